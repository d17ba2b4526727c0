"""Second derivatives through the ops raise (fastformer.ops._autograd.first_order).

The eager autograd Functions' backwards run kernels whose results carry no graph: before
`first_order`, a backward through gradients taken with create_graph=True returned zeros (the
LayerNorm ops) or partial sums (the FFN) without an error. First-order gradients taken with
create_graph=True must stay exactly the usual ones.
"""

from __future__ import annotations

import pytest
import torch

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


def _ffn(x, w1, w2):
    return ffn.ffn(x, w1, None, w2, None, "gelu", dropout_p=0.2)


def _attention(q, k, v):
    return attention.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=True)


# op -> (function, shapes of its differentiable inputs)
OPS = {
    "layer_norm": (_layer_norm, [(6, 8), (8,)]),
    "rms_norm": (_rms_norm, [(6, 8), (8,)]),
    "dropout_add_layer_norm": (_dropout_add_layer_norm, [(6, 8), (8,), (6, 8)]),
    "ffn": (_ffn, [(6, 8), (16, 8), (8, 16)]),
    "attention": (_attention, [(1, 2, 6, 4), (1, 2, 5, 4), (1, 2, 5, 4)]),
}


NORMS = ("layer_norm", "rms_norm", "dropout_add_layer_norm")


def _first_grads(op: str, create_graph: bool, square: bool):
    fn, shapes = OPS[op]
    inputs = [_randn(*shape, seed=i) for i, shape in enumerate(shapes)]
    torch.manual_seed(0)  # the same dropout mask in every call
    out = fn(*inputs)
    loss = (out * out).sum() if square else out.sum()
    return inputs, torch.autograd.grad(loss, inputs, create_graph=create_graph)


@pytest.mark.parametrize("backend", ["default", "torch"])
@pytest.mark.parametrize("square", [True, False], ids=["loss_x_squared", "loss_sum"])
@pytest.mark.parametrize("op", OPS)
def test_second_derivative_raises(monkeypatch, op, square, backend):
    # square: the incoming gradient depends on the inputs; sum: it is a constant, and the tie
    # to the inputs goes through the tensors the forward saved. The norms' torch backend is
    # the reference's plain torch ops: its second derivative is autograd's own.
    for name in ("ATTENTION", "LAYER_NORM", "FFN"):
        monkeypatch.delenv(f"FASTFORMER_BACKEND_{name}", raising=False)
        if backend == "torch":
            monkeypatch.setenv(f"FASTFORMER_BACKEND_{name}", "torch")
    inputs, grads = _first_grads(op, create_graph=True, square=square)
    _, plain = _first_grads(op, create_graph=False, square=square)
    for got, want in zip(grads, plain):
        assert torch.equal(got, want)
    assert any(g.requires_grad for g in grads)
    second = sum((g * g).sum() for g in grads)
    if backend == "torch" and op in NORMS:  # plain torch ops (the reference): differentiable
        assert all(torch.isfinite(g).all() for g in torch.autograd.grad(second, inputs))
        return
    with pytest.raises(RuntimeError, match="first-order gradients only"):
        torch.autograd.grad(second, inputs)


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
