// A decode step's transformer layers in one call: for one token per row, what model.TransformerBlock computes, layer
// after layer, with the library's own ops (ops.h) and PyTorch's SiLU, in the same order and with the same roundings,
// so the result is the Python path's bit for bit. Why: between two weight products an eager step's Python and
// PyTorch operators run with the caches that the weights streaming through have just flushed, at several times
// their warm cost; here the only code between two products is this loop (docs/performance.md, "One call per decode
// step").
// llama/fused_decode.py decides when it runs and hands it the layers' tensors.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>

#include "check.h"

#include "ops.h"
#include "simd.h"

namespace {

using namespace llama_cpu;

// How a product's weight is held, and the tensors it takes from the weight list.
// kGGUF (int8 activation blocks, llama.cpp's) and kGGUFFloat (fp32 activations): group is the ggml type
enum Scheme : int64_t { kFloat = 0, kInt4 = 1, kInt8 = 2, kGGUF = 3, kGGUFFloat = 4 };
int64_t tensors_of(int64_t scheme) { return scheme == kInt4 || scheme == kInt8 ? 2 : 1; }

// 8 floats rounded to bf16 as PyTorch rounds (nearest even; NaN as 0x7FC0): store_f's rule, 8 lanes at a time.
inline __m128i round_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// out[i] = x[i] + y[i] (sum == true) or x[i] * y[i] over n elements, each computed in fp32 and rounded to S once:
// PyTorch's add and mul for fp32 and bf16 tensors. out may be x.
template <typename S>
void combine(const S* x, const S* y, S* out, int64_t n, bool sum) {
  const int64_t n8 = n / 8 * 8;
  for (int64_t i = 0; i < n8; i += 8) {
    const __m256 a = load8(x + i), b = load8(y + i);
    const __m256 c = sum ? _mm256_add_ps(a, b) : _mm256_mul_ps(a, b);
    if constexpr (sizeof(S) == 4)
      _mm256_storeu_ps(reinterpret_cast<float*>(out + i), c);
    else
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), round_bf16(c));
  }
  for (int64_t i = n8; i < n; ++i) store_f(out + i, sum ? load_f(x + i) + load_f(y + i) : load_f(x + i) * load_f(y + i));
}

// Row by row, for (B, N) operands whose rows may be strided (the halves of a fused gate/up product).
void combine_rows(const at::Tensor& x, const at::Tensor& y, const at::Tensor& out, bool sum) {
  const int64_t B = x.size(0), N = x.size(1);
  for (int64_t b = 0; b < B; ++b) {
    if (x.scalar_type() == at::kFloat)
      combine(x.data_ptr<float>() + b * x.stride(0), y.data_ptr<float>() + b * y.stride(0),
              out.data_ptr<float>() + b * out.stride(0), N, sum);
    else
      combine(reinterpret_cast<const uint16_t*>(x.data_ptr()) + b * x.stride(0),
              reinterpret_cast<const uint16_t*>(y.data_ptr()) + b * y.stride(0),
              reinterpret_cast<uint16_t*>(out.data_ptr()) + b * out.stride(0), N, sum);
  }
}

// An fp32 product's result in the activations' dtype, as Tensor.to() gives it.
at::Tensor rounded(const at::Tensor& y, at::ScalarType dtype) {
  if (dtype == at::kFloat) return y;
  at::Tensor out = at::empty(y.sizes(), y.options().dtype(dtype));
  const float* src = y.data_ptr<float>();
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t n = y.numel(), n8 = n / 8 * 8;
  for (int64_t i = 0; i < n8; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), round_bf16(_mm256_loadu_ps(src + i)));
  for (int64_t i = n8; i < n; ++i) store_f(dst + i, src[i]);
  return out;
}

// The products in the order the layers use them, each with its scheme, group size and tensors.
struct Products {
  at::TensorList weights;
  c10::ArrayRef<int64_t> schemes, groups;
  size_t next = 0, tensor = 0;

  // x (B, K) contiguous in the activations' dtype -> x @ W.T (B, N) in the same dtype, as quantize.product gives it.
  at::Tensor operator()(const at::Tensor& x) {
    const int64_t scheme = schemes[next], group = groups[next];
    const at::Tensor* w = weights.data() + tensor;
    ++next, tensor += tensors_of(scheme);
    at::Tensor y;
    if (scheme == kFloat)
      y = float_linear(x, w[0]);
    else if (scheme == kInt4)
      y = int4_linear(x.to(at::kFloat), w[0], w[1], group);
    else if (scheme == kInt8)
      y = int8_linear(x.to(at::kFloat), w[0], w[1]);
    else if (scheme == kGGUF)
      y = gguf_linear(x.to(at::kFloat).contiguous(), w[0], group);
    else
      y = gguf_linear_float(x.to(at::kFloat).contiguous(), w[0], group);
    return rounded(y, x.scalar_type());
  }
};

