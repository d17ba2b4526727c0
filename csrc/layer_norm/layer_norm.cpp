// torch.ops.fastformer.layer_norm_fwd / layer_norm_bwd: LayerNorm, RMSNorm and the fused
// dropout + residual-add + LayerNorm, CPU kernels here and CUDA glue for layer_norm_cuda.cu.
//
// Both ops take x as (..., cols) and work on it as a contiguous (rows, cols) matrix, every
// leading dim a row (fastformer/ops/layer_norm.py flattens a normalized shape of several dims
// into cols; ln_glue::rows_of / cols_of), and keep their statistics in the
// accumulation dtype: fp32, or fp64 for fp64 inputs (CPU only; it lets gradcheck test these
// kernels). Dropout keeps element i = row * cols + col when element_uniform(seed, i) >= p and
// scales it by 1 / (1 - p); the backward regenerates that mask from the seed. The seed is a
// 0-dim int64 CPU tensor so that a traced backward can carry it without reading it.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

#include "common/checks.h"
#include "common/philox.h"
#include "common/philox_cpu.h"
#include "common/prefault.h"
#include "common/stream_store.h"
#include "layer_norm/layer_norm_glue.h"

#ifdef FASTFORMER_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "layer_norm/layer_norm.h"
#endif

namespace fastformer {
namespace {

using Tensors4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

using ln_glue::cols_of;
using ln_glue::dropout_scale;
using ln_glue::param_dtype;
using ln_glue::rows_of;

// ------------------------------------------------------------------ checks

uint64_t seed_value(const at::Tensor& seed) {
  TORCH_CHECK(seed.device().is_cpu() && seed.scalar_type() == at::kLong && seed.numel() == 1,
              "layer_norm: seed must be a 1-element int64 CPU tensor, got ", seed.scalar_type(),
              " on ", seed.device(), " with ", seed.numel(), " elements");
  const int64_t value = seed.item<int64_t>();
  TORCH_CHECK(value >= 0, "layer_norm: seed must be >= 0, got ", value);
  return static_cast<uint64_t>(value);
}

// The CUDA kernels' seed: a CPU seed's value, or a pointer to a seed drawn on x's device (inside
// CUDA graph capture: the kernels read it there, so that each replay uses that replay's draw).
template <typename Args>
void set_cuda_seed(Args& a, const at::Tensor& seed, const at::Tensor& x) {
  if (seed.device().is_cpu()) {
    a.seed = seed_value(seed);
    return;
  }
  a.seed = 0;
  a.seed_ptr = device_seed_data(seed, x, "layer_norm");
}

// A per-column parameter (weight or bias): (cols,), the input dtype or fp32, on x's device.
void check_param(const c10::optional<at::Tensor>& p, const char* name, const at::Tensor& x) {
  if (!p.has_value()) return;
  TORCH_CHECK(p->dim() == 1 && p->size(0) == cols_of(x), "layer_norm: ", name,
              " must have shape (", cols_of(x), ",), got ", p->sizes());
  TORCH_CHECK(p->scalar_type() == x.scalar_type() || p->scalar_type() == at::kFloat,
              "layer_norm: ", name, " must be ",
              x.scalar_type() == at::kFloat ? "float32" : "x's dtype or float32", " (x is ",
              x.scalar_type(), "), got ", p->scalar_type());
  FF_CHECK_DEVICE(*p, x.device());
}

void check_x(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() >= 1, "layer_norm: ", name, " must be (..., cols), got a 0-d tensor");
  TORCH_CHECK(x.size(-1) > 0, "layer_norm: ", name, " must have cols > 0, got shape ", x.sizes());
  const auto t = x.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16 ||
                  (t == at::kDouble && x.device().is_cpu()),
              "layer_norm: ", name, " must be float32, float16 or bfloat16 (float64 on CPU), got ",
              t, " on ", x.device());
}

void check_fwd(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
               const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
               double eps, double dropout_p, bool rms, bool store_pre) {
  check_x(x, "x");
  check_param(weight, "weight", x);
  check_param(bias, "bias", x);
  param_dtype(weight, bias, x);
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "layer_norm: residual must match x ", x.sizes(), " ", x.scalar_type(), ", got ",
                residual->sizes(), " ", residual->scalar_type());
    FF_CHECK_DEVICE(*residual, x.device());
  }
  TORCH_CHECK(std::isfinite(eps) && eps > 0, "layer_norm: eps must be finite and > 0, got ", eps);
  TORCH_CHECK(dropout_p >= 0 && dropout_p < 1, "layer_norm: dropout_p must be in [0, 1), got ",
              dropout_p);
  TORCH_CHECK(!rms || (!bias.has_value() && !residual.has_value() && dropout_p == 0 && !store_pre),
              "layer_norm: rms=True takes no bias, residual, dropout or store_pre");
}

at::ScalarType stats_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// ------------------------------------------------------------------ CPU: row kernels
//
// Loops over one row of the accumulation dtype A (float or double), four independent
// accumulators (one would serialise on the add latency), every sum in a fixed order
// (deterministic). Extensions are compiled for the baseline x86-64 ISA and without ATen's
// CPU_CAPABILITY, where at::vec::Vectorized is its generic array implementation: measured here
// 2.3x slower than F.layer_norm. So with GCC/clang the vectors are the compiler's 32-byte
// vector types and each entry point is also cloned for x86-64-v3 (AVX2, FMA), picked at load
// time by the CPU: ymm code in that clone, two xmm halves in the baseline one. Other compilers
// use at::vec::Vectorized through the same four helpers.

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define FF_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define FF_CPU_CLONES
#endif

#if defined(__GNUC__) || defined(__clang__)
// The helpers must be inlined into each clone to be compiled for its ISA.
#define FF_INLINE inline __attribute__((always_inline))
#pragma GCC diagnostic ignored "-Wpsabi"  // 32-byte vectors only cross inlined calls

template <typename A>
struct VecOf;
template <>
struct VecOf<float> {
  typedef float type __attribute__((vector_size(32)));
};
template <>
struct VecOf<double> {
  typedef double type __attribute__((vector_size(32)));
};
template <typename A>
using Vec = typename VecOf<A>::type;
template <typename A>
constexpr int64_t kLanes = 32 / sizeof(A);

