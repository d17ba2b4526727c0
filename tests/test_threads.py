"""Kernel launches from several threads at once (a server's request threads, a data-parallel
loop per GPU): each thread's call gives what it gives alone.

No GPU here: the Triton interpreter runs the kernels, and a CUDA-typed stand-in for the query
sends `_launch` down its GPU tuning path with a real Triton Autotuner over a stub kernel.
"""

import math
import random
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
import triton

from fastformer.kernels import attention as kernels
from fastformer.ops.attention import scaled_dot_product_attention as sdpa

F16 = torch.float16


@contextmanager
def _switching_often() -> Iterator[None]:
    # Threads switch every microsecond instead of every 5 ms: a race shows in a few calls.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def _run_threads(work: Callable[[int], None], n: int) -> list[BaseException]:
    """`work(i)` in n threads started together; the exceptions they raised."""
    errors, start = [], threading.Barrier(n)

    def run(i: int) -> None:
        start.wait()
        try:
            work(i)
        except BaseException as e:  # the test reports every one
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    with _switching_often():
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
    return errors


@pytest.mark.skipif(not kernels.INTERPRETED, reason="the Triton interpreter's launches")
def test_attention_on_the_interpreter_from_several_threads(monkeypatch):
    # The interpreter runs a kernel through one process-wide builder and patches
    # triton.language meanwhile: two threads' calls raised InterpreterError or gave wrong
    # outputs. Each thread's outputs must be the bits a serial call gives.
    monkeypatch.setenv("FASTFORMER_BACKEND_ATTENTION", "triton")
    g = torch.Generator().manual_seed(0)
    cases = []
    for lq, extra in [(3, {}), (5, {"is_causal": True}), (8, "kpm"), (4, "bool")]:
        q, k, v = (torch.randn(1, 2, n, 16, generator=g) for n in (lq, lq + 1, lq + 1))
        if extra == "kpm":
            extra = {"key_padding_mask": torch.rand(1, lq + 1, generator=g) > 0.7}
        elif extra == "bool":
            extra = {"attn_mask": torch.rand(lq, lq + 1, generator=g) > 0.3}
        cases.append(((q, k, v), extra))
    expected = [sdpa(*qkv, **kw) for qkv, kw in cases]
    wrong = []

    def work(i: int) -> None:
        order = list(range(len(cases))) * 3
        random.Random(i).shuffle(order)
        for c in order:
            if not torch.equal(sdpa(*cases[c][0], **cases[c][1]), expected[c]):
                wrong.append(c)

    errors = _run_threads(work, 4)
    assert not errors and not wrong, (errors[:3], wrong)


class _StubKernel:
    """Stands for the forward kernel under its Autotuner: a launch records the block size it
    ran with and lets the other thread run (as a GPU launch releases the GIL)."""

    arg_names = kernels.KERNELS["fwd"].arg_names
    __name__ = "stub"
    ran = threading.local()

    def run(self, *args, grid=None, warmup=False, **kwargs) -> None:
        self.ran.block_m = kwargs["BLOCK_M"]
        time.sleep(0.0005)

    @staticmethod
    def fn(*args) -> None:  # the Autotuner looks for the Python function under it
        pass


def test_first_calls_of_two_keys_of_one_autotuner_tune_one_at_a_time(monkeypatch):
    # One Autotuner serves every key of a (kernel, arch, dtype class, head-dim bucket, feature
    # class) and keeps the last key's state: two threads tuning two of its keys at once
    # crashed in it (`nargs` set to None by the other: TypeError) or stored, for one key, the
    # config the other key chose.
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": 32}) for m in (16, 32, 64, 128)]
    best = {64: 16, 4096: 128}  # by query sequence bucket: each key's fastest BLOCK_M

    def do_bench(kernel_call, quantiles):
        kernel_call()
        time.sleep(0.001)
        miss = abs(math.log2(_StubKernel.ran.block_m / best[_StubKernel.ran.seq_q]))
        return [1.0 + miss] * 3

    q = types.SimpleNamespace(device=torch.device("cuda", 0), dtype=F16, shape=(1, 1, 512, 64))
    meta = {"HEAD_D": 64, "HEAD_DV": 64, "IS_CAUSAL": False, "MASK_KIND": 0, "HAS_KPM": False,
            "HAS_DROPOUT": False}  # fmt: skip
    iq, ik = kernels._SEQ_BUCKET_ARGS["fwd"]
    monkeypatch.setattr(kernels, "INTERPRETED", False)
    monkeypatch.setattr(kernels, "arch_family", lambda device: 90)
    monkeypatch.setattr(kernels, "_compile_at_once", lambda jobs: None)  # nothing to compile
    monkeypatch.setattr(kernels, "TUNING_LOG", [])

    def work(i: int) -> None:
        seq_q = list(best)[i]
        _StubKernel.ran.seq_q = seq_q
        args = [torch.empty(1, dtype=F16)] * 2 + [3] * 40
        args[iq], args[ik] = seq_q, 512
        kernels._launch("fwd", lambda c: (1,), tuple(args), meta, q, None)

    for _ in range(5):  # a new autotuner each time, as in a new process
        tuner = triton.autotune(configs, key=kernels._tune_key(_StubKernel), do_bench=do_bench)(
            _StubKernel()
        )
        monkeypatch.setattr(kernels, "_autotuned", lambda *key, tuner=tuner: tuner)
        monkeypatch.setattr(kernels, "_TUNED", {})
        errors = _run_threads(work, 2)
        assert not errors, errors
        chosen = {key[2]: tuned["BLOCK_M"] for key, tuned in kernels._TUNED.items()}
        assert chosen == best
