// Products of 2 to kShareRows activation rows (a speculative verify step's k + 1 tokens) with weights of the
// 256-value K-quants in the file's layout (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS), included by gguf_dot.h and so
// compiled as its AVX2 copy and its AVX-512 VNNI copy; gguf_rows.h does the same for the 32-value formats.
//
// Why: linear_rows runs block_dot once per (row, output), unpacking each super-block (nibbles, high bits, 6-bit
// scales, the scale vectors) once per row. Here each block is unpacked once, one 32-value step at a time, and each
// step is multiplied by every row.
//
// Exactness: a row's 8 int32 lanes per block hold the same integers as block_dot's (the same products of the same
// bytes land in the same lane; integer sums are exact in any order, the VNNI copy's 512-bit steps fold their halves
// as k_quant_sum does), and then get block_dot's fp32 operations in its order into that row's own accumulators.
// So every row's result is the one-row product's bit for bit (tests/kernels/test_gguf_krows.py). A change to
// block_dot's arithmetic must be made here too.

// The formats shared_krows takes (unsigned codes: Q2_K, Q4_K, Q5_K, Q6_K; signed values: Q3_K, IQ4_XS)
constexpr bool shares_krows(int64_t type) {
  return type == Q2_K || type == Q3_K || type == Q4_K || type == Q5_K || type == Q6_K || type == IQ4_XS;
}
constexpr bool signed_codes(int64_t type) { return type == Q3_K || type == IQ4_XS; }

#ifdef GGUF_VNNI
// Q4_K, Q5_K's step2 weights: word i of vector t takes sub-block scale 2t + i / 16
struct KSpread {
  alignas(64) int16_t k4[4][32]{};
  constexpr KSpread() {
    for (int t = 0; t < 4; ++t)
      for (int i = 0; i < 32; ++i) k4[t][i] = int16_t(2 * t + i / 16);
  }
};
constexpr KSpread kKSpread;
#endif

// One super-block's unpacking, a 32-value step s (0..7, activation codes xq + 32 s) at a time: codes u (unsigned;
// Q3_K, IQ4_XS: |value|, with the value v for the activations' signs) and the dot's weights sc (int16 words for
// dot_scaled; IQ4_XS: int32 for its mullo).
template <int64_t TYPE>
struct KBlock {
  const uint8_t* b;
  int16_t sc[16];  // Q4_K, Q5_K: the 8 sub-blocks' scales; Q2_K, Q3_K, Q6_K: the 16 groups'; IQ4_XS: 8 sub-blocks'
  uint8_t m[8];    // Q4_K, Q5_K: the mins
  __m256i qh;      // Q5_K: the fifth bits; Q3_K: hmask

  __m256i sc16;    // Q6_K: the 16 scales as int16 (q6k_lane_offsets')
#ifdef GGUF_VNNI
  __m512i scw, qhj;  // Q2_K, Q4_K, Q5_K, Q6_K: the scales as words for vpermw; Q5_K: fifth bits, qh | qh >> 1
#endif

  explicit KBlock(const uint8_t* blk) : b(blk) {
#ifdef GGUF_VNNI
    if constexpr (!signed_codes(TYPE)) {  // the unsigned formats run step2 alone here
      if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
        uint8_t s8[8];
        scale_min_k4(b + 4, s8, m);
        scw = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s8))));
        const __m256i h = load32(b + 16);
        qhj = join(h, _mm256_srli_epi16(h, 1));
      } else if constexpr (TYPE == Q6_K) {
        sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
        scw = _mm512_castsi256_si512(sc16);
      } else {
        scw = _mm512_castsi256_si512(_mm256_and_si256(
            _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b))), _mm256_set1_epi16(0x0F)));
      }
      return;
    }
#endif
    if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
      uint8_t s8[8];
      scale_min_k4(b + 4, s8, m);
      for (int j = 0; j < 8; ++j) sc[j] = s8[j];
    } else if constexpr (TYPE == Q6_K) {
      for (int g = 0; g < 16; ++g) sc[g] = int8_t(b[192 + g]);
      sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
    } else if constexpr (TYPE == Q2_K) {
      for (int g = 0; g < 16; ++g) sc[g] = b[g] & 0x0F;
    } else if constexpr (TYPE == Q3_K) {
      q3k_scales(b + 96, sc);
    } else {
      for (int j = 0; j < 8; ++j) sc[j] = int16_t(iq4xs_scale(b, j));
    }
    qh = TYPE == Q5_K ? load32(b + 16) : TYPE == Q3_K ? load32(b) : _mm256_setzero_si256();
  }

