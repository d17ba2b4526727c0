"""`fastformer.explain(module, *inputs, **kwargs)`: which backend runs where, and why not faster.

It runs `module(*inputs, **kwargs)` once (as given: same grad mode, same train/eval mode) while
every fastformer module notes each op call (the backend that runs and, for each faster backend,
why it cannot) and each fallback to torch.nn with its reason. torch.nn or reference modules of a
kind `fastformer.swap` would replace are listed as such.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fastformer.nn import _record
from fastformer.swap import _FROM_REFERENCE, _FROM_TORCH, _type_name


class Explanation(str):
    """The printable report (a str) with the raw `records` (list of `_record.Record`)."""

    records: list[_record.Record]


def _unswapped_hook(store: list[_record.Record]):
    """A global forward pre-hook noting torch.nn / reference modules fastformer could run.

    Global, not per module: a per-module hook would make the fastformer layers see "hooks
    attached" and take their unfused path, so the report would not show the normal run.
    """

    def hook(module: nn.Module, args) -> None:
        kind = type(module)
        if kind in _FROM_TORCH or kind in _FROM_REFERENCE:
            why = ["not a fastformer module: fastformer.swap(model) replaces it"]
            # Into this call's store only: each overlapping explain has its own hook, and every
            # hook sees every module.
            _record.note(module, kind.__name__, _type_name(kind), [("fastformer", why)], store)

    return hook


def _format(root: nn.Module, records: list[_record.Record]) -> str:
    """Records grouped by module (in order of first call); repeated calls counted."""
    # A compiled child (torch.compile's wrapper) holds the module that runs as `_orig_mod`:
    # named as the child the user set.
    names = {
        id(m): ".".join(p for p in name.split(".") if p != "_orig_mod")
        for name, m in root.named_modules()
    }
    grouped: dict[int, tuple[nn.Module, Counter]] = {}
    for r in records:
        entry = grouped.setdefault(id(r.module), (r.module, Counter()))
        entry[1][(r.what, r.runs, r.reasons)] += 1  # a Counter keeps first-seen order
    lines = [f"fastformer.explain({type(root).__name__}): {len(records)} calls"]
    for key, (module, calls) in grouped.items():
        lines.append(f"{names.get(key, '?') or '(root)'} ({type(module).__name__})")
        for (what, runs, reasons), count in calls.items():
            lines.append(f"    {what} -> {runs}" + (f" (x{count})" if count > 1 else ""))
            lines += [
                f"        not {b}: {'; '.join(why) or '(no reason given)'}" for b, why in reasons
            ]
    if not records:
        lines.append("    no fastformer module ran (fastformer.swap(model) replaces torch.nn ones)")
    return "\n".join(lines)


@torch.compiler.disable  # called inside a compiled function: its set_stance cannot be traced
def explain(module: nn.Module, *inputs: Any, **kwargs: Any) -> Explanation:
    """Run `module(*inputs, **kwargs)` once and report, per submodule, the backend of every op
    call and every reason a faster backend (or the fused path) did not run.

    Returns an Explanation: a str (print it) with `.records` for programs. The forward runs
    as a normal call would (grad mode and train/eval mode untouched; dropout draws random
    numbers as usual), but eagerly: a compiled module's code runs uncompiled (the backends
    chosen are the same), so that the recording neither breaks nor stays in its graphs.
    """
    # force_eager: compiled, the recording graph-broke the trace (fullgraph raised) and
    # the broken graphs served every later call (4 graphs a call of a Transformer, 1 before).
    # A torch.compile(module) wrapper is reported as the module it wraps.
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    module = getattr(module, "_orig_mod", module)
    with _record.recording() as store, _force_eager():
        handle = _register_own_hook(_unswapped_hook(store))
        try:
            module(*inputs, **kwargs)
        finally:
            handle.remove()
            _record.OWN_HOOKS.discard(handle.id)
    records = _own(module, store)
    text = Explanation(_format(module, records))
    text.records = records
    return text


# The explain calls running now hold torch.compile's stance at "force_eager" together: the first
# sets it, the last puts back what the first found.
_EAGER_LOCK = threading.Lock()
_eager_calls = 0
_eager_stance: torch.compiler.set_stance | None = None


@contextmanager
def _force_eager() -> Iterator[None]:
    """torch.compile's "force_eager" stance (process-wide) while any explain runs. With a
    `set_stance` block each, two explains of two threads ending out of order left "force_eager"
    on for good (each restored the stance it found): every compiled model then ran eagerly."""
    global _eager_calls, _eager_stance
    with _EAGER_LOCK:
        if _eager_calls == 0:
            _eager_stance = torch.compiler.set_stance("force_eager")  # set when made
        _eager_calls += 1
    try:
        yield
    finally:
        with _EAGER_LOCK:
            _eager_calls -= 1
            if _eager_calls == 0:
                _eager_stance.__exit__(None, None, None)  # the stance the first call found
                _eager_stance = None


def _register_own_hook(hook: Callable[[nn.Module, tuple], None]) -> RemovableHandle:
    """`register_module_forward_pre_hook(hook)`, with the hook's id in OWN_HOOKS before the hook
    is: registered first, another thread's forward could see a foreign hook in between and take
    its unfused path (the same two steps as torch's function, in the other order)."""
    hooks = nn.modules.module._global_forward_pre_hooks
    handle = RemovableHandle(hooks)
    _record.OWN_HOOKS.add(handle.id)
    hooks[handle.id] = hook
    return handle


def _own(root: nn.Module, records: list[_record.Record]) -> list[_record.Record]:
    """The records of this call: those made in this thread, or by `root`'s modules in others
    (a forward that runs branches in a thread pool); not those of other threads' models."""
    ids, me = {id(m) for m in root.modules()}, threading.get_ident()
    return [r for r in records if r.thread == me or id(r.module) in ids]
