#include "radixkv/radix_tree.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <utility>

#include "radix_node.h"
#include "radixkv/compare.h"
#include "radixkv/slot_set.h"
#include "radixkv/status.h"

namespace radixkv {
using tree_errors::kBroken;
using tree_errors::kInvalid;

namespace {

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

// `length`, checked to fit a node's capacity (Node::capacity).
int64_t NodeLength(int64_t length) {
  RADIXKV_CHECK(length <= int64_t{UINT32_MAX}, kInvalid, "cannot cache ", length,
                " new tokens at once: at most ", UINT32_MAX);
  return length;
}

// The bytes of a block for `length` tokens (unless `slots_only`) and one slot
// per page of them.
size_t BlockBytes(int64_t length, int64_t page_size, bool slots_only) {
  return static_cast<size_t>((slots_only ? 0 : length) + length / page_size) * sizeof(int32_t);
}

}  // namespace

// --- node blocks ------------------------------------------------------------------

RadixTree::NodeBlock::NodeBlock(NodeArena* arena, const int32_t* tokens, int64_t length,
                                int64_t page_size)
    : arena_(arena),
      bytes_(BlockBytes(NodeLength(length), page_size, tokens == nullptr)),
      block_(arena->Allocate(bytes_)),
      capacity_(length),
      slots_only_(tokens == nullptr) {
  if (tokens != nullptr) std::memcpy(block_.data, tokens, length * sizeof(int32_t));
}

RadixTree::NodeBlock& RadixTree::NodeBlock::operator=(NodeBlock&& other) noexcept {
  Free();
  arena_ = other.arena_;
  block_ = other.block_;
  bytes_ = other.bytes_;
  capacity_ = other.capacity_;
  slots_only_ = other.slots_only_;
  other.block_ = NodeArena::Block{};
  return *this;
}

RadixTree::NodeBlock RadixTree::NodeBlock::Adopt(NodeArena* arena, Node* node, NodeExtra* host,
                                                 int64_t page_size) noexcept {
  NodeBlock s;
  s.arena_ = arena;
  s.slots_only_ = host != nullptr;
  if (host != nullptr) {
    s.block_ = NodeArena::Block{host->host, host->host_slab};
    s.capacity_ = host->host_capacity;
    s.bytes_ = BlockBytes(s.capacity_, page_size, true);
    host->host = nullptr;
    host->host_slab = nullptr;
    node->hosted = false;
  } else {
    s.block_ = NodeArena::Block{node->data, node->data_slab};
    s.capacity_ = node->capacity;
    s.bytes_ = BlockBytes(s.capacity_, page_size, false);
    node->data = nullptr;
    node->data_slab = nullptr;
  }
  return s;
}

void RadixTree::NodeBlock::MoveTo(Node* node, int64_t length) noexcept {
  node->data = static_cast<int32_t*>(block_.data);
  node->data_slab = block_.slab;
  node->capacity = capacity_;
  node->length = length;
  block_ = NodeArena::Block{};
}

void RadixTree::NodeBlock::MoveToHost(Node* node, NodeExtra* extra) noexcept {
  extra->host = static_cast<int32_t*>(block_.data);
  extra->host_slab = block_.slab;
  extra->host_capacity = capacity_;
  node->hosted = true;
  block_ = NodeArena::Block{};
}

void RadixTree::NodeBlock::Free() noexcept {
  if (block_.data != nullptr) {
    arena_->Free(block_, bytes_);
  }
  block_ = NodeArena::Block{};
}

// --- nodes -----------------------------------------------------------------------

RadixTree::RadixTree(int64_t page_size, int64_t max_slots, EvictionPolicy policy,
                     int64_t tel_safe_tokens, bool aligned_pages)
    : page_size_(page_size),
      max_slots_(max_slots),
      aligned_(aligned_pages),
      id_(next_tree_id.fetch_add(1, std::memory_order_relaxed)) {
  RADIXKV_CHECK(page_size >= 1, kInvalid, "page_size must be >= 1, got ", page_size);
  RADIXKV_CHECK(max_slots == kAnySlot || (max_slots >= 0 && max_slots <= (int64_t{1} << 31)),
                kInvalid, "max_slots must be in [0, 2**31], got ", max_slots);
  RADIXKV_CHECK(policy <= EvictionPolicy::kTlru, kInvalid, "unknown eviction policy ",
                static_cast<int>(policy));
  policy_ = policy;
  tel_safe_tokens_ = tel_safe_tokens;
  if (aligned_ && (page_size & (page_size - 1)) == 0) {
    // Every stored slot is part of a whole aligned page: a bit a page.
    const int shift = __builtin_ctzll(static_cast<uint64_t>(page_size));
    stored_.SetSlotsPerBit(shift);
    stored_host_.SetSlotsPerBit(shift);
  }
  root_ = nodes_.Add();
  // The fifo policy keys nodes by the time they were made (NodeExtra).
  if (policy_ == EvictionPolicy::kFifo) NeedExtras();
  ReserveNodes(0);
}

RadixTree::~RadixTree() {
  for (size_t i = 1; i < nodes_.size(); ++i) {
    FreeStorage(nodes_[i]);
    FreeHost(nodes_[i]);
  }
}

void RadixTree::FreeStorage(Node* node) noexcept {
  if (node->data == nullptr) return;
  arena_.Free(NodeArena::Block{node->data, node->data_slab},
              BlockBytes(node->capacity, page_size_, false));
  node->data = nullptr;
  node->data_slab = nullptr;
}

void RadixTree::FreeHost(Node* node) noexcept {
  if (!node->has_host()) return;
  NodeExtra& e = MutEx(node);
  arena_.Free(NodeArena::Block{e.host, e.host_slab}, BlockBytes(e.host_capacity, page_size_, true));
  e.host = nullptr;
  e.host_slab = nullptr;
  node->hosted = false;
}

void RadixTree::NeedExtras() {
  if (!extras_.empty()) return;
  extras_ = std::vector<NodeExtra>(nodes_.size());  // on failure nothing has changed
}

uint64_t RadixTree::ChildKey(const Node* parent, const int32_t* tokens,
                             uint64_t ns) const noexcept {
  const uint64_t key =
      page_size_ == 1 ? static_cast<uint32_t>(tokens[0]) : HashPage(tokens, page_size_);
  if (parent != root_ || ns == 0) return key;
  // Under the root a namespace moves its children's keys elsewhere (FindChild
  // compares the namespace too, so a collision is only a longer probe).
  uint64_t h = (ns + 0x9E3779B97F4A7C15ull) * 0xBF58476D1CE4E5B9ull;
  h ^= h >> 31;
  return key ^ h;
}

Node* RadixTree::FindChild(const Node* node, const int32_t* tokens, uint64_t ns) const noexcept {
  const uint64_t key = ChildKey(node, tokens, ns);
  if (node != root_) {
    // Below the root the namespace is the parent's: only the tokens decide.
    if (page_size_ == 1) return node->children.Find(key, [](const Node*) { return true; });
    const size_t bytes = static_cast<size_t>(page_size_) * sizeof(int32_t);
    return node->children.Find(
        key, [&](const Node* child) { return std::memcmp(child->key(), tokens, bytes) == 0; });
  }
  const size_t bytes = static_cast<size_t>(page_size_) * sizeof(int32_t);
  return node->children.Find(key, [&](const Node* child) {
    return NsOf(child) == ns && std::memcmp(child->key(), tokens, bytes) == 0;
  });
}

void RadixTree::ReserveNodes(size_t k) {
  // Room first, so that every node, once made, can be a member of both heaps
  // and have its id freed without allocating.
  const size_t want = nodes_.size() + (k > free_ids_.size() ? k - free_ids_.size() : 0);
  heap_.Reserve(want);
  host_heap_.Reserve(want);
  for (auto& [ns, q] : quotas_) {
    q->heap.Reserve(want);
    q->host_heap.Reserve(want);
  }
  if (free_ids_.capacity() < want) free_ids_.reserve(std::max(want, 2 * free_ids_.capacity()));
  if (victims_.capacity() < want) victims_.reserve(std::max(want, 2 * victims_.capacity()));
  if (!extras_.empty() && extras_.capacity() < want) {
    extras_.reserve(std::max(want, 2 * extras_.capacity()));
  }
  while (free_ids_.size() < k) {
    const auto id = static_cast<uint32_t>(nodes_.size());
    nodes_.Add()->id = id;  // on failure the nodes made so far stay free
    if (!extras_.empty()) extras_.emplace_back();  // room reserved
    free_ids_.push_back(id);
  }
}

Node* RadixTree::TakeNode(Node* parent, NodeBlock data, int64_t length, uint64_t ns) noexcept {
  Node* node = nodes_[free_ids_.back()];
  free_ids_.pop_back();
  data.MoveTo(node, length);
  if (parent != root_) ns = NsOf(parent);
  node->child_key = ChildKey(parent, node->key(), ns);
  node->parent = parent;
  node->depth = parent->depth + length;
  node->ref_count = 0;
  node->timestamp = clock_;
  node->priority = 0;
  node->device_children = node->host_children = node->hits = 0;
  node->on_device = false;  // the caller puts it on the device (SetOnDevice)
  node->backing_up = node->loading = node->storage_writing = node->from_storage = false;
  if (!extras_.empty()) {
    NodeExtra& e = extras_[node->id];
    e = NodeExtra{};
    e.ns = ns;
    e.created = clock_;
  }
  ++num_nodes_;
  return node;
}

void RadixTree::FreeNode(Node* node) noexcept {
  FreeStorage(node);
  FreeHost(node);
  node->children.Clear();
  node->parent = nullptr;
  node->length = 0;
  node->ref_count = 0;
  ++node->generation;
  ++node->incarnation;
  free_ids_.push_back(node->id);  // room reserved by ReserveNodes
  --num_nodes_;
}

void RadixTree::SetOnDevice(Node* x, bool on) noexcept {
  if (x->on_device == on) return;
  x->on_device = on;
  if (on) x->from_storage = false;
  const int64_t d = on ? 1 : -1;
  x->parent->device_children += static_cast<uint32_t>(d);
  (Protected(x) ? protected_size_ : evictable_size_) += d * x->length;
  if (x->has_host()) host_only_size_ -= d * x->length;
  if (Quota* q = QuotaOf(NsOf(x))) q->device += d * x->length;
}

void RadixTree::CountHost(Node* x, int64_t sign) noexcept {
  host_size_ += sign * x->length;
  if (!x->on_device) host_only_size_ += sign * x->length;
  if (Quota* q = QuotaOf(NsOf(x))) q->host += sign * x->length;
}

void RadixTree::Refresh(Node* x) noexcept {
  if (x == root_) return;
  const bool device = DeviceEvictable(x);
  if (device != heap_.Contains(x->id)) {
    device ? heap_.Push(x->id, Key(x)) : heap_.Erase(x->id);  // room reserved
  }
  if (Quota* q = QuotaOf(NsOf(x))) RefreshQuota(x, q);
  // A node leaves the host heap before it loses its host copy, so one
  // without a copy is not there (and a tree without a host tier pays nothing).
  if (!x->has_host()) return;
  const bool host = HostEvictable(x);
  if (host != host_heap_.Contains(x->id)) {
    host ? host_heap_.Push(x->id, Key(x)) : host_heap_.Erase(x->id);
  }
}

void RadixTree::LockPath(Node* node, int64_t delta) noexcept {
  for (Node* x = node; x != root_; x = x->parent) {
    const bool was = x->ref_count > 0;
    const bool was_protected = Protected(x);
    x->ref_count += delta;
    if (was == (x->ref_count > 0)) continue;
    Reprotect(x, was_protected);
    Refresh(x);
  }
}

void RadixTree::Reprotect(Node* x, bool was) noexcept {
  const bool is = Protected(x);
  if (was == is || !x->on_device) return;
  const int64_t moved = is ? x->length : -x->length;
  evictable_size_ -= moved;
  protected_size_ += moved;
}

Node* RadixTree::DeviceEnd(Node* x) const noexcept {
  while (x != root_ && !x->on_device) x = x->parent;
  return x;
}

void RadixTree::PrepareSplit(Node* node, int64_t pos, uint32_t children, SplitPlan* plan) {
  plan->node = node;
  plan->pos = pos;
  const int64_t rest = node->length - pos;
  const bool front = pos <= rest;  // the smaller part is the prefix
  const int64_t from = front ? 0 : pos, length = front ? pos : rest;
  const size_t page_bytes = static_cast<size_t>(length / page_size_) * sizeof(int32_t);
  plan->smaller = NodeBlock(&arena_, node->key() + from, length, page_size_);
  std::memcpy(plan->smaller.pages(), node->value() + from / page_size_, page_bytes);
  if (node->has_host()) {
    plan->smaller_host = NodeBlock(&arena_, nullptr, length, page_size_);
    std::memcpy(plan->smaller_host.pages(), Ex(node).host + from / page_size_, page_bytes);
  }
  plan->prefix_children.Reserve(children);
}

Node* RadixTree::CommitSplit(SplitPlan* plan) noexcept {
  Node* node = plan->node;
  const int64_t pos = plan->pos, len = node->length, rest = len - pos;
  const int64_t pos_pages = pos / page_size_, rest_pages = rest / page_size_;
  const bool host = node->has_host();
  Node* parent = node->parent;
  Node* prefix;
  if (pos <= rest) {
    // The suffix keeps the blocks: its tokens and slots move to the front.
    prefix = TakeNode(parent, std::move(plan->smaller), pos, NsOf(node));
    std::memmove(node->data, node->data + pos, rest * sizeof(int32_t));
    std::memmove(node->data + rest, node->data + len + pos_pages, rest_pages * sizeof(int32_t));
    if (host) {
      plan->smaller_host.MoveToHost(prefix, &MutEx(prefix));
      int32_t* slots = MutEx(node).host;
      std::memmove(slots, slots + pos_pages, rest_pages * sizeof(int32_t));
    }
    node->length = rest;
  } else {
    // The prefix takes the blocks: its tokens stay, its slots move down.
    NodeBlock suffix = std::move(plan->smaller);
    prefix =
        TakeNode(parent, NodeBlock::Adopt(&arena_, node, nullptr, page_size_), pos, NsOf(node));
    std::memmove(prefix->data + pos, prefix->data + len, pos_pages * sizeof(int32_t));
    suffix.MoveTo(node, rest);
    if (host) {
      NodeBlock::Adopt(&arena_, node, &MutEx(node), page_size_).MoveToHost(prefix, &MutEx(prefix));
      plan->smaller_host.MoveToHost(node, &MutEx(node));
    }
  }
  // The prefix holds what the node held, tier state included.
  prefix->ref_count = node->ref_count;
  if (!extras_.empty()) {
    NodeExtra& to = extras_[prefix->id];
    const NodeExtra& from = extras_[node->id];
    to.claims = from.claims;
    to.host_claims = from.host_claims;
    to.created = from.created;
  }
  prefix->timestamp = node->timestamp;
  prefix->priority = node->priority;
  prefix->hits = node->hits;
  prefix->on_device = node->on_device;
  prefix->backing_up = node->backing_up;
  prefix->loading = node->loading;
  prefix->storage_writing = node->storage_writing;
  prefix->from_storage = node->from_storage;
  prefix->device_children = node->on_device;
  prefix->host_children = node->has_host() || node->backing_up;
  prefix->children = std::move(plan->prefix_children);
  parent->children.Replace(node->child_key, node, prefix);

  node->depth = prefix->depth + rest;
  node->child_key = ChildKey(prefix, node->key(), NsOf(node));
  node->parent = prefix;
  prefix->children.Insert(node->child_key, node);  // room reserved
  Refresh(prefix);
  if (policy_ == EvictionPolicy::kTlru) Rekey(node);  // shorter now: its key may have fallen
  return prefix;
}

void RadixTree::Rekey(Node* x) noexcept {
  const uint64_t key = Key(x);
  if (heap_.Contains(x->id)) heap_.Update(x->id, key);
  if (host_heap_.Contains(x->id)) host_heap_.Update(x->id, key);
  if (Quota* q = QuotaOf(NsOf(x))) {
    if (q->heap.Contains(x->id)) q->heap.Update(x->id, key);
    if (q->host_heap.Contains(x->id)) q->host_heap.Update(x->id, key);
  }
}

void RadixTree::Touch(Node* node) noexcept {
  // The heaps are not updated here: a leaf's key there may fall behind its
  // timestamp, and eviction puts it right when it reaches the top.
  for (Node* x = node; x != root_; x = x->parent) x->timestamp = clock_;
  if (policy_ != EvictionPolicy::kMru) return;
  for (Node* x = node; x != root_; x = x->parent) Rekey(x);
}

int64_t RadixTree::Walk(const int32_t* tokens, int64_t n, uint64_t ns, Node** node, Node** partial,
                        int64_t* partial_len, Node* start) const {
  Node* cur = start != nullptr ? start : root_;
  int64_t pos = cur == root_ ? 0 : cur->depth;
  *partial = nullptr;
  *partial_len = 0;
  while (pos < n) {
    Node* child = FindChild(cur, tokens + pos, ns);
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

// --- match, insert, locks ------------------------------------------------------

void RadixTree::RequireAligned(bool pages) const {
  RADIXKV_CHECK(!pages || aligned_, kInvalid,
                "page ids need a tree whose pages are aligned in their pool (aligned_pages)");
}

Handle RadixTree::MatchPrefix(const int32_t* tokens, int64_t n, SlotSink out, uint64_t ns) {
  RequireAligned(out.pages());
  RADIXKV_CHECK(n >= 0, kInvalid, "input length must be >= 0, got ", n);
  n -= n % page_size_;
  Node* node;
  Node* partial;
  int64_t partial_len;
  const int64_t matched = Walk(tokens, n, ns, &node, &partial, &partial_len);
  SplitPlan split;
  if (partial != nullptr) {
    ReserveNodes(1);
    PrepareSplit(partial, partial_len, 1, &split);
  }
  // The device part: the path is on the device down to some node, then host only.
  const int64_t device_len =
      partial != nullptr && partial->on_device ? matched : DeviceEnd(node)->depth;
  int32_t* slots = out(Units(out.pages(), device_len));
  // Nothing below allocates or throws.
  ++clock_;
  Node* end = partial != nullptr ? CommitSplit(&split) : node;
  Touch(end);
  for (Node* x = end; x != root_; x = x->parent) {
    if (x->hits != UINT32_MAX) ++x->hits;  // saturates: keys must never fall (see Key)
  }
  Node* device_end = DeviceEnd(end);
  CopyPathSlots(device_end, slots, out.pages());
  Handle h;
  h.tree_id = id_;
  h.generation = device_end->generation;
  h.node_id = device_end->id;
  h.cached_len = device_end->depth;
  h.host_generation = end->generation;
  h.host_node_id = end->id;
  h.ns = ns;
  h.host_hit_len = end->depth - device_end->depth;
  return h;
}

int64_t RadixTree::InsertPrefix(const int32_t* tokens, SlotSource in, int64_t n,
                                int32_t priority, uint64_t ns, const Handle* prefix) {
  RADIXKV_CHECK(n >= 0, kInvalid, "input length must be >= 0, got ", n);
  RequireAligned(in.pages);
  struct ShrinkRuns {
    SlotRuns& runs;
    ~ShrinkRuns() { runs.Shrink(); }
  } shrink{runs_};
  // All of the input is checked, the cached part and a partial last page
  // too: the caller frees its own copies of those, so a bad one is a bug
  // either way.
  if (in.pages) {
    // Page ids: in range and distinct as pages; their slots as runs.
    const int64_t k = (n + page_size_ - 1) / page_size_;
    CheckSlots(in.data, k, "page_ids", &scratch_,
               max_slots_ == kAnySlot ? (int64_t{1} << 31) / page_size_ : max_slots_ / page_size_);
    runs_.AssignPageIds(in.data, k, page_size_);
    n -= n % page_size_;
  } else {
    runs_.Assign(in.data, n);
    CheckSlots(runs_, in.data, "indices", &scratch_, max_slots_);
    n -= n % page_size_;
    // The tree keeps a slot per page: each whole page's slots must be one run.
    CheckPages(runs_, in.data, n, page_size_, "indices", aligned_);
  }
  // A checked prefix is walked from its node (its path is tokens[0, depth)).
  Node* start = prefix != nullptr ? Resolve(*prefix, "prefix") : nullptr;
  if (start != nullptr && (start->depth != prefix->cached_len || start->depth > n)) start = nullptr;
  Node* node;
  Node* partial;
  int64_t partial_len;
  const int64_t pos = Walk(tokens, n, ns, &node, &partial, &partial_len, start);
  // Host-only nodes on the path take the caller's slots: from the device end
  // on, every slot goes to the tree.
  const int64_t device_len =
      partial != nullptr && partial->on_device ? pos : DeviceEnd(node)->depth;
  for (Node* x = node; x != root_ && !x->on_device; x = x->parent) {
    RADIXKV_CHECK(!x->loading, kInvalid,
                  "input_ids runs through a prefix whose load from host is in flight: wait for "
                  "it (loading_check) before inserting");
  }
  RADIXKV_CHECK(partial == nullptr || !partial->loading, kInvalid,
                "input_ids runs through a prefix whose load from host is in flight: wait for it "
                "(loading_check) before inserting");
  runs_.DropBefore(device_len);
  runs_.DropAfter(n);
  const int64_t stored = stored_.AddAll(runs_);
  if (stored >= 0) {
    const int64_t at = in.pages ? stored / page_size_ : stored;
    throw Error(kInvalid, StrCat(in.pages ? "page_ids[" : "indices[", at, "] = ", in.data[at],
                                 " is already stored in the cache"));
  }
  SplitPlan split;
  NodeBlock leaf_data;
  try {
    if (ns != 0) NeedExtras();  // the new nodes' namespace
    ReserveNodes((partial != nullptr) + (pos < n));
    if (partial != nullptr) PrepareSplit(partial, partial_len, 1 + (pos < n), &split);
    if (pos < n) {
      leaf_data = NodeBlock(&arena_, tokens + pos, n - pos, page_size_);
      if (in.pages) {
        FirstOfPageIds(in.At(pos, page_size_), (n - pos) / page_size_, page_size_,
                       leaf_data.pages());
      } else {
        FirstOfPages(in.data + pos, (n - pos) / page_size_, page_size_, leaf_data.pages());
      }
      if (partial == nullptr) node->children.Reserve(node->children.size() + 1);
    }
  } catch (...) {
    stored_.RemoveAll(runs_);
    throw;
  }
  // Nothing below allocates or throws.
  ++clock_;
  if (partial != nullptr) node = CommitSplit(&split);
  for (Node* x = node; x != root_ && !x->on_device; x = x->parent) {
    TakeFirsts(in, x->depth - x->length, x, x->value());
    SetOnDevice(x, true);
    Refresh(x);
    Refresh(x->parent);
  }
  for (Node* x = node; x != root_; x = x->parent) x->priority = std::max(x->priority, priority);
  Touch(node);
  if (leaf_data) {
    Node* leaf = TakeNode(node, std::move(leaf_data), n - pos, ns);
    leaf->priority = priority;
    node->children.Insert(leaf->child_key, leaf);
    SetOnDevice(leaf, true);
    Refresh(leaf);
    Refresh(node);
  }
  return device_len;
}

Node* RadixTree::Resolve(const Handle& handle, const char* what) const {
  RADIXKV_CHECK(handle.tree_id == id_, kInvalid, what, " belongs to another cache manager");
  RADIXKV_CHECK(IsValid(handle), kInvalid, what,
                " is stale: its node was evicted or the cache was reset");
  return nodes_[handle.node_id];
}

bool RadixTree::IsValid(const Handle& handle) const noexcept {
  // Freeing a node bumps its generation, so a matching generation means the
  // node is the one the handle was made for, still in the tree.
  return handle.tree_id == id_ && handle.node_id < nodes_.size() &&
         nodes_[handle.node_id]->generation == handle.generation;
}

void RadixTree::CopyPathSlots(const Node* node, int32_t* out, bool pages) const noexcept {
  for (const Node* x = node; x != root_; x = x->parent) {
    Emit(x->value(), x, out + Units(pages, x->depth - x->length), pages);
  }
}

int64_t RadixTree::AddSlots(SlotSet* set, SlotSource in, int64_t pos, int64_t tokens) {
  if (in.pages) return set->AddPageIds(in.At(pos, page_size_), tokens / page_size_, page_size_);
  return set->AddAll(in.data + pos, tokens);
}

void RadixTree::RemoveSlots(SlotSet* set, SlotSource in, int64_t pos, int64_t tokens) noexcept {
  if (in.pages) {
    set->RemovePageIds(in.At(pos, page_size_), tokens / page_size_, page_size_);
  } else {
    set->RemoveAll(in.data + pos, tokens);
  }
}

void RadixTree::HandleSlots(const Handle& handle, SlotSink out) const {
  RequireAligned(out.pages());
  const Node* node = Resolve(handle, "handle");
  RADIXKV_CHECK(node == root_ || node->on_device, kInvalid,
                "handle's prefix is not on the device (its load from host did not finish)");
  CopyPathSlots(node, out(Units(out.pages(), node->depth)), out.pages());
}

bool RadixTree::HandleMatches(const Handle& handle, const int32_t* tokens,
                              SlotSource in) const {
  RequireAligned(in.pages);
  const int32_t* slots = in.data;
  const Node* node = Resolve(handle, "handle");
  RADIXKV_CHECK(slots == nullptr || node == root_ || node->on_device, kInvalid,
                "handle's prefix is not on the device (its load from host did not finish)");
  for (const Node* x = node; x != root_; x = x->parent) {
    const int64_t start = x->depth - x->length;
    if (!std::equal(x->key(), x->key() + x->length, tokens + start)) return false;
    if (slots == nullptr) continue;
    const int32_t* first = x->value();
    if (in.pages) {  // a page id is its first slot / page_size (aligned)
      const int32_t* given = in.At(start, page_size_);
      int32_t differ = 0;
      for (int64_t p = 0; p < Pages(x); ++p) {
        differ |= static_cast<int32_t>(int64_t{given[p]} * page_size_ != first[p]);
      }
      if (differ != 0) return false;
      continue;
    }
    // A page's slots are consecutive from its first: compare, never expand.
    for (int64_t p = 0; p < Pages(x); ++p) {
      const int32_t* given = slots + start + p * page_size_;
      int32_t differ = 0;  // branch-free within a page, so it vectorizes
      for (int32_t j = 0; j < page_size_; ++j) differ |= given[j] ^ (first[p] + j);
      if (differ != 0) return false;
    }
  }
  return true;
}

void RadixTree::Lock(Handle* handle) {
  Node* node = Resolve(*handle, "handle");
  ++clock_;
  LockPath(node, +1);
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
  LockPath(node, -1);
  --handle->lock_count;
}

void RadixTree::Reset() {
  for (size_t i = 1; i < nodes_.size(); ++i) {
    if (nodes_[i]->parent != nullptr) FreeNode(nodes_[i]);
  }
  root_->children.Clear();
  root_->device_children = root_->host_children = 0;
  ++root_->generation;
  heap_.Clear();
  host_heap_.Clear();
  for (auto& [ns, q] : quotas_) {
    q->heap.Clear();
    q->host_heap.Clear();
    q->device = q->host = 0;
  }
  stored_.Clear();
  stored_host_.Clear();
  evictable_size_ = protected_size_ = 0;
  host_size_ = host_only_size_ = backing_up_size_ = loading_size_ = storage_writing_size_ = 0;
  host_pins_ = claimed_size_ = 0;
  ++clock_;
}

TierSizes RadixTree::tier_sizes() const noexcept {
  TierSizes s;
  s.device_evictable = evictable_size_;
  s.device_protected = protected_size_;
  s.host = host_size_;
  s.host_only = host_only_size_;
  s.backing_up = backing_up_size_;
  s.loading = loading_size_;
  s.storage_writing = storage_writing_size_;
  return s;
}

}  // namespace radixkv
