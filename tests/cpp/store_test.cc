// The store's shared index math (store_index.h, also compiled into the CUDA
// kernel) and the CPU kernel (store.h), against a plain byte-by-byte scatter
// written from the layout definitions.
#include "radixkv/store.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "radixkv/store_index.h"

namespace radixkv {
namespace {

// ---- the index math ----------------------------------------------------------

TEST(StoreIndexTest, RowOffsetUnpagedAndPaged) {
  const RowLayout flat{1, 320, 320, 80};
  for (int64_t r = 0; r < 100; ++r) EXPECT_EQ(RowOffset(flat, r), r * 320);
  const RowLayout paged{16, 15360, 320, 80};  // 3 layers interleaved per page
  for (int64_t r = 0; r < 100; ++r) {
    EXPECT_EQ(RowOffset(paged, r), (r / 16) * 15360 + (r % 16) * 320) << r;
  }
}

TEST(StoreIndexTest, LoadSlotWidensBothIndexTypes) {
  const int32_t i32[3] = {7, -1, 2147483647};
  const int64_t i64[3] = {7, -1, int64_t{1} << 40};
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(LoadSlot(i32, IndexType::kInt32, i), i32[i]);
    EXPECT_EQ(LoadSlot(i64, IndexType::kInt64, i), i64[i]);
  }
}

TEST(StoreIndexTest, SlotInRange) {
  EXPECT_TRUE(SlotInRange(0, 1));
  EXPECT_TRUE(SlotInRange(9, 10));
  EXPECT_FALSE(SlotInRange(10, 10));
  EXPECT_FALSE(SlotInRange(-1, 10));
  EXPECT_FALSE(SlotInRange(0, 0));
}

StoreParams DenseParams(int64_t heads, int64_t head_bytes, int64_t page_size) {
  StoreParams p{};
  const int64_t row = heads * head_bytes;
  for (int s = 0; s < 2; ++s) {
    p.src_layout[s] = RowLayout{1, row, row, head_bytes};
    p.dst_layout[s] = RowLayout{page_size, page_size * row, row, head_bytes};
  }
  p.heads = heads;
  p.head_bytes = head_bytes;
  return p;
}

TEST(StoreIndexTest, SimplifyMergesDenseHeadsAndPages) {
  StoreParams p = DenseParams(8, 256, 16);
  SimplifyStore(&p);
  EXPECT_EQ(p.heads, 1);
  EXPECT_EQ(p.head_bytes, 2048);
  for (int s = 0; s < 2; ++s) {
    EXPECT_EQ(p.dst_layout[s].page_size, 1);
    EXPECT_EQ(p.dst_layout[s].page_stride, 2048);
    EXPECT_EQ(p.dst_layout[s].row_stride, 2048);
    EXPECT_EQ(p.src_layout[s].page_stride, 2048);
  }
}

TEST(StoreIndexTest, SimplifyKeepsWhatIsNotDense) {
  StoreParams p = DenseParams(4, 160, 16);
  p.src_layout[1].head_stride = 480;           // v's heads are strided: a fused kv slice
  p.dst_layout[0].page_stride = 3 * 16 * 640;  // PageFirst with 3 layers
  p.dst_layout[1].page_stride = 3 * 16 * 640;
  SimplifyStore(&p);
  EXPECT_EQ(p.heads, 4);
  EXPECT_EQ(p.head_bytes, 160);
  EXPECT_EQ(p.dst_layout[0].page_size, 16);
  EXPECT_EQ(p.dst_layout[0].row_stride, 640);
  EXPECT_EQ(p.src_layout[1].head_stride, 480);
}

TEST(StoreIndexTest, VectorBytesFollowsEveryPointerAndStride) {
  alignas(64) static char buf[4096];
  StoreParams p = DenseParams(1, 256, 1);
  for (int s = 0; s < 2; ++s) {
    p.src[s] = buf;
    p.dst[s] = buf + 1024;
  }
  EXPECT_EQ(VectorBytes(p, 16), 16);
  EXPECT_EQ(VectorBytes(p, 8), 8);
  p.head_bytes = 200;  // head_dim 100 in fp16
  EXPECT_EQ(VectorBytes(p, 16), 8);
  p.head_bytes = 256;
  p.src[1] = buf + 6;  // a misaligned slice
  EXPECT_EQ(VectorBytes(p, 16), 2);
  p.src[1] = buf;
  p.src_layout[0].page_stride = 256 + 4;
  EXPECT_EQ(VectorBytes(p, 16), 4);
  p.src_layout[0].page_stride = 256;
  p.heads = 2;
  p.dst_layout[0].head_stride = 1;  // only counts when there are several heads
  EXPECT_EQ(VectorBytes(p, 16), 1);
  p.heads = 1;
  EXPECT_EQ(VectorBytes(p, 16), 16);
}

// ---- a reference scatter and random layouts ------------------------------------

// One store problem in owned buffers: strided sources, padded and paged caches,
// every base offset free, so alignment goes from 1 byte to 16.
struct Problem {
  int64_t n = 0, heads = 1, head_bytes = 1, page_size = 1, num_pages = 1;
  int64_t src_stride[2] = {}, src_head_stride[2] = {};
  int64_t dst_page_stride = 0, dst_row_stride = 0, dst_head_stride = 0;
  int64_t src_offset[2] = {}, dst_offset[2] = {};
  std::vector<uint8_t> src[2], dst[2];
  std::vector<int32_t> idx32;
  std::vector<int64_t> idx64;
  IndexType index_type = IndexType::kInt32;

