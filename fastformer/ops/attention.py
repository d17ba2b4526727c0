"""Fused scaled-dot-product attention: the public op.

`scaled_dot_product_attention` has exactly the arguments and meaning of
`torch.nn.functional.scaled_dot_product_attention` (q (B, H, Lq, D), k (B, Hkv, Lk, D),
v (B, Hkv, Lk, Dv); bool attn_mask True = attend, float attn_mask added to the scores, masks
broadcastable to (B, H, Lq, Lk); causal aligned top-left; enable_gqa with H % Hkv == 0) plus
`key_padding_mask` (B, Lk) bool, True = padding. Unlike SDPA, `is_causal` combines with both
masks, and a query row with every key masked gives 0 (gradient 0), never NaN.

Backends (fastformer.ops._dispatch, FASTFORMER_BACKEND_ATTENTION forces one): `triton`, the
fused kernel of fastformer.kernels.attention (CUDA tensors, or CPU tensors under
TRITON_INTERPRET=1), then `torch`: on CPU without dropout torch's own fused CPU attention (the
kernels of SDPA's CPU flash path) fed with fastformer's masks, otherwise the eager reference fed
with the same dropout mask (computed in float32 for float16 / bfloat16 inputs, like the kernels;
results in the input dtype). The torch backend also takes what the kernel cannot: a batch or head
count over 65535 (CUDA's grid limit) or batch x heads of 2**31 or more, and (batch, head) slices
past int32 offsets (`backend_reasons` says which). An eager CPU call of
`scaled_dot_product_attention` that runs torch's flash kernel, with plain arguments (exact
tensors, a float dropout_p of 0, bools, no tracer, transform, mode or autocast, no gradient for a
float mask), runs from one C call, ``fastformer._C``'s ``attention_cpu_eager``, with the same
ops and bits, its backward too (a C++ autograd node); it returns None for any other call, which
takes the checked Python path.

Dropout: each call draws a seed from the torch generator of the query's device (inside the
custom op, so torch.compile never bakes it in). Inside CUDA graph capture (`torch.cuda.graph`)
the seed is drawn on the device instead and the Triton kernels read it from memory, so each
replay drops different elements (the torch backend cannot: it raises). One Philox4x32-10 call
gives 16 random bits to each of 8 scores of a row (8x less Philox work than a call per score).
With C = 4 * ceil(Lk / 32) calls per row and key column j = 32 g + 8 w + 2 c + l (w, c in 0..3,
l in 0..1), attention probability (b, h, i, j) takes

    w0, w1, w2, w3 = tl.randint4x(seed, ((b * H + h) << 32) + i * C + 4 g + c)   (int64 offset)
    u16 = (w_w >> (16 * l)) & 0xFFFF

(`fastformer.ops.rng.philox4x32` gives the same words) and is kept when u16 >= t,
t = round(dropout_p * 65536); kept probabilities are scaled by 1 / (1 - dropout_p). The columns
of one call, 8 w + 2 c + {0, 1} for a fixed c, are those one thread holds in a tensor-core
accumulator tile, so the kernels assemble the mask without exchanging data between threads. The
(b, h) pair owns the high 32 bits of the Philox counter and (i, j) the low 32, so the scheme
holds for any B * H and for Lq * C < 2**32 (a ValueError beyond).
`dropout_keep_mask(seed, ...)` regenerates the mask a call used; the backward of both backends
regenerates it too, so nothing of size Lq x Lk is stored.
"""

import functools
import math
import numbers
from dataclasses import dataclass
from importlib.util import find_spec
from typing import Optional

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.nn.attention.bias import CausalBias, CausalVariant

from fastformer import reference
from fastformer._ext import load_extension
from fastformer.ops import rng
from fastformer.ops._autograd import (
    DRAWS_A_SEED,
    autocast_off,
    check_dense,
    differentiable_vjp,
    positive_float,
    refuse_compiled_vmap_dropout,
    tensor_list,
    traced,
    twice_differentiable,
    type_name,
    under_transform,
)
from fastformer.ops._dispatch import Backend, explain, forced_backend, register, select_by_key

__all__ = [
    "AttentionInputs",
    "backend_reasons",
    "dropout_keep_mask",
    "lse_dtype",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_with_lse",
    "sdpa_call",
    "sdpa_call_reasons",
]

OP = "attention"
_OP_NAME = "scaled_dot_product_attention"  # in messages
MAX_HEAD_DIM = 256
MAX_DROPOUT_CALLS = 2**32  # Lq * dropout_calls(Lk) must stay below: the low 32 bits of the counter
DROPOUT_BLOCK = 32  # key columns served by 4 Philox calls (8 scores a call, 16 bits each)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the Triton kernel's
_DTYPES = (*_KERNEL_DTYPES, torch.float64)  # float64: the torch backend (tests, gradcheck)
_HALF = (torch.float16, torch.bfloat16)
_MASK_DIMS = ("batch", "heads", "seq_q", "seq_k")
# The plain eager CPU call in one C call, its backward in a C++ autograd node (csrc/attention/
# attention_eager.cpp), None for any other call: around torch's CPU flash kernel the checked
# path's small ops and Python cost ~50-110 us a call. Absent without the extension.
_EAGER = getattr(load_extension(), "attention_cpu_eager", None)
_INTERPRETED: bool | None = None  # the kernels' INTERPRETED, read at the first eager call
_is_compiling = torch.compiler.is_compiling  # (dynamo folds it: the C call is never traced)


# --------------------------------------------------------------------------- public API


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """Fused `softmax(q k^T * scale + masks) v` with dropout on the probabilities.

    Args:
        query: (B, H, Lq, D) float16, bfloat16 or float32, 1 <= D <= 256; float64 runs
            on the torch backend (the reference's math, for tests and gradcheck).
        key: (B, Hkv, Lk, D), same dtype and device; Hkv == H unless enable_gqa.
        value: (B, Hkv, Lk, Dv), 1 <= Dv <= 256.
        attn_mask: bool (True = attend) or float (added to the scores; the query dtype or
            float32, differentiable), broadcastable to (B, H, Lq, Lk); or torch's
            `torch.nn.attention.bias.CausalBias` of size (Lq, Lk): `causal_upper_left` runs
            as is_causal, `causal_lower_right` (key j visible from query i iff
            j <= i + Lk - Lq) as is_causal where Lq == Lk, else as its bool mask.
        dropout_p: probability in [0, 0.99237] of dropping an attention probability (closer
            to 1 the 16-bit keep threshold would bias the output; see the README).
        is_causal: key j is visible from query i iff j <= i (top-left aligned).
        scale: score scale, default 1 / sqrt(D); a positive finite float.
        enable_gqa: grouped-query attention, H % Hkv == 0 (query head h reads kv head
            h // (H // Hkv)).
        key_padding_mask: (B, Lk) bool, True = padding (that key is ignored).

    Returns:
        (B, H, Lq, Dv) in the query dtype; rows with every key masked are 0. Outside
        torch.compile its dims may lie in memory in the query's order (say (B, Lq, H, Dv) for
        heads split off a (B, Lq, H * D) projection, as torch's SDPA may return them), so that
        merging the heads back is a view: not necessarily contiguous.
    """
    if not _is_compiling() and (entry := _eager_entry()) is not None:
        out = entry(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask
        )
        if out is not None:
            return out
    return scaled_dot_product_attention_with_lse(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        key_padding_mask=key_padding_mask,
    )[0]


def _eager_entry():
    """`_EAGER`, except where the Triton interpreter takes CPU calls (TRITON_INTERPRET=1 when
    the kernels were imported) and the torch backend is not forced: the entry runs the torch
    backend's kernel only."""
    global _INTERPRETED
    if _EAGER is None:
        return None
    if _INTERPRETED is None:
        _INTERPRETED = find_spec("triton") is not None and _kernels().INTERPRETED
    if _INTERPRETED and forced_backend(OP) != "torch":
        return None
    return _EAGER


