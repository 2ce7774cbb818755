#include "radixkv/slot_set.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "radixkv/status.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace radixkv {
namespace {

// The bits of word `w` that fall in the slot range [lo, hi).
uint64_t RangeMask(int64_t w, int64_t lo, int64_t hi) noexcept {
  const int64_t base = w << 6;
  const int64_t a = std::max(lo, base) - base;       // 0..63
  const int64_t b = std::min(hi, base + 64) - base;  // 1..64
  const uint64_t upto_b = b == 64 ? ~uint64_t{0} : (uint64_t{1} << b) - 1;
  return upto_b & ~((uint64_t{1} << a) - 1);
}

// The end of the run of consecutive slots that starts at `slots[i]`: the
// first j with slots[j] != slots[i] + (j - i). Four at a time with SSE2; the
// arithmetic wraps (unsigned), like the vector lanes.
int64_t RunEnd(const int32_t* slots, int64_t i, int64_t n) noexcept {
  const uint32_t offset = static_cast<uint32_t>(slots[i]) - static_cast<uint32_t>(i);
  int64_t j = i + 1;
#if defined(__SSE2__)
  const __m128i want = _mm_set1_epi32(static_cast<int32_t>(offset));
  const __m128i step = _mm_set1_epi32(4);
  __m128i index = _mm_setr_epi32(static_cast<int32_t>(j), static_cast<int32_t>(j + 1),
                                 static_cast<int32_t>(j + 2), static_cast<int32_t>(j + 3));
  for (; j + 4 <= n; j += 4) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(slots + j));
    const __m128i same = _mm_cmpeq_epi32(_mm_sub_epi32(v, index), want);
    const int eq = _mm_movemask_ps(_mm_castsi128_ps(same));
    if (eq != 0xF) return j + __builtin_ctz(~eq & 0xF);
    index = _mm_add_epi32(index, step);
  }
#endif
  while (j < n && static_cast<uint32_t>(slots[j]) - static_cast<uint32_t>(j) == offset) ++j;
  return j;
}

// Calls fn(at, lo, hi) for each maximal run slots[at, ...) = [lo, hi); stops
// early, returning false, when fn does.
template <typename Fn>
bool ForEachRun(const int32_t* slots, int64_t n, Fn fn) {
  for (int64_t i = 0; i < n;) {
    const int64_t j = RunEnd(slots, i, n);
    if (!fn(i, int64_t{slots[i]}, int64_t{slots[i]} + (j - i))) return false;
    i = j;
  }
  return true;
}

// The same over runs found before.
template <typename Fn>
bool ForEachRun(const SlotRuns& runs, Fn fn) {
  for (const SlotRun& r : runs) {
    if (!fn(r.at, r.lo, r.hi)) return false;
  }
  return true;
}

// The same over the slots of page ids `ids[0, k)` (page p: slots p *
// page_size + [0, page_size)), consecutive pages one run; `at` in slots.
template <typename Fn>
bool ForEachPageRun(const int32_t* ids, int64_t k, int64_t page_size, Fn fn) {
  for (int64_t i = 0; i < k;) {
    int64_t j = i + 1;
    while (j < k && int64_t{ids[j]} == int64_t{ids[j - 1]} + 1) ++j;
    if (!fn(i * page_size, int64_t{ids[i]} * page_size, (int64_t{ids[j - 1]} + 1) * page_size)) {
      return false;
    }
    i = j;
  }
  return true;
}

constexpr int kWordShift = SlotSet::kChunkShift - 6;  // words per chunk, log2
constexpr int64_t kWordMask = (int64_t{1} << kWordShift) - 1;

}  // namespace

bool SlotRuns::Assign(const int32_t* slots, int64_t n, size_t max_runs) {
  runs_.clear();
  return ForEachRun(slots, n, [&](int64_t at, int64_t lo, int64_t hi) {
    if (max_runs > 0 && runs_.size() == max_runs) return false;
    runs_.push_back(SlotRun{lo, hi, at});
    return true;
  });
}

void SlotRuns::AssignPageIds(const int32_t* ids, int64_t k, int64_t page_size) {
  runs_.clear();
  ForEachPageRun(ids, k, page_size, [&](int64_t at, int64_t lo, int64_t hi) {
    runs_.push_back(SlotRun{lo, hi, at});
    return true;
  });
}

