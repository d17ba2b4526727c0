"""fastformer.ops.ffn: parity with fastformer.reference.ffn (outputs and every gradient), the
shared Philox dropout, bad inputs, torch.library registration (opcheck, torch.compile), what is
saved for backward, the CUDA epilogue heuristic, and (GPU only) the CUDA kernels."""

from __future__ import annotations

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

import fastformer
from fastformer import reference
from fastformer._ext import load_extension
from fastformer.ops import _dispatch, rng
from fastformer.ops import ffn as ffn_mod
from fastformer.ops.ffn import ffn, ffn_keep_mask, use_fused_epilogue
from fastformer.testing import assert_parity, compare_with_reference

ACTIVATIONS = reference.ACTIVATIONS
GATED = reference.GATED_ACTIVATIONS
NAMES = ["x", "w1", "b1", "w2", "b2"]

# (leading dims of x, d_model, d_ff): tokens 1, 7, 10, 1000; d_model 8..1024; d_ff never a
# multiple of 8 except one (the CUDA kernels' vectorized path).
SHAPES = [((1,), 8, 13), ((7,), 64, 37), ((2, 5), 24, 16), ((1000,), 16, 11), ((3,), 1024, 23)]


def make_inputs(
    lead, d_model, d_ff, activation, dtype=torch.float32, device="cpu", bias=True, seed=0
):
    """x (*lead, d_model), w1, b1, w2, b2 with O(1) activations; all require grad."""
    gen = torch.Generator().manual_seed(seed)
    width = 2 * d_ff if activation in GATED else d_ff

    def rand(*shape, scale=1.0):
        t = torch.randn(*shape, generator=gen, dtype=torch.float64) * scale
        return t.to(dtype=dtype, device=device).requires_grad_()

    x = rand(*lead, d_model)
    w1 = rand(width, d_model, scale=d_model**-0.5)
    w2 = rand(d_model, d_ff, scale=d_ff**-0.5)
    b1 = rand(width, scale=0.5) if bias else None
    b2 = rand(d_model, scale=0.5) if bias else None
    return [x, w1, b1, w2, b2]


def names_of(inputs):
    return [n for n, t in zip(NAMES, inputs) if t is not None]


def _use_backend(monkeypatch, backend: str) -> None:
    if backend != "default":
        monkeypatch.setenv("FASTFORMER_BACKEND_FFN", backend)


def check_parity(inputs, activation, dropout_p=0.0, seed=1234):
    """ffn vs reference.ffn (fed the op's Philox mask when dropout_p > 0), outputs and grads."""
    x = inputs[0]
    d_ff = inputs[3].shape[1]
    torch.manual_seed(seed)
    drawn = rng.draw_seed(x.device) if dropout_p > 0 else 0
    keep = ffn_keep_mask(drawn, x[..., 0].numel(), d_ff, dropout_p, x.device)
    keep = keep.view(*x.shape[:-1], d_ff)

    def fast(*args):
        torch.manual_seed(seed)
        return ffn(*args, activation, dropout_p)

    def ref(*args):
        return reference.ffn(*args, activation, dropout_p, keep_mask=keep)

    assert_parity(compare_with_reference(fast, ref, inputs, names=names_of(inputs)))


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}")
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_parity(shape, activation, dtype):
    check_parity(make_inputs(*shape, activation, dtype), activation)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
def test_parity_without_biases(activation, dtype):
    check_parity(make_inputs((2, 9), 32, 21, activation, dtype, bias=False), activation)


@pytest.mark.parametrize("activation", ["relu", "gelu", "swiglu"])
def test_parity_with_dropout(activation):
    inputs = make_inputs((3, 11), 40, 29, activation)
    check_parity(inputs, activation, dropout_p=0.3)
    check_parity([t.detach().bfloat16().requires_grad_() for t in inputs], activation, 0.1)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_parity_with_dropout_fp64(activation):
    check_parity(make_inputs((5,), 12, 9, activation, torch.float64), activation, dropout_p=0.5)


def test_parity_non_contiguous_x():
    _, w1, b1, w2, b2 = make_inputs((1,), 16, 13, "gelu")
    base = torch.randn(16, 2, 30, dtype=torch.float32)
    x_t = base.permute(1, 2, 0).requires_grad_()  # (2, 30, 16), d_model not innermost in memory
    x_s = torch.randn(40, 32)[::3, ::2].requires_grad_()  # strided rows and columns
    for x in (x_t, x_s):
        assert not x.is_contiguous()
        check_parity([x, w1, b1, w2, b2], "gelu")
        check_parity([x, w1, b1, w2, b2], "gelu", dropout_p=0.2)


def test_rank1_and_empty_x():
    x, w1, b1, w2, b2 = make_inputs((1,), 8, 6, "silu")
    check_parity([x[0].detach().requires_grad_(), w1, b1, w2, b2], "silu")
    empty = torch.empty(0, 8, requires_grad=True)
    out = ffn(empty, w1, b1, w2, b2, "silu", 0.2)
    assert out.shape == (0, 8)
    out.sum().backward()
    assert torch.equal(w1.grad, torch.zeros_like(w1)) and torch.equal(b2.grad, torch.zeros(8))


@pytest.mark.parametrize("backend", ["default", "torch"])
@pytest.mark.parametrize("lead", [(6,), (2, 3)])
def test_output_can_be_changed_in_place(lead, backend, monkeypatch):
    """A residual `out += x` on the output (not a view autograd forbids to modify), with the
    gradients of the out-of-place sum."""
    _use_backend(monkeypatch, backend)
    inputs = make_inputs(lead, 8, 12, "gelu")
    out = ffn(*inputs, "gelu")
    out += inputs[0]
    out.square().sum().backward()
    grads = [t.grad for t in inputs]
    for t in inputs:
        t.grad = None
    (ffn(*inputs, "gelu") + inputs[0]).square().sum().backward()
    for got, t in zip(grads, inputs):
        torch.testing.assert_close(got, t.grad, rtol=0, atol=0)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradcheck_float64(activation):
    inputs = make_inputs((2, 3), 5, 4, activation, torch.float64)

    def fn(*args):
        torch.manual_seed(7)  # the same dropout mask at every evaluation
        return ffn(*args, activation, 0.25)

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_relu_passes_the_gradient_at_nan_as_torch_does(backend, monkeypatch):
    # torch's relu backward zeroes where x <= 0, so a NaN passes its gradient; the kernels
    # tested g > 0 and gave 0 there.
    monkeypatch.setenv("FASTFORMER_BACKEND_FFN", backend)
    x = torch.tensor([[torch.nan], [1.0], [-1.0]], requires_grad=True)
    one = torch.ones(1, 1)
    (dx,) = torch.autograd.grad(ffn(x, one, None, one, None, "relu").sum(), x)
    x_ref = x.detach().clone().requires_grad_()
    (dx_ref,) = torch.autograd.grad(torch.relu(x_ref @ one.t()).sum(), x_ref)
    assert dx_ref.tolist() == [[1.0], [1.0], [0.0]] and torch.equal(dx, dx_ref)
    # With dropout a NaN is saved as NaN where dropped too (NaN * 0): no gradient there.
    x = torch.full((64, 1), torch.nan, requires_grad=True)
    torch.manual_seed(3)
    (dx,) = torch.autograd.grad(ffn(x, one, None, one, None, "relu", 0.5).sum(), x)
    torch.manual_seed(3)
    keep = ffn_keep_mask(rng.draw_seed(), 64, 1, 0.5)
    assert 0 < keep.sum() < 64 and torch.equal(dx, keep.float() * 2.0)


