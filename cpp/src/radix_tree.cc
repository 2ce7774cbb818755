#include "radixkv/radix_tree.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <utility>

#include "radixkv/compare.h"
#include "radixkv/slot_set.h"
#include "radixkv/status.h"

namespace radixkv {
namespace {

constexpr ErrorCode kInvalid = ErrorCode::kInvalidArgument;
constexpr ErrorCode kBroken = ErrorCode::kIntegrity;

std::atomic<uint64_t> next_tree_id{1};

// Hash of one page of tokens. Four independent lanes over 64-bit words keep
// the multiply chains short for 512-token pages.
uint64_t HashPage(const int32_t* tokens, int64_t n) noexcept {
  constexpr uint64_t kMul = 0x9E3779B97F4A7C15ull;
  uint64_t lane[4] = {0x243F6A8885A308D3ull, 0x13198A2E03707344ull, 0xA4093822299F31D0ull,
                      0x082EFA98EC4E6C89ull};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 4; ++j) {
      uint64_t w;
      std::memcpy(&w, tokens + i + 2 * j, sizeof(w));
      lane[j] = (lane[j] ^ w) * kMul;
      lane[j] ^= lane[j] >> 29;
    }
  }
  for (; i < n; ++i) {
    lane[0] = ((lane[0] ^ static_cast<uint32_t>(tokens[i])) * kMul) ^ (lane[0] >> 31);
  }
  uint64_t h = static_cast<uint64_t>(n);
  for (uint64_t x : lane) h = (h ^ x) * kMul + (h >> 23);
  return h;
}

size_t StorageBytes(int64_t length) { return static_cast<size_t>(2 * length) * sizeof(int32_t); }

}  // namespace

RadixTree::Storage::Storage(NodeArena* arena, const int32_t* tokens, const int32_t* slots,
                            int64_t length)
    : arena_(arena), block_(arena->Allocate(StorageBytes(length))), capacity_(length) {
  auto* data = static_cast<int32_t*>(block_.data);
  std::memcpy(data, tokens, length * sizeof(int32_t));
  std::memcpy(data + length, slots, length * sizeof(int32_t));
}

RadixTree::Storage& RadixTree::Storage::operator=(Storage&& other) noexcept {
  Free();
  arena_ = other.arena_;
  block_ = other.block_;
  capacity_ = other.capacity_;
  other.block_ = NodeArena::Block{};
  return *this;
}

RadixTree::Storage RadixTree::Storage::Adopt(NodeArena* arena, Node* node) noexcept {
  Storage s;
  s.arena_ = arena;
  s.block_ = NodeArena::Block{node->data, node->data_slab};
  s.capacity_ = node->capacity;
  node->data = nullptr;
  node->data_slab = nullptr;
  return s;
}

void RadixTree::Storage::MoveTo(Node* node, int64_t length) noexcept {
  node->data = static_cast<int32_t*>(block_.data);
  node->data_slab = block_.slab;
  node->capacity = capacity_;
  node->length = length;
  block_ = NodeArena::Block{};
}

void RadixTree::Storage::Free() noexcept {
  if (block_.data != nullptr) arena_->Free(block_, StorageBytes(capacity_));
  block_ = NodeArena::Block{};
}

RadixTree::RadixTree(int64_t page_size, int64_t max_slots)
    : page_size_(page_size),
      max_slots_(max_slots),
      id_(next_tree_id.fetch_add(1, std::memory_order_relaxed)) {
  RADIXKV_CHECK(page_size >= 1, kInvalid, "page_size must be >= 1, got ", page_size);
  RADIXKV_CHECK(max_slots == kAnySlot || (max_slots >= 0 && max_slots <= (int64_t{1} << 31)),
                kInvalid, "max_slots must be in [0, 2**31], got ", max_slots);
  nodes_.push_back(std::make_unique<Node>());
  root_ = nodes_[0].get();
  ReserveNodes(0);
}

RadixTree::~RadixTree() {
  for (size_t i = 1; i < nodes_.size(); ++i) FreeStorage(nodes_[i].get());
}

void RadixTree::FreeStorage(Node* node) noexcept {
  if (node->data == nullptr) return;
  arena_.Free(NodeArena::Block{node->data, node->data_slab}, StorageBytes(node->capacity));
  node->data = nullptr;
  node->data_slab = nullptr;
}

uint64_t RadixTree::ChildKey(const int32_t* tokens) const noexcept {
  if (page_size_ == 1) return static_cast<uint32_t>(tokens[0]);
  return HashPage(tokens, page_size_);
}

