#include "radixkv/store.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "radixkv/slot_set.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define RADIXKV_STREAM_STORES 1
#endif

namespace radixkv {
namespace {

// Batches writing at least this much bypass the cache when their rows are whole
// 64-byte lines (bench/README.md has the measurements): such rows would evict
// the cache anyway, and streaming stores skip reading each destination line
// before overwriting it.
constexpr int64_t kStreamBytes = int64_t{1} << 20;

// Rows that go through the cache are bound by the latency of fetching each
// destination line; a second thread keeps more fetches in flight. Each thread
// gets at least this many bytes to write, so starting it pays.
constexpr int64_t kThreadBytes = int64_t{2} << 20;

// Negative slots wrap to huge unsigned values, so one comparison tests both ends.
template <typename Index>
int64_t FindOutOfRangeT(const Index* idx, int64_t n, int64_t num_slots) noexcept {
  const uint64_t limit = static_cast<uint64_t>(num_slots);
  constexpr int64_t kBlock = 1024;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = std::min(n, b + kBlock);
    bool bad = false;
    for (int64_t i = b; i < e; ++i) {
      bad |= static_cast<uint64_t>(static_cast<int64_t>(idx[i])) >= limit;
    }
    if (!bad) continue;
    for (int64_t i = b; i < e; ++i) {
      if (static_cast<uint64_t>(static_cast<int64_t>(idx[i])) >= limit) return i;
    }
  }
  return -1;
}

struct CachedCopy {
  void operator()(char* dst, const char* src, size_t n) const noexcept { std::memcpy(dst, src, n); }
};

#if RADIXKV_STREAM_STORES
// Streams whole 64-byte lines; used only when every destination run is made of
// whole lines (see LinesAligned), the rest goes through memcpy.
__attribute__((target("avx2"))) void StreamCopy(char* dst, const char* src, size_t n) noexcept {
  size_t i = 0;
  for (; i + 128 <= n; i += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 64));
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 96), d);
  }
  for (; i + 32 <= n; i += 32) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
  }
  std::memcpy(dst + i, src + i, n - i);
}

struct StreamingCopy {
  void operator()(char* dst, const char* src, size_t n) const noexcept { StreamCopy(dst, src, n); }
};

bool HasAvx2() noexcept {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}

// Whether every side copies bytes and every run of the caches starts on a
// 64-byte line and fills whole lines. Streaming a partial line costs a
// read-modify-write in memory, which made streaming slower than plain stores
// in our measurements.
bool LinesAligned(const StoreParams& p) noexcept {
  uint64_t bits = 0;
  for (int s = 0; s < p.num_sides; ++s) {
    const StoreSide& d = p.side[s];
    if (d.source != SourceFloat::kNone) return false;
    const RowLayout& l = d.dst_layout;
    bits |= static_cast<uint64_t>(d.head_bytes) | reinterpret_cast<uintptr_t>(d.dst) |
            static_cast<uint64_t>(l.page_stride) | static_cast<uint64_t>(l.row_stride);
    if (d.heads > 1) bits |= static_cast<uint64_t>(l.head_stride);
  }
  return (bits & 63) == 0;
}
#endif

// Whether side `d` copies one run per row between unpaged tensors.
bool DenseCopy(const StoreSide& d) noexcept {
  return d.source == SourceFloat::kNone && d.heads == 1 && d.src_layout.page_size == 1 &&
         d.dst_layout.page_size == 1;
}

// Every side a dense copy (the common case): one copy a token and side.
template <int kSides, typename Index, typename Copy>
void StoreDense(const StoreParams& p, const Index* idx, int64_t begin, int64_t end,
                Copy copy) noexcept {
  const int sides = kSides > 0 ? kSides : p.num_sides;
  const char* src[kMaxStoreSides];
  char* dst[kMaxStoreSides];
  int64_t src_stride[kMaxStoreSides], dst_stride[kMaxStoreSides];
  size_t bytes[kMaxStoreSides];
  for (int s = 0; s < sides; ++s) {
    src[s] = static_cast<const char*>(p.side[s].src);
    dst[s] = static_cast<char*>(p.side[s].dst);
    src_stride[s] = p.side[s].src_layout.page_stride;
    dst_stride[s] = p.side[s].dst_layout.page_stride;
    bytes[s] = static_cast<size_t>(p.side[s].head_bytes);
  }
  for (int64_t i = begin; i < end; ++i) {
    const int64_t slot = static_cast<int64_t>(idx[i]);
    for (int s = 0; s < sides; ++s) {
      copy(dst[s] + slot * dst_stride[s], src[s] + i * src_stride[s], bytes[s]);
    }
  }
}