template <typename A>
FF_INLINE Vec<A> vload(const A* p) {
  Vec<A> v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
template <typename A>
FF_INLINE void vstore(A* p, const Vec<A>& v) {
  __builtin_memcpy(p, &v, sizeof(v));
}
template <typename A>
FF_INLINE Vec<A> vsplat(A a) {
  return Vec<A>{} + a;
}
// vstore with non-temporal stores (stream_store.h); p 16-byte aligned.
template <typename A>
FF_INLINE void vstream(A* p, const Vec<A>& v) {
  stream16(p, &v);
  stream16(reinterpret_cast<char*>(p) + 16, reinterpret_cast<const char*>(&v) + 16);
}
#else
#define FF_INLINE inline
template <typename A>
using Vec = at::vec::Vectorized<A>;
template <typename A>
constexpr int64_t kLanes = Vec<A>::size();
template <typename A>
FF_INLINE Vec<A> vload(const A* p) {
  return Vec<A>::loadu(p);
}
template <typename A>
FF_INLINE void vstore(A* p, const Vec<A>& v) {
  v.store(p);
}
template <typename A>
FF_INLINE Vec<A> vsplat(A a) {
  return Vec<A>(a);
}
template <typename A>
FF_INLINE void vstream(A* p, const Vec<A>& v) {
  vstore(p, v);
}
#endif

// vstore, or vstream when kStream.
template <bool kStream, typename A>
FF_INLINE void vput(A* p, const Vec<A>& v) {
  if constexpr (kStream) {
    vstream(p, v);
  } else {
    vstore(p, v);
  }
}

template <typename A>
FF_INLINE A lane_sum(const Vec<A>& v) {
  A lanes[kLanes<A>];
  vstore(lanes, v);
  A s = 0;
  for (int64_t i = 0; i < kLanes<A>; ++i) s += lanes[i];
  return s;
}

// N vectors a loop sums into independently (one would serialise on the add latency).
template <typename A, int N>
struct Accs {
  Vec<A> v[N];
  static FF_INLINE Accs zero() {
    Accs a;
    for (int i = 0; i < N; ++i) a.v[i] = vsplat<A>(0);
    return a;
  }
  FF_INLINE Accs operator+(const Accs& o) const {
    Accs r;
    for (int i = 0; i < N; ++i) r.v[i] = v[i] + o.v[i];
    return r;
  }
};

// Rows past kSumBlock elements are summed a block at a time, each block into fresh
// accumulators, and the blocks' sums added pairwise (a binary counter of partial sums): the
// rounding of a long row then grows with log2 of its blocks, not with its length. With one
// pass of accumulators a float32 RMSNorm of 262144 columns at 1000 + N(0, 1e-3) had 219x
// torch's error (2026-12-07). A row of one block keeps the bits of a single pass.
constexpr int64_t kSumBlock = 2048;

// The blocks' sums of a row, added pairwise as they come, in a fixed order. (The loops over
// a block stay in their callers' bodies, not in lambdas: a lambda is compiled for the baseline
// ISA, and did not inline the x86-64-v3 loads of the 16-bit rows.)
template <typename S>
struct Cascade {
  S level[48];  // level[i]: the sum of 2^i blocks, held while bit i of `blocks` is set
  int64_t blocks = 0;

  // Takes a block's sum; after the last block, acc is the row's (a row of one block: its own).
  FF_INLINE void add(S& acc, bool last) {
    if (last && blocks == 0) return;
    push(acc);
    if (last) acc = total();
  }
  FF_INLINE void push(S acc) {
    int i = 0;
    for (int64_t carry = blocks++; carry & 1; carry >>= 1, ++i) acc = level[i] + acc;
    level[i] = acc;
  }
  FF_INLINE S total() const {  // blocks > 0
    int i = 0;
    while (((blocks >> i) & 1) == 0) ++i;
    S sum = level[i];
    for (++i; (blocks >> i) != 0; ++i) {
      if ((blocks >> i) & 1) sum = level[i] + sum;
    }
    return sum;
  }
};

// Where the block that starts at j ends.
FF_INLINE int64_t block_end(int64_t n, int64_t j) { return std::min(n, j + kSumBlock); }

// sum(f(row[j])) over a row of n elements, in one fixed order (every sum of the CPU kernels
// takes it, so that equal rows give equal bits): load(j) gives the vector of elements j..j+k-1,
// load_one(j) element j of the tail; f maps vectors (the tail goes through f as a splat vector).
template <typename A, typename L, typename L1, typename F>
FF_INLINE A sum_loaded(int64_t n, const L& load, const L1& load_one, const F& f) {
  constexpr int64_t k = kLanes<A>;
  Cascade<Accs<A, 4>> blocks;
  int64_t j = 0;
  Accs<A, 4> acc;
  for (bool last = false; !last;) {
    acc = Accs<A, 4>::zero();
    for (const int64_t end = block_end(n, j); j + 4 * k <= end; j += 4 * k) {
      for (int u = 0; u < 4; ++u) acc.v[u] = acc.v[u] + f(load(j + u * k));
    }
    last = j + 4 * k > n;
    for (; last && j + k <= n; j += k) acc.v[0] = acc.v[0] + f(load(j));
    blocks.add(acc, last);
  }
  A s = lane_sum<A>((acc.v[0] + acc.v[1]) + (acc.v[2] + acc.v[3]));
  A tail[kLanes<A>];
  for (; j < n; ++j) {
    vstore(tail, f(vsplat<A>(load_one(j))));
    s += tail[0];
  }
  return s;
}

// sum(f(p[j])) over the row.
template <typename A, typename F>
FF_INLINE A sum_map(const A* p, int64_t n, const F& f) {
  return sum_loaded<A>(
      n, [p](int64_t j) { return vload(p + j); }, [p](int64_t j) { return p[j]; }, f);
}

template <typename A>
FF_INLINE A sum_impl(const A* p, int64_t n) {
  return sum_map(p, n, [](const Vec<A>& v) { return v; });
}

// sum(p[j] - shift): the mean's sum for rows far from 0 (row_stats).
template <typename A>
FF_INLINE A shifted_sum_impl(const A* p, int64_t n, A shift) {
  const Vec<A> s = vsplat(shift);
  return sum_map(p, n, [s](const Vec<A>& v) { return v - s; });
}

// One pass over a row for its mean and variance: the sums of d = x - shift and of d * d, where
// shift is the mean of the row's first 4 vectors (of the whole row when shorter). That shift
// lies within a few std of the mean for most rows, so var = mean(d * d) - mean(d)^2 keeps all
// but a bit (row_stats takes it only then). Half the reads of the sum-then-deviation passes:
// the op's fp32 forward at 4096 x 512-1024 went from 0.90-0.96x to 0.98-1.07x F.layer_norm's
// speed on an AVX-512 CI VM (1 and 2 threads).
template <typename A>
struct Moments {
  A shift, sum, sum_sq;  // of d = x - shift: sum(d), sum(d * d)
};

// Moments of a row read through load / load_one (as sum_loaded): the head's vectors are read
// twice, once for the shift.
template <typename A, typename L, typename L1>
FF_INLINE Moments<A> moments_loaded(int64_t n, const L& load, const L1& load_one) {
  constexpr int64_t k = kLanes<A>;
  const int64_t head = std::min<int64_t>(n, 4 * k);
  const A shift =
      sum_loaded<A>(head, load, load_one, [](const Vec<A>& v) { return v; }) / static_cast<A>(head);
  const Vec<A> s = vsplat(shift);
  Cascade<Accs<A, 8>> blocks;  // acc.v[0..3]: sums of d, acc.v[4..7]: of d * d
  int64_t j = 0;
  Accs<A, 8> acc;
  for (bool last = false; !last;) {
    acc = Accs<A, 8>::zero();
    for (const int64_t end = block_end(n, j); j + 4 * k <= end; j += 4 * k) {
      for (int u = 0; u < 4; ++u) {
        const Vec<A> v = load(j + u * k) - s;
        acc.v[u] = acc.v[u] + v;
        acc.v[4 + u] = acc.v[4 + u] + v * v;
      }
    }
    last = j + 4 * k > n;
    for (; last && j + k <= n; j += k) {
      const Vec<A> v = load(j) - s;
      acc.v[0] = acc.v[0] + v;
      acc.v[4] = acc.v[4] + v * v;
    }
    blocks.add(acc, last);
  }
  Moments<A> m{shift, lane_sum<A>((acc.v[0] + acc.v[1]) + (acc.v[2] + acc.v[3])),
               lane_sum<A>((acc.v[4] + acc.v[5]) + (acc.v[6] + acc.v[7]))};
  for (; j < n; ++j) {
    const A v = load_one(j) - shift;
    m.sum += v;
    m.sum_sq += v * v;
  }
  return m;
}

template <typename A>
FF_INLINE Moments<A> moments_impl(const A* p, int64_t n) {
  return moments_loaded<A>(
      n, [p](int64_t j) { return vload(p + j); }, [p](int64_t j) { return p[j]; });
}

template <typename A>
FF_INLINE A sq_dev_impl(const A* p, int64_t n, A mean) {
  const Vec<A> m = vsplat(mean);
  return sum_map(p, n, [m](const Vec<A>& v) { return (v - m) * (v - m); });
}

// Asks for the cache line of `next` (a row the kernel reads next) at element j, once a line: a
// pass that writes its output overlaps that row's read from memory with its arithmetic. Null:
// none.
template <typename T>
FF_INLINE void prefetch_next(const T* next, int64_t j) {
#if defined(__GNUC__) || defined(__clang__)
  constexpr int64_t line = 64 / sizeof(T);
  if (next != nullptr && j % line == 0) __builtin_prefetch(next + j, 0, 3);
#endif
}

// Whether the 16-bit kernels ask for the next row while they write one (the bfloat16 forward's
// fused-copy pass, and the in-place twins): for rows of 2048 and more, where 4096-row forwards
// and backwards took 5-30% less time with it; at 1024 up to 10% more (a 2-core AMD EPYC VM,
// benchmarks/NOTES.md). Not float32's: its forward took up to 20% more with a prefetch there.
template <typename T>
bool prefetches_next_row(int64_t n) {
  return sizeof(T) == 2 && n >= 2048;
}

// out = (x - mean) * rstd * w + b (w, b both given or both null); out streamed when kStream.
template <bool kStream, typename A>
FF_INLINE void normalize_impl(const A* x, A* out, int64_t n, A mean, A rstd, const A* w,
                              const A* b) {
  constexpr int64_t k = kLanes<A>;
  const Vec<A> m = vsplat(mean), r = vsplat(rstd);
  int64_t j = 0;
  if (w == nullptr) {
    for (; j + k <= n; j += k) vput<kStream>(out + j, (vload(x + j) - m) * r);
    for (; j < n; ++j) out[j] = (x[j] - mean) * rstd;
    return;
  }
  for (; j + k <= n; j += k) {
    vput<kStream>(out + j, (vload(x + j) - m) * r * vload(w + j) + vload(b + j));
  }
  for (; j < n; ++j) out[j] = (x[j] - mean) * rstd * w[j] + b[j];
}

// The row sums the backward needs before dx, with xhat = (x - mean) * rstd and g = dy * w.
template <typename A>
struct GradSums {
  A g, gx, xhat;  // sum(g), sum(g * xhat), sum(xhat)
};

// The first of the backward's two passes over a row: returns the GradSums and adds dy to pb
// (when PB). The dx pass recomputes xhat and g (the same operations, so the same values)
// instead of storing and reloading them: two passes over the row, not three.
// x and dy are rows of A, or of a 16-bit T read through load(p) (8 lanes of float from p; the
// tail takes them one by one).
template <typename A, bool PB, typename T, typename L>
FF_INLINE GradSums<A> bwd_sums_loop(const T* x, const T* dy, const A* w, A mean, A rstd, A* pb,
                                    int64_t n, const L& load) {
  constexpr int64_t k = kLanes<A>;
  const Vec<A> m = vsplat(mean), r = vsplat(rstd);
  Cascade<Accs<A, 6>> blocks;  // acc.v: sums of g, g * xhat and xhat, two vectors each
  int64_t j = 0;
  Accs<A, 6> acc;
  for (bool last = false; !last;) {
    acc = Accs<A, 6>::zero();
    for (const int64_t end = block_end(n, j); j + 2 * k <= end; j += 2 * k) {
      for (int u = 0; u < 2; ++u) {
        const Vec<A> d = load(dy + j + u * k), xh = (load(x + j + u * k) - m) * r;
        const Vec<A> g = d * vload(w + j + u * k);
        acc.v[u] = acc.v[u] + g;
        acc.v[2 + u] = acc.v[2 + u] + g * xh;
        acc.v[4 + u] = acc.v[4 + u] + xh;
        if constexpr (PB) vstore(pb + j + u * k, vload(pb + j + u * k) + d);
      }
    }
    last = j + 2 * k > n;
    blocks.add(acc, last);
  }
  GradSums<A> s{lane_sum<A>(acc.v[0] + acc.v[1]), lane_sum<A>(acc.v[2] + acc.v[3]),
                lane_sum<A>(acc.v[4] + acc.v[5])};
  for (; j < n; ++j) {
    const A xj = static_cast<A>(x[j]), dyj = static_cast<A>(dy[j]);
    const A xh = (xj - mean) * rstd, g = dyj * w[j];
    s.g += g;
    s.gx += g * xh;
    s.xhat += xh;
    if constexpr (PB) pb[j] += dyj;
  }
  return s;
}

template <typename A, typename T, typename L>
FF_INLINE GradSums<A> bwd_sums_impl(const T* x, const T* dy, const A* w, A mean, A rstd, A* pb,
                                    int64_t n, const L& load) {
  if (pb != nullptr) return bwd_sums_loop<A, true>(x, dy, w, mean, rstd, pb, n, load);
  return bwd_sums_loop<A, false>(x, dy, w, mean, rstd, pb, n, load);
}

template <typename A>
FF_INLINE GradSums<A> bwd_sums_impl(const A* x, const A* dy, const A* w, A mean, A rstd, A* pb,
                                    int64_t n) {
  return bwd_sums_impl(x, dy, w, mean, rstd, pb, n, [](const A* p) { return vload(p); });
}

// A row's constants for dx: dx = rstd * (g - c_g - xc * c_gx) with xc = xhat - shift the
// centred xhat, c_g = mean(g) (RMSNorm: 0) and c_gx = mean(g * xc).
template <typename A>
struct DxConsts {
  A c_g, c_gx, shift;
};

// The stored mean is the row's mean rounded to A: where the mean dwarfs the spread (1e4
// against 1 in float32) that shifts every xhat of the row by the same mean(xhat), which the
// mean's own derivative cancels. Taken out (shift), dx and dweight are those of exactly centred
// xhat (float32, offset 1e4, hidden 4: dx error 3.5e-3 -> 6.4e-6, 8x under the parity bound).
template <typename A>
DxConsts<A> dx_consts(const GradSums<A>& s, int64_t n, bool rms) {
  const A cols = static_cast<A>(n);
  if (rms) return {A(0), s.gx / cols, A(0)};
  const A shift = s.xhat / cols;
  return {s.g / cols, (s.gx - shift * s.g) / cols, shift};
}

// The second pass: dx (DxConsts), and dy * xc added to pw (when PW).
// Without FMA contraction: fused into fma(dy, w, -c_g), g - c_g would keep dy * w unrounded and
// miss exact cancellations (hidden size 1: dx 2.7e-5 times rstd where 0 is exact).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif
// x, dy and dx as in bwd_sums_loop, dx written through store(p, v) (8 lanes).
template <typename A, bool PW, typename T, typename L, typename S>
FF_INLINE void dx_loop(const T* x, const T* dy, const A* w, T* dx, int64_t n, A mean, A rstd,
                       const DxConsts<A>& c, A* pw, const L& load, const S& store,
                       const T* next_x, const T* next_dy) {
  constexpr int64_t k = kLanes<A>;
  const Vec<A> m = vsplat(mean), r = vsplat(rstd), cg = vsplat(c.c_g), cgx = vsplat(c.c_gx);
  const Vec<A> sh = vsplat(c.shift);
  int64_t j = 0;
  for (; j + k <= n; j += k) {
    prefetch_next(next_x, j);
    prefetch_next(next_dy, j);
    const Vec<A> d = load(dy + j), xc = (load(x + j) - m) * r - sh, g = d * vload(w + j);
    store(dx + j, r * (g - cg - xc * cgx));
    if constexpr (PW) vstore(pw + j, vload(pw + j) + d * xc);
  }
  for (; j < n; ++j) {
    const A dyj = static_cast<A>(dy[j]);
    const A xc = (static_cast<A>(x[j]) - mean) * rstd - c.shift, g = dyj * w[j];
    dx[j] = static_cast<T>(rstd * (g - c.c_g - xc * c.c_gx));
    if constexpr (PW) pw[j] += dyj * xc;
  }
}

template <typename A, typename T, typename L, typename S>
FF_INLINE void dx_impl(const T* x, const T* dy, const A* w, T* dx, int64_t n, A mean, A rstd,
                       const DxConsts<A>& c, A* pw, const L& load, const S& store,
                       const T* next_x = nullptr, const T* next_dy = nullptr) {
  if (pw != nullptr) {
    return dx_loop<A, true>(x, dy, w, dx, n, mean, rstd, c, pw, load, store, next_x, next_dy);
  }
  dx_loop<A, false>(x, dy, w, dx, n, mean, rstd, c, pw, load, store, next_x, next_dy);
}

template <bool kStream, typename A>
FF_INLINE void dx_impl(const A* x, const A* dy, const A* w, A* dx, int64_t n, A mean, A rstd,
                       const DxConsts<A>& c, A* pw) {
  dx_impl(
      x, dy, w, dx, n, mean, rstd, c, pw, [](const A* p) { return vload(p); },
      [](A* p, const Vec<A>& v) { vput<kStream>(p, v); });
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

// acc += a * b (b null: acc += a).
template <typename A>
FF_INLINE void accumulate_impl(A* acc, const A* a, const A* b, int64_t n) {
  constexpr int64_t k = kLanes<A>;
  int64_t j = 0;
  if (b == nullptr) {
    for (; j + k <= n; j += k) vstore(acc + j, vload(acc + j) + vload(a + j));
    for (; j < n; ++j) acc[j] += a[j];
    return;
  }
  for (; j + k <= n; j += k) vstore(acc + j, vload(acc + j) + vload(a + j) * vload(b + j));
  for (; j < n; ++j) acc[j] += a[j] * b[j];
}


template <typename S, typename D>
FF_INLINE void convert_impl(const S* src, D* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<D>(src[j]);
}

#if defined(__GNUC__) || defined(__clang__)
// bfloat16 <-> float on 8 lanes with integer vectors: the same bits as c10::BFloat16
// (round to nearest even, NaN -> 0x7FC0), which the compiler does not vectorize by itself.
typedef uint16_t U16x8 __attribute__((vector_size(16)));
typedef uint32_t U32x8 __attribute__((vector_size(32)));

FF_INLINE Vec<float> load_bf16x8(const c10::BFloat16* p) {
  U16x8 h;
  __builtin_memcpy(&h, p, sizeof(h));
  const U32x8 w = __builtin_convertvector(h, U32x8) << 16;
  Vec<float> f;
  __builtin_memcpy(&f, &w, sizeof(f));
  return f;
}

// (streamed when kStream; p then 16-byte aligned)
template <bool kStream = false>
FF_INLINE void store_bf16x8(c10::BFloat16* p, const Vec<float>& f) {
  U32x8 u;
  __builtin_memcpy(&u, &f, sizeof(u));
  const U32x8 rounded = (u + (((u >> 16) & 1) + 0x7FFF)) >> 16;
  const U32x8 bits = f != f ? (U32x8{} + 0x7FC0) : rounded;
  const U16x8 h = __builtin_convertvector(bits, U16x8);
  put16<kStream>(p, &h);
}

FF_INLINE void convert_impl(const c10::BFloat16* src, float* dst, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) vstore(dst + j, load_bf16x8(src + j));
  for (; j < n; ++j) dst[j] = static_cast<float>(src[j]);
}

template <bool kStream = false>
FF_INLINE void convert_impl(const float* src, c10::BFloat16* dst, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) store_bf16x8<kStream>(dst + j, vload(src + j));
  for (; j < n; ++j) dst[j] = static_cast<c10::BFloat16>(src[j]);
}

