// Products with weights in GGUF's own block formats (llama.cpp's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, and the
// 256-value super-blocks Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS), read as the file holds them: a weight matrix is (N, row bytes)
// of the file's blocks, each row the blocks of one output row (llama/quantization/gguf_blocks.py).
//
// Activations are quantized to int8 as llama.cpp's own CPU kernels do it, with its roundings (quantize_block):
// blocks of 32 for the 32-value formats (its q8_0, and q8_1's fp16 sums for Q4_1 and Q5_1's mins), and blocks of 256
// for the super-block formats (its q8_K: d = 1 / (-127 / max), with 16-value sums). Every integer sum is exact, and
// the scales multiply in fp32 in the order llama.cpp's x86 code uses for a one-row product (gguf_dot.h: its AVX2
// dots' 8 fp32 lanes, or one fp32 sum per output where it runs a repacked layout: Q4_0, IQ4_NL, Q4_K, Q2_K), so a
// product is llama.cpp's bit for bit given the same input (tests/quantization/test_gguf_llama_cpp.py,
// tests/kernels/test_gguf_q8k.py). A row's result never depends on the other rows of its batch: each (row, output)
// is summed by the same code in the same order (llama.cpp sums batches of 4+ rows of Q4_K otherwise).
// AVX2 everywhere; on CPUs with AVX-512 VNNI (and LLAMA_CPU_AVX512 not "0") a second copy of the inner loops runs
// (gguf_dot.h): vpdpbusd for the unit-weight int8 sums, 512-bit vectors for Q4_K's and Q6_K's, F16C for the
// scales. It computes the same int32 lanes and the same fp32 operations in the same order, so its results are
// bitwise the AVX2 copy's.
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
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

#include "gguf_format.h"
#include "gguf_simd.h"
#include "gguf_x8.h"

// ---- dequantization: one block into out, with the operations (and roundings) of gguf's numpy code ----

void dequantize_block(int64_t type, const uint8_t* b, float* out) {
  switch (type) {
    case Q8_0: {
      const float d = half_to_float(b);
      for (int i = 0; i < 32; ++i) out[i] = float(int8_t(b[2 + i])) * d;
      return;
    }
    case Q4_0: case IQ4_NL: {
      const float d = half_to_float(b);
      for (int i = 0; i < 16; ++i) {
        const int lo = b[2 + i] & 0x0F, hi = b[2 + i] >> 4;
        out[i] = d * float(type == Q4_0 ? lo - 8 : kIQ4[lo]);
        out[i + 16] = d * float(type == Q4_0 ? hi - 8 : kIQ4[hi]);
      }
      return;
    }
    case Q4_1: {
      const float d = half_to_float(b), m = half_to_float(b + 2);
      for (int i = 0; i < 16; ++i) out[i] = d * float(b[4 + i] & 0x0F) + m, out[i + 16] = d * float(b[4 + i] >> 4) + m;
      return;
    }
    case Q5_0: case Q5_1: {
      const bool one = type == Q5_1;
      const float d = half_to_float(b), m = one ? half_to_float(b + 2) : 0.f;
      uint32_t qh;
      std::memcpy(&qh, b + (one ? 4 : 2), 4);
      const uint8_t* qs = b + (one ? 8 : 6);
      for (int i = 0; i < 32; ++i) {
        const int q = (i < 16 ? qs[i] & 0x0F : qs[i - 16] >> 4) | (((qh >> i) & 1) << 4);
        out[i] = one ? d * float(q) + m : d * float(q - 16);
      }
      return;
    }
    case Q4_K: case Q5_K: {
      const float d = half_to_float(b), dmin = half_to_float(b + 2);
      uint8_t sc[8], m[8];
      scale_min_k4(b + 4, sc, m);
      const uint8_t* qh = b + 16;
      const uint8_t* qs = type == Q4_K ? b + 16 : b + 48;
      for (int j = 0; j < 8; ++j) {
        const float ds = d * float(sc[j]), dm = dmin * float(m[j]);
        for (int l = 0; l < 32; ++l) {
          int q = (qs[(j / 2) * 32 + l] >> (4 * (j % 2))) & 0x0F;
          if (type == Q5_K) q |= ((qh[l] >> j) & 1) << 4;
          out[j * 32 + l] = ds * float(q) - dm;
        }
      }
      return;
    }
    case Q6_K: {
      const uint8_t *ql = b, *qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = half_to_float(b + 208);
      for (int i = 0; i < 256; ++i) {
        const int h = i / 128, r = i % 128, part = r / 32, l = r % 32;  // part: ql low/low/high/high of 2 halves
        const int low = (ql[64 * h + l + 32 * (part % 2)] >> (4 * (part / 2))) & 0x0F;
        const int high = (qh[32 * h + l] >> (2 * part)) & 3;
        out[i] = (d * float(sc[i / 16])) * float((low | (high << 4)) - 32);
      }
      return;
    }
    case Q2_K: case Q3_K: {  // value i: 2-bit code of byte 32 (i / 128) + i % 32, bits 2 ((i / 32) % 4); group i / 16
      const bool two = type == Q2_K;
      const float d = half_to_float(b + (two ? 80 : 108)), dmin = two ? half_to_float(b + 82) : 0.f;
      int16_t sc[16];
      if (!two) q3k_scales(b + 96, sc);
      const uint8_t* qs = b + (two ? 16 : 32);
      for (int i = 0; i < 256; ++i) {
        const int g = i / 16, l = i % 32;
        int q = (qs[32 * (i / 128) + l] >> (2 * ((i / 32) % 4))) & 3;
        if (two) {
          out[i] = (d * float(b[g] & 0x0F)) * float(q) - dmin * float(b[g] >> 4);
        } else {
          q -= ((b[l] >> (i / 32)) & 1) ? 0 : 4;  // hmask bit i / 32 of byte i % 32: clear means -4
          out[i] = (d * float(sc[g])) * float(q);
        }
      }
      return;
    }
    case IQ4_XS: {
      const float d = half_to_float(b);
      for (int j = 0; j < 8; ++j) {
        const float dl = d * float(iq4xs_scale(b, j));
        for (int i = 0; i < 16; ++i) {
          const uint8_t q = b[8 + 16 * j + i];
          out[32 * j + i] = dl * float(kIQ4[q & 0x0F]), out[32 * j + i + 16] = dl * float(kIQ4[q >> 4]);
        }
      }
      return;
    }
  }
}

