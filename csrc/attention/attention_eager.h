// fastformer._C.attention_cpu_eager (attention_eager.cpp), for the module's method table.
#pragma once

#include <Python.h>

namespace fastformer {

PyObject* attention_cpu_eager(PyObject* self, PyObject* const* args, Py_ssize_t nargs);

}  // namespace fastformer
