// radixkv._core.BlockLedger: the tiers' blocks for KV events, in Python.
#pragma once

#include <pybind11/pybind11.h>

namespace radixkv::bindings {

/// Registers `BlockLedger` on `_core`.
void RegisterBlockLedger(pybind11::module_& m);

}  // namespace radixkv::bindings
