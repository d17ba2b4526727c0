"""Second derivatives through the ops (fastformer.ops._autograd.twice_differentiable).

The eager autograd Functions' backwards run kernels whose results carry no graph: a backward
through gradients taken with create_graph=True returned zeros (the LayerNorm ops) or partial sums
(the FFN) without an error, and then raised. Under create_graph=True the ops now compute their
gradients through the reference's operations (torch.func.vjp), which a second backward
differentiates; those gradients must equal the kernels' (the parity rule's reference), and the
second derivatives torch's own ops'.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fastformer
from fastformer.ops import attention, ffn, layer_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _randn(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE).requires_grad_()


def _layer_norm(x, w):
    return layer_norm.layer_norm(x, 8, w)


def _rms_norm(x, w):
    return layer_norm.rms_norm(x, 8, w)


def _dropout_add_layer_norm(x, w, r):
    return layer_norm.dropout_add_layer_norm(x, r, w, None, dropout_p=0.2)


def _prenorm(x, w, r):  # both outputs used: pre's gradient joins out's
    out, pre = layer_norm.dropout_add_layer_norm(x, r, w, None, dropout_p=0.2, prenorm=True)
    return out + pre.sin()


def _ffn(x, w1, w2):
    return ffn.ffn(x, w1, None, w2, None, "gelu", dropout_p=0.2)


def _gated_ffn(x, w1, w2):  # linear1 twice as wide as linear2's input, and its dropout mask
    return ffn.ffn(x, w1, None, w2, None, "swiglu", dropout_p=0.2)


def _attention(q, k, v):
    return attention.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True)


def _attention_lse(q, k, v, mask):  # lse's gradient and a float mask's
    out, lse = attention.scaled_dot_product_attention_with_lse(q, k, v, mask, dropout_p=0.2)
    return out.sum(-1) + lse.cos()


# op -> (function, shapes of its differentiable inputs)
OPS = {
    "layer_norm": (_layer_norm, [(6, 8), (8,)]),
    "rms_norm": (_rms_norm, [(6, 8), (8,)]),
    "dropout_add_layer_norm": (_dropout_add_layer_norm, [(6, 8), (8,), (6, 8)]),
    "ffn": (_ffn, [(6, 8), (16, 8), (8, 16)]),
    "gated_ffn": (_gated_ffn, [(6, 8), (32, 8), (8, 16)]),
    "attention": (_attention, [(1, 2, 6, 4), (1, 2, 5, 4), (1, 2, 5, 4)]),
}
SECOND = {
    **OPS,
    "prenorm": (_prenorm, [(6, 8), (8,), (6, 8)]),
    "attention_lse": (_attention_lse, [(1, 2, 6, 4), (1, 2, 5, 4), (1, 2, 5, 4), (6, 5)]),
}


def _use_backend(monkeypatch, backend: str) -> None:
    for name in ("ATTENTION", "LAYER_NORM", "FFN"):
        monkeypatch.delenv(f"FASTFORMER_BACKEND_{name}", raising=False)
        if backend == "torch":
            monkeypatch.setenv(f"FASTFORMER_BACKEND_{name}", "torch")


def _first_grads(op: str, create_graph: bool, square: bool, dtype=torch.float32):
    fn, shapes = SECOND[op]
    inputs = [_randn(*shape, seed=i).detach().to(dtype).requires_grad_() for i, shape in
              enumerate(shapes)]  # fmt: skip
    torch.manual_seed(0)  # the same dropout mask in every call
    out = fn(*inputs)
    loss = (out * out).sum() if square else out.sum()
    return inputs, torch.autograd.grad(loss, inputs, create_graph=create_graph)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("backend", ["default", "torch"])
@pytest.mark.parametrize("square", [True, False], ids=["loss_x_squared", "loss_sum"])
@pytest.mark.parametrize("op", SECOND)
def test_create_graph_gradients_equal_the_kernels(monkeypatch, op, square, backend, dtype):
    # square: the incoming gradient depends on the inputs; sum: it is a constant, and what
    # the gradients depend on are the tensors the forward saved. float32: the reference's
    # rounding against the kernels' (their parity bound at these sizes is looser still).
    _use_backend(monkeypatch, backend)
    _, grads = _first_grads(op, create_graph=True, square=square, dtype=dtype)
    _, plain = _first_grads(op, create_graph=False, square=square, dtype=dtype)
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    for got, want in zip(grads, plain):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert any(g.requires_grad for g in grads)
    assert not any(g.requires_grad for g in plain)


@pytest.mark.cuda
@pytest.mark.parametrize("op", SECOND)
def test_cuda_create_graph_gradients_equal_the_kernels(op):
    # The kernels' gradients against the reference's on the device, to bf16 rounding, and a
    # second backward through the latter. (bf16 only: each dtype compiles attention kernels
    # anew, in a GPU suite stage with a time box.)
    dtype, tol = torch.bfloat16, 3e-2
    inputs, grads = _first_grads(op, create_graph=True, square=True, dtype=dtype)
    _, plain = _first_grads(op, create_graph=False, square=True, dtype=dtype)
    for got, want in zip(grads, plain):
        scale = want.float().abs().amax().item() + 1.0
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale)
    second = torch.autograd.grad(sum(g.float().square().sum() for g in grads), inputs)
    assert all(s.dtype == t.dtype and torch.isfinite(s).all() for s, t in zip(second, inputs))


@pytest.mark.parametrize("backend", ["default", "torch"])
@pytest.mark.parametrize("op", SECOND)
def test_second_derivatives_pass_gradgradcheck(monkeypatch, op, backend):
    # float64 on CPU (the kernels' gradcheck dtype); a fixed seed: one dropout mask a call.
    # The FFNs smaller (gradgradcheck's cost grows with the weights' size: 12 s a case in CI).
    _use_backend(monkeypatch, backend)
    fn, shapes = SECOND[op]
    shapes = {"ffn": [(3, 4), (8, 4), (4, 8)], "gated_ffn": [(3, 4), (16, 4), (4, 8)]}.get(
        op, shapes
    )
    inputs = [_randn(*s, seed=i).detach().cpu().double().requires_grad_() for i, s in
              enumerate(shapes)]  # fmt: skip

    def seeded(*args):
        torch.manual_seed(0)
        return fn(*args)

    assert torch.autograd.gradgradcheck(seeded, inputs)


def _hessian_vector_products(fn, inputs):
    out = fn(*inputs)
    grads = torch.autograd.grad((out * out).sum(), inputs, create_graph=True)
    penalty = sum((g * g).sum() for g in grads)
    return (*grads, *torch.autograd.grad(penalty, inputs))


def _torch_ops(op: str):
    """The op without dropout in torch's own functions, and the fastformer call."""
    d = 8
    if op == "layer_norm":
        return (lambda x, w, b: F.layer_norm(x, (d,), w, b)), (
            lambda x, w, b: layer_norm.layer_norm(x, d, w, b)
        )
    if op == "dropout_add_layer_norm":  # x and the residual: the node saves only their sum
        return (lambda x, w, b, r: F.layer_norm(x + r, (d,), w, b)), (
            lambda x, w, b, r: layer_norm.dropout_add_layer_norm(x, r, w, b)
        )
    if op == "ffn":
        return (lambda x, w1, b1, w2, b2: F.linear(F.silu(F.linear(x, w1, b1)), w2, b2)), (
            lambda x, w1, b1, w2, b2: ffn.ffn(x, w1, b1, w2, b2, "silu")
        )

    # self-attention from one projection: q, k and v depend on the same weight (their
    # gradients must be the node's partial derivatives, not total ones)
    def split(x, w):
        q, k, v = (x @ w).view(1, 6, 3, 2, 4).permute(2, 0, 3, 1, 4)
        return q, k * 2 + q, v

    return (lambda x, w: _math_sdpa(*split(x, w), is_causal=True)), (
        lambda x, w: attention.scaled_dot_product_attention(*split(x, w), is_causal=True)
    )


