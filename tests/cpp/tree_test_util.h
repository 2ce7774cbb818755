// Helpers the tree's test files share: token and slot lists, and insert.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <numeric>
#include <vector>

#include "radixkv/radix_tree.h"

namespace radixkv::testing_util {

using Ints = std::vector<int32_t>;

/// `n` consecutive values from `first`.
inline Ints Iota(int32_t first, int n) {
  Ints out(static_cast<size_t>(n));
  std::iota(out.begin(), out.end(), first);
  return out;
}

/// InsertPrefix of `tokens` with `slots` (the same length).
inline int64_t Insert(RadixTree* tree, const Ints& tokens, const Ints& slots) {
  EXPECT_EQ(tokens.size(), slots.size());
  return tree->InsertPrefix(tokens.data(), slots.data(), static_cast<int64_t>(tokens.size()));
}

}  // namespace radixkv::testing_util
