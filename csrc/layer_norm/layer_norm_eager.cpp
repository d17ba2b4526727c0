// fastformer._C.layer_norm_eager(input, normalized_shape, weight, bias, eps, rms) -> Tensor | None:
// the plain eager call of layer_norm and rms_norm (fastformer/ops/layer_norm.py) in one C call.
//
// Between ops that stream memory, the Python of the checked path (argument checks, the tracing
// and transform gates, the backend choice) runs with cold caches: ~45 us above the kernel on the
// CI VM, which left layer_norm 3-7% slower than F.layer_norm at 4096 x 512-1024 float32 on the
// CPU. This entry takes the common call only and returns None for anything else (a bad or
// unusual argument, a tensor subclass, a tracer, a transform, a dispatch or torch function mode,
// a backend forced to another than cpp): the Python path then runs, with its messages. It never
// raises for bad input, and where it runs it calls the ops the Python path calls (through the
// dispatcher) with the same arguments, so both give the same bits.
#include "layer_norm/layer_norm_eager.h"

#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/forward_grad.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/csrc/utils/pybind.h>

#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "common/dispatch.h"

namespace fastformer {
namespace {

// An exact torch.Tensor or nn.Parameter (a subclass may override __torch_function__), or null.
const at::Tensor* plain_tensor(PyObject* obj) {
  return THPVariable_CheckExact(obj) ? &THPVariable_Unpack(obj) : nullptr;
}

bool dense(const at::Tensor& t) { return t.layout() == at::kStrided && !t.is_nested(); }

// What the cpp backend runs: float32/16, bfloat16 on the CPU and (when built) CUDA; float64 on
// the CPU only.
bool kernel_input(const at::Tensor& x) {
  const at::ScalarType t = x.scalar_type();
  const bool half_or_float = t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
#ifdef FASTFORMER_WITH_CUDA
  if (x.is_cuda()) return half_or_float;
#endif
  return x.is_cpu() && (half_or_float || t == at::kDouble);
}

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

// Nothing that the Python path routes elsewhere: torch.jit.trace, a dispatch mode (fake tensors
// included) or torch function mode, a torch.func transform, a forward-mode AD level, a backend
// forced to another than cpp. (torch.compile never gets here: layer_norm.py asks first.)
bool plain_context() {
  if (torch::jit::tracer::isTracing() || c10::impl::TorchDispatchModeTLS::any_modes_set() ||
      at::impl::torch_function_mode_enabled() ||
      // (functorch includes this key while its layer stack is not empty)
      c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) ||
      torch::autograd::ForwardADLevel::try_get_by_idx(0) != nullptr) {
    return false;
  }
  const char* forced = std::getenv("FASTFORMER_BACKEND_LAYER_NORM");
  return forced == nullptr || forced[0] == '\0' || std::strcmp(forced, "cpp") == 0;
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

at::Tensor run(const at::Tensor& x, const OptTensor& weight, const OptTensor& bias, double eps,
               bool rms) {
  const bool grad = at::GradMode::is_enabled() &&
                    (x.requires_grad() || (weight && weight->requires_grad()) ||
                     (bias && bias->requires_grad()));
  const pybind11::gil_scoped_release no_gil;
  if (grad) {  // the C++ autograd node of csrc/autograd.cpp
    return std::get<0>(handle<LnAutograd>().call(x, weight, bias, c10::nullopt, no_seed(), eps,
                                                 0.0, rms, false));
  }
  return std::get<0>(
      handle<LnFwd>().call(x, weight, bias, c10::nullopt, no_seed(), eps, 0.0, rms, false));
}

}  // namespace

PyObject* layer_norm_eager(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 6) {
    PyErr_SetString(PyExc_TypeError,
                    "layer_norm_eager(input, normalized_shape, weight, bias, eps, rms) takes 6 "
                    "arguments");
    return nullptr;
  }
  const bool rms = args[5] == Py_True;
  const at::Tensor* x = plain_tensor(args[0]);
  if (x == nullptr || !dense(*x) || x->dim() == 0 || x->numel() == 0 || !kernel_input(*x)) {
    Py_RETURN_NONE;
  }
  OptTensor weight, bias;
  const double eps = plain_eps(args[4], *x, rms);
  if (single_dim(args[1]) != x->size(-1) || eps < 0 || !plain_param(args[2], *x, weight) ||
      !plain_param(args[3], *x, bias) || (rms && bias) ||
      (weight && bias && weight->scalar_type() != bias->scalar_type()) || !plain_context()) {
    Py_RETURN_NONE;
  }
  return THPVariable_Wrap(run(*x, weight, bias, eps, rms));
  END_HANDLE_TH_ERRORS
}

}  // namespace fastformer
