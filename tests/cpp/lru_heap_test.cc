#include "radixkv/lru_heap.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <set>
#include <utility>
#include <vector>

namespace radixkv {
namespace {

// Pops everything, checking the heap after each pop; returns the keys in pop order.
std::vector<uint64_t> Drain(LruHeap* heap, const std::vector<uint64_t>& key_of) {
  std::vector<uint64_t> out;
  while (!heap->empty()) {
    const uint32_t id = heap->Pop();
    EXPECT_FALSE(heap->Contains(id));
    EXPECT_EQ(heap->PositionOf(id), LruHeap::kAbsent);
    EXPECT_TRUE(heap->IsValid());
    out.push_back(key_of[id]);
  }
  return out;
}

TEST(LruHeapTest, EmptyHeap) {
  LruHeap heap;
  EXPECT_TRUE(heap.empty());
  EXPECT_EQ(heap.size(), 0u);
  EXPECT_FALSE(heap.Contains(0));
  EXPECT_FALSE(heap.Contains(1000));
  EXPECT_EQ(heap.PositionOf(7), LruHeap::kAbsent);
  EXPECT_TRUE(heap.IsValid());
}

TEST(LruHeapTest, PopsInKeyOrder) {
  const std::vector<uint64_t> keys{5, 3, 9, 1, 7, 3, 8, 0, 6, 2, 4};
  LruHeap heap;
  for (uint32_t id = 0; id < keys.size(); ++id) {
    heap.Push(id, keys[id]);
    EXPECT_TRUE(heap.Contains(id));
    EXPECT_EQ(heap.KeyAt(static_cast<size_t>(heap.PositionOf(id))), keys[id]);
    EXPECT_EQ(heap.IdAt(static_cast<size_t>(heap.PositionOf(id))), id);
    EXPECT_TRUE(heap.IsValid());
  }
  EXPECT_EQ(heap.size(), keys.size());
  EXPECT_EQ(heap.top(), 7u);
  EXPECT_EQ(Drain(&heap, keys), (std::vector<uint64_t>{0, 1, 2, 3, 3, 4, 5, 6, 7, 8, 9}));
}

TEST(LruHeapTest, SparseAndLargeIds) {
  LruHeap heap;
  heap.Push(1000, 3);
  heap.Push(5, 1);
  heap.Push(70000, 2);
  EXPECT_TRUE(heap.Contains(1000));
  EXPECT_FALSE(heap.Contains(999));
  EXPECT_FALSE(heap.Contains(6));
  EXPECT_EQ(heap.Pop(), 5u);
  EXPECT_EQ(heap.Pop(), 70000u);
  EXPECT_EQ(heap.Pop(), 1000u);
  EXPECT_TRUE(heap.empty());
}

TEST(LruHeapTest, EraseArbitraryElement) {
  const std::vector<uint64_t> keys{4, 2, 8, 6, 1, 9, 3, 7, 5, 0};
  for (uint32_t victim = 0; victim < keys.size(); ++victim) {
    LruHeap heap;
    for (uint32_t id = 0; id < keys.size(); ++id) heap.Push(id, keys[id]);
    heap.Erase(victim);
    EXPECT_FALSE(heap.Contains(victim));
    EXPECT_EQ(heap.size(), keys.size() - 1);
    EXPECT_TRUE(heap.IsValid());
    std::multiset<uint64_t> want(keys.begin(), keys.end());
    want.erase(want.find(keys[victim]));
    EXPECT_EQ(Drain(&heap, keys), std::vector<uint64_t>(want.begin(), want.end())) << victim;
  }
}

TEST(LruHeapTest, EraseLastAndOnlyElement) {
  LruHeap heap;
  heap.Push(0, 1);
  heap.Erase(0);
  EXPECT_TRUE(heap.empty());
  EXPECT_FALSE(heap.Contains(0));
  heap.Push(0, 1);
  heap.Push(1, 2);
  heap.Erase(1);  // the back element
  EXPECT_EQ(heap.size(), 1u);
  EXPECT_EQ(heap.top(), 0u);
  EXPECT_EQ(heap.PositionOf(0), 0);
  EXPECT_TRUE(heap.IsValid());
}

TEST(LruHeapTest, UpdateUpAndDown) {
  std::vector<uint64_t> keys{10, 20, 30, 40, 50, 60, 70, 80, 90};
  LruHeap heap;
  for (uint32_t id = 0; id < keys.size(); ++id) heap.Push(id, keys[id]);
  keys[8] = 5;  // down: the last leaf becomes the minimum
  heap.Update(8, keys[8]);
  EXPECT_TRUE(heap.IsValid());
  EXPECT_EQ(heap.top(), 8u);
  keys[8] = 100;  // up: the root sinks to the bottom
  heap.Update(8, keys[8]);
  EXPECT_TRUE(heap.IsValid());
  EXPECT_EQ(heap.top(), 0u);
  keys[3] = 45;  // a small change that keeps the order
  heap.Update(3, keys[3]);
  keys[5] = 15;
  heap.Update(5, keys[5]);
  EXPECT_TRUE(heap.IsValid());
  EXPECT_EQ(Drain(&heap, keys), (std::vector<uint64_t>{10, 15, 20, 30, 45, 50, 70, 80, 100}));
}

TEST(LruHeapTest, ClearForgetsEveryId) {
  LruHeap heap;
  for (uint32_t id = 0; id < 10; ++id) heap.Push(id, 10 - id);
  heap.Clear();
  EXPECT_TRUE(heap.empty());
  for (uint32_t id = 0; id < 10; ++id) EXPECT_FALSE(heap.Contains(id));
  EXPECT_TRUE(heap.IsValid());
  heap.Push(3, 1);
  EXPECT_EQ(heap.top(), 3u);
  EXPECT_EQ(heap.size(), 1u);
}

TEST(LruHeapTest, RandomizedAgainstMultiset) {
  std::mt19937_64 rng(1234);
  constexpr uint32_t kIds = 300;
  std::vector<uint64_t> key_of(kIds, 0);
  LruHeap heap;
  std::set<std::pair<uint64_t, uint32_t>> ref;  // (key, id): ids are unique
  for (int step = 0; step < 30000; ++step) {
    const uint32_t id = static_cast<uint32_t>(rng() % kIds);
    const bool in = ref.count({key_of[id], id}) == 1;
    ASSERT_EQ(heap.Contains(id), in) << step;
    switch (rng() % 4) {
      case 0:
        if (!in) {
          key_of[id] = rng() % 64;  // a small range: many ties
          heap.Push(id, key_of[id]);
          ref.insert({key_of[id], id});
        }
        break;
      case 1:
        if (!heap.empty()) {
          const uint32_t top = heap.Pop();
          ASSERT_EQ(key_of[top], ref.begin()->first) << step;
          ASSERT_EQ(ref.erase({key_of[top], top}), 1u);
        }
        break;
      case 2:
        if (in) {
          heap.Erase(id);
          ref.erase({key_of[id], id});
        }
        break;
      case 3:
        if (in) {
          ref.erase({key_of[id], id});
          key_of[id] = rng() % 64;
          heap.Update(id, key_of[id]);
          ref.insert({key_of[id], id});
        }
        break;
    }
    ASSERT_EQ(heap.size(), ref.size());
    if (!ref.empty()) ASSERT_EQ(key_of[heap.top()], ref.begin()->first);
    if (step % 64 == 0) ASSERT_TRUE(heap.IsValid()) << step;
  }
  ASSERT_TRUE(heap.IsValid());
  std::vector<uint64_t> want;
  for (auto& [key, id] : ref) want.push_back(key);
  EXPECT_EQ(Drain(&heap, key_of), want);
}

}  // namespace
}  // namespace radixkv