  int64_t num_slots() const { return page_size * num_pages; }

  StoreParams Params() {
    StoreParams p{};
    for (int s = 0; s < 2; ++s) {
      p.src[s] = src[s].data() + src_offset[s];
      p.dst[s] = dst[s].data() + dst_offset[s];
      p.src_layout[s] = RowLayout{1, src_stride[s], src_stride[s], src_head_stride[s]};
      p.dst_layout[s] = RowLayout{page_size, dst_page_stride, dst_row_stride, dst_head_stride};
    }
    p.heads = heads;
    p.head_bytes = head_bytes;
    p.indices = index_type == IndexType::kInt32 ? static_cast<const void*>(idx32.data())
                                                : static_cast<const void*>(idx64.data());
    p.index_type = index_type;
    p.num_tokens = n;
    p.num_slots = num_slots();
    return p;
  }

  int64_t Slot(int64_t i) const { return index_type == IndexType::kInt32 ? idx32[i] : idx64[i]; }

  // The expected caches, written byte by byte from the definitions.
  void Expected(std::vector<uint8_t> out[2]) const {
    for (int s = 0; s < 2; ++s) {
      out[s] = dst[s];
      for (int64_t i = 0; i < n; ++i) {
        const int64_t slot = Slot(i);
        if (slot < 0 || slot >= num_slots()) continue;
        for (int64_t h = 0; h < heads; ++h) {
          for (int64_t b = 0; b < head_bytes; ++b) {
            out[s][dst_offset[s] + (slot / page_size) * dst_page_stride +
                   (slot % page_size) * dst_row_stride + h * dst_head_stride + b] =
                src[s][src_offset[s] + i * src_stride[s] + h * src_head_stride[s] + b];
          }
        }
      }
    }
  }
};

Problem RandomProblem(std::mt19937_64& rng, int64_t n, bool dense) {
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  Problem pr;
  pr.n = n;
  pr.heads = pick(1, 4);
  const int64_t elem = int64_t{1} << pick(0, 2);  // 1, 2 or 4 byte dtypes
  pr.head_bytes = elem * (dense ? 8 * pick(1, 16) : pick(1, 100));
  pr.page_size = pick(0, 1) ? 1 : pick(2, 16);
  pr.num_pages = (n + pr.page_size - 1) / pr.page_size + pick(1, 4);
  const int64_t pad = dense ? 0 : 1;
  for (int s = 0; s < 2; ++s) {
    pr.src_head_stride[s] = pr.head_bytes + pad * elem * pick(0, 3);
    pr.src_stride[s] = pr.heads * pr.src_head_stride[s] + pad * elem * pick(0, 5);
    pr.src_offset[s] = pad * pick(0, 17);
    pr.dst_offset[s] = pad * pick(0, 17);
  }
  pr.dst_head_stride = pr.head_bytes + pad * elem * pick(0, 3);
  pr.dst_row_stride = pr.heads * pr.dst_head_stride + pad * elem * pick(0, 3);
  const int64_t layers = dense ? 1 : pick(1, 3);  // PageFirst interleaves layers in a page
  pr.dst_page_stride = layers * pr.page_size * pr.dst_row_stride;
  for (int s = 0; s < 2; ++s) {
    pr.src[s].resize(pr.src_offset[s] + std::max<int64_t>(n, 1) * pr.src_stride[s]);
    pr.dst[s].resize(pr.dst_offset[s] + pr.num_pages * pr.dst_page_stride);
    for (auto& b : pr.src[s]) b = static_cast<uint8_t>(rng());
    for (auto& b : pr.dst[s]) b = static_cast<uint8_t>(rng());
  }
  std::vector<int64_t> slots(pr.num_slots());
  for (int64_t i = 0; i < pr.num_slots(); ++i) slots[i] = i;
  std::shuffle(slots.begin(), slots.end(), rng);
  pr.index_type = pick(0, 1) ? IndexType::kInt32 : IndexType::kInt64;
  for (int64_t i = 0; i < n; ++i) {
    pr.idx32.push_back(static_cast<int32_t>(slots[i]));
    pr.idx64.push_back(slots[i]);
  }
  return pr;
}

// ---- the device code path, run on the host ----------------------------------------

struct alignas(16) Bytes16 {
  uint32_t w[4];
};
struct alignas(8) Bytes8 {
  uint32_t w[2];
};

// Runs StoreTokenPart the way the CUDA kernel does: groups of `lanes` workers,
// each worker its share of a token, after SimplifyStore.
template <typename Vec>
void EmulateKernel(StoreParams p, int64_t lanes) {
  SimplifyStore(&p);
  ASSERT_LE(static_cast<int64_t>(sizeof(Vec)), VectorBytes(p, 16));
  for (int64_t i = 0; i < p.num_tokens; ++i) {
    for (int64_t lane = 0; lane < lanes; ++lane) StoreTokenPart<Vec>(p, i, lane, lanes);
  }
}

void EmulateWidest(StoreParams p, int64_t lanes) {
  StoreParams q = p;
  SimplifyStore(&q);
  switch (VectorBytes(q, 16)) {
    case 16:
      return EmulateKernel<Bytes16>(p, lanes);
    case 8:
      return EmulateKernel<Bytes8>(p, lanes);
    case 4:
      return EmulateKernel<uint32_t>(p, lanes);
    case 2:
      return EmulateKernel<uint16_t>(p, lanes);
    default:
      return EmulateKernel<uint8_t>(p, lanes);
  }
}

TEST(StoreTokenPartTest, MatchesReferenceForEveryLaneCount) {
  std::mt19937_64 rng(1);
  for (int trial = 0; trial < 300; ++trial) {
    const bool dense = trial % 3 == 0;
    Problem pr = RandomProblem(rng, 1 + trial % 37, dense);
    std::vector<uint8_t> expected[2];
    pr.Expected(expected);
    for (int64_t lanes : {1, 4, 32}) {
      Problem run = pr;
      EmulateWidest(run.Params(), lanes);
      for (int s = 0; s < 2; ++s) {
        ASSERT_EQ(run.dst[s], expected[s]) << "trial " << trial << " side " << s << " lanes "
                                           << lanes << " head_bytes " << pr.head_bytes;
      }
    }
  }
}

TEST(StoreTokenPartTest, SkipsOutOfRangeSlots) {
  std::mt19937_64 rng(2);
  Problem pr = RandomProblem(rng, 8, true);
  pr.idx32[3] = pr.idx64[3] = -1;
  pr.idx32[5] = static_cast<int32_t>(pr.num_slots());
  pr.idx64[5] = pr.num_slots();
  std::vector<uint8_t> expected[2];
  pr.Expected(expected);  // skips them too
  StoreParams p = pr.Params();
  SimplifyStore(&p);
  for (int64_t i = 0; i < p.num_tokens; ++i) {
    EXPECT_EQ(StoreTokenPart<uint8_t>(p, i, 0, 1), i != 3 && i != 5) << i;
  }
  for (int s = 0; s < 2; ++s) EXPECT_EQ(pr.dst[s], expected[s]);
}

// ---- the CPU kernel ------------------------------------------------------------------

TEST(StoreRowsTest, MatchesReferenceOnRandomLayouts) {
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 300; ++trial) {
    Problem pr = RandomProblem(rng, trial % 50, trial % 2 == 0);
    std::vector<uint8_t> expected[2];
    pr.Expected(expected);
    ASSERT_EQ(StoreRows(pr.Params()).kind, StoreCheck::kOk);
    for (int s = 0; s < 2; ++s) ASSERT_EQ(pr.dst[s], expected[s]) << "trial " << trial;
  }
}

