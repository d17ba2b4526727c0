"""kernels/interpreter_bounds.py: an interpreted launch's access outside its tensors raises.

conftest.py keeps the check on for the whole test session, so these tests are also what shows
that the session's other interpreter tests were checked at all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="checks the Triton interpreter"
)

if os.environ.get("TRITON_INTERPRET") == "1":
    import triton
    import triton.language as tl
    from triton.runtime.errors import InterpreterError

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

    @triton.jit
    def row_copy(X, Y, n_rows, n, BLOCK: tl.constexpr):
        # One program a row; a scalar condition masks the programs past the last row (the
        # interpreter hands such a mask over as 0/1 integers).
        row = tl.program_id(0)
        i = tl.arange(0, BLOCK)
        keep = (i < n) & (row < n_rows)
        tl.store(Y + row * BLOCK + i, tl.load(X + row * n + i, mask=keep, other=0.0), mask=keep)

    @triton.jit
    def wide_load(X, Y, offset):
        tl.store(Y, tl.load((X + offset).to(tl.pointer_type(tl.int64))))

    @triton.jit
    def tuple_copy(XY, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(XY[1] + i, tl.load(XY[0] + i, mask=i < n), mask=i < n)

    @triton.jit
    def descriptor_copy(XD, Y, R: tl.constexpr, C: tl.constexpr):
        r, c = tl.arange(0, R)[:, None], tl.arange(0, C)[None, :]
        tl.store(Y + r * C + c, XD.load([0, 0]))

    @triton.jit
    def swap_at(X, offset):
        tl.atomic_cas(X + offset, 0.0, 1.0)


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


def test_the_error_names_the_argument_nearest_to_the_access():
    # X's end is 1 element behind the lane, Y's start 2 further on: X is named, not the
    # argument whose start is nearer than X's.
    buf = torch.zeros(32)
    x, y = buf[:10], buf[12:22]
    with pytest.raises(InterpreterError, match="0 bytes past the end of argument 'X'"):
        shifted_copy[(1,)](x, y, 10, 1, 10, BLOCK=16)


def test_a_view_is_bounded_by_its_own_elements_not_its_storage():
    # The extent is the view's own span, not its storage's: reading on past a slice is caught.
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


def test_masks_of_scalar_conditions_check_every_lane():
    # As an index array, a 0/1 mask checked lanes 0 and 1 only: the all-masked program past
    # the last row raised, and a read of X[2..3] passed.
    x, y = torch.arange(4.0), torch.zeros(8)
    from fastformer.kernels.attention import _triton_version

    if _triton_version() >= (3, 9):
        # Triton 3.9's interpreter refuses such a mask itself, after the check passed it (no
        # fastformer kernel builds one: their masks are boolean).
        with pytest.raises(InterpreterError, match="ValueError\\('mask has unsupported dtype'\\)"):
            row_copy[(2,)](x, y, 1, 4, BLOCK=4)
    else:
        row_copy[(2,)](x, y, 1, 4, BLOCK=4)
        assert torch.equal(y, torch.cat([x, torch.zeros(4)]))
    with pytest.raises(InterpreterError, match="row_copy: a 4-byte load on 2 unmasked lane"):
        row_copy[(1,)](torch.arange(2.0), torch.zeros(4), 1, 4, BLOCK=4)


def test_a_wide_access_straddling_the_end_and_a_launch_without_tensors():
    x, y = torch.zeros(4), torch.zeros(1, dtype=torch.int64)
    with pytest.raises(InterpreterError, match="a 8-byte load .* 4 bytes before the end \\(str"):
        wide_load[(1,)](x, y, 3)
    with pytest.raises(InterpreterError, match="no tensor argument with elements"):
        wide_load[(1,)](torch.zeros(0), torch.zeros(0, dtype=torch.int64), 0)


def test_an_access_of_another_width_is_bounded_by_the_extent_alone():
    # A load that reinterprets its argument's bytes (8 of a float32 view with stride 2, from
    # its second element on) has no element grid to fall between: inside the extent passes.
    x, y = torch.arange(8.0)[::2], torch.zeros(1, dtype=torch.int64)
    wide_load[(1,)](x, y, 1)
    assert y.view(torch.float32)[0] == 1.0 and y.view(torch.float32)[1] == 2.0


def test_tensors_in_tuples_keywords_and_host_descriptors_are_arguments_too():
    x, y = _xy()
    tuple_copy[(1,)]((x, y), 10, BLOCK=16)
    assert torch.equal(y, x)
    with pytest.raises(InterpreterError, match="tuple_copy: a 4-byte load on 1 unmasked lane"):
        tuple_copy[(1,)]((x, y), 11, BLOCK=16)
    y.zero_()
    shifted_copy[(1,)](X=x, Y=y, n=10, shift=1, limit=9, BLOCK=16)
    assert torch.equal(y[:9], x[1:])
    # A host-side TensorDescriptor: its loads are accesses of its base tensor.
    from triton.tools.tensor_descriptor import TensorDescriptor

    x, y = torch.arange(32.0).reshape(4, 8), torch.zeros(4, 8)
    descriptor_copy[(1,)](TensorDescriptor.from_tensor(x, [4, 8]), y, 4, 8)
    assert torch.equal(y, x)


def test_a_compare_and_swap_outside_its_tensor_raises():
    x = torch.zeros(4)
    swap_at[(1,)](x, 3)
    assert x[3] == 1.0
    with pytest.raises(InterpreterError, match="swap_at: a 4-byte atomic .* 0 bytes past the end"):
        swap_at[(1,)](x, 4)


def test_a_launch_from_a_pre_run_hook_leaves_the_outer_launch_checked(monkeypatch):
    x, y = _xy()

    def hook(*args, **kwargs):
        shifted_add[(1,)](torch.zeros(4), 0, 4, BLOCK=4)

    monkeypatch.setattr(shifted_copy, "pre_run_hooks", [hook])
    with pytest.raises(InterpreterError, match="shifted_copy: a 4-byte load"):
        shifted_copy[(1,)](x, y, 10, 1, 10, BLOCK=16)


def test_the_hooks_leave_with_the_last_exit():
    # In a fresh process: this one's conftest keeps the check on for the whole session.
    script = """
