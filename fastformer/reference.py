"""Eager PyTorch reference of every fastformer op and of the "Attention Is All You Need" model.

This module is the ground truth for all parity tests: each function is the textbook math
written out with plain torch ops (matmul, softmax-by-hand, mean/var), computed in the dtype of
its inputs. Running it on float64 inputs gives ``ref64``; running it on the fast op's own
input dtype (fp16/bf16/fp32) gives ``ref_lp`` (see the parity rule in ``fastformer.testing``).

It imports only torch and the standard library, and never draws random numbers in the
functional ops: dropout takes an explicit boolean keep-mask (True = keep), so a fast kernel's
Philox mask can be regenerated and handed to the reference. Only the ``nn.Module`` classes,
when training with dropout > 0, draw keep-masks themselves (with ``torch.rand``).

Mask conventions (the same as the torch API each argument comes from):

* ``scaled_dot_product_attention``: a bool ``attn_mask`` is True = attend (SDPA); a float
  ``attn_mask`` is added to the scores; ``key_padding_mask`` is ``(B, Lk)`` bool, True = padding.
* ``MultiheadAttention`` and the Transformer modules: a bool ``attn_mask`` is True = NOT
  allowed and ``key_padding_mask`` True = padding (``nn.MultiheadAttention``); float masks are
  added.
* ``is_causal`` is the top-left aligned lower triangle (key ``j`` visible from query ``i`` iff
  ``j <= i``), as in SDPA. Unlike SDPA, here it may be combined with any other mask, and in
  the modules it is applied (not only a hint, as in torch.nn).
* A query row whose every key is masked gives output 0 and log-sum-exp ``-inf``; no NaN is
  produced anywhere, gradients included.

The modules have the same constructor arguments, forward signatures and parameter names as
their ``torch.nn`` counterparts, so state_dicts load with ``strict=True`` in both directions,
except where ``MultiheadAttention`` says otherwise.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.bias import CausalBias, CausalVariant

__all__ = [
    "ACTIVATIONS",
    "LayerNorm",
    "MultiheadAttention",
    "PositionalEncoding",
    "RMSNorm",
    "Transformer",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
    "TransformerModel",
    "causal_bias_mask",
    "causal_mask",
    "dropout_add_layer_norm",
    "ffn",
    "layer_norm",
    "padding_mask",
    "rms_norm",
    "scaled_dot_product_attention",
    "shift_right",
]

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu")
GATED_ACTIVATIONS = ("swiglu", "geglu")

_ACTIVATION_FNS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "swiglu": F.silu,  # gate activation of the gated variants
    "geglu": F.gelu,
}


# --------------------------------------------------------------------------- dropout helpers


def _check_dropout_p(dropout_p: float) -> None:
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p}")


def _apply_keep_mask(x: Tensor, keep_mask: Tensor | None, dropout_p: float, name: str) -> Tensor:
    """Inverted dropout with an explicit keep-mask: ``x * keep / (1 - p)``; identity if p == 0."""
    _check_dropout_p(dropout_p)
    if dropout_p == 0.0:
        return x
    if keep_mask is None:
        raise ValueError(
            f"dropout_p={dropout_p} > 0 needs an explicit boolean {name} (True = keep): "
            "the reference never draws random numbers itself"
        )
    if keep_mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor (True = keep), got {keep_mask.dtype}")
    if not _broadcasts_to(keep_mask.shape, x.shape):
        raise ValueError(
            f"{name} of shape {tuple(keep_mask.shape)} does not broadcast to the dropped "
            f"tensor's shape {tuple(x.shape)}"
        )
    scale = 1.0 / (1.0 - dropout_p) if dropout_p < 1.0 else 0.0
    return x * keep_mask.to(x.dtype) * scale


def _broadcasts_to(shape: Sequence[int], target: Sequence[int]) -> bool:
    """Whether `shape` broadcasts to `target` without widening it."""
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


def _draw_keep_mask(shape: Sequence[int], p: float, like: Tensor) -> Tensor:
    """Random bool keep-mask (True = keep, probability 1 - p), for the modules only."""
    return torch.rand(shape, device=like.device) >= p


def _module_dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """What ``nn.Dropout(p)`` does, written with an explicit keep-mask."""
    if not training or p == 0.0:
        return x
    return _apply_keep_mask(x, _draw_keep_mask(x.shape, p, x), p, "keep_mask")


# --------------------------------------------------------------------------- attention


def _attention_scores(
    query: Tensor,
    key: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    scale: float | None,
    key_padding_mask: Tensor | None,
) -> Tensor:
    """Scaled scores ``q @ k^T * scale`` with every mask applied (-inf = masked), (B,H,Lq,Lk).

    In place on the fresh product (the same values; the attention op's torch backend computes
    its scores here too, where a full-size copy a mask cost more than the product on CPU);
    not under torch.func transforms, where a mask vmap batches cannot go into unbatched scores.
    """
    lq, lk = query.shape[-2], key.shape[-2]
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    scores = torch.matmul(query, key.transpose(-2, -1)).mul_(scale)
    inplace = torch._C._functorch.peek_interpreter_stack() is None

    def masked(keep_out: Tensor) -> Tensor:
        fill = scores.masked_fill_ if inplace else scores.masked_fill
        return fill(keep_out, float("-inf"))

    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = masked(~attn_mask)
        else:
            bias = attn_mask.to(scores.dtype)
            scores = scores.add_(bias) if inplace else scores + bias
    if is_causal:
        scores = masked(torch.ones(lq, lk, dtype=torch.bool, device=scores.device).triu_(1))
    if key_padding_mask is not None:
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(
                f"key_padding_mask must be bool (True = padding), got {key_padding_mask.dtype}"
            )
        if key_padding_mask.shape != (scores.shape[0], lk):
            raise ValueError(
                f"key_padding_mask must have shape (batch, seq_k) = {(scores.shape[0], lk)}, "
                f"got {tuple(key_padding_mask.shape)}"
            )
        scores = masked(key_padding_mask[:, None, None, :])
    return scores


def _wide(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit dtypes, else the dtype: where the reference sums squares or
    exponentials, as torch's own reductions accumulate (in float16 those sums overflow, and a
    reference whose error is the overflow's makes the parity bound too loose to fail)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _safe_softmax(scores: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax over the last dim and its log-sum-exp; rows with every score -inf give 0 / -inf.

    Written out (max-subtract, exp, sum, divide) so that fully masked rows produce neither
    NaN values nor NaN gradients.
    """
    if scores.shape[-1] == 0:  # no keys at all: every row is empty (amax refuses a 0-size dim)
        row_max = scores.new_full((*scores.shape[:-1], 1), float("-inf"))
    else:
        row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)
    exp = torch.exp(scores - row_max)
    # Summed in float32 at least: a float16 sum passes 65504 (inf) from 65505 near-equal keys.
    total = exp.sum(dim=-1, keepdim=True, dtype=_wide(exp.dtype))
    empty = total == 0
    safe_total = torch.where(empty, torch.ones_like(total), total)
    probs = (exp / safe_total).to(exp.dtype)
    lse = torch.where(empty, torch.full_like(total, float("-inf")), row_max + safe_total.log())
    return probs, lse.squeeze(-1)


