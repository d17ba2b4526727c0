// A CUDA runtime emulated on the CPU, for compiling the project's .cu files with a host C++
// compiler and running their kernels on CPU memory (tests/cuda_emu/__init__.py does the
// textual rewrites a C++ compiler cannot: `<<<...>>>` launches, `__shared__` declarations).
//
// Blocks run one after another, each as one cooperative fiber per CUDA thread (one OS thread).
// A fiber runs until it reaches a barrier (__syncthreads, a warp intrinsic) or returns. Warps are
// the 32 consecutive linear thread ids of the block, as on the GPU, and scheduling is
// warp-greedy: the lanes of one warp run (in the configured order) until all of them wait at
// __syncthreads; then the first runnable warp in the order goes. In forward order warp 0 runs a
// whole barrier interval before warp 1 starts it, in reverse order the last warp goes first, so
// a missing barrier shows up as a wrong result in one of the two orders. Misuse the GPU would
// punish with a hang, garbage or a launch error is an exception here (a RuntimeError in
// Python): deadlocks, barriers met at different __syncthreads, warp intrinsics naming an exited
// or absent lane, launch shapes over the limits, shared memory over its limits or written past
// its end. Shared memory starts every block as NaN bytes (0xFF), so reading what no thread wrote
// shows up in the results.
//
// The CUDA headers come first (types: dim3, uint4, float2, __half, __nv_bfloat16 and their host
// conversions); the macros below then turn the device dialect into plain C++.
#pragma once

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>

#include "emu_api.h"

namespace emu {
namespace detail {

// What threadIdx / blockIdx / blockDim / gridDim read: the running fiber's values.
struct ThreadCtx {
  uint3 tid;
  uint3 bid;
  dim3 bdim;
  dim3 gdim;
  int linear;  // tid.x + tid.y * bdim.x + tid.z * bdim.x * bdim.y
  int lane;    // linear % 32
  int warp;    // linear / 32
};

extern ThreadCtx* g_cur;  // null outside kernels

[[noreturn]] void fail(const char* what);
void syncthreads(const char* file, int line);
// Warp collective: every lane of `mask` posts `bytes` of `in`; when the last one arrives, lane l
// receives the value of lane src(l) (src < 0: its own value). `op` names the intrinsic.
void warp_exchange(unsigned mask, const void* in, void* out, size_t bytes, int src, const char* op);
// __ballot_sync / __all_sync / __any_sync: the mask of lanes of `mask` whose predicate is set.
unsigned warp_vote(unsigned mask, bool pred, const char* op);
void* block_shared(const void* key, size_t bytes, size_t align);
void* dynamic_shared(size_t align);
void kernel_entry(const char* name, int max_threads);
void run_grid(dim3 grid, dim3 block, size_t smem, const void* kernel, void (*thunk)(void*),
              void* ctx);

inline ThreadCtx& cur() {
  if (g_cur == nullptr) fail("threadIdx/blockIdx/blockDim/gridDim read outside a kernel");
  return *g_cur;
}

template <typename T>
inline void check_exchangeable() {
  static_assert(std::is_trivially_copyable_v<T>, "warp shuffles move trivially copyable values");
  static_assert(sizeof(T) <= 16, "warp shuffles move at most 16 bytes here");
}

template <typename... P>
struct Launch {
  void (*kernel)(P...);
  std::tuple<std::remove_cv_t<P>...> params;
  static void thunk(void* self) {
    auto* l = static_cast<Launch*>(self);
    // Each thread gets its own copy of the parameters, as the kernel parameters are per-thread
    // values on the GPU.
    std::tuple<std::remove_cv_t<P>...> mine = l->params;
    std::apply(l->kernel, mine);
  }
};

}  // namespace detail

// kernel<<<grid, block, smem, stream>>>(args...): the arguments convert to the kernel's parameter
// types once, at the launch (as CUDA copies them into the parameter buffer), then every block
// runs to completion before launch returns (the default stream is in order anyway).
template <typename... P, typename... A>
void launch(dim3 grid, dim3 block, size_t smem, void (*kernel)(P...), A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "kernel launched with the wrong argument count");
  detail::Launch<P...> l{kernel, std::tuple<std::remove_cv_t<P>...>(std::forward<A>(args)...)};
  detail::run_grid(grid, block, smem, reinterpret_cast<const void*>(kernel),
                   &detail::Launch<P...>::thunk, &l);
}

// `__shared__ T name[N]...;` (one object per block, shared by its threads).
template <typename T>
T& block_shared(const void* key) {
  return *static_cast<T*>(detail::block_shared(key, sizeof(T), alignof(T)));
}

// `extern __shared__ T name[];` (the launch's dynamic shared memory).
template <typename T>
T* dynamic_shared() {
  return static_cast<T*>(detail::dynamic_shared(alignof(T) < 16 ? 16 : alignof(T)));
}

namespace detail {
// Every lane of `mask` gets `var` of lane `src` (its own value when src is -1).
template <typename T>
T shuffle(unsigned mask, const T& var, int src, const char* name) {
  check_exchangeable<T>();
  T out;
  warp_exchange(mask, &var, &out, sizeof(T), src, name);
  return out;
}

// The first lane of the caller's group of `width` lanes.
inline int group_base(int width) { return cur().lane & ~(width - 1); }
}  // namespace detail

template <typename T>
T shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  const int src = detail::group_base(width) + (src_lane & (width - 1));
  return detail::shuffle(mask, var, src, "__shfl_sync");
}

