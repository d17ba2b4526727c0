"""The environment manifest shared by `info`, `check` and `bench`: versions, devices, build."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    """stdout of `cmd`, or None when it is missing, fails or hangs (never raises)."""
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_sha() -> str | None:
    """Commit of the source tree fastformer runs from (None outside a git checkout of it: a
    package copied or installed into another project's repository is not that project's)."""
    # Tracked where it lies (a subfolder of a larger repository counts); untracked: a copy.
    tracked = _run(["git", "ls-files", "fastformer/cli/env.py"], cwd=REPO_ROOT)
    if tracked != "fastformer/cli/env.py":
        return None
    sha = _run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT)
    if sha is None:
        return None
    # (this tree only: in a larger repository, others' changes are not fastformer's)
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no", "--", "."], cwd=REPO_ROOT)
    return sha + ("-dirty" if dirty else "")


def triton_version() -> str | None:
    """triton.__version__, or None when Triton is not installed."""
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def triton_launches() -> str | None:
    """Which path attention's Triton launches take (fastformer.kernels.launcher.status), or
    None without Triton."""
    try:
        from fastformer.kernels import launcher
    except ImportError:
        return None
    return launcher.status()


def triton_interpret() -> bool:
    """Whether Triton's interpreter runs its kernels (TRITON_INTERPRET=1): their times then
    measure Python on the CPU, not the kernels."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


L3_SIZE_PATH = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")


def cpu_l3_bytes(path: Path = L3_SIZE_PATH) -> int | None:
    """cpu0's level-3 cache in bytes, from Linux's sysfs (None where it is not there): the size
    against which the CPU LayerNorm decides to stream its outputs (csrc/common/stream_store.h),
    so it changes which kernels run."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    digits = text[:-1] if scale > 1 else text
    return int(digits) * scale if digits.isdigit() else None


def nvidia_driver() -> str | None:
    """The NVIDIA driver version (nvidia-smi, else /proc/driver/nvidia/version)."""
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if out:
        return out.splitlines()[0].strip()
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    for word in text.split():
        if word.count(".") >= 1 and word.replace(".", "").isdigit():
            return word
    return None


def gpus() -> list[dict[str, Any]]:
    """Name, compute capability, memory and SM count of every visible CUDA device."""
    if not torch.cuda.is_available():
        return []
    found = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        found.append(
            {
                "index": index,
                "name": props.name,
                "capability": f"{props.major}.{props.minor}",
                "memory_gib": round(props.total_memory / 2**30, 1),
                "sm_count": props.multi_processor_count,
            }
        )
    return found


def build() -> dict[str, Any]:
    """How fastformer._C was built and whether it loads."""
    from fastformer import _ext

    return {
        "build_info": _ext.build_info(),
        "sources_match": _ext.sources_match(),
        "cuda_kernels_compiled": _ext.cuda_kernels_compiled(),
        "extension_error": _ext.extension_error(),
    }


def manifest() -> dict[str, Any]:
    """Everything needed to reproduce or compare a run, JSON-serialisable."""
    import fastformer

    gpu_list = gpus()
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "fastformer": fastformer.__version__,
        "git_sha": git_sha(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "triton": triton_version(),
        "triton_launches": triton_launches(),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "driver": nvidia_driver() if gpu_list else None,
        "machine": "gpu" if gpu_list else "cpu",
        "gpu": gpu_list[0]["name"] if gpu_list else None,
        "gpus": gpu_list,
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "cpu_l3_bytes": cpu_l3_bytes(),
        "torch_threads": torch.get_num_threads(),
        "triton_interpret": triton_interpret(),
        # What changes which kernels run: forced backends, FASTFORMER_ATTN_TMA, ...
        "fastformer_env": {
            k: v for k, v in sorted(os.environ.items()) if k.startswith("FASTFORMER_")
        },
        **build(),
    }
