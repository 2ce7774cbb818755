#include "radixkv/page_hash.h"

#include <openssl/evp.h>

#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace radixkv {
namespace {

static_assert(sizeof(int32_t) == 4, "tokens are hashed as 4-byte words");

bool LittleEndian() {
  const uint32_t one = 1;
  unsigned char first;
  std::memcpy(&first, &one, 1);
  return first == 1;
}

struct CtxFree {
  void operator()(EVP_MD_CTX* c) const { EVP_MD_CTX_free(c); }
};

}  // namespace

void PageKeys(const int32_t* tokens, int64_t n, int64_t page_size, const uint8_t* seed,
              uint8_t* out) {
  if (n < 0 || page_size < 1) {
    throw std::invalid_argument("PageKeys needs n >= 0 and page_size >= 1");
  }
  const int64_t pages = n / page_size;
  if (pages == 0) return;
  // One context initialised once, copied per page: a fresh EVP_DigestInit_ex
  // per page costs more than the hash of a small page.
  std::unique_ptr<EVP_MD_CTX, CtxFree> base(EVP_MD_CTX_new()), ctx(EVP_MD_CTX_new());
  const EVP_MD* sha256 = EVP_sha256();
  if (!base || !ctx || sha256 == nullptr || EVP_DigestInit_ex(base.get(), sha256, nullptr) != 1) {
    throw std::runtime_error("libcrypto: no SHA-256 context");
  }
  const bool little = LittleEndian();
  std::vector<uint32_t> swapped(little ? 0 : static_cast<size_t>(page_size));
  const uint8_t* prior = seed;
  for (int64_t p = 0; p < pages; ++p) {
    const int32_t* page = tokens + p * page_size;
    const void* bytes = page;
    if (!little) {  // the key is defined over little-endian words
      for (int64_t i = 0; i < page_size; ++i) {
        const auto v = static_cast<uint32_t>(page[i]);
        swapped[i] = (v >> 24) | ((v >> 8) & 0xff00u) | ((v << 8) & 0xff0000u) | (v << 24);
      }
      bytes = swapped.data();
    }
    uint8_t* key = out + p * kPageKeyBytes;
    unsigned int len = 0;
    if (EVP_MD_CTX_copy_ex(ctx.get(), base.get()) != 1 ||
        (prior != nullptr && EVP_DigestUpdate(ctx.get(), prior, kPageKeyBytes) != 1) ||
        EVP_DigestUpdate(ctx.get(), bytes, static_cast<size_t>(page_size) * 4) != 1 ||
        EVP_DigestFinal_ex(ctx.get(), key, &len) != 1 || len != kPageKeyBytes) {
      throw std::runtime_error("libcrypto: SHA-256 failed");
    }
    prior = key;
  }
}

void HmacSha256(const uint8_t* key, size_t key_len, const ByteSpan* parts, size_t n_parts,
                uint8_t* out) {
  constexpr size_t kBlock = 64;  // SHA-256's block
  uint8_t block[kBlock] = {};
  std::unique_ptr<EVP_MD_CTX, CtxFree> ctx(EVP_MD_CTX_new());
  const EVP_MD* sha256 = EVP_sha256();
  if (!ctx || sha256 == nullptr) throw std::runtime_error("libcrypto: no SHA-256 context");
  unsigned int len = 0;
  if (key_len > kBlock) {  // a long key is hashed first
    if (EVP_DigestInit_ex(ctx.get(), sha256, nullptr) != 1 ||
        EVP_DigestUpdate(ctx.get(), key, key_len) != 1 ||
        EVP_DigestFinal_ex(ctx.get(), block, &len) != 1) {
      throw std::runtime_error("libcrypto: SHA-256 failed");
    }
  } else if (key_len > 0) {
    std::memcpy(block, key, key_len);
  }
  uint8_t pad[kBlock], inner[kPageKeyBytes];
  for (size_t i = 0; i < kBlock; ++i) pad[i] = block[i] ^ 0x36;
  bool ok = EVP_DigestInit_ex(ctx.get(), sha256, nullptr) == 1 &&
            EVP_DigestUpdate(ctx.get(), pad, kBlock) == 1;
  for (size_t p = 0; ok && p < n_parts; ++p) {
    ok = parts[p].size == 0 || EVP_DigestUpdate(ctx.get(), parts[p].data, parts[p].size) == 1;
  }
  ok = ok && EVP_DigestFinal_ex(ctx.get(), inner, &len) == 1;
  for (size_t i = 0; i < kBlock; ++i) pad[i] = block[i] ^ 0x5c;
  ok = ok && EVP_DigestInit_ex(ctx.get(), sha256, nullptr) == 1 &&
       EVP_DigestUpdate(ctx.get(), pad, kBlock) == 1 &&
       EVP_DigestUpdate(ctx.get(), inner, sizeof(inner)) == 1 &&
       EVP_DigestFinal_ex(ctx.get(), out, &len) == 1;
  if (!ok) throw std::runtime_error("libcrypto: SHA-256 failed");
}

void KeyPageKeys(const uint8_t* keys, int64_t n, const uint8_t* secret, uint8_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    const ByteSpan part{keys + i * kPageKeyBytes, static_cast<size_t>(kPageKeyBytes)};
    HmacSha256(secret, kPageKeyBytes, &part, 1, out + i * kPageKeyBytes);
  }
}

}  // namespace radixkv
