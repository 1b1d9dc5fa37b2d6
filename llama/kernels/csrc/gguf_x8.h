// Q4_K repacked 8 rows at a time (type Q4_K_X8): the layout, and the conversions to and from the file's blocks.
// Included inside gguf_blocks.cpp's and gguf_gemm.cpp's anonymous namespaces, after gguf_format.h.
//
// Why: the one-row Q4_K product (gguf_dot.h) unpacks each block's 6-bit scales and reduces its integer lanes to one
// sum per block, for every row on its own. With 8 rows' blocks side by side, one activation load feeds 8 rows, the
// scales of 8 rows unpack in a few vector operations, and the 8 rows' block sums land in the 8 lanes of one vector:
// no reduction per block (llama.cpp's repacked q4_K_8x8 does the same with its own layout).
//
// The layout keeps the file's size: a matrix (N, row bytes) of nb blocks a row holds floor(N / 8) groups of 8 rows,
// then the N % 8 last rows as the file has them. Group g's block kb is the 1152 bytes (8 blocks of 144) at
// g * 8 * row bytes + kb * 1152:
//   [0, 16)      d of rows 0..7 (fp16), [16, 32) dmin of rows 0..7
//   [32, 96)     Q: byte k's low nibble is the low 4 bits of value k, its high nibble those of value 64 + k
//   [96, 128)    H: byte k's bits 2t, 2t + 1 are the high 2 bits of value 32 t + k (t = 0..3)
//                values 0..63: scale of sub-block j of row r at j * 8 + r; values 64..127: min of sub-block
//                2 p + i of row r at 64 + p * 16 + r * 2 + i (the order the products unpack them in)
//   [128, 1152)  codes: 16 chunks of 64 bytes, chunk 4 p + c holding bytes 8 c .. 8 c + 7 of each row's 32 bytes of
//                sub-blocks 2 p (low nibbles) and 2 p + 1 (high), row r at 8 r
// Every field is the file's bits moved, so the conversion back gives the file's bytes exactly.
#pragma once

constexpr int64_t kX8Rows = 8, kX8Bytes = 8 * 144;

// Row n's block kb of a Q4_K_X8 matrix w (N rows, nb blocks a row) as the file holds it: a pointer into w for the
// rows past the last group, else rebuilt into out (144 bytes).
inline const uint8_t* x8_block(const uint8_t* w, int64_t N, int64_t nb, int64_t n, int64_t kb, uint8_t* out) {
  const int64_t row_bytes = nb * 144;
  if (n >= N / kX8Rows * kX8Rows) return w + n * row_bytes + kb * 144;
  const int r = int(n % kX8Rows);
  const uint8_t* b = w + (n / kX8Rows) * kX8Rows * row_bytes + kb * kX8Bytes;
  std::memcpy(out, b + 2 * r, 2), std::memcpy(out + 2, b + 16 + 2 * r, 2);
  uint8_t v[128];  // the 6-bit values in the layout's order
  for (int k = 0; k < 128; ++k)
    v[k] = uint8_t(((b[32 + k % 64] >> (4 * (k / 64))) & 0x0F) | (((b[96 + k % 32] >> (2 * (k / 32))) & 3) << 4));
  uint8_t sc[8], m[8];
  for (int j = 0; j < 8; ++j) sc[j] = v[j * 8 + r], m[j] = v[64 + (j / 2) * 16 + r * 2 + j % 2];
  uint8_t* s = out + 4;  // inverse of scale_min_k4: 6 bits of j < 4 in bytes j and j + 4, 4 + 4 bits in byte j + 8
  for (int j = 0; j < 4; ++j) {
    s[j] = uint8_t(sc[j] | ((sc[j + 4] >> 4) << 6));
    s[j + 4] = uint8_t(m[j] | ((m[j + 4] >> 4) << 6));
    s[j + 8] = uint8_t((sc[j + 4] & 0x0F) | ((m[j + 4] & 0x0F) << 4));
  }
  for (int p = 0; p < 4; ++p)
    for (int c = 0; c < 4; ++c) std::memcpy(out + 16 + 32 * p + 8 * c, b + 128 + (4 * p + c) * 64 + 8 * r, 8);
  return out;
}

// The 8 file blocks src[r] (row r's block kb) as one group block dst (kX8Bytes).
inline void x8_pack(const uint8_t* const* src, uint8_t* dst) {
  uint8_t v[128];
  for (int r = 0; r < 8; ++r) {
    const uint8_t* b = src[r];
    std::memcpy(dst + 2 * r, b, 2), std::memcpy(dst + 16 + 2 * r, b + 2, 2);
    uint8_t sc[8], m[8];
    scale_min_k4(b + 4, sc, m);
    for (int j = 0; j < 8; ++j) v[j * 8 + r] = sc[j], v[64 + (j / 2) * 16 + r * 2 + j % 2] = m[j];
    for (int p = 0; p < 4; ++p)
      for (int c = 0; c < 4; ++c) std::memcpy(dst + 128 + (4 * p + c) * 64 + 8 * r, b + 16 + 32 * p + 8 * c, 8);
  }
  for (int k = 0; k < 64; ++k) dst[32 + k] = uint8_t((v[k] & 0x0F) | ((v[64 + k] & 0x0F) << 4));
  for (int k = 0; k < 32; ++k) {
    uint8_t h = 0;
    for (int t = 0; t < 4; ++t) h = uint8_t(h | ((v[32 * t + k] >> 4) << (2 * t)));
    dst[96 + k] = h;
  }
}

// w (N, nb blocks of Q4_K) into out in the Q4_K_X8 layout, or back (to_x8 false: w is Q4_K_X8, out the file's).
// Groups are independent: callers may split the rows among threads on multiples of 8.
inline void x8_convert(const uint8_t* w, uint8_t* out, int64_t N, int64_t nb, int64_t g0, int64_t g1, bool to_x8) {
  const int64_t row_bytes = nb * 144;
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t kb = 0; kb < nb; ++kb) {
      if (to_x8) {
        const uint8_t* src[8];
        for (int r = 0; r < 8; ++r) src[r] = w + (g * 8 + r) * row_bytes + kb * 144;
        x8_pack(src, out + g * 8 * row_bytes + kb * kX8Bytes);
      } else {
        for (int r = 0; r < 8; ++r) {
          uint8_t* dst = out + (g * 8 + r) * row_bytes + kb * 144;
          const uint8_t* b = x8_block(w, N, nb, g * 8 + r, kb, dst);
          if (b != dst) std::memcpy(dst, b, 144);
        }
      }
    }
}
