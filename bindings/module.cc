// The private extension radixkv._core: one-line definitions over adapters
// named Class_Method. Tree logic lives in cpp/; tensor handoff in tensor_view.
// The tree and its handles are CPython types with vectorcall methods
// (fast_call.h); the rest is pybind11.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <structmember.h>

#include <cstddef>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "block_ledger.h"
#include "controller.h"
#include "errors.h"
#include "fast_call.h"
#include "kernels.h"
#include "radixkv/checksum.h"
#include "radixkv/compare.h"
#include "radixkv/event_pack.h"
#include "radixkv/page_allocator.h"
#include "radixkv/page_codec.h"
#include "radixkv/page_hash.h"
#include "radixkv/radix_tree.h"
#include "radixkv/request_steps.h"
#include "radixkv/slot_set.h"
#include "radixkv/status.h"
#include "radixkv/tier_steps.h"
#include "signal_shield.h"
#include "tensor_view.h"

namespace py = pybind11;
using radixkv::Handle;
using radixkv::RadixTree;
using radixkv::SlotSink;
using radixkv::SlotSource;
using radixkv::bindings::Boxed;
using radixkv::bindings::Bytes32;
using radixkv::bindings::FastMethod;
using radixkv::bindings::FinishAll;
using radixkv::bindings::FinishViews;
using radixkv::bindings::Int32Block;
using radixkv::bindings::Int32View;
using radixkv::bindings::NewBoxed;
using radixkv::bindings::NewInt32Tensor;
using radixkv::bindings::Params;
using radixkv::bindings::TensorSink;
using radixkv::bindings::ToInt64;
using radixkv::bindings::U8;
using radixkv::bindings::Unbox;

namespace {

// Inputs at least this long are processed with the GIL released.
constexpr int64_t kReleaseGilTokens = 1 << 16;

// A tree and the mutex that keeps one thread at a time inside it.
struct PyRadixTree {
  PyRadixTree(int64_t page_size, int64_t max_slots, radixkv::EvictionPolicy policy,
              int64_t tel_safe_tokens, bool aligned_pages)
      : tree(page_size, max_slots, policy, tel_safe_tokens, aligned_pages) {}
  RadixTree tree;
  std::mutex mu;
  // Where finish_requests_flat joins a batch's cached parts and own pages,
  // kept between calls (at most what the largest batch needed), so a large
  // batch does not fault in fresh memory each step. Guarded by `mu`.
  std::vector<int32_t> joined;
};

// Runs `f` holding `mu`. A thread never blocks on the mutex while it holds
// the GIL: it tries once, and if another thread is inside (or the call is
// long) it lets the GIL go first, so Python threads keep running while it
// waits. Before letting the GIL go, `own` copies whatever `f` reads from
// Python objects, which other threads may then change or free. `f` itself
// runs no Python code (results go to a TensorSink, made a tensor afterwards),
// so nothing under the mutex can re-enter the tree.
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

// Runs f() holding both the tree's mutex and the GIL: for a call that also
// changes a Python-owned object the GIL guards (a PageAllocator). Waiting for
// the mutex releases the GIL (`own()` first), as Locked does; the GIL is
// taken back once the mutex is held, which never deadlocks, since no thread
// waits for the mutex while holding the GIL.
template <typename F, typename Own>
auto LockedWithGil(PyRadixTree& t, F&& f, Own&& own) {
  if (!t.mu.try_lock()) {
    own();
    py::gil_scoped_release nogil;
    t.mu.lock();
  }
  std::lock_guard<std::mutex> guard(t.mu, std::adopt_lock);
  return f();
}

PyTypeObject* g_tree_type = nullptr;
PyTypeObject* g_handle_type = nullptr;

// --- typed values ---------------------------------------------------------------------
// What the tree hands back in fixed shapes (a copy between the tiers, the tier
// sizes, a dump's row) crosses as a struct sequence: a tuple (indexing,
// unpacking, equality and hashing as a tuple's) whose fields also have names,
// made in C at a tuple's cost.

PyTypeObject* g_tier_copy_type = nullptr;
PyTypeObject* g_tier_sizes_type = nullptr;
// dump()'s rows by (tiers, namespaces): DumpRow, DumpRowNs, TierDumpRow, TierDumpRowNs.
PyTypeObject* g_dump_row_types[4] = {};

PyStructSequence_Field kTierCopyFields[] = {
    {"node_id", "The node the copy's range ends at (splits keep the deeper part in it)."},
    {"incarnation",
     "The node's incarnation: bumped only when its id is freed, so a copy stays valid while "
     "its node moves between the tiers."},
    {"start", "Depth (tokens from the root) where the copy's range starts."},
    {"end", "Depth where it ends: the node's depth."},
    {nullptr, nullptr},
};
PyStructSequence_Desc kTierCopyDesc{
    "radixkv._core.TierCopy",
    "TierCopy(node_id, incarnation, start, end): a copy between the tiers, of the tokens\n"
    "at depths [start, end) of the path that ends at node node_id. A tuple; calls that\n"
    "take a copy back take any tuple of those four.",
    kTierCopyFields, 4};

PyStructSequence_Field kTierSizesFields[] = {
    {"device_evictable", "Tokens on the device, unlocked."},
    {"device_protected", "Tokens on the device, locked (by requests or copies)."},
    {"host", "Tokens with a host copy."},
    {"host_only", "Tokens with a host copy and not on the device."},
    {"backing_up", "Tokens on the device with a backup in flight."},
    {"loading", "Host-only tokens with a load in flight."},
    {"storage_writing", "Tokens with a host copy being written to storage."},
    {nullptr, nullptr},
};
PyStructSequence_Desc kTierSizesDesc{
    "radixkv._core.TierSizes",
    "TierSizes(device_evictable, device_protected, host, host_only, backing_up, loading,\n"
    "storage_writing): token counts of the two tiers. A tuple.",
    kTierSizesFields, 7};

constexpr const char* kParentDoc = "Index in the dump of the node's parent (-1: the root).";
constexpr const char* kTokensDoc = "The node's tokens (list of int).";
constexpr const char* kDeviceDoc = "Its device slots (empty when not on the device).";
constexpr const char* kHostDoc = "Its host slots (empty without a host copy).";
constexpr const char* kRefDoc = "Locks on the node.";
constexpr const char* kTimeDoc = "Its LRU time (the tree's clock at its last use).";
constexpr const char* kNsDoc = "Its namespace.";
PyStructSequence_Field kDumpRowFields[] = {
    {"parent", kParentDoc}, {"tokens", kTokensDoc},  {"device_slots", kDeviceDoc},
    {"ref_count", kRefDoc}, {"timestamp", kTimeDoc}, {"namespace", kNsDoc},
    {nullptr, nullptr},
};
PyStructSequence_Field kTierDumpRowFields[] = {
    {"parent", kParentDoc},   {"tokens", kTokensDoc}, {"device_slots", kDeviceDoc},
    {"host_slots", kHostDoc}, {"ref_count", kRefDoc}, {"timestamp", kTimeDoc},
    {"namespace", kNsDoc},    {nullptr, nullptr},
};
// Without namespaces=True the namespace is a field by name only (not in the tuple).
PyStructSequence_Desc kDumpRowDescs[4] = {
    {"radixkv._core.DumpRow",
     "DumpRow(parent, tokens, device_slots, ref_count, timestamp): a node in dump(); a\n"
     "tuple of those five. Its namespace is row.namespace (not in the tuple).",
     kDumpRowFields, 5},
    {"radixkv._core.DumpRowNs",
     "DumpRowNs(parent, tokens, device_slots, ref_count, timestamp, namespace): a node in\n"
     "dump(namespaces=True).",
     kDumpRowFields, 6},
    {"radixkv._core.TierDumpRow",
     "TierDumpRow(parent, tokens, device_slots, host_slots, ref_count, timestamp): a node in\n"
     "dump(tiers=True); a tuple of those six. Its namespace is row.namespace (not in the "
     "tuple).",
     kTierDumpRowFields, 6},
    {"radixkv._core.TierDumpRowNs",
     "TierDumpRowNs(parent, tokens, device_slots, host_slots, ref_count, timestamp,\n"
     "namespace): a node in dump(tiers=True, namespaces=True).",
     kTierDumpRowFields, 7},
};

PyTypeObject* AddStructType(py::module_& m, PyStructSequence_Desc* desc) {
  py::object type = py::reinterpret_steal<py::object>(
      reinterpret_cast<PyObject*>(PyStructSequence_NewType(desc)));
  if (!type) throw py::error_already_set();
  const char* dot = std::strrchr(desc->name, '.');
  m.add_object(dot + 1, type);
  return reinterpret_cast<PyTypeObject*>(type.ptr());
}

// A new struct sequence filled field by field (each Add steals a new
// reference; a null one means a Python error is set, and throws).
class Fields {
 public:
  explicit Fields(PyTypeObject* type)
      : obj_(py::reinterpret_steal<py::object>(PyStructSequence_New(type))) {
    if (!obj_) throw py::error_already_set();
  }
  Fields& Add(PyObject* value) {
    if (value == nullptr) throw py::error_already_set();
    PyStructSequence_SET_ITEM(obj_.ptr(), next_++, value);
    return *this;
  }
  Fields& Add(py::object value) { return Add(value.release().ptr()); }
  PyObject* Take() { return obj_.release().ptr(); }

