"""Build of fastformer and its extension fastformer._C.

C++ sources are always built; CUDA sources (csrc/**/*.cu) when nvcc and a CUDA build of torch
are present. FASTFORMER_CUDA=auto|0|1|check (1: fail loudly when CUDA cannot be built; check: see
_check_nvcc), TORCH_CUDA_ARCH_LIST (default "8.0;9.0"), MAX_JOBS and NVCC_THREADS (default 2)
are respected.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
DEFAULT_ARCHS = "8.0;9.0"


def _find_cuda_home() -> str | None:
    """CUDA_HOME, else the folder above nvcc; torch guesses /usr/local when nvcc is a symlink."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    for candidate in ("/usr/local/cuda",):
        if os.path.exists(os.path.join(candidate, "bin", "nvcc")):
            return candidate
    nvcc = shutil.which("nvcc")
    if nvcc:
        return str(Path(os.path.realpath(nvcc)).parent.parent)
    return None


CUDA_HOME = _find_cuda_home()
if CUDA_HOME:
    # Must be set before torch.utils.cpp_extension is imported: it reads CUDA_HOME at import.
    os.environ["CUDA_HOME"] = CUDA_HOME
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCHS)

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def _cuda_mode() -> str:
    mode = os.environ.get("FASTFORMER_CUDA", "auto").lower()
    if mode not in ("auto", "0", "1", "check"):
        sys.exit(f"FASTFORMER_CUDA must be auto, 0, 1 or check, got {mode!r}")
    return mode


def _want_cuda() -> bool:
    mode = _cuda_mode()
    problems = []
    if torch.version.cuda is None:
        problems.append(f"torch {torch.__version__} is not a CUDA build")
    if CUDA_HOME is None:
        problems.append("nvcc not found (set CUDA_HOME)")
    if mode in ("1", "check") and problems:
        sys.exit(f"FASTFORMER_CUDA={mode} but CUDA cannot be built: " + "; ".join(problems))
    if mode == "auto" and problems:
        print("fastformer: building without CUDA kernels: " + "; ".join(problems))
    return mode != "0" and not problems


def _wheel_cuda_includes() -> list[str]:
    """Headers torch's pip wheels ship (cuBLAS, cuSPARSE, ...) but a bare CUDA toolkit may lack."""
    found = []
    for base in sys.path:
        for inc in glob.glob(os.path.join(base, "nvidia", "*", "include")):
            if os.path.exists(os.path.join(inc, "cublasLt.h")) or os.path.exists(
                os.path.join(inc, "cusparse.h")
            ):
                found.append(inc)
    return sorted(set(found))


def _cublaslt_link() -> tuple[list[str], list[str]]:
    """(library_dirs, link args) for the cuBLASLt torch loads (csrc/ffn/ffn_lt.cpp calls it;
    torch's extension builder links cudart only): libcublasLt.so.<torch's CUDA major> in a pip
    wheel's nvidia/*/lib, torch/lib or CUDA_HOME/lib64, linked by its file name (the wheels ship
    no unversioned libcublasLt.so) with its folder on the rpath; else plain -lcublasLt, from the
    linker's own paths (a system CUDA)."""
    torch_dir = Path(torch.__file__).parent
    sites = [str(torch_dir.parent)] + sys.path
    folders = [os.path.join(site, "nvidia", "*", "lib") for site in sites]
    folders += [str(torch_dir / "lib")] + ([os.path.join(CUDA_HOME, "lib64")] if CUDA_HOME else [])
    name = f"libcublasLt.so.{(torch.version.cuda or '').split('.')[0]}"
    for folder in folders:
        for lib in sorted(glob.glob(os.path.join(folder, name))):
            where = os.path.dirname(lib)
            return [where], [f"-l:{name}", f"-Wl,-rpath,{where}"]
    return [], ["-lcublasLt"]


def _check_nvcc() -> list[str]:
    """nvcc's flags of a check build (FASTFORMER_CUDA=check), for CI's stages on other torch
    versions: the CUDA sources' host code is compiled as in a full build, against that torch's
    headers; their device code only to unoptimized PTX (cicc -O0, no ptxas) of the list's first
    arch. `make test` builds the same device code in full with the same nvcc. The LayerNorm .cu
    file took 15 s instead of 62 (cicc 33 s, ptxas 22 s; 2-core VM, sm_90). Such a build's
    kernels are for no GPU: fastformer warns when one is loaded where a GPU is."""
    arch = _check_arch().replace(".", "")
    # Naming an arch here keeps torch's builder from adding its own -gencode flags.
    return ["-Xcicc", "-O0", f"-gencode=arch=compute_{arch},code=compute_{arch}"]


def _check_arch() -> str:
    """The one arch ("9.0") a check build holds PTX of: the first of TORCH_CUDA_ARCH_LIST."""
    return re.split(r"[;\s]+", os.environ["TORCH_CUDA_ARCH_LIST"].replace("+PTX", "").strip())[0]