// The bfloat16 forward's first and last passes fused with the conversions (`perf`: the separate
// conversion passes took 30% of it). The same operations in the same order as convert_impl
// then moments_impl, and normalize_impl then convert_impl: the same bits, in 2 passes, not 4.
FF_INLINE Moments<float> convert_moments_impl(const c10::BFloat16* src, float* dst, int64_t n) {
  const auto load = [src, dst](int64_t j) {
    const Vec<float> v = load_bf16x8(src + j);
    vstore(dst + j, v);
    return v;
  };
  const auto load_one = [src, dst](int64_t j) { return dst[j] = static_cast<float>(src[j]); };
  return moments_loaded<float>(n, load, load_one);
}

template <bool kStream>
FF_INLINE void normalize_store_impl(const float* x, c10::BFloat16* out, int64_t n, float mean,
                                    float rstd, const float* w, const float* b,
                                    const c10::BFloat16* next) {
  constexpr int64_t k = 8;
  const Vec<float> m = vsplat(mean), r = vsplat(rstd);
  int64_t j = 0;
  if (w == nullptr) {
    for (; j + k <= n; j += k) {
      prefetch_next(next, j);
      store_bf16x8<kStream>(out + j, (vload(x + j) - m) * r);
    }
    for (; j < n; ++j) out[j] = static_cast<c10::BFloat16>((x[j] - mean) * rstd);
    return;
  }
  for (; j + k <= n; j += k) {
    prefetch_next(next, j);
    store_bf16x8<kStream>(out + j, (vload(x + j) - m) * r * vload(w + j) + vload(b + j));
  }
  for (; j < n; ++j) out[j] = static_cast<c10::BFloat16>((x[j] - mean) * rstd * w[j] + b[j]);
}

