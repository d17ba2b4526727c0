"""The CUDA kernels of csrc/ (LayerNorm, FFN elementwise stages, RNG) run on the CPU by the
emulator of tests/cuda_emu, against the eager reference with the parity rule.

The emulator compiles the real .cu sources for the host and runs every block as cooperative
fibers, one per CUDA thread (tests/cuda_emu/emu.h). So on a machine without a GPU these tests
execute the kernels' indexing, vector paths, shuffles, shared-memory reductions, persistent
grids and dropout masks. Kernels with shared memory run in forward and reverse order (of the
warps, lanes and blocks) and must give the same bits in both: a missing barrier shows up as a
difference, a parity failure or NaN (the value shared memory starts with). What the emulator cannot see: timing races it does not
schedule, register and occupancy limits, the GPU's approximate math (rsqrtf is exact here).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import cuda_emu as ce
import pytest
import torch
import torch.nn.functional as F

from fastformer import reference as ref
from fastformer.ops import rng
from fastformer.testing import ATOL_FLOOR, assert_parity, compare_with_reference, parity

REASON = ce.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"CUDA emulator: {REASON}")

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
ORDERS = ("forward", "reverse")
SEED = 2**40 + 12345  # dropout seed: both Philox key words non-zero


@pytest.fixture(scope="module", autouse=True)
def emulator():
    """Builds (first run) or loads the emulated kernels once for the module."""
    return ce.load()


def _make(shape, dtype=F32, seed=0, scale=1.0, shift=0.0, grad=True):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=torch.float32) * scale + shift
    return t.to(dtype).requires_grad_(grad)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    bytes_a = a.detach().contiguous().view(-1).view(torch.uint8)
    return torch.equal(bytes_a, b.detach().contiguous().view(-1).view(torch.uint8))


def _keep(seed: int, shape: tuple[int, ...], p: float) -> torch.Tensor:
    """The keep-mask of element i = row-major index: element_uniform(seed, i) >= p."""
    offsets = torch.arange(math.prod(shape), dtype=torch.int64).view(shape)
    return rng.element_uniform(seed, offsets) >= torch.tensor(p, dtype=torch.float32)


def _parity_in_orders(fast, reference, inputs, names, floor, orders=ORDERS, **device):
    """compare_with_reference once per fiber order, on one emulated device; the emulated
    outputs and gradients must also be bit-identical across the orders. Returns the launches
    of the last order."""
    snapshots = []
    for order in orders:
        record: list[torch.Tensor] = []
        ce.clear_launches()
        with ce.device(order=order, **device):
            results = compare_with_reference(
                lambda *a, rec=record: fast(*a, record=rec),
                reference,
                inputs,
                names=names,
                atol_floor=floor,
            )
        assert_parity(results)
        snapshots.append(record)
    for order, record in zip(orders[1:], snapshots[1:]):
        assert len(record) == len(snapshots[0])
        for i, (a, b) in enumerate(zip(snapshots[0], record)):
            assert _same_bits(a, b), f"result {i} differs between {orders[0]} and {order} order"
    return ce.launches()


def _path(launch: ce.Launch) -> tuple[str, int, tuple[int, int, int]]:
    kind = launch.kernel.split("_")[2]  # ln_bwd_<kind>_kernel
    return kind, int(launch.params.get("kVecs", 0)), launch.block


# --------------------------------------------------------------------------- the emulator


@pytest.mark.parametrize("mutation", sorted(ce.MUTATIONS))
def test_every_mutation_still_applies(mutation):
    # A mutation whose text the sources no longer hold cannot show that the tests catch it
    # (three had gone stale that way); each must occur exactly once.
    source, _, new = ce.MUTATIONS[mutation]
    assert new in ce.mutated_source(source, mutation)


def test_transform_rewrites_launches_and_shared_declarations():
    src = (
        "template <typename T, int N>\n"
        "__global__ void __launch_bounds__(256, 1) k(const T* x) {\n"
        "  __shared__ float2 red[32][kWarp + 1];\n"
        "  extern __shared__ float dyn[];\n"
        '  // k<<<1, 2>>>(x) in a comment, "__shared__" in a string\n'
        "}\n"
        "void go(cudaStream_t s) {\n"
        "  ns::k<float, 4><<<dim3(a, b), 64, smem, s>>>(\n      x);\n"
        "  kernel<<<grid < 4 ? grid : 4, threads>>>();\n"
        "}\n"
    )
    out = ce.transform(src, "k.cu")
    assert out.count("\n") == src.count("\n") + 2  # #include and #line only: lines are kept
    assert "::emu::launch(dim3(a, b), 64, smem, ns::k<float, 4>, \n      x)" in out
    assert "::emu::launch(grid < 4 ? grid : 4, threads, 0, kernel)" in out
    assert "auto& red = ::emu::block_shared<float2[32][kWarp + 1]>(&red_emu_key)" in out
    assert "float* dyn = ::emu::dynamic_shared<float>()" in out
    assert "kernel_entry(__PRETTY_FUNCTION__, static_cast<int>(256));" in out
    assert '"__shared__" in a string' in out and "k<<<1, 2>>>(x) in a comment" in out


def test_correct_block_reduction_in_every_order(emulator):
    x = torch.arange(256, dtype=F32)
    expected = torch.cat([x[:128].sum().expand(128), x[128:].sum().expand(128)])
    for order in ("forward", "reverse", "shuffled"):
        with ce.device(order=order, seed=3):
            out = emulator.ops.selftest("block_sum", x, 2, 128, 0)
        assert torch.equal(out[:256], expected), order


def test_missing_barrier_shows_in_the_result(emulator):
    # The same reduction without its __syncthreads: another warp's slot is read before it
    # is written, which gives NaN (the initial shared memory) in at least one order.
    x = torch.arange(256, dtype=F32)
    outs = []
    for order in ORDERS:
        with ce.device(order=order):
            outs.append(emulator.ops.selftest("block_sum_racy", x, 2, 128, 0)[:256])
    assert any(torch.isnan(o).any() for o in outs)
    # Slots reused by a second reduction without a barrier: a fast warp overwrites a slot
    # another warp has still to read (the result is 0 without the race).
    outs = []
    for order in ORDERS:
        with ce.device(order=order):
            outs.append(emulator.ops.selftest("two_sums_racy", x, 2, 128, 0)[:256])
    assert any((o != 0).any() for o in outs)
    with ce.device():
        assert torch.isnan(emulator.ops.selftest("uninitialized_shared", x, 1, 32, 0)[:32]).all()


def test_warp_intrinsics(emulator):
    with ce.device():
        out = emulator.ops.selftest("ballot_and_shuffles", torch.zeros(32), 1, 32, 0)
    out = out[: 32 * 6].view(32, 6)
    lane = torch.arange(32, dtype=F32)
    assert torch.equal(out[:, 0], torch.ones(32))  # ballot of odd lanes
    assert torch.equal(out[:, 1], torch.where(lane < 31, lane + 1, lane))  # shfl_down 1
    assert torch.equal(out[:, 2], torch.where(lane >= 2, lane - 2, lane))  # shfl_up 2
    assert torch.equal(out[:, 3], torch.full((32,), 3.0))
    assert torch.equal(out[:, 4:], torch.ones(32, 2))


@pytest.mark.parametrize(
    ("case", "threads", "smem", "message"),
    [
        ("deadlock", 32, 0, "deadlock|wait for it"),
        ("divergent_barriers", 32, 0, "divergent barriers"),
        ("shuffle_exited_lane", 32, 0, "exited"),
        ("shuffle_partial_warp", 32, 0, "do not exist"),
        ("too_many_threads", 32, 0, "more than 1024 threads"),
        ("launch_bounds", 32, 0, "__launch_bounds__ of 128"),
        ("dynamic_smem", 64, 48 * 1024 + 4, None),  # allowed after cudaFuncSetAttribute
        ("dynamic_smem", 64, 228 * 1024, "dynamic shared memory over"),
        ("dynamic_smem_overflow", 64, 0, "dynamic shared memory written past"),
        ("static_smem_overflow", 32, 0, "written past an array"),
        ("misaligned_vector", 32, 0, "misaligned access .* uint4"),
        ("index_out_of_bounds", 32, 0, "out of bounds of 'float \\[4\\]'"),
    ],
)
def test_misuse_is_an_error(emulator, case, threads, smem, message):
    x = torch.arange(256, dtype=F32)
    for order in ORDERS:
        with ce.device(order=order):
            if message is None:
                out = emulator.ops.selftest(case, x, 1, threads, smem)
                assert torch.equal(out[:threads], torch.arange(threads - 1, -1, -1, dtype=F32))
            else:
                with pytest.raises(RuntimeError, match=message):
                    emulator.ops.selftest(case, x, 1, threads, smem)


# --------------------------------------------------------------------------- rng


def test_rng_kernel_bit_identical_to_python(emulator):
    gen = torch.Generator().manual_seed(0)
    edges = torch.tensor([0, 1, 2, 3, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40 - 1])
    offsets = torch.cat([edges, torch.randint(0, 2**40, (3000,), generator=gen)])
    for seed in (0, 1, 2**31, 2**32 + 7, 2**62 + 12345, 2**63 - 1):
        ce.clear_launches()
        with ce.device():
            element = emulator.ops.uniform(seed, offsets, True)
            first = emulator.ops.uniform(seed, offsets, False)
        assert torch.equal(element, rng.element_uniform(seed, offsets)), seed
        assert torch.equal(first, rng.philox_uniform(seed, offsets)), seed
        grids = [launch.grid for launch in ce.launches()]
        assert grids == [(12, 1, 1)] * 2  # 3009 offsets, 256 threads a block


# --------------------------------------------------------------------------- layer_norm


def _ln_fast(x, w, b, *, record, **kw):
    return ce.layer_norm(x, w, b, **kw, record=record)


def _ln_ref(x, w, b, eps=1e-5):
    return ref.layer_norm(x, x.shape[-1], w, b, eps).to(x.dtype)


VEC, ANY, CHUNK = "vec", "any", "chunk"
# dtype, rows, cols; the forward kernel (kind, vectors a thread, block) and the backward's. Rows
# too long for the registers take the generic kernels on 16-byte chunks when cols is a multiple
# of the vector width (CHUNK), else the scalar ones (ANY).
LN_PATHS = [
    (F32, 1, 1, (ANY, 0, (32, 4, 1)), (ANY, 0, (32, 8, 1))),
    (F32, 3, 7, (ANY, 0, (32, 4, 1)), (ANY, 0, (32, 8, 1))),
    (F32, 300, 64, (VEC, 1, (32, 4, 1)), (VEC, 1, (32, 8, 1))),  # warp per row
    (F32, 37, 200, (VEC, 2, (32, 4, 1)), (VEC, 2, (32, 8, 1))),
    (F32, 5, 512, (VEC, 4, (32, 4, 1)), (VEC, 4, (32, 8, 1))),
    (F32, 9, 1024, (VEC, 4, (64, 2, 1)), (VEC, 4, (64, 4, 1))),  # block per row, 2-D blocks
    (F32, 3, 1028, (VEC, 4, (96, 1, 1)), (VEC, 4, (96, 2, 1))),  # three warps a row
    (F32, 2, 8192, (VEC, 4, (512, 1, 1)), (VEC, 4, (512, 1, 1))),
    (F32, 3, 1023, (ANY, 0, (256, 1, 1)), (ANY, 0, (256, 1, 1))),
    (F32, 2, 8196, (CHUNK, 0, (512, 1, 1)), (CHUNK, 0, (512, 1, 1))),  # 2049 chunks: a tail
    (F32, 2, 8194, (ANY, 0, (512, 1, 1)), (ANY, 0, (512, 1, 1))),  # not whole chunks
    (BF16, 300, 256, (VEC, 1, (32, 4, 1)), (VEC, 1, (32, 8, 1))),
    (BF16, 1, 512, (VEC, 2, (32, 4, 1)), (VEC, 2, (32, 8, 1))),  # one row, seven idle
    (BF16, 9, 1024, (VEC, 4, (32, 4, 1)), (VEC, 2, (64, 4, 1))),
    (F16, 3, 8192, (VEC, 4, (256, 1, 1)), (VEC, 2, (512, 1, 1))),
    (BF16, 2, 16384, (VEC, 4, (512, 1, 1)), (VEC, 4, (512, 1, 1))),  # 4 vectors, no prefetch
    (BF16, 3, 8200, (VEC, 4, (288, 1, 1)), (VEC, 4, (288, 1, 1))),  # 1025 chunks: a tail
    (F16, 2, 16384, (VEC, 4, (512, 1, 1)), (VEC, 4, (512, 1, 1))),
    (BF16, 2, 16392, (CHUNK, 0, (512, 1, 1)), (CHUNK, 0, (512, 1, 1))),  # over 4 x 512 vectors
    (F16, 2, 8201, (ANY, 0, (512, 1, 1)), (ANY, 0, (512, 1, 1))),  # odd cols
    (F16, 5, 1023, (ANY, 0, (256, 1, 1)), (ANY, 0, (256, 1, 1))),
]


@pytest.mark.parametrize(
    ("dtype", "rows", "cols", "fwd", "bwd"),
    LN_PATHS,
    ids=[f"{str(c[0])[6:]}-{c[1]}x{c[2]}-{c[3][0]}{c[3][1]}" for c in LN_PATHS],
)
def test_layer_norm_kernel_paths(dtype, rows, cols, fwd, bwd):
    x = _make((rows, cols), dtype, scale=2.0, shift=1.0)  # an offset mean tests the centring
    w, b = _make((cols,), seed=1), _make((cols,), seed=2)  # fp32 parameters
    launches = _parity_in_orders(
        _ln_fast, _ln_ref, [x, w, b], ["x", "weight", "bias"], ATOL_FLOOR[dtype]
    )
    assert [launch.kernel for launch in launches] == [
        f"ln_fwd_{fwd[0]}_kernel",
        f"ln_bwd_{bwd[0]}_kernel",
        "ln_bwd_finalize_kernel",
    ]
    assert _path(launches[0]) == fwd and _path(launches[1]) == bwd
    vecs, (tpr, rpb, _) = bwd[1], bwd[2]
    if vecs:  # a thread's dweight and dbias sums, a float each of its columns
        smem = 2 * tpr * rpb * vecs * (16 // x.element_size()) * 4
    else:  # a dweight and a dbias slice of cols floats a row group
        smem = 2 * rpb * cols * 4
        assert launches[1].params["kSmemAcc"] == "true"
    assert launches[1].smem == smem
    assert launches[2].grid == (math.ceil(cols / 32), 2, 1)


# Launch overrides (torch.ops.fastformer.layer_norm_tuning, for measuring alternatives on a GPU):
# [fwd_vecs, fwd_block, bwd_vecs, bwd_block, stage] -> the forward's and backward's (kind,
# vectors a thread, block). A 16-bit backward holds at most 2 vectors with the next row; rows
# too long for the vectors asked for take the built-in long-row choice.
LN_TUNED = [
    (BF16, 9, 1024, [2, 256, 1, 512, 0], (VEC, 2, (64, 4, 1)), (VEC, 1, (128, 4, 1))),
    (BF16, 5, 2048, [1, 512, 1, 128, 0], (VEC, 1, (256, 2, 1)), (VEC, 1, (256, 1, 1))),
    (F32, 7, 512, [1, 64, 4, 64, 1], (VEC, 1, (128, 1, 1)), (VEC, 4, (32, 2, 1))),
    (F16, 3, 8192, [4, 512, 4, 0, 3], (VEC, 4, (256, 2, 1)), (VEC, 2, (512, 1, 1))),
    (BF16, 2, 16384, [1, 0, 1, 0, 2], (CHUNK, 0, (512, 1, 1)), (VEC, 4, (512, 1, 1))),
    # stage 4: the forward reads its rows in a loop, with fewer threads a row when told
    (BF16, 2, 16384, [0, 128, 0, 0, 4], (CHUNK, 0, (128, 1, 1)), (VEC, 4, (512, 1, 1))),
    (F32, 7, 512, [0, 64, 0, 0, 4], (CHUNK, 0, (32, 2, 1)), (VEC, 4, (32, 8, 1))),
]
NO_TUNING = [0, 0, 0, 0, 0]


@pytest.mark.parametrize(
    ("dtype", "rows", "cols", "tuning", "fwd", "bwd"),
    LN_TUNED,
    ids=[f"{str(c[0])[6:]}-{c[1]}x{c[2]}-{'.'.join(map(str, c[3]))}" for c in LN_TUNED],
)
def test_layer_norm_launch_overrides(dtype, rows, cols, tuning, fwd, bwd):
    x = _make((rows, cols), dtype, scale=2.0, shift=1.0)
    w, b = _make((cols,), seed=1), _make((cols,), seed=2)
    built_in = torch.ops.fastformer_emu.layer_norm_tuning(tuning)
    try:
        launches = _parity_in_orders(
            _ln_fast, _ln_ref, [x, w, b], ["x", "weight", "bias"], ATOL_FLOOR[dtype]
        )
    finally:
        assert torch.ops.fastformer_emu.layer_norm_tuning(built_in) == tuning
    assert built_in == NO_TUNING
    assert _path(launches[0]) == fwd and _path(launches[1]) == bwd
    # Rows staged ahead: the vector kernels only (the forward one at most), with stage 2 or 3.
    ahead = tuning[4] - 1 if tuning[4] in (2, 3) else 0
    assert launches[0].params.get("kStages", "0") == str(min(ahead, 1) if fwd[0] == VEC else 0)
    assert launches[1].params.get("kStages", "0") == str(ahead if bwd[0] == VEC else 0)


def test_layer_norm_launch_overrides_are_checked():
    bad_ones = ([3, 0, 0, 0, 0], [0, 100, 0, 0, 0], [0, 0, 0, 1024, 0], [0, 0, 0, 0, 5])
    for bad in (*bad_ones, [1, 2, 3], [0, 0, 0, 0]):
        with pytest.raises(RuntimeError, match="layer_norm.tuning"):
            torch.ops.fastformer_emu.layer_norm_tuning(bad)
    assert torch.ops.fastformer_emu.layer_norm_tuning(NO_TUNING) == NO_TUNING


@contextmanager
def _tuned(config: list[int]):
    """layer_norm_tuning(config) for the enclosed ops, then the built-in choice again."""
    assert torch.ops.fastformer_emu.layer_norm_tuning(config) == NO_TUNING
    try:
        yield
    finally:
        torch.ops.fastformer_emu.layer_norm_tuning(NO_TUNING)


REGISTERS, STAGED, DEEP = [0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [0, 0, 0, 0, 3]
# Staged rows (layer_norm_tuning's stage 2: each row copied to shared memory with cp.async while
# the row before it is worked on; 3: two rows ahead in the backward) on a persistent grid of
# `sms` one-block SMs, so that every block carries staged rows from one iteration to the next:
# dtype, rows, cols, mode, sms; rows past a block's last one and partial blocks of rows included.
# Every vector forward stages (one row ahead); every unfused vector backward (1 or 2 rows ahead).
STAGED_CASES = [
    (BF16, 37, 1024, "plain", 3),  # a warp a row, 4 rows a block: a partial last block
    (F32, 9, 200, "plain", 2),  # 50 chunks: lanes past the row in the second vector
    (F16, 5, 8192, "rms", 2),
    (BF16, 7, 2048, "fused", 2),  # dropout, residual, pre stored
    (BF16, 3, 16384, "fused", 1),  # 64 KB of slots (x and the residual): opted in
    (F32, 6, 4096, "dropout", 4),  # dropout without a residual: x's slots only
    (BF16, 1, 512, "plain", 7),  # more SMs than rows
    (BF16, 5, 16384, "plain", 2),  # the backward: 128 KB of sums + 64 KB of slots a row ahead
    (F16, 4, 8200, "rms", 3),  # 1025 chunks, 288 threads
    (F32, 35, 64, "plain", 1),  # one block: 5 backward rounds of 8 rows, the last partial
]


def _run_bits(fast, inputs) -> list[torch.Tensor]:
    """The outputs of fast(*inputs) and the gradients of the inputs it uses, for a fixed
    output gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fast(*leaves, record=[])
    outs = out if isinstance(out, tuple) else (out,)
    grads = [_make(tuple(o.shape), o.dtype, seed=7 + i, grad=False) for i, o in enumerate(outs)]
    torch.autograd.backward(outs, grads)
    return [*outs, *(t.grad for t in leaves if t.grad is not None)]


