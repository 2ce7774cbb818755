// The eviction policies of the radix tree: their names, their parsing and the
// order each one evicts in, in one place (the bindings and Python read the
// names from here).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <string_view>

namespace radixkv {

/// Which unlocked leaf goes first, on both tiers; ties (and everything
/// within a class) go least recently used first, and the order is exact.
enum class EvictionPolicy : uint8_t {
  kLru,       ///< least recently used
  kLfu,       ///< fewest matches (counted up to 2^24 - 1), then least recently used
  kFifo,      ///< cached earliest
  kMru,       ///< most recently used
  kPriority,  ///< lowest priority (InsertPrefix's, clamped to int16), then least recently used
  kSlru,      ///< segmented: leaves matched fewer than twice (probation) before the others
              ///< (protected), least recently used within each segment
  kTlru,      ///< tail-optimized: leaves at most the tree's TEL-safe length long (their
              ///< recompute keeps the next turn within its TTFT budget) first, then the
              ///< others, least recently used within each
};

/// The policies' names, in the enum's order.
inline constexpr std::array<std::string_view, 7> kEvictionPolicyNames = {
    "lru", "lfu", "fifo", "mru", "priority", "slru", "tlru"};

inline std::string_view EvictionPolicyName(EvictionPolicy policy) noexcept {
  return kEvictionPolicyNames[static_cast<size_t>(policy)];
}

/// The policy named `name`; false, leaving `*policy` alone, for no policy.
inline bool ParseEvictionPolicy(std::string_view name, EvictionPolicy* policy) noexcept {
  for (size_t i = 0; i < kEvictionPolicyNames.size(); ++i) {
    if (name == kEvictionPolicyNames[i]) {
      *policy = static_cast<EvictionPolicy>(i);
      return true;
    }
  }
  return false;
}

/// A node's order under `policy` in the tree's eviction heaps (smallest
/// first), from its last access time, matches, creation time, priority and
/// length (tlru: with `tel_safe`, the longest leaf safe to evict first).
/// Every policy but mru only ever raises a node's key as it is used, so a
/// heap may hold keys that lag (the tree re-keys a lagging top before it
/// evicts it); mru's keys fall when used and are kept exact, and tlru's fall
/// only when a split shortens a node, which re-keys it.
inline uint64_t EvictionKey(EvictionPolicy policy, uint64_t timestamp, uint32_t hits,
                            uint64_t created, int32_t priority, int64_t length = 0,
                            int64_t tel_safe = 0) noexcept {
  constexpr uint64_t kTime40 = (uint64_t{1} << 40) - 1, kTime48 = (uint64_t{1} << 48) - 1;
  switch (policy) {
    case EvictionPolicy::kLfu:
      return (uint64_t{std::min<uint32_t>(hits, (1u << 24) - 1)} << 40) | (timestamp & kTime40);
    case EvictionPolicy::kFifo:
      return created;
    case EvictionPolicy::kMru:
      return ~timestamp;
    case EvictionPolicy::kPriority:
      // Priorities past int16 order as its ends.
      return (uint64_t(std::clamp<int32_t>(priority, -32768, 32767) + 32768) << 48) |
             (timestamp & kTime48);
    case EvictionPolicy::kSlru:
      return (uint64_t{hits >= 2} << 63) | (timestamp & ((uint64_t{1} << 63) - 1));
    case EvictionPolicy::kTlru:
      return (uint64_t{length > tel_safe} << 63) | (timestamp & ((uint64_t{1} << 63) - 1));
    default:
      return timestamp;
  }
}

}  // namespace radixkv
