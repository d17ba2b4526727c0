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


def _forced_messages(op: str) -> list[str]:
    return [m for m in _dispatch.bad_forced_backends() if f"_{op.upper()}=" in m]


def test_an_empty_forced_backend_forces_nothing(counted, monkeypatch):
    # `FASTFORMER_BACKEND_<OP>=` (empty) is unset, as an empty variable is in a shell script.
    monkeypatch.setenv(f"FASTFORMER_BACKEND_{OP.upper()}", "")
    assert _dispatch.select_by_key(OP, "bad", lambda: "bad") == "slow"
    assert _forced_messages(OP) == []


def test_any_backend_of_the_op_may_be_forced(counted, monkeypatch):
    monkeypatch.setenv(f"FASTFORMER_BACKEND_{OP.upper()}", "slow")  # not the first one
    assert _forced_messages(OP) == []
    monkeypatch.setenv(f"FASTFORMER_BACKEND_{OP.upper()}", "bogus")
    [message] = _forced_messages(OP)
    assert message.endswith("='bogus' is not one of ['fast', 'slow']")


def test_unknown_backend_variables_skip_empty_values(monkeypatch):
    name = "FASTFORMER_BACKEND_NO_SUCH_OP"
    monkeypatch.setenv(name, "")
    assert not any(name in m for m in _dispatch.unknown_backend_variables())
    monkeypatch.setenv(name, "torch")
    assert any(name in m for m in _dispatch.unknown_backend_variables())


def test_forcing_a_backend_the_op_lacks_names_the_choices(counted, monkeypatch):
    # A misspelt backend is an error, never a silent fall back to the default choice.
    monkeypatch.setenv(f"FASTFORMER_BACKEND_{OP.upper()}", "bogus")
    with pytest.raises(
        ValueError, match=r"'bogus' is not a backend of .*choose one of: fast, slow"
    ):
        _dispatch.select_by_key(OP, "good", lambda: "good")


def test_no_backend_that_can_run_is_an_error_with_every_reason(monkeypatch):
    # Instead of running the last backend anyway.
    monkeypatch.setitem(_dispatch.REGISTRY, OP, [])
    refuse = [_dispatch.Backend(n, lambda i, n=n: [f"{n} refuses"]) for n in ("fast", "slow")]
    _dispatch.register(OP, refuse)
    monkeypatch.delenv(f"FASTFORMER_BACKEND_{OP.upper()}", raising=False)
    with pytest.raises(RuntimeError, match=r"\(fast: fast refuses; slow: slow refuses\)$"):
        _dispatch.select(OP, "x")