Node* RadixTree::FindChild(const Node* node, const int32_t* tokens) const noexcept {
  if (page_size_ == 1) {
    return node->children.Find(ChildKey(tokens), [](const Node*) { return true; });
  }
  const size_t bytes = static_cast<size_t>(page_size_) * sizeof(int32_t);
  return node->children.Find(ChildKey(tokens), [&](const Node* child) {
    return std::memcmp(child->key(), tokens, bytes) == 0;
  });
}

void RadixTree::ReserveNodes(size_t k) {
  // Room first, so that every node, once made, can be a heap member and have
  // its id freed without allocating.
  const size_t want = nodes_.size() + (k > free_ids_.size() ? k - free_ids_.size() : 0);
  heap_.Reserve(want);
  if (free_ids_.capacity() < want) free_ids_.reserve(std::max(want, 2 * free_ids_.capacity()));
  while (free_ids_.size() < k) {
    auto node = std::make_unique<Node>();
    node->id = static_cast<uint32_t>(nodes_.size());
    nodes_.push_back(std::move(node));  // on failure the new node is simply dropped
    free_ids_.push_back(nodes_.back()->id);
  }
}

Node* RadixTree::TakeNode(Node* parent, Storage data, int64_t length) noexcept {
  Node* node = nodes_[free_ids_.back()].get();
  free_ids_.pop_back();
  data.MoveTo(node, length);
  node->child_key = ChildKey(node->key());
  node->parent = parent;
  node->depth = parent->depth + length;
  node->ref_count = 0;
  node->timestamp = clock_;
  node->state = NodeState::kDevice;
  ++num_nodes_;
  return node;
}

void RadixTree::FreeNode(Node* node) noexcept {
  FreeStorage(node);
  node->children.Clear();
  node->parent = nullptr;
  node->next = nullptr;
  node->length = 0;
  node->ref_count = 0;
  ++node->generation;
  free_ids_.push_back(node->id);  // room reserved by ReserveNodes
  --num_nodes_;
}

void RadixTree::PrepareSplit(Node* node, int64_t pos, uint32_t children, SplitPlan* plan) {
  plan->node = node;
  plan->pos = pos;
  const int64_t rest = node->length - pos;
  plan->smaller = pos <= rest ? Storage(&arena_, node->key(), node->value(), pos)
                              : Storage(&arena_, node->key() + pos, node->value() + pos, rest);
  plan->prefix_children.Reserve(children);
}

Node* RadixTree::CommitSplit(SplitPlan* plan) noexcept {
  Node* node = plan->node;
  const int64_t pos = plan->pos, len = node->length, rest = len - pos;
  Node* parent = node->parent;
  Node* prefix;
  if (pos <= rest) {
    // The suffix keeps the block: its tokens and slots move to the front.
    prefix = TakeNode(parent, std::move(plan->smaller), pos);
    std::memmove(node->data, node->data + pos, rest * sizeof(int32_t));
    std::memmove(node->data + rest, node->data + len + pos, rest * sizeof(int32_t));
    node->length = rest;
  } else {
    // The prefix takes the block: its tokens stay, its slots move down.
    Storage suffix = std::move(plan->smaller);
    prefix = TakeNode(parent, Storage::Adopt(&arena_, node), pos);
    std::memmove(prefix->data + pos, prefix->data + len, pos * sizeof(int32_t));
    suffix.MoveTo(node, rest);
  }
  prefix->ref_count = node->ref_count;
  prefix->timestamp = node->timestamp;
  prefix->children = std::move(plan->prefix_children);
  parent->children.Replace(node->child_key, node, prefix);

  node->depth = prefix->depth + rest;
  node->child_key = ChildKey(node->key());
  node->parent = prefix;
  prefix->children.Insert(node->child_key, node);  // room reserved
  return prefix;
}

void RadixTree::Touch(Node* node) noexcept {
  // The heap is not updated here: a leaf's key there may fall behind its
  // timestamp, and Evict puts it right when it reaches the top (see Evict).
  for (Node* x = node; x != root_; x = x->parent) x->timestamp = clock_;
}

int64_t RadixTree::Walk(const int32_t* tokens, int64_t n, Node** node, Node** partial,
                        int64_t* partial_len) const {
  Node* cur = root_;
  int64_t pos = 0;
  *partial = nullptr;
  *partial_len = 0;
  while (pos < n) {
    Node* child = FindChild(cur, tokens + pos);
    if (child == nullptr) break;
    const int64_t limit = std::min(child->length, n - pos);
    int64_t m = static_cast<int64_t>(FirstMismatch(child->key(), tokens + pos, limit));
    m -= m % page_size_;
    pos += m;
    if (m < child->length) {
      *partial = child;
      *partial_len = m;
      break;
    }
    cur = child;
  }
  *node = cur;
  return pos;
}

