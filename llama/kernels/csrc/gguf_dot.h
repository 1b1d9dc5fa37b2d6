// The GGUF block products' inner loops (gguf_blocks.cpp), included twice (no include guard): once as namespace `avx2`, once as
// namespace `vnni` under `#pragma GCC target` for AVX-512 VNNI with GGUF_VNNI defined. Both compile the same
// sums in the same order; the VNNI copy only computes some of the int32 lanes with other instructions
// (vpdpbusd; 512-bit vectors whose two halves are added as integers) that give the same integers in the same
// lanes, so the two copies' results are bitwise equal (tests/kernels/test_gguf_block_kernels.py).

// 32 unsigned codes (at most 127) times 32 signed codes, summed in pairs then fours with the 16-bit weights in
// `scale` (one int16 per pair of products' lane): 8 int32 lanes.
inline __m256i dot_scaled(__m256i u, __m256i s, __m256i scale) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scale);
}
// The same with unit weights: lane i is the sum of the products of bytes 4i .. 4i + 3 (no int16 pair sum
// saturates: |u| * |s| * 2 <= 128 * 127 * 2), which is what vpdpbusd computes in one instruction.
inline __m256i dot_us(__m256i u, __m256i s) {
#ifdef GGUF_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return dot_scaled(u, s, _mm256_set1_epi16(1));
#endif
}
// signed weights w (|w| <= 127, or -128) times signed codes x: |w| * (x with w's sign)
inline __m256i dot_ss(__m256i w, __m256i x) { return dot_us(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)); }

inline float half(const uint8_t* p) {
#ifdef GGUF_VNNI
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);  // F16C (every AVX-512 CPU): the same exact conversion
#else
  return half_to_float(p);
#endif
}

// Two 16-value groups' int16 weights for dot_scaled: a in lanes 0-7 (values 0..15), b in lanes 8-15
inline __m256i pair_scale(int a, int b) { return _mm256_set_m128i(_mm_set1_epi16(int16_t(b)), _mm_set1_epi16(int16_t(a))); }
// Q6_K's offsets per int32 lane (gguf_simd.h), from its int8 group scales
inline __m256i q6k_offsets(const int8_t* sc, const int32_t* s16) {
  return q6k_lane_offsets(s16, _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc))));
}

// The 8 int32 lanes of a K-quant super-block's scaled integer sum (Q4_K, Q5_K, Q6_K), lane by lane as the AVX2 code
// sums them. GGUF_VNNI: two 32-byte steps per 512-bit vector, the halves added at the end (integer sums: the same).
#ifdef GGUF_VNNI
inline __m512i dot_scaled2(__m512i u, __m512i s, __m512i scale) {
  return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), scale);
}
inline __m512i join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
inline __m256i fold(__m512i v) {
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}
// The int16 weight vectors of the 512-bit steps, spread from the super-block's scales by one vpermw each (the AVX2
// code broadcasts each scale on its own, and those shuffles limited the 512-bit loops): word i of vector v takes
// scale kSpread.q4k[v][i] (Q4_K: 16 words a sub-block) or kSpread.q6k[v][i] (Q6_K: 8 words a group of 16).
// Computed at compile time (constexpr): no code of this AVX-512 copy runs when the library loads, so an AVX2 CPU can
// load it.
struct Spread {
  alignas(64) int16_t q4k[4][32]{};
  alignas(64) int16_t q6k[4][32]{};
  constexpr Spread() {
    for (int v = 0; v < 4; ++v)
      for (int i = 0; i < 32; ++i) {
        q4k[v][i] = int16_t((v / 2) * 4 + v % 2 + 2 * (i / 16));  // j = 0: (lo: 0, 2), (hi: 1, 3); j = 2: 4 ...
        q6k[v][i] = int16_t(4 * v + i / 8);  // half h = v / 2, steps 2 (v % 2) .. + 1
      }
  }
};
constexpr Spread kSpread;
#endif

template <int64_t TYPE>
inline __m256i k_quant_sum(const uint8_t* b, const int8_t* xq, const uint8_t* sc) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
    const uint8_t* qs = b + (TYPE == Q4_K ? 16 : 48);
    const __m256i one = _mm256_set1_epi8(1);
    const __m256i qh = TYPE == Q5_K ? load32(b + 16) : _mm256_setzero_si256();
