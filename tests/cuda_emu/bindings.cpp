// torch.ops.fastformer_emu: the project's CUDA launchers (csrc/**/*.cu, compiled for the CPU
// emulator) on CPU tensors. LayerNorm's arguments come from the CUDA glue's own
// layer_norm_glue.h; the FFN ops fill theirs as csrc/ffn/ffn.cpp does (same outputs, workspace
// sizes, dropout scale). Memory differs: every buffer a kernel sees lives between red zones of
// NaN bytes, outputs and workspaces start as NaN bytes (at::empty leaves garbage on the GPU),
// inputs keep their address modulo 16 (a misaligned view stays misaligned), and after the launch
// the red zones and the inputs must be untouched.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "emu_api.h"
#include "ffn/ffn.h"
#include "layer_norm/layer_norm.h"
#include "layer_norm/layer_norm_glue.h"
#include "rng/rng.h"
#include "selftest.h"

namespace {

using Tensors4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using fastformer::FfnActivation;
using fastformer::FfnDtype;

constexpr int64_t kRedZone = 1024;  // bytes of NaN before and after every buffer
constexpr uint8_t kPoison = 0xFF;

// Buffers of one op: each a NaN-filled byte tensor [red zone | data | red zone].
class Arena {
 public:
  // A fresh output: contents and red zones all NaN bytes; 64-byte aligned data, as at::empty's.
  at::Tensor empty(at::IntArrayRef shape, at::ScalarType dtype, const std::string& name) {
    return make(shape, dtype, 0, name, nullptr, false);
  }

  // A copy of `t` (contiguous) at the same address modulo 64; checked unchanged afterwards
  // unless `writable` (the in-place FFN forward).
  at::Tensor input(const at::Tensor& t, const std::string& name, bool writable = false) {
    const at::Tensor c = t.contiguous();
    const int64_t misalign =
        c.numel() > 0 ? static_cast<int64_t>(reinterpret_cast<uintptr_t>(c.data_ptr()) % 64) : 0;
    return make(c.sizes(), c.scalar_type(), misalign, name, &c, !writable);
  }

  c10::optional<at::Tensor> input(const c10::optional<at::Tensor>& t, const std::string& name) {
    return t.has_value() ? c10::optional<at::Tensor>(input(*t, name)) : c10::nullopt;
  }

  // No undefined behaviour reported, red zones intact, read-only inputs unchanged.
  void check() const {
    emu::check_no_pending_error();
    for (const Buffer& b : buffers_) {
      const int64_t total = b.storage.numel();
      const at::Tensor front = b.storage.narrow(0, 0, b.front);
      const at::Tensor back = b.storage.narrow(0, b.front + b.bytes, total - b.front - b.bytes);
      TORCH_CHECK(front.eq(kPoison).all().item<bool>() && back.eq(kPoison).all().item<bool>(),
                  "cuda_emu: a kernel wrote outside the buffer '", b.name, "' (its red zone)");
      if (b.original.defined()) {  // compared as bytes: NaN inputs compare equal too
        TORCH_CHECK(at::equal(b.view.reshape(-1).view(at::kByte),
                              b.original.reshape(-1).view(at::kByte)),
                    "cuda_emu: a kernel wrote into the read-only input '", b.name, "'");
      }
    }
  }

 private:
  struct Buffer {
    at::Tensor storage;
    at::Tensor view;
    at::Tensor original;
    int64_t front;
    int64_t bytes;
    std::string name;
  };

  // A guarded buffer holding a copy of `source` (if given); `read_only`: checked unchanged.
  at::Tensor make(at::IntArrayRef shape, at::ScalarType dtype, int64_t misalign,
                  const std::string& name, const at::Tensor* source, bool read_only) {
    const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
    TORCH_CHECK(misalign % elem == 0, "cuda_emu: misaligned by part of an element");
    const int64_t bytes = c10::multiply_integers(shape) * elem;
    const int64_t front = kRedZone + misalign;
    at::Tensor storage = at::empty({front + bytes + kRedZone}, at::kByte);
    TORCH_CHECK(reinterpret_cast<uintptr_t>(storage.data_ptr()) % 64 == 0,
                "cuda_emu: the CPU allocator is expected to align to 64 bytes");
    storage.fill_(kPoison);
    at::Tensor view = storage.narrow(0, front, bytes).view(dtype).view(shape);
    at::Tensor kept;
    if (source != nullptr) view.copy_(*source);
    if (source != nullptr && read_only) kept = source->clone();
    buffers_.push_back({storage, view, kept, front, bytes, name});
    return view;
  }