void SlotRuns::DropBefore(int64_t from) {
  size_t first = 0;
  while (first < runs_.size() && runs_[first].at + (runs_[first].hi - runs_[first].lo) <= from) {
    ++first;
  }
  runs_.erase(runs_.begin(), runs_.begin() + static_cast<std::ptrdiff_t>(first));
  if (!runs_.empty() && runs_[0].at < from) {
    runs_[0].lo += from - runs_[0].at;
    runs_[0].at = from;
  }
}

void SlotRuns::DropAfter(int64_t to) {
  while (!runs_.empty() && runs_.back().at >= to) runs_.pop_back();
  if (!runs_.empty() && runs_.back().at + (runs_.back().hi - runs_.back().lo) > to) {
    runs_.back().hi = runs_.back().lo + (to - runs_.back().at);
  }
}

void SlotRuns::Shrink() {
  if (runs_.capacity() > 4096) std::vector<SlotRun>().swap(runs_);
}

int64_t SlotRuns::FindOutOfRange(int64_t limit) const noexcept {
  const int64_t bound = limit >= 0 ? limit : int64_t{1} << 31;
  for (const SlotRun& r : runs_) {
    // A run rises by one a slot, so its first slot is its smallest.
    if (r.lo < 0) return r.at;
    if (r.hi > bound) return r.at + std::max<int64_t>(0, bound - r.lo);
  }
  return -1;
}

void SlotSet::FreeChunk(size_t c) noexcept {
  chunks_[c].reset();
  if (c + 1 != chunks_.size()) return;
  while (!chunks_.empty() && !chunks_.back()) chunks_.pop_back();
  if (chunks_.capacity() > 2 * chunks_.size() + 16) chunks_.shrink_to_fit();
}

// Slots come mostly in runs of consecutive values, so every loop works a run
// at a time, a word at a time.
template <typename ForEachRunFn>
int64_t SlotSet::AddRuns(ForEachRunFn for_each_slot_run) {
  // Runs of slots as runs of bits (a bit per page when pages are bits).
  auto for_each_run = [&](auto fn) {
    return for_each_slot_run([&](int64_t at, int64_t lo, int64_t hi) {
      return fn(at, lo >> shift_, ((hi - 1) >> shift_) + 1);
    });
  };
  auto release_empty = [&] {
    for_each_run([&](int64_t, int64_t lo, int64_t hi) {
      for (size_t c = static_cast<size_t>(lo >> kChunkShift);
           c <= static_cast<size_t>((hi - 1) >> kChunkShift) && c < chunks_.size(); ++c) {
        if (chunks_[c] && chunks_[c]->count == 0) FreeChunk(c);
      }
      return true;
    });
  };
  // The only allocation, before anything is added.
  try {
    for_each_run([&](int64_t, int64_t lo, int64_t hi) {
      const size_t last = static_cast<size_t>((hi - 1) >> kChunkShift);
      if (last >= chunks_.size()) chunks_.resize(last + 1);
      for (size_t c = static_cast<size_t>(lo >> kChunkShift); c <= last; ++c) {
        if (!chunks_[c]) chunks_[c] = std::make_unique<Chunk>();
      }
      return true;
    });
  } catch (...) {
    release_empty();
    throw;
  }
  int64_t found = -1;
  size_t added = 0;
  for_each_run([&](int64_t at, int64_t lo, int64_t hi) {
    for (int64_t w = lo >> 6; w <= (hi - 1) >> 6; ++w) {
      const uint64_t word = chunks_[w >> kWordShift]->words[w & kWordMask];
      if (const uint64_t hit = word & RangeMask(w, lo, hi)) {
        found = at + (((w << 6) + __builtin_ctzll(hit) - lo) << shift_);
        return false;
      }
    }
    for (int64_t w = lo >> 6; w <= (hi - 1) >> 6; ++w) {
      Chunk* chunk = chunks_[w >> kWordShift].get();
      chunk->words[w & kWordMask] |= RangeMask(w, lo, hi);
      chunk->count += std::min(hi, (w + 1) << 6) - std::max(lo, w << 6);
    }
    ++added;
    return true;
  });
  if (found >= 0) {
    // Take back the runs added before the failing one; chunks made for the
    // rest are empty.
    size_t k = 0;
    RemoveBits([&](auto fn) {
      for_each_run(
          [&](int64_t at, int64_t lo, int64_t hi) { return k++ < added && fn(at, lo, hi); });
    });
    release_empty();
  }
  return found;
}