def _repeat_kv_heads(query: Tensor, key: Tensor, value: Tensor, enable_gqa: bool):
    h, hkv = query.shape[1], key.shape[1]
    if h == hkv:
        return key, value
    if not enable_gqa:
        raise ValueError(
            f"query has {h} heads but key/value have {hkv}; pass enable_gqa=True for "
            "grouped-query attention"
        )
    if h % hkv != 0:
        raise ValueError(f"enable_gqa needs query heads ({h}) divisible by key heads ({hkv})")
    rep = h // hkv
    return key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)


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
    dropout_mask: Tensor | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Reference attention ``softmax(q k^T * scale + masks) v``, computed in the input dtype.

    Args:
        query: ``(B, H, Lq, D)``.
        key: ``(B, Hkv, Lk, D)``; ``Hkv == H`` unless ``enable_gqa``.
        value: ``(B, Hkv, Lk, Dv)``.
        attn_mask: bool (True = attend) or float (added to the scores), broadcastable to
            ``(B, H, Lq, Lk)``; or a ``torch.nn.attention.bias.CausalBias``, applied as its
            bool mask (not with ``is_causal``, as in SDPA).
        dropout_p: dropout probability on the attention probabilities. If > 0,
            ``dropout_mask`` is required (ValueError otherwise); ignored when 0.
        is_causal: apply the top-left aligned causal mask (key ``j <= `` query ``i``). May be
            combined with ``attn_mask`` and ``key_padding_mask``.
        scale: score scale, default ``1 / sqrt(D)``.
        enable_gqa: grouped-query attention: each key/value head serves ``H // Hkv``
            consecutive query heads (``repeat_interleave``), as in SDPA.
        key_padding_mask: ``(B, Lk)`` bool, True = padding (that key is ignored).
        dropout_mask: bool keep-mask broadcastable to ``(B, H, Lq, Lk)``, True = keep; the
            probabilities are multiplied by ``keep / (1 - dropout_p)`` after the softmax.
        return_lse: also return the log-sum-exp of the scaled, masked scores.

    Returns:
        ``out`` of shape ``(B, H, Lq, Dv)`` in the input dtype, or ``(out, lse)`` with ``lse``
        ``(B, H, Lq)``: float32 for float16/bfloat16 inputs (the kernels' lse dtype; values
        computed in the input dtype), otherwise the input dtype. A query row with every key
        masked gives ``out == 0`` and ``lse == -inf``, with finite gradients.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, H, L, D), got shape {tuple(t.shape)}")
    _check_dropout_p(dropout_p)
    if isinstance(attn_mask, CausalBias):
        attn_mask = causal_bias_mask(attn_mask, is_causal, query.device)
    if dropout_p > 0.0 and dropout_mask is None:
        raise ValueError(
            f"dropout_p={dropout_p} > 0 needs an explicit bool dropout_mask (True = keep): "
            "the reference never draws random numbers itself"
        )
    key, value = _repeat_kv_heads(query, key, value, enable_gqa)
    scores = _attention_scores(query, key, attn_mask, is_causal, scale, key_padding_mask)
    probs, lse = _safe_softmax(scores)
    probs = _apply_keep_mask(probs, dropout_mask, dropout_p, "dropout_mask")
    out = torch.matmul(probs, value)
    if not return_lse:
        return out
    if lse.dtype in (torch.float16, torch.bfloat16):
        lse = lse.float()
    return out, lse


