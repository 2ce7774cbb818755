// The page helpers of slot_set.h: a page's slots kept as its first, expanded
// back, checked for being consecutive, and removed from a SlotSet by pages.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "radixkv/slot_set.h"
#include "radixkv/status.h"

namespace radixkv {
namespace {

using Ints = std::vector<int32_t>;

// Pages 7, 2, 3 (3 follows 2) of `page_size` slots, in that order.
Ints SomePages(int64_t page_size) {
  Ints out;
  for (int32_t page : {7, 2, 3}) {
    for (int64_t i = 0; i < page_size; ++i) out.push_back(page * page_size + i);
  }
  return out;
}

TEST(SlotPagesTest, FirstOfPagesAndExpandPagesAreInverse) {
  for (int64_t page_size : {1, 3, 4, 16, 512}) {
    SCOPED_TRACE(page_size);
    const Ints slots = SomePages(page_size);
    Ints first(3), back(slots.size(), -1);
    FirstOfPages(slots.data(), 3, page_size, first.data());
    EXPECT_EQ(first, (Ints{static_cast<int32_t>(7 * page_size), static_cast<int32_t>(2 * page_size),
                           static_cast<int32_t>(3 * page_size)}));
    ExpandPages(first.data(), 3, page_size, back.data());
    EXPECT_EQ(back, slots);
  }
}

TEST(SlotPagesTest, PageIdsAndTheirSlotsGoBothWays) {
  // Powers of two take a shift, the others a division: the same answers.
  for (int64_t page_size : {1, 3, 4, 6, 16, 512}) {
    SCOPED_TRACE(page_size);
    const Ints slots = SomePages(page_size), ids{7, 2, 3};
    Ints first(3), back(3, -1), expanded(slots.size(), -1);
    FirstOfPageIds(ids.data(), 3, page_size, first.data());
    PageIdsOf(first.data(), 3, page_size, back.data());
    EXPECT_EQ(back, ids);
    ExpandPageIds(ids.data(), 3, page_size, expanded.data());
    EXPECT_EQ(expanded, slots);
  }
  // The largest page id of a pool whose slots fill int32.
  const Ints top{(int32_t{1} << 27) - 1};
  Ints first(1), back(1), expanded(16);
  FirstOfPageIds(top.data(), 1, 16, first.data());
  PageIdsOf(first.data(), 1, 16, back.data());
  EXPECT_EQ(back, top);
  ExpandPageIds(top.data(), 1, 16, expanded.data());
  EXPECT_EQ(expanded.back(), std::numeric_limits<int32_t>::max());
}

TEST(SlotPagesTest, ExpandPagesNeedsNoAlignment) {
  const Ints first{5, 100};
  Ints out(8);
  ExpandPages(first.data(), 2, 4, out.data());
  EXPECT_EQ(out, (Ints{5, 6, 7, 8, 100, 101, 102, 103}));
}

TEST(SlotPagesTest, FindBrokenPageFindsTheFirstSlotOutOfStep) {
  for (int64_t page_size : {2, 3, 4, 16, 512}) {
    SCOPED_TRACE(page_size);
    Ints slots = SomePages(page_size);
    const int64_t n = static_cast<int64_t>(slots.size());
    EXPECT_EQ(FindBrokenPage(slots.data(), n, page_size), -1);
    // Every position but a page's first can break it.
    for (int64_t at : {int64_t{1}, page_size + 1, n - 1}) {
      Ints bad = slots;
      bad[at] += 1;
      EXPECT_EQ(FindBrokenPage(bad.data(), n, page_size), at);
    }
    // A page's first slot moved breaks the page at its second.
    Ints bad = slots;
    bad[page_size] -= 1;
    EXPECT_EQ(FindBrokenPage(bad.data(), n, page_size), page_size + 1);
  }
  const Ints any{9, 3, -4};
  EXPECT_EQ(FindBrokenPage(any.data(), 3, 1), -1);
}

TEST(SlotPagesTest, CheckPagesNamesTheArgumentAndBothSlots) {
  Ints slots = SomePages(4);
  slots[6] = 99;
  try {
    CheckPages(slots.data(), 12, 4, "host_slots");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_EQ(std::string(e.what()),
              "host_slots[6] = 99 breaks the page at host_slots[4] = 8: with page_size 4 the "
              "slots of a page are consecutive");
  }
  // From runs: the same verdict, and a partial last page is not checked.
  SlotRuns runs;
  runs.Assign(slots.data(), 12);
  EXPECT_THROW(CheckPages(runs, slots.data(), 12, 4, "indices"), Error);
  runs.Assign(slots.data(), 7);
  EXPECT_NO_THROW(CheckPages(runs, slots.data(), 4, 4, "indices"));
}

TEST(SlotPagesTest, RemovePagesRemovesExactlyThePages) {
  for (int64_t page_size : {1, 4, 512}) {
    SCOPED_TRACE(page_size);
    SlotSet set;
    Ints all(static_cast<size_t>(10 * page_size));
    std::iota(all.begin(), all.end(), 0);
    ASSERT_EQ(set.AddAll(all.data(), static_cast<int64_t>(all.size())), -1);
    const Ints first{static_cast<int32_t>(7 * page_size), static_cast<int32_t>(2 * page_size),
                     static_cast<int32_t>(3 * page_size)};
    set.RemovePages(first.data(), 3, page_size);
    EXPECT_EQ(set.Count(), 7 * page_size);
    for (int32_t s : all) {
      const int64_t page = s / page_size;
      EXPECT_EQ(set.Contains(s), page != 7 && page != 2 && page != 3) << s;
    }
  }
}


// Aligned pages: a page's first slot is a multiple of page_size, checked only
// when asked; a set may then keep a bit a page.
TEST(SlotPagesTest, AlignedPagesAndABitAPage) {
  Ints slots(8);
  std::iota(slots.begin(), slots.end(), 6);  // pages of 4 from 6: whole, not aligned
  EXPECT_EQ(FindBrokenPage(slots.data(), 8, 4), -1);
  EXPECT_EQ(FindBrokenPage(slots.data(), 8, 4, /*aligned=*/true), 0);
  std::iota(slots.begin(), slots.end(), 8);
  EXPECT_EQ(FindBrokenPage(slots.data(), 8, 4, /*aligned=*/true), -1);

  SlotSet pages;
  pages.SetSlotsPerBit(2);  // a bit for 4 slots
  const Ints ids{2, 3, 7};  // slots 8..15 and 28..31
  EXPECT_EQ(pages.AddPageIds(ids.data(), 3, 4), -1);
  EXPECT_EQ(pages.Count(), 12);
  EXPECT_TRUE(pages.Contains(9) && pages.Contains(15) && pages.Contains(28));
  EXPECT_FALSE(pages.Contains(16) || pages.Contains(7) || pages.Contains(27));
  EXPECT_TRUE(pages.AnyIn(28, 32));
  EXPECT_FALSE(pages.AnyIn(16, 28));
  Ints again(4);
  std::iota(again.begin(), again.end(), 28);
  EXPECT_EQ(pages.AddAll(again.data(), 4), 0);  // present: refused, nothing added
  EXPECT_EQ(pages.Count(), 12);
  const Ints more{4, 3};  // page 4 is new, page 3 is not: neither is added
  EXPECT_EQ(pages.AddPageIds(more.data(), 2, 4), 1);
  EXPECT_FALSE(pages.Contains(16));
  pages.RemovePageIds(ids.data(), 2, 4);
  EXPECT_EQ(pages.Count(), 4);
  pages.RemoveAll(again.data(), 4);
  EXPECT_EQ(pages.Count(), 0);
}

}  // namespace
}  // namespace radixkv
