// The tree's side of the storage tier: host pages pinned while they are
// written to storage, host copies pinned for reads in flight, and the pages
// read back joining the tree as host-only nodes.
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

// --- the storage tier: writes of host pages, pages read back -------------------------

bool RadixTree::BeginStorageWrite(const TierCopy& from, SlotSink host, SlotSink tokens,
                                  TierCopy* copy, uint64_t* ns) {
  Node* x = ResolveCopy(from);
  if (x == nullptr) return false;  // gone since (evicted from both tiers, or Reset)
  Node* end = x;                   // the deepest node of the range with a host copy
  while (end != root_ && !end->has_host()) end = end->parent;
  if (end == root_ || end->depth <= from.start) return false;
  Node* top = end;
  while (top->depth - top->length > from.start) top = top->parent;
  RADIXKV_CHECK(top->depth - top->length == from.start, kInvalid, "start=", from.start,
                " is not where a node of the path begins");
  for (Node* y = end;; y = y->parent) {
    RADIXKV_CHECK(!y->storage_writing, kInvalid, "node ", y->id,
                  " is being written to storage already");
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
    ExpandSlots(Ex(y).host, y, slots + (y->depth - y->length - from.start));
    y->storage_writing = true;
    storage_writing_size_ += y->length;
    Refresh(y);
    if (y == top) break;
  }
  MutEx(end).storage_write_start = from.start;
  *copy = TierCopy{end->id, end->incarnation, from.start, end->depth};
  if (ns != nullptr) *ns = NsOf(end);
  return true;
}

void RadixTree::FinishStorageWrite(const TierCopy& copy) {
  Node* end = ResolveCopy(copy);
  if (end == nullptr) return;  // only Reset frees a node being written
  RADIXKV_CHECK(end->storage_writing && Ex(end).storage_write_start == copy.start, kInvalid,
                "copy is not a write to storage in flight: it was finished already, or its "
                "range is not the one begun");
  std::vector<Node*> nodes;
  ForEachInCopy(end, copy, [&](Node* x, int64_t) { nodes.push_back(x); });
  for (Node* x : nodes) {
    RADIXKV_CHECK(x->storage_writing, kInvalid, "node ", x->id,
                  " finishes a write it did not start");
  }
  // Nothing below allocates or throws.
  ++clock_;
  for (Node* x : nodes) {
    x->storage_writing = false;
    storage_writing_size_ -= x->length;
    Refresh(x);
  }
  MutEx(end).storage_write_start = -1;
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
  RADIXKV_CHECK(Ex(attach).host_pins < INT32_MAX, kInvalid, "node ", attach->id,
                " has too many pins");
  ++MutEx(attach).host_pins;
  ++host_pins_;
  Refresh(attach);
  *pin = TierCopy{attach->id, attach->incarnation, pos, attach->depth};
  return true;
}

void RadixTree::UnpinHost(const TierCopy& pin) {
  Node* x = ResolveCopy(pin);
  if (x == nullptr) return;  // only Reset frees a pinned node
  RADIXKV_CHECK(Ex(x).host_pins > 0 && pin.start <= x->depth, kInvalid,
                "pin is not held: it was released already, or was never taken");
  --MutEx(x).host_pins;
  --host_pins_;
  Refresh(x);
}

int64_t RadixTree::InsertHost(const int32_t* tokens, int64_t n, int64_t start, const int32_t* host,
                              SlotSink rejected, uint64_t ns) {
  RADIXKV_CHECK(
      start >= 0 && start % page_size_ == 0 && n >= start && (n - start) % page_size_ == 0,
      kInvalid, "pages read from storage must be whole pages from a page boundary");
  const int64_t len = n - start;
  RADIXKV_CHECK(FindOutOfRange(host, len) < 0, kInvalid, "host_slots has a negative slot");
  CheckPages(host, len, page_size_, "host_slots", aligned_);
  Node* node;
  Node* partial;
  int64_t partial_len;
  const int64_t pos = Walk(tokens, n, ns, &node, &partial, &partial_len);
  const Node* attach = partial != nullptr ? partial : node;
  const bool fits = pos >= start && pos < n && (attach == root_ || attach->has_host());
  const int64_t take = fits ? n - pos : 0;
  const int32_t* fresh = host + (n - take - start);
  SplitPlan split;
  NodeBlock data, block;
  bool marked = false;
  try {
    if (take > 0) {
      const int64_t twice = stored_host_.AddAll(fresh, take);
      RADIXKV_CHECK(twice < 0, kInvalid,
                    "host_slots repeats a slot, or has one the cache "
                    "already stores");
      marked = true;
      NeedExtras();  // its host copy
      ReserveNodes((partial != nullptr) + 1);
      if (partial != nullptr) PrepareSplit(partial, partial_len, 1 + 1, &split);
      // Device slots: none until a load puts the node on the device.
      data = NodeBlock(&arena_, tokens + pos, take, page_size_);
      std::fill_n(data.pages(), take / page_size_, -1);
      block = NodeBlock(&arena_, nullptr, take, page_size_);
      FirstOfPages(fresh, take / page_size_, page_size_, block.pages());
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
  block.MoveToHost(leaf, &MutEx(leaf));
  leaf->from_storage = true;
  CountHost(leaf, +1);
  ++node->host_children;
  Touch(leaf);
  Refresh(leaf);
  Refresh(node);
  return take;
}

int64_t RadixTree::StorageHitLen(const Handle& handle) const {
  const Node* device_end = Resolve(handle, "handle");
  int64_t tokens = 0;
  for (const Node* x = MatchedEnd(handle, true); x != device_end && x != root_; x = x->parent) {
    tokens += x->from_storage ? x->length : 0;
  }
  return tokens;
}

}  // namespace radixkv
