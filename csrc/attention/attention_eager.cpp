// fastformer._C.attention_cpu_eager(query, key, value, attn_mask, dropout_p, is_causal, scale,
// enable_gqa, key_padding_mask): the plain eager CPU call of
// fastformer.ops.attention.scaled_dot_product_attention in one C call, and its backward in a
// C++ autograd node (FlashFunction).
//
// Such a call runs torch's CPU flash kernels (the op's torch backend). Around them the checked
// Python path builds the additive mask, looks for rows without a key and reads lse: a dozen
// small ops and their Python, which ran with the kernel's cold caches, ~50-110 us above the
// kernel on a 2-core EPYC VM (2026-12-07), and left the forward at 0.80-0.97x torch's
// F.scaled_dot_product_attention at batch 2-8 x 4 heads x 128-512 tokens in float32, and the
// forward + backward at 0.86-0.96x. As layer_norm_eager.cpp, this entry takes the common call
// only and returns None for anything else (a bad or unusual argument, a tensor subclass such
// as CausalBias, a float mask's gradient to record, dropout, float64, autocast, a context
// common/eager.h names, a backend forced to another than torch): the Python path then runs,
// with its messages. The Python caller does not offer it the calls the Triton interpreter
// takes. Where it runs it calls the ATen ops of that path (ops/attention.py's
// _cpu_flash_forward and _cpu_flash_backward) on the same operands, so both give the same bits.
#include "attention/attention_eager.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <vector>

#include "common/eager.h"
#include "common/grads.h"

