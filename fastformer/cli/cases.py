"""Benchmark case definitions shared by `python -m fastformer bench` and benchmarks/*.py.

GPU cases follow the issue texts. The full grid (`bench --full`, and the pytest-benchmark suites
benchmarks/bench_*.py) is attention: head dim 64/128, causal or not, seq 512..16384 with
batch*seq = 16384 and heads*dim = 2048, plus key padding 25% and dropout 0.1 (30 cases);
layer_norm: 16384 rows, hidden 512..16384, plus dropout + residual add at 512 and 1024 (8);
ffn: 16384 tokens, 512->2048 and 4096->16384, dropout 0/0.1 (4).

The default GPU grid is a representative subset of it, because the default `bench` (the base
model, then every op against every peer) must finish within 3 minutes on one H100/H200. On an
H200 (benchmarks/results/h200-2026-11-29/run1) the model stage took 77 s (60 s of it
torch.compile); an attention case (both modes, 8 peers) cost 10-29 s when it brought a new mask
kind or a new shape (torch.compile and FlexAttention recompile, Triton autotunes) and 4-10 s
otherwise, so the full attention grid measured 7 of its 30 cases (14 of 60 case-modes) in
100 s; the 16 layer_norm case-modes took 36 s and the 8 ffn ones 17 s. On 2026-11-30 the
default run's model stage took 134 s (the whole model under torch.compile 91 s; fastformer's
first step 26 s, in which Triton compiles and times 20 attention candidates one by one) and
left the ops 36 s: 2 attention cases. Since, the default compiles the eager model's layers
instead of the whole model (--full keeps that) and attention compiles a key's candidates at once
(bench.py, kernels/attention.py); the H200 run of 2026-11-30 (s8) took 150 s for the whole
default bench. The default keeps one case of each
kind that the model runs or that tells the kernels apart (12 cases):
- attention (5): d64 s2048 and s8192 non-causal, d64 s2048 causal, d64 s2048 causal + padding
  25% + dropout 0.1 (the decoder's self-attention in training), d128 s2048 non-causal;
- layer_norm (4): hidden 1024, 4096, 16384, and dropout + residual add at 1024;
- ffn (3): 512->2048 at dropout 0 and 0.1, 4096->16384 at dropout 0.
On that grid attention's torch.compile peer is left out (bench.DEFAULT_LEFT_OUT): its compiles
took 35 s of the default bench on the 12-04 H200 run; --full and the suites time it.

A CPU-only machine gets a reduced grid sized to finish the default `bench` within minutes on
two cores, the same with or without `full`. `quick` (2 cases an op, on a GPU a subset of the
default grid) is smaller still and wins over `full`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from fastformer.cli.errors import UsageError
from fastformer.reference import GATED_ACTIVATIONS

MODES = ("fwd", "fwd+bwd")  # measured; attention also reports "bwd" = fwd+bwd - fwd
DERIVED_BWD_OPS = ("attention",)


@dataclass(frozen=True)
class ModelCase:
    """A Transformer configuration plus its synthetic batch (sentences, max tokens each)."""

    name: str
    d_model: int
    nhead: int
    num_encoder_layers: int
    num_decoder_layers: int
    dim_feedforward: int
    dropout: float
    vocab: int
    batch: int
    max_len: int

    def params(self) -> dict[str, Any]:
        """The case as a JSON-serialisable dict (stored with every result)."""
        return asdict(self)


MODELS = {
    # "Attention Is All You Need", Table 3: base and big; shared 32k (37k in the paper) BPE
    # vocabulary. A batch of 64 sentences of up to 256 tokens is ~12k real tokens per side.
    "base": ModelCase("base", 512, 8, 6, 6, 2048, 0.1, 32000, batch=64, max_len=256),
    "big": ModelCase("big", 1024, 16, 6, 6, 4096, 0.3, 32000, batch=32, max_len=256),
    "tiny": ModelCase("tiny", 64, 4, 1, 1, 128, 0.1, 1000, batch=4, max_len=16),
}

# CPU-only machines: the same widths (so the per-layer shapes stay those of the model) but
# fewer layers, a smaller vocabulary and a small batch, to finish in about a minute on 2 cores.
CPU_REDUCTION = {
    "base": dict(num_encoder_layers=1, num_decoder_layers=1, vocab=8000, batch=4, max_len=64),
    "big": dict(num_encoder_layers=1, num_decoder_layers=1, vocab=8000, batch=2, max_len=48),
    "tiny": {},
}


def model_case(name: str, device_type: str) -> tuple[ModelCase, str | None]:
    """The model to benchmark and, when it was reduced for a CPU-only machine, why and how."""
    if name not in MODELS:
        raise UsageError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    case = MODELS[name]
    change = CPU_REDUCTION[name] if device_type == "cpu" else {}
    if not change:
        return case, None
    reduced = replace(case, **change)
    what = ", ".join(f"{k} {getattr(case, k)} -> {v}" for k, v in change.items())
    return reduced, f"CPU-only machine: reduced size of the {name} model ({what})"


@dataclass(frozen=True)
class AttentionCase:
    """Self-attention (batch, heads, seq, head_dim), optional causal / key padding / dropout."""

    batch: int
    heads: int
    seq: int
    head_dim: int
    causal: bool = False
    padding: float = 0.0  # fraction of keys that are padding (same in every batch row)
    dropout_p: float = 0.0

    @property
    def name(self) -> str:
        """Short unique label, used in tables, plots and figure keys."""
        name = f"b{self.batch}h{self.heads}s{self.seq}d{self.head_dim}"
        name += "-causal" if self.causal else ""
        name += f"-pad{round(self.padding * 100)}" if self.padding else ""
        return name + (f"-drop{self.dropout_p:g}" if self.dropout_p else "")

    @property
    def tokens(self) -> int:
        """Query positions (batch x seq): what saved bytes are counted per."""
        return self.batch * self.seq

    @property
    def sweep(self) -> bool:
        """Part of the sequence-length sweep (plotted as TFLOP/s against seq)."""
        return not self.padding and not self.dropout_p

    def flops(self, mode: str) -> float:
        """4*B*H*Sq*Sk*D forward, x0.5 causal; backward ("bwd") 2.5x forward."""
        fwd = 4.0 * self.batch * self.heads * self.seq * self.seq * self.head_dim
        fwd *= 0.5 if self.causal else 1.0
        return fwd * {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[mode]

    def bytes(self, mode: str, elem: int) -> float:
        """Minimum traffic: fwd reads q, k, v and writes o; bwd reads q, k, v, o, do and
        writes dq, dk, dv."""
        unit = self.batch * self.heads * self.seq * self.head_dim * elem
        return unit * {"fwd": 4, "bwd": 8, "fwd+bwd": 12}[mode]

    def score_bytes(self, elem: int) -> int:
        """Size of one (B, H, S, S) score matrix: what eager/math implementations materialise."""
        return self.batch * self.heads * self.seq * self.seq * elem

    def params(self) -> dict[str, Any]:
        """The case as a JSON-serialisable dict (stored with every result)."""
        return asdict(self)


@dataclass(frozen=True)
class LayerNormCase:
    """LayerNorm over `hidden` of `rows` rows; `fused` = dropout + residual add + LayerNorm."""

    rows: int
    hidden: int
    fused: bool = False
    dropout_p: float = 0.0

    @property
    def name(self) -> str:
        """Short unique label, used in tables, plots and figure keys."""
        base = f"r{self.rows}n{self.hidden}"
        return base + (f"-add-drop{self.dropout_p:g}" if self.fused else "")

    @property
    def tokens(self) -> int:
        """Rows: what saved bytes are counted per."""
        return self.rows

    def bytes(self, mode: str, elem: int) -> float:
        """Minimum traffic: fwd (timed without grad) reads x (and residual) and writes y. With a
        backward, the plain op's reads x and dy and writes dx; the fused forward also writes
        pre = residual + dropout(x), which its backward reads with dy to write the gradients of
        x and the residual (8 tensors; 7 under-counted its GB/s by 1/8). Weights and row
        statistics are negligible."""
        fwd = 3 if self.fused else 2
        n = self.rows * self.hidden * elem
        if mode == "fwd":
            return n * fwd
        return n * (fwd + 1 + 4 if self.fused else fwd + 3)

    def params(self) -> dict[str, Any]:
        """The case as a JSON-serialisable dict (stored with every result)."""
        return asdict(self)


@dataclass(frozen=True)
class FfnCase:
    """Position-wise FFN on `tokens` tokens: d_model -> d_ff -> d_model."""

    tokens: int
    d_model: int
    d_ff: int
    activation: str = "relu"
    dropout_p: float = 0.0

    @property
    def name(self) -> str:
        """Short unique label, used in tables, plots and figure keys."""
        name = f"t{self.tokens}-{self.d_model}x{self.d_ff}-{self.activation}"
        return name + (f"-drop{self.dropout_p:g}" if self.dropout_p else "")

    @property
    def width1(self) -> int:
        """linear1's output width: 2 * d_ff for the gated activations (both halves)."""
        return self.d_ff * (2 if self.activation in GATED_ACTIVATIONS else 1)

    def flops(self, mode: str) -> float:
        """Two GEMMs forward (2*T*d*width1 and 2*T*dff*d); backward is twice the forward."""
        fwd = 2.0 * self.tokens * self.d_model * (self.width1 + self.d_ff)
        return fwd if mode == "fwd" else 3.0 * fwd

    def bytes(self, mode: str, elem: int) -> float:
        """Minimum traffic: x, the output and both weights, once each way."""
        weights = self.d_model * (self.width1 + self.d_ff)
        unit = (2 * self.tokens * self.d_model + weights) * elem
        return unit if mode == "fwd" else 3 * unit

    def params(self) -> dict[str, Any]:
        """The case as a JSON-serialisable dict (stored with every result)."""
        return asdict(self)


