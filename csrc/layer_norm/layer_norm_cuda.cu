// CUDA kernels of LayerNorm, RMSNorm and the fused dropout + residual-add + LayerNorm.
//
// Forward, three kernels:
//   * ln_fwd_vec_kernel: the row lives in registers as kVecs raw 16-byte chunks per thread (in
//     the input dtype, converted to fp32 at each use: half the registers for 16-bit rows). A warp
//     per row (4 rows per block) up to 128 vectors (1024 fp16/bf16, 512 fp32 elements), then a
//     block per row of up to 512 threads x 4 vectors (16384 fp16/bf16, 8192 fp32 elements).
//     Needs cols to be a multiple of the vector width and 16-byte aligned pointers. A thread
//     issues all its loads of a row (x, and the residual when fused) before it uses any.
//     Staged (kStages 1, opt-in: layer_norm_tuning's stage 2 or 3, until a GPU has timed it):
//     each row's chunks travel to shared memory by cp.async while the row before it is worked
//     on, on a persistent grid (stage_slot says why).
//   * ln_fwd_chunk_kernel: rows of whole aligned 16-byte chunks too long for the registers (and,
//     opt-in: layer_norm_tuning's stage 4, every row of the vector kernel), read in a loop and
//     re-read from L2 for the statistics' second pass and for the output; few registers, so
//     more blocks an SM.
//   * ln_fwd_any_kernel: any cols and alignment, scalar loads, the row re-read from L1/L2 for
//     each of its passes.
// Statistics are fp32 and two-pass (mean, then the mean of squared deviations; "row statistics"
// below says how they stay exact for constant rows and finite for huge ones); mean and rstd are
// saved for the backward.
//
// Backward: one pass over x and dy gives dx and, per block, fp32 partial sums of dweight and dbias;
// ln_bwd_finalize_kernel sums those partials in a fixed order. No atomics anywhere, so the
// gradients are bit-identical from run to run on the same GPU (the grid, hence the order, depends
// on the GPU's SM count). ln_bwd_vec_kernel holds x and dy in registers as the forward does (a warp
// per row, 8 rows per block, then a block per row of up to 512 threads: 8192 elements of any dtype)
// on a persistent grid of one wave, and loads its next row before working on the current one; its
// dweight / dbias sums live in shared memory (up to 64 KB a block), which leaves the registers for
// that second row (bf16: 101 registers, was 114 with the sums in registers and no second row). It
// ran at ~60% of copy bandwidth on an H200 with 32 KB of loads in flight an SM (2 blocks of 256
// threads, 64 bytes each); the second row doubles that. 16-bit rows of up to 16384 columns take it
// with 4 vectors a thread and no second row (128 registers, 128 KB of sums: one block an SM),
// reading x and dy once. Staged instead (kStages, opt-in like the forward's: stage_bwd_row), an
// unfused backward holds no next row in registers: its next rows go to shared memory. Longer rows
// take a generic kernel that reads the row twice (from L1/L2 the second time) and keeps the sums of
// each row group in shared memory (cols floats for each of dweight and dbias), writing its partial
// rows once at the end: adding into the partial rows in global memory for every row moved 8 bytes a
// column a row through L2 (~4 GB a call at 16384 x 16384: 3x torch's time). Only rows too long for
// a block's shared memory (over ~29000 columns on sm_90, ~20000 on sm_80, with both gradients)
// still add in global memory. Those sums cost the generic kernel its occupancy (one 512-thread
// block an SM), so its loads must keep enough bytes in flight by themselves: rows of whole 16-byte
// chunks (aligned, the common case) take ln_bwd_chunk_kernel, which loads several chunks a thread
// before using them (with scalar 2-byte loads, ln_bwd_any_kernel took 2.9 ms against torch's 1.0 at
// bf16 16384 x 16384 on an H200: latency-bound); ln_bwd_any_kernel, any cols and alignment, is the
// fallback.
//
// Every kernel but the vector forward has __launch_bounds__(threads, 1): without the 1, ptxas
// for sm_90 aims at a higher occupancy and spills. The vector forward asks for two blocks an SM
// (kFwdMinBlocks), which it reaches without spilling because it keeps its row as raw 16-byte
// chunks. All compile with 0 bytes of spills for sm_80 and sm_90.
//
// RMSNorm (kRms) and the fused dropout + residual variant (kFused) are template flags of the
// same kernels. Dropout regenerates its keep-mask from (seed, row * cols + col) with the shared
// Philox function in the backward: no mask is stored.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <tuple>
#include <type_traits>
#include <utility>

#include "common/async_copy.cuh"
#include "common/column_sum.cuh"
#include "common/convert.cuh"
#include "common/philox.h"
#include "layer_norm/layer_norm.h"

