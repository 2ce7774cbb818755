// Maps the core's error codes onto Python exception types.
#pragma once

#include <pybind11/pybind11.h>

#include "radixkv/status.h"

// The bindings' one check vocabulary: each throws radixkv::Error when `cond`
// is false, with the message radixkv::StrCat(...) makes (strings, ints,
// doubles as %g, bools), built only on failure. CHECK_TYPE raises TypeError,
// for a wrong type, dtype or device; CHECK_VALUE raises ValueError, for a
// wrong shape, stride, length or value. The message names the argument
// (or the arguments) at fault.
#define CHECK_TYPE(cond, ...) RADIXKV_CHECK(cond, ::radixkv::ErrorCode::kWrongType, __VA_ARGS__)
#define CHECK_VALUE(cond, ...) \
  RADIXKV_CHECK(cond, ::radixkv::ErrorCode::kInvalidArgument, __VA_ARGS__)

namespace radixkv::bindings {

/// Defines `OutOfCapacityError` and `IntegrityError` (RuntimeError
/// subclasses) on `m` and registers the translator for radixkv::Error:
/// kInvalidArgument -> ValueError, kWrongType -> TypeError.
void RegisterErrors(pybind11::module_& m);

/// Sets the Python exception for `e` (after RegisterErrors).
void SetError(const Error& e);

}  // namespace radixkv::bindings
