"""Bounds checks of the Triton interpreter's memory accesses: a GPU's out-of-bounds reads found
on a CPU.

On a GPU, a load or store that leaves its tensor reads another allocation's bytes, or faults;
a load whose lanes are later masked out can give right outputs anyway, so parity tests miss it
(a `rows < Lq + 1` load of the LSE passed every interpreter parity test). Under `checked()`,
every load, store and atomic of an interpreted launch (TRITON_INTERPRET=1) must fall, on each
of its unmasked lanes, inside the extent of one of the launch's tensor arguments (the bytes from
its first element to the end of its last: a view's own span, not its storage's); otherwise the
launch raises `OutOfBounds` (wrapped in Triton's InterpreterError) naming the kernel, the
access and the argument it came nearest to.

The unmasked lanes of one access must also all be elements of one and the same argument: an
access that runs on from one argument into the next (two slices of one buffer), or that falls
between a strided argument's elements (q + D of a packed (L, 3, D) qkv reads k[0], inside q's
span), is out of bounds too. This assumes one access comes from one base pointer, as in every
kernel of fastformer; a kernel that loads through `tl.where(c, a_ptr, b_ptr)` would fail it.

Blind spots: an access that lands wholly on another argument's elements passes (the check does
not know which argument a pointer came from); so does one between the elements of an argument
whose layout interleaves or overlaps its dims (`unfold`, `as_strided`), or one whose width
differs from its argument's element size, anywhere inside the argument's extent.

It hooks the interpreter's internals (`GridExecutor`, `InterpreterBuilder`), the same in
Triton 3.6, 3.8 and 3.9; tests/test_interpreter_bounds.py checks that it still catches an access one
element past a tensor.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from triton.runtime import interpreter as _interp

_state = threading.local()  # the running launch's extents; interpreted launches take a lock
_install_lock = threading.Lock()
_installs = 0
_originals: dict[str, tuple[type, object]] = {}


class OutOfBounds(AssertionError):
    """An interpreted kernel's access outside, or not on the elements of, one tensor argument of
    its launch."""


class _Arg:
    """One tensor argument: its byte extent [lo, hi) and where its elements lie in it."""

    def __init__(self, name: str, t: torch.Tensor) -> None:
        self.name, self.t, self.size = name, t, t.element_size()
        self.lo, self.hi = _extent(t)
        self.dims = _nested_dims(t)
        # No gaps between the elements (a contiguous tensor, or one permuted): every aligned
        # byte offset in the extent is an element's.
        self.dense = self.dims is not None and self.hi - self.lo == self.size * math.prod(
            n for n, _ in self.dims
        )

    def strays(self, addrs: np.ndarray, size: int) -> np.ndarray:
        """Byte offsets of the lanes (all inside the extent) that are not at an element."""
        offsets = addrs.astype(np.int64) - self.lo
        if self.dims is None or size != self.size:  # interleaved dims, or a reinterpreting access
            return offsets[:0]
        stray = offsets % self.size != 0
        if self.dense:
            return offsets[stray]
        rest = offsets // self.size
        for n, stride in self.dims:  # largest stride first: a mixed-radix digit each
            digit = rest // stride
            stray |= digit >= n
            rest -= np.minimum(digit, n - 1) * stride
        return offsets[stray | (rest != 0)]

    def describe(self) -> str:
        t = self.t
        return f"argument {self.name!r} {tuple(t.shape)} {t.dtype} stride {t.stride()}"


def _nested_dims(t: torch.Tensor) -> list[tuple[int, int]] | None:
    """(size, stride) of the dims that move, largest stride first, if each stride is at least
    the span of the dims below it (views of a dense tensor by slicing, permuting, expanding: the
    decomposition of an offset into indices is then unique and greedy); None for interleaved or
    overlapping dims (`unfold`, `as_strided`)."""
    dims = sorted(((s, n) for n, s in zip(t.shape, t.stride()) if n > 1 and s > 0), reverse=True)
    span = 1
    for s, n in reversed(dims):
        if s < span:
            return None
        span += (n - 1) * s
    return [(n, s) for s, n in dims]


class _Launch:
    """The tensor arguments of one interpreted launch."""

    def __init__(self, kernel: str, named: list[tuple[str, torch.Tensor]]) -> None:
        self.kernel = kernel
        self.args = [_Arg(name, t) for name, t in named if t.numel() > 0]

    def check(self, ptrs: np.ndarray, mask: np.ndarray, size: int, access: str) -> None:
        # A mask from a scalar condition (`row < n_rows`) arrives as 0/1 integers: as an index
        # array it would pick lanes 0 and 1 over and over.
        mask = np.asarray(mask).astype(bool, copy=False)
        shape = np.broadcast_shapes(ptrs.shape, mask.shape)
        addrs = np.broadcast_to(ptrs, shape)[np.broadcast_to(mask, shape)].astype(np.uint64)
        if addrs.size == 0:
            return
        # One access comes from one base pointer, so its lanes must all be elements of one
        # argument: not run on from one argument into the next (two slices of one buffer), nor
        # fall between a strided argument's elements (q's row stride wrong in a packed qkv).
        first, last = int(addrs.min()), int(addrs.max())
        holders = sorted(
            (a for a in self.args if a.lo <= first and last + size <= a.hi),
            key=lambda a: a.hi - a.lo,
        )
        if not any(a.strays(addrs, size).size == 0 for a in holders):
            raise OutOfBounds(self._violation(addrs, size, access, holders))

    def _violation(self, addrs: np.ndarray, size: int, access: str, holders: list[_Arg]) -> str:
        """What is wrong with an access that no single argument holds as elements."""
        what = f"{self.kernel}: a {size}-byte {access}"
        inside = np.zeros(addrs.shape, dtype=bool)
        for a in self.args:
            inside |= (addrs >= np.uint64(a.lo)) & (addrs + np.uint64(size) <= np.uint64(a.hi))
        if not inside.all():
            bad = addrs[~inside]
            return (
                f"{what} on {bad.size} unmasked lane(s) outside every tensor argument, at "
                f"{self._nearest(int(bad[0]))}"
            )
        if not holders:
            first, last = int(addrs.min()), int(addrs.max())
            return (
                f"{what} whose unmasked lanes span more than one tensor argument: its first "
                f"lane in {self._holder(first)}, its last in {self._holder(last)}"
            )
        strays = holders[0].strays(addrs, size)
        return (
            f"{what} on {strays.size} unmasked lane(s) between the elements of "
            f"{holders[0].describe()}, the lowest {int(strays.min())} bytes into it"
        )

    def _holder(self, addr: int) -> str:
        """The argument whose extent holds a byte (the smallest such one)."""
        a = min((a for a in self.args if a.lo <= addr < a.hi), key=lambda a: a.hi - a.lo)
        return f"{a.describe()}, {addr - a.lo} bytes into it"

    def _nearest(self, addr: int) -> str:
        def distance(a: _Arg) -> int:
            return a.lo - addr if addr < a.lo else addr - a.hi + 1

        if not self.args:
            return f"address {addr:#x} (the launch has no tensor argument with elements)"
        a = min(self.args, key=distance)
        if addr < a.lo:
            where = f"{a.lo - addr} bytes before"
        elif addr < a.hi:  # a wide access that starts inside and ends past the end
            where = f"{a.hi - addr} bytes before the end (straddling it) of"
        else:
            where = f"{addr - a.hi} bytes past the end of"
        return f"{where} {a.describe()}"


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes a tensor's elements span (torch strides are never negative)."""
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _tensors(name: str, arg: object) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(arg, torch.Tensor):
        yield name, arg
    elif isinstance(arg, tuple):
        for i, item in enumerate(arg):
            yield from _tensors(f"{name}[{i}]", item)
    elif isinstance(getattr(arg, "base", None), torch.Tensor):  # TensorDescriptor, TensorWrapper
        yield name, arg.base