def _staged_op(mode: str, x: torch.Tensor):
    """(fast, reference, extra inputs, their names) of a LayerNorm `mode` of x."""
    cols = x.shape[-1]
    if mode == "plain":
        return _ln_fast, _ln_ref, [], []
    if mode == "rms":

        def fast_rms(x, w, b, *, record):
            return ce.layer_norm(x, w, None, rms=True, record=record)

        return fast_rms, lambda x, w, b: ref.rms_norm(x, cols, w, 1e-5).to(x.dtype), [], []
    p = 0.2 if mode == "fused" else 0.3
    keep = _keep(SEED, tuple(x.shape), p)

    def fast(x, w, b, *residual, record):
        r = residual[0] if residual else None
        return ce.layer_norm(x, w, b, r, dropout_p=p, prenorm=True, seed=SEED, record=record)

    def reference(x, w, b, *residual):
        r = residual[0] if residual else None
        out, pre = ref.dropout_add_layer_norm(x, r, w, b, 1e-5, p, True, keep_mask=keep)
        return out.to(x.dtype), pre

    if mode == "dropout":
        return fast, reference, [], []
    return fast, reference, [_make(tuple(x.shape), x.dtype, seed=9)], ["residual"]


def _bits_by_config(dtype, rows, cols, mode: str, sms: int, configs) -> tuple[dict, dict]:
    """{stage: `_run_bits`} and {stage: launches} of a `_staged_op` case under each tuning
    config, on a persistent grid of `sms` one-block SMs; every config but REGISTERS also meets
    the parity rule (the register kernels' parity: the tests above)."""
    x = _make((rows, cols), dtype, scale=1.5, shift=0.5)
    w, b = _make((cols,), seed=1), _make((cols,), seed=2)
    fast, reference, extra, extra_names = _staged_op(mode, x)
    inputs, names = [x, w, b, *extra], ["x", "weight", "bias", *extra_names]
    device = {"sms": sms, "blocks_per_sm": 1}
    results, launches = {}, {}
    for config in configs:
        with _tuned(config):
            if config is not REGISTERS:
                _parity_in_orders(fast, reference, inputs, names, ATOL_FLOOR[dtype], **device)
            ce.clear_launches()
            with ce.device(**device):
                results[config[4]] = _run_bits(fast, inputs)
        launches[config[4]] = ce.launches()
    return results, launches


