// The bf16 and fp32 weight tiles of float_linear (cpu_kernels.cpp, inside its anonymous namespace): fp32 sums of
// bf16-widened or fp32 weights, and AVX-512 BF16's vdpbf16ps for bf16 activations. Moved out of cpu_kernels.cpp
// to keep that file under 500 lines; included once, there, after prefetch() and the AVX-512 target macros.
#pragma once

// 16 weights widened to fp32. bf16 is the high half of an fp32, so a 32-bit lane holding elements (2i, 2i+1) gives
// element 2i shifted up and element 2i+1 masked, without shuffles (which would limit the rate): w0 holds the even
// elements of the 16 and w1 the odd ones, and x must be in that order (evens_odds). fp32 weights: as they are.
inline void load16(const uint16_t* w, __m256& w0, __m256& w1) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  w0 = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  w1 = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
}
inline void load16(const float* w, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(w);
  w1 = _mm256_loadu_ps(w + 8);
}
inline float to_float(uint16_t b) { return bf16_to_float(b); }
inline float to_float(float f) { return f; }

// x with each whole block of 16 reordered as its 8 even elements, then its 8 odd ones (the bf16 weights' order).
at::Tensor evens_odds(const at::Tensor& x) {
  at::Tensor out = x.clone();
  const int64_t M = x.size(0), K = x.size(1);
  const float* src = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k + 16 <= K; k += 16)
      for (int64_t j = 0; j < 16; ++j) dst[m * K + k + (j % 2) * 8 + j / 2] = src[m * K + k + j];
  return out;
}

// Rows [n0, n1) of y for rows m0 .. m0 + T of x: bf16 or fp32 weights, fp32 activations and sums.
template <int T, typename W>
void float_tile(const float* x, int64_t m0, int64_t K, int64_t N, const W* weight, int64_t n0, int64_t n1,
                float* y) {
  const int64_t k16 = K / 16 * 16;
  for (int64_t n = n0; n < n1; ++n) {
    const W* wr = weight + n * K;
    __m256 acc[T][2];
    for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < k16; k += 16) {
      __m256 w0, w1;
      prefetch(wr + k);
      load16(wr + k, w0, w1);
      for (int t = 0; t < T; ++t) {
        const float* xr = x + (m0 + t) * K + k;
        acc[t][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc[t][0]);
        acc[t][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), acc[t][1]);
      }
    }
    for (int t = 0; t < T; ++t) {
      float s = hsum(_mm256_add_ps(acc[t][0], acc[t][1]));
      for (int64_t k = k16; k < K; ++k) s += to_float(wr[k]) * x[(m0 + t) * K + k];
      y[(m0 + t) * N + n] = s;
    }
  }
}

// float_tile for bf16 weights and bf16 activations on CPUs with AVX-512 BF16: vdpbf16ps multiplies 16 pairs of bf16
// (each product exact in fp32) and adds every pair's sum into an fp32 lane, 32 products per instruction where
// float_tile widens the weights first and does 8 per FMA. Only for activations that are bf16 already (a bf16 model's),
// so nothing is rounded that was not. Each row of x is summed in 32-element vectors over two accumulators in the
// same order whatever T, the last vector masked to K; the sums run in another order than float_tile's.
#define LLAMA_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// Weight rows n .. n + R of y for rows m0 .. m0 + T of x: each activation vector loaded once for R weight rows.
template <int T, int R>
LLAMA_AVX512_BF16 inline void bf16_rows_dot(const uint16_t* x, int64_t m0, int64_t K, int64_t N,
                                            const uint16_t* weight, int64_t n, float* y) {
  const int64_t full = K / 32, tail = K % 32;
  const __mmask32 last = __mmask32((1u << tail) - 1);
  __m512 acc[T][R][2];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) acc[t][r][0] = acc[t][r][1] = _mm512_setzero_ps();
  // vector v of every row into accumulator j (== v % 2); masked: the last, partial vector
  auto step = [&](int64_t v, int j, bool masked) LLAMA_AVX512_BF16 {
    __m512i w[R];
    for (int r = 0; r < R; ++r) {
      const uint16_t* wp = weight + (n + r) * K + v * 32;
      if (R > 1) prefetch(wp);  // one weight row at a time: the hardware prefetcher alone (below)
      w[r] = masked ? _mm512_maskz_loadu_epi16(last, wp) : _mm512_loadu_si512(wp);
    }
    for (int t = 0; t < T; ++t) {
      const uint16_t* xp = x + (m0 + t) * K + v * 32;
      const __m512i xv = masked ? _mm512_maskz_loadu_epi16(last, xp) : _mm512_loadu_si512(xp);
      for (int r = 0; r < R; ++r) acc[t][r][j] = _mm512_dpbf16_ps(acc[t][r][j], (__m512bh)xv, (__m512bh)w[r]);
    }
  };
  int64_t v = 0;
  for (; v + 2 <= full; v += 2) step(v, 0, false), step(v + 1, 1, false);
  if (v < full) step(v, 0, false), ++v;
  if (tail) step(v, int(v & 1), true);
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r)
      y[(m0 + t) * N + n + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t][r][0], acc[t][r][1]));
}

// One row of x (batch-1 decode) reads the weights as a single stream, one row after the next, and leaves the
// prefetching to the hardware: pairs of rows 8 KB apart (K = 4096) and the software prefetch each cost a third of
// the 7B model's batch-1 rate on this machine (docs/performance.md, "At 7B"). So does a product of up to 8 rows
// (`stream`: a speculative verify step, whose weights also come from memory once; 4 rows of a 7B-width step cost
// 1.30 one-row steps this way, 1.60 with three weight rows per pass). Only the tiles of a prefill, whose weights
// come from L2 again for every tile (run_tiles), run several weight rows per pass with the prefetch. A row's sums
// run in the same order either way.
template <int T>
LLAMA_AVX512_BF16 void bf16_tile_dot(const uint16_t* x, int64_t m0, int64_t K, int64_t N, const uint16_t* weight,
                                     int64_t n0, int64_t n1, float* y, bool stream) {
  int64_t n = n0;
  if (T == 1 || stream) {
    for (; n < n1; ++n) bf16_rows_dot<T, 1>(x, m0, K, N, weight, n, y);
    return;
  }
  // Three weight rows per pass: 24 accumulators, 3 weight vectors and one of x fill 28 of the 32 registers, and
  // every vector of x loaded serves three rows instead of two (3-7 % faster than pairs on 7B-shaped layers at 16-64
  // rows, 5-13 % on 1.38B's; docs/performance-history.md, "Prefill at 7B (2026-11-25)").
  for (; n + 3 <= n1; n += 3) bf16_rows_dot<T, 3>(x, m0, K, N, weight, n, y);
  if (n + 2 <= n1) bf16_rows_dot<T, 2>(x, m0, K, N, weight, n, y), n += 2;
  if (n < n1) bf16_rows_dot<T, 1>(x, m0, K, N, weight, n, y);
}

// Whether the CPU has AVX-512 (F, BW, VL) and BF16.
bool has_bf16_dot() {
  static const bool cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  return cpu;
}

// Whether bf16_tile_dot may run: has_bf16_dot(), and LLAMA_CPU_AVX512 is not "0".
bool use_bf16_dot() {
  const char* env = std::getenv("LLAMA_CPU_AVX512");
  return has_bf16_dot() && !(env && std::strcmp(env, "0") == 0);
}
