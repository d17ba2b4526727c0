// torch.ops.fastformer.ffn_forward / ffn_backward: the fused feed-forward
// linear2(dropout(act(linear1(x)))), CPU kernels and (under FASTFORMER_WITH_CUDA) CUDA glue.
//
// Kernel layer only: tensors in, tensors out, the dropout seed given by the caller. Autograd,
// seed drawing and input messages live in fastformer/ops/ffn.py. The GEMMs run in ATen
// (MKL/oneDNN on CPU, cuBLAS/cuBLASLt on CUDA); what lies between them is one fused pass here
// (CPU) or in ffn_cuda.cu (CUDA). Layouts and saved-tensor semantics: ffn/ffn.h.
//
//   ffn_forward(x (..., d_model), w1 (width, d_model), b1?, w2 (d_out, d_ff), b2?, ...)
//     -> out (..., d_out), saved; T below = the tokens, x's leading dims together
//   saved = dropout(relu(h)) (T, d_ff) for relu (all its backward needs: linear2's input, and
//           where it is positive is where relu passed and dropout kept), else the
//           pre-activation h (T, width). Empty when gelu_tanh ran in cuBLASLt's epilogue
//           (inference only: the pre-activation never exists).
//   ffn_backward(grad_out (..., d_out), x, w1, w2, saved, ...) -> dx (x's shape), dw1, db1,
//     dw2, db2
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/accumulate.h>
#include <c10/util/bit_cast.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common/checks.h"
#include "common/expf.h"
#include "common/philox.h"
#include "common/philox_cpu.h"
#include "common/prefault.h"
#include "ffn/ffn.h"
#include "ffn/ffn_lt.h"

#ifdef FASTFORMER_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace fastformer {
namespace {

using OptTensor = std::optional<at::Tensor>;
using Forward = std::tuple<at::Tensor, at::Tensor>;
using Backward = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

FfnActivation parse_activation(c10::string_view name) {
  if (name == "relu") return FfnActivation::kRelu;
  if (name == "gelu") return FfnActivation::kGelu;
  if (name == "gelu_tanh") return FfnActivation::kGeluTanh;
  if (name == "silu") return FfnActivation::kSilu;
  if (name == "swiglu") return FfnActivation::kSwiglu;
  if (name == "geglu") return FfnActivation::kGeglu;
  TORCH_CHECK(false, "ffn: activation must be one of relu, gelu, gelu_tanh, silu, swiglu, geglu; "
              "got '", std::string(name), "'");
}

// Sizes of one problem; width is linear1's output (2 * d_ff when gated).
struct Problem {
  FfnActivation act;
  int64_t tokens, d_model, width, d_ff, d_out;
  float p;       // keep where philox_uniform >= p (compared in float, as everywhere)
  double scale;  // 1 / (1 - p) from the double p, as the eager reference computes it
  uint64_t seed;
};

void check_same(const at::Tensor& t, const at::Tensor& x, const char* name) {
  TORCH_CHECK(t.device() == x.device(), "ffn: ", name, " is on ", t.device(), " but x is on ",
              x.device());
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), "ffn: ", name, " has dtype ", t.scalar_type(),
              " but x has ", x.scalar_type());
}

void check_bias(const OptTensor& b, int64_t size, const at::Tensor& x, const char* name) {
  if (!b.has_value()) return;
  check_same(*b, x, name);
  TORCH_CHECK(b->dim() == 1 && b->size(0) == size, "ffn: ", name, " must have shape (", size,
              "), got ", b->sizes());
}

Problem check_problem(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                      c10::string_view activation, double dropout_p, int64_t seed) {
  Problem pr{};
  pr.act = parse_activation(activation);
  TORCH_CHECK(x.dim() == 2, "ffn: x must be (tokens, d_model) here, got ", x.sizes());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "ffn: x must be a floating dtype, got ",
              x.scalar_type());
  TORCH_CHECK(w1.dim() == 2 && w1.size(1) == x.size(1), "ffn: w1 must be (width, ", x.size(1),
              "), got ", w1.sizes());
  TORCH_CHECK(!ffn_is_gated(pr.act) || w1.size(0) % 2 == 0, "ffn: gated activation ",
              std::string(activation), " needs an even w1.size(0), got ", w1.size(0));
  pr.tokens = x.size(0);
  pr.d_model = x.size(1);
  pr.width = w1.size(0);
  pr.d_ff = ffn_is_gated(pr.act) ? pr.width / 2 : pr.width;
  TORCH_CHECK(w2.dim() == 2 && w2.size(1) == pr.d_ff, "ffn: w2 must be (d_out, ", pr.d_ff,
              "), got ", w2.sizes());
  pr.d_out = w2.size(0);
  check_same(w1, x, "w1");
  check_same(w2, x, "w2");
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "ffn: dropout_p must be in [0, 1), got ",
              dropout_p);
  TORCH_CHECK(seed >= 0, "ffn: seed must be >= 0, got ", seed);
  pr.p = static_cast<float>(dropout_p);
  pr.scale = 1.0 / (1.0 - dropout_p);
  pr.seed = static_cast<uint64_t>(seed);
  return pr;
}

