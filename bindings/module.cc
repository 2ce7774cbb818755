// The private extension radixkv._core: one-line definitions over adapters
// named Class_Method. Tree logic lives in cpp/; tensor handoff in tensor_view.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <mutex>
#include <utility>
#include <optional>
#include <vector>

#include "errors.h"
#include "kernels.h"
#include "radixkv/compare.h"
#include "radixkv/page_allocator.h"
#include "radixkv/radix_tree.h"
#include "radixkv/slot_set.h"
#include "radixkv/status.h"
#include "tensor_view.h"

namespace py = pybind11;
using radixkv::Handle;
using radixkv::RadixTree;
using radixkv::bindings::Int32View;
using radixkv::bindings::NewInt32Tensor;
using radixkv::bindings::ToInt64;

namespace {

// Inputs at least this long are processed with the GIL released.
constexpr int64_t kReleaseGilTokens = 1 << 16;

// A tree and the mutex that keeps one thread at a time inside it.
struct PyRadixTree {
  explicit PyRadixTree(int64_t page_size) : tree(page_size) {}
  RadixTree tree;
  std::mutex mu;
};

// Runs `f` holding the tree's mutex. A thread never blocks on the mutex while
// it holds the GIL: it tries once, and if another thread is inside the tree
// (or the call is long) it lets the GIL go first, so Python threads keep
// running while it waits. Before letting the GIL go, `own` copies whatever
// `f` reads from Python objects, which other threads may then change. `f`
// itself never touches Python.
template <typename F, typename Own>
auto Locked(PyRadixTree& t, bool release_gil, F&& f, Own&& own) {
  if (!release_gil && t.mu.try_lock()) {
    std::lock_guard<std::mutex> guard(t.mu, std::adopt_lock);
    return f();
  }
  own();
  py::gil_scoped_release nogil;
  std::lock_guard<std::mutex> guard(t.mu);
  return f();
}

template <typename F>
auto Locked(PyRadixTree& t, bool release_gil, F&& f) {
  return Locked(t, release_gil, std::forward<F>(f), [] {});
}

std::vector<int32_t>& Scratch() {
  thread_local std::vector<int32_t> buffer;
  return buffer;
}

Handle& AsHandle(py::handle obj) {
  if (!py::isinstance<Handle>(obj)) {
    throw py::type_error(std::string("handle must be a RadixCacheHandle from match_prefix, got ") +
                         Py_TYPE(obj.ptr())->tp_name);
  }
  return obj.cast<Handle&>();
}

py::tuple RadixTree_MatchPrefix(PyRadixTree& t, py::handle input_ids) {
  Int32View ids(input_ids, "input_ids");
  std::vector<int32_t>& slots = Scratch();
  Handle h = Locked(
      t, ids.size() >= kReleaseGilTokens,
      [&] { return t.tree.MatchPrefix(ids.data(), ids.size(), &slots); }, [&] { ids.Own(); });
  // The tensor first: making the handle object may run Python code that
  // calls back into this thread's scratch buffer.
  py::object indices = NewInt32Tensor(slots.data(), h.cached_len);
  return py::make_tuple(py::cast(h), std::move(indices));
}

int64_t RadixTree_InsertPrefix(PyRadixTree& t, py::handle input_ids, py::handle indices) {
  Int32View ids(input_ids, "input_ids");
  Int32View slots(indices, "indices");
  if (ids.size() != slots.size()) {
    throw py::value_error("indices has length " + std::to_string(slots.size()) +
                          " but input_ids has length " + std::to_string(ids.size()));
  }
  return Locked(
      t, ids.size() >= kReleaseGilTokens,
      [&] { return t.tree.InsertPrefix(ids.data(), slots.data(), ids.size()); },
      [&] {
        ids.Own();
        slots.Own();
      });
}

void RadixTree_LockHandle(PyRadixTree& t, py::handle handle, bool unlock) {
  Handle& h = AsHandle(handle);
  Locked(t, false, [&] { unlock ? t.tree.Unlock(&h) : t.tree.Lock(&h); });
}

py::object RadixTree_Evict(PyRadixTree& t, py::handle size) {
  const int64_t n = ToInt64(size, "size");
  std::vector<int32_t>& slots = Scratch();
  Locked(t, n >= kReleaseGilTokens, [&] { t.tree.Evict(n, &slots); });
  return NewInt32Tensor(slots.data(), static_cast<int64_t>(slots.size()));
}

void RadixTree_Reset(PyRadixTree& t) {
  Locked(t, true, [&] { t.tree.Reset(); });
}

void RadixTree_CheckIntegrity(PyRadixTree& t) {
  Locked(t, true, [&] { t.tree.CheckIntegrity(); });
}

py::tuple RadixTree_SizeInfo(PyRadixTree& t) {
  auto sizes = Locked(t, false, [&] {
    return std::make_pair(t.tree.evictable_size(), t.tree.protected_size());
  });
  return py::make_tuple(sizes.first, sizes.second);
}

py::object RadixTree_HandleSlots(PyRadixTree& t, py::handle handle) {
  const Handle& h = AsHandle(handle);
  std::vector<int32_t>& slots = Scratch();
  Locked(t, false, [&] { t.tree.HandleSlots(h, &slots); });
  return NewInt32Tensor(slots.data(), static_cast<int64_t>(slots.size()));
}

py::list RadixTree_Dump(PyRadixTree& t) {
  std::vector<radixkv::NodeInfo> nodes = Locked(t, true, [&] { return t.tree.Dump(); });
  py::list out;
  for (const auto& n : nodes) {
    out.append(py::make_tuple(n.parent, py::cast(n.key), py::cast(n.value), n.ref_count,
                              n.timestamp));
  }
  return out;
}

bool RadixTree_IsValid(PyRadixTree& t, py::handle handle) {
  const Handle& h = AsHandle(handle);
  return Locked(t, false, [&] { return t.tree.IsValid(h); });
}

// The allocator runs with the GIL held (its callers are one scheduler
// thread); the tree's mutex is taken only to read the tree's stored slots.
const radixkv::SlotSet* CachedSlots(py::handle tree, std::unique_lock<std::mutex>* guard) {
  if (tree.is_none()) return nullptr;
  if (!py::isinstance<PyRadixTree>(tree)) {
    throw py::type_error(std::string("tree must be a radixkv._core.RadixTree or None, got ") +
                         Py_TYPE(tree.ptr())->tp_name);
  }
  PyRadixTree& t = tree.cast<PyRadixTree&>();
  // As in Locked: never block on the mutex holding the GIL. Taking the GIL
  // back while holding the mutex is safe, since no GIL holder waits for it.
  *guard = std::unique_lock<std::mutex>(t.mu, std::try_to_lock);
  if (!guard->owns_lock()) {
    py::gil_scoped_release nogil;
    guard->lock();
  }
  return &t.tree.stored_slots();
}

py::object PageAllocator_Allocate(radixkv::PageAllocator& a, py::handle num_tokens) {
  std::vector<int32_t>& slots = Scratch();
  a.Allocate(ToInt64(num_tokens, "num_tokens"), &slots);
  return NewInt32Tensor(slots.data(), static_cast<int64_t>(slots.size()));
}

void PageAllocator_Free(radixkv::PageAllocator& a, py::handle indices, py::handle tree) {
  Int32View v(indices, "indices");
  std::unique_lock<std::mutex> guard;
  a.Free(v.data(), v.size(), CachedSlots(tree, &guard));
}

void PageAllocator_CheckOwned(radixkv::PageAllocator& a, py::handle indices,
                              const std::string& name, py::handle tree) {
  Int32View v(indices, name.c_str());
  std::unique_lock<std::mutex> guard;
  a.CheckOwned(v.data(), v.size(), name.c_str(), CachedSlots(tree, &guard));
}

void PageAllocator_CheckDisjoint(radixkv::PageAllocator& a, py::handle tree) {
  std::unique_lock<std::mutex> guard;
  const radixkv::SlotSet* cached = CachedSlots(tree, &guard);
  a.CheckDisjoint(cached != nullptr ? *cached : radixkv::SlotSet());
}

int64_t Kernel_FirstMismatch(py::handle a, py::handle b) {
  Int32View x(a, "a");
  Int32View y(b, "b");
  const int64_t n = std::min(x.size(), y.size());
  return static_cast<int64_t>(radixkv::FirstMismatch(x.data(), y.data(), n));
}

int64_t CheckIds(py::handle values, const char* name) {
  return Int32View(values, name).size();
}

// The checks insert_prefix applies to all of its indices, for managers that
// store nothing: no negative and no repeated slot.
int64_t CheckSlots(py::handle values, const std::string& name) {
  Int32View v(values, name.c_str());
  thread_local radixkv::SlotSet scratch;
  radixkv::CheckSlots(v.data(), v.size(), name.c_str(), &scratch);
  return v.size();
}

py::object Int32Tensor(py::handle values, const std::string& name) {
  Int32View v(values, name.c_str());
  return NewInt32Tensor(v.data(), v.size());
}

std::string Handle_Repr(const Handle& h) {
  return "RadixCacheHandle(cached_len=" + std::to_string(h.cached_len) +
         ", lock_count=" + std::to_string(h.lock_count) + ")";
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "radixkv native core (private; use the radixkv package)";
  radixkv::bindings::RegisterErrors(m);
  radixkv::bindings::RegisterKernels(m);
  m.def("first_mismatch", &Kernel_FirstMismatch, py::arg("a"), py::arg("b"));
  m.def("int32_tensor", &Int32Tensor, py::arg("values"), py::arg("name") = "values");
  m.def("check_ids", &CheckIds, py::arg("values"), py::arg("name"));
  m.def("check_slots", &CheckSlots, py::arg("values"), py::arg("name"));

  py::class_<Handle>(m, "RadixCacheHandle")
      .def_readonly("cached_len", &Handle::cached_len)
      .def_readonly("lock_count", &Handle::lock_count)
      .def("__repr__", &Handle_Repr);

  py::class_<PyRadixTree>(m, "RadixTree")
      .def(py::init<int64_t>(), py::arg("page_size") = 1)
      .def_property_readonly("page_size", [](PyRadixTree& t) { return t.tree.page_size(); })
      .def_property_readonly("num_nodes", [](PyRadixTree& t) { return t.tree.num_nodes(); })
      .def("match_prefix", &RadixTree_MatchPrefix, py::arg("input_ids"))
      .def("insert_prefix", &RadixTree_InsertPrefix, py::arg("input_ids"), py::arg("indices"))
      .def("lock_handle", &RadixTree_LockHandle, py::arg("handle"), py::arg("unlock") = false)
      .def("evict", &RadixTree_Evict, py::arg("size"))
      .def("reset", &RadixTree_Reset)
      .def("size_info", &RadixTree_SizeInfo)
      .def("check_integrity", &RadixTree_CheckIntegrity)
      .def("dump", &RadixTree_Dump)
      .def("is_valid", &RadixTree_IsValid, py::arg("handle"))
      .def("handle_slots", &RadixTree_HandleSlots, py::arg("handle"));

  py::class_<radixkv::PageAllocator>(m, "PageAllocator")
      .def(py::init<int64_t, int64_t>(), py::arg("num_pages"), py::arg("page_size") = 1)
      .def_property_readonly("num_pages", &radixkv::PageAllocator::num_pages)
      .def_property_readonly("page_size", &radixkv::PageAllocator::page_size)
      .def_property_readonly("num_free_pages", &radixkv::PageAllocator::num_free_pages)
      .def("allocate", &PageAllocator_Allocate, py::arg("num_tokens"))
      .def("free", &PageAllocator_Free, py::arg("indices"), py::arg("tree") = py::none())
      .def("check_owned", &PageAllocator_CheckOwned, py::arg("indices"), py::arg("name"),
           py::arg("tree") = py::none())
      .def("check_disjoint", &PageAllocator_CheckDisjoint, py::arg("tree") = py::none());
}
