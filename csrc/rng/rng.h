// Launchers of the RNG CUDA kernels (raw pointers; the caller has checked the inputs).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fastformer {

// element_scheme false: philox_uniform (tl.rand); true: element_uniform (four per call).
void philox_uniform_cuda_launch(uint64_t seed, const int64_t* offsets, float* out, int64_t n,
                                bool element_scheme, cudaStream_t stream);

}  // namespace fastformer
