// Input checks shared by the C++ ops. Python validates first with friendlier messages; these
// guard direct torch.ops.fastformer calls so a bad call is an error, never a crash.
#pragma once

#include <ATen/ATen.h>

#define FF_CHECK_DEVICE(t, dev)                                                           \
  TORCH_CHECK((t).device() == (dev), #t " must be on ", (dev), ", got ", (t).device())
#define FF_CHECK_CONTIGUOUS(t) TORCH_CHECK((t).is_contiguous(), #t " must be contiguous")
#define FF_CHECK_DTYPE(t, dt) \
  TORCH_CHECK((t).scalar_type() == (dt), #t " must have dtype ", (dt), ", got ", (t).scalar_type())