def causal_bias_mask(bias: CausalBias, is_causal: bool, device: torch.device) -> Tensor:
    """The bool (Lq, Lk) mask of torch's CausalBias: key j visible from query i iff
    j <= i (upper left) or j <= i + Lk - Lq (lower right)."""
    if is_causal:
        raise ValueError("a CausalBias attn_mask with is_causal=True: pass one of them")
    lq, lk = bias.seq_len_q, bias.seq_len_kv
    offset = lk - lq if bias.variant == CausalVariant.LOWER_RIGHT else 0
    return torch.ones(lq, lk, dtype=torch.bool, device=device).tril(offset)


def refuse_causal_bias(attn_mask: Tensor | None) -> None:
    """TypeError for torch's CausalBias as a MultiheadAttention mask: a mask for SDPA only,
    elsewhere a float tensor of uninitialized values (torch.nn's module adds them)."""
    if isinstance(attn_mask, CausalBias):
        raise TypeError(
            "attn_mask (a Transformer layer's src_mask, tgt_mask or memory_mask) is a "
            "torch.nn.attention.bias.CausalBias, a mask for "
            "scaled_dot_product_attention only: MultiheadAttention would add its uninitialized "
            "values to the scores. Pass is_causal=True without attn_mask (causal, top-left), or "
            "a bool (L, S) mask, True = not allowed: torch.ones(L, S, dtype=torch.bool)"
            ".triu(1), or .triu(S - L + 1) for causal_lower_right"
        )


# --------------------------------------------------------------------------- normalization


def _norm_dims(input: Tensor, normalized_shape: int | Sequence[int]) -> tuple[int, ...]:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if tuple(input.shape[input.dim() - len(shape) :]) != shape:
        raise ValueError(
            f"normalized_shape {shape} does not match the trailing dims of input "
            f"{tuple(input.shape)}"
        )
    return tuple(range(-len(shape), 0))


