// The radix prefix cache: a compressed trie from token sequences to the KV
// slot indices that hold their keys and values, on the device and in host
// memory, with reference counts and exact LRU eviction on both tiers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "radixkv/eviction_policy.h"
#include "radixkv/lru_heap.h"
#include "radixkv/node_arena.h"
#include "radixkv/node_table.h"
#include "radixkv/slot_set.h"
#include "radixkv/slot_sink.h"

namespace radixkv {

/// One edge of the tree (private to the tree's sources: cpp/src/radix_node.h).
struct Node;
struct NodeExtra;

/// A reference to the node that ends a matched prefix. Plain data: copying a
/// handle copies its lock count, so bindings keep one handle object per match.
/// The match's device part ends at `node_id` (`cached_len` tokens, whose
/// slots the match returned); a part held only in host memory may follow, up
/// to `host_node_id` (`host_hit_len` more tokens), which LoadBack brings to
/// the device.
struct Handle {
  /// Identifies the tree that made the handle.
  uint64_t tree_id = 0;
  uint64_t generation = 0;
  uint32_t node_id = 0;
  /// Tokens from the root to the node: the matched length on the device.
  int64_t cached_len = 0;
  /// Locks taken through this handle and not yet released.
  int64_t lock_count = 0;
  uint64_t host_generation = 0;
  uint32_t host_node_id = 0;
  /// Matched tokens after `cached_len` that only host memory holds.
  int64_t host_hit_len = 0;
  /// The namespace the match was made in.
  uint64_t ns = 0;
};

/// A copy between the tiers in flight: the tokens at depths [start, end) of
/// the path that ends at node `node_id` (which splits do not change: a split
/// keeps the deeper part in the node).
struct TierCopy {
  uint32_t node_id = 0;
  /// The node's incarnation: bumped only when its id is freed, so a copy
  /// stays valid while its node moves between the tiers.
  uint64_t incarnation = 0;
  int64_t start = 0;
  int64_t end = 0;
  int64_t length() const noexcept { return end - start; }
};

/// Token counts of the two tiers.
struct TierSizes {
  int64_t device_evictable = 0;  ///< on the device, unlocked
  int64_t device_protected = 0;  ///< on the device, locked (by requests, copies or claims)
  int64_t host = 0;              ///< with a host copy
  int64_t host_only = 0;         ///< with a host copy and not on the device
  int64_t backing_up = 0;        ///< on the device, a backup in flight
  int64_t loading = 0;           ///< host only, a load in flight
  int64_t storage_writing = 0;   ///< with a host copy, a write to storage in flight
};

/// One node as seen by `RadixTree::Dump`: tokens, slots and bookkeeping.
struct NodeInfo {
  int64_t parent = -1;  // index into the dump, -1 for children of the root
  std::vector<int32_t> key;
  std::vector<int32_t> value;       // device slots, empty when not on the device
  std::vector<int32_t> host_value;  // host slots, empty without a host copy
  int64_t ref_count = 0;
  uint64_t timestamp = 0;
  uint64_t ns = 0;  // the node's namespace
};

/// The radix tree. Token ids and slot indices are int32; lengths are in
/// tokens. With `page_size > 1` every node holds whole pages, children are
/// keyed by their first page, and inputs are rounded down to whole pages.
/// A page's slots are consecutive (`s, s + 1, ..., s + page_size - 1`, as a
/// paged pool hands them out; with `aligned_pages` s is a multiple of
/// page_size, as every engine's paged allocator aligns them; every call that
/// gives the tree slots checks it), so a node keeps one slot per page and expands them
/// where a call returns slots: a 12k-token request at page 512 stores 24
/// slots, not 12k.
///
/// Two interfaces: every call that reads or writes slots takes them per
/// token (a SlotSource or SlotSink of slots) or, on a tree made with
/// `aligned_pages`, per page (page ids, `p` for slots `p * page_size + [0,
/// page_size)`: SlotSource with `pages`, SlotSink::Pages()), with the same
/// checks and effects; lengths stay in tokens. The page form moves
/// page_size times fewer entries.
///
/// Two tiers: a node's K/V is on the device (its device slots), in host
/// memory (its host slots), or both. Device-resident nodes are root-closed (a
/// node on the device has its parent on the device), and so are nodes with a
/// host copy. A match returns the device part and reports the host-only part
/// after it; eviction frees device slots (a node with a host copy stays, host
/// only; one without is deleted) or host slots (a node also on the device
/// stays, device only; a host-only one is deleted), each tier in exact LRU
/// order on one clock. The tree holds the tier state only: copies between the
/// tiers are made elsewhere (CacheController), between BeginBackup and
/// FinishBackup, BeginLoad and FinishLoad, and a node's state changes only
/// when a copy finishes.
///
/// Every public call advances a logical clock by one tick. A match refreshes
/// the timestamp of exactly the matched tokens, an insert of every token on
/// its path. Eviction removes leaves oldest first from an indexed heap per
/// tier in O(k log n) for k nodes, with no scan of the tree. A refresh only
/// writes the timestamps (O(path)): a leaf's key in a heap may lag behind,
/// and eviction re-keys a lagging leaf when it reaches the top, which keeps
/// the order exact and costs each refreshed leaf at most one O(log n) fix.
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
  /// `tel_safe_tokens` (tlru only): a leaf at most this long is safe to evict
  /// first (SGLang's threshold less its next-prompt estimate, in tokens).
  static constexpr int64_t kAnySlot = -1;
  /// `aligned_pages`: every page given to the tree starts at a multiple of
  /// page_size (checked), so a page is named by its id and the page forms
  /// of the calls (SlotSource with `pages`, SlotSink::Pages()) may be used;
  /// without it they throw kInvalidArgument.
  explicit RadixTree(int64_t page_size = 1, int64_t max_slots = kAnySlot,
                     EvictionPolicy policy = EvictionPolicy::kLru, int64_t tel_safe_tokens = 0,
                     bool aligned_pages = false);
  ~RadixTree();
  RadixTree(const RadixTree&) = delete;
  RadixTree& operator=(const RadixTree&) = delete;

