// Maps the core's error codes onto Python exception types.
#pragma once

#include <pybind11/pybind11.h>

namespace radixkv::bindings {

/// Defines `OutOfCapacityError` and `IntegrityError` (RuntimeError
/// subclasses) on `m` and registers the translator for radixkv::Error:
/// kInvalidArgument -> ValueError, kWrongType -> TypeError.
void RegisterErrors(pybind11::module_& m);

}  // namespace radixkv::bindings
