// Calls of the registered torch.ops.fastformer ops from C++, through the dispatcher (so that
// CPU, CUDA, autograd and dispatch modes see them as they see a Python call), and the
// signatures of the ones called from more than one file.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <tuple>

namespace fastformer {

using OptTensor = c10::optional<at::Tensor>;
using Tensors4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The registered op `Op::name`, looked up once.
template <typename Op>
const c10::TypedOperatorHandle<typename Op::Sig>& handle() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow(Op::name, "")
                             .template typed<typename Op::Sig>();
  return op;
}

struct LnFwd {
  static constexpr const char* name = "fastformer::layer_norm_fwd";
  using Sig = Tensors4(const at::Tensor&, const OptTensor&, const OptTensor&, const OptTensor&,
                       const at::Tensor&, double, double, bool, bool);
};

struct LnAutograd {
  static constexpr const char* name = "fastformer::layer_norm_autograd";
  using Sig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const OptTensor&,
                                                 const OptTensor&, const OptTensor&,
                                                 const at::Tensor&, double, double, bool, bool);
};

struct FfnFwd {
  static constexpr const char* name = "fastformer::ffn_forward";
  using Sig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                 const OptTensor&, const at::Tensor&,
                                                 const OptTensor&, c10::string_view, double,
                                                 int64_t, bool, const OptTensor&);
};

struct FfnAutograd {
  static constexpr const char* name = "fastformer::ffn_autograd";
  using Sig = at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                         const at::Tensor&, const OptTensor&, c10::string_view, double, int64_t,
                         bool, const OptTensor&);
};

}  // namespace fastformer
