// CPU matrix-vector kernels for decoding: x @ W.T where W is read once per token, so speed is the rate weights
// stream from memory. AVX2 + FMA (x86-64 since 2013); llama/cpu_kernels.py builds this file (with decode_ops.cpp) on first use and
// falls back to PyTorch's kernels where it cannot.
//
// Quantized schemes multiply int8 codes by int8 codes, as llama.cpp does: each row of x is quantized on the fly in
// blocks of 32 (symmetric, round to nearest even, scale d = amax / 127), so a block's dot product is an exact int32
// sum of products, then scaled in fp32. A row's result never depends on the other rows of its batch: rows are
// tiled only to reuse the weights loaded into registers, and every row's sums run in the same order.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "check.h"
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

using namespace llama_cpu;

constexpr int64_t kBlock = 32;  // activation block (q8_0's)
constexpr int64_t kTile = 4;    // rows of x multiplied per load of a weight block
constexpr int64_t kTileVnni4 = 8;  // int4's VNNI tile: a row costs it 1 register (int4_tiles.h)
constexpr int64_t kTileBf16Stream = 8;  // bf16 products of up to 8 rows: one pass (float_tiles.h)

// Weights are read once, front to back: asking for the bytes kPrefetch ahead keeps more of the stream in flight
// than the hardware prefetcher alone, and the non-temporal hint keeps them from evicting what is reused (x, the
// scales' neighbours) on their way through (bf16 GEMV ~40 -> ~45-50 GB/s measured, docs/performance.md).
constexpr int64_t kPrefetch = 4096;
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p) + kPrefetch, _MM_HINT_NTA); }

// Integer dot product of 32 unsigned codes (0..127 at most) with 32 signed codes, as 8 int32 lanes.
inline __m256i dot_u8_s8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// One block's 32 int4 codes (16 bytes, even k in the low nibbles) as 32 bytes 0..15: the low nibbles, then the high.
inline __m256i unpack_nibbles(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}

// Memory aligned to a cache line: the VNNI tiles load 64 bytes of activation codes at a time, and from malloc's
// 16-byte alignment every such load would straddle two lines.
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
};
template <typename T>
using aligned_vector = std::vector<T, LineAligned<T>>;

// Activation rows quantized in blocks of 32, each row's codes in the order its product reads them (Layout,
// int4_tiles.h).
struct Blocks {
  aligned_vector<int8_t> q;   // (M, K)
  aligned_vector<float> d;    // (M, K / 32) scales
  aligned_vector<float> sum;  // (M, K / 32) d * sum of the block's codes
};

// One block's integer dot product of unsigned codes w with row block i of xb, as 8 fp32 lanes.
inline __m256 block_dot(__m256i w, const Blocks& xb, int64_t i) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.q.data() + i * kBlock));
  return _mm256_cvtepi32_ps(dot_u8_s8(w, xv));
}

// AVX-512 VNNI tiles (int4's and int8's) are compiled for it and run only where use_vnni() says so.
#define LLAMA_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

#include "int4_tiles.h"

// One block of 32 values quantized: its codes (round half to even of v / d, as std::nearbyint; vector division and
// rounding are IEEE's, the same as scalar) stored at slot, and d * their sum.
inline void quantize_block(const float* v, int8_t* q, const int64_t slot[kBlock], float& d_out, float& sum_out) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax = _mm256_setzero_ps();
  for (int j = 0; j < kBlock; j += 8) amax = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(v + j)), amax);
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  const float d = std::fmax(_mm_cvtss_f32(m), _mm_cvtss_f32(_mm_movehdup_ps(m))) / 127.f;
  alignas(32) int32_t c[kBlock] = {};
  if (d > 0.f)
    for (int j = 0; j < kBlock; j += 8)
      _mm256_store_si256(reinterpret_cast<__m256i*>(c + j),
                         _mm256_cvtps_epi32(_mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(v + j), _mm256_set1_ps(d)),
                                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
  int32_t total = 0;
  for (int j = 0; j < kBlock; ++j) total += c[j], q[slot[j]] = int8_t(c[j]);
  d_out = d;
  sum_out = d * float(total);
}

