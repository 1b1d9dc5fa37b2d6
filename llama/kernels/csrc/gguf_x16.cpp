// Products with GGUF block weights and activations quantized to int16 in blocks of 32 (each block scaled by its own
// largest magnitude): the weight codes are widened to int16 in registers and multiplied with one vpmaddwd per 16
// values, where the fp32 path (gguf_float.cpp) converts every code to fp32 first. The result is the quantized
// activations' product with the dequantized weights, to fp32 rounding, offsets included. A long prompt's rows take
// gguf_float.cpp's fp32 GEMM instead (llama/kernels/cpu.py).
//
// Why: on AVX2 the fp32 path is compute-bound (about 8 products per ns per core on SmolLM2's shapes), and llama.cpp's
// int8 activations, which are faster, make small models answer worse (docs/performance.md, "Quality of the default
// arithmetic"). 16-bit activations err by at most 2^-16 of their block's largest value, 256 times less than int8's,
// and the products are summed exactly in int32, so the model stays at the fp32 path's distance from the dequantized
// file (measured there) at int arithmetic's speed.
//
// Exactness: a row's activations are quantized alone, and every output (row m, column n) is summed by the same
// operations in the same order whether its row goes alone or beside another, so a row's result never depends on the
// other rows of its batch or on the thread split (tests/kernels/test_gguf_x16.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "check.h"
#include "ops.h"
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#pragma GCC target("f16c")  // every AVX2 CPU has F16C (llama/kernels/cpu.py requires it)

namespace {

#include "gguf_format.h"
#include "gguf_simd.h"

// Activation rows quantized per 32 values: q = round(x / scale), scale = max |x| / 32767 (0 for a block of zeros),
// and each block's sum scale * (sum of q) (for the formats' offsets), and where asked the sums of its values 0-15
// (half0) and 16-31 (half1) alike (Q6_K's, whose scales go per 16 values): the products are exactly those of the
// activations q * scale.
struct Acts {
  std::vector<int16_t> q;
  std::vector<float> scale, sum, half0, half1;
};

// spread: each block's codes in the order [0-7 16-23 | 8-15 24-31], the order in which AVX2's in-lane byte unpacking
// widens 32 bytes of codes (Q4_K's and Q6_K's chunks), where the natural order would take lane-crossing widenings.
Acts quantize(const float* x, int64_t M, int64_t K, bool spread, bool halves) {
  const int64_t blocks = M * (K / 32);
  Acts a{std::vector<int16_t>(M * K), std::vector<float>(blocks), std::vector<float>(blocks),
         std::vector<float>(halves ? blocks : 0), std::vector<float>(halves ? blocks : 0)};
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t c = 0; c < blocks; ++c) {
    const float* xp = x + 32 * c;
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xp + 8 * i), amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, amax);
    float m = 0.f;
    for (float l : lanes) m = l > m ? l : m;
    int nan = 0;
    for (int i = 0; i < 4; ++i) nan |= _mm256_movemask_ps(_mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
    // an inf or NaN activation makes the block's products NaN
    const float scale = nan || !std::isfinite(m) ? NAN : m / 32767.f;
    const __m256 inv = _mm256_set1_ps(m > 0.f && std::isfinite(m) ? 32767.f / m : 0.f);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // nearest, ties to even
    alignas(32) int32_t total[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(total),
                       _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    int64_t codes = 0;  // 64 bits: a NaN's code is INT32_MIN (the block's results are NaN anyway)
    for (int32_t t : total) codes += t;
    a.scale[c] = scale;
    a.sum[c] = scale * float(codes);  // finite blocks: |codes| < 2^20, so float(codes) is exact
    if (halves) {  // 32-bit lanes wrap only for NaN blocks, whose sums are NaN through their scale
      a.half0[c] = scale * float(hsum_i32(_mm256_add_epi32(q[0], q[1])));
      a.half1[c] = scale * float(hsum_i32(_mm256_add_epi32(q[2], q[3])));
    }
    // packs works within 128-bit lanes: [0-3 8-11 4-7 12-15] -> put the 64-bit quarters back in order
    const __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[spread ? 2 : 1]), 0xD8);
    const __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[spread ? 1 : 2], q[3]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.q.data() + 32 * c), lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.q.data() + 32 * c + 16), hi);
  }
  return a;
}

