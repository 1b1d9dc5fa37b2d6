// Products of many activation rows (a prompt's prefill) with the 256-value GGUF block weights (Q2_K, Q3_K, Q4_K,
// Q5_K, Q6_K, IQ4_XS; takes_gemm), equal bit for bit to the one-row product of gguf_blocks.cpp for every row.
//
// Why: the one-row loop (gguf_dot.h) unpacks every weight block again for every row: Q4_K's nibbles and 6-bit
// scales, Q6_K's split codes. That is most of its work, and it is repeated M times. Here a panel of kPanel output
// columns is unpacked once (codes to whole bytes, per-16-value int16 scales as the vectors the sums use, fp32 block
// scales), then multiplied by the rows in tiles of rows x columns whose sums stay in registers, each x load serving
// several columns and each weight load several rows.
//
// Exactness: every (row, output) gets the same 8 int32 lanes per block as block_dot (integer sums are exact, so how
// they are grouped does not matter; Q3_K as signed values, Q6_K less its per-lane offsets), then the same fp32
// operations in the same order as block_dot's llama.cpp arithmetic (gguf_gemm.h's Sum: the 8 lanes into acc by fma;
// or the lanes' total by one fma per block into lane 0 (Q4_K, Q2_K)); the mins' acc1 = fma(float(integer sum),
// e * dx, acc1) per block; y = hsum(acc) + acc1. So
// a row's result does not depend on how many rows come with it, and tests/kernels/test_gguf_gemm.py checks this
// against the one-row product for every format. A change to block_dot's arithmetic must be made here too.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

#include "gguf_format.h"
#include "gguf_simd.h"

constexpr int64_t kPanel = 16;  // output columns unpacked at a time (a multiple of 8: corrections() takes 8 at once)

// The product's inputs: the rows' activation codes and scales as gguf_blocks.cpp's quantize_act made them.
struct Gemm {
  const int8_t* xq;   // (M, K) codes
  const float* xd;    // (M, nb) scales, one per weight block
  const int32_t* xp;  // (M, nb, groups / 2) sums of 16 codes, two int16 to an int32
  const int32_t* s16;  // (M, nb, groups) the same 16-value sums as int32 (Q6_K's lane offsets)
  int64_t M, K, N, nb, groups;  // groups: 16-value groups per block
};

// kPanel (or fewer) output columns, unpacked: for block kb and column n, codes[(kb * nt + n) * values ...] are the
// weight codes in value order (unsigned, or signed for Q3_K and IQ4_XS), scales the int16 weights of their pairs
// (16 per 32 values: the group's scale), d the block scale, wg (kb, groups / 2, n, 2) the integer weights of the
// 16-sums in the scalar part, e its fp32 scale.
struct Panel {
  int64_t n0 = 0, nt = 0;
  std::vector<uint8_t> codes;
  std::vector<int16_t> scales, wg, sc16;  // sc16: Q6_K's 16 group scales per (block, column), for its offsets
  std::vector<float> d, e;
};

// One block b of `type`: codes (values, in value order), group scales sg and scalar weights wg (values / 16 each),
// d and e.
void unpack_block(int64_t type, const uint8_t* b, uint8_t* codes, int16_t* sg, int16_t* wg, float& d, float& e) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1), three = _mm256_set1_epi8(3);
  switch (type) {
    case Q4_K: case Q5_K: {
      d = half_to_float(b), e = half_to_float(b + 2);
      uint8_t sc[8], m[8];
      scale_min_k4(b + 4, sc, m);
      const uint8_t* qs = type == Q4_K ? b + 16 : b + 48;
      const __m256i qh = load32(b + 16);
      for (int j = 0; j < 4; ++j) {
        const __m256i raw = load32(qs + 32 * j);
        __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
        if (type == Q5_K) {
          lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), one), 4));
          hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), one), 4));
        }
        store32(codes + 64 * j, lo), store32(codes + 64 * j + 32, hi);
      }
      for (int g = 0; g < 16; ++g) sg[g] = sc[g / 2], wg[g] = int16_t(-m[g / 2]);
      return;
    }
    case Q6_K: {
      d = e = half_to_float(b + 208);
      for (int h = 0; h < 2; ++h) {
        const __m256i l0 = load32(b + 64 * h), l1 = load32(b + 64 * h + 32), hb = load32(b + 128 + 32 * h);
        const __m256i q[4] = {_mm256_and_si256(l0, low4), _mm256_and_si256(l1, low4),
                              _mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                              _mm256_and_si256(_mm256_srli_epi16(l1, 4), low4)};
        for (int i = 0; i < 4; ++i) {
          const __m256i high = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * i), three), 4);
          store32(codes + 128 * h + 32 * i, _mm256_or_si256(q[i], high));
        }
      }
      for (int g = 0; g < 16; ++g) sg[g] = int8_t(b[192 + g]), wg[g] = 0;  // offsets: per lane, in the tile
      return;
    }
    case Q2_K: case Q3_K: {
      const bool two = type == Q2_K;
      d = half_to_float(b + (two ? 80 : 108)), e = two ? half_to_float(b + 82) : d;
      int16_t sc[16];
      if (!two) q3k_scales(b + 96, sc);
      const uint8_t* qs = b + (two ? 16 : 32);
      const __m256i hm = load32(b);
      for (int h = 0; h < 2; ++h) {
        const __m256i raw = load32(qs + 32 * h);
        for (int s = 0; s < 4; ++s) {
          __m256i q = _mm256_and_si256(_mm256_srli_epi16(raw, 2 * s), three);
          if (!two)  // Q3_K: the signed value code + 4 * hbit - 4
            q = _mm256_sub_epi8(_mm256_or_si256(q, _mm256_slli_epi16(
                    _mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + s), one), 2)), _mm256_set1_epi8(4));
          store32(codes + 128 * h + 32 * s, q);
        }
      }
      for (int g = 0; g < 16; ++g) {
        sg[g] = two ? int16_t(b[g] & 0x0F) : sc[g];
        wg[g] = two ? int16_t(-(b[g] >> 4)) : 0;
      }
      return;
    }
    case IQ4_XS: {
      d = half_to_float(b), e = 0.f;
      for (int j = 0; j < 8; ++j) store32(codes + 32 * j, iq4_lookup(nibbles_split(b + 8 + 16 * j)));
      for (int g = 0; g < 16; ++g) sg[g] = int16_t(iq4xs_scale(b, g / 2)), wg[g] = 0;
      return;
    }
  }
}