@pytest.mark.parametrize(("dtype", "rows", "cols", "mode", "sms"), STAGED_CASES)
def test_staged_rows_equal_the_register_kernels(dtype, rows, cols, mode, sms):
    configs = (REGISTERS, STAGED, DEEP)
    results, launches = _bits_by_config(dtype, rows, cols, mode, sms, configs)
    unfused = mode in ("plain", "rms")
    for config in configs:
        fwd, bwd = launches[config[4]][:2]
        ahead = config[4] - 1  # rows staged ahead: 0, 1, 2
        assert (fwd.kernel, fwd.params["kStages"]) == ("ln_fwd_vec_kernel", str(min(ahead, 1)))
        bwd_ahead = ahead if unfused else 0
        if dtype != F32 and cols == 16384:  # 128 KB of sums: room for one staged row only
            bwd_ahead = min(bwd_ahead, 1)
        assert (bwd.kernel, bwd.params["kStages"]) == ("ln_bwd_vec_kernel", str(bwd_ahead))
        rpb = fwd.block[1]
        if ahead > 0:
            assert fwd.grid == (min(math.ceil(rows / rpb), sms), 1, 1)  # persistent: one wave
            slots = 2 if mode == "fused" else 1  # x's chunks, and the residual's
            assert fwd.smem == fwd.block[0] * rpb * int(fwd.params["kVecs"]) * slots * 16
        threads, vecs = bwd.block[0] * bwd.block[1], int(bwd.params["kVecs"])
        per_vec = 16 // dtype.itemsize
        sums = (1 if mode == "rms" else 2) * threads * vecs * per_vec * 4  # dweight (and dbias)
        assert bwd.smem == sums + bwd_ahead * threads * vecs * 2 * 16  # then x's and dy's slots
    for config in (STAGED, DEEP):
        for i, (registers, staged) in enumerate(zip(results[1], results[config[4]], strict=True)):
            assert _same_bits(registers, staged), f"stage {config[4]}, result {i}"


LOOP = [0, 0, 0, 0, 4]


@pytest.mark.parametrize(("dtype", "rows", "cols", "mode", "sms"), STAGED_CASES)
def test_rows_read_in_a_loop_equal_the_register_kernels(dtype, rows, cols, mode, sms):
    # layer_norm_tuning's stage 4: the forward reads each row in a loop (ln_fwd_chunk_kernel)
    # with the register kernel's block and grid, so its sums run in the same order: the same
    # bits, its outputs and, through the saved statistics, the backward's gradients.
    results, launches = _bits_by_config(dtype, rows, cols, mode, sms, (REGISTERS, LOOP))
    held, looped = launches[1][0], launches[4][0]
    assert (held.kernel, looped.kernel) == ("ln_fwd_vec_kernel", "ln_fwd_chunk_kernel")
    assert (looped.block, looped.grid) == (held.block, held.grid)
    assert launches[4][1].params["kStages"] == "0"  # the backward as built in
    for i, (registers, loop) in enumerate(zip(results[1], results[4], strict=True)):
        assert _same_bits(registers, loop), f"result {i}"


@pytest.mark.parametrize(("dtype", "rows", "cols", "residual"), [
    (BF16, 7, 2048, True), (F32, 6, 4096, False), (BF16, 3, 16384, True), (F16, 4, 8200, True),
])  # fmt: skip
def test_rows_read_in_a_loop_fuse_again_where_pre_is_not_stored(dtype, rows, cols, residual):
    # Inference without prenorm stores no pre: the loop's later passes fuse dropout and the
    # residual again from x (the same Philox offsets), and give the register kernel's bits.
    x = _make((rows, cols), dtype, scale=1.5, shift=0.5, grad=False)
    w, b = _make((cols,), seed=1, grad=False), _make((cols,), seed=2, grad=False)
    r = _make((rows, cols), dtype, seed=9, grad=False) if residual else None
    outs = {}
    for config in (REGISTERS, LOOP):
        with _tuned(config):
            ce.clear_launches()
            with ce.device(sms=2, blocks_per_sm=1):
                outs[config[4]] = ce.layer_norm(x, w, b, r, dropout_p=0.2, seed=SEED)
        kind = "vec" if config is REGISTERS else "chunk"
        assert ce.launches()[0].kernel == f"ln_fwd_{kind}_kernel"
    assert _same_bits(outs[1], outs[4])


def test_staged_forward_takes_the_register_kernel_where_its_slots_do_not_fit():
    # bf16 16384 columns, fused with a residual: 512 threads x 4 chunks x 2 slots = 64 KB, over
    # what a GPU with 48 KB to opt in to grants: the register forward runs, one block a row.
    x, r = _make((3, 16384), BF16), _make((3, 16384), BF16, seed=9)
    w, b = _make((16384,), seed=1), _make((16384,), seed=2)
    for optin_kb, staged, grid in ((48, "0", 3), (227, "1", 2)):
        ce.clear_launches()
        with ce.device(sms=2, blocks_per_sm=1, smem_optin_kb=optin_kb), _tuned(STAGED):
            out, _ = ce.layer_norm(x, w, b, r, dropout_p=0.1, prenorm=True, seed=SEED)
        fwd = ce.launches()[0]
        assert (fwd.params["kStages"], fwd.grid[0]) == (staged, grid)
        if optin_kb == 48:
            expected = out
        else:
            assert _same_bits(out, expected)


def test_staged_backward_takes_the_register_kernel_where_its_slots_do_not_fit():
    # bf16 16384 columns: 128 KB of dweight and dbias sums and 64 KB of slots, over the 163 KB
    # an A100 (sm_80) grants: the register backward runs there, with its sums only.
    x, w, b = _make((3, 16384), BF16), _make((16384,), seed=1), _make((16384,), seed=2)
    bits = {}
    for optin_kb, staged, smem in ((163, "0", 128 * 1024), (227, "1", 192 * 1024)):
        ce.clear_launches()
        with ce.device(sms=2, blocks_per_sm=1, smem_optin_kb=optin_kb), _tuned(STAGED):
            bits[staged] = _run_bits(_ln_fast, [x, w, b])
        bwd = ce.launches()[1]
        assert (bwd.kernel, bwd.params["kStages"], bwd.smem) == ("ln_bwd_vec_kernel", staged, smem)
    for registers, staged in zip(bits["0"], bits["1"], strict=True):
        assert _same_bits(registers, staged)


def _bwd_kernel(dtype: torch.dtype, cols: int) -> str:
    """The backward kernel of aligned inputs: registers up to 2048 whole 16-byte chunks (8192
    fp32, 16384 fp16/bf16 columns), then the generic kernel on chunks; the scalar generic
    kernel for other cols."""
    per_chunk = 16 // dtype.itemsize
    if cols % per_chunk != 0:
        return "ln_bwd_any_kernel"
    return "ln_bwd_vec_kernel" if cols <= 2048 * per_chunk else "ln_bwd_chunk_kernel"


