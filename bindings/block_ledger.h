// radixkv._core.BlockLedger: the tiers' blocks for KV events, in Python.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

namespace radixkv {
class BlockLedger;
}

namespace radixkv::bindings {

/// Registers `BlockLedger` on `_core`.
void RegisterBlockLedger(pybind11::module_& m);

/// Where a tree's request call announces what it cached, in the same call:
/// built from the call's `ledger` (a `_core.BlockLedger`, or None/absent:
/// nowhere) and `seed` (32 bytes, or None) before the call changes anything,
/// raising TypeError or ValueError for bad ones: the ledger must have at
/// least the `pool_pages` device pages of the call's pool, of `page_size`
/// tokens, so that every page the call accepts is one of its rows.
class InsertAnnouncer {
 public:
  InsertAnnouncer(PyObject* ledger, PyObject* seed, int64_t pool_pages, int64_t page_size);
  /// `tokens[start, end)` joined the device with the page ids `pages`
  /// (BlockLedger::DeviceInserted; `known`: tokens before `start` the tree
  /// already held). The caller holds the GIL and keeps the ledger alive.
  /// With `page_ids` false, `pages` holds token slots, one a token.
  void Inserted(const int32_t* tokens, const int32_t* pages, int64_t start, int64_t end,
                int64_t known, bool page_ids) const;

 private:
  BlockLedger* ledger_ = nullptr;
  std::string seed_;
};

}  // namespace radixkv::bindings
