"""What the tests of the ops' C entries pass to see them decline: a tensor subclass, and modes
that pass every call through (they route an op call to the checked Python path)."""

from __future__ import annotations

import torch


class Subclass(torch.Tensor):
    pass


class PassThroughMode(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class PassThroughFunctionMode(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def assert_declined_drawing_nothing(call) -> None:
    """call() (of a C entry) returned None and drew no seed from the CPU generator."""
    state = torch.get_rng_state()
    assert call() is None
    assert torch.equal(torch.get_rng_state(), state)
