"""`FeedForward`: the position-wise feed-forward block on fastformer's fused ffn op.

Also the FFN code the encoder and decoder layers share: `feed_forward(owner, x)` runs
`linear2(dropout(activation(linear1(x))))` of any module holding `linear1`, `dropout`,
`linear2` and `activation` (the torch.nn layer attribute names) through the op when it can.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as _module

from fastformer.nn import _ops, _record
from fastformer.nn._lookup import child, param
from fastformer.reference import ACTIVATIONS, GATED_ACTIVATIONS

Activation = str | Callable[[Tensor], Tensor]

_LINEAR_TYPES = (nn.Linear, nn.modules.linear.NonDynamicallyQuantizableLinear)


def check_activation(activation: Activation) -> None:
    """ValueError/TypeError unless `activation` is one of ACTIVATIONS or a callable."""
    if isinstance(activation, str):
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {ACTIVATIONS} or a callable, got {activation!r}"
            )
    elif not callable(activation):
        raise TypeError(
            f"activation must be a string in {ACTIVATIONS} or a callable, got "
            f"{type(activation).__name__}"
        )


def activation_name(activation: Activation) -> str | None:
    """The op's name for `activation` (a string, F.relu/F.gelu/F.silu or nn.ReLU/GELU/SiLU),
    or None for any other callable, which the fused op cannot run."""
    if isinstance(activation, str):
        return activation if activation in ACTIVATIONS else None
    if activation is F.relu or type(activation) is nn.ReLU:
        return "relu"
    if activation is F.gelu:
        return "gelu"
    if type(activation) is nn.GELU:
        return "gelu" if activation.approximate == "none" else "gelu_tanh"
    if activation is F.silu or type(activation) is nn.SiLU:
        return "silu"
    return None


def linear1_features(dim_feedforward: int, activation: Activation) -> int:
    """Output features of linear1: twice dim_feedforward for the gated activations."""
    gated = isinstance(activation, str) and activation in GATED_ACTIVATIONS
    return 2 * dim_feedforward if gated else dim_feedforward


def _runs_hooks(module: nn.Module) -> bool:
    """Whether calling `module` runs hooks: its own forward / backward hooks or global ones
    (`torch.nn.modules.module.register_module_forward_hook` and the like, which profilers use),
    as torch.nn's `Module._call_impl` tests; fastformer.explain's own hook aside."""
    if module._forward_hooks or module._forward_pre_hooks:
        return True
    if module._backward_hooks or module._backward_pre_hooks:
        return True
    if _module._global_forward_hooks or _module._global_backward_hooks:
        return True
    if _module._global_backward_pre_hooks:
        return True
    # (A tuple, made in one step: another thread's explain may add or remove its hook.)
    return any(h not in _record.OWN_HOOKS for h in tuple(_module._global_forward_pre_hooks))


def is_plain(module: nn.Module, types: tuple[type, ...]) -> bool:
    """True when `module` is exactly one of `types` and calling it runs no hooks (its own or
    global ones): a fused op can then stand for its forward without skipping anything the user
    attached."""
    return type(module) in types and not _runs_hooks(module)


def ffn_reasons(owner: nn.Module) -> list[str]:
    """Why `feed_forward(owner, x)` runs unfused ([] = it runs the fused op)."""
    return _reasons(owner, *_parts(owner))


def _parts(owner: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module]:
    """owner's linear1, dropout and linear2, each looked up once (host time)."""
    return child(owner, "linear1"), child(owner, "dropout"), child(owner, "linear2")


