#include <cstdint>

#include "radixkv/store_index.h"
#include "store.cuh"

namespace radixkv::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;

// Groups of `1 << lanes_log2` threads (1 to 32, inside one warp) each store one
// token at a time, striding over the batch.
template <typename Vec>
__global__ void __launch_bounds__(kThreads) StoreKernel(const StoreParams p, int lanes_log2) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t lanes = int64_t{1} << lanes_log2;
  const int64_t lane = tid & (lanes - 1);
  const int64_t groups = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> lanes_log2;
  for (int64_t i = tid >> lanes_log2; i < p.num_tokens; i += groups) {
    StoreTokenPart<Vec>(p, i, lane, lanes);
  }
}

template <typename Vec>
cudaError_t Launch(const StoreParams& p, cudaStream_t stream) {
  const int64_t vectors = MaxRunUnits(p, static_cast<int64_t>(sizeof(Vec)));
  int lanes_log2 = 0;
  while (lanes_log2 < 5 && (int64_t{1} << lanes_log2) < vectors) ++lanes_log2;
  const int64_t tokens_per_block = kThreads >> lanes_log2;
  int64_t blocks = (p.num_tokens + tokens_per_block - 1) / tokens_per_block;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  StoreKernel<Vec><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p, lanes_log2);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchStore(const StoreParams& params, cudaStream_t stream) {
  if (params.num_tokens <= 0) return cudaSuccess;
  if (params.num_sides < 1 || params.num_sides > kMaxStoreSides) return cudaErrorInvalidValue;
  StoreParams p = params;
  SimplifyStore(&p);
  switch (VectorBytes(p, 16)) {
    case 16:
      return Launch<uint4>(p, stream);
    case 8:
      return Launch<uint2>(p, stream);
    case 4:
      return Launch<uint32_t>(p, stream);
    case 2:
      return Launch<uint16_t>(p, stream);
    default:
      return Launch<uint8_t>(p, stream);
  }
}

}  // namespace radixkv::cuda
