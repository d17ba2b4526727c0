"""The shared dropout RNG: counter-based Philox4x32-10, identical on every device.

`philox4x32(seed, offsets)` is Triton's `tl.randint4x` and `philox_uniform(seed, offsets)` its
`tl.rand` (int64 offsets), written in plain PyTorch, bit for bit; `csrc/common/philox.h` is the
same for C++ and CUDA. The C++/CUDA ops keep element i when `element_uniform(seed, i) >= p`
(word i % 4 of the call for counter i // 4); attention has its own layout of the same words
(fastformer.ops.attention). Any op's keep-mask can therefore be regenerated here from its seed,
which is how tests feed the exact mask to the eager reference.
"""

from __future__ import annotations

import functools
import numbers

import torch

from fastformer.ops._autograd import type_name

_MASK32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_ROUNDS = 10
# Triton's uint_to_uniform_float scale: the largest float with (2**31 - 1) * scale < 1.0f.
_SCALE = 4.6566127342e-10
SEED_BITS = 63
# The seed tensor of eager calls without dropout, shared (never written): saves the host time of
# a new CPU tensor per call.
NO_SEED = torch.zeros((), dtype=torch.int64, device="cpu")
# The CPU device as an object: named by a string, each factory call parses it (~0.2 us a
# call on the CI VM, on the eager ops' seed path).
_CPU = torch.device("cpu")
_LOW62 = (1 << 62) - 1


# How far the kept fraction of the elementwise ops' dropout may be from 1 - p: their float32
# uniforms step by 2**-24 just below 1, and p is compared in float32 (half a step more).
ELEMENT_KEEP_ERROR = 1.5 * 2.0**-24
# Attention's: its 16-bit keep threshold round(p * 65536) is off by up to half a step.
ATTENTION_KEEP_ERROR = 2.0**-17


def max_dropout_p(keep_error: float = ELEMENT_KEEP_ERROR) -> float:
    """The largest dropout_p `check_dropout_p` takes for random numbers of that resolution:
    closer to 1 the kept fraction may be off from 1 - p by more than 0.1%."""
    return 1.0 - 1000 * keep_error


def check_dropout_p(fn: str, dropout_p: object, keep_error: float = ELEMENT_KEEP_ERROR) -> float:
    """`dropout_p` as a float in [0, 1) (any real number type: a numpy scalar too); TypeError or
    ValueError naming `fn` otherwise.

    Also refused: p so close to 1 that the kept fraction, off from 1 - p by up to
    `keep_error` (the random numbers' resolution), is off by more than 0.1%: the 1 / (1 - p)
    scale would leave that as a bias of the output (at p = 1 - 3e-8 nothing was kept at all).
    """
    # The usual case, fast: 0.99 is below every op's limit (max_dropout_p).
    if type(dropout_p) is float and 0.0 <= dropout_p <= 0.99:
        return dropout_p
    if not isinstance(dropout_p, numbers.Real) or isinstance(dropout_p, bool):
        raise TypeError(f"{fn}: dropout_p must be a float, got {type_name(dropout_p)}")
    # Checked again once converted: just below 1 in a wider type (numpy.longdouble) is 1.0.
    if not 0.0 <= dropout_p < 1.0 or not float(dropout_p) < 1.0:
        raise ValueError(f"{fn}: dropout_p must be in [0, 1), got {dropout_p}")
    limit = max_dropout_p(keep_error)
    if float(dropout_p) > limit:
        raise ValueError(
            f"{fn}: dropout_p must be at most {limit:.6g}: closer to 1 the fraction its random "
            f"numbers keep is off from 1 - p by more than 0.1%, a bias the 1 / (1 - p) scale "
            f"would not undo; got {dropout_p}"
        )
    return float(dropout_p)


def _mulhilo(const: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # The int64 product wraps, but bits 0..63 are exact, which is all we read.
    prod = x * const
    return (prod >> 32) & _MASK32, prod & _MASK32


def _check_seed(seed: int, fn: str = "") -> None:
    where = f"{fn}: " if fn else ""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"{where}seed must be an int, got {type_name(seed)}")
    if not 0 <= seed < 2**64:
        raise ValueError(f"{where}seed must be in [0, 2**64), got {seed}")


def check_keep_mask_args(
    fn: str,
    seed: object,
    sizes: dict[str, object],
    dropout_p: object,
    keep_error: float = ELEMENT_KEEP_ERROR,
) -> float:
    """The checks of a keep-mask builder (`fn`), before it allocates anything: `seed` an int in
    [0, 2**64), each of `sizes` (name: value) an int >= 0, `dropout_p` as `check_dropout_p`
    takes it, returned as a float. TypeError / ValueError naming `fn` and the argument."""
    _check_seed(seed, fn)
    for name, n in sizes.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"{fn}: {name} must be an int >= 0, got {n!r}")
    return check_dropout_p(fn, dropout_p, keep_error)