#endif

// The cloned entry points, for A = float and double.
#define FF_ROW_OPS(A)                                                                         \
  FF_CPU_CLONES A row_sum(const A* p, int64_t n) { return sum_impl(p, n); }                   \
  FF_CPU_CLONES A row_shifted_sum(const A* p, int64_t n, A shift) {                           \
    return shifted_sum_impl(p, n, shift);                                                     \
  }                                                                                           \
  FF_CPU_CLONES A row_sq_dev(const A* p, int64_t n, A mean) { return sq_dev_impl(p, n, mean); } \
  FF_CPU_CLONES Moments<A> row_moments(const A* p, int64_t n) { return moments_impl(p, n); }   \
  FF_CPU_CLONES void row_normalize(const A* x, A* out, int64_t n, A mean, A rstd, const A* w,  \
                                   const A* b, bool stream = false) {                         \
    if (stream) return normalize_impl<true>(x, out, n, mean, rstd, w, b);                     \
    normalize_impl<false>(x, out, n, mean, rstd, w, b);                                       \
  }                                                                                           \
  FF_CPU_CLONES GradSums<A> row_bwd_sums(const A* x, const A* dy, const A* w, A mean, A rstd, \
                                         A* pb, int64_t n) {                                  \
    return bwd_sums_impl(x, dy, w, mean, rstd, pb, n);                                        \
  }                                                                                           \
  FF_CPU_CLONES void row_accumulate(A* acc, const A* a, const A* b, int64_t n) {              \
    accumulate_impl(acc, a, b, n);                                                            \
  }
FF_ROW_OPS(float)
FF_ROW_OPS(double)
#undef FF_ROW_OPS

// Compiled without FMA contraction, as dx_loop says why (the option must hold where it is
// inlined).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif
#define FF_DX_OP(A)                                                                          \
  FF_CPU_CLONES void row_dx(const A* x, const A* dy, const A* w, A* dx, int64_t n, A mean,    \
                            A rstd, const DxConsts<A>& c, A* pw, bool stream) {               \
    if (stream) return dx_impl<true>(x, dy, w, dx, n, mean, rstd, c, pw);                     \
    dx_impl<false>(x, dy, w, dx, n, mean, rstd, c, pw);                                       \
  }
FF_DX_OP(float)
FF_DX_OP(double)
#undef FF_DX_OP
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

#define FF_CONVERT_OPS(T)                                                                     \
  FF_CPU_CLONES void row_convert(const T* src, float* dst, int64_t n) {                       \
    convert_impl(src, dst, n);                                                                \
  }                                                                                           \
  FF_CPU_CLONES void row_convert(const float* src, T* dst, int64_t n, bool stream = false) {  \
    if (stream) return convert_impl<true>(src, dst, n);                                       \
    convert_impl<false>(src, dst, n);                                                         \
  }
FF_CONVERT_OPS(c10::BFloat16)
#undef FF_CONVERT_OPS

// 16-bit twins of the float row kernels that read and write T's rows in place, 8 lanes converted
// at a time, with the same vector operations compiled for the same ISA as the float clones: the
// same bits as converting the row into a float copy and running those (tests/test_layer_norm.py
// checks it), without the conversion passes (float16: 70% of its forward's time, `perf`).
// kRowsInPlace<T>: T has them; rows_in_place(x, n): for a row of n, on this CPU. Only rows of a
// multiple of 16, which leave the kernels no scalar tail: GCC vectorizes part of the float
// kernels' tails (a product without FMA), not the twins'.
template <typename T>
constexpr bool kRowsInPlace = false;

#if defined(__GNUC__) || defined(__clang__)
#define FF_FUSED_BF16 1
FF_CPU_CLONES Moments<float> row_convert_moments(const c10::BFloat16* src, float* dst, int64_t n) {
  return convert_moments_impl(src, dst, n);
}
FF_CPU_CLONES void row_normalize(const float* x, c10::BFloat16* out, int64_t n, float mean,
                                 float rstd, const float* w, const float* b,
                                 const c10::BFloat16* next, bool stream) {
  if (stream) return normalize_store_impl<true>(x, out, n, mean, rstd, w, b, next);
  normalize_store_impl<false>(x, out, n, mean, rstd, w, b, next);
}

// The bfloat16 backward in place (kRowsInPlace), for rows of 1024 and more: there its two passes
// converting x and dy again beat the copies (fwd+bwd 4096 x 1024-4096: 7-13% less time on a
// 2-core AMD EPYC VM), but took 10-15% more at 256-512, where a row's copies stay in L1. Not its
// forward: read in place (converted in both passes) it took ~20% more at 512-1024 than the fused
// passes above.
template <>
constexpr bool kRowsInPlace<c10::BFloat16> = true;
bool rows_in_place(const c10::BFloat16*, int64_t n) { return n % 16 == 0 && n >= 1024; }

FF_CPU_CLONES GradSums<float> row_bwd_sums(const c10::BFloat16* x, const c10::BFloat16* dy,
                                           const float* w, float mean, float rstd, float* pb,
                                           int64_t n) {
  return bwd_sums_impl(x, dy, w, mean, rstd, pb, n, load_bf16x8);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")  // as row_dx's float clones (dx_loop)
#endif
FF_CPU_CLONES void row_dx(const c10::BFloat16* x, const c10::BFloat16* dy, const float* w,
                          c10::BFloat16* dx, int64_t n, float mean, float rstd,
                          const DxConsts<float>& c, float* pw, const c10::BFloat16* next_x,
                          const c10::BFloat16* next_dy, bool stream) {
  if (stream) {
    return dx_impl(x, dy, w, dx, n, mean, rstd, c, pw, load_bf16x8, store_bf16x8<true>, next_x,
                   next_dy);
  }
  dx_impl(x, dy, w, dx, n, mean, rstd, c, pw, load_bf16x8, store_bf16x8<false>, next_x, next_dy);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
#endif

// float16 <-> float: F16C's packed conversions (IEEE, round to nearest even, as c10::Half)
// where the CPU has them, picked at run time. c10::Half's scalar bit arithmetic made the fp16
// CPU kernels 4-8x slower than F.layer_norm; GCC 12 turns _Float16 vectors into one
// conversion per element.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx,f16c"))) void half_to_float_f16c(const c10::Half* src, float* dst,
                                                             int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j));
    _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(h));
  }
  for (; j < n; ++j) dst[j] = static_cast<float>(src[j]);
}

template <bool kStream>
__attribute__((target("avx,f16c"))) void float_to_half_f16c(const float* src, c10::Half* dst,
                                                             int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT);
    put16<kStream>(dst + j, &h);
  }
  for (; j < n; ++j) dst[j] = static_cast<c10::Half>(src[j]);
}

bool cpu_has_f16c() {
  static const bool has = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return has;
}

void row_convert(const c10::Half* src, float* dst, int64_t n) {
  if (cpu_has_f16c()) return half_to_float_f16c(src, dst, n);
  convert_impl(src, dst, n);
}

// (streamed when `stream` and the CPU has F16C)
void row_convert(const float* src, c10::Half* dst, int64_t n, bool stream = false) {
  if (cpu_has_f16c() && stream) return float_to_half_f16c<true>(src, dst, n);
  if (cpu_has_f16c()) return float_to_half_f16c<false>(src, dst, n);
  convert_impl(src, dst, n);
}

// The float16 forward and backward in place (kRowsInPlace), where the CPU runs the x86-64-v3
// clones (F16C).
#define FF_V3 __attribute__((target("arch=x86-64-v3")))
FF_V3 inline Vec<float> load_f16x8(const c10::Half* p) {
  const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  Vec<float> v;
  __builtin_memcpy(&v, &f, sizeof(v));
  return v;
}

// (streamed when kStream; p then 16-byte aligned)
template <bool kStream = false>
FF_V3 inline void store_f16x8(c10::Half* p, const Vec<float>& v) {
  __m256 f;
  __builtin_memcpy(&f, &v, sizeof(f));
  const __m128i h = _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT);
  put16<kStream>(p, &h);
}

template <>
constexpr bool kRowsInPlace<c10::Half> = true;
bool rows_in_place(const c10::Half*, int64_t n) {
  static const bool v3 = __builtin_cpu_supports("x86-64-v3");
  return v3 && n % 16 == 0;
}

