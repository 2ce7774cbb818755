// The kernel boundary: torch tensors in, checked raw pointers and strides out.
//
// Compiled into both extensions: `_core` (the CPU kernels, RegisterKernels)
// and `_cuda` (bindings/cuda_module.cc), which share these checks so a bad
// argument reads the same on every device. Tensors are read through torch's
// DLPack C exchange API (no libtorch link, no copy, no sync).
#pragma once

#include <Python.h>
#include <dlpack/dlpack.h>
#include <pybind11/pybind11.h>

#include <cstdint>

#include "radixkv/store_index.h"

namespace radixkv::bindings {

/// The checked arguments of a store: the kernel parameters and the device
/// they live on.
struct StoreArgs {
  StoreParams params;
  DLDevice device;
};

/// Checks `store_cache(k_cache, v_cache, out_loc, k, v)` (see
/// radixkv.kernel.store_cache) and returns what the kernels take. All five
/// must be torch tensors on one device of type `device_type`; the caches
/// `[num_pages, page_size, H, D]` or `[num_slots, H, D]`, `k` and `v`
/// `[n, H, D]` with the caches' dtype, `out_loc` 1-D int32/int64 of length n;
/// every last dimension contiguous. Raises TypeError (type, dtype, device) or
/// ValueError (shape, stride) naming the argument. Reads no tensor data.
StoreArgs CheckStoreArgs(pybind11::handle k_cache, pybind11::handle v_cache,
                         pybind11::handle out_loc, pybind11::handle k, pybind11::handle v,
                         DLDeviceType device_type);

/// The checked arguments of a batched first-mismatch: `out[b]` receives the
/// first i < min(query_len, len_b) with `query[i] != keys[b * key_stride + i]`,
/// else that minimum; `len_b` is `key_lens[b]` or `key_cols` when `key_lens`
/// is null (a length outside [0, key_cols] raises on the CPU and is clamped on
/// CUDA, where checking would need a sync).
struct CompareArgs {
  const int32_t* query;
  int64_t query_len;
  const int32_t* keys;
  int64_t key_stride;  ///< elements from one key to the next
  int64_t key_cols;
  const void* key_lens;  ///< nullable
  IndexType len_type;
  int64_t num_keys;
  int32_t* out;
  DLDevice device;
};

/// Checks `first_mismatch_batched(query, keys, key_lens, out)`: int32 `query`
/// 1-D, int32 `keys` 2-D `[B, L]` with contiguous rows, `key_lens` None or 1-D
/// int32/int64 of length B, int32 `out` 1-D contiguous of length B, all on one
/// device of type `device_type`. Raises TypeError or ValueError naming the
/// argument.
CompareArgs CheckCompareArgs(pybind11::handle query, pybind11::handle keys,
                             pybind11::handle key_lens, pybind11::handle out,
                             DLDeviceType device_type);

/// Torch's current work stream on `device` (nullptr on the CPU), through the
/// exchange API's `current_work_stream`. Raises on failure.
void* CurrentStream(const DLDevice& device);

/// Registers the CPU kernels on `_core`: `store_cache` and
/// `first_mismatch_batched`.
void RegisterKernels(pybind11::module_& m);

}  // namespace radixkv::bindings
