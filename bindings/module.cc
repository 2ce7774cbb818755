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
using radixkv::bindings::FinishViews;
using radixkv::bindings::Int32View;
using radixkv::bindings::TensorSink;
using radixkv::bindings::NewInt32Tensor;
using radixkv::bindings::ToInt64;

namespace {

// Inputs at least this long are processed with the GIL released.
constexpr int64_t kReleaseGilTokens = 1 << 16;

// A tree and the mutex that keeps one thread at a time inside it.
struct PyRadixTree {
  PyRadixTree(int64_t page_size, int64_t max_slots) : tree(page_size, max_slots) {}
  RadixTree tree;
  std::mutex mu;
};

// Runs `f` holding `mu`. A thread never blocks on the mutex while it holds
// the GIL: it tries once, and if another thread is inside (or the call is
// long) it lets the GIL go first, so Python threads keep running while it
// waits. Before letting the GIL go, `own` copies whatever `f` reads from
// Python objects, which other threads may then change or free. `f` itself
// touches no Python object (a TensorSink takes the GIL back on its own).
template <typename F, typename Own>
auto Locked(std::mutex& mu, bool release_gil, F&& f, Own&& own) {
  if (!release_gil && mu.try_lock()) {
    std::lock_guard<std::mutex> guard(mu, std::adopt_lock);
    return f();
  }
  own();
  py::gil_scoped_release nogil;
  std::lock_guard<std::mutex> guard(mu);
  return f();
}

template <typename F>
auto Locked(PyRadixTree& t, bool release_gil, F&& f) {
  return Locked(t.mu, release_gil, std::forward<F>(f), [] {});
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
  FinishViews(ids);
  // The handle object is made before the match, so nothing can fail after it.
  py::object handle = py::cast(Handle{});
  TensorSink indices;
  Handle h = Locked(
      t.mu, ids.size() >= kReleaseGilTokens,
      [&] { return t.tree.MatchPrefix(ids.data(), ids.size(), indices); }, [&] { ids.Own(); });
  handle.cast<Handle&>() = h;
  return py::make_tuple(std::move(handle), indices.take());
}

int64_t RadixTree_InsertPrefix(PyRadixTree& t, py::handle input_ids, py::handle indices) {
  Int32View ids(input_ids, "input_ids");
  Int32View slots(indices, "indices");
  FinishViews(ids, slots);
  if (ids.size() != slots.size()) {
    throw py::value_error("indices has length " + std::to_string(slots.size()) +
                          " but input_ids has length " + std::to_string(ids.size()));
  }
  return Locked(
      t.mu, ids.size() >= kReleaseGilTokens,
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
  TensorSink slots;
  Locked(t, n >= kReleaseGilTokens, [&] { t.tree.Evict(n, slots); });
  return slots.take();
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

int64_t RadixTree_NumNodes(PyRadixTree& t) {
  return Locked(t, false, [&] { return t.tree.num_nodes(); });
}

py::object RadixTree_HandleSlots(PyRadixTree& t, py::handle handle) {
  const Handle& h = AsHandle(handle);
  TensorSink slots;
  Locked(t, false, [&] { t.tree.HandleSlots(h, slots); });
  return slots.take();
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

PyRadixTree* AsTree(py::handle tree) {
  if (tree.is_none()) return nullptr;
  if (!py::isinstance<PyRadixTree>(tree)) {
    throw py::type_error(std::string("tree must be a radixkv._core.RadixTree or None, got ") +
                         Py_TYPE(tree.ptr())->tp_name);
  }
  return &tree.cast<PyRadixTree&>();
}

// Runs `f(cached)` with the tree's stored slots (null without a tree), holding
// the tree's mutex as Locked does. The allocator itself runs with the GIL
// held (its callers are one scheduler thread).
template <typename F, typename Own>
auto WithCachedSlots(py::handle tree, F&& f, Own&& own) {
  PyRadixTree* t = AsTree(tree);
  if (t == nullptr) return f(nullptr);
  return Locked(t->mu, false, [&] { return f(&t->tree.stored_slots()); }, own);
}

py::object PageAllocator_Allocate(radixkv::PageAllocator& a, py::handle num_tokens) {
  TensorSink slots;
  a.Allocate(ToInt64(num_tokens, "num_tokens"), slots);
  return slots.take();
}

void PageAllocator_Free(radixkv::PageAllocator& a, py::handle indices, py::handle tree) {
  Int32View v(indices, "indices");
  FinishViews(v);
  WithCachedSlots(
      tree, [&](const radixkv::SlotSet* cached) { a.Free(v.data(), v.size(), cached); },
      [&] { v.Own(); });
}

void PageAllocator_CheckOwned(radixkv::PageAllocator& a, py::handle indices,
                              const std::string& name, py::handle tree) {
  Int32View v(indices, name.c_str());
  FinishViews(v);
  WithCachedSlots(
      tree,
      [&](const radixkv::SlotSet* cached) {
        a.CheckOwned(v.data(), v.size(), name.c_str(), cached);
      },
      [&] { v.Own(); });
}

void PageAllocator_CheckDisjoint(radixkv::PageAllocator& a, py::handle tree) {
  WithCachedSlots(
      tree,
      [&](const radixkv::SlotSet* cached) {
        static const radixkv::SlotSet kNone;
        a.CheckDisjoint(cached != nullptr ? *cached : kNone);
      },
      [] {});
}

int64_t Kernel_FirstMismatch(py::handle a, py::handle b) {
  Int32View x(a, "a");
  Int32View y(b, "b");
  FinishViews(x, y);
  const int64_t n = std::min(x.size(), y.size());
  return static_cast<int64_t>(radixkv::FirstMismatch(x.data(), y.data(), n));
}

int64_t CheckIds(py::handle values, const char* name) {
  Int32View v(values, name);
  FinishViews(v);
  return v.size();
}

// The checks insert_prefix applies to all of its indices, for managers that
// store nothing: no negative, out-of-range (`limit` >= 0) or repeated slot.
int64_t CheckSlots(py::handle values, const std::string& name, int64_t limit) {
  Int32View v(values, name.c_str());
  FinishViews(v);
  radixkv::SlotSet scratch;
  radixkv::CheckSlots(v.data(), v.size(), name.c_str(), &scratch, limit);
  return v.size();
}

py::object Int32Tensor(py::handle values, const std::string& name) {
  Int32View v(values, name.c_str());
  FinishViews(v);
  return NewInt32Tensor(v.data(), v.size());
}

std::string Handle_Repr(const Handle& h) {
  return "RadixCacheHandle(cached_len=" + std::to_string(h.cached_len) +
         ", lock_count=" + std::to_string(h.lock_count) + ")";
}

constexpr const char* kMatchDoc =
    "match_prefix(input_ids) -> (handle, indices)\n\n"
    "Longest cached prefix of input_ids in whole pages: a handle (cached_len\n"
    "tokens, no locks) and the slot indices stored for them (int32).\n"
    "Refreshes the LRU time of exactly the matched tokens; may split a node.";
constexpr const char* kInsertDoc =
    "insert_prefix(input_ids, indices) -> int\n\n"
    "Store the whole pages of input_ids that are not cached yet, with their\n"
    "slot indices; return how many leading tokens were cached already (the\n"
    "caller frees its own copies of those). Raises ValueError, changing\n"
    "nothing, for a negative, out-of-range or repeated slot or one the cache\n"
    "already stores.";
constexpr const char* kLockDoc =
    "lock_handle(handle, unlock=False)\n\n"
    "Add (or with unlock=True remove) one lock on every node from the\n"
    "handle's node to the root. Locked tokens are never evicted.";
constexpr const char* kEvictDoc =
    "evict(size) -> indices\n\n"
    "Free at least size unlocked tokens, least recently used first, and\n"
    "return their slots in eviction order. Raises OutOfCapacityError,\n"
    "changing nothing, when size exceeds the evictable size.";

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "radixkv native core (private; use the radixkv package)";
  radixkv::bindings::RegisterErrors(m);
  radixkv::bindings::RegisterKernels(m);
  m.def("first_mismatch", &Kernel_FirstMismatch, py::arg("a"), py::arg("b"));
  m.def("int32_tensor", &Int32Tensor, py::arg("values"), py::arg("name") = "values");
  m.def("check_ids", &CheckIds, py::arg("values"), py::arg("name"));
  m.def("check_slots", &CheckSlots, py::arg("values"), py::arg("name"), py::arg("limit") = -1);

  py::class_<Handle>(m, "RadixCacheHandle")
      .def_readonly("cached_len", &Handle::cached_len)
      .def_readonly("lock_count", &Handle::lock_count)
      .def("__repr__", &Handle_Repr);

  py::class_<PyRadixTree>(m, "RadixTree")
      .def(py::init<int64_t, int64_t>(), py::arg("page_size") = 1,
           py::arg("max_slots") = RadixTree::kAnySlot)
      .def_property_readonly("page_size", [](PyRadixTree& t) { return t.tree.page_size(); })
      .def_property_readonly("max_slots", [](PyRadixTree& t) { return t.tree.max_slots(); })
      .def_property_readonly("num_nodes", &RadixTree_NumNodes)
      .def("match_prefix", &RadixTree_MatchPrefix, py::arg("input_ids"), kMatchDoc)
      .def("insert_prefix", &RadixTree_InsertPrefix, py::arg("input_ids"), py::arg("indices"),
           kInsertDoc)
      .def("lock_handle", &RadixTree_LockHandle, py::arg("handle"), py::arg("unlock") = false,
           kLockDoc)
      .def("evict", &RadixTree_Evict, py::arg("size"), kEvictDoc)
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
