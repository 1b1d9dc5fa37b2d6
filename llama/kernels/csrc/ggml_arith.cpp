// llama.cpp's CPU arithmetic for the ops around the block products (RMSNorm, RoPE, SwiGLU, attention over an fp16
// KV cache), so that a GGUF model run in its own blocks gives llama.cpp's logits bit for bit.
//
// Written from what llama.cpp's ggml-cpu does on an AVX-512 build (ops.cpp, vec.h/vec.cpp, simd-mappings.h,
// llamafile/sgemm.cpp; llama-cpp-python 0.3.36), not copied: each vector lane is a scalar here and every fused
// multiply-add an explicit std::fma, so the compiler cannot reorder or contract anything (-ffp-contract=off).
// What each op reproduces:
//   rms_norm: the sum of squares in double, each square rounded to float; scale 1/sqrtf(mean + eps) in float.
//   rope:     cosf/sinf of theta accumulated in float (theta *= powf(base, -2/d)), the rotation contracted into
//             one FMA per output as GCC contracts llama.cpp's rotate_pairs.
//   swiglu:   silu(x) = x / (1 + exp(-x)) with ggml_v_expf's 16-lane polynomial (libm's expf on a tail), times up.
//   attend:   q rounded to fp16; scores = fp16 dots (16 lanes x 4 accumulators when a batch holds one token, one
//             16-lane accumulator in tinyBLAS when it holds more) times the scale; softmax with ggml_v_expf, each
//             16 values' sum in float added into a double; probabilities times (float)(1/sum), rounded to fp16;
//             the value dot in the same lanes as the scores.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "check.h"

namespace {

constexpr int LANES = 16;  // an __m512 of floats

float half_round(float x) { return static_cast<float>(static_cast<at::Half>(x)); }  // fp32 -> fp16, to nearest even

// _mm512_reduce_add_ps as GCC expands it: halves 8+8, 4+4, then pairs (0,2)(1,3), then (0,1).
float reduce16(const float* v) {
  float a[8], b[4];
  for (int l = 0; l < 8; ++l) a[l] = v[l + 8] + v[l];
  for (int l = 0; l < 4; ++l) b[l] = a[l + 4] + a[l];
  float c0 = b[0] + b[2], c1 = b[1] + b[3];
  return c0 + c1;
}

// ggml_v_expf, one lane (AVX-512: the result scaled by _mm512_scalef_ps; |n| > 192 gives 0 or inf).
float v_expf(float x) {
  const float r = 0x1.8p23f;
  const float z = std::fma(x, 0x1.715476p+0f, r);
  const float n = z - r;
  const float b = std::fma(-n, 0x1.7f7d1cp-20f, std::fma(-n, 0x1.62e4p-1f, x));
  const float u = b * b;
  const float j = std::fma(std::fma(std::fma(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u,
                                    std::fma(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)),
                           u, std::fma(0x1.ffffecp-1f, b, 1.0f));
  if (std::fabs(n) > 192.0f) return n <= 0.0f ? 0.0f : INFINITY;
  if (std::isnan(n)) return n;
  return std::ldexp(j, static_cast<int>(n));  // scalef: j * 2^n, rounded once
}

// ggml_vec_dot_f16 (one token in the batch): lane i % 16 of accumulator (i / 16) % 4, FMAs in float, the four
// accumulators added (0+2, 1+3, then 0+1), the lanes reduced, leftovers past the last 64 added in double.
float dot_vec(const float* x, const float* y, int64_t n) {
  float acc[4][LANES] = {};
  const int64_t np = n & ~int64_t(63);
  for (int64_t i = 0; i < np; i += 64)
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < LANES; ++l) acc[j][l] = std::fma(x[i + j * LANES + l], y[i + j * LANES + l], acc[j][l]);
  for (int l = 0; l < LANES; ++l) {
    acc[0][l] = acc[0][l] + acc[2][l];
    acc[1][l] = acc[1][l] + acc[3][l];
  }
  for (int l = 0; l < LANES; ++l) acc[0][l] = acc[0][l] + acc[1][l];
  double sum = reduce16(acc[0]);
  for (int64_t i = np; i < n; ++i) sum += static_cast<double>(x[i] * y[i]);
  return static_cast<float>(sum);
}

// tinyBLAS (llamafile_sgemm, f16 x f16, more than one token in the batch): one 16-lane accumulator, FMAs in order
// over the 16-value steps, then the lanes reduced. n is a multiple of 16 (callers pad with zeros).
float dot_tiled(const float* x, const float* y, int64_t n) {
  float acc[LANES] = {};
  for (int64_t i = 0; i < n; i += LANES)
    for (int l = 0; l < LANES; ++l) acc[l] = std::fma(x[i + l], y[i + l], acc[l]);
  return reduce16(acc);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  LLAMA_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "ggml rms_norm: x must be a "
              "contiguous float32 (rows, dim) tensor");
  const int64_t N = x.size(0), D = x.size(1);
  LLAMA_CHECK(weight.scalar_type() == at::kFloat && weight.numel() == D && weight.is_contiguous(),
              "ggml rms_norm: weight must be ", D, " contiguous float32 values");
  at::Tensor out = at::empty_like(x);
  const float *px = x.data_ptr<float>(), *pw = weight.data_ptr<float>();
  float* po = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = px + r * D;
      double sum = 0.0;
      for (int64_t i = 0; i < D; ++i) sum += static_cast<double>(xr[i] * xr[i]);
      const float mean = static_cast<float>(sum / D);
      const float scale = 1.0f / std::sqrt(mean + e);
      for (int64_t i = 0; i < D; ++i) po[r * D + i] = (xr[i] * scale) * pw[i];
    }
  });
  return out;
}

