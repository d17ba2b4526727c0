"""Wrappers of the ops' implementations: their backward made differentiable again under
``create_graph=True``, autocast kept out of their plain-PyTorch backends, and the test that sends
calls under torch.func transforms or forward-mode AD to plain PyTorch.

The ops' backward runs compiled kernels (C++/CUDA, Triton) whose results carry no autograd graph.
Taken with ``create_graph=True`` (a gradient penalty, a Hessian-vector product), those gradients
would look constant to a second backward, which would then return zeros or partial sums in
silence. ``twice_differentiable(by_reference)`` computes them there instead through the
reference's operations, with the kernels' dropout mask: the same gradients (within the parity
rule), differentiable to any order, at the reference's cost. (The C++ autograd nodes of the
LayerNorm and FFN kernels, csrc/autograd.cpp, call the ops' ``*_grads_by_reference`` ops.)
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Sequence

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import Tensor
from torch._functorch.pyfunctorch import coerce_cinterpreter

_TRANSFORMS = torch._C._functorch.peek_interpreter_stack


def twice_differentiable(by_reference: Callable) -> Callable:
    """Decorator of an autograd.Function's backward whose kernels' results carry no graph.

    Outside ``create_graph=True``, or when nothing its results depend on requires grad (the
    incoming gradients, the saved tensors, and ``ctx.tied``: inputs kept outside
    save_for_backward and its in-place checks), it calls the backward. Inside,
    ``by_reference(ctx, *grads)`` gives the results: the same gradients by the reference's
    operations (`differentiable_vjp`), which a second backward differentiates.
    """

    def wrap(backward: Callable) -> Callable:
        @functools.wraps(backward)
        def run(ctx, *grads):
            if torch.is_grad_enabled():
                candidates = (*grads, *ctx.saved_tensors, *getattr(ctx, "tied", ()))
                if any(isinstance(t, Tensor) and t.requires_grad for t in candidates):
                    return by_reference(ctx, *grads)
            with torch.no_grad():
                return backward(ctx, *grads)

        return run

    return wrap


def differentiable_vjp(
    fn: Callable[..., Sequence[Tensor]],
    primals: Sequence[Tensor | None],
    cotangents: Sequence[Tensor | None],
) -> list[Tensor | None]:
    """The vector-Jacobian product of ``fn(*primals)`` (a sequence of tensors) with
    `cotangents` (None: zero), by torch.func.vjp over the primals that require grad, the others
    held constant; recorded by autograd where it records (a backward under create_graph=True),
    so differentiable again. None for the primals that do not require grad.

    torch.func rather than torch.autograd.grad: inside a node's backward, autograd.grad with
    respect to tensors of the graph being differentiated went on down that graph (to the
    weights, through the node's own saved output: the C++ nodes' backward ran again and hung),
    and would have given total derivatives where a primal depends on another.
    """
    wanted = [i for i, t in enumerate(primals) if t is not None and t.requires_grad]
    grads: list[Tensor | None] = [None] * len(primals)
    if not wanted:
        return grads

    def partial(*args: Tensor) -> tuple[Tensor, ...]:
        full = list(primals)
        for i, arg in zip(wanted, args):
            full[i] = arg
        return tuple(fn(*full))

    outputs, pullback = torch.func.vjp(partial, *(primals[i] for i in wanted))
    zero = torch.zeros_like
    cots = tuple(zero(o) if c is None else c for o, c in zip(outputs, cotangents))
    for i, g in zip(wanted, pullback(cots)):
        grads[i] = g
    return grads


def tensor_list(grads: Sequence[Tensor | None], like: Tensor) -> list[Tensor]:
    """`grads` as a custom op's Tensor[] result: an empty tensor for each None (a gradient the
    C++ node does not ask for, or of an input that does not require grad)."""
    return [like.new_empty(0) if g is None else g for g in grads]


def _autocast_devices() -> tuple[str, ...]:
    names = ("cpu", "cuda", "xpu", "hpu", "mps", "mtia", "maia", "xla", "ipu", "privateuseone")
    found = [d for d in names if torch.amp.is_autocast_available(d)]
    renamed = torch._C._get_privateuse1_backend_name()  # "npu" and the like
    if renamed not in names and torch.amp.is_autocast_available(renamed):
        found.append(renamed)
    return tuple(found)


# The device types with autocast, asked once: torch.amp.is_autocast_available calls into C,
# which dynamo 2.11 cannot trace (compiled torch.func transforms of the ops failed).
_AUTOCAST_DEVICES = _autocast_devices()


def autocast_on(device_type: str) -> bool:
    """Whether autocast is on for `device_type`; False for device types without autocast."""
    return device_type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type)


def autocast_off(fn: Callable) -> Callable:
    """`fn` run with autocast off for its first argument's device type when it is on there.

    The ops compute in their inputs' dtypes, as their fake implementations promise (the modules
    cast the inputs as torch.nn would first). Autocast would otherwise reach the plain-PyTorch
    backends' products, called where it is on: a backward run inside an autocast region, or an
    op called there directly; they would compute in bfloat16 and return some results in it.
    """

    @functools.wraps(fn)
    def run(first: Tensor, *args, **kwargs):
        device = first.device.type
        # "meta" and other device types without autocast: torch.is_autocast_enabled raises.
        if not autocast_on(device):
            return fn(first, *args, **kwargs)
        with torch.autocast(device, enabled=False):
            return fn(first, *args, **kwargs)

    return run


# Tags of a custom op that draws its dropout seed when it runs: torch.compile's partitioner must
# not run it again in the backward (activation checkpointing would recompute it there, with
# a new seed and so another mask: gradients off by O(1)); it keeps its outputs instead.
DRAWS_A_SEED = (torch.Tag.nondeterministic_seeded,)


def traced() -> bool:
    """Whether an op call must go through its registered custom op: under torch.compile, or
    under a FakeTensorMode (shape and memory propagation without data), where the eager paths'
    real seed tensors and host draws cannot run; the custom ops' fakes can. And under
    torch.jit.trace, which then records one node per op, with its autograd and a seed drawn
    each run (the eager paths depend on grad mode and record Python Functions a saved trace
    cannot hold)."""
    return (
        torch.compiler.is_compiling()
        or torch.jit.is_tracing()
        or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None
    )


def under_transform() -> bool:
    """Whether a torch.func transform (grad, vjp, jvp, jacrev, jacfwd, vmap, ...) or a
    forward-mode AD level (`torch.autograd.forward_ad.dual_level`) is active, eagerly or
    inside torch.compile.

    The ops' kernels have reverse-mode autograd only (C++ nodes, custom ops and Functions
    without setup_context or jvp): under a transform they would raise, and forward-mode AD would
    pass through them without their tangents, a silent zero. The ops then compute with the
    reference's PyTorch operations and the same dropout mask, which every transform handles.
    """
    # type(), not `is not None`: dynamo wraps the functorch stack's peek as an object that is
    # never None (compiled calls took this path always, or never), but folds its type.
    return _forward_ad._current_level >= 0 or type(_TRANSFORMS()) is not type(None)


def _vmap_randomness() -> tuple[str, ...]:
    """The `randomness` of every active torch.vmap level, innermost first; dynamo folds it
    (the interpreter's key and randomness are constants to it; `lower` looks under a level)."""
    top = _TRANSFORMS()
    if type(top) is type(None):
        return ()
    interpreter = coerce_cinterpreter(top)
    with interpreter.lower():
        below = _vmap_randomness()
    vmap = interpreter.key() == torch._C._functorch.TransformType.Vmap
    return ((interpreter.randomness(),) if vmap else ()) + below


def refuse_compiled_vmap_dropout(op: str) -> None:
    """For a dropout mask drawn by a custom op inside torch.compile under a transform: vmap
    runs such an op once a sample (it has no vmap rule), each drawing its own seed, so every
    sample gets its own mask. Right for randomness="different"; "error" must raise, as torch's
    dropout does, and "same" cannot be honoured: clear errors (without fullgraph, dynamo then
    runs the call eagerly, where the ops follow `randomness`)."""
    levels = _vmap_randomness()
    if "error" in levels:
        raise RuntimeError(
            f"vmap: called random operation while in randomness error mode ({op} with "
            "dropout_p > 0). Please either use the 'same' or 'different' randomness flags on "
            "vmap or perform the randomness operation out of vmap"
        )
    if "same" in levels:
        raise RuntimeError(
            f"{op} with dropout_p > 0 under torch.vmap(randomness='same') inside torch.compile "
            "(or another traced call) is not supported (traced, each sample draws its own "
            "mask): run the vmap eagerly, or use randomness='different'"
        )


def check_devices(op: str, like: Tensor, **tensors: object) -> None:
    """ValueError unless every given tensor is on `like`'s device; `seed` may also be on the CPU
    (`device_seed`, drawn on the device in CUDA graph capture, may not), and a seed that is an
    int is not checked. For the ops' fake kernels: one meta tensor among CPU ones sends a call
    to them, and they would return uninitialized CPU tensors where the kernels raise."""
    for name, t in tensors.items():
        if not isinstance(t, Tensor) or t.device == like.device:
            continue
        if name == "seed" and t.device.type == "cpu":
            continue
        raise ValueError(f"{op}: {name} is on {t.device}, the input on {like.device}")


def check_dense(op: str, name: str, t: Tensor) -> None:
    """ValueError for a sparse, mkldnn or nested tensor: the kernels read dense strided memory
    (torch.nn.functional takes nested tensors; the fastformer.nn modules fall back to it)."""
    if t.layout != torch.strided or t.is_nested:
        kind = "a nested tensor" if t.is_nested else f"layout {t.layout}"
        raise ValueError(f"{op}: {name} must be a dense strided tensor, got {kind}")


def type_name(value: object) -> str:
    """The name of value's type for messages: numpy.float32 rather than float32 (and numpy.bool
    rather than a puzzling bool)."""
    cls = type(value)
    return cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__name__}"


def positive_float(op: str, name: str, value: object) -> float:
    """`value` (a real number of any type but bool, numpy scalars too) as a float in (0, inf);
    TypeError or ValueError naming `op` and `name` otherwise. Checked again once converted: a
    huge int overflows float(), a tiny numpy.longdouble rounds to 0."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be a float, got {type_name(value)}")
    if 0 < value < math.inf:  # (not math.isfinite: dynamo cannot trace it on a SymFloat)
        try:
            converted = float(value)
        except OverflowError:
            converted = math.inf
        if 0 < converted < math.inf:
            return converted
    raise ValueError(f"{op}: {name} must be a finite number > 0, got {value}")
