// torch.ops.fastformer.layer_norm_autograd / ffn_autograd: the eager autograd of the LayerNorm
// and FFN ops, in C++.
//
// The eager model's step on a GPU is bound by host time, and a Python autograd.Function costs
// the backward a Python call (the GIL, the ctx, saved_tensors, needs_input_grad) on top of the
// kernels' launches. These nodes run the ops' compiled kernels (layer_norm_fwd / _bwd,
// ffn_forward / _backward, redispatched so that CPU, CUDA and dispatch modes see them) and save
// what the Python Functions they replace saved; the Python wrappers still check the inputs,
// draw the dropout seed and choose the FFN's epilogue. Under create_graph=True their backward
// calls Python after all: the ops' *_grads_by_reference, whose gradients a second backward can
// differentiate. torch.compile keeps using the custom ops fastformer::layer_norm and
// fastformer::ffn.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "common/dispatch.h"
#include "common/grads.h"

namespace fastformer {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct LnBwd {
  static constexpr const char* name = "fastformer::layer_norm_bwd";
  using Sig = Tensors4(const at::Tensor&, const OptTensor&, const at::Tensor&, const OptTensor&,
                       const OptTensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                       double, bool, bool, bool, bool, bool);
};

// fastformer/ops/layer_norm.py's norm_grads_by_reference: the gradients of (x, weight, bias,
// residual); an empty tensor for those not needed (the need_* arguments).
struct LnByReference {
  static constexpr const char* name = "fastformer::layer_norm_grads_by_reference";
  using Sig = std::vector<at::Tensor>(const OptTensor&, const OptTensor&, const at::Tensor&,
                                      const OptTensor&, const OptTensor&, const at::Tensor&,
                                      double, double, bool, bool, bool, bool, bool, bool);
};

OptTensor optional(const at::Tensor& t) { return t.defined() ? OptTensor(t) : c10::nullopt; }

// Saves what the backward needs: the normalized input (x, or pre when fused), the parameters,
// mean, rstd and the seed (the dropout mask is regenerated from it, never stored).
struct LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const OptTensor& weight,
                               const OptTensor& bias, const OptTensor& residual,
                               const at::Tensor& seed, double eps, double dropout_p, bool rms,
                               bool store_pre) {
    auto [out, pre, mean, rstd] =
        handle<LnFwd>().call(x, weight, bias, residual, seed, eps, dropout_p, rms, store_pre);
    // The kernel normalizes pre (and writes it) when there is something to add or drop.
    const bool fused = residual.has_value() || dropout_p > 0 || store_pre;
    TORCH_CHECK(!fused || pre.sym_numel() != 0 || x.sym_numel() == 0,
                "fastformer::layer_norm_autograd: the backward needs pre; call with store_pre");
    // (Zero rows: no pre is written; x, as empty, stands for it.)
    const bool use_pre = fused && pre.sym_numel() != 0;
    ctx->save_for_backward({use_pre ? pre : x, weight.value_or(at::Tensor()),
                            bias.value_or(at::Tensor()), mean, rstd, seed});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["rms"] = rms;
    ctx->saved_data["fused"] = fused;
    // needs_input_grad counts tensor arguments only, absent optionals not included.
    const int64_t w_edge = weight.has_value() ? 1 : 0, b_edge = w_edge + bias.has_value();
    ctx->saved_data["weight_edge"] = weight.has_value() ? w_edge : int64_t{-1};
    ctx->saved_data["bias_edge"] = bias.has_value() ? b_edge : int64_t{-1};
    ctx->saved_data["residual_edge"] = residual.has_value() ? b_edge + 1 : int64_t{-1};
    ctx->set_materialize_grads(false);  // an unused pre gets no zero gradient tensor
    // pre = residual + dropout(x) depends on neither weight nor bias: not differentiable when
    // only they require grad (torch's autograd says so of such an output, and raises on it).
    if (!x.requires_grad() && !(residual.has_value() && residual->requires_grad())) {
      ctx->mark_non_differentiable({pre});
    }
    return {out, pre};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &xin = saved[0], &weight = saved[1], &bias = saved[2];
    auto needs = [&](const char* edge) {
      const int64_t i = ctx->saved_data[edge].toInt();
      return i >= 0 && ctx->needs_input_grad(i);
    };
    // Only pre used (out's gradient undefined): weight and bias did not shape it, so no
    // gradient (None, as torch gives; a zero tensor would count for weight decay and momentum).
    const bool out_used = grads[0].defined();
    const bool need_x = ctx->needs_input_grad(0), need_w = out_used && needs("weight_edge");
    const bool need_b = out_used && needs("bias_edge"), need_res = needs("residual_edge");
    const OptTensor dpre = grads[1].defined() && grads[1].sym_numel() != 0 ? OptTensor(grads[1])
                                                                        : c10::nullopt;
    const double dropout_p = ctx->saved_data["dropout_p"].toDouble();
    const bool rms = ctx->saved_data["rms"].toBool(), fused = ctx->saved_data["fused"].toBool();
    std::vector<at::Tensor> found;  // of (x, weight, bias, residual)
    if (differentiable(grads, saved)) {
      found = handle<LnByReference>().call(
          optional(grads[0]), dpre, xin, optional(weight), optional(bias), saved[5],
          ctx->saved_data["eps"].toDouble(), dropout_p, rms, fused, need_x, need_w, need_b,
          need_res);
    } else {
      const at::Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(xin);
      auto [dx, dres, dweight, dbias] = handle<LnBwd>().call(
          dout, dpre, xin, optional(weight), optional(bias), saved[3], saved[4], saved[5],
          dropout_p, rms, fused, need_res, need_w, need_b);
      found = {dx, dweight, dbias, dres};
    }
    variable_list results(9);
    const bool needed[4] = {need_x, need_w, need_b, need_res};
    for (int i = 0; i < 4; ++i) {
      if (needed[i]) results[i] = found[i];
    }
    return results;
  }
};

