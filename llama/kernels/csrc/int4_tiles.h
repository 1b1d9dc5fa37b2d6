// The int4 product's tiles (int4_linear in cpu_kernels.cpp, which includes this file inside its anonymous namespace,
// after Blocks, kBlock, prefetch, unpack_nibbles, block_dot and LLAMA_AVX512).
//
// Rows of 8-block multiples run "transposed": 8 (AVX2) or 16 (AVX-512) blocks' codes are shuffled once, shared by
// every row of the tile, so that each 32-bit lane of the integer dot products holds 4 codes of one block, and
// summing the 8 vectors of a group lane by lane gives each block's exact integer total. A row then pays one
// conversion and two fmas (its products, its offsets' terms) for 8 or 16 blocks instead of a conversion and an fma
// per block (AVX2) or block pair (VNNI, and a permute): extra rows of a tile cost little more than their
// activations' loads and integer dot products, and a row takes one register, so the VNNI tile holds 8 rows
// (docs/performance.md, "int4 rows").
// The activation codes are stored in the same shuffled order (code_slots). A row's fp32 sums run in the same order
// whatever the tile, so a row's result never depends on the other rows of its batch.
#pragma once

// How a row of activation codes is stored: as x (int8 weights), each block's 16 even elements then its 16 odd ones
// (int4 rows not of 8-block multiples), or shuffled in groups of 8 blocks (AVX2) or 16 (AVX-512; a last 8 as AVX2).
enum class Layout { Plain, Interleave, Groups8, Groups16 };

// Where the 32 elements of block b of a row of nb blocks are stored in it. In a group of G = 8 W blocks (W = 2 or
// 4 128-bit lanes), vector u = 2 v + h (32 W bytes) holds, in 32-bit lane 4 L + i, elements 8 v + h, + 2, + 4, + 6
// of block W i + L: the order in which unpack_groups leaves the weights' nibbles (h = 1: the high ones).
inline void code_slots(Layout layout, int64_t nb, int64_t b, int64_t slot[32]) {
  for (int64_t j = 0; j < 32; ++j) slot[j] = b * kBlock + (layout == Layout::Plain ? j : (j % 2) * 16 + j / 2);
  if (layout == Layout::Plain || layout == Layout::Interleave) return;
  const bool wide = layout == Layout::Groups16 && b / 16 * 16 + 16 <= nb;
  const int64_t W = wide ? 4 : 2, g0 = wide ? b / 16 * 16 : b / 8 * 8, i = (b - g0) / W, L = (b - g0) % W;
  for (int64_t j = 0; j < 32; ++j) slot[j] = g0 * kBlock + (2 * (j / 8) + j % 2) * 16 * W + (4 * L + i) * 4 + (j % 8) / 2;
}

// The (scale, zero) pairs of 8 consecutive blocks' groups, as 8 32-bit words (the bf16 scale in the low half),
// for a row whose block count is a multiple of 8. Groups of 2 or 4 blocks load their 4 or 2 pairs and repeat each
// over its blocks; groups of 8 or more blocks broadcast one; other sizes walk the groups (no division per block).
struct GroupPairs {
  int64_t blocks_per_group;
  __m256i block_group, first_groups;
  explicit GroupPairs(int64_t bpg) : blocks_per_group(bpg) {
    alignas(32) int32_t lanes[8], loads[8];  // block j's group among the loaded ones; which groups to load
    for (int j = 0; j < 8; ++j) lanes[j] = j / int32_t(bpg), loads[j] = j < 8 / bpg ? -1 : 0;
    block_group = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
    first_groups = _mm256_load_si256(reinterpret_cast<const __m256i*>(loads));
  }
  // pairs: the row's (s, z) words; b8: the first of the 8 blocks; g, in_group: the walk's state, from 0, 0.
  __m256i load(const uint32_t* pairs, int64_t b8, int64_t& g, int64_t& in_group) const {
    if (blocks_per_group == 1) {
      prefetch(pairs + b8);
      return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + b8));
    }
    if (8 % blocks_per_group == 0) {
      const uint32_t* gp = pairs + (b8 >> 3) * (8 / blocks_per_group);
      prefetch(gp);
      return _mm256_permutevar8x32_epi32(_mm256_maskload_epi32(reinterpret_cast<const int*>(gp), first_groups),
                                         block_group);
    }
    if (blocks_per_group % 8 == 0) return _mm256_set1_epi32(int32_t(pairs[b8 / blocks_per_group]));
    alignas(32) uint32_t block_pairs[8];
    for (int j = 0; j < 8; ++j) {
      block_pairs[j] = pairs[g];
      if (++in_group == blocks_per_group) in_group = 0, ++g;
    }
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(block_pairs));
  }
};

