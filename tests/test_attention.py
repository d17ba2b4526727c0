"""Tests of fastformer.ops.attention and the Triton kernels of fastformer.kernels.attention.

Without a GPU the Triton kernels run through the interpreter (TRITON_INTERPRET=1, set by
conftest.py) on CPU tensors in float32 and float16; with a GPU the same tests run the compiled
kernels on CUDA, plus the `cuda`-marked ones (bfloat16, long sequences, determinism). Outputs and
gradients are held to the parity rule of DESIGN.md against fastformer.reference; dropout is
checked against the reference fed with the keep-mask regenerated from the seed the op drew
(`torch.manual_seed` + `draw_seed` predict it). `test_compile_report` compiles every sm_90
and sm_80 config without a GPU and checks spills, shared memory and (sm_90) wgmma.
"""

import contextlib
import fcntl
import functools
import itertools
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

from fastformer import reference as ref
from fastformer.ops import _dispatch, rng
from fastformer.ops import attention as attn
from fastformer.testing import assert_parity, compare_with_reference, max_abs_diff, parity

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(autouse=True)
def _default_backend(monkeypatch):
    # A developer's FASTFORMER_BACKEND_ATTENTION must not change what these tests check.
    monkeypatch.delenv("FASTFORMER_BACKEND_ATTENTION", raising=False)


def _randn(shape, dtype=F32, seed=0, grad=False, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=torch.float32)
    return t.to(device=device, dtype=dtype).requires_grad_(grad)


# --------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """One parity case: shapes, masks, dtype and layout of q/k/v."""

    b: int = 2
    h: int = 2
    hkv: int = 0  # 0: same as h
    lq: int = 64
    lk: int = 64
    d: int = 64
    dv: int = 0  # 0: same as d
    causal: bool = False
    mask: str = ""  # "", "bool", "float" (a float mask gets a gradient)
    # Which of (B, H, Lq, Lk) the mask has: "bhqk", "b1qk", "11qk", "b11k", "qk".
    mask_shape: str = "bhqk"
    mask_dtype: torch.dtype | None = None  # a float mask's dtype; None: the q/k/v dtype
    kpm: str = ""  # "", "random", "edges" (leading and trailing padding)
    dtype: torch.dtype = F32
    layout: str = "contiguous"  # "blhd": (B, L, H, D) storage seen as (B, H, L, D); "strided_d"
    scale: float | None = None
    grad: bool = True


def _qkv(c: Case) -> list[torch.Tensor]:
    hkv, dv = c.hkv or c.h, c.dv or c.d
    shapes = [(c.b, c.h, c.lq, c.d), (c.b, hkv, c.lk, c.d), (c.b, hkv, c.lk, dv)]
    out = []
    for seed, (b, h, seq, d) in enumerate(shapes):
        if c.layout == "blhd":  # a transposed view: strides passed to the kernel, no copy
            t = _randn((b, seq, h, d), c.dtype, seed).transpose(1, 2)
        elif c.layout == "strided_d":  # last stride 2: the op must copy
            t = _randn((b, h, seq, 2 * d), c.dtype, seed)[..., ::2]
        else:
            t = _randn((b, h, seq, d), c.dtype, seed)
        out.append(t.requires_grad_(c.grad))
    return out


def _attn_mask(c: Case) -> torch.Tensor | None:
    if not c.mask:
        return None
    full = {"b": c.b, "h": c.h, "q": c.lq, "k": c.lk, "1": 1}
    shape = [full[ch] for ch in c.mask_shape]
    if c.mask == "bool":
        g = torch.Generator().manual_seed(7)
        return (torch.rand(shape, generator=g) > 0.3).to(DEVICE)
    return _randn(shape, c.mask_dtype or c.dtype, seed=8, grad=c.grad)


