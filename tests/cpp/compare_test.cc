#include "radixkv/compare.h"

#include <gtest/gtest.h>

#include <cstdint>
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

}  // namespace
}  // namespace radixkv