#ifdef GGUF_VNNI
    if constexpr (TYPE == Q4_K) {  // steps j, j + 1 in one vector: lanes 0-7 step j's, 8-15 step j + 1's
      const __m512i low4x = _mm512_set1_epi8(0x0F);
      const __m512i sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc))));
      __m512i isum = _mm512_setzero_si512();
      for (int j = 0; j < 4; j += 2) {
        const __m512i raw = _mm512_loadu_si512(qs + 32 * j);
        const __m512i lo = _mm512_and_si512(raw, low4x), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4x);
        const __m512i xlo = join(load32(xq + 64 * j), load32(xq + 64 * j + 64));
        const __m512i xhi = join(load32(xq + 64 * j + 32), load32(xq + 64 * j + 96));
        const __m512i slo = _mm512_permutexvar_epi16(_mm512_load_si512(kSpread.q4k[j]), sc16);
        const __m512i shi = _mm512_permutexvar_epi16(_mm512_load_si512(kSpread.q4k[j + 1]), sc16);
        isum = _mm512_add_epi32(isum, dot_scaled2(lo, xlo, slo));
        isum = _mm512_add_epi32(isum, dot_scaled2(hi, xhi, shi));
      }
      return fold(isum);
    }
#endif
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
    return isum;
  } else {  // Q6_K: sc are the 16 signed scales
    const int8_t* s = reinterpret_cast<const int8_t*>(sc);
#ifdef GGUF_VNNI
    // half h's four 32-value steps as two vectors: (step 0, step 1) and (step 2, step 3)
    const __m512i low4x = _mm512_set1_epi8(0x0F), three = _mm512_set1_epi8(3);
    const __m512i s16x = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s))));
    __m512i isum = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      const __m512i l01 = _mm512_loadu_si512(b + 64 * h);  // ql: steps 0, 1 low nibbles; steps 2, 3 high
      const __m256i hb = load32(b + 128 + 32 * h);
      const __m512i hb2 = join(hb, _mm256_srli_epi16(hb, 2));
      const __m512i q01 = _mm512_or_si512(_mm512_and_si512(l01, low4x),
                                          _mm512_slli_epi16(_mm512_and_si512(hb2, three), 4));
      const __m512i q23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l01, 4), low4x),
                                          _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb2, 4), three), 4));
      const __m512i s01 = _mm512_permutexvar_epi16(_mm512_load_si512(kSpread.q6k[2 * h]), s16x);
      const __m512i s23 = _mm512_permutexvar_epi16(_mm512_load_si512(kSpread.q6k[2 * h + 1]), s16x);
      isum = _mm512_add_epi32(isum, dot_scaled2(q01, _mm512_loadu_si512(xq + 128 * h), s01));
      isum = _mm512_add_epi32(isum, dot_scaled2(q23, _mm512_loadu_si512(xq + 128 * h + 64), s23));
    }
    return fold(isum);
#else
    const __m256i three = _mm256_set1_epi8(3);
    __m256i isum = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = load32(b + 64 * h), l1 = load32(b + 64 * h + 32), hb = load32(b + 128 + 32 * h);
      __m256i q[4] = {_mm256_and_si256(l0, low4), _mm256_and_si256(l1, low4),
                      _mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(_mm256_srli_epi16(l1, 4), low4)};
      for (int i = 0; i < 4; ++i) {
        const __m256i high = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * i), three), 4);
        isum = _mm256_add_epi32(isum, dot_scaled(_mm256_or_si256(q[i], high), load32(xq + 128 * h + 32 * i),
                                                 pair_scale(s[8 * h + 2 * i], s[8 * h + 2 * i + 1])));
      }
    }
    return isum;
#endif
  }
}

// Q2_K / Q3_K: 2-bit codes (Q3_K: and a third bit from hmask), 16 groups of 16 with their own scales (Q2_K: 4-bit
// scale and min per group; Q3_K: 6-bit signed scales), as 8 int32 lanes of sum(scale * code * x) (Q2_K: codes
// 0..3; Q3_K: the values, -4..3).
template <int64_t TYPE>
inline __m256i low_bit_sum(const uint8_t* b, const int8_t* xq, const int16_t* sc) {
  const uint8_t* qs = b + (TYPE == Q2_K ? 16 : 32);
  const __m256i three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
  const __m256i hm = TYPE == Q3_K ? load32(b) : _mm256_setzero_si256();
  __m256i isum = _mm256_setzero_si256();
  for (int h = 0; h < 2; ++h) {
    const __m256i raw = load32(qs + 32 * h);
    for (int s = 0; s < 4; ++s) {
      __m256i q = _mm256_and_si256(_mm256_srli_epi16(raw, 2 * s), three);
      if constexpr (TYPE == Q3_K)  // code + 4 * hbit, 0..7 (the value is that minus 4)
        q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + s), one), 2));
      const int g = 8 * h + 2 * s;
      const __m256i x = load32(xq + 128 * h + 32 * s);
      if constexpr (TYPE == Q3_K) {  // the signed value q - 4 in the lanes, as llama.cpp's AVX2 dot sums it
        q = _mm256_sub_epi8(q, _mm256_set1_epi8(4));
        const __m256i scale = pair_scale(sc[g], sc[g + 1]);
        isum = _mm256_add_epi32(isum, dot_scaled(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q), scale));
      } else {
        isum = _mm256_add_epi32(isum, dot_scaled(q, x, pair_scale(sc[g], sc[g + 1])));
      }
    }
  }
  return isum;
}