def _key_padding(c: Case) -> torch.Tensor | None:
    if not c.kpm:
        return None
    if c.kpm == "random":
        g = torch.Generator().manual_seed(9)
        return (torch.rand(c.b, c.lk, generator=g) > 0.7).to(DEVICE)
    kpm = torch.zeros(c.b, c.lk, dtype=torch.bool)
    kpm[0, : c.lk // 3] = True  # leading padding: whole key tiles skipped before the loop
    kpm[-1, c.lk // 2 :] = True  # trailing padding
    return kpm.to(DEVICE)


def _parity(c: Case, with_lse: bool = False) -> None:
    q, k, v = _qkv(c)
    mask, kpm = _attn_mask(c), _key_padding(c)
    gqa = (c.hkv or c.h) != c.h
    kw = dict(is_causal=c.causal, scale=c.scale, enable_gqa=gqa, key_padding_mask=kpm)
    fast_fn = (
        attn.scaled_dot_product_attention_with_lse
        if with_lse
        else attn.scaled_dot_product_attention
    )
    inputs, names = [q, k, v], ["q", "k", "v"]
    if mask is not None and mask.is_floating_point() and c.grad:
        inputs.append(mask)
        names.append("attn_mask")

    def fast(q, k, v, m=mask):
        return fast_fn(q, k, v, m, **kw)

    def reference(q, k, v, m=mask):
        return ref.scaled_dot_product_attention(q, k, v, m, return_lse=with_lse, **kw)

    results = compare_with_reference(fast, reference, inputs, names=names)
    assert_parity(results)


CASES = {
    "plain_d64": Case(),
    "causal_l97_d40": Case(lq=97, lk=97, d=40, causal=True),
    "causal_lq129_gt_lk97_d16": Case(lq=129, lk=97, d=16, causal=True),
    "causal_lq7_lt_lk129_d80": Case(lq=7, lk=129, d=80, causal=True),
    "l1": Case(lq=1, lk=1, d=16),
    "l7_causal": Case(lq=7, lk=7, d=16, causal=True),
    "kpm_random_l129": Case(lq=33, lk=129, kpm="random"),
    "kpm_edges_causal": Case(lq=97, lk=97, d=16, kpm="edges", causal=True),
    "bool_mask_b1qk_d96": Case(lq=33, lk=65, d=96, mask="bool", mask_shape="b1qk"),
    "float_mask_11qk": Case(lq=33, lk=47, d=32, mask="float", mask_shape="11qk"),
    "float_mask_b11k": Case(lq=33, lk=47, d=32, mask="float", mask_shape="b11k"),
    "float_mask_qk": Case(lq=33, lk=47, d=32, mask="float", mask_shape="qk"),
    "all_masks_d128": Case(lq=65, lk=97, d=128, causal=True, mask="float", kpm="random"),
    "bool_mask_causal_kpm": Case(lq=65, lk=33, d=16, causal=True, mask="bool", kpm="edges"),
    "gqa": Case(h=4, hkv=2, lq=33, lk=65, d=32, causal=True),
    "mqa": Case(h=4, hkv=1, lq=33, lk=33, d=32, kpm="random"),
    "batch1": Case(b=1, h=3, lq=65, lk=65, d=64),
    "blhd_views": Case(lq=47, lk=65, d=40, layout="blhd", causal=True),
    "strided_head_dim": Case(lq=33, lk=33, d=16, layout="strided_d", mask="float"),
    "dv_ne_d": Case(lq=33, lk=47, d=40, dv=24),
    "scale": Case(lq=33, lk=33, d=16, scale=0.3, causal=True),
    "d160_dv136_kpm": Case(b=1, lq=33, lk=40, d=160, dv=136, causal=True, kpm="random"),
    # float32 keeps one dK/dV launch at every head dim; 16-bit inputs take the two (dkdv_parts).
    "fp16_d160_split_dkdv": Case(b=1, lq=33, lk=40, d=160, dv=136, causal=True, dtype=F16),
    "fp16_causal_kpm": Case(lq=97, lk=97, d=64, causal=True, kpm="random", dtype=F16),
    # 16-bit masks without key padding: their own key and query loop orders (EDGE_FIRST,
    # EDGE_LOOP), the partial last query block a loop of its own not causal at d > 64.
    "fp16_float_mask_causal": Case(lq=97, lk=97, d=64, causal=True, mask="float", dtype=F16),
    "fp16_bool_mask_d96": Case(lq=47, lk=65, d=96, mask="bool", dtype=F16),
    "fp16_fp32_mask_gqa": Case(
        h=4, hkv=2, lq=33, lk=65, d=64, mask="float", mask_dtype=F32, dtype=F16
    ),
    # A float32 mask makes the 16-bit reference compute in float32: the backward's delta from
    # the float16 O took dk to 1.18x and d attn_mask to 2.16x the bound (float32 O: 0.11, 0.19).
    "fp16_fp32_mask_l1": Case(
        lq=1, lk=5, d=16, mask="float", mask_dtype=F32, dtype=F16, scale=1.48
    ),
}


def _use_backend(monkeypatch, backend: str) -> None:
    if backend != "default":
        monkeypatch.setenv("FASTFORMER_BACKEND_ATTENTION", backend)


def _assert_qkv_parity(q, k, v, **kw) -> None:
    """The op's output and q, k, v gradients against the reference's, with the same keywords."""
    results = compare_with_reference(
        lambda q, k, v: attn.scaled_dot_product_attention(q, k, v, **kw),
        lambda q, k, v: ref.scaled_dot_product_attention(q, k, v, **kw),
        [q, k, v],
        names=["q", "k", "v"],
    )
    assert_parity(results)


# "torch": on CPU without dropout, torch's CPU flash kernels fed with fastformer's masks.
@pytest.mark.parametrize("backend", ["default", "torch"])
@pytest.mark.parametrize("name", list(CASES))
def test_parity(monkeypatch, name, backend):
    _use_backend(monkeypatch, backend)
    _parity(CASES[name])


def test_parity_head_dim_256_forward():
    _parity(Case(b=1, lq=33, lk=47, d=256, causal=True, grad=False))


@pytest.mark.parametrize("backend", ["default", "torch"])
def test_parity_with_lse(monkeypatch, backend):
    # The lse output is differentiable too: its cotangent enters the backward through delta.
    _use_backend(monkeypatch, backend)
    _parity(Case(lq=33, lk=65, d=32, causal=True, mask="float", kpm="random"), with_lse=True)


# torch's CausalBias masks: upper left runs as is_causal, lower right as is_causal where square,
# else as its bool mask; (65, 33) leaves the first 32 rows without a key, which are 0.
CAUSAL_BIASES = {
    "upper_left": (causal_upper_left, 33, 65),
    "lower_right_decoding": (causal_lower_right, 1, 65),
    "lower_right_lq_lt_lk": (causal_lower_right, 33, 65),
    "lower_right_square": (causal_lower_right, 47, 47),
    "lower_right_lq_gt_lk": (causal_lower_right, 65, 33),
}


@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")
@pytest.mark.parametrize("backend", ["default", "torch"])
@pytest.mark.parametrize("name", list(CAUSAL_BIASES))
def test_parity_with_a_causal_bias(monkeypatch, name, backend):
    _use_backend(monkeypatch, backend)
    make, lq, lk = CAUSAL_BIASES[name]
    q, k, v = _qkv(Case(lq=lq, lk=lk, d=32))
    bias = make(lq, lk)
    results = compare_with_reference(
        lambda q, k, v: attn.scaled_dot_product_attention(q, k, v, bias),
        lambda q, k, v: ref.scaled_dot_product_attention(q, k, v, bias),
        [q, k, v],
        names=["q", "k", "v"],
    )
    assert_parity(results)


@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")
@pytest.mark.parametrize("name", list(CAUSAL_BIASES))
def test_reference_reads_a_causal_bias_as_torch_s_sdpa(name):
    # The reference against torch's own meaning of the bias, on the rows that see a key (torch
    # warns its kernels may leave a row without one NaN; the reference and the op make it 0).
    make, lq, lk = CAUSAL_BIASES[name]
    q, k, v = (t.double().detach() for t in _qkv(Case(lq=lq, lk=lk, d=32)))
    bias = make(lq, lk)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    got = ref.scaled_dot_product_attention(q, k, v, bias)
    seen = slice(max(lq - lk, 0) if make is causal_lower_right else 0, None)
    torch.testing.assert_close(got[:, :, seen], want[:, :, seen], rtol=1e-12, atol=1e-12)
    assert torch.all(got[:, :, : seen.start] == 0)


@pytest.mark.parametrize("use", ["out", "lse"])
def test_gradient_of_one_output_alone(use):
    """Eager autograd gets no cotangent for the unused output (out or lse): the gradients are
    those of the used one alone, as the reference's autograd gives them."""
    c = Case(lq=33, lk=47, d=32, causal=True)
    q, k, v = _qkv(c)
    grads = []
    for fn in (attn.scaled_dot_product_attention_with_lse, ref.scaled_dot_product_attention):
        leaves = [t.detach().double().requires_grad_() if fn is ref.scaled_dot_product_attention
                  else t.detach().requires_grad_() for t in (q, k, v)]  # fmt: skip
        kwargs = {"return_lse": True} if fn is ref.scaled_dot_product_attention else {}
        out, lse = fn(*leaves, is_causal=True, **kwargs)
        (out.square().sum() if use == "out" else lse.sum()).backward()
        # lse does not depend on v: the reference leaves v.grad None, fastformer gives zeros.
        grads.append([torch.zeros(t.shape) if t.grad is None else t.grad.float() for t in leaves])
    for got, want in zip(*grads):
        assert max_abs_diff(got, want) < 1e-4 * max(1.0, want.abs().max().item())


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter tile config is a CPU-test knob")
@pytest.mark.parametrize("blocks", [(16, 32), (64, 16), (128, 128)])
@pytest.mark.parametrize("qk_tiles", [False, True], ids=["kq_tiles", "qk_tiles"])
def test_parity_other_tile_shapes(monkeypatch, blocks, qk_tiles):
    # GPU configs have BLOCK_M != BLOCK_N: the causal / padding loop bounds must hold for them,
    # with dK/dV on (key x query) and on (query x key) tiles; and the largest GPU tiles.
    from fastformer.kernels import attention as kernels

    monkeypatch.setattr(kernels, "INTERPRET_CONFIG", kernels.Config(*blocks, 4, 1, qk_tiles))
    _parity(Case(lq=97, lk=81, d=16, causal=True, kpm="edges", mask="bool", mask_shape="qk"))


def _gpu_tile_shapes() -> list[tuple[int, int, bool]]:
    from fastformer.kernels import attention as kernels

    configs = (c for configs in kernels.CONFIGS.values() for c in configs)
    return sorted({(c.block_m, c.block_n, c.qk_tiles) for c in configs})


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter tile config is a CPU-test knob")
@pytest.mark.parametrize("i, shape", list(enumerate(_gpu_tile_shapes())), ids=str)
def test_parity_and_bounds_of_every_gpu_tile_shape(monkeypatch, i, shape):
    # Each (BLOCK_M, BLOCK_N, qk_tiles) of the GPU tables, every other one as its TMA twin,
    # on partial blocks of rows and keys, GQA, padding, causal and a float32 mask with its
    # gradient: parity, and (conftest) no access outside the tensors.
    from fastformer.kernels import attention as kernels

    config = kernels.Config(*shape[:2], 4, 1, shape[2], tma=i % 2 == 1)
    monkeypatch.setattr(kernels, "INTERPRET_CONFIG", config)
    c = Case(b=1, h=2, hkv=1, lq=97, lk=81, d=40, dv=24, causal=True, kpm="edges", mask="float")
    _parity(replace(c, mask_shape="b1qk", mask_dtype=F32, layout="blhd", dtype=F16))


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter tile config is a CPU-test knob")
@pytest.mark.parametrize("qk_tiles", [False, True], ids=["kq_tiles", "qk_tiles"])
def test_dkdv_runs_the_tile_orientation_its_config_names(monkeypatch, qk_tiles):
    # Both orientations give the same gradients, so parity cannot tell which one ran; only the
    # (key x query) one caps P at 1, which GPU configs without qk_tiles rely on.
    from fastformer.kernels import attention as kernels

    ran = []
    for name in ("_dkdv_tile_t", "_dkdv_tile_n"):
        real = getattr(kernels, name)
        monkeypatch.setattr(
            kernels, name, lambda *a, _r=real, _n=name, **k: ran.append(_n) or _r(*a, **k)
        )
    monkeypatch.setattr(kernels, "INTERPRET_CONFIG", kernels.Config(32, 32, 4, 1, qk_tiles))
    q, k, v = _qkv(Case(b=1, h=1, lq=40, lk=40, d=16))
    attn.scaled_dot_product_attention(q, k, v).sum().backward()
    assert set(ran) == {"_dkdv_tile_n" if qk_tiles else "_dkdv_tile_t"}, ran


def test_dkdv_caps_p_at_one_where_the_row_stat_rounds_low():
    # The (key x query) tiles' k @ q^T may round a dominant score above the forward's row max,
    # and P came out 1 + 1.2e-4 where the reference's is 1 (a GPU case). A CPU rounds both
    # orientations alike, so a log2-sum lowered by 2**-10 stands in for that rounding: with one
    # key P is 1, and dV must be the column sum of dO, not 1.0007 times it.
    from fastformer.kernels import attention as kernels

    q, k, v = (_randn((1, 1, 5, 16), seed=s) for s in range(3))
    k, v = k[:, :, :1], v[:, :, :1]
    mask = torch.zeros(5, 1, device=DEVICE)  # a float mask: P from the stat, as _probs takes it
    config = kernels.Config(32, 32, 4, 1, False)
    stat = torch.empty(1, 1, 5, 2, device=DEVICE)
    out, lse = kernels.attention_forward(
        q, k, v, mask, None, 0, 0.0, False, 0.25, config, stat=stat
    )
    stat[..., 1] -= 2**-10
    grad_out = _randn(out.shape, seed=3)
    _, _, dv, _ = kernels.attention_backward(
        grad_out, None, q, k, v, out, lse, mask, None, 0, 0.0, False, 0.25, False, config,
        stat=stat,
    )  # fmt: skip
    dv64 = grad_out.double().sum(2, keepdim=True)
    assert max_abs_diff(dv, dv64) <= 1e-5, max_abs_diff(dv, dv64)


def test_lse_matches_reference_and_is_float32():
    c = Case(lq=33, lk=47, d=32, causal=True, dtype=F16, grad=False)
    q, k, v = _qkv(c)
    out, lse = attn.scaled_dot_product_attention_with_lse(q, k, v, is_causal=True)
    assert out.dtype == F16 and lse.dtype == F32 and lse.shape == (2, 2, 33)
    _, lse64 = ref.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=True, return_lse=True
    )
    assert max_abs_diff(lse, lse64) < 1e-4


@pytest.mark.parametrize("backend", ["default", "torch"])
@pytest.mark.parametrize("hkv", [2, 1], ids=["", "gqa"])
def test_batch_zero_with_key_padding(monkeypatch, backend, hkv):
    # (GQA's head sum once asked reshape for a -1 dim of 0 elements, and raised)
    _use_backend(monkeypatch, backend)
    q = _randn((0, 2, 4, 16), grad=True)
    k, v = (_randn((0, hkv, 4, 16), seed=s, grad=True) for s in (1, 2))
    kpm = torch.zeros(0, 4, dtype=torch.bool, device=DEVICE)
    out = attn.scaled_dot_product_attention(q, k, v, key_padding_mask=kpm, enable_gqa=hkv == 1)
    out.sum().backward()
    assert out.shape == (0, 2, 4, 16)
    assert all(t.grad.shape == t.shape for t in (q, k, v))


@pytest.mark.parametrize("backend", ["default", "torch"])
@pytest.mark.parametrize("lq, lk", [(0, 5), (5, 0)])
@pytest.mark.parametrize("padding", [False, True], ids=["", "kpm"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
@pytest.mark.parametrize("hkv", [2, 1], ids=["", "gqa"])
def test_empty_sequences(monkeypatch, backend, lq, lk, padding, dropout_p, hkv):
    # No keys at all is every key masked: out 0, lse -inf, zero gradients (torch's SDPA gives
    # 0 too); the reference's softmax once raised on the empty key dim, GQA's head sum on its
    # reshape.
    _use_backend(monkeypatch, backend)
    q = _randn((2, 2, lq, 16), grad=True)
    k, v = _randn((2, hkv, lk, 16), seed=1, grad=True), _randn((2, hkv, lk, 8), seed=2, grad=True)
    kpm = torch.zeros(2, lk, dtype=torch.bool, device=DEVICE) if padding else None
    out, lse = attn.scaled_dot_product_attention_with_lse(
        q, k, v, dropout_p=dropout_p, key_padding_mask=kpm, is_causal=True, enable_gqa=hkv == 1
    )
    assert out.shape == (2, 2, lq, 8) and torch.all(out == 0) and torch.all(torch.isneginf(lse))
    out.sum().backward()
    assert all(torch.all(t.grad == 0) for t in (q, k, v))


@pytest.mark.parametrize("backend", ["default", "torch"])
def test_nan_in_a_query_row_gives_that_row_nan(monkeypatch, backend):
    # torch's CPU flash kernel (the torch backend) takes a row whose max score is NaN for a row
    # without keys: out 0, lse 0, the NaN hidden. A row the mask leaves no key stays 0.
    _use_backend(monkeypatch, backend)
    q, k, v = (_randn((1, 2, 5, 16), seed=s, grad=True) for s in range(3))
    with torch.no_grad():
        q[0, 0, 1, 3] = q[0, 1, 4, 0] = float("nan")
    mask = torch.ones(5, 5, dtype=torch.bool, device=DEVICE)
    mask[4] = False  # row 4: no key, so 0 (and gradients 0) even with a NaN query
    for attn_mask in (None, mask):
        out, lse = attn.scaled_dot_product_attention_with_lse(q, k, v, attn_mask=attn_mask)
        want = ref.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        torch.testing.assert_close(out, want, equal_nan=True)
        assert torch.equal(lse.isnan(), want.isnan().any(-1))
        # (With the mask, the torch backend's dk is 0 where the reference's is 0 * NaN: the
        # empty row's dS of 0 times its NaN query. So dq and dv there.)
        inputs = (q, k, v) if attn_mask is None else (q, v)
        grads = torch.autograd.grad(out, inputs, torch.ones_like(out))
        for got, expected in zip(grads, torch.autograd.grad(want, inputs, torch.ones_like(out))):
            torch.testing.assert_close(got, expected, equal_nan=True)


def test_triton_nan_key_hidden_by_a_bool_mask_gets_zero_gradients(monkeypatch):
    # Rows past Lq in a dK/dV tile (q = 0) loaded the bool mask as "allowed": their score
    # against the hidden NaN key was NaN, and so were its dK and dV (the reference's are 0).
    _use_backend(monkeypatch, "triton")
    q = _randn((1, 1, 5, 16))
    k, v = _randn((1, 1, 4, 16), seed=1, grad=True), _randn((1, 1, 4, 16), seed=2, grad=True)
    with torch.no_grad():
        k[0, 0, 2, 0] = float("nan")
    mask = torch.ones(5, 4, dtype=torch.bool, device=DEVICE)
    mask[:, 2] = False
    grads = []
    for fn in (attn.scaled_dot_product_attention, ref.scaled_dot_product_attention):
        out = fn(q, k, v, attn_mask=mask)
        grads.append(torch.autograd.grad(out, (k, v), torch.ones_like(out)))
    for got, want in zip(*grads):
        assert torch.isfinite(got).all() and torch.all(got[0, 0, 2] == 0)
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", ["default", "torch"])
@pytest.mark.parametrize("shape", [(2, 0, 3), (0, 2, 3)], ids=["no_heads", "no_batch"])
@pytest.mark.parametrize("hkv", [None, 2], ids=["", "gqa"])
def test_no_heads_or_batches(monkeypatch, backend, shape, hkv):
    # The Triton backward divided the heads by the kv heads: 0 // 0 (ZeroDivisionError); with
    # GQA, no query heads over 2 kv heads made a group of 0, and dk, dv came out (b, 0, ...).
    _use_backend(monkeypatch, backend)
    b, h, lq = shape
    hkv = h if hkv is None else hkv
    q = _randn((b, h, lq, 8), grad=True)
    k, v = _randn((b, hkv, 4, 8), seed=1, grad=True), _randn((b, hkv, 4, 8), seed=2, grad=True)
    out = attn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hkv != h)
    assert out.shape == (b, h, lq, 8)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert all(torch.all(g == 0) for g in grads)


@pytest.mark.parametrize("backend", ["default", "torch"])
@pytest.mark.parametrize("scale", [1e-300, 1e-46])
def test_a_scale_below_float32s_range_averages_the_visible_keys(monkeypatch, backend, scale):
    # scale * log2(e) rounded to 0 in float32 and the Triton kernels' masked keys (padding past
    # Lk, causal) became -inf * 0 = NaN: every score is ~0, softmax uniform over the visible
    # keys (torch's SDPA gives NaN for the causal case too; the float64 reference does not).
    _use_backend(monkeypatch, backend)
    q, k, v = _qkv(Case(b=1, h=2, lq=5, lk=3, d=8, grad=False))
    out = attn.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    q64, k64, v64 = (t.double() for t in (q, k, v))
    expected = ref.scaled_dot_product_attention(q64, k64, v64, is_causal=True, scale=scale)
    torch.testing.assert_close(out, expected.float())


def test_strided_slices_past_int32_are_copied():
    from fastformer.kernels import attention as kernels

    # (B, L, H, D) storage seen as (B, H, L, D): a slice spans L*H*D elements (meta: no memory).
    x = torch.empty(1, 2**22, 64, 16, device="meta").transpose(1, 2)
    assert kernels.slice_extent(x) >= kernels.INT32_LIMIT
    assert kernels._kernel_layout(x).is_contiguous()
    small = torch.empty(1, 64, 8, 16, device="meta").transpose(1, 2)
    assert kernels._kernel_layout(small) is small  # a view that fits is used as is
    # A key padding mask that is a column of a wider buffer: key * stride passed int32 (the
    # last keys' flags were read 2 GiB before the mask; reproduced in the interpreter).
    column = torch.empty(2, 32769, 2**16, dtype=torch.bool, device="meta")[:, :, 0]
    assert kernels._kpm_layout(column).stride() == (32769, 1)
    strided = torch.empty(2, 64, 4, dtype=torch.bool, device="meta")[:, :, 0]
    assert kernels._kpm_layout(strided).stride() == strided.stride()  # fits: read in place
    ranges = torch.zeros(2, 2, dtype=torch.int32, device="meta")
    assert kernels._padding(column, ranges, ranges).strides == (32769, 1)  # what launches get


# --------------------------------------------------------------------------- fully masked rows


@pytest.mark.parametrize("backend", ["default", "torch"])
@pytest.mark.parametrize("lse_grad", [True, False], ids=["out_and_lse", "out"])
def test_fully_masked_rows_are_zero_with_zero_gradients(monkeypatch, backend, lse_grad):
    _use_backend(monkeypatch, backend)
    b, h, lq, lk, d = 2, 2, 33, 40, 16
    q, k, v = (
        _randn(s, seed=i, grad=True)
        for i, s in enumerate([(b, h, lq, d), (b, h, lk, d), (b, h, lk, d)])
    )
    kpm = torch.zeros(b, lk, dtype=torch.bool, device=DEVICE)
    kpm[1] = True  # batch 1: every key is padding
    mask = torch.ones(lq, lk, dtype=torch.bool, device=DEVICE)
    mask[5] = False  # row 5 of batch 0 sees nothing either
    out, lse = attn.scaled_dot_product_attention_with_lse(q, k, v, mask, key_padding_mask=kpm)
    loss = out.sum() + (lse.masked_fill(torch.isinf(lse), 0).sum() if lse_grad else 0)
    loss.backward()
    assert torch.all(out[1] == 0) and torch.all(out[0, :, 5] == 0)
    assert torch.all(torch.isneginf(lse[1])) and torch.all(torch.isneginf(lse[0, :, 5]))
    assert torch.isfinite(lse[0, :, :5]).all()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.all(q.grad[1] == 0) and torch.all(q.grad[0, :, 5] == 0)
    assert torch.all(k.grad[1] == 0) and torch.all(v.grad[1] == 0)


@pytest.mark.parametrize("backend", ["default", "torch"])
def test_fully_masked_rows_parity_float_mask(monkeypatch, backend):
    # A float mask of -inf on whole rows (and causal with Lq > Lk leaves no row empty: mix both).
    _use_backend(monkeypatch, backend)
    c = Case(lq=33, lk=40, d=16, mask="float", mask_shape="b1qk", causal=True, kpm="edges")
    q, k, v = _qkv(c)
    mask = _attn_mask(c).detach().clone()
    mask[0, 0, 3] = float("-inf")
    mask.requires_grad_(True)
    kw = dict(is_causal=True, key_padding_mask=_key_padding(c))
    results = compare_with_reference(
        lambda q, k, v, m: attn.scaled_dot_product_attention(q, k, v, m, **kw),
        lambda q, k, v, m: ref.scaled_dot_product_attention(q, k, v, m, **kw),
        [q, k, v, mask],
        names=["q", "k", "v", "attn_mask"],
    )
    assert_parity(results)


@pytest.mark.parametrize("mask_grad", [True, False])
@pytest.mark.parametrize("backend", ["default", "torch"])
@pytest.mark.parametrize("bias", [-1e4, -1e9, torch.finfo(torch.float32).min])
def test_rows_under_one_large_negative_bias_average_their_values(
    monkeypatch, backend, bias, mask_grad
):
    # Every key of some rows carries the same large negative bias (finfo.min: Hugging Face's
    # masks), so softmax gives each key 1 / Lk (a shift of a row changes nothing; zero queries
    # there make it exact in float32 too). The kernel's forward made a finfo.min row -inf (a
    # zero row), and its backward recomputed P from an LSE that float32 had rounded to the bias
    # alone (P = 1, or 0, for every key instead of 1 / Lk).
    _use_backend(monkeypatch, backend)
    b, h, lq, lk, d = 2, 2, 9, 12, 16
    q, k, v = _randn((b, h, lq, d)), _randn((b, h, lk, d), seed=1), _randn((b, h, lk, d), seed=2)
    rows = [1, 4, 8]
    q[:, :, rows] = 0
    mask = _randn((lq, lk), seed=4)
    mask[rows] = bias
    mask[4, :5] = float("-inf")  # and some keys masked outright
    kpm = torch.zeros(b, lk, dtype=torch.bool, device=DEVICE)
    kpm[1, -3:] = True
    inputs = [t.requires_grad_() for t in (q, k, v, mask)]
    kw = dict(key_padding_mask=kpm)
    if not mask_grad:  # (the torch backend's CPU flash backward then; it has the same fault)
        inputs[3].requires_grad_(False)
    results = compare_with_reference(
        lambda q, k, v, m: attn.scaled_dot_product_attention(q, k, v, m, **kw),
        lambda q, k, v, m: ref.scaled_dot_product_attention(q, k, v, m, **kw),
        inputs,
        names=["q", "k", "v", "attn_mask"],
    )
    assert_parity(results)
    out = attn.scaled_dot_product_attention(*inputs[:3], mask.detach(), **kw)
    kept = ~kpm[:, None, :, None]
    average = (v * kept).sum(2) / kept.sum(2)  # rows 1 and 8: every unpadded key alike
    torch.testing.assert_close(out[:, :, 1], average, atol=1e-5, rtol=1e-5)


def test_float_mask_of_1e3_dominant_probabilities_stay_at_most_1():
    # A bias of ~1e3 makes one key take a row (P = 1). The dK/dV tiles compute k @ q^T where
    # the forward computed q @ k^T: a score one float32 ulp (1.2e-4 at 1934) above the saved
    # row max gave P = 1.00012 and dv 5.4x the parity bound (found by a float-mask hunt). The
    # other sign of that rounding (P = 1 - 1.2e-4) is not caught by the cap (NOTES.md).
    q = _randn((1, 1, 65, 64))
    k, v = _randn((1, 1, 33, 64), seed=1), _randn((1, 1, 33, 64), seed=2)
    mask = _randn((1, 1, 65, 33), seed=3) * 2 + _randn((1, 1, 65, 33), seed=4) * 1e3
    results = compare_with_reference(
        lambda q, k, v: attn.scaled_dot_product_attention(q, k, v, mask),
        lambda q, k, v: ref.scaled_dot_product_attention(q, k, v, mask),
        [t.requires_grad_() for t in (q, k, v)],
        names=["q", "k", "v"],
    )
    assert_parity(results)


# (The interpreter's warning: a dK/dV tile's rows past Lk, never stored, overflow to inf.)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")
@pytest.mark.parametrize("backend", ["default", "torch"])
@pytest.mark.parametrize("bias", [2000.0, -2000.0])
def test_float_mask_of_large_values(monkeypatch, backend, bias):
    # torch's CPU flash backward recomputes P from a float32 LSE, which at |LSE| ~ 2000 has
    # lost 2**-13 of it: its gradients missed the parity bound (found by a fuzzer). In the
    # kernels, -2000 on every key (no key_padding_mask) makes a key past Lk in the dQ edge tile,
    # scored 0 if not hidden, exp(2000) times a real one: dQ NaN (a mutation run's `<= Lk`).
    # q and k are multiples of 1/8, so every order of summing q . k gives it exactly: the dK/dV
    # kernel forms k @ q^T where the forward formed q @ k^T, and at |score| ~ 2000 one float32
    # ulp between the two is 1.2e-4 of P. The interpreter's numpy (OpenBLAS, Haswell kernels)
    # on an AMD VM gave the two orders different bits in 22% of the products, and dV 1.5x the
    # bound (the reference forms P once); an Intel VM's passed.
    _use_backend(monkeypatch, backend)
    b, h, lq, lk, d = 1, 4, 40, 40, 32
    q, k, v = (_randn((b, h, n, d), seed=i) for i, n in enumerate((lq, lk, lk)))
    q, k = ((t * 8).round() / 8 for t in (q, k))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = _randn((lq, lk), seed=3)
    if bias > 0:  # two dominant keys a row
        rows = torch.arange(lq)
        mask[rows, rows % lk] += bias
        mask[rows, (7 * rows + 3) % lk] += bias
    else:
        mask += bias
    results = compare_with_reference(
        lambda q, k, v: attn.scaled_dot_product_attention(q, k, v, mask, scale=2.0),
        lambda q, k, v: ref.scaled_dot_product_attention(q, k, v, mask, scale=2.0),
        [q, k, v],
        names=["q", "k", "v"],
    )
    assert_parity(results)


@pytest.mark.parametrize("backend", ["default", "torch"])
@pytest.mark.parametrize(
    "masks, scale",
    [("none", 3.0), ("none", 30.0), ("none", 1e3), ("causal_padding", 30.0),
     ("causal_padding", 300.0)],
)  # fmt: skip
def test_float32_gradients_at_large_logits(monkeypatch, backend, masks, scale):
    # |LSE| up to ~3e4 (scale 1e3 on N(0, 1) inputs, d64). P recomputed from the float32 LSE,
    # which rounds at its magnitude, is off by up to 2**-24 * |LSE| of itself: dV was 64x the
    # parity bound in the Triton kernels; torch's CPU flash backward missed it from |LSE| ~ 100
    # (dq 1.01x at scale 3, dv 571x at 1e3). The kernels now keep the row max and log2 of the
    # sum apart for float32 (`Stat`), and the torch backend takes its own backward there.
    # The interpreter's tl.dot (numpy) rounds k @ q^T unlike q @ k^T, which the forward takes:
    # on CPU, dK/dV run on (query x key) tiles (NOTES.md). Not in the grid, as they miss the
    # bound on CPU for other reasons: causal + padding at scale 100 (the interpreter's forward
    # out 1.18x) and 1e3 (dq 24x in rows whose exact gradient is 0: FlashAttention's delta,
    # rowsum(dO * O), does not cancel dP exactly; the reference's rowsum(P * dP) does).
    _use_backend(monkeypatch, backend)
    if DEVICE == "cpu":
        from fastformer.kernels import attention as kernels

        monkeypatch.setattr(kernels, "INTERPRET_CONFIG", kernels.Config(32, 32, 4, 1, True))
    b, h, lq, lk, d = 1, 2, 65, 47, 64
    q, k, v = (_randn((b, h, n, d), seed=i, grad=True) for i, n in enumerate((lq, lk, lk)))
    kw = dict(scale=scale)
    if masks == "causal_padding":
        kpm = torch.zeros(b, lk, dtype=torch.bool, device=DEVICE)
        kpm[:, 3:9] = True
        kw.update(is_causal=True, key_padding_mask=kpm)
    _assert_qkv_parity(q, k, v, **kw)


# --------------------------------------------------------------------------- dropout


def _predicted_seed(manual_seed: int, device=DEVICE) -> int:
    torch.manual_seed(manual_seed)
    return rng.draw_seed(device)


DROPOUT_CASES = {
    "fp32_causal_kpm": Case(lq=33, lk=47, d=32, causal=True, kpm="random"),
    "fp16_gqa_float_mask": Case(h=4, hkv=2, lq=47, lk=33, d=16, mask="float", dtype=F16),
    # The torch backend lost up to ~3x the bound in 16 bits before it computed in float32.
    "fp16_causal_float_mask": Case(
        b=1, lq=7, lk=47, d=16, causal=True, mask="float", mask_shape="qk", dtype=F16
    ),
    "fp16_dv8": Case(b=1, lq=7, lk=64, d=64, dv=8, dtype=F16, scale=0.5),
    "bf16_causal": Case(b=1, lq=16, lk=64, d=64, causal=True, dtype=BF16, scale=0.5),
}


@pytest.mark.parametrize("backend", ["default", "torch"])
@pytest.mark.parametrize("c", DROPOUT_CASES.values(), ids=DROPOUT_CASES.keys())
def test_dropout_parity_with_regenerated_mask(monkeypatch, c, backend):
    _use_backend(monkeypatch, backend)
    _dropout_parity(c)


def _dropout_parity(c: Case) -> None:
    p = 0.3
    q, k, v = _qkv(c)
    mask, kpm = _attn_mask(c), _key_padding(c)
    keep = attn.dropout_keep_mask(_predicted_seed(11), c.b, c.h, c.lq, c.lk, p, device=DEVICE)
    gqa = (c.hkv or c.h) != c.h
    kw = dict(is_causal=c.causal, scale=c.scale, enable_gqa=gqa, key_padding_mask=kpm)
    inputs = [q, k, v] + ([mask] if mask is not None else [])

    def fast(q, k, v, m=None):
        torch.manual_seed(11)
        return attn.scaled_dot_product_attention(q, k, v, m, p, **kw)

    def reference(q, k, v, m=None):
        return ref.scaled_dot_product_attention(q, k, v, m, p, dropout_mask=keep, **kw)

    assert_parity(compare_with_reference(fast, reference, inputs))


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter tile config is a CPU-test knob")
@pytest.mark.parametrize("blocks", [(16, 16), (32, 64)], ids=["half_block", "two_blocks"])
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("qk_tiles", [False, True], ids=["kq_tiles", "qk_tiles"])
def test_dropout_parity_other_tile_shapes(monkeypatch, blocks, dtype, qk_tiles):
    # Key tiles of 16 columns (half a 32-column block of the scheme) and of 64 (two blocks)
    # assemble the mask differently from the default 32: forward and all three gradients, with
    # dK/dV on (key x query) tiles (the mask transposed) and on (query x key) tiles.
    from fastformer.kernels import attention as kernels

    monkeypatch.setattr(kernels, "INTERPRET_CONFIG", kernels.Config(*blocks, 4, 1, qk_tiles))
    c = Case(lq=47, lk=81, d=16, causal=True, kpm="edges", dtype=dtype)
    _dropout_parity(c)


@pytest.mark.parametrize("lk", [64, 45], ids=["whole_blocks", "partial_last_block"])
def test_dropout_mask_read_back_from_the_kernel(lk):
    # q = k = 0 gives uniform probabilities 1/Lk and v = identity reads them back: out * Lk *
    # (1 - p) is exactly the kernel's keep-mask, which must be dropout_keep_mask(seed) element
    # for element (the kernel's column order within a 32-column block included).
    p = 0.25
    expected = _kernel_keep_mask_read_back(lk, p)
    n = expected.numel()
    rate = expected.float().mean().item()
    assert abs(rate - (1 - p)) <= 5 * math.sqrt(p * (1 - p) / n)


def _kernel_keep_mask_read_back(lk: int, p: float) -> torch.Tensor:
    """The kernel's keep-mask read back (see above), asserted equal to dropout_keep_mask's."""
    b, h, lq = 2, 2, 64
    q = torch.zeros(b, h, lq, 16, device=DEVICE)
    k = torch.zeros(b, h, lk, 16, device=DEVICE)
    v = torch.eye(lk, device=DEVICE).expand(b, h, lk, lk)
    torch.manual_seed(3)
    out = attn.scaled_dot_product_attention(q, k, v, dropout_p=p)
    kept = out * lk * (1 - p)
    assert torch.allclose(kept, kept.round(), atol=1e-4)
    expected = attn.dropout_keep_mask(_predicted_seed(3), b, h, lq, lk, p, device=DEVICE)
    assert torch.equal(kept.round().bool(), expected)
    return expected


@pytest.mark.parametrize("lk", [5, 45, 64, 1030], ids=str)
def test_key_range_is_each_row_s_first_and_last_kept_key(lk):
    # Parity cannot see a range that is too wide (the extra tiles are all hidden keys: the
    # kernels only lose their skipping) nor one cut at a block edge by chance.
    from fastformer.kernels import attention as kernels

    g = torch.Generator().manual_seed(lk)
    kpm = torch.rand(6, lk, generator=g) < 0.5
    kpm[0] = True  # every key padding: (0, 0)
    kpm[1] = False
    kpm[2, : lk // 2] = True  # leading padding
    kpm[3, lk // 3 :] = True  # trailing padding
    kpm[4] = True
    kpm[4, -1] = False  # only the last key
    kept = [torch.nonzero(~row).flatten().tolist() for row in kpm]
    want = [(r[0], r[-1] + 1) if r else (0, 0) for r in kept]
    assert kernels.key_range(kpm.to(DEVICE)).tolist() == [list(w) for w in want]


def test_dropout_keeps_a_lane_equal_to_the_threshold():
    # A lane is kept when its 16 random bits are >= the threshold p * 2**16: a kernel keeping
    # only those above it differs on 1 score in 65536, which no other test draws. Find a
    # threshold that one lane of the read-back's mask equals, and read the mask back there.
    seed = _predicted_seed(3)

    def keep(t):
        return attn.dropout_keep_mask(seed, 2, 2, 64, 64, t / 2**16, device=DEVICE)

    t = next(t for t in range(2**14, 2**14 + 64) if not torch.equal(keep(t), keep(t + 1)))
    assert torch.equal(_kernel_keep_mask_read_back(64, t / 2**16), keep(t))


@pytest.mark.skipif(DEVICE == "cuda", reason="interpreter: the launchers' seed argument")
def test_seed_tensor_read_by_the_kernels_equals_the_int_seed():
    """A seed given as a 0-dim int64 tensor (as drawn on the device inside CUDA graph capture)
    is read by the three kernels from memory: output, LSE and every gradient bit-identical to
    the same seed given as an int."""
    from fastformer.kernels import attention as kernels

    c = Case(lq=33, lk=47, d=16, causal=True, kpm="random")
    q, k, v = _qkv(c)
    kpm, g = _key_padding(c), torch.randn(c.b, c.h, c.lq, c.d, device=DEVICE)
    results = []
    for seed in (987654321, torch.tensor(987654321, device=DEVICE)):
        out, lse = kernels.attention_forward(q, k, v, None, kpm, seed, 0.3, True, 0.25)
        grads = kernels.attention_backward(
            g, None, q, k, v, out, lse, None, kpm, seed, 0.3, True, 0.25, False
        )
        results.append([out, lse, *grads[:3]])
    for int_seed, tensor_seed in zip(*results):
        assert torch.equal(int_seed, tensor_seed)
    other = kernels.attention_forward(q, k, v, None, kpm, torch.tensor(5), 0.3, True, 0.25)
    assert not torch.equal(other[0], results[0][0])  # the tensor's value is what is used


@pytest.mark.skipif(DEVICE == "cuda", reason="capture simulated on CPU (the GPU test captures)")
def test_dropout_inside_capture_uses_a_device_seed(monkeypatch):
    """Inside CUDA graph capture (simulated: rng.capturing) the op draws its seed on the device
    and the kernels read it there, forward and backward: the result is the reference's with
    the mask of that seed. The torch backend, which needs the seed on the host, refuses."""
    p = 0.3
    c = Case(lq=33, lk=47, d=16, causal=True, kpm="random")
    q, k, v = _qkv(c)
    kpm = _key_padding(c)
    monkeypatch.setattr(rng, "capturing", lambda device: True)
    torch.manual_seed(4)
    seed = int(torch.randint(0, 2**rng.SEED_BITS - 1, (), dtype=torch.int64))
    keep = attn.dropout_keep_mask(seed, c.b, c.h, c.lq, c.lk, p, device=DEVICE)
    kw = dict(is_causal=True, key_padding_mask=kpm)

    def fast(q, k, v):
        torch.manual_seed(4)
        return attn.scaled_dot_product_attention(q, k, v, None, p, **kw)

    def reference(q, k, v):
        return ref.scaled_dot_product_attention(q, k, v, None, p, dropout_mask=keep, **kw)

    assert_parity(compare_with_reference(fast, reference, [q, k, v]))
    monkeypatch.setenv("FASTFORMER_BACKEND_ATTENTION", "torch")
    with pytest.raises(RuntimeError, match="only on its compiled kernels"):
        attn.scaled_dot_product_attention(q, k, v, None, p, **kw)


_KEEPS_NOTHING_SCRIPT = """
import gc, torch
from fastformer.ops.attention import scaled_dot_product_attention as sdpa
from fastformer.ops.ffn import ffn
from fastformer.ops.layer_norm import dropout_add_layer_norm

def live():
    return {id(t): t for t in gc.get_objects() if isinstance(t, torch.Tensor)}

q = torch.randn(1, 2, 16, 16, device=DEVICE, requires_grad=True)
x = torch.randn(4, 16, device=DEVICE, requires_grad=True)
w1, w2 = torch.randn(32, 16, device=DEVICE), torch.randn(16, 32, device=DEVICE)
gc.collect()
before = live()
out = sdpa(q, q, q, dropout_p=0.0, is_causal=True)
out = out.sum() + sdpa(q, q, q, dropout_p=0.5).sum()
out = out + dropout_add_layer_norm(x, x, None, None, dropout_p=0.5).sum()
out = out + ffn(x, w1, None, w2, None, dropout_p=0.5).sum()
out.backward()
del out
q.grad = x.grad = None
gc.collect()
print([(tuple(t.shape), t.dtype) for i, t in live().items() if i not in before])
"""


def test_a_call_keeps_no_tensor_of_its_own():
    """Nothing a call allocates outlives it (attention with and without dropout, the fused
    LayerNorm and the FFN): inductor's CUDA-graph warm-up runs a call in the graph's memory
    pool, and cudagraph trees refuse a tensor left alive there (the kernels' Seed pointer, kept
    across calls, failed `test_reduce_overhead_keeps_the_step_in_cuda_graphs` on an H200). In
    a fresh process: a first call is where such a tensor is made."""
    env = {**os.environ, "FASTFORMER_BACKEND_ATTENTION": "triton"}
    script = _KEEPS_NOTHING_SCRIPT.replace("DEVICE", repr(DEVICE))
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"


def test_tuning_inside_capture_raises_a_clear_error(monkeypatch):
    # A launch key never tuned before capture compiled and timed its candidates inside it,
    # which fails with an opaque capture error on a GPU (simulated here: a CUDA-typed stand-in
    # for q and a capturing stream).
    from types import SimpleNamespace

    from fastformer.kernels import attention as kernels

    q = SimpleNamespace(device=torch.device("cuda"), shape=(2, 4, 100, 64), dtype=torch.float16)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    kernels._refuse_tuning_in_capture("fwd", q)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="outside capture first with the same shapes"):
        kernels._refuse_tuning_in_capture("fwd", q)
    kernels._refuse_tuning_in_capture("fwd", SimpleNamespace(device=torch.device("cpu")))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # no context: no capture
    kernels._refuse_tuning_in_capture("fwd", q)


def test_dropout_keep_mask_offsets():
    # An independent spelling of the documented scheme, element by element: key column
    # j = 32 g + 8 w + 2 c + l takes half l of word w of the call at i * C + 4 g + c.
    seed, b, h, lq, lk, p = 1234, 2, 3, 5, 45, 0.4  # lk % 32 != 0: a partial last block
    calls, t = 8, round(p * 65536)  # C = 4 * ceil(45 / 32)
    keep = attn.dropout_keep_mask(seed, b, h, lq, lk, p)
    assert keep.shape == (b, h, lq, lk)
    assert attn.dropout_calls(lk) == calls
    for bb, hh, i in [(0, 0, 0), (1, 2, 4), (1, 0, 3), (0, 2, 1)]:
        for j in range(lk):
            g, w, c, half = j // 32, (j // 8) % 4, (j // 2) % 4, j % 2
            counter = ((bb * h + hh) << 32) + i * calls + 4 * g + c
            words = [int(x[0]) for x in rng.philox4x32(seed, torch.tensor([counter]))]
            u16 = (words[w] >> (16 * half)) & 0xFFFF
            assert keep[bb, hh, i, j].item() == (u16 >= t), (bb, hh, i, j)
    assert attn.dropout_keep_mask(seed, b, h, lq, lk, 0.0).all()


def test_dropout_blocks_fit_every_tile_config():
    # A key tile covers whole 32-column blocks of the scheme, or one half of one (BLOCK_N 16).
    from fastformer.kernels import attention as kernels

    configs = [c for lists in kernels.CONFIGS.values() for c in lists]
    for c in configs + [kernels.INTERPRET_CONFIG]:
        assert c.block_n == 16 or c.block_n % 32 == 0, c


@pytest.mark.parametrize("version", ["3.6.0", "3.8.0", "3.9.0"])
def test_configs_that_spill_with_one_triton_version_are_left_out_under_it(monkeypatch, version):
    # _VERSION_SPILLS names (kernel, arch, bucket, feature class, config): only that list of
    # that Triton version loses the config, every list keeps one, and each name is listed.
    # _VERSION_EXTRA adds configs to the lists it names, under its version only, where the
    # spills left none.
    import triton

    from fastformer.kernels import attention as kernels

    monkeypatch.setattr(triton, "__version__", version)
    v = kernels._triton_version()
    spills = kernels._VERSION_SPILLS.get(v, set())
    extra = kernels._VERSION_EXTRA.get(v, {})
    named, all_dropped, all_added = set(), set(), {}
    for key in kernels.CONFIGS:
        listed = kernels.listed_configs(*key)
        kept = kernels._for_this_triton(key, listed)
        kernel, arch, _, bucket, fclass = key
        dropped = {(kernel, arch, bucket, fclass, c) for c in set(listed) - set(kept)}
        added = [c for c in kept if c not in listed]
        assert kept and (not added or len(added) == len(kept)), key
        all_dropped |= dropped
        all_added.update({key: added} if added else {})
        named |= {(kernel, arch, bucket, fclass, c) for c in listed}
    assert all_dropped == spills
    assert all_added == extra
    assert all(spills <= named for spills in kernels._VERSION_SPILLS.values())
    assert all(set(e) <= set(kernels.CONFIGS) for e in kernels._VERSION_EXTRA.values())


def test_tuned_config_is_launched_directly_after_the_first_call(monkeypatch):
    # Triton's Autotuner.run costs ~60 us of host time a call: after the tuned first call of a
    # key, _launch runs the chosen config itself; another key (a tensor dtype, a sequence
    # bucket, a feature) goes through the tuner again.
    import types

    import triton

    from fastformer.kernels import attention as kernels

    launches = []

    class Recorder:  # stands for `kernel[grid](*args, **kwargs)`, or an autotuner
        best_config = triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=3)
        other = triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=2)
        configs = [best_config, other]
        configs_timings = {best_config: [1.5, 1.4, 1.6], other: [float("inf")] * 3}

        def __init__(self, how):
            self.how, self.cache = how, {}

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                launches.append((self.how, args, kwargs))
                self.cache[len(self.cache)] = self.best_config  # the tuner benchmarked

            return run

    monkeypatch.setattr(kernels, "INTERPRETED", False)
    monkeypatch.setattr(kernels, "KERNELS", {**kernels.KERNELS, "fwd": Recorder("direct")})
    monkeypatch.setattr(kernels, "_autotuned", lambda *key: Recorder("tuner"))
    monkeypatch.setattr(kernels, "arch_family", lambda device: 90)
    monkeypatch.setattr(kernels, "_TUNED", {})
    monkeypatch.setattr(kernels, "TUNING_LOG", [])
    q = types.SimpleNamespace(device=torch.device("cuda", 0), dtype=F16, shape=(1, 1, 512, 64))
    iq, ik = kernels._SEQ_BUCKET_ARGS["fwd"]
    meta = {"HEAD_D": 64, "HEAD_DV": 64, "IS_CAUSAL": False, "MASK_KIND": 0, "HAS_KPM": False,
            "HAS_DROPOUT": False}  # fmt: skip

    def launch(mask_dtype=F16, seq_q=512, seq_k=512, tma=False, **features):
        args = [torch.empty(1, dtype=F16), torch.empty(1, dtype=mask_dtype)] + [3] * 40
        args[iq], args[ik] = seq_q, seq_k
        kernels._launch("fwd", lambda c: (1,), tuple(args), {**meta, **features}, q, None, tma=tma)
        assert all(a is b for a, b in zip(launches[-1][1], args, strict=True))
        return launches[-1]

    first = launch()
    assert first[0] == "tuner" and first[2] == meta
    how, _, kwargs = launch()
    assert how == "direct" and kwargs == {**meta, **Recorder.best_config.all_kwargs()}
    assert launch(mask_dtype=F32)[0] == "tuner"
    assert launch(seq_q=1024)[0] == launch(seq_k=64)[0] == "tuner"
    assert launch(IS_CAUSAL=True)[0] == "tuner"
    assert launch(IS_CAUSAL=True)[0] == launch(seq_q=1024)[0] == "direct"
    monkeypatch.setattr(kernels, "_ensure_allocator", lambda: None)
    assert launch(tma=True)[0] == "tuner"  # a choice made without TMA twins does not serve
    assert launch(tma=True)[0] == "direct"
    # One log entry per tuned key: what it chose and each candidate's time (None: did not fit).
    assert len(kernels.TUNING_LOG) == 6
    entry = kernels.TUNING_LOG[0]
    assert entry["kernel"] == "fwd" and entry["feature_class"] == "base"
    assert entry["seq_q_bucket"] == 512 and entry["dtype"] == "torch.float16"
    assert entry["IS_CAUSAL"] is False and entry["HEAD_D"] == 64
    assert entry["chosen"] == "64x32 w4 s3"
    assert entry["ms"] == {"64x32 w4 s3": 1.5, "128x64 w8 s2": None}
    # Inside CUDA graph capture a tuned key launches; a new one raises (tuning breaks capture).
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert launch()[0] == "direct"
    with pytest.raises(RuntimeError, match="inside CUDA graph capture"):
        launch(seq_q=4096)


def test_tuning_key_reads_the_dtype_of_every_tensor_argument(monkeypatch):
    # _tuned_key takes dtypes at the kernels' pointer positions: those must be exactly where
    # the launchers pass tensors (Triton's autotuner keys on every tensor's dtype).
    from fastformer.kernels import attention as kernels

    seen = {}
    launch = kernels._launch

    def record(kernel, grid, args, meta, q, config, **then):
        seen[kernel] = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        return launch(kernel, grid, args, meta, q, config, **then)

    monkeypatch.setattr(kernels, "_launch", record)
    c = Case(lq=33, lk=40, d=16, causal=True, mask="float", kpm="random")
    q, k, v = _qkv(c)
    mask = _attn_mask(c)
    out = attn.scaled_dot_product_attention(q, k, v, mask, key_padding_mask=_key_padding(c))
    out.sum().backward()
    assert set(seen) == set(kernels.KERNELS)
    for kernel, positions in seen.items():
        assert positions == list(kernels._TENSOR_ARGS[kernel]), kernel


def test_key_padding_alone_tunes_over_the_base_configs_too():
    # Key padding without attn_mask is its own feature class: the masked configs plus every base
    # config that compiles without spills for it (the compile report checks them all).
    from fastformer.kernels import attention as kernels

    cls = kernels.feature_class
    assert cls(kernels.MASK_NONE, True, False) == "padded"
    assert cls(kernels.MASK_BOOL, True, False) == cls(kernels.MASK_FLOAT, False, False) == "masked"
    assert cls(kernels.MASK_NONE, False, False) == "base"
    assert cls(kernels.MASK_NONE, True, True) == "dropout"
    assert cls(kernels.MASK_BOOL, False, True) == cls(kernels.MASK_FLOAT, True, True)
    assert cls(kernels.MASK_FLOAT, True, True) == "masked_dropout"
    grown = 0
    for kernel, arch, dclass, bucket, fclass in kernels.CONFIGS:
        if fclass != "padded":
            continue
        # The tables' lists, before a Triton version's exclusions (tested apart).
        base, masked, padded = (
            kernels.listed_configs(kernel, arch, dclass, bucket, c)
            for c in ("base", "masked", "padded")
        )
        assert set(masked) <= set(padded) <= set(base) | set(masked)
        spills = kernels._PADDED_SPILLS[arch]
        assert not any((kernel, bucket, c) in spills for c in padded if c not in masked)
        grown += len(padded) > len(masked)
    assert grown >= 10  # most 16-bit entries gained base configs


def test_plain_calls_also_tune_over_tiles_that_spill_only_with_the_causal_mask():
    # Non-causal calls without masks, padding or dropout use the "plain" list where it exists:
    # the base configs, and with TMA the tiles of _TMA_EXTRA's plain entry, which the causal
    # list lacks; every other launch keeps its feature class.
    from fastformer.kernels import attention as kernels

    plain = dict(MASK_KIND=kernels.MASK_NONE, HAS_KPM=False, HAS_DROPOUT=False, IS_CAUSAL=False)
    for arch, kernel, dclass, bucket in kernels._PLAIN_KEYS:
        key = (kernel, arch, dclass, bucket)
        assert kernels.config_class(*key, plain) == "plain"
        assert kernels.config_class(*key, {**plain, "IS_CAUSAL": True}) == "base"
        assert kernels.config_class(*key, {**plain, "HAS_KPM": True}) == "padded"
        assert kernels.listed_configs(*key, "plain") == kernels.listed_configs(*key, "base")
        extra = kernels._TMA_EXTRA[(kernel, bucket, "plain")]
        assert extra and all(c.tma for c in extra)
        assert not set(extra) & set(kernels.tma_candidates(*key, "base"))
        version_spills = kernels._TMA_VERSION_SPILLS.get(kernels._triton_version(), set())
        kept = {c for c in extra if (kernel, bucket, "plain", c) not in version_spills}
        tuned = set(kernels.tma_candidates(*key, "plain"))
        assert kept <= tuned and not (set(extra) - kept) & tuned
    assert kernels.config_class("fwd", 90, "16bit", 64, plain) == "base"  # no plain list
    assert kernels.CHECK_VARIANTS["plain"].is_causal is False  # what the compile check builds


def test_key_padding_range_is_computed_once_per_forward_and_backward(monkeypatch):
    # One attn_kv_range launch serves the forward and its backward (eager autograd).
    from fastformer.kernels import attention as kernels

    calls = []
    real = kernels.key_range
    monkeypatch.setattr(kernels, "key_range", lambda kpm: calls.append(1) or real(kpm))
    c = Case(lq=40, lk=70, d=16, kpm="edges", grad=True)
    q, k, v = _qkv(c)
    kpm = torch.zeros(c.b, c.lk, dtype=torch.bool)
    kpm[:, :5] = kpm[:, -9:] = True
    attn.scaled_dot_product_attention(q, k, v, key_padding_mask=kpm).sum().backward()
    assert len(calls) == 1
    with torch.no_grad():
        attn.scaled_dot_product_attention(q, k, v, key_padding_mask=kpm)
    assert len(calls) == 2


def test_dropout_same_seed_identical_and_calls_differ():
    q, k, v = _qkv(Case(lq=33, lk=33, d=16, grad=False))
    torch.manual_seed(5)
    first = attn.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    second = attn.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(5)
    again = attn.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert torch.equal(first, again)
    assert not torch.equal(first, second)


def test_dropout_output_linear_in_value():
    q, k, v = _qkv(Case(lq=33, lk=47, d=16, causal=True, grad=False))
    v2 = _randn(v.shape, seed=5)

    def run(value):
        torch.manual_seed(21)
        return attn.scaled_dot_product_attention(q, k, value, dropout_p=0.3, is_causal=True)

    torch.testing.assert_close(run(v + 2 * v2), run(v) + 2 * run(v2), atol=1e-5, rtol=1e-5)


def test_torch_backend_matches_triton_for_the_same_seed(monkeypatch):
    c = Case(lq=33, lk=47, d=32, causal=True, mask="bool", kpm="random", grad=True)

    def run():
        q, k, v = _qkv(c)
        torch.manual_seed(17)
        out = attn.scaled_dot_product_attention(
            q, k, v, _attn_mask(c), 0.2, True, key_padding_mask=_key_padding(c)
        )
        out.backward(torch.ones_like(out))
        return out, q.grad, k.grad, v.grad

    assert attn.backend_reasons(*_qkv(c))[0] == ("triton", [])
    fused = run()
    monkeypatch.setenv("FASTFORMER_BACKEND_ATTENTION", "torch")
    eager = run()
    for a, b in zip(fused, eager):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


def _softmax_by_torch(scores, grad, dlse, seed, dropout_p):
    # The torch backend's softmax spelled in torch ops: P * K * c and lse, then P * K * c and dS.
    probs, lse = attn._softmax(scores.clone(), with_lse=True)
    if dropout_p > 0:
        probs = probs * attn._kept_scale(seed, probs, dropout_p)
    return probs, lse, *attn._softmax_backward(seed, scores.clone(), grad.clone(), dlse, dropout_p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("shape", "dropout_p"),
    [((2, 3, 17, 45), 0.1), ((1, 2, 5, 64), 0.9), ((1, 1, 3, 97), 2**-16), ((2, 1, 4, 1), 0.5)]
    + [((1, 2, 6, 300), 0.0), ((1, 2, 0, 5), 0.5)],
)
def test_attention_softmax_cpp_parity(shape, dropout_p, dtype):
    # The torch backend's fused softmax (csrc/attention/attention_softmax.cpp) against its
    # spelling in torch ops, by the parity rule: masked keys, a row without a key, a row with a
    # NaN (NaN throughout, dropped or not, as torch's softmax), lse and its gradient.
    gen = torch.Generator().manual_seed(8)
    scores = torch.randn(shape, generator=gen, dtype=torch.float64) * 4
    scores[:, 0, :, ::3] = float("-inf")
    if shape[2] > 1:
        scores[0, -1, 0] = float("-inf")
        scores[-1, 0, 1, 1 % shape[3]] = float("nan")
    grad = torch.randn(shape, generator=gen, dtype=torch.float64)
    dlse = torch.randn(shape[:3], generator=gen, dtype=torch.float64)
    seed = 2**62 + 99
    fused = _fused_softmax_call(scores.to(dtype), grad.to(dtype), dlse.to(dtype), seed, dropout_p)
    ref64 = _softmax_by_torch(scores, grad, dlse, seed, dropout_p)
    ref_lp = _softmax_by_torch(scores.to(dtype), grad.to(dtype), dlse.to(dtype), seed, dropout_p)
    names = ("forward probs", "lse", "backward probs", "dS")
    for name, got, want in zip(names, fused, ref_lp):  # (parity counts a NaN as a mismatch)
        assert torch.equal(got.isnan(), want.isnan()), name
    finite = [[t.nan_to_num(0.0, 0.0, 0.0) for t in ts] for ts in (fused, ref64, ref_lp)]
    assert_parity([parity(*case) for case in zip(names, *finite)])


def _fused_softmax_call(scores, grad, dlse, seed, dropout_p):
    fused = attn._fused_softmax(seed, dropout_p, scores, grad, dlse)
    assert fused is not None  # contiguous CPU float32 / float64: the C++ ops serve them
    probs, lse = scores.clone(), scores.new_empty(scores.shape[:-1])
    torch.ops.fastformer.attention_softmax_(probs, lse, *fused)
    dropped, dS = scores.clone(), grad.clone()
    torch.ops.fastformer.attention_softmax_backward_(dropped, dS, dlse, *fused)
    return probs, lse, dropped, dS


@pytest.mark.parametrize("fused", [True, False], ids=["cpp", "torch_ops"])
def test_lse_gradient_is_exact_where_a_row_has_one_key(monkeypatch, fused):
    # With one key P = 1, so dS = P * (dP - rowsum(P * dP) + dlse) = dlse whatever dP is: the
    # mask's gradient is the lse cotangent. dlse folded into the row sum first came back
    # rounded to the ulp of dP (10x the scores' gradient with p 0.9): a 4.5x parity miss. (The
    # torch backend: the kernels' delta = rowsum(dO * O) is itself within an ulp of dP only.)
    _use_backend(monkeypatch, "torch")
    if not fused:
        monkeypatch.setattr(attn, "_fused_softmax", lambda *args: None)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 9, 16, generator=gen) * 8 for _ in range(3))
    k, v = k[:, :, :1], v[:, :, :1]
    mask = torch.zeros(2, 3, 9, 1, requires_grad=True)
    out, lse = attn.scaled_dot_product_attention_with_lse(q, k, v, mask, dropout_p=0.9)
    grad_lse = torch.randn(lse.shape, generator=gen) * 1e-3
    torch.autograd.backward((out, lse), (torch.randn(out.shape, generator=gen) * 8, grad_lse))
    torch.testing.assert_close(mask.grad[..., 0], grad_lse, rtol=1e-6, atol=0)


