"""`LayerNorm` and `RMSNorm`: torch.nn's normalizations on fastformer's layer_norm op."""

from __future__ import annotations

import math

from torch import Tensor, nn

from fastformer.nn import _ops, _record
from fastformer.nn._lookup import param


def _input_reasons(input: Tensor) -> list[str]:
    if not isinstance(input, Tensor):
        return [f"{type(input).__name__} input: not a tensor"]
    if input.is_nested:
        return ["nested-tensor input: the op takes dense tensors"]
    if _ops.is_dtensor(input):  # SequenceParallel() norms: torch.nn's run on DTensors
        return ["DTensor input: the op has no sharding rules"]
    return []


def eps_reasons(eps: float | None) -> list[str]:
    """Why the ops cannot take a norm's `eps` ([] = they can): torch.nn accepts 0, the ops take
    a finite eps > 0 (None: RMSNorm's default)."""
    # (Comparisons, not math.isfinite: under torch.compile(dynamic=True) eps is a SymFloat.)
    if eps is None or 0 < eps < math.inf:
        return []
    return [f"eps={eps}: the op takes a finite eps > 0"]


def _fallback(module: nn.Module, op: str, input: Tensor) -> bool:
    """Whether `module` runs torch.nn's forward for `input` (the reason recorded)."""
    plain = isinstance(input, Tensor) and not input.is_nested and not _ops.is_dtensor(input)
    if plain and not eps_reasons(module.eps):  # every call: no lists built
        return False
    reasons = _input_reasons(input) + module.fallback_reasons
    if reasons:
        _record.note(module, op, "torch.nn", [("fastformer", reasons)])
    return bool(reasons)


class LayerNorm(nn.LayerNorm):
    """Drop-in `torch.nn.LayerNorm` running `fastformer.ops.layer_norm.layer_norm`.

    Same constructor (normalized_shape, eps, elementwise_affine, bias, device, dtype),
    parameters `weight`/`bias` and init. Input (..., *normalized_shape) in float32, float16 or
    bfloat16; output of the same shape and dtype (under CUDA autocast float32, as torch.nn).
    Nested tensors and DTensors fall back to torch.nn.
    """

    __prepare_scriptable__ = _ops.refuse_script

    @property
    def fallback_reasons(self) -> list[str]:
        """Configuration reasons for torch.nn's path ([] = fused): an eps the op refuses."""
        return eps_reasons(self.eps)

    def forward(self, input: Tensor) -> Tensor:
        """input (..., *normalized_shape) -> normalized, same shape."""
        if _fallback(self, "LayerNorm", input):
            return super().forward(input)
        weight, bias = param(self, "weight"), param(self, "bias")
        return _ops.layer_norm(self, input, tuple(self.normalized_shape), weight, bias, self.eps)


class RMSNorm(nn.RMSNorm):
    """Drop-in `torch.nn.RMSNorm` running `fastformer.ops.layer_norm.rms_norm`.

    Same constructor (normalized_shape, eps=None meaning F.rms_norm's default, elementwise_affine,
    device, dtype) and parameter `weight`. Input (..., *normalized_shape); output same shape
    and dtype. Nested tensors and DTensors fall back to torch.nn.
    """

    __prepare_scriptable__ = _ops.refuse_script

    @property
    def fallback_reasons(self) -> list[str]:
        """Configuration reasons for torch.nn's path ([] = fused): an eps the op refuses."""
        return eps_reasons(self.eps)

    def forward(self, x: Tensor) -> Tensor:  # torch.nn.RMSNorm names it x (LayerNorm: input)
        """x (..., *normalized_shape) -> normalized, same shape."""
        if _fallback(self, "RMSNorm", x):
            return super().forward(x)
        weight = param(self, "weight")
        return _ops.rms_norm(self, x, tuple(self.normalized_shape), weight, self.eps)