namespace fastformer {
namespace {

constexpr int kWarp = 32;
constexpr int kFwdMaxThreads = 512;  // up to 128 registers a thread
constexpr int kBwdMaxThreads = 512;
constexpr int kFwdMaxVecs = 4;  // 16-byte vectors a forward thread holds, at most
// Two resident 512-thread blocks an SM (at most 64 registers a thread): with one, an SM's loads
// stop while its only block reduces and stores (bf16 16384 columns ran at 46% of copy bandwidth
// on an H200 with 72 registers a thread).
constexpr int kFwdMinBlocks = 2;

// The backward holds x and dy of its vectors and of the next row's (16 elements a thread at
// most: 16-bit inputs use 2 vectors, fp32 4), up to 512 threads a row: 8192 columns. Longer
// 16-bit rows, to 16384 columns, take 4 vectors a thread without the next row (kPrefetch:
// with it, 128 registers and spills) rather than the generic kernel, which reads them twice.
constexpr int bwd_max_vecs(int elem_bytes) { return elem_bytes == 2 ? 2 : 4; }
// Whether the vector backward holds the next row in registers (16 elements a thread at most).
constexpr bool bwd_prefetches(int vecs, int elem_bytes) { return vecs * (16 / elem_bytes) <= 16; }
// Whether it may stage its next rows in shared memory instead (stage_bwd_row): not fused (with
// the dpre chunks loaded early, the fused staged kernel spilled 8 bytes on sm_80).
constexpr bool bwd_may_stage(bool fused) { return !fused; }
// The most rows a staged kernel keeps in flight (layer_norm_tuning's stage 2: 1, 3: 2; the
// forward stages one row ahead for both).
constexpr int kMaxStages = 2;
// layer_norm_tuning's stage that has the forward read its vector rows in a loop
// (ln_fwd_chunk_kernel) instead of holding them; the backward keeps its built-in choice.
constexpr int kStageLoop = kMaxStages + 2;
constexpr int kBwdLongVecs = 4;
constexpr int kFinalizeRows = 8;  // row groups of the finalize kernel (each sums a strided slice)
constexpr size_t kDefaultSmem = 48 * 1024;  // shared memory of a block without opting in
// The row_sum slots of the backward kernels (their static shared memory).
// 12 * kWarp bytes: a backward's GradSums red[kWarp], the vector forward's red and red2 alike.
constexpr size_t kStaticSmem = 12 * kWarp;
constexpr int64_t kMaxGrid = int64_t{1} << 30;

// The staged forward's shared-memory slots a chunk of a row: x's, and the residual's if any.
__host__ __device__ __forceinline__ int stage_slots_per_chunk(const LnFwdArgs& a, bool fused) {
  return fused && a.residual != nullptr ? 2 : 1;
}

// ------------------------------------------------------------------ 16-byte vector access

// The elements of one 16-byte chunk. Copied with memcpy, never read through a T* into a uint4:
// that breaks strict aliasing, and g++ -O2 did miscompile it (zeros) in the CPU emulator of
// tests/cuda_emu. nvcc turns these copies into register moves (ptxas: same registers, no stack).
template <typename T>
struct Chunk {
  T v[16 / sizeof(T)];
};

template <typename T>
__device__ __forceinline__ Chunk<T> to_chunk(const uint4& raw) {
  Chunk<T> c;
  memcpy(&c, &raw, sizeof(raw));
  return c;
}

template <typename T>
__device__ __forceinline__ uint4 to_raw(const Chunk<T>& c) {
  uint4 raw;
  memcpy(&raw, &c, sizeof(raw));
  return raw;
}

// kN elements of T from 16-byte chunks (kN * sizeof(T) is a multiple of 16), as fp32.
template <typename T, int kN>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, float (&out)[kN]) {
  constexpr int kPer = 16 / sizeof(T);
  static_assert(kN % kPer == 0, "load_vec reads whole 16-byte chunks");
#pragma unroll
  for (int c = 0; c < kN / kPer; ++c) {
    const Chunk<T> e = to_chunk<T>(__ldg(reinterpret_cast<const uint4*>(p) + c));
#pragma unroll
    for (int i = 0; i < kPer; ++i) out[c * kPer + i] = to_float(e.v[i]);
  }
}

template <typename T, int kN>
__device__ __forceinline__ void store_vec(T* __restrict__ p, const float (&in)[kN]) {
  constexpr int kPer = 16 / sizeof(T);
  static_assert(kN % kPer == 0, "store_vec writes whole 16-byte chunks");
#pragma unroll
  for (int c = 0; c < kN / kPer; ++c) {
    Chunk<T> e;
#pragma unroll
    for (int i = 0; i < kPer; ++i) e.v[i] = from_float<T>(in[c * kPer + i]);
    store16(reinterpret_cast<uint4*>(p) + c, to_raw(e));
  }
}

// The 16/sizeof(T) elements of one raw 16-byte chunk, as fp32.
template <typename T>
__device__ __forceinline__ void unpack(const uint4& raw, float (&out)[16 / sizeof(T)]) {
  const Chunk<T> e = to_chunk<T>(raw);
#pragma unroll
  for (int i = 0; i < static_cast<int>(16 / sizeof(T)); ++i) out[i] = to_float(e.v[i]);
}

// 16/sizeof(T) fp32 values rounded to T, as one raw 16-byte chunk (unpack's inverse).
template <typename T>
__device__ __forceinline__ uint4 pack(const float (&in)[16 / sizeof(T)]) {
  Chunk<T> e;
#pragma unroll
  for (int i = 0; i < static_cast<int>(16 / sizeof(T)); ++i) e.v[i] = from_float<T>(in[i]);
  return to_raw(e);
}

// Chunk vi of a row of 16-byte chunks at `row`, raw; zero bits (0.0 in every dtype) unless
// `valid` (past the row, or past the last row).
__device__ __forceinline__ uint4 chunk_or_zero(const void* row, int64_t vi, bool valid) {
  return valid ? __ldg(static_cast<const uint4*>(row) + vi) : make_uint4(0, 0, 0, 0);
}

// ------------------------------------------------------------------ row reductions

__device__ __forceinline__ float warp_sum(float v) {
  // Butterfly: every lane adds the same two numbers at each level (a + b == b + a), so all
  // lanes end with the same bits.
#pragma unroll
  for (int m = kWarp / 2; m > 0; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

__device__ __forceinline__ float2 warp_sum(float2 v) {
#pragma unroll
  for (int m = kWarp / 2; m > 0; m /= 2) {
    v.x += __shfl_xor_sync(0xffffffffu, v.x, m);
    v.y += __shfl_xor_sync(0xffffffffu, v.y, m);
  }
  return v;
}

// The row sums a backward reduces before dx, with xhat = (x - mean) * rstd and g = dy * weight.
struct GradSums {
  float g, gx, xhat;  // sum(g), sum(g * xhat), sum(xhat)
};
static_assert(sizeof(GradSums) * kWarp == kStaticSmem, "the backward's static shared memory");

__device__ __forceinline__ GradSums warp_sum(GradSums v) {
#pragma unroll
  for (int m = kWarp / 2; m > 0; m /= 2) {
    v.g += __shfl_xor_sync(0xffffffffu, v.g, m);
    v.gx += __shfl_xor_sync(0xffffffffu, v.gx, m);
    v.xhat += __shfl_xor_sync(0xffffffffu, v.xhat, m);
  }
  return v;
}

__device__ __forceinline__ float add(float a, float b) { return a + b; }
__device__ __forceinline__ float2 add(float2 a, float2 b) {
  return make_float2(a.x + b.x, a.y + b.y);
}
__device__ __forceinline__ GradSums add(GradSums a, GradSums b) {
  return GradSums{a.g + b.g, a.gx + b.gx, a.xhat + b.xhat};
}

__device__ __forceinline__ bool finite(float v) { return isfinite(v); }
__device__ __forceinline__ bool finite(float2 v) { return isfinite(v.x) && isfinite(v.y); }
__device__ __forceinline__ bool finite(GradSums v) {
  return isfinite(v.g) && isfinite(v.gx) && isfinite(v.xhat);
}

// The sum of one row's warp partials, in a fixed order.
template <typename V>
__device__ __forceinline__ V slots_total(const V* slot, int warps) {
  V total = slot[0];
  for (int w = 1; w < warps; ++w) total = add(total, slot[w]);
  return total;
}

// Sum over the threads of one row (threadIdx.x, for a fixed threadIdx.y); every thread gets the
// total, in a fixed order. Every thread of the block must call it (it may synchronise).
// nonfinite (when given): whether the total is inf or NaN for any row of the block (for the
// caller's row only with a warp a row, which never synchronises): a branch on it that holds
// barriers is then taken by the whole block.
template <typename V>
__device__ __forceinline__ V row_sum(V v, V* red, bool* nonfinite = nullptr) {
  v = warp_sum(v);
  const int warps = blockDim.x / kWarp;
  if (warps == 1) {  // warp per row: no shared memory, no barrier
    if (nonfinite != nullptr) *nonfinite = !finite(v);
    return v;
  }
  V* slot = red + threadIdx.y * warps;
  if (threadIdx.x % kWarp == 0) slot[threadIdx.x / kWarp] = v;
  __syncthreads();
  const V total = slots_total(slot, warps);
  if (nonfinite != nullptr && blockDim.y == 1) {  // a block a row: the total is the block's
    *nonfinite = !finite(total);
  } else if (nonfinite != nullptr) {
    *nonfinite = false;
    for (int y = 0; y < blockDim.y; ++y) *nonfinite |= !finite(slots_total(red + y * warps, warps));
  }
  __syncthreads();  // the slots are reused by the next reduction
  return total;
}

// ------------------------------------------------------------------ row statistics
//
// Two passes, the second corrected (Chan, Golub and LeVeque): mean1 = sum(x) / n, then with
// d = x - mean1, mean = mean1 + sum(d) / n and var = (sum(d^2) - sum(d)^2 / n) / n. The
// correction takes back what rounding cost the first sum: for a row far from 0 the error then
// grows with its spread, not its offset (a plain fp32 mean was off by ~20 for a 100003-column
// row at 1e6 in the CPU kernels), and a constant row comes out exact (x - mean is 0, and the
// output the bias even with eps = 1e-12). Shifting every row by its first value instead was
// worse when that value is an outlier. The second pass's float2 reduction and the overflow
// branch cost the warp-a-row forward up to 15-20 registers (sm_90, 0 spills; the prediction
// for the next GPU run is in benchmarks/NOTES.md, seventeenth session). A row whose sums
// overflow (|x - mean| past ~1.8e19: its rstd came out 0 and the output silently the bias) is
// summed again with its values scaled by 2^-96, exact for a power of two, where no square or
// sum can overflow; rstd must still be a normal float (ftz), which holds for a standard
// deviation up to ~8.5e37.
constexpr float kOverflowScale = 0x1p-96f;

// Shared memory of a forward kernel's row reductions: kWarp slots of each kind.
struct RowSlots {
  float* one;
  float2* two;
};

// One value's term of the first sum: v, or v^2 for RMSNorm (values times scale).
template <bool kRms>
__device__ __forceinline__ float stat_term(float v, float scale) {
  v *= scale;
  return kRms ? v * v : v;
}

// (mean, rstd) of a row from this thread's first sum (stat_term); each(f) calls f on each of
// this thread's values of the row, for the second pass. nonfinite: as row_sum's.
template <bool kRms, typename Each>
__device__ __forceinline__ float2 scaled_stats(float sum, const Each& each, float cols, float eps,
                                               float scale, RowSlots slots, bool* nonfinite) {
  float mean = 0.f, var;
  if (kRms) {
    var = row_sum(sum, slots.one, nonfinite) / cols;  // the mean square
  } else {
    const float mean1 = row_sum(sum, slots.one) / cols;
    float2 dev = make_float2(0.f, 0.f);  // sum(d), sum(d^2)
    each([&](float v) {
      const float d = v * scale - mean1;
      dev = add(dev, make_float2(d, d * d));
    });
    dev = row_sum(dev, slots.two, nonfinite);
    mean = mean1 + dev.x / cols;
    // (dev.x / cols first: dev.x^2 overflows past 1.8e19 while dev.y, at least dev.x^2 / n, may
    // not: a row at ~1e23 with a spread of a few ulps got var -inf, clamped to 0, rstd 316)
    var = (dev.y - dev.x * (dev.x / cols)) / cols;
    var = var < 0.f ? 0.f : var;  // rounding may go below 0 (not fmaxf: NaN must stay NaN)
  }
  // eps * scale^2 underflows at scale 2^-96: a row left with no spread takes eps alone (an
  // overflowed or NaN row keeps rstd 0 or NaN: row_stats' test)
  const float arg = var + eps * scale * scale;
  return make_float2(mean / scale, arg == 0.f ? rsqrtf(eps) : scale * rsqrtf(arg));
}

// (mean, rstd) of the caller's row, rescaled where its sums overflowed. Uniform over the block.
template <bool kRms, typename Each>
__device__ __forceinline__ float2 row_stats(float sum, const Each& each, float cols, float eps,
                                            RowSlots slots) {
  bool overflow = false;
  float2 stats = scaled_stats<kRms>(sum, each, cols, eps, 1.f, slots, &overflow);
  if (overflow) {  // rare: any row of the block, so that its barriers are reached by all
    float scaled_sum = 0.f;
    each([&](float v) { scaled_sum += stat_term<kRms>(v, kOverflowScale); });
    const float2 scaled =
        scaled_stats<kRms>(scaled_sum, each, cols, eps, kOverflowScale, slots, nullptr);
    if (!(stats.y > 0.f)) stats = scaled;  // this row's own sums overflowed (or hold NaN)
  }
  return stats;
}


// ------------------------------------------------------------------ fused input

// The dropout seed of a launch: the argument, or (seed_ptr set: drawn on the device inside CUDA
// graph capture, a new one each replay) the value in device memory.
template <typename Args>
__device__ __forceinline__ uint64_t seed_of(const Args& a) {
  return a.seed_ptr != nullptr ? static_cast<uint64_t>(__ldg(a.seed_ptr)) : a.seed;
}

// Dropout of one element: the shared Philox keep decision, kept values scaled. A product with
// 0, as torch's dropout takes it: a dropped NaN or inf stays NaN, not a silent 0.
__device__ __forceinline__ float dropout(float v, uint64_t seed, uint64_t offset, float p,
                                         float scale) {
  return v * (dropout_keep(seed, offset, p) ? scale : 0.f);
}

// The normalized input of one 16-byte chunk, raw in the input dtype, from its raw x and
// residual chunks (res: zero bits without a residual): pre = residual + dropout(x) rounded to
// that dtype (the backward reads pre back in it), stored when a.pre is set. Kept raw, a 16-bit
// row costs half the registers of its fp32 values.
template <typename T>
__device__ __forceinline__ uint4 fuse_chunk(const LnFwdArgs& a, int64_t idx, uint4 x, uint4 res) {
  constexpr int kE = 16 / sizeof(T);
  float v[kE];
  unpack<T>(x, v);
  if (a.dropout_p > 0.f) {
    for_each_keep<kE>(seed_of(a), static_cast<uint64_t>(idx), a.dropout_p, [&](int e, bool keep) {
      v[e] *= keep ? a.dropout_scale : 0.f;  // (a dropped NaN stays NaN: `dropout`)
    });
  }
  if (a.residual != nullptr) {
    float r[kE];
    unpack<T>(res, r);
#pragma unroll
    for (int e = 0; e < kE; ++e) v[e] += r[e];
  }
  const uint4 pre = pack<T>(v);
  if (a.pre != nullptr) store16(static_cast<T*>(a.pre) + idx, pre);
  return pre;
}

// The staged forward (kStaged) copies the chunks of the block's next row to shared memory with
// cp.async while a row is reduced and stored, so an SM's loads stay in flight through the
// reductions (the backward's way, the next row held in registers, would spill here: a 16-bit
// row of 4 chunks a thread takes 63 of the forward's 64 registers). Each thread reads back only
// the chunks it copied, so its own wait is enough: no barrier. A row's copies are one group.
// Slot of chunk i of x (j = 0) or of the residual (j = 1, fused with a residual only), in
// 16-byte units of the block's dynamic shared memory, already offset by the thread: consecutive
// threads, consecutive slots (no bank conflicts).
template <bool kFused>
__device__ __forceinline__ int stage_slot(const LnFwdArgs& a, int i, int j) {
  const int per_chunk = stage_slots_per_chunk(a, kFused);
  return (per_chunk * i + j) * static_cast<int>(blockDim.x * blockDim.y);
}


// Starts the copies of row's chunks of x (and of the residual) to the thread's slots, as one
// group; a row past the last, or chunks past the row, copy nothing (load_row reads zero
// bits for them instead), and the group is empty.
template <typename T, int kVecs, bool kFused>
__device__ __forceinline__ void stage_row(const LnFwdArgs& a, int64_t row, int64_t nvec,
                                          uint4* stage) {
  constexpr int kE = 16 / sizeof(T);
  if (row < a.rows) {
    const T* x = static_cast<const T*>(a.x) + row * a.cols;
    const T* residual = static_cast<const T*>(a.residual);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int64_t vi = threadIdx.x + static_cast<int64_t>(i) * blockDim.x;
      if (vi >= nvec) continue;
      copy16_async(stage + stage_slot<kFused>(a, i, 0), x + vi * kE);
      if (kFused && residual != nullptr) {
        copy16_async(stage + stage_slot<kFused>(a, i, 1), residual + row * a.cols + vi * kE);
      }
    }
  }
  commit_async_copies();
}

// One row's normalized input as kVecs raw 16-byte chunks a thread (zero bits, 0.0 in every
// dtype, past the row or past the last row). Every load of the row is issued before any chunk
// is fused: fused chunk by chunk, each chunk's pre store kept the next chunk's loads waiting
// behind it (the compiler may not move a load above a store it cannot prove apart), one memory
// round trip a chunk (ptxas's sm_90 code for 16-bit rows of 4 chunks a thread).
// stage (kStaged only): the thread's slots, where stage_row copied this row (the only group in
// flight).
template <typename T, int kVecs, bool kFused, bool kStaged>
__device__ __forceinline__ void load_row(const LnFwdArgs& a, int64_t row, bool row_ok,
                                         int64_t nvec, uint4 (&raw)[kVecs],
                                         [[maybe_unused]] const uint4* stage) {
  constexpr int kE = 16 / sizeof(T);
  const int64_t offset = row_ok ? row * a.cols : 0;
  [[maybe_unused]] uint4 res[kVecs];
  if constexpr (kStaged) wait_async_copies<0>();
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int64_t vi = threadIdx.x + static_cast<int64_t>(i) * blockDim.x;
    const bool valid = row_ok && vi < nvec;
    const T* residual = static_cast<const T*>(a.residual);
    if constexpr (kStaged) {
      const uint4 zero = make_uint4(0, 0, 0, 0);
      raw[i] = valid ? stage[stage_slot<kFused>(a, i, 0)] : zero;
      if constexpr (kFused) {
        res[i] = valid && residual != nullptr ? stage[stage_slot<kFused>(a, i, 1)] : zero;
      }
    } else {
      raw[i] = chunk_or_zero(static_cast<const T*>(a.x) + offset, vi, valid);
      if constexpr (kFused) {
        res[i] = chunk_or_zero(residual + offset, vi, valid && residual != nullptr);
      }
    }
  }
  if constexpr (kFused) {
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int64_t vi = threadIdx.x + static_cast<int64_t>(i) * blockDim.x;
      if (row_ok && vi < nvec) raw[i] = fuse_chunk<T>(a, row * a.cols + vi * kE, raw[i], res[i]);
    }
  }
}

