// Error codes of the native core and the exception that carries them.
//
// The core checks its inputs before it changes anything and throws `Error` on a
// violation; the Python bindings map each code to one Python exception type
// (see bindings/errors.cc), so a message written here is what the user reads.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

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
  Error(ErrorCode code, const std::string& message)
      : std::runtime_error(message), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

/// Concatenates streamable values into a string (used for error messages).
template <typename... Args>
std::string StrCat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

/// Throws `Error(code, message)` when `cond` is false. The message is only
/// built on failure.
#define RADIXKV_CHECK(cond, code, ...)                                      \
  do {                                                                      \
    if (!(cond)) throw ::radixkv::Error((code), ::radixkv::StrCat(__VA_ARGS__)); \
  } while (0)

}  // namespace radixkv
