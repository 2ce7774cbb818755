// Indexed binary min-heap of tree nodes ordered by their LRU timestamp.
#pragma once

#include <cstdint>
#include <vector>

namespace radixkv {

/// A min-heap of `T*` keyed on `T::timestamp` (uint64). Each element stores
/// its own position in `T::heap_index` (-1 when absent), so `Erase` and
/// `Update` of an arbitrary element cost O(log n) with no search.
/// The heap does not own its elements.
template <typename T>
class LruHeap {
 public:
  bool empty() const noexcept { return items_.empty(); }
  size_t size() const noexcept { return items_.size(); }
  /// The element with the smallest timestamp. Requires `!empty()`.
  T* top() const noexcept { return items_.front(); }
  static bool Contains(const T* x) noexcept { return x->heap_index >= 0; }

  /// Adds `x`, which must not be in the heap. O(log n).
  void Push(T* x) {
    x->heap_index = static_cast<int64_t>(items_.size());
    items_.push_back(x);
    SiftUp(items_.size() - 1);
  }

  /// Removes and returns the smallest element. Requires `!empty()`. O(log n).
  T* Pop() {
    T* x = items_.front();
    Erase(x);
    return x;
  }

  /// Removes `x`, which must be in the heap. O(log n).
  void Erase(T* x) {
    size_t i = static_cast<size_t>(x->heap_index);
    T* last = items_.back();
    items_.pop_back();
    x->heap_index = -1;
    if (last == x) return;
    items_[i] = last;
    last->heap_index = static_cast<int64_t>(i);
    Restore(i);
  }

  /// Restores order after `x->timestamp` changed. O(log n).
  void Update(T* x) { Restore(static_cast<size_t>(x->heap_index)); }

  void Clear() noexcept {
    for (T* x : items_) x->heap_index = -1;
    items_.clear();
  }

  /// The elements in heap order (for integrity checks).
  const std::vector<T*>& items() const noexcept { return items_; }

  /// True when every parent is no later than its children and every index is
  /// consistent. O(n).
  bool IsValid() const noexcept {
    for (size_t i = 0; i < items_.size(); ++i) {
      if (items_[i]->heap_index != static_cast<int64_t>(i)) return false;
      if (i > 0 && Less(items_[i], items_[(i - 1) / 2])) return false;
    }
    return true;
  }

 private:
  static bool Less(const T* a, const T* b) noexcept { return a->timestamp < b->timestamp; }

  void Restore(size_t i) {
    if (i > 0 && Less(items_[i], items_[(i - 1) / 2])) {
      SiftUp(i);
    } else {
      SiftDown(i);
    }
  }

  void Place(size_t i, T* x) {
    items_[i] = x;
    x->heap_index = static_cast<int64_t>(i);
  }

  void SiftUp(size_t i) {
    T* x = items_[i];
    while (i > 0) {
      size_t parent = (i - 1) / 2;
      if (!Less(x, items_[parent])) break;
      Place(i, items_[parent]);
      i = parent;
    }
    Place(i, x);
  }

  void SiftDown(size_t i) {
    T* x = items_[i];
    const size_t n = items_.size();
    while (true) {
      size_t child = 2 * i + 1;
      if (child >= n) break;
      if (child + 1 < n && Less(items_[child + 1], items_[child])) ++child;
      if (!Less(items_[child], x)) break;
      Place(i, items_[child]);
      i = child;
    }
    Place(i, x);
  }

  std::vector<T*> items_;
};

}  // namespace radixkv
