// Products with weights in GGUF's own block formats (llama.cpp's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, and the
// 256-value super-blocks Q4_K, Q5_K, Q6_K, IQ4_XS), read as the file holds them: a weight matrix is (N, row bytes)
// of the file's blocks, each row the blocks of one output row (llama/quantization/gguf_blocks.py).
//
// Activations are quantized to int8 as llama.cpp's own CPU kernels do it, with its roundings (quantize_block):
// blocks of 32 for the 32-value formats (its q8_0, and q8_1's fp16 sums for Q4_1 and Q5_1's mins), and blocks of 256
// for the super-block formats (symmetric, d = amax / 127; not yet its q8_K). Every integer sum is exact, and the fp32
// products of the scales follow, so a product equals (the weights as gguf's dequantize gives them) x (the
// dequantized activation codes; for the mins, q8_1's sums) to fp32 rounding. A row's result
// never depends on the other rows of its batch: each (row, output) is summed by the same code in the same order.
// AVX2 everywhere; on CPUs with AVX-512 VNNI (and LLAMA_CPU_AVX512 not "0") the integer sums of the main formats use
// vpdpbusd (the same integers, so the same results).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <vector>

namespace {

// ggml's type ids (gguf.GGMLQuantizationType)
enum : int64_t {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
  IQ4_NL = 20, IQ4_XS = 23
};

struct Format {
  int64_t values, bytes, act_block;  // values and bytes per weight block; activation block size
};

bool format_of(int64_t type, Format& f) {
  switch (type) {
    case Q8_0: f = {32, 34, 32}; return true;
    case Q4_0: f = {32, 18, 32}; return true;
    case Q4_1: f = {32, 20, 32}; return true;
    case Q5_0: f = {32, 22, 32}; return true;
    case Q5_1: f = {32, 24, 32}; return true;
    case IQ4_NL: f = {32, 18, 32}; return true;
    case Q4_K: f = {256, 144, 256}; return true;
    case Q5_K: f = {256, 176, 256}; return true;
    case Q6_K: f = {256, 210, 256}; return true;
    case IQ4_XS: f = {256, 136, 256}; return true;
    default: return false;
  }
}

const int8_t kIQ4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  uint32_t u;
  if (exp == 0) {
    const float f = std::ldexp(float(mant), -24);  // zero or subnormal: exact
    return sign ? -f : f;
  }
  u = exp == 31 ? sign | 0x7F800000u | (mant << 13) : sign | ((exp + 112) << 23) | (mant << 13);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Q4_K / Q5_K: the 8 sub-blocks' 6-bit scales and mins from their 12 bytes (gguf's Q4_K.get_scale_min).
