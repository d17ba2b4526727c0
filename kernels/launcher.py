"""Triton launches that skip Triton's per-call binding when the same launch was seen before.

`fn[grid](*args, **kwargs)` (Triton's `JITFunction.run`) binds every argument, specializes each
(pointer alignment, integer value classes), builds a cache-key string from them, finds the
compiled kernel, then calls its launcher: ~13 us of host time for an attention kernel's ~50
arguments on the CI VM before the launcher runs, and a model's training step makes ~70 such
launches. A short kernel waits for that time; a host-bound step is made of it.

`launch` asks Triton once for each launch key and keeps the compiled kernel it returns; later
launches with that key call the kernel's launcher directly, with the arguments Triton would
pass it. The key holds at least everything Triton specializes on: every pointer's dtype and
address modulo 16, the exact value of every scalar (the integer class only for Triton's
`do_not_specialize` arguments, such as a dropout seed that changes each call) and its type, the
current device, Triton's debug and instrumentation knobs, and the caller's key, which must
determine the keyword arguments (constexprs and compile options). The grid is not compiled in:
each launch passes its own. Launch hooks (profilers such
as proton), pre-run hooks and stage-inspection hooks send every launch through Triton's own path.

The launcher's calling convention is Triton's internal one: direct launches are made only on the
Triton versions whose convention the tests check (tests/test_launcher.py, CI runs 3.6, 3.8, 3.9),
and `FASTFORMER_TRITON_DIRECT_LAUNCH=0` (read when this module is imported) turns them off.
Otherwise, and under TRITON_INTERPRET=1, `launch` is `fn[grid](*args, **kwargs)` (the
interpreter's one launch at a time: it is not thread-safe).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Hashable
from contextlib import nullcontext
from typing import NamedTuple

import torch
import triton
from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.interpreter import InterpretedFunction

_LIMIT = 4096  # launch keys kept; past it the memo starts again (a changing shape each call)
TESTED_TRITON = ("3.6", "3.8", "3.9")  # major.minor versions whose launcher convention tests check
ENABLED = (
    ".".join(triton.__version__.split(".")[:2]) in TESTED_TRITON
    and os.environ.get("FASTFORMER_TRITON_DIRECT_LAUNCH", "1") != "0"
)


class _Memo(NamedTuple):
    kernel: object  # triton.compiler.CompiledKernel
    tail: tuple  # the values Triton binds to the parameters after the positional arguments


class _Signature(NamedTuple):
    arity: int  # positional arguments (calls with another count are not memoized)
    pointers: int  # leading tensor arguments
    classes: tuple[int, ...]  # positions after them keyed by integer class (do_not_specialize)


# The Triton interpreter (TRITON_INTERPRET=1) is not thread-safe: it runs a kernel through one
# process-wide builder and patches triton.language while it runs, so two threads' attention
# calls raised InterpreterError or gave wrong outputs. Its launches are made one at a time.
INTERPRETER_LOCK = threading.Lock()
_MEMO: dict[tuple, _Memo] = {}
# id(fn) -> (fn, its signature or None: its calls are not memoized). The entry keeps fn alive,
# so its id cannot name another kernel (a JITFunction hashes by its source, slowly).
_SIGNATURES: dict[int, tuple[object, _Signature | None]] = {}


def launch(
    fn, grid: tuple[int, ...], args: tuple, key: Hashable, meta: dict, options: dict
) -> None:
    """`fn[grid](*args, **meta, **options)` for a Triton kernel `fn`.

    `key` must determine `meta` and `options` (the caller's constexprs and config): two calls
    with equal keys and different keyword arguments would launch the first one's kernel.
    """
    if not _direct_ok(fn):
        with INTERPRETER_LOCK if isinstance(fn, InterpretedFunction) else nullcontext():
            fn[grid](*args, **meta, **options)
        return
    entry = _SIGNATURES.get(id(fn))
    sig = False if entry is None else entry[1]
    launch_key = None if sig is None or sig is False else _launch_key(fn, sig, args, key)
    memo = _MEMO.get(launch_key) if launch_key is not None else None
    if memo is None:
        kernel = fn.run(*args, grid=grid, warmup=False, **meta, **options)
        _remember(fn, sig, args, key, meta, options, kernel, launch_key)
        return
    kernel = memo.kernel
    stream = driver.active.get_current_stream(launch_key[1])
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    kernel.run(
        grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, None, enter, leave,
        *args, *memo.tail,
    )  # fmt: skip


def status() -> str:
    """Which path attention's launches take in this process, and why (`python -m fastformer
    info`, the bench's manifest)."""
    version = ".".join(triton.__version__.split(".")[:2])
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "the Triton interpreter's (TRITON_INTERPRET=1)"
    if ENABLED:
        return (
            f"direct after a key's first launch (Triton {version}'s launcher convention is tested)"
        )
    if version not in TESTED_TRITON:
        tested = ", ".join(TESTED_TRITON)
        return f"Triton's own: Triton {version} is not among the versions tested ({tested})"
    return "Triton's own: FASTFORMER_TRITON_DIRECT_LAUNCH=0"


def clear() -> None:
    """Forget every memoized launch (tests; a changed Triton cache)."""
    _MEMO.clear()
    _SIGNATURES.clear()


def _direct_ok(fn) -> bool:
    # Anything that watches or alters a launch goes through Triton's own path.
    return (
        ENABLED
        and isinstance(fn, triton.runtime.JITFunction)
        and not fn.pre_run_hooks
        and _no_hook(knobs.runtime.launch_enter_hook)
        and _no_hook(knobs.runtime.launch_exit_hook)
        and getattr(knobs.runtime, "add_stages_inspection_hook", None) is None
    )


def _no_hook(hook) -> bool:
    return hook is None or (isinstance(hook, knobs.HookChain) and not hook.calls)


def _launch_key(fn, sig: _Signature, args: tuple, key: Hashable) -> tuple | None:
    n = sig.pointers
    if len(args) != sig.arity:
        return None
    try:
        pointers = [(a.dtype, a.data_ptr() & 15) for a in args[:n]]
    except AttributeError:  # a pointer argument that is not a tensor this time
        return None
    scalars = list(args[n:])
    for i in sig.classes:
        scalars[i] = _int_class(scalars[i])
    device = driver.active.get_current_device()
    runtime = (knobs.runtime.debug, knobs.compilation.instrumentation_mode)
    # Types too: 1 == 1.0 == True, which Triton specializes three ways.
    return (id(fn), device, key, *pointers, *scalars, *map(type, args[n:]), runtime)


def _int_class(value) -> object:
    # Triton types an unspecialized int by its range: i32, i64 or u64.
    if type(value) is not int:
        return value
    return (int, -(2**31) <= value < 2**31, value >= 2**63)


def _remember(fn, sig, args, key, meta, options, kernel, launch_key) -> None:
    # launch_key: the caller's, None when it could not make one (a kernel's first call).
    if sig is False:
        sig = _signature(fn, args)
        _SIGNATURES[id(fn)] = (fn, sig)
    if sig is None or not isinstance(kernel, triton.compiler.CompiledKernel):
        return  # an argument layout this module does not key, or no kernel was compiled
    if launch_key is None:
        launch_key = _launch_key(fn, sig, args, key)
    if launch_key is None:
        return
    kwargs = {**meta, **options}
    tail = tuple(kwargs.get(p.name, p.default) for p in fn.params[len(args) :])
    if len(_MEMO) >= _LIMIT:
        _MEMO.clear()
    _MEMO[launch_key] = _Memo(kernel, tail)


def _signature(fn, args: tuple) -> _Signature | None:
    n = next((i for i, a in enumerate(args) if not isinstance(a, torch.Tensor)), len(args))
    if any(isinstance(a, torch.Tensor) for a in args[n:]):
        return None  # tensors after scalars: the key would hold (and keep alive) tensors
    params = fn.params[n : len(args)]
    classes = tuple(i for i, p in enumerate(params) if p.do_not_specialize and not p.is_constexpr)
    return _Signature(len(args), n, classes)
