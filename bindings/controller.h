// radixkv._core.CacheController: the host tier's copy controller in Python,
// and what radixkv._cuda shares with it to hand over a CUDA copy engine.
#pragma once

#include <dlpack/dlpack.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "radixkv/cache_controller.h"
#include "radixkv/transfer_index.h"

namespace radixkv::bindings {

/// A pool's layout from Python: its buffer tensor and (side, layer, page,
/// row) strides in bytes, the page size and the slot count. Keeps an alias of
/// the tensor (`detach()`) alive, so the storage stays whatever is done to
/// the tensor it was given while copies run on another thread. A pool given
/// as a sequence of tensors, one per (side, layer) plane (side-major, as an
/// engine keeps its per-layer K and V buffers), keeps one alias per plane and
/// the plane table its layout points to.
struct Pool {
  pybind11::object alias;
  PoolLayout layout{};
  DLDevice device{};
  int64_t bytes = 0;  // the tensor's extent when read
  std::vector<pybind11::object> plane_aliases;
  std::vector<char*> plane_starts;    // layout.planes points here
  std::vector<int64_t> plane_extents;  // each plane's bytes when read

  /// Raises ValueError unless the storage is still where it was read: a
  /// storage resized or replaced since (`resize_`, `set_` on the alias's
  /// storage) would leave the copies writing freed memory. With the GIL.
  void CheckUnchanged(const char* name) const;
};

/// Reads and checks a pool: every row the layout names lies inside the
/// tensor's memory (or, for a sequence of plane tensors, each plane's rows
/// inside its tensor; the layout's side and layer strides are then unused).
/// `cuda`: the tensors may be on a CUDA device (else CPU).
Pool ReadPool(pybind11::handle buffer, const std::vector<int64_t>& strides, const char* name,
              int64_t row_bytes, int64_t layers, bool cuda);

/// Raises ValueError unless the two pools of a transfer have the same sides.
void CheckSameSides(const Pool& a, const Pool& b, const char* a_name, const char* b_name);

/// Reads the side buffers of a copy engine: a sequence of (device, device_layout,
/// host, host_layout, row_bytes), each a one-sided plane whose slots and pages
/// are those of the K/V plane `kv` (its device and host pools). Appends the
/// pools to `pools` (device then host for each) and returns the planes.
std::vector<CopyPlane> ReadSidePlanes(pybind11::handle side_planes, int64_t layers, bool cuda,
                                      const Pool& kv_device, const Pool& kv_host,
                                      std::vector<Pool>* pools);

/// Reads a float8 host pool from Python: None, or (dtype, heads, head_dim,
/// scales, scales_layout), `scales` a tensor holding page p's `heads` float32
/// scales of (side, layer) at row `p * page_size` of `scales_layout` (row
/// stride 0); heads x head_dim elements of dtype make a device row of
/// `row_bytes`. Appends the scales' pool to `pools`.
Float8Pool ReadCodecSpec(pybind11::handle codec, int64_t row_bytes, int64_t layers,
                         std::vector<Pool>* pools);

/// Makes the K/V plane of a copy engine: the device pool and, read from
/// `host` and `host_layout`, the host pool (`*host_pool`), whose rows are
/// codes when `codec` is not None (ReadCodecSpec; its scales go to `pools`).
/// Checks the two pools agree. `cuda`: the device pool is on a CUDA device.
CopyPlane ReadKvPlane(const Pool& device, pybind11::handle host,
                      const std::vector<int64_t>& host_layout, int64_t row_bytes, int64_t layers,
                      pybind11::handle codec, Pool* host_pool, std::vector<Pool>* pools);

/// A copy engine in a capsule named kEngineCapsule, made by one extension
/// module and taken by CacheController in another.
struct EngineBox {
  std::unique_ptr<CopyEngine> engine;
  Pool device, host;        // the pools the engine copies between, kept alive
  std::vector<Pool> sides;  // the side buffers' pools, device then host for each, then
                            // the host scales of an encoded K/V plane
};
inline constexpr const char* kEngineCapsule = "radixkv.CopyEngine";

/// Registers `CacheController` and `transfer_rows` on `_core`.
void RegisterController(pybind11::module_& m);

}  // namespace radixkv::bindings
