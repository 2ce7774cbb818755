// Eviction on both tiers: the oldest unlocked device leaves (Evict), the
// oldest host copies (EvictHost), and the device leaves write_back copies
// to host first. Each pops its victims from its tier's heap with PopOldest:
// the tree's, or a namespace quota's (radix_tree_quota.cc).
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
    Node* x = nodes_[heap->top()];
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

namespace {

// One eviction, the same on both tiers: take victims (`pop` gives the
// oldest, null when none is left; `take` takes it out of its tier, keeping
// its storage and its parent's table) until they hold `size` tokens, ask
// `out` for room for their slots, then `commit` each victim with its slots'
// place in that room, oldest victim last in the room. If too few can be
// taken (`short_of(freed)` is the error; with `partial`, what was taken is
// evicted instead) or `out` throws, `undo` puts every victim back, newest
// first, and nothing has changed. Returns the tokens freed. `victims` is
// scratch with room for every node of the tree (empty between calls).
template <typename Pop, typename Take, typename Undo, typename Commit, typename ShortOf>
inline __attribute__((always_inline)) int64_t EvictVictims(int64_t size, int64_t page_size,
                                                           const SlotSink& out,
                                                           std::vector<Node*>* victims,
                                                           bool partial, Pop pop, Take take,
                                                           Undo undo, Commit commit,
                                                           ShortOf short_of) {
  auto put_back = [&]() noexcept {
    for (auto it = victims->rbegin(); it != victims->rend(); ++it) undo(*it);
    victims->clear();
  };
  int64_t freed = 0;
  while (freed < size) {
    Node* x = pop();
    if (x == nullptr) {
      if (partial) break;
      put_back();
      throw short_of(freed);
    }
    take(x);
    victims->push_back(x);  // room reserved (ReserveNodes)
    freed += x->length;
  }
  // Slots, or with a page sink page ids (`unit` tokens an entry).
  const int64_t unit = out.pages() ? page_size : 1;
  int32_t* slots;
  try {
    slots = out(freed / unit);
  } catch (...) {
    put_back();
    throw;
  }
  // The slots in eviction order, newest victim first from the room's end.
  int64_t end = freed;
  for (auto it = victims->rbegin(); it != victims->rend(); ++it) {
    end -= (*it)->length;
    commit(*it, slots + end / unit);
  }
  victims->clear();
  return freed;
}

}  // namespace

int64_t RadixTree::Evict(int64_t size, SlotSink out) {
  RequireAligned(out.pages());
  RADIXKV_CHECK(size >= 0, kInvalid, "size must be >= 0, got ", size);
  RADIXKV_CHECK(size <= evictable_size_, ErrorCode::kOutOfCapacity, "cannot evict size=", size,
                " tokens: evictable_size is ", evictable_size_);
  return EvictDevice(&heap_, size, out, false);
}

int64_t RadixTree::EvictDevice(LruHeap* heap, int64_t size, SlotSink out, bool partial) {
  RequireAligned(out.pages());
  // A victim with a host copy stays in the tree, host only; one without is
  // unlinked (deleted at commit). Refresh takes it out of the other heaps.
  auto pop = [&]() {
    Node* x = PopOldest(heap);
    if (x != nullptr && !heap->empty()) {
      // Overlap the next victim's cache misses with the work on this one.
      const Node* next = nodes_[heap->top()];
      __builtin_prefetch(next);
      __builtin_prefetch(next->data);
    }
    return x;
  };
  auto take = [&](Node* x) {
    Node* parent = x->parent;
    if (!x->has_host()) parent->children.Erase(x->child_key, x, /*keep_table=*/true);
    SetOnDevice(x, false);
    Refresh(x);
    Refresh(parent);
  };
  auto undo = [&](Node* x) noexcept {
    Node* parent = x->parent;
    if (!x->has_host()) parent->children.Insert(x->child_key, x);  // the kept table has room
    SetOnDevice(x, true);
    Refresh(x);
    Refresh(parent);
  };
  auto commit = [&](Node* x, int32_t* slots) {
    const int64_t pages = Pages(x);
    Emit(x->value(), x, slots, out.pages());
    stored_.RemovePages(x->value(), pages, page_size_);
    if (!x->has_host()) {
      Node* parent = x->parent;
      if (parent->children.empty()) parent->children.Clear();
      FreeNode(x);
    } else {
      // Its device pages are gone: a handle to its device part is stale, as
      // if the node had been deleted (a match gives host-only nodes anew).
      ++x->generation;
    }
  };
  auto short_of = [&](int64_t freed) {
    return Error(kBroken, StrCat("no evictable leaf left with ", size - freed,
                                 " evictable tokens still counted"));
  };
  const int64_t freed =
      EvictVictims(size, page_size_, out, &victims_, partial, pop, take, undo, commit, short_of);
  ++clock_;
  return freed;
}