Handle RadixTree::MatchPrefix(const int32_t* tokens, int64_t n, SlotSink out) {
  RADIXKV_CHECK(n >= 0, kInvalid, "input length must be >= 0, got ", n);
  n -= n % page_size_;
  Node* node;
  Node* partial;
  int64_t partial_len;
  const int64_t matched = Walk(tokens, n, &node, &partial, &partial_len);
  SplitPlan split;
  if (partial != nullptr) {
    ReserveNodes(1);
    PrepareSplit(partial, partial_len, 1, &split);
  }
  int32_t* slots = out(matched);
  // Nothing below allocates or throws.
  ++clock_;
  if (partial != nullptr) node = CommitSplit(&split);
  Touch(node);
  CopyPathSlots(node, slots);
  return Handle{id_, node->generation, node->id, node->depth, 0};
}

int64_t RadixTree::InsertPrefix(const int32_t* tokens, const int32_t* slots, int64_t n) {
  RADIXKV_CHECK(n >= 0, kInvalid, "input length must be >= 0, got ", n);
  // All of `slots` is checked, the cached part and a partial last page too:
  // the caller frees its own copies of those, so a bad one is a bug either way.
  runs_.Assign(slots, n);
  struct ShrinkRuns {
    SlotRuns& runs;
    ~ShrinkRuns() { runs.Shrink(); }
  } shrink{runs_};
  CheckSlots(runs_, slots, "indices", &scratch_, max_slots_);
  n -= n % page_size_;
  Node* node;
  Node* partial;
  int64_t partial_len;
  const int64_t pos = Walk(tokens, n, &node, &partial, &partial_len);
  runs_.DropBefore(pos);
  runs_.DropAfter(n);
  const int64_t stored = stored_.AddAll(runs_);
  RADIXKV_CHECK(stored < 0, kInvalid, "indices[", stored, "] = ", stored < 0 ? 0 : slots[stored],
                " is already stored in the cache");
  SplitPlan split;
  Storage leaf_data;
  try {
    ReserveNodes((partial != nullptr) + (pos < n));
    if (partial != nullptr) PrepareSplit(partial, partial_len, 1 + (pos < n), &split);
    if (pos < n) {
      leaf_data = Storage(&arena_, tokens + pos, slots + pos, n - pos);
      if (partial == nullptr) node->children.Reserve(node->children.size() + 1);
    }
  } catch (...) {
    stored_.RemoveAll(runs_);
    throw;
  }
  // Nothing below allocates or throws.
  ++clock_;
  if (partial != nullptr) node = CommitSplit(&split);
  Touch(node);
  if (leaf_data) {
    Node* leaf = TakeNode(node, std::move(leaf_data), n - pos);
    if (InHeap(node)) heap_.Erase(node->id);
    node->children.Insert(leaf->child_key, leaf);
    heap_.Push(leaf->id, leaf->timestamp);
    evictable_size_ += leaf->length;
  }
  return pos;
}

Node* RadixTree::Resolve(const Handle& handle, const char* what) const {
  RADIXKV_CHECK(handle.tree_id == id_, kInvalid, what, " belongs to another cache manager");
  RADIXKV_CHECK(IsValid(handle), kInvalid, what,
                " is stale: its node was evicted or the cache was reset");
  return nodes_[handle.node_id].get();
}

bool RadixTree::IsValid(const Handle& handle) const noexcept {
  // Freeing a node bumps its generation, so a matching generation means the
  // node is the one the handle was made for, still in the tree.
  return handle.tree_id == id_ && handle.node_id < nodes_.size() &&
         nodes_[handle.node_id]->generation == handle.generation;
}

void RadixTree::CopyPathSlots(const Node* node, int32_t* out) const noexcept {
  for (const Node* x = node; x != root_; x = x->parent) {
    std::memcpy(out + (x->depth - x->length), x->value(), x->length * sizeof(int32_t));
  }
}

void RadixTree::HandleSlots(const Handle& handle, SlotSink out) const {
  const Node* node = Resolve(handle, "handle");
  CopyPathSlots(node, out(node->depth));
}

void RadixTree::Lock(Handle* handle) {
  Node* node = Resolve(*handle, "handle");
  ++clock_;
  for (Node* x = node; x != root_; x = x->parent) {
    if (x->ref_count == 0) {
      evictable_size_ -= x->length;
      protected_size_ += x->length;
      if (InHeap(x)) heap_.Erase(x->id);
    }
    ++x->ref_count;
  }
  ++handle->lock_count;
}

