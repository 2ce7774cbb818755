#include "radixkv/page_allocator.h"

#include <cstring>
#include <iterator>
#include <limits>
#include <new>

#include "radixkv/status.h"

namespace radixkv {
namespace {
constexpr ErrorCode kInvalid = ErrorCode::kInvalidArgument;
}  // namespace

PageAllocator::PageAllocator(int64_t num_pages, int64_t page_size)
    : num_pages_(num_pages),
      page_size_(page_size),
      page_shift_(page_size >= 1 && (page_size & (page_size - 1)) == 0
                      ? __builtin_ctzll(static_cast<uint64_t>(page_size))
                      : -1) {
  RADIXKV_CHECK(num_pages >= 0, kInvalid, "num_pages must be >= 0, got ", num_pages);
  RADIXKV_CHECK(page_size >= 1, kInvalid, "page_size must be >= 1, got ", page_size);
  RADIXKV_CHECK(num_pages <= std::numeric_limits<int32_t>::max() / page_size, kInvalid,
                "num_pages * page_size = ", num_pages, " * ", page_size,
                " slots do not fit in int32");
  free_.resize(static_cast<size_t>(num_pages));
  // Top of the stack is page 0, so a fresh pool hands out pages in order.
  for (int64_t i = 0; i < num_pages; ++i) free_[i] = static_cast<int32_t>(num_pages - 1 - i);
  is_free_.assign(static_cast<size_t>(num_pages), 1);
}

void PageAllocator::Allocate(int64_t num_tokens, SlotSink sink) {
  RADIXKV_CHECK(num_tokens >= 0, kInvalid, "num_tokens must be >= 0, got ", num_tokens);
  const int64_t pages = num_tokens / page_size_ + (num_tokens % page_size_ != 0);
  RADIXKV_CHECK(pages <= num_free_pages(), ErrorCode::kOutOfCapacity, "cannot allocate ",
                num_tokens, " tokens (", pages, " pages): only ", num_free_pages(),
                " pages are free");
  if (sink.pages()) {
    int32_t* out = sink(pages);
    for (int64_t p = 0; p < pages; ++p) {
      const int32_t page = free_.back();
      free_.pop_back();
      is_free_[page] = 0;
      out[p] = page;
    }
    return;
  }
  int32_t* out = sink(pages * page_size_);
  for (int64_t p = 0; p < pages; ++p) {
    const int32_t page = free_.back();
    free_.pop_back();
    is_free_[page] = 0;
    const int32_t base = static_cast<int32_t>(page * page_size_);
    for (int64_t j = 0; j < page_size_; ++j) *out++ = base + static_cast<int32_t>(j);
  }
}

void PageAllocator::CheckOwned(const int32_t* slots, int64_t n, const char* name,
                               const SlotSet* cached) const {
  Check(slots, n, name, cached);
}

bool PageAllocator::AnyFree(int64_t first_page, int64_t end_page) const noexcept {
  uint8_t any = 0;  // branch-free: it vectorizes
  for (int64_t p = first_page; p < end_page; ++p) any |= is_free_[p];
  return any != 0;
}

bool PageAllocator::OwnedByRuns(const int32_t* slots, int64_t n, const SlotSet* cached) const {
  // Slots scattered page by page gain nothing from runs: give up early.
  const int64_t pages = n / page_size_;
  try {
    if (!runs_.Assign(slots, n, static_cast<size_t>(pages / 4 + 1))) return false;
  } catch (const std::bad_alloc&) {
    return false;  // page by page needs no memory: a free after its check cannot fail
  }
  const int64_t limit = num_pages_ * page_size_;
  for (const SlotRun& r : runs_) {
    // A run of whole pages: it starts a page of the input and of the pool,
    // and spans whole pages.
    if (r.at % page_size_ != 0 || r.lo % page_size_ != 0 || (r.hi - r.lo) % page_size_ != 0 ||
        r.lo < 0 || r.hi > limit) {
      return false;
    }
    if (AnyFree(PageOf(r.lo), PageOf(r.hi))) return false;
    if (cached != nullptr && cached->AnyIn(r.lo, r.hi)) return false;
  }
  return true;
}

bool PageAllocator::Check(const int32_t* slots, int64_t n, const char* name,
                          const SlotSet* cached) const {
  RADIXKV_CHECK(n % page_size_ == 0, kInvalid, name, " has length ", n,
                ", not a whole number of pages of ", page_size_);
  if (OwnedByRuns(slots, n, cached)) return true;
  for (int64_t i = 0; i < n; i += page_size_) {
    const int64_t s = slots[i];
    RADIXKV_CHECK(s >= 0 && s < num_pages_ * page_size_, kInvalid, name, "[", i, "] = ", s,
                  " is out of range [0, ", num_pages_ * page_size_, ")");
    const int64_t page = PageOf(s);
    RADIXKV_CHECK(page * page_size_ == s, kInvalid, name, "[", i, "] = ", s,
                  " does not start a page of ", page_size_);
    // Branch-free over the page (it vectorizes); the slot is found only on failure.
    int32_t differ = 0;
    for (int32_t j = 1; j < page_size_; ++j) differ |= slots[i + j] ^ static_cast<int32_t>(s + j);
    for (int64_t j = 1; differ != 0 && j < page_size_; ++j) {
      RADIXKV_CHECK(slots[i + j] == s + j, kInvalid, name, "[", i + j, "] = ", slots[i + j],
                    " breaks page ", page, ": expected slot ", s + j);
    }
    RADIXKV_CHECK(!is_free_[page], kInvalid, name, "[", i, "] = ", s, " is in page ", page,
                  ", which is free (not allocated)");
    if (cached != nullptr) {
      RADIXKV_CHECK(!cached->Contains(static_cast<int32_t>(s)), kInvalid, name, "[", i, "] = ", s,
                    " is owned by the prefix cache");
    }
  }
  return false;
}

void PageAllocator::CheckOwnedPages(const int32_t* ids, int64_t k, const char* name,
                                    const SlotSet* cached) const {
  RADIXKV_CHECK(k >= 0, kInvalid, name, " has length ", k);
  // A run of consecutive ids at a time (pages freed together come out as
  // runs): its range, its free flags and the cache's bits in one pass each.
  for (int64_t i = 0; i < k;) {
    int64_t j = i + 1;
    while (j < k && int64_t{ids[j]} == int64_t{ids[j - 1]} + 1) ++j;
    const int64_t lo = ids[i], hi = int64_t{ids[j - 1]} + 1;
    if (lo < 0 || hi > num_pages_ || AnyFree(lo, hi) ||
        (cached != nullptr && cached->AnyIn(lo * page_size_, hi * page_size_))) {
      CheckOwnedPagesOneByOne(ids + i, j - i, i, name, cached);
    }
    i = j;
  }
}

// The page of `ids[0, k)` (named from `at` on) that CheckOwnedPages refuses.
void PageAllocator::CheckOwnedPagesOneByOne(const int32_t* ids, int64_t k, int64_t at,
                                            const char* name, const SlotSet* cached) const {
  for (int64_t i = 0; i < k; ++i) {
    const int64_t p = ids[i];
    RADIXKV_CHECK(p >= 0 && p < num_pages_, kInvalid, name, "[", at + i, "] = ", p,
                  " is out of range [0, ", num_pages_, ")");
    RADIXKV_CHECK(!is_free_[p], kInvalid, name, "[", at + i, "] = ", p,
                  " is free (not allocated)");
    RADIXKV_CHECK(cached == nullptr || !cached->AnyIn(p * page_size_, (p + 1) * page_size_),
                  kInvalid, name, "[", at + i, "] = ", p, " is owned by the prefix cache");
  }
}

void PageAllocator::MarkPagesFree(const int32_t* ids, int64_t k, const char* name) {
  int64_t i = 0;
  for (; i < k && !is_free_[ids[i]]; ++i) is_free_[ids[i]] = 1;
  if (i < k) {
    for (int64_t j = 0; j < i; ++j) is_free_[ids[j]] = 0;
    throw Error(kInvalid, StrCat(name, "[", i, "] = ", ids[i], " repeats page ", ids[i]));
  }
}

void PageAllocator::FreePages(const int32_t* ids, int64_t k, const SlotSet* cached) {
  CheckOwnedPages(ids, k, "page_ids", cached);
  MarkPagesFree(ids, k, "page_ids");
  // Reversed onto the stack, so the batch comes back out in its own order.
  free_.insert(free_.end(), std::reverse_iterator<const int32_t*>(ids + k),
               std::reverse_iterator<const int32_t*>(ids));
}

void PageAllocator::CheckFreePages(const int32_t* ids, int64_t k, const char* name,
                                   const SlotSet* cached) {
  CheckOwnedPages(ids, k, name, cached);
  MarkPagesFree(ids, k, name);
  for (int64_t i = 0; i < k; ++i) is_free_[ids[i]] = 0;
}

bool PageAllocator::MarkRunsFree() noexcept {
  for (const SlotRun* r = runs_.begin(); r != runs_.end(); ++r) {
    if (AnyFree(PageOf(r->lo), PageOf(r->hi))) {  // marked by an earlier run
      for (const SlotRun* q = runs_.begin(); q != r; ++q) {
        std::memset(&is_free_[PageOf(q->lo)], 0, PageOf(q->hi) - PageOf(q->lo));
      }
      return false;
    }
    std::memset(&is_free_[PageOf(r->lo)], 1, PageOf(r->hi) - PageOf(r->lo));
  }
  return true;
}

void PageAllocator::SetRuns(uint8_t free) noexcept {
  for (const SlotRun& r : runs_) {
    std::memset(&is_free_[PageOf(r.lo)], free, PageOf(r.hi) - PageOf(r.lo));
  }
}

// Marks the pages of `slots` free, catching a repeated page; undoes the marks
// and throws on one. Returns with them marked.
void PageAllocator::MarkFree(const int32_t* slots, int64_t n, const char* name) {
  int64_t i = 0;
  for (; i < n; i += page_size_) {
    const int64_t page = PageOf(slots[i]);
    if (is_free_[page]) break;
    is_free_[page] = 1;
  }
  if (i < n) {
    for (int64_t k = 0; k < i; k += page_size_) is_free_[PageOf(slots[k])] = 0;
    throw Error(kInvalid,
                StrCat(name, "[", i, "] = ", slots[i], " repeats page ", PageOf(slots[i])));
  }
}

void PageAllocator::CheckFree(const int32_t* slots, int64_t n, const char* name,
                              const SlotSet* cached) {
  if (Check(slots, n, name, cached) && MarkRunsFree()) {
    SetRuns(0);
    return;
  }
  MarkFree(slots, n, name);
  for (int64_t k = 0; k < n; k += page_size_) {
    is_free_[PageOf(slots[k])] = 0;
  }
}

void PageAllocator::CheckFreeAll(const Span* spans, int64_t k, const SlotSet* cached) {
  for (int64_t i = 0; i < k; ++i) {
    if (spans[i].pages) {
      CheckOwnedPages(spans[i].slots, spans[i].n, spans[i].name.c_str(), cached);
    } else {
      CheckOwned(spans[i].slots, spans[i].n, spans[i].name.c_str(), cached);
    }
  }
  // A span's entries a page apart, and the page of its entry at `i`.
  auto step = [&](const Span& s) { return s.pages ? int64_t{1} : page_size_; };
  auto page_at = [&](const Span& s, int64_t i) -> int64_t {
    return s.pages ? int64_t{s.slots[i]} : PageOf(s.slots[i]);
  };
  // Marks each span's pages free in turn: a page marked already repeats in
  // its own span or is held by an earlier one. The marks are undone either way.
  int64_t done = 0, at = 0;  // spans marked whole; slots of span `done` marked
  auto unmark = [&] {
    for (int64_t i = 0; i <= done && i < k; ++i) {
      const int64_t end = i < done ? spans[i].n : at;
      for (int64_t s = 0; s < end; s += step(spans[i])) is_free_[page_at(spans[i], s)] = 0;
    }
  };
  for (; done < k; ++done) {
    const Span& span = spans[done];
    for (at = 0; at < span.n; at += step(span)) {
      const int64_t page = page_at(span, at);
      if (!is_free_[page]) {
        is_free_[page] = 1;
        continue;
      }
      int64_t owner = done;
      for (int64_t i = 0; i < done && owner == done; ++i) {
        for (int64_t s = 0; s < spans[i].n; s += step(spans[i])) {
          if (page_at(spans[i], s) == page) owner = i;
        }
      }
      unmark();
      if (owner == done) {
        throw Error(kInvalid,
                    StrCat(span.name, "[", at, "] = ", span.slots[at], " repeats page ", page));
      }
      throw Error(kInvalid,
                  StrCat(spans[owner].name, " and ", span.name, " both hold page ", page));
    }
    at = 0;
  }
  unmark();
}

void PageAllocator::Free(const int32_t* slots, int64_t n, const SlotSet* cached) {
  // Reversed onto the stack (as FreePages).
  if (Check(slots, n, "indices", cached) && MarkRunsFree()) {
    for (const SlotRun* r = runs_.end(); r != runs_.begin();) {
      --r;
      for (int64_t p = PageOf(r->hi) - 1; p >= PageOf(r->lo); --p)
        free_.push_back(static_cast<int32_t>(p));
    }
    return;
  }
  MarkFree(slots, n, "indices");
  for (int64_t k = n - page_size_; k >= 0; k -= page_size_) {
    free_.push_back(static_cast<int32_t>(PageOf(slots[k])));
  }
}

void PageAllocator::CheckDisjoint(const SlotSet& cached) const {
  int64_t flagged = 0;
  for (int64_t p = 0; p < num_pages_; ++p) flagged += is_free_[p];
  RADIXKV_CHECK(flagged == num_free_pages(), ErrorCode::kIntegrity, flagged,
                " pages are flagged free but the free list holds ", num_free_pages());
  for (int32_t page : free_) {
    RADIXKV_CHECK(is_free_[page], ErrorCode::kIntegrity, "page ", page,
                  " is on the free list but not flagged free");
    for (int64_t j = 0; j < page_size_; ++j) {
      const int32_t s = static_cast<int32_t>(page * page_size_ + j);
      RADIXKV_CHECK(!cached.Contains(s), ErrorCode::kIntegrity, "page ", page,
                    " is both free and cached (slot ", s, ")");
    }
  }
}

}  // namespace radixkv
