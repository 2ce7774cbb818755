#include <cstdint>

#include "radixkv/page_codec.h"
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

// One warp per (page, side, layer, head) of the whole pages of `p`.
__global__ void __launch_bounds__(kThreads)
    CodecKernel(const TransferParams p, const Float8Pool c, bool encode) {
  const int64_t lane = threadIdx.x & 31;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int64_t layers = p.layer_end - p.layer_begin;
  const int64_t page = p.src.page_size;
  const int64_t per_page = p.src.sides * layers * c.heads;
  const int64_t items = p.num_tokens / page * per_page;
  const PoolLayout& plain = encode ? p.src : p.dst;
  const PoolLayout& packed = encode ? p.dst : p.src;
  const int64_t elements = page * c.head_dim;
  for (int64_t item = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
       item < items; item += warps) {
    const int64_t pg = item / per_page;
    int64_t rest = item - pg * per_page;
    const int64_t side = rest / (layers * c.heads);
    rest -= side * layers * c.heads;
    const int64_t layer = p.layer_begin + rest / c.heads;
    const int64_t h = rest % c.heads;
    const int64_t s = p.src_slots[pg * page], d = p.dst_slots[pg * page];
    const int64_t plain_slot = encode ? s : d, packed_slot = encode ? d : s;
    char* rows = PoolRow(plain, side, layer, plain_slot);
    uint8_t* codes = reinterpret_cast<uint8_t*>(PoolRow(packed, side, layer, packed_slot));
    char* scale_at = c.scales.base + PoolRowOffset(c.scales, side, layer, packed_slot) + h * 4;
    const int64_t first = h * c.head_dim;
    if (encode) {
      uint32_t amax = 0;
      for (int64_t e = lane; e < elements; e += 32) {
        const int64_t r = e / c.head_dim, col = first + (e - r * c.head_dim);
        amax = FiniteMax(amax, LoadSourceFloat(rows + r * plain.row_stride, c.type, col));
      }
      for (int off = 16; off > 0; off >>= 1) {
        const uint32_t other = __shfl_xor_sync(0xFFFFFFFFu, amax, off);
        amax = other > amax ? other : amax;
      }
      const float scale = Float8Scale(amax);
      if (lane == 0) memcpy(scale_at, &scale, 4);
      for (int64_t e = lane; e < elements; e += 32) {
        const int64_t r = e / c.head_dim, col = first + (e - r * c.head_dim);
        codes[r * packed.row_stride + col] =
            ScaledFloat8(LoadSourceFloat(rows + r * plain.row_stride, c.type, col), scale,
                         Float8Format::kE4M3Fn);
      }
    } else {
      float scale;
      memcpy(&scale, scale_at, 4);
      for (int64_t e = lane; e < elements; e += 32) {
        const int64_t r = e / c.head_dim, col = first + (e - r * c.head_dim);
        StoreSourceFloat(rows + r * plain.row_stride, c.type, col,
                         Float8E4M3ToFloat(codes[r * packed.row_stride + col]) * scale);
      }
    }
  }
}

}  // namespace

cudaError_t LaunchCodecTransfer(const TransferParams& p, const Float8Pool& codes, bool encode,
                                cudaStream_t stream, int max_blocks) {
  if (p.num_tokens <= 0 || p.layer_end <= p.layer_begin) return cudaSuccess;
  if (max_blocks < 1) max_blocks = 1;
  const int64_t items =
      p.num_tokens / p.src.page_size * p.src.sides * (p.layer_end - p.layer_begin) * codes.heads;
  int64_t blocks = (items + kThreads / 32 - 1) / (kThreads / 32);
  if (blocks > max_blocks) blocks = max_blocks;
  CodecKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p, codes, encode);
  return cudaGetLastError();
}

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
