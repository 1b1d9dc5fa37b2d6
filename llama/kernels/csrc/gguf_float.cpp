// Products with GGUF block weights and fp32 activations: each 32-value chunk of a weight row is decoded in registers
// to fp32 codes with its scales and offset (value = scale * code + offset), and multiplied by the activations in
// fp32. Nothing is quantized on the activation side, so the result is the dequantized file's product to fp32
// rounding.
//
// Why: llama.cpp's CPU arithmetic (gguf_blocks.cpp, int8 activation blocks) answers wrongly at near-ties on small
// models: SmolLM2-135M Q4_1 answers "What is the capital of France?" with nonsense while the same file dequantized
// says Paris (docs/performance.md, "Quality of the default arithmetic"). The default is gguf_x16.cpp's int16
// activation blocks, as close to the file and faster; this path is LLAMA_GGUF_ACTIVATIONS=float, and it runs the
// formats gguf_x16.cpp does not decode. int8 activations stay available (LLAMA_GGUF_ACTIVATIONS=int8).
//
// Exactness: every output (row m, column n) is summed by the same operations in the same order (row_dot), whether
// its row goes alone or beside another, so a row's result never depends on the other rows of its batch or on the
// thread split (tests/kernels/test_gguf_float.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "check.h"
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#pragma GCC target("f16c")  // every AVX2 CPU has F16C (llama/kernels/cpu.py requires it): fp16 scales in one op

namespace {

#include "gguf_format.h"
#include "gguf_simd.h"

}  // namespace

namespace llama_cpu {
void gguf_dequantize_block(int64_t type, const uint8_t* b, float* out);  // gguf_blocks.cpp (scalar, every type)
}

namespace {

inline __m256 cvt_u8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); }  // low 8 bytes
inline __m256 cvt_i8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)); }

// A 32-value chunk of a weight row: codes (4 x 8 fp32), a scale for values 0-15 and one for 16-31, and an offset
// added to every value: value = scale * code + offset.
struct Chunk {
  __m256 q[4];
  float s0, s1, offset;
  uint8_t sc[8], mn[8];  // Q4_K: the block's 6-bit scales and mins, unpacked at its chunk 0
};

// Q4_0 and Q4_1's 16 bytes of nibbles without byte shuffles: vector d is bytes 4d..4d+3 broadcast and shifted
// per lane, values [4d .. 4d + 3, 16 + 4d .. 16 + 4d + 3]: the activations go in that order too (lane_order).
inline __attribute__((always_inline)) void nibble_lanes(const uint8_t* qs, Chunk& c) {
  const __m256i shifts = _mm256_setr_epi32(0, 8, 16, 24, 4, 12, 20, 28), m = _mm256_set1_epi32(0x0F);
  for (int d = 0; d < 4; ++d) {
    int32_t word;
    std::memcpy(&word, qs + 4 * d, 4);
    c.q[d] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), m));
  }
}

// Q8_0's 32 codes without byte shuffles: vector v is bytes 8v..8v+7 broadcast, each lane's byte shifted to the top
// and back with its sign: values [8v, 8v + 4, 8v + 1, 8v + 5, 8v + 2, 8v + 6, 8v + 3, 8v + 7].
inline __attribute__((always_inline)) void byte_lanes(const uint8_t* qs, Chunk& c) {
  const __m256i shifts = _mm256_setr_epi32(24, 24, 16, 16, 8, 8, 0, 0);
  for (int v = 0; v < 4; ++v) {
    int64_t word;
    std::memcpy(&word, qs + 8 * v, 8);
    c.q[v] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_sllv_epi32(_mm256_set1_epi64x(word), shifts), 24));
  }
}

// Whether a format's chunk codes come in nibble_lanes' or byte_lanes' order, and which value of its 32 each
// position holds.
constexpr bool in_lanes(int64_t type) { return type == Q4_0 || type == Q4_1 || type == Q8_0; }
inline int lane_value(int64_t type, int pos) {
  const int v = pos / 8, l = pos % 8;
  if (type == Q8_0) return 8 * v + (l % 2) * 4 + l / 2;
  return l < 4 ? 4 * v + l : 16 + 4 * v + (l - 4);
}