Blocks quantize_blocks(const float* x, int64_t M, int64_t K, Layout layout) {
  const int64_t nb = K / kBlock;
  Blocks out{aligned_vector<int8_t>(M * K), aligned_vector<float>(M * nb), aligned_vector<float>(M * nb)};
  at::parallel_for(0, M * nb, 64, [&](int64_t begin, int64_t end) {
    int64_t slot[kBlock];
    for (int64_t i = begin; i < end; ++i) {  // row i / nb, block i % nb: x + i * 32 == x + m * K + b * 32
      code_slots(layout, nb, i % nb, slot);
      quantize_block(x + i * kBlock, out.q.data() + (i / nb) * K, slot, out.d[i], out.sum[i]);
    }
  });
  return out;
}

void check_rows(const at::Tensor& x, int64_t K, const char* op) {
  LLAMA_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), op,
              ": x must be a contiguous 2-d float32 tensor");
  LLAMA_CHECK(x.size(1) == K, op, ": x has ", x.size(1), " inputs, the weight ", K);
  LLAMA_CHECK(K % kBlock == 0, op, ": the input size must be a multiple of 32, got ", K);
}

// The VNNI tiles' per-block scales: 8 blocks' scales in the low half of a vector, spread so that block pair p gets
// block 2p's scale in lanes 0-7 and block 2p + 1's in lanes 8-15, as the pair's dot products lie.
struct PairScales {
  __m512i pick[4];
  LLAMA_AVX512 PairScales() {
    for (int p = 0; p < 4; ++p)
      pick[p] = _mm512_inserti64x4(_mm512_set1_epi32(2 * p), _mm256_set1_epi32(2 * p + 1), 1);
  }
  LLAMA_AVX512 __m512 of(int p, __m512 eight) const { return _mm512_permutexvar_ps(pick[p], eight); }
};

// Whether q4_tile_vnni may run: the CPU has AVX-512 (F, BW, DQ, VL) and VNNI, and LLAMA_CPU_AVX512 is not "0" (read
// on every call, so a test can compare both tiles in one process).
bool use_vnni() {
  static const bool cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512vnni");
  const char* env = std::getenv("LLAMA_CPU_AVX512");
  return cpu && !(env && std::strcmp(env, "0") == 0);
}

// Rows [n0, n1) of y for rows m0 .. m0 + T of x: int8 weights with one scale per output row.
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

// q8_tile on CPUs with AVX-512 VNNI, rows of 8-block multiples: two blocks per 512-bit vector. vpdpbusd multiplies
// unsigned by signed bytes, so, as in q8_tile, |w| is the unsigned side and x takes w's sign (a masked negation;
// x's codes are within +-127). The integer sums are q8_tile's; the fp32 sums run in another order.
template <int T>
LLAMA_AVX512 void q8_tile_vnni(const Blocks& xb, int64_t m0, int64_t K, int64_t N, const int8_t* weight,
                               const float* scales, int64_t n0, int64_t n1, float* y) {
  const int64_t nb = K / kBlock;
  const PairScales pair_scales;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = weight + n * K;
    __m512 acc[T][2];
    for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
    for (int64_t b8 = 0; b8 < nb; b8 += 8) {
      __m512 ds[T];
      for (int t = 0; t < T; ++t) ds[t] = _mm512_castps256_ps512(_mm256_loadu_ps(xb.d.data() + (m0 + t) * nb + b8));
      for (int p = 0; p < 4; ++p) {
        const int8_t* wp = wr + (b8 + 2 * p) * kBlock;
        if (T > 1) prefetch(wp);  // one row of x: the hardware prefetcher alone is faster (bf16_tile_dot's note)
        const __m512i w = _mm512_loadu_si512(wp);
        const __mmask64 negative = _mm512_movepi8_mask(w);
        const __m512i aw = _mm512_abs_epi8(w);
        for (int t = 0; t < T; ++t) {
          const __m512i xv = _mm512_loadu_si512(xb.q.data() + ((m0 + t) * nb + b8 + 2 * p) * kBlock);
          const __m512i sx = _mm512_mask_sub_epi8(xv, negative, _mm512_setzero_si512(), xv);
          const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, sx));
          acc[t][p & 1] = _mm512_fmadd_ps(dot, pair_scales.of(p, ds[t]), acc[t][p & 1]);
        }
      }
    }
    for (int t = 0; t < T; ++t)
      y[(m0 + t) * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t][0], acc[t][1])) * scales[n];
  }
}

