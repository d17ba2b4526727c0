// The fastformer._C module: the torch.ops.fastformer library and an empty Python module.
//
// Ops are reached through torch.ops.fastformer.*; importing fastformer._C only loads this
// library so its static registrations run. Each op folder adds its schemas with
// TORCH_LIBRARY_FRAGMENT and its kernels with TORCH_LIBRARY_IMPL.
#include <Python.h>
#include <torch/library.h>

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", "fastformer C++/CUDA kernels (see torch.ops.fastformer)", -1,
      nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(fastformer, m) {
  m.def("philox_uniform(int seed, Tensor offsets) -> Tensor");
  m.def("element_uniform(int seed, Tensor offsets) -> Tensor");
  m.def("attention_keep_mask(int seed, Tensor row_offsets, int seq_k, int threshold) -> Tensor");
}
