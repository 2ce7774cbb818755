#include "radixkv/store.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "radixkv/slot_set.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
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

// Whether every run of the caches starts on a 64-byte line and fills whole
// lines. Streaming a partial line costs a read-modify-write in memory, which
// made streaming slower than plain stores in our measurements.
bool LinesAligned(const StoreParams& p) noexcept {
  uint64_t bits = static_cast<uint64_t>(p.head_bytes);
  for (int s = 0; s < 2; ++s) {
    const RowLayout& l = p.dst_layout[s];
    bits |= reinterpret_cast<uintptr_t>(p.dst[s]) | static_cast<uint64_t>(l.page_stride) |
            static_cast<uint64_t>(l.row_stride);
    if (p.heads > 1) bits |= static_cast<uint64_t>(l.head_stride);
  }
  return (bits & 63) == 0;
}
#endif

// Rows that are one run in unpaged tensors, the common case: two copies a token.
template <typename Index, typename Copy>
void StoreDense(const StoreParams& p, const Index* idx, int64_t begin, int64_t end,
                Copy copy) noexcept {
  const size_t bytes = static_cast<size_t>(p.head_bytes);
  const char* k = static_cast<const char*>(p.src[0]);
  const char* v = static_cast<const char*>(p.src[1]);
  char* kc = static_cast<char*>(p.dst[0]);
  char* vc = static_cast<char*>(p.dst[1]);
  const int64_t ks = p.src_layout[0].page_stride, vs = p.src_layout[1].page_stride;
  const int64_t kcs = p.dst_layout[0].page_stride, vcs = p.dst_layout[1].page_stride;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t slot = static_cast<int64_t>(idx[i]);
    copy(kc + slot * kcs, k + i * ks, bytes);
    copy(vc + slot * vcs, v + i * vs, bytes);
  }
}

template <typename Copy>
void StoreGeneric(const StoreParams& p, int64_t begin, int64_t end, Copy copy) noexcept {
  const size_t bytes = static_cast<size_t>(p.head_bytes);
  for (int64_t i = begin; i < end; ++i) {
    const int64_t slot = LoadSlot(p.indices, p.index_type, i);
    for (int s = 0; s < 2; ++s) {
      const char* src = static_cast<const char*>(p.src[s]) + RowOffset(p.src_layout[s], i);
      char* dst = static_cast<char*>(p.dst[s]) + RowOffset(p.dst_layout[s], slot);
      for (int64_t h = 0; h < p.heads; ++h) {
        copy(dst + h * p.dst_layout[s].head_stride, src + h * p.src_layout[s].head_stride, bytes);
      }
    }
  }
}

// Stores tokens [begin, end).
template <typename Copy>
void StoreRange(const StoreParams& p, int64_t begin, int64_t end, Copy copy) noexcept {
  const bool dense = p.heads == 1 && p.src_layout[0].page_size == 1 &&
                     p.src_layout[1].page_size == 1 && p.dst_layout[0].page_size == 1 &&
                     p.dst_layout[1].page_size == 1;
  if (!dense) {
    StoreGeneric(p, begin, end, copy);
  } else if (p.index_type == IndexType::kInt32) {
    StoreDense(p, static_cast<const int32_t*>(p.indices), begin, end, copy);
  } else {
    StoreDense(p, static_cast<const int64_t*>(p.indices), begin, end, copy);
  }
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
  StoreParams p = params;
  p.indices = indices;
  SimplifyStore(&p);
  const int64_t written = 2 * p.num_tokens * p.heads * p.head_bytes;
#if RADIXKV_STREAM_STORES
  if (written >= kStreamBytes && LinesAligned(p) && HasAvx2()) {
    StoreRange(p, 0, p.num_tokens, StreamingCopy{});
    _mm_sfence();  // order the streamed lines before anything the caller does next
    return check;
  }
#endif
  const int threads = static_cast<int>(
      std::min<int64_t>(std::max(max_threads, 1), std::max<int64_t>(written / kThreadBytes, 1)));
  if (threads > 1) {
    StoreParallel(p, threads);
  } else {
    StoreRange(p, 0, p.num_tokens, CachedCopy{});
  }
  return check;
}

}  // namespace radixkv
