// Index arithmetic of the KV store (a row scatter), shared by the CPU kernel
// (cpp/src/store.cc) and the CUDA kernel (cuda/store.cu). Everything here is
// compiled for the host and, under nvcc, for the device too, so the CPU tests
// exercise the exact offsets and conversions the GPU uses.
//
// Vocabulary: a store has up to kMaxStoreSides *sides*, each a source tensor
// and the cache it is written into (MHA: k -> k_cache and v -> v_cache; MLA:
// k_nope and k_rope into two column ranges of one buffer). A *row* is what
// one token stores on one side: its `heads` runs of `head_bytes` contiguous
// bytes. Source row i of every side goes to destination row `indices[i]` (a
// token slot). All offsets and strides are in bytes.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define RADIXKV_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define RADIXKV_HOST_DEVICE inline
#endif

namespace radixkv {

/// Where the rows of one tensor lie. Row r starts at
/// `(r / page_size) * page_stride + (r % page_size) * row_stride`; head h of a
/// row starts `h * head_stride` bytes after the row. Sources use
/// `page_size == 1` (row i at `i * page_stride`); a paged cache whose pages do
/// not follow each other (the PageFirst layout) uses `page_size > 1`.
struct RowLayout {
  int64_t page_size;    ///< rows per page, >= 1
  int64_t page_stride;  ///< bytes from one page to the next
  int64_t row_stride;   ///< bytes from one row of a page to the next
  int64_t head_stride;  ///< bytes from one head of a row to the next
};

/// Index dtypes accepted for `indices`.
enum class IndexType : int32_t { kInt32 = 0, kInt64 = 1 };

/// The element type of a side's source when the store converts it: kNone
/// copies bytes as they are (source and cache of one dtype).
enum class SourceFloat : int32_t { kNone = 0, kFloat32 = 1, kFloat16 = 2, kBFloat16 = 3 };

/// The float8 format a converting side writes (one byte per element).
enum class Float8Format : int32_t { kE4M3Fn = 0, kE5M2 = 1 };

/// Most sides one store writes.
constexpr int kMaxStoreSides = 8;

/// One source and the cache it goes into.
///
/// A copying side (`source == kNone`) moves `heads` runs of `head_bytes` bytes
/// per row. A converting side reads `heads * head_bytes` elements of type
/// `source` per row (so a source run is `head_bytes * SourceBytes(source)`
/// bytes), divides each by the scale in float32 and rounds it to `format`,
/// exactly as torch's `(x.float() / scale).to(float8)` does on the CPU
/// (Float8FromFloat). The scale is `*scale_ptr` when that is not null (memory
/// the kernel's device can read: a device tensor on CUDA), else `scale`.
struct StoreSide {
  const void* src;       ///< `num_tokens` rows
  void* dst;             ///< `num_slots` rows
  RowLayout src_layout;  ///< page_size 1
  RowLayout dst_layout;
  int64_t heads;       ///< runs per row, >= 1
  int64_t head_bytes;  ///< cache bytes per run, >= 1
  SourceFloat source;  ///< kNone: bytewise copy
  Float8Format format;
  float scale;             ///< > 0 and finite; used when scale_ptr is null
  const float* scale_ptr;  ///< nullable
};

/// Everything one store needs. Plain data, passed by value to the CUDA kernel;
/// the pointers are borrowed and must stay valid for the duration of the store.
struct StoreParams {
  StoreSide side[kMaxStoreSides];
  int32_t num_sides;     ///< sides in use, [1, kMaxStoreSides]
  const void* indices;   ///< `num_tokens` destination slots
  IndexType index_type;  ///< dtype of `indices`
  int64_t num_tokens;    ///< rows to store
  int64_t num_slots;     ///< rows of every cache; valid slots are [0, num_slots)
};

/// Bytes of one source element of a converting side.
RADIXKV_HOST_DEVICE int64_t SourceBytes(SourceFloat s) {
  return s == SourceFloat::kFloat32 ? 4 : s == SourceFloat::kNone ? 1 : 2;
}

/// Bytes of one source run of `s`.
RADIXKV_HOST_DEVICE int64_t SourceRunBytes(const StoreSide& s) {
  return s.source == SourceFloat::kNone ? s.head_bytes : s.head_bytes * SourceBytes(s.source);
}

/// Cache bytes one token writes over all sides of `p`.
RADIXKV_HOST_DEVICE int64_t RowBytes(const StoreParams& p) {
  int64_t bytes = 0;
  for (int s = 0; s < p.num_sides; ++s) bytes += p.side[s].heads * p.side[s].head_bytes;
  return bytes;
}

/// Byte offset of row `row` in a tensor laid out as `l`.
RADIXKV_HOST_DEVICE int64_t RowOffset(const RowLayout& l, int64_t row) {
  if (l.page_size == 1) return row * l.page_stride;
  const int64_t page = row / l.page_size;
  return page * l.page_stride + (row - page * l.page_size) * l.row_stride;
}

/// Slot `i` of `indices`, widened to int64.
RADIXKV_HOST_DEVICE int64_t LoadSlot(const void* indices, IndexType type, int64_t i) {
  return type == IndexType::kInt32 ? static_cast<int64_t>(static_cast<const int32_t*>(indices)[i])
                                   : static_cast<const int64_t*>(indices)[i];
}

/// Whether `slot` names a row of a cache with `num_slots` rows.
RADIXKV_HOST_DEVICE bool SlotInRange(int64_t slot, int64_t num_slots) {
  return slot >= 0 && slot < num_slots;
}

// ---- float conversion ------------------------------------------------------------

/// The bits of a float, and back, without undefined behaviour.
RADIXKV_HOST_DEVICE uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  return __builtin_bit_cast(uint32_t, f);
#endif
}
RADIXKV_HOST_DEVICE float BitsFloat(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  return __builtin_bit_cast(float, b);
#endif
}

