"""The module layer's one door to the ops.

Every fastformer module calls the ops through these functions, which (1) apply torch's autocast
policy by hand — the ops are opaque custom ops that autocast does not see, so the module casts
exactly as torch.nn would and then runs the op with autocast off; and (2) while
`fastformer.explain` records, note which backend runs and why each faster one does not.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fastformer.nn import _record
from fastformer.ops import _dispatch, rng
from fastformer.ops import attention as _attention
from fastformer.ops import ffn as _ffn
from fastformer.ops import layer_norm as _layer_norm

_DTensor = None
if torch.distributed.is_available():  # (a torch built without it has no DTensor)
    from torch.distributed.tensor import DTensor as _DTensor


def is_dtensor(t: Tensor) -> bool:
    """Whether `t` is a DTensor (tensor or sequence parallelism), which the ops cannot take: they
    have no sharding rules."""
    return _DTensor is not None and isinstance(t, _DTensor)


def not_dense(*inputs: object) -> bool:
    """Whether any input is a nested tensor, or no tensor at all: the module then runs torch.nn's
    forward (for a list, say, torch's own TypeError rather than an AttributeError of ours)."""
    for t in inputs:  # a loop, not any(...): a generator costs ~0.2 us on every module call
        if not isinstance(t, Tensor) or t.is_nested:
            return True
    return False


# Whether autocast is on for any device: one C call (~0.1 us) where the per-device check below
# costs ~0.5 us, and every module call asks (torch 2.11 and 2.14 have it; None: ask per device).
_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None)


def refuse_script(module: nn.Module) -> nn.Module:
    """`__prepare_scriptable__` of the fastformer.nn modules: torch.jit.script asks it of every
    module it compiles, so a swapped model fails with this message, not a TorchScript type
    error deep inside the module (the modules call the ops from Python)."""
    raise RuntimeError(
        f"torch.jit.script cannot compile {type(module).__module__}.{type(module).__qualname__}: "
        "fastformer's modules call their ops from Python. Use torch.compile or torch.export, or "
        "keep torch.nn modules where TorchScript is needed (state_dicts load both ways)"
    )


def _autocast_dtype(t: Tensor) -> torch.dtype | None:
    """The autocast dtype for `t`'s device, or None when autocast is off there."""
    if _ANY_AUTOCAST is not None and not _ANY_AUTOCAST():
        return None
    device = t.device.type
    if device in ("cpu", "cuda") and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return None


def _cast(dtype: torch.dtype, *tensors: Tensor | None) -> list[Tensor | None]:
    return [None if t is None else t.to(dtype) for t in tensors]


def _note(owner: nn.Module, what: str, op: str, inputs: object) -> None:
    """Record which backend of dispatch op `op` runs `inputs` (the forced one, else the first
    without reasons) and why each backend before it does not; `what` names the call."""
    reasons = _dispatch.explain(op, inputs)
    forced = _dispatch.forced_backend(op)
    runs = forced or next((name for name, why in reasons if not why), "none")
    faster = []
    for name, why in reasons:
        if name == runs:
            break
        faster.append((name, why or [f"FASTFORMER_BACKEND_{op.upper()}={forced} forces {runs}"]))
    _record.note(owner, what, runs, faster)


# The floating dtypes autocast casts to its own (it leaves float64 as it is).
_AUTOCAST_CASTS = (torch.float32, torch.float16, torch.bfloat16)


def _call(autocast: bool, like: Tensor, fn, *args, **kwargs):
    """fn(*args, **kwargs); with autocast switched off for `like`'s device when it is on (the
    inputs are cast already, and an op's torch backend must not cast again inside)."""
    if not autocast:
        return fn(*args, **kwargs)
    with torch.autocast(like.device.type, enabled=False):
        return fn(*args, **kwargs)


# --------------------------------------------------------------------------- attention


def attention(
    owner: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    key_padding_mask: Tensor | None,
) -> Tensor:
    """`fastformer.ops.attention.scaled_dot_product_attention` on (B, H, L, D) tensors.

    Under autocast q/k/v already come out of autocast's linear layers in the autocast dtype;
    an additive float mask is cast to that dtype as autocast casts SDPA's (not a float64 one).
    Without autocast the mask goes as it is: torch.nn's SDPA takes a float32 mask with 16-bit
    queries, and refuses other mismatches (the op does too).
    """
    autocast = _autocast_dtype(query) is not None
    if autocast and attn_mask is not None and attn_mask.dtype in _AUTOCAST_CASTS:
        attn_mask = attn_mask.to(query.dtype)
    args = (query, key, value, attn_mask, dropout_p, is_causal)
    if _record.active():
        _note(owner, "attention", "attention", _attention.AttentionInputs(query, value.shape[-1]))
    sdpa = _attention.scaled_dot_product_attention
    return _call(autocast, query, sdpa, *args, key_padding_mask=key_padding_mask)


