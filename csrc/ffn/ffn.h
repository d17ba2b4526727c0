// The fused FFN's elementwise stages, shared by the C++ glue (ffn.cpp) and the CUDA kernels
// (ffn_cuda.cu). No torch headers here: ffn_cuda.cu must compile alone with nvcc.
//
// Layouts (row-major, contiguous, rows = tokens):
//   h      (rows, width)  pre-activation linear1(x); width = d_ff, or 2 * d_ff when gated
//                         (columns [0, d_ff) are the gate, [d_ff, 2 d_ff) the linear "up" half)
//   g      (rows, d_ff)   dropout(act(h)), the input of linear2
//   dg     (rows, d_ff)   gradient of g
//   dh     (rows, width)  gradient of h
// Dropout keeps element (t, j) of g where element_uniform(seed, t * d_ff + j) >= p and scales
// kept elements by 1 / (1 - p).
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(FASTFORMER_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace fastformer {

// kIdentity is dropout only: the activation already ran in cuBLASLt's GEMM epilogue.
enum class FfnActivation : int {
  kIdentity = 0,
  kRelu,
  kGelu,      // exact: x * Phi(x)
  kGeluTanh,  // tanh approximation
  kSilu,
  kSwiglu,  // silu(gate) * up
  kGeglu,   // gelu(gate) * up (exact gelu)
};

enum class FfnDtype : int { kFloat32 = 0, kFloat16, kBFloat16 };

inline bool ffn_is_gated(FfnActivation act) {
  return act == FfnActivation::kSwiglu || act == FfnActivation::kGeglu;
}

// Forward elementwise stage: g = dropout(act(h)). h may alias g (in-place) when not gated.
struct FfnForwardArgs {
  const void* h;
  void* g;
  int64_t rows;
  int64_t d_ff;
  uint64_t seed;
  float dropout_p;      // 0 disables dropout (no Philox work at all)
  float dropout_scale;  // 1 / (1 - dropout_p)
  FfnActivation act;
  FfnDtype dtype;
  const int64_t* seed_ptr = nullptr;  // or the seed is here, on the device (drawn in capture)
};

// Backward elementwise stage with the bias-gradient column reduction (any activation but
// kIdentity, which is forward-only).
//   relu:   saved = g (the forward's dropout(relu(h))); dh = (g > 0) * dg / (1 - p); no g_out.
//   others: saved = h; the keep-mask is regenerated; dh = dg * keep / (1 - p) * act'(h) (gated:
//           d gate = dg' * up * act'(gate), d up = dg' * act(gate)); g_out = dropout(act(h))
//           recomputed for linear2's weight gradient.
// dh may be dg itself when not gated (the CUDA glue writes it in place).
// db1 (width, in dtype) is the column sum of dh in fp32: per-block partials in `partials`
// (ffn_bias_grad_row_blocks(rows) * width floats) then a fixed-order finalize, no atomics.
struct FfnBackwardArgs {
  const void* dg;
  const void* saved;
  void* dh;
  void* g_out;  // null for relu
  float* partials;
  void* db1;
  int64_t rows;
  int64_t d_ff;
  uint64_t seed;
  float dropout_p;
  float dropout_scale;
  FfnActivation act;
  FfnDtype dtype;
  const int64_t* seed_ptr = nullptr;  // as in FfnForwardArgs
};

// Column sums of a (rows, cols) matrix, out[c] = sum over rows of src[r][c] (the bias gradient
// of linear2: grad_out summed over tokens), deterministic: fp32 partial sums per row block
// (`partials`, (ffn_bias_grad_row_blocks(rows), cols)), then summed in a fixed order.
struct FfnColumnSumArgs {
  const void* src;
  float* partials;
  void* out;
  int64_t rows;
  int64_t cols;
  FfnDtype dtype;
};

// The relu bitmask cuBLASLt's DRELU_BGRAD epilogue reads, made from saved = dropout(relu(h))
// by FfnBackwardArgs' relu rule: an element's bit is set where dh = dg / (1 - p) (0 elsewhere).
// Element (t, j) is bit j % 32 of word t * ffn_relu_mask_words(d_ff) + j / 32 of `mask`: a
// column-major bit matrix (d_ff, rows) whose leading dimension is d_ff rounded up to 128 bits,
// as cuBLASLt asks; bits past d_ff are 0. (cuBLASLt does not document the bit order inside its
// words: ffn_lt.cpp checks this one against its own RELU_AUX mask before using it on a device.)
struct FfnReluMaskArgs {
  const void* saved;
  uint32_t* mask;
  int64_t rows;
  int64_t d_ff;
  uint64_t seed;  // the keep decision of a NaN element, as the backward kernel draws it
  float dropout_p;
  FfnDtype dtype;
  const int64_t* seed_ptr = nullptr;  // as in FfnForwardArgs
};

// 32-bit words of one token's row of the relu bitmask.
inline int64_t ffn_relu_mask_words(int64_t d_ff) { return (d_ff + 127) / 128 * 4; }

// Rows one backward block covers per pass, and the most row blocks (partials) per column.
constexpr int64_t kFfnRowsPerBlock = 32;
constexpr int64_t kFfnMaxRowBlocks = 256;

// Number of row blocks of the backward kernel: depends on `rows` only, so the reduction order
// (and hence db1, bit for bit) does not depend on the device.
inline int64_t ffn_bias_grad_row_blocks(int64_t rows) {
  const int64_t blocks = (rows + kFfnRowsPerBlock - 1) / kFfnRowsPerBlock;
  return blocks < 1 ? 1 : (blocks > kFfnMaxRowBlocks ? kFfnMaxRowBlocks : blocks);
}

#if defined(__CUDACC__) || defined(FASTFORMER_WITH_CUDA)
void ffn_forward_cuda_launch(const FfnForwardArgs& args, cudaStream_t stream);
void ffn_backward_cuda_launch(const FfnBackwardArgs& args, cudaStream_t stream);
void ffn_column_sum_cuda_launch(const FfnColumnSumArgs& args, cudaStream_t stream);
void ffn_relu_mask_cuda_launch(const FfnReluMaskArgs& args, cudaStream_t stream);
#endif

}  // namespace fastformer