// ---- activations ----

// fp32 to fp16 and back, rounding to nearest even (F16C's _cvtss_sh, which ggml's GGML_FP32_TO_FP16 uses)
inline float round_to_half(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = u & 0x80000000u, a = u & 0x7FFFFFFFu;
  uint16_t h;
  if (a >= 0x7F800000u) {
    h = uint16_t(sign >> 16 | (a > 0x7F800000u ? 0x7E00u : 0x7C00u));
  } else if (a >= 0x477FF000u) {  // rounds past the largest half
    h = uint16_t(sign >> 16 | 0x7C00u);
  } else if (a < 0x38800000u) {  // subnormal half (or zero): a multiple of 2^-24, rounded to even by nearbyint
    float v;
    std::memcpy(&v, &a, 4);
    h = uint16_t(sign >> 16 | uint32_t(std::nearbyint(v * 16777216.f)));
  } else {
    const uint32_t m = a + 0xFFFu + ((a >> 13) & 1u);  // round to nearest even at bit 13
    h = uint16_t(sign >> 16 | ((m - 0x38000000u) >> 13));
  }
  uint8_t b[2];
  std::memcpy(b, &h, 2);
  return half_to_float(b);
}

struct Act {
  std::vector<int8_t> q;     // (M, K) codes
  std::vector<float> d;      // (M, K / block) scales
  std::vector<int32_t> s16;  // (M, K / 16) sums of 16 codes
  std::vector<float> s;      // (M, K / 32) llama.cpp's q8_1 sums: d * (sum of the block's codes), rounded to fp16
};

