// torch.ops.fastformer.layer_norm_autograd / ffn_autograd: the eager autograd of the LayerNorm
// and FFN ops, in C++.
//
// The eager model's step on a GPU is bound by host time, and a Python autograd.Function costs
// the backward a Python call (the GIL, the ctx, saved_tensors, needs_input_grad) on top of the
// kernels' launches. These nodes run the ops' compiled kernels (layer_norm_fwd / _bwd,
// ffn_forward / _backward, redispatched so that CPU, CUDA and dispatch modes see them) and save
// what the Python Functions they replace saved; the Python wrappers still check the inputs,
// draw the dropout seed and choose the FFN's epilogue. torch.compile keeps using the custom ops
// fastformer::layer_norm and fastformer::ffn.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <string>
#include <utility>
#include <vector>

#include "common/dispatch.h"

namespace fastformer {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Identity on a backward's results, tied to the tensors they depend on; a second backward
// that reaches it raises (fastformer/ops/_autograd.py's first_order, for the C++ nodes).
struct FirstOrderOnly : public torch::autograd::Function<FirstOrderOnly> {
  static variable_list forward(AutogradContext* ctx, const std::string& op, int64_t n_tied,
                               at::TensorList tensors) {
    ctx->saved_data["op"] = op;
    variable_list out;
    for (size_t i = static_cast<size_t>(n_tied); i < tensors.size(); ++i) {
      out.push_back(tensors[i].clone());
    }
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list /*grads*/) {
    TORCH_CHECK(false, "fastformer's ", ctx->saved_data["op"].toStringRef(),
                " kernels compute first-order gradients only, and a second derivative (a "
                "backward through gradients taken with create_graph=True) was asked for; use "
                "the torch.nn / torch.nn.functional op where double backward is needed");
  }
};

// `results` as they are outside create_graph=True; inside, passed through FirstOrderOnly tied
// to whatever of `grads`, `saved` and `kept` (an input kept outside the saved variables)
// requires grad.
variable_list first_order(const std::string& op, variable_list results,
                          const variable_list& grads, const variable_list& saved,
                          const at::Tensor& kept = at::Tensor()) {
  if (!at::GradMode::is_enabled()) return results;
  const variable_list extra{kept};
  variable_list all;
  for (const auto* list : {&grads, &saved, &extra}) {
    for (const at::Tensor& t : *list) {
      if (t.defined() && t.requires_grad()) all.push_back(t);
    }
  }
  const int64_t n_tied = static_cast<int64_t>(all.size());
  if (n_tied == 0) return results;
  for (const at::Tensor& r : results) {
    if (r.defined()) all.push_back(r);
  }
  variable_list tied = FirstOrderOnly::apply(op, n_tied, at::TensorList(all));
  auto next = tied.begin();
  for (at::Tensor& r : results) {
    if (r.defined()) r = *next++;
  }
  return results;
}

struct LnBwd {
  static constexpr const char* name = "fastformer::layer_norm_bwd";
  using Sig = Tensors4(const at::Tensor&, const OptTensor&, const at::Tensor&, const OptTensor&,
                       const OptTensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                       double, bool, bool, bool, bool, bool);
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
    const at::Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(xin);
    const OptTensor dpre = grads[1].defined() && grads[1].sym_numel() != 0 ? OptTensor(grads[1])
                                                                        : c10::nullopt;
    variable_list results(9);
    {
      const at::NoGradGuard no_grad;
      auto [dx, dres, dweight, dbias] = handle<LnBwd>().call(
          dout, dpre, xin, optional(weight), optional(bias), saved[3], saved[4], saved[5],
          ctx->saved_data["dropout_p"].toDouble(), ctx->saved_data["rms"].toBool(),
          ctx->saved_data["fused"].toBool(), need_res, need_w, need_b);
      if (need_x) results[0] = dx;
      if (need_w) results[1] = dweight;
      if (need_b) results[2] = dbias;
      if (need_res) results[3] = dres;
    }
    return first_order("LayerNorm / RMSNorm", std::move(results), grads, saved);
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
    // b1 only for first_order to tie the gradients to: with x, w1 and w2 frozen, a
    // create_graph=True db1 came back as a constant (a gradient penalty silently dropped).
    // db2 is grad_out summed: a constant then, correctly. Kept outside save_for_backward: db1
    // never reads it, and an in-place update of b1 after the forward must not fail the
    // backward (torch's linear does not save its bias either).
    ctx->saved_data["b1"] = b1.value_or(at::Tensor());
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
    {
      const at::NoGradGuard no_grad;
      auto [dx, dw1, db1, dw2, db2] = handle<FfnBwd>().call(
          grads[0].contiguous(), saved[0], saved[1], saved[2], saved[3],
          ctx->saved_data["activation"].toStringRef(), ctx->saved_data["dropout_p"].toDouble(),
          ctx->saved_data["seed"].toInt(), optional(saved[4]));
      results[0] = dx;
      results[1] = dw1;
      results[3] = dw2;
      if (ctx->saved_data["has_b1"].toBool()) results[2] = db1;
      if (ctx->saved_data["has_b2"].toBool()) results[4] = db2;
    }
    return first_order("FFN", std::move(results), grads, saved,
                       ctx->saved_data["b1"].toTensor());
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
