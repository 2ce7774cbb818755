// radixkv's own SHA-256 (cpp/src/sha256.h): FIPS 180-4's examples, a message
// in any split giving one digest, and the portable compression agreeing with
// the one this CPU runs (its SHA instructions where it has them). The Python
// tests compare messages of every length to 160 bytes with hashlib and hmac.
#include "sha256.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace radixkv {
namespace {

std::string Digest(const std::string& message) {
  Sha256 h;
  h.Update(message.data(), message.size());
  uint8_t out[32];
  h.Final(out);
  std::string hex;
  char buf[3];
  for (uint8_t b : out) {
    std::snprintf(buf, sizeof(buf), "%02x", b);
    hex += buf;
  }
  return hex;
}

TEST(Sha256Test, FipsExamples) {
  EXPECT_EQ(Digest(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(Digest("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(Digest("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(Digest(std::string(1000000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256Test, EveryPaddingCase) {  // (hashlib's digests of n 'a's)
  const std::pair<size_t, const char*> cases[] = {
      {55, "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318"},  // 0x80 at 55
      {56, "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a"},  // a block more
      {63, "7d3e74a05d7db15bce4ad9ec0658ea98e3f06eeecf16b4c6fff2da457ddc2f34"},
      {64, "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb"},
      {119, "31eba51c313a5c08226adf18d4a359cfdfd8d2e816b13f4af952f7ea6584dcfb"},
      {120, "2f3d335432c70b580af0e8e1b3674a7c020d683aa5f73aaaedfdc55af904c21c"}};
  for (const auto& [n, digest] : cases) EXPECT_EQ(Digest(std::string(n, 'a')), digest) << n;
}

TEST(Sha256Test, AnySplitOfTheMessageGivesOneDigest) {
  std::mt19937 rng(3);
  std::string message(300, '\0');
  for (char& c : message) c = static_cast<char>(rng());
  for (size_t len : {0, 1, 55, 56, 63, 64, 65, 119, 120, 128, 300}) {
    const std::string m = message.substr(0, len);
    for (int trial = 0; trial < 20; ++trial) {
      Sha256 h;
      size_t at = 0;
      while (at < len) {
        const size_t take = std::min(len - at, static_cast<size_t>(rng() % 70));
        h.Update(m.data() + at, take);  // pieces of 0 bytes too
        at += take;
      }
      uint8_t out[32];
      h.Final(out);
      Sha256 whole;
      whole.Update(m.data(), len);
      uint8_t want[32];
      whole.Final(want);
      EXPECT_EQ(std::memcmp(out, want, 32), 0) << len;
    }
  }
}

TEST(Sha256Test, PortableCompressionAgreesWithTheOneInUse) {
  std::mt19937 rng(11);
  std::vector<uint8_t> blocks(64 * 9);
  for (int trial = 0; trial < 50; ++trial) {
    for (auto& b : blocks) b = static_cast<uint8_t>(rng());
    const size_t n = 1 + trial % 9;
    // A whole-block message through the class (whatever it runs on) ...
    Sha256 h;
    h.Update(blocks.data(), 64 * n);
    uint8_t out[32];
    h.Final(out);
    // ... and through the portable function with the padding block by hand.
    uint32_t state[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                         0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    Sha256CompressPortable(state, blocks.data(), n);
    uint8_t pad[64] = {0x80};
    const uint64_t bits = 512ull * n;
    for (int i = 0; i < 8; ++i) pad[56 + i] = static_cast<uint8_t>(bits >> (56 - 8 * i));
    Sha256CompressPortable(state, pad, 1);
    uint8_t want[32];
    for (int i = 0; i < 8; ++i) {
      for (int j = 0; j < 4; ++j) want[4 * i + j] = static_cast<uint8_t>(state[i] >> (24 - 8 * j));
    }
    EXPECT_EQ(std::memcmp(out, want, 32), 0) << "blocks " << n;
  }
  std::printf("SHA instructions in use: %s\n", Sha256::Accelerated() ? "yes" : "no");
}

}  // namespace
}  // namespace radixkv