// Batches past the streaming threshold: caches of whole 64-byte lines take the
// cache-bypassing copy, the others are split over threads.
TEST(StoreRowsTest, LargeBatchesMatchReference) {
  std::mt19937_64 rng(4);
  for (int64_t head_bytes : {4096, 4000, 256, 192, 200, 33}) {
    for (bool line_aligned : {true, false}) {
      Problem pr;
      pr.heads = 1;
      pr.head_bytes = head_bytes;
      pr.n = (int64_t{6} << 20) / (2 * head_bytes) + 1;  // 6 MiB written
      pr.page_size = 1;
      pr.num_pages = pr.n + 100;
      for (int s = 0; s < 2; ++s) {
        pr.src_stride[s] = pr.src_head_stride[s] = head_bytes;
        pr.src_offset[s] = line_aligned ? 0 : 3 + s;
        pr.src[s].resize(pr.src_offset[s] + pr.n * head_bytes);
        pr.dst[s].assign(64 + pr.num_pages * head_bytes, 0xAB);
        const auto addr = reinterpret_cast<uintptr_t>(pr.dst[s].data());
        pr.dst_offset[s] = static_cast<int64_t>((64 - addr % 64) % 64) + (line_aligned ? 0 : 16);
        for (auto& b : pr.src[s]) b = static_cast<uint8_t>(rng());
      }
      pr.dst_page_stride = pr.dst_row_stride = pr.dst_head_stride = head_bytes;
      std::vector<int64_t> slots(pr.num_pages);
      for (int64_t i = 0; i < pr.num_pages; ++i) slots[i] = i;
      std::shuffle(slots.begin(), slots.end(), rng);
      for (int64_t i = 0; i < pr.n; ++i) pr.idx64.push_back(slots[i]);
      pr.index_type = IndexType::kInt64;
      std::vector<uint8_t> expected[2];
      pr.Expected(expected);
      const std::vector<uint8_t> before[2] = {pr.dst[0], pr.dst[1]};
      for (int threads : {1, 2, 3}) {
        pr.dst[0] = before[0];
        pr.dst[1] = before[1];
        ASSERT_EQ(StoreRows(pr.Params(), threads).kind, StoreCheck::kOk);
        for (int s = 0; s < 2; ++s) {
          ASSERT_TRUE(pr.dst[s] == expected[s])
              << "head_bytes " << head_bytes << " line_aligned " << line_aligned << " side " << s
              << " threads " << threads;
        }
      }
    }
  }
}