def _reasons(
    owner: nn.Module, linear1: nn.Module, drop: nn.Module, linear2: nn.Module
) -> list[str]:
    reasons = []
    if activation_name(owner.activation) is None:
        reasons.append(
            f"activation {owner.activation!r} is a custom callable; the fused FFN runs "
            f"{', '.join(ACTIVATIONS)} (or F.relu/F.gelu/F.silu, nn.ReLU/GELU/SiLU)"
        )
    elif isinstance(owner.activation, nn.Module) and _runs_hooks(owner.activation):
        reasons.append(f"activation {type(owner.activation).__name__} runs hooks")
    for name, linear in (("linear1", linear1), ("linear2", linear2)):
        if not is_plain(linear, _LINEAR_TYPES):
            reasons.append(f"{name} is not a plain nn.Linear without hooks")
    if not is_plain(drop, (nn.Dropout,)):
        reasons.append("dropout is not a plain nn.Dropout without hooks")
    else:
        reasons += _ops.dropout_reasons(drop.p)
    return reasons


def _gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


# The activation of each name (for the gated ones: of the gate half).
_EAGER = {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": _gelu_tanh, "silu": F.silu}
_EAGER |= {"swiglu": F.silu, "geglu": F.gelu}


def _eager_activation(activation: Activation, h: Tensor) -> Tensor:
    """The activation in plain torch (gated: act(first half) * second half)."""
    if not isinstance(activation, str):
        return activation(h)
    if activation in GATED_ACTIVATIONS:
        gate, up = h.chunk(2, dim=-1)
        return _EAGER[activation](gate) * up
    return _EAGER[activation](h)


def feed_forward(owner: nn.Module, x: Tensor) -> Tensor:
    """`owner.linear2(owner.dropout(act(owner.linear1(x))))` (gated: act(gate) * up).

    x (..., d_model) -> (..., d_model). Runs the fused op unless the activation is a custom
    callable or a sub-module is not plain (then torch.nn's modules run, reason recorded).
    """
    l1, drop, l2 = parts = _parts(owner)
    reasons = _reasons(owner, *parts)
    if reasons:
        _record.note(owner, "ffn", "eager", [("fastformer", reasons)])
        return l2(drop(_eager_activation(owner.activation, l1(x))))
    p = drop.p if drop.training else 0.0
    w1, b1, w2, b2 = param(l1, "weight"), param(l1, "bias"), param(l2, "weight"), param(l2, "bias")
    return _ops.ffn(owner, x, w1, b1, w2, b2, activation_name(owner.activation), p)


class FeedForward(nn.Module):
    """Position-wise feed-forward block `linear2(dropout(activation(linear1(x))))`.

    Parameters `linear1` (d_model -> dim_feedforward, twice that for "swiglu"/"geglu") and
    `linear2` (dim_feedforward -> d_model), named like torch.nn.TransformerEncoderLayer's, and
    the same nn.Linear init. `activation`: "relu", "gelu", "gelu_tanh", "silu", "swiglu",
    "geglu", or a callable (F.relu/F.gelu/F.silu and nn.ReLU/GELU/SiLU are fused; any other
    callable runs unfused). The dropout (p=`dropout`, training mode only) is the inner one,
    after the activation; the residual dropout belongs to the caller.

    Input (..., d_model) in float32/float16/bfloat16; output (..., d_model), same dtype.
    """

    __prepare_scriptable__ = _ops.refuse_script

    def __init__(
        self,
        d_model: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: Activation = "relu",
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_activation(activation)
        kw = {"device": device, "dtype": dtype}
        self.linear1 = nn.Linear(d_model, linear1_features(dim_feedforward, activation), bias, **kw)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias, **kw)
        self.activation = activation

    @property
    def fallback_reasons(self) -> list[str]:
        """Why this configuration runs unfused ([] = it runs the fused op)."""
        return ffn_reasons(self)

    def forward(self, x: Tensor) -> Tensor:
        """x (..., d_model) -> (..., d_model)."""
        # Named for the module's caller: the op's own check names w1, which they never passed.
        # Only for a plain Linear: a quantized or wrapped linear1 runs the unfused path.
        linear1 = child(self, "linear1")
        if type(linear1) is nn.Linear:
            width = param(linear1, "weight").shape[-1]
            if x.dim() == 0 or x.shape[-1] != width:
                raise ValueError(
                    f"x must have last dim d_model={width}, got shape {tuple(x.shape)}"
                )
        return feed_forward(self, x)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"
