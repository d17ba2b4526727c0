"""Tests of fastformer.ops.layer_norm: the C++/CUDA LayerNorm, RMSNorm and fused dropout +
residual-add + LayerNorm, against the eager reference with the parity rule (DESIGN.md).

On a CPU-only machine these run the C++ CPU kernels (the `cpp` backend); the `cuda`-marked tests
run the CUDA kernels on a GPU machine. Dropout is checked against the reference fed with the
keep-mask regenerated from the seed the op drew (`torch.manual_seed` predicts it).
"""

import itertools
import math
import re
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from _contexts import (
    PassThroughFunctionMode,
    PassThroughMode,
    Subclass,
    assert_declined_drawing_nothing,
    checked_path,
    generator_state,
    needs_ext,
    on_devices,
)

from fastformer import reference as ref
from fastformer._ext import extension_error
from fastformer.ops import _dispatch, rng
from fastformer.ops import layer_norm as ln
from fastformer.testing import ATOL_FLOOR, assert_parity, compare_with_reference, parity

CUDA = "cuda"
STREAM_ENV = "FASTFORMER_LN_STREAM"


@pytest.fixture(autouse=True)
def _default_backend(monkeypatch):
    # A developer's FASTFORMER_BACKEND_LAYER_NORM or FASTFORMER_LN_STREAM must not change what
    # these tests check.
    monkeypatch.delenv("FASTFORMER_BACKEND_LAYER_NORM", raising=False)
    monkeypatch.delenv(STREAM_ENV, raising=False)


def _make(shape, dtype=torch.float32, seed=0, device="cpu", scale=1.0, shift=0.0, grad=True):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=torch.float32) * scale + shift
    return t.to(device=device, dtype=dtype).requires_grad_(grad)


def _params(n, affine, dtype=torch.float32, seed=1, device="cpu"):
    """(weight, bias) for `affine` in {"both", "weight", "bias", "none"}."""
    w = _make((n,), dtype, seed, device) if affine in ("both", "weight") else None
    b = _make((n,), dtype, seed + 1, device) if affine in ("both", "bias") else None
    return w, b


def _floor(dtype):
    # The output is in the input dtype even when the parameters are fp32.
    return ATOL_FLOOR[dtype]


def _assert_runs_cpp(x):
    if extension_error() is None and x.device.type == "cpu":
        assert _dispatch.select(ln.OP, x) == "cpp"


def _ln_parity(x, shape, w, b, eps=1e-5):
    _assert_runs_cpp(x)
    results = compare_with_reference(
        lambda x, w, b: ln.layer_norm(x, shape, w, b, eps),
        lambda x, w, b: ref.layer_norm(x, shape, w, b, eps).to(x.dtype),
        [x, w, b],
        names=["x", "weight", "bias"],
        atol_floor=_floor(x.dtype),
    )
    assert_parity(results)


# --------------------------------------------------------------------------- layer_norm parity

HIDDEN = (1, 7, 64, 1023, 4096, 65536)
ROWS = (1, 3, 1000)
GRID = [(r, h) for h in HIDDEN for r in ROWS if r * h <= 4096 * 1000]


@pytest.mark.parametrize(("rows", "hidden"), GRID)
def test_layer_norm_parity_fp32(rows, hidden):
    x = _make((rows, hidden), scale=2.0, shift=3.0)  # an offset mean tests the centring
    w, b = _params(hidden, "both")
    _ln_parity(x, hidden, w, b)


@pytest.mark.parametrize("affine", ["none", "weight", "bias"])
@pytest.mark.parametrize(("rows", "hidden"), [(3, 7), (64, 1023), (5, 4096)])
def test_layer_norm_affine_variants(rows, hidden, affine):
    x = _make((rows, hidden))
    w, b = _params(hidden, affine)
    _ln_parity(x, hidden, w, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("wdtype", ["fp32", "same"])
@pytest.mark.parametrize(("rows", "hidden"), [(3, 7), (1000, 1024), (2, 4099)])
def test_layer_norm_low_precision(dtype, wdtype, rows, hidden):
    x = _make((rows, hidden), dtype, scale=2.0, shift=1.0)
    w, b = _params(hidden, "both", torch.float32 if wdtype == "fp32" else dtype)
    out = ln.layer_norm(x, hidden, w, b)
    assert out.dtype == dtype
    _ln_parity(x, hidden, w, b)


def test_layer_norm_noncontiguous_and_multidim():
    base = _make((64, 2, 50), grad=False)
    x = base.permute(2, 1, 0).requires_grad_()  # (50, 2, 64), last dim strided
    assert not x.is_contiguous()
    w, b = _params(64, "both")
    _ln_parity(x, 64, w, b)
    x = _make((3, 5, 4, 16))
    w, b = _make((4, 16), seed=5), _make((4, 16), seed=6)
    _ln_parity(x, (4, 16), w, b)
    _ln_parity(_make((16,)), 16, *_params(16, "both"))  # one row: the kernels take (..., cols)


@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8)])
def test_empty_batch(shape):
    x = _make(shape)
    w, b = _params(8, "both")
    out = ln.layer_norm(x, 8, w, b)
    assert out.shape == shape
    out.sum().backward()
    assert torch.equal(w.grad, torch.zeros(8)) and torch.equal(b.grad, torch.zeros(8))


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("shape", [(3, 0), (2, 3, 0)])
def test_rows_without_columns(shape, rms):
    # torch.nn.LayerNorm(0) / RMSNorm(0) return the empty rows, and empty gradients.
    x = _make(shape)
    w, b = _params(0, "both")
    out = ln.rms_norm(x, 0, w) if rms else ln.layer_norm(x, 0, w, b)
    assert out.shape == shape and out.dtype == x.dtype
    out.sum().backward()
    assert x.grad.shape == shape and w.grad.shape == (0,)


@pytest.mark.parametrize("prenorm", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.5])
def test_dropout_add_layer_norm_rows_without_columns(p, prenorm):
    # As LayerNorm(0): it refused them ("a non-empty last dim").
    x, res = _make((2, 3, 0)), _make((2, 3, 0), seed=1)
    w, b = _params(0, "both")
    out = ln.dropout_add_layer_norm(x, res, w, b, 1e-5, p, prenorm)
    outs = out if prenorm else (out,)
    assert all(o.shape == (2, 3, 0) and o.dtype == x.dtype for o in outs)
    sum(o.sum() for o in outs).backward()
    assert x.grad.shape == res.grad.shape == (2, 3, 0) and b.grad.shape == (0,)


def test_layer_norm_matches_torch_and_eps():
    x = _make((10, 33), grad=False) * 1e-3  # tiny variance: eps matters
    w, b = _params(33, "both")
    for eps in (1e-5, 1e-2):
        expected = torch.nn.functional.layer_norm(x, (33,), w, b, eps)
        torch.testing.assert_close(ln.layer_norm(x, 33, w, b, eps), expected)
        with torch.no_grad():  # the path without autograd
            torch.testing.assert_close(ln.layer_norm(x, 33, w, b, eps), expected)


@pytest.mark.parametrize(
    ("dtype", "rows", "hidden", "shift"),
    [
        (torch.float32, 2, 100003, 1e6),
        (torch.float32, 3, 65536, 1e3),
        (torch.bfloat16, 2, 65536, 64.0),
    ],
)
def test_layer_norm_long_rows_with_a_large_offset(dtype, rows, hidden, shift):
    # The row mean sums x - x[0]: a plain fp32 sum of the 100003 columns at offset 1e6 was off
    # by ~20 and the output by up to 10, where the reference's error is 0.02.
    x = _make((rows, hidden), dtype, shift=shift)
    _ln_parity(x, hidden, *_params(hidden, "both"))


def _plain_or_fused(fused, hidden):
    """layer_norm, or LayerNorm(x + 0) through the fused op's backward."""

    def fast(x, w, b):
        if fused:
            return ln.dropout_add_layer_norm(x, torch.zeros_like(x), w, b)
        return ln.layer_norm(x, hidden, w, b)

    return fast


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("hidden", [16384, 65536])
def test_layer_norm_rows_whose_head_is_far_from_their_mean(fused, hidden):
    # The CPU forward's one pass sums d = x - shift and d * d, shift the mean of a row's first
    # 32 columns. Here those are at 1e4 and the rest N(0, 1): mean(d * d) - mean(d)^2 would
    # keep 13 to 15 of float32's 24 bits, so such rows must take the passes of the mean first.
    x = _make((3, hidden), grad=False)
    x[:, :32] += 1e4
    x.requires_grad_()
    results = compare_with_reference(
        _plain_or_fused(fused, hidden),
        lambda x, w, b: ref.layer_norm(x, hidden, w, b),
        [x, *_params(hidden, "both")],
        names="xwb",
    )
    assert_parity(results)


@pytest.mark.parametrize(("hidden", "shift"), [(4, 1e4), (8, 1e5), (8, 1e6)])
@pytest.mark.parametrize("fused", [False, True])
def test_layer_norm_gradients_of_rows_whose_mean_dwarfs_their_spread(fused, hidden, shift):
    # The saved fp32 mean is off by up to half an ulp of the offset (5e-4 at 1e4), the same for
    # every xhat of a row; the backward must take that out as the mean's derivative does. Before
    # it did, dx missed the parity bound in 15% of these draws at 1e4 (by up to 4x), dweight in
    # 3% (2.3x). Small calls, many draws: each call's bound is its own reference's error.
    fast = _plain_or_fused(fused, hidden)
    failed = []
    for seed in range(60):
        x = _make((8, hidden), seed=seed, shift=shift)
        w, b = _params(hidden, "both", seed=seed + 1000)
        results = compare_with_reference(
            fast, lambda x, w, b: ref.layer_norm(x, hidden, w, b), [x, w, b], names="xwb"
        )
        failed += [f"seed {seed}: {r}" for r in results if not r.passed]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [7, 1000, 4096])
def test_layer_norm_of_constant_rows_is_the_bias(dtype, hidden):
    # x - mean must be exactly 0: with eps = 1e-12 an ulp of error in the mean is multiplied by
    # 1e6 (the output was O(1) where it is the bias).
    x = torch.tensor([7.3, -1e3, 0.1, 3e4], dtype=dtype)[:, None].expand(4, hidden).contiguous()
    w, b = _params(hidden, "both", dtype)
    expected = b.detach().expand(4, hidden)
    assert torch.equal(ln.layer_norm(x, hidden, w, b, 1e-12).detach(), expected)
    out, pre = ln.dropout_add_layer_norm(x, torch.zeros_like(x), w, b, 1e-12, prenorm=True)
    assert torch.equal(out.detach(), expected) and torch.equal(pre, x)


@pytest.mark.parametrize("value", [-2e37, 1e36])
def test_layer_norm_of_constant_rows_whose_sum_overflows_is_the_bias(value):
    # 1000 x 1e36 overflows the plain sum (mean and variance inf): the shifted sum is exact
    # (the output was NaN, where torch and the CUDA kernels give the bias).
    x = torch.full((3, 1000), value)
    w, b = _params(1000, "both")
    assert torch.equal(ln.layer_norm(x, 1000, w, b).detach(), b.detach().expand(3, 1000))


def _relative_error(fast: torch.Tensor, ref64: torch.Tensor) -> float:
    return float((fast.detach().double() - ref64.detach()).abs().max() / ref64.detach().abs().max())