def dropout_reasons(p: float, keep_error: float = rng.ELEMENT_KEEP_ERROR) -> list[str]:
    """Why the ops cannot take a module's dropout `p` ([] = they can): torch.nn takes any p in
    [0, 1]; the ops refuse p so close to 1 that their random numbers' resolution would bias
    the output (`rng.check_dropout_p`)."""
    limit = rng.max_dropout_p(keep_error)
    if p <= limit:
        return []
    return [f"dropout p={p}: the fused op takes p <= {limit:.6g} (closer to 1 its keep-mask "
            "would bias the output)"]  # fmt: skip


# --------------------------------------------------------------------------- normalization


def _norm_input(x: Tensor) -> tuple[Tensor, bool]:
    """Autocast's policy for normalizations: CUDA autocast runs them in float32 (CPU autocast
    leaves the input dtype). Returns the input to use and whether autocast is on."""
    dtype = _autocast_dtype(x)
    if dtype is None:
        return x, False
    if x.device.type == "cuda":
        x = x.float()
    return x, True


def _norm_params(x: Tensor, *params: Tensor | None) -> list[Tensor | None]:
    """The op takes parameters in the input dtype or float32 (torch.nn's CPU norms under
    autocast: a float32 weight with a bfloat16 input); anything else goes in x's dtype."""
    return [
        p if p is None or p.dtype in (x.dtype, torch.float32) else p.to(x.dtype) for p in params
    ]


def layer_norm(
    owner: nn.Module,
    x: Tensor,
    normalized_shape: tuple[int, ...],
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
) -> Tensor:
    """`fastformer.ops.layer_norm.layer_norm`, with torch.nn's autocast dtype policy."""
    x, autocast = _norm_input(x)
    weight, bias = _norm_params(x, weight, bias)
    args = (x, normalized_shape, weight, bias, eps)
    if _record.active():
        _note(owner, "layer_norm", "layer_norm", x)
    return _call(autocast, x, _layer_norm.layer_norm, *args)


def rms_norm(
    owner: nn.Module,
    x: Tensor,
    normalized_shape: tuple[int, ...],
    weight: Tensor | None,
    eps: float | None,
) -> Tensor:
    """`fastformer.ops.layer_norm.rms_norm`, with torch.nn's autocast dtype policy."""
    x, autocast = _norm_input(x)
    (weight,) = _norm_params(x, weight)
    args = (x, normalized_shape, weight, eps)
    if _record.active():
        _note(owner, "rms_norm", "layer_norm", x)
    return _call(autocast, x, _layer_norm.rms_norm, *args)


def dropout_add_layer_norm(
    owner: nn.Module,
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    dropout_p: float,
    prenorm: bool,
) -> Tensor | tuple[Tensor, Tensor]:
    """`LayerNorm(residual + dropout(x))` (and the sum when `prenorm`) in one op.

    torch.nn adds the sub-layer output to the residual first, which promotes the dtypes (under
    autocast a bfloat16 attention output meets a float32 residual): both go in promoted.
    """
    if x.dtype != residual.dtype:
        dtype = torch.promote_types(x.dtype, residual.dtype)
        x, residual = x.to(dtype), residual.to(dtype)
    x, autocast = _norm_input(x)
    if residual.dtype != x.dtype:
        residual = residual.to(x.dtype)
    weight, bias = _norm_params(x, weight, bias)
    args = (x, residual, weight, bias, eps, dropout_p, prenorm)
    if _record.active():
        _note(owner, "dropout_add_layer_norm", "layer_norm", x)
    return _call(autocast, x, _layer_norm.dropout_add_layer_norm, *args)


# --------------------------------------------------------------------------- feed-forward


def ffn(
    owner: nn.Module,
    x: Tensor,
    w1: Tensor,
    b1: Tensor | None,
    w2: Tensor,
    b2: Tensor | None,
    activation: str,
    dropout_p: float,
) -> Tensor:
    """`fastformer.ops.ffn.ffn`; under autocast every operand goes in the autocast dtype, as
    autocast's two linear layers would take them."""
    dtype = _autocast_dtype(x)
    if dtype is not None:
        x, w1, b1, w2, b2 = _cast(dtype, x, w1, b1, w2, b2)
    args = (x, w1, b1, w2, b2, activation, dropout_p)
    if _record.active():
        _note(owner, "ffn", "ffn", _ffn.FfnInputs(x.device, x.dtype))
    return _call(dtype is not None, x, _ffn.ffn, *args)