  int64_t page_size() const noexcept { return page_size_; }
  EvictionPolicy policy() const noexcept { return policy_; }
  int64_t tel_safe_tokens() const noexcept { return tel_safe_tokens_; }
  int64_t max_slots() const noexcept { return max_slots_; }
  bool aligned_pages() const noexcept { return aligned_; }
  /// Throws kInvalidArgument when `pages` (a call's page form) and the tree
  /// was not made with `aligned_pages`.
  void RequireAligned(bool pages) const;
  uint64_t id() const noexcept { return id_; }

  /// Finds the longest cached prefix of `tokens[0, n)` in whole pages, on
  /// either tier, splits the last node if the prefix ends inside it, and
  /// writes the device slots of its device part to `out(cached_len)`. Returns
  /// a handle with no locks; `host_hit_len` counts the host-only tokens after
  /// the device part. Counts a hit on every matched node. O(n) plus O(log
  /// leaves) for the LRU update.
  ///
  /// Cache namespaces: every call that takes tokens also takes `ns`, the
  /// namespace of the sequence (a tenant's cache salt, a LoRA adapter; 0 is
  /// the default). Sequences of different namespaces never share a prefix;
  /// they live in one tree, under the one LRU order and pool.
  Handle MatchPrefix(const int32_t* tokens, int64_t n, SlotSink out, uint64_t ns = 0);
  /// The same, replacing `*slots` with the prefix's slots.
  Handle MatchPrefix(const int32_t* tokens, int64_t n, std::vector<int32_t>* slots,
                     uint64_t ns = 0) {
    return MatchPrefix(tokens, n, SlotSink::Into(slots), ns);
  }

  /// Stores `tokens[0, m)` with the device slots `slots[0, m)`, m = n rounded
  /// down to whole pages, where not on the device yet: host-only nodes on the
  /// path take the caller's slots (they are the tree's from then on), the
  /// rest becomes a new leaf. Returns how many leading tokens were on the
  /// device already; their `slots` are ignored and stay the caller's. Throws
  /// kInvalidArgument, changing nothing, if any of `slots[0, n)` is negative,
  /// not below `max_slots`, or repeated, or a whole page's slots are not
  /// consecutive, or a slot to be stored is in the tree already, or the path
  /// has a load in flight (match and load it first).
  /// `priority` raises the priority of every node on the path to at least
  /// it (what the priority policy orders by). With `prefix`, a live handle of
  /// this tree whose path the caller has checked is `tokens[0,
  /// prefix->cached_len)` (HandleMatches), the walk starts at the handle's
  /// node instead of comparing that part again.
  int64_t InsertPrefix(const int32_t* tokens, SlotSource slots, int64_t n, int32_t priority = 0,
                       uint64_t ns = 0, const Handle* prefix = nullptr);