// One block as llama.cpp's CPU backend quantizes it. Blocks of 32 (its q8_0 and q8_1): d = amax / 127 kept as
// fp16, codes round(x * (127 / amax)) to nearest even, s = d * sum rounded to fp16 (d before its rounding).
// Blocks of 256 (its q8_K, quantize_row_q8_K_ref): max is the first element of the largest magnitude, with its
// sign; iscale = -127 / max, codes round(iscale * x) to nearest even (llama.cpp's nearest_int) capped at 127, and
// d = 1 / iscale in fp32 (so the largest element's code is -127 when it is positive).
inline void quantize_block(const float* v, int64_t block, int8_t* q, float& d, float& s) {
  if (block == 32) {
    float amax = 0.f;
    for (int64_t j = 0; j < block; ++j) amax = std::fmax(amax, std::fabs(v[j]));
    const float d32 = amax / 127.f, id = amax != 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int64_t j = 0; j < block; ++j) q[j] = int8_t(int32_t(std::nearbyint(v[j] * id))), sum += q[j];
    d = round_to_half(d32), s = round_to_half(d32 * float(sum));
    return;
  }
  float amax = 0.f, max = 0.f;
  for (int64_t j = 0; j < block; ++j) {
    const float ax = std::fabs(v[j]);
    if (ax > amax) amax = ax, max = v[j];
  }
  s = 0.f;
  if (amax == 0.f) {
    d = 0.f;
    std::memset(q, 0, size_t(block));
    return;
  }
  const float iscale = -127.f / max;
  for (int64_t j = 0; j < block; ++j) q[j] = int8_t(std::min<int32_t>(127, int32_t(std::nearbyint(iscale * v[j]))));
  d = 1.f / iscale;
}

Act quantize_act(const float* x, int64_t M, int64_t K, int64_t block) {
  const int64_t nb = K / block;
  Act a{std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<int32_t>(M * K / 16),
        std::vector<float>(block == 32 ? M * nb : 0)};
  at::parallel_for(0, M * nb, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int8_t* q = a.q.data() + i * block;
      float s;
      quantize_block(x + i * block, block, q, a.d[i], s);
      if (block == 32) a.s[i] = s;
      for (int64_t j = 0; j < block; j += 16) {
        int32_t t = 0;
        for (int k = 0; k < 16; ++k) t += q[j + k];
        a.s16[(i * block + j) / 16] = t;
      }
    }
  });
  return a;
}

// ---- the products' inner loops, twice: AVX2, and AVX-512 VNNI (the same sums; gguf_dot.h) ----

#define GGUF_INNER "gguf_dot.h"
#include "gguf_copies.h"
#undef GGUF_INNER

// Whether the VNNI copy runs: the CPU has AVX-512 (F, BW, VL) and VNNI, and LLAMA_CPU_AVX512 is not "0" (read on
// every call, so a test can compare both copies in one process).
bool use_vnni() {
  static const bool cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  const char* env = std::getenv("LLAMA_CPU_AVX512");
  return cpu && !(env && std::strcmp(env, "0") == 0);
}

// Q4_K_X8's per-block activation sums (gguf_x8_dot.h): (M, nb, 4) int32, entry p holding the sums of sub-blocks
// 2p and 2p + 1's 32 codes as two int16 (each at most 32 * 127 in magnitude).
std::vector<int32_t> x8_pairs(const Act& a, int64_t M, int64_t K) {
  std::vector<int32_t> pairs(M * K / 64);
  for (int64_t i = 0; i < int64_t(pairs.size()); ++i) {
    const int32_t* s = a.s16.data() + 4 * i;
    pairs[i] = int32_t(uint32_t(uint16_t(s[0] + s[1])) | (uint32_t(uint16_t(s[2] + s[3])) << 16));
  }
  return pairs;
}

}  // namespace

