// Counter-based Philox4x32-10, bit-identical to Triton's tl.rand(seed, offset) with int64 offsets.
//
// The one dropout RNG of fastformer: Triton kernels call tl.rand, C++/CUDA kernels call
// philox_uniform, and fastformer/ops/rng.py reproduces both in plain PyTorch. The scheme:
// key = (seed low 32 bits, seed high 32 bits), counter = (offset low, offset high, 0, 0),
// first output word, converted to float exactly as Triton's uint_to_uniform_float.
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define FF_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FF_HOST_DEVICE inline
#endif

namespace fastformer {

FF_HOST_DEVICE uint32_t mulhi32(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

// First output word of Philox4x32-10 for counter (lo, hi, 0, 0) and the seed's two key words.
FF_HOST_DEVICE uint32_t philox_first_word(uint64_t seed, uint64_t offset) {
  constexpr uint32_t kKeyA = 0x9E3779B9u, kKeyB = 0xBB67AE85u;
  constexpr uint32_t kRoundA = 0xD2511F53u, kRoundB = 0xCD9E8D57u;
  uint32_t c0 = static_cast<uint32_t>(offset), c1 = static_cast<uint32_t>(offset >> 32);
  uint32_t c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint32_t old_c0 = c0, old_c2 = c2;
    c0 = mulhi32(kRoundB, old_c2) ^ c1 ^ k0;
    c2 = mulhi32(kRoundA, old_c0) ^ c3 ^ k1;
    c1 = kRoundB * old_c2;
    c3 = kRoundA * old_c0;
    k0 += kKeyA;
    k1 += kKeyB;
  }
  return c0;
}

// Triton's uint_to_uniform_float for 32-bit words: fold the sign, scale below 1.0f.
FF_HOST_DEVICE float uint_to_uniform(uint32_t word) {
  int32_t x = static_cast<int32_t>(word);
  x = x < 0 ? ~x : x;
  return static_cast<float>(x) * 4.6566127342e-10f;
}

// Uniform float in [0, 1) for (seed, offset): the value tl.rand(seed, offset) gives.
FF_HOST_DEVICE float philox_uniform(uint64_t seed, uint64_t offset) {
  return uint_to_uniform(philox_first_word(seed, offset));
}

// Dropout keep decision shared by every op: keep when u >= p (probability 1 - p).
FF_HOST_DEVICE bool dropout_keep(uint64_t seed, uint64_t offset, float p) {
  return philox_uniform(seed, offset) >= p;
}

}  // namespace fastformer