  /// Adds one lock on every node from the handle's node to the root.
  /// Throws kInvalidArgument for a handle of another tree or a freed node.
  void Lock(Handle* handle);
  /// Removes one lock taken through `handle`. Throws kInvalidArgument if the
  /// handle holds no lock or is stale.
  void Unlock(Handle* handle);

  /// Evicts least recently used unlocked device leaves until at least `size`
  /// tokens are freed and writes their device slots, in eviction order, to
  /// `out(count)`; returns the count. Whole nodes go: one with a host copy
  /// stays in the tree, host only (handles to it become stale, as to a deleted
  /// node); one without is deleted. Throws
  /// kInvalidArgument for `size < 0` and kOutOfCapacity for `size` beyond what
  /// can be freed, changing nothing; if `out` throws, nothing changed either.
  int64_t Evict(int64_t size, SlotSink out);
  /// The same, replacing `*slots` with the freed slots.
  void Evict(int64_t size, std::vector<int32_t>* slots) { Evict(size, SlotSink::Into(slots)); }

  /// Evicts least recently used host copies until at least `size` host slots
  /// are freed and writes them to `out(count)`; returns the count. Candidates
  /// are nodes with a host copy and no child with one (or a backup in
  /// flight), no load in flight: a host-only one is deleted, one also on the
  /// device keeps its device slots. Throws kOutOfCapacity, changing nothing,
  /// when `size` cannot be freed.
  int64_t EvictHost(int64_t size, SlotSink out);
  void EvictHost(int64_t size, std::vector<int32_t>* slots) {
    EvictHost(size, SlotSink::Into(slots));
  }

  /// Drops every node. Handles made before become stale. Copies in flight
  /// must be finished (or abandoned by the caller) first.
  void Reset();

  /// Tokens in unlocked device nodes (may be evicted).
  int64_t evictable_size() const noexcept { return evictable_size_; }
  /// Tokens in locked device nodes (by requests, copies or claims; a host
  /// claim locks its path until its end has a host copy: AddClaim).
  int64_t protected_size() const noexcept { return protected_size_; }
  /// Both tiers' token counts. O(1).
  TierSizes tier_sizes() const noexcept;
  /// Nodes, the root excluded.
  int64_t num_nodes() const noexcept { return num_nodes_; }
  /// Pins of PinHost not yet released, over all nodes.
  int64_t host_pins() const noexcept { return host_pins_; }
  /// Unlocked device leaves, i.e. the device eviction candidates.
  int64_t num_evictable_leaves() const noexcept { return static_cast<int64_t>(heap_.size()); }
  /// The device slots stored in the tree, and the host slots.
  const SlotSet& stored_slots() const noexcept { return stored_; }
  const SlotSet& stored_host_slots() const noexcept { return stored_host_; }
  /// Writes the device slots of the handle's prefix to `out(cached_len)`.
  /// Throws kInvalidArgument for a foreign or stale handle, or one whose
  /// prefix is not on the device.
  void HandleSlots(const Handle& handle, SlotSink out) const;
  void HandleSlots(const Handle& handle, std::vector<int32_t>* slots) const {
    HandleSlots(handle, SlotSink::Into(slots));
  }
  /// Whether `handle` refers to a live node of this tree.
  bool IsValid(const Handle& handle) const noexcept;
  /// Whether `tokens[0, cached_len)` are the tokens of the handle's prefix
  /// and, unless `slots` is null, `slots[0, cached_len)` its device slots
  /// (HandleSlots, compared page by page without writing them out). Throws
  /// kInvalidArgument as HandleSlots does.
  bool HandleMatches(const Handle& handle, const int32_t* tokens,
                     SlotSource slots = SlotSource()) const;

  // --- copies between the tiers -------------------------------------------------

