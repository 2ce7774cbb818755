// The tree's side of retention claims: per-node claim counts, the tokens they
// hold, and the tier each claim keeps its path on. Deadlines, budgets and
// refreshing are the manager's (python/radixkv/scheduler/retention.py).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "radix_node.h"
#include "radixkv/radix_tree.h"
#include "radixkv/status.h"

namespace radixkv {

using tree_errors::kInvalid;

Node* RadixTree::MatchedEnd(const Handle& handle, bool host) const {
  Node* end = Resolve(handle, "handle");
  if (host && handle.host_hit_len > 0 && handle.host_node_id < nodes_.size()) {
    Node* deeper = nodes_[handle.host_node_id];
    // A host part evicted since the match leaves the device part.
    if (deeper->generation == handle.host_generation) end = deeper;
  }
  return end;
}

int64_t RadixTree::ClaimCost(const Handle& handle, bool host) const {
  int64_t cost = 0;
  for (const Node* x = MatchedEnd(handle, host); x != root_ && Ex(x).claims == 0; x = x->parent) {
    cost += x->length;  // a claimed node's ancestors are all claimed
  }
  return cost;
}

int64_t RadixTree::PrefixClaimCost(const int32_t* tokens, int64_t n, uint64_t ns, bool host) const {
  RADIXKV_CHECK(n >= 0, kInvalid, "input length must be >= 0, got ", n);
  n -= n % page_size_;
  Node* node;
  Node* partial;
  int64_t partial_len;
  Walk(tokens, n, ns, &node, &partial, &partial_len);
  // A match would split `partial`: its front part, `partial_len` tokens with
  // its tier state and claims, would end the match (a device claim's only
  // while on the device: the device part is a prefix of every path).
  int64_t cost = 0;
  const Node* x = host ? node : DeviceEnd(node);
  if (partial != nullptr && (host || partial->on_device)) {
    if (Ex(partial).claims > 0) return 0;  // a claimed node's ancestors are all claimed
    cost = partial_len;
    x = node;
  }
  for (; x != root_ && Ex(x).claims == 0; x = x->parent) cost += x->length;
  return cost;
}

TierCopy RadixTree::AddClaim(const Handle& handle, bool host, int32_t priority, int64_t* added) {
  Node* end = MatchedEnd(handle, host);
  for (const Node* x = end; x != root_; x = x->parent) {
    RADIXKV_CHECK(Ex(x).claims < INT32_MAX, kInvalid, "node ", x->id, " has too many claims");
  }
  NeedExtras();
  // Nothing below allocates or throws.
  ++clock_;
  int64_t claimed = 0;
  for (Node* x = end; x != root_; x = x->parent) {
    if (MutEx(x).claims++ == 0) claimed += x->length;
    x->priority = std::max(x->priority, priority);  // a key only rises: a heap may lag
    if (host && MutEx(x).host_claims++ == 0) Refresh(x);
  }
  // A device claim locks its path; a host claim too while its end has no
  // host copy (FinishBackup gives that lock back), since until then the path
  // may not leave the device.
  if (end != root_ && (!host || !end->has_host())) {
    LockPath(end, +1);
    if (host) ++MutEx(end).host_claim_locks;
  }
  claimed_size_ += claimed;
  if (added != nullptr) *added = claimed;
  return TierCopy{end->id, end->incarnation, host ? kHostClaim : 0, end->depth};
}

int64_t RadixTree::ReleaseClaim(const TierCopy& claim) {
  RADIXKV_CHECK(claim.start == 0 || claim.start == kHostClaim, kInvalid,
                "claim is a copy between the tiers, not a claim");
  const bool host = claim.start == kHostClaim;
  Node* end = ResolveCopy(claim);
  if (end == nullptr) return 0;  // the root's claim, or its node is gone (Reset)
  const bool locked = !host || Ex(end).host_claim_locks > 0;
  for (const Node* x = end; x != root_; x = x->parent) {
    // Each node holds a claim of the released one's kind (the device claims
    // are those that are not host claims).
    const NodeExtra& e = Ex(x);
    RADIXKV_CHECK((host ? e.host_claims > 0 : e.claims > e.host_claims) &&
                      (!locked || x->ref_count > 0),
                  kInvalid, "claim is not held: it was released already, or was never made");
  }
  ++clock_;
  if (locked) {
    if (host) --MutEx(end).host_claim_locks;
    LockPath(end, -1);
  }
  int64_t freed = 0;
  for (Node* x = end; x != root_; x = x->parent) {
    if (--MutEx(x).claims == 0) freed += x->length;
    if (host && --MutEx(x).host_claims == 0) Refresh(x);
  }
  claimed_size_ -= freed;
  return freed;
}

std::vector<uint32_t> RadixTree::ClaimedPath(const Handle& handle) const {
  std::vector<uint32_t> ids;
  const Node* x = MatchedEnd(handle, true);
  while (x != root_ && Ex(x).claims == 0) x = x->parent;
  for (; x != root_; x = x->parent) ids.push_back(x->id);
  return ids;
}

int64_t RadixTree::LockedBeyondClaims() const {
  // A node's claim locks: its device claims, and the host claims' locks of
  // its subtree (each held from the claim's end up), summed children first.
  std::vector<const Node*> order;
  std::vector<const Node*> stack{root_};
  while (!stack.empty()) {
    const Node* x = stack.back();
    stack.pop_back();
    order.push_back(x);
    x->children.ForEach([&](uint64_t, const Node* child) { stack.push_back(child); });
  }
  std::vector<int64_t> host_locks(nodes_.size(), 0);
  int64_t locked = 0;
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    const Node* x = *it;
    if (x == root_) continue;
    host_locks[x->id] += Ex(x).host_claim_locks;
    host_locks[x->parent->id] += host_locks[x->id];
    const int64_t by_claims = Ex(x).claims - Ex(x).host_claims + host_locks[x->id];
    if (x->on_device && x->ref_count > by_claims) locked += x->length;
  }
  return locked;
}

}  // namespace radixkv
