"""Shared pytest setup.

Without a GPU, Triton kernels run through the interpreter on CPU tensors. Triton reads
TRITON_INTERPRET when a kernel is decorated, so it is set here, before any test imports
fastformer.kernels. The `cuda` marker skips GPU-only tests on such machines.
"""

import os
import zlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pytest_addoption(parser):
    parser.addoption(
        "--sample-cases",
        type=int,
        default=1,
        metavar="N",
        help="run the first and every Nth case of each parametrized test (CI's stages on other "
        "torch and Triton versions: every test still runs, on a third of its grid)",
    )
    parser.addoption(
        "--compile-heaviest-only",
        action="store_true",
        help="the attention compile check builds the heaviest feature classes, one config per "
        "kernel specialization, its heaviest (CI's stage on the newest Triton; "
        "kernels.attention.compile_jobs)",
    )


def pytest_configure(config):
    every = config.getoption("sample_cases")
    if every < 1:
        raise pytest.UsageError(f"--sample-cases must be >= 1, got {every}")


def pytest_collection_modifyitems(config, items):
    _sample_cases(config, items, config.getoption("sample_cases"))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def interpreter_bounds_checked():
    """Every interpreted Triton launch must stay inside its tensors: parity alone misses a
    load whose lanes are masked out later (kernels/interpreter_bounds.py)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from fastformer.kernels.interpreter_bounds import checked

    with checked():
        yield


@pytest.fixture(autouse=True)
def seeded_from_test_id(request):
    """Each test starts from a seed of its own id, so its random inputs do not depend on which
    tests its xdist worker ran before it: a failure reproduces when the test runs alone, and a
    test whose assertion holds for most inputs only fails on every run, not one in twelve."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def keep_mask_never_built(monkeypatch):
    """rng.dropout_keep raising: a keep-mask builder must refuse bad arguments before it."""
    from fastformer.ops import rng

    def must_not_run(*args, **kwargs):
        raise AssertionError("the mask was built from bad arguments")

    monkeypatch.setattr(rng, "dropout_keep", must_not_run)


@pytest.fixture
def fake_cuda():
    """`make(*shape, dtype=float32, requires_grad=False)`: a CUDA tensor without a GPU, made
    under a FakeTensorMode. It carries a device and a dtype (what backend choices read); used
    outside the mode, the ops take their eager paths and their compiled kernels run as fakes."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()

    def make(*shape: int, dtype=torch.float32, requires_grad: bool = False):
        with mode:
            return torch.empty(*shape, device="cuda", dtype=dtype, requires_grad=requires_grad)

    return make


def _sample_cases(config, items, every: int) -> None:
    # Cases are counted per test function in collection order, so the sample is the same on
    # every xdist worker; `every_case` tests (each case checks a different thing) keep all.
    if every == 1:
        return
    seen: dict[str, int] = {}
    kept, dropped = [], []
    for item in items:
        name = item.nodeid.split("[")[0]
        index = seen[name] = seen.get(name, -1) + 1
        keep = index % every == 0 or "every_case" in item.keywords
        (kept if keep else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