def test_attention_softmax_cpp_takes_the_dropout_mask_of_the_seed():
    # Where the keep-mask drops, the fused probabilities are exactly 0; elsewhere P / (1 - p).
    scores = torch.randn(2, 3, 9, 70, generator=torch.Generator().manual_seed(2))
    probs, _, dropped, _ = _fused_softmax_call(scores, scores, None, 31, 0.4)
    keep = attn.dropout_keep_mask(31, 2, 3, 9, 70, 0.4)
    assert torch.equal(probs != 0, keep) and torch.equal(dropped != 0, keep)
    plain = _fused_softmax_call(scores, scores, None, 31, 0.0)[0]
    torch.testing.assert_close(probs, torch.where(keep, plain / 0.6, 0.0), rtol=1e-6, atol=0)


def test_attention_softmax_cpp_falls_back_where_it_does_not_apply():
    # Not contiguous, float16, no key: the torch ops' spelling, not the C++ ops.
    scores = torch.randn(1, 2, 8, 5).transpose(-2, -1)
    assert attn._fused_softmax(3, 0.5, scores) is None
    assert attn._fused_softmax(3, 0.5, scores.contiguous().half()) is None
    assert attn._fused_softmax(3, 0.5, torch.randn(1, 2, 3, 0)) is None
    assert attn._fused_softmax(3, 0.5, scores.contiguous(), None, scores) is None
    assert attn._fused_softmax(3, 0.0, scores.contiguous()) == (0, 0, 1.0)
    probs, lse = attn._softmax_dropped(3, scores.clone(), 0.5)
    fused, fused_lse = attn._softmax_dropped(3, scores.contiguous(), 0.5)
    torch.testing.assert_close(probs, fused, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(lse, fused_lse, rtol=1e-6, atol=1e-6)


def test_attention_softmax_cpp_errors():
    scores, lse = torch.rand(1, 2, 3, 4), torch.rand(1, 2, 3)
    fwd, bwd = (
        torch.ops.fastformer.attention_softmax_,
        torch.ops.fastformer.attention_softmax_backward_,
    )
    with pytest.raises(RuntimeError, match="threshold must be in"):
        fwd(scores, lse, 1, 65537, 1.0)
    with pytest.raises(RuntimeError, match="scale must be 1 without dropout"):
        fwd(scores, lse, 1, 0, 2.0)
    with pytest.raises(RuntimeError, match=r"scores must be \(B, H, Lq, Lk\)"):
        fwd(scores[0], lse[0], 1, 10, 1.0)
    with pytest.raises(RuntimeError, match="scores must be float32 or float64"):
        fwd(scores.half(), lse.half(), 1, 10, 1.0)
    with pytest.raises(RuntimeError, match="scores must be a contiguous CPU tensor"):
        fwd(scores.transpose(-2, -1), lse, 1, 10, 1.0)
    for bad_lse in (lse[..., :2], lse.double(), torch.rand(1, 3, 2).transpose(1, 2)):
        with pytest.raises(RuntimeError, match=r"of shape \(B, H, Lq\)"):
            fwd(scores, bad_lse, 1, 10, 1.0)
    for bad in (scores.double(), scores[..., :2]):
        with pytest.raises(RuntimeError, match="of shape scores's"):
            bwd(scores, bad, None, 1, 10, 1.0)
    with pytest.raises(RuntimeError, match=r"of shape \(B, H, Lq\)"):
        bwd(scores, scores.clone(), lse[:, :1], 1, 10, 1.0)


# --------------------------------------------------------------------------- memory, registration


@pytest.mark.parametrize("mask_dtype", [F16, F32])
@pytest.mark.parametrize("grad", [True, False])
def test_float32_output_kept_for_a_float32_mask(mask_dtype, grad):
    # out32 (float32 O for the backward's delta) exactly where a float32 mask meets 16-bit
    # inputs that are to be differentiated: not under no_grad, not for a 16-bit mask.
    c = Case(b=1, h=2, lq=9, lk=12, d=16, dv=8, mask="float", mask_dtype=mask_dtype, dtype=F16)
    q, k, v = _qkv(c)
    mask = _attn_mask(c)
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.set_grad_enabled(grad):
        out = attn.scaled_dot_product_attention(q, k, v, mask)
    kept = ((1, 2, 9, 8), torch.float32) in saved
    assert kept == (grad and mask_dtype == F32), saved
    if kept:  # out is the float32 O rounded
        op = torch.ops.fastformer.attention
        out32 = op(q, k, v, mask, None, 0.0, False, None, True)[4]
        assert torch.equal(out32.half(), out.detach())
        assert (out32 - out.detach().float()).abs().max() > 0  # not an upcast of out


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
@pytest.mark.parametrize("mask_dtype", ["own", F32])
@pytest.mark.parametrize("needs_grad", [True, False])
def test_raw_op_has_a_float32_output_for_16_bit_inputs_with_a_float32_mask(
    dtype, mask_dtype, needs_grad
):
    # The op's out32 output is (B, H, Lq, Dv) float32 exactly then, from either backend (the
    # fake says so to torch.compile); else empty.
    q, k = _randn((1, 2, 9, 16), dtype), _randn((1, 2, 12, 16), dtype)
    v = _randn((1, 2, 12, 8), dtype)
    mask = _randn((9, 12), dtype if mask_dtype == "own" else mask_dtype)
    out32 = torch.ops.fastformer.attention(q, k, v, mask, None, 0.0, False, None, needs_grad)[4]
    kept = needs_grad and dtype != F32 and mask.dtype == F32
    assert out32.dtype == F32 and out32.shape == ((1, 2, 9, 8) if kept else (0,))


def test_saved_tensors_are_linear_in_sequence_length():
    b, h, l, d = 2, 2, 128, 16
    q, k, v = _qkv(Case(b=b, h=h, lq=l, lk=l, d=d))
    kpm = _key_padding(Case(b=b, lk=l, kpm="random"))
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = attn.scaled_dot_product_attention(q, k, v, None, 0.1, True, key_padding_mask=kpm)
    out.sum().backward()
    assert sizes and max(sizes) <= b * h * l * d < b * h * l * l


@pytest.mark.parametrize("backend", ["default", "torch"])
def test_opcheck(monkeypatch, backend):
    _use_backend(monkeypatch, backend)
    c = Case(b=1, h=2, lq=9, lk=12, d=16, mask="float", kpm="random")
    q, k, v = _qkv(c)
    op = torch.ops.fastformer.attention.default
    torch.library.opcheck(op, (q, k, v, _attn_mask(c), _key_padding(c), 0.0, True, 0.25))
    torch.library.opcheck(op, (q, k, v, None, None, 0.0, False, 0.25))
    torch.library.opcheck(op, (q, k, v, None, None, 0.0, False, None))  # scale 1 / sqrt(D)
    q, k, v = (t.detach() for t in (q, k, v))  # the backward op itself has no autograd
    # the keep-mask of compiled torch.func transforms (p = 0: every draw keeps all)
    torch.library.opcheck(torch.ops.fastformer.attention_drawn_keep_mask.default, (q, 12, 0.0))
    backward = torch.ops.fastformer.attention_backward.default
    for mask in (None, _attn_mask(c).detach()):
        # The forward's row statistics: kept for float32 inputs and float masks, the 8 bytes a
        # row spared for 16-bit inputs without one.
        half = op(q.half(), k.half(), v.half(), mask, None, 0.0, False, 0.25)
        assert half[3].shape == ((1, 2, 9, 2) if mask is not None else (0,))
        assert half[4].shape == (0,)  # float32 O: only when needs_grad says so
        out, lse, seed, stat, out32 = op(q, k, v, mask, None, 0.0, False, 0.25)
        assert stat.shape == (1, 2, 9, 2) and out32.shape == (0,)
        # Without an lse gradient the torch backend runs torch's CPU flash backward, with one
        # its written-out reference backward: check both.
        for grad_lse in (None, torch.randn_like(lse)):
            saved = (out, lse, stat, out32, mask, None, seed)
            args = (torch.randn_like(out), grad_lse, q, k, v, *saved)
            torch.library.opcheck(backward, (*args, 0.0, False, 0.25, False))
    # A 16-bit call with a float32 mask, made to be differentiated, keeps a float32 O.
    qh, kh, vh, mask = q.half(), k.half(), v.half(), _attn_mask(c).detach()
    torch.library.opcheck(op, (qh, kh, vh, mask, None, 0.0, True, 0.25, True))
    out, lse, seed, stat, out32 = op(qh, kh, vh, mask, None, 0.0, True, 0.25, True)
    assert out32.shape == (1, 2, 9, 16) and out32.dtype == torch.float32
    args = (torch.randn_like(out), None, qh, kh, vh, out, lse, stat, out32, mask, None, seed)
    torch.library.opcheck(backward, (*args, 0.0, True, 0.25, True))


@pytest.mark.parametrize("case", ["key_batch", "value_length", "grad_out", "lse", "seed", "out32"])
def test_raw_ops_check_their_inputs(case):
    # torch.ops.fastformer.attention(_backward) are public: torch's CPU flash kernels read out
    # of bounds (a segfault) for a key of fewer batches than q, or a grad_out / lse smaller
    # than q's geometry.
    q, k, v = (_randn((2, 2, 5, 8), seed=i) for i in range(3))
    op, backward = torch.ops.fastformer.attention, torch.ops.fastformer.attention_backward
    if case in ("key_batch", "value_length"):
        k, v = (k[:1], v) if case == "key_batch" else (k, v[:, :, :3])
        with pytest.raises(ValueError, match="key has batch 1|value .* must match key"):
            op(q, k, v, None, None, 0.0, False, 0.25)
        return
    out, lse, seed, stat, out32 = op(q, k, v, None, None, 0.0, False, 0.25)
    grad_out = {"grad_out": out[:, :, :1]}.get(case, torch.ones_like(out))
    lse = lse[:, :, :3] if case == "lse" else lse
    seed = seed.float() if case == "seed" else seed
    out32 = out[:, :, :1].float() if case == "out32" else out32
    with pytest.raises(ValueError, match=f"attention_backward: {case} must be"):
        backward(grad_out, None, q, k, v, out, lse, stat, out32, None, None, seed, 0.0, False,
                 0.25, False)  # fmt: skip


@pytest.mark.parametrize("shape", [(1, 2, 0, 16), (0, 2, 3, 16)])
def test_raw_backward_takes_the_forwards_empty_float32_output(shape):
    # A kept out32 of no elements keeps its 4 dims: the backward took only (0,) as empty.
    q = _randn(shape, dtype=F16)
    k = v = _randn((shape[0], 2, 4, 16), dtype=F16)
    mask = _randn((shape[2], 4), dtype=F32)
    op, backward = torch.ops.fastformer.attention, torch.ops.fastformer.attention_backward
    out, lse, seed, stat, out32 = op(q, k, v, mask, None, 0.0, False, None, True)
    assert out32.shape == (*shape[:3], 16)
    grads = backward(torch.ones_like(out), None, q, k, v, out, lse, stat, out32, mask, None,
                     seed, 0.0, False, None, True)  # fmt: skip
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape, mask.shape]


