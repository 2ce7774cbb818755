// The children of one radix-tree node: an open-addressing hash map from a
// 64-bit key (the first token, or a hash of the first page) to a child.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>

namespace radixkv {

/// Maps a 64-bit key to a `T*`. Several entries may share a key (hashes of
/// different pages can collide); `Find` asks a predicate which one is meant.
/// Linear probing with backward-shift deletion, so there are no tombstones.
/// Empty until the first insert; capacity grows in powers of two and keeps
/// the load at or below 1/2 (short probe runs). Find, Insert and Erase are
/// O(1) expected.
template <typename T>
class ChildMap {
 public:
  ChildMap() = default;
  ChildMap(const ChildMap&) = delete;
  ChildMap& operator=(const ChildMap&) = delete;
  /// Takes `other`'s table (entries and room); `other` is left empty.
  ChildMap& operator=(ChildMap&& other) noexcept {
    slots_ = std::move(other.slots_);
    capacity_ = other.capacity_;
    size_ = other.size_;
    other.capacity_ = 0;
    other.size_ = 0;
    return *this;
  }

  uint32_t size() const noexcept { return size_; }
  bool empty() const noexcept { return size_ == 0; }

  /// Returns the entry with `key` for which `is_match(value)` holds, or null.
  template <typename Pred>
  T* Find(uint64_t key, Pred is_match) const noexcept {
    if (size_ == 0) return nullptr;
    for (uint32_t i = Slot(key);; i = (i + 1) & mask()) {
      const Entry& e = slots_[i];
      if (e.value == nullptr) return nullptr;
      if (e.key == key && is_match(e.value)) return e.value;
    }
  }

  /// Adds `value` under `key`. The caller guarantees it is not present.
  /// Allocates only when the map holds `Reserve`d room for fewer entries;
  /// throws std::bad_alloc, changing nothing, when that allocation fails.
  void Insert(uint64_t key, T* value) {
    Reserve(size_ + 1);
    Place(key, value);
    ++size_;
  }

  /// Makes room for `n` entries, so inserts up to that many never allocate.
  /// Throws std::bad_alloc, changing nothing.
  void Reserve(uint32_t n) {
    if (uint64_t{n} * 2 <= capacity_) return;
    uint32_t capacity = capacity_ == 0 ? 4 : capacity_;
    while (uint64_t{n} * 2 > capacity) capacity *= 2;
    Rehash(capacity);
  }

  /// Removes the entry holding exactly `value` under `key`; false if absent.
  /// An emptied map frees its table unless `keep_table` (so the entry can be
  /// put back without allocating).
  bool Erase(uint64_t key, const T* value, bool keep_table = false) noexcept {
    if (size_ == 0) return false;
    uint32_t i = Slot(key);
    for (;; i = (i + 1) & mask()) {
      if (slots_[i].value == nullptr) return false;
      if (slots_[i].value == value) break;
    }
    // Shift later members of the probe run back so every entry stays
    // reachable from its home slot.
    uint32_t hole = i;
    for (uint32_t j = (i + 1) & mask(); slots_[j].value != nullptr; j = (j + 1) & mask()) {
      uint32_t home = Slot(slots_[j].key);
      bool movable = ((j - home) & mask()) >= ((j - hole) & mask());
      if (movable) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole] = Entry{};
    --size_;
    if (size_ == 0 && !keep_table) Release();
    return true;
  }

  /// Replaces the value stored for `old_value` by `new_value` (same key).
  void Replace(uint64_t key, const T* old_value, T* new_value) noexcept {
    for (uint32_t i = Slot(key);; i = (i + 1) & mask()) {
      if (slots_[i].value == old_value) {
        slots_[i].value = new_value;
        return;
      }
    }
  }

  /// Entries the table has room for before the next allocation.
  uint32_t room() const noexcept { return capacity_ / 2; }

  /// Calls `fn(key, value)` for every entry, in slot order.
  template <typename Fn>
  void ForEach(Fn fn) const {
    for (uint32_t i = 0; i < capacity_; ++i) {
      if (slots_[i].value != nullptr) fn(slots_[i].key, slots_[i].value);
    }
  }

  void Clear() noexcept {
    Release();
    size_ = 0;
  }

 private:
  struct Entry {
    uint64_t key = 0;
    T* value = nullptr;
  };

  uint32_t mask() const noexcept { return capacity_ - 1; }
  uint32_t Slot(uint64_t key) const noexcept {
    // Fibonacci hashing spreads sequential token ids over the table.
    return static_cast<uint32_t>((key * 0x9E3779B97F4A7C15ull) >> 32) & mask();
  }

  void Place(uint64_t key, T* value) noexcept {
    uint32_t i = Slot(key);
    while (slots_[i].value != nullptr) i = (i + 1) & mask();
    slots_[i] = Entry{key, value};
  }

  // Moves every entry into a new table of `capacity` slots. The new table is
  // allocated before the old one is touched, so a failure changes nothing.
  void Rehash(uint32_t capacity) {
    std::unique_ptr<Entry[]> table(new Entry[capacity]);
    std::unique_ptr<Entry[]> old = std::move(slots_);
    const uint32_t old_capacity = capacity_;
    slots_ = std::move(table);
    capacity_ = capacity;
    for (uint32_t i = 0; i < old_capacity; ++i) {
      if (old[i].value != nullptr) Place(old[i].key, old[i].value);
    }
  }

  void Release() noexcept {
    slots_.reset();
    capacity_ = 0;
  }

  std::unique_ptr<Entry[]> slots_;
  uint32_t capacity_ = 0;
  uint32_t size_ = 0;
};

}  // namespace radixkv
