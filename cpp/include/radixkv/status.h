// Error codes of the native core and the exception that carries them.
//
// The core checks its inputs before it changes anything and throws `Error` on a
// violation; the Python bindings map each code to one Python exception type
// (see bindings/errors.cc), so a message written here is what the user reads.
#pragma once

#include <cstdio>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

namespace radixkv {

enum class ErrorCode {
  kInvalidArgument,  // a wrong value, shape, length or handle: ValueError
  kWrongType,        // a wrong type, dtype or device: TypeError
  kOutOfCapacity,    // asking for more than there is (evict, allocate): RuntimeError
  kIntegrity,        // check_integrity found a broken invariant: RuntimeError
};

/// The one exception type of the core. `code()` decides the Python type.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

// Appends one value to an error message. No iostreams: they need the C++
// library's locale machinery, which crashed (inside ostream's number
// formatting) in a process whose other extensions brought another C++ library
// build.
inline void StrAppend(std::string* out, std::string_view s) { out->append(s); }
inline void StrAppend(std::string* out, const char* s) { out->append(s); }
inline void StrAppend(std::string* out, char c) { out->push_back(c); }
inline void StrAppend(std::string* out, bool b) { out->append(b ? "true" : "false"); }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
void StrAppend(std::string* out, T v) {
  out->append(std::to_string(v));
}
template <typename T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
void StrAppend(std::string* out, T v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(v));
  out->append(buf);
}
template <typename T, std::enable_if_t<std::is_enum_v<T>, int> = 0>
void StrAppend(std::string* out, T v) {
  out->append(std::to_string(static_cast<std::underlying_type_t<T>>(v)));
}

/// Concatenates strings and numbers into a string (used for error messages).
template <typename... Args>
std::string StrCat(const Args&... args) {
  std::string out;
  (StrAppend(&out, args), ...);
  return out;
}

/// Throws `Error(code, message)` when `cond` is false. The message is only
/// built on failure.
#define RADIXKV_CHECK(cond, code, ...)                                           \
  do {                                                                           \
    if (!(cond)) throw ::radixkv::Error((code), ::radixkv::StrCat(__VA_ARGS__)); \
  } while (0)

}  // namespace radixkv
