// A decode step's small operators in one call each: RMSNorm, and attention for one new token per row (rotary
// embedding, cache write, attention over the cached positions). Eager decoding otherwise runs each as many PyTorch
// operators, and at small batch each costs microseconds of dispatch for nanoseconds of work. Built into the same
// library as cpu_kernels.cpp (llama/cpu_kernels.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "check.h"

#include <algorithm>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

using namespace llama_cpu;

// ------------------------------------------------------------------------------------------------ RMSNorm
// model.RMSNorm's arithmetic in one call: each row normalised in fp32 (x * 1/sqrt(mean(x^2) + eps)), rounded to
// x's dtype, then scaled by the weight and rounded again. PyTorch runs it as about eight operators.
template <typename S>
void rms_rows(const S* x, const S* w, S* out, int64_t M, int64_t D, double eps) {
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const S* row = x + m * D;
      __m256 squares = _mm256_setzero_ps();
      const int64_t d8 = D / 8 * 8;
      for (int64_t d = 0; d < d8; d += 8) squares = _mm256_fmadd_ps(load8(row + d), load8(row + d), squares);
      float total = hsum(squares);
      for (int64_t d = d8; d < D; ++d) total += load_f(row + d) * load_f(row + d);
      const float r = 1.f / std::sqrt(total / float(D) + float(eps));
      for (int64_t d = 0; d < D; ++d) {
        S normed;
        store_f(&normed, load_f(row + d) * r);
        store_f(out + m * D + d, load_f(&normed) * load_f(w + d));
      }
    }
  });
}

}  // namespace

namespace llama_cpu {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  LLAMA_CHECK(x.is_contiguous() && weight.is_contiguous() && x.scalar_type() == weight.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "rms_norm: x and weight must be contiguous float32 or bf16 of one dtype");
  const int64_t D = weight.numel();
  LLAMA_CHECK(x.dim() >= 1 && x.size(-1) == D, "rms_norm: x's last dimension must be ", D, ", got ", x.size(-1));
  at::Tensor out = at::empty_like(x);
  const int64_t M = x.numel() / D;
  if (x.scalar_type() == at::kFloat)
    rms_rows(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), M, D, eps);
  else
    rms_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), reinterpret_cast<const uint16_t*>(weight.data_ptr()),
             reinterpret_cast<uint16_t*>(out.data_ptr()), M, D, eps);
  return out;
}

}  // namespace llama_cpu