// Scalar version of load_row and fuse_chunk for the generic kernel: one element.
template <typename T, bool kFused>
__device__ __forceinline__ float input_at(const LnFwdArgs& a, int64_t idx) {
  float v = to_float(static_cast<const T*>(a.x)[idx]);
  if (!kFused) return v;
  if (a.dropout_p > 0.f) {
    v = dropout(v, seed_of(a), static_cast<uint64_t>(idx), a.dropout_p, a.dropout_scale);
  }
  if (a.residual != nullptr) v += to_float(static_cast<const T*>(a.residual)[idx]);
  return round_to<T>(v);
}

// ------------------------------------------------------------------ forward kernels

// y = (v - mean) * rstd * weight + bias for one vector of kE elements.
template <typename T, typename W, int kE>
__device__ __forceinline__ void normalize_store(const LnFwdArgs& a, int64_t row, int64_t col,
                                                float (&v)[kE], float mean, float rstd) {
  float w[kE], b[kE];
#pragma unroll
  for (int e = 0; e < kE; ++e) v[e] = (v[e] - mean) * rstd;
  if (a.weight != nullptr) {
    load_vec<W, kE>(static_cast<const W*>(a.weight) + col, w);
#pragma unroll
    for (int e = 0; e < kE; ++e) v[e] *= w[e];
  }
  if (a.bias != nullptr) {
    load_vec<W, kE>(static_cast<const W*>(a.bias) + col, b);
#pragma unroll
    for (int e = 0; e < kE; ++e) v[e] += b[e];
  }
  store_vec<T, kE>(static_cast<T*>(a.out) + row * a.cols + col, v);
}

// kStages 1 (kStaged): on a persistent grid (one wave), each row's loads start while the row
// before it is worked on (stage_slot); the block's dynamic shared memory holds the slots. One
// row ahead only (the launcher says why).
template <typename T, typename W, int kVecs, bool kRms, bool kFused, int kStages>
__global__ void __launch_bounds__(kFwdMaxThreads, kFwdMinBlocks)
    ln_fwd_vec_kernel(const LnFwdArgs a) {
  static_assert(kStages == 0 || kStages == 1, "the forward stages one row ahead at most");
  constexpr bool kStaged = kStages == 1;
  constexpr int kE = 16 / sizeof(T);
  __shared__ float red[kWarp];
  __shared__ float2 red2[kWarp];
  extern __shared__ uint4 stage_smem[];
  uint4* const stage = stage_smem + threadIdx.y * blockDim.x + threadIdx.x;
  const int64_t nvec = a.cols / kE;
  const float cols = static_cast<float>(a.cols);
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.y;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.y;
  if constexpr (kStaged) stage_row<T, kVecs, kFused>(a, first + threadIdx.y, nvec, stage);
  // The loop bound is uniform over the block, so every thread reaches every barrier.
  for (int64_t base = first; base < a.rows; base += step) {
    const int64_t row = base + threadIdx.y;
    const bool row_ok = row < a.rows;
    uint4 raw[kVecs];
    load_row<T, kVecs, kFused, kStaged>(a, row, row_ok, nvec, raw, stage);
    if constexpr (kStaged) stage_row<T, kVecs, kFused>(a, row + step, nvec, stage);
    const auto each = [&](auto&& f) {  // f(v) for this thread's values of the row
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        if (threadIdx.x + static_cast<int64_t>(i) * blockDim.x >= nvec) continue;
        float v[kE];
        unpack<T>(raw[i], v);
#pragma unroll
        for (int e = 0; e < kE; ++e) f(v[e]);
      }
    };
    float sum = 0.f;
    each([&](float v) { sum += stat_term<kRms>(v, 1.f); });
    const float2 stats = row_stats<kRms>(sum, each, cols, a.eps, RowSlots{red, red2});
    const float mean = stats.x, rstd = stats.y;
    if (row_ok && threadIdx.x == 0) {
      if (a.mean != nullptr) a.mean[row] = mean;
      a.rstd[row] = rstd;
    }
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int64_t vi = threadIdx.x + static_cast<int64_t>(i) * blockDim.x;
      if (!row_ok || vi >= nvec) continue;
      float v[kE];
      unpack<T>(raw[i], v);
      normalize_store<T, W, kE>(a, row, vi * kE, v, mean, rstd);
    }
  }
}

// Resident 512-thread blocks an SM the chunk forward asks for: three (40 registers) where that
// does not spill, two (64) where it did on sm_90: fused (Philox and the residual), and 16-bit
// rows with fp32 weights (16 floats of weight and bias a chunk).
template <typename T, typename W, bool kFused>
constexpr int chunk_min_blocks() {
  return kFused || sizeof(W) > sizeof(T) ? kFwdMinBlocks : 3;
}

// Rows of whole 16-byte chunks, read in a loop instead of held: too long for the registers, or
// (layer_norm_tuning's stage 4, opt-in until a GPU has timed it) any rows of the vector kernel,
// with its block, hence its sums in its order and its bits. The statistics' second pass and the
// output re-read the row, from L2 on a GPU: the few registers leave room for many resident
// blocks, whose loads stay in flight while one block reduces (torch.compile's static LayerNorm,
// usually a looped reduction at this length, reached 92% of copy at bf16 16384 x 16384 on an
// H200, where the register kernel holds 69%).
// The fused variant's first pass writes pre when asked, and the later ones read it back with
// plain loads (written by this kernel: not through the read-only cache).
template <typename T, typename W, bool kRms, bool kFused>
__global__ void __launch_bounds__(kFwdMaxThreads, chunk_min_blocks<T, W, kFused>())
    ln_fwd_chunk_kernel(const LnFwdArgs a) {
  constexpr int kE = 16 / sizeof(T);
  constexpr int kU = 4;  // chunks a thread loads before it uses them, in the first pass
  __shared__ float red[kWarp];
  __shared__ float2 red2[kWarp];
  const int64_t nvec = a.cols / kE;
  const float cols = static_cast<float>(a.cols);
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.y;
  const T* residual = static_cast<const T*>(a.residual);
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.y; base < a.rows;
       base += step) {
    const int64_t row = base + threadIdx.y;
    const bool row_ok = row < a.rows;
    const int64_t offset = row_ok ? row * a.cols : 0;
    const int64_t end = row_ok ? nvec : 0;  // no chunk past the last row
    const T* x = static_cast<const T*>(a.x) + offset;
    float sum = 0.f;
    for (int64_t v0 = threadIdx.x; v0 < end; v0 += int64_t{kU} * blockDim.x) {
      uint4 raw[kU];
      [[maybe_unused]] uint4 res[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int64_t vi = v0 + static_cast<int64_t>(u) * blockDim.x;
        raw[u] = chunk_or_zero(x, vi, vi < end);
        if constexpr (kFused) {
          res[u] = chunk_or_zero(residual + offset, vi, vi < end && residual != nullptr);
        }
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int64_t vi = v0 + static_cast<int64_t>(u) * blockDim.x;
        if (vi >= end) continue;
        if constexpr (kFused) raw[u] = fuse_chunk<T>(a, offset + vi * kE, raw[u], res[u]);
        float v[kE];
        unpack<T>(raw[u], v);
#pragma unroll
        for (int e = 0; e < kE; ++e) sum += stat_term<kRms>(v[e], 1.f);
      }
    }
    // Chunk vi of the row again: x, or (fused) pre as stored, or fused again where not stored.
    const auto chunk = [&](int64_t vi) -> uint4 {
      if constexpr (!kFused) return __ldg(reinterpret_cast<const uint4*>(x) + vi);
      if (a.pre != nullptr) return static_cast<const uint4*>(a.pre)[offset / kE + vi];
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(x) + vi);
      const uint4 res = chunk_or_zero(residual + offset, vi, residual != nullptr);
      return fuse_chunk<T>(a, offset + vi * kE, raw, res);
    };
    const auto each = [&](auto&& f) {  // f(v) for this thread's values of the row
#pragma unroll 1
      for (int64_t vi = threadIdx.x; vi < end; vi += blockDim.x) {
        float v[kE];
        unpack<T>(chunk(vi), v);
#pragma unroll
        for (int e = 0; e < kE; ++e) f(v[e]);
      }
    };
    const float2 stats = row_stats<kRms>(sum, each, cols, a.eps, RowSlots{red, red2});
    if (row_ok && threadIdx.x == 0) {
      if (a.mean != nullptr) a.mean[row] = stats.x;
      a.rstd[row] = stats.y;
    }
