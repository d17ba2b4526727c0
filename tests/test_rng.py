"""The shared dropout RNG: PyTorch reference == C++ CPU op == Triton tl.rand, bit for bit."""

import numpy as np
import pytest
import torch

from fastformer._ext import cuda_kernels_compiled
from fastformer.ops import rng

SEEDS = [0, 1, 2**31 - 1, 2**31, 2**32 + 7, 2**62 + 12345, 2**63 - 1]


def _offsets(n: int, generator: torch.Generator) -> torch.Tensor:
    edges = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40 - 1])
    return torch.cat([edges, torch.randint(0, 2**40, (n,), generator=generator)])


def _random_seeds(count: int) -> list[int]:
    gen = torch.Generator().manual_seed(2024)
    draws = torch.randint(0, 2**62, (count, 2), generator=gen)
    return [(int(a) << 1) ^ int(b) for a, b in draws] + SEEDS


@pytest.fixture(scope="module")
def triton_rand():
    pytest.importorskip("triton")
    from fastformer.kernels import rng as kernels_rng

    return kernels_rng.philox_uniform


def test_python_matches_cpp():
    gen = torch.Generator().manual_seed(0)
    for seed in _random_seeds(20):
        offsets = _offsets(5000, gen)
        expected = rng.philox_uniform(seed, offsets)
        assert torch.equal(rng.philox_uniform_cpp(seed, offsets), expected), seed


def test_element_scheme_python_matches_cpp():
    gen = torch.Generator().manual_seed(4)
    for seed in _random_seeds(10):
        offsets = _offsets(5000, gen)
        expected = rng.element_uniform(seed, offsets)
        assert torch.equal(rng.element_uniform_cpp(seed, offsets), expected), seed


def test_negative_offsets_are_unsigned_counters_in_python_and_cpp():
    # The C++ ops read an int64 offset as uint64; Python's arithmetic >> 2 carried the sign into
    # the element scheme's top counter bits, so the two disagreed for negative offsets.
    offsets = torch.tensor([-1, -2, -4, -5, -(2**62), -(2**63), 2**63 - 1, 0, 7])
    for seed in (0, 12345, 2**63 - 5):
        assert torch.equal(
            rng.element_uniform_cpp(seed, offsets), rng.element_uniform(seed, offsets)
        )
        assert torch.equal(rng.philox_uniform_cpp(seed, offsets), rng.philox_uniform(seed, offsets))
    # -4 .. -1 share the call of counter 2**62 - 1 (2**64 - 4 .. 2**64 - 1, divided by 4)
    top = torch.tensor([2**62 - 1])
    words = torch.stack(rng.philox4x32(7, top), dim=-1)[0]
    lanes = [rng._uint_to_uniform(words[i : i + 1]) for i in range(4)]
    assert torch.equal(rng.element_uniform(7, torch.tensor([-4, -3, -2, -1])), torch.cat(lanes))


@pytest.mark.parametrize(
    ("seq_k", "dropout_p"),
    [(1, 0.5), (45, 0.1), (64, 0.9), (97, 0.0), (31, 0.5), (59, 0.3), (127, 0.2)],
)
def test_attention_keep_mask_cpp_matches_python(monkeypatch, seq_k, dropout_p):
    # attention's dropout_keep_mask on CPU runs the compiled kernel; the PyTorch spelling of the
    # scheme (its path without the extension) must give the same bits. The kernel computes a
    # row's ragged tail past its last whole group of 32 columns word by word: seq_k % 32 in
    # 17..31 reaches the tail's words 2 and 3.
    from fastformer.ops import attention as attn

    for seed in _random_seeds(4):
        seed %= 2**63  # the compiled kernel's range; larger seeds take the PyTorch path
        args = (seed, 2, 3, 17, seq_k, dropout_p)
        assert rng.compiled_cpu_kernels(torch.device("cpu"), seed)
        compiled = attn.dropout_keep_mask(*args)
        with monkeypatch.context() as m:
            m.setattr(rng, "compiled_cpu_kernels", lambda device, seed: False)
            assert torch.equal(compiled, attn.dropout_keep_mask(*args)), seed