template <typename ForEachRunFn>
void SlotSet::RemoveRuns(ForEachRunFn for_each_slot_run) noexcept {
  RemoveBits([&](auto fn) {
    return for_each_slot_run([&](int64_t at, int64_t lo, int64_t hi) {
      return fn(at, lo >> shift_, ((hi - 1) >> shift_) + 1);
    });
  });
}

template <typename ForEachRunFn>
void SlotSet::RemoveBits(ForEachRunFn for_each_run) noexcept {
  for_each_run([&](int64_t, int64_t lo, int64_t hi) {
    for (int64_t w = lo >> 6; w <= (hi - 1) >> 6; ++w) {
      const size_t c = static_cast<size_t>(w >> kWordShift);
      Chunk* chunk = c < chunks_.size() ? chunks_[c].get() : nullptr;
      if (chunk == nullptr) continue;  // not present (a caller's bug; nothing to do)
      uint64_t& word = chunk->words[w & kWordMask];
      const uint64_t mask = word & RangeMask(w, lo, hi);
      word &= ~mask;
      chunk->count -= __builtin_popcountll(mask);
      if (chunk->count == 0) FreeChunk(c);
    }
    return true;
  });
}

bool SlotSet::AnyIn(int64_t lo, int64_t hi) const noexcept {
  if (hi <= lo) return false;
  lo >>= shift_;
  hi = ((hi - 1) >> shift_) + 1;
  const int64_t end = std::min(hi, static_cast<int64_t>(chunks_.size()) << kChunkShift);
  for (int64_t w = lo >> 6; lo < end && w <= (end - 1) >> 6; ++w) {
    const Chunk* chunk = chunks_[w >> kWordShift].get();
    if (chunk != nullptr && (chunk->words[w & kWordMask] & RangeMask(w, lo, end)) != 0) {
      return true;
    }
  }
  return false;
}

int64_t SlotSet::AddAll(const int32_t* slots, int64_t n) {
  return AddRuns([&](auto fn) { return ForEachRun(slots, n, fn); });
}

int64_t SlotSet::AddAll(const SlotRuns& runs) {
  return AddRuns([&](auto fn) { return ForEachRun(runs, fn); });
}

void SlotSet::RemoveAll(const int32_t* slots, int64_t n) noexcept {
  RemoveRuns([&](auto fn) { return ForEachRun(slots, n, fn); });
}

void SlotSet::RemoveAll(const SlotRuns& runs) noexcept {
  RemoveRuns([&](auto fn) { return ForEachRun(runs, fn); });
}

int64_t SlotSet::AddPageIds(const int32_t* ids, int64_t k, int64_t page_size) {
  const int64_t at =
      AddRuns([&](auto fn) { return ForEachPageRun(ids, k, page_size, fn); });
  return at < 0 ? -1 : at / page_size;
}

void SlotSet::RemovePageIds(const int32_t* ids, int64_t k, int64_t page_size) noexcept {
  RemoveRuns([&](auto fn) { return ForEachPageRun(ids, k, page_size, fn); });
}

void SlotSet::RemovePages(const int32_t* first, int64_t pages, int64_t page_size) noexcept {
  if (page_size == 1) {
    RemoveAll(first, pages);
    return;
  }
  RemoveRuns([&](auto fn) {
    // Pages that follow on from each other make one run.
    for (int64_t k = 0; k < pages;) {
      int64_t j = k + 1;
      while (j < pages && int64_t{first[j]} == int64_t{first[j - 1]} + page_size) ++j;
      if (!fn(k * page_size, int64_t{first[k]}, int64_t{first[j - 1]} + page_size)) return;
      k = j;
    }
  });
}

int64_t SlotSet::Count() const noexcept {
  int64_t count = 0;
  for (const auto& c : chunks_) count += c ? c->count : 0;
  return count << shift_;
}

