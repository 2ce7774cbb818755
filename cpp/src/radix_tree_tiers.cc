// The tree's host tier: host eviction and the state changes around copies
// between the tiers (the copies themselves are the CacheController's).
#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "radixkv/radix_tree.h"
#include "radixkv/status.h"

namespace radixkv {
namespace {
constexpr ErrorCode kInvalid = ErrorCode::kInvalidArgument;
}  // namespace

template <typename Fn>
void RadixTree::ForEachInCopy(Node* end, const TierCopy& copy, Fn fn) const {
  for (Node* x = end; x != root_ && x->depth > copy.start; x = x->parent) {
    fn(x, x->depth - x->length - copy.start);
  }
}

Node* RadixTree::ResolveCopy(const TierCopy& copy) const noexcept {
  if (copy.node_id >= nodes_.size()) return nullptr;
  Node* node = nodes_[copy.node_id].get();
  if (node->incarnation != copy.incarnation || node->parent == nullptr ||
      node->depth != copy.end) {
    return nullptr;
  }
  return node;
}

// --- host eviction -----------------------------------------------------------------

int64_t RadixTree::EvictHost(int64_t size, SlotSink out) {
  RADIXKV_CHECK(size >= 0, kInvalid, "size must be >= 0, got ", size);
  // As Evict: take the victims first, put them back if `size` cannot be
  // reached or `out` fails. A victim also on the device keeps its node; a
  // host-only one (which has no children) is unlinked and deleted at commit.
  Node* victims = nullptr;
  auto put_back = [&]() noexcept {
    for (Node* x = victims; x != nullptr;) {
      Node* parent = x->parent;
      Node* next = x->next;
      if (!x->on_device) parent->children.Insert(x->child_key, x);  // the kept table has room
      ++parent->host_children;
      CountHost(x, +1);
      host_heap_.Push(x->id, Key(x));
      Refresh(parent);
      x->next = nullptr;
      x = next;
    }
  };
  int64_t freed = 0;
  while (freed < size) {
    if (host_heap_.empty()) {
      put_back();
      throw Error(ErrorCode::kOutOfCapacity,
                  StrCat("cannot evict size=", size, " host tokens: only ", freed,
                         " can go now (of ", host_size_, " with a host copy, the rest are "
                         "being loaded, or ancestors of host copies that stay)"));
    }
    Node* x = nodes_[host_heap_.top()].get();
    if (host_heap_.KeyAt(0) != Key(x)) {
      host_heap_.Update(x->id, Key(x));  // lagging key: see Evict
      continue;
    }
    host_heap_.Pop();
    Node* parent = x->parent;
    if (!x->on_device) parent->children.Erase(x->child_key, x, /*keep_table=*/true);
    --parent->host_children;
    CountHost(x, -1);
    Refresh(parent);
    x->next = victims;
    victims = x;
    freed += x->length;
  }
  int32_t* slots;
  try {
    slots = out(freed);
  } catch (...) {
    put_back();
    throw;
  }
  ++clock_;
  int64_t end = freed;
  for (Node* x = victims; x != nullptr;) {
    Node* parent = x->parent;
    Node* next = x->next;
    x->next = nullptr;
    end -= x->length;
    std::memcpy(slots + end, x->host, x->length * sizeof(int32_t));
    stored_host_.RemoveAll(x->host, x->length);
    FreeHost(x);
    if (x->on_device) {
      Refresh(x);
    } else {
      if (parent->children.empty()) parent->children.Clear();
      FreeNode(x);
    }
    x = next;
  }
  return freed;
}

// --- backups: device to host ---------------------------------------------------------

bool RadixTree::FindBackup(const int32_t* tokens, int64_t n, uint32_t min_hits,
                           TierCopy* copy, bool through_partial, uint64_t ns) const {
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
  int32_t* slots = out(copy.length());
  // Nothing below allocates or throws.
  ++clock_;
  ForEachInCopy(end, copy, [&](Node* x, int64_t offset) {
    std::memcpy(slots + offset, x->value(), x->length * sizeof(int32_t));
    x->backing_up = true;
    ++x->parent->host_children;
    backing_up_size_ += x->length;
    Refresh(x->parent);
  });
  end->copy_start = copy.start;
  LockPath(end, +1);  // its device pages are being read: a pin, like a lock
}

int64_t RadixTree::FinishBackup(const TierCopy& copy, const int32_t* host, bool ok,
                                SlotSink rejected) {
  Node* end = ResolveCopy(copy);
  if (end == nullptr) {  // only Reset frees a node with a backup in flight
    int32_t* out = rejected(copy.length());
    std::memcpy(out, host, copy.length() * sizeof(int32_t));
    return copy.length();
  }
  RADIXKV_CHECK(end->backing_up && end->copy_start == copy.start, kInvalid,
                "copy is not a backup in flight: it was finished already, or its range is "
                "not the one begun");
  RADIXKV_CHECK(FindOutOfRange(host, copy.length()) < 0, kInvalid,
                "host_slots has a negative slot");
  // Top down: a node takes its host slots only if its parent has a host copy
  // by then, so a failed parent cuts off the nodes below it.
  std::vector<Node*> nodes;
  ForEachInCopy(end, copy, [&](Node* x, int64_t) { nodes.push_back(x); });
  std::reverse(nodes.begin(), nodes.end());
  std::vector<char> take(nodes.size(), 0);
  std::vector<Storage> blocks(nodes.size());
  int64_t kept = 0;
  for (size_t k = 0; k < nodes.size(); ++k) {
    Node* x = nodes[k];
    RADIXKV_CHECK(x->backing_up, kInvalid, "node ", x->id, " finishes a backup it did not start");
    const bool parent_has = x->parent == root_ || x->parent->has_host() ||
                            (k > 0 && x->parent == nodes[k - 1] && take[k - 1]);
    take[k] = ok && parent_has;
    if (take[k]) {
      blocks[k] = Storage(&arena_, nullptr, host + (x->depth - x->length - copy.start), x->length);
      kept += x->length;
    }
  }
  // The host slots taken must be new to the tree (checked before anything changes).
  size_t added = 0;
  for (; added < nodes.size(); ++added) {
    if (!take[added]) continue;
    Node* x = nodes[added];
    const int32_t* h = host + (x->depth - x->length - copy.start);
    const int64_t twice = stored_host_.AddAll(h, x->length);
    if (twice >= 0) break;
  }
  if (added < nodes.size()) {
    for (size_t k = 0; k < added; ++k) {
      if (take[k]) {
        Node* x = nodes[k];
        stored_host_.RemoveAll(host + (x->depth - x->length - copy.start), x->length);
      }
    }
    throw Error(kInvalid, "host_slots repeats a slot, or has one the cache already stores");
  }
  const int64_t refused = copy.length() - kept;
  int32_t* out = nullptr;
  try {
    out = rejected(refused);
  } catch (...) {
    for (size_t k = 0; k < nodes.size(); ++k) {
      if (take[k]) {
        Node* x = nodes[k];
        stored_host_.RemoveAll(host + (x->depth - x->length - copy.start), x->length);
      }
    }
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
      blocks[k].MoveToHost(x);  // the parent already counts it (backing up)
      CountHost(x, +1);
    } else {
      --x->parent->host_children;
      std::memcpy(out + written, host + (x->depth - x->length - copy.start),
                  x->length * sizeof(int32_t));
      written += x->length;
    }
  }
  end->copy_start = -1;
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
    return TierCopy{device_end->id, device_end->incarnation, device_end->depth,
                    device_end->depth};
  }
  Node* end = nodes_[handle.host_node_id].get();
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

