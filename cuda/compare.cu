#include <cstdint>

#include "compare.cuh"

namespace radixkv::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr int kPerLane = 4;  // tokens per lane per step: one 16-byte load
constexpr int64_t kMaxBlocks = 65535;
constexpr unsigned kFullMask = 0xffffffffu;

// Position of the first of this lane's kPerLane tokens at `start` that differ,
// or kPerLane; tokens at or past `n` count as equal.
__device__ __forceinline__ int LaneMismatch(const int32_t* q, const int32_t* k, int64_t start,
                                            int64_t n, bool vector_loads) {
  if (vector_loads && start + kPerLane <= n) {
    const int4 x = *reinterpret_cast<const int4*>(q + start);
    const int4 y = *reinterpret_cast<const int4*>(k + start);
    return x.x != y.x ? 0 : x.y != y.y ? 1 : x.z != y.z ? 2 : x.w != y.w ? 3 : kPerLane;
  }
  for (int j = 0; j < kPerLane; ++j) {
    if (start + j < n && q[start + j] != k[start + j]) return j;
  }
  return kPerLane;
}

// One warp per key; every branch below is uniform across the warp.
__global__ void __launch_bounds__(kThreads)
    FirstMismatchKernel(const CompareBatch c, bool vector_loads) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / kWarp;
  for (int64_t b = warp; b < c.num_keys; b += warps) {
    int64_t len = c.key_cols;
    if (c.key_lens != nullptr) {
      len = LoadSlot(c.key_lens, c.len_type, b);
      len = len < 0 ? 0 : (len > c.key_cols ? c.key_cols : len);
    }
    const int64_t n = c.query_len < len ? c.query_len : len;
    const int32_t* key = c.keys + b * c.key_stride;
    int64_t result = n;
    for (int64_t base = 0; base < n; base += kWarp * kPerLane) {
      const int local = LaneMismatch(c.query, key, base + lane * kPerLane, n, vector_loads);
      const unsigned hits = __ballot_sync(kFullMask, local < kPerLane);
      if (hits != 0) {
        const int first = __ffs(static_cast<int>(hits)) - 1;
        result = base + first * kPerLane + __shfl_sync(kFullMask, local, first);
        break;
      }
    }
    if (lane == 0) c.out[b] = static_cast<int32_t>(result);
  }
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

cudaError_t LaunchFirstMismatchBatched(const CompareBatch& c, cudaStream_t stream) {
  if (c.num_keys <= 0) return cudaSuccess;
  const bool vector_loads = Aligned16(c.query) && Aligned16(c.keys) && c.key_stride % 4 == 0;
  constexpr int64_t kWarpsPerBlock = kThreads / kWarp;
  int64_t blocks = (c.num_keys + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  FirstMismatchKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(c, vector_loads);
  return cudaGetLastError();
}

}  // namespace radixkv::cuda
