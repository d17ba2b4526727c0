"""The fastformer._C build: what it records, its op registrations, and the CUDA sources' ptxas
reports (every kernel compiles for sm_80 and sm_90 with 0 bytes of spills)."""

import re
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

import fastformer
from fastformer import _ext

ROOT = Path(__file__).resolve().parents[1]
CUDA_SOURCES = sorted((ROOT / "csrc").rglob("*.cu"))
NVCC = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
HAVE_NVCC = Path(NVCC).exists()
needs_nvcc = pytest.mark.skipif(not HAVE_NVCC, reason="nvcc not installed")


def test_extension_loaded_and_build_recorded():
    assert fastformer.extension_error() is None
    info = fastformer.build_info()
    assert info is not None
    assert info["torch"] == torch.__version__
    assert set(info) >= {"torch", "cuda", "cuda_compiled", "arch_list"}


@needs_nvcc
def test_cuda_kernels_compiled_when_nvcc_present():
    if torch.version.cuda is None:
        pytest.skip("CPU-only torch cannot build CUDA sources")
    info = fastformer.build_info()
    assert info["cuda_compiled"] is True
    assert fastformer.cuda_kernels_compiled()
    assert "9.0" in info["arch_list"]


def test_ops_registered_per_dispatch_key():
    schema = torch.ops.fastformer.philox_uniform.default._schema
    assert str(schema).startswith("fastformer::philox_uniform(")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("fastformer::philox_uniform", "CPU")
    if fastformer.cuda_kernels_compiled():
        assert torch._C._dispatch_has_kernel_for_dispatch_key("fastformer::philox_uniform", "CUDA")


def test_build_records_the_sources_it_compiled():
    from fastformer import _sources

    info = fastformer.build_info()
    assert info["sources"] == _sources.digest(ROOT / "csrc")
    assert _ext.sources_match() is True


def test_sources_digest_follows_every_source_file(tmp_path):
    from fastformer import _sources

    (tmp_path / "op").mkdir()
    (tmp_path / "op" / "k.cu").write_text("__global__ void k() {}\n")
    (tmp_path / "op" / "k.h").write_text("#pragma once\n")
    first = _sources.digest(tmp_path)
    (tmp_path / "notes.txt").write_text("not a source")
    assert _sources.digest(tmp_path) == first
    (tmp_path / "op" / "k.h").write_text("#pragma once \n")
    assert _sources.digest(tmp_path) != first
    (tmp_path / "op" / "k.h").write_text("#pragma once\n")
    assert _sources.digest(tmp_path) == first
    (tmp_path / "op" / "k.cu").rename(tmp_path / "op" / "j.cu")
    assert _sources.digest(tmp_path) != first
    assert _sources.digest(tmp_path / "missing") is None


def _load_warnings(monkeypatch, info: dict) -> list[str]:
    """The warnings of loading fastformer._C when setup.py had recorded `info`."""
    monkeypatch.setattr(_ext, "build_info", lambda: info)
    _ext._load.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _ext._load()
        return [str(w.message) for w in caught]
    finally:
        monkeypatch.undo()
        _ext._load.cache_clear()
        _ext._load()


def test_stale_sources_warn(monkeypatch):
    stale = {"torch": torch.__version__, "sources": "0" * 64}
    monkeypatch.setattr(_ext, "build_info", lambda: stale)
    assert _ext.sources_match() is False
    messages = _load_warnings(monkeypatch, stale)
    assert any("built from other sources" in m and "make install" in m for m in messages)
    current = {"torch": torch.__version__, "sources": fastformer.build_info()["sources"]}
    assert _load_warnings(monkeypatch, current) == []


def test_torch_mismatch_warns(monkeypatch):
    messages = _load_warnings(monkeypatch, {"torch": "0.0.0-other"})
    assert any("built against torch 0.0.0-other" in m and "make install" in m for m in messages)


def test_missing_extension_says_how_to_build():
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'fastformer._C': raise ImportError('blocked for the test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import fastformer\n"
        "from fastformer._ext import require_extension\n"
        "assert 'make install' in fastformer.extension_error()\n"
        "try:\n    require_extension()\nexcept RuntimeError as e:\n    print('ERR', e)\n"
    )
    out = subprocess.run(
        [__import__("sys").executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "ERR fastformer._C is not built" in out.stdout
    assert "pip install --no-build-isolation -e ." in out.stdout


def ptxas_report(source: Path, arch: str, tmp_path: Path) -> str:
    """nvcc's -Xptxas=-v output for one .cu file compiled alone for one architecture."""
    cmd = [
        NVCC,
        f"-arch={arch}",
        "-std=c++17",
        "-O3",
        "-Xptxas=-v",
        "--expt-relaxed-constexpr",
        "-I",
        str(ROOT / "csrc"),
        "-c",
        str(source),
        "-o",
        str(tmp_path / f"{source.stem}-{arch}.o"),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{source} failed for {arch}:\n{out.stderr[-4000:]}"
    return out.stdout + out.stderr


def kernel_spills(report: str) -> dict[str, tuple[int, int]]:
    """{kernel: (spill store bytes, spill load bytes)} parsed from a ptxas -v report."""
    spills, current = {}, None
    for line in report.splitlines():
        name = re.search(r"Compiling entry function '([^']+)'", line)
        if name:
            current = name.group(1)
        counts = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if counts and current:
            spills[current] = (int(counts.group(1)), int(counts.group(2)))
    return spills


def test_ptxas_parser_sees_spills():
    sample = (
        "ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_90'\n"
        "ptxas info    : Function properties for _Z3fooPf\n"
        "    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
    )
    assert kernel_spills(sample) == {"_Z3fooPf": (8, 4)}


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", CUDA_SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_cuda_source_has_no_spills(source, arch, tmp_path):
    spills = kernel_spills(ptxas_report(source, arch, tmp_path))
    assert spills, f"no kernel found in the ptxas report of {source.name}"
    spilled = {k: v for k, v in spills.items() if v != (0, 0)}
    assert not spilled, f"{source.name} spills on {arch}: {spilled}"