#ifdef GGUF_VNNI
  // Steps 2t and 2t + 1 of an unsigned format as one vector (codes u, words w), activation codes xq + 64 t: the
  // codes of step's (below) in the same bytes, the weights spread by one vpermw (word i: scale idx[t][i])
  inline void step2(int t, __m512i& u, __m512i& w) const {
    const __m512i low4 = _mm512_set1_epi8(0x0F), three = _mm512_set1_epi8(3);
    if constexpr (TYPE == Q4_K || TYPE == Q5_K) {  // the low then the high nibbles of 32 bytes
      const __m256i raw = load32(b + (TYPE == Q4_K ? 16 : 48) + 32 * t);
      u = _mm512_and_si512(join(raw, _mm256_srli_epi16(raw, 4)), low4);
      if constexpr (TYPE == Q5_K)
        u = _mm512_or_si512(u, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qhj, 2 * t), _mm512_set1_epi8(1)), 4));
      w = _mm512_permutexvar_epi16(_mm512_load_si512(kKSpread.k4[t]), scw);
    } else if constexpr (TYPE == Q6_K) {  // k_quant_sum's: half t / 2, low (t even) or high nibbles of 64 bytes
      const int h = t / 2;
      const __m512i l = _mm512_loadu_si512(b + 64 * h);
      const __m256i hb = load32(b + 128 + 32 * h);
      const __m512i hb2 = _mm512_srli_epi16(join(hb, _mm256_srli_epi16(hb, 2)), 4 * (t % 2));
      u = _mm512_or_si512(_mm512_and_si512(t % 2 ? _mm512_srli_epi16(l, 4) : l, low4),
                          _mm512_slli_epi16(_mm512_and_si512(hb2, three), 4));
      w = _mm512_permutexvar_epi16(_mm512_load_si512(kSpread.q6k[t]), scw);
    } else {  // Q2_K: half t / 2, its 2-bit steps 2 (t % 2) and 2 (t % 2) + 1
      const __m256i raw = _mm256_srli_epi16(load32(b + 16 + 32 * (t / 2)), 4 * (t % 2));
      u = _mm512_and_si512(join(raw, _mm256_srli_epi16(raw, 2)), three);
      w = _mm512_permutexvar_epi16(_mm512_load_si512(kSpread.q6k[t]), scw);
    }
  }
#endif

  inline void step(int s, __m256i& u, __m256i& v, __m256i& w) const {
    const __m256i low4 = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    if constexpr (TYPE == Q4_K || TYPE == Q5_K) {  // k_quant_sum's step j = s / 2, low (even s) or high nibbles
      const __m256i raw = load32(b + (TYPE == Q4_K ? 16 : 48) + 32 * (s / 2));
      u = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(raw, 4) : raw, low4);
      if constexpr (TYPE == Q5_K) u = _mm256_or_si256(u, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, s), one), 4));
      w = _mm256_set1_epi16(sc[s]);
    } else if constexpr (TYPE == Q6_K) {  // half h = s / 4, its step i = s % 4
      const int h = s / 4, i = s % 4;
      const __m256i l = load32(b + 64 * h + 32 * (i % 2)), hb = load32(b + 128 + 32 * h);
      const __m256i high = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * i), three), 4);
      u = _mm256_or_si256(_mm256_and_si256(i < 2 ? l : _mm256_srli_epi16(l, 4), low4), high);
      w = pair_scale(sc[2 * s], sc[2 * s + 1]);
    } else if constexpr (TYPE == Q2_K || TYPE == Q3_K) {  // low_bit_sum's h = s / 4, its step s % 4
      const int h = s / 4, t = s % 4;
      u = _mm256_and_si256(_mm256_srli_epi16(load32(b + (TYPE == Q2_K ? 16 : 32) + 32 * h), 2 * t), three);
      if constexpr (TYPE == Q3_K) {
        u = _mm256_or_si256(u, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4 * h + t), one), 2));
        v = _mm256_sub_epi8(u, _mm256_set1_epi8(4));
        u = _mm256_sign_epi8(v, v);
      }
      w = pair_scale(sc[2 * s], sc[2 * s + 1]);
    } else {  // IQ4_XS: sub-block s
      v = iq4_lookup(nibbles_split(b + 8 + 16 * s));
      u = _mm256_sign_epi8(v, v);
      w = _mm256_set1_epi32(sc[s]);
    }
  }
};