namespace {

// ------------------------------------------------------------------------------------------ decode attention
// One new token per row: rotate its query and key, write its key and value into the cache, and attend over the
// row's cached positions. In eager decoding this replaces about fifteen small operators per layer (rotary
// embedding, two cache writes, scaled_dot_product_attention and the reshapes between them), each of which costs
// microseconds of dispatch and some of which cost far more (SDPA sets up a flash-attention pass for one query).

// Interleaved pairs (x[2i], x[2i+1]) rotated by angle i, computed in fp32 as model.apply_rotary does (products and
// differences rounded separately) and rounded to the storage type S, also into fp32 `back` when given.
template <typename S>
void rotate(const S* x, const float* cos, const float* sin, int64_t D, S* out, float* back) {
  for (int64_t i = 0; i < D / 2; ++i) {
    const float x0 = load_f(x + 2 * i), x1 = load_f(x + 2 * i + 1);
    store_f(out + 2 * i, x0 * cos[i] - x1 * sin[i]);
    store_f(out + 2 * i + 1, x1 * cos[i] + x0 * sin[i]);
    if (back) back[2 * i] = load_f(out + 2 * i), back[2 * i + 1] = load_f(out + 2 * i + 1);
  }
}

// A paged cache (table given): cache_k/cache_v (blocks, Hkv, block_size, D) and table (rows, M) int64, row r's
// position s in block table[r * M + s / block_size] at offset s % block_size. Without a table: (rows, Hkv, S, D).
template <typename S>
void attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const float* cos, const float* sin,
                 int64_t angle_stride, at::Tensor& cache_k, at::Tensor& cache_v, const int64_t* table, int64_t M,
                 const int64_t* rows, int64_t row0, const int64_t* pos, int64_t pos_stride, int64_t kv_len,
                 float scale, int64_t window, at::Tensor& out) {
  const int64_t B = q.size(0), Hkv = cache_k.size(1), S_ = cache_k.size(2), D = cache_k.size(3);
  const int64_t H = q.size(1) / D, group = H / Hkv;
  S* ck = reinterpret_cast<S*>(cache_k.data_ptr());
  S* cv = reinterpret_cast<S*>(cache_v.data_ptr());
  const S* qp = reinterpret_cast<const S*>(q.data_ptr());
  const S* kp = reinterpret_cast<const S*>(k.data_ptr());
  const S* vp = reinterpret_cast<const S*>(v.data_ptr());
  S* op = reinterpret_cast<S*>(out.data_ptr());
  auto slot = [&](int64_t b, int64_t g, int64_t s) {
    const int64_t r = rows ? rows[b] : row0 + b;
    if (!table) return (r * Hkv + g) * S_ * D + s * D;
    return ((table[r * M + s / S_] * Hkv + g) * S_ + s % S_) * D;  // S_ is the block size here
  };
  for (int64_t b = 0; b < B; ++b) {  // the cache writes, before any row reads
    const int64_t p = pos[b * pos_stride];
    for (int64_t g = 0; g < Hkv; ++g) {
      rotate(kp + b * k.stride(0) + g * D, cos + b * angle_stride, sin + b * angle_stride, D, ck + slot(b, g, p),
             static_cast<float*>(nullptr));
      std::memcpy(cv + slot(b, g, p), vp + b * v.stride(0) + g * D, D * sizeof(S));
    }
  }
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(D), acc(D), scores(kv_len);
    std::vector<S> qs(D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / H, h = i % H, g = h / group;
      const int64_t n = std::min(pos[b * pos_stride] + 1, kv_len);  // keys at positions first .. pos
      const int64_t first = window > 0 ? std::max<int64_t>(0, pos[b * pos_stride] - window + 1) : 0;
      rotate(qp + b * q.stride(0) + h * D, cos + b * angle_stride, sin + b * angle_stride, D, qs.data(), qf.data());
      // Positions in runs that are contiguous in memory: a whole row without a table, a block with one.
      const int64_t run = table ? S_ : n;
      float top = -INFINITY;
      for (int64_t s0 = first / run * run; s0 < n; s0 += run) {
        const S* keys = ck + slot(b, g, s0) - s0 * D;
        for (int64_t s = std::max(s0, first); s < std::min(n, s0 + run); ++s) {
          __m256 dot = _mm256_setzero_ps();
          for (int64_t d = 0; d < D; d += 8) dot = _mm256_fmadd_ps(_mm256_loadu_ps(qf.data() + d), load8(keys + s * D + d), dot);
          scores[s] = hsum(dot) * scale;
          top = std::max(top, scores[s]);
        }
      }
      float total = 0.f;
      for (int64_t s = first; s < n; ++s) total += scores[s] = std::exp(scores[s] - top);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t s0 = first / run * run; s0 < n; s0 += run) {
        const S* values = cv + slot(b, g, s0) - s0 * D;
        for (int64_t s = std::max(s0, first); s < std::min(n, s0 + run); ++s) {
          const __m256 w = _mm256_set1_ps(scores[s] / total);
          for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_ps(acc.data() + d, _mm256_fmadd_ps(w, load8(values + s * D + d), _mm256_loadu_ps(acc.data() + d)));
        }
      }
      for (int64_t d = 0; d < D; ++d) store_f(op + b * H * D + h * D + d, acc[d]);
    }
  });
}

}  // namespace