  /// The nodes of the path of `tokens[0, n)` (whole pages, as far as it is on
  /// the device) that a backup should copy to host: those without a host copy
  /// or one in flight, from the first such down to the deepest node matched
  /// with at least `min_hits` hits (1: every node on the path). Returns false
  /// when there is none. With `through_partial`, a node the tokens end
  /// inside counts as matched (the whole node is copied): the storage tier
  /// needs a host copy exactly where a match ends. Changes nothing.
  bool FindBackup(const int32_t* tokens, int64_t n, uint32_t min_hits, TierCopy* copy,
                  bool through_partial = false, uint64_t ns = 0) const;
  /// The nodes of `copy`'s range, which must be on the device with no host
  /// copy and no backup in flight: pins them (their device pages may not go)
  /// and writes their device slots, the copy's source, to `out`.
  void BeginBackup(const TierCopy& copy, SlotSink out);
  void BeginBackup(const TierCopy& copy, std::vector<int32_t>* device) {
    BeginBackup(copy, SlotSink::Into(device));
  }
  /// Ends a backup: when `ok`, the nodes take the host slots `host[0,
  /// copy.length())`, whole pages of consecutive slots (those whose parent
  /// has no host copy do not: a parent whose own backup failed cuts its
  /// subtree off); unpins them. Writes to `rejected` the host slots not taken
  /// (all of them when not `ok`, or when the copy's node is gone, which only
  /// Reset does); returns how many. `host_checked`: the caller vouches that
  /// `host` is whole pages of slots in range (a PageAllocator's CheckFree
  /// says so), which are then not checked again.
  int64_t FinishBackup(const TierCopy& copy, SlotSource host, bool ok, SlotSink rejected,
                       bool host_checked = false);

  /// The host-only part of `handle`'s match, as a copy starting at the
  /// deepest node now on the device (empty when none is left: loaded since,
  /// or evicted from host since, in which case the copy ends at the handle's
  /// own node). Throws kInvalidArgument for a stale handle, or one whose host
  /// part has a load in flight.
  TierCopy FindLoad(const Handle& handle) const;
  /// Starts loading `copy` (from FindLoad): marks its nodes loading (not
  /// evictable from host), writes their host slots (the copy's source) to
  /// `host` and the device slots of the path above them (`copy.start`
  /// tokens, on the device) to `prefix`, and sets `*loaded` to a new handle
  /// for the whole match, with one lock (its nodes are on the device once
  /// FinishLoad succeeds). The copy also pins the path until FinishLoad, so
  /// the part above stays on the device whatever the handle's owner does. An
  /// empty copy (the part landed meanwhile) only makes the handle.
  void BeginLoad(const TierCopy& copy, SlotSink host, SlotSink prefix, Handle* loaded);
  void BeginLoad(const TierCopy& copy, std::vector<int32_t>* host, Handle* loaded,
                 std::vector<int32_t>* prefix = nullptr) {
    std::vector<int32_t> unused;
    BeginLoad(copy, SlotSink::Into(host), SlotSink::Into(prefix ? prefix : &unused), loaded);
  }
  /// Ends a load: when `ok`, the nodes take the device slots `device[0,
  /// copy.length())` (whole pages of consecutive slots) and are on the
  /// device; either way they are no longer loading and the copy's pin goes.
  /// Returns false (taking nothing) when the copy's node is gone.
  bool FinishLoad(const TierCopy& copy, SlotSource device, bool ok);

