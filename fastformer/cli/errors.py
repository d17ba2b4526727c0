"""The commands' usage error."""

from __future__ import annotations


class UsageError(ValueError):
    """A bad option value or file: the command exits 2 with its message, as argparse does. A
    ValueError from anywhere else (a kernel's) is a failure, not a usage error."""


def check_forced_backends() -> None:
    """UsageError for a FASTFORMER_BACKEND_<OP> that names no backend of its op, or one that
    cannot run in this environment (Triton on a CPU without TRITON_INTERPRET=1, a C++ backend
    without its build): every call of the op would raise, while `check`, which forces each
    backend itself, passed."""
    import fastformer.ops  # noqa: F401  (registers the backends)
    from fastformer.ops import _dispatch

    bad = _dispatch.bad_forced_backends() + _unavailable_forced_backends()
    if bad:
        raise UsageError("; ".join(bad))


def _unavailable_forced_backends() -> list[str]:
    """Messages for the existing forced backends that this environment cannot run: their
    reasons for no inputs in particular. Per-input limits (a dtype, a device the run does not
    use) are the op's to report."""
    from fastformer.ops import _dispatch

    bad = []
    for op in _dispatch.REGISTRY:
        forced = _dispatch.forced_backend(op)
        why = dict(_dispatch.explain(op)).get(forced) if forced is not None else None
        if why:
            variable = f"FASTFORMER_BACKEND_{op.upper()}={forced!r}"
            bad.append(f"{variable} cannot run here: {'; '.join(why)}")
    return bad
