// The free pages of a paged KV pool.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "radixkv/slot_set.h"
#include "radixkv/slot_sink.h"

namespace radixkv {

/// Owns the free pages of a pool of `num_pages` pages of `page_size` token
/// slots; slot `s` belongs to page `s / page_size`. Pages leave through
/// `Allocate` and come back through `Free`, always whole: a page's slots are
/// `page * page_size + [0, page_size)` in that order. Freed pages are handed
/// out again first (LIFO keeps recently used memory warm), a batch freed
/// together in its own order: pages a node or a request held as a run of
/// consecutive pages come out as that run again, which every later check and
/// set of slots takes a run at a time. O(1) per page.
class PageAllocator {
 public:
  /// Throws kInvalidArgument unless `num_pages >= 0`, `page_size >= 1` and
  /// every slot fits in int32.
  PageAllocator(int64_t num_pages, int64_t page_size);

  int64_t num_pages() const noexcept { return num_pages_; }
  int64_t page_size() const noexcept { return page_size_; }
  int64_t num_free_pages() const noexcept { return static_cast<int64_t>(free_.size()); }
  bool IsFree(int64_t page) const noexcept { return is_free_[page] != 0; }

  /// Takes ceil(`num_tokens` / page_size) pages and writes all their slots
  /// to `out(pages * page_size)` (a page sink, SlotSink::Pages(): their ids
  /// to `out(pages)`). Throws kInvalidArgument for a negative count
  /// and kOutOfCapacity when too few pages are free; then, and when `out`
  /// throws, it takes nothing.
  void Allocate(int64_t num_tokens, SlotSink out);
  void Allocate(int64_t num_tokens, std::vector<int32_t>* slots) {
    Allocate(num_tokens, SlotSink::Into(slots));
  }

  /// Returns the pages whose slots are `slots[0, n)`. Throws kInvalidArgument,
  /// freeing nothing, unless `n` covers whole pages in order, every page is
  /// in range and allocated, no page repeats, and (when `cached` is given) no
  /// slot is in `cached`.
  void Free(const int32_t* slots, int64_t n, const SlotSet* cached = nullptr);

  /// Free by page ids: returns pages `ids[0, k)`. Throws kInvalidArgument,
  /// freeing nothing, unless every page is in range and allocated, none
  /// repeats, and (when `cached` is given) none has a slot in `cached`.
  void FreePages(const int32_t* ids, int64_t k, const SlotSet* cached = nullptr);
  /// Throws what FreePages(ids, k, cached) would throw (naming `name`), and
  /// frees nothing either way.
  void CheckFreePages(const int32_t* ids, int64_t k, const char* name,
                      const SlotSet* cached = nullptr);

  /// Throws what Free(slots, n, cached) would throw (naming `name`), and frees
  /// nothing either way: for a caller that must know Free will succeed
  /// before it changes anything else.
  void CheckFree(const int32_t* slots, int64_t n, const char* name,
                 const SlotSet* cached = nullptr);

  /// Slots a caller would free, and the name its errors give them.
  struct Span {
    const int32_t* slots = nullptr;
    int64_t n = 0;
    std::string name;
    /// Whether `slots[0, n)` are page ids (then n pages), not slots.
    bool pages = false;
  };
  /// CheckFree of `spans[0, k)` as one: also throws kInvalidArgument when two
  /// spans hold the same page (naming both). O(pages); frees nothing.
  void CheckFreeAll(const Span* spans, int64_t k, const SlotSet* cached = nullptr);

  /// Throws kInvalidArgument, naming `name`, unless `slots[0, n)` are whole
  /// pages in order that are allocated and (when given) not in `cached`.
  void CheckOwned(const int32_t* slots, int64_t n, const char* name,
                  const SlotSet* cached = nullptr) const;

  /// Throws kIntegrity if a free page has a slot in `cached`, or the free
  /// list and the free flags disagree. O(num_pages).
  void CheckDisjoint(const SlotSet& cached) const;

 private:
  // CheckOwned; true when it checked run by run (then `runs_` holds the
  // runs of `slots`), false when it went page by page.
  bool Check(const int32_t* slots, int64_t n, const char* name, const SlotSet* cached) const;
  // The checks of CheckOwned over the runs of consecutive slots (a page or
  // more each): true when every run passes. False decides nothing: the
  // page-by-page checks find the page at fault and name it.
  bool OwnedByRuns(const int32_t* slots, int64_t n, const SlotSet* cached) const;
  bool AnyFree(int64_t first_page, int64_t end_page) const noexcept;
  // CheckOwned of page ids.
  void CheckOwnedPages(const int32_t* ids, int64_t k, const char* name,
                       const SlotSet* cached) const;
  // The same page by page, naming `ids[i]` as `name[at + i]`: finds the page
  // at fault in a run CheckOwnedPages refused.
  void CheckOwnedPagesOneByOne(const int32_t* ids, int64_t k, int64_t at, const char* name,
                               const SlotSet* cached) const;
  // Marks pages `ids[0, k)` free, undoing the marks and throwing (naming
  // `name`) on a repeated one.
  void MarkPagesFree(const int32_t* ids, int64_t k, const char* name);
  // Marks the pages of `runs_` free; false, marking none, when a page
  // repeats (MarkFree then names it).
  bool MarkRunsFree() noexcept;
  void SetRuns(uint8_t free) noexcept;
  void MarkFree(const int32_t* slots, int64_t n, const char* name);
  // The page of `slot` (a shift at a power-of-two page: the checks run per page).
  int64_t PageOf(int64_t slot) const noexcept {
    return page_shift_ >= 0 ? slot >> page_shift_ : slot / page_size_;
  }

  const int64_t num_pages_;
  const int64_t page_size_;
  const int page_shift_;  // log2(page_size_) when a power of two, else -1
  std::vector<int32_t> free_;     // stack of free page ids
  std::vector<uint8_t> is_free_;  // by page id
  // Scratch of the checks, so even the const ones are for one thread at a
  // time (as every call is: the bindings hold the GIL around them).
  mutable SlotRuns runs_;
};

}  // namespace radixkv