def test_attention_keep_mask_cpp_errors():
    rows = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="threshold must be in"):
        torch.ops.fastformer.attention_keep_mask(1, rows, 4, 65537)
    with pytest.raises(RuntimeError, match="seq_k must be >= 0"):
        torch.ops.fastformer.attention_keep_mask(1, rows, -1, 10)


def test_element_scheme_is_four_words_of_one_call():
    offsets = torch.arange(4000, dtype=torch.int64)
    words = torch.stack(rng.philox4x32(77, offsets // 4), -1)  # (n, 4)
    lanes = words[torch.arange(4000), offsets % 4]
    signed = torch.where(lanes >= 2**31, lanes - 2**32, lanes)
    folded = torch.where(signed < 0, -signed - 1, signed).double()
    expected = (folded.float() * torch.tensor(4.6566127342e-10)).float()
    assert torch.equal(rng.element_uniform(77, offsets), expected)
    # Word 0 of each call is tl.rand of the counter.
    assert torch.equal(
        rng.element_uniform(77, offsets[::4]), rng.philox_uniform(77, offsets[::4] // 4)
    )


def test_python_matches_triton(triton_rand):
    gen = torch.Generator().manual_seed(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for seed in _random_seeds(8):
        offsets = _offsets(3000, gen)
        expected = rng.philox_uniform(seed, offsets)
        got = triton_rand(seed, offsets.to(device)).cpu()
        assert torch.equal(got, expected), seed


def test_four_words_match_triton_randint4x():
    pytest.importorskip("triton")
    from fastformer.kernels import rng as kernels_rng

    gen = torch.Generator().manual_seed(3)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for seed in _random_seeds(4):
        offsets = _offsets(2000, gen)
        got = kernels_rng.philox4x32(seed, offsets.to(device))
        for word, expected in zip(got, rng.philox4x32(seed, offsets)):
            assert torch.equal(word.cpu(), expected), seed


@pytest.mark.cuda
def test_cuda_op_matches_python():
    gen = torch.Generator().manual_seed(2)
    for seed in _random_seeds(8):
        offsets = _offsets(100_000, gen)
        got = rng.philox_uniform_cpp(seed, offsets.cuda()).cpu()
        assert torch.equal(got, rng.philox_uniform(seed, offsets))


def test_uniform_range_and_statistics():
    values = rng.philox_uniform(12345, torch.arange(200_000, dtype=torch.int64))
    assert values.dtype == torch.float32
    assert float(values.min()) >= 0.0 and float(values.max()) < 1.0
    # Mean of 200k uniforms: standard error 0.00065; 5 sigma.
    assert abs(float(values.mean()) - 0.5) < 5 * (1 / 12) ** 0.5 / 200_000**0.5
    counts = torch.histc(values, bins=10, min=0.0, max=1.0)
    assert float((counts - 20_000).abs().max()) < 5 * (20_000 * 0.9) ** 0.5


def test_shape_preserved_and_streams_differ():
    offsets = torch.arange(24, dtype=torch.int64).reshape(2, 3, 4)
    a = rng.philox_uniform(7, offsets)
    assert a.shape == offsets.shape
    assert not torch.equal(a, rng.philox_uniform(8, offsets))
    # The high word of the offset is part of the counter: distinct streams, not a shift.
    assert not torch.equal(a, rng.philox_uniform(7, offsets + (1 << 32)))


@pytest.mark.cuda
def test_cuda_element_scheme_matches_python():
    gen = torch.Generator().manual_seed(5)
    for seed in _random_seeds(4):
        offsets = _offsets(100_000, gen)
        got = rng.element_uniform_cpp(seed, offsets.cuda()).cpu()
        assert torch.equal(got, rng.element_uniform(seed, offsets))


def test_dropout_keep_rate():
    keep = rng.dropout_keep(99, torch.arange(100_000, dtype=torch.int64), 0.3)
    rate = float(keep.float().mean())
    assert abs(rate - 0.7) < 5 * (0.7 * 0.3 / 100_000) ** 0.5


def test_draw_seed_reproducible_and_fresh():
    torch.manual_seed(123)
    first = [rng.draw_seed("cpu") for _ in range(3)]
    torch.manual_seed(123)
    again = [rng.draw_seed("cpu") for _ in range(3)]
    assert first == again
    assert len(set(first)) == 3
    assert all(0 <= s < 2**63 for s in first)


@pytest.mark.cuda
def test_draw_seed_cuda_reproducible_and_fresh():
    torch.manual_seed(5)
    first = [rng.draw_seed("cuda") for _ in range(3)]
    torch.manual_seed(5)
    assert first == [rng.draw_seed("cuda") for _ in range(3)]
    assert len(set(first)) == 3


@pytest.mark.cuda
def test_draw_seed_cuda_moves_torch_s_offset_on_by_one_call():
    # The draw reads torch's (seed, offset) and moves the offset on by 4 in one step, so that
    # torch's own draws, and other threads', never reuse its offsets.
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    torch.manual_seed(5)
    before = gen.get_offset()
    seed = rng.draw_seed("cuda")
    assert gen.get_offset() == before + 4
    torch.manual_seed(5)
    assert rng._cuda_philox_advance(torch.cuda.current_device()) == (gen.initial_seed(), before)
    torch.manual_seed(5)
    assert rng.draw_seed("cuda") == seed


def test_cuda_seed_draw_takes_the_extension_s_one_step(monkeypatch):
    # The CUDA draw's (seed, offset) come from fastformer._C's cuda_philox_advance (under the
    # generator's mutex), asked for 4 more offsets; no GPU: a stand-in takes the call.
    calls = []

    def advance(index, increment):
        calls.append((index, increment))
        return 123, 8 * len(calls)

    monkeypatch.setattr(rng, "_compiled_philox_advance", lambda: advance)
    monkeypatch.setattr(rng, "capturing", lambda device: False)
    seeds = [rng.draw_seed(torch.device("cuda", 1)) for _ in range(2)]
    assert calls == [(1, 4), (1, 4)] and seeds[0] != seeds[1]


@pytest.mark.skipif(not cuda_kernels_compiled(), reason="fastformer._C without CUDA kernels")
def test_cuda_philox_advance_checks_its_device():
    from fastformer import _C

    with pytest.raises(ValueError, match="device_index must be in"):
        _C.cuda_philox_advance(-1, 4)
    with pytest.raises(RuntimeError):  # no 128th GPU: torch's error, not a crash
        _C.cuda_philox_advance(127, 4)


def test_draw_seed_refuses_cuda_graph_capture(monkeypatch):
    # A seed drawn at capture would be replayed with every graph replay: a clear error instead.
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA graph capture"):
        rng.draw_seed("cuda")
    assert rng.draw_seed("cpu") >= 0  # CPU draws never ask


def test_capturing_asks_the_stream_of_the_op_s_device(monkeypatch):
    # torch.cuda.is_current_stream_capturing asks the current device's stream: an op on cuda:1
    # while cuda:0 (current) captures is not in the capture, and the reverse (stubs: no GPU).
    current = [0]

    class Device:
        def __init__(self, device):
            self.index = torch.device(device).index

        def __enter__(self):
            self.was, current[0] = current[0], self.index

        def __exit__(self, *exc):
            current[0] = self.was

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", Device)
    for capturing_index in (0, 1):
        monkeypatch.setattr(
            torch.cuda, "is_current_stream_capturing", lambda i=capturing_index: current[0] == i
        )
        for index in (0, 1):
            assert rng.capturing(torch.device("cuda", index)) == (index == capturing_index)
        assert rng.capturing(torch.device("cuda")) == (capturing_index == 0)
        assert current == [0]
    assert not rng.capturing(torch.device("cpu"))


def test_call_seed_is_drawn_on_the_device_inside_capture(monkeypatch):
    # Inside capture a call's seed is a device tensor from torch's (capture-safe) generator;
    # outside, the host draw as before.
    device = torch.device("cpu")  # stands for the capturing CUDA device
    torch.manual_seed(9)
    host = rng.draw_call_seed(device)
    torch.manual_seed(9)
    assert isinstance(host, int) and host == rng.draw_seed(device)
    monkeypatch.setattr(rng, "capturing", lambda device: True)
    torch.manual_seed(9)
    seed = rng.draw_call_seed(device)
    torch.manual_seed(9)
    expected = torch.randint(0, 2**rng.SEED_BITS - 1, (), dtype=torch.int64)
    assert isinstance(seed, torch.Tensor) and seed.dtype == torch.int64 and seed.dim() == 0
    assert torch.equal(seed, expected) and rng.seed_output(seed, device) is seed
    assert rng.saved_seed(seed) == int(expected)  # a CPU seed goes to the kernels as an int


def test_cpp_ops_take_the_seed_drawn_inside_capture(monkeypatch):
    # Capture simulated on CPU (the GPU tests capture for real): LayerNorm's kernels read the
    # drawn seed tensor (the result is the reference's with that seed's mask); the FFN op gets
    # it as device_seed, which only its CUDA kernels take.
    from fastformer import reference as R
    from fastformer.ops import ffn as ffn_ops
    from fastformer.ops import layer_norm as ln_ops

    monkeypatch.setattr(rng, "capturing", lambda device: True)
    x, res = torch.randn(4, 32), torch.randn(4, 32)
    w, b = torch.rand(32) + 0.5, torch.randn(32)
    torch.manual_seed(3)
    seed = int(torch.randint(0, 2**rng.SEED_BITS - 1, (), dtype=torch.int64))
    torch.manual_seed(3)
    out = ln_ops.dropout_add_layer_norm(x, res, w, b, dropout_p=0.3)
    keep = ln_ops.dropout_add_layer_norm_keep_mask(seed, x.shape, 0.3)
    expected = R.dropout_add_layer_norm(x, res, w, b, dropout_p=0.3, keep_mask=keep)
    torch.testing.assert_close(out, expected)
    w1, w2 = torch.randn(64, 32), torch.randn(32, 64)
    with pytest.raises(RuntimeError, match="device_seed must be a 1-element int64 tensor"):
        ffn_ops.ffn(x, w1, None, w2, None, "gelu", dropout_p=0.3)


@pytest.mark.cuda
def test_attention_dropout_replays_with_a_new_mask_each_time(monkeypatch):
    # Captured with dropout, each replay draws a new seed on the device, and its forward and
    # gradient are those of the kernels run eagerly with that seed.
    from fastformer.kernels import attention as kernels
    from fastformer.ops.attention import scaled_dot_product_attention as sdpa

    drawn = []
    draw = rng.draw_call_seed
    monkeypatch.setattr(
        rng, "draw_call_seed", lambda device: drawn.append(draw(device)) or drawn[-1]
    )
    q = torch.randn(2, 4, 96, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(q)
    kw = dict(is_causal=True, dropout_p=0.2)
    sdpa(q, q, q, **kw).backward(g)  # warm-up: the autotuner cannot time configs under capture
    drawn.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sdpa(q, q, q, **kw)
        (grad,) = torch.autograd.grad(out, q, g)
    (seed,) = drawn
    assert isinstance(seed, torch.Tensor) and seed.is_cuda
    x, seen = q.detach(), set()
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        seen.add(int(seed))
        args = (None, None, int(seed), 0.2, True, 64**-0.5)
        expected, lse = kernels.attention_forward(x, x, x, *args)
        assert torch.equal(out, expected)
        dq, dk, dv, _ = kernels.attention_backward(g, None, x, x, x, expected, lse, *args, False)
        torch.testing.assert_close(grad, dq + dk + dv, rtol=2e-2, atol=2e-2)
    assert len(seen) == 2


@pytest.mark.cuda
@pytest.mark.parametrize("op", ["dropout_add_layer_norm", "ffn"])
def test_cpp_op_dropout_replays_with_the_mask_of_each_replays_seed(monkeypatch, op):
    # The C++ ops captured with dropout: each replay's output and gradients are those of an
    # eager call whose keep-mask is regenerated from the seed that replay drew on the device.
    from fastformer import reference as R
    from fastformer.ops import ffn as ffn_ops
    from fastformer.ops import layer_norm as ln_ops

    drawn = []
    draw = rng.draw_call_seed
    monkeypatch.setattr(
        rng, "draw_call_seed", lambda device: drawn.append(draw(device)) or drawn[-1]
    )
    torch.manual_seed(0)
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    if op == "ffn":
        w1, w2 = (
            torch.randn(512, 256, device="cuda") / 16,
            torch.randn(256, 512, device="cuda") / 23,
        )

        def run(x):
            return ffn_ops.ffn(x, w1, None, w2, None, "gelu", dropout_p=0.3)

        def expected(x, seed):
            keep = ffn_ops.ffn_keep_mask(seed, 64, 512, 0.3, device="cuda")
            return R.ffn(x, w1, None, w2, None, "gelu", 0.3, keep_mask=keep)
    else:
        res = torch.randn(64, 256, device="cuda")
        w, b = torch.rand(256, device="cuda") + 0.5, torch.randn(256, device="cuda")

        def run(x):
            return ln_ops.dropout_add_layer_norm(x, res, w, b, dropout_p=0.3)

        def expected(x, seed):
            keep = ln_ops.dropout_add_layer_norm_keep_mask(seed, x.shape, 0.3, device="cuda")
            return R.dropout_add_layer_norm(x, res, w, b, dropout_p=0.3, keep_mask=keep)

    run(x).sum().backward()  # warm-up outside the capture
    drawn.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(x)
        (grad,) = torch.autograd.grad(out.sum(), x)
    (seed,) = drawn
    assert seed.is_cuda
    seen = set()
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        seen.add(int(seed))
        xr = x.detach().requires_grad_()
        ref = expected(xr, int(seed))
        (ref_grad,) = torch.autograd.grad(ref.sum(), xr)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-4)
    assert len(seen) == 2


@pytest.mark.cuda
def test_attention_without_dropout_replays_in_a_cuda_graph():
    # Without dropout nothing is drawn on the host: capture works (after a warm-up call, as
    # the autotuner cannot time configs under capture) and a replay gives the eager result.
    from fastformer.ops.attention import scaled_dot_product_attention as sdpa

    q = torch.randn(1, 2, 64, 32, device="cuda", dtype=torch.bfloat16)
    expected = sdpa(q, q, q, is_causal=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sdpa(q, q, q, is_causal=True)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, sdpa(q, q, q, is_causal=True))
    assert not torch.equal(out, expected)


@pytest.mark.parametrize(
    "seed, offsets, error",
    [
        (-1, torch.zeros(3, dtype=torch.int64), ValueError),
        (1.5, torch.zeros(3, dtype=torch.int64), TypeError),
        (1, torch.zeros(3, dtype=torch.int32), TypeError),
    ],
)
def test_bad_input(seed, offsets, error):
    with pytest.raises(error, match="seed|offsets"):
        rng.philox_uniform(seed, offsets)


def test_cpp_op_rejects_wrong_dtype():
    with pytest.raises(RuntimeError, match="int64"):
        torch.ops.fastformer.philox_uniform(1, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="attention_keep_mask: offsets must be int64"):
        torch.ops.fastformer.attention_keep_mask(1, torch.zeros(3, dtype=torch.int32), 4, 10)


@pytest.mark.parametrize("p", [np.float32(0.25), np.float64(0.0), np.int64(0), 0])
def test_every_op_takes_dropout_p_of_any_real_type(p):
    # numpy scalars (a config read with numpy) run as the equal Python float does.
    from fastformer.ops import attention, ffn, layer_norm

    x, w1, w2 = torch.randn(2, 4, 8), torch.randn(16, 8), torch.randn(8, 16)
    q = torch.randn(1, 2, 4, 8)
    calls = {
        "attention": lambda p: attention.scaled_dot_product_attention(q, q, q, dropout_p=p),
        "ffn": lambda p: ffn.ffn(x, w1, None, w2, None, dropout_p=p),
        "layer_norm": lambda p: layer_norm.dropout_add_layer_norm(x, x, None, None, dropout_p=p),
    }
    for name, call in calls.items():
        torch.manual_seed(0)
        got = call(p)
        torch.manual_seed(0)
        assert torch.equal(got, call(float(p))), name
    with pytest.raises(TypeError, match="dropout_p must be a float, got bool"):
        ffn.ffn(x, w1, None, w2, None, dropout_p=False)


@pytest.mark.parametrize(("op", "limit"), [("attention", 0.9923706), ("ffn", 0.9999105)])
def test_dropout_p_so_close_to_1_that_the_keep_rate_is_off_is_refused(op, limit):
    # The kept fraction is 1 - p only to the random numbers' resolution (attention: a 16-bit
    # threshold, 2**-17; the elementwise ops: float32 uniforms, 1.5 * 2**-24), and the output is
    # scaled by 1 / (1 - p): at attention's p = 0.99999 the mean output was 1.53x the input, at
    # the elementwise ops' 1 - 3e-8 nothing was kept. Refused past a 0.1% bias; accepted below.
    from fastformer.ops import attention, ffn

    x, w1, w2 = torch.randn(2, 4, 8), torch.randn(16, 8), torch.randn(8, 16)
    q = torch.randn(1, 2, 4, 8)
    call = {
        "attention": lambda p: attention.scaled_dot_product_attention(q, q, q, dropout_p=p),
        "ffn": lambda p: ffn.ffn(x, w1, None, w2, None, dropout_p=p),
    }[op]
    call(limit - 1e-6)
    worst = {"attention": 2.0**-17, "ffn": 1.5 * 2.0**-24}[op] / (1 - limit)
    assert 9e-4 < worst <= 1e-3  # the limit is where the bias bound reaches 0.1%
    for p in (limit + 1e-6, 1 - 3e-8):
        with pytest.raises(ValueError, match=r"dropout_p must be at most .*by more than 0.1%"):
            call(p)


def test_check_keep_mask_args_names_the_builder_and_the_argument():
    # The shared checks of the keep-mask builders (ffn, layer_norm, attention).
    p = rng.check_keep_mask_args("f", 2**64 - 1, {"rows": 0}, np.float32(0.5))
    assert p == 0.5 and type(p) is float
    with pytest.raises(ValueError, match=r"^f: rows must be an int >= 0, got -1$"):
        rng.check_keep_mask_args("f", 0, {"rows": -1}, 0.5)
    with pytest.raises(TypeError, match=r"^f: seed must be an int, got str$"):
        rng.check_keep_mask_args("f", "1", {}, 0.5)
    assert rng.check_keep_mask_args("f", 0, {}, 0.995) == 0.995  # the elementwise limit
    with pytest.raises(ValueError, match=r"^f: dropout_p must be at most 0.99237"):
        rng.check_keep_mask_args("f", 0, {}, 0.995, rng.ATTENTION_KEEP_ERROR)


def test_keep_mask_keeps_a_uniform_equal_to_p():
    # kept when uniform >= p: no test had a uniform exactly p, so '>' passed.
    offsets = torch.arange(256, dtype=torch.int64)
    u = rng.element_uniform(1234, offsets)
    i = int(torch.argmax(torch.where(u < 0.99, u, torch.zeros_like(u))))
    keep = rng.dropout_keep(1234, offsets, float(u[i]))
    assert bool(keep[i]) and torch.equal(keep, u >= u[i])


# --------------------------------------------------------------------------- independent checks


def _philox_random123(ctr: list[int], key: list[int]) -> list[int]:
    """Philox4x32-10 on Python ints as Random123's philox.h writes it (round, then key bump),
    with all four counter words: an implementation apart from fastformer's tensor one."""
    mask = 0xFFFFFFFF
    for i in range(10):
        if i:
            key = [(key[0] + 0x9E3779B9) & mask, (key[1] + 0xBB67AE85) & mask]
        p0, p1 = 0xD2511F53 * ctr[0], 0xCD9E8D57 * ctr[2]
        ctr = [(p1 >> 32) ^ ctr[1] ^ key[0], p1 & mask, (p0 >> 32) ^ ctr[3] ^ key[1], p0 & mask]
    return ctr


def test_philox_matches_random123_for_seeds_past_2_63():
    # Random123's known-answer vectors (kat_vectors: counter, key, output) vouch for the
    # implementation above; fastformer's then matches it for keys whose high word has its top
    # bit set (seeds >= 2**63, which the Triton and C++ comparisons, int64 seeds, never reach).
    kat = [
        ([0] * 4, [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
        ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
        (
            [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344],
            [0xA4093822, 0x299F31D0],
            [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1],
        ),
    ]
    for ctr, key, expected in kat:
        assert _philox_random123(ctr, key) == expected
    offsets = [0, 1, 2**32 - 1, 2**32, 2**63 - 1, -1, 123456789012345]
    for seed in (2**63, 2**63 + 2**32 + 5, 2**64 - 1, 0xA4093822_299F31D0 | 2**63):
        words = rng.philox4x32(seed, torch.tensor(offsets))
        for j, offset in enumerate(offsets):
            counter = [offset & 0xFFFFFFFF, (offset >> 32) & 0xFFFFFFFF, 0, 0]
            expected = _philox_random123(counter, [seed & 0xFFFFFFFF, seed >> 32])
            assert [int(w[j]) for w in words] == expected, (seed, offset)


def test_draw_seed_uses_all_63_bits():
    torch.manual_seed(0)
    seeds = [rng.draw_seed("cpu") for _ in range(64)]
    union = 0
    for s in seeds:
        assert 0 <= s < 2**63
        union |= s
    # 64 uniform draws leave a given bit unset with probability 2**-64
    assert union == 2**63 - 1


def test_seed_mixer_is_splitmix64():
    # splitmix64's outputs from the state 1234567 (Rosetta Code, "Pseudo-random numbers/
    # Splitmix64"): _mix64 is its step from the state before the increment.
    expected = [
        6457827717110365317,
        3203168211198807973,
        9817491932198370423,
        4593380528125082431,
        16408922859458223821,
    ]
    state = 1234567
    for value in expected:
        assert rng._mix64(state) == value
        state = (state + 0x9E3779B97F4A7C15) % 2**64


def test_cuda_seed_draw_spans_63_bits_and_mixes_seed_and_offset(monkeypatch):
    # No GPU: a stand-in for fastformer._C's advance gives torch's (seed, offset) pairs.
    pairs = iter([(base, offset) for base in (0, 1, 2**63 + 9) for offset in range(0, 96, 4)])
    monkeypatch.setattr(rng, "_compiled_philox_advance", lambda: lambda index, n: next(pairs))
    monkeypatch.setattr(rng, "capturing", lambda device: False)
    seeds = [rng.draw_seed(torch.device("cuda", 0)) for _ in range(72)]
    assert len(set(seeds)) == 72  # another base or another offset: another seed
    union = 0
    for s in seeds:
        assert 0 <= s < 2**63
        union |= s
    assert union == 2**63 - 1


def test_cuda_seed_draw_without_the_extension_moves_torch_s_offset_on_by_4(monkeypatch):
    # Without fastformer._C's CUDA kernels the draw reads torch's generator and sets its
    # offset itself; a stand-in generator, as no GPU is here.
    class Generator:
        offset = 40

        def initial_seed(self):
            return 77

        def get_offset(self):
            return self.offset

        def set_offset(self, offset):
            self.offset = offset

    gens = [Generator(), Generator()]
    monkeypatch.setattr(rng, "_compiled_philox_advance", lambda: None)
    monkeypatch.setattr(torch.cuda, "default_generators", gens)
    assert rng._cuda_philox_advance(1) == (77, 40)
    assert rng._cuda_philox_advance(1) == (77, 44)
    assert gens[1].offset == 48 and gens[0].offset == 40