// The scale and the offset (zero - 8 * scale) of 8 blocks' groups, from their (s, z) words.
inline void scale_offset(__m256i pairs, __m256& s, __m256& zs) {
  s = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
  zs = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), s,
                        _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(int32_t(0xFFFF0000u)))));
}

// The codes of 8 blocks (128 bytes) as the 8 vectors of code_slots' order: a 4 x 4 transpose of 32-bit words in
// each 128-bit lane of 4 loads, then each word's low and high nibbles. Lane 4 L + i holds block 2 i + L.
inline void unpack_groups(const uint8_t* c, __m256i w[8]) {
  __m256i a[4];
  for (int i = 0; i < 4; ++i) a[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * i));
  const __m256i t0 = _mm256_unpacklo_epi32(a[0], a[1]), t1 = _mm256_unpackhi_epi32(a[0], a[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(a[2], a[3]), t3 = _mm256_unpackhi_epi32(a[2], a[3]);
  const __m256i v[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2), _mm256_unpacklo_epi64(t1, t3),
                        _mm256_unpackhi_epi64(t1, t3)};
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int u = 0; u < 4; ++u)
    w[2 * u] = _mm256_and_si256(v[u], low4), w[2 * u + 1] = _mm256_and_si256(_mm256_srli_epi16(v[u], 4), low4);
}

// 8 blocks' exact integer totals (lane 4 L + i: block 2 i + L) of codes w with a row's activation codes xq. A
// 16-bit lane sums 16 products of at most 15 * 127, 30480: no overflow.
inline __m256i group_totals(const __m256i w[8], const int8_t* xq) {
  __m256i sum = _mm256_setzero_si256();
  for (int u = 0; u < 8; ++u)
    sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(w[u], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * u))));
  return _mm256_madd_epi16(sum, _mm256_set1_epi16(1));
}

// Natural block order -> the lanes' (lane 4 L + i holds block 2 i + L).
inline __m256i lanes8() { return _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7); }

// Rows [n0, n1) of y for rows m0 .. m0 + T of x, int4 weights in the storage layout of llama/quantization/int4.py,
// rows of 8-block multiples, x's codes in Layout::Groups8.
template <int T>
void q4_tile(const Blocks& xb, int64_t m0, int64_t K, int64_t N, const uint8_t* codes, const uint16_t* scales,
             int64_t groups, int64_t blocks_per_group, int64_t n0, int64_t n1, float* y) {
  const int64_t nb = K / kBlock;
  const GroupPairs group_pairs(blocks_per_group);
  const __m256i lanes = lanes8();
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* c = codes + n * (K / 2);
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(scales + n * groups * 2);  // (s, z) as one word
    __m256 acc[T];  // the products' terms, then the offsets' (lane b: block b; one register a row)
    for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
    int64_t g = 0, in_group = 0;
    for (int64_t b8 = 0; b8 < nb; b8 += 8) {
      prefetch(c + b8 * 16);
      prefetch(c + b8 * 16 + 64);
      __m256 s, zs;
      scale_offset(group_pairs.load(pairs, b8, g, in_group), s, zs);
      s = _mm256_permutevar8x32_ps(s, lanes);
      __m256i w[8];
      unpack_groups(c + b8 * 16, w);
      for (int t = 0; t < T; ++t) {
        const int64_t i = (m0 + t) * nb + b8;
        const __m256 ds = _mm256_mul_ps(_mm256_permutevar8x32_ps(_mm256_loadu_ps(xb.d.data() + i), lanes), s);
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(group_totals(w, xb.q.data() + i * kBlock)), ds, acc[t]);
        acc[t] = _mm256_fmadd_ps(_mm256_loadu_ps(xb.sum.data() + i), zs, acc[t]);
      }
    }
    for (int t = 0; t < T; ++t) y[(m0 + t) * N + n] = hsum(acc[t]);
  }
}