 private:
  py::object obj_;
  Py_ssize_t next_ = 0;
};

bool Truth(PyObject* o, bool absent) {
  if (o == nullptr) return absent;
  const int truth = PyObject_IsTrue(o);
  if (truth < 0) throw py::error_already_set();
  return truth != 0;
}

Handle& AsHandle(PyObject* obj, const char* name = "handle") {
  CHECK_TYPE(Py_TYPE(obj) == g_handle_type, name,
             " must be a RadixCacheHandle from match_prefix, got ", Py_TYPE(obj)->tp_name);
  return Unbox<Handle>(obj);
}

// A cache namespace: a non-negative int (0, the default, when absent).
uint64_t AsNamespace(PyObject* o, const char* name = "namespace") {
  if (o == nullptr) return 0;
  const int64_t ns = ToInt64(o, name);
  CHECK_VALUE(ns >= 0, name, " must be >= 0, got ", ns);
  return static_cast<uint64_t>(ns);
}

// Where a call writes what it returns: slots, or (`P`, the page forms of the
// calls: match_pages, evict_pages, ...) page ids.
template <bool P>
SlotSink Out(TensorSink& sink) {
  const SlotSink out(sink);
  return P ? out.Pages() : out;
}

template <bool P>
py::object RadixTree_MatchPrefix(PyRadixTree& t, PyObject* const* a) {
  const uint64_t ns = AsNamespace(a[1]);
  Int32View ids(a[0], "input_ids");
  // The handle object is made before the match, so nothing can fail after it,
  // and before `ids` is borrowed, since making an object may run Python code.
  py::object handle = NewBoxed<Handle>(g_handle_type);
  // skip_last: without the last token, which a scheduler always computes.
  const bool skip_last = Truth(a[2], false);
  FinishViews(ids);
  CHECK_VALUE(!skip_last || ids.size() > 0, "input_ids must hold at least one token");
  const int64_t n = ids.size() - skip_last;
  TensorSink indices;
  Unbox<Handle>(handle.ptr()) = Locked(
      t.mu, n >= kReleaseGilTokens,
      [&] { return t.tree.MatchPrefix(ids.data(), n, Out<P>(indices), ns); },
      [&] { ids.Own(); });
  return py::make_tuple(std::move(handle), indices.take());
}

// A prefill batch's matches in one call: every input is converted (and every
// handle made) before the tree is touched, then all are matched under one
// lock (the GIL released once when the batch is large). The same as one
// match_prefix per input, in order.
py::object RadixTree_MatchPrefixBatch(PyRadixTree& t, PyObject* const* a) {
  CHECK_TYPE(PyList_Check(a[0]) || PyTuple_Check(a[0]),
             "batch must be a list or tuple of token id sequences, got ", Py_TYPE(a[0])->tp_name);
  // A snapshot: Python code run while items are converted cannot change it.
  const py::tuple items = py::reinterpret_steal<py::tuple>(PySequence_Tuple(a[0]));
  if (!items) throw py::error_already_set();
  const size_t n = items.size();
  // One namespace for the whole batch, or one per input.
  std::vector<uint64_t> spaces(
      n,
      AsNamespace(a[1] != nullptr && (PyList_Check(a[1]) || PyTuple_Check(a[1])) ? nullptr : a[1]));
  if (a[1] != nullptr && (PyList_Check(a[1]) || PyTuple_Check(a[1]))) {
    const py::tuple given = py::reinterpret_steal<py::tuple>(PySequence_Tuple(a[1]));
    if (!given) throw py::error_already_set();
    CHECK_VALUE(given.size() == n, "namespace has ", given.size(), " entries but batch has ", n);
    for (size_t i = 0; i < n; ++i) {
      const std::string name = "namespace[" + std::to_string(i) + "]";
      spaces[i] = AsNamespace(given[i].ptr(), name.c_str());
    }
  }
  std::vector<std::string> names(n);
  std::vector<std::unique_ptr<Int32View>> views(n);
  std::vector<py::object> handles(n);
  for (size_t i = 0; i < n; ++i) {
    names[i] = "batch[" + std::to_string(i) + "]";
    views[i] = std::make_unique<Int32View>(items[i], names[i].c_str());
  }
  for (size_t i = 0; i < n; ++i) handles[i] = NewBoxed<Handle>(g_handle_type);
  // skip_last: each input without its last token, which a scheduler always
  // computes (so each must have one).
  const bool skip_last = Truth(a[2], false);
  // flat: every match's slots back to back in one tensor, written straight
  // into the block that becomes it (room for all the input tokens, made
  // before any match; the room past the result is never written, so it
  // costs address space, not memory: copying a short result out instead
  // left the freed blocks resident).
  const bool flat = Truth(a[3], false);
  int64_t total = 0;
  FinishAll(views);
  for (size_t i = 0; i < n; ++i) {
    CHECK_VALUE(!skip_last || views[i]->size() > 0, names[i], " must hold at least one token");
    total += views[i]->size();
  }
  Int32Block joined = flat ? Int32Block(total) : Int32Block();
  int64_t used = 0;
  std::vector<TensorSink> indices(flat ? 0 : n);
  std::vector<Handle> matched(n);
  Locked(
      t.mu, total >= kReleaseGilTokens,
      [&] {
        for (size_t i = 0; i < n; ++i) {
          const int32_t* ids = views[i]->data();
          const int64_t len = views[i]->size() - skip_last;
          if (flat) {
            matched[i] = t.tree.MatchPrefix(
                ids, len,
                [&](int64_t m) {
                  used += m;  // (at most the input's length)
                  return joined.data() + used - m;
                },
                spaces[i]);
          } else {
            matched[i] = t.tree.MatchPrefix(ids, len, indices[i], spaces[i]);
          }
        }
        return 0;
      },
      [&] {
        for (auto& v : views) v->Own();
      });
  py::list out(n);
  for (size_t i = 0; i < n; ++i) {
    Unbox<Handle>(handles[i].ptr()) = matched[i];
    out[i] = flat ? std::move(handles[i])
                  : py::object(py::make_tuple(std::move(handles[i]), indices[i].take()));
  }
  if (flat) {
    joined.Truncate(used);
    return py::make_tuple(std::move(out), joined.ToTensor());
  }
  return std::move(out);
}

// An eviction priority: an int that fits int32 (0 when absent).
int32_t AsPriority(PyObject* o, const char* name = "priority") {
  const int64_t p = o != nullptr ? ToInt64(o, name) : 0;
  CHECK_VALUE(p >= INT32_MIN && p <= INT32_MAX, name, " must fit int32, got ", p);
  return static_cast<int32_t>(p);
}

py::object RadixTree_InsertPrefix(PyRadixTree& t, PyObject* const* a) {
  Int32View ids(a[0], "input_ids");
  Int32View slots(a[1], "indices");
  const int32_t priority = AsPriority(a[2]);
  const uint64_t ns = AsNamespace(a[3]);
  FinishViews(ids, slots);
  CHECK_VALUE(ids.size() == slots.size(), "indices has length ", slots.size(),
              " but input_ids has length ", ids.size());
  return py::int_(Locked(
      t.mu, ids.size() >= kReleaseGilTokens,
      [&] { return t.tree.InsertPrefix(ids.data(), slots.data(), ids.size(), priority, ns); },
      [&] {
        ids.Own();
        slots.Own();
      }));
}

py::object RadixTree_LockHandle(PyRadixTree& t, PyObject* const* a) {
  Handle& h = AsHandle(a[0]);
  bool unlock = false;
  if (a[1] != nullptr) {
    const int truth = PyObject_IsTrue(a[1]);
    if (truth < 0) throw py::error_already_set();
    unlock = truth != 0;
  }
  Locked(t, false, [&] { unlock ? t.tree.Unlock(&h) : t.tree.Lock(&h); });
  return py::none();
}

template <bool P>
py::object RadixTree_Evict(PyRadixTree& t, PyObject* const* a) {
  const int64_t n = ToInt64(a[0], "size");
  TensorSink slots;
  Locked(t, n >= kReleaseGilTokens, [&] { t.tree.Evict(n, Out<P>(slots)); });
  return slots.take();
}

py::object RadixTree_Reset(PyRadixTree& t, PyObject* const*) {
  Locked(t, true, [&] { t.tree.Reset(); });
  return py::none();
}

py::object RadixTree_CheckIntegrity(PyRadixTree& t, PyObject* const*) {
  Locked(t, true, [&] { t.tree.CheckIntegrity(); });
  return py::none();
}

py::object RadixTree_SizeInfo(PyRadixTree& t, PyObject* const*) {
  auto sizes = Locked(
      t, false, [&] { return std::make_pair(t.tree.evictable_size(), t.tree.protected_size()); });
  return py::make_tuple(sizes.first, sizes.second);
}

py::object RadixTree_EvictableSize(PyRadixTree& t, PyObject* const*) {
  return py::int_(Locked(t, false, [&] { return t.tree.evictable_size(); }));
}

py::object RadixTree_ProtectedSize(PyRadixTree& t, PyObject* const*) {
  return py::int_(Locked(t, false, [&] { return t.tree.protected_size(); }));
}

template <bool P>
py::object RadixTree_HandleSlots(PyRadixTree& t, PyObject* const* a) {
  const Handle& h = AsHandle(a[0]);
  TensorSink slots;
  Locked(t, false, [&] { t.tree.HandleSlots(h, Out<P>(slots)); });
  return slots.take();
}

py::object RadixTree_Dump(PyRadixTree& t, PyObject* const* a) {
  const bool tiers = Truth(a[0], false), spaces = Truth(a[1], false);
  std::vector<radixkv::NodeInfo> nodes = Locked(t, true, [&] { return t.tree.Dump(); });
  // The row's layout: host_slots after device_slots with tiers; the namespace
  // last, in the tuple with namespaces and after it (by name only) without.
  PyTypeObject* type = g_dump_row_types[(tiers ? 2 : 0) + (spaces ? 1 : 0)];
  py::list out(nodes.size());
  for (size_t i = 0; i < nodes.size(); ++i) {
    const radixkv::NodeInfo& n = nodes[i];
    Fields row(type);
    row.Add(PyLong_FromLongLong(n.parent)).Add(py::cast(n.key)).Add(py::cast(n.value));
    if (tiers) row.Add(py::cast(n.host_value));
    row.Add(PyLong_FromLongLong(n.ref_count))
        .Add(PyLong_FromUnsignedLongLong(n.timestamp))
        .Add(PyLong_FromUnsignedLongLong(n.ns));
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), row.Take());
  }
  return std::move(out);
}

// --- the host tier ------------------------------------------------------------------
// A TierCopy crosses to Python as a TierCopy (node_id, incarnation, start, end),
// a tuple; any tuple of those four comes back as one.

py::object CopyTuple(const radixkv::TierCopy& c) {
  Fields copy(g_tier_copy_type);
  copy.Add(PyLong_FromUnsignedLong(c.node_id))
      .Add(PyLong_FromUnsignedLongLong(c.incarnation))
      .Add(PyLong_FromLongLong(c.start))
      .Add(PyLong_FromLongLong(c.end));
  return py::reinterpret_steal<py::object>(copy.Take());
}

// `claim`: a claim of RadixTree.claim, whose start may be kHostClaim.
radixkv::TierCopy AsCopy(PyObject* o, bool claim = false) {
  // A TierCopy is a tuple of four; so is a plain (node_id, incarnation, start, end).
  CHECK_TYPE(PyTuple_Check(o) && PyTuple_GET_SIZE(o) == 4,
             "copy must be a TierCopy (node_id, incarnation, start, end) "
             "from find_backup or find_load, or a tuple of those four, "
             "got ",
             Py_TYPE(o)->tp_name);
  radixkv::TierCopy c;
  const int64_t id = ToInt64(PyTuple_GET_ITEM(o, 0), "copy.node_id");
  CHECK_VALUE(id >= 0 && id <= UINT32_MAX, "copy.node_id is not a node id");
  c.node_id = static_cast<uint32_t>(id);
  c.incarnation = static_cast<uint64_t>(ToInt64(PyTuple_GET_ITEM(o, 1), "copy.incarnation"));
  c.start = ToInt64(PyTuple_GET_ITEM(o, 2), "copy.start");
  c.end = ToInt64(PyTuple_GET_ITEM(o, 3), "copy.end");
  const bool host_claim = claim && c.start == RadixTree::kHostClaim;
  CHECK_VALUE(host_claim || (c.start >= 0 && c.end >= c.start), "copy has a bad range");
  return c;
}

py::object RadixTree_TierSizes(PyRadixTree& t, PyObject* const*) {
  const radixkv::TierSizes z = Locked(t, false, [&] { return t.tree.tier_sizes(); });
  Fields sizes(g_tier_sizes_type);
  for (const int64_t n : {z.device_evictable, z.device_protected, z.host, z.host_only, z.backing_up,
                          z.loading, z.storage_writing}) {
    sizes.Add(PyLong_FromLongLong(n));
  }
  return py::reinterpret_steal<py::object>(sizes.Take());
}

template <bool P>
py::object RadixTree_EvictHost(PyRadixTree& t, PyObject* const* a) {
  const int64_t n = ToInt64(a[0], "size");
  TensorSink slots;
  Locked(t, false, [&] { t.tree.EvictHost(n, Out<P>(slots)); });
  return slots.take();
}

py::object RadixTree_FindBackup(PyRadixTree& t, PyObject* const* a) {
  Int32View ids(a[0], "input_ids");
  const int64_t min_hits = a[1] != nullptr ? ToInt64(a[1], "min_hits") : 0;
  CHECK_VALUE(min_hits >= 0 && min_hits <= UINT32_MAX, "min_hits is out of range");
  const bool through_partial = Truth(a[2], false);
  const uint64_t ns = AsNamespace(a[3]);
  FinishViews(ids);
  radixkv::TierCopy c;
  const bool found = Locked(
      t.mu, ids.size() >= kReleaseGilTokens,
      [&] {
        return t.tree.FindBackup(ids.data(), ids.size(), static_cast<uint32_t>(min_hits), &c,
                                 through_partial, ns);
      },
      [&] { ids.Own(); });
  return found ? CopyTuple(c) : py::none();
}

py::object RadixTree_BeginBackup(PyRadixTree& t, PyObject* const* a) {
  const radixkv::TierCopy c = AsCopy(a[0]);
  TensorSink slots;
  Locked(t, false, [&] { t.tree.BeginBackup(c, slots); });
  return slots.take();
}

// A pool's pages for a step that takes or frees them with the tree's: a
// PageAllocator of the tree's page size. None is refused when `required`,
// else it comes back null (the caller frees).
radixkv::PageAllocator* PagesFor(const PyRadixTree& t, PyObject* obj, const char* name,
                                 bool required) {
  if (obj == nullptr || obj == Py_None) {
    CHECK_TYPE(!required, name, " must be a radixkv._core.PageAllocator, got None");
    return nullptr;
  }
  py::handle h(obj);
  CHECK_TYPE(py::isinstance<radixkv::PageAllocator>(h), name,
             " must be a radixkv._core.PageAllocator, got ", Py_TYPE(obj)->tp_name);
  auto* pages = h.cast<radixkv::PageAllocator*>();
  CHECK_VALUE(pages->page_size() == t.tree.page_size(), name, " has page_size ", pages->page_size(),
              " but the tree has ", t.tree.page_size());
  return pages;
}

template <bool P>
py::object RadixTree_StartBackup(PyRadixTree& t, PyObject* const* a) {
  Int32View ids(a[0], "input_ids");
  radixkv::PageAllocator* pages = PagesFor(t, a[1], "host_pages", true);
  const int64_t min_hits = a[2] != nullptr ? ToInt64(a[2], "min_hits") : 0;
  CHECK_VALUE(min_hits >= 0 && min_hits <= UINT32_MAX, "min_hits is out of range");
  const bool through_partial = Truth(a[3], false);
  const uint64_t ns = AsNamespace(a[4]);
  FinishViews(ids);
  radixkv::TierCopy c;
  TensorSink device, host;
  const radixkv::BackupStart r = LockedWithGil(
      t,
      [&] {
        return radixkv::StartBackup(&t.tree, pages, ids.data(), ids.size(),
                                    static_cast<uint32_t>(min_hits), through_partial, ns, &c,
                                    Out<P>(device), Out<P>(host));
      },
      [&] { ids.Own(); });
  if (r == radixkv::BackupStart::kNothing) return py::none();
  if (r == radixkv::BackupStart::kNoRoom)
    return py::make_tuple(CopyTuple(c), py::none(), py::none());
  return py::make_tuple(CopyTuple(c), device.take(), host.take());
}

template <bool P>
py::object RadixTree_FinishBackup(PyRadixTree& t, PyObject* const* a) {
  const radixkv::TierCopy c = AsCopy(a[0]);
  const bool ok = Truth(a[2], true);
  radixkv::PageAllocator* pages = PagesFor(t, a[3], "host_pages", false);
  const char* name = P ? "host_page_ids" : "host_slots";
  Int32View host(a[1], name);
  FinishViews(host);
  const int64_t ps = t.tree.page_size();
  CHECK_VALUE(P ? host.size() * ps == c.length() : host.size() == c.length(), name,
              " has length ", host.size(), " but the copy covers ", c.length(), " tokens",
              P ? " (in pages of " + std::to_string(ps) + ")" : std::string());
  TensorSink rejected;
  if (pages != nullptr) {
    LockedWithGil(
        t,
        [&] {
          radixkv::FinishBackup(&t.tree, pages, c, SlotSource(host.data(), P), ok, rejected);
        },
        [&] { host.Own(); });
  } else {
    Locked(
        t.mu, false,
        [&] { return t.tree.FinishBackup(c, SlotSource(host.data(), P), ok, rejected); },
        [&] { host.Own(); });
  }
  return rejected.take();
}

