// Asynchronous 16-byte copies from global to shared memory (cp.async, sm_80 and later): the
// data goes to shared memory without passing through registers, so a thread can keep whole rows'
// loads in flight while it works on registers it already holds.
//
// A thread's copies form groups (commit_async_copies closes one); wait_async_copies<N> returns
// once at most the N newest of its committed groups are still in flight. A thread may then read
// the bytes its landed copies wrote; bytes copied by another thread also need a barrier after
// that thread's wait.
#pragma once

#include <cuda_runtime.h>

namespace fastformer {

// Starts copying 16 bytes from src (global, 16-byte aligned) to dst (shared, 16-byte aligned).
__device__ __forceinline__ void copy16_async(void* dst, const void* src) {
#if defined(FASTFORMER_CUDA_EMU)  // tests/cuda_emu: the copy lands at a wait
  ::emu::copy16_async(dst, src);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned smem = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  // .cg: through L2 only; the row is read once.
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem), "l"(src) : "memory");
#else
  *static_cast<uint4*>(dst) = *static_cast<const uint4*>(src);
#endif
}

// Closes the group of the copies this thread started since its last commit (maybe none).
__device__ __forceinline__ void commit_async_copies() {
#if defined(FASTFORMER_CUDA_EMU)
  ::emu::commit_async_copies();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// Waits until at most kPending of this thread's committed groups, the newest, are in flight.
template <int kPending>
__device__ __forceinline__ void wait_async_copies() {
#if defined(FASTFORMER_CUDA_EMU)
  ::emu::wait_async_copies(kPending);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
#endif
}

}  // namespace fastformer
