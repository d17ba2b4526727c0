"""The digest of fastformer._C's C++/CUDA sources (csrc/), recorded by setup.py in
_build_info.json and compared at import, so that a build older than its checkout's sources
(edited or pulled since) is noticed instead of silently running the old kernels.

Standard library only: setup.py loads this file by path, before the package can be imported.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

SUFFIXES = (".cpp", ".cu", ".h", ".cuh")


def digest(csrc: Path) -> str | None:
    """sha256 over every source file below `csrc` (relative path and bytes, in path order);
    None when `csrc` is not a folder (an installed wheel has no sources)."""
    if not csrc.is_dir():
        return None
    h = hashlib.sha256()
    for path in sorted(p for p in csrc.rglob("*") if p.suffix in SUFFIXES and p.is_file()):
        h.update(path.relative_to(csrc).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()