/// An IEEE half as a float (exact: every half is a float). Branch-free, so
/// a loop of it vectorizes.
RADIXKV_HOST_DEVICE float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  const uint32_t normal = sign | ((exp + 112) << 23) | (man << 13);
  const uint32_t special = sign | 0x7F800000u | (man << 13);  // inf, NaN
  // A subnormal half is man * 2^-24: exact in float arithmetic (a normal float).
  const uint32_t subnormal = sign | FloatBits(static_cast<float>(man) * 5.9604644775390625e-8f);
  return BitsFloat(exp == 0 ? subnormal : exp == 0x1F ? special : normal);
}

/// A bfloat16 as a float (exact: the top half of the float's bits).
RADIXKV_HOST_DEVICE float BFloat16ToFloat(uint16_t b) {
  return BitsFloat(static_cast<uint32_t>(b) << 16);
}

/// `x` rounded to the nearest float8 value of `format`, ties to even, as
/// torch (2.13) converts: the sign is kept (also for zero and NaN); a NaN
/// becomes 0x7F; a magnitude that rounds beyond the largest finite value
/// (infinity included) saturates to 448 (0x7E) in e4m3fn, which has no
/// infinity, and becomes infinity (0x7C) in e5m2, whose largest finite value
/// is 57344. Integer arithmetic only, so the result does not depend on the
/// floating-point environment (flush-to-zero, rounding mode).
RADIXKV_HOST_DEVICE uint8_t Float8FromFloat(float x, Float8Format format) {
  // Branch-free (selects only), so a loop of it vectorizes. A normal result
  // is ((exp - 1) << man_bits) + (significand with its leading 1 >> shift); a
  // subnormal one the same with exp taken as 1 and a wider shift, so both are
  // one expression, and a carry out of the mantissa moves into the exponent.
  const bool e4m3 = format == Float8Format::kE4M3Fn;
  const int man_bits = e4m3 ? 3 : 2;
  const int bias = e4m3 ? 7 : 15;
  const uint32_t max_finite = e4m3 ? 0x7Eu : 0x7Bu;  // codes without the sign
  const uint32_t overflow = e4m3 ? 0x7Eu : 0x7Cu;    // what a larger magnitude becomes
  const uint32_t bits = FloatBits(x);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t mag = bits & 0x7FFFFFFFu;
  const int fexp = static_cast<int>(mag >> 23);
  const uint32_t sig = (mag & 0x7FFFFFu) | (fexp != 0 ? 0x800000u : 0u);
  const int exp = fexp - 127 + bias;                    // the result's exponent field, if normal
  int shift = 23 - man_bits + (exp < 1 ? 1 - exp : 0);  // bits of sig below the result's
  shift = shift > 31 ? 31 : shift;  // past 24 every bit of sig is below half: zero
  uint32_t code = (static_cast<uint32_t>(exp < 1 ? 1 : exp) - 1u) << man_bits;
  code += sig >> shift;
  const uint32_t rest = sig & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  code += static_cast<uint32_t>(rest > half) |
          (static_cast<uint32_t>(rest == half) & code & 1u);  // to nearest, ties to even
  code = code > max_finite ? overflow : code;
  code = mag > 0x7F800000u ? 0x7Fu : code;  // NaN
  return static_cast<uint8_t>(sign | code);
}

