"""`MultiheadAttention`: torch.nn.MultiheadAttention on the fused attention op.

The projections stay torch's linear layers; the attention core (scores, masks, softmax,
dropout, weighted sum) runs in `fastformer.ops.attention.scaled_dot_product_attention`, which
never materialises the (B, H, L, S) score or mask tensor. nn.MultiheadAttention's masks are
translated to the op's conventions without expanding them over heads.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from fastformer import reference
from fastformer.nn import _ops, _record
from fastformer.nn._lookup import child, param
from fastformer.ops import rng
from fastformer.ops._autograd import traced, under_transform
from fastformer.ops.attention import MAX_HEAD_DIM

_MAX_DROPOUT_P = rng.max_dropout_p(rng.ATTENTION_KEEP_ERROR)


def _check_mask_dtype(name: str, mask: Tensor) -> None:
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            f"{name} must be a bool tensor (True = masked) or a floating tensor (added to the "
            f"scores), got dtype {mask.dtype}"
        )


def _check_key_padding_mask(key_padding_mask: Tensor, batch: int, seq_k: int) -> None:
    _check_mask_dtype("key_padding_mask", key_padding_mask)
    if tuple(key_padding_mask.shape) != (batch, seq_k):
        raise ValueError(
            f"key_padding_mask must have shape (batch, seq_k) = {(batch, seq_k)}, "
            f"got {tuple(key_padding_mask.shape)}"
        )


def _sdpa_attn_mask(attn_mask: Tensor, batch: int, heads: int, lq: int, lk: int) -> Tensor:
    """nn.MultiheadAttention's attn_mask -> the op's, broadcastable to (B, H, Lq, Lk).

    (Lq, Lk) stays 2-D (broadcast by the op); (B*H, Lq, Lk) is viewed as (B, H, Lq, Lk). A bool
    mask flips meaning (nn: True = NOT allowed; SDPA: True = attend).
    """
    _check_mask_dtype("attn_mask", attn_mask)
    if attn_mask.dim() == 2 and tuple(attn_mask.shape) == (lq, lk):
        mask = attn_mask
    elif attn_mask.dim() == 3 and tuple(attn_mask.shape) == (batch * heads, lq, lk):
        mask = attn_mask.reshape(batch, heads, lq, lk)
    else:
        raise ValueError(
            f"attn_mask must have shape (seq_q, seq_k) = {(lq, lk)} or "
            f"(batch * num_heads, seq_q, seq_k) = {(batch * heads, lq, lk)}, "
            f"got {tuple(attn_mask.shape)}"
        )
    return ~mask if mask.dtype == torch.bool else mask


def _add_masks(attn_mask: Tensor, additive: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Sum of an SDPA-convention mask (bool: True = attend, or float) and a float mask; a bool
    mask becomes a float one of `dtype` (torch.nn: the query's) first."""
    if attn_mask.dtype == torch.bool:
        dtype = additive.dtype if dtype is None else torch.promote_types(additive.dtype, dtype)
        zeros = torch.zeros(attn_mask.shape, dtype=dtype, device=additive.device)
        attn_mask = zeros.masked_fill(~attn_mask, float("-inf"))
    return attn_mask + additive


def _causal_hint(
    attn_mask: Tensor | None, key_padding_mask: Tensor | None, is_causal: bool
) -> tuple[Tensor | None, bool]:
    """torch.nn's reading of is_causal as a hint that attn_mask is the causal mask
    (F.multi_head_attention_forward, need_weights=False): without a key_padding_mask the mask
    is dropped and the op applies the causal mask; with one, torch.nn applies attn_mask as given
    and drops is_causal (a float mask then also gets its gradient)."""
    if not is_causal or attn_mask is None:
        return attn_mask, is_causal
    if key_padding_mask is None:
        # Unread, so its shape is not checked either: torch.nn takes a (max_len, max_len)
        # causal mask given for a shorter sequence there; a model doing so must still run.
        _check_mask_dtype("attn_mask", attn_mask)
        return None, True
    return attn_mask, False