def _element_size(handle) -> int:
    return _interp._get_np_dtype(handle.get_element_ty()).itemsize


def _check(ptrs, mask: np.ndarray, access: str) -> None:
    launch = getattr(_state, "launch", None)
    if launch is not None:
        launch.check(ptrs.data, mask, _element_size(ptrs), access)


def _init_args_hst(self, args_dev, kwargs):
    args_hst, kwargs_hst = _originals["_init_args_hst"][1](self, args_dev, kwargs)
    named = [*zip(self.arg_names, args_hst), *kwargs_hst.items()]
    tensors = [pair for name, arg in named for pair in _tensors(name, arg)]
    _state.launch = _Launch(self.fn.__name__, tensors)
    return args_hst, kwargs_hst


def _call(self, *args, **kwargs):
    outer = getattr(_state, "launch", None)  # a launch made by a pre-run hook of another
    try:
        return _originals["__call__"][1](self, *args, **kwargs)
    finally:
        _state.launch = outer


def _masked_load(self, ptrs, mask, *rest, **options):
    _check(ptrs, mask.data, "load")
    return _originals["create_masked_load"][1](self, ptrs, mask, *rest, **options)


def _masked_store(self, ptrs, value, mask, *rest, **options):
    _check(ptrs, mask.data, "store")
    return _originals["create_masked_store"][1](self, ptrs, value, mask, *rest, **options)


def _atomic_rmw(self, op, ptr, val, mask, *rest, **options):
    _check(ptr, mask.data, "atomic")
    return _originals["create_atomic_rmw"][1](self, op, ptr, val, mask, *rest, **options)


def _atomic_cas(self, ptr, cmp, val, *rest, **options):
    _check(ptr, np.ones_like(ptr.data, dtype=bool), "atomic")
    return _originals["create_atomic_cas"][1](self, ptr, cmp, val, *rest, **options)


_HOOKS = {
    "_init_args_hst": (_interp.GridExecutor, _init_args_hst),
    "__call__": (_interp.GridExecutor, _call),
    "create_masked_load": (_interp.InterpreterBuilder, _masked_load),
    "create_masked_store": (_interp.InterpreterBuilder, _masked_store),
    "create_atomic_rmw": (_interp.InterpreterBuilder, _atomic_rmw),
    "create_atomic_cas": (_interp.InterpreterBuilder, _atomic_cas),
}


@contextmanager
def checked() -> Iterator[None]:
    """Bounds-checks every interpreted Triton launch (any thread) while the context is open.

    Nests and may be entered from several threads: the hooks stay until the last exit.
    Launches outside the interpreter are not affected.
    """
    global _installs
    with _install_lock:
        if _installs == 0:
            for name, (cls, hook) in _HOOKS.items():
                _originals[name] = (cls, cls.__dict__[name])
                setattr(cls, name, hook)
        _installs += 1
    try:
        yield
    finally:
        with _install_lock:
            _installs -= 1
            if _installs == 0:
                for name, (cls, original) in _originals.items():
                    setattr(cls, name, original)
