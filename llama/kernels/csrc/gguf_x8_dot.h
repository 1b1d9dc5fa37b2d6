// The Q4_K_X8 product's inner loop (gguf_x8.h's layout), included at the end of gguf_dot.h: compiled as its AVX2
// copy and its AVX-512 VNNI copy. Per 8-row group and block it computes each row's integer sums, the same integers
// as block_dot<Q4_K> (sum_j sc[j] * (codes of sub-block j . x), and sum_j m[j] * (sum of sub-block j's x codes)),
// and then the same fp32 operations in the same order, lane r for row r: acc = fma(float(total), d * dx, acc) and
// acc1 = fma(-float(msum), dmin * dx, acc1) per block, y = acc + acc1. So its results are block_dot's bit for bit.

// 8 fp16 values to fp32, exactly (the AVX2 copy without F16C: the bits moved, subnormals as integer * 2^-24)
inline __m256 halves8(const uint8_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
#ifdef GGUF_VNNI
  return _mm256_cvtph_ps(h);
#else
  const __m256i v = _mm256_cvtepu16_epi32(h), em = _mm256_and_si256(v, _mm256_set1_epi32(0x7FFF));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x8000)), 16);
  const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(em, 13), _mm256_set1_epi32(112 << 23));
  const __m256i special = _mm256_or_si256(_mm256_slli_epi32(em, 13), _mm256_set1_epi32(0x7F800000));
  const __m256i small = _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(0x1p-24f)));
  __m256i bits = _mm256_blendv_epi8(normal, small, _mm256_cmpgt_epi32(_mm256_set1_epi32(0x400), em));
  bits = _mm256_blendv_epi8(bits, special, _mm256_cmpgt_epi32(em, _mm256_set1_epi32(0x7BFF)));
  return _mm256_castsi256_ps(_mm256_or_si256(bits, sign));
#endif
}

#ifdef GGUF_VNNI
// The word permutations spreading sub-block j's 8 scales (words j * 8 + r, j < 4 of a vector) to words 4 r .. 4 r + 3
struct X8Spread {
  alignas(64) int16_t idx[4][32]{};
  constexpr X8Spread() {
    for (int j = 0; j < 4; ++j)
      for (int w = 0; w < 32; ++w) idx[j][w] = int16_t(j * 8 + w / 4);
  }
};
constexpr X8Spread kX8Spread;
#endif

// An X8 group block's 64 six-bit scales (sc, value j * 8 + r: sub-block j of row r) and 8 rows' mins, as words
// (mins[p]: sub-blocks 2p and 2p + 1), unpacked from its 96 bytes of packed scales: what every row's sums share.
inline void x8_scales_mins(const uint8_t* b, uint8_t sc[64], __m256i mins[4]) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
  const __m256i q0 = load32(b + 32), q1 = load32(b + 64), h = load32(b + 96);
  store32(sc, _mm256_or_si256(_mm256_and_si256(q0, low4), _mm256_slli_epi16(_mm256_and_si256(h, three), 4)));
  store32(sc + 32, _mm256_or_si256(_mm256_and_si256(q1, low4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), three), 4)));
  const __m256i mn0 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q0, 4), low4),
                                      _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), three), 4));
  const __m256i mn1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q1, 4), low4),
                                      _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), three), 4));
  mins[0] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(mn0));
  mins[1] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(mn0, 1));
  mins[2] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(mn1));
  mins[3] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(mn1, 1));
}

// Rows 0..7's integer totals (lane r) of group block b with activation codes xq; msum: the mins' sums, from pairs
// (sub-blocks 2p and 2p + 1's 32-value code sums, as int16 in one int32 per p). The AVX2 copy's one row; several
// rows (and the AVX-512 copy's every row) run x8_block_sums_rows.
inline void x8_block_sums(const uint8_t* b, const int8_t* xq, const int32_t* pairs, __m256i& total, __m256i& msum) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const uint8_t* codes = b + 128;
  alignas(32) uint8_t sc[64];
  __m256i mins[4];
  x8_scales_mins(b, sc, mins);
  msum = _mm256_setzero_si256();
  for (int p = 0; p < 4; ++p) msum = _mm256_add_epi32(msum, _mm256_madd_epi16(mins[p], _mm256_set1_epi32(pairs[p])));
  const __m128i rep = _mm_set_epi8(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m256i t0 = _mm256_setzero_si256(), t1 = _mm256_setzero_si256();  // rows 0-3, rows 4-7: lanes 2r', 2r' + 1
  for (int j = 0; j < 8; j += 2) {
    __m256i s[2][2];  // [sub-block j, j + 1][rows 0-3, 4-7]: the scale in words 4 r' .. 4 r' + 3
    for (int i = 0; i < 2; ++i)
      for (int half = 0; half < 2; ++half) {
        int32_t four;
        std::memcpy(&four, sc + (j + i) * 8 + 4 * half, 4);
        s[i][half] = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_cvtsi32_si128(four), rep));
      }
    const int p = j / 2;
    for (int c = 0; c < 4; ++c) {
      int64_t x0, x1;
      std::memcpy(&x0, xq + 64 * p + 8 * c, 8), std::memcpy(&x1, xq + 64 * p + 32 + 8 * c, 8);
      const __m256i xl = _mm256_set1_epi64x(x0), xh = _mm256_set1_epi64x(x1);
      for (int half = 0; half < 2; ++half) {
        const __m256i raw = load32(codes + (4 * p + c) * 64 + 32 * half);
        const __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
        __m256i& t = half ? t1 : t0;
        t = _mm256_add_epi32(t, _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xl), s[0][half]));
        t = _mm256_add_epi32(t, _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xh), s[1][half]));
      }
    }
  }
  total = _mm256_permute4x64_epi64(_mm256_hadd_epi32(t0, t1), 0xD8);
}