inline void scale_min_k4(const uint8_t* s, uint8_t* sc, uint8_t* m) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63, m[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
    m[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

// IQ4_XS: sub-block j's scale (6 bits, minus 32).
inline int iq4xs_scale(const uint8_t* b, int j) {
  uint16_t h;
  std::memcpy(&h, b + 2, 2);
  const int lo = (b[4 + j / 2] >> (4 * (j % 2))) & 0x0F, hi = (h >> (2 * j)) & 3;
  return (lo | (hi << 4)) - 32;
}

// ---- dequantization: one block into out, with the operations (and roundings) of gguf's numpy code ----

void dequantize_block(int64_t type, const uint8_t* b, float* out) {
  switch (type) {
    case Q8_0: {
      const float d = half_to_float(b);
      for (int i = 0; i < 32; ++i) out[i] = float(int8_t(b[2 + i])) * d;
      return;
    }
    case Q4_0: case IQ4_NL: {
      const float d = half_to_float(b);
      for (int i = 0; i < 16; ++i) {
        const int lo = b[2 + i] & 0x0F, hi = b[2 + i] >> 4;
        out[i] = d * float(type == Q4_0 ? lo - 8 : kIQ4[lo]);
        out[i + 16] = d * float(type == Q4_0 ? hi - 8 : kIQ4[hi]);
      }
      return;
    }
    case Q4_1: {
      const float d = half_to_float(b), m = half_to_float(b + 2);
      for (int i = 0; i < 16; ++i) out[i] = d * float(b[4 + i] & 0x0F) + m, out[i + 16] = d * float(b[4 + i] >> 4) + m;
      return;
    }
    case Q5_0: case Q5_1: {
      const bool one = type == Q5_1;
      const float d = half_to_float(b), m = one ? half_to_float(b + 2) : 0.f;
      uint32_t qh;
      std::memcpy(&qh, b + (one ? 4 : 2), 4);
      const uint8_t* qs = b + (one ? 8 : 6);
      for (int i = 0; i < 32; ++i) {
        const int q = (i < 16 ? qs[i] & 0x0F : qs[i - 16] >> 4) | (((qh >> i) & 1) << 4);
        out[i] = one ? d * float(q) + m : d * float(q - 16);
      }
      return;
    }
    case Q4_K: case Q5_K: {
      const float d = half_to_float(b), dmin = half_to_float(b + 2);
      uint8_t sc[8], m[8];
      scale_min_k4(b + 4, sc, m);
      const uint8_t* qh = b + 16;
      const uint8_t* qs = type == Q4_K ? b + 16 : b + 48;
      for (int j = 0; j < 8; ++j) {
        const float ds = d * float(sc[j]), dm = dmin * float(m[j]);
        for (int l = 0; l < 32; ++l) {
          int q = (qs[(j / 2) * 32 + l] >> (4 * (j % 2))) & 0x0F;
          if (type == Q5_K) q |= ((qh[l] >> j) & 1) << 4;
          out[j * 32 + l] = ds * float(q) - dm;
        }
      }
      return;
    }
    case Q6_K: {
      const uint8_t *ql = b, *qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = half_to_float(b + 208);
      for (int i = 0; i < 256; ++i) {
        const int h = i / 128, r = i % 128, part = r / 32, l = r % 32;  // part: ql low/low/high/high of 2 halves
        const int low = (ql[64 * h + l + 32 * (part % 2)] >> (4 * (part / 2))) & 0x0F;
        const int high = (qh[32 * h + l] >> (2 * part)) & 3;
        out[i] = (d * float(sc[i / 16])) * float((low | (high << 4)) - 32);
      }
      return;
    }
    case IQ4_XS: {
      const float d = half_to_float(b);
      for (int j = 0; j < 8; ++j) {
        const float dl = d * float(iq4xs_scale(b, j));
        for (int i = 0; i < 16; ++i) {
          const uint8_t q = b[8 + 16 * j + i];
          out[32 * j + i] = dl * float(kIQ4[q & 0x0F]), out[32 * j + i + 16] = dl * float(kIQ4[q >> 4]);
        }
      }
      return;
    }
  }
}

// ---- activations ----

// fp32 to fp16 and back, rounding to nearest even (F16C's _cvtss_sh, which ggml's GGML_FP32_TO_FP16 uses)
inline float round_to_half(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = u & 0x80000000u, a = u & 0x7FFFFFFFu;
  uint16_t h;
  if (a >= 0x7F800000u) {
    h = uint16_t(sign >> 16 | (a > 0x7F800000u ? 0x7E00u : 0x7C00u));
  } else if (a >= 0x477FF000u) {  // rounds past the largest half
    h = uint16_t(sign >> 16 | 0x7C00u);
  } else if (a < 0x38800000u) {  // subnormal half (or zero): a multiple of 2^-24, rounded to even by nearbyint
    float v;
    std::memcpy(&v, &a, 4);
    h = uint16_t(sign >> 16 | uint32_t(std::nearbyint(v * 16777216.f)));
  } else {
    const uint32_t m = a + 0xFFFu + ((a >> 13) & 1u);  // round to nearest even at bit 13
    h = uint16_t(sign >> 16 | ((m - 0x38000000u) >> 13));
  }
  uint8_t b[2];
  std::memcpy(b, &h, 2);
  return half_to_float(b);
}

struct Act {
  std::vector<int8_t> q;     // (M, K) codes
  std::vector<float> d;      // (M, K / block) scales
  std::vector<int32_t> s16;  // (M, K / 16) sums of 16 codes
  std::vector<float> s;      // (M, K / 32) llama.cpp's q8_1 sums: d * (sum of the block's codes), rounded to fp16
};

// One block as llama.cpp's CPU backend quantizes it. Blocks of 32 (its q8_0 and q8_1): d = amax / 127 kept as
// fp16, codes round(x * (127 / amax)) to nearest even, s = d * sum rounded to fp16 (d before its rounding).
// Blocks of 256: d = amax / 127 in fp32, codes round(x / d) (not yet llama.cpp's q8_K, whose d = 1 / (-127 / max)
// moved a Q4_K_M SmolLM2's greedy answer off "Paris": tests/formats/test_gguf_blocks_real.py).
inline void quantize_block(const float* v, int64_t block, int8_t* q, float& d, float& s) {
  if (block == 32) {
    float amax = 0.f;
    for (int64_t j = 0; j < block; ++j) amax = std::fmax(amax, std::fabs(v[j]));
    const float d32 = amax / 127.f, id = amax != 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int64_t j = 0; j < block; ++j) q[j] = int8_t(int32_t(std::nearbyint(v[j] * id))), sum += q[j];
    d = round_to_half(d32), s = round_to_half(d32 * float(sum));
    return;
  }
  float amax = 0.f;  // blocks of 256: d = amax / 127, codes round(x / d) (llama.cpp's q8_K is not followed yet)
  for (int64_t j = 0; j < block; ++j) amax = std::fmax(amax, std::fabs(v[j]));
  d = amax / 127.f, s = 0.f;
  for (int64_t j = 0; j < block; ++j) q[j] = int8_t(d > 0.f ? int32_t(std::nearbyint(v[j] / d)) : 0);
}

Act quantize_act(const float* x, int64_t M, int64_t K, int64_t block) {
  const int64_t nb = K / block;
  Act a{std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<int32_t>(M * K / 16),
        std::vector<float>(block == 32 ? M * nb : 0)};
  at::parallel_for(0, M * nb, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int8_t* q = a.q.data() + i * block;
      float s;
      quantize_block(x + i * block, block, q, a.d[i], s);
      if (block == 32) a.s[i] = s;
      for (int64_t j = 0; j < block; j += 16) {
        int32_t t = 0;
        for (int k = 0; k < 16; ++k) t += q[j + k];
        a.s16[(i * block + j) / 16] = t;
      }
    }
  });
  return a;
}