TEST(StoreRowsTest, OutOfRangeSlotWritesNothing) {
  std::mt19937_64 rng(5);
  for (int64_t bad_at : {0, 7, 1023, 1024, 2999}) {
    for (int64_t bad : {int64_t{-1}, int64_t{-2147483648LL}, int64_t{0}}) {
      for (IndexType type : {IndexType::kInt32, IndexType::kInt64}) {
        Problem pr = RandomProblem(rng, 3000, true);
        pr.index_type = type;
        const int64_t value = bad == 0 ? pr.num_slots() : bad;  // 0 stands for num_slots
        pr.idx32[bad_at] = static_cast<int32_t>(value);
        pr.idx64[bad_at] = value;
        const std::vector<uint8_t> before[2] = {pr.dst[0], pr.dst[1]};
        const StoreCheck check = StoreRows(pr.Params());
        EXPECT_EQ(check.kind, StoreCheck::kOutOfRange);
        EXPECT_EQ(check.position, bad_at);
        EXPECT_EQ(check.slot, value);
        EXPECT_EQ(pr.dst[0], before[0]);
        EXPECT_EQ(pr.dst[1], before[1]);
      }
    }
  }
}

TEST(StoreRowsTest, Int64SlotsBeyondInt32AreOutOfRange) {
  std::mt19937_64 rng(6);
  Problem pr = RandomProblem(rng, 10, true);
  pr.index_type = IndexType::kInt64;
  pr.idx64[9] = (int64_t{1} << 32) + 1;  // would wrap to slot 1 if truncated
  EXPECT_EQ(StoreRows(pr.Params()).position, 9);
}

