// The tree's full integrity walk and its dump.
#include <algorithm>
#include <cstring>
#include <unordered_map>
#include <utility>
#include <vector>

#include "radix_node.h"
#include "radixkv/radix_tree.h"
#include "radixkv/status.h"

namespace radixkv {

using tree_errors::kBroken;
using tree_errors::kInvalid;

void RadixTree::CheckIntegrity() const {
  int64_t evictable = 0, protected_tokens = 0, nodes = 0, heap_members = 0, host_members = 0;
  int64_t device_tokens = 0, host_tokens = 0, host_only = 0, backing_up = 0, loading = 0,
          storage_writing = 0, pins = 0, claimed = 0;
  SlotSet seen, seen_host;
  // Per namespace with a quota: tokens on each tier and heap members.
  struct QuotaCount {
    int64_t device = 0, host = 0, heap = 0, host_heap = 0;
  };
  std::unordered_map<uint64_t, QuotaCount> quota_counts;
  // A node's slots, token by token (it keeps the first of each page).
  auto slots_of = [&](const int32_t* pages, int64_t length) {
    std::vector<int32_t> slots(static_cast<size_t>(length));
    ExpandPages(pages, length / page_size_, page_size_, slots.data());
    return slots;
  };
  std::vector<const Node*> stack{root_};
  RADIXKV_CHECK(root_->parent == nullptr && root_->length == 0 && root_->depth == 0, kBroken,
                "root node has a parent or tokens");
  while (!stack.empty()) {
    const Node* x = stack.back();
    stack.pop_back();
    int64_t child_refs = 0, child_claims = 0, child_host_claims = 0;
    uint32_t device_children = 0, host_children = 0;
    x->children.ForEach([&](uint64_t key, const Node* child) {
      RADIXKV_CHECK(child->parent == x, kBroken, "node ", child->id, " has a wrong parent link");
      RADIXKV_CHECK(child->length > 0 && child->data != nullptr, kBroken, "node ", child->id,
                    " is empty");
      RADIXKV_CHECK(x == root_ || NsOf(child) == NsOf(x), kBroken, "node ", child->id,
                    " is in another namespace than its parent");
      RADIXKV_CHECK(ChildKey(x, child->key(), NsOf(child)) == key && child->child_key == key,
                    kBroken, "node ", child->id,
                    " is filed under a key that is not its first page");
      child_refs += child->ref_count;
      child_claims += Ex(child).claims;
      child_host_claims += Ex(child).host_claims;
      device_children += child->on_device;
      host_children += child->has_host() || child->backing_up;
      stack.push_back(child);
    });
    RADIXKV_CHECK(device_children == x->device_children && host_children == x->host_children,
                  kBroken, "node ", x->id, " counts ", x->device_children, " device and ",
                  x->host_children, " host children but has ", device_children, " and ",
                  host_children);
    if (x == root_) continue;
    ++nodes;
    RADIXKV_CHECK(x->id < nodes_.size() && nodes_[x->id] == x, kBroken, "node ", x->id,
                  " is not in the node table");
    RADIXKV_CHECK(x->length % page_size_ == 0, kBroken, "node ", x->id, " has length ", x->length,
                  ", not a multiple of page_size ", page_size_);
    const NodeExtra& e = Ex(x);
    RADIXKV_CHECK(x->has_host() == (e.host != nullptr), kBroken, "node ", x->id,
                  " has host slots that do not match its host flag");
    RADIXKV_CHECK(x->length <= x->capacity && (!x->has_host() || x->length <= e.host_capacity),
                  kBroken, "node ", x->id, " is longer than its storage");
    RADIXKV_CHECK(x->depth == x->parent->depth + x->length, kBroken, "node ", x->id,
                  " has a wrong depth");
    RADIXKV_CHECK(x->ref_count >= child_refs, kBroken, "node ", x->id, " has ref_count ",
                  x->ref_count, " below its children's total ", child_refs);
    RADIXKV_CHECK(e.claims >= child_claims && e.host_claims >= child_host_claims, kBroken,
                  "node ", x->id, " holds fewer claims than its children");
    RADIXKV_CHECK(0 <= e.host_claims && e.host_claims <= e.claims &&
                      x->ref_count >= e.claims - e.host_claims,
                  kBroken, "node ", x->id, " has ", e.claims, " claims, ", e.host_claims,
                  " of them for host, and ", x->ref_count, " locks");
    RADIXKV_CHECK(0 <= e.host_claim_locks && e.host_claim_locks <= e.host_claims &&
                      (e.host_claim_locks == 0 || !x->has_host()),
                  kBroken, "node ", x->id, " has ", e.host_claim_locks, " host claim locks with ",
                  e.host_claims, " host claims");
    RADIXKV_CHECK(e.host_claims == 0 || x->has_host() || x->ref_count > 0, kBroken, "node ", x->id,
                  " is held by a host claim without a host copy but is not locked");
    claimed += e.claims > 0 ? x->length : 0;
    RADIXKV_CHECK(x->parent == root_ || x->timestamp <= x->parent->timestamp, kBroken, "node ",
                  x->id, " was used later than its parent");
    // The tiers: every node is somewhere, and each tier is closed toward the root.
    RADIXKV_CHECK(x->on_device || x->has_host(), kBroken, "node ", x->id,
                  " is neither on the device nor in host memory");
    RADIXKV_CHECK(!x->on_device || x->parent == root_ || x->parent->on_device, kBroken, "node ",
                  x->id, " is on the device but its parent is not");
    RADIXKV_CHECK(!x->has_host() || x->parent == root_ || x->parent->has_host(), kBroken, "node ",
                  x->id, " has a host copy but its parent has none");
    RADIXKV_CHECK(!x->backing_up || (x->on_device && !x->has_host()), kBroken, "node ", x->id,
                  " is being backed up but is not on the device without a host copy");
    RADIXKV_CHECK(!x->loading || (!x->on_device && x->has_host()), kBroken, "node ", x->id,
                  " is loading but is not host only");
    RADIXKV_CHECK(!x->backing_up || x->ref_count > 0, kBroken, "node ", x->id,
                  " is being backed up without a pin");
    const bool device_leaf = DeviceEvictable(x);
    RADIXKV_CHECK(device_leaf == heap_.Contains(x->id), kBroken, "node ", x->id,
                  device_leaf ? " may be evicted from the device but is not in its heap"
                              : " is in the device heap but may not be evicted");
    if (device_leaf) {
      const size_t pos = static_cast<size_t>(heap_.PositionOf(x->id));
      RADIXKV_CHECK(heap_.IdAt(pos) == x->id && heap_.KeyAt(pos) <= Key(x), kBroken, "node ", x->id,
                    " has a wrong device heap position or key");
      ++heap_members;
    }
    const bool host_leaf = HostEvictable(x);
    RADIXKV_CHECK(host_leaf == host_heap_.Contains(x->id), kBroken, "node ", x->id,
                  host_leaf ? " may be evicted from host but is not in its heap"
                            : " is in the host heap but may not be evicted");
    if (host_leaf) {
      const size_t pos = static_cast<size_t>(host_heap_.PositionOf(x->id));
      RADIXKV_CHECK(host_heap_.IdAt(pos) == x->id && host_heap_.KeyAt(pos) <= Key(x), kBroken,
                    "node ", x->id, " has a wrong host heap position or key");
      ++host_members;
    }
    if (const Quota* q = QuotaOf(NsOf(x))) {
      RADIXKV_CHECK(
          q->heap.Contains(x->id) == device_leaf && q->host_heap.Contains(x->id) == host_leaf,
          kBroken, "node ", x->id, " of namespace ", NsOf(x),
          " is not in its quota's heaps as it is in the tree's");
      for (const LruHeap* h : {&q->heap, &q->host_heap}) {
        if (!h->Contains(x->id)) continue;
        const size_t pos = static_cast<size_t>(h->PositionOf(x->id));
        RADIXKV_CHECK(h->IdAt(pos) == x->id && h->KeyAt(pos) <= Key(x), kBroken, "node ", x->id,
                      " has a wrong position or key in its namespace quota's heaps");
      }
      QuotaCount& c = quota_counts[NsOf(x)];
      c.device += x->on_device ? x->length : 0;
      c.host += x->has_host() ? x->length : 0;
      c.heap += device_leaf;
      c.host_heap += host_leaf;
    }
    if (x->on_device) {
      (Protected(x) ? protected_tokens : evictable) += x->length;
      device_tokens += x->length;
      const std::vector<int32_t> slots = slots_of(x->value(), x->length);
      const int64_t bad = FindOutOfRange(slots.data(), x->length, max_slots_);
      RADIXKV_CHECK(bad < 0, kBroken, "node ", x->id, " stores slot ", bad < 0 ? 0 : slots[bad],
                    ", outside [0, max_slots)");
      for (int32_t slot : slots) {
        RADIXKV_CHECK(stored_.Contains(slot), kBroken, "slot ", slot, " is stored but not marked");
      }
      const int64_t twice = seen.AddAll(slots.data(), x->length);
      RADIXKV_CHECK(twice < 0, kBroken, "slot ", twice < 0 ? 0 : slots[twice], " is stored twice");
    }
    if (x->has_host()) {
      host_tokens += x->length;
      host_only += x->on_device ? 0 : x->length;
      const std::vector<int32_t> slots = slots_of(Ex(x).host, x->length);
      const int64_t bad = FindOutOfRange(slots.data(), x->length);
      RADIXKV_CHECK(bad < 0, kBroken, "node ", x->id, " stores a negative host slot");
      for (int32_t slot : slots) {
        RADIXKV_CHECK(stored_host_.Contains(slot), kBroken, "host slot ", slot,
                      " is stored but not marked");
      }
      const int64_t twice = seen_host.AddAll(slots.data(), x->length);
      RADIXKV_CHECK(twice < 0, kBroken, "host slot ", twice < 0 ? 0 : slots[twice],
                    " is stored twice");
    }
    backing_up += x->backing_up ? x->length : 0;
    loading += x->loading ? x->length : 0;
    storage_writing += x->storage_writing ? x->length : 0;
    pins += Ex(x).host_pins;
    RADIXKV_CHECK(Ex(x).host_pins >= 0 && (Ex(x).host_pins == 0 || x->has_host()), kBroken, "node ",
                  x->id, " is pinned for a read from storage but has no host copy");
    RADIXKV_CHECK(!x->from_storage || (!x->on_device && x->has_host()), kBroken, "node ", x->id,
                  " is marked read from storage but is on the device or has no host copy");
    RADIXKV_CHECK(!x->storage_writing || x->has_host(), kBroken, "node ", x->id,
                  " is being written to storage without a host copy");
  }
  RADIXKV_CHECK(stored_.Count() == device_tokens, kBroken, stored_.Count(),
                " device slots are marked but ", device_tokens, " are stored");
  RADIXKV_CHECK(stored_host_.Count() == host_tokens, kBroken, stored_host_.Count(),
                " host slots are marked but ", host_tokens, " are stored");
  RADIXKV_CHECK(nodes == num_nodes_, kBroken, "node count ", num_nodes_, " but ", nodes,
                " reachable");
  RADIXKV_CHECK(static_cast<size_t>(nodes) + free_ids_.size() + 1 == nodes_.size(), kBroken,
                "node table leaks ids");
  RADIXKV_CHECK(evictable == evictable_size_, kBroken, "evictable_size is ", evictable_size_,
                " but unlocked device nodes hold ", evictable);
  RADIXKV_CHECK(protected_tokens == protected_size_, kBroken, "protected_size is ", protected_size_,
                " but locked device nodes hold ", protected_tokens);
  RADIXKV_CHECK(host_tokens == host_size_ && host_only == host_only_size_, kBroken,
                "host sizes are ", host_size_, " and ", host_only_size_,
                " host only, but nodes hold ", host_tokens, " and ", host_only);
  RADIXKV_CHECK(storage_writing == storage_writing_size_, kBroken,
                "writes to storage are counted as ", storage_writing_size_,
                " tokens, but nodes hold ", storage_writing);
  RADIXKV_CHECK(claimed == claimed_size_, kBroken, "claims are counted as holding ", claimed_size_,
                " tokens, but nodes hold ", claimed);
  RADIXKV_CHECK(pins == host_pins_, kBroken, "host pins are counted as ", host_pins_,
                " but nodes hold ", pins);
  RADIXKV_CHECK(backing_up == backing_up_size_ && loading == loading_size_, kBroken,
                "copies in flight are counted as ", backing_up_size_, " backing up and ",
                loading_size_, " loading, but nodes hold ", backing_up, " and ", loading);
  RADIXKV_CHECK(heap_members == static_cast<int64_t>(heap_.size()) && heap_.IsValid(), kBroken,
                "device LRU heap is out of order or holds dead nodes");
  RADIXKV_CHECK(host_members == static_cast<int64_t>(host_heap_.size()) && host_heap_.IsValid(),
                kBroken, "host LRU heap is out of order or holds dead nodes");
  RADIXKV_CHECK(heap_.room() >= nodes_.size() && host_heap_.room() >= nodes_.size() &&
                    free_ids_.capacity() >= nodes_.size() && victims_.capacity() >= nodes_.size(),
                kBroken, "room reserved for heap members, free ids or victims is below the node ",
                "count");
  RADIXKV_CHECK(extras_.empty() || extras_.size() == nodes_.size(), kBroken,
                "the nodes' extras column has ", extras_.size(), " rows for ", nodes_.size(),
                " nodes");
  for (const auto& [ns, q] : quotas_) {
    const QuotaCount c = quota_counts[ns];
    RADIXKV_CHECK(c.device == q->device && c.host == q->host, kBroken, "namespace ", ns,
                  " is counted as holding ", q->device, " device and ", q->host,
                  " host tokens, but its nodes hold ", c.device, " and ", c.host);
    RADIXKV_CHECK(c.heap == static_cast<int64_t>(q->heap.size()) && q->heap.IsValid() &&
                      c.host_heap == static_cast<int64_t>(q->host_heap.size()) &&
                      q->host_heap.IsValid() && q->heap.room() >= nodes_.size() &&
                      q->host_heap.room() >= nodes_.size(),
                  kBroken, "the heaps of namespace ", ns,
                  "'s quota are out of order, hold other nodes or lack room");
  }
}

std::vector<NodeInfo> RadixTree::Dump() const {
  std::vector<NodeInfo> out;
  std::vector<std::pair<const Node*, int64_t>> stack{{root_, -1}};
  while (!stack.empty()) {
    auto [x, index] = stack.back();
    stack.pop_back();
    std::vector<const Node*> children;
    x->children.ForEach([&](uint64_t, const Node* c) { children.push_back(c); });
    // Siblings in ascending key order (under the root, equal keys of
    // different namespaces in ascending namespace order).
    std::sort(children.begin(), children.end(), [this](const Node* a, const Node* b) {
      if (std::lexicographical_compare(a->key(), a->key() + a->length, b->key(),
                                       b->key() + b->length)) {
        return true;
      }
      return !std::lexicographical_compare(b->key(), b->key() + b->length, a->key(),
                                           a->key() + a->length) &&
             NsOf(a) < NsOf(b);
    });
    const size_t first = out.size();
    for (const Node* c : children) {
      NodeInfo info;
      info.parent = index;
      info.key.assign(c->key(), c->key() + c->length);
      if (c->on_device) {
        info.value.resize(static_cast<size_t>(c->length));
        ExpandSlots(c->value(), c, info.value.data());
      }
      if (c->has_host()) {
        info.host_value.resize(static_cast<size_t>(c->length));
        ExpandSlots(Ex(c).host, c, info.host_value.data());
      }
      info.ref_count = c->ref_count;
      info.timestamp = c->timestamp;
      info.ns = NsOf(c);
      out.push_back(std::move(info));
    }
    // Pushed in reverse, so the smallest child's subtree is listed first.
    for (size_t k = children.size(); k-- > 0;) {
      stack.push_back({children[k], static_cast<int64_t>(first + k)});
    }
  }
  return out;
}

}  // namespace radixkv
