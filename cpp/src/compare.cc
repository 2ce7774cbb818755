#include "radixkv/compare.h"

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

}  // namespace radixkv
