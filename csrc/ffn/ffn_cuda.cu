// CUDA kernels of the fused FFN's elementwise stages (layouts and semantics: ffn/ffn.h).
//
// The GEMMs run in cuBLAS(Lt) through ATen (ffn.cpp); these kernels do what lies between them:
//   forward:  g = dropout(act(h))                      (one read of h, one write of g)
//   backward: dh = dg * keep / (1 - p) * act'(h), g recomputed for linear2's weight gradient,
//             and the bias gradient of linear1 as a deterministic column reduction;
//   and linear2's bias gradient, grad_out's column sums, by the same two-stage reduction.
// Blocks are 32 column-vectors x 8 rows, so each warp reads 16-byte vectors along one row
// (coalesced) and a block's column sums need only one shared-memory pass.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "common/column_sum.cuh"
#include "common/convert.cuh"
#include "common/philox.h"
#include "ffn/ffn.h"

namespace fastformer {
namespace {

constexpr int kThreadsX = 32;  // column vectors per block: one warp along a row
constexpr int kThreadsY = 8;   // rows per block step
constexpr int64_t kMaxForwardRowBlocks = 65535;  // gridDim.y limit; larger inputs loop
constexpr int kFinalizeRows = 8;  // row groups of the db1 finalize (column_sum)
constexpr int kMaskThreads = 256;  // the relu bitmask kernel's blocks
constexpr int64_t kMaxMaskBlocks = 65535;  // more work loops

static_assert(kFfnRowsPerBlock % kThreadsY == 0, "a row block is whole block steps");

// VEC consecutive elements moved as one aligned (up to 16-byte) access.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ void load(const T* ptr, float (&out)[VEC]) {
  const Pack<T, VEC> pack = *reinterpret_cast<const Pack<T, VEC>*>(ptr);
#pragma unroll
  for (int k = 0; k < VEC; ++k) out[k] = to_float(pack.v[k]);
}

template <typename T, int VEC>
__device__ __forceinline__ void store(T* ptr, const float (&in)[VEC]) {
  Pack<T, VEC> pack;
#pragma unroll
  for (int k = 0; k < VEC; ++k) pack.v[k] = from_float<T>(in[k]);
  if constexpr (sizeof(pack) == 16) {
    uint4 raw;  // (memcpy, not a uint4 read of the Pack: strict aliasing, see layer_norm_cuda)
    memcpy(&raw, &pack, sizeof(raw));
    store16(ptr, raw);
  } else {
    *reinterpret_cast<Pack<T, VEC>*>(ptr) = pack;
  }
}

constexpr float kSqrtHalf = 0.70710678118654752f;     // 1 / sqrt(2)
constexpr float kInvSqrt2Pi = 0.39894228040143268f;   // 1 / sqrt(2 pi)
constexpr float kTanhBeta = 0.79788456080286536f;     // sqrt(2 / pi)
constexpr float kTanhKappa = 0.044715f;

// The tanh GELU's gate s = (1 + tanh(u)) / 2 = 1 / (1 + e^-2u) and 1 - s (ffn.cpp says why not
// from tanhf: 1 + tanh and 1 - tanh^2 cancel in the left tail).
__device__ __forceinline__ float2 gelu_tanh_gate(float x) {
  const float e = expf(-2.f * kTanhBeta * (x + kTanhKappa * x * x * x));
  const float s = 1.f / (1.f + e);
  return make_float2(s, e > 1.f ? 1.f - s : e * s);
}

__host__ __device__ constexpr bool is_gated(FfnActivation a) {
  return a == FfnActivation::kSwiglu || a == FfnActivation::kGeglu;
}

// The activation (of the gate, for the gated variants), in fp32.
template <FfnActivation A>
__device__ __forceinline__ float act(float x) {
  if constexpr (A == FfnActivation::kRelu) {
    return x < 0.f ? 0.f : x;  // NaN stays NaN, as in torch.relu
  } else if constexpr (A == FfnActivation::kGelu || A == FfnActivation::kGeglu) {
    return 0.5f * x * (1.f + erff(x * kSqrtHalf));
  } else if constexpr (A == FfnActivation::kGeluTanh) {
    return x * gelu_tanh_gate(x).x;
  } else if constexpr (A == FfnActivation::kSilu || A == FfnActivation::kSwiglu) {
    return x / (1.f + expf(-x));
  } else {
    return x;  // kIdentity: the activation ran in the GEMM epilogue
  }
}

// d act / dx (not used for relu, whose backward reads the saved output instead).
template <FfnActivation A>
__device__ __forceinline__ float act_grad(float x) {
  if constexpr (A == FfnActivation::kGelu || A == FfnActivation::kGeglu) {
    return 0.5f * (1.f + erff(x * kSqrtHalf)) + x * kInvSqrt2Pi * expf(-0.5f * x * x);
  } else if constexpr (A == FfnActivation::kGeluTanh) {
    const float2 s = gelu_tanh_gate(x);  // (1 - tanh^2) / 2 = 2 s (1 - s)
    return s.x + 2.f * x * s.x * s.y * kTanhBeta * (1.f + 3.f * kTanhKappa * x * x);
  } else if constexpr (A == FfnActivation::kSilu || A == FfnActivation::kSwiglu) {
    const float s = 1.f / (1.f + expf(-x));
    return s * (1.f + x * (1.f - s));
  } else {
    return 1.f;
  }
}

// Dropout multipliers of VEC consecutive elements: 1/(1-p) where kept, 0 where dropped.
// 16-bit vectors (8 elements) draw one Philox call per four elements (for_each_keep); fp32
// vectors (4) draw per element: with four words live, the fp32 swiglu backward spills on sm_90.
// seed_ptr: when set, the seed is read there (drawn on the device inside CUDA graph capture), at
// each use: a seed kept in registers across the row loop spilled the fp32 swiglu backward.
template <int VEC>
__device__ __forceinline__ void dropout_multipliers(float (&m)[VEC], uint64_t seed,
                                                    const int64_t* seed_ptr, int64_t offset,
                                                    float p, float scale) {
  if (p <= 0.f) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) m[k] = 1.f;
    return;
  }
  if (seed_ptr != nullptr) seed = static_cast<uint64_t>(__ldg(seed_ptr));
  if constexpr (VEC % 8 == 0) {
    for_each_keep<VEC>(seed, static_cast<uint64_t>(offset), p,
                       [&](int k, bool keep) { m[k] = keep ? scale : 0.f; });
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      m[k] = dropout_keep(seed, static_cast<uint64_t>(offset + k), p) ? scale : 0.f;
    }
  }
}

