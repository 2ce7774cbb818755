#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "errors.h"
#include "fast_call.h"
#include "radixkv/compare.h"
#include "radixkv/status.h"
#include "radixkv/store.h"
#include "tensor_view.h"
#include "torch_api.h"

namespace py = pybind11;

namespace radixkv::bindings {
namespace {

const char* DeviceTypeName(DLDeviceType t) { return t == kDLCUDA ? "CUDA" : "CPU"; }

bool SameDType(const DLDataType& a, const DLDataType& b) {
  return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}

bool IsIndexDType(const DLDataType& d) {
  return d.code == kDLInt && d.lanes == 1 && (d.bits == 32 || d.bits == 64);
}

bool RequiresGrad(PyObject* o) {
  static PyObject* name = PyUnicode_InternFromString("requires_grad");  // lives with the module
  PyObject* flag = PyObject_GetAttr(o, name);
  if (flag == nullptr) throw py::error_already_set();
  const int truth = flag == Py_False ? 0 : flag == Py_True ? 1 : PyObject_IsTrue(flag);
  Py_DECREF(flag);
  if (truth < 0) throw py::error_already_set();
  return truth != 0;
}

// The layout of a cache: [num_pages, page_size, H, D] or [num_slots, H, D].
RowLayout CacheLayout(const Tensor& c) {
  const int64_t e = c.elem_bytes();
  if (c.ndim() == 4) {
    return RowLayout{c.size(1), c.stride(0) * e, c.stride(1) * e, c.stride(2) * e};
  }
  if (c.ndim() == 2) {  // [num_slots, row]: one "head" of the whole row
    return RowLayout{1, c.stride(0) * e, c.stride(0) * e, c.size(1) * e};
  }
  return RowLayout{1, c.stride(0) * e, c.stride(0) * e, c.stride(1) * e};
}

RowLayout TokenLayout(const Tensor& x) {
  const int64_t e = x.elem_bytes();
  const int64_t head_stride = x.ndim() == 2 ? x.size(1) * e : x.stride(1) * e;
  return RowLayout{1, x.stride(0) * e, x.stride(0) * e, head_stride};
}

// Batches moving at least this many bytes run with the GIL released.
constexpr int64_t kReleaseGilBytes = int64_t{1} << 20;
// Threads a large store may use (StoreRows decides how many pay); 2 is what
// was measured (bench/README.md).
constexpr unsigned kMaxStoreThreads = 2;

// Runs a checked store on the CPU: step one (Check) on every tensor, then
// step two (View) and `params`, which returns the parameters with their
// indices; after `Own`/`Pin` both steps run again, so no Python code runs
// between a view and the store.
template <typename Params>
void RunStoreCpu(Int32View& loc, const TensorList& tensors, Params params) {
  const auto check_all = [&] {
    for (Tensor* t : tensors) t->Check();
  };
  const auto view_all = [&] {
    for (Tensor* t : tensors) t->View();
    return params();
  };
  check_all();
  FinishViews(loc);
  StoreParams p = view_all();
  StoreCheck check;
  if (2 * p.num_tokens * RowBytes(p) >= kReleaseGilBytes) {
    // Other threads run while the rows are copied: own everything first.
    static const int threads =
        static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, kMaxStoreThreads));
    loc.Own();
    for (Tensor* t : tensors) t->Pin();
    check_all();
    p = view_all();
    py::gil_scoped_release nogil;
    check = StoreRows(p, threads);
  } else {
    check = StoreRows(p);
  }
  if (check.kind != StoreCheck::kOk) {
    RaiseBadIndex(check.position, check.slot, check.kind == StoreCheck::kRepeated, p.num_slots);
  }
}

void StoreCacheCpu(py::handle k_cache, py::handle v_cache, py::handle out_loc, py::handle k,
                   py::handle v, bool pool_views, py::handle k_scale, py::handle v_scale,
                   py::handle side) {
  // Step one for every argument (out_loc may be any 1-D integer input), then
  // step two: from here on no Python code runs until the store is done.
  ScaleArg ks(k_scale, "k_scale", kDLCPU), vs(v_scale, "v_scale", kDLCPU);
  const Tensor::Checks cache_checks = pool_views ? Tensor::kTrusted : Tensor::kWritten;
  SideArgs sides(side, cache_checks);
  Int32View loc(out_loc, "out_loc");
  Tensor kc(k_cache, "k_cache", cache_checks), vc(v_cache, "v_cache", cache_checks);
  Tensor kt(k, "k"), vt(v, "v");
  TensorList tensors{&kc, &vc, &kt, &vt};
  sides.AppendTo(&tensors);
  RunStoreCpu(loc, tensors, [&] {
    StoreParams p = CheckStoreTensors(kc, vc, kt, vt, ks, vs, kDLCPU);
    sides.AddTo(&p, {&kc, &vc}, {&kt, &vt});
    SetStoreIndices(&p, loc.data(), IndexType::kInt32, loc.size());
    return p;
  });
  MarkWritten(kc.object(), vc.object());
  sides.MarkWritten();
}

