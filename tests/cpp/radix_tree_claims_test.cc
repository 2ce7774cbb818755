// Retention claims in the tree: what they keep on which tier, the tokens they
// hold (shared paths counted once), splits of claimed nodes, and release.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "radixkv/radix_tree.h"
#include "radixkv/status.h"
#include "tree_test_util.h"

namespace radixkv {
namespace {

using testing_util::Insert;
using testing_util::Ints;
using testing_util::Iota;

Handle Match(RadixTree* t, const Ints& tokens) {
  Ints out;
  return t->MatchPrefix(tokens.data(), static_cast<int64_t>(tokens.size()), &out);
}

int64_t Evictable(RadixTree* t) { return t->evictable_size(); }

TEST(RadixTreeClaimsTest, DeviceClaimKeepsThePathAndCountsSharedTokensOnce) {
  RadixTree t;
  Insert(&t, {1, 2, 3, 4, 5, 6}, Iota(0, 6));
  Insert(&t, {1, 2, 3, 7, 8}, Iota(10, 5));
  int64_t added = 0;
  Handle a = Match(&t, {1, 2, 3, 4, 5, 6});
  EXPECT_EQ(t.ClaimCost(a, false), 6);
  TierCopy ca = t.AddClaim(a, false, 0, &added);
  EXPECT_EQ(added, 6);
  EXPECT_EQ(ca.end, 6);
  Handle b = Match(&t, {1, 2, 3, 7, 8});
  EXPECT_EQ(t.ClaimCost(b, false), 2);  // {1, 2, 3} is claimed already
  TierCopy cb = t.AddClaim(b, false, 0, &added);
  EXPECT_EQ(added, 2);
  EXPECT_EQ(t.claimed_size(), 8);
  EXPECT_EQ(Evictable(&t), 0);
  t.CheckIntegrity();
  Ints freed;
  EXPECT_THROW(t.Evict(1, &freed), Error);

  EXPECT_EQ(t.ReleaseClaim(ca), 3);  // {4, 5, 6}; {1, 2, 3} stays claimed
  EXPECT_EQ(t.claimed_size(), 5);
  EXPECT_EQ(Evictable(&t), 3);
  t.Evict(3, &freed);
  EXPECT_EQ(freed, Iota(3, 3));
  EXPECT_EQ(t.ReleaseClaim(cb), 5);
  EXPECT_EQ(t.claimed_size(), 0);
  t.CheckIntegrity();
  // Released twice: refused, nothing changes.
  EXPECT_THROW(t.ReleaseClaim(cb), Error);
  t.CheckIntegrity();
}

TEST(RadixTreeClaimsTest, SplittingAClaimedNodeKeepsTheClaimWhole) {
  RadixTree t;
  Insert(&t, Iota(0, 8), Iota(100, 8));
  int64_t added = 0;
  TierCopy c = t.AddClaim(Match(&t, Iota(0, 8)), false, 0, &added);
  // A match that ends inside the claimed node splits it.
  Handle half = Match(&t, Iota(0, 3));
  EXPECT_EQ(half.cached_len, 3);
  t.CheckIntegrity();
  EXPECT_EQ(t.claimed_size(), 8);
  EXPECT_EQ(t.ClaimCost(half, false), 0);
  EXPECT_EQ(t.ReleaseClaim(c), 8);
  t.CheckIntegrity();
  EXPECT_EQ(Evictable(&t), 8);
}

TEST(RadixTreeClaimsTest, HostClaimLetsThePathLeaveTheDeviceOnlyWithAHostCopy) {
  RadixTree t;
  Insert(&t, {1, 2, 3, 4}, {10, 11, 12, 13});
  int64_t added = 0;
  TierCopy c = t.AddClaim(Match(&t, {1, 2, 3, 4}), true, 0, &added);
  EXPECT_EQ(added, 4);
  // No host copy yet: the path may not leave the device.
  EXPECT_EQ(Evictable(&t), 0);
  EXPECT_EQ(t.protected_size(), 4);
  Ints freed;
  EXPECT_THROW(t.Evict(4, &freed), Error);
  t.CheckIntegrity();
  // Backed up: it may leave the device, and its host copy then stays.
  TierCopy backup;
  ASSERT_TRUE(t.FindBackup(Ints{1, 2, 3, 4}.data(), 4, 0, &backup));
  Ints device;
  t.BeginBackup(backup, &device);
  const Ints host = Iota(50, 4);
  Ints rejected;
  EXPECT_EQ(t.FinishBackup(backup, host.data(), true, SlotSink::Into(&rejected)), 0);
  EXPECT_EQ(Evictable(&t), 4);
  t.Evict(4, &freed);
  EXPECT_EQ(freed.size(), 4u);
  EXPECT_EQ(t.tier_sizes().host_only, 4);
  EXPECT_THROW(t.EvictHost(4, &freed), Error);
  t.CheckIntegrity();
  // Released: the host copy may go, and with it the node.
  EXPECT_EQ(t.ReleaseClaim(c), 4);
  t.EvictHost(4, &freed);
  EXPECT_EQ(t.num_nodes(), 0);
  t.CheckIntegrity();
}

TEST(RadixTreeClaimsTest, HostClaimWithoutAHostCopyKeepsItsWholePathOnTheDevice) {
  RadixTree t;
  Insert(&t, {1, 2, 3, 4}, {10, 11, 12, 13});
  TierCopy backup;  // the parent {1, 2, 3, 4} gets a host copy...
  ASSERT_TRUE(t.FindBackup(Ints{1, 2, 3, 4}.data(), 4, 0, &backup));
  Ints device, rejected, freed;
  t.BeginBackup(backup, &device);
  const Ints host = Iota(50, 4);
  t.FinishBackup(backup, host.data(), true, SlotSink::Into(&rejected));
  Insert(&t, {1, 2, 3, 4, 5, 6}, {10, 11, 12, 13, 20, 21});  // ...the child {5, 6} none
  int64_t added = 0;
  TierCopy c = t.AddClaim(Match(&t, {1, 2, 3, 4, 5, 6}), true, 0, &added);
  // The child may not leave without a copy, so neither may its parent.
  EXPECT_EQ(t.evictable_size(), 0);
  EXPECT_EQ(t.protected_size(), 6);
  try {
    t.Evict(1, &freed);
    FAIL() << "evicted what the claim keeps";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kOutOfCapacity);
  }
  t.CheckIntegrity();
  // The child's backup lands: the claim's lock goes, both may leave the device.
  ASSERT_TRUE(t.FindBackup(Ints{1, 2, 3, 4, 5, 6}.data(), 6, 0, &backup));
  t.BeginBackup(backup, &device);
  const Ints host2 = Iota(60, 2);
  t.FinishBackup(backup, host2.data(), true, SlotSink::Into(&rejected));
  EXPECT_EQ(t.evictable_size(), 6);
  t.Evict(6, &freed);
  EXPECT_EQ(t.tier_sizes().host_only, 6);
  t.CheckIntegrity();
  EXPECT_EQ(t.ReleaseClaim(c), 6);
  t.CheckIntegrity();
}

TEST(RadixTreeClaimsTest, HostClaimCoversTheHostPartOfAMatch) {
  RadixTree t;
  Insert(&t, {1, 2, 3, 4}, {10, 11, 12, 13});
  TierCopy backup;
  ASSERT_TRUE(t.FindBackup(Ints{1, 2, 3, 4}.data(), 4, 0, &backup));
  Ints device, freed, rejected;
  t.BeginBackup(backup, &device);
  const Ints host = Iota(50, 4);
  t.FinishBackup(backup, host.data(), true, SlotSink::Into(&rejected));
  t.Evict(4, &freed);
  Handle h = Match(&t, {1, 2, 3, 4});
  EXPECT_EQ(h.cached_len, 0);
  EXPECT_EQ(h.host_hit_len, 4);
  EXPECT_EQ(t.ClaimCost(h, false), 0);  // the device part is empty
  EXPECT_EQ(t.ClaimCost(h, true), 4);
  int64_t added = 0;
  TierCopy c = t.AddClaim(h, true, 0, &added);
  EXPECT_EQ(c.end, 4);
  EXPECT_EQ(t.ClaimedPath(h).size(), 1u);
  EXPECT_THROW(t.EvictHost(4, &freed), Error);
  // A forged device claim for it is refused, changing nothing.
  TierCopy forged = c;
  forged.start = 0;
  EXPECT_THROW(t.ReleaseClaim(forged), Error);
  t.CheckIntegrity();
  EXPECT_EQ(t.ReleaseClaim(c), 4);
  t.CheckIntegrity();
}

TEST(RadixTreeClaimsTest, ClaimRaisesPriorityAndResetDropsClaims) {
  RadixTree t(1, RadixTree::kAnySlot, EvictionPolicy::kPriority);
  Insert(&t, {1, 2}, {0, 1});
  Insert(&t, {5, 6}, {2, 3});
  int64_t added = 0;
  TierCopy c = t.AddClaim(Match(&t, {1, 2}), false, 7, &added);
  EXPECT_EQ(t.ReleaseClaim(c), 2);
  Match(&t, {1, 2});  // {1, 2} is now the most recently used...
  Ints freed;
  t.Evict(2, &freed);  // ...but its priority keeps it: {5, 6} goes
  EXPECT_EQ(freed, (Ints{2, 3}));
  c = t.AddClaim(Match(&t, {1, 2}), false, 0, &added);
  t.Reset();
  EXPECT_EQ(t.claimed_size(), 0);
  EXPECT_EQ(t.ReleaseClaim(c), 0);  // its node is gone: ignored
  t.CheckIntegrity();
}

TEST(RadixTreeClaimsTest, LockedBeyondClaimsCountsOnlyOtherLocks) {
  RadixTree t;
  Insert(&t, {1, 2, 3, 4}, Iota(0, 4));
  int64_t added = 0;
  Handle h = Match(&t, {1, 2, 3, 4});
  t.AddClaim(h, false, 0, &added);
  EXPECT_EQ(t.protected_size(), 4);
  EXPECT_EQ(t.LockedBeyondClaims(), 0);
  Handle r = Match(&t, {1, 2});
  t.Lock(&r);
  EXPECT_EQ(t.LockedBeyondClaims(), 2);
  t.Unlock(&r);
  EXPECT_EQ(t.LockedBeyondClaims(), 0);
  // A host claim without a host copy locks its path: a claim's lock too.
  Insert(&t, {1, 2, 3, 4, 5, 6}, Iota(0, 6));
  t.AddClaim(Match(&t, {1, 2, 3, 4, 5, 6}), true, 0, &added);
  EXPECT_EQ(t.protected_size(), 6);
  EXPECT_EQ(t.LockedBeyondClaims(), 0);
}

// Every field of two dumps (timestamps included) alike.
bool SameDump(const std::vector<NodeInfo>& a, const std::vector<NodeInfo>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].parent != b[i].parent || a[i].key != b[i].key || a[i].value != b[i].value ||
        a[i].host_value != b[i].host_value || a[i].ref_count != b[i].ref_count ||
        a[i].timestamp != b[i].timestamp || a[i].ns != b[i].ns) {
      return false;
    }
  }
  return true;
}

