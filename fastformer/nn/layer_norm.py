"""`LayerNorm` and `RMSNorm`: torch.nn's normalizations on fastformer's layer_norm op."""

from __future__ import annotations

from torch import Tensor, nn

from fastformer.nn import _ops, _record
from fastformer.nn._lookup import param


def _nested_reason(input: Tensor) -> list[str]:
    return ["nested-tensor input: the op takes dense tensors"] if input.is_nested else []


class LayerNorm(nn.LayerNorm):
    """Drop-in `torch.nn.LayerNorm` running `fastformer.ops.layer_norm.layer_norm`.

    Same constructor (normalized_shape, eps, elementwise_affine, bias, device, dtype),
    parameters `weight`/`bias` and init. Input (..., *normalized_shape) in float32, float16 or
    bfloat16; output of the same shape and dtype (under CUDA autocast float32, as torch.nn).
    Nested tensors fall back to torch.nn.
    """

    @property
    def fallback_reasons(self) -> list[str]:
        """Configuration reasons for torch.nn's path: none, every configuration is fused."""
        return []

    def forward(self, input: Tensor) -> Tensor:
        """input (..., *normalized_shape) -> normalized, same shape."""
        if input.is_nested:
            _record.note(self, "LayerNorm", "torch.nn", [("fastformer", _nested_reason(input))])
            return super().forward(input)
        weight, bias = param(self, "weight"), param(self, "bias")
        return _ops.layer_norm(self, input, tuple(self.normalized_shape), weight, bias, self.eps)


class RMSNorm(nn.RMSNorm):
    """Drop-in `torch.nn.RMSNorm` running `fastformer.ops.layer_norm.rms_norm`.

    Same constructor (normalized_shape, eps=None meaning finfo(dtype).eps, elementwise_affine,
    device, dtype) and parameter `weight`. Input (..., *normalized_shape); output same shape
    and dtype. Nested tensors fall back to torch.nn.
    """

    @property
    def fallback_reasons(self) -> list[str]:
        """Configuration reasons for torch.nn's path: none, every configuration is fused."""
        return []

    def forward(self, input: Tensor) -> Tensor:
        """input (..., *normalized_shape) -> normalized, same shape."""
        if input.is_nested:
            _record.note(self, "RMSNorm", "torch.nn", [("fastformer", _nested_reason(input))])
            return super().forward(input)
        weight = param(self, "weight")
        return _ops.rms_norm(self, input, tuple(self.normalized_shape), weight, self.eps)
