// The storage tier's page keys against fixed vectors computed with Python's
// hashlib (sha256 of the prior key, then the page's tokens as little-endian
// uint32), with and without a seed.
#include "radixkv/page_hash.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

namespace radixkv {
namespace {

std::vector<std::string> Keys(const std::vector<int32_t>& tokens, int64_t page,
                              const uint8_t* seed = nullptr) {
  const int64_t pages = page > 0 ? static_cast<int64_t>(tokens.size()) / page : 0;
  std::vector<uint8_t> raw(static_cast<size_t>(pages * kPageKeyBytes));
  PageKeys(tokens.data(), static_cast<int64_t>(tokens.size()), page, seed, raw.data());
  std::vector<std::string> hex;
  for (int64_t p = 0; p < pages; ++p) {
    std::string s;
    char buf[3];
    for (int64_t i = 0; i < kPageKeyBytes; ++i) {
      std::snprintf(buf, sizeof(buf), "%02x", raw[p * kPageKeyBytes + i]);
      s += buf;
    }
    hex.push_back(s);
  }
  return hex;
}

TEST(PageHashTest, ChainWithoutSeedIsSGLangsPageHash) {
  std::vector<int32_t> t(8);
  std::iota(t.begin(), t.end(), 0);
  EXPECT_EQ(Keys(t, 4), (std::vector<std::string>{
                            "baed642339816affb3fe8719792d0e4ce82f12db72b7373d244eaa65445800fe",
                            "01414b052706d93bd0f1f1646c0e8ca2fa8ef5efd7bcc99f7a1cee8eb11ad052"}));
}

TEST(PageHashTest, SeedStartsTheChainAndPartialPagesHaveNoKey) {
  std::vector<int32_t> t(8);
  std::iota(t.begin(), t.end(), 0);
  t.push_back(9);  // a partial page: no key
  uint8_t seed[32];
  std::iota(seed, seed + 32, 0);
  EXPECT_EQ(Keys(t, 4, seed),
            (std::vector<std::string>{
                "9042001fd4171e3d07043769dcd26fa03685417d40e036b1159ed596b228f8d4",
                "6e5714262436e6f2b2ba5743f51d6aa8a5c40ebbc84e3e15ec7138e9a046e64b"}));
}

TEST(PageHashTest, TokensAreUnsignedWordsPageOne) {
  EXPECT_EQ(Keys({100000, -1, 7}, 1),
            (std::vector<std::string>{
                "1fce70c028536c62aaa3e70132da38a719f84da916015c1fb278f3dba0587176",
                "e881c1efecb136fddc8a34195caa543e1ce79262e304e46297b7218dd048fdd7",
                "ba79d0d71536eca08b9fa73976e0c5dd2d7f6a3ecaeae4ed1a4983d11ffe70d2"}));
}

TEST(PageHashTest, AKeyDependsOnEveryEarlierPage) {
  std::vector<int32_t> a(64), b(64);
  std::iota(a.begin(), a.end(), 0);
  b = a;
  b[3] = 99;  // page 0 differs; pages 1.. are equal token for token
  const auto ka = Keys(a, 16), kb = Keys(b, 16);
  for (size_t p = 0; p < ka.size(); ++p) EXPECT_NE(ka[p], kb[p]) << p;
  EXPECT_THROW(Keys(a, 0), std::invalid_argument);
  EXPECT_TRUE(Keys({1, 2, 3}, 4).empty());
}

std::string Hex(const uint8_t* bytes, size_t n) {
  std::string s;
  char buf[3];
  for (size_t i = 0; i < n; ++i) {
    std::snprintf(buf, sizeof(buf), "%02x", bytes[i]);
    s += buf;
  }
  return s;
}

// RFC 4231's test cases 1 (a short key) and 6 (a key longer than a block),
// and a message in two parts: the same as in one.
TEST(PageHashTest, HmacSha256MatchesRfc4231) {
  uint8_t out[32];
  const std::vector<uint8_t> short_key(20, 0x0b), long_key(131, 0xaa);
  const std::string hi = "Hi There";
  const ByteSpan one{hi.data(), hi.size()};
  HmacSha256(short_key.data(), short_key.size(), &one, 1, out);
  EXPECT_EQ(Hex(out, 32), "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  const std::string a = "Test Using Larger Than Block-Siz", b = "e Key - Hash Key First";
  const ByteSpan two[] = {{a.data(), a.size()}, {b.data(), b.size()}};
  HmacSha256(long_key.data(), long_key.size(), two, 2, out);
  EXPECT_EQ(Hex(out, 32), "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
}

// Keyed page keys are HMAC-SHA-256(secret, key) each, computed in place.
TEST(PageHashTest, KeyedPageKeysAreEachKeysHmac) {
  std::vector<uint8_t> secret(32), keys(64);
  std::iota(secret.begin(), secret.end(), 0);
  std::iota(keys.begin(), keys.end(), 0);
  KeyPageKeys(keys.data(), 2, secret.data(), keys.data());
  EXPECT_EQ(Hex(keys.data(), 32),
            "e8499be4f1980d68f13222a418df5cbd97d53fddf590c2108e22d40005b70713");
  EXPECT_EQ(Hex(keys.data() + 32, 32),
            "62215de7bddcea7e2c4047ff6bb94f8d18262fc8b3f3648134bb7d44158ff84d");
}

}  // namespace
}  // namespace radixkv
