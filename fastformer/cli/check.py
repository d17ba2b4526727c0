"""`python -m fastformer check`: the parity grid of every op against the eager reference.

Every op x backend x device x dtype x mask kind x dropout on/off x awkward shape is run through
`fastformer.testing.compare_with_reference` (the parity rule of DESIGN.md: outputs and every
gradient). Dropout cases predict the seed the op will draw (`torch.manual_seed` then
`draw_seed`), regenerate its keep-mask with `fastformer.ops.rng` and feed it to the reference.
One row per case; exit status 1 when any case fails or errors.

Test-only hook: FASTFORMER_CHECK_BREAK=<op>[,<op>...] perturbs the fast output of those ops, so
a test can prove that `check` catches a broken kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
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
    """One parity case: `build(module, device, dtype)` -> (fast_fn, ref_fn, inputs, names)."""

    op: str
    name: str
    build: Callable[..., tuple[Callable, Callable, list, list[str]]]
    dropout: bool = False


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
    """(attn_mask, is_causal, key_padding_mask) of a mask kind. With several batch rows, key
    padding pads the last one entirely (fully masked rows must give 0, never NaN)."""
    kpm = attn_mask = None
    if "key_padding" in kind:
        lengths = torch.randint(1, lk + 1, (b,), generator=gen)
        if b > 1:
            lengths[-1] = 0
        kpm = (torch.arange(lk)[None, :] >= lengths[:, None]).to(device)
    if kind == "bool":
        attn_mask = (torch.rand(b, 1, lq, lk, generator=gen) > 0.3).to(device)
        attn_mask[..., 0, :] = False  # one fully masked query row
    elif kind == "float":
        attn_mask = torch.randn(1, 1, lq, lk, generator=gen, dtype=torch.float64).to(device, dtype)
    return attn_mask, "causal" in kind, kpm


def _attention_case(shape, mask: str, p: float, strided: bool, kv_heads: int = 0) -> Case:
    b, h, lq, lk, d = shape
    hkv = kv_heads or h  # fewer key/value heads: grouped-query attention (enable_gqa)
    gqa = hkv != h

    def build(module, device, dtype):
        gen = _gen()
        if strided:  # (B, L, H, D) storage seen as (B, H, L, D): a non-contiguous view
            q = _randn((b, lq, h, d), device, dtype, gen).transpose(1, 2)
            k = _randn((b, lk, hkv, d), device, dtype, gen).transpose(1, 2)
            v = _randn((b, lk, hkv, d), device, dtype, gen).transpose(1, 2)
        else:
            q = _randn((b, h, lq, d), device, dtype, gen)
            k, v = (_randn((b, hkv, lk, d), device, dtype, gen) for _ in range(2))
        attn_mask, causal, kpm = _attention_masks(mask, b, lq, lk, device, dtype, gen)
        keep = None
        if p:
            seed = _predicted_seed(device)
            keep = _keep_rate_checked(
                module.dropout_keep_mask(seed, b, h, lq, lk, p, device=device), p
            )

        def fast(q, k, v):
            return module.scaled_dot_product_attention(
                q, k, v, attn_mask, p, causal, None, gqa, key_padding_mask=kpm
            )

        def ref(q, k, v):
            from fastformer import reference as R

            m = (
                attn_mask.to(q.dtype)
                if attn_mask is not None and attn_mask.is_floating_point()
                else attn_mask
            )
            return R.scaled_dot_product_attention(
                q, k, v, m, p, causal, None, gqa, key_padding_mask=kpm, dropout_mask=keep
            )

        return _seeded(fast), ref, [q, k, v], ["q", "k", "v"]

    name = f"b{b}h{h}" + (f"kv{hkv}" if gqa else "") + f"q{lq}k{lk}d{d}-{mask}"
    name += f"-drop{p:g}" if p else ""
    return Case("attention", name + ("-strided" if strided else ""), build, dropout=bool(p))


def attention_cases(quick: bool) -> list[Case]:
    """Every shape x mask kind x dropout on/off, plus a strided (non-contiguous) case and, in
    the full grid, grouped-query attention."""
    shapes = ATTN_SHAPES_QUICK if quick else ATTN_SHAPES_FULL
    masks = ATTN_MASKS_QUICK if quick else ATTN_MASKS_FULL
    cases = [_attention_case(s, m, p, False) for s in shapes for m in masks for p in (0.0, 0.1)]
    cases.append(_attention_case(shapes[-1], "causal", 0.0, True))
    if not quick:
        cases += [_attention_case((2, 4, 33, 33, 32), "causal", p, False, 2) for p in (0.0, 0.1)]
    return cases


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


def _norm_case(op: str, shape, affine: bool, strided: bool) -> Case:
    n = shape[-1]

    def build(module, device, dtype):
        gen = _gen()
        if strided:  # every other row of a twice-as-tall tensor: non-contiguous rows
            x = _randn((*shape[:-1], 2, n), device, dtype, gen)[..., 0, :]
        else:
            x = _randn(shape, device, dtype, gen)
        w = _randn((n,), device, dtype, gen) if affine else None
        b = _randn((n,), device, dtype, gen) if affine else None
        inputs = [x] + ([w] + ([b] if op == "layer_norm" else []) if affine else [])
        names = ["x", "weight", "bias"][: len(inputs)]
        from fastformer import reference as R

        fast_op, ref_op = getattr(module, op), getattr(R, op)
        eps = 1e-5 if op == "layer_norm" else 1e-6

        def fast(x, *wb):
            return fast_op(x, (n,), *wb, eps=eps)

        def ref(x, *wb):
            return ref_op(x, (n,), *wb, eps=eps)

        return fast, ref, inputs, names

    name = "x".join(map(str, shape)) + ("" if affine else "-noaffine")
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
    """layer_norm and rms_norm (affine or not, strided rows) and dropout_add_layer_norm
    (dropout on/off, prenorm, without residual) over the awkward hidden sizes."""
    shapes = NORM_SHAPES_QUICK if quick else NORM_SHAPES_FULL
    cases = []
    for op in ("layer_norm", "rms_norm"):
        cases += [_norm_case(op, s, True, False) for s in shapes]
        cases += [_norm_case(op, shapes[0], False, False), _norm_case(op, shapes[-1], True, True)]
    for s in shapes:
        for p in (0.0, 0.1):
            cases.append(_dropout_add_case(s, True, p, prenorm=p > 0))
    cases.append(_dropout_add_case(shapes[0], False, 0.1, prenorm=False))
    return cases


# --------------------------------------------------------------------------- ffn


FFN_SHAPES_QUICK = [((5,), 16, 32), ((2, 3), 33, 65)]
FFN_SHAPES_FULL = [((1,), 8, 16), ((7,), 33, 65), ((13,), 64, 256), ((2, 5), 40, 96)]


def _ffn_case(lead, d: int, f: int, act: str, p: float, bias: bool) -> Case:
    def build(module, device, dtype):
        from fastformer import reference as R

        gen = _gen()
        width = 2 * f if act in R.GATED_ACTIVATIONS else f
        x = _randn((*lead, d), device, dtype, gen)
        w1 = _randn((width, d), device, dtype, gen, scale=d**-0.5)
        w2 = _randn((d, f), device, dtype, gen, scale=f**-0.5)
        b1 = _randn((width,), device, dtype, gen) if bias else None
        b2 = _randn((d,), device, dtype, gen) if bias else None
        keep = None
        if p:
            keep = _ffn_keep(module, _predicted_seed(device), (*lead, f), p, device)

        def split(params):
            return params if bias else (params[0], None, params[1], None)

        def fast(x, *params):
            w1_, b1_, w2_, b2_ = split(params)
            return module.ffn(x, w1_, b1_, w2_, b2_, act, p)

        def ref(x, *params):
            w1_, b1_, w2_, b2_ = split(params)
            return R.ffn(x, w1_, b1_, w2_, b2_, act, p, keep_mask=keep)

        inputs = [x, w1, b1, w2, b2] if bias else [x, w1, w2]
        names = ["x", "w1", "b1", "w2", "b2"] if bias else ["x", "w1", "w2"]
        return _seeded(fast), ref, inputs, names

    name = f"{'x'.join(map(str, lead))}x{d}-ff{f}-{act}" + (f"-drop{p:g}" if p else "")
    return Case("ffn", name + ("" if bias else "-nobias"), build, dropout=bool(p))


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
    """Every shape x activation (all six in the full grid) x dropout on/off, plus no biases."""
    from fastformer.reference import ACTIVATIONS

    shapes = FFN_SHAPES_QUICK if quick else FFN_SHAPES_FULL
    acts = ("relu", "gelu", "swiglu") if quick else ACTIVATIONS
    cases = [_ffn_case(*s, a, p, True) for s in shapes for a in acts for p in (0.0, 0.1)]
    cases.append(_ffn_case(*shapes[0], "relu", 0.0, False))
    return cases


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
    """fp32 (and fp16/bf16 in the full grid) on CPU; all three on CUDA. The Triton interpreter
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
    """Backends of `op` to force one by one, and `skip` rows for those this environment lacks.
    Triton backends on CPU run only with --interpret."""
    from fastformer.ops import _dispatch

    key = registry_key(op)
    if key not in _dispatch.REGISTRY:
        return [None], []
    chosen: list[str | None] = []
    skipped = []
    for name, why in _dispatch.explain(key, None):
        if device.type == "cpu" and "triton" in name and not interpret:
            why = why or ["Triton on CPU runs only through the interpreter: pass --interpret"]
        if why:
            skipped.append(Row(op, name, str(device), "-", "(all)", "skip", message="; ".join(why)))
        else:
            chosen.append(name)
    return chosen, skipped


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
            chosen, skipped = backends_for(op, device, interpret)
            yield from skipped
            for backend in chosen:
                for dtype in dtypes_for(device, backend, quick):
                    for case in CASE_BUILDERS[op](quick):
                        index += 1
                        if index % shard[1] != shard[0]:
                            continue
                        if deadline is not None and time.perf_counter() > deadline:
                            name = str(dtype).removeprefix("torch.")
                            yield Row(op, backend or "-", str(device), name, case.name, "not run")
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
    when no kernel module is imported yet, else re-run this command in a fresh process."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    os.environ["TRITON_INTERPRET"] = "1"
    loaded = [m for m in sys.modules if m.startswith("fastformer.kernels.")]
    if not loaded:
        return None
    import subprocess

    args = list(argv) if argv is not None else sys.argv[1:]
    return subprocess.call([sys.executable, "-m", "fastformer", *args], env=dict(os.environ))


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
            for backend in backends_for(op, device, interpret)[0]:
                total += len(dtypes_for(device, backend, quick)) * len(CASE_BUILDERS[op](quick))
    return total