// device_seed: a seed drawn on x's device inside CUDA graph capture (the CUDA kernels read it
// there, so that each replay uses that replay's draw; `seed` is then ignored). CPU ops take the
// seed as the int.
const int64_t* device_seed_ptr(const OptTensor& device_seed, const at::Tensor& x) {
  return device_seed.has_value() ? device_seed_data(*device_seed, x, "ffn") : nullptr;
}

// Shape of `saved` for a forward whose activation ran outside cuBLASLt: h, or for relu (never
// gated, so d_ff == width) dropout(relu(h)).
std::vector<int64_t> saved_shape(const Problem& pr) { return {pr.tokens, pr.width}; }

void check_backward(const Problem& pr, const at::Tensor& grad_out, const at::Tensor& x,
                    const at::Tensor& saved) {
  check_same(grad_out, x, "grad_out");
  check_same(saved, x, "saved");
  TORCH_CHECK(grad_out.dim() == 2 && grad_out.size(0) == pr.tokens && grad_out.size(1) == pr.d_out,
              "ffn: grad_out must be (", pr.tokens, ", ", pr.d_out, "), got ", grad_out.sizes());
  TORCH_CHECK(saved.sizes() == at::IntArrayRef(saved_shape(pr)), "ffn: saved must be ",
              at::IntArrayRef(saved_shape(pr)), " (empty when the forward ran gelu_tanh in the ",
              "cuBLASLt epilogue, which supports no backward), got ", saved.sizes());
}

at::Tensor affine(const at::Tensor& x, const at::Tensor& w, const OptTensor& b) {
  return b.has_value() ? at::addmm(*b, x, w.t()) : at::mm(x, w.t());
}

// ------------------------------------------------------------------ CPU: one fused pass
//
// Per row, per L1-sized chunk of columns: convert to the compute type (float; double for
// float64), run one loop of bias + activation + dropout (forward; the bias only for fp32/fp64,
// see ffn_forward_cpu) or of dropout regeneration x activation derivative (backward), convert
// back. The loops are branch-free (selects; exp, erf, tanh as polynomials) so compilers
// auto-vectorize them, and on x86-64 GCC builds them three times (AVX-512, AVX2+FMA, baseline)
// behind an ifunc picked at load time (FMA contraction makes the clones differ in the last bit).
//
// at::vec is deliberately not used: an extension built with the default flags gets its generic
// (non-SIMD) fallback, whose per-element libm calls and memcpy-based selects measured ~10x
// slower than these loops; ATen's own kernels get AVX2/AVX-512 through per-file compile flags
// that an extension does not have.

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && __GNUC__ >= 11
#define FF_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FF_CPU_CLONES
#endif
#if defined(__GNUC__)
#define FF_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define FF_ALWAYS_INLINE inline
#endif

constexpr int64_t kChunk = 256;  // columns per step: the buffers stay in L1

// |x| clamped to `limit` keeping the sign, NaN kept; integer selects so the loop vectorizes
// (float compares block GCC's if-conversion under the default -ftrapping-math).
FF_ALWAYS_INLINE float clamp_magnitude(float x, float limit) {
  const int32_t bits = c10::bit_cast<int32_t>(x);
  const int32_t mag = bits & 0x7fffffff, lim = c10::bit_cast<int32_t>(limit);
  const bool clamp = (mag > lim) & (mag <= 0x7f800000);
  return c10::bit_cast<float>(clamp ? ((bits & INT32_MIN) | lim) : bits);
}

// exp in float: Cephes' expf polynomial (relative error ~1e-7). |x| <= 104 keeps n in
// [-150, 150]; 2^n is applied in two halves so results overflow and underflow (to subnormals)
// where expf does.
FF_ALWAYS_INLINE float exp_f32(float x) {
  x = clamp_magnitude(x, 104.f);
  float n;
  const float p = expf_reduced(x, n);
  int32_t i = static_cast<int32_t>(n);  // NaN gives INT_MIN: clamped, and p is NaN anyway
  i = i < 150 ? i : 150;
  i = i > -150 ? i : -150;
  const int32_t i1 = i / 2, i2 = i - i1;
  return p * c10::bit_cast<float>((i1 + 127) << 23) * c10::bit_cast<float>((i2 + 127) << 23);
}

// erf in float: Abramowitz & Stegun 7.1.26, the formula of ATen's vectorized erf (absolute
// error < 6e-7 in float arithmetic).
FF_ALWAYS_INLINE float erf_f32(float x) {
  const float a = std::fabs(x);
  const float t = 1.f / (1.f + 0.3275911f * a);
  float p = 1.061405429f;
  p = p * t - 1.453152027f;
  p = p * t + 1.421413741f;
  p = p * t - 0.284496736f;
  p = p * t + 0.254829592f;
  return std::copysign(1.f - p * t * exp_f32(-a * a), x);
}

// float: the polynomials above; double (the gradcheck dtype): libm.
template <typename acc_t>
struct Math;
template <>
struct Math<float> {
  static FF_ALWAYS_INLINE float exp(float x) { return exp_f32(x); }
  static FF_ALWAYS_INLINE float erf(float x) { return erf_f32(x); }
};
template <>
struct Math<double> {
  static double exp(double x) { return std::exp(x); }
  static double erf(double x) { return std::erf(x); }
};

