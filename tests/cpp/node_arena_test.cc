// The node-storage slab allocator: size classes, reuse, alignment, and that a
// slab whose blocks are all free goes back to the system.
#include "radixkv/node_arena.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <vector>

namespace radixkv {
namespace {

TEST(NodeArenaTest, ClassesCoverEverySizeWithLittleRounding) {
  size_t previous = 0;
  for (int c = 0; c < NodeArena::kClasses; ++c) {
    const size_t size = NodeArena::ClassSize(c);
    EXPECT_GT(size, previous) << c;
    EXPECT_EQ(size % 32, 0u) << c;
    EXPECT_EQ(NodeArena::ClassOf(size), c) << size;
    EXPECT_EQ(NodeArena::ClassOf(previous + 1), c) << previous + 1;
    previous = size;
  }
  for (size_t bytes = 1; bytes <= NodeArena::ClassSize(NodeArena::kClasses - 1); bytes += 97) {
    const int c = NodeArena::ClassOf(bytes);
    ASSERT_GE(c, 0) << bytes;
    const size_t size = NodeArena::ClassSize(c);
    ASSERT_GE(size, bytes);
    // 32-byte steps up to 1 KiB, then at most 1/32 of the block is rounding
    ASSERT_LE(size - bytes, bytes <= 1024 ? 31u : size / 32) << bytes;
  }
  EXPECT_EQ(NodeArena::ClassOf(NodeArena::ClassSize(NodeArena::kClasses - 1) + 1), -1);
  EXPECT_EQ(NodeArena::ClassSize(NodeArena::kClasses - 1), size_t{2} << 20);
  // A node of 1,024 tokens: at page 16 (4,352 bytes) and 512 (4,104) a block
  // with little or no rounding.
  EXPECT_EQ(NodeArena::ClassSize(NodeArena::ClassOf(4352)), 4352u);
  EXPECT_EQ(NodeArena::ClassSize(NodeArena::ClassOf(4104)), 4224u);
  // Sizes past the largest class, to the largest size_t: none.
  EXPECT_EQ(NodeArena::ClassOf(SIZE_MAX), -1);
  EXPECT_EQ(NodeArena::ClassOf((SIZE_MAX >> 1) + 2), -1);
}

TEST(NodeArenaTest, BlocksAreAlignedDisjointAndReused) {
  NodeArena arena;
  std::mt19937 rng(1);
  std::map<uintptr_t, size_t> live;  // start -> bytes
  std::vector<std::pair<NodeArena::Block, size_t>> blocks;
  for (int step = 0; step < 20000; ++step) {
    if (blocks.empty() || rng() % 3 != 0) {
      const size_t bytes = 1 + rng() % (rng() % 8 == 0 ? 300000 : 5000);
      NodeArena::Block b = arena.Allocate(bytes);
      const auto p = reinterpret_cast<uintptr_t>(b.data);
      ASSERT_EQ(p % 32, 0u);
      auto next = live.lower_bound(p);
      ASSERT_TRUE(next == live.end() || next->first >= p + bytes) << "overlaps the next block";
      if (next != live.begin()) {
        auto prev = std::prev(next);
        ASSERT_LE(prev->first + prev->second, p) << "overlaps the previous block";
      }
      std::memset(b.data, step & 0xFF, bytes);
      live[p] = bytes;
      blocks.push_back({b, bytes});
    } else {
      const size_t k = rng() % blocks.size();
      live.erase(reinterpret_cast<uintptr_t>(blocks[k].first.data));
      arena.Free(blocks[k].first, blocks[k].second);
      blocks[k] = blocks.back();
      blocks.pop_back();
    }
  }
  for (auto& [b, bytes] : blocks) arena.Free(b, bytes);
  // Everything free: at most the empty slabs kept for reuse remain.
  EXPECT_LE(arena.reserved_bytes(), size_t{16} << 20);
}

TEST(NodeArenaTest, FreedBlockIsReusedByItsClass) {
  NodeArena arena;
  NodeArena::Block a = arena.Allocate(1000);
  arena.Free(a, 1000);
  NodeArena::Block b = arena.Allocate(1010);  // same class
  EXPECT_EQ(a.data, b.data);
  arena.Free(b, 1010);
}

TEST(NodeArenaTest, EmptySlabsGoBackToTheSystem) {
  NodeArena arena;
  std::vector<NodeArena::Block> blocks;
  for (int i = 0; i < 4000; ++i) blocks.push_back(arena.Allocate(4096));
  const size_t full = arena.reserved_bytes();
  EXPECT_GE(full, size_t{4000} * 4096);
  for (NodeArena::Block b : blocks) arena.Free(b, 4096);
  EXPECT_LE(arena.reserved_bytes(), size_t{16} << 20);  // the empty slabs kept at most
  // Large blocks come from the system and go straight back.
  NodeArena::Block big = arena.Allocate(size_t{8} << 20);
  EXPECT_EQ(big.slab, nullptr);
  const size_t with_big = arena.reserved_bytes();
  arena.Free(big, size_t{8} << 20);
  EXPECT_EQ(arena.reserved_bytes(), with_big - (size_t{8} << 20));
}

TEST(NodeArenaTest, AnEmptyHugeSlabServesAnotherClass) {
  // Node sizes move: one class fills 2 MiB slabs and empties them, then
  // another class takes the same memory instead of asking the system.
  NodeArena arena;
  constexpr size_t kA = 300000, kB = 200000;  // two classes, 2 MiB slabs both
  ASSERT_NE(NodeArena::ClassOf(kA), NodeArena::ClassOf(kB));
  std::vector<NodeArena::Block> a;
  for (int i = 0; i < 40; ++i) a.push_back(arena.Allocate(kA));
  for (NodeArena::Block b : a) std::memset(b.data, 1, kA);
  const size_t full = arena.reserved_bytes();
  for (NodeArena::Block b : a) arena.Free(b, kA);
  const size_t kept = arena.reserved_bytes();
  EXPECT_GE(kept, size_t{2} << 20);  // spare slabs kept
  EXPECT_LE(kept, std::max(size_t{16} << 20, full / 8));
  std::vector<NodeArena::Block> b;
  // As many blocks of the other class as the spare slabs hold: no new memory.
  const size_t fit = kept / (size_t{2} << 20) * ((size_t{2} << 20) / NodeArena::ClassSize(
                                                     NodeArena::ClassOf(kB)));
  for (size_t i = 0; i < fit; ++i) {
    b.push_back(arena.Allocate(kB));
    std::memset(b.back().data, 2, kB);
  }
  EXPECT_EQ(arena.reserved_bytes(), kept);
  std::set<uintptr_t> starts;
  for (NodeArena::Block x : b) starts.insert(reinterpret_cast<uintptr_t>(x.data));
  EXPECT_EQ(starts.size(), b.size());
  for (NodeArena::Block x : b) arena.Free(x, kB);
  EXPECT_EQ(arena.reserved_bytes(), kept);
}

TEST(NodeArenaTest, SparesShrinkWhenLargeBlocksGo) {
  // Large blocks in use raise the spares' budget; once they go, so do the
  // spares past 16 MiB.
  NodeArena arena;
  std::vector<NodeArena::Block> big, small;
  for (int i = 0; i < 64; ++i) big.push_back(arena.Allocate(size_t{8} << 20));
  for (int i = 0; i < 120; ++i) small.push_back(arena.Allocate(300000));
  for (NodeArena::Block x : small) arena.Free(x, 300000);
  EXPECT_GT(arena.reserved_bytes(), (size_t{64} * 8 + 16) << 20);  // spares past 16 MiB kept
  for (NodeArena::Block x : big) arena.Free(x, size_t{8} << 20);
  EXPECT_LE(arena.reserved_bytes(), size_t{16} << 20);
}

}  // namespace
}  // namespace radixkv