@pytest.mark.parametrize("dtype", [F16, F32])
def test_raw_backward_wants_the_forwards_stat(dtype):
    # stat must have the shape the forward gives it: (B, H, Lq, 2) float32 for float32 inputs
    # (or a float mask), else empty. A 16-bit call without a float mask took any float32 stat
    # and its kernels read it (a 3-element one gave NaN dq: out of bounds on a GPU).
    op, backward = torch.ops.fastformer.attention, torch.ops.fastformer.attention_backward
    q, k, v = (_randn((2, 2, 5, 8), dtype=dtype, seed=i) for i in range(3))
    out, lse, seed, stat, out32 = op(q, k, v, None, None, 0.0, False, 0.25)
    args = (torch.ones_like(out), None, q, k, v, out, lse)
    rest = (out32, None, None, seed, 0.0, False, 0.25, False)
    backward(*args, stat, *rest)  # its own
    wrong = [torch.zeros(3), torch.zeros(2, 2, 3, 2)]
    wrong += [torch.zeros(2, 2, 5, 2)] if dtype == F16 else [torch.zeros(0)]
    for bad in wrong:
        with pytest.raises(ValueError, match="attention_backward: stat must be"):
            backward(*args, bad.to(DEVICE), *rest)


@pytest.mark.parametrize("name", ["grad_out", "out", "lse", "seed"])
def test_raw_backward_refuses_one_meta_argument(name):
    # One meta tensor among CPU ones sends the call to the fake kernel, which checked nothing
    # and returned uninitialized CPU gradients.
    q = _randn((1, 2, 5, 8))
    out, lse, seed, stat, out32 = torch.ops.fastformer.attention(
        q, q, q, None, None, 0.0, False, 0.25
    )
    args = dict(grad_out=torch.ones_like(out), out=out, lse=lse, seed=seed)
    args[name] = args[name].to("meta")
    with pytest.raises(ValueError, match=f"attention_backward: {name} is on meta"):
        torch.ops.fastformer.attention_backward(args["grad_out"], None, q, q, q, args["out"],
                                                args["lse"], stat, out32, None, None,
                                                args["seed"], 0.0, False, 0.25, False)  # fmt: skip


@pytest.mark.parametrize("name", ["grad_out", "out", "lse"])
def test_raw_backward_refuses_one_cpu_argument_of_a_meta_call(name):
    # The other way round: only the seed may stay on the CPU (`rng.call_seed` draws it there
    # for a CPU generator) while the query is elsewhere.
    q = torch.empty(1, 2, 5, 8, device="meta")
    out, lse, seed, stat, out32 = torch.ops.fastformer.attention(
        q, q, q, None, None, 0.0, False, 0.25
    )
    args = dict(
        grad_out=torch.empty_like(out), out=out, lse=lse, seed=torch.zeros((), dtype=torch.int64)
    )

    def backward():
        return torch.ops.fastformer.attention_backward(
            args["grad_out"], None, q, q, q, args["out"], args["lse"], stat, out32, None, None,
            args["seed"], 0.0, False, 0.25, False,
        )  # fmt: skip

    assert backward()[0].device.type == "meta"  # a CPU seed is taken
    args[name] = torch.empty_like(args[name], device="cpu")
    with pytest.raises(ValueError, match=f"attention_backward: {name} is on cpu, query on meta"):
        backward()


@pytest.mark.parametrize("mask", [None, "bool"])
def test_raw_backward_wants_a_float_mask_for_its_gradient(mask):
    q = _randn((1, 2, 5, 8))
    mask = None if mask is None else torch.ones(5, 5, dtype=torch.bool, device=DEVICE)
    op, backward = torch.ops.fastformer.attention, torch.ops.fastformer.attention_backward
    out, lse, seed, stat, out32 = op(q, q, q, mask, None, 0.0, False, 0.25)
    with pytest.raises(ValueError, match="attention_backward: mask_grad needs a float attn_mask"):
        backward(torch.ones_like(out), None, q, q, q, out, lse, stat, out32, mask, None, seed,
                 0.0, False, 0.25, True)  # fmt: skip


@pytest.mark.parametrize("backend", ["default", "torch"])
def test_raw_forward_outputs_are_defined_without_keys(monkeypatch, backend):
    # Lk = 0: no kernel runs. Every output is still written (torch.empty is NaN-filled in
    # deterministic mode, which shows a buffer nobody wrote).
    _use_backend(monkeypatch, backend)
    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)
    q, kv = _randn((1, 2, 5, 8)), _randn((1, 2, 0, 8))
    mask = _randn((5, 0))
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        outputs = torch.ops.fastformer.attention(q, kv, kv, mask, None, 0.0, False, 0.25)
    finally:
        torch.use_deterministic_algorithms(was)
    out, lse, seed, stat, out32 = outputs
    assert stat.shape == (1, 2, 5, 2)
    assert not any(bool(t.isnan().any()) for t in (out, stat)), outputs
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())


@pytest.mark.parametrize(
    ("dtype", "lse", "flash"),
    [(F32, 31.0, True), (F32, 33.0, False), (F32, -31.0, True), (F32, -33.0, False),
     (F16, 33.0, True)],
)  # fmt: skip
def test_torch_backend_backward_takes_cpu_flash_while_the_lse_keeps_its_sum(
    monkeypatch, dtype, lse, flash
):
    # `_lse_keeps_its_sum`: past |lse| 32 a float32 lse has rounded away too much of the log of
    # the sum for torch's CPU flash backward (float32 missed the parity bound from ~100);
    # 16-bit inputs' own rounding hides it, and they keep the flash backward.
    if DEVICE != "cpu" or attn._CPU_FLASH is None:
        pytest.skip("torch's CPU flash kernels")
    calls, flash_backward = [], attn._CPU_FLASH_BWD
    monkeypatch.setattr(
        attn, "_CPU_FLASH_BWD", lambda *a, **kw: calls.append(1) or flash_backward(*a, **kw)
    )
    _use_backend(monkeypatch, "torch")
    lk, d = 4, 16
    # Every score equal, lse - log(lk) at scale 1: the rows' lse is `lse`.
    q = torch.ones(1, 1, 3, d, dtype=dtype, requires_grad=True)
    k = torch.full((1, 1, lk, d), (lse - math.log(lk)) / d, dtype=dtype)
    v = _randn((1, 1, lk, d), dtype=dtype)
    out, got = attn.scaled_dot_product_attention_with_lse(q, k, v, scale=1.0)
    assert abs(got.max().item() - lse) < 0.1, got
    out.sum().backward()
    assert bool(calls) == flash


