// Launchers of the RNG CUDA kernels (raw pointers; the caller has checked the inputs).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fastformer {

void philox_uniform_cuda_launch(uint64_t seed, const int64_t* offsets, float* out, int64_t n,
                                cudaStream_t stream);

}  // namespace fastformer
