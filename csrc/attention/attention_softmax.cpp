// torch.ops.fastformer.attention_softmax_ / attention_softmax_backward_ (CPU): the softmax of
// fastformer.ops.attention's torch backend, with its dropout, in one pass over each row of the
// (B, H, Lq, Lk) scores. The forward had been a max, torch's softmax, a second max for the
// log-sum-exp and the dropout pass; the backward a softmax, the dropout pass and four more
// elementwise passes for dS = P * (dP - rowsum(P * dP) + dlse). Here a row is read from memory
// once and each pass after the first runs in L1.
#include <ATen/ATen.h>
#include <c10/util/bit_cast.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>

#include "common/expf.h"
#include "rng/keep_mask.h"

namespace fastformer {

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && __GNUC__ >= 11
#define FF_SOFTMAX_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define FF_SOFTMAX_INLINE inline __attribute__((always_inline))
#else
#define FF_SOFTMAX_CLONES
#define FF_SOFTMAX_INLINE inline
#endif

namespace {

// Loops run kLanes independent lanes (accumulators included), which the compiler turns into
// vector code in each clone; a sum is then added up in a fixed order (deterministic).
constexpr int64_t kLanes = 16;

// exp(x) for x <= 0 or NaN (a score minus its row's max), 0 below -87 (a probability below
// 1.6e-38 of the row's largest, which is >= 1 / Lk; a masked key's -inf gives exactly 0).
// float: Cephes' polynomial (common/expf.h), within 2 ulp; double: std::exp.
FF_SOFTMAX_INLINE float exp_nonpositive(float x) {
  const bool under = x < -87.0f;
  float n;
  const float p = expf_reduced(under ? -87.0f : x, n);  // n in [-126, 0]: 2^n is normal
  return under ? 0.0f : p * c10::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

FF_SOFTMAX_INLINE double exp_nonpositive(double x) { return std::exp(x); }

template <typename T>
FF_SOFTMAX_INLINE T lane_sum(const T* acc) {
  T s = 0;
  for (int64_t l = 0; l < kLanes; ++l) s += acc[l];
  return s;
}

// The row's maximum, NaN left out: a NaN then makes its row NaN through exp_nonpositive, except
// in a row whose other scores are -inf (`row_has_nan`).
template <typename T>
FF_SOFTMAX_INLINE T row_max(const T* s, int64_t n) {
  constexpr T kLow = -std::numeric_limits<T>::infinity();
  T acc[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) acc[l] = kLow;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) acc[l] = s[j + l] > acc[l] ? s[j + l] : acc[l];
  }
  for (; j < n; ++j) acc[0] = s[j] > acc[0] ? s[j] : acc[0];
  T m = kLow;
  for (int64_t l = 0; l < kLanes; ++l) m = acc[l] > m ? acc[l] : m;
  return m;
}

template <typename T>
bool row_has_nan(const T* s, int64_t n) {
  return std::any_of(s, s + n, [](T x) { return x != x; });
}

// A row whose maximum (row_max) is -inf: P = 0 (no key) as in the reference's safe softmax, or
// NaN where a score is NaN, as torch's softmax; returns that value.
template <typename T>
T fill_keyless_row(T* s, int64_t n) {
  const T value = row_has_nan(s, n) ? std::numeric_limits<T>::quiet_NaN() : T(0);
  std::fill(s, s + n, value);
  return value;
}

// e[j] = exp(s[j] - mx) (e may be s); returns their sum.
template <typename T>
FF_SOFTMAX_INLINE T exp_row(const T* s, T* e, int64_t n, T mx) {
  T acc[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) {
      const T v = exp_nonpositive(s[j + l] - mx);
      e[j + l] = v;
      acc[l] += v;
    }
  }
  for (; j < n; ++j) {
    const T v = exp_nonpositive(s[j] - mx);
    e[j] = v;
    acc[0] += v;
  }
  return lane_sum(acc);
}

// A row's dropout multipliers: at(j) = scale where column j is kept (its 16-bit draw >= t),
// else 0.
template <typename T>
struct Drop {
  const uint16_t* halves;
  uint32_t t;
  T scale;
  FF_SOFTMAX_INLINE T at(int64_t j) const { return halves[j] >= t ? scale : T(0); }
};

// Row s of scores in place: P = softmax(s), times m (the dropout multipliers, scale or 0) where
// kDrop; returns the log-sum-exp. A row with no key (all -inf) gives 0 and -inf, as the
// reference's safe softmax. Products, as torch's dropout: a dropped NaN stays NaN.
template <typename T, bool kDrop>
FF_SOFTMAX_INLINE T softmax_row(T* s, int64_t n, Drop<T> m) {
  const T mx = row_max(s, n);
  if (mx == -std::numeric_limits<T>::infinity()) {
    return fill_keyless_row(s, n) == T(0) ? mx : std::numeric_limits<T>::quiet_NaN();
  }
  const T sum = exp_row(s, s, n, mx);
  const T inv = T(1) / sum;
  for (int64_t j = 0; j < n; ++j) s[j] = kDrop ? s[j] * inv * m.at(j) : s[j] * inv;
  return mx + std::log(sum);
}

