// Runs the fuzz target over seeded random inputs when libFuzzer is absent
// (the ctest smoke run): `radix_tree_fuzz_smoke [iterations] [seed]`.
#include <cstdint>
#include <cstdlib>
#include <random>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  const long iterations = argc > 1 ? std::atol(argv[1]) : 3000;
  std::mt19937 rng(argc > 2 ? std::atoi(argv[2]) : 1);
  std::vector<uint8_t> buf;
  for (long i = 0; i < iterations; ++i) {
    buf.resize(rng() % 512);
    for (auto& b : buf) b = static_cast<uint8_t>(rng());
    LLVMFuzzerTestOneInput(buf.data(), buf.size());
  }
  return 0;
}