// Converts `n` source elements of kType at `src` to float8 at `dst`, one at a
// time (any x86-64, and the tails of the AVX2 loop).
template <SourceFloat kType, Float8Format kFormat>
void ConvertRunPlain(uint8_t* dst, const char* src, int64_t n, float scale) noexcept {
  for (int64_t e = 0; e < n; ++e) {
    dst[e] = ScaledFloat8(LoadSourceFloat(src, kType, e), scale, kFormat);
  }
}

using ConvertFn = void (*)(uint8_t*, const char*, int64_t, float) noexcept;

#if RADIXKV_STREAM_STORES
// The same, 8 elements at a time: Float8FromFloat's integer steps on AVX2
// lanes (the compiler does not vectorize the scalar loop), bit for bit the
// same results (tests/cpp/store_test.cc compares the two over float bit
// patterns).
template <SourceFloat kType, Float8Format kFormat>
__attribute__((target("avx2,f16c"))) void ConvertRunAvx2(uint8_t* dst, const char* src, int64_t n,
                                                         float scale) noexcept {
  constexpr bool kE4M3 = kFormat == Float8Format::kE4M3Fn;
  constexpr int kManBits = kE4M3 ? 3 : 2;
  constexpr int kBias = kE4M3 ? 7 : 15;
  const __m256i max_finite = _mm256_set1_epi32(kE4M3 ? 0x7E : 0x7B);
  const __m256i overflow = _mm256_set1_epi32(kE4M3 ? 0x7E : 0x7C);
  const __m256i nan_code = _mm256_set1_epi32(0x7F);
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256i inf_bits = _mm256_set1_epi32(0x7F800000);
  const __m256i man_mask = _mm256_set1_epi32(0x7FFFFF);
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i zero = _mm256_setzero_si256();
  const __m256 divisor = _mm256_set1_ps(scale);
  // Gathers byte 0 of each 32-bit lane into the low 4 bytes of each 128-bit half.
  const __m256i low_bytes =
      _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1,
                       -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  int64_t e = 0;
  for (; e + 8 <= n; e += 8) {
    __m256 x;
    if constexpr (kType == SourceFloat::kFloat32) {
      x = _mm256_loadu_ps(reinterpret_cast<const float*>(src) + e);
    } else {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * e));
      if constexpr (kType == SourceFloat::kFloat16) {
        x = _mm256_cvtph_ps(h);  // exact, as HalfToFloat
      } else {
        x = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      }
    }
    const __m256i xbits = _mm256_castps_si256(x);
    const __m256i bits = _mm256_castps_si256(_mm256_div_ps(x, divisor));
    const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80));
    const __m256i mag = _mm256_and_si256(bits, abs_mask);
    const __m256i fexp = _mm256_srli_epi32(mag, 23);
    const __m256i normal =
        _mm256_andnot_si256(_mm256_cmpeq_epi32(fexp, zero), _mm256_set1_epi32(0x800000));
    const __m256i sig = _mm256_or_si256(_mm256_and_si256(mag, man_mask), normal);
    const __m256i exp = _mm256_sub_epi32(fexp, _mm256_set1_epi32(127 - kBias));
    // shift = 23 - man_bits + max(1 - exp, 0), at most 31
    __m256i shift = _mm256_add_epi32(_mm256_set1_epi32(23 - kManBits),
                                     _mm256_max_epi32(_mm256_sub_epi32(one, exp), zero));
    shift = _mm256_min_epi32(shift, _mm256_set1_epi32(31));
    __m256i code = _mm256_slli_epi32(_mm256_sub_epi32(_mm256_max_epi32(exp, one), one), kManBits);
    code = _mm256_add_epi32(code, _mm256_srlv_epi32(sig, shift));
    const __m256i low_mask = _mm256_sub_epi32(_mm256_sllv_epi32(one, shift), one);
    const __m256i rest = _mm256_and_si256(sig, low_mask);
    const __m256i half = _mm256_sllv_epi32(one, _mm256_sub_epi32(shift, one));
    // rest and half are below 2^31: signed comparisons are exact.
    const __m256i up = _mm256_or_si256(
        _mm256_and_si256(_mm256_cmpgt_epi32(rest, half), one),
        _mm256_and_si256(_mm256_and_si256(_mm256_cmpeq_epi32(rest, half), code), one));
    code = _mm256_add_epi32(code, up);
    code = _mm256_blendv_epi8(code, overflow, _mm256_cmpgt_epi32(code, max_finite));
    code = _mm256_blendv_epi8(code, nan_code, _mm256_cmpgt_epi32(mag, inf_bits));
    __m256i out = _mm256_or_si256(code, sign);
    // A NaN source keeps its own sign (the division may not).
    const __m256i x_sign = _mm256_and_si256(_mm256_srli_epi32(xbits, 24), _mm256_set1_epi32(0x80));
    const __m256i x_nan = _mm256_cmpgt_epi32(_mm256_and_si256(xbits, abs_mask), inf_bits);
    out = _mm256_blendv_epi8(out, _mm256_or_si256(x_sign, nan_code), x_nan);
    const __m256i packed = _mm256_shuffle_epi8(out, low_bytes);
    const uint32_t lo = static_cast<uint32_t>(_mm256_extract_epi32(packed, 0));
    const uint32_t hi = static_cast<uint32_t>(_mm256_extract_epi32(packed, 4));
    std::memcpy(dst + e, &lo, 4);
    std::memcpy(dst + e + 4, &hi, 4);
  }
  // Clean the upper halves before the SSE tail (and the caller's SSE code):
  // without it every switch stalls, about 120 ns a row.
  _mm256_zeroupper();
  ConvertRunPlain<kType, kFormat>(dst + e, src + e * SourceBytes(kType), n - e, scale);
}

