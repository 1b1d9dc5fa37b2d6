// The AVX2 helpers that the GGUF block kernels share (gguf_dot.h one row, gguf_gemm.h many rows, gguf_float.cpp's
// fp32 and gguf_x16.cpp's int16 activations), defined once per file: the AVX-512 VNNI copies inline them as they
// are, so both copies and every kernel run the same operations. Included inside each file's anonymous namespace,
// after gguf_format.h.
#pragma once

#ifndef LLAMA_INLINE
#define LLAMA_INLINE inline __attribute__((always_inline))
#endif

// An fp16 scale as fp32 in one op (every AVX2 CPU has F16C: llama/kernels/cpu.py requires it).
__attribute__((target("f16c"))) inline float half_f16c(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void store32(void* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }

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
// IQ4_NL / IQ4_XS: 4-bit codes to their non-linear values
inline __m256i iq4_lookup(__m256i codes) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4));
  return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), codes);
}
// IQ4_NL's 16 bytes of 4-bit codes as their non-linear values: values 0-15 (low nibbles) in lo, 16-31 in hi
LLAMA_INLINE void iq4_values16(const uint8_t* p, __m128i& lo, __m128i& hi) {
  const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4)), m = _mm_set1_epi8(0x0F);
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  lo = _mm_shuffle_epi8(table, _mm_and_si128(raw, m));
  hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(raw, 4), m));
}
// The sum of 8 fp32 lanes, always added in this order
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// The sum of 8 int32 lanes (exact)
inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}
// Q6_K's offset per int32 lane as llama.cpp's AVX2 dot subtracts it, from a block's 16-value sums s16 (int32) and
// its 16 group scales sc16 (int16): lane k = 32 * (s16[2k] * sc[2k] + s16[2k + 1] * sc[2k + 1]) (the sums fit
// int16, as q8_K's bsums do).
inline __m256i q6k_lane_offsets(const int32_t* s16, __m256i sc16) {
  const __m256i bs = _mm256_permute4x64_epi64(_mm256_packs_epi32(load32(s16), load32(s16 + 8)), 0xD8);
  return _mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), 5);
}
