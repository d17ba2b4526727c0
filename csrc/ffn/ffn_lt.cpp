// The relu FFN's backward through cuBLASLt's DRELU_BGRAD epilogue, and the FASTFORMER_FFN_DRELU
// switch (ffn_lt.h).
//
// Why: on an H200 (2026-12-04) the bf16 16384 x 512 -> 2048 relu FFN took 0.386 ms forward +
// backward against 0.333 ms for its bare GEMMs; the backward's elementwise pass (read dg and the
// saved g, write dh, sum db1: 192 MB) took 54 us in the 2026-11-29 H200 profile: about the
// whole difference. Here the dgrad GEMM applies relu's derivative and sums db1 in its epilogue
// and writes dh itself; what it needs is relu's bitmask, 1/16 of g, made from g by
// ffn_relu_mask_kernel (one read of g).
//
// The GEMMs are column-major to cuBLASLt: a row-major (rows, cols) matrix is a column-major
// (cols, rows) one with the same leading dimension, so dh^T (d_ff, tokens) = w2^T (d_ff, d_out)
// @ grad_out^T (d_out, tokens) with no transposes, and db1 is the bias gradient of D's rows.
#include "ffn/ffn_lt.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>

#ifdef FASTFORMER_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <cublasLt.h>

#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <vector>

#include "ffn/ffn.h"
#endif

namespace fastformer {

constexpr const char* kDreluEnv = "FASTFORMER_FFN_DRELU";

FfnDreluMode ffn_drelu_mode() {
  const char* raw = std::getenv(kDreluEnv);
  std::string value = raw != nullptr ? raw : "";
  value.erase(0, value.find_first_not_of(" \t\n"));
  value.erase(value.find_last_not_of(" \t\n") + 1);
  std::transform(value.begin(), value.end(), value.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (value.empty() || value == "kernel") return FfnDreluMode::kKernel;
  if (value == "epilogue") return FfnDreluMode::kEpilogue;
  TORCH_CHECK_VALUE(false, kDreluEnv, " must be one of ('kernel', 'epilogue'), got '", raw, "'");
}

std::string ffn_drelu_mode_name() {
  return ffn_drelu_mode() == FfnDreluMode::kEpilogue ? "epilogue" : "kernel";
}

#ifdef FASTFORMER_WITH_CUDA
namespace {

constexpr uint64_t kMaxWorkspace = 32 << 20;  // what cuBLASLt may ask for; each call takes its own

// D (m, n) = epilogue(alpha * A (m, k) @ B (k, n)), column-major, leading dimensions m, k and m.
struct LtGemm {
  int64_t m, n, k;
  const void* a;
  const void* b;
  void* d;
  cudaDataType_t type;
  cublasLtEpilogue_t epilogue;
  void* bias = nullptr;  // the bias gradient, with a BGRAD epilogue
  void* aux = nullptr;   // the relu bitmask
  int64_t aux_ld = 0;    // in bits
  float alpha = 1.f;
};

bool ok(cublasStatus_t status) { return status == CUBLAS_STATUS_SUCCESS; }

template <typename H>
using Owned = std::unique_ptr<std::remove_pointer_t<H>, cublasStatus_t (*)(H)>;

struct Described {
  Owned<cublasLtMatmulDesc_t> desc{nullptr, &cublasLtMatmulDescDestroy};
  Owned<cublasLtMatrixLayout_t> a{nullptr, &cublasLtMatrixLayoutDestroy};
  Owned<cublasLtMatrixLayout_t> b{nullptr, &cublasLtMatrixLayoutDestroy};
  Owned<cublasLtMatrixLayout_t> d{nullptr, &cublasLtMatrixLayoutDestroy};
};

template <typename V>
bool set(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const V& value) {
  return ok(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)));
}

Owned<cublasLtMatrixLayout_t> layout(cudaDataType_t type, int64_t rows, int64_t cols) {
  cublasLtMatrixLayout_t l = nullptr;
  if (!ok(cublasLtMatrixLayoutCreate(&l, type, rows, cols, rows))) l = nullptr;
  return {l, &cublasLtMatrixLayoutDestroy};
}

std::optional<Described> describe(const LtGemm& g) {
  cublasLtMatmulDesc_t raw = nullptr;
  if (!ok(cublasLtMatmulDescCreate(&raw, CUBLAS_COMPUTE_32F, CUDA_R_32F))) return std::nullopt;
  Described out;
  out.desc.reset(raw);
  bool good = set(raw, CUBLASLT_MATMUL_DESC_EPILOGUE, static_cast<uint32_t>(g.epilogue));
  if (g.bias != nullptr) good = good && set(raw, CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
  if (g.aux != nullptr) {
    good = good && set(raw, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux) &&
           set(raw, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, g.aux_ld);
  }
  out.a = layout(g.type, g.m, g.k);
  out.b = layout(g.type, g.k, g.n);
  out.d = layout(g.type, g.m, g.n);
  if (!good || !out.a || !out.b || !out.d) return std::nullopt;
  return out;
}

// The largest power of two (up to 256) that divides the address: what the heuristic reads from
// each pointer, so one plan serves every call with the same shape and alignments.
int alignment(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  int a = 1;
  while (a < 256 && address % (2 * a) == 0) a *= 2;
  return a;
}

struct Plan {
  cublasLtMatmulAlgo_t algo;
  size_t workspace;
};

using PlanKey = std::tuple<int, int64_t, int64_t, int64_t, int, int, int, int, int, int, int>;

std::optional<Plan> ask_heuristic(const LtGemm& g, const Described& ds, cublasLtHandle_t handle) {
  cublasLtMatmulPreference_t raw = nullptr;
  if (!ok(cublasLtMatmulPreferenceCreate(&raw))) return std::nullopt;
  const Owned<cublasLtMatmulPreference_t> pref{raw, &cublasLtMatmulPreferenceDestroy};
  const auto set_pref = [&](cublasLtMatmulPreferenceAttributes_t attr, auto value) {
    return ok(cublasLtMatmulPreferenceSetAttribute(raw, attr, &value, sizeof(value)));
  };
  if (!set_pref(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, kMaxWorkspace) ||
      !set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, uint32_t(alignment(g.a))) ||
      !set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, uint32_t(alignment(g.b))) ||
      !set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, uint32_t(alignment(g.d))) ||
      !set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, uint32_t(alignment(g.d)))) {
    return std::nullopt;
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  if (!ok(cublasLtMatmulAlgoGetHeuristic(handle, ds.desc.get(), ds.a.get(), ds.b.get(),
                                         ds.d.get(), ds.d.get(), raw, 1, &result, &found)) ||
      found == 0 || !ok(result.state)) {
    return std::nullopt;
  }
  return Plan{result.algo, result.workspaceSize};
}

