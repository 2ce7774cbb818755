// The kernel boundary: torch tensors in, checked raw pointers and strides out.
//
// Compiled into both extensions: `_core` (the CPU kernels, RegisterKernels)
// and `_cuda` (bindings/cuda_module.cc), which share these checks so a bad
// argument reads the same on every device. Tensors are read through torch's
// DLPack C exchange API (no libtorch link, no copy, no sync).
//
// As for Int32View (tensor_view.h), every tensor is first asked what may run
// Python code (torch's lazy-negation and requires_grad queries: `Check`), and
// only then are all of them borrowed (`View`), so no Python code runs between
// borrowing memory and using it. A call that lets the GIL go first `Pin`s its
// tensors: it views aliases of its own (`detach()`), which keep the storage
// alive when another thread gives the tensors it was passed new storage
// (`set_`). Resizing a storage in use is a race with every reader, torch's own
// ops included, and is not guarded against; nor is a tensor subclass whose
// torch function code changes the other arguments while they are checked.
#pragma once

#include <Python.h>
#include <dlpack/dlpack.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "radixkv/compare.h"
#include "radixkv/store_index.h"
#include "torch_api.h"

namespace radixkv::bindings {

constexpr int kMaxDims = 8;

/// A torch tensor argument of a kernel, viewed in two steps.
class Tensor {
 public:
  /// What step one asks torch about the tensor: whether it is a lazy
  /// negation (read), and also whether it requires grad (written); nothing for
  /// the views a pool made of its own buffer (trusted: MHAKVCache's caches).
  enum Checks { kRead, kWritten, kTrusted };
  /// Checks `obj` is a torch tensor (no Python code runs).
  Tensor(pybind11::handle obj, const char* name, Checks checks = kRead);
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;

  /// Step one: refuses what `checks` asks about. Runs torch's queries
  /// (Python code for subclasses and torch function modes).
  void Check();
  /// Step two: borrows the memory through DLPack (no Python code runs).
  /// Raises TypeError for a tensor with elements but no data (a fake tensor).
  void View();
  /// Replaces the view by one of an alias this object owns (Python code runs:
  /// call `View` on every tensor of the call again afterwards).
  void Pin();

  pybind11::handle object() const { return pinned_ ? pinned_ : obj_; }
  const char* name() const { return name_; }
  int ndim() const { return ndim_; }
  int64_t size(int d) const { return shape_[d]; }
  int64_t stride(int d) const { return strides_[d]; }
  const DLDataType& dtype() const { return dtype_; }
  int64_t elem_bytes() const { return dtype_.bits / 8; }
  const DLDevice& device() const { return device_; }
  char* data() const { return data_; }
  std::string ShapeString() const;
  /// The bytes the tensor's elements span, [first, last + 1).
  std::pair<const char*, const char*> Extent() const;
  /// Whether the spans of the two tensors' elements meet.
  bool Overlaps(const Tensor& other) const;
  void CheckDevice(DLDeviceType type) const;
  void CheckSameDevice(const Tensor& ref) const;
  void CheckLastContiguous() const;

 private:
  pybind11::handle obj_;
  pybind11::object pinned_;
  const char* name_;
  Checks checks_;
  int ndim_ = 0;
  int64_t shape_[kMaxDims] = {};
  int64_t strides_[kMaxDims] = {};
  DLDataType dtype_{};
  DLDevice device_{};
  char* data_ = nullptr;
};

/// The per-tensor scale of a float8 store (`k_scale`, `v_scale`): None, a
/// Python number, or a one-element floating tensor. Constructed before any
/// tensor of the call is checked (it may run Python code): a number or a CPU
/// tensor becomes `value`, rounded to float32 as torch rounds a Python scalar
/// for a float32 division, and must be positive and finite there
/// (ValueError); on CUDA a float32 tensor on the device stays a tensor the
/// kernel reads (no synchronization; its value is the caller's to check).
class ScaleArg {
 public:
  ScaleArg(pybind11::handle obj, const char* name, DLDeviceType device_type);
  ScaleArg(const ScaleArg&) = delete;
  ScaleArg& operator=(const ScaleArg&) = delete;

