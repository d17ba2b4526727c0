"""A module's registered children and parameters, read without `nn.Module.__getattr__`.

`layer.linear1` or `linear.weight` finds a child module or a parameter through
`nn.Module.__getattr__`, a Python method (~0.45 us a lookup on the CI VM), and a fused layer
makes ~20 of them a call: host time that a host-bound step on a GPU pays. These read the
registries themselves (~0.05 us) and fall back to `getattr` for a name that is not registered
there (an attribute set in place of a parameter, say), so they return what the attribute does.
"""

from __future__ import annotations

from typing import Any

from torch import nn

_MISSING = object()


def child(module: nn.Module, name: str) -> Any:
    """`module.<name>` for a child module (or None registered in its place)."""
    found = module._modules.get(name, _MISSING)
    return getattr(module, name) if found is _MISSING else found


def param(module: nn.Module, name: str) -> Any:
    """`module.<name>` for a parameter (or None registered in its place)."""
    found = module._parameters.get(name, _MISSING)
    return getattr(module, name) if found is _MISSING else found