void RadixTree::Unlock(Handle* handle) {
  Node* node = Resolve(*handle, "handle");
  RADIXKV_CHECK(handle->lock_count > 0, kInvalid,
                "handle is not locked: unlock without a matching lock");
  for (Node* x = node; x != root_; x = x->parent) {
    RADIXKV_CHECK(x->ref_count > 0, kBroken, "node on the handle's path has no lock to release");
  }
  ++clock_;
  for (Node* x = node; x != root_; x = x->parent) {
    if (--x->ref_count == 0) {
      evictable_size_ += x->length;
      protected_size_ -= x->length;
      if (x->is_leaf()) heap_.Push(x->id, x->timestamp);  // room reserved
    }
  }
  --handle->lock_count;
}

int64_t RadixTree::Evict(int64_t size, SlotSink out) {
  RADIXKV_CHECK(size >= 0, kInvalid, "size must be >= 0, got ", size);
  RADIXKV_CHECK(size <= evictable_size_, ErrorCode::kOutOfCapacity, "cannot evict size=", size,
                " tokens: evictable_size is ", evictable_size_);
  // Unlink the victims, oldest first, keeping their storage and their
  // parents' tables, so they can be put back if `out` fails.
  Node* victims = nullptr;
  auto put_back = [&]() noexcept {
    // Most recent first: each victim goes back under its parent, which stops
    // being a leaf.
    for (Node* x = victims; x != nullptr;) {
      Node* parent = x->parent;
      Node* next = x->next;
      if (InHeap(parent)) heap_.Erase(parent->id);
      parent->children.Insert(x->child_key, x);  // the kept table has room
      heap_.Push(x->id, x->timestamp);
      x->next = nullptr;
      x = next;
    }
  };
  int64_t freed = 0;
  while (freed < size) {
    if (heap_.empty()) {
      put_back();
      throw Error(kBroken, StrCat("no evictable leaf left with ", size - freed,
                                  " evictable tokens still counted"));
    }
    Node* x = nodes_[heap_.top()].get();
    if (heap_.KeyAt(0) != x->timestamp) {
      // Touched since it was keyed: every key is at most its leaf's
      // timestamp, so a top whose key is current is the least recently used
      // leaf. Re-key this one and look again.
      heap_.Update(x->id, x->timestamp);
      continue;
    }
    heap_.Pop();
    if (!heap_.empty()) {
      // Overlap the next victim's cache misses with the work on this one.
      const Node* next = nodes_[heap_.top()].get();
      __builtin_prefetch(next);
      __builtin_prefetch(next->data);
    }
    Node* parent = x->parent;
    parent->children.Erase(x->child_key, x, /*keep_table=*/true);
    x->next = victims;
    victims = x;
    freed += x->length;
    if (parent != root_ && parent->ref_count == 0 && parent->is_leaf()) {
      heap_.Push(parent->id, parent->timestamp);
    }
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
    end -= x->length;
    std::memcpy(slots + end, x->value(), x->length * sizeof(int32_t));
    evictable_size_ -= x->length;
    stored_.RemoveAll(x->value(), x->length);
    if (parent->children.empty()) parent->children.Clear();
    FreeNode(x);
    x = next;
  }
  return freed;
}

void RadixTree::Reset() {
  for (size_t i = 1; i < nodes_.size(); ++i) {
    if (nodes_[i]->parent != nullptr) FreeNode(nodes_[i].get());
  }
  root_->children.Clear();
  ++root_->generation;
  heap_.Clear();
  stored_.Clear();
  evictable_size_ = 0;
  protected_size_ = 0;
  ++clock_;
}