  bool given() const { return given_; }
  const char* name() const { return name_; }
  float value() const { return value_; }
  /// The device tensor, or null.
  Tensor* tensor() { return tensor_ ? &*tensor_ : nullptr; }
  const Tensor* tensor() const { return tensor_ ? &*tensor_ : nullptr; }

 private:
  const char* name_;
  bool given_ = false;
  float value_ = 1.0f;
  std::optional<Tensor> tensor_;
};

/// Checks one side of a store and returns it: `src` (`[n, heads, head_dim]`,
/// or `[n, head_dim]` when `flat_src`) goes into `heads` runs of `head_dim`
/// elements of `cache` (`[num_pages, page_size, H, W]`, `[num_slots, H, W]`
/// or `[num_slots, W]`, whose layout `cache_layout` gives), starting
/// `col_offset` elements into each head. Same dtypes copy bytes; a float8
/// cache (e4m3fn, e5m2) also takes float32, float16 or bfloat16 sources,
/// divided by `scale` (1 when not given) and rounded. Raises TypeError for a
/// dtype pair that is neither, ValueError for a scale where nothing is
/// converted. Checks `src`'s device, rank, sizes and last stride, and that it
/// does not lie in the memory of `cache`.
StoreSide CheckStoreSide(const Tensor& cache, const RowLayout& cache_layout, int64_t col_offset,
                         const Tensor& src, int64_t heads, int64_t head_dim, bool flat_src,
                         const ScaleArg& scale);

/// Checks the data tensors of `store_cache(k_cache, v_cache, out_loc, k, v,
/// k_scale, v_scale)` (see radixkv.kernel.store_cache), which must have been
/// `View`ed: all on one device of type `device_type`, the caches `[num_pages,
/// page_size, H, D]` or `[num_slots, H, D]`, `k` and `v` `[n, H, D]` with the
/// caches' dtype (not complex) or a float type a float8 cache converts from
/// (CheckStoreSide), every last dimension contiguous, no cache dimension of
/// stride 0 (an expanded tensor writes one place many times), and neither k
/// nor v in the memory of a cache. Returns the kernel parameters (two sides),
/// indices left unset. Raises TypeError (type, dtype, device) or ValueError
/// (shape, stride, scale) naming the argument. Reads no tensor data.
StoreParams CheckStoreTensors(const Tensor& k_cache, const Tensor& v_cache, const Tensor& k,
                              const Tensor& v, const ScaleArg& k_scale, const ScaleArg& v_scale,
                              DLDeviceType device_type);

/// Checks the tensors of `store_mla(kv_cache, out_loc, k_nope, k_rope,
/// kv_lora_rank, k_scale)`, `View`ed: `kv_cache` `[num_pages, page_size, 1,
/// R]`, `[num_slots, 1, R]` or `[num_slots, R]` with `0 < kv_lora_rank < R`;
/// `k_nope` `[n, 1, kv_lora_rank]` or `[n, kv_lora_rank]`, `k_rope` `[n, 1, R -
/// kv_lora_rank]` or `[n, R - kv_lora_rank]`, each with a contiguous last
/// dimension and any row stride. Returns two sides: k_nope into columns [0,
/// kv_lora_rank) of each row, k_rope into the rest, both converted with
/// `k_scale` for a float8 cache fed floats. Raises as CheckStoreTensors.
StoreParams CheckMlaTensors(const Tensor& kv_cache, const Tensor& k_nope, const Tensor& k_rope,
                            int64_t kv_lora_rank, const ScaleArg& k_scale,
                            DLDeviceType device_type);

/// The tensors of one store call (caches, sources, side buffers), in a fixed
/// array: a call allocates nothing on the heap for them.
class TensorList {
 public:
  TensorList(std::initializer_list<Tensor*> first) {
    for (Tensor* t : first) items_[size_++] = t;
  }
  void push_back(Tensor* t) { items_[size_++] = t; }
  Tensor* const* begin() const { return items_; }
  Tensor* const* end() const { return items_ + size_; }
  size_t size() const { return static_cast<size_t>(size_); }
  Tensor* operator[](size_t i) const { return items_[i]; }