// A 32-value block of a weight row as int16 codes: values 0-15 in w[0], 16-31 in w[1], with its scale and an offset
// per unit of the activations' sum: value = scale * code + offset. (Q4_K and Q6_K go a super-block at a time:
// ksuper_dot.)
struct Chunk {
  __m256i w[2];
  float scale, offset;
};

// 16 bytes of nibbles -> low nibbles (values 0-15) and high nibbles (16-31) as int16
LLAMA_INLINE void nibbles16(const uint8_t* qs, Chunk& c) {
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  const __m256i m = _mm256_set1_epi16(0x0F);
  c.w[0] = _mm256_and_si256(bytes, m), c.w[1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), m);
}

// Q5_0 and Q5_1: the fifth bits (bit j of qh for value j) added to the nibbles as 16
LLAMA_INLINE void fifth_bits(const uint8_t* qh, Chunk& c) {
  uint32_t h;
  std::memcpy(&h, qh, 4);
  const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, -32768);
  const __m256i sixteen = _mm256_set1_epi16(16);
  for (int half = 0; half < 2; ++half) {
    const __m256i bits = _mm256_and_si256(_mm256_set1_epi16(int16_t(h >> (16 * half))), bit);
    c.w[half] = _mm256_or_si256(c.w[half], _mm256_and_si256(_mm256_cmpeq_epi16(bits, bit), sixteen));
  }
}

LLAMA_INLINE void signed16(__m128i lo, __m128i hi, Chunk& c) {
  c.w[0] = _mm256_cvtepi8_epi16(lo), c.w[1] = _mm256_cvtepi8_epi16(hi);
}

// the formats with an offset (value = scale * code + offset), multiplied by the activations' exact block sums
constexpr bool has_offset(int64_t type) { return type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1; }

template <int64_t TYPE>
LLAMA_INLINE void chunk_of(const uint8_t* b, Chunk& c) {
  switch (TYPE) {
    case Q4_0: {
      const float d = half_f16c(b);
      nibbles16(b + 2, c);
      c.scale = d, c.offset = -8.f * d;
      return;
    }
    case Q4_1:
      nibbles16(b + 4, c);
      c.scale = half_f16c(b), c.offset = half_f16c(b + 2);
      return;
    case Q5_0: {  // d (q - 16), q = nibble | fifth bit << 4
      const float d = half_f16c(b);
      nibbles16(b + 6, c);
      fifth_bits(b + 2, c);
      c.scale = d, c.offset = -16.f * d;
      return;
    }
    case Q5_1:
      nibbles16(b + 8, c);
      fifth_bits(b + 4, c);
      c.scale = half_f16c(b), c.offset = half_f16c(b + 2);
      return;
    case Q8_0: {
      const __m128i* q = reinterpret_cast<const __m128i*>(b + 2);
      signed16(_mm_loadu_si128(q), _mm_loadu_si128(q + 1), c);
      c.scale = half_f16c(b), c.offset = 0.f;
      return;
    }
    case IQ4_NL: {
      __m128i lo, hi;
      iq4_values16(b + 2, lo, hi);
      signed16(lo, hi, c);
      c.scale = half_f16c(b), c.offset = 0.f;
      return;
    }
  }
}

template <int64_t TYPE, int MR>
struct Chains {
  __m256 acc[MR];
  float off[MR];

  // block t of the row into these sums
  LLAMA_INLINE void add(const uint8_t* row, const Format& f, int64_t K, int64_t t, const int16_t* q,
                        const float* scale, const float* sum) {
    const int64_t kb = K / 32;
    Chunk c;
    chunk_of<TYPE>(row + t * f.bytes, c);
    for (int i = 0; i < MR; ++i) {
      const __m256i* xq = reinterpret_cast<const __m256i*>(q + i * K + 32 * t);
      const __m256i p0 = _mm256_madd_epi16(c.w[0], _mm256_loadu_si256(xq));
      const __m256i p1 = _mm256_madd_epi16(c.w[1], _mm256_loadu_si256(xq + 1));
      const float xs = scale[i * kb + t];
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)), _mm256_set1_ps(c.scale * xs), acc[i]);
      if (has_offset(TYPE)) off[i] += c.offset * sum[i * kb + t];
    }
  }
};

