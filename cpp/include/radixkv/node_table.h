// The radix tree's nodes by id, in chunks that never move.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

namespace radixkv {

/// Elements by a dense index from 0, made one at a time and kept until the
/// table goes. They live in fixed chunks of `kChunk`, so an element never
/// moves (pointers to it stay valid as the table grows) and costs its own
/// size, without an allocation header of its own.
template <typename T>
class NodeTable {
 public:
  static constexpr size_t kChunkShift = 6;
  static constexpr size_t kChunk = size_t{1} << kChunkShift;

  size_t size() const noexcept { return size_; }
  /// Element `i` (< size()).
  T* operator[](size_t i) const noexcept { return &chunks_[i >> kChunkShift][i & (kChunk - 1)]; }

  /// Adds a default-made element at index size() and returns it. Throws
  /// std::bad_alloc, changing nothing.
  T* Add() {
    if ((size_ >> kChunkShift) == chunks_.size()) {
      auto chunk = std::make_unique<T[]>(kChunk);
      chunks_.push_back(std::move(chunk));  // on failure the chunk is freed
    }
    return (*this)[size_++];
  }

 private:
  std::vector<std::unique_ptr<T[]>> chunks_;
  size_t size_ = 0;
};

}  // namespace radixkv
