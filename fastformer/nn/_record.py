"""What `fastformer.explain` records while it runs a forward pass.

Modules call `note(...)` for every op call and every fallback. Outside `recording()` the store
is None and `note` returns at once, so the normal forward pays one global read (a constant for
torch.compile, which guards on it).
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


_store: list[Record] | None = None
# Ids of the global module hooks fastformer itself registers (explain's): they do not make a
# sub-module "hooked" (fastformer.nn.ffn.is_plain), so explain reports the normal path.
OWN_HOOKS: set[int] = set()


def active() -> bool:
    """True while `fastformer.explain` records a forward pass."""
    return _store is not None


def note(module: nn.Module, what: str, runs: str, reasons: list[tuple[str, list[str]]]) -> None:
    """Record one call; a no-op unless recording."""
    if _store is None:
        return
    frozen = tuple((name, tuple(why)) for name, why in reasons)
    _store.append(Record(module, what, runs, frozen))


@contextmanager
def recording() -> Iterator[list[Record]]:
    """Collect the records of every fastformer module call made inside the block."""
    global _store
    previous, _store = _store, []
    try:
        yield _store
    finally:
        _store = previous
