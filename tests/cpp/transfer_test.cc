// The K/V transfer between pools: the CPU copy (transfer.h) and the CUDA
// kernel's per-row body run on the host (transfer_index.h), against a plain
// byte-by-byte copy written from the layout definitions.
#include "radixkv/transfer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "radixkv/status.h"
#include "radixkv/transfer_index.h"

namespace radixkv {
namespace {

enum class Kind { kLayerFirst, kPageFirst, kHostPageFirst };

// A pool's bytes and its layout: `sides` sides (2: K and V, 1: MLA), L layers,
// P pages of S slots, rows of R bytes.
struct Pool {
  std::vector<uint8_t> bytes;
  PoolLayout layout{};

  Pool(Kind kind, int64_t L, int64_t P, int64_t S, int64_t R, int64_t sides = 2)
      : bytes(sides * L * P * S * R) {
    PoolLayout& l = layout;
    l.base = reinterpret_cast<char*>(bytes.data());
    l.row_stride = R;
    l.page_size = S;
    l.num_slots = P * S;
    l.sides = sides;
    switch (kind) {
      case Kind::kLayerFirst:  // [2, L, P, S, R]
        l.side_stride = L * P * S * R;
        l.layer_stride = P * S * R;
        l.page_stride = S * R;
        break;
      case Kind::kPageFirst:  // [2, P, L, S, R]
        l.side_stride = P * L * S * R;
        l.layer_stride = S * R;
        l.page_stride = L * S * R;
        break;
      case Kind::kHostPageFirst:  // [P, 2, L, S, R]
        l.page_stride = sides * L * S * R;
        l.side_stride = L * S * R;
        l.layer_stride = S * R;
        break;
    }
  }
  uint8_t* Row(int64_t side, int64_t layer, int64_t slot, int64_t R) {
    (void)R;
    return bytes.data() + PoolRowOffset(layout, side, layer, slot);
  }
};

// Slots for n tokens: whole pages in random page order (what page
// allocators hand out), or, when `scattered`, any distinct slots.
std::vector<int32_t> Slots(std::mt19937& rng, int64_t n, int64_t pages, int64_t S, bool scattered) {
  std::vector<int32_t> out;
  if (scattered) {
    std::vector<int32_t> all(pages * S);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    out.assign(all.begin(), all.begin() + n);
    return out;
  }
  std::vector<int32_t> order(pages);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  for (int64_t i = 0; i < n; ++i) out.push_back(static_cast<int32_t>(order[i / S] * S + i % S));
  return out;
}

struct Case {
  Kind src_kind, dst_kind;
  int64_t L, S, R, n;
  bool scattered;
  int64_t layer_begin, layer_end;
  int64_t sides = 2;
};

void RunCase(const Case& c, std::mt19937& rng, bool emulate_kernel) {
  const int64_t P = (c.n + c.S - 1) / c.S + 3;
  Pool src(c.src_kind, c.L, P, c.S, c.R, c.sides), dst(c.dst_kind, c.L, P, c.S, c.R, c.sides);
  for (auto& b : src.bytes) b = static_cast<uint8_t>(rng());
  for (auto& b : dst.bytes) b = static_cast<uint8_t>(rng());
  const std::vector<int32_t> s = Slots(rng, c.n, P, c.S, c.scattered);
  const std::vector<int32_t> d = Slots(rng, c.n, P, c.S, c.scattered);
  Pool expected = dst;
  expected.layout.base = reinterpret_cast<char*>(expected.bytes.data());
  for (int64_t i = 0; i < c.n; ++i) {
    for (int64_t side = 0; side < c.sides; ++side) {
      for (int64_t layer = c.layer_begin; layer < c.layer_end; ++layer) {
        std::memcpy(expected.Row(side, layer, d[i], c.R), src.Row(side, layer, s[i], c.R), c.R);
      }
    }
  }
  TransferParams p{src.layout, dst.layout, c.R,           c.L,        s.data(),
                   d.data(),   c.n,        c.layer_begin, c.layer_end};
  if (emulate_kernel) {
    // The CUDA kernel's body with 16-byte vectors and 8 lanes a row.
    struct alignas(16) V16 {
      uint32_t w[4];
    };
    ASSERT_EQ(TransferVectorBytes(p) % 16, 0);
    const int64_t rows = TransferRowCount(p);
    ASSERT_EQ(rows, c.n * c.sides * (c.layer_end - c.layer_begin));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t lane = 0; lane < 8; ++lane) TransferRowPart<V16>(p, r, lane, 8);
    }
  } else {
    ASSERT_EQ(TransferRows(p), -1);
  }
  ASSERT_TRUE(dst.bytes == expected.bytes);
}

TEST(TransferTest, EveryLayoutPairPageSizeAndLayerRange) {
  std::mt19937 rng(1);
  const Kind kinds[] = {Kind::kLayerFirst, Kind::kPageFirst, Kind::kHostPageFirst};
  for (Kind a : kinds) {
    for (Kind b : kinds) {
      for (int64_t S : {1, 4, 16}) {
        for (bool scattered : {false, true}) {
          for (int64_t R : {16, 48, 100}) {
            RunCase({a, b, 3, S, R, 37, scattered, 0, 3}, rng, false);  // backup: every layer
            RunCase({a, b, 3, S, R, 37, scattered, 1, 2}, rng, false);  // load: one layer
          }
        }
      }
    }
  }
}

