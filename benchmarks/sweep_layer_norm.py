"""LayerNorm's CUDA launch configurations measured against each other, on a GPU.

The issue's targets (forward >= 85%, backward >= 75% of the device copy bandwidth, bf16, 16384
rows) were missed on the H200 (12-04 sweep: forward 48-78%, backward 47-75%) with the built-in
choice of vectors a thread and threads a block. For each hidden size this times the forward and the
backward kernels with every override of that choice (torch.ops.fastformer.layer_norm_tuning:
the most 16-byte vectors a thread holds, the threads a block), next to the built-in one, as
GB/s and the fraction of the copy bandwidth measured in the same run. The forward kinds are
also timed staged (stage 2: each row copied to shared memory with cp.async while the row before
it is worked on, on a persistent grid; not yet the built-in choice), with the built-in vectors
and block and with each override of 4 vectors, and read in a loop (stage 4: re-read from L2 for
the statistics and the output, fewer registers; not yet the built-in choice either) with the
built-in block and with 128 and 256 threads; the unfused backward with the built-in vectors
and block, one row ahead (stage 2) and two (stage 3). Which configuration runs
is the C++ choice given the override (rows too long for the vectors asked for take the long-row
kernels). The backward is timed as its op alone (kernel and finalize, no autograd). "fused" is
the forward of dropout_add_layer_norm (dropout 0.1, the residual added, pre stored as for
training), which takes the forward's overrides; "prenorm_bwd" its backward in a Pre-LN stack
(the gradient of pre comes in too), which takes the backward's. Those two at FUSED_COLS only,
to keep the sweep within its ~45 s in the GPU suite; the JSON is rewritten after each size.

    python benchmarks/sweep_layer_norm.py [--cols 1024,4096] [--out sweep.json]

Exit status 2 without a GPU or without the CUDA kernels.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

FWD = [(v, b) for v in (1, 2, 4) for b in (64, 128, 256, 512)]
BWD = [(v, b) for v in (1, 2, 4) for b in (128, 256, 512)]
REGISTERS, STAGED, DEEP, LOOP = 1, 2, 3, 4  # layer_norm_tuning's stage (0: built-in)
LOOP_BLOCKS = (0, 128, 256)  # the looped forward's blocks: built-in, then threads a row
COLS = (512, 1024, 2048, 4096, 8192, 16384)
FUSED_COLS = (1024, 4096)  # the bench's fused case, and a size with a block a row
KINDS = ("fwd", "bwd", "fused", "prenorm_bwd")
ROWS = 16384


def _available() -> str | None:
    """Why the sweep cannot run here, or None."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    import fastformer  # noqa: F401  (loads fastformer._C)

    if not hasattr(torch.ops.fastformer, "layer_norm_tuning"):
        return "fastformer._C was built without its CUDA kernels"
    return None


def _time_ms(fn) -> float:
    from fastformer.cli import timing

    return timing.time_op(fn, torch.device("cuda"), timing.GPU_DEFAULT)


def _calls(cols: int, dtype: torch.dtype):
    """{kind: call} of a (ROWS, cols) LayerNorm: the C++ ops on fixed inputs."""
    x, dy, res = (torch.randn(ROWS, cols, device="cuda", dtype=dtype) for _ in range(3))
    w, b = (torch.randn(cols, device="cuda", dtype=dtype) for _ in range(2))
    seed = torch.zeros((), dtype=torch.int64)
    ops = torch.ops.fastformer
    _, _, mean, rstd = ops.layer_norm_fwd(x, w, b, None, seed, 1e-5, 0.0, False, False)

    def forward():
        return ops.layer_norm_fwd(x, w, b, None, seed, 1e-5, 0.0, False, False)

    def backward():
        return ops.layer_norm_bwd(
            dy, None, x, w, b, mean, rstd, seed, 0.0, False, False, False, True, True
        )

    def fused():
        return ops.layer_norm_fwd(x, w, b, res, seed, 1e-5, 0.1, False, True)

    def prenorm_bwd():  # x stands for pre, res for the gradient of pre
        return ops.layer_norm_bwd(
            dy, res, x, w, b, mean, rstd, seed, 0.1, False, True, True, True, True
        )

    return dict(zip(KINDS, (forward, backward, fused, prenorm_bwd), strict=True))


def _configs(kind: str, elem: int, cols: int) -> list[tuple[int, int, int]]:
    """The built-in choice (0, 0, 0), then the overrides worth timing for `kind`, as (vecs,
    block, stage)."""
    if kind in ("fwd", "fused"):
        staged = [(0, 0, STAGED), *((v, b, STAGED) for v, b in FWD if v == 4)]
        looped = [(0, b, LOOP) for b in LOOP_BLOCKS]
        return [(0, 0, 0), *((v, b, 0) for v, b in FWD), *staged, *looped]
    # 16-bit rows: at most 2 vectors a backward thread (the C++ choice caps it). Only the
    # unfused backward stages.
    staged = [(0, 0, STAGED), (0, 0, DEEP)] if kind == "bwd" else []
    return [(0, 0, 0), *((v, b, 0) for v, b in BWD if not (elem == 2 and v == 4)), *staged]