template <typename acc_t>
struct Consts {
  static constexpr acc_t kSqrtHalf = static_cast<acc_t>(0.70710678118654752440);
  static constexpr acc_t kInvSqrt2Pi = static_cast<acc_t>(0.39894228040143267794);
  static constexpr acc_t kTanhBeta = static_cast<acc_t>(0.79788456080286535588);  // sqrt(2/pi)
  static constexpr acc_t kTanhKappa = static_cast<acc_t>(0.044715);
};

// The tanh GELU's gate s = (1 + tanh(u)) / 2 = 1 / (1 + e^-2u), u = sqrt(2/pi) (x + k x^3), and
// 1 - s. From tanh, 1 + tanh(u) and 1 - tanh(u)^2 cancel in the left tail (fp32 at x = -5: 0
// where torch gives -3e-7; 4x torch's error at x = -3); 1 - s = e^-2u s keeps its digits.
template <typename acc_t>
FF_ALWAYS_INLINE std::pair<acc_t, acc_t> gelu_tanh_gate(acc_t x) {
  using C = Consts<acc_t>;
  const acc_t e = Math<acc_t>::exp(acc_t(-2) * C::kTanhBeta * (x + C::kTanhKappa * x * x * x));
  const acc_t s = acc_t(1) / (acc_t(1) + e);
  return {s, e > acc_t(1) ? acc_t(1) - s : e * s};
}

constexpr bool is_gated(FfnActivation a) {
  return a == FfnActivation::kSwiglu || a == FfnActivation::kGeglu;
}

// The activation (of the gate, when gated); relu keeps NaN as torch.relu does.
template <FfnActivation A, typename acc_t>
FF_ALWAYS_INLINE acc_t act(acc_t x) {
  using M = Math<acc_t>;
  using C = Consts<acc_t>;
  if constexpr (A == FfnActivation::kRelu) {
    return x < acc_t(0) ? acc_t(0) : x;
  } else if constexpr (A == FfnActivation::kGelu || A == FfnActivation::kGeglu) {
    return acc_t(0.5) * x * (acc_t(1) + M::erf(x * C::kSqrtHalf));
  } else if constexpr (A == FfnActivation::kGeluTanh) {
    return x * gelu_tanh_gate(x).first;
  } else if constexpr (A == FfnActivation::kSilu || A == FfnActivation::kSwiglu) {
    return x / (acc_t(1) + M::exp(-x));
  } else {
    return x;
  }
}

// d act / dx (relu's backward reads the saved output instead).
template <FfnActivation A, typename acc_t>
FF_ALWAYS_INLINE acc_t act_grad(acc_t x) {
  using M = Math<acc_t>;
  using C = Consts<acc_t>;
  if constexpr (A == FfnActivation::kGelu || A == FfnActivation::kGeglu) {
    return acc_t(0.5) * (acc_t(1) + M::erf(x * C::kSqrtHalf)) +
           x * C::kInvSqrt2Pi * M::exp(acc_t(-0.5) * x * x);
  } else if constexpr (A == FfnActivation::kGeluTanh) {
    const auto [s, one_minus_s] = gelu_tanh_gate(x);  // (1 - tanh^2) / 2 = 2 s (1 - s)
    return s + acc_t(2) * x * s * one_minus_s * C::kTanhBeta *
                   (acc_t(1) + acc_t(3) * C::kTanhKappa * x * x);
  } else if constexpr (A == FfnActivation::kSilu || A == FfnActivation::kSwiglu) {
    const acc_t s = acc_t(1) / (acc_t(1) + M::exp(-x));
    return s * (acc_t(1) + x * (acc_t(1) - s));
  } else {
    return acc_t(1);
  }
}

// One chunk's buffers: a = h (the gate), up = the up half, m = dropout multipliers, d = dg.
template <typename acc_t>
struct Chunk {
  alignas(64) acc_t a[kChunk];
  alignas(64) acc_t up[kChunk];
  alignas(64) acc_t m[kChunk];
  alignas(64) acc_t d[kChunk];
};

// Forward: a = act(a) (* up when gated) * m.
template <FfnActivation A, typename acc_t>
FF_ALWAYS_INLINE void forward_loop(Chunk<acc_t>& c, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    acc_t y = act<A>(c.a[i]);
    if constexpr (is_gated(A)) y *= c.up[i];
    c.a[i] = y * c.m[i];
  }
}

