// LLAMA_CHECK(cond, parts...): TORCH_CHECK without iostreams. TORCH_CHECK builds its message with an
// std::ostringstream inlined into this library; on a machine whose compiler is not the toolset torch was built with
// (the CUDA image: Ubuntu g++ 13.3 against torch's gcc-toolset-13) that inlined stream crashed with a segmentation
// fault instead of raising (docs/performance.md, "The GPU"). Here the message is concatenated with std::string and
// std::to_string, and the exception is built and thrown inside libc10 (torchCheckFail), so Python gets the same
// RuntimeError.
#pragma once
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>

namespace llama_check {

inline void put(std::string& s, const char* v) { s += v; }
inline void put(std::string& s, const std::string& v) { s += v; }
inline void put(std::string& s, char v) { s += v; }
inline void put(std::string& s, bool v) { s += v ? "true" : "false"; }
inline void put(std::string& s, double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", v);
  s += b;
}
inline void put(std::string& s, c10::ScalarType t) { s += c10::toString(t); }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline void put(std::string& s, T v) {
  s += std::to_string(v);
}

template <typename... A>
[[noreturn]] void fail(const char* func, const char* file, uint32_t line, const A&... parts) {
  std::string msg;
  (put(msg, parts), ...);
  c10::detail::torchCheckFail(func, file, line, msg);
}

}  // namespace llama_check

#define LLAMA_CHECK(cond, ...)                                                                \
  do {                                                                                        \
    if (__builtin_expect(!(cond), 0))                                                         \
      ::llama_check::fail(__func__, __FILE__, static_cast<uint32_t>(__LINE__), __VA_ARGS__); \
  } while (0)