inline __attribute__((always_inline)) void signed_codes(__m128i lo, __m128i hi, Chunk& c) {
  c.q[0] = cvt_i8(lo), c.q[1] = cvt_i8(_mm_srli_si128(lo, 8)), c.q[2] = cvt_i8(hi), c.q[3] = cvt_i8(_mm_srli_si128(hi, 8));
}

// Chunk j of block b, for the formats most files hold (vector_type); the others are dequantized by the scalar code.
template <int64_t TYPE>
LLAMA_INLINE void chunk_of(const uint8_t* b, int j, Chunk& c) {
  switch (TYPE) {
    case Q4_0: {
      const float d = half_f16c(b);
      nibble_lanes(b + 2, c);
      c.s0 = c.s1 = d, c.offset = -8.f * d;
      return;
    }
    case Q4_1:
      nibble_lanes(b + 4, c);
      c.s0 = c.s1 = half_f16c(b), c.offset = half_f16c(b + 2);
      return;
    case Q8_0:
      byte_lanes(b + 2, c);
      c.s0 = c.s1 = half_f16c(b), c.offset = 0.f;
      return;
    case IQ4_NL: {
      __m128i lo, hi;
      iq4_values16(b + 2, lo, hi);
      signed_codes(lo, hi, c);
      c.s0 = c.s1 = half_f16c(b), c.offset = 0.f;
      return;
    }
    case Q4_K: {  // sub-block j: the 32 bytes of pair j / 2, low nibbles for even j; d sc[j] q - dmin m[j]
      if (j == 0) scale_min_k4(b + 4, c.sc, c.mn);
      const __m128i m = _mm_set1_epi8(0x0F);
      const __m128i* src = reinterpret_cast<const __m128i*>(b + 16 + 32 * (j / 2));
      const int shift = 4 * (j % 2);
      const __m128i lo = _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128(src), shift), m);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128(src + 1), shift), m);
      c.q[0] = cvt_u8(lo), c.q[1] = cvt_u8(_mm_srli_si128(lo, 8)), c.q[2] = cvt_u8(hi), c.q[3] = cvt_u8(_mm_srli_si128(hi, 8));
      c.s0 = c.s1 = half_f16c(b) * float(c.sc[j]), c.offset = -(half_f16c(b + 2) * float(c.mn[j]));
      return;
    }
    case Q6_K: {  // chunk j = 4 h + part: values 128 h + 32 part ...; d sc[i / 16] (q - 32)
      const int h = j / 4, part = j % 4;
      const __m256i lowsrc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32 * (part % 2)));
      const __m256i low = _mm256_and_si256(_mm256_srli_epi16(lowsrc, 4 * (part / 2)), _mm256_set1_epi8(0x0F));
      const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
      const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(high, 2 * part), _mm256_set1_epi8(3));
      const __m256i q = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(hb, 4)), _mm256_set1_epi8(32));
      signed_codes(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1), c);
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = half_f16c(b + 208);
      c.s0 = d * float(sc[2 * j]), c.s1 = d * float(sc[2 * j + 1]), c.offset = 0.f;
      return;
    }
  }
}

constexpr bool vector_type(int64_t type) {
  return type == Q4_0 || type == Q4_1 || type == Q8_0 || type == IQ4_NL || type == Q4_K || type == Q6_K;
}

// Chunk j of a block: chunk_of, or for the other formats the block dequantized once into buf (256 floats) by the
// scalar code (j == 0 does it; `type` names the format there, TYPE is then -1).
template <int64_t TYPE>
LLAMA_INLINE void any_chunk(int64_t type, const uint8_t* b, int j, float* buf, Chunk& c) {
  if constexpr (vector_type(TYPE)) {
    chunk_of<TYPE>(b, j, c);
  } else {
    if (j == 0) llama_cpu::gguf_dequantize_block(type, b, buf);
    for (int v = 0; v < 4; ++v) c.q[v] = _mm256_load_ps(buf + 32 * j + 8 * v);
    c.s0 = c.s1 = 1.f, c.offset = 0.f;
  }
}