// Backward. relu: d = !(a <= 0) * d * scale, with a the saved g (positive where relu passed and
// dropout kept; NaN where h was NaN, whose gradient torch's relu passes: relu_dropped_nans
// zeroes the dropped ones). Others: the results replace their inputs --
//   plain: d = dg m act'(h), a = g = act(h) m;
//   gated: d = d gate = dg m up act'(gate), up = d up = dg m act(gate), m = g = act(gate) up m.
template <FfnActivation A, typename acc_t>
FF_ALWAYS_INLINE void backward_loop(Chunk<acc_t>& c, acc_t scale, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (A == FfnActivation::kRelu) {
      c.d[i] = c.a[i] <= acc_t(0) ? acc_t(0) : c.d[i] * scale;
    } else if constexpr (is_gated(A)) {
      const acc_t gate = c.a[i], up = c.up[i], m = c.m[i];
      const acc_t dm = c.d[i] * m, y = act<A>(gate);
      c.d[i] = dm * up * act_grad<A>(gate);
      c.up[i] = dm * y;
      c.m[i] = y * up * m;
    } else {
      const acc_t h = c.a[i], m = c.m[i];
      c.d[i] = c.d[i] * m * act_grad<A>(h);
      c.a[i] = act<A>(h) * m;
    }
  }
}

template <typename acc_t>
FF_ALWAYS_INLINE void forward_compute(FfnActivation act, Chunk<acc_t>& c, int64_t n) {
  switch (act) {
    case FfnActivation::kRelu: return forward_loop<FfnActivation::kRelu>(c, n);
    case FfnActivation::kGelu: return forward_loop<FfnActivation::kGelu>(c, n);
    case FfnActivation::kGeluTanh: return forward_loop<FfnActivation::kGeluTanh>(c, n);
    case FfnActivation::kSilu: return forward_loop<FfnActivation::kSilu>(c, n);
    case FfnActivation::kSwiglu: return forward_loop<FfnActivation::kSwiglu>(c, n);
    case FfnActivation::kGeglu: return forward_loop<FfnActivation::kGeglu>(c, n);
    default: return forward_loop<FfnActivation::kIdentity>(c, n);
  }
}

template <typename acc_t>
FF_ALWAYS_INLINE void backward_compute(FfnActivation act, Chunk<acc_t>& c, acc_t scale,
                                       int64_t n) {
  switch (act) {
    case FfnActivation::kRelu: return backward_loop<FfnActivation::kRelu>(c, scale, n);
    case FfnActivation::kGelu: return backward_loop<FfnActivation::kGelu>(c, scale, n);
    case FfnActivation::kGeluTanh: return backward_loop<FfnActivation::kGeluTanh>(c, scale, n);
    case FfnActivation::kSilu: return backward_loop<FfnActivation::kSilu>(c, scale, n);
    case FfnActivation::kSwiglu: return backward_loop<FfnActivation::kSwiglu>(c, scale, n);
    case FfnActivation::kGeglu: return backward_loop<FfnActivation::kGeglu>(c, scale, n);
    default: return backward_loop<FfnActivation::kIdentity>(c, scale, n);
  }
}

// The float instances, built per instruction set (FF_CPU_CLONES); double stays generic.
FF_CPU_CLONES void forward_compute_f32(FfnActivation act, Chunk<float>& c, int64_t n) {
  forward_compute(act, c, n);
}
FF_CPU_CLONES void backward_compute_f32(FfnActivation act, Chunk<float>& c, float scale,
                                        int64_t n) {
  backward_compute(act, c, scale, n);
}
void forward_compute_any(FfnActivation act, Chunk<float>& c, int64_t n) {
  forward_compute_f32(act, c, n);
}
void forward_compute_any(FfnActivation act, Chunk<double>& c, int64_t n) {
  forward_compute(act, c, n);
}
void backward_compute_any(FfnActivation act, Chunk<float>& c, float scale, int64_t n) {
  backward_compute_f32(act, c, scale, n);
}
void backward_compute_any(FfnActivation act, Chunk<double>& c, double scale, int64_t n) {
  backward_compute(act, c, scale, n);
}

// m = dropout multipliers of elements [offset, offset + n): 1/(1-p) kept, 0 dropped; 1 if p == 0.
template <typename acc_t>
void dropout_multipliers(acc_t* m, int64_t n, const Problem& pr, int64_t offset) {
  std::fill(m, m + n, acc_t(1));  // and 1 * scale is scale exactly
  if (pr.p != 0.f) {
    dropout_scale_cpu(m, n, pr.seed, static_cast<uint64_t>(offset), pr.p,
                      static_cast<acc_t>(pr.scale));
  }
}

// Everything one pass needs; pointers are contiguous row-major (see ffn.h).
template <typename scalar_t>
struct CpuPass {
  Problem pr;
  scalar_t* h;            // forward: read, bias-added in place when keep_h
  const scalar_t* b1;     // forward only, may be null
  const scalar_t* dg;     // backward only
  const scalar_t* saved;  // backward only: g (relu) or h
  scalar_t* g;            // forward: output; backward: recomputed g (not for relu)
  scalar_t* dh;           // backward only; may alias dg (non-gated)
  bool keep_h;            // forward: h is saved, so write the bias-added values back
};

template <typename scalar_t, typename acc_t>
void load(const scalar_t* src, acc_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<acc_t>(src[i]);
}

template <typename scalar_t, typename acc_t>
void store(const acc_t* src, scalar_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<scalar_t>(src[i]);
}