def _warn_mismatched_masks(key_padding_mask: Tensor | None, attn_mask: Tensor | None) -> None:
    """torch.nn.MultiheadAttention's deprecation warning (F._canonical_mask), shown at the
    module's forward as torch's is. (torch's layers and encoders give it under their own mask
    names, once per call; here each attention block gives it, and Python shows it once.) Not
    under torch.compile: dynamo cannot trace warnings.warn, and a graph break (an error under
    fullgraph, as torch.nn's module gets) would be the price of a deprecation notice."""
    if key_padding_mask is None or attn_mask is None or torch.compiler.is_compiling():
        return
    if key_padding_mask.dtype != attn_mask.dtype:
        warnings.warn(
            "Support for mismatched key_padding_mask and attn_mask is deprecated. Use same "
            "type for both instead.",
            stacklevel=3,
        )


def sdpa_masks(
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    is_causal: bool,
    batch: int,
    heads: int,
    lq: int,
    lk: int,
    causal_hint: bool = True,
    dtype: torch.dtype | None = None,
) -> tuple[Tensor | None, Tensor | None, bool]:
    """nn.MultiheadAttention's (attn_mask, key_padding_mask, is_causal) -> the op's.

    Args:
        attn_mask: None, (Lq, Lk) or (B*H, Lq, Lk); bool True = NOT allowed, or float added.
        key_padding_mask: None or (B, Lk); bool True = padding, or float added.
        is_causal: with `causal_hint` (torch.nn), a hint that `attn_mask` IS the causal mask:
            without a key_padding_mask the op applies the (top-left) causal mask itself and
            `attn_mask` is not read; with one, `attn_mask` is applied as given and is_causal
            is ignored (torch.nn's rule). Without `attn_mask` it simply asks for causal
            attention (torch.nn would raise there).
        causal_hint: False = fastformer.reference's semantics: is_causal applies the causal
            mask together with `attn_mask` and `key_padding_mask`.

    Returns:
        (attn_mask for the op: None, bool True = attend or float, broadcastable to
        (B, H, Lq, Lk); key_padding_mask: None or bool (B, Lk) True = padding; is_causal).
        A float key_padding_mask becomes an additive (B, 1, 1, Lk) mask, summed with a given
        attn_mask into at most (B, 1 or H, Lq, Lk) — never expanded over heads.
    """
    if key_padding_mask is not None:
        _check_key_padding_mask(key_padding_mask, batch, lk)
    if causal_hint:
        attn_mask, is_causal = _causal_hint(attn_mask, key_padding_mask, is_causal)
    if attn_mask is not None:
        attn_mask = _sdpa_attn_mask(attn_mask, batch, heads, lq, lk)
        # torch.nn adds a bool padding mask to a float attn_mask as a float mask of the query's
        # dtype, and the reference adds the mask to the scores: the sums promote (a float16
        # mask of a float32 module runs there; the op takes the query's dtype or float32).
        bool_padding = key_padding_mask is not None and key_padding_mask.dtype == torch.bool
        promotes = bool_padding or not causal_hint
        if dtype is not None and promotes and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(torch.promote_types(attn_mask.dtype, dtype))
    if key_padding_mask is not None and key_padding_mask.is_floating_point():
        additive = key_padding_mask.view(batch, 1, 1, lk)
        attn_mask = additive if attn_mask is None else _add_masks(attn_mask, additive, dtype)
        key_padding_mask = None
    return attn_mask, key_padding_mask, is_causal


def _head_views(x: Tensor, n: int, heads: int, batch_first: bool) -> list[Tensor]:
    x = x.unflatten(-1, (n, heads, -1))
    x = x.permute(2, 0, 3, 1, 4) if batch_first else x.permute(2, 1, 3, 0, 4)
    return list(x.unbind(0))


