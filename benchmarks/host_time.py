"""Host time of the model's training step, measured on a CPU: a stand-in for the GPU's step.

The swapped model's training step on the H200 was bound by host time (37.2 ms a step, 35.3 of
them Python and launches). That time is the same Python on any machine, so it can be cut and
measured here: the bench's model at tiny widths (the base model's 6 + 6 layers and 8 heads,
d_model 32, 2 x 8 tokens), where every kernel costs next to nothing, so a step's time is its
Python, dispatch and autograd. Variants: the eager reference, its torch.nn twin, and the model
after fastformer.swap with attention's Triton launches replaced by no-ops (the interpreter's
launch path, everything before the launch kept). Not included: Triton's own argument binding
of a real launch (~25 us each on the CI VM, three a layer's attention fwd+bwd). Adam with
foreach, as on CUDA; one thread.

    python benchmarks/host_time.py [--steps N] [--variants eager,torch.nn,fastformer]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

os.environ["TRITON_INTERPRET"] = "1"  # before fastformer imports its kernels

import torch  # noqa: E402

from fastformer.cli import bench  # noqa: E402
from fastformer.cli.cases import ModelCase  # noqa: E402

CASE = ModelCase("host", 32, 8, 6, 6, 64, 0.1, 100, batch=2, max_len=8)
VARIANTS = ("eager", "torch.nn", "fastformer")


class _NoLaunch:
    """Stands for a Triton kernel: `kernel[grid](*args)` does nothing but count."""

    launches = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs) -> None:
            _NoLaunch.launches += 1

        return launch


def _stub_attention_launches() -> None:
    from fastformer.kernels import attention as kernels

    for name in kernels.KERNELS:
        kernels.KERNELS[name] = _NoLaunch()
    kernels.attn_kv_range = _NoLaunch()


def models() -> dict[str, torch.nn.Module]:
    """The three variants on CPU in float32, the same weights."""
    eager = bench.build_model(CASE, torch.device("cpu"), torch.float32, CASE.dropout)
    fast, info = bench.swapped(eager)
    if fast is None:
        raise RuntimeError(info["error"])
    return {"eager": eager, "torch.nn": bench.torch_nn_twin(eager), "fastformer": fast}


def step_ms(model: torch.nn.Module, steps: int) -> tuple[float, float]:
    """(median, min) milliseconds of a training step after 20 warm-up steps."""
    src, tgt = bench.synthetic_batch(CASE, torch.device("cpu"))
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=True)
    step = bench.training_step(model.loss, opt, src, tgt)
    for _ in range(20):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="timed steps a variant")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma list")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    if not names or set(names) - set(VARIANTS):
        parser.error(f"--variants: a comma list of {', '.join(VARIANTS)}, got {args.variants!r}")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "The PyTorch API of nested tensors")
    _stub_attention_launches()
    variants = models()
    for name in names:
        median, best = step_ms(variants[name], args.steps)
        print(f"{name:<12} step median {median:7.2f} ms  min {best:7.2f} ms")
    if "fastformer" in names and not _NoLaunch.launches:
        raise RuntimeError("the fastformer variant launched no Triton kernel: not the GPU's path")


if __name__ == "__main__":
    main()
