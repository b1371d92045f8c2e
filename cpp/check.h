// Contract checks for programming errors at API edges.
//
// Hot paths signal expected conditions (an exhausted pool, a sequence that
// cannot grow) with return values; a violated precondition (a bad block id, a
// double free) is a bug in the caller and throws, so it surfaces in Python as
// an exception instead of silently corrupting the cache.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace pagedserve::detail {

[[noreturn]] inline void fail_check(const char* kind, const char* expr, const char* file, int line,
                                    const std::string& message) {
  std::ostringstream out;
  out << message << " [" << kind << " failed: " << expr << " at " << file << ":" << line << "]";
  throw std::logic_error(out.str());
}

template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

}  // namespace pagedserve::detail

// PS_CHECK(cond, "message", values...) throws std::logic_error when cond is false.
#define PS_CHECK(cond, ...)                                                                  \
  do {                                                                                      \
    if (!(cond)) [[unlikely]]                                                               \
      ::pagedserve::detail::fail_check("check", #cond, __FILE__, __LINE__,                  \
                                       ::pagedserve::detail::concat(__VA_ARGS__));          \
  } while (false)
