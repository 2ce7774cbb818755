#include <cstdint>

#include "radixkv/transfer_index.h"
#include "transfer.cuh"

namespace radixkv::cuda {
namespace {

constexpr int kThreads = 256;

template <typename Vec>
__global__ void __launch_bounds__(kThreads) TransferKernel(const TransferParams p, int lanes_log2) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t lanes = int64_t{1} << lanes_log2;
  const int64_t lane = tid & (lanes - 1);
  const int64_t groups = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> lanes_log2;
  const int64_t rows = TransferRowCount(p);
  for (int64_t r = tid >> lanes_log2; r < rows; r += groups)
    TransferRowPart<Vec>(p, r, lane, lanes);
}

template <typename Vec>
cudaError_t Launch(const TransferParams& p, cudaStream_t stream, int max_blocks) {
  const int64_t vectors = p.row_bytes / static_cast<int64_t>(sizeof(Vec));
  int lanes_log2 = 0;
  while (lanes_log2 < 5 && (int64_t{1} << lanes_log2) < vectors) ++lanes_log2;
  const int64_t rows = TransferRowCount(p);
  const int64_t rows_per_block = kThreads >> lanes_log2;
  int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  if (blocks > max_blocks) blocks = max_blocks;
  TransferKernel<Vec><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p, lanes_log2);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchTransfer(const TransferParams& p, cudaStream_t stream, int max_blocks) {
  if (p.num_tokens <= 0 || p.layer_end <= p.layer_begin) return cudaSuccess;
  if (max_blocks < 1) max_blocks = 1;
  switch (TransferVectorBytes(p)) {
    case 16:
      return Launch<uint4>(p, stream, max_blocks);
    case 8:
      return Launch<uint2>(p, stream, max_blocks);
    case 4:
      return Launch<uint32_t>(p, stream, max_blocks);
    case 2:
      return Launch<uint16_t>(p, stream, max_blocks);
    default:
      return Launch<uint8_t>(p, stream, max_blocks);
  }
}

}  // namespace radixkv::cuda