@pytest.mark.parametrize(
    ("norm", "scale"), [("layer_norm", 1e30), ("layer_norm", 5e37), ("rms_norm", 1e25)]
)
def test_norms_of_rows_whose_squares_overflow(norm, scale):
    # (x - mean)^2 overflows float32 (and at 5e37 the sum of x does too): the statistics are
    # then taken on x scaled by a power of two. Unscaled, rstd was 0 and the output silently the
    # bias (torch's own float32 LayerNorm gives NaN); the float64 reference is finite.
    x = _make((3, 4096), scale=scale)
    w, b = _params(4096, "both")
    fast = ln.layer_norm if norm == "layer_norm" else ln.rms_norm
    reference = ref.layer_norm if norm == "layer_norm" else ref.rms_norm
    extra = (b,) if norm == "layer_norm" else ()
    dy = _make((3, 4096), seed=9, grad=False)
    out = fast(x, 4096, w, *extra, 1e-5)
    out64 = reference(x.double(), 4096, w.double(), *(t.double() for t in extra), 1e-5)
    grads = torch.autograd.grad(out, (x, w, *extra), dy)
    grads64 = torch.autograd.grad(out64, (x, w, *extra), dy.double())
    for got, want in zip((out, *grads), (out64, *grads64)):
        assert _relative_error(got, want) < 1e-5


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize(("hidden", "scale"), [(2**18, 1e-3), (2**20, 1.0)])
def test_norms_of_very_long_float32_rows(norm, hidden, scale):
    # A row past 2048 columns is summed in blocks added pairwise: with one pass of accumulators
    # (each summing hidden / 32 terms) a float32 RMSNorm of 2**18 columns at 1000 + N(0, 1e-3)
    # had 219x the error of torch's, and both norms ~12x at 2**20 columns of N(0, 1).
    x = _make((2, hidden), scale=scale, shift=1000.0 if scale < 1 else 0.0)
    w, b = _params(hidden, "both")
    _assert_runs_cpp(x)
    fast = ln.layer_norm if norm == "layer_norm" else ln.rms_norm
    reference = ref.layer_norm if norm == "layer_norm" else ref.rms_norm
    params = [w, b] if norm == "layer_norm" else [w]
    results = compare_with_reference(
        lambda x, *p: fast(x, hidden, *p, 1e-5),
        lambda x, *p: reference(x, hidden, *p, 1e-5).to(x.dtype),
        [x, *params],
        names=["x", "weight", "bias"][: 1 + len(params)],
    )
    assert_parity(results)


# --------------------------------------------------------------------------- rms_norm


@pytest.mark.parametrize(("rows", "hidden"), [(1, 1), (3, 7), (1000, 64), (3, 1023), (7, 4096)])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_parity(rows, hidden, weighted):
    x = _make((rows, hidden), shift=0.5)
    w = _make((hidden,), seed=3) if weighted else None
    _assert_runs_cpp(x)
    results = compare_with_reference(
        lambda x, w: ln.rms_norm(x, hidden, w, 1e-6),
        lambda x, w: ref.rms_norm(x, hidden, w, 1e-6).to(x.dtype),
        [x, w],
        names=["x", "weight"],
    )
    assert_parity(results)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_low_precision_default_eps(dtype):
    x = _make((100, 512), dtype)
    w = _make((512,), seed=4)  # fp32 weight
    out = ln.rms_norm(x, 512, w)
    assert out.dtype == dtype
    results = compare_with_reference(
        lambda x, w: ln.rms_norm(x, 512, w),
        lambda x, w: ref.rms_norm(x, 512, w, torch.finfo(dtype).eps).to(x.dtype),
        [x, w],
        names=["x", "weight"],
        atol_floor=_floor(dtype),
    )
    assert_parity(results)
    # eps=None means finfo(input dtype).eps, as in F.rms_norm.
    eps = torch.finfo(dtype).eps
    expected = torch.nn.functional.rms_norm(x.detach().float(), (512,), w.detach(), eps)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


# --------------------------------------------------------------------------- gradcheck


def test_gradcheck_float64():
    x = _make((4, 9), torch.float64, shift=1.0)
    w, b = _params(9, "both", torch.float64)
    r = _make((4, 9), torch.float64, seed=7)
    _assert_runs_cpp(x)
    assert torch.autograd.gradcheck(lambda x, w, b: ln.layer_norm(x, 9, w, b), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w: ln.rms_norm(x, 9, w, 1e-5), (x, w))

    def fused(x, r, w, b):
        torch.manual_seed(11)  # the same dropout seed in every evaluation
        return ln.dropout_add_layer_norm(x, r, w, b, 1e-5, 0.3, prenorm=True)

    assert torch.autograd.gradcheck(fused, (x, r, w, b))


@pytest.mark.parametrize("prenorm", [False, True])
def test_gradients_of_every_subset_of_inputs(prenorm):
    """Eager autograd with any of weight, bias, residual absent and any subset of the inputs
    requiring grad: the gradients of exactly those inputs, equal to the reference's."""
    import itertools

    for has_w, has_b, has_r, *needs in itertools.product([False, True], repeat=7):
        given = [True, has_w, has_b, has_r]
        if not any(g and n for g, n in zip(given, needs)):
            continue
        x = _make((5, 16), torch.float64, grad=needs[0])
        w = _make((16,), torch.float64, seed=1, grad=needs[1]) if has_w else None
        b = _make((16,), torch.float64, seed=2, grad=needs[2]) if has_b else None
        r = _make((5, 16), torch.float64, seed=3, grad=needs[3]) if has_r else None
        got, want = (_subset_grads(fn, x, r, w, b, prenorm) for fn in (ln, ref))
        for g, h in zip(got, want):
            torch.testing.assert_close(g, h, atol=1e-9, rtol=1e-9)


def _subset_grads(module, x, r, w, b, prenorm):
    leaves = [t for t in (x, w, b, r) if t is not None and t.requires_grad]
    out = module.dropout_add_layer_norm(x, r, w, b, 1e-5, 0.0, prenorm)
    loss = (out[0] * 1.5 + out[1] * 0.5) if prenorm else out
    return torch.autograd.grad(loss.square().sum(), leaves)


# --------------------------------------------------------------------------- dropout_add_layer_norm


def _seed_of_next_call(manual_seed):
    torch.manual_seed(manual_seed)
    return rng.draw_seed("cpu")


def _fused_parity(x, res, w, b, p, prenorm, manual_seed=123, atol_floor=None):
    """dropout_add_layer_norm against the reference given the keep-mask its call drew."""
    seed = _seed_of_next_call(manual_seed)
    keep = ln.dropout_add_layer_norm_keep_mask(seed, x.shape, p) if p > 0 else None

    def fast(x, res, w, b):
        torch.manual_seed(manual_seed)
        return ln.dropout_add_layer_norm(x, res, w, b, 1e-5, p, prenorm)

    def reference(x, res, w, b):
        out = ref.dropout_add_layer_norm(x, res, w, b, 1e-5, p, prenorm, keep_mask=keep)
        return (out[0].to(x.dtype), out[1]) if prenorm else out.to(x.dtype)

    _assert_runs_cpp(x)
    names = ["x", "residual", "weight", "bias"] if res is not None else ["x", "weight", "bias"]
    kwargs = {} if atol_floor is None else {"atol_floor": atol_floor}
    assert_parity(compare_with_reference(fast, reference, [x, res, w, b], names=names, **kwargs))


@pytest.mark.parametrize("prenorm", [False, True])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize(("rows", "hidden", "p"), [(3, 7, 0.5), (100, 1024, 0.1), (4, 1023, 0.0)])
def test_dropout_add_layer_norm_matches_reference(prenorm, with_residual, rows, hidden, p):
    x = _make((2, rows, hidden), scale=1.5)
    res = _make((2, rows, hidden), seed=9) if with_residual else None
    _fused_parity(x, res, *_params(hidden, "both"), p, prenorm)


def test_outputs_of_fresh_pages_match_reference():
    """Outputs over 32 MiB: glibc maps them fresh, so the CPU kernels prefault their pages
    (csrc/common/prefault.h) before writing out, pre, dx and dres."""
    x = _make((2100, 4096), scale=1.5)
    res = _make((2100, 4096), seed=9)
    _fused_parity(x, res, *_params(4096, "both"), 0.1, True, manual_seed=31)


def test_dropout_add_layer_norm_low_precision():
    x = _make((64, 256), torch.bfloat16)
    res = _make((64, 256), torch.bfloat16, seed=2)
    w, b = _params(256, "both")  # fp32 parameters
    _fused_parity(x, res, w, b, 0.2, True, manual_seed=5, atol_floor=1e-2)


def test_dropout_keep_rate_within_binomial_bound():
    n, p = 1_000_000, 0.3
    x = torch.ones(1000, 1000)
    _, pre = ln.dropout_add_layer_norm(
        x, torch.zeros_like(x), None, None, dropout_p=p, prenorm=True
    )
    kept = (pre != 0).double().mean().item()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(kept - (1 - p)) < 6 * sigma, kept
    assert torch.allclose(pre[pre != 0], torch.full_like(pre[pre != 0], 1 / (1 - p)))


def test_dropout_mask_is_the_regenerated_one():
    x = torch.ones(37, 129)
    seed = _seed_of_next_call(77)
    torch.manual_seed(77)
    _, pre = ln.dropout_add_layer_norm(x, None, None, None, dropout_p=0.4, prenorm=True)
    keep = ln.dropout_add_layer_norm_keep_mask(seed, x.shape, 0.4)
    assert torch.equal(pre != 0, keep)


def test_dropout_reproducible_and_calls_differ():
    x, res = _make((8, 64), grad=False), _make((8, 64), seed=1, grad=False)
    torch.manual_seed(0)
    a = ln.dropout_add_layer_norm(x, res, None, None, dropout_p=0.5)
    b = ln.dropout_add_layer_norm(x, res, None, None, dropout_p=0.5)
    torch.manual_seed(0)
    c = ln.dropout_add_layer_norm(x, res, None, None, dropout_p=0.5)
    assert torch.equal(a, c)
    assert not torch.equal(a, b)


def test_dropout_backward_regenerates_mask_and_stores_none():
    x = _make((16, 32))
    torch.manual_seed(3)
    seed = rng.draw_seed("cpu")
    saved = []
    torch.manual_seed(3)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = ln.dropout_add_layer_norm(x, None, None, None, dropout_p=0.5)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    keep = ln.dropout_add_layer_norm_keep_mask(seed, x.shape, 0.5)
    assert torch.equal(x.grad != 0, keep)  # a dropped element gets no gradient
    assert saved and all(t.dtype not in (torch.bool, torch.uint8, torch.int8) for t in saved)


@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_dropout_keeps_a_dropped_nan_nan(monkeypatch, backend):
    # torch's dropout multiplies by 0, so a dropped NaN or inf stays NaN, and so does a NaN
    # gradient it drops. The C++ kernels selected 0 there, hiding a NaN the model had made.
    monkeypatch.setenv("FASTFORMER_BACKEND_LAYER_NORM", backend)
    p, shape = 0.5, (4, 64)
    seed = _seed_of_next_call(5)
    (r0, c0), (r1, c1) = (~ln.dropout_add_layer_norm_keep_mask(seed, shape, p)).nonzero()[:2]
    x, res = _make(shape, grad=False), _make(shape, seed=1, grad=False)
    x[r0, c0], x[r1, c1] = float("nan"), float("inf")
    torch.manual_seed(5)
    out, pre = ln.dropout_add_layer_norm(x, res, None, None, dropout_p=p, prenorm=True)
    assert pre[r0, c0].isnan() and pre[r1, c1].isnan()
    assert out[r0].isnan().all() and out[r1].isnan().all()
    x = _make(shape)
    torch.manual_seed(5)
    out, pre = ln.dropout_add_layer_norm(x, None, None, None, dropout_p=p, prenorm=True)
    grad_pre = torch.zeros(shape)
    grad_pre[r0, c0] = float("nan")
    (dx,) = torch.autograd.grad((out, pre), x, (torch.zeros(shape), grad_pre))
    assert dx[r0, c0].isnan() and dx.isnan().sum() == 1


# --------------------------------------------------------------------------- determinism


