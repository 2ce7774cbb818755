// The float8 page codec's loops (the per-element conversions are in
// page_codec.h, shared with the device).
#include "radixkv/page_codec.h"

#include <cstring>

namespace radixkv {
namespace {

int64_t PlaneElements(const PageCodecShape& s) { return s.rows * s.heads * s.head_dim; }

// A page's plane as rows packed back to back.
CodecRows PlaneRows(const PageCodecShape& s) {
  const int64_t row = s.heads * s.head_dim;
  return {s.rows, s.heads, s.head_dim, s.type, row * SourceBytes(s.type), row};
}

}  // namespace

int64_t RawPageBytes(const PageCodecShape& s) noexcept {
  return s.planes * PlaneElements(s) * SourceBytes(s.type) + s.rest_bytes;
}

int64_t Float8PageBytes(const PageCodecShape& s) noexcept {
  return s.planes * s.heads * 4 + s.planes * PlaneElements(s) + s.rest_bytes;
}

void EncodeFloat8Rows(const CodecRows& r, const char* src, uint8_t* codes, char* scales) noexcept {
  for (int64_t h = 0; h < r.heads; ++h) {
    const int64_t first = h * r.head_dim;
    uint32_t amax = 0;
    for (int64_t i = 0; i < r.rows; ++i) {
      const char* row = src + i * r.stride;
      for (int64_t d = 0; d < r.head_dim; ++d) {
        amax = FiniteMax(amax, LoadSourceFloat(row, r.type, first + d));
      }
    }
    const float scale = Float8Scale(amax);
    std::memcpy(scales + h * 4, &scale, 4);
    for (int64_t i = 0; i < r.rows; ++i) {
      const char* row = src + i * r.stride;
      uint8_t* out = codes + i * r.code_stride + first;
      for (int64_t d = 0; d < r.head_dim; ++d) {
        out[d] =
            ScaledFloat8(LoadSourceFloat(row, r.type, first + d), scale, Float8Format::kE4M3Fn);
      }
    }
  }
}

void DecodeFloat8Rows(const CodecRows& r, const uint8_t* codes, const char* scales,
                      char* dst) noexcept {
  for (int64_t i = 0; i < r.rows; ++i) {
    char* row = dst + i * r.stride;
    const uint8_t* in = codes + i * r.code_stride;
    for (int64_t h = 0; h < r.heads; ++h) {
      float scale;
      std::memcpy(&scale, scales + h * 4, 4);
      const int64_t first = h * r.head_dim;
      for (int64_t d = 0; d < r.head_dim; ++d) {
        StoreSourceFloat(row, r.type, first + d, Float8E4M3ToFloat(in[first + d]) * scale);
      }
    }
  }
}

void EncodeFloat8Page(const void* page, const PageCodecShape& s, void* out) noexcept {
  const int64_t per_plane = PlaneElements(s);
  const int64_t elem = SourceBytes(s.type);
  const CodecRows r = PlaneRows(s);
  const char* src = static_cast<const char*>(page);
  char* scales = static_cast<char*>(out);
  uint8_t* codes = reinterpret_cast<uint8_t*>(scales + s.planes * s.heads * 4);
  for (int64_t p = 0; p < s.planes; ++p) {
    EncodeFloat8Rows(r, src + p * per_plane * elem, codes + p * per_plane,
                     scales + p * s.heads * 4);
  }
  std::memcpy(codes + s.planes * per_plane, src + s.planes * per_plane * elem,
              static_cast<size_t>(s.rest_bytes));
}

void DecodeFloat8Page(const void* in, const PageCodecShape& s, void* page) noexcept {
  const int64_t per_plane = PlaneElements(s);
  const int64_t elem = SourceBytes(s.type);
  const CodecRows r = PlaneRows(s);
  const char* scales = static_cast<const char*>(in);
  const uint8_t* codes = reinterpret_cast<const uint8_t*>(scales + s.planes * s.heads * 4);
  char* dst = static_cast<char*>(page);
  for (int64_t p = 0; p < s.planes; ++p) {
    DecodeFloat8Rows(r, codes + p * per_plane, scales + p * s.heads * 4,
                     dst + p * per_plane * elem);
  }
  std::memcpy(dst + s.planes * per_plane * elem, codes + s.planes * per_plane,
              static_cast<size_t>(s.rest_bytes));
}

}  // namespace radixkv
