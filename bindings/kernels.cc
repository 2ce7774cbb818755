#include "kernels.h"

#include "torch_api.h"

#include <algorithm>
#include <optional>
#include <string>
#include <thread>

#include "radixkv/compare.h"
#include "radixkv/status.h"
#include "radixkv/store.h"

namespace py = pybind11;

// The one check vocabulary of the kernel boundary: TypeError for a wrong type,
// dtype or device, ValueError for a wrong shape, stride, length or value. The
// message always starts with the argument's name.
#define KERNEL_CHECK_TYPE(cond, ...) \
  RADIXKV_CHECK(cond, ::radixkv::ErrorCode::kWrongType, __VA_ARGS__)
#define KERNEL_CHECK_VALUE(cond, ...) \
  RADIXKV_CHECK(cond, ::radixkv::ErrorCode::kInvalidArgument, __VA_ARGS__)

namespace radixkv::bindings {
namespace {

constexpr int kMaxDims = 8;

const char* DeviceTypeName(DLDeviceType t) { return t == kDLCUDA ? "CUDA" : "CPU"; }

bool SameDType(const DLDataType& a, const DLDataType& b) {
  return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}

bool IsIndexDType(const DLDataType& d) {
  return d.code == kDLInt && d.lanes == 1 && (d.bits == 32 || d.bits == 64);
}

// A torch tensor viewed through DLPack for the length of one call; the caller
// keeps the Python object (and so the memory) alive.
class Tensor {
 public:
  Tensor(py::handle obj, const char* name) : name_(name) {
    PyObject* o = obj.ptr();
    KERNEL_CHECK_TYPE(IsTorchTensor(o), name, " must be a torch.Tensor, got ", Py_TYPE(o)->tp_name);
    view_.emplace(o, name);
    const DLTensor& t = view_->get();
    ndim_ = t.ndim;
    KERNEL_CHECK_VALUE(ndim_ <= kMaxDims, name, " has ", ndim_, " dimensions, too many");
    int64_t expected = 1;
    for (int d = ndim_ - 1; d >= 0; --d) {
      shape_[d] = t.shape[d];
      strides_[d] = t.strides != nullptr ? t.strides[d] : expected;
      expected *= shape_[d];
    }
    dtype_ = t.dtype;
    device_ = t.device;
    data_ = static_cast<char*>(t.data) + t.byte_offset;
  }
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;

  const char* name() const { return name_; }
  int ndim() const { return ndim_; }
  int64_t size(int d) const { return shape_[d]; }
  int64_t stride(int d) const { return strides_[d]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int d = 0; d < ndim_; ++d) n *= shape_[d];
    return n;
  }
  const DLDataType& dtype() const { return dtype_; }
  int64_t elem_bytes() const { return dtype_.bits / 8; }
  const DLDevice& device() const { return device_; }
  char* data() const { return data_; }

  std::string ShapeString() const {
    std::string s = "[";
    for (int d = 0; d < ndim_; ++d) s += (d ? ", " : "") + std::to_string(shape_[d]);
    return s + "]";
  }

  // The last dimension is contiguous (or too short for it to matter).
  bool LastContiguous() const {
    return ndim_ == 0 || shape_[ndim_ - 1] <= 1 || strides_[ndim_ - 1] == 1;
  }

  void CheckDevice(DLDeviceType type) const {
    KERNEL_CHECK_TYPE(device_.device_type == type, name_, " must be a ", DeviceTypeName(type),
                      " tensor, got one on ", DeviceName(device_));
  }
  void CheckSameDevice(const Tensor& ref) const {
    KERNEL_CHECK_TYPE(device_.device_type == ref.device_.device_type &&
                          device_.device_id == ref.device_.device_id,
                      name_, " must be on ", DeviceName(ref.device_), " like ", ref.name_, ", got ",
                      DeviceName(device_));
  }
  void CheckLastContiguous() const {
    KERNEL_CHECK_VALUE(LastContiguous(), name_,
                       " must have a contiguous last dimension (stride 1), got stride ",
                       strides_[ndim_ - 1], "; pass ", name_, ".contiguous()");
  }