def _exact_gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    # 0.5 x (1 + tanh(u)) as x sigmoid(2u): float64's own 1 + tanh(u) cancels past x = -6.
    u = (2 / torch.pi) ** 0.5 * (x + 0.044715 * x**3)
    return x * torch.sigmoid(2 * u)


def test_gelu_tanh_keeps_its_digits_in_the_left_tail():
    # 1 + tanh(u) and 1 - tanh(u)^2 in float32 lose their digits for negative x: the output was
    # 0 from x = -7.1 to -4.96 and 4x torch's error at x = -3.
    x = torch.linspace(-9, 9, 3601)[:, None].requires_grad_()
    one = torch.ones(1, 1)
    out = ffn(x, one, None, one, None, "gelu_tanh")
    (dx,) = torch.autograd.grad(out.sum(), x)
    x64 = x.detach().double().requires_grad_()
    out64 = _exact_gelu_tanh(x64)
    (dx64,) = torch.autograd.grad(out64.sum(), x64)
    assert ((out - out64).abs() <= 2e-5 * out64.abs()).all()
    assert ((dx - dx64).abs() <= 2e-5 * dx64.abs() + 1e-7).all()  # dx crosses 0 at x = -0.75


# --------------------------------------------------------------------------- dropout


def identity_probe(tokens, d_ff, dropout_p):
    """ffn output that IS the scaled keep-mask: h = 1 everywhere, relu, w2 = identity."""
    x = torch.ones(tokens, 1)
    w1, w2 = torch.ones(d_ff, 1), torch.eye(d_ff)
    return ffn(x, w1, None, w2, None, "relu", dropout_p)


