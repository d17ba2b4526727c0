"""Timing and peak-memory measurement: CUDA (median of `triton.testing.do_bench` or CUDA events
after warm-up) and CPU (median of `time.perf_counter`)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Budget:
    """How long to measure one thing: warm-up calls, then repetitions until both `min_reps`
    and `min_time_s` are reached (or `max_reps`)."""

    warmup: int = 2
    min_reps: int = 5
    max_reps: int = 50
    min_time_s: float = 0.2


QUICK = Budget(warmup=1, min_reps=3, max_reps=5, min_time_s=0.0)
# Past a run's deadline: one timed call (the untimed first call already warmed up).
MINIMAL = Budget(warmup=0, min_reps=1, max_reps=1, min_time_s=0.0)
# CPU: no extra warm-up; the callers' untimed first call already warmed caches and allocator.
# Up to 30 repetitions: a median of 10 calls of 0.2-1 ms moved by 10-20% between runs on a
# 2-core VM, and 30 of them cost a few ms (the default CPU bench takes ~15 s).
CPU_DEFAULT = Budget(warmup=0, min_reps=3, max_reps=30, min_time_s=0.1)
GPU_DEFAULT = Budget(warmup=3, min_reps=10, max_reps=200, min_time_s=0.05)


class Pacer:
    """Hands out the measurement budget, cut to MINIMAL once `deadline` (a perf_counter time)
    has passed, so a run on a slow or busy machine still ends in time; `cut` records it. Past
    `stop` (bench --max-seconds) nothing new is measured at all: `expired()` says so."""

    def __init__(self, budget: Budget, deadline: float | None = None, stop: float | None = None):
        self.budget = budget
        self.deadline = deadline
        self.stop = stop
        self.cut = False

    def current(self) -> Budget:
        """The budget for the next measurement."""
        if self.deadline is not None and time.perf_counter() > self.deadline:
            self.cut = True
            return MINIMAL
        return self.budget

    def expired(self) -> bool:
        """True past the hard stop: the caller records "not run" instead of measuring."""
        return self.stop is not None and time.perf_counter() > self.stop


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
KEEP_FREED_PAGES = "glibc malloc keeps freed memory (mallopt: no mmap, no trimming)"


def keep_freed_pages() -> str | None:
    """Asks glibc's malloc to keep the memory it frees (every block from the heap, which is
    never trimmed), so that a call's output reuses the pages an earlier call freed instead of
    faulting in fresh ones. For CPU benchmarks; process-wide and never undone.

    With glibc's defaults an allocation of 32 MB or more is a fresh mmap each time: an fp32
    4096 x 4096 `F.layer_norm` spent 10 of its 18 ms in page faults on a 2-core VM. Which calls
    found reused memory also changed from run to run (one LayerNorm case read 0.60x, 2.79x and
    0.91x torch's speed in three runs; 1.15x, 1.15x and 1.28x with this). torch's CPU launcher
    (`torch.backends.xeon.run_cpu`) preloads jemalloc or tcmalloc for the same reason.

    Returns KEEP_FREED_PAGES, or None where there is no glibc mallopt (another OS or libc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = ((_M_MMAP_MAX, 0), (_M_MMAP_THRESHOLD, 1 << 30), (_M_TRIM_THRESHOLD, 2**31 - 1))
    return KEEP_FREED_PAGES if all(mallopt(*s) == 1 for s in settings) else None


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_cpu(fn: Callable[[], object], budget: Budget) -> float:
    """Median wall time of `fn()` in milliseconds (CPU: perf_counter)."""
    for _ in range(budget.warmup):
        fn()
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < budget.max_reps:
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
        enough = len(samples) >= budget.min_reps
        if enough and time.perf_counter() - start >= budget.min_time_s:
            break
    return statistics.median(samples)


def time_cpu_in_turns(calls: dict[str, Callable[[], object]], budget: Budget) -> dict[str, float]:
    """Median wall time in milliseconds of each of `calls`, timed in turns: each round calls
    every one once (the order rotated by one each round), until every call has `min_reps`
    samples and the rounds took `min_time_s` per call, or `max_reps` rounds. A ratio of two
    medians then compares calls made under the same machine state: timed one after the other,
    the same LayerNorm case read 0.69x and 1.23x F.layer_norm's speed in two runs on a 2-core VM.
    """
    names = list(calls)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(budget.warmup):
        for name in names:
            calls[name]()
    start = time.perf_counter()
    for round_ in range(budget.max_reps):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            t0 = time.perf_counter()
            calls[name]()
            samples[name].append((time.perf_counter() - t0) * 1e3)
        enough = round_ + 1 >= budget.min_reps
        if enough and time.perf_counter() - start >= budget.min_time_s * len(names):
            break
    return {name: statistics.median(times) for name, times in samples.items()}


def time_cuda_events(fn: Callable[[], object], budget: Budget, device: torch.device) -> float:
    """Median time of `fn()` in milliseconds measured with CUDA events, one pair per call."""
    for _ in range(budget.warmup):
        fn()
    _synchronize(device)
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < budget.max_reps:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end))
        enough = len(samples) >= budget.min_reps
        if enough and time.perf_counter() - start >= budget.min_time_s:
            break
    return statistics.median(samples)


