"""`fastformer.swap(model)`: put fastformer modules into an existing model, in place.

Every torch.nn.LayerNorm, RMSNorm, MultiheadAttention, TransformerEncoderLayer,
TransformerDecoderLayer, TransformerEncoder, TransformerDecoder and Transformer (exactly those
classes, not user subclasses) and every fastformer.reference LayerNorm, RMSNorm,
MultiheadAttention, TransformerEncoderLayer and TransformerDecoderLayer becomes its
fastformer.nn counterpart (a reference MultiheadAttention becomes
fastformer.nn.attention.ReferenceMultiheadAttention, which keeps the reference's forward
semantics: need_weights=False by default, is_causal applied together with attn_mask; the
swapped layers pass is_causal on to it). The swap changes the class of the module object
itself (adding the few plain attributes torch.nn has and the reference lacks): the module
objects, their Parameter objects, buffers and hooks stay the same ones, so an optimizer built
before the swap keeps working, and the state_dict keys cannot change (checked; a failed check
undoes the swap).
"""

from __future__ import annotations

import fnmatch
import inspect
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils import parametrize

import fastformer.nn as fnn
from fastformer import reference
from fastformer.nn.attention import ReferenceMultiheadAttention

# torch.nn class -> fastformer subclass: a class change suffices (no new state).
_FROM_TORCH: dict[type, type] = {
    nn.LayerNorm: fnn.LayerNorm,
    nn.RMSNorm: fnn.RMSNorm,
    nn.MultiheadAttention: fnn.MultiheadAttention,
    nn.TransformerEncoderLayer: fnn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer: fnn.TransformerDecoderLayer,
    nn.TransformerEncoder: fnn.TransformerEncoder,
    nn.TransformerDecoder: fnn.TransformerDecoder,
    nn.Transformer: fnn.Transformer,
}


def _norm_args(m: nn.Module) -> dict:
    affine = m.elementwise_affine
    return {
        "normalized_shape": m.normalized_shape,
        "eps": m.eps,
        "elementwise_affine": affine,
        "bias": not affine or m.bias is not None,
    }


def _rms_args(m: nn.Module) -> dict:
    return {
        "normalized_shape": m.normalized_shape,
        "eps": m.eps,
        "elementwise_affine": m.elementwise_affine,
    }


def _mha_args(m: nn.Module) -> dict:
    return {
        "embed_dim": m.embed_dim,
        "num_heads": m.num_heads,
        "dropout": m.dropout,
        "bias": m.in_proj_bias is not None,
        "batch_first": m.batch_first,
    }


def _layer_args(m: nn.Module) -> dict:
    return {
        "d_model": m.self_attn.embed_dim,
        "nhead": m.self_attn.num_heads,
        "dim_feedforward": m.linear2.in_features,
        "dropout": m.dropout.p,
        "activation": m.activation,
        "layer_norm_eps": m.norm1.eps,
        "batch_first": m.self_attn.batch_first,
        "norm_first": m.norm_first,
        "bias": m.linear1.bias is not None,
    }


# reference class -> (fastformer class, its constructor arguments read off the module).
_FROM_REFERENCE: dict[type, tuple[type, Callable[[nn.Module], dict]]] = {
    reference.LayerNorm: (fnn.LayerNorm, _norm_args),
    reference.RMSNorm: (fnn.RMSNorm, _rms_args),
    # Keeps the reference's forward (need_weights=False, is_causal combined with attn_mask).
    reference.MultiheadAttention: (ReferenceMultiheadAttention, _mha_args),
    reference.TransformerEncoderLayer: (fnn.TransformerEncoderLayer, _layer_args),
    reference.TransformerDecoderLayer: (fnn.TransformerDecoderLayer, _layer_args),
}

_FASTFORMER = tuple(set(_FROM_TORCH.values()))
_KINDS = (*_FROM_TORCH, *_FROM_REFERENCE)  # every class swap replaces, as isinstance bases
_MODULE_INTERNALS = frozenset(nn.Module().__dict__)


def _type_name(cls: type) -> str:
    """torch.nn.X / fastformer.nn.X / fastformer.reference.X, else module.qualname."""
    for prefix, namespace in (
        ("torch.nn", nn),
        ("fastformer.nn", fnn),
        ("fastformer.reference", reference),
    ):
        if getattr(namespace, cls.__name__, None) is cls:
            return f"{prefix}.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass
class SwapReport:
    """What `swap` did: `replaced` (qualified name, old type, new type) and `left` (qualified
    name, type, reason) for each module of a swappable kind it did not replace."""

    replaced: list[tuple[str, type, type]] = field(default_factory=list)
    left: list[tuple[str, type, str]] = field(default_factory=list)

    def __str__(self) -> str:
        rows = [("module", "was", "now")]
        rows += [(n or "(root)", _type_name(a), _type_name(b)) for n, a, b in self.replaced]
        lines = [f"fastformer.swap: replaced {len(self.replaced)}, left {len(self.left)}"]
        lines += _table(rows) if self.replaced else []
        if self.left:
            left = [("left", "type", "reason")]
            left += [(n or "(root)", _type_name(t), why) for n, t, why in self.left]
            lines += _table(left)
        return "\n".join(lines)


def _table(rows: list[tuple[str, str, str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    return [f"  {a:<{widths[0]}}  {b:<{widths[1]}}  {c}" for a, b, c in rows]


def _matches(item: type | str, name: str, module: nn.Module) -> bool:
    """A class matches modules of exactly that class (nn.LayerNorm, not the reference's
    LayerNorm); a string matches the class name ("LayerNorm": either) or the qualified name as
    an fnmatch pattern ("decoder.*", "encoder.layers.0.self_attn")."""
    if isinstance(item, type):
        return type(module) is item
    return item == type(module).__name__ or fnmatch.fnmatchcase(name, item)


def _selection(arg: str, items: Iterable[type | str] | None) -> list[type | str] | None:
    """`include` / `exclude` as a list, each item a class or a str."""
    if items is None:
        return None
    if isinstance(items, (str, type)):  # a str iterates as its letters: nothing matched
        raise TypeError(f"{arg} must be a list of classes or names, got {items!r}: [{items!r}]?")
    items = list(items)
    for item in items:
        if not isinstance(item, (type, str)):
            raise TypeError(f"{arg} items must be classes or names, got {type(item).__name__}")
    return items


def _skip_reason(name, module, include, exclude) -> str | None:
    if include is not None and not any(_matches(i, name, module) for i in include):
        return "not selected by include"
    if exclude is not None and any(_matches(e, name, module) for e in exclude):
        return "excluded by exclude"
    return None


def _subclass_reason(module: nn.Module) -> str | None:
    """Why a user subclass of a swappable class is left alone (None if it is not one)."""
    if isinstance(module, _KINDS) and parametrize.is_parametrized(module):
        return (
            "parametrized (torch.nn.utils.parametrize subclasses it): swap before "
            "registering the parametrization"
        )
    for base in _KINDS:
        if isinstance(module, base):
            return (
                f"subclass of {_type_name(base)}: its own methods are kept (use the "
                "fastformer.nn classes in its definition instead)"
            )
    return None


class _Journal:
    """Undo log of the in-place changes, so a failed check leaves the model as it was."""

    def __init__(self) -> None:
        self.steps: list[Callable[[], None]] = []

    def set_class(self, module: nn.Module, cls: type) -> None:
        old = type(module)
        module.__class__ = cls
        self.steps.append(lambda: setattr(module, "__class__", old))

    def add(self, mapping: dict, key: str, value) -> None:
        mapping[key] = value
        self.steps.append(lambda: mapping.pop(key))

    def undo(self) -> None:
        for step in reversed(self.steps):
            step()
        self.steps.clear()


def _names(mapping: dict) -> set[str]:
    return {k for k, v in mapping.items() if v is not None}


def _convert_reference(module: nn.Module, journal: _Journal) -> str | None:
    """Turn a reference module into its fastformer class in place; a reason if it cannot."""
    cls, args = _FROM_REFERENCE[type(module)]
    with torch.device("meta"):  # a template for the attribute names and values, no memory
        template = cls(**args(module))
    for what in ("_parameters", "_buffers", "_modules"):
        mine, theirs = _names(getattr(module, what)), _names(getattr(template, what))
        if mine != theirs:
            return f"{what[1:]} {sorted(mine)} differ from {_type_name(cls)}'s {sorted(theirs)}"
    for key, value in template.__dict__.items():
        if key not in _MODULE_INTERNALS and key not in module.__dict__:
            journal.add(module.__dict__, key, value)
    for key in template._parameters.keys() - module._parameters.keys():
        journal.add(module._parameters, key, None)  # e.g. MHA's unused q_proj_weight slot
    journal.set_class(module, cls)
    return None


def _override_reason(module: nn.Module) -> str | None:
    """Why a module with instance attributes over its class's methods (a patched _sa_block or
    _ff_block) is left alone: the fastformer forward does not call torch.nn's helper methods."""
    names = sorted(k for k in module.__dict__ if inspect.isfunction(getattr(type(module), k, None)))
    if not names:
        return None
    return f"instance attributes {names} replace methods the fastformer forward does not call"


def _swap_one(module: nn.Module, journal: _Journal) -> tuple[type | None, str | None]:
    """(new class, None) if replaced, (None, reason) if left, (None, None) if not a kind."""
    kind = type(module)
    if kind in _FROM_TORCH:
        reason = _override_reason(module)
        if reason is not None:
            return None, reason
        journal.set_class(module, _FROM_TORCH[kind])
        return _FROM_TORCH[kind], None
    if kind in _FROM_REFERENCE:
        reason = _convert_reference(module, journal)
        return (None, reason) if reason else (type(module), None)
    if isinstance(module, _FASTFORMER):
        return None, None
    if isinstance(module, torch.jit.ScriptModule):
        return None, _script_reason(module)
    return None, _subclass_reason(module)


_SWAPPABLE_NAMES = {cls.__name__ for cls in _KINDS}


def _script_reason(module: torch.jit.ScriptModule) -> str | None:
    """Why a scripted or traced module of a swappable kind is left (None if not such a kind)."""
    if getattr(module, "original_name", None) not in _SWAPPABLE_NAMES:
        return None
    return (
        "TorchScript (scripted or traced): its compiled code is kept; swap the eager module "
        "before tracing it (fastformer modules do not script)"
    )


def _warn_unmatched(arg: str, items: list | None, modules: list[tuple[str, nn.Module]]) -> None:
    """A name or class that selects nothing is most likely a typo (the report would only show
    every module as "not selected by include")."""
    for item in items or ():
        if not any(_matches(item, name, module) for name, module in modules):
            shown = _type_name(item) if isinstance(item, type) else repr(item)
            warnings.warn(
                f"fastformer.swap: {arg} item {shown} matches none of the model's modules of "
                "a swappable kind (items match a module's exact class, its class name, or its "
                "qualified name as an fnmatch pattern)",
                stacklevel=3,
            )


def _check_unchanged(model: nn.Module, keys: list[str], params: list[int]) -> None:
    after = list(model.state_dict().keys())
    if after != keys:
        missing, extra = sorted(set(keys) - set(after)), sorted(set(after) - set(keys))
        raise RuntimeError(
            f"swap changed the state_dict keys (missing {missing}, new {extra}); undone"
        )
    if [id(p) for p in model.parameters()] != params:
        raise RuntimeError("swap changed the model's Parameter objects; undone")


def swap(
    model: nn.Module,
    include: Iterable[type | str] | None = None,
    exclude: Iterable[type | str] | None = None,
) -> SwapReport:
    """Replace the swappable modules of `model` by fastformer.nn ones, in place.

    Args:
        model: any nn.Module (the root itself may be swappable).
        include: only replace modules whose class (exactly: nn.LayerNorm is not the
            reference's LayerNorm), class name (e.g. "LayerNorm": both) or qualified name
            (fnmatch pattern) matches an item; None = every swappable module.
        exclude: leave modules matching an item (same matching) as they are.

    Returns:
        A SwapReport; `print(report)` shows a table. The module objects and their Parameter
        objects are unchanged (`p is q`), and so are the state_dict keys (RuntimeError, with
        the model restored, otherwise). A module's class changes: a swapped torch.nn module
        is still an instance of its torch.nn class; a swapped `fastformer.reference` one is no
        longer an instance of its reference class and becomes one of the torch.nn class (an
        `isinstance` filter, say norms left out of weight decay, can change its verdict
        across a swap: build such lists after it).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError(
            "model is a TorchScript module (torch.jit.script / trace): its compiled code "
            "cannot be swapped; call fastformer.swap on the eager model (and use torch.compile "
            "or torch.export rather than TorchScript: the fastformer modules do not script)"
        )
    include, exclude = _selection("include", include), _selection("exclude", exclude)
    keys = list(model.state_dict().keys())
    params = [id(p) for p in model.parameters()]
    report, journal = SwapReport(), _Journal()
    modules = list(model.named_modules(remove_duplicate=True))
    # Swapped ones and subclasses too: a second swap, or an exclude naming a subclass, selects.
    kinds = [(name, m) for name, m in modules if isinstance(m, _KINDS)]
    _warn_unmatched("include", include, kinds)
    _warn_unmatched("exclude", exclude, kinds)
    for name, module in modules:
        old = type(module)
        swappable = old in _FROM_TORCH or old in _FROM_REFERENCE
        skip = _skip_reason(name, module, include, exclude) if swappable else None
        if skip is not None:
            report.left.append((name, old, skip))
            continue
        new, reason = _swap_one(module, journal)
        if new is not None:
            report.replaced.append((name, old, new))
        elif reason is not None:
            report.left.append((name, old, reason))
    try:
        _check_unchanged(model, keys, params)
    except RuntimeError:
        journal.undo()
        raise
    return report