void RadixTree::LeaveHostHeaps(Node* x) noexcept {
  if (host_heap_.Contains(x->id)) host_heap_.Erase(x->id);
  Quota* q = QuotaOf(NsOf(x));
  if (q != nullptr && q->host_heap.Contains(x->id)) q->host_heap.Erase(x->id);
}

int64_t RadixTree::EvictHost(int64_t size, SlotSink out) {
  RequireAligned(out.pages());
  RADIXKV_CHECK(size >= 0, kInvalid, "size must be >= 0, got ", size);
  return EvictHostCopies(&host_heap_, size, out, false);
}

int64_t RadixTree::EvictHostCopies(LruHeap* heap, int64_t size, SlotSink out, bool partial) {
  RequireAligned(out.pages());
  // A victim also on the device keeps its node; a host-only one (which has
  // no children) is unlinked and deleted at commit.
  auto pop = [&]() { return PopOldest(heap); };
  auto take = [&](Node* x) {
    Node* parent = x->parent;
    if (!x->on_device) parent->children.Erase(x->child_key, x, /*keep_table=*/true);
    --parent->host_children;
    LeaveHostHeaps(x);
    CountHost(x, -1);
    Refresh(parent);
  };
  auto undo = [&](Node* x) noexcept {
    Node* parent = x->parent;
    if (!x->on_device) parent->children.Insert(x->child_key, x);  // the kept table has room
    ++parent->host_children;
    CountHost(x, +1);
    Refresh(x);  // back into the host heaps (room reserved)
    Refresh(parent);
  };
  auto commit = [&](Node* x, int32_t* slots) {
    const int64_t pages = Pages(x);
    Emit(Ex(x).host, x, slots, out.pages());
    stored_host_.RemovePages(Ex(x).host, pages, page_size_);
    FreeHost(x);
    if (x->on_device) {
      Refresh(x);
    } else {
      Node* parent = x->parent;
      if (parent->children.empty()) parent->children.Clear();
      FreeNode(x);
    }
  };
  auto short_of = [&](int64_t freed) {
    return Error(ErrorCode::kOutOfCapacity,
                 StrCat("cannot evict size=", size, " host tokens: only ", freed,
                        " can go now (of ", host_size_,
                        " with a host copy, the rest are being loaded, or ancestors of host "
                        "copies that stay)"));
  };
  const int64_t freed =
      EvictVictims(size, page_size_, out, &victims_, partial, pop, take, undo, commit, short_of);
  ++clock_;
  return freed;
}

std::vector<TierCopy> RadixTree::EvictionCandidatesWithoutHost(int64_t size, const uint64_t* ns) {
  LruHeap* heap =
      ns == nullptr ? &heap_ : &RequireQuota(*ns, "eviction_candidates_without_host")->heap;
  // Pop the leaves Evict would take first, note those without a host copy,
  // and put every one back (the same keys: nothing visible changes).
  std::vector<uint32_t> popped;
  std::vector<TierCopy> out;
  int64_t covered = 0;
  while (covered < size) {
    Node* x = PopOldest(heap);
    if (x == nullptr) break;
    popped.push_back(x->id);
    covered += x->length;
    if (x->has_host() || x->backing_up) continue;
    // Up to the path's host copy, or to a node an earlier copy covers (which
    // is begun first, so this one's parent is backing up by then).
    Node* top = x;
    auto covered_already = [&](const Node* n) {
      for (const TierCopy& c : out) {
        for (Node* y = nodes_[c.node_id]; y != root_ && y->depth > c.start; y = y->parent) {
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
  for (uint32_t id : popped) heap->Push(id, Key(nodes_[id]));
  return out;
}

}  // namespace radixkv