  /// The storage tier. Starts writing to storage the host pages of the
  /// range a backup `from` covered (its node's path, tokens [from.start,
  /// from.end)), down to the deepest node there with a host copy: pins those
  /// nodes on host (not evictable there), writes their host slots to `host`
  /// and the path's tokens from the root to `tokens` (for the page keys).
  /// Returns false, changing nothing, when nothing of the range has a host
  /// copy, or its node is gone. Throws kInvalidArgument if `from.start` is
  /// not a node boundary of the path or a node there is being written. Sets
  /// `*ns` (when not null) to the path's namespace.
  bool BeginStorageWrite(const TierCopy& from, SlotSink host, SlotSink tokens, TierCopy* copy,
                         uint64_t* ns = nullptr);
  /// Where pages read from storage would join `tokens[0, n)`'s path: the
  /// matched length (whole pages). `*host_backed` says whether the match
  /// ends at the root or on a node with a host copy; if not, pages could not
  /// be attached there until its host copy is made again. Changes nothing:
  /// no clock tick, no hit counted.
  int64_t StoragePrefixEnd(const int32_t* tokens, int64_t n, bool* host_backed,
                           uint64_t ns = 0) const;
  /// Pins the host copy of the node where `tokens[0, n)`'s match ends (whole
  /// pages), so pages read from storage can join there when they arrive:
  /// until `UnpinHost(*pin)` it is not evicted from host (its ancestors keep
  /// theirs, having a host child). `pin->start` is the matched length.
  /// False, pinning nothing, when the match ends at the root or on a node
  /// without a host copy. No clock tick.
  bool PinHost(const int32_t* tokens, int64_t n, TierCopy* pin, uint64_t ns = 0);
  /// Releases a pin of PinHost. A pin whose node is gone (Reset) is ignored.
  void UnpinHost(const TierCopy& pin);
  /// Ends a write to storage (success or not: storage has no state here):
  /// unpins the nodes. A copy whose node is gone (Reset) is ignored.
  void FinishStorageWrite(const TierCopy& copy);
  /// Adds pages read from storage as host-only nodes: `host[0, n - start)`
  /// are host slots holding the K/V of `tokens[start, n)` (whole pages). The
  /// part already in the tree keeps what it has; the rest becomes one
  /// host-only node under the path, which must end at a node with a host copy
  /// (or the root) at or after `start`. Writes the host slots not taken to
  /// `rejected` (all of them when the path no longer reaches `start` with a
  /// host copy) and returns the tokens taken. Throws kInvalidArgument for a
  /// negative or repeated host slot, or one the tree stores already, or a
  /// page of host slots that are not consecutive.
  int64_t InsertHost(const int32_t* tokens, int64_t n, int64_t start, const int32_t* host,
                     SlotSink rejected, uint64_t ns = 0);

  // --- retention claims ------------------------------------------------------------

  /// Retention claims keep a prefix cached while its owner expects it back
  /// (an agent between turns). A claim holds the path from the root to the
  /// deepest node of `handle`'s match: without `host`, the device part, which
  /// it locks as Lock does; with `host`, the whole match (host part included),
  /// whose nodes are then never evicted from host and leave the device only
  /// once they have a host copy (so the prefix stays at least in host
  /// memory; until the path's end has a host copy, the claim locks the path).
  /// Claims count per node, like locks; the path's nodes that no claim held
  /// before add their tokens to `claimed_size()`, which AddClaim returns in
  /// `*added`. Raises the priority of every node on the path to at least
  /// `priority` (the priority policy's order, once the claim ends). Returns
  /// the claim as a copy of the whole path (`end` its length) that names its
  /// node by incarnation and its tier by `start`: 0 on the device,
  /// kHostClaim for host. Throws kInvalidArgument for a foreign or stale
  /// handle.
  static constexpr int64_t kHostClaim = -1;
  TierCopy AddClaim(const Handle& handle, bool host, int32_t priority, int64_t* added);
  /// The tokens AddClaim would add to `claimed_size()`. Changes nothing.
  int64_t ClaimCost(const Handle& handle, bool host) const;
  /// The tokens a claim of the match of `tokens` (n of them, in whole pages,
  /// in namespace `ns`) would add to `claimed_size()`: ClaimCost of the
  /// handle MatchPrefix would return, found by a walk that changes nothing
  /// (no LRU time, hit count or split), so a claim the caller refuses for
  /// its cost leaves the eviction order as it was.
  int64_t PrefixClaimCost(const int32_t* tokens, int64_t n, uint64_t ns, bool host) const;
  /// Ends a claim of AddClaim; returns the tokens no claim holds any more. A
  /// claim whose node is gone (Reset) is ignored and returns 0. Throws
  /// kInvalidArgument, changing nothing, for a claim not held (or not a
  /// claim): one whose path holds no claim of its kind (device or host).
  /// Claims are counted, not named: a claim released twice while another of
  /// its kind holds the same node releases that one (the manager's claims,
  /// retention.py, are named: a second release of one returns False).
  int64_t ReleaseClaim(const TierCopy& claim);
  /// The ids of the nodes on the path of `handle`'s whole match (host part
  /// included) that a claim holds, deepest first: a claim whose node is among
  /// them was matched to its end.
  std::vector<uint32_t> ClaimedPath(const Handle& handle) const;
  /// Tokens that at least one claim holds.
  int64_t claimed_size() const noexcept { return claimed_size_; }
  /// Tokens on the device that a lock other than a claim's holds (a request's,
  /// a copy's): what `protected_size()` would be with every claim released.
  /// O(nodes).
  int64_t LockedBeyondClaims() const;