// The op's kernel: for the Autograd key the node above; below autograd (inference mode, tensors
// without autograd keys) the forward alone.
template <bool kAutograd>
std::tuple<at::Tensor, at::Tensor> layer_norm_autograd(const at::Tensor& x,
                                                       const OptTensor& weight,
                                                       const OptTensor& bias,
                                                       const OptTensor& residual,
                                                       const at::Tensor& seed, double eps,
                                                       double dropout_p, bool rms,
                                                       bool store_pre) {
  if constexpr (kAutograd) {
    variable_list out = LayerNormFunction::apply(x, weight, bias, residual, seed, eps, dropout_p,
                                                 rms, store_pre);
    return {out[0], out[1]};
  } else {
    auto [out, pre, mean, rstd] =
        handle<LnFwd>().call(x, weight, bias, residual, seed, eps, dropout_p, rms, store_pre);
    return {out, pre};
  }
}

struct FfnBwd {
  static constexpr const char* name = "fastformer::ffn_backward";
  using Sig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, c10::string_view, double, int64_t, const OptTensor&);
};

// fastformer/ops/ffn.py's ffn_grads_by_reference: the gradients of (x, w1, b1, w2, b2), an
// empty tensor for those not computed.
struct FfnByReference {
  static constexpr const char* name = "fastformer::ffn_grads_by_reference";
  using Sig = std::vector<at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const OptTensor&, const at::Tensor&, const OptTensor&,
                                      int64_t, c10::string_view, double, bool, int64_t);
};