  std::vector<Buffer> buffers_;
};

// seed_in_memory: the seed as the CUDA glue passes one drawn inside graph capture, an int64 in
// (emulated) device memory that the kernels read, with a wrong launch argument beside it.
template <typename Args>
at::Tensor put_seed_in_memory(Args& a, Arena& arena, int64_t seed) {
  at::Tensor cell = arena.input(at::full({}, seed, at::kLong), "seed");
  a.seed = 0;
  a.seed_ptr = cell.data_ptr<int64_t>();
  return cell;
}

Tensors4 layer_norm_fwd(const at::Tensor& x_in, const c10::optional<at::Tensor>& weight_in,
                        const c10::optional<at::Tensor>& bias_in,
                        const c10::optional<at::Tensor>& residual_in, int64_t seed, double eps,
                        double dropout_p, bool rms, bool store_pre, bool seed_in_memory) {
  TORCH_CHECK(x_in.dim() == 2, "cuda_emu layer_norm_fwd: x must be 2-D");
  TORCH_CHECK(seed >= 0, "cuda_emu: seed must be >= 0");
  const bool fused = residual_in.has_value() || dropout_p > 0 || store_pre;
  Arena arena;
  const at::Tensor x = arena.input(x_in, "x");
  const auto weight = arena.input(weight_in, "weight");
  const auto bias = arena.input(bias_in, "bias");
  const auto residual = arena.input(residual_in, "residual");
  const int64_t rows = x.size(0);
  at::Tensor out = arena.empty(x.sizes(), x.scalar_type(), "out");
  at::Tensor pre = store_pre ? arena.empty(x.sizes(), x.scalar_type(), "pre")
                             : at::empty({0}, x.options());
  at::Tensor mean = rms ? at::empty({0}, at::kFloat) : arena.empty({rows}, at::kFloat, "mean");
  at::Tensor rstd = arena.empty({rows}, at::kFloat, "rstd");
  fastformer::LnFwdArgs a =
      fastformer::ln_glue::fwd_args(x, weight, bias, residual, out, pre, mean, rstd,
                                    static_cast<uint64_t>(seed), eps, dropout_p, rms, fused);
  const at::Tensor cell = seed_in_memory ? put_seed_in_memory(a, arena, seed) : at::Tensor();
  fastformer::layer_norm_fwd_cuda_launch(a, emu::config().sms, nullptr);
  arena.check();
  return {out, pre, mean, rstd};
}

Tensors4 layer_norm_bwd(const at::Tensor& dy_in, const c10::optional<at::Tensor>& dpre_in,
                        const at::Tensor& x_in, const c10::optional<at::Tensor>& weight_in,
                        const c10::optional<at::Tensor>& bias_in, const at::Tensor& mean_in,
                        const at::Tensor& rstd_in, int64_t seed, double dropout_p, bool rms,
                        bool fused, bool has_residual, bool need_dweight, bool need_dbias,
                        bool seed_in_memory) {
  TORCH_CHECK(x_in.dim() == 2 && dy_in.sizes() == x_in.sizes(), "cuda_emu layer_norm_bwd: shapes");
  TORCH_CHECK(!need_dweight || weight_in.has_value(), "need_dweight without weight");
  TORCH_CHECK(!need_dbias || bias_in.has_value(), "need_dbias without bias");
  Arena arena;
  const at::Tensor x = arena.input(x_in, "x"), dy = arena.input(dy_in, "dy");
  const auto dpre = arena.input(dpre_in, "dpre");
  const at::Tensor mean = rms ? mean_in : arena.input(mean_in, "mean");
  const at::Tensor rstd = arena.input(rstd_in, "rstd");
  const auto weight = arena.input(weight_in, "weight");
  const auto& bias = bias_in;  // only its dtype matters (never read by the kernels)
  const at::Tensor none = at::empty({0}, x.options());
  at::Tensor dx = arena.empty(x.sizes(), x.scalar_type(), "dx");
  at::Tensor dres = has_residual ? arena.empty(x.sizes(), x.scalar_type(), "dres") : none;
  at::Tensor dweight = need_dweight ? arena.empty({x.size(1)}, weight->scalar_type(), "dweight")
                                    : none;
  at::Tensor dbias = need_dbias ? arena.empty({x.size(1)}, bias->scalar_type(), "dbias") : none;
  fastformer::LnBwdArgs a = fastformer::ln_glue::bwd_args(
      dy, dpre.has_value() ? *dpre : at::Tensor(), x, weight, bias, mean, rstd, dx, dres, dweight,
      dbias, static_cast<uint64_t>(seed), dropout_p, rms, fused, has_residual, need_dweight,
      need_dbias);
  const at::Tensor cell = seed_in_memory ? put_seed_in_memory(a, arena, seed) : at::Tensor();
  const int num_sms = emu::config().sms;  // multiProcessorCount of the emulated device
  const fastformer::LnBwdPlan plan = fastformer::layer_norm_bwd_plan(a, num_sms);
  const int64_t partial_floats = std::max<int64_t>(1, 2 * plan.partial_rows * a.cols);
  at::Tensor partial = arena.empty({partial_floats}, at::kFloat, "partial");
  a.partial = partial.data_ptr<float>();
  fastformer::layer_norm_bwd_cuda_launch(a, plan, nullptr);
  arena.check();
  return {dx, dres, dweight, dbias};
}

FfnActivation parse_activation(c10::string_view name) {
  if (name == "identity") return FfnActivation::kIdentity;  // the fused-epilogue forward
  if (name == "relu") return FfnActivation::kRelu;
  if (name == "gelu") return FfnActivation::kGelu;
  if (name == "gelu_tanh") return FfnActivation::kGeluTanh;
  if (name == "silu") return FfnActivation::kSilu;
  if (name == "swiglu") return FfnActivation::kSwiglu;
  if (name == "geglu") return FfnActivation::kGeglu;
  TORCH_CHECK(false, "cuda_emu ffn: unknown activation '", std::string(name), "'");
}

FfnDtype ffn_dtype(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kFloat:
      return FfnDtype::kFloat32;
    case at::kHalf:
      return FfnDtype::kFloat16;
    case at::kBFloat16:
      return FfnDtype::kBFloat16;
    default:
      TORCH_CHECK(false, "cuda_emu ffn: float32, float16 or bfloat16, got ", x.scalar_type());
  }
}

