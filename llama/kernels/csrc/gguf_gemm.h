// The many-row GGUF product's inner loops (gguf_gemm.cpp), included twice (no include guard) as gguf_dot.h is: once
// as namespace `avx2`, once as `vnni` under `#pragma GCC target` with GGUF_VNNI defined, where the compiler also has
// 32 vector registers and the tile is twice as tall. Both compute every (row, output) from the same int32 lanes
// with the same fp32 operations in the same order as gguf_dot.h's block_dot and linear_rows (gguf_copies.h;
// the helpers they share are gguf_simd.h's).

// How a block's int32 lanes reach the fp32 sums, as block_dot does per format: LANES: acc = fma(lanes, d * dx, acc);
// LANE0: the lanes' total by one fma into lane 0 of acc (Q4_K, Q2_K: llama.cpp's repacked layouts); Q6: LANES less
// Q6_K's offsets per lane, 32 * (bsum * scale) of two groups.
enum Sum { LANES, LANE0, Q6 };

#ifdef GGUF_VNNI
constexpr int kRows = 4;  // rows x columns of one tile: its int32 and fp32 accumulators stay in registers
#else
constexpr int kRows = 2;
#endif
constexpr int kCols = 2;

// isum += the 8 int32 lanes of 32 weight codes w times 32 activation codes x (lane i: values 4i .. 4i + 3), each
// pair of products times its int16 weight in sc (the code's scale), as block_dot's dot_scaled sums them. SIGNED
// codes multiply as |w| * (x with w's sign).
template <bool SIGNED>
inline __m256i lanes(__m256i isum, __m256i u, __m256i w, __m256i x, const int16_t* sc) {
  const __m256i xs = SIGNED ? _mm256_sign_epi8(x, w) : x;
#ifdef GGUF_VNNI
  return _mm256_dpwssd_epi32(isum, _mm256_maddubs_epi16(u, xs), load32(sc));
#else
  return _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(u, xs), load32(sc)));
#endif
}


// y[m][n] = hsum(acc) + y[m][n] (y holds the scalar part, acc1) for rows m0 .. m0 + MB and panel columns n0 .. n0 + NB:
// per block, the int32 lanes, then the fp32 steps of SUM, as linear_rows does for one (row, output).
template <bool SIGNED, Sum SUM, int MB, int NB>
void tile(const Gemm& g, const Panel& p, int64_t m0, int64_t n0, float* y) {
  constexpr int CH = 8;  // 32-value chunks per 256-value block
  __m256 acc[MB][NB];
  float one[MB][NB];  // LANE0: the per-block fma chain
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps(), one[i][j] = 0.f;
  for (int64_t kb = 0; kb < g.nb; ++kb) {
    __m256i isum[MB][NB];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) isum[i][j] = _mm256_setzero_si256();
    const int8_t* x = g.xq + m0 * g.K + kb * 32 * CH;
    const uint8_t* w = p.codes.data() + (kb * p.nt + n0) * 32 * CH;
    const int16_t* s = p.scales.data() + (kb * p.nt + n0) * CH * 16;
#pragma GCC unroll 8
    for (int c = 0; c < CH; ++c) {
      __m256i xv[MB];
      for (int i = 0; i < MB; ++i) xv[i] = load32(x + i * g.K + 32 * c);
      for (int j = 0; j < NB; ++j) {
        const __m256i wv = load32(w + (j * CH + c) * 32);
        const __m256i u = SIGNED ? _mm256_sign_epi8(wv, wv) : wv;
        for (int i = 0; i < MB; ++i)
          isum[i][j] = lanes<SIGNED>(isum[i][j], u, wv, xv[i], s + (j * CH + c) * 16);
      }
    }
    for (int i = 0; i < MB; ++i) {  // d * dx in every lane: the one-row loop's scalar product, broadcast
      const __m256 dx = _mm256_broadcast_ss(g.xd + (m0 + i) * g.nb + kb);
      for (int j = 0; j < NB; ++j) {
        const __m256 dd = _mm256_mul_ps(_mm256_broadcast_ss(p.d.data() + kb * p.nt + n0 + j), dx);
        if constexpr (SUM == LANE0) {
          one[i][j] = std::fma(float(hsum_i32(isum[i][j])), _mm256_cvtss_f32(dd), one[i][j]);
        } else {
          __m256i lanes_ = isum[i][j];
          if constexpr (SUM == Q6)
            lanes_ = _mm256_sub_epi32(lanes_, q6k_lane_offsets(g.s16 + ((m0 + i) * g.nb + kb) * 16,
                                                               load32(p.sc16.data() + (kb * p.nt + n0 + j) * 16)));
          acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes_), dd, acc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      float& out = y[(m0 + i) * g.N + p.n0 + n0 + j];
      // LANE0: acc is (one, 0, ..., 0), whose hsum is one
      out = SUM == LANE0 ? one[i][j] + out : hsum(acc[i][j]) + out;
    }
}

// The panel's columns for rows m0 .. m1: whole tiles, then the remaining rows and columns one at a time.
template <bool SIGNED, Sum SUM = LANES>
void panel_rows(const Gemm& g, const Panel& p, int64_t m0, int64_t m1, float* y) {
  int64_t m = m0;
  for (; m + kRows <= m1; m += kRows) {
    int64_t n = 0;
    for (; n + kCols <= p.nt; n += kCols) tile<SIGNED, SUM, kRows, kCols>(g, p, m, n, y);
    for (; n < p.nt; ++n) tile<SIGNED, SUM, kRows, 1>(g, p, m, n, y);
  }
  for (; m < m1; ++m)
    for (int64_t n = 0; n < p.nt; ++n) tile<SIGNED, SUM, 1, 1>(g, p, m, n, y);
}

// The integer products of the panel with rows m0 .. m1 (after corrections() wrote the scalar parts into y).
inline void products(int64_t type, const Gemm& g, const Panel& p, int64_t m0, int64_t m1, float* y) {
  switch (type) {
    case IQ4_XS: case Q3_K: panel_rows<true>(g, p, m0, m1, y); break;
    case Q4_K: case Q2_K: panel_rows<false, LANE0>(g, p, m0, m1, y); break;
    case Q6_K: panel_rows<false, Q6>(g, p, m0, m1, y); break;
    default: panel_rows<false>(g, p, m0, m1, y); break;  // Q5_K
  }
}