#pragma unroll 1
    for (int64_t vi = threadIdx.x; vi < end; vi += blockDim.x) {
      float v[kE];
      unpack<T>(chunk(vi), v);
      normalize_store<T, W, kE>(a, row, vi * kE, v, stats.x, stats.y);
    }
  }
}

// Any cols, any alignment: each pass re-reads the row (from L1/L2). In the fused variant the
// first pass writes pre when asked and later passes read it back (the same thread wrote it).
template <typename T, typename W, bool kRms, bool kFused>
__global__ void __launch_bounds__(kFwdMaxThreads, 1) ln_fwd_any_kernel(const LnFwdArgs a) {
  __shared__ float red[kWarp];
  __shared__ float2 red2[kWarp];
  const float cols = static_cast<float>(a.cols);
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.y;
  T* pre = static_cast<T*>(a.pre);
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.y; base < a.rows;
       base += step) {
    const int64_t row = base + threadIdx.y;
    const int64_t end = row < a.rows ? (row + 1) * a.cols : 0;  // empty range past the last row
    const int64_t begin = row * a.cols + threadIdx.x;
    float sum = 0.f;
    for (int64_t idx = begin; idx < end; idx += blockDim.x) {
      const float v = input_at<T, kFused>(a, idx);
      if (kFused && pre != nullptr) pre[idx] = from_float<T>(v);
      sum += stat_term<kRms>(v, 1.f);
    }
    auto value = [&](int64_t idx) {
      return kFused && pre != nullptr ? to_float(pre[idx]) : input_at<T, kFused>(a, idx);
    };
    const auto each = [&](auto&& f) {
      for (int64_t idx = begin; idx < end; idx += blockDim.x) f(value(idx));
    };
    const float2 stats = row_stats<kRms>(sum, each, cols, a.eps, RowSlots{red, red2});
    const float mean = stats.x, rstd = stats.y;
    if (row < a.rows && threadIdx.x == 0) {
      if (a.mean != nullptr) a.mean[row] = mean;
      a.rstd[row] = rstd;
    }
    const W* weight = static_cast<const W*>(a.weight);
    const W* bias = static_cast<const W*>(a.bias);
    for (int64_t idx = begin; idx < end; idx += blockDim.x) {
      const int64_t col = idx - row * a.cols;
      float y = (value(idx) - mean) * rstd;
      if (weight != nullptr) y *= to_float(weight[col]);
      if (bias != nullptr) y += to_float(bias[col]);
      static_cast<T*>(a.out)[idx] = from_float<T>(y);
    }
  }
}

// ------------------------------------------------------------------ backward kernels

// g = dy * weight, rounded on its own: were it contracted into g - c_g as an FMA, dx would
// carry the product's rounding residual times rstd (nonzero dx for constant rows; seen on an
// H200 at hidden 1, fp32: 2.7e-5 where the reference gives 0).
__device__ __forceinline__ float grad_times_weight(float dy, float w) { return __fmul_rn(dy, w); }

// Adds one element of the row to its GradSums (sum(xhat) only with kCentre, see DxConsts);
// returns xhat.
template <bool kCentre>
__device__ __forceinline__ float add_grad_sums(float x, float dy, float w, float mean, float rstd,
                                               GradSums& sums) {
  const float xhat = (x - mean) * rstd;
  const float g = grad_times_weight(dy, w);
  sums.g += g;
  sums.gx += g * xhat;
  if (kCentre) sums.xhat += xhat;
  return xhat;
}

// A row's constants for dx = rstd * (g - c_g - xc * c_gx), with xc = xhat - shift the centred
// xhat, c_g = mean(g) (RMSNorm: 0) and c_gx = mean(g * xc). The stored mean is the row's mean
// rounded to float: where the mean dwarfs the spread (1e4 against 1) that shifts every xhat of
// the row by the same mean(xhat), which the mean's own derivative cancels; taken out (shift),
// dx and dweight are those of the exactly centred xhat (as in the CPU kernels). Only float32
// inputs need it (kCentre): a 16-bit input's own rounding is some 2^16 times that of the mean,
// and RMSNorm has no mean; their kernels keep their register counts (float32 ones: +7 to +33).
struct DxConsts {
  float c_g, c_gx, shift;
};

template <typename T, bool kRms>
constexpr bool centres() {
  return !kRms && std::is_same_v<T, float>;
}

template <bool kRms, bool kCentre>
__device__ __forceinline__ DxConsts dx_consts(const GradSums& s, float cols) {
  if (kRms) return DxConsts{0.f, s.gx / cols, 0.f};
  if (!kCentre) return DxConsts{s.g / cols, s.gx / cols, 0.f};
  const float shift = s.xhat / cols;
  return DxConsts{s.g / cols, (s.gx - shift * s.g) / cols, shift};
}

// xc of one element (see DxConsts).
__device__ __forceinline__ float centred(float x, float mean, float rstd, const DxConsts& c) {
  return (x - mean) * rstd - c.shift;
}

template <bool kRms>
__device__ __forceinline__ float dx_of(float g, float xc, float rstd, const DxConsts& c) {
  return kRms ? rstd * (g - xc * c.c_gx) : rstd * (g - c.c_g - xc * c.c_gx);
}

// Fused tail of one gradient value: add the gradient of pre, write dres, apply the dropout.
template <typename T, bool kFused>
__device__ __forceinline__ float fused_dx(const LnBwdArgs& a, int64_t idx, float d) {
  if (!kFused) return d;
  if (a.dpre != nullptr) d += to_float(static_cast<const T*>(a.dpre)[idx]);
  if (a.dres != nullptr) static_cast<T*>(a.dres)[idx] = from_float<T>(d);
  return a.dropout_p > 0.f
             ? dropout(d, seed_of(a), static_cast<uint64_t>(idx), a.dropout_p, a.dropout_scale)
             : d;
}

// The same for one vector of kE gradient values at idx (16-byte loads and stores); dpre: the
// chunk of a.dpre at idx, raw, when the caller has loaded it already.
template <typename T, int kE>
__device__ __forceinline__ void fused_dx_vec(const LnBwdArgs& a, int64_t idx, float (&d)[kE],
                                             const uint4* dpre = nullptr) {
  if (a.dpre != nullptr) {
    float g[kE];
    if (dpre == nullptr) {
      load_vec<T, kE>(static_cast<const T*>(a.dpre) + idx, g);
    } else if constexpr (kE * sizeof(T) == 16) {
      unpack<T>(*dpre, g);
    }
#pragma unroll
    for (int e = 0; e < kE; ++e) d[e] += g[e];
  }
  if (a.dres != nullptr) store_vec<T, kE>(static_cast<T*>(a.dres) + idx, d);
  if (a.dropout_p > 0.f) {
    for_each_keep<kE>(seed_of(a), static_cast<uint64_t>(idx), a.dropout_p, [&](int e, bool keep) {
      d[e] *= keep ? a.dropout_scale : 0.f;
    });
  }
}

// The weight of chunk vi of a row as fp32: 1 without a weight, or past the row.
template <typename W, int kE>
__device__ __forceinline__ void weight_chunk(const W* weight, int64_t vi, int64_t nvec,
                                             float (&w)[kE]) {
  if (weight != nullptr && vi < nvec) {
    load_vec<W, kE>(weight + vi * kE, w);
  } else {
#pragma unroll
    for (int e = 0; e < kE; ++e) w[e] = 1.f;
  }
}

// The vector backward's raw inputs of one row: x and dy as 16-byte chunks (zero bits, 0.0 in
// every dtype, past the row or past the last row), and the row's mean and rstd.
template <int kVecs>
struct RawRow {
  uint4 x[kVecs], dy[kVecs];
  float mean, rstd;
};

// The row's (mean, rstd) (0 past the last row; mean 0 for RMSNorm).
template <bool kRms>
__device__ __forceinline__ float2 fetch_stats(const LnBwdArgs& a, int64_t row) {
  const bool row_ok = row < a.rows;
  return make_float2((kRms || !row_ok) ? 0.f : a.mean[row], row_ok ? a.rstd[row] : 0.f);
}

template <typename T, int kVecs, bool kRms>
__device__ __forceinline__ void fetch_row(const LnBwdArgs& a, int64_t row, int64_t nvec,
                                          RawRow<kVecs>& r) {
  const bool row_ok = row < a.rows;
  const int64_t offset = row_ok ? row * a.cols : 0;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int64_t vi = threadIdx.x + static_cast<int64_t>(i) * blockDim.x;
    r.x[i] = chunk_or_zero(static_cast<const T*>(a.x) + offset, vi, row_ok && vi < nvec);
    r.dy[i] = chunk_or_zero(static_cast<const T*>(a.dy) + offset, vi, row_ok && vi < nvec);
  }
  const float2 stats = fetch_stats<kRms>(a, row);
  r.mean = stats.x;
  r.rstd = stats.y;
}

// The staged backward (kStages 1 or 2) copies the x and dy chunks of the block's next kStages
// rows to shared memory with cp.async, as the staged forward does (stage_slot), instead of
// holding the next row in registers. Slots of chunk i within a buffer: x at 2i, dy at 2i + 1
// (times the block's threads, from the thread's own slot). A row's copies are one group; a row
// past the last copies nothing (an empty group).
template <typename T, int kVecs>
__device__ __forceinline__ void stage_bwd_row(const LnBwdArgs& a, int64_t row, int64_t nvec,
                                              uint4* stage) {
  constexpr int kE = 16 / sizeof(T);
  if (row < a.rows) {
    const int threads = static_cast<int>(blockDim.x * blockDim.y);
    const int64_t offset = row * a.cols;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int64_t vi = threadIdx.x + static_cast<int64_t>(i) * blockDim.x;
      if (vi >= nvec) continue;
      const int64_t at = offset + vi * kE;
      copy16_async(stage + 2 * i * threads, static_cast<const T*>(a.x) + at);
      copy16_async(stage + (2 * i + 1) * threads, static_cast<const T*>(a.dy) + at);
    }
  }
  commit_async_copies();
}

// A staged row's x and dy from the thread's slots of its buffer, once its group, the oldest of
// kStages in flight, has landed (zero bits past the row or past the last row, as fetch_row
// gives).
template <int kVecs, int kStages>
__device__ __forceinline__ void read_staged_row(bool row_ok, int64_t nvec, const uint4* stage,
                                                RawRow<kVecs>& r) {
  const int threads = static_cast<int>(blockDim.x * blockDim.y);
  wait_async_copies<kStages - 1>();
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const bool valid = row_ok && threadIdx.x + static_cast<int64_t>(i) * blockDim.x < nvec;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    r.x[i] = valid ? stage[2 * i * threads] : zero;
    r.dy[i] = valid ? stage[(2 * i + 1) * threads] : zero;
  }
}

