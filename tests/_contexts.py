"""Helpers of the tests of the ops' C entries (fastformer._C's *_eager): what they pass to see
an entry decline (a tensor subclass, modes that pass every call through), the checked Python
path to compare with, and the devices their cases run on."""

from __future__ import annotations

import pytest
import torch

from fastformer._ext import extension_error

needs_ext = pytest.mark.skipif(extension_error() is not None, reason="fastformer._C not built")


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


def checked_path(monkeypatch, module, fn, entry: str = "_EAGER"):
    """fn() with `module`'s eager `entry` switched off: the Python path (checks, gates,
    backend)."""
    with monkeypatch.context() as m:
        m.setattr(module, entry, None)
        return fn()


def generator_state(device):
    return torch.get_rng_state() if device == "cpu" else torch.cuda.get_rng_state(device)


def on_devices(cases: dict, dtype_at: int) -> list:
    """(case, device) for each case on the CPU, and as a `cuda` test on CUDA but for float64
    (each spec's item `dtype_at`), which runs on the torch backend there: the entries decline
    it."""
    cuda = [
        pytest.param(case, "cuda", marks=pytest.mark.cuda)
        for case, spec in cases.items()
        if spec[dtype_at] != torch.float64
    ]
    return [*((case, "cpu") for case in cases), *cuda]