// Whether relu's gradient passes element idx, given saved = dropout(relu(h)): where it is
// positive (relu passed, dropout kept), and where it is NaN (torch's relu passes its gradient at
// a NaN h) unless dropout dropped it (NaN * 0 is NaN: the keep decision is drawn again; rare,
// behind a branch).
__device__ __forceinline__ bool relu_passes(float saved, int64_t idx, uint64_t seed,
                                            const int64_t* seed_ptr, float p) {
  if (saved <= 0.f) return false;
  if (!isnan(saved) || p <= 0.f) return true;
  const uint64_t s = seed_ptr != nullptr ? static_cast<uint64_t>(__ldg(seed_ptr)) : seed;
  return dropout_keep(s, static_cast<uint64_t>(idx), p);
}

// g = dropout(act(h)); h and g may alias (in-place), hence no __restrict__.
template <typename T, FfnActivation A, int VEC>
__global__ void __launch_bounds__(kThreadsX* kThreadsY)
    ffn_forward_kernel(const T* h, T* g, int64_t rows, int64_t d_ff, uint64_t seed,
                       const int64_t* __restrict__ seed_ptr, float p, float scale) {
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * kThreadsX + threadIdx.x) * VEC;
  if (col >= d_ff) return;
  const int64_t ld_h = is_gated(A) ? 2 * d_ff : d_ff;
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * kThreadsY;
  for (int64_t row = static_cast<int64_t>(blockIdx.y) * kThreadsY + threadIdx.y; row < rows;
       row += row_step) {
    float a[VEC], y[VEC], m[VEC];
    load<T, VEC>(h + row * ld_h + col, a);
    if constexpr (is_gated(A)) {
      float up[VEC];
      load<T, VEC>(h + row * ld_h + d_ff + col, up);
#pragma unroll
      for (int k = 0; k < VEC; ++k) y[k] = act<A>(a[k]) * up[k];
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) y[k] = act<A>(a[k]);
    }
    dropout_multipliers<VEC>(m, seed, seed_ptr, row * d_ff + col, p, scale);
