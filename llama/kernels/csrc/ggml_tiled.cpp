// llama.cpp's batched K-quant products, for the opt-in llama.cpp arithmetic (llama/kernels/ggml_products.py): the
// per-output order of operations of the two kernels its CPU backend multiplies a batch of tokens in, so a prompt
// fed in one batch gives llama.cpp's logits bit for bit.
//
// Written from llama.cpp's source as llama-cpp-python 0.3.36 vendors it (ggml-cpu/tiled/tiled.cpp,
// tiled-kernel.cpp; ggml-cpu/repack.cpp, arch/x86/repack.cpp), not copied. Every integer sum there is exact (int8
// codes times int8 codes in int16/int32 lanes that cannot overflow, or wrap mod 2^32 alike), so only the fp32
// operations and their order matter; here each is an explicit scalar operation or std::fma
// (-ffp-contract=off: the compiler contracts nothing).
//
// tiled (ggml_compute_forward_mul_mat_tiled, from 8 tokens, for Q2_K..Q6_K and IQ4_XS weights llama.cpp did not
// repack; its AVX-512 VNNI microkernel): the activations are q8_K rows (quantize_row_q8_K_ref). Per output and
// super-block b, in b's order:
//   s1 = sum_s scale_s * (sum of the sub-block's weight values times activation codes)      (int32)
//   s2 = sum_s min_s * (sum of the sub-block's activation codes)                             (int32; Q4_K, Q5_K)
//   r  = float(s1) * d;  with mins: r = fma(-dmin, float(s2), r)
//   y  = fma(r, d_act, y)       (GCC contracts tiled-kernel.cpp's add of the product into one FMA), y from 0
// x4 (its repacked Q4_K, q4_K_8x8, from 4 tokens: ggml_gemm_q4_K_8x8_q8_K for the first T - T % 4 rows; the rest
// go through its gemv, which our one-row product already equals): activations quantized 4 rows at a time
// (ggml_quantize_mat_q8_K_4x8: as quantize_row_q8_K_ref, but the scale's sign is the largest magnitude's sign
// taken positive when +max occurs at all, where the one-row code takes the first occurrence). Per output, for each
// super-block b and each pair p of 32-value sub-blocks, in that order:
//   acc  = fma(float(sc_2p * dot_2p + sc_2p+1 * dot_2p+1), d * d_act, acc)
//   accm = fma(float(m_2p * sum_2p + m_2p+1 * sum_2p+1), dmin * d_act, accm)
//   y = acc - accm
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "check.h"

