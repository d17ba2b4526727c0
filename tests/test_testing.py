"""fastformer.testing's parity helpers (what tests/ and `python -m fastformer check` use) fail
wrong implementations that a looser comparison passed (found by a hunt of check)."""

from __future__ import annotations

import pytest
import torch

from fastformer.testing import assert_parity, compare_with_reference


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
    x = torch.randn(6)
    assert_parity(compare_with_reference(lambda x: x > 0, lambda x: x > 0, [x]))
    assert _failed(compare_with_reference(lambda x: x >= 1, lambda x: x > 0, [x])) == ["out"]
    with pytest.raises(AssertionError, match="nothing was compared"):
        assert_parity(compare_with_reference(lambda x: None, lambda x: None, [x]))