# A CUDA call at least this long is timed by 3 calls with events: do_bench spends 5 calls on an
# estimate before its warm-up and repetitions (8 calls of a 180 ms materialising peer on an
# H200), and an L2 flush is noise at that length.
SLOW_CALL_MS = 20.0


def time_op(fn: Callable[[], object], device: torch.device, budget: Budget) -> float:
    """Median milliseconds of a kernel-sized call: `triton.testing.do_bench` (L2 flushed between
    calls) on CUDA, or 3 calls timed with events when one takes SLOW_CALL_MS or more;
    perf_counter on CPU."""
    if device.type != "cuda":
        return time_cpu(fn, budget)
    probe = time_cuda_events(fn, MINIMAL, device)
    if probe >= SLOW_CALL_MS:
        rest = [time_cuda_events(fn, MINIMAL, device) for _ in range(2)]
        return statistics.median([probe, *rest])
    from triton.testing import do_bench

    warmup_ms = 10 if budget is QUICK or budget is MINIMAL else 25
    rep_ms = max(20.0, budget.min_time_s * 1e3)
    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def time_step(fn: Callable[[], object], device: torch.device, budget: Budget) -> float:
    """Median milliseconds of a whole training/inference step (CUDA events or perf_counter)."""
    if device.type == "cuda":
        return time_cuda_events(fn, budget, device)
    return time_cpu(fn, budget)


def host_time(fn: Callable[[], object], device: torch.device, reps: int = 3) -> float:
    """Median milliseconds for `fn()` to return on the host, the device idle at its start and
    not waited for at its end (CUDA: the queue is drained before each call). Near the device
    time of the same call, the host (Python, launches) sets the pace, not the GPU; well below,
    the GPU does. (A queue that fills up also blocks the host: then the two agree either way.)"""
    samples = []
    for _ in range(reps):
        _synchronize(device)
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    _synchronize(device)
    return statistics.median(samples)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence the profiler's native start/stop chatter on file descriptor 2."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_memory(
    fn: Callable[[], object], device: torch.device, above_start: bool = False
) -> tuple[int, str]:
    """Peak bytes of tensor memory while `fn()` runs, and how it was measured.

    CUDA: `torch.cuda.max_memory_allocated`, absolute (model and optimizer state included) or,
    with `above_start`, less what was allocated before the call (an op's inputs excluded).
    CPU has no allocator statistics: the autograd profiler's per-op allocation records are
    summed in time order and the peak above the level at the start is reported.
    """
    if device.type == "cuda":
        _synchronize(device)
        start = torch.cuda.memory_allocated(device) if above_start else 0
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        _synchronize(device)
        how = "cuda max_memory_allocated" + (" above the call's start" if above_start else "")
        return int(torch.cuda.max_memory_allocated(device) - start), how
    from torch.autograd.profiler import profile

    with _quiet_stderr(), profile(profile_memory=True, use_kineto=False) as prof:
        fn()
    events = sorted(prof.function_events, key=lambda e: e.time_range.start)
    level = peak = 0
    for event in events:
        level += event.self_cpu_memory_usage
        peak = max(peak, level)
    return int(peak), "cpu profiler: peak tensor bytes above the step's start"


def saved_bytes(fn: Callable[..., object], args: tuple) -> int:
    """Bytes autograd keeps for the backward of `fn(*args)` beyond the inputs themselves: the
    distinct storages of the tensors saved for the backward (`saved_tensors_hooks`) that no
    tensor of `args` shares. Exact on any device (sizes, not allocator statistics)."""
    inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in inputs:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(kept.values())