def test_keep_mask_is_the_ops_mask():
    torch.manual_seed(3)
    seed = rng.draw_seed("cpu")
    torch.manual_seed(3)
    out = identity_probe(37, 23, 0.4)
    expected = ffn_keep_mask(seed, 37, 23, 0.4).float() / 0.6
    assert torch.allclose(out, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dropout_p", [0.1, 0.5, 0.9])
def test_keep_rate_binomial(dropout_p):
    tokens, d_ff = 200, 500
    kept = int((identity_probe(tokens, d_ff, dropout_p) > 0).sum())
    n, q = tokens * d_ff, 1.0 - dropout_p
    assert abs(kept - n * q) <= 5 * (n * q * dropout_p) ** 0.5, (kept, n * q)


def test_dropout_reproducible_and_calls_differ():
    inputs = [t.detach() for t in make_inputs((4, 6), 16, 19, "geglu")]
    torch.manual_seed(11)
    first = ffn(*inputs, "geglu", 0.3)
    second = ffn(*inputs, "geglu", 0.3)
    torch.manual_seed(11)
    again = ffn(*inputs, "geglu", 0.3)
    assert torch.equal(first, again)
    assert not torch.equal(first, second)


def test_no_dropout_is_deterministic_and_draws_nothing():
    inputs = [t.detach() for t in make_inputs((5,), 16, 12, "relu")]
    torch.manual_seed(0)
    ffn(*inputs, "relu", 0.0)
    after = torch.rand(1)
    torch.manual_seed(0)
    assert torch.equal(torch.rand(1), after)


def test_backward_regenerates_the_forward_mask():
    inputs = make_inputs((6,), 8, 10, "gelu")
    torch.manual_seed(5)
    out = ffn(*inputs, "gelu", 0.5)
    torch.rand(100)  # RNG traffic between forward and backward must not matter
    (dx,) = torch.autograd.grad(out.sum(), inputs[0])
    torch.manual_seed(5)
    seed = rng.draw_seed("cpu")
    keep = ffn_keep_mask(seed, 6, 10, 0.5)
    ref = reference.ffn(*inputs, "gelu", 0.5, keep_mask=keep)
    (dx_ref,) = torch.autograd.grad(ref.sum(), inputs[0])
    torch.testing.assert_close(dx, dx_ref)


# --------------------------------------------------------------------------- saved tensors


@pytest.mark.parametrize(
    ("activation", "saved_width"), [("relu", 13), ("gelu", 13), ("swiglu", 26)]
)
def test_saves_no_byte_mask(activation, saved_width):
    inputs = make_inputs((7,), 16, 13, activation)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ffn(*inputs, activation, 0.3)
    shapes = sorted(tuple(t.shape) for t in saved)
    # x, w1, w2, the activation (g for relu, else h) -- no bool tensor of any size (the seed
    # is kept as an int). b1 is not saved: it only ties the gradients for create_graph
    # (test_autograd.py), outside save_for_backward's in-place checks.
    expected = [(7, 16), inputs[1].shape, (16, 13), (7, saved_width)]
    assert shapes == sorted(tuple(s) for s in expected)
    assert not any(t.dtype == torch.bool for t in saved)


def test_inference_saves_nothing_large():
    inputs = [t.detach() for t in make_inputs((7,), 16, 13, "gelu")]
    out, saved, _ = ffn_mod._ffn_op(inputs[0], *inputs[1:], "gelu", 0.0, False)
    assert saved.numel() == 0 and out.shape == (7, 16)


# --------------------------------------------------------------------------- bad inputs


_LONG_ONE = np.longdouble(1)


def _bad_cases():
    x, w1, b1, w2, b2 = (t.detach() for t in make_inputs((3,), 8, 6, "relu"))
    ok = dict(x=x, w1=w1, b1=b1, w2=w2, b2=b2, activation="relu", dropout_p=0.1)
    w1g = torch.randn(11, 8)
    return [
        ("x_dim", dict(x=torch.randn(3, 9)), ValueError, r"w1 must have shape \(d_ff, d_model=9\)"),
        ("w1_rank", dict(w1=torch.randn(6, 8, 1)), ValueError, r"w1 must have shape"),
        ("b1", dict(b1=torch.randn(7)), ValueError, r"b1 must have shape \(6,\).*got \(7,\)"),
        ("w2", dict(w2=torch.randn(8, 5)), ValueError, r"w2 must have shape \(d_out, d_ff=6\)"),
        ("b2", dict(b2=torch.randn(2, 8)), ValueError, r"b2 must have shape \(8,\).*got \(2, 8\)"),
        ("gated_odd", dict(w1=w1g, b1=None, activation="swiglu"), ValueError, r"even.*\(11, 8\)"),
        ("activation", dict(activation="tanh"), ValueError, r"one of .*'relu'.*got 'tanh'"),
        ("activation_type", dict(activation=None), TypeError, r"must be a str.*got NoneType$"),
        ("dtype_mix", dict(w2=w2.double()), TypeError, r"w2 has dtype torch.float64 but x"),
        ("device_mix", dict(b1=b1.to("meta")), ValueError, r"b1 is on meta but x is on cpu"),
        ("p_one", dict(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\), got 1.0"),
        ("p_negative", dict(dropout_p=-0.1), ValueError, r"dropout_p must be in \[0, 1\)"),
        ("p_type", dict(dropout_p="0.1"), TypeError, r"dropout_p must be a float, got str"),
        ("x_scalar", dict(x=torch.tensor(1.0)), ValueError, r"at least 1 dimension"),
        ("x_int", dict(x=torch.ones(3, 8, dtype=torch.int64)), TypeError, r"floating dtype"),
        ("b1_type", dict(b1=[0.0] * 6), TypeError, r"b1 must be a Tensor or None, got list"),
        ("x_type", dict(x=[[0.0] * 8] * 3), TypeError, r"x must be a Tensor, got list"),
        # b2 and w2 go through the checks of w1 and b1: dtype, device, None, rank
        ("b2_dtype", dict(b2=b2.double()), TypeError, r"b2 has dtype torch.float64 but x"),
        ("b2_device", dict(b2=b2.to("meta")), ValueError, r"b2 is on meta but x is on cpu"),
        ("w2_none", dict(w2=None), TypeError, r"w2 must be a Tensor, got NoneType$"),
        (
            "w2_rank",
            dict(w2=torch.randn(8, 1, 6)),
            ValueError,
            r"w2 must have shape \(d_out, d_ff=6\)",
        ),
        # sparse and nested tensors failed inside torch without naming the argument
        ("x_sparse", dict(x=x.to_sparse()), ValueError, r"x must be a dense .*sparse_coo"),
        ("w1_sparse", dict(w1=w1.to_sparse()), ValueError, r"w1 must be a dense"),
        ("x_nested", dict(x=torch.nested.as_nested_tensor([x, x[:2]])), ValueError, r"nested"),
        # below 1 as a numpy.longdouble, 1.0 as a float: refused by C++, ZeroDivisionError in torch
        ("p_rounds_to_one", dict(dropout_p=_LONG_ONE - _LONG_ONE / 2**60), ValueError, r"\[0, 1\)"),
    ], ok


BAD_CASES, OK_ARGS = _bad_cases()


@pytest.mark.parametrize(
    ("change", "error", "match"), [c[1:] for c in BAD_CASES], ids=[c[0] for c in BAD_CASES]
)
def test_bad_inputs_raise_before_any_work(change, error, match, monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("the op ran on bad inputs")

    # The checked path reaches the kernels through _forward or the C++ autograd op; the eager
    # entry returns None without running anything for a call it does not take.
    monkeypatch.setattr(ffn_mod, "_ffn_op", must_not_run)
    monkeypatch.setattr(ffn_mod, "_forward", must_not_run)
    entry = ffn_mod._EAGER
    if entry is not None:
        monkeypatch.setattr(ffn_mod, "_EAGER", lambda *a: entry(*a) and must_not_run())
    args = {**OK_ARGS, **change}
    with pytest.raises(error, match=f"^ffn: .*{match}"):
        ffn(**args)


def test_drawn_keep_mask_op_names_itself_for_a_negative_d_ff():
    with pytest.raises(ValueError, match="^ffn_drawn_keep_mask: d_ff must be >= 0, got -1$"):
        torch.ops.fastformer.ffn_drawn_keep_mask(torch.zeros(3, 8), -1, 0.1)
    with pytest.raises(ValueError, match="^ffn_drawn_keep_mask: x must have at least 1 dim"):
        torch.ops.fastformer.ffn_drawn_keep_mask(torch.tensor(1.0), 4, 0.1)


_KEEP_MASK_BAD = [  # (seed, tokens, d_ff, dropout_p), error, message after "ffn_keep_mask: "
    ((1, 3, 6, 1.5), ValueError, r"dropout_p must be in \[0, 1\), got 1.5"),  # was all False
    ((1, 3, 6, -1.0), ValueError, r"dropout_p must be in \[0, 1\), got -1.0"),  # was all True
    ((1, 3, 6, 0.99999), ValueError, r"dropout_p must be at most 0.999911"),
    ((1, 3, 6, "0.1"), TypeError, r"dropout_p must be a float, got str"),
    ((1, -1, 6, 0.1), ValueError, r"tokens must be an int >= 0, got -1"),
    ((1, 3.0, 6, 0.1), ValueError, r"tokens must be an int >= 0, got 3.0"),
    ((1, 3, -6, 0.1), ValueError, r"d_ff must be an int >= 0, got -6"),
    ((1.5, 3, 6, 0.1), TypeError, r"seed must be an int, got float"),
    ((True, 3, 6, 0.1), TypeError, r"seed must be an int, got bool"),
    ((-1, 3, 6, 0.1), ValueError, r"seed must be in \[0, 2\*\*64\), got -1"),
]


@pytest.mark.parametrize(("args", "error", "match"), _KEEP_MASK_BAD)
def test_keep_mask_checks_its_arguments_before_any_work(args, error, match, keep_mask_never_built):
    with pytest.raises(error, match=f"^ffn_keep_mask: {match}"):
        ffn_keep_mask(*args)


def test_keep_mask_takes_what_the_op_passes():
    # numpy scalars and empty sizes, as before the checks
    assert ffn_keep_mask(1, 0, 6, np.float32(0.5)).shape == (0, 6)
    assert torch.equal(ffn_keep_mask(2**64 - 1, 3, 0, 0.3), torch.ones(3, 0, dtype=torch.bool))
    assert torch.equal(ffn_keep_mask(7, 5, 4, np.float64(0.25)), ffn_keep_mask(7, 5, 4, 0.25))


def test_compiled_kernels_reject_bad_calls():
    x, w1, b1, w2, b2 = (t.detach() for t in make_inputs((3,), 8, 6, "relu"))
    with pytest.raises(RuntimeError, match=r"w2 must be \(d_out, 6\)"):
        torch.ops.fastformer.ffn_forward(x, w1, b1, w2.t(), b2, "relu", 0.0, 0)
    with pytest.raises(RuntimeError, match="activation must be one of"):
        torch.ops.fastformer.ffn_forward(x, w1, b1, w2, b2, "tanh", 0.0, 0)
    with pytest.raises(RuntimeError, match=r"saved must be \[3, 6\]"):
        torch.ops.fastformer.ffn_backward(x, x, w1, w2, torch.zeros(3, 7), "relu", 0.0, 0)


@pytest.mark.parametrize("lead", [(5,), (2, 3), (2, 1, 3)])
def test_compiled_ops_take_any_leading_dims(lead):
    """(..., d_model) in, (..., d_out) out (not a view), the same bits as the (tokens, d_model)
    call; the backward likewise."""
    x, w1, b1, w2, b2 = (t.detach() for t in make_inputs(lead, 8, 6, "gelu"))
    flat = x.reshape(-1, 8)
    out, saved = torch.ops.fastformer.ffn_forward(x, w1, b1, w2, b2, "gelu", 0.2, 7)
    out2, saved2 = torch.ops.fastformer.ffn_forward(flat, w1, b1, w2, b2, "gelu", 0.2, 7)
    assert out.shape == (*lead, 8)
    assert not out._is_view() and torch.equal(out.reshape(-1, 8), out2)
    assert torch.equal(saved, saved2)
    grad = torch.randn(out.shape)
    grads = torch.ops.fastformer.ffn_backward(grad, x, w1, w2, saved, "gelu", 0.2, 7)
    flat_grads = torch.ops.fastformer.ffn_backward(
        grad.reshape(-1, 8), flat, w1, w2, saved, "gelu", 0.2, 7
    )
    assert grads[0].shape == x.shape and torch.equal(grads[0].reshape(-1, 8), flat_grads[0])
    for got, want in zip(grads[1:], flat_grads[1:]):
        assert torch.equal(got, want)


# --------------------------------------------------------------------------- registration


@pytest.mark.parametrize("backend", ["default", "torch"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_autocast_does_not_reach_the_ops_gemms(dropout_p, backend, monkeypatch):
    # The ops compute in their inputs' dtype whether or not autocast is on, as their fakes say;
    # before, the C++ ops' own at::mm calls were autocast to bfloat16 and the float32 passes
    # after them raised, and the torch backend computed in bfloat16 and returned it.
    _use_backend(monkeypatch, backend)
    x, w1, b1, w2, b2 = make_inputs((5,), 8, 12, "gelu")
    results = []
    for autocast in (False, True):
        torch.manual_seed(3)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = ffn(x, w1, b1, w2, b2, "gelu", dropout_p)
            grads = torch.autograd.grad(out.square().sum(), (x, w1, b1, w2, b2))
        results.append((out, *grads))
    assert results[1][0].dtype == torch.float32
    for plain, autocast in zip(*results):
        torch.testing.assert_close(autocast, plain, rtol=0, atol=0)


def test_ops_registered():
    for name in ("ffn_forward", "ffn_backward"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fastformer::{name}", "CPU")
        if fastformer.cuda_kernels_compiled():
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fastformer::{name}", "CUDA")
    assert _dispatch.explain("ffn") == [("cpp", []), ("torch", [])]


def test_backend_reasons():
    cpu = ffn_mod.FfnInputs(torch.device("cpu"), torch.float64)
    assert ffn_mod._cpp_reasons(cpu) == []
    meta = ffn_mod.FfnInputs(torch.device("meta"), torch.float32)
    assert "CPU and CUDA" in ffn_mod._cpp_reasons(meta)[0]
    cuda64 = ffn_mod.FfnInputs(torch.device("cuda", 0), torch.float64)
    reason = ffn_mod._cpp_reasons(cuda64)
    assert reason and ("float64" in reason[0] or "without CUDA" in reason[0])
    assert _dispatch.select("ffn", meta) == "torch"


@pytest.mark.parametrize("activation", ["relu", "gelu_tanh", "geglu"])
def test_torch_backend_matches_reference_and_cpp(activation, monkeypatch):
    inputs = make_inputs((2, 6), 16, 14, activation)
    monkeypatch.setenv("FASTFORMER_BACKEND_FFN", "torch")
    check_parity(inputs, activation, dropout_p=0.3)
    torch.manual_seed(2)
    via_torch = ffn(*inputs, activation, 0.3)
    monkeypatch.setenv("FASTFORMER_BACKEND_FFN", "cpp")
    torch.manual_seed(2)
    via_cpp = ffn(*inputs, activation, 0.3)
    torch.testing.assert_close(via_cpp, via_torch)


def test_opcheck():
    x, w1, b1, w2, b2 = make_inputs((6,), 8, 5, "swiglu")
    x = x.detach().requires_grad_()
    op = torch.ops.fastformer.ffn.default
    torch.library.opcheck(op, (x, w1, b1, w2, b2, "swiglu", 0.0, True))
    plain = [t.detach() for t in (x, w1, b1, w2, b2)]
    torch.library.opcheck(op, (plain[0], plain[1][:5], None, plain[3], None, "relu", 0.0, False))
    out, saved = torch.ops.fastformer.ffn_forward(*plain, "swiglu", 0.4, 99)
    seed = torch.tensor(99)
    grad_out = torch.randn_like(out)
    torch.library.opcheck(torch.ops.fastformer.ffn_forward.default, (*plain, "swiglu", 0.4, 99))
    # an epilogue asked for on CPU runs unfused there: the fake must say it saves h
    gelu = (plain[0], plain[1][:5], plain[2][:5], plain[3], plain[4], "gelu_tanh", 0.0, 3, True)
    torch.library.opcheck(torch.ops.fastformer.ffn_forward.default, gelu)
    # the keep-mask of compiled torch.func transforms (p = 0: every draw keeps all)
    drawn = torch.ops.fastformer.ffn_drawn_keep_mask.default
    torch.library.opcheck(drawn, (x.detach().view(-1, 2, x.shape[-1]), 7, 0.0))
    torch.library.opcheck(
        torch.ops.fastformer.ffn_backward.default,
        (grad_out, plain[0], plain[1], plain[3], saved, "swiglu", 0.4, 99),
    )
    torch.library.opcheck(
        torch.ops.fastformer.ffn_grad.default,
        (grad_out, plain[0], plain[1], plain[3], saved, seed, "swiglu", 0.4),
    )
    eager = torch.ops.fastformer.ffn_autograd.default  # the eager path's C++ autograd
    x3 = make_inputs((2, 3), 8, 5, "gelu")[0].transpose(0, 1)  # rank 3, not contiguous
    torch.library.opcheck(eager, (x3, w1[:5], None, w2, b2, "gelu", 0.4, 99))
    torch.library.opcheck(eager, (x, w1, b1, w2, None, "swiglu", 0.0, 0))
    with torch.inference_mode():  # below autograd: the forward kernel alone
        assert torch.equal(eager(*plain, "swiglu", 0.4, 99), out)


@pytest.mark.parametrize(("activation", "dropout_p"), [("swiglu", 0.2), ("relu", 0.0)])
def test_torch_compile_fullgraph_matches_eager(activation, dropout_p):
    inputs = make_inputs((3, 5), 16, 13, activation)

    def fn(*args):
        return ffn(*args, activation, dropout_p)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    results = []
    for f in (fn, compiled):
        torch.manual_seed(21)
        out = f(*inputs)
        results.append((out, torch.autograd.grad(out.square().sum(), inputs)))
    (out_e, grads_e), (out_c, grads_c) = results
    assert torch.equal(out_e, out_c)
    for g_e, g_c in zip(grads_e, grads_c):
        assert torch.equal(g_e, g_c)
    with torch.no_grad():  # the inference path (nothing saved) compiles too
        torch.manual_seed(21)
        assert torch.equal(compiled(*inputs), out_e)


# --------------------------------------------------------------------------- CUDA epilogue


def test_epilogue_heuristic():
    h100, a100 = (9, 0), (8, 0)
    assert use_fused_epilogue("relu", h100, True) and use_fused_epilogue("relu", a100, True)
    assert not use_fused_epilogue("gelu_tanh", h100, False)  # slower on sm_90
    assert use_fused_epilogue("gelu_tanh", a100, False)
    assert not use_fused_epilogue("gelu_tanh", a100, True)  # backward needs the pre-activation
    assert use_fused_epilogue("gelu_tanh", h100, False, mode="fused")
    assert not use_fused_epilogue("gelu_tanh", h100, True, mode="fused")
    assert not use_fused_epilogue("relu", h100, True, mode="unfused")
    for activation in ("gelu", "silu", "swiglu", "geglu"):
        assert not use_fused_epilogue(activation, a100, False, mode="fused")
    with pytest.raises(ValueError, match="mode must be one of"):
        use_fused_epilogue("relu", h100, True, mode="always")
    # an unknown activation is an error, as in ffn, not "no epilogue"
    with pytest.raises(ValueError, match=r"^use_fused_epilogue: activation must be one of .*"):
        use_fused_epilogue("bogus", h100, False)
    with pytest.raises(TypeError, match=r"^use_fused_epilogue: activation must be a str.*None"):
        use_fused_epilogue(None, h100, False)


def test_epilogue_env(monkeypatch):
    monkeypatch.delenv(ffn_mod.EPILOGUE_ENV, raising=False)
    assert ffn_mod.epilogue_mode() == "auto"
    monkeypatch.setenv(ffn_mod.EPILOGUE_ENV, "Unfused")
    assert ffn_mod.epilogue_mode() == "unfused"
    monkeypatch.setenv(ffn_mod.EPILOGUE_ENV, " fused\n")  # as a shell or a .env file may set it
    assert ffn_mod.epilogue_mode() == "fused"
    monkeypatch.setenv(ffn_mod.EPILOGUE_ENV, "")  # set but empty: the default
    assert ffn_mod.epilogue_mode() == "auto"
    monkeypatch.setenv(ffn_mod.EPILOGUE_ENV, "yes")
    with pytest.raises(ValueError, match="FASTFORMER_FFN_EPILOGUE must be one of"):
        ffn_mod.epilogue_mode()
    with pytest.raises(ValueError, match="mode must be one of"):  # the direct argument too
        ffn_mod.use_fused_epilogue("relu", (9, 0), needs_grad=False, mode="yes")


@needs_ext
def test_drelu_env(monkeypatch):
    # Parsed by the extension (the CUDA backward reads it there); ffn.drelu_mode asks the same.
    monkeypatch.delenv(ffn_mod.DRELU_ENV, raising=False)
    assert ffn_mod.drelu_mode() == "kernel"
    for raw, mode in ((" Epilogue\n", "epilogue"), ("KERNEL", "kernel"), ("", "kernel")):
        monkeypatch.setenv(ffn_mod.DRELU_ENV, raw)
        assert ffn_mod.drelu_mode() == mode
    monkeypatch.setenv(ffn_mod.DRELU_ENV, "fused")
    with pytest.raises(ValueError, match="FASTFORMER_FFN_DRELU must be one of .*got 'fused'"):
        ffn_mod.drelu_mode()


# --------------------------------------------------------------------------- CUDA (GPU only)

CUDA_SHAPES = [((1,), 8, 13), ((7,), 64, 64), ((3, 129), 96, 40), ((1000,), 256, 1000)]


@pytest.mark.cuda
@pytest.mark.parametrize("epilogue", ["fused", "unfused"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"]
)
def test_cuda_parity(epilogue, activation, dtype, monkeypatch):
    monkeypatch.setenv(ffn_mod.EPILOGUE_ENV, epilogue)
    for shape in CUDA_SHAPES:
        inputs = make_inputs(*shape, activation, dtype, device="cuda")
        check_parity(inputs, activation)
        check_parity(inputs, activation, dropout_p=0.2)
        without_bias = make_inputs(*shape, activation, dtype, device="cuda", bias=False)
        check_parity(without_bias, activation, dropout_p=0.1)


@pytest.mark.cuda
@pytest.mark.parametrize("epilogue", ["fused", "unfused"])
@pytest.mark.parametrize("activation", ["relu", "gelu_tanh"])
def test_cuda_inference_epilogue(epilogue, activation, monkeypatch):
    monkeypatch.setenv(ffn_mod.EPILOGUE_ENV, epilogue)
    inputs = [t.detach() for t in make_inputs((300,), 128, 512, activation, torch.bfloat16, "cuda")]
    for p in (0.0, 0.3):
        torch.manual_seed(4)
        seed = rng.draw_seed("cuda")
        torch.manual_seed(4)
        with torch.no_grad():
            out = ffn(*inputs, activation, p)
        keep = ffn_keep_mask(seed, 300, 512, p, "cuda")
        args64 = [t.double() for t in inputs]
        ref64 = reference.ffn(*args64, activation, p, keep_mask=keep)
        ref_lp = reference.ffn(*inputs, activation, p, keep_mask=keep)
        bound = 2 * (ref_lp.double() - ref64).abs().max() + 1e-2
        assert (out.double() - ref64).abs().max() <= bound


@pytest.mark.cuda
def test_cuda_mask_equals_cpu_mask():
    torch.manual_seed(8)
    seed = rng.draw_seed("cuda")
    torch.manual_seed(8)
    x = torch.ones(333, 1, device="cuda")
    w1, w2 = torch.ones(77, 1, device="cuda"), torch.eye(77, device="cuda")
    out = ffn(x, w1, None, w2, None, "relu", 0.35)
    assert torch.equal((out > 0).cpu(), ffn_keep_mask(seed, 333, 77, 0.35))


@pytest.mark.cuda
def test_cuda_bias_grad_deterministic_and_many_rows():
    # 530k rows: more than the forward grid's 65535 x 8 rows per pass, and many row blocks.
    inputs = make_inputs((530_000,), 8, 16, "gelu", torch.bfloat16, "cuda")
    grads = []
    for _ in range(2):
        torch.manual_seed(0)
        out = ffn(*inputs, "gelu", 0.1)
        grads.append(torch.autograd.grad(out.float().sum(), inputs[2]))
    assert torch.equal(grads[0][0], grads[1][0])
    check_parity(make_inputs((530_000,), 8, 16, "swiglu", torch.float32, "cuda"), "swiglu", 0.1)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "activation, drelu",
    [("relu", "kernel"), ("relu", "epilogue"), ("gelu", "kernel"), ("silu", "kernel")],
)
def test_cuda_backward_peak_memory_at_most_eager(activation, drelu, monkeypatch):
    """The peak of forward + backward against eager Linear, activation, Linear on the same
    inputs. A non-gated backward writes dh over linear2's dgrad, so it never holds more than
    eager autograd does; relu, which saves only its output, holds one (tokens, d_ff) tensor less
    (half of one is asked), its DRELU epilogue path too (dh written by the GEMM, the bitmask
    freed before the weight gradients). Slack of 1/8 of one: the bias gradients' fp32 partials,
    the weight gradients."""
    monkeypatch.setenv(ffn_mod.DRELU_ENV, drelu)
    tokens, d_model, d_ff = 32768, 256, 4096
    inputs = make_inputs((tokens,), d_model, d_ff, activation, torch.bfloat16, "cuda")
    grad = torch.ones(tokens, d_model, dtype=torch.bfloat16, device="cuda")
    act = {"relu": torch.relu, "gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu}
    linear = torch.nn.functional.linear

    def eager(x, w1, b1, w2, b2):
        return linear(act[activation](linear(x, w1, b1)), w2, b2)

    def fast(*args):
        return ffn(*args, activation)

    def peak(fn) -> int:
        for _ in range(2):  # the first call allocates cuBLAS(Lt) workspaces, kept afterwards
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            torch.autograd.grad(fn(*inputs), inputs, grad)
            torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    activation_bytes = tokens * d_ff * 2
    fast_peak, eager_peak = peak(fast), peak(eager)
    allowed = eager_peak - activation_bytes // 2 if activation == "relu" else eager_peak
    assert fast_peak <= allowed + activation_bytes // 8, (fast_peak, eager_peak)


def _cuda_kernels(fn) -> set[str]:
    """Names of the CUDA kernels fn launches."""
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_drelu_epilogue_parity(dtype, monkeypatch):
    """FASTFORMER_FFN_DRELU=epilogue: dh and db1 from cuBLASLt's DRELU_BGRAD epilogue against the
    reference, with and without dropout and biases; where it cannot run (d_ff 13: no 16-byte
    aligned columns) the kernel path answers. It does run at the aligned shapes: its bitmask
    kernel launches and the elementwise backward does not (no silent fallback)."""
    monkeypatch.setenv(ffn_mod.DRELU_ENV, "epilogue")
    for shape in CUDA_SHAPES + [((2048,), 512, 2048)]:
        inputs = make_inputs(*shape, "relu", dtype, device="cuda")
        check_parity(inputs, "relu")
        check_parity(inputs, "relu", dropout_p=0.2)
        without_bias = make_inputs(*shape, "relu", dtype, device="cuda", bias=False)
        check_parity(without_bias, "relu", dropout_p=0.1)
    for p in (0.0, 0.2):
        names = _cuda_kernels(
            lambda p=p: torch.autograd.grad(ffn(*inputs, "relu", p).sum(), inputs)
        )
        assert any("ffn_relu_mask_kernel" in n for n in names), names
        assert not any("ffn_backward_kernel" in n for n in names), names


@pytest.mark.cuda
def test_cuda_relu_mask_layout_is_cublaslt_s():
    """The bitmask kernel's layout (ffn.h) against cuBLASLt's own RELU_AUX bitmask of a small
    GEMM, every bit below d_ff: what the DRELU path checks before it runs on a device. On a
    mismatch both are printed as hex words, what a fix of the layout needs."""
    sample = load_extension().ffn_relu_mask_layout_sample()
    assert sample is not None, "cuBLASLt has no RELU_AUX algorithm for the sample GEMM"
    theirs, ours, d_ff = sample

    def bits(words: torch.Tensor) -> torch.Tensor:
        return ((words.long().unsqueeze(-1) >> torch.arange(32)) & 1).flatten(1)[:, :d_ff]

    def hexes(words: torch.Tensor) -> list[list[str]]:
        return [[f"{v & 0xFFFFFFFF:08x}" for v in row] for row in words.tolist()]

    assert torch.equal(bits(theirs), bits(ours)), f"cuBLASLt {hexes(theirs)}\nours {hexes(ours)}"
    assert 0 < int(bits(ours).sum()) < bits(ours).numel()  # mixed signs


@pytest.mark.cuda
def test_cuda_drelu_epilogue_is_deterministic_and_captures(monkeypatch):
    """Two backward passes through the DRELU_BGRAD epilogue give the same bits (db1 is a
    reduction cuBLASLt chooses), and a CUDA graph replays them: the layout check ran outside
    capture, in the eager step, and the captured step takes the same path."""
    monkeypatch.setenv(ffn_mod.DRELU_ENV, "epilogue")
    inputs = make_inputs((4096,), 256, 1024, "relu", torch.bfloat16, "cuda")

    def step():
        return torch.autograd.grad(ffn(*inputs, "relu").float().square().sum(), inputs)

    eager = [step(), step()]
    assert all(torch.equal(a, b) for a, b in zip(*eager))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(eager[0], captured))


@pytest.mark.parametrize("backend", ["default", "torch"])
@pytest.mark.parametrize("grad", [False, True])
def test_zero_features_in_a_rank_3_input(backend, grad, monkeypatch):
    # reshape(-1, 0) cannot tell the rows of an empty last dim: the leading dims' product can.
    _use_backend(monkeypatch, backend)
    x, w1, b1 = torch.randn(2, 3, 0), torch.randn(16, 0), torch.randn(16)
    w2, b2 = torch.randn(8, 16), torch.randn(8)
    got = ffn(x, w1, b1.requires_grad_(grad), w2, b2, "gelu")
    torch.testing.assert_close(got, reference.ffn(x, w1, b1, w2, b2, "gelu"))
    assert got.shape == (2, 3, 8)


def test_raw_grad_op_refuses_a_seed_that_is_not_int64():
    # rng.saved_seed read a float seed tensor with int() (1.5 -> 1) instead of refusing it.
    x, w1, w2 = torch.randn(4, 8), torch.randn(16, 8), torch.randn(8, 16)
    out, saved, seed = torch.ops.fastformer.ffn(x, w1, None, w2, None, "relu", 0.1, True)
    with pytest.raises(TypeError, match="seed must be a 0-dim int64 tensor"):
        torch.ops.fastformer.ffn_grad(torch.ones_like(out), x, w1, w2, saved, seed.float(),
                                      "relu", 0.1)  # fmt: skip
    # One meta argument among CPU ones reached the fake kernel, which returned CPU tensors.
    with pytest.raises(ValueError, match="w1 is on meta"):
        torch.ops.fastformer.ffn(x, w1.to("meta"), None, w2, None, "relu", 0.0, False)
    # And a seed: neither the saved seed nor the compiled kernels' device_seed was checked.
    with pytest.raises(ValueError, match="ffn_grad: seed is on meta"):
        torch.ops.fastformer.ffn_grad(torch.ones_like(out), x, w1, w2, saved, seed.to("meta"),
                                      "relu", 0.1)  # fmt: skip
    meta_seed = seed.to("meta")
    with pytest.raises(ValueError, match="ffn_forward: device_seed is on meta"):
        torch.ops.fastformer.ffn_forward(x, w1, None, w2, None, "relu", 0.0, 1, False, meta_seed)
    with pytest.raises(ValueError, match="ffn_backward: device_seed is on meta"):
        torch.ops.fastformer.ffn_backward(torch.ones_like(out), x, w1, w2, saved, "relu", 0.1, 1,
                                          meta_seed)  # fmt: skip


def test_raw_op_without_needs_grad_refuses_a_backward():
    x, w1, w2 = torch.randn(4, 8, requires_grad=True), torch.randn(16, 8), torch.randn(8, 16)
    out = torch.ops.fastformer.ffn(x, w1, None, w2, None, "gelu", 0.0, False)[0]
    with pytest.raises(RuntimeError, match="ran with needs_grad=False, so it saved nothing"):
        out.sum().backward()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("backend", ["default", "torch"])
def test_gradient_of_each_input_alone(name, backend, monkeypatch):
    # Only one input requires grad (a frozen model's bias, say): it must still get its gradient
    _use_backend(monkeypatch, backend)
    i = NAMES.index(name)
    inputs = [t.detach() for t in make_inputs((2, 3), 8, 6, "relu")]
    inputs[i].requires_grad_()
    grad_out = torch.randn(2, 3, 8)
    out = ffn(*inputs, "relu")
    assert "FfnFunction" in out.grad_fn.name()  # the op's one node, not the GEMMs' own
    (got,) = torch.autograd.grad(out, inputs[i], grad_out)
    (want,) = torch.autograd.grad(reference.ffn(*inputs, "relu"), inputs[i], grad_out)
    torch.testing.assert_close(got, want)


def test_cuda_path_asks_for_the_epilogue_with_its_grad_mode(monkeypatch, fake_cuda):
    # The eager autograd path needs the pre-activation: gelu_tanh's epilogue (which does not
    # write it) only without gradients. Fake CUDA tensors run the op's fakes: no GPU needed.
    asked = []

    def spy(activation, capability, needs_grad, mode="auto"):
        asked.append((activation, capability, needs_grad))
        return use_fused_epilogue(activation, capability, needs_grad, mode)

    monkeypatch.setattr(ffn_mod, "use_fused_epilogue", spy)
    monkeypatch.setattr(ffn_mod, "cuda_kernels_compiled", lambda: True)
    monkeypatch.setattr(ffn_mod, "_CAPABILITY", {})
    monkeypatch.setattr(_dispatch, "_CHOICES", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    x, w1, w2 = fake_cuda(4, 8, requires_grad=True), fake_cuda(6, 8), fake_cuda(8, 6)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            assert ffn(x, w1, None, w2, None, "gelu_tanh").requires_grad == grad
    assert asked == [("gelu_tanh", (8, 0), True), ("gelu_tanh", (8, 0), False)]


def test_cpp_backend_names_a_build_without_the_ffn_kernels(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(ffn_mod, "extension_error", lambda: None)
    monkeypatch.setattr(torch.ops, "fastformer", SimpleNamespace())
    assert ffn_mod._cpp_reasons(None) == [
        "fastformer._C was built without csrc/ffn; rebuild it (make build)"
    ]


def test_backend_choice_is_remembered_per_dtype(monkeypatch, fake_cuda):
    # On CUDA the compiled kernels take no float64: a choice cached per device alone gave a
    # float64 call the kernels' backend after a float32 call (fake CUDA tensors: no GPU needed).
    monkeypatch.setattr(ffn_mod, "cuda_kernels_compiled", lambda: True)
    monkeypatch.setattr(_dispatch, "_CHOICES", {})
    xs = [fake_cuda(2, 8, dtype=dtype) for dtype in (torch.float32, torch.float64)]
    assert [ffn_mod._backend(x) for x in xs] == ["cpp", "torch"]


def test_a_device_seed_goes_where_the_compiled_ops_read_it():
    # Inside CUDA graph capture the seed is a device tensor: the ops take it as device_seed,
    # with 0 for the host seed (which they then ignore)
    device_seed = torch.tensor([7])
    for op, extra in (
        (torch.ops.fastformer.ffn_forward, (True,)),
        (torch.ops.fastformer.ffn_backward, ()),
    ):
        names = [a.name for a in op.default._schema.arguments]
        from_seed = names[names.index("seed") :]
        args = dict(zip(from_seed, ffn_mod._op_seed(device_seed, *extra)))
        assert args["seed"] == 0 and args["device_seed"] is device_seed
        assert dict(zip(from_seed, ffn_mod._op_seed(5, *extra)))["seed"] == 5


def test_torch_backend_refuses_a_seed_drawn_inside_graph_capture(monkeypatch):
    monkeypatch.setenv("FASTFORMER_BACKEND_FFN", "torch")
    monkeypatch.setattr(rng, "call_seed", lambda device, p: torch.tensor([7]))
    inputs = [t.detach() for t in make_inputs((3,), 8, 6, "gelu")]
    with pytest.raises(RuntimeError, match="inside CUDA graph capture runs only on its compiled"):
        ffn(*inputs, "gelu", 0.2)


def test_compiled_inference_saves_nothing(monkeypatch):
    needs = []
    forward = ffn_mod._forward

    def spy(*args, **kwargs):
        needs.append(args[7])
        return forward(*args, **kwargs)

    monkeypatch.setattr(ffn_mod, "_forward", spy)
    inputs = make_inputs((3,), 8, 6, "gelu")
    compiled = torch.compile(lambda *a: ffn(*a, "gelu"), fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        compiled(*inputs)
    compiled(*inputs)
    assert needs == [False, True]


def test_raw_forward_op_refuses_integer_inputs_before_its_gemm():
    # It raised NotImplementedError from inside a kernel ("ffn_cpu" not implemented for 'Long').
    x, w1, w2 = (torch.ones(*s, dtype=torch.long) for s in ((4, 8), (16, 8), (8, 16)))
    with pytest.raises(RuntimeError, match="ffn: x must be a floating dtype, got Long"):
        torch.ops.fastformer.ffn_forward(x, w1, None, w2, None, "relu", 0.0, 0)


def test_backend_reasons_refuses_what_ffn_refuses():
    # It answered "cpp runs" for an int64 x, which ffn refuses.
    with pytest.raises(TypeError, match="backend_reasons: x must have a floating dtype"):
        ffn_mod.backend_reasons(torch.zeros(2, 4, dtype=torch.int64))
    assert [name for name, why in ffn_mod.backend_reasons(torch.zeros(2, 4)) if not why]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_parity_with_d_ff_past_the_cpu_chunk(activation, dropout_p):
    # The CPU pass takes a row of h in chunks of 256 columns: d_ff 300 runs a full chunk and a
    # ragged one, each reading its own columns of both gated halves.
    check_parity(make_inputs((2, 3), 16, 300, activation), activation, dropout_p)


@pytest.mark.parametrize("activation", ["relu", "gelu", "silu"])
def test_bfloat16_infinity_passes_as_in_torch(activation):
    # torch's bfloat16 relu / gelu / silu pass +inf through, and linear2 of it with positive
    # weights is +inf: the CPU pass's bfloat16 rounding must keep an infinity one, not a NaN.
    # Forward only (gradients through an infinity are NaN in the reference too).
    x = torch.tensor([[float("inf")], [1.0], [-2.0]], dtype=torch.bfloat16)
    w1 = torch.ones(4, 1, dtype=torch.bfloat16)
    w2 = torch.full((2, 4), 0.5, dtype=torch.bfloat16)
    inputs = [x, w1, None, w2, None]
    results = compare_with_reference(
        lambda *a: ffn(*a, activation), lambda *a: reference.ffn(*a, activation), inputs
    )
    assert_parity(results)
    assert torch.equal(ffn(*inputs, activation)[0], torch.full((2,), float("inf")).bfloat16())


def test_gelu_tanh_derivative_keeps_its_digits_in_the_right_tail():
    # The gate's derivative takes e * s where e = exp(-2u) <= 1 rather than 1 - s, which loses
    # digits as s -> 1 (relative error 2e-6 against 1.5e-7, measured on the CI VM; torch's own
    # float32 error there is 1e-6). Below the parity rule's floor, so a bound of its own, as the
    # left-tail test's.
    x = torch.linspace(0, 9, 3601)[:, None].requires_grad_()
    one = torch.ones(1, 1)
    (dx,) = torch.autograd.grad(ffn(x, one, None, one, None, "gelu_tanh").sum(), x)
    x64 = x.detach().double().requires_grad_()
    (dx64,) = torch.autograd.grad(_exact_gelu_tanh(x64).sum(), x64)
    assert ((dx - dx64).abs() <= 8e-7 * dx64.abs()).all()


# --------------------------------------------------------------------------- the eager entry
#
# ffn first tries fastformer._C.ffn_eager: the plain call in one C call, None for any other
# (csrc/ffn/ffn_eager.cpp). Where it runs it must give the checked Python path's bits, gradients
# and generator state included; everything it declines goes down that path.

# name: (leading dims of x, d_model, d_ff, activation, dtype, biases, dropout_p)
_ENTRY_CASES = {
    "relu": ((4, 5), 32, 48, "relu", torch.float32, True, 0.0),
    "relu dropout": ((7,), 16, 24, "relu", torch.float32, True, 0.2),
    "gelu without biases": ((3, 2), 24, 40, "gelu", torch.float32, False, 0.0),
    "gelu_tanh bf16 dropout": ((9,), 64, 80, "gelu_tanh", torch.bfloat16, True, 0.1),
    "silu fp16": ((5,), 32, 16, "silu", torch.float16, True, 0.0),
    "swiglu dropout": ((6,), 16, 24, "swiglu", torch.float32, True, 0.3),
    "geglu fp64 dropout": ((4,), 8, 12, "geglu", torch.float64, True, 0.5),
    "rank-1 x": ((), 8, 12, "relu", torch.float32, True, 0.0),
}


@needs_ext
@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize(("case", "device"), on_devices(_ENTRY_CASES, 4))
def test_eager_entry_gives_the_checked_paths_bits(case, device, grad, monkeypatch):
    lead, d_model, d_ff, activation, dtype, bias, p = _ENTRY_CASES[case]
    inputs = make_inputs(lead, d_model, d_ff, activation, dtype, device, bias)
    if not grad:
        inputs = [None if t is None else t.detach() for t in inputs]
    leaves = [t for t in inputs if t is not None]
    dy = torch.randn(*lead, d_model, dtype=torch.float64).to(dtype=dtype, device=device)
    # On CUDA gelu_tanh's epilogue choice without a gradient reads the GPU's capability: the
    # checked path's to make.
    taken = not (device == "cuda" and activation == "gelu_tanh" and not grad)
    assert (ffn_mod._EAGER(*inputs, activation, p, ffn_mod._eager_seed) is not None) == taken

    def run():
        torch.manual_seed(11)
        out = ffn(*inputs, activation, p)
        state = generator_state(device)
        return [out, state, *(torch.autograd.grad(out, leaves, dy) if grad else ())]

    want = checked_path(monkeypatch, ffn_mod, run)
    got = run()
    assert len(got) == len(want) == (2 + len(leaves) if grad else 2)
    for a, c in zip(got, want):
        assert a.dtype == c.dtype and a.shape == c.shape
        assert torch.equal(a, c), case


@needs_ext
def test_eager_entry_runs_non_contiguous_inputs(monkeypatch):
    x = torch.randn(16, 6).t()  # (6, 16), column-major
    w1, w2 = torch.randn(12, 32)[:, ::2], torch.randn(16, 12)
    assert ffn_mod._EAGER(x, w1, None, w2, None, "gelu", 0.0, ffn_mod._eager_seed) is not None
    want = checked_path(monkeypatch, ffn_mod, lambda: ffn(x, w1, None, w2, None, "gelu"))
    assert torch.equal(ffn(x, w1, None, w2, None, "gelu"), want)


@needs_ext
def test_plain_calls_take_the_eager_entry(monkeypatch):
    # The checked path's checks raise: a plain call must not reach them (an entry that declined
    # every call would leave these tests blind).
    def checked(*args):
        raise AssertionError("the checked path ran")

    monkeypatch.setattr(ffn_mod, "_check_inputs", checked)
    x, w1, b1, w2, b2 = make_inputs((3, 2), 8, 6, "relu")
    ffn(x, w1, b1, w2, b2).sum().backward()
    assert all(t.grad is not None for t in (x, w1, b1, w2, b2))
    ffn(x, w1, None, w2, None, "silu", 0.1).sum().backward()
    with torch.no_grad():
        ffn(x, w1, b1, w2, b2, "gelu", 0.5)
    with torch.inference_mode():
        ffn(x, w1, b1, w2, b2)
    with pytest.raises(AssertionError, match="checked path"):
        ffn(x, w1, b1, w2, b2, "relu", 0)  # an int dropout_p: the checked path's


class _Name(str):
    pass


def _declined_calls():
    """name: a call of the entry it must decline (return None, drawing nothing)."""
    x, w1, b1, w2, b2 = (t.detach() for t in make_inputs((3,), 8, 6, "relu"))
    wg = torch.randn(12, 8)

    def plain(**kw):
        args = dict(x=x, w1=w1, b1=b1, w2=w2, b2=b2, activation="relu", p=0.1)
        args.update(kw)
        return lambda: ffn_mod._EAGER(*args.values(), ffn_mod._eager_seed)

    return {
        "subclass x": plain(x=x.as_subclass(Subclass)),
        "subclass w1": plain(w1=w1.as_subclass(Subclass)),
        "int x": plain(x=x.int(), w1=w1.int(), b1=None, w2=w2.int(), b2=None),
        "0-dim x": plain(x=torch.tensor(1.0)),
        "empty x": plain(x=torch.randn(0, 8)),
        "meta x": plain(x=x.to("meta"), w1=w1.to("meta"), b1=None, w2=w2.to("meta"), b2=None),
        "sparse x": plain(x=x.to_sparse()),
        "nested x": plain(x=torch.nested.nested_tensor([x, x[:2]])),
        "x d_model": plain(x=torch.randn(3, 9)),
        "w1 3-dim": plain(w1=w1[..., None]),
        "w1 a list": plain(w1=w1.tolist()),
        "w1 empty": plain(w1=torch.randn(0, 8), b1=None, w2=torch.randn(8, 0)),
        "gated w1 odd": plain(
            w1=torch.randn(11, 8), b1=None, w2=torch.randn(8, 5), activation="swiglu"
        ),
        "gated w2 d_ff": plain(w1=wg, b1=None, w2=torch.randn(8, 12), activation="geglu"),
        "w2 d_ff": plain(w2=torch.randn(8, 5)),
        "w2 dtype": plain(w2=w2.double()),
        "b1 size": plain(b1=torch.randn(7)),
        "b1 2-dim": plain(b1=b1[None]),
        "b2 size": plain(b2=torch.randn(9)),
        "b2 device": plain(b2=b2.to("meta")),
        "b2 dtype": plain(b2=b2.half()),
        "activation unknown": plain(activation="tanh"),
        "activation None": plain(activation=None),
        "activation a str subclass": plain(activation=_Name("relu")),
        "activation upper case": plain(activation="RELU"),
        "p int": plain(p=0),
        "p numpy": plain(p=np.float64(0.1)),
        "p negative": plain(p=-0.1),
        "p one": plain(p=1.0),
        "p above 0.99": plain(p=0.995),
        "p nan": plain(p=float("nan")),
    }


@needs_ext
@pytest.mark.parametrize("case", list(_declined_calls()))
def test_eager_entry_declines_unusual_arguments(case):
    assert_declined_drawing_nothing(_declined_calls()[case])


@needs_ext
def test_eager_entry_declines_in_contexts_the_checked_path_routes(monkeypatch):
    x, w1, b1, w2, b2 = (t.detach() for t in make_inputs((3,), 8, 6, "relu"))
    e = ffn_mod._EAGER

    def plain(t=x, p=0.1):
        return e(t, w1, b1, w2, b2, "relu", p, ffn_mod._eager_seed)

    assert plain() is not None
    seen = []
    with torch.autograd.forward_ad.dual_level():
        seen.append(plain())
    torch.vmap(lambda t: (seen.append(plain(t)), t)[1], randomness="same")(x)
    torch.func.grad(lambda t: (seen.append(plain(t, 0.0)), t.sum())[1])(x)
    torch.func.jvp(lambda t: (seen.append(plain(t, 0.0)), t)[1], (x,), (x,))
    with torch._subclasses.fake_tensor.FakeTensorMode():
        seen.append(e(torch.randn(3, 8), torch.randn(6, 8), None, torch.randn(8, 6), None,
                      "relu", 0.0, ffn_mod._eager_seed))  # fmt: skip
    with PassThroughMode():
        seen.append(plain())
    with PassThroughFunctionMode():
        seen.append(plain())
    torch.jit.trace(lambda t: (seen.append(plain(t, 0.0)), t + 1)[1], x, check_trace=False)
    assert seen == [None] * 8
    monkeypatch.setenv("FASTFORMER_BACKEND_FFN", "torch")
    assert plain() is None
    monkeypatch.setenv("FASTFORMER_BACKEND_FFN", "cpp")
    assert plain() is not None
    monkeypatch.setenv("FASTFORMER_BACKEND_FFN", "")  # unset, as for the checked path
    assert plain() is not None
    monkeypatch.setenv(ffn_mod.EPILOGUE_ENV, "fused")  # read for CUDA inputs only, as there
    assert plain() is not None
    with pytest.raises(TypeError, match="wrong number of arguments"):
        e(x, w1, b1, w2, b2, "relu", 0.1)


@needs_ext
def test_eager_entry_passes_the_seed_draws_errors_on(monkeypatch):
    x, w1, b1, w2, b2 = (t.detach() for t in make_inputs((3,), 8, 6, "relu"))

    def entry(p=0.1, seed_fn=ffn_mod._eager_seed):
        return ffn_mod._EAGER(x, w1, b1, w2, b2, "relu", p, seed_fn)

    def failing(*args):
        raise KeyError("seed")

    with pytest.raises(KeyError, match="seed"):
        entry(seed_fn=failing)
    with pytest.raises(RuntimeError, match="neither an int nor a tensor"):
        entry(seed_fn=lambda *args: "3")
    with pytest.raises(OverflowError):
        entry(seed_fn=lambda *args: 2**70)
    assert entry(p=0.0, seed_fn=failing) is not None  # no dropout: no draw
    # A seed drawn on the device (inside CUDA graph capture) goes to the op as device_seed, as
    # from the checked path: on the CPU its kernels refuse it, with the same message.
    monkeypatch.setattr(rng, "call_seed", lambda device, p: torch.tensor([7]))
    errors = []
    for run in (lambda: ffn(x, w1, b1, w2, b2, "relu", 0.1),) * 2:
        with pytest.raises(RuntimeError) as raised:
            run() if errors else checked_path(monkeypatch, ffn_mod, run)
        errors.append(str(raised.value))
    assert errors[0] == errors[1] and "seed" in errors[0]