@pytest.mark.parametrize(
    ("rows", "cols", "shift", "kernel"),
    [(256, 7, 1e4, ANY), (256, 64, 1e4, VEC), (128, 200, 1e5, VEC)],
    ids=["any", "vec1", "vec2-padded"],
)
def test_layer_norm_gradients_of_rows_whose_mean_dwarfs_their_spread(rows, cols, shift, kernel):
    # float32 rows at an offset: the saved mean's rounding shifts a row's every xhat alike, and
    # the backward kernels must take that out (see DxConsts). Each row is a LayerNorm of its own,
    # so the parity rule holds row by row for dx: before, 5-17% of the rows missed it. (Not the
    # chunk kernel: its rows, over 8192 columns, pass without the centring too, the shift's
    # effect shrinking with the row's length.)
    x = _make((rows, cols), shift=shift)
    w, b = _make((cols,), seed=1), _make((cols,), seed=2)
    dy = _make((rows, cols), seed=3, shift=1.0, grad=False)  # mean(dy * w) far from 0

    def dx_of(fn, *inputs):
        inputs = [t.detach().requires_grad_() for t in inputs]
        return torch.autograd.grad(fn(*inputs), inputs[0], dy.to(inputs[0].dtype))[0]

    ce.clear_launches()
    with ce.device():
        fast = dx_of(lambda x, w, b: ce.layer_norm(x, w, b), x, w, b)
    assert ce.launches()[1].kernel == f"ln_bwd_{kernel}_kernel"
    ref64 = dx_of(_ln_ref, x.double(), w.double(), b.double())
    ref_lp = dx_of(_ln_ref, x, w, b)
    rows_failed = [
        str(r)
        for i in range(rows)
        if not (r := parity(f"dx[{i}]", fast[i], ref64[i], ref_lp[i])).passed
    ]
    assert not rows_failed, f"{len(rows_failed)} rows: " + "; ".join(rows_failed[:3])


@pytest.mark.parametrize("affine", ["none", "weight", "bias", "both"])
@pytest.mark.parametrize(
    ("dtype", "rows", "cols"),
    [(F16, 4, 1024), (BF16, 3, 1023), (F32, 37, 256), (BF16, 2, 8200), (F32, 2, 8196)],
)
def test_layer_norm_weight_dtype_and_affine_variants(dtype, rows, cols, affine):
    # Parameters in the input dtype (W = T in the kernels), or absent.
    x = _make((rows, cols), dtype)
    w = _make((cols,), dtype, seed=1) if affine in ("weight", "both") else None
    b = _make((cols,), dtype, seed=2) if affine in ("bias", "both") else None
    names = [n for n, t in zip(["x", "weight", "bias"], [x, w, b]) if t is not None]
    launches = _parity_in_orders(_ln_fast, _ln_ref, [x, w, b], names, ATOL_FLOOR[dtype])
    assert launches[1].kernel == _bwd_kernel(dtype, cols)


@pytest.mark.parametrize("frozen", ["weight", "bias"])
@pytest.mark.parametrize(
    ("dtype", "cols"), [(F32, 64), (BF16, 1024), (F16, 1023), (F16, 16384), (F32, 8196)]
)
def test_layer_norm_one_parameter_gradient(dtype, cols, frozen):
    # need_dweight xor need_dbias: one half of the partials and of the finalize grid idle.
    x = _make((40 if cols <= 8192 else 3, cols), dtype)
    w = _make((cols,), seed=1, grad=frozen != "weight")
    b = _make((cols,), seed=2, grad=frozen != "bias")
    names = ["x", "bias"] if frozen == "weight" else ["x", "weight"]
    launches = _parity_in_orders(_ln_fast, _ln_ref, [x, w, b], names, ATOL_FLOOR[dtype])
    assert launches[1].kernel == _bwd_kernel(dtype, cols)


def _fused_ln_ref(x, r, w, b):
    """The reference of LayerNorm(x + r) with prenorm, out in x's dtype."""
    out, pre = ref.dropout_add_layer_norm(x, r, w, b, 1e-5, 0.0, True)
    return out.to(x.dtype), pre


@pytest.mark.parametrize(
    ("dtype", "cols"), [(F32, 1024), (BF16, 1024), (F16, 64), (BF16, 8200), (F32, 8196)]
)
@pytest.mark.parametrize("misaligned", ["x", "weight", "bias", "residual"])
def test_layer_norm_misaligned_pointer_takes_the_generic_kernels(dtype, cols, misaligned):
    # A view one element into its storage is not 16-byte aligned (a parameter sliced from one
    # flat buffer, say): the vector kernels would fault on the GPU (the emulator reports such
    # an access as an error).
    rows = 5
    shifted = _make((rows * cols + 1,), dtype, seed=3, grad=False)[1:]
    x = shifted.view(rows, cols) if misaligned == "x" else _make((rows, cols), dtype, grad=False)
    w = shifted[:cols] if misaligned == "weight" else _make((cols,), dtype, seed=1, grad=False)
    b = shifted[:cols] if misaligned == "bias" else _make((cols,), dtype, seed=2, grad=False)
    x, w, b = x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    if misaligned == "residual":  # the fused kernels; their backward reads pre, a new tensor
        r = shifted.view(rows, cols).requires_grad_()

        def fast(x, r, w, b, record):
            return ce.layer_norm(x, w, b, r, prenorm=True, record=record)

        reference, inputs = _fused_ln_ref, [x, r, w, b]
        names = ["x", "residual", "weight", "bias"]
    else:
        fast, reference, inputs, names = _ln_fast, _ln_ref, [x, w, b], ["x", "weight", "bias"]
    launches = _parity_in_orders(fast, reference, inputs, names, ATOL_FLOOR[dtype])
    # The backward of the fused kernels reads pre (aligned), not the residual; none reads the
    # bias.
    aligned_bwd = misaligned in ("residual", "bias")
    backward = _bwd_kernel(dtype, cols) if aligned_bwd else "ln_bwd_any_kernel"
    assert [launch.kernel for launch in launches[:2]] == ["ln_fwd_any_kernel", backward]


