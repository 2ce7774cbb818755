// SHA-256 (FIPS 180-4) for the page keys and their MACs: the x86 SHA
// extensions where the CPU has them, portable C++ elsewhere. Private to
// page_hash.cc; its tests compare every length with Python's hashlib.
#pragma once

#include <cstddef>
#include <cstdint>

namespace radixkv {

/// One SHA-256 computation. The state is 104 bytes on the stack, so a page
/// key is a copy of a prefix's state, two updates and a final: no allocation
/// and no library context per page.
class Sha256 {
 public:
  Sha256();
  /// Appends `n` bytes of message.
  void Update(const void* data, size_t n);
  /// Writes the 32-byte digest; the object is spent afterwards.
  void Final(uint8_t* out);

  /// Whether the compression runs on the CPU's SHA instructions (for the
  /// tests and benchmarks; the digest is the same either way).
  static bool Accelerated();

 private:
  uint32_t state_[8];
  uint64_t bytes_ = 0;  // message bytes so far
  uint8_t block_[64];   // the partial block, bytes_ % 64 of it
};

/// The compression function alone over `n` whole 64-byte blocks, portable
/// whatever the CPU has (the tests compare it with the accelerated one).
void Sha256CompressPortable(uint32_t state[8], const uint8_t* blocks, size_t n);

}  // namespace radixkv
