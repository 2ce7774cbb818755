#include "radixkv/compare.h"

#include <algorithm>

#if defined(__SSE2__)
#include <emmintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

namespace radixkv {

size_t FirstMismatch(const int32_t* a, const int32_t* b, size_t n) noexcept {
  size_t i = 0;
#if defined(__SSE2__)
  for (; i + 8 <= n; i += 8) {
    __m128i x0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i));
    __m128i y0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i));
    __m128i x1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i + 4));
    __m128i y1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i + 4));
    int eq0 = _mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(x0, y0)));
    int eq1 = _mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(x1, y1)));
    int eq = eq0 | (eq1 << 4);
    if (eq != 0xFF) return i + static_cast<size_t>(__builtin_ctz(~eq & 0xFF));
  }
#elif defined(__ARM_NEON)
  for (; i + 4 <= n; i += 4) {
    uint32x4_t eq = vceqq_s32(vld1q_s32(a + i), vld1q_s32(b + i));
    if (vminvq_u32(eq) == 0) break;
  }
#endif
  for (; i < n; ++i) {
    if (a[i] != b[i]) return i;
  }
  return n;
}

int64_t FindBadKeyLength(const CompareBatch& c) noexcept {
  if (c.key_lens == nullptr) return -1;
  for (int64_t b = 0; b < c.num_keys; ++b) {
    const int64_t len = LoadSlot(c.key_lens, c.len_type, b);
    if (len < 0 || len > c.key_cols) return b;
  }
  return -1;
}

void FirstMismatchBatched(const CompareBatch& c) noexcept {
  for (int64_t b = 0; b < c.num_keys; ++b) {
    int64_t len = c.key_cols;
    if (c.key_lens != nullptr) {
      len = std::clamp<int64_t>(LoadSlot(c.key_lens, c.len_type, b), 0, c.key_cols);
    }
    const size_t n = static_cast<size_t>(std::min(c.query_len, len));
    c.out[b] = static_cast<int32_t>(FirstMismatch(c.query, c.keys + b * c.key_stride, n));
  }
}

}  // namespace radixkv