#pragma unroll
    for (int k = 0; k < VEC; ++k) y[k] *= m[k];
    store<T, VEC>(g + row * d_ff + col, y);
  }
}

// One row of the backward stage for the columns [col, col + VEC); adds dh to `acc` (fp32).
// acc holds VEC sums (2 * VEC when gated: the gate columns, then the up columns). A non-gated
// dh may alias dg (in place; each thread reads its elements before writing them), hence no
// __restrict__ on either.
template <typename T, FfnActivation A, int VEC, int ACC>
__device__ __forceinline__ void backward_row(const T* dg, const T* __restrict__ saved, T* dh,
                                             T* __restrict__ g_out, int64_t row, int64_t col,
                                             int64_t d_ff, uint64_t seed, const int64_t* seed_ptr,
                                             float p, float scale, float (&acc)[ACC]) {
  float d[VEC];
  load<T, VEC>(dg + row * d_ff + col, d);
  if constexpr (A == FfnActivation::kRelu) {
    float gv[VEC];
    load<T, VEC>(saved + row * d_ff + col, gv);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const bool pass = relu_passes(gv[k], row * d_ff + col + k, seed, seed_ptr, p);
      d[k] = pass ? d[k] * scale : 0.f;
      acc[k] += d[k];
    }
    store<T, VEC>(dh + row * d_ff + col, d);
  } else {
    float m[VEC], y[VEC];
    dropout_multipliers<VEC>(m, seed, seed_ptr, row * d_ff + col, p, scale);
    if constexpr (is_gated(A)) {
      float gate[VEC], up[VEC], dgate[VEC], dup[VEC];
      load<T, VEC>(saved + row * 2 * d_ff + col, gate);
      load<T, VEC>(saved + row * 2 * d_ff + d_ff + col, up);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float a = act<A>(gate[k]), dm = d[k] * m[k];
        y[k] = a * up[k] * m[k];
        dgate[k] = dm * up[k] * act_grad<A>(gate[k]);
        dup[k] = dm * a;
        acc[k] += dgate[k];
        acc[VEC + k] += dup[k];
      }
      store<T, VEC>(dh + row * 2 * d_ff + col, dgate);
      store<T, VEC>(dh + row * 2 * d_ff + d_ff + col, dup);
    } else {
      float a[VEC];
      load<T, VEC>(saved + row * d_ff + col, a);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        y[k] = act<A>(a[k]) * m[k];
        d[k] = d[k] * m[k] * act_grad<A>(a[k]);
        acc[k] += d[k];
      }
      store<T, VEC>(dh + row * d_ff + col, d);
    }
    store<T, VEC>(g_out + row * d_ff + col, y);
  }
}

// The block's column sums into its row of partials (`width` floats a row): each thread's kAcc
// sums are added over the kThreadsY rows in order of y, then sum j goes to column j (j < kVec),
// or j - kVec + `second` (the up half of a gated width). `partials` points at the thread's
// first column in row 0.
template <int kAcc, int kVec>
__device__ __forceinline__ void write_partials(float (&lanes)[kThreadsY][kThreadsX * kAcc],
                                               const float (&acc)[kAcc], bool active,
                                               float* __restrict__ partials, int64_t width,
                                               int64_t second) {
#pragma unroll
  for (int j = 0; j < kAcc; ++j) lanes[threadIdx.y][threadIdx.x * kAcc + j] = acc[j];
  __syncthreads();
  if (threadIdx.y != 0 || !active) return;
  float* row = partials + static_cast<int64_t>(blockIdx.y) * width;
#pragma unroll
  for (int j = 0; j < kAcc; ++j) {
    float sum = 0.f;
#pragma unroll
    for (int r = 0; r < kThreadsY; ++r) sum += lanes[r][threadIdx.x * kAcc + j];
    row[j < kVec ? j : second + (j - kVec)] = sum;
  }
}

// dh, recomputed g and per-block column partial sums of dh (partials[blockIdx.y][column]).
template <typename T, FfnActivation A, int VEC>
__global__ void __launch_bounds__(kThreadsX* kThreadsY)
    ffn_backward_kernel(const T* dg, const T* __restrict__ saved, T* dh, T* __restrict__ g_out,
                        float* __restrict__ partials, int64_t rows, int64_t d_ff, uint64_t seed,
                        const int64_t* __restrict__ seed_ptr, float p, float scale) {
  constexpr int kAcc = is_gated(A) ? 2 * VEC : VEC;
  __shared__ float lanes[kThreadsY][kThreadsX * kAcc];
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * kThreadsX + threadIdx.x) * VEC;
  const bool active = col < d_ff;
  float acc[kAcc];
