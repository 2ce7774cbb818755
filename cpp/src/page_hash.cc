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
  std::unique_ptr<EVP_MD_CTX, CtxFree> ctx(EVP_MD_CTX_new());
  const EVP_MD* sha256 = EVP_sha256();
  if (!ctx || sha256 == nullptr) throw std::runtime_error("libcrypto: no SHA-256 context");
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
    if (EVP_DigestInit_ex(ctx.get(), sha256, nullptr) != 1 ||
        (prior != nullptr && EVP_DigestUpdate(ctx.get(), prior, kPageKeyBytes) != 1) ||
        EVP_DigestUpdate(ctx.get(), bytes, static_cast<size_t>(page_size) * 4) != 1 ||
        EVP_DigestFinal_ex(ctx.get(), key, &len) != 1 || len != kPageKeyBytes) {
      throw std::runtime_error("libcrypto: SHA-256 failed");
    }
    prior = key;
  }
}

}  // namespace radixkv
