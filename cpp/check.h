// Contract checks for programming errors at API edges.
//
// Hot paths signal expected conditions (an exhausted pool, a sequence that
// cannot grow) with return values; a violated precondition (a bad block id, a
// double free) is a bug in the caller and throws, so it surfaces in Python as
// an exception instead of silently corrupting the cache.
#pragma once

#include <type_traits>
#include <stdexcept>
#include <string>

namespace pagedserve::detail {

[[noreturn]] inline void fail_check(const char* kind, const char* expr, const char* file, int line,
                                    const std::string& message) {
  throw std::logic_error(message + " [" + kind + " failed: " + expr + " at " + file + ":" + std::to_string(line) +
                         "]");
}

// Joins strings and numbers without iostreams (see cpp/ops/tensor_view.cc).
template <typename Part>
void append_part(std::string& out, const Part& part) {
  if constexpr (std::is_arithmetic_v<Part>) {
    out += std::to_string(part);
  } else {
    out += part;
  }
}

template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::string out;
  (append_part(out, parts), ...);
  return out;
}

}  // namespace pagedserve::detail

// PS_CHECK(cond, "message", values...) throws std::logic_error when cond is false.
#define PS_CHECK(cond, ...)                                                                  \
  do {                                                                                      \
    if (!(cond)) [[unlikely]]                                                               \
      ::pagedserve::detail::fail_check("check", #cond, __FILE__, __LINE__,                  \
                                       ::pagedserve::detail::concat(__VA_ARGS__));          \
  } while (false)
