// The tree's host tier: backups and loads around their copies, eviction on
// both tiers, and the invariants (both tiers root-closed, every slot owned
// once) through every step, including failed copies and splits of nodes with
// a copy in flight.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "radixkv/radix_tree.h"
#include "radixkv/status.h"
#include "tree_test_util.h"

namespace radixkv {
namespace {

using testing_util::Insert;
using testing_util::Ints;
using testing_util::Iota;

Handle Match(RadixTree* t, const Ints& tokens, Ints* slots = nullptr) {
  Ints out;
  Handle h = t->MatchPrefix(tokens.data(), static_cast<int64_t>(tokens.size()), &out);
  if (slots != nullptr) *slots = out;
  return h;
}

// Backs up the path of `tokens` with host slots from `next_host`: returns the
// copy (already begun) and fills `host` with its slots.
TierCopy StartBackup(RadixTree* t, const Ints& tokens, int32_t* next_host, Ints* host,
                     Ints* device = nullptr) {
  TierCopy c;
  EXPECT_TRUE(t->FindBackup(tokens.data(), static_cast<int64_t>(tokens.size()), 0, &c));
  Ints d;
  t->BeginBackup(c, &d);
  *host = Iota(*next_host, static_cast<int>(c.length()));
  *next_host += static_cast<int32_t>(c.length());
  if (device != nullptr) *device = d;
  return c;
}

void BackUp(RadixTree* t, const Ints& tokens, int32_t* next_host) {
  Ints host, rejected;
  TierCopy c = StartBackup(t, tokens, next_host, &host);
  EXPECT_EQ(t->FinishBackup(c, host.data(), true, SlotSink::Into(&rejected)), 0);
  t->CheckIntegrity();
}

TEST(RadixTreeTiersTest, BackupGivesHostSlotsOnlyWhenItFinishes) {
  RadixTree t;
  Insert(&t, {1, 2, 3, 4}, {10, 11, 12, 13});
  int32_t next_host = 100;
  Ints host, device;
  TierCopy c = StartBackup(&t, {1, 2, 3, 4}, &next_host, &host, &device);
  EXPECT_EQ(c.start, 0);
  EXPECT_EQ(c.end, 4);
  EXPECT_EQ(device, Ints({10, 11, 12, 13}));
  t.CheckIntegrity();
  // In flight: pinned (not evictable), no host copy yet.
  EXPECT_EQ(t.evictable_size(), 0);
  EXPECT_EQ(t.tier_sizes().host, 0);
  EXPECT_EQ(t.tier_sizes().backing_up, 4);
  TierCopy again;
  EXPECT_FALSE(t.FindBackup(Ints({1, 2, 3, 4}).data(), 4, 0, &again));
  Ints rejected;
  EXPECT_EQ(t.FinishBackup(c, host.data(), true, SlotSink::Into(&rejected)), 0);
  t.CheckIntegrity();
  EXPECT_EQ(t.tier_sizes().host, 4);
  EXPECT_EQ(t.evictable_size(), 4);
  EXPECT_EQ(t.stored_host_slots().Count(), 4);
}

TEST(RadixTreeTiersTest, FailedBackupMakesNothingVisible) {
  RadixTree t;
  Insert(&t, {1, 2, 3, 4}, {10, 11, 12, 13});
  int32_t next_host = 100;
  Ints host, rejected;
  TierCopy c = StartBackup(&t, {1, 2, 3, 4}, &next_host, &host);
  EXPECT_EQ(t.FinishBackup(c, host.data(), false, SlotSink::Into(&rejected)), 4);
  EXPECT_EQ(rejected, host);
  t.CheckIntegrity();
  EXPECT_EQ(t.tier_sizes().host, 0);
  EXPECT_EQ(t.evictable_size(), 4);
}

TEST(RadixTreeTiersTest, ParentFailureCutsOffItsChildrensBackups) {
  RadixTree t;
  Insert(&t, {1, 2}, {10, 11});
  int32_t next_host = 100;
  Ints host_parent, host_child, rejected;
  TierCopy parent = StartBackup(&t, {1, 2}, &next_host, &host_parent);
  Insert(&t, {1, 2, 3, 4}, {10, 11, 12, 13});
  TierCopy child = StartBackup(&t, {1, 2, 3, 4}, &next_host, &host_child);
  EXPECT_EQ(child.start, 2);  // the parent's backup is in flight: it is not repeated
  t.CheckIntegrity();
  EXPECT_EQ(t.FinishBackup(parent, host_parent.data(), false, SlotSink::Into(&rejected)), 2);
  t.CheckIntegrity();
  // The child's copy succeeds, but its parent has no host copy: refused.
  EXPECT_EQ(t.FinishBackup(child, host_child.data(), true, SlotSink::Into(&rejected)), 2);
  EXPECT_EQ(rejected, host_child);
  t.CheckIntegrity();
  EXPECT_EQ(t.tier_sizes().host, 0);
}

TEST(RadixTreeTiersTest, DeviceEvictionKeepsBackedUpNodesOnHost) {
  RadixTree t;
  int32_t next_host = 100;
  Insert(&t, {1, 2, 3, 4}, {10, 11, 12, 13});
  BackUp(&t, {1, 2, 3, 4}, &next_host);
  Insert(&t, {5, 6}, {14, 15});  // not backed up
  Ints freed;
  t.Evict(6, &freed);
  std::sort(freed.begin(), freed.end());
  EXPECT_EQ(freed, Ints({10, 11, 12, 13, 14, 15}));
  t.CheckIntegrity();
  EXPECT_EQ(t.num_nodes(), 1);  // {5, 6} is gone, {1..4} is host only
  EXPECT_EQ(t.tier_sizes().host_only, 4);
  Ints slots;
  Handle h = Match(&t, {1, 2, 3, 4, 9}, &slots);
  EXPECT_EQ(h.cached_len, 0);
  EXPECT_EQ(h.host_hit_len, 4);
  EXPECT_TRUE(slots.empty());
  // A handle to the host-only node itself is not a device prefix.
  Handle host_only{t.id(), h.host_generation, h.host_node_id, 4, 0, 0, 0, 0};
  EXPECT_THROW(t.HandleSlots(host_only, &slots), Error);
}

TEST(RadixTreeTiersTest, LoadBringsTheHostPartBackWhenItFinishes) {
  RadixTree t;
  int32_t next_host = 100;
  Insert(&t, {1, 2, 3, 4, 5, 6}, {10, 11, 12, 13, 14, 15});
  BackUp(&t, {1, 2, 3, 4, 5, 6}, &next_host);
  Match(&t, {1, 2});  // split: {1, 2} | {3, 4, 5, 6}
  Ints freed;
  t.Evict(4, &freed);  // the suffix goes to host only
  t.CheckIntegrity();
  Handle m = Match(&t, {1, 2, 3, 4, 5, 6, 7});
  EXPECT_EQ(m.cached_len, 2);
  EXPECT_EQ(m.host_hit_len, 4);
  TierCopy load = t.FindLoad(m);
  EXPECT_EQ(load.start, 2);
  EXPECT_EQ(load.end, 6);
  Ints host;
  Handle loaded;
  t.BeginLoad(load, &host, &loaded);
  EXPECT_EQ(host, Ints({102, 103, 104, 105}));
  EXPECT_EQ(loaded.cached_len, 6);
  EXPECT_EQ(loaded.lock_count, 1);
  t.CheckIntegrity();
  // In flight: still host only (invisible), not evictable from host.
  EXPECT_EQ(Match(&t, {1, 2, 3, 4, 5, 6}).cached_len, 2);
  EXPECT_THROW(t.FindLoad(Match(&t, {1, 2, 3, 4, 5, 6})), Error);
  Ints out;
  EXPECT_THROW(t.EvictHost(4, &out), Error);
  const Ints device{20, 21, 22, 23};
  EXPECT_TRUE(t.FinishLoad(load, device.data(), true));
  t.CheckIntegrity();
  Ints slots;
  Handle after = Match(&t, {1, 2, 3, 4, 5, 6}, &slots);
  EXPECT_EQ(after.cached_len, 6);
  EXPECT_EQ(slots, Ints({10, 11, 20, 21, 22, 23}));
  EXPECT_EQ(t.protected_size(), 6);  // the loaded handle's lock
  t.Unlock(&loaded);
  t.CheckIntegrity();
}

TEST(RadixTreeTiersTest, FailedLoadLeavesTheNodeHostOnly) {
  RadixTree t;
  int32_t next_host = 100;
  Insert(&t, {1, 2, 3, 4}, {10, 11, 12, 13});
  BackUp(&t, {1, 2, 3, 4}, &next_host);
  Ints freed;
  t.Evict(4, &freed);
  Handle m = Match(&t, {1, 2, 3, 4, 9});
  TierCopy load = t.FindLoad(m);
  Ints host;
  Handle loaded;
  t.BeginLoad(load, &host, &loaded);
  const Ints device{20, 21, 22, 23};
  EXPECT_TRUE(t.FinishLoad(load, device.data(), false));
  t.CheckIntegrity();
  EXPECT_EQ(Match(&t, {1, 2, 3, 4, 9}).host_hit_len, 4);
  EXPECT_FALSE(t.stored_slots().Contains(20));
  t.Unlock(&loaded);
  t.CheckIntegrity();
}

TEST(RadixTreeTiersTest, InsertOverHostOnlyNodesTakesTheCallersSlots) {
  RadixTree t;
  int32_t next_host = 100;
  Insert(&t, {1, 2, 3, 4}, {10, 11, 12, 13});
  BackUp(&t, {1, 2, 3, 4}, &next_host);
  Ints freed;
  t.Evict(4, &freed);
  // The caller recomputed the prefix into its own slots: they become the tree's.
  EXPECT_EQ(Insert(&t, {1, 2, 3, 4, 5, 6}, {30, 31, 32, 33, 34, 35}), 0);
  t.CheckIntegrity();
  Ints slots;
  EXPECT_EQ(Match(&t, {1, 2, 3, 4, 5, 6}, &slots).cached_len, 6);
  EXPECT_EQ(slots, Ints({30, 31, 32, 33, 34, 35}));
  EXPECT_EQ(t.tier_sizes().host, 4);  // the host copy stays
}

TEST(RadixTreeTiersTest, HostEvictionDeletesHostOnlyLeavesAndDropsMirrors) {
  RadixTree t;
  int32_t next_host = 100;
  Insert(&t, {1, 2}, {10, 11});
  BackUp(&t, {1, 2}, &next_host);
  Insert(&t, {1, 2, 3, 4}, {10, 11, 12, 13});
  BackUp(&t, {1, 2, 3, 4}, &next_host);
  Insert(&t, {7, 8}, {14, 15});
  BackUp(&t, {7, 8}, &next_host);
  Ints freed;
  t.Evict(2, &freed);  // oldest device leaf: {3, 4} -> host only
  EXPECT_EQ(freed, Ints({12, 13}));
  t.CheckIntegrity();
  Ints host_freed;
  t.EvictHost(2, &host_freed);  // the oldest host copy without a child copy: {3, 4}
  EXPECT_EQ(host_freed, Ints({102, 103}));
  t.CheckIntegrity();
  EXPECT_EQ(t.num_nodes(), 2);
  t.EvictHost(4, &host_freed);  // the mirrors {1, 2} and {7, 8}: dropped, kept on device
  std::sort(host_freed.begin(), host_freed.end());
  EXPECT_EQ(host_freed, Ints({100, 101, 104, 105}));
  t.CheckIntegrity();
  EXPECT_EQ(t.num_nodes(), 2);
  EXPECT_EQ(t.tier_sizes().host, 0);
  EXPECT_EQ(t.evictable_size(), 4);
  EXPECT_THROW(t.EvictHost(1, &host_freed), Error);
}

TEST(RadixTreeTiersTest, SplitOfNodesWithCopiesInFlight) {
  for (int page : {1, 2}) {
    RadixTree t(page);
    int32_t next_host = 100;
    Insert(&t, Iota(0, 8), Iota(10, 8));
    Ints host, rejected;
    TierCopy c = StartBackup(&t, Iota(0, 8), &next_host, &host);
    Match(&t, Iota(0, 4));  // splits the node being backed up
    t.CheckIntegrity();
    EXPECT_EQ(t.FinishBackup(c, host.data(), true, SlotSink::Into(&rejected)), 0);
    t.CheckIntegrity();
    EXPECT_EQ(t.tier_sizes().host, 8);
    Ints freed;
    t.Evict(8, &freed);
    t.CheckIntegrity();
    Handle m = Match(&t, Iota(0, 8));
    EXPECT_EQ(m.host_hit_len, 8);
    TierCopy load = t.FindLoad(m);
    Handle loaded;
    t.BeginLoad(load, &host, &loaded);
    EXPECT_EQ(host, Iota(100, 8));
    Match(&t, Iota(0, 2 * page));  // splits a node being loaded
    t.CheckIntegrity();
    const Ints device = Iota(40, 8);
    EXPECT_TRUE(t.FinishLoad(load, device.data(), true));
    t.CheckIntegrity();
    Ints slots;
    EXPECT_EQ(Match(&t, Iota(0, 8), &slots).cached_len, 8);
    EXPECT_EQ(slots, device);
  }
}

TEST(RadixTreeTiersTest, WriteBackCandidatesAreTheNextVictimsWithoutHost) {
  RadixTree t;
  int32_t next_host = 100;
  Insert(&t, {1, 2}, {10, 11});
  BackUp(&t, {1, 2}, &next_host);
  Insert(&t, {3, 4}, {12, 13});
  Insert(&t, {5, 6}, {14, 15});
  const std::vector<TierCopy> c = t.EvictionCandidatesWithoutHost(4);
  ASSERT_EQ(c.size(), 1u);  // {1, 2} has a host copy; {3, 4} is next; {5, 6} not reached
  EXPECT_EQ(c[0].end, 2);
  t.CheckIntegrity();
  Ints freed;
  t.Evict(2, &freed);
  EXPECT_EQ(freed, Ints({10, 11}));  // the order was left as it was
}

TEST(RadixTreeTiersTest, ResetWithCopiesInFlightRejectsTheirAcks) {
  RadixTree t;
  int32_t next_host = 100;
  Insert(&t, {1, 2}, {10, 11});
  Ints host, rejected;
  TierCopy c = StartBackup(&t, {1, 2}, &next_host, &host);
  t.Reset();
  EXPECT_EQ(t.FinishBackup(c, host.data(), true, SlotSink::Into(&rejected)), 2);
  EXPECT_EQ(rejected, host);
  t.CheckIntegrity();
}

// Random operations on both tiers, with copies finishing (or failing) in
// random order, and every invariant checked after each step.
TEST(RadixTreeTiersTest, RandomOperationsKeepEveryInvariant) {
  for (int64_t page : {1, 4}) {
    RadixTree t(page);
    std::mt19937 rng(static_cast<unsigned>(7 + page));
    int32_t next_slot = 0, next_host = 0;
    struct Flight {
      TierCopy copy;
      Ints slots;
      bool load;
      Handle handle;
    };
    std::vector<Flight> flights;
    std::vector<Handle> locked;
    for (int step = 0; step < 3000; ++step) {
      Ints tokens(1 + rng() % 24);
      for (int32_t& x : tokens) x = static_cast<int32_t>(rng() % 3);
      const int op = static_cast<int>(rng() % 9);
      try {
        if (op <= 1) {
          Insert(&t, tokens, Iota(next_slot, static_cast<int>(tokens.size())));
          next_slot += static_cast<int32_t>(tokens.size());
        } else if (op == 2) {
          TierCopy c;
          if (t.FindBackup(tokens.data(), static_cast<int64_t>(tokens.size()), 0, &c)) {
            Ints device;
            t.BeginBackup(c, &device);
            flights.push_back({c, Iota(next_host, static_cast<int>(c.length())), false, {}});
            next_host += static_cast<int32_t>(c.length());
          }
        } else if (op == 3) {
          Handle m = Match(&t, tokens);
          if (m.host_hit_len > 0) {
            TierCopy c = t.FindLoad(m);
            Ints host;
            Handle loaded;
            t.BeginLoad(c, &host, &loaded);
            flights.push_back({c, Iota(next_slot, static_cast<int>(c.length())), true, loaded});
            next_slot += static_cast<int32_t>(c.length());
          } else if (rng() % 2) {
            t.Lock(&m);
            locked.push_back(m);
          }
        } else if (op == 4 && !flights.empty()) {
          const size_t k = rng() % flights.size();
          Flight f = flights[k];
          flights.erase(flights.begin() + static_cast<long>(k));
          const bool ok = rng() % 4 != 0;
          Ints rejected;
          if (f.load) {
            t.FinishLoad(f.copy, f.slots.data(), ok);
            if (t.IsValid(f.handle)) t.Unlock(&f.handle);
          } else {
            t.FinishBackup(f.copy, f.slots.data(), ok, SlotSink::Into(&rejected));
          }
        } else if (op == 5 && !locked.empty()) {
          Handle h = locked.back();
          locked.pop_back();
          if (t.IsValid(h)) t.Unlock(&h);
        } else if (op == 6 && t.evictable_size() > 0) {
          Ints freed;
          t.Evict(1 + static_cast<int64_t>(rng() % t.evictable_size()), &freed);
        } else if (op == 7 && t.tier_sizes().host > 0) {
          Ints freed;
          t.EvictHost(1 + static_cast<int64_t>(rng() % t.tier_sizes().host), &freed);
        } else if (op == 8) {
          Match(&t, tokens);
        }
      } catch (const Error& e) {
        // Refusals are fine (stale handles, loads in flight, nothing evictable);
        // broken invariants are not.
        ASSERT_NE(e.code(), ErrorCode::kIntegrity) << e.what();
      }
      ASSERT_NO_THROW(t.CheckIntegrity()) << "step " << step;
    }
  }
}

TEST(RadixTreeTiersTest, PagesBeingStoredStayOnHostUntilTheWriteEnds) {
  RadixTree t;
  int32_t next_host = 100;
  const Ints a = {1, 2, 3, 4};
  Insert(&t, a, {10, 11, 12, 13});
  Ints host, rejected;
  const TierCopy backup = StartBackup(&t, a, &next_host, &host);
  ASSERT_EQ(t.FinishBackup(backup, host.data(), true, SlotSink::Into(&rejected)), 0);
  Match(&t, {1, 2});  // split: the write covers two nodes
  Ints slots, tokens;
  TierCopy c;
  ASSERT_TRUE(t.BeginStorageWrite(backup, SlotSink::Into(&slots), SlotSink::Into(&tokens), &c));
  EXPECT_EQ(slots, Ints({100, 101, 102, 103}));
  EXPECT_EQ(tokens, a);
  EXPECT_EQ(t.tier_sizes().storage_writing, 4);
  t.CheckIntegrity();
  Ints freed;
  t.Evict(4, &freed);                           // device eviction: the nodes stay, host only
  EXPECT_THROW(t.EvictHost(1, &freed), Error);  // pinned on host while being written
  Ints again;
  TierCopy c2;
  EXPECT_THROW(t.BeginStorageWrite(backup, SlotSink::Into(&again), SlotSink::Into(&again), &c2),
               Error);
  EXPECT_THROW(t.BeginStorageWrite(TierCopy{backup.node_id, backup.incarnation, 1, backup.end},
                                   SlotSink::Into(&again), SlotSink::Into(&again), &c2),
               Error);  // not a node boundary
  EXPECT_THROW(t.FinishStorageWrite(TierCopy{c.node_id, c.incarnation, 2, c.end}),
               Error);  // forged
  t.CheckIntegrity();
  t.FinishStorageWrite(c);  // the node left the device meanwhile: the copy still names it
  EXPECT_THROW(t.FinishStorageWrite(c), Error);  // twice
  EXPECT_EQ(t.tier_sizes().storage_writing, 0);
  t.EvictHost(4, &freed);
  EXPECT_EQ(t.num_nodes(), 0);
  t.CheckIntegrity();
  EXPECT_FALSE(t.BeginStorageWrite(backup, SlotSink::Into(&again), SlotSink::Into(&again), &c2));
}

TEST(RadixTreeTiersTest, PagesReadFromStorageBecomeHostOnlyNodesUnderAHostPath) {
  RadixTree t(2);
  int32_t next_host = 100;
  Insert(&t, {1, 2, 3, 4}, {10, 11, 12, 13});
  BackUp(&t, {1, 2, 3, 4}, &next_host);
  // Pages of {1, 2, 3, 4, 5, 6, 7, 8} from 2 on: {3, 4} is cached already.
  const Ints tokens = {1, 2, 3, 4, 5, 6, 7, 8};
  Ints rejected;
  EXPECT_EQ(t.InsertHost(tokens.data(), 8, 2, Iota(200, 6).data(), SlotSink::Into(&rejected)), 4);
  EXPECT_EQ(rejected, Ints({200, 201}));
  t.CheckIntegrity();
  Ints slots;
  Handle h = Match(&t, {1, 2, 3, 4, 5, 6, 7, 8, 9}, &slots);
  EXPECT_EQ(h.cached_len, 4);
  EXPECT_EQ(h.host_hit_len, 4);
  // Under a device-only node (no host copy) nothing is attached.
  Insert(&t, {9, 9, 8, 8}, {20, 21, 22, 23});
  const Ints other = {9, 9, 8, 8, 7, 7};
  EXPECT_EQ(t.InsertHost(other.data(), 6, 4, Iota(300, 2).data(), SlotSink::Into(&rejected)), 0);
  EXPECT_EQ(rejected, Ints({300, 301}));
  // Inside a node with a host copy: it splits, the new leaf hangs off the prefix.
  const Ints inside = {1, 2, 3, 4, 5, 6, 1, 1};
  EXPECT_EQ(t.InsertHost(inside.data(), 8, 6, Iota(400, 2).data(), SlotSink::Into(&rejected)), 2);
  EXPECT_TRUE(rejected.empty());
  t.CheckIntegrity();
  // A host slot the tree has, or a repeated one, is refused with nothing changed.
  const Ints fresh = {5, 5, 5, 5};
  EXPECT_THROW(t.InsertHost(fresh.data(), 4, 0, Ints({100, 500, 501, 502}).data(),
                            SlotSink::Into(&rejected)),
               Error);
  EXPECT_THROW(t.InsertHost(fresh.data(), 4, 0, Ints({600, 600, 601, 602}).data(),
                            SlotSink::Into(&rejected)),
               Error);
  EXPECT_THROW(t.InsertHost(fresh.data(), 3, 0, Ints({1, 2, 3}).data(), SlotSink::Into(&rejected)),
               Error);
  t.CheckIntegrity();
  EXPECT_EQ(t.tier_sizes().host, 4 + 4 + 2);
}

TEST(RadixTreeTiersTest, APinnedHostCopyStaysUntilItsReadJoins) {
  RadixTree t(2);
  int32_t next_host = 100;
  Insert(&t, {1, 2, 3, 4}, {10, 11, 12, 13});
  BackUp(&t, {1, 2, 3, 4}, &next_host);
  const Ints tokens = {1, 2, 3, 4};
  bool backed = false;
  EXPECT_EQ(t.StoragePrefixEnd(tokens.data(), 4, &backed), 4);
  EXPECT_TRUE(backed);
  TierCopy pin;
  ASSERT_TRUE(t.PinHost(tokens.data(), 4, &pin));
  EXPECT_EQ(pin.start, 4);
  EXPECT_EQ(t.host_pins(), 1);
  t.CheckIntegrity();
  Ints freed;
  EXPECT_THROW(t.EvictHost(2, &freed), Error);  // the only host leaf is pinned
  t.Evict(4, &freed);                           // device eviction: still on host
  EXPECT_THROW(t.EvictHost(2, &freed), Error);
  const Ints more = {1, 2, 3, 4, 5, 6};
  Ints rejected;
  EXPECT_EQ(t.InsertHost(more.data(), 6, 4, Iota(200, 2).data(), SlotSink::Into(&rejected)), 2);
  t.UnpinHost(pin);
  EXPECT_EQ(t.host_pins(), 0);
  EXPECT_THROW(t.UnpinHost(pin), Error);  // twice
  t.CheckIntegrity();
  t.EvictHost(6, &freed);
  EXPECT_EQ(t.num_nodes(), 0);
  t.UnpinHost(pin);  // its node is gone: ignored
  // At the root, or where the match ends without a host copy, nothing is pinned.
  EXPECT_FALSE(t.PinHost(tokens.data(), 4, &pin));
  Insert(&t, {1, 2, 3, 4}, {10, 11, 12, 13});
  EXPECT_FALSE(t.PinHost(tokens.data(), 4, &pin));
  EXPECT_EQ(t.StoragePrefixEnd(tokens.data(), 4, &backed), 4);
  EXPECT_FALSE(backed);
}

TEST(RadixTreeTiersTest, BackupThroughAPartialMatchCopiesTheWholeNode) {
  RadixTree t(2);
  Insert(&t, {1, 2, 3, 4, 5, 6}, {10, 11, 12, 13, 14, 15});
  const Ints head = {1, 2, 3, 4};
  TierCopy c;
  EXPECT_FALSE(t.FindBackup(head.data(), 4, 0, &c));  // the match ends inside the node
  ASSERT_TRUE(t.FindBackup(head.data(), 4, 0, &c, /*through_partial=*/true));
  EXPECT_EQ(c.start, 0);
  EXPECT_EQ(c.end, 6);
}

}  // namespace
}  // namespace radixkv