def layer_norm(
    input: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the trailing ``normalized_shape``.

    Biased variance, computed in the input dtype but for the sum of squares (float32 for 16-bit
    inputs, as torch accumulates: in float16 it overflows past |x - mean| = 256). ``weight`` /
    ``bias`` have shape ``normalized_shape`` (or are None). Output: same shape and dtype as
    ``input`` (type promotion with the parameters' dtype aside).
    """
    dims = _norm_dims(input, normalized_shape)
    mean = input.mean(dim=dims, keepdim=True)
    centered = input - mean
    wide = centered.to(_wide(centered.dtype))
    var = (wide * wide).mean(dim=dims, keepdim=True)
    out = centered / torch.sqrt(var + eps).to(centered.dtype)
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out


def rms_norm_eps(dtype: torch.dtype) -> float:
    """The eps ``F.rms_norm`` uses when given None: the machine epsilon of the type it computes
    in, float32 for float16 and bfloat16 inputs (torch 2.11 and 2.14; their docs say the input
    dtype's, which is 8x to 64x larger)."""
    wide = dtype in (torch.float16, torch.bfloat16)
    return torch.finfo(torch.float32 if wide else dtype).eps


def rms_norm(
    input: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    eps: float | None = None,
) -> Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the trailing ``normalized_shape``.

    ``eps=None`` means ``rms_norm_eps(input.dtype)``, as ``F.rms_norm``. Computed in the input
    dtype but for the mean square (float32 for 16-bit inputs, as in `layer_norm`); output has the
    shape and dtype of ``input``.
    """
    dims = _norm_dims(input, normalized_shape)
    if eps is None:
        eps = rms_norm_eps(input.dtype)
    wide = input.to(_wide(input.dtype))
    mean_square = (wide * wide).mean(dim=dims, keepdim=True)
    out = input / torch.sqrt(mean_square + eps).to(input.dtype)
    if weight is not None:
        out = out * weight
    return out


def dropout_add_layer_norm(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float = 1e-5,
    dropout_p: float = 0.0,
    prenorm: bool = False,
    *,
    keep_mask: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """``LayerNorm(residual + dropout(x))`` over the last dim.

    Args:
        x: ``(..., N)``.
        residual: same shape as ``x``, or None (then ``pre = dropout(x)``).
        weight, bias: ``(N,)`` or None.
        dropout_p: dropout on ``x``; if > 0, ``keep_mask`` (bool, shape of ``x``, True = keep)
            is required (ValueError otherwise); kept values are scaled by ``1 / (1 - p)``.
            ``keep_mask`` is ignored when ``dropout_p == 0``.
        prenorm: also return ``pre = residual + dropout(x)`` (the next residual stream).

    Returns:
        ``out`` (shape and dtype of ``x``), or ``(out, pre)`` when ``prenorm``.
    """
    pre = _apply_keep_mask(x, keep_mask, dropout_p, "keep_mask")
    if residual is not None:
        pre = residual + pre
    out = layer_norm(pre, (x.shape[-1],), weight, bias, eps)
    return (out, pre) if prenorm else out


# --------------------------------------------------------------------------- feed-forward


def ffn(
    x: Tensor,
    w1: Tensor,
    b1: Tensor | None,
    w2: Tensor,
    b2: Tensor | None,
    activation: str | Callable[[Tensor], Tensor] = "relu",
    dropout_p: float = 0.0,
    *,
    keep_mask: Tensor | None = None,
) -> Tensor:
    """Position-wise feed-forward ``linear2(dropout(act(linear1(x))))``.

    Weights use ``nn.Linear`` layouts: ``w1`` is ``(d_ff, d_model)`` (``(2 * d_ff, d_model)``
    for the gated activations), ``b1`` matches its first dim, ``w2`` is ``(d_model, d_ff)``,
    ``b2`` is ``(d_model,)``; biases may be None.

    ``activation`` is one of ``ACTIVATIONS`` (or, for a non-gated FFN, any callable):
    ``relu``; ``gelu`` (exact, erf); ``gelu_tanh`` (tanh approximation); ``silu``; and the
    gated ``swiglu`` / ``geglu``. Gated convention: ``h = linear1(x)``,
    ``gate, up = h.chunk(2, -1)``; the FIRST half is the gate and goes through the activation
    (silu for swiglu, exact gelu for geglu), the SECOND half is the linear "up" part:
    ``act(gate) * up``.

    Dropout: if ``dropout_p > 0``, ``keep_mask`` (bool, shape ``(..., d_ff)``, True = keep) is
    required (ValueError otherwise) and kept values are scaled by ``1 / (1 - p)``; it is
    ignored when ``dropout_p == 0``. Output ``(..., d_model)`` in the input dtype.
    """
    h = F.linear(x, w1, b1)
    if callable(activation):
        h = activation(h)
    elif activation in GATED_ACTIVATIONS:
        gate, up = h.chunk(2, dim=-1)
        h = _ACTIVATION_FNS[activation](gate) * up
    elif activation in _ACTIVATION_FNS:
        h = _ACTIVATION_FNS[activation](h)
    else:
        raise ValueError(
            f"activation must be one of {ACTIVATIONS} or a callable, got {activation!r}"
        )
    h = _apply_keep_mask(h, keep_mask, dropout_p, "keep_mask")
    return F.linear(h, w2, b2)


# --------------------------------------------------------------------------- mask helpers


def padding_mask(lengths: Tensor, max_len: int) -> Tensor:
    """Key padding mask from sequence lengths: ``(B,)`` ints -> ``(B, max_len)`` bool, True = pad."""
    positions = torch.arange(max_len, device=lengths.device)
    return positions[None, :] >= lengths[:, None]


def causal_mask(
    size: int, device: torch.device | str | None = None, dtype: torch.dtype = torch.bool
) -> Tensor:
    """Square ``(size, size)`` causal mask in the ``nn.MultiheadAttention`` convention.

    ``dtype=torch.bool``: True above the diagonal = masked (NOT allowed). Note this is the
    inverse of SDPA's bool ``attn_mask`` (True = attend); pass ``~causal_mask(n)`` there.
    A floating ``dtype``: ``-inf`` above the diagonal and 0 elsewhere, exactly
    ``nn.Transformer.generate_square_subsequent_mask(size)``.
    """
    future = torch.ones(size, size, dtype=torch.bool, device=device).triu(diagonal=1)
    if dtype == torch.bool:
        return future
    zeros = torch.zeros(size, size, dtype=dtype, device=device)
    return zeros.masked_fill(future, float("-inf"))


def shift_right(tgt: Tensor, bos_id: int) -> Tensor:
    """Teacher-forcing decoder input: ``(B, L)`` tokens -> ``[bos, tgt[:, :-1]]`` ``(B, L)``."""
    bos = torch.full_like(tgt[:, :1], bos_id)
    return torch.cat([bos, tgt[:, :-1]], dim=1)


# --------------------------------------------------------------------------- modules: norms


class LayerNorm(nn.Module):
    """``nn.LayerNorm`` on top of :func:`layer_norm` (same arguments, ``weight``/``bias``).
    Input (..., *normalized_shape), float32/float16/bfloat16/float64; output same shape and
    dtype."""

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape, **kw))
            self.bias = nn.Parameter(torch.zeros(self.normalized_shape, **kw)) if bias else None
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, input: Tensor) -> Tensor:
        """input (..., *normalized_shape) -> normalized, same shape and dtype."""
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


class RMSNorm(nn.Module):
    """``nn.RMSNorm`` on top of :func:`rms_norm` (same arguments, ``weight``).
    Input (..., *normalized_shape), float32/float16/bfloat16/float64; output same shape and
    dtype."""

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float | None = None,
        elementwise_affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(
                torch.ones(self.normalized_shape, device=device, dtype=dtype)
            )
        else:
            self.register_parameter("weight", None)

    def forward(self, input: Tensor) -> Tensor:
        """input (..., *normalized_shape) -> normalized, same shape and dtype."""
        return rms_norm(input, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


# --------------------------------------------------------------------------- modules: attention


class MultiheadAttention(nn.Module):
    """``nn.MultiheadAttention`` (packed q/k/v projection) on top of the reference attention.

    Parameters ``in_proj_weight (3E, E)``, ``in_proj_bias (3E,)`` and ``out_proj`` (an
    ``nn.Linear``) as in torch. Mask conventions of ``nn.MultiheadAttention``: ``attn_mask`` is
    ``(L, S)`` or ``(B * H, L, S)``, bool True = NOT allowed, float added; ``key_padding_mask``
    ``(B, S)``, bool True = padding, float added. ``is_causal=True`` applies the causal mask
    (combined with ``attn_mask`` if given) instead of being only a hint.

    Unlike torch's: ``need_weights`` defaults to False, and the constructor has no
    ``add_bias_kv``, ``add_zero_attn``, ``kdim`` or ``vdim``; ``batch_first``, ``device`` and
    ``dtype`` are keyword-only (torch's fifth positional argument is ``add_bias_kv``, which a
    positional ``batch_first`` here would have silently stood for).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        *,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if embed_dim % num_heads != 0:
            raise ValueError(
                f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})"
            )
        kw = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **kw))
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **kw))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.in_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)

    def _split_heads(self, x: Tensor) -> Tensor:
        b, seq, _ = x.shape
        return x.view(b, seq, self.num_heads, self.head_dim).transpose(1, 2)

    def _sdpa_masks(self, attn_mask, key_padding_mask, batch, lq, lk):
        """nn.MultiheadAttention masks -> (SDPA-convention attn_mask, bool key_padding_mask)."""
        if attn_mask is not None:
            if attn_mask.dim() == 2:
                attn_mask = attn_mask.view(1, 1, lq, lk)
            elif attn_mask.dim() == 3:
                attn_mask = attn_mask.view(batch, self.num_heads, lq, lk)
            else:
                raise ValueError(f"attn_mask must be 2-D or 3-D, got {attn_mask.dim()}-D")
            if attn_mask.dtype == torch.bool:
                attn_mask = ~attn_mask  # nn.MHA: True = masked; SDPA: True = attend
        if key_padding_mask is not None and key_padding_mask.dtype != torch.bool:
            additive = key_padding_mask.view(batch, 1, 1, lk)
            if attn_mask is None:
                attn_mask = additive
            elif attn_mask.dtype == torch.bool:
                blocked = ~attn_mask  # back to True = masked
                attn_mask = torch.zeros(blocked.shape, dtype=additive.dtype, device=blocked.device)
                attn_mask = attn_mask.masked_fill(blocked, float("-inf")) + additive
            else:
                attn_mask = attn_mask + additive
            key_padding_mask = None
        return attn_mask, key_padding_mask

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = False,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """query ``(L, B, E)`` (``(B, L, E)`` if batch_first, ``(L, E)`` unbatched), key/value
        ``(S, B, E)`` -> ``(out like query, weights (B, L, S) or (B, H, L, S) or None)``."""
        refuse_causal_bias(attn_mask)
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        # now (L, B, E) -> compute in (B, L, E)
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        batch, lq, lk = query.shape[0], query.shape[1], key.shape[1]

        w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        b_q = b_k = b_v = None
        if self.in_proj_bias is not None:
            b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        q = self._split_heads(F.linear(query, w_q, b_q))
        k = self._split_heads(F.linear(key, w_k, b_k))
        v = self._split_heads(F.linear(value, w_v, b_v))

        mask, kpm = self._sdpa_masks(attn_mask, key_padding_mask, batch, lq, lk)
        p = self.dropout if self.training else 0.0
        keep = _draw_keep_mask((batch, self.num_heads, lq, lk), p, q) if p > 0 else None
        weights = None
        if need_weights:
            scores = _attention_scores(q, k, mask, is_causal, None, kpm)
            weights = _apply_keep_mask(_safe_softmax(scores)[0], keep, p, "dropout_mask")
            out = torch.matmul(weights, v)
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if unbatched:
                weights = weights.squeeze(0)
        else:
            out = scaled_dot_product_attention(
                q, k, v, mask, p, is_causal, key_padding_mask=kpm, dropout_mask=keep
            )
        out = self.out_proj(out.transpose(1, 2).reshape(batch, lq, self.embed_dim))
        if unbatched:
            return out.squeeze(0), weights
        return (out if self.batch_first else out.transpose(0, 1)), weights


