// Launchers of the LayerNorm / RMSNorm CUDA kernels (raw pointers; the caller has checked the
// inputs). Included by layer_norm.cpp and layer_norm_cuda.cu; no torch headers here.
//
// Every tensor is a contiguous row-major (rows, cols) matrix: the caller flattens the leading
// dims into rows and the normalized dims into cols. Statistics are fp32; mean is absent for
// RMSNorm. The fused variant normalizes pre = residual + dropout(x) (dropout: keep element
// i = row * cols + col when element_uniform(seed, i) >= dropout_p, scale kept ones by
// dropout_scale), and the backward regenerates the same keep-mask from the seed.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fastformer {

// Element types of the CUDA kernels: the input dtype, and the weight dtype (input or fp32).
enum class LnType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct LnFwdArgs {
  const void* x;         // (rows, cols), dtype
  const void* residual;  // (rows, cols), dtype, or nullptr
  const void* weight;    // (cols,), wtype, or nullptr
  const void* bias;      // (cols,), wtype, or nullptr
  void* out;             // (rows, cols), dtype
  void* pre;             // (rows, cols), dtype: written when not nullptr (fused only)
  float* mean;           // (rows,) or nullptr (RMSNorm)
  float* rstd;           // (rows,)
  int64_t rows;
  int64_t cols;
  float eps;
  float dropout_p;
  float dropout_scale;  // 1 / (1 - dropout_p), rounded to fp32 as the reference does
  uint64_t seed;
  const int64_t* seed_ptr;  // or the seed is here, on the device (drawn in CUDA graph capture)
  LnType dtype;
  LnType wtype;
  bool rms;    // RMSNorm: no mean subtraction, no bias
  bool fused;  // normalize residual + dropout(x) instead of x
};

struct LnBwdArgs {
  const void* dy;      // (rows, cols), dtype
  const void* dpre;    // (rows, cols), dtype, or nullptr: gradient flowing into pre (prenorm)
  const void* x;       // (rows, cols), dtype: the normalized input (x, or pre when fused)
  const void* weight;  // (cols,), wtype, or nullptr
  const float* mean;   // (rows,) or nullptr (RMSNorm)
  const float* rstd;   // (rows,)
  void* dx;            // (rows, cols), dtype
  void* dres;          // (rows, cols), dtype, or nullptr: gradient of the residual (fused)
  void* dweight;       // (cols,), wtype, or nullptr when not wanted
  void* dbias;         // (cols,), wtype, or nullptr when not wanted
  float* partial;      // workspace: 2 * LnBwdPlan::partial_rows * cols floats, 16-byte aligned
  int64_t rows;
  int64_t cols;
  float dropout_p;
  float dropout_scale;
  uint64_t seed;
  const int64_t* seed_ptr;  // as in LnFwdArgs
  LnType dtype;
  LnType wtype;
  bool rms;
  bool fused;  // dx = dropout(dpre_total), dres = dpre_total
};

// Overrides of the launch configurations, for measuring alternatives on a GPU
// (benchmarks/sweep_layer_norm.py); 0 keeps the built-in choice. vecs: the most 16-byte vectors
// a thread holds (1, 2 or 4; the backward's 16-bit rows take at most 2 with the next row held);
// block: threads a block (a multiple of 32, 32 to 512); stage: how the vector kernels' rows
// arrive. 1 loads them into registers; 2 stages the next row through shared memory with
// cp.async (layer_norm_cuda.cu's stage_slot), 3 the next two (the unfused backward; the forward
// one); 4 has the forward read its rows in a loop instead of holding them
// (ln_fwd_chunk_kernel), the backward as built in. Process-wide, read at each launch.
struct LnTuning {
  int fwd_vecs = 0;
  int fwd_block = 0;
  int bwd_vecs = 0;
  int bwd_block = 0;
  int stage = 0;
};

// Sets the overrides and returns the previous ones; throws std::invalid_argument on a value
// outside the ranges above.
LnTuning set_layer_norm_tuning(const LnTuning& t);

// The backward grid: how many blocks, and how many rows of fp32 partial sums of dweight and
// dbias they write (summed by the finalize kernel in a fixed order: deterministic); the
// overrides it was planned with, which the launch keeps (the workspace is sized by them).
struct LnBwdPlan {
  int64_t grid;
  int64_t partial_rows;
  LnTuning tuning;
};

// num_sms: the device's SM count (the staged forward's persistent grid).
void layer_norm_fwd_cuda_launch(const LnFwdArgs& a, int num_sms, cudaStream_t stream);

LnBwdPlan layer_norm_bwd_plan(const LnBwdArgs& a, int num_sms);

void layer_norm_bwd_cuda_launch(const LnBwdArgs& a, const LnBwdPlan& plan, cudaStream_t stream);

}  // namespace fastformer