// x (rows, heads, dim) rotated in adjacent pairs at positions (rows,), in place of a copy.
at::Tensor rope(const at::Tensor& x, const at::Tensor& positions, double base) {
  LLAMA_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.is_contiguous(), "ggml rope: x must be a "
              "contiguous float32 (rows, heads, dim) tensor");
  const int64_t N = x.size(0), H = x.size(1), D = x.size(2);
  LLAMA_CHECK(D % 2 == 0, "ggml rope: dim must be even, got ", D);
  LLAMA_CHECK(positions.scalar_type() == at::kLong && positions.numel() == N, "ggml rope: positions must be ", N,
              " int64 values");
  at::Tensor pos = positions.contiguous();
  at::Tensor out = at::empty_like(x);
  const float theta_scale = std::pow(static_cast<float>(base), -2.0f / static_cast<float>(D));
  const float* px = x.data_ptr<float>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  float* po = out.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> cs(D);
    for (int64_t r = r0; r < r1; ++r) {
      float theta = static_cast<float>(pp[r]);
      for (int64_t i = 0; i < D; i += 2) {
        cs[i] = std::cos(theta);
        cs[i + 1] = std::sin(theta);
        theta *= theta_scale;
      }
      for (int64_t h = 0; h < H; ++h) {
        const float* s = px + (r * H + h) * D;
        float* d = po + (r * H + h) * D;
        for (int64_t i = 0; i < D; i += 2) {
          const float c = cs[i], sn = cs[i + 1], x0 = s[i], x1 = s[i + 1];
          d[i] = std::fma(x0, c, -(x1 * sn));
          d[i + 1] = std::fma(x0, sn, x1 * c);
        }
      }
    }
  });
  return out;
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  LLAMA_CHECK(gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat && gate.dim() == 2 &&
              gate.sizes() == up.sizes(), "ggml swiglu: gate and up must be float32 (rows, hidden) of one shape");
  at::Tensor g = gate.contiguous(), u = up.contiguous();
  const int64_t N = g.size(0), F = g.size(1);
  at::Tensor out = at::empty_like(g);
  const float *pg = g.data_ptr<float>(), *pu = u.data_ptr<float>();
  float* po = out.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t vec = F - F % LANES;
      for (int64_t i = 0; i < F; ++i) {
        const float x = pg[r * F + i];
        const float e = i < vec ? v_expf(0.0f - x) : std::exp(-x);
        po[r * F + i] = (x / (1.0f + e)) * pu[r * F + i];
      }
    }
  });
  return out;
}