// The kernel part of ffn.cpp's ffn_forward_cuda: g = dropout(act(h)), in place (g is h) for
// relu and for the fused-epilogue call (activation "identity"), as there.
at::Tensor ffn_forward(const at::Tensor& h_in, c10::string_view activation, double dropout_p,
                       int64_t seed, bool seed_in_memory) {
  const FfnActivation act = parse_activation(activation);
  TORCH_CHECK(h_in.dim() == 2, "cuda_emu ffn_forward: h must be (tokens, width)");
  const bool gated = fastformer::ffn_is_gated(act);
  TORCH_CHECK(!gated || h_in.size(1) % 2 == 0, "gated h needs an even width");
  const bool in_place = act == FfnActivation::kRelu || act == FfnActivation::kIdentity;
  Arena arena;
  at::Tensor h = arena.input(h_in, "h", /*writable=*/in_place);
  const int64_t tokens = h.size(0), d_ff = gated ? h.size(1) / 2 : h.size(1);
  at::Tensor g = in_place ? h : arena.empty({tokens, d_ff}, h.scalar_type(), "g");
  const float p = static_cast<float>(dropout_p);
  fastformer::FfnForwardArgs args{h.const_data_ptr(),
                                        g.data_ptr(),
                                        tokens,
                                        d_ff,
                                        static_cast<uint64_t>(seed),
                                        p,
                                        static_cast<float>(1.0 / (1.0 - dropout_p)),
                                        act,
                                        ffn_dtype(h)};
  const at::Tensor cell = seed_in_memory ? put_seed_in_memory(args, arena, seed) : at::Tensor();
  fastformer::ffn_forward_cuda_launch(args, nullptr);
  arena.check();
  return g;
}