// moments_impl of the row.
FF_V3 Moments<float> row_moments(const c10::Half* x, int64_t n) {
  return moments_loaded<float>(
      n, [x](int64_t j) FF_V3 { return load_f16x8(x + j); },
      [x](int64_t j) { return static_cast<float>(x[j]); });
}

// sq_dev_impl(row, mean 0).
FF_V3 float row_sq_sum(const c10::Half* x, int64_t n) {
  return sum_loaded<float>(
      n, [x](int64_t j) FF_V3 { return load_f16x8(x + j); },
      [x](int64_t j) { return static_cast<float>(x[j]); },
      [](const Vec<float>& v) { return v * v; });
}

// normalize_impl of the row, stored as float16.
template <bool kStream>
FF_V3 inline void normalize_f16_impl(const c10::Half* x, c10::Half* out, int64_t n, float mean,
                                     float rstd, const float* w, const float* b,
                                     const c10::Half* next) {
  const Vec<float> m = vsplat(mean), r = vsplat(rstd);
  if (w == nullptr) {
    for (int64_t j = 0; j < n; j += 8) {
      prefetch_next(next, j);
      store_f16x8<kStream>(out + j, (load_f16x8(x + j) - m) * r);
    }
    return;
  }
  for (int64_t j = 0; j < n; j += 8) {
    prefetch_next(next, j);
    store_f16x8<kStream>(out + j, (load_f16x8(x + j) - m) * r * vload(w + j) + vload(b + j));
  }
}

FF_V3 void row_normalize(const c10::Half* x, c10::Half* out, int64_t n, float mean, float rstd,
                         const float* w, const float* b, const c10::Half* next, bool stream) {
  if (stream) return normalize_f16_impl<true>(x, out, n, mean, rstd, w, b, next);
  normalize_f16_impl<false>(x, out, n, mean, rstd, w, b, next);
}

