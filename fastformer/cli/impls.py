"""The implementations each op is benchmarked against, built for one case on one device.

Shared by `python -m fastformer bench` and benchmarks/*.py. Every builder returns an `OpBench`:
the inputs, a callable per implementation (or the reason it cannot run this case) and the
case's FLOPs / bytes. Peers: `reference` (fastformer.reference, eager, dropout through a
precomputed keep-mask), `torch` (torch's own op), and on CUDA `torch.compile` of the reference,
the SDPA backends, FlexAttention and the bare GEMMs.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from fastformer import reference as R
from fastformer.cli.cases import AttentionCase, FfnCase, LayerNormCase

FAST = "fastformer"
# Implementations that materialise the (B, H, S, S) scores; skipped when those would not fit.
MATERIALISING = ("reference", "torch.compile", "sdpa-math")
SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")


def load_op(op: str) -> tuple[ModuleType | None, str | None]:
    """`fastformer.ops.<op>`, or None and why it cannot be imported (ops land one by one)."""
    try:
        return importlib.import_module(f"fastformer.ops.{op}"), None
    except Exception as exc:  # any import failure is reported, never fatal
        return None, f"fastformer.ops.{op} cannot be imported: {type(exc).__name__}: {exc}"


@dataclass
class OpBench:
    """One case ready to time: `impls[name]` is `fn(*args) -> Tensor` or a str (why not)."""

    op: str
    case: object
    args: tuple
    impls: dict[str, Callable | str]
    flops: Callable[[str], float] | None = None
    bytes: Callable[[str], float] | None = None
    backend: str | None = None  # the fastformer backend these inputs dispatch to


def which_backend(module: ModuleType | None, key: str, *args, **kwargs) -> str | None:
    """The backend `fastformer.ops.<op>` runs for these arguments (forced or first able), or
    None when the op module does not say (`backend_reasons`)."""
    from fastformer.ops import _dispatch

    forced = _dispatch.forced_backend(key)
    if forced or module is None:
        return forced
    reasons = getattr(module, "backend_reasons", None)
    if reasons is None:
        return None
    try:
        rows = reasons(*args, **kwargs)
    except Exception:  # reporting only: never let it stop a benchmark
        return None
    return next((name for name, why in rows if not why), None)


def _randn(shape, device, dtype, gen, requires_grad=True) -> torch.Tensor:
    t = torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
    return t.requires_grad_(requires_grad)


def static_compile(fn: Callable) -> Callable:
    """torch.compile of `fn` with static shapes: each case's shapes compile kernels of their
    own, as a user's fixed-shape training compiles them. With torch's default, every case
    after a shape change of the same function was compiled with dynamic shapes (automatic
    dynamic): the LayerNorm peer's forward at 16384 x 16384 took 0.708 ms as a grid's sixth
    case and 0.262 ms alone (H200, 2026-11-29). Recompile limits are raised for every
    benchmark shape."""
    import torch._dynamo.config as dyn

    for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(dyn, knob):
            setattr(dyn, knob, max(getattr(dyn, knob), 512))
    return torch.compile(fn, dynamic=False)


def _memory_budget(device: torch.device) -> int:
    """Bytes an eager implementation may use for its (B, H, S, S) intermediates."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // 2
    return 4 * 2**30


def _gpu_peers(device: torch.device, forced: bool | None) -> bool:
    """The CUDA peer set (torch.compile, SDPA backends, FlexAttention) by default on CUDA;
    `forced` builds it on any device (a CPU smoke test of the GPU code path)."""
    return device.type == "cuda" if forced is None else forced


# --------------------------------------------------------------------------- attention


def _sdpa_mask(case: AttentionCase, kpm: torch.Tensor | None, device) -> torch.Tensor | None:
    """SDPA's bool attn_mask (True = attend) equivalent to key padding (+ causal)."""
    if kpm is None:
        return None
    mask = ~kpm[:, None, None, :]
    if case.causal:
        tril = torch.ones(case.seq, case.seq, dtype=torch.bool, device=device).tril()
        mask = mask & tril
    return mask


def _sdpa(backend: str, mask, case: AttentionCase) -> Callable:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }[backend]

    def run(q, k, v):
        with sdpa_kernel(chosen), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=case.dropout_p,
                is_causal=case.causal and mask is None,
            )

    return run