 private:
  const char* name_;
  int ndim_ = 0;
  int64_t shape_[kMaxDims] = {};
  int64_t strides_[kMaxDims] = {};
  DLDataType dtype_{};
  DLDevice device_{};
  char* data_ = nullptr;
  std::optional<TorchTensorView> view_;
};

// The layout of a cache: [num_pages, page_size, H, D] or [num_slots, H, D].
RowLayout CacheLayout(const Tensor& c) {
  const int64_t e = c.elem_bytes();
  if (c.ndim() == 4) {
    return RowLayout{c.size(1), c.stride(0) * e, c.stride(1) * e, c.stride(2) * e};
  }
  return RowLayout{1, c.stride(0) * e, c.stride(0) * e, c.stride(1) * e};
}

RowLayout TokenLayout(const Tensor& x) {
  const int64_t e = x.elem_bytes();
  return RowLayout{1, x.stride(0) * e, x.stride(0) * e, x.stride(1) * e};
}

// Batches moving at least this many bytes run with the GIL released.
constexpr int64_t kReleaseGilBytes = int64_t{1} << 20;
// Threads a large store may use (StoreRows decides how many pay); 2 is what
// was measured (bench/README.md).
constexpr unsigned kMaxStoreThreads = 2;

void StoreCacheCpu(py::handle k_cache, py::handle v_cache, py::handle out_loc, py::handle k,
                   py::handle v) {
  const StoreArgs args = CheckStoreArgs(k_cache, v_cache, out_loc, k, v, kDLCPU);
  const StoreParams& p = args.params;
  int64_t bad;
  if (4 * p.num_tokens * p.heads * p.head_bytes >= kReleaseGilBytes) {
    static const int threads =
        static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, kMaxStoreThreads));
    py::gil_scoped_release nogil;
    bad = StoreRows(p, threads);
  } else {
    bad = StoreRows(p);
  }
  KERNEL_CHECK_VALUE(bad < 0, "out_loc[", bad, "] = ", LoadSlot(p.indices, p.index_type, bad),
                     " is out of range for a cache of ", p.num_slots, " slots");
}

void FirstMismatchBatchedCpu(py::handle query, py::handle keys, py::handle key_lens,
                             py::handle out) {
  const CompareArgs a = CheckCompareArgs(query, keys, key_lens, out, kDLCPU);
  for (int64_t b = 0; b < a.num_keys; ++b) {
    int64_t len = a.key_cols;
    if (a.key_lens != nullptr) {
      len = LoadSlot(a.key_lens, a.len_type, b);
      KERNEL_CHECK_VALUE(len >= 0 && len <= a.key_cols, "key_lens[", b, "] = ", len,
                         " is outside [0, ", a.key_cols, "]");
    }
  }
  std::optional<py::gil_scoped_release> nogil;
  if (a.num_keys * std::min(a.query_len, a.key_cols) >= (int64_t{1} << 16)) nogil.emplace();
  for (int64_t b = 0; b < a.num_keys; ++b) {
    // Loaded again without the GIL: clamp, in case another thread changed it.
    int64_t len = a.key_cols;
    if (a.key_lens != nullptr) {
      len = std::clamp<int64_t>(LoadSlot(a.key_lens, a.len_type, b), 0, a.key_cols);
    }
    const size_t n = static_cast<size_t>(std::min(a.query_len, len));
    a.out[b] = static_cast<int32_t>(FirstMismatch(a.query, a.keys + b * a.key_stride, n));
  }
}

}  // namespace

StoreArgs CheckStoreArgs(py::handle k_cache_obj, py::handle v_cache_obj, py::handle out_loc_obj,
                         py::handle k_obj, py::handle v_obj, DLDeviceType device_type) {
  Tensor kc(k_cache_obj, "k_cache"), vc(v_cache_obj, "v_cache");
  Tensor loc(out_loc_obj, "out_loc"), k(k_obj, "k"), v(v_obj, "v");

  kc.CheckDevice(device_type);
  for (const Tensor* t : {&vc, &loc, &k, &v}) t->CheckSameDevice(kc);

  KERNEL_CHECK_VALUE(kc.ndim() == 3 || kc.ndim() == 4,
                     "k_cache must have shape [num_pages, page_size, heads, head_dim] or "
                     "[num_slots, heads, head_dim], got ",
                     kc.ShapeString());
  KERNEL_CHECK_VALUE(vc.ShapeString() == kc.ShapeString(), "v_cache has shape ", vc.ShapeString(),
                     " but k_cache has shape ", kc.ShapeString());
  const DLDataType& dt = kc.dtype();
  KERNEL_CHECK_TYPE(dt.lanes == 1 && dt.bits % 8 == 0 && dt.bits > 0, "k_cache has dtype ",
                    DTypeName(dt), ", which is not whole bytes");
  for (const Tensor* t : {&vc, &k, &v}) {
    KERNEL_CHECK_TYPE(SameDType(t->dtype(), dt), t->name(), " has dtype ", DTypeName(t->dtype()),
                      " but k_cache has dtype ", DTypeName(dt));
  }
  const int64_t heads = kc.size(kc.ndim() - 2), head_dim = kc.size(kc.ndim() - 1);
  for (const Tensor* t : {&k, &v}) {
    KERNEL_CHECK_VALUE(t->ndim() == 3, t->name(), " must have shape [num_tokens, ", heads, ", ",
                       head_dim, "], got ", t->ShapeString());
    KERNEL_CHECK_VALUE(t->size(1) == heads && t->size(2) == head_dim, t->name(), " has shape ",
                       t->ShapeString(), " but the cache rows are [", heads, ", ", head_dim, "]");
  }
  KERNEL_CHECK_VALUE(v.size(0) == k.size(0), "v has ", v.size(0), " tokens but k has ", k.size(0));
  KERNEL_CHECK_VALUE(loc.ndim() == 1, "out_loc must be 1-D, got shape ", loc.ShapeString());
  KERNEL_CHECK_TYPE(IsIndexDType(loc.dtype()), "out_loc must have dtype int32 or int64, got ",
                    DTypeName(loc.dtype()));
  KERNEL_CHECK_VALUE(loc.size(0) == k.size(0), "out_loc has length ", loc.size(0), " but k has ",
                     k.size(0), " tokens");
  for (const Tensor* t : {&kc, &vc, &k, &v, &loc}) t->CheckLastContiguous();

  StoreArgs a{};
  StoreParams& p = a.params;
  p.src[0] = k.data();
  p.src[1] = v.data();
  p.dst[0] = kc.data();
  p.dst[1] = vc.data();
  p.src_layout[0] = TokenLayout(k);
  p.src_layout[1] = TokenLayout(v);
  p.dst_layout[0] = CacheLayout(kc);
  p.dst_layout[1] = CacheLayout(vc);
  p.heads = heads;
  p.head_bytes = head_dim * kc.elem_bytes();
  p.indices = loc.data();
  p.index_type = loc.dtype().bits == 32 ? IndexType::kInt32 : IndexType::kInt64;
  p.num_tokens = k.size(0);
  p.num_slots = kc.ndim() == 4 ? kc.size(0) * kc.size(1) : kc.size(0);
  a.device = kc.device();
  return a;
}