void StoreMlaCpu(py::handle kv_cache, py::handle out_loc, py::handle k_nope, py::handle k_rope,
                 int64_t kv_lora_rank, bool pool_views, py::handle k_scale, py::handle side) {
  ScaleArg ks(k_scale, "k_scale", kDLCPU);
  const Tensor::Checks cache_checks = pool_views ? Tensor::kTrusted : Tensor::kWritten;
  SideArgs sides(side, cache_checks);
  Int32View loc(out_loc, "out_loc");
  Tensor kv(kv_cache, "kv_cache", cache_checks);
  Tensor nope(k_nope, "k_nope"), rope(k_rope, "k_rope");
  TensorList tensors{&kv, &nope, &rope};
  sides.AppendTo(&tensors);
  RunStoreCpu(loc, tensors, [&] {
    StoreParams p = CheckMlaTensors(kv, nope, rope, kv_lora_rank, ks, kDLCPU);
    sides.AddTo(&p, {&kv}, {&nope, &rope});
    SetStoreIndices(&p, loc.data(), IndexType::kInt32, loc.size(), "k_nope");
    return p;
  });
  MarkWritten(kv.object());
  sides.MarkWritten();
}

void FirstMismatchBatchedCpu(py::handle query, py::handle keys, py::handle key_lens,
                             py::handle out) {
  Tensor q(query, "query"), k(keys, "keys"), o(out, "out", Tensor::kWritten);
  std::optional<Tensor> lens;
  if (!key_lens.is_none()) lens.emplace(key_lens, "key_lens");
  auto view_all = [&] {
    for (Tensor* t : {&q, &k, &o}) t->Check();
    if (lens) lens->Check();
    for (Tensor* t : {&q, &k, &o}) t->View();
    if (lens) lens->View();
    return CheckCompareArgs(q, k, lens ? &*lens : nullptr, o, kDLCPU);
  };
  CompareBatch a = view_all();
  const int64_t bad = FindBadKeyLength(a);
  if (bad >= 0) {
    const int64_t len = LoadSlot(a.key_lens, a.len_type, bad);
    CHECK_VALUE(false, "key_lens[", bad, "] = ", len, " is outside [0, ", a.key_cols, "]");
  }
  std::optional<py::gil_scoped_release> nogil;
  if (a.num_keys * std::min(a.query_len, a.key_cols) >= (int64_t{1} << 16)) {
    for (Tensor* t : {&q, &k, &o}) t->Pin();
    if (lens) lens->Pin();
    a = view_all();
    nogil.emplace();
  }
  // Lengths loaded again (maybe without the GIL) are clamped, in case they changed.
  FirstMismatchBatched(a);
  nogil.reset();
  MarkWritten(o.object());
}

}  // namespace

Tensor::Tensor(py::handle obj, const char* name, Checks checks)
    : obj_(obj), name_(name), checks_(checks) {
  PyObject* o = obj.ptr();
  CHECK_TYPE(IsTorchTensor(o), name, " must be a torch.Tensor, got ", Py_TYPE(o)->tp_name);
}

void Tensor::Check() {
  if (checks_ == kTrusted) return;
  PyObject* o = object().ptr();
  // torch's DLPack export ignores the bit: the memory holds -x for x.
  CHECK_VALUE(!IsNegView(o), name_, " is a lazy negation (its negative bit is set): pass ", name_,
              ".resolve_neg()");
  CHECK_VALUE(checks_ != kWritten || !RequiresGrad(o), name_,
              " requires grad, and a KV cache is written in place: pass ", name_,
              ".detach() (or create it with requires_grad=False)");
}

void Tensor::View() {
  TorchTensorView view(object().ptr(), name_);
  const DLTensor& t = view.get();
  ndim_ = t.ndim;
  CHECK_VALUE(ndim_ <= kMaxDims, name_, " has ", ndim_, " dimensions, too many");
  int64_t expected = 1;
  for (int d = ndim_ - 1; d >= 0; --d) {
    shape_[d] = t.shape[d];
    strides_[d] = t.strides != nullptr ? t.strides[d] : expected;
    expected *= shape_[d];
  }
  dtype_ = t.dtype;
  device_ = t.device;
  CHECK_TYPE(t.data != nullptr || expected == 0, name_,
             " has no data (a fake tensor, or one whose storage was freed)");
  data_ = static_cast<char*>(t.data) + t.byte_offset;
}