// ---- AVX2 integer dot products ----

inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 32 unsigned codes (at most 127) times 32 signed codes, summed in pairs then fours with the 16-bit weights in
// `scale` (one int16 per pair of products' lane): 8 int32 lanes.
inline __m256i dot_scaled(__m256i u, __m256i s, __m256i scale) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scale);
}
inline __m256i dot_us(__m256i u, __m256i s) { return dot_scaled(u, s, _mm256_set1_epi16(1)); }
// signed weights w (|w| <= 127, or -128) times signed codes x: |w| * (x with w's sign)
inline __m256i dot_ss(__m256i w, __m256i x) { return dot_us(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)); }

// 16 bytes of nibbles as 32 bytes: low nibbles (elements 0..15), then high (16..31)
inline __m256i nibbles_split(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}
// 32 bits as 32 bytes, 0x10 where the bit is set (llama.cpp's bytes_from_bits_32)
inline __m256i bits_to_16(const uint8_t* p) {
  uint32_t x;
  std::memcpy(&x, p, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(int32_t(x)), shuf);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}
inline __m256i iq4_lookup(__m256i codes) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4));
  return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), codes);
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One weight block (b) times activation codes xq with scale dx (and 16-sums s16): adds the product into acc (vector
// part) and acc1 (scalar part: the offsets and mins, exact integers times one scale).
template <int64_t TYPE>
inline void block_dot(const uint8_t* b, const int8_t* xq, float dx, const int32_t* s16, float xsum, __m256& acc,
                      float& acc1) {
  if constexpr (TYPE == Q8_0) {
    const __m256i p = dot_ss(load32(b + 2), load32(xq));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(half_to_float(b) * dx), acc);
  } else if constexpr (TYPE == IQ4_NL) {
    const __m256i p = dot_ss(iq4_lookup(nibbles_split(b + 2)), load32(xq));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(half_to_float(b) * dx), acc);
  } else if constexpr (TYPE == Q4_0 || TYPE == Q4_1) {
    const __m256i p = dot_us(nibbles_split(b + (TYPE == Q4_0 ? 2 : 4)), load32(xq));
    const float dd = half_to_float(b) * dx;
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dd), acc);
    const int32_t xs = s16[0] + s16[1];
    acc1 += TYPE == Q4_0 ? float(-8 * xs) * dd : half_to_float(b + 2) * xsum;
  } else if constexpr (TYPE == Q5_0 || TYPE == Q5_1) {
    const int64_t h = TYPE == Q5_0 ? 2 : 4;
    const __m256i w = _mm256_or_si256(nibbles_split(b + h + 4), bits_to_16(b + h));
    const __m256i p = dot_us(w, load32(xq));
    const float dd = half_to_float(b) * dx;
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dd), acc);
    const int32_t xs = s16[0] + s16[1];
    acc1 += TYPE == Q5_0 ? float(-16 * xs) * dd : half_to_float(b + 2) * xsum;
  } else if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
    uint8_t sc[8], m[8];
    scale_min_k4(b + 4, sc, m);
    const uint8_t* qs = b + (TYPE == Q4_K ? 16 : 48);
    const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    const __m256i qh = TYPE == Q5_K ? load32(b + 16) : _mm256_setzero_si256();
    __m256i isum = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i raw = load32(qs + 32 * j);
      __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
      if constexpr (TYPE == Q5_K) {
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), one), 4));
      }
      isum = _mm256_add_epi32(isum, dot_scaled(lo, load32(xq + 64 * j), _mm256_set1_epi16(sc[2 * j])));
      isum = _mm256_add_epi32(isum, dot_scaled(hi, load32(xq + 64 * j + 32), _mm256_set1_epi16(sc[2 * j + 1])));
    }
    int32_t msum = 0;
    for (int j = 0; j < 8; ++j) msum += int32_t(m[j]) * (s16[2 * j] + s16[2 * j + 1]);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(half_to_float(b) * dx), acc);
    acc1 -= float(msum) * (half_to_float(b + 2) * dx);
  } else if constexpr (TYPE == Q6_K) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const __m256i low4 = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
    __m256i isum = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = load32(b + 64 * h), l1 = load32(b + 64 * h + 32), hb = load32(b + 128 + 32 * h);
      __m256i q[4] = {_mm256_and_si256(l0, low4), _mm256_and_si256(l1, low4),
                      _mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(_mm256_srli_epi16(l1, 4), low4)};
      for (int i = 0; i < 4; ++i) {
        const __m256i high = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * i), three), 4);
        const __m256i scale = _mm256_set_m128i(_mm_set1_epi16(sc[8 * h + 2 * i + 1]), _mm_set1_epi16(sc[8 * h + 2 * i]));
        isum = _mm256_add_epi32(isum, dot_scaled(_mm256_or_si256(q[i], high), load32(xq + 128 * h + 32 * i), scale));
      }
    }
    int32_t corr = 0;
    for (int i = 0; i < 16; ++i) corr += int32_t(sc[i]) * s16[i];
    const float dd = half_to_float(b + 208) * dx;
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(dd), acc);
    acc1 += float(-32 * corr) * dd;
  } else if constexpr (TYPE == IQ4_XS) {
    __m256i isum = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      const __m256i p = dot_ss(iq4_lookup(nibbles_split(b + 8 + 16 * j)), load32(xq + 32 * j));
      isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(p, _mm256_set1_epi32(iq4xs_scale(b, j))));
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(half_to_float(b) * dx), acc);
  }
}