  /// Of the host part of `handle`'s match (`host_hit_len`), the tokens whose
  /// pages were read from storage and have not been on the device since:
  /// the hits the storage tier serves. Throws kInvalidArgument for a foreign
  /// or stale handle.
  int64_t StorageHitLen(const Handle& handle) const;

  /// The namespace of the node `copy` names; false when it is gone.
  bool CopyNamespace(const TierCopy& copy, uint64_t* ns) const noexcept;

  /// Device leaves that the next `Evict(size)` would take and that have no
  /// host copy (their end nodes as copies, oldest first): under write_back
  /// they are backed up before eviction. With `ns` (not null; a namespace
  /// with a quota), those `EvictNamespace(*ns, size)` would take. Changes
  /// nothing visible.
  std::vector<TierCopy> EvictionCandidatesWithoutHost(int64_t size, const uint64_t* ns = nullptr);

  // --- namespace quotas ------------------------------------------------------------

  /// What a namespace with a quota holds: tokens on the device and tokens
  /// with a host copy, and its limits (-1: none on that tier).
  struct QuotaUse {
    uint64_t ns = 0;
    int64_t device = 0;
    int64_t host = 0;
    int64_t device_limit = -1;
    int64_t host_limit = -1;
  };
  /// Gives namespace `ns` limits of `device` tokens on the device and `host`
  /// tokens with a host copy (-1: none on that tier; both -1 removes the
  /// quota). Its tokens are counted per tier from then on (the first quota
  /// of a namespace counts what it holds: O(nodes)). The tree never evicts
  /// on its own account: `OverQuota` says who holds more than its limits,
  /// and `EvictNamespace` / `EvictHostNamespace` take that namespace's own
  /// least recently used pages. Throws kInvalidArgument for a limit below
  /// -1. Namespaces without a quota cost nothing.
  void SetQuota(uint64_t ns, int64_t device, int64_t host);
  /// Every namespace with a quota, in no particular order. O(quotas).
  std::vector<QuotaUse> Quotas() const;
  /// The namespaces holding more than a limit, with how much more: `device`
  /// and `host` are the excess on each tier (0 where within). O(quotas).
  std::vector<QuotaUse> OverQuota() const;
  /// Evicts the least recently used unlocked device leaves of namespace `ns`
  /// (which must have a quota) until `size` tokens are freed or none is
  /// left, as Evict does (whole nodes; one with a host copy stays, host
  /// only); writes the freed device slots to `out(count)` and returns the
  /// count (0 when none could go). If `out` throws, nothing changed.
  int64_t EvictNamespace(uint64_t ns, int64_t size, SlotSink out);
  /// The same on the host tier, as EvictHost does.
  int64_t EvictHostNamespace(uint64_t ns, int64_t size, SlotSink out);

  /// Walks the whole tree and checks every counter and invariant: parent
  /// links, child keys, lengths and page alignment, depths, lock counts,
  /// timestamps, both tiers' root-closure and counts, heap membership and
  /// order for both tiers, that no device or host slot is stored twice or out
  /// of range, and that the room reserved for node ids, heap members and free
  /// ids covers every node (so commits never allocate). Throws kIntegrity
  /// naming the first violation. O(tokens + nodes).
  void CheckIntegrity() const;

  /// Every node, parents before children, children in ascending key order.
  std::vector<NodeInfo> Dump() const;

 private:
  // A block of a node's tokens and slots (or host slots) owned until it is
  // given to a node, and what a split needs: see radix_node.h.
  class NodeBlock;
  struct SplitPlan;

