// The library's ops as C++ functions, for the ops built from them (decode_layers.cpp runs a decode step's layers
// from these without going back to Python). Each is also registered as torch.ops.llama_cpu.<name>; their comments
// are at their definitions (cpu_kernels.cpp, gguf_blocks.cpp, gguf_float.cpp and
// gguf_x16.cpp: the products; decode_ops.cpp: RMSNorm and decode attention).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace llama_cpu {

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t group_size);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales);
at::Tensor float_linear(const at::Tensor& x_in, const at::Tensor& weight);
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& w, int64_t type);
at::Tensor gguf_linear_float(const at::Tensor& x, const at::Tensor& w, int64_t type);
at::Tensor gguf_linear_x16(const at::Tensor& x, const at::Tensor& w, int64_t type);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                            const at::Tensor& sin, at::Tensor cache_k, at::Tensor cache_v,
                            const c10::optional<at::Tensor>& table, const c10::optional<at::Tensor>& rows, int64_t row0, const at::Tensor& positions,
                            int64_t kv_len, double scale = 0., int64_t window = 0);

}  // namespace llama_cpu
