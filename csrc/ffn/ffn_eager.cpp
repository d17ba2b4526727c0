// fastformer._C.ffn_eager(x, w1, b1, w2, b2, activation, dropout_p, seed_fn): the plain eager
// call of fastformer.ops.ffn in one C call.
//
// The checked Python path (its argument checks, the tracing and transform gates, the backend
// and epilogue choices) cost ~12 us a call above the op, ~40 us between ops that stream memory
// (2-core Xeon VM, 2026-12-05): host time the GPU's host-bound model step pays twelve times a
// forward. As layer_norm_eager.cpp, this entry takes the common call only and returns None for
// anything else (a bad or unusual argument, a tensor subclass, a context common/eager.h names, an
// epilogue mode forced, gelu_tanh's epilogue choice on CUDA, which reads the GPU's
// capability): the Python path then runs, with its messages. Where it runs it calls the op that
// path calls, with the same arguments, so both give the same bits; a call with dropout draws
// its seed through seed_fn, the Python path's own draw.
#include "ffn/ffn_eager.h"

#include <ATen/ATen.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdlib>
#include <cstring>
#include <string_view>

#include "common/dispatch.h"
#include "common/eager.h"

namespace fastformer {
namespace {

using eager::dense;
using eager::plain_tensor;

// The operands of one call, as the op takes them.
struct Call {
  const at::Tensor* x = nullptr;
  const at::Tensor* w1 = nullptr;
  const at::Tensor* w2 = nullptr;
  OptTensor b1, b2, device_seed;
  std::string_view activation;
  double dropout_p = 0;
  int64_t seed = 0;
  bool fused = false;
};

// A dense tensor of x's dtype and device with `dim` dims and no empty one, or null.
const at::Tensor* like_x(PyObject* obj, const at::Tensor& x, int64_t dim) {
  const at::Tensor* t = plain_tensor(obj);
  if (t == nullptr || !dense(*t) || t->dim() != dim || t->numel() == 0) return nullptr;
  return t->scalar_type() == x.scalar_type() && t->device() == x.device() ? t : nullptr;
}

// A bias: None, or a (size,) tensor as like_x.
bool plain_bias(PyObject* obj, const at::Tensor& x, int64_t size, OptTensor& bias) {
  if (obj == Py_None) return true;
  const at::Tensor* b = like_x(obj, x, 1);
  if (b == nullptr || b->size(0) != size) return false;
  bias = *b;
  return true;
}

// activation as one of ffn.ACTIVATIONS; 1 for a gated one, 0 for another, -1 for anything else.
int plain_activation(PyObject* obj, std::string_view& activation) {
  if (!PyUnicode_CheckExact(obj)) return -1;
  Py_ssize_t size = 0;
  const char* text = PyUnicode_AsUTF8AndSize(obj, &size);
  if (text == nullptr) {
    PyErr_Clear();
    return -1;
  }
  activation = std::string_view(text, static_cast<size_t>(size));
  if (activation == "swiglu" || activation == "geglu") return 1;
  const bool plain = activation == "relu" || activation == "gelu" ||
                     activation == "gelu_tanh" || activation == "silu";
  return plain ? 0 : -1;
}

// x, the weights and the biases of a plain call (ffn.py's _check_inputs, cpp backend): false
// for anything else.
bool plain_operands(Call& call, PyObject* const* args) {
  call.x = plain_tensor(args[0]);
  if (call.x == nullptr || !dense(*call.x) || call.x->dim() == 0 || call.x->numel() == 0 ||
      !eager::kernel_input(*call.x)) {
    return false;
  }
  const int gated = plain_activation(args[5], call.activation);
  call.w1 = like_x(args[1], *call.x, 2);
  call.w2 = like_x(args[3], *call.x, 2);
  if (gated < 0 || call.w1 == nullptr || call.w2 == nullptr) return false;
  const int64_t rows = call.w1->size(0);
  if (call.w1->size(1) != call.x->size(-1) || (gated && rows % 2 != 0)) return false;
  return call.w2->size(1) == (gated ? rows / 2 : rows) &&
         plain_bias(args[2], *call.x, rows, call.b1) &&
         plain_bias(args[4], *call.x, call.w2->size(0), call.b2);
}

bool needs_grad(const Call& call) {
  if (!at::GradMode::is_enabled()) return false;
  for (const OptTensor& b : {call.b1, call.b2}) {
    if (b && b->requires_grad()) return true;
  }
  return call.x->requires_grad() || call.w1->requires_grad() || call.w2->requires_grad();
}

// ffn.use_fused_epilogue in its default mode: relu in cuBLASLt's epilogue on every GPU, no other
// activation but gelu_tanh without a gradient, which reads the GPU's capability. 1 or 0, or -1
// where the Python path decides (that case, or FASTFORMER_FFN_EPILOGUE set other than auto).
int fused_epilogue(const Call& call, bool grad) {
  if (!call.x->is_cuda()) return 0;
  const char* mode = std::getenv("FASTFORMER_FFN_EPILOGUE");
  if (mode != nullptr && mode[0] != '\0' && std::strcmp(mode, "auto") != 0) return -1;
  if (call.activation == "relu") return 1;
  return call.activation == "gelu_tanh" && !grad ? -1 : 0;
}

// The seed of a call with dropout, from ffn.py's rng.call_seed(x.device, dropout_p): an int, or
// inside CUDA graph capture a tensor drawn on the device (then the op's seed is 0).
void draw_seed(PyObject* seed_fn, PyObject* x, PyObject* dropout_p, Call& call) {
  PyObject* seed = PyObject_CallFunctionObjArgs(seed_fn, x, dropout_p, nullptr);
  if (seed == nullptr) throw python_error();
  if (THPVariable_Check(seed)) {
    call.device_seed = THPVariable_Unpack(seed);
  } else if (PyLong_CheckExact(seed)) {
    call.seed = PyLong_AsLongLong(seed);  // (an overflow sets the error raised below)
  } else {
    Py_DECREF(seed);
    throw std::runtime_error("ffn.py's seed draw returned neither an int nor a tensor");
  }
  Py_DECREF(seed);
  if (PyErr_Occurred()) throw python_error();
}

// The op ffn.py's eager path calls: the C++ autograd node of csrc/autograd.cpp when a gradient
// is needed, else the forward alone.
at::Tensor run(const Call& call, bool grad) {
  const pybind11::gil_scoped_release no_gil;
  const c10::string_view activation(call.activation.data(), call.activation.size());
  if (grad) {
    return handle<FfnAutograd>().call(*call.x, *call.w1, call.b1, *call.w2, call.b2, activation,
                                      call.dropout_p, call.seed, call.fused, call.device_seed);
  }
  return std::get<0>(handle<FfnFwd>().call(call.x->contiguous(), *call.w1, call.b1, *call.w2,
                                           call.b2, activation, call.dropout_p, call.seed,
                                           call.fused, call.device_seed));
}

}  // namespace

PyObject* ffn_eager(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 8) {
    return eager::arity_error("ffn_eager(x, w1, b1, w2, b2, activation, dropout_p, seed_fn)");
  }
  Call call;
  call.dropout_p = eager::plain_dropout_p(args[6]);
  if (call.dropout_p < 0 || !plain_operands(call, args) ||
      !eager::plain_context("FASTFORMER_BACKEND_FFN")) {
    Py_RETURN_NONE;
  }
  const bool grad = needs_grad(call);
  const int fused = fused_epilogue(call, grad);
  if (fused < 0) Py_RETURN_NONE;
  call.fused = fused == 1;
  if (call.dropout_p > 0) draw_seed(args[7], args[0], args[6], call);
  return THPVariable_Wrap(run(call, grad));
  END_HANDLE_TH_ERRORS
}

}  // namespace fastformer
