"""Backend choice (fastformer.ops._dispatch): the remembered choice of select_by_key."""

from __future__ import annotations

import pytest

from fastformer.ops import _dispatch

OP = "dispatch_test_op"


@pytest.fixture
def counted(monkeypatch):
    """A test op whose 'fast' backend cannot run key 'bad'; counts the reasons calls."""
    calls = []

    def fast_reasons(inputs):
        calls.append(inputs)
        return ["cannot"] if inputs == "bad" else []

    monkeypatch.setitem(_dispatch.REGISTRY, OP, [])
    _dispatch.register(
        OP, [_dispatch.Backend("fast", fast_reasons), _dispatch.Backend("slow", lambda i: [])]
    )
    monkeypatch.delenv(f"FASTFORMER_BACKEND_{OP.upper()}", raising=False)
    return calls


def test_choice_is_remembered_per_key(counted):
    assert _dispatch.select_by_key(OP, "good", lambda: "good") == "fast"
    assert _dispatch.select_by_key(OP, "good", lambda: "good") == "fast"
    assert _dispatch.select_by_key(OP, "bad", lambda: "bad") == "slow"
    assert counted == ["good", "bad"]  # one look at the reasons a key


def test_forced_backend_is_read_at_every_call(counted, monkeypatch):
    assert _dispatch.select_by_key(OP, "good", lambda: "good") == "fast"
    monkeypatch.setenv(f"FASTFORMER_BACKEND_{OP.upper()}", "slow")
    assert _dispatch.select_by_key(OP, "good", lambda: "good") == "slow"
    monkeypatch.setenv(f"FASTFORMER_BACKEND_{OP.upper()}", "fast")
    with pytest.raises(RuntimeError, match="cannot run these inputs: cannot"):
        _dispatch.select_by_key(OP, "bad", lambda: "bad")


def test_register_forgets_the_choices(counted):
    _dispatch.select_by_key(OP, "good", lambda: "good")
    _dispatch.register(OP, [_dispatch.Backend("other", lambda i: [])])
    assert _dispatch.select_by_key(OP, "good", lambda: "good") == "other"


def test_remembered_choices_are_bounded(counted, monkeypatch):
    # Keys holding shapes (attention's) take a new value for every new sequence length.
    monkeypatch.setattr(_dispatch, "_CHOICES_LIMIT", 5)
    for n in range(12):
        assert _dispatch.select_by_key(OP, ("good", n), lambda: "good") == "fast"
        assert len(_dispatch._CHOICES) <= 5
    assert len(counted) == 12