void Tensor::Pin() {
  // detach() makes a new tensor sharing the storage: the storage lives as
  // long as the alias, even if the caller's tensor is given another one.
  pinned_ = py::reinterpret_borrow<py::object>(obj_).attr("detach")();
  CHECK_TYPE(IsTorchTensor(pinned_.ptr()), name_, ".detach() did not return a tensor");
}

std::pair<const char*, const char*> Tensor::Extent() const {
  int64_t lo = 0, hi = 0;  // bytes from data_, of the lowest and one past the highest element
  for (int d = 0; d < ndim_; ++d) {
    if (shape_[d] == 0) return {data_, data_};
    const int64_t span = (shape_[d] - 1) * strides_[d] * elem_bytes();
    (span < 0 ? lo : hi) += span;
  }
  return {data_ + lo, data_ + hi + elem_bytes()};
}

bool Tensor::Overlaps(const Tensor& other) const {
  const auto [a0, a1] = Extent();
  const auto [b0, b1] = other.Extent();
  return a0 < a1 && b0 < b1 && a0 < b1 && b0 < a1;
}

std::string Tensor::ShapeString() const {
  std::string s = "[";
  for (int d = 0; d < ndim_; ++d) s += (d ? ", " : "") + std::to_string(shape_[d]);
  return s + "]";
}

void Tensor::CheckDevice(DLDeviceType type) const {
  CHECK_TYPE(device_.device_type == type, name_, " must be a ", DeviceTypeName(type),
             " tensor, got one on ", DeviceName(device_));
}

void Tensor::CheckSameDevice(const Tensor& ref) const {
  CHECK_TYPE(
      device_.device_type == ref.device_.device_type && device_.device_id == ref.device_.device_id,
      name_, " must be on ", DeviceName(ref.device_), " like ", ref.name_, ", got ",
      DeviceName(device_));
}

void Tensor::CheckLastContiguous() const {
  // The last dimension is contiguous (or too short for it to matter).
  const bool ok = ndim_ == 0 || shape_[ndim_ - 1] <= 1 || strides_[ndim_ - 1] == 1;
  CHECK_VALUE(ok, name_, " must have a contiguous last dimension (stride 1), got stride ",
              strides_[ndim_ - 1], "; pass ", name_, ".contiguous()");
}

namespace {

bool IsFloat8(const DLDataType& d) {
  return d.lanes == 1 && d.bits == 8 && (d.code == kDLFloat8_e4m3fn || d.code == kDLFloat8_e5m2);
}

// The source type a float8 cache converts from, or kNone.
SourceFloat ConvertibleSource(const DLDataType& d) {
  if (d.lanes != 1) return SourceFloat::kNone;
  if (d.code == kDLFloat && d.bits == 32) return SourceFloat::kFloat32;
  if (d.code == kDLFloat && d.bits == 16) return SourceFloat::kFloat16;
  if (d.code == kDLBfloat && d.bits == 16) return SourceFloat::kBFloat16;
  return SourceFloat::kNone;
}

void CheckCacheDType(const Tensor& c) {
  const DLDataType& dt = c.dtype();
  CHECK_TYPE(dt.lanes == 1 && dt.bits % 8 == 0 && dt.bits > 0, c.name(), " has dtype ",
             DTypeName(dt), ", which is not whole bytes");
  CHECK_TYPE(dt.code != kDLComplex, c.name(), " has dtype ", DTypeName(dt),
             ": complex K/V is not supported");
}

void CheckNoStride0(const Tensor& c) {
  for (int d = 0; d < c.ndim(); ++d) {
    CHECK_VALUE(c.stride(d) != 0 || c.size(d) <= 1, c.name(), " has stride 0 in dimension ", d,
                ": an expanded tensor would write one place many times");
  }
}

}  // namespace

