"""What `fastformer.explain` records while it runs a forward pass.

Modules call `note(...)` for every op call and every fallback. Outside `recording()` no store
is active (an empty tuple) and `note` returns at once, so the normal forward pays one global read
(a constant for torch.compile, which guards on it).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from torch import nn


@dataclass(frozen=True)
class Record:
    """One op call (or fallback) made by `module` during a recorded forward.

    `what` is the op ("attention", "layer_norm", "ffn", ...) or the part of the module that fell
    back; `runs` is the backend that ran ("triton", "torch", ..., or "torch.nn" / "eager" for a
    fallback); `reasons` lists, for every backend or path faster than `runs`, why it did not run;
    `thread` is the id of the thread that made the call.
    """

    module: nn.Module
    what: str
    runs: str
    reasons: tuple[tuple[str, tuple[str, ...]], ...]
    thread: int = field(default_factory=threading.get_ident)


# The stores of the recordings running now, one per `recording()` block (explain calls of
# several threads overlap, and end in any order). Replaced whole under _LOCK, never changed in
# place: readers take it without the lock.
_stores: tuple[list[Record], ...] = ()
_LOCK = threading.Lock()
# Ids of the global module hooks fastformer itself registers (explain's): they do not make a
# sub-module "hooked" (fastformer.nn.ffn.is_plain), so explain reports the normal path.
OWN_HOOKS: set[int] = set()


def active() -> bool:
    """True while `fastformer.explain` records a forward pass."""
    return bool(_stores)


def note(
    module: nn.Module,
    what: str,
    runs: str,
    reasons: list[tuple[str, list[str]]],
    into: list[Record] | None = None,
) -> None:
    """Record one call in every active store (each explain picks its own records out: see
    fastformer.explain._own), or in `into` only (one explain's own hook); a no-op unless
    recording."""
    stores = _stores if into is None else (into,)
    if not stores:
        return
    frozen = tuple((name, tuple(why)) for name, why in reasons)
    record = Record(module, what, runs, frozen)
    for store in stores:
        store.append(record)


@contextmanager
def recording() -> Iterator[list[Record]]:
    """Collect the records of every fastformer module call made inside the block."""
    global _stores
    store: list[Record] = []
    with _LOCK:
        _stores = (*_stores, store)
    try:
        yield store
    finally:
        # By identity: another thread's block may have started or ended since this one began.
        with _LOCK:
            _stores = tuple(s for s in _stores if s is not store)
