"""LayerNorm, RMSNorm and the fused dropout + residual-add + LayerNorm.

Public functions (semantics of ``torch.nn.functional`` where it has them):

* ``layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5)``
* ``rms_norm(input, normalized_shape, weight=None, eps=None)``
* ``dropout_add_layer_norm(x, residual, weight, bias, eps=1e-5, dropout_p=0.0, prenorm=False)``:
  ``LayerNorm(residual + dropout(x))`` over the last dim in one pass; ``prenorm=True`` also
  returns ``pre = residual + dropout(x)`` (the next residual stream).
* ``dropout_add_layer_norm_keep_mask(seed, shape, dropout_p)``: the keep-mask a call with that
  seed used, regenerated (for tests and debugging) by fastformer._C's element_uniform kernel
  when it is loaded for the device, else in plain PyTorch: the same bits.

Backends (``fastformer.ops._dispatch``, op name ``"layer_norm"``): ``cpp`` runs the compiled
kernels of ``csrc/layer_norm`` (CPU always, CUDA when built with nvcc), then ``torch`` runs the
eager reference (``fastformer.reference``). ``FASTFORMER_BACKEND_LAYER_NORM`` forces one.
An eager call with plain arguments (exact tensors, one normalized dim, a float eps and dropout_p,
no tracer, transform or mode) runs the cpp kernels from one C call, ``fastformer._C``'s
``layer_norm_eager`` (layer_norm, rms_norm) or ``dropout_add_layer_norm_eager``; they return None
for any other call, which takes the checked Python path.

Dtypes: inputs float32, float16 or bfloat16, and float64 (the C++ CPU kernels take it too, so
``gradcheck`` tests the real kernels; on CUDA float64 runs on the torch backend). Weight and
bias have the input dtype or float32; the output has the input dtype. Statistics are kept in
float32 (float64 for float64 inputs).

Dropout: one seed per call, drawn from the torch generator of the input's device inside the
custom op (so ``torch.compile`` draws it at run time and ``torch.manual_seed`` reproduces a
run). Element ``i`` of ``x.reshape(-1, N)`` in row-major order (int64 offset ``row * N + col``)
is kept when ``element_uniform(seed, i) >= dropout_p`` (fastformer.ops.rng) and scaled by ``1 / (1 - dropout_p)``.
The backward regenerates the mask from the seed: no mask is stored. Inside CUDA graph capture
the seed is drawn on the device and the CUDA kernels read it there, so each replay drops
different elements (``fastformer.ops.rng.draw_call_seed``). The normalized input
``pre`` is kept for the backward (and returned when ``prenorm``), rounded to the input dtype.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

from fastformer import reference
from fastformer._ext import cuda_kernels_compiled, extension_error, load_extension
from fastformer.ops import rng
from fastformer.ops._autograd import (
    DRAWS_A_SEED,
    check_dense,
    check_devices,
    differentiable_vjp,
    positive_float,
    refuse_compiled_vmap_dropout,
    tensor_list,
    traced,
    twice_differentiable,
    type_name,
    under_transform,
)
from fastformer.ops._dispatch import Backend, explain, register, select_by_key

__all__ = [
    "dropout_add_layer_norm",
    "dropout_add_layer_norm_keep_mask",
    "layer_norm",
    "rms_norm",
]

OP = "layer_norm"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_CUDA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# --------------------------------------------------------------------------- backends


# Read once at import: torch.compile traces the backend choice, and these are cached loaders.
_EXTENSION_ERROR = extension_error()
_CUDA_KERNELS = cuda_kernels_compiled()
# The plain eager call of layer_norm / rms_norm (_EAGER) and of dropout_add_layer_norm
# (_EAGER_FUSED) in one C call, None for any other call (csrc/layer_norm/layer_norm_eager.cpp):
# between ops that stream memory, the checked path's Python ran with cold caches, ~45 us above
# the kernel on a CPU. Absent without the extension.
_C = load_extension()
_EAGER = getattr(_C, "layer_norm_eager", None)
_EAGER_FUSED = getattr(_C, "dropout_add_layer_norm_eager", None)
_is_compiling = torch.compiler.is_compiling  # (dynamo folds it: the C calls are never traced)


def _cpp_reasons(x: Tensor | None) -> list[str]:
    """Why the compiled kernels cannot run `x` (None: this environment)."""
    if _EXTENSION_ERROR is not None:
        return [_EXTENSION_ERROR]
    if x is None:
        return []
    if x.device.type == "cuda":
        if not _CUDA_KERNELS:
            return ["fastformer._C was built without CUDA kernels (no nvcc or a CPU-only torch)"]
        if x.dtype not in _CUDA_DTYPES:
            return [f"the CUDA kernels take float32, float16 or bfloat16 inputs, got {x.dtype}"]
    elif x.device.type != "cpu":
        return [f"no kernels for device type {x.device.type!r}"]
    return []


def _torch_reasons(x: Tensor | None) -> list[str]:
    return []


register(OP, [Backend("cpp", _cpp_reasons), Backend("torch", _torch_reasons)])

# --------------------------------------------------------------------------- input checks


def _check_input(fn: str, name: str, x: object) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type_name(x)}")
    check_dense(fn, name, x)
    if x.dtype not in _DTYPES:
        raise TypeError(
            f"{fn}: {name} must be float32, float16, bfloat16 or float64, got {x.dtype}"
        )
    return x


def _normalized_shape(fn: str, x: Tensor, normalized_shape: object) -> tuple[int, ...]:
    # The common cases (an int, or one int in a tuple, list or torch.Size, matching the last
    # dim) cost ~0.2 us here instead of ~2.5 us through the general checks below.
    last = normalized_shape
    if type(normalized_shape) in (tuple, list, torch.Size) and len(normalized_shape) == 1:
        last = normalized_shape[0]
    if type(last) is int and last >= 1 and x.dim() >= 1 and x.shape[-1] == last:
        return (last,)
    if isinstance(normalized_shape, numbers.Integral) and not isinstance(normalized_shape, bool):
        shape: tuple = (int(normalized_shape),)
    elif isinstance(normalized_shape, Sequence) and all(
        isinstance(d, numbers.Integral) and not isinstance(d, bool) for d in normalized_shape
    ):
        shape = tuple(int(d) for d in normalized_shape)
    else:
        raise TypeError(
            f"{fn}: normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}"
        )
    if not shape or any(d < 0 for d in shape):  # 0 is empty rows, as torch.nn.LayerNorm(0)
        raise ValueError(f"{fn}: normalized_shape must be non-empty and non-negative, got {shape}")
    if len(shape) > x.dim() or tuple(x.shape[x.dim() - len(shape) :]) != shape:
        raise ValueError(
            f"{fn}: normalized_shape {shape} does not match the trailing dims of input "
            f"{tuple(x.shape)}; expected input of shape (*, {', '.join(map(str, shape))})"
        )
    return shape


def _check_param(
    fn: str, name: str, p: object, x: Tensor, shape: tuple[int, ...], x_name: str
) -> None:
    if p is None:
        return
    if not isinstance(p, Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor or None, got {type_name(p)}")
    check_dense(fn, name, p)
    if p.shape != shape:  # torch.Size is a tuple: no copy to compare
        raise ValueError(f"{fn}: {name} must have shape {shape}, got {tuple(p.shape)}")
    if p.dtype not in (x.dtype, torch.float32):
        allowed = (
            "float32" if x.dtype == torch.float32 else f"the {x_name} dtype {x.dtype} or float32"
        )
        raise TypeError(f"{fn}: {name} must be {allowed}, got {p.dtype}")
    if p.device != x.device:
        raise ValueError(f"{fn}: {name} is on {p.device} but {x_name} is on {x.device}")


def _check_params(
    fn: str, x: Tensor, shape: tuple[int, ...], weight: object, bias: object, x_name="input"
):
    """`x_name`: what `fn` calls x, for the messages (input in layer_norm, x in the fused op)."""
    _check_param(fn, "weight", weight, x, shape, x_name)
    _check_param(fn, "bias", bias, x, shape, x_name)
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        raise TypeError(
            f"{fn}: weight and bias must have the same dtype, got {weight.dtype} and {bias.dtype}"
        )


def _check_eps(fn: str, eps: object) -> float:
    if type(eps) is float and 0.0 < eps < math.inf:  # the usual case, without the ABC checks
        return eps
    return positive_float(fn, "eps", eps)


def _check_residual(fn: str, residual: object, x: Tensor) -> None:
    if residual is None:
        return
    if not isinstance(residual, Tensor):
        raise TypeError(f"{fn}: residual must be a torch.Tensor or None, got {type_name(residual)}")
    check_dense(fn, "residual", residual)
    if residual.shape != x.shape:
        raise ValueError(
            f"{fn}: residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}"
        )
    if residual.dtype != x.dtype:
        raise TypeError(f"{fn}: residual must have the dtype of x {x.dtype}, got {residual.dtype}")
    if residual.device != x.device:
        raise ValueError(f"{fn}: residual is on {residual.device} but x is on {x.device}")


# --------------------------------------------------------------------------- custom ops
#
# torch.compile sees the custom op fastformer::layer_norm (one opaque op, seed drawn when the
# graph runs). Eager calls skip the custom-op machinery (~40 us a call on the CI machine): with
# gradients they run the same kernels through a C++ autograd node (fastformer::layer_norm_autograd,
# csrc/autograd.cpp: no Python in the backward), without them the forward helper alone; the
# compile tests check both paths give the same bits.


def _forward(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    residual: Tensor | None,
    eps: float,
    dropout_p: float,
    rms: bool,
    store_pre: bool,
    seed: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Draws the dropout seed (when dropout_p > 0) and runs the compiled forward."""
    if dropout_p > 0 or seed is None:
        seed = rng.seed_output(rng.call_seed(x.device, dropout_p), x.device)
    out, pre, mean, rstd = torch.ops.fastformer.layer_norm_fwd(
        x, weight, bias, residual, seed, eps, dropout_p, rms, store_pre
    )
    return out, pre, mean, rstd, seed


