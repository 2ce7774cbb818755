// Indexed 4-ary min-heap of node ids ordered by LRU timestamp.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace radixkv {

/// A min-heap of ids (uint32, dense from 0) keyed on a uint64 timestamp. The
/// heap keeps each id's position in a dense array of its own, so `Erase` and
/// `Update` of any member cost O(log n) with no search, and a sift touches
/// only two contiguous arrays, never the elements themselves. 4-ary: half the
/// levels of a binary heap, and the four siblings compared at each level are
/// 64 contiguous bytes (at most two cache lines).
class LruHeap {
 public:
  static constexpr int32_t kAbsent = -1;

  bool empty() const noexcept { return items_.empty(); }
  size_t size() const noexcept { return items_.size(); }
  /// The id with the smallest key. Requires `!empty()`.
  uint32_t top() const noexcept { return items_.front().id; }
  bool Contains(uint32_t id) const noexcept { return id < pos_.size() && pos_[id] != kAbsent; }
  /// The id and key at heap position `i` (for integrity checks).
  uint32_t IdAt(size_t i) const noexcept { return items_[i].id; }
  uint64_t KeyAt(size_t i) const noexcept { return items_[i].key; }
  /// Heap position of `id`, or kAbsent.
  int32_t PositionOf(uint32_t id) const noexcept { return id < pos_.size() ? pos_[id] : kAbsent; }

  /// Makes room for every id below `ids` to be a member at once, so `Push`
  /// of such ids never allocates. Throws std::bad_alloc; a failure changes no
  /// member.
  void Reserve(size_t ids) {
    if (items_.capacity() < ids) items_.reserve(std::max(ids, 2 * items_.capacity()));
    if (pos_.size() < ids) pos_.resize(std::max(ids, 2 * pos_.size()), kAbsent);
  }

  /// Ids below this many can be pushed without allocating.
  size_t room() const noexcept { return std::min(items_.capacity(), pos_.size()); }

  /// Adds `id`, which must not be in the heap, with `key`. O(log n).
  /// Allocates only past the room made by `Reserve`.
  void Push(uint32_t id, uint64_t key) {
    if (id >= pos_.size()) pos_.resize(std::max<size_t>(id + 1, pos_.size() * 2), kAbsent);
    items_.push_back(Entry{key, id});
    SiftUp(items_.size() - 1);
  }

  /// Removes and returns the id with the smallest key. Requires `!empty()`.
  uint32_t Pop() {
    const uint32_t id = items_.front().id;
    Erase(id);
    return id;
  }

  /// Removes `id`, which must be in the heap. O(log n).
  void Erase(uint32_t id) {
    const size_t i = static_cast<size_t>(pos_[id]);
    const Entry last = items_.back();
    items_.pop_back();
    pos_[id] = kAbsent;
    if (last.id == id) return;
    items_[i] = last;
    Restore(i);
  }

  /// Gives `id`, which must be in the heap, a new key. O(log n).
  void Update(uint32_t id, uint64_t key) {
    const size_t i = static_cast<size_t>(pos_[id]);
    items_[i].key = key;
    Restore(i);
  }

  void Clear() noexcept {
    for (const Entry& e : items_) pos_[e.id] = kAbsent;
    items_.clear();
  }

  /// True when no key is smaller than its parent's and every position is
  /// consistent. O(n).
  bool IsValid() const noexcept {
    size_t present = 0;
    for (int32_t p : pos_) present += p != kAbsent;
    if (present != items_.size()) return false;
    for (size_t i = 0; i < items_.size(); ++i) {
      if (PositionOf(items_[i].id) != static_cast<int32_t>(i)) return false;
      if (i > 0 && items_[i].key < items_[Parent(i)].key) return false;
    }
    return true;
  }

 private:
  static constexpr size_t kArity = 4;
  struct Entry {
    uint64_t key;
    uint32_t id;
  };

  static size_t Parent(size_t i) noexcept { return (i - 1) / kArity; }

  void Restore(size_t i) {
    if (i > 0 && items_[i].key < items_[Parent(i)].key) {
      SiftUp(i);
    } else {
      SiftDown(i);
    }
  }

  void Place(size_t i, const Entry& e) noexcept {
    items_[i] = e;
    pos_[e.id] = static_cast<int32_t>(i);
  }

  void SiftUp(size_t i) {
    const Entry x = items_[i];
    while (i > 0) {
      const size_t parent = Parent(i);
      if (!(x.key < items_[parent].key)) break;
      Place(i, items_[parent]);
      i = parent;
    }
    Place(i, x);
  }

  void SiftDown(size_t i) {
    const Entry x = items_[i];
    const size_t n = items_.size();
    while (true) {
      const size_t first = kArity * i + 1;
      if (first >= n) break;
      const size_t end = first + kArity < n ? first + kArity : n;
      size_t best = first;
      for (size_t c = first + 1; c < end; ++c) {
        if (items_[c].key < items_[best].key) best = c;
      }
      if (!(items_[best].key < x.key)) break;
      Place(i, items_[best]);
      i = best;
    }
    Place(i, x);
  }

  std::vector<Entry> items_;
  std::vector<int32_t> pos_;  // by id
};

}  // namespace radixkv
