"""fastformer.testing's parity helpers (what tests/ and `python -m fastformer check` use) fail
wrong implementations that a looser comparison passed (found by a hunt of check)."""

from __future__ import annotations

import math

import pytest
import torch

from fastformer.testing import assert_parity, compare_with_reference, max_abs_diff, parity


def _failed(results) -> list[str]:
    return [r.name for r in results if not r.passed]


def test_an_op_that_changes_its_input_in_place_fails():
    # The reference copies were made after the fast op ran: an op that scaled its caller's
    # float mask in place (the exp2 trick) was compared with a reference fed the scaled mask.
    x, mask = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4)

    def fast(x, mask):
        mask.mul_(1.4427)
        return x + mask

    results = compare_with_reference(fast, lambda x, mask: x + mask, [x, mask])
    assert _failed(results) == ["input[1] modified in place"]
    for special in (float("nan"), float("inf")):  # overwriting NaN or inf is a change too
        held = torch.full((3, 4), special)
        results = compare_with_reference(
            lambda x, m: x + m.nan_to_num_().sub(m), lambda x, m: x + m - m, [x, held]
        )
        assert "input[1] modified in place" in _failed(results)
    untouched = torch.randn(3, 4)
    assert_parity(compare_with_reference(lambda x, m: x + m, lambda x, m: x + m, [x, untouched]))


def test_an_output_of_another_dtype_fails():
    # float32 returned for float16 inputs passed: only values were compared.
    x = torch.randn(8, dtype=torch.float16, requires_grad=True)
    results = compare_with_reference(lambda x: x.float() * 2, lambda x: x * 2, [x])
    assert _failed(results) == ["out[0] dtype torch.float32 vs torch.float16"]


def test_names_must_label_every_gradient():
    # zip() with fewer names than gradients dropped the rest: a missing weight gradient passed.
    x, w = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
    with pytest.raises(ValueError, match="names: 1 given for 2 inputs"):
        compare_with_reference(lambda x, w: x * w, lambda x, w: x * w, [x, w], names=["x"])
    # one name per input: those that need no gradient (None, a mask) are left out
    results = compare_with_reference(
        lambda x, b, w: x * w, lambda x, b, w: x * w, [x, None, w], names=["x", "bias", "w"]
    )
    assert [r.name for r in results] == ["out", "dx", "dw"] and not _failed(results)


def test_a_tensor_passed_twice_is_one_tensor_for_the_reference():
    # q = k = v: the fast op's gradient of the shared tensor is the sum over its uses, while the
    # reference ran on separate copies and gave each use's part: a correct op failed.
    x = torch.randn(5, requires_grad=True)
    assert_parity(compare_with_reference(lambda a, b: a * b, lambda a, b: a * b, [x, x]))


def test_bool_outputs_compare_exactly_and_nothing_compared_fails():
    # Fixed values: with randn(6), no element fell in (0, 1) one run in twelve (CI stop 54).
    x = torch.tensor([-1.5, -0.2, 0.3, 0.7, 1.2, 2.0])
    assert_parity(compare_with_reference(lambda x: x > 0, lambda x: x > 0, [x]))
    assert _failed(compare_with_reference(lambda x: x >= 1, lambda x: x > 0, [x])) == ["out"]
    with pytest.raises(AssertionError, match="nothing was compared"):
        assert_parity(compare_with_reference(lambda x: None, lambda x: None, [x]))


def test_parity_bound_is_twice_the_low_precision_error_plus_the_scaled_floor():
    # Every parity test trusts this number: a bound 10x too loose, or a floor 10x too large,
    # passed the whole suite.
    lp = 2.0**-10
    ref64 = torch.tensor([0.5, -0.25], dtype=torch.float64)
    ref_lp = torch.tensor([0.5 + lp, -0.25])  # float32, off by lp exactly
    result = parity("x", ref_lp, ref64, ref_lp)
    assert result.passed and result.bound == pytest.approx(2 * lp + 1e-5, rel=1e-9)
    assert not parity("x", ref64.float() + 2.5 * lp, ref64, ref_lp).passed
    # An exact low-precision reference leaves the floor: the dtype's, times max(1, max|ref64|).
    for dtype, floor in ((torch.float32, 1e-5), (torch.float16, 1e-3), (torch.bfloat16, 1e-2)):
        for scale, magnitude in ((1.0, 1.0), (400.0, 200.0)):
            exact = (ref64 * scale).to(dtype)
            got = parity("x", exact, exact.double(), exact).bound
            assert got == pytest.approx(floor * magnitude, rel=1e-9), (dtype, scale)


def test_a_relative_floor_follows_the_reference_below_1_as_above():
    # bench's model parity: a mean loss's gradients (~1e-2) got bfloat16's whole 1e-2 floor.
    for magnitude in (0.02, 1.0, 300.0):
        exact = torch.tensor([magnitude, -magnitude / 3], dtype=torch.bfloat16)
        got = parity("x", exact, exact.double(), exact, relative_floor=True).bound
        assert got == pytest.approx(1e-2 * float(exact[0]), rel=1e-9), magnitude
    zero = torch.zeros(3)
    assert parity("x", zero, zero.double(), zero, relative_floor=True).bound == 0.0


def test_an_overflowed_reference_leaves_the_floor_of_the_float64_magnitude():
    ref64 = torch.tensor([7e4, 1.0], dtype=torch.float64)
    ref_lp = ref64.half()  # 7e4 overflows float16
    assert ref_lp.isinf().any()
    result = parity("x", torch.tensor([65504.0, 1.0], dtype=torch.float16), ref64, ref_lp)
    assert result.bound == pytest.approx(1e-3 * 7e4) and not result.passed


def test_max_abs_diff_never_matches_nan_and_matches_only_equal_infinities():
    inf, nan = math.inf, math.nan
    assert max_abs_diff(torch.tensor([nan, 1.0]), torch.tensor([nan, 1.0])) == inf
    assert max_abs_diff(torch.tensor([inf, 1.0]), torch.tensor([inf, 1.5])) == 0.5
    assert max_abs_diff(torch.tensor([inf]), torch.tensor([-inf])) == inf
    assert max_abs_diff(torch.tensor([inf]), torch.tensor([1.0])) == inf


def test_gradients_are_compared_under_non_uniform_cotangents():
    # A backward that permutes the incoming gradient is right for a cotangent of ones only.
    class FlippedGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad.flip(-1)

    x = torch.randn(3, 4, requires_grad=True)
    results = compare_with_reference(FlippedGrad.apply, lambda x: x.clone(), [x])
    assert _failed(results) == ["dgrad[0]"]