// Adds v[0..kE) to the thread's float4 accumulators q0, q0 + 1, ... in shared memory (element
// q of a thread at acc[q * threads]: the lanes of a warp touch consecutive 16-byte words).
template <int kE>
__device__ __forceinline__ void add_acc(float4* acc, int q0, int threads, const float (&v)[kE]) {
#pragma unroll
  for (int j = 0; j < kE / 4; ++j) {
    float4& s = acc[(q0 + j) * threads];
    s.x += v[4 * j];
    s.y += v[4 * j + 1];
    s.z += v[4 * j + 2];
    s.w += v[4 * j + 3];
  }
}

// The sums of the block's row groups (threadIdx.y = 0, 1, ... in order) of one gradient's
// accumulators, written by the threads of row group 0 to the block's partial row.
template <int kVecs, int kE>
__device__ __forceinline__ void store_partials(const float4* acc, float* dst, int64_t nvec) {
  constexpr int kQ = kVecs * kE / 4;
  const int threads = blockDim.x * blockDim.y;
  if (threadIdx.y != 0) return;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int64_t vi = threadIdx.x + static_cast<int64_t>(i) * blockDim.x;
    if (vi >= nvec) continue;
    float v[kE];
#pragma unroll
    for (int j = 0; j < kE / 4; ++j) {
      const int q = i * kE / 4 + j;
      float4 s = acc[q * threads + threadIdx.x];
      for (int y = 1; y < static_cast<int>(blockDim.y); ++y) {
        const float4 o = acc[q * threads + y * blockDim.x + threadIdx.x];
        s = make_float4(s.x + o.x, s.y + o.y, s.z + o.z, s.w + o.w);
      }
      v[4 * j] = s.x;
      v[4 * j + 1] = s.y;
      v[4 * j + 2] = s.z;
      v[4 * j + 3] = s.w;
    }
    static_assert(kQ >= kE / 4, "at least one float4 a vector");
    store_vec<float, kE>(dst + vi * kE, v);
  }
}

// The row in registers: x and dy as raw 16-byte vectors, converted when used (twice). The next
// row's are loaded before this row is worked on, so an SM keeps loads in flight through the row
// reductions; the dweight / dbias sums live in shared memory (a float4 slot per 4 columns of a
// thread, only the wanted ones), not in registers, to leave room for that second row.
// kStages > 0 (unfused only): the next kStages rows' x and dy are staged in shared memory after
// the accumulators (stage_bwd_row), their means and rstds held in registers; no row is held in
// registers ahead.
template <typename T, typename W, int kVecs, bool kRms, bool kFused, int kStages>
__global__ void __launch_bounds__(kBwdMaxThreads, 1) ln_bwd_vec_kernel(const LnBwdArgs a) {
  constexpr bool kCentre = centres<T, kRms>();
  constexpr int kE = 16 / sizeof(T);
  constexpr int kQ = kVecs * kE / 4;  // float4 accumulators a thread holds per gradient
  constexpr bool kWeightHeld = bwd_prefetches(kVecs, sizeof(T));  // registers for it
  constexpr bool kPrefetch = kWeightHeld && kStages == 0;
  static_assert(kStages == 0 || bwd_may_stage(kFused), "see bwd_may_stage");
  // Pre-LN's dpre chunks of a row all load before its first dx store (loaded chunk by chunk,
  // each waited behind the chunk before's stores: a memory round trip a chunk). Not for fp32
  // rows of 4 chunks a thread: their 16 more registers spilled on sm_90.
  constexpr bool kDpreFirst = kFused && (kVecs <= 2 || sizeof(T) == 2);
  __shared__ GradSums red[kWarp];
  extern __shared__ float acc_smem[];  // [wanted gradient][kQ][thread] float4s
  const int64_t nvec = a.cols / kE;
  const float cols = static_cast<float>(a.cols);
  const bool want_w = a.dweight != nullptr, want_b = a.dbias != nullptr;
  const W* weight = static_cast<const W*>(a.weight);
  const int threads = blockDim.x * blockDim.y;
  float4* slots = reinterpret_cast<float4*>(acc_smem) + threadIdx.y * blockDim.x + threadIdx.x;
  float4* acc_w = want_w ? slots : nullptr;
  float4* acc_b = want_b ? slots + (want_w ? kQ * threads : 0) : nullptr;
#pragma unroll
  for (int q = 0; q < kQ; ++q) {
    if (want_w) acc_w[q * threads] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (want_b) acc_b[q * threads] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  // The weight of a thread's columns, the same for every row it works on: loaded once where
  // the registers allow (rows of up to 16 values a thread), else twice a row (L1 hits, but
  // each waited for behind the chunk before's dx store).
  [[maybe_unused]] float w_row[kVecs][kE];
  if constexpr (kWeightHeld) {
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      weight_chunk<W, kE>(weight, threadIdx.x + static_cast<int64_t>(i) * blockDim.x, nvec,
                          w_row[i]);
    }
  }
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.y;
  const int64_t first_row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  uint4* const stage = reinterpret_cast<uint4*>(slots) + (want_w + want_b) * kQ * threads;
  const int buffer = 2 * kVecs * threads;  // the slots of one staged row
  RawRow<kVecs> next;
  [[maybe_unused]] float2 ahead[kStages > 0 ? kStages : 1];  // the staged rows' (mean, rstd)
  if (kPrefetch) fetch_row<T, kVecs, kRms>(a, first_row, nvec, next);
#pragma unroll
  for (int s = 0; s < kStages; ++s) {
    stage_bwd_row<T, kVecs>(a, first_row + s * step, nvec, stage + s * buffer);
    ahead[s] = fetch_stats<kRms>(a, first_row + s * step);
  }
  int slot = 0;  // the buffer of this iteration's row (kStages > 1)
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.y; base < a.rows;
       base += step) {
    const int64_t row = base + threadIdx.y;
    const bool row_ok = row < a.rows;
    RawRow<kVecs> cur;
    if constexpr (kStages > 0) {
      read_staged_row<kVecs, kStages>(row_ok, nvec, stage + slot * buffer, cur);
      cur.mean = ahead[0].x;
      cur.rstd = ahead[0].y;
#pragma unroll
      for (int s = 0; s + 1 < kStages; ++s) ahead[s] = ahead[s + 1];
      stage_bwd_row<T, kVecs>(a, row + kStages * step, nvec, stage + slot * buffer);
      ahead[kStages - 1] = fetch_stats<kRms>(a, row + kStages * step);
      slot = slot + 1 == kStages ? 0 : slot + 1;
    } else if (kPrefetch) {
      cur = next;
      fetch_row<T, kVecs, kRms>(a, row + step, nvec, next);
    } else {
      fetch_row<T, kVecs, kRms>(a, row, nvec, cur);
    }
    const float mean = cur.mean, rstd = cur.rstd;
    GradSums sums{0.f, 0.f, 0.f};
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int64_t vi = threadIdx.x + static_cast<int64_t>(i) * blockDim.x;
      if (kCentre && vi >= nvec) continue;  // padding: dy = 0 there, but xhat is not
      float x[kE], dy[kE], w[kE], dyx[kE];
      unpack<T>(cur.x[i], x);
      unpack<T>(cur.dy[i], dy);
      if constexpr (kWeightHeld) {
#pragma unroll
        for (int e = 0; e < kE; ++e) w[e] = w_row[i][e];
      } else {
        weight_chunk<W, kE>(weight, vi, nvec, w);
      }
#pragma unroll
      for (int e = 0; e < kE; ++e) {
        dyx[e] = dy[e] * add_grad_sums<kCentre>(x[e], dy[e], w[e], mean, rstd, sums);
      }
      // dweight's terms here unless they want the row's shift (not known before row_sum).
      if (want_w && !kCentre) add_acc<kE>(acc_w, i * kE / 4, threads, dyx);
      if (want_b) add_acc<kE>(acc_b, i * kE / 4, threads, dy);
    }
    [[maybe_unused]] uint4 dpre[kVecs];
    if constexpr (kDpreFirst) {
      const T* dpre_row = static_cast<const T*>(a.dpre) + (row_ok ? row * a.cols : 0);
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        const int64_t vi = threadIdx.x + static_cast<int64_t>(i) * blockDim.x;
        dpre[i] = chunk_or_zero(dpre_row, vi, a.dpre != nullptr && row_ok && vi < nvec);
      }
    }
    const DxConsts c = dx_consts<kRms, kCentre>(row_sum(sums, red), cols);
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int64_t vi = threadIdx.x + static_cast<int64_t>(i) * blockDim.x;
      if (!row_ok || vi >= nvec) continue;
      float x[kE], dy[kE], w[kE], d[kE], dyx[kE];
      unpack<T>(cur.x[i], x);
      unpack<T>(cur.dy[i], dy);
      if constexpr (kWeightHeld) {
#pragma unroll
        for (int e = 0; e < kE; ++e) w[e] = w_row[i][e];
      } else {
        weight_chunk<W, kE>(weight, vi, nvec, w);
      }
      const int64_t idx = row * a.cols + vi * kE;
#pragma unroll
      for (int e = 0; e < kE; ++e) {
        const float xc = centred(x[e], mean, rstd, c);
        d[e] = dx_of<kRms>(grad_times_weight(dy[e], w[e]), xc, rstd, c);
        dyx[e] = dy[e] * xc;
      }
      if (want_w && kCentre) add_acc<kE>(acc_w, i * kE / 4, threads, dyx);
      if constexpr (kFused) fused_dx_vec<T, kE>(a, idx, d, kDpreFirst ? &dpre[i] : nullptr);
      store_vec<T, kE>(static_cast<T*>(a.dx) + idx, d);
    }
  }
  if (!want_w && !want_b) return;  // uniform over the block
  __syncthreads();  // every row group's sums are in shared memory
  const int64_t part = static_cast<int64_t>(gridDim.x) * a.cols;  // floats per partial matrix
  const float4* first = reinterpret_cast<const float4*>(acc_smem);
  if (want_w) store_partials<kVecs, kE>(first, a.partial + blockIdx.x * a.cols, nvec);
  if (want_b) {
    store_partials<kVecs, kE>(first + (want_w ? kQ * threads : 0),
                              a.partial + part + blockIdx.x * a.cols, nvec);
  }
}

// The dweight / dbias accumulators of a generic-backward row group: its partial rows in global
// memory (gw, gb), and what it adds into (pw, pb): with kSmemAcc its slices of dynamic shared
// memory (only the wanted ones), else the partial rows themselves. Null when not wanted.
struct AccRows {
  float *gw, *gb, *pw, *pb;
};