ScaleArg::ScaleArg(py::handle obj, const char* name, DLDeviceType device_type) : name_(name) {
  if (obj.is_none()) return;
  given_ = true;
  PyObject* o = obj.ptr();
  double value = 0;
  if (IsTorchTensor(o)) {
    py::object t = py::reinterpret_borrow<py::object>(obj);
    const int64_t numel = t.attr("numel")().cast<int64_t>();
    CHECK_VALUE(numel == 1, name,
                " must be a number or a one-element tensor, got a tensor "
                "of ",
                numel, " elements");
    CHECK_TYPE(t.attr("is_floating_point")().cast<bool>(), name,
               " must be a floating tensor, got dtype ",
               py::str(t.attr("dtype")).cast<std::string>());
    if (device_type == kDLCUDA && t.attr("is_cuda").cast<bool>()) {
      tensor_.emplace(obj, name);
      return;  // read by the kernel; checked with the other tensors
    }
    CHECK_TYPE(!t.attr("is_meta").cast<bool>(), name,
               " is a tensor on the meta device: it has no value");
    value = t.attr("item")().cast<double>();
  } else {
    // A number: what has float() or index() (not a string, which float() parses,
    // nor a bool, Python's or NumPy's).
    const PyNumberMethods* num = Py_TYPE(o)->tp_as_number;
    const bool numeric = num != nullptr && (num->nb_float != nullptr || num->nb_index != nullptr);
    const std::string type = Py_TYPE(o)->tp_name;
    const bool boolean = PyBool_Check(o) || type == "numpy.bool" || type == "numpy.bool_";
    CHECK_TYPE(numeric && !boolean, name, " must be a number or a one-element tensor, got ", type);
    PyObject* f = PyNumber_Float(o);
    if (f == nullptr) {
      const bool overflow = PyErr_ExceptionMatches(PyExc_OverflowError);
      PyErr_Clear();
      CHECK_VALUE(!overflow, name,
                  " must be positive and finite in float32, got a "
                  "number too large for a float");
      throw Error(ErrorCode::kWrongType, StrCat(name,
                                                " must be a number or a one-element tensor, "
                                                "got ",
                                                type));
    }
    value = PyFloat_AS_DOUBLE(f);
    Py_DECREF(f);
  }
  value_ = static_cast<float>(value);  // rounds to nearest, as torch does a Python scalar
  CHECK_VALUE(value_ > 0 && std::isfinite(value_), name,
              " must be positive and finite in float32, got ", value);
}

StoreSide CheckStoreSide(const Tensor& cache, const RowLayout& cache_layout, int64_t col_offset,
                         const Tensor& src, int64_t heads, int64_t head_dim, bool flat_src,
                         const ScaleArg& scale) {
  src.CheckSameDevice(cache);
  const DLDataType& dt = cache.dtype();
  StoreSide side{};
  if (!SameDType(src.dtype(), dt)) {
    side.source = IsFloat8(dt) ? ConvertibleSource(src.dtype()) : SourceFloat::kNone;
    CHECK_TYPE(side.source != SourceFloat::kNone, src.name(), " has dtype ", DTypeName(src.dtype()),
               " but ", cache.name(), " has dtype ", DTypeName(dt),
               IsFloat8(dt) ? " (a float8 cache also takes float32, float16 or bfloat16)" : "");
    side.format = dt.code == kDLFloat8_e4m3fn ? Float8Format::kE4M3Fn : Float8Format::kE5M2;
    side.scale = scale.value();
    if (const Tensor* t = scale.tensor()) {
      t->CheckSameDevice(cache);
      CHECK_TYPE(SameDType(t->dtype(), DLDataType{kDLFloat, 32, 1}), scale.name(), " on ",
                 DeviceName(t->device()), " must have dtype float32, got ", DTypeName(t->dtype()));
      side.scale_ptr = reinterpret_cast<const float*>(t->data());
    }
  } else if (scale.given()) {
    CHECK_VALUE(false, scale.name(), " is given, but ", src.name(), " already has ", cache.name(),
                "'s dtype ", DTypeName(dt),
                " and is copied as it is (a "
                "scale applies when a float8 cache is fed float32, float16 or bfloat16)");
  }
  const int64_t rank = flat_src ? 2 : 3;
  if (flat_src) {
    CHECK_VALUE(src.ndim() == 2 && src.size(1) == head_dim, src.name(),
                " must have shape [num_tokens, ", head_dim, "], got ", src.ShapeString());
  } else {
    CHECK_VALUE(src.ndim() == rank, src.name(), " must have shape [num_tokens, ", heads, ", ",
                head_dim, "], got ", src.ShapeString());
    CHECK_VALUE(src.size(1) == heads && src.size(2) == head_dim, src.name(), " has shape ",
                src.ShapeString(), " but the cache rows are [", heads, ", ", head_dim, "]");
  }
  src.CheckLastContiguous();
  CHECK_VALUE(!src.Overlaps(cache), src.name(), " lies in the memory of ", cache.name(),
              ": the store would overwrite rows it has yet to read");
  const int64_t se = src.elem_bytes(), ce = cache.elem_bytes();
  side.src = src.data();
  side.dst = cache.data() + col_offset * ce;
  const int64_t src_head_stride = flat_src ? head_dim * se : src.stride(1) * se;
  side.src_layout = RowLayout{1, src.stride(0) * se, src.stride(0) * se, src_head_stride};
  side.dst_layout = cache_layout;
  side.heads = heads;
  side.head_bytes = head_dim * ce;
  return side;
}