  // The key of a child starting with `tokens` under `parent` (`ns` is mixed
  // in under the root only), and the child itself.
  uint64_t ChildKey(const Node* parent, const int32_t* tokens, uint64_t ns) const noexcept;
  Node* FindChild(const Node* node, const int32_t* tokens, uint64_t ns) const noexcept;
  // Ensures `k` free node ids, with heap room and free-list room for every
  // node. Throws std::bad_alloc; what it adds is free, so nothing visible
  // changes.
  void ReserveNodes(size_t k);
  // A node from the free ids holding `data` (`length` tokens, then slots),
  // linked to `parent` by its parent pointer only, in namespace `ns` (its
  // parent's, unless the parent is the root; one other than 0 needs the
  // NodeExtra column). Needs a reserved id.
  Node* TakeNode(Node* parent, NodeBlock data, int64_t length, uint64_t ns) noexcept;
  void FreeNode(Node* node) noexcept;
  void FreeStorage(Node* node) noexcept;
  void FreeHost(Node* node) noexcept;
  void PrepareSplit(Node* node, int64_t pos, uint32_t children, SplitPlan* plan);
  // Splits as planned (needs one reserved id) and returns the prefix node.
  Node* CommitSplit(SplitPlan* plan) noexcept;
  void Touch(Node* node) noexcept;
  // The rarely used fields of `x` (NodeExtra): its own while the tree keeps
  // the column, else the defaults. MutEx needs the column (NeedExtras).
  const NodeExtra& Ex(const Node* x) const noexcept;
  NodeExtra& MutEx(const Node* x) noexcept;
  uint64_t NsOf(const Node* x) const noexcept;
  // Makes the column of NodeExtra, for every node id, unless it is there.
  // Throws std::bad_alloc, changing nothing. Called before a call changes
  // anything, by every call that may set a field of NodeExtra.
  void NeedExtras();
  // The node's order in the eviction heaps under the policy (EvictionKey).
  uint64_t Key(const Node* x) const noexcept;
  // Adds `delta` locks on every node from `node` to the root.
  void LockPath(Node* node, int64_t delta) noexcept;
  // Puts `x` into, or takes it out of, each tier's heap to match its state.
  void Refresh(Node* x) noexcept;
  bool DeviceEvictable(const Node* x) const noexcept;
  // Whether `x`'s device tokens count as protected, not evictable: it is
  // locked (by a request, a copy, or a claim; a host claim on a path without
  // a host copy locks it until it has one).
  static bool Protected(const Node* x) noexcept;
  // Moves `x`'s device tokens between evictable and protected when
  // Protected(x) is no longer `was`.
  void Reprotect(Node* x, bool was) noexcept;
  bool HostEvictable(const Node* x) const noexcept;
  // The oldest member of `heap` under the policy, popped (re-keying the
  // lagging keys it meets on top; see Evict); null when it is empty.
  Node* PopOldest(LruHeap* heap) noexcept;
  // A namespace's quota: its limits, its tokens per tier and its own heaps
  // of eviction candidates, which mirror heap_ and host_heap_ (Refresh).
  struct Quota {
    int64_t device_limit = -1;
    int64_t host_limit = -1;
    int64_t device = 0;
    int64_t host = 0;
    LruHeap heap;
    LruHeap host_heap;
  };
  // The quota of `ns`, or null (a hash lookup; none while quotas_ is empty).
  Quota* QuotaOf(uint64_t ns) const noexcept;
  // The namespace quota `ns` must have for a call named `what`.
  Quota* RequireQuota(uint64_t ns, const char* what) const;
  // Gives `x` its current key in every heap it is in, where a key may have
  // risen (mru's touch) or fallen (tlru's split), which the lazy re-keying
  // of PopOldest cannot put right.
  void Rekey(Node* x) noexcept;
  // Keeps `x`'s membership of its namespace's heaps like the tree's.
  void RefreshQuota(Node* x, Quota* q) noexcept;
  // Evict and EvictHost on `heap` (the tree's, or a quota's); `partial`:
  // freeing less than `size` is no error.
  int64_t EvictDevice(LruHeap* heap, int64_t size, SlotSink out, bool partial);
  int64_t EvictHostCopies(LruHeap* heap, int64_t size, SlotSink out, bool partial);
  // Takes `x` out of every host heap it is in (a host eviction's victim).
  void LeaveHostHeaps(Node* x) noexcept;
  // Sets whether `x` is on the device (or has host storage), keeping the
  // parent's child counts and the size counters right.
  void SetOnDevice(Node* x, bool on) noexcept;
  void CountHost(Node* x, int64_t sign) noexcept;
  Node* Resolve(const Handle& handle, const char* what) const;
  Node* ResolveCopy(const TierCopy& copy) const noexcept;
  // The deepest node of `handle`'s match: its host part's end when `host`
  // and the host part is still there, else its device part's.
  Node* MatchedEnd(const Handle& handle, bool host) const;
  // The deepest node on the device from `x` up (the root at worst).
  Node* DeviceEnd(Node* x) const noexcept;
  // The device slots (or, with `pages`, page ids) of the path to `node`.
  void CopyPathSlots(const Node* node, int32_t* out, bool pages = false) const noexcept;
  // Entries of a sink or source for `tokens` tokens: slots, or pages.
  int64_t Units(bool pages, int64_t tokens) const noexcept {
    return pages ? tokens / page_size_ : tokens;
  }
  // Writes x's slots given its pages' first slots `first` (x->value() or
  // x->host), or with `pages` their page ids.
  void Emit(const int32_t* first, const Node* x, int32_t* out, bool pages) const noexcept;
  // The first slots of x's pages from `in`, whose entries for x start at
  // token `pos`.
  void TakeFirsts(SlotSource in, int64_t pos, const Node* x, int32_t* out) const noexcept;
  // Adds (or removes) the device or host slots of x's entries in `in` from
  // token `pos` to `set`; Add returns the position of one stored already, or -1.
  int64_t AddSlots(SlotSet* set, SlotSource in, int64_t pos, int64_t tokens);
  void RemoveSlots(SlotSet* set, SlotSource in, int64_t pos, int64_t tokens) noexcept;
  // The pages of `x`'s tokens, and the slots of those pages given their
  // first slots `first` (x->value() or x->host), written to `out`.
  int64_t Pages(const Node* x) const noexcept;
  void ExpandSlots(const int32_t* first, const Node* x, int32_t* out) const noexcept;
  // Calls fn(node, offset) for the nodes of `copy`, deepest first; `offset`
  // is where the node's tokens start within the copy.
  template <typename Fn>
  void ForEachInCopy(Node* end, const TierCopy& copy, Fn fn) const;

