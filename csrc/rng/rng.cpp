// torch.ops.fastformer.philox_uniform / element_uniform: CPU and CUDA kernels of the shared
// dropout RNG (csrc/common/philox.h), so Python can regenerate any kernel's mask quickly;
// philox4x32 (CPU): the raw words, for attention's keep-mask.
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

void check_offsets(const at::Tensor& offsets, const char* op = "philox_uniform") {
  TORCH_CHECK(offsets.scalar_type() == at::kLong, op, ": offsets must be int64, got ",
              offsets.scalar_type());
}

// The four words of each Philox call as int64 (uint32 values), shape offsets.shape + (4,):
// fastformer.ops.rng.philox4x32 stacked, for attention's dropout_keep_mask on CPU.
at::Tensor philox4x32_cpu(int64_t seed, const at::Tensor& offsets) {
  check_offsets(offsets, "philox4x32");
  const at::Tensor off = offsets.contiguous();
  std::vector<int64_t> sizes(off.sizes().begin(), off.sizes().end());
  sizes.push_back(4);
  at::Tensor out = at::empty(sizes, off.options());
  const int64_t* src = off.data_ptr<int64_t>();
  int64_t* dst = out.data_ptr<int64_t>();
  const auto key = static_cast<uint64_t>(seed);
  at::parallel_for(0, off.numel(), 2048, [&](int64_t begin, int64_t end) {
    uint32_t words[4];
    for (int64_t i = begin; i < end; ++i) {
      philox4x32(key, static_cast<uint64_t>(src[i]), words);
      for (int k = 0; k < 4; ++k) dst[4 * i + k] = words[k];
    }
  });
  return out;
}

template <bool kElement>
at::Tensor uniform_cpu(int64_t seed, const at::Tensor& offsets) {
  check_offsets(offsets);
  const at::Tensor off = offsets.contiguous();
  at::Tensor out = at::empty(off.sizes(), off.options().dtype(at::kFloat));
  const int64_t* src = off.data_ptr<int64_t>();
  float* dst = out.data_ptr<float>();
  const auto key = static_cast<uint64_t>(seed);
  at::parallel_for(0, off.numel(), 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto offset = static_cast<uint64_t>(src[i]);
      dst[i] = kElement ? element_uniform(key, offset) : philox_uniform(key, offset);
    }
  });
  return out;
}

#ifdef FASTFORMER_WITH_CUDA
template <bool kElement>
at::Tensor uniform_cuda(int64_t seed, const at::Tensor& offsets) {
  check_offsets(offsets);
  const c10::cuda::CUDAGuard guard(offsets.device());
  const at::Tensor off = offsets.contiguous();
  at::Tensor out = at::empty(off.sizes(), off.options().dtype(at::kFloat));
  philox_uniform_cuda_launch(static_cast<uint64_t>(seed), off.data_ptr<int64_t>(),
                             out.data_ptr<float>(), off.numel(), kElement,
                             at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}
#endif

}  // namespace

TORCH_LIBRARY_IMPL(fastformer, CPU, m) {
  m.impl("philox_uniform", &uniform_cpu<false>);
  m.impl("element_uniform", &uniform_cpu<true>);
  m.impl("philox4x32", &philox4x32_cpu);
}

#ifdef FASTFORMER_WITH_CUDA
TORCH_LIBRARY_IMPL(fastformer, CUDA, m) {
  m.impl("philox_uniform", &uniform_cuda<false>);
  m.impl("element_uniform", &uniform_cuda<true>);
}
#endif

}  // namespace fastformer