def scaled_dot_product_attention_with_lse(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    key_padding_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """`scaled_dot_product_attention` plus the log-sum-exp of the scaled, masked scores.

    Returns:
        (out, lse): out (B, H, Lq, Dv) in the query dtype; lse (B, H, Lq) in `lse_dtype`
        (float32; float64 for float64 inputs), natural log, -inf for a row with every key
        masked. Both are differentiable.
    """
    attn_mask, is_causal = _causal_bias(query, key, value, attn_mask, is_causal, enable_gqa)
    scale = _check_inputs(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask
    )
    return _checked_call(
        query, key, value, attn_mask, key_padding_mask, dropout_p, is_causal, scale
    )


def _checked_call(query, key, value, attn_mask, key_padding_mask, dropout_p, is_causal, scale):
    """(out, lse) of arguments `_check_inputs` accepted, `scale` as it returned it."""
    args = (query, key, value, attn_mask, key_padding_mask, float(dropout_p), bool(is_causal))
    needs_grad = torch.is_grad_enabled() and _any_requires_grad(query, key, value, attn_mask)
    if traced() and not under_transform():
        # The op resolves a None scale itself: 1 / sqrt(D) of a symbolic head dim is a guard on
        # D (dynamic=True recompiled per head dim). A jit trace saves for a backward in any
        # grad mode.
        needs_grad = needs_grad or torch.jit.is_tracing()
        out, lse = torch.ops.fastformer.attention(*args, scale, needs_grad)[:2]
        return out, lse
    resolved = _resolve_scale(scale, query.shape[-1])
    if under_transform():  # eager or compiled
        return _transformed(*args, resolved)
    if needs_grad:
        out, lse = _AttentionFunction.apply(*args, resolved)
    else:
        out, lse = _forward(*args, resolved, like_query=True)[:2]
    return out, lse


@autocast_off  # as the kernels, which ignore autocast
def _transformed(q, k, v, attn_mask, kpm, dropout_p, is_causal, scale):
    """The reference's function with the kernels' dropout mask (`under_transform`), in float32
    for 16-bit inputs as the kernels compute."""
    keep = None
    if dropout_p > 0 and traced():  # a seed drawn at run time, not one baked into a graph
        refuse_compiled_vmap_dropout(_OP_NAME)
        keep = _drawn_keep_mask_op(q.detach(), k.shape[2], dropout_p)
    elif dropout_p > 0:  # drawn here, where vmap sees the draw and applies its randomness
        seed = rng.host_call_seed(q.device, dropout_p, "attention")
        b, h, lq, _ = q.shape
        keep = dropout_keep_mask(seed, b, h, lq, k.shape[2], dropout_p, device=q.device)
    return _by_reference(q, k, v, attn_mask, kpm, keep, dropout_p, is_causal, scale)


@autocast_off
def _by_reference(q, k, v, attn_mask, kpm, keep, dropout_p, is_causal, scale):
    """(out, lse) by the reference's operations with the keep-mask `keep`, in float32 for
    16-bit inputs as the kernels compute; differentiable (to any order) where autograd records."""
    wq, wk, wv, wmask = _wide(q, k, v, attn_mask)
    gqa = k.shape[1] != q.shape[1]
    out, lse = reference.scaled_dot_product_attention(
        wq, wk, wv, wmask, dropout_p, is_causal, scale, gqa, key_padding_mask=kpm,
        dropout_mask=keep, return_lse=True,
    )  # fmt: skip
    return out.to(q.dtype), lse.to(lse_dtype(q.dtype))


@torch.library.custom_op(
    "fastformer::attention_drawn_keep_mask", mutates_args=(), tags=DRAWS_A_SEED
)
def _drawn_keep_mask_op(query: Tensor, seq_k: int, dropout_p: float) -> Tensor:
    """Draws a seed when it runs (also under torch.compile) and returns the (B, H, Lq, seq_k)
    keep-mask the kernels would use with it: `_transformed`'s dropout inside torch.compile."""
    _check_drawn_keep_mask(query, seq_k, dropout_p)
    seed = rng.draw_seed(query.device)
    b, h, lq, _ = query.shape
    return dropout_keep_mask(seed, b, h, lq, seq_k, dropout_p, device=query.device)


@_drawn_keep_mask_op.register_fake
def _(query, seq_k, dropout_p):
    _check_drawn_keep_mask(query, seq_k, dropout_p)
    return query.new_empty(*query.shape[:3], seq_k, dtype=torch.bool)


def _check_drawn_keep_mask(query: Tensor, seq_k: int, dropout_p: float) -> None:
    fn = "attention_drawn_keep_mask"
    if query.dim() != 4:
        raise ValueError(f"{fn}: query must be 4-D (batch, heads, seq, head_dim), got shape "
                         f"{tuple(query.shape)}")  # fmt: skip
    if seq_k < 0:
        raise ValueError(f"{fn}: seq_k must be >= 0, got {seq_k}")
    _check_dropout_p(fn, dropout_p)


def _any_requires_grad(*tensors: Tensor | None) -> bool:
    return any(t is not None and t.requires_grad for t in tensors)


def dropout_keep_mask(
    seed: int,
    batch: int,
    heads: int,
    seq_q: int,
    seq_k: int,
    dropout_p: float,
    device: torch.device | str | None = None,
) -> Tensor:
    """The bool (batch, heads, seq_q, seq_k) keep-mask a call with this `seed` used.

    keep[b, h, i, j] = half l of word w of philox4x32(seed, ((b * heads + h) << 32) + i * C
    + 4 g + c) >= round(dropout_p * 65536), where j = 32 g + 8 w + 2 c + l and
    C = dropout_calls(seq_k) (see the module docstring), computed on `device`: on CPU by the
    compiled kernel torch.ops.fastformer.attention_keep_mask (tests/test_rng.py holds it equal to
    the PyTorch spelling), elsewhere in plain PyTorch.
    """
    sizes = dict(batch=batch, heads=heads, seq_q=seq_q, seq_k=seq_k)
    keep_error = rng.ATTENTION_KEEP_ERROR
    rng.check_keep_mask_args("dropout_keep_mask", seed, sizes, dropout_p, keep_error)
    _check_dropout_size("dropout_keep_mask", seq_q, seq_k)
    calls = dropout_calls(seq_k)
    bh = torch.arange(batch * heads, dtype=torch.int64, device=device) << 32
    if rng.compiled_cpu_kernels(bh.device, seed):  # rows: the counter of each (i, 0)
        rows = bh[:, None] + torch.arange(seq_q, dtype=torch.int64, device=bh.device) * calls
        keep = torch.ops.fastformer.attention_keep_mask(
            seed, rows, seq_k, dropout_threshold(dropout_p)
        )
        return keep.view(batch, heads, seq_q, seq_k)
    ic = torch.arange(seq_q * calls, dtype=torch.int64, device=device)
    offsets = (bh[:, None] + ic[None, :]).view(batch * heads, seq_q, calls // 4, 4)
    words = torch.stack(rng.philox4x32(seed, offsets), -1)  # (BH, Lq, g, c, w) uint32 values
    halves = torch.stack([words & 0xFFFF, words >> 16], -1)  # (BH, Lq, g, c, w, l)
    lanes = halves.transpose(3, 4).reshape(batch, heads, seq_q, calls * 8)[..., :seq_k]
    return lanes >= dropout_threshold(dropout_p)


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the log-sum-exp for inputs of `dtype`: float32, float64 for float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dropout_calls(seq_k: int) -> int:
    """Philox calls per query row of the attention dropout scheme: 4 per 32 key columns."""
    return 4 * -(-seq_k // DROPOUT_BLOCK)


def dropout_threshold(dropout_p: float) -> int:
    """The integer keep threshold t of the scheme: a score is kept when its 16-bit lane >= t."""
    return round(dropout_p * 65536)


# --------------------------------------------------------------------------- validation


def _check_inputs(
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask
) -> float | None:
    """Raise TypeError/ValueError naming the bad argument; return the scale as a float, or None
    (the default, which `_resolve_scale` turns into 1 / sqrt(D))."""
    _check_qkv(query, key, value, enable_gqa)
    if attn_mask is not None:
        _check_attn_mask(attn_mask, query, key)
    if key_padding_mask is not None:
        _check_key_padding_mask(key_padding_mask, query, key)
    _check_dropout_p(_OP_NAME, dropout_p)
    if dropout_p > 0:
        _check_dropout_size(_OP_NAME, query.shape[2], key.shape[2])
    _check_is_causal(is_causal)
    if scale is None:
        return None
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool):
        raise TypeError(f"{_OP_NAME}: scale must be a float or None, got {type_name(scale)}")
    return positive_float(_OP_NAME, "scale", scale)


def _check_is_causal(is_causal) -> None:
    if not isinstance(is_causal, bool):
        raise TypeError(f"{_OP_NAME}: is_causal must be a bool, got {type_name(is_causal)}")


def _causal_bias(query, key, value, attn_mask, is_causal, enable_gqa):
    """(attn_mask, is_causal) for the op: a CausalBias as what it stands for, else as given.

    A CausalBias is a tensor of uninitialized values to anything but torch's SDPA: read as a
    float mask it would give a wrong answer without an error.
    """
    if not isinstance(attn_mask, CausalBias):
        return attn_mask, is_causal
    _check_qkv(query, key, value, enable_gqa)
    _check_is_causal(is_causal)
    if is_causal:
        raise ValueError(
            f"{_OP_NAME}: attn_mask is a CausalBias and is_causal=True: pass one of them "
            "(torch's SDPA refuses both too)"
        )
    lq, lk = query.shape[2], key.shape[2]
    size = (attn_mask.seq_len_q, attn_mask.seq_len_kv)
    if size != (lq, lk):
        raise ValueError(
            f"{_OP_NAME}: attn_mask is a CausalBias of size (seq_len_q, seq_len_kv) = {size}, "
            f"expected (seq_q, seq_k) = {(lq, lk)} of query and key"
        )
    if attn_mask.variant == CausalVariant.UPPER_LEFT or lq == lk:
        return None, True
    # The kernels' causal tiles are aligned top-left: lower right of Lq != Lk is a mask they
    # read (no tile skipped; a decoding step's few queries see nearly every key anyway).
    return reference.causal_bias_mask(attn_mask, is_causal, query.device), False


def _check_qkv(query, key, value, enable_gqa) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{_OP_NAME}: {name} must be a torch.Tensor, got {type_name(t)}")
        check_dense(_OP_NAME, name, t)
        if t.dim() != 4:
            raise ValueError(
                f"{_OP_NAME}: {name} must be 4-D (batch, heads, seq, head_dim), got shape "
                f"{tuple(t.shape)}"
            )
        if t.dtype not in _DTYPES:
            raise TypeError(
                f"{_OP_NAME}: {name} must be float16, bfloat16, float32 or float64, got {t.dtype}"
            )
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            raise TypeError(
                f"{_OP_NAME}: {name} has dtype {t.dtype} but query has {query.dtype}: q, k, v "
                "must share one dtype"
            )
        if t.device != query.device:
            raise ValueError(f"{_OP_NAME}: {name} is on {t.device} but query is on {query.device}")
        if t.shape[0] != query.shape[0]:
            raise ValueError(
                f"{_OP_NAME}: {name} has batch {t.shape[0]} but query has batch {query.shape[0]}"
            )
    if value.shape[1] != key.shape[1] or value.shape[2] != key.shape[2]:
        raise ValueError(
            f"{_OP_NAME}: value (B, Hkv, Lk, Dv) = {tuple(value.shape)} must match key "
            f"{tuple(key.shape)} in heads and sequence length"
        )
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(
            f"{_OP_NAME}: key head_dim {key.shape[-1]} must equal query head_dim {query.shape[-1]}"
        )
    for name, d in (("query/key head_dim", query.shape[-1]), ("value head_dim", value.shape[-1])):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"{_OP_NAME}: {name} must be in [1, {MAX_HEAD_DIM}], got {d}")
    _check_heads(query.shape[1], key.shape[1], enable_gqa)


def _check_heads(h: int, hkv: int, enable_gqa) -> None:
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"{_OP_NAME}: enable_gqa must be a bool, got {type_name(enable_gqa)}")
    if enable_gqa:
        if hkv == 0 or h % hkv != 0:
            raise ValueError(
                f"{_OP_NAME}: enable_gqa needs query heads ({h}) divisible by key/value "
                f"heads ({hkv})"
            )
    elif hkv != h:
        raise ValueError(
            f"{_OP_NAME}: query has {h} heads but key/value have {hkv}; pass "
            "enable_gqa=True for grouped-query attention"
        )