// The backward's passes of the row: bwd_sums_impl, then dx_impl with dx stored as float16.
FF_V3 GradSums<float> row_bwd_sums(const c10::Half* x, const c10::Half* dy, const float* w,
                                   float mean, float rstd, float* pb, int64_t n) {
  return bwd_sums_impl(x, dy, w, mean, rstd, pb, n,
                       [](const c10::Half* p) FF_V3 { return load_f16x8(p); });
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")  // as row_dx's float clones (dx_loop)
#endif
FF_V3 void row_dx(const c10::Half* x, const c10::Half* dy, const float* w, c10::Half* dx,
                  int64_t n, float mean, float rstd, const DxConsts<float>& c, float* pw,
                  const c10::Half* next_x, const c10::Half* next_dy, bool stream) {
  const auto load = [](const c10::Half* p) FF_V3 { return load_f16x8(p); };
  if (stream) {
    return dx_impl(
        x, dy, w, dx, n, mean, rstd, c, pw, load,
        [](c10::Half* p, const Vec<float>& v) FF_V3 { store_f16x8<true>(p, v); }, next_x,
        next_dy);
  }
  dx_impl(
      x, dy, w, dx, n, mean, rstd, c, pw, load,
      [](c10::Half* p, const Vec<float>& v) FF_V3 { store_f16x8<false>(p, v); }, next_x, next_dy);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
#undef FF_V3
#else
void row_convert(const c10::Half* src, float* dst, int64_t n) { convert_impl(src, dst, n); }
void row_convert(const float* src, c10::Half* dst, int64_t n, bool = false) {
  convert_impl(src, dst, n);
}
#endif

// (streamed when `stream`; dst then 16-byte aligned)
template <typename A>
void row_convert(const A* src, A* dst, int64_t n, bool stream = false) {
  if (!stream) {
    std::copy(src, src + n, dst);
    return;
  }
  int64_t j = 0;
  for (; j + kLanes<A> <= n; j += kLanes<A>) vstream(dst + j, vload(src + j));
  for (; j < n; ++j) dst[j] = src[j];
}

// A per-column parameter as a buffer of A (`fill` when absent).
template <typename A>
std::vector<A> param_buffer(const c10::optional<at::Tensor>& p, int64_t cols, A fill) {
  std::vector<A> out(cols, fill);
  if (!p.has_value()) return out;
  const at::Tensor c = p->contiguous().to(c10::CppTypeToScalarType<A>::value);
  std::copy(c.data_ptr<A>(), c.data_ptr<A>() + cols, out.begin());
  return out;
}

// ------------------------------------------------------------------ CPU: forward

template <typename T>
struct FwdCpu {
  const T* x;
  const T* residual;
  T* out;
  T* pre;
  int64_t cols;
  double eps;
  float dropout_p;  // the keep test compares an fp32 uniform with the fp32 p
  double scale;     // dropout_scale(p)
  uint64_t seed;
  bool rms;
  bool fused;
};

// Whether the fused rows of T (residual, pre and dpre) go through row_convert and a scratch row
// instead of scalar conversions: float16's, whose scalar conversion (c10::Half's bit arithmetic,
// which GCC does not vectorize) made its fused forward 3-5x slower than bfloat16's. Not
// bfloat16's: GCC vectorizes its scalar conversions (shifts) in place, and through a scratch row
// its fused forward took 4-25% more (hidden 256-4096, a 2-core AMD EPYC VM).
template <typename T>
constexpr bool kConvertsRows = std::is_same_v<T, c10::Half>;

// v += the row r of T.
template <typename T, typename A>
void add_row(const T* r, A* v, A* tmp, int64_t n) {
  if constexpr (kConvertsRows<T>) {
    row_convert(r, tmp, n);
    for (int64_t j = 0; j < n; ++j) v[j] += tmp[j];
  } else {
    for (int64_t j = 0; j < n; ++j) v[j] += static_cast<A>(r[j]);
  }
}

// Scratch rows of a fused forward task (kConvertsRows): a row in A and one in T.
template <typename T, typename A>
struct FwdScratch {
  explicit FwdScratch(int64_t n, bool fused)
      : a(fused && kConvertsRows<T> ? n : 0), t(fused && kConvertsRows<T> ? n : 0) {}
  std::vector<A> a;
  std::vector<T> t;
};

// Row `row` of the normalized input in v: round_to_T(residual + dropout(x)), or x.
template <typename T, typename A>
void load_row(const FwdCpu<T>& p, int64_t row, A* v, FwdScratch<T, A>& s, bool stream) {
  const int64_t off = row * p.cols;
  row_convert(p.x + off, v, p.cols);
  if (!p.fused) return;
  if (p.dropout_p > 0) {
    dropout_scale_cpu(v, p.cols, p.seed, static_cast<uint64_t>(off), p.dropout_p,
                      static_cast<A>(p.scale));
  }
  if (p.residual != nullptr) add_row(p.residual + off, v, s.a.data(), p.cols);
  // The backward reads pre back in the input dtype: normalize exactly those values.
  if constexpr (kConvertsRows<T>) {
    T* rounded = p.pre != nullptr ? p.pre + off : s.t.data();
    row_convert(v, rounded, p.cols);
    row_convert(rounded, v, p.cols);
    return;
  }
  for (int64_t j = 0; j < p.cols; ++j) v[j] = static_cast<A>(static_cast<T>(v[j]));
  if (p.pre != nullptr) row_convert(v, p.pre + off, p.cols, stream);
}

// Mean and rstd of a row whose statistics overflowed (|x - mean| past sqrt(max), or a sum past
// max): the same two passes on x times 2^-(3/4 max_exponent) (2^-96 for float), exact for a
// power of two, so that neither the squares nor their sum over 2^63 columns can overflow. The
// values it flushes are too small to change a variance past max. torch's fp32 LayerNorm gives
// NaN there; an unscaled rstd was 0 and the output silently the bias. Rows with inf or NaN come
// out NaN as before.
template <typename A>
std::pair<A, A> scaled_stats(const A* v, int64_t n, double eps, bool rms) {
  const A s = std::ldexp(A(1), -3 * std::numeric_limits<A>::max_exponent / 4);
  const Vec<A> vs = vsplat(s), shift = vsplat(rms ? A(0) : v[0] * s);
  const A sum = sum_map(v, n, [&](const Vec<A>& x) { return x * vs - shift; });
  const A mu = rms ? A(0) : v[0] * s + sum / static_cast<A>(n);  // of the scaled row
  const Vec<A> m = vsplat(mu);
  const A var = sum_map(v, n, [&](const Vec<A>& x) { return (x * vs - m) * (x * vs - m); });
  const A scaled_eps = static_cast<A>(eps) * s * s;  // 0 in float: eps * 2^-192 underflows
  const A root = std::sqrt(var / static_cast<A>(n) + scaled_eps);
  // (root 0: no spread left after scaling, so eps alone sets rstd; NaN stays NaN)
  return {mu / s, root == A(0) ? A(1) / std::sqrt(static_cast<A>(eps)) : s / root};
}

// Mean and rstd from the moments of a row (n > 0) where they are kept: the variance loses at
// most a bit to cancellation (shift within a std of the mean).
template <typename A>
bool moments_stats(const Moments<A>& m, int64_t n, double eps, std::pair<A, A>& stats) {
  const A d = m.sum / static_cast<A>(n), q = m.sum_sq / static_cast<A>(n);
  // (q inf or NaN: a row that overflowed or holds inf or NaN, left to row_stats' passes)
  if (!std::isfinite(q) || !(d * d <= q / 2)) return false;
  stats = {m.shift + d, A(1) / std::sqrt(q - d * d + static_cast<A>(eps))};
  return true;
}

// Mean (0 for RMSNorm) and rstd of row v (`given`: its moments, taken while converting, else
// row_moments: one pass), where moments_stats keeps them. Other rows take two passes: the mean,
// then the squared deviations. A row whose mean dominates its spread (|mean| > 16 std; a
// constant row) takes its mean again from the sum of x - x[0]: exact for a constant row (x - mean
// is then 0, and the output the bias even with eps = 1e-12), its rounding growing with the
// spread, not the offset (the plain fp32 sum of a 100003-column row at offset 1e6 was off by
// ~20). Only those rows pay for that third pass.
template <typename A>
std::pair<A, A> row_stats(const A* v, int64_t n, double eps, bool rms, const Moments<A>* given) {
  std::pair<A, A> stats;
  if (!rms && n > 0 && moments_stats(given ? *given : row_moments(v, n), n, eps, stats)) {
    return stats;
  }
  A mu = rms ? A(0) : row_sum(v, n) / static_cast<A>(n);
  A var = row_sq_dev(v, n, mu) / static_cast<A>(n);
  // (a constant row whose sum overflowed, mu and var inf, takes the shifted sum too, exact;
  // NaN rows as well, to no effect; a zero row does not)
  if (!rms && n > 0 && (!(mu * mu <= A(256) * var) || std::isinf(mu))) {
    mu = v[0] + row_shifted_sum(v, n, v[0]) / static_cast<A>(n);
    var = row_sq_dev(v, n, mu) / static_cast<A>(n);
  }
  if (!std::isfinite(mu) || !std::isfinite(var)) return scaled_stats(v, n, eps, rms);
  return {mu, A(1) / std::sqrt(var + static_cast<A>(eps))};
}

// row_stats of a 16-bit row read in place (rows_in_place): its moments, or for RMSNorm its sum
// of squares. A row they do not settle is converted into buf for row_stats' passes.
template <typename T>
std::pair<float, float> stats_in_place(const T* x, float* buf, int64_t n, double eps, bool rms) {
  std::pair<float, float> stats;
  if (n > 0 && !rms && moments_stats(row_moments(x, n), n, eps, stats)) return stats;
  if (n > 0 && rms) {
    const float var = row_sq_sum(x, n) / static_cast<float>(n);
    if (std::isfinite(var)) return {0.0f, 1.0f / std::sqrt(var + static_cast<float>(eps))};
  }
  row_convert(x, buf, n);
  return row_stats<float>(buf, n, eps, rms, nullptr);
}

constexpr const char* kStreamEnv = "FASTFORMER_LN_STREAM";

// Whether a call writes its output rows (`outs`, rows of `cols`; null: none) with non-temporal
// stores (stream_store.h): FASTFORMER_LN_STREAM=1 always, 0 never, auto (the default) where the
// call moves at least the last-level cache's size in `bytes` (its row tensors read and written)
// and `pays`. Only where every row starts 16-byte aligned.
template <typename T>
bool streams_rows(std::initializer_list<const T*> outs, int64_t cols, int64_t bytes, bool pays) {
  const char* raw = std::getenv(kStreamEnv);
  const std::string mode = raw != nullptr ? raw : "";
  TORCH_CHECK_VALUE(mode.empty() || mode == "auto" || mode == "0" || mode == "1", kStreamEnv,
                    " must be one of ('auto', '0', '1'), got '", mode, "'");
  bool aligned = cols * sizeof(T) % 16 == 0;
  for (const T* out : outs) aligned = aligned && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  if (!kHasStreamStores || !aligned || mode == "0") return false;
  return mode == "1" || (pays && bytes >= llc_bytes());
}

// The next row of x for the 16-bit forwards' prefetch_next, within a task's rows (end). Not
// float16's past 8192 columns: its forward (x read twice in place) took 10-20% more with it at
// 16384-32768, where its backward and bfloat16's forward still gained (benchmarks/NOTES.md).
template <typename T>
const T* next_row(const FwdCpu<T>& p, int64_t row, int64_t end) {
  const bool too_long = std::is_same_v<T, c10::Half> && p.cols > 8192;
  if (p.fused || !prefetches_next_row<T>(p.cols) || too_long || row + 1 >= end) return nullptr;
  return p.x + (row + 1) * p.cols;
}

template <typename T>
void fwd_cpu_kernel(const FwdCpu<T>& p, const c10::optional<at::Tensor>& weight,
                    const c10::optional<at::Tensor>& bias, int64_t rows, at::Tensor& mean,
                    at::Tensor& rstd) {
  using A = at::opmath_type<T>;
  const int64_t n = p.cols;
  const bool affine = weight.has_value() || bias.has_value();
  const std::vector<A> w = param_buffer<A>(weight, affine ? n : 0, A(1));
  const std::vector<A> b = param_buffer<A>(bias, affine ? n : 0, A(0));
  A* mean_out = p.rms ? nullptr : mean.data_ptr<A>();
  A* rstd_out = rstd.data_ptr<A>();
  const A* wp = affine ? w.data() : nullptr;
  const A* bp = affine ? b.data() : nullptr;
  const auto store_stats = [mean_out, rstd_out](int64_t row, A mu, A r) {
    if (mean_out != nullptr) mean_out[row] = mu;
    rstd_out[row] = r;
  };
  // 16-bit rows read in place (kRowsInPlace), but not bfloat16's forward.
  constexpr bool kInPlace = kRowsInPlace<T> && !std::is_same_v<T, c10::BFloat16>;
  bool in_place = false;
  if constexpr (kInPlace) in_place = !p.fused && rows_in_place(p.x, n);
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1));
  // out and pre streamed (forwards moving 32-128 MiB on a 2-core AMD EPYC VM with a 32 MiB L3:
  // float32 1.1-1.5x, float16 1.2-1.4x, bfloat16 1.03-1.26x faster; the fused op: float32
  // 1.06-1.13x, 16-bit 0.96-1.07x), but not float16's pre, which is read back at once.
  const int64_t row_tensors = 2 + (p.residual != nullptr) + (p.pre != nullptr);
  const bool stream =
      streams_rows<T>({p.out, p.pre}, n, row_tensors * rows * n * int64_t{sizeof(T)}, true);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    prefault_rows(p.out, n, begin, end);
    prefault_rows(p.pre, n, begin, end);
    std::vector<A> buf(n);
    FwdScratch<T, A> scratch(n, p.fused);
    for (int64_t row = begin; row < end; ++row) {
      const T* next = next_row(p, row, end);
      const A* v = buf.data();
      Moments<A> moments{};  // of v, when the conversion took them
      bool converted = false;
      if constexpr (std::is_same_v<T, A>) {
        if (!p.fused) v = p.x + row * n;  // fp32 / fp64: read x in place
      }
      if constexpr (kInPlace) {
        if (in_place) {
          const T* x = p.x + row * n;
          const auto [mu, r] = stats_in_place(x, buf.data(), n, p.eps, p.rms);
          store_stats(row, mu, r);
          row_normalize(x, p.out + row * n, n, mu, r, wp, bp, next, stream);
          continue;
        }
      }
#ifdef FF_FUSED_BF16
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (!p.fused) {
          moments = row_convert_moments(p.x + row * n, buf.data(), n);
          converted = true;
        }
      }
#endif
      if (v == buf.data() && !converted) load_row<T, A>(p, row, buf.data(), scratch, stream);
      const auto [mu, r] = row_stats(v, n, p.eps, p.rms, converted ? &moments : nullptr);
      store_stats(row, mu, r);
      if constexpr (std::is_same_v<T, A>) {
        row_normalize(v, p.out + row * n, n, mu, r, wp, bp, stream);
      } else {
#ifdef FF_FUSED_BF16
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          row_normalize(v, p.out + row * n, n, mu, r, wp, bp, next, stream);
          continue;
        }
#endif
        row_normalize(v, buf.data(), n, mu, r, wp, bp);
        row_convert(buf.data(), p.out + row * n, n, stream);
      }
    }
    if (stream) stream_fence();
  });
}

// ------------------------------------------------------------------ CPU: backward

template <typename T>
struct BwdCpu {
  const T* dy;
  const T* dpre;
  const T* x;
  T* dx;
  T* dres;
  int64_t cols;
  float dropout_p;
  double scale;
  uint64_t seed;
  bool rms;
  bool fused;
};

// Fixed number of row blocks (a function of rows only): each block sums its rows' dweight /
// dbias terms in row order, then the blocks' sums are added in block order. Deterministic for
// any thread count. At least 8 rows a block: a block's partial rows are written and read back
// once, which with a block per row was as much traffic as the input (64 x 4096: 11% of the
// backward's time on one core of the CI VM), and at most 64 blocks to share among threads.
int64_t bwd_blocks(int64_t rows) { return std::min<int64_t>(64, (rows + 7) / 8); }

// Scratch rows of one backward task.
template <typename A>
struct BwdScratch {
  explicit BwdScratch(int64_t n) : x(n), dy(n), g(n) {}
  std::vector<A> x, dy, g;
};

