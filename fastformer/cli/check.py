"""`python -m fastformer check`: the parity grid of every op against the eager reference.

Every op x backend x device x dtype x mask kind x dropout on/off x awkward shape is run through
`fastformer.testing.compare_with_reference` (the parity rule stated there: outputs and every
gradient). Dropout cases predict the seed the op will draw (`torch.manual_seed` then
`draw_seed`), regenerate its keep-mask with `fastformer.ops.rng` and feed it to the reference;
keep-mask cases hold each op's mask helper to an independent spelling of the Philox scheme. One
row per case; exit status 1 when any case fails or errors (a C++ extension that does not load is
an ERROR row).

Test-only hook: FASTFORMER_CHECK_BREAK=<op>[,<op>...] perturbs the fast output of those ops, so
a test can prove that `check` catches a broken kernel.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from fastformer.cli.errors import UsageError, check_settings
from fastformer.cli.report import finite

BREAK_ENV = "FASTFORMER_CHECK_BREAK"
SEED = 20240607
DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Ops of the grid: (op module, registry key for FASTFORMER_BACKEND_<OP>). An op that has no
# registry entry of its own is dispatched under its module's (see registry_key).
CHECK_OPS = {
    "attention": ("attention", "attention"),
    "layer_norm": ("layer_norm", "layer_norm"),
    "rms_norm": ("layer_norm", "rms_norm"),
    "dropout_add_layer_norm": ("layer_norm", "dropout_add_layer_norm"),
    "ffn": ("ffn", "ffn"),
}
OP_GROUPS = {"attention": ["attention"], "ffn": ["ffn"]}
OP_GROUPS["layer_norm"] = ["layer_norm", "rms_norm", "dropout_add_layer_norm"]


@dataclass(frozen=True)
class Case:
    """One parity case: `build(module, device, dtype)` -> (fast_fn, ref_fn, inputs, names).
    `quick_16bit`: a --quick grid on CPU (float32 only) runs this case in float16 too."""

    op: str
    name: str
    build: Callable[..., tuple[Callable, Callable, list, list[str]]]
    dropout: bool = False
    quick_16bit: bool = False


@dataclass(frozen=True)
class KeepMaskCase:
    """The op's keep-mask helper against an independent statement of the Philox scheme:
    `masks(module, device)` -> (the helper's mask, the scheme's, on CPU). The dropout cases
    feed the reference the op's own helper, so a helper wrong the same way as the op (one
    mask reused for every batch row and head) passed them. Runs once per device."""

    op: str
    name: str
    masks: Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Row:
    """The verdict of one case on one backend, device and dtype."""

    op: str
    backend: str
    device: str
    dtype: str
    case: str
    status: str  # pass | FAIL | ERROR | skip | not run (past --max-seconds)
    worst: str = ""
    error: float | None = None
    bound: float | None = None
    message: str = ""
    results: list[dict[str, Any]] = field(default_factory=list)


# --------------------------------------------------------------------------- inputs


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _randn(shape, device, dtype, gen, grad=True, scale=1.0) -> torch.Tensor:
    t = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(device, dtype)
    return t.requires_grad_(grad)


def _offsets_keep(seed: int, shape: tuple[int, ...], p: float, device) -> torch.Tensor:
    """Keep-mask of dropout on a contiguous tensor: element i (row-major) uses offset i."""
    from fastformer.ops.rng import dropout_keep

    numel = 1
    for s in shape:
        numel *= s
    offsets = torch.arange(numel, dtype=torch.int64, device=device).view(shape)
    return dropout_keep(seed, offsets, p)


def _predicted_seed(device) -> int:
    """The seed the next op call on `device` draws after torch.manual_seed(SEED)."""
    from fastformer.ops.rng import draw_seed

    torch.manual_seed(SEED)
    return draw_seed(device)


def _seeded(fn: Callable) -> Callable:
    """`fn` run right after torch.manual_seed(SEED), so it draws the predicted seed."""

    def run(*args):
        torch.manual_seed(SEED)
        return fn(*args)

    return run


# --------------------------------------------------------------------------- keep-masks


KEEP_MASK_SEEDS = (1234, 2**62 + 987654321)  # the second fills both 32-bit key words
KEEP_MASK_PS = (0.4, 0.1)
KEEP_MASK_SHAPES = {
    "attention": [(2, 3, 5, 45), (3, 2, 9, 70)],  # (batch, heads, seq_q, seq_k)
    "ffn": [(6, 45), (13, 70)],  # (tokens, d_ff)
    "dropout_add_layer_norm": [(2, 3, 45), (5, 70)],
}
KEEP_MASK_HELPERS = {
    "attention": lambda m, seed, shape, p, dev: m.dropout_keep_mask(seed, *shape, p, device=dev),
    "ffn": lambda m, seed, shape, p, dev: m.ffn_keep_mask(seed, *shape, p, device=dev),
    "dropout_add_layer_norm": lambda m, seed, shape, p, dev: m.dropout_add_layer_norm_keep_mask(
        seed, shape, p, device=dev
    ),
}


def _element_scheme(seed: int, shape: tuple[int, ...], p: float) -> torch.Tensor:
    """The keep-mask of the C++/CUDA ops as fastformer.ops.rng states it, spelled out here:
    element i (row-major) takes word i % 4 of philox4x32(seed, i // 4) as a uniform in [0, 1)
    (Triton's uint_to_uniform_float) and is kept when that is >= p in float32."""
    from fastformer.ops import rng

    numel = math.prod(shape)
    i = torch.arange(numel, dtype=torch.int64)
    lane = torch.stack(rng.philox4x32(seed, i // 4), -1)[torch.arange(numel), i % 4]
    signed = torch.where(lane >= 2**31, lane - 2**32, lane)
    folded = torch.where(signed < 0, -signed - 1, signed)
    uniform = folded.to(torch.float32) * torch.tensor(4.6566127342e-10, dtype=torch.float32)
    return (uniform >= torch.tensor(p, dtype=torch.float32)).view(shape)


def _attention_scheme(seed: int, shape: tuple[int, ...], p: float) -> torch.Tensor:
    """attention's keep-mask as its module docstring states it: key column j = 32 g + 8 w +
    2 c + l of (b, h, i) takes half l of word w of philox4x32(seed, ((b * H + h) << 32) +
    i * C + 4 g + c), C = 4 * ceil(Lk / 32), and is kept when >= round(p * 65536)."""
    from fastformer.ops import rng

    _, heads, _, seq_k = shape
    bb, hh, ii, jj = torch.meshgrid(*(torch.arange(n) for n in shape), indexing="ij")
    calls = 4 * -(-seq_k // 32)
    g, w, c, half = jj // 32, jj // 8 % 4, jj // 2 % 4, jj % 2
    counter = ((bb * heads + hh) << 32) + ii * calls + 4 * g + c
    word = torch.stack(rng.philox4x32(seed, counter), -1).gather(-1, w[..., None])[..., 0]
    return ((word >> (16 * half)) & 0xFFFF) >= round(p * 65536)


def _keep_mask_cases(op: str) -> list[KeepMaskCase]:
    """The op's keep-mask helper against the scheme for a few seeds and shapes (batch and
    heads > 1: a mask reused across them fails)."""
    scheme = _attention_scheme if op == "attention" else _element_scheme

    def case(seed: int, shape: tuple[int, ...], p: float) -> KeepMaskCase:
        def masks(module, device):
            return KEEP_MASK_HELPERS[op](module, seed, shape, p, device), scheme(seed, shape, p)

        return KeepMaskCase(op, f"dropout-mask-{'x'.join(map(str, shape))}-p{p:g}", masks)

    return [case(*a) for a in zip(KEEP_MASK_SEEDS, KEEP_MASK_SHAPES[op], KEEP_MASK_PS)]


def _with_16bit(cases: list[Case], op: str, name: str) -> list[Case]:
    """`cases` with `op`'s case `name` marked to run in float16 in --quick on CPU too."""
    return [replace(c, quick_16bit=True) if (c.op, c.name) == (op, name) else c for c in cases]


# --------------------------------------------------------------------------- attention


ATTN_SHAPES_QUICK = [(2, 2, 7, 7, 16), (1, 2, 97, 129, 40)]
ATTN_SHAPES_FULL = [
    (1, 1, 1, 1, 16),
    (2, 2, 7, 7, 32),
    (2, 3, 97, 97, 64),
    (1, 2, 129, 129, 128),
    (2, 2, 97, 129, 40),
    (1, 2, 33, 17, 80),
]
ATTN_MASKS_QUICK = ["none", "causal", "key_padding"]
ATTN_MASKS_FULL = ["none", "causal", "key_padding", "causal+key_padding", "bool", "float"]


def _attention_masks(kind: str, b: int, lq: int, lk: int, device, dtype, gen):
    """(attn_mask, is_causal, key_padding_mask) of a mask kind ("causal+key_padding+bool": any
    of causal, key_padding and one of bool or float). With several batch rows, key padding pads
    the last one entirely (fully masked rows must give 0, never NaN)."""
    kpm = attn_mask = None
    if "key_padding" in kind:
        lengths = torch.randint(1, lk + 1, (b,), generator=gen)
        if b > 1:
            lengths[-1] = 0
        kpm = (torch.arange(lk)[None, :] >= lengths[:, None]).to(device)
    if "bool" in kind:
        attn_mask = (torch.rand(b, 1, lq, lk, generator=gen) > 0.3).to(device)
        attn_mask[..., 0, :] = False  # one fully masked query row
    elif "float" in kind:
        attn_mask = torch.randn(1, 1, lq, lk, generator=gen, dtype=torch.float64).to(device, dtype)
    return attn_mask, "causal" in kind, kpm


@dataclass(frozen=True)
class AttnSpec:
    """One attention case: shape (b, h, lq, lk, d), mask kind (`_attention_masks`), dropout p,
    a strided (non-contiguous) layout, fewer key/value heads (GQA), a value head dim, an
    explicit scale, the float mask among the differentiable inputs, and the lse output of
    scaled_dot_product_attention_with_lse."""

    shape: tuple[int, int, int, int, int]
    mask: str = "none"
    p: float = 0.0
    strided: bool = False
    kv_heads: int = 0  # 0: as many as query heads
    dv: int = 0  # 0: the query head dim
    scale: float | None = None
    mask_grad: bool = False
    lse: bool = False

    @property
    def name(self) -> str:
        b, h, lq, lk, d = self.shape
        name = f"b{b}h{h}" + (f"kv{self.kv_heads}" if self.kv_heads else "")
        name += f"q{lq}k{lk}d{d}" + (f"v{self.dv}" if self.dv else "") + f"-{self.mask}"
        name += "-grad" if self.mask_grad else ""
        name += (f"-drop{self.p:g}" if self.p else "") + ("-strided" if self.strided else "")
        name += f"-scale{self.scale:g}" if self.scale is not None else ""
        return name + ("-lse" if self.lse else "")


def _qkv(spec: AttnSpec, device, dtype, gen) -> list[torch.Tensor]:
    """q (b, h, lq, d), k (b, hkv, lk, d), v (b, hkv, lk, dv); strided: (B, L, H, D) storage
    seen as (B, H, L, D), a non-contiguous view."""
    b, h, lq, lk, d = spec.shape
    hkv, dv = spec.kv_heads or h, spec.dv or d
    shapes = [(b, h, lq, d), (b, hkv, lk, d), (b, hkv, lk, dv)]
    if not spec.strided:
        return [_randn(s, device, dtype, gen) for s in shapes]
    return [_randn((s[0], s[2], s[1], s[3]), device, dtype, gen).transpose(1, 2) for s in shapes]


def _attention_case(spec: AttnSpec) -> Case:
    b, h, lq, lk, _ = spec.shape
    gqa = spec.kv_heads not in (0, h)

    def build(module, device, dtype):
        gen = _gen()
        q, k, v = _qkv(spec, device, dtype, gen)
        attn_mask, causal, kpm = _attention_masks(spec.mask, b, lq, lk, device, dtype, gen)
        extra = [attn_mask.requires_grad_()] if spec.mask_grad else []
        keep = None
        if spec.p:
            seed = _predicted_seed(device)
            keep = _keep_rate_checked(
                module.dropout_keep_mask(seed, b, h, lq, lk, spec.p, device=device), spec.p
            )
        fast_op = (
            module.scaled_dot_product_attention_with_lse
            if spec.lse
            else module.scaled_dot_product_attention
        )

        def fast(q, k, v, *m):
            mask = m[0] if m else attn_mask
            return fast_op(q, k, v, mask, spec.p, causal, spec.scale, gqa, key_padding_mask=kpm)

        def ref(q, k, v, *m):
            from fastformer import reference as R

            mask = m[0] if m else attn_mask
            if mask is not None and mask.is_floating_point():
                mask = mask.to(q.dtype)
            kw = {"key_padding_mask": kpm, "dropout_mask": keep, "return_lse": spec.lse}
            return R.scaled_dot_product_attention(
                q, k, v, mask, spec.p, causal, spec.scale, gqa, **kw
            )

        names = ["q", "k", "v"] + (["attn_mask"] if extra else [])
        return _seeded(fast), ref, [q, k, v, *extra], names

    return Case("attention", spec.name, build, dropout=bool(spec.p))


# The full grid's cases of features that the shape x mask grid leaves out.
ATTN_FEATURES = [
    AttnSpec((2, 4, 33, 33, 32), "causal", 0.0, kv_heads=2),
    AttnSpec((2, 4, 33, 33, 32), "causal", 0.1, kv_heads=2),
    AttnSpec((2, 4, 33, 45, 32), "key_padding+bool", 0.1, kv_heads=2),
    AttnSpec((2, 2, 33, 45, 32), "key_padding+bool"),
    AttnSpec((2, 2, 33, 45, 32), "key_padding+float", 0.1),
    AttnSpec((2, 2, 45, 33, 32), "causal+float"),
    AttnSpec((2, 2, 33, 17, 32), "float", 0.0, mask_grad=True),
    AttnSpec((2, 2, 33, 17, 32), "causal+key_padding+float", 0.1, mask_grad=True),
    AttnSpec((2, 2, 33, 33, 32), "causal", 0.1, scale=0.3),
    AttnSpec((2, 2, 33, 45, 32), "key_padding", 0.1, dv=48),
    AttnSpec((2, 2, 33, 45, 48), "causal", 0.0, dv=16),
    AttnSpec((2, 2, 33, 45, 32), "causal+key_padding", 0.1, lse=True),
    AttnSpec((2, 2, 97, 129, 40), "causal+key_padding", 0.1, strided=True),
]


def attention_cases(quick: bool) -> list[Case]:
    """Every shape x mask kind x dropout on/off, plus a strided (non-contiguous) case, the
    keep-mask checks and, in the full grid, ATTN_FEATURES (GQA, combined masks, a float mask's
    gradient, scale, value head dim, lse). In --quick on CPU one case also runs in float16."""
    shapes = ATTN_SHAPES_QUICK if quick else ATTN_SHAPES_FULL
    masks = ATTN_MASKS_QUICK if quick else ATTN_MASKS_FULL
    specs = [AttnSpec(s, m, p) for s in shapes for m in masks for p in (0.0, 0.1)]
    specs.append(AttnSpec(shapes[-1], "causal", 0.0, strided=True))
    # The features first: a GPU suite's time limit cuts each block's end (the H200's shards
    # reached ~20 of ~65 cases), and the shape x mask grid has passed there before.
    cases = [_attention_case(s) for s in ([] if quick else ATTN_FEATURES) + specs]
    half = AttnSpec(ATTN_SHAPES_QUICK[0], "key_padding", 0.1).name
    return _keep_mask_cases("attention") + _with_16bit(cases, "attention", half)


# --------------------------------------------------------------------------- layer_norm family


NORM_SHAPES_QUICK = [(3, 7), (2, 4, 129)]
# (4100, 768): on a GPU, more rows than one wave of backward blocks (each loads its next row
# ahead); (3, 16384): the longest rows the backward keeps in registers (16-bit).
NORM_SHAPES_FULL = [
    (1, 1),
    (5, 7),
    (3, 97),
    (2, 1023),
    (2, 4, 129),
    (1, 4096),
    (4100, 768),
    (3, 16384),
]


def _norm_case(
    op: str, shape, affine: bool, strided: bool, w32: bool = False, eps_none: bool = False
) -> Case:
    """`op` (layer_norm or rms_norm) over the last dim; `w32`: float32 weight and bias whatever
    the input dtype; `eps_none`: eps=None (the op's default) on inputs small enough (1e-3)
    that eps shows, against the reference given rms_norm_eps of the case's dtype."""
    n = shape[-1]

    def build(module, device, dtype):
        from fastformer import reference as R

        gen, scale = _gen(), 1e-3 if eps_none else 1.0
        if strided:  # every other row of a twice-as-tall tensor: non-contiguous rows
            x = _randn((*shape[:-1], 2, n), device, dtype, gen, scale=scale)[..., 0, :]
        else:
            x = _randn(shape, device, dtype, gen, scale=scale)
        wdtype = torch.float32 if w32 else dtype
        params = [_randn((n,), device, wdtype, gen) for _ in ("weight", "bias")]
        params = params[: 2 if op == "layer_norm" else 1] if affine else []
        fast_op, ref_op = getattr(module, op), getattr(R, op)
        eps = 1e-5 if op == "layer_norm" else 1e-6
        fast_eps, ref_eps = (None, R.rms_norm_eps(dtype)) if eps_none else (eps, eps)

        def fast(x, *wb):
            return fast_op(x, (n,), *wb, eps=fast_eps)

        def ref(x, *wb):  # float32 parameters promote; the op keeps the input dtype
            return ref_op(x, (n,), *wb, eps=ref_eps).to(x.dtype)

        return fast, ref, [x, *params], ["x", "weight", "bias"][: 1 + len(params)]

    name = "x".join(map(str, shape)) + ("" if affine else "-noaffine")
    name += ("-w32" if w32 else "") + ("-epsNone" if eps_none else "")
    return Case(op, name + ("-strided" if strided else ""), build)


def _dropout_add_case(shape, residual: bool, p: float, prenorm: bool) -> Case:
    n = shape[-1]

    def build(module, device, dtype):
        gen = _gen()
        x = _randn(shape, device, dtype, gen)
        r = _randn(shape, device, dtype, gen) if residual else None
        w, b = _randn((n,), device, dtype, gen), _randn((n,), device, dtype, gen)
        keep = _layer_norm_keep(module, _predicted_seed(device), shape, p, device) if p else None
        from fastformer import reference as R

        def fast(x, *rest):
            r_, w_, b_ = rest if residual else (None, *rest)
            return module.dropout_add_layer_norm(x, r_, w_, b_, 1e-5, p, prenorm)

        def ref(x, *rest):
            r_, w_, b_ = rest if residual else (None, *rest)
            return R.dropout_add_layer_norm(x, r_, w_, b_, 1e-5, p, prenorm, keep_mask=keep)

        inputs = [x] + ([r] if residual else []) + [w, b]
        names = ["x"] + (["residual"] if residual else []) + ["weight", "bias"]
        return _seeded(fast), ref, inputs, names

    name = "x".join(map(str, shape)) + ("" if residual else "-noresidual")
    name += (f"-drop{p:g}" if p else "") + ("-prenorm" if prenorm else "")
    return Case("dropout_add_layer_norm", name, build, dropout=bool(p))


def _keep_rate_checked(keep: torch.Tensor, p: float) -> torch.Tensor:
    """`keep` after a check of its kept fraction (6 standard deviations of a binomial): the
    reference takes the op's own mask, so a mask keeping p instead of 1 - p passed parity on
    the backends that use that mask helper themselves (attention's torch backend)."""
    n, kept = keep.numel(), int(keep.sum())
    if abs(kept - n * (1 - p)) > 6 * (n * p * (1 - p)) ** 0.5 + 1:
        raise ValueError(f"the dropout keep-mask keeps {kept} of {n} elements at p={p:g}")
    return keep


def _layer_norm_keep(module, seed: int, shape, p: float, device) -> torch.Tensor:
    """The op's own mask helper when it has one, else offset i = row-major element index."""
    helper = getattr(module, "dropout_add_layer_norm_keep_mask", None)
    if helper is not None:
        return _keep_rate_checked(helper(seed, tuple(shape), p, device=device), p)
    return _offsets_keep(seed, tuple(shape), p, device)


def layer_norm_cases(quick: bool) -> list[Case]:
    """layer_norm and rms_norm (affine or not, strided rows; in the full grid float32 weights
    and rms_norm's eps=None too) and dropout_add_layer_norm (dropout on/off, prenorm, without
    residual; in the full grid residual + dropout without prenorm), over the awkward hidden
    sizes, and the dropout keep-mask checks. In --quick on CPU one case of each op also runs in
    float16."""
    shapes = NORM_SHAPES_QUICK if quick else NORM_SHAPES_FULL
    cases = []
    for op in ("layer_norm", "rms_norm"):
        cases += [_norm_case(op, s, True, False) for s in shapes]
        cases += [_norm_case(op, shapes[0], False, False), _norm_case(op, shapes[-1], True, True)]
        if not quick:
            cases += [
                _norm_case(op, (3, 97), False, False),
                _norm_case(op, (5, 7), True, False, w32=True),
            ]
    if not quick:
        cases.append(_norm_case("rms_norm", (3, 97), True, False, eps_none=True))
    for s in shapes:
        for p in (0.0, 0.1):
            cases.append(_dropout_add_case(s, True, p, prenorm=p > 0))
    cases.append(_dropout_add_case(shapes[0], False, 0.1, prenorm=False))
    if not quick:
        cases.append(_dropout_add_case((2, 4, 129), True, 0.1, prenorm=False))
    half = ["2x4x129", "2x4x129", "2x4x129-drop0.1-prenorm"]
    for op, name in zip(("layer_norm", "rms_norm", "dropout_add_layer_norm"), half):
        cases = _with_16bit(cases, op, name)
    return _keep_mask_cases("dropout_add_layer_norm") + cases


# --------------------------------------------------------------------------- ffn


FFN_SHAPES_QUICK = [((5,), 16, 32), ((2, 3), 33, 65)]
FFN_SHAPES_FULL = [((1,), 8, 16), ((7,), 33, 65), ((13,), 64, 256), ((2, 5), 40, 96)]


def _ffn_case(
    lead, d: int, f: int, act: str, p: float, biases: str = "b1b2", strided: bool = False
) -> Case:
    """ffn with the biases named in `biases` ("b1b2", "b1", "b2", "") and, `strided`, an x
    that is every other column of a twice-as-wide tensor (non-contiguous)."""

    def build(module, device, dtype):
        from fastformer import reference as R

        gen = _gen()
        width = 2 * f if act in R.GATED_ACTIVATIONS else f
        if strided:
            x = _randn((*lead, 2 * d), device, dtype, gen)[..., ::2]
        else:
            x = _randn((*lead, d), device, dtype, gen)
        w1 = _randn((width, d), device, dtype, gen, scale=d**-0.5)
        w2 = _randn((d, f), device, dtype, gen, scale=f**-0.5)
        b1, b2 = _randn((width,), device, dtype, gen), _randn((d,), device, dtype, gen)
        params = {"w1": w1, "b1": b1, "w2": w2, "b2": b2}
        names = [k for k in params if k.startswith("w") or k in biases]
        keep = None
        if p:
            keep = _ffn_keep(module, _predicted_seed(device), (*lead, f), p, device)

        def split(given):  # the op's (w1, b1, w2, b2), None for a bias left out
            by_name = dict(zip(names, given))
            return [by_name.get(k) for k in params]

        def fast(x, *given):
            return module.ffn(x, *split(given), act, p)

        def ref(x, *given):
            return R.ffn(x, *split(given), act, p, keep_mask=keep)

        return _seeded(fast), ref, [x, *(params[k] for k in names)], ["x", *names]

    name = f"{'x'.join(map(str, lead))}x{d}-ff{f}-{act}" + (f"-drop{p:g}" if p else "")
    name += {"b1b2": "", "": "-nobias"}.get(biases, f"-{biases}only")
    return Case("ffn", name + ("-strided" if strided else ""), build, dropout=bool(p))


def _ffn_keep(module, seed: int, shape, p: float, device) -> torch.Tensor:
    """The op's keep-mask of the (tokens, d_ff) activation, shaped like it."""
    helper = getattr(module, "ffn_keep_mask", None)
    if helper is None:
        return _offsets_keep(seed, tuple(shape), p, device)
    tokens = 1
    for s in shape[:-1]:
        tokens *= s
    return _keep_rate_checked(helper(seed, tokens, shape[-1], p, device=device).view(shape), p)


def ffn_cases(quick: bool) -> list[Case]:
    """Every shape x activation (all six in the full grid) x dropout on/off, plus no biases,
    the keep-mask checks and, in the full grid, one bias only and a non-contiguous x. In
    --quick on CPU one case also runs in float16."""
    from fastformer.reference import ACTIVATIONS

    shapes = FFN_SHAPES_QUICK if quick else FFN_SHAPES_FULL
    acts = ("relu", "gelu", "swiglu") if quick else ACTIVATIONS
    cases = [_ffn_case(*s, a, p) for s in shapes for a in acts for p in (0.0, 0.1)]
    cases.append(_ffn_case(*shapes[0], "relu", 0.0, ""))
    if not quick:
        cases += [_ffn_case(*shapes[1], "gelu", 0.1, b) for b in ("b1", "b2")]
        cases += [_ffn_case(*shapes[-1], "swiglu", 0.1, strided=True)]
    half = _ffn_case(*FFN_SHAPES_QUICK[0], "gelu", 0.1).name
    return _keep_mask_cases("ffn") + _with_16bit(cases, "ffn", half)


CASE_BUILDERS = {
    "attention": attention_cases,
    "layer_norm": lambda quick: [c for c in layer_norm_cases(quick) if c.op == "layer_norm"],
    "rms_norm": lambda quick: [c for c in layer_norm_cases(quick) if c.op == "rms_norm"],
    "dropout_add_layer_norm": lambda quick: [
        c for c in layer_norm_cases(quick) if c.op == "dropout_add_layer_norm"
    ],
    "ffn": ffn_cases,
}


# --------------------------------------------------------------------------- running


def _break(fn: Callable) -> Callable:
    """The FASTFORMER_CHECK_BREAK perturbation: shift the first output by 0.1."""

    def broken(*args):
        out = fn(*args)
        if isinstance(out, tuple):
            return (out[0] + 0.1, *out[1:])
        return out + 0.1

    return broken


def broken_ops() -> set[str]:
    """Ops named in FASTFORMER_CHECK_BREAK (a module name breaks all its ops)."""
    return {s.strip() for s in os.environ.get(BREAK_ENV, "").split(",") if s.strip()}


def registry_key(op: str) -> str:
    """The FASTFORMER_BACKEND_<KEY> / REGISTRY name that dispatches `op`."""
    from fastformer.ops import _dispatch

    module, key = CHECK_OPS[op]
    return key if key in _dispatch.REGISTRY else module


def run_case(case: Case, module, device, dtype, backend: str | None) -> Row:
    """Parity of one case with the op forced to `backend` (None: the default dispatch)."""
    from fastformer.cli.impls import forced_backend
    from fastformer.testing import compare_with_reference

    key = registry_key(case.op)
    row = Row(
        case.op,
        backend or "default",
        str(device),
        str(dtype).replace("torch.", ""),
        case.name,
        "pass",
    )
    try:
        fast, ref, inputs, names = case.build(module, device, dtype)
        if case.op in broken_ops() or CHECK_OPS[case.op][0] in broken_ops():
            fast = _break(fast)
        with forced_backend(key, backend):
            results = compare_with_reference(fast, ref, inputs, names=names)
    except RuntimeError as exc:
        text = str(exc)
        if f"FASTFORMER_BACKEND_{key.upper()}=" in text and "cannot run" in text:
            row.status, row.message = "skip", text.split(": ", 1)[-1]
        else:
            row.status, row.message = "ERROR", f"{type(exc).__name__}: {text}"
        return row
    except Exception as exc:  # a crash in a kernel is a failed case, not a crashed command
        row.status, row.message = "ERROR", f"{type(exc).__name__}: {exc}"
        return row
    worst = max(results, key=lambda r: r.error / r.bound if r.bound > 0 else float("inf"))
    row.worst, row.error, row.bound = worst.name, worst.error, worst.bound
    row.status = "pass" if all(r.passed for r in results) else "FAIL"
    row.results = [
        {"name": r.name, "error": r.error, "bound": r.bound, "passed": r.passed} for r in results
    ]
    return row


def run_keep_mask_case(case: KeepMaskCase, module, device: torch.device) -> Row:
    """The op's keep-mask helper on `device` against the scheme: every element must agree."""
    row = Row(case.op, "-", str(device), "-", case.name, "pass", worst="keep")
    try:
        got, expected = case.masks(module, device)
    except Exception as exc:  # a helper that raises is a failed case, not a crashed command
        row.status, row.message = "ERROR", f"{type(exc).__name__}: {exc}"
        return row
    if got.dtype != torch.bool or got.shape != expected.shape:
        row.status = "FAIL"
        row.message = (
            f"keep-mask is {got.dtype} {tuple(got.shape)}; expected torch.bool "
            f"{tuple(expected.shape)}"
        )
        return row
    wrong = int((got.cpu() != expected).sum())
    row.error, row.bound = float(wrong), 0.0
    row.results = [{"name": "keep", "error": row.error, "bound": 0.0, "passed": not wrong}]
    if wrong:
        row.status = "FAIL"
        row.message = f"{wrong} of {expected.numel()} elements differ from the Philox scheme"
    return row


def devices(choice: str) -> list[torch.device]:
    """The devices to check: `all` = CPU plus CUDA when visible."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            "--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)"
        )
    if choice in ("cpu", "cuda"):
        return [torch.device(choice)]
    return [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


def dtypes_for(device: torch.device, backend: str | None, quick: bool) -> list[torch.dtype]:
    """--quick: fp32 on CPU, bf16 on CUDA; the full grid: all three. The Triton interpreter
    cannot run bf16 (ENVIRONMENT.md), so bf16 Triton is checked on a GPU only."""
    if device.type == "cuda":  # bf16 first: the interpreter cannot check it
        return [torch.bfloat16] if quick else [torch.bfloat16, torch.float16, torch.float32]
    if quick:
        return [torch.float32]
    if backend is not None and "triton" in backend:
        return [torch.float32, torch.float16]
    return [torch.float32, torch.float16, torch.bfloat16]


def backends_for(
    op: str, device: torch.device, interpret: bool
) -> tuple[list[str | None], list[Row]]:
    """Backends of `op` to force one by one, and a row for each this environment lacks: `skip`,
    or ERROR for the C++ kernels (`_lacking_row`). Triton backends on CPU run only with
    --interpret."""
    from fastformer.ops import _dispatch

    key = registry_key(op)
    if key not in _dispatch.REGISTRY:
        return [None], []
    chosen: list[str | None] = []
    lacking = []
    for name, why in _dispatch.explain(key, None):
        if device.type == "cpu" and "triton" in name and not interpret:
            why = why or ["Triton on CPU runs only through the interpreter: pass --interpret"]
        if why:
            lacking.append(_lacking_row(op, name, device, why))
        else:
            chosen.append(name)
    return chosen, lacking


def _lacking_row(op: str, backend: str, device: torch.device, why: list[str]) -> Row:
    """The row of a backend that cannot run here. A C++ extension that does not load is an
    ERROR: `check` is documented to check the C++ kernels, and a `skip` let a CI job pass
    without them. Only a FASTFORMER_BACKEND_<OP> forcing another backend (the user's runs
    never use these kernels) leaves it a `skip`."""
    from fastformer.ops import _dispatch

    key = registry_key(op)
    forced = _dispatch.forced_backend(key)
    row = Row(op, backend, str(device), "-", "(all)", "skip", message="; ".join(why))
    if backend != "cpp":
        return row
    if forced in (None, backend):
        row.status, row.message = "ERROR", f"the C++ kernels cannot run: {row.message}"
    else:
        row.message = f"FASTFORMER_BACKEND_{key.upper()}={forced!r}; {row.message}"
    return row


def parse_shard(text: str | None) -> tuple[int, int]:
    """`--shard K/N` -> (K - 1, N): this process runs grid cases K, K + N, K + 2N, ..."""
    if text is None:
        return 0, 1
    try:
        k, n = (int(part) for part in text.split("/"))
    except ValueError:
        k = n = 0
    if not 1 <= k <= n:
        raise UsageError(f"--shard must be K/N with 1 <= K <= N, got {text!r}")
    return k - 1, n


GridEntry = tuple[str | None, torch.dtype | None, Case | KeepMaskCase]


def op_grid(
    op: str, device: torch.device, quick: bool, interpret: bool
) -> tuple[list[GridEntry], list[Row]]:
    """(backend, dtype, case) of every case of `op` on `device`, in order, and the rows of the
    backends this environment lacks. Keep-mask cases depend on neither backend nor dtype:
    they run once, first. The (backend, dtype) blocks take turns, case by case: a time limit
    (--max-seconds) then cuts the end of every block, not whole blocks (the H200 suite's
    attention shards never reached float32 Triton nor the torch backend, which came last)."""
    chosen, lacking = backends_for(op, device, interpret)
    cases = CASE_BUILDERS[op](quick)
    entries: list[GridEntry] = [(None, None, c) for c in cases if isinstance(c, KeepMaskCase)]
    parity = [c for c in cases if isinstance(c, Case)]
    blocks = []
    for backend in chosen:
        blocks += [
            [(backend, dtype, c) for c in parity] for dtype in dtypes_for(device, backend, quick)
        ]
        if quick and device.type == "cpu":  # fp16: the Triton interpreter cannot run bf16
            blocks.append([(backend, torch.float16, c) for c in parity if c.quick_16bit])
    turns = itertools.zip_longest(*blocks)
    entries += [entry for turn in turns for entry in turn if entry is not None]
    return entries, lacking


def iter_rows(
    ops: list[str],
    device_choice: str,
    quick: bool,
    interpret: bool,
    shard: tuple[int, int] = (0, 1),
    deadline: float | None = None,
) -> Iterator[Row]:
    """Run the grid (the cases of `shard`); yields each row as soon as it is known. Cases
    reached after `deadline` (time.perf_counter()) are yielded as "not run"."""
    from fastformer.cli.impls import load_op

    index = -1
    for op in ops:
        module, error = load_op(CHECK_OPS[op][0])
        if module is None:
            yield Row(op, "-", "-", "-", "(import)", "ERROR", message=error or "")
            continue
        for device in devices(device_choice):
            entries, lacking = op_grid(op, device, quick, interpret)
            yield from lacking
            for backend, dtype, case in entries:
                index += 1
                if index % shard[1] != shard[0]:
                    continue
                if deadline is not None and time.perf_counter() > deadline:
                    name = str(dtype).removeprefix("torch.") if dtype else "-"
                    yield Row(op, backend or "-", str(device), name, case.name, "not run")
                elif isinstance(case, KeepMaskCase):
                    yield run_keep_mask_case(case, module, device)
                else:
                    yield run_case(case, module, device, dtype, backend)


def _fmt(row: Row) -> str:
    err = "-" if row.error is None else f"{row.error:.2e}"
    bound = "-" if row.bound is None else f"{row.bound:.2e}"
    line = (
        f"{row.op:<23} {row.backend:<8} {row.device:<5} {row.dtype:<9} {row.case:<36} "
        f"{row.worst:<9} {err:>9} {bound:>9}  {row.status}"
    )
    return line + (f"  ({row.message})" if row.message else "")


HEADER = (
    f"{'op':<23} {'backend':<8} {'dev':<5} {'dtype':<9} {'case':<36} {'worst':<9} "
    f"{'error':>9} {'bound':>9}  verdict"
)


def _set_interpret(argv: list[str] | None) -> int | None:
    """--interpret must take effect before any Triton kernel is decorated: set the variable
    when neither Triton nor a kernel module is imported yet, else re-run this command in a
    fresh process. Triton's own library functions (tl.cdiv, tl.max) are decorated when triton
    is imported, and torch imports it on the way to fastformer.cli: every interpreted kernel
    then failed ("Cannot call @triton.jit'd outside of the scope of a kernel")."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    os.environ["TRITON_INTERPRET"] = "1"
    loaded = [m for m in sys.modules if m == "triton" or m.startswith("fastformer.kernels.")]
    if not loaded:
        return None
    import subprocess

    args = list(argv) if argv is not None else sys.argv[1:]
    return subprocess.call([sys.executable, "-m", "fastformer", *args], env=dict(os.environ))


def _bounds_checked(interpret: bool) -> AbstractContextManager:
    """Under --interpret, a kernel's access outside its tensors errors its case (a GPU would
    read another allocation there, or fault)."""
    if not interpret:
        return nullcontext()
    from fastformer.kernels.interpreter_bounds import checked

    return checked()


def parse_ops(text: str) -> list[str]:
    """`--ops attention,layer_norm` -> the ops of the grid (layer_norm includes rms_norm and
    dropout_add_layer_norm)."""
    ops: list[str] = []
    for name in (s.strip() for s in text.split(",") if s.strip()):
        if name in OP_GROUPS:
            ops += OP_GROUPS[name]
        elif name in CHECK_OPS:
            ops.append(name)
        else:
            choices = sorted(set(OP_GROUPS) | set(CHECK_OPS))
            raise UsageError(f"--ops: unknown op {name!r}; expected a comma list of {choices}")
    if not ops:
        raise UsageError(f"--ops: no op given; expected a comma list of {sorted(OP_GROUPS)}")
    return list(dict.fromkeys(ops))


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Run the grid, print one row per case (or JSON); 1 if any case fails or errors."""
    ops = parse_ops(args.ops)
    shard = parse_shard(args.shard)
    if args.max_seconds is not None and not args.max_seconds > 0:
        raise UsageError(f"--max-seconds must be > 0, got {args.max_seconds}")
    device = args.device
    if args.interpret:
        if device == "cuda":
            raise UsageError(
                "--interpret runs Triton on CPU tensors; it cannot go with --device cuda"
            )
        device = "cpu"  # the interpreter would also take over the GPU kernels
        code = _set_interpret(argv)
        if code is not None:
            return code
    # After --interpret took effect: it is what lets a forced Triton backend run on a CPU.
    check_settings(forces_backends=True)
    devices(device)  # an unavailable --device fails here, before the table's header
    start = time.perf_counter()
    rows = []
    if not args.json:
        print(HEADER)
    deadline = None if args.max_seconds is None else start + args.max_seconds
    with _bounds_checked(args.interpret):
        for row in iter_rows(ops, device, args.quick, args.interpret, shard, deadline):
            rows.append(row)
            if not args.json:
                print(_fmt(row), flush=True)
    ran = [r for r in rows if r.status not in ("skip", "not run")]
    bad = [r for r in rows if r.status in ("FAIL", "ERROR")]
    not_run = sum(r.status == "not run" for r in rows)
    summary = {
        "cases": len(ran),
        "passed": len(ran) - len(bad),
        "failed": len(bad),
        "skipped": len(rows) - len(ran) - not_run,
        "not_run": not_run,
        "seconds": round(time.perf_counter() - start, 1),
    }
    if args.json:
        from fastformer.cli.env import manifest

        out = {"environment": manifest(), "summary": summary, "rows": [r.__dict__ for r in rows]}
        print(json.dumps(finite(out), indent=2, allow_nan=False))
    else:
        print(
            f"{summary['passed']}/{summary['cases']} cases passed, {summary['failed']} failed, "
            f"{summary['skipped']} skipped in {summary['seconds']} s"
            + (f"; {not_run} not run (past --max-seconds)" if not_run else "")
        )
    if not ran:
        return _nothing_ran(args, ops, device, shard, not_run)
    return 1 if bad else 0


def _nothing_ran(
    args: argparse.Namespace, ops: list[str], device: str, shard: tuple[int, int], not_run: int
) -> int:
    """Exit status when no case ran: 0 for a shard past the grid's end (a CI job split into
    more shards than the grid has cases must not fail), else 1 with the cause."""
    if not_run:
        print("check: no case ran before --max-seconds", file=sys.stderr)
        return 1
    total = grid_size(ops, device, args.quick, args.interpret)
    if total and shard[0] >= total:
        print(
            f"check: shard {shard[0] + 1}/{shard[1]} holds no case (the grid has {total}): "
            "nothing to check",
            file=sys.stderr,
        )
        return 0
    print("check: no case ran (see the skip reasons above)", file=sys.stderr)
    return 1


def grid_size(ops: list[str], device_choice: str, quick: bool, interpret: bool) -> int:
    """How many cases the grid of `iter_rows` holds (all shards together)."""
    from fastformer.cli.impls import load_op

    total = 0
    for op in ops:
        if load_op(CHECK_OPS[op][0])[0] is None:
            continue
        for device in devices(device_choice):
            total += len(op_grid(op, device, quick, interpret)[0])
    return total
