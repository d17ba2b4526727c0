// CUDA kernels of philox_uniform and element_uniform: one thread per offset.
#include "common/philox.h"
#include "rng/rng.h"

namespace fastformer {

template <bool kElement>
__global__ void philox_uniform_kernel(uint64_t seed, const int64_t* __restrict__ offsets,
                                      float* __restrict__ out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    const uint64_t offset = static_cast<uint64_t>(offsets[i]);
    out[i] = kElement ? element_uniform(seed, offset) : philox_uniform(seed, offset);
  }
}

void philox_uniform_cuda_launch(uint64_t seed, const int64_t* offsets, float* out, int64_t n,
                                bool element_scheme, cudaStream_t stream) {
  if (n == 0) return;
  constexpr int kThreads = 256;
  const int64_t wanted = (n + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(wanted < 65535 ? wanted : 65535);
  if (element_scheme) {
    philox_uniform_kernel<true><<<blocks, kThreads, 0, stream>>>(seed, offsets, out, n);
  } else {
    philox_uniform_kernel<false><<<blocks, kThreads, 0, stream>>>(seed, offsets, out, n);
  }
}

}  // namespace fastformer