template <int64_t TYPE>
void linear_rows(const Act& a, const uint8_t* w, const Format& f, int64_t M, int64_t K, int64_t N, float* y) {
  const int64_t nblocks = K / f.values, row_bytes = nblocks * f.bytes;
  const int64_t grain = std::max<int64_t>(1, 64 / std::max<int64_t>(M, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wr = w + n * row_bytes;
      for (int64_t m = 0; m < M; ++m) {
        __m256 acc = _mm256_setzero_ps();
        float acc1 = 0.f;
        for (int64_t i = 0; i < nblocks; ++i) {
          _mm_prefetch(reinterpret_cast<const char*>(wr + i * f.bytes) + 1024, _MM_HINT_T0);
          const int64_t k = i * f.values;
          block_dot<TYPE>(wr + i * f.bytes, a.q.data() + m * K + k, a.d[(m * K + k) / f.act_block],
                          a.s16.data() + (m * K + k) / 16, a.s.empty() ? 0.f : a.s[(m * K + k) / 32], acc, acc1);
        }
        y[m * N + n] = hsum(acc) + acc1;
      }
    }
  });
}

}  // namespace

namespace llama_cpu {

// x (M, K) fp32 times the GGUF weight w (N, row bytes) of ggml type `type`: y (M, N) fp32.
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& w, int64_t type) {
  Format f;
  TORCH_CHECK(format_of(type, f), "gguf_linear: ggml type ", type, " is not run natively");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "gguf_linear: x must be a contiguous 2-d float32 tensor");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "gguf_linear: the weight must be a contiguous 2-d uint8 tensor");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % f.values == 0 && w.size(1) == K / f.values * f.bytes, "gguf_linear: x has ", K,
              " inputs, the weight rows ", w.size(1), " bytes of blocks of ", f.values);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const Act a = quantize_act(x.data_ptr<float>(), M, K, f.act_block);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  switch (type) {
#define CASE(T) case T: linear_rows<T>(a, wp, f, M, K, N, yp); break;
    CASE(Q8_0) CASE(Q4_0) CASE(Q4_1) CASE(Q5_0) CASE(Q5_1) CASE(IQ4_NL) CASE(Q4_K) CASE(Q5_K) CASE(Q6_K) CASE(IQ4_XS)
#undef CASE
  }
  return y;
}