TEST(TransferTest, KernelRowBodyMatches) {
  std::mt19937 rng(2);
  const Kind kinds[] = {Kind::kLayerFirst, Kind::kPageFirst, Kind::kHostPageFirst};
  for (Kind a : kinds) {
    for (Kind b : kinds) {
      for (int64_t S : {1, 16}) {
        RunCase({a, b, 2, S, 64, 50, false, 0, 2}, rng, true);
        RunCase({a, b, 2, S, 576, 20, true, 1, 2}, rng, true);  // an MLA fp8 row: 576 B
      }
    }
  }
}

TEST(TransferTest, OneSidedPoolsCopyTheirOneRowALayer) {
  // MLA pools: one latent row per layer and token, no V side (a second side
  // would read and write past the pools' buffers).
  std::mt19937 rng(4);
  const Kind kinds[] = {Kind::kLayerFirst, Kind::kPageFirst, Kind::kHostPageFirst};
  for (Kind a : kinds) {
    for (Kind b : kinds) {
      for (int64_t S : {1, 16}) {
        RunCase({a, b, 3, S, 1152, 21, false, 0, 3, 1}, rng, false);
        RunCase({a, b, 3, S, 576, 21, true, 1, 2, 1}, rng, true);
      }
    }
  }
}

// A pool whose (side, layer) planes are buffers of their own, named by a
// plane table (an engine's per-layer K and V tensors): copies to and from it
// give the bytes the same copies give with a one-buffer layer-first pool
// holding the same planes, on the CPU and through the kernel's row body.
TEST(TransferTest, PlaneTablePoolsCopyAsTheOneBufferPoolOfTheirPlanes) {
  std::mt19937 rng(5);
  for (const int64_t sides : {1, 2}) {
    for (const int64_t S : {1, 4}) {
      for (const bool kernel : {false, true}) {
        const int64_t L = 3, R = 64, n = 17, P = n / S + 3;
        Pool flat(Kind::kLayerFirst, L, P, S, R, sides);
        for (auto& b : flat.bytes) b = static_cast<uint8_t>(rng());
        // The planes in buffers of their own, apart and in a shuffled order.
        std::vector<std::vector<uint8_t>> planes(sides * L);
        std::vector<char*> table(sides * L);
        const int64_t plane_bytes = P * S * R;
        for (int64_t i = 0; i < sides * L; ++i) {
          planes[i].assign(flat.bytes.begin() + i * plane_bytes,
                           flat.bytes.begin() + (i + 1) * plane_bytes);
          table[i] = reinterpret_cast<char*>(planes[i].data());
        }
        PoolLayout split = flat.layout;
        split.side_stride = split.layer_stride = 0;
        split.planes = table.data();
        split.plane_layers = L;
        for (char* t : table) split.plane_bits |= reinterpret_cast<uintptr_t>(t);
        for (int64_t i = 0; i < sides * L; ++i) {
          PoolLayout one = split;
          one.base = table[i];
          EXPECT_NO_THROW(CheckPlaneLayout(one, R, plane_bytes, "device"));
          EXPECT_THROW(CheckPlaneLayout(one, R, plane_bytes - 1, "device"), Error);
        }
        Pool host(Kind::kHostPageFirst, L, P, S, R, sides);
        for (auto& b : host.bytes) b = static_cast<uint8_t>(rng());
        Pool expected = host;
        expected.layout.base = reinterpret_cast<char*>(expected.bytes.data());
        std::vector<int32_t> s = Slots(rng, n, P, S, false);
        std::vector<int32_t> d = Slots(rng, n, P, S, false);
        auto copy = [&](const PoolLayout& from, const PoolLayout& to, int64_t begin, int64_t end) {
          TransferParams p{from, to, R, L, s.data(), d.data(), n, begin, end};
          if (!kernel) {
            ASSERT_EQ(TransferRows(p), -1);
            return;
          }
          ASSERT_EQ(TransferVectorBytes(p) % 16, 0);
          struct alignas(16) V16 {
            uint32_t w[4];
          };
          for (int64_t r = 0; r < TransferRowCount(p); ++r) {
            for (int64_t lane = 0; lane < 4; ++lane) TransferRowPart<V16>(p, r, lane, 4);
          }
        };
        copy(flat.layout, expected.layout, 0, L);  // a backup, from the one buffer
        copy(split, host.layout, 0, L);            // the same, from the planes
        ASSERT_TRUE(host.bytes == expected.bytes);
        // A load of one layer back into the planes changes exactly that
        // layer's rows of those slots: compare with the one-buffer pool.
        for (auto& b : host.bytes) b = static_cast<uint8_t>(rng());
        std::swap(s, d);
        copy(host.layout, flat.layout, 1, 2);
        copy(host.layout, split, 1, 2);
        for (int64_t i = 0; i < sides * L; ++i) {
          ASSERT_TRUE(std::equal(planes[i].begin(), planes[i].end(),
                                 flat.bytes.begin() + i * plane_bytes))
              << "plane " << i;
        }
      }
    }
  }
}

