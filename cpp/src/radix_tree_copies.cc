// The tree's side of the copies between the tiers: a backup (device to
// host) and a load (host to device) change a node's state only when they
// finish; the copies themselves are the CacheController's.
#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "radix_node.h"
#include "radixkv/radix_tree.h"
#include "radixkv/status.h"

namespace radixkv {

using tree_errors::kBroken;
using tree_errors::kInvalid;

Node* RadixTree::ResolveCopy(const TierCopy& copy) const noexcept {
  if (copy.node_id >= nodes_.size()) return nullptr;
  Node* node = nodes_[copy.node_id];
  if (node->incarnation != copy.incarnation || node->parent == nullptr || node->depth != copy.end) {
    return nullptr;
  }
  return node;
}

bool RadixTree::CopyNamespace(const TierCopy& copy, uint64_t* ns) const noexcept {
  const Node* node = ResolveCopy(copy);
  if (node == nullptr) return false;
  *ns = NsOf(node);
  return true;
}

// --- backups: device to host ---------------------------------------------------------

bool RadixTree::FindBackup(const int32_t* tokens, int64_t n, uint32_t min_hits, TierCopy* copy,
                           bool through_partial, uint64_t ns) const {
  RADIXKV_CHECK(n >= 0, kInvalid, "input length must be >= 0, got ", n);
  n -= n % page_size_;
  Node* node;
  Node* partial;
  int64_t partial_len;
  Walk(tokens, n, ns, &node, &partial, &partial_len);
  if (through_partial && partial != nullptr) node = partial;
  // The deepest node on the device with enough hits, fully matched.
  Node* end = DeviceEnd(node);
  while (end != root_ && end->hits < min_hits) end = end->parent;
  if (end == root_ || end->has_host() || end->backing_up) return false;
  Node* top = end;
  while (top->parent != root_ && !top->parent->has_host() && !top->parent->backing_up) {
    top = top->parent;
  }
  copy->node_id = end->id;
  copy->incarnation = end->incarnation;
  copy->start = top->depth - top->length;
  copy->end = end->depth;
  return true;
}

void RadixTree::BeginBackup(const TierCopy& copy, SlotSink out) {
  RequireAligned(out.pages());
  Node* end = ResolveCopy(copy);
  RADIXKV_CHECK(end != nullptr && copy.start < copy.end, kInvalid,
                "backup is stale: its node was evicted or the cache was reset");
  Node* top = end;
  ForEachInCopy(end, copy, [&](Node* x, int64_t) {
    RADIXKV_CHECK(x->on_device && !x->has_host() && !x->backing_up, kInvalid, "node ", x->id,
                  " cannot be backed up: it is not on the device, or has a host copy or one "
                  "in flight");
    top = x;
  });
  RADIXKV_CHECK(top->depth - top->length == copy.start, kInvalid,
                "backup range does not start at a node");
  Node* above = top->parent;
  RADIXKV_CHECK(above == root_ || above->has_host() || above->backing_up, kInvalid,
                "backup must start where the path's host copy ends (its parent has none)");
  NeedExtras();  // the copy's range, then the host copy
  const bool pages = out.pages();
  int32_t* slots = out(Units(pages, copy.length()));
  // Nothing below allocates or throws.
  ++clock_;
  ForEachInCopy(end, copy, [&](Node* x, int64_t offset) {
    Emit(x->value(), x, slots + Units(pages, offset), pages);
    x->backing_up = true;
    ++x->parent->host_children;
    backing_up_size_ += x->length;
    Refresh(x->parent);
  });
  MutEx(end).copy_start = copy.start;
  LockPath(end, +1);  // its device pages are being read: a pin, like a lock
}

int64_t RadixTree::FinishBackup(const TierCopy& copy, SlotSource in, bool ok,
                                SlotSink rejected, bool host_checked) {
  RequireAligned(in.pages);
  // The rejected are written in the input's form (slots or page ids).
  if (in.pages) rejected = rejected.Pages();
  const int32_t* host = in.data;
  Node* end = ResolveCopy(copy);
  if (end == nullptr) {  // only Reset frees a node with a backup in flight
    const int64_t k = Units(in.pages, copy.length());
    int32_t* out = rejected(k);
    std::memcpy(out, host, k * sizeof(int32_t));
    return copy.length();
  }
  RADIXKV_CHECK(end->backing_up && Ex(end).copy_start == copy.start, kInvalid,
                "copy is not a backup in flight: it was finished already, or its range is "
                "not the one begun");
  if (!host_checked) {
    const int64_t k = Units(in.pages, copy.length());
    const int64_t limit = in.pages ? (int64_t{1} << 31) / page_size_ : -1;
    RADIXKV_CHECK(FindOutOfRange(host, k, limit) < 0, kInvalid,
                  in.pages ? "host_page_ids has a page out of range"
                           : "host_slots has a negative slot");
    if (!in.pages) CheckPages(host, copy.length(), page_size_, "host_slots", aligned_);
  }
  // Top down: a node takes its host slots only if its parent has a host copy
  // by then, so a failed parent cuts off the nodes below it.
  std::vector<Node*> nodes;
  ForEachInCopy(end, copy, [&](Node* x, int64_t) { nodes.push_back(x); });
  std::reverse(nodes.begin(), nodes.end());
  std::vector<char> take(nodes.size(), 0);
  std::vector<NodeBlock> blocks(nodes.size());
  int64_t kept = 0;
  for (size_t k = 0; k < nodes.size(); ++k) {
    Node* x = nodes[k];
    RADIXKV_CHECK(x->backing_up, kInvalid, "node ", x->id, " finishes a backup it did not start");
    const bool parent_has = x->parent == root_ || x->parent->has_host() ||
                            (k > 0 && x->parent == nodes[k - 1] && take[k - 1]);
    take[k] = ok && parent_has;
    if (take[k]) {
      blocks[k] = NodeBlock(&arena_, nullptr, x->length, page_size_);
      TakeFirsts(in, x->depth - x->length - copy.start, x, blocks[k].pages());
      kept += x->length;
    }
  }
  // The host slots taken must be new to the tree (checked before anything changes).
  size_t added = 0;
  for (; added < nodes.size(); ++added) {
    if (!take[added]) continue;
    Node* x = nodes[added];
    const int64_t twice =
        AddSlots(&stored_host_, in, x->depth - x->length - copy.start, x->length);
    if (twice >= 0) break;
  }
  auto take_back = [&](size_t upto) noexcept {
    for (size_t k = 0; k < upto; ++k) {
      if (take[k]) {
        Node* x = nodes[k];
        RemoveSlots(&stored_host_, in, x->depth - x->length - copy.start, x->length);
      }
    }
  };
  if (added < nodes.size()) {
    take_back(added);
    throw Error(kInvalid, in.pages
                              ? "host_pages repeats a page, or has one the cache already stores"
                              : "host_slots repeats a slot, or has one the cache already stores");
  }
  const int64_t refused = copy.length() - kept;
  int32_t* out = nullptr;
  try {
    out = rejected(Units(in.pages, refused));
  } catch (...) {
    take_back(nodes.size());
    throw;
  }
  // Nothing below allocates or throws.
  ++clock_;
  int64_t written = 0;
  for (size_t k = 0; k < nodes.size(); ++k) {
    Node* x = nodes[k];
    x->backing_up = false;
    backing_up_size_ -= x->length;
    if (take[k]) {
      blocks[k].MoveToHost(x, &MutEx(x));  // the parent already counts it (backing up)
      CountHost(x, +1);
      if (Ex(x).host_claim_locks > 0) {  // its host claims need the device no more
        LockPath(x, -Ex(x).host_claim_locks);
        MutEx(x).host_claim_locks = 0;
      }
    } else {
      --x->parent->host_children;
      const int64_t k = Units(in.pages, x->length);
      std::memcpy(out + written, in.At(x->depth - x->length - copy.start, page_size_),
                  k * sizeof(int32_t));
      written += k;
    }
  }
  MutEx(end).copy_start = -1;
  LockPath(end, -1);
  for (Node* x : nodes) {
    Refresh(x);
    Refresh(x->parent);
  }
  return refused;
}

// --- loads: host to device -------------------------------------------------------------

TierCopy RadixTree::FindLoad(const Handle& handle) const {
  Node* device_end = Resolve(handle, "handle");
  if (handle.host_node_id >= nodes_.size() ||
      nodes_[handle.host_node_id]->generation != handle.host_generation) {
    // The host part was evicted since the match: nothing is left to load.
    return TierCopy{device_end->id, device_end->incarnation, device_end->depth, device_end->depth};
  }
  Node* end = nodes_[handle.host_node_id];
  device_end = DeviceEnd(end);
  for (Node* x = end; x != device_end; x = x->parent) {
    RADIXKV_CHECK(!x->loading, kInvalid,
                  "handle's host part is already being loaded: wait for it (loading_check) and "
                  "match again");
  }
  TierCopy copy;
  copy.node_id = end->id;
  copy.incarnation = end->incarnation;
  copy.start = device_end->depth;
  copy.end = end->depth;
  return copy;
}

void RadixTree::BeginLoad(const TierCopy& copy, SlotSink host, SlotSink prefix, Handle* loaded) {
  RequireAligned(host.pages() || prefix.pages());
  Node* end = ResolveCopy(copy);
  RADIXKV_CHECK(end != nullptr, kInvalid,
                "load is stale: its node was evicted or the cache was reset");
  RADIXKV_CHECK(DeviceEnd(end)->depth == copy.start, kInvalid,
                "load does not start where the path's device part ends: match again");
  ForEachInCopy(end, copy, [&](Node* x, int64_t) {
    RADIXKV_CHECK(!x->on_device && x->has_host() && !x->loading, kInvalid, "node ", x->id,
                  " cannot be loaded: it is on the device, has no host copy, or is loading");
  });
  int32_t* slots = host(Units(host.pages(), copy.length()));
  Node* device_end = DeviceEnd(end);
  CopyPathSlots(device_end, prefix(Units(prefix.pages(), device_end->depth)), prefix.pages());
  // Nothing below allocates or throws.
  ++clock_;
  ForEachInCopy(end, copy, [&](Node* x, int64_t offset) {
    Emit(Ex(x).host, x, slots + Units(host.pages(), offset), host.pages());
    x->loading = true;
    loading_size_ += x->length;
    Refresh(x);
  });
  Touch(end);
  if (copy.length() > 0) MutEx(end).copy_start = copy.start;
  // One lock for the handle and, when there is something to copy, one pin
  // for the copy: the path above stays on the device until the load lands,
  // even if the request lets go first.
  LockPath(end, copy.length() > 0 ? 2 : 1);
  Handle h;
  h.tree_id = id_;
  h.generation = end->generation;
  h.node_id = end->id;
  h.cached_len = end->depth;
  h.lock_count = 1;
  h.host_generation = end->generation;
  h.host_node_id = end->id;
  h.host_hit_len = 0;
  h.ns = NsOf(end);
  *loaded = h;
}

bool RadixTree::FinishLoad(const TierCopy& copy, SlotSource in, bool ok) {
  RequireAligned(in.pages);
  const int32_t* device = in.data;
  Node* end = ResolveCopy(copy);
  if (end == nullptr) return false;
  RADIXKV_CHECK(end->loading && Ex(end).copy_start == copy.start, kInvalid,
                "copy is not a load in flight: it was finished already, or its range is not "
                "the one begun");
  if (ok && in.pages) {
    const int64_t limit =
        (max_slots_ == kAnySlot ? (int64_t{1} << 31) : max_slots_) / page_size_;
    const int64_t bad = FindOutOfRange(device, copy.length() / page_size_, limit);
    RADIXKV_CHECK(bad < 0, kInvalid, "device_page_ids has page ", bad < 0 ? 0 : device[bad],
                  ", outside [0, max_slots / page_size)");
  } else if (ok) {
    const int64_t bad = FindOutOfRange(device, copy.length(), max_slots_);
    RADIXKV_CHECK(bad < 0, kInvalid, "device_slots has slot ", bad < 0 ? 0 : device[bad],
                  ", outside [0, max_slots)");
    CheckPages(device, copy.length(), page_size_, "device_slots", aligned_);
  }
  std::vector<Node*> nodes;
  ForEachInCopy(end, copy, [&](Node* x, int64_t) { nodes.push_back(x); });
  for (Node* x : nodes) {
    RADIXKV_CHECK(x->loading, kInvalid, "node ", x->id, " finishes a load it did not start");
  }
  if (ok) {
    SlotSet& s = stored_;
    size_t added = 0;
    for (; added < nodes.size(); ++added) {
      Node* x = nodes[added];
      if (AddSlots(&s, in, x->depth - x->length - copy.start, x->length) >= 0) break;
    }
    if (added < nodes.size()) {
      for (size_t k = 0; k < added; ++k) {
        Node* x = nodes[k];
        RemoveSlots(&s, in, x->depth - x->length - copy.start, x->length);
      }
      throw Error(kInvalid, in.pages
                                ? "device_pages repeats a page, or has one the cache already stores"
                                : "device_slots repeats a slot, or has one the cache already stores");
    }
  }
  // Nothing below allocates or throws. Top down, so each node's parent is on
  // the device before it is.
  ++clock_;
  for (size_t k = nodes.size(); k-- > 0;) {
    Node* x = nodes[k];
    x->loading = false;
    loading_size_ -= x->length;
    if (ok) {
      TakeFirsts(in, x->depth - x->length - copy.start, x, x->value());
      SetOnDevice(x, true);
    }
    Refresh(x);
    Refresh(x->parent);
  }
  MutEx(end).copy_start = -1;
  LockPath(end, -1);  // the copy's pin
  return true;
}

}  // namespace radixkv