 private:
  Tensor* items_[2 * kMaxStoreSides + 2] = {};
  int size_ = 0;
};

/// The per-token side buffers of a pool a store also writes (`side` of
/// store_cache and store_mla): a sequence of `(name, buffer, source)`, each
/// buffer `[num_slots, W]` (a pool's layer view) and each source `[n, W]` of
/// the buffer's dtype, copied as they are. Constructed before any tensor is
/// checked; raises TypeError for anything but such triples.
class SideArgs {
 public:
  SideArgs(pybind11::handle sides, Tensor::Checks buffer_checks);
  SideArgs(const SideArgs&) = delete;
  SideArgs& operator=(const SideArgs&) = delete;

  /// Appends every tensor, buffer then source per entry, for Check, View, Pin.
  void AppendTo(TensorList* tensors);
  /// Appends one side per entry to `p` (whose caches are `caches`, its
  /// sources `sources`): checks shapes, dtypes, slot counts, token counts,
  /// and that no source lies in a buffer or cache and no buffer in a cache.
  /// Raises ValueError when `p` would have more than kMaxStoreSides sides.
  void AddTo(StoreParams* p, std::initializer_list<const Tensor*> caches,
             std::initializer_list<const Tensor*> sources) const;
  /// Bumps every side buffer's version counter, after a store wrote them.
  void MarkWritten() const;

 private:
  pybind11::tuple entries_;         // the caller's entries, owned: they outlive every borrow below
  std::vector<std::string> names_;  // "side[<name>]" and "side buffer <name>", two per entry
  std::vector<std::unique_ptr<Tensor>> buffers_, sources_;
};

/// Sets the indices of `p`: `n` slots of `type` at `data`; raises ValueError
/// unless `n` equals the tokens of the source named `tokens_name`.
void SetStoreIndices(StoreParams* p, const void* data, IndexType type, int64_t n,
                     const char* tokens_name = "k");

/// Checks a device `out_loc` tensor (1-D int32/int64, on `k_cache`'s device,
/// contiguous) and sets it as the indices of `p`.
void SetStoreIndices(StoreParams* p, const Tensor& out_loc, const Tensor& k_cache,
                     const char* tokens_name = "k");

/// Raises ValueError naming out_loc for a bad index found by a store.
[[noreturn]] void RaiseBadIndex(int64_t position, int64_t slot, bool repeated, int64_t num_slots);

/// Tells autograd that `a` and `b` were written in place (bumps their
/// version counters; a no-op for inference tensors), as torch's own in-place
/// ops do.
void MarkWritten(pybind11::handle a, pybind11::handle b = pybind11::handle());

/// Checks `first_mismatch_batched(query, keys, key_lens, out)` from `View`ed
/// tensors: int32 `query` 1-D, int32 `keys` 2-D `[B, L]` with contiguous rows,
/// `key_lens` None or 1-D int32/int64 of length B, int32 `out` 1-D contiguous
/// of length B, all on one device of type `device_type`. Raises TypeError or
/// ValueError naming the argument.
CompareBatch CheckCompareArgs(const Tensor& query, const Tensor& keys, const Tensor* key_lens,
                              const Tensor& out, DLDeviceType device_type);

/// Torch's current work stream on `device` (nullptr on the CPU), through the
/// exchange API's `current_work_stream`. Raises on failure.
void* CurrentStream(const DLDevice& device);

/// Registers the CPU kernels on `_core`: `store_cache`, `store_mla` and
/// `first_mismatch_batched`.
void RegisterKernels(pybind11::module_& m);

}  // namespace radixkv::bindings
