// The radix prefix cache: a compressed trie from token sequences to the KV
// slot indices that hold their keys and values, with reference counts and
// exact LRU eviction.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "radixkv/child_map.h"
#include "radixkv/lru_heap.h"
#include "radixkv/node_arena.h"
#include "radixkv/slot_set.h"
#include "radixkv/slot_sink.h"

namespace radixkv {

/// Where the KV data of a node lives. Every node is `kDevice` today: the
/// field is the hook for a host tier, which will move a node whose device
/// slots were evicted to `kHost` (it keeps a host copy and stays in the tree)
/// instead of deleting it.
enum class NodeState : uint8_t { kDevice, kHost };

/// One edge of the radix tree: a run of tokens and the slot of each token.
/// Nodes are intrusive: each carries its own children, parent link, lock
/// count, LRU timestamp and heap position. Owned by the `RadixTree`.
struct Node {
  Node* parent = nullptr;
  ChildMap<Node> children;
  /// `2 * length` int32 values: tokens in [0, length), slots in [length, 2 * length),
  /// in a block of the tree's NodeArena (`data_slab` is its slab) with room
  /// for `capacity` tokens (a split may leave a node in a larger block).
  int32_t* data = nullptr;
  NodeArena::Slab* data_slab = nullptr;
  int64_t capacity = 0;
  int64_t length = 0;
  /// Tokens from the root to the end of this node.
  int64_t depth = 0;
  /// Number of locks on this node (locks on any descendant count too).
  int64_t ref_count = 0;
  /// Logical time of the last access; never earlier than any child's.
  uint64_t timestamp = 0;
  /// The key this node is filed under in its parent's children (its first
  /// token, or the hash of its first page), kept so eviction need not rehash.
  uint64_t child_key = 0;
  /// Bumped each time the id is freed, so handles to a dead node are
  /// detected. 64 bits: a hot id recycled a billion times a second would take
  /// centuries to wrap around to a stale handle's value.
  uint64_t generation = 0;
  /// Index in the tree's node table; reused after the node is freed.
  uint32_t id = 0;
  NodeState state = NodeState::kDevice;
  /// Scratch link used while a call is under way (Evict's list of victims).
  Node* next = nullptr;

  const int32_t* key() const noexcept { return data; }
  const int32_t* value() const noexcept { return data + length; }
  bool is_leaf() const noexcept { return children.empty(); }
};

/// A reference to the node that ends a matched prefix. Plain data: copying a
/// handle copies its lock count, so bindings keep one handle object per match.
struct Handle {
  /// Identifies the tree that made the handle.
  uint64_t tree_id = 0;
  uint64_t generation = 0;
  uint32_t node_id = 0;
  /// Tokens from the root to the node: the matched length.
  int64_t cached_len = 0;
  /// Locks taken through this handle and not yet released.
  int64_t lock_count = 0;
};

/// One node as seen by `RadixTree::Dump`: tokens, slots and bookkeeping.
struct NodeInfo {
  int64_t parent = -1;  // index into the dump, -1 for children of the root
  std::vector<int32_t> key;
  std::vector<int32_t> value;
  int64_t ref_count = 0;
  uint64_t timestamp = 0;
};

/// The radix tree. Token ids and slot indices are int32; lengths are in
/// tokens. With `page_size > 1` every node holds whole pages, children are
/// keyed by their first page, and inputs are rounded down to whole pages.
///
/// Every public call advances a logical clock by one tick. A match refreshes
/// the timestamp of exactly the matched tokens, an insert of every token on
/// its path. `Evict` removes unlocked leaves oldest first from an indexed heap
/// in O(k log n) for k nodes, with no scan of the tree. A refresh only writes
/// the timestamps (O(path)): a leaf's key in the heap may lag behind, and
/// Evict re-keys a lagging leaf when it reaches the top, which keeps the order
/// exact and costs each refreshed leaf at most one O(log n) fix.
///
/// Failures change nothing: every call checks its inputs and allocates what
/// it needs (node storage, table and heap room, the result's buffer) before
/// it changes the tree, so an invalid argument or a failed allocation leaves
/// the tree exactly as it was.
///
/// Not thread-safe: one thread at a time (the bindings hold a mutex).
class RadixTree {
 public:
  /// Slots must be below `max_slots` (the pool's size); kAnySlot allows
  /// every int32 slot >= 0. Throws kInvalidArgument if `page_size < 1` or
  /// `max_slots` is neither kAnySlot nor in [0, 2^31].
  static constexpr int64_t kAnySlot = -1;
  explicit RadixTree(int64_t page_size = 1, int64_t max_slots = kAnySlot);
  ~RadixTree();
  RadixTree(const RadixTree&) = delete;
  RadixTree& operator=(const RadixTree&) = delete;

