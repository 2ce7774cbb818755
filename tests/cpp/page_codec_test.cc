#include "radixkv/page_codec.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "radixkv/transfer.h"

namespace radixkv {
namespace {

TEST(PageCodecTest, EveryFloat8CodeDecodesToTheValueThatEncodesBackToIt) {
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<uint8_t>(c);
    const float x = Float8E4M3ToFloat(code);
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(x)) << c;
      continue;
    }
    EXPECT_EQ(Float8FromFloat(x, Float8Format::kE4M3Fn), code) << c;
  }
  EXPECT_EQ(Float8E4M3ToFloat(0x7E), 448.0f);
  EXPECT_EQ(Float8E4M3ToFloat(0x01), 0.001953125f);  // the smallest subnormal, 2^-9
  EXPECT_EQ(Float8E4M3ToFloat(0x38), 1.0f);
}

TEST(PageCodecTest, EveryHalfAndBFloat16ComesBackFromItsFloat) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const auto bits = static_cast<uint16_t>(h);
    const float x = HalfToFloat(bits);
    if (std::isnan(x)) {
      EXPECT_EQ(HalfFromFloat(x) & 0x7E00u, 0x7E00u);
    } else {
      EXPECT_EQ(HalfFromFloat(x), bits) << h;
    }
    const float y = BFloat16ToFloat(bits);
    if (!std::isnan(y)) EXPECT_EQ(BFloat16FromFloat(y), bits) << h;
  }
}

TEST(PageCodecTest, HalfRoundsToNearestTiesToEven) {
  EXPECT_EQ(HalfFromFloat(65504.0f), 0x7BFFu);
  EXPECT_EQ(HalfFromFloat(65519.99f), 0x7BFFu);
  EXPECT_EQ(HalfFromFloat(65520.0f), 0x7C00u);               // the tie rounds up to infinity
  EXPECT_EQ(HalfFromFloat(1.0f + 1.0f / 2048), 0x3C00u);     // a tie: to the even 1.0
  EXPECT_EQ(HalfFromFloat(1.0f + 3.0f / 2048), 0x3C02u);     // a tie: to the even 1 + 2/1024
  EXPECT_EQ(HalfFromFloat(std::ldexp(1.0f, -25)), 0x0000u);  // half the smallest: to 0
  EXPECT_EQ(HalfFromFloat(std::ldexp(1.5f, -25)), 0x0001u);
  EXPECT_EQ(HalfFromFloat(-std::ldexp(3.0f, -25)), 0x8002u);  // 1.5 units: to even 2
}

TEST(PageCodecTest, APageComesBackWithinHalfAStepOfItsHeadsScale) {
  PageCodecShape s{4, 16, 3, 8, SourceFloat::kFloat32, 20};
  std::vector<float> kv(static_cast<size_t>(s.planes * s.rows * s.heads * s.head_dim));
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (size_t i = 0; i < kv.size(); ++i) kv[i] = normal(rng) * static_cast<float>(1 + i % 3);
  std::vector<char> page(static_cast<size_t>(RawPageBytes(s)));
  std::memcpy(page.data(), kv.data(), kv.size() * 4);
  for (int i = 0; i < 20; ++i) page[kv.size() * 4 + i] = static_cast<char>(i * 7);
  std::vector<char> packed(static_cast<size_t>(Float8PageBytes(s)));
  ASSERT_EQ(packed.size(), static_cast<size_t>(4 * 3 * 4 + kv.size() + 20));
  EncodeFloat8Page(page.data(), s, packed.data());
  std::vector<char> back(page.size(), 0);
  DecodeFloat8Page(packed.data(), s, back.data());
  EXPECT_EQ(std::memcmp(back.data() + kv.size() * 4, page.data() + kv.size() * 4, 20), 0);
  const float* got = reinterpret_cast<const float*>(back.data());
  for (int64_t p = 0; p < s.planes; ++p) {
    for (int64_t h = 0; h < s.heads; ++h) {
      float amax = 0.0f;
      for (int64_t r = 0; r < s.rows; ++r) {
        for (int64_t d = 0; d < s.head_dim; ++d) {
          const int64_t i = ((p * s.rows + r) * s.heads + h) * s.head_dim + d;
          amax = std::max(amax, std::fabs(kv[static_cast<size_t>(i)]));
        }
      }
      for (int64_t r = 0; r < s.rows; ++r) {
        for (int64_t d = 0; d < s.head_dim; ++d) {
          const auto i = static_cast<size_t>(((p * s.rows + r) * s.heads + h) * s.head_dim + d);
          // e4m3 keeps 4 significant bits: half a step is 1/16 of the value,
          // and at least half the smallest step (2^-10 of the scale's 448).
          const float bound = std::max(std::fabs(kv[i]) / 16, amax / 448 * 0.001953125f);
          EXPECT_LE(std::fabs(got[i] - kv[i]), bound * 1.0001f) << p << " " << h;
        }
      }
    }
  }
}