namespace llama_cpu {

// One block's values as fp32 (gguf_float.cpp unpacks the formats it has no vector code for with this).
void gguf_dequantize_block(int64_t type, const uint8_t* b, float* out) { dequantize_block(type, b, out); }

bool gguf_gemm(int64_t type, const int8_t* xq, const float* xd, const int32_t* s16, const float* xs,
               const uint8_t* w, int64_t M, int64_t K, int64_t N, float* y, bool use_vnni);  // gguf_gemm.cpp

// x (M, K) fp32 times the GGUF weight w (N, row bytes) of ggml type `type`: y (M, N) fp32.
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& w, int64_t type) {
  Format f;
  LLAMA_CHECK(format_of(type, f), "gguf_linear: ggml type ", type, " is not run natively");
  LLAMA_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "gguf_linear: x must be a contiguous 2-d float32 tensor");
  LLAMA_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "gguf_linear: the weight must be a contiguous 2-d uint8 tensor");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  LLAMA_CHECK(K % f.values == 0 && w.size(1) == K / f.values * f.bytes, "gguf_linear: x has ", K,
              " inputs, the weight rows ", w.size(1), " bytes of blocks of ", f.values);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const Act a = quantize_act(x.data_ptr<float>(), M, K, f.act_block);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const bool v = use_vnni();
  if (gguf_gemm(type, a.q.data(), a.d.data(), a.s16.data(), a.s.data(), wp, M, K, N, yp, v)) return y;  // many rows
  if (type == Q4_K_X8) {
    const std::vector<int32_t> pairs = x8_pairs(a, M, K);
    (v ? vnni::linear_x8 : avx2::linear_x8)(a, pairs.data(), wp, M, K, N, yp);
  } else {
    (v ? vnni::linear : avx2::linear)(type, a, wp, f, M, K, N, yp);
  }
  return y;
}

// A Q4_K matrix w (N, row bytes) in the Q4_K_X8 layout (gguf_x8.h), or (back) a Q4_K_X8 one as the file held it:
// a new tensor of w's shape.
at::Tensor gguf_repack(const at::Tensor& w, int64_t type, bool back) {
  LLAMA_CHECK(type == Q4_K, "gguf_repack: only Q4_K (ggml type ", int64_t(Q4_K), ") repacks, not type ", type);
  LLAMA_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "gguf_repack: the weight must be a contiguous 2-d uint8 tensor");
  LLAMA_CHECK(w.size(1) % 144 == 0, "gguf_repack: rows of ", w.size(1), " bytes are not whole Q4_K blocks");
  const int64_t N = w.size(0), nb = w.size(1) / 144, groups = N / kX8Rows;
  at::Tensor out = at::empty(w.sizes(), w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) { x8_convert(src, dst, N, nb, g0, g1, !back); });
  const int64_t done = groups * kX8Rows * w.size(1);  // the last N % 8 rows stay as they are
  std::memcpy(dst + done, src + done, size_t(w.numel() - done));
  return out;
}

// Rows `ids` of the GGUF matrix w (N, row bytes), dequantized to fp32 (an embedding lookup reads only these rows).
at::Tensor gguf_rows(const at::Tensor& w, const at::Tensor& ids, int64_t type) {
  Format f;
  LLAMA_CHECK(format_of(type, f), "gguf_rows: ggml type ", type, " is not run natively");
  LLAMA_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "gguf_rows: the weight must be a contiguous 2-d uint8 tensor");
  LLAMA_CHECK(w.size(1) % f.bytes == 0, "gguf_rows: rows of ", w.size(1), " bytes are not whole blocks");
  const at::Tensor idx = ids.to(at::kLong).contiguous();
  const int64_t R = idx.numel(), nb = w.size(1) / f.bytes, K = nb * f.values, N = w.size(0);
  at::Tensor out = at::empty({R, K}, w.options().dtype(at::kFloat));
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) LLAMA_CHECK(ip[r] >= 0 && ip[r] < N, "gguf_rows: row ", ip[r], " of ", N);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R * nb, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / nb, blk = i % nb;
      uint8_t block[144];
      if (type == Q4_K_X8)
        dequantize_block(Q4_K, x8_block(wp, N, nb, ip[r], blk, block), op + r * K + blk * f.values);
      else
        dequantize_block(type, wp + ip[r] * w.size(1) + blk * f.bytes, op + r * K + blk * f.values);
    }
  });
  return out;
}

}  // namespace llama_cpu

TORCH_LIBRARY_FRAGMENT(llama_cpu, m) {
  m.def("gguf_linear(Tensor x, Tensor weight, int type) -> Tensor");
  m.def("gguf_rows(Tensor weight, Tensor ids, int type) -> Tensor");
  m.def("gguf_repack(Tensor weight, int type, bool back=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(llama_cpu, CPU, m) {
  m.impl("gguf_linear", llama_cpu::gguf_linear);
  m.impl("gguf_rows", llama_cpu::gguf_rows);
  m.impl("gguf_repack", llama_cpu::gguf_repack);
}
