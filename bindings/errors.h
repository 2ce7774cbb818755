// Maps the core's error codes onto Python exception types.
#pragma once

#include <pybind11/pybind11.h>

#include "radixkv/status.h"

namespace radixkv::bindings {

/// Defines `OutOfCapacityError` and `IntegrityError` (RuntimeError
/// subclasses) on `m` and registers the translator for radixkv::Error:
/// kInvalidArgument -> ValueError, kWrongType -> TypeError.
void RegisterErrors(pybind11::module_& m);

/// Sets the Python exception for `e` (after RegisterErrors).
void SetError(const Error& e);

}  // namespace radixkv::bindings
