#include "radixkv/event_pack.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

namespace radixkv {
namespace {

std::string Bytes(std::initializer_list<unsigned> v) {
  std::string s;
  for (unsigned b : v) s.push_back(static_cast<char>(b));
  return s;
}

TEST(EventPackTest, IntegersTakeTheirSmallestEncoding) {
  const std::vector<std::pair<int64_t, std::string>> cases = {
      {0, Bytes({0x00})},
      {127, Bytes({0x7f})},
      {128, Bytes({0xcc, 0x80})},
      {256, Bytes({0xcd, 0x01, 0x00})},
      {65536, Bytes({0xce, 0x00, 0x01, 0x00, 0x00})},
      {int64_t{1} << 32, Bytes({0xcf, 0, 0, 0, 1, 0, 0, 0, 0})},
      {-1, Bytes({0xff})},
      {-32, Bytes({0xe0})},
      {-33, Bytes({0xd0, 0xdf})},
      {-129, Bytes({0xd1, 0xff, 0x7f})},
      {-32769, Bytes({0xd2, 0xff, 0xff, 0x7f, 0xff})},
      {INT64_MIN, Bytes({0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0})},
  };
  for (const auto& [v, want] : cases) {
    std::string out;
    PackInt(&out, v);
    EXPECT_EQ(out, want) << v;
  }
  std::string out;
  PackUint(&out, UINT64_MAX);
  EXPECT_EQ(out, Bytes({0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}));
}

TEST(EventPackTest, StringsArraysAndFloats) {
  std::string out;
  PackStr(&out, std::string(31, 'a'));
  EXPECT_EQ(static_cast<unsigned char>(out[0]), 0xbf);
  out.clear();
  PackStr(&out, std::string(32, 'a'));
  EXPECT_EQ(out.substr(0, 2), Bytes({0xd9, 32}));
  out.clear();
  PackStr(&out, std::string(256, 'a'));
  EXPECT_EQ(out.substr(0, 3), Bytes({0xda, 0x01, 0x00}));
  out.clear();
  PackArrayHeader(&out, 15);
  PackArrayHeader(&out, 16);
  PackArrayHeader(&out, 65536);
  EXPECT_EQ(out, Bytes({0x9f, 0xdc, 0x00, 0x10, 0xdd, 0x00, 0x01, 0x00, 0x00}));
  out.clear();
  PackDouble(&out, 1.5);
  EXPECT_EQ(out, Bytes({0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0}));
}

TEST(EventPackTest, EventsAreTaggedArraysReadThroughStrides) {
  // Hashes every other element of an array: a strided run.
  const uint64_t raw[] = {1, 99, 300, 99};
  const Strided<uint64_t> hashes{reinterpret_cast<const unsigned char*>(raw), 2,
                                 2 * sizeof(uint64_t)};
  const int32_t tokens[] = {-1, 200};
  const Strided<int32_t> toks{reinterpret_cast<const unsigned char*>(tokens), 2, sizeof(int32_t)};
  std::string out;
  PackBlockStored(&out, hashes, std::nullopt, toks, 2, 7, "GPU");
  std::string want = Bytes({0x97, 0xab});
  want += "BlockStored";
  want += Bytes({0x92, 0x01, 0xcd, 0x01, 0x2c, 0xc0, 0x92, 0xff, 0xcc, 0xc8, 0x02, 0x07, 0xa3});
  want += "GPU";
  EXPECT_EQ(out, want);
  out.clear();
  PackBlockRemoved(&out, hashes, std::nullopt);
  want = Bytes({0x93, 0xac});
  want += "BlockRemoved";
  want += Bytes({0x92, 0x01, 0xcd, 0x01, 0x2c, 0xc0});
  EXPECT_EQ(out, want);
  out.clear();
  PackAllBlocksCleared(&out);
  EXPECT_EQ(out, Bytes({0x91, 0xb0}) + "AllBlocksCleared");
}

}  // namespace
}  // namespace radixkv