// The arguments of a request step (old_handle, input_ids, indices, pages,
// priority), read in that order and finished.
struct RequestArgs {
  // `page_ids`: the third argument holds page ids (the page forms).
  RequestArgs(const PyRadixTree& t, PyObject* const* a, bool page_ids = false)
      : handle(AsHandle(a[0], "old_handle")),
        ids(a[1], "input_ids"),
        slots(a[2], page_ids ? "page_ids" : "indices"),
        pages(PagesFor(t, a[3], "pages", true)),
        priority(AsPriority(a[4])),
        page_ids(page_ids) {
    FinishViews(ids, slots);
  }
  // Read under the lock: Own() may have moved the data.
  radixkv::FinishedRequest request() const {
    return {&handle, ids.data(), ids.size(), slots.data(), slots.size(), priority, page_ids};
  }
  void Own() {
    ids.Own();
    slots.Own();
  }

  Handle& handle;
  Int32View ids, slots;
  radixkv::PageAllocator* pages;
  int32_t priority;
  bool page_ids;
};

// A request step's BlockStored for what it cached, from the step's own call
// (its `ledger` and `seed` arguments, a[5] and a[6]), checked before it runs.
struct StepAnnouncer {
  StepAnnouncer(const PyRadixTree& t, const RequestArgs& r, PyObject* const* a)
      : announce(a[5], a[6], r.pages->num_pages(), t.tree.page_size()),
        known(r.handle.cached_len),
        whole(r.ids.size() - r.ids.size() % t.tree.page_size()) {}
  void Inserted(const RequestArgs& r, int64_t in_cache) const {
    announce.Inserted(r.ids.data(), r.slots.data(), in_cache, whole, known, r.page_ids);
  }

  const radixkv::bindings::InsertAnnouncer announce;
  const int64_t known, whole;
};

template <bool P>
py::object RadixTree_FinishRequest(PyRadixTree& t, PyObject* const* a) {
  RequestArgs r(t, a, P);
  const StepAnnouncer announce(t, r, a);
  const int64_t in_cache = LockedWithGil(
      t, [&] { return radixkv::FinishRequest(&t.tree, r.pages, r.request()); }, [&] { r.Own(); });
  announce.Inserted(r, in_cache);
  return py::int_(in_cache);
}

template <bool P>
py::object RadixTree_CacheRequest(PyRadixTree& t, PyObject* const* a) {
  RequestArgs r(t, a, P);
  const StepAnnouncer announce(t, r, a);
  py::object handle = NewBoxed<Handle>(g_handle_type);
  TensorSink indices;
  const int64_t in_cache = LockedWithGil(
      t,
      [&] {
        return radixkv::CacheRequest(&t.tree, r.pages, r.request(), &Unbox<Handle>(handle.ptr()),
                                     Out<P>(indices));
      },
      [&] { r.Own(); });
  announce.Inserted(r, in_cache);
  return py::make_tuple(std::move(handle), indices.take(), in_cache);
}

// A batch's priorities: one int for all (0 when absent), or a list or tuple
// with one per request.
std::vector<int32_t> BatchPriorities(PyObject* arg, size_t n) {
  if (arg == nullptr || !(PyList_Check(arg) || PyTuple_Check(arg))) {
    return std::vector<int32_t>(n, AsPriority(arg));
  }
  const py::tuple given = py::reinterpret_steal<py::tuple>(PySequence_Tuple(arg));
  if (!given) throw py::error_already_set();
  CHECK_VALUE(given.size() == n, "priority has ", given.size(), " entries but batch has ", n);
  std::vector<int32_t> priorities(n);
  for (size_t i = 0; i < n; ++i) {
    priorities[i] = AsPriority(given[i].ptr(), ("priority[" + std::to_string(i) + "]").c_str());
  }
  return priorities;
}

// A list or tuple argument as a snapshot tuple: Python code run while its
// items are converted cannot change it, and it keeps them alive while views
// borrow them.
py::tuple Snapshot(PyObject* arg, const char* what) {
  CHECK_TYPE(PyList_Check(arg) || PyTuple_Check(arg), what, Py_TYPE(arg)->tp_name);
  py::tuple items = py::reinterpret_steal<py::tuple>(PySequence_Tuple(arg));
  if (!items) throw py::error_already_set();
  return items;
}

// FinishRequests over finished views (`views` owned before the GIL goes):
// request i is handles[i] with the tokens of the view ids(i) and the slots
// (with `P`, page ids) slots(i) (a pointer and a count), both read under the
// tree's lock, once the views are final.
template <bool P, typename Ids, typename Slots, typename Prepare>
py::object FinishBatch(PyRadixTree& t, radixkv::PageAllocator* pages,
                       const std::vector<Handle*>& handles, const std::vector<int32_t>& priorities,
                       std::vector<std::unique_ptr<Int32View>>& views, Ids ids, Slots slots,
                       const char* what, Prepare prepare) {
  const size_t n = handles.size();
  std::vector<int64_t> in_cache(n);
  LockedWithGil(
      t,
      [&] {
        prepare();
        std::vector<radixkv::FinishedRequest> batch(n);
        for (size_t i = 0; i < n; ++i) {
          const Int32View& tokens = ids(i);
          const auto [slot_data, m] = slots(i);
          batch[i] = {handles[i], tokens.data(), tokens.size(), slot_data, m, priorities[i], P};
        }
        radixkv::FinishRequests(&t.tree, pages, batch.data(), static_cast<int64_t>(n),
                                in_cache.data(), what);
      },
      [&] {
        for (auto& v : views) v->Own();
      });
  py::list out(n);
  for (size_t i = 0; i < n; ++i) out[i] = py::int_(in_cache[i]);
  return std::move(out);
}

// A batch's requests: each item an (old_handle, input_ids, indices) tuple
// (with `P`, the page forms: (old_handle, input_ids, page_ids)). A tree whose
// pages are not aligned refuses page ids, even for an empty batch.
template <bool P>
py::object RadixTree_FinishRequests(PyRadixTree& t, PyObject* const* a) {
  t.tree.RequireAligned(P);
  const char* slots_name = P ? "page_ids" : "indices";
  const py::tuple items = Snapshot(
      a[0], P ? "batch must be a list or tuple of (old_handle, input_ids, page_ids), got "
              : "batch must be a list or tuple of (old_handle, input_ids, indices), got ");
  const size_t n = items.size();
  radixkv::PageAllocator* pages = PagesFor(t, a[1], "pages", true);
  const std::vector<int32_t> priorities = BatchPriorities(a[2], n);
  std::vector<std::string> names(3 * n);
  std::vector<Handle*> handles(n);
  std::vector<std::unique_ptr<Int32View>> views(2 * n);
  for (size_t i = 0; i < n; ++i) {
    const std::string where = "batch[" + std::to_string(i) + "]";
    PyObject* item = items[i].ptr();
    CHECK_TYPE(PyTuple_Check(item) && PyTuple_GET_SIZE(item) == 3, where,
               " must be a tuple (old_handle, input_ids, ", slots_name, "), got ",
               Py_TYPE(item)->tp_name);
    names[3 * i] = where + " old_handle";
    names[3 * i + 1] = where + " input_ids";
    names[3 * i + 2] = where + " " + slots_name;
    handles[i] = &AsHandle(PyTuple_GET_ITEM(item, 0), names[3 * i].c_str());
    views[2 * i] = std::make_unique<Int32View>(PyTuple_GET_ITEM(item, 1), names[3 * i + 1].c_str());
    views[2 * i + 1] =
        std::make_unique<Int32View>(PyTuple_GET_ITEM(item, 2), names[3 * i + 2].c_str());
  }
  FinishAll(views);
  return FinishBatch<P>(
      t, pages, handles, priorities, views,
      [&](size_t i) -> const Int32View& { return *views[2 * i]; },
      [&](size_t i) {
        const Int32View& v = *views[2 * i + 1];
        return std::make_pair(v.data(), v.size());
      },
      "batch", [] {});
}

// The same with every request's slots in one tensor: request i's are the
// ceil(len(input_ids[i]) / page_size) pages after those of the requests
// before it. With `own`, `indices` holds each request's cached part
// (handles[i].cached_len slots) and `own` the rest, joined in the tree's
// kept buffer (PyRadixTree::joined). With `P` (the page form) the tensors
// hold page ids, one entry a page, and `indices` is named `page_ids`.
template <bool P>
py::object RadixTree_FinishRequestsFlat(PyRadixTree& t, PyObject* const* a) {
  t.tree.RequireAligned(P);
  const char* slots_name = P ? "page_ids" : "indices";
  const char* unit = P ? " pages" : " slots";
  const py::tuple given =
      Snapshot(a[0], "handles must be a list or tuple of the requests' handles, got ");
  const py::tuple tokens =
      Snapshot(a[1], "input_ids must be a list or tuple of token id sequences, got ");
  const size_t n = given.size();
  CHECK_VALUE(tokens.size() == n, "input_ids has ", tokens.size(), " entries but handles has ", n);
  radixkv::PageAllocator* pages = PagesFor(t, a[3], "pages", true);
  const std::vector<int32_t> priorities = BatchPriorities(a[4], n);
  const bool split = a[5] != nullptr && a[5] != Py_None;
  std::vector<std::string> names(2 * n);
  std::vector<Handle*> handles(n);
  std::vector<std::unique_ptr<Int32View>> views(n + 1 + split);
  for (size_t i = 0; i < n; ++i) {
    names[2 * i] = "handles[" + std::to_string(i) + "]";
    names[2 * i + 1] = "input_ids[" + std::to_string(i) + "]";
    handles[i] = &AsHandle(given[i].ptr(), names[2 * i].c_str());
    views[i] = std::make_unique<Int32View>(tokens[i], names[2 * i + 1].c_str());
  }
  views[n] = std::make_unique<Int32View>(a[2], slots_name);
  if (split) views[n + 1] = std::make_unique<Int32View>(a[5], "own");
  FinishAll(views);
  // No Python code runs from here on: the handles' lengths stay as read.
  // Offsets and counts in entries: slots, or pages (`P`). A handle's
  // cached_len is whole pages.
  const int64_t ps = t.tree.page_size();
  const int64_t per_page = P ? 1 : ps;
  std::vector<int64_t> offsets(n + 1, 0), hits(n);
  int64_t cached = 0;
  for (size_t i = 0; i < n; ++i) {
    const int64_t whole = (views[i]->size() + ps - 1) / ps;
    const int64_t covers = handles[i]->cached_len;
    CHECK_VALUE(!split || (covers >= 0 && covers <= whole * ps), "request[", i,
                "] old_handle covers ", covers, " tokens but request[", i, "] input_ids has only ",
                views[i]->size());
    hits[i] = P ? covers / ps : covers;
    offsets[i + 1] = offsets[i] + whole * per_page;
    cached += hits[i];
  }
  const Int32View* head = views[n].get();
  const Int32View* own = split ? views[n + 1].get() : nullptr;
  if (split) {
    CHECK_VALUE(head->size() == cached, slots_name, " has length ", head->size(),
                " but with own it holds the requests' cached parts: ", cached, unit);
    CHECK_VALUE(own->size() == offsets[n] - cached, "own has length ", own->size(),
                " but the requests' input_ids need ", offsets[n] - cached, " more", unit,
                " than their cached parts (each in whole pages of ", ps, ")");
  } else {
    CHECK_VALUE(head->size() == offsets[n], slots_name, " has length ", head->size(),
                " but the requests' input_ids need ", offsets[n], unit,
                " (each in whole pages of ", ps, ")");
  }
  // Joins each request's cached part and own pages in the tree's buffer
  // (under its lock, after the views are owned if the GIL went).
  const auto join = [&] {
    if (!split) return;
    t.joined.resize(static_cast<size_t>(offsets[n]));
    const int32_t* from_head = head->data();
    const int32_t* from_own = own->data();
    for (size_t i = 0; i < n; ++i) {
      const int64_t hit = hits[i];
      const int64_t rest = offsets[i + 1] - offsets[i] - hit;
      int32_t* to = t.joined.data() + offsets[i];
      std::copy(from_head, from_head + hit, to);
      std::copy(from_own, from_own + rest, to + hit);
      from_head += hit;
      from_own += rest;
    }
  };
  return FinishBatch<P>(
      t, pages, handles, priorities, views, [&](size_t i) -> const Int32View& { return *views[i]; },
      [&](size_t i) {
        const int32_t* base = split ? t.joined.data() : head->data();
        return std::make_pair(base + offsets[i], offsets[i + 1] - offsets[i]);
      },
      "request", join);
}