// Gradient of pre -> dx: add dpre, write dres (streamed when `stream`), apply the dropout mask
// (fused op only).
template <typename T, typename A>
void fused_tail(const BwdCpu<T>& p, int64_t off, A* g, A* tmp, bool stream) {
  const int64_t n = p.cols;
  if (p.dpre != nullptr) add_row(p.dpre + off, g, tmp, n);
  if (p.dres != nullptr) row_convert(g, p.dres + off, n, stream);
  if (p.dropout_p > 0) {
    dropout_scale_cpu(g, n, p.seed, static_cast<uint64_t>(off), p.dropout_p,
                      static_cast<A>(p.scale));
  }
}

// has_next: the task goes on with row + 1. stream: dx and dres streamed (streams_rows).
template <typename T, typename A>
void bwd_row(const BwdCpu<T>& p, int64_t row, A mu, A r, const A* w, BwdScratch<A>& s, A* pw,
             A* pb, bool has_next, bool stream) {
  const int64_t n = p.cols, off = row * n;
  if constexpr (kRowsInPlace<T>) {
    if (!p.fused && rows_in_place(p.x, n)) {
      const T* x16 = p.x + off;
      const T* dy16 = p.dy + off;
      const bool pf = has_next && prefetches_next_row<T>(n);
      const DxConsts<A> c = dx_consts(row_bwd_sums(x16, dy16, w, mu, r, pb, n), n, p.rms);
      row_dx(x16, dy16, w, p.dx + off, n, mu, r, c, pw, pf ? x16 + n : nullptr,
             pf ? dy16 + n : nullptr, stream);
      return;
    }
  }
  const A* x = nullptr;
  const A* dy = nullptr;
  if constexpr (std::is_same_v<T, A>) {  // fp32 / fp64: read in place
    x = p.x + off;
    dy = p.dy + off;
  } else {
    row_convert(p.x + off, s.x.data(), n);
    row_convert(p.dy + off, s.dy.data(), n);
    x = s.x.data();
    dy = s.dy.data();
  }
  const DxConsts<A> c = dx_consts(row_bwd_sums(x, dy, w, mu, r, pb, n), n, p.rms);
  if constexpr (std::is_same_v<T, A>) {
    if (!p.fused) {  // fp32 / fp64: straight into dx
      row_dx(x, dy, w, p.dx + off, n, mu, r, c, pw, stream);
      return;
    }
  }
  row_dx(x, dy, w, s.g.data(), n, mu, r, c, pw, false);
  if (p.fused) fused_tail(p, off, s.g.data(), s.x.data(), stream);  // (x's row is read by then)
  row_convert(s.g.data(), p.dx + off, n, stream);
}

// Sums the blocks' partial rows (in block order) into dst (cols,), written in dst's dtype.
template <typename A>
void finalize_cpu(const std::vector<A>& partial, int64_t blocks, int64_t cols, at::Tensor& dst) {
  at::Tensor acc = at::zeros({cols}, dst.options().dtype(c10::CppTypeToScalarType<A>::value));
  A* out = acc.data_ptr<A>();
  at::parallel_for(0, cols, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const A* src = partial.data() + blk * cols + begin;
      row_accumulate(out + begin, src, static_cast<const A*>(nullptr), end - begin);
    }
  });
  dst.copy_(acc);
}

template <typename T>
void bwd_cpu_kernel(const BwdCpu<T>& p, const c10::optional<at::Tensor>& weight,
                    const at::Tensor& mean, const at::Tensor& rstd, int64_t rows,
                    at::Tensor& dweight, at::Tensor& dbias) {
  using A = at::opmath_type<T>;
  const int64_t n = p.cols;
  const std::vector<A> w = param_buffer<A>(weight, n, A(1));
  const A* mean_in = p.rms ? nullptr : mean.data_ptr<A>();
  const A* rstd_in = rstd.data_ptr<A>();
  const bool want_w = dweight.numel() > 0, want_b = dbias.numel() > 0;
  const int64_t blocks = bwd_blocks(rows);
  const int64_t per_block = blocks == 0 ? 0 : (rows + blocks - 1) / blocks;
  std::vector<A> pw(want_w ? blocks * n : 0, A(0)), pb(want_b ? blocks * n : 0, A(0));
  // dx and dres streamed as the forward's out (float32 1.1-1.3x, float16 1.07-1.19x faster;
  // the fused op: float32 1.11-1.19x, float16 1.03-1.14x, bfloat16 1.03-1.08x), but not by
  // default where bfloat16 rows are read in place: their dx pass (the rounding in integer
  // vector operations) is not waiting on memory, and took 1-3% more streamed.
  bool bf16_in_place = false;
  if constexpr (kRowsInPlace<T> && std::is_same_v<T, c10::BFloat16>) {
    bf16_in_place = !p.fused && rows_in_place(p.x, n);
  }
  const int64_t row_tensors = 3 + (p.dpre != nullptr) + (p.dres != nullptr);
  const int64_t bytes = row_tensors * rows * n * int64_t{sizeof(T)};
  const bool stream = streams_rows<T>({p.dx, p.dres}, n, bytes, !bf16_in_place);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    const int64_t first = std::min(rows, begin * per_block), last = std::min(rows, end * per_block);
    prefault_rows(p.dx, n, first, last);
    prefault_rows(p.dres, n, first, last);
    BwdScratch<A> scratch(n);
    for (int64_t blk = begin; blk < end; ++blk) {
      A* bw = want_w ? pw.data() + blk * n : nullptr;
      A* bb = want_b ? pb.data() + blk * n : nullptr;
      const int64_t block_end = std::min(rows, (blk + 1) * per_block);
      for (int64_t row = blk * per_block; row < block_end; ++row) {
        const A mu = mean_in != nullptr ? mean_in[row] : A(0);
        bwd_row<T, A>(p, row, mu, rstd_in[row], w.data(), scratch, bw, bb, row + 1 < last,
                      stream);
      }
    }
    if (stream) stream_fence();
  });
  if (want_w) finalize_cpu<A>(pw, blocks, n, dweight);
  if (want_b) finalize_cpu<A>(pb, blocks, n, dbias);
}

// Calls f(T{}) for x's dtype (weight and bias are read into A buffers, whatever their dtype).
template <typename F>
void dispatch_cpu(at::ScalarType xt, F&& f) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, xt, "layer_norm_cpu",
                                  [&] { f(scalar_t{}); });
}

// ------------------------------------------------------------------ ops

// The fused kernels normalize pre = residual + dropout(x) (and write it when store_pre): when
// there is something to add or drop, or when pre is asked for.
bool is_fused(const c10::optional<at::Tensor>& residual, double dropout_p, bool store_pre) {
  return residual.has_value() || dropout_p > 0 || store_pre;
}

// Outputs of the forward, allocated for x: out, pre (or empty), mean (or empty), rstd.
Tensors4 fwd_outputs(const at::Tensor& x, bool store_pre, bool rms) {
  const auto stats = x.options().dtype(stats_dtype(x));
  at::Tensor pre = store_pre ? at::empty_like(x) : at::empty({0}, x.options());
  at::Tensor mean = rms ? at::empty({0}, stats) : at::empty({rows_of(x)}, stats);
  return {at::empty_like(x), pre, mean, at::empty({rows_of(x)}, stats)};
}

Tensors4 layer_norm_fwd_cpu(const at::Tensor& x_in, const c10::optional<at::Tensor>& weight,
                            const c10::optional<at::Tensor>& bias,
                            const c10::optional<at::Tensor>& residual, const at::Tensor& seed,
                            double eps, double dropout_p, bool rms, bool store_pre) {
  check_fwd(x_in, weight, bias, residual, eps, dropout_p, rms, store_pre);
  const bool fused = is_fused(residual, dropout_p, store_pre);
  const at::Tensor x = x_in.contiguous();
  const at::Tensor res = residual.has_value() ? residual->contiguous() : at::Tensor();
  auto [out, pre, mean, rstd] = fwd_outputs(x, store_pre, rms);
  dispatch_cpu(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    const FwdCpu<T> p{x.data_ptr<T>(),
                      res.defined() ? res.data_ptr<T>() : nullptr,
                      out.data_ptr<T>(),
                      pre.numel() > 0 ? pre.data_ptr<T>() : nullptr,
                      cols_of(x),
                      eps,
                      static_cast<float>(dropout_p),
                      dropout_scale(dropout_p),
                      seed_value(seed),
                      rms,
                      fused};
    fwd_cpu_kernel<T>(p, weight, bias, rows_of(x), mean, rstd);
  });
  return {out, pre, mean, rstd};
}

struct BwdInputs {
  at::Tensor dy, dpre, x;
};