// Rows `ids` of the GGUF matrix w (N, row bytes), dequantized to fp32 (an embedding lookup reads only these rows).
at::Tensor gguf_rows(const at::Tensor& w, const at::Tensor& ids, int64_t type) {
  Format f;
  TORCH_CHECK(format_of(type, f), "gguf_rows: ggml type ", type, " is not run natively");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "gguf_rows: the weight must be a contiguous 2-d uint8 tensor");
  TORCH_CHECK(w.size(1) % f.bytes == 0, "gguf_rows: rows of ", w.size(1), " bytes are not whole blocks");
  const at::Tensor idx = ids.to(at::kLong).contiguous();
  const int64_t R = idx.numel(), nb = w.size(1) / f.bytes, K = nb * f.values, N = w.size(0);
  at::Tensor out = at::empty({R, K}, w.options().dtype(at::kFloat));
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(ip[r] >= 0 && ip[r] < N, "gguf_rows: row ", ip[r], " of ", N);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R * nb, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / nb, blk = i % nb;
      dequantize_block(type, wp + ip[r] * w.size(1) + blk * f.bytes, op + r * K + blk * f.values);
    }
  });
  return out;
}

}  // namespace llama_cpu

TORCH_LIBRARY_FRAGMENT(llama_cpu, m) {
  m.def("gguf_linear(Tensor x, Tensor weight, int type) -> Tensor");
  m.def("gguf_rows(Tensor weight, Tensor ids, int type) -> Tensor");
}

TORCH_LIBRARY_IMPL(llama_cpu, CPU, m) {
  m.impl("gguf_linear", llama_cpu::gguf_linear);
  m.impl("gguf_rows", llama_cpu::gguf_rows);
}