void RadixTree::BeginLoad(const TierCopy& copy, SlotSink host, SlotSink prefix,
                          Handle* loaded) {
  Node* end = ResolveCopy(copy);
  RADIXKV_CHECK(end != nullptr, kInvalid,
                "load is stale: its node was evicted or the cache was reset");
  RADIXKV_CHECK(DeviceEnd(end)->depth == copy.start, kInvalid,
                "load does not start where the path's device part ends: match again");
  ForEachInCopy(end, copy, [&](Node* x, int64_t) {
    RADIXKV_CHECK(!x->on_device && x->has_host() && !x->loading, kInvalid, "node ", x->id,
                  " cannot be loaded: it is on the device, has no host copy, or is loading");
  });
  int32_t* slots = host(copy.length());
  Node* device_end = DeviceEnd(end);
  CopyPathSlots(device_end, prefix(device_end->depth));
  // Nothing below allocates or throws.
  ++clock_;
  ForEachInCopy(end, copy, [&](Node* x, int64_t offset) {
    std::memcpy(slots + offset, x->host, x->length * sizeof(int32_t));
    x->loading = true;
    loading_size_ += x->length;
    Refresh(x);
  });
  Touch(end);
  if (copy.length() > 0) end->copy_start = copy.start;
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
  h.ns = end->ns;
  *loaded = h;
}