def _check_attn_mask(mask, query: Tensor, key: Tensor) -> None:
    if not isinstance(mask, Tensor):
        raise TypeError(
            f"{_OP_NAME}: attn_mask must be a torch.Tensor or None, got {type_name(mask)}"
        )
    check_dense(_OP_NAME, "attn_mask", mask)
    floats = dict.fromkeys((query.dtype, torch.float32))  # the query's dtype first, no repeat
    if mask.dtype != torch.bool and mask.dtype not in floats:
        allowed = " or ".join(str(d) for d in floats)
        raise TypeError(
            f"{_OP_NAME}: attn_mask must be bool or float ({allowed}), got {mask.dtype}"
        )
    if mask.device != query.device:
        raise ValueError(
            f"{_OP_NAME}: attn_mask is on {mask.device} but query is on {query.device}"
        )
    target = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    if mask.dim() > 4:
        raise ValueError(
            f"{_OP_NAME}: attn_mask must have at most 4 dims, broadcastable to (batch, heads, "
            f"seq_q, seq_k) = {target}, got shape {tuple(mask.shape)}"
        )
    for dim in range(-1, -mask.dim() - 1, -1):
        if mask.shape[dim] not in (1, target[dim]):
            raise ValueError(
                f"{_OP_NAME}: attn_mask of shape {tuple(mask.shape)} is not broadcastable to "
                f"(batch, heads, seq_q, seq_k) = {target}: its {_MASK_DIMS[dim]} dim has size "
                f"{mask.shape[dim]}, expected 1 or {target[dim]}"
            )


def _check_key_padding_mask(kpm, query: Tensor, key: Tensor) -> None:
    if not isinstance(kpm, Tensor):
        raise TypeError(
            f"{_OP_NAME}: key_padding_mask must be a torch.Tensor or None, got {type_name(kpm)}"
        )
    check_dense(_OP_NAME, "key_padding_mask", kpm)
    if kpm.dtype != torch.bool:
        raise TypeError(
            f"{_OP_NAME}: key_padding_mask must be bool (True = padding), got {kpm.dtype}"
        )
    expected = (query.shape[0], key.shape[2])
    if tuple(kpm.shape) != expected:
        raise ValueError(
            f"{_OP_NAME}: key_padding_mask must have shape (batch, seq_k) = {expected}, got "
            f"{tuple(kpm.shape)}"
        )
    if kpm.device != query.device:
        raise ValueError(
            f"{_OP_NAME}: key_padding_mask is on {kpm.device} but query is on {query.device}"
        )


def _check_dropout_p(fn: str, dropout_p) -> None:
    rng.check_dropout_p(fn, dropout_p, keep_error=rng.ATTENTION_KEEP_ERROR)


def _check_dropout_size(fn: str, seq_q: int, seq_k: int) -> None:
    # Symbolic sizes (torch.export, dynamic shapes) raise only where the overflow is certain: a
    # guard on this product made export's solver fail on an unbounded sequence Dim. The op's
    # eager run checks its concrete sizes.
    too_big = seq_q * dropout_calls(seq_k) >= MAX_DROPOUT_CALLS
    if isinstance(too_big, torch.SymBool):  # (under torch.jit.trace sizes are tensors)
        too_big = statically_known_true(too_big)
    if too_big:
        raise ValueError(
            f"{fn}: dropout needs seq_q * 4 * ceil(seq_k / 32) < 2**32 (the low 32 bits of the "
            f"Philox counter number the calls of a (batch, head)), got seq_q={seq_q}, "
            f"seq_k={seq_k}"
        )