namespace fastformer {
namespace {

using eager::dense;
using eager::plain_tensor;
using OptTensor = c10::optional<at::Tensor>;

constexpr const char* kBackendEnv = "FASTFORMER_BACKEND_ATTENTION";
constexpr int64_t kMaxHeadDim = 256;  // ops/attention.py's MAX_HEAD_DIM

// The operands of one call, as _cpu_flash_forward takes them.
struct Call {
  at::Tensor q, k, v;
  OptTensor mask, kpm;
  bool causal = false, gqa = false;
  double scale = 0;
};

bool flash_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// query, key, value: exact dense 4-D CPU tensors of one dtype that torch's CPU flash kernel
// takes, no empty dim, one head dim in [1, 256] for all three, heads as _check_heads accepts.
bool plain_qkv(Call& call, PyObject* const* args) {
  const at::Tensor* t[3] = {plain_tensor(args[0]), plain_tensor(args[1]), plain_tensor(args[2])};
  for (const at::Tensor* x : t) {
    if (x == nullptr || !dense(*x) || x->dim() != 4 || !x->is_cpu() || x->numel() == 0 ||
        x->scalar_type() != t[0]->scalar_type()) {
      return false;
    }
  }
  const at::Tensor &q = *t[0], &k = *t[1], &v = *t[2];
  const int64_t d = q.size(3), heads = q.size(1), kv_heads = k.size(1);
  const bool same_batch = k.size(0) == q.size(0) && v.size(0) == q.size(0);
  const bool same_keys = v.size(1) == kv_heads && v.size(2) == k.size(2);
  const bool same_dim = k.size(3) == d && v.size(3) == d && d <= kMaxHeadDim;
  const bool heads_ok = call.gqa ? heads % kv_heads == 0 : heads == kv_heads;
  if (!flash_dtype(q.scalar_type()) || !same_batch || !same_keys || !same_dim || !heads_ok) {
    return false;
  }
  call.q = q;
  call.k = k;
  call.v = v;
  return true;
}

// attn_mask: None, or an exact dense CPU tensor, bool or float (the query's dtype or float32),
// of at most 4 dims broadcastable to (B, H, Lq, Lk).
bool plain_mask(Call& call, PyObject* obj) {
  if (obj == Py_None) return true;
  const at::Tensor* m = plain_tensor(obj);
  if (m == nullptr || !dense(*m) || !m->is_cpu() || m->dim() > 4) return false;
  const at::ScalarType t = m->scalar_type();
  if (t != at::kBool && t != at::kFloat && t != call.q.scalar_type()) return false;
  const int64_t target[4] = {call.q.size(0), call.q.size(1), call.q.size(2), call.k.size(2)};
  for (int64_t i = 1; i <= m->dim(); ++i) {
    const int64_t size = m->size(-i);
    if (size != 1 && size != target[4 - i]) return false;
  }
  call.mask = *m;
  return true;
}

// key_padding_mask: None, or an exact dense bool CPU tensor of shape (B, Lk).
bool plain_key_padding(Call& call, PyObject* obj) {
  if (obj == Py_None) return true;
  const at::Tensor* m = plain_tensor(obj);
  if (m == nullptr || !dense(*m) || !m->is_cpu() || m->scalar_type() != at::kBool ||
      m->dim() != 2 || m->size(0) != call.q.size(0) || m->size(1) != call.k.size(2)) {
    return false;
  }
  call.kpm = *m;
  return true;
}

// scale: None (1 / sqrt(D), as _resolve_scale computes it) or a float the flash kernel takes
// (_cpu_flash_ok: at least float32's smallest normal); -1 for anything else.
double plain_scale(PyObject* scale, int64_t head_dim) {
  if (scale == Py_None) return 1.0 / std::sqrt(static_cast<double>(head_dim));
  if (!PyFloat_CheckExact(scale)) return -1;
  const double value = PyFloat_AS_DOUBLE(scale);
  return value >= 0x1p-126 && value < INFINITY ? value : -1;
}

// Whether the call records a gradient (for q, k or v: a float mask's declines the entry).
bool needs_grad(const Call& call) {
  if (!at::GradMode::is_enabled()) return false;
  return call.q.requires_grad() || call.k.requires_grad() || call.v.requires_grad();
}

// _cpu_flash_mask: the one additive 4-D mask the kernel takes; a bool mask and key padding as
// -inf, a float mask as it is.
OptTensor flash_mask(const Call& call) {
  if (!call.mask && !call.kpm) return c10::nullopt;
  const bool float_mask = call.mask && call.mask->is_floating_point();
  OptTensor keep;
  if (call.mask && !float_mask) keep = *call.mask;
  if (call.kpm) {
    const at::Tensor kept = call.kpm->unsqueeze(1).unsqueeze(1).bitwise_not();
    keep = keep ? keep->bitwise_and(kept) : kept;
  }
  const at::Tensor add = float_mask ? *call.mask : at::zeros({}, call.q.options());
  const at::Tensor mask = keep ? at::where(*keep, add, -INFINITY) : add;
  std::vector<int64_t> shape(4 - mask.dim(), 1);
  shape.insert(shape.end(), mask.sizes().begin(), mask.sizes().end());
  return mask.reshape(shape);
}

// _rows_without_key: bool (.., Lq) of the query rows the mask (and causality) leave no key, or
// none.
OptTensor rows_without_key(const at::Tensor& mask, int64_t lq, bool causal) {
  const at::Tensor visible = mask.ne(-INFINITY);
  at::Tensor empty;
  if (causal) {  // row i has a key iff its first visible key is at most i
    const at::Tensor first = at::where(visible.any(-1), visible.to(at::kByte).argmax(-1), lq);
    empty = first.gt(at::arange(lq, first.options()));
  } else {
    empty = visible.any(-1).bitwise_not();
  }
  if (!empty.any().item<bool>()) return c10::nullopt;
  return empty;
}

at::Tensor last_dim_dense(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

// key / value heads repeated for each query head they serve (GQA), reference._repeat_kv_heads.
at::Tensor query_heads(const at::Tensor& t, int64_t heads) {
  return t.size(1) == heads ? t : t.repeat_interleave(heads / t.size(1), 1);
}

// _sum_kv_groups: a gradient of the repeated heads summed back to kv_heads.
at::Tensor kv_groups(const at::Tensor& grad, int64_t kv_heads) {
  if (grad.size(1) == kv_heads) return grad;
  return grad.reshape({grad.size(0), kv_heads, -1, grad.size(2), grad.size(3)}).sum(2);
}

// The kernel's out and lse for q with its rows without a key zeroed, as _cpu_flash_forward;
// `empty`: those rows, whose lse the op gives as -inf.
std::tuple<at::Tensor, at::Tensor> flash_forward(const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& v, const OptTensor& mask,
                                                 const OptTensor& empty, bool causal,
                                                 double scale) {
  const int64_t heads = q.size(1);
  auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(
      q, last_dim_dense(query_heads(k, heads)), last_dim_dense(query_heads(v, heads)), 0.0,
      causal, mask, scale);
  const at::Tensor op_lse = empty ? lse.masked_fill(*empty, -INFINITY) : lse;
  // A NaN in a query row with keys gives NaN (the kernel gives such a row out 0, lse 0).
  if (!op_lse.all().item<bool>()) {
    const at::Tensor nan_rows = op_lse.eq(0).bitwise_and(q.isnan().any(-1));
    out.masked_fill_(nan_rows.unsqueeze(-1), NAN);
  }
  return {out, lse};
}

// fastformer/ops/attention.py's _cpu_grads_by_reference: (dq, dk, dv) by the reference's
// operations, differentiable (create_graph=True) or as _reference_backward gives them. Called in
// Python, not through the dispatcher: under vmap (is_grads_batched) the fallback takes no op
// that returns a list.
std::vector<at::Tensor> grads_by_reference(const at::Tensor& grad, const at::Tensor& q,
                                           const at::Tensor& k, const at::Tensor& v,
                                           const OptTensor& mask, bool causal, double scale,
                                           bool graph) {
  const pybind11::gil_scoped_acquire gil;
  // Never freed: no Python object may be released after the interpreter's exit.
  static const pybind11::object* fn = new pybind11::object(
      pybind11::module_::import("fastformer.ops.attention").attr("_cpu_grads_by_reference"));
  const pybind11::object mask_arg = mask ? pybind11::cast(*mask) : pybind11::none();
  return (*fn)(grad, q, k, v, mask_arg, causal, scale, graph).cast<std::vector<at::Tensor>>();
}

// _lse_keeps_its_sum on the kernel's lse (0 where the op's is -inf or NaN, which it skips):
// whether P recomputed from it is accurate, where the kernels would keep a Stat.
bool lse_keeps_its_sum(const at::Tensor& lse) {
  auto [low, high] = at::aminmax(lse);
  if (low.item<double>() > -32.0 && high.item<double>() < 32.0) return true;
  const at::Tensor finite = at::where(lse.isfinite(), lse, 0.0);
  return finite.abs().amax().item<double>() < 32.0;
}

// The autograd node of a call that records a gradient: torch's CPU flash forward and backward
// as the checked path's _AttentionFunction runs them, without its Python. q has its rows
// without a key zeroed (by an op autograd records); k and v are the caller's (heads repeated
// here and summed back in the backward). Under create_graph=True, and where lse has rounded
// away part of a row's sum (keeps_stat: float32 q or a float mask), the backward calls the
// reference's (`grads_by_reference`). A vmap'd cotangent (is_grads_batched) runs the flash
// backward through vmap's fallback, a call per sample.
struct FlashFunction : public torch::autograd::Function<FlashFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, const OptTensor& mask,
                                                const OptTensor& empty, bool causal,
                                                double scale, bool keeps_stat) {
    auto [out, lse] = flash_forward(q, k, v, mask, empty, causal, scale);
    ctx->save_for_backward({q, k, v, out, lse, mask.value_or(at::Tensor())});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["keeps_stat"] = keeps_stat;
    ctx->set_materialize_grads(false);
    return {out};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    torch::autograd::variable_list results(8);
    if (!grads[0].defined()) return results;
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2];
    const OptTensor mask = saved[5].defined() ? OptTensor(saved[5]) : c10::nullopt;
    const bool causal = ctx->saved_data["causal"].toBool();
    const double scale = ctx->saved_data["scale"].toDouble();
    const bool keeps_stat = ctx->saved_data["keeps_stat"].toBool();
    std::vector<at::Tensor> found;
    const bool graph = differentiable(grads, saved);
    if (graph || (keeps_stat && !lse_keeps_its_sum(saved[4]))) {
      found = grads_by_reference(grads[0], q, k, v, mask, causal, scale, graph);
    } else {
      const int64_t heads = q.size(1), kv_heads = k.size(1);
      auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
          last_dim_dense(grads[0]), q, last_dim_dense(query_heads(k, heads)),
          last_dim_dense(query_heads(v, heads)), last_dim_dense(saved[3]), saved[4], 0.0,
          causal, mask, scale);
      found = {dq, kv_groups(dk, kv_heads), kv_groups(dv, kv_heads)};
    }
    for (int i = 0; i < 3; ++i) {
      if (ctx->needs_input_grad(i) && found[i].defined() && found[i].numel() != 0) {
        results[i] = found[i];
      }
    }
    return results;
  }
};

