// torch.ops.fastformer.philox_uniform: CPU and CUDA kernels of the shared dropout RNG.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/checks.h"
#include "common/philox.h"

#ifdef FASTFORMER_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "rng/rng.h"
#endif

namespace fastformer {
namespace {

void check_offsets(const at::Tensor& offsets) {
  TORCH_CHECK(offsets.scalar_type() == at::kLong,
              "philox_uniform: offsets must be int64, got ", offsets.scalar_type());
}

at::Tensor philox_uniform_cpu(int64_t seed, const at::Tensor& offsets) {
  check_offsets(offsets);
  const at::Tensor off = offsets.contiguous();
  at::Tensor out = at::empty(off.sizes(), off.options().dtype(at::kFloat));
  const int64_t* src = off.data_ptr<int64_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, off.numel(), 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      dst[i] = philox_uniform(static_cast<uint64_t>(seed), static_cast<uint64_t>(src[i]));
    }
  });
  return out;
}

#ifdef FASTFORMER_WITH_CUDA
at::Tensor philox_uniform_cuda(int64_t seed, const at::Tensor& offsets) {
  check_offsets(offsets);
  const c10::cuda::CUDAGuard guard(offsets.device());
  const at::Tensor off = offsets.contiguous();
  at::Tensor out = at::empty(off.sizes(), off.options().dtype(at::kFloat));
  philox_uniform_cuda_launch(static_cast<uint64_t>(seed), off.data_ptr<int64_t>(),
                             out.data_ptr<float>(), off.numel(),
                             at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}
#endif

}  // namespace

TORCH_LIBRARY_IMPL(fastformer, CPU, m) { m.impl("philox_uniform", &philox_uniform_cpu); }

#ifdef FASTFORMER_WITH_CUDA
TORCH_LIBRARY_IMPL(fastformer, CUDA, m) { m.impl("philox_uniform", &philox_uniform_cuda); }
#endif

}  // namespace fastformer
