"""The command line: `python -m fastformer {info, check, bench}`.

Command implementations live in fastformer.cli.info / check / bench (imported lazily, so that
`check --interpret` can set TRITON_INTERPRET before any Triton kernel is imported).
"""

from __future__ import annotations

import argparse
import os
import sys

from fastformer.cli.cases import MODELS, OPS
from fastformer.cli.errors import UsageError

__all__ = ["build_parser", "main"]


def _info_parser(sub) -> None:
    p = sub.add_parser("info", help="versions, devices, build metadata and each op's backends")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def _check_parser(sub) -> None:
    p = sub.add_parser(
        "check",
        help="parity grid of every op against the eager reference (exit 1 on any failure)",
    )
    p.add_argument("--quick", action="store_true", help="a small grid (seconds on a CPU)")
    p.add_argument("--json", action="store_true", help="print JSON instead of rows")
    p.add_argument(
        "--interpret",
        action="store_true",
        help="also check the Triton kernels on CPU through TRITON_INTERPRET=1 (CPU only)",
    )
    p.add_argument(
        "--device",
        choices=("all", "cpu", "cuda"),
        default="all",
        help="devices to check (default: CPU, plus CUDA when visible)",
    )
    p.add_argument(
        "--ops",
        default=",".join(OPS),
        help="comma list of ops (layer_norm includes rms_norm and dropout_add_layer_norm)",
    )
    p.add_argument(
        "--shard",
        metavar="K/N",
        help="run only grid cases K, K+N, K+2N, ... (1 <= K <= N): N processes split the grid",
    )
    p.add_argument(
        "--max-seconds",
        type=float,
        metavar="S",
        help="start no case after S seconds; the rest are listed as 'not run' (not passed)",
    )


def _bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="whole-model and per-op benchmarks with reports and plots")
    p.add_argument(
        "--model", choices=sorted(MODELS), default="base", help="model size (default base)"
    )
    p.add_argument(
        "--ops",
        default=",".join(OPS),
        help=f"comma list of ops (default {','.join(OPS)}; '' for the model stage alone)",
    )
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "float16", "bfloat16"),
        default="auto",
        help="benchmark dtype (auto: bfloat16 on CUDA, float32 on CPU)",
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--quick", action="store_true", help="few cases, few repetitions")
    p.add_argument(
        "--full",
        action="store_true",
        help="the complete per-op GPU grid (42 cases, many minutes) instead of the default "
        "representative subset (12 cases, sized for 3 minutes with the model), and on a GPU the "
        "whole eager and swapped models under torch.compile too (by default: the eager model's "
        "layers) and both with their steps replayed from CUDA graphs; the CPU grid is the same "
        "either way; --quick wins",
    )
    p.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="CPU threads for torch (default: torch's own choice); recorded in the manifest",
    )
    p.add_argument("--no-model", action="store_true", help="skip the whole-model stage")
    p.add_argument(
        "--cases",
        metavar="TEXT,...",
        help="measure only the op cases whose name contains one of these texts",
    )
    p.add_argument(
        "--max-seconds",
        type=float,
        metavar="S",
        help="measure nothing new after S seconds (listed as 'not run'); repetitions are cut "
        "to one after 70%% of S",
    )
    p.add_argument("--out", help="output folder (default bench-results/<timestamp>)")
    p.add_argument("--compare", metavar="OLD/results.json", help="print the change of every figure")
    p.add_argument(
        "--fail-if-slower",
        type=float,
        metavar="PCT",
        help="with --compare: exit 1 if a fastformer figure takes more than PCT%% more time "
        "(a time's printed change; for a rate, the time per unit)",
    )
    p.add_argument(
        "--results",
        metavar="RESULTS.json",
        help="do not measure: re-render and compare an existing results.json",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of `python -m fastformer`."""
    parser = argparse.ArgumentParser(
        prog="python -m fastformer",
        description="fastformer: fused Transformer kernels for PyTorch",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{info,check,bench}")
    _info_parser(sub)
    _check_parser(sub)
    _bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status (0 ok, 1 failure, 2 usage error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "info":
            from fastformer.cli import info

            return info.run(args)
        if args.command == "check":
            from fastformer.cli import check

            return check.run(args, argv)
        from fastformer.cli import bench

        return bench.run(args, argv)
    except UsageError as exc:  # bad option values: say which and exit like argparse does
        print(f"python -m fastformer {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as shell tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:  # Ctrl-C where no command handles it (check): a line, no traceback
        print(f"python -m fastformer {args.command}: interrupted", file=sys.stderr)
        return 130