// Columns n0 .. n0 + nt of w (row_bytes per column) unpacked into p.
void unpack(int64_t type, const Format& f, const uint8_t* w, int64_t row_bytes, const Gemm& g, int64_t n0,
            int64_t nt, Panel& p) {
  const int64_t chunks = f.values / 32, G = g.groups;
  p.n0 = n0, p.nt = nt;
  p.codes.resize(g.nb * nt * f.values), p.scales.resize(g.nb * nt * chunks * 16);
  p.wg.resize(g.nb * nt * G), p.d.resize(g.nb * nt), p.e.resize(g.nb * nt);
  if (type == Q6_K) p.sc16.resize(g.nb * nt * 16);
  int16_t sg[16], wg[16];
  for (int64_t n = 0; n < nt; ++n)
    for (int64_t kb = 0; kb < g.nb; ++kb) {
      const int64_t at = kb * nt + n;
      const uint8_t* b = w + (n0 + n) * row_bytes + kb * f.bytes;
      unpack_block(type, b, p.codes.data() + at * f.values, sg, wg, p.d[at], p.e[at]);
      for (int64_t c = 0; c < chunks; ++c)  // chunk c's pairs: lanes 0-7 group 2c's scale, lanes 8-15 group 2c + 1's
        store32(p.scales.data() + (at * chunks + c) * 16, _mm256_set_m128i(_mm_set1_epi16(sg[2 * c + 1]),
                                                                           _mm_set1_epi16(sg[2 * c])));
      for (int64_t q = 0; q < G / 2; ++q)
        for (int t = 0; t < 2; ++t) p.wg[((kb * (G / 2) + q) * nt + n) * 2 + t] = wg[2 * q + t];
      if (type == Q6_K) std::memcpy(p.sc16.data() + at * 16, sg, sizeof sg);
    }
}

// y[m][panel columns] = acc1, the mins' part of block_dot (Q2_K, Q4_K, Q5_K; MINS false: none) summed over the
// blocks in order, 8 columns at a time (the same fp32 operations per column as one at a time).
template <bool MINS>
void corrections(const Gemm& g, const Panel& p, float* y) {
  constexpr int PAIRS = 8;  // 16-value group pairs per 256-value block
  const int64_t nt = p.nt, nb = g.nb;
  const float *e = p.e.data(), *xd = g.xd;
  const int16_t* wg = p.wg.data();
  const int32_t* xp = g.xp;
  for (int64_t m = 0; m < g.M; ++m) {
    float* out = y + m * g.N + p.n0;
    int64_t n = 0;
    for (; n + 8 <= nt; n += 8) {
      __m256 a1 = _mm256_setzero_ps();
      for (int64_t kb = 0; kb < nb && MINS; ++kb) {
        const __m256 ev = _mm256_loadu_ps(e + kb * nt + n);
        __m256i c = _mm256_setzero_si256();
        const int16_t* wq = wg + (kb * PAIRS * nt + n) * 2;
        const int32_t* xq = xp + (m * nb + kb) * PAIRS;
        for (int q = 0; q < PAIRS; ++q)
          c = _mm256_add_epi32(c, _mm256_madd_epi16(load32(wq + q * nt * 2), _mm256_set1_epi32(xq[q])));
        const __m256 edx = _mm256_mul_ps(ev, _mm256_set1_ps(xd[m * nb + kb]));
        a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), edx, a1);
      }
      _mm256_storeu_ps(out + n, a1);
    }
    for (; n < nt; ++n) {
      float a1 = 0.f;
      for (int64_t kb = 0; kb < nb && MINS; ++kb) {
        int32_t c = 0;
        for (int q = 0; q < PAIRS; ++q) {
          const int32_t packed = xp[(m * nb + kb) * PAIRS + q];
          const int16_t* wq = wg + ((kb * PAIRS + q) * nt + n) * 2;
          c += int32_t(wq[0]) * int16_t(packed & 0xFFFF) + int32_t(wq[1]) * int16_t(packed >> 16);
        }
        a1 = std::fma(float(c), e[kb * nt + n] * xd[m * nb + kb], a1);
      }
      out[n] = a1;
    }
  }
}