def _grads_once(x, w, b, res):
    xs = [t.detach().clone().requires_grad_() for t in (x, w, b, res)]
    torch.manual_seed(4)
    out, pre = ln.dropout_add_layer_norm(*xs[:1], xs[3], xs[1], xs[2], 1e-5, 0.1, True)
    g = torch.Generator().manual_seed(9)
    torch.autograd.backward(
        [out, pre], [torch.randn(out.shape, generator=g), torch.randn(pre.shape, generator=g)]
    )
    return [t.grad for t in xs]


def test_grads_bit_identical_twice_and_across_thread_counts():
    x, res = _make((1000, 1023), grad=False), _make((1000, 1023), seed=2, grad=False)
    w, b = _params(1023, "both")
    first, second = _grads_once(x, w, b, res), _grads_once(x, w, b, res)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = _grads_once(x, w, b, res)
    finally:
        torch.set_num_threads(threads)
    for a, b2, c in zip(first, second, single):
        assert torch.equal(a, b2) and torch.equal(a, c)


# --------------------------------------------------------------------------- streamed outputs


def _outputs_and_grads(kind, x, w, b, res):
    """The op's outputs, then the gradients of x, w, b (and res) for a seeded dout."""
    torch.manual_seed(7)
    if kind == "fused":
        outs = ln.dropout_add_layer_norm(x, res, w, b, 1e-5, 0.1, True)
    elif kind == "rms_norm":
        outs, b = (ln.rms_norm(x, x.shape[-1], w),), None
    else:
        outs = (ln.layer_norm(x, x.shape[-1], w, b),)
    ins = [t for t in (x, w, b, res) if t is not None and t.requires_grad]
    g = torch.Generator().manual_seed(3)
    douts = [torch.randn(o.shape, generator=g).to(o.dtype) for o in outs]
    return [o.detach() for o in outs] + list(torch.autograd.grad(outs, ins, douts))


STREAM_CASES = [
    (kind, dtype)
    for kind in ("layer_norm", "rms_norm", "fused")
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    if not (kind == "fused" and dtype == torch.float64)  # (the fused op takes no float64)
]


@needs_ext
@pytest.mark.parametrize(("kind", "dtype"), STREAM_CASES)
@pytest.mark.parametrize("hidden", [12, 16, 1024, 2052])
def test_streamed_outputs_have_the_plain_stores_bits(monkeypatch, kind, dtype, hidden):
    """FASTFORMER_LN_STREAM=1 writes out, pre, dx and dres with non-temporal stores
    (csrc/common/stream_store.h) at any size: no arithmetic changes, so the bits are those of =0.
    Hidden 12 and 2052: float32 rows with a 4-element tail after the 8-lane vectors; 16: 16-bit
    rows through a float scratch row; 1024: 16-bit rows in place, and the fused op's."""
    x = _make((37, hidden), dtype, scale=2.0, shift=1.0)
    res = _make((37, hidden), dtype, seed=4) if kind == "fused" else None
    w, b = _params(hidden, "both", torch.float64 if dtype == torch.float64 else torch.float32)
    results = {}
    for mode in ("0", "1", "auto"):
        monkeypatch.setenv(STREAM_ENV, mode)
        results[mode] = _outputs_and_grads(kind, x, w, b, res)
    for streamed, plain in zip(results["1"], results["0"]):
        assert torch.equal(streamed.view(torch.uint8), plain.view(torch.uint8))
    for auto, plain in zip(results["auto"], results["0"]):
        assert torch.equal(auto.view(torch.uint8), plain.view(torch.uint8))


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_streamed_outputs_match_reference(monkeypatch, dtype):
    monkeypatch.setenv(STREAM_ENV, "1")
    x = _make((64, 2048), dtype, scale=2.0, shift=3.0)
    _ln_parity(x, 2048, *_params(2048, "both"))


@needs_ext
def test_stream_switch_rejects_other_values(monkeypatch):
    monkeypatch.setenv(STREAM_ENV, "yes")
    with pytest.raises(ValueError, match="FASTFORMER_LN_STREAM must be one of .*got 'yes'"):
        ln.layer_norm(torch.randn(2, 8), 8)


# --------------------------------------------------------------------------- bad input


def _bad_cases():
    x = torch.randn(3, 8)
    w = torch.randn(8)
    meta = torch.randn(8, device="meta")
    return {
        "shape mismatch": (lambda: ln.layer_norm(x, 7), ValueError, "normalized_shape"),
        "shape too long": (lambda: ln.layer_norm(x, (2, 3, 8)), ValueError, "normalized_shape"),
        "shape type": (lambda: ln.layer_norm(x, "8"), TypeError, "normalized_shape"),
        "shape empty": (lambda: ln.layer_norm(x, ()), ValueError, "normalized_shape"),
        "shape negative": (lambda: ln.layer_norm(x, -8), ValueError, "non-negative"),
        "weight shape": (lambda: ln.layer_norm(x, 8, torch.randn(7)), ValueError, "weight"),
        "bias shape": (lambda: ln.layer_norm(x, 8, w, torch.randn(4, 2)), ValueError, "bias"),
        "weight dtype": (lambda: ln.layer_norm(x, 8, w.half()), TypeError, "weight"),
        "weight/bias dtypes": (
            lambda: ln.layer_norm(x.half(), 8, w, w.half()),
            TypeError,
            "same dtype",
        ),
        "weight type": (lambda: ln.layer_norm(x, 8, [1.0] * 8), TypeError, "weight"),
        "input dtype": (lambda: ln.layer_norm(x.long(), 8), TypeError, "input"),
        "input type": (lambda: ln.layer_norm(x.tolist(), 8), TypeError, "input"),
        "weight device": (lambda: ln.layer_norm(x, 8, meta), ValueError, "weight is on meta"),
        "eps zero": (lambda: ln.layer_norm(x, 8, eps=0.0), ValueError, "eps"),
        "eps negative": (lambda: ln.layer_norm(x, 8, eps=-1e-5), ValueError, "eps"),
        "eps nan": (lambda: ln.layer_norm(x, 8, eps=math.nan), ValueError, "eps"),
        "eps type": (lambda: ln.layer_norm(x, 8, eps="1e-5"), TypeError, "eps"),
        # past float's range: float() raised OverflowError; 0.0 as a float: the kernel refused it
        "eps huge int": (lambda: ln.layer_norm(x, 8, eps=10**400), ValueError, "eps must be"),
        "eps tiny": (lambda: ln.rms_norm(x, 8, eps=np.longdouble("1e-4000")), ValueError, "> 0"),
        # the float fast path of the eps check refuses inf as the general path does
        "eps inf": (
            lambda: ln.layer_norm(x, 8, eps=math.inf),
            ValueError,
            "^layer_norm: eps must be a finite number > 0, got inf$",
        ),
        # True is a numbers.Real and a numbers.Integral: it would pass as 1.0 or as a size of 1
        "eps bool": (
            lambda: ln.layer_norm(x, 8, eps=True),
            TypeError,
            "eps must be a float, got bool$",
        ),
        **{
            f"shape {shape!r}": (
                lambda shape=shape: ln.layer_norm(x[:, :1], shape),
                TypeError,
                "^layer_norm: normalized_shape must be an int or a sequence of ints",
            )
            for shape in (True, (True,))
        },
        "rms weight shape": (
            lambda: ln.rms_norm(x, 8, torch.randn(7)),
            ValueError,
            r"^rms_norm: weight must have shape \(8,\), got \(7,\)$",
        ),
        "input sparse": (
            lambda: ln.layer_norm(x.to_sparse(), 8),
            ValueError,
            "input must be a dense",
        ),
        "weight sparse": (
            lambda: ln.layer_norm(x, 8, w.to_sparse()),
            ValueError,
            "weight must be a",
        ),
        "residual nested": (
            lambda: ln.dropout_add_layer_norm(x, torch.nested.as_nested_tensor([x]), w, w),
            ValueError,
            "residual must be a dense strided tensor, got a nested tensor",
        ),
        "rms eps": (lambda: ln.rms_norm(x, 8, eps=0), ValueError, "eps"),
        "rms shape": (lambda: ln.rms_norm(x, 9), ValueError, "normalized_shape"),
        "p one": (
            lambda: ln.dropout_add_layer_norm(x, x, w, w, dropout_p=1.0),
            ValueError,
            "dropout_p",
        ),
        "p negative": (
            lambda: ln.dropout_add_layer_norm(x, x, w, w, dropout_p=-0.1),
            ValueError,
            "dropout_p",
        ),
        "residual shape": (
            lambda: ln.dropout_add_layer_norm(x, x[:2], w, w),
            ValueError,
            "residual",
        ),
        "residual dtype": (
            lambda: ln.dropout_add_layer_norm(x, x.double(), w, w),
            TypeError,
            "residual",
        ),
        "residual device": (
            lambda: ln.dropout_add_layer_norm(x, x.to("meta"), w, w),
            ValueError,
            "residual",
        ),
        "fused residual type": (
            lambda: ln.dropout_add_layer_norm(x, x.tolist(), w, w),
            TypeError,
            "residual must be a torch.Tensor or None, got list",
        ),
        "fused weight": (
            lambda: ln.dropout_add_layer_norm(x, x, torch.randn(7), None),
            ValueError,
            "weight",
        ),
        # the fused op calls its input x: the shared checks said "input"
        "fused bias device": (
            lambda: ln.dropout_add_layer_norm(x, None, w, meta),
            ValueError,
            "^dropout_add_layer_norm: bias is on meta but x is on cpu$",
        ),
        "fused weight dtype": (
            lambda: ln.dropout_add_layer_norm(x.half(), None, w.double(), None),
            TypeError,
            r"weight must be the x dtype torch.float16 or float32, got torch.float64$",
        ),
        "prenorm type": (
            lambda: ln.dropout_add_layer_norm(x, x, w, w, prenorm=1),
            TypeError,
            "prenorm",
        ),
        "0-dim x": (
            lambda: ln.dropout_add_layer_norm(torch.tensor(1.0), None, None, None),
            ValueError,
            "x must have at least one dim",
        ),
        # (the shortcut for an int normalized_shape read the last dim of a 0-dim input)
        "0-dim input": (lambda: ln.layer_norm(torch.tensor(1.0), 1), ValueError, "trailing dims"),
        "0-dim rms input": (lambda: ln.rms_norm(torch.tensor(1.0), [1]), ValueError, "trailing"),
    }


def _launch_guard(entry, launched):
    def guarded(*args):
        if entry(*args) is not None:
            launched()

    return guarded


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_input_raises_before_any_kernel(case, monkeypatch):
    fn, error, match = _bad_cases()[case]

    class Launched(Exception):
        pass

    def launched(*args, **kwargs):
        raise Launched

    # Every path to the compiled forward goes through _forward (eager, no-grad, custom op), or
    # through the eager entry, which returns None without running anything for a call it does
    # not take (a kernel it ran on a bad call would show as Launched).
    monkeypatch.setattr(ln, "_forward", launched)
    for attr in ("_EAGER", "_EAGER_FUSED"):
        entry = getattr(ln, attr)
        if entry is not None:
            monkeypatch.setattr(ln, attr, _launch_guard(entry, launched))
    if extension_error() is None:  # the patches do intercept a valid call
        with pytest.raises(Launched):
            ln.dropout_add_layer_norm(torch.randn(3, 8), None, None, None, dropout_p=0.1)
        with pytest.raises(Launched):
            ln.layer_norm(torch.randn(3, 8), 8)
        with pytest.raises(Launched):
            ln.dropout_add_layer_norm(torch.randn(3, 8), None, None, None)
    with pytest.raises(error, match=match):
        fn()


