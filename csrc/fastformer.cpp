// The fastformer._C module: the torch.ops.fastformer library, and a Python module holding
// cuda_philox_advance (the dropout seed draw's atomic step, below) and the plain eager calls of
// the LayerNorm and FFN ops, and attention's on the CPU, in one C call
// (layer_norm/layer_norm_eager.cpp, ffn/ffn_eager.cpp, attention/attention_eager.cpp).
//
// Ops are reached through torch.ops.fastformer.*; importing fastformer._C loads this library so
// its static registrations run. Each op folder adds its schemas with
// TORCH_LIBRARY_FRAGMENT and its kernels with TORCH_LIBRARY_IMPL.
#include <Python.h>
#include <torch/library.h>

#include <exception>
#include <mutex>

#include "attention/attention_eager.h"
#include "ffn/ffn_eager.h"
#include "ffn/ffn_lt.h"
#include "layer_norm/layer_norm_eager.h"

#ifdef FASTFORMER_WITH_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <torch/csrc/autograd/python_variable.h>
#endif

namespace {

// f() (a new reference), with a C++ exception raised as a RuntimeError; in a build without CUDA
// that RuntimeError and nothing run.
template <typename F>
PyObject* on_cuda(F&& f) {
#ifdef FASTFORMER_WITH_CUDA
  try {
    return f();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
#else
  PyErr_SetString(PyExc_RuntimeError, "fastformer._C was built without CUDA");
  return nullptr;
#endif
}

// cuda_philox_advance(device_index, increment) -> (seed, offset): the seed and Philox offset of
// torch's default CUDA generator of that device, the offset advanced by `increment` in the same
// step, under the generator's mutex as torch's own ops take it. (In Python, get_offset and
// set_offset are two steps: another thread's draw falling between them was lost, and both then
// used the same offsets.) A plain CPython function, not an op: no dispatcher on the seed path.
PyObject* cuda_philox_advance(PyObject* /*self*/, PyObject* args) {
  long long index = 0, increment = 0;
  if (!PyArg_ParseTuple(args, "LL", &index, &increment)) return nullptr;
  if (index < 0 || index > 127 || increment < 0) {  // (a DeviceIndex is an int8_t; -1 the current)
    PyErr_SetString(PyExc_ValueError,
                    "cuda_philox_advance: device_index must be in [0, 127] and increment >= 0");
    return nullptr;
  }
  return on_cuda([&]() -> PyObject* {
#ifdef FASTFORMER_WITH_CUDA
    at::Generator gen =
        at::cuda::detail::getDefaultCUDAGenerator(static_cast<c10::DeviceIndex>(index));
    uint64_t seed = 0, offset = 0;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      auto* impl = gen.get<at::CUDAGeneratorImpl>();
      seed = impl->current_seed();
      offset = impl->get_offset();
      impl->set_offset(offset + static_cast<uint64_t>(increment));
    }
    return Py_BuildValue("(KK)", static_cast<unsigned long long>(seed),
                         static_cast<unsigned long long>(offset));
#else
    return nullptr;
#endif
  });
}

// ffn_drelu_mode() -> str: FASTFORMER_FFN_DRELU as the CUDA relu backward reads it (ValueError
// for a value it refuses), so Python can check it without a GPU.
PyObject* ffn_drelu_mode(PyObject* /*self*/, PyObject* /*args*/) {
  try {
    return PyUnicode_FromString(fastformer::ffn_drelu_mode_name().c_str());
  } catch (const c10::ValueError& e) {
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    return nullptr;
  }
}

// ffn_relu_mask_layout_sample() -> (theirs, ours, d_ff) | None: ffn_lt.h's sample, for a test.
PyObject* ffn_relu_mask_layout_sample(PyObject* /*self*/, PyObject* /*args*/) {
  return on_cuda([]() -> PyObject* {
#ifdef FASTFORMER_WITH_CUDA
    const auto sample = fastformer::ffn_relu_mask_layout_sample();
    if (!sample) Py_RETURN_NONE;
    return Py_BuildValue("(NNL)", THPVariable_Wrap(sample->theirs),
                         THPVariable_Wrap(sample->ours), static_cast<long long>(sample->d_ff));
#else
    return nullptr;
#endif
  });
}

// ffn_relu_mask_layout_ok() -> bool: whether the DRELU path may run on the current device.
PyObject* ffn_relu_mask_layout_ok(PyObject* /*self*/, PyObject* /*args*/) {
  return on_cuda([]() -> PyObject* {
#ifdef FASTFORMER_WITH_CUDA
    return PyBool_FromLong(fastformer::ffn_relu_mask_layout_ok() ? 1 : 0);
#else
    return nullptr;
#endif
  });
}

PyMethodDef methods[] = {
    {"cuda_philox_advance", cuda_philox_advance, METH_VARARGS,
     "cuda_philox_advance(device_index, increment) -> (seed, offset) of torch's CUDA generator, "
     "the offset advanced by increment atomically"},
    {"ffn_drelu_mode", ffn_drelu_mode, METH_NOARGS,
     "ffn_drelu_mode() -> str: FASTFORMER_FFN_DRELU as the CUDA relu backward reads it ('kernel' "
     "or 'epilogue'); ValueError for any other value"},
    {"ffn_relu_mask_layout_sample", ffn_relu_mask_layout_sample, METH_NOARGS,
     "ffn_relu_mask_layout_sample() -> (theirs, ours, d_ff) | None: cuBLASLt's RELU_AUX bitmask "
     "of a small GEMM and the relu bitmask kernel's of its output (int32 words, CPU), for a test"},
    {"ffn_relu_mask_layout_ok", ffn_relu_mask_layout_ok, METH_NOARGS,
     "ffn_relu_mask_layout_ok() -> bool: whether FASTFORMER_FFN_DRELU=epilogue may run on the "
     "current CUDA device (its bitmask layout check, run once per device outside capture)"},
    {"layer_norm_eager", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(
                             &fastformer::layer_norm_eager)),
     METH_FASTCALL,
     "layer_norm_eager(input, normalized_shape, weight, bias, eps, rms) -> Tensor | None: the "
     "plain eager call of fastformer.ops.layer_norm / rms_norm, None when it is not one"},
    {"dropout_add_layer_norm_eager",
     reinterpret_cast<PyCFunction>(
         reinterpret_cast<void (*)(void)>(&fastformer::dropout_add_layer_norm_eager)),
     METH_FASTCALL,
     "dropout_add_layer_norm_eager(x, residual, weight, bias, eps, dropout_p, prenorm, seed_fn) "
     "-> Tensor | (Tensor, Tensor) | None: the plain eager call of "
     "fastformer.ops.dropout_add_layer_norm, None when it is not one"},
    {"attention_cpu_eager",
     reinterpret_cast<PyCFunction>(
         reinterpret_cast<void (*)(void)>(&fastformer::attention_cpu_eager)),
     METH_FASTCALL,
     "attention_cpu_eager(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, "
     "key_padding_mask) -> Tensor | None: the plain eager CPU call of "
     "fastformer.ops.attention.scaled_dot_product_attention (its backward a C++ autograd node), "
     "None when it is not one"},
    {"ffn_eager",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(&fastformer::ffn_eager)),
     METH_FASTCALL,
     "ffn_eager(x, w1, b1, w2, b2, activation, dropout_p, seed_fn) -> Tensor | None: the plain "
     "eager call of fastformer.ops.ffn, None when it is not one"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", "fastformer C++/CUDA kernels (see torch.ops.fastformer)", -1,
      methods};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(fastformer, m) {
  m.def("philox_uniform(int seed, Tensor offsets) -> Tensor");
  m.def("element_uniform(int seed, Tensor offsets) -> Tensor");
  m.def("attention_keep_mask(int seed, Tensor row_offsets, int seq_k, int threshold) -> Tensor");
  m.def(
      "attention_softmax_(Tensor(a!) scores, Tensor(b!) lse, int seed, int threshold, "
      "float scale) -> ()");
  m.def(
      "attention_softmax_backward_(Tensor(a!) scores, Tensor(b!) grad, Tensor? grad_lse, "
      "int seed, int threshold, float scale) -> ()");
}