// One weight row's products with MR quantized activation rows (row i: codes q + i K, block scales and sums at i K /
// 32): out[i * out_stride]. Each row's sum takes the same operations in the same order whatever MR is: each block's
// exact int32 sums, times its scale and the activation block's scale, into one of two 8-lane chains (even and odd
// blocks, so an FMA need not wait for the one before), and the offsets into two scalars.
template <int64_t TYPE, int MR>
void row_dot(const uint8_t* row, const Format& f, int64_t K, const int16_t* q, const float* scale, const float* sum,
             float* out, int64_t out_stride) {
  Chains<TYPE, MR> even, odd;
  for (int i = 0; i < MR; ++i) even.acc[i] = odd.acc[i] = _mm256_setzero_ps(), even.off[i] = odd.off[i] = 0.f;
  const int64_t chunks = K / 32;
  int64_t t = 0;
  for (; t + 2 <= chunks; t += 2) {
    even.add(row, f, K, t, q, scale, sum);
    odd.add(row, f, K, t + 1, q, scale, sum);
  }
  if (t < chunks) even.add(row, f, K, t, q, scale, sum);
  for (int i = 0; i < MR; ++i)
    out[i * out_stride] = hsum(_mm256_add_ps(even.acc[i], odd.acc[i])) + (even.off[i] + odd.off[i]);
}

// Q4_K's 6-bit scales (bytes 0-7) and mins (8-15) of a block's 12 bytes (gguf_format.h), built in registers: through
// memory, the 16-byte load would wait on smaller stores.
LLAMA_INLINE __m128i scales_mins_k4(const uint8_t* s) {
  uint32_t w[4];
  scale_min_k4_words(s, w);
  return _mm_setr_epi32(int(w[0]), int(w[1]), int(w[2]), int(w[3]));
}

