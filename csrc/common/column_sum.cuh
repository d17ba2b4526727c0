// Column sums of a (parts, cols) fp32 matrix of partial sums in a fixed order: the last step of
// the deterministic parameter gradients (LayerNorm's dweight / dbias, the FFN's db1).
#pragma once

#include <cstdint>

#include "common/convert.cuh"

namespace fastformer {

constexpr int kColumnSumWidth = 32;  // columns a block sums: blockDim.x

// out[c] for the block's 32 columns, with blockDim (32, kRows): row group y sums rows y,
// y + kRows, ... (many loads in flight per column, unlike one thread walking all rows), then
// the kRows sums are added in order of y. buf: the kernel's __shared__ float[kRows][33].
template <int kRows, typename T>
__device__ __forceinline__ void column_sum(const float* __restrict__ src, int64_t parts,
                                           int64_t cols, T* __restrict__ out,
                                           float (*buf)[kColumnSumWidth + 1]) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kColumnSumWidth + threadIdx.x;
  float s = 0.f;
  if (col < cols) {
    for (int64_t p = threadIdx.y; p < parts; p += kRows) s += src[p * cols + col];
  }
  buf[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float total = buf[0][threadIdx.x];
    for (int y = 1; y < kRows; ++y) total += buf[y][threadIdx.x];
    out[col] = from_float<T>(total);
  }
}

}  // namespace fastformer