def _tuning(kind: str, vecs: int, block: int, stage: int) -> list[int]:
    """layer_norm_tuning's [fwd_vecs, fwd_block, bwd_vecs, bwd_block, stage] of a config."""
    if kind in ("fwd", "fused"):
        return [vecs, block, 0, 0, stage]
    return [0, 0, vecs, block, stage]


def _measure(kind: str, fn, cols: int, elem: int, copy_gbps: float) -> list[dict]:
    tuning = torch.ops.fastformer.layer_norm_tuning
    # x, y; x, dy, dx; x, residual, y, pre; pre, dy, dpre, dx, dresidual
    tensors = {"fwd": 2, "bwd": 3, "fused": 4, "prenorm_bwd": 5}[kind]
    rows = []
    for vecs, block, stage in _configs(kind, elem, cols):
        tuning(_tuning(kind, vecs, block, stage))
        ms = _time_ms(fn)
        gbps = tensors * ROWS * cols * elem / ms / 1e6
        rows.append(
            dict(
                kind=kind,
                cols=cols,
                vecs=vecs,
                block=block,
                staged=stage in (STAGED, DEEP),
                ahead=stage - 1 if stage in (STAGED, DEEP) else 0,
                loop=stage == LOOP,
                ms=ms,
                gbps=gbps,
                of_copy=gbps / copy_gbps,
            )
        )
    return rows


def sweep(cols_list: list[int], dtype: torch.dtype, done=lambda result: None) -> dict:
    """Every configuration's ms, GB/s and fraction of copy bandwidth, per hidden size;
    `done(result so far)` after each size."""
    from fastformer.cli import bench, timing

    copy_gbps = bench.rooflines(torch.device("cuda"), dtype, timing.GPU_DEFAULT)["copy_gbps"]
    elem = torch.finfo(dtype).bits // 8
    result = {
        "device": torch.cuda.get_device_name(),
        "dtype": str(dtype),
        "rows": ROWS,
        "copy_gbps": copy_gbps,
        "results": [],
    }
    try:
        for cols in cols_list:
            calls = _calls(cols, dtype)
            for kind, fn in calls.items():
                if kind in ("fwd", "bwd") or cols in FUSED_COLS:
                    result["results"] += _measure(kind, fn, cols, elem, copy_gbps)
            del calls
            torch.cuda.empty_cache()
            done(result)
    finally:
        torch.ops.fastformer.layer_norm_tuning([0, 0, 0, 0, 0])
    return result


def _name(r: dict) -> str:
    ahead = r.get("ahead", 1 if r.get("staged") else 0)
    mode = "/loop" if r.get("loop") else {0: "", 1: "/staged", 2: "/staged2"}[ahead]
    return f"{r['vecs']}/{r['block']}{mode}"


def table(result: dict) -> str:
    """One line a (kind, hidden size): the built-in configuration's fraction of copy, the
    staged built-in's (one row ahead: "staged", two: "staged2") and the looped ones' ("loop",
    by block), then the best override's."""
    lines = [
        f"{result['device']}, {result['dtype']}, {result['rows']} rows, copy "
        f"{result['copy_gbps']:.0f} GB/s; vecs/block[/staged|/loop] (0/0: built-in), fraction of "
        "copy"
    ]
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in result["results"]:
        groups.setdefault((r["kind"], r["cols"]), []).append(r)
    for (kind, cols), rs in groups.items():
        built_in = next(
            r for r in rs if r["vecs"] == 0 and not r.get("staged") and not r.get("loop")
        )
        best = max(rs, key=lambda r: r["gbps"])
        line = f"{kind} {cols:>6}: built-in {built_in['of_copy']:.1%} ({built_in['ms']:.3f} ms); "
        for r in rs:
            if r["vecs"] == 0 and r.get("staged"):
                name = _name(r).split("/")[-1]
                line += f"{name} {r['of_copy']:.1%} ({r['ms']:.3f} ms); "
            elif r.get("loop"):
                line += f"loop/{r['block']} {r['of_copy']:.1%} ({r['ms']:.3f} ms); "
        lines.append(line + f"best {_name(best)} {best['of_copy']:.1%} ({best['ms']:.3f} ms)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cols", default=",".join(map(str, COLS)), help="hidden sizes")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--out", help="write every measurement as JSON here")
    args = parser.parse_args(argv)
    try:
        cols = [int(c) for c in args.cols.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--cols: a comma list of ints, got {args.cols!r}")
    if not cols or min(cols) < 1:
        parser.error(f"--cols: positive ints, got {args.cols!r}")
    why = _available()
    if why is not None:
        print(f"sweep_layer_norm: {why}", file=sys.stderr)
        return 2

    def save(result: dict) -> None:  # what a stage timeout would leave
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)

    result = sweep(cols, getattr(torch, args.dtype), save)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