// One query row (heads * dim floats) over keys/values (kv_heads, S, dim) as fp16-exact floats, positions 0..last.
void attend_row(const float* q, const float* keys, const float* values, int64_t H, int64_t Hkv, int64_t S,
                int64_t D, int64_t last, bool tiled, float scale, float* out) {
  const int64_t n = last + 1;
  const int64_t padded = (n + 63) / 64 * 64;  // llama.cpp's KV length is a multiple of 256: zeros past n
  std::vector<float> qh(D), s(padded, 0.0f), p(padded, 0.0f), col(padded, 0.0f), kpad(D);
  for (int64_t h = 0; h < H; ++h) {
    const int64_t kvh = h / (H / Hkv);
    const float* K = keys + kvh * S * D;
    const float* V = values + kvh * S * D;
    for (int64_t i = 0; i < D; ++i) qh[i] = half_round(q[h * D + i]);
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      const float dot = tiled ? dot_tiled(K + j * D, qh.data(), D) : dot_vec(K + j * D, qh.data(), D);
      s[j] = dot * scale;
      mx = std::max(mx, s[j]);
    }
    double sum = 0.0;
    for (int64_t c = 0; c < padded; c += LANES) {
      float chunk[LANES];
      for (int l = 0; l < LANES; ++l) chunk[l] = c + l < n ? v_expf(s[c + l] - mx) : 0.0f;
      for (int l = 0; l < LANES; ++l) p[c + l] = chunk[l];
      sum += static_cast<double>(reduce16(chunk));
    }
    const float inv = static_cast<float>(1.0 / sum);
    for (int64_t j = 0; j < n; ++j) p[j] = half_round(p[j] * inv);
    for (int64_t d = 0; d < D; ++d) {
      for (int64_t j = 0; j < n; ++j) col[j] = V[j * D + d];
      out[h * D + d] = tiled ? dot_tiled(col.data(), p.data(), padded) : dot_vec(col.data(), p.data(), padded);
    }
  }
}

// q (B, T, heads, dim); keys/values (B, kv_heads, S, dim) float32 holding fp16 values; last (B, T) the newest
// position each query sees. Returns (B, T, heads * dim).
at::Tensor attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& last,
                  bool tiled, double scale) {
  LLAMA_CHECK(q.scalar_type() == at::kFloat && q.dim() == 4, "ggml attend: q must be float32 (B, T, heads, dim)");
  LLAMA_CHECK(keys.scalar_type() == at::kFloat && keys.dim() == 4 && keys.sizes() == values.sizes() &&
              values.scalar_type() == at::kFloat, "ggml attend: keys and values must be float32 (B, kv_heads, "
              "positions, dim) of one shape");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3), Hkv = keys.size(1), S = keys.size(2);
  LLAMA_CHECK(keys.size(0) == B && keys.size(3) == D && H % Hkv == 0 && last.numel() == B * T &&
              last.scalar_type() == at::kLong, "ggml attend: shapes of q, keys and last disagree");
  LLAMA_CHECK(D % LANES == 0, "ggml attend: head dim must be a multiple of 16, got ", D);
  at::Tensor qc = q.contiguous(), kc = keys.contiguous(), vc = values.contiguous(), lc = last.contiguous();
  const int64_t* pl = lc.data_ptr<int64_t>();
  for (int64_t r = 0; r < B * T; ++r)
    LLAMA_CHECK(pl[r] >= 0 && pl[r] < S, "ggml attend: position ", pl[r], " outside the ", S, " cached");
  at::Tensor out = at::empty({B, T, H * D}, q.options());
  const float *pq = qc.data_ptr<float>(), *pk = kc.data_ptr<float>(), *pv = vc.data_ptr<float>();
  float* po = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * T, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / T;
      attend_row(pq + r * H * D, pk + b * Hkv * S * D, pv + b * Hkv * S * D, H, Hkv, S, D, pl[r], tiled, sc,
                 po + r * H * D);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(llama_ggml, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope(Tensor x, Tensor positions, float base) -> Tensor");
  m.def("swiglu(Tensor gate, Tensor up) -> Tensor");
  m.def("attend(Tensor q, Tensor keys, Tensor values, Tensor last, bool tiled, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(llama_ggml, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("rope", rope);
  m.impl("swiglu", swiglu);
  m.impl("attend", attend);
}