// bfloat16 <-> float with integer ops only, so they vectorize (c10::BFloat16's conversion
// branches on NaN): widening is a shift; narrowing rounds to nearest even, NaN -> quiet NaN.
FF_CPU_CLONES void widen_bf16(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::bit_cast<float>(uint32_t{src[i]} << 16);
}
FF_CPU_CLONES void narrow_bf16(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = c10::bit_cast<uint32_t>(src[i]);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    dst[i] = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
  }
}
template <>
void load(const c10::BFloat16* src, float* dst, int64_t n) {
  widen_bf16(reinterpret_cast<const uint16_t*>(src), dst, n);
}
template <>
void store(const float* src, c10::BFloat16* dst, int64_t n) {
  narrow_bf16(src, reinterpret_cast<uint16_t*>(dst), n);
}

// dst = src (+ bias) in acc_t; with write_back the sum is stored (rounded) and reloaded, so
// the backward later recomputes exactly what this forward used.
template <typename scalar_t, typename acc_t>
void load_biased(scalar_t* src, const scalar_t* bias, acc_t* dst, int64_t n, bool write_back) {
  if (bias == nullptr) {
    load(src, dst, n);
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t v =
        static_cast<scalar_t>(static_cast<acc_t>(src[i]) + static_cast<acc_t>(bias[i]));
    if (write_back) src[i] = v;
    dst[i] = static_cast<acc_t>(v);
  }
}

template <typename scalar_t>
void forward_rows(const CpuPass<scalar_t>& s, int64_t row_begin, int64_t row_end) {
  using acc_t = at::opmath_type<scalar_t>;
  const Problem& pr = s.pr;
  Chunk<acc_t> c;
  prefault_rows(s.g, pr.d_ff, row_begin, row_end);
  for (int64_t row = row_begin; row < row_end; ++row) {
    scalar_t* h_row = s.h + row * pr.width;
    for (int64_t c0 = 0; c0 < pr.d_ff; c0 += kChunk) {
      const int64_t n = std::min(kChunk, pr.d_ff - c0);
      load_biased(h_row + c0, s.b1 ? s.b1 + c0 : nullptr, c.a, n, s.keep_h);
      if (is_gated(pr.act)) {
        load_biased(h_row + pr.d_ff + c0, s.b1 ? s.b1 + pr.d_ff + c0 : nullptr, c.up, n,
                    s.keep_h);
      }
      dropout_multipliers(c.m, n, pr, row * pr.d_ff + c0);
      forward_compute_any(pr.act, c, n);
      store(c.a, s.g + row * pr.d_ff + c0, n);
    }
  }
}

// relu with dropout: a saved NaN is relu's NaN times the dropout multiplier, 0 where dropped,
// and NaN * 0 is NaN: passed by backward_loop, but torch's dropout passes no gradient there.
// Its keep decision is drawn again (NaN inputs only: rare, so scalar).
template <typename acc_t>
void relu_dropped_nans(Chunk<acc_t>& c, const Problem& pr, int64_t base, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (c.a[i] != c.a[i] && !dropout_keep(pr.seed, static_cast<uint64_t>(base + i), pr.p)) {
      c.d[i] = acc_t(0);
    }
  }
}

// Columns [c0, c0 + n) of one row: dh, and g recomputed for linear2's weight gradient
// (relu: dh only, g is what was saved).
template <typename scalar_t>
void backward_chunk(const CpuPass<scalar_t>& s, Chunk<at::opmath_type<scalar_t>>& c,
                    int64_t row, int64_t c0, int64_t n) {
  using acc_t = at::opmath_type<scalar_t>;
  const Problem& pr = s.pr;
  const int64_t base = row * pr.d_ff + c0;
  const int64_t h_base = row * pr.width + c0;
  load(s.dg + base, c.d, n);
  load(s.saved + h_base, c.a, n);
  if (is_gated(pr.act)) load(s.saved + h_base + pr.d_ff, c.up, n);
  if (pr.act != FfnActivation::kRelu) dropout_multipliers(c.m, n, pr, base);
  backward_compute_any(pr.act, c, static_cast<acc_t>(pr.scale), n);
  if (pr.act == FfnActivation::kRelu && pr.p != 0.f) relu_dropped_nans(c, pr, base, n);
  store(c.d, s.dh + h_base, n);
  if (pr.act == FfnActivation::kRelu) return;
  if (is_gated(pr.act)) {
    store(c.up, s.dh + h_base + pr.d_ff, n);
    store(c.m, s.g + base, n);
  } else {
    store(c.a, s.g + base, n);
  }
}

template <typename scalar_t>
void backward_rows(const CpuPass<scalar_t>& s, int64_t row_begin, int64_t row_end) {
  Chunk<at::opmath_type<scalar_t>> c;
  prefault_rows(s.g, s.pr.d_ff, row_begin, row_end);
  prefault_rows(s.dh, s.pr.width, row_begin, row_end);
  for (int64_t row = row_begin; row < row_end; ++row) {
    for (int64_t c0 = 0; c0 < s.pr.d_ff; c0 += kChunk) {
      backward_chunk(s, c, row, c0, std::min(kChunk, s.pr.d_ff - c0));
    }
  }
}

int64_t grain_rows(const Problem& pr) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, pr.width));
}

template <typename F>
void dispatch_cpu(const at::Tensor& x, F&& f) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "ffn_cpu",
                                  [&] { f(scalar_t{}); });
}

