// Counter-based Philox4x32-10, bit-identical to Triton's tl.randint4x / tl.rand(seed, offset)
// with int64 offsets.
//
// The one dropout RNG of fastformer; fastformer/ops/rng.py is the same in plain PyTorch.
// key = (seed low 32 bits, seed high 32 bits), counter = (offset low, offset high, 0, 0);
// words become floats exactly as Triton's uint_to_uniform_float. philox_uniform is tl.rand (the
// first word); element_uniform / dropout_keep, the scheme of the C++/CUDA ops, take all four
// words of one call for four consecutive elements.
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

// The four output words of Philox4x32-10 for counter (lo, hi, 0, 0): tl.randint4x(seed, offset).
FF_HOST_DEVICE void philox4x32(uint64_t seed, uint64_t offset, uint32_t (&out)[4]) {
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
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

// First output word of Philox4x32-10 for counter (lo, hi, 0, 0).
FF_HOST_DEVICE uint32_t philox_first_word(uint64_t seed, uint64_t offset) {
  uint32_t w[4];
  philox4x32(seed, offset, w);
  return w[0];
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

// Word `lane` (0..3) with selects, not an indexed load: a dynamic index into a register array
// would put it in local memory on the GPU.
FF_HOST_DEVICE uint32_t select_word(const uint32_t (&w)[4], uint64_t lane) {
  return (lane & 2) ? ((lane & 1) ? w[3] : w[2]) : ((lane & 1) ? w[1] : w[0]);
}

// The element scheme of layer_norm and ffn dropout: element i takes word i % 4 of the Philox
// call for counter i / 4, so one call serves four elements. fastformer.ops.rng.element_uniform
// is the same function in PyTorch.
FF_HOST_DEVICE float element_uniform(uint64_t seed, uint64_t i) {
  uint32_t w[4];
  philox4x32(seed, i >> 2, w);
  return uint_to_uniform(select_word(w, i & 3));
}

// Dropout keep decision of element i: kept when element_uniform >= p (probability 1 - p).
FF_HOST_DEVICE bool dropout_keep(uint64_t seed, uint64_t i, float p) {
  return element_uniform(seed, i) >= p;
}

// f(k, keep) for the N elements first .. first + N - 1 with one Philox call per four. N and
// `first` are multiples of 4 (the callers' vectors of 8 or 4 elements in rows of whole vectors):
// a branch for other `first`s, never taken, cost the fused 16-bit LayerNorm forward a 4-byte
// spill on sm_80.
template <int N, typename F>
FF_HOST_DEVICE void for_each_keep(uint64_t seed, uint64_t first, float p, F&& f) {
  static_assert(N % 4 == 0, "for_each_keep takes whole groups of four");
#pragma unroll
  for (int g = 0; g < N / 4; ++g) {
    uint32_t w[4];
    philox4x32(seed, (first >> 2) + g, w);
#pragma unroll
    for (int lane = 0; lane < 4; ++lane) f(4 * g + lane, uint_to_uniform(w[lane]) >= p);
  }
}

}  // namespace fastformer