template <bool P>
py::object RadixTree_StartLoad(PyRadixTree& t, PyObject* const* a) {
  const Handle& h = AsHandle(a[0]);
  radixkv::PageAllocator* pages = PagesFor(t, a[1], "device_pages", true);
  CHECK_VALUE(t.tree.max_slots() == radixkv::RadixTree::kAnySlot ||
                  pages->num_pages() * pages->page_size() <= t.tree.max_slots(),
              "device_pages has ", pages->num_pages() * pages->page_size(),
              " slots but the tree takes slots below max_slots ", t.tree.max_slots());
  radixkv::TierCopy c;
  py::object loaded = NewBoxed<Handle>(g_handle_type);
  TensorSink host, indices;
  const radixkv::LoadStart r = LockedWithGil(
      t,
      [&] {
        return radixkv::StartLoad(&t.tree, pages, h, &c, &Unbox<Handle>(loaded.ptr()),
                                  Out<P>(host), Out<P>(indices));
      },
      [] {});
  if (r == radixkv::LoadStart::kNothing) return py::none();
  if (r == radixkv::LoadStart::kNoRoom) {
    return py::make_tuple(CopyTuple(c), py::none(), py::none(), py::none());
  }
  return py::make_tuple(CopyTuple(c), std::move(loaded), host.take(), indices.take());
}

py::object RadixTree_FindLoad(PyRadixTree& t, PyObject* const* a) {
  const Handle& h = AsHandle(a[0]);
  return CopyTuple(Locked(t, false, [&] { return t.tree.FindLoad(h); }));
}

template <bool P>
py::object RadixTree_BeginLoad(PyRadixTree& t, PyObject* const* a) {
  const radixkv::TierCopy c = AsCopy(a[0]);
  py::object handle = NewBoxed<Handle>(g_handle_type);
  TensorSink host, prefix;
  Locked(t, false, [&] {
    t.tree.BeginLoad(c, Out<P>(host), Out<P>(prefix), &Unbox<Handle>(handle.ptr()));
  });
  return py::make_tuple(std::move(handle), host.take(), prefix.take());
}

template <bool P>
py::object RadixTree_FinishLoad(PyRadixTree& t, PyObject* const* a) {
  const radixkv::TierCopy c = AsCopy(a[0]);
  const bool ok = Truth(a[2], true);
  const char* name = P ? "device_page_ids" : "device_slots";
  Int32View device(a[1], name);
  FinishViews(device);
  const int64_t ps = t.tree.page_size();
  CHECK_VALUE(P ? device.size() * ps == c.length() : device.size() == c.length(), name,
              " has length ", device.size(), " but the copy covers ", c.length(), " tokens",
              P ? " (in pages of " + std::to_string(ps) + ")" : std::string());
  return py::bool_(Locked(
      t.mu, false, [&] { return t.tree.FinishLoad(c, SlotSource(device.data(), P), ok); },
      [&] { device.Own(); }));
}

py::object RadixTree_EvictionCandidatesWithoutHost(PyRadixTree& t, PyObject* const* a) {
  const int64_t n = ToInt64(a[0], "size");
  const bool in_ns = a[1] != nullptr && a[1] != Py_None;
  const uint64_t ns = in_ns ? AsNamespace(a[1]) : 0;
  std::vector<radixkv::TierCopy> copies = Locked(
      t, false, [&] { return t.tree.EvictionCandidatesWithoutHost(n, in_ns ? &ns : nullptr); });
  py::list out;
  for (const radixkv::TierCopy& c : copies) out.append(CopyTuple(c));
  return std::move(out);
}

// --- namespace quotas ------------------------------------------------------------------

py::object RadixTree_CopyNamespace(PyRadixTree& t, PyObject* const* a) {
  const radixkv::TierCopy c = AsCopy(a[0]);
  uint64_t ns = 0;
  const bool found = Locked(t, false, [&] { return t.tree.CopyNamespace(c, &ns); });
  return found ? py::object(py::int_(ns)) : py::none();
}

py::object RadixTree_SetQuota(PyRadixTree& t, PyObject* const* a) {
  const uint64_t ns = AsNamespace(a[0]);
  const int64_t device = a[1] == Py_None ? -1 : ToInt64(a[1], "device");
  const int64_t host = a[2] == Py_None ? -1 : ToInt64(a[2], "host");
  CHECK_VALUE(device >= 0 || a[1] == Py_None, "device must be >= 0 or None, got ", device);
  CHECK_VALUE(host >= 0 || a[2] == Py_None, "host must be >= 0 or None, got ", host);
  Locked(t, true, [&] { t.tree.SetQuota(ns, device, host); });
  return py::none();
}

py::list QuotaList(const std::vector<radixkv::RadixTree::QuotaUse>& uses) {
  py::list out;
  for (const auto& u : uses) {
    out.append(py::make_tuple(u.ns, u.device, u.host, u.device_limit, u.host_limit));
  }
  return out;
}

py::object RadixTree_Quotas(PyRadixTree& t, PyObject* const*) {
  return QuotaList(Locked(t, false, [&] { return t.tree.Quotas(); }));
}

py::object RadixTree_OverQuota(PyRadixTree& t, PyObject* const*) {
  return QuotaList(Locked(t, false, [&] { return t.tree.OverQuota(); }));
}

py::object RadixTree_EvictNamespace(PyRadixTree& t, PyObject* const* a) {
  const uint64_t ns = AsNamespace(a[0]);
  const int64_t n = ToInt64(a[1], "size");
  TensorSink slots;
  Locked(t, n >= kReleaseGilTokens, [&] { t.tree.EvictNamespace(ns, n, slots); });
  return slots.take();
}

py::object RadixTree_EvictHostNamespace(PyRadixTree& t, PyObject* const* a) {
  const uint64_t ns = AsNamespace(a[0]);
  const int64_t n = ToInt64(a[1], "size");
  TensorSink slots;
  Locked(t, false, [&] { t.tree.EvictHostNamespace(ns, n, slots); });
  return slots.take();
}

// --- the storage tier ------------------------------------------------------------------

py::object RadixTree_BeginStorageWrite(PyRadixTree& t, PyObject* const* a) {
  const radixkv::TierCopy from = AsCopy(a[0]);
  TensorSink host, tokens;
  radixkv::TierCopy c;
  uint64_t ns = 0;
  const bool found =
      Locked(t, false, [&] { return t.tree.BeginStorageWrite(from, host, tokens, &c, &ns); });
  if (!found) return py::none();
  return py::make_tuple(CopyTuple(c), host.take(), tokens.take(), ns);
}

py::object RadixTree_StoragePrefixEnd(PyRadixTree& t, PyObject* const* a) {
  const uint64_t ns = AsNamespace(a[1]);
  Int32View ids(a[0], "input_ids");
  FinishViews(ids);
  bool host_backed = false;
  const int64_t end = Locked(
      t.mu, ids.size() >= kReleaseGilTokens,
      [&] { return t.tree.StoragePrefixEnd(ids.data(), ids.size(), &host_backed, ns); },
      [&] { ids.Own(); });
  return py::make_tuple(end, host_backed);
}

py::object RadixTree_PinHost(PyRadixTree& t, PyObject* const* a) {
  const uint64_t ns = AsNamespace(a[1]);
  Int32View ids(a[0], "input_ids");
  FinishViews(ids);
  radixkv::TierCopy pin;
  const bool pinned = Locked(
      t.mu, ids.size() >= kReleaseGilTokens,
      [&] { return t.tree.PinHost(ids.data(), ids.size(), &pin, ns); }, [&] { ids.Own(); });
  return pinned ? CopyTuple(pin) : py::none();
}

py::object RadixTree_UnpinHost(PyRadixTree& t, PyObject* const* a) {
  const radixkv::TierCopy c = AsCopy(a[0]);
  Locked(t, false, [&] { t.tree.UnpinHost(c); });
  return py::none();
}

py::object RadixTree_Claim(PyRadixTree& t, PyObject* const* a) {
  const Handle& h = AsHandle(a[0]);
  const bool host = Truth(a[1], false);
  const int32_t priority = AsPriority(a[2]);
  int64_t added = 0;
  const radixkv::TierCopy c =
      Locked(t, false, [&] { return t.tree.AddClaim(h, host, priority, &added); });
  return py::make_tuple(CopyTuple(c), added);
}

py::object RadixTree_ClaimCost(PyRadixTree& t, PyObject* const* a) {
  const Handle& h = AsHandle(a[0]);
  const bool host = Truth(a[1], false);
  return py::int_(Locked(t, false, [&] { return t.tree.ClaimCost(h, host); }));
}

py::object RadixTree_PrefixClaimCost(PyRadixTree& t, PyObject* const* a) {
  const uint64_t ns = AsNamespace(a[1]);
  const bool host = Truth(a[2], false);
  Int32View ids(a[0], "input_ids");
  FinishViews(ids);
  return py::int_(Locked(
      t.mu, ids.size() >= kReleaseGilTokens,
      [&] { return t.tree.PrefixClaimCost(ids.data(), ids.size(), ns, host); },
      [&] { ids.Own(); }));
}

py::object RadixTree_ReleaseClaim(PyRadixTree& t, PyObject* const* a) {
  const radixkv::TierCopy c = AsCopy(a[0], true);
  return py::int_(Locked(t, false, [&] { return t.tree.ReleaseClaim(c); }));
}

py::object RadixTree_StorageHitLen(PyRadixTree& t, PyObject* const* a) {
  const Handle& h = AsHandle(a[0]);
  return py::int_(Locked(t, false, [&] { return t.tree.StorageHitLen(h); }));
}

py::object RadixTree_LockedBeyondClaims(PyRadixTree& t, PyObject* const*) {
  return py::int_(Locked(t, false, [&] { return t.tree.LockedBeyondClaims(); }));
}

py::object RadixTree_ClaimedPath(PyRadixTree& t, PyObject* const* a) {
  const Handle& h = AsHandle(a[0]);
  const std::vector<uint32_t> ids = Locked(t, false, [&] { return t.tree.ClaimedPath(h); });
  py::list out(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) out[i] = py::int_(ids[i]);
  return out;
}

py::object RadixTree_FinishStorageWrite(PyRadixTree& t, PyObject* const* a) {
  const radixkv::TierCopy c = AsCopy(a[0]);
  Locked(t, false, [&] { t.tree.FinishStorageWrite(c); });
  return py::none();
}

py::object RadixTree_InsertHost(PyRadixTree& t, PyObject* const* a) {
  Int32View ids(a[0], "input_ids");
  const int64_t start = ToInt64(a[1], "start");
  const uint64_t ns = AsNamespace(a[3]);
  Int32View host(a[2], "host_slots");
  FinishViews(ids, host);
  CHECK_VALUE(start >= 0 && start <= ids.size() && host.size() == ids.size() - start,
              "host_slots has length ", host.size(),
              " but must cover input_ids[start:] (start=", start, ", ", ids.size(), " tokens)");
  TensorSink rejected;
  Locked(
      t.mu, ids.size() >= kReleaseGilTokens,
      [&] { t.tree.InsertHost(ids.data(), ids.size(), start, host.data(), rejected, ns); },
      [&] {
        ids.Own();
        host.Own();
      });
  return rejected.take();
}

py::object RadixTree_IsValid(PyRadixTree& t, PyObject* const* a) {
  const Handle& h = AsHandle(a[0]);
  return py::bool_(Locked(t, false, [&] { return t.tree.IsValid(h); }));
}

radixkv::EvictionPolicy ParsePolicy(const std::string& name) {
  radixkv::EvictionPolicy policy;
  if (radixkv::ParseEvictionPolicy(name, &policy)) return policy;
  std::string names;
  for (std::string_view n : radixkv::kEvictionPolicyNames) {
    names += (names.empty() ? "" : ", ") + std::string(n);
  }
  CHECK_VALUE(false, "eviction_policy must be one of ", names, ", got '", name, "'");
}

py::tuple EvictionPolicies() {
  py::tuple names(radixkv::kEvictionPolicyNames.size());
  for (size_t i = 0; i < names.size(); ++i) {
    names[i] = py::str(std::string(radixkv::kEvictionPolicyNames[i]));
  }
  return names;
}

PyObject* RadixTree_New(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"page_size",       "max_slots",     "eviction_policy",
                                "tel_safe_tokens", "aligned_pages", nullptr};
  PyObject* page_size = nullptr;
  PyObject* max_slots = nullptr;
  const char* policy = "lru";
  PyObject* tel_safe = nullptr;
  int aligned = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|OOsOp:RadixTree", const_cast<char**>(names),
                                   &page_size, &max_slots, &policy, &tel_safe, &aligned)) {
    return nullptr;
  }
  try {
    const int64_t p = page_size != nullptr ? ToInt64(page_size, "page_size") : 1;
    const int64_t m = max_slots != nullptr ? ToInt64(max_slots, "max_slots") : RadixTree::kAnySlot;
    const int64_t s = tel_safe != nullptr ? ToInt64(tel_safe, "tel_safe_tokens") : 0;
    return NewBoxed<PyRadixTree>(type, p, m, ParsePolicy(policy), s, aligned != 0)
        .release()
        .ptr();
  } catch (...) {
    radixkv::bindings::SetErrorFromException();
    return nullptr;
  }
}

template <typename F>
PyObject* Getter(PyObject* self, F f) {
  try {
    return f(Unbox<PyRadixTree>(self)).release().ptr();
  } catch (...) {
    radixkv::bindings::SetErrorFromException();
    return nullptr;
  }
}

