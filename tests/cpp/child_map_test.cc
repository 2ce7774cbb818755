#include "radixkv/child_map.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <unordered_map>
#include <utility>
#include <vector>

namespace radixkv {
namespace {

struct Child {
  int id = 0;
};

using Map = ChildMap<Child>;

Child* FindExact(const Map& map, uint64_t key, const Child* want) {
  return map.Find(key, [want](const Child* c) { return c == want; });
}

Child* FindAny(const Map& map, uint64_t key) {
  return map.Find(key, [](const Child*) { return true; });
}

std::vector<std::pair<uint64_t, Child*>> Entries(const Map& map) {
  std::vector<std::pair<uint64_t, Child*>> out;
  map.ForEach([&](uint64_t key, Child* c) { out.emplace_back(key, c); });
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::unique_ptr<Child>> MakeChildren(int n) {
  std::vector<std::unique_ptr<Child>> out;
  for (int i = 0; i < n; ++i) out.push_back(std::make_unique<Child>(Child{i}));
  return out;
}

TEST(ChildMapTest, EmptyMap) {
  Map map;
  EXPECT_TRUE(map.empty());
  EXPECT_EQ(map.size(), 0u);
  EXPECT_EQ(FindAny(map, 0), nullptr);
  Child c;
  EXPECT_FALSE(map.Erase(0, &c));
  EXPECT_TRUE(Entries(map).empty());
}

TEST(ChildMapTest, InsertFindEraseManyKeys) {
  constexpr int kN = 1000;
  auto children = MakeChildren(kN);
  Map map;
  for (int i = 0; i < kN; ++i) {
    map.Insert(static_cast<uint64_t>(i) * 7919, children[i].get());
    ASSERT_EQ(map.size(), static_cast<uint32_t>(i + 1));
  }
  for (int i = 0; i < kN; ++i) {
    EXPECT_EQ(FindAny(map, static_cast<uint64_t>(i) * 7919), children[i].get()) << i;
  }
  EXPECT_EQ(FindAny(map, 1), nullptr);
  EXPECT_EQ(FindAny(map, 7919ull * kN), nullptr);
  for (int i = 0; i < kN; i += 2)
    ASSERT_TRUE(map.Erase(static_cast<uint64_t>(i) * 7919, children[i].get()));
  EXPECT_EQ(map.size(), static_cast<uint32_t>(kN / 2));
  for (int i = 0; i < kN; ++i) {
    EXPECT_EQ(FindAny(map, static_cast<uint64_t>(i) * 7919), i % 2 ? children[i].get() : nullptr)
        << i;
  }
  EXPECT_FALSE(map.Erase(0, children[0].get()));  // already gone
}

TEST(ChildMapTest, CollidingKeysResolvedByPredicate) {
  auto children = MakeChildren(20);
  Map map;
  for (auto& c : children) map.Insert(42, c.get());
  map.Insert(43, children[0].get());  // the same value under another key is a separate entry
  EXPECT_EQ(map.size(), 21u);
  for (auto& c : children) EXPECT_EQ(FindExact(map, 42, c.get()), c.get());
  EXPECT_EQ(map.Find(42, [](const Child*) { return false; }), nullptr);
  EXPECT_EQ(map.Find(42, [](const Child* c) { return c->id == 13; }), children[13].get());
  EXPECT_EQ(FindExact(map, 43, children[1].get()), nullptr);
  EXPECT_EQ(FindExact(map, 43, children[0].get()), children[0].get());

  // Erase the members of the collision run in a scrambled order; the rest stay findable.
  std::vector<int> order{7, 0, 19, 3, 12, 18, 1, 5, 9, 2, 11, 4, 17, 6, 15, 8, 10, 13, 16, 14};
  for (size_t k = 0; k < order.size(); ++k) {
    ASSERT_TRUE(map.Erase(42, children[order[k]].get()));
    ASSERT_FALSE(map.Erase(42, children[order[k]].get()));
    for (size_t r = k + 1; r < order.size(); ++r) {
      ASSERT_EQ(FindExact(map, 42, children[order[r]].get()), children[order[r]].get())
          << "after erasing " << k + 1;
    }
    ASSERT_EQ(FindExact(map, 43, children[0].get()), children[0].get());
  }
  EXPECT_EQ(map.size(), 1u);
}

TEST(ChildMapTest, ReplaceKeepsKeyAndSize) {
  auto children = MakeChildren(10);
  Map map;
  for (int i = 0; i < 8; ++i) map.Insert(i % 3, children[i].get());
  map.Replace(1, children[4].get(), children[9].get());
  EXPECT_EQ(map.size(), 8u);
  EXPECT_EQ(FindExact(map, 1, children[4].get()), nullptr);
  EXPECT_EQ(FindExact(map, 1, children[9].get()), children[9].get());
  EXPECT_EQ(FindExact(map, 1, children[1].get()), children[1].get());
  EXPECT_EQ(FindExact(map, 1, children[7].get()), children[7].get());
  EXPECT_TRUE(map.Erase(1, children[9].get()));
  EXPECT_EQ(map.size(), 7u);
}

TEST(ChildMapTest, ForEachVisitsEveryEntryOnce) {
  auto children = MakeChildren(50);
  Map map;
  std::vector<std::pair<uint64_t, Child*>> want;
  for (int i = 0; i < 50; ++i) {
    uint64_t key = static_cast<uint64_t>(i % 17) << 40;  // keys differing only in high bits
    map.Insert(key, children[i].get());
    want.emplace_back(key, children[i].get());
  }
  std::sort(want.begin(), want.end());
  EXPECT_EQ(Entries(map), want);
}

TEST(ChildMapTest, ClearEmptiesAndAllowsReuse) {
  auto children = MakeChildren(10);
  Map map;
  for (int i = 0; i < 10; ++i) map.Insert(i, children[i].get());
  map.Clear();
  EXPECT_TRUE(map.empty());
  EXPECT_EQ(FindAny(map, 3), nullptr);
  EXPECT_TRUE(Entries(map).empty());
  map.Insert(3, children[3].get());
  EXPECT_EQ(map.size(), 1u);
  EXPECT_EQ(FindAny(map, 3), children[3].get());
}

TEST(ChildMapTest, EraseToEmptyThenReinsert) {
  auto children = MakeChildren(5);
  Map map;
  for (int i = 0; i < 5; ++i) map.Insert(i, children[i].get());
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(map.Erase(i, children[i].get()));
  EXPECT_TRUE(map.empty());
  EXPECT_EQ(FindAny(map, 0), nullptr);
  map.Insert(9, children[0].get());
  EXPECT_EQ(FindAny(map, 9), children[0].get());
}

// Backward-shift deletion must keep every remaining entry reachable from its home slot, also
// across the wrap-around of the table. Small key ranges force long probe runs and duplicates.
TEST(ChildMapTest, RandomizedAgainstUnorderedMultimap) {
  std::mt19937_64 rng(20240601);
  constexpr int kPool = 64;
  auto children = MakeChildren(kPool);
  for (int round = 0; round < 60; ++round) {
    Map map;
    std::unordered_multimap<uint64_t, Child*> ref;
    std::vector<uint64_t> key_of(kPool);
    std::vector<bool> present(kPool, false);
    const uint64_t key_range = round % 3 == 0 ? 4 : round % 3 == 1 ? 32 : ~0ull;
    for (int step = 0; step < 400; ++step) {
      const int i = static_cast<int>(rng() % kPool);
      if (!present[i] && rng() % 3 != 0) {
        key_of[i] = key_range == ~0ull ? rng() : rng() % key_range;
        map.Insert(key_of[i], children[i].get());
        ref.emplace(key_of[i], children[i].get());
        present[i] = true;
      } else if (present[i]) {
        ASSERT_TRUE(map.Erase(key_of[i], children[i].get()));
        auto range = ref.equal_range(key_of[i]);
        for (auto it = range.first; it != range.second; ++it) {
          if (it->second == children[i].get()) {
            ref.erase(it);
            break;
          }
        }
        present[i] = false;
      }
      ASSERT_EQ(map.size(), ref.size());
      for (int j = 0; j < kPool; ++j) {
        if (present[j]) {
          ASSERT_EQ(FindExact(map, key_of[j], children[j].get()), children[j].get())
              << "round " << round << " step " << step << " child " << j;
        }
      }
      std::vector<std::pair<uint64_t, Child*>> want(ref.begin(), ref.end());
      std::sort(want.begin(), want.end());
      ASSERT_EQ(Entries(map), want);
    }
  }
}

}  // namespace
}  // namespace radixkv