Forward ffn_forward_cpu(const at::Tensor& x, const at::Tensor& w1, const OptTensor& b1,
                        const at::Tensor& w2, const OptTensor& b2, c10::string_view activation,
                        double dropout_p, int64_t seed, bool /*fused_epilogue: CUDA only*/,
                        const OptTensor& device_seed) {
  device_seed_ptr(device_seed, x);  // refuses one: CPU kernels take the int
  const Problem pr = check_problem(x, w1, w2, activation, dropout_p, seed);
  check_bias(b1, pr.width, x, "b1");
  check_bias(b2, pr.d_out, x, "b2");
  // fp32/fp64: the bias joins in the fused pass. fp16/bf16: inside the GEMM, which adds it
  // before rounding h; adding it to an already rounded h cancels badly where x w1 ~ -b1 (the
  // sign of h, hence relu's mask, flips; measured beyond the parity bound).
  const bool bias_in_pass = b1.has_value() && at::isFloatingType(x.scalar_type()) &&
                            c10::elementSize(x.scalar_type()) >= 4;
  at::Tensor h = bias_in_pass ? at::mm(x, w1.t()) : affine(x, w1, b1);
  const bool relu = pr.act == FfnActivation::kRelu;
  // relu saves only g, so g overwrites h in place; the others keep h (bias added) for backward.
  at::Tensor g = relu ? h : at::empty({pr.tokens, pr.d_ff}, x.options());
  const at::Tensor bias = bias_in_pass ? b1->contiguous() : at::Tensor();
  dispatch_cpu(x, [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    const CpuPass<scalar_t> s{pr,
                              h.data_ptr<scalar_t>(),
                              bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr,
                              nullptr,
                              nullptr,
                              g.data_ptr<scalar_t>(),
                              nullptr,
                              !relu};
    at::parallel_for(0, pr.tokens, grain_rows(pr),
                     [&](int64_t begin, int64_t end) { forward_rows(s, begin, end); });
  });
  return {affine(g, w2, b2), relu ? g : h};
}

Backward ffn_backward_cpu(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& w1,
                          const at::Tensor& w2, const at::Tensor& saved_in,
                          c10::string_view activation, double dropout_p, int64_t seed,
                          const OptTensor& device_seed) {
  device_seed_ptr(device_seed, x);  // refuses one: CPU kernels take the int
  const Problem pr = check_problem(x, w1, w2, activation, dropout_p, seed);
  check_backward(pr, grad_out, x, saved_in);
  const at::Tensor saved = saved_in.contiguous();
  at::Tensor dg = at::mm(grad_out, w2);  // (tokens, d_ff), fresh: a non-gated dh overwrites it
  const bool relu = pr.act == FfnActivation::kRelu, gated = ffn_is_gated(pr.act);
  at::Tensor g = relu ? saved : at::empty({pr.tokens, pr.d_ff}, x.options());
  at::Tensor dh = gated ? at::empty({pr.tokens, pr.width}, x.options()) : dg;
  dispatch_cpu(x, [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    const CpuPass<scalar_t> s{pr,
                              nullptr,
                              nullptr,
                              dg.const_data_ptr<scalar_t>(),
                              saved.const_data_ptr<scalar_t>(),
                              relu ? nullptr : g.data_ptr<scalar_t>(),
                              dh.data_ptr<scalar_t>(),
                              false};
    at::parallel_for(0, pr.tokens, grain_rows(pr),
                     [&](int64_t begin, int64_t end) { backward_rows(s, begin, end); });
  });
  return {at::mm(dh, w1), at::mm(dh.t(), x), dh.sum(0), at::mm(grad_out.t(), g), grad_out.sum(0)};
}

// ------------------------------------------------------------------ CUDA glue

#ifdef FASTFORMER_WITH_CUDA
FfnDtype cuda_dtype(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kFloat: return FfnDtype::kFloat32;
    case at::kHalf: return FfnDtype::kFloat16;
    case at::kBFloat16: return FfnDtype::kBFloat16;
    default:
      TORCH_CHECK(false, "ffn: CUDA kernels take float32, float16 or bfloat16, got ",
                  x.scalar_type());
  }
}

