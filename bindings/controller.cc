#include "controller.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "errors.h"
#include "kernels.h"
#include "radixkv/cache_controller.h"
#include "radixkv/slot_set.h"
#include "radixkv/transfer.h"
#include "radixkv/transfer_index.h"
#include "tensor_view.h"

namespace py = pybind11;

namespace radixkv::bindings {

namespace {

PoolLayout LayoutOf(char* base, const std::vector<int64_t>& strides) {
  return PoolLayout{base,       strides[0], strides[1], strides[2],
                    strides[3], strides[4], strides[5], strides.size() == 7 ? strides[6] : 2};
}

// One tensor a pool's rows live in: checked, pinned, viewed, on the device
// `cuda` allows; its alias and its extent from its data pointer.
char* ReadBuffer(py::handle buffer, const char* name, bool cuda, Pool* p, py::object* alias,
                 int64_t* extent, int64_t* span) {
  Tensor t(buffer, name, Tensor::kWritten);
  t.Check();  // on the caller's tensor (requires grad, lazy negation), then its alias
  t.Pin();
  t.View();
  const DLDeviceType type = t.device().device_type;
  CHECK_TYPE(cuda ? type == kDLCUDA : (type == kDLCPU || type == kDLCUDAHost), name, " must be a ",
             cuda ? "CUDA" : "CPU", " tensor, got one on device type ", type);
  if (p->device.device_type == 0) {  // the pool's first tensor
    p->device = t.device();
  } else {
    CHECK_VALUE(t.device().device_type == p->device.device_type &&
                    t.device().device_id == p->device.device_id,
                name, "'s planes must all be on one device");
  }
  *alias = py::reinterpret_borrow<py::object>(t.object());
  const auto [begin, end] = t.Extent();
  *extent = end - t.data();  // from the first row on
  *span = end - begin;       // all of it, for CheckUnchanged
  return t.data();
}

}  // namespace

Pool ReadPool(py::handle buffer, const std::vector<int64_t>& strides, const char* name,
              int64_t row_bytes, int64_t layers, bool cuda) {
  CHECK_VALUE(strides.size() == 6 || strides.size() == 7, name,
              "_layout must be (side_stride, layer_stride, "
              "page_stride, row_stride, page_size, num_slots[, sides])");
  CHECK_VALUE(row_bytes >= 1 && layers >= 1, "row_bytes and layers must be >= 1");
  Pool p;
  if (!PyList_Check(buffer.ptr()) && !PyTuple_Check(buffer.ptr())) {
    int64_t extent = 0;
    char* base = ReadBuffer(buffer, name, cuda, &p, &p.alias, &extent, &p.bytes);
    p.layout = LayoutOf(base, strides);
    CheckPoolLayout(p.layout, row_bytes, layers, extent, name);
    return p;
  }
  // One tensor per (side, layer) plane.
  const py::sequence planes = py::reinterpret_borrow<py::sequence>(buffer);
  p.layout = LayoutOf(nullptr, strides);
  CHECK_VALUE(p.layout.sides == 1 || p.layout.sides == 2, name,
              "_layout must have 1 or 2 sides, got ", p.layout.sides);
  const int64_t want = p.layout.sides * layers;
  CHECK_VALUE(static_cast<int64_t>(py::len(planes)) == want, name, " must be ", want,
              " plane tensors (", p.layout.sides, " sides x ", layers, " layers), got ",
              py::len(planes));
  uint64_t bits = 0;
  for (py::handle item : planes) {
    py::object alias = py::none();
    int64_t extent = 0, span = 0;
    char* start = ReadBuffer(item, name, cuda, &p, &alias, &extent, &span);
    PoolLayout one = p.layout;
    one.base = start;
    CheckPlaneLayout(one, row_bytes, extent, name);
    p.plane_aliases.push_back(std::move(alias));
    p.plane_starts.push_back(start);
    p.plane_extents.push_back(span);
    bits |= reinterpret_cast<uintptr_t>(start);
  }
  p.layout.base = p.plane_starts.front();
  p.layout.side_stride = p.layout.layer_stride = 0;
  p.layout.planes = p.plane_starts.data();
  p.layout.plane_layers = layers;
  p.layout.plane_bits = bits;
  return p;
}

void CheckSameSides(const Pool& a, const Pool& b, const char* a_name, const char* b_name) {
  CHECK_VALUE(a.layout.sides == b.layout.sides, a_name, "_layout has ", a.layout.sides,
              " sides but ", b_name, "_layout has ", b.layout.sides);
}

std::vector<CopyPlane> ReadSidePlanes(py::handle side_planes, int64_t layers, bool cuda,
                                      const Pool& kv_device, const Pool& kv_host,
                                      std::vector<Pool>* pools) {
  std::vector<CopyPlane> planes;
  if (side_planes.is_none()) return planes;
  CHECK_TYPE(PySequence_Check(side_planes.ptr()),
             "side_planes must be a sequence of (device, device_layout, host, "
             "host_layout, row_bytes)");
  for (py::handle item : py::reinterpret_borrow<py::sequence>(side_planes)) {
    CHECK_VALUE(PyTuple_Check(item.ptr()) && PyTuple_GET_SIZE(item.ptr()) == 5,
                "side_planes items must be tuples (device, device_layout, host, "
                "host_layout, row_bytes)");
    const py::tuple t = py::reinterpret_borrow<py::tuple>(item);
    const int64_t row_bytes = ToInt64(t[4], "row_bytes");
    std::vector<int64_t> device_layout, host_layout;
    try {
      device_layout = t[1].cast<std::vector<int64_t>>();
      host_layout = t[3].cast<std::vector<int64_t>>();
    } catch (const py::cast_error&) {
      CHECK_TYPE(false, "side_planes layouts must be sequences of ints");
    }
    Pool d = ReadPool(t[0], device_layout, "side device", row_bytes, layers, cuda);
    Pool h = ReadPool(t[2], host_layout, "side host", row_bytes, layers, false);
    CheckSameSides(d, h, "side device", "side host");
    // A copy checks its slots against the K/V plane's pools: every plane must
    // have their slots, or a copy would fail half done.
    const PoolLayout* pairs[2][2] = {{&d.layout, &kv_device.layout}, {&h.layout, &kv_host.layout}};
    for (const auto& pair : pairs) {
      CHECK_VALUE(
          pair[0]->num_slots == pair[1]->num_slots && pair[0]->page_size == pair[1]->page_size,
          "side_planes: a side buffer must have the slots and page size of "
          "the K/V it moves with");
    }
    planes.push_back(CopyPlane{d.layout, h.layout, row_bytes});
    pools->push_back(std::move(d));
    pools->push_back(std::move(h));
  }
  return planes;
}

Float8Pool ReadCodecSpec(py::handle codec, int64_t row_bytes, int64_t layers,
                         std::vector<Pool>* pools) {
  CHECK_TYPE(PyTuple_Check(codec.ptr()) && PyTuple_GET_SIZE(codec.ptr()) == 5,
             "codec must be None or a tuple (dtype, heads, head_dim, scales, scales_layout)");
  const py::tuple t = py::reinterpret_borrow<py::tuple>(codec);
  Float8Pool c;
  const std::string dtype = py::str(t[0]);
  c.type = dtype == "float32"    ? SourceFloat::kFloat32
           : dtype == "float16"  ? SourceFloat::kFloat16
           : dtype == "bfloat16" ? SourceFloat::kBFloat16
                                 : SourceFloat::kNone;
  CHECK_VALUE(c.type != SourceFloat::kNone,
              "codec dtype must be float32, float16 or bfloat16, got '", dtype, "'");
  c.heads = ToInt64(t[1], "codec heads");
  c.head_dim = ToInt64(t[2], "codec head_dim");
  CHECK_VALUE(c.heads >= 1 && c.head_dim >= 1 && c.heads <= row_bytes &&
                  c.heads * c.head_dim * SourceBytes(c.type) == row_bytes,
              "codec: heads x head_dim elements of ", dtype,
              " must make a row of row_bytes=", row_bytes, " bytes");
  std::vector<int64_t> layout;
  try {
    layout = t[4].cast<std::vector<int64_t>>();
  } catch (const py::cast_error&) {
    CHECK_TYPE(false, "codec scales_layout must be a sequence of ints");
  }
  Pool scales = ReadPool(t[3], layout, "codec scales", c.heads * 4, layers, false);
  CHECK_VALUE(scales.layout.row_stride == 0, "codec scales_layout must have row stride 0");
  c.scales = scales.layout;
  pools->push_back(std::move(scales));
  return c;
}

CopyPlane ReadKvPlane(const Pool& device, py::handle host, const std::vector<int64_t>& host_layout,
                      int64_t row_bytes, int64_t layers, py::handle codec, Pool* host_pool,
                      std::vector<Pool>* pools) {
  CopyPlane kv{device.layout, {}, row_bytes};
  int64_t host_row = row_bytes;
  if (!codec.is_none()) {
    kv.encoded = true;
    kv.codes = ReadCodecSpec(codec, row_bytes, layers, pools);
    host_row = kv.codes.heads * kv.codes.head_dim;
  }
  *host_pool = ReadPool(host, host_layout, "host", host_row, layers, false);
  kv.host = host_pool->layout;
  CheckSameSides(device, *host_pool, "device", "host");
  const PoolLayout& h = kv.host;
  CHECK_VALUE(
      !kv.encoded ||
          (h.page_size == device.layout.page_size && kv.codes.scales.num_slots == h.num_slots &&
           kv.codes.scales.page_size == h.page_size && kv.codes.scales.sides == h.sides),
      "codec: the host pool, its scales and the device pool must have the same "
      "page size, and the scales the host pool's slots and sides");
  return kv;
}

void Pool::CheckUnchanged(const char* name) const {
  for (size_t i = 0; i < plane_aliases.size(); ++i) {
    // The plane's own alias (ReadBuffer's, checked then): its place and
    // extent are all there is to look at again.
    Tensor t(plane_aliases[i], name, Tensor::kTrusted);
    t.View();
    const auto [begin, end] = t.Extent();
    CHECK_VALUE(t.data() == plane_starts[i] && end - begin == plane_extents[i],
                name,
                "'s storage was resized or replaced after the "
                "controller was made: its copies would touch freed memory");
  }
  if (!alias) return;
  Tensor t(alias, name);
  t.Check();
  t.View();
  const auto [begin, end] = t.Extent();
  CHECK_VALUE(t.data() == layout.base && end - begin == bytes, name,
              "'s storage was resized or replaced after the "
              "controller was made: its copies would touch freed memory");
}

namespace {

// Slots, or with `page_size` > 1 page ids (page p: slots p * page_size +
// [0, page_size)), each checked to name slots an int32 holds; copied as they
// are (the engine expands pages where it copies by slot).
std::vector<int32_t> Slots(py::handle obj, const char* name, int64_t page_size = 1) {
  Int32View v(obj, name);
  FinishViews(v);
  const int32_t* ids = v.data();
  if (page_size == 1) return std::vector<int32_t>(ids, ids + v.size());
  // One branch-free pass for the range (it vectorizes); the id at fault is
  // looked for only when there is one.
  const int64_t limit = (int64_t{1} << 31) / page_size;
  int32_t lo = 0, hi = 0;
  for (int64_t i = 0; i < v.size(); ++i) {
    lo = std::min(lo, ids[i]);
    hi = std::max(hi, ids[i]);
  }
  for (int64_t i = 0; (lo < 0 || hi >= limit) && i < v.size(); ++i) {
    CHECK_VALUE(ids[i] >= 0 && ids[i] < limit, name, "[", i, "] = ", ids[i],
                " is not a page id of page_size ", page_size);
  }
  return std::vector<int32_t>(ids, ids + v.size());
}

void CheckPageSize(int64_t page_size) {
  CHECK_VALUE(page_size >= 1 && page_size <= INT32_MAX, "page_size must be in [1, 2^31), got ",
              page_size);
}

py::list Acks(const std::vector<CopyAck>& acks) {
  py::list out;
  for (const CopyAck& a : acks) out.append(py::make_tuple(a.id, a.ok));
  return out;
}

class PyController {
 public:
  // The CPU engine between two CPU pools.
  PyController(py::handle device, const std::vector<int64_t>& device_layout, py::handle host,
               const std::vector<int64_t>& host_layout, int64_t row_bytes, int64_t layers,
               bool manual, py::handle side_planes, py::object keep, py::handle codec)
      // With `codec`, the host holds the K/V as float8 pages (ReadKvPlane).
      : keep_(std::move(keep)),
        device_(ReadPool(device, device_layout, "device", row_bytes, layers, false)) {
    CopyPlane kv =
        ReadKvPlane(device_, host, host_layout, row_bytes, layers, codec, &host_, &sides_);
    std::vector<CopyPlane> planes{kv};
    for (CopyPlane& p : ReadSidePlanes(side_planes, layers, false, device_, host_, &sides_)) {
      planes.push_back(p);
    }
    c_ = std::make_unique<CacheController>(MakeCpuCopyEngine(std::move(planes), layers), manual);
  }
  // Bookkeeping only: copies succeed at once.
  PyController(int64_t layers, bool manual) {
    CHECK_VALUE(layers >= 1, "layers must be >= 1");
    c_ = std::make_unique<CacheController>(MakeNullCopyEngine(layers), manual);
  }
  // An engine another module made (radixkv._cuda.copy_engine), taken once.
  PyController(py::capsule engine, bool manual, py::object keep) : keep_(std::move(keep)) {
    CHECK_TYPE(std::string(engine.name() ? engine.name() : "") == kEngineCapsule,
               "engine must come from radixkv._cuda.copy_engine");
    auto* box = engine.get_pointer<EngineBox>();
    CHECK_VALUE(box->engine != nullptr, "engine was already given to a CacheController");
    device_ = std::move(box->device);
    host_ = std::move(box->host);
    sides_ = std::move(box->sides);
    engine_ = box->engine.get();
    c_ = std::make_unique<CacheController>(std::move(box->engine), manual);
  }

