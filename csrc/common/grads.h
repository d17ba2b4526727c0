// What the C++ autograd nodes share (autograd.cpp, attention/attention_eager.cpp).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

namespace fastformer {

// Whether a backward runs under create_graph=True with something its gradients depend on
// (`grads`, `saved`, or `kept`: an input kept outside the saved variables) requiring grad:
// then the kernels' results, which carry no graph, would look constant to a second backward
// (zeros, partial sums), and the nodes call the ops' *_grads_by_reference ops instead
// (fastformer/ops/_autograd.py's twice_differentiable, for the C++ nodes).
inline bool differentiable(const std::vector<at::Tensor>& grads,
                           const std::vector<at::Tensor>& saved,
                           const at::Tensor& kept = at::Tensor()) {
  if (!at::GradMode::is_enabled()) return false;
  auto needs_grad = [](const at::Tensor& t) { return t.defined() && t.requires_grad(); };
  return std::any_of(grads.begin(), grads.end(), needs_grad) ||
         std::any_of(saved.begin(), saved.end(), needs_grad) || needs_grad(kept);
}

}  // namespace fastformer
