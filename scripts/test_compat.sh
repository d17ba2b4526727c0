#!/usr/bin/env bash
# The test suite on another software stack, on CPU: a second venv and a copy of the source tree,
# so that the main build stays untouched. By default the GPU machine's (torch 2.11 + triton 3.6,
# see ENVIRONMENT.md); `make test-latest` sets COMPAT_TORCH, COMPAT_NUMPY, COMPAT_VENV and
# COMPAT_DIR for the newest torch and Triton on PyPI. It catches what only those versions break
# (torch library APIs, Triton codegen: the sm_90 compile check, the interpreter) before a GPU
# session or a user finds it.
#
#   scripts/test_compat.sh [pytest args...]      (or `make test-compat PYTEST_ARGS=...`)
#   scripts/test_compat.sh --venv-only           make the venv only (CI starts it early)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$ROOT/${COMPAT_VENV:-.venv-compat}
SRC=$ROOT/${COMPAT_DIR:-build/compat}
TORCH_SPEC=${COMPAT_TORCH:-torch==2.11.0}
# numpy<2.4: Triton 3.6's interpreter fails on NumPy 2.4 (fastformer refuses that pair).
NUMPY_SPEC=${COMPAT_NUMPY:-numpy<2.4}

# A CUDA build of torch takes ~5.5 GB in a venv. Without the room, this extra stage is reported
# as not run (loudly, exit 0): it re-checks on other versions what `make test` has just passed,
# and a full disk is the machine's state, not the code's. (CI's early --venv-only call asks for
# the room of both venvs, as the main one is being made beside it; short of that, it leaves the
# venv to the stage itself.)
NEED_GB=${COMPAT_NEED_GB:-8}
# A venv of another torch than the pinned one asked (LATEST_TORCH moved on) is made anew.
WANT=${TORCH_SPEC#torch==}
if [ -x "$VENV/bin/python" ] && [ "$WANT" != "$TORCH_SPEC" ]; then
    HAVE=$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' || true)
    if [ "$HAVE" != "$WANT" ]; then
        echo "$VENV has torch ${HAVE:-(none)}, $TORCH_SPEC asked: made anew"
        rm -rf "$VENV"
    fi
fi
if [ ! -x "$VENV/bin/python" ]; then
    FREE_GB=$(df -Pk "$ROOT" | awk 'NR == 2 {print int($4 / 1048576)}')
    if [ "$FREE_GB" -lt "$NEED_GB" ]; then
        if [ "${1:-}" = --venv-only ]; then
            echo "compat venv not made early: $FREE_GB GB free on $ROOT, $NEED_GB GB asked"
        else
            echo "COMPAT STAGE NOT RUN: $FREE_GB GB free on $ROOT;" \
                "the $TORCH_SPEC venv needs ~$NEED_GB GB"
        fi
        exit 0
    fi
    python3 -m venv "$VENV"
    # Byte-compiled at install: the CI VM sets PYTHONDONTWRITEBYTECODE=1, so with --no-compile
    # every process compiled torch's modules again on import (tests ~25% slower).
    "$VENV/bin/python" -m pip install -q "$TORCH_SPEC" "$NUMPY_SPEC" pytest \
        pytest-xdist pytest-timeout pytest-benchmark matplotlib ninja setuptools wheel ||
        { rm -rf "$VENV"; exit 1; }  # a half-made venv would be taken as ready next time
fi
"$VENV/bin/python" -c 'import torch, triton; print("compat stack: torch", torch.__version__, "triton", triton.__version__)'
[ "${1:-}" = --venv-only ] && exit 0

# The tracked and untracked-but-not-ignored files, as `git status` sees the tree.
rm -rf "$SRC"
mkdir -p "$SRC"
git ls-files -z -co --exclude-standard | tar --null -T - --ignore-failed-read -cf - | tar -xf - -C "$SRC"
cd "$SRC"
# The GPU machine is an H200: its arch alone (`make test` builds and checks sm_80 and sm_90). A
# check build (setup.py's _check_nvcc): the CUDA sources' host code against this torch, their
# device code to unoptimized PTX only; `make test` compiled it in full with the same nvcc. It
# took 53 s of CPU off each stage's build (of 164). COMPAT_CUDA=1 builds in full.
TORCH_CUDA_ARCH_LIST=${COMPAT_ARCHS:-9.0} FASTFORMER_CUDA=${COMPAT_CUDA:-check} \
    "$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps -e .
# Left out, to keep CI within its time (each is run by `make test`):
# - the CUDA emulator's tests: they run the .cu kernels compiled by g++, the same on any torch and
#   Triton, and would rebuild the emulator (minutes on 2 cores);
# - the GPU suite's tests: they run its bash script with a stub Python, no torch in it;
# - the CLI's tests: the GPU suite runs `check` and `bench` on torch 2.11 itself, and here their
#   cold torch.compile builds took minutes of CPU;
# - the sm_80 compile check: 107 Triton compiles (~290 s of CPU); this stage checks the GPU
#   machine's arch, sm_90;
# - the interpreter's extra tile-shape and TMA-twin grids (~90 s of CPU): on CPU they run the
#   same kernel code through another interpreter, not Triton 3.6's GPU code; the main parity
#   grid still runs here, and the TMA twins run on the GPU in the GPU suite;
# - the suite's own pytest options (test_conftest.py: pytest in subprocesses, ~24 s of CPU): pytest
#   is the same in every stage, the torch and Triton under test do not enter them;
# - the spill and store checks of the built kernels' machine code: a check build has none.
A=tests/test_attention.py
# COMPAT_COMPILE_FIRST=1 (CI): the sm_90 compile check first, alone (its 2 compile processes),
# then the tests without it, not 3-4 processes on 2 cores: on a 2-core VM the compat stage's tests
# took 477 s with the check beside them, and 310 + 129 s apart (2026-12-06; ~1 s of CPU a kernel).
if [ "${COMPAT_COMPILE_FIRST:-0}" = 1 ]; then
    "$VENV/bin/python" -m pytest "$A::test_compile_report[90]" "$@" -n 0
    set -- "$@" --deselect "$A::test_compile_report[90]"
fi
"$VENV/bin/python" -m pytest tests --ignore=tests/test_cuda_emu.py \
    --ignore=tests/test_gpu_suite.py --ignore=tests/test_cli.py \
    --ignore=tests/test_conftest.py \
    --deselect tests/test_build.py::test_built_vector_kernels_store_whole_16_byte_vectors \
    --deselect tests/test_build.py::test_built_cuda_kernels_have_no_spills \
    --deselect "$A::test_compile_report[80]" \
    --deselect "$A::test_parity_other_tile_shapes" \
    --deselect "$A::test_dropout_parity_other_tile_shapes" \
    --deselect "$A::test_tma_twin_is_bit_identical_to_pointer_loads" "$@"
