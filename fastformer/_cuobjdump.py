"""Registers, stack frames and local memory of compiled CUDA kernels, as `cuobjdump -res-usage`
reads them from a binary (the built extension, or a cubin Triton built); and the global stores
of their machine code (`cuobjdump -sass`).

Spilled registers live in a kernel's stack frame, so a kernel with an empty frame and no local
memory does not spill. Reading the binary itself checks what runs: a separate compile uses other
flags (the extension's build adds --use_fast_math; Triton runs the ptxas of its wheel with
-lineinfo and, from 3.8, --regAllocOptLevel=2), and both times passed kernels that spilled.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path


def cuobjdump_path() -> str | None:
    """CUOBJDUMP if set, else the CUDA toolkit's (on the PATH or next to nvcc), else the copy
    Triton's wheel ships (3.6, 3.8 and 3.9 do); None when there is none."""
    if os.environ.get("CUOBJDUMP"):
        return os.environ["CUOBJDUMP"]
    candidates = [shutil.which("cuobjdump")]
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    candidates.append(str(Path(nvcc).parent / "cuobjdump"))
    triton = importlib.util.find_spec("triton")
    if triton is not None and triton.origin is not None:
        candidates.append(str(Path(triton.origin).parent / "backends/nvidia/bin/cuobjdump"))
    return next((p for p in candidates if p and Path(p).exists()), None)


def parse(report: str) -> dict[tuple[str, str, str], dict[str, int]]:
    """{(arch, source file name, kernel): {"REG": .., "STACK": .., "LOCAL": .., ...}} parsed from
    `cuobjdump -res-usage` output (a cubin has no source name: "")."""
    usage, arch, source, kernel = {}, "", "", None
    for line in report.splitlines():
        line = line.strip()
        if line.startswith("arch = "):
            arch = line.removeprefix("arch = ")
        elif line.startswith("identifier = "):
            source = Path(line.removeprefix("identifier = ")).name
        elif line.startswith("Function "):
            kernel = line.removeprefix("Function ").rstrip(":")
        elif kernel and line.startswith("REG:"):
            fields = dict(field.split(":", 1) for field in line.split())
            usage[(arch, source, kernel)] = {k: int(v) for k, v in fields.items() if v.isdigit()}
            kernel = None
    return usage


def _cuobjdump(option: str, binary: str | os.PathLike) -> str:
    """The output of `cuobjdump OPTION BINARY`; RuntimeError without cuobjdump or on failure."""
    tool = cuobjdump_path()
    if tool is None:
        raise RuntimeError("cuobjdump not found (CUDA toolkit or Triton's wheel; CUOBJDUMP)")
    result = subprocess.run([tool, option, str(binary)], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"cuobjdump {option} {binary} failed:\n{result.stderr[-2000:]}")
    return result.stdout


def resource_usage(binary: str | os.PathLike) -> dict[tuple[str, str, str], dict[str, int]]:
    """`parse` of `cuobjdump -res-usage BINARY`; RuntimeError without cuobjdump or on failure."""
    return parse(_cuobjdump("-res-usage", binary))


_PTX_FILE = re.compile(r"^PTX file\s+\d+: .*\.(sm_\d+a?)\.ptx$", re.M)


def ptx_archs(binary: str | os.PathLike) -> set[str]:
    """The archs ("sm_90") whose PTX `binary` embeds (`cuobjdump -lptx`)."""
    return set(_PTX_FILE.findall(_cuobjdump("-lptx", binary)))


_STORE = re.compile(r"\bSTG(\.[A-Z0-9]+)*")


def parse_stores(sass: str) -> dict[tuple[str, str], Counter]:
    """{(arch, kernel): Counter of its global store opcodes ("STG.E.128", "STG.E.U16", ...)}
    parsed from `cuobjdump -sass` output."""
    stores: dict[tuple[str, str], Counter] = {}
    arch, kernel = "", None
    for line in sass.splitlines():
        line = line.strip()
        if line.startswith("code for sm_"):
            arch = line.removeprefix("code for ")
        elif line.startswith("Function : "):
            kernel = line.removeprefix("Function : ")
            stores[(arch, kernel)] = Counter()
        elif kernel is not None:
            match = _STORE.search(line)
            if match:
                stores[(arch, kernel)][match.group(0)] += 1
    return stores


def global_stores(binary: str | os.PathLike) -> dict[tuple[str, str], Counter]:
    """`parse_stores` of `cuobjdump -sass BINARY`; RuntimeError as `resource_usage`."""
    return parse_stores(_cuobjdump("-sass", binary))
