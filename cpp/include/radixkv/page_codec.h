// The float8 page codec: a host page's K/V rows as float8 e4m3fn with one
// float32 scale per (side, layer, head) that travels with the page, and the
// rest of the page (side-buffer rows, padding) as it is. A storage tier with
// the codec writes this in place of the page, in half the bytes or less, and
// reads it back into a host page of the pool's dtype. Lossy: the default is
// no codec.
//
// Everything per element is here, host and device, so the CPU tests check the
// exact conversions a CUDA twin would make; the loops are in page_codec.cc.
#pragma once

#include <cstdint>
#include <cstring>

#include "radixkv/store_index.h"

namespace radixkv {

/// A `page_first` host page: `planes` (sides x layers) of `rows` (tokens) x
/// `heads` x `head_dim` elements of `type` (kFloat32, kFloat16 or kBFloat16),
/// one after the other, then `rest_bytes` bytes kept as they are.
struct PageCodecShape {
  int64_t planes;
  int64_t rows;
  int64_t heads;
  int64_t head_dim;
  SourceFloat type;
  int64_t rest_bytes;
};

/// The largest finite e4m3fn value: a (plane, head)'s scale maps its largest
/// magnitude there.
constexpr float kFloat8E4M3Max = 448.0f;

/// Bytes of a page as the pool holds it.
int64_t RawPageBytes(const PageCodecShape& s) noexcept;

/// Bytes of an encoded page: `planes * heads` float32 scales, one byte per
/// K/V element, then the rest.
int64_t Float8PageBytes(const PageCodecShape& s) noexcept;

/// Encodes `page` (RawPageBytes) into `out` (Float8PageBytes). A (plane,
/// head)'s scale is its largest finite magnitude / 448 in float32 (1 when
/// that is 0, the smallest positive float when the division underflows to
/// 0); each element becomes ScaledFloat8(x, scale, kE4M3Fn), exactly
/// torch's `(x.float() / scale).to(torch.float8_e4m3fn)`: infinities
/// saturate to +-448 * scale, NaN stays NaN. O(page bytes).
void EncodeFloat8Page(const void* page, const PageCodecShape& s, void* out) noexcept;

/// Decodes `in` (Float8PageBytes) into `page` (RawPageBytes): each element is
/// `float(code) * scale` in float32, rounded to the pool's type to nearest,
/// ties to even, exactly torch's `(codes.float() * scale).to(dtype)`.
void DecodeFloat8Page(const void* in, const PageCodecShape& s, void* page) noexcept;

/// The rows of one plane (side and layer) of a page: `rows` rows of `heads`
/// x `head_dim` elements of `type`, `stride` bytes from one row to the next
/// (at least a row's bytes) in the pool that holds them as `type`, and
/// `code_stride` bytes (at least heads x head_dim) where they are codes.
struct CodecRows {
  int64_t rows;
  int64_t heads;
  int64_t head_dim;
  SourceFloat type;
  int64_t stride;
  int64_t code_stride;
};

/// Encodes one plane's rows at `src` into codes at `codes` and `heads`
/// float32 scales at `scales` (unaligned), as EncodeFloat8Page does each
/// plane of a page. O(rows x heads x head_dim).
void EncodeFloat8Rows(const CodecRows& r, const char* src, uint8_t* codes, char* scales) noexcept;

/// Decodes one plane's codes and scales into rows of `r.type` at `dst`, as
/// DecodeFloat8Page does each plane of a page.
void DecodeFloat8Rows(const CodecRows& r, const uint8_t* codes, const char* scales,
                      char* dst) noexcept;

/// The scale of a (plane, head) whose largest finite magnitude has the
/// bits `amax` (0 for none): amax / 448, 1 when amax is 0, the smallest
/// positive float where the division underflows to 0.
RADIXKV_HOST_DEVICE float Float8Scale(uint32_t amax) {
  const float scale = amax != 0 ? BitsFloat(amax) / kFloat8E4M3Max : 1.0f;
  return scale != 0.0f ? scale : BitsFloat(1u);
}

/// `amax` and the magnitude of `x`, whichever is larger, as bits; NaN and
/// infinities leave `amax` as it is (a finite float's magnitude orders as
/// its bits do).
RADIXKV_HOST_DEVICE uint32_t FiniteMax(uint32_t amax, float x) {
  const uint32_t mag = FloatBits(x) & 0x7FFFFFFFu;
  return mag < 0x7F800000u && mag > amax ? mag : amax;
}

/// An e4m3fn code as a float (exact): 0x7F and 0xFF are NaN, there is no
/// infinity, a zero exponent field is subnormal (man * 2^-9).
RADIXKV_HOST_DEVICE float Float8E4M3ToFloat(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t exp = (code >> 3) & 0xFu;
  const uint32_t man = code & 0x7u;
  if ((code & 0x7Fu) == 0x7Fu) return BitsFloat(sign | 0x7FC00000u);
  // A subnormal is man * 2^-9: exact in float arithmetic.
  const float mag = exp == 0 ? static_cast<float>(man) * 0.001953125f
                             : BitsFloat(((exp + 120u) << 23) | (man << 20));
  return BitsFloat(sign | FloatBits(mag));
}

/// `x` as a bfloat16, to nearest, ties to even; NaN becomes 0x7FC0, as torch
/// converts.
RADIXKV_HOST_DEVICE uint16_t BFloat16FromFloat(float x) {
  const uint32_t bits = FloatBits(x);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/// `x` as an IEEE half, to nearest, ties to even: beyond 65504 it rounds to
/// infinity, below 2^-14 to a subnormal; NaN becomes 0x7E00 with its sign.
/// Integer arithmetic only.
RADIXKV_HOST_DEVICE uint16_t HalfFromFloat(float x) {
  const uint32_t bits = FloatBits(x);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t mag = bits & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u);
  if (mag >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520
  uint32_t h, rest, half;
  if (mag >= 0x38800000u) {  // a normal half: drop 13 bits, re-bias the exponent
    h = (mag >> 13) - (112u << 10);
    rest = mag & 0x1FFFu;
    half = 0x1000u;
  } else {
    const int e = static_cast<int>(mag >> 23);
    if (e < 102) return static_cast<uint16_t>(sign);  // below 2^-25: zero
    const uint32_t sig = (mag & 0x7FFFFFu) | 0x800000u;
    const int shift = 126 - e;  // sig * 2^(e - 126) counts units of 2^-24
    h = sig >> shift;
    rest = sig & ((1u << shift) - 1u);
    half = 1u << (shift - 1);
  }
  h += static_cast<uint32_t>(rest > half) | (static_cast<uint32_t>(rest == half) & h & 1u);
  return static_cast<uint16_t>(sign | h);
}

/// Writes `x` as element `e` of `row`, an array of `type`, rounded to
/// nearest, ties to even (as torch's `.to(dtype)`).
RADIXKV_HOST_DEVICE void StoreSourceFloat(char* row, SourceFloat type, int64_t e, float x) {
  if (type == SourceFloat::kFloat32) {
    memcpy(row + e * 4, &x, 4);
    return;
  }
  const uint16_t h = type == SourceFloat::kFloat16 ? HalfFromFloat(x) : BFloat16FromFloat(x);
  memcpy(row + e * 2, &h, 2);
}

}  // namespace radixkv