// sum_i w[i] * s16[i] over 16 groups, w[i] = ws[i] (Q6_K's signed scales, Q3_K's) or, with pairs, ws[i / 2] (Q4_K's
// mins, one per two groups of 16): an exact integer, summed in one vector by the AVX-512 copy.
template <bool PAIRS, typename T>
inline int32_t weighted_sum16(const T* ws, const int32_t* s16) {
#ifdef GGUF_VNNI
  __m128i w8;
  if constexpr (PAIRS) {
    w8 = _mm_shuffle_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ws)),
                          _mm_set_epi8(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0));
  } else {
    w8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ws));
  }
  const __m512i w = std::is_signed_v<T> ? _mm512_cvtepi8_epi32(w8) : _mm512_cvtepu8_epi32(w8);
  return _mm512_reduce_add_epi32(_mm512_mullo_epi32(w, _mm512_loadu_si512(s16)));
#else
  int32_t sum = 0;
  for (int i = 0; i < 16; ++i) sum += int32_t(ws[PAIRS ? i / 2 : i]) * s16[i];
  return sum;
#endif
}

// One weight block (b) times activation codes xq with scale dx (and 16-sums s16): adds the product into acc (vector
// part) and acc1 (scalar part: the offsets and mins, exact integers times one scale).
// Q4_0 / IQ4_NL as llama.cpp's repacked q4_0_8x8 / iq4_nl_8x8 sum them: one fp32 sum per output, each block's
// whole integer sum (Q4_0: of (q - 8) x, the -8 from the 16-value sums) added by one fma. A block's 8 lanes:
template <int64_t TYPE>
inline __m256i b32_lanes(const uint8_t* b, const int8_t* xq) {
  if constexpr (TYPE == Q4_0) return dot_us(nibbles_split(b + 2), load32(xq));
  else return dot_ss(iq4_lookup(nibbles_split(b + 2)), load32(xq));
}
template <int64_t TYPE>
inline int32_t b32_offset(const int32_t* s16) { return TYPE == Q4_0 ? -8 * (s16[0] + s16[1]) : 0; }
// Two blocks' lane sums in one reduction (exact integers: the same sums as hsum_i32 each).
inline void hsum_i32_pair(__m256i p0, __m256i p1, int32_t& s0, int32_t& s1) {
  const __m256i h = _mm256_hadd_epi32(p0, p1);  // p0 01, p0 23, p1 01, p1 23 | p0 45, p0 67, p1 45, p1 67
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  t = _mm_hadd_epi32(t, t);  // s0, s1, s0, s1
  s0 = _mm_cvtsi128_si32(t), s1 = _mm_extract_epi32(t, 1);
}