// One weight row's products with MR activation rows x (stride K) whose per-32 sums are xs (stride K / 32): out[i *
// out_stride] for row i. Each row's sum takes the same operations in the same order whatever MR is: two 8-lane
// accumulators (values 0-15 and 16-31 of each chunk, times their scales) and one scalar for the offsets.
template <int64_t TYPE, int MR>
void row_dot(int64_t type, const uint8_t* row, const Format& f, int64_t K, const float* x, const float* xs,
             float* out, int64_t out_stride) {
  __m256 lo_acc[MR], hi_acc[MR];
  float off[MR];
  for (int i = 0; i < MR; ++i) lo_acc[i] = hi_acc[i] = _mm256_setzero_ps(), off[i] = 0.f;
  const int64_t nb = K / f.values;
  const int chunks = vector_type(TYPE) ? (TYPE == Q4_K || TYPE == Q6_K ? 8 : 1) : int(f.values / 32);
  alignas(32) float buf[256];
  Chunk c;
  for (int64_t blk = 0; blk < nb; ++blk) {
    const uint8_t* b = row + blk * f.bytes;
    for (int j = 0; j < chunks; ++j) {
      any_chunk<TYPE>(type, b, j, buf, c);
      const __m256 s0 = _mm256_set1_ps(c.s0), s1 = _mm256_set1_ps(c.s1);
      const int64_t k = blk * f.values + 32 * j;
      for (int i = 0; i < MR; ++i) {
        const float* xp = x + i * K + k;
        const __m256 lo = _mm256_fmadd_ps(c.q[1], _mm256_loadu_ps(xp + 8), _mm256_mul_ps(c.q[0], _mm256_loadu_ps(xp)));
        const __m256 hi = _mm256_fmadd_ps(c.q[3], _mm256_loadu_ps(xp + 24), _mm256_mul_ps(c.q[2], _mm256_loadu_ps(xp + 16)));
        lo_acc[i] = _mm256_fmadd_ps(s0, lo, lo_acc[i]);
        hi_acc[i] = _mm256_fmadd_ps(s1, hi, hi_acc[i]);
        off[i] += c.offset * xs[i * (K / 32) + k / 32];
      }
    }
  }
  for (int i = 0; i < MR; ++i) out[i * out_stride] = hsum(_mm256_add_ps(lo_acc[i], hi_acc[i])) + off[i];
}

// x (M, K) with each 32 values in the order of type's chunk codes (in_lanes).
std::vector<float> lane_order(int64_t type, const float* x, int64_t M, int64_t K) {
  int src[32];
  for (int pos = 0; pos < 32; ++pos) src[pos] = lane_value(type, pos);
  std::vector<float> out(M * K);
  for (int64_t c = 0; c < M * K / 32; ++c)
    for (int pos = 0; pos < 32; ++pos) out[32 * c + pos] = x[32 * c + src[pos]];
  return out;
}

// The sums of each 32 values of x (M, K), left to right: the offsets' factors.
std::vector<float> chunk_sums(const float* x, int64_t M, int64_t K) {
  std::vector<float> xs(M * (K / 32));
  for (int64_t i = 0; i < M * (K / 32); ++i) {
    float t = 0.f;
    for (int v = 0; v < 32; ++v) t += x[i * 32 + v];
    xs[i] = t;
  }
  return xs;
}

// y[:, n0:n1] for every activation row, two rows at a time through each weight row.
template <int64_t TYPE>
void rows_of(int64_t type, const uint8_t* wp, int64_t row_bytes, const Format& f, int64_t M, int64_t K, int64_t N,
             const float* xp, const float* xs, float* yp, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = wp + n * row_bytes;
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) row_dot<TYPE, 2>(type, row, f, K, xp + m * K, xs + m * (K / 32), yp + m * N + n, N);
    if (m < M) row_dot<TYPE, 1>(type, row, f, K, xp + m * K, xs + m * (K / 32), yp + m * N + n, N);
  }
}

using RowsFn = void (*)(int64_t, const uint8_t*, int64_t, const Format&, int64_t, int64_t, int64_t, const float*,
                        const float*, float*, int64_t, int64_t);

RowsFn rows_fn(int64_t type) {
  switch (type) {
    case Q4_0: return rows_of<Q4_0>;
    case Q4_1: return rows_of<Q4_1>;
    case Q8_0: return rows_of<Q8_0>;
    case IQ4_NL: return rows_of<IQ4_NL>;
    case Q4_K: return rows_of<Q4_K>;
    case Q6_K: return rows_of<Q6_K>;
    default: return rows_of<-1>;
  }
}