bool RadixTree::FinishLoad(const TierCopy& copy, const int32_t* device, bool ok) {
  Node* end = ResolveCopy(copy);
  if (end == nullptr) return false;
  RADIXKV_CHECK(end->loading && end->copy_start == copy.start, kInvalid,
                "copy is not a load in flight: it was finished already, or its range is not "
                "the one begun");
  if (ok) {
    const int64_t bad = FindOutOfRange(device, copy.length(), max_slots_);
    RADIXKV_CHECK(bad < 0, kInvalid, "device_slots has slot ", bad < 0 ? 0 : device[bad],
                  ", outside [0, max_slots)");
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
      if (s.AddAll(device + (x->depth - x->length - copy.start), x->length) >= 0) break;
    }
    if (added < nodes.size()) {
      for (size_t k = 0; k < added; ++k) {
        Node* x = nodes[k];
        s.RemoveAll(device + (x->depth - x->length - copy.start), x->length);
      }
      throw Error(kInvalid, "device_slots repeats a slot, or has one the cache already stores");
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
      std::memcpy(x->data + x->length, device + (x->depth - x->length - copy.start),
                  x->length * sizeof(int32_t));
      SetOnDevice(x, true);
    }
    Refresh(x);
    Refresh(x->parent);
  }
  end->copy_start = -1;
  LockPath(end, -1);  // the copy's pin
  return true;
}

std::vector<TierCopy> RadixTree::EvictionCandidatesWithoutHost(int64_t size) {
  // Pop the leaves Evict would take first, note those without a host copy,
  // and put every one back (the same keys: nothing visible changes).
  std::vector<uint32_t> popped;
  std::vector<TierCopy> out;
  int64_t covered = 0;
  while (covered < size && !heap_.empty()) {
    Node* x = nodes_[heap_.top()].get();
    if (heap_.KeyAt(0) != Key(x)) {
      heap_.Update(x->id, Key(x));
      continue;
    }
    heap_.Pop();
    popped.push_back(x->id);
    covered += x->length;
    if (x->has_host() || x->backing_up) continue;
    // Up to the path's host copy, or to a node an earlier copy covers (which
    // is begun first, so this one's parent is backing up by then).
    Node* top = x;
    auto covered_already = [&](const Node* n) {
      for (const TierCopy& c : out) {
        for (Node* y = nodes_[c.node_id].get(); y != root_ && y->depth > c.start; y = y->parent) {
          if (y == n) return true;
        }
      }
      return false;
    };
    while (top->parent != root_ && !top->parent->has_host() && !top->parent->backing_up &&
           !covered_already(top->parent)) {
      top = top->parent;
    }
    out.push_back(TierCopy{x->id, x->incarnation, top->depth - top->length, x->depth});
  }
  for (uint32_t id : popped) heap_.Push(id, Key(nodes_[id].get()));
  return out;
}

// --- the storage tier: writes of host pages, pages read back -------------------------

bool RadixTree::BeginStore(const TierCopy& from, SlotSink host, SlotSink tokens,
                           TierCopy* copy, uint64_t* ns) {
  Node* x = ResolveCopy(from);
  if (x == nullptr) return false;  // gone since (evicted from both tiers, or Reset)
  Node* end = x;  // the deepest node of the range with a host copy
  while (end != root_ && !end->has_host()) end = end->parent;
  if (end == root_ || end->depth <= from.start) return false;
  Node* top = end;
  while (top->depth - top->length > from.start) top = top->parent;
  RADIXKV_CHECK(top->depth - top->length == from.start, kInvalid, "start=", from.start,
                " is not where a node of the path begins");
  for (Node* y = end;; y = y->parent) {
    RADIXKV_CHECK(!y->storing, kInvalid, "node ", y->id, " is being written to storage already");
    if (y == top) break;
  }
  int32_t* slots = host(end->depth - from.start);
  int32_t* path = tokens(end->depth);
  // Nothing below allocates or throws.
  ++clock_;
  for (Node* y = end; y != root_; y = y->parent) {
    std::memcpy(path + (y->depth - y->length), y->key(), y->length * sizeof(int32_t));
  }
  for (Node* y = end;; y = y->parent) {
    std::memcpy(slots + (y->depth - y->length - from.start), y->host, y->length * sizeof(int32_t));
    y->storing = true;
    storing_size_ += y->length;
    Refresh(y);
    if (y == top) break;
  }
  end->store_start = from.start;
  *copy = TierCopy{end->id, end->incarnation, from.start, end->depth};
  if (ns != nullptr) *ns = end->ns;
  return true;
}

