#include "radixkv/event_pack.h"

#include <cstring>

namespace radixkv {
namespace {

void Byte(std::string* out, unsigned v) { out->push_back(static_cast<char>(v & 0xff)); }

// `v`'s low `bytes` bytes, big-endian, after the type byte `tag`.
void Big(std::string* out, unsigned tag, uint64_t v, int bytes) {
  char buf[9];
  buf[0] = static_cast<char>(tag);
  for (int i = 0; i < bytes; ++i)
    buf[1 + i] = static_cast<char>((v >> (8 * (bytes - 1 - i))) & 0xff);
  out->append(buf, static_cast<size_t>(bytes) + 1);
}

void PackMedium(std::string* out, std::optional<std::string_view> medium) {
  if (medium) {
    PackStr(out, *medium);
  } else {
    PackNil(out);
  }
}

void PackHashes(std::string* out, Strided<uint64_t> hashes) {
  PackArrayHeader(out, static_cast<uint64_t>(hashes.n));
  for (int64_t i = 0; i < hashes.n; ++i) PackUint(out, hashes[i]);
}

}  // namespace

void PackUint(std::string* out, uint64_t v) {
  if (v < 0x80) {
    Byte(out, static_cast<unsigned>(v));
  } else if (v <= 0xff) {
    Big(out, 0xcc, v, 1);
  } else if (v <= 0xffff) {
    Big(out, 0xcd, v, 2);
  } else if (v <= 0xffffffffull) {
    Big(out, 0xce, v, 4);
  } else {
    Big(out, 0xcf, v, 8);
  }
}

void PackInt(std::string* out, int64_t v) {
  if (v >= 0) return PackUint(out, static_cast<uint64_t>(v));
  const auto u = static_cast<uint64_t>(v);
  if (v >= -32) {
    Byte(out, static_cast<unsigned>(u));
  } else if (v >= -128) {
    Big(out, 0xd0, u, 1);
  } else if (v >= -32768) {
    Big(out, 0xd1, u, 2);
  } else if (v >= INT32_MIN) {
    Big(out, 0xd2, u, 4);
  } else {
    Big(out, 0xd3, u, 8);
  }
}

void PackNil(std::string* out) { Byte(out, 0xc0); }

void PackDouble(std::string* out, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  Big(out, 0xcb, bits, 8);
}

void PackStr(std::string* out, std::string_view s) {
  const uint64_t n = s.size();
  if (n < 32) {
    Byte(out, 0xa0 | static_cast<unsigned>(n));
  } else if (n <= 0xff) {
    Big(out, 0xd9, n, 1);
  } else if (n <= 0xffff) {
    Big(out, 0xda, n, 2);
  } else {
    Big(out, 0xdb, n, 4);
  }
  out->append(s.data(), s.size());
}

void PackArrayHeader(std::string* out, uint64_t n) {
  if (n < 16) {
    Byte(out, 0x90 | static_cast<unsigned>(n));
  } else if (n <= 0xffff) {
    Big(out, 0xdc, n, 2);
  } else {
    Big(out, 0xdd, n, 4);
  }
}

void PackBlockStored(std::string* out, Strided<uint64_t> hashes, std::optional<uint64_t> parent,
                     Strided<int32_t> token_ids, int64_t block_size, std::optional<int64_t> lora_id,
                     std::optional<std::string_view> medium) {
  // Worst case: 9 bytes a hash, 5 a token.
  out->reserve(out->size() + 64 + 9 * static_cast<size_t>(hashes.n) +
               5 * static_cast<size_t>(token_ids.n));
  PackArrayHeader(out, 7);
  PackStr(out, "BlockStored");
  PackHashes(out, hashes);
  if (parent) {
    PackUint(out, *parent);
  } else {
    PackNil(out);
  }
  PackArrayHeader(out, static_cast<uint64_t>(token_ids.n));
  for (int64_t i = 0; i < token_ids.n; ++i) PackInt(out, token_ids[i]);
  PackInt(out, block_size);
  if (lora_id) {
    PackInt(out, *lora_id);
  } else {
    PackNil(out);
  }
  PackMedium(out, medium);
}

void PackBlockRemoved(std::string* out, Strided<uint64_t> hashes,
                      std::optional<std::string_view> medium) {
  out->reserve(out->size() + 32 + 9 * static_cast<size_t>(hashes.n));
  PackArrayHeader(out, 3);
  PackStr(out, "BlockRemoved");
  PackHashes(out, hashes);
  PackMedium(out, medium);
}

void PackAllBlocksCleared(std::string* out) {
  PackArrayHeader(out, 1);
  PackStr(out, "AllBlocksCleared");
}

}  // namespace radixkv