Format checked(const char* op, const at::Tensor& w, int64_t type) {
  Format f;
  LLAMA_CHECK(format_of(type, f) && type != Q4_K_X8, op, ": ggml type ", type, " is not run natively with fp32 "
              "activations (Q4_K runs in the file's layout)");
  LLAMA_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), op,
              ": the weight must be a contiguous 2-d uint8 tensor");
  LLAMA_CHECK(w.size(1) % f.bytes == 0, op, ": rows of ", w.size(1), " bytes are not whole blocks of ", f.bytes);
  LLAMA_CHECK(__builtin_cpu_supports("f16c"), op, ": the CPU lacks F16C");
  return f;
}

}  // namespace

namespace llama_cpu {

// x (M, K) fp32 times the GGUF weight w (N, row bytes) of ggml type `type`, with fp32 activations: y (M, N) fp32.
// Rows go two at a time through each weight row (its chunks decoded once for both), threads split the weight rows.
at::Tensor gguf_linear_float(const at::Tensor& x, const at::Tensor& w, int64_t type) {
  const Format f = checked("gguf_linear_float", w, type);
  LLAMA_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "gguf_linear_float: x must be a contiguous 2-d float32 tensor");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), row_bytes = w.size(1);
  LLAMA_CHECK(K % f.values == 0 && row_bytes == K / f.values * f.bytes, "gguf_linear_float: x has ", K,
              " inputs, the weight rows ", row_bytes, " bytes of blocks of ", f.values);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const std::vector<float> xs = chunk_sums(xp, M, K);
  const std::vector<float> lanes = in_lanes(type) ? lane_order(type, xp, M, K) : std::vector<float>();
  if (in_lanes(type)) xp = lanes.data();
  const RowsFn fn = rows_fn(type);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    fn(type, wp, row_bytes, f, M, K, N, xp, xs.data(), yp, n0, n1);
  });
  return y;
}

// The GGUF matrix w (N, row bytes) dequantized to fp32 (N, K) with the same chunk decoding: a prompt's products
// (many rows) multiply slices of it in a GEMM.
at::Tensor gguf_unpack(const at::Tensor& w, int64_t type) {
  const Format f = checked("gguf_unpack", w, type);
  const int64_t N = w.size(0), nb = w.size(1) / f.bytes, K = nb * f.values;
  at::Tensor out = at::empty({N, K}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N * nb, 16, [&](int64_t i0, int64_t i1) {
    alignas(32) float buf[256];
    Chunk c;
    for (int64_t i = i0; i < i1; ++i) {
      const uint8_t* b = wp + i * f.bytes;  // rows are whole blocks: block i of the matrix
      for (int j = 0; j < int(f.values / 32); ++j) {
        switch (type) {
          case Q4_0: any_chunk<Q4_0>(type, b, j, buf, c); break;
          case Q4_1: any_chunk<Q4_1>(type, b, j, buf, c); break;
          case Q8_0: any_chunk<Q8_0>(type, b, j, buf, c); break;
          case IQ4_NL: any_chunk<IQ4_NL>(type, b, j, buf, c); break;
          case Q4_K: any_chunk<Q4_K>(type, b, j, buf, c); break;
          case Q6_K: any_chunk<Q6_K>(type, b, j, buf, c); break;
          default: any_chunk<-1>(type, b, j, buf, c);
        }
        float* o = op + i * f.values + 32 * j;
        const __m256 s0 = _mm256_set1_ps(c.s0), s1 = _mm256_set1_ps(c.s1), off = _mm256_set1_ps(c.offset);
        for (int v = 0; v < 4; ++v) {
          const __m256 value = _mm256_fmadd_ps(c.q[v], v < 2 ? s0 : s1, off);
          if (in_lanes(type)) {
            alignas(32) float lanes[8];
            _mm256_store_ps(lanes, value);
            for (int l = 0; l < 8; ++l) o[lane_value(type, 8 * v + l)] = lanes[l];
          } else {
            _mm256_storeu_ps(o + 8 * v, value);
          }
        }
      }
    }
  });
  return out;
}

}  // namespace llama_cpu

TORCH_LIBRARY_FRAGMENT(llama_cpu, m) {
  m.def("gguf_linear_float(Tensor x, Tensor weight, int type) -> Tensor");
  m.def("gguf_unpack(Tensor weight, int type) -> Tensor");
}

TORCH_LIBRARY_IMPL(llama_cpu, CPU, m) {
  m.impl("gguf_linear_float", llama_cpu::gguf_linear_float);
  m.impl("gguf_unpack", llama_cpu::gguf_unpack);
}
