"""The commands' usage error, and the FASTFORMER_* settings they check before running."""

from __future__ import annotations

import sys


class UsageError(ValueError):
    """A bad option value or file: the command exits 2 with its message, as argparse does. A
    ValueError from anywhere else (a kernel's) is a failure, not a usage error."""


def check_settings(forces_backends: bool = False) -> None:
    """UsageError for a FASTFORMER_* setting that would make the run mean something else than
    the user asked: checked by `check` and `bench` before anything runs. `forces_backends`
    (`check`): the command forces each backend itself, so a forced backend that cannot run
    here only gets a warning."""
    check_forced_backends(forces_backends)
    check_ffn_settings()


def check_forced_backends(forces_backends: bool = False) -> None:
    """UsageError for a FASTFORMER_BACKEND_<X> that names no op with backends, a
    FASTFORMER_BACKEND_<OP> that names no backend of its op, or one that cannot run in this
    environment (Triton on a CPU without TRITON_INTERPRET=1, a C++ backend without its build):
    every call of the op would raise (or, for an unknown <X>, the setting is ignored). A command
    that forces each backend itself (`check`) does not use the setting: it warns that the
    user's other runs would fail, and goes on."""
    import fastformer.ops  # noqa: F401  (registers the backends)
    from fastformer.ops import _dispatch

    bad = _dispatch.unknown_backend_variables() + _dispatch.bad_forced_backends()
    unavailable = _unavailable_forced_backends()
    if forces_backends:
        for message in unavailable:
            print(f"warning: {message} (its rows force each backend themselves)", file=sys.stderr)
    else:
        bad += unavailable
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


def check_ffn_settings() -> None:
    """UsageError for a FASTFORMER_FFN_EPILOGUE or FASTFORMER_FFN_DRELU that is not a mode: ffn
    reads them in every CUDA call, so a GPU run's ffn rows all raised (exit 1, after measuring)
    instead of a usage error before it."""
    from fastformer.ops import ffn

    try:
        ffn.epilogue_mode()
        ffn.drelu_mode()
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