template <int64_t TYPE>
inline void block_dot(const uint8_t* b, const int8_t* xq, float dx, const int32_t* s16, float xsum, __m256& acc,
                      float& acc1) {
  if constexpr (TYPE == Q8_0) {
    const __m256i p = dot_ss(load32(b + 2), load32(xq));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(half(b) * dx), acc);
  } else if constexpr (TYPE == IQ4_NL || TYPE == Q4_0) {  // one block alone (linear_rows takes them in pairs)
    acc1 = std::fma(float(hsum_i32(b32_lanes<TYPE>(b, xq)) + b32_offset<TYPE>(s16)), half(b) * dx, acc1);
  } else if constexpr (TYPE == Q4_1) {
    const __m256i p = dot_us(nibbles_split(b + 4), load32(xq));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(half(b) * dx), acc);
    acc1 += half(b + 2) * xsum;
  } else if constexpr (TYPE == Q5_0 || TYPE == Q5_1) {
    const int64_t h = TYPE == Q5_0 ? 2 : 4;
    const __m256i w = _mm256_or_si256(nibbles_split(b + h + 4), bits_to_16(b + h));
    const float dd = half(b) * dx;
    if constexpr (TYPE == Q5_0) {  // signed values q - 16 in the lanes, as llama.cpp's q5_0 x q8_0 dot sums them
      const __m256i p = dot_ss(_mm256_sub_epi8(w, _mm256_set1_epi8(16)), load32(xq));
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dd), acc);
    } else {
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_us(w, load32(xq))), _mm256_set1_ps(dd), acc);
      acc1 += half(b + 2) * xsum;
    }
  } else if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
    uint8_t sc[8], m[8];
    scale_min_k4(b + 4, sc, m);
    const __m256i isum = k_quant_sum<TYPE>(b, xq, sc);
    if constexpr (TYPE == Q4_K) {
      // as llama.cpp's repacked Q4_K (q4_K_8x8 x q8_K, which its AVX2 CPUs run): one fp32 sum per output, the
      // block's whole integer sum times d * dx added by one fma (lane 0 here), the mins' likewise, subtracted last.
      // The mins' 8 products m[j] * (sums of sub-block j's 32 codes) in lanes, reduced with isum's lanes at once.
      const __m256i bs = _mm256_permute4x64_epi64(_mm256_hadd_epi32(load32(s16), load32(s16 + 8)), 0xD8);
      const __m256i m32 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m)));
      const __m256i mv = _mm256_mullo_epi32(bs, m32);
      int32_t total, msum;
      hsum_i32_pair(isum, mv, total, msum);
      acc = _mm256_fmadd_ps(_mm256_castps128_ps256(_mm_set_ss(float(total))), _mm256_set1_ps(half(b) * dx), acc);
      acc1 = std::fma(-float(msum), half(b + 2) * dx, acc1);
    } else {  // Q5_K as llama.cpp's AVX2 dot: 8 fp32 lanes, the mins in one fp32 sum
      const int32_t msum = weighted_sum16<true>(m, s16);
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(half(b) * dx), acc);
      acc1 = std::fma(-float(msum), half(b + 2) * dx, acc1);
    }
  } else if constexpr (TYPE == Q6_K) {  // as llama.cpp's AVX2 dot: the offsets subtracted lane by lane first
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const __m256i isum = _mm256_sub_epi32(k_quant_sum<TYPE>(b, xq, b + 192), q6k_offsets(sc, s16));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(half(b + 208) * dx), acc);
  } else if constexpr (TYPE == Q2_K) {  // w = d * sc * q - dmin * m; summed as Q4_K (llama.cpp's q2_K_8x8 on AVX-512)
    int16_t sc[16];
    int32_t msum = 0;
    for (int g = 0; g < 16; ++g) sc[g] = b[g] & 0x0F, msum += int32_t(b[g] >> 4) * s16[g];
    const int32_t isum = hsum_i32(low_bit_sum<TYPE>(b, xq, sc));
    acc = _mm256_fmadd_ps(_mm256_setr_ps(float(isum), 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f),
                          _mm256_set1_ps(half(b + 80) * dx), acc);
    acc1 = std::fma(-float(msum), half(b + 82) * dx, acc1);
  } else if constexpr (TYPE == Q3_K) {  // w = d * sc * (q + 4 * hbit - 4), as llama.cpp's AVX2 dot: 8 fp32 lanes
    int16_t sc[16];
    q3k_scales(b + 96, sc);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(low_bit_sum<TYPE>(b, xq, sc)), _mm256_set1_ps(half(b + 108) * dx), acc);
  } else if constexpr (TYPE == IQ4_XS) {
    __m256i isum = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      const __m256i p = dot_ss(iq4_lookup(nibbles_split(b + 8 + 16 * j)), load32(xq + 32 * j));
      isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(p, _mm256_set1_epi32(iq4xs_scale(b, j))));
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(half(b) * dx), acc);
  }
}