PyObject* RadixTree_PageSize(PyObject* self, void*) {
  return Getter(self, [](PyRadixTree& t) { return py::int_(t.tree.page_size()); });
}
PyObject* RadixTree_MaxSlots(PyObject* self, void*) {
  return Getter(self, [](PyRadixTree& t) { return py::int_(t.tree.max_slots()); });
}
PyObject* RadixTree_Policy(PyObject* self, void*) {
  return Getter(self, [](PyRadixTree& t) {
    return py::str(std::string(radixkv::EvictionPolicyName(t.tree.policy())));
  });
}
PyObject* RadixTree_HostPins(PyObject* self, void*) {
  return Getter(self, [](PyRadixTree& t) {
    return py::int_(Locked(t, false, [&] { return t.tree.host_pins(); }));
  });
}
PyObject* RadixTree_ClaimedSize(PyObject* self, void*) {
  return Getter(self, [](PyRadixTree& t) {
    return py::int_(Locked(t, false, [&] { return t.tree.claimed_size(); }));
  });
}
PyObject* RadixTree_NumNodes(PyObject* self, void*) {
  return Getter(self, [](PyRadixTree& t) {
    return py::int_(Locked(t, false, [&] { return t.tree.num_nodes(); }));
  });
}

PyObject* Handle_Repr(PyObject* self) {
  const Handle& h = Unbox<Handle>(self);
  if (h.host_hit_len > 0) {
    return PyUnicode_FromFormat(
        "RadixCacheHandle(cached_len=%lld, host_hit_len=%lld, lock_count=%lld)",
        static_cast<long long>(h.cached_len), static_cast<long long>(h.host_hit_len),
        static_cast<long long>(h.lock_count));
  }
  return PyUnicode_FromFormat("RadixCacheHandle(cached_len=%lld, lock_count=%lld)",
                              static_cast<long long>(h.cached_len),
                              static_cast<long long>(h.lock_count));
}

PyRadixTree* AsTree(py::handle tree) {
  if (tree.is_none()) return nullptr;
  CHECK_TYPE(Py_TYPE(tree.ptr()) == g_tree_type,
             "tree must be a radixkv._core.RadixTree or None, got ", Py_TYPE(tree.ptr())->tp_name);
  return &Unbox<PyRadixTree>(tree.ptr());
}

// Runs `f(cached)` with the tree's stored slots (null without a tree),
// holding the tree's mutex, and the GIL: the allocator is guarded by the GIL
// alone (other calls use it without a tree). As in Locked, a thread never
// waits for the mutex holding the GIL; it takes the GIL back once it has the
// mutex, which is safe since no thread waits for the mutex holding the GIL.
template <typename F, typename Own>
auto WithCachedSlots(py::handle tree, bool host, F&& f, Own&& own) {
  PyRadixTree* t = AsTree(tree);
  if (t == nullptr) return f(nullptr);
  std::unique_lock<std::mutex> guard(t->mu, std::try_to_lock);
  if (!guard.owns_lock()) {
    own();
    py::gil_scoped_release nogil;
    guard.lock();
  }
  return f(host ? &t->tree.stored_host_slots() : &t->tree.stored_slots());
}

template <bool P>
py::object PageAllocator_Allocate(radixkv::PageAllocator& a, py::handle num_tokens) {
  TensorSink slots;
  a.Allocate(ToInt64(num_tokens, "num_tokens"), Out<P>(slots));
  return slots.take();
}

void PageAllocator_FreePages(radixkv::PageAllocator& a, py::handle ids, py::handle tree,
                             bool host) {
  Int32View v(ids, "page_ids");
  FinishViews(v);
  WithCachedSlots(
      tree, host, [&](const radixkv::SlotSet* cached) { a.FreePages(v.data(), v.size(), cached); },
      [&] { v.Own(); });
}

void PageAllocator_Free(radixkv::PageAllocator& a, py::handle indices, py::handle tree, bool host) {
  Int32View v(indices, "indices");
  FinishViews(v);
  WithCachedSlots(
      tree, host, [&](const radixkv::SlotSet* cached) { a.Free(v.data(), v.size(), cached); },
      [&] { v.Own(); });
}

void PageAllocator_CheckOwned(radixkv::PageAllocator& a, py::handle indices,
                              const std::string& name, py::handle tree, bool host) {
  Int32View v(indices, name.c_str());
  FinishViews(v);
  WithCachedSlots(
      tree, host,
      [&](const radixkv::SlotSet* cached) {
        a.CheckOwned(v.data(), v.size(), name.c_str(), cached);
      },
      [&] { v.Own(); });
}