TEST(TransferTest, OutOfRangeSlotCopiesNothing) {
  std::mt19937 rng(3);
  Pool src(Kind::kLayerFirst, 2, 4, 4, 16), dst(Kind::kHostPageFirst, 2, 4, 4, 16);
  for (auto& b : src.bytes) b = static_cast<uint8_t>(rng());
  const std::vector<uint8_t> before = dst.bytes;
  std::vector<int32_t> s{0, 1, 2}, d{4, 16, 5};  // 16 is past the 16 slots of dst
  TransferParams p{src.layout, dst.layout, 16, 2, s.data(), d.data(), 3, 0, 2};
  EXPECT_EQ(TransferRows(p), 1);
  EXPECT_EQ(dst.bytes, before);
  d[1] = -1;
  EXPECT_EQ(TransferRows(p), 1);
  d[1] = 6;
  s[2] = 16;
  EXPECT_EQ(TransferRows(p), 2);
  EXPECT_EQ(dst.bytes, before);
}

// The message of the Error a layout check throws, or "" when it passes.
std::string LayoutError(const PoolLayout& l, int64_t row_bytes, int64_t layers, int64_t bytes) {
  try {
    CheckPoolLayout(l, row_bytes, layers, bytes, "host");
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    return e.what();
  }
  return "";
}

TEST(PoolLayoutCheckTest, AcceptsEveryKindThatFitsExactly) {
  for (const Kind kind : {Kind::kLayerFirst, Kind::kPageFirst, Kind::kHostPageFirst}) {
    for (const int64_t sides : {1, 2}) {
      Pool p(kind, 3, 4, 5, 16, sides);
      const int64_t n = static_cast<int64_t>(p.bytes.size());
      EXPECT_EQ(LayoutError(p.layout, 16, 3, n), "") << static_cast<int>(kind);
      EXPECT_NE(LayoutError(p.layout, 16, 3, n - 1), "") << "one byte short";
      EXPECT_NE(LayoutError(p.layout, 17, 3, n), "") << "rows one byte longer";
      EXPECT_NE(LayoutError(p.layout, 16, 4, n), "") << "one more layer";
    }
  }
}

TEST(PoolLayoutCheckTest, NamesWhatIsWrong) {
  Pool p(Kind::kLayerFirst, 2, 2, 2, 8);
  const int64_t n = static_cast<int64_t>(p.bytes.size());
  PoolLayout l = p.layout;
  EXPECT_EQ(LayoutError(l, 8, 2, n - 1),
            "host_layout reaches past the end of host (" + std::to_string(n - 1) + " bytes there)");
  EXPECT_EQ(LayoutError(l, 0, 2, n), "row_bytes and layers must be >= 1");
  EXPECT_EQ(LayoutError(l, 8, 0, n), "row_bytes and layers must be >= 1");
  l.sides = 3;
  EXPECT_EQ(LayoutError(l, 8, 2, n), "host_layout must have 1 or 2 sides, got 3");
  l = p.layout;
  l.page_size = 0;
  EXPECT_NE(LayoutError(l, 8, 2, n).find("page size < 1"), std::string::npos);
  l = p.layout;
  l.row_stride = -8;
  EXPECT_NE(LayoutError(l, 8, 2, n).find("negative stride"), std::string::npos);
  l = p.layout;
  l.num_slots = (int64_t{1} << 31) + 1;
  EXPECT_EQ(LayoutError(l, 8, 2, n), "host_layout has more slots than int32 can name");
  l = p.layout;
  l.num_slots = 0;  // names no row: fits in no bytes at all
  EXPECT_EQ(LayoutError(l, 8, 2, 0), "");
}

// Strides whose products overflow int64 must not wrap around into "fits".
TEST(PoolLayoutCheckTest, HugeStridesDoNotOverflowIntoAFit) {
  Pool p(Kind::kLayerFirst, 2, 2, 2, 8);
  const int64_t n = static_cast<int64_t>(p.bytes.size());
  for (int64_t PoolLayout::*stride : {&PoolLayout::side_stride, &PoolLayout::layer_stride,
                                      &PoolLayout::page_stride, &PoolLayout::row_stride}) {
    PoolLayout l = p.layout;
    l.*stride = INT64_MAX;
    EXPECT_NE(LayoutError(l, 8, 2, n), "");
    l.*stride = INT64_MAX / 2 + 1;  // times 2 wraps to INT64_MIN in 64 bits
    EXPECT_NE(LayoutError(l, 8, 2, n), "");
  }
  PoolLayout l = p.layout;
  l.num_slots = int64_t{1} << 31;
  l.page_size = 1;
  l.page_stride = INT64_MAX / ((int64_t{1} << 31) - 1) + 1;
  EXPECT_NE(LayoutError(l, 8, 2, n), "");
}

}  // namespace
}  // namespace radixkv