@torch.library.custom_op("fastformer::layer_norm", mutates_args=(), tags=DRAWS_A_SEED)
def _layer_norm_op(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    residual: Tensor | None,
    eps: float,
    dropout_p: float,
    rms: bool,
    store_pre: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The compiled forward on a (..., cols) input (rows: the leading dims together); draws the
    dropout seed (here, at run time).

    Returns out (x's shape), pre (x's shape; (0,) unless stored), mean ((rows,); (0,) for
    RMSNorm), rstd (rows,) and the seed as a 0-dim int64 tensor on x's device (`rng.seed_output`).
    """
    return _forward(x, weight, bias, residual, eps, dropout_p, rms, store_pre)


def _fused(residual: Tensor | None, dropout_p: float, store_pre: bool) -> bool:
    # The kernel normalizes pre (and writes it) when there is something to add or drop, or
    # when pre is asked for.
    return residual is not None or dropout_p > 0 or store_pre


def _stats_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _fwd_fake(x, weight, bias, residual, eps, dropout_p, rms, store_pre, seed=None):
    check_devices("layer_norm", x, weight=weight, bias=bias, residual=residual, seed=seed)
    rows = math.prod(x.shape[:-1])
    pre_shape = x.shape if store_pre else (0,)
    mean = x.new_empty((0,) if rms else (rows,), dtype=_stats_dtype(x))
    rstd = x.new_empty((rows,), dtype=_stats_dtype(x))
    # Contiguous, as the kernels' (they read x contiguous): inductor checks the strides.
    return x.new_empty(x.shape), x.new_empty(pre_shape), mean, rstd


@_layer_norm_op.register_fake
def _(x, weight, bias, residual, eps, dropout_p, rms, store_pre):
    out = _fwd_fake(x, weight, bias, residual, eps, dropout_p, rms, store_pre)
    return (*out, x.new_empty((), dtype=torch.int64))  # rng.seed_output


def _save(ctx, inputs, output) -> None:
    """What the backward needs: the normalized input (x, or pre when fused), the parameters,
    mean, rstd and the seed (the dropout mask is regenerated from it, never stored)."""
    x, weight, bias, residual, eps, dropout_p, rms, store_pre = inputs
    _, pre, mean, rstd, seed = output
    ctx.fused = _fused(residual, dropout_p, store_pre)
    if ctx.fused and pre.numel() == 0 and x.numel() > 0:
        raise RuntimeError("fastformer::layer_norm: the backward needs pre; call with store_pre")
    # (Zero rows: no pre is written; x, as empty, stands for it.)
    use_pre = ctx.fused and pre.numel() != 0
    ctx.save_for_backward(pre if use_pre else x, weight, bias, mean, rstd, seed)
    ctx.dropout_p, ctx.rms, ctx.has_residual = dropout_p, rms, residual is not None
    ctx.eps = eps
    ctx.set_materialize_grads(False)  # an unused pre gets no zero gradient tensor


def _setup_context(ctx, inputs, output) -> None:
    _save(ctx, inputs, output)
    ctx.mark_non_differentiable(*output[2:])  # mean, rstd, seed


def _needs(ctx, dout: Tensor | None, weight, bias) -> tuple[bool, bool, bool, bool]:
    """Which of (x, weight, bias, residual) get a gradient: weight and bias none when only pre
    was used (dout None: they did not shape it; None, as torch gives)."""
    need_x, need_w, need_b, need_res = ctx.needs_input_grad[:4]
    out_used = dout is not None
    return (
        need_x,
        weight is not None and need_w and out_used,
        bias is not None and need_b and out_used,
        ctx.has_residual and need_res,
    )


def _grads_by_reference(ctx, dout, dpre, _dmean, _drstd, _dseed):
    """`_backward` under create_graph=True (`norm_grads_by_reference`)."""
    xin, weight, bias, _, _, seed = ctx.saved_tensors
    needs = _needs(ctx, dout, weight, bias)
    args = (seed, ctx.eps, ctx.dropout_p, ctx.rms, ctx.fused, *needs)
    grads = norm_grads_by_reference(dout, dpre, xin, weight, bias, *args)
    return (*grads, None, None, None, None)


@twice_differentiable(_grads_by_reference)  # layer_norm_bwd has no autograd
def _backward(ctx, dout, dpre, _dmean, _drstd, _dseed):
    return _grads(ctx, dout, dpre)


def _grads(ctx, dout: Tensor | None, dpre: Tensor | None) -> tuple:
    """Gradients of (x, weight, bias, residual, and None for the 4 non-tensor arguments)."""
    xin, weight, bias, mean, rstd, seed = ctx.saved_tensors
    need_x, need_w, need_b, need_res = _needs(ctx, dout, weight, bias)
    if dout is None:  # only pre was used
        dout = torch.zeros_like(xin)
    if dpre is not None and dpre.numel() == 0:
        dpre = None
    dx, dres, dweight, dbias = torch.ops.fastformer.layer_norm_bwd(
        dout,
        dpre,
        xin,
        weight,
        bias,
        mean,
        rstd,
        seed,
        ctx.dropout_p,
        ctx.rms,
        ctx.fused,
        need_res,
        need_w,
        need_b,
    )
    return (
        dx if need_x else None,
        dweight if need_w else None,
        dbias if need_b else None,
        dres if need_res else None,
        None,
        None,
        None,
        None,
    )


def norm_grads_by_reference(
    dout: Tensor | None,
    dpre: Tensor | None,
    xin: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    seed: Tensor,
    eps: float,
    dropout_p: float,
    rms: bool,
    fused: bool,
    need_x: bool,
    need_w: bool,
    need_b: bool,
    need_res: bool,
) -> list[Tensor | None]:
    """The gradients of (x, weight, bias, residual) of a LayerNorm / RMSNorm call, by autograd
    through the reference's operations: under create_graph=True, differentiable again.

    From the backward's saved tensors: `xin` is x, or pre = residual + dropout(x) when `fused`
    (then x's gradient is pre's through the call's keep-mask, regenerated from `seed`, and the
    residual's is pre's). `dout` (None: only pre was used) and `dpre` are the cotangents of
    the normalized output and of pre. None where a gradient is not needed.
    """
    if dpre is not None and dpre.numel() == 0:
        dpre = None
    shape = (xin.shape[-1],)

    def forward(xin, weight, bias):
        if rms:
            return (reference.rms_norm(xin, shape, weight, eps).to(xin.dtype),)
        return (reference.layer_norm(xin, shape, weight, bias, eps).to(xin.dtype),)

    dxin = dweight = dbias = None
    if dout is not None:  # else only pre was used
        dxin, dweight, dbias = differentiable_vjp(forward, (xin, weight, bias), (dout,))
    if dpre is not None:
        dxin = dpre if dxin is None else dxin + dpre
    if dxin is None:
        dxin = torch.zeros_like(xin)
    dx = dxin
    if fused and dropout_p > 0 and need_x:
        host = rng.host_seed(seed, "dropout_add_layer_norm")
        keep = dropout_add_layer_norm_keep_mask(host, xin.shape, dropout_p, device=xin.device)
        dx = reference._apply_keep_mask(dxin, keep, dropout_p, "keep_mask")
    return [
        dx if need_x else None,
        dweight if need_w else None,
        dbias if need_b else None,
        dxin if need_res else None,
    ]


# The C++ autograd node's call of `norm_grads_by_reference` (csrc/autograd.cpp), through the
# dispatcher: a CompositeImplicitAutograd kernel, so that autograd records its operations.
_LIBRARY = torch.library.Library("fastformer", "FRAGMENT")
_LIBRARY.define(
    "layer_norm_grads_by_reference(Tensor? dout, Tensor? dpre, Tensor xin, Tensor? weight, "
    "Tensor? bias, Tensor seed, float eps, float dropout_p, bool rms, bool fused, bool need_x, "
    "bool need_w, bool need_b, bool need_res) -> Tensor[]"
)


def _grads_by_reference_op(dout, dpre, xin, weight, bias, *args) -> list[Tensor]:
    """The gradients of (x, weight, bias, residual); an empty tensor for those not needed."""
    return tensor_list(norm_grads_by_reference(dout, dpre, xin, weight, bias, *args), xin)


_LIBRARY.impl("layer_norm_grads_by_reference", _grads_by_reference_op, "CompositeImplicitAutograd")


_layer_norm_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("fastformer::layer_norm_keep_mask", mutates_args=(), tags=DRAWS_A_SEED)
def _keep_mask_op(x: Tensor, dropout_p: float) -> Tensor:
    """Torch backend: draws a seed (at run time, also under torch.compile) and returns the bool
    keep-mask of x's shape that the compiled kernels would use with that seed."""
    rng.check_dropout_p("layer_norm_keep_mask", dropout_p)
    seed = rng.draw_seed(x.device)
    return dropout_add_layer_norm_keep_mask(seed, x.shape, dropout_p, device=x.device)


@_keep_mask_op.register_fake
def _(x, dropout_p):
    return torch.empty(x.shape, dtype=torch.bool, device=x.device)


def _register_compiled_fakes() -> None:
    """Fake kernels of the C++ ops (traced in the backward under torch.compile)."""

    @torch.library.register_fake("fastformer::layer_norm_fwd")
    def _(x, weight, bias, residual, seed, eps, dropout_p, rms, store_pre):
        return _fwd_fake(x, weight, bias, residual, eps, dropout_p, rms, store_pre, seed)

    @torch.library.register_fake("fastformer::layer_norm_bwd")
    def _(dy, dpre, x, weight, bias, mean, rstd, seed, p, rms, fused, has_res, need_w, need_b):
        tensors = dict(dy=dy, dpre=dpre, weight=weight, bias=bias, mean=mean, rstd=rstd, seed=seed)
        check_devices("layer_norm_bwd", x, **tensors)
        cols = x.shape[-1]
        return (  # each its own tensor, the empty ones too, as the kernel's
            x.new_empty(x.shape),  # contiguous, as the kernel's
            x.new_empty(x.shape) if has_res else x.new_empty((0,)),
            weight.new_empty((cols,)) if need_w else x.new_empty((0,)),
            bias.new_empty((cols,)) if need_b else x.new_empty((0,)),
        )


if _EXTENSION_ERROR is None:
    _register_compiled_fakes()

# --------------------------------------------------------------------------- public API


def dropout_add_layer_norm_keep_mask(
    seed: int,
    shape: Sequence[int],
    dropout_p: float,
    *,
    device: torch.device | str | None = None,
) -> Tensor:
    """The dropout keep-mask of a ``dropout_add_layer_norm`` call that drew ``seed``.

    Bit-identical to the CPU and CUDA kernels: element ``i`` in row-major order over ``shape``
    is kept when ``element_uniform(seed, i) >= p``. Computed by ``rng.dropout_keep``:
    fastformer._C's element_uniform kernel when it is loaded for ``device`` (CPU; CUDA when built
    with CUDA kernels), else the same bits in plain PyTorch.

    Returns:
        bool tensor of ``shape`` (True = keep) on ``device`` (default CPU).
    """
    fn = "dropout_add_layer_norm_keep_mask"
    if not isinstance(shape, Sequence):
        raise TypeError(f"{fn}: shape must be a sequence of ints, got {type_name(shape)}")
    sizes = {f"shape[{i}]": n for i, n in enumerate(shape)}
    dropout_p = rng.check_keep_mask_args(fn, seed, sizes, dropout_p)
    numel = math.prod(shape)
    offsets = torch.arange(numel, dtype=torch.int64, device=device).reshape(tuple(shape))
    return rng.dropout_keep(seed, offsets, dropout_p)


def _grad_needed(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _as_rows(t: Tensor, cols: int) -> Tensor:
    """t as the ops take it, (..., cols): itself when its last dim is cols, else flattened to
    (rows, cols) (a normalized shape of several dims; a view when t's layout allows)."""
    return t if t.dim() >= 1 and t.shape[-1] == cols else t.reshape(-1, cols)


def _eager_seed(x: Tensor, dropout_p: float, grad: bool) -> Tensor:
    """The seed of an eager call: for the autograd node a CPU scalar (NO_SEED without dropout;
    inside CUDA graph capture a draw on the device), else the forward's seed output. Also what
    the C entry of dropout_add_layer_norm calls, once it has taken a call with dropout."""
    seed = rng.call_seed(x.device, dropout_p)
    return rng.seed_tensor(seed) if grad else rng.seed_output(seed, x.device)


def _run_cpp(
    x: Tensor,
    cols: int,
    weight: Tensor | None,
    bias: Tensor | None,
    residual: Tensor | None,
    eps: float,
    dropout_p: float,
    rms: bool,
    prenorm: bool,
) -> Tensor | tuple[Tensor, Tensor]:
    # (A jit trace keeps store_pre: it stores pre for a backward in any grad mode.)
    grad = _grad_needed(x, residual, weight, bias) or torch.jit.is_tracing()
    store_pre = prenorm or (grad and (residual is not None or dropout_p > 0))
    args = (
        _as_rows(x, cols),
        weight if weight is None or weight.dim() == 1 else weight.reshape(cols),
        bias if bias is None or bias.dim() == 1 else bias.reshape(cols),
        None if residual is None else _as_rows(residual, cols),
        eps,
        dropout_p,
        rms,
        store_pre,
    )
    if traced():
        out, pre = _layer_norm_op(*args)[:2]
    elif grad:  # eager autograd in C++ (csrc/autograd.cpp): no Python in the backward
        seed = _eager_seed(x, dropout_p, grad=True)
        out, pre = torch.ops.fastformer.layer_norm_autograd(*args[:4], seed, *args[4:])
    else:
        out, pre = _forward(*args, seed=rng.NO_SEED)[:2]
    if out.shape != x.shape:
        out = out.view(x.shape)
        pre = pre.view(x.shape) if prenorm else pre
    return (out, pre) if prenorm else out


def _keep_mask(x: Tensor, dropout_p: float) -> Tensor:
    """The keep-mask of the torch backend's dropout: through the custom op, which draws its
    seed when it runs (also under torch.compile). Eagerly under a torch.func transform the seed
    is drawn here, where vmap sees the draw and applies its `randomness` (the custom op runs once
    a sample through vmap's fallback, a new mask each: traced, that is only right for
    randomness="different", see `refuse_compiled_vmap_dropout`)."""
    if under_transform():
        if not traced():
            seed = rng.host_call_seed(x.device, dropout_p, "dropout_add_layer_norm")
            return dropout_add_layer_norm_keep_mask(seed, x.shape, dropout_p, device=x.device)
        refuse_compiled_vmap_dropout("dropout_add_layer_norm")
    return _keep_mask_op(x.detach(), dropout_p)


def _run_torch(
    x: Tensor,
    shape: tuple[int, ...],
    weight: Tensor | None,
    bias: Tensor | None,
    residual: Tensor | None,
    eps: float,
    dropout_p: float,
    rms: bool,
    prenorm: bool,
) -> Tensor | tuple[Tensor, Tensor]:
    # The reference computes in the dtype type promotion gives; outputs keep the input dtype
    # and are contiguous, as the kernels' and F.layer_norm's (the reference's follow x's order).
    def like_kernels(t: Tensor) -> Tensor:
        return t.to(x.dtype).contiguous()

    if rms:
        return like_kernels(reference.rms_norm(x, shape, weight, eps))
    if residual is None and dropout_p == 0 and not prenorm:
        return like_kernels(reference.layer_norm(x, shape, weight, bias, eps))
    keep = _keep_mask(x, dropout_p) if dropout_p > 0 else None
    result = reference.dropout_add_layer_norm(
        x, residual, weight, bias, eps, dropout_p, prenorm, keep_mask=keep
    )
    if prenorm:  # pre is a new tensor, as the kernels' (the reference returns x itself
        # when there is nothing to add or drop; a caller may write into pre)
        pre = (
            result[1].clone(memory_format=torch.contiguous_format) if result[1] is x else result[1]
        )
        return like_kernels(result[0]), pre.contiguous()
    return like_kernels(result)


def _run(x, shape, weight, bias, residual, eps, dropout_p, rms, prenorm):
    args = (weight, bias, residual, eps, dropout_p, rms, prenorm)
    # (Rows of no columns, torch.nn.LayerNorm(0)'s, are empty: the kernels want columns.)
    if under_transform() or math.prod(shape) == 0:  # eager or compiled
        return _run_torch(x, shape, *args)
    if select_by_key(OP, (x.device.type, x.dtype), lambda: x) == "cpp":
        return _run_cpp(x, math.prod(shape), *args)
    return _run_torch(x, shape, *args)


def backend_reasons(input: Tensor) -> list[tuple[str, list[str]]]:
    """(backend, reasons it cannot run `input`) for each backend of layer_norm, rms_norm and
    dropout_add_layer_norm, in preference order: the first without reasons runs, unless
    FASTFORMER_BACKEND_LAYER_NORM forces one. The choice reads input's device and dtype."""
    return explain(OP, _check_input("backend_reasons", "input", input))


def layer_norm(
    input: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """``torch.nn.functional.layer_norm``: normalize over the trailing ``normalized_shape`` dims.

    Args:
        input: ``(*, *normalized_shape)``, float32/float16/bfloat16 (float64 too, see module doc).
        normalized_shape: int or sequence of ints, the trailing dims of ``input``.
        weight, bias: ``normalized_shape``, the input dtype or float32, or None.
        eps: > 0, added to the (biased) variance.

    Returns:
        Tensor of ``input``'s shape and dtype.
    """
    if _EAGER is not None and not _is_compiling():
        out = _EAGER(input, normalized_shape, weight, bias, eps, False)
        if out is not None:
            return out
    fn = "layer_norm"
    x = _check_input(fn, "input", input)
    shape = _normalized_shape(fn, x, normalized_shape)
    _check_params(fn, x, shape, weight, bias)
    return _run(x, shape, weight, bias, None, _check_eps(fn, eps), 0.0, False, False)


def rms_norm(
    input: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    eps: float | None = None,
) -> Tensor:
    """``torch.nn.functional.rms_norm``: ``x / sqrt(mean(x^2) + eps) * weight``.

    Args:
        input: ``(*, *normalized_shape)``, float32/float16/bfloat16 (float64 too).
        normalized_shape: int or sequence of ints, the trailing dims of ``input``.
        weight: ``normalized_shape``, the input dtype or float32, or None.
        eps: > 0; None means ``fastformer.reference.rms_norm_eps(input.dtype)``, as
            ``F.rms_norm``: float32's machine epsilon for 16-bit inputs.

    Returns:
        Tensor of ``input``'s shape and dtype.
    """
    if _EAGER is not None and not _is_compiling():
        out = _EAGER(input, normalized_shape, weight, None, eps, True)
        if out is not None:
            return out
    fn = "rms_norm"
    x = _check_input(fn, "input", input)
    shape = _normalized_shape(fn, x, normalized_shape)
    _check_params(fn, x, shape, weight, None)
    eps = reference.rms_norm_eps(x.dtype) if eps is None else _check_eps(fn, eps)
    return _run(x, shape, weight, None, None, eps, 0.0, True, False)


def dropout_add_layer_norm(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float = 1e-5,
    dropout_p: float = 0.0,
    prenorm: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """``LayerNorm(residual + dropout(x))`` over the last dim, in one pass.

    Args:
        x: ``(*, N)``, float32/float16/bfloat16 (float64 too).
        residual: same shape and dtype as ``x``, or None (then ``LayerNorm(dropout(x))``).
        weight, bias: ``(N,)``, the dtype of ``x`` or float32, or None.
        eps: > 0.
        dropout_p: in [0, 0.99991]; the mask is drawn per call from the torch generator of ``x``'s
            device and regenerated in the backward (see the module doc and
            ``dropout_add_layer_norm_keep_mask``). Pass 0 in eval mode.
        prenorm: also return ``pre = residual + dropout(x)``.

    Returns:
        ``out`` (shape and dtype of ``x``), or ``(out, pre)`` when ``prenorm``.
    """
    if _EAGER_FUSED is not None and not _is_compiling():
        out = _EAGER_FUSED(x, residual, weight, bias, eps, dropout_p, prenorm, _eager_seed)
        if out is not None:
            return out
    fn = "dropout_add_layer_norm"
    x = _check_input(fn, "x", x)
    if x.dim() == 0:
        raise ValueError(f"{fn}: x must have at least one dim, got a 0-dim tensor")
    shape = (x.shape[-1],)
    _check_residual(fn, residual, x)
    _check_params(fn, x, shape, weight, bias, x_name="x")
    eps = _check_eps(fn, eps)
    dropout_p = rng.check_dropout_p(fn, dropout_p)
    if not isinstance(prenorm, bool):
        raise TypeError(f"{fn}: prenorm must be a bool, got {type_name(prenorm)}")
    return _run(x, shape, weight, bias, residual, eps, dropout_p, False, prenorm)
