"""Backend choice shared by every op.

Each op has an ordered list of backends; each backend answers `reasons(inputs)` — why it cannot
run these inputs (an empty list means it can). With `inputs=None` it answers only for this
environment, which is what `python -m fastformer info` prints. The op runs the first backend
with no reasons; `FASTFORMER_BACKEND_<OP>=name` forces one (an error listing its reasons if it
cannot run).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

Reasons = Callable[[Any], list[str]]


@dataclass(frozen=True)
class Backend:
    """A way to run an op; `reasons(inputs or None)` lists why it cannot."""

    name: str
    reasons: Reasons


REGISTRY: dict[str, list[Backend]] = {}
# (op, key, forced backend) -> the backend select_by_key chose.
_CHOICES: dict[tuple[str, Hashable, str | None], str] = {}
_CHOICES_LIMIT = 4096


def register(op: str, backends: list[Backend]) -> None:
    """Declare an op's backends in order of preference."""
    REGISTRY[op] = backends
    _CHOICES.clear()


PREFIX = "FASTFORMER_BACKEND_"


def forced_backend(op: str) -> str | None:
    return os.environ.get(f"{PREFIX}{op.upper()}") or None


def select_by_key(op: str, key: Hashable, make_inputs: Callable[[], Any]) -> str:
    """`select(op, make_inputs())`, remembered per `key` and forced backend: for ops whose
    backends' reasons depend on nothing but `key` (say, device type and dtype). An eager call
    then pays ~1 us for its backend instead of ~6 us (CI VM), host time a small GPU kernel
    would otherwise wait for."""
    if torch.compiler.is_compiling():
        # Traced, the cache would become a guard of the graph: it recompiled on each change
        # of the cache (its first fill; its reset at _CHOICES_LIMIT by run-time calls).
        return select(op, make_inputs())
    forced = forced_backend(op)
    name = _CHOICES.get((op, key, forced))
    if name is None:
        if len(_CHOICES) >= _CHOICES_LIMIT:  # keys with shapes: a new length each batch
            _CHOICES.clear()
        name = _CHOICES[(op, key, forced)] = select(op, make_inputs())
    return name


def bad_forced_backends() -> list[str]:
    """FASTFORMER_BACKEND_<OP> settings that name no backend of their op (each call of the op
    would raise), as messages; checked by the commands before they run anything."""
    bad = []
    for op, backends in REGISTRY.items():
        forced = forced_backend(op)
        names = [b.name for b in backends]
        if forced is not None and forced not in names:
            bad.append(f"FASTFORMER_BACKEND_{op.upper()}={forced!r} is not one of {names}")
    return bad


def unknown_backend_variables() -> list[str]:
    """A message for the FASTFORMER_BACKEND_<X> variables whose <X> is no registered op, or []:
    FASTFORMER_BACKEND_RMS_NORM=torch is read by no op (rms_norm dispatches through
    layer_norm's entry), so a run would not force what the user thought. The commands refuse
    it; `import fastformer` warns."""
    valid = {f"{PREFIX}{op.upper()}" for op in REGISTRY}
    unknown = sorted(
        name
        for name, value in os.environ.items()
        # an empty value is unset for a known variable too (forced_backend)
        if name.startswith(PREFIX) and name not in valid and value
    )
    if not unknown:
        return []
    return [
        f"{', '.join(unknown)} names no op with backends; the variables are "
        f"{', '.join(sorted(valid))} (an op follows its module's: rms_norm and "
        "dropout_add_layer_norm follow layer_norm's)"
    ]


def explain(op: str, inputs: Any = None) -> list[tuple[str, list[str]]]:
    """(backend name, reasons it cannot run) for each backend of `op`, in preference order."""
    return [(b.name, b.reasons(inputs)) for b in REGISTRY[op]]


def select(op: str, inputs: Any) -> str:
    """Name of the backend that runs `inputs` (honours FASTFORMER_BACKEND_<OP>)."""
    backends = REGISTRY[op]
    forced = forced_backend(op)
    if forced is not None:
        match = [b for b in backends if b.name == forced]
        if not match:
            names = ", ".join(b.name for b in backends)
            raise ValueError(
                f"FASTFORMER_BACKEND_{op.upper()}={forced!r} is not a backend of {op}; "
                f"choose one of: {names}"
            )
        why = match[0].reasons(inputs)
        if why:
            raise RuntimeError(
                f"FASTFORMER_BACKEND_{op.upper()}={forced!r} cannot run these inputs: "
                + "; ".join(why)
            )
        return forced
    for backend in backends:
        if not backend.reasons(inputs):
            return backend.name
    report = "; ".join(f"{n}: {', '.join(r)}" for n, r in explain(op, inputs))
    raise RuntimeError(f"no backend of {op} can run these inputs ({report})")