#include "float_tiles.h"

// Splits the output rows over threads, and each thread's rows over tiles of x's rows. With more rows of x than one
// tile, a thread takes its weight rows in chunks of about kChunkBytes, small enough to stay in L2 while every tile
// passes over them, so a prefill reads the weights from memory once instead of once per tile. The order in which
// any (row, output) pair is summed is the same either way.
constexpr int64_t kChunkBytes = 128 << 10;

template <typename Tile>
at::Tensor run_tiles(int64_t M, int64_t N, int64_t row_bytes, const at::Tensor& like, Tile tile,
                     int64_t tile_rows = kTile) {
  at::Tensor y = at::empty({M, N}, like.options().dtype(at::kFloat));
  float* out = y.data_ptr<float>();
  const int64_t chunk = M <= tile_rows ? N : std::max<int64_t>(4, kChunkBytes / std::max<int64_t>(row_bytes, 1));
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t c0 = n0; c0 < n1; c0 += chunk) {
      const int64_t c1 = std::min(n1, c0 + chunk);
      for (int64_t m0 = 0; m0 < M; m0 += tile_rows) tile(m0, std::min(tile_rows, M - m0), c0, c1, out);
    }
  });
  return y;
}

#define DISPATCH_TILE(T_, CALL) \
  switch (T_) {                 \
    case 1: CALL(1); break;     \
    case 2: CALL(2); break;     \
    case 3: CALL(3); break;     \
    default: CALL(4); break;    \
  }
#define DISPATCH_TILE8(T_, CALL) \
  switch (T_) {                  \
    case 1: CALL(1); break;      \
    case 2: CALL(2); break;      \
    case 3: CALL(3); break;      \
    case 4: CALL(4); break;      \
    case 5: CALL(5); break;      \
    case 6: CALL(6); break;      \
    case 7: CALL(7); break;      \
    default: CALL(8); break;     \
  }

}  // namespace

namespace llama_cpu {

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t group_size) {
  const int64_t N = codes.size(0), K = codes.size(1) * 2;
  check_rows(x, K, "int4_linear");
  LLAMA_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous(), "int4_linear: codes must be contiguous uint8");
  LLAMA_CHECK(group_size % kBlock == 0, "int4_linear: group size must be a multiple of 32, got ", group_size);
  const int64_t groups = (K + group_size - 1) / group_size;
  LLAMA_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == N && scales.size(1) == groups && scales.size(2) == 2,
              "int4_linear: scales must be contiguous bf16 of shape (", N, ", ", groups, ", 2)");
  const int64_t M = x.size(0), nb = K / kBlock, bpg = group_size / kBlock;
  const bool vnni = nb % 8 == 0 && use_vnni();
  const Layout layout = vnni ? Layout::Groups16 : nb % 8 == 0 ? Layout::Groups8 : Layout::Interleave;
  const Blocks xb = quantize_blocks(x.data_ptr<float>(), M, K, layout);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  const int64_t row_bytes = K / 2 + groups * 4;
  if (vnni)
    return run_tiles(M, N, row_bytes, x, [&](int64_t m0, int64_t t, int64_t n0, int64_t n1, float* y) {
#define CALL(T) q4_tile_vnni<T>(xb, m0, K, N, c, s, groups, bpg, n0, n1, y)
      DISPATCH_TILE8(t, CALL)
#undef CALL
    }, kTileVnni4);
  if (nb % 8 == 0)
    return run_tiles(M, N, row_bytes, x, [&](int64_t m0, int64_t t, int64_t n0, int64_t n1, float* y) {
#define CALL(T) q4_tile<T>(xb, m0, K, N, c, s, groups, bpg, n0, n1, y)
      DISPATCH_TILE(t, CALL)
#undef CALL
    });
  std::vector<float> group_sum(M * groups, 0.f);  // sum over a group of d * sum of codes, per row
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) group_sum[m * groups + b / bpg] += xb.sum[m * nb + b];
  return run_tiles(M, N, row_bytes, x, [&](int64_t m0, int64_t t, int64_t n0, int64_t n1, float* y) {
#define CALL(T) q4_tile_groups<T>(xb, group_sum, m0, K, N, c, s, groups, bpg, n0, n1, y)
    DISPATCH_TILE(t, CALL)
#undef CALL
  });
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  const int64_t N = weight.size(0), K = weight.size(1);
  check_rows(x, K, "int8_linear");
  LLAMA_CHECK(weight.scalar_type() == at::kChar && weight.is_contiguous(), "int8_linear: weight must be contiguous int8");
  LLAMA_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N,
              "int8_linear: scales must be ", N, " contiguous float32 values");
  const int64_t M = x.size(0);
  const Blocks xb = quantize_blocks(x.data_ptr<float>(), M, K, Layout::Plain);
  const int8_t* w = weight.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  if ((K / kBlock) % 8 == 0 && use_vnni())
    return run_tiles(M, N, K, x, [&](int64_t m0, int64_t t, int64_t n0, int64_t n1, float* y) {
#define CALL(T) q8_tile_vnni<T>(xb, m0, K, N, w, s, n0, n1, y)
      DISPATCH_TILE(t, CALL)
#undef CALL
    });
  return run_tiles(M, N, K, x, [&](int64_t m0, int64_t t, int64_t n0, int64_t n1, float* y) {
#define CALL(T) q8_tile<T>(xb, m0, K, N, w, s, n0, n1, y)
    DISPATCH_TILE(t, CALL)
#undef CALL
  });
}