// cuBLASLt's first algorithm for the GEMM, remembered (refusals too) per device, shape, dtype,
// epilogue and alignments: the heuristic costs tens of microseconds of host time a call.
std::optional<Plan> plan_for(const LtGemm& g, const Described& ds, cublasLtHandle_t handle) {
  static std::mutex mutex;
  static std::map<PlanKey, std::optional<Plan>> plans;
  int device = 0;
  cudaGetDevice(&device);
  const PlanKey key{device,        g.m,           g.n,
                    g.k,           int(g.type),   int(g.epilogue),
                    alignment(g.a), alignment(g.b), alignment(g.d),
                    alignment(g.bias), alignment(g.aux)};
  const std::lock_guard<std::mutex> lock(mutex);
  const auto it = plans.find(key);
  if (it != plans.end()) return it->second;
  return plans.emplace(key, ask_heuristic(g, ds, handle)).first->second;
}

// A planned GEMM: run() launches it on the current stream. prepare() is nullopt where cuBLASLt
// offers no algorithm.
struct Prepared {
  LtGemm gemm;
  Described ds;
  Plan plan;
  cublasLtHandle_t handle;

  bool run(const at::TensorOptions& device) const {
    const at::Tensor workspace =
        at::empty({static_cast<int64_t>(std::max<size_t>(plan.workspace, 1))},
                  device.dtype(at::kByte));
    const float beta = 0.f;
    return ok(cublasLtMatmul(handle, ds.desc.get(), &gemm.alpha, gemm.a, ds.a.get(), gemm.b,
                             ds.b.get(), &beta, gemm.d, ds.d.get(), gemm.d, ds.d.get(),
                             &plan.algo, workspace.data_ptr(), plan.workspace,
                             at::cuda::getCurrentCUDAStream()));
  }
};

std::optional<Prepared> prepare(const LtGemm& g) {
  std::optional<Described> ds = describe(g);
  if (!ds) return std::nullopt;
  const cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  const std::optional<Plan> plan = plan_for(g, *ds, handle);
  if (!plan) return std::nullopt;
  return Prepared{g, std::move(*ds), *plan, handle};
}

std::optional<cudaDataType_t> lt_type(FfnDtype t) {
  if (t == FfnDtype::kBFloat16) return CUDA_R_16BF;
  if (t == FfnDtype::kFloat16) return CUDA_R_16F;
  return std::nullopt;  // float32 stays on at::mm, which follows torch's TF32 setting
}