TORCH_SHAPES = {
    "layer_norm": [(6, 8), (8,), (8,)],
    "dropout_add_layer_norm": [(6, 8), (8,), (8,), (6, 8)],
    "ffn": [(6, 8), (16, 8), (16,), (8, 16), (8,)],
    "attention": [(1, 6, 8), (8, 24)],
}


@pytest.mark.parametrize("backend", ["default", "torch"])
@pytest.mark.parametrize("op", TORCH_SHAPES)
def test_second_derivatives_equal_torchs(monkeypatch, op, backend):
    _use_backend(monkeypatch, backend)
    inputs = [_randn(*s, seed=i).detach().cpu().double().requires_grad_() for i, s in
              enumerate(TORCH_SHAPES[op])]  # fmt: skip
    expected_fn, fn = _torch_ops(op)
    got = _hessian_vector_products(fn, inputs)
    expected = _hessian_vector_products(expected_fn, inputs)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("vectorize", [False, True])  # True: a batched create_graph backward
@pytest.mark.parametrize("op", ["layer_norm", "ffn", "attention"])
def test_hessians_equal_torchs(op, vectorize):
    w, w1, w2 = (_randn(*s, seed=i).detach().cpu().double() for i, s in
                 enumerate([(8,), (16, 8), (8, 16)]))  # fmt: skip
    x = _randn(3, 8, seed=3).detach().cpu().double()
    fns = {
        "layer_norm": (
            lambda x: layer_norm.layer_norm(x, 8, w),
            lambda x: F.layer_norm(x, (8,), w),
        ),
        "ffn": (
            lambda x: ffn.ffn(x, w1, None, w2, None, "gelu"),
            lambda x: F.linear(F.gelu(F.linear(x, w1)), w2),
        ),
        "attention": (
            lambda x: attention.scaled_dot_product_attention(*[x.view(1, 1, 3, 8)] * 3),
            lambda x: _math_sdpa(*[x.view(1, 1, 3, 8)] * 3),
        ),
    }
    fn, expected_fn = fns[op]

    def hessian(f):
        return torch.autograd.functional.hessian(
            lambda x: f(x).pow(3).sum(), x, vectorize=vectorize
        )

    torch.testing.assert_close(hessian(fn), hessian(expected_fn), rtol=1e-9, atol=1e-9)


