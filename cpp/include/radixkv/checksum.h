// The storage tier's page checksum: CRC-32C (Castagnoli), with the x86
// SSE4.2 instruction on three streams at once where the CPU has it, and a
// slicing-by-8 table everywhere else.
#pragma once

#include <cstddef>
#include <cstdint>

namespace radixkv {

/// CRC-32C of `data[0, n)`, continuing from `crc` (the value of the bytes
/// before, 0 for none): Crc32c(b, Crc32c(a)) == Crc32c(a || b).
uint32_t Crc32c(const void* data, size_t n, uint32_t crc = 0);

/// The same with the table only (what Crc32c uses without SSE4.2); for tests.
uint32_t Crc32cPortable(const void* data, size_t n, uint32_t crc = 0);

}  // namespace radixkv