#pragma unroll
  for (int j = 0; j < kAcc; ++j) acc[j] = 0.f;
  if (active) {
    const int64_t row_step = static_cast<int64_t>(gridDim.y) * kThreadsY;
    for (int64_t row = static_cast<int64_t>(blockIdx.y) * kThreadsY + threadIdx.y; row < rows;
         row += row_step) {
      backward_row<T, A, VEC, kAcc>(dg, saved, dh, g_out, row, col, d_ff, seed, seed_ptr, p, scale,
                                    acc);
    }
  }
  const int64_t width = is_gated(A) ? 2 * d_ff : d_ff;
  // Gated: the gate columns' sums, then the up columns' (d_ff further on).
  write_partials<kAcc, VEC>(lanes, acc, active, partials + col, width, d_ff);
}

// partials[blockIdx.y][c] = the sum of src's column c over the rows of the block's row block
// (the first stage of ffn_column_sum_cuda_launch); blocks as the backward stage's.
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreadsX* kThreadsY)
    ffn_column_partials_kernel(const T* __restrict__ src, float* __restrict__ partials,
                               int64_t rows, int64_t cols) {
  __shared__ float lanes[kThreadsY][kThreadsX * VEC];
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * kThreadsX + threadIdx.x) * VEC;
  const bool active = col < cols;
  float acc[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) acc[j] = 0.f;
  if (active) {
    const int64_t row_step = static_cast<int64_t>(gridDim.y) * kThreadsY;
    for (int64_t row = static_cast<int64_t>(blockIdx.y) * kThreadsY + threadIdx.y; row < rows;
         row += row_step) {
      float v[VEC];
      load<T, VEC>(src + row * cols + col, v);
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j] += v[j];
    }
  }
  write_partials<VEC, VEC>(lanes, acc, active, partials + col, cols, 0);
}

// db[c] = the sum over row blocks b of partials[b][c], in column_sum's fixed order. (A thread
// per column walking all 256 row blocks took 26 us for 2048 columns on an H200: 8 blocks on
// 132 SMs, one load in flight a thread.)
template <typename T>
__global__ void __launch_bounds__(kColumnSumWidth* kFinalizeRows)
    ffn_bias_grad_finalize_kernel(const float* __restrict__ partials, T* __restrict__ db,
                                  int64_t blocks, int64_t width) {
  __shared__ float buf[kFinalizeRows][kColumnSumWidth + 1];
  column_sum<kFinalizeRows>(partials, blocks, width, db, buf);
}

// The relu bitmask (FfnReluMaskArgs) of `saved`. A warp covers kWarp * VEC columns of one row a
// step, VEC consecutive ones a lane (one 16-byte load for 16-bit rows of whole vectors), so its
// loads are coalesced; the lanes of one 32-bit word gather their bits by shuffles and its first
// lane stores it. Every word of the row is written, the padding past d_ff with 0 bits.
template <typename T, int VEC>
__global__ void __launch_bounds__(kMaskThreads)
    ffn_relu_mask_kernel(const T* __restrict__ saved, uint32_t* __restrict__ mask, int64_t rows,
                         int64_t d_ff, int64_t words, uint64_t seed,
                         const int64_t* __restrict__ seed_ptr, float p) {
  constexpr int kLanesPerWord = 32 / VEC;
  constexpr int64_t kStepCols = int64_t{kThreadsX} * VEC;
  const int lane = threadIdx.x % kThreadsX;
  const int64_t steps = (words * 32 + kStepCols - 1) / kStepCols;  // a row's steps
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kThreadsX;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / kThreadsX;
  // The bound is the same for every lane of a warp: the shuffles below see the whole warp.
  for (int64_t unit = first; unit < rows * steps; unit += warps) {
    const int64_t row = unit / steps, step = unit % steps;
    const int64_t col = step * kStepCols + lane * VEC;
    uint32_t bits = 0;
    if (col < d_ff) {  // (VEC divides d_ff)
      float g[VEC];
      load<T, VEC>(saved + row * d_ff + col, g);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        if (relu_passes(g[k], row * d_ff + col + k, seed, seed_ptr, p)) bits |= 1u << k;
      }
    }
    uint32_t word = bits << ((lane % kLanesPerWord) * VEC);
#pragma unroll
    for (int m = 1; m < kLanesPerWord; m *= 2) word |= __shfl_xor_sync(0xffffffffu, word, m);
    const int64_t w = step * (kStepCols / 32) + lane / kLanesPerWord;
    if (lane % kLanesPerWord == 0 && w < words) mask[row * words + w] = word;
  }
}