// Q4_K and Q6_K a super-block (256 values, 8 chunks) at a time: its scales are decoded once, as vectors, and each
// chunk's combined scale (weight scale times activation block scale) is read from a small table, where decoding them
// a chunk at a time cost more than the products (about 3x the bytes' time on AVX2). Each chunk's sums go into an even
// or odd chain by its index, as row_dot's; the offsets (Q4_K's mins, Q6_K's bias of 32) are summed 8 blocks to a
// vector, then across its lanes.
template <int64_t TYPE, int MR>
void ksuper_dot(const uint8_t* row, int64_t K, const int16_t* q, const float* scale, const float* sum,
                const float* half0, const float* half1, float* out, int64_t out_stride) {
  constexpr int64_t bytes = TYPE == Q4_K ? 144 : 210;
  const int64_t kb = K / 32;
  __m256 even[MR], odd[MR], off[MR];
  for (int i = 0; i < MR; ++i) even[i] = odd[i] = off[i] = _mm256_setzero_ps();
  const __m256i nib = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
  alignas(32) float comb[MR][2][8];  // [row][half (Q6_K's two scales a chunk)][chunk]
  for (int64_t s = 0; s < K / 256; ++s) {
    const uint8_t* b = row + s * bytes;
    const int16_t* xq = q + 256 * s;
    if constexpr (TYPE == Q4_K) {
      const __m128i raw = scales_mins_k4(b + 4);
      const __m256 ws = _mm256_mul_ps(_mm256_set1_ps(half_f16c(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(raw)));
      const __m256 wm = _mm256_mul_ps(_mm256_set1_ps(half_f16c(b + 2)),
                                      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8))));
      for (int i = 0; i < MR; ++i) {
        _mm256_store_ps(comb[i][0], _mm256_mul_ps(ws, _mm256_loadu_ps(scale + i * kb + 8 * s)));
        off[i] = _mm256_sub_ps(off[i], _mm256_mul_ps(wm, _mm256_loadu_ps(sum + i * kb + 8 * s)));
      }
      for (int p = 0; p < 4; ++p) {  // the 32 bytes of chunks 2p (low nibbles) and 2p + 1 (high)
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * p));
        const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        // the activations are spread (quantize): values [0-7 16-23] and [8-15 24-31] of each chunk
        const __m256i w0 = _mm256_unpacklo_epi8(lo, zero), w1 = _mm256_unpackhi_epi8(lo, zero);
        const __m256i w2 = _mm256_unpacklo_epi8(hi, zero), w3 = _mm256_unpackhi_epi8(hi, zero);
        for (int i = 0; i < MR; ++i) {
          const __m256i* x = reinterpret_cast<const __m256i*>(xq + i * K + 64 * p);
          const __m256i a = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(x)),
                                             _mm256_madd_epi16(w1, _mm256_loadu_si256(x + 1)));
          even[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_broadcast_ss(&comb[i][0][2 * p]), even[i]);
          const __m256i c = _mm256_add_epi32(_mm256_madd_epi16(w2, _mm256_loadu_si256(x + 2)),
                                             _mm256_madd_epi16(w3, _mm256_loadu_si256(x + 3)));
          odd[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), _mm256_broadcast_ss(&comb[i][0][2 * p + 1]), odd[i]);
        }
      }
    } else {
      // Q6_K: chunk j = 4 h + part, its codes unsigned (0-63) against spread activations, so a chunk's int32 sums
      // hold its values 0-15 in lanes 0-3 (scaled by d sc[2j]) and 16-31 in lanes 4-7 (d sc[2j + 1]): one
      // conversion and one FMA a chunk. The codes' bias of 32 comes off through the activations' half-block sums.
      const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
      const __m128i split = _mm_shuffle_epi8(sc, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
      const __m256 d = _mm256_set1_ps(half_f16c(b + 208)), bias = _mm256_set1_ps(-32.f);
      const __m256 s0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(split)));
      const __m256 s1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(split, 8))));
      const __m256 b0 = _mm256_mul_ps(bias, s0), b1 = _mm256_mul_ps(bias, s1);
      for (int i = 0; i < MR; ++i) {
        const __m256 xs = _mm256_loadu_ps(scale + i * kb + 8 * s);
        _mm256_store_ps(comb[i][0], _mm256_mul_ps(s0, xs));
        _mm256_store_ps(comb[i][1], _mm256_mul_ps(s1, xs));
        off[i] = _mm256_fmadd_ps(b0, _mm256_loadu_ps(half0 + i * kb + 8 * s), off[i]);
        off[i] = _mm256_fmadd_ps(b1, _mm256_loadu_ps(half1 + i * kb + 8 * s), off[i]);
      }
      const __m256i two = _mm256_set1_epi8(0x30);
      for (int h = 0; h < 2; ++h) {
        const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h));
        const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32));
        const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
        const __m256i parts[4] = {
            _mm256_or_si256(_mm256_and_si256(l0, nib), _mm256_and_si256(_mm256_slli_epi16(hb, 4), two)),
            _mm256_or_si256(_mm256_and_si256(l1, nib), _mm256_and_si256(_mm256_slli_epi16(hb, 2), two)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), nib), _mm256_and_si256(hb, two)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), nib),
                            _mm256_and_si256(_mm256_srli_epi16(hb, 2), two))};
        for (int part = 0; part < 4; ++part) {
          const int j = 4 * h + part;
          const __m256i w0 = _mm256_unpacklo_epi8(parts[part], zero), w1 = _mm256_unpackhi_epi8(parts[part], zero);
          for (int i = 0; i < MR; ++i) {
            const __m256i* x = reinterpret_cast<const __m256i*>(xq + i * K + 32 * j);
            const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(x)),
                                               _mm256_madd_epi16(w1, _mm256_loadu_si256(x + 1)));
            const __m256 scales = _mm256_set_m128(_mm_broadcast_ss(&comb[i][1][j]), _mm_broadcast_ss(&comb[i][0][j]));
            __m256& acc = j % 2 ? odd[i] : even[i];
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scales, acc);
          }
        }
      }
    }
  }
  for (int i = 0; i < MR; ++i) out[i * out_stride] = hsum(_mm256_add_ps(even[i], odd[i])) + hsum(off[i]);
}

