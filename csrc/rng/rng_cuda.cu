// CUDA kernel of philox_uniform: one thread per offset.
#include "common/philox.h"
#include "rng/rng.h"

namespace fastformer {

__global__ void philox_uniform_kernel(uint64_t seed, const int64_t* __restrict__ offsets,
                                      float* __restrict__ out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    out[i] = philox_uniform(seed, static_cast<uint64_t>(offsets[i]));
  }
}

void philox_uniform_cuda_launch(uint64_t seed, const int64_t* offsets, float* out, int64_t n,
                                cudaStream_t stream) {
  if (n == 0) return;
  constexpr int kThreads = 256;
  const int64_t wanted = (n + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(wanted < 65535 ? wanted : 65535);
  philox_uniform_kernel<<<blocks, kThreads, 0, stream>>>(seed, offsets, out, n);
}

}  // namespace fastformer