namespace {

#include "gguf_format.h"
#include "gguf_x8.h"

constexpr int QK = 256;

// A weight super-block as signed values (the code minus the format's offset) with its integer sub-block scales.
struct KBlock {
  int8_t v[QK];
  int32_t sc[16], mn[16];
  float d, dmin;
  int sub;        // values per sub-block: 32 or 16
  bool has_min;
};

void decode(int64_t type, const uint8_t* b, KBlock& k) {
  switch (type) {
    case Q4_K: case Q5_K: {
      k.d = half_to_float(b), k.dmin = half_to_float(b + 2), k.sub = 32, k.has_min = true;
      uint8_t sc[8], m[8];
      scale_min_k4(b + 4, sc, m);
      for (int j = 0; j < 8; ++j) k.sc[j] = sc[j], k.mn[j] = m[j];
      const uint8_t* qh = b + 16;
      const uint8_t* qs = type == Q4_K ? b + 16 : b + 48;
      for (int j = 0; j < 4; ++j)
        for (int l = 0; l < 32; ++l) {
          int lo = qs[32 * j + l] & 0x0F, hi = qs[32 * j + l] >> 4;
          if (type == Q5_K) lo |= ((qh[l] >> (2 * j)) & 1) << 4, hi |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
          k.v[64 * j + l] = int8_t(lo), k.v[64 * j + 32 + l] = int8_t(hi);
        }
      return;
    }
    case Q6_K: {
      const uint8_t *ql = b, *qh = b + 128;
      k.d = half_to_float(b + 208), k.dmin = 0.f, k.sub = 16, k.has_min = false;
      for (int j = 0; j < 16; ++j) k.sc[j] = int8_t(b[192 + j]), k.mn[j] = 0;
      for (int h = 0; h < 2; ++h)
        for (int l = 0; l < 32; ++l) {
          const uint8_t *L = ql + 64 * h, *H = qh + 32 * h;
          int8_t* y = k.v + 128 * h;
          y[l] = int8_t(((L[l] & 0x0F) | ((H[l] & 3) << 4)) - 32);
          y[l + 32] = int8_t(((L[l + 32] & 0x0F) | (((H[l] >> 2) & 3) << 4)) - 32);
          y[l + 64] = int8_t(((L[l] >> 4) | (((H[l] >> 4) & 3) << 4)) - 32);
          y[l + 96] = int8_t(((L[l + 32] >> 4) | (((H[l] >> 6) & 3) << 4)) - 32);
        }
      return;
    }
    case Q3_K: {
      const uint8_t *hmask = b, *qs = b + 32;
      k.d = half_to_float(b + 108), k.dmin = 0.f, k.sub = 16, k.has_min = false;
      int16_t sc[16];
      q3k_scales(b + 96, sc);
      for (int j = 0; j < 16; ++j) k.sc[j] = sc[j], k.mn[j] = 0;
      for (int e = 0; e < QK; ++e) {
        const int half = e >> 7, el = e & 127, group = el >> 5, l = el & 31;
        const int low = (qs[half * 32 + l] >> (2 * group)) & 3, high = (hmask[l] >> (half * 4 + group)) & 1;
        k.v[e] = int8_t(low + 4 * high - 4);
      }
      return;
    }
    case IQ4_XS: {
      const uint8_t* qs = b + 8;
      k.d = half_to_float(b), k.dmin = 0.f, k.sub = 32, k.has_min = false;
      for (int j = 0; j < 8; ++j) {
        k.sc[j] = iq4xs_scale(b, j), k.mn[j] = 0;
        for (int l = 0; l < 16; ++l)
          k.v[32 * j + l] = kIQ4[qs[16 * j + l] & 0x0F], k.v[32 * j + 16 + l] = kIQ4[qs[16 * j + l] >> 4];
      }
      return;
    }
    default: return;
  }
}

// Activations as q8_K rows: codes, scale d and the sums of each 16 codes, per (row, super-block).
struct Q8K {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> s16;
};

void q8k_block(const float* x, int8_t* q, float& d, int32_t* s16, bool x4) {
  float amax = 0.f, max = 0.f;
  for (int j = 0; j < QK; ++j) {
    const float ax = std::fabs(x[j]);
    if (ax > amax) amax = ax, max = x[j];
  }
  std::memset(s16, 0, 16 * sizeof(int32_t));
  if (amax == 0.f) {
    d = 0.f;
    std::memset(q, 0, QK);
    return;
  }
  float iscale = -127.f / max;
  if (x4) {  // the 4-row quantizer: negative scale (a code of -127 for the max) whenever +amax occurs
    bool positive = false;
    for (int j = 0; j < QK; ++j) positive = positive || x[j] == amax;
    iscale = positive ? -127.f / amax : 127.f / amax;
  }
  for (int j = 0; j < QK; ++j) {
    q[j] = int8_t(std::min<int32_t>(127, int32_t(std::nearbyint(iscale * x[j]))));
    s16[j / 16] += q[j];
  }
  d = 1.f / iscale;
}

Q8K quantize(const float* x, int64_t M, int64_t K, bool x4) {
  const int64_t nb = K / QK;
  Q8K a{std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<int32_t>(M * K / 16)};
  at::parallel_for(0, M * nb, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0; i < b1; ++i) q8k_block(x + i * QK, a.q.data() + i * QK, a.d[i], a.s16.data() + i * 16, x4);
  });
  return a;
}

inline int32_t idot(const int8_t* a, const int8_t* b, int n) {
  int32_t s = 0;
  for (int i = 0; i < n; ++i) s += int32_t(a[i]) * int32_t(b[i]);
  return s;
}

// Wrapping int32 arithmetic, as the vector lanes compute it (defined behaviour in C++ through uint32).
inline int32_t wadd(int32_t a, int32_t b) { return int32_t(uint32_t(a) + uint32_t(b)); }
inline int32_t wmul(int32_t a, int32_t b) { return int32_t(uint32_t(a) * uint32_t(b)); }

// One output's contribution from super-block k and activation block (q, d, s16), into y (tiled) or (acc, accm) (x4).
inline void tiled_step(const KBlock& k, const int8_t* q, float da, const int32_t* s16, float& y) {
  const int ns = QK / k.sub, per = k.sub / 16;
  int32_t s1 = 0, s2 = 0;
  for (int s = 0; s < ns; ++s) s1 = wadd(s1, wmul(k.sc[s], idot(k.v + s * k.sub, q + s * k.sub, k.sub)));
  float r = float(s1) * k.d;
  if (k.has_min) {
    for (int s = 0; s < ns; ++s) {
      int32_t bs = 0;
      for (int u = 0; u < per; ++u) bs += s16[s * per + u];
      s2 = wadd(s2, wmul(k.mn[s], bs));
    }
    r = std::fma(-k.dmin, float(s2), r);
  }
  y = std::fma(r, da, y);
}

