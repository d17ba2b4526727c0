"""Loading of the compiled extension fastformer._C and the record of how it was built."""

from __future__ import annotations

import functools
import importlib
import json
import warnings
from pathlib import Path
from types import ModuleType

import torch

BUILD_HINT = (
    "build it from the repository root with `make install` "
    "(or `pip install --no-build-isolation -e .` inside an environment that has torch)"
)


@functools.cache
def build_info() -> dict | None:
    """What setup.py recorded: torch and CUDA versions, arch list, whether CUDA was compiled."""
    path = Path(__file__).with_name("_build_info.json")
    if not path.exists():
        return None
    return json.loads(path.read_text())


def sources_match() -> bool | None:
    """Whether fastformer._C was built from the csrc/ next to this package as it is now; None
    when that cannot be told (no csrc/: an installed wheel; or a build that predates the
    record)."""
    from fastformer import _sources

    recorded = (build_info() or {}).get("sources")
    current = _sources.digest(Path(__file__).resolve().parent.parent / "csrc")
    if recorded is None or current is None:
        return None
    return recorded == current


@functools.cache
def _load() -> tuple[ModuleType | None, str | None]:
    try:
        module = importlib.import_module("fastformer._C")
    except ImportError as exc:
        return None, f"fastformer._C is not built ({exc}); {BUILD_HINT}"
    info = build_info()
    if info is not None and info.get("torch") != torch.__version__:
        warnings.warn(
            f"fastformer._C was built against torch {info.get('torch')} but torch "
            f"{torch.__version__} is running; rebuild: {BUILD_HINT}",
            RuntimeWarning,
            stacklevel=3,
        )
    if info is not None and info.get("cuda_check_build") and torch.cuda.is_available():
        warnings.warn(
            "fastformer._C is a check build (FASTFORMER_CUDA=check): its CUDA kernels are "
            f"unoptimized PTX, built only to check that the sources compile; rebuild: {BUILD_HINT}",
            RuntimeWarning,
            stacklevel=3,
        )
    if sources_match() is False:
        warnings.warn(
            "fastformer._C was built from other sources than csrc/ holds now (edited or pulled "
            f"since the build): its kernels are the old ones; rebuild: {BUILD_HINT}",
            RuntimeWarning,
            stacklevel=3,
        )
    return module, None


def load_extension() -> ModuleType | None:
    """fastformer._C (its ops now registered under torch.ops.fastformer), or None if not built."""
    return _load()[0]


def extension_error() -> str | None:
    """None when fastformer._C is loaded, else why not and how to build it."""
    return _load()[1]


def require_extension() -> ModuleType:
    """fastformer._C, or a RuntimeError that says how to build it."""
    module, error = _load()
    if module is None:
        raise RuntimeError(error)
    return module


def cuda_kernels_compiled() -> bool:
    """True when fastformer._C holds CUDA kernels (built with nvcc against a CUDA torch)."""
    info = build_info()
    return extension_error() is None and bool(info and info.get("cuda_compiled"))
