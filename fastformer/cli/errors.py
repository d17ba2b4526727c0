"""The commands' usage error."""

from __future__ import annotations


class UsageError(ValueError):
    """A bad option value or file: the command exits 2 with its message, as argparse does. A
    ValueError from anywhere else (a kernel's) is a failure, not a usage error."""


def check_forced_backends() -> None:
    """UsageError for a FASTFORMER_BACKEND_<OP> that names no backend of its op: every call of
    the op would raise, while `check`, which forces each backend itself, passed."""
    import fastformer.ops  # noqa: F401  (registers the backends)
    from fastformer.ops import _dispatch

    bad = _dispatch.bad_forced_backends()
    if bad:
        raise UsageError("; ".join(bad))
