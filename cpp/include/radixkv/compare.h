// First-mismatch comparison of token arrays, the inner loop of every tree walk.
#pragma once

#include <cstddef>
#include <cstdint>

namespace radixkv {

/// Returns the index of the first position where `a` and `b` differ, or `n`
/// when the first `n` elements are equal. Vectorized (32 bytes a step with
/// SSE2 on x86-64, 16 with NEON on AArch64, scalar elsewhere). O(n), reads at
/// most `n` elements.
size_t FirstMismatch(const int32_t* a, const int32_t* b, size_t n) noexcept;

}  // namespace radixkv
