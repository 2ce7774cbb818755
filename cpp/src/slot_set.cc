#include "radixkv/slot_set.h"

#include <algorithm>

namespace radixkv {

void SlotSet::Reserve(int32_t max_slot) {
  const size_t words = (static_cast<size_t>(max_slot) >> 6) + 1;
  if (words > words_.size()) words_.resize(std::max(words, words_.size() * 2), 0);
}

int64_t SlotSet::AddAll(const int32_t* slots, int64_t n) {
  if (n == 0) return -1;
  Reserve(*std::max_element(slots, slots + n));
  int64_t i = 0;
  while (i < n) {
    const int64_t run_start = i;
    const uint32_t w = static_cast<uint32_t>(slots[i]) >> 6;
    uint64_t mask = 0;
    do {
      const uint64_t bit = uint64_t{1} << (slots[i] & 63);
      if ((mask | words_[w]) & bit) {
        RemoveAll(slots, run_start);
        return i;
      }
      mask |= bit;
      ++i;
    } while (i < n && (static_cast<uint32_t>(slots[i]) >> 6) == w);
    words_[w] |= mask;
  }
  return -1;
}

void SlotSet::RemoveAll(const int32_t* slots, int64_t n) noexcept {
  int64_t i = 0;
  while (i < n) {
    const uint32_t w = static_cast<uint32_t>(slots[i]) >> 6;
    uint64_t mask = 0;
    do {
      mask |= uint64_t{1} << (slots[i] & 63);
      ++i;
    } while (i < n && (static_cast<uint32_t>(slots[i]) >> 6) == w);
    words_[w] &= ~mask;
  }
}

int64_t SlotSet::Count() const noexcept {
  int64_t count = 0;
  for (uint64_t w : words_) count += __builtin_popcountll(w);
  return count;
}

int64_t FindNegative(const int32_t* slots, int64_t n) noexcept {
  for (int64_t i = 0; i < n; ++i) {
    if (slots[i] < 0) return i;
  }
  return -1;
}

int64_t FindRepeat(const int32_t* slots, int64_t n, SlotSet* scratch) {
  const int64_t at = scratch->AddAll(slots, n);
  if (at < 0) scratch->RemoveAll(slots, n);
  return at;
}

}  // namespace radixkv
