#include "block_ledger.h"

#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "errors.h"
#include "radixkv/block_ledger.h"
#include "tensor_view.h"

namespace py = pybind11;

namespace radixkv::bindings {
namespace {

using radixkv::BlockLedger;

// A seed: 32 bytes, or None (the unseeded chain: null).
const uint8_t* SeedArg(const std::string& bytes) { return bytes.empty() ? nullptr : U8(bytes); }

void CheckSameLength(const Int32View& a, const Int32View& b, const char* a_name,
                     const char* b_name) {
  CHECK_VALUE(a.size() == b.size(), a_name, " and ", b_name, " must have the same length, got ",
              a.size(), " and ", b.size());
}

// With `page_ids` the slot arguments hold page ids (one a page); counts in
// slots are their length times the page size.
void DeviceInserted(BlockLedger& l, py::handle tokens, py::handle slots, int64_t start, int64_t end,
                    int64_t known, py::handle seed, bool page_ids) {
  Int32View t(tokens, "tokens"), s(slots, "slots");
  const std::string seed_bytes = Bytes32(seed, "seed");
  FinishViews(t, s);
  const int64_t covered = page_ids ? s.size() * l.page_size() : s.size();
  CHECK_VALUE(end >= 0 && end <= t.size() && end <= covered, "end (", end,
              ") must be in [0, min(len(tokens), the slots' tokens)] = [0, ",
              std::min(t.size(), covered), "]");
  l.DeviceInserted(t.data(), s.data(), start, end, known, SeedArg(seed_bytes), page_ids);
}

}  // namespace

InsertAnnouncer::InsertAnnouncer(PyObject* ledger, PyObject* seed, int64_t pool_pages,
                                 int64_t page_size) {
  seed_ = Bytes32(seed == nullptr ? py::handle(Py_None) : py::handle(seed), "seed");
  if (ledger == nullptr || ledger == Py_None) return;
  const py::handle l(ledger);
  CHECK_TYPE(py::isinstance<BlockLedger>(l), "ledger must be a BlockLedger or None, got ",
             Py_TYPE(ledger)->tp_name);
  BlockLedger& led = l.cast<BlockLedger&>();
  CHECK_VALUE(led.page_size() == page_size && led.device_pages() >= pool_pages,
              "ledger holds ", led.device_pages(), " device pages of ", led.page_size(),
              " tokens; the pool has ", pool_pages, " pages of ", page_size);
  ledger_ = &led;
}

void InsertAnnouncer::Inserted(const int32_t* tokens, const int32_t* pages, int64_t start,
                               int64_t end, int64_t known, bool page_ids) const {
  if (ledger_ != nullptr && start < end) {
    ledger_->DeviceInserted(tokens, pages, start, end, known, SeedArg(seed_), page_ids);
  }
}

namespace {

void DeviceEvicted(BlockLedger& l, py::handle slots, bool page_ids) {
  Int32View s(slots, "slots");
  FinishViews(s);
  l.DeviceEvicted(s.data(), page_ids ? s.size() * l.page_size() : s.size(), page_ids);
}

void DeviceLoaded(BlockLedger& l, py::handle host_slots, py::handle device_slots, bool page_ids) {
  Int32View h(host_slots, "host_slots"), d(device_slots, "device_slots");
  FinishViews(h, d);
  CheckSameLength(h, d, "host_slots", "device_slots");
  l.DeviceLoaded(h.data(), d.data(), page_ids ? h.size() * l.page_size() : h.size(), page_ids);
}

void HostBackedUp(BlockLedger& l, py::handle device_slots, py::handle host_slots,
                  py::handle rejected, bool page_ids) {
  Int32View d(device_slots, "device_slots"), h(host_slots, "host_slots"), r(rejected, "rejected");
  FinishViews(d, h, r);
  CheckSameLength(d, h, "device_slots", "host_slots");
  const int64_t unit = page_ids ? l.page_size() : 1;
  l.HostBackedUp(d.data(), h.data(), d.size() * unit, r.data(), r.size() * unit, page_ids);
}

void HostEvicted(BlockLedger& l, py::handle slots, bool page_ids) {
  Int32View s(slots, "slots");
  FinishViews(s);
  l.HostEvicted(s.data(), page_ids ? s.size() * l.page_size() : s.size(), page_ids);
}

void HostInserted(BlockLedger& l, py::handle tokens, int64_t start, py::handle host_slots,
                  py::handle rejected, py::handle seed) {
  Int32View t(tokens, "tokens"), h(host_slots, "host_slots"), r(rejected, "rejected");
  const std::string seed_bytes = Bytes32(seed, "seed");
  FinishViews(t, h, r);
  l.HostInserted(t.data(), t.size(), start, h.data(), h.size(), r.data(), r.size(),
                 SeedArg(seed_bytes));
}

// None, or an int (not a bool) that fits int64.
void SetLoraId(BlockLedger& l, py::handle id) {
  l.set_lora_id(id.is_none() ? std::nullopt : std::optional<int64_t>(ToInt64(id, "lora_id")));
}

py::list AsList(const std::vector<std::string>& events) {
  py::list out(events.size());
  for (size_t i = 0; i < events.size(); ++i) out[i] = py::bytes(events[i]);
  return out;
}

py::list TakeEvents(BlockLedger& l) { return AsList(l.TakeEvents()); }
py::list Snapshot(BlockLedger& l) { return AsList(l.Snapshot()); }

}  // namespace

void RegisterBlockLedger(py::module_& m) {
  py::class_<BlockLedger>(m, "BlockLedger",
                          "The blocks each tier holds (a row per pool page) and the KV events\n"
                          "their changes make, packed as msgpack as they happen.")
      .def(py::init<int64_t, int64_t, int64_t, bool>(), py::arg("device_pages"),
           py::arg("host_pages"), py::arg("page_size"), py::arg("threaded") = false)
      .def_property_readonly("page_size", &BlockLedger::page_size)
      .def_property_readonly("threaded", &BlockLedger::threaded)
      .def_property_readonly("pending", &BlockLedger::pending)
      .def_property_readonly("device_blocks", &BlockLedger::device_blocks)
      .def_property_readonly("host_blocks", &BlockLedger::host_blocks)
      .def_property("lora_id", &BlockLedger::lora_id, &SetLoraId)
      .def("device_inserted", &DeviceInserted, py::arg("tokens"), py::arg("slots"),
           py::arg("start"), py::arg("end"), py::arg("known"), py::arg("seed") = py::none(),
           py::arg("page_ids") = false)
      .def("device_evicted", &DeviceEvicted, py::arg("slots"), py::arg("page_ids") = false)
      .def("device_loaded", &DeviceLoaded, py::arg("host_slots"), py::arg("device_slots"),
           py::arg("page_ids") = false)
      .def("host_backed_up", &HostBackedUp, py::arg("device_slots"), py::arg("host_slots"),
           py::arg("rejected"), py::arg("page_ids") = false)
      .def("host_evicted", &HostEvicted, py::arg("slots"), py::arg("page_ids") = false)
      .def("host_inserted", &HostInserted, py::arg("tokens"), py::arg("start"),
           py::arg("host_slots"), py::arg("rejected"), py::arg("seed") = py::none())
      .def("reset", &BlockLedger::Reset)
      .def("take_events", &TakeEvents)
      .def("snapshot", &Snapshot);
}

}  // namespace radixkv::bindings