def _attention_sweep(seqs, dims, tokens: int, width: int) -> list[AttentionCase]:
    return [
        AttentionCase(tokens // s, width // d, s, d, causal)
        for d in dims
        for causal in (False, True)
        for s in seqs
    ]


def attention_cases(device_type: str, quick: bool, full: bool = False) -> list[AttentionCase]:
    """GPU: batch*seq = 16384, heads*dim = 2048 (the default grid: 5 of the full grid's 30
    cases); CPU: batch*seq = 1024, heads*dim = 256."""
    if device_type == "cuda":
        default = [
            AttentionCase(8, 32, 2048, 64),
            AttentionCase(2, 32, 8192, 64),
            AttentionCase(8, 32, 2048, 64, causal=True),
            AttentionCase(8, 16, 2048, 128),
            AttentionCase(8, 32, 2048, 64, causal=True, padding=0.25, dropout_p=0.1),
        ]
        if quick:
            return [default[0], default[-1]]
        if not full:
            return default
        seqs, dims = (512, 1024, 2048, 4096, 8192, 16384), (64, 128)
        # Key padding 25% and dropout 0.1 at seq 2048, apart and together with causal (the
        # decoder's self-attention in training).
        extra = [
            AttentionCase(8, 2048 // d, 2048, d, causal=c, padding=pad, dropout_p=p)
            for d in dims
            for c, pad, p in ((False, 0.25, 0.0), (False, 0.0, 0.1), (True, 0.25, 0.1))
        ]
        return _attention_sweep(seqs, dims, 16384, 2048) + extra
    if quick:
        return [AttentionCase(2, 2, 64, 32), AttentionCase(2, 2, 64, 32, causal=True)]
    extra = [
        AttentionCase(2, 4, 256, 64, padding=0.25),
        AttentionCase(2, 4, 256, 64, dropout_p=0.1),
    ]
    return _attention_sweep((128, 256, 512), (64,), 1024, 256) + extra


def layer_norm_cases(device_type: str, quick: bool, full: bool = False) -> list[LayerNormCase]:
    """GPU: 16384 rows, hidden 512..16384 (the default grid: 4 of the full grid's 8 cases);
    CPU: 4096 rows, hidden 256..4096."""
    if device_type == "cuda":
        rows = 16384
        fused_1024 = LayerNormCase(rows, 1024, fused=True, dropout_p=0.1)
        if quick:
            return [LayerNormCase(rows, 1024), fused_1024]
        if not full:
            return [*(LayerNormCase(rows, h) for h in (1024, 4096, 16384)), fused_1024]
        hidden = (512, 1024, 2048, 4096, 8192, 16384)
    elif quick:
        return [LayerNormCase(256, 256), LayerNormCase(256, 256, fused=True, dropout_p=0.1)]
    else:
        hidden, rows = (256, 1024, 4096), 4096
    fused = [LayerNormCase(rows, h, fused=True, dropout_p=0.1) for h in hidden[:2]]
    return [LayerNormCase(rows, h) for h in hidden] + fused


def ffn_cases(device_type: str, quick: bool, full: bool = False) -> list[FfnCase]:
    """GPU: 16384 tokens, 512->2048 and 4096->16384, dropout 0 and 0.1 (the default grid: 3 of
    the full grid's 4 cases, no dropout at 4096->16384); CPU: 512 tokens."""
    if device_type == "cuda":
        small = [FfnCase(16384, 512, 2048, dropout_p=p) for p in (0.0, 0.1)]
        if quick:
            return small
        if not full:
            return small + [FfnCase(16384, 4096, 16384)]
        shapes = ((512, 2048), (4096, 16384))
        return [FfnCase(16384, d, f, dropout_p=p) for d, f in shapes for p in (0.0, 0.1)]
    if quick:
        return [FfnCase(64, 64, 256), FfnCase(64, 64, 256, dropout_p=0.1)]
    return [FfnCase(512, 512, 2048, dropout_p=p) for p in (0.0, 0.1)]


OP_CASES = {"attention": attention_cases, "layer_norm": layer_norm_cases, "ffn": ffn_cases}
OPS = tuple(OP_CASES)
