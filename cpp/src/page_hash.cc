#include "radixkv/page_hash.h"

#include <cstring>
#include <stdexcept>
#include <vector>

#include "sha256.h"

namespace radixkv {
namespace {

static_assert(sizeof(int32_t) == 4, "tokens are hashed as 4-byte words");

bool LittleEndian() {
  const uint32_t one = 1;
  unsigned char first;
  std::memcpy(&first, &one, 1);
  return first == 1;
}

constexpr size_t kBlock = 64;  // SHA-256's block

// HMAC's two hashes with the key's padded blocks already taken in (RFC 2104):
// a MAC under one key is then two short hashes from these states.
struct HmacStates {
  Sha256 inner, outer;
  HmacStates(const uint8_t* key, size_t key_len) {
    uint8_t block[kBlock] = {};
    if (key_len > kBlock) {  // a long key is hashed first
      Sha256 h;
      h.Update(key, key_len);
      h.Final(block);
    } else if (key_len > 0) {
      std::memcpy(block, key, key_len);
    }
    uint8_t pad[kBlock];
    for (size_t i = 0; i < kBlock; ++i) pad[i] = block[i] ^ 0x36;
    inner.Update(pad, kBlock);
    for (size_t i = 0; i < kBlock; ++i) pad[i] = block[i] ^ 0x5c;
    outer.Update(pad, kBlock);
  }
  void Mac(const ByteSpan* parts, size_t n_parts, uint8_t* out) const {
    Sha256 in = inner, on = outer;
    for (size_t p = 0; p < n_parts; ++p) in.Update(parts[p].data, parts[p].size);
    uint8_t digest[kPageKeyBytes];
    in.Final(digest);
    on.Update(digest, sizeof(digest));
    on.Final(out);
  }
};

}  // namespace

void PageKeys(const int32_t* tokens, int64_t n, int64_t page_size, const uint8_t* seed,
              uint8_t* out) {
  if (n < 0 || page_size < 1) {
    throw std::invalid_argument("PageKeys needs n >= 0 and page_size >= 1");
  }
  const int64_t pages = n / page_size;
  const bool little = LittleEndian();
  std::vector<uint32_t> swapped(little || pages == 0 ? 0 : static_cast<size_t>(page_size));
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
    Sha256 h;
    if (prior != nullptr) h.Update(prior, kPageKeyBytes);
    h.Update(bytes, static_cast<size_t>(page_size) * 4);
    h.Final(key);
    prior = key;
  }
}

void HmacSha256(const uint8_t* key, size_t key_len, const ByteSpan* parts, size_t n_parts,
                uint8_t* out) {
  HmacStates(key, key_len).Mac(parts, n_parts, out);
}

void KeyPageKeys(const uint8_t* keys, int64_t n, const uint8_t* secret, uint8_t* out) {
  const HmacStates mac(secret, kPageKeyBytes);
  for (int64_t i = 0; i < n; ++i) {
    const ByteSpan part{keys + i * kPageKeyBytes, static_cast<size_t>(kPageKeyBytes)};
    mac.Mac(&part, 1, out + i * kPageKeyBytes);
  }
}

}  // namespace radixkv