  int64_t page_size() const noexcept { return page_size_; }
  uint64_t id() const noexcept { return id_; }

  int64_t max_slots() const noexcept { return max_slots_; }

  /// Finds the longest cached prefix of `tokens[0, n)` in whole pages, splits
  /// the last node if the prefix ends inside it, and writes the slot indices
  /// of the prefix to `out(cached_len)`. Returns a handle with no locks.
  /// O(n) plus O(log leaves) for the LRU update.
  Handle MatchPrefix(const int32_t* tokens, int64_t n, SlotSink out);
  /// The same, replacing `*slots` with the prefix's slots.
  Handle MatchPrefix(const int32_t* tokens, int64_t n, std::vector<int32_t>* slots) {
    return MatchPrefix(tokens, n, SlotSink::Into(slots));
  }

  /// Stores `tokens[0, m)` with `slots[0, m)`, m = n rounded down to whole
  /// pages, where not cached yet. Returns how many leading tokens were cached
  /// already; their `slots` are ignored and stay the caller's. Throws
  /// kInvalidArgument, changing nothing, if any of `slots[0, n)` is negative,
  /// not below `max_slots`, or repeated, or a slot to be stored is in the tree
  /// already.
  int64_t InsertPrefix(const int32_t* tokens, const int32_t* slots, int64_t n);

  /// Adds one lock on every node from the handle's node to the root.
  /// Throws kInvalidArgument for a handle of another tree or a freed node.
  void Lock(Handle* handle);
  /// Removes one lock taken through `handle`. Throws kInvalidArgument if the
  /// handle holds no lock or is stale.
  void Unlock(Handle* handle);

  /// Evicts least recently used unlocked leaves until at least `size` tokens
  /// are freed and writes their slots, in eviction order, to `out(count)`;
  /// returns the count. Whole nodes go. Throws kInvalidArgument for
  /// `size < 0` and kOutOfCapacity for `size > evictable_size()`, changing
  /// nothing; if `out` throws, the victims are put back and nothing changed.
  int64_t Evict(int64_t size, SlotSink out);
  /// The same, replacing `*slots` with the freed slots.
  void Evict(int64_t size, std::vector<int32_t>* slots) { Evict(size, SlotSink::Into(slots)); }

  /// Drops every node. Handles made before become stale.
  void Reset();

  /// Tokens in unlocked nodes (may be evicted).
  int64_t evictable_size() const noexcept { return evictable_size_; }
  /// Tokens in locked nodes.
  int64_t protected_size() const noexcept { return protected_size_; }
  /// Nodes, the root excluded.
  int64_t num_nodes() const noexcept { return num_nodes_; }
  /// Unlocked leaves, i.e. the eviction candidates.
  int64_t num_evictable_leaves() const noexcept { return static_cast<int64_t>(heap_.size()); }
  /// The slots stored in the tree.
  const SlotSet& stored_slots() const noexcept { return stored_; }
  /// Writes the slots of the handle's prefix to `out(cached_len)`. Throws
  /// kInvalidArgument for a foreign or stale handle.
  void HandleSlots(const Handle& handle, SlotSink out) const;
  void HandleSlots(const Handle& handle, std::vector<int32_t>* slots) const {
    HandleSlots(handle, SlotSink::Into(slots));
  }
  /// Whether `handle` refers to a live node of this tree.
  bool IsValid(const Handle& handle) const noexcept;