void RadixTree::CheckIntegrity() const {
  int64_t evictable = 0, protected_tokens = 0, nodes = 0, heap_members = 0, tokens = 0;
  SlotSet seen;
  std::vector<const Node*> stack{root_};
  RADIXKV_CHECK(root_->parent == nullptr && root_->length == 0 && root_->depth == 0, kBroken,
                "root node has a parent or tokens");
  while (!stack.empty()) {
    const Node* x = stack.back();
    stack.pop_back();
    int64_t child_refs = 0;
    x->children.ForEach([&](uint64_t key, const Node* child) {
      RADIXKV_CHECK(child->parent == x, kBroken, "node ", child->id, " has a wrong parent link");
      RADIXKV_CHECK(child->length > 0 && child->data != nullptr, kBroken, "node ", child->id,
                    " is empty");
      RADIXKV_CHECK(ChildKey(child->key()) == key && child->child_key == key, kBroken, "node ",
                    child->id,
                    " is filed under a key that is not its first page");
      child_refs += child->ref_count;
      stack.push_back(child);
    });
    if (x == root_) continue;
    ++nodes;
    RADIXKV_CHECK(x->id < nodes_.size() && nodes_[x->id].get() == x, kBroken, "node ", x->id,
                  " is not in the node table");
    RADIXKV_CHECK(x->length % page_size_ == 0, kBroken, "node ", x->id, " has length ", x->length,
                  ", not a multiple of page_size ", page_size_);
    RADIXKV_CHECK(x->depth == x->parent->depth + x->length, kBroken, "node ", x->id,
                  " has a wrong depth");
    RADIXKV_CHECK(x->ref_count >= child_refs, kBroken, "node ", x->id, " has ref_count ",
                  x->ref_count, " below its children's total ", child_refs);
    RADIXKV_CHECK(x->parent == root_ || x->timestamp <= x->parent->timestamp, kBroken, "node ",
                  x->id, " was used later than its parent");
    const bool evictable_leaf = x->ref_count == 0 && x->is_leaf();
    const bool in_heap = InHeap(x);
    RADIXKV_CHECK(evictable_leaf == in_heap, kBroken, "node ", x->id,
                  evictable_leaf ? " is an unlocked leaf missing from the LRU heap"
                                 : " is in the LRU heap but is locked or has children");
    if (in_heap) {
      const size_t pos = static_cast<size_t>(heap_.PositionOf(x->id));
      RADIXKV_CHECK(heap_.IdAt(pos) == x->id && heap_.KeyAt(pos) <= x->timestamp, kBroken,
                    "node ", x->id, " has a wrong heap position or key");
      ++heap_members;
    }
    (x->ref_count == 0 ? evictable : protected_tokens) += x->length;
    tokens += x->length;
    const int64_t bad = FindOutOfRange(x->value(), x->length, max_slots_);
    RADIXKV_CHECK(bad < 0, kBroken, "node ", x->id, " stores slot ",
                  bad < 0 ? 0 : x->value()[bad], ", outside [0, max_slots)");
    for (int64_t i = 0; i < x->length; ++i) {
      RADIXKV_CHECK(stored_.Contains(x->value()[i]), kBroken, "slot ", x->value()[i],
                    " is stored but not marked");
    }
    const int64_t twice = seen.AddAll(x->value(), x->length);
    RADIXKV_CHECK(twice < 0, kBroken, "slot ", twice < 0 ? 0 : x->value()[twice],
                  " is stored twice");
  }
  const int64_t marked = stored_.Count();
  RADIXKV_CHECK(marked == tokens, kBroken, marked, " slots are marked but ", tokens,
                " are stored");
  RADIXKV_CHECK(nodes == num_nodes_, kBroken, "node count ", num_nodes_, " but ", nodes,
                " reachable");
  RADIXKV_CHECK(static_cast<size_t>(nodes) + free_ids_.size() + 1 == nodes_.size(), kBroken,
                "node table leaks ids");
  RADIXKV_CHECK(evictable == evictable_size_, kBroken, "evictable_size is ", evictable_size_,
                " but unlocked nodes hold ", evictable);
  RADIXKV_CHECK(protected_tokens == protected_size_, kBroken, "protected_size is ",
                protected_size_, " but locked nodes hold ", protected_tokens);
  RADIXKV_CHECK(heap_members == static_cast<int64_t>(heap_.size()) && heap_.IsValid(), kBroken,
                "LRU heap is out of order or holds dead nodes");
  RADIXKV_CHECK(heap_.room() >= nodes_.size() && free_ids_.capacity() >= nodes_.size(), kBroken,
                "room reserved for heap members or free ids is below the node count");
}

std::vector<NodeInfo> RadixTree::Dump() const {
  std::vector<NodeInfo> out;
  std::vector<std::pair<const Node*, int64_t>> stack{{root_, -1}};
  while (!stack.empty()) {
    auto [x, index] = stack.back();
    stack.pop_back();
    std::vector<const Node*> children;
    x->children.ForEach([&](uint64_t, const Node* c) { children.push_back(c); });
    std::sort(children.begin(), children.end(), [](const Node* a, const Node* b) {
      return std::lexicographical_compare(a->key(), a->key() + a->length, b->key(),
                                          b->key() + b->length);
    });
    const size_t first = out.size();
    for (const Node* c : children) {
      NodeInfo info;
      info.parent = index;
      info.key.assign(c->key(), c->key() + c->length);
      info.value.assign(c->value(), c->value() + c->length);
      info.ref_count = c->ref_count;
      info.timestamp = c->timestamp;
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
