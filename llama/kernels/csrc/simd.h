// Helpers shared by llama's CPU kernels (cpu_kernels.cpp: matrix products; decode_ops.cpp: a decode step's small
// operators): bf16 <-> fp32 and vector sums, AVX2 + FMA.
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace llama_cpu {

inline float bf16_to_float(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Scalar loads and stores in the activations' dtype (fp32, or bf16 as raw 16-bit words).
inline float load_f(const float* p) { return *p; }
inline float load_f(const uint16_t* p) { return bf16_to_float(*p); }
inline void store_f(float* p, float v) { *p = v; }
inline void store_f(uint16_t* p, float v) {  // round to nearest even, as PyTorch converts to bf16
  uint32_t u;
  std::memcpy(&u, &v, 4);
  *p = std::isnan(v) ? uint16_t(0x7FC0) : uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

}  // namespace llama_cpu
