"""Encoder/decoder layers, their stacks, the full Transformer and the positional encoding.

Each class subclasses its torch.nn counterpart: same constructor, forward signature, parameter
names, shapes and initialisation (the same torch.manual_seed gives the same weights), so
state_dicts load both ways with strict=True. A layer runs its sub-layers as

* attention: its (fastformer) MultiheadAttention, i.e. the fused attention op;
* residual: Post-LN `norm(x + dropout(sublayer(x)))` is one `dropout_add_layer_norm` op; in
  Pre-LN `x + dropout(sublayer(norm(x)))` the add of one sub-layer and the norm of the next are
  one op (`prenorm=True` returns both the normalized input and the residual stream);
* FFN: the fused `ffn` op (linear1, bias, activation, dropout, linear2, bias).

Dropout p comes from the layer's nn.Dropout modules and applies in training mode only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastformer import reference
from fastformer.nn import _ops, _record
from fastformer.nn._lookup import child, param
from fastformer.nn.attention import MultiheadAttention
from fastformer.nn.ffn import (
    Activation,
    check_activation,
    feed_forward,
    ffn_reasons,
    is_plain,
    linear1_features,
)
from fastformer.nn.layer_norm import LayerNorm, eps_reasons

_TORCH_ACTIVATIONS = ("relu", "gelu")
# fastformer LayerNorm only: a torch.nn or reference one is a child swap left alone (exclude,
# include), and its computation stays its own, as a left MultiheadAttention's does.
_NORM_TYPES = (LayerNorm,)


def _adopt_children(module: nn.Module) -> None:
    """Turn the torch.nn attention and LayerNorm children torch's __init__ built into their
    fastformer subclasses, in place (no new parameters, so init and RNG use match torch)."""
    for sub in module.children():
        if type(sub) is nn.MultiheadAttention:
            sub.__class__ = MultiheadAttention
        elif type(sub) is nn.LayerNorm:
            sub.__class__ = LayerNorm


def _torch_activation(activation: Activation) -> Activation:
    """What torch's layer __init__ gets: the activation, or "relu" for fastformer's extras."""
    check_activation(activation)
    return activation if callable(activation) or activation in _TORCH_ACTIVATIONS else "relu"


def _finish_layer(
    layer: nn.Module, activation: Activation, d_model: int, dim_ff: int, bias: bool, kw: dict
) -> bool:
    """After torch's __init__: fastformer children, and one of fastformer's extra activations
    when torch was given "relu" in its place (then True)."""
    _adopt_children(layer)
    if _torch_activation(activation) is activation:
        return False
    layer.activation = activation
    if linear1_features(dim_ff, activation) != dim_ff:
        layer.linear1 = nn.Linear(d_model, linear1_features(dim_ff, activation), bias, **kw)
    return True


def _norm_reasons(norm: nn.Module, drop: nn.Module) -> list[str]:
    """Why `norm(residual + drop(x))` cannot be one dropout_add_layer_norm op ([] = it can)."""
    reasons = []
    if is_plain(norm, (nn.LayerNorm, reference.LayerNorm)):  # exact types: not fastformer's
        reasons.append(f"{type(norm).__module__}.LayerNorm is not fastformer's (left by swap)")
    elif not is_plain(norm, _NORM_TYPES) or len(norm.normalized_shape) != 1:
        reasons.append(f"{type(norm).__name__} is not a plain 1-D LayerNorm without hooks")
    else:
        reasons += eps_reasons(norm.eps)
    if not is_plain(drop, (nn.Dropout,)):
        reasons.append("the residual dropout is not a plain nn.Dropout without hooks")
    else:
        reasons += _ops.dropout_reasons(drop.p)
    return reasons


def residual_norm(
    owner: nn.Module,
    sub: Tensor,
    residual: Tensor,
    norm_name: str,
    drop_name: str,
    prenorm: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """`norm(residual + drop(sub))`, plus the sum itself when `prenorm`, as one fused op; norm
    and drop are the children of `owner` named `norm_name` and `drop_name`.

    sub, residual: (..., d_model). Falls back to calling `drop` and `norm` (reason recorded)
    when they are not a plain nn.Dropout and a plain 1-D LayerNorm.
    """
    norm, drop = child(owner, norm_name), child(owner, drop_name)
    reasons = _norm_reasons(norm, drop)
    if not reasons:
        p = drop.p if drop.training else 0.0
        weight, bias = param(norm, "weight"), param(norm, "bias")
        return _ops.dropout_add_layer_norm(owner, sub, residual, weight, bias, norm.eps, p, prenorm)
    _record.note(owner, "dropout_add_layer_norm", "eager", [("fastformer", reasons)])
    pre = residual + drop(sub)
    out = norm(pre)
    return (out, pre) if prenorm else out


def _layer_reasons(layer: nn.Module, attentions: tuple[str, ...], fused: list[tuple]) -> list[str]:
    """Configuration reasons for the unfused path of each part of a layer."""
    reasons = [f"ffn: {why}" for why in ffn_reasons(layer)]
    for norm, drop in fused:
        reasons += [
            f"{norm} + {drop}: {why}"
            for why in _norm_reasons(*(getattr(layer, n) for n in (norm, drop)))
        ]
    for name in attentions:
        attn = getattr(layer, name)
        if not isinstance(attn, MultiheadAttention):
            kind = f"{type(attn).__module__}.{type(attn).__qualname__}"
            reasons.append(f"{name}: a {kind}, not fastformer's MultiheadAttention")
        else:
            reasons += [f"{name}: {why}" for why in attn.fallback_reasons]
    return reasons


def _fused_pairs(layer: nn.Module, count: int) -> list[tuple[str, str]]:
    """The (norm, dropout) pairs a layer with `count` sub-layers fuses: Post-LN pairs norm_i
    with dropout_i; Pre-LN pairs norm_(i+1) with dropout_i (the last dropout is a plain add)."""
    if layer.norm_first:
        return [(f"norm{i + 1}", f"dropout{i}") for i in range(1, count)]
    return [(f"norm{i}", f"dropout{i}") for i in range(1, count + 1)]


def _nested_fallback(owner: nn.Module, *tensors: Tensor) -> bool:
    if not any(t.is_nested for t in tensors):
        return False
    if isinstance(owner.activation, str) and owner.activation not in _TORCH_ACTIVATIONS:
        raise ValueError(
            f"nested-tensor input runs torch.nn's layer, which has no activation "
            f"{owner.activation!r} (fastformer's own); pass a padded tensor with a key padding "
            "mask, or F.silu / nn.GELU('tanh') for 'silu' / 'gelu_tanh'"
        )
    reason = "nested-tensor input (torch.nn's sparsity fast path): the ops take dense tensors"
    _record.note(owner, type(owner).__name__, "torch.nn", [("fastformer", [reason])])
    return True


class TransformerEncoderLayer(nn.TransformerEncoderLayer):
    """Drop-in `torch.nn.TransformerEncoderLayer`: self-attention and FFN sub-layers with
    dropout, residual and LayerNorm (Post-LN, or Pre-LN when norm_first).

    Same arguments and submodules (self_attn, linear1, dropout, linear2, norm1, norm2,
    dropout1, dropout2). `activation` also takes "gelu_tanh", "silu", "swiglu" and "geglu"
    (the gated ones make linear1 output 2 * dim_feedforward). src (S, B, E) ((B, S, E) if
    batch_first, (S, E) unbatched) -> same shape. src_mask (S, S) or (B*nhead, S, S),
    src_key_padding_mask (B, S): bool True = masked, or float added. is_causal=True applies the
    causal mask; with src_mask it is torch.nn's hint that src_mask is causal (src_mask is not
    read, except with src_key_padding_mask: then, as in torch.nn, src_mask is applied as given
    and is_causal ignored).
    Inputs float32/float16/bfloat16; the output has src's dtype. Nested-tensor input falls
    back to torch.nn.
    """

    __prepare_scriptable__ = _ops.refuse_script

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: Activation = F.relu,
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            d_model, nhead, dim_feedforward, dropout, _torch_activation(activation),
            layer_norm_eps, batch_first, norm_first, bias, device, dtype,
        )  # fmt: skip
        kw = {"device": device, "dtype": dtype}
        if _finish_layer(self, activation, d_model, dim_feedforward, bias, kw):
            self.activation_relu_or_gelu = 0  # keeps torch's own fused path away

    @property
    def fallback_reasons(self) -> list[str]:
        """Why parts of this layer run unfused ([] = all fused; nested-tensor input, a per-call
        reason, is reported by `fastformer.explain`)."""
        return _layer_reasons(self, ("self_attn",), _fused_pairs(self, 2))

    def _sa(self, x: Tensor, mask: Tensor | None, kpm: Tensor | None, causal: bool) -> Tensor:
        return child(self, "self_attn")(
            x, x, x, attn_mask=mask, key_padding_mask=kpm, need_weights=False, is_causal=causal
        )[0]

    def forward(
        self,
        src: Tensor,
        src_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> Tensor:
        """src (S, B, E) / (B, S, E) / (S, E) -> same shape and dtype."""
        if _nested_fallback(self, src):
            return super().forward(src, src_mask, src_key_padding_mask, is_causal)
        masks = (src_mask, src_key_padding_mask, bool(is_causal))
        x = src
        if self.norm_first:
            attn = self._sa(self.norm1(x), *masks)
            h, x = residual_norm(self, attn, x, "norm2", "dropout1", prenorm=True)
            return x + self.dropout2(feed_forward(self, h))
        x = residual_norm(self, self._sa(x, *masks), x, "norm1", "dropout1")
        return residual_norm(self, feed_forward(self, x), x, "norm2", "dropout2")


class TransformerDecoderLayer(nn.TransformerDecoderLayer):
    """Drop-in `torch.nn.TransformerDecoderLayer`: masked self-attention, cross-attention over
    the encoder memory and FFN, each with dropout, residual and LayerNorm.

    Same arguments and submodules (self_attn, multihead_attn, linear1, dropout, linear2,
    norm1-3, dropout1-3); `activation` as in TransformerEncoderLayer. tgt (T, B, E), memory
    (S, B, E) (batch first if batch_first) -> like tgt. tgt_mask (T, T), memory_mask (T, S)
    (or per head (B*nhead, ., .)), key padding masks (B, T) / (B, S); tgt_is_causal /
    memory_is_causal as is_causal of the encoder layer. Inputs float32/float16/bfloat16; the
    output has tgt's dtype.
    """

    __prepare_scriptable__ = _ops.refuse_script

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: Activation = F.relu,
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            d_model, nhead, dim_feedforward, dropout, _torch_activation(activation),
            layer_norm_eps, batch_first, norm_first, bias, device, dtype,
        )  # fmt: skip
        _finish_layer(
            self, activation, d_model, dim_feedforward, bias, {"device": device, "dtype": dtype}
        )

    @property
    def fallback_reasons(self) -> list[str]:
        """Why parts of this layer run unfused ([] = all fused)."""
        return _layer_reasons(self, ("self_attn", "multihead_attn"), _fused_pairs(self, 3))

    def _sa(self, x: Tensor, mask: Tensor | None, kpm: Tensor | None, causal: bool) -> Tensor:
        return child(self, "self_attn")(
            x, x, x, attn_mask=mask, key_padding_mask=kpm, need_weights=False, is_causal=causal
        )[0]

    def _ca(self, x: Tensor, mem: Tensor, mask, kpm, causal: bool) -> Tensor:
        return child(self, "multihead_attn")(
            x, mem, mem, attn_mask=mask, key_padding_mask=kpm, need_weights=False,
            is_causal=causal,
        )[0]  # fmt: skip

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
        """tgt (T, B, E), memory (S, B, E) (batch first if batch_first) -> like tgt."""
        if _nested_fallback(self, tgt, memory):
            return super().forward(
                tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask,
                memory_key_padding_mask, tgt_is_causal, memory_is_causal,
            )  # fmt: skip
        self_masks = (tgt_mask, tgt_key_padding_mask, bool(tgt_is_causal))
        mem_masks = (memory_mask, memory_key_padding_mask, bool(memory_is_causal))
        x = tgt
        if self.norm_first:
            attn = self._sa(self.norm1(x), *self_masks)
            h, x = residual_norm(self, attn, x, "norm2", "dropout1", prenorm=True)
            attn = self._ca(h, memory, *mem_masks)
            h, x = residual_norm(self, attn, x, "norm3", "dropout2", prenorm=True)
            return x + self.dropout3(feed_forward(self, h))
        x = residual_norm(self, self._sa(x, *self_masks), x, "norm1", "dropout1")
        x = residual_norm(self, self._ca(x, memory, *mem_masks), x, "norm2", "dropout2")
        return residual_norm(self, feed_forward(self, x), x, "norm3", "dropout3")


def _causal_hint_note(owner: nn.Module, name: str, mask: Tensor | None, causal: bool | None):
    """While explaining: a mask given with is_causal=None runs as a mask; say how to do better."""
    if mask is not None and causal is None and _record.active():
        hint = (
            f"{name} is applied as given since is_causal is None (torch.nn compares the mask "
            "with the causal one, a device sync); if it is the causal mask, pass is_causal=True "
            "and the kernel skips the masked blocks"
        )
        _record.note(owner, name, "applied as given", [("is_causal", [hint])])


class TransformerEncoder(nn.TransformerEncoder):
    """Drop-in `torch.nn.TransformerEncoder`: `num_layers` deep copies of `encoder_layer`
    (`layers`), then `norm` if given.

    `enable_nested_tensor` and `mask_check` are accepted and ignored: torch's nested-tensor
    path would bypass the fastformer layers (padded positions are computed like any other and
    are not zeroed). `is_causal=None` with a mask applies the mask as given (no data-dependent
    causal detection, which would sync the device and break torch.compile graphs).
    src (S, B, E) / (B, S, E) in float32/float16/bfloat16 -> same shape and dtype.
    """

    __prepare_scriptable__ = _ops.refuse_script

    def __init__(
        self,
        encoder_layer: nn.Module,
        num_layers: int,
        norm: nn.Module | None = None,
        enable_nested_tensor: bool = True,
        mask_check: bool = True,
    ) -> None:
        super().__init__(encoder_layer, num_layers, norm, False, mask_check)
        self.enable_nested_tensor = enable_nested_tensor

    def forward(
        self,
        src: Tensor,
        mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool | None = None,
    ) -> Tensor:
        """src (S, B, E) ((B, S, E) if batch_first) -> same shape."""
        _causal_hint_note(self, "mask", mask, is_causal)
        # The reference's layer loop: it only reads `layers` and `norm`, which torch's has too.
        return reference.TransformerEncoder.forward(
            self, src, mask, src_key_padding_mask, is_causal
        )


class TransformerDecoder(nn.TransformerDecoder):
    """Drop-in `torch.nn.TransformerDecoder`: `num_layers` deep copies of `decoder_layer`
    (`layers`), then `norm` if given. tgt_is_causal=None as is_causal=None of the encoder.
    tgt (T, B, E), memory (S, B, E) (batch first if batch_first), float32/float16/bfloat16
    -> tgt's shape and dtype."""

    __prepare_scriptable__ = _ops.refuse_script

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
        """tgt (T, B, E), memory (S, B, E) -> like tgt."""
        _causal_hint_note(self, "tgt_mask", tgt_mask, tgt_is_causal)
        return reference.TransformerDecoder.forward(
            self, tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask,
            memory_key_padding_mask, tgt_is_causal, memory_is_causal,
        )  # fmt: skip