// y[r] = weight rows wr, wr + row_bytes, ... (R outputs) times activation row m, each as block_dot sums it alone:
// its own acc and acc1 get the same fp32 operations in the same order whatever R is. R > 1 interleaves outputs so
// that one output's fma chain does not wait on its last step (a one-row product is latency-bound, not
// bandwidth-bound, on SmolLM2's small matrices).
template <int64_t TYPE, int R>
inline void outputs_dot(const Act& a, const uint8_t* wr, const Format& f, int64_t nblocks, int64_t row_bytes,
                        int64_t m, int64_t K, float* y) {
  __m256 acc[R];
  float acc1[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), acc1[r] = 0.f;
  int64_t i = 0;
  if constexpr (TYPE == Q4_0 || TYPE == IQ4_NL) {  // two blocks a step, one reduction (block_dot's sums)
    for (; i + 1 < nblocks; i += 2) {
      const int64_t j = m * K / 32 + i;  // the activation block
      const int32_t* s16 = a.s16.data() + 2 * j;
      const int8_t* xq = a.q.data() + 32 * j;
      for (int r = 0; r < R; ++r) {
        const uint8_t* b = wr + r * row_bytes + i * f.bytes;
        _mm_prefetch(reinterpret_cast<const char*>(b) + 1024, _MM_HINT_T0);
        int32_t s0, s1;
        hsum_i32_pair(b32_lanes<TYPE>(b, xq), b32_lanes<TYPE>(b + f.bytes, xq + 32), s0, s1);
        acc1[r] = std::fma(float(s0 + b32_offset<TYPE>(s16)), half(b) * a.d[j], acc1[r]);
        acc1[r] = std::fma(float(s1 + b32_offset<TYPE>(s16 + 2)), half(b + f.bytes) * a.d[j + 1], acc1[r]);
      }
    }
  }
  for (; i < nblocks; ++i) {
    const int64_t k = m * K + i * f.values;
    const int8_t* xq = a.q.data() + k;
    const float dx = a.d[k / f.act_block], xs = a.s.empty() ? 0.f : a.s[k / 32];
    const int32_t* s16 = a.s16.data() + k / 16;
    for (int r = 0; r < R; ++r) {
      const uint8_t* b = wr + r * row_bytes + i * f.bytes;
      _mm_prefetch(reinterpret_cast<const char*>(b) + 1024, _MM_HINT_T0);
      block_dot<TYPE>(b, xq, dx, s16, xs, acc[r], acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r] = hsum(acc[r]) + acc1[r];
}

// One row (M == 1, a decode step) of the 32-value formats kOutputs outputs at a time (SmolLM2 Q4_1's decode step
// 0.93x the time of one output at a time, docs/performance.md; the K-quants' larger block_dot lost with it at 7B);
// the rest, and more rows (below gguf_gemm's, formats gguf_rows.h does not take), one (output, row) at a time.
constexpr int kOutputs = 2;

template <int64_t TYPE>
void linear_rows(const Act& a, const uint8_t* w, const Format& f, int64_t M, int64_t K, int64_t N, float* y) {
  const int64_t nblocks = K / f.values, row_bytes = nblocks * f.bytes;
  const int64_t grain = std::max<int64_t>(1, 64 / std::max<int64_t>(M, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    int64_t n = n0;
    if constexpr (shares_rows(TYPE))
      if (M == 1)
        for (; n + kOutputs <= n1; n += kOutputs)
          outputs_dot<TYPE, kOutputs>(a, w + n * row_bytes, f, nblocks, row_bytes, 0, K, y + n);
    for (; n < n1; ++n)
      for (int64_t m = 0; m < M; ++m)
        outputs_dot<TYPE, 1>(a, w + n * row_bytes, f, nblocks, row_bytes, m, K, y + m * N + n);
  });
}

#include "gguf_rows.h"
#include "gguf_krows.h"

// y (M, N) = the activations a times the weight w of ggml type `type` (one of the formats format_of knows): 2 rows
// or more of gguf_rows.h's formats there, of the K-quants (below gguf_gemm's rows) in gguf_krows.h, one row here.
template <int64_t TYPE>
void linear_of(const Act& a, const uint8_t* w, const Format& f, int64_t M, int64_t K, int64_t N, float* y) {
  if constexpr (shares_rows(TYPE))
    if (M >= 2) return linear_shared<TYPE>(a, w, f, M, K, N, y);
  if constexpr (shares_krows(TYPE))
    if (M >= 2) return linear_kshared<TYPE>(a, w, f, M, K, N, y);
  linear_rows<TYPE>(a, w, f, M, K, N, y);
}
inline void linear(int64_t type, const Act& a, const uint8_t* w, const Format& f, int64_t M, int64_t K, int64_t N,
                   float* y) {
  switch (type) {
#define CASE(T) case T: linear_of<T>(a, w, f, M, K, N, y); break;
    CASE(Q8_0) CASE(Q4_0) CASE(Q4_1) CASE(Q5_0) CASE(Q5_1) CASE(IQ4_NL) CASE(Q4_K) CASE(Q5_K) CASE(Q6_K) CASE(IQ4_XS)
    CASE(Q2_K) CASE(Q3_K)
#undef CASE
  }
}

#include "gguf_x8_dot.h"
