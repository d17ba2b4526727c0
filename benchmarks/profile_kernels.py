"""Where the time of one op call goes on a GPU: its kernels (torch.profiler) against the wall time.

    python benchmarks/profile_kernels.py [--iters N] [--cases TEXT,...] [--model NAME|none]

First the model (`bench`'s base Transformer by default): one training step (zero_grad, loss
forward + backward, Adam step) of the eager reference and of the model after fastformer.swap:
the step's wall time (synchronized), how long its Python takes to return (the GPU idle at its
start), the GPU time of its kernels and how many there are, and the kernels that take most of
it. Then, for each op case: the wall time of one forward + backward (synchronized, median of N),
the GPU time of its kernels (their sum per call), and the kernels that take most of it. Wall time
well above the kernel sum means the call is bound by host overhead or launch gaps; a kernel far
above its share of the bytes or FLOPs is the one to look at. After each case, the attention
autotuner's choices and every candidate's time for the keys that case tuned. Needs CUDA.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from fastformer.cli import bench, report
from fastformer.cli.cases import MODELS, AttentionCase, FfnCase, LayerNormCase, ModelCase
from fastformer.cli.impls import BUILDERS, FAST, runner
from fastformer.cli.timing import host_time

PEER = {"attention": "sdpa-flash", "layer_norm": "torch", "ffn": "torch"}  # profiled beside


def _cases() -> dict[str, tuple[str, object]]:
    """The cases in the order they are profiled: the quick C++ ops first."""
    cases: list[tuple[str, object]] = [
        ("layer_norm", LayerNormCase(16384, n)) for n in (2048, 16384)
    ]
    cases += [("ffn", FfnCase(16384, 512, 2048, dropout_p=p)) for p in (0.0, 0.1)]
    cases += [("attention", AttentionCase(8, 32, 2048, 64, causal=c)) for c in (False, True)]
    # Causal at s512 took longer than non-causal on an H200 (fwd+bwd 2.09 ms vs 1.58; flash
    # 1.03): its kernels first, then dropout.
    cases.append(("attention", AttentionCase(32, 32, 512, 64, causal=True)))
    cases.append(
        ("attention", AttentionCase(8, 32, 2048, 64, causal=True, padding=0.25, dropout_p=0.1))
    )
    cases.append(("attention", AttentionCase(8, 32, 2048, 64, dropout_p=0.1)))
    return {f"{op}-{case.name}": (op, case) for op, case in cases}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wall_ms(call: Callable[[], None], iters: int, device: torch.device) -> float:
    samples = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        call()
        _sync(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _kernel_lines(prof, iters: int, top: int, cuda: bool, what: str) -> list[str]:
    """A summary (kernel time and count per `what`), then a line for each of the `top` kernels."""

    def us(e) -> float:
        return e.device_time_total if cuda else e.self_cpu_time_total

    kernels = sorted((e for e in prof.key_averages() if us(e) > 0), key=us, reverse=True)
    lines = []
    for e in kernels[:top]:
        name = e.key if len(e.key) <= 90 else e.key[:87] + "..."
        lines.append(f"    {us(e) / iters:9.1f} us  x{e.count // iters:<3} {name}")
    launches = sum(e.count for e in kernels) // iters
    total_ms = sum(us(e) for e in kernels) / iters / 1e3
    head = f"kernels {total_ms:.3f} ms in {launches} {'kernels' if cuda else 'ops'} per {what}"
    return [head, *lines]


def _profiled(call: Callable[[], None], iters: int, top: int, device, what: str):
    """(synchronized wall milliseconds of `call`, median of `iters`; its kernel lines), after a
    warm-up (autotuning, allocator)."""
    for _ in range(3):
        call()
    wall = _wall_ms(call, iters, device)
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            call()
        _sync(device)
    return wall, _kernel_lines(prof, iters, top, cuda, what)


def profile_model(case: ModelCase, iters: int, top: int, device="cuda") -> list[str]:
    """Report lines of one training step of the eager reference, its torch.nn.Transformer twin
    and its fastformer.swap copy (same weights and batch; bf16 on CUDA, float32 on CPU for a
    dry run)."""
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    eager = bench.build_model(case, device, dtype, case.dropout)
    fast, info = bench.swapped(eager)
    src, tgt = bench.synthetic_batch(case, device)
    tokens = bench.real_tokens(src, tgt)
    lines = [f"model {case.name}: {tokens} tokens a step (src + tgt, no padding), {dtype}"]
    twin = bench.torch_nn_twin(eager)
    for name, model in (("eager", eager), (bench.TORCH_NN, twin), (FAST, fast)):
        if model is None or isinstance(model, str):
            lines.append(f"  {name}: not run ({model or info['error']})")
            continue
        model.train()
        opt = bench.optimizer(model)
        step = bench.training_step(model.loss, opt, src, tgt)
        wall, kernels = _profiled(step, iters, top, device, "step")
        host = host_time(step, device, iters)
        lines.append(f"  {name}: wall {wall:.2f} ms, host {host:.2f} ms, {kernels[0]}")
        lines += kernels[1:]
    return lines


def profile_case(op: str, case, impl: str, iters: int, top: int, device="cuda") -> list[str]:
    """Report lines of one implementation of one case, forward + backward (bf16 on CUDA; on
    CPU, in float32 with CPU ops as the "kernels", for a dry run)."""
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bench = BUILDERS[op](case, device, dtype)
    fn = bench.impls.get(impl, "no such implementation here")
    if isinstance(fn, str):
        return [f"  {impl}: not run ({fn})"]
    wall, kernels = _profiled(runner(fn, bench.args, "fwd+bwd"), iters, top, device, "fwd+bwd")
    return [f"  {impl}: wall {wall:.3f} ms, {kernels[0]}", *kernels[1:]]


def _print_tuning_since(count: int) -> int:
    """Prints the attention autotuner's choices and candidate times logged after the first
    `count` (why a case runs the tile it runs, say the causal s512 one); returns the new count."""
    entries = bench.attention_tuning()
    if entries[count:]:
        print("\n".join(report.tuning_lines(entries[count:])), flush=True)
    return len(entries)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--top", type=int, default=6)
    parser.add_argument("--cases", help="only cases whose name contains one of these texts")
    parser.add_argument("--model", default="base", help="model profiled first, or 'none'")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_kernels.py needs a CUDA GPU")
    only = args.cases.split(",") if args.cases else None
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16")
    if args.model != "none":
        try:
            print("\n".join(profile_model(MODELS[args.model], args.iters, 12)), flush=True)
        except Exception as exc:  # the op cases still run
            print(f"model {args.model}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        torch.cuda.empty_cache()
    tuned = _print_tuning_since(0)
    print("op cases, fwd+bwd")
    for name, (op, case) in _cases().items():
        if only and not any(text in name for text in only):
            continue
        print(name)
        for impl in (FAST, PEER[op]):
            try:
                print("\n".join(profile_case(op, case, impl, args.iters, args.top)), flush=True)
            except Exception as exc:  # one failing case must not hide the others
                print(f"  {impl}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        tuned = _print_tuning_since(tuned)


if __name__ == "__main__":
    main()