class _SplitHeads(torch.autograd.Function):
    """`_head_views` whose backward returns the gradients as the input's without a copy when
    they lie in one buffer exactly as the views lie in the input (the attention op's Triton
    backward allocates them so, fastformer.kernels.attention.grads_like). Autograd's own
    backward of the views stacks the n gradients and copies them back into (B, L, n*E): two
    passes over n*E activations a token."""

    @staticmethod
    def forward(ctx, x: Tensor, n: int, heads: int, batch_first: bool):
        parts = _head_views(x, n, heads, batch_first)
        ctx.x_geometry = (x.shape, x.stride())
        ctx.parts = [(p.stride(), p.storage_offset() - x.storage_offset()) for p in parts]
        ctx.batch_first = batch_first
        return tuple(parts)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        # (Autograd hands an unused view's gradient in as zeros: none is None.)
        shape, stride = ctx.x_geometry
        offset = _offset_in_one_buffer(grads, ctx.parts)
        if offset is not None:
            return grads[0].as_strided(shape, stride, offset), None, None, None
        grad = torch.stack(grads)
        grad = grad.permute(1, 3, 0, 2, 4) if ctx.batch_first else grad.permute(3, 1, 0, 2, 4)
        return grad.reshape(shape), None, None, None


def _offset_in_one_buffer(grads, parts) -> int | None:
    """The storage offset the input's gradient has when every gradient lies in one storage with
    the geometry (strides, offset from the input) of its part, else None."""
    base = grads[0].storage_offset() - parts[0][1]
    storage = grads[0].untyped_storage().data_ptr()
    for g, (stride, offset) in zip(grads, parts):
        if g.untyped_storage().data_ptr() != storage or g.stride() != stride:
            return None
        if g.storage_offset() - base != offset:
            return None
    return base


def _split_heads(x: Tensor, n: int, heads: int, batch_first: bool) -> list[Tensor]:
    """(B, L, n*E) or (L, B, n*E) -> n tensors (B, H, L, D) (views, no copy)."""
    if (
        x.requires_grad
        and torch.is_grad_enabled()
        and not traced()  # compiled or jit-traced: autograd's views (a trace cannot save it)
        and not under_transform()  # a Function without setup_context: torch.func refuses it
    ):
        return list(_SplitHeads.apply(x, n, heads, batch_first))
    return _head_views(x, n, heads, batch_first)


def _sizes(query: Tensor, key: Tensor, batch_first: bool) -> tuple[int, int, int]:
    """(batch, seq_q, seq_k) of 3-D (B, L, E) inputs (`batch_first`) or (L, B, E)."""
    if batch_first:
        return query.shape[0], query.shape[1], key.shape[1]
    return query.shape[1], query.shape[0], key.shape[0]


def _merge_heads(out: Tensor, batch_first: bool) -> Tensor:
    """(B, H, L, D) -> (B, L, E) or (L, B, E)."""
    out = out.transpose(1, 2) if batch_first else out.permute(2, 0, 1, 3)
    return out.flatten(-2)