// ------------------------------------------------------------------ host-side dispatch

template <typename T>
struct TypeTag {
  using type = T;
};

template <typename F>
void dispatch_dtype(FfnDtype dtype, F&& f) {
  switch (dtype) {
    case FfnDtype::kFloat32: return f(TypeTag<float>{});
    case FfnDtype::kFloat16: return f(TypeTag<__half>{});
    case FfnDtype::kBFloat16: return f(TypeTag<__nv_bfloat16>{});
  }
}

template <FfnActivation A>
using ActTag = std::integral_constant<FfnActivation, A>;

template <typename F>
void dispatch_activation(FfnActivation act, F&& f) {
  switch (act) {
    case FfnActivation::kIdentity: return f(ActTag<FfnActivation::kIdentity>{});
    case FfnActivation::kRelu: return f(ActTag<FfnActivation::kRelu>{});
    case FfnActivation::kGelu: return f(ActTag<FfnActivation::kGelu>{});
    case FfnActivation::kGeluTanh: return f(ActTag<FfnActivation::kGeluTanh>{});
    case FfnActivation::kSilu: return f(ActTag<FfnActivation::kSilu>{});
    case FfnActivation::kSwiglu: return f(ActTag<FfnActivation::kSwiglu>{});
    case FfnActivation::kGeglu: return f(ActTag<FfnActivation::kGeglu>{});
  }
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <typename T, FfnActivation A, int VEC>
void launch_forward(const FfnForwardArgs& a, cudaStream_t stream) {
  const dim3 block(kThreadsX, kThreadsY);
  const int64_t row_blocks = ceil_div(a.rows, kThreadsY);
  const dim3 grid(static_cast<unsigned>(ceil_div(ceil_div(a.d_ff, VEC), kThreadsX)),
                  static_cast<unsigned>(row_blocks < kMaxForwardRowBlocks ? row_blocks
                                                                          : kMaxForwardRowBlocks));
  ffn_forward_kernel<T, A, VEC><<<grid, block, 0, stream>>>(
      static_cast<const T*>(a.h), static_cast<T*>(a.g), a.rows, a.d_ff, a.seed, a.seed_ptr,
      a.dropout_p, a.dropout_p > 0.f ? a.dropout_scale : 1.f);
}

template <typename T, FfnActivation A, int VEC>
void launch_backward(const FfnBackwardArgs& a, cudaStream_t stream) {
  const dim3 block(kThreadsX, kThreadsY);
  const dim3 grid(static_cast<unsigned>(ceil_div(ceil_div(a.d_ff, VEC), kThreadsX)),
                  static_cast<unsigned>(ffn_bias_grad_row_blocks(a.rows)));
  ffn_backward_kernel<T, A, VEC><<<grid, block, 0, stream>>>(
      static_cast<const T*>(a.dg), static_cast<const T*>(a.saved), static_cast<T*>(a.dh),
      static_cast<T*>(a.g_out), a.partials, a.rows, a.d_ff, a.seed, a.seed_ptr, a.dropout_p,
      a.dropout_p > 0.f ? a.dropout_scale : 1.f);
}

// db[c] = sum of partials[b][c] over the `blocks` row blocks (0 blocks: zeros).
template <typename T>
void launch_finalize(const float* partials, void* db, int64_t blocks, int64_t width,
                     cudaStream_t stream) {
  if (width == 0) return;
  const dim3 block(kColumnSumWidth, kFinalizeRows);
  ffn_bias_grad_finalize_kernel<T><<<static_cast<unsigned>(ceil_div(width, kColumnSumWidth)),
                                     block, 0, stream>>>(partials, static_cast<T*>(db), blocks,
                                                         width);
}

template <typename T, int VEC>
void launch_column_partials(const FfnColumnSumArgs& a, cudaStream_t stream) {
  const dim3 block(kThreadsX, kThreadsY);
  const dim3 grid(static_cast<unsigned>(ceil_div(ceil_div(a.cols, VEC), kThreadsX)),
                  static_cast<unsigned>(ffn_bias_grad_row_blocks(a.rows)));
  ffn_column_partials_kernel<T, VEC><<<grid, block, 0, stream>>>(
      static_cast<const T*>(a.src), a.partials, a.rows, a.cols);
}

template <typename T, int VEC>
void launch_relu_mask(const FfnReluMaskArgs& a, cudaStream_t stream) {
  const int64_t words = ffn_relu_mask_words(a.d_ff);
  const int64_t units = a.rows * ceil_div(words * 32, int64_t{kThreadsX} * VEC);  // warp steps
  const int64_t blocks = std::min(ceil_div(units, kMaskThreads / kThreadsX), kMaxMaskBlocks);
  ffn_relu_mask_kernel<T, VEC><<<static_cast<unsigned>(blocks), kMaskThreads, 0, stream>>>(
      static_cast<const T*>(a.saved), a.mask, a.rows, a.d_ff, words, a.seed, a.seed_ptr,
      a.dropout_p);
}

}  // namespace

