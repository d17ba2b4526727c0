"""The fastformer._C build: what it records, its op registrations, and its CUDA kernels' resource
usage (every kernel built for sm_80 and sm_90 with 0 bytes of spills)."""

import re
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

import fastformer
from fastformer import _cuobjdump, _ext

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
    renamed = _sources.digest(tmp_path)
    (tmp_path / "op" / "j.cu").rename(tmp_path / "j.cu")  # the same name in another folder
    assert _sources.digest(tmp_path) != renamed
    before = _sources.digest(tmp_path)
    (tmp_path / "op" / "k.cuh").write_text("#pragma once\n")
    assert _sources.digest(tmp_path) != before
    before = _sources.digest(tmp_path)
    (tmp_path / "op" / "k.cpp").write_text("void f() {}\n")
    assert _sources.digest(tmp_path) != before
    before = _sources.digest(tmp_path)
    (tmp_path / "include.h").mkdir()  # a folder named like a source is not one
    assert _sources.digest(tmp_path) == before
    assert _sources.digest(tmp_path / "j.cu") is None  # a file is not a source folder


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


def test_sources_match_cannot_tell_without_a_record_or_sources(monkeypatch):
    # A build older than the record of its sources, or an installed wheel without csrc/:
    # neither "built from these sources" nor "stale", and loading it warns of nothing.
    from fastformer import _sources

    monkeypatch.setattr(_ext, "build_info", lambda: {"torch": torch.__version__})
    assert _ext.sources_match() is None
    monkeypatch.setattr(_ext, "build_info", lambda: {"sources": "0" * 64})
    monkeypatch.setattr(_sources, "digest", lambda csrc: None)
    assert _ext.sources_match() is None
    monkeypatch.undo()
    assert _load_warnings(monkeypatch, {"torch": torch.__version__}) == []


def test_cuda_kernels_compiled_reads_the_record_of_a_loaded_extension(monkeypatch):
    # A CPU-only build still records torch's CUDA version: only `cuda_compiled` says whether
    # nvcc ran; and a record of CUDA kernels counts for nothing when the extension did not load.
    monkeypatch.setattr(_ext, "build_info", lambda: {"cuda": "13.0", "cuda_compiled": False})
    assert _ext.cuda_kernels_compiled() is False
    monkeypatch.setattr(_ext, "build_info", lambda: {"cuda": "13.0", "cuda_compiled": True})
    assert _ext.cuda_kernels_compiled() is (_ext.extension_error() is None)
    monkeypatch.setattr(_ext, "extension_error", lambda: "fastformer._C is not built")
    assert _ext.cuda_kernels_compiled() is False


def test_build_info_is_none_without_a_record(monkeypatch, tmp_path):
    monkeypatch.setattr(_ext, "__file__", str(tmp_path / "_ext.py"))
    _ext.build_info.cache_clear()
    try:
        assert _ext.build_info() is None
    finally:
        monkeypatch.undo()
        _ext.build_info.cache_clear()
    assert _ext.build_info() is not None


def test_torch_mismatch_warns(monkeypatch):
    messages = _load_warnings(monkeypatch, {"torch": "0.0.0-other"})
    assert any("built against torch 0.0.0-other" in m and "make install" in m for m in messages)


def test_a_check_build_warns_where_a_gpu_would_run_it(monkeypatch):
    check = {"torch": torch.__version__, "cuda_compiled": True, "cuda_check_build": True}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    messages = _load_warnings(monkeypatch, check)
    assert any("check build (FASTFORMER_CUDA=check)" in m and "make install" in m for m in messages)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _load_warnings(monkeypatch, {**check, "cuda_check_build": False}) == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # CI's CPU stages
    assert _load_warnings(monkeypatch, check) == []


def _machine_code_built() -> bool:
    # A check build (FASTFORMER_CUDA=check: CI's stages on other torch versions) holds PTX of
    # its device code, not machine code; `make test` reads the full build's.
    return fastformer.cuda_kernels_compiled() and not fastformer.build_info().get(
        "cuda_check_build"
    )