#ifndef GGUF_VNNI
// x8_block_sums for R rows at once (xq[r], pairs[r]), the AVX2 copy's: the block's scales, mins and code nibbles
// unpacked once for them, each row's integers summed in the same lanes as x8_block_sums sums them (one half of the
// 8 outputs at a time: the rows' sums stay in registers)
template <int R>
inline void x8_block_sums_rows(const uint8_t* b, const int8_t* const* xq, const int32_t* const* pairs,
                               __m256i* total, __m256i* msum) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const uint8_t* codes = b + 128;
  alignas(32) uint8_t sc[64];
  __m256i mins[4];
  x8_scales_mins(b, sc, mins);
  for (int r = 0; r < R; ++r) {
    msum[r] = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) msum[r] = _mm256_add_epi32(msum[r], _mm256_madd_epi16(mins[p], _mm256_set1_epi32(pairs[r][p])));
  }
  const __m128i rep = _mm_set_epi8(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m256i th[2][R];  // [rows 0-3, rows 4-7][row]: x8_block_sums' t0, t1
  for (int half = 0; half < 2; ++half) {
    __m256i t[R];
    for (int r = 0; r < R; ++r) t[r] = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      __m256i s[2];  // sub-blocks 2p, 2p + 1: the scale in words 4 r' .. 4 r' + 3
      for (int i = 0; i < 2; ++i) {
        int32_t four;
        std::memcpy(&four, sc + (2 * p + i) * 8 + 4 * half, 4);
        s[i] = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_cvtsi32_si128(four), rep));
      }
      for (int c = 0; c < 4; ++c) {
        const __m256i raw = load32(codes + (4 * p + c) * 64 + 32 * half);
        const __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
        for (int r = 0; r < R; ++r) {
          int64_t x0, x1;
          std::memcpy(&x0, xq[r] + 64 * p + 8 * c, 8), std::memcpy(&x1, xq[r] + 64 * p + 32 + 8 * c, 8);
          t[r] = _mm256_add_epi32(t[r], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi64x(x0)), s[0]));
          t[r] = _mm256_add_epi32(t[r], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_set1_epi64x(x1)), s[1]));
        }
      }
    }
    for (int r = 0; r < R; ++r) th[half][r] = t[r];
  }
  for (int r = 0; r < R; ++r) total[r] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(th[0][r], th[1][r]), 0xD8);
}
#endif

#ifdef GGUF_VNNI
// x8_block_sums for R rows at once (xq[r], pairs[r]): the block's scales, mins and code nibbles unpacked once for
// them, each row's integers summed in the same lanes as x8_block_sums sums them
template <int R>
inline void x8_block_sums_rows(const uint8_t* b, const int8_t* const* xq, const int32_t* const* pairs,
                               __m256i* total, __m256i* msum) {
  const __m256i three = _mm256_set1_epi8(3);
  const __m512i low4x = _mm512_set1_epi8(0x0F);
  const __m512i q = _mm512_loadu_si512(b + 32);
  const __m256i h = load32(b + 96);
  const __m512i hlo = join(_mm256_and_si256(h, three), _mm256_and_si256(_mm256_srli_epi16(h, 2), three));
  const __m512i hhi = join(_mm256_and_si256(_mm256_srli_epi16(h, 4), three), _mm256_and_si256(_mm256_srli_epi16(h, 6), three));
  const __m512i sc = _mm512_or_si512(_mm512_and_si512(q, low4x), _mm512_slli_epi16(hlo, 4));
  const __m512i mn = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(q, 4), low4x), _mm512_slli_epi16(hhi, 4));
  const __m512i sw[2] = {_mm512_cvtepu8_epi16(_mm512_castsi512_si256(sc)), _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(sc, 1))};
  const __m512i mw0 = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(mn)), mw1 = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(mn, 1));
  const __m512i i01 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i i23 = _mm512_add_epi32(i01, _mm512_set1_epi32(2));
  __m512i tot[R];
  for (int r = 0; r < R; ++r) {
    const __m512i pv = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pairs[r])));
    msum[r] = fold(_mm512_add_epi32(_mm512_madd_epi16(mw0, _mm512_permutexvar_epi32(i01, pv)),
                                    _mm512_madd_epi16(mw1, _mm512_permutexvar_epi32(i23, pv))));
    tot[r] = _mm512_setzero_si512();
  }
  for (int p = 0; p < 4; ++p) {
    const __m512i s0 = _mm512_permutexvar_epi16(_mm512_load_si512(kX8Spread.idx[(2 * p) % 4]), sw[p / 2]);
    const __m512i s1 = _mm512_permutexvar_epi16(_mm512_load_si512(kX8Spread.idx[(2 * p + 1) % 4]), sw[p / 2]);
    for (int c = 0; c < 4; ++c) {
      const __m512i raw = _mm512_loadu_si512(b + 128 + (4 * p + c) * 64);
      const __m512i lo = _mm512_and_si512(raw, low4x), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4x);
      for (int r = 0; r < R; ++r) {
        int64_t xl, xh;
        std::memcpy(&xl, xq[r] + 64 * p + 8 * c, 8), std::memcpy(&xh, xq[r] + 64 * p + 32 + 8 * c, 8);
        tot[r] = _mm512_dpwssd_epi32(tot[r], _mm512_maddubs_epi16(lo, _mm512_set1_epi64(xl)), s0);
        tot[r] = _mm512_dpwssd_epi32(tot[r], _mm512_maddubs_epi16(hi, _mm512_set1_epi64(xh)), s1);
      }
    }
  }
  for (int r = 0; r < R; ++r) total[r] = _mm512_cvtepi64_epi32(_mm512_add_epi32(tot[r], _mm512_srli_epi64(tot[r], 32)));
}
#endif