// Saves x, the weights and the forward's saved activation (the pre-activation, or for relu
// the dropped activation); the dropout mask is regenerated from the seed.
struct FfnFunction : public torch::autograd::Function<FfnFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w1,
                               const OptTensor& b1, const at::Tensor& w2, const OptTensor& b2,
                               c10::string_view activation, double dropout_p, int64_t seed,
                               bool fused_epilogue, const OptTensor& device_seed) {
    auto [out, saved] = handle<FfnFwd>().call(x.contiguous(), w1, b1, w2, b2, activation,
                                              dropout_p, seed, fused_epilogue, device_seed);
    ctx->save_for_backward({x, w1, w2, saved, device_seed.value_or(at::Tensor())});
    // b1 kept outside save_for_backward: the kernels' backward never reads it, and an in-place
    // update of b1 after the forward must not fail it (torch's linear does not save its bias
    // either). A create_graph=True backward reads it (ffn_grads_by_reference, which refuses an
    // update since the forward by its version), and `differentiable` looks at it: with x, w1
    // and w2 frozen, db1 came back as a constant there (a gradient penalty silently dropped).
    ctx->saved_data["b1"] = b1.value_or(at::Tensor());
    ctx->saved_data["b1_version"] = b1.has_value() ? int64_t(b1->_version()) : int64_t{-1};
    ctx->saved_data["activation"] = std::string(activation);
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["seed"] = seed;
    ctx->saved_data["has_b1"] = b1.has_value();
    ctx->saved_data["has_b2"] = b2.has_value();
    ctx->set_materialize_grads(false);
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list results(10);
    if (!grads[0].defined()) return results;  // nothing flowed into the output
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor b1 = ctx->saved_data["b1"].toTensor();
    const std::string activation = ctx->saved_data["activation"].toStringRef();
    const double dropout_p = ctx->saved_data["dropout_p"].toDouble();
    const int64_t seed = ctx->saved_data["seed"].toInt();
    const bool has_b1 = ctx->saved_data["has_b1"].toBool();
    const bool has_b2 = ctx->saved_data["has_b2"].toBool();
    std::vector<at::Tensor> found;
    if (differentiable(grads, saved, b1)) {
      found = handle<FfnByReference>().call(grads[0], saved[0], saved[1], optional(b1), saved[2],
                                            optional(saved[4]), seed, activation, dropout_p,
                                            has_b2, ctx->saved_data["b1_version"].toInt());
      // An input that does not require grad got an empty tensor: no gradient.
      const at::Tensor inputs[4] = {saved[0], saved[1], b1, saved[2]};
      for (int i = 0; i < 4; ++i) {
        if (!inputs[i].defined() || !inputs[i].requires_grad()) found[i] = at::Tensor();
      }
    } else {
      auto [dx, dw1, db1, dw2, db2] =
          handle<FfnBwd>().call(grads[0].contiguous(), saved[0], saved[1], saved[2], saved[3],
                                activation, dropout_p, seed, optional(saved[4]));
      found = {dx, dw1, db1, dw2, db2};
    }
    results[0] = found[0];
    results[1] = found[1];
    results[3] = found[3];
    if (has_b1) results[2] = found[2];
    if (has_b2) results[4] = found[4];
    return results;
  }
};

// As layer_norm_autograd: the node for the Autograd key, the forward alone below autograd.
template <bool kAutograd>
at::Tensor ffn_autograd(const at::Tensor& x, const at::Tensor& w1, const OptTensor& b1,
                        const at::Tensor& w2, const OptTensor& b2, c10::string_view activation,
                        double dropout_p, int64_t seed, bool fused_epilogue,
                        const OptTensor& device_seed) {
  if constexpr (kAutograd) {
    return FfnFunction::apply(x, w1, b1, w2, b2, activation, dropout_p, seed, fused_epilogue,
                              device_seed)[0];
  } else {
    auto [out, saved] = handle<FfnFwd>().call(x.contiguous(), w1, b1, w2, b2, activation,
                                              dropout_p, seed, fused_epilogue, device_seed);
    return out;
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastformer, m) {
  m.def(
      "layer_norm_autograd(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, "
      "Tensor seed, float eps, float dropout_p, bool rms, bool store_pre) "
      "-> (Tensor out, Tensor pre)");
  m.def(
      "ffn_autograd(Tensor x, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, str activation, "
      "float dropout_p, int seed, bool fused_epilogue=False, Tensor? device_seed=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastformer, Autograd, m) {
  m.impl("layer_norm_autograd", &layer_norm_autograd<true>);
  m.impl("ffn_autograd", &ffn_autograd<true>);
}

TORCH_LIBRARY_IMPL(fastformer, CompositeExplicitAutograd, m) {
  m.impl("layer_norm_autograd", &layer_norm_autograd<false>);
  m.impl("ffn_autograd", &ffn_autograd<false>);
}

}  // namespace fastformer
