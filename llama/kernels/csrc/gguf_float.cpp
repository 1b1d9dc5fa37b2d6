// Products with GGUF block weights and fp32 activations: each weight row's blocks are unpacked to fp32 in a small
// buffer that stays in cache (L1/L2), then multiplied by the activations in fp32. Nothing is quantized on the
// activation side, so the result is the dequantized file's product to fp32 rounding.
//
// Why: llama.cpp's CPU arithmetic (gguf_blocks.cpp, int8 activation blocks) answers wrongly at near-ties on small
// models: SmolLM2-135M Q4_1 answers "What is the capital of France?" with nonsense while the same file dequantized
// says Paris (docs/performance.md, "Quality of the default arithmetic"). This is the default; int8 activations stay
// available (LLAMA_GGUF_ACTIVATIONS=int8).
//
// Exactness: every output (row m, column n) is summed by one 8-lane fp32 accumulator over k in order, then reduced
// in a fixed order, whatever the tile it was computed in, so a row's result never depends on the other rows of its
// batch or on the thread split (tests/kernels/test_gguf_float.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "check.h"
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

#include "gguf_format.h"
#include "gguf_x8.h"

}  // namespace

namespace llama_cpu {
void gguf_dequantize_block(int64_t type, const uint8_t* b, float* out);  // gguf_blocks.cpp (scalar, every type)
}

namespace {

inline __m256 cvt_u8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); }  // low 8 bytes
inline __m256 cvt_i8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)); }

// 16 unsigned 4-bit codes' low and high nibbles (values 0-15 then 16-31 of a 32-value block) as fp32, times d plus
// bias: out[0..31].
inline void nibbles16(__m128i raw, __m256 d, __m256 bias, float* out) {
  const __m128i m = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(raw, m), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m);
  _mm256_storeu_ps(out, _mm256_fmadd_ps(cvt_u8(lo), d, bias));
  _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(cvt_u8(_mm_srli_si128(lo, 8)), d, bias));
  _mm256_storeu_ps(out + 16, _mm256_fmadd_ps(cvt_u8(hi), d, bias));
  _mm256_storeu_ps(out + 24, _mm256_fmadd_ps(cvt_u8(_mm_srli_si128(hi, 8)), d, bias));
}

// 32 codes in 32 bytes (one per byte, already reduced), as (code + add) * scale: 8 values per store.
inline void bytes32_signed(__m256i q, const float* scales16, float* out) {
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  const __m256 s0 = _mm256_set1_ps(scales16[0]), s1 = _mm256_set1_ps(scales16[1]);
  _mm256_storeu_ps(out, _mm256_mul_ps(cvt_i8(lo), s0));
  _mm256_storeu_ps(out + 8, _mm256_mul_ps(cvt_i8(_mm_srli_si128(lo, 8)), s0));
  _mm256_storeu_ps(out + 16, _mm256_mul_ps(cvt_i8(hi), s1));
  _mm256_storeu_ps(out + 24, _mm256_mul_ps(cvt_i8(_mm_srli_si128(hi, 8)), s1));
}

void unpack_q4k(const uint8_t* b, float* out) {
  const float d = half_to_float(b), dmin = half_to_float(b + 2);
  uint8_t sc[8], mn[8];
  scale_min_k4(b + 4, sc, mn);
  const __m256i m = _mm256_set1_epi8(0x0F);
  for (int p = 0; p < 4; ++p) {  // 32 bytes: sub-block 2p in the low nibbles, 2p + 1 in the high ones
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * p));
    for (int half = 0; half < 2; ++half) {
      const int j = 2 * p + half;
      const __m256i q = _mm256_and_si256(half ? _mm256_srli_epi16(raw, 4) : raw, m);
      const __m256 ds = _mm256_set1_ps(d * float(sc[j])), dm = _mm256_set1_ps(-(dmin * float(mn[j])));
      const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
      float* o = out + 32 * j;
      _mm256_storeu_ps(o, _mm256_fmadd_ps(cvt_u8(lo), ds, dm));
      _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(cvt_u8(_mm_srli_si128(lo, 8)), ds, dm));
      _mm256_storeu_ps(o + 16, _mm256_fmadd_ps(cvt_u8(hi), ds, dm));
      _mm256_storeu_ps(o + 24, _mm256_fmadd_ps(cvt_u8(_mm_srli_si128(hi, 8)), ds, dm));
    }
  }
}

void unpack_q6k(const uint8_t* b, float* out) {
  const uint8_t *ql = b, *qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_to_float(b + 208);
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3), k32 = _mm256_set1_epi8(32);
  for (int h = 0; h < 2; ++h) {
    const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * h));
    for (int part = 0; part < 4; ++part) {  // values 128h + 32 part .. + 31
      const __m256i lowsrc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * h + 32 * (part % 2)));
      const __m256i low = _mm256_and_si256(part / 2 ? _mm256_srli_epi16(lowsrc, 4) : lowsrc, m4);
      const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(high, 2 * part), m2);
      const __m256i q = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(hb, 4)), k32);
      const int i = 128 * h + 32 * part;
      const float scales[2] = {d * float(sc[i / 16]), d * float(sc[i / 16 + 1])};
      bytes32_signed(q, scales, out + i);
    }
  }
}