namespace llama_cpu {

// q (B, H*D), k and v (B, Hkv*D): the new token's projections (any row stride, contiguous within a row).
// cos/sin (1 or B, D/2) fp32: its rotation. cache_k/cache_v (rows, Hkv, S, D), contiguous, written in place; with
// a block table (rows, M) int64 they are a paged pool (blocks, Hkv, block_size, D) and a row has M * block_size
// positions (llama/core/worker/kv_cache.py).
// Row b lives in cache row rows[b] (or row0 + b without rows) at position positions[b] (one position: all rows)
// and attends positions 0 .. min(position, kv_len - 1), the newest `window` of them when window > 0 (a sliding
// window, Mistral's), its scores scaled by `scale` (0: head_dim ** -0.5; Granite's attention multiplier otherwise).
// Returns (B, H*D) in the cache's dtype.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                            const at::Tensor& sin, at::Tensor cache_k, at::Tensor cache_v,
                            const c10::optional<at::Tensor>& table, const c10::optional<at::Tensor>& rows,
                            int64_t row0, const at::Tensor& positions, int64_t kv_len, double scale, int64_t window) {
  LLAMA_CHECK(cache_k.dim() == 4 && cache_k.is_contiguous() && cache_v.is_contiguous() &&
                  cache_v.sizes() == cache_k.sizes() && cache_v.scalar_type() == cache_k.scalar_type() &&
                  (cache_k.scalar_type() == at::kFloat || cache_k.scalar_type() == at::kBFloat16),
              "decode_attention: cache_k and cache_v must be contiguous float32 or bf16 of one shape (rows, kv_heads, "
              "seq, head_dim)");
  int64_t R = cache_k.size(0), S_ = cache_k.size(2), M = 0;
  const int64_t Hkv = cache_k.size(1), D = cache_k.size(3);
  const int64_t* table_ids = nullptr;
  if (table.has_value()) {  // a paged pool: rows are the table's, positions M blocks' worth
    LLAMA_CHECK(table->scalar_type() == at::kLong && table->is_contiguous() && table->dim() == 2,
                "decode_attention: table must be a contiguous 2-d int64 tensor (rows, blocks per row)");
    const int64_t blocks = R;
    R = table->size(0), M = table->size(1), S_ = M * cache_k.size(2);
    table_ids = table->data_ptr<int64_t>();
    for (int64_t i = 0; i < R * M; ++i)
      LLAMA_CHECK(table_ids[i] >= 0 && table_ids[i] < blocks, "decode_attention: table names block ", table_ids[i],
                  " outside the pool's ", blocks);
  }
  LLAMA_CHECK(D % 8 == 0, "decode_attention: head_dim must be a multiple of 8, got ", D);
  const int64_t B = q.size(0);
  for (const at::Tensor* t : {&q, &k, &v})
    LLAMA_CHECK(t->dim() == 2 && t->size(0) == B && t->stride(1) == 1 && t->scalar_type() == cache_k.scalar_type(),
                "decode_attention: q, k and v must be 2-d with contiguous rows, B rows each, in the cache's dtype");
  LLAMA_CHECK(k.size(1) == Hkv * D && v.size(1) == Hkv * D && q.size(1) % (Hkv * D) == 0,
              "decode_attention: k and v need ", Hkv * D, " features and q a multiple of them, got ", k.size(1), ", ",
              v.size(1), " and ", q.size(1));
  const int64_t P = positions.numel();
  LLAMA_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && (P == 1 || P == B),
              "decode_attention: positions must be 1 or ", B, " contiguous int64 values");
  for (const at::Tensor* t : {&cos, &sin})
    LLAMA_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == P &&
                    t->size(1) == D / 2,
                "decode_attention: cos and sin must be contiguous float32 of shape (", P, ", ", D / 2, ")");
  LLAMA_CHECK(kv_len >= 1 && kv_len <= S_, "decode_attention: kv_len must be in [1, ", S_, "], got ", kv_len);
  LLAMA_CHECK(scale >= 0 && window >= 0, "decode_attention: scale and window must be >= 0, got ", scale, " and ",
              window);
  const float score_scale = scale > 0 ? float(scale) : 1.f / std::sqrt(float(D));
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < P; ++i)
    LLAMA_CHECK(pos[i] >= 0 && pos[i] < S_, "decode_attention: position ", pos[i], " outside the cache's ", S_);
  const int64_t* row_ids = nullptr;
  if (rows.has_value()) {
    LLAMA_CHECK(rows->scalar_type() == at::kLong && rows->is_contiguous() && rows->numel() == B,
                "decode_attention: rows must be ", B, " contiguous int64 values");
    row_ids = rows->data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      LLAMA_CHECK(row_ids[b] >= 0 && row_ids[b] < R, "decode_attention: row ", row_ids[b], " outside the cache's ", R);
  } else {
    LLAMA_CHECK(row0 >= 0 && row0 + B <= R, "decode_attention: rows ", row0, "..", row0 + B, " outside the cache's ", R);
  }
  at::Tensor out = at::empty({B, q.size(1)}, q.options());
  const int64_t step = P == 1 ? 0 : 1;
  if (cache_k.scalar_type() == at::kFloat)
    attend_rows<float>(q, k, v, cos.data_ptr<float>(), sin.data_ptr<float>(), step * (D / 2), cache_k, cache_v,
                       table_ids, M, row_ids, row0, pos, step, kv_len, score_scale, window, out);
  else
    attend_rows<uint16_t>(q, k, v, cos.data_ptr<float>(), sin.data_ptr<float>(), step * (D / 2), cache_k, cache_v,
                          table_ids, M, row_ids, row0, pos, step, kv_len, score_scale, window, out);
  return out;
}

}  // namespace llama_cpu

TORCH_LIBRARY_FRAGMENT(llama_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) cache_k, "
        "Tensor(b!) cache_v, Tensor? table, Tensor? rows, int row0, Tensor positions, int kv_len, float scale=0., "
        "int window=0) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(llama_cpu, CPU, m) {
  m.impl("decode_attention", llama_cpu::decode_attention);
  m.impl("rms_norm", llama_cpu::rms_norm);
}