// linear2's bias gradient: the column sums of grad_out (tokens, d_out) by the deterministic
// two-stage kernels of db1 (torch's grad_out.sum(0) took 25 us for 16384 x 512 bf16 on an
// H200, about 5x the time to read its 16 MB once).
at::Tensor column_sum_cuda(const at::Tensor& grad_out) {
  const at::Tensor src = grad_out.contiguous();
  const int64_t rows = src.size(0), cols = src.size(1);
  at::Tensor out = at::empty({cols}, src.options());
  at::Tensor partials =
      at::empty({ffn_bias_grad_row_blocks(rows), cols}, src.options().dtype(at::kFloat));
  const FfnColumnSumArgs args{src.const_data_ptr(), partials.data_ptr<float>(), out.data_ptr(),
                              rows, cols, cuda_dtype(src)};
  ffn_column_sum_cuda_launch(args, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// linear1 with relu / gelu_tanh inside cuBLASLt's epilogue (RELU_BIAS / GELU_BIAS; torch's
// _addmm_activation uses the tanh GELU, and falls back to addmm + activation when Lt cannot
// take the shape). It needs a bias vector: zeros when linear1 has none.
at::Tensor linear1_fused(const Problem& pr, const at::Tensor& x, const at::Tensor& w1,
                         const OptTensor& b1) {
  const at::Tensor bias = b1.has_value() ? *b1 : at::zeros({pr.width}, x.options());
  return at::_addmm_activation(bias, x, w1.t(), 1, 1,
                               /*use_gelu=*/pr.act == FfnActivation::kGeluTanh);
}

Forward ffn_forward_cuda(const at::Tensor& x, const at::Tensor& w1, const OptTensor& b1,
                         const at::Tensor& w2, const OptTensor& b2, c10::string_view activation,
                         double dropout_p, int64_t seed, bool fused_epilogue,
                         const OptTensor& device_seed) {
  const Problem pr = check_problem(x, w1, w2, activation, dropout_p, seed);
  check_bias(b1, pr.width, x, "b1");
  check_bias(b2, pr.d_out, x, "b2");
  const c10::cuda::CUDAGuard guard(x.device());
  const bool fused = fused_epilogue && (pr.act == FfnActivation::kRelu ||
                                        pr.act == FfnActivation::kGeluTanh);
  const bool relu = pr.act == FfnActivation::kRelu;
  at::Tensor h = fused ? linear1_fused(pr, x, w1, b1) : affine(x, w1, b1);
  TORCH_INTERNAL_ASSERT(h.is_contiguous(), "ffn: the kernels need a row-major linear1 output");
  // After a fused epilogue h already holds act(linear1(x)): only dropout is left, in place.
  at::Tensor g = (fused || relu) ? h : at::empty({pr.tokens, pr.d_ff}, x.options());
  if (!fused || pr.p > 0.f) {
    const FfnForwardArgs args{h.const_data_ptr(),
                              g.data_ptr(),
                              pr.tokens,
                              pr.d_ff,
                              pr.seed,
                              pr.p,
                              static_cast<float>(pr.scale),
                              fused ? FfnActivation::kIdentity : pr.act,
                              cuda_dtype(x),
                              device_seed_ptr(device_seed, x)};
    ffn_forward_cuda_launch(args, at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  at::Tensor saved = relu ? g : (fused ? at::empty({0}, x.options()) : h);
  return {affine(g, w2, b2), saved};
}

// The relu backward with dh and db1 from cuBLASLt's DRELU_BGRAD epilogue (ffn_lt.cpp), when
// FASTFORMER_FFN_DRELU=epilogue asks for it and it runs here; nullopt: take the kernel path.
std::optional<Backward> relu_backward_lt(const Problem& pr, const at::Tensor& grad_out,
                                         const at::Tensor& x, const at::Tensor& w1,
                                         const at::Tensor& w2, const at::Tensor& saved,
                                         const OptTensor& device_seed) {
  if (ffn_drelu_mode() != FfnDreluMode::kEpilogue) return std::nullopt;
  if (!w2.is_contiguous() || !grad_out.is_contiguous()) return std::nullopt;
  const float alpha = pr.p > 0.f ? static_cast<float>(pr.scale) : 1.f;
  auto dh_db1 = ffn_drelu_bgrad_lt(grad_out, w2, saved, cuda_dtype(x), alpha, pr.p, pr.seed,
                                   device_seed_ptr(device_seed, x));
  if (!dh_db1) return std::nullopt;
  auto& [dh, db1] = *dh_db1;
  at::Tensor dw2 = at::mm(grad_out.t(), saved);
  at::Tensor dx = at::mm(dh, w1), dw1 = at::mm(dh.t(), x);
  return Backward{dx, dw1, db1, dw2, column_sum_cuda(grad_out)};
}

Backward ffn_backward_cuda(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& w1,
                           const at::Tensor& w2, const at::Tensor& saved_in,
                           c10::string_view activation, double dropout_p, int64_t seed,
                           const OptTensor& device_seed) {
  const Problem pr = check_problem(x, w1, w2, activation, dropout_p, seed);
  check_backward(pr, grad_out, x, saved_in);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor saved = saved_in.contiguous();
  const bool relu = pr.act == FfnActivation::kRelu, gated = ffn_is_gated(pr.act);
  if (relu) {
    if (auto done = relu_backward_lt(pr, grad_out, x, w1, w2, saved, device_seed)) return *done;
  }
  at::Tensor dg = at::mm(grad_out, w2);
  at::Tensor g = relu ? saved : at::empty({pr.tokens, pr.d_ff}, x.options());
  // A non-gated dh overwrites dg, as on CPU: one (tokens, d_ff) buffer fewer at the peak, which
  // is then no higher than eager autograd's (lower for relu, which saves its output only).
  at::Tensor dh = gated ? at::empty({pr.tokens, pr.width}, x.options()) : dg;
  at::Tensor db1 = at::empty({pr.width}, x.options());
  at::Tensor partials =
      at::empty({ffn_bias_grad_row_blocks(pr.tokens), pr.width}, x.options().dtype(at::kFloat));
  const FfnBackwardArgs args{dg.const_data_ptr(),
                             saved.const_data_ptr(),
                             dh.data_ptr(),
                             relu ? nullptr : g.data_ptr(),
                             partials.data_ptr<float>(),
                             db1.data_ptr(),
                             pr.tokens,
                             pr.d_ff,
                             pr.seed,
                             pr.p,
                             static_cast<float>(pr.scale),
                             pr.act,
                             cuda_dtype(x),
                             device_seed_ptr(device_seed, x)};
  // kIdentity (activation fused into the GEMM) is an inference-only forward: its backward
  // kernel does not exist, and db1 would be summed from unwritten partials.
  TORCH_INTERNAL_ASSERT(pr.act != FfnActivation::kIdentity, "ffn backward without an activation");
  ffn_backward_cuda_launch(args, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // Free what the GEMMs no longer need before they allocate their outputs: dg (gated; a
  // non-gated dh is dg), the partials, a recomputed g once dw2 is taken from it. The caching
  // allocator hands a freed block out again on this stream only, after the queued kernels.
  dg.reset();
  partials.reset();
  at::Tensor dw2 = at::mm(grad_out.t(), g);
  g.reset();
  at::Tensor dx = at::mm(dh, w1), dw1 = at::mm(dh.t(), x);
  return {dx, dw1, db1, dw2, column_sum_cuda(grad_out)};
}
#endif

// ------------------------------------------------------------------ registered ops
//
// The registered ops take x as (..., d_model) and grad_out as (..., d_out), the shapes callers
// hold: a (B, L, D) input then needs no reshape and view around the op (two more autograd nodes
// in an eager call, host time). The implementations above work on (tokens, features) matrices.

// (tokens, n): the leading dims' product, not -1, which a last dim of 0 leaves undetermined.
at::Tensor as_rows(const at::Tensor& t) {
  if (t.dim() == 2) return t;
  const auto sizes = t.sizes();
  const int64_t rows = c10::multiply_integers(sizes.begin(), sizes.end() - 1);
  return t.reshape({rows, t.size(-1)});
}

// `rows` (tokens, n) with the leading dims of `like`. Not a view: autograd lets callers change
// the op's output in place, as any op's.
at::Tensor with_lead(const at::Tensor& rows, const at::Tensor& like) {
  if (like.dim() == 2) return rows;
  std::vector<int64_t> shape(like.sizes().begin(), like.sizes().end() - 1);
  shape.push_back(rows.size(1));
  return at::_unsafe_view(rows, shape);
}

void check_rank(const at::Tensor& t, const char* name, const char* last) {
  TORCH_CHECK(t.dim() >= 1, "ffn: ", name, " must be (..., ", last, "), got a 0-d tensor");
}

// The ops compute in their inputs' dtypes: autocast, when on, must not reach the GEMMs they
// call through the dispatcher (at::mm of float32 operands would return bfloat16 there, which
// the fused passes refuse; the module door casts the inputs as torch.nn would beforehand).
template <auto Impl>
Forward forward_op(const at::Tensor& x, const at::Tensor& w1, const OptTensor& b1,
                   const at::Tensor& w2, const OptTensor& b2, c10::string_view activation,
                   double dropout_p, int64_t seed, bool fused_epilogue,
                   const OptTensor& device_seed) {
  check_rank(x, "x", "d_model");
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  auto [out, saved] = Impl(as_rows(x), w1, b1, w2, b2, activation, dropout_p, seed,
                           fused_epilogue, device_seed);
  return {with_lead(out, x), saved};
}

template <auto Impl>
Backward backward_op(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& w1,
                     const at::Tensor& w2, const at::Tensor& saved, c10::string_view activation,
                     double dropout_p, int64_t seed, const OptTensor& device_seed) {
  check_rank(x, "x", "d_model");
  check_rank(grad_out, "grad_out", "d_out");
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  auto [dx, dw1, db1, dw2, db2] = Impl(as_rows(grad_out), as_rows(x), w1, w2, saved, activation,
                                       dropout_p, seed, device_seed);
  return {with_lead(dx, x), dw1, db1, dw2, db2};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastformer, m) {
  m.def(
      "ffn_forward(Tensor x, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, str activation, "
      "float dropout_p, int seed, bool fused_epilogue=False, Tensor? device_seed=None) "
      "-> (Tensor, Tensor)");
  m.def(
      "ffn_backward(Tensor grad_out, Tensor x, Tensor w1, Tensor w2, Tensor saved, "
      "str activation, float dropout_p, int seed, Tensor? device_seed=None) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastformer, CPU, m) {
  m.impl("ffn_forward", &forward_op<ffn_forward_cpu>);
  m.impl("ffn_backward", &backward_op<ffn_backward_cpu>);
}

#ifdef FASTFORMER_WITH_CUDA
TORCH_LIBRARY_IMPL(fastformer, CUDA, m) {
  m.impl("ffn_forward", &forward_op<ffn_forward_cuda>);
  m.impl("ffn_backward", &backward_op<ffn_backward_cuda>);
}
#endif

}  // namespace fastformer
