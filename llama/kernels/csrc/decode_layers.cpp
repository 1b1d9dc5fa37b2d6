// A decode step's transformer layers in one call: for one token per row, what model.TransformerBlock computes, layer
// after layer, with the library's own ops (ops.h) and PyTorch's SiLU, in the same order and with the same roundings,
// so the result is the Python path's bit for bit. Why: between two weight products an eager step's Python and
// PyTorch operators run with the caches that the weights streaming through have just flushed, at several times
// their warm cost; here the only code between two products is this loop (docs/performance.md, "One call per decode
// step").
// llama/fused_decode.py decides when it runs and hands it the layers' tensors.
#include <ATen/core/Tensor.h>
#include <ATen/ops/div.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/topk.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "check.h"

#include "ops.h"
#include "simd.h"

namespace {

using namespace llama_cpu;

// How a product's weight is held, and the tensors it takes from the weight list.
// kGGUF (int8 activation blocks, llama.cpp's), kGGUFFloat (fp32 activations) and kGGUFX16 (int16 activation
// blocks): group is the ggml type
enum Scheme : int64_t { kFloat = 0, kInt4 = 1, kInt8 = 2, kGGUF = 3, kGGUFFloat = 4, kGGUFX16 = 5 };
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

// The products in the order the layers use them, each with its scheme, group size and tensors: one after another
// (operator()), or by index (at(): an MoE layer's experts, of which a step runs those its tokens picked).
struct Products {
  at::TensorList weights;
  c10::ArrayRef<int64_t> schemes, groups;
  size_t next = 0;
  std::vector<size_t> first;  // each product's first tensor in weights

  Products(at::TensorList w, c10::ArrayRef<int64_t> s, c10::ArrayRef<int64_t> g) : weights(w), schemes(s), groups(g) {
    size_t tensor = 0;
    for (const int64_t scheme : schemes) first.push_back(tensor), tensor += tensors_of(scheme);
  }

  at::Tensor operator()(const at::Tensor& x) { return at(next++, x); }

  // x (B, K) contiguous in the activations' dtype -> x @ W.T (B, N) in the same dtype, as quantize.product gives it.
  at::Tensor at(size_t index, const at::Tensor& x) const {
    const int64_t scheme = schemes[index], group = groups[index];
    const at::Tensor* w = weights.data() + first[index];
    at::Tensor y;
    if (scheme == kFloat)
      y = float_linear(x, w[0]);
    else if (scheme == kInt4)
      y = int4_linear(x.to(at::kFloat), w[0], w[1], group);
    else if (scheme == kInt8)
      y = int8_linear(x.to(at::kFloat), w[0], w[1]);
    else if (scheme == kGGUF)
      y = gguf_linear(x.to(at::kFloat).contiguous(), w[0], group);
    else if (scheme == kGGUFFloat)
      y = gguf_linear_float(x.to(at::kFloat).contiguous(), w[0], group);
    else
      y = gguf_linear_x16(x.to(at::kFloat).contiguous(), w[0], group);
    return rounded(y, x.scalar_type());
  }
};

// A dense FFN (model.FeedForward) over x (B, D): products `ffn_products` (gate and up, or both fused) then down, from
// product `index` on (advanced past them).
at::Tensor swiglu(const Products& product, size_t& index, const at::Tensor& x, int64_t ffn_products) {
  at::Tensor gate, up;
  if (ffn_products == 2) {
    gate = product.at(index++, x), up = product.at(index++, x);
  } else {
    const at::Tensor both = product.at(index++, x);
    const int64_t hidden = both.size(1) / 2;
    gate = both.narrow(1, 0, hidden), up = both.narrow(1, hidden, hidden);
  }
  const at::Tensor act = at::silu(gate);  // PyTorch's own, for its exp's roundings
  const at::Tensor f = at::empty({x.size(0), gate.size(1)}, x.options());
  combine_rows(act, up, f, false);
  return product.at(index++, f);
}

// acc (n) = out * w, or acc + out * w (first == false), each op rounded to S once: PyTorch's mul and add of a row by
// its routing weight (llama/moe.py combine).
template <typename S>
void weigh(S* acc, const S* out, float w, int64_t n, bool first) {
  for (int64_t i = 0; i < n; ++i) {
    S t;
    store_f(&t, load_f(out + i) * w);
    if (first)
      acc[i] = t;
    else
      store_f(acc + i, load_f(acc + i) + load_f(&t));
  }
}

struct Routing {
  int64_t n_experts, top_k;
  bool renormalize;
};

// An MoE layer's FFN (llama/moe.py MoEFeedForward) over x (B, D): the router's product at `index`, softmax over every
// expert in fp32 and the top k (renormalised where asked); each picked expert's SwiGLU over the rows that picked it,
// in row order; each row's k outputs weighted and added in rank order. index ends past the layer's products.
at::Tensor moe_ffn(const Products& product, size_t& index, const at::Tensor& x, const Routing& r, int64_t ffn_products) {
  const int64_t B = x.size(0), D = x.size(1), K = r.top_k, per_expert = ffn_products + 1;
  const at::Tensor logits = product.at(index, x);
  const size_t base = index + 1;
  index = base + size_t(r.n_experts * per_expert);
  auto [w, picks] = at::topk(at::softmax(logits.to(at::kFloat), -1), K, -1);
  if (r.renormalize) w = at::div(w, at::sum(w, {-1}, true));
  w = w.to(x.scalar_type()).to(at::kFloat).contiguous();  // the weights as Python holds them, read as floats
  picks = picks.contiguous();
  const int64_t* pick = picks.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> pairs(r.n_experts);  // (row, rank) pairs b * K + i, grouped by expert
  for (int64_t i = 0; i < B * K; ++i) pairs[pick[i]].push_back(i);
  const int64_t row_bytes = D * x.element_size();
  const char* src = static_cast<const char*>(x.data_ptr());
  at::Tensor out = at::empty({B * K, D}, x.options());
  char* dst = static_cast<char*>(out.data_ptr());
  for (int64_t e = 0; e < r.n_experts; ++e) {
    const std::vector<int64_t>& mine = pairs[e];
    if (mine.empty()) continue;
    at::Tensor rows = at::empty({int64_t(mine.size()), D}, x.options());
    char* gathered = static_cast<char*>(rows.data_ptr());
    for (size_t j = 0; j < mine.size(); ++j) std::memcpy(gathered + j * row_bytes, src + mine[j] / K * row_bytes, row_bytes);
    size_t at_expert = base + size_t(e * per_expert);
    const at::Tensor y = swiglu(product, at_expert, rows, ffn_products).contiguous();
    const char* ys = static_cast<const char*>(y.data_ptr());
    for (size_t j = 0; j < mine.size(); ++j) std::memcpy(dst + mine[j] * row_bytes, ys + j * row_bytes, row_bytes);
  }
  at::Tensor acc = at::empty({B, D}, x.options());
  const float* wf = w.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < K; ++i) {
      if (x.scalar_type() == at::kFloat)
        weigh(acc.data_ptr<float>() + b * D, out.data_ptr<float>() + (b * K + i) * D, wf[b * K + i], D, i == 0);
      else
        weigh(reinterpret_cast<uint16_t*>(acc.data_ptr()) + b * D,
              reinterpret_cast<const uint16_t*>(out.data_ptr()) + (b * K + i) * D, wf[b * K + i], D, i == 0);
    }
  return acc;
}

