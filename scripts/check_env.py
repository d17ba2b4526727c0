"""Says which of fastformer's build/test requirements are missing from this Python, then exits 1.

Used by `make install` when PYTHON points at an existing environment (e.g. the GPU machine,
which has no network): it installs nothing, it only explains what is missing.
"""

import importlib.util
import sys

REQUIRED = {"torch": "torch>=2.11", "setuptools": "setuptools", "ninja": "ninja", "numpy": "numpy"}
# `bench` draws its plots with matplotlib; the tests use pytest (xdist for `-n 2`).
FOR_TESTS = {"pytest": "pytest", "xdist": "pytest-xdist", "matplotlib": "matplotlib"}


def main() -> int:
    missing = [spec for mod, spec in REQUIRED.items() if importlib.util.find_spec(mod) is None]
    if missing:
        print(f"{sys.executable} lacks: {' '.join(missing)}; run `pip install {' '.join(missing)}`")
        return 1
    absent = [spec for mod, spec in FOR_TESTS.items() if importlib.util.find_spec(mod) is None]
    if absent:
        print(f"note: {' '.join(absent)} not installed; `make test` and `make bench` need them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