def test_torch_compile_fullgraph_matches_eager():
    c = Case(lq=33, lk=47, d=16, mask="float", kpm="random")
    kpm = _key_padding(c)

    def fn(q, k, v, m):
        out, lse = attn.scaled_dot_product_attention_with_lse(
            q, k, v, m, 0.2, True, key_padding_mask=kpm
        )
        return out * 2, lse

    def run(f):
        q, k, v = _qkv(c)
        m = _attn_mask(c)
        torch.manual_seed(2)
        out, lse = f(q, k, v, m)
        (out.sum() + lse.sum()).backward()
        return out, lse, q.grad, k.grad, v.grad, m.grad

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for a, b in zip(run(compiled), run(fn)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    # The seed is drawn at run time, not baked into the graph: a second call differs.
    q, k, v = _qkv(replace(c, grad=False))
    torch.manual_seed(2)
    first, _ = compiled(q, k, v, None)
    second, _ = compiled(q, k, v, None)
    assert not torch.equal(first, second)


def test_backend_reasons():
    q, k, v = _qkv(Case(lq=8, lk=8, d=16, grad=False))
    rows = dict(attn.backend_reasons(q, k, v))
    assert rows["torch"] == [] and rows["triton"] == []
    assert _dispatch.select(attn.OP, attn.AttentionInputs(q, key=k, value=v)) == "triton"
    if DEVICE == "cpu":
        why = dict(_dispatch.explain(attn.OP, q.bfloat16()))["triton"]
        assert any("bfloat16" in r for r in why)
    wide_v = torch.zeros(1, 1, 1, 512, device=DEVICE).expand(2, 2, 8, 512)
    for inputs in (attn.AttentionInputs(q, key=k, value=wide_v), attn.AttentionInputs(q, 512)):
        why = dict(_dispatch.explain(attn.OP, inputs))["triton"]
        assert any("value head dim must be <= 256, got 512" in r for r in why)
    # Stride-0 views: shapes past the kernels' int32 offsets without memory.
    long_k = torch.zeros(1, 1, 1, 16, device=DEVICE).expand(2, 2, 2**27, 16)
    why = dict(_dispatch.explain(attn.OP, attn.AttentionInputs(q, key=long_k, value=long_k)))[
        "triton"
    ]
    assert any("slice of key" in r and "int32" in r for r in why)
    mask = torch.empty(2**16, 2**16, dtype=torch.bool, device="meta")  # shapes only
    why = dict(_dispatch.explain(attn.OP, attn.AttentionInputs(q, key=k, value=v, attn_mask=mask)))[
        "triton"
    ]
    assert any("attn_mask spans" in r for r in why)
    # The output's slice (Lq x Dv) and a float mask's gradient rows (dq's BLOCK_M x Lk): D and
    # the mask's own extent fit, Dv or Lk do not (found by review: out of bounds on a GPU).
    long_q = torch.empty(1, 1, 2**23 + 1, 128, device="meta")
    wide_v = torch.empty(1, 1, 8, 256, device="meta")
    why = dict(_dispatch.explain(attn.OP, attn.AttentionInputs(long_q, key=wide_v, value=wide_v)))
    assert any("slice of the output has" in r for r in why["triton"])
    assert dict(_dispatch.explain(attn.OP, attn.AttentionInputs(long_q[..., :64], 128)))["triton"]
    many_keys = torch.empty(1, 1, 2**24 + 1, 16, device="meta")
    bias = torch.empty(2**24 + 1, device="meta")  # a per-key bias, broadcast over queries
    for bias_dtype, refused in ((torch.float32, True), (torch.bool, False)):
        inputs = attn.AttentionInputs(
            q[..., :16].to("meta"), key=many_keys, value=many_keys, attn_mask=bias.to(bias_dtype)
        )
        why = dict(_dispatch.explain(attn.OP, inputs))["triton"]
        assert any("float attn_mask's gradient" in r for r in why) == refused, why
    huge_batch = torch.zeros(1, 1, 8, 16, device=DEVICE).expand(2**16, 2, 8, 16)
    why = dict(_dispatch.explain(attn.OP, attn.AttentionInputs(huge_batch)))["triton"]
    assert any("batch 65536" in r and "grid limit" in r for r in why)
    assert attn._grid_reasons(65535, 65535) and attn._grid_reasons(65535, 32769)
    assert attn._grid_reasons(65535, 32768) == [] and attn._grid_reasons(2048, 32) == []
    assert attn._grid_reasons(1, attn._kernels().MAX_GRID_YZ + 1)  # heads: a grid dim of their own
    assert isinstance(dict(_dispatch.explain(attn.OP, None))["triton"], list)


def _triton_refuses(query, **inputs) -> str:
    return "; ".join(
        dict(_dispatch.explain(attn.OP, attn.AttentionInputs(query, **inputs)))["triton"]
    )


def test_shape_limits_of_the_triton_kernel_fall_exactly_on_their_bounds():
    # Each limit is met at its last allowed value and passed one step later (the int32 ones at
    # 2**31 elements or a 2**31 offset). Stride-0 queries and meta tensors: no memory.
    limit, rows = attn._kernels().INT32_LIMIT, attn._kernels().DQ_MAX_BLOCK_M

    def query(lq, d):
        return torch.zeros(1, 1, 1, d, device=DEVICE).expand(1, 1, lq, d)

    def meta(*shape, stride=None, dtype=torch.float32):
        stride = stride or torch.empty(shape, device="meta").stride()
        return torch.empty_strided(shape, stride, dtype=dtype, device="meta")

    q = query(8, 16)
    for d, refused in ((attn.MAX_HEAD_DIM, False), (attn.MAX_HEAD_DIM + 1, True)):
        wide = meta(1, 1, 8, d)
        assert ("query head dim" in _triton_refuses(query(8, d), key=wide, value=wide)) == refused
        assert ("value head dim" in _triton_refuses(q, key=q, value=wide)) == refused
        assert ("value head dim" in _triton_refuses(q, value_head_dim=d)) == refused
    for lq, refused in ((2**23 - 1, False), (2**23, True)):  # Lq x Dv of the output
        assert (
            "slice of the output" in _triton_refuses(query(lq, 16), value_head_dim=256)
        ) == refused
    for row_stride, refused in ((limit - 8, False), (limit - 7, True)):  # last offset 2**31 - 1
        mask = meta(2, 8, stride=(row_stride, 1), dtype=torch.bool)
        assert ("attn_mask spans" in _triton_refuses(q, key=q, value=q, attn_mask=mask)) == refused
    for lk, refused in ((limit // rows, False), (limit // rows + 1, True)):  # dq's mask rows
        k = meta(1, 1, lk, 16)
        why = _triton_refuses(q, key=k, value=k, attn_mask=meta(lk))
        assert ("gradient over" in why) == refused


def test_backend_choice_follows_every_call_s_inputs():
    # The op remembers its backend per device, dtype, shapes and mask geometry: alternating
    # calls that one of those sends elsewhere each get their own backend.
    q, k, v = _qkv(Case(lq=8, lk=8, d=16, grad=False))
    wide = torch.zeros(1, 1, 1, 300, device=DEVICE).expand(2, 2, 8, 300)  # head dim 300
    long_k = torch.zeros(1, 1, 1, 16, device=DEVICE).expand(2, 2, 2**27, 16)  # past int32
    small_mask = torch.ones(8, 8, dtype=torch.bool, device=DEVICE)
    # The same shape with rows 2**29 apart, past int32 offsets (geometry only: no memory).
    huge_mask = torch.empty_strided((8, 8), (2**29, 1), dtype=torch.bool, device="meta")
    for _ in range(2):
        assert attn._backend(q, k, v, None) == "triton"
        assert attn._backend(q, wide, wide, None) == "torch"
        assert attn._backend(q, long_k, long_k, None) == "torch"
        assert attn._backend(q, k, v, small_mask) == "triton"
        assert attn._backend(q, k, v, huge_mask) == "torch"
    if DEVICE == "cpu":  # the interpreter does not take bfloat16
        assert attn._backend(q.bfloat16(), k.bfloat16(), v.bfloat16(), None) == "torch"
        assert attn._backend(q, k, v, None) == "triton"


def test_launches_make_the_device_of_their_tensors_current(monkeypatch):
    # Triton launches on the current device: a call on cuda:1 while cuda:0 is current must
    # switch to cuda:1 for its launches (a stub device context stands in for a GPU here).
    from fastformer.kernels import attention as kernels

    events = []

    class Device:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            events.append(("enter", self.device))

        def __exit__(self, *exc):
            events.append(("exit", self.device))

    class Stub:  # the wrapper reads the first argument's device only
        def __init__(self, device):
            self.device = torch.device(device)

    monkeypatch.setattr(torch.cuda, "device", Device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    launch = kernels._on_device_of(lambda t, x: events.append(("launch", x)) or x)
    assert launch(Stub("cuda:1"), 7) == 7
    cuda1 = torch.device("cuda:1")
    assert events == [("enter", cuda1), ("launch", 7), ("exit", cuda1)]
    events.clear()
    assert launch(Stub("cuda:0"), 8) == 8 and launch(Stub("cpu"), 9) == 9
    assert events == [("launch", 8), ("launch", 9)]  # already current, or not CUDA
    for fn in (kernels.attention_forward, kernels.attention_backward, kernels.key_range):
        assert fn.__wrapped__ is not None, fn.__name__


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two NVIDIA GPUs")
def test_cuda_second_gpu_while_the_first_is_current():
    # The same call on cuda:1, with cuda:1 current and with cuda:0 current: identical results.
    def run(current):
        q, k, v = (_randn((2, 4, 128, 64), torch.bfloat16, s, True, "cuda:1") for s in range(3))
        kpm = torch.zeros(2, 128, dtype=torch.bool, device="cuda:1")
        kpm[:, -9:] = True
        with torch.cuda.device(current):
            out = attn.scaled_dot_product_attention(q, k, v, key_padding_mask=kpm, is_causal=True)
            out.float().sum().backward()
        return out, q.grad, k.grad, v.grad

    for got, expected in zip(run(0), run(1)):
        assert got.device == torch.device("cuda:1") and torch.equal(got, expected)


def test_launch_grids_stay_within_cuda_limits(monkeypatch):
    # CUDA caps grid dims 1 and 2 at 65535: B * H = 65536 (B 2048, H 32) must still launch.
    from fastformer.kernels import attention as kernels

    grids = []

    def record(kernel, grid, *args, **kwargs):
        grids.append((kernel, grid({"BLOCK_M": 16, "BLOCK_N": 16})))

    monkeypatch.setattr(kernels, "_launch", record)
    q = torch.zeros(2048, 32, 4, 16, device=DEVICE)
    out, lse = kernels.attention_forward(q, q, q, None, None, 0, 0.0, False, 0.25)
    kernels.attention_backward(q, None, q, q, q, out, lse, None, None, 0, 0.0, False, 0.25, False)
    assert [kernel for kernel, _ in grids] == ["fwd", "dq", "dkdv"]
    for kernel, grid in grids:
        assert grid == (1, 32, 2048), kernel
        assert max(grid[1:]) <= kernels.MAX_GRID_YZ


@pytest.mark.parametrize(("causal", "padding"), [(False, False), (True, False), (True, True)])
def test_causal_query_blocks_start_longest_first(causal, padding, monkeypatch):
    # A causal query block's key loop grows with its index; the fwd and dq kernels take the
    # blocks last first, so that the programs left running at the end of the grid are short
    # (in index order with key padding, where the reversal made ptxas spill).
    if DEVICE != "cpu":
        pytest.skip("a kernel through the interpreter")
    import triton
    import triton.language as tl

    from fastformer.kernels import attention as kernels

    # The interpreter runs a kernel's source in its module's globals, not in its closure.
    monkeypatch.setitem(globals(), "_query_block", kernels._query_block)

    @triton.jit
    def block_of_program(Out, IS_CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr):
        tl.store(Out + tl.program_id(0), _query_block(IS_CAUSAL, HAS_KPM))  # noqa: F821

    out = torch.full((5,), -1, dtype=torch.int32)
    block_of_program[(5,)](out, IS_CAUSAL=causal, HAS_KPM=padding)
    expected = [4, 3, 2, 1, 0] if causal and not padding else [0, 1, 2, 3, 4]
    assert out.tolist() == expected


@pytest.mark.parametrize(
    ("triton_version", "numpy_version", "refused"),
    [("3.6.0", "2.4.0", True), ("3.6.0", "2.3.5", False), ("3.7.0", "2.4.1", False)],
)
def test_interpreter_refuses_triton36_with_numpy24(
    monkeypatch, triton_version, numpy_version, refused
):
    # Triton 3.6's interpreter raises a bare TypeError deep inside the kernel loop there.
    if DEVICE != "cpu":
        pytest.skip("interpreter routing")
    import numpy
    import triton

    # Import the kernels before faking the version: their config tables read it at import,
    # and a first import here (backend_reasons imports them lazily) kept the fake one for the
    # rest of the worker (the compile check then counted a job that 3.6 leaves out).
    attn._kernels()
    monkeypatch.setattr(triton, "__version__", triton_version)
    monkeypatch.setattr(numpy, "__version__", numpy_version)
    q, k, v = _qkv(Case(lq=8, lk=8, d=16, grad=False))
    why = dict(attn.backend_reasons(q, k, v))["triton"]
    assert any("numpy<2.4" in r for r in why) == refused
    assert (
        any("numpy<2.4" in r for r in dict(_dispatch.explain(attn.OP, None))["triton"]) == refused
    )


@pytest.mark.parametrize(
    ("interpreted", "capability", "reason"),
    [
        (False, (7, 5), "compute capability >= 8.0"),
        (False, (8, 0), None),
        (False, (9, 0), None),
        (True, (9, 0), "interpreter runs CPU tensors only"),
    ],
)
def test_triton_reasons_for_cuda_tensors(monkeypatch, fake_cuda, interpreted, capability, reason):
    # Fake CUDA tensors carry a device and a dtype without a GPU: the choice reads nothing else.
    q = fake_cuda(1, 2, 8, 16, dtype=torch.float16)
    monkeypatch.setattr(attn._kernels(), "INTERPRETED", interpreted)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    why = dict(_dispatch.explain(attn.OP, attn.AttentionInputs(q, key=q, value=q)))["triton"]
    assert len(why) == (reason is not None) and all(reason in r for r in why), why


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_autocast_does_not_reach_the_torch_backend(monkeypatch, dropout_p):
    # The op computes in its inputs' dtype with autocast on or off, as its fake says (float32
    # lse): autocast reached the torch backend's products, called inside an autocast region
    # (the op, or a backward, run there), which returned a bfloat16 lse and bf16-rounded values.
    _use_backend(monkeypatch, "torch")
    q, k, v = _qkv(Case(b=2, h=2, lq=9, lk=11, d=8))
    results = []
    for autocast in (False, True):
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out, lse = attn.scaled_dot_product_attention_with_lse(q, k, v, None, dropout_p)
            loss = out.square().sum() + lse.sum()  # the lse gradient: the explicit backward
            results.append((out, lse, *torch.autograd.grad(loss, (q, k, v))))
    assert results[1][1].dtype == torch.float32
    for plain, under_autocast in zip(*results):
        torch.testing.assert_close(under_autocast, plain, rtol=0, atol=0)


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_reference_backward_gradcheck_float64(dropout_p):
    # The torch backend's backward where torch's CPU flash kernels do not apply (dropout, an lse
    # gradient, a float mask's gradient), in float64 (which only these internals take): q, k, v,
    # a float mask and both outputs, GQA, causal and rows without a key.
    c = Case(b=2, h=4, hkv=2, lq=5, lk=6, d=3, mask="float", mask_shape="b1qk")
    q, k, v = (t.detach().double().requires_grad_() for t in _qkv(c))
    mask = _attn_mask(c).detach().double().requires_grad_()
    kpm = torch.zeros(c.b, c.lk, dtype=torch.bool, device=DEVICE)
    kpm[1, :3] = True  # with causal: rows 0-2 of batch 1 see no key
    rest = (kpm, 1234, dropout_p, True, 0.4)

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, m):
            ctx.save_for_backward(q, k, v, m)
            return attn._reference_forward(q, k, v, m, *rest)

        @staticmethod
        def backward(ctx, grad_out, grad_lse):
            q, k, v, m = ctx.saved_tensors
            return attn._reference_backward(grad_out, grad_lse, q, k, v, m, *rest, True)

    def fn(q, k, v, m):
        out, lse = Attention.apply(q, k, v, m)
        return out, lse.masked_fill(torch.isinf(lse), 0)

    assert torch.autograd.gradcheck(fn, (q, k, v, mask))


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_public_op_in_float64_runs_the_torch_backend_and_passes_gradcheck(dropout_p):
    # float64 (what a swapped float64 model feeds the op) runs the torch backend: the Triton
    # kernel refuses it with a reason, and the public op's out and lse (float64) have exact
    # gradients for q, k, v and a float mask, with causal, key padding, GQA and empty rows.
    c = Case(b=2, h=4, hkv=2, lq=5, lk=6, d=3, causal=True, mask="float", mask_shape="b1qk")
    q, k, v = (t.detach().double().requires_grad_() for t in _qkv(c))
    mask = _attn_mask(c).detach().double().requires_grad_()
    kpm = torch.zeros(c.b, c.lk, dtype=torch.bool, device=DEVICE)
    kpm[1, :3] = True  # with causal: rows 0-2 of batch 1 see no key
    reasons = dict(attn.backend_reasons(q, k, v, mask, enable_gqa=True, key_padding_mask=kpm))
    assert any("torch.float64" in r for r in reasons["triton"]) and reasons["torch"] == []

    def fn(q, k, v, m):
        torch.manual_seed(5)  # one dropout seed for every evaluation gradcheck makes
        out, lse = attn.scaled_dot_product_attention_with_lse(
            q, k, v, m, dropout_p, True, 0.4, True, key_padding_mask=kpm
        )
        assert out.dtype == lse.dtype == attn.lse_dtype(q.dtype) == torch.float64
        return out, lse.masked_fill(torch.isinf(lse), 0)

    want = ref.scaled_dot_product_attention(
        q, k, v, mask, dropout_p, True, 0.4, enable_gqa=True, key_padding_mask=kpm,
        dropout_mask=attn.dropout_keep_mask(_seed_of_call(5), c.b, c.h, c.lq, c.lk, dropout_p)
        if dropout_p else None,
    )  # fmt: skip
    torch.testing.assert_close(fn(q, k, v, mask)[0], want, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(fn, (q, k, v, mask))
    # The fake says what the op returns in float64 (lse included), for torch.compile.
    q, k, v = (t.detach().double().requires_grad_() for t in _qkv(replace(c, hkv=0)))
    op = torch.ops.fastformer.attention.default
    torch.library.opcheck(op, (q, k, v, mask, kpm, 0.0, True, 0.4))


@pytest.mark.parametrize("mask_grad", [False, True])
def test_float32_mask_of_a_float64_query(monkeypatch, mask_grad):
    # torch's CPU flash kernels took a float32 mask of float64 q wrong from 16 keys on (out off
    # by up to 1.9): the torch backend hands them the mask in float64.
    _use_backend(monkeypatch, "torch")
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 17, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = torch.randn(2, 1, 17, 17, generator=gen)  # float32
    inputs = [t.requires_grad_() for t in (q, k, v)] + [mask.requires_grad_(mask_grad)]
    assert_parity(
        compare_with_reference(
            attn.scaled_dot_product_attention,
            lambda q, k, v, m: ref.scaled_dot_product_attention(q, k, v, m.to(q.dtype)),
            inputs,
            names=["q", "k", "v", "mask"][: 3 + mask_grad],
        )
    )


def _seed_of_call(manual_seed: int) -> int:
    """The dropout seed a CPU op call draws right after torch.manual_seed(manual_seed)."""
    torch.manual_seed(manual_seed)
    return rng.draw_call_seed(torch.device("cpu"))


@pytest.mark.parametrize("entry", [True, False], ids=["entry", "checked_path"])
@pytest.mark.parametrize(
    ("dropout_p", "mask", "dtype", "flash"),
    [(0.0, "float", F32, True), (0.0, "float", BF16, True), (0.0, "float", F16, True),
     (0.0, "", F32, True), (0.2, "", F32, False)],
)  # fmt: skip
def test_torch_backend_uses_cpu_flash_kernels_without_dropout(
    monkeypatch, dropout_p, mask, dtype, flash, entry
):
    # The parity tests above hold whichever path runs; this pins which one does, from the C
    # entry (attention_cpu_eager) and from the checked Python path. A float32 mask of 16-bit
    # inputs too: the kernels keep its bits (test_float32_mask_of_16_bit_query_keeps_its_bits),
    # and took 3-8x less time than the reference there (NOTES.md).
    if DEVICE != "cpu" or attn._CPU_FLASH is None:
        pytest.skip("torch's CPU flash kernels")
    if not entry:
        monkeypatch.setattr(attn, "_EAGER", None)
    _use_backend(monkeypatch, "torch")
    c = Case(lq=9, lk=12, d=16, causal=True, mask=mask, mask_dtype=F32, kpm="random", grad=False)
    q, k, v = (t.to(dtype).requires_grad_() for t in _qkv(c))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = attn.scaled_dot_product_attention(
            q, k, v, _attn_mask(c), dropout_p, True, key_padding_mask=_key_padding(c)
        )
        out.sum().backward()
    names = [e.name for e in prof.events()]
    kernels = [n for n in names if n.startswith("aten::_scaled_dot_product_flash_attention_for")]
    assert len(kernels) == (2 if flash else 0), kernels


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_float32_mask_of_16_bit_query_keeps_its_bits(monkeypatch, dtype):
    # Kernels and reference add the float32 mask to float32 scores; so do torch's CPU flash
    # kernels, given it (cast to q's dtype first, 3001.5 was rounded to 3000 or 3008).
    _use_backend(monkeypatch, "torch")
    q, k, v = (torch.zeros(1, 1, 1, 16, dtype=dtype), *torch.zeros(2, 1, 1, 2, 16, dtype=dtype))
    v[0, 0, 0, 0] = v[0, 0, 1, 1] = 1
    mask = torch.tensor([[3000.0, 3001.5]])
    out = attn.scaled_dot_product_attention(q, k, v, mask)[0, 0, 0, :2].double()
    expected = torch.softmax(mask.double(), -1)[0]
    torch.testing.assert_close(out, expected, atol=4e-3, rtol=0)


@pytest.mark.parametrize("backend", ["default", "torch"])
def test_strided_grad_out(monkeypatch, backend):
    # A gradient whose last stride is not 1 (on CPU the torch backend hands the flash kernels
    # unit-stride tensors: torch 2.11's forward misreads a strided q, k or v).
    _use_backend(monkeypatch, backend)
    c = Case(lq=33, lk=40, d=16, causal=True, kpm="random")
    q, k, v = _qkv(c)
    out = attn.scaled_dot_product_attention(
        q, k, v, is_causal=True, key_padding_mask=_key_padding(c)
    )
    grad = _randn((*out.shape[:-1], 2 * out.shape[-1]), seed=5)[..., ::2]
    strided = torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
    dense = torch.autograd.grad(out, (q, k, v), grad.contiguous())
    for a, b in zip(strided, dense):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
def test_output_keeps_the_memory_order_of_heads_split_off_a_projection(grad, batch_first):
    # q, k, v as nn.MultiheadAttention's fast path makes them: head-split views of one packed
    # (B, L, 3E) (or (L, B, 3E)) projection. The output comes back in the same order of dims
    # (merging its heads is then a view, not a copy), with the reference's values and
    # gradients; a contiguous query gets a contiguous output.
    b, h, seq, d = 2, 3, 33, 16
    packed = _randn((b, seq, 3 * h * d) if batch_first else (seq, b, 3 * h * d), grad=grad)
    perm = (2, 0, 3, 1, 4) if batch_first else (2, 1, 3, 0, 4)

    def run(fn, x):
        q, k, v = x.unflatten(-1, (3, h, d)).permute(*perm).unbind(0)
        return fn(q, k, v, is_causal=True)

    out = run(attn.scaled_dot_product_attention, packed)
    merged = out.transpose(1, 2) if batch_first else out.permute(2, 0, 1, 3)
    assert merged.is_contiguous(), out.stride()
    fast = functools.partial(run, attn.scaled_dot_product_attention)
    reference = functools.partial(run, ref.scaled_dot_product_attention)
    assert_parity(compare_with_reference(fast, reference, [packed], names=["qkv"]))
    q = _randn((b, h, seq, d))
    assert attn.scaled_dot_product_attention(q, q, q, is_causal=True).is_contiguous()


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_output_buffer_takes_the_query_s_order_of_dims(order):
    # _empty_like_order: (B, H, L, Dv) lying in memory with q's (B, H, L) dims in q's order
    # (outermost first), dense; where a (batch, head) slice of that layout would span int32
    # offsets (meta tensors: no memory), contiguous instead.
    from fastformer.kernels.attention import INT32_LIMIT, _empty_like_order, slice_extent

    def in_order(sizes, d, device):  # (B, H, L, d) allocated with its (B, H, L) dims in `order`
        alloc = torch.empty(*(sizes[i] for i in order), d, device=device)
        return alloc.permute(*(order.index(i) for i in range(3)), 3)

    def stride_order(t):
        return sorted(range(3), key=lambda i: -t.stride(i))

    for device, sizes in (("cpu", (2, 3, 5)), ("meta", (2, 128, 2**22))):
        q = in_order(sizes, 8, device)
        assert tuple(q.shape[:3]) == sizes and stride_order(q) == list(order)
        out = _empty_like_order(q, (*sizes, 4))
        assert tuple(out.shape) == (*sizes, 4)
        if slice_extent(in_order(sizes, 4, device)) < INT32_LIMIT:
            assert out.permute(*order, 3).is_contiguous(), (out.shape, out.stride())
        else:
            assert out.is_contiguous() and device == "meta"


@pytest.mark.parametrize("seq_first", [False, True])
@pytest.mark.parametrize("expanded", [0, 1, 2])
def test_output_of_an_expanded_query_is_contiguous(expanded, seq_first):
    # A query broadcast along batch, heads or sequence (stride 0) is no projection's split to
    # merge back: the output is contiguous, as torch's SDPA gives it, with the same values.
    sizes = [3, 2, 5]
    one = list(sizes)
    one[expanded] = 1
    if seq_first:  # laid out (L, B, H, D) before the expansion
        q = _randn((one[2], one[0], one[1], 8)).permute(1, 2, 0, 3).expand(*sizes, 8)
    else:
        q = _randn((*one, 8)).expand(*sizes, 8)
    k, v = _randn((*sizes[:2], 7, 8), seed=1), _randn((*sizes[:2], 7, 8), seed=2)
    out = attn.scaled_dot_product_attention(q, k, v)
    assert out.is_contiguous(), out.stride()
    torch.testing.assert_close(out, ref.scaled_dot_product_attention(q, k, v))


def test_gradient_buffers_share_storage_only_for_a_packed_projection():
    # grads_like: one buffer for q, k, v split off one packed projection (or k, v), with their
    # strides; never for tensors that alias each other or leave gaps between them.
    from fastformer.kernels.attention import grads_like

    b, h, seq, d = 2, 3, 5, 4

    def heads(x, n):  # (B, L, n*H*D) -> n (B, H, L, D) views
        return x.unflatten(-1, (n, h, d)).permute(2, 0, 3, 1, 4).unbind(0)

    def storages(ts):
        return len({t.untyped_storage().data_ptr() for t in ts})

    packed = heads(_randn((b, seq, 3 * h * d)), 3)
    grads = grads_like(*packed)
    assert storages(grads) == 1 and [g.stride() for g in grads] == [t.stride() for t in packed]
    assert grads[0].untyped_storage().nbytes() == 3 * packed[0].numel() * 4  # no spare room
    q = heads(_randn((b, seq, h * d)), 1)[0]
    k, v = heads(_randn((b, seq, 2 * h * d)), 2)
    grads = grads_like(q, k, v)
    assert storages(grads) == 2 and all(g.stride() == t.stride() for g, t in zip(grads, (q, k, v)))
    x = _randn((b, h, seq, d))
    assert storages(grads_like(x, x, x)) == 3  # the same tensor thrice: no aliasing
    gapped = heads(_randn((b, seq, 4 * h * d)), 4)[:3]  # rows longer than the three parts
    assert storages(grads_like(*gapped)) == 3

    def self_attention(fn, x):
        return fn(x, x, x, is_causal=True)

    fast = functools.partial(self_attention, attn.scaled_dot_product_attention)
    reference = functools.partial(self_attention, ref.scaled_dot_product_attention)
    assert_parity(compare_with_reference(fast, reference, [x.requires_grad_()], names=["x"]))


def test_bfloat16_on_cpu_runs_the_torch_backend():
    if DEVICE != "cpu":
        pytest.skip("CPU-only routing")
    q, k, v = (t.bfloat16() for t in _qkv(Case(lq=9, lk=9, d=16, grad=False)))
    out = attn.scaled_dot_product_attention(q, k, v, is_causal=True)
    expected = ref.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert max_abs_diff(out, expected) < 2e-2


# --------------------------------------------------------------------------- errors


def _good():
    q = torch.zeros(2, 4, 5, 8, device=DEVICE)
    k = torch.zeros(2, 4, 6, 8, device=DEVICE)
    v = torch.zeros(2, 4, 6, 8, device=DEVICE)
    return q, k, v


def _bad(**change):
    q, k, v = _good()
    args = dict(
        query=q,
        key=k,
        value=v,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
        key_padding_mask=None,
    )
    args.update(change)
    return args


def _z(*shape, dtype=F32):
    return torch.zeros(shape, dtype=dtype, device=DEVICE)


def _huge(seq):
    # Stride-0 views: shapes as large as we like without memory.
    return torch.zeros(1, 1, 1, 8, device=DEVICE).expand(1, 1, seq, 8)


ERRORS = {
    "query_3d": (_bad(query=_z(2, 5, 8)), ValueError, "query must be 4-D"),
    "key_not_tensor": (_bad(key=[1.0]), TypeError, "key must be a torch.Tensor"),
    "int_dtype": (
        _bad(value=_z(2, 4, 6, 8, dtype=torch.int32)),
        TypeError,
        "value must be float16",
    ),
    "mixed_dtypes": (
        _bad(key=_z(2, 4, 6, 8, dtype=F16)),
        TypeError,
        "key has dtype torch.float16 but query",
    ),
    "batch_mismatch": (
        _bad(key=_z(3, 4, 6, 8), value=_z(3, 4, 6, 8)),
        ValueError,
        "key has batch 3",
    ),
    "head_dim_mismatch": (_bad(key=_z(2, 4, 6, 4)), ValueError, "key head_dim 4"),
    "kv_seq_mismatch": (_bad(value=_z(2, 4, 7, 8)), ValueError, "value"),
    "heads_without_gqa": (
        _bad(key=_z(2, 2, 6, 8), value=_z(2, 2, 6, 8)),
        ValueError,
        "enable_gqa=True",
    ),
    "gqa_not_divisible": (
        _bad(key=_z(2, 3, 6, 8), value=_z(2, 3, 6, 8), enable_gqa=True),
        ValueError,
        "divisible",
    ),
    "head_dim_too_big": (
        _bad(query=_z(2, 4, 5, 300), key=_z(2, 4, 6, 300)),
        ValueError,
        r"head_dim must be in \[1, 256\], got 300",
    ),
    "value_head_dim_zero": (
        _bad(value=_z(2, 4, 6, 0)),
        ValueError,
        r"value head_dim must be in \[1, 256\], got 0",
    ),
    "mask_seq_k": (_bad(attn_mask=_z(5, 7)), ValueError, "seq_k dim has size 7"),
    "mask_heads": (_bad(attn_mask=_z(2, 3, 5, 6)), ValueError, "heads dim has size 3"),
    "mask_5d": (_bad(attn_mask=_z(1, 2, 4, 5, 6)), ValueError, "at most 4 dims"),
    "mask_int": (
        _bad(attn_mask=_z(5, 6, dtype=torch.int64)),
        TypeError,
        "attn_mask must be bool or float",
    ),
    "mask_f64": (
        _bad(attn_mask=_z(5, 6, dtype=torch.float64)),
        TypeError,
        "attn_mask must be bool or float",
    ),
    "kpm_shape": (
        _bad(key_padding_mask=_z(2, 5, dtype=torch.bool)),
        ValueError,
        r"key_padding_mask must have shape \(batch, seq_k\) = \(2, 6\)",
    ),
    "kpm_dtype": (_bad(key_padding_mask=_z(2, 6)), TypeError, "key_padding_mask must be bool"),
    "dropout_one": (_bad(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\), got 1.0"),
    "dropout_negative": (_bad(dropout_p=-0.1), ValueError, "dropout_p must be in"),
    "dropout_str": (_bad(dropout_p="0.1"), TypeError, "dropout_p must be a float"),
    # round(p * 65536) = 65536: no 16-bit lane reaches the keep threshold, all would be dropped
    "dropout_near_one": (_bad(dropout_p=0.9925), ValueError, r"at most 0\.99237.*by more than"),
    "dropout_too_many_scores": (
        _bad(query=_huge(2**20), key=_huge(2**15), value=_huge(2**15), dropout_p=0.1),
        ValueError,
        r"seq_q \* 4 \* ceil\(seq_k / 32\) < 2\*\*32",
    ),
    "scale_zero": (_bad(scale=0.0), ValueError, "scale must be a finite number > 0, got 0.0"),
    "scale_nan": (_bad(scale=float("nan")), ValueError, "scale must be a finite number > 0"),
    "scale_str": (_bad(scale="1"), TypeError, "scale must be a float or None"),
    # an int past float's range: OverflowError from float() once checked
    "scale_huge_int": (_bad(scale=10**400), ValueError, "scale must be a finite number > 0"),
    "causal_int": (_bad(is_causal=1), TypeError, "is_causal must be a bool"),
    "causal_numpy": (_bad(is_causal=np.bool_(True)), TypeError, "must be a bool, got numpy.bool"),
    "gqa_numpy": (_bad(enable_gqa=np.bool_(False)), TypeError, "must be a bool, got numpy.bool"),
    # just below 1 as a numpy.longdouble, 1.0 as the float the kernels take
    "dropout_rounds_to_one": (
        _bad(dropout_p=np.longdouble(1) - np.longdouble(2) ** -60),
        ValueError,
        r"dropout_p must be in \[0, 1\)",
    ),
    "query_sparse": (_bad(query=_z(2, 4, 5, 8).to_sparse()), ValueError, "query must be a dense"),
    # Non-tensor masks and a second device: a mutation run left these checks untested (a list
    # mask gave an AttributeError; a meta tensor is a second device on a CPU-only machine).
    "mask_list": (_bad(attn_mask=[[True] * 6] * 5), TypeError, "attn_mask must be a torch.Tensor"),
    "kpm_list": (
        _bad(key_padding_mask=[[False] * 6] * 2),
        TypeError,
        "key_padding_mask must be a torch.Tensor",
    ),
    **{
        f"{name}_meta": (
            _bad(**{name: torch.zeros(shape, dtype=dtype, device="meta")}),
            ValueError,
            f"{name} is on meta but query is on",
        )
        for name, shape, dtype in (
            ("key", (2, 4, 6, 8), F32),
            ("value", (2, 4, 6, 8), F32),
            ("attn_mask", (5, 6), torch.bool),
            ("key_padding_mask", (2, 6), torch.bool),
        )
    },
    "mask_sparse": (
        _bad(attn_mask=_z(5, 6).to_sparse()),
        ValueError,
        "attn_mask must be a dense strided tensor, got layout torch.sparse_coo",
    ),
    "kpm_sparse": (
        _bad(key_padding_mask=_z(2, 6, dtype=torch.bool).to_sparse()),
        ValueError,
        "key_padding_mask must be a dense strided tensor",
    ),
    # value is checked against query as key is, not only in its sequence length
    "value_dtype": (
        _bad(value=_z(2, 4, 6, 8, dtype=F16)),
        TypeError,
        "value has dtype torch.float16 but query",
    ),
    "value_heads": (_bad(value=_z(2, 2, 6, 8)), ValueError, r"must match key .* in heads"),
    # h % 0 would raise ZeroDivisionError
    "gqa_no_kv_heads": (
        _bad(key=_z(2, 0, 6, 8), value=_z(2, 0, 6, 8), enable_gqa=True),
        ValueError,
        r"divisible by key/value heads \(0\)",
    ),
    # True is a numbers.Real: it would run as a scale of 1.0
    "scale_bool": (_bad(scale=True), TypeError, "scale must be a float or None, got bool$"),
    # torch's CausalBias: its values are uninitialized memory, wrong as a float mask
    "causal_bias_and_is_causal": (
        _bad(attn_mask=causal_lower_right(5, 6), is_causal=True),
        ValueError,
        "attn_mask is a CausalBias and is_causal=True",
    ),
    "causal_bias_size": (
        _bad(attn_mask=causal_upper_left(5, 7)),
        ValueError,
        r"CausalBias of size \(seq_len_q, seq_len_kv\) = \(5, 7\), expected \(seq_q, seq_k\) "
        r"= \(5, 6\)",
    ),
    "causal_bias_causal_int": (
        _bad(attn_mask=causal_upper_left(5, 6), is_causal=1),
        TypeError,
        "is_causal must be a bool",
    ),
}


# "torch": the CPU entry (attention_cpu_eager) is offered the calls too; it must decline each.
@pytest.mark.parametrize("backend", ["default", "torch"])
@pytest.mark.parametrize("name", list(ERRORS))
def test_bad_inputs_raise_before_launch(name, backend, monkeypatch):
    def must_not_run(*args, **kwargs):
        # (without a check the oversized dropout case would compute for hours, not fail)
        raise AssertionError("the op ran on bad inputs")

    _use_backend(monkeypatch, backend)
    monkeypatch.setattr(attn, "_forward", must_not_run)
    kwargs, exc, pattern = ERRORS[name]
    kwargs = dict(kwargs)  # (each backend's case pops from its own copy)
    kpm = kwargs.pop("key_padding_mask")
    with pytest.raises(exc, match=f"^{attn._OP_NAME}: .*{pattern}"):
        attn.scaled_dot_product_attention(**kwargs, key_padding_mask=kpm)


def test_the_largest_allowed_dropout_p_is_accepted():
    # The limit is inclusive, as its message says ("at most").
    p = rng.max_dropout_p(rng.ATTENTION_KEEP_ERROR)
    assert dict(attn.backend_reasons(*_good(), dropout_p=p))["torch"] == []
    with pytest.raises(ValueError, match="dropout_p must be at most"):
        attn.backend_reasons(*_good(), dropout_p=math.nextafter(p, 1.0))


def test_drawn_keep_mask_op_names_itself_for_a_negative_seq_k():
    with pytest.raises(ValueError, match="^attention_drawn_keep_mask: seq_k must be >= 0, got -1"):
        torch.ops.fastformer.attention_drawn_keep_mask(_z(1, 1, 2, 8), -1, 0.1)


def test_mixed_devices_raise():
    if not torch.cuda.is_available():
        pytest.skip("needs a second device type")
    q, k, v = _good()
    with pytest.raises(ValueError, match="key is on cpu"):
        attn.scaled_dot_product_attention(q, k.cpu(), v)


def test_dropout_keep_mask_errors():
    # On the meta device a missed size check returns at once instead of building 2**35 lanes.
    with pytest.raises(ValueError, match=r"seq_q \* 4 \* ceil\(seq_k / 32\) < 2\*\*32"):
        attn.dropout_keep_mask(1, 1, 1, 2**20, 2**15, 0.1, "meta")  # 2**20 rows * 2**12 calls
    with pytest.raises(ValueError, match=r"seq_q \* 4 \* ceil\(seq_k / 32\) < 2\*\*32"):
        attn.dropout_keep_mask(1, 1, 1, 2**19, 2**16 - 7, 0.1, "meta")  # ceil: 2**13 calls
    with pytest.raises(ValueError, match="batch must be an int >= 0"):
        attn.dropout_keep_mask(1, -1, 1, 4, 4, 0.1)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        attn.dropout_keep_mask(1, 1, 1, 4, 4, 1.5)
    # The CPU kernel's schema took a bool or a numpy int, and refused a float opaquely.
    for seed, name in ((1.5, "float"), (True, "bool"), (np.int64(7), "numpy.int64")):
        with pytest.raises(
            TypeError, match=f"^dropout_keep_mask: seed must be an int, got {name}$"
        ):
            attn.dropout_keep_mask(seed, 1, 1, 4, 4, 0.1)
    with pytest.raises(ValueError, match=r"^dropout_keep_mask: seed must be in \[0, 2\*\*64\)"):
        attn.dropout_keep_mask(-1, 1, 1, 4, 4, 0.1)


_REASONS_BAD = {  # name: (q, k, v -> args, kwargs), error, the op's message
    "query 3-D": (lambda q, k, v: ((q[0], k[0], v[0]), {}), ValueError, r"query must be 4-D"),
    "query None": (lambda q, k, v: ((None, k, v), {}), TypeError, r"got NoneType"),
    "value seq": (lambda q, k, v: ((q, k, v[:, :, :4]), {}), ValueError, r"must match key"),
    "dropout_p": (lambda q, k, v: ((q, k, v), dict(dropout_p=5.0)), ValueError, r"\[0, 1\)"),
    "is_causal": (lambda q, k, v: ((q, k, v), dict(is_causal=1)), TypeError, r"is_causal"),
    "scale": (lambda q, k, v: ((q, k, v), dict(scale=-1.0)), ValueError, r"scale must be"),
    "enable_gqa": (
        lambda q, k, v: ((q, k[:, :3], v[:, :3]), dict(enable_gqa=True)),
        ValueError,
        r"divisible by",
    ),
    "key_padding_mask": (
        lambda q, k, v: ((q, k, v), dict(key_padding_mask=k[0, 0, :, 0].bool())),
        ValueError,
        r"key_padding_mask must have shape \(batch, seq_k\)",
    ),
    "causal bias": (
        lambda q, k, v: ((q, k, v, causal_upper_left(q.shape[2], k.shape[2] + 1)), {}),
        ValueError,
        r"attn_mask is a CausalBias of size",
    ),
}


@pytest.mark.parametrize("case", list(_REASONS_BAD))
def test_backend_reasons_checks_its_arguments_as_the_op(case):
    # It answered for a 3-D query (no call runs one) and raised AttributeError for None.
    change, error, match = _REASONS_BAD[case]
    args, kwargs = change(*_good())
    with pytest.raises(error, match=match):
        attn.scaled_dot_product_attention(*args, **kwargs)
    with pytest.raises(error, match=match):
        attn.backend_reasons(*args, **kwargs)


def test_backend_reasons_reads_only_the_tensors_and_mask():
    # As its docstring says: the other arguments are checked but never change the answer.
    q, k, v = _good()
    kpm = torch.zeros(2, 6, dtype=torch.bool, device=DEVICE)
    plain = attn.backend_reasons(q, k, v)
    others = dict(dropout_p=0.3, is_causal=True, scale=0.5, key_padding_mask=kpm)
    assert attn.backend_reasons(q, k, v, **others) == plain
    assert attn.backend_reasons(q, k[:, :2], v[:, :2], enable_gqa=True) == plain
    lq, lk = q.shape[2], k.shape[2]
    assert attn.backend_reasons(q, k, v, causal_upper_left(lq, lk)) == plain
    lower_right = torch.ones(lq, lk, dtype=torch.bool, device=DEVICE).tril(lk - lq)
    want = attn.backend_reasons(q, k, v, lower_right)
    assert attn.backend_reasons(q, k, v, causal_lower_right(lq, lk)) == want


# --------------------------------------------------------------------------- compile check


_COMPILE_ARCHS = (90, 80)
_COMPILE_TESTS = ("test_compile_report",)
_COMPILE_STALL_S = 300


def _cuobjdump_found() -> bool:
    from fastformer import _cuobjdump

    return _cuobjdump.cuobjdump_path() is not None


def _compile_dir(tmp_path_factory) -> Path:
    # Shared by the xdist workers of one run (their base temps are siblings), so that only the
    # first worker to get here starts the compile job.
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "compile_report"


def _selected_archs(session) -> list[int]:
    # The archs whose test_compile_report runs: CI deselects sm_80 (a cold Triton cache makes it
    # minutes of CPU), and the compile job builds only what is checked.
    items = [item for item in session.items if item.originalname in _COMPILE_TESTS]
    return sorted({item.callspec.params["arch"] for item in items}, reverse=True)


def _heaviest_only(request) -> bool:
    return request.config.getoption("compile_heaviest_only")


def _start_compile(folder: Path, archs: list[int], heaviest_only: bool) -> None:
    # One subprocess without TRITON_INTERPRET (the interpreter replaces the JIT) compiling on 2
    # processes, to files (a full pipe would stall it); `rc` appears when it is done.
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / "started").exists():
            return
        (folder / "started").touch()
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    args = ["--heaviest-only"] * heaviest_only + [str(arch) for arch in archs]
    script = (
        f'"$0" -m fastformer.kernels.attention {" ".join(args)} >out 2>err; '
        "echo $? >rc.tmp; mv rc.tmp rc"
    )
    subprocess.Popen(["sh", "-c", script, sys.executable], cwd=folder, env=env)


@pytest.fixture(scope="module", autouse=True)
def _compile_in_background(request, tmp_path_factory):
    # The compile check is this file's slowest test (minutes of CPU): when it is selected,
    # start it with the module so that it overlaps the interpreter tests.
    archs = _selected_archs(request.session)
    if archs and _cuobjdump_found():
        _start_compile(_compile_dir(tmp_path_factory), archs, _heaviest_only(request))


def _compile_rows(request, tmp_path_factory) -> list[dict]:
    folder = _compile_dir(tmp_path_factory)
    _start_compile(folder, _selected_archs(request.session), _heaviest_only(request))
    # A stall, not a total: one kernel takes seconds, the whole job 5-25 minutes of a 2-core
    # CI machine (it shares them with the tests), and a slow machine is not a failure.
    out, size, last = folder / "out", -1, time.monotonic()
    while not (folder / "rc").exists():
        if out.exists() and out.stat().st_size != size:
            size, last = out.stat().st_size, time.monotonic()
        assert time.monotonic() - last < _COMPILE_STALL_S, (
            f"the compile job printed nothing for {_COMPILE_STALL_S} s"
        )
        time.sleep(1)
    stderr = (folder / "err").read_text()
    assert (folder / "rc").read_text().strip() == "0", stderr[-3000:]
    lines = (folder / "out").read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


@pytest.mark.every_case
@pytest.mark.timeout(3600)  # waits for the compile job, which _compile_rows watches for stalls
@pytest.mark.parametrize("arch", _COMPILE_ARCHS)
def test_compile_report(arch, request, tmp_path_factory):
    """Every config of the arch table compiles without a GPU: no spills (the cubins' stack
    frames), shared memory within the arch's limit; on sm_90 wgmma for fp16/bf16."""
    if not _cuobjdump_found():
        pytest.skip("cuobjdump not found (Triton's wheel ships it; CUOBJDUMP overrides)")
    from fastformer.kernels import attention as kernels

    report = [r for r in _compile_rows(request, tmp_path_factory) if r["arch"] == arch]
    assert len(report) == len(kernels.compile_jobs(arch, _heaviest_only(request)))
    assert kernels.check_compile_report(report) == []
    kinds = {(r["kernel"], r["variant"]) for r in report}
    assert {("fwd", "all"), ("dkdv", "all"), ("dq", "all")} <= kinds
    if not _heaviest_only(request):  # (the heaviest classes hold no bf16 kernel)
        assert ("fwd", "causal") in kinds
        assert arch != 90 or any(r["dtype"] == "bfloat16" and r["wgmma"] for r in report)


# Run without TRITON_INTERPRET and without a GPU: a stand-in driver makes Triton's JIT target
# sm_90, so `_precompile` compiles real kernels through the same path as on a GPU.
_SM90_SCRIPT = """
import triton

import torch
from fastformer.testing import sm90_jit

sm90_jit()
from fastformer.kernels import attention as A


class CudaTensor:  # what _precompile reads of the query: its device and dtype
    device = torch.device("cuda", 0)
    dtype = torch.float16


A.arch_family = lambda device: 90
launches = []
A._launch = lambda *launch, then=(), tma=False: launches.append((A._Launch(*launch[:4]), then))
q, g = (torch.randn(1, 2, 64, 64, dtype=torch.float16) for _ in range(2))
lse = torch.zeros(1, 2, 64)
dq, dk, dv = (torch.empty_like(q) for _ in range(3))
A._backward_kernels(g, None, q, q, q, q, lse, None, None, 0, 0.0, False, 0.125, dq, dk, dv, None,
                    None, None, None)
"""
_PRECOMPILE_SCRIPT = (
    _SM90_SCRIPT
    + """
(dq, then), *rest = launches
assert [launch.kernel for launch in then] == [launch.kernel for launch, _ in rest] == ["dkdv"]
launches = [dq, *then]
A._precompile(launches, CudaTensor())  # as dq's _launch does: dq's and dK/dV's candidates
for launch in launches:
    fn, table = A.KERNELS[launch.kernel], A._table_key(launch.kernel, launch.meta, CudaTensor())
    configs = A._autotuned(launch.kernel, *table).configs
    cache = fn.device_caches[0][0]
    before = len(cache)
    for config in configs:  # the launches the autotuner makes next: already compiled
        fn.warmup(*launch.args, **launch.meta, **config.all_kwargs(), grid=launch.grid)
    print(launch.kernel, len(configs), before, len(cache))
# Failing in the compile (a tile of 3 rows) and before it (3 warps): the others compile.
fwd = A._Launch("dq", launches[0].grid, launches[0].args, launches[0].meta)
tiles = lambda m, n: {"BLOCK_M": m, "BLOCK_N": n, "USE_TMA": False}
broken = [triton.Config(tiles(3, 64), num_warps=4, num_stages=3)]
broken.append(triton.Config(tiles(64, 64), num_warps=3, num_stages=3))
broken.insert(1, triton.Config(tiles(64, 32), num_warps=4, num_stages=2))
A._compile_at_once([(fwd, config) for config in broken])
cache = A.KERNELS["dq"].device_caches[0][0]
compiled = [kernel.result(ignore_errors=True) if hasattr(kernel, "future") else kernel
            for kernel in cache.values()]
print("compiled", sum(kernel is not None for kernel in compiled))
"""
)


_TUNING_CACHE_SCRIPT = (
    _SM90_SCRIPT
    + """
dkdv = launches[-1][0]
table = A._table_key("dkdv", dkdv.meta, CudaTensor())
A.KERNELS["dkdv"].run = lambda *args, **kwargs: None  # the launch after tuning: none here
timed = []


def bench(*args, config, **meta):  # the last candidate timed is the fastest
    timed.append(config)
    return [2.0 - 0.1 * len(timed), 0.0, 0.0]


def refuse(*args, config, **meta):
    raise AssertionError("timed again instead of reading the disk cache")


for process, timing in (("first", bench), ("later", refuse)):
    A._autotuned.cache_clear()  # a new autotuner, as in a new process
    tuned = A._autotuned("dkdv", *table)
    tuned._bench = timing
    tuned[dkdv.grid](*dkdv.args, **dkdv.meta)
    ms = sorted(round(t[0], 2) for t in tuned.configs_timings.values())
    print(process, len(timed), A._config_name(tuned.best_config), ms)
print("last candidate", A._config_name(tuned.configs[-1]))
"""
)


_FP_FUSION_SCRIPT = (
    _SM90_SCRIPT
    + """
from triton.backends.nvidia.compiler import CUDABackend

asked = []
parse = CUDABackend.parse_options


def recorded(self, options):
    asked.append(options.get("enable_fp_fusion"))
    return parse(self, options)


CUDABackend.parse_options = recorded
(dq, then), *rest = launches
A._precompile([dq, *then], CudaTensor())  # through Triton's JIT
config = A.CONFIGS[("fwd", 90, "16bit", 64, "base")][0]
A.compile_one("fwd", torch.float16, 64, config, A.CHECK_VARIANTS["base"])  # triton.compile
print(len(asked), sorted(set(map(str, asked))))
"""
)


def test_every_compile_and_launch_asks_for_fp_fusion(monkeypatch, tmp_path):
    # Triton 3.10 turns FMA contraction off by default (3.9 warns of it): the configs were tuned
    # and checked with it on, so fastformer asks for it, here against a default set off.
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    count, values = _run_sm90(_FP_FUSION_SCRIPT, tmp_path).strip().split(" ", 1)
    assert int(count) >= 3 and values == "['True']"

    from fastformer.kernels import attention as kernels
    from fastformer.kernels import launcher

    options, launch = [], launcher.launch
    monkeypatch.setattr(launcher, "launch", lambda *a: options.append((a[0], a[-1])) or launch(*a))
    q = _randn((1, 1, 5, 16))
    kpm = torch.tensor([[False, False, True, False, True]])
    attn.scaled_dot_product_attention(q, q, q, key_padding_mask=kpm)  # fwd and kv_range
    assert {fn for fn, _ in options} == {kernels.attn_fwd, kernels.attn_kv_range}
    assert all(o["enable_fp_fusion"] is True for _, o in options)
    for kernel in ("fwd", "dq", "dkdv"):
        tuner = kernels._autotuned(kernel, 90, "16bit", 64, "base")
        assert all(c.all_kwargs()["enable_fp_fusion"] is True for c in tuner.configs)


def test_each_autotuner_keys_on_its_kernel_s_own_arguments():
    # Triton <= 3.8 dropped a key name that is not an argument of the kernel; 3.9 refuses it
    # when the autotuner is made, which made every GPU launch fail.
    from fastformer.kernels import attention as kernels

    for kernel in ("fwd", "dq", "dkdv"):
        tuner = kernels._autotuned(kernel, 90, "16bit", 64, "base")
        names = kernels.KERNELS[kernel].arg_names
        assert set(tuner.keys) <= set(names), kernel
        assert set(tuner.keys) == set(kernels._TUNE_KEY) & set(names), kernel
        assert {"SEQ_Q_BUCKET", "SEQ_K_BUCKET", "HEAD_D", "IS_CAUSAL"} <= set(tuner.keys)
    assert "PART" in kernels._autotuned("dkdv", 90, "16bit", 64, "base").keys
    assert "WRITE_DS" in kernels._autotuned("dq", 90, "16bit", 64, "base").keys


def test_tuning_choices_are_read_back_from_disk(tmp_path):
    """The autotuner keeps each key's choice and timings in Triton's cache directory: a new
    autotuner (a new process) launches the same config without timing anything (sm_90 through a
    stand-in driver, the timing replaced)."""
    result = _run_sm90(_TUNING_CACHE_SCRIPT, tmp_path)
    first, later, last = result.splitlines()
    _, timed, choice = first.split(" ", 2)  # "first <candidates timed> <chosen> [<ms>...]"
    assert int(timed) >= 2 and choice.startswith(last.removeprefix("last candidate ") + " [")
    assert later == first.replace("first", "later", 1)  # the same choice and timings


def _run_sm90(script: str, cache_dir) -> str:
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_precompile_compiles_every_candidate_for_the_autotuner(tmp_path):
    """The autotuner's candidates of a backward's new keys (dq and dK/dV) are compiled at once,
    in threads, into the very cache entries its launches look up; a candidate that fails to
    compile is left to the autotuner. Compiled for sm_90 through Triton's JIT without a GPU."""
    *launches, compiled = _run_sm90(_PRECOMPILE_SCRIPT, tmp_path).splitlines()
    assert [line.split()[0] for line in launches] == ["dq", "dkdv"]
    for line in launches:
        _, candidates, before, after = line.split()
        assert int(candidates) >= 2 and int(before) == int(after) == int(candidates), line
    # dq's candidates, plus the one good config of the three (Triton 3.8 also caches failures)
    assert compiled == f"compiled {int(launches[0].split()[1]) + 1}"


@pytest.mark.parametrize("arch", _COMPILE_ARCHS)
def test_heaviest_only_compiles_each_specialization_once_at_its_heaviest_config(arch):
    from fastformer.kernels import attention as kernels

    def specialization(job):
        c = kernels.Config(*job[3])
        return job[:3] + job[4:] + (c.tma, c.ws)

    def per_warp(job):
        c = kernels.Config(*job[3])
        return c.block_m * c.block_n / c.num_warps

    every, heaviest = kernels.compile_jobs(arch), kernels.compile_jobs(arch, heaviest_only=True)
    assert set(heaviest) <= set(every) and len(heaviest) < len(every)
    heaviest = [job for job in heaviest if job[0] not in kernels._HELPER_KERNELS]  # (kv_range)
    kept = {specialization(job): job for job in heaviest}
    assert len(kept) == len(heaviest)  # one config each
    # and every one of the heaviest feature classes
    wanted = [job for job in every if job[4] in kernels.HEAVIEST_CLASSES]
    assert set(kept) == {specialization(job) for job in wanted}
    for job in wanted:
        assert per_warp(job) <= per_warp(kept[specialization(job)]), job
    # whose features hold those of every class left out
    for name, variant in kernels.CHECK_VARIANTS.items():
        assert any(
            _features(variant) <= _features(kernels.CHECK_VARIANTS[c])
            for c in kernels.HEAVIEST_CLASSES
        ), name


def test_compile_jobs_twins_add_each_masked_or_dropout_class_without_padding_and_bool():
    from fastformer.kernels import attention as kernels

    every, twins = kernels.compile_jobs(90), kernels.compile_jobs(90, twins=True)
    assert set(every) < set(twins)
    added = {job[4] for job in set(twins) - set(every)}
    variants = {job[4]: kernels.CHECK_VARIANTS[job[4]] for job in every}
    for name, v in variants.items():
        nokpm = v._replace(has_kpm=False)
        bool_mask = v._replace(mask_kind=kernels.MASK_BOOL)
        wanted = [nokpm] if v.has_kpm and (v.mask_kind or v.has_dropout) else []
        if v.mask_kind == kernels.MASK_FLOAT and not v.out32:
            wanted += [bool_mask, bool_mask._replace(has_kpm=False)]
        got = [kernels.CHECK_VARIANTS[t]._replace(name="") for t in kernels.FEATURE_TWINS[name]]
        assert got == [w._replace(name="") for w in wanted], name
        assert set(kernels.FEATURE_TWINS[name]) <= added
        # each twin compiled for every config of its class
        for twin in kernels.FEATURE_TWINS[name]:
            configs = {job[:4] + job[5:] for job in every if job[4] == name}
            assert configs == {job[:4] + job[5:] for job in twins if job[4] == twin}, twin


def _features(variant) -> set[str]:
    on = {"causal": variant.is_causal, "mask": variant.mask_kind != 0, "kpm": variant.has_kpm}
    on.update(dropout=variant.has_dropout, out32=variant.out32)
    return {name for name, value in on.items() if value}


def test_check_compile_report_flags_problems():
    from fastformer.kernels import attention as kernels

    row = dict(kernel="fwd", arch=90, dtype="float16", head_dim=64, config=[128, 64, 4, 3])
    row.update(variant="all", part=0, wgmma=True, shared=1024, stack=0, local=0)
    assert kernels.check_compile_report([row]) == []
    problems = kernels.check_compile_report(
        [{**row, "stack": 8}, {**row, "local": 4}, {**row, "wgmma": False}]
        + [{**row, "arch": 80, "shared": 2**18}]
    )
    assert [p.split(": ")[1].split()[0] for p in problems] == ["spills", "spills", "no", "262144"]
    assert kernels.check_compile_report([{**row, "arch": 80, "wgmma": False}]) == []
    ws = {**row, "config": [128, 64, 4, 3, False, True, True], "warp_specialized": True}
    assert kernels.check_compile_report([ws]) == []
    (problem,) = kernels.check_compile_report([{**ws, "warp_specialized": False}])
    assert "not warp-specialized" in problem
    (problem,) = kernels.check_compile_report([{**row, "wgmma_serialized": True}])
    assert "serialized" in problem
    tolerated = {**row, "kernel": "dkdv", "variant": "dropout"}
    tolerated["config"] = [64, 64, 4, 3, True, True, False]  # (a TMA twin)
    assert kernels.check_compile_report([{**tolerated, "wgmma_serialized": True}]) == []
    (problem,) = kernels.check_compile_report(
        [{**tolerated, "variant": "all", "wgmma_serialized": True}]
    )
    assert "serialized" in problem
    # a tolerance holds for the class's twins, and only beside a config that is not serialized
    twin = {**tolerated, "variant": "dropout-nokpm", "wgmma_serialized": True}
    other = {**twin, "config": [32, 128, 8, 3, True, False, False], "wgmma_serialized": False}
    assert kernels.check_compile_report([twin, other]) == []
    problems = kernels.check_compile_report([twin, {**other, "wgmma_serialized": True}])
    assert ["C7515" in p for p in problems] == [True, False]  # (32, 128, 8, 3): not tolerated
    assert "every config serialized" in problems[1]
    (problem,) = kernels.check_compile_report([twin, {**twin, "config": [64, 64, 4, 3, True]}])
    assert "every config serialized" in problem


def test_each_tolerated_serialized_config_has_a_clean_alternative_in_its_list():
    from fastformer.kernels import attention as kernels

    for kernel, bucket, fclass, config in kernels.SERIALIZED_OK:
        listed_class = fclass.removesuffix("_nc").removesuffix("_out32")
        listed = kernels.listed_configs(kernel, 90, "16bit", bucket, listed_class)
        assert config in listed, (kernel, bucket, fclass, config)
        clean = [c for c in listed if (kernel, bucket, fclass, c) not in kernels.SERIALIZED_OK]
        assert clean, (kernel, bucket, fclass)


# --------------------------------------------------------------------------- TMA twins


def _tma_runs_here() -> bool:
    # The interpreter emulates descriptors on CPU; a GPU needs TMA (sm_90 or newer).
    return DEVICE == "cpu" or torch.cuda.get_device_capability()[0] >= 9


# (case, dropout_p): dropout changes no load (its keep-mask comes from indices), so each case
# runs with or without it rather than both (the full product took ~110 s of CI time a stack).
_TMA_CASES = {
    "d40_dropout": (Case(lq=45, lk=70, d=40, dtype=F16), 0.3),  # ragged tiles, non-pow2 D
    "causal_kpm_dropout": (Case(lq=64, lk=80, d=64, causal=True, kpm="edges", dtype=F16), 0.3),
    # GQA, (B, L, H, D) views
    "gqa_blhd": (Case(h=4, hkv=2, lq=33, lk=47, d=32, layout="blhd", dtype=F16), 0.0),
    "float_mask_dropout": (Case(lq=40, lk=70, d=16, dv=32, mask="float", dtype=F16), 0.3),
    "one_key": (Case(b=1, h=1, lq=1, lk=1, d=16, dtype=F16), 0.0),  # tiles past both sequences
}


@pytest.mark.gpu_too
@pytest.mark.skipif(not _tma_runs_here(), reason="TMA needs sm_90 or newer")
@pytest.mark.parametrize("qk_tiles", [False, True], ids=["kq_tiles", "qk_tiles"])
@pytest.mark.parametrize("c, dropout_p", _TMA_CASES.values(), ids=_TMA_CASES.keys())
def test_tma_twin_is_bit_identical_to_pointer_loads(c, dropout_p, qk_tiles):
    """A config's TMA twin reads the tiles of its loop (K and V in the forward and dQ, Q and dO
    in dK/dV) through per-slice descriptors (zero past the sequence and the head dim) where the
    other uses masked pointer loads: out, LSE and every gradient must come out the same, bit
    for bit (dK/dV on both tile orientations)."""
    from fastformer.kernels import attention as kernels

    q, k, v = (t.detach() for t in _qkv(c))
    mask, kpm = _attn_mask(c), _key_padding(c)
    mask = None if mask is None else mask.detach()
    scale = q.shape[-1] ** -0.5
    grad_out = _randn((c.b, c.h, c.lq, c.dv or c.d), c.dtype, seed=5)
    results = []
    for tma in (False, True):
        config = kernels.Config(32, 32, 4, 1, qk_tiles=qk_tiles, tma=tma)
        out, lse = kernels.attention_forward(
            q, k, v, mask, kpm, 123, dropout_p, c.causal, scale, config=config
        )
        grads = kernels.attention_backward(
            grad_out, None, q, k, v, out, lse, mask, kpm, 123, dropout_p, c.causal, scale,
            mask is not None, config=config,
        )  # fmt: skip
        results.append((out, lse, *grads[:3], *([grads[3]] if mask is not None else [])))
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv", "dmask"], *results):
        assert torch.equal(a, b), name


def test_tma_alignment_rules():
    """TMA needs 16-byte aligned slice bases and row strides and distinct rows: anything else
    keeps the pointer loads."""
    from fastformer.kernels import attention as kernels

    dense = torch.zeros(2, 3, 17, 64, dtype=F16)
    assert kernels._tma_aligned(dense)
    assert kernels._tma_aligned(torch.zeros(2, 17, 3, 64, dtype=F16).transpose(1, 2))
    assert not kernels._tma_aligned(torch.zeros(2, 3, 17, 20, dtype=F16))  # 40-byte rows
    assert not kernels._tma_aligned(
        torch.zeros(2 * 3 * 17 * 64 + 1, dtype=F16)[1:].view(2, 3, 17, 64)
    )
    assert not kernels._tma_aligned(torch.zeros(2, 3, 1, 64, dtype=F16).expand(2, 3, 17, 64))
    assert not kernels._tma_aligned(torch.zeros(2, 3, 17, 72, dtype=F16)[:, :, 1:, 4:68])


def test_tma_gate(monkeypatch):
    """TMA twins tune only when enabled, for the attention kernels, never for CPU tensors."""
    from fastformer.kernels import attention as kernels

    t = torch.zeros(1, 1, 16, 64, dtype=F16)
    monkeypatch.setattr(kernels, "TMA", False)
    assert not kernels.tma_ok("fwd", t, t)
    monkeypatch.setattr(kernels, "TMA", True)
    assert not kernels.tma_ok("fwd", t, t)  # CPU
    assert not kernels.tma_ok("kv_range", t, t)


def test_tma_twins_join_the_candidates():
    """With TMA the autotuner times each config, its twin and the TMA-only tiles, and the tuned
    choice is kept apart from the choice made without them."""
    from fastformer.kernels import attention as kernels

    plain = kernels._autotuned("fwd", 90, "16bit", 64, "base")
    both = kernels._autotuned("fwd", 90, "16bit", 64, "base", True)
    n, extra = len(plain.configs), kernels._TMA_EXTRA[("fwd", 64, "base")]
    assert [c.kwargs["USE_TMA"] for c in plain.configs] == [False] * n
    assert [c.kwargs["USE_TMA"] for c in both.configs] == [False] * n + [True] * (n + len(extra))
    strip = [{k: v for k, v in c.all_kwargs().items() if k != "USE_TMA"} for c in both.configs]
    assert strip[:n] == strip[n : 2 * n]
    assert kernels.tma_candidates("dkdv", 90, "16bit", 256, "base") == []  # they spilled
    assert kernels.tma_candidates("fwd", 80, "16bit", 64, "base") == []
    args = [None] * len(kernels.attn_fwd.arg_names)
    key = functools.partial(kernels._tuned_key, "fwd", args, {"HEAD_D": 64}, torch.zeros(1))
    assert key() != key(True)


def test_tma_scratch_allocator_never_replaces_the_users():
    import contextvars

    import triton
    from triton.runtime import _allocation

    from fastformer.kernels import attention as kernels

    def run(user):
        if user is not None:
            triton.set_allocator(user)
        kernels._ensure_allocator()
        return _allocation._allocator.get()

    def users_allocator(size, alignment, stream):
        raise AssertionError("not called")

    assert contextvars.copy_context().run(run, None) is kernels._scratch
    assert contextvars.copy_context().run(run, users_allocator) is users_allocator


# --------------------------------------------------------------------------- GPU only


@pytest.mark.cuda
@pytest.mark.parametrize(
    "c",
    [
        Case(lq=129, lk=97, d=64, causal=True, kpm="random", dtype=torch.bfloat16),
        Case(h=4, hkv=2, lq=97, lk=129, d=128, mask="float", dtype=torch.bfloat16),
        Case(lq=65, lk=65, d=256, dtype=torch.bfloat16),
    ],
    ids=["causal_kpm", "gqa_float_mask_d128", "d256"],
)
def test_cuda_bfloat16_parity(c):
    _parity(c)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [F16, torch.bfloat16])
def test_cuda_long_sequence_parity(dtype):
    _parity(Case(b=1, h=2, lq=2048, lk=2048, d=64, causal=True, kpm="edges", dtype=dtype))


@pytest.mark.cuda
def test_cuda_backward_is_deterministic():
    c = Case(
        b=2, h=4, hkv=2, lq=1024, lk=1024, d=128, causal=True, mask="float", kpm="random", dtype=F16
    )

    def grads():
        q, k, v = _qkv(c)
        m = _attn_mask(c)
        torch.manual_seed(1)
        out = attn.scaled_dot_product_attention(
            q, k, v, m, 0.1, True, enable_gqa=True, key_padding_mask=_key_padding(c)
        )
        out.backward(_randn(out.shape, F16, seed=4))
        return q.grad, k.grad, v.grad, m.grad

    for a, b in zip(grads(), grads()):
        assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE == "cuda" and not _tma_runs_here(), reason="TMA needs sm_90+")
def test_cuda_tma_twins_tune_and_keep_parity(monkeypatch):
    """FASTFORMER_ATTN_TMA=1: the forward, dQ and dK/dV autotuners take the TMA twins too
    (their tuned keys say so), and the result keeps the parity rule."""
    from fastformer.kernels import attention as kernels

    monkeypatch.setattr(kernels, "TMA", True)
    _parity(Case(b=2, h=4, lq=777, lk=777, d=64, causal=True, kpm="edges", dtype=torch.bfloat16))
    with_twins = {key[0] for key in kernels._TUNED if key[-1] is True}
    assert with_twins == {"fwd", "dq", "dkdv"}


# --------------------------------------------------------------------------- warp specialization

# Calls without masks, padding or dropout: the only ones the warp-specialized loop runs.
# Ragged tiles of queries and keys, a non-power-of-two head dim, GQA on (B, L, H, D) views,
# tiles past both sequences, causal with Lq < Lk and Lq > Lk.
_WS_CASES = {
    "ragged_d40": Case(lq=45, lk=70, d=40, dtype=F16),
    "gqa_blhd": Case(h=4, hkv=2, lq=33, lk=47, d=32, layout="blhd", dtype=F16),
    "dv_wider": Case(lq=64, lk=96, d=16, dv=32, dtype=F16),
    "one_key": Case(b=1, h=1, lq=1, lk=1, d=16, dtype=F16),
    "causal_wide": Case(lq=45, lk=100, d=40, causal=True, dtype=F16),
    "causal_tall": Case(h=4, hkv=1, lq=97, lk=33, d=32, causal=True, dtype=F16),
}


@pytest.mark.gpu_too
@pytest.mark.skipif(not _tma_runs_here(), reason="TMA needs sm_90 or newer")
@pytest.mark.parametrize("c", _WS_CASES.values(), ids=_WS_CASES.keys())
def test_warp_specialized_forward_matches_its_tma_twin(c):
    """A ws config loads Q through TMA too and runs one key loop, its every tile under the
    key-bound and causal masks, where its TMA twin runs the full tiles unmasked and the edge
    tiles in a loop of their own: the same scores reach the same online softmax in the same
    order, so out and LSE are the same bits in the interpreter. On a GPU the compiler's split
    of the loop (a 64-row tile is the smallest it specializes) may order an MMA's sums
    otherwise: there a rounding apart, a miscompile is far more."""
    from fastformer.kernels import attention as kernels

    q, k, v = (t.detach() for t in _qkv(c))
    results = [
        kernels.attention_forward(
            q, k, v, None, None, 0, 0.0, c.causal, q.shape[-1] ** -0.5,
            config=kernels.Config(64, 32, 4, 2, tma=True, ws=ws),
        )
        for ws in (False, True)
    ]  # fmt: skip
    for name, a, b in zip(["out", "lse"], *results):
        if DEVICE == "cuda":
            torch.testing.assert_close(b, a, rtol=2**-9, atol=1e-4, msg=name)
        else:
            assert torch.equal(a, b), name


@pytest.mark.parametrize(
    "features",
    [{"kpm": "edges"}, {"mask": "bool"}, {"dropout": True}, {"tma": False}],
    ids=["padding", "mask", "dropout", "no_tma"],
)
def test_ws_config_refused_outside_unmasked_tma_forwards(features):
    # The warp-specialized loop loads no mask, padding or keep-mask, and Q only through TMA: a
    # fixed config asking it for more is an error before any launch, not a static_assert in
    # the compiler.
    from fastformer.kernels import attention as kernels

    c = Case(lq=40, lk=40, d=16, causal=True, dtype=F16)
    c = replace(c, kpm=features.get("kpm", ""), mask=features.get("mask", ""))
    q, k, v = (t.detach() for t in _qkv(c))
    mask, kpm = _attn_mask(c), _key_padding(c)
    config = kernels.Config(32, 32, 4, 1, tma=features.get("tma", True), ws=True)
    p = 0.3 if features.get("dropout") else 0.0
    with pytest.raises(ValueError, match="warp specialization is for TMA forwards"):
        kernels.attention_forward(q, k, v, mask, kpm, 1, p, c.causal, 0.25, config=config)


def test_ws_tiles_join_only_unmasked_forwards_and_only_when_enabled(monkeypatch):
    """The ws tiles tune for forwards without masks, padding or dropout (the base lists:
    causal or not), at head dims 64 and 128 on sm_90, and only with FASTFORMER_ATTN_WS=1 (not
    timed on a GPU yet); the compile check builds them either way."""
    from fastformer.kernels import attention as kernels

    tiles = kernels._WS_TILES[128]
    assert kernels.ws_candidates("fwd", 128, "base") == tiles
    for args in [("fwd", 128, "padded"), ("fwd", 128, "dropout"), ("dq", 128, "base")]:
        assert kernels.ws_candidates(*args) == [], args
    assert kernels.ws_candidates("fwd", 256, "base") == []
    assert kernels.tma_candidates("fwd", 90, "16bit", 128, "base")[-len(tiles) :] == tiles
    assert not any(c.ws for c in kernels.tma_candidates("fwd", 90, "16bit", 128, "base", False))
    for causal in (False, True):
        assert (
            kernels.config_class("fwd", 90, "16bit", 128, _unmasked_meta(IS_CAUSAL=causal))
            == "base"
        )
    jobs = [kernels.Config(*job[3]) for job in kernels.compile_jobs(90)]
    assert all(tile in jobs for tile in kernels._WS_TILES[64] + tiles)
    for enabled in (False, True):
        monkeypatch.setattr(kernels, "WS", enabled)
        kernels._autotuned.cache_clear()
        tuner = kernels._autotuned("fwd", 90, "16bit", 128, "base", True)
        assert sum(c.kwargs["WARP_SPEC"] for c in tuner.configs) == (len(tiles) if enabled else 0)
    kernels._autotuned.cache_clear()


def _unmasked_meta(**changes) -> dict:
    meta = dict(IS_CAUSAL=False, MASK_KIND=0, HAS_KPM=False, HAS_DROPOUT=False)
    return {**meta, **changes}


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE == "cuda" and not _tma_runs_here(), reason="TMA needs sm_90+")
def test_cuda_ws_tiles_tune_and_keep_parity(monkeypatch):
    """FASTFORMER_ATTN_WS=1: the forwards without masks at head dims 64 and 128 tune the
    warp-specialized tiles too (each runs while the tuner times it), and keep the parity rule
    whichever wins; and each ws tile, fixed, keeps it."""
    from fastformer.kernels import attention as kernels

    monkeypatch.setattr(kernels, "WS", True)
    kernels._autotuned.cache_clear()
    try:
        for d, causal in itertools.product((64, 128), (False, True)):
            c = Case(b=2, h=4, lq=1000, lk=1000, d=d, causal=causal, dtype=torch.bfloat16)
            _parity(c)
            q, k, v = (t.detach() for t in _qkv(c))
            run = functools.partial(
                kernels.attention_forward, q, k, v, None, None, 0, 0.0, causal, d**-0.5
            )
            want, want_lse = run(config=kernels.Config(128, 64, 8, 3, tma=True))
            for tile in kernels._WS_TILES[d]:  # a rounding apart from a tile without ws
                out, lse = run(config=tile)
                torch.testing.assert_close(out, want, rtol=2**-7, atol=1e-3, msg=str(tile))
                torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-4, msg=str(tile))
    finally:
        kernels._autotuned.cache_clear()