void PageAllocator_CheckDisjoint(radixkv::PageAllocator& a, py::handle tree, bool host) {
  WithCachedSlots(
      tree, host,
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

// CRC-32C of a contiguous buffer (bytes, memoryview, numpy array): the file
// backend's page checksum. The buffer is held (exported) while the GIL is
// released, as zlib.crc32 does.
uint32_t Crc32c(py::handle data, uint32_t value) {
  Py_buffer view;
  if (PyObject_GetBuffer(data.ptr(), &view, PyBUF_SIMPLE) != 0) throw py::error_already_set();
  struct Release {
    Py_buffer* v;
    ~Release() { PyBuffer_Release(v); }
  } release{&view};
  const size_t n = static_cast<size_t>(view.len);
  if (n < (64u << 10)) return radixkv::Crc32c(view.buf, n, value);
  py::gil_scoped_release nogil;
  return radixkv::Crc32c(view.buf, n, value);
}

// A contiguous buffer exported for the length of a call (held while the GIL is
// released); `writable` asks for one the call may write.
class Buffer {
 public:
  Buffer(py::handle obj, const char* name, bool writable) {
    if (PyObject_GetBuffer(obj.ptr(), &view_, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) != 0) {
      PyErr_Clear();
      CHECK_TYPE(false, name, " must be a contiguous", writable ? " writable" : "",
                 " buffer (bytes, memoryview, numpy array)");
    }
  }
  ~Buffer() { PyBuffer_Release(&view_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  char* data() const { return static_cast<char*>(view_.buf); }
  int64_t size() const { return view_.len; }

 private:
  Py_buffer view_;
};

radixkv::PageCodecShape CodecShape(int64_t planes, int64_t rows, int64_t heads, int64_t head_dim,
                                   const std::string& dtype, int64_t rest_bytes) {
  CHECK_VALUE(planes >= 1 && rows >= 1 && heads >= 1 && head_dim >= 1 && rest_bytes >= 0,
              "shape: planes, rows, heads and head_dim must be >= 1 and rest_bytes >= 0");
  radixkv::SourceFloat type = dtype == "float32"    ? radixkv::SourceFloat::kFloat32
                              : dtype == "float16"  ? radixkv::SourceFloat::kFloat16
                              : dtype == "bfloat16" ? radixkv::SourceFloat::kBFloat16
                                                    : radixkv::SourceFloat::kNone;
  CHECK_VALUE(type != radixkv::SourceFloat::kNone,
              "dtype must be float32, float16 or bfloat16, got '", dtype, "'");
  const int64_t limit = int64_t{1} << 40;
  CHECK_VALUE(planes <= limit / rows && planes * rows <= limit / heads &&
                  planes * rows * heads <= limit / head_dim && rest_bytes <= limit,
              "shape: a page of more than 2^40 elements");
  return {planes, rows, heads, head_dim, type, rest_bytes};
}

// The float8 page codec (page_codec.h) between two buffers of the sizes the
// shape gives; the GIL is released while it runs.
void CodecPage(py::handle src, py::handle dst, const radixkv::PageCodecShape& shape, bool encode) {
  Buffer in(src, encode ? "page" : "data", false);
  Buffer out(dst, encode ? "out" : "page", true);
  const int64_t raw = radixkv::RawPageBytes(shape), packed = radixkv::Float8PageBytes(shape);
  CHECK_VALUE(in.size() == (encode ? raw : packed), encode ? "page" : "data", " has ", in.size(),
              " bytes, the shape needs ", encode ? raw : packed);
  CHECK_VALUE(out.size() == (encode ? packed : raw), encode ? "out" : "page", " has ", out.size(),
              " bytes, the shape needs ", encode ? packed : raw);
  CHECK_VALUE(out.data() + out.size() <= in.data() || in.data() + in.size() <= out.data(),
              encode ? "out" : "page", " overlaps ", encode ? "page" : "data");
  py::gil_scoped_release nogil;
  if (encode) {
    radixkv::EncodeFloat8Page(in.data(), shape, out.data());
  } else {
    radixkv::DecodeFloat8Page(in.data(), shape, out.data());
  }
}

void EncodeFloat8Page(py::handle page, py::handle out, int64_t planes, int64_t rows, int64_t heads,
                      int64_t head_dim, const std::string& dtype, int64_t rest_bytes) {
  CodecPage(page, out, CodecShape(planes, rows, heads, head_dim, dtype, rest_bytes), true);
}

void DecodeFloat8Page(py::handle data, py::handle page, int64_t planes, int64_t rows, int64_t heads,
                      int64_t head_dim, const std::string& dtype, int64_t rest_bytes) {
  CodecPage(data, page, CodecShape(planes, rows, heads, head_dim, dtype, rest_bytes), false);
}

int64_t Float8PageBytes(int64_t planes, int64_t rows, int64_t heads, int64_t head_dim,
                        const std::string& dtype, int64_t rest_bytes) {
  return radixkv::Float8PageBytes(CodecShape(planes, rows, heads, head_dim, dtype, rest_bytes));
}

// 32-byte keys back to back as a list of hex strings (a store's keys).
py::list HexKeys(const uint8_t* keys, int64_t n) {
  static const char kHex[] = "0123456789abcdef";
  py::list out(n);
  char text[2 * radixkv::kPageKeyBytes];
  for (int64_t p = 0; p < n; ++p) {
    const uint8_t* k = keys + p * radixkv::kPageKeyBytes;
    for (int64_t i = 0; i < radixkv::kPageKeyBytes; ++i) {
      text[2 * i] = kHex[k[i] >> 4];
      text[2 * i + 1] = kHex[k[i] & 15];
    }
    PyObject* str = PyUnicode_FromStringAndSize(text, sizeof(text));
    if (str == nullptr) throw py::error_already_set();
    PyList_SET_ITEM(out.ptr(), p, str);
  }
  return out;
}

// The storage tier's page keys, as hex strings (a store's keys) or raw bytes;
// with `key`, each is then keyed (HMAC-SHA-256 under it).
py::object PageKeys(py::handle input_ids, py::handle page_size, py::handle seed, bool raw,
                    py::handle key) {
  Int32View ids(input_ids, "input_ids");
  const int64_t page = ToInt64(page_size, "page_size");
  CHECK_VALUE(page >= 1, "page_size must be >= 1, got ", page);
  const std::string seed_bytes = Bytes32(seed, "seed"), key_bytes = Bytes32(key, "key");
  FinishViews(ids);
  const int64_t pages = ids.size() / page;
  std::string keys(static_cast<size_t>(pages * radixkv::kPageKeyBytes), '\0');
  auto* out = reinterpret_cast<uint8_t*>(keys.data());
  auto hash = [&] {
    radixkv::PageKeys(ids.data(), ids.size(), page, seed_bytes.empty() ? nullptr : U8(seed_bytes),
                      out);
    if (!key_bytes.empty()) radixkv::KeyPageKeys(out, pages, U8(key_bytes), out);
  };
  if (ids.size() >= kReleaseGilTokens) {
    ids.Own();
    py::gil_scoped_release nogil;
    hash();
  } else {
    hash();
  }
  if (raw) return py::bytes(keys);
  return HexKeys(out, pages);
}

// Page keys made elsewhere (32 bytes each, back to back in a buffer), keyed
// under `key`, as hex strings.
py::list KeyedPageKeys(py::handle raw_keys, py::handle key) {
  const std::string key_bytes = Bytes32(key, "key");
  CHECK_TYPE(!key_bytes.empty(), "key must be 32 bytes");
  Py_buffer view;
  if (PyObject_GetBuffer(raw_keys.ptr(), &view, PyBUF_C_CONTIGUOUS) != 0) {
    throw py::error_already_set();
  }
  std::string keys(static_cast<const char*>(view.buf), static_cast<size_t>(view.len));
  PyBuffer_Release(&view);
  CHECK_VALUE(keys.size() % radixkv::kPageKeyBytes == 0,
              "raw_keys must be 32-byte keys back to back, got ", keys.size(), " bytes");
  const int64_t n = static_cast<int64_t>(keys.size()) / radixkv::kPageKeyBytes;
  auto* data = reinterpret_cast<uint8_t*>(keys.data());
  radixkv::KeyPageKeys(data, n, U8(key_bytes), data);
  return HexKeys(data, n);
}

// HMAC-SHA-256 under `key` of the concatenation of `parts` (buffers: bytes,
// memoryviews, NumPy arrays): the page tags of a store with a secret. The
// buffers are held while the GIL is released.
py::bytes HmacSha256(py::bytes key, py::sequence parts) {
  const std::string k = key;
  std::vector<Py_buffer> views;
  struct Release {
    std::vector<Py_buffer>* v;
    ~Release() {
      for (Py_buffer& b : *v) PyBuffer_Release(&b);
    }
  } release{&views};
  std::vector<radixkv::ByteSpan> spans;
  size_t total = 0;
  views.reserve(py::len(parts));
  for (py::handle part : parts) {
    Py_buffer b;
    if (PyObject_GetBuffer(part.ptr(), &b, PyBUF_C_CONTIGUOUS) != 0) {
      throw py::error_already_set();
    }
    views.push_back(b);
    spans.push_back({b.buf, static_cast<size_t>(b.len)});
    total += static_cast<size_t>(b.len);
  }
  uint8_t out[radixkv::kPageKeyBytes];
  if (total < (64u << 10)) {
    radixkv::HmacSha256(U8(k), k.size(), spans.data(), spans.size(), out);
  } else {
    py::gil_scoped_release nogil;
    radixkv::HmacSha256(U8(k), k.size(), spans.data(), spans.size(), out);
  }
  return py::bytes(reinterpret_cast<const char*>(out), sizeof(out));
}

// A 1-D or N-D buffer of T's (read in C order), borrowed while `view` is
// held; N-D or oddly strided input is copied into `owned`.
template <typename T>
struct PackInput {
  Py_buffer view{};
  bool held = false;
  std::vector<T> owned;
  radixkv::Strided<T> run;
  ~PackInput() {
    if (held) PyBuffer_Release(&view);
  }
};

// Whether a buffer format names a native-order T (uint64 or int32): no byte
// order, native ('@', '='), or the one this machine has ('<' or '>').
template <typename T>
bool NativeFormat(const char* format) {
  std::string f = format ? format : "B";
  const char own = __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__ ? '<' : '>';
  if (!f.empty() && (f[0] == '@' || f[0] == '=' || f[0] == own)) f = f.substr(1);
  if (f.size() != 1) return false;
  if constexpr (std::is_same_v<T, uint64_t>) {
    return f == "Q" || (f == "L" && sizeof(unsigned long) == 8);
  } else {
    return f == "i" || (f == "l" && sizeof(long) == 4);
  }
}

template <typename T>
void ReadPackInput(py::handle obj, const char* name, const char* dtype, PackInput<T>* in) {
  CHECK_TYPE(PyObject_CheckBuffer(obj.ptr()), name, " must be a NumPy array of ", dtype, ", got ",
             Py_TYPE(obj.ptr())->tp_name);
  if (PyObject_GetBuffer(obj.ptr(), &in->view, PyBUF_RECORDS_RO) != 0) {
    throw py::error_already_set();
  }
  in->held = true;
  const Py_buffer& v = in->view;
  CHECK_TYPE(v.itemsize == sizeof(T) && NativeFormat<T>(v.format), name, " must hold ", dtype,
             ", got format '", v.format ? v.format : "B", "'");
  const auto* base = static_cast<const unsigned char*>(v.buf);
  if (v.ndim == 1) {
    in->run = {base, v.shape[0], v.strides[0]};
    return;
  }
  int64_t total = 1;
  for (int d = 0; d < v.ndim; ++d) total *= v.shape[d];
  in->owned.resize(static_cast<size_t>(total));
  std::vector<int64_t> index(static_cast<size_t>(v.ndim), 0);
  for (int64_t i = 0; i < total; ++i) {
    const unsigned char* p = base;
    for (int d = 0; d < v.ndim; ++d) p += index[d] * v.strides[d];
    std::memcpy(&in->owned[static_cast<size_t>(i)], p, sizeof(T));
    for (int d = v.ndim - 1; d >= 0 && ++index[d] == v.shape[d]; --d) index[d] = 0;
  }
  in->run = {reinterpret_cast<const unsigned char*>(in->owned.data()), total, sizeof(T)};
}

std::optional<std::string_view> MediumArg(py::handle medium) {
  if (medium.is_none()) return std::nullopt;
  CHECK_TYPE(PyUnicode_Check(medium.ptr()), "medium must be a str or None, got ",
             Py_TYPE(medium.ptr())->tp_name);
  Py_ssize_t n = 0;
  const char* s = PyUnicode_AsUTF8AndSize(medium.ptr(), &n);
  if (s == nullptr) throw py::error_already_set();
  return std::string_view(s, static_cast<size_t>(n));
}

std::optional<uint64_t> ParentArg(py::handle parent) {
  if (parent.is_none()) return std::nullopt;
  CHECK_TYPE(PyLong_Check(parent.ptr()) && !PyBool_Check(parent.ptr()),
             "parent_block_hash must be an int or None, got ", Py_TYPE(parent.ptr())->tp_name);
  const unsigned long long v = PyLong_AsUnsignedLongLong(parent.ptr());
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    CHECK_VALUE(false, "parent_block_hash must be in [0, 2**64)");
  }
  return static_cast<uint64_t>(v);
}

// One BlockStored event as msgpack (radixkv.events.encode_batch's bytes for it).
py::bytes PackBlockStored(py::handle block_hashes, py::handle parent_block_hash,
                          py::handle token_ids, py::handle block_size, py::handle lora_id,
                          py::handle medium) {
  PackInput<uint64_t> hashes;
  ReadPackInput(block_hashes, "block_hashes", "uint64", &hashes);
  PackInput<int32_t> tokens;
  ReadPackInput(token_ids, "token_ids", "int32", &tokens);
  const std::optional<uint64_t> parent = ParentArg(parent_block_hash);
  const int64_t size = ToInt64(block_size, "block_size");
  std::optional<int64_t> lora;
  if (!lora_id.is_none()) lora = ToInt64(lora_id, "lora_id");
  const auto med = MediumArg(medium);
  std::string out;
  radixkv::PackBlockStored(&out, hashes.run, parent, tokens.run, size, lora, med);
  return py::bytes(out);
}

// One BlockRemoved event as msgpack.
py::bytes PackBlockRemoved(py::handle block_hashes, py::handle medium) {
  PackInput<uint64_t> hashes;
  ReadPackInput(block_hashes, "block_hashes", "uint64", &hashes);
  const auto med = MediumArg(medium);
  std::string out;
  radixkv::PackBlockRemoved(&out, hashes.run, med);
  return py::bytes(out);
}

constexpr const char* kMatchDoc =
    "match_prefix(input_ids, namespace=0, skip_last=False) -> (handle, indices)\n\n"
    "Longest cached prefix of input_ids in whole pages: a handle (cached_len\n"
    "tokens, no locks) and the slot indices stored for them (int32).\n"
    "Refreshes the LRU time of exactly the matched tokens; may split a node.\n"
    "namespace (an int >= 0) is the cache namespace: sequences of different\n"
    "namespaces never share a prefix. With skip_last the last token is left\n"
    "out (a scheduler always computes it): input_ids must hold one.";
constexpr const char* kInsertDoc =
    "insert_prefix(input_ids, indices, priority=0, namespace=0) -> int\n\n"
    "Store the whole pages of input_ids that are not cached yet, with their\n"
    "slot indices; return how many leading tokens were cached already (the\n"
    "caller frees its own copies of those). Raises ValueError, changing\n"
    "nothing, for a negative, out-of-range or repeated slot, one the cache\n"
    "already stores, or a whole page whose slots are not consecutive.";
constexpr const char* kLockDoc =
    "lock_handle(handle, unlock=False)\n\n"
    "Add (or with unlock=True remove) one lock on every node from the\n"
    "handle's node to the root. Locked tokens are never evicted.";
constexpr const char* kEvictDoc =
    "evict(size) -> indices\n\n"
    "Free at least size unlocked tokens, least recently used first, and\n"
    "return their slots in eviction order. Raises OutOfCapacityError,\n"
    "changing nothing, when size exceeds the evictable size.";

constexpr Params kIds{"match_prefix", {"input_ids", "namespace", "skip_last"}, 3, 1};
constexpr Params kBatch{"match_prefix_batch", {"batch", "namespace", "skip_last", "flat"}, 4, 1};
constexpr Params kInsert{"insert_prefix", {"input_ids", "indices", "priority", "namespace"}, 4, 2};
constexpr Params kLock{"lock_handle", {"handle", "unlock"}, 2, 1};
constexpr Params kSize{"evict", {"size"}, 1, 1};
constexpr Params kIsValid{"is_valid", {"handle"}, 1, 1};
constexpr Params kSlotsOfHandle{"handle_slots", {"handle"}, 1, 1};
constexpr Params kReset{"reset", {}, 0, 0};
constexpr Params kSizeInfo{"size_info", {}, 0, 0};
constexpr Params kEvictableSize{"evictable_size", {}, 0, 0};
constexpr Params kProtectedSize{"protected_size", {}, 0, 0};
constexpr Params kCheck{"check_integrity", {}, 0, 0};
constexpr Params kDump{"dump", {"tiers", "namespaces"}, 2, 0};
constexpr Params kTierSizes{"tier_sizes", {}, 0, 0};
constexpr Params kEvictHost{"evict_host", {"size"}, 1, 1};
constexpr Params kFindBackup{
    "find_backup", {"input_ids", "min_hits", "through_partial", "namespace"}, 4, 1};
constexpr Params kBeginBackup{"begin_backup", {"copy"}, 1, 1};
constexpr Params kStartBackup{
    "start_backup", {"input_ids", "host_pages", "min_hits", "through_partial", "namespace"}, 5, 2};
constexpr Params kFinishBackup{"finish_backup", {"copy", "host_slots", "ok", "host_pages"}, 4, 2};
constexpr Params kFinishRequest{
    "finish_request",
    {"old_handle", "input_ids", "indices", "pages", "priority", "ledger", "seed"},
    7,
    4};
constexpr Params kCacheRequest{
    "cache_request",
    {"old_handle", "input_ids", "indices", "pages", "priority", "ledger", "seed"},
    7,
    4};
constexpr Params kFinishRequests{"finish_requests", {"batch", "pages", "priority"}, 3, 2};
constexpr Params kFinishRequestsFlat{
    "finish_requests_flat", {"handles", "input_ids", "indices", "pages", "priority", "own"}, 6, 4};
constexpr Params kStartLoad{"start_load", {"handle", "device_pages"}, 2, 2};
constexpr Params kFindLoad{"find_load", {"handle"}, 1, 1};
constexpr Params kBeginLoad{"begin_load", {"copy"}, 1, 1};
constexpr Params kFinishLoad{"finish_load", {"copy", "device_slots", "ok"}, 3, 2};
constexpr Params kCandidates{"eviction_candidates_without_host", {"size", "namespace"}, 2, 1};
constexpr Params kSetQuota{"set_quota", {"namespace", "device", "host"}, 3, 3};
constexpr Params kCopyNamespace{"copy_namespace", {"copy"}, 1, 1};
constexpr Params kQuotas{"quotas", {}, 0, 0};
constexpr Params kOverQuota{"over_quota", {}, 0, 0};
constexpr Params kEvictNamespace{"evict_namespace", {"namespace", "size"}, 2, 2};
constexpr Params kEvictHostNamespace{"evict_host_namespace", {"namespace", "size"}, 2, 2};
constexpr Params kBeginStorageWrite{"begin_storage_write", {"copy"}, 1, 1};
constexpr Params kFinishStorageWrite{"finish_storage_write", {"copy"}, 1, 1};
constexpr Params kPinHost{"pin_host", {"input_ids", "namespace"}, 2, 1};
constexpr Params kUnpinHost{"unpin_host", {"pin"}, 1, 1};
constexpr Params kClaim{"claim", {"handle", "host", "priority"}, 3, 1};
constexpr Params kClaimCost{"claim_cost", {"handle", "host"}, 2, 1};
constexpr Params kPrefixClaimCost{"prefix_claim_cost", {"input_ids", "namespace", "host"}, 3, 1};
constexpr Params kReleaseClaim{"release_claim", {"claim"}, 1, 1};
constexpr Params kClaimedPath{"claimed_path", {"handle"}, 1, 1};
constexpr Params kLockedBeyondClaims{"locked_beyond_claims", {}, 0, 0};
constexpr Params kStorageHitLen{"storage_hit_len", {"handle"}, 1, 1};
constexpr Params kStoragePrefixEnd{"storage_prefix_end", {"input_ids", "namespace"}, 2, 1};
constexpr Params kInsertHost{
    "insert_host", {"input_ids", "start", "host_slots", "namespace"}, 4, 3};

// The page forms: the same calls with page ids where the slot forms take or
// give slots (page p: slots p * page_size + [0, page_size)).
constexpr Params kMatchPages{"match_pages", {"input_ids", "namespace", "skip_last"}, 3, 1};
constexpr Params kEvictPages{"evict_pages", {"size"}, 1, 1};
constexpr Params kEvictHostPages{"evict_host_pages", {"size"}, 1, 1};
constexpr Params kHandlePages{"handle_pages", {"handle"}, 1, 1};
constexpr Params kStartBackupPages{
    "start_backup_pages",
    {"input_ids", "host_pages", "min_hits", "through_partial", "namespace"},
    5,
    2};
constexpr Params kFinishBackupPages{
    "finish_backup_pages", {"copy", "host_page_ids", "ok", "host_pages"}, 4, 2};
constexpr Params kFinishRequestPages{
    "finish_request_pages",
    {"old_handle", "input_ids", "page_ids", "pages", "priority", "ledger", "seed"},
    7,
    4};
constexpr Params kCacheRequestPages{
    "cache_request_pages",
    {"old_handle", "input_ids", "page_ids", "pages", "priority", "ledger", "seed"},
    7,
    4};
constexpr Params kFinishRequestsPages{
    "finish_requests_pages", {"batch", "pages", "priority"}, 3, 2};
constexpr Params kFinishRequestsFlatPages{
    "finish_requests_flat_pages", {"handles", "input_ids", "page_ids", "pages", "priority", "own"},
    6, 4};
constexpr Params kStartLoadPages{"start_load_pages", {"handle", "device_pages"}, 2, 2};
constexpr Params kFinishLoadPages{"finish_load_pages", {"copy", "device_page_ids", "ok"}, 3, 2};
constexpr Params kBeginLoadPages{"begin_load_pages", {"copy"}, 1, 1};

template <py::object (*Impl)(PyRadixTree&, PyObject* const*), const Params& P>
constexpr PyCFunction Fast() {
  return reinterpret_cast<PyCFunction>(
      reinterpret_cast<void (*)()>(&FastMethod<PyRadixTree, Impl, P>));
}
constexpr int kFastCall = METH_FASTCALL | METH_KEYWORDS;

PyMethodDef kTreeMethods[] = {
    {"match_prefix", Fast<RadixTree_MatchPrefix<false>, kIds>(), kFastCall, kMatchDoc},
    {"match_prefix_batch", Fast<RadixTree_MatchPrefixBatch, kBatch>(), kFastCall,
     "match_prefix_batch(batch, namespace=0, skip_last=False, flat=False)\n"
     "    -> [(handle, indices), ...] | ([handle, ...], indices):\n"
     "match_prefix of each input in order, in one call (inputs are all checked before any\n"
     "is matched); namespace is one int for all or a sequence with one per input. With\n"
     "skip_last each input is matched without its last token (each must have one). With\n"
     "flat the handles come in one list and the indices in one tensor, each match's\n"
     "(handle.cached_len of them) after those of the matches before it."},
    {"insert_prefix", Fast<RadixTree_InsertPrefix, kInsert>(), kFastCall, kInsertDoc},
    {"lock_handle", Fast<RadixTree_LockHandle, kLock>(), kFastCall, kLockDoc},
    {"evict", Fast<RadixTree_Evict<false>, kSize>(), kFastCall, kEvictDoc},
    {"reset", Fast<RadixTree_Reset, kReset>(), kFastCall, "Drop every node."},
    {"size_info", Fast<RadixTree_SizeInfo, kSizeInfo>(), kFastCall,
     "(evictable, protected) tokens."},
    {"evictable_size", Fast<RadixTree_EvictableSize, kEvictableSize>(), kFastCall,
     "Device tokens eviction may free (size_info's first)."},
    {"protected_size", Fast<RadixTree_ProtectedSize, kProtectedSize>(), kFastCall,
     "Device tokens locked against eviction (size_info's second)."},
    {"check_integrity", Fast<RadixTree_CheckIntegrity, kCheck>(), kFastCall,
     "Walk the tree and raise IntegrityError on a broken invariant."},
    {"dump", Fast<RadixTree_Dump, kDump>(), kFastCall,
     "dump(tiers=False, namespaces=False) -> every node as a DumpRow (parent, tokens,\n"
     "device_slots, ref_count, timestamp); with tiers=True a TierDumpRow (parent, tokens,\n"
     "device_slots, host_slots, ref_count, timestamp); namespaces=True appends each node's\n"
     "namespace (DumpRowNs, TierDumpRowNs). Siblings in ascending token order (then\n"
     "namespace)."},
    {"tier_sizes", Fast<RadixTree_TierSizes, kTierSizes>(), kFastCall,
     "tier_sizes() -> TierSizes (device_evictable, device_protected, host, host_only,\n"
     "backing_up, loading, storage_writing), in tokens."},
    {"evict_host", Fast<RadixTree_EvictHost<false>, kEvictHost>(), kFastCall,
     "evict_host(size) -> host slots freed, least recently used host copies first."},
    {"find_backup", Fast<RadixTree_FindBackup, kFindBackup>(), kFastCall,
     "find_backup(input_ids, min_hits=0, through_partial=False, namespace=0) -> TierCopy\n"
     "or None: what a backup of the path needs (through_partial: the node the ids end inside,\n"
     "whole)."},
    {"begin_backup", Fast<RadixTree_BeginBackup, kBeginBackup>(), kFastCall,
     "begin_backup(copy) -> device slots: pins the nodes until finish_backup."},
    {"start_backup", Fast<RadixTree_StartBackup<false>, kStartBackup>(), kFastCall,
     "start_backup(input_ids, host_pages, min_hits=0, through_partial=False, namespace=0) ->\n"
     "None, or (copy, device_slots, host_slots): find_backup, then, when host_pages (a\n"
     "PageAllocator) has the pages, takes them and begin_backup. The slots are None when it\n"
     "has not (nothing begun)."},
    {"finish_backup", Fast<RadixTree_FinishBackup<false>, kFinishBackup>(), kFastCall,
     "finish_backup(copy, host_slots, ok=True, host_pages=None) -> host slots not taken\n"
     "(given host_pages, also freed there). With ok, ValueError unless each page of\n"
     "host_slots is page_size consecutive slots."},
    {"finish_request", Fast<RadixTree_FinishRequest<false>, kFinishRequest>(), kFastCall,
     "finish_request(old_handle, input_ids, indices, pages, priority=0, ledger=None,\n"
     "seed=None) -> int\n\n"
     "The end of a request in one call: checks that indices cover input_ids in whole pages,\n"
     "that old_handle is live and locked and indices[:cached_len] are its slots, and that\n"
     "the rest are pages `pages` (the device pool's PageAllocator) handed out, none cached;\n"
     "then caches the whole pages (insert_prefix in the handle's namespace), frees into\n"
     "`pages` the request's copies of tokens cached meanwhile and its partial last page,\n"
     "and unlocks old_handle. Returns insert_prefix's count. Raises ValueError or\n"
     "TypeError naming the argument, changing nothing. With `ledger` (a BlockLedger covering\n"
     "the pool), the BlockStored of the whole pages it cached, the chain seeded with `seed`\n"
     "(32 bytes or None)."},
    {"cache_request", Fast<RadixTree_CacheRequest<false>, kCacheRequest>(), kFastCall,
     "cache_request(old_handle, input_ids, indices, pages, priority=0, ledger=None,\n"
     "seed=None) -> (new_handle, indices, in_cache)\n\n"
     "finish_request for a request that goes on (a chunk of a chunked prefill): the same\n"
     "checks and insert, then match_prefix of input_ids gives new_handle (locked;\n"
     "old_handle is unlocked), the request's copies of tokens it now covers go back to\n"
     "`pages`, and indices are the slots it goes on with: the cache's for the matched\n"
     "part, then its own. Raises, changing nothing, on bad input. `ledger` and `seed`: as\n"
     "finish_request's."},
    {"finish_requests", Fast<RadixTree_FinishRequests<false>, kFinishRequests>(), kFastCall,
     "finish_requests(batch, pages, priority=0) -> [int, ...]\n\n"
     "finish_request of each (old_handle, input_ids, indices) of batch, in order, in one\n"
     "call. priority is one int for all or a sequence with one per request. Every request\n"
     "is checked first, and together (no page in two requests, no handle unlocked more\n"
     "often than it is locked, no load from host in flight): a failed check changes nothing."},
    {"finish_requests_flat", Fast<RadixTree_FinishRequestsFlat<false>, kFinishRequestsFlat>(),
     kFastCall,
     "finish_requests_flat(handles, input_ids, indices, pages, priority=0, own=None)\n"
     "    -> [int, ...]\n\n"
     "finish_requests with the requests' slots in one tensor: request i holds handles[i]\n"
     "and input_ids[i], and its slots are the next ceil(len(input_ids[i]) / page_size)\n"
     "pages of indices (which must hold exactly all of them). With own, indices holds each\n"
     "request's cached part only (handles[i].cached_len slots, as match_prefix_batch with\n"
     "flat returns them) and own the rest (its own whole pages). Errors name request i as\n"
     "request[i], its slots by their position in its own slots."},
    {"start_load", Fast<RadixTree_StartLoad<false>, kStartLoad>(), kFastCall,
     "start_load(handle, device_pages) -> None | (copy, None, None, None)\n"
     "    | (copy, loaded, host_slots, indices)\n\n"
     "find_load, then, when device_pages (the device pool's PageAllocator) has the pages,\n"
     "begin_load and the pages in one call: None when no host part is left to load (lock\n"
     "the handle's device part); (copy, None, None, None) when too few pages are free\n"
     "(nothing changed: make room and call again); else the locked handle for the whole\n"
     "match, the copy's host slots, and the slots the request goes on with: the device\n"
     "part's, then from copy.start the new pages the copy fills. Raises as find_load and\n"
     "begin_load, changing nothing."},
    {"find_load", Fast<RadixTree_FindLoad, kFindLoad>(), kFastCall,
     "find_load(handle) -> TierCopy: the host-only part of the handle's match."},
    {"begin_load", Fast<RadixTree_BeginLoad<false>, kBeginLoad>(), kFastCall,
     "begin_load(copy) -> (locked handle for the whole match, host slots, device slots of\n"
     "the path above the copy)."},
    {"finish_load", Fast<RadixTree_FinishLoad<false>, kFinishLoad>(), kFastCall,
     "finish_load(copy, device_slots, ok=True) -> False if the copy's node is gone. With ok,\n"
     "ValueError unless each page of device_slots is page_size consecutive slots."},
    {"eviction_candidates_without_host",
     Fast<RadixTree_EvictionCandidatesWithoutHost, kCandidates>(), kFastCall,
     "The device leaves evict(size) would take that have no host copy, as backups (with\n"
     "namespace, those evict_namespace(namespace, size) would take)."},
    {"copy_namespace", Fast<RadixTree_CopyNamespace, kCopyNamespace>(), kFastCall,
     "copy_namespace(copy) -> the namespace of the copy's node, or None when it is gone."},
    {"set_quota", Fast<RadixTree_SetQuota, kSetQuota>(), kFastCall,
     "set_quota(namespace, device, host): limits in tokens on each tier (None: no limit;\n"
     "both None removes the quota). The tree counts the namespace's tokens per tier."},
    {"quotas", Fast<RadixTree_Quotas, kQuotas>(), kFastCall,
     "quotas() -> [(namespace, device, host, device_limit, host_limit)] (-1: no limit)."},
    {"over_quota", Fast<RadixTree_OverQuota, kOverQuota>(), kFastCall,
     "over_quota() -> [(namespace, device excess, host excess, device_limit, host_limit)]."},
    {"evict_namespace", Fast<RadixTree_EvictNamespace, kEvictNamespace>(), kFastCall,
     "evict_namespace(namespace, size) -> device slots freed: the namespace's least recently\n"
     "used unlocked leaves, until size or none is left (ValueError without a quota)."},
    {"evict_host_namespace", Fast<RadixTree_EvictHostNamespace, kEvictHostNamespace>(), kFastCall,
     "evict_host_namespace(namespace, size) -> host slots freed, as evict_namespace."},
    {"begin_storage_write", Fast<RadixTree_BeginStorageWrite, kBeginStorageWrite>(), kFastCall,
     "begin_storage_write(backup) -> (copy, host slots, path tokens, namespace) or None: pins on\n"
     "host what a finished backup gave a host copy, while its pages are written to storage."},
    {"storage_prefix_end", Fast<RadixTree_StoragePrefixEnd, kStoragePrefixEnd>(), kFastCall,
     "storage_prefix_end(input_ids, namespace=0) -> (where pages from storage would join\n"
     "the path: its match in whole pages, whether the match ends at the root or on a host\n"
     "copy)."},
    {"pin_host", Fast<RadixTree_PinHost, kPinHost>(), kFastCall,
     "pin_host(input_ids, namespace=0) -> pin (a TierCopy) or None: keeps the host copy\n"
     "where the match ends until unpin_host(pin); pin.start is the matched length. None at\n"
     "the root or without a host copy."},
    {"unpin_host", Fast<RadixTree_UnpinHost, kUnpinHost>(), kFastCall,
     "unpin_host(pin): releases a pin of pin_host."},
    {"claim", Fast<RadixTree_Claim, kClaim>(), kFastCall,
     "claim(handle, host=False, priority=0) -> (claim (a TierCopy), tokens newly claimed):\n"
     "keeps the path of handle's match on the device (its device part, locked) or, with\n"
     "host, at least in host memory (the whole match; claim.start is -1), until\n"
     "release_claim(claim)."},
    {"claim_cost", Fast<RadixTree_ClaimCost, kClaimCost>(), kFastCall,
     "claim_cost(handle, host=False) -> the tokens claim would add to claimed_size."},
    {"prefix_claim_cost", Fast<RadixTree_PrefixClaimCost, kPrefixClaimCost>(), kFastCall,
     "prefix_claim_cost(input_ids, namespace=0, host=False) -> the tokens a claim of\n"
     "match_prefix(input_ids, namespace)'s handle would add to claimed_size, found without\n"
     "matching: no LRU time, hit count or split changes."},
    {"release_claim", Fast<RadixTree_ReleaseClaim, kReleaseClaim>(), kFastCall,
     "release_claim(claim) -> the tokens no claim holds any more."},
    {"storage_hit_len", Fast<RadixTree_StorageHitLen, kStorageHitLen>(), kFastCall,
     "storage_hit_len(handle) -> of the match's host part, the tokens read from storage and\n"
     "not on the device since (the storage tier's hits)."},
    {"locked_beyond_claims", Fast<RadixTree_LockedBeyondClaims, kLockedBeyondClaims>(), kFastCall,
     "locked_beyond_claims() -> device tokens a lock other than a claim's holds (O(nodes))."},
    {"claimed_path", Fast<RadixTree_ClaimedPath, kClaimedPath>(), kFastCall,
     "claimed_path(handle) -> ids of the claimed nodes on the match's path, deepest first."},
    {"finish_storage_write", Fast<RadixTree_FinishStorageWrite, kFinishStorageWrite>(), kFastCall,
     "finish_storage_write(copy): the write to storage is over; unpins."},
    {"insert_host", Fast<RadixTree_InsertHost, kInsertHost>(), kFastCall,
     "insert_host(input_ids, start, host_slots, namespace=0) -> host slots not taken: pages\n"
     "read from storage (input_ids[start:]) as host-only nodes under the path's host copy.\n"
     "ValueError unless each page of host_slots is page_size consecutive slots."},
    {"is_valid", Fast<RadixTree_IsValid, kIsValid>(), kFastCall,
     "Whether handle names a live node of this tree."},
    {"handle_slots", Fast<RadixTree_HandleSlots<false>, kSlotsOfHandle>(), kFastCall,
     "The slots of the handle's prefix."},
    // The page forms: page ids (int32, one per page) where the calls above
    // take or give slots; checks, effects and token counts as theirs.
    {"match_pages", Fast<RadixTree_MatchPrefix<true>, kMatchPages>(), kFastCall,
     "match_pages(input_ids, namespace=0, skip_last=False) -> (handle, page_ids)\n\n"
     "match_prefix, returning the device pages of the match (cached_len / page_size)."},
    {"handle_pages", Fast<RadixTree_HandleSlots<true>, kHandlePages>(), kFastCall,
     "The page ids of the handle's prefix."},
    {"begin_load_pages", Fast<RadixTree_BeginLoad<true>, kBeginLoadPages>(), kFastCall,
     "begin_load_pages(copy) -> begin_load, with host and device page ids for slots."},
    {"evict_pages", Fast<RadixTree_Evict<true>, kEvictPages>(), kFastCall,
     "evict_pages(size) -> page_ids: evict, returning the freed pages."},
    {"evict_host_pages", Fast<RadixTree_EvictHost<true>, kEvictHostPages>(), kFastCall,
     "evict_host_pages(size) -> host page_ids: evict_host, returning the freed host pages."},
    {"start_backup_pages", Fast<RadixTree_StartBackup<true>, kStartBackupPages>(), kFastCall,
     "start_backup_pages(input_ids, host_pages, min_hits=0, through_partial=False,\n"
     "namespace=0) -> None or (copy, device_page_ids, host_page_ids): start_backup in pages."},
    {"finish_backup_pages", Fast<RadixTree_FinishBackup<true>, kFinishBackupPages>(), kFastCall,
     "finish_backup_pages(copy, host_page_ids, ok=True, host_pages=None) -> rejected page_ids:\n"
     "finish_backup in pages."},
    {"finish_request_pages", Fast<RadixTree_FinishRequest<true>, kFinishRequestPages>(),
     kFastCall,
     "finish_request_pages(old_handle, input_ids, page_ids, pages, priority=0, ledger=None,\n"
     "seed=None) -> int\n\n"
     "finish_request with the request's pages: its match's, then its own (ceil(len(input_ids)\n"
     "/ page_size) in all). With `ledger` (a BlockLedger of the device pool), the BlockStored\n"
     "of the whole pages it cached, the chain seeded with `seed` (32 bytes or None)."},
    {"cache_request_pages", Fast<RadixTree_CacheRequest<true>, kCacheRequestPages>(), kFastCall,
     "cache_request_pages(old_handle, input_ids, page_ids, pages, priority=0, ledger=None,\n"
     "seed=None) -> (handle, page_ids, in_cache): cache_request in pages."},
    {"finish_requests_pages", Fast<RadixTree_FinishRequests<true>, kFinishRequestsPages>(),
     kFastCall,
     "finish_requests_pages(batch, pages, priority=0) -> [int, ...]\n\n"
     "finish_requests of (old_handle, input_ids, page_ids) tuples: finish_request_pages."},
    {"finish_requests_flat_pages",
     Fast<RadixTree_FinishRequestsFlat<true>, kFinishRequestsFlatPages>(), kFastCall,
     "finish_requests_flat_pages(handles, input_ids, page_ids, pages, priority=0, own=None)\n"
     "    -> [int, ...]\n\n"
     "finish_requests_flat in pages: request i's are the next ceil(len(input_ids[i]) /\n"
     "page_size) page ids; with own, page_ids holds each request's cached part\n"
     "(handles[i].cached_len // page_size ids) and own the rest."},
    {"start_load_pages", Fast<RadixTree_StartLoad<true>, kStartLoadPages>(), kFastCall,
     "start_load_pages(handle, device_pages) -> None or (copy, loaded, host_page_ids,\n"
     "page_ids): start_load in pages."},
    {"finish_load_pages", Fast<RadixTree_FinishLoad<true>, kFinishLoadPages>(), kFastCall,
     "finish_load_pages(copy, device_page_ids, ok=True) -> bool: finish_load in pages."},
    {nullptr, nullptr, 0, nullptr},
};

PyGetSetDef kTreeProperties[] = {
    {"page_size", RadixTree_PageSize, nullptr, "Tokens per page.", nullptr},
    {"max_slots", RadixTree_MaxSlots, nullptr, "Slots must be below this (-1: any).", nullptr},
    {"num_nodes", RadixTree_NumNodes, nullptr, "Nodes, the root excluded.", nullptr},
    {"host_pins", RadixTree_HostPins, nullptr, "Pins of pin_host not yet released.", nullptr},
    {"claimed_size", RadixTree_ClaimedSize, nullptr, "Tokens that at least one claim holds.",
     nullptr},
    {"eviction_policy", RadixTree_Policy, nullptr, "Which leaf goes first.", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyType_Slot kTreeSlots[] = {
    {Py_tp_new, reinterpret_cast<void*>(RadixTree_New)},
    {Py_tp_dealloc, reinterpret_cast<void*>(radixkv::bindings::DeallocBoxed<PyRadixTree>)},
    {Py_tp_methods, kTreeMethods},
    {Py_tp_getset, kTreeProperties},
    {Py_tp_doc, const_cast<char*>("RadixTree(page_size=1, max_slots=-1, eviction_policy='lru', "
                                  "tel_safe_tokens=0, aligned_pages=False): "
                                  "the native radix tree "
                                  "and the mutex that keeps one thread at a time in it.")},
    {0, nullptr},
};
PyType_Spec kTreeSpec{"radixkv._core.RadixTree", sizeof(Boxed<PyRadixTree>), 0, Py_TPFLAGS_DEFAULT,
                      kTreeSlots};

constexpr Py_ssize_t kHandleAt = offsetof(Boxed<Handle>, value);
PyMemberDef kHandleMembers[] = {
    {"cached_len", T_LONGLONG, kHandleAt + offsetof(Handle, cached_len), READONLY,
     "Tokens from the root to the handle's node: the matched length."},
    {"lock_count", T_LONGLONG, kHandleAt + offsetof(Handle, lock_count), READONLY,
     "Locks taken through this handle and not yet released."},
    {"host_hit_len", T_LONGLONG, kHandleAt + offsetof(Handle, host_hit_len), READONLY,
     "Matched tokens after cached_len that only host memory holds (load_back brings them)."},
    {"namespace", T_ULONGLONG, kHandleAt + offsetof(Handle, ns), READONLY,
     "The namespace the match was made in."},
    {nullptr, 0, 0, 0, nullptr},
};
PyType_Slot kHandleSlots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(radixkv::bindings::DeallocBoxed<Handle>)},
    {Py_tp_members, kHandleMembers},
    {Py_tp_repr, reinterpret_cast<void*>(Handle_Repr)},
    {Py_tp_doc, const_cast<char*>("The result of a match: names the matched prefix.")},
    {0, nullptr},
};
PyType_Spec kHandleSpec{"radixkv._core.RadixCacheHandle", sizeof(Boxed<Handle>), 0,
                        Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION, kHandleSlots};

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "radixkv native core (private; use the radixkv package)";
  radixkv::bindings::RegisterErrors(m);
  radixkv::bindings::RegisterKernels(m);
  radixkv::bindings::RegisterController(m);
  radixkv::bindings::RegisterBlockLedger(m);
  radixkv::bindings::RegisterSignalShield(m);
  m.attr("EVICTION_POLICIES") = EvictionPolicies();
  m.def("first_mismatch", &Kernel_FirstMismatch, py::arg("a"), py::arg("b"));
  m.def("int32_tensor", &Int32Tensor, py::arg("values"), py::arg("name") = "values");
  m.def("encode_float8_page", &EncodeFloat8Page, py::arg("page"), py::arg("out"), py::arg("planes"),
        py::arg("rows"), py::arg("heads"), py::arg("head_dim"), py::arg("dtype"),
        py::arg("rest_bytes") = 0,
        "encode_float8_page(page, out, planes, rows, heads, head_dim, dtype, rest_bytes=0) -> "
        "None. A host page as float8 e4m3fn with a float32 scale per (plane, head).");
  m.def("decode_float8_page", &DecodeFloat8Page, py::arg("data"), py::arg("page"),
        py::arg("planes"), py::arg("rows"), py::arg("heads"), py::arg("head_dim"), py::arg("dtype"),
        py::arg("rest_bytes") = 0,
        "decode_float8_page(data, page, planes, rows, heads, head_dim, dtype, rest_bytes=0) -> "
        "None. An encoded page back into a host page of `dtype`.");
  m.def("float8_page_bytes", &Float8PageBytes, py::arg("planes"), py::arg("rows"), py::arg("heads"),
        py::arg("head_dim"), py::arg("dtype"), py::arg("rest_bytes") = 0,
        "float8_page_bytes(planes, rows, heads, head_dim, dtype, rest_bytes=0) -> int");
  m.def("crc32c", &Crc32c, py::arg("data"), py::arg("value") = 0,
        "crc32c(data, value=0) -> CRC-32C of a contiguous buffer, continuing from value.");
  m.def("page_keys", &PageKeys, py::arg("input_ids"), py::arg("page_size"),
        py::arg("seed") = py::none(), py::arg("raw") = false, py::arg("key") = py::none(),
        "page_keys(input_ids, page_size, seed=None, raw=False, key=None) -> list of hex keys\n"
        "(or the raw 32-byte keys back to back): the SHA-256 chain over the whole pages of\n"
        "input_ids, seeded with `seed` (32 bytes) or, without one, SGLang's page hash;\n"
        "with `key` (32 bytes) each is keyed: HMAC-SHA-256(key, chain key).");
  m.def("keyed_page_keys", &KeyedPageKeys, py::arg("raw_keys"), py::arg("key"),
        "keyed_page_keys(raw_keys, key) -> hex of HMAC-SHA-256(key, k) for each 32-byte k.");
  m.def("hmac_sha256", &HmacSha256, py::arg("key"), py::arg("parts"),
        "hmac_sha256(key, parts) -> HMAC-SHA-256 under key of the buffers in parts, joined.");
  m.def("pack_block_stored", &PackBlockStored, py::arg("block_hashes"),
        py::arg("parent_block_hash"), py::arg("token_ids"), py::arg("block_size"),
        py::arg("lora_id"), py::arg("medium"),
        "pack_block_stored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, "
        "medium) -> the msgpack of one BlockStored event (uint64 and int32 arrays).");
  m.def("pack_block_removed", &PackBlockRemoved, py::arg("block_hashes"), py::arg("medium"),
        "pack_block_removed(block_hashes, medium) -> the msgpack of one BlockRemoved event.");
  m.def("check_ids", &CheckIds, py::arg("values"), py::arg("name"));
  m.def("check_slots", &CheckSlots, py::arg("values"), py::arg("name"), py::arg("limit") = -1);

  g_handle_type = radixkv::bindings::AddType(m, &kHandleSpec);
  g_tree_type = radixkv::bindings::AddType(m, &kTreeSpec);
  g_tier_copy_type = AddStructType(m, &kTierCopyDesc);
  g_tier_sizes_type = AddStructType(m, &kTierSizesDesc);
  for (int i = 0; i < 4; ++i) g_dump_row_types[i] = AddStructType(m, &kDumpRowDescs[i]);

  py::class_<radixkv::PageAllocator>(m, "PageAllocator")
      .def(py::init<int64_t, int64_t>(), py::arg("num_pages"), py::arg("page_size") = 1)
      .def_property_readonly("num_pages", &radixkv::PageAllocator::num_pages)
      .def_property_readonly("page_size", &radixkv::PageAllocator::page_size)
      .def_property_readonly("num_free_pages", &radixkv::PageAllocator::num_free_pages)
      .def("allocate", &PageAllocator_Allocate<false>, py::arg("num_tokens"))
      .def("allocate_pages", &PageAllocator_Allocate<true>, py::arg("num_tokens"))
      .def("free_pages", &PageAllocator_FreePages, py::arg("page_ids"),
           py::arg("tree") = py::none(), py::arg("host") = false)
      .def("free", &PageAllocator_Free, py::arg("indices"), py::arg("tree") = py::none(),
           py::arg("host") = false)
      .def("check_owned", &PageAllocator_CheckOwned, py::arg("indices"), py::arg("name"),
           py::arg("tree") = py::none(), py::arg("host") = false)
      .def("check_disjoint", &PageAllocator_CheckDisjoint, py::arg("tree") = py::none(),
           py::arg("host") = false);
}
