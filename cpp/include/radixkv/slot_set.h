// Sets of KV slot indices: runs of consecutive slots, and a bitmap in chunks
// that exist only while they hold a slot.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace radixkv {

/// A run of consecutive slots in an input: `slots[at, at + (hi - lo))` are
/// `lo, lo + 1, ..., hi - 1`.
struct SlotRun {
  int64_t lo;
  int64_t hi;
  int64_t at;
};

/// The maximal runs of consecutive slots of an input, found in one pass
/// (vectorized). Slots come mostly in runs (pages, nodes, fresh allocations),
/// so every later check and bitmap update works a run at a time instead of
/// going over the input again. Reusable across calls.
class SlotRuns {
 public:
  /// Splits `slots[0, n)` into runs. With `max_runs` > 0, stops and returns
  /// false as soon as there would be more than that many (the runs are then
  /// incomplete); returns true otherwise.
  bool Assign(const int32_t* slots, int64_t n, size_t max_runs = 0);
  /// The runs of the slots of page ids `ids[0, k)` (page p holds slots p *
  /// page_size + [0, page_size)), positions in slots (page i at i *
  /// page_size): what Assign finds in those pages expanded.
  void AssignPageIds(const int32_t* ids, int64_t k, int64_t page_size);
  /// Keeps only the runs of `slots[from, n)` (trimming the one holding `from`).
  void DropBefore(int64_t from);
  /// Keeps only the runs of `slots[0, to)` (trimming the one holding `to`).
  void DropAfter(int64_t to);
  /// Frees memory a large input left behind.
  void Shrink();

  const SlotRun* begin() const noexcept { return runs_.data(); }
  const SlotRun* end() const noexcept { return runs_.data() + runs_.size(); }
  size_t size() const noexcept { return runs_.size(); }

  /// Position of the first slot outside `[0, limit)` (`limit` < 0: no upper
  /// bound), or -1.
  int64_t FindOutOfRange(int64_t limit) const noexcept;

 private:
  std::vector<SlotRun> runs_;
};

/// Slot indices (int32, >= 0) as one bit each. The bits live in chunks of
/// `kChunkSlots` slots (8 KiB each), allocated when a slot of the chunk is
/// added and freed when its last slot goes, so memory follows what is stored:
/// one slot near 2^31 costs one chunk and a table of chunk pointers, and
/// nothing after it is removed. Operations over a run of slots gather the bits
/// that share a 64-bit word, so the consecutive slots of a page or a node cost
/// one access per word.
class SlotSet {
 public:
  static constexpr int kChunkShift = 16;
  static constexpr int64_t kChunkSlots = int64_t{1} << kChunkShift;

  SlotSet() = default;
  SlotSet(const SlotSet&) = delete;
  SlotSet& operator=(const SlotSet&) = delete;

  /// Makes a bit stand for `2^shift` consecutive slots from a multiple of
  /// 2^shift (an aligned page): every slot given is then part of a whole such
  /// page, and the set takes 2^shift times less memory. Only while empty.
  void SetSlotsPerBit(int shift) noexcept { shift_ = shift; }
  int slots_per_bit_shift() const noexcept { return shift_; }

  bool Contains(int32_t slot) const noexcept {
    if (slot < 0) return false;
    const uint32_t unit = static_cast<uint32_t>(slot) >> shift_;
    const size_t c = static_cast<size_t>(unit) >> kChunkShift;
    if (c >= chunks_.size() || !chunks_[c]) return false;
    const uint32_t bit = unit & (kChunkSlots - 1);
    return (chunks_[c]->words[bit >> 6] >> (bit & 63)) & 1;
  }

  /// Adds `slots[0, n)`, which must be >= 0. If one is present already (or
  /// repeats within the run) nothing is added and its position is returned;
  /// otherwise returns -1. Throws std::bad_alloc, changing nothing, when a
  /// chunk cannot be allocated.
  int64_t AddAll(const int32_t* slots, int64_t n);
  /// The same for the slots of `runs` (positions as in their input).
  int64_t AddAll(const SlotRuns& runs);

  /// Removes `slots[0, n)` (or those of `runs`); each must be present. Frees
  /// chunks that empty.
  void RemoveAll(const int32_t* slots, int64_t n) noexcept;
  void RemoveAll(const SlotRuns& runs) noexcept;
  /// Removes `pages` pages of `page_size` slots each, page k being
  /// `first[k], first[k] + 1, ..., first[k] + page_size - 1` (see ExpandPages).
  void RemovePages(const int32_t* first, int64_t pages, int64_t page_size) noexcept;

  /// AddAll of the slots of page ids `ids[0, k)` (page p holds slots p *
  /// page_size + [0, page_size)); the position returned is the page's (k),
  /// not a slot's.
  int64_t AddPageIds(const int32_t* ids, int64_t k, int64_t page_size);
  /// Removes the slots of page ids `ids[0, k)`; each must be present.
  void RemovePageIds(const int32_t* ids, int64_t k, int64_t page_size) noexcept;