// One block of `type` into out (its values as fp32): vector code for the formats most files hold, the scalar
// dequantization (gguf_blocks.cpp) for the rest.
void unpack_block(int64_t type, const uint8_t* b, float* out) {
  switch (type) {
    case Q4_0: {
      const float d = half_to_float(b);
      nibbles16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)), _mm256_set1_ps(d), _mm256_set1_ps(-8.f * d),
                out);
      return;
    }
    case Q4_1:
      nibbles16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4)), _mm256_set1_ps(half_to_float(b)),
                _mm256_set1_ps(half_to_float(b + 2)), out);
      return;
    case Q8_0: {
      const __m256 d = _mm256_set1_ps(half_to_float(b));
      for (int i = 0; i < 32; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(cvt_i8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + i))), d));
      return;
    }
    case Q4_K: unpack_q4k(b, out); return;
    case Q6_K: unpack_q6k(b, out); return;
    default: llama_cpu::gguf_dequantize_block(type, b, out);
  }
}

// Row n of w (nb blocks) unpacked to fp32 in out; Q4_K_X8's blocks are found in their 8-row groups.
void unpack_row(int64_t type, const uint8_t* w, int64_t N, int64_t row_bytes, const Format& f, int64_t n, float* out) {
  const int64_t nb = row_bytes / f.bytes;
  for (int64_t blk = 0; blk < nb; ++blk) {
    if (type == Q4_K_X8) {
      uint8_t block[144];
      unpack_block(Q4_K, x8_block(w, N, nb, n, blk, block), out + blk * f.values);
    } else {
      unpack_block(type, w + n * row_bytes + blk * f.bytes, out + blk * f.values);
    }
  }
}

// The 8 lanes' sum in a fixed order.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// y[m, n] for MR activation rows and NR unpacked weight rows: one accumulator per output, k in order.
template <int MR, int NR>
void tile(const float* const* w, const float* x, int64_t K, float* y, int64_t N) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm256_loadu_ps(w[j] + k);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(wv[j], xv, acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * N + j] = hsum(acc[i][j]);
}

template <int NR>
void rows_tile(const float* const* w, const float* x, int64_t M, int64_t K, float* y, int64_t N) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) tile<2, NR>(w, x + m * K, K, y + m * N, N);
  if (m < M) tile<1, NR>(w, x + m * K, K, y + m * N, N);
}

}  // namespace

namespace llama_cpu {

// x (M, K) fp32 times the GGUF weight w (N, row bytes) of ggml type `type`, unpacked to fp32: y (M, N) fp32.
at::Tensor gguf_linear_float(const at::Tensor& x, const at::Tensor& w, int64_t type) {
  Format f;
  LLAMA_CHECK(format_of(type, f), "gguf_linear_float: ggml type ", type, " is not run natively");
  LLAMA_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "gguf_linear_float: x must be a contiguous 2-d float32 tensor");
  LLAMA_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "gguf_linear_float: the weight must be a contiguous 2-d uint8 tensor");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), row_bytes = w.size(1);
  LLAMA_CHECK(K % f.values == 0 && row_bytes == K / f.values * f.bytes, "gguf_linear_float: x has ", K,
              " inputs, the weight rows ", row_bytes, " bytes of blocks of ", f.values);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  constexpr int64_t NR = 4;
  at::parallel_for(0, (N + NR - 1) / NR, 4, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf(NR * K);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * NR, nr = std::min(NR, N - n0);
      const float* rows[NR];
      for (int64_t j = 0; j < nr; ++j) {
        unpack_row(type, wp, N, row_bytes, f, n0 + j, buf.data() + j * K);
        rows[j] = buf.data() + j * K;
      }
      float* out = yp + n0;
      switch (nr) {
        case 4: rows_tile<4>(rows, xp, M, K, out, N); break;
        case 3: rows_tile<3>(rows, xp, M, K, out, N); break;
        case 2: rows_tile<2>(rows, xp, M, K, out, N); break;
        default: rows_tile<1>(rows, xp, M, K, out, N);
      }
    }
  });
  return y;
}

}  // namespace llama_cpu

TORCH_LIBRARY_FRAGMENT(llama_cpu, m) { m.def("gguf_linear_float(Tensor x, Tensor weight, int type) -> Tensor"); }

TORCH_LIBRARY_IMPL(llama_cpu, CPU, m) { m.impl("gguf_linear_float", llama_cpu::gguf_linear_float); }
