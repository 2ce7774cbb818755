#include "radixkv/checksum.h"

#include <array>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define RADIXKV_CRC32C_SSE42 1
#endif

namespace radixkv {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // CRC-32C, reflected

// Slicing-by-8 tables: table[k][b] is the CRC of byte b followed by k zeros.
std::array<std::array<uint32_t, 256>, 8> MakeTables() {
  std::array<std::array<uint32_t, 256>, 8> t{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t c = b;
    for (int i = 0; i < 8; ++i) c = (c >> 1) ^ (kPoly & (0u - (c & 1u)));
    t[0][b] = c;
  }
  for (uint32_t b = 0; b < 256; ++b) {
    for (int k = 1; k < 8; ++k) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFF];
  }
  return t;
}

const std::array<std::array<uint32_t, 256>, 8>& Tables() {
  static const auto tables = MakeTables();
  return tables;
}

#ifdef RADIXKV_CRC32C_SSE42
// Three streams at once: the instruction's latency is three cycles and its
// throughput one a cycle, so a single chain runs at a third of what the unit
// can do. Each round runs the chains over three consecutive kLong-byte
// blocks, then joins them: by linearity, the register after A || B is the
// register after A advanced over |B| zero bytes, xor the register after B
// from zero. ShiftLong advances a register over kLong zero bytes.
constexpr size_t kLong = 4096;

std::array<std::array<uint32_t, 256>, 4> MakeShift() {
  const auto& t = Tables();
  uint32_t basis[32];  // each register bit, advanced over kLong zero bytes
  for (int j = 0; j < 32; ++j) {
    uint32_t r = 1u << j;
    for (size_t i = 0; i < kLong; ++i) r = (r >> 8) ^ t[0][r & 0xFF];
    basis[j] = r;
  }
  std::array<std::array<uint32_t, 256>, 4> z{};
  for (int k = 0; k < 4; ++k) {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t v = 0;
      for (int j = 0; j < 8; ++j) {
        if (b & (1u << j)) v ^= basis[8 * k + j];
      }
      z[k][b] = v;
    }
  }
  return z;
}

uint32_t ShiftLong(uint32_t r) {
  static const auto z = MakeShift();
  return z[0][r & 0xFF] ^ z[1][(r >> 8) & 0xFF] ^ z[2][(r >> 16) & 0xFF] ^ z[3][r >> 24];
}

__attribute__((target("sse4.2"))) uint32_t Crc32cSse42(const uint8_t* p, size_t n, uint32_t crc) {
  uint64_t c = ~crc;
  while (n >= 3 * kLong) {
    uint64_t c1 = 0, c2 = 0;
    for (const uint8_t* end = p + kLong; p < end; p += 8) {
      uint64_t w0, w1, w2;
      std::memcpy(&w0, p, 8);
      std::memcpy(&w1, p + kLong, 8);
      std::memcpy(&w2, p + 2 * kLong, 8);
      c = _mm_crc32_u64(c, w0);
      c1 = _mm_crc32_u64(c1, w1);
      c2 = _mm_crc32_u64(c2, w2);
    }
    c = ShiftLong(static_cast<uint32_t>(c)) ^ static_cast<uint32_t>(c1);
    c = ShiftLong(static_cast<uint32_t>(c)) ^ static_cast<uint32_t>(c2);
    p += 2 * kLong;
    n -= 3 * kLong;
  }
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; n > 0; --n, ++p) c32 = _mm_crc32_u8(c32, *p);
  return ~c32;
}

bool HasSse42() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}
#endif

}  // namespace

uint32_t Crc32cPortable(const void* data, size_t n, uint32_t crc) {
  const auto& t = Tables();
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint32_t lo, hi;  // little-endian words, as the tables assume
    lo = static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
    hi = static_cast<uint32_t>(p[4]) | static_cast<uint32_t>(p[5]) << 8 |
         static_cast<uint32_t>(p[6]) << 16 | static_cast<uint32_t>(p[7]) << 24;
    lo ^= c;
    c = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
        t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
  }
  for (; n > 0; --n, ++p) c = (c >> 8) ^ t[0][(c ^ *p) & 0xFF];
  return ~c;
}

uint32_t Crc32c(const void* data, size_t n, uint32_t crc) {
#ifdef RADIXKV_CRC32C_SSE42
  if (HasSse42()) return Crc32cSse42(static_cast<const uint8_t*>(data), n, crc);
#endif
  return Crc32cPortable(data, n, crc);
}

}  // namespace radixkv