def _resolve_scale(scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


# --------------------------------------------------------------------------- backends


@dataclass(frozen=True)
class AttentionInputs:
    """What backend choice looks at: the query and whatever else the caller knows (the value
    head dim, or the key / value / attn_mask tensors themselves: the most complete answer)."""

    query: Tensor
    value_head_dim: int | None = None
    key: Tensor | None = None
    value: Tensor | None = None
    attn_mask: Tensor | None = None


def backend_reasons(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    key_padding_mask: Tensor | None = None,
) -> list[tuple[str, list[str]]]:
    """(backend, reasons it cannot run) for a call with these arguments, in preference order.

    Checks every argument as the op does (the same TypeError / ValueError for a call that would
    raise). The choice itself reads only query, key, value and attn_mask (devices, dtypes,
    shapes, the mask's layout): dropout_p, is_causal, scale, enable_gqa and key_padding_mask
    never change it (every backend takes them all).
    """
    attn_mask, is_causal = _causal_bias(query, key, value, attn_mask, is_causal, enable_gqa)
    _check_inputs(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask
    )
    return explain(OP, AttentionInputs(query, key=key, value=value, attn_mask=attn_mask))


def sdpa_call_reasons(
    query: object,
    key: object,
    value: object,
    attn_mask: object = None,
    dropout_p: object = 0.0,
    is_causal: object = False,
    scale: object = None,
    enable_gqa: object = False,
) -> list[str]:
    """Why `torch.nn.functional.scaled_dot_product_attention` with these arguments would not
    run as this op (`fastformer.patch_sdpa`); [] where it runs the Triton kernel with torch's
    result.

    Not taken: tensor subclasses (nested, DTensor: their own dispatch; a CausalBias mask is
    this op's), other than 4-D inputs, is_causal with a mask (torch 2.14 raises, 2.11 applies
    both on the CPU), arguments the op refuses (a scale <= 0, say, which torch takes), and,
    outside torch.compile, calls the op would not give its Triton kernel (CPU tensors, say).
    Inside torch.compile the op picks its backend at run time.
    """
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    checked = _sdpa_call_args(*args)
    return checked if isinstance(checked, list) else []


def sdpa_call(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor | None:
    """`torch.nn.functional.scaled_dot_product_attention(...)` computed by this op, or None
    where the op does not take the call (`sdpa_call_reasons`); its arguments checked once."""
    out = _sdpa_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return None if isinstance(out, list) else out


def _sdpa_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """`sdpa_call`'s output, or the reasons the op does not take the call (`sdpa_call_reasons`)."""
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    checked = _sdpa_call_args(*args)
    if isinstance(checked, list):
        return checked
    mask, causal, scale = checked
    return _checked_call(query, key, value, mask, None, dropout_p, causal, scale)[0]


def _sdpa_call_args(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """(attn_mask, is_causal, scale) of torch's SDPA call for `_checked_call`, or the list of
    reasons the op does not take it (`sdpa_call_reasons`)."""
    if not _plain_tensors(query, key, value):
        return ["query, key or value is not a plain tensor (a subclass, or nested)"]
    if not query.dim() == key.dim() == value.dim() == 4:
        dims = f"{query.dim()}-D, {key.dim()}-D and {value.dim()}-D"
        return [f"query, key and value are {dims}, not 4-D (batch, heads, seq, head_dim)"]
    if not (attn_mask is None or isinstance(attn_mask, CausalBias) or _plain_tensors(attn_mask)):
        return ["attn_mask is not a plain tensor (a subclass, or nested)"]
    if is_causal is not False and attn_mask is not None:
        return ["is_causal=True with attn_mask: torch's SDPA decides (2.14 refuses the pair)"]
    try:
        mask, causal = _causal_bias(query, key, value, attn_mask, is_causal, enable_gqa)
        scale = _check_inputs(query, key, value, mask, dropout_p, causal, scale, enable_gqa, None)
    except (TypeError, ValueError) as error:
        return [str(error)]
    if not torch.compiler.is_compiling():
        backend = _backend(query, key, value, mask)
        if backend != "triton":
            return [f"the op gives this call its {backend} backend, not the Triton kernel "
                    "(backend_reasons says why)"]  # fmt: skip
    return mask, causal, scale


def _plain_tensors(*tensors: object) -> bool:
    # FakeTensor and dynamo's tensors have no __torch_function__ of their own; CausalBias,
    # DTensor and the masked and nested subclasses do, or are nested.
    return all(
        isinstance(t, Tensor) and not t.is_nested for t in tensors
    ) and not torch.overrides.has_torch_function(tensors)


def _as_inputs(inputs) -> AttentionInputs | None:
    # Callers may pass the query tensor alone (fastformer.nn does).
    return AttentionInputs(inputs) if isinstance(inputs, Tensor) else inputs


@functools.cache
def _kernels():
    # Imported on first use (Triton is not needed before); cached: an import statement costs
    # ~2 us a call on the CI VM, several a call of the op.
    from fastformer.kernels import attention as kernels

    return kernels


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _interpreter_reasons() -> list[str]:
    # Triton < 3.7's interpreter calls int() on 1-element arrays (loop bounds loaded from
    # memory), which NumPy 2.4 turned from a deprecation warning into a TypeError.
    import numpy
    import triton

    if _version(triton.__version__) < (3, 7) and _version(numpy.__version__) >= (2, 4):
        return [
            f"the Triton {triton.__version__} interpreter cannot run with NumPy "
            f"{numpy.__version__} (int() of a 1-element array is an error since NumPy 2.4; "
            "fixed in Triton 3.7): install 'numpy<2.4' or 'triton>=3.7'"
        ]
    return []


def _triton_reasons(inputs) -> list[str]:
    """Why the Triton kernel cannot run `inputs` (None: this environment)."""
    if find_spec("triton") is None:
        return ["triton is not installed"]
    interpreted = _kernels().INTERPRETED
    inputs = _as_inputs(inputs)
    if inputs is None:
        if not torch.cuda.is_available() and not interpreted:
            return ["no CUDA device (on CPU the Triton kernel runs only under TRITON_INTERPRET=1)"]
        return _interpreter_reasons() if interpreted else []
    q = inputs.query
    reasons = []
    if q.dtype not in _KERNEL_DTYPES:
        reasons.append(f"{q.dtype}: the kernel takes float16, bfloat16 or float32")
    if q.device.type == "cuda":
        if interpreted:
            reasons.append(
                "TRITON_INTERPRET=1 was set when the kernels were imported: the "
                "interpreter runs CPU tensors only"
            )
        elif torch.cuda.get_device_capability(q.device)[0] < 8:
            reasons.append("needs an NVIDIA GPU of compute capability >= 8.0")
    elif q.device.type == "cpu":
        if not interpreted:
            reasons.append(
                "CPU tensors run the Triton kernel only under TRITON_INTERPRET=1 (the "
                "Triton interpreter, for tests)"
            )
        elif q.dtype == torch.bfloat16:
            reasons.append(
                "bfloat16 is not supported by the Triton interpreter (tl.dot on bf16 "
                "is broken there)"
            )
        else:
            reasons += _interpreter_reasons()
    else:
        reasons.append(f"no Triton kernel for device type {q.device.type!r}")
    return reasons + _shape_reasons(inputs)


def _shape_reasons(inputs: AttentionInputs) -> list[str]:
    """Head dims over 256, (batch, head) slices too large for the kernels' int32 offsets, and
    batches or head counts beyond the kernels' grid."""
    limit = _kernels().INT32_LIMIT
    reasons = []
    for name in ("query", "key", "value"):
        t = getattr(inputs, name)
        if t is None or t.dim() != 4:
            continue
        if t.shape[-1] > MAX_HEAD_DIM:
            reasons.append(f"{name} head dim must be <= {MAX_HEAD_DIM}, got {t.shape[-1]}")
        if t.shape[2] * t.shape[3] >= limit:
            reasons.append(
                f"a (batch, head) slice of {name} has {t.shape[2] * t.shape[3]} elements: the "
                "kernel's int32 offsets need < 2**31"
            )
    q = inputs.query
    if q is not None and q.dim() == 4:
        reasons += _grid_reasons(q.shape[0], q.shape[1])
    if inputs.value is None and (inputs.value_head_dim or 0) > MAX_HEAD_DIM:
        reasons.append(f"value head dim must be <= {MAX_HEAD_DIM}, got {inputs.value_head_dim}")
    value = inputs.value
    dv = value.shape[-1] if value is not None and value.dim() == 4 else inputs.value_head_dim
    if q is not None and q.dim() == 4 and dv and q.shape[2] * dv >= limit:  # out, grad_out
        reasons.append(
            f"a (batch, head) slice of the output has {q.shape[2] * dv} elements: the "
            "kernel's int32 offsets need < 2**31"
        )
    return reasons + _mask_reasons(inputs, limit)


def _mask_reasons(inputs: AttentionInputs, limit: int) -> list[str]:
    """An attn_mask whose slice, or whose gradient's rows in one dq block, pass int32 offsets."""
    mask, reasons = inputs.attn_mask, []
    if mask is None:
        return reasons
    extent = 0  # (a mask of 0 or 1 dims spans at most one row; over 4 dims the op refuses)
    if 2 <= mask.dim() <= 4:
        extent = _kernels().slice_extent(mask[(None,) * (4 - mask.dim())])
    if extent >= limit:
        reasons.append(
            f"attn_mask spans {extent + 1} elements per (batch, head): the kernel's int32 "
            "offsets need < 2**31"
        )
    # (Whether the gradient will be asked for is not known here: inside the op no input
    # requires grad. A float mask may need one.)
    key = inputs.key
    if mask.is_floating_point() and key is not None and key.dim() == 4:
        rows = _kernels().DQ_MAX_BLOCK_M
        if rows * key.shape[2] > limit:
            reasons.append(
                f"a float attn_mask's gradient over {key.shape[2]} keys: the kernel's int32 "
                f"offsets need {rows} * seq_k <= 2**31"
            )
    return reasons


def _grid_reasons(batch: int, heads: int) -> list[str]:
    """The kernels' grid gives batch and heads a dim each (CUDA: 65535 at most) and numbers the
    (batch, head) pairs in int32."""
    kernels = _kernels()
    if max(batch, heads) > kernels.MAX_GRID_YZ:
        return [
            f"batch {batch} and heads {heads} must each be <= {kernels.MAX_GRID_YZ} (CUDA's "
            "grid limit)"
        ]
    if batch * heads >= kernels.INT32_LIMIT:
        return [f"batch x heads is {batch * heads}: the kernels number them in int32 (< 2**31)"]
    return []


def _torch_reasons(inputs) -> list[str]:
    return []


register(OP, [Backend("triton", _triton_reasons), Backend("torch", _torch_reasons)])


# --------------------------------------------------------------------------- torch backend


# torch's own fused CPU attention (SDPA's CPU flash kernels: tiled, fp32 accumulation, no
# Lq x Lk scores held). Private aten ops, present in the torch versions fastformer supports; when
# missing, the torch backend uses the reference for everything.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BWD = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None
)


def _cpu_flash_ok(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, scale) -> bool:
    """Whether torch's CPU flash kernels compute this call: no dropout (fastformer's Philox mask
    cannot be fed to them), CPU, one head dim for q/k/v, no empty dimension, and a scale in
    float32's normal range (below it they return NaN for masked keys). A float32 mask of
    16-bit q is theirs too: they add it in float32, as the Triton kernels and the reference do
    (torch 2.11 and 2.14; it must not be cast to q's dtype first)."""
    return (
        scale >= 2.0**-126
        and _CPU_FLASH is not None
        and _CPU_FLASH_BWD is not None
        and dropout_p == 0
        and q.device.type == "cpu"
        and q.dtype in _DTYPES
        and q.shape[-1] == v.shape[-1]
        and q.numel() > 0
        and k.numel() > 0
    )


def _cpu_flash_mask(q: Tensor, attn_mask, kpm) -> Tensor | None:
    """The one additive 4-D mask the CPU flash kernels take: a bool mask and key padding
    become -inf, as in the reference; a float mask keeps its dtype (q's, or float32 for 16-bit
    q), but a float32 one of float64 q becomes float64: from 16 keys on, the kernels of torch
    2.11 to 2.15 took it wrong (outputs off by 0.3-1.9; found by a fuzz)."""
    if attn_mask is None and kpm is None:
        return None
    keep = None if attn_mask is None or attn_mask.is_floating_point() else attn_mask
    if kpm is not None:
        keep = ~kpm[:, None, None, :] if keep is None else keep & ~kpm[:, None, None, :]
    add = torch.zeros((), dtype=q.dtype, device=q.device)
    if attn_mask is not None and attn_mask.is_floating_point():
        add = attn_mask if q.dtype in _HALF else attn_mask.to(q.dtype)
    mask = add if keep is None else torch.where(keep, add, float("-inf"))
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def _rows_without_key(mask: Tensor | None, lq: int, lk: int, is_causal: bool):
    """Bool (.., Lq) of the query rows `mask` (and causality) leave no key, or None if none."""
    if mask is None:
        return None  # causal alone leaves key 0 to every row
    visible = mask != float("-inf")
    if is_causal:  # row i has a key iff its first visible key is at most i (no Lq x Lk tril)
        first = torch.where(visible.any(-1), visible.byte().argmax(-1), lq)  # argmax: the first
        empty = first > torch.arange(lq, device=mask.device)
    else:
        empty = ~visible.any(-1)
    return empty if bool(empty.any()) else None


def _flash_inputs(*tensors: Tensor) -> list[Tensor]:
    # torch 2.11's CPU flash kernels read q, k and v as if their last stride were 1 (wrong
    # results otherwise, measured; 2.14 reads them right). out and grad_out get the same care.
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


def _sum_kv_groups(grad: Tensor, hkv: int) -> Tensor:
    """A (B, H, L, D) gradient summed over the query heads each of the hkv key/value heads
    served (GQA); unchanged when H == hkv."""
    if grad.shape[1] == hkv:
        return grad
    # (reshape, not unflatten: autograd's legacy vmap, is_grads_batched, has no rule for it;
    # the group size spelled out: reshape cannot infer a -1 of an empty batch or key length)
    b, h, *rest = grad.shape
    return grad.reshape(b, hkv, h // hkv, *rest).sum(2)


def _cpu_flash_forward(q, k, v, attn_mask, kpm, is_causal, scale):
    mask = _cpu_flash_mask(q, attn_mask, kpm)
    k, v = reference._repeat_kv_heads(q, k, v, k.shape[1] != q.shape[1])
    empty = _rows_without_key(mask, q.shape[2], k.shape[2], is_causal)
    q, k, v = _flash_inputs(_without_rows(q, empty), k, v)
    out, lse = _CPU_FLASH(q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)
    if empty is not None:  # the kernel leaves lse 0 there; the op's convention is -inf
        lse = lse.masked_fill(empty, float("-inf"))
    # The kernel takes a row whose max score is NaN for a row without keys (out 0, lse 0): a
    # NaN in a query row with keys gives NaN, as in the reference and the Triton kernels. Only
    # rows of lse 0 are looked at (one reduction over lse a call, not a pass over q).
    if not bool(lse.all()):
        nan_rows = (lse == 0) & q.isnan().any(-1)
        out.masked_fill_(nan_rows[..., None], float("nan"))
        lse = lse.masked_fill(nan_rows, float("nan"))
    return out, lse


def _without_rows(q: Tensor, empty: Tensor | None) -> Tensor:
    """q with the rows `empty` marks (rows without a key) zeroed: the kernels' masked scores
    are then -inf, not NaN + -inf (a NaN query there gave NaN where the op gives 0)."""
    return q if empty is None else q.masked_fill(empty[..., None], 0.0)


def _cpu_flash_backward(
    grad_out, q, k, v, out, lse, attn_mask, kpm, is_causal, scale, lse_min=-math.inf
):  # fmt: skip
    """lse_min: lse's least value (`_lse_bounds`); above -inf (not NaN) no row is without a
    key, and lse goes to the kernel as it is."""
    mask = _cpu_flash_mask(q, attn_mask, kpm)
    hkv = k.shape[1]
    k, v = reference._repeat_kv_heads(q, k, v, hkv != q.shape[1])
    empty = None
    if not lse_min > -math.inf:
        # Rows without a key: back to the kernel's own lse 0 (with -inf, exp(-inf - lse) is NaN).
        empty = torch.isneginf(lse)
        lse = lse.masked_fill(empty, 0.0)
        empty = empty if bool(empty.any()) else None
    q, k, v, grad_out, out = _flash_inputs(_without_rows(q, empty), k, v, grad_out, out)
    dq, dk, dv = _CPU_FLASH_BWD(
        grad_out, q, k, v, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale
    )
    return dq, _sum_kv_groups(dk, hkv), _sum_kv_groups(dv, hkv)


@autocast_off
def _torch_forward(q, k, v, attn_mask, kpm, seed, dropout_p, is_causal, scale):
    """torch's CPU flash kernels where they apply (`_cpu_flash_ok`), else the eager reference
    with the Philox keep-mask of `seed` (materialized: fine here)."""
    if _cpu_flash_ok(q, k, v, dropout_p, scale):
        return _cpu_flash_forward(q, k, v, attn_mask, kpm, is_causal, scale)
    return _reference_forward(q, k, v, attn_mask, kpm, seed, dropout_p, is_causal, scale)


def _wide(*tensors: Tensor | None) -> list[Tensor | None]:
    """float16 / bfloat16 tensors as float32: the torch backend computes softmax, products and
    gradients in float32 like the kernels (in 16 bits its explicit backward, ordered otherwise
    than autograd's, lost up to ~3x the 16-bit reference's error with dropout). Others as they
    are."""
    return [t.float() if t is not None and t.dtype in _HALF else t for t in tensors]


def _reference_forward(q, k, v, attn_mask, kpm, seed, dropout_p, is_causal, scale):
    """The reference's function with the Philox keep-mask of `seed`, computed with fewer
    passes than the reference's safe softmax (`_softmax`): on CPU its out-of-place elementwise
    passes cost more than the two matrix products."""
    b, h, lq, _ = q.shape
    wq, wk, wv, wmask = _wide(q, k, v, attn_mask)
    kh, vh = reference._repeat_kv_heads(wq, wk, wv, k.shape[1] != h)
    scores = reference._attention_scores(wq, kh, wmask, is_causal, scale, kpm)
    probs, lse = _softmax_dropped(seed, scores, dropout_p)
    return (probs @ vh).to(q.dtype), lse  # lse: float32 for 16-bit q, lse_dtype(q.dtype)


def _fused_softmax(seed, dropout_p: float, scores: Tensor, *others: Tensor | None):
    """(seed, threshold, scale) of torch.ops.fastformer.attention_softmax_ and its backward where
    they serve these tensors (contiguous CPU float32 / float64, none batched by vmap, a key, the
    extension loaded, a seed below 2**63), else None. Threshold 0 and scale 1: no dropout."""
    seed = seed if dropout_p > 0 else 0
    tensors = (scores, *others)
    if not (
        rng.compiled_cpu_kernels(scores.device, seed)
        and scores.dtype in (torch.float32, torch.float64)
        and scores.shape[-1] > 0
        and all(t is None or (t.is_contiguous() and t.dtype == scores.dtype) for t in tensors)
        and not _batched(*tensors)
    ):
        return None
    if dropout_p == 0:
        return 0, 0, 1.0
    return seed, dropout_threshold(dropout_p), 1.0 / (1.0 - dropout_p)


def _softmax_dropped(seed, scores: Tensor, dropout_p: float) -> tuple[Tensor, Tensor]:
    """(P * K * c, lse): the softmax of `scores` (B, H, Lq, Lk) over Lk, where dropout_p > 0 times
    the keep-mask K of `seed` and c = 1 / (1 - p), and the log-sum-exp of each row before dropout;
    scores's buffer is used up. On CPU in one pass of torch.ops.fastformer.attention_softmax_
    (a max, torch's softmax, a second max and the dropout pass took 1.7x its time at
    (2, 4, 256, 256) on one thread), else by `_softmax` and `_kept_scale`."""
    fused = _fused_softmax(seed, dropout_p, scores)
    if fused is not None:
        lse = scores.new_empty(scores.shape[:-1])
        torch.ops.fastformer.attention_softmax_(scores, lse, *fused)
        return scores, lse
    probs, lse = _softmax(scores, with_lse=True)
    if dropout_p > 0:
        probs.mul_(_kept_scale(seed, probs, dropout_p, out=scores))
    return probs, lse


def _softmax(scores: Tensor, with_lse: bool = False):
    """Softmax over the last dim by torch's fused kernel, where rows with every score masked
    give 0 as in the reference (torch's give NaN); with_lse: also the log-sum-exp, as
    max - log(max probability) (exact to rounding: that probability is exp(max - lse), at
    least 1 / Lk)."""
    if scores.shape[-1] == 0:  # no keys (amax refuses a 0-size dim): lse -inf
        return (scores, scores.new_full(scores.shape[:-1], float("-inf"))) if with_lse else scores
    row_max = scores.amax(-1)
    empty = torch.isneginf(row_max)
    probs = torch.softmax(scores, -1)
    # A pass saved on CPU where no row is empty; a GPU (no sync) always fills. (A
    # torch.jit.trace records the op, which runs this each call: no branch is frozen.)
    if probs.device.type != "cpu" or bool(empty.any()):
        probs.masked_fill_(empty[..., None], 0.0)
    if not with_lse:
        return probs
    return probs, (row_max - probs.amax(-1).log()).masked_fill_(empty, float("-inf"))


def _kept_scale(seed, probs: Tensor, dropout_p: float, out: Tensor | None = None) -> Tensor:
    """`out` (probs's shape and dtype; a buffer the caller is done with; else a new tensor) set
    to the keep-mask K of `seed` times 1 / (1 - p): dropout is then one multiply (two `where`s
    took 4x as long, and a fresh buffer's page faults cost more than the multiply)."""
    b, h, lq, lk = probs.shape
    keep = dropout_keep_mask(seed, b, h, lq, lk, dropout_p, device=probs.device)
    if out is None:
        return keep.to(probs.dtype) * (1.0 / (1.0 - dropout_p))
    return out.copy_(keep).mul_(1.0 / (1.0 - dropout_p))


@autocast_off
def _torch_backward(
    grad_out, grad_lse, q, k, v, out, lse, attn_mask, kpm, seed, dropout_p, is_causal, scale,
    mask_grad,
):  # fmt: skip
    """Gradients through torch's CPU flash backward (from out and lse) where the forward used
    it and only `out` has a gradient, else by `_reference_backward`; the arguments are those of
    kernels.attention.attention_backward."""
    # CPU only: .any() and aminmax never sync with a GPU
    flash = _cpu_flash_ok(q, k, v, dropout_p, scale) and not mask_grad
    bounds = _lse_bounds(lse) if flash else (0.0, 0.0)
    flash = flash and _lse_keeps_its_sum(lse, q, attn_mask, bounds)
    if flash and (grad_lse is None or (not _batched(grad_lse) and not bool(grad_lse.any()))):
        dq, dk, dv = _cpu_flash_backward(
            grad_out, q, k, v, out, lse, attn_mask, kpm, is_causal, scale, bounds[0]
        )
        return dq, dk, dv, None
    return _reference_backward(
        grad_out, grad_lse, q, k, v, attn_mask, kpm, seed, dropout_p, is_causal, scale, mask_grad
    )


def _batched(*tensors: Tensor | None) -> bool:
    """Whether vmap batches any of `tensors` (a backward under is_grads_batched or a jacobian:
    torch.autograd's legacy vmap, or torch.func's)."""
    ft = torch._C._functorch
    return any(
        t is not None and (ft.is_batchedtensor(t) or ft.is_legacy_batchedtensor(t)) for t in tensors
    )


def _lse_bounds(lse: Tensor) -> tuple[float, float]:
    """lse's least and greatest values in one pass (NaN if any is NaN); (0, 0) when empty."""
    if lse.numel() == 0:
        return 0.0, 0.0
    low, high = torch.aminmax(lse)
    return float(low), float(high)


def _lse_keeps_its_sum(
    lse: Tensor, q: Tensor, attn_mask: Tensor | None, bounds: tuple[float, float]
) -> bool:
    """Whether P recomputed from `lse` is accurate (torch's CPU flash backward does so), where
    the kernels would keep a Stat (`_keeps_stat`): not where float32 has rounded away part of
    the log of a row's sum. A float mask's bias of -1e9 on a whole row rounds all of it away
    (every P came out 1 instead of 1 / Lk); float32 q, k, v missed the parity bound from
    |lse| ~ 100 (dq 1.01x at scale 3 on N(0, 1) inputs, d64; dv 5.2x at scale 30). Below 32
    the worst seen was 0.83x the bound (d128). `bounds`: `_lse_bounds(lse)`, which settles
    the common case; rows without a key (-inf) or NaN take a second look."""
    low, high = bounds
    if not _keeps_stat(q, attn_mask) or -32.0 < low <= high < 32.0:
        return True
    finite = torch.where(torch.isfinite(lse), lse, 0.0)
    return bool(finite.abs().amax() < 32.0)  # P within 2**-19 of itself


def _reference_backward(
    grad_out, grad_lse, q, k, v, attn_mask, kpm, seed, dropout_p, is_causal, scale, mask_grad
):  # fmt: skip
    """The reference's gradients written out, on the recomputed probabilities P and the same
    keep-mask K (drop scale c): with S the masked scaled scores and
    O = (P * K * c) V, dV = (P * K * c)^T dO, dP = (dO V^T) * K * c,
    dS = P * (dP - rowsum(P * dP) + dlse), dQ = dS K_heads * scale, dK = dS^T Q * scale,
    d attn_mask = dS summed to its shape. Explicit rather than autograd: inside a custom op the
    Autograd key is excluded, and torch.func's wrapped tensors break the dispatch modes of fake
    tensors and opcheck."""
    dtypes = [t.dtype for t in (q, k, v)]
    mask_dtype = None if attn_mask is None else attn_mask.dtype
    grad_out, grad_lse, q, k, v, attn_mask = _wide(grad_out, grad_lse, q, k, v, attn_mask)
    hkv = k.shape[1]
    kh, vh = reference._repeat_kv_heads(q, k, v, hkv != q.shape[1])
    scores = reference._attention_scores(q, kh, attn_mask, is_causal, scale, kpm)
    grad_probs = grad_out.to(scores.dtype) @ vh.transpose(-2, -1)
    dlse = None if grad_lse is None else grad_lse.to(scores.dtype).contiguous()
    fused = _fused_softmax(seed, dropout_p, scores, grad_probs, dlse)
    if fused is not None:  # scores becomes P * K * c, grad_probs dS
        torch.ops.fastformer.attention_softmax_backward_(scores, grad_probs, dlse, *fused)
        dropped, grad_scores = scores, grad_probs
    else:
        dropped, grad_scores = _softmax_backward(seed, scores, grad_probs, dlse, dropout_p)
    grad_v = dropped.transpose(-2, -1) @ grad_out.to(scores.dtype)
    grad_q = (grad_scores @ kh) * scale
    grad_k = (grad_scores.transpose(-2, -1) @ q) * scale
    grad_k, grad_v = _sum_kv_groups(grad_k, hkv), _sum_kv_groups(grad_v, hkv)
    grad_mask = None
    if mask_grad:
        grad_mask = grad_scores.sum_to_size(attn_mask.shape).to(mask_dtype)
    grads = (grad_q, grad_k, grad_v)
    return (*(g.to(dtype) for g, dtype in zip(grads, dtypes)), grad_mask)


def _softmax_backward(seed, scores: Tensor, grad_probs: Tensor, dlse, dropout_p: float):
    """(P * K * c, dS) as torch.ops.fastformer.attention_softmax_backward_ gives them, by torch
    ops: for other devices, and where vmap batches the gradients (is_grads_batched, jacobians),
    which has no rule for out= and in-place ops on them; elsewhere in place into the (B, H, Lq,
    Lk) buffers."""
    probs = _softmax(scores)
    functional = _batched(grad_probs, dlse)
    dropped = probs
    if dropout_p > 0 and functional:
        kept = _kept_scale(seed, probs, dropout_p)
        dropped, grad_probs = probs * kept, grad_probs * kept
    elif dropout_p > 0:  # scores's buffer is free: it takes K * c, then P * K * c
        kept = _kept_scale(seed, probs, dropout_p, out=scores)
        grad_probs.mul_(kept)
        dropped = kept.mul_(probs)
    # dlse is added after the row sum, not folded into it (attention_softmax.cpp says why)
    if functional:  # (vmap has no rule for einsum here)
        grad_scores = grad_probs - (probs * grad_probs).sum(-1, keepdim=True)
        grad_scores = grad_scores if dlse is None else grad_scores + dlse[..., None]
        return dropped, grad_scores * probs
    # no Lq x Lk product: scores holds the dropped probabilities, which dV still needs
    grad_probs.sub_(torch.einsum("...j,...j->...", probs, grad_probs)[..., None])
    if dlse is not None:
        grad_probs.add_(dlse[..., None])
    return dropped, grad_probs.mul_(probs)


@autocast_off
def _cpu_grads_by_reference(
    grad_out, query, key, value, attn_mask, is_causal, scale, differentiable
):  # fmt: skip
    """(dq, dk, dv) for the CPU entry's autograd node (csrc/attention/attention_eager.cpp calls
    it), whose attn_mask is the additive one (`_cpu_flash_mask`) and whose query has its rows
    without a key zeroed: by autograd through the reference's operations where `differentiable`
    (create_graph=True; an empty tensor for an input that does not require grad), else by
    `_reference_backward`, as `_torch_backward` gives them where lse has rounded."""
    if not differentiable:
        args = (attn_mask, None, 0, 0.0, is_causal, scale, False)
        return list(_reference_backward(grad_out, None, query, key, value, *args)[:3])

    def forward(q, k, v):
        return _by_reference(q, k, v, attn_mask, None, None, 0.0, is_causal, scale)

    grads = differentiable_vjp(forward, (query, key, value), (grad_out, None))
    return tensor_list(grads, query)


# --------------------------------------------------------------------------- custom ops


def _backend(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None) -> str:
    # The backends' reasons read the device, dtype and shapes, and the mask's geometry: one
    # choice per those (~1.5 us a call instead of ~10 on the CI VM, 18 calls a model step).
    mask = None if attn_mask is None else (attn_mask.dtype, attn_mask.shape, attn_mask.stride())
    key = (q.device, q.dtype, q.shape, k.shape, v.shape, mask)
    return select_by_key(OP, key, lambda: AttentionInputs(q, key=k, value=v, attn_mask=attn_mask))


@torch.library.custom_op("fastformer::attention", mutates_args=(), tags=DRAWS_A_SEED)
def _attention_op(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor],  # noqa: UP045 (torch's schema inference wants typing.Optional)
    key_padding_mask: Optional[Tensor],  # noqa: UP045
    dropout_p: float,
    is_causal: bool,
    scale: Optional[float],  # noqa: UP045 (None: 1 / sqrt(D))
    needs_grad: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out, lse, seed, stat, out32): seed is an int64 scalar on the query's device, drawn
    here at run time when dropout_p > 0 (`rng.seed_output`);
    stat (B, H, Lq, 2) float32 where `_keeps_stat`: the Triton forward's row statistics for
    its backward; out32 (B, H, Lq, Dv) float32 where `_keeps_out32` (needs_grad: the caller
    will differentiate): out before its rounding, for the backward. Both are zeros from the
    torch backend, which does not read them, and empty where not kept."""
    # Callers of torch.ops.fastformer.attention skip the public checks; torch's CPU flash
    # kernel read past a key of fewer batches than the query (a segfault).
    scale = _check_inputs(
        query, key, value, attn_mask, dropout_p, is_causal, scale, True, key_padding_mask
    )
    scale = _resolve_scale(scale, query.shape[-1])
    args = (query, key, value, attn_mask, key_padding_mask, dropout_p, is_causal, scale)
    out, lse, seed, stat, out32 = _forward(*args, needs_grad=needs_grad)
    # Contiguous like the fake: inductor trusts its strides. The torch backend's tensors may
    # be (B, L, H, D) views, kept in eager calls, where that layout is what a caller with
    # (B, L, H * D) projections reshapes for free.
    if stat is None:  # the fake's shapes (it cannot know the backend); never read
        stat = _new_stat(query, attn_mask).zero_()
    if out32 is None:  # not kept, or the torch backend's (never read)
        out32 = _new_out32(query, value, attn_mask, needs_grad).zero_()
    seed = rng.seed_output(seed, query.device)
    return out.contiguous(), lse.contiguous(), seed, stat, out32


def _forward(
    query, key, value, attn_mask, key_padding_mask, dropout_p, is_causal, scale, backend=None,
    kv_range=None, like_query=False, needs_grad=False,
):  # fmt: skip
    """(out, lse, seed, stat, out32); stat and out32 None from the torch backend, out32 None
    where not kept (`_keeps_out32`)."""
    # like_query (eager calls): out in the query's memory order, as the torch backend's may be.
    seed = rng.call_seed(query.device, dropout_p)
    args = (query, key, value, attn_mask, key_padding_mask, seed, dropout_p, is_causal, scale)
    stat = out32 = None
    if (backend or _backend(query, key, value, attn_mask)) == "triton":
        stat = _row_stat(query, key, attn_mask)
        if _keeps_out32(query, attn_mask, needs_grad):
            out32 = _new_out32(query, value, attn_mask, needs_grad)
        out, lse = _kernels().attention_forward(
            *args, kv_range=kv_range, like_query=like_query, stat=stat, out32=out32
        )
    else:
        rng.check_host_seed(seed, "attention")
        out, lse = _torch_forward(*args)
    return out, lse, seed, stat, out32


def _row_stat(query: Tensor, key: Tensor, attn_mask: Tensor | None) -> Tensor | None:
    """The (B, H, Lq, 2) float32 buffer in which the Triton forward leaves its row statistics
    for the backward (kernels.attention.attention_forward's `stat`), where `_keeps_stat`."""
    if key.shape[2] == 0 or not _keeps_stat(query, attn_mask):
        return None
    return _new_stat(query, attn_mask)


@_attention_op.register_fake
def _attention_fake(
    query, key, value, attn_mask, key_padding_mask, dropout_p, is_causal, scale, needs_grad=False
):  # fmt: skip
    _check_inputs(query, key, value, attn_mask, dropout_p, is_causal, scale, True,
                  key_padding_mask)  # fmt: skip
    b, h, lq, _ = query.shape
    out = query.new_empty(b, h, lq, value.shape[-1])
    lse = query.new_empty(b, h, lq, dtype=lse_dtype(query.dtype))
    seed = query.new_empty((), dtype=torch.int64)  # rng.seed_output
    stat, out32 = _new_stat(query, attn_mask), _new_out32(query, value, attn_mask, needs_grad)
    return out, lse, seed, stat, out32


def _keeps_stat(query: Tensor, attn_mask: Tensor | None) -> bool:
    # The row max and log2 of the sum apart (the LSE rounds their sum at the max's magnitude):
    # needed by float masks (a large bias on a whole row) and by float32 parity past |LSE| ~
    # 900; 16-bit inputs' own rounding hides the LSE's, and their 8 bytes a row are spared.
    float_mask = attn_mask is not None and attn_mask.is_floating_point()
    return float_mask or query.dtype == torch.float32


def _new_stat(query: Tensor, attn_mask: Tensor | None) -> Tensor:
    # The op's stat output: (B, H, Lq, 2) float32 where `_keeps_stat`, else empty.
    if _keeps_stat(query, attn_mask):
        return query.new_empty(*query.shape[:3], 2, dtype=torch.float32)
    return query.new_empty(0, dtype=torch.float32)


def _keeps_out32(query: Tensor, attn_mask: Tensor | None, needs_grad: bool) -> bool:
    # The backward's delta = rowsum(dO * O) from O before its rounding to 16 bits, where a
    # float32 mask makes torch compute 16-bit attention in float32: the rounded O's error,
    # amplified through dS = P * (dP - delta), took gradients (d attn_mask the most) up to
    # 2.7x past the parity bound. O-sized, next to the mask's Lq x Lk float32.
    float32_mask = attn_mask is not None and attn_mask.dtype == torch.float32
    return needs_grad and float32_mask and query.dtype in _HALF


def _new_out32(query: Tensor, value: Tensor, attn_mask: Tensor | None, needs_grad: bool):
    # The op's out32 output: (B, H, Lq, Dv) float32 where `_keeps_out32`, else empty.
    if _keeps_out32(query, attn_mask, needs_grad):
        return query.new_empty(*query.shape[:3], value.shape[-1], dtype=torch.float32)
    return query.new_empty(0, dtype=torch.float32)


@torch.library.custom_op("fastformer::attention_backward", mutates_args=())
def _attention_backward_op(
    grad_out: Tensor,
    grad_lse: Optional[Tensor],  # noqa: UP045
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    lse: Tensor,
    stat: Tensor,
    out32: Tensor,
    attn_mask: Optional[Tensor],  # noqa: UP045
    key_padding_mask: Optional[Tensor],  # noqa: UP045
    seed: Tensor,
    dropout_p: float,
    is_causal: bool,
    scale: Optional[float],  # noqa: UP045 (None: 1 / sqrt(D))
    mask_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dmask); dmask is empty unless mask_grad (float attn_mask needing grad).
    stat and out32: the forward op's (out32 empty or (B, H, Lq, Dv) float32)."""
    scale = _check_inputs(query, key, value, attn_mask, dropout_p, is_causal, scale, True,
                          key_padding_mask)  # fmt: skip
    scale = _resolve_scale(scale, query.shape[-1])
    saved = (out, lse, stat, out32, seed)
    _check_saved(grad_out, grad_lse, query, value, *saved, attn_mask, mask_grad)
    grads = _backward_kernels(
        grad_out, grad_lse, query, key, value, out, lse, stat, out32, attn_mask,
        key_padding_mask, seed, dropout_p, is_causal, scale, mask_grad,
    )  # fmt: skip
    return tuple(g.contiguous() for g in grads)  # as the fake (see _attention_op)


def _check_saved(
    grad_out, grad_lse, query, value, out, lse, stat, out32, seed, attn_mask, mask_grad
):  # fmt: skip
    """attention_backward's tensors against the forward's geometry (torch's CPU flash backward
    indexes them with q's sizes: smaller ones were read out of bounds)."""
    b, h, lq, _ = query.shape
    # out32 as the forward kept it, or empty (1-D: not kept; a kept one may have no elements)
    out32_shape = (0,) if out32 is None or out32.dim() == 1 else (b, h, lq, value.shape[-1])
    float_mask = attn_mask is not None and attn_mask.is_floating_point()
    expected = {
        "grad_out": (grad_out, (b, h, lq, value.shape[-1]), query.dtype),
        "out": (out, (b, h, lq, value.shape[-1]), query.dtype),
        "lse": (lse, (b, h, lq), lse_dtype(query.dtype)),
        "grad_lse": (grad_lse, (b, h, lq), lse_dtype(query.dtype)),
        "stat": (stat, (b, h, lq, 2) if _keeps_stat(query, attn_mask) else (0,), torch.float32),
        "out32": (out32, out32_shape, torch.float32),
        "seed": (seed, (), torch.int64),
    }
    for name, (t, shape, dtype) in expected.items():
        if t is None:
            continue
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(
                f"attention_backward: {name} must be {shape} {dtype}, got "
                f"{tuple(t.shape)} {t.dtype}"
            )
        if t.device != query.device and not (name == "seed" and t.device.type == "cpu"):
            raise ValueError(
                f"attention_backward: {name} is on {t.device}, query on {query.device}"
            )
    if mask_grad and not float_mask:
        raise ValueError("attention_backward: mask_grad needs a float attn_mask")


def _backward_kernels(
    grad_out, grad_lse, query, key, value, out, lse, stat, out32, attn_mask, key_padding_mask,
    seed, dropout_p, is_causal, scale, mask_grad, backend=None, kv_range=None, like_inputs=False,
):  # fmt: skip
    # like_inputs (eager calls): Triton's dq, dk, dv in the memory layout of q, k, v.
    args = (grad_out, grad_lse, query, key, value, out, lse, attn_mask, key_padding_mask,
            rng.saved_seed(seed), dropout_p, is_causal, scale, mask_grad)  # fmt: skip
    triton = (backend or _backend(query, key, value, attn_mask)) == "triton"
    # Batched cotangents (is_grads_batched, vectorized jacobians) are wrappers without storage
    # for the kernels: the torch backend's functional path takes them (the same function).
    if triton and not _batched(grad_out, grad_lse):
        backward = _kernels().attention_backward
        stat = stat if stat is not None and stat.numel() else None
        if out32 is not None and out32.numel():  # the kernels' delta reads it instead of out
            args = (*args[:5], out32, *args[6:])
        dq, dk, dv, dmask = backward(*args, kv_range=kv_range, like_inputs=like_inputs, stat=stat)
    else:  # its mask is built on the host
        host_seed = rng.host_seed(seed, "attention") if dropout_p > 0 else 0
        dq, dk, dv, dmask = _torch_backward(*args[:9], host_seed, *args[10:])
    return dq, dk, dv, query.new_empty(0) if dmask is None else dmask


@_attention_backward_op.register_fake
def _attention_backward_fake(grad_out, grad_lse, query, key, value, *rest):
    out, lse, stat, out32, attn_mask, kpm, seed, dropout_p, is_causal, scale, mask_grad = rest
    _check_inputs(query, key, value, attn_mask, dropout_p, is_causal, scale, True, kpm)
    saved = (out, lse, stat, out32, seed)
    _check_saved(grad_out, grad_lse, query, value, *saved, attn_mask, mask_grad)
    dmask = attn_mask.new_empty(attn_mask.shape) if mask_grad else query.new_empty(0)
    return (
        query.new_empty(query.shape),
        key.new_empty(key.shape),
        value.new_empty(value.shape),
        dmask,
    )


def _setup_context(ctx, inputs, output) -> None:
    query, key, value, attn_mask, key_padding_mask, dropout_p, is_causal, scale = inputs[:8]
    out, lse, seed, stat, out32 = output
    # O(B*H*L*D): q, k, v, out, lse, stat and out32; the masks are the caller's own tensors.
    saved = (query, key, value, out, lse, stat, out32, attn_mask, key_padding_mask, seed)
    ctx.save_for_backward(*saved)
    ctx.dropout_p, ctx.is_causal, ctx.scale = dropout_p, is_causal, scale
    ctx.float_mask = attn_mask is not None and attn_mask.is_floating_point()
    # No zero cotangent for an unused out: value's gradient is then None (`_grads`), as in
    # eager calls (compiled ones gave a zero tensor, which AdamW's weight decay moves).
    ctx.set_materialize_grads(False)


def _grads_by_reference(ctx, grad_out, grad_lse) -> tuple:
    """`_grads` under create_graph=True: by autograd through the reference's operations with
    the kernels' keep-mask, so that they are differentiable again (a gradient penalty, a
    Hessian-vector product). The reference's (B, H, Lq, Lk) memory and speed."""
    query, key, value, _, _, _, _, attn_mask, key_padding_mask, seed = ctx.saved_tensors
    keep = None
    if ctx.dropout_p > 0:
        b, h, lq, _ = query.shape
        host = rng.host_seed(seed, _OP_NAME)
        keep = dropout_keep_mask(host, b, h, lq, key.shape[2], ctx.dropout_p, query.device)
    mask = attn_mask if ctx.float_mask and ctx.needs_input_grad[3] else None

    def forward(q, k, v, m):
        m = attn_mask if m is None else m
        args = (key_padding_mask, keep, ctx.dropout_p, ctx.is_causal, ctx.scale)
        return _by_reference(q, k, v, m, *args)

    dq, dk, dv, dmask = differentiable_vjp(forward, (query, key, value, mask), (grad_out, grad_lse))
    # as `_grads`: no value gradient when only lse was used
    return dq, dk, dv if grad_out is not None else None, dmask, None, None, None, None


def _op_grads_by_reference(ctx, grad_out, grad_lse, *_) -> tuple:
    return *_grads_by_reference(ctx, grad_out, grad_lse), None  # needs_grad


@twice_differentiable(_op_grads_by_reference)
def _backward(ctx, grad_out, grad_lse, _grad_seed, _grad_stat, _grad_out32):
    grads = _grads(ctx, grad_out, grad_lse, torch.ops.fastformer.attention_backward)
    return *grads, None  # needs_grad


def _grads(ctx, grad_out, grad_lse, backward_fn) -> tuple:
    """Gradients of the 8 inputs of _AttentionFunction (None for masks without grad and
    non-tensors)."""
    query, key, value, out, lse, stat, out32, attn_mask, key_padding_mask, seed = ctx.saved_tensors
    mask_grad = ctx.float_mask and ctx.needs_input_grad[3]
    out_used = grad_out is not None
    if not out_used:  # only lse was used
        grad_out = torch.zeros_like(out)
    dq, dk, dv, dmask = backward_fn(
        grad_out,
        grad_lse,
        query,
        key,
        value,
        out,
        lse,
        stat,
        out32,
        attn_mask,
        key_padding_mask,
        seed,
        ctx.dropout_p,
        ctx.is_causal,
        ctx.scale,
        mask_grad,
    )
    # lse does not depend on value: no gradient (None, as torch gives; a zero tensor would count
    # as one for optimizers, weight decay and momentum included)
    return dq, dk, dv if out_used else None, dmask if mask_grad else None, None, None, None, None


torch.library.register_autograd("fastformer::attention", _backward, setup_context=_setup_context)


class _AttentionFunction(torch.autograd.Function):
    """Eager autograd of fastformer::attention: the same helpers without the custom-op dispatch
    (torch.compile traces the custom op; eager calls save its host time, as layer_norm does)."""

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, key_padding_mask, dropout_p, is_causal, scale):
        inputs = (query, key, value, attn_mask, key_padding_mask, dropout_p, is_causal, scale)
        ctx.backend = _backend(query, key, value, attn_mask)  # the backward runs the same one
        # The key-padding range (one small launch) serves the forward and the backward.
        ctx.kv_range = None
        if ctx.backend == "triton" and key_padding_mask is not None:
            ctx.kv_range = _kernels().key_range(key_padding_mask)
        out, lse, seed, stat, out32 = _forward(
            *inputs, backend=ctx.backend, kv_range=ctx.kv_range, like_query=True, needs_grad=True
        )
        output = (out, lse, rng.seed_tensor(seed), stat, out32)
        _setup_context(ctx, inputs, output)
        ctx.set_materialize_grads(False)  # no zero LSE cotangent when only out is used
        return output[0], output[1]

    @staticmethod
    @twice_differentiable(_grads_by_reference)
    def backward(ctx, grad_out, grad_lse):
        def run(*args):
            return _backward_kernels(
                *args, backend=ctx.backend, kv_range=ctx.kv_range, like_inputs=True
            )

        return _grads(ctx, grad_out, grad_lse, run)