  // With `page_size` > 1 the two are page ids (device_pages, host_pages),
  // each inside its pool where the pools are known (a page past the pool
  // would only fail the copy, after its slots were made on the thread).
  uint64_t Backup(py::handle device, py::handle host, int64_t page_size) {
    CheckPageSize(page_size);
    std::vector<int32_t> d = Slots(device, "device_slots", page_size),
                         h = Slots(host, "host_slots", page_size);
    CheckedStream();
    CHECK_VALUE(d.size() == h.size(), "device_slots and host_slots differ in length");
    InPool(d, page_size, device_, "device_slots");
    InPool(h, page_size, host_, "host_slots");
    return c_->Backup(std::move(d), std::move(h), static_cast<int32_t>(page_size));
  }
  uint64_t Load(py::handle host, py::handle device, int64_t page_size) {
    CheckPageSize(page_size);
    std::vector<int32_t> h = Slots(host, "host_slots", page_size),
                         d = Slots(device, "device_slots", page_size);
    CHECK_VALUE(d.size() == h.size(), "device_slots and host_slots differ in length");
    InPool(h, page_size, host_, "host_slots");
    InPool(d, page_size, device_, "device_slots");
    CheckedStream();
    return c_->Load(std::move(h), std::move(d), static_cast<int32_t>(page_size));
  }
  void StartLoading() {
    Stream();
    c_->StartLoading();
  }
  void WaitLayer(py::handle layer) {
    const int64_t l = ToInt64(layer, "layer");
    CHECK_VALUE(l >= 0 && l < c_->num_layers(), "layer=", l, " is out of range for ",
                c_->num_layers(), " layers");
    Stream();
    py::gil_scoped_release nogil;
    c_->WaitLayer(l);
  }
  void Drain() {
    Stream();
    py::gil_scoped_release nogil;
    c_->Drain();
  }
  void WaitLoads() {
    Stream();
    py::gil_scoped_release nogil;
    c_->WaitLoads();
  }
  py::list TakeBackupAcks() { return Acks(Checked(c_->TakeBackupAcks())); }
  py::list TakeLoadAcks() { return Acks(Checked(c_->TakeLoadAcks())); }
  bool Complete(uint64_t id, bool ok) {
    Stream();
    py::gil_scoped_release nogil;
    return c_->Complete(id, ok);
  }
  int64_t InFlight() const { return c_->in_flight(); }
  std::vector<uint64_t> Waiting() const { return c_->Waiting(); }
  int64_t NumLayers() const { return c_->num_layers(); }

