// What gguf_blocks.cpp and gguf_gemm.cpp share about GGUF's block formats: the ggml type ids, values and bytes
// per block, and the scale unpacking of the K- and i-quants. Included inside each file's anonymous namespace.
#pragma once

// ggml's type ids (gguf.GGMLQuantizationType)
enum : int64_t {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
  IQ4_NL = 20, IQ4_XS = 23
};
// Q4_K with its rows repacked 8 at a time (gguf_x8.h): not a ggml type, our kernels' own id for that layout
constexpr int64_t kX8 = 0x100, Q4_K_X8 = kX8 | Q4_K;

// gguf_rows.h's formats: their products of 2 rows or more share each weight block's unpacking across kShareRows
// rows at a time (gguf_gemm does not take them: with K = 576 to 2048 its panels cost 2x to 3x as much at 9 to 64
// rows, docs/performance.md)
constexpr int64_t kShareRows = 8;
constexpr bool shares_rows(int64_t type) {
  return type == Q8_0 || type == Q4_0 || type == IQ4_NL || type == Q4_1 || type == Q5_0 || type == Q5_1;
}

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
    case Q4_K: case Q4_K_X8: f = {256, 144, 256}; return true;
    case Q5_K: f = {256, 176, 256}; return true;
    case Q6_K: f = {256, 210, 256}; return true;
    case Q2_K: f = {256, 84, 256}; return true;
    case Q3_K: f = {256, 110, 256}; return true;
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

// Q4_K / Q5_K: the 8 sub-blocks' 6-bit scales and mins from their 12 bytes (gguf's Q4_K.get_scale_min), four at a
// time in 32-bit words as llama.cpp unpacks them: w[0], w[1] the scales 0-3 and 4-7, w[2], w[3] the mins.
inline void scale_min_k4_words(const uint8_t* s, uint32_t* w) {
  uint32_t u[3];
  std::memcpy(u, s, 12);
  const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
  w[0] = u[0] & low6;
  w[1] = (u[2] & low4) | (((u[0] >> 6) & low2) << 4);
  w[2] = u[1] & low6;
  w[3] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4);
}
// The same as bytes: sc[0..7] and m[0..7].
inline void scale_min_k4(const uint8_t* s, uint8_t* sc, uint8_t* m) {
  uint32_t w[4];
  scale_min_k4_words(s, w);
  std::memcpy(sc, w, 8);
  std::memcpy(m, w + 2, 8);
}

// IQ4_XS: sub-block j's scale (6 bits, minus 32).
inline int iq4xs_scale(const uint8_t* b, int j) {
  uint16_t h;
  std::memcpy(&h, b + 2, 2);
  const int lo = (b[4 + j / 2] >> (4 * (j % 2))) & 0x0F, hi = (h >> (2 * j)) & 3;
  return (lo | (hi << 4)) - 32;
}

// Q3_K: the 16 groups' 6-bit scales (minus 32) from their 12 bytes (gguf's Q3_K: low 4 bits in bytes 0-7, two
// high bits in bytes 8-11).
inline void q3k_scales(const uint8_t* s, int16_t* sc) {
  for (int j = 0; j < 16; ++j) {
    const int low = (j < 8 ? s[j] : s[j - 8] >> 4) & 0x0F, high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
    sc[j] = int16_t((low | (high << 4)) - 32);
  }
}
