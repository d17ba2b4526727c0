// fastformer._C.layer_norm_eager(input, normalized_shape, weight, bias, eps, rms) and
// dropout_add_layer_norm_eager(x, residual, weight, bias, eps, dropout_p, prenorm, seed_fn): the
// plain eager calls of layer_norm, rms_norm and dropout_add_layer_norm
// (fastformer/ops/layer_norm.py) in one C call each.
//
// Between ops that stream memory, the Python of the checked path (argument checks, the tracing
// and transform gates, the backend choice) runs with cold caches: ~45 us above the kernel on a
// 2-core Xeon VM (2026-12-05), which left layer_norm's forward at 0.85-1.00x F.layer_norm's speed
// at 4096 x 512-1024 float32 on the CPU. These entries take the common call only and return None
// for anything else (a bad or unusual argument, a tensor subclass, a tracer, a transform, a
// dispatch or torch function mode, a backend forced to another than cpp: common/eager.h): the
// Python path then runs, with its messages. They never raise for bad input, and where they run
// they call the ops the Python path calls (through the dispatcher) with the same arguments, so
// both give the same bits. A call with dropout draws its seed through seed_fn, the Python path's
// own draw.
#include "layer_norm/layer_norm_eager.h"

#include <ATen/ATen.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include <cfloat>
#include <cmath>

#include "common/dispatch.h"
#include "common/eager.h"

namespace fastformer {
namespace {

using eager::dense;
using eager::plain_tensor;

constexpr const char* kBackendEnv = "FASTFORMER_BACKEND_LAYER_NORM";

// normalized_shape as the common call gives it: an int, or one int in a tuple (torch.Size too)
// or list; -1 for anything else.
int64_t single_dim(PyObject* shape) {
  PyObject* item = shape;
  if (PyTuple_Check(shape) && PyTuple_GET_SIZE(shape) == 1) {
    item = PyTuple_GET_ITEM(shape, 0);
  } else if (PyList_CheckExact(shape) && PyList_GET_SIZE(shape) == 1) {
    item = PyList_GET_ITEM(shape, 0);
  }
  if (!PyLong_CheckExact(item)) return -1;
  int overflow = 0;
  const long long dim = PyLong_AsLongLongAndOverflow(item, &overflow);
  return overflow == 0 ? dim : -1;
}

// weight or bias: None, or a (cols,) dense tensor of x's dtype or float32 on x's device.
bool plain_param(PyObject* obj, const at::Tensor& x, OptTensor& param) {
  if (obj == Py_None) return true;
  const at::Tensor* p = plain_tensor(obj);
  if (p == nullptr || !dense(*p) || p->dim() != 1 || p->size(0) != x.size(-1)) return false;
  if (p->scalar_type() != x.scalar_type() && p->scalar_type() != at::kFloat) return false;
  if (p->device() != x.device()) return false;
  param = *p;
  return true;
}

// eps as a float in (0, inf), or None for RMSNorm (F.rms_norm's default, as
// reference.rms_norm_eps: float64's machine epsilon for float64 inputs, else float32's); -1
// for anything else.
double plain_eps(PyObject* eps, const at::Tensor& x, bool rms) {
  if (rms && eps == Py_None) return x.scalar_type() == at::kDouble ? DBL_EPSILON : FLT_EPSILON;
  if (!PyFloat_CheckExact(eps)) return -1;
  const double value = PyFloat_AS_DOUBLE(eps);
  return value > 0 && value < INFINITY ? value : -1;
}

// rng.NO_SEED's twin, the seed of a call that drops nothing: a normal tensor even when first
// made under inference mode (the autograd node saves it). Never freed: no destructor runs after
// the allocator's at exit.
const at::Tensor& no_seed() {
  static const at::Tensor* seed = [] {
    const c10::InferenceMode normal(false);
    return new at::Tensor(at::zeros({}, at::dtype(at::kLong)));
  }();
  return *seed;
}

// The operands of one call, as the ops take them.
struct Call {
  const at::Tensor* x = nullptr;
  OptTensor weight, bias, residual;
  double eps = 0;
  double dropout_p = 0;
  bool rms = false;
};

// x, weight and bias of a plain call (the input checks of layer_norm.py's fast cases), each
// parameter of x's last dim: false for anything else.
bool plain_operands(Call& call, PyObject* x, PyObject* weight, PyObject* bias, PyObject* eps) {
  call.x = plain_tensor(x);
  if (call.x == nullptr || !dense(*call.x) || call.x->dim() == 0 || call.x->numel() == 0 ||
      !eager::kernel_input(*call.x)) {
    return false;
  }
  call.eps = plain_eps(eps, *call.x, call.rms);
  return call.eps > 0 && plain_param(weight, *call.x, call.weight) &&
         plain_param(bias, *call.x, call.bias) &&
         !(call.weight && call.bias && call.weight->scalar_type() != call.bias->scalar_type());
}

bool needs_grad(const Call& call) {
  if (!at::GradMode::is_enabled()) return false;
  for (const OptTensor& t : {call.weight, call.bias, call.residual}) {
    if (t && t->requires_grad()) return true;
  }
  return call.x->requires_grad();
}

// out and pre, through the ops layer_norm.py's _run_cpp calls: the C++ autograd node of
// csrc/autograd.cpp when a gradient is needed, else the forward alone.
std::tuple<at::Tensor, at::Tensor> run(const Call& call, const at::Tensor& seed, bool grad,
                                       bool store_pre) {
  const pybind11::gil_scoped_release no_gil;
  if (grad) {
    return handle<LnAutograd>().call(*call.x, call.weight, call.bias, call.residual, seed,
                                     call.eps, call.dropout_p, call.rms, store_pre);
  }
  auto [out, pre, mean, rstd] = handle<LnFwd>().call(*call.x, call.weight, call.bias,
                                                     call.residual, seed, call.eps,
                                                     call.dropout_p, call.rms, store_pre);
  return {out, pre};
}

// residual: None, or a dense tensor of x's shape, dtype and device.
bool plain_residual(PyObject* obj, Call& call) {
  if (obj == Py_None) return true;
  const at::Tensor* r = plain_tensor(obj);
  if (r == nullptr || !dense(*r) || r->sizes() != call.x->sizes()) return false;
  if (r->scalar_type() != call.x->scalar_type() || r->device() != call.x->device()) return false;
  call.residual = *r;
  return true;
}

// The seed tensor of a call with dropout, from layer_norm.py's _eager_seed(x, dropout_p, grad):
// the draw of the checked path (the torch generator; on the device inside CUDA graph capture).
at::Tensor draw_seed(PyObject* seed_fn, PyObject* x, PyObject* dropout_p, bool grad) {
  PyObject* seed =
      PyObject_CallFunctionObjArgs(seed_fn, x, dropout_p, grad ? Py_True : Py_False, nullptr);
  if (seed == nullptr) throw python_error();
  if (!THPVariable_Check(seed)) {
    Py_DECREF(seed);
    throw std::runtime_error("layer_norm.py's _eager_seed did not return a tensor");
  }
  at::Tensor value = THPVariable_Unpack(seed);
  Py_DECREF(seed);
  return value;
}

}  // namespace

PyObject* layer_norm_eager(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 6) {
    return eager::arity_error(
        "layer_norm_eager(input, normalized_shape, weight, bias, eps, rms)");
  }
  Call call;
  call.rms = args[5] == Py_True;
  if (!plain_operands(call, args[0], args[2], args[3], args[4]) ||
      single_dim(args[1]) != call.x->size(-1) || (call.rms && call.bias) ||
      !eager::plain_context(kBackendEnv)) {
    Py_RETURN_NONE;
  }
  return THPVariable_Wrap(std::get<0>(run(call, no_seed(), needs_grad(call), false)));
  END_HANDLE_TH_ERRORS
}