def _resident(threads: int, smem: int) -> int:
    """The emulator's blocks an SM (emu.cpp): 2048 threads and 228 KB of shared memory."""
    return min(2048 // threads, 228 * 1024 // (smem + 1024) if smem else 32, 32)


# dtype, rows, cols, rows a block, parameter gradients, accumulators in shared memory: while a
# block's slices (cols floats a row group for each wanted gradient, plus 384 bytes of row_sum
# slots) fit the 227 KB a block may opt in to; else in the partial rows in global memory. Cols
# of whole 16-byte chunks take ln_bwd_chunk_kernel, the others ln_bwd_any_kernel.
ANY_BWD_CASES = [
    (F32, 400, 99, 8, "both", True),  # 8 row groups a block, 2 or 3 rows each on 3 SMs
    (F32, 400, 99, 8, "weight", True),
    (F32, 400, 99, 8, "bias", True),
    (F32, 300, 130, 4, "both", True),  # two warps a row: row groups interleave at barriers
    (BF16, 300, 130, 4, "bias", True),
    (BF16, 7, 29008, 1, "both", True),  # exactly 227 KB
    (BF16, 7, 29009, 1, "both", False),  # 8 bytes over
    (BF16, 7, 29016, 1, "both", False),  # a chunk over
    (F32, 5, 30001, 1, "both", False),
    (F32, 5, 30000, 1, "both", False),
    (F32, 5, 30001, 1, "weight", True),  # one slice
    (F32, 5, 30000, 1, "weight", True),
    (F32, 2, 58052, 1, "bias", False),  # 144 bytes over: dbias only, in global memory
    (F16, 3, 58016, 1, "bias", True),  # exactly 227 KB
    (F16, 3, 58024, 1, "weight", False),
    (BF16, 3, 58049, 1, "weight", False),
    (F32, 5, 30001, 1, "none", True),  # no slices
    (F32, 5, 30000, 1, "none", True),
    (F16, 3, 16392, 1, "weight", True),  # past the vector kernel's 2048 chunks
    (BF16, 3, 16400, 1, "bias", True),
    (F32, 9, 8196, 1, "both", True),
]


@pytest.mark.parametrize(("dtype", "rows", "cols", "rpb", "grads", "smem_acc"), ANY_BWD_CASES)
def test_layer_norm_generic_backward_accumulators(dtype, rows, cols, rpb, grads, smem_acc):
    x = _make((rows, cols), dtype, scale=2.0, shift=1.0)
    w = _make((cols,), seed=1, grad=grads in ("both", "weight"))
    b = _make((cols,), seed=2, grad=grads in ("both", "bias"))
    names = {"both": ["x", "weight", "bias"], "none": ["x"]}.get(grads, ["x", grads])
    launches = _parity_in_orders(_ln_fast, _ln_ref, [x, w, b], names, ATOL_FLOOR[dtype], sms=3)
    bwd = launches[1]
    tpr = 512 if rpb == 1 else 256 // rpb
    assert bwd.kernel == _bwd_kernel(dtype, cols) and bwd.block == (tpr, rpb, 1)
    assert bwd.params["kSmemAcc"] == ("true" if smem_acc else "false")
    slices = {"both": 2, "none": 0}.get(grads, 1)
    smem = slices * rpb * cols * 4 if smem_acc else 0
    assert bwd.smem == smem
    # One wave: the occupancy query sees the shared memory the launch asks for.
    resident = _resident(tpr * rpb, smem)
    assert bwd.grid == (min(math.ceil(rows / rpb), 3 * resident), 1, 1)


RMS_CASES = [
    (F32, 3, 7, True),
    (F32, 300, 64, True),
    (F32, 4, 1024, False),
    (BF16, 5, 1024, True),
    (F16, 4, 4096, True),
    (BF16, 2, 16384, False),
    (F32, 2, 8196, True),
    (F16, 3, 8200, True),
    (F16, 3, 1023, True),
]


@pytest.mark.parametrize(("dtype", "rows", "cols", "weighted"), RMS_CASES)
def test_rms_norm_parity(dtype, rows, cols, weighted):
    x = _make((rows, cols), dtype, shift=0.5)
    eps = torch.finfo(dtype).eps
    inputs, names = [x], ["x"]
    if weighted:
        inputs, names = [x, _make((cols,), seed=3)], ["x", "weight"]

    def fast(x, w=None, *, record):
        return ce.layer_norm(x, w, None, rms=True, eps=eps, record=record)

    def reference(x, w=None):
        return ref.rms_norm(x, cols, w, eps).to(x.dtype)

    launches = _parity_in_orders(fast, reference, inputs, names, ATOL_FLOOR[dtype])
    assert all(launch.params.get("kRms") == "true" for launch in launches[:2])
    assert launches[1].kernel == _bwd_kernel(dtype, cols)


# dtype, rows, cols, dropout p, with a residual
FUSED_CASES = [
    (F32, 37, 129, 0.3, True),
    (BF16, 64, 256, 0.1, True),
    (BF16, 7, 1000, 0.1, True),  # a warp a row: a partial last block of rows and last chunk
    (F32, 4, 1024, 0.5, False),
    (F16, 3, 8192, 0.2, True),
    (BF16, 2, 16384, 0.25, True),
    (F16, 3, 8200, 0.1, True),
    (F32, 2, 8196, 0.3, False),
    (BF16, 2, 8201, 0.2, True),
    (F32, 5, 1023, 0.0, True),
]


@pytest.mark.parametrize(("dtype", "rows", "cols", "p", "with_residual"), FUSED_CASES)
def test_dropout_add_layer_norm_prenorm_parity(dtype, rows, cols, p, with_residual):
    x = _make((rows, cols), dtype, scale=1.5)
    r = _make((rows, cols), dtype, seed=9) if with_residual else None
    w, b = _make((cols,), seed=1), _make((cols,), seed=2)
    keep = _keep(SEED, (rows, cols), p) if p > 0 else None

    def fast(x, *rest, record):
        r, w, b = rest if with_residual else (None, *rest)
        return ce.layer_norm(x, w, b, r, dropout_p=p, prenorm=True, seed=SEED, record=record)

    def reference(x, *rest):
        r, w, b = rest if with_residual else (None, *rest)
        out, pre = ref.dropout_add_layer_norm(x, r, w, b, 1e-5, p, True, keep_mask=keep)
        return out.to(x.dtype), pre

    inputs = [x, r, w, b] if with_residual else [x, w, b]
    names = ["x", "residual", "weight", "bias"] if with_residual else ["x", "weight", "bias"]
    launches = _parity_in_orders(fast, reference, inputs, names, ATOL_FLOOR[dtype])
    assert launches[0].params["kFused"] == "true" and launches[1].params["kFused"] == "true"
    assert launches[1].kernel == _bwd_kernel(dtype, cols)


@pytest.mark.parametrize(("dtype", "cols"), [(F32, 129), (BF16, 1024), (F16, 8192), (F32, 16384)])
def test_layer_norm_dropout_mask_is_the_regenerated_one(dtype, cols):
    rows, p = 3, 0.4
    keep = _keep(SEED, (rows, cols), p)
    x = torch.ones(rows, cols, dtype=dtype, requires_grad=True)
    with ce.device():
        out, pre = ce.layer_norm(x, None, None, dropout_p=p, prenorm=True, seed=SEED)
        assert torch.equal(pre != 0, keep)
        assert torch.equal(pre[keep], torch.full_like(pre[keep], 1 / (1 - p)))
        out.backward(_make((rows, cols), dtype, seed=5, grad=False))
    assert torch.equal(x.grad != 0, keep)  # the backward regenerates the same mask


@pytest.mark.parametrize(("dtype", "cols"), [(F32, 129), (BF16, 1024)])
def test_layer_norm_dropout_keeps_a_dropped_nan_nan(dtype, cols):
    # torch's dropout multiplies by 0: a dropped NaN or inf stays NaN, and so does a NaN
    # gradient it drops (the kernels selected 0 there, hiding a NaN the model had made).
    rows, p = 3, 0.4
    (r0, c0), (r1, c1) = (~_keep(SEED, (rows, cols), p)).nonzero()[:2]
    x = _make((rows, cols), dtype, grad=False)
    x[r0, c0], x[r1, c1] = torch.nan, torch.inf
    with ce.device():
        out, pre = ce.layer_norm(x, None, None, dropout_p=p, prenorm=True, seed=SEED)
    assert pre[r0, c0].isnan() and pre[r1, c1].isnan()
    assert out[r0].isnan().all() and out[r1].isnan().all()
    x = _make((rows, cols), dtype)
    grad_pre = torch.zeros(rows, cols, dtype=dtype)
    grad_pre[r0, c0] = torch.nan
    with ce.device():
        out, pre = ce.layer_norm(x, None, None, dropout_p=p, prenorm=True, seed=SEED)
        (dx,) = torch.autograd.grad((out, pre), x, (torch.zeros_like(out), grad_pre))
    assert dx[r0, c0].isnan() and dx.isnan().sum() == 1


@pytest.mark.parametrize(("dtype", "cols"), [(F32, 1024), (BF16, 1023)])
def test_fused_forward_without_pre_recomputes_the_same_values(dtype, cols):
    # Without a stored pre the kernels recompute residual + dropout(x) in each pass.
    x, r = _make((7, cols), dtype, grad=False), _make((7, cols), dtype, seed=1, grad=False)
    w, b = _make((cols,), seed=2, grad=False), _make((cols,), seed=3, grad=False)
    with ce.device():
        out = ce.layer_norm(x, w, b, r, dropout_p=0.2, seed=SEED)
        out_pre, _ = ce.layer_norm(x, w, b, r, dropout_p=0.2, seed=SEED, prenorm=True)
    assert _same_bits(out, out_pre)


@pytest.mark.parametrize("sms", [1, 7])
@pytest.mark.parametrize(
    ("dtype", "rows", "cols", "rpb"),
    [(F32, 200, 64, 8), (F32, 50, 1024, 4), (BF16, 40, 1023, 1), (BF16, 30, 16384, 1)],
)
def test_backward_persistent_grid_and_finalize(sms, dtype, rows, cols, rpb):
    # One resident block an SM: `sms` blocks loop over all the rows and keep their partials.
    x = _make((rows, cols), dtype, shift=2.0)
    w, b = _make((cols,), seed=1), _make((cols,), seed=2)
    names = ["x", "weight", "bias"]
    device = {"sms": sms, "blocks_per_sm": 1}
    launches = _parity_in_orders(_ln_fast, _ln_ref, [x, w, b], names, ATOL_FLOOR[dtype], **device)
    grid = min(math.ceil(rows / rpb), sms)
    assert launches[1].grid == (grid, 1, 1)
    assert launches[2].kernel == "ln_bwd_finalize_kernel"


@pytest.mark.parametrize(
    ("optin_kb", "kernel", "smem"),
    [(227, "ln_bwd_vec_kernel", 2 * 512 * 16 * 4), (64, "ln_bwd_chunk_kernel", 0)],
)
def test_vector_backward_falls_back_when_its_shared_memory_does_not_fit(optin_kb, kernel, smem):
    # bf16 8192 columns: 512 threads a row, each with 16 dweight and 16 dbias sums in shared
    # memory (64 KB, plus the static row_sum slots). A GPU with 64 KB to opt in to (sm_75)
    # cannot launch that: the generic kernel on chunks runs instead, and as its two slices of
    # 8192 floats do not fit either, it adds into its partial rows in global memory.
    x = _make((3, 8192), BF16, shift=1.0)
    w, b = _make((8192,), seed=1), _make((8192,), seed=2)
    launches = _parity_in_orders(
        _ln_fast,
        _ln_ref,
        [x, w, b],
        ["x", "weight", "bias"],
        ATOL_FLOOR[BF16],
        smem_optin_kb=optin_kb,
    )
    assert launches[1].kernel == kernel
    assert launches[1].smem == smem


def test_shared_memory_grants_are_per_device():
    # CUDA keeps cudaFuncSetAttribute's limit per device, and the launchers cache their grants
    # per device; the emulator kept one limit a kernel, so a smaller grant on another emulated
    # device made a later launch on the first fail (found by a random sweep of the kernels).
    def backward_launch(cols: int, **device):
        x, w, b = _make((2, cols)), _make((cols,), seed=1), _make((cols,), seed=2)
        ce.clear_launches()
        with ce.device(**device):
            out = ce.layer_norm(x, w, b)
            out.backward(torch.ones_like(out))
        return ce.launches()[1]

    first = backward_launch(8193)  # two 8193-float slices: over the 48 KB default
    assert backward_launch(6201, blocks_per_sm=1).smem < first.smem
    again = backward_launch(8193)
    assert (again.kernel, again.smem) == (first.kernel, first.smem) and first.smem > 48 * 1024


def test_layer_norm_bit_identical_twice_in_any_order():
    x, r = _make((37, 1024)), _make((37, 1024), seed=2)
    w, b = _make((1024,), seed=3), _make((1024,), seed=4)
    dy = _make((37, 1024), seed=5, grad=False)

    def once(**device):
        xs = [t.detach().clone().requires_grad_() for t in (x, r, w, b)]
        with ce.device(**device):
            x_, r_, w_, b_ = xs
            out, pre = ce.layer_norm(x_, w_, b_, r_, dropout_p=0.1, prenorm=True, seed=SEED)
            torch.autograd.backward([out, pre], [dy, dy * 0.5])
        return [out, pre, *(t.grad for t in xs)]

    first = once()
    for device in ({}, {"order": "shuffled", "seed": 1}, {"order": "shuffled", "seed": 2}):
        assert all(_same_bits(a, c) for a, c in zip(first, once(**device)))
    # dx and dres are per row: the same for any grid; dweight and dbias are summed in an order
    # that depends on the grid (the SM count), as documented.
    other = once(sms=7, blocks_per_sm=1)
    assert all(_same_bits(a, c) for a, c in zip(first[:4], other[:4]))


# One case of each forward kernel kind: a warp a row; a block a row with 2 rows a block; 16
# warps a row; the generic kernel with 2 rows a block and with one row of 8 warps; the generic
# kernel on 16-byte chunks, 16 warps a row.
STAT_PATHS = [
    (F32, 64, (VEC, 1, (32, 4, 1))),
    (F32, 1024, (VEC, 4, (64, 2, 1))),
    (F32, 8192, (VEC, 4, (512, 1, 1))),
    (F32, 201, (ANY, 0, (64, 2, 1))),
    (F32, 8196, (CHUNK, 0, (512, 1, 1))),
    (BF16, 1024, (VEC, 4, (32, 4, 1))),
    (F16, 1023, (ANY, 0, (256, 1, 1))),
]
STAT_IDS = [f"{str(c[0])[6:]}-{c[1]}" for c in STAT_PATHS]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize(("dtype", "cols", "path"), STAT_PATHS, ids=STAT_IDS)
def test_layer_norm_of_constant_rows_is_the_bias(dtype, cols, path, fused):
    # The mean sums x - x[0]: exactly 0 here, so x - mean is 0 and the output the bias even with
    # eps = 1e-12, where a mean off by an ulp is multiplied by 1e6.
    x = torch.tensor([7.3, -1e3, 0.1, 3e4, 1.0], dtype=dtype)[:, None].expand(5, cols)
    x = x.contiguous()
    w, b = _make((cols,), seed=1, grad=False), _make((cols,), seed=2, grad=False)
    residual = torch.zeros_like(x) if fused else None
    for order in ORDERS:
        ce.clear_launches()
        with ce.device(order=order):
            out = ce.layer_norm(x, w, b, residual, eps=1e-12, dropout_p=0.0)
        assert torch.equal(out, b.to(dtype).expand(5, cols))
        assert _path(ce.launches()[0]) == path


@pytest.mark.parametrize(("dtype", "cols", "path"), STAT_PATHS, ids=STAT_IDS)
def test_layer_norm_rows_with_a_large_offset(dtype, cols, path):
    shift = 1e5 if dtype == F32 else 100.0
    x = _make((5, cols), dtype, shift=shift)
    w, b = _make((cols,), seed=1), _make((cols,), seed=2)
    launches = _parity_in_orders(
        _ln_fast, _ln_ref, [x, w, b], ["x", "weight", "bias"], ATOL_FLOOR[dtype]
    )
    assert _path(launches[0]) == path


@pytest.mark.parametrize(("dtype", "cols", "path"), STAT_PATHS[:5], ids=STAT_IDS[:5])
def test_layer_norm_rows_with_nan_or_inf_stay_nan_beside_overflowing_rows(dtype, cols, path):
    # The rescaled statistics of an overflowing row must not turn a NaN row's rstd finite (a
    # clamp by fmaxf did: its output came out 1e32); the plain rows beside them are unchanged.
    x = _make((4, cols), grad=False)
    x[1, 3], x[2, 5] = torch.nan, torch.inf
    x[3] *= 1e30
    ce.clear_launches()
    with ce.device():
        out = ce.layer_norm(x)
    assert _path(ce.launches()[0]) == path
    assert out[1:3].isnan().all() and out[[0, 3]].isfinite().all()
    ref64 = ref.layer_norm(x[[0, 3]].double(), cols)
    torch.testing.assert_close(out[[0, 3]].double(), ref64, atol=1e-5, rtol=1e-5)


def test_layer_norm_row_far_out_with_a_spread_of_ulps():
    # At 1e23 the first sum's rounding leaves sum(d) ~ 3e19, whose square overflowed while
    # sum(d^2) did not: var came out -inf, clamped to 0 (rstd 316, outputs ~1e19).
    noise = torch.randn(2, 4096, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = (1e23 * (1 + 3e-7 * noise)).float()
    ce.clear_launches()
    with ce.device():
        out = ce.layer_norm(x)
    assert _path(ce.launches()[0]) == (VEC, 4, (256, 1, 1))
    assert out.isfinite().all() and out.abs().max() < 10


@pytest.mark.parametrize(("cols", "outlier"), [(8192, 1e4), (1024, 1e4), (201, 1e3)])
def test_layer_norm_row_whose_first_value_is_an_outlier(cols, outlier):
    # A shift by x[0] = 1e4 made the mean's sum n * 1e4: its rounding put the outputs of the
    # other columns off by 4.8e-6 (torch's float32: 7e-9), under the parity floor. The plain
    # sum serves rows whose first value is farther from the mean than 0 is.
    x = torch.randn(4, cols, generator=torch.Generator().manual_seed(0))
    x[:, 0] = outlier
    with ce.device():
        out = ce.layer_norm(x)
    ref64 = ref.layer_norm(x.double(), cols)
    torch_error = float((F.layer_norm(x, (cols,)).double() - ref64)[:, 1:].abs().max())
    assert float((out.double() - ref64)[:, 1:].abs().max()) <= 4 * max(torch_error, 1e-9)


def _relative_error(fast: torch.Tensor, ref64: torch.Tensor) -> float:
    return float((fast.detach().double() - ref64.detach()).abs().max() / ref64.detach().abs().max())


@pytest.mark.parametrize("roll", [0, 1], ids=["first", "second"])
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize(("dtype", "cols", "path"), STAT_PATHS[:4], ids=STAT_IDS[:4])
def test_rows_whose_squares_overflow_share_blocks_with_plain_rows(dtype, cols, path, rms, roll):
    # Row 0's squares overflow float32 (row 2's sum too): those rows are summed again scaled by
    # 2^-96, a branch every thread of a block takes when any of its rows needs it. Unscaled,
    # rstd was 0 and the output the bias; the plain rows in the same blocks must not change.
    # Rolled one row on, the overflowing rows are the second of their two-row blocks.
    scales = torch.tensor([1e30, 1.0, 5e37 if not rms else 1e37, 1e-3, 1.0])[:, None]
    scales = scales.roll(roll, 0)
    x = (_make((5, cols), grad=False) * scales).requires_grad_()
    w, b = _make((cols,), seed=1), None if rms else _make((cols,), seed=2)
    dy = _make((5, cols), seed=3, grad=False)
    results = {}
    for order in ORDERS:
        ce.clear_launches()
        with ce.device(order=order):
            out = ce.layer_norm(x, w, b, rms=rms)
            grads = torch.autograd.grad(out, [t for t in (x, w, b) if t is not None], dy)
        assert _path(ce.launches()[0]) == path
        results[order] = (out, *grads)
    assert all(_same_bits(a, c) for a, c in zip(*results.values()))
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    if rms:
        out64 = ref.rms_norm(x64, cols, w64, 1e-5)
        grads64 = torch.autograd.grad(out64, (x64, w64), dy.double())
    else:
        b64 = b.detach().double().requires_grad_()
        out64 = ref.layer_norm(x64, cols, w64, b64, 1e-5)
        grads64 = torch.autograd.grad(out64, (x64, w64, b64), dy.double())
    out, dx = results["forward"][:2]
    for row in range(5):  # each row on its own scale
        assert _relative_error(out[row], out64[row]) < 1e-5, row
        assert _relative_error(dx[row], grads64[0][row]) < 1e-4, row
    for got, want in zip(results["forward"][2:], grads64[1:]):
        assert _relative_error(got, want) < 1e-4


def test_layer_norm_empty_batch_gives_zero_parameter_gradients(emulator):
    x = torch.empty(0, 8)
    w, b = torch.ones(8), torch.zeros(8)
    with ce.device():
        out, pre, mean, rstd = emulator.ops.layer_norm_fwd(
            x, w, b, None, 0, 1e-5, 0.0, False, False
        )
        dx, _, dw, db = emulator.ops.layer_norm_bwd(
            x, None, x, w, b, mean, rstd, 0, 0.0, False, False, False, True, True
        )
    assert out.shape == (0, 8) and dx.shape == (0, 8)
    assert torch.equal(dw, torch.zeros(8)) and torch.equal(db, torch.zeros(8))


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_seed_read_from_device_memory_equals_the_argument(emulator, dtype):
    """Inside CUDA graph capture the glue passes a seed drawn on the device by pointer (the
    launch argument is then 0): LayerNorm's fused forward and backward (vector and generic
    kernels) and the FFN stages give the same bits as with the seed as the argument."""
    p = 0.3
    for cols in (64, 7):  # whole 16-byte chunks (vector kernels), odd (generic)
        x = _make((5, cols), dtype, seed=1, grad=False)
        res, dy = _make((5, cols), dtype, seed=2, grad=False), _make((5, cols), dtype, seed=3)
        w, b = torch.ones(cols), torch.zeros(cols)
        runs = []
        for in_memory in (False, True):
            with ce.device():
                out, pre, mean, rstd = emulator.ops.layer_norm_fwd(
                    x, w, b, res, SEED, 1e-5, p, False, True, in_memory
                )
                grads = emulator.ops.layer_norm_bwd(
                    dy.detach(),
                    None,
                    pre,
                    w,
                    b,
                    mean,
                    rstd,
                    SEED,
                    p,
                    False,
                    True,
                    True,
                    True,
                    True,
                    in_memory,
                )
            runs.append([out, pre, *grads])
        assert all(_same_bits(a, c) for a, c in zip(*runs)), cols
    for act in ("gelu", "swiglu"):
        h, dg = _ffn_inputs(9, 24, act, dtype)
        runs = []
        for in_memory in (False, True):
            with ce.device():
                g = emulator.ops.ffn_forward(h, act, p, SEED, in_memory)
                runs.append([g, *emulator.ops.ffn_backward(dg, h, act, p, SEED, in_memory)])
        assert all(_same_bits(a, c) for a, c in zip(*runs)), act
    with ce.device():  # the argument alone, 0, would drop other elements
        assert not torch.equal(emulator.ops.ffn_forward(h, act, p, 0), runs[1][0])


# --------------------------------------------------------------------------- ffn


GATED = ("swiglu", "geglu")
ACT_FN = {
    "identity": lambda h: h,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "silu": F.silu,
    "swiglu": F.silu,
    "geglu": F.gelu,
}


def _stage_ref(h: torch.Tensor, act: str, keep: torch.Tensor | None, p: float) -> torch.Tensor:
    """g = dropout(act(h)) eagerly, in h's dtype (the gated variants: act(gate) * up)."""
    if act in GATED:
        gate, up = h.chunk(2, dim=-1)
        y = ACT_FN[act](gate) * up
    else:
        y = ACT_FN[act](h)
    return y * keep.to(y.dtype) * (1.0 / (1.0 - p)) if p > 0 else y


def _stage_ref_grads(h, dg, act, keep, p):
    """(g, dh, db1) of the eager stage, in h's dtype."""
    h = h.detach().requires_grad_()
    g = _stage_ref(h, act, keep, p)
    (dh,) = torch.autograd.grad(g, h, dg)
    return g.detach(), dh, dh.sum(0)


@pytest.mark.parametrize("low, high", [(-9, 9), (-60, -5)])
def test_ffn_gelu_tanh_keeps_its_digits_in_the_left_tail(emulator, low, high):
    # The stage's gate is 1 / (1 + e^-2u): from tanhf, 1 + tanh(u) cancelled (0 at x = -5).
    # Below x ~ -10 e^-2u overflows to inf (s = 0): 1 - s must then come from 1 - s, not e * s
    # (inf * 0, a NaN gradient). torch's gradient there is 0 to float32.
    h = torch.linspace(low, high, 3600).view(-1, 8)
    dg = torch.ones_like(h)
    with ce.device():
        g = emulator.ops.ffn_forward(h, "gelu_tanh", 0.0, SEED)
        dh = emulator.ops.ffn_backward(dg, h, "gelu_tanh", 0.0, SEED)[0]
    h64 = h.double().requires_grad_()
    u = (2 / torch.pi) ** 0.5 * (h64 + 0.044715 * h64**3)
    g64 = h64 * torch.sigmoid(2 * u)  # float64's 1 + tanh(u) cancels too
    (dh64,) = torch.autograd.grad(g64.sum(), h64)
    assert g.isfinite().all() and ((g - g64).abs() <= 2e-5 * g64.abs() + 1e-30).all()
    assert ((dh - dh64).abs() <= 2e-5 * dh64.abs() + 1e-7).all()


def test_ffn_relu_passes_the_gradient_at_nan_as_torch_does(emulator):
    h = torch.tensor([[torch.nan, 1.0, -1.0, 0.0, torch.nan, 2.0, -3.0, 4.0]])
    dg = torch.arange(1.0, 9.0)[None]
    with ce.device():
        g = emulator.ops.ffn_forward(h, "relu", 0.0, SEED)
        dh = emulator.ops.ffn_backward(dg, g, "relu", 0.0, SEED)[0]
    assert dh.tolist() == [[1.0, 2.0, 0.0, 0.0, 5.0, 6.0, 0.0, 8.0]]  # torch.relu's backward
    # with dropout a dropped NaN is saved as NaN too (NaN * 0): it gets no gradient
    h = torch.full((4, 64), torch.nan)
    with ce.device():
        g = emulator.ops.ffn_forward(h, "relu", 0.5, SEED)
        dh = emulator.ops.ffn_backward(torch.ones_like(h), g, "relu", 0.5, SEED)[0]
    assert torch.equal(dh, _keep(SEED, (4, 64), 0.5).float() * 2.0)


def _ffn_inputs(rows, d_ff, act, dtype, seed=0):
    width = 2 * d_ff if act in GATED else d_ff
    h = _make((rows, width), dtype, seed=seed, scale=2.0, grad=False)
    dg = _make((rows, d_ff), dtype, seed=seed + 1, grad=False)
    return h, dg


def _check_ffn_stages(emulator, h, dg, act, p, dtype, seed=SEED):
    rows, d_ff = dg.shape
    keep = _keep(seed, (rows, d_ff), p) if p > 0 else None
    floor = ATOL_FLOOR[dtype]
    with ce.device():
        g = emulator.ops.ffn_forward(h, act, p, seed)
    g64, g_lp = _stage_ref(h.double(), act, keep, p), _stage_ref(h, act, keep, p)
    assert_parity([parity("g", g, g64, g_lp, floor)])
    if act == "identity":
        return []
    # The backward reads h, or for relu the forward's output g.
    saved = g if act == "relu" else h
    results = []
    for order in ORDERS:
        ce.clear_launches()
        with ce.device(order=order):
            results.append(emulator.ops.ffn_backward(dg, saved, act, p, seed))
    assert all(_same_bits(a, c) for a, c in zip(*results)), "fiber orders disagree"
    dh, g_out, db1 = results[0]
    ref64 = _stage_ref_grads(h.double(), dg.double(), act, keep, p)
    ref_lp = _stage_ref_grads(h, dg, act, keep, p)
    checks = [parity("dh", dh, ref64[1], ref_lp[1], floor)]
    checks.append(parity("db1", db1, ref64[2], ref_lp[2], floor))
    if act != "relu":
        checks.append(parity("g_out", g_out, ref64[0], ref_lp[0], floor))
    assert_parity(checks)
    return ce.launches()


FFN_SHAPES = [(1, 13), (70, 40), (33, 36), (257, 37)]  # 40: vectors of any dtype, 36: fp32 only


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("shape", FFN_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("act", ["relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu"])
def test_ffn_stages_parity(emulator, act, dtype, shape, p):
    rows, d_ff = shape
    h, dg = _ffn_inputs(rows, d_ff, act, dtype)
    launches = _check_ffn_stages(emulator, h, dg, act, p, dtype)
    vec = 16 // h.element_size() if d_ff % (16 // h.element_size()) == 0 else 1
    backward, finalize = launches
    assert backward.kernel == "ffn_backward_kernel" and int(backward.params["VEC"]) == vec
    assert backward.grid == (math.ceil(math.ceil(d_ff / vec) / 32), math.ceil(rows / 32), 1)
    assert finalize.kernel == "ffn_bias_grad_finalize_kernel"
    width = 2 * d_ff if act in ("swiglu", "geglu") else d_ff
    assert finalize.grid == (math.ceil(width / 32), 1, 1) and finalize.block == (32, 8, 1)


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("p", [0.0, 0.25])
def test_ffn_identity_forward_is_dropout_in_place(emulator, dtype, p):
    # The forward after a fused cuBLASLt epilogue: only dropout is left, in place on h.
    h, dg = _ffn_inputs(70, 40, "identity", dtype)
    _check_ffn_stages(emulator, h, dg, "identity", p, dtype)


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("d_ff", [40, 37])
def test_ffn_dropout_mask_is_the_regenerated_one(emulator, dtype, d_ff):
    rows, p = 9, 0.4
    keep = _keep(SEED, (rows, d_ff), p)
    ce.clear_launches()
    with ce.device():
        g = emulator.ops.ffn_forward(torch.ones(rows, d_ff, dtype=dtype), "relu", p, SEED)
        dg = _make((rows, d_ff), dtype, grad=False)
        dh, _, _ = emulator.ops.ffn_backward(dg, g, "relu", p, SEED)
        h = torch.ones(rows, 2 * d_ff, dtype=dtype)
        dh_gated, g_gated, _ = emulator.ops.ffn_backward(dg, h, "swiglu", p, SEED)
    assert torch.equal(g != 0, keep) and torch.equal(dh != 0, keep)
    assert torch.equal(g_gated != 0, keep)
    assert torch.equal(dh_gated[:, :d_ff] != 0, keep) and torch.equal(dh_gated[:, d_ff:] != 0, keep)
    vec = 16 // g.element_size() if d_ff % (16 // g.element_size()) == 0 else 1
    assert int(ce.launches()[0].params["VEC"]) == vec


def _relu_mask_ref(saved: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """relu's bitmask in the layout ffn.h documents (FfnReluMaskArgs): element (t, j) is bit
    j % 32 of int32 word t * words + j // 32, words = 4 per 128 columns begun; set where the
    gradient passes (saved > 0, or NaN unless dropout dropped it), 0 past d_ff."""
    rows, d_ff = saved.shape
    words = (d_ff + 127) // 128 * 4
    passes = (saved > 0) | (saved.isnan() & (True if keep is None else keep))
    bits = torch.zeros(rows, words * 32, dtype=torch.int64)
    bits[:, :d_ff] = passes.long()
    value = (bits.view(rows, words, 32) << torch.arange(32)).sum(-1)
    return (value - (value >= 2**31).long() * 2**32).to(torch.int32)  # as int32 bits


@pytest.mark.parametrize("seed_in_memory", [False, True], ids=["seed", "seed_ptr"])
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize(
    "shape", [(1, 13), (70, 40), (5, 300), (9, 256), (3, 376)], ids=lambda s: f"{s[0]}x{s[1]}"
)
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["fp32", "fp16", "bf16"])
def test_ffn_relu_mask_has_the_documented_layout(emulator, dtype, shape, p, seed_in_memory):
    """The bitmask cuBLASLt's DRELU_BGRAD epilogue reads (FASTFORMER_FFN_DRELU=epilogue), made
    from the saved relu output: every bit as the layout of ffn.h says, in both fiber orders, the
    vector and scalar kernels, NaNs dropped or kept, zeros and negatives off, padding 0."""
    rows, d_ff = shape
    h = _make(shape, dtype, seed=5, grad=False)
    h.view(-1)[::7] = float("nan")
    h.view(-1)[3::11] = 0.0
    with ce.device():
        saved = emulator.ops.ffn_forward(h, "relu", p, SEED)
    saved.view(-1)[5::13] = -1.0  # never written by the forward, but refused all the same
    keep = _keep(SEED, shape, p) if p > 0 else None
    masks = []
    for order in ORDERS:
        ce.clear_launches()
        with ce.device(order=order):
            masks.append(emulator.ops.ffn_relu_mask(saved, p, SEED, seed_in_memory))
    vec = 16 // saved.element_size()
    assert ce.launches()[0].params["VEC"] == str(vec if d_ff % vec == 0 else 1)
    assert torch.equal(masks[0], masks[1]), "fiber orders disagree"
    assert torch.equal(masks[0], _relu_mask_ref(saved, keep))


def test_ffn_relu_mask_of_misaligned_rows_takes_the_scalar_kernel(emulator):
    base = _make((6, 41), BF16, seed=2, grad=False).relu()
    saved = base.view(-1)[1 : 1 + 6 * 40].view(6, 40)  # contiguous, one element off
    assert saved.data_ptr() % 16 != 0
    ce.clear_launches()
    with ce.device():
        mask = emulator.ops.ffn_relu_mask(saved, 0.0, SEED)
    assert ce.launches()[0].params["VEC"] == "1"  # 40 columns would take 8-wide vectors
    assert torch.equal(mask, _relu_mask_ref(saved, None))


def test_ffn_misaligned_h_takes_the_scalar_kernels(emulator):
    base, dg = _ffn_inputs(70, 41, "gelu", BF16)
    h = base.view(-1)[1 : 1 + 70 * 40].view(70, 40)  # contiguous, one element off
    dg = dg[:, :40].contiguous()
    assert h.data_ptr() % 16 != 0
    ce.clear_launches()
    with ce.device():
        emulator.ops.ffn_forward(h, "gelu", 0.3, SEED)
    assert ce.launches()[0].params["VEC"] == "1"  # 40 columns would take 8-wide vectors
    launches = _check_ffn_stages(emulator, h, dg, "gelu", 0.3, BF16)
    assert launches[0].params["VEC"] == "1"


def test_ffn_bias_grad_with_the_most_row_blocks(emulator):
    # 8300 rows: 256 row blocks (the cap), each looping over several block steps.
    h, dg = _ffn_inputs(8300, 5, "gelu", F32)
    launches = _check_ffn_stages(emulator, h, dg, "gelu", 0.1, F32)
    assert launches[0].grid == (1, 256, 1)


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize(
    "shape", [(1, 8), (70, 40), (257, 37), (8300, 16), (0, 6)], ids=lambda s: f"{s[0]}x{s[1]}"
)
def test_ffn_column_sum_parity(emulator, dtype, shape):
    """linear2's bias gradient, grad_out summed over tokens: per-row-block partial sums, then a
    fixed-order finalize; vector and scalar paths, the most row blocks (8300 rows), no rows.
    Bit-identical in every fiber order."""
    rows, cols = shape
    src = _make(shape, dtype, seed=3, grad=False)
    results = []
    for order in ORDERS:
        ce.clear_launches()
        with ce.device(order=order):
            results.append(emulator.ops.ffn_column_sum(src))
    assert _same_bits(*results), "fiber orders disagree"
    want64, want_lp = src.double().sum(0), src.float().sum(0).to(dtype)
    assert_parity([parity("db2", results[0], want64, want_lp, ATOL_FLOOR[dtype])])
    kernels = [launch.kernel for launch in ce.launches()]
    assert kernels == (["ffn_column_partials_kernel"] if rows else []) + [
        "ffn_bias_grad_finalize_kernel"
    ]
    if rows:
        vec = 16 // src.element_size() if cols % (16 // src.element_size()) == 0 else 1
        partials = ce.launches()[0]
        assert int(partials.params["VEC"]) == vec
        assert partials.grid == (math.ceil(math.ceil(cols / vec) / 32), min(256, -(-rows // 32)), 1)


def test_ffn_empty_batch_gives_zero_bias_gradient(emulator):
    with ce.device():
        dh, _, db1 = emulator.ops.ffn_backward(
            torch.empty(0, 6), torch.empty(0, 12), "geglu", 0.0, 0
        )
    assert dh.shape == (0, 12) and torch.equal(db1, torch.zeros(12))


@pytest.mark.parametrize(
    ("dtype", "cols"), [(F32, 1024), (BF16, 1024), (F16, 64), (BF16, 8200), (F32, 8196)]
)
@pytest.mark.parametrize("misaligned", ["dout", "dpre"])
def test_layer_norm_misaligned_gradient_takes_the_generic_backward(dtype, cols, misaligned):
    # The gradient of out (or of pre) may be a view one element into its storage (a slice of
    # a larger gradient: torch.cat's backward, say); the glue's contiguous() keeps it so. The
    # vector backward kernels would fault on the GPU: the scalar generic kernel runs instead.
    rows = 5
    x, r = _make((rows, cols), dtype), _make((rows, cols), dtype, seed=9)
    w, b = _make((cols,), seed=1), _make((cols,), seed=2)
    gen = torch.Generator().manual_seed(4)
    cot = [torch.randn(rows * cols + 1, generator=gen).to(dtype)[1:].view(rows, cols)]
    cot.append(torch.randn(rows, cols, generator=gen).to(dtype))
    if misaligned == "dpre":
        cot.reverse()
    assert [c.data_ptr() % 16 != 0 for c in cot] == [misaligned == "dout", misaligned == "dpre"]
    inputs = [x, r, w, b]

    def grads(fn, dtype_):
        ins = [t.detach().to(dtype_).requires_grad_() for t in inputs]
        outs = fn(*ins)
        return [*outs, *torch.autograd.grad(outs, ins, [c.to(dtype_) for c in cot])]

    ce.clear_launches()
    with ce.device():
        fast = grads(lambda x, r, w, b: ce.layer_norm(x, w, b, r, prenorm=True), dtype)
    assert ce.launches()[1].kernel == "ln_bwd_any_kernel"

    ref64 = grads(_fused_ln_ref, torch.float64)
    ref_lp = grads(_fused_ln_ref, dtype)
    names = ["out", "pre", "dx", "dresidual", "dweight", "dbias"]
    floor = ATOL_FLOOR[dtype]
    assert_parity(
        [parity(n, f, r64, lp, floor) for n, f, r64, lp in zip(names, fast, ref64, ref_lp)]
    )


@pytest.mark.parametrize("act", ["gelu", "relu", "swiglu"])
def test_ffn_misaligned_dg_takes_the_scalar_backward(emulator, act):
    # The op's dg is a fresh GEMM output; the launcher's own contract takes any dg.
    h, base = _ffn_inputs(70, 40, act, BF16)
    dg = torch.cat([base.view(-1)[:1], base.view(-1)])[1:].view(70, 40)  # one element off
    assert dg.data_ptr() % 16 != 0
    launches = _check_ffn_stages(emulator, h, dg, act, 0.3, BF16)
    assert launches[0].params["VEC"] == "1"  # 40 columns would take 8-wide vectors


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["fp32", "fp16", "bf16"])
def test_ffn_column_sum_of_misaligned_src_takes_the_scalar_kernel(emulator, dtype):
    # grad_out may be a view one element into its storage (contiguous() keeps it so): its 40
    # columns would take vectors in every dtype, which would fault on the GPU.
    rows, cols = 70, 40
    src = _make((rows * cols + 1,), dtype, seed=3, grad=False)[1:].view(rows, cols)
    assert src.data_ptr() % 16 != 0
    ce.clear_launches()
    with ce.device():
        got = emulator.ops.ffn_column_sum(src)
    assert ce.launches()[0].params["VEC"] == "1"
    want64, want_lp = src.double().sum(0), src.float().sum(0).to(dtype)
    assert_parity([parity("db2", got, want64, want_lp, ATOL_FLOOR[dtype])])


@pytest.mark.parametrize(
    ("rows", "cols", "shift", "kernel"),
    [(256, 7, 1e4, ANY), (256, 64, 1e4, VEC), (128, 200, 1e5, VEC)],
    ids=["any", "vec1", "vec2-padded"],
)
def test_layer_norm_weight_gradient_of_rows_whose_mean_dwarfs_their_spread(
    rows, cols, shift, kernel
):
    # dweight sums dy * xc, of the exactly centred xhat (see DxConsts): its error stays at the
    # parity floor however far the rows sit from 0, while torch's float32 (whose xhat carries
    # the rounding of the mean) misses that floor. The parity rule alone (twice torch's error)
    # would let a dweight of the uncentred xhat pass.
    x = _make((rows, cols), shift=shift)
    w, b = _make((cols,), seed=1), _make((cols,), seed=2)
    dy = _make((rows, cols), seed=3, shift=1.0, grad=False)  # mean(dy) far from 0

    def grads(fn, *inputs):
        inputs = [t.detach().requires_grad_() for t in inputs]
        return torch.autograd.grad(fn(*inputs), inputs, dy.to(inputs[0].dtype))

    ce.clear_launches()
    with ce.device():
        fast = grads(lambda x, w, b: ce.layer_norm(x, w, b), x, w, b)
    assert ce.launches()[1].kernel == f"ln_bwd_{kernel}_kernel"
    ref64 = grads(_ln_ref, x.double(), w.double(), b.double())
    # parity against float64 rounded to float32: the bound is the floor (and that rounding)
    floor_only = [
        parity(f"d{n}", f, r, r.float()) for n, f, r in zip(["weight", "bias"], fast[1:], ref64[1:])
    ]
    assert_parity(floor_only)