template <bool kSmemAcc>
__device__ __forceinline__ AccRows acc_rows(const LnBwdArgs& a, float* acc_smem) {
  const int64_t parts = static_cast<int64_t>(gridDim.x) * blockDim.y;
  const int64_t my_part = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  AccRows r;
  r.gw = a.dweight != nullptr ? a.partial + my_part * a.cols : nullptr;
  r.gb = a.dbias != nullptr ? a.partial + (parts + my_part) * a.cols : nullptr;
  r.pw = r.gw;
  r.pb = r.gb;
  if constexpr (kSmemAcc) {
    const int64_t n = (r.gw != nullptr) + (r.gb != nullptr);  // slices a row group
    float* slices = acc_smem + n * threadIdx.y * a.cols;
    r.pw = r.gw != nullptr ? slices : nullptr;
    r.pb = r.gb != nullptr ? slices + (n - 1) * a.cols : nullptr;
  }
  return r;
}

// Any cols and alignment. Each row group accumulates dweight / dbias in its own partial row
// (only its own threads touch it, each always the same columns, so no barrier guards it): with
// kSmemAcc a slice of dynamic shared memory, copied to its partial row in global memory once at
// the end; without it (the slices over the shared memory limit) the global partial row itself.
template <typename T, typename W, bool kRms, bool kFused, bool kSmemAcc>
__global__ void __launch_bounds__(kBwdMaxThreads, 1) ln_bwd_any_kernel(const LnBwdArgs a) {
  constexpr bool kCentre = centres<T, kRms>();
  __shared__ GradSums red[kWarp];
  extern __shared__ float acc_smem[];  // kSmemAcc: the wanted dweight, dbias slices of cols
  const float cols = static_cast<float>(a.cols);
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  const W* weight = static_cast<const W*>(a.weight);
  const auto [gw, gb, pw, pb] = acc_rows<kSmemAcc>(a, acc_smem);
  for (int64_t c = threadIdx.x; c < a.cols; c += blockDim.x) {
    if (pw != nullptr) pw[c] = 0.f;
    if (pb != nullptr) pb[c] = 0.f;
  }
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.y; base < a.rows;
       base += step) {
    const int64_t row = base + threadIdx.y;
    const bool row_ok = row < a.rows;
    const int64_t cols_here = row_ok ? a.cols : 0;  // nothing to do past the last row
    const float mean = (kRms || !row_ok) ? 0.f : a.mean[row];
    const float rstd = row_ok ? a.rstd[row] : 0.f;
    const int64_t offset = row * a.cols;
    GradSums sums{0.f, 0.f, 0.f};
    for (int64_t c = threadIdx.x; c < cols_here; c += blockDim.x) {
      add_grad_sums<kCentre>(to_float(x[offset + c]), to_float(dy[offset + c]),
                             weight != nullptr ? to_float(weight[c]) : 1.f, mean, rstd, sums);
    }
    const DxConsts k = dx_consts<kRms, kCentre>(row_sum(sums, red), cols);
    for (int64_t c = threadIdx.x; c < cols_here; c += blockDim.x) {
      const int64_t idx = offset + c;
      const float xc = centred(to_float(x[idx]), mean, rstd, k);
      const float dyv = to_float(dy[idx]);
      const float g = grad_times_weight(dyv, weight != nullptr ? to_float(weight[c]) : 1.f);
      const float d = fused_dx<T, kFused>(a, idx, dx_of<kRms>(g, xc, rstd, k));
      static_cast<T*>(a.dx)[idx] = from_float<T>(d);
      if (pw != nullptr) pw[c] += dyv * xc;
      if (pb != nullptr) pb[c] += dyv;
    }
  }
  if constexpr (kSmemAcc) {
    for (int64_t c = threadIdx.x; c < a.cols; c += blockDim.x) {
      if (gw != nullptr) gw[c] = pw[c];
      if (gb != nullptr) gb[c] = pb[c];
    }
  }
}

// kN fp32 accumulators at p (16-byte aligned) that this thread itself wrote earlier in the
// kernel: a plain load (__ldg's read-only cache may hold the old values), copied with memcpy.
template <int kN>
__device__ __forceinline__ void load_acc(const float* p, float (&out)[kN]) {
  static_assert(kN % 4 == 0, "load_acc reads whole 16-byte chunks");
  memcpy(out, __builtin_assume_aligned(p, 16), sizeof(out));
}

// ln_bwd_any_kernel for rows of whole 16-byte chunks (cols a multiple of 16 / sizeof(T), every
// pointer 16-byte aligned) too long for ln_bwd_vec_kernel's registers. Each pass strides over
// the row's chunks and loads kU chunks of x, dy and weight before using any of them: at one
// 512-thread block an SM, scalar 2-byte loads left too few bytes in flight (see the header).
// The summation order is fixed (a thread's chunks in order, then row_sum), as in the others.
// Thread x owns chunks x, x + blockDim.x, ... of its row group's accumulators, so no barrier
// guards them. With kSmemAcc the slice holds element e of chunk j at e * nchunks + j, not in
// column order: the lanes of a warp then touch consecutive words (in column order they would be
// a chunk apart, 8 floats for 16-bit inputs: 8-way bank conflicts on every update); each thread
// copies its own chunks to its partial row, in column order, at the end. Without kSmemAcc the
// partial row in global memory is the accumulator, updated a chunk at a time.
template <typename T, typename W, bool kRms, bool kFused, bool kSmemAcc>
__global__ void __launch_bounds__(kBwdMaxThreads, 1) ln_bwd_chunk_kernel(const LnBwdArgs a) {
  constexpr bool kCentre = centres<T, kRms>();
  constexpr int kE = 16 / sizeof(T);
  constexpr int kU = sizeof(T) == 2 ? 2 : 4;  // chunks in flight: 32 bytes of x, 32 of dy
  __shared__ GradSums red[kWarp];
  extern __shared__ float acc_smem[];  // kSmemAcc: the wanted dweight, dbias slices of cols
  const float cols = static_cast<float>(a.cols);
  const int64_t nchunks = a.cols / kE;
  const W* weight = static_cast<const W*>(a.weight);
  const auto [gw, gb, pw, pb] = acc_rows<kSmemAcc>(a, acc_smem);
  // acc(p, j, v): adds v to the accumulators of chunk j.
  auto acc = [&](float* p, int64_t j, const float (&v)[kE]) {
    if constexpr (kSmemAcc) {
#pragma unroll
      for (int e = 0; e < kE; ++e) p[e * nchunks + j] += v[e];
    } else {
      float s[kE];
      load_acc<kE>(p + j * kE, s);
#pragma unroll
      for (int e = 0; e < kE; ++e) s[e] += v[e];
      store_vec<float, kE>(p + j * kE, s);
    }
  };
  auto clear = [&](float* p, int64_t j) {
    const float zero[kE] = {};
    if constexpr (kSmemAcc) {
#pragma unroll
      for (int e = 0; e < kE; ++e) p[e * nchunks + j] = zero[e];
    } else {
      store_vec<float, kE>(p + j * kE, zero);
    }
  };
  for (int64_t j = threadIdx.x; j < nchunks; j += blockDim.x) {
    if (pw != nullptr) clear(pw, j);
    if (pb != nullptr) clear(pb, j);
  }
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.y; base < a.rows;
       base += step) {
    const int64_t row = base + threadIdx.y;
    const bool row_ok = row < a.rows;
    const int64_t chunks_here = row_ok ? nchunks : 0;  // nothing to do past the last row
    const float mean = (kRms || !row_ok) ? 0.f : a.mean[row];
    const float rstd = row_ok ? a.rstd[row] : 0.f;
    const int64_t offset = row_ok ? row * a.cols : 0;
    const uint4* x_row = reinterpret_cast<const uint4*>(static_cast<const T*>(a.x) + offset);
    const uint4* dy_row = reinterpret_cast<const uint4*>(static_cast<const T*>(a.dy) + offset);
    // The kU chunks j0, j0 + blockDim.x, ... of x, dy and weight (all loads issued first);
    // chunks past the row are zeros and ones, and are not used.
    uint4 raw_x[kU], raw_dy[kU];
    float w[kU][kE];
    auto load = [&](int64_t j0) {
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int64_t j = j0 + u * static_cast<int64_t>(blockDim.x);
        raw_x[u] = raw_dy[u] = make_uint4(0, 0, 0, 0);
        if (j < chunks_here) {
          raw_x[u] = __ldg(x_row + j);
          raw_dy[u] = __ldg(dy_row + j);
        }
        if (weight != nullptr && j < chunks_here) {
          load_vec<W, kE>(weight + j * kE, w[u]);
        } else {
#pragma unroll
          for (int e = 0; e < kE; ++e) w[u][e] = 1.f;
        }
      }
    };
    // f(j, x, dy, w) for each chunk j of the row this thread owns (kU loaded before any is used).
    auto for_each_chunk = [&](auto&& f) {
      for (int64_t j0 = threadIdx.x; j0 < chunks_here; j0 += kU * blockDim.x) {
        load(j0);
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int64_t j = j0 + u * static_cast<int64_t>(blockDim.x);
          if (j >= chunks_here) continue;
          float x[kE], dy[kE];
          unpack<T>(raw_x[u], x);
          unpack<T>(raw_dy[u], dy);
          f(j, x, dy, w[u]);
        }
      }
    };
    GradSums sums{0.f, 0.f, 0.f};
    using Row = const float (&)[kE];
    for_each_chunk([&](int64_t, Row x, Row dy, Row w) {
#pragma unroll
      for (int e = 0; e < kE; ++e) add_grad_sums<kCentre>(x[e], dy[e], w[e], mean, rstd, sums);
    });
    const DxConsts c = dx_consts<kRms, kCentre>(row_sum(sums, red), cols);
    for_each_chunk([&](int64_t j, Row x, Row dy, Row w) {
      float d[kE], dyx[kE];
#pragma unroll
      for (int e = 0; e < kE; ++e) {
        const float xc = centred(x[e], mean, rstd, c);
        d[e] = dx_of<kRms>(grad_times_weight(dy[e], w[e]), xc, rstd, c);
        dyx[e] = dy[e] * xc;
      }
      const int64_t idx = offset + j * kE;
      if (kFused) fused_dx_vec<T, kE>(a, idx, d);
      store_vec<T, kE>(static_cast<T*>(a.dx) + idx, d);
      if (pw != nullptr) acc(pw, j, dyx);
      if (pb != nullptr) acc(pb, j, dy);
    });
  }
  if constexpr (kSmemAcc) {
    // Chunk j of a slice to the partial row (the thread's own chunks: no barrier).
    auto copy_out = [&](const float* p, float* g, int64_t j) {
      float v[kE];
#pragma unroll
      for (int e = 0; e < kE; ++e) v[e] = p[e * nchunks + j];
      store_vec<float, kE>(g + j * kE, v);
    };
    for (int64_t j = threadIdx.x; j < nchunks; j += blockDim.x) {
      if (gw != nullptr) copy_out(pw, gw, j);
      if (gb != nullptr) copy_out(pb, gb, j);
    }
  }
}