// The kernel part of ffn.cpp's ffn_backward_cuda (dg = grad_out @ w2 is an input here):
// returns dh, g (recomputed; the saved g for relu) and db1.
std::tuple<at::Tensor, at::Tensor, at::Tensor> ffn_backward(const at::Tensor& dg_in,
                                                            const at::Tensor& saved_in,
                                                            c10::string_view activation,
                                                            double dropout_p, int64_t seed,
                                                            bool seed_in_memory) {
  const FfnActivation act = parse_activation(activation);
  TORCH_CHECK(act != FfnActivation::kIdentity, "the backward always knows the activation");
  TORCH_CHECK(dg_in.dim() == 2 && saved_in.dim() == 2, "cuda_emu ffn_backward: 2-D inputs");
  const bool relu = act == FfnActivation::kRelu, gated = fastformer::ffn_is_gated(act);
  const int64_t tokens = dg_in.size(0), d_ff = dg_in.size(1);
  const int64_t width = gated ? 2 * d_ff : d_ff;
  TORCH_CHECK(saved_in.size(0) == tokens && saved_in.size(1) == width, "saved must be (tokens, ",
              width, ")");
  Arena arena;
  // A non-gated dh is written over dg, as ffn.cpp does.
  const at::Tensor dg = arena.input(dg_in, "dg", /*writable=*/!gated);
  const at::Tensor saved = arena.input(saved_in, "saved");
  at::Tensor g = relu ? saved : arena.empty({tokens, d_ff}, dg.scalar_type(), "g");
  at::Tensor dh = gated ? arena.empty({tokens, width}, dg.scalar_type(), "dh") : dg;
  at::Tensor db1 = arena.empty({width}, dg.scalar_type(), "db1");
  at::Tensor partials = arena.empty({fastformer::ffn_bias_grad_row_blocks(tokens), width},
                                    at::kFloat, "partials");
  const float p = static_cast<float>(dropout_p);
  fastformer::FfnBackwardArgs args{dg.const_data_ptr(),
                                         saved.const_data_ptr(),
                                         dh.data_ptr(),
                                         relu ? nullptr : g.data_ptr(),
                                         partials.data_ptr<float>(),
                                         db1.data_ptr(),
                                         tokens,
                                         d_ff,
                                         static_cast<uint64_t>(seed),
                                         p,
                                         static_cast<float>(1.0 / (1.0 - dropout_p)),
                                         act,
                                         ffn_dtype(dg)};
  const at::Tensor cell = seed_in_memory ? put_seed_in_memory(args, arena, seed) : at::Tensor();
  fastformer::ffn_backward_cuda_launch(args, nullptr);
  arena.check();
  return {dh, g, db1};
}

// ffn.cpp's column_sum_cuda (linear2's bias gradient): the column sums of src (rows, cols).
at::Tensor ffn_column_sum(const at::Tensor& src_in) {
  TORCH_CHECK(src_in.dim() == 2, "cuda_emu ffn_column_sum: src must be (rows, cols)");
  Arena arena;
  const at::Tensor src = arena.input(src_in, "src");
  const int64_t rows = src.size(0), cols = src.size(1);
  at::Tensor out = arena.empty({cols}, src.scalar_type(), "out");
  at::Tensor partials =
      arena.empty({fastformer::ffn_bias_grad_row_blocks(rows), cols}, at::kFloat, "partials");
  const fastformer::FfnColumnSumArgs args{src.const_data_ptr(), partials.data_ptr<float>(),
                                          out.data_ptr(),       rows,
                                          cols,                 ffn_dtype(src)};
  fastformer::ffn_column_sum_cuda_launch(args, nullptr);
  arena.check();
  return out;
}

// The relu bitmask of cuBLASLt's DRELU_BGRAD epilogue from saved (tokens, d_ff), as ffn.cpp's
// relu backward makes it: int32 words (tokens, ffn_relu_mask_words(d_ff)).
at::Tensor ffn_relu_mask(const at::Tensor& saved_in, double dropout_p, int64_t seed,
                         bool seed_in_memory) {
  TORCH_CHECK(saved_in.dim() == 2, "cuda_emu ffn_relu_mask: saved must be (tokens, d_ff)");
  Arena arena;
  const at::Tensor saved = arena.input(saved_in, "saved");
  const int64_t tokens = saved.size(0), d_ff = saved.size(1);
  at::Tensor mask =
      arena.empty({tokens, fastformer::ffn_relu_mask_words(d_ff)}, at::kInt, "mask");
  fastformer::FfnReluMaskArgs args{saved.const_data_ptr(),
                                   reinterpret_cast<uint32_t*>(mask.data_ptr<int32_t>()),
                                   tokens,
                                   d_ff,
                                   static_cast<uint64_t>(seed),
                                   static_cast<float>(dropout_p),
                                   ffn_dtype(saved)};
  const at::Tensor cell = seed_in_memory ? put_seed_in_memory(args, arena, seed) : at::Tensor();
  fastformer::ffn_relu_mask_cuda_launch(args, nullptr);
  arena.check();
  return mask;
}