 private:
  // Before a copy is queued, with the GIL: the pools are still where they
  // were (see Pool::CheckUnchanged); then Stream().
  void CheckedStream() {
    device_.CheckUnchanged("device");
    host_.CheckUnchanged("host");
    for (const Pool& p : sides_) p.CheckUnchanged("a side buffer");
    Stream();
  }
  // Before anything is queued or waited for: a CUDA engine fences against,
  // and makes wait, the caller's current stream (torch's). Waiting touches
  // no pool: it works (and a shutdown drains) after a pool has moved.
  void Stream() {
    if (engine_ != nullptr && device_.device.device_type == kDLCUDA) {
      engine_->SetComputeStream(CurrentStream(device_.device));
    }
  }

  // Copies that finished into memory a pool no longer has (its storage moved
  // since, say by share_memory_(), the memory they used kept alive by
  // `keep`) count as failed: the tree never takes rows the pool cannot see.
  std::vector<CopyAck> Checked(std::vector<CopyAck> acks) const {
    if (!acks.empty() && !PoolsUnchanged()) {
      for (CopyAck& a : acks) a.ok = false;
    }
    return acks;
  }
  bool PoolsUnchanged() const {
    try {
      device_.CheckUnchanged("device");
      host_.CheckUnchanged("host");
      for (const Pool& p : sides_) p.CheckUnchanged("a side buffer");
    } catch (const std::exception&) {
      PyErr_Clear();
      return false;
    }
    return true;
  }

