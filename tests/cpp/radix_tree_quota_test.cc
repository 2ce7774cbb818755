// Namespace quotas in the tree: each tier's tokens counted per namespace,
// eviction inside one namespace that never touches another's pages, and the
// counts and heaps right through random operations on both tiers.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <random>
#include <vector>

#include "radixkv/radix_tree.h"
#include "radixkv/status.h"
#include "tree_test_util.h"

namespace radixkv {
namespace {

using testing_util::Ints;
using testing_util::Iota;

int64_t InsertNs(RadixTree* t, const Ints& tokens, const Ints& slots, uint64_t ns) {
  return t->InsertPrefix(tokens.data(), slots.data(), static_cast<int64_t>(tokens.size()), 0, ns);
}

// Tokens per namespace on each tier, from a dump.
std::map<uint64_t, std::pair<int64_t, int64_t>> Held(const RadixTree& t) {
  std::map<uint64_t, std::pair<int64_t, int64_t>> out;
  for (const NodeInfo& n : t.Dump()) {
    auto& [device, host] = out[n.ns];
    device += static_cast<int64_t>(n.value.size());
    host += static_cast<int64_t>(n.host_value.size());
  }
  return out;
}

RadixTree::QuotaUse UseOf(const RadixTree& t, uint64_t ns) {
  for (const RadixTree::QuotaUse& u : t.Quotas()) {
    if (u.ns == ns) return u;
  }
  ADD_FAILURE() << "no quota for namespace " << ns;
  return {};
}

TEST(RadixTreeQuotaTest, AQuotaCountsWhatTheNamespaceHoldsAndEvictsOnlyItsOwnPages) {
  RadixTree t(4);
  InsertNs(&t, Iota(0, 8), Iota(0, 8), 1);       // ns 1: 8 tokens, oldest
  InsertNs(&t, Iota(100, 8), Iota(8, 8), 2);     // ns 2: 8 tokens
  InsertNs(&t, Iota(200, 4), Iota(16, 4), 1);    // ns 1: 4 more
  InsertNs(&t, Iota(300, 12), Iota(20, 12), 2);  // ns 2: 12 more, newest
  t.SetQuota(2, 12, -1);
  RadixTree::QuotaUse u = UseOf(t, 2);
  EXPECT_EQ(u.device, 20);
  EXPECT_EQ(u.host, 0);
  ASSERT_EQ(t.OverQuota().size(), 1u);
  EXPECT_EQ(t.OverQuota()[0].ns, 2u);
  EXPECT_EQ(t.OverQuota()[0].device, 8);
  t.CheckIntegrity();
  // The globally oldest leaf is ns 1's: a namespace eviction passes it by.
  Ints freed;
  EXPECT_EQ(t.EvictNamespace(2, 8, SlotSink::Into(&freed)), 8);
  EXPECT_EQ(freed, Iota(8, 8));  // ns 2's oldest leaf
  EXPECT_TRUE(t.OverQuota().empty());
  EXPECT_EQ(UseOf(t, 2).device, 12);
  EXPECT_EQ(Held(t)[1].first, 12);  // ns 1 untouched
  t.CheckIntegrity();
  // Asking for more than it holds frees what can go, no error.
  freed.clear();
  EXPECT_EQ(t.EvictNamespace(2, 100, SlotSink::Into(&freed)), 12);
  EXPECT_EQ(UseOf(t, 2).device, 0);
  EXPECT_EQ(t.EvictNamespace(2, 4, SlotSink::Into(&freed)), 0);
  EXPECT_EQ(Held(t)[1].first, 12);
  t.CheckIntegrity();
  // The global eviction still sees every namespace, and keeps the counts.
  InsertNs(&t, Iota(400, 4), Iota(40, 4), 2);
  t.Evict(12, &freed);  // ns 1's, the oldest
  EXPECT_EQ(UseOf(t, 2).device, 4);
  EXPECT_EQ(Held(t)[1].first, 0);
  t.CheckIntegrity();
}

TEST(RadixTreeQuotaTest, LockedPagesCountButStay) {
  RadixTree t(2);
  InsertNs(&t, Iota(0, 6), Iota(0, 6), 7);
  t.SetQuota(7, 2, -1);
  Ints slots;
  Ints tokens = Iota(0, 6);
  Handle h = t.MatchPrefix(tokens.data(), 6, &slots, 7);
  t.Lock(&h);
  Ints freed;
  EXPECT_EQ(t.EvictNamespace(7, 4, SlotSink::Into(&freed)), 0);
  EXPECT_EQ(t.OverQuota()[0].device, 4);
  t.Unlock(&h);
  EXPECT_EQ(t.EvictNamespace(7, 4, SlotSink::Into(&freed)), 6);  // whole nodes
  t.CheckIntegrity();
}

TEST(RadixTreeQuotaTest, BadLimitsAndNamespacesWithoutQuotaAreRefused) {
  RadixTree t;
  EXPECT_THROW(t.SetQuota(1, -2, 0), Error);
  Ints freed;
  EXPECT_THROW(t.EvictNamespace(1, 1, SlotSink::Into(&freed)), Error);
  EXPECT_THROW(t.EvictHostNamespace(1, 1, SlotSink::Into(&freed)), Error);
  t.SetQuota(1, 5, 5);
  EXPECT_THROW(t.EvictNamespace(1, -1, SlotSink::Into(&freed)), Error);
  t.SetQuota(1, -1, -1);  // removed
  EXPECT_TRUE(t.Quotas().empty());
}

// Random operations on both tiers in three namespaces, two with quotas set
// and changed along the way: after each, the integrity walk (which checks
// every quota's counts and heaps) passes, the counts match a dump, and a
// namespace eviction changed no other namespace's pages.
TEST(RadixTreeQuotaTest, CountsAndHeapsHoldThroughRandomOperations) {
  for (uint32_t seed = 0; seed < 20; ++seed) {
    std::mt19937 rng(seed);
    const int64_t page = 1 + static_cast<int64_t>(seed % 2);
    RadixTree t(page);
    int32_t next_slot = 0, next_host = 0;
    std::vector<Handle> locked;
    auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<uint32_t>(n)); };
    for (int step = 0; step < 300; ++step) {
      const uint64_t ns = static_cast<uint64_t>(pick(3));
      const int op = pick(10);
      Ints tokens =
          Iota(static_cast<int32_t>(1000 * pick(4)), 2 * (1 + pick(4)) * static_cast<int>(page));
      for (int32_t& x : tokens) x += pick(2);  // some branching
      if (op < 4) {
        InsertNs(&t, tokens, Iota(next_slot, static_cast<int>(tokens.size())), ns);
        next_slot += static_cast<int32_t>(tokens.size());
      } else if (op == 4) {
        t.SetQuota(1 + static_cast<uint64_t>(pick(2)), pick(3) == 0 ? -1 : pick(20),
                   pick(3) == 0 ? -1 : pick(20));
      } else if (op == 5) {
        Ints slots;
        Handle h = t.MatchPrefix(tokens.data(), static_cast<int64_t>(tokens.size()), &slots, ns);
        if (h.cached_len > 0 && locked.size() < 3) {
          t.Lock(&h);
          locked.push_back(h);
        }
      } else if (op == 6 && !locked.empty()) {
        if (t.IsValid(locked.back())) t.Unlock(&locked.back());
        locked.pop_back();
      } else if (op == 7) {
        TierCopy c;
        if (t.FindBackup(tokens.data(), static_cast<int64_t>(tokens.size()), 0, &c, false, ns)) {
          Ints device, host = Iota(next_host, static_cast<int>(c.length())), rejected;
          next_host += static_cast<int32_t>(c.length());
          t.BeginBackup(c, &device);
          t.FinishBackup(c, host.data(), pick(4) != 0, SlotSink::Into(&rejected));
        }
      } else {
        const auto before = Held(t);
        Ints freed;
        const bool host = pick(2) == 0;
        const int64_t size = pick(12);
        if (t.Quotas().empty() || pick(3) == 0) {
          const TierSizes s = t.tier_sizes();
          if (!host && size <= s.device_evictable) t.Evict(size, &freed);
          if (host) {
            try {
              t.EvictHost(size, &freed);
            } catch (const Error&) {
            }
          }
        } else {
          const uint64_t target =
              t.Quotas()[static_cast<size_t>(pick(static_cast<int>(t.Quotas().size())))].ns;
          if (host) {
            t.EvictHostNamespace(target, size, SlotSink::Into(&freed));
          } else {
            t.EvictNamespace(target, size, SlotSink::Into(&freed));
          }
          auto after = Held(t);
          for (const auto& [other, held] : before) {
            if (other != target) EXPECT_EQ(after[other], held) << "seed " << seed;
          }
        }
      }
      t.CheckIntegrity();
      const auto held = Held(t);
      for (const RadixTree::QuotaUse& u : t.Quotas()) {
        const auto it = held.find(u.ns);
        const std::pair<int64_t, int64_t> h =
            it == held.end() ? std::pair<int64_t, int64_t>{0, 0} : it->second;
        ASSERT_EQ(u.device, h.first) << "seed " << seed << " step " << step;
        ASSERT_EQ(u.host, h.second) << "seed " << seed << " step " << step;
      }
    }
  }
}

}  // namespace
}  // namespace radixkv