def test_error_message_names_value_and_expectation():
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\), got \(7,\)"):
        ln.layer_norm(torch.randn(3, 8), 8, torch.randn(7))
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\), got 1.5"):
        ln.dropout_add_layer_norm(torch.randn(3, 8), None, None, None, dropout_p=1.5)


_KEEP_MASK_BAD = [  # (seed, shape, dropout_p), error, message after the function's name
    ((1, (3, 8), 1.5), ValueError, r"dropout_p must be in \[0, 1\), got 1.5"),  # was all False
    ((1, (3, 8), -1.0), ValueError, r"dropout_p must be in \[0, 1\), got -1.0"),  # all True
    ((1, (3, 8), 0.99999), ValueError, r"dropout_p must be at most 0.999911"),
    ((1, (3, 8), "a"), TypeError, r"dropout_p must be a float, got str"),
    ((1, 8, 0.1), TypeError, r"shape must be a sequence of ints, got int"),
    ((1, (3, -2), 0.1), ValueError, r"shape\[1\] must be an int >= 0, got -2"),
    ((1, [3.0], 0.1), ValueError, r"shape\[0\] must be an int >= 0, got 3.0"),
    ((1.5, (3, 8), 0.1), TypeError, r"seed must be an int, got float"),
    ((-1, (3, 8), 0.1), ValueError, r"seed must be in \[0, 2\*\*64\), got -1"),
]


@pytest.mark.parametrize(("args", "error", "match"), _KEEP_MASK_BAD)
def test_keep_mask_checks_its_arguments_before_any_work(args, error, match, keep_mask_never_built):
    with pytest.raises(error, match=f"^dropout_add_layer_norm_keep_mask: {match}"):
        ln.dropout_add_layer_norm_keep_mask(*args)


def test_keep_mask_takes_any_sequence_of_sizes():
    expected = ln.dropout_add_layer_norm_keep_mask(5, (3, 8), 0.4)
    for shape in (torch.Size([3, 8]), [3, 8]):
        assert torch.equal(ln.dropout_add_layer_norm_keep_mask(5, shape, np.float32(0.4)), expected)
    assert ln.dropout_add_layer_norm_keep_mask(5, (), 0.4).shape == ()
    assert ln.dropout_add_layer_norm_keep_mask(5, (0, 8), 0.4).shape == (0, 8)


@needs_ext
def test_compiled_op_rejects_bad_direct_calls():
    seed = torch.tensor(0)
    f = torch.ops.fastformer.layer_norm_fwd
    with pytest.raises(RuntimeError, match="0-d"):
        f(torch.randn(()), None, None, None, seed, 1e-5, 0.0, False, False)
    with pytest.raises(RuntimeError, match="weight must have shape"):
        f(torch.randn(2, 4), torch.randn(3), None, None, seed, 1e-5, 0.0, False, False)
    with pytest.raises(RuntimeError, match="eps"):
        f(torch.randn(2, 4), None, None, None, seed, 0.0, 0.0, False, False)
    for rms in (False, True):  # no columns: the row statistics would read x[0] (a crash)
        with pytest.raises(RuntimeError, match="cols > 0"):
            f(torch.randn(3, 0), None, None, None, seed, 1e-5, 0.0, rms, False)
    with pytest.raises(RuntimeError, match="seed"):
        f(torch.randn(2, 4), None, None, None, torch.tensor(0.5), 1e-5, 0.1, False, False)


# --------------------------------------------------------------------------- backends


def test_cpp_backend_leaves_float64_on_cuda_to_torch(monkeypatch):
    # The CUDA kernels take no float64; a stand-in tensor says what a CUDA one would.
    monkeypatch.setattr(ln, "_EXTENSION_ERROR", None)
    monkeypatch.setattr(ln, "_CUDA_KERNELS", True)

    def on_cuda(dtype):
        return SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype)

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert ln._cpp_reasons(on_cuda(dtype)) == []
    [why] = ln._cpp_reasons(on_cuda(torch.float64))
    assert "CUDA kernels" in why and "got torch.float64" in why


def test_backend_reasons():
    assert _dispatch.explain(ln.OP, None)[1] == ("torch", [])
    meta = torch.empty(2, 3, device="meta")
    if extension_error() is None:
        assert _dispatch.explain(ln.OP, None)[0] == ("cpp", [])
        assert _dispatch.select(ln.OP, torch.randn(2, 3)) == "cpp"
    assert _dispatch.explain(ln.OP, meta)[0][1]  # no compiled kernels for meta tensors


def test_forcing_a_backend(monkeypatch):
    monkeypatch.setenv("FASTFORMER_BACKEND_LAYER_NORM", "cpp")
    if extension_error() is None:
        with pytest.raises(RuntimeError, match="cannot run"):
            _dispatch.select(ln.OP, torch.empty(2, 3, device="meta"))
    monkeypatch.setenv("FASTFORMER_BACKEND_LAYER_NORM", "nope")
    with pytest.raises(ValueError, match="not a backend"):
        ln.layer_norm(torch.randn(2, 3), 3)


@needs_ext
def test_torch_backend_agrees_with_cpp(monkeypatch):
    x, res = _make((6, 40), grad=False), _make((6, 40), seed=2, grad=False)
    w, b = _params(40, "both")
    torch.manual_seed(8)
    fast = ln.dropout_add_layer_norm(x, res, w, b, 1e-5, 0.25, True)
    monkeypatch.setenv("FASTFORMER_BACKEND_LAYER_NORM", "torch")
    torch.manual_seed(8)
    slow = ln.dropout_add_layer_norm(x, res, w, b, 1e-5, 0.25, True)
    for a, c in zip(fast, slow):
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ln.rms_norm(x, 40, w), torch.nn.functional.rms_norm(x, (40,), w))
    torch.testing.assert_close(
        ln.layer_norm(x, 40, w, b), torch.nn.functional.layer_norm(x, (40,), w, b)
    )


@pytest.mark.parametrize("where", ["torch_backend", "meta"])
def test_outputs_are_contiguous_on_every_backend(monkeypatch, where):
    # The kernels (and F.layer_norm) return contiguous outputs for a permuted input, and the
    # fakes say so; the torch backend (and the meta device, which takes it) kept x's order.
    x = _make((6, 4, 8), grad=False).transpose(0, 1)
    if where == "meta":
        x = x.to("meta")
    else:
        monkeypatch.setenv("FASTFORMER_BACKEND_LAYER_NORM", "torch")
    outs = [
        ln.layer_norm(x, 8),
        ln.rms_norm(x, 8),
        *ln.dropout_add_layer_norm(x, x, None, None, prenorm=True),
        *ln.dropout_add_layer_norm(x, None, None, None, prenorm=True),  # pre: a copy of x
    ]
    assert all(t.shape == x.shape and t.is_contiguous() for t in outs)


# --------------------------------------------------------------------------- torch.library


@needs_ext
def test_opcheck():
    x = _make((5, 24))
    w, b = _params(24, "both")
    r = _make((5, 24), seed=3)
    op = torch.ops.fastformer.layer_norm.default
    torch.library.opcheck(op, (x, w, b, None, 1e-5, 0.0, False, False))
    torch.library.opcheck(op, (x, w, None, None, 1e-6, 0.0, True, False))
    torch.library.opcheck(op, (x, w, b, r, 1e-5, 0.0, False, True))
    seed = torch.tensor(42)
    xd, wd, bd, rd = (t.detach() for t in (x, w, b, r))
    torch.library.opcheck(
        torch.ops.fastformer.layer_norm_fwd.default, (xd, wd, bd, rd, seed, 1e-5, 0.3, False, True)
    )
    out, pre, mean, rstd = torch.ops.fastformer.layer_norm_fwd(
        xd, wd, bd, rd, seed, 1e-5, 0.3, False, True
    )
    args = (torch.randn_like(xd), xd.clone(), pre, wd, bd, mean, rstd, seed, 0.3, False, True)
    torch.library.opcheck(torch.ops.fastformer.layer_norm_bwd.default, (*args, True, True, True))
    # without residual, dweight and dbias: three empty outputs, each its own (they were one)
    no_grads = (args[0], None, xd, None, None, mean, rstd, seed, 0.0, False, False)
    torch.library.opcheck(
        torch.ops.fastformer.layer_norm_bwd.default, (*no_grads, False, False, False)
    )
    eager = torch.ops.fastformer.layer_norm_autograd.default  # the eager path's C++ autograd
    torch.library.opcheck(eager, (x, w, b, r, seed, 1e-5, 0.3, False, True))
    torch.library.opcheck(eager, (x, None, b, None, rng.NO_SEED, 1e-5, 0.0, False, False))
    with torch.inference_mode():  # below autograd: the forward kernel alone
        got = eager(x, w, b, r, seed, 1e-5, 0.3, False, True)
    assert torch.equal(got[0], out) and torch.equal(got[1], pre)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_opcheck_of_float64_and_float32_parameters_of_16_bit_inputs(dtype):
    # The fakes' statistics are float64 for float64 inputs, and dweight has the weight's dtype
    x, r = _make((5, 24), dtype), _make((5, 24), dtype, seed=3)
    w, b = _params(24, "both")
    w, b = (
        t.detach().to(torch.float64 if dtype == torch.float64 else torch.float32) for t in (w, b)
    )
    w.requires_grad_(), b.requires_grad_()
    op = torch.ops.fastformer.layer_norm.default
    torch.library.opcheck(op, (x, w, b, r, 1e-5, 0.0, False, True))
    torch.library.opcheck(op, (x, w, None, None, 1e-6, 0.0, True, False))
    seed = torch.tensor(7)
    xd, wd, bd, rd = (t.detach() for t in (x, w, b, r))
    _, pre, mean, rstd = torch.ops.fastformer.layer_norm_fwd(
        xd, wd, bd, rd, seed, 1e-5, 0.3, False, True
    )
    args = (torch.randn_like(xd), None, pre, wd, bd, mean, rstd, seed, 0.3, False, True)
    torch.library.opcheck(torch.ops.fastformer.layer_norm_bwd.default, (*args, True, True, True))


@needs_ext
@pytest.mark.parametrize("residual", [False, True])
def test_raw_op_with_dropout_refuses_autograd_without_store_pre(residual):
    # Its backward regenerates the mask on pre: a forward for autograd without pre must say
    # so, not save x in its place
    x = _make((3, 8))
    r = _make((3, 8), seed=2, grad=False) if residual else None
    with pytest.raises(RuntimeError, match="backward needs pre; call with store_pre"):
        torch.ops.fastformer.layer_norm(x, None, None, r, 1e-5, 0.3, False, False)


