// Memory for the tree's node storage (tokens and slots): a slab allocator.
#pragma once

#include <cstddef>
#include <cstdint>

namespace radixkv {

/// A slab allocator for node storage. Blocks come in size classes (32-byte
/// steps to 1 KiB, then 32 classes per power of two, so at most 1/32 of a
/// block is rounding: a node of 1,024 tokens at page 512, 4,104 bytes, takes
/// 4,224); each class carves its blocks from slabs of its own,
/// which double in size as the class grows, up to 2 MiB slabs backed by huge
/// pages where the kernel allows (madvise). A tree that grows by a node per
/// request therefore takes one page fault per 2 MiB instead of one per 4 KiB,
/// and a freed block is reused by the next node of its class. A slab whose
/// blocks are all free goes back to the system, except for a few kept for
/// reuse: an empty 2 MiB slab is a spare for any class's next slab (up to
/// 16 MiB, or an eighth of the bytes in use where that is more), a smaller
/// one stays with its class if it is the class's only one with room (up to
/// 16 MiB in all), so neither a class that frees and allocates in turn nor a
/// workload whose node sizes move thrashes.
/// Blocks larger than the largest class come from the system directly.
///
/// Not thread-safe (the tree's mutex covers it).
class NodeArena {
 public:
  struct Slab;
  /// An allocated block: where it is, and the slab it came from (null for a
  /// block from the system). Pass both back to Free.
  struct Block {
    void* data = nullptr;
    Slab* slab = nullptr;
  };

  NodeArena() = default;
  ~NodeArena();
  NodeArena(const NodeArena&) = delete;
  NodeArena& operator=(const NodeArena&) = delete;

  /// A block of at least `bytes` (> 0) bytes, 32-byte aligned. Throws
  /// std::bad_alloc, changing nothing.
  Block Allocate(size_t bytes);
  /// Returns a block from Allocate(bytes) with the same `bytes`.
  void Free(Block block, size_t bytes) noexcept;

  /// Bytes held from the system (slabs and large blocks).
  size_t reserved_bytes() const noexcept { return reserved_; }

  /// The number of size classes, and the block size of class `c`: 32-byte
  /// steps to 1 KiB (kSmallClasses), then kStepsPerOctave steps per power
  /// of two (every step a multiple of 32 bytes), up to 2 MiB blocks.
  static constexpr int kStepShift = 5;
  static constexpr int kStepsPerOctave = 1 << kStepShift;
  static constexpr int kFirstOctave = 10;
  static constexpr int kSmallClasses = (1 << kFirstOctave) / 32;
  static constexpr int kClasses = kSmallClasses + kStepsPerOctave * (21 - kFirstOctave);
  static size_t ClassSize(int c) noexcept;
  /// The smallest class whose blocks hold `bytes`, or -1 if none does.
  static int ClassOf(size_t bytes) noexcept;

 private:
  struct Class {
    Slab* partial = nullptr;  // slabs with a free block, most recent first
    size_t next_slab = 0;     // bytes of the next slab this class makes
  };
  Slab* NewSlab(int c);
  void ReleaseSlab(Slab* slab) noexcept;
  bool MayKeep(size_t bytes) const noexcept;
  void TrimSpares() noexcept;
  static void Unlink(Class* cls, Slab* slab) noexcept;
  static void Link(Class* cls, Slab* slab) noexcept;

  Class classes_[kClasses];
  size_t reserved_ = 0;
  size_t empty_kept_ = 0;  // bytes of empty slabs kept for reuse
  Slab* spare_ = nullptr;  // empty 2 MiB slabs kept for any class
};

}  // namespace radixkv