def _math_sdpa(q, k, v, **kwargs):  # torch's math backend differentiates twice (CPU flash not)
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("norm_first", [False, True])
def test_gradient_penalty_of_a_swapped_decoder_layer_equals_torch_nn(norm_first):
    # Every op of a layer at once (causal self-attention, cross-attention with key padding, the
    # fused residual + LayerNorm, the FFN): the gradients of a gradient penalty, which go
    # through the create_graph backward of each.
    torch.manual_seed(0)
    eager = torch.nn.TransformerDecoderLayer(
        16, 2, 32, dropout=0.0, batch_first=True, norm_first=norm_first, device=DEVICE
    )
    fast = copy.deepcopy(eager)
    fastformer.swap(fast)
    assert isinstance(fast, fastformer.nn.TransformerDecoderLayer) and not fast.fallback_reasons
    x, memory = _randn(2, 5, 16, seed=0), _randn(2, 7, 16, seed=1).detach()
    kpm = torch.zeros(2, 7, dtype=torch.bool, device=DEVICE)
    kpm[0, 5:] = True
    causal = torch.nn.Transformer.generate_square_subsequent_mask(5, device=DEVICE)

    def penalty_grads(layer):
        inputs = [x, *layer.parameters()]
        with sdpa_kernel(SDPBackend.MATH):
            out = layer(x, memory, causal, None, None, kpm, tgt_is_causal=True)
            grads = torch.autograd.grad(out.pow(2).sum(), inputs, create_graph=True)
            return torch.autograd.grad(sum(g.pow(2).sum() for g in grads), inputs)

    for got, want in zip(penalty_grads(fast), penalty_grads(eager)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("backend", ["default", "torch"])
@pytest.mark.parametrize("biases", [("b1",), ("b1", "b2")])
def test_ffn_gradient_penalty_when_only_biases_train(monkeypatch, backend, biases):
    # Nothing the backward saved required grad and the cotangent was a constant: db1 came back
    # as a constant, and a gradient penalty on it was silently dropped (a found fault).
    _use_backend(monkeypatch, backend)
    x, w1, w2 = (_randn(*s, seed=i).detach() for i, s in enumerate([(4, 8), (16, 8), (8, 16)]))

    def penalty(fn):
        b = {"b1": torch.zeros(16, device=DEVICE), "b2": torch.zeros(8, device=DEVICE)}
        for name in biases:
            b[name].requires_grad_()
        out = fn(x, w1, b["b1"], w2, b["b2"])
        grads = torch.autograd.grad(out.sum(), [b[n] for n in biases], create_graph=True)
        loss = out.square().sum() + sum(g.pow(2).sum() for g in grads)
        return torch.autograd.grad(loss, [b[n] for n in biases])

    got = penalty(lambda *args: ffn.ffn(*args, "gelu"))
    expected = penalty(lambda x, w1, b1, w2, b2: F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2))
    assert got[0].abs().amax() > 0
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["default", "torch", "custom_op"])
def test_ffn_backward_allows_an_in_place_update_of_b1(monkeypatch, path):
    # torch's linear does not save its bias, so updating b1 in place between the forward and the
    # backward (an EMA, a bias tied elsewhere) leaves torch's backward alone. The FFN kept b1
    # for its create_graph=True backward, but saved it for backward, which then raised
    # "modified by an inplace operation". w1, which the backward reads, still makes it raise,
    # as in torch; so does b1 under create_graph=True, where the reference reads it.
    monkeypatch.delenv("FASTFORMER_BACKEND_FFN", raising=False)
    if path == "torch":
        monkeypatch.setenv("FASTFORMER_BACKEND_FFN", "torch")
    x, w1, w2 = (_randn(*s, seed=i) for i, s in enumerate([(4, 8), (16, 8), (8, 16)]))
    b1, b2 = _randn(16, seed=3), _randn(8, seed=4)
    inputs = (x, w1, b1, w2, b2)

    def run():
        if path == "custom_op":
            return torch.ops.fastformer.ffn(*inputs, "gelu", 0.0, True)[0]
        return ffn.ffn(*inputs, "gelu")

    expected = torch.autograd.grad(run().sum(), inputs)
    out = run()
    with torch.no_grad():
        b1.add_(1.0)
    for got, want in zip(torch.autograd.grad(out.sum(), inputs), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    out = run()
    with torch.no_grad():
        b1.add_(1.0)
    with pytest.raises(RuntimeError, match="b1 of fastformer's FFN is at version"):
        torch.autograd.grad(out.sum(), inputs, create_graph=True)
    out = run()
    with torch.no_grad():
        w1.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(out.sum(), inputs)


def test_raw_layer_norm_op_second_derivative_equals_torchs():
    # fastformer::layer_norm's Python autograd formula (the path torch.compile traces): its
    # backward calls layer_norm_bwd, which has no autograd; a second derivative came back as
    # zeros, then raised.
    x = _randn(3, 8, seed=0).detach().double().requires_grad_()
    w, b = _randn(8, seed=1).detach().double(), _randn(8, seed=2).detach().double()

    def second(fn):
        (g,) = torch.autograd.grad(fn(x).pow(2).sum(), x, create_graph=True)
        return torch.autograd.grad(g.pow(2).sum(), x)[0]

    got = second(lambda x: torch.ops.fastformer.layer_norm(x, w, b, None, 1e-5, 0.0, False,
                                                            False)[0])  # fmt: skip
    torch.testing.assert_close(got, second(lambda x: F.layer_norm(x, (8,), w, b)))


# --------------------------------------------------------------------------- torch.func, forward AD
# Under a torch.func transform or a forward-AD level the ops compute with the reference's torch
# operations and the kernels' dropout mask (`_autograd.under_transform`): forward AD through the
# kernels dropped the tangents in silence (zero), and torch.func refused their autograd.


def _wide_inputs(op: str) -> list[torch.Tensor]:
    return [_randn(*shape, seed=i).detach().double() for i, shape in enumerate(OPS[op][1])]


def _seeded(fn, *args):
    torch.manual_seed(0)  # the same dropout mask in every call
    return fn(*args)


@pytest.mark.parametrize("op", OPS)
def test_forward_ad_tangent_matches_finite_differences(op):
    fn = OPS[op][0]
    inputs = _wide_inputs(op)
    tangents = [torch.randn_like(t) for t in inputs]
    step = 1e-6
    moved = [[x + s * step * t for x, t in zip(inputs, tangents)] for s in (1, -1)]
    expected = (_seeded(fn, *moved[0]) - _seeded(fn, *moved[1])) / (2 * step)
    plain = _seeded(fn, *inputs)
    out, tangent = _seeded(torch.func.jvp, fn, tuple(inputs), tuple(tangents))
    torch.testing.assert_close(out, plain, rtol=1e-12, atol=1e-12)  # the same dropout mask
    torch.testing.assert_close(tangent, expected, rtol=1e-6, atol=1e-6)
    # Forward AD on plain tensors (no requires_grad anywhere: the kernels' path before).
    with torch.autograd.forward_ad.dual_level():
        duals = [torch.autograd.forward_ad.make_dual(x, t) for x, t in zip(inputs, tangents)]
        dual_tangent = torch.autograd.forward_ad.unpack_dual(_seeded(fn, *duals)).tangent
    assert dual_tangent is not None
    torch.testing.assert_close(dual_tangent, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op", OPS)
def test_torch_func_grad_matches_autograd(op):
    fn = OPS[op][0]
    inputs = [t.requires_grad_() for t in _wide_inputs(op)]

    def loss(*args):
        return _seeded(fn, *args).square().sum()

    expected = torch.autograd.grad(loss(*inputs), inputs)  # the kernels' backward
    got = torch.func.grad(loss, argnums=tuple(range(len(inputs))))(*inputs)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("op", ["dropout_add_layer_norm", "ffn", "attention"])  # the dropouts
def test_vmap_randomness_modes_with_dropout(op):
    # The ops draw one seed a call. "same": every sample gets that mask (dropout_add_layer_norm
    # drew its mask inside a custom op, which vmap's fallback ran once a sample: a new mask
    # each); "error": vmap's own error (it did not raise for that op); "different": a clear
    # error (an .item() on a batched tensor deep in torch before).
    fn, shapes = OPS[op]
    one = [_randn(*shape, seed=i).detach() for i, shape in enumerate(shapes)]
    batch = [t.expand(3, *t.shape).contiguous() for t in one]  # three identical samples
    out = torch.func.vmap(fn, randomness="same")(*batch)
    assert all(torch.equal(out[0], out[i]) for i in (1, 2))
    with pytest.raises(RuntimeError, match="randomness error mode"):
        torch.func.vmap(fn, randomness="error")(*batch)
    with pytest.raises(RuntimeError, match=r"vmap\(randomness='different'\) is not supported"):
        torch.func.vmap(fn, randomness="different")(*batch)
    # per-sample gradients: the draw is a grad wrapper around vmap's batched tensor
    loss = lambda *args: fn(*args).sum()  # noqa: E731
    with pytest.raises(RuntimeError, match=r"vmap\(randomness='different'\) is not supported"):
        torch.func.vmap(torch.func.grad(loss), randomness="different")(*batch)


@pytest.mark.parametrize("randomness", ["same", "error"])
def test_compiled_dropout_refusal_finds_a_vmap_under_another_transform(randomness):
    # vmap(grad(f)): inside f the innermost level is grad's, the vmap one below it; the check
    # that refuses what a traced call cannot honour must look under grad's level.
    from fastformer.ops import _autograd

    levels = []

    def f(x):
        levels.append(_autograd._vmap_randomness())
        _autograd.refuse_compiled_vmap_dropout("op")
        return x.sum()

    match = "randomness error mode" if randomness == "error" else "randomness='same'"
    with pytest.raises(RuntimeError, match=match):
        torch.func.vmap(torch.func.grad(f), randomness=randomness)(torch.ones(3, 2))
    assert levels == [(randomness,)]
    levels.clear()
    torch.func.vmap(torch.func.grad(f), randomness="different")(torch.ones(3, 2))
    assert levels == [("different",)]


@pytest.mark.parametrize("backend", ["torch", "default"])
@pytest.mark.parametrize("case", ["mask", "dropout", "lse"])
def test_attention_gradients_batched_over_cotangents(monkeypatch, case, backend):
    # is_grads_batched (and vectorized jacobians) run the backward under vmap, which has no
    # rule for the reference backward's out= and in-place ops, nor for bool(grad_lse.any());
    # the Triton kernels cannot take its batched tensors (no storage): the torch backend's
    # functional path computes theirs.
    dtype, tol = torch.double, 1e-12
    if backend == "torch":
        monkeypatch.setenv("FASTFORMER_BACKEND_ATTENTION", "torch")
    else:  # Triton on a GPU or under the interpreter: float32
        monkeypatch.delenv("FASTFORMER_BACKEND_ATTENTION", raising=False)
        dtype, tol = torch.float32, 1e-5
    q, k, v = (_randn(1, 2, 3, 4, seed=i).detach().to(dtype).requires_grad_() for i in range(3))
    mask = _randn(3, 3, seed=3).detach().to(dtype).requires_grad_()
    torch.manual_seed(1)
    if case == "lse":
        out = attention.scaled_dot_product_attention_with_lse(q, k, v)[1]
    else:
        out = attention.scaled_dot_product_attention(
            q, k, v, mask if case == "mask" else None, dropout_p=0.3 if case == "dropout" else 0.0
        )
    inputs = {"mask": (q, k, v, mask), "dropout": (q, k, v), "lse": (q, k)}[case]  # lse: no v
    cotangents = torch.randn(2, *out.shape, dtype=dtype, device=DEVICE)
    batched = torch.autograd.grad(out, inputs, cotangents, is_grads_batched=True, retain_graph=True)
    for i, cotangent in enumerate(cotangents):
        one = torch.autograd.grad(out, inputs, cotangent, retain_graph=True)
        for got, want in zip(batched, one):
            torch.testing.assert_close(got[i], want, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", ["default", "torch"])
def test_inputs_an_output_does_not_depend_on_get_no_gradient(monkeypatch, backend):
    # Only pre of a prenorm call used: weight and bias did not shape it. Only attention's lse
    # used: value did not. torch gives None there; the kernels' nodes gave zero tensors, which
    # optimizers count as gradients (weight decay, momentum).
    for name in ("LAYER_NORM", "ATTENTION"):
        monkeypatch.delenv(f"FASTFORMER_BACKEND_{name}", raising=False)
        if backend == "torch":
            monkeypatch.setenv(f"FASTFORMER_BACKEND_{name}", "torch")
    x, r, w, b = (_randn(*s, seed=i) for i, s in enumerate([(3, 8), (3, 8), (8,), (8,)]))
    _, pre = layer_norm.dropout_add_layer_norm(x, r, w, b, prenorm=True)
    pre.sum().backward()
    assert w.grad is None and b.grad is None and x.grad is not None and r.grad is not None
    q, k, v = (_randn(1, 1, 3, 4, seed=i) for i in range(3))
    attention.scaled_dot_product_attention_with_lse(q, k, v)[1].sum().backward()
    assert v.grad is None and q.grad is not None and k.grad is not None


def test_raw_layer_norm_op_gives_parameters_no_gradient_when_only_pre_is_used():
    # The op's Python autograd formula (the path torch.compile traces; eager calls go through
    # csrc/autograd.cpp): with only pre used, weight and bias get None, as above.
    x, r, w, b = (_randn(*s, seed=i) for i, s in enumerate([(3, 8), (3, 8), (8,), (8,)]))
    pre = torch.ops.fastformer.layer_norm(x, w, b, r, 1e-5, 0.0, False, True)[1]
    pre.sum().backward()
    assert w.grad is None and b.grad is None
    torch.testing.assert_close(x.grad, torch.ones_like(x))
    torch.testing.assert_close(r.grad, torch.ones_like(r))


@pytest.mark.parametrize("op", ["ffn", "attention"])
def test_transforms_ignore_autocast_as_eager_calls_do(op):
    # Under torch.func transforms the ops run the reference's torch operations; autocast reached
    # them (bfloat16 products, float32 dtype: the ffn output off by up to 1) where eager calls,
    # like the kernels, compute in the inputs' dtype.
    if op == "ffn":
        x, w1, w2 = _randn(4, 64, seed=0), _randn(256, 64, seed=1), _randn(64, 256, seed=2)

        def fn(x):
            return ffn.ffn(x, w1, None, w2, None, "gelu")
    else:
        x, k, v = (_randn(2, 2, 16, 64, seed=s) for s in range(3))

        def fn(x):
            return attention.scaled_dot_product_attention(x, k, v)

    x = x.detach()
    plain = fn(x)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        mapped = torch.func.vmap(fn)(x[None])[0]
    torch.testing.assert_close(mapped, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", ["attn_mask", "key_padding_mask"])
def test_vmap_over_a_mask_alone(which):
    # q, k, v shared and only a mask batched: the reference's in-place masking of the (unbatched)
    # scores raised under vmap; torch's SDPA takes such calls.
    q, k, v = (_randn(1, 2, 3, 4, seed=i).detach() for i in range(3))
    g = torch.Generator().manual_seed(5)
    if which == "attn_mask":
        masks = torch.randn(6, 3, 3, generator=g).to(DEVICE)
    else:
        masks = (torch.rand(6, 1, 3, generator=g) > 0.5).to(DEVICE)
        masks[..., 0] = False  # a visible key a row

    def fn(m):
        return attention.scaled_dot_product_attention(q, k, v, **{which: m})

    mapped = torch.func.vmap(fn)(masks)
    for m, got in zip(masks, mapped):
        torch.testing.assert_close(got, fn(m), rtol=1e-6, atol=1e-6)


def test_ops_run_under_fake_tensor_mode_as_torch_does():
    # Shape propagation without data (FakeTensorMode, as memory estimators run a model): the
    # eager paths met a real seed tensor or drew a seed from fake data and raised; the ops now
    # take their custom ops' fakes there. Shapes, dtypes and gradients' shapes as for real data.
    from torch._subclasses.fake_tensor import FakeTensorMode

    def calls(x, q, w1, w2):
        out = [
            layer_norm.layer_norm(x, 8),
            layer_norm.rms_norm(x, 8),
            layer_norm.dropout_add_layer_norm(x, x, None, None, dropout_p=0.1),
            ffn.ffn(x, w1, None, w2, None, "gelu", dropout_p=0.1),
            attention.scaled_dot_product_attention(q, q, q, dropout_p=0.1),
        ]
        grads = torch.autograd.grad(sum(t.sum() for t in out), (x, q, w1, w2))
        return [(t.shape, t.dtype) for t in (*out, *grads)]

    def inputs():
        shapes = [(4, 8), (1, 2, 3, 8), (16, 8), (8, 16)]
        return [torch.randn(s, device=DEVICE, requires_grad=True) for s in shapes]

    real = calls(*inputs())
    with FakeTensorMode():
        assert calls(*inputs()) == real
