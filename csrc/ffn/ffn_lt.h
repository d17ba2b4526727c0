// The relu FFN's backward through cuBLASLt's DRELU_BGRAD epilogue (ffn_lt.cpp): linear2's input
// gradient, relu's derivative and linear1's bias gradient in one GEMM, in place of a GEMM and
// an elementwise pass over three (tokens, d_ff) tensors.
#pragma once

#include <string>

#ifdef FASTFORMER_WITH_CUDA
#include <ATen/ATen.h>

#include <optional>

#include "ffn/ffn.h"
#endif

namespace fastformer {

// FASTFORMER_FFN_DRELU: which path takes the CUDA relu backward. "kernel" (the default: dgrad
// by at::mm, then ffn_backward_kernel) or "epilogue" (cuBLASLt's DRELU_BGRAD; not yet timed on a
// GPU, so opt-in). Anything else raises a ValueError naming the variable and its values.
enum class FfnDreluMode { kKernel, kEpilogue };
FfnDreluMode ffn_drelu_mode();
std::string ffn_drelu_mode_name();  // the validated value, for Python (fastformer._C)

#ifdef FASTFORMER_WITH_CUDA
// dh and db1 of the relu FFN's backward: dh = alpha * grad_out @ w2 where the relu bitmask of
// `saved` (ffn_relu_mask_cuda_launch) lets the gradient pass, 0 elsewhere; db1 = dh summed over
// the tokens. alpha is 1 / (1 - p) with dropout, else 1. grad_out (tokens, d_out), w2 (d_out,
// d_ff) and saved (tokens, d_ff) are contiguous, of `dtype`, on the current device. nullopt when
// this path does not run here (float32, a device whose bitmask layout did not check out, or no
// cuBLASLt algorithm for the shape): the caller takes the kernel path, nothing was written.
std::optional<std::pair<at::Tensor, at::Tensor>> ffn_drelu_bgrad_lt(
    const at::Tensor& grad_out, const at::Tensor& w2, const at::Tensor& saved, FfnDtype dtype,
    float alpha, float dropout_p, uint64_t seed, const int64_t* seed_ptr);

// Whether this device's cuBLASLt reads relu bitmasks as ffn_relu_mask_cuda_launch writes them:
// the bits of ffn_relu_mask_layout_sample below agree below d_ff, once per device and process
// (it synchronizes; inside CUDA graph capture it is not run and reports false).
bool ffn_relu_mask_layout_ok();

// One RELU_AUX GEMM, D = relu(a b^T) (d_ff = 376, 8 tokens) for two irregular sign vectors:
// (cuBLASLt's bitmask of it, ffn_relu_mask_cuda_launch's of D, d_ff), both int32 (tokens,
// ffn_relu_mask_words(d_ff)) on the CPU; nullopt when cuBLASLt has no algorithm for it. Also
// for a test that prints both when they differ: what a fix of the layout needs.
struct FfnReluMaskSample {
  at::Tensor theirs, ours;
  int64_t d_ff;
};
std::optional<FfnReluMaskSample> ffn_relu_mask_layout_sample();
#endif

}  // namespace fastformer
