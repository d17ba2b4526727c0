// torch.ops.fastformer.philox_uniform / element_uniform: CPU and CUDA kernels of the shared
// dropout RNG (csrc/common/philox.h), so Python can regenerate any kernel's mask quickly;
// attention_keep_mask (CPU): attention's dropout keep-mask, for its torch backend and tests.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

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

// Attention's dropout keep-mask (fastformer.ops.attention.dropout_keep_mask), shape
// row_offsets.shape + (seq_k,): in row r, key column j = 32 g + 8 w + 2 c + l is kept when
// 16-bit half l of word w of the Philox call at counter row_offsets[r] + 4 g + c is >= threshold.
at::Tensor attention_keep_mask_cpu(int64_t seed, const at::Tensor& row_offsets, int64_t seq_k,
                                   int64_t threshold) {
  check_offsets(row_offsets, "attention_keep_mask");
  TORCH_CHECK(seq_k >= 0, "attention_keep_mask: seq_k must be >= 0, got ", seq_k);
  TORCH_CHECK(threshold >= 0 && threshold <= 65536,
              "attention_keep_mask: threshold must be in [0, 65536], got ", threshold);
  const at::Tensor rows = row_offsets.contiguous();
  std::vector<int64_t> sizes(rows.sizes().begin(), rows.sizes().end());
  sizes.push_back(seq_k);
  at::Tensor out = at::empty(sizes, rows.options().dtype(at::kBool));
  const int64_t* base = rows.data_ptr<int64_t>();
  bool* dst = out.data_ptr<bool>();
  const auto key = static_cast<uint64_t>(seed);
  const auto t = static_cast<uint32_t>(threshold);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(seq_k, 1));
  at::parallel_for(0, rows.numel(), grain, [&](int64_t begin, int64_t end) {
    uint32_t words[4];
    for (int64_t r = begin; r < end; ++r) {
      bool* row = dst + r * seq_k;
      for (int64_t g = 0; 32 * g < seq_k; ++g) {
        for (int c = 0; c < 4; ++c) {
          philox4x32(key, static_cast<uint64_t>(base[r] + 4 * g + c), words);
          for (int w = 0; w < 4; ++w) {
            for (int l = 0; l < 2; ++l) {
              const int64_t j = 32 * g + 8 * w + 2 * c + l;
              if (j < seq_k) row[j] = ((words[w] >> (16 * l)) & 0xFFFFu) >= t;
            }
          }
        }
      }
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
  m.impl("attention_keep_mask", &attention_keep_mask_cpu);
}

#ifdef FASTFORMER_WITH_CUDA
TORCH_LIBRARY_IMPL(fastformer, CUDA, m) {
  m.impl("philox_uniform", &uniform_cuda<false>);
  m.impl("element_uniform", &uniform_cuda<true>);
}
#endif

}  // namespace fastformer
