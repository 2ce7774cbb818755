#include "sha256.h"

#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define RADIXKV_SHA_X86 1
#endif

namespace radixkv {
namespace {

constexpr uint32_t kRound[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

constexpr uint32_t kInitial[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                  0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

inline uint32_t Rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

inline uint32_t LoadBig(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
}

inline void StoreBig(uint8_t* p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<uint8_t>(v >> (8 * (bytes - 1 - i)));
}

#ifdef RADIXKV_SHA_X86
// The state as the SHA instructions hold it: (A, B, E, F) and (C, D, G, H),
// four rounds per group of four message words, the schedule's next group
// from sha256msg1/msg2.
__attribute__((target("sha,sse4.1,ssse3"))) void CompressShaNi(uint32_t state[8],
                                                               const uint8_t* blocks,
                                                               size_t n) {
  const __m128i swap = _mm_set_epi64x(0x0c0d0e0f08090a0bLL, 0x0405060700010203LL);
  __m128i dcba = _mm_loadu_si128(reinterpret_cast<const __m128i*>(state));
  __m128i hgfe = _mm_loadu_si128(reinterpret_cast<const __m128i*>(state + 4));
  const __m128i cdab = _mm_shuffle_epi32(dcba, 0xB1);
  const __m128i efgh = _mm_shuffle_epi32(hgfe, 0x1B);
  __m128i abef = _mm_alignr_epi8(cdab, efgh, 8);
  __m128i cdgh = _mm_blend_epi16(efgh, cdab, 0xF0);
  for (; n > 0; --n, blocks += 64) {
    const __m128i abef0 = abef, cdgh0 = cdgh;
    __m128i w[4];  // the last four groups of the schedule, w[g % 4]
#pragma GCC unroll 16
    for (int g = 0; g < 16; ++g) {
      __m128i& x = w[g % 4];
      if (g < 4) {
        x = _mm_shuffle_epi8(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks + 16 * g)), swap);
      } else {  // W[t-16] + s0(W[t-15]) + W[t-7], then + s1(W[t-2])
        const __m128i& prev = w[(g + 3) % 4];
        x = _mm_sha256msg1_epu32(x, w[(g + 1) % 4]);
        x = _mm_add_epi32(x, _mm_alignr_epi8(prev, w[(g + 2) % 4], 4));
        x = _mm_sha256msg2_epu32(x, prev);
      }
      __m128i wk =
          _mm_add_epi32(x, _mm_loadu_si128(reinterpret_cast<const __m128i*>(kRound + 4 * g)));
      cdgh = _mm_sha256rnds2_epu32(cdgh, abef, wk);  // rounds 4g, 4g+1: now (A..F)
      wk = _mm_shuffle_epi32(wk, 0x0E);
      abef = _mm_sha256rnds2_epu32(abef, cdgh, wk);  // rounds 4g+2, 4g+3
    }
    abef = _mm_add_epi32(abef, abef0);
    cdgh = _mm_add_epi32(cdgh, cdgh0);
  }
  const __m128i feba = _mm_shuffle_epi32(abef, 0x1B);
  const __m128i dchg = _mm_shuffle_epi32(cdgh, 0xB1);
  dcba = _mm_blend_epi16(feba, dchg, 0xF0);
  hgfe = _mm_alignr_epi8(dchg, feba, 8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(state), dcba);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(state + 4), hgfe);
}

bool CpuHasSha() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  const bool ssse3 = c & (1u << 9), sse41 = c & (1u << 19);
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return ssse3 && sse41 && (b & (1u << 29));
}
#endif

using CompressFn = void (*)(uint32_t*, const uint8_t*, size_t);

CompressFn PickCompress() {
#ifdef RADIXKV_SHA_X86
  if (CpuHasSha()) return CompressShaNi;
#endif
  return Sha256CompressPortable;
}

// Chosen on first use (a static in a function: a hash from another file's
// static initialiser still finds it set).
void Compress(uint32_t* state, const uint8_t* blocks, size_t n) {
  static const CompressFn chosen = PickCompress();
  chosen(state, blocks, n);
}

}  // namespace

void Sha256CompressPortable(uint32_t state[8], const uint8_t* blocks, size_t n) {
  for (; n > 0; --n, blocks += 64) {
    uint32_t w[64];
    for (int t = 0; t < 16; ++t) w[t] = LoadBig(blocks + 4 * t);
    for (int t = 16; t < 64; ++t) {
      const uint32_t s0 = Rotr(w[t - 15], 7) ^ Rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
      const uint32_t s1 = Rotr(w[t - 2], 17) ^ Rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
      w[t] = w[t - 16] + s0 + w[t - 7] + s1;
    }
    uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
    uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
    for (int t = 0; t < 64; ++t) {
      const uint32_t t1 = h + (Rotr(e, 6) ^ Rotr(e, 11) ^ Rotr(e, 25)) + ((e & f) ^ (~e & g)) +
                          kRound[t] + w[t];
      const uint32_t t2 = (Rotr(a, 2) ^ Rotr(a, 13) ^ Rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      h = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = b;
      b = a;
      a = t1 + t2;
    }
    state[0] += a;
    state[1] += b;
    state[2] += c;
    state[3] += d;
    state[4] += e;
    state[5] += f;
    state[6] += g;
    state[7] += h;
  }
}

Sha256::Sha256() { std::memcpy(state_, kInitial, sizeof(state_)); }

bool Sha256::Accelerated() {
#ifdef RADIXKV_SHA_X86
  return CpuHasSha();
#else
  return false;
#endif
}

void Sha256::Update(const void* data, size_t n) {
  if (n == 0) return;  // (data may be null)
  auto in = static_cast<const uint8_t*>(data);
  size_t used = bytes_ % 64;
  bytes_ += n;
  if (used > 0) {
    const size_t take = n < 64 - used ? n : 64 - used;
    std::memcpy(block_ + used, in, take);
    in += take;
    n -= take;
    if (used + take < 64) return;
    Compress(state_, block_, 1);
  }
  if (n >= 64) {
    Compress(state_, in, n / 64);
    in += n / 64 * 64;
    n %= 64;
  }
  if (n > 0) std::memcpy(block_, in, n);
}

void Sha256::Final(uint8_t* out) {
  const uint64_t bits = bytes_ * 8;
  size_t used = bytes_ % 64;
  block_[used++] = 0x80;
  if (used > 56) {  // no room for the length: one more block
    std::memset(block_ + used, 0, 64 - used);
    Compress(state_, block_, 1);
    used = 0;
  }
  std::memset(block_ + used, 0, 56 - used);
  StoreBig(block_ + 56, bits, 8);
  Compress(state_, block_, 1);
  for (int i = 0; i < 8; ++i) StoreBig(out + 4 * i, state_[i], 4);
}

}  // namespace radixkv
