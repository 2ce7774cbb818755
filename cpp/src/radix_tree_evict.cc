// Eviction on both tiers: the oldest unlocked device leaves (Evict), the
// oldest host copies (EvictHost), and the device leaves write_back copies
// to host first. Each pops its victims from its tier's heap with PopOldest.
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

Node* RadixTree::PopOldest(LruHeap* heap) noexcept {
  while (!heap->empty()) {
    Node* x = nodes_[heap->top()].get();
    const uint64_t key = Key(x);
    if (heap->KeyAt(0) == key) {
      heap->Pop();
      return x;
    }
    // Touched since it was keyed: every key is at most its node's current
    // one, so a top whose key is current is the oldest. Re-key this one and
    // look again.
    heap->Update(x->id, key);
  }
  return nullptr;
}

int64_t RadixTree::Evict(int64_t size, SlotSink out) {
  RADIXKV_CHECK(size >= 0, kInvalid, "size must be >= 0, got ", size);
  RADIXKV_CHECK(size <= evictable_size_, ErrorCode::kOutOfCapacity, "cannot evict size=", size,
                " tokens: evictable_size is ", evictable_size_);
  // Take the victims, oldest first, keeping their storage and their parents'
  // tables, so they can be put back if `out` fails. A victim with a host copy
  // stays in the tree, host only; one without is unlinked (deleted at commit).
  Node* victims = nullptr;
  auto put_back = [&]() noexcept {
    for (Node* x = victims; x != nullptr;) {  // most recent first
      Node* parent = x->parent;
      Node* next = x->next;
      if (!x->has_host()) parent->children.Insert(x->child_key, x);  // the kept table has room
      SetOnDevice(x, true);
      Refresh(x);
      Refresh(parent);
      x->next = nullptr;
      x = next;
    }
  };
  int64_t freed = 0;
  while (freed < size) {
    Node* x = PopOldest(&heap_);
    if (x == nullptr) {
      put_back();
      throw Error(kBroken, StrCat("no evictable leaf left with ", size - freed,
                                  " evictable tokens still counted"));
    }
    if (!heap_.empty()) {
      // Overlap the next victim's cache misses with the work on this one.
      const Node* next = nodes_[heap_.top()].get();
      __builtin_prefetch(next);
      __builtin_prefetch(next->data);
    }
    Node* parent = x->parent;
    if (!x->has_host()) parent->children.Erase(x->child_key, x, /*keep_table=*/true);
    SetOnDevice(x, false);
    Refresh(x);
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
  // Commit: the slots in eviction order (the list is newest first).
  ++clock_;
  int64_t end = freed;
  for (Node* x = victims; x != nullptr;) {
    Node* parent = x->parent;
    Node* next = x->next;
    x->next = nullptr;
    end -= x->length;
    std::memcpy(slots + end, x->value(), x->length * sizeof(int32_t));
    stored_.RemoveAll(x->value(), x->length);
    if (!x->has_host()) {
      if (parent->children.empty()) parent->children.Clear();
      FreeNode(x);
    } else {
      // Its device pages are gone: a handle to its device part is stale, as
      // if the node had been deleted (a match gives host-only nodes anew).
      ++x->generation;
    }
    x = next;
  }
  return freed;
}

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
    Node* x = PopOldest(&host_heap_);
    if (x == nullptr) {
      put_back();
      throw Error(ErrorCode::kOutOfCapacity,
                  StrCat("cannot evict size=", size, " host tokens: only ", freed,
                         " can go now (of ", host_size_,
                         " with a host copy, the rest are "
                         "being loaded, or ancestors of host copies that stay)"));
    }
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

std::vector<TierCopy> RadixTree::EvictionCandidatesWithoutHost(int64_t size) {
  // Pop the leaves Evict would take first, note those without a host copy,
  // and put every one back (the same keys: nothing visible changes).
  std::vector<uint32_t> popped;
  std::vector<TierCopy> out;
  int64_t covered = 0;
  while (covered < size) {
    Node* x = PopOldest(&heap_);
    if (x == nullptr) break;
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

}  // namespace radixkv
