"""The fused position-wise feed-forward op: ``linear2(dropout(act(linear1(x))))``.

``ffn(x, w1, b1, w2, b2, activation="relu", dropout_p=0.0)`` with ``nn.Linear`` layouts:
``w1`` is ``(d_ff, d_model)`` (``(2 * d_ff, d_model)`` for the gated activations), ``b1`` matches
its first dimension, ``w2`` is ``(d_out, d_ff)`` (``d_out`` is usually ``d_model``), ``b2`` is
``(d_out,)``; either bias may be None. ``x`` is ``(..., d_model)``; the output is
``(..., d_out)`` in the dtype of the inputs (float16, bfloat16, float32; float64 too: on CPU
by the compiled kernels, on CUDA by the torch backend).

Activations (``ACTIVATIONS``): ``relu``, ``gelu`` (exact, erf), ``gelu_tanh`` (tanh
approximation), ``silu``, and the gated ``swiglu`` / ``geglu``: ``h = linear1(x)`` is split as
``gate, up = h.chunk(2, -1)`` and the FIRST half goes through the activation (silu, exact gelu):
``act(gate) * up`` -- exactly ``fastformer.reference.ffn``.

Dropout (``dropout_p`` in [0, ``rng.max_dropout_p()``], about 0.99991: closer to 1 the fraction
the float32 uniforms keep is off from 1 - p by more than 0.1%, a bias the ``1 / (1 - p)`` scale
would not undo) acts on the ``(tokens, d_ff)`` activation with the shared Philox scheme: element
``(t, j)`` is kept where ``element_uniform(seed, t * d_ff + j) >= p`` and scaled by
``1 / (1 - p)``. ``ffn_keep_mask(seed, tokens, d_ff, p)`` regenerates that mask through
``rng.dropout_keep``: fastformer._C's element_uniform kernel when it is loaded for the device,
else the same bits in plain PyTorch. The seed is drawn inside the op (``draw_seed``), so
``torch.manual_seed`` reproduces a call and ``torch.compile`` never bakes it in. Inside CUDA
graph capture it is drawn on the device and the CUDA kernels read it there, so each replay drops
different elements (``fastformer.ops.rng.draw_call_seed``; the torch backend refuses).

Backends (``fastformer.ops._dispatch``, ``FASTFORMER_BACKEND_FFN`` forces one): ``cpp``, the
compiled ``torch.ops.fastformer.ffn_forward`` / ``ffn_backward`` (csrc/ffn: ATen GEMMs plus one
fused elementwise pass on CPU, a CUDA kernel on GPU), then ``torch``, the same math in plain
PyTorch. Both save the same tensors for backward: ``x``, the weights, the seed (an int in eager
calls) and the pre-activation ``h`` -- for relu only ``dropout(relu(h))``, which is linear2's
input anyway and whose sign is relu's and dropout's mask together. No byte mask is ever stored.

On CUDA, relu and gelu_tanh can run inside cuBLASLt's GEMM epilogue (``use_fused_epilogue``;
``FASTFORMER_FFN_EPILOGUE=auto|fused|unfused``). relu's backward can too
(``FASTFORMER_FFN_DRELU=epilogue``, opt-in until timed on a GPU; default ``kernel``): cuBLASLt's
DRELU_BGRAD epilogue then gives dh and db1 in linear2's dgrad GEMM, from a bitmask of the saved
output, in place of our elementwise pass (csrc/ffn/ffn_lt.cpp); same math, other rounding.

The plain eager call (exact tensors of one dtype and device on the ``cpp`` backend, a str
activation, a float ``dropout_p`` up to 0.99, no tracer, transform or mode) runs from one C call,
``fastformer._C``'s ``ffn_eager``; every other call takes the checked Python path. Both run the
same op on the same arguments.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from fastformer import reference
from fastformer._ext import cuda_kernels_compiled, extension_error, load_extension
from fastformer.ops import rng
from fastformer.ops._autograd import (
    DRAWS_A_SEED,
    autocast_off,
    check_dense,
    check_devices,
    differentiable_vjp,
    refuse_compiled_vmap_dropout,
    tensor_list,
    traced,
    twice_differentiable,
    type_name,
    under_transform,
)
from fastformer.ops._dispatch import Backend, explain, register, select_by_key

__all__ = [
    "ACTIVATIONS",
    "DRELU_ENV",
    "EPILOGUE_ENV",
    "EPILOGUE_MODES",
    "GATED_ACTIVATIONS",
    "FfnInputs",
    "drelu_mode",
    "epilogue_mode",
    "ffn",
    "ffn_keep_mask",
    "use_fused_epilogue",
]

ACTIVATIONS: tuple[str, ...] = reference.ACTIVATIONS
GATED_ACTIVATIONS: tuple[str, ...] = reference.GATED_ACTIVATIONS
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DRELU_ENV = "FASTFORMER_FFN_DRELU"
EPILOGUE_ENV = "FASTFORMER_FFN_EPILOGUE"
EPILOGUE_MODES = ("auto", "fused", "unfused")
# Activations cuBLASLt can apply in the GEMM epilogue (torch._addmm_activation: RELU_BIAS and
# GELU_BIAS, whose GELU is the tanh approximation).
EPILOGUE_ACTIVATIONS = ("relu", "gelu_tanh")


# The plain eager call in one C call, None for any other (csrc/ffn/ffn_eager.cpp): the checked
# path's Python cost ~12 us a call above the op on a CPU, ~40 us between ops that stream memory.
# Absent without the extension.
_EAGER = getattr(load_extension(), "ffn_eager", None)
_is_compiling = torch.compiler.is_compiling  # (dynamo folds it: the C call is never traced)


# --------------------------------------------------------------------------- dropout mask


def ffn_keep_mask(
    seed: int,
    tokens: int,
    d_ff: int,
    dropout_p: float,
    device: torch.device | str | None = None,
) -> Tensor:
    """The op's dropout keep-mask, regenerated (for tests, the reference and the torch backend).

    Returns a bool tensor ``(tokens, d_ff)`` on ``device``: True where
    ``element_uniform(seed, t * d_ff + j) >= dropout_p``, tokens in the row-major order of x's
    leading dims. Feed it, viewed as ``(*x.shape[:-1], d_ff)``, to
    ``fastformer.reference.ffn(..., keep_mask=...)`` to reproduce a call that drew ``seed``.
    Computed by ``rng.dropout_keep``: fastformer._C's element_uniform kernel when it is loaded
    for ``device`` (CPU; CUDA when built with CUDA kernels), else the same bits in plain PyTorch.
    """
    sizes = dict(tokens=tokens, d_ff=d_ff)
    dropout_p = rng.check_keep_mask_args("ffn_keep_mask", seed, sizes, dropout_p)
    offsets = torch.arange(tokens * d_ff, dtype=torch.int64, device=device).view(tokens, d_ff)
    return rng.dropout_keep(seed, offsets, dropout_p)


# --------------------------------------------------------------------------- backends


@dataclass(frozen=True)
class FfnInputs:
    """What backend choice looks at: the device and dtype of the inputs."""

    device: torch.device
    dtype: torch.dtype


def _cpp_reasons(inputs: FfnInputs | None) -> list[str]:
    error = extension_error()
    if error is not None:
        return [error]
    if not hasattr(torch.ops.fastformer, "ffn_forward"):
        return ["fastformer._C was built without csrc/ffn; rebuild it (make build)"]
    if inputs is None:
        return []
    if inputs.device.type == "cuda":
        if not cuda_kernels_compiled():
            return ["fastformer._C was built without CUDA kernels"]
        if inputs.dtype not in CUDA_DTYPES:
            return [f"CUDA kernels take float16, bfloat16 or float32, got {inputs.dtype}"]
        return []
    if inputs.device.type != "cpu":
        return [f"runs on CPU and CUDA tensors, got device {inputs.device}"]
    return []


def _torch_reasons(inputs: FfnInputs | None) -> list[str]:
    return []


register("ffn", [Backend("cpp", _cpp_reasons), Backend("torch", _torch_reasons)])


# --------------------------------------------------------------------------- CUDA epilogue


def epilogue_mode() -> str:
    """``FASTFORMER_FFN_EPILOGUE`` (auto, fused or unfused; default auto), validated."""
    mode = os.environ.get(EPILOGUE_ENV, "auto").strip().lower() or "auto"
    if mode not in EPILOGUE_MODES:
        raise ValueError(f"{EPILOGUE_ENV} must be one of {EPILOGUE_MODES}, got {mode!r}")
    return mode


def drelu_mode() -> str:
    """``FASTFORMER_FFN_DRELU`` (kernel or epilogue; default kernel) as the CUDA relu backward
    reads it: validated by the extension's own parser, so both say the same (ValueError for any
    other value). Without the extension there is no CUDA backward to read it: "kernel"."""
    parse = getattr(load_extension(), "ffn_drelu_mode", None)
    return parse() if parse is not None else "kernel"


def use_fused_epilogue(
    activation: str, capability: tuple[int, int], needs_grad: bool, mode: str = "auto"
) -> bool:
    """Whether linear1's activation runs in cuBLASLt's GEMM epilogue on a GPU of `capability`.

    Fused: ``torch._addmm_activation`` (cuBLASLt RELU_BIAS / GELU_BIAS), then at most an
    in-place dropout kernel. Unfused: ``addmm`` (cuBLASLt BIAS epilogue), then our fused
    activation + dropout kernel. Rules:

    * only relu and gelu_tanh exist as epilogues (cuBLASLt's GELU is the tanh form);
    * gelu_tanh only when no gradient is needed: the epilogue never writes the pre-activation
      that gelu's derivative needs (torch does not expose GELU_AUX), and recomputing it would
      cost a whole GEMM -- slower than unfused;
    * ``mode="fused"`` / ``"unfused"`` force the choice within those limits (benchmarking);
    * ``"auto"``: relu fused on every GPU -- the epilogue is a max in registers, its output is
      exactly what the backward saves, and without dropout it removes our kernel (one read and
      one write of the activation); gelu_tanh fused before sm_90 only, since flash-attention
      measured cuBLASLt's fused GELU epilogue slower than the unfused GEMM + GELU on H100.
    """
    _check_activation("use_fused_epilogue", activation)
    if mode not in EPILOGUE_MODES:
        raise ValueError(f"mode must be one of {EPILOGUE_MODES}, got {mode!r}")
    if activation not in EPILOGUE_ACTIVATIONS or mode == "unfused":
        return False
    if activation == "gelu_tanh" and needs_grad:
        return False
    if mode == "fused" or activation == "relu":
        return True
    return capability < (9, 0)


# --------------------------------------------------------------------------- input checks


def _check_tensor(name: str, t: object, x: Tensor, optional: bool = False) -> None:
    if t is None and optional:
        return
    if not isinstance(t, Tensor):
        expected = "a Tensor or None" if optional else "a Tensor"
        raise TypeError(f"ffn: {name} must be {expected}, got {type_name(t)}")
    check_dense("ffn", name, t)
    if t.device != x.device:
        raise ValueError(
            f"ffn: {name} is on {t.device} but x is on {x.device}; expected one device"
        )
    if t.dtype != x.dtype:
        raise TypeError(f"ffn: {name} has dtype {t.dtype} but x has {x.dtype}; expected one dtype")


def _check_shape(name: str, t: Tensor | None, expected: tuple[int, ...], why: str) -> None:
    if t is not None and tuple(t.shape) != expected:
        raise ValueError(f"ffn: {name} must have shape {expected} ({why}), got {tuple(t.shape)}")


def _check_activation(fn: str, activation: object) -> None:
    if not isinstance(activation, str):
        raise TypeError(
            f"{fn}: activation must be a str, one of {ACTIVATIONS}, got {type_name(activation)}"
        )
    if activation not in ACTIVATIONS:
        raise ValueError(f"{fn}: activation must be one of {ACTIVATIONS}, got {activation!r}")


def _check_scalars(activation: object, dropout_p: object) -> None:
    _check_activation("ffn", activation)
    rng.check_dropout_p("ffn", dropout_p)


def _check_inputs(x, w1, b1, w2, b2, activation, dropout_p) -> None:
    """Every check of `ffn`, before any work; raises TypeError / ValueError naming the argument."""
    _check_scalars(activation, dropout_p)
    if not isinstance(x, Tensor):
        raise TypeError(f"ffn: x must be a Tensor, got {type_name(x)}")
    check_dense("ffn", "x", x)
    if x.dim() < 1:
        raise ValueError("ffn: x must have at least 1 dimension (..., d_model), got a 0-d tensor")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"ffn: x must have a floating dtype {FLOAT_DTYPES}, got {x.dtype}")
    for name, t, optional in (("w1", w1, False), ("b1", b1, True), ("w2", w2, False)):
        _check_tensor(name, t, x, optional)
    _check_tensor("b2", b2, x, optional=True)
    d_model = x.shape[-1]
    if w1.dim() != 2 or w1.shape[1] != d_model:
        raise ValueError(
            f"ffn: w1 must have shape (d_ff, d_model={d_model}) to match x {tuple(x.shape)}, "
            f"got {tuple(w1.shape)}"
        )
    gated = activation in GATED_ACTIVATIONS
    if gated and w1.shape[0] % 2:
        raise ValueError(
            f"ffn: activation {activation!r} is gated, so w1 must have shape (2 * d_ff, d_model) "
            f"with an even first dimension, got {tuple(w1.shape)}"
        )
    d_ff = w1.shape[0] // 2 if gated else w1.shape[0]
    _check_shape("b1", b1, (w1.shape[0],), f"w1 is {tuple(w1.shape)}")
    if w2.dim() != 2 or w2.shape[1] != d_ff:
        raise ValueError(
            f"ffn: w2 must have shape (d_out, d_ff={d_ff}) to match w1 {tuple(w1.shape)} "
            f"({activation}), got {tuple(w2.shape)}"
        )
    _check_shape("b2", b2, (w2.shape[0],), f"w2 is {tuple(w2.shape)}")


# --------------------------------------------------------------------------- public op


def ffn(
    x: Tensor,
    w1: Tensor,
    b1: Tensor | None,
    w2: Tensor,
    b2: Tensor | None,
    activation: str = "relu",
    dropout_p: float = 0.0,
) -> Tensor:
    """Fused feed-forward ``linear2(dropout(act(linear1(x))))`` (see the module docstring).

    Args:
        x: ``(..., d_model)``, float16 / bfloat16 / float32, any strides; float64 too (on
            CUDA it runs on the torch backend).
        w1: ``(d_ff, d_model)``, or ``(2 * d_ff, d_model)`` for swiglu / geglu.
        b1: ``(w1.shape[0],)`` or None.
        w2: ``(d_out, d_ff)``.
        b2: ``(d_out,)`` or None.
        activation: one of ``ACTIVATIONS``.
        dropout_p: drop probability in [0, 0.99991] on the ``(tokens, d_ff)`` activation.

    Returns:
        ``(..., d_out)`` in the dtype of ``x``. Differentiable in x, w1, b1, w2, b2 (first order).
    """
    if _EAGER is not None and not _is_compiling():
        out = _EAGER(x, w1, b1, w2, b2, activation, dropout_p, _eager_seed)
        if out is not None:
            return out
    _check_inputs(x, w1, b1, w2, b2, activation, dropout_p)
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad
        or w1.requires_grad
        or w2.requires_grad
        or (b1 is not None and b1.requires_grad)
        or (b2 is not None and b2.requires_grad)
    )
    dropout_p = float(dropout_p)
    if under_transform():  # eager or compiled
        return _transformed(x, w1, b1, w2, b2, activation, dropout_p)
    if traced():  # (a jit trace keeps needs_grad: it saves for a backward in any grad mode)
        needs_grad = needs_grad or torch.jit.is_tracing()
        out = _ffn_op(_rows(x), w1, b1, w2, b2, activation, dropout_p, needs_grad)[0]
        return out.view(*x.shape[:-1], w2.shape[0])
    if needs_grad and _backend(x) == "cpp":  # eager autograd in C++ (csrc/autograd.cpp)
        seed = rng.call_seed(x.device, dropout_p)
        fused = _fused_epilogue(x, activation, True)
        args = (x, w1, b1, w2, b2, activation, dropout_p, *_op_seed(seed, fused))
        return torch.ops.fastformer.ffn_autograd(*args)
    if needs_grad:
        return _FfnFunction.apply(x, w1, b1, w2, b2, activation, dropout_p)
    return _forward(x, w1, b1, w2, b2, activation, dropout_p, needs_grad=False)[0]


def _eager_seed(x: Tensor, dropout_p: float) -> int | Tensor:
    """The seed of the C entry's call with dropout: the checked path's draw (an int; inside CUDA
    graph capture a tensor drawn on the device)."""
    return rng.call_seed(x.device, dropout_p)


@autocast_off  # as the kernels, which ignore autocast
def _transformed(x, w1, b1, w2, b2, activation: str, dropout_p: float) -> Tensor:
    """The reference's function with the kernels' dropout mask (`under_transform`)."""
    keep = None
    d_ff = w1.shape[0] // 2 if activation in GATED_ACTIVATIONS else w1.shape[0]
    if dropout_p > 0 and traced():  # a seed drawn at run time, not one baked into a graph
        refuse_compiled_vmap_dropout("ffn")
        keep = _drawn_keep_mask_op(x.detach(), d_ff, dropout_p)
    elif dropout_p > 0:  # drawn here, where vmap sees the draw and applies its randomness
        keep = _keep_mask_like(rng.host_call_seed(x.device, dropout_p, "ffn"), x, d_ff, dropout_p)
    return reference.ffn(x, w1, b1, w2, b2, activation, dropout_p, keep_mask=keep)


def _keep_mask_like(seed: int, x: Tensor, d_ff: int, dropout_p: float) -> Tensor:
    """`ffn_keep_mask` viewed as (*x.shape[:-1], d_ff)."""
    tokens = math.prod(x.shape[:-1])
    return ffn_keep_mask(seed, tokens, d_ff, dropout_p, x.device).view(*x.shape[:-1], d_ff)


@torch.library.custom_op("fastformer::ffn_drawn_keep_mask", mutates_args=(), tags=DRAWS_A_SEED)
def _drawn_keep_mask_op(x: Tensor, d_ff: int, dropout_p: float) -> Tensor:
    """Draws a seed when it runs (also under torch.compile) and returns the (..., d_ff)
    keep-mask the kernels would use with it: `_transformed`'s dropout inside torch.compile."""
    _check_drawn_keep_mask(x, d_ff, dropout_p)
    return _keep_mask_like(rng.draw_seed(x.device), x, d_ff, dropout_p)


@_drawn_keep_mask_op.register_fake
def _(x, d_ff, dropout_p):
    _check_drawn_keep_mask(x, d_ff, dropout_p)
    return x.new_empty(*x.shape[:-1], d_ff, dtype=torch.bool)


def _check_drawn_keep_mask(x: Tensor, d_ff: int, dropout_p: float) -> None:
    if x.dim() < 1:
        raise ValueError("ffn_drawn_keep_mask: x must have at least 1 dimension, got 0")
    if d_ff < 0:
        raise ValueError(f"ffn_drawn_keep_mask: d_ff must be >= 0, got {d_ff}")
    rng.check_dropout_p("ffn_drawn_keep_mask", dropout_p)


def _rows(t: Tensor) -> Tensor:
    """`t` as a (tokens, features) matrix (the leading dims' product: with 0 features, -1
    would be undetermined)."""
    return t if t.dim() == 2 else t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _saved_shape(x: Tensor, w1: Tensor) -> tuple[int, int]:
    # (tokens, w1 rows): h, or for relu (never gated) dropout(relu(h)) of the same shape.
    return (math.prod(x.shape[:-1]), w1.shape[0])


def _with_lead(out: Tensor, x: Tensor) -> Tensor:
    """(tokens, n) `out` with x's leading dims; not a view, so that callers may change it in
    place (autograd forbids that for a view made inside an autograd.Function)."""
    if x.dim() == 2:
        return out
    return torch.ops.aten._unsafe_view(out, (*x.shape[:-1], out.shape[-1]))


# torch.compile sees the custom op fastformer::ffn (one opaque op, seed drawn when the graph
# runs). Eager calls skip the custom-op machinery (its dispatch cost ~60 us of host time a call
# on the CI machine, as much as the GPU time of the paper's base FFN on an H200): with gradients
# the compiled kernels run through a C++ autograd node (fastformer::ffn_autograd,
# csrc/autograd.cpp: no Python in the backward), the torch backend through a plain
# autograd.Function; without gradients the forward helper alone.


@torch.library.custom_op("fastformer::ffn", mutates_args=(), tags=DRAWS_A_SEED)
def _ffn_op(
    x: Tensor,
    w1: Tensor,
    b1: Tensor | None,
    w2: Tensor,
    b2: Tensor | None,
    activation: str,
    dropout_p: float,
    needs_grad: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(out, saved, seed) for a 2-D x; saved is empty when no gradient is needed."""
    out, saved, seed = _forward(x, w1, b1, w2, b2, activation, dropout_p, needs_grad)
    return out, saved, rng.seed_output(seed, x.device)


_CAPABILITY: dict[int, tuple[int, int]] = {}  # CUDA device index -> compute capability


def _capability(device: torch.device) -> tuple[int, int]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index]


def backend_reasons(x: Tensor) -> list[tuple[str, list[str]]]:
    """(backend, reasons it cannot run `x`) for each backend of ffn, in preference order: the
    first without reasons runs, unless FASTFORMER_BACKEND_FFN forces one. The choice reads x's
    device and dtype."""
    if not isinstance(x, Tensor):
        raise TypeError(f"backend_reasons: x must be a Tensor, got {type_name(x)}")
    if x.dtype not in FLOAT_DTYPES:  # as ffn refuses it
        raise TypeError(
            f"backend_reasons: x must have a floating dtype {FLOAT_DTYPES}, got {x.dtype}"
        )
    return explain("ffn", FfnInputs(x.device, x.dtype))


def _backend(x: Tensor) -> str:
    return select_by_key("ffn", (x.device.type, x.dtype), lambda: FfnInputs(x.device, x.dtype))


def _op_seed(seed: int | Tensor, *before_device_seed: object) -> tuple:
    """The compiled ops' seed arguments: (seed, *before_device_seed), or for a seed drawn on the
    device inside CUDA graph capture (0, *before_device_seed, device_seed), read there."""
    if isinstance(seed, int):
        return (seed, *before_device_seed)
    return (0, *before_device_seed, seed)


def _fused_epilogue(x: Tensor, activation: str, needs_grad: bool) -> bool:
    """Whether the compiled op runs bias + activation in the first GEMM's epilogue."""
    return x.is_cuda and use_fused_epilogue(
        activation, _capability(x.device), needs_grad, epilogue_mode()
    )


def _forward(
    x, w1, b1, w2, b2, activation, dropout_p, needs_grad, backend=None
) -> tuple[Tensor, Tensor, int | Tensor]:
    """(out (..., d_out), saved (tokens, width), seed: an int, or a device tensor inside CUDA
    graph capture) for x (..., d_model) through `backend` (default: the selected one)."""
    backend = backend or _backend(x)
    seed = rng.call_seed(x.device, dropout_p)
    if backend == "cpp":  # the compiled op takes (..., d_model) itself
        fused = _fused_epilogue(x, activation, needs_grad)
        out, saved = torch.ops.fastformer.ffn_forward(
            x.contiguous(), w1, b1, w2, b2, activation, dropout_p, *_op_seed(seed, fused)
        )
    else:
        rng.check_host_seed(seed, "ffn")
        out, saved = _torch_forward(_rows(x), w1, b1, w2, b2, activation, dropout_p, seed)
        out = _with_lead(out, x)
    if not needs_grad:
        saved = x.new_empty(0)
    return out, saved, seed


@_ffn_op.register_fake
def _ffn_op_fake(x, w1, b1, w2, b2, activation, dropout_p, needs_grad):
    check_devices("ffn", x, w1=w1, b1=b1, w2=w2, b2=b2)
    saved_shape = _saved_shape(x, w1) if needs_grad else (0,)
    seed = x.new_empty((), dtype=torch.int64)  # rng.seed_output
    return x.new_empty(*x.shape[:-1], w2.shape[0]), x.new_empty(saved_shape), seed


@torch.library.custom_op("fastformer::ffn_grad", mutates_args=())
def _ffn_grad_op(
    grad_out: Tensor,
    x: Tensor,
    w1: Tensor,
    w2: Tensor,
    saved: Tensor,
    seed: Tensor,
    activation: str,
    dropout_p: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, dw1, db1, dw2, db2) of `fastformer::ffn` from what its forward saved."""
    return _grad(grad_out, x, w1, w2, saved, seed, activation, dropout_p)


def _grad(
    grad_out, x, w1, w2, saved, seed, activation, dropout_p, backend=None
) -> tuple[Tensor, ...]:
    backend = backend or _backend(x)
    seed = rng.saved_seed(seed)
    if backend == "cpp":  # (..., d_out) and (..., d_model) as they are
        return torch.ops.fastformer.ffn_backward(
            grad_out.contiguous(), x, w1, w2, saved, activation, dropout_p, *_op_seed(seed)
        )
    host_seed = rng.host_seed(seed, "ffn") if dropout_p > 0 else 0  # its mask: on the host
    args = (_rows(grad_out), _rows(x), w1, w2, saved, host_seed, activation, dropout_p)
    dx, *rest = _torch_backward(*args)
    return (dx.view(x.shape), *rest)


@_ffn_grad_op.register_fake
def _ffn_grad_op_fake(grad_out, x, w1, w2, saved, seed, activation, dropout_p, op="ffn_grad"):
    check_devices(op, x, grad_out=grad_out, w1=w1, w2=w2, saved=saved, seed=seed)
    return (
        x.new_empty(x.shape),
        w1.new_empty(w1.shape),
        w1.new_empty(w1.shape[0]),
        w2.new_empty(w2.shape),
        w2.new_empty(w2.shape[0]),
    )


def _setup_context(ctx, inputs, output) -> None:
    x, w1, b1, w2, b2, activation, dropout_p = inputs[:7]
    _, saved, seed = output
    ctx.save_for_backward(x, w1, w2, saved, seed)
    _keep_options(ctx, activation, dropout_p, b1, b2)
    # saved and seed are bookkeeping outputs: no gradient flows into them, and autograd should
    # not materialize a zero (tokens, width) tensor for them at every backward.
    ctx.mark_non_differentiable(*output[1:])


def _keep_options(ctx, activation: str, dropout_p: float, b1, b2) -> None:
    ctx.set_materialize_grads(False)
    ctx.activation, ctx.dropout_p = activation, dropout_p
    ctx.has_b1, ctx.has_b2 = b1 is not None, b2 is not None
    # b1 kept outside save_for_backward, as in csrc/autograd.cpp's FfnFunction (which says why),
    # for a create_graph=True backward to read (with its version, to refuse an update since)
    # and for twice_differentiable to look at.
    ctx.tied = () if b1 is None else (b1,)
    ctx.b1_version = -1 if b1 is None else b1._version


def _input_grads(ctx, grads: tuple[Tensor, ...]) -> tuple:
    """Gradients of the 7 inputs of ffn's helpers (None for absent biases and non-tensors)."""
    dx, dw1, db1, dw2, db2 = grads
    return dx, dw1, db1 if ctx.has_b1 else None, dw2, db2 if ctx.has_b2 else None, None, None


def _check_saved(saved: Tensor) -> None:
    if saved.dim() != 2:
        raise RuntimeError(
            "fastformer::ffn ran with needs_grad=False, so it saved nothing to differentiate"
        )


def _grads_by_reference(ctx, grad_out: Tensor | None, seed: int | Tensor) -> tuple:
    """`_input_grads` under create_graph=True (`ffn_grads_by_reference`)."""
    if grad_out is None:
        return (None,) * 7
    x, w1, w2 = ctx.saved_tensors[:3]
    b1 = ctx.tied[0] if ctx.tied else None
    options = (ctx.activation, ctx.dropout_p, ctx.has_b2, ctx.b1_version)
    return _input_grads(ctx, ffn_grads_by_reference(grad_out, x, w1, b1, w2, seed, *options))


def _op_grads_by_reference(ctx, grad_out, _grad_saved, _grad_seed) -> tuple:
    return (*_grads_by_reference(ctx, grad_out, ctx.saved_tensors[4]), None)


def _function_grads_by_reference(ctx, grad_out) -> tuple:
    return _grads_by_reference(ctx, grad_out, ctx.seed)


@twice_differentiable(_op_grads_by_reference)  # _ffn_grad_op has no autograd
def _backward(ctx, grad_out, _grad_saved, _grad_seed):
    if grad_out is None:  # grads are not materialized: nothing flowed into `out`
        return (None,) * 8
    x, w1, w2, saved, seed = ctx.saved_tensors
    _check_saved(saved)
    grads = _ffn_grad_op(grad_out, x, w1, w2, saved, seed, ctx.activation, ctx.dropout_p)
    return (*_input_grads(ctx, grads), None)  # needs_grad gets None too


_ffn_op.register_autograd(_backward, setup_context=_setup_context)


class _FfnFunction(torch.autograd.Function):
    """Eager autograd of fastformer::ffn on its torch backend (the compiled kernels have their
    C++ node): the same helpers, less the custom-op dispatch. It takes x of any rank as it is,
    so that autograd records one node, not three (reshape, op, view)."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, activation, dropout_p):
        inputs = (x, w1, b1, w2, b2, activation, dropout_p)
        out, saved, ctx.seed = _forward(*inputs, needs_grad=True, backend="torch")
        ctx.save_for_backward(x, w1, w2, saved)
        _keep_options(ctx, activation, dropout_p, b1, b2)
        return out

    @staticmethod
    @twice_differentiable(_function_grads_by_reference)
    def backward(ctx, grad_out):
        if grad_out is None:
            return (None,) * 7
        x, w1, w2, saved = ctx.saved_tensors
        _check_saved(saved)
        args = (grad_out, x, w1, w2, saved, ctx.seed, ctx.activation, ctx.dropout_p)
        return _input_grads(ctx, _grad(*args, backend="torch"))


def ffn_grads_by_reference(
    grad_out: Tensor,
    x: Tensor,
    w1: Tensor,
    b1: Tensor | None,
    w2: Tensor,
    seed: int | Tensor,
    activation: str,
    dropout_p: float,
    has_b2: bool,
    b1_version: int = -1,
) -> list[Tensor | None]:
    """The gradients of (x, w1, b1, w2, b2) of an ffn call, by autograd through the reference's
    operations with the call's keep-mask (regenerated from `seed`): under create_graph=True,
    differentiable again. None for the inputs that do not require grad and absent biases.

    b1 is not saved for backward (an in-place update of it must not fail a first-order
    backward, as for torch's linear); here it is read, so an update since the forward
    (`b1_version`, its version then) raises as autograd does for a saved tensor.
    """
    if b1 is not None and b1._version != b1_version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: b1 of fastformer's FFN is at version {b1._version}; expected "
            f"version {b1_version} instead (a create_graph=True backward reads it)"
        )
    keep = None
    if dropout_p > 0:
        keep = _keep_mask_like(rng.host_seed(seed, "ffn"), x, w2.shape[1], dropout_p)

    def forward(x, w1, b1, w2):
        return (reference.ffn(x, w1, b1, w2, None, activation, dropout_p, keep_mask=keep),)

    grads = differentiable_vjp(forward, (x, w1, b1, w2), (grad_out,))
    db2 = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if has_b2 else None
    return [*grads, db2]


# The C++ autograd node's call of `ffn_grads_by_reference` (csrc/autograd.cpp), through the
# dispatcher: a CompositeImplicitAutograd kernel, so that autograd records its operations.
_LIBRARY = torch.library.Library("fastformer", "FRAGMENT")
_LIBRARY.define(
    "ffn_grads_by_reference(Tensor grad_out, Tensor x, Tensor w1, Tensor? b1, Tensor w2, "
    "Tensor? device_seed, int seed, str activation, float dropout_p, bool has_b2, "
    "int b1_version) -> Tensor[]"
)


def _grads_by_reference_op(grad_out, x, w1, b1, w2, device_seed, seed, *options) -> list[Tensor]:
    """The 5 gradients of (x, w1, b1, w2, b2); an empty tensor for those not computed."""
    seed = seed if device_seed is None else device_seed
    return tensor_list(ffn_grads_by_reference(grad_out, x, w1, b1, w2, seed, *options), x)


_LIBRARY.impl("ffn_grads_by_reference", _grads_by_reference_op, "CompositeImplicitAutograd")


# --------------------------------------------------------------------------- torch backend

_ACT = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "silu": F.silu,
    "swiglu": F.silu,
    "geglu": F.gelu,
}


def _act_backward(grad: Tensor, h: Tensor, activation: str) -> Tensor:
    """grad * act'(h) through ATen's own derivative kernels (what autograd would run)."""
    if activation in ("gelu", "geglu"):
        return torch.ops.aten.gelu_backward(grad, h, approximate="none")
    if activation == "gelu_tanh":
        return torch.ops.aten.gelu_backward(grad, h, approximate="tanh")
    return torch.ops.aten.silu_backward(grad, h)


def _dropout(g: Tensor, seed: int, dropout_p: float) -> Tensor:
    if dropout_p == 0.0:
        return g
    keep = ffn_keep_mask(seed, g.shape[0], g.shape[1], dropout_p, g.device)
    return g * keep.to(g.dtype) * (1.0 / (1.0 - dropout_p))


@autocast_off
def _torch_forward(x, w1, b1, w2, b2, activation, dropout_p, seed) -> tuple[Tensor, Tensor]:
    """Plain-PyTorch forward: (out, saved) with the same meaning as ffn_forward's."""
    h = F.linear(x, w1, b1)
    if activation in GATED_ACTIVATIONS:
        gate, up = h.chunk(2, dim=-1)
        g = _ACT[activation](gate) * up
    else:
        g = _ACT[activation](h)
    g = _dropout(g, seed, dropout_p)
    return F.linear(g, w2, b2), g if activation == "relu" else h


@autocast_off
def _torch_backward(grad_out, x, w1, w2, saved, seed, activation, dropout_p):
    """Plain-PyTorch backward from (x, saved, seed): (dx, dw1, db1, dw2, db2)."""
    dg = grad_out @ w2
    scale = 1.0 / (1.0 - dropout_p)
    if activation == "relu":
        g = saved
        passes = ~(g <= 0)  # NaN too, as torch's relu: unless dropout dropped it (NaN * 0 is NaN)
        if dropout_p > 0:  # (the mask regardless of NaNs: no data-dependent branch, meta works)
            passes &= ffn_keep_mask(seed, x.shape[0], dg.shape[1], dropout_p, x.device)
        dh = torch.where(passes, dg * scale, torch.zeros_like(dg))
    else:
        keep = ffn_keep_mask(seed, x.shape[0], dg.shape[1], dropout_p, x.device).to(dg.dtype)
        dm = dg * keep * scale
        if activation in GATED_ACTIVATIONS:
            gate, up = saved.chunk(2, dim=-1)
            a = _ACT[activation](gate)
            g = a * up * keep * scale
            dh = torch.cat([_act_backward(dm * up, gate, activation), dm * a], dim=-1)
        else:
            g = _ACT[activation](saved) * keep * scale
            dh = _act_backward(dm, saved, activation)
    return dh @ w1, dh.t() @ x, dh.sum(0), grad_out.t() @ g, grad_out.sum(0)


# --------------------------------------------------------------------------- kernel fakes


def _register_kernel_fakes() -> None:
    """Fake kernels of the compiled ops, so they trace and pass opcheck on their own too."""
    if extension_error() is not None or not hasattr(torch.ops.fastformer, "ffn_forward"):
        return

    @torch.library.register_fake("fastformer::ffn_forward")
    def _(x, w1, b1, w2, b2, activation, dropout_p, seed, fused_epilogue=False, device_seed=None):
        check_devices("ffn_forward", x, w1=w1, b1=b1, w2=w2, b2=b2, device_seed=device_seed)
        epilogue_only = fused_epilogue and x.device.type == "cuda" and activation == "gelu_tanh"
        saved_shape = (0,) if epilogue_only else _saved_shape(x, w1)
        return x.new_empty(*x.shape[:-1], w2.shape[0]), x.new_empty(saved_shape)

    @torch.library.register_fake("fastformer::ffn_backward")
    def _(grad_out, x, w1, w2, saved, activation, dropout_p, seed, device_seed=None):
        check_devices("ffn_backward", x, device_seed=device_seed)
        args = (grad_out, x, w1, w2, saved, seed, activation, dropout_p)
        return _ffn_grad_op_fake(*args, op="ffn_backward")


_register_kernel_fakes()