// Row r's 8 int32 lanes of block k with its activation codes xq[r], for MR rows, one step at a time
template <int64_t TYPE, int MR>
inline void krows_lanes(const KBlock<TYPE>& k, const int8_t* const* xq, __m256i* lanes) {
#ifdef GGUF_VNNI
  if constexpr (!signed_codes(TYPE)) {  // steps 2t, 2t + 1 in one vector (AVX-512 has no vpsignb for the others)
    __m512i l[MR];
    for (int r = 0; r < MR; ++r) l[r] = _mm512_setzero_si512();
    for (int t = 0; t < 4; ++t) {
      __m512i u, w;
      k.step2(t, u, w);
      for (int r = 0; r < MR; ++r) l[r] = _mm512_add_epi32(l[r], dot_scaled2(u, _mm512_loadu_si512(xq[r] + 64 * t), w));
    }
    for (int r = 0; r < MR; ++r) lanes[r] = fold(l[r]);
    return;
  }
#endif
  for (int r = 0; r < MR; ++r) lanes[r] = _mm256_setzero_si256();
  for (int s = 0; s < 8; ++s) {
    __m256i u, v = _mm256_setzero_si256(), w;
    k.step(s, u, v, w);
    for (int r = 0; r < MR; ++r) {
      const __m256i x = load32(xq[r] + 32 * s);
      __m256i p;
      if constexpr (TYPE == IQ4_XS) p = _mm256_mullo_epi32(dot_us(u, _mm256_sign_epi8(x, v)), w);
      else if constexpr (TYPE == Q3_K) p = dot_scaled(u, _mm256_sign_epi8(x, v), w);
      else p = dot_scaled(u, x, w);
      lanes[r] = _mm256_add_epi32(lanes[r], p);
    }
  }
}

// One row's fp32 steps for block k, as block_dot<TYPE> runs them: lanes (its integers), activation scale dx and
// 16-value sums s16, into acc and acc1
template <int64_t TYPE>
inline void krow_finish(const KBlock<TYPE>& k, __m256i lanes, float dx, const int32_t* s16, __m256& acc,
                        float& acc1) {
  const uint8_t* b = k.b;
  if constexpr (TYPE == Q4_K) {
    const __m256i bs = _mm256_permute4x64_epi64(_mm256_hadd_epi32(load32(s16), load32(s16 + 8)), 0xD8);
    const __m256i m32 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(k.m)));
    int32_t total, msum;
    hsum_i32_pair(lanes, _mm256_mullo_epi32(bs, m32), total, msum);
    acc = _mm256_fmadd_ps(_mm256_castps128_ps256(_mm_set_ss(float(total))), _mm256_set1_ps(half(b) * dx), acc);
    acc1 = std::fma(-float(msum), half(b + 2) * dx, acc1);
  } else if constexpr (TYPE == Q5_K) {
    const int32_t msum = weighted_sum16<true>(k.m, s16);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(half(b) * dx), acc);
    acc1 = std::fma(-float(msum), half(b + 2) * dx, acc1);
  } else if constexpr (TYPE == Q6_K) {
    const __m256i isum = _mm256_sub_epi32(lanes, q6k_lane_offsets(s16, k.sc16));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(half(b + 208) * dx), acc);
  } else if constexpr (TYPE == Q2_K) {
    int32_t msum = 0;
    for (int g = 0; g < 16; ++g) msum += int32_t(b[g] >> 4) * s16[g];
    acc = _mm256_fmadd_ps(_mm256_setr_ps(float(hsum_i32(lanes)), 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f),
                          _mm256_set1_ps(half(b + 80) * dx), acc);
    acc1 = std::fma(-float(msum), half(b + 82) * dx, acc1);
  } else if constexpr (TYPE == Q3_K) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(half(b + 108) * dx), acc);
  } else {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(half(b) * dx), acc);
  }
}

// y rows m0 .. m0 + MR (of M), every output: each super-block unpacked once for the MR rows.
template <int64_t TYPE, int MR>
void shared_krows(const Act& a, const uint8_t* w, const Format& f, int64_t m0, int64_t K, int64_t N, float* y) {
  const int64_t nb = K / 256, row_bytes = nb * f.bytes;
  at::parallel_for(0, N, std::max<int64_t>(1, 64 / MR), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wr = w + n * row_bytes;
      __m256 acc[MR];
      float acc1[MR];
      for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps(), acc1[r] = 0.f;
      for (int64_t i = 0; i < nb; ++i) {
        const uint8_t* b = wr + i * f.bytes;
        _mm_prefetch(reinterpret_cast<const char*>(b) + 1024, _MM_HINT_T0);
        const int8_t* xq[MR];
        for (int r = 0; r < MR; ++r) xq[r] = a.q.data() + (m0 + r) * K + 256 * i;
        const KBlock<TYPE> k(b);
        __m256i lanes[MR];
        krows_lanes<TYPE, MR>(k, xq, lanes);
        for (int r = 0; r < MR; ++r) {
          const int64_t j = (m0 + r) * nb + i;
          krow_finish<TYPE>(k, lanes[r], a.d[j], a.s16.data() + 16 * j, acc[r], acc1[r]);
        }
      }
      for (int r = 0; r < MR; ++r) y[(m0 + r) * N + n] = hsum(acc[r]) + acc1[r];
    }
  });
}

// y (M, N) for M >= 2 rows of a format that shares_krows, kShareRows at a time (in_row_chunks, gguf_rows.h)
template <int64_t TYPE>
void linear_kshared(const Act& a, const uint8_t* w, const Format& f, int64_t M, int64_t K, int64_t N, float* y) {
  in_row_chunks(M, [&]<int R>(int64_t m0) { shared_krows<TYPE, R>(a, w, f, m0, K, N, y); });
}