# --------------------------------------------------------------------------- modules: layers


def _check_layer_activation(activation: str | Callable[[Tensor], Tensor]) -> None:
    if not callable(activation) and activation not in ACTIVATIONS:
        raise ValueError(
            f"activation must be one of {ACTIVATIONS} or a callable, got {activation!r}"
        )


def _linear1_out(dim_feedforward: int, activation: str | Callable[[Tensor], Tensor]) -> int:
    gated = isinstance(activation, str) and activation in GATED_ACTIVATIONS
    return 2 * dim_feedforward if gated else dim_feedforward


class _SublayerMixin:
    """Shared residual sub-layer code of the encoder and decoder layers."""

    def _init_sublayers(
        self, count: int, d_model: int, dim_feedforward: int, dropout: float, activation,
        layer_norm_eps: float, norm_first: bool, bias: bool, kw: dict,
    ) -> None:  # fmt: skip
        """The FFN and `count` LayerNorm / Dropout pairs, registered (and initialised) in the
        order of the torch.nn layers, after the attention modules."""
        self.linear1 = nn.Linear(d_model, _linear1_out(dim_feedforward, activation), bias, **kw)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias, **kw)
        self.norm_first = norm_first
        for i in range(1, count + 1):
            setattr(self, f"norm{i}", LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw))
        for i in range(1, count + 1):
            setattr(self, f"dropout{i}", nn.Dropout(dropout))
        self.activation = activation

    def _ff_block(self, x: Tensor) -> Tensor:
        """``linear2(dropout(act(linear1(x))))`` via :func:`ffn` (without the outer dropout)."""
        p = self.dropout.p if self.training else 0.0
        d_ff = self.linear2.in_features
        keep = _draw_keep_mask((*x.shape[:-1], d_ff), p, x) if p > 0 else None
        l1, l2 = self.linear1, self.linear2
        return ffn(x, l1.weight, l1.bias, l2.weight, l2.bias, self.activation, p, keep_mask=keep)

    def _residual(self, x: Tensor, sublayer_out: Tensor, norm: LayerNorm, drop: nn.Dropout):
        """Post-norm: ``norm(x + dropout(sublayer_out))``; pre-norm: ``x + dropout(...)``."""
        p = drop.p if self.training else 0.0
        keep = _draw_keep_mask(sublayer_out.shape, p, sublayer_out) if p > 0 else None
        if self.norm_first:
            return x + _apply_keep_mask(sublayer_out, keep, p, "keep_mask")
        return dropout_add_layer_norm(
            sublayer_out, x, norm.weight, norm.bias, norm.eps, p, keep_mask=keep
        )


