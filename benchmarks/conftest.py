"""pytest-benchmark suites of fastformer (`pytest benchmarks/ --benchmark-only`).

They run on an NVIDIA GPU only and skip cleanly anywhere else (or without pytest-benchmark).
Cases and implementations come from fastformer.cli.cases / fastformer.cli.impls, the same
definitions `python -m fastformer bench` uses.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
HAS_PLUGIN = importlib.util.find_spec("pytest_benchmark") is not None


def pytest_collect_file(file_path, parent):
    """Collect bench_<op>.py (the repository's naming) without touching pytest's settings."""
    if file_path.suffix == ".py" and file_path.name.startswith("bench_"):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_collection_modifyitems(config, items):
    """Skip every benchmark without a GPU or without pytest-benchmark."""
    if HAS_GPU and HAS_PLUGIN:
        return
    why = "benchmarks need an NVIDIA GPU" if not HAS_GPU else "pytest-benchmark is not installed"
    skip = pytest.mark.skip(reason=why)
    for item in items:
        item.add_marker(skip)


@functools.lru_cache(maxsize=1)
def _prepared(builder, case, dtype):
    """Inputs and implementations of the last case (parametrized tests run case by case)."""
    return builder(case, torch.device("cuda"), dtype)


@pytest.fixture
def op_benchmark(request):
    """`op_benchmark(builder, case, impl, mode)`: time one implementation of one op case with
    pytest-benchmark (CUDA-synchronised rounds after warm-up); FLOP/s and GB/s go to
    extra_info. Skips an implementation that cannot run the case."""
    from fastformer.cli.impls import runner

    benchmark = request.getfixturevalue("benchmark")

    def run(builder, case, impl, mode, dtype=torch.bfloat16):
        bench = _prepared(builder, case, dtype)
        fn = bench.impls.get(impl, f"{impl} is not a peer of this op on CUDA")
        if isinstance(fn, str):
            pytest.skip(fn)
        call = runner(fn, bench.args, mode)

        def synced():
            call()
            torch.cuda.synchronize()

        try:
            synced()  # compilation / autotuning outside the timed rounds
        except Exception as exc:  # an SDPA backend that cannot run this case
            pytest.skip(f"{impl}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        benchmark.pedantic(synced, rounds=20, warmup_rounds=3, iterations=1)
        seconds = benchmark.stats.stats.median
        if bench.flops:
            benchmark.extra_info["tflops"] = bench.flops(mode) / seconds / 1e12
        if bench.bytes:
            benchmark.extra_info["gbps"] = bench.bytes(mode) / seconds / 1e9
        benchmark.extra_info["case"] = case.name

    return run