// x (B, D): the hidden state of one token per row, contiguous fp32 or bf16. Per layer l: norms[2l], norms[2l + 1]
// (attention and feed-forward RMSNorm weights) and caches[2l], caches[2l + 1] (its keys and values, written in
// place). weights: every product's tensors, layer by layer in the order attention inputs (qkv_products: 1 for a
// fused q/k/v, or 3), output, feed-forward inputs (ffn_products: 1 for a fused gate/up, or 2), down; schemes holds
// one entry per product (0: a bf16 or fp32 weight; 1: int4 codes and scales, groups[i] the group size; 2: int8
// weight and scales; 3 and 4: GGUF blocks, groups[i] the ggml type, with int8 or fp32 activations) and says how
// many tensors it takes (1, 2, 2, 1, 1). cos, sin, table, rows, row0, positions and kv_len
// are decode_attention's (one block table for every layer's paged pool). Returns the last layer's output (B, D).
at::Tensor decode_layers(const at::Tensor& x, at::TensorList norms, double eps, at::TensorList weights,
                         c10::IntArrayRef schemes, c10::IntArrayRef groups, int64_t qkv_products,
                         int64_t ffn_products, const at::Tensor& cos, const at::Tensor& sin, at::TensorList caches,
                         const c10::optional<at::Tensor>& table, const c10::optional<at::Tensor>& rows,
                         int64_t row0, const at::Tensor& positions, int64_t kv_len) {
  LLAMA_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "decode_layers: x must be a contiguous 2-d float32 or bf16 tensor (rows, dim)");
  LLAMA_CHECK((qkv_products == 1 || qkv_products == 3) && (ffn_products == 1 || ffn_products == 2),
              "decode_layers: qkv_products must be 1 or 3 and ffn_products 1 or 2, got ", qkv_products, " and ",
              ffn_products);
  const int64_t L = int64_t(norms.size()) / 2, per_layer = qkv_products + ffn_products + 2;
  LLAMA_CHECK(norms.size() == size_t(2 * L) && caches.size() == size_t(2 * L),
              "decode_layers: two norms and two caches per layer, got ", norms.size(), " and ", caches.size());
  LLAMA_CHECK(schemes.size() == size_t(L * per_layer) && groups.size() == schemes.size(), "decode_layers: ",
              L * per_layer, " products for ", L, " layers, got ", schemes.size(), " schemes and ", groups.size(),
              " group sizes");
  size_t tensors = 0;
  for (const int64_t scheme : schemes) {
    LLAMA_CHECK(scheme >= kFloat && scheme <= kGGUFFloat, "decode_layers: unknown scheme ", scheme);
    tensors += tensors_of(scheme);
  }
  LLAMA_CHECK(tensors == weights.size(), "decode_layers: the schemes take ", tensors, " weight tensors, got ",
              weights.size());
  Products product{weights, schemes, groups};
  at::Tensor h = x.clone();
  const int64_t B = x.size(0);
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor &cache_k = caches[2 * l], &cache_v = caches[2 * l + 1];
    const at::Tensor n = rms_norm(h, norms[2 * l], eps);
    at::Tensor q, k, v;
    if (qkv_products == 3) {
      q = product(n), k = product(n), v = product(n);
    } else {
      const at::Tensor qkv = product(n);
      const int64_t kv = cache_k.size(1) * cache_k.size(3), nq = qkv.size(1) - 2 * kv;
      q = qkv.narrow(1, 0, nq), k = qkv.narrow(1, nq, kv), v = qkv.narrow(1, nq + kv, kv);
    }
    const at::Tensor a = decode_attention(q, k, v, cos, sin, cache_k, cache_v, table, rows, row0, positions, kv_len);
    combine_rows(h, product(a), h, true);
    const at::Tensor n2 = rms_norm(h, norms[2 * l + 1], eps);
    at::Tensor gate, up;
    if (ffn_products == 2) {
      gate = product(n2), up = product(n2);
    } else {
      const at::Tensor both = product(n2);
      const int64_t hidden = both.size(1) / 2;
      gate = both.narrow(1, 0, hidden), up = both.narrow(1, hidden, hidden);
    }
    const at::Tensor act = at::silu(gate);  // PyTorch's own, for its exp's roundings
    const at::Tensor f = at::empty({B, gate.size(1)}, h.options());
    combine_rows(act, up, f, false);
    combine_rows(h, product(f), h, true);
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llama_cpu, m) {
  m.def("decode_layers(Tensor x, Tensor[] norms, float eps, Tensor[] weights, int[] schemes, int[] groups, "
        "int qkv_products, int ffn_products, Tensor cos, Tensor sin, Tensor(a!)[] caches, Tensor? table, Tensor? rows, "
        "int row0, "
        "Tensor positions, int kv_len) -> Tensor");
}

TORCH_LIBRARY_IMPL(llama_cpu, CPU, m) { m.impl("decode_layers", decode_layers); }