def test_a_check_build_records_the_arch_it_holds():
    if not fastformer.build_info().get("cuda_check_build"):
        pytest.skip("not a check build (FASTFORMER_CUDA=check)")
    assert _cuobjdump.cuobjdump_path() is not None, "cuobjdump not found (CUDA toolkit or Triton)"
    recorded = fastformer.build_info()["arch_list"]
    held = _cuobjdump.ptx_archs(fastformer._C.__file__)
    assert held == {"sm_" + recorded.replace("+PTX", "").replace(".", "")}, (recorded, held)


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


def test_resource_usage_parser_sees_stack_frames():
    sample = (
        "Fatbin elf code:\n================\narch = sm_80\ncode version = [1,8]\n"
        "identifier = /src/csrc/layer_norm/layer_norm_cuda.cu\n\nResource usage:\n Common:\n"
        "  GLOBAL:0\n Function _Z3fooPf:\n"
        "  REG:64 STACK:8 SHARED:128 LOCAL:0 CONSTANT[0]:384 TEXTURE:0 SURFACE:0 SAMPLER:0\n"
    )
    usage = _cuobjdump.parse(sample)
    assert list(usage) == [("sm_80", "layer_norm_cuda.cu", "_Z3fooPf")]
    assert usage[("sm_80", "layer_norm_cuda.cu", "_Z3fooPf")]["STACK"] == 8


def test_cuobjdump_is_found_where_the_toolkit_or_the_setting_puts_it(monkeypatch, tmp_path):
    monkeypatch.setenv("CUOBJDUMP", "/opt/other/cuobjdump")
    assert _cuobjdump.cuobjdump_path() == "/opt/other/cuobjdump"
    monkeypatch.delenv("CUOBJDUMP")
    (tmp_path / "nvcc").touch()
    (tmp_path / "cuobjdump").touch()  # the toolkit's, next to an nvcc that is on the PATH
    tools = {"nvcc": str(tmp_path / "nvcc")}
    monkeypatch.setattr(_cuobjdump.shutil, "which", tools.get)
    assert _cuobjdump.cuobjdump_path() == str(tmp_path / "cuobjdump")


def test_cuobjdump_failure_is_an_error_not_an_empty_report(monkeypatch, tmp_path):
    tool = tmp_path / "cuobjdump"
    tool.write_text("#!/bin/sh\necho 'cuobjdump fatal: not an ELF' >&2\nexit 1\n")
    tool.chmod(0o755)
    monkeypatch.setenv("CUOBJDUMP", str(tool))
    with pytest.raises(RuntimeError, match="not an ELF"):
        _cuobjdump.resource_usage(tmp_path / "x.so")
    with pytest.raises(RuntimeError, match="-sass"):
        _cuobjdump.global_stores(tmp_path / "x.so")
    monkeypatch.setattr(_cuobjdump, "cuobjdump_path", lambda: None)
    with pytest.raises(RuntimeError, match="cuobjdump not found"):
        _cuobjdump.resource_usage(tmp_path / "x.so")


@needs_nvcc
def test_built_cuda_kernels_have_no_spills():
    """Every kernel of the built fastformer._C, for every arch of its arch list: a 0-byte stack
    frame and no local memory, hence no register spills (spilled registers live in the frame).

    Read from the binary the build made, with its flags: a separate compile of each .cu without
    the build's --use_fast_math passed while the build's sm_80 fused LayerNorm forward spilled."""
    if not _machine_code_built():
        pytest.skip("this build has no CUDA machine code")
    assert _cuobjdump.cuobjdump_path() is not None, "cuobjdump not found (CUDA toolkit or Triton)"
    usage = _cuobjdump.resource_usage(fastformer._C.__file__)
    arch_list = fastformer.build_info()["arch_list"].replace("+PTX", "")
    archs = {"sm_" + a.replace(".", "") for a in re.split(r"[;\s]+", arch_list.strip())}
    seen = {(arch, source) for arch, source, _ in usage}
    assert seen == {(arch, s.name) for arch in archs for s in CUDA_SOURCES}
    spilled = [
        f"{arch} {source} {kernel}: STACK {u.get('STACK')} LOCAL {u.get('LOCAL')}"
        for (arch, source, kernel), u in usage.items()
        if u.get("STACK") != 0 or u.get("LOCAL") != 0
    ]
    assert not spilled, "kernels with a stack frame or local memory:\n" + "\n".join(spilled)