StoreParams CheckStoreTensors(const Tensor& kc, const Tensor& vc, const Tensor& k, const Tensor& v,
                              const ScaleArg& k_scale, const ScaleArg& v_scale,
                              DLDeviceType device_type) {
  kc.CheckDevice(device_type);
  for (const Tensor* t : {&vc, &k, &v}) t->CheckSameDevice(kc);
  CHECK_VALUE(kc.ndim() >= 2 && kc.ndim() <= 4,
              "k_cache must have shape [num_pages, page_size, heads, head_dim], "
              "[num_slots, heads, head_dim] or [num_slots, row], got ",
              kc.ShapeString());
  CHECK_VALUE(vc.ShapeString() == kc.ShapeString(), "v_cache has shape ", vc.ShapeString(),
              " but k_cache has shape ", kc.ShapeString());
  CheckCacheDType(kc);
  CHECK_TYPE(SameDType(vc.dtype(), kc.dtype()), "v_cache has dtype ", DTypeName(vc.dtype()),
             " but k_cache has dtype ", DTypeName(kc.dtype()));
  const bool rows = kc.ndim() == 2;  // mini-SGLang's [num_slots, row] caches
  const int64_t heads = rows ? 1 : kc.size(kc.ndim() - 2), head_dim = kc.size(kc.ndim() - 1);
  StoreParams p;  // only what num_sides names is read: no need to clear the rest
  p.num_sides = 2;
  p.side[0] = CheckStoreSide(kc, CacheLayout(kc), 0, k, heads, head_dim, rows, k_scale);
  p.side[1] = CheckStoreSide(vc, CacheLayout(vc), 0, v, heads, head_dim, rows, v_scale);
  CHECK_VALUE(v.size(0) == k.size(0), "v has ", v.size(0), " tokens but k has ", k.size(0));
  for (const Tensor* c : {&kc, &vc}) {
    c->CheckLastContiguous();
    CheckNoStride0(*c);
  }
  for (const Tensor* x : {&k, &v}) {
    const Tensor& other = x == &k ? vc : kc;
    CHECK_VALUE(!x->Overlaps(other), x->name(), " lies in the memory of ", other.name(),
                ": the store would overwrite rows it has yet to read");
  }
  // K and V caches may interleave (pages holding both), so only the same rows
  // twice is refused: v would overwrite k.
  // (Caches with no elements hold no memory: nothing can be overwritten.)
  bool same = kc.data() == vc.data() && kc.Extent().first != kc.Extent().second;
  for (int d = 0; same && d < kc.ndim(); ++d) same = kc.stride(d) == vc.stride(d);
  CHECK_VALUE(!same,
              "v_cache is the same memory as k_cache: the store would write v "
              "over k");
  p.num_tokens = k.size(0);
  p.num_slots = kc.ndim() == 4 ? kc.size(0) * kc.size(1) : kc.size(0);
  return p;
}

StoreParams CheckMlaTensors(const Tensor& kv, const Tensor& k_nope, const Tensor& k_rope,
                            int64_t kv_lora_rank, const ScaleArg& k_scale,
                            DLDeviceType device_type) {
  kv.CheckDevice(device_type);
  CHECK_VALUE((kv.ndim() >= 2 && kv.ndim() <= 4) && (kv.ndim() == 2 || kv.size(kv.ndim() - 2) == 1),
              "kv_cache must have shape [num_pages, page_size, 1, row], [num_slots, 1, "
              "row] or [num_slots, row], got ",
              kv.ShapeString());
  CheckCacheDType(kv);
  const int64_t row = kv.size(kv.ndim() - 1);
  CHECK_VALUE(kv_lora_rank > 0 && kv_lora_rank < row, "kv_lora_rank=", kv_lora_rank,
              " must leave both parts of kv_cache's rows of ", row, " non-empty");
  const int64_t rope = row - kv_lora_rank;
  // A 2-D row cache is one head of the whole row (see CacheLayout): here each
  // side is a run of its own width inside it.
  RowLayout layout = CacheLayout(kv);
  layout.head_stride = row * kv.elem_bytes();
  for (const Tensor* x : {&k_nope, &k_rope}) {
    CHECK_VALUE(x->ndim() == 2 || x->ndim() == 3, x->name(),
                " must have shape "
                "[num_tokens, 1, ",
                x == &k_nope ? kv_lora_rank : rope, "] or [num_tokens, ",
                x == &k_nope ? kv_lora_rank : rope, "], got ", x->ShapeString());
  }
  StoreParams p;  // only what num_sides names is read
  p.num_sides = 2;
  p.side[0] = CheckStoreSide(kv, layout, 0, k_nope, 1, kv_lora_rank, k_nope.ndim() == 2, k_scale);
  p.side[1] =
      CheckStoreSide(kv, layout, kv_lora_rank, k_rope, 1, rope, k_rope.ndim() == 2, k_scale);
  CHECK_VALUE(k_rope.size(0) == k_nope.size(0), "k_rope has ", k_rope.size(0),
              " tokens but k_nope has ", k_nope.size(0));
  kv.CheckLastContiguous();
  CheckNoStride0(kv);
  p.num_tokens = k_nope.size(0);
  p.num_slots = kv.ndim() == 4 ? kv.size(0) * kv.size(1) : kv.size(0);
  return p;
}