// How many products layer l takes, and checks its per-layer arguments.
int64_t layer_products(int64_t qkv_products, int64_t ffn_products, c10::IntArrayRef experts, int64_t l) {
  const int64_t attention = qkv_products + 1;
  if (experts.empty() || experts[l] == 0) return attention + ffn_products + 1;
  return attention + 1 + experts[l] * (ffn_products + 1);
}

void check_arguments(const at::Tensor& x, size_t norms, at::TensorList weights, c10::IntArrayRef schemes,
                     c10::IntArrayRef groups, c10::IntArrayRef qkv_products, c10::IntArrayRef ffn_products,
                     size_t caches, size_t head_norms, c10::IntArrayRef experts, int64_t top_k) {
  LLAMA_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "decode_layers: x must be a contiguous 2-d float32 or bf16 tensor (rows, dim)");
  const int64_t L = int64_t(norms) / 2;
  LLAMA_CHECK(norms == size_t(2 * L) && caches == size_t(2 * L),
              "decode_layers: two norms and two caches per layer, got ", norms, " and ", caches);
  LLAMA_CHECK(qkv_products.size() == size_t(L) && ffn_products.size() == size_t(L),
              "decode_layers: one qkv_products and one ffn_products per layer, got ", qkv_products.size(), " and ",
              ffn_products.size(), " for ", L, " layers");
  for (int64_t l = 0; l < L; ++l)
    LLAMA_CHECK((qkv_products[l] == 1 || qkv_products[l] == 3) && (ffn_products[l] == 1 || ffn_products[l] == 2),
                "decode_layers: qkv_products must be 1 or 3 and ffn_products 1 or 2, got ", qkv_products[l], " and ",
                ffn_products[l], " at layer ", l);
  LLAMA_CHECK(head_norms == 0 || head_norms == size_t(2 * L), "decode_layers: no head norms or two per layer, got ",
              head_norms);
  LLAMA_CHECK(experts.empty() || experts.size() == size_t(L), "decode_layers: no expert counts or one per layer, got ",
              experts.size());
  int64_t products = 0;
  for (int64_t l = 0; l < L; ++l) {
    LLAMA_CHECK(experts.empty() || (experts[l] >= 0 && (experts[l] == 0 || (top_k >= 1 && top_k <= experts[l]))),
                "decode_layers: layer ", l, " has ", experts.empty() ? 0 : experts[l], " experts for top_k ", top_k);
    products += layer_products(qkv_products[l], ffn_products[l], experts, l);
  }
  LLAMA_CHECK(schemes.size() == size_t(products) && groups.size() == schemes.size(), "decode_layers: ", products,
              " products for ", L, " layers, got ", schemes.size(), " schemes and ", groups.size(), " group sizes");
  size_t tensors = 0;
  for (const int64_t scheme : schemes) {
    LLAMA_CHECK(scheme >= kFloat && scheme <= kGGUFX16, "decode_layers: unknown scheme ", scheme);
    tensors += tensors_of(scheme);
  }
  LLAMA_CHECK(tensors == weights.size(), "decode_layers: the schemes take ", tensors, " weight tensors, got ",
              weights.size());
}

