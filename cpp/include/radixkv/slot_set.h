// A set of KV slot indices as a growable bitmap.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace radixkv {

/// Slot indices (int32, >= 0) as one bit each, growing to the largest slot
/// added. Operations over a run of slots gather the bits that share a 64-bit
/// word, so the consecutive slots of a page or a node cost one access per word.
class SlotSet {
 public:
  bool Contains(int32_t slot) const noexcept {
    const size_t w = static_cast<uint32_t>(slot) >> 6;
    return slot >= 0 && w < words_.size() && ((words_[w] >> (slot & 63)) & 1);
  }

  /// Adds `slots[0, n)`, which must be >= 0. If one is present already (or
  /// repeats within the run) nothing is added and its position is returned;
  /// otherwise returns -1.
  int64_t AddAll(const int32_t* slots, int64_t n);

  /// Removes `slots[0, n)`; each must be present.
  void RemoveAll(const int32_t* slots, int64_t n) noexcept;

  /// Number of slots in the set. O(capacity / 64).
  int64_t Count() const noexcept;

  void Clear() noexcept { words_.clear(); }

 private:
  void Reserve(int32_t max_slot);
  std::vector<uint64_t> words_;
};

/// Returns the position of the first negative slot in `slots[0, n)`, or -1.
int64_t FindNegative(const int32_t* slots, int64_t n) noexcept;

/// Throws kInvalidArgument naming `name` ("indices[3] = -1 is negative",
/// "indices[7] = 12 appears twice in indices") unless every one of
/// `slots[0, n)` is >= 0 and distinct. `scratch` as for FindRepeat.
void CheckSlots(const int32_t* slots, int64_t n, const char* name, SlotSet* scratch);

/// Returns the position of the first slot of `slots[0, n)` that repeats an
/// earlier one, or -1. Slots must be >= 0. `scratch` is working memory, empty
/// again on return. O(n + max slot / 64).
int64_t FindRepeat(const int32_t* slots, int64_t n, SlotSet* scratch);

}  // namespace radixkv