class MultiheadAttention(nn.MultiheadAttention):
    """Drop-in `torch.nn.MultiheadAttention` whose attention core is the fused op.

    Same constructor, forward signature, parameters (`in_proj_weight`/`in_proj_bias`, or
    `q_proj_weight`/`k_proj_weight`/`v_proj_weight` when kdim/vdim differ, `out_proj`) and
    initialisation. Shapes: query (L, B, E) ((B, L, E) if batch_first, (L, E) unbatched),
    key/value (S, B, kdim/vdim); returns (output like query, None), or with need_weights=True
    torch.nn's (output, attention weights).

    Fast path (all float dtypes the op takes): packed or separate projections, self-, cross- or
    general attention, bool or float key_padding_mask and attn_mask ((L, S) or (B*H, L, S)),
    is_causal, dropout (this module's `dropout` in training mode). Falls back to
    torch.nn.MultiheadAttention.forward (same results; `fastformer.explain` says why, and
    `fallback_reasons` lists the configuration's reasons) for: need_weights=True (the fused
    kernel never forms the attention weights; note torch's default is True — pass
    need_weights=False), add_bias_kv, add_zero_attn, head dims over 256, nested-tensor inputs.

    A query row whose keys are all masked gives 0 here, as torch.nn does with need_weights=False
    (its SDPA path); with need_weights=True both give NaN (this module falls back to torch.nn).
    """

    __prepare_scriptable__ = _ops.refuse_script

    # is_causal with attn_mask is torch.nn's hint (see sdpa_masks); ReferenceMultiheadAttention
    # turns it off.
    _causal_hint: bool = True
    _fallback = "torch.nn"  # what runs where the fused path does not (explain's record)
    _calls_out_proj = False  # torch.nn reads out_proj's parameters, never calls it

    @property
    def fallback_reasons(self) -> list[str]:
        """Why this module's configuration always takes torch.nn's path ([] = it never does
        for configuration reasons; per-call reasons such as need_weights=True are listed by
        `fastformer.explain`)."""
        reasons = []
        if self.bias_k is not None:
            reasons.append("add_bias_kv=True: the fused kernel has no learned bias key/value")
        if self.add_zero_attn:
            reasons.append("add_zero_attn=True: the fused kernel has no zero attention slot")
        reasons += _ops.dropout_reasons(self.dropout, rng.ATTENTION_KEEP_ERROR)
        if self.head_dim > MAX_HEAD_DIM:
            reasons.append(f"head_dim {self.head_dim}: the fused op takes up to {MAX_HEAD_DIM}")
        return reasons

    def _call_reasons(self, query: Tensor, key: Tensor, value: Tensor, need_weights: bool):
        reasons = self.fallback_reasons
        if need_weights:
            reasons.append(
                "need_weights=True (torch.nn's default): the fused kernel does not form the "
                "attention weights; pass need_weights=False"
            )
        if _ops.not_dense(query, key, value):
            reasons.append("nested or non-tensor input: the op takes dense (B, H, L, D) tensors")
        return reasons

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """See torch.nn.MultiheadAttention.forward; `is_causal=True` without `attn_mask` is
        allowed here and means causal attention. With `attn_mask`, is_causal is torch.nn's hint
        that attn_mask is the causal mask: attn_mask is not read, except with a
        key_padding_mask, where attn_mask is applied as given and is_causal ignored."""
        reference.refuse_causal_bias(attn_mask)
        plain = (
            not need_weights
            and self.bias_k is None
            and not self.add_zero_attn
            and self.dropout <= _MAX_DROPOUT_P
            and self.head_dim <= MAX_HEAD_DIM
            and not _ops.not_dense(query, key, value)
        )
        if not plain:
            reasons = self._call_reasons(query, key, value, need_weights)
            _record.note(self, "MultiheadAttention", self._fallback, [("fastformer", reasons)])
            return self._torch_forward(
                query, key, value, key_padding_mask, need_weights, attn_mask,
                average_attn_weights, is_causal,
            )  # fmt: skip
        return self._fast_forward(query, key, value, key_padding_mask, attn_mask, is_causal)

    def _torch_forward(
        self, query, key, value, key_padding_mask, need_weights, attn_mask, average, is_causal
    ):
        if is_causal and attn_mask is None:  # torch.nn needs the mask is_causal describes
            attn_mask = self._causal_mask(query, key)
        return super().forward(
            query, key, value, key_padding_mask, need_weights, attn_mask, average, is_causal
        )

    def _causal_mask(self, query: Tensor, key: Tensor) -> Tensor:
        """The (Lq, Lk) bool mask that is_causal describes (nn convention: True = NOT allowed)."""
        if query.is_nested or key.is_nested:
            # torch.nn's nested path ignores is_causal (its output is the non-causal one)
            raise ValueError(
                "is_causal=True is not supported with nested-tensor query/key: sequences of "
                "different lengths have no one (Lq, Lk) causal mask, and torch.nn."
                "MultiheadAttention would silently ignore is_causal; pad the batch to a dense "
                "tensor (with key_padding_mask) instead"
            )
        seq_dim = 0 if query.dim() == 2 or not self.batch_first else 1
        lq, lk = query.shape[seq_dim], key.shape[seq_dim]
        return torch.ones(lq, lk, dtype=torch.bool, device=query.device).triu(1)

    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        if query.dim() not in (2, 3):
            raise ValueError(
                f"query must be 3-D (seq, batch, embed) or (batch, seq, embed) with "
                f"batch_first, or 2-D unbatched, got shape {tuple(query.shape)}"
            )
        for name, t, dim in (
            ("query", query, self.embed_dim),
            ("key", key, self.kdim),
            ("value", value, self.vdim),
        ):
            if t.dim() != query.dim():
                raise ValueError(
                    f"{name} must have as many dims as query ({query.dim()}), got shape "
                    f"{tuple(t.shape)}"
                )
            if t.shape[-1] != dim:
                raise ValueError(f"{name} must have last dim {dim}, got shape {tuple(t.shape)}")
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(
                f"key and value must have the same (seq, batch) dims, got key "
                f"{tuple(key.shape)} and value {tuple(value.shape)}"
            )

    def _project(self, query: Tensor, key: Tensor, value: Tensor, bf: bool) -> list[Tensor]:
        """q, k, v as (B, H, L, D) from (B, L, E) inputs (`bf`) or (L, B, E); one GEMM for all
        three in self-attention, one for k and v when key is value (usual cross-attention)."""
        e, h = self.embed_dim, self.num_heads
        bias = param(self, "in_proj_bias")
        if query is key and key is value and self._qkv_same_embed_dim:
            # Self-attention, the usual case first: no bias slices (host time per call).
            weight = param(self, "in_proj_weight")
            return _split_heads(nn.functional.linear(query, weight, bias), 3, h, bf)
        b_q = b_k = b_v = None
        if bias is not None:
            b_q, b_k, b_v = bias.split(e)
        if not self._qkv_same_embed_dim:
            q = nn.functional.linear(query, self.q_proj_weight, b_q)
            k = nn.functional.linear(key, self.k_proj_weight, b_k)
            v = nn.functional.linear(value, self.v_proj_weight, b_v)
            return [_split_heads(t, 1, h, bf)[0] for t in (q, k, v)]
        w = param(self, "in_proj_weight")
        q = _split_heads(nn.functional.linear(query, w[:e], b_q), 1, h, bf)[0]
        if key is value:
            b_kv = None if bias is None else bias[e:]
            k, v = _split_heads(nn.functional.linear(key, w[e:], b_kv), 2, h, bf)
            return [q, k, v]
        k = _split_heads(nn.functional.linear(key, w[e : 2 * e], b_k), 1, h, bf)[0]
        v = _split_heads(nn.functional.linear(value, w[2 * e :], b_v), 1, h, bf)[0]
        return [q, k, v]

    def _fast_forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None,
        attn_mask: Tensor | None,
        is_causal: bool,
    ) -> tuple[Tensor, None]:
        self._check_inputs(query, key, value)
        batched = query.dim() == 3
        batch_first = self.batch_first or not batched
        if not batched:  # (L, E) -> (1, L, E); keep `is` identities for the packed GEMMs
            same_kv, same_qk = key is value, query is key
            query = query.unsqueeze(0)
            key = query if same_qk else key.unsqueeze(0)
            value = key if same_kv else value.unsqueeze(0)
            if key_padding_mask is not None:
                if key_padding_mask.dim() != 1:  # torch.nn's rule, said before the unsqueeze
                    raise ValueError(
                        "key_padding_mask must be 1-D (seq_k,) for an unbatched (2-D) query, "
                        f"got shape {tuple(key_padding_mask.shape)}"
                    )
                key_padding_mask = key_padding_mask.unsqueeze(0)
        # The masks are checked before the projection GEMMs run.
        batch, lq, lk = _sizes(query, key, batch_first)
        mask, kpm, causal = sdpa_masks(
            attn_mask, key_padding_mask, is_causal, batch, self.num_heads, lq, lk,
            self._causal_hint, query.dtype,
        )  # fmt: skip
        if self._causal_hint:  # torch.nn's module, not the reference's
            _warn_mismatched_masks(key_padding_mask, attn_mask)
        q, k, v = self._project(query, key, value, batch_first)
        p = self.dropout if self.training else 0.0
        out = _ops.attention(self, q, k, v, mask, p, causal, kpm)
        proj = child(self, "out_proj")
        if self._calls_out_proj:  # on (B, L, E), as the reference: its hooks see that shape
            out = proj(_merge_heads(out, True))
            out = out if batch_first else out.transpose(0, 1)
        else:
            merged = _merge_heads(out, batch_first)
            out = nn.functional.linear(merged, param(proj, "weight"), param(proj, "bias"))
        return (out if batched else out.squeeze(0)), None


