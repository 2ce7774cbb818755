#include "radixkv/page_codec.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

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

}  // namespace
}  // namespace radixkv