bool HasF16c() noexcept {
  // CPUID leaf 1, ECX bit 29 (clang's __builtin_cpu_supports has no "f16c").
  static const bool has = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & (1u << 29)) != 0;
  }();
  return has;
}
#endif

template <SourceFloat kType, Float8Format kFormat>
ConvertFn PickConvert() noexcept {
#if RADIXKV_STREAM_STORES
  if (HasAvx2() && HasF16c()) return &ConvertRunAvx2<kType, kFormat>;
#endif
  return &ConvertRunPlain<kType, kFormat>;
}

template <Float8Format kFormat>
ConvertFn PickConvert(SourceFloat type) noexcept {
  switch (type) {
    case SourceFloat::kFloat32:
      return PickConvert<SourceFloat::kFloat32, kFormat>();
    case SourceFloat::kFloat16:
      return PickConvert<SourceFloat::kFloat16, kFormat>();
    default:
      return PickConvert<SourceFloat::kBFloat16, kFormat>();
  }
}

// The run converter of side `d` (a converting side).
ConvertFn PickConvert(const StoreSide& d) noexcept {
  return d.format == Float8Format::kE4M3Fn ? PickConvert<Float8Format::kE4M3Fn>(d.source)
                                           : PickConvert<Float8Format::kE5M2>(d.source);
}

void ConvertRows(const StoreSide& d, const char* src, char* dst) noexcept {
  const float scale = SideScale(d);
  const ConvertFn convert = PickConvert(d);
  for (int64_t h = 0; h < d.heads; ++h) {
    convert(reinterpret_cast<uint8_t*>(dst + h * d.dst_layout.head_stride),
            src + h * d.src_layout.head_stride, d.head_bytes, scale);
  }
}

template <typename Copy>
void StoreGeneric(const StoreParams& p, int64_t begin, int64_t end, Copy copy) noexcept {
  for (int64_t i = begin; i < end; ++i) {
    const int64_t slot = LoadSlot(p.indices, p.index_type, i);
    for (int s = 0; s < p.num_sides; ++s) {
      const StoreSide& d = p.side[s];
      const char* src = static_cast<const char*>(d.src) + RowOffset(d.src_layout, i);
      char* dst = static_cast<char*>(d.dst) + RowOffset(d.dst_layout, slot);
      if (d.source != SourceFloat::kNone) {
        ConvertRows(d, src, dst);
        continue;
      }
      const size_t bytes = static_cast<size_t>(d.head_bytes);
      for (int64_t h = 0; h < d.heads; ++h) {
        copy(dst + h * d.dst_layout.head_stride, src + h * d.src_layout.head_stride, bytes);
      }
    }
  }
}

