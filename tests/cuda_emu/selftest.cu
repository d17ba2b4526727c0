// Kernels that misuse CUDA on purpose (and one that does not), to test that the emulator
// reports each misuse. Compiled through the same rewrite as csrc/**/*_cuda.cu.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "selftest.h"

namespace emu_selftest {
namespace {

// Correct: block sum through shared memory, every thread writes the total.
__global__ void block_sum(const float* in, float* out) {
  __shared__ float part[32];
  float v = in[blockIdx.x * blockDim.x + threadIdx.x];
  for (int m = 16; m > 0; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total += part[w];
  out[blockIdx.x * blockDim.x + threadIdx.x] = total;
}

// The same without the barrier: the result depends on the order threads run in.
__global__ void block_sum_racy(const float* in, float* out) {
  __shared__ float part[32];
  float v = in[blockIdx.x * blockDim.x + threadIdx.x];
  for (int m = 16; m > 0; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
  float total = 0.f;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total += part[w];
  out[blockIdx.x * blockDim.x + threadIdx.x] = total;
}

// Two block sums through one set of slots, without the barrier after reading them: a fast
// warp overwrites a slot for the second sum while another warp still reads the first.
__device__ float reduce_no_trailing_barrier(float v, float* part) {
  for (int m = 16; m > 0; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total += part[w];
  return total;  // missing: __syncthreads() before the slots are reused
}

__global__ void two_sums_racy(const float* in, float* out) {
  __shared__ float part[32];
  const float v = in[blockIdx.x * blockDim.x + threadIdx.x];
  const float first = reduce_no_trailing_barrier(v, part);
  const float second = reduce_no_trailing_barrier(2.f * v, part);
  out[blockIdx.x * blockDim.x + threadIdx.x] = second - 2.f * first;  // 0 when race-free
}

// Reads a shared slot no thread wrote: NaN (shared memory starts as NaN bytes).
__global__ void uninitialized_shared(float* out) {
  __shared__ float slots[64];
  slots[threadIdx.x] = 1.f;
  __syncthreads();
  out[threadIdx.x] = slots[threadIdx.x + 32];
}

__global__ void deadlock(float* out) {
  float v = 1.f;
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    v = __shfl_xor_sync(0xffffffffu, v, 1);
  }
  out[threadIdx.x] = v;
}

__global__ void divergent_barriers(float* out) {
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1.f;
}

__global__ void shuffle_exited_lane(float* out) {
  if (threadIdx.x == 5) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.f, 1);
}

__global__ void shuffle_partial_warp(float* out) {
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.f, 1);
}

__global__ void __launch_bounds__(128) bounded(float* out) { out[threadIdx.x] = 1.f; }

__global__ void dynamic_smem(float* out) {
  extern __shared__ float buf[];
  buf[threadIdx.x] = static_cast<float>(threadIdx.x);
  __syncthreads();
  out[threadIdx.x] = buf[blockDim.x - 1 - threadIdx.x];
}

__global__ void dynamic_smem_overflow(float* out) {
  extern __shared__ float buf[];
  buf[threadIdx.x + 1] = 1.f;  // one past the end for the last thread
  out[threadIdx.x] = 0.f;
}

__global__ void static_smem_overflow(float* out) {
  __shared__ float buf[32];
  float* p = buf;
  p[threadIdx.x + 1] = 1.f;  // through a pointer: past the array for the last thread
  out[threadIdx.x] = 0.f;
}

__global__ void misaligned_vector(const float* in, float* out) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(in + 1));
  float v[4];
  std::memcpy(v, &raw, sizeof(raw));
  out[threadIdx.x] = v[0];
}

__global__ void index_out_of_bounds(float* out) {
  float local[4] = {0.f, 1.f, 2.f, 3.f};
  const int i = static_cast<int>(threadIdx.x) + 1;
  out[threadIdx.x] = local[i];  // i == 4 for the last of 4 threads
}

__global__ void ballot_and_shuffles(float* out) {
  const unsigned lane = threadIdx.x % 32;
  const unsigned odd = __ballot_sync(0xffffffffu, lane & 1);
  const float down = __shfl_down_sync(0xffffffffu, static_cast<float>(lane), 1);
  const float up = __shfl_up_sync(0xffffffffu, static_cast<float>(lane), 2);
  const float from3 = __shfl_sync(0xffffffffu, static_cast<float>(lane), 3);
  const int all = __all_sync(0xffffffffu, lane < 32);
  const int any = __any_sync(0xffffffffu, lane == 7);
  __syncwarp();
  out[threadIdx.x * 6 + 0] = odd == 0xAAAAAAAAu ? 1.f : 0.f;
  out[threadIdx.x * 6 + 1] = down;
  out[threadIdx.x * 6 + 2] = up;
  out[threadIdx.x * 6 + 3] = from3;
  out[threadIdx.x * 6 + 4] = static_cast<float>(all);
  out[threadIdx.x * 6 + 5] = static_cast<float>(any);
}

}  // namespace

// Runs one case on `in` (threads * blocks floats) into `out`; errors propagate.
void run(const std::string& name, const float* in, float* out, int blocks, int threads,
         int smem) {
  if (name == "block_sum") {
    block_sum<<<blocks, threads>>>(in, out);
  } else if (name == "block_sum_racy") {
    block_sum_racy<<<blocks, threads>>>(in, out);
  } else if (name == "two_sums_racy") {
    two_sums_racy<<<blocks, threads>>>(in, out);
  } else if (name == "uninitialized_shared") {
    uninitialized_shared<<<1, 32>>>(out);
  } else if (name == "deadlock") {
    deadlock<<<1, 64>>>(out);
  } else if (name == "divergent_barriers") {
    divergent_barriers<<<1, 64>>>(out);
  } else if (name == "shuffle_exited_lane") {
    shuffle_exited_lane<<<1, 32>>>(out);
  } else if (name == "shuffle_partial_warp") {
    shuffle_partial_warp<<<1, 48>>>(out);
  } else if (name == "too_many_threads") {
    bounded<<<1, dim3(32, 33)>>>(out);
  } else if (name == "launch_bounds") {
    bounded<<<1, 256>>>(out);
  } else if (name == "dynamic_smem") {
    if (smem > 48 * 1024) {
      cudaFuncSetAttribute(dynamic_smem, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    }
    dynamic_smem<<<1, threads, smem, nullptr>>>(out);
  } else if (name == "dynamic_smem_overflow") {
    dynamic_smem_overflow<<<1, threads, threads * sizeof(float)>>>(out);
  } else if (name == "static_smem_overflow") {
    static_smem_overflow<<<1, 32>>>(out);
  } else if (name == "misaligned_vector") {
    misaligned_vector<<<1, 1>>>(in, out);
  } else if (name == "index_out_of_bounds") {
    index_out_of_bounds<<<1, 4>>>(out);
  } else if (name == "ballot_and_shuffles") {
    ballot_and_shuffles<<<1, 32>>>(out);
  } else {
    throw std::invalid_argument("unknown self-test case " + name);
  }
}

}  // namespace emu_selftest