def _flex(case: AttentionCase, kpm: torch.Tensor | None, device) -> Callable | str:
    if case.dropout_p:
        return "FlexAttention has no attention dropout"
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as exc:
        return f"FlexAttention unavailable: {exc}"
    lengths = None if kpm is None else (~kpm).sum(-1)

    def mask_mod(b, h, q_idx, kv_idx):
        keep = kv_idx >= 0
        if case.causal:
            keep = keep & (kv_idx <= q_idx)
        if lengths is not None:
            keep = keep & (kv_idx < lengths[b])
        return keep

    block_mask = None
    if case.causal or lengths is not None:
        block_mask = create_block_mask(
            mask_mod, case.batch, None, case.seq, case.seq, device=device
        )
    flex = static_compile(flex_attention)
    return lambda q, k, v: flex(q, k, v, block_mask=block_mask)


def attention_bench(
    case: AttentionCase, device: torch.device, dtype: torch.dtype, gpu_peers: bool | None = None
) -> OpBench:
    """Self-attention on (batch, heads, seq, head_dim) q/k/v."""
    gen = torch.Generator().manual_seed(0)
    shape = (case.batch, case.heads, case.seq, case.head_dim)
    q, k, v = (_randn(shape, device, dtype, gen) for _ in range(3))
    kpm = None
    if case.padding:
        kpm = torch.zeros(case.batch, case.seq, dtype=torch.bool, device=device)
        kpm[:, case.seq - round(case.seq * case.padding) :] = True
    too_big = case.score_bytes(4) * 4 > _memory_budget(device)
    keep = None
    if case.dropout_p and not too_big:
        keep = (
            torch.rand(case.batch, case.heads, case.seq, case.seq, device=device) >= case.dropout_p
        )
    kw = dict(dropout_p=case.dropout_p, is_causal=case.causal)
    impls: dict[str, Callable | str] = {}
    module, error = load_op("attention")
    impls[FAST] = error or (
        lambda q, k, v: module.scaled_dot_product_attention(q, k, v, key_padding_mask=kpm, **kw)
    )

    def reference(q, k, v):
        return R.scaled_dot_product_attention(
            q, k, v, key_padding_mask=kpm, dropout_mask=keep, **kw
        )

    impls["reference"] = reference
    mask = _sdpa_mask(case, kpm, device)
    if _gpu_peers(device, gpu_peers):
        impls["torch.compile"] = static_compile(reference)
        for backend in SDPA_BACKENDS:
            impls[f"sdpa-{backend}"] = _sdpa(backend, mask, case)
        impls["flex"] = _flex(case, kpm, device)
    else:
        impls["torch"] = lambda q, k, v: F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=case.dropout_p,
            is_causal=case.causal and mask is None,
        )
    if too_big:
        why = f"skipped: materialises {case.score_bytes(4) / 2**30:.1f} GiB of fp32 scores"
        impls.update({name: why for name in MATERIALISING if name in impls})
    elem = torch.finfo(dtype).bits // 8
    backend = which_backend(
        module, "attention", q, k, v, None, case.dropout_p, case.causal, key_padding_mask=kpm
    )
    return OpBench(
        "attention",
        case,
        (q, k, v),
        impls,
        case.flops,
        lambda mode: case.bytes(mode, elem),
        backend,
    )


# --------------------------------------------------------------------------- layer_norm


def layer_norm_bench(
    case: LayerNormCase, device: torch.device, dtype: torch.dtype, gpu_peers: bool | None = None
) -> OpBench:
    """LayerNorm of (rows, hidden), or the fused dropout + residual add + LayerNorm."""
    gen = torch.Generator().manual_seed(0)
    shape, n = (case.rows, case.hidden), (case.hidden,)
    x, residual = _randn(shape, device, dtype, gen), _randn(shape, device, dtype, gen)
    w, b = _randn(n, device, dtype, gen), _randn(n, device, dtype, gen)
    elem = torch.finfo(dtype).bits // 8
    module, error = load_op("layer_norm")
    impls: dict[str, Callable | str] = {}
    if case.fused:
        p = case.dropout_p
        keep = torch.rand(shape, device=device) >= p
        args = (x, residual, w, b)
        impls[FAST] = error or (
            lambda x, r, w, b: module.dropout_add_layer_norm(x, r, w, b, 1e-5, p)
        )

        def reference(x, r, w, b):
            return R.dropout_add_layer_norm(x, r, w, b, 1e-5, p, keep_mask=keep)

        impls["reference"] = reference
        impls["torch"] = lambda x, r, w, b: F.layer_norm(r + F.dropout(x, p), n, w, b, 1e-5)
    else:
        args = (x, w, b)
        impls[FAST] = error or (lambda x, w, b: module.layer_norm(x, n, w, b, 1e-5))
        reference = lambda x, w, b: R.layer_norm(x, n, w, b, 1e-5)
        impls["reference"] = reference
        impls["torch"] = lambda x, w, b: F.layer_norm(x, n, w, b, 1e-5)
    if _gpu_peers(device, gpu_peers):
        impls["torch.compile"] = static_compile(reference)
    backend = which_backend(module, "layer_norm", x)  # the fused op dispatches as layer_norm
    nbytes = lambda mode: case.bytes(mode, elem)
    return OpBench("layer_norm", case, args, impls, bytes=nbytes, backend=backend)