// Group g's 8 outputs for rows m0 .. m0 + R: per block the integer sums (R rows at once), then each
// row's fp32 steps in order, lane r for output r: acc = fma(total, d * dx), acc1 = acc1 - msum * (dmin * dx).
template <int R>
inline void x8_group_rows(const Act& a, const int32_t* pairs, const uint8_t* wg, int64_t m0, int64_t K, int64_t N,
                          int64_t g, float* y) {
  const int64_t nb = K / 256;
  __m256 acc[R], acc1[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), acc1[r] = _mm256_setzero_ps();
  for (int64_t kb = 0; kb < nb; ++kb) {
    const uint8_t* b = wg + kb * kX8Bytes;
    // every line of the block two ahead: on this VM prefetching only some lines of it was slower than the
    // file layout's loop when memory is busy (docs/performance.md)
    for (int64_t l = 0; l < kX8Bytes; l += 64)
      _mm_prefetch(reinterpret_cast<const char*>(b) + 2 * kX8Bytes + l, _MM_HINT_T0);
    __m256i total[R], msum[R];
    const int8_t* xq[R];
    const int32_t* pr[R];
    for (int r = 0; r < R; ++r) xq[r] = a.q.data() + (m0 + r) * K + kb * 256, pr[r] = pairs + ((m0 + r) * nb + kb) * 4;
#ifndef GGUF_VNNI
    if constexpr (R == 1) x8_block_sums(b, xq[0], pr[0], total[0], msum[0]);
    else
#endif
      x8_block_sums_rows<R>(b, xq, pr, total, msum);
    for (int r = 0; r < R; ++r) {
      const __m256 dx = _mm256_set1_ps(a.d[(m0 + r) * nb + kb]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[r]), _mm256_mul_ps(halves8(b), dx), acc[r]);
      acc1[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum[r]), _mm256_mul_ps(halves8(b + 16), dx), acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + (m0 + r) * N + g * kX8Rows, _mm256_add_ps(acc[r], acc1[r]));
}

// y (M, N) for a Q4_K_X8 weight w: groups of 8 rows here, the last N % 8 rows by block_dot<Q4_K>. pairs (M, nb, 4):
// each block's 16-value sums added in pairs (sub-blocks' sums), two to an int32.
inline void linear_x8(const Act& a, const int32_t* pairs, const uint8_t* w, int64_t M, int64_t K, int64_t N,
                      float* y) {
  const int64_t nb = K / 256, row_bytes = nb * 144, groups = N / kX8Rows;
  at::parallel_for(0, groups, std::max<int64_t>(1, 8 / std::max<int64_t>(M, 1)), [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* wg = w + g * kX8Rows * row_bytes;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) x8_group_rows<4>(a, pairs, wg, m, K, N, g, y);  // each block unpacked once for 4
      if (M - m == 3) x8_group_rows<3>(a, pairs, wg, m, K, N, g, y), m += 3;
      if (M - m == 2) x8_group_rows<2>(a, pairs, wg, m, K, N, g, y), m += 2;
      if (M - m == 1) x8_group_rows<1>(a, pairs, wg, m, K, N, g, y);
    }
  });
  for (int64_t n = groups * kX8Rows; n < N; ++n)  // the rows past the last group, as the file holds them
    for (int64_t m = 0; m < M; ++m) {
      __m256 acc = _mm256_setzero_ps();
      float acc1 = 0.f;
      for (int64_t kb = 0; kb < nb; ++kb)
        block_dot<Q4_K>(w + n * row_bytes + kb * 144, a.q.data() + m * K + kb * 256, a.d[m * nb + kb],
                        a.s16.data() + (m * K + kb * 256) / 16, 0.f, acc, acc1);
      y[m * N + n] = hsum(acc) + acc1;
    }
}