SideArgs::SideArgs(py::handle sides, Tensor::Checks buffer_checks) {
  if (sides.is_none()) return;
  CHECK_TYPE(PyTuple_Check(sides.ptr()) || PyList_Check(sides.ptr()),
             "side must be a sequence of (name, buffer, source), got ",
             Py_TYPE(sides.ptr())->tp_name);
  // A snapshot this object owns: Python code run later in the call (an
  // out_loc item's __index__) may empty the caller's list, but not free the
  // entries or their tensors while the store still uses them.
  entries_ = py::reinterpret_steal<py::tuple>(PySequence_Tuple(sides.ptr()));
  if (!entries_) throw py::error_already_set();
  const py::tuple& seq = entries_;
  const size_t count = seq.size();
  CHECK_VALUE(count <= kMaxStoreSides - 2, "side has ", count, " buffers; a store writes at most ",
              kMaxStoreSides - 2, " beside its caches");
  names_.reserve(2 * count);  // the Tensors keep pointers into it: never reallocated
  for (size_t i = 0; i < count; ++i) {
    py::handle entry = seq[i];
    CHECK_TYPE(PyTuple_Check(entry.ptr()) && PyTuple_GET_SIZE(entry.ptr()) == 3, "side[", i,
               "] must be a (name, buffer, source) tuple");
    py::tuple t = py::reinterpret_borrow<py::tuple>(entry);
    CHECK_TYPE(PyUnicode_Check(t[0].ptr()), "side[", i, "]'s name must be a str");
    Py_ssize_t size = 0;
    const char* utf8 = PyUnicode_AsUTF8AndSize(t[0].ptr(), &size);
    if (utf8 == nullptr) {
      PyErr_Clear();
      CHECK_VALUE(false, "side[", i, "]'s name is not valid text");
    }
    const std::string name(utf8, static_cast<size_t>(size));
    names_.push_back("side[" + name + "]");
    names_.push_back("side buffer " + name);
    sources_.push_back(std::make_unique<Tensor>(t[2], names_[names_.size() - 2].c_str()));
    buffers_.push_back(std::make_unique<Tensor>(t[1], names_.back().c_str(), buffer_checks));
  }
}

void SideArgs::MarkWritten() const {
  for (const auto& b : buffers_) bindings::MarkWritten(b->object());
}

void SideArgs::AppendTo(TensorList* tensors) {
  for (size_t i = 0; i < buffers_.size(); ++i) {
    tensors->push_back(buffers_[i].get());
    tensors->push_back(sources_[i].get());
  }
}