# --------------------------------------------------------------------------- ffn


def ffn_bench(
    case: FfnCase, device: torch.device, dtype: torch.dtype, gpu_peers: bool | None = None
) -> OpBench:
    """Linear(d_model, d_ff), activation, dropout, Linear(d_ff, d_model) on (tokens, d_model)."""
    gen = torch.Generator().manual_seed(0)
    d, f, f1 = case.d_model, case.d_ff, case.width1  # f1: both halves of a gated linear1
    x = _randn((case.tokens, d), device, dtype, gen)
    w1 = (_randn((f1, d), device, dtype, gen, False) * d**-0.5).requires_grad_()
    w2 = (_randn((d, f), device, dtype, gen, False) * f**-0.5).requires_grad_()
    b1, b2 = _randn((f1,), device, dtype, gen), _randn((d,), device, dtype, gen)
    p, act = case.dropout_p, case.activation
    keep = torch.rand(case.tokens, f, device=device) >= p if p else None
    module, error = load_op("ffn")
    impls: dict[str, Callable | str] = {}
    impls[FAST] = error or (lambda x, w1, b1, w2, b2: module.ffn(x, w1, b1, w2, b2, act, p))

    def reference(x, w1, b1, w2, b2):
        return R.ffn(x, w1, b1, w2, b2, act, p, keep_mask=keep)

    impls["reference"] = reference
    if act == "relu":
        impls["torch"] = lambda x, w1, b1, w2, b2: F.linear(
            F.dropout(F.relu(F.linear(x, w1, b1)), p), w2, b2
        )
    # The floor: the two GEMMs alone, no bias, activation or dropout.
    impls["gemm-only"] = lambda x, w1, b1, w2, b2: (x @ w1.t())[:, :f] @ w2.t()
    if _gpu_peers(device, gpu_peers):
        impls["torch.compile"] = static_compile(reference)
    elem = torch.finfo(dtype).bits // 8
    backend = which_backend(module, "ffn", x)
    return OpBench(
        "ffn",
        case,
        (x, w1, b1, w2, b2),
        impls,
        case.flops,
        lambda mode: case.bytes(mode, elem),
        backend,
    )


BUILDERS = {"attention": attention_bench, "layer_norm": layer_norm_bench, "ffn": ffn_bench}


# --------------------------------------------------------------------------- running


def runner(fn: Callable, args: tuple, mode: str) -> Callable[[], None]:
    """A no-argument call of `fn(*args)`: forward under no_grad, or forward + backward (the
    gradients are dropped after each call so nothing accumulates)."""
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    if mode == "fwd":

        def forward() -> None:
            with torch.no_grad():
                fn(*args)

        return forward
    grad_out: list[torch.Tensor] = []

    def forward_backward() -> None:
        out = fn(*args)
        if not grad_out:
            grad_out.append(torch.randn_like(out))
        out.backward(grad_out[0])
        for leaf in leaves:
            leaf.grad = None

    return forward_backward


@contextlib.contextmanager
def forced_backend(op: str, backend: str | None):
    """Run with FASTFORMER_BACKEND_<OP>=backend (nothing when backend is None)."""
    import os

    var = f"FASTFORMER_BACKEND_{op.upper()}"
    old = os.environ.get(var)
    if backend is not None:
        os.environ[var] = backend
    try:
        yield
    finally:
        if backend is not None:
            if old is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = old
