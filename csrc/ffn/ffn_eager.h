// fastformer._C.ffn_eager (ffn_eager.cpp), for the module's method table.
#pragma once

#include <Python.h>

namespace fastformer {

PyObject* ffn_eager(PyObject* self, PyObject* const* args, Py_ssize_t nargs);

}  // namespace fastformer
