// The int8 product's tiles (int8_linear in cpu_kernels.cpp, which includes this file inside its anonymous namespace,
// after Blocks, kBlock, prefetch, dot_u8_s8, LLAMA_AVX512 and int4_tiles.h).
//
// On AVX-512 VNNI, rows of 8-block multiples run "transposed", as int4's (int4_tiles.h): the weights of 16 blocks
// are shuffled once, shared by every row of the tile, so that each 32-bit lane of the integer dot products holds
// one block, and a row pays only its loads and vpdpbusd plus one conversion and one fma per 16 blocks (instead of
// a sign flip, conversion, permute and fma per block pair), so a row takes one register and a tile 8 rows.
// vpdpbusd multiplies unsigned by signed bytes: the weights go in as w + 128 (w ^ 0x80), and each block's integer
// total starts from -128 * (sum of the row's codes in the block), so every total is the exact sum of w * x. The
// activation codes are stored in the shuffled order (int8_slots) and their scales in the lanes' (LaneRows). A
// row's fp32 sums run in the same order whatever the tile, so its result never depends on the other rows of its
// batch.
#pragma once

// Where the 32 elements of block b of a row of nb blocks (a multiple of 8) are stored in it. A group of 16 blocks
// is 8 vectors of 64 bytes, vector k holding elements 4k .. 4k + 3 of each block, block 8 (q / 2) + 2 r + q % 2 in
// 32-bit lane 4 q + r (rows16's order). A last group of 8 blocks is 4 vectors, vector i holding elements 4 i ..
// 4 i + 3 (h = 0) and 16 + 4 i .. (h = 1) of block 2 r + L in lane 4 (2 L + h) + r (rows8's order).
inline void int8_slots(int64_t nb, int64_t b, int64_t slot[32]) {
  const int64_t g0 = b / 16 * 16, j = b - g0;
  for (int64_t e = 0; e < 32; ++e) {
    if (g0 + 16 <= nb) {
      const int64_t q = 2 * (j / 8) + j % 2, r = (j % 8) / 2;
      slot[e] = g0 * kBlock + 64 * (e / 4) + 4 * (4 * q + r) + e % 4;
    } else {
      const int64_t lane = 4 * (2 * (j % 2) + e / 16) + j / 2;
      slot[e] = g0 * kBlock + 64 * ((e / 4) % 4) + 4 * lane + e % 4;
    }
  }
}

// Each row's block scales d and integer offsets -128 * (sum of the block's codes) in the lanes of int8_slots'
// groups: 16 lanes per group of 16 blocks and per last group of 8 (whose blocks take two lanes each: d in both,
// the offset in the first).
struct LaneRows {
  int64_t stride;  // lanes per row
  aligned_vector<float> d;
  aligned_vector<int32_t> offset;
};

LaneRows lane_rows(const Blocks& xb, int64_t M, int64_t nb) {
  const int64_t groups = (nb + 15) / 16, stride = groups * 16;
  LaneRows out{stride, aligned_vector<float>(M * stride), aligned_vector<int32_t>(M * stride)};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g0 = 0; g0 < nb; g0 += 16)
      for (int64_t lane = 0; lane < 16; ++lane) {
        const int64_t q = lane / 4, r = lane % 4;
        const bool whole = g0 + 16 <= nb, first = whole || q % 2 == 0;
        const int64_t b = m * nb + g0 + (whole ? 8 * (q / 2) + 2 * r + q % 2 : 2 * r + q / 2);
        out.d[m * stride + g0 + lane] = xb.d[b];
        out.offset[m * stride + g0 + lane] = first ? -128 * xb.total[b] : 0;
      }
  return out;
}

