// Products of 2 to kShareRows activation rows (a speculative verify step's k + 1 tokens) with weights of the 32-value
// GGUF formats, included by gguf_dot.h and so compiled as its AVX2 copy and its AVX-512 VNNI copy.
//
// Why: linear_rows runs block_dot once per (row, output), so each weight block is unpacked (nibbles split, fifth
// bits, the sign of signed codes, fp16 scales) once per row, and those steps are most of block_dot's work. Here each
// weight block is unpacked once and then multiplied by every row.
//
// Exactness: each (row, output) gets the same 8 int32 lanes per block as block_dot (the same instructions on the
// same bytes) and then the same fp32 operations in the same order, into that row's own accumulators: acc = fma(lanes,
// d * dx, acc) (Q8_0, Q5_0, Q4_1, Q5_1), acc1 += e * (q8_1 sum) (Q4_1, Q5_1), or linear_rows' block pairs' integer
// totals by one fma each into acc1 (Q4_0, IQ4_NL), and y = hsum(acc) + acc1. So every row's result is the one-row
// product's bit for bit, whatever rows come with it (tests/kernels/test_gguf_rows.py). A change to block_dot's
// arithmetic must be made here too.

// Rows m0 .. m0 + MR's activations, 32-value blocks: row r's block i is entry j = r * nb + i
struct Rows32 {
  const int8_t* q;  // codes, 32 per block
  const float* d;   // scales
  const float* s;   // q8_1 sums
  const int32_t* s16;  // 16-value sums, 2 per block
  int64_t nb;
};

// One weight block b (not Q4_0 / IQ4_NL) times block i of every row, into each row's acc and acc1.
template <int64_t TYPE, int MR>
inline void rows_block(const uint8_t* b, const Rows32& x, int64_t i, __m256* acc, float* acc1) {
  const float d = half(b);
  if constexpr (TYPE == Q8_0 || TYPE == Q5_0) {  // signed codes: |w| * (x with w's sign), as dot_ss
    __m256i w;
    if constexpr (TYPE == Q8_0) w = load32(b + 2);
    else w = _mm256_sub_epi8(_mm256_or_si256(nibbles_split(b + 6), bits_to_16(b + 2)), _mm256_set1_epi8(16));
    const __m256i u = _mm256_sign_epi8(w, w);
    for (int r = 0; r < MR; ++r) {
      const int64_t j = r * x.nb + i;
      const __m256i p = dot_us(u, _mm256_sign_epi8(load32(x.q + 32 * j), w));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * x.d[j]), acc[r]);
    }
  } else {  // Q4_1, Q5_1: unsigned codes, and the mins times the q8_1 sums
    const __m256i u = TYPE == Q4_1 ? nibbles_split(b + 4) : _mm256_or_si256(nibbles_split(b + 8), bits_to_16(b + 4));
    const float e = half(b + 2);
    for (int r = 0; r < MR; ++r) {
      const int64_t j = r * x.nb + i;
      const __m256i p = dot_us(u, load32(x.q + 32 * j));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * x.d[j]), acc[r]);
      acc1[r] += e * x.s[j];
    }
  }
}

// Q4_0 / IQ4_NL: the 8 lanes of weight codes c (nibbles) times x, as b32_lanes; v: IQ4_NL's values, u their size
template <int64_t TYPE>
inline __m256i b32_lanes_of(__m256i c, __m256i v, __m256i u, __m256i x) {
  if constexpr (TYPE == Q4_0) return dot_us(c, x);
  else return dot_us(u, _mm256_sign_epi8(x, v));
}

// Q4_0 / IQ4_NL: blocks i and i + 1 (PAIR) or block i alone, each block's integer total by one fma into acc1, as
// linear_rows' pairs and block_dot's last block sum them.
template <int64_t TYPE, int MR, bool PAIR>
inline void rows_b32(const uint8_t* b, int64_t bytes, const Rows32& x, int64_t i, float* acc1) {
  __m256i c[2], v[2], u[2];
  float d[2];
  for (int t = 0; t < 1 + PAIR; ++t) {
    c[t] = nibbles_split(b + t * bytes + 2), d[t] = half(b + t * bytes);
    v[t] = TYPE == Q4_0 ? c[t] : iq4_lookup(c[t]), u[t] = _mm256_sign_epi8(v[t], v[t]);
  }
  for (int r = 0; r < MR; ++r) {
    const int64_t j = r * x.nb + i;
    const int8_t* xq = x.q + 32 * j;
    const int32_t* s16 = x.s16 + 2 * j;
    if constexpr (PAIR) {
      int32_t s0, s1;
      hsum_i32_pair(b32_lanes_of<TYPE>(c[0], v[0], u[0], load32(xq)),
                    b32_lanes_of<TYPE>(c[1], v[1], u[1], load32(xq + 32)), s0, s1);
      acc1[r] = std::fma(float(s0 + b32_offset<TYPE>(s16)), d[0] * x.d[j], acc1[r]);
      acc1[r] = std::fma(float(s1 + b32_offset<TYPE>(s16 + 2)), d[1] * x.d[j + 1], acc1[r]);
    } else {
      const int32_t s = hsum_i32(b32_lanes_of<TYPE>(c[0], v[0], u[0], load32(xq)));
      acc1[r] = std::fma(float(s + b32_offset<TYPE>(s16)), d[0] * x.d[j], acc1[r]);
    }
  }
}

// y rows m0 .. m0 + MR (of M), every output: each weight block unpacked once for the MR rows.
template <int64_t TYPE, int MR>
void shared_rows(const Act& a, const uint8_t* w, const Format& f, int64_t m0, int64_t K, int64_t N, float* y) {
  const int64_t nb = K / 32, row_bytes = nb * f.bytes;
  const Rows32 x{a.q.data() + m0 * K, a.d.data() + m0 * nb, a.s.empty() ? nullptr : a.s.data() + m0 * nb,
                 a.s16.data() + m0 * K / 16, nb};
  at::parallel_for(0, N, std::max<int64_t>(1, 64 / MR), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wr = w + n * row_bytes;
      __m256 acc[MR];
      float acc1[MR];
      for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps(), acc1[r] = 0.f;
      int64_t i = 0;
      if constexpr (TYPE == Q4_0 || TYPE == IQ4_NL) {
        for (; i + 1 < nb; i += 2) {
          _mm_prefetch(reinterpret_cast<const char*>(wr + i * f.bytes) + 1024, _MM_HINT_T0);
          rows_b32<TYPE, MR, true>(wr + i * f.bytes, f.bytes, x, i, acc1);
        }
        if (i < nb) rows_b32<TYPE, MR, false>(wr + i * f.bytes, f.bytes, x, i, acc1);
      } else {
        for (; i < nb; ++i) {
          _mm_prefetch(reinterpret_cast<const char*>(wr + i * f.bytes) + 1024, _MM_HINT_T0);
          rows_block<TYPE, MR>(wr + i * f.bytes, x, i, acc, acc1);
        }
      }
      for (int r = 0; r < MR; ++r) y[(m0 + r) * N + n] = hsum(acc[r]) + acc1[r];
    }
  });
}

// y (M, N) for 2 <= M <= kShareRows (gguf_format.h) rows of a format that shares_rows
template <int64_t TYPE>
void linear_shared(const Act& a, const uint8_t* w, const Format& f, int64_t M, int64_t K, int64_t N, float* y) {
  switch (M) {
#define ROWS(R) case R: shared_rows<TYPE, R>(a, w, f, 0, K, N, y); break;
    ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
  }
}
