// Products of 2 or more activation rows (a speculative verify step's k + 1 tokens, a prompt) with weights of the
// 32-value GGUF formats, included by gguf_dot.h and so compiled as its AVX2 copy and its AVX-512 VNNI copy.
//
// Why: linear_rows runs block_dot once per (row, output), so each weight block is unpacked (nibbles split, fifth
// bits, the sign of signed codes, fp16 scales) once per row, and those steps are most of block_dot's work. Here each
// weight block is unpacked once and then multiplied by every row.
//
// Exactness: each (row, output) gets the same 8 int32 lanes per block as block_dot (the same instructions on the
// same bytes) and then the same fp32 operations in the same order, into that row's own accumulators: acc = fma(lanes,
// d * dx, acc) (Q8_0, Q5_0, Q4_1, Q5_1), acc1 += e * (q8_1 sum) (Q4_1, Q5_1), or each block's integer total by one fma
// into acc1 (Q4_0, IQ4_NL, as linear_rows' block pairs), and y = hsum(acc) + acc1. The rows' scalar steps (d * dx,
// acc1) run as 8-lane vectors, lane r for row r: lane by lane the same fp32 operations. So every row's result is the
// one-row product's bit for bit, whatever rows come with it (tests/kernels/test_gguf_rows.py). A change to block_dot's
// arithmetic must be made here too.

// Rows m0 .. m0 + MR's activations, 32-value blocks. Codes: row r's block i at q + 32 * (r * nb + i). The rest
// transposed, 8 floats (int32) per block, lane r for row r (lanes past MR zero): the fp32 steps of all rows at once,
// lane by lane the same operations as each row's own.
struct Rows32 {
  const int8_t* q;
  int64_t nb;
  const float* d8;    // scales
  const float* s8;    // q8_1 sums (Q4_1, Q5_1)
  const int32_t* o8;  // Q4_0's offsets, -8 * (sum of the block's codes)
};

// One weight block b (not Q4_0 / IQ4_NL) times block i of every row: acc[r] = fma(lanes, d * dx_r, acc[r]), and
// (Q4_1, Q5_1) lane r of acc1 += e * xs_r.
template <int64_t TYPE, int MR>
inline void rows_block(const uint8_t* b, const Rows32& x, int64_t i, __m256* acc, __m256& acc1) {
  const __m256 dd = _mm256_mul_ps(_mm256_set1_ps(half(b)), _mm256_loadu_ps(x.d8 + 8 * i));  // lane r: d * dx_r
  if constexpr (TYPE == Q8_0 || TYPE == Q5_0) {  // signed codes: |w| * (x with w's sign), as dot_ss
    __m256i w;
    if constexpr (TYPE == Q8_0) w = load32(b + 2);
    else w = _mm256_sub_epi8(_mm256_or_si256(nibbles_split(b + 6), bits_to_16(b + 2)), _mm256_set1_epi8(16));
    const __m256i u = _mm256_sign_epi8(w, w);
    for (int r = 0; r < MR; ++r) {
      const __m256i p = dot_us(u, _mm256_sign_epi8(load32(x.q + 32 * (r * x.nb + i)), w));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_permutevar8x32_ps(dd, _mm256_set1_epi32(r)), acc[r]);
    }
  } else {  // Q4_1, Q5_1: unsigned codes, and the mins times the q8_1 sums
    const __m256i u = TYPE == Q4_1 ? nibbles_split(b + 4) : _mm256_or_si256(nibbles_split(b + 8), bits_to_16(b + 4));
    for (int r = 0; r < MR; ++r) {
      const __m256i p = dot_us(u, load32(x.q + 32 * (r * x.nb + i)));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_permutevar8x32_ps(dd, _mm256_set1_epi32(r)), acc[r]);
    }
    acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(_mm256_set1_ps(half(b + 2)), _mm256_loadu_ps(x.s8 + 8 * i)));
  }
}