_INT32_SEED_SCRIPT = """
import torch, triton
from triton.backends.compiler import GPUTarget
from fastformer.kernels import attention as A
for kernel in ("fwd", "dq", "dkdv"):
    cfg = A.CONFIGS[(kernel, 90, "16bit", 64, "dropout")][0]
    sig, ce, attrs = A._compile_inputs(
        kernel, torch.float16, 64, cfg, A.CHECK_VARIANTS["dropout"], 0
    )
    sig["seed"] = "i32"  # a seed in int32's range (capture's -1 before 2026-12-02)
    src = triton.compiler.ASTSource(A.KERNELS[kernel], sig, ce, attrs)
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    print(kernel)
"""


def test_dropout_kernels_compile_with_an_int32_seed_argument(tmp_path):
    """A seed argument in int32's range (inside CUDA graph capture, until 2026-12-02, the -1
    that sends the kernels to the seed in device memory, int64): Triton 3.6 refused that
    branch on an H200 until both were int64."""
    assert _run_sm90(_INT32_SEED_SCRIPT, tmp_path).split() == ["fwd", "dq", "dkdv"]


_PTXAS_LOG_SCRIPT = """
from fastformer.kernels import attention as A
printed_logs = []
compile_logged = A._compile_logged
def spy(*args):
    compiled, printed = compile_logged(*args)
    printed_logs.append("Used" in printed and "registers" in printed)
    return compiled, printed
A._compile_logged = spy
d64 = [j for j in A.compile_jobs(90) if j[:3] == ("dkdv", "float16", 64)]
# (a tile that ptxas serializes under Triton 3.6, where the table has it)
tolerated = [j for j in d64 if ("dkdv", 64, j[4], A.Config(*j[3])) in A.SERIALIZED_OK]
job = (tolerated or d64)[0]
cold, warm = A._compile_job(job), A._compile_job(job)
print(*printed_logs, cold == warm, cold["wgmma"])
"""