// _cpu_flash_forward's output: through FlashFunction where a gradient is recorded.
at::Tensor forward(const Call& call, bool grad) {
  const pybind11::gil_scoped_release no_gil;
  const OptTensor mask = flash_mask(call);
  const OptTensor empty =
      mask ? rows_without_key(*mask, call.q.size(2), call.causal) : c10::nullopt;
  // Rows without a key get a zero query: a NaN there would give NaN where the op gives 0.
  const at::Tensor q =
      last_dim_dense(empty ? call.q.masked_fill(empty->unsqueeze(-1), 0.0) : call.q);
  if (!grad) {
    return std::get<0>(flash_forward(q, call.k, call.v, mask, empty, call.causal, call.scale));
  }
  // _keeps_stat: float32 q, or a float attn_mask
  const bool keeps_stat =
      q.scalar_type() == at::kFloat || (call.mask && call.mask->is_floating_point());
  return FlashFunction::apply(q, call.k, call.v, mask, empty, call.causal, call.scale,
                              keeps_stat)[0];
}

}  // namespace

PyObject* attention_cpu_eager(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 9) {
    return eager::arity_error(
        "attention_cpu_eager(query, key, value, attn_mask, dropout_p, is_causal, scale, "
        "enable_gqa, key_padding_mask)");
  }
  Call call;
  if (!PyBool_Check(args[5]) || !PyBool_Check(args[7]) || !PyFloat_CheckExact(args[4]) ||
      PyFloat_AS_DOUBLE(args[4]) != 0.0) {
    Py_RETURN_NONE;
  }
  call.causal = args[5] == Py_True;
  call.gqa = args[7] == Py_True;
  if (!plain_qkv(call, args) || !plain_mask(call, args[3]) || !plain_key_padding(call, args[8]) ||
      (call.mask && call.mask->requires_grad() && at::GradMode::is_enabled()) ||
      at::autocast::is_autocast_enabled(at::kCPU) ||
      !eager::plain_context(kBackendEnv, "torch")) {
    Py_RETURN_NONE;
  }
  call.scale = plain_scale(args[6], call.q.size(3));
  if (call.scale < 0) Py_RETURN_NONE;
  return THPVariable_Wrap(forward(call, needs_grad(call)));
  END_HANDLE_TH_ERRORS
}

}  // namespace fastformer