TEST(PageCodecTest, AHeadTooSmallForItsScaleStillDecodesItsZerosAsZeros) {
  PageCodecShape s{1, 1, 1, 4, SourceFloat::kFloat32, 0};
  const float in[4] = {0.0f, 1e-43f, -0.0f, 0.0f};
  std::vector<char> packed(static_cast<size_t>(Float8PageBytes(s)));
  EncodeFloat8Page(in, s, packed.data());
  float out[4];
  DecodeFloat8Page(packed.data(), s, out);
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_NEAR(out[1], 1e-43f, 1e-44f);
  EXPECT_EQ(out[2], 0.0f);
  EXPECT_TRUE(std::signbit(out[2]));
}

TEST(PageCodecTest, ZerosInfinitiesAndNaNs) {
  PageCodecShape s{1, 2, 1, 2, SourceFloat::kFloat32, 0};
  const float in[4] = {0.0f, INFINITY, -INFINITY, NAN};
  std::vector<char> packed(static_cast<size_t>(Float8PageBytes(s)));
  EncodeFloat8Page(in, s, packed.data());
  float scale;
  std::memcpy(&scale, packed.data(), 4);
  EXPECT_EQ(scale, 1.0f);  // no finite magnitude above 0
  float out[4];
  DecodeFloat8Page(packed.data(), s, out);
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_EQ(out[1], 448.0f);  // an infinity saturates
  EXPECT_EQ(out[2], -448.0f);
  EXPECT_TRUE(std::isnan(out[3]));
}

// A float8 host pool of `pages` pages in the codec's page format, behind a
// LayerFirst device pool of float32 rows: a backup encodes exactly what
// EncodeFloat8Page makes of the same page, a load decodes it back as
// DecodeFloat8Page does, and a copy of anything but whole pages does nothing.
struct EncodedPools {
  static constexpr int64_t kSides = 2, kLayers = 2, kRows = 4, kHeads = 2, kDim = 4, kPages = 4;
  static constexpr int64_t kRow = kHeads * kDim;
  static constexpr int64_t kScales = kSides * kLayers * kHeads * 4;
  static constexpr int64_t kPage = kScales + kSides * kLayers * kRows * kRow;
  std::vector<float> device = std::vector<float>(kSides * kLayers * kPages * kRows * kRow);
  std::vector<char> host = std::vector<char>(kPages * kPage);
  TransferParams params{};
  Float8Pool codes{};

  EncodedPools() {
    std::mt19937 rng(11);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (size_t i = 0; i < device.size(); ++i) device[i] = normal(rng) * (i % 7 == 0 ? 50 : 1);
    PoolLayout dev{reinterpret_cast<char*>(device.data()),
                   kLayers * kPages * kRows * kRow * 4,
                   kPages * kRows * kRow * 4,
                   kRows * kRow * 4,
                   kRow * 4,
                   kRows,
                   kPages * kRows,
                   kSides};
    PoolLayout packed{host.data() + kScales,
                      kLayers * kRows * kRow,
                      kRows * kRow,
                      kPage,
                      kRow,
                      kRows,
                      kPages * kRows,
                      kSides};
    codes = {SourceFloat::kFloat32, kHeads, kDim,
             PoolLayout{host.data(), kLayers * kHeads * 4, kHeads * 4, kPage, 0, kRows,
                        kPages * kRows, kSides}};
    params = {dev, packed, kRow * 4, kLayers, nullptr, nullptr, 0, 0, kLayers};
  }
  // Device page `p` as the plain page the codec takes: (side, layer) planes.
  std::vector<char> PlainPage(int64_t p) const {
    std::vector<char> out(static_cast<size_t>(kSides * kLayers * kRows * kRow * 4));
    for (int64_t side = 0; side < kSides; ++side) {
      for (int64_t layer = 0; layer < kLayers; ++layer) {
        const float* rows = device.data() + ((side * kLayers + layer) * kPages + p) * kRows * kRow;
        std::memcpy(out.data() + (side * kLayers + layer) * kRows * kRow * 4, rows,
                    static_cast<size_t>(kRows * kRow * 4));
      }
    }
    return out;
  }
  PageCodecShape Shape() const {
    return {kSides * kLayers, kRows, kHeads, kDim, SourceFloat::kFloat32, 0};
  }
};