  static void InPool(const std::vector<int32_t>& pages, int64_t page_size, const Pool& pool,
                     const char* name) {
    const int64_t slots = pool.layout.num_slots;
    if (page_size == 1 || slots <= 0) return;
    for (size_t i = 0; i < pages.size(); ++i) {
      CHECK_VALUE((int64_t{pages[i]} + 1) * page_size <= slots, name, "[", i, "] = ", pages[i],
                  " is a page past the pool's ", slots, " slots");
    }
  }

  // The memory the pools had when the controller was made (the tensors
  // that own it): kept until the controller's thread has stopped, so a
  // pool whose storage moves in place (share_memory_()) never frees memory
  // a copy is using. Declared first: destroyed last.
  py::object keep_;
  Pool device_, host_;  // destroyed after the controller's thread stops
  std::vector<Pool> sides_;
  CopyEngine* engine_ = nullptr;  // owned by c_; set for an engine from another module
  std::unique_ptr<CacheController> c_;
};

// One transfer, on the caller's thread with the GIL held (benchmarks and
// tests; the controller is how the tier copies).
int64_t TransferRowsNow(py::handle src, const std::vector<int64_t>& src_layout, py::handle dst,
                        const std::vector<int64_t>& dst_layout, int64_t row_bytes, int64_t layers,
                        py::handle src_slots, py::handle dst_slots, int64_t layer_begin,
                        int64_t layer_end) {
  Pool s = ReadPool(src, src_layout, "src", row_bytes, layers, false);
  Pool d = ReadPool(dst, dst_layout, "dst", row_bytes, layers, false);
  CheckSameSides(s, d, "src", "dst");
  std::vector<int32_t> a = Slots(src_slots, "src_slots"), b = Slots(dst_slots, "dst_slots");
  CHECK_VALUE(a.size() == b.size(), "src_slots and dst_slots differ in length");
  if (layer_end == -1) layer_end = layers;
  CHECK_VALUE(layer_begin >= 0 && layer_begin <= layer_end && layer_end <= layers, "layers [",
              layer_begin, ", ", layer_end, ") are not within [0, ", layers, ")");
  TransferParams p{
      s.layout,    d.layout, row_bytes, layers, a.data(), b.data(), static_cast<int64_t>(a.size()),
      layer_begin, layer_end};
  const int64_t bad = TransferRows(p);
  CHECK_VALUE(bad < 0, "slot pair ", bad, " (", a[bad], " -> ", b[bad],
              ") is out of range; nothing copied");
  return static_cast<int64_t>(a.size());
}

}  // namespace

void RegisterController(py::module_& m) {
  m.def("transfer_rows", &TransferRowsNow, py::arg("src"), py::arg("src_layout"), py::arg("dst"),
        py::arg("dst_layout"), py::arg("row_bytes"), py::arg("layers"), py::arg("src_slots"),
        py::arg("dst_slots"), py::arg("layer_begin") = 0, py::arg("layer_end") = -1);
  py::class_<PyController>(m, "CacheController")
      .def(
          py::init<py::handle, const std::vector<int64_t>&, py::handle, const std::vector<int64_t>&,
                   int64_t, int64_t, bool, py::handle, py::object, py::handle>(),
          py::arg("device"), py::arg("device_layout"), py::arg("host"), py::arg("host_layout"),
          py::arg("row_bytes"), py::arg("layers"), py::arg("manual") = false,
          py::arg("side_planes") = py::none(), py::arg("keep") = py::none(),
          py::arg("codec") = py::none())
      .def(py::init<int64_t, bool>(), py::arg("layers"), py::arg("manual") = false)
      .def(py::init<py::capsule, bool, py::object>(), py::arg("engine"), py::arg("manual") = false,
           py::arg("keep") = py::none())
      .def("backup", &PyController::Backup, py::arg("device_slots"), py::arg("host_slots"),
           py::arg("page_size") = 1)
      .def("load", &PyController::Load, py::arg("host_slots"), py::arg("device_slots"),
           py::arg("page_size") = 1)
      .def("start_loading", &PyController::StartLoading)
      .def("wait_layer", &PyController::WaitLayer, py::arg("layer"))
      .def("drain", &PyController::Drain)
      .def("wait_loads", &PyController::WaitLoads)
      .def("take_backup_acks", &PyController::TakeBackupAcks)
      .def("take_load_acks", &PyController::TakeLoadAcks)
      .def("complete", &PyController::Complete, py::arg("id"), py::arg("ok") = true)
      .def_property_readonly("in_flight", &PyController::InFlight)
      .def_property_readonly("num_layers", &PyController::NumLayers)
      .def("waiting", &PyController::Waiting);
}

}  // namespace radixkv::bindings
