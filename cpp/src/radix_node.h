// The radix tree's private parts: its node, the blocks that hold a node's
// tokens and slots, and the small inline functions of the tree's sources.
// Included by cpp/src/radix_tree*.cc (and white-box tests) only; the public
// API is radixkv/radix_tree.h.
#pragma once

#include <cstdint>
#include <utility>

#include "radixkv/child_map.h"
#include "radixkv/node_arena.h"
#include "radixkv/radix_tree.h"
#include "radixkv/slot_set.h"
#include "radixkv/status.h"

namespace radixkv {

/// Where a node's K/V is: on the device, in host memory, or both.
enum class NodeState : uint8_t { kDevice, kHost, kDeviceAndHost };

/// One edge of the radix tree: a run of tokens and the device slots of its
/// pages while the node is on the device. A page's slots are consecutive, so
/// a node keeps one slot per page, the page's first (`length / page_size` of
/// them; at page_size 1, one per token). Nodes are intrusive: each carries
/// its own children, parent link, lock count, LRU timestamp and tier flags.
/// What few trees use (a namespace, a host copy, claims, reads from storage,
/// the fifo clock) is in the node's `NodeExtra`. Owned by the `RadixTree`,
/// in its `NodeTable`: 128 bytes a node, so a cached token costs its token,
/// its share of a page slot and little more.
struct Node {
  Node()
      : on_device(true),
        backing_up(false),
        loading(false),
        storage_writing(false),
        from_storage(false),
        hosted(false) {}

  // The fields a walk and an eviction touch come first (one cache line).
  Node* parent = nullptr;
  ChildMap<Node> children;
  /// The tokens in [0, length), then the first device slot of each page
  /// (meaningful while `on_device`), in a block of the tree's NodeArena
  /// (`data_slab` is its slab) with room for `capacity` tokens and their
  /// pages (a split may leave a node in a larger block).
  int32_t* data = nullptr;
  int64_t length = 0;
  /// Tokens from the root to the end of this node.
  int64_t depth = 0;
  /// Number of locks on this node (locks on any descendant count too), by
  /// requests and by copies in flight that read its device pages.
  int64_t ref_count = 0;
  /// Logical time of the last access; never earlier than any child's.
  uint64_t timestamp = 0;
  /// The key this node is filed under in its parent's children (its first
  /// token, or the hash of its first page, mixed with the namespace under the
  /// root), kept so eviction need not rehash.
  uint64_t child_key = 0;
  /// Bumped each time the id is freed (only then): copies in flight name
  /// their node by it, since a node may leave the device meanwhile.
  uint64_t incarnation = 0;
  /// Bumped each time the id is freed, and when the node leaves the device
  /// for host only, so handles to a dead node (or to device pages that are
  /// gone) are detected. 64 bits: a hot id recycled a billion times a second would take
  /// centuries to wrap around to a stale handle's value.
  uint64_t generation = 0;
  NodeArena::Slab* data_slab = nullptr;
  /// Tokens the data block has room for (at most UINT32_MAX: NodeBlock).
  uint32_t capacity = 0;
  /// Index in the tree's node table; reused after the node is freed.
  uint32_t id = 0;
  /// Children on the device, and children with a host copy or one being made.
  uint32_t device_children = 0;
  uint32_t host_children = 0;
  /// Matches that reached this node (write_through_selective backs up a
  /// node on its second hit; the lfu policy evicts the fewest first).
  uint32_t hits = 0;
  /// The highest priority an insert gave this node (the priority policy
  /// evicts the lowest first).
  int32_t priority = 0;
  bool on_device : 1;
  /// A backup of this node to host is in flight (its device pages are read).
  bool backing_up : 1;
  /// A load of this host-only node to the device is in flight.
  bool loading : 1;
  /// Its host pages are being written to storage (not evictable from host).
  bool storage_writing : 1;
  /// Host only, its pages read from storage and not on the device since: a
  /// match of it is served by the storage tier.
  bool from_storage : 1;
  /// It has a host copy (its host slots are in its NodeExtra).
  bool hosted : 1;

