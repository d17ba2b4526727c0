// The CPU kernels' dropout step, in vector code (defined in csrc/rng/rng.cpp).
//
// One Philox4x32-10 call is ~60 dependent integer operations, but the calls of a run are
// independent: rng.cpp computes many at once in vector registers (built per instruction set,
// picked at load time), ~4x the scalar rate of common/philox.h on the CI VM's AVX-512 CPU, with
// the same bits. The element-at-a-time forms in philox.h serve the GPU kernels.
#pragma once

#include <cstdint>

namespace fastformer {

// Inverted dropout of the element scheme (dropout_keep in philox.h) in place:
// v[k] *= keep(first + k) ? scale : 0 for k < n (a dropped NaN stays NaN, as in torch).
void dropout_scale_cpu(float* v, int64_t n, uint64_t seed, uint64_t first, float p, float scale);
void dropout_scale_cpu(double* v, int64_t n, uint64_t seed, uint64_t first, float p,
                       double scale);

}  // namespace fastformer