void ffn_forward_cuda_launch(const FfnForwardArgs& args, cudaStream_t stream) {
  if (args.rows == 0 || args.d_ff == 0) return;
  dispatch_dtype(args.dtype, [&](auto type_tag) {
    using T = typename decltype(type_tag)::type;
    constexpr int kVec = 16 / sizeof(T);
    const bool vectorized = args.d_ff % kVec == 0 && aligned16(args.h) && aligned16(args.g);
    dispatch_activation(args.act, [&](auto act_tag) {
      constexpr FfnActivation A = decltype(act_tag)::value;
      if (vectorized) {
        launch_forward<T, A, kVec>(args, stream);
      } else {
        launch_forward<T, A, 1>(args, stream);
      }
    });
  });
}

void ffn_backward_cuda_launch(const FfnBackwardArgs& args, cudaStream_t stream) {
  dispatch_dtype(args.dtype, [&](auto type_tag) {
    using T = typename decltype(type_tag)::type;
    constexpr int kVec = 16 / sizeof(T);
    const bool vectorized = args.d_ff % kVec == 0 && aligned16(args.dg) &&
                            aligned16(args.saved) && aligned16(args.dh) &&
                            (args.g_out == nullptr || aligned16(args.g_out));
    if (args.rows > 0 && args.d_ff > 0) {
      dispatch_activation(args.act, [&](auto act_tag) {
        constexpr FfnActivation A = decltype(act_tag)::value;
        if constexpr (A != FfnActivation::kIdentity) {  // the backward always knows act
          if (vectorized) {
            launch_backward<T, A, kVec>(args, stream);
          } else {
            launch_backward<T, A, 1>(args, stream);
          }
        }
      });
    }
    const int64_t width = ffn_is_gated(args.act) ? 2 * args.d_ff : args.d_ff;
    const bool any = args.rows > 0 && args.d_ff > 0;
    launch_finalize<T>(args.partials, args.db1, any ? ffn_bias_grad_row_blocks(args.rows) : 0,
                       width, stream);
  });
}

void ffn_relu_mask_cuda_launch(const FfnReluMaskArgs& args, cudaStream_t stream) {
  if (args.rows == 0 || args.d_ff == 0) return;
  dispatch_dtype(args.dtype, [&](auto type_tag) {
    using T = typename decltype(type_tag)::type;
    constexpr int kVec = 16 / sizeof(T);
    if (args.d_ff % kVec == 0 && aligned16(args.saved)) {
      launch_relu_mask<T, kVec>(args, stream);
    } else {
      launch_relu_mask<T, 1>(args, stream);
    }
  });
}

void ffn_column_sum_cuda_launch(const FfnColumnSumArgs& args, cudaStream_t stream) {
  dispatch_dtype(args.dtype, [&](auto type_tag) {
    using T = typename decltype(type_tag)::type;
    constexpr int kVec = 16 / sizeof(T);
    const bool any = args.rows > 0 && args.cols > 0;
    if (any && args.cols % kVec == 0 && aligned16(args.src)) {
      launch_column_partials<T, kVec>(args, stream);
    } else if (any) {
      launch_column_partials<T, 1>(args, stream);
    }
    launch_finalize<T>(args.partials, args.out, any ? ffn_bias_grad_row_blocks(args.rows) : 0,
                       args.cols, stream);
  });
}

}  // namespace fastformer
