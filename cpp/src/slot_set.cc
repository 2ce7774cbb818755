#include "radixkv/slot_set.h"

#include "radixkv/status.h"

#include <algorithm>
#include <utility>
#include <vector>

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
// first j with slots[j] != slots[i] + (j - i). Four at a time with SSE2.
int64_t RunEnd(const int32_t* slots, int64_t i, int64_t n) noexcept {
  const int32_t offset = slots[i] - static_cast<int32_t>(i);  // slots[j] - j on the run
  int64_t j = i + 1;
#if defined(__SSE2__)
  const __m128i want = _mm_set1_epi32(offset);
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
  while (j < n && slots[j] - static_cast<int32_t>(j) == offset) ++j;
  return j;
}

// Calls fn(i, lo, hi) for each maximal run slots[i, ...) = [lo, hi).
template <typename Fn>
bool ForEachRun(const int32_t* slots, int64_t n, Fn fn) {
  for (int64_t i = 0; i < n;) {
    const int64_t j = RunEnd(slots, i, n);
    if (!fn(i, int64_t{slots[i]}, int64_t{slots[i]} + (j - i))) return false;
    i = j;
  }
  return true;
}

}  // namespace

void SlotSet::Reserve(int32_t max_slot) {
  const size_t words = (static_cast<size_t>(max_slot) >> 6) + 1;
  if (words > words_.size()) words_.resize(std::max(words, words_.size() * 2), 0);
}

// Slots come mostly in runs of consecutive values (pages, nodes, fresh
// allocations), so both loops work a run at a time, a word at a time.
int64_t SlotSet::AddAll(const int32_t* slots, int64_t n) {
  if (n == 0) return -1;
  int64_t top = 0;
  ForEachRun(slots, n, [&](int64_t, int64_t, int64_t hi) {
    top = std::max(top, hi);
    return true;
  });
  Reserve(static_cast<int32_t>(top - 1));
  int64_t found = -1;
  ForEachRun(slots, n, [&](int64_t i, int64_t lo, int64_t hi) {
    for (int64_t w = lo >> 6; w <= (hi - 1) >> 6; ++w) {
      if (const uint64_t hit = words_[w] & RangeMask(w, lo, hi)) {
        RemoveAll(slots, i);
        found = i + ((w << 6) + __builtin_ctzll(hit) - lo);
        return false;
      }
    }
    for (int64_t w = lo >> 6; w <= (hi - 1) >> 6; ++w) words_[w] |= RangeMask(w, lo, hi);
    return true;
  });
  return found;
}

void SlotSet::RemoveAll(const int32_t* slots, int64_t n) noexcept {
  ForEachRun(slots, n, [&](int64_t, int64_t lo, int64_t hi) {
    for (int64_t w = lo >> 6; w <= (hi - 1) >> 6; ++w) words_[w] &= ~RangeMask(w, lo, hi);
    return true;
  });
}

int64_t SlotSet::Count() const noexcept {
  int64_t count = 0;
  for (uint64_t w : words_) count += __builtin_popcountll(w);
  return count;
}

int64_t FindNegative(const int32_t* slots, int64_t n) noexcept {
  // A branch-free minimum first (it vectorizes); the search only on failure.
  int32_t low = 0;
  for (int64_t i = 0; i < n; ++i) low = std::min(low, slots[i]);
  if (low >= 0) return -1;
  for (int64_t i = 0; i < n; ++i) {
    if (slots[i] < 0) return i;
  }
  return -1;
}

int64_t FindRepeat(const int32_t* slots, int64_t n, SlotSet* scratch) {
  // Few runs of consecutive slots (the usual case) are checked by sorting the
  // runs; many, or an overlap, go through the bitmap, which also finds the
  // position of the first repeat.
  constexpr size_t kMaxRuns = 64;
  thread_local std::vector<std::pair<int64_t, int64_t>> runs;
  runs.clear();
  const bool few = ForEachRun(slots, n, [&](int64_t, int64_t lo, int64_t hi) {
    runs.emplace_back(lo, hi);
    return runs.size() <= kMaxRuns;
  });
  if (few) {
    std::sort(runs.begin(), runs.end());
    bool overlap = false;
    for (size_t k = 1; k < runs.size() && !overlap; ++k) {
      overlap = runs[k].first < runs[k - 1].second;
    }
    if (!overlap) return -1;
  }
  const int64_t at = scratch->AddAll(slots, n);
  if (at < 0) scratch->RemoveAll(slots, n);
  return at;
}

void CheckSlots(const int32_t* slots, int64_t n, const char* name, SlotSet* scratch) {
  const int64_t neg = FindNegative(slots, n);
  RADIXKV_CHECK(neg < 0, ErrorCode::kInvalidArgument, name, "[", neg, "] = ",
                neg < 0 ? 0 : slots[neg], " is negative");
  const int64_t rep = FindRepeat(slots, n, scratch);
  RADIXKV_CHECK(rep < 0, ErrorCode::kInvalidArgument, name, "[", rep, "] = ",
                rep < 0 ? 0 : slots[rep], " appears twice in ", name);
}

}  // namespace radixkv