inline void x4_step(const KBlock& k, const int8_t* q, float da, const int32_t* s16, float& acc, float& accm) {
  const float t1 = k.d * da, t2 = k.dmin * da;
  for (int p = 0; p < 4; ++p) {
    const int a = 2 * p, b = 2 * p + 1;
    const int32_t I = k.sc[a] * idot(k.v + 32 * a, q + 32 * a, 32) + k.sc[b] * idot(k.v + 32 * b, q + 32 * b, 32);
    const int32_t Mn = k.mn[a] * (s16[2 * a] + s16[2 * a + 1]) + k.mn[b] * (s16[2 * b] + s16[2 * b + 1]);
    acc = std::fma(float(I), t1, acc);
    accm = std::fma(float(Mn), t2, accm);
  }
}

// x (M, K) fp32 times the weight w (N, row bytes) of type `type` (Q4_K_X8: our 8-row layout, read per block).
at::Tensor product(const at::Tensor& x, const at::Tensor& w, int64_t type, bool x4) {
  LLAMA_CHECK(type == Q3_K || type == Q4_K || type == Q4_K_X8 || type == Q5_K || type == Q6_K || type == IQ4_XS,
              "ggml_tiled: ggml type ", type, " has no batched llama.cpp product here (Q3_K, Q4_K, Q5_K, Q6_K, "
              "IQ4_XS)");
  LLAMA_CHECK(!x4 || type == Q4_K || type == Q4_K_X8, "ggml_tiled: the 4-row product is Q4_K's, not type ", type);
  LLAMA_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "ggml_tiled: x must be a contiguous 2-d float32 tensor");
  LLAMA_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "ggml_tiled: the weight must be a contiguous 2-d uint8 tensor");
  Format f;
  format_of(type, f);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), nb = K / QK;
  LLAMA_CHECK(K % QK == 0 && w.size(1) == nb * f.bytes, "ggml_tiled: x has ", K, " inputs, the weight rows ",
              w.size(1), " bytes of blocks of 256");
  LLAMA_CHECK(!x4 || M % 4 == 0, "ggml_tiled: the 4-row product takes a multiple of 4 rows, got ", M);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const Q8K a = quantize(x.data_ptr<float>(), M, K, x4);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t base = type == Q4_K_X8 ? Q4_K : type;
  at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
    std::vector<float> acc(M), accm(M);
    KBlock k;
    uint8_t tmp[144];
    for (int64_t n = n0; n < n1; ++n) {
      std::fill(acc.begin(), acc.end(), 0.f), std::fill(accm.begin(), accm.end(), 0.f);
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = type == Q4_K_X8 ? x8_block(wp, N, nb, n, b, tmp) : wp + n * w.size(1) + b * f.bytes;
        decode(base, blk, k);
        for (int64_t m = 0; m < M; ++m) {
          const int64_t i = m * nb + b;
          if (x4)
            x4_step(k, a.q.data() + i * QK, a.d[i], a.s16.data() + i * 16, acc[m], accm[m]);
          else
            tiled_step(k, a.q.data() + i * QK, a.d[i], a.s16.data() + i * 16, acc[m]);
        }
      }
      for (int64_t m = 0; m < M; ++m) yp[m * N + n] = x4 ? acc[m] - accm[m] : acc[m];
    }
  });
  return y;
}

at::Tensor tiled(const at::Tensor& x, const at::Tensor& w, int64_t type) { return product(x, w, type, false); }

// x (M, K) as q8_K blocks, one row at a time or (x4) as the 4-row quantizer does: (codes (M, K) int8, d (M, K / 256)).
std::tuple<at::Tensor, at::Tensor> q8k(const at::Tensor& x, bool x4) {
  LLAMA_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) % QK == 0,
              "ggml_tiled q8k: x must be a contiguous float32 (rows, multiple of 256) tensor");
  const Q8K a = quantize(x.data_ptr<float>(), x.size(0), x.size(1), x4);
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kChar));
  at::Tensor d = at::empty({x.size(0), x.size(1) / QK}, x.options());
  std::memcpy(q.data_ptr<int8_t>(), a.q.data(), a.q.size());
  std::memcpy(d.data_ptr<float>(), a.d.data(), a.d.size() * sizeof(float));
  return {q, d};
}
at::Tensor q4k_x4(const at::Tensor& x, const at::Tensor& w, int64_t type) { return product(x, w, type, true); }

}  // namespace

TORCH_LIBRARY(llama_ggml_mm, m) {
  m.def("tiled(Tensor x, Tensor weight, int type) -> Tensor");
  m.def("q4k_x4(Tensor x, Tensor weight, int type) -> Tensor");
  m.def("q8k(Tensor x, bool x4) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(llama_ggml_mm, CPU, m) {
  m.impl("tiled", tiled);
  m.impl("q4k_x4", q4k_x4);
  m.impl("q8k", q8k);
}
