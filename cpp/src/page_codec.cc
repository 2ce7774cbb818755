// The float8 page codec's loops (the per-element conversions are in
// page_codec.h, shared with the device).
#include "radixkv/page_codec.h"

#include <cstring>

namespace radixkv {
namespace {

int64_t PlaneElements(const PageCodecShape& s) { return s.rows * s.heads * s.head_dim; }

void StoreElement(char* plane, SourceFloat type, int64_t e, float x) {
  if (type == SourceFloat::kFloat32) {
    std::memcpy(plane + e * 4, &x, 4);
    return;
  }
  const uint16_t h = type == SourceFloat::kFloat16 ? HalfFromFloat(x) : BFloat16FromFloat(x);
  std::memcpy(plane + e * 2, &h, 2);
}

}  // namespace

int64_t RawPageBytes(const PageCodecShape& s) noexcept {
  return s.planes * PlaneElements(s) * SourceBytes(s.type) + s.rest_bytes;
}

int64_t Float8PageBytes(const PageCodecShape& s) noexcept {
  return s.planes * s.heads * 4 + s.planes * PlaneElements(s) + s.rest_bytes;
}

void EncodeFloat8Page(const void* page, const PageCodecShape& s, void* out) noexcept {
  const int64_t per_plane = PlaneElements(s);
  const int64_t elem = SourceBytes(s.type);
  const char* src = static_cast<const char*>(page);
  char* scales = static_cast<char*>(out);
  uint8_t* codes = reinterpret_cast<uint8_t*>(scales + s.planes * s.heads * 4);
  const int64_t row = s.heads * s.head_dim;
  for (int64_t p = 0; p < s.planes; ++p) {
    const char* plane = src + p * per_plane * elem;
    uint8_t* plane_codes = codes + p * per_plane;
    for (int64_t h = 0; h < s.heads; ++h) {
      // The largest finite magnitude, as bits: a finite float's magnitude
      // orders as its bits do.
      uint32_t amax = 0;
      for (int64_t r = 0; r < s.rows; ++r) {
        for (int64_t d = 0; d < s.head_dim; ++d) {
          const float x = LoadSourceFloat(plane, s.type, r * row + h * s.head_dim + d);
          const uint32_t mag = FloatBits(x) & 0x7FFFFFFFu;
          amax = mag < 0x7F800000u && mag > amax ? mag : amax;
        }
      }
      float scale = amax != 0 ? BitsFloat(amax) / kFloat8E4M3Max : 1.0f;
      // Below 448 x 2^-149 the division gives 0, and a zero / 0 a NaN: the
      // smallest positive float instead.
      scale = scale != 0.0f ? scale : BitsFloat(1u);
      std::memcpy(scales + (p * s.heads + h) * 4, &scale, 4);
      for (int64_t r = 0; r < s.rows; ++r) {
        const int64_t first = r * row + h * s.head_dim;
        for (int64_t d = 0; d < s.head_dim; ++d) {
          const float x = LoadSourceFloat(plane, s.type, first + d);
          plane_codes[first + d] = ScaledFloat8(x, scale, Float8Format::kE4M3Fn);
        }
      }
    }
  }
  std::memcpy(codes + s.planes * per_plane, src + s.planes * per_plane * elem,
              static_cast<size_t>(s.rest_bytes));
}

void DecodeFloat8Page(const void* in, const PageCodecShape& s, void* page) noexcept {
  const int64_t per_plane = PlaneElements(s);
  const int64_t elem = SourceBytes(s.type);
  const char* scales = static_cast<const char*>(in);
  const uint8_t* codes = reinterpret_cast<const uint8_t*>(scales + s.planes * s.heads * 4);
  char* dst = static_cast<char*>(page);
  const int64_t row = s.heads * s.head_dim;
  for (int64_t p = 0; p < s.planes; ++p) {
    char* plane = dst + p * per_plane * elem;
    const uint8_t* plane_codes = codes + p * per_plane;
    for (int64_t r = 0; r < s.rows; ++r) {
      for (int64_t h = 0; h < s.heads; ++h) {
        float scale;
        std::memcpy(&scale, scales + (p * s.heads + h) * 4, 4);
        const int64_t first = r * row + h * s.head_dim;
        for (int64_t d = 0; d < s.head_dim; ++d) {
          StoreElement(plane, s.type, first + d, Float8E4M3ToFloat(plane_codes[first + d]) * scale);
        }
      }
    }
  }
  std::memcpy(dst + s.planes * per_plane * elem, codes + s.planes * per_plane,
              static_cast<size_t>(s.rest_bytes));
}

}  // namespace radixkv