// Element j of softmax_backward_row's first pass: P = e * inv, dP = g * m; s = P * m, g = dP;
// returns P * dP. (A function, not a lambda: a lambda cannot be made always_inline, and code
// not inlined into a clone is not built for its instruction set.)
template <typename T, bool kDrop>
FF_SOFTMAX_INLINE T drop_step(int64_t j, T* s, T* g, Drop<T> m, const T* e, T inv) {
  const T p = e[j] * inv;
  const T mj = kDrop ? m.at(j) : T(1);
  const T dp = kDrop ? g[j] * mj : g[j];
  s[j] = kDrop ? p * mj : p;
  g[j] = dp;
  return p * dp;
}

// Row s of scores and g = dO V^T (the gradient of the dropped probabilities) in place:
// s = P * m and g = dS = P * (dP - rowsum(P * dP) + dlse), with dP = g * m (m = 1 without
// kDrop); e: n values of scratch. A row with no key gets P = 0 and dS = 0.
template <typename T, bool kDrop>
FF_SOFTMAX_INLINE void softmax_backward_row(T* s, T* g, int64_t n, Drop<T> m, T dlse, T* e) {
  const T mx = row_max(s, n);
  if (mx == -std::numeric_limits<T>::infinity()) {
    std::fill(g, g + n, fill_keyless_row(s, n));
    return;
  }
  const T inv = T(1) / exp_row(s, e, n, mx);
  T acc[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) acc[l] += drop_step<T, kDrop>(j + l, s, g, m, e, inv);
  }
  for (; j < n; ++j) acc[0] += drop_step<T, kDrop>(j, s, g, m, e, inv);
  // dP - rowsum first, then dlse: in a row whose P is nearly one-hot, dP - rowsum is nearly
  // exact, where dP - (rowsum - dlse) rounded dlse to the ulp of dP (which dropout's 1 / (1 - p)
  // scales up): float32 dS missed the parity bound by up to 4.5x in a fuzz (p 0.9, Lk 1).
  const T row = lane_sum(acc);
  for (j = 0; j < n; ++j) g[j] = (g[j] - row + dlse) * (e[j] * inv);
}

// The row kernels per dtype (overloads: a template cannot be cloned), the float ones cloned
// per instruction set; m.halves null: no dropout.
FF_SOFTMAX_CLONES float softmax_row_of(float* s, int64_t n, Drop<float> m) {
  return m.halves ? softmax_row<float, true>(s, n, m) : softmax_row<float, false>(s, n, m);
}
double softmax_row_of(double* s, int64_t n, Drop<double> m) {
  return m.halves ? softmax_row<double, true>(s, n, m) : softmax_row<double, false>(s, n, m);
}
FF_SOFTMAX_CLONES void softmax_backward_row_of(float* s, float* g, int64_t n, Drop<float> m,
                                               float dlse, float* e) {
  if (m.halves) {
    softmax_backward_row<float, true>(s, g, n, m, dlse, e);
  } else {
    softmax_backward_row<float, false>(s, g, n, m, dlse, e);
  }
}
void softmax_backward_row_of(double* s, double* g, int64_t n, Drop<double> m, double dlse,
                             double* e) {
  if (m.halves) {
    softmax_backward_row<double, true>(s, g, n, m, dlse, e);
  } else {
    softmax_backward_row<double, false>(s, g, n, m, dlse, e);
  }
}

// Checks an op's (B, H, Lq, Lk) scores and its other tensors: contiguous CPU tensors of the
// scores' dtype, float32 or float64, of `rows`'s shape (B, H, Lq) or of the scores' shape.
void check_tensors(const char* op, const at::Tensor& scores,
                   std::initializer_list<const at::Tensor*> rows,
                   std::initializer_list<const at::Tensor*> full) {
  TORCH_CHECK(scores.dim() == 4, op, ": scores must be (B, H, Lq, Lk), got ", scores.sizes());
  TORCH_CHECK(scores.scalar_type() == at::kFloat || scores.scalar_type() == at::kDouble, op,
              ": scores must be float32 or float64, got ", scores.scalar_type());
  TORCH_CHECK(scores.is_contiguous() && scores.device().is_cpu(), op,
              ": scores must be a contiguous CPU tensor");
  const auto row_shape = scores.sizes().slice(0, 3);
  for (const auto& [tensors, shape, what] :
       {std::tuple{rows, row_shape, "(B, H, Lq)"}, std::tuple{full, scores.sizes(), "scores's"}}) {
    for (const at::Tensor* t : tensors) {
      if (t == nullptr) continue;
      TORCH_CHECK(t->sizes() == shape && t->scalar_type() == scores.scalar_type() &&
                      t->is_contiguous() && t->device().is_cpu(),
                  op, ": expected a contiguous CPU tensor of shape ", what, " and dtype ",
                  scores.scalar_type(), ", got ", t->sizes(), " ", t->scalar_type());
    }
  }
}