// A 4 x 4 transpose of 32-bit words in each 128-bit lane: t[i] holds word i of a[0 .. 3].
LLAMA_AVX512 inline void transpose4(const __m512i a[4], __m512i t[4]) {
  const __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpackhi_epi32(a[0], a[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(a[2], a[3]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
  t[0] = _mm512_unpacklo_epi64(t0, t2), t[1] = _mm512_unpackhi_epi64(t0, t2);
  t[2] = _mm512_unpacklo_epi64(t1, t3), t[3] = _mm512_unpackhi_epi64(t1, t3);
}

// 4 vectors of weights (8 blocks) as w + 128, transposed.
LLAMA_AVX512 inline void rows8(const int8_t* w, __m512i t[4]) {
  __m512i a[4];
  for (int i = 0; i < 4; ++i) a[i] = _mm512_xor_si512(_mm512_loadu_si512(w + 64 * i), _mm512_set1_epi8(-128));
  transpose4(a, t);
}

// 16 blocks of weights as the 8 vectors of int8_slots' order: two rows8, then 128-bit lanes 0 and 2 (words 0-3
// of their blocks) of each pair, and 1 and 3 (words 4-7).
LLAMA_AVX512 inline void rows16(const int8_t* w, __m512i out[8]) {
  __m512i lo[4], hi[4];
  rows8(w, lo);
  rows8(w + 256, hi);
  for (int i = 0; i < 4; ++i) {
    out[i] = _mm512_shuffle_i64x2(lo[i], hi[i], _MM_SHUFFLE(2, 0, 2, 0));
    out[i + 4] = _mm512_shuffle_i64x2(lo[i], hi[i], _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// Blocks [b0, b1) (16-block groups) of one output row for rows m0 .. m0 + T of x, added into acc (a register a
// row, a lane a block); then, with last, the row's last 8 blocks.
template <int T>
LLAMA_AVX512 inline void q8_span_vnni(const Blocks& xb, const LaneRows& lr, int64_t m0, int64_t K, const int8_t* wr,
                                      int64_t b0, int64_t b1, bool last, __m512 acc[T]) {
  for (int64_t b16 = b0; b16 < b1; b16 += 16) {
    if (T > 1)  // one row of x: the hardware prefetcher alone is faster (bf16_tile_dot's note)
      for (int p = 0; p < 512; p += 64) prefetch(wr + b16 * kBlock + p);
    __m512i w[8];
    rows16(wr + b16 * kBlock, w);
    for (int t = 0; t < T; ++t) {
      const int8_t* xq = xb.q.data() + (m0 + t) * K + b16 * kBlock;
      const int64_t l = (m0 + t) * lr.stride + b16;
      __m512i a = _mm512_loadu_si512(lr.offset.data() + l), b = _mm512_setzero_si512();
      for (int u = 0; u < 8; u += 2) {
        a = _mm512_dpbusd_epi32(a, w[u], _mm512_loadu_si512(xq + 64 * u));
        b = _mm512_dpbusd_epi32(b, w[u + 1], _mm512_loadu_si512(xq + 64 * u + 64));
      }
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a, b)), _mm512_loadu_ps(lr.d.data() + l), acc[t]);
    }
  }
  if (!last) return;
  __m512i w[4];
  rows8(wr + b1 * kBlock, w);
  for (int t = 0; t < T; ++t) {
    const int8_t* xq = xb.q.data() + (m0 + t) * K + b1 * kBlock;
    const int64_t l = (m0 + t) * lr.stride + b1;
    __m512i a = _mm512_loadu_si512(lr.offset.data() + l), b = _mm512_setzero_si512();
    a = _mm512_dpbusd_epi32(a, w[0], _mm512_loadu_si512(xq));
    b = _mm512_dpbusd_epi32(b, w[1], _mm512_loadu_si512(xq + 64));
    a = _mm512_dpbusd_epi32(a, w[2], _mm512_loadu_si512(xq + 128));
    b = _mm512_dpbusd_epi32(b, w[3], _mm512_loadu_si512(xq + 192));
    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a, b)), _mm512_loadu_ps(lr.d.data() + l), acc[t]);
  }
}

// Rows [n0, n1) of y for rows m0 .. m0 + T of x (up to 8), int8 weights with one scale per output row, rows of
// 8-block multiples, x's codes in int8_slots' order. Long rows go kSpanBlocks blocks at a time over kSpanRows
// output rows (int4_tiles.h's q4_tile_vnni: the tile's activation codes for a span stay in L1); a lane's fp32 sums
// run in the same order either way, and whatever T.
template <int T>
LLAMA_AVX512 void q8_tile_vnni(const Blocks& xb, const LaneRows& lr, int64_t m0, int64_t K, int64_t N,
                               const int8_t* weight, const float* scales, int64_t n0, int64_t n1, float* y) {
  const int64_t nb = K / kBlock, whole = nb / 16 * 16;
  for (int64_t r0 = n0; r0 < n1; r0 += kSpanRows) {
    const int64_t r1 = std::min(n1, r0 + kSpanRows);
    __m512 acc[kSpanRows][T];
    for (int64_t r = 0; r < r1 - r0; ++r)
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < whole || (b0 == 0 && whole < nb); b0 += kSpanBlocks) {
      const int64_t b1 = std::min(whole, b0 + kSpanBlocks);
      for (int64_t n = r0; n < r1; ++n) q8_span_vnni<T>(xb, lr, m0, K, weight + n * K, b0, b1, b1 == whole && whole < nb, acc[n - r0]);
    }
    for (int64_t n = r0; n < r1; ++n)
      for (int t = 0; t < T; ++t) y[(m0 + t) * N + n] = _mm512_reduce_add_ps(acc[n - r0][t]) * scales[n];
  }
}

// Rows [n0, n1) of y for rows m0 .. m0 + T of x (AVX2): int8 weights with one scale per output row, x's codes in
// their plain order.
template <int T>
void q8_tile(const Blocks& xb, int64_t m0, int64_t K, int64_t N, const int8_t* weight, const float* scales,
             int64_t n0, int64_t n1, float* y) {
  const int64_t nb = K / kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = weight + n * K;
    __m256 acc[T][2];
    for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      prefetch(wr + b * kBlock);
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + b * kBlock));
      const __m256i aw = _mm256_sign_epi8(w, w);  // |w|, with the sign moved onto x: |w| * (x * sign(w))
      for (int t = 0; t < T; ++t) {
        const int64_t i = (m0 + t) * nb + b;
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.q.data() + i * kBlock));
        const __m256 p = _mm256_cvtepi32_ps(dot_u8_s8(aw, _mm256_sign_epi8(xv, w)));
        acc[t][b & 1] = _mm256_fmadd_ps(p, _mm256_set1_ps(xb.d[i]), acc[t][b & 1]);
      }
    }
    for (int t = 0; t < T; ++t) y[(m0 + t) * N + n] = hsum(_mm256_add_ps(acc[t][0], acc[t][1])) * scales[n];
  }
}