// rng.cpp's uniform_cuda: philox_uniform (element false) or element_uniform of int64 offsets.
at::Tensor uniform(int64_t seed, const at::Tensor& offsets, bool element) {
  TORCH_CHECK(offsets.scalar_type() == at::kLong, "offsets must be int64");
  Arena arena;
  const at::Tensor off = arena.input(offsets, "offsets");
  at::Tensor out = arena.empty(off.sizes(), at::kFloat, "out");
  fastformer::philox_uniform_cuda_launch(static_cast<uint64_t>(seed), off.data_ptr<int64_t>(),
                                         out.data_ptr<float>(), off.numel(), element, nullptr);
  arena.check();
  return out;
}

// One of selftest.cu's kernels on `in`; returns its output (threads * blocks * 6 floats).
at::Tensor selftest(c10::string_view name, const at::Tensor& in, int64_t blocks, int64_t threads,
                    int64_t smem) {
  TORCH_CHECK(in.scalar_type() == at::kFloat, "selftest takes float32");
  Arena arena;
  const at::Tensor x = arena.input(in, "in");
  at::Tensor out = arena.empty({std::max<int64_t>(blocks * threads * 6, 64)}, at::kFloat, "out");
  emu_selftest::run(std::string(name), x.data_ptr<float>(), out.data_ptr<float>(),
                    static_cast<int>(blocks), static_cast<int>(threads), static_cast<int>(smem));
  arena.check();
  return out;
}

void configure(int64_t device, int64_t sms, int64_t blocks_per_sm, int64_t order,
               int64_t shuffle_seed, int64_t smem_optin) {
  TORCH_CHECK(sms >= 1 && blocks_per_sm >= 0 && order >= 0 && order <= 2 && smem_optin >= 0,
              "bad emulator config");
  emu::Config& c = emu::config();
  c.device = static_cast<int>(device);
  c.sms = static_cast<int>(sms);
  c.blocks_per_sm = static_cast<int>(blocks_per_sm);
  c.order = static_cast<emu::Order>(order);
  c.shuffle_seed = static_cast<uint64_t>(shuffle_seed);
  c.smem_optin = static_cast<size_t>(smem_optin);
}

std::string launch_log() { return emu::launch_log(); }

void clear_launch_log() { emu::clear_launch_log(); }

}  // namespace

TORCH_LIBRARY(fastformer_emu, m) {
  m.def(
      "layer_norm_fwd(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, int seed, "
      "float eps, float dropout_p, bool rms, bool store_pre, bool seed_in_memory=False) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "layer_norm_bwd(Tensor dy, Tensor? dpre, Tensor x, Tensor? weight, Tensor? bias, "
      "Tensor mean, Tensor rstd, int seed, float dropout_p, bool rms, bool fused, "
      "bool has_residual, bool need_dweight, bool need_dbias, bool seed_in_memory=False) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "ffn_forward(Tensor h, str activation, float dropout_p, int seed, "
      "bool seed_in_memory=False) -> Tensor");
  m.def(
      "ffn_backward(Tensor dg, Tensor saved, str activation, float dropout_p, int seed, "
      "bool seed_in_memory=False) -> (Tensor, Tensor, Tensor)");
  m.def("ffn_column_sum(Tensor src) -> Tensor");
  m.def(
      "ffn_relu_mask(Tensor saved, float dropout_p, int seed, bool seed_in_memory=False) "
      "-> Tensor");
  m.def("uniform(int seed, Tensor offsets, bool element) -> Tensor");
  m.def("selftest(str name, Tensor x, int blocks, int threads, int smem) -> Tensor");
  // No tensor arguments: catch-all kernels.
  m.def("configure(int device, int sms, int blocks_per_sm, int order, int shuffle_seed, "
        "int smem_optin) -> ()",
        &configure);
  m.def("layer_norm_tuning(int[] config) -> int[]", &fastformer::ln_glue::tuning_op);
  m.def("launch_log() -> str", &launch_log);
  m.def("clear_launch_log() -> ()", &clear_launch_log);
}

TORCH_LIBRARY_IMPL(fastformer_emu, CPU, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd);
  m.impl("layer_norm_bwd", &layer_norm_bwd);
  m.impl("ffn_forward", &ffn_forward);
  m.impl("ffn_backward", &ffn_backward);
  m.impl("ffn_column_sum", &ffn_column_sum);
  m.impl("ffn_relu_mask", &ffn_relu_mask);
  m.impl("uniform", &uniform);
  m.impl("selftest", &selftest);
}
