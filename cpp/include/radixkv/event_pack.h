// KV events in msgpack, written natively: the bytes msgpack-python's
// `packb(..., use_bin_type=True)` writes for the same values (the smallest
// integer encoding, None as nil, strings as fixstr/str8/16/32, floats as
// float64), so an event packed here equals radixkv.events.encode_batch's.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace radixkv {

/// Appends the msgpack of a signed integer to `out` (its smallest encoding).
void PackInt(std::string* out, int64_t v);
/// Appends the msgpack of an unsigned integer to `out` (its smallest encoding).
void PackUint(std::string* out, uint64_t v);
/// Appends nil.
void PackNil(std::string* out);
/// Appends a float64 (0xcb, big-endian).
void PackDouble(std::string* out, double v);
/// Appends a UTF-8 string (the caller vouches for its encoding).
void PackStr(std::string* out, std::string_view s);
/// Appends the header of an array of `n` elements; the elements follow.
void PackArrayHeader(std::string* out, uint64_t n);

/// A strided run of `n` values of type T: element i at `data + i * stride`
/// bytes. Borrowed: valid for the call it is given to.
template <typename T>
struct Strided {
  const unsigned char* data = nullptr;
  int64_t n = 0;
  int64_t stride = sizeof(T);
  T operator[](int64_t i) const {
    T v;
    __builtin_memcpy(&v, data + i * stride, sizeof(T));
    return v;
  }
};

/// Appends `["BlockStored", hashes, parent, token_ids, block_size, lora_id,
/// medium]`; an empty optional is nil.
void PackBlockStored(std::string* out, Strided<uint64_t> hashes, std::optional<uint64_t> parent,
                     Strided<int32_t> token_ids, int64_t block_size, std::optional<int64_t> lora_id,
                     std::optional<std::string_view> medium);

/// Appends `["BlockRemoved", hashes, medium]`.
void PackBlockRemoved(std::string* out, Strided<uint64_t> hashes,
                      std::optional<std::string_view> medium);

/// Appends `["AllBlocksCleared"]`.
void PackAllBlocksCleared(std::string* out);

}  // namespace radixkv