def _with_causal(attn_mask: Tensor, blocked: Tensor) -> Tensor:
    """An nn.MultiheadAttention attn_mask ((Lq, Lk) or (B*H, Lq, Lk); bool True = NOT allowed,
    or float added) that also blocks the keys `blocked` (the causal mask) blocks."""
    if attn_mask.dtype == torch.bool:
        return attn_mask | blocked
    return attn_mask.masked_fill(blocked, float("-inf"))


class ReferenceMultiheadAttention(MultiheadAttention):
    """What `fastformer.swap` turns a `fastformer.reference.MultiheadAttention` into: this
    module's fused path with the reference's forward semantics, so a swap does not change what
    a call computes. `need_weights` defaults to False, and `is_causal=True` applies the causal
    mask together with `attn_mask` and `key_padding_mask` (torch.nn reads it as a hint that
    attn_mask is the causal mask and drops one of the two)."""

    _causal_hint = False
    _fallback = "the reference"  # what runs where the fused path does not (`_torch_forward`)
    # The reference calls its out_proj (torch.nn does not): its hooks, a prune mask or an
    # old-style weight_norm run. F.linear on its weight skipped them: a pruned out_proj used a
    # stale weight, and training it raised.
    _calls_out_proj = True

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
        """See fastformer.reference.MultiheadAttention.forward."""
        return super().forward(
            query, key, value, key_padding_mask, need_weights, attn_mask,
            average_attn_weights, is_causal,
        )  # fmt: skip

    # For the reference's forward on this module's parameters (`_torch_forward`).
    _split_heads = reference.MultiheadAttention._split_heads
    _sdpa_masks = reference.MultiheadAttention._sdpa_masks

    def _torch_forward(
        self, query, key, value, key_padding_mask, need_weights, attn_mask, average, is_causal
    ):
        if not _ops.not_dense(query, key, value):
            # The reference's own function where the fused path does not apply (need_weights,
            # dropout past the kernels' limits): torch.nn's weights are NaN in a row whose every
            # key is masked, where the reference's (and its output) are 0.
            return reference.MultiheadAttention.forward(
                self, query, key, value, key_padding_mask, need_weights, attn_mask, average,
                is_causal,
            )  # fmt: skip
        if is_causal and attn_mask is not None:
            # torch.nn would read is_causal as a hint and drop one of the two: merge them.
            attn_mask = _with_causal(attn_mask, self._causal_mask(query, key))
            is_causal = False
        return super()._torch_forward(
            query, key, value, key_padding_mask, need_weights, attn_mask, average, is_causal
        )