void SideArgs::AddTo(StoreParams* p, std::initializer_list<const Tensor*> caches,
                     std::initializer_list<const Tensor*> sources) const {
  const int64_t count = static_cast<int64_t>(buffers_.size());
  if (count == 0) return;
  CHECK_VALUE(p->num_sides + count <= kMaxStoreSides, "side has ", count,
              " buffers; a store writes at most ", kMaxStoreSides - p->num_sides,
              " beside its caches");
  const ScaleArg none(py::none(), "scale", kDLCPU);
  for (int64_t i = 0; i < count; ++i) {
    const Tensor& buf = *buffers_[i];
    const Tensor& src = *sources_[i];
    buf.CheckSameDevice(**caches.begin());
    CHECK_VALUE(buf.ndim() == 2, buf.name(), " must be [num_slots, row], got ", buf.ShapeString());
    CHECK_VALUE(buf.size(0) == p->num_slots, buf.name(), " has ", buf.size(0),
                " slots but the cache has ", p->num_slots);
    CheckCacheDType(buf);
    buf.CheckLastContiguous();
    CheckNoStride0(buf);
    CHECK_TYPE(SameDType(src.dtype(), buf.dtype()), src.name(), " has dtype ",
               DTypeName(src.dtype()), " but ", buf.name(), " has dtype ", DTypeName(buf.dtype()));
    p->side[p->num_sides] =
        CheckStoreSide(buf, CacheLayout(buf), 0, src, 1, buf.size(1), true, none);
    ++p->num_sides;
    CHECK_VALUE(src.size(0) == p->num_tokens, src.name(), " has ", src.size(0), " tokens but ",
                (*sources.begin())->name(), " has ", p->num_tokens);
    // Sources are read while caches and buffers are written: none may meet.
    for (const Tensor* c : caches) {
      CHECK_VALUE(!src.Overlaps(*c), src.name(), " lies in the memory of ", c->name(),
                  ": the store would overwrite rows it has yet to read");
      CHECK_VALUE(!buf.Overlaps(*c), buf.name(), " lies in the memory of ", c->name());
    }
    for (const Tensor* x : sources) {
      CHECK_VALUE(!x->Overlaps(buf), x->name(), " lies in the memory of ", buf.name(),
                  ": the store would overwrite rows it has yet to read");
    }
    for (int64_t j = 0; j < count; ++j) {
      if (j == i) continue;
      CHECK_VALUE(!sources_[j]->Overlaps(buf), sources_[j]->name(), " lies in the memory of ",
                  buf.name(), ": the store would overwrite rows it has yet to read");
      CHECK_VALUE(j < i || !buffers_[j]->Overlaps(buf), buffers_[j]->name(), " and ", buf.name(),
                  " share memory: one would overwrite the other");
    }
  }
}

void SetStoreIndices(StoreParams* p, const void* data, IndexType type, int64_t n,
                     const char* tokens_name) {
  CHECK_VALUE(n == p->num_tokens, "out_loc has length ", n, " but ", tokens_name, " has ",
              p->num_tokens, " tokens");
  p->indices = data;
  p->index_type = type;
}

void SetStoreIndices(StoreParams* p, const Tensor& loc, const Tensor& k_cache,
                     const char* tokens_name) {
  loc.CheckSameDevice(k_cache);
  CHECK_VALUE(loc.ndim() == 1, "out_loc must be 1-D, got shape ", loc.ShapeString());
  CHECK_TYPE(IsIndexDType(loc.dtype()), "out_loc must have dtype int32 or int64, got ",
             DTypeName(loc.dtype()));
  loc.CheckLastContiguous();
  SetStoreIndices(p, loc.data(), loc.dtype().bits == 32 ? IndexType::kInt32 : IndexType::kInt64,
                  loc.size(0), tokens_name);
}

void RaiseBadIndex(int64_t position, int64_t slot, bool repeated, int64_t num_slots) {
  if (repeated) {
    throw Error(ErrorCode::kInvalidArgument,
                StrCat("out_loc[", position, "] = ", slot,
                       " repeats an earlier slot of out_loc: each token needs its own slot"));
  }
  throw Error(ErrorCode::kInvalidArgument,
              StrCat("out_loc[", position, "] = ", slot, " is out of range for a cache of ",
                     num_slots, " slots"));
}

void MarkWritten(py::handle a, py::handle b) {
  static PyObject* increment = [] {
    py::object f = py::module_::import("torch._C").attr("_increment_version");
    return f.release().ptr();  // lives as long as torch, that is, the process
  }();
  PyObject* tensors = b ? PyTuple_Pack(2, a.ptr(), b.ptr()) : PyTuple_Pack(1, a.ptr());
  if (tensors == nullptr) throw py::error_already_set();
  PyObject* r = PyObject_Vectorcall(increment, &tensors, 1, nullptr);
  Py_DECREF(tensors);
  if (r == nullptr) throw py::error_already_set();
  Py_DECREF(r);
}