  /// Walks the whole tree and checks every counter and invariant: parent
  /// links, child keys, lengths and page alignment, depths, lock counts,
  /// timestamps, heap membership and order, that no slot is stored twice or
  /// out of range, and that the room reserved for node ids, heap members and
  /// free ids covers every node (so commits never allocate). Throws
  /// kIntegrity naming the first violation. O(tokens + nodes).
  void CheckIntegrity() const;

  /// Every node, parents before children, children in ascending key order.
  std::vector<NodeInfo> Dump() const;

 private:
  // A block of node storage owned until it is given to a node (or freed).
  class Storage {
   public:
    Storage() = default;
    Storage(NodeArena* arena, const int32_t* tokens, const int32_t* slots, int64_t length);
    Storage(Storage&& other) noexcept { *this = std::move(other); }
    Storage& operator=(Storage&& other) noexcept;
    ~Storage() { Free(); }
    explicit operator bool() const noexcept { return block_.data != nullptr; }
    // Takes `node`'s block (the node is left without one).
    static Storage Adopt(NodeArena* arena, Node* node) noexcept;
    // Gives the block, holding `length` tokens, to `node`, which holds none.
    void MoveTo(Node* node, int64_t length) noexcept;
    void Free() noexcept;

   private:
    NodeArena* arena_ = nullptr;
    NodeArena::Block block_;
    int64_t capacity_ = 0;  // tokens
  };

  // What a split of `node` at `pos` needs, allocated before anything changes:
  // the larger part keeps the node's block (its data moved in place), the
  // smaller gets a new one.
  struct SplitPlan {
    Node* node = nullptr;
    int64_t pos = 0;
    Storage smaller;
    ChildMap<Node> prefix_children;  // with room for the suffix and a new leaf
  };

  uint64_t ChildKey(const int32_t* tokens) const noexcept;
  Node* FindChild(const Node* node, const int32_t* tokens) const noexcept;
  // Ensures `k` free node ids, with heap room and free-list room for every
  // node. Throws std::bad_alloc; what it adds is free, so nothing visible
  // changes.
  void ReserveNodes(size_t k);
  // A node from the free ids holding `data` (`length` tokens, then slots),
  // linked to `parent` by its parent pointer only. Needs a reserved id.
  Node* TakeNode(Node* parent, Storage data, int64_t length) noexcept;
  void FreeNode(Node* node) noexcept;
  void FreeStorage(Node* node) noexcept;
  void PrepareSplit(Node* node, int64_t pos, uint32_t children, SplitPlan* plan);
  // Splits as planned (needs one reserved id) and returns the prefix node.
  Node* CommitSplit(SplitPlan* plan) noexcept;
  void Touch(Node* node) noexcept;
  bool InHeap(const Node* node) const noexcept { return heap_.Contains(node->id); }
  Node* Resolve(const Handle& handle, const char* what) const;
  void CopyPathSlots(const Node* node, int32_t* out) const noexcept;

  // Walks from the root over whole pages of `tokens[0, n)`. Stops at the
  // deepest fully matched node `*node`, and reports in `*partial` the child
  // matched for `*partial_len` tokens but not to its end (or null). Returns
  // the matched length. Changes nothing.
  int64_t Walk(const int32_t* tokens, int64_t n, Node** node, Node** partial,
               int64_t* partial_len) const;

  const int64_t page_size_;
  const int64_t max_slots_;
  const uint64_t id_;
  uint64_t clock_ = 0;
  NodeArena arena_;  // node storage; declared first so it outlives the nodes
  std::vector<std::unique_ptr<Node>> nodes_;  // by id; id 0 is the root
  Node* root_ = nullptr;
  std::vector<uint32_t> free_ids_;
  LruHeap heap_;  // unlocked leaves by id, oldest first
  SlotSet stored_;   // the slots stored in the tree
  SlotSet scratch_;  // working memory for input checks, empty between calls
  SlotRuns runs_;    // the runs of an insert's slots, found once per call
  int64_t evictable_size_ = 0;
  int64_t protected_size_ = 0;
  int64_t num_nodes_ = 0;
};

}  // namespace radixkv
