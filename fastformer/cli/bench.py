"""`python -m fastformer bench`: the whole model and the per-op micro-benchmarks.

Stage 1 (model): the paper's Transformer (reference.TransformerModel) on a synthetic padded
batch, as the eager reference, after `fastformer.swap`, and (CUDA) with its layers under
torch.compile (--full: also the whole model, and the swapped model, under torch.compile, and the
eager and swapped models with each step replayed from a CUDA graph); the same weights and inputs
for all. Training-step tokens/s (forward + backward + Adam step), inference tokens/s (one teacher-forced forward), peak memory, and the parity of the loss and
of every gradient at dropout 0 (fastformer.testing.parity against the reference in float64).
Stage 2 (ops): attention, layer_norm and ffn against each peer of fastformer.cli.impls, on
the default grid of fastformer.cli.cases (a representative subset on CUDA, sized for the 3-minute
target) or, with --full, the complete one.
Results go to results.json (written after every stage), report.md and PNG plots.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as _dt
import importlib
import importlib.util
import math
import os
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from fastformer.cli import cases as C
from fastformer.cli import env, report, timing
from fastformer.cli.errors import UsageError, check_settings
from fastformer.cli.impls import BUILDERS, FAST, runner, static_compile
from fastformer.cli.progress import Progress

# After this many seconds, repetitions are cut to one (timing.Pacer) so that the default run
# ends within its 3-minute target on a 2-core CPU (even a busy one) and on one H100/H200.
DEADLINE_S = {"cpu": 100, "cuda": 150}
# --threads above this many per CPU: torch.set_num_threads(100000) then a GEMM segfaulted
# in torch, and 5000 threads took 50 s for four layer_norm rows.
MAX_THREADS_PER_CPU = 4
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PAD, BOS = 0, 1


# --------------------------------------------------------------------------- set-up


def resolve_device(name: str) -> torch.device:
    """`auto` = CUDA when visible, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            "--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)"
        )
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` = bfloat16 on CUDA (the training dtype), float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def parse_ops(text: str) -> list[str]:
    """`--ops attention,ffn` -> ["attention", "ffn"], checked against the known ops (`--ops ""`:
    none, the model stage alone)."""
    ops = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    unknown = [op for op in ops if op not in C.OPS]
    if unknown:
        raise UsageError(f"--ops: unknown op(s) {unknown}; expected a comma list of {list(C.OPS)}")
    return ops


def parse_cases(text: str | None, ops: list[str], device: torch.device, quick: bool, full: bool):
    """`--cases a,b` -> the texts, each required to match a case of `ops` in this run's grid
    (None: every case)."""
    if text is None:
        return None
    only = [t.strip() for t in text.split(",") if t.strip()]
    if not only:  # said "nothing matches no case"
        raise UsageError(f"--cases: no text given ({text!r}); expected a comma list of texts")
    if not ops:
        raise UsageError("--cases selects op cases, but --ops names no op")
    names = [c.name for op in ops for c in C.OP_CASES[op](device.type, quick, full=full)]
    unmatched = [t for t in only if not any(t in name for name in names)]
    if unmatched:
        raise UsageError(
            f"--cases: {unmatched} matches no case of {ops} in this grid; its "
            f"cases: {', '.join(names)}"
        )
    return only


def default_out_dir() -> Path:
    """bench-results/<local timestamp> under the current directory."""
    return Path("bench-results") / _dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def budget_for(device: torch.device, quick: bool) -> timing.Budget:
    """Repetitions per measurement for this device (fewer with --quick)."""
    if quick:
        return timing.QUICK
    return timing.GPU_DEFAULT if device.type == "cuda" else timing.CPU_DEFAULT


# --------------------------------------------------------------------------- rooflines


def _copy_ms(numel: int, device: torch.device, budget: timing.Budget) -> float:
    """Median ms of one device copy of `numel` float32 elements (each read and written once)."""
    src = torch.empty(numel, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    return timing.time_op(lambda: dst.copy_(src), device, budget)


def rooflines(device: torch.device, dtype: torch.dtype, budget: timing.Budget) -> dict[str, float]:
    """The two numbers of the performance method, measured in this run: device copy GB/s and
    dense GEMM TFLOP/s in the benchmark dtype (CUDA 8192^3, CPU 1024^3)."""
    numel = (256 if device.type == "cuda" else 16) * 2**20
    copy_ms = _copy_ms(numel, device, budget)
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    gemm_ms = timing.time_op(lambda: a @ b, device, budget)
    return {
        "copy_gbps": 2 * numel * 4 / copy_ms / 1e6,
        "gemm_tflops": 2 * n**3 / gemm_ms / 1e9,
        "gemm_size": n,
    }


# --------------------------------------------------------------------------- model stage


def synthetic_batch(case: C.ModelCase, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, tgt) token batches (B, max_len) padded with PAD: lengths uniform in
    [max_len/2, max_len] (one row full), target lengths within +-10% of the source."""
    gen = torch.Generator().manual_seed(0)
    b, n = case.batch, case.max_len
    src_len = torch.randint(n // 2, n + 1, (b,), generator=gen)
    src_len[0] = n
    jitter = torch.randint(-max(n // 10, 1), max(n // 10, 1) + 1, (b,), generator=gen)
    tgt_len = (src_len + jitter).clamp(2, n)
    tgt_len[0] = n

    def tokens(lengths):
        t = torch.randint(3, case.vocab, (b, n), generator=gen)
        return t.masked_fill(torch.arange(n)[None, :] >= lengths[:, None], PAD).to(device)

    return tokens(src_len), tokens(tgt_len)


def build_model(case: C.ModelCase, device: torch.device, dtype: torch.dtype, dropout: float):
    """reference.TransformerModel of `case` (shared embeddings, seeded weights) on device."""
    from fastformer import reference as R

    torch.manual_seed(0)
    model = R.TransformerModel(
        case.vocab,
        case.vocab,
        d_model=case.d_model,
        nhead=case.nhead,
        num_encoder_layers=case.num_encoder_layers,
        num_decoder_layers=case.num_decoder_layers,
        dim_feedforward=case.dim_feedforward,
        dropout=dropout,
        share_embeddings=True,
        pad_id=PAD,
        bos_id=BOS,
        max_len=max(case.max_len + 1, 512),
    )
    return model.to(device=device, dtype=dtype)


def swapped(model) -> tuple[Any, dict[str, Any]]:
    """A copy of `model` after fastformer.swap, and what swap reported (or why it failed)."""
    try:
        # The module, whether or not fastformer/__init__ re-exports its function.
        swap = importlib.import_module("fastformer.swap").swap
    except (ImportError, AttributeError) as exc:
        return None, {"error": f"fastformer.swap is not available: {exc}"}
    fast = copy.deepcopy(model)
    try:
        rep = swap(fast)
    except Exception as exc:
        return None, {"error": f"fastformer.swap failed: {type(exc).__name__}: {exc}"}
    return fast, {"report": str(rep)}


def torch_nn_twin(model) -> Any:
    """A copy of the eager `model` whose encoder-decoder is `torch.nn.Transformer` with the same
    weights: the model as a torch.nn user writes it (SDPA's fused attention, PyTorch's
    inference fast path), where the eager reference spells every op out. A reason string if
    `model` is not the reference's TransformerModel."""
    from fastformer import reference as R

    if not isinstance(model, R.TransformerModel):
        return f"not a fastformer.reference.TransformerModel: {type(model).__name__}"
    ref = model.transformer
    layer = ref.encoder.layers[0]
    if layer.activation not in ("relu", "gelu") and not callable(layer.activation):
        return f"torch.nn.Transformer has no {layer.activation!r} activation"
    weight = layer.linear1.weight
    twin = copy.deepcopy(model)
    twin.transformer = torch.nn.Transformer(
        ref.d_model,
        ref.nhead,
        len(ref.encoder.layers),
        len(ref.decoder.layers),
        layer.linear1.out_features,
        layer.dropout.p,
        layer.activation,
        layer_norm_eps=layer.norm1.eps,
        batch_first=True,
        norm_first=layer.norm_first,
        bias=layer.linear1.bias is not None,
        device=weight.device,
        dtype=weight.dtype,
    )
    twin.transformer.load_state_dict(ref.state_dict())
    return twin


def _loss_and_grads(model, src, tgt) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.eval()  # eval mode turns every dropout off: parity is defined at dropout 0
    model.zero_grad(set_to_none=True)
    loss = model.loss(src, tgt)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@contextlib.contextmanager
def _ffn_records(model, da: bool = True) -> Iterator[dict[str, dict[str, torch.Tensor]]]:
    """While open, records for every ReLU FFN of a reference model (a layer with `_ff_block`)
    its input `x` and pre-activation `h` as (tokens, features), its `input` as it came (in the
    autograd graph), and after the backward the gradient `da` reaching the ReLU's output
    (dy @ w2: parity runs at dropout 0; not with `da=False`). Keyed by the layer's name; one
    call of each layer."""
    records: dict[str, dict[str, torch.Tensor]] = {}
    layers = [
        (name, m)
        for name, m in model.named_modules()
        if hasattr(m, "_ff_block") and getattr(m, "activation", None) == "relu"
    ]

    def recorded(name, layer):
        def ff_block(x):
            y = type(layer)._ff_block(layer, x)
            l1, w2 = layer.linear1, layer.linear2.weight
            with torch.no_grad():
                h = torch.nn.functional.linear(x, l1.weight, l1.bias)
            rec = records[name] = {
                "x": x.detach().flatten(0, -2),
                "h": h.flatten(0, -2),
                "input": x,
            }
            if da and y.requires_grad:
                y.register_hook(lambda dy: rec.update(da=(dy.flatten(0, -2) @ w2).detach()))
            return y

        return ff_block

    for name, layer in layers:
        layer._ff_block = recorded(name, layer)  # the instance's, shadowing the class's
    try:
        yield records
    finally:
        for _, layer in layers:
            del layer._ff_block


# The ReLU inputs within rounding of 0 get the backward that bounds what their sign moves
# upstream (`_upstream_moves`) while inputs x parameters stay within this (the tiny model in
# bfloat16: ~600 x 0.2M); past it (the base model), the rule keeps its absolute floor instead.
MAX_FLIP_WORK = 2**30


def _near_zero(rec64: dict, rec_lp: dict) -> dict[str, torch.Tensor]:
    """Per ReLU FFN layer, the (tokens, d_ff) mask of its inputs within rounding of 0 whose sign
    matters: |h| in float64 at most twice the largest error of the layer's h in the eager
    low-precision run (the parity rule's factor), and a gradient da at the ReLU's output."""
    near = {}
    for name, r64 in rec64.items():
        rlp = rec_lp.get(name)
        if rlp is not None and "da" in r64:
            tol = 2 * float((rlp["h"].double() - r64["h"]).abs().max())
            near[name] = (r64["h"].abs() <= tol) & (r64["da"] != 0)  # none where tol is NaN
    return near


def _upstream_moves(ref64, src, tgt, near: dict, rec64: dict) -> dict:
    """Per parameter, the sum over the inputs in `near` of |what taking the other sign moves its
    gradient by| upstream of the FFN: the flip changes the FFN input's gradient by da * w1[u] at
    its token, and each such change is carried back by its own (batched) backward."""
    model = copy.deepcopy(ref64).eval()
    modules = dict(model.named_modules())
    names, params = zip(*((n, p) for n, p in model.named_parameters() if p.requires_grad))
    chunk = max(1, min(64, 2**26 // sum(p.numel() for p in params)))  # batched grads' memory
    moves: dict[str, torch.Tensor] = {}
    with _ffn_records(model, da=False) as rec:
        model.loss(src, tgt)
    for name, mask in near.items():
        tokens, units = mask.nonzero(as_tuple=True)
        x = rec[name]["input"]
        dx = rec64[name]["da"][tokens, units, None] * modules[name].linear1.weight.detach()[units]
        for start in range(0, len(tokens), chunk):
            rows = tokens[start : start + chunk]
            cot = x.new_zeros(len(rows), x.numel() // x.shape[-1], x.shape[-1])
            cot[torch.arange(len(rows)), rows] = dx[start : start + chunk]
            grads = torch.autograd.grad(
                x, params, cot.view(len(rows), *x.shape), retain_graph=True,
                allow_unused=True, is_grads_batched=True,
            )  # fmt: skip
            for n, g in zip(names, grads):
                if g is not None:
                    moves[n] = moves.get(n, 0) + g.abs().sum(0)
    return moves


def relu_sign_allowance(ref64, src, tgt, rec64: dict, rec_lp: dict) -> tuple[dict, int, bool]:
    """What the ReLU inputs within rounding of 0 (`_near_zero`) may move each gradient by, per
    element; how many inputs there are; and whether the moves upstream of their FFNs were
    bounded (`MAX_FLIP_WORK`). Such an input's sign is a draw: the other one moves
    linear1's weight row by da * x of its token, the bias by da, and everything upstream
    (`_upstream_moves`); one such input where da is large moved gradients by more than the
    whole rule allows."""
    near = _near_zero(rec64, rec_lp)
    count = sum(int(m.sum()) for m in near.values())
    upstream = count * sum(p.numel() for p in ref64.parameters()) <= MAX_FLIP_WORK
    # No input near 0 (float32, most often): nothing moves, no second forward to make.
    allowance = _upstream_moves(ref64, src, tgt, near, rec64) if upstream and count else {}
    for name, mask in near.items():
        flip = torch.where(mask, rec64[name]["da"].abs(), 0.0)  # (tokens, d_ff)
        w, b = f"{name}.linear1.weight", f"{name}.linear1.bias"
        allowance[w] = allowance.get(w, 0) + flip.T @ rec64[name]["x"].abs()
        allowance[b] = allowance.get(b, 0) + flip.sum(0)
    return allowance, count, upstream


def _less(got: torch.Tensor, ref: torch.Tensor, allowance: torch.Tensor | None) -> torch.Tensor:
    """`got` moved towards `ref` by at most `allowance` per element (NaN and inf stay)."""
    if allowance is None:
        return got
    diff = got.double() - ref.double()
    return ref.double() + diff.sign() * (diff.abs() - allowance.to(diff)).clamp(min=0)


def model_parity(eager, fast, src, tgt) -> dict[str, Any]:
    """Parity rule on the loss and every parameter gradient: fastformer vs the reference in
    float64, bounded by twice the larger error of two eager runs in the benchmark dtype, the
    reference's and its torch.nn twin's (`torch_nn_twin`; the reference's alone for other
    models). A ReLU input within rounding of 0 takes either sign, a draw of each run: every
    gradient's error is measured less what such flips can move it by (`relu_sign_allowance`).
    The rule's floor (one rounding step: 1e-2 in bfloat16) is then taken relative to the
    tensor's largest value below 1 too: a mean loss's gradients are ~1e-2, and the absolute
    floor passed the tiny model in bfloat16 with a linear1 weight 20% off. Without the
    allowance, in float16, one flip where the upstream gradient is large failed the tiny
    model's linear1 gradients by 2.4x, and others, upstream, the relative floor
    (benchmarks/NOTES.md)."""
    from fastformer.testing import parity

    ref64, reference = copy.deepcopy(eager).double(), copy.deepcopy(eager)
    twin = torch_nn_twin(eager)
    with _ffn_records(ref64) as rec64, _ffn_records(reference) as rec_lp:
        loss64, grads64 = _loss_and_grads(ref64, src, tgt)
        runs = [_loss_and_grads(m, src, tgt) for m in [reference, twin] if not isinstance(m, str)]
    allowance, near_zero, relative = relu_sign_allowance(ref64, src, tgt, rec64, rec_lp)
    loss_f, grads_f = _loss_and_grads(fast, src, tgt)

    def checked(name: str, got: torch.Tensor, ref: torch.Tensor, lows: list, allow=None) -> Any:
        got = _less(got, ref, allow)
        return max(
            (parity(name, got, ref, lp, relative_floor=relative) for lp in lows),
            key=lambda r: r.bound,
        )

    results = [checked("loss", loss_f, loss64, [loss for loss, _ in runs])]
    missing = sorted(set(grads64) - set(grads_f))
    extra = sorted(set(grads_f) - set(grads64))  # e.g. a frozen weight the swap made trainable
    for name in sorted(set(grads64) & set(grads_f)):
        lows = [grads[name] for _, grads in runs if name in grads]
        allow = allowance.get(name)
        results.append(checked(f"d{name}", grads_f[name], grads64[name], lows, allow))
    worst = max(results, key=lambda r: r.error / r.bound if r.bound else math.inf)
    failed = [str(r) for r in results if not r.passed]
    return {
        "passed": not failed and not missing and not extra,
        "compared": len(results),
        "relu_inputs_near_zero": near_zero,
        "relative_floor": relative,
        "loss": {"error": results[0].error, "bound": results[0].bound, "passed": results[0].passed},
        "worst": {"name": worst.name, "error": worst.error, "bound": worst.bound},
        "failed": failed
        + [f"d{n}: no gradient in the fastformer model" for n in missing]
        + [f"d{n}: a gradient in the fastformer model only" for n in extra],
    }


def real_tokens(src, tgt) -> int:
    """Tokens of a (src, tgt) batch that are not padding."""
    return int((src != PAD).sum() + (tgt != PAD).sum())


# Every variant's training step ends with the same optimizer: Adam through torch's fused kernel
# (`optimizer`). Its default, foreach, makes ~10 list ops a step over every parameter list, each
# launching kernels per chunk of tensors: 2.5 ms of host time a step against the fused kernel's
# 0.7 (CPU stand-in of the base model's 186 parameters, `benchmarks/host_time.py`, 2026-12-06),
# and the base model's step is host-bound on an H200.
OPTIMIZER = "Adam (lr 1e-4, torch's fused kernel)"


def optimizer(model: torch.nn.Module, graphed: bool = False) -> torch.optim.Adam:
    """The bench's optimizer of `model` (`OPTIMIZER`). graphed: capturable, its step state on
    the device, so that a CUDA graph captures the step. Parameters that torch's fused kernel does
    not take (not floating point, or on a device without it) get torch's default Adam."""
    params = list(model.parameters())
    fused = all(p.is_floating_point() and p.device.type in ("cuda", "cpu") for p in params)
    return torch.optim.Adam(params, lr=1e-4, capturable=graphed, fused=fused or None)


def training_step(loss_fn, opt, src, tgt):
    """One training step of `bench` (zero_grad, loss forward + backward, Adam step) as a
    function of nothing; the profiler and the pytest-benchmark suite time the same."""

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(src, tgt).backward()
        opt.step()

    return step


def _measure_variant(
    name, model, loss_fn, forward_fn, src, tgt, device, pacer, graphed: bool = False
) -> dict:
    """Train-step and inference timings, peak memory; the first call (compilation) apart.
    graphed: each step captured once in a CUDA graph and replayed (`_cuda_graph`)."""
    opt = optimizer(model, graphed)
    tgt_in = torch.cat([torch.full_like(tgt[:, :1], BOS), tgt[:, :-1]], dim=1)
    train_step = training_step(loss_fn, opt, src, tgt)

    def infer_step():
        with torch.no_grad():
            forward_fn(src, tgt_in)

    model.train()
    start = time.perf_counter()
    train_step()  # first call: compilation, autotuning, allocator warm-up
    if graphed:
        train_step = _cuda_graph(train_step)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    first_s = time.perf_counter() - start
    train_ms = timing.time_step(train_step, device, pacer.current())
    peak, method = timing.peak_memory(train_step, device)
    host = {}
    if device.type == "cuda":  # on CPU the host time is the step time
        host["train_host_ms"] = timing.host_time(train_step, device)
    model.eval()
    infer_step()
    if graphed:
        infer_step = _cuda_graph(infer_step)
    infer_ms = timing.time_step(infer_step, device, pacer.current())
    if device.type == "cuda":
        host["infer_host_ms"] = timing.host_time(infer_step, device)
    tokens = real_tokens(src, tgt)
    return {
        "train_step_ms": train_ms,
        "train_tokens_per_s": tokens / train_ms * 1e3,
        "infer_ms": infer_ms,
        "infer_tokens_per_s": tokens / infer_ms * 1e3,
        **host,
        "peak_memory_bytes": peak,
        "peak_memory_method": method,
        "first_step_s": first_s,
    }


def _cuda_graph(step):
    """`step` captured in a CUDA graph (PyTorch's whole-network capture): warm-up steps on a
    side stream, then one captured step; returns the graph's replay. A training step's
    zero_grad(set_to_none=True) inside the capture makes the captured backward allocate the
    gradients, which every replay then overwrites, and Adam (capturable) steps from them."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


NOT_RUN = "not run (past --max-seconds)"


# The eager model under torch.compile, two ways (CUDA). By default its layers (PyTorch's
# "regional compilation"): every encoder and decoder layer, the positional encoding and the
# loss, each compiled once and reused by the identical layers. The whole model as one graph
# (--full) took 66 s to compile a training step and ~18 s more for inference on the H200
# (2026-11-30), a third of the default run's 3-minute budget; compiling the layers took 27 s
# against 68 s for the whole model on the CI VM (CPU inductor, 6 + 6 layers).
COMPILE_LAYERS = "torch.compile-layers"
COMPILE_WHOLE = "torch.compile"
# With --full (CUDA): fastformer's model under torch.compile too. Its ops are custom ops that
# compile as single nodes, so this shows fastformer's kernels with compile's fusion and lower
# host time around them. Not in the default run: another minute of compilation.
FAST_COMPILED = FAST + "+compile"
# What each compiled variant compiles (stored with its results, printed under the table).
COMPILED = {
    COMPILE_LAYERS: "the eager model with each encoder and decoder layer, the positional "
    "encoding and the loss compiled (one compile per kind of layer)",
    COMPILE_WHOLE: "the whole eager model compiled as one graph",
    FAST_COMPILED: "the model after fastformer.swap compiled as one graph",
}
# With --full (CUDA): the eager and swapped models with each step (training: forward, backward
# and Adam; inference) captured once in a CUDA graph and replayed, which takes the host out of
# the step (the swapped model's step was host-bound on the H200: 22 ms of kernels in 64 ms).
GRAPHED = {
    "eager+cuda-graph": "the eager model, each step captured in a CUDA graph and replayed",
    FAST + "+cuda-graph": "the model after fastformer.swap, each step captured in a CUDA graph "
    "and replayed (dropout seeds drawn on the device)",
}
# The eager model with its encoder-decoder built of torch.nn modules (`torch_nn_twin`): what
# fastformer.swap replaces in a torch.nn user's model; the eager reference writes attention's
# softmax, masks and dropout out op by op, torch.nn runs SDPA's fused kernels.
TORCH_NN = "torch.nn"
NOTES = {
    TORCH_NN: "the same model and weights with torch.nn.Transformer as its encoder-decoder "
    "(SDPA's fused attention; PyTorch's fast path in inference)",
    **COMPILED,
    **GRAPHED,
}


def model_variants(eager, fast, swap_info: dict, device, full: bool) -> dict[str, Any]:
    """name -> model to measure, why it is not measured (a skip), or its record when
    fastformer.swap raised (an error, not a skip: exit 1). The compiled ones are copies."""
    variants: dict[str, Any] = {"eager": eager, TORCH_NN: torch_nn_twin(eager)}
    variants[FAST] = fast if fast is not None else {"error": swap_info["error"]}
    gpu_only = "not measured on CPU (GPU only)"
    for name in NOTES if full else [COMPILE_LAYERS]:
        model = fast if name.startswith(FAST) else eager
        if device.type != "cuda":
            variants[name] = gpu_only
        elif model is None:  # the same swap error: fastformer_errors lists it once
            variants[name] = {"error": swap_info["error"], "same_as": FAST}
        else:
            variants[name] = copy.deepcopy(model)
    return variants


def compiled_model(name: str, model) -> tuple[Any, Any]:
    """(training loss, forward) of `model` compiled as variant `name`: the whole model, or
    (COMPILE_LAYERS) its layers, positional encoding and loss in place."""
    # Static shapes, as the per-op peers (`static_compile`): a region that met two sizes (a
    # source and a target length) would compile its second with dynamic shapes.
    if name != COMPILE_LAYERS:
        return static_compile(model.loss), static_compile(model)
    from fastformer import reference as R

    regions = (R.TransformerEncoderLayer, R.TransformerDecoderLayer, R.PositionalEncoding)
    for module in model.modules():
        if isinstance(module, regions):
            module.compile(dynamic=False)
    cross_entropy = static_compile(torch.nn.functional.cross_entropy)

    def loss(src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        # model.loss with the compiled cross-entropy (the largest activation: tokens x vocab)
        logits = model(src, R.shift_right(tgt, model.bos_id))
        flat = logits.reshape(-1, logits.shape[-1])
        return cross_entropy(flat, tgt.reshape(-1), ignore_index=model.pad_id)

    return loss, model


def bench_model(
    case: C.ModelCase, device, dtype, pacer, save, progress_stream=None, full: bool = False
) -> dict:
    """Stage 1: eager reference vs fastformer.swap (vs its layers under torch.compile on CUDA;
    with `full`, also the whole eager and swapped models under torch.compile, and both with
    their steps in CUDA graphs). `save(out)` is called after every variant, so a run killed
    mid-stage keeps what it measured."""
    src, tgt = synthetic_batch(case, device)
    eager = build_model(case, device, dtype, case.dropout)
    fast, swap_info = swapped(eager)
    variants = model_variants(eager, fast, swap_info, device, full)
    bar = Progress("model", 1 + len(variants), progress_stream)
    out: dict[str, Any] = {
        "config": case.params(),
        "dtype": str(dtype).replace("torch.", ""),
        "tokens_per_batch": real_tokens(src, tgt),
        "padding_fraction": 1 - real_tokens(src, tgt) / (src.numel() + tgt.numel()),
        "swap": swap_info,
        "optimizer": OPTIMIZER,
        "variants": {},
    }
    if fast is not None:
        try:
            out["parity"] = model_parity(eager, fast, src, tgt)
        except Exception as exc:  # fastformer raised: a failure to report, not a crash
            error = f"{type(exc).__name__}: {exc}"
            out["parity"] = {"passed": False, "failed": [error], "error": error}
    else:
        out["parity"] = {"passed": None, "skipped": swap_info["error"]}
    bar.step("parity")
    for name, model in variants.items():
        if isinstance(model, str):
            out["variants"][name] = {"skipped": model}
        elif isinstance(model, dict):
            out["variants"][name] = model
        elif pacer.expired():
            out["variants"][name] = {"skipped": NOT_RUN}
        else:
            loss_fn, fwd_fn = model.loss, model
            if name in COMPILED:
                loss_fn, fwd_fn = compiled_model(name, model)
            try:
                with warnings.catch_warnings():
                    # torch.nn's inference fast path warns that its nested tensors are a
                    # prototype, once a process: noise in the job's output
                    warnings.filterwarnings("ignore", "The PyTorch API of nested tensors")
                    out["variants"][name] = _measure_variant(
                        name, model, loss_fn, fwd_fn, src, tgt, device, pacer, name in GRAPHED
                    )
                if name in NOTES:
                    out["variants"][name]["note"] = NOTES[name]
            except Exception as exc:  # report the failure, keep benchmarking the rest
                out["variants"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        save(out)
        bar.step(name)
    bar.close()
    return out


# --------------------------------------------------------------------------- ops stage


# Peers that legitimately refuse some cases (an SDPA backend without masks, Flex without
# dropout): their exceptions are "unsupported"; anyone else's is an error.
MAY_REFUSE = ("sdpa-", "flex")


def _measure_impl(name, fn, bench, mode, device, pacer) -> dict[str, Any]:
    """Time one implementation: {"ms", "first_call_s"}, or why it was not measured."""
    if isinstance(fn, str):
        return {"unsupported": fn}
    if pacer.expired():
        return {"not_run": NOT_RUN}
    call = runner(fn, bench.args, mode)
    try:
        # First call: compilation / autotuning, and any "not supported" error.
        start = time.perf_counter()
        call()
        first_s = time.perf_counter() - start
        # On CUDA, the memory each implementation needs beyond its inputs (saved tensors,
        # scores, ...), exactly by the allocator (CPU would need the profiler, so not there), on
        # a second call: the first one's autotuning allocates do_bench's 256 MB L2-flush buffer
        # (an H200 run read 322 MiB for fastformer's d64 forward, whose kernels need 66).
        peak = None
        if device.type == "cuda":
            peak = timing.peak_memory(call, device, above_start=True)[0]
        # CPU: one call for now; `_time_in_turns` times the row's implementations together.
        budget = pacer.current() if device.type == "cuda" else timing.MINIMAL
        ms = timing.time_op(call, device, budget)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {"error": "out of memory"}
    except Exception as exc:  # reported in the results, never fatal to the run
        kind = "unsupported" if name.startswith(MAY_REFUSE) else "error"
        first_line = (str(exc).splitlines() or [""])[0][:200]
        return {kind: f"{type(exc).__name__}: {first_line}"}
    result = {"ms": ms, "first_call_s": first_s}
    if peak is not None:
        result["peak_memory_bytes"] = peak
    if mode != "fwd" and not pacer.expired():
        saved = _saved_bytes_per_token(fn, bench)
        if saved is not None:
            result["saved_bytes_per_token"] = saved
    return result


def _saved_bytes_per_token(fn, bench) -> float | None:
    """timing.saved_bytes of one more call, per token; None where an implementation cannot run
    under saved-tensor hooks (a side figure: it never costs the timing already measured)."""
    try:
        return timing.saved_bytes(fn, bench.args) / max(bench.case.tokens, 1)
    except Exception:
        return None


def _time_in_turns(impls: dict[str, Any], bench, mode: str, pacer) -> None:
    """CPU: the implementations that ran, timed in turns (`timing.time_cpu_in_turns`), those
    medians replacing the one call `_measure_impl` timed. A CPU's state drifts between
    implementations timed one after the other (other processes, the allocator's pages,
    frequency); in turns each round sees the same. Past the run's stop, or where a call fails
    now, the one-call times stay."""
    names = [name for name, res in impls.items() if "ms" in res]
    if not names or pacer.expired():
        return
    calls = {name: runner(bench.impls[name], bench.args, mode) for name in names}
    try:
        times = timing.time_cpu_in_turns(calls, pacer.current())
    except Exception:  # measured once already: the run goes on with those times
        return
    for name, ms in times.items():
        impls[name]["ms"] = ms


def _derive(row: dict[str, Any], bench, mode: str, roof: dict[str, float]) -> None:
    """TFLOP/s or GB/s of every timed implementation, the speedup of fastformer over each
    peer, and fastformer's time as a fraction of the roofline floor."""
    flops = bench.flops(mode) if bench.flops else None
    nbytes = bench.bytes(mode) if bench.bytes else None
    row["flops"], row["bytes"] = flops, nbytes
    for res in row["impls"].values():
        if "ms" in res:
            if flops:
                res["tflops"] = flops / res["ms"] / 1e9
            if nbytes:
                res["gbps"] = nbytes / res["ms"] / 1e6
    fast = row["impls"].get(FAST, {})
    if "ms" not in fast:
        row["speedup"] = {}
        return
    row["speedup"] = {
        name: res["ms"] / fast["ms"]
        for name, res in row["impls"].items()
        if name != FAST and "ms" in res
    }
    floor_ms = max(
        (flops or 0) / (roof["gemm_tflops"] * 1e9), (nbytes or 0) / (roof["copy_gbps"] * 1e6)
    )
    row["roofline_floor_ms"] = floor_ms
    row["fraction_of_roofline"] = floor_ms / fast["ms"]
    if nbytes:
        row["fraction_of_copy_bandwidth"] = fast["gbps"] / roof["copy_gbps"]


def _same_size_copy(row: dict[str, Any], device: torch.device, pacer) -> None:
    """A bandwidth-bound row (bytes, no FLOPs: LayerNorm) against its floor at its own size:
    one device copy moving the row's bytes, half read and half written, timed as the
    implementations are. The rooflines' copy rate is a 2 GiB copy's; a row of a few MB pays a
    launch and a ramp that it leaves out."""
    fast = row["impls"].get(FAST, {})
    if row.get("flops") or not row.get("bytes") or "ms" not in fast or pacer.expired():
        return
    try:
        copy_ms = _copy_ms(int(row["bytes"]) // 8, device, pacer.current())
    except torch.OutOfMemoryError:
        return
    row["same_size_copy_ms"] = copy_ms
    row["fraction_of_same_size_copy"] = copy_ms / fast["ms"]


def _backward_row(rows: list[dict[str, Any]], bench, roof: dict[str, float]) -> dict[str, Any]:
    """The backward alone, derived from a case's fwd and fwd+bwd rows (the last two): each
    implementation's fwd+bwd time less its fwd time, so peers are compared on the same terms."""
    fwd, both = rows[-2], rows[-1]
    impls: dict[str, Any] = {}
    for name, res in both["impls"].items():
        before = fwd["impls"].get(name, {})
        if "ms" in res and "ms" in before and res["ms"] > before["ms"]:
            impls[name] = {"ms": res["ms"] - before["ms"], "derived": "fwd+bwd - fwd"}
        elif "ms" in res and "ms" in before:  # timing noise on a tiny backward
            impls[name] = {"unsupported": "bwd not derived: fwd+bwd timed no slower than fwd"}
        elif "ms" in res:  # copied, fwd+bwd's time passed for the backward's
            impls[name] = {"unsupported": "bwd not derived: fwd was not measured"}
        else:  # fwd+bwd's reason or error, copied
            impls[name] = {k: v for k, v in res.items() if k != "first_call_s"}
            if "error" in res:  # raised by fwd+bwd: listed once (fastformer_errors), not twice
                impls[name]["same_as"] = "fwd+bwd"
    if "backend" in both["impls"].get(FAST, {}) and "ms" in impls.get(FAST, {}):
        impls[FAST]["backend"] = both["impls"][FAST]["backend"]
    row = {"case": both["case"], "mode": "bwd", "params": both["params"], "impls": impls}
    _derive(row, bench, "bwd", roof)
    return row


# Peers of the GPU grids that the default grid leaves out, and why (`--full` and the
# benchmark suites time them).
DEFAULT_LEFT_OUT = {
    "attention": {
        "torch.compile": "not in the default grid (--full times it): the eager reference "
        "compiled, where FlexAttention is torch.compile's attention; its compiles took 35 s of "
        "the default bench's 3 minutes (H200, 2026-12-04)",
    },
}


def bench_op(
    op, device, dtype, quick, pacer, roof, save, progress_stream=None, only=None, full=False
) -> dict[str, Any]:
    """Stage 2: every case of `op` in its default grid (the full grid with `full`; or those whose
    name contains a text of `only`), forward and forward + backward, every implementation;
    `save(out)` after every case."""
    op_cases = C.OP_CASES[op](device.type, quick, full=full)
    if only:
        op_cases = [c for c in op_cases if any(text in c.name for text in only)]
    bar = Progress(op, len(op_cases) * len(C.MODES), progress_stream)
    rows: list[dict[str, Any]] = []
    out = {"cases": rows}
    for case in op_cases:
        bench = BUILDERS[op](case, device, dtype)
        left_out = {} if full else DEFAULT_LEFT_OUT.get(op, {})
        bench.impls.update({name: why for name, why in left_out.items() if name in bench.impls})
        for mode in C.MODES:
            row: dict[str, Any] = {"case": case.name, "mode": mode, "params": case.params()}
            row["impls"] = {
                name: _measure_impl(name, fn, bench, mode, device, pacer)
                for name, fn in bench.impls.items()
            }
            if device.type == "cpu":
                _time_in_turns(row["impls"], bench, mode, pacer)
            if bench.backend and "ms" in row["impls"].get(FAST, {}):
                row["impls"][FAST]["backend"] = bench.backend
            _derive(row, bench, mode, roof)
            _same_size_copy(row, device, pacer)
            rows.append(row)
            bar.step(f"{case.name} {mode}")
        if op in C.DERIVED_BWD_OPS:
            rows.append(_backward_row(rows, bench, roof))
        del bench
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save(out)
    bar.close()
    return out


def attention_tuning() -> list[dict[str, Any]]:
    """What the attention autotuner chose for each key so far, with each candidate's time
    (empty where the kernels never tuned: no GPU, or no attention call yet)."""
    kernels = sys.modules.get("fastformer.kernels.attention")
    return [dict(entry) for entry in getattr(kernels, "TUNING_LOG", [])]


def op_backends() -> dict[str, Any]:
    """Which backend each op dispatches to by default here (as `info` reports it)."""
    from fastformer.cli.info import op_backends as backends

    return backends()


# --------------------------------------------------------------------------- command


class Interrupted(KeyboardInterrupt):
    """Ctrl-C after `measure` wrote the partial results.json (an interrupt before its stages,
    while it reads the environment or measures the rooflines, saves nothing)."""


# Measured after the other ops, whatever --ops says (the report keeps its order): attention's
# peers compile for each case, so its grid takes ~5x the C++ ops' time, and a time limit that
# falls in it cuts its last cases rather than whole ops. On the H200 (2026-12-04) the attention
# grid ran past --max-seconds 170 and the LayerNorm and FFN grids measured nothing.
RUN_LAST = ("attention",)


def _pacer(budget, device, args, start: float) -> tuple[timing.Pacer, float | None]:
    """The run's pacer and its soft limit in seconds: repetitions are cut after DEADLINE_S (the
    default grid's 3-minute target; not with --full) or 70% of --max-seconds, if sooner; nothing
    new is measured after --max-seconds."""
    limit = None if getattr(args, "full", False) else DEADLINE_S.get(device.type)
    if args.max_seconds is not None:
        limit = 0.7 * args.max_seconds if limit is None else min(limit, 0.7 * args.max_seconds)
    if args.quick:
        limit = None
    stop = None if args.max_seconds is None else start + args.max_seconds
    return timing.Pacer(budget, None if limit is None else start + limit, stop), limit


def measure(
    args: argparse.Namespace,
    out_dir: Path,
    argv: list[str] | None = None,
    malloc: str | None = None,
) -> dict[str, Any]:
    """Run every stage, writing results.json after each one (a killed run keeps its data).
    `malloc`: how the CPU allocator was set for the run (`timing.keep_freed_pages`), recorded."""
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    ops = parse_ops(args.ops)
    budget = budget_for(device, args.quick)
    full = _full(args)
    only = parse_cases(args.cases, ops, device, args.quick, full)
    case, reduced = C.model_case(args.model, device.type)
    notes = [reduced] if reduced and not args.no_model else []
    if device.type == "cpu":
        notes.append(
            "CPU-only machine: reduced per-op grid (see cases.py); no torch.compile, SDPA backend or FlexAttention peers"
        )
    results: dict[str, Any] = {
        "schema": report.SCHEMA,
        "manifest": env.manifest(),
        "config": {
            **_settings(args),
            "ops": ops,
            "reduced": bool(notes),
            "notes": notes,
            "argv": list(argv) if argv is not None else sys.argv[1:],
            "malloc": malloc,
        },
        "backends": op_backends(),
        "ops": {},
        # Until the run ends: a run killed (SIGTERM, `timeout`) between two saves left a file
        # that read as complete.
        "partial": True,
    }
    start = time.perf_counter()
    pacer, limit = _pacer(budget, device, args, start)
    results["rooflines"] = rooflines(device, dtype, budget)

    def saver(*keys: str):
        def save(part: dict[str, Any]) -> None:
            parent = results
            for key in keys[:-1]:
                parent = parent[key]
            parent[keys[-1]] = part
            tuning = attention_tuning()
            if tuning:
                results["tuning"] = {"attention": tuning}
            report.write_json(out_dir, results)

        return save

    try:
        if not args.no_model:
            bench_model(case, device, dtype, pacer, saver("model"), full=full)
        for op in sorted(ops, key=RUN_LAST.__contains__):
            save = saver("ops", op)
            roof = results["rooflines"]
            bench_op(op, device, dtype, args.quick, pacer, roof, save, only=only, full=full)
    except KeyboardInterrupt as exc:  # keep what was measured, marked as partial
        notes.append("interrupted: the stages after the last one written were not measured")
        report.write_json(out_dir, results)
        raise Interrupted from exc
    results["ops"] = {op: results["ops"][op] for op in ops if op in results["ops"]}
    if pacer.cut:
        notes.append(f"time limit: measurements after {limit:g} s were cut to one repetition")
    if pacer.expired():
        notes.append(f"time limit: nothing new was measured after {args.max_seconds:g} s")
    results["wall_s"] = time.perf_counter() - start
    results["partial"] = False
    return results


def _check_args(args: argparse.Namespace) -> None:
    """The option values `bench` can check without measuring (UsageError: exit 2)."""
    if args.fail_if_slower is not None and not args.compare:
        raise UsageError("--fail-if-slower needs --compare OLD/results.json")
    pct = args.fail_if_slower
    if pct is not None and not (math.isfinite(pct) and pct >= 0):
        raise UsageError(f"--fail-if-slower must be a finite percentage >= 0, got {pct}")
    cap = MAX_THREADS_PER_CPU * (os.cpu_count() or 1)
    if args.threads is not None and not 1 <= args.threads <= cap:
        raise UsageError(
            f"--threads must be between 1 and {cap} ({MAX_THREADS_PER_CPU} per CPU of this "
            f"machine), got {args.threads}"
        )
    if args.max_seconds is not None and not args.max_seconds > 0:
        raise UsageError(f"--max-seconds must be > 0, got {args.max_seconds}")
    if not parse_ops(args.ops) and args.no_model:
        raise UsageError("--no-model with no --ops: nothing to measure")
    if args.results:
        given = [f"--{name.replace('_', '-')}" for name in _MEASURING if _given(args, name)]
        if given:
            raise UsageError(f"--results re-renders a run without measuring: {given} do nothing")
    if args.no_model and _given(args, "model"):
        raise UsageError(f"--no-model skips the model stage: --model {args.model} does nothing")
    if args.out == "":  # Path("") is the current folder; "" read as no --out at all
        raise UsageError("--out '': expected a folder (omit --out for bench-results/<timestamp>)")


# The options that only shape a measurement, with their defaults (False / None otherwise).
_MEASURING = (
    "model", "ops", "dtype", "device", "quick", "full", "threads", "no_model", "cases",
    "max_seconds",
)  # fmt: skip
_MEASURING_DEFAULTS = {"model": "base", "ops": ",".join(C.OPS), "dtype": "auto", "device": "auto"}


def _given(args: argparse.Namespace, name: str) -> bool:
    return getattr(args, name) not in (_MEASURING_DEFAULTS.get(name), None, False)


def _out_dir(text: str | None, compare: str | None = None) -> tuple[Path, bool]:
    """--out (default bench-results/<timestamp>) and whether it was created now: a path that
    cannot be a folder, or one that cannot be written, fails before anything is measured."""
    out = Path(text) if text else default_out_dir()
    if compare and (out / report.RESULTS_JSON).resolve() == Path(compare).resolve():
        # the first save would overwrite the baseline, before anything was compared
        raise UsageError(
            f"--out {str(out)!r} holds the --compare file {compare!r}, which this run would "
            "overwrite; expected another folder"
        )
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".bench-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"--out {str(out)!r}: cannot write there ({exc})") from exc
    # A folder named like an output file crashed the run late (IsADirectoryError after
    # measuring; at the first save for results.json.tmp).
    for name in report.output_names(list(C.OPS)):
        path = out / name
        if path.exists() and not path.is_file():
            kind = "a folder" if path.is_dir() else "not a regular file"
            raise UsageError(f"--out {str(out)!r}: {name} there is {kind}")
    return out, created


def _results(args: argparse.Namespace, out_dir: Path, argv: list[str] | None) -> dict | None:
    """--results loaded, or a new measurement (None when interrupted)."""
    if args.results:
        return _load(args.results, "--results", complete=True)
    threads = torch.get_num_threads()
    # Only in its own process (`python -m fastformer bench`: argv None): the setting is
    # process-wide and cannot be undone, and in-process callers (the tests) keep their malloc.
    malloc = None
    if argv is None and resolve_device(args.device).type == "cpu":
        malloc = timing.keep_freed_pages()
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        return measure(args, out_dir, argv, malloc=malloc)
    except KeyboardInterrupt as exc:
        _say_interrupted(out_dir, saved=isinstance(exc, Interrupted))
        return None
    finally:  # main() may run in-process (tests): leave torch as it was
        torch.set_num_threads(threads)


def _load(text: str, option: str, complete: bool = False) -> dict[str, Any]:
    """report.load, with a warning when the file is a partial run (its gaps are no change)."""
    data = report.load(Path(text), option, complete=complete)
    note = report.partial_note(data, f"{option} {text!r}")
    if note:
        print(f"bench: {note}", file=sys.stderr)
    return data


def _remove_stale_plots(out_dir: Path, written: list[Path]) -> None:
    """Delete the plots of an earlier run in a re-used --out folder that this run did not write
    (another op's, the model's): they read as this run's. Only bench's own file names, and only
    in a folder that held a results.json (a user's own model.png elsewhere is not bench's)."""
    for name in report.output_names(list(C.OPS)):
        path = out_dir / name
        if path.suffix == ".png" and path not in written and path.is_file():
            path.unlink()


def _say_interrupted(out_dir: Path, saved: bool) -> None:
    """Where the partial results are, or that nothing was saved: it said "partial results in"
    an empty folder, or one holding an earlier run's results.json."""
    if saved:
        text = f"partial results in {out_dir}"
    else:
        earlier = (out_dir / "results.json").exists()
        text = f"nothing was measured or saved in {out_dir}" + (
            " (its results.json is an earlier run's)" if earlier else ""
        )
    print(f"\nbench: interrupted; {text}", file=sys.stderr)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """What a run measures, as results.json's config records it (and --compare compares)."""
    device = resolve_device(args.device)
    return {
        "model": None if args.no_model else args.model,
        "dtype": str(resolve_dtype(args.dtype, device)).replace("torch.", ""),
        "device": str(device),
        "quick": args.quick,
        "full": _full(args),
    }


def _full(args: argparse.Namespace) -> bool:
    """--full as measured: --quick wins (its grid and model variants are the same either way)."""
    return args.full and not args.quick


def _check_comparable(args: argparse.Namespace, old: dict) -> None:
    """UsageError, before measuring, when --compare's run had other settings than this one
    will (or than --results' run): their figures would measure different things."""
    if args.results:
        new = report.load(Path(args.results), "--results", complete=True)
    else:
        config = _settings(args)
        gpus = env.gpus()
        gpu = gpus[0]["name"] if gpus else None
        new = {
            "config": config,
            "manifest": {"gpu": gpu, "triton_interpret": env.triton_interpret()},
        }
    diffs = report.incomparable(old, new)
    if diffs:
        raise UsageError(
            f"--compare {args.compare!r} ran with other settings ({'; '.join(diffs)}): its "
            "figures measure something else"
        )


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Measure (or load --results), write results.json + report.md + plots, print the table,
    compare with --compare. Exit 1 when fastformer raised, on a model parity failure, when
    nothing was measured, or when --fail-if-slower fails (results are written in every case)."""
    _check_args(args)
    if args.results is None:  # --results measures nothing: no setting matters
        check_settings()
    if importlib.util.find_spec("matplotlib") is None:  # the plots come after the measuring
        raise UsageError("bench writes PNG plots with matplotlib, which is not installed")
    # Every file argument is checked before anything is measured (minutes on a GPU).
    old = _load(args.compare, "--compare") if args.compare else None
    if old is not None:
        _check_comparable(args, old)
    out_dir, created = _out_dir(args.out, args.compare)
    # A folder an earlier bench run wrote (its results.json): only there are plots stale.
    rerun = (out_dir / report.RESULTS_JSON).is_file()
    try:
        results = _results(args, out_dir, argv)
    except UsageError:  # found while measuring (a case filter that matches nothing, ...)
        if created and not any(out_dir.iterdir()):
            out_dir.rmdir()  # leave no empty folder behind
        raise
    if results is None:
        return 130
    paths = report.write_all(out_dir, results)
    if rerun:
        _remove_stale_plots(out_dir, paths)
    print(report.terminal_table(results))
    print(f"\nwrote {', '.join(str(p) for p in paths)}")
    code = _failures(results)
    if old is not None:
        code = max(code, _compared(args, old, results))
    return code


def _failures(results: dict[str, Any]) -> int:
    """1, each cause on stderr, when fastformer raised, the model parity failed, or nothing was
    measured (`check` fails a run that checked nothing too); else 0."""
    code = 0
    errors = report.fastformer_errors(results)
    if errors:
        print("bench: fastformer raised:\n  " + "\n  ".join(errors), file=sys.stderr)
        code = 1
    parity = results.get("model", {}).get("parity", {})
    if parity.get("passed") is False:
        print("bench: model parity FAILED:\n  " + "\n  ".join(parity["failed"]), file=sys.stderr)
        code = 1
    nothing = report.nothing_measured(results)
    if nothing:
        print(f"bench: {nothing}", file=sys.stderr)
        code = 1
    return code


def _compared(args: argparse.Namespace, old: dict, results: dict[str, Any]) -> int:
    """Print the change of every figure since --compare's run, and fastformer's figures that
    have no counterpart; 1 when --fail-if-slower fails."""
    changes = report.compare(old, results)
    lone = report.unpaired(old, results)
    print("\n" + report.format_changes(changes, args.fail_if_slower))
    if lone:
        print(report.format_unpaired(lone))
    if args.fail_if_slower is None:
        return 0
    return _judged(args, changes, [u for u in lone if u.lost])


def _judged(args: argparse.Namespace, changes: list, lost: list) -> int:
    """--fail-if-slower's verdict: 1 on a regression, on a figure of the old run without a
    valid new one (its change is unknown), or when nothing of fastformer's was compared."""
    code = 0
    if not any(c.own for c in changes):  # a regression check that checked nothing
        print(
            f"bench: --fail-if-slower: no figure of fastformer's in common with "
            f"{args.compare}: nothing was compared",
            file=sys.stderr,
        )
        code = 1
    if lost:
        print(
            f"bench: --fail-if-slower: {len(lost)} fastformer figure(s) of {args.compare} have "
            "no valid figure in this run (missing, null or 0): their change is unknown",
            file=sys.stderr,
        )
        code = 1
    slower = report.regressions(changes, args.fail_if_slower)
    if slower:
        print(
            f"bench: {len(slower)} figure(s) of fastformer slower by more than "
            f"{args.fail_if_slower:g}%",
            file=sys.stderr,
        )
        code = 1
    return code