  const int32_t* key() const noexcept { return data; }
  /// The first device slot of each page.
  int32_t* value() const noexcept { return data + length; }
  bool is_leaf() const noexcept { return children.empty(); }
  bool has_host() const noexcept { return hosted; }
  NodeState state() const noexcept {
    return !has_host() ? NodeState::kDevice
           : on_device ? NodeState::kDeviceAndHost
                       : NodeState::kHost;
  }
};
static_assert(sizeof(Node) <= 128, "a node is two cache lines at most (see bench_radix.py)");

/// The part of a node few trees use, in a column beside the node table
/// (`RadixTree::extras_`, by node id). The tree makes the column the first
/// time it needs one of these fields (a namespace other than the default, a
/// host copy or a backup, a claim, a pin for a read from storage, the fifo
/// policy) and keeps it from then on; a tree that needs none stores none, and
/// reading one of them from such a tree gives the defaults below.
struct NodeExtra {
  /// The cache namespace of the node's path (0: the default one). Paths of
  /// different namespaces never share a node: they part at the root.
  uint64_t ns = 0;
  /// Logical time the node's tokens were first cached (the fifo policy).
  uint64_t created = 0;
  /// The first host slot of each page while the node has a host copy, else
  /// null; a block (of `host_slab`) with room for the pages of
  /// `host_capacity` tokens.
  int32_t* host = nullptr;
  NodeArena::Slab* host_slab = nullptr;
  int64_t host_capacity = 0;
  /// Where the copy in flight that ends at this node starts (a backup or a
  /// load; -1 when none): finishing a copy checks its range against it.
  int64_t copy_start = -1;
  /// The same for a write to storage that ends at this node.
  int64_t storage_write_start = -1;
  /// Reads from storage in flight that will join the tree below this node:
  /// while any, its host copy stays (not evictable from host).
  int32_t host_pins = 0;
  /// Retention claims held on this node (claims of its descendants count
  /// too), and those of them that keep it at least in host memory only: a
  /// node with one is never evicted from host. The others hold a lock
  /// (ref_count) each.
  int32_t claims = 0;
  int32_t host_claims = 0;
  /// Host claims that end at this node while it has no host copy: each
  /// holds a lock on the path (so the path stays on the device, ancestors
  /// included), given back when a backup gives the node its host copy.
  int32_t host_claim_locks = 0;
};

// A block of a node's tokens and device page slots (or of its host page
// slots), owned until it is given to a node (or freed).
class RadixTree::NodeBlock {
 public:
  NodeBlock() = default;
  // Room for `length` tokens, a copy of `tokens`, then the slots of their
  // pages (`pages()`, to be filled by the caller); with `tokens` null only
  // the page slots (a host slot array).
  NodeBlock(NodeArena* arena, const int32_t* tokens, int64_t length, int64_t page_size);
  // Where the block's page slots go.
  int32_t* pages() const noexcept {
    return static_cast<int32_t*>(block_.data) + (slots_only_ ? 0 : capacity_);
  }
  NodeBlock(NodeBlock&& other) noexcept { *this = std::move(other); }
  NodeBlock& operator=(NodeBlock&& other) noexcept;
  ~NodeBlock() { Free(); }
  explicit operator bool() const noexcept { return block_.data != nullptr; }
  // Takes `node`'s data block, or with `host` (the node's NodeExtra) its
  // host block.
  static NodeBlock Adopt(NodeArena* arena, Node* node, NodeExtra* host, int64_t page_size) noexcept;
  // Gives the block to `node` as its data (`length` tokens), or as its host
  // slots (kept in `extra`, the node's NodeExtra).
  void MoveTo(Node* node, int64_t length) noexcept;
  void MoveToHost(Node* node, NodeExtra* extra) noexcept;
  void Free() noexcept;

 private:
  NodeArena* arena_ = nullptr;
  size_t bytes_ = 0;  // what the arena gave, for Free
  NodeArena::Block block_;
  int64_t capacity_ = 0;  // tokens
  bool slots_only_ = false;
};

// What a split of `node` at `pos` needs, allocated before anything changes:
// the larger part keeps the node's blocks (its data moved in place), the
// smaller gets new ones.
struct RadixTree::SplitPlan {
  Node* node = nullptr;
  int64_t pos = 0;
  NodeBlock smaller, smaller_host;
  ChildMap<Node> prefix_children;  // with room for the suffix and a new leaf
};

// The defaults of NodeExtra, for a tree without the column.
inline const NodeExtra kNoExtra{};

inline const NodeExtra& RadixTree::Ex(const Node* x) const noexcept {
  return extras_.empty() ? kNoExtra : extras_[x->id];
}

inline NodeExtra& RadixTree::MutEx(const Node* x) noexcept { return extras_[x->id]; }

inline uint64_t RadixTree::NsOf(const Node* x) const noexcept {
  return extras_.empty() ? 0 : extras_[x->id].ns;
}

inline uint64_t RadixTree::Key(const Node* x) const noexcept {
  return EvictionKey(policy_, x->timestamp, x->hits, Ex(x).created, x->priority, x->length,
                     tel_safe_tokens_);
}

inline bool RadixTree::DeviceEvictable(const Node* x) const noexcept {
  return x->on_device && x->ref_count == 0 && x->device_children == 0 &&
         (x->has_host() || Ex(x).host_claims == 0);
}

inline bool RadixTree::Protected(const Node* x) noexcept { return x->ref_count > 0; }

inline bool RadixTree::HostEvictable(const Node* x) const noexcept {
  if (!x->has_host() || x->host_children != 0 || x->loading || x->storage_writing) return false;
  const NodeExtra& e = Ex(x);
  return e.host_pins == 0 && e.host_claims == 0 && (x->on_device || x->ref_count == 0);
}

inline int64_t RadixTree::Pages(const Node* x) const noexcept { return x->length / page_size_; }

inline void RadixTree::ExpandSlots(const int32_t* first, const Node* x,
                                   int32_t* out) const noexcept {
  ExpandPages(first, Pages(x), page_size_, out);
}

inline void RadixTree::Emit(const int32_t* first, const Node* x, int32_t* out,
                            bool pages) const noexcept {
  if (pages) {
    PageIdsOf(first, Pages(x), page_size_, out);
  } else {
    ExpandSlots(first, x, out);
  }
}

inline void RadixTree::TakeFirsts(SlotSource in, int64_t pos, const Node* x,
                                  int32_t* out) const noexcept {
  if (in.pages) {
    FirstOfPageIds(in.At(pos, page_size_), Pages(x), page_size_, out);
  } else {
    FirstOfPages(in.data + pos, Pages(x), page_size_, out);
  }
}

// Calls fn(node, offset) for the nodes of `copy`, deepest first; `offset` is
// where the node's tokens start within the copy.
template <typename Fn>
void RadixTree::ForEachInCopy(Node* end, const TierCopy& copy, Fn fn) const {
  for (Node* x = end; x != root_ && x->depth > copy.start; x = x->parent) {
    fn(x, x->depth - x->length - copy.start);
  }
}

namespace tree_errors {
constexpr ErrorCode kInvalid = ErrorCode::kInvalidArgument;
constexpr ErrorCode kBroken = ErrorCode::kIntegrity;
}  // namespace tree_errors

}  // namespace radixkv
