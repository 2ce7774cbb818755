// radixkv._core.CacheController: the host tier's copy controller in Python.
#pragma once

#include <pybind11/pybind11.h>

namespace radixkv::bindings {

/// Registers `CacheController` on `_core`.
void RegisterController(pybind11::module_& m);

}  // namespace radixkv::bindings
