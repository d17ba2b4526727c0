// fp32 <-> storage-dtype conversions for CUDA kernels (fp32, fp16, bf16).
//
// torch's nvcc flags disable the implicit half/bf16 conversions, so every kernel converts
// explicitly through these; arithmetic is always fp32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace fastformer {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// One 16-byte store to global memory (p 16-byte aligned), always one instruction: nvcc split
// plain 16-byte struct assignments into narrower stores (2- and 4-byte ones in its PTX; four
// 4-byte stores a vector in the sm_90 code of the FFN's 16-bit elementwise kernels and of the
// LayerNorm forward's last chunks of a row).
__device__ __forceinline__ void store16(void* p, const uint4& v) {
#ifdef FASTFORMER_CUDA_EMU  // tests/cuda_emu runs the kernels as host code
  *static_cast<uint4*>(p) = v;
#else
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
#endif
}

// Rounds an fp32 value to T and back: what storing it in T keeps.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_float(from_float<T>(v));
}

}  // namespace fastformer