template <int kSides, typename Copy>
void StoreDenseRange(const StoreParams& p, int64_t begin, int64_t end, Copy copy) noexcept {
  if (p.index_type == IndexType::kInt32) {
    StoreDense<kSides>(p, static_cast<const int32_t*>(p.indices), begin, end, copy);
  } else {
    StoreDense<kSides>(p, static_cast<const int64_t*>(p.indices), begin, end, copy);
  }
}

// Stores tokens [begin, end).
template <typename Copy>
void StoreRange(const StoreParams& p, int64_t begin, int64_t end, Copy copy) noexcept {
  bool dense = true;
  for (int s = 0; s < p.num_sides; ++s) dense = dense && DenseCopy(p.side[s]);
  if (!dense) {
    StoreGeneric(p, begin, end, copy);
  } else if (p.num_sides == 2) {  // K and V, or MLA's two halves
    StoreDenseRange<2>(p, begin, end, copy);
  } else {
    StoreDenseRange<0>(p, begin, end, copy);
  }
}

// What one token costs, in bytes copied: a converted byte (a float read,
// divided, rounded) costs about what kConvertWork copied bytes do (about 1 ns
// against 0.1 ns in our measurements).
constexpr int64_t kConvertWork = 8;

int64_t RowWork(const StoreParams& p) noexcept {
  int64_t work = 0;
  for (int s = 0; s < p.num_sides; ++s) {
    const StoreSide& d = p.side[s];
    work += d.heads * d.head_bytes * (d.source == SourceFloat::kNone ? 1 : kConvertWork);
  }
  return work;
}

// Splits the batch over `threads` threads (this one included). Falls back to
// fewer when a thread cannot be started.
void StoreParallel(const StoreParams& p, int threads) noexcept {
  std::vector<std::thread> workers;
  for (int t = 1; t < threads; ++t) {
    const int64_t begin = p.num_tokens * t / threads, end = p.num_tokens * (t + 1) / threads;
    try {
      workers.emplace_back([&p, begin, end] { StoreRange(p, begin, end, CachedCopy{}); });
    } catch (...) {
      StoreRange(p, begin, end, CachedCopy{});
    }
  }
  StoreRange(p, 0, p.num_tokens / threads, CachedCopy{});
  for (std::thread& w : workers) w.join();
}

}  // namespace

int64_t FindSlotOutOfRange(const void* indices, IndexType type, int64_t n,
                           int64_t num_slots) noexcept {
  if (type == IndexType::kInt32) {
    return FindOutOfRangeT(static_cast<const int32_t*>(indices), n, num_slots);
  }
  return FindOutOfRangeT(static_cast<const int64_t*>(indices), n, num_slots);
}