// q4_tile for rows whose block count is not a multiple of 8: a group at a time, x's codes in Layout::Interleave.
template <int T>
void q4_tile_groups(const Blocks& xb, const std::vector<float>& group_sum, int64_t m0, int64_t K, int64_t N,
                    const uint8_t* codes, const uint16_t* scales, int64_t groups, int64_t blocks_per_group,
                    int64_t n0, int64_t n1, float* y) {
  const int64_t nb = K / kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* c = codes + n * (K / 2);
    const uint16_t* sz = scales + n * groups * 2;
    __m256 acc[T][2];
    float corr[T];
    for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps(), corr[t] = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      const float s = bf16_to_float(sz[2 * g]);
      const float zs = bf16_to_float(sz[2 * g + 1]) - 8.f * s;  // w = code * s + (zero - 8 s)
      for (int t = 0; t < T; ++t) corr[t] += group_sum[(m0 + t) * groups + g] * zs;
      const int64_t b1 = std::min(nb, (g + 1) * blocks_per_group);
      prefetch(sz + 2 * g);
      for (int64_t b = g * blocks_per_group; b < b1; ++b) {
        if (b % 4 == 0) prefetch(c + b * 16);
        const __m256i w = unpack_nibbles(c + b * 16);
        for (int t = 0; t < T; ++t) {
          const int64_t i = (m0 + t) * nb + b;
          acc[t][b & 1] = _mm256_fmadd_ps(block_dot(w, xb, i), _mm256_set1_ps(xb.d[i] * s), acc[t][b & 1]);
        }
      }
    }
    for (int t = 0; t < T; ++t) y[(m0 + t) * N + n] = hsum(_mm256_add_ps(acc[t][0], acc[t][1])) + corr[t];
  }
}

// q4_tile on CPUs with AVX-512 VNNI: 16 blocks a step (one vpdpbusd per 64 bytes of codes, the exact totals in 16
// lanes), a last 8 blocks in 256-bit vectors; x's codes in Layout::Groups16.
// 16 blocks' codes as the 8 vectors of code_slots' order (lane 4 L + i holds block 4 i + L).
LLAMA_AVX512 inline void unpack_groups16(const uint8_t* c, __m512i w[8]) {
  __m512i a[4];
  for (int i = 0; i < 4; ++i) a[i] = _mm512_loadu_si512(c + 64 * i);
  const __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpackhi_epi32(a[0], a[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(a[2], a[3]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
  const __m512i v[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2), _mm512_unpacklo_epi64(t1, t3),
                        _mm512_unpackhi_epi64(t1, t3)};
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int u = 0; u < 4; ++u)
    w[2 * u] = _mm512_and_si512(v[u], low4), w[2 * u + 1] = _mm512_and_si512(_mm512_srli_epi16(v[u], 4), low4);
}

// Exact integer totals of 16 (or, 256-bit, 8) blocks: two chains of 4 vpdpbusd each.
LLAMA_AVX512 inline __m512i group_totals16(const __m512i w[8], const int8_t* xq) {
  __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
  for (int u = 0; u < 8; u += 2) {
    a = _mm512_dpbusd_epi32(a, w[u], _mm512_loadu_si512(xq + 64 * u));
    b = _mm512_dpbusd_epi32(b, w[u + 1], _mm512_loadu_si512(xq + 64 * u + 64));
  }
  return _mm512_add_epi32(a, b);
}
LLAMA_AVX512 inline __m256i group_totals8(const __m256i w[8], const int8_t* xq) {
  __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
  for (int u = 0; u < 8; u += 2) {
    a = _mm256_dpbusd_epi32(a, w[u], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * u)));
    b = _mm256_dpbusd_epi32(b, w[u + 1], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * u + 32)));
  }
  return _mm256_add_epi32(a, b);
}

// The last 8 blocks of a row of 16-block groups plus 8 (from block b8), added into acc.
template <int T>
LLAMA_AVX512 void q4_last8_vnni(const Blocks& xb, int64_t m0, int64_t nb, const uint8_t* c, __m256i pairs8,
                                int64_t b8, __m256 acc[T]) {
  const __m256i lanes = lanes8();
  __m256 s, zs;
  scale_offset(pairs8, s, zs);
  s = _mm256_permutevar8x32_ps(s, lanes);
  __m256i w[8];
  unpack_groups(c + b8 * 16, w);
  for (int t = 0; t < T; ++t) {
    const int64_t i = (m0 + t) * nb + b8;
    const __m256 ds = _mm256_mul_ps(_mm256_permutevar8x32_ps(_mm256_loadu_ps(xb.d.data() + i), lanes), s);
    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(group_totals8(w, xb.q.data() + i * kBlock)), ds, acc[t]);
    acc[t] = _mm256_fmadd_ps(_mm256_loadu_ps(xb.sum.data() + i), zs, acc[t]);
  }
}