size_t SlotSet::MemoryBytes() const noexcept {
  size_t bytes = chunks_.capacity() * sizeof(chunks_[0]);
  for (const auto& c : chunks_) bytes += c ? sizeof(Chunk) : 0;
  return bytes;
}

void SlotSet::Clear() noexcept { std::vector<std::unique_ptr<Chunk>>().swap(chunks_); }

int64_t FindOutOfRange(const int32_t* slots, int64_t n, int64_t limit) noexcept {
  // Negative slots wrap to huge unsigned values, so one comparison tests both
  // ends; a branch-free pass first (it vectorizes), the search only on failure.
  const uint32_t bound = limit >= 0 && limit <= std::numeric_limits<int32_t>::max()
                             ? static_cast<uint32_t>(limit)
                             : uint32_t{1} << 31;
  uint32_t high = 0;
  for (int64_t i = 0; i < n; ++i) high = std::max(high, static_cast<uint32_t>(slots[i]));
  if (n == 0 || high < bound) return -1;
  for (int64_t i = 0; i < n; ++i) {
    if (static_cast<uint32_t>(slots[i]) >= bound) return i;
  }
  return -1;
}

int64_t FindRepeat(const SlotRuns& runs, SlotSet* scratch) {
  // Few runs (the usual case) are checked by sorting them; many, or an
  // overlap, go through the bitmap, which also finds the first repeat.
  constexpr size_t kMaxRuns = 64;
  if (runs.size() <= kMaxRuns) {
    std::pair<int64_t, int64_t> sorted[kMaxRuns];
    size_t count = 0;
    for (const SlotRun& r : runs) sorted[count++] = {r.lo, r.hi};
    std::sort(sorted, sorted + count);
    bool overlap = false;
    for (size_t k = 1; k < count && !overlap; ++k) overlap = sorted[k].first < sorted[k - 1].second;
    if (!overlap) return -1;
  }
  const int64_t at = scratch->AddAll(runs);
  if (at < 0) scratch->RemoveAll(runs);
  return at;
}

int64_t FindRepeat(const int32_t* slots, int64_t n, SlotSet* scratch) {
  SlotRuns runs;
  runs.Assign(slots, n);
  return FindRepeat(runs, scratch);
}

void CheckSlots(const SlotRuns& runs, const int32_t* slots, const char* name, SlotSet* scratch,
                int64_t limit) {
  const int64_t bad = runs.FindOutOfRange(limit);
  if (bad >= 0) {
    RADIXKV_CHECK(slots[bad] >= 0, ErrorCode::kInvalidArgument, name, "[", bad, "] = ", slots[bad],
                  " is negative");
    throw Error(ErrorCode::kInvalidArgument,
                StrCat(name, "[", bad, "] = ", slots[bad], " is out of range [0, ", limit, ")"));
  }
  const int64_t rep = FindRepeat(runs, scratch);
  RADIXKV_CHECK(rep < 0, ErrorCode::kInvalidArgument, name, "[", rep,
                "] = ", rep < 0 ? 0 : slots[rep], " appears twice in ", name);
}

void CheckSlots(const int32_t* slots, int64_t n, const char* name, SlotSet* scratch,
                int64_t limit) {
  SlotRuns runs;
  runs.Assign(slots, n);
  CheckSlots(runs, slots, name, scratch, limit);
}

int64_t FindBrokenPage(const int32_t* slots, int64_t n, int64_t page_size, bool aligned) noexcept {
  if (page_size == 1) return -1;
  for (int64_t p = 0; p < n; p += page_size) {
    if (aligned && slots[p] % page_size != 0) return p;
    const int64_t end = RunEnd(slots, p, p + page_size);
    if (end < p + page_size) return end;
  }
  return -1;
}