// For xor/down/up, a source outside the caller's group of `width` lanes gives its own value.
template <typename T>
T shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  const int src = detail::cur().lane ^ lane_mask;
  const bool outside = src >= detail::group_base(width) + width;
  return detail::shuffle(mask, var, outside ? -1 : src, "__shfl_xor_sync");
}

template <typename T>
T shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  const int src = detail::cur().lane + static_cast<int>(delta);
  const bool outside = src >= detail::group_base(width) + width;
  return detail::shuffle(mask, var, outside ? -1 : src, "__shfl_down_sync");
}

template <typename T>
T shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  const int src = detail::cur().lane - static_cast<int>(delta);
  const bool outside = src < detail::group_base(width);
  return detail::shuffle(mask, var, outside ? -1 : src, "__shfl_up_sync");
}

inline void syncwarp(unsigned mask = 0xffffffffu) {
  char dummy = 0;
  detail::warp_exchange(mask, &dummy, &dummy, 1, -1, "__syncwarp");
}

inline unsigned ballot_sync(unsigned mask, int pred) {
  return detail::warp_vote(mask, pred != 0, "__ballot_sync");
}
inline int all_sync(unsigned mask, int pred) {
  return detail::warp_vote(mask, pred != 0, "__all_sync") == mask;
}
inline int any_sync(unsigned mask, int pred) {
  return detail::warp_vote(mask, pred != 0, "__any_sync") != 0;
}

// ------------------------------------------------------------------ runtime API shims

// cp.async (csrc/common/async_copy.cuh): copy16_async snapshots 16 bytes of src and queues them
// for dst, which must be 16-byte aligned shared memory of the block; commit_async_copies closes
// the thread's group of queued copies; wait_async_copies(n) lands all but the n newest of its
// committed groups. A thread that reads a copy before the wait that lands it reads what was
// there before (NaN bytes at first), so a missing wait or commit shows up in the results.
void copy16_async(void* dst, const void* src);
void commit_async_copies();
void wait_async_copies(int pending);

cudaError_t cudaGetDevice(int* device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, const void* kernel,
                                                          int threads, size_t smem);
cudaError_t cudaFuncSetAttribute(const void* kernel, cudaFuncAttribute attr, int value);
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream = nullptr);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream = nullptr);

template <typename T>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, T* kernel, int threads,
                                                          size_t smem) {
  return ::emu::cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      blocks, reinterpret_cast<const void*>(kernel), threads, smem);
}

template <typename T>
cudaError_t cudaFuncSetAttribute(T* kernel, cudaFuncAttribute attr, int value) {
  return ::emu::cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), attr, value);
}

}  // namespace emu

// ------------------------------------------------------------------ device functions

// rsqrtf is a device function (approximate on the GPU, <= 2 ulp); here the exact value.
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline unsigned int __umulhi(unsigned int a, unsigned int b) {
  return static_cast<unsigned int>((static_cast<unsigned long long>(a) * b) >> 32);
}
inline float __fdividef(float a, float b) { return a / b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __expf(float x) { return std::exp(x); }

// ------------------------------------------------------------------ the device dialect

// emu.cpp defines the shims under their CUDA names: no renaming macros there.
#ifndef EMU_RUNTIME_IMPLEMENTATION

#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __launch_bounds__
#undef __shared__
#undef __noinline__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
// Fallback for declarations the build step did not rewrite: blocks run one after another, so
// a static local is a correct (if never NaN-poisoned) per-block array.
#define __shared__ static

#define threadIdx (::emu::detail::cur().tid)
#define blockIdx (::emu::detail::cur().bid)
#define blockDim (::emu::detail::cur().bdim)
#define gridDim (::emu::detail::cur().gdim)
#ifndef warpSize
#define warpSize 32
#endif

#define __syncthreads() ::emu::detail::syncthreads(__FILE__, __LINE__)
#define __syncwarp ::emu::syncwarp
#define __shfl_sync ::emu::shfl_sync
#define __shfl_xor_sync ::emu::shfl_xor_sync
#define __shfl_down_sync ::emu::shfl_down_sync
#define __shfl_up_sync ::emu::shfl_up_sync
#define __ballot_sync ::emu::ballot_sync
#define __all_sync ::emu::all_sync
#define __any_sync ::emu::any_sync
// A plain load at the call site, so a misaligned vector load is reported there.
#define __ldg(p) (*(p))
#define FASTFORMER_CUDA_EMU 1  // csrc/common/convert.cuh: store16 as a plain store

#define cudaGetDevice ::emu::cudaGetDevice
#define cudaSetDevice ::emu::cudaSetDevice
#define cudaDeviceGetAttribute ::emu::cudaDeviceGetAttribute
#define cudaOccupancyMaxActiveBlocksPerMultiprocessor \
  ::emu::cudaOccupancyMaxActiveBlocksPerMultiprocessor
#define cudaFuncSetAttribute ::emu::cudaFuncSetAttribute
#define cudaGetLastError ::emu::cudaGetLastError
#define cudaPeekAtLastError ::emu::cudaPeekAtLastError
#define cudaMemsetAsync ::emu::cudaMemsetAsync
#define cudaMemcpyAsync ::emu::cudaMemcpyAsync

// Device code paths (#if defined(__CUDA_ARCH__), e.g. philox.h's __umulhi) are the ones the GPU
// runs, so compile those. Every CUDA header is already in, so none of them sees it.
#ifndef __CUDA_ARCH__
#define __CUDA_ARCH__ 900
#endif
#endif  // EMU_RUNTIME_IMPLEMENTATION