CompareArgs CheckCompareArgs(py::handle query_obj, py::handle keys_obj, py::handle key_lens_obj,
                             py::handle out_obj, DLDeviceType device_type) {
  Tensor q(query_obj, "query"), keys(keys_obj, "keys"), out(out_obj, "out");
  std::optional<Tensor> lens;
  if (!key_lens_obj.is_none()) lens.emplace(key_lens_obj, "key_lens");

  q.CheckDevice(device_type);
  keys.CheckSameDevice(q);
  out.CheckSameDevice(q);
  if (lens) lens->CheckSameDevice(q);
  const DLDataType i32{kDLInt, 32, 1};
  for (const Tensor* t : {&q, &keys, &out}) {
    KERNEL_CHECK_TYPE(SameDType(t->dtype(), i32), t->name(), " must have dtype int32, got ",
                      DTypeName(t->dtype()));
  }
  KERNEL_CHECK_VALUE(q.ndim() == 1, "query must be 1-D, got shape ", q.ShapeString());
  KERNEL_CHECK_VALUE(keys.ndim() == 2, "keys must be 2-D [num_keys, length], got shape ",
                     keys.ShapeString());
  const int64_t b = keys.size(0);
  KERNEL_CHECK_VALUE(out.ndim() == 1 && out.size(0) == b, "out must have shape [", b, "], got ",
                     out.ShapeString());
  for (const Tensor* t : {&q, &keys, &out}) t->CheckLastContiguous();
  if (lens) {
    KERNEL_CHECK_VALUE(lens->ndim() == 1 && lens->size(0) == b, "key_lens must have shape [", b,
                       "], got ", lens->ShapeString());
    KERNEL_CHECK_TYPE(IsIndexDType(lens->dtype()), "key_lens must have dtype int32 or int64, got ",
                      DTypeName(lens->dtype()));
    lens->CheckLastContiguous();
  }
  CompareArgs a{};
  a.query = reinterpret_cast<const int32_t*>(q.data());
  a.query_len = q.size(0);
  a.keys = reinterpret_cast<const int32_t*>(keys.data());
  a.key_stride = keys.stride(0);
  a.key_cols = keys.size(1);
  a.key_lens = lens ? lens->data() : nullptr;
  a.len_type = lens && lens->dtype().bits == 32 ? IndexType::kInt32 : IndexType::kInt64;
  a.num_keys = b;
  a.out = reinterpret_cast<int32_t*>(out.data());
  a.device = q.device();
  return a;
}

void* CurrentStream(const DLDevice& device) {
  void* stream = nullptr;
  if (device.device_type == kDLCPU) return nullptr;
  if (TorchApi().current_work_stream(device.device_type, device.device_id, &stream) != 0) {
    throw py::error_already_set();
  }
  return stream;
}

void RegisterKernels(py::module_& m) {
  m.def("store_cache", &StoreCacheCpu, py::arg("k_cache"), py::arg("v_cache"), py::arg("out_loc"),
        py::arg("k"), py::arg("v"));
  m.def("first_mismatch_batched", &FirstMismatchBatchedCpu, py::arg("query"), py::arg("keys"),
        py::arg("key_lens"), py::arg("out"));
}

}  // namespace radixkv::bindings