def test_compile_check_reads_ptxas_log_of_the_compile_else_runs_ptxas_again(tmp_path):
    """The compile check reads ptxas's notes (C7515, serialized wgmma) from the log Triton's own
    compile printed; on a cache hit, where it prints nothing, from a second ptxas run: both give
    the same row."""
    assert _run_sm90(_PTXAS_LOG_SCRIPT, tmp_path).split() == ["True", "False", "True", "True"]


def test_device_seed_argument_has_the_type_of_host_seeds():
    # Triton types a do_not_specialize int by its range: capture's -1 was int32 where host
    # seeds are int64, so the first captured call compiled and loaded its own kernels inside
    # the capture.
    from triton.runtime.jit import mangle_type

    from fastformer.kernels import attention as kernels

    _, arg = kernels._seed_args(torch.zeros((), dtype=torch.int64), torch.device("cpu"))
    host = {mangle_type(rng.draw_seed()) for _ in range(8)}  # each < 2**31 with p = 2**-32
    assert arg < 0 and host == {mangle_type(arg)} == {"i64"}


def test_causal_row_whose_only_key_is_right_of_the_diagonal_is_empty():
    # A row that the mask leaves one key, which causality hides: no key at all, so lse -inf
    # and output 0 (a causal offset off by one in the empty-row test left lse 0 there).
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[0] = torch.tensor([False, True, False, False])
    out, lse = attn.scaled_dot_product_attention_with_lse(q, k, v, mask, is_causal=True)
    assert lse[0, 0, 0] == float("-inf") and torch.all(out[0, 0, 0] == 0)


