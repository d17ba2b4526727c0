// Input checks shared by the C++ ops. Python validates first with friendlier messages; these
// guard direct torch.ops.fastformer calls so a bad call is an error, never a crash.
#pragma once

#include <ATen/ATen.h>

#define FF_CHECK_DEVICE(t, dev)                                                           \
  TORCH_CHECK((t).device() == (dev), #t " must be on ", (dev), ", got ", (t).device())
#define FF_CHECK_CONTIGUOUS(t) TORCH_CHECK((t).is_contiguous(), #t " must be contiguous")
#define FF_CHECK_DTYPE(t, dt) \
  TORCH_CHECK((t).scalar_type() == (dt), #t " must have dtype ", (dt), ", got ", (t).scalar_type())

// The data of a seed drawn on x's CUDA device (inside CUDA graph capture), after checking it is
// one int64 there; `op` names the op in the message.
inline const int64_t* device_seed_data(const at::Tensor& seed, const at::Tensor& x,
                                       const char* op) {
  TORCH_CHECK(x.is_cuda() && seed.device() == x.device() && seed.scalar_type() == at::kLong &&
                  seed.numel() == 1,
              op, ": device_seed must be a 1-element int64 tensor on x's CUDA device, got ",
              seed.scalar_type(), " on ", seed.device(), " with ", seed.numel(),
              " elements for x on ", x.device());
  return seed.data_ptr<int64_t>();
}