void check_bwd(const at::Tensor& dy, const c10::optional<at::Tensor>& dpre, const at::Tensor& x,
               const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias,
               const at::Tensor& mean, const at::Tensor& rstd, double dropout_p, bool rms,
               bool fused, bool has_residual, bool need_dweight, bool need_dbias) {
  check_x(x, "x");
  TORCH_CHECK(!rms || (!fused && !bias.has_value()), "layer_norm: rms=True is never fused and "
              "takes no bias");
  TORCH_CHECK(dropout_p >= 0 && dropout_p < 1, "layer_norm: dropout_p must be in [0, 1), got ",
              dropout_p);
  // Only the fused kernels read dpre, drop, and write dres (an unfused dres stayed unwritten).
  TORCH_CHECK(fused || (dropout_p == 0 && !has_residual && !dpre.has_value()),
              "layer_norm: dropout_p > 0, has_residual and dpre need fused=True");
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type(),
              "layer_norm: dy must match x ", x.sizes(), " ", x.scalar_type(), ", got ",
              dy.sizes(), " ", dy.scalar_type());
  FF_CHECK_DEVICE(dy, x.device());
  if (dpre.has_value()) {
    TORCH_CHECK(dpre->sizes() == x.sizes() && dpre->scalar_type() == x.scalar_type(),
                "layer_norm: dpre must match x ", x.sizes(), ", got ", dpre->sizes(), " ",
                dpre->scalar_type());
    FF_CHECK_DEVICE(*dpre, x.device());
  }
  check_param(weight, "weight", x);
  check_param(bias, "bias", x);
  param_dtype(weight, bias, x);
  TORCH_CHECK(!need_dweight || weight.has_value(), "layer_norm: need_dweight without weight");
  TORCH_CHECK(!need_dbias || bias.has_value(), "layer_norm: need_dbias without bias");
  const auto st = stats_dtype(x);
  TORCH_CHECK(rstd.numel() == rows_of(x) && rstd.scalar_type() == st,
              "layer_norm: rstd must be (", rows_of(x), ",) ", st, ", got ", rstd.sizes(), " ",
              rstd.scalar_type());
  TORCH_CHECK(rms || (mean.numel() == rows_of(x) && mean.scalar_type() == st),
              "layer_norm: mean must be (", rows_of(x), ",) ", st, ", got ", mean.sizes(), " ",
              mean.scalar_type());
  FF_CHECK_DEVICE(rstd, x.device());
  if (!rms) FF_CHECK_DEVICE(mean, x.device());
}

// Outputs of the backward: dx, dres (or empty), dweight (or empty), dbias (or empty). Each its
// own tensor, empty ones too: the schema declares no aliasing outputs (opcheck's test_schema).
Tensors4 bwd_outputs(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                     const c10::optional<at::Tensor>& bias, bool has_residual, bool need_dweight,
                     bool need_dbias) {
  auto none = [&] { return at::empty({0}, x.options()); };
  return {at::empty_like(x), has_residual ? at::empty_like(x) : none(),
          need_dweight ? at::empty({cols_of(x)}, weight->options()) : none(),
          need_dbias ? at::empty({cols_of(x)}, bias->options()) : none()};
}

Tensors4 layer_norm_bwd_cpu(const at::Tensor& dy_in, const c10::optional<at::Tensor>& dpre_in,
                            const at::Tensor& x_in, const c10::optional<at::Tensor>& weight,
                            const c10::optional<at::Tensor>& bias, const at::Tensor& mean_in,
                            const at::Tensor& rstd_in, const at::Tensor& seed, double dropout_p,
                            bool rms, bool fused, bool has_residual, bool need_dweight,
                            bool need_dbias) {
  check_bwd(dy_in, dpre_in, x_in, weight, bias, mean_in, rstd_in, dropout_p, rms, fused,
            has_residual, need_dweight, need_dbias);
  const at::Tensor x = x_in.contiguous(), dy = dy_in.contiguous();
  const at::Tensor dpre = dpre_in.has_value() ? dpre_in->contiguous() : at::Tensor();
  const at::Tensor mean = mean_in.contiguous(), rstd = rstd_in.contiguous();
  auto [dx, dres, dweight, dbias] =
      bwd_outputs(x, weight, bias, has_residual, need_dweight, need_dbias);
  dispatch_cpu(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    const BwdCpu<T> p{dy.data_ptr<T>(),
                      dpre.defined() ? dpre.data_ptr<T>() : nullptr,
                      x.data_ptr<T>(),
                      dx.data_ptr<T>(),
                      has_residual ? dres.data_ptr<T>() : nullptr,
                      cols_of(x),
                      static_cast<float>(dropout_p),
                      dropout_scale(dropout_p),
                      seed_value(seed),
                      rms,
                      fused};
    bwd_cpu_kernel<T>(p, weight, mean, rstd, rows_of(x), dweight, dbias);
  });
  return {dx, dres, dweight, dbias};
}

// ------------------------------------------------------------------ CUDA glue

#ifdef FASTFORMER_WITH_CUDA

Tensors4 layer_norm_fwd_cuda(const at::Tensor& x_in, const c10::optional<at::Tensor>& weight_in,
                             const c10::optional<at::Tensor>& bias_in,
                             const c10::optional<at::Tensor>& residual_in,
                             const at::Tensor& seed, double eps, double dropout_p, bool rms,
                             bool store_pre) {
  check_fwd(x_in, weight_in, bias_in, residual_in, eps, dropout_p, rms, store_pre);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const bool fused = is_fused(residual_in, dropout_p, store_pre);
  const at::Tensor x = x_in.contiguous();
  auto contiguous = [](const c10::optional<at::Tensor>& t) -> c10::optional<at::Tensor> {
    return t.has_value() ? c10::optional<at::Tensor>(t->contiguous()) : c10::nullopt;
  };
  const auto weight = contiguous(weight_in), bias = contiguous(bias_in);
  const auto residual = contiguous(residual_in);
  auto [out, pre, mean, rstd] = fwd_outputs(x, store_pre, rms);
  LnFwdArgs a = ln_glue::fwd_args(x, weight, bias, residual, out, pre, mean, rstd, 0, eps,
                                  dropout_p, rms, fused);
  set_cuda_seed(a, seed, x);
  layer_norm_fwd_cuda_launch(a, at::cuda::getCurrentDeviceProperties()->multiProcessorCount,
                             at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, pre, mean, rstd};
}

Tensors4 layer_norm_bwd_cuda(const at::Tensor& dy_in, const c10::optional<at::Tensor>& dpre_in,
                             const at::Tensor& x_in, const c10::optional<at::Tensor>& weight_in,
                             const c10::optional<at::Tensor>& bias, const at::Tensor& mean_in,
                             const at::Tensor& rstd_in, const at::Tensor& seed, double dropout_p,
                             bool rms, bool fused, bool has_residual, bool need_dweight,
                             bool need_dbias) {
  check_bwd(dy_in, dpre_in, x_in, weight_in, bias, mean_in, rstd_in, dropout_p, rms, fused,
            has_residual, need_dweight, need_dbias);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), dy = dy_in.contiguous();
  const at::Tensor dpre = dpre_in.has_value() ? dpre_in->contiguous() : at::Tensor();
  const at::Tensor mean = mean_in.contiguous(), rstd = rstd_in.contiguous();
  const c10::optional<at::Tensor> weight =
      weight_in.has_value() ? c10::optional<at::Tensor>(weight_in->contiguous()) : c10::nullopt;
  auto [dx, dres, dweight, dbias] =
      bwd_outputs(x, weight, bias, has_residual, need_dweight, need_dbias);
  LnBwdArgs a = ln_glue::bwd_args(dy, dpre, x, weight, bias, mean, rstd, dx, dres, dweight,
                                   dbias, 0, dropout_p, rms, fused, has_residual, need_dweight,
                                   need_dbias);
  set_cuda_seed(a, seed, x);
  const int num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const LnBwdPlan plan = layer_norm_bwd_plan(a, num_sms);
  const int64_t partial_floats = std::max<int64_t>(1, 2 * plan.partial_rows * a.cols);
  const at::Tensor partial = at::empty({partial_floats}, x.options().dtype(at::kFloat));
  a.partial = partial.data_ptr<float>();
  layer_norm_bwd_cuda_launch(a, plan, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {dx, dres, dweight, dbias};
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastformer, m) {
  m.def(
      "layer_norm_fwd(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, Tensor seed, "
      "float eps, float dropout_p, bool rms, bool store_pre) "
      "-> (Tensor out, Tensor pre, Tensor mean, Tensor rstd)");
  m.def(
      "layer_norm_bwd(Tensor dy, Tensor? dpre, Tensor x, Tensor? weight, Tensor? bias, "
      "Tensor mean, Tensor rstd, Tensor seed, float dropout_p, bool rms, bool fused, "
      "bool has_residual, bool need_dweight, bool need_dbias) "
      "-> (Tensor dx, Tensor dres, Tensor dweight, Tensor dbias)");
}

TORCH_LIBRARY_IMPL(fastformer, CPU, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd_cpu);
  m.impl("layer_norm_bwd", &layer_norm_bwd_cpu);
}

#ifdef FASTFORMER_WITH_CUDA
TORCH_LIBRARY_IMPL(fastformer, CUDA, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd_cuda);
  m.impl("layer_norm_bwd", &layer_norm_bwd_cuda);
}

// For measuring launch configurations (benchmarks/sweep_layer_norm.py); no tensor arguments:
// a catch-all kernel.
TORCH_LIBRARY_FRAGMENT(fastformer, m) {
  m.def("layer_norm_tuning(int[] config) -> int[]", &ln_glue::tuning_op);
}
#endif

}  // namespace fastformer