@pytest.mark.parametrize(("lq", "lk"), [(6, 9), (9, 6)])
def test_causal_rows_before_the_first_unpadded_key_are_empty(monkeypatch, lq, lk):
    # Causal with leading padding keys: a row sees a key iff the first visible key is at most
    # its index, Lq > Lk included (rows past the last key still see some). float32 on the
    # torch backend runs torch's CPU flash kernels, which get those rows zeroed (`_without_rows`).
    _use_backend(monkeypatch, "torch")
    q = _randn((2, 2, lq, 8), grad=True)
    k, v = (_randn((2, 2, lk, 8), seed=i, grad=True) for i in (1, 2))
    kpm = torch.zeros(2, lk, dtype=torch.bool, device=DEVICE)
    kpm[1, :3] = True  # batch 1: rows 0-2 see no key
    kpm[0, 1] = True  # batch 0: key 0 is visible to every row
    kw = dict(is_causal=True, key_padding_mask=kpm)
    out, lse = attn.scaled_dot_product_attention_with_lse(q, k, v, **kw)
    empty = torch.isneginf(lse)
    assert empty[1, :, :3].all() and not empty[1, :, 3:].any() and not empty[0].any()
    assert torch.all(out[1, :, :3] == 0)
    _assert_qkv_parity(q, k, v, **kw)


# --------------------------------------------------------------------------- CPU entry

needs_cpu_entry = pytest.mark.skipif(
    DEVICE != "cpu" or attn._EAGER is None, reason="fastformer._C's attention_cpu_eager (CPU)"
)


def _entry_call(dtype=F32, b=2, h=4, hkv=2, lq=9, lk=11, d=16, mask=None, kpm=None, **kw):
    """Arguments of a plain call with GQA: (q, k, v), and the keywords."""
    q = _randn((b, h, lq, d), dtype=dtype)
    k, v = (_randn((b, hkv, lk, d), dtype=dtype, seed=i) for i in (1, 2))
    return (q, k, v), dict(attn_mask=mask, key_padding_mask=kpm, enable_gqa=h != hkv, **kw)


def _entry_cases():
    g = torch.Generator().manual_seed(0)
    kpm = torch.rand(2, 11, generator=g) < 0.4
    kpm[1, :4] = True  # with causal: rows 0-3 of batch 1 see no key
    kpm[0] = True  # batch 0: no key at all
    bool_qk = torch.rand(9, 11, generator=g) < 0.7
    bool_qk[3] = False  # row 3: no key
    nan_q = _entry_call()
    nan_q[0][0][0, 1, 2, 5] = float("nan")  # a NaN in a query row with keys: NaN out
    nan_q_no_key = _entry_call(kpm=kpm)
    nan_q_no_key[0][0][0, 1, 2, 5] = float("nan")  # batch 0 has no key: 0 out all the same
    strided = _entry_call()
    strided = ((strided[0][0].transpose(-1, -2).contiguous().transpose(-1, -2), *strided[0][1:]),
               strided[1])  # fmt: skip
    cases = {
        "plain": _entry_call(),
        "causal": _entry_call(is_causal=True),
        "kpm_causal": _entry_call(kpm=kpm, is_causal=True),
        "bool_qk_kpm": _entry_call(mask=bool_qk, kpm=kpm),
        "bool_b1qk_causal": _entry_call(mask=torch.rand(2, 1, 9, 11, generator=g) < 0.5,
                                        is_causal=True),
        "float_h": _entry_call(mask=torch.randn(1, 4, 1, 11, generator=g), kpm=kpm),
        "float_inf_rows": _entry_call(mask=torch.where(bool_qk, torch.randn(9, 11), -math.inf)),
        "float32_mask_bf16": _entry_call(BF16, mask=torch.randn(9, 11, generator=g)),
        "fp16_kpm": _entry_call(F16, kpm=kpm, scale=0.3),
        "bf16_causal_lq_gt_lk": _entry_call(BF16, lq=13, lk=6, is_causal=True),
        "mha_scalar_mask": _entry_call(hkv=4, mask=torch.tensor(0.5)),
        "nan_query": nan_q,
        # every score 33 - log(11): lse 33, past what torch's flash backward recomputes P from
        "float32_lse_33": (
            (torch.ones(2, 4, 9, 16), torch.full((2, 2, 11, 16), (33 - math.log(11)) / 16),
             _randn((2, 2, 11, 16), seed=2)),
            dict(attn_mask=None, key_padding_mask=kpm, enable_gqa=True, scale=1.0),
        ),
        "nan_query_without_keys": nan_q_no_key,
        "q_last_dim_strided": strided,
    }  # fmt: skip
    return cases


def _entry_and_checked(monkeypatch, run) -> tuple:
    """run() through the entry (which must not call the checked path) and through the checked
    Python path."""
    entry = attn._EAGER
    monkeypatch.setattr(attn, "_EAGER", None)
    checked = run()
    monkeypatch.setattr(attn, "_EAGER", entry)
    calls = _python_path_calls(monkeypatch)
    got = run()
    assert not calls, "the checked path ran"
    return got, checked


@needs_cpu_entry
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("name", list(_entry_cases()))
def test_cpu_entry_gives_the_checked_paths_bits(monkeypatch, name, grad):
    # The entry runs the ATen ops of _cpu_flash_forward, and its node those of
    # _cpu_flash_backward (or _reference_backward past lse 32): the same output and gradients,
    # NaN included, as the checked Python path.
    _use_backend(monkeypatch, "torch")
    (q, k, v), kw = _entry_cases()[name]

    def run():
        leaves = [t.detach().clone().requires_grad_(grad) for t in (q, k, v)]
        out = attn.scaled_dot_product_attention(*leaves, **kw)
        if grad:
            out.backward(_randn(out.shape, dtype=out.dtype, seed=9))
        return [out, *(t.grad for t in leaves)] if grad else [out]

    got, checked = _entry_and_checked(monkeypatch, run)
    for a, b in zip(got, checked):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) and torch.equal(
            a.isnan(), b.isnan()
        )
    out = got[0]
    if name in ("kpm_causal", "bool_qk_kpm", "float_inf_rows"):
        assert (out == 0).all(-1).any(), "the case has rows without a key"
    if name == "nan_query":
        assert out[0, 1, 2].isnan().all() and not out[0, 1, 3].isnan().any()
    if name == "nan_query_without_keys":
        assert not out.isnan().any() and (out[0] == 0).all()


@needs_cpu_entry
@pytest.mark.parametrize("name", ["kpm_causal", "float_h", "bf16_causal_lq_gt_lk"])
def test_cpu_entry_backward_is_differentiable(monkeypatch, name):
    # create_graph=True: the node's gradients come from the reference's operations, which a
    # second backward differentiates (a gradient penalty), as on the checked path.
    _use_backend(monkeypatch, "torch")
    (q, k, v), kw = _entry_cases()[name]

    def run():
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = attn.scaled_dot_product_attention(*leaves, **kw)
        grads = torch.autograd.grad(out.float().square().sum(), leaves, create_graph=True)
        return torch.autograd.grad(sum(g.float().square().sum() for g in grads), leaves)

    got, checked = _entry_and_checked(monkeypatch, run)
    for a, b in zip(got, checked):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=1e-2 if q.dtype != F32 else 1e-4, atol=1e-4)


@needs_cpu_entry
def test_cpu_entry_backward_of_batched_cotangents(monkeypatch):
    # is_grads_batched: a vmap over the node's backward (torch's flash backward a sample at a
    # time), against the checked path's (the reference's; GQA's head sum failed there under the
    # legacy vmap before it used reshape).
    _use_backend(monkeypatch, "torch")
    (q, k, v), kw = _entry_cases()["kpm_causal"]
    cotangents = _randn((3, 2, 4, 9, 16), seed=5)

    def run():
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = attn.scaled_dot_product_attention(*leaves, **kw)
        return torch.autograd.grad(out, leaves, cotangents, is_grads_batched=True)

    got, checked = _entry_and_checked(monkeypatch, run)
    for a, b in zip(got, checked):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _python_path_calls(monkeypatch) -> list:
    calls, checked = [], attn.scaled_dot_product_attention_with_lse

    def counted(*args, **kwargs):
        calls.append(1)
        return checked(*args, **kwargs)

    monkeypatch.setattr(attn, "scaled_dot_product_attention_with_lse", counted)
    return calls


@needs_cpu_entry
@pytest.mark.parametrize(
    "change",
    ["mask_grad", "dropout", "dropout_int_0", "float64", "causal_bias", "scale_int",
     "scale_subnormal", "gqa_numpy", "mask_float16_of_bf16", "autocast", "triton_forced",
     "interpreted", "subclass"],
)  # fmt: skip
def test_cpu_entry_declines_what_the_checked_path_must_see(monkeypatch, change):
    # Each call runs (or raises) on the checked Python path; the plain call does not.
    _use_backend(monkeypatch, "torch")
    (q, k, v), kw = _entry_call()
    calls = _python_path_calls(monkeypatch)
    attn.scaled_dot_product_attention(q, k, v, **kw)
    attn.scaled_dot_product_attention(q.requires_grad_(True), k, v, **kw)  # its node
    with torch.no_grad():
        attn.scaled_dot_product_attention(q, k, v, **kw)
    q.requires_grad_(False)
    assert not calls
    context, raises = contextlib.nullcontext(), contextlib.nullcontext()
    if change == "mask_grad":
        kw["attn_mask"] = _randn((9, 11), grad=True)
    elif change == "dropout":
        kw["dropout_p"] = 0.1
    elif change == "dropout_int_0":
        kw["dropout_p"] = 0
    elif change == "float64":
        q, k, v = (t.double() for t in (q, k, v))
    elif change == "causal_bias":
        kw["attn_mask"] = causal_upper_left(9, 11)
    elif change == "scale_int":
        kw["scale"] = 1
    elif change == "scale_subnormal":  # the reference computes it: torch's kernel gives NaN
        kw["scale"] = 2.0**-127
    elif change == "gqa_numpy":  # refused by the checked path
        kw["enable_gqa"], raises = np.bool_(True), pytest.raises(TypeError, match="enable_gqa")
    elif change == "mask_float16_of_bf16":
        q, k, v = (t.bfloat16() for t in (q, k, v))
        kw["attn_mask"] = torch.zeros(9, 11, dtype=F16)
        raises = pytest.raises(TypeError, match="attn_mask must be bool or float")
    elif change == "autocast":
        context = torch.autocast("cpu", dtype=torch.bfloat16)
    elif change == "triton_forced":  # the checked path then raises: bf16 is not the point
        monkeypatch.setenv("FASTFORMER_BACKEND_ATTENTION", "triton")
    elif change == "interpreted":  # the interpreter takes CPU calls unless torch is forced
        monkeypatch.delenv("FASTFORMER_BACKEND_ATTENTION")
        monkeypatch.setattr(attn, "_INTERPRETED", True)
    elif change == "subclass":
        q = q.as_subclass(_Tagged)
    with context, raises:
        attn.scaled_dot_product_attention(q, k, v, **kw)
    assert len(calls) == 1


class _Tagged(torch.Tensor):
    pass


@needs_cpu_entry
@pytest.mark.parametrize(
    "args",
    [
        ("q", "k", "v", None, 0.0, False, None, False, None),
        (_z(2, 4, 5, 8), _z(2, 4, 6, 8), _z(2, 4, 6, 4), None, 0.0, False, None, False, None),
        (_z(2, 4, 5, 8), _z(2, 3, 6, 8), _z(2, 3, 6, 8), None, 0.0, False, None, True, None),
        (_z(2, 4, 5, 8), _z(2, 4, 6, 8), _z(2, 4, 6, 8), _z(3, 5, 6), 0.0, False, None, False, None),
        (_z(2, 4, 5, 8), _z(2, 4, 6, 8), _z(2, 4, 6, 8), None, 0.0, False, None, False,
         _z(2, 5, dtype=torch.bool)),
        (_z(2, 4, 5, 8), _z(2, 4, 6, 8), _z(2, 4, 6, 8), None, 0.0, 1, None, False, None),
        (_z(2, 4, 0, 8), _z(2, 4, 6, 8), _z(2, 4, 6, 8), None, 0.0, False, None, False, None),
        (_z(2, 4, 5, 300), _z(2, 4, 6, 300), _z(2, 4, 6, 300), None, 0.0, False, None, False, None),
        (_z(2, 4, 5, 8), _z(2, 4, 6, 8), _z(2, 4, 6, 8), None, 0.0, False, float("inf"), False, None),
    ],
    ids=["strings", "dv_differs", "gqa_3_of_4", "mask_batch_3", "kpm_shape", "causal_int",
         "empty_query", "head_dim_300", "scale_inf"],
)  # fmt: skip
def test_cpu_entry_returns_none_for_what_it_does_not_take(monkeypatch, args):
    # Never an error: the checked path raises its own (or computes what the entry does not).
    _use_backend(monkeypatch, "torch")
    assert attn._EAGER(*args) is None


@pytest.mark.parametrize(
    ("mask_shape", "match"),
    [((4, 5), "seq_q dim has size 4"), ((3, 2, 5, 5), "batch dim has size 3")],
)
def test_mask_of_a_wrong_leading_dim_is_refused(mask_shape, match):
    q = _randn((2, 2, 5, 8))
    with pytest.raises(ValueError, match=match):
        attn.scaled_dot_product_attention(q, q, q, torch.zeros(mask_shape))


def test_strided_key_padding_mask():
    # Every padding mask of the other tests is contiguous: its stride reached the kernels.
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 16, generator=g) for _ in range(3))
    wide = torch.rand(2, 16, generator=g) < 0.4
    wide[:, 0] = False  # key 0 kept: no empty rows
    kpm = wide[:, ::2]  # strides (16, 2)
    got = attn.scaled_dot_product_attention(q, k, v, key_padding_mask=kpm)
    want = ref.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), key_padding_mask=kpm.contiguous()
    )
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