def _sources(with_cuda: bool) -> list[str]:
    cpp = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
    cu = sorted(glob.glob("csrc/**/*.cu", recursive=True)) if with_cuda else []
    return cpp + cu


def _sources_digest() -> str | None:
    # fastformer/_sources.py by path: the package itself cannot be imported before it is built.
    spec = importlib.util.spec_from_file_location("_sources", ROOT / "fastformer" / "_sources.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.digest(ROOT / "csrc")


def _built_archs() -> str:
    # A check build holds PTX of one arch whatever the list names (_check_nvcc).
    if _cuda_mode() == "check":
        return _check_arch() + "+PTX"
    return os.environ["TORCH_CUDA_ARCH_LIST"]


def _build_info(with_cuda: bool, sources: str | None) -> dict:
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda if with_cuda else None,
        "cuda_compiled": with_cuda,
        "arch_list": _built_archs() if with_cuda else None,
        "cuda_check_build": with_cuda and _cuda_mode() == "check",
        "cuda_home": CUDA_HOME if with_cuda else None,
        "sources": sources,
    }


def _extension():
    with_cuda = _want_cuda()
    # at::parallel_for is inline OpenMP in ATen's headers: without -fopenmp it runs serially.
    # -g0: Python's own CFLAGS carry -g, and debug info for torch's templates doubled the compile
    # time of every .cpp file (rng.cpp: 52 s -> 23 s on a CI core). -Wno-unknown-pragmas: the
    # headers shared with nvcc hold `#pragma unroll`.
    cxx = ["-O3", "-fopenmp", "-g0", "-Wno-unknown-pragmas"]
    nvcc = ["-O3", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr"]
    # One .cu file is compiled per arch of the list: let nvcc run those at once (the longest
    # file is the build's critical path on a many-core machine).
    nvcc += ["--threads", os.environ.get("NVCC_THREADS", "2")]
    if _cuda_mode() == "check":
        nvcc += _check_nvcc()
    macros = [("FASTFORMER_WITH_CUDA", "1")] if with_cuda else []
    kwargs = dict(
        name="fastformer._C",
        sources=_sources(with_cuda),
        include_dirs=[str(ROOT / "csrc")] + (_wheel_cuda_includes() if with_cuda else []),
        define_macros=macros,
        extra_compile_args={"cxx": cxx, "nvcc": nvcc} if with_cuda else {"cxx": cxx},
        extra_link_args=["-fopenmp"],
        py_limited_api=False,
    )
    if with_cuda:
        library_dirs, link = _cublaslt_link()
        kwargs["library_dirs"] = library_dirs
        kwargs["extra_link_args"] += link
        return CUDAExtension(**kwargs), with_cuda
    return CppExtension(**kwargs), with_cuda


EXTENSION, WITH_CUDA = _extension()


class Build(BuildExtension):
    """Records what was built next to the package, so import can detect a torch mismatch or
    sources changed since the build."""

    def finalize_options(self) -> None:
        super().finalize_options()
        # A fixed object folder (pip's editable build would use a fresh temp dir) keeps ninja's
        # rebuilds incremental.
        self.build_temp = str(ROOT / "build" / "temp")

    def build_extension(self, ext) -> None:
        # setuptools sorts the sources by name, and ninja starts them in that order. The
        # LayerNorm .cu file is a build's critical path (65 s of a 100 s sm_90 build on 2 cores,
        # started 36 s in): the CUDA files first, the longest first, overlap it with the rest.
        compile_ = self.compiler.compile

        def longest_first(sources, *args, **kwargs):
            def cost(path: str) -> tuple[bool, int]:
                return (not path.endswith(".cu"), -os.path.getsize(path))

            return compile_(sorted(sources, key=cost), *args, **kwargs)

        self.compiler.compile = longest_first
        try:
            super().build_extension(ext)
        finally:
            self.compiler.compile = compile_

    def run(self) -> None:
        sources = _sources_digest()  # what this build compiles, read before it starts
        super().run()
        info = json.dumps(_build_info(WITH_CUDA, sources), indent=2)
        (ROOT / "fastformer" / "_build_info.json").write_text(info + "\n")
        if self.build_lib and not self.inplace:
            out = Path(self.build_lib) / "fastformer"
            out.mkdir(parents=True, exist_ok=True)
            (out / "_build_info.json").write_text(info + "\n")


setup(
    packages=find_packages(include=["fastformer", "fastformer.*"]) + ["fastformer.kernels"],
    package_dir={"fastformer.kernels": "kernels"},
    package_data={"fastformer": ["_build_info.json"]},
    ext_modules=[EXTENSION],
    cmdclass={"build_ext": Build.with_options(use_ninja=True)},
)