class Transformer(nn.Transformer):
    """Drop-in `torch.nn.Transformer` built from the fastformer layers and stacks.

    Same arguments, forward (src, tgt and the six masks, src/tgt/memory_is_causal), parameter
    names (encoder.layers.N.*, encoder.norm.*, decoder.layers.N.*, decoder.norm.*) and init:
    torch.manual_seed(s) gives the weights torch.nn.Transformer gets. `activation` also takes
    "gelu_tanh", "silu", "swiglu" and "geglu". src (S, B, E), tgt (T, B, E) (batch first if
    batch_first), float32/float16/bfloat16 -> (T, B, E) in tgt's dtype.
    """

    __prepare_scriptable__ = _ops.refuse_script

    def __init__(
        self,
        d_model: int = 512,
        nhead: int = 8,
        num_encoder_layers: int = 6,
        num_decoder_layers: int = 6,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: Activation = F.relu,
        custom_encoder: nn.Module | None = None,
        custom_decoder: nn.Module | None = None,
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        check_activation(activation)
        kw = {"device": device, "dtype": dtype}
        layer_args = (d_model, nhead, dim_feedforward, dropout, activation, layer_norm_eps)
        layer_args += (batch_first, norm_first, bias)
        # Built in torch's order (encoder layer, norm, stack, then decoder) so that the same
        # seed gives the same weights; torch's __init__ then re-initialises the matrices.
        if custom_encoder is None:
            layer = TransformerEncoderLayer(*layer_args, **kw)
            norm = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw)
            custom_encoder = TransformerEncoder(layer, num_encoder_layers, norm)
        if custom_decoder is None:
            layer = TransformerDecoderLayer(*layer_args, **kw)
            norm = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **kw)
            custom_decoder = TransformerDecoder(layer, num_decoder_layers, norm)
        super().__init__(
            d_model, nhead, num_encoder_layers, num_decoder_layers, dim_feedforward, dropout,
            F.relu, custom_encoder, custom_decoder, layer_norm_eps, batch_first, norm_first,
            bias, device, dtype,
        )  # fmt: skip


class PositionalEncoding(reference.PositionalEncoding):
    """Sinusoidal positional encoding of the paper, then dropout (the reference module with an
    input check): x (B, L, d_model) ((L, B, d_model) with batch_first=False) -> x + pe[:L].

    `pe` is a non-persistent (max_len, d_model) buffer, not in the state_dict.
    """

    def forward(self, x: Tensor) -> Tensor:
        """x (B, L, d_model) / (L, B, d_model) -> same shape and dtype."""
        seq_dim = 1 if self.batch_first else 0
        if x.dim() != 3 or x.shape[-1] != self.pe.shape[1]:
            raise ValueError(
                f"x must be 3-D with last dim d_model={self.pe.shape[1]}, got shape "
                f"{tuple(x.shape)}"
            )
        if x.shape[seq_dim] > self.pe.shape[0]:
            raise ValueError(
                f"x has sequence length {x.shape[seq_dim]} (dim {seq_dim}) but max_len is "
                f"{self.pe.shape[0]}; construct PositionalEncoding with a larger max_len"
            )
        return super().forward(x)