def philox4x32(seed: int, offsets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The four output words of Philox4x32-10 as Triton's `tl.randint4x(seed, offsets)` gives.

    Args:
        seed: integer in [0, 2**64); its low and high 32 bits are the two Philox key words.
        offsets: int64 tensor of any shape, read as unsigned 64-bit counters (-1 is 2**64 - 1);
            low and high 32 bits are the first two counter words, the other two are 0.

    Returns:
        four int64 tensors of the shape of `offsets` holding uint32 values.
    """
    _check_seed(seed)
    if offsets.dtype != torch.int64:
        raise TypeError(f"offsets must be an int64 tensor, got {offsets.dtype}")
    c0 = offsets & _MASK32
    c1 = (offsets >> 32) & _MASK32
    c2 = torch.zeros_like(offsets)
    c3 = torch.zeros_like(offsets)
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(_ROUNDS):
        hi_b, lo_b = _mulhilo(_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _MASK32, (k1 + _KEY_B) & _MASK32
    return c0, c1, c2, c3


def philox_uniform(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """Uniform floats in [0, 1) equal bit for bit to Triton's `tl.rand(seed, offsets)`.

    Args:
        seed: integer in [0, 2**64); its low and high 32 bits are the two Philox key words.
        offsets: int64 tensor of any shape, read as unsigned 64-bit counters (-1 is 2**64 - 1);
            low and high 32 bits are the first two counter words.

    Returns:
        float32 tensor of the shape and device of `offsets`.
    """
    return _uint_to_uniform(philox4x32(seed, offsets)[0])


def element_uniform(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """The uniform of element i in the scheme of the C++/CUDA ops (layer_norm, ffn dropout).

    Element i takes word `i % 4` of `philox4x32(seed, i // 4)`: one Philox call serves four
    consecutive elements (a full call per element would make dropout compute-bound on a GPU).
    Same arguments and result as `philox_uniform`; `csrc/common/philox.h` has the C++ twin.
    """
    # i // 4 of i as an unsigned 64-bit counter, as the C++ ops read it (>> of a negative int64
    # would carry its sign into the top bits)
    words = torch.stack(philox4x32(seed, (offsets >> 2) & _LOW62), dim=-1)
    lane = (offsets & 3).unsqueeze(-1)
    return _uint_to_uniform(torch.gather(words, -1, lane).squeeze(-1))


def _uint_to_uniform(word: torch.Tensor) -> torch.Tensor:
    signed = torch.where(word >= 2**31, word - 2**32, word)
    folded = torch.where(signed < 0, ~signed, signed)
    return folded.to(torch.float32) * torch.tensor(_SCALE, dtype=torch.float32, device=_CPU)


def dropout_keep(seed: int, offsets: torch.Tensor, p: float) -> torch.Tensor:
    """Bool keep-mask of dropout with drop probability `p`: True where `element_uniform >= p`.

    Runs the compiled kernel when fastformer._C has one for the device (the same bits, tested
    in tests/test_rng.py, ~40x faster than the int64 PyTorch arithmetic), else `element_uniform`.

    Args:
        seed: integer in [0, 2**64) (the compiled kernel serves those below 2**63).
        offsets: int64 tensor of any shape: the element indices i, read as unsigned 64-bit
            counters as `element_uniform` reads them.
        p: the drop probability, compared with the float32 uniforms in float32.

    Returns:
        bool tensor of the shape and device of `offsets` (True = keep).
    """
    uniform = element_uniform_cpp if _compiled_for(offsets.device, seed) else element_uniform
    return uniform(seed, offsets) >= torch.tensor(p, dtype=torch.float32, device=_CPU)


def _compiled_for(device: torch.device, seed: int) -> bool:
    from fastformer._ext import cuda_kernels_compiled, extension_error

    _check_seed(seed)  # before the kernels' schema, which took a bool and refused a float opaquely
    if extension_error() is not None or not 0 <= seed < 2**63:
        return False
    return device.type == "cpu" or (device.type == "cuda" and cuda_kernels_compiled())


def compiled_cpu_kernels(device: torch.device, seed: int) -> bool:
    """Whether fastformer._C's CPU kernels serve `seed` on `device`: a CPU device, the extension
    loaded, and a seed below 2**63 (they take it as an int64)."""
    return device.type == "cpu" and _compiled_for(device, seed)


def _mix64(x: int) -> int:
    # splitmix64 finaliser: turns (generator seed, offset) into a well-spread key.
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def capturing(device: torch.device) -> bool:
    """Whether `device`'s current stream is capturing a CUDA graph. (torch asks the current
    device's: an op on another GPU than the one capturing must ask its own.)"""
    if device.type != "cuda":
        return False
    if device.index is None or device.index == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def draw_call_seed(device: torch.device) -> int | torch.Tensor:
    """The seed of one dropout call: `draw_seed(device)`, or inside CUDA graph capture a 0-dim
    int64 tensor drawn on the device, which the kernels read from memory. torch's CUDA RNG is
    capture-safe: each replay of the graph draws a new seed (its Philox offset advances)."""
    if capturing(device):
        return torch.randint(0, 2**SEED_BITS - 1, (), dtype=torch.int64, device=device)
    return _host_seed(device)


def call_seed(device: torch.device, dropout_p: float) -> int | torch.Tensor:
    """The seed an op call with dropout probability `dropout_p` runs with: `draw_call_seed`
    when it drops anything, else 0 (nothing drawn: the generator does not advance)."""
    return draw_call_seed(device) if dropout_p > 0 else 0


def draw_seed(device: torch.device | str | None = None) -> int:
    """A fresh dropout seed in [0, 2**63) from the torch generator of `device`.

    `torch.manual_seed` therefore reproduces a run, and consecutive calls differ. On CUDA the
    draw advances the generator's Philox offset instead of sampling on the device, so it never
    synchronises the host with the GPU; inside CUDA graph capture it raises RuntimeError (ops
    that support capture draw with `draw_call_seed`).
    """
    device = torch.device("cpu" if device is None else device)
    if capturing(device):
        # A host seed is a launch argument: a captured graph would replay one mask forever.
        raise RuntimeError(
            "this fastformer op cannot run dropout inside CUDA graph capture "
            "(torch.cuda.graph): its seed is drawn on the host when the op runs, so every "
            "replay would drop the same elements. Capture with dropout 0 (eval mode), or "
            "train without CUDA graphs."
        )
    return _host_seed(device)


def _refuse_batched_draw(draw: torch.Tensor) -> None:
    """A draw vmap batched (randomness="different"): one seed a call cannot give it a mask a
    sample. (randomness="error" has raised in the draw itself.) Unwrapped level by level: under
    vmap(grad(f)) the draw is a grad wrapper around the batched tensor."""
    ft = torch._C._functorch
    while ft.is_functorch_wrapped_tensor(draw) and not ft.is_batchedtensor(draw):
        draw = ft.get_unwrapped(draw)
    if ft.is_batchedtensor(draw):
        raise RuntimeError(
            "fastformer's dropout under torch.vmap(randomness='different') is not supported: "
            "its mask comes from one seed a call; use randomness='same' (one mask for every "
            "sample) or dropout 0"
        )


def _host_seed(device: torch.device) -> int:
    if torch.jit.is_tracing():
        # The seed is a Python int: the trace would record it as a constant.
        raise RuntimeError(
            "fastformer's dropout cannot be recorded by torch.jit.trace: the trace would keep "
            "this call's seed as a constant and drop the same elements on every call. Trace in "
            "eval mode (dropout 0), or use torch.export or torch.compile, which draw a new seed "
            "each call"
        )
    if device.type == "cuda":
        if torch._C._functorch.peek_interpreter_stack() is not None:
            # Under a torch.func transform: a draw vmap sees, for its `randomness` (the seed
            # below only moves the generator's offset, which vmap cannot see).
            _refuse_batched_draw(torch.randint(0, 2, (), device=device))
        index = device.index if device.index is not None else torch.cuda.current_device()
        base, offset = _cuda_philox_advance(index)
        return _mix64(_mix64(base) ^ offset) >> (64 - SEED_BITS)
    draw = torch.randint(-(2**63), 2**63 - 1, (), generator=torch.default_generator, device=_CPU)
    _refuse_batched_draw(draw)
    return draw.item() & (2**SEED_BITS - 1)


def _cuda_philox_advance(index: int) -> tuple[int, int]:
    """(seed, offset) of torch's CUDA generator of device `index`, its offset moved on by 4 in
    the same step: fastformer._C's, under the generator's mutex (get_offset and set_offset from
    Python are two steps, and a draw of another thread falling between them was lost: both
    then used the same offsets); those two steps without CUDA kernels in the extension."""
    advance = _compiled_philox_advance()
    if advance is not None:
        return advance(index, 4)
    gen = torch.cuda.default_generators[index]
    base, offset = gen.initial_seed(), gen.get_offset()
    gen.set_offset(offset + 4)
    return base, offset


@functools.cache
def _compiled_philox_advance():
    # fastformer._C's cuda_philox_advance, None without its CUDA kernels (or in an older build)
    from fastformer._ext import cuda_kernels_compiled, load_extension

    return (
        getattr(load_extension(), "cuda_philox_advance", None) if cuda_kernels_compiled() else None
    )


def seed_output(seed: int | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A custom op's seed output: a fresh 0-dim int64 tensor holding `seed` on the op's
    `device` (its fake's), or a seed drawn on the device (`draw_call_seed`) as it is.

    On the device, not the CPU: inductor's CUDA graphs (`mode="reduce-overhead"`) take no CPU
    tensor; they skipped a graph holding one, or cut it off in a partition that returned the
    ops' tuples (torch 2.11 and 2.14, read from inductor's source). Costs a fill kernel a call
    on a GPU, with no host synchronisation. (`torch.full`: exact for every int64, ~1 us on the
    CPU against ~2.6 for `torch.tensor`.)"""
    if isinstance(seed, torch.Tensor):
        return seed
    return torch.full((), seed, dtype=torch.int64, device=device)


def seed_tensor(seed: int | torch.Tensor) -> torch.Tensor:
    """`seed` as the int64 scalar tensor the eager ops save for their backward: the shared
    NO_SEED for 0, a device seed as it is, else a new CPU scalar."""
    if isinstance(seed, int) and seed == 0:
        return NO_SEED
    return seed_output(seed, _CPU)


def saved_seed(seed: int | torch.Tensor) -> int | torch.Tensor:
    """What a backward passes its kernels for a saved seed: the int of a CPU seed, the tensor
    itself of a device one (read from memory: no host synchronisation, capture-safe)."""
    if isinstance(seed, torch.Tensor) and (seed.dtype != torch.int64 or seed.dim() != 0):
        raise TypeError(f"seed must be a 0-dim int64 tensor, got {seed.dtype} {tuple(seed.shape)}")
    if isinstance(seed, torch.Tensor) and seed.device.type == "cpu":
        return int(seed)
    return seed


def host_seed(seed: int | torch.Tensor, op: str) -> int:
    """The int of a saved seed, for a backend that builds its mask on the host: a seed on the
    device (a compiled call's output) is read, a host synchronisation; refused inside CUDA
    graph capture, where it cannot be read."""
    seed = saved_seed(seed)
    if isinstance(seed, int):
        return seed
    if capturing(seed.device):  # (a device seed cannot be read there)
        check_host_seed(seed, op)
    return int(seed)


def host_call_seed(device: torch.device, dropout_p: float, op: str) -> int:
    """`call_seed` for a mask built on the host (torch ops): refused inside CUDA graph capture
    (`check_host_seed`)."""
    seed = call_seed(device, dropout_p)
    check_host_seed(seed, op)
    return seed


def check_host_seed(seed: int | torch.Tensor, op: str) -> None:
    """Refuse a device seed (drawn inside CUDA graph capture) where `op`'s torch backend needs
    the seed on the host to build its mask."""
    if isinstance(seed, torch.Tensor):  # only draw_call_seed under capture gives a tensor
        raise RuntimeError(
            f"{op} with dropout inside CUDA graph capture runs only on its compiled kernels "
            "(the torch backend builds its mask on the host); these inputs run on the torch "
            "backend"
        )


def _compiled_op(name: str, seed: int, offsets: torch.Tensor) -> torch.Tensor:
    from fastformer._ext import require_extension

    require_extension()
    _check_seed(seed)
    if seed >= 2**63:
        raise ValueError(f"the compiled op takes seeds in [0, 2**63), got {seed}")
    return getattr(torch.ops.fastformer, name)(seed, offsets)


def philox_uniform_cpp(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """`philox_uniform` through the compiled kernel torch.ops.fastformer.philox_uniform."""
    return _compiled_op("philox_uniform", seed, offsets)


def element_uniform_cpp(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """`element_uniform` through the compiled kernel torch.ops.fastformer.element_uniform."""
    return _compiled_op("element_uniform", seed, offsets)


def _register_fake() -> None:
    """Shape function of the compiled op, so traced code (torch.compile) can call it."""
    from fastformer._ext import load_extension

    if load_extension() is None:
        return

    def fake(seed: int, offsets: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(offsets, dtype=torch.float32)

    def fake_keep(seed: int, row_offsets: torch.Tensor, seq_k: int, threshold: int):
        return row_offsets.new_empty((*row_offsets.shape, seq_k), dtype=torch.bool)

    torch.library.register_fake("fastformer::philox_uniform", fake)
    torch.library.register_fake("fastformer::element_uniform", fake)
    torch.library.register_fake("fastformer::attention_keep_mask", fake_keep)


_register_fake()
