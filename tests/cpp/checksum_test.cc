#include "radixkv/checksum.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

namespace radixkv {
namespace {

TEST(Crc32cTest, KnownValues) {
  const char* digits = "123456789";
  EXPECT_EQ(Crc32c(digits, 9), 0xE3069283u);  // the standard check value
  EXPECT_EQ(Crc32cPortable(digits, 9), 0xE3069283u);
  EXPECT_EQ(Crc32c(digits, 0), 0u);
  std::vector<uint8_t> zeros(32, 0), ones(32, 0xFF);
  EXPECT_EQ(Crc32c(zeros.data(), 32), 0x8A9136AAu);  // RFC 3720, B.4
  EXPECT_EQ(Crc32c(ones.data(), 32), 0x62A8AB43u);
}

TEST(Crc32cTest, HardwareAndTableAgreeAtEveryLengthAndAlignment) {
  std::mt19937 rng(7);
  std::vector<uint8_t> buf(5 * 12288 + 16);  // past the three-stream rounds (12 KiB)
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  for (size_t off = 0; off < 8; ++off) {
    for (size_t n :
         {0, 1, 7, 8, 9, 63, 64, 65, 1000, 4096, 12287, 12288, 12289, 24576 + 100, 5 * 12288}) {
      EXPECT_EQ(Crc32c(buf.data() + off, n), Crc32cPortable(buf.data() + off, n))
          << off << " " << n;
    }
  }
}

TEST(Crc32cTest, ContinuesAcrossPieces) {
  std::vector<uint8_t> buf(1000);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<uint8_t>(i * 31 + 7);
  const uint32_t whole = Crc32c(buf.data(), buf.size());
  for (size_t cut : {0, 1, 13, 500, 999, 1000}) {
    EXPECT_EQ(Crc32c(buf.data() + cut, buf.size() - cut, Crc32c(buf.data(), cut)), whole);
    EXPECT_EQ(Crc32cPortable(buf.data() + cut, buf.size() - cut, Crc32cPortable(buf.data(), cut)),
              whole);
  }
  buf[500] ^= 1;
  EXPECT_NE(Crc32c(buf.data(), buf.size()), whole);
}

}  // namespace
}  // namespace radixkv