// dweight[c] (blockIdx.y 0) or dbias[c] (blockIdx.y 1) = sum over the partial rows, in a fixed
// order: row group y sums rows y, y + 8, ...; then the 8 sums are added in order of y.
template <typename W>
__global__ void __launch_bounds__(kWarp * kFinalizeRows, 1)
    ln_bwd_finalize_kernel(const float* __restrict__ partial, int64_t parts, int64_t cols,
                           W* __restrict__ dweight, W* __restrict__ dbias) {
  __shared__ float buf[kFinalizeRows][kColumnSumWidth + 1];
  W* out = blockIdx.y == 0 ? dweight : dbias;
  if (out == nullptr) return;  // uniform over the block
  const float* src = partial + (blockIdx.y == 0 ? 0 : parts * cols);
  column_sum<kFinalizeRows>(src, parts, cols, out, buf);
}

// ------------------------------------------------------------------ host: configuration

template <typename T>
struct Tag {
  using type = T;
};

// Calls f(Tag<T>, Tag<W>) for the input dtype and weight dtype (the input's or fp32).
template <typename F>
void dispatch_types(LnType t, LnType w, F&& f) {
  const bool w32 = w == LnType::kFloat32;
  switch (t) {
    case LnType::kFloat32:
      f(Tag<float>{}, Tag<float>{});
      return;
    case LnType::kFloat16:
      w32 ? f(Tag<__half>{}, Tag<float>{}) : f(Tag<__half>{}, Tag<__half>{});
      return;
    case LnType::kBFloat16:
      w32 ? f(Tag<__nv_bfloat16>{}, Tag<float>{})
          : f(Tag<__nv_bfloat16>{}, Tag<__nv_bfloat16>{});
      return;
  }
}

// Calls f(kRms, kFused) as integral constants; RMSNorm is never fused (the caller checks).
template <typename F>
void dispatch_mode(bool rms, bool fused, F&& f) {
  if (rms) {
    f(std::true_type{}, std::false_type{});
  } else if (fused) {
    f(std::false_type{}, std::true_type{});
  } else {
    f(std::false_type{}, std::false_type{});
  }
}

// Calls f(std::integral_constant<int, V>) for the V of kValues equal to v, else for 0.
template <int... kValues, typename F>
void dispatch_int(int v, F&& f) {
  const bool found = ((v == kValues ? (f(std::integral_constant<int, kValues>{}), true) : false) ||
                      ...);
  if (!found) f(std::integral_constant<int, 0>{});
}

// Calls f(kVecs) as an integral constant; 0 means the generic kernel.
template <typename F>
void dispatch_vecs(int vecs, F&& f) {
  dispatch_int<1, 2, 4>(vecs, f);
}

struct Config {
  int vecs;             // 16-byte vectors per thread, 0 = generic kernel
  int tpr;              // threads per row (blockDim.x)
  int rpb;              // rows per block (blockDim.y)
  bool chunks = false;  // generic kernel on rows of 16-byte chunks (ln_*_chunk_kernel)
  int stages = 0;  // backward, vector kernel: rows staged ahead in shared memory
};

int elem_bytes(LnType t) { return t == LnType::kFloat32 ? 4 : 2; }

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int warps_for(int64_t threads) { return static_cast<int>(ceil_div(threads, kWarp)) * kWarp; }

// A warp per row (block_threads / 32 rows a block) while max_vecs vectors a lane cover the row,
// then a block per row with max_vecs vectors a thread and at most max_threads threads, then
// with long_vecs (if more), then the generic kernel (vecs 0).
Config pick(int64_t cols, int elem, bool vec_ok, int max_vecs, int max_threads, int block_threads,
            int long_vecs = 0) {
  const int per_vec = 16 / elem;
  const int64_t nvec = cols / per_vec;
  if (vec_ok && cols % per_vec == 0) {
    for (int vecs = 1; vecs <= max_vecs; vecs *= 2) {
      if (nvec <= int64_t{kWarp} * vecs) return {vecs, kWarp, block_threads / kWarp};
    }
    for (const int vecs : {max_vecs, long_vecs}) {
      if (vecs > 0 && nvec <= vecs * static_cast<int64_t>(max_threads)) {
        const int tpr = warps_for(ceil_div(nvec, vecs));
        return {vecs, tpr, std::max(1, block_threads / tpr)};
      }
    }
  }
  // Generic: at least 4 columns per thread, a warp at least, max_threads at most.
  const int tpr = std::min(max_threads, std::max(kWarp, warps_for(ceil_div(cols, 4))));
  return {0, tpr, std::max(1, block_threads / tpr)};
}

// The overrides of set_layer_norm_tuning (0: the built-in choice), one atomic each: a launch
// on another thread reads whole values.
std::atomic<int> g_fwd_vecs{0}, g_fwd_block{0}, g_bwd_vecs{0}, g_bwd_block{0}, g_stage{0};

LnTuning current_tuning() {
  LnTuning t;
  t.fwd_vecs = g_fwd_vecs.load(std::memory_order_relaxed);
  t.fwd_block = g_fwd_block.load(std::memory_order_relaxed);
  t.bwd_vecs = g_bwd_vecs.load(std::memory_order_relaxed);
  t.bwd_block = g_bwd_block.load(std::memory_order_relaxed);
  t.stage = g_stage.load(std::memory_order_relaxed);
  return t;
}

// How many rows ahead the vector kernels stage in shared memory (stage_slot), 0 for none. Built
// in: none yet; staging is the candidate of the sweep (benchmarks/sweep_layer_norm.py) until a
// GPU has timed it.
int stages_of(const LnTuning& t) {
  return t.stage >= 2 && t.stage <= kMaxStages + 1 ? t.stage - 1 : 0;
}

// Calls f(std::integral_constant<int, S>) for S = stages (0 to kMaxStages).
template <typename F>
void dispatch_stages(int stages, F&& f) {
  static_assert(kMaxStages == 2, "one value a depth");
  dispatch_int<1, 2>(stages, f);
}

int or_default(int override_value, int built_in) {
  return override_value != 0 ? override_value : built_in;
}

Config fwd_config(const LnFwdArgs& a, const LnTuning& t) {
  const bool vec_ok = aligned16(a.x) && aligned16(a.residual) && aligned16(a.weight) &&
                      aligned16(a.bias) && aligned16(a.out) && aligned16(a.pre);
  const int elem = elem_bytes(a.dtype);
  Config c = pick(a.cols, elem, vec_ok, or_default(t.fwd_vecs, kFwdMaxVecs), kFwdMaxThreads,
                  or_default(t.fwd_block, 128));
  // Rows too long for the registers; with stage 4, every row the vector kernel would take.
  c.chunks = c.vecs == 0 ? vec_ok && a.cols % (16 / elem) == 0 : t.stage == kStageLoop;
  // A block a row reads it in a loop: with a block override, fewer threads take the row.
  if (c.chunks && c.rpb == 1 && t.fwd_block != 0) c.tpr = std::min(c.tpr, t.fwd_block);
  return c;
}

// registers: whether the vector kernel may run (not when its shared memory does not fit).
Config bwd_config(const LnBwdArgs& a, const LnTuning& t, bool registers = true) {
  const bool vec_ok = aligned16(a.dy) && aligned16(a.dpre) && aligned16(a.x) &&
                      aligned16(a.weight) && aligned16(a.dx) && aligned16(a.dres);
  const int elem = elem_bytes(a.dtype);
  const int vecs = std::min(or_default(t.bwd_vecs, bwd_max_vecs(elem)), bwd_max_vecs(elem));
  Config c = pick(a.cols, elem, vec_ok && registers, vecs, kBwdMaxThreads,
                  or_default(t.bwd_block, 256), kBwdLongVecs);
  c.chunks = c.vecs == 0 && vec_ok && a.cols % (16 / elem) == 0;  // rows too long for registers
  return c;
}

// The vector backward's dynamic shared memory: its threads' dweight and dbias sums (only the
// wanted ones), summed over the row groups at the end; then, staged, the next rows' x and dy.
size_t bwd_vec_smem_bytes(const Config& c, const LnBwdArgs& a) {
  const int slices = (a.dweight != nullptr) + (a.dbias != nullptr);
  const int per_vec = 16 / elem_bytes(a.dtype);
  const size_t threads = static_cast<size_t>(c.tpr) * c.rpb;
  const size_t sums = slices * threads * c.vecs * per_vec * sizeof(float);
  return sums + c.stages * threads * c.vecs * 2 * sizeof(uint4);
}

// Resident blocks per SM of a kernel, queried once per (device, kernel, block shape).
int blocks_per_sm(const void* kernel, int threads, size_t smem) {
  static std::mutex mutex;
  static std::map<std::tuple<int, const void*, int, size_t>, int> cache;
  int device = 0;
  cudaGetDevice(&device);
  const auto key = std::make_tuple(device, kernel, threads, smem);
  const std::lock_guard<std::mutex> lock(mutex);
  const auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int blocks = 1;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem) !=
      cudaSuccess) {
    cudaGetLastError();  // clear it so a later launch check does not report it
    blocks = 1;
  }
  blocks = std::max(1, blocks);
  cache.emplace(key, blocks);
  return blocks;
}

// Shared memory a block may opt in to on the current device, queried once per device.
size_t smem_optin_limit() {
  static std::mutex mutex;
  static std::map<int, size_t> cache;
  int device = 0;
  cudaGetDevice(&device);
  const std::lock_guard<std::mutex> lock(mutex);
  const auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  int bytes = 0;
  if (cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
      cudaSuccess) {
    cudaGetLastError();
    bytes = 0;  // no opt-in: the default 48 KB only
  }
  const size_t limit = std::max<size_t>(kDefaultSmem, static_cast<size_t>(bytes));
  cache.emplace(device, limit);
  return limit;
}

// Whether a kernel may launch with `bytes` of dynamic shared memory on the current device,
// raising its limit (cudaFuncSetAttribute) past the default 48 KB. Remembered per (device,
// kernel), refusals too: the plan and the launch of one backward must take the same path.
bool allow_dynamic_smem(const void* kernel, size_t bytes, size_t static_bytes) {
  if (bytes + static_bytes <= kDefaultSmem) return true;
  if (bytes + static_bytes > smem_optin_limit()) return false;
  struct Granted {
    size_t granted = 0;
    size_t refused = SIZE_MAX;
  };
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, Granted> cache;
  int device = 0;
  cudaGetDevice(&device);
  const std::lock_guard<std::mutex> lock(mutex);
  Granted& g = cache[std::make_pair(device, kernel)];
  if (bytes <= g.granted) return true;
  if (bytes >= g.refused) return false;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(bytes)) != cudaSuccess) {
    cudaGetLastError();  // clear it so a later launch check does not report it
    g.refused = bytes;
    return false;
  }
  g.granted = bytes;
  return true;
}