// y[:, n0:n1] for every activation row, two rows at a time through each weight row.
template <int64_t TYPE>
void rows_of(const uint8_t* wp, int64_t row_bytes, const Format& f, int64_t M, int64_t K, int64_t N, const Acts& a,
             float* yp, int64_t n0, int64_t n1) {
  const int64_t kb = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = wp + n * row_bytes;
    int64_t m = 0;
    if constexpr (TYPE == Q4_K || TYPE == Q6_K) {
      const int64_t halves = TYPE == Q6_K ? kb : 0;  // Q4_K's activations have no half sums
      for (; m + 2 <= M; m += 2)
        ksuper_dot<TYPE, 2>(row, K, a.q.data() + m * K, a.scale.data() + m * kb, a.sum.data() + m * kb,
                            a.half0.data() + m * halves, a.half1.data() + m * halves, yp + m * N + n, N);
      if (m < M)
        ksuper_dot<TYPE, 1>(row, K, a.q.data() + m * K, a.scale.data() + m * kb, a.sum.data() + m * kb,
                            a.half0.data() + m * halves, a.half1.data() + m * halves, yp + m * N + n, N);
      continue;
    }
    for (; m + 2 <= M; m += 2)
      row_dot<TYPE, 2>(row, f, K, a.q.data() + m * K, a.scale.data() + m * kb, a.sum.data() + m * kb, yp + m * N + n, N);
    if (m < M)
      row_dot<TYPE, 1>(row, f, K, a.q.data() + m * K, a.scale.data() + m * kb, a.sum.data() + m * kb, yp + m * N + n, N);
  }
}

using RowsFn = void (*)(const uint8_t*, int64_t, const Format&, int64_t, int64_t, int64_t, const Acts&, float*,
                        int64_t, int64_t);

RowsFn rows_fn(int64_t type) {
  switch (type) {
    case Q4_0: return rows_of<Q4_0>;
    case Q4_1: return rows_of<Q4_1>;
    case Q5_0: return rows_of<Q5_0>;
    case Q5_1: return rows_of<Q5_1>;
    case Q8_0: return rows_of<Q8_0>;
    case IQ4_NL: return rows_of<IQ4_NL>;
    case Q4_K: return rows_of<Q4_K>;
    case Q6_K: return rows_of<Q6_K>;
    default: return nullptr;
  }
}

}  // namespace

namespace llama_cpu {

// x (M, K) fp32 times the GGUF weight w (N, row bytes) of ggml type `type`, with x quantized to int16 blocks of 32:
// y (M, N) fp32. The formats without an int16 decoding here (rows_fn) run gguf_linear_float's fp32 arithmetic.
at::Tensor gguf_linear_x16(const at::Tensor& x, const at::Tensor& w, int64_t type) {
  const RowsFn fn = rows_fn(type);
  if (fn == nullptr) return gguf_linear_float(x, w, type);
  Format f;
  format_of(type, f);
  LLAMA_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "gguf_linear_x16: x must be a contiguous 2-d float32 tensor");
  LLAMA_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "gguf_linear_x16: the weight must be a contiguous 2-d uint8 tensor");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), row_bytes = w.size(1);
  LLAMA_CHECK(K % f.values == 0 && row_bytes == K / f.values * f.bytes, "gguf_linear_x16: x has ", K,
              " inputs, the weight rows ", row_bytes, " bytes of blocks of ", f.values);
  LLAMA_CHECK(__builtin_cpu_supports("f16c"), "gguf_linear_x16: the CPU lacks F16C");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const Acts a = quantize(x.data_ptr<float>(), M, K, type == Q4_K || type == Q6_K, type == Q6_K);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { fn(wp, row_bytes, f, M, K, N, a, yp, n0, n1); });
  return y;
}

}  // namespace llama_cpu

TORCH_LIBRARY_FRAGMENT(llama_cpu, m) { m.def("gguf_linear_x16(Tensor x, Tensor weight, int type) -> Tensor"); }

TORCH_LIBRARY_IMPL(llama_cpu, CPU, m) { m.impl("gguf_linear_x16", llama_cpu::gguf_linear_x16); }
