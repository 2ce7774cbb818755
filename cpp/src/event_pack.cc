#include "radixkv/event_pack.h"

#include <cstring>

namespace radixkv {
namespace {

// The encoders write at a pointer with room for 9 bytes and return the end:
// the long arrays of an event are written into a string grown once, which
// costs less than appending to it a byte at a time.

// `v`'s low `bytes` bytes, big-endian, after the type byte `tag`.
char* PutBig(char* p, unsigned tag, uint64_t v, int bytes) {
  *p++ = static_cast<char>(tag);
  for (int i = bytes - 1; i >= 0; --i) *p++ = static_cast<char>((v >> (8 * i)) & 0xff);
  return p;
}

char* PutUint(char* p, uint64_t v) {
  if (v < 0x80) {
    *p = static_cast<char>(v);
    return p + 1;
  }
  if (v <= 0xff) return PutBig(p, 0xcc, v, 1);
  if (v <= 0xffff) return PutBig(p, 0xcd, v, 2);
  if (v <= 0xffffffffull) return PutBig(p, 0xce, v, 4);
  return PutBig(p, 0xcf, v, 8);
}

char* PutInt(char* p, int64_t v) {
  if (v >= 0) return PutUint(p, static_cast<uint64_t>(v));
  const auto u = static_cast<uint64_t>(v);
  if (v >= -32) {
    *p = static_cast<char>(u & 0xff);
    return p + 1;
  }
  if (v >= -128) return PutBig(p, 0xd0, u, 1);
  if (v >= -32768) return PutBig(p, 0xd1, u, 2);
  if (v >= INT32_MIN) return PutBig(p, 0xd2, u, 4);
  return PutBig(p, 0xd3, u, 8);
}

void Byte(std::string* out, unsigned v) { out->push_back(static_cast<char>(v & 0xff)); }

void Big(std::string* out, unsigned tag, uint64_t v, int bytes) {
  char buf[9];
  out->append(buf, static_cast<size_t>(PutBig(buf, tag, v, bytes) - buf));
}

// Appends `n` values read by `at(i)` and written by `put`: the string grows
// once to the worst case (9 bytes a value) and is cut back after.
template <typename Put, typename At>
void PutAll(std::string* out, int64_t n, Put put, At at) {
  const size_t used = out->size();
  out->resize(used + 9 * static_cast<size_t>(n));
  char* const begin = out->data() + used;
  char* p = begin;
  for (int64_t i = 0; i < n; ++i) p = put(p, at(i));
  out->resize(used + static_cast<size_t>(p - begin));
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
  PutAll(out, hashes.n, PutUint, [&](int64_t i) { return hashes[i]; });
}

}  // namespace

void PackUint(std::string* out, uint64_t v) {
  char buf[9];
  out->append(buf, static_cast<size_t>(PutUint(buf, v) - buf));
}

void PackInt(std::string* out, int64_t v) {
  char buf[9];
  out->append(buf, static_cast<size_t>(PutInt(buf, v) - buf));
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
  // Room for PutAll's worst case (9 bytes a value), so nothing moves.
  out->reserve(out->size() + 64 + 9 * static_cast<size_t>(hashes.n) +
               9 * static_cast<size_t>(token_ids.n));
  PackArrayHeader(out, 7);
  PackStr(out, "BlockStored");
  PackHashes(out, hashes);
  if (parent) {
    PackUint(out, *parent);
  } else {
    PackNil(out);
  }
  PackArrayHeader(out, static_cast<uint64_t>(token_ids.n));
  PutAll(out, token_ids.n, PutInt, [&](int64_t i) { return int64_t{token_ids[i]}; });
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