PyObject* dropout_add_layer_norm_eager(PyObject* /*self*/, PyObject* const* args,
                                       Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 8) {
    return eager::arity_error(
        "dropout_add_layer_norm_eager(x, residual, weight, bias, eps, dropout_p, prenorm, "
        "seed_fn)");
  }
  Call call;
  call.dropout_p = eager::plain_dropout_p(args[5]);
  if (!plain_operands(call, args[0], args[2], args[3], args[4]) ||
      !plain_residual(args[1], call) || call.dropout_p < 0 || !PyBool_Check(args[6]) ||
      !eager::plain_context(kBackendEnv)) {
    Py_RETURN_NONE;
  }
  const bool prenorm = args[6] == Py_True;
  const bool grad = needs_grad(call);
  // As _run_cpp: pre is stored when returned, or for a backward that needs it.
  const bool store_pre = prenorm || (grad && (call.residual || call.dropout_p > 0));
  const at::Tensor seed =
      call.dropout_p > 0 ? draw_seed(args[7], args[0], args[5], grad) : no_seed();
  auto [out, pre] = run(call, seed, grad, store_pre);
  if (!prenorm) return THPVariable_Wrap(std::move(out));
  return Py_BuildValue("(NN)", THPVariable_Wrap(std::move(out)), THPVariable_Wrap(std::move(pre)));
  END_HANDLE_TH_ERRORS
}

}  // namespace fastformer