// Lane r: the total of v[r]'s 8 int32 lanes, for r < R (exact integers, so any order of the additions gives them)
template <int R>
inline __m256i totals(const __m256i* v) {
  auto at = [&](int r) { return r < R ? v[r] : _mm256_setzero_si256(); };
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(at(0), at(1)), _mm256_hadd_epi32(at(2), at(3)));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(at(4), at(5)), _mm256_hadd_epi32(at(6), at(7)));
  // a: rows 0-3's sums of lanes 0-3, then of lanes 4-7; b: rows 4-7's
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// Q4_0 / IQ4_NL: weight block b times block i of every row, its integer total (plus Q4_0's offset) by one fma into
// lane r of acc1, as linear_rows and block_dot sum each block (b32_lanes: unsigned nibbles, or IQ4_NL's values).
template <int64_t TYPE, int MR>
inline void rows_b32(const uint8_t* b, const Rows32& x, int64_t i, __m256& acc1) {
  const __m256i c = nibbles_split(b + 2), v = TYPE == Q4_0 ? c : iq4_lookup(c), u = _mm256_sign_epi8(v, v);
  __m256i lanes[MR];
  for (int r = 0; r < MR; ++r) {
    const __m256i xq = load32(x.q + 32 * (r * x.nb + i));
    lanes[r] = TYPE == Q4_0 ? dot_us(c, xq) : dot_us(u, _mm256_sign_epi8(xq, v));
  }
  __m256i t = totals<MR>(lanes);
  if constexpr (TYPE == Q4_0) t = _mm256_add_epi32(t, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.o8 + 8 * i)));
  const __m256 dd = _mm256_mul_ps(_mm256_set1_ps(half(b)), _mm256_loadu_ps(x.d8 + 8 * i));
  acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), dd, acc1);
}

// Rows32's transposed parts for rows m0 .. m0 + MR, in the vectors given
template <int64_t TYPE, int MR>
Rows32 rows32(const Act& a, int64_t m0, int64_t K, std::vector<float>& d8, std::vector<float>& s8,
              std::vector<int32_t>& o8) {
  const int64_t nb = K / 32;
  d8.assign(nb * 8, 0.f), s8.assign(a.s.empty() ? 0 : nb * 8, 0.f), o8.assign(nb * 8, 0);
  for (int64_t r = 0; r < MR; ++r)
    for (int64_t i = 0; i < nb; ++i) {
      const int64_t j = (m0 + r) * nb + i;
      d8[8 * i + r] = a.d[j];
      if (!a.s.empty()) s8[8 * i + r] = a.s[j];
      o8[8 * i + r] = b32_offset<TYPE>(a.s16.data() + 2 * j);
    }
  return Rows32{a.q.data() + m0 * K, nb, d8.data(), s8.data(), o8.data()};
}

// y rows m0 .. m0 + MR (of M), every output: each weight block unpacked once for the MR rows.
template <int64_t TYPE, int MR>
void shared_rows(const Act& a, const uint8_t* w, const Format& f, int64_t m0, int64_t K, int64_t N, float* y) {
  std::vector<float> d8, s8;
  std::vector<int32_t> o8;
  const Rows32 x = rows32<TYPE, MR>(a, m0, K, d8, s8, o8);
  const int64_t nb = x.nb, row_bytes = nb * f.bytes;
  at::parallel_for(0, N, std::max<int64_t>(1, 64 / MR), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wr = w + n * row_bytes;
      __m256 acc[MR], acc1 = _mm256_setzero_ps();
      for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t i = 0; i < nb; ++i) {
        _mm_prefetch(reinterpret_cast<const char*>(wr + i * f.bytes) + 1024, _MM_HINT_T0);
        if constexpr (TYPE == Q4_0 || TYPE == IQ4_NL) rows_b32<TYPE, MR>(wr + i * f.bytes, x, i, acc1);
        else rows_block<TYPE, MR>(wr + i * f.bytes, x, i, acc, acc1);
      }
      alignas(32) float one[8];
      _mm256_store_ps(one, acc1);
      for (int r = 0; r < MR; ++r) y[(m0 + r) * N + n] = hsum(acc[r]) + one[r];  // Q4_0, IQ4_NL: hsum(zero) + acc1
    }
  });
}

// run.template operator()<R>(m0) over M rows in chunks of kShareRows rows, the last the rest (one row alone as
// linear_rows does: the same arithmetic): the row-count dispatch of this file's and gguf_krows.h's shared loops.
template <typename Run>
void in_row_chunks(int64_t M, Run run) {
  for (int64_t m0 = 0; m0 < M; m0 += kShareRows) {
    switch (std::min(M - m0, kShareRows)) {
#define ROWS(R) case R: run.template operator()<R>(m0); break;
      ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
    }
  }
}

// y (M, N) for M >= 2 rows of a format that shares_rows (gguf_format.h)
template <int64_t TYPE>
void linear_shared(const Act& a, const uint8_t* w, const Format& f, int64_t M, int64_t K, int64_t N, float* y) {
  in_row_chunks(M, [&]<int R>(int64_t m0) { shared_rows<TYPE, R>(a, w, f, m0, K, N, y); });
}
