// fastformer._C.layer_norm_eager and dropout_add_layer_norm_eager (layer_norm_eager.cpp), for
// the module's method table.
#pragma once

#include <Python.h>

namespace fastformer {

PyObject* layer_norm_eager(PyObject* self, PyObject* const* args, Py_ssize_t nargs);
PyObject* dropout_add_layer_norm_eager(PyObject* self, PyObject* const* args, Py_ssize_t nargs);

}  // namespace fastformer
