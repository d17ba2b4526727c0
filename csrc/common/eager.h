// What the C entries of the plain eager calls share (layer_norm/layer_norm_eager.cpp,
// ffn/ffn_eager.cpp): the tests an argument or the context passes for the entry to take the
// call. Each returns false (or -1) for anything the checked Python path must see; none raises.
#pragma once

#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/forward_grad.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>

#include <cstdlib>
#include <cstring>

namespace fastformer::eager {

// An exact torch.Tensor or nn.Parameter (a subclass may override __torch_function__), or null.
inline const at::Tensor* plain_tensor(PyObject* obj) {
  return THPVariable_CheckExact(obj) ? &THPVariable_Unpack(obj) : nullptr;
}

inline bool dense(const at::Tensor& t) { return t.layout() == at::kStrided && !t.is_nested(); }

// What the cpp backends run: float32/16, bfloat16 on the CPU and (when built) CUDA; float64 on
// the CPU only.
inline bool kernel_input(const at::Tensor& x) {
  const at::ScalarType t = x.scalar_type();
  const bool half_or_float = t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
#ifdef FASTFORMER_WITH_CUDA
  if (x.is_cuda()) return half_or_float;
#endif
  return x.is_cpu() && (half_or_float || t == at::kDouble);
}

// dropout_p as a float in [0, 0.99] (rng.check_dropout_p's fast case: below every op's limit),
// -1 for anything else.
inline double plain_dropout_p(PyObject* p) {
  if (!PyFloat_CheckExact(p)) return -1;
  const double value = PyFloat_AS_DOUBLE(p);
  return value >= 0 && value <= 0.99 ? value : -1;
}

// Nothing that the Python path routes elsewhere: torch.jit.trace, a dispatch mode (fake tensors
// included) or torch function mode, a torch.func transform, a forward-mode AD level, a backend
// forced (through `backend_env`) to another than `backend`. (torch.compile never gets here: the
// Python callers ask first.)
inline bool plain_context(const char* backend_env, const char* backend = "cpp") {
  if (torch::jit::tracer::isTracing() || c10::impl::TorchDispatchModeTLS::any_modes_set() ||
      at::impl::torch_function_mode_enabled() ||
      // (functorch includes this key while its layer stack is not empty)
      c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) ||
      torch::autograd::ForwardADLevel::try_get_by_idx(0) != nullptr) {
    return false;
  }
  const char* forced = std::getenv(backend_env);
  return forced == nullptr || forced[0] == '\0' || std::strcmp(forced, backend) == 0;
}

inline PyObject* arity_error(const char* signature) {
  PyErr_Format(PyExc_TypeError, "%s: wrong number of arguments", signature);
  return nullptr;
}

}  // namespace fastformer::eager