// x (B, D): the hidden state of one token per row, contiguous fp32 or bf16. Per layer l: norms[2l], norms[2l + 1]
// (attention and feed-forward RMSNorm weights) and caches[2l], caches[2l + 1] (its keys and values, written in
// place). weights: every product's tensors, layer by layer in the order attention inputs (qkv_products[l]: 1 for
// a fused q/k/v, or 3), output, then a dense layer's feed-forward inputs (ffn_products[l]: 1 for a fused gate/up, or
// 2; per layer, as a Q4_K_M file's Q6_K v keeps some layers' q/k/v apart) and down, or an MoE layer's router and
// each of its experts' inputs and down; schemes holds one entry per product
// (0: a bf16 or fp32 weight; 1: int4 codes and scales, groups[i] the group size; 2: int8 weight and scales; 3, 4
// and 5: GGUF blocks, groups[i] the ggml type, with int8, fp32 or int16 activations) and says how many tensors it
// takes (1, 2, 2, 1, 1, 1). cos, sin, table, rows, row0, positions and kv_len are decode_attention's (one block table for every
// layer's paged pool). head_norms: empty, or each layer's q and k norm weights (Qwen3's qk-norm, over each head).
// experts: empty, or per layer 0 (dense) or its expert count, routed top_k (renormalised where asked). Returns the
// last layer's output (B, D).
at::Tensor decode_layers(const at::Tensor& x, at::TensorList norms, double eps, at::TensorList weights,
                         c10::IntArrayRef schemes, c10::IntArrayRef groups, c10::IntArrayRef qkv_products,
                         c10::IntArrayRef ffn_products, const at::Tensor& cos, const at::Tensor& sin, at::TensorList caches,
                         const c10::optional<at::Tensor>& table, const c10::optional<at::Tensor>& rows,
                         int64_t row0, const at::Tensor& positions, int64_t kv_len, at::TensorList head_norms,
                         c10::IntArrayRef experts, int64_t top_k, bool renormalize) {
  check_arguments(x, norms.size(), weights, schemes, groups, qkv_products, ffn_products, caches.size(),
                  head_norms.size(), experts, top_k);
  const int64_t L = int64_t(norms.size()) / 2;
  Products product{weights, schemes, groups};
  at::Tensor h = x.clone();
  const int64_t B = x.size(0);
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor &cache_k = caches[2 * l], &cache_v = caches[2 * l + 1];
    const at::Tensor n = rms_norm(h, norms[2 * l], eps);
    at::Tensor q, k, v;
    if (qkv_products[l] == 3) {
      q = product(n), k = product(n), v = product(n);
    } else {
      const at::Tensor qkv = product(n);
      const int64_t kv = cache_k.size(1) * cache_k.size(3), nq = qkv.size(1) - 2 * kv;
      q = qkv.narrow(1, 0, nq), k = qkv.narrow(1, nq, kv), v = qkv.narrow(1, nq + kv, kv);
    }
    if (!head_norms.empty()) {  // each head normalised on its own, as rows of head_dim
      const int64_t hd = cache_k.size(3);
      q = rms_norm(q.contiguous().view({-1, hd}), head_norms[2 * l], eps).view({B, -1});
      k = rms_norm(k.contiguous().view({-1, hd}), head_norms[2 * l + 1], eps).view({B, -1});
    }
    const at::Tensor a = decode_attention(q, k, v, cos, sin, cache_k, cache_v, table, rows, row0, positions, kv_len);
    combine_rows(h, product(a), h, true);
    const at::Tensor n2 = rms_norm(h, norms[2 * l + 1], eps);
    const at::Tensor f = experts.empty() || experts[l] == 0
                             ? swiglu(product, product.next, n2, ffn_products[l])
                             : moe_ffn(product, product.next, n2, Routing{experts[l], top_k, renormalize},
                                       ffn_products[l]);
    combine_rows(h, f, h, true);
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llama_cpu, m) {
  m.def("decode_layers(Tensor x, Tensor[] norms, float eps, Tensor[] weights, int[] schemes, int[] groups, "
        "int[] qkv_products, int[] ffn_products, Tensor cos, Tensor sin, Tensor(a!)[] caches, Tensor? table, Tensor? rows, "
        "int row0, "
        "Tensor positions, int kv_len, Tensor[] head_norms, int[] experts, int top_k, bool renormalize) -> Tensor");
}

TORCH_LIBRARY_IMPL(llama_cpu, CPU, m) { m.impl("decode_layers", decode_layers); }