// x @ W.T for a bf16 or fp32 weight, summed in fp32. x is fp32, or bf16 (taken as is by bf16_tile_dot where it
// runs, else widened to fp32).
at::Tensor float_linear(const at::Tensor& x_in, const at::Tensor& weight) {
  const int64_t N = weight.size(0), K = weight.size(1);
  LLAMA_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16) &&
                  x_in.is_contiguous() && x_in.size(1) == K,
              "float_linear: x must be contiguous float32 or bf16 of shape (M, ", K, ")");
  LLAMA_CHECK((weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat) && weight.is_contiguous(),
              "float_linear: weight must be contiguous bf16 or float32");
  if (x_in.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 && use_bf16_dot()) {
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x_in.data_ptr<at::BFloat16>());
    const uint16_t* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
    if (x_in.size(0) <= kTileBf16Stream)  // a decode or verify step: one tile, the weights streamed once
      return run_tiles(x_in.size(0), N, K * 2, x_in, [&](int64_t m0, int64_t t, int64_t n0, int64_t n1, float* y) {
#define CALL(T) bf16_tile_dot<T>(xp, m0, K, N, w, n0, n1, y, true)
        DISPATCH_TILE8(t, CALL)
#undef CALL
      }, kTileBf16Stream);
    return run_tiles(x_in.size(0), N, K * 2, x_in, [&](int64_t m0, int64_t t, int64_t n0, int64_t n1, float* y) {
#define CALL(T) bf16_tile_dot<T>(xp, m0, K, N, w, n0, n1, y, false)
      DISPATCH_TILE(t, CALL)
#undef CALL
    });
  }
  const at::Tensor x = x_in.to(at::kFloat);
  const float* xp = x.data_ptr<float>();
  if (weight.scalar_type() == at::kFloat) {
    const float* w = weight.data_ptr<float>();
    return run_tiles(x.size(0), N, K * 4, x, [&](int64_t m0, int64_t t, int64_t n0, int64_t n1, float* y) {
#define CALL(T) float_tile<T>(xp, m0, K, N, w, n0, n1, y)
      DISPATCH_TILE(t, CALL)
#undef CALL
    });
  }
  const uint16_t* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  const at::Tensor xs = evens_odds(x);
  xp = xs.data_ptr<float>();
  return run_tiles(x.size(0), N, K * 2, x, [&](int64_t m0, int64_t t, int64_t n0, int64_t n1, float* y) {
#define CALL(T) float_tile<T>(xp, m0, K, N, w, n0, n1, y)
    DISPATCH_TILE(t, CALL)
#undef CALL
  });
}

}  // namespace llama_cpu