void RadixTree::FinishStore(const TierCopy& copy) {
  Node* end = ResolveCopy(copy);
  if (end == nullptr) return;  // only Reset frees a node being written
  RADIXKV_CHECK(end->storing && end->store_start == copy.start, kInvalid,
                "copy is not a write to storage in flight: it was finished already, or its "
                "range is not the one begun");
  std::vector<Node*> nodes;
  ForEachInCopy(end, copy, [&](Node* x, int64_t) { nodes.push_back(x); });
  for (Node* x : nodes) {
    RADIXKV_CHECK(x->storing, kInvalid, "node ", x->id, " finishes a write it did not start");
  }
  // Nothing below allocates or throws.
  ++clock_;
  for (Node* x : nodes) {
    x->storing = false;
    storing_size_ -= x->length;
    Refresh(x);
  }
  end->store_start = -1;
}

Node* RadixTree::MatchEnd(const int32_t* tokens, int64_t n, uint64_t ns, int64_t* pos) const {
  RADIXKV_CHECK(n >= 0, kInvalid, "input length must be >= 0, got ", n);
  n -= n % page_size_;
  Node* node;
  Node* partial;
  int64_t partial_len;
  *pos = Walk(tokens, n, ns, &node, &partial, &partial_len);
  return partial != nullptr ? partial : node;
}

int64_t RadixTree::StoragePrefixEnd(const int32_t* tokens, int64_t n, bool* host_backed,
                                    uint64_t ns) const {
  int64_t pos;
  const Node* attach = MatchEnd(tokens, n, ns, &pos);
  *host_backed = attach == root_ || attach->has_host();
  return pos;
}

bool RadixTree::PinHost(const int32_t* tokens, int64_t n, TierCopy* pin, uint64_t ns) {
  int64_t pos;
  Node* attach = MatchEnd(tokens, n, ns, &pos);
  if (attach == root_ || !attach->has_host()) return false;
  RADIXKV_CHECK(attach->host_pins < INT32_MAX, kInvalid, "node ", attach->id,
                " has too many pins");
  ++attach->host_pins;
  ++host_pins_;
  Refresh(attach);
  *pin = TierCopy{attach->id, attach->incarnation, pos, attach->depth};
  return true;
}

void RadixTree::UnpinHost(const TierCopy& pin) {
  Node* x = ResolveCopy(pin);
  if (x == nullptr) return;  // only Reset frees a pinned node
  RADIXKV_CHECK(x->host_pins > 0 && pin.start <= x->depth, kInvalid,
                "pin is not held: it was released already, or was never taken");
  --x->host_pins;
  --host_pins_;
  Refresh(x);
}

int64_t RadixTree::InsertHost(const int32_t* tokens, int64_t n, int64_t start,
                              const int32_t* host, SlotSink rejected, uint64_t ns) {
  RADIXKV_CHECK(start >= 0 && start % page_size_ == 0 && n >= start &&
                    (n - start) % page_size_ == 0,
                kInvalid, "pages read from storage must be whole pages from a page boundary");
  const int64_t len = n - start;
  RADIXKV_CHECK(FindOutOfRange(host, len) < 0, kInvalid, "host_slots has a negative slot");
  Node* node;
  Node* partial;
  int64_t partial_len;
  const int64_t pos = Walk(tokens, n, ns, &node, &partial, &partial_len);
  const Node* attach = partial != nullptr ? partial : node;
  const bool fits = pos >= start && pos < n && (attach == root_ || attach->has_host());
  const int64_t take = fits ? n - pos : 0;
  const int32_t* fresh = host + (n - take - start);
  SplitPlan split;
  Storage data, block;
  bool marked = false;
  try {
    if (take > 0) {
      const int64_t twice = stored_host_.AddAll(fresh, take);
      RADIXKV_CHECK(twice < 0, kInvalid, "host_slots repeats a slot, or has one the cache "
                    "already stores");
      marked = true;
      ReserveNodes((partial != nullptr) + 1);
      if (partial != nullptr) PrepareSplit(partial, partial_len, 1 + 1, &split);
      data = Storage(&arena_, tokens + pos, fresh, take);  // slots: unused until on the device
      block = Storage(&arena_, nullptr, fresh, take);
      if (partial == nullptr) node->children.Reserve(node->children.size() + 1);
    }
    int32_t* out = rejected(len - take);
    if (len > take) std::memcpy(out, host, (len - take) * sizeof(int32_t));
  } catch (...) {
    if (marked) stored_host_.RemoveAll(fresh, take);
    throw;
  }
  if (take == 0) return 0;
  // Nothing below allocates or throws.
  ++clock_;
  if (partial != nullptr) node = CommitSplit(&split);
  Node* leaf = TakeNode(node, std::move(data), take, ns);
  node->children.Insert(leaf->child_key, leaf);
  block.MoveToHost(leaf);
  CountHost(leaf, +1);
  ++node->host_children;
  Touch(leaf);
  Refresh(leaf);
  Refresh(node);
  return take;
}

}  // namespace radixkv