namespace {

// Position of the first of `idx[0, n)` that repeats an earlier one, or -1,
// with an open-addressing set of the slots seen (a table of >= 2n keys;
// `kEmpty` is no slot). O(n), whatever the slots' range.
template <typename Key>
int64_t FirstRepeatHashed(const void* idx, IndexType type, int64_t n) {
  constexpr Key kEmpty = ~Key{0};
  int shift = 64;
  size_t capacity = 1;
  while (capacity < static_cast<size_t>(2 * n)) {
    capacity <<= 1;
    --shift;
  }
  std::vector<Key> table(capacity, kEmpty);
  const size_t mask = capacity - 1;
  for (int64_t i = 0; i < n; ++i) {
    const Key slot = static_cast<Key>(LoadSlot(idx, type, i));
    size_t h = static_cast<size_t>((static_cast<uint64_t>(slot) * 0x9E3779B97F4A7C15ull) >> shift);
    while (table[h] != kEmpty) {
      if (table[h] == slot) return i;
      h = (h + 1) & mask;
    }
    table[h] = slot;
  }
  return -1;
}

// Position of the first index of `idx[0, n)` (all in [0, num_slots)) that
// repeats an earlier one, or -1.
int64_t FindRepeatedSlot(const void* idx, IndexType type, int64_t n, int64_t num_slots) {
  if (n <= 32) {  // a decode step's few tokens: comparing is cheaper than any set
    for (int64_t i = 1; i < n; ++i) {
      for (int64_t j = 0; j < i; ++j) {
        if (LoadSlot(idx, type, i) == LoadSlot(idx, type, j)) return i;
      }
    }
    return -1;
  }
  if (type == IndexType::kInt32) {
    // Slots from a page allocator come in few runs, checked by sorting them.
    SlotRuns runs;
    if (runs.Assign(static_cast<const int32_t*>(idx), n, 64)) {
      SlotSet scratch;
      return FindRepeat(runs, &scratch);
    }
  }
  // Slots spread over a range not much wider than the batch: a bitmap of
  // the range (a few bits per token, scanned in order); wider: a hash set.
  int64_t lo = LoadSlot(idx, type, 0), hi = lo;
  for (int64_t i = 1; i < n; ++i) {
    const int64_t s = LoadSlot(idx, type, i);
    lo = std::min(lo, s);
    hi = std::max(hi, s);
  }
  if (hi - lo < 64 * n) {
    std::vector<uint64_t> seen(static_cast<size_t>((hi - lo) / 64 + 1), 0);
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t bit = static_cast<uint64_t>(LoadSlot(idx, type, i) - lo);
      uint64_t& word = seen[bit >> 6];
      if ((word >> (bit & 63)) & 1) return i;
      word |= uint64_t{1} << (bit & 63);
    }
    return -1;
  }
  if (num_slots <= int64_t{1} << 31) return FirstRepeatHashed<uint32_t>(idx, type, n);
  return FirstRepeatHashed<uint64_t>(idx, type, n);
}

}  // namespace

StoreCheck StoreRows(const StoreParams& params, int max_threads) {
  // One read of every index, into memory no one else can change (on the
  // stack for a small batch).
  const size_t width = params.index_type == IndexType::kInt32 ? 4 : 8;
  const size_t bytes = static_cast<size_t>(params.num_tokens) * width;
  alignas(8) char small[512];
  std::vector<char> large;
  char* indices = small;
  if (bytes > sizeof(small)) {
    large.resize(bytes);
    indices = large.data();
  }
  if (bytes > 0) std::memcpy(indices, params.indices, bytes);
  StoreCheck check;
  check.position =
      FindSlotOutOfRange(indices, params.index_type, params.num_tokens, params.num_slots);
  if (check.position < 0) {
    check.position =
        FindRepeatedSlot(indices, params.index_type, params.num_tokens, params.num_slots);
    if (check.position >= 0) check.kind = StoreCheck::kRepeated;
  } else {
    check.kind = StoreCheck::kOutOfRange;
  }
  if (check.position >= 0) {
    check.slot = LoadSlot(indices, params.index_type, check.position);
    return check;
  }
  // A copy of what the store reads (the sides in use, not all kMaxStoreSides).
  StoreParams p;
  p.num_sides = params.num_sides;
  std::copy(params.side, params.side + params.num_sides, p.side);
  p.index_type = params.index_type;
  p.num_tokens = params.num_tokens;
  p.num_slots = params.num_slots;
  p.indices = indices;
  SimplifyStore(&p);
  const int64_t written = p.num_tokens * RowBytes(p);
#if RADIXKV_STREAM_STORES
  if (written >= kStreamBytes && LinesAligned(p) && HasAvx2()) {
    StoreRange(p, 0, p.num_tokens, StreamingCopy{});
    _mm_sfence();  // order the streamed lines before anything the caller does next
    return check;
  }
#endif
  const int threads = static_cast<int>(std::min<int64_t>(
      std::max(max_threads, 1), std::max<int64_t>(p.num_tokens * RowWork(p) / kThreadBytes, 1)));
  if (threads > 1) {
    StoreParallel(p, threads);
  } else {
    StoreRange(p, 0, p.num_tokens, CachedCopy{});
  }
  return check;
}

}  // namespace radixkv