CompareBatch CheckCompareArgs(const Tensor& q, const Tensor& keys, const Tensor* lens,
                              const Tensor& out, DLDeviceType device_type) {
  q.CheckDevice(device_type);
  keys.CheckSameDevice(q);
  out.CheckSameDevice(q);
  if (lens) lens->CheckSameDevice(q);
  const DLDataType i32{kDLInt, 32, 1};
  for (const Tensor* t : {&q, &keys, &out}) {
    CHECK_TYPE(SameDType(t->dtype(), i32), t->name(), " must have dtype int32, got ",
               DTypeName(t->dtype()));
  }
  CHECK_VALUE(q.ndim() == 1, "query must be 1-D, got shape ", q.ShapeString());
  CHECK_VALUE(keys.ndim() == 2, "keys must be 2-D [num_keys, length], got shape ",
              keys.ShapeString());
  const int64_t b = keys.size(0);
  CHECK_VALUE(out.ndim() == 1 && out.size(0) == b, "out must have shape [", b, "], got ",
              out.ShapeString());
  for (const Tensor* t : {&q, &keys, &out}) t->CheckLastContiguous();
  if (lens) {
    CHECK_VALUE(lens->ndim() == 1 && lens->size(0) == b, "key_lens must have shape [", b, "], got ",
                lens->ShapeString());
    CHECK_TYPE(IsIndexDType(lens->dtype()), "key_lens must have dtype int32 or int64, got ",
               DTypeName(lens->dtype()));
    lens->CheckLastContiguous();
  }
  CompareBatch a{};
  a.query = reinterpret_cast<const int32_t*>(q.data());
  a.query_len = q.size(0);
  a.keys = reinterpret_cast<const int32_t*>(keys.data());
  a.key_stride = keys.stride(0);
  a.key_cols = keys.size(1);
  a.key_lens = lens ? lens->data() : nullptr;
  a.len_type = lens && lens->dtype().bits == 32 ? IndexType::kInt32 : IndexType::kInt64;
  a.num_keys = b;
  a.out = reinterpret_cast<int32_t*>(out.data());
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

namespace {

constexpr Params kStoreCache{
    "store_cache",
    {"k_cache", "v_cache", "out_loc", "k", "v", "pool_views", "k_scale", "v_scale", "side"},
    9,
    5};
constexpr Params kStoreMla{
    "store_mla",
    {"kv_cache", "out_loc", "k_nope", "k_rope", "kv_lora_rank", "pool_views", "k_scale", "side"},
    8,
    5};

py::handle OrNone(PyObject* o) { return o != nullptr ? o : Py_None; }

bool PoolViews(PyObject* o) {
  CHECK_TYPE(o == nullptr || PyBool_Check(o), "pool_views must be a bool, got ",
             Py_TYPE(o)->tp_name);
  return o == Py_True;
}

// The store entry points as METH_FASTCALL functions: pybind11's dispatcher
// would cost more than a decode step's store of a few tokens (fast_call.h).
PyObject* StoreCacheFast(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  PyObject* a[kMaxParams] = {};
  if (!BindArgs(kStoreCache, args, nargs, kwnames, a)) return nullptr;
  try {
    StoreCacheCpu(a[0], a[1], a[2], a[3], a[4], PoolViews(a[5]), OrNone(a[6]), OrNone(a[7]),
                  OrNone(a[8]));
  } catch (...) {
    SetErrorFromException();
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* StoreMlaFast(PyObject*, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  PyObject* a[kMaxParams] = {};
  if (!BindArgs(kStoreMla, args, nargs, kwnames, a)) return nullptr;
  try {
    CHECK_TYPE(PyLong_Check(a[4]) && !PyBool_Check(a[4]),
               "kv_lora_rank must be an int, "
               "got ",
               Py_TYPE(a[4])->tp_name);
    const long long rank = PyLong_AsLongLong(a[4]);
    if (rank == -1 && PyErr_Occurred()) throw py::error_already_set();
    StoreMlaCpu(a[0], a[1], a[2], a[3], rank, PoolViews(a[5]), OrNone(a[6]), OrNone(a[7]));
  } catch (...) {
    SetErrorFromException();
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef kStoreFunctions[] = {
    {"store_cache", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&StoreCacheFast)),
     METH_FASTCALL | METH_KEYWORDS,
     "store_cache(k_cache, v_cache, out_loc, k, v, pool_views=False, k_scale=None, "
     "v_scale=None, side=None): see radixkv.kernel.store_cache."},
    {"store_mla", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&StoreMlaFast)),
     METH_FASTCALL | METH_KEYWORDS,
     "store_mla(kv_cache, out_loc, k_nope, k_rope, kv_lora_rank, pool_views=False, "
     "k_scale=None, side=None): see radixkv.kernel.store_mla."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

void RegisterKernels(py::module_& m) {
  if (PyModule_AddFunctions(m.ptr(), kStoreFunctions) != 0) throw py::error_already_set();
  m.def("first_mismatch_batched", &FirstMismatchBatchedCpu, py::arg("query"), py::arg("keys"),
        py::arg("key_lens"), py::arg("out"));
}

}  // namespace radixkv::bindings