namespace {

// The bf16 weight an int4 weight stands for, (code - 8) * scale + zero computed in fp32 (quant_int4.dequantize_codes's
// order of operations) and rounded to nearest even: what a prefill hands to oneDNN's bf16 GEMM, a slice of rows at a
// time (llama/cpu_kernels.py). Only where the CPU has AVX-512 BF16 (whatever LLAMA_CPU_AVX512 says: it picks our
// tiles), the only place that GEMM is used for it.
LLAMA_AVX512_BF16 void int4_rows_to_bf16(const uint8_t* codes, const uint16_t* scales, int64_t K, int64_t groups,
                                         int64_t group_size, int64_t n0, int64_t n1, uint16_t* out) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m512 eight = _mm512_set1_ps(8.f);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* c = codes + n * (K / 2);
    const uint16_t* sz = scales + n * groups * 2;
    uint16_t* o = out + n * K;
    for (int64_t k = 0; k < K; k += 32) {
      const int64_t g = k / group_size;
      const __m512 s = _mm512_set1_ps(bf16_to_float(sz[2 * g])), z = _mm512_set1_ps(bf16_to_float(sz[2 * g + 1]));
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + k / 2));
      const __m128i lo = _mm_and_si128(raw, low4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
      __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));  // k .. k + 15
      __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)));  // k + 16 .. k + 31
      a = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(a, eight), s), z);
      b = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(b, eight), s), z);
      _mm512_storeu_si512(o + k, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
  }
}

at::Tensor int4_to_bf16(const at::Tensor& codes, const at::Tensor& scales, int64_t group_size) {
  LLAMA_CHECK(has_bf16_dot(), "int4_to_bf16: needs a CPU with AVX-512 BF16");
  LLAMA_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.is_contiguous(),
              "int4_to_bf16: codes must be contiguous uint8 of shape (N, K / 2)");
  const int64_t N = codes.size(0), K = codes.size(1) * 2;
  LLAMA_CHECK(K % kBlock == 0 && group_size % kBlock == 0, "int4_to_bf16: K and the group size must be multiples of 32");
  const int64_t groups = (K + group_size - 1) / group_size;
  LLAMA_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == N && scales.size(1) == groups && scales.size(2) == 2,
              "int4_to_bf16: scales must be contiguous bf16 of shape (", N, ", ", groups, ", 2)");
  at::Tensor out = at::empty({N, K}, codes.options().dtype(at::kBFloat16));
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { int4_rows_to_bf16(c, s, K, groups, group_size, n0, n1, o); });
  return out;
}

// The same for an int8 weight with a scale per row (int8-dynamic's): code * scale in fp32
// (quantize.dequantize_weight's product), rounded to nearest even.
LLAMA_AVX512_BF16 void int8_rows_to_bf16(const int8_t* weight, const float* scales, int64_t K, int64_t n0, int64_t n1,
                                         uint16_t* out) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* w = weight + n * K;
    const __m512 s = _mm512_set1_ps(scales[n]);
    for (int64_t k = 0; k < K; k += 32) {
      const __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k)))), s);
      const __m512 b = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k + 16)))), s);
      _mm512_storeu_si512(out + n * K + k, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
  }
}

at::Tensor int8_to_bf16(const at::Tensor& weight, const at::Tensor& scales) {
  LLAMA_CHECK(has_bf16_dot(), "int8_to_bf16: needs a CPU with AVX-512 BF16");
  LLAMA_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.size(1) % kBlock == 0,
              "int8_to_bf16: weight must be contiguous int8 of shape (N, K), K a multiple of 32");
  const int64_t N = weight.size(0), K = weight.size(1);
  LLAMA_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N,
              "int8_to_bf16: scales must be ", N, " contiguous float32 values");
  at::Tensor out = at::empty({N, K}, weight.options().dtype(at::kBFloat16));
  const int8_t* w = weight.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { int8_rows_to_bf16(w, s, K, n0, n1, o); });
  return out;
}

}  // namespace

TORCH_LIBRARY(llama_cpu, m) {
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scales, int group_size) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scales) -> Tensor");
  m.def("float_linear(Tensor x, Tensor weight) -> Tensor");
  m.def("int4_to_bf16(Tensor codes, Tensor scales, int group_size) -> Tensor");
  m.def("int8_to_bf16(Tensor weight, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(llama_cpu, CPU, m) {
  m.impl("int4_linear", llama_cpu::int4_linear);
  m.impl("int8_linear", llama_cpu::int8_linear);
  m.impl("float_linear", llama_cpu::float_linear);
  m.impl("int4_to_bf16", int4_to_bf16);
  m.impl("int8_to_bf16", int8_to_bf16);
}
