"""Parity helpers shared by tests/, `python -m fastformer check` and the benchmarks; and
`sm90_jit`, Triton's JIT compiling for sm_90 without a GPU (tests, host-time measurements).

The parity rule (from flash-attention's tests): with `ref64` the eager reference in float64 and
`ref_lp` the reference run in the input dtype,

    max|fast - ref64| <= 2 * max|ref_lp - ref64| + atol_floor

for every output and every gradient. The fast kernel may be as wrong as the reference is in
low precision, twice over, but no more. The floor is per dtype and scales with the magnitude of
the result when that exceeds 1 (`floor * max(1, max|ref64|)`): on a handful of large values the
low-precision reference can be right by luck, and one rounding step of the input dtype is the
least any fast kernel may differ by.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

ATOL_FLOOR = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.float16: 1e-3,
    torch.bfloat16: 1e-2,
}


@dataclass(frozen=True)
class ParityResult:
    """One compared tensor: the fast error against float64 and the bound it must stay under."""

    name: str
    error: float
    bound: float

    @property
    def passed(self) -> bool:
        return math.isfinite(self.error) and self.error <= self.bound

    def __str__(self) -> str:
        verdict = "pass" if self.passed else "FAIL"
        return f"{self.name}: error {self.error:.3e} bound {self.bound:.3e} {verdict}"


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| in float64; inf when either holds a NaN (a NaN is never a match, even where
    both have one); 0 where both hold the same infinity."""
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {tuple(a.shape)} vs {tuple(b.shape)}")
    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    if a64.numel() == 0:
        return 0.0
    nan_a, nan_b = torch.isnan(a64), torch.isnan(b64)
    if not torch.equal(nan_a, nan_b) or nan_a.any():
        return math.inf
    both_inf = torch.isinf(a64) & (a64 == b64)
    diff = torch.where(both_inf, torch.zeros_like(a64), (a64 - b64).abs())
    return float(diff.max())


def parity(
    name: str,
    fast: torch.Tensor,
    ref64: torch.Tensor,
    ref_lp: torch.Tensor,
    atol_floor: float | None = None,
    relative_floor: bool = False,
) -> ParityResult:
    """Apply the parity rule to one tensor; `atol_floor` defaults by the dtype of `ref_lp`.
    The floor scales with the largest |ref64| above 1, and with `relative_floor` below 1 too
    (for tensors whose other sources of error are bounded apart). Bool and integer tensors
    (masks, indices) must be equal to `ref_lp`."""
    if not ref_lp.is_floating_point():
        same = fast.shape == ref_lp.shape and torch.equal(fast.cpu(), ref_lp.cpu())
        return ParityResult(name, 0.0 if same else math.inf, 0.0)
    floor = ATOL_FLOOR.get(ref_lp.dtype, 1e-5) if atol_floor is None else atol_floor
    magnitude = float(ref64.detach().abs().max()) if ref64.numel() else 0.0
    if math.isfinite(magnitude):
        floor *= magnitude if relative_floor else max(1.0, magnitude)
    lp_error = max_abs_diff(ref_lp, ref64)
    # A reference that overflowed (inf or NaN where float64 is finite) sets no bound: an
    # infinite one would pass anything; the floor alone is left.
    bound = (2 * lp_error if math.isfinite(lp_error) else 0.0) + floor
    return ParityResult(name, max_abs_diff(fast, ref64), bound)


def assert_parity(results: Sequence[ParityResult]) -> None:
    """Raise AssertionError listing every failed comparison (or that there was none: a
    comparison of nothing proves nothing)."""
    if not results:
        raise AssertionError("parity failed: nothing was compared")
    failed = [str(r) for r in results if not r.passed]
    if failed:
        raise AssertionError("parity failed:\n  " + "\n  ".join(failed))


def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _cast_like(x: Any, dtype: torch.dtype | None) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    y = x.detach()
    if dtype is not None and y.is_floating_point():
        y = y.to(dtype)
    else:
        y = y.clone()
    return y.requires_grad_(x.requires_grad)


def _run(fn: Callable, inputs: Sequence[Any], cotangents: list[torch.Tensor] | None):
    diff = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    outs = [o for o in _as_tuple(fn(*inputs)) if isinstance(o, torch.Tensor)]
    if cotangents is None:
        gen = torch.Generator().manual_seed(1234)
        cotangents = [
            torch.randn(o.shape, generator=gen, dtype=torch.float64, device="cpu") for o in outs
        ]
    if not diff:
        return outs, [], cotangents
    pairs = [(o, c) for o, c in zip(outs, cotangents) if o.requires_grad]
    grads = torch.autograd.grad(
        [o for o, _ in pairs],
        diff,
        [c.to(o.dtype).to(o.device) for o, c in pairs],
        allow_unused=True,
    )
    grads = [torch.zeros_like(x) if g is None else g for x, g in zip(diff, grads)]
    return outs, grads, cotangents


def _grad_labels(inputs: Sequence[Any], names: Sequence[str] | None) -> list[str]:
    """The label of each differentiable input's gradient (compare_with_reference's `names`)."""
    wanted = [isinstance(x, torch.Tensor) and x.requires_grad for x in inputs]
    if names is None:
        return [f"grad[{i}]" for i in range(sum(wanted))]
    if len(names) == sum(wanted):
        return list(names)
    if len(names) == len(inputs):
        return [name for name, w in zip(names, wanted) if w]
    # zip with fewer labels than gradients would leave gradients unchecked
    raise ValueError(
        f"names: {len(names)} given for {len(inputs)} inputs, {sum(wanted)} of which require "
        "grad; expected a name for each input or for each that requires grad"
    )