  /// Whether any of the slots `[lo, hi)` (0 <= lo <= hi) is in the set. One
  /// access per 64-bit word.
  bool AnyIn(int64_t lo, int64_t hi) const noexcept;

  /// Number of slots in the set. O(chunks).
  int64_t Count() const noexcept;

  /// Bytes held: the chunks and the chunk table.
  size_t MemoryBytes() const noexcept;

  /// Removes everything and frees all memory.
  void Clear() noexcept;

 private:
  struct Chunk {
    uint64_t words[kChunkSlots / 64] = {};
    int64_t count = 0;
  };

  template <typename ForEachRun>
  int64_t AddRuns(ForEachRun for_each_run);
  template <typename ForEachRun>
  void RemoveRuns(ForEachRun for_each_run) noexcept;
  // RemoveRuns of runs already in bits.
  template <typename ForEachRun>
  void RemoveBits(ForEachRun for_each_run) noexcept;
  void FreeChunk(size_t c) noexcept;

  std::vector<std::unique_ptr<Chunk>> chunks_;  // by bit >> kChunkShift
  int shift_ = 0;  // a bit stands for 2^shift_ slots (SetSlotsPerBit)
};

/// Returns the position of the first slot of `slots[0, n)` outside `[0,
/// limit)`, or -1. A negative `limit` means no upper bound (only negatives
/// count). One vectorized pass when all are in range.
int64_t FindOutOfRange(const int32_t* slots, int64_t n, int64_t limit = -1) noexcept;

/// Throws kInvalidArgument naming `name` ("indices[3] = -1 is negative",
/// "indices[3] = 9 is out of range [0, 8)", "indices[7] = 12 appears twice in
/// indices") unless every one of `slots[0, n)` is in `[0, limit)` and they are
/// distinct. A negative `limit` means no upper bound. `runs` must hold the
/// runs of `slots[0, n)`; `scratch` as for FindRepeat.
void CheckSlots(const SlotRuns& runs, const int32_t* slots, const char* name, SlotSet* scratch,
                int64_t limit = -1);
/// The same, finding the runs itself.
void CheckSlots(const int32_t* slots, int64_t n, const char* name, SlotSet* scratch,
                int64_t limit = -1);

// --- pages: `page_size` consecutive slots, kept as the first of them ---------------

/// Position of the first slot of `slots[0, n)` (n a multiple of `page_size`)
/// that breaks its page: a page's slots must be consecutive (`slots[p + i] ==
/// slots[p] + i`), and with `aligned` start at a multiple of `page_size`
/// (pages aligned in their pool, so a page is also named by its id,
/// `slots[p] / page_size`); -1 when every page is whole. One vectorized pass (RunEnd
/// per page).
int64_t FindBrokenPage(const int32_t* slots, int64_t n, int64_t page_size,
                       bool aligned = false) noexcept;

/// Throws kInvalidArgument naming `name` ("indices[17] = 40 breaks the page at
/// indices[16] = 768: with page_size 16 the slots of a page are consecutive",
/// with `aligned` "indices[16] = 770 does not start a page ...") unless every
/// page of `slots[0, n)` is whole (and aligned; see FindBrokenPage).
void CheckPages(const int32_t* slots, int64_t n, int64_t page_size, const char* name,
                bool aligned = false);
/// The same from the runs of `slots` (found before; O(runs)).
void CheckPages(const SlotRuns& runs, const int32_t* slots, int64_t n, int64_t page_size,
                const char* name, bool aligned = false);

/// Writes the slots of `pages` pages, page k starting at `first[k]`, to
/// `out[0, pages * page_size)`: `out[k * page_size + i] = first[k] + i`.
void ExpandPages(const int32_t* first, int64_t pages, int64_t page_size, int32_t* out) noexcept;
/// The same from page ids (page p starts at slot p * page_size; every slot
/// must fit in int32): `out[k * page_size + i] = ids[k] * page_size + i`.
void ExpandPageIds(const int32_t* ids, int64_t pages, int64_t page_size, int32_t* out) noexcept;

/// The ids of pages given their first slots: `out[k] = first[k] / page_size`.
void PageIdsOf(const int32_t* first, int64_t pages, int64_t page_size, int32_t* out) noexcept;
/// The first slots of pages given their ids: `out[k] = ids[k] * page_size`.
void FirstOfPageIds(const int32_t* ids, int64_t pages, int64_t page_size, int32_t* out) noexcept;

/// The first slot of each whole page of `slots[0, pages * page_size)`:
/// `out[k] = slots[k * page_size]` (the inverse of ExpandPages).
void FirstOfPages(const int32_t* slots, int64_t pages, int64_t page_size, int32_t* out) noexcept;

/// Returns the position of the first slot that repeats an earlier one, or
/// -1. Slots must be >= 0. `scratch` is working memory, empty again on return
/// (also when it throws std::bad_alloc). O(runs log runs) for inputs made of
/// few runs, O(n + chunks touched * 8 KiB) otherwise.
int64_t FindRepeat(const SlotRuns& runs, SlotSet* scratch);
int64_t FindRepeat(const int32_t* slots, int64_t n, SlotSet* scratch);

}  // namespace radixkv
