// The storage tier's page keys: one SHA-256 chain over the pages of a token
// sequence, so a page's key names the page and everything before it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace radixkv {

/// Bytes of one page key.
inline constexpr int64_t kPageKeyBytes = 32;

/// Writes the keys of the whole pages of `tokens[0, n)` to `out` (32 bytes
/// each, `n / page_size` of them): key i = SHA256(key i-1 || the tokens of
/// page i as little-endian uint32), where key -1 is `seed` (32 bytes) or, with
/// no seed, nothing (the first page hashes its tokens alone: SGLang's page
/// hash, so a store it wrote can be read). The seed is a fingerprint of what
/// changes the bytes (model, dtype, layout, page size, shard, namespace), so
/// two configurations never share a key. Throws std::invalid_argument for
/// `n < 0` or `page_size < 1`. SHA-256 is radixkv's own (cpp/src/sha256.h):
/// the CPU's SHA instructions where it has them.
void PageKeys(const int32_t* tokens, int64_t n, int64_t page_size, const uint8_t* seed,
              uint8_t* out);

/// A run of bytes, one of the parts a MAC is taken over.
struct ByteSpan {
  const void* data;
  size_t size;
};

/// HMAC-SHA-256 (RFC 2104) under `key[0, key_len)` of the concatenation of
/// `parts[0, n_parts)`; writes 32 bytes to `out`.
void HmacSha256(const uint8_t* key, size_t key_len, const ByteSpan* parts, size_t n_parts,
                uint8_t* out);

/// Keyed page keys: out_i = HMAC-SHA-256(`secret`, keys_i) for `n` keys of
/// 32 bytes (`secret` is 32 bytes). With a deployment secret a store's page
/// names come from this: nobody without the secret can compute one, so a
/// page can be neither planted under a prompt's name nor probed for.
void KeyPageKeys(const uint8_t* keys, int64_t n, const uint8_t* secret, uint8_t* out);

}  // namespace radixkv
