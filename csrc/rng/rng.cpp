// torch.ops.fastformer.philox_uniform / element_uniform: CPU and CUDA kernels of the shared
// dropout RNG (csrc/common/philox.h), so Python can regenerate any kernel's mask quickly;
// attention_keep_mask (CPU): attention's dropout keep-mask, for its torch backend and tests
// (rng/keep_mask.h; the torch backend applies it in its fused softmax).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <vector>

#include "common/checks.h"
#include "common/philox.h"
#include "common/philox_cpu.h"
#include "rng/keep_mask.h"

#ifdef FASTFORMER_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "rng/rng.h"
#endif

namespace fastformer {

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && __GNUC__ >= 11
#define FF_PHILOX_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define FF_FORCE_INLINE inline __attribute__((always_inline))
#else
#define FF_PHILOX_CLONES
#define FF_FORCE_INLINE inline
#endif

// Loops over independent Philox calls, which the compiler vectorizes across calls
// (common/philox_cpu.h).
FF_PHILOX_CLONES void philox_words_cpu(uint64_t seed, uint64_t first, int64_t calls,
                                       uint32_t* words) {
  for (int64_t i = 0; i < calls; ++i) {
    uint32_t w[4];
    philox4x32(seed, first + i, w);
    for (int k = 0; k < 4; ++k) words[4 * i + k] = w[k];
  }
}

namespace {

// keep[4 * i + k] = dropout_keep(seed, 4 * (first_call + i) + k, p), for i < calls.
FF_PHILOX_CLONES void element_keep_cpu(uint64_t seed, uint64_t first_call, int64_t calls,
                                       float p, uint8_t* keep) {
  for (int64_t i = 0; i < calls; ++i) {
    uint32_t w[4];
    philox4x32(seed, first_call + i, w);
    for (int k = 0; k < 4; ++k) keep[4 * i + k] = uint_to_uniform(w[k]) >= p;
  }
}

// v[k] *= keep ? scale : 0 for the n elements first .. first + n - 1 (any n and alignment; a
// product, as torch's dropout: a dropped NaN or inf stays NaN, not a silent 0): aligned groups
// of four in blocks of element_keep_cpu, the edges one by one.
// Inlined into each clone of dropout_scale_cpu, so its loop is built for that clone's ISA.
template <typename A>
FF_FORCE_INLINE void dropout_scale_impl(A* v, int64_t n, uint64_t seed, uint64_t first, float p,
                                        A scale) {
  constexpr int64_t kCalls = 64;
  uint8_t keep[4 * kCalls];
  int64_t k = 0;
  for (; k < n && ((first + k) & 3) != 0; ++k) {
    v[k] *= dropout_keep(seed, first + k, p) ? scale : A(0);
  }
  while (k + 4 <= n) {
    const int64_t calls = std::min(kCalls, (n - k) / 4);
    element_keep_cpu(seed, (first + k) >> 2, calls, p, keep);
    for (int64_t e = 0; e < 4 * calls; ++e) v[k + e] *= keep[e] ? scale : A(0);
    k += 4 * calls;
  }
  for (; k < n; ++k) v[k] *= dropout_keep(seed, first + k, p) ? scale : A(0);
}

}  // namespace

FF_PHILOX_CLONES void dropout_scale_cpu(float* v, int64_t n, uint64_t seed, uint64_t first,
                                        float p, float scale) {
  dropout_scale_impl(v, n, seed, first, p, scale);
}

void dropout_scale_cpu(double* v, int64_t n, uint64_t seed, uint64_t first, float p,
                       double scale) {
  dropout_scale_impl(v, n, seed, first, p, scale);
}

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
  check_threshold(threshold, "attention_keep_mask");
  const at::Tensor rows = row_offsets.contiguous();
  std::vector<int64_t> sizes(rows.sizes().begin(), rows.sizes().end());
  sizes.push_back(seq_k);
  at::Tensor out = at::empty(sizes, rows.options().dtype(at::kBool));
  const int64_t* base = rows.data_ptr<int64_t>();
  bool* dst = out.data_ptr<bool>();
  const auto t = static_cast<uint32_t>(threshold);
  for_each_keep_row<bool, 0>(
      static_cast<uint64_t>(seed), rows.numel(), seq_k,
      [&](int64_t r) { return static_cast<uint64_t>(base[r]); },
      [&](int64_t r, const uint16_t* halves, bool*) {
        bool* row = dst + r * seq_k;
        for (int64_t j = 0; j < seq_k; ++j) row[j] = halves[j] >= t;
      });
  return out;
}

// dst[i] = element_uniform (element) or philox_uniform of offsets[i], i < n: one independent
// call an element, vectorized across elements like the loops above.
template <bool kElement>
FF_FORCE_INLINE void uniform_loop(uint64_t seed, const int64_t* offsets, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) {
    const auto offset = static_cast<uint64_t>(offsets[i]);
    dst[i] = kElement ? element_uniform(seed, offset) : philox_uniform(seed, offset);
  }
}

FF_PHILOX_CLONES void uniform_run(uint64_t seed, const int64_t* offsets, int64_t n, bool element,
                                  float* dst) {
  if (element) {
    uniform_loop<true>(seed, offsets, n, dst);
  } else {
    uniform_loop<false>(seed, offsets, n, dst);
  }
}

constexpr const char* uniform_name(bool element) {
  return element ? "element_uniform" : "philox_uniform";
}

template <bool kElement>
at::Tensor uniform_cpu(int64_t seed, const at::Tensor& offsets) {
  check_offsets(offsets, uniform_name(kElement));
  const at::Tensor off = offsets.contiguous();
  at::Tensor out = at::empty(off.sizes(), off.options().dtype(at::kFloat));
  const int64_t* src = off.data_ptr<int64_t>();
  float* dst = out.data_ptr<float>();
  const auto key = static_cast<uint64_t>(seed);
  at::parallel_for(0, off.numel(), 4096, [&](int64_t begin, int64_t end) {
    uniform_run(key, src + begin, end - begin, kElement, dst + begin);
  });
  return out;
}

#ifdef FASTFORMER_WITH_CUDA
template <bool kElement>
at::Tensor uniform_cuda(int64_t seed, const at::Tensor& offsets) {
  check_offsets(offsets, uniform_name(kElement));
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
