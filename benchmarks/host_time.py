"""Host time of the model's training step, measured on a CPU: a stand-in for the GPU's step.

The swapped model's training step on the H200 was bound by host time (37.2 ms a step, 35.3 of
them Python and launches). That time is the same Python on any machine, so it can be cut and
measured here: the bench's model at tiny widths (the base model's 6 + 6 layers and 8 heads,
d_model 32, 2 x 8 tokens), where every kernel costs next to nothing, so a step's time is its
Python, dispatch and autograd. Variants: the eager reference, its torch.nn twin, and the model
after fastformer.swap with attention on its Triton kernels: Triton's real JIT, compiling for
sm_90 through a stand-in driver, so each launch binds its arguments, specializes and finds its
compiled kernel as on a GPU; only the driver's launcher (its C argument parsing and
cuLaunchKernel) is replaced by a no-op. The first steps compile (~1 s a kernel variant, kept in
Triton's cache). The bench's optimizer (Adam, torch's fused kernel; `--adam foreach` for torch's
default); one thread.

    python benchmarks/host_time.py [--steps N] [--variants eager,torch.nn,fastformer] [--inference]
        [--adam fused|foreach]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

os.environ.pop("TRITON_INTERPRET", None)  # the real JIT, before fastformer imports its kernels

import torch  # noqa: E402

from fastformer.cli import bench  # noqa: E402
from fastformer.cli.cases import ModelCase  # noqa: E402

CASE = ModelCase("host", 32, 8, 6, 6, 64, 0.1, 100, batch=2, max_len=8)
VARIANTS = ("eager", "torch.nn", "fastformer")


class _Launcher:
    """Stands for the driver's launcher of a compiled kernel: counts the launches."""

    launches = 0

    def __call__(self, *args) -> None:
        _Launcher.launches += 1


def _sm90_jit() -> None:
    """Triton's JIT compiles for sm_90 without a GPU and launches through `_Launcher`; the
    attention op takes its Triton backend for CPU tensors."""
    from fastformer.ops import _dispatch
    from fastformer.testing import sm90_jit

    sm90_jit(lambda kernel: _Launcher())
    _dispatch.register("attention", [_dispatch.Backend("triton", lambda inputs: [])])


def models() -> dict[str, torch.nn.Module]:
    """The three variants on CPU in float32, the same weights."""
    eager = bench.build_model(CASE, torch.device("cpu"), torch.float32, CASE.dropout)
    fast, info = bench.swapped(eager)
    if fast is None:
        raise RuntimeError(info["error"])
    return {"eager": eager, "torch.nn": bench.torch_nn_twin(eager), "fastformer": fast}


def training_step(model: torch.nn.Module, adam: str = "fused"):
    """The bench's training step of `model` after 20 warm-up steps; adam "foreach": torch's
    default Adam instead of the bench's fused one."""
    src, tgt = bench.synthetic_batch(CASE, torch.device("cpu"))
    model.train()
    if adam == "foreach":
        opt = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=True)
    else:
        opt = bench.optimizer(model)
    step = bench.training_step(model.loss, opt, src, tgt)
    for _ in range(20):
        step()
    return step


def inference_step(model: torch.nn.Module):
    """The bench's inference pass of `model` (eval, no_grad, teacher-forced), after 20 warm-up
    calls."""
    src, tgt = bench.synthetic_batch(CASE, torch.device("cpu"))
    tgt_in = torch.cat([torch.full_like(tgt[:, :1], bench.BOS), tgt[:, :-1]], dim=1)
    model.eval()

    def step() -> None:
        with torch.no_grad():
            model(src, tgt_in)

    for _ in range(20):
        step()
    return step


def step_ms(steps: dict, reps: int) -> dict[str, tuple[float, float]]:
    """(median, min) milliseconds of each variant's step, the variants taking turns step by
    step, so that a drift of the machine's speed reaches them alike."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(reps):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="timed steps a variant")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma list")
    parser.add_argument(
        "--inference", action="store_true", help="time the inference pass, not the training step"
    )
    parser.add_argument(
        "--adam", choices=("fused", "foreach"), default="fused", help="the training step's Adam"
    )
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    if not names or set(names) - set(VARIANTS):
        parser.error(f"--variants: a comma list of {', '.join(VARIANTS)}, got {args.variants!r}")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "The PyTorch API of nested tensors")
    _sm90_jit()
    variants = models()
    if args.inference:
        steps = {name: inference_step(variants[name]) for name in names}
    else:
        steps = {name: training_step(variants[name], args.adam) for name in names}
    for name, (median, best) in step_ms(steps, args.steps).items():
        print(f"{name:<12} step median {median:7.2f} ms  min {best:7.2f} ms")
    if "fastformer" in names and not _Launcher.launches:
        raise RuntimeError("the fastformer variant launched no Triton kernel: not the GPU's path")


if __name__ == "__main__":
    main()