  // Walks from the root (or from `start`, whose path is known to be
  // `tokens[0, start->depth)`) over whole pages of `tokens[0, n)`. Stops at
  // the deepest fully matched node `*node`, and reports in `*partial` the
  // child matched for `*partial_len` tokens but not to its end (or null).
  // Returns the matched length. Changes nothing.
  int64_t Walk(const int32_t* tokens, int64_t n, uint64_t ns, Node** node, Node** partial,
               int64_t* partial_len, Node* start = nullptr) const;
  // The node where a match of tokens[0, n) (whole pages) ends, on its end or
  // inside it, and the matched length. For the storage tier's queries.
  Node* MatchEnd(const int32_t* tokens, int64_t n, uint64_t ns, int64_t* pos) const;

  const int64_t page_size_;
  const int64_t max_slots_;
  const bool aligned_;
  const uint64_t id_;
  uint64_t clock_ = 0;
  NodeArena arena_;  // node storage; declared first so it outlives the nodes
  NodeTable<Node> nodes_;           // by id; id 0 is the root
  std::vector<NodeExtra> extras_;  // by id, once a call needs one (NeedExtras)
  std::vector<Node*> victims_;     // an eviction's victims; room for every node
  Node* root_ = nullptr;
  std::vector<uint32_t> free_ids_;
  LruHeap heap_;         // device leaves that may be evicted, oldest first
  LruHeap host_heap_;    // host copies that may be evicted, oldest first
  SlotSet stored_;       // the device slots stored in the tree
  SlotSet stored_host_;  // the host slots
  SlotSet scratch_;      // working memory for input checks, empty between calls
  SlotRuns runs_;        // the runs of an insert's slots, found once per call
  int64_t evictable_size_ = 0;
  int64_t protected_size_ = 0;
  int64_t host_size_ = 0;
  int64_t host_only_size_ = 0;
  int64_t backing_up_size_ = 0;
  int64_t loading_size_ = 0;
  EvictionPolicy policy_ = EvictionPolicy::kLru;
  int64_t tel_safe_tokens_ = 0;
  int64_t storage_writing_size_ = 0;
  int64_t host_pins_ = 0;
  int64_t claimed_size_ = 0;
  int64_t num_nodes_ = 0;
  std::unordered_map<uint64_t, std::unique_ptr<Quota>> quotas_;
};

}  // namespace radixkv
