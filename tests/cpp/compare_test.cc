#include "radixkv/compare.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

namespace radixkv {
namespace {

constexpr size_t kMaxLen = 64;
constexpr size_t kMaxOffset = 4;  // int32 offsets 0..3 cover every 16-byte misalignment

// Spans of length n at offsets off_a and off_b that agree on [0, n) and differ everywhere after,
// so a read past n would show up as a mismatch.
void FillEqualPrefix(size_t n, size_t off_a, size_t off_b, std::vector<int32_t>* a,
                     std::vector<int32_t>* b) {
  a->assign(kMaxLen + 2 * kMaxOffset + 8, 0x7fffffff);
  b->assign(a->size(), -0x7fffffff);
  for (size_t i = 0; i < n; ++i) {
    (*a)[off_a + i] = (*b)[off_b + i] = static_cast<int32_t>(i * 2654435761u);
  }
}

TEST(FirstMismatchTest, EqualSpansReturnLength) {
  std::vector<int32_t> a, b;
  for (size_t off_a = 0; off_a < kMaxOffset; ++off_a) {
    for (size_t off_b = 0; off_b < kMaxOffset; ++off_b) {
      for (size_t n = 0; n <= kMaxLen; ++n) {
        FillEqualPrefix(n, off_a, off_b, &a, &b);
        EXPECT_EQ(FirstMismatch(a.data() + off_a, b.data() + off_b, n), n)
            << "n=" << n << " off_a=" << off_a << " off_b=" << off_b;
      }
    }
  }
}

TEST(FirstMismatchTest, EveryMismatchPosition) {
  std::vector<int32_t> a, b;
  for (size_t off_a = 0; off_a < kMaxOffset; ++off_a) {
    for (size_t off_b = 0; off_b < kMaxOffset; ++off_b) {
      for (size_t n = 1; n <= kMaxLen; ++n) {
        for (size_t pos = 0; pos < n; ++pos) {
          FillEqualPrefix(n, off_a, off_b, &a, &b);
          b[off_b + pos] ^= (pos & 1) ? 1 : static_cast<int32_t>(0x80000000u);
          EXPECT_EQ(FirstMismatch(a.data() + off_a, b.data() + off_b, n), pos)
              << "n=" << n << " pos=" << pos << " off_a=" << off_a << " off_b=" << off_b;
        }
      }
    }
  }
}

TEST(FirstMismatchTest, ReportsFirstOfSeveralMismatches) {
  for (size_t n = 2; n <= kMaxLen; ++n) {
    for (size_t pos = 0; pos + 1 < n; ++pos) {
      std::vector<int32_t> a(n, 5), b(n, 5);
      for (size_t i = pos; i < n; ++i) b[i] = 6;  // every lane from pos on differs
      EXPECT_EQ(FirstMismatch(a.data(), b.data(), n), pos) << "n=" << n << " pos=" << pos;
    }
  }
}

TEST(FirstMismatchTest, ZeroLengthIgnoresContents) {
  int32_t a = 1, b = 2;
  EXPECT_EQ(FirstMismatch(&a, &b, 0), 0u);
  EXPECT_EQ(FirstMismatch(nullptr, nullptr, 0), 0u);
}

// The batched loop against FirstMismatch on each key by hand: lengths from
// `key_lens` (int32 and int64) clamped to the key's columns, the query
// shorter and longer than the keys, and keys laid out with a stride.
TEST(FirstMismatchBatchedTest, MatchesOneCallPerKey) {
  constexpr int64_t kKeys = 6, kCols = 20, kStride = 23;
  std::vector<int32_t> keys(kKeys * kStride, -1);
  for (int64_t b = 0; b < kKeys; ++b) {
    for (int64_t i = 0; i < kCols; ++i) keys[b * kStride + i] = static_cast<int32_t>(i);
    if (b > 0) keys[b * kStride + 3 * b] = 1000;  // key b first differs at 3b
  }
  const std::vector<int64_t> lens64{20, 2, 5, 30, -4, 20};
  const std::vector<int32_t> lens32(lens64.begin(), lens64.end());
  for (const int64_t query_len : {int64_t{0}, int64_t{7}, kCols, int64_t{25}}) {
    std::vector<int32_t> query(query_len);
    std::iota(query.begin(), query.end(), 0);
    for (const void* lens :
         {static_cast<const void*>(nullptr), static_cast<const void*>(lens32.data()),
          static_cast<const void*>(lens64.data())}) {
      std::vector<int32_t> out(kKeys, -7);
      const IndexType type = lens == lens32.data() ? IndexType::kInt32 : IndexType::kInt64;
      FirstMismatchBatched(CompareBatch{query.data(), query_len, keys.data(), kStride, kCols, lens,
                                        type, kKeys, out.data()});
      for (int64_t b = 0; b < kKeys; ++b) {
        const int64_t len = lens ? std::clamp<int64_t>(lens64[b], 0, kCols) : kCols;
        const size_t n = static_cast<size_t>(std::min(query_len, len));
        EXPECT_EQ(out[b], static_cast<int32_t>(FirstMismatch(query.data(), &keys[b * kStride], n)))
            << "key " << b << " query_len " << query_len;
      }
    }
  }
  // Key 0 equals the query on every column; key 1 (length 2) stops before its mismatch.
  std::vector<int32_t> query(kCols), out(kKeys);
  std::iota(query.begin(), query.end(), 0);
  FirstMismatchBatched(CompareBatch{query.data(), kCols, keys.data(), kStride, kCols, lens64.data(),
                                    IndexType::kInt64, kKeys, out.data()});
  EXPECT_EQ(out[0], kCols);
  EXPECT_EQ(out[1], 2);
  EXPECT_EQ(out[2], 5);  // length 5 < the mismatch at 6
  EXPECT_EQ(out[3], 9);  // length 30 clamped to 20; the mismatch at 9 comes first
  EXPECT_EQ(out[4], 0);  // a negative length compares nothing
}

TEST(FirstMismatchBatchedTest, FindsTheFirstLengthOutsideTheColumns) {
  const std::vector<int64_t> ok{0, 4, 8}, high{0, 9, -1}, low{3, -1, 9};
  CompareBatch c{nullptr, 0, nullptr, 8, 8, nullptr, IndexType::kInt64, 3, nullptr};
  EXPECT_EQ(FindBadKeyLength(c), -1);  // no lengths: every key has its columns
  c.key_lens = ok.data();
  EXPECT_EQ(FindBadKeyLength(c), -1);
  c.key_lens = high.data();
  EXPECT_EQ(FindBadKeyLength(c), 1);
  c.key_lens = low.data();
  EXPECT_EQ(FindBadKeyLength(c), 1);
  const std::vector<int32_t> low32{3, 8, -2};
  c.key_lens = low32.data();
  c.len_type = IndexType::kInt32;
  EXPECT_EQ(FindBadKeyLength(c), 2);
}

}  // namespace
}  // namespace radixkv