# The kernels that move their data in 16-byte vectors (FFN: 16-bit with 8 values a vector, or
# fp32 with 4), and how many narrower global stores each may make: the LayerNorm forward's row
# statistics (mean, rstd); the FFN backward's fp32 column partials (any number of STG.E). nvcc
# once split such vector stores into four 4-byte stores (csrc/common/convert.cuh, store16).
_FFN_16 = r"I(?:(?:13__nv_bfloat16|6__half)L.*?ELi8EE|fL.*?ELi4EE)"
_VECTOR_KERNELS = [
    (re.compile(r"ln_fwd_vec_kernel"), {"STG.E": 2}),
    (re.compile(r"ln_fwd_chunk_kernel"), {"STG.E": 2}),  # mean and rstd, as the vector one
    (re.compile(r"ln_bwd_vec_kernel"), {}),
    (re.compile(r"ffn_forward_kernel" + _FFN_16), {}),
    (re.compile(r"ffn_backward_kernel" + _FFN_16), {"STG.E": None}),
]


def vector_store_problems(stores: dict) -> list[str]:
    """Kernels of `_VECTOR_KERNELS` whose global stores (`_cuobjdump.global_stores`) include
    narrower ones than those allowed; and a kernel family not found at all."""
    problems, found = [], set()
    for (arch, kernel), counts in stores.items():
        for index, (pattern, allowed) in enumerate(_VECTOR_KERNELS):
            if not pattern.search(kernel):
                continue
            found.add(index)
            for op, n in counts.items():
                limit = allowed.get(op, 0)
                if op != "STG.E.128" and limit is not None and n > limit:
                    problems.append(f"{arch} {kernel}: {n} x {op}")
    missing = [_VECTOR_KERNELS[i][0].pattern for i in range(len(_VECTOR_KERNELS)) if i not in found]
    return problems + [f"no kernel matches {m}" for m in missing]


@needs_nvcc
def test_built_vector_kernels_store_whole_16_byte_vectors():
    """The vector kernels of the built fastformer._C write their data with 16-byte stores only
    (STG.E.128), on every arch: see _VECTOR_KERNELS."""
    if not _machine_code_built():
        pytest.skip("this build has no CUDA machine code")
    assert _cuobjdump.cuobjdump_path() is not None, "cuobjdump not found (CUDA toolkit or Triton)"
    problems = vector_store_problems(_cuobjdump.global_stores(fastformer._C.__file__))
    assert not problems, "narrow stores in vector kernels:\n" + "\n".join(problems)


def test_vector_store_check_flags_split_stores():
    sass = (
        "\tcode for sm_90\n\t\tFunction : _ZN10fastformer17ln_fwd_vec_kernelI6__halfEEv\n"
        + "        /*0010*/ STG.E desc[UR4][R2.64], R5 ;\n" * 3
        + "        /*0020*/ @P0 STG.E.128 desc[UR4][R2.64], R8 ;\n"
        "\t\tFunction : _ZN10fastformer18ffn_forward_kernelI6__halfLNS_3ActE0ELi8EEEv\n"
        "        /*0030*/ STG.E.U16 desc[UR4][R2.64], R5 ;\n"
        "\t\tFunction : _ZN10fastformer18ffn_forward_kernelI6__halfLNS_3ActE0ELi1EEEv\n"
        "        /*0040*/ STG.E.U16 desc[UR4][R2.64], R5 ;\n"
    )
    stores = _cuobjdump.parse_stores(sass)
    assert stores[("sm_90", "_ZN10fastformer17ln_fwd_vec_kernelI6__halfEEv")] == {
        "STG.E": 3,
        "STG.E.128": 1,
    }
    problems = vector_store_problems(stores)
    assert any("ln_fwd_vec_kernel" in p and "3 x STG.E" in p for p in problems)
    assert any("ELi8E" in p and "STG.E.U16" in p for p in problems)
    assert not any("ELi1E" in p for p in problems)  # scalar variants may store 2 bytes
    assert any("no kernel matches ln_bwd_vec_kernel" in p for p in problems)