/// Source element `e` of a converting side's run at `src`, as a float.
RADIXKV_HOST_DEVICE float LoadSourceFloat(const char* src, SourceFloat type, int64_t e) {
  if (type == SourceFloat::kFloat32) return reinterpret_cast<const float*>(src)[e];
  const uint16_t h = reinterpret_cast<const uint16_t*>(src)[e];
  return type == SourceFloat::kFloat16 ? HalfToFloat(h) : BFloat16ToFloat(h);
}

/// The float8 element stored for source value `x` and scale `scale`: torch's
/// `(x / scale).to(float8)` in float32. A NaN stays NaN with its sign (a
/// CUDA division would drop the sign; torch's CPU keeps it).
RADIXKV_HOST_DEVICE uint8_t ScaledFloat8(float x, float scale, Float8Format format) {
  const uint8_t nan = static_cast<uint8_t>(((FloatBits(x) >> 24) & 0x80u) | 0x7Fu);
  const uint8_t scaled = Float8FromFloat(x / scale, format);
  return (FloatBits(x) & 0x7FFFFFFFu) > 0x7F800000u ? nan : scaled;
}

/// The scale of side `s`.
RADIXKV_HOST_DEVICE float SideScale(const StoreSide& s) {
  return s.scale_ptr != nullptr ? *s.scale_ptr : s.scale;
}

// ---- the store ---------------------------------------------------------------------

/// Rewrites `p` into an equivalent, cheaper form, side by side: heads that
/// follow each other in both tensors of a side become one run, and a tensor
/// whose pages follow each other becomes unpaged. Call once before the copy.
RADIXKV_HOST_DEVICE void SimplifyStore(StoreParams* p) {
  for (int s = 0; s < p->num_sides; ++s) {
    StoreSide& d = p->side[s];
    if (d.heads > 1 && d.src_layout.head_stride == SourceRunBytes(d) &&
        d.dst_layout.head_stride == d.head_bytes) {
      d.head_bytes *= d.heads;
      d.heads = 1;
    }
    RowLayout* ls[2] = {&d.src_layout, &d.dst_layout};
    for (int t = 0; t < 2; ++t) {
      RowLayout* l = ls[t];
      if (d.heads == 1) l->head_stride = t == 0 ? SourceRunBytes(d) : d.head_bytes;
      if (l->page_size > 1 && l->page_stride == l->page_size * l->row_stride) {
        l->page_size = 1;
        l->page_stride = l->row_stride;
      }
      if (l->page_size == 1) l->row_stride = l->page_stride;
    }
  }
}