// Blocks [b0, b1) (16-block groups) of one output row for rows m0 .. m0 + T of x, added into acc (lane order of
// code_slots; a row's products, then its offsets' terms, into its one register).
template <int T>
LLAMA_AVX512 inline void q4_span_vnni(const Blocks& xb, int64_t m0, int64_t nb, const uint8_t* c, const uint32_t* pairs,
                                      const GroupPairs& group_pairs, int64_t b0, int64_t b1, __m512 acc[T]) {
  const __m512i lanes = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  int64_t g = b0 / group_pairs.blocks_per_group, in_group = b0 % group_pairs.blocks_per_group;
  for (int64_t b16 = b0; b16 < b1; b16 += 16) {
    for (int p = 0; p < 256; p += 64) prefetch(c + b16 * 16 + p);
    __m256 s0, zs0, s1, zs1;
    scale_offset(group_pairs.load(pairs, b16, g, in_group), s0, zs0);
    scale_offset(group_pairs.load(pairs, b16 + 8, g, in_group), s1, zs1);
    const __m512 s = _mm512_permutexvar_ps(lanes, _mm512_insertf32x8(_mm512_castps256_ps512(s0), s1, 1));
    const __m512 zs = _mm512_insertf32x8(_mm512_castps256_ps512(zs0), zs1, 1);  // the blocks' order, as sum's
    __m512i w[8];
    unpack_groups16(c + b16 * 16, w);
    for (int t = 0; t < T; ++t) {
      const int64_t i = (m0 + t) * nb + b16;
      const __m512 ds = _mm512_mul_ps(_mm512_permutexvar_ps(lanes, _mm512_loadu_ps(xb.d.data() + i)), s);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(group_totals16(w, xb.q.data() + i * kBlock)), ds, acc[t]);
      acc[t] = _mm512_fmadd_ps(_mm512_loadu_ps(xb.sum.data() + i), zs, acc[t]);
    }
  }
}

// Up to 8 rows a tile (a row takes one register). Long rows go kSpanBlocks blocks at a time over kSpanRows output
// rows, so that the tile's activation codes for the span (at most 8 x 4 KiB) stay in L1 instead of 8 x K bytes
// (44 KiB at 4 rows of 11008) streaming from L2 for every output row. A lane's fp32 sums run in the same order
// either way, and whatever T.
constexpr int64_t kSpanBlocks = 128, kSpanRows = 8;

template <int T>
LLAMA_AVX512 void q4_tile_vnni(const Blocks& xb, int64_t m0, int64_t K, int64_t N, const uint8_t* codes,
                               const uint16_t* scales, int64_t groups, int64_t blocks_per_group, int64_t n0,
                               int64_t n1, float* y) {
  const int64_t nb = K / kBlock, whole = nb / 16 * 16;
  const GroupPairs group_pairs(blocks_per_group);
  for (int64_t r0 = n0; r0 < n1; r0 += kSpanRows) {
    const int64_t r1 = std::min(n1, r0 + kSpanRows);
    __m512 acc[kSpanRows][T];
    for (int64_t r = 0; r < r1 - r0; ++r)
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < whole; b0 += kSpanBlocks)
      for (int64_t n = r0; n < r1; ++n)
        q4_span_vnni<T>(xb, m0, nb, codes + n * (K / 2), reinterpret_cast<const uint32_t*>(scales + n * groups * 2),
                        group_pairs, b0, std::min(whole, b0 + kSpanBlocks), acc[n - r0]);
    for (int64_t n = r0; n < r1; ++n) {
      __m256 acc8[T];
      for (int t = 0; t < T; ++t) acc8[t] = _mm256_setzero_ps();
      if (whole < nb) {
        int64_t g = whole / blocks_per_group, in_group = whole % blocks_per_group;
        const uint32_t* pairs = reinterpret_cast<const uint32_t*>(scales + n * groups * 2);
        q4_last8_vnni<T>(xb, m0, nb, codes + n * (K / 2), group_pairs.load(pairs, whole, g, in_group), whole, acc8);
      }
      for (int t = 0; t < T; ++t) y[(m0 + t) * N + n] = _mm512_reduce_add_ps(acc[n - r0][t]) + hsum(acc8[t]);
    }
  }
}
