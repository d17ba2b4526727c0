"""Tests of fastformer.patch_sdpa: torch.nn.functional.scaled_dot_product_attention on the op.

A patched call the op takes must run the op (a spy counts its calls) and give torch's result
under the parity rule; every other call must reach torch's function and give its result
exactly. Without a GPU the op's Triton kernel runs in the interpreter (conftest.py).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

import fastformer
from fastformer.ops import attention as attn
from fastformer.testing import assert_parity, compare_with_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TORCH_SDPA = F.scaled_dot_product_attention


@pytest.fixture
def op_calls(monkeypatch):
    """The number of calls that ran the op, as a one-item list."""
    calls = [0]
    run = attn._checked_call

    def counted(*args, **kwargs):
        calls[0] += 1
        return run(*args, **kwargs)

    monkeypatch.setattr(attn, "_checked_call", counted)
    return calls


@pytest.fixture(autouse=True)
def _torch_sdpa_after_each_test():
    yield
    assert F.scaled_dot_product_attention is TORCH_SDPA, "a test left F patched"


def _randn(*shape: int, seed: int, grad: bool = True, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype).requires_grad_(grad)


def _qkv(lq=9, lk=9, d=16, h=2, hkv=2, **kwargs):
    return [_randn(2, n, seq, d, seed=i, **kwargs) for i, (n, seq) in
            enumerate([(h, lq), (hkv, lk), (hkv, lk)])]  # fmt: skip


def _bool_mask(*shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return (torch.rand(*shape, generator=g) > 0.3).to(DEVICE)


# name -> (q/k/v kwargs of _qkv, SDPA kwargs; "float_mask": a float mask of that shape, with
# its gradient)
TAKEN = {
    "plain": ({}, {}),
    "causal_lq_gt_lk": (dict(lq=13, lk=7), dict(is_causal=True)),
    "bool_mask_broadcast": (dict(lq=5, lk=11), dict(attn_mask=_bool_mask(5, 11))),
    "float_mask": (dict(lq=5, lk=11), dict(float_mask=(2, 1, 5, 11))),
    "gqa_scale": (dict(h=4, hkv=2), dict(enable_gqa=True, scale=0.3)),
    "causal_lower_right": (dict(lq=4, lk=11), dict(attn_mask=causal_lower_right(4, 11))),
}


def _on_gpu_too(names: list[str], gpu: set[str]) -> list:
    # On a GPU these compare the Triton kernel with torch's CUDA SDPA; the GPU suite runs the
    # few that compile no kernel or one fp32 pair (its tests_other stage has a 170 s box).
    return [pytest.param(n, marks=pytest.mark.gpu_too) if n in gpu else n for n in names]


@pytest.mark.parametrize("name", _on_gpu_too(list(TAKEN), {"plain"}))
def test_a_call_the_op_takes_runs_it_with_torch_s_result(name, op_calls):
    shapes, kwargs = TAKEN[name][0], dict(TAKEN[name][1])  # (a copy: float_mask is popped)
    inputs, names = _qkv(**shapes), ["q", "k", "v"]
    if "float_mask" in kwargs:
        inputs.append(_randn(*kwargs.pop("float_mask"), seed=7))
        names.append("attn_mask")

    patches = []

    def patched(*args):
        with fastformer.patch_sdpa() as patch:
            patches.append(patch)
            return F.scaled_dot_product_attention(*args, **kwargs)

    assert_parity(compare_with_reference(patched, lambda *a: TORCH_SDPA(*a, **kwargs), inputs,
                                         names=names))  # fmt: skip
    assert op_calls[0] == 1
    assert [(p.taken, p.not_taken) for p in patches] == [(1, {})]
    assert attn.sdpa_call_reasons(*inputs, **kwargs) == []


def test_a_one_dimensional_mask_gives_torch_s_math_result(op_calls):
    # A (Lk,) mask broadcasts to (B, H, Lq, Lk), as SDPA's documentation says, and torch's math
    # backend takes it; torch 2.14's CPU flash kernel raised "Dimension out of range" for it.
    # The op takes the call: the math backend's result, not that error.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mask = _bool_mask(11)

    def patched(*args):
        with fastformer.patch_sdpa():
            return F.scaled_dot_product_attention(*args, attn_mask=mask)

    def math(*args):
        with sdpa_kernel(SDPBackend.MATH):
            return TORCH_SDPA(*args, attn_mask=mask)

    inputs = _qkv(lq=5, lk=11)
    assert_parity(compare_with_reference(patched, math, inputs, names=["q", "k", "v"]))
    assert op_calls[0] == 1


def test_dropout_runs_the_op_s_dropout(op_calls):
    q, k, v = _qkv(grad=False)
    torch.manual_seed(3)
    want = attn.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)
    with fastformer.patch_sdpa():
        torch.manual_seed(3)
        got = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)
    assert op_calls[0] == 2  # the direct call, then the patched one
    assert torch.equal(got, want)


def _five_d():
    return [_randn(2, 3, 2, 9, 16, seed=i, grad=False) for i in range(3)]


# name -> (args, kwargs) of a call torch's SDPA runs and the op does not take, and its reason
NOT_TAKEN = {
    "3d": (lambda: [t[:, 0] for t in _qkv(grad=False)], {}, "3-D, 3-D and 3-D, not 4-D"),
    "5d": (_five_d, {}, "5-D, 5-D and 5-D, not 4-D"),
    "negative_scale": (
        lambda: _qkv(grad=False),
        dict(scale=-0.5),
        "scale must be a finite number > 0, got -0.5",
    ),
    "head_dim_300": (lambda: _qkv(d=300, grad=False), {}, r"head_dim must be in \[1, 256\]"),
    "float64": (
        lambda: _qkv(grad=False, dtype=torch.float64),
        {},
        "its torch backend, not the Triton kernel",
    ),
    "dropout_near_one": (
        lambda: _qkv(grad=False),
        dict(dropout_p=0.995),
        "dropout_p must be at most",
    ),
}


@pytest.mark.parametrize("name", _on_gpu_too(list(NOT_TAKEN), {"3d", "head_dim_300", "float64"}))
def test_a_call_the_op_does_not_take_runs_torch_s(name, op_calls):
    make, kwargs, reason = NOT_TAKEN[name]
    args = make()
    torch.manual_seed(0)
    want = TORCH_SDPA(*args, **kwargs)
    with fastformer.patch_sdpa() as patch:
        torch.manual_seed(0)
        got = F.scaled_dot_product_attention(*args, **kwargs)
    assert op_calls[0] == 0
    assert torch.equal(got, want)
    [why] = attn.sdpa_call_reasons(*args, **kwargs)
    assert re.search(reason, why), why
    assert patch.taken == 0 and patch.not_taken == {why: 1}
    assert f"1 x {why}" in str(patch)


def test_is_causal_with_a_mask_does_what_torch_s_does(op_calls):
    # torch 2.14 raises; 2.11 applies both on the CPU. The patch leaves it to torch.
    q, k, v = _qkv(grad=False)
    mask = _bool_mask(9, 9)

    def outcome(sdpa):
        try:
            return sdpa(q, k, v, mask, is_causal=True)
        except RuntimeError as error:
            return str(error)

    want = outcome(TORCH_SDPA)
    with fastformer.patch_sdpa():
        got = outcome(F.scaled_dot_product_attention)
    assert type(got) is type(want)
    assert got == want if isinstance(want, str) else torch.equal(got, want)
    assert op_calls[0] == 0


def test_scale_and_enable_gqa_are_keyword_only_as_in_torch():
    q, k, v = _qkv(grad=False)
    with pytest.raises(TypeError):
        TORCH_SDPA(q, k, v, None, 0.0, False, 0.5)
    with fastformer.patch_sdpa(), pytest.raises(TypeError):
        F.scaled_dot_product_attention(q, k, v, None, 0.0, False, 0.5)


def test_patches_nest_and_restore_what_they_replaced():
    outer = fastformer.patch_sdpa()
    patched = F.scaled_dot_product_attention
    assert patched is not TORCH_SDPA and outer.active
    with fastformer.patch_sdpa() as inner:
        assert F.scaled_dot_product_attention is patched
    assert not inner.active and F.scaled_dot_product_attention is patched
    outer.restore()
    outer.restore()  # a no-op once restored
    assert not outer.active and F.scaled_dot_product_attention is TORCH_SDPA
    with pytest.raises(KeyError), fastformer.patch_sdpa():
        raise KeyError("an error inside the block")
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_a_call_not_taken_goes_to_the_function_the_patch_replaced(monkeypatch, op_calls):
    # Another library's patch of F before fastformer's keeps its calls.
    seen = []

    def theirs(*args, **kwargs):
        seen.append(kwargs)
        return TORCH_SDPA(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", theirs)
    q, k, v = (t[:, 0] for t in _qkv(grad=False))  # 3-D: not the op's
    with fastformer.patch_sdpa():
        F.scaled_dot_product_attention(q, k, v, scale=0.5)
        assert F.scaled_dot_product_attention is not theirs
    assert F.scaled_dot_product_attention is theirs
    monkeypatch.undo()
    assert seen == [dict(scale=0.5, enable_gqa=False)] and op_calls[0] == 0


def test_autocast_casts_the_inputs_as_it_casts_torch_s(op_calls):
    q, k, v = _qkv(grad=False)
    mask = _randn(9, 9, seed=6, grad=False)  # float32: cast to float16 as torch's is
    with torch.autocast(DEVICE, dtype=torch.float16):
        want = TORCH_SDPA(q, k, v, mask)
        with fastformer.patch_sdpa():
            got = F.scaled_dot_product_attention(q, k, v, mask)
    assert got.dtype == want.dtype == torch.float16
    assert op_calls[0] == 1
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_torch_nn_multihead_attention_runs_the_op(op_calls):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True, device=DEVICE)
    x = _randn(2, 9, 32, seed=0, grad=False)
    want = mha(x, x, x, need_weights=False, is_causal=True, attn_mask=_causal(9))[0]
    with fastformer.patch_sdpa():
        got = mha(x, x, x, need_weights=False, is_causal=True, attn_mask=_causal(9))[0]
    assert op_calls[0] == 1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _causal(n: int) -> torch.Tensor:
    return torch.nn.Transformer.generate_square_subsequent_mask(n, device=DEVICE)


def test_a_compiled_call_keeps_the_op_in_its_graph():
    graphs = []

    def record(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    q, k, v = _qkv(grad=False)
    want = TORCH_SDPA(q, k, v, is_causal=True)
    fn = torch.compile(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        backend=record,
        fullgraph=True,
    )
    try:
        fn(q, k, v)  # compiled before the patch: traced again under it (docs/usage.md)
        with fastformer.patch_sdpa():
            got = fn(q, k, v)
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 2 and "fastformer.attention" not in graphs[0]
    assert "fastformer.attention" in graphs[1]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