// Calls f(kernel pointer) for the backward kernel these arguments run (smem_acc: the generic
// kernels' accumulators in shared memory).
template <typename F>
void with_bwd_kernel(const LnBwdArgs& a, const Config& c, bool smem_acc, F&& f) {
  dispatch_types(a.dtype, a.wtype, [&](auto t, auto w) {
    using T = typename decltype(t)::type;
    using W = typename decltype(w)::type;
    dispatch_mode(a.rms, a.fused, [&](auto rms, auto fused) {
      constexpr bool kRms = decltype(rms)::value, kFused = decltype(fused)::value;
      dispatch_vecs(c.vecs, [&](auto vecs) {
        constexpr int kVecs = decltype(vecs)::value;
        if constexpr (kVecs == 0) {
          if (c.chunks) {
            if (smem_acc) {
              f(ln_bwd_chunk_kernel<T, W, kRms, kFused, true>);
            } else {
              f(ln_bwd_chunk_kernel<T, W, kRms, kFused, false>);
            }
          } else if (smem_acc) {
            f(ln_bwd_any_kernel<T, W, kRms, kFused, true>);
          } else {
            f(ln_bwd_any_kernel<T, W, kRms, kFused, false>);
          }
        } else if constexpr (bwd_may_stage(kFused)) {
          dispatch_stages(c.stages, [&](auto stages) {
            f(ln_bwd_vec_kernel<T, W, kVecs, kRms, kFused, decltype(stages)::value>);
          });
        } else {
          f(ln_bwd_vec_kernel<T, W, kVecs, kRms, kFused, 0>);
        }
      });
    });
  });
}

// The backward kernel's configuration and dynamic shared memory. The generic kernels keep their
// dweight / dbias sums in shared memory whenever a block's slices fit (see the file's header):
// only the wanted ones, which leaves room for more resident blocks and longer rows.
struct BwdLaunch {
  Config c;
  size_t smem;
  bool smem_acc;  // generic kernel: accumulators in shared memory
};

// Whether the vector kernel's shared memory fits on this device (raising its limit if needed).
bool bwd_vec_fits(const LnBwdArgs& a, const Config& c) {
  bool fits = false;
  with_bwd_kernel(a, c, false, [&](auto kernel) {
    fits = allow_dynamic_smem(reinterpret_cast<const void*>(kernel), bwd_vec_smem_bytes(c, a),
                              kStaticSmem);
  });
  return fits;
}

BwdLaunch bwd_launch(const LnBwdArgs& a, const LnTuning& t) {
  Config c = bwd_config(a, t);
  if (c.vecs != 0) {
    // Fewer rows ahead where the shared memory of more does not fit (16-bit rows of 16384: 128
    // KB of sums, and 64 KB a staged row), none where even one does not (sm_80: 163 KB).
    for (c.stages = bwd_may_stage(a.fused) ? stages_of(t) : 0; c.stages > 0; --c.stages) {
      if (bwd_vec_fits(a, c)) return {c, bwd_vec_smem_bytes(c, a), false};
    }
    if (bwd_vec_fits(a, c)) return {c, bwd_vec_smem_bytes(c, a), false};
    // Up to 128 KB (16-bit rows of 16384, both sums): a GPU with less to opt in to (sm_86 and
    // sm_89: 99 KB, sm_75: 64 KB) takes the generic kernels instead.
    c = bwd_config(a, t, false);
  }
  const int slices = (a.dweight != nullptr) + (a.dbias != nullptr);
  const size_t bytes = static_cast<size_t>(slices) * c.rpb * a.cols * sizeof(float);
  bool fits = false;
  with_bwd_kernel(a, c, true, [&](auto kernel) {
    fits = allow_dynamic_smem(reinterpret_cast<const void*>(kernel), bytes, kStaticSmem);
  });
  return fits ? BwdLaunch{c, bytes, true} : BwdLaunch{c, 0, false};
}

template <typename W>
void launch_finalize(const LnBwdArgs& a, const LnBwdPlan& plan, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div(a.cols, kWarp)), 2);
  ln_bwd_finalize_kernel<W><<<grid, dim3(kWarp, kFinalizeRows), 0, stream>>>(
      a.partial, plan.partial_rows, a.cols, static_cast<W*>(a.dweight),
      static_cast<W*>(a.dbias));
}

// Launches the staged vector forward (its buffers in dynamic shared memory, a persistent grid of
// one wave); false, launching nothing, where the device refuses that much shared memory.
template <typename T, typename W, int kVecs, bool kRms, bool kFused>
bool launch_fwd_staged(const LnFwdArgs& a, const Config& c, int num_sms, cudaStream_t stream) {
  const auto kernel = ln_fwd_vec_kernel<T, W, kVecs, kRms, kFused, 1>;
  const int threads = c.tpr * c.rpb;
  const size_t smem =
      static_cast<size_t>(threads) * kVecs * stage_slots_per_chunk(a, kFused) * sizeof(uint4);
  const void* key = reinterpret_cast<const void*>(kernel);
  if (!allow_dynamic_smem(key, smem, kStaticSmem)) return false;
  const int64_t wave = int64_t{std::max(1, num_sms)} * blocks_per_sm(key, threads, smem);
  const int64_t grid = std::min(ceil_div(a.rows, c.rpb), wave);
  kernel<<<static_cast<unsigned>(grid), dim3(c.tpr, c.rpb), smem, stream>>>(a);
  return true;
}

}  // namespace

// ------------------------------------------------------------------ host: entry points

LnTuning set_layer_norm_tuning(const LnTuning& t) {
  for (const int vecs : {t.fwd_vecs, t.bwd_vecs}) {
    if (vecs != 0 && vecs != 1 && vecs != 2 && vecs != 4) {
      throw std::invalid_argument("layer_norm tuning: vecs must be 0, 1, 2 or 4");
    }
  }
  if (t.stage < 0 || t.stage > kStageLoop) {
    throw std::invalid_argument("layer_norm tuning: stage must be 0, 1, 2, 3 or 4");
  }
  static_assert(kFwdMaxThreads == 512 && kBwdMaxThreads == 512, "the message's bound");
  for (const int block : {t.fwd_block, t.bwd_block}) {
    if (block != 0 && (block % kWarp != 0 || block < kWarp || block > 512)) {
      throw std::invalid_argument("layer_norm tuning: block must be 0 or a multiple of 32 in "
                                  "[32, 512]");
    }
  }
  LnTuning old;
  old.fwd_vecs = g_fwd_vecs.exchange(t.fwd_vecs);
  old.fwd_block = g_fwd_block.exchange(t.fwd_block);
  old.bwd_vecs = g_bwd_vecs.exchange(t.bwd_vecs);
  old.bwd_block = g_bwd_block.exchange(t.bwd_block);
  old.stage = g_stage.exchange(t.stage);
  return old;
}

void layer_norm_fwd_cuda_launch(const LnFwdArgs& a, int num_sms, cudaStream_t stream) {
  if (a.rows == 0 || a.cols == 0) return;
  const LnTuning tuning = current_tuning();
  const Config c = fwd_config(a, tuning);
  const dim3 block(c.tpr, c.rpb);
  const unsigned grid = static_cast<unsigned>(std::min(ceil_div(a.rows, c.rpb), kMaxGrid));
  dispatch_types(a.dtype, a.wtype, [&](auto t, auto w) {
    using T = typename decltype(t)::type;
    using W = typename decltype(w)::type;
    dispatch_mode(a.rms, a.fused, [&](auto rms, auto fused) {
      constexpr bool kRms = decltype(rms)::value, kFused = decltype(fused)::value;
      if (c.chunks) {
        ln_fwd_chunk_kernel<T, W, kRms, kFused><<<grid, block, 0, stream>>>(a);
        return;
      }
      dispatch_vecs(c.vecs, [&](auto vecs) {
        constexpr int kVecs = decltype(vecs)::value;
        if constexpr (kVecs == 0) {
          ln_fwd_any_kernel<T, W, kRms, kFused><<<grid, block, 0, stream>>>(a);
        } else {
          // One row ahead at most: two 512-thread blocks an SM already keep 64 KB in flight
          // through the reductions, and every depth is more kernels to compile.
          const bool launched =
              stages_of(tuning) > 0 &&
              launch_fwd_staged<T, W, kVecs, kRms, kFused>(a, c, num_sms, stream);
          if (!launched) {
            ln_fwd_vec_kernel<T, W, kVecs, kRms, kFused, 0><<<grid, block, 0, stream>>>(a);
          }
        }
      });
    });
  });
}

LnBwdPlan layer_norm_bwd_plan(const LnBwdArgs& a, int num_sms) {
  if (a.rows == 0 || a.cols == 0) return {0, 0, {}};
  const LnTuning tuning = current_tuning();  // the launch takes the plan's
  const BwdLaunch l = bwd_launch(a, tuning);
  const Config& c = l.c;
  int resident = 1;
  with_bwd_kernel(a, c, l.smem_acc, [&](auto kernel) {
    resident = blocks_per_sm(reinterpret_cast<const void*>(kernel), c.tpr * c.rpb, l.smem);
  });
  // Persistent grid: one wave of blocks, each looping over rows and keeping its partial sums.
  const int64_t grid =
      std::max<int64_t>(1, std::min(ceil_div(a.rows, c.rpb), int64_t{num_sms} * resident));
  return {grid, c.vecs == 0 ? grid * c.rpb : grid, tuning};
}

void layer_norm_bwd_cuda_launch(const LnBwdArgs& a, const LnBwdPlan& plan, cudaStream_t stream) {
  if (a.cols == 0) return;
  const size_t wbytes = static_cast<size_t>(a.cols) * elem_bytes(a.wtype);
  if (a.rows == 0) {  // empty sums
    if (a.dweight != nullptr) cudaMemsetAsync(a.dweight, 0, wbytes, stream);
    if (a.dbias != nullptr) cudaMemsetAsync(a.dbias, 0, wbytes, stream);
    return;
  }
  const BwdLaunch l = bwd_launch(a, plan.tuning);
  with_bwd_kernel(a, l.c, l.smem_acc, [&](auto kernel) {
    kernel<<<static_cast<unsigned>(plan.grid), dim3(l.c.tpr, l.c.rpb), l.smem, stream>>>(a);
  });
  if (a.dweight == nullptr && a.dbias == nullptr) return;
  switch (a.wtype) {
    case LnType::kFloat32:
      launch_finalize<float>(a, plan, stream);
      return;
    case LnType::kFloat16:
      launch_finalize<__half>(a, plan, stream);
      return;
    case LnType::kBFloat16:
      launch_finalize<__nv_bfloat16>(a, plan, stream);
      return;
  }
}

}  // namespace fastformer