std::vector<int32_t> PageSlots(std::initializer_list<int32_t> pages, int64_t rows) {
  std::vector<int32_t> out;
  for (int32_t p : pages) {
    for (int64_t r = 0; r < rows; ++r) out.push_back(static_cast<int32_t>(p * rows + r));
  }
  return out;
}

TEST(PageCodecTest, ABackupEncodesWhatTheStorageCodecWritesAndALoadDecodesIt) {
  EncodedPools t;
  const int64_t S = EncodedPools::kRows;
  std::vector<int32_t> src = PageSlots({2, 0}, S), dst = PageSlots({1, 3}, S);
  TransferParams p = t.params;
  p.src_slots = src.data();
  p.dst_slots = dst.data();
  p.num_tokens = static_cast<int64_t>(src.size());
  ASSERT_EQ(EncodeTransfer(p, t.codes), -1);
  const PageCodecShape shape = t.Shape();
  ASSERT_EQ(Float8PageBytes(shape), EncodedPools::kPage);
  const std::pair<int64_t, int64_t> moved[] = {{2, 1}, {0, 3}};
  for (const auto& [from, to] : moved) {
    std::vector<char> want(static_cast<size_t>(EncodedPools::kPage));
    EncodeFloat8Page(t.PlainPage(from).data(), shape, want.data());
    EXPECT_EQ(0, std::memcmp(want.data(), t.host.data() + to * EncodedPools::kPage, want.size()))
        << "device page " << from;
  }
  // Load host page 1 into device page 3, layer 1 only, then every layer.
  const std::vector<float> before = t.device;
  std::vector<int32_t> host_slots = PageSlots({1}, S), dev_slots = PageSlots({3}, S);
  TransferParams load{t.params.dst,
                      t.params.src,
                      t.params.row_bytes,
                      EncodedPools::kLayers,
                      host_slots.data(),
                      dev_slots.data(),
                      S,
                      1,
                      2};
  ASSERT_EQ(DecodeTransfer(load, t.codes), -1);
  std::vector<char> decoded(static_cast<size_t>(RawPageBytes(shape)));
  DecodeFloat8Page(t.host.data() + EncodedPools::kPage, shape, decoded.data());
  const std::vector<char> got = t.PlainPage(3), was = [&] {
    EncodedPools old;
    old.device = before;
    return old.PlainPage(3);
  }();
  const size_t plane = static_cast<size_t>(S * EncodedPools::kRow * 4);
  for (int64_t side = 0; side < 2; ++side) {
    for (int64_t layer = 0; layer < 2; ++layer) {
      const size_t at = static_cast<size_t>(side * 2 + layer) * plane;
      const std::vector<char>& want = layer == 1 ? decoded : was;
      EXPECT_EQ(0, std::memcmp(got.data() + at, want.data() + at, plane)) << side << layer;
    }
  }
  load.layer_begin = 0;
  ASSERT_EQ(DecodeTransfer(load, t.codes), -1);
  EXPECT_EQ(t.PlainPage(3), decoded);
}

TEST(PageCodecTest, ACopyOfPartOfAPageOrOutOfRangeWritesNothing) {
  EncodedPools t;
  const int64_t S = EncodedPools::kRows;
  const std::vector<char> host = t.host;
  const std::vector<std::pair<std::vector<int32_t>, std::vector<int32_t>>> bad = {
      {{1, 2, 3, 4}, {0, 1, 2, 3}},            // the source does not start a page
      {PageSlots({0}, S), {4, 5, 6, 7}},       // fine
      {{0, 1, 2}, {0, 1, 2}},                  // three rows of a page of four
      {{0, 1, 3, 2}, {0, 1, 2, 3}},            // out of order
      {PageSlots({0}, S), PageSlots({4}, S)},  // past the host pool
  };
  const int64_t expect[] = {0, -1, 0, 0, 0};
  for (size_t i = 0; i < bad.size(); ++i) {
    TransferParams p = t.params;
    p.src_slots = bad[i].first.data();
    p.dst_slots = bad[i].second.data();
    p.num_tokens = static_cast<int64_t>(bad[i].first.size());
    t.host = host;
    p.dst.base = t.host.data() + EncodedPools::kScales;
    Float8Pool codes = t.codes;
    codes.scales.base = t.host.data();
    EXPECT_EQ(EncodeTransfer(p, codes), expect[i]) << i;
    if (expect[i] >= 0) EXPECT_EQ(t.host, host) << i;
  }
}

}  // namespace
}  // namespace radixkv