def _same(x: torch.Tensor, b: torch.Tensor) -> bool:
    """x equals its snapshot b, NaN where b has NaN (a NaN or inf overwritten is a change)."""
    x = x.detach()
    if torch.equal(x, b):
        return True
    return bool(((x == b) | (x.isnan() & b.isnan())).all()) if x.is_floating_point() else False


def _modified_inputs(inputs: Sequence[Any], before: list[torch.Tensor | None]):
    """A failed result for each tensor input `fast_fn` changed in place (the reference would
    then run on other values, and the caller's tensor is corrupted)."""
    changed = [
        i for i, (x, b) in enumerate(zip(inputs, before)) if b is not None and not _same(x, b)
    ]
    return [ParityResult(f"input[{i}] modified in place", math.inf, 0.0) for i in changed]


def compare_with_reference(
    fast_fn: Callable,
    ref_fn: Callable,
    inputs: Sequence[Any],
    *,
    names: Sequence[str] | None = None,
    atol_floor: float | None = None,
    ref_device: torch.device | str | None = None,
) -> list[ParityResult]:
    """Parity of `fast_fn(*inputs)` with `ref_fn` for every output and every input gradient.

    Tensors in `inputs` that require grad get their gradients compared (non-leaf views such as
    a transposed tensor are fine, but not together with their base; a tensor passed twice
    stays one tensor for the reference).
    Floating inputs are cast to float64 for `ref64`; `ref_lp` runs the reference on the inputs
    as given. Outputs must also have `ref_lp`'s dtype, and `fast_fn` must leave its inputs as
    they were. The cotangents are fixed (seeded normal draws). `names` labels the
    differentiable inputs: one name each, or one for every input (those of inputs that need no
    gradient, a None weight say, are left out); `ref_device` runs the reference there
    (say "cpu" for a GPU op). Returns one ParityResult per output and gradient, and a failed
    one per input changed in place, per output of another dtype and per missing output or
    gradient, for `assert_parity`.
    """
    labels = _grad_labels(inputs, names)
    before = [x.detach().clone() if isinstance(x, torch.Tensor) else None for x in inputs]
    fast_outs, fast_grads, cot = _run(fast_fn, inputs, None)
    results = _modified_inputs(inputs, before)

    def on_ref_device(dtype: torch.dtype | None) -> list[Any]:
        converted: dict[int, Any] = {}  # by identity: the same tensor twice stays one
        for x in inputs:
            if id(x) not in converted:
                y = _cast_like(x, dtype)
                if ref_device is not None and isinstance(y, torch.Tensor):
                    y = y.detach().to(ref_device).requires_grad_(x.requires_grad)
                converted[id(x)] = y
        return [converted[id(x)] for x in inputs]

    outs64, grads64, _ = _run(ref_fn, on_ref_device(torch.float64), cot)
    outs_lp, grads_lp, _ = _run(ref_fn, on_ref_device(None), cot)
    results += [
        ParityResult(f"out[{i}] dtype {f.dtype} vs {lp.dtype}", math.inf, 0.0)
        for i, (f, lp) in enumerate(zip(fast_outs, outs_lp))
        if f.dtype != lp.dtype
    ]
    results += [
        parity(f"out[{i}]" if len(fast_outs) > 1 else "out", f, r, lp, atol_floor)
        for i, (f, r, lp) in enumerate(zip(fast_outs, outs64, outs_lp))
    ]
    results += [
        parity(f"d{label}", f, r, lp, atol_floor)
        for label, f, r, lp in zip(labels, fast_grads, grads64, grads_lp)
    ]
    # zip stops at the shorter: an output or gradient the fast op left out would go unchecked
    for what, fast, ref in (("outputs", fast_outs, outs64), ("gradients", fast_grads, grads64)):
        if len(fast) != len(ref):
            results.append(ParityResult(f"{what}: {len(fast)} vs {len(ref)}", math.inf, 0.0))
    return results


def dropout_sites_one_at_a_time(*layers: torch.nn.Module) -> Iterator[str]:
    """Puts `layers` (the same architecture, e.g. a torch.nn Transformer layer and its
    fastformer twin) in train mode with exactly one dropout site at p=1 and the others at 0, for
    each site of the first layer in turn, and yields the site's name. A site is an `nn.Dropout`
    child or an `nn.MultiheadAttention` child (its attention-weight dropout). With one site
    dropping everything, layers that drop in different places give different outputs."""
    kinds = (torch.nn.Dropout, torch.nn.MultiheadAttention)
    names = [n for n, m in layers[0].named_children() if isinstance(m, kinds)]
    for name in names:
        for layer in layers:
            layer.train()
            for n in names:
                child, p = getattr(layer, n), 1.0 if n == name else 0.0
                if isinstance(child, torch.nn.Dropout):
                    child.p = p
                else:
                    child.dropout = p
        yield name


def sm90_jit(launcher_for: Callable[[Any], Callable] | None = None, stream: int = 0) -> None:
    """Make Triton's JIT compile for sm_90 in this process without a GPU (device 0, `stream`
    the current stream's handle).

    For tests and host-time measurements: Triton binds, specializes, compiles (ptxas included)
    and finds kernels as on an H100/H200. Nothing can run on a device, so a compiled kernel's
    launcher is `launcher_for(kernel)` when given (a recorder, a counter); without it, loading
    a kernel (a launch) fails. Call before the first compile; it lasts for the process.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compiler
    from triton.runtime.driver import driver

    class Sm90:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return stream

    driver.set_active(Sm90())
    if launcher_for is None:
        return

    def load(kernel) -> None:  # CompiledKernel._init_handles: no module to load
        if kernel.module is None:
            kernel.module, kernel.function, kernel._run = 0, id(kernel), launcher_for(kernel)

    compiler.CompiledKernel._init_handles = load