TEST(RadixTreeClaimsTest, PrefixClaimCostIsTheMatchsClaimCostAndChangesNothing) {
  // {1, 2} claimed on the device, {3, 4} on the device, {5..8} host only
  // under it, {20, 21} a device leaf beside that.
  RadixTree t;
  Insert(&t, Iota(1, 8), Iota(0, 8));
  TierCopy backup;
  Ints device, freed, rejected;
  ASSERT_TRUE(t.FindBackup(Iota(1, 8).data(), 8, 0, &backup));
  t.BeginBackup(backup, &device);
  t.FinishBackup(backup, Iota(50, 8).data(), true, SlotSink::Into(&rejected));
  Insert(&t, {1, 2, 3, 4, 20, 21}, {0, 1, 2, 3, 100, 101});
  t.Evict(4, &freed);
  EXPECT_EQ(freed, Iota(4, 4));
  int64_t added = 0;
  t.AddClaim(Match(&t, {1, 2}), false, 0, &added);
  struct Case {
    Ints tokens;
    int64_t device, host;
  };
  const Case cases[] = {
      {Iota(1, 8), 2, 6},  // {3, 4}; and the host part {5..8}
      {Iota(1, 6), 2, 4},  // into the host-only node: a split of it for host
      {{1, 2, 3}, 1, 1},   // into {3, 4} on the device
      {{1}, 0, 0},         // into the claimed {1, 2}
      {{1, 2, 3, 4, 20, 21, 22}, 4, 4},
      {{7, 8}, 0, 0},  // nothing cached
      {{}, 0, 0},
  };
  for (const bool host : {false, true}) {
    for (const Case& c : cases) {
      const int64_t n = static_cast<int64_t>(c.tokens.size());
      const std::vector<NodeInfo> before = t.Dump();
      const int64_t nodes = t.num_nodes();
      const int64_t cost = t.PrefixClaimCost(c.tokens.data(), n, 0, host);
      EXPECT_TRUE(SameDump(before, t.Dump()));
      EXPECT_EQ(t.num_nodes(), nodes);
      EXPECT_EQ(cost, host ? c.host : c.device) << "case of " << n << " tokens";
      EXPECT_EQ(t.ClaimCost(Match(&t, c.tokens), host), cost);
    }
  }
  EXPECT_EQ(t.PrefixClaimCost(Iota(1, 8).data(), 8, 1, false), 0);  // another namespace
  EXPECT_THROW(t.PrefixClaimCost(nullptr, -1, 0, false), Error);
  t.CheckIntegrity();

  // Inputs count in whole pages.
  RadixTree paged(2);
  Insert(&paged, Iota(1, 6), Iota(0, 6));
  EXPECT_EQ(paged.PrefixClaimCost(Iota(1, 5).data(), 5, 0, false), 4);
  EXPECT_EQ(paged.ClaimCost(Match(&paged, Iota(1, 5)), false), 4);
}

}  // namespace
}  // namespace radixkv