/// The widest access (1, 2, 4, 8 or 16 bytes, at most `max_bytes`, a power of
/// two) that every pointer, every stride and the run length of the copying
/// sides of `p` are multiples of, so each access of that width is aligned.
/// Converting sides go element by element and do not count.
RADIXKV_HOST_DEVICE int64_t VectorBytes(const StoreParams& p, int64_t max_bytes) {
  uint64_t bits = static_cast<uint64_t>(max_bytes);
  for (int s = 0; s < p.num_sides; ++s) {
    const StoreSide& d = p.side[s];
    if (d.source != SourceFloat::kNone) continue;
    bits |= static_cast<uint64_t>(d.head_bytes) | reinterpret_cast<uintptr_t>(d.src) |
            reinterpret_cast<uintptr_t>(d.dst);
    const RowLayout* ls[2] = {&d.src_layout, &d.dst_layout};
    for (const RowLayout* l : ls) {
      bits |= static_cast<uint64_t>(l->page_stride) | static_cast<uint64_t>(l->row_stride);
      if (d.heads > 1) bits |= static_cast<uint64_t>(l->head_stride);
    }
  }
  return static_cast<int64_t>(bits & (~bits + 1));  // lowest set bit
}

/// Units one worker group shares out per run of the widest side: vectors of
/// `vec_bytes` for a copying side, elements for a converting one.
RADIXKV_HOST_DEVICE int64_t MaxRunUnits(const StoreParams& p, int64_t vec_bytes) {
  int64_t most = 1;
  for (int s = 0; s < p.num_sides; ++s) {
    const StoreSide& d = p.side[s];
    const int64_t units = d.source == SourceFloat::kNone ? d.head_bytes / vec_bytes : d.head_bytes;
    if (units > most) most = units;
  }
  return most;
}

/// Converts the runs of side `d` for one row, elements `lane, lane + lanes,
/// ...` of each run.
RADIXKV_HOST_DEVICE void ConvertRowPart(const StoreSide& d, const char* src, char* dst,
                                        int64_t lane, int64_t lanes) {
  const float scale = SideScale(d);
  for (int64_t h = 0; h < d.heads; ++h) {
    const char* from = src + h * d.src_layout.head_stride;
    uint8_t* to = reinterpret_cast<uint8_t*>(dst + h * d.dst_layout.head_stride);
    for (int64_t e = lane; e < d.head_bytes; e += lanes) {
      to[e] = ScaledFloat8(LoadSourceFloat(from, d.source, e), scale, d.format);
    }
  }
}

/// Stores the part of token `i`'s rows (every side) that lane `lane` of
/// `lanes` cooperating workers owns: on a copying side `sizeof(Vec)` bytes at a
/// time, run h, vector e going to the lane with `e % lanes == lane`; on a
/// converting side element e of each run. A token whose slot is out of range
/// is skipped (never written). `sizeof(Vec)` must not exceed
/// `VectorBytes(p, ...)`. Returns false for a skipped token.
template <typename Vec>
RADIXKV_HOST_DEVICE bool StoreTokenPart(const StoreParams& p, int64_t i, int64_t lane,
                                        int64_t lanes) {
  const int64_t slot = LoadSlot(p.indices, p.index_type, i);
  if (!SlotInRange(slot, p.num_slots)) return false;
  for (int s = 0; s < p.num_sides; ++s) {
    const StoreSide& d = p.side[s];
    const char* src = static_cast<const char*>(d.src) + RowOffset(d.src_layout, i);
    char* dst = static_cast<char*>(d.dst) + RowOffset(d.dst_layout, slot);
    if (d.source != SourceFloat::kNone) {
      ConvertRowPart(d, src, dst, lane, lanes);
      continue;
    }
    const int64_t vectors = d.head_bytes / static_cast<int64_t>(sizeof(Vec));
    for (int64_t h = 0; h < d.heads; ++h) {
      const Vec* from = reinterpret_cast<const Vec*>(src + h * d.src_layout.head_stride);
      Vec* to = reinterpret_cast<Vec*>(dst + h * d.dst_layout.head_stride);
      for (int64_t e = lane; e < vectors; e += lanes) to[e] = from[e];
    }
  }
  return true;
}

}  // namespace radixkv
