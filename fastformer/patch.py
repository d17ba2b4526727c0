"""`fastformer.patch_sdpa()`: `torch.nn.functional.scaled_dot_product_attention` on fastformer's
Triton kernel.

Attention code that calls `F.scaled_dot_product_attention` itself (Hugging Face's, timm's,
nanoGPT's, torch.nn.MultiheadAttention's own path without weights) has no module for
`fastformer.swap` to replace. The patch replaces the function: a call that fastformer's op
computes the same way (`fastformer.ops.attention.sdpa_call_reasons`) runs its Triton kernel,
every other call the function the patch replaced, so the results are torch's wherever the two
differ. Code that bound the function to a name of its own before the patch
(`from torch.nn.functional import scaled_dot_product_attention`) keeps torch's.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch import Tensor

from fastformer.nn._ops import _AUTOCAST_CASTS, _autocast_dtype, _call
from fastformer.ops.attention import _plain_tensors, _sdpa_call

__all__ = ["SdpaPatch", "patch_sdpa", "scaled_dot_product_attention"]

_ACTIVE: list[SdpaPatch] = []  # patches not restored yet, the first made first


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """What `patch_sdpa` puts in place of `torch.nn.functional.scaled_dot_product_attention`:
    its signature and semantics, on fastformer's op where that takes the call.

    Under autocast, floating inputs are cast to autocast's dtype first, as autocast casts
    torch's. Dropout draws its mask from fastformer's generator (the same distribution, other
    draws than torch's). Every other call goes to the function the patch replaced.
    """
    dtype = _autocast_dtype(query) if isinstance(query, Tensor) else None
    tensors = [query, key, value, attn_mask]
    if dtype is not None:
        tensors = [_autocast(t, dtype) for t in tensors]
    rest = (dropout_p, is_causal, scale, enable_gqa)
    # The inputs are cast: the op's torch backend must not cast them again.
    out = _call(dtype is not None, query, _sdpa_call, *tensors, *rest)
    reasons = out if isinstance(out, list) else None  # the op's output, or why it did not run
    if _ACTIVE and not torch.compiler.is_compiling():  # a traced count would not run
        _count(reasons)
    if reasons is not None:
        return _replaced()(*tensors, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    return out


def _count(reasons: list[str] | None) -> None:
    for patch in _ACTIVE:
        if reasons is None:
            patch.taken += 1
        else:
            patch.not_taken["; ".join(reasons)] += 1


def _autocast(t: object, dtype: torch.dtype) -> object:
    # Autocast leaves float64 as it is; a CausalBias's values are not its meaning.
    if _plain_tensors(t) and t.dtype in _AUTOCAST_CASTS:
        return t.to(dtype)
    return t


def _replaced():
    """The function the first patch in force replaced (torch's, unless someone patched before)."""
    for patch in _ACTIVE:
        if patch.replaced is not scaled_dot_product_attention:
            return patch.replaced
    return torch._C._nn.scaled_dot_product_attention


class SdpaPatch:
    """A patch of `torch.nn.functional.scaled_dot_product_attention` in force until `restore()`
    or the end of its `with` block.

    Counts the eager calls made while it is in force (compiled calls are not counted):
    `taken`, those that ran fastformer's op, and `not_taken`, the others by the reason
    (`fastformer.ops.attention.sdpa_call_reasons`); `str(patch)` lists them.
    """

    def __init__(self) -> None:
        self.taken = 0
        self.not_taken: Counter[str] = Counter()
        self.replaced = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = scaled_dot_product_attention
        _ACTIVE.append(self)

    @property
    def active(self) -> bool:
        return self in _ACTIVE

    def restore(self) -> None:
        """Put back the function this patch replaced; no-op once restored."""
        if self.active:
            F.scaled_dot_product_attention = self.replaced
            _ACTIVE.remove(self)

    def __enter__(self) -> SdpaPatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def __repr__(self) -> str:
        not_taken = sum(self.not_taken.values())
        return f"SdpaPatch(active={self.active}, taken={self.taken}, not_taken={not_taken})"

    def __str__(self) -> str:
        lines = [f"patch_sdpa: {self.taken} call(s) ran fastformer's op, "
                 f"{sum(self.not_taken.values())} the replaced function"]  # fmt: skip
        lines += [f"  {n} x {reason}" for reason, n in self.not_taken.most_common()]
        return "\n".join(lines)


def patch_sdpa() -> SdpaPatch:
    """Route `torch.nn.functional.scaled_dot_product_attention` to fastformer's Triton kernel
    where it computes the same result (see the module docstring), in place, until the
    returned patch's `restore()`, or for a `with` block:

        with fastformer.patch_sdpa():
            loss = model(batch).loss  # the model's own F.scaled_dot_product_attention calls

    Patches nest: each restores what it replaced.
    """
    return SdpaPatch()