void launch_relu_mask(const at::Tensor& saved, at::Tensor& mask, FfnDtype dtype, float p,
                      uint64_t seed, const int64_t* seed_ptr) {
  const FfnReluMaskArgs args{saved.const_data_ptr(), static_cast<uint32_t*>(mask.data_ptr()),
                             saved.size(0),          saved.size(1),
                             seed,                   p,
                             dtype,                  seed_ptr};
  ffn_relu_mask_cuda_launch(args, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ±1 in an irregular pattern (a linear congruential generator's top bit): any misplaced bit of
// the layout check shows.
std::vector<float> signs(int64_t count, uint32_t state) {
  std::vector<float> out(count);
  for (float& v : out) {
    state = state * 1664525u + 1013904223u;
    v = (state >> 31) != 0 ? 1.f : -1.f;
  }
  return out;
}

// Element (row, col) of a bitmask in ffn.h's layout (int32 words, CPU).
bool bit(const at::Tensor& words, int64_t row, int64_t col) {
  const int32_t word = words.const_data_ptr<int32_t>()[row * words.size(1) + col / 32];
  return ((static_cast<uint32_t>(word) >> (col % 32)) & 1u) != 0;
}

}  // namespace

std::optional<FfnReluMaskSample> ffn_relu_mask_layout_sample() {
  constexpr int64_t kDff = 376, kTokens = 8, kK = 8;  // 16-byte aligned columns everywhere
  const auto device = at::TensorOptions().device(at::kCUDA, at::cuda::current_device());
  const auto host = at::TensorOptions().dtype(at::kFloat);
  at::Tensor a = at::zeros({kK, kDff}, host), b = at::zeros({kTokens, kK}, host);
  a[0].copy_(at::tensor(signs(kDff, 12345u), host));  // a's column 0, column-major
  b.select(1, 0).copy_(at::tensor(signs(kTokens, 777u), host));  // b's row 0
  a = a.to(device.dtype(at::kBFloat16));
  b = b.to(device.dtype(at::kBFloat16));
  const int64_t words = ffn_relu_mask_words(kDff);
  at::Tensor d = at::empty({kTokens, kDff}, device.dtype(at::kBFloat16));
  at::Tensor theirs = at::zeros({kTokens, words}, device.dtype(at::kInt));
  at::Tensor ours = at::empty({kTokens, words}, device.dtype(at::kInt));
  const LtGemm g{kDff, kTokens, kK, a.const_data_ptr(), b.const_data_ptr(), d.data_ptr(),
                 CUDA_R_16BF, CUBLASLT_EPILOGUE_RELU_AUX, nullptr, theirs.data_ptr(), words * 32};
  const std::optional<Prepared> gemm = prepare(g);
  if (!gemm || !gemm->run(device)) return std::nullopt;
  launch_relu_mask(d, ours, FfnDtype::kBFloat16, 0.f, 0, nullptr);
  return FfnReluMaskSample{theirs.cpu(), ours.cpu(), kDff};
}

namespace {

// The sample's bits agree below d_ff, and are not all alike (the signs are mixed).
bool mask_layout_matches() {
  const std::optional<FfnReluMaskSample> sample = ffn_relu_mask_layout_sample();
  if (!sample) return false;
  bool any_set = false, any_clear = false;
  for (int64_t row = 0; row < sample->ours.size(0); ++row) {
    for (int64_t col = 0; col < sample->d_ff; ++col) {
      const bool mine = bit(sample->ours, row, col);
      if (mine != bit(sample->theirs, row, col)) return false;
      (mine ? any_set : any_clear) = true;
    }
  }
  return any_set && any_clear;
}

}  // namespace

bool ffn_relu_mask_layout_ok() {
  static std::mutex mutex;
  static std::map<int, bool> checked;  // device -> verdict
  const int device = at::cuda::current_device();
  {
    const std::lock_guard<std::mutex> lock(mutex);
    const auto it = checked.find(device);
    if (it != checked.end()) return it->second;
  }
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(at::cuda::getCurrentCUDAStream(), &capture) != cudaSuccess ||
      capture != cudaStreamCaptureStatusNone) {
    return false;  // (the check copies to the host: it waits for a call outside capture)
  }
  const bool verdict = mask_layout_matches();
  const std::lock_guard<std::mutex> lock(mutex);
  checked.emplace(device, verdict);
  return verdict;
}

std::optional<std::pair<at::Tensor, at::Tensor>> ffn_drelu_bgrad_lt(
    const at::Tensor& grad_out, const at::Tensor& w2, const at::Tensor& saved, FfnDtype dtype,
    float alpha, float dropout_p, uint64_t seed, const int64_t* seed_ptr) {
  const auto type = lt_type(dtype);
  const int64_t tokens = saved.size(0), d_ff = saved.size(1), d_out = grad_out.size(1);
  if (!type || tokens == 0 || d_ff == 0 || d_out == 0 || !ffn_relu_mask_layout_ok()) {
    return std::nullopt;
  }
  const int64_t words = ffn_relu_mask_words(d_ff);
  at::Tensor mask = at::empty({tokens, words}, saved.options().dtype(at::kInt));
  at::Tensor dh = at::empty({tokens, d_ff}, saved.options());
  at::Tensor db1 = at::empty({d_ff}, saved.options());
  const LtGemm g{d_ff,        tokens,
                 d_out,       w2.const_data_ptr(),
                 grad_out.const_data_ptr(), dh.data_ptr(),
                 *type,       CUBLASLT_EPILOGUE_DRELU_BGRAD,
                 db1.data_ptr(), mask.data_ptr(),
                 words * 32,  alpha};
  const std::optional<Prepared> gemm = prepare(g);
  if (!gemm) return std::nullopt;
  launch_relu_mask(saved, mask, dtype, dropout_p, seed, seed_ptr);
  if (!gemm->run(saved.options())) return std::nullopt;
  return std::make_pair(dh, db1);
}
#endif

}  // namespace fastformer