namespace {

[[noreturn]] void ThrowBrokenPage(const int32_t* slots, int64_t bad, int64_t page_size,
                                  const char* name) {
  const int64_t start = bad - bad % page_size;
  if (bad == start) {  // (only an aligned check breaks a page at its first slot)
    throw Error(ErrorCode::kInvalidArgument,
                StrCat(name, "[", bad, "] = ", slots[bad], " does not start a page: with page_size ",
                       page_size, " a page's first slot is a multiple of ", page_size,
                       " (pages are aligned in their pool)"));
  }
  throw Error(ErrorCode::kInvalidArgument,
              StrCat(name, "[", bad, "] = ", slots[bad], " breaks the page at ", name, "[", start,
                     "] = ", slots[start], ": with page_size ", page_size,
                     " the slots of a page are consecutive"));
}

}  // namespace

void CheckPages(const int32_t* slots, int64_t n, int64_t page_size, const char* name,
                bool aligned) {
  const int64_t bad = FindBrokenPage(slots, n, page_size, aligned);
  if (bad >= 0) ThrowBrokenPage(slots, bad, page_size, name);
}

void CheckPages(const SlotRuns& runs, const int32_t* slots, int64_t n, int64_t page_size,
                const char* name, bool aligned) {
  // Runs are maximal, so a page is whole exactly when no run starts inside it.
  for (const SlotRun& r : runs) {
    if (r.at >= n) break;
    if (r.at % page_size != 0 || (aligned && r.lo % page_size != 0)) {
      ThrowBrokenPage(slots, r.at, page_size, name);
    }
  }
}

namespace {

// ExpandPages with page k's first slot `first(k)`.
template <typename FirstFn>
void Expand(FirstFn first, int64_t pages, int64_t page_size, int32_t* out) noexcept {
#if defined(__SSE2__)
  if (page_size % 4 == 0) {
    // Four slots a store: base + {0, 1, 2, 3}, then + 4 each step.
    const __m128i ramp = _mm_setr_epi32(0, 1, 2, 3);
    const __m128i step = _mm_set1_epi32(4);
    for (int64_t k = 0; k < pages; ++k) {
      __m128i v = _mm_add_epi32(_mm_set1_epi32(first(k)), ramp);
      auto* page = reinterpret_cast<__m128i*>(out + k * page_size);
      for (int64_t i = 0; i < page_size / 4; ++i) {
        _mm_storeu_si128(page + i, v);
        v = _mm_add_epi32(v, step);
      }
    }
    return;
  }
#endif
  for (int64_t k = 0; k < pages; ++k) {
    const int32_t base = first(k);
    int32_t* page = out + k * page_size;
    for (int64_t i = 0; i < page_size; ++i) page[i] = base + static_cast<int32_t>(i);
  }
}

}  // namespace

void ExpandPages(const int32_t* first, int64_t pages, int64_t page_size, int32_t* out) noexcept {
  if (page_size == 1) {
    std::memcpy(out, first, static_cast<size_t>(pages) * sizeof(int32_t));
    return;
  }
  Expand([first](int64_t k) { return first[k]; }, pages, page_size, out);
}

void ExpandPageIds(const int32_t* ids, int64_t pages, int64_t page_size, int32_t* out) noexcept {
  const int32_t ps = static_cast<int32_t>(page_size);
  Expand([ids, ps](int64_t k) { return ids[k] * ps; }, pages, page_size, out);
}

void PageIdsOf(const int32_t* first, int64_t pages, int64_t page_size, int32_t* out) noexcept {
  if ((page_size & (page_size - 1)) == 0) {
    // A shift, not a division, a page (first slots are >= 0): it vectorizes.
    const int shift = __builtin_ctzll(static_cast<uint64_t>(page_size));
    for (int64_t k = 0; k < pages; ++k) out[k] = first[k] >> shift;
    return;
  }
  for (int64_t k = 0; k < pages; ++k) out[k] = static_cast<int32_t>(first[k] / page_size);
}

void FirstOfPageIds(const int32_t* ids, int64_t pages, int64_t page_size, int32_t* out) noexcept {
  for (int64_t k = 0; k < pages; ++k) out[k] = static_cast<int32_t>(ids[k] * page_size);
}

void FirstOfPages(const int32_t* slots, int64_t pages, int64_t page_size, int32_t* out) noexcept {
  if (page_size == 1) {
    std::memcpy(out, slots, static_cast<size_t>(pages) * sizeof(int32_t));
    return;
  }
  for (int64_t k = 0; k < pages; ++k) out[k] = slots[k * page_size];
}

}  // namespace radixkv