@pytest.mark.parametrize("backend", ["cpp", "torch"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_outputs_have_the_input_dtype_with_float32_parameters(monkeypatch, backend, dtype):
    # The torch backend's reference promotes to the float32 parameters' dtype
    if backend == "cpp" and extension_error() is not None:
        pytest.skip("fastformer._C not built")
    monkeypatch.setenv("FASTFORMER_BACKEND_LAYER_NORM", backend)
    x = _make((3, 8), dtype, grad=False)
    w, b = (t.detach() for t in _params(8, "both"))
    outs = [
        ln.layer_norm(x, 8, w, b),
        ln.rms_norm(x, 8, w),
        *ln.dropout_add_layer_norm(x, x, w, b, dropout_p=0.2, prenorm=True),
        ln.dropout_add_layer_norm(x, None, w, b),
    ]
    assert [t.dtype for t in outs] == [dtype] * len(outs)


def test_backend_choice_is_remembered_per_dtype(monkeypatch, fake_cuda):
    # On CUDA the compiled kernels take no float64: a choice cached per device alone gave a
    # float64 call the kernels' backend after a float32 call (fake CUDA tensors: no GPU needed).
    monkeypatch.setattr(ln, "_EXTENSION_ERROR", None)
    monkeypatch.setattr(ln, "_CUDA_KERNELS", True)
    monkeypatch.setattr(_dispatch, "_CHOICES", {})
    ran = []
    monkeypatch.setattr(ln, "_run_cpp", lambda x, *args: ran.append(("cpp", x.dtype)))
    monkeypatch.setattr(ln, "_run_torch", lambda x, *args: ran.append(("torch", x.dtype)))
    for dtype in (torch.float32, torch.float64):
        ln.layer_norm(fake_cuda(2, 8, dtype=dtype), 8)
    assert ran == [("cpp", torch.float32), ("torch", torch.float64)]


def _compiled_matches_eager(fn, inputs, seed=0):
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    results = []
    for f in (fn, compiled):
        xs = [t.detach().clone().requires_grad_() if t is not None else None for t in inputs]
        torch.manual_seed(seed)
        out = f(*xs)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(list(outs), [torch.ones_like(o) * 0.5 for o in outs])
        results.append([*outs, *(t.grad for t in xs if t is not None)])
    for a, c in zip(*results):
        torch.testing.assert_close(a, c, atol=0, rtol=0)
    return compiled


def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    x, res = _make((4, 6, 48)), _make((4, 6, 48), seed=1)
    w, b = _params(48, "both")
    _compiled_matches_eager(lambda x, w, b: ln.layer_norm(x, 48, w, b), [x, w, b])
    _compiled_matches_eager(lambda x, w: ln.rms_norm(x, (6, 48), None, 1e-6) * w, [x, w])

    def fused(x, r, w, b):
        return ln.dropout_add_layer_norm(x, r, w, b, 1e-5, 0.3, True)

    # pre alone is returned and differentiated: the custom op's backward must add its gradient
    _compiled_matches_eager(
        lambda x, w, b: ln.dropout_add_layer_norm(x, None, w, b, prenorm=True), [x, w, b]
    )
    compiled = _compiled_matches_eager(fused, [x, res, w, b], seed=21)
    # The seed is drawn when the compiled graph runs, not baked in at trace time.
    torch.manual_seed(1)
    first = compiled(x, res, w, b)[0]
    assert not torch.equal(first, compiled(x, res, w, b)[0])


def test_torch_compile_torch_backend(monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setenv("FASTFORMER_BACKEND_LAYER_NORM", "torch")
    x, res = _make((4, 32)), _make((4, 32), seed=1)
    w, b = _params(32, "both")
    _compiled_matches_eager(
        lambda x, r, w, b: ln.dropout_add_layer_norm(x, r, w, b, 1e-5, 0.2, True),
        [x, res, w, b],
        seed=3,
    )
    torch._dynamo.reset()


# --------------------------------------------------------------------------- the eager entry
#
# layer_norm and rms_norm first try fastformer._C.layer_norm_eager: the plain call in one C call,
# None for any other (csrc/layer_norm/layer_norm_eager.cpp). Where it runs it must give the
# checked Python path's bits, gradients included; everything it declines goes down that path.


def _entry():
    from fastformer import _C

    return _C.layer_norm_eager


# name: (input shape, dtype, parameter dtype, affine, rms, eps, input scale). RMSNorm's default
# eps cases have a small scale: there the eps chosen changes the bits.
_ENTRY_CASES = {
    "fp32": ((3, 5, 64), torch.float32, torch.float32, "both", False, 1e-5, 2.0),
    "fp32 weight only": ((7, 33), torch.float32, torch.float32, "weight", False, 1e-3, 2.0),
    "fp32 bias only": ((7, 33), torch.float32, torch.float32, "bias", False, 1e-5, 2.0),
    "fp32 no affine": ((2, 4099), torch.float32, None, "none", False, 1e-5, 2.0),
    "bf16, fp32 params": ((9, 1024), torch.bfloat16, torch.float32, "both", False, 1e-5, 2.0),
    "fp16, fp16 params": ((9, 1000), torch.float16, torch.float16, "both", False, 1e-5, 2.0),
    "fp64": ((4, 17), torch.float64, torch.float64, "both", False, 1e-5, 2.0),
    "rms fp32 default eps": ((5, 96), torch.float32, torch.float32, "weight", True, None, 1e-3),
    "rms bf16 default eps": ((5, 96), torch.bfloat16, torch.float32, "weight", True, None, 1e-3),
    "rms fp64 default eps": ((5, 96), torch.float64, torch.float64, "weight", True, None, 1e-7),
    "rms fp16 eps": ((1, 7), torch.float16, None, "none", True, 1e-6, 2.0),
}


def _call(x, w, b, rms, eps, shape):
    return ln.rms_norm(x, shape, w, eps) if rms else ln.layer_norm(x, shape, w, b, eps)


@needs_ext
@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize(("case", "device"), on_devices(_ENTRY_CASES, 1))
def test_eager_entry_gives_the_checked_paths_bits(case, device, grad, monkeypatch):
    shape, dtype, pdtype, affine, rms, eps, scale = _ENTRY_CASES[case]
    n = shape[-1]
    x = _make(shape, dtype, scale=scale, shift=scale / 2, device=device, grad=grad)
    w, b = _params(n, affine, pdtype or dtype, device=device)
    b = None if rms else b
    if grad:
        for p in (w, b):
            if p is not None:
                p.requires_grad_(True)
    dy = _make(shape, dtype, seed=5, device=device, grad=False)
    assert _entry()(x, n, w, None if rms else b, eps, rms) is not None  # it does run these

    def run(shape_arg):
        xs = [t for t in (x, w, b) if t is not None]
        out = _call(x, w, b, rms, eps, shape_arg)
        if not grad:
            return [out]
        return [out, *torch.autograd.grad(out, xs, dy)]

    want = checked_path(monkeypatch, ln, lambda: run(n))
    for shape_arg in (n, (n,), [n], torch.Size([n])):
        got = run(shape_arg)
        assert len(got) == len(want)
        for a, c in zip(got, want):
            assert a.dtype == c.dtype and a.shape == c.shape
            assert torch.equal(a, c), (case, shape_arg)


@needs_ext
def test_eager_entry_runs_non_contiguous_inputs_and_parameters(monkeypatch):
    x = _make((64, 6), grad=False).t()  # (6, 64), column-major
    w = _make((64, 2), seed=3, grad=False)[:, 0]  # stride 2
    assert _entry()(x, 64, w, None, 1e-5, False) is not None
    want = checked_path(monkeypatch, ln, lambda: ln.layer_norm(x, 64, w))
    assert torch.equal(ln.layer_norm(x, 64, w), want)


@needs_ext
def test_plain_calls_take_the_eager_entry(monkeypatch):
    # The checked path's dispatch raises: a plain call must not reach it (a gate of the entry that
    # declined every call would leave it unused, and these tests blind to that).
    def checked(*args):
        raise AssertionError("the checked path ran")

    monkeypatch.setattr(ln, "_run", checked)
    x, (w, b) = _make((3, 16)), _params(16, "both")
    ln.layer_norm(x, 16, w, b).sum().backward()
    assert x.grad is not None and w.grad is not None and b.grad is not None
    with torch.no_grad():
        ln.rms_norm(x, (16,), w)
    with torch.inference_mode():
        ln.layer_norm(x, [16], None, None, 1e-6)
    out, pre = ln.dropout_add_layer_norm(x, x.detach(), w, b, 1e-5, 0.1, True)
    (out + pre).sum().backward()
    with torch.no_grad():
        ln.dropout_add_layer_norm(x, None, None, None, 1e-5, 0.0)
    with pytest.raises(AssertionError, match="checked path"):
        ln.layer_norm(x.detach().view(3, 1, 16), (1, 16))  # two normalized dims: the checked path's


def _nested(layout=torch.strided):
    return torch.nested.nested_tensor([torch.randn(2, 8), torch.randn(3, 8)], layout=layout)


def _declined_calls():
    """name: (call of the entry, what the public function must then give, or an exception)."""
    x, w, b = torch.randn(3, 8), torch.randn(8), torch.randn(8)
    e = _entry()

    def plain(**kw):
        args = dict(input=x, normalized_shape=8, weight=w, bias=b, eps=1e-5, rms=False)
        args.update(kw)
        return lambda: e(*args.values())

    return {
        "subclass input": plain(input=x.as_subclass(Subclass)),
        "subclass weight": plain(weight=w.as_subclass(Subclass)),
        "int input": plain(input=x.int()),
        "0-dim input": plain(input=torch.tensor(1.0), normalized_shape=1, weight=None, bias=None),
        "empty input": plain(input=torch.randn(0, 8)),
        "meta input": plain(input=x.to("meta"), weight=None, bias=None),
        "sparse input": plain(input=x.to_sparse(), weight=None, bias=None),
        "nested input": plain(input=_nested(), weight=None, bias=None),
        "shape mismatch": plain(normalized_shape=7),
        "two normalized dims": plain(normalized_shape=(3, 8), weight=None, bias=None),
        "bool shape": plain(input=torch.randn(3, 1), normalized_shape=True, weight=None, bias=None),
        "numpy shape": plain(normalized_shape=np.int64(8)),
        "weight shape": plain(weight=torch.randn(7)),
        "weight 2-dim": plain(weight=torch.randn(1, 8)),
        "weight dtype": plain(weight=w.double()),
        "16-bit weight of fp32 input": plain(weight=w.half()),
        "weight and bias dtypes differ": plain(input=x.bfloat16(), bias=b.bfloat16()),
        "weight device": plain(weight=w.to("meta")),
        "weight a list": plain(weight=w.tolist()),
        "eps int": plain(eps=1),
        "eps zero": plain(eps=0.0),
        "eps inf": plain(eps=math.inf),
        "eps nan": plain(eps=math.nan),
        "eps numpy": plain(eps=np.float64(1e-5)),
        "eps None for layer_norm": plain(eps=None),
        "rms with a bias": plain(rms=True),
    }


@needs_ext
@pytest.mark.parametrize("case", list(_declined_calls()))
def test_eager_entry_declines_unusual_arguments(case):
    assert _declined_calls()[case]() is None


@needs_ext
def test_eager_entry_declines_in_contexts_the_checked_path_routes(monkeypatch):
    x, w, b = torch.randn(3, 8), torch.randn(8), torch.randn(8)
    e = _entry()

    def plain(t=x):
        return e(t, 8, w, b, 1e-5, False)

    assert plain() is not None
    with torch.autograd.forward_ad.dual_level():
        assert plain() is None
    seen = []
    torch.vmap(lambda t: (seen.append(plain(t)), t)[1])(x)
    torch.func.grad(lambda t: (seen.append(plain(t)), t.sum())[1])(x)
    torch.func.jvp(lambda t: (seen.append(plain(t)), t)[1], (x,), (x,))
    assert seen == [None, None, None]
    with torch._subclasses.fake_tensor.FakeTensorMode():
        assert e(torch.randn(3, 8), 8, None, None, 1e-5, False) is None
    with PassThroughMode():
        assert plain() is None
    with PassThroughFunctionMode():
        assert plain() is None
    traced = []
    torch.jit.trace(lambda t: (traced.append(plain(t)), t + 1)[1], x, check_trace=False)
    assert traced == [None]
    monkeypatch.setenv("FASTFORMER_BACKEND_LAYER_NORM", "torch")
    assert plain() is None
    monkeypatch.setenv("FASTFORMER_BACKEND_LAYER_NORM", "cpp")
    assert plain() is not None
    monkeypatch.setenv("FASTFORMER_BACKEND_LAYER_NORM", "")  # unset, as for the checked path
    assert plain() is not None
    with pytest.raises(TypeError, match="wrong number of arguments"):
        e(x, 8, w, b, 1e-5)


def _fused_entry():
    from fastformer import _C

    return _C.dropout_add_layer_norm_eager


# name: (x shape, dtype, parameter dtype, residual, dropout_p, prenorm)
_FUSED_ENTRY_CASES = {
    "add": ((3, 5, 64), torch.float32, torch.float32, True, 0.0, False),
    "add prenorm": ((6, 33), torch.float32, torch.float32, True, 0.0, True),
    "drop": ((6, 1024), torch.float32, torch.float32, False, 0.25, False),
    "drop prenorm": ((6, 33), torch.float32, torch.float32, False, 0.25, True),
    "add drop": ((2, 7, 96), torch.float32, torch.float32, True, 0.1, False),
    "add drop prenorm": ((9, 1000), torch.float32, torch.float32, True, 0.5, True),
    "bf16 add drop": ((9, 1024), torch.bfloat16, torch.float32, True, 0.1, False),
    "fp16 add drop prenorm": ((4, 256), torch.float16, torch.float16, True, 0.1, True),
    "fp64 add drop prenorm": ((4, 17), torch.float64, torch.float64, True, 0.3, True),
    "plain": ((4, 40), torch.float32, torch.float32, False, 0.0, False),
}


@needs_ext
@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize(("case", "device"), on_devices(_FUSED_ENTRY_CASES, 1))
def test_fused_eager_entry_gives_the_checked_paths_bits(case, device, grad, monkeypatch):
    # The same bits, gradients and generator state after: the seed is the checked path's draw.
    shape, dtype, pdtype, with_residual, p, prenorm = _FUSED_ENTRY_CASES[case]
    n = shape[-1]
    x = _make(shape, dtype, scale=2.0, shift=1.0, device=device, grad=grad)
    res = _make(shape, dtype, seed=2, device=device, grad=grad) if with_residual else None
    w, b = _params(n, "both", pdtype, device=device)
    w.requires_grad_(grad), b.requires_grad_(grad)
    dy = [_make(shape, dtype, seed=s, device=device, grad=False) for s in (5, 6)]
    leaves = [t for t in (x, res, w, b) if t is not None]
    assert _fused_entry()(x, res, w, b, 1e-5, p, prenorm, ln._eager_seed) is not None

    def run():
        torch.manual_seed(11)
        outs = ln.dropout_add_layer_norm(x, res, w, b, 1e-5, p, prenorm)
        outs = list(outs) if prenorm else [outs]
        state = generator_state(device)
        if grad:
            outs += torch.autograd.grad(outs, leaves, dy[: len(outs)])
        return [*outs, state]

    want = checked_path(monkeypatch, ln, run, "_EAGER_FUSED")
    got = run()
    assert len(got) == len(want)
    for a, c in zip(got, want):
        assert a.dtype == c.dtype and a.shape == c.shape
        assert torch.equal(a, c), case


def _declined_fused_calls():
    x, r, w, b = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8), torch.randn(8)
    e = _fused_entry()

    def plain(**kw):
        args = dict(x=x, residual=r, weight=w, bias=b, eps=1e-5, p=0.1, prenorm=False)
        args.update(kw)
        return lambda: e(*args.values(), ln._eager_seed)

    return {
        "subclass x": plain(x=x.as_subclass(Subclass)),
        "subclass residual": plain(residual=r.as_subclass(Subclass)),
        "0-dim x": plain(x=torch.tensor(1.0), residual=None, weight=None, bias=None),
        "empty x": plain(x=torch.randn(0, 8), residual=None),
        "int x": plain(x=x.int(), residual=None, weight=None, bias=None),
        "nested x": plain(x=_nested(), residual=None, weight=None, bias=None),
        "jagged x": plain(x=_nested(torch.jagged), residual=None, weight=None, bias=None),
        "residual broadcast": plain(residual=torch.randn(8)),
        "residual shape": plain(residual=torch.randn(1, 3, 8)),
        "residual dtype": plain(residual=r.double()),
        "residual device": plain(residual=r.to("meta")),
        "residual a list": plain(residual=r.tolist()),
        "weight shape": plain(weight=torch.randn(7)),
        "bias dtype": plain(bias=b.half()),
        "eps int": plain(eps=1),
        "eps None": plain(eps=None),
        "p int": plain(p=0),
        "p numpy": plain(p=np.float64(0.1)),
        "p negative": plain(p=-0.1),
        "p one": plain(p=1.0),
        "p above 0.99": plain(p=0.995),
        "p nan": plain(p=math.nan),
        "prenorm int": plain(prenorm=1),
        "prenorm None": plain(prenorm=None),
    }


@needs_ext
@pytest.mark.parametrize("case", list(_declined_fused_calls()))
def test_fused_eager_entry_declines_unusual_arguments(case):
    assert_declined_drawing_nothing(_declined_fused_calls()[case])


@needs_ext
def test_fused_eager_entry_declines_in_contexts_and_passes_seed_errors_on(monkeypatch):
    x, r, w, b = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8), torch.randn(8)
    e = _fused_entry()

    def plain(t=x, p=0.1, seed_fn=ln._eager_seed):
        return e(t, r, w, b, 1e-5, p, True, seed_fn)

    assert isinstance(plain(), tuple) and len(plain()) == 2
    seen = []
    torch.vmap(lambda t: (seen.append(plain(t)), t)[1], randomness="same")(x)
    with torch.autograd.forward_ad.dual_level():
        seen.append(plain())
    with PassThroughMode():
        seen.append(plain())
    monkeypatch.setenv("FASTFORMER_BACKEND_LAYER_NORM", "torch")
    seen.append(plain())
    assert seen == [None] * 4
    monkeypatch.delenv("FASTFORMER_BACKEND_LAYER_NORM")

    def failing(*args):
        raise KeyError("seed")

    with pytest.raises(KeyError, match="seed"):
        plain(seed_fn=failing)
    with pytest.raises(RuntimeError, match="did not return a tensor"):
        plain(seed_fn=lambda *args: 3)
    assert plain(p=0.0, seed_fn=failing) is not None  # no dropout: no draw
    with pytest.raises(TypeError, match="wrong number of arguments"):
        e(x, r, w, b, 1e-5, 0.1, True)


@needs_ext
def test_eager_entry_after_a_first_call_in_inference_mode():
    # The entry's shared seed tensor, made on the first call, must be a normal tensor even when
    # that call ran in inference mode: the autograd node saves it. (A new process: the first call.)
    code = (
        "import torch\n"
        "from fastformer.ops.layer_norm import layer_norm\n"
        "x = torch.randn(3, 8)\n"
        "with torch.inference_mode():\n"
        "    layer_norm(x, 8)\n"
        "w = torch.ones(8, requires_grad=True)\n"
        "layer_norm(x, 8, w).sum().backward()\n"
        "assert w.grad is not None\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


# --------------------------------------------------------------------------- CUDA


def _cuda_parity(rows, hidden, dtype, wdtype, affine="both", offset=0):
    # offset > 0 makes every pointer misaligned (the generic kernels).
    n = rows * hidden
    base = _make((n + offset,), dtype, device=CUDA, scale=2.0, shift=1.0, grad=False)
    x = base[offset:].view(rows, hidden).requires_grad_()
    w, b = _params(hidden, affine, wdtype, device=CUDA)
    results = compare_with_reference(
        lambda x, w, b: ln.layer_norm(x, hidden, w, b),
        lambda x, w, b: ref.layer_norm(x, hidden, w, b).to(x.dtype),
        [x, w, b],
        names=["x", "weight", "bias"],
        atol_floor=_floor(dtype),
    )
    assert_parity(results)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "hidden", [1, 7, 64, 256, 768, 1023, 1024, 4096, 8192, 12288, 16384, 16392, 65536]
)
def test_cuda_layer_norm_parity(dtype, hidden):
    rows = max(1, min(1000, 2**22 // hidden))
    _cuda_parity(rows, hidden, dtype, torch.float32)
    _cuda_parity(3, hidden, dtype, dtype, affine="weight")
    _cuda_parity(5, hidden, dtype, torch.float32, offset=1)


@pytest.mark.cuda
def test_cuda_bf16_large():
    _cuda_parity(16384, 8192, torch.bfloat16, torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("hidden", [7, 1024, 5000])
def test_cuda_rms_norm_and_fused_parity(hidden):
    x = _make((300, hidden), torch.bfloat16, device=CUDA)
    res = _make((300, hidden), torch.bfloat16, seed=2, device=CUDA)
    w, b = _params(hidden, "both", device=CUDA)
    assert_parity(
        compare_with_reference(
            lambda x, w: ln.rms_norm(x, hidden, w),
            lambda x, w: ref.rms_norm(x, hidden, w, torch.finfo(x.dtype).eps).to(x.dtype),
            [x, w],
            atol_floor=1e-2,
        )
    )
    torch.manual_seed(6)
    seed = rng.draw_seed(CUDA)
    keep = ln.dropout_add_layer_norm_keep_mask(seed, x.shape, 0.1, device=CUDA)

    def fast(x, r, w, b):
        torch.manual_seed(6)
        return ln.dropout_add_layer_norm(x, r, w, b, 1e-5, 0.1, True)

    def reference(x, r, w, b):
        out, pre = ref.dropout_add_layer_norm(x, r, w, b, 1e-5, 0.1, True, keep_mask=keep)
        return out.to(x.dtype), pre

    assert_parity(compare_with_reference(fast, reference, [x, res, w, b], atol_floor=1e-2))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [256, 1024, 4096, 12288, 16384])
def test_cuda_staged_and_looped_rows_equal_the_register_kernels(dtype, hidden):
    # layer_norm_tuning's stage 2 and 3 (cp.async rows on a persistent grid, one or two rows
    # ahead) and 4 (the forward reads its rows in a loop; the sweep's candidates): the same bits
    # as the register kernels, the forward plain and fused with a residual and dropout, and the
    # unfused backward, on enough rows (2**24 elements) that every block of the one-wave grid
    # loops (~4 times at hidden 1024 and 16384, more below), with a partial last wave.
    rows = 2**24 // hidden + 5
    x = _make((rows, hidden), dtype, device=CUDA, grad=False)
    r = _make((rows, hidden), dtype, seed=2, device=CUDA, grad=False)
    w, b = _params(hidden, "both", device=CUDA)
    seed = torch.tensor(1234, dtype=torch.int64)
    ops = torch.ops.fastformer

    def forward():
        plain = ops.layer_norm_fwd(x, w, b, None, seed, 1e-5, 0.0, False, False)
        fused = ops.layer_norm_fwd(x, w, b, r, seed, 1e-5, 0.1, False, True)
        _, _, mean, rstd = plain
        grads = ops.layer_norm_bwd(
            r, None, x, w, b, mean, rstd, seed, 0.0, False, False, False, True, True
        )
        return [t for t in (*plain, *fused, *grads) if t is not None]

    outputs = []
    for stage in (1, 2, 3, 4):
        assert ops.layer_norm_tuning([0, 0, 0, 0, stage]) == [0, 0, 0, 0, 0]
        try:
            outputs.append(forward())
            if stage > 1:  # and the parity rule, gradients included
                _cuda_parity(rows, hidden, dtype, torch.float32)
        finally:
            ops.layer_norm_tuning([0, 0, 0, 0, 0])
    for staged in outputs[1:]:
        for registers, result in zip(outputs[0], staged, strict=True):
            assert torch.equal(registers, result)


@pytest.mark.cuda
def test_cuda_matches_cpu_kernels_and_is_deterministic():
    x = _make((4096, 1024), torch.bfloat16, grad=False)
    w, b = _params(1024, "both")
    cpu = ln.layer_norm(x, 1024, w, b)
    xc, wc, bc = (t.detach().cuda().requires_grad_() for t in (x, w, b))
    gpu = ln.layer_norm(xc, 1024, wc, bc)
    torch.testing.assert_close(gpu.cpu(), cpu, atol=2e-2, rtol=2e-2)
    grads = []
    for _ in range(2):
        g = torch.autograd.grad(ln.layer_norm(xc, 1024, wc, bc), (xc, wc, bc), torch.ones_like(xc))
        grads.append(g)
    for a, c in zip(*grads):
        assert torch.equal(a, c)


def _norm_of(norm: str, cols: int, w: torch.Tensor, b: torch.Tensor):
    """x -> the norm's output: layer_norm with weight and bias, without them, or rms_norm."""
    if norm == "rms_norm":
        return lambda x: ln.rms_norm(x, cols, w)
    if norm == "plain":
        return lambda x: ln.layer_norm(x, cols)
    return lambda x: ln.layer_norm(x, cols, w, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cols", [7, 8, 16, 64, 1000, 1023, 4096])
@pytest.mark.parametrize("weight_scale", [1.0, 1e-6], ids=["normal", "subnormal_out"])
@pytest.mark.parametrize("norm", ["layer_norm", "plain", "rms_norm"])
def test_cpu_16bit_is_float32_math_rounded_once(dtype, cols, weight_scale, norm):
    # The CPU kernels read 16-bit rows into float32 and round the results once (nearest even):
    # bit for bit the float32 kernels' results on the same values, rounded by torch. Checks the
    # vectorized conversions (F16C for float16, integer lanes for bfloat16), their scalar tails
    # and subnormal outputs, and the 16-bit twins that read and write rows of a multiple of 16
    # in place (16, 64, 4096; layer_norm.cpp's kRowsInPlace) against the float kernels.
    g = torch.Generator().manual_seed(cols)
    x = (torch.randn(33, cols, generator=g) * 3 + 1).to(dtype).requires_grad_()
    x32 = x.detach().float().requires_grad_()
    w = (torch.randn(cols, generator=g) * weight_scale).requires_grad_()
    b = (torch.randn(cols, generator=g) * weight_scale).requires_grad_()
    dy = torch.randn(33, cols, generator=g).to(dtype)
    fn = _norm_of(norm, cols, w, b)
    out, out32 = fn(x), fn(x32)
    assert torch.equal(out, out32.to(dtype))
    params = {"layer_norm": (w, b), "plain": (), "rms_norm": (w,)}[norm]
    grads = torch.autograd.grad(out, (x, *params), dy)
    grads32 = torch.autograd.grad(out32, (x32, *params), dy.float())
    assert torch.equal(grads[0], grads32[0].to(dtype))
    for a, c in zip(grads[1:], grads32[1:]):
        assert torch.equal(a, c)


def _float16_store_cases() -> torch.Tensor:
    """float32 values around every finite float16 h: h itself, the halfway points to both
    neighbours (ties round to even) and a float32 ulp either side of them; the overflow edge;
    inf, NaN and signed zeros."""
    h = torch.arange(0, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    up = torch.nextafter(h.half(), torch.tensor(float("inf"), dtype=torch.float16)).float()
    mid = (h + up) / 2  # exact in float32
    inf32 = torch.tensor(float("inf"))
    near = [mid, torch.nextafter(mid, inf32), torch.nextafter(mid, -inf32)]
    edge = torch.tensor([65504.0, 65519.99, 65520.0, 1e30, float("inf"), float("nan"), 0.0])
    values = torch.cat([h, *near, edge])
    return torch.cat([values, -values])


def test_cpu_float16_conversions_match_torch_for_every_value():
    # The float16 kernels convert 8 lanes at a time (F16C where the CPU has it): loads of every
    # float16 bit pattern give the pattern back through the fused op's pre output, and stores of
    # a bias-only output (weight 0: out = bias, in float32) round every tie, subnormal and
    # overflow as torch's conversion does (the load side's -0 is above).
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.float16).reshape(-1, 64)  # 64: whole vectors, no scalar tail
    pre = ln.dropout_add_layer_norm(x, None, None, None, prenorm=True)[1]
    same = (pre.view(torch.int16) == bits.view(-1, 64)) | (pre.isnan() & x.isnan())
    assert bool(same.all()), f"{int((~same).sum())} float16 values changed by a load and store"
    bias = _float16_store_cases()
    bias = torch.cat([bias, bias.new_zeros(-bias.numel() % 64)])  # whole vectors
    x, weight = torch.randn(2, bias.numel()).half(), torch.zeros(bias.numel())
    out = ln.layer_norm(x, bias.numel(), weight, bias)
    expected = bias.half().expand_as(out)
    ok = (out.view(torch.int16) == expected.view(torch.int16)) | (out.isnan() & expected.isnan())
    ok |= (out == 0) & (expected == 0)  # 0 * xhat + -0 is +0 where xhat >= 0: not a conversion
    assert bool(ok.all()), (bias[~ok.all(0)], out[0][~ok.all(0)])


# --------------------------------------------------------------------------- launch overrides


def test_launch_overrides_are_set_checked_and_reset():
    # torch.ops.fastformer.layer_norm_tuning (CUDA builds): benchmarks/sweep_layer_norm.py's
    # knob. The emulator tests run the kernels with overrides (tests/test_cuda_emu.py).
    from fastformer._ext import cuda_kernels_compiled

    if not cuda_kernels_compiled():
        pytest.skip("fastformer._C was built without its CUDA kernels")
    tuning = torch.ops.fastformer.layer_norm_tuning
    assert tuning([2, 256, 1, 128, 3]) == [0, 0, 0, 0, 0]
    try:
        bad_ones = ([3, 0, 0, 0, 0], [0, 96 + 1, 0, 0, 0], [0, 0, 0, 544, 0], [0, 0, 0, 0, 5])
        for bad in (*bad_ones, [1, 2, 3], [0, 0, 0, 0]):
            with pytest.raises(RuntimeError, match="layer_norm.tuning"):
                tuning(bad)
    finally:
        assert tuning([0, 0, 0, 0, 0]) == [2, 256, 1, 128, 3]  # a refused call changed nothing


def _sweep_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "benchmarks" / "sweep_layer_norm.py"
    spec = importlib.util.spec_from_file_location("sweep_layer_norm", path)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    return sweep


def test_sweep_script_needs_a_gpu_and_prints_a_table():
    sweep = _sweep_module()
    if not torch.cuda.is_available():
        assert sweep.main(["--cols", "1024"]) == 2
    with pytest.raises(SystemExit):
        sweep.main(["--cols", "x"])
    rows = [
        dict(kind="fwd", cols=1024, vecs=v, block=b, staged=st, ms=ms, gbps=g, of_copy=g / 4000)
        for v, b, st, ms, g in (
            (0, 0, False, 0.02, 3200.0),
            (2, 256, False, 0.018, 3500.0),
            (1, 64, False, 0.03, 2000.0),
            (0, 0, True, 0.019, 3400.0),
            (4, 128, True, 0.017, 3600.0),
        )
    ]
    rows.append(dict(rows[0], block=128, loop=True, ms=0.018, gbps=3300.0, of_copy=0.825))
    bwd = [dict(r, kind="bwd") for r in rows[:2]]
    bwd.append(
        dict(rows[0], kind="bwd", staged=True, ahead=2, ms=0.016, gbps=3700.0, of_copy=0.925)
    )
    result = {"device": "GPU", "dtype": "torch.bfloat16", "rows": 16384, "copy_gbps": 4000.0}
    lines = sweep.table({**result, "results": [*rows, *bwd]}).splitlines()
    assert lines[1] == (
        "fwd   1024: built-in 80.0% (0.020 ms); staged 85.0% (0.019 ms); "
        "loop/128 82.5% (0.018 ms); best 4/128/staged 90.0% (0.017 ms)"
    )
    assert lines[2] == (
        "bwd   1024: built-in 80.0% (0.020 ms); staged2 92.5% (0.016 ms); "
        "best 0/0/staged2 92.5% (0.016 ms)"
    )


def test_sweep_times_each_override_once(monkeypatch):
    # The sweep's loop with its timer and the C++ knob replaced: which overrides it sets.
    sweep = _sweep_module()
    calls, timed = [], []
    monkeypatch.setattr(torch.ops.fastformer, "layer_norm_tuning", calls.append, raising=False)
    monkeypatch.setattr(sweep, "_time_ms", lambda fn: timed.append(calls[-1]) or 0.5)
    bwd_knobs = [[0, 0, v, b, 0] for v, b in [(0, 0), *sweep.BWD] if v != 4]
    staged_bwd = [[0, 0, 0, 0, 2], [0, 0, 0, 0, 3]]  # one and two rows ahead, unfused only
    rows = sweep._measure("bwd", None, 1024, 2, 4000.0)
    assert timed == calls == [*bwd_knobs, *staged_bwd]
    assert [r["ahead"] for r in rows[-3:]] == [0, 1, 2]
    assert rows[0]["gbps"] == 3 * 16384 * 1024 * 2 / 0.5 / 1e6  # x, dy, dx of 2 bytes
    calls.clear(), timed.clear()
    # The forward's knobs: each override in registers, then staged with the built-in vectors
    # and block and with each 4-vector override, then read in a loop with the built-in block,
    # 128 and 256 threads.
    fwd_knobs = [[v, b, 0, 0, 0] for v, b in [(0, 0), *sweep.FWD]]
    fwd_knobs += [[v, b, 0, 0, 2] for v, b in [(0, 0), *sweep.FWD] if v in (0, 4)]
    fwd_knobs += [[0, b, 0, 0, 4] for b in (0, 128, 256)]
    rows = sweep._measure("fused", None, 1024, 2, 4000.0)
    assert timed == calls == fwd_knobs
    assert rows[0]["gbps"] == 4 * 16384 * 1024 * 2 / 0.5 / 1e6  # x, residual, y, pre
    assert [r["staged"] for r in rows] == [k[4] == 2 for k in fwd_knobs]
    assert [r["loop"] for r in rows] == [k[4] == 4 for k in fwd_knobs]
    assert [r["ahead"] for r in rows] == [int(k[4] == 2) for k in fwd_knobs]
    calls.clear(), timed.clear()
    rows = sweep._measure("prenorm_bwd", None, 1024, 2, 4000.0)  # the backward's knobs
    assert timed == calls == bwd_knobs
    assert rows[0]["gbps"] == 5 * 16384 * 1024 * 2 / 0.5 / 1e6  # pre, dy, dpre, dx, dres
    calls.clear()
    assert len(sweep._measure("fwd", None, 1024, 4, 4000.0)) == len(fwd_knobs)
    assert calls == fwd_knobs
    calls.clear()
    sweep._measure("prenorm_bwd", None, 16384, 2, 4000.0)  # fused: never staged
    assert calls == bwd_knobs


def test_sweep_measures_the_fused_kinds_at_their_sizes_and_saves_each_size(monkeypatch):
    # The sweep's outer loop with the GPU parts replaced: which (kind, size) pairs it times,
    # and that each finished size is handed over (the suite's stage timeout keeps those).
    sweep = _sweep_module()
    from fastformer.cli import bench

    monkeypatch.setattr(torch.ops.fastformer, "layer_norm_tuning", lambda t: None, raising=False)
    monkeypatch.setattr(sweep, "_time_ms", lambda fn: 0.5)
    monkeypatch.setattr(sweep, "_calls", lambda cols, dtype: dict.fromkeys(sweep.KINDS))
    monkeypatch.setattr(bench, "rooflines", lambda *a: {"copy_gbps": 4000.0})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU")
    saved = []
    result = sweep.sweep([512, 1024], torch.bfloat16, lambda r: saved.append(len(r["results"])))
    pairs = sorted({(r["kind"], r["cols"]) for r in result["results"]})
    fused = [(k, 1024) for k in ("fused", "prenorm_bwd")]
    assert pairs == sorted([(k, c) for k in ("fwd", "bwd") for c in (512, 1024)] + fused)
    assert saved == [30, 88]  # 21 + 9 timings at 512; 21 + 9 + 21 + 7 more at 1024


@pytest.mark.parametrize("backend", ["cpp", "torch"])
@pytest.mark.parametrize("grad", [False, True])
def test_prenorm_returns_a_new_pre_tensor(monkeypatch, backend, grad):
    # Nothing to add or drop: pre equals x, but is its own tensor on every backend (the torch
    # backend returned x itself), so that writing into it leaves x alone.
    monkeypatch.setenv("FASTFORMER_BACKEND_LAYER_NORM", backend)
    x = _make((3, 8), grad=grad)
    out, pre = ln.dropout_add_layer_norm(x, None, None, None, prenorm=True)
    assert torch.equal(pre, x) and pre.data_ptr() != x.data_ptr()


def _ln_bwd_args(**change):
    """Arguments of torch.ops.fastformer.layer_norm_bwd for a plain (4, 8) forward."""
    x, w, b = torch.randn(4, 8), torch.randn(8), torch.randn(8)
    out, pre, mean, rstd = torch.ops.fastformer.layer_norm_fwd(
        x, w, b, None, rng.NO_SEED, 1e-5, 0.0, False, False
    )
    args = dict(dy=torch.randn(4, 8), dpre=None, x=x, weight=w, bias=b, mean=mean, rstd=rstd,
                seed=rng.NO_SEED, dropout_p=0.0, rms=False, fused=False, has_residual=False,
                need_dweight=True, need_dbias=True)  # fmt: skip
    return list({**args, **change}.values())


@pytest.mark.skipif(extension_error() is not None, reason="fastformer._C not built")
@pytest.mark.parametrize(
    "change, words",
    [
        # an unfused backward never wrote dres: it came back as uninitialized memory
        (dict(has_residual=True), "need fused=True"),
        (dict(dropout_p=0.3), "need fused=True"),
        (dict(dpre=torch.ones(4, 8)), "need fused=True"),
        (dict(dropout_p=1.0, fused=True), "dropout_p must be in [0, 1)"),
        (dict(dropout_p=float("nan"), fused=True), "dropout_p must be in [0, 1)"),
        (dict(rms=True), "takes no bias"),
    ],
)
def test_raw_backward_op_refuses_inconsistent_flags(change, words):
    # torch.ops.fastformer.* are public: called directly, bad flags raise, never a wrong answer.
    with pytest.raises(RuntimeError, match=re.escape(words)):
        torch.ops.fastformer.layer_norm_bwd(*_ln_bwd_args(**change))


@pytest.mark.skipif(extension_error() is not None, reason="fastformer._C not built")
def test_raw_ops_refuse_an_infinite_eps_and_mixed_meta_arguments():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="eps must be finite"):
        torch.ops.fastformer.layer_norm_fwd(x, None, None, None, rng.NO_SEED, math.inf, 0.0,
                                            False, False)  # fmt: skip
    # One meta argument sends the call to the fake kernel, which returned empty CPU tensors.
    with pytest.raises(ValueError, match="weight is on meta"):
        torch.ops.fastformer.layer_norm_fwd(x, torch.empty(8, device="meta"), None, None,
                                            rng.NO_SEED, 1e-5, 0.0, False, False)  # fmt: skip
    with pytest.raises(ValueError, match="dropout_p must be in"):
        torch.ops.fastformer.layer_norm_keep_mask(x, -0.5)
    # The seed too: it was not checked, and the fake's output came back as the result (also
    # through layer_norm_autograd, with a grad_fn).
    meta_seed = rng.NO_SEED.to("meta")
    for op in (torch.ops.fastformer.layer_norm_fwd, torch.ops.fastformer.layer_norm_autograd):
        with pytest.raises(ValueError, match="seed is on meta"):
            op(x, None, None, None, meta_seed, 1e-5, 0.0, False, False)
    with pytest.raises(ValueError, match="layer_norm_bwd: seed is on meta"):
        torch.ops.fastformer.layer_norm_bwd(*_ln_bwd_args(seed=meta_seed))


@pytest.mark.skipif(extension_error() is not None, reason="fastformer._C not built")
@pytest.mark.parametrize("op", ["layer_norm_autograd", "layer_norm"])
def test_zero_rows_with_residual_backward_without_store_pre(op):
    # No pre is written for zero rows: the backward got a (0,) placeholder for the normalized
    # input and refused it ("dy must match x").
    x = torch.randn(0, 8, requires_grad=True)
    args = (x, None, None, torch.randn(0, 8))
    if op == "layer_norm_autograd":
        out = torch.ops.fastformer.layer_norm_autograd(*args, rng.NO_SEED, 1e-5, 0.0, False, False)
    else:
        out = torch.ops.fastformer.layer_norm(*args, 1e-5, 0.0, False, False)
    (grad,) = torch.autograd.grad(out[0].sum(), x)
    assert grad.shape == x.shape


@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_prenorm_pre_requires_grad_only_through_x_or_residual(monkeypatch, backend):
    # pre = residual + dropout(x) does not depend on weight or bias: with only they requiring
    # grad, the C++ node's pre required grad (the reference's does not, and torch raises on a
    # backward from it).
    if backend == "torch":
        monkeypatch.setenv("FASTFORMER_BACKEND_LAYER_NORM", "torch")
    for wants in itertools.product([False, True], repeat=4):
        x, r = _make((4, 8), grad=wants[0]), _make((4, 8), seed=2, grad=wants[1])
        w, b = _make((8,), seed=3, grad=wants[2]), _make((8,), seed=4, grad=wants[3])
        fast = ln.dropout_add_layer_norm(x, r, w, b, prenorm=True)
        slow = ref.dropout_add_layer_norm(x, r, w, b, 1e-5, 0.0, True)
        assert [t.requires_grad for t in fast] == [t.requires_grad for t in slow], wants


def test_torch_backend_rms_norm_reads_eps(monkeypatch):
    # The torch backend's tests used the default eps only: an eps it ignored passed.
    monkeypatch.setenv("FASTFORMER_BACKEND_LAYER_NORM", "torch")
    x, w = torch.randn(4, 8) * 1e-2, torch.randn(8)
    torch.testing.assert_close(
        ln.rms_norm(x, (8,), w, eps=0.1), torch.nn.functional.rms_norm(x, (8,), w, eps=0.1)
    )


@pytest.mark.parametrize(("hidden", "shift"), [(16, 1e4), (64, 1e4), (1000, 1e4), (64, 3e4)])
@pytest.mark.parametrize("fused", [False, True])
def test_layer_norm_gradients_of_offset_rows_match_a_centred_reference(fused, hidden, shift):
    # The kernels' gradients are those of exactly centred xhat (the rounded mean's shift taken
    # out). Against ref.layer_norm(x) the bound would hide an error of that shift: it has the
    # form of the float32 reference's own error (autograd through `x - mean` with a rounded
    # mean). LayerNorm is translation invariant, so the reference normalizes x - x[:, :1] (exact
    # for rows within a factor 2 of their first element): the same function and gradients,
    # with no large mean to round, and a tight bound. Gradients only: `out` keeps the rounded
    # mean's offset, as the float32 reference of x does.
    fast = _plain_or_fused(fused, hidden)

    def centred_reference(x, w, b):
        return ref.layer_norm(x - x.detach()[:, :1], hidden, w, b)

    failed = []
    for seed in range(20):
        x = _make((8, hidden), seed=seed, shift=shift)
        assert torch.equal((x - x[:, :1]).double(), x.double() - x.double()[:, :1])  # exact
        w, b = _params(hidden, "both", seed=seed + 1000)
        results = compare_with_reference(fast, centred_reference, [x, w, b], names="xwb")
        grads = [r for r in results if r.name != "out"]
        assert len(grads) == 3
        failed += [f"seed {seed}: {r}" for r in grads if not r.passed]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("affine", ["none", "weight", "bias"])
@pytest.mark.parametrize(("rows", "hidden"), [(3, 7), (5, 13), (4, 1023)])
def test_layer_norm_low_precision_affine_variants(dtype, affine, rows, hidden):
    # 16-bit rows without weight or bias store through their own path, vector lanes and tail.
    x = _make((rows, hidden), dtype, scale=2.0, shift=1.0)
    w, b = _params(hidden, affine)  # fp32 parameters, or none
    _ln_parity(x, hidden, w, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_fused_out_is_the_layer_norm_of_the_returned_pre(dtype, p):
    # out must be the LayerNorm of pre as returned, rounded to the input dtype: the backward
    # differentiates that. The parity checks cannot see a kernel that normalizes the unrounded
    # sum (it is closer to ref64, which is fed the exact sum). A residual at 64 with a spread of
    # ~1 makes one rounding of pre large against the spread; the reference normalizes
    # pre - pre[:, :1] (exact here: every value within a factor 2 of 64), which keeps ref_lp's
    # own error (a 16-bit mean at 64) out of the bound.
    x = _make((16, 200), dtype, scale=0.7, grad=False)
    res = _make((16, 200), dtype, seed=4, shift=64.0, grad=False)
    w, b = (t.detach() for t in _params(200, "both"))  # fp32 parameters
    torch.manual_seed(3)
    out, pre = ln.dropout_add_layer_norm(x, res, w, b, 1e-5, p, prenorm=True)
    centred = pre - pre[:, :1]
    assert torch.equal(centred.double(), pre.double() - pre[:, :1].double())  # exact
    ref64 = ref.layer_norm(centred.double(), 200, w.double(), b.double())
    ref_lp = ref.layer_norm(centred, 200, w, b).to(dtype)
    assert_parity([parity("out", out, ref64, ref_lp)])


@pytest.mark.parametrize("prenorm", [False, True])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("p", [0.1, 0.3])
def test_dropout_add_layer_norm_float64_matches_reference(prenorm, with_residual, p):
    # float64 runs the C++ kernels too (gradcheck's dtype), where the parity bound is the float64
    # floor: the dropout scale 1 / (1 - p) must be a double (gradcheck cannot see a scale that
    # the forward and backward share).
    x = _make((2, 5, 33), torch.float64, scale=1.5)
    res = _make((2, 5, 33), torch.float64, seed=9) if with_residual else None
    _fused_parity(x, res, *_params(33, "both", torch.float64), p, prenorm)


def _row_regions(rows, cols):
    """Element indices of the scalar head, the aligned groups of four, and the scalar tail of
    each row (row r covers r * cols .. r * cols + cols - 1)."""
    regions = {"head": [], "vector": [], "tail": []}
    for r in range(rows):
        first, end = r * cols, (r + 1) * cols
        aligned = min(end, (first + 3) // 4 * 4)
        groups_end = aligned + (end - aligned) // 4 * 4
        regions["head"] += range(first, aligned)
        regions["vector"] += range(aligned, groups_end)
        regions["tail"] += range(groups_end, end)
    return regions


@pytest.mark.parametrize("where", ["head", "vector", "tail"])
@pytest.mark.parametrize("prenorm", [False, True])
def test_dropout_keeps_an_element_whose_uniform_equals_p(where, prenorm):
    # An element is kept when its uniform >= p; random data hits u == p once in ~2**24
    # elements. Here p is the uniform of one element (a float32, exact as a Python float) in
    # each region of a 7-column row the kernels treat apart: the scalar head, the aligned
    # groups of four, the scalar tail.
    rows, cols = 6, 7
    seed = _seed_of_next_call(123)  # _fused_parity's call draws this seed
    u = rng.element_uniform(seed, torch.arange(rows * cols))
    element = next(e for e in _row_regions(rows, cols)[where] if 0.05 < u[e] < 0.95)
    p = float(u[element])
    assert ln.dropout_add_layer_norm_keep_mask(seed, (rows, cols), p).view(-1)[element]
    x = _make((rows, cols), scale=1.5)
    res = _make((rows, cols), seed=9)
    _fused_parity(x, res, *_params(cols, "both"), p, prenorm)
