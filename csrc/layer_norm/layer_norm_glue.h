// Tensors -> kernel arguments for the LayerNorm ops: used by layer_norm.cpp (its CPU kernels and
// CUDA glue) and by the CPU emulator of the CUDA kernels (tests/cuda_emu/bindings.cpp), so that
// the emulator tests this glue, not a copy of it. The caller has checked the inputs and made
// every tensor contiguous.
#pragma once

#include <ATen/ATen.h>

#include <stdexcept>
#include <vector>

namespace fastformer {
namespace ln_glue {

// The dtype of weight and bias (they must agree), or x's when both are absent.
inline at::ScalarType param_dtype(const c10::optional<at::Tensor>& weight,
                                  const c10::optional<at::Tensor>& bias, const at::Tensor& x) {
  if (weight.has_value() && bias.has_value()) {
    TORCH_CHECK(weight->scalar_type() == bias->scalar_type(),
                "layer_norm: weight and bias must have the same dtype, got ",
                weight->scalar_type(), " and ", bias->scalar_type());
  }
  if (weight.has_value()) return weight->scalar_type();
  if (bias.has_value()) return bias->scalar_type();
  return x.scalar_type();
}

// The ops take x as (..., cols): LayerNorm over the last dim, every leading dim a row (a 1-D
// x is one row). Callers pass the caller's own shape, so the outputs (empty_like(x)) have it too
// and Python needs no reshape and view around the op (each an autograd node, host time).
inline int64_t cols_of(const at::Tensor& x) { return x.size(-1); }
inline int64_t rows_of(const at::Tensor& x) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  return rows;
}

// 1 / (1 - p) from the double p, rounded once to the accumulation dtype (as the reference's
// `x * keep * scale` with a Python float scale).
inline double dropout_scale(double p) { return 1.0 / (1.0 - p); }

}  // namespace ln_glue
}  // namespace fastformer

#ifdef FASTFORMER_WITH_CUDA
#include "layer_norm/layer_norm.h"

namespace fastformer {
namespace ln_glue {

inline LnType ln_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return LnType::kFloat32;
    case at::kHalf:
      return LnType::kFloat16;
    case at::kBFloat16:
      return LnType::kBFloat16;
    default:
      TORCH_CHECK(false, "layer_norm: CUDA kernels take float32, float16 or bfloat16, got ", t);
  }
  return LnType::kFloat32;  // unreachable
}

inline const void* ptr_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr() : nullptr;
}

inline void* ptr_or_null(const at::Tensor& t) { return t.numel() > 0 ? t.data_ptr() : nullptr; }

// The fields LnFwdArgs and LnBwdArgs share.
template <typename Args>
void set_common(Args& a, const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                const c10::optional<at::Tensor>& bias, uint64_t seed, double dropout_p, bool rms,
                bool fused) {
  a.rows = rows_of(x);
  a.cols = cols_of(x);
  a.dropout_p = static_cast<float>(dropout_p);
  a.dropout_scale = static_cast<float>(dropout_scale(dropout_p));
  a.seed = seed;
  a.dtype = ln_type(x.scalar_type());
  a.wtype = ln_type(param_dtype(weight, bias, x));
  a.rms = rms;
  a.fused = fused;
}

// The forward's arguments: pre is (0,) unless stored, mean (0,) for RMSNorm.
inline LnFwdArgs fwd_args(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                          const c10::optional<at::Tensor>& bias,
                          const c10::optional<at::Tensor>& residual, const at::Tensor& out,
                          const at::Tensor& pre, const at::Tensor& mean, const at::Tensor& rstd,
                          uint64_t seed, double eps, double dropout_p, bool rms, bool fused) {
  LnFwdArgs a{};
  a.x = x.data_ptr();
  a.residual = ptr_or_null(residual);
  a.weight = ptr_or_null(weight);
  a.bias = ptr_or_null(bias);
  a.out = out.data_ptr();
  a.pre = ptr_or_null(pre);
  a.mean = rms ? nullptr : mean.data_ptr<float>();
  a.rstd = rstd.data_ptr<float>();
  a.eps = static_cast<float>(eps);
  set_common(a, x, weight, bias, seed, dropout_p, rms, fused);
  return a;
}

// The backward's arguments, all but the partial-sum workspace (sized by layer_norm_bwd_plan).
// dpre may be undefined; dres, dweight, dbias are only used when wanted.
inline LnBwdArgs bwd_args(const at::Tensor& dy, const at::Tensor& dpre, const at::Tensor& x,
                          const c10::optional<at::Tensor>& weight,
                          const c10::optional<at::Tensor>& bias, const at::Tensor& mean,
                          const at::Tensor& rstd, const at::Tensor& dx, const at::Tensor& dres,
                          const at::Tensor& dweight, const at::Tensor& dbias, uint64_t seed,
                          double dropout_p, bool rms, bool fused, bool has_residual,
                          bool need_dweight, bool need_dbias) {
  LnBwdArgs a{};
  a.dy = dy.data_ptr();
  a.dpre = dpre.defined() ? dpre.data_ptr() : nullptr;
  a.x = x.data_ptr();
  a.weight = ptr_or_null(weight);
  a.mean = rms ? nullptr : mean.data_ptr<float>();
  a.rstd = rstd.data_ptr<float>();
  a.dx = dx.data_ptr();
  a.dres = has_residual ? dres.data_ptr() : nullptr;
  a.dweight = need_dweight ? dweight.data_ptr() : nullptr;
  a.dbias = need_dbias ? dbias.data_ptr() : nullptr;
  set_common(a, x, weight, bias, seed, dropout_p, rms, fused);
  return a;
}

// layer_norm_tuning(int[] config) -> int[]: sets the CUDA launch overrides [fwd_vecs, fwd_block,
// bwd_vecs, bwd_block, stage] (0: the built-in choice; see LnTuning) and returns the
// previous ones.
inline std::vector<int64_t> tuning_op(at::IntArrayRef config) {
  TORCH_CHECK(config.size() == 5,
              "layer_norm_tuning: config is [fwd_vecs, fwd_block, bwd_vecs, bwd_block, "
              "stage], got ",
              config.size(), " values");
  LnTuning t;
  int* fields[] = {&t.fwd_vecs, &t.fwd_block, &t.bwd_vecs, &t.bwd_block, &t.stage};
  for (size_t i = 0; i < 5; ++i) {
    TORCH_CHECK(config[i] >= 0 && config[i] <= 4096, "layer_norm_tuning: bad value ", config[i]);
    *fields[i] = static_cast<int>(config[i]);
  }
  LnTuning old;
  try {
    old = set_layer_norm_tuning(t);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, e.what());
  }
  return {old.fwd_vecs, old.fwd_block, old.bwd_vecs, old.bwd_block, old.stage};
}

}  // namespace ln_glue
}  // namespace fastformer
#endif
