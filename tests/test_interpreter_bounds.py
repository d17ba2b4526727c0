"""kernels/interpreter_bounds.py: an interpreted launch's access outside its tensors raises.

conftest.py keeps the check on for the whole test session, so these tests are also what shows
that the session's other interpreter tests were checked at all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="checks the Triton interpreter"
)

if os.environ.get("TRITON_INTERPRET") == "1":
    import triton
    import triton.language as tl
    from triton.runtime.errors import InterpreterError

    from fastformer.kernels import interpreter_bounds as bounds

    @triton.jit
    def shifted_copy(X, Y, n, shift, limit, BLOCK: tl.constexpr):
        # Y[i] = X[i + shift] for i < limit: with limit + shift > n the last lanes read past X.
        i = tl.arange(0, BLOCK)
        tl.store(Y + i, tl.load(X + i + shift, mask=i < limit, other=0.0), mask=i < limit)

    @triton.jit
    def shifted_store(X, Y, shift, limit, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(Y + i + shift, tl.load(X + i, mask=i < limit), mask=i < limit)

    @triton.jit
    def shifted_add(Y, shift, limit, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.atomic_add(Y + i + shift, 1.0, mask=i < limit)


def _xy(n: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(n, dtype=torch.float32), torch.zeros(n, dtype=torch.float32)


def test_in_bounds_launch_runs_and_gives_the_copy():
    x, y = _xy()
    shifted_copy[(1,)](x, y, 10, 1, 9, BLOCK=16)
    assert torch.equal(y[:9], x[1:]) and y[9] == 0


@pytest.mark.parametrize("shift, limit", [(1, 10), (-1, 3), (0, 11)])
def test_a_load_outside_its_tensor_raises(shift, limit):
    x, y = _xy()
    where = "bytes before" if shift < 0 else "bytes past the end of"
    with pytest.raises(InterpreterError, match=f"shifted_copy: a 4-byte load .*{where}"):
        shifted_copy[(1,)](x, y, 10, shift, limit, BLOCK=16)


def test_a_view_is_bounded_by_its_own_elements_not_its_storage():
    # A kernel given q of a packed qkv must not read k: the extent is the view's.
    storage = torch.arange(30, dtype=torch.float32)
    x, y = storage[10:20], torch.zeros(10)
    with pytest.raises(InterpreterError, match="past the end of argument 'X' \\(10,\\)"):
        shifted_copy[(1,)](x, y, 10, 1, 10, BLOCK=16)


def test_masked_lanes_are_not_checked():
    x, y = _xy()
    shifted_copy[(1,)](x, y, 10, 6, 4, BLOCK=16)  # lanes 4..15 would read x[10..21]
    assert torch.equal(y[:4], x[6:])


def test_a_store_and_an_atomic_outside_their_tensor_raise():
    x, y = _xy()
    with pytest.raises(InterpreterError, match="a 4-byte store .* past the end of argument 'Y'"):
        shifted_store[(1,)](x, y, 1, 10, BLOCK=16)
    with pytest.raises(InterpreterError, match="a 4-byte atomic .* past the end of argument 'Y'"):
        shifted_add[(1,)](y, 5, 6, BLOCK=8)


def test_the_hooks_leave_with_the_last_exit():
    cls = bounds._interp.InterpreterBuilder
    before = cls.__dict__["create_masked_load"]  # conftest's session-wide check is on
    with bounds.checked():
        with bounds.checked():
            pass
        assert cls.__dict__["create_masked_load"] is before
    assert cls.__dict__["create_masked_load"] is before
    assert before is bounds._masked_load


# kernels/attention._lse_log2 with its load one row too long, patched in by a fresh process
# (conftest's session-wide check is not there: the command's own check must catch it).
ONE_ROW_PAST = """
import sys
import triton
import triton.language as tl
from fastformer.cli import main
from fastformer.kernels import attention

@triton.jit
def lse_log2_one_row_past(Lse, row_ptrs, rows, Lq):
    lse = tl.load(Lse + row_ptrs, mask=rows < Lq + 1, other=0.0)
    return tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)

attention._lse_log2 = lse_log2_one_row_past
sys.exit(main(sys.argv[1:]))
"""


def test_check_interpret_errors_a_case_whose_kernel_reads_outside_its_tensors():
    # The backward reading the LSE one row past its end: parity passes (the row's results
    # are masked out), a GPU reads another allocation. The bounds check makes the case ERROR.
    argv = ["check", "--quick", "--interpret", "--ops", "attention", "--shard", "1/3", "--json"]
    proc = subprocess.run(
        [sys.executable, "-c", ONE_ROW_PAST, *argv], capture_output=True, text=True
    )
    rows = json.loads(proc.stdout)["rows"] if proc.stdout.startswith("{") else []
    errors = [r["message"] for r in rows if r["backend"] == "triton" and r["status"] == "ERROR"]
    assert proc.returncode == 1 and errors, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert all("attn_bwd_dq: a 4-byte load" in e and "past the end of" in e for e in errors)
