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
    Node* deeper = nodes_[handle.host_node_id].get();
    // A host part evicted since the match leaves the device part.
    if (deeper->generation == handle.host_generation) end = deeper;
  }
  return end;
}

int64_t RadixTree::ClaimCost(const Handle& handle, bool host) const {
  int64_t cost = 0;
  for (const Node* x = MatchedEnd(handle, host); x != root_ && x->claims == 0; x = x->parent) {
    cost += x->length;  // a claimed node's ancestors are all claimed
  }
  return cost;
}

TierCopy RadixTree::AddClaim(const Handle& handle, bool host, int32_t priority, int64_t* added) {
  Node* end = MatchedEnd(handle, host);
  for (const Node* x = end; x != root_; x = x->parent) {
    RADIXKV_CHECK(x->claims < INT32_MAX, kInvalid, "node ", x->id, " has too many claims");
  }
  // Nothing below allocates or throws.
  ++clock_;
  int64_t claimed = 0;
  for (Node* x = end; x != root_; x = x->parent) {
    if (x->claims++ == 0) claimed += x->length;
    x->priority = std::max(x->priority, priority);  // a key only rises: a heap may lag
    if (host && x->host_claims++ == 0) {
      Reprotect(x, x->ref_count > 0);  // it was protected only if locked
      Refresh(x);
    }
  }
  if (!host) LockPath(end, +1);
  claimed_size_ += claimed;
  if (added != nullptr) *added = claimed;
  return TierCopy{end->id, end->incarnation, 0, end->depth};
}

int64_t RadixTree::ReleaseClaim(const TierCopy& claim, bool host) {
  Node* end = ResolveCopy(claim);
  if (end == nullptr) return 0;  // the root's claim, or its node is gone (Reset)
  RADIXKV_CHECK(claim.start == 0, kInvalid, "claim is a copy between the tiers, not a claim");
  for (const Node* x = end; x != root_; x = x->parent) {
    RADIXKV_CHECK(x->claims > 0 && (host ? x->host_claims > 0 : x->ref_count > 0), kInvalid,
                  "claim is not held: it was released already, or was made ",
                  host ? "without" : "with", " host=True");
  }
  ++clock_;
  if (!host) LockPath(end, -1);
  int64_t freed = 0;
  for (Node* x = end; x != root_; x = x->parent) {
    if (--x->claims == 0) freed += x->length;
    if (host && x->host_claims == 1) {
      const bool was = Protected(x);
      x->host_claims = 0;
      Reprotect(x, was);
      Refresh(x);
    } else if (host) {
      --x->host_claims;
    }
  }
  claimed_size_ -= freed;
  return freed;
}

std::vector<uint32_t> RadixTree::ClaimedPath(const Handle& handle) const {
  std::vector<uint32_t> ids;
  const Node* x = MatchedEnd(handle, true);
  while (x != root_ && x->claims == 0) x = x->parent;
  for (; x != root_; x = x->parent) ids.push_back(x->id);
  return ids;
}

int64_t RadixTree::LockedBeyondClaims() const noexcept {
  int64_t locked = 0;
  for (size_t i = 1; i < nodes_.size(); ++i) {
    const Node* x = nodes_[i].get();
    if (x->parent != nullptr && x->on_device && x->ref_count > x->claims - x->host_claims) {
      locked += x->length;
    }
  }
  return locked;
}

}  // namespace radixkv