// Dropout arguments: threshold 0 is no dropout (every key kept), where scale must be 1.
bool check_dropout(const char* op, int64_t threshold, double scale) {
  check_threshold(threshold, op);
  TORCH_CHECK(threshold > 0 || scale == 1.0, op, ": scale must be 1 without dropout, got ",
              scale);
  return threshold > 0;
}

// Runs row_fn(r, m, scratch) over the rows of (B, H, Lq, Lk) scores in parallel, m the row's
// dropout multipliers (null halves without dropout), scratch kScratch rows of seq_k values.
template <typename T, int kScratch, typename RowFn>
void for_each_row(const at::Tensor& scores, int64_t seed, int64_t threshold, double scale,
                  bool drop, RowFn row_fn) {
  const int64_t seq_q = scores.size(2), seq_k = scores.size(3);
  const int64_t rows = seq_k == 0 ? 0 : scores.numel() / seq_k;
  const int64_t calls = dropout_calls(seq_k);
  const auto t = static_cast<uint32_t>(threshold);
  const auto c = static_cast<T>(scale);
  for_each_keep_row<T, kScratch>(
      static_cast<uint64_t>(seed), rows, seq_k,
      [&](int64_t r) { return attention_row_counter(r, seq_q, calls); },
      [&](int64_t r, const uint16_t* halves, T* scratch) {
        row_fn(r, Drop<T>{drop ? halves : nullptr, t, c}, scratch);
      },
      drop);
}

// scores (B, H, Lq, Lk) in place: softmax over Lk, then dropout (threshold = round(p * 65536),
// scale = 1 / (1 - p); the keep-mask of fastformer.ops.attention.dropout_keep_mask(seed, ...));
// lse (B, H, Lq) = the log-sum-exp of each row before dropout.
void attention_softmax_cpu(const at::Tensor& scores, const at::Tensor& lse, int64_t seed,
                           int64_t threshold, double scale) {
  constexpr const char* op = "attention_softmax_";
  check_tensors(op, scores, {&lse}, {});
  const bool drop = check_dropout(op, threshold, scale);
  const int64_t seq_k = scores.size(3);
  AT_DISPATCH_FLOATING_TYPES(scores.scalar_type(), op, [&] {
    scalar_t* s = scores.data_ptr<scalar_t>();
    scalar_t* l = lse.data_ptr<scalar_t>();
    for_each_row<scalar_t, 0>(scores, seed, threshold, scale, drop,
                              [&](int64_t r, Drop<scalar_t> m, scalar_t*) {
                                l[r] = softmax_row_of(s + r * seq_k, seq_k, m);
                              });
  });
}

// The backward of attention_softmax_ and of the product with V, given scores (B, H, Lq, Lk) as
// the forward took them and grad = dO V^T, in place: scores = P * K * scale (the dropped
// probabilities, for dV), grad = dS (the scores' gradient); grad_lse (B, H, Lq), if given, is
// the log-sum-exp's gradient.
void attention_softmax_backward_cpu(const at::Tensor& scores, const at::Tensor& grad,
                                    const std::optional<at::Tensor>& grad_lse, int64_t seed,
                                    int64_t threshold, double scale) {
  constexpr const char* op = "attention_softmax_backward_";
  check_tensors(op, scores, {grad_lse ? &*grad_lse : nullptr}, {&grad});
  const bool drop = check_dropout(op, threshold, scale);
  const int64_t seq_k = scores.size(3);
  AT_DISPATCH_FLOATING_TYPES(scores.scalar_type(), op, [&] {
    scalar_t* s = scores.data_ptr<scalar_t>();
    scalar_t* g = grad.data_ptr<scalar_t>();
    const scalar_t* dlse = grad_lse ? grad_lse->const_data_ptr<scalar_t>() : nullptr;
    for_each_row<scalar_t, 1>(
        scores, seed, threshold, scale, drop, [&](int64_t r, Drop<scalar_t> m, scalar_t* e) {
          const int64_t at = r * seq_k;
          softmax_backward_row_of(s + at, g + at, seq_k, m, dlse ? dlse[r] : scalar_t(0), e);
        });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fastformer, CPU, m) {
  m.impl("attention_softmax_", &attention_softmax_cpu);
  m.impl("attention_softmax_backward_", &attention_softmax_backward_cpu);
}

}  // namespace fastformer
