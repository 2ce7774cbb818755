// Every call of the core under allocation failure: the Nth allocation of a call
// throws std::bad_alloc, for every N until the call succeeds, and after each
// failure the tree (or allocator) must be exactly as before the call, with
// every invariant intact. The injector replaces the global operator new of
// this test binary; it is armed only around the call under test.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "radixkv/cache_controller.h"
#include "radixkv/child_map.h"
#include "radixkv/node_arena.h"
#include "radixkv/page_allocator.h"
#include "radixkv/radix_tree.h"
#include "radixkv/slot_set.h"
#include "radixkv/status.h"

namespace {

// Allocations left before the armed one fails; negative when disarmed.
thread_local int64_t g_fail_in = -1;
thread_local int64_t g_allocations = 0;

void* Allocate(std::size_t size, std::size_t align = alignof(std::max_align_t)) {
  if (g_fail_in >= 0) {
    ++g_allocations;
    if (g_fail_in-- == 0) throw std::bad_alloc();
  }
  size = size == 0 ? 1 : size;
  void* p = align <= alignof(std::max_align_t)
                ? std::malloc(size)
                : std::aligned_alloc(align, (size + align - 1) / align * align);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

}  // namespace

void* operator new(std::size_t size) { return Allocate(size); }
void* operator new[](std::size_t size) { return Allocate(size); }
void* operator new(std::size_t size, std::align_val_t a) {
  return Allocate(size, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t size, std::align_val_t a) {
  return Allocate(size, static_cast<std::size_t>(a));
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

namespace radixkv {
namespace {

using Ints = std::vector<int32_t>;

// Runs `call` with its n-th allocation failing, for n = 0, 1, ... until it
// succeeds; after each failure `check` must hold. Returns how many runs failed.
template <typename Call, typename Check>
int FailEachAllocation(Call&& call, Check&& check) {
  for (int64_t n = 0;; ++n) {
    g_allocations = 0;
    g_fail_in = n;
    try {
      call();
      g_fail_in = -1;
      return static_cast<int>(n);
    } catch (const std::bad_alloc&) {
      g_fail_in = -1;
      check(n);
    }
  }
}

std::string DumpString(const RadixTree& tree) {
  std::string s;
  for (const NodeInfo& n : tree.Dump()) {
    s += std::to_string(n.parent) + ":";
    for (int32_t t : n.key) s += std::to_string(t) + ",";
    s += "|";
    for (int32_t v : n.value) s += std::to_string(v) + ",";
    s += "|" + std::to_string(n.ref_count) + "|" + std::to_string(n.timestamp) + "\n";
  }
  return s + "evictable " + std::to_string(tree.evictable_size()) + " protected " +
         std::to_string(tree.protected_size()) + " nodes " + std::to_string(tree.num_nodes()) +
         " leaves " + std::to_string(tree.num_evictable_leaves()) + " stored " +
         std::to_string(tree.stored_slots().Count());
}

// A tree whose calls are run under the injector, checked after each failure.
class Harness {
 public:
  explicit Harness(int64_t page_size) : tree(page_size) {}

  template <typename Call>
  void Run(const char* what, Call&& call) {
    const std::string before = DumpString(tree);
    const int failures = FailEachAllocation(call, [&](int64_t n) {
      ASSERT_NO_THROW(tree.CheckIntegrity()) << what << ", allocation " << n << " failed";
      ASSERT_EQ(DumpString(tree), before) << what << ", allocation " << n << " failed";
    });
    total_failures += failures;
    ASSERT_NO_THROW(tree.CheckIntegrity()) << what;
  }

  RadixTree tree;
  int total_failures = 0;
};

Ints Tokens(std::mt19937& rng, int n, int vocab) {
  Ints t(static_cast<size_t>(n));
  for (int& x : t) x = static_cast<int>(rng() % vocab);
  return t;
}

TEST(AllocFailureTest, InjectorFailsTheNthAllocation) {
  int runs = FailEachAllocation(
      [] {
        std::vector<int> a(3), b(4);
        (void)a;
        (void)b;
      },
      [](int64_t) {});
  EXPECT_EQ(runs, 2);  // the first two runs failed, the third got both
}

// Random inserts, matches (with splits), locks, unlocks and evictions, each
// call run under every possible allocation failure.
TEST(AllocFailureTest, EveryTreeCallChangesNothingWhenAnAllocationFails) {
  for (int64_t page : {1, 4}) {
    Harness h(page);
    std::mt19937 rng(static_cast<unsigned>(page));
    int32_t next_slot = 0;
    std::vector<Handle> locked;
    for (int step = 0; step < 400; ++step) {
      const int op = static_cast<int>(rng() % 6);
      const Ints tokens = Tokens(rng, 1 + static_cast<int>(rng() % 40), 3);
      if (op <= 1) {
        Ints slots(tokens.size());
        std::iota(slots.begin(), slots.end(), next_slot);
        next_slot += static_cast<int32_t>(tokens.size());
        h.Run("insert", [&] {
          h.tree.InsertPrefix(tokens.data(), slots.data(), static_cast<int64_t>(tokens.size()));
        });
      } else if (op == 2) {
        Ints out;
        Handle handle;
        h.Run("match", [&] {
          handle = h.tree.MatchPrefix(tokens.data(), static_cast<int64_t>(tokens.size()), &out);
        });
        ASSERT_EQ(static_cast<int64_t>(out.size()), handle.cached_len);
        if (rng() % 2) {
          h.Run("lock", [&] { h.tree.Lock(&handle); });
          locked.push_back(handle);
        }
      } else if (op == 3 && !locked.empty()) {
        Handle handle = locked.back();
        locked.pop_back();
        h.Run("unlock", [&] { h.tree.Unlock(&handle); });
      } else if (op == 4 && h.tree.evictable_size() > 0) {
        const int64_t size = 1 + static_cast<int64_t>(rng() % h.tree.evictable_size());
        Ints out;
        h.Run("evict", [&] { h.tree.Evict(size, &out); });
        ASSERT_GE(static_cast<int64_t>(out.size()), size);
      } else if (op == 5 && rng() % 8 == 0) {
        h.Run("reset", [&] { h.tree.Reset(); });
        locked.clear();
      }
    }
    // The injector did bite: calls failed at many points.
    EXPECT_GT(h.total_failures, 150) << "page " << page;
  }
}

// A node with many children grows its child table: a failed growth keeps
// every child reachable.
TEST(AllocFailureTest, ChildTableGrowthKeepsTheChildren) {
  Harness h(1);
  for (int32_t i = 0; i < 200; ++i) {
    const Ints tokens{7, i};
    const Ints slots{0, i + 1};
    h.Run("insert", [&] { h.tree.InsertPrefix(tokens.data(), slots.data(), 2); });
  }
  Ints out;
  for (int32_t i = 0; i < 200; ++i) {
    const Ints tokens{7, i};
    EXPECT_EQ(h.tree.MatchPrefix(tokens.data(), 2, &out).cached_len, 2);
  }
}

// When the caller's output cannot be allocated, eviction puts every victim
// back: the same victims go when it is retried.
TEST(AllocFailureTest, FailedEvictionOutputPutsTheVictimsBack) {
  RadixTree tree(1);
  for (int32_t i = 0; i < 50; ++i) {
    const Ints tokens{1, 2, i + 10};
    const Ints slots{0, 1, i + 2};
    tree.InsertPrefix(tokens.data(), slots.data(), 3);
  }
  const std::string before = DumpString(tree);
  auto failing = [](int64_t) -> int32_t* { throw std::bad_alloc(); };
  EXPECT_THROW(tree.Evict(30, failing), std::bad_alloc);
  EXPECT_EQ(DumpString(tree), before);
  EXPECT_NO_THROW(tree.CheckIntegrity());
  Ints out;
  tree.Evict(30, &out);
  EXPECT_EQ(out.size(), 30u);
  EXPECT_NO_THROW(tree.CheckIntegrity());
}

TEST(AllocFailureTest, NodeArenaChangesNothingOnFailure) {
  NodeArena arena;
  std::vector<NodeArena::Block> blocks;
  for (size_t bytes : {8, 100, 4096, 5000, 300000, 5000000}) {
    const size_t before = arena.reserved_bytes();
    NodeArena::Block b;
    const int failures =
        FailEachAllocation([&] { b = arena.Allocate(bytes); },
                           [&](int64_t) { ASSERT_EQ(arena.reserved_bytes(), before); });
    EXPECT_GE(failures, 1) << bytes;
    blocks.push_back(b);
    std::memset(b.data, 0xAB, bytes);
  }
  size_t i = 0;
  for (size_t bytes : {8, 100, 4096, 5000, 300000, 5000000}) arena.Free(blocks[i++], bytes);
}

TEST(AllocFailureTest, SlotSetAddAllChangesNothingOnFailure) {
  SlotSet set;
  const Ints first{5, 6, 7, 1 << 20};
  set.AddAll(first.data(), 4);
  // Slots in four new chunks, and one in an existing chunk.
  const Ints more{3 << 16, 5 << 16, (7 << 16) + 1, 100, 9 << 16};
  const int failures = FailEachAllocation([&] { ASSERT_EQ(set.AddAll(more.data(), 5), -1); },
                                          [&](int64_t) {
                                            ASSERT_EQ(set.Count(), 4);
                                            for (int32_t s : more) ASSERT_FALSE(set.Contains(s));
                                          });
  EXPECT_GT(failures, 1);
  EXPECT_EQ(set.Count(), 9);
}

TEST(AllocFailureTest, PageAllocatorTakesNothingWhenTheOutputFails) {
  PageAllocator pages(8, 4);
  auto failing = [](int64_t) -> int32_t* { throw std::bad_alloc(); };
  EXPECT_THROW(pages.Allocate(10, failing), std::bad_alloc);
  EXPECT_EQ(pages.num_free_pages(), 8);
  Ints out;
  FailEachAllocation([&] { pages.Allocate(10, &out); },
                     [&](int64_t) { ASSERT_EQ(pages.num_free_pages(), 8); });
  EXPECT_EQ(pages.num_free_pages(), 5);
}

TEST(AllocFailureTest, AMixedLoadBatchAcksEachLoadOnce) {
  // Loads of mixed units are merged as slots when the batch starts; the Nth
  // allocation there failing, for every N, fails one load (acknowledged at
  // once, false) or the start (retried by the next call), and never loses or
  // repeats an acknowledgement.
  int failed_loads = 0, failed_starts = 0;
  for (int64_t n = 0;; ++n) {
    CacheController c(MakeNullCopyEngine(1), true);
    const uint64_t a = c.Load({0, 1, 2, 3}, {4, 5, 6, 7});
    const uint64_t b = c.Load({2}, {3}, 4);
    g_fail_in = n;
    try {
      c.StartLoading();
    } catch (const std::bad_alloc&) {
      ++failed_starts;
    }
    const bool injected = g_fail_in < 0;
    g_fail_in = -1;
    c.Drain();
    std::vector<CopyAck> acks = c.TakeLoadAcks();
    ASSERT_EQ(acks.size(), 2u) << n;
    ASSERT_EQ(std::set<uint64_t>({acks[0].id, acks[1].id}), std::set<uint64_t>({a, b})) << n;
    for (const CopyAck& ack : acks) failed_loads += ack.ok ? 0 : 1;
    EXPECT_EQ(c.in_flight(), 0) << n;
    if (!injected) break;
  }
  EXPECT_GT(failed_loads, 0);
  EXPECT_GT(failed_starts, 0);
}

TEST(AllocFailureTest, ACopyHasItsRoomFromTheMomentItIsQueued) {
  // Queuing a copy allocates what running and acknowledging it will need, so
  // a failure there changes nothing, and running it (here Complete and a
  // batch, on this thread; the copy thread cannot report a failure) never
  // fails to allocate: no acknowledgement is ever lost.
  CacheController c(MakeNullCopyEngine(1), true);
  std::vector<uint64_t> ids;
  ids.reserve(40);  // (the test's own, outside the injector's count)
  for (int i = 0; i < 40; ++i) {
    FailEachAllocation(
        [&] {
          ids.push_back(i % 2 ? c.Load({i}, {i}) : c.Backup({i}, {i}));
        },
        [&](int64_t n) {
          ASSERT_EQ(c.Waiting(), ids) << "copy " << i << ", allocation " << n << " failed";
        });
  }
  for (size_t i = 0; i < ids.size(); i += 2) {
    EXPECT_EQ(FailEachAllocation([&] { ASSERT_TRUE(c.Complete(ids[i], true)); }, [](int64_t) {}),
              0);
  }
  FailEachAllocation([&] { c.StartLoading(); }, [&](int64_t) { ASSERT_EQ(c.in_flight(), 20); });
  EXPECT_EQ(FailEachAllocation([&] { c.WaitLoads(); }, [](int64_t) {}), 0);
  EXPECT_EQ(c.in_flight(), 0);
  EXPECT_EQ(c.TakeBackupAcks().size() + c.TakeLoadAcks().size(), 40u);
}

}  // namespace
}  // namespace radixkv