TEST(StoreRowsTest, RepeatedSlotWritesNothing) {
  std::mt19937_64 rng(8);
  for (IndexType type : {IndexType::kInt32, IndexType::kInt64}) {
    for (int64_t n : {2, 100, 5000}) {
      Problem pr = RandomProblem(rng, n, true);
      pr.index_type = type;
      pr.idx32[n - 1] = pr.idx32[n / 2 - 1];
      pr.idx64[n - 1] = pr.idx64[n / 2 - 1];
      const std::vector<uint8_t> before[2] = {pr.dst[0], pr.dst[1]};
      const StoreCheck check = StoreRows(pr.Params());
      EXPECT_EQ(check.kind, StoreCheck::kRepeated);
      EXPECT_EQ(check.position, n - 1);
      EXPECT_EQ(check.slot, pr.idx64[n - 1]);
      EXPECT_EQ(pr.dst[0], before[0]);
      EXPECT_EQ(pr.dst[1], before[1]);
    }
  }
}

// The indices live inside the cache they are stored into: storing token 0
// rewrites token 1's index. Each index is read once, before anything is
// written, so token 1 goes where its index said at the start, never out of
// bounds.
TEST(StoreRowsTest, IndicesAliasingTheCacheAreReadOnce) {
  for (IndexType type : {IndexType::kInt32, IndexType::kInt64}) {
    const int64_t width = type == IndexType::kInt32 ? 4 : 8;
    const int64_t row = 16, num_slots = 8;
    std::vector<uint8_t> kc(num_slots * row, 0), vc(num_slots * row, 0);
    // Slot 0's row holds the two indices; token 0's k row is all 0xFF, which
    // written into slot 0 turns index 1 into -1 (int32) or -1 (int64).
    void* indices = kc.data();
    if (type == IndexType::kInt32) {
      const int32_t idx[2] = {0, 5};
      std::memcpy(indices, idx, sizeof(idx));
    } else {
      const int64_t idx[2] = {0, 5};
      std::memcpy(indices, idx, sizeof(idx));
    }
    std::vector<uint8_t> k(2 * row, 0xFF), v(2 * row, 0x11);
    StoreParams p{};
    p.src[0] = k.data();
    p.src[1] = v.data();
    p.dst[0] = kc.data();
    p.dst[1] = vc.data();
    for (int s = 0; s < 2; ++s) {
      p.src_layout[s] = RowLayout{1, row, row, row};
      p.dst_layout[s] = RowLayout{1, row, row, row};
    }
    p.heads = 1;
    p.head_bytes = row;
    p.indices = indices;
    p.index_type = type;
    p.num_tokens = 2;
    p.num_slots = num_slots;
    ASSERT_EQ(StoreRows(p).kind, StoreCheck::kOk) << width;
    for (int64_t b = 0; b < row; ++b) {
      EXPECT_EQ(kc[5 * row + b], 0xFF) << "token 1 went to slot 5, as read at the start";
      EXPECT_EQ(vc[5 * row + b], 0x11);
    }
  }
}

TEST(StoreRowsTest, EmptyBatchIsANoOp) {
  StoreParams p{};
  p.heads = 1;
  p.head_bytes = 16;
  p.num_tokens = 0;
  p.num_slots = 0;
  p.index_type = IndexType::kInt32;
  EXPECT_EQ(StoreRows(p).kind, StoreCheck::kOk);
}

TEST(FindSlotOutOfRangeTest, FirstBadPosition) {
  std::vector<int32_t> idx(5000, 3);
  EXPECT_EQ(FindSlotOutOfRange(idx.data(), IndexType::kInt32, 5000, 4), -1);
  EXPECT_EQ(FindSlotOutOfRange(idx.data(), IndexType::kInt32, 5000, 3), 0);
  idx[4097] = 4;
  idx[4500] = -1;
  EXPECT_EQ(FindSlotOutOfRange(idx.data(), IndexType::kInt32, 5000, 4), 4097);
  EXPECT_EQ(FindSlotOutOfRange(idx.data(), IndexType::kInt32, 4097, 4), -1);
  EXPECT_EQ(FindSlotOutOfRange(idx.data(), IndexType::kInt32, 0, 0), -1);
}

}  // namespace
}  // namespace radixkv