class TransformerEncoderLayer(_SublayerMixin, nn.Module):
    """Encoder layer of the paper: self-attention and FFN sub-layers, each with dropout,
    residual and LayerNorm (post-norm, or pre-norm when ``norm_first``). Same arguments,
    forward signature and submodule names as ``nn.TransformerEncoderLayer``.

    ``activation``: one of ``ACTIVATIONS`` or a callable (the gated ones make ``linear1`` output
    ``2 * dim_feedforward``).
    """

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable[[Tensor], Tensor] = "relu",
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _check_layer_activation(activation)
        kw = {"device": device, "dtype": dtype}
        self.self_attn = MultiheadAttention(
            d_model, nhead, dropout, bias, batch_first=batch_first, **kw
        )
        self._init_sublayers(
            2, d_model, dim_feedforward, dropout, activation, layer_norm_eps, norm_first, bias, kw
        )

    def forward(
        self,
        src: Tensor,
        src_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> Tensor:
        """src ``(S, B, E)`` (``(B, S, E)`` if batch_first) -> same shape."""

        def self_attention(x: Tensor) -> Tensor:
            return self.self_attn(
                x, x, x, src_key_padding_mask, attn_mask=src_mask, is_causal=is_causal
            )[0]

        x = src
        if self.norm_first:
            x = self._residual(x, self_attention(self.norm1(x)), self.norm1, self.dropout1)
            x = self._residual(x, self._ff_block(self.norm2(x)), self.norm2, self.dropout2)
        else:
            x = self._residual(x, self_attention(x), self.norm1, self.dropout1)
            x = self._residual(x, self._ff_block(x), self.norm2, self.dropout2)
        return x


class TransformerDecoderLayer(_SublayerMixin, nn.Module):
    """Decoder layer of the paper: masked self-attention, cross-attention over the encoder
    memory and FFN, each with dropout, residual and LayerNorm. Same arguments, forward
    signature and submodule names as ``nn.TransformerDecoderLayer``."""

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable[[Tensor], Tensor] = "relu",
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _check_layer_activation(activation)
        kw = {"device": device, "dtype": dtype}
        self.self_attn = MultiheadAttention(
            d_model, nhead, dropout, bias, batch_first=batch_first, **kw
        )
        self.multihead_attn = MultiheadAttention(
            d_model, nhead, dropout, bias, batch_first=batch_first, **kw
        )
        self._init_sublayers(
            3, d_model, dim_feedforward, dropout, activation, layer_norm_eps, norm_first, bias, kw
        )

    def forward(
        self,
        tgt: Tensor,
        memory: Tensor,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        tgt_is_causal: bool = False,
        memory_is_causal: bool = False,
    ) -> Tensor:
        """tgt ``(T, B, E)``, memory ``(S, B, E)`` (batch first if batch_first) -> like tgt."""

        def self_attention(x: Tensor) -> Tensor:
            return self.self_attn(
                x, x, x, tgt_key_padding_mask, attn_mask=tgt_mask, is_causal=tgt_is_causal
            )[0]

        def cross_attention(x: Tensor) -> Tensor:
            return self.multihead_attn(
                x,
                memory,
                memory,
                memory_key_padding_mask,
                attn_mask=memory_mask,
                is_causal=memory_is_causal,
            )[0]

        x = tgt
        if self.norm_first:
            x = self._residual(x, self_attention(self.norm1(x)), self.norm1, self.dropout1)
            x = self._residual(x, cross_attention(self.norm2(x)), self.norm2, self.dropout2)
            x = self._residual(x, self._ff_block(self.norm3(x)), self.norm3, self.dropout3)
        else:
            x = self._residual(x, self_attention(x), self.norm1, self.dropout1)
            x = self._residual(x, cross_attention(x), self.norm2, self.dropout2)
            x = self._residual(x, self._ff_block(x), self.norm3, self.dropout3)
        return x


# --------------------------------------------------------------------------- modules: stacks


class TransformerEncoder(nn.Module):
    """A stack of ``num_layers`` deep copies of ``encoder_layer`` (``layers``), then ``norm``.

    ``enable_nested_tensor`` and ``mask_check`` are accepted for ``nn.TransformerEncoder``
    compatibility and ignored: the reference has no nested-tensor fast path, so padded
    positions are computed like any other (torch's fast path outputs 0 there instead).
    """

    def __init__(
        self,
        encoder_layer: nn.Module,
        num_layers: int,
        norm: nn.Module | None = None,
        enable_nested_tensor: bool = True,
        mask_check: bool = True,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList([copy.deepcopy(encoder_layer) for _ in range(num_layers)])
        self.num_layers = num_layers
        self.norm = norm

    def forward(
        self,
        src: Tensor,
        mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool | None = None,
    ) -> Tensor:
        """src (S, B, E) ((B, S, E) when the layers are batch first) -> same shape, dtype."""
        output = src
        for layer in self.layers:
            output = layer(
                output,
                src_mask=mask,
                src_key_padding_mask=src_key_padding_mask,
                is_causal=bool(is_causal),
            )
        return self.norm(output) if self.norm is not None else output


class TransformerDecoder(nn.Module):
    """A stack of ``num_layers`` deep copies of ``decoder_layer`` (``layers``), then ``norm``."""

    def __init__(
        self, decoder_layer: nn.Module, num_layers: int, norm: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList([copy.deepcopy(decoder_layer) for _ in range(num_layers)])
        self.num_layers = num_layers
        self.norm = norm

    def forward(
        self,
        tgt: Tensor,
        memory: Tensor,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        tgt_is_causal: bool | None = None,
        memory_is_causal: bool = False,
    ) -> Tensor:
        """tgt (T, B, E), memory (S, B, E) (batch first as the layers) -> tgt's shape, dtype."""
        output = tgt
        for layer in self.layers:
            output = layer(
                output,
                memory,
                tgt_mask=tgt_mask,
                memory_mask=memory_mask,
                tgt_key_padding_mask=tgt_key_padding_mask,
                memory_key_padding_mask=memory_key_padding_mask,
                tgt_is_causal=bool(tgt_is_causal),
                memory_is_causal=bool(memory_is_causal),
            )
        return self.norm(output) if self.norm is not None else output


class Transformer(nn.Module):
    """The encoder-decoder of the paper, a drop-in for ``nn.Transformer``: same arguments,
    forward signature and parameter names (``encoder.layers.*``, ``encoder.norm``,
    ``decoder.layers.*``, ``decoder.norm``), xavier-uniform init of matrices."""

    def __init__(
        self,
        d_model: int = 512,
        nhead: int = 8,
        num_encoder_layers: int = 6,
        num_decoder_layers: int = 6,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable[[Tensor], Tensor] = "relu",
        custom_encoder: nn.Module | None = None,
        custom_decoder: nn.Module | None = None,
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        layer_args = (d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps)
        layer_args += (batch_first, norm_first, bias)
        if custom_encoder is not None:
            self.encoder = custom_encoder
        else:
            self.encoder = TransformerEncoder(
                TransformerEncoderLayer(*layer_args, **kw),
                num_encoder_layers,
                LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw),
            )
        if custom_decoder is not None:
            self.decoder = custom_decoder
        else:
            self.decoder = TransformerDecoder(
                TransformerDecoderLayer(*layer_args, **kw),
                num_decoder_layers,
                LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw),
            )
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
        self.d_model = d_model
        self.nhead = nhead
        self.batch_first = batch_first

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        src_is_causal: bool | None = None,
        tgt_is_causal: bool | None = None,
        memory_is_causal: bool = False,
    ) -> Tensor:
        """src ``(S, B, E)``, tgt ``(T, B, E)`` (batch first if batch_first) -> ``(T, B, E)``."""
        if src.size(-1) != self.d_model or tgt.size(-1) != self.d_model:
            raise ValueError(
                f"the feature size of src {tuple(src.shape)} and tgt {tuple(tgt.shape)} must "
                f"be d_model={self.d_model}"
            )
        memory = self.encoder(
            src, mask=src_mask, src_key_padding_mask=src_key_padding_mask, is_causal=src_is_causal
        )
        return self.decoder(
            tgt,
            memory,
            tgt_mask=tgt_mask,
            memory_mask=memory_mask,
            tgt_key_padding_mask=tgt_key_padding_mask,
            memory_key_padding_mask=memory_key_padding_mask,
            tgt_is_causal=tgt_is_causal,
            memory_is_causal=memory_is_causal,
        )

    @staticmethod
    def generate_square_subsequent_mask(
        sz: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> Tensor:
        """Float causal mask: ``-inf`` above the diagonal, 0 elsewhere (as torch.nn)."""
        return causal_mask(sz, device=device, dtype=dtype or torch.get_default_dtype())


# --------------------------------------------------------------------------- the paper's model


def _sinusoids(max_len: int, d_model: int, device) -> Tensor:
    position = torch.arange(max_len, dtype=torch.float64, device=device)[:, None]
    inv_freq = torch.exp(
        torch.arange(0, d_model, 2, dtype=torch.float64, device=device)
        * (-math.log(10000.0) / d_model)
    )
    pe = torch.zeros(max_len, d_model, dtype=torch.float64, device=device)
    pe[:, 0::2] = torch.sin(position * inv_freq)
    pe[:, 1::2] = torch.cos(position * inv_freq[: d_model // 2])
    return pe


class PositionalEncoding(nn.Module):
    """Sinusoidal positional encoding: ``pe[pos, 2i] = sin(pos / 10000^(2i/d))``,
    ``pe[pos, 2i+1] = cos(pos / 10000^(2i/d))``; forward adds it, then dropout.

    ``pe`` is a ``(max_len, d_model)`` non-persistent buffer (not in the state_dict).
    The input is ``(B, L, d_model)`` (``(L, B, d_model)`` with ``batch_first=False``); the
    embedding scale ``sqrt(d_model)`` is applied by the caller.
    """

    def __init__(
        self, d_model: int, dropout: float = 0.1, max_len: int = 5000, batch_first: bool = True
    ) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.batch_first = batch_first
        pe = _sinusoids(max_len, d_model, device=None)
        self.register_buffer("pe", pe.to(torch.get_default_dtype()), persistent=False)

    def _apply(self, fn, recurse=True):
        # The table again where an application cannot carry it over: after a dtype change
        # (.double() of the float32 table left it 3e-8 off the formula; .bfloat16().float() kept
        # it rounded, 2e-3 off) and off the meta device (to_empty() leaves memory
        # uninitialized). Being non-persistent, no state_dict fills it. Other applications
        # (moves, share_memory) keep the buffer they made.
        was, was_meta = self.pe.dtype, self.pe.is_meta
        super()._apply(fn, recurse)
        if (self.pe.dtype != was or was_meta) and not self.pe.is_meta:
            self.reset_parameters()
        return self

    def reset_parameters(self) -> None:
        """Recompute the table `pe` in its dtype and on its device (after `to_empty()` from a
        device other than meta, say: no state_dict fills a non-persistent buffer)."""
        if not self.pe.is_meta:
            self.pe = _sinusoids(*self.pe.shape, device=self.pe.device).to(self.pe.dtype)

    def forward(self, x: Tensor) -> Tensor:
        """x (B, L, d_model) ((L, B, d_model) without batch_first) -> x + pe[:L], then dropout."""
        seq_len = x.shape[1] if self.batch_first else x.shape[0]
        pe = self.pe[:seq_len].to(x.dtype)
        pe = pe[None] if self.batch_first else pe[:, None]
        return self.dropout(x + pe)


class TransformerModel(nn.Module):
    """The full "Attention Is All You Need" sequence-to-sequence model, batch first.

    ``src_embed`` / ``tgt_embed`` (``nn.Embedding``, scaled by ``sqrt(d_model)``; the same module
    when ``share_embeddings``, which needs ``src_vocab == tgt_vocab``), ``pos_encoding``,
    ``transformer`` (the reference :class:`Transformer`, ``batch_first=True``) and ``generator``
    (``nn.Linear(d_model, tgt_vocab)``, its weight tied to ``tgt_embed`` when
    ``share_embeddings``). Token ``pad_id`` marks padding; ``bos_id`` starts decoder inputs.
    """

    def __init__(
        self,
        src_vocab: int,
        tgt_vocab: int,
        d_model: int = 512,
        nhead: int = 8,
        num_encoder_layers: int = 6,
        num_decoder_layers: int = 6,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable[[Tensor], Tensor] = "relu",
        norm_first: bool = False,
        share_embeddings: bool = False,
        pad_id: int = 0,
        max_len: int = 5000,
        bos_id: int = 1,
    ) -> None:
        super().__init__()
        if share_embeddings and src_vocab != tgt_vocab:
            raise ValueError(
                f"share_embeddings needs src_vocab == tgt_vocab, got {src_vocab} and {tgt_vocab}"
            )
        self.d_model = d_model
        self.pad_id = pad_id
        self.bos_id = bos_id
        self.src_embed = nn.Embedding(src_vocab, d_model)
        self.tgt_embed = self.src_embed if share_embeddings else nn.Embedding(tgt_vocab, d_model)
        embeds = [self.src_embed] if share_embeddings else [self.src_embed, self.tgt_embed]
        for embed in embeds:
            nn.init.normal_(embed.weight, mean=0.0, std=d_model**-0.5)
        self.pos_encoding = PositionalEncoding(d_model, dropout, max_len)
        self.transformer = Transformer(
            d_model,
            nhead,
            num_encoder_layers,
            num_decoder_layers,
            dim_feedforward,
            dropout,
            activation,
            batch_first=True,
            norm_first=norm_first,
        )
        self.generator = nn.Linear(d_model, tgt_vocab)
        if share_embeddings:
            self.generator.weight = self.tgt_embed.weight

    def _embed(self, embed: nn.Embedding, tokens: Tensor) -> Tensor:
        return self.pos_encoding(embed(tokens) * math.sqrt(self.d_model))

    def encode(self, src: Tensor) -> Tensor:
        """src ``(B, S)`` tokens -> memory ``(B, S, d_model)``."""
        return self.transformer.encoder(
            self._embed(self.src_embed, src), src_key_padding_mask=src == self.pad_id
        )

    def decode(self, tgt_in: Tensor, memory: Tensor, src: Tensor) -> Tensor:
        """tgt_in ``(B, T)`` tokens, memory ``(B, S, d_model)``, src ``(B, S)`` -> logits
        ``(B, T, tgt_vocab)``; causal + padding masks on the target, padding on the memory."""
        t = tgt_in.shape[1]
        # is_causal alone is the causal mask to this module's decoder (its layers swapped or
        # not), whose swapped kernels then skip the future's tiles without reading a mask; any
        # other decoder (torch.nn's, which needs the mask with the hint) gets the mask too.
        ours = isinstance(self.transformer.decoder, TransformerDecoder)
        out = self.transformer.decoder(
            self._embed(self.tgt_embed, tgt_in),
            memory,
            tgt_mask=None if ours else causal_mask(t, device=tgt_in.device),
            tgt_key_padding_mask=tgt_in == self.pad_id,
            memory_key_padding_mask=src == self.pad_id,
            tgt_is_causal=True,
        )
        return self.generator(out)

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """src ``(B, S)``, tgt_in ``(B, T)`` tokens -> logits ``(B, T, tgt_vocab)``."""
        return self.decode(tgt_in, self.encode(src), src)

    def loss(self, src: Tensor, tgt: Tensor, label_smoothing: float = 0.0) -> Tensor:
        """Mean cross-entropy of predicting ``tgt (B, T)`` from ``shift_right(tgt, bos_id)``,
        ignoring ``pad_id`` targets."""
        logits = self(src, shift_right(tgt, self.bos_id))
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            tgt.reshape(-1),
            ignore_index=self.pad_id,
            label_smoothing=label_smoothing,
        )