from triton.runtime.interpreter import InterpreterBuilder as B
from fastformer.kernels import interpreter_bounds as bounds
original = B.__dict__["create_masked_load"]
with bounds.checked():
    with bounds.checked():
        pass
    assert B.__dict__["create_masked_load"] is bounds._masked_load
assert B.__dict__["create_masked_load"] is original
print("restored")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.stdout.strip() == "restored", proc.stderr[-3000:]


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


def test_an_access_running_from_one_argument_into_the_next_raises():
    # Each lane lies inside some argument (two adjacent slices of one buffer), but one access
    # comes from one base pointer: lanes 10..15 of the load from X read Y's first bytes.
    buffer = torch.arange(26, dtype=torch.float32)
    x, y = buffer[:10], buffer[10:]
    with pytest.raises(
        InterpreterError,
        match="shifted_copy: a 4-byte load whose unmasked lanes span more than one tensor "
        "argument: its first lane in argument 'X' .*, its last in argument 'Y' \\(16,\\) "
        "torch.float32 stride \\(1,\\), 20 bytes into it",
    ):
        shifted_copy[(1,)](x, y, 10, 0, 16, BLOCK=16)
    shifted_copy[(1,)](x, y, 10, 0, 10, BLOCK=16)  # the same load within X runs
    assert torch.equal(y[:10], x)


def test_an_access_between_the_elements_of_a_strided_argument_raises():
    # x is every other element of a buffer (a packed pair's first half): a contiguous read of
    # x stays inside its span but reads the other half's elements.
    pairs = torch.arange(16, dtype=torch.float32).view(8, 2)
    x, y = pairs[:, 0], torch.zeros(8)
    with pytest.raises(
        InterpreterError,
        match="shifted_copy: a 4-byte load on 7 unmasked lane\\(s\\) between the elements of "
        "argument 'X' \\(8,\\) torch.float32 stride \\(2,\\), the lowest 4 bytes into it",
    ):
        shifted_copy[(1,)](x, y, 8, 0, 15, BLOCK=16)
    shifted_copy[(1,)](x.contiguous(), y, 8, 0, 8, BLOCK=16)
    assert torch.equal(y, x)
    # Inside two strided arguments' extents (X within Y's), the error names the smaller one.
    buf = torch.zeros(32)
    with pytest.raises(InterpreterError, match="between the elements of argument 'X' \\(7,\\)"):
        shifted_copy[(1,)](buf[2:16:2], buf[0:32:2], 7, 0, 13, BLOCK=16)


@pytest.mark.parametrize(
    "shape, stride, interleaved",
    [((4, 3), (3, 1), False), ((3, 4), (1, 3), False), ((2, 5, 3), (0, 3, 1), False),
     ((3, 2), (4, 1), False), ((2, 3), (1, 4), False), ((2, 2), (6, 2), False),
     ((4, 1), (2, 3), False), ((3, 2), (2, 3), True), ((2, 2), (2, 2), True)],
)  # fmt: skip
def test_element_offsets_of_a_layout(shape, stride, interleaved):
    # Every element's offset is accepted and every other byte of the extent refused, computed
    # from the layout directly; interleaved dims are not judged (nothing refused).
    from fastformer.kernels.interpreter_bounds import _Arg

    t = torch.zeros(64).as_strided(shape, stride)
    arg = _Arg("t", t)
    idx = torch.cartesian_prod(*(torch.arange(n) for n in shape)).view(-1, len(shape))
    elements = set(((idx * torch.tensor(stride)).sum(1) * 4).tolist())
    offsets = np.arange(arg.hi - arg.lo, dtype=np.int64)
    strays = set(arg.strays(offsets.astype(np.uint64) + np.uint64(arg.lo), 4).tolist())
    assert (arg.dims is None) == interleaved
    assert strays == (set() if interleaved else set(offsets.tolist()) - elements)
