// Compiles the header named by GGUF_INNER twice: as namespace `avx2`, and as namespace `vnni` for AVX-512 VNNI
// (with F16C) with GGUF_VNNI defined. No include guard: gguf_blocks.cpp and gguf_gemm.cpp each include it once.
namespace avx2 {
#include GGUF_INNER
}  // namespace avx2

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")
#endif
namespace vnni {
#define GGUF_VNNI 1
#include GGUF_INNER
#undef GGUF_VNNI
}  // namespace vnni
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