// The formats gguf_gemm takes: the 256-value K-quants and IQ4_XS in the file's layout.
bool takes_gemm(int64_t type) {
  return type == Q2_K || type == Q3_K || type == Q4_K || type == Q5_K || type == Q6_K || type == IQ4_XS;
}

void scalar_parts(int64_t type, const Gemm& g, const Panel& p, float* y) {
  if (type == Q2_K || type == Q4_K || type == Q5_K) corrections<true>(g, p, y);
  else corrections<false>(g, p, y);  // IQ4_XS, Q3_K, Q6_K
}

#define GGUF_INNER "gguf_gemm.h"
#include "gguf_copies.h"
#undef GGUF_INNER

}  // namespace

namespace llama_cpu {

// From this many rows a product goes to gguf_gemm; below, the one-row loop's shared-unpack copy (gguf_krows.h) runs
// it. One thread, 4096x4096 and 11008x4096, both copies: the shared loop took 0.55x-0.85x gguf_gemm's time at 2 to 7
// rows and 0.6x-1.0x at 8 (Q2_K 1.1x-1.2x), gguf_gemm 0.9x-1.0x the shared loop's at 9 (8 rows and 1), and less
// from there on (docs/performance.md).
constexpr int64_t kGemmMinRows = 9;
int64_t gemm_min_rows(int64_t type) { return type == Q2_K ? 8 : kGemmMinRows; }

// y (M, N) = the activation rows (gguf_blocks.cpp's quantize_act: codes xq, scales xd, 16-sums s16; xs, the q8_1
// sums of 32-value blocks, is unused here) times the GGUF weight w (N, row bytes) of `layout`, as its one-row loop
// gives each row. False (y untouched) where it does not take the product: fewer than gemm_min_rows, formats
// other than takes_gemm's: gguf_rows.h's (their rows share each block's unpacking there), Q4_K_X8 (whose own loop,
// gguf_x8_dot.h, feeds 8 outputs from each activation load: 8 rows of a 4096x2048 product took 1.45 ms there and
// 7.8 ms here, 256 rows 42 and 51 ms, one thread, docs/performance.md), or activation blocks other than the weight's.
bool gguf_gemm(int64_t layout, const int8_t* xq, const float* xd, const int32_t* s16, const float* /*xs*/,
               const uint8_t* w, int64_t M, int64_t K, int64_t N, float* y, bool use_vnni) {
  Format f;
  if (M < gemm_min_rows(layout) || !takes_gemm(layout) || !format_of(layout, f) || f.act_block != f.values ||
      K % f.values != 0)
    return false;
  const int64_t type = layout;
  const int64_t nb = K / f.values, groups = f.values / 16;
  std::vector<int32_t> packed(M * nb * groups / 2);  // s16 in int16 pairs (each at most 16 * 127 in magnitude)
  for (int64_t i = 0; i < int64_t(packed.size()); ++i)
    packed[i] = int32_t(uint32_t(uint16_t(s16[2 * i])) | (uint32_t(uint16_t(s16[2 * i + 1])) << 16));
  const Gemm g{xq, xd, packed.data(), s16, M, K, N, nb, groups};
  const int64_t panels = (N + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    Panel p;
    for (int64_t i = p0; i < p1; ++i) {
      const int64_t n0 = i * kPanel;
      unpack(type, f, w, nb * f.bytes, g, n0, std::min(kPanel, N - n0), p);
      scalar_parts(type, g, p, y);
      (use_vnni ? vnni::products : avx2::products)(type, g, p, 0, M, y);
    }
  });
  return true;
}

}  // namespace llama_cpu
