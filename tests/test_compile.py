"""torch.compile(fullgraph=True) of fastformer modules and of swapped models: no graph break
(fullgraph raises on one), the same results as eager, dropout seeds drawn at run time.

Inductor is slow to compile on a 2-core CPU: one inductor test per kind (a fastformer layer, a
swapped model); the rest use backend="aot_eager", which traces the same graphs (dynamo + AOT
autograd) and runs them eagerly.
"""

import copy

import pytest
import torch
from torch import nn

import fastformer.nn as fnn
from fastformer import reference
from fastformer.swap import swap

pytestmark = [
    pytest.mark.filterwarnings("ignore:Support for mismatched:UserWarning"),
    pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning"),
]

E, H, FF, B, S, T = 16, 2, 32, 3, 7, 5
TOL = dict(atol=2e-5, rtol=2e-5)


@pytest.fixture(autouse=True)
def fresh_dynamo(monkeypatch):
    """Each test compiles from scratch, on the attention op's torch backend (the Triton
    interpreter is for test_nn's Triton test)."""
    monkeypatch.setenv("FASTFORMER_BACKEND_ATTENTION", "torch")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _padding(batch, length, seed=0):
    lengths = torch.randint(1, length + 1, (batch,), generator=torch.Generator().manual_seed(seed))
    lengths[0] = length
    return reference.padding_mask(lengths, length)


def _run(model, args, kwargs):
    """Output and the gradients of every parameter and of the args that require grad."""
    model.zero_grad(set_to_none=True)
    leaves = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    out = model(*leaves, **kwargs)
    out.square().mean().backward()
    grads = [p.grad for p in model.parameters()] + [a.grad for a in leaves if a.requires_grad]
    return out.detach(), grads


def _assert_same_as_eager(model, args, kwargs=None, backend="aot_eager"):
    kwargs = kwargs or {}
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    out_c, grads_c = _run(compiled, args, kwargs)
    out_e, grads_e = _run(model, args, kwargs)
    torch.testing.assert_close(out_c, out_e, **TOL)
    assert len(grads_c) == len(grads_e)
    for g_c, g_e in zip(grads_c, grads_e):
        torch.testing.assert_close(g_c, g_e, **TOL)
    return compiled


def _transformer_inputs(batch_first):
    def seq(length, seed):
        shape = (B, length, E) if batch_first else (length, B, E)
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).requires_grad_()

    kpm = _padding(B, S)
    masks = dict(src_key_padding_mask=kpm, memory_key_padding_mask=kpm, tgt_is_causal=True)
    masks |= dict(tgt_mask=nn.Transformer.generate_square_subsequent_mask(T))
    return (seq(S, 1), seq(T, 2)), masks


def test_inductor_fastformer_layer():
    layer = fnn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True)
    x = torch.randn(B, S, E, requires_grad=True)
    _assert_same_as_eager(layer, (x,), dict(src_key_padding_mask=_padding(B, S)), "inductor")


def test_inductor_swapped_model():
    model = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, norm_first=True), 1, nn.LayerNorm(E)
    )
    swap(model)
    x = torch.randn(S, B, E, requires_grad=True)
    mask = nn.Transformer.generate_square_subsequent_mask(S)
    _assert_same_as_eager(model, (x,), dict(mask=mask, is_causal=True), "inductor")


@pytest.mark.parametrize("norm_first", [False, True])
def test_fastformer_transformer(norm_first):
    model = fnn.Transformer(E, H, 1, 1, FF, dropout=0.0, norm_first=norm_first)
    args, masks = _transformer_inputs(batch_first=False)
    compiled = _assert_same_as_eager(model, args, masks)
    src = torch.randn(S + 4, B, E)  # another length: recompiles (dynamic shapes), no break
    kpm = _padding(B, S + 4)
    out = compiled(src, args[1], src_key_padding_mask=kpm, memory_key_padding_mask=kpm)
    expected = model(src, args[1], src_key_padding_mask=kpm, memory_key_padding_mask=kpm)
    torch.testing.assert_close(out, expected, **TOL)


def test_swapped_torch_transformer():
    model = nn.Transformer(E, H, 1, 1, FF, dropout=0.0, batch_first=True)
    original = copy.deepcopy(model)
    swap(model)
    args, masks = _transformer_inputs(batch_first=True)
    _assert_same_as_eager(model, args, masks)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(*args, **masks), original(*args, **masks), **TOL)


def test_swapped_reference_model():
    model = reference.TransformerModel(11, 13, E, H, 1, 1, FF, dropout=0.0)
    swap(model)
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(2, 11, (B, S), generator=g), torch.randint(2, 13, (B, T), generator=g)
    src[1, -3:] = 0
    compiled = torch.compile(model.loss, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(src, tgt), model.loss(src, tgt), **TOL)


def test_multihead_attention_masks_and_projections():
    mha = fnn.MultiheadAttention(E, H, kdim=12, vdim=10)
    q = torch.randn(T, B, E, requires_grad=True)
    k, v = torch.randn(S, B, 12, requires_grad=True), torch.randn(S, B, 10, requires_grad=True)
    mask = torch.rand(B * H, T, S) > 0.7
    mask[..., 0] = False
    kwargs = dict(key_padding_mask=torch.randn(B, S), attn_mask=mask, need_weights=False)

    class First(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = mha

        def forward(self, q, k, v, **kw):
            return self.mha(q, k, v, **kw)[0]

    _assert_same_as_eager(First(), (q, k, v), kwargs)


@pytest.mark.parametrize("norm_first", [False, True])
def test_dropout_seeds_are_drawn_at_run_time(norm_first):
    layer = fnn.TransformerEncoderLayer(E, H, FF, dropout=0.3, norm_first=norm_first)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = torch.randn(S, B, E)

    def run(fn, seed):
        torch.manual_seed(seed)
        return fn(x, is_causal=True)

    first, again, other = run(compiled, 0), run(compiled, 0), run(compiled, 1)
    torch.testing.assert_close(first, again, atol=0, rtol=0)
    assert (first - other).abs().max() > 1e-3  # not a seed baked into the graph
    torch.testing.assert_close(first, run(layer, 0), **TOL)  # the same draws as eager


def test_checkpointed_dropout_keeps_its_masks_in_the_compiled_backward():
    # The partitioner recomputed the checkpointed ops in the backward, where they drew a new
    # seed: other dropout masks, gradients off by O(1) (1e2 on this layer) without a word. The
    # seed-drawing ops are tagged nondeterministic_seeded: their outputs are kept instead.
    from torch.utils.checkpoint import checkpoint

    layer = fnn.TransformerEncoderLayer(E, H, FF, dropout=0.5)
    x = torch.randn(S, B, E)

    def grads(fn):
        xi = x.clone().requires_grad_()
        torch.manual_seed(9)
        out = fn(xi)
        (out * torch.arange(out.numel()).view_as(out)).sum().backward()
        return out.detach(), xi.grad

    plain = grads(layer)
    ckpt = torch.compile(
        lambda t: checkpoint(layer, t, use_reentrant=False), fullgraph=True, backend="aot_eager"
    )
    for got, want in zip(grads(ckpt), plain):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("activation", ["swiglu", "gelu_tanh", torch.tanh])
def test_feed_forward_fused_and_unfused(activation):
    ff = fnn.FeedForward(E, FF, dropout=0.0, activation=activation)
    _assert_same_as_eager(ff, (torch.randn(B, S, E, requires_grad=True),))


def test_layer_norm_of_a_transposed_input_under_inductor():
    # The fake kernels gave their outputs x's strides, where the kernels return contiguous
    # ones: inductor's stride check failed at run time ("expected ... stride 24==8").
    class Transposed(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = fnn.LayerNorm(E)

        def forward(self, x):
            return self.norm(x.transpose(0, 1)).view(-1, E)  # a view of a contiguous output

    _assert_same_as_eager(
        Transposed(), (torch.randn(B, S, E, requires_grad=True),), backend="inductor"
    )


def test_dynamic_shapes_compile_one_graph():
    # dynamic=True made eps a SymFloat, and math.isfinite on it broke the graph (an error
    # under fullgraph) in every module with a LayerNorm.
    from torch._dynamo.utils import counters

    layer = fnn.TransformerEncoderLayer(E, H, FF, 0.0, batch_first=True)
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend="aot_eager")
    counters.clear()
    for length in (S, S + 4):
        x = torch.randn(B, length, E)
        torch.testing.assert_close(compiled(x), layer(x), **TOL)
    assert counters["stats"]["unique_graphs"] == 1


def test_attention_head_dims_share_one_dynamic_graph():
    # The default scale 1 / sqrt(D), resolved before the op, was a guard on D: one graph per
    # head dim. Gradients too: the backward op resolves the scale the forward saved as None.
    from torch._dynamo.utils import counters

    from fastformer import scaled_dot_product_attention

    def attend(q, k, v):
        return scaled_dot_product_attention(q, k, v, is_causal=True)

    compiled = torch.compile(attend, fullgraph=True, dynamic=True, backend="aot_eager")
    counters.clear()
    for head_dim in (8, 12, 16):
        q = torch.randn(B, H, S, head_dim, requires_grad=True)
        k, v = torch.randn(2, B, H, S + 2, head_dim)
        expected = reference.scaled_dot_product_attention(q, k, v, is_causal=True)
        (grad_expected,) = torch.autograd.grad(expected.square().sum(), q)
        out = compiled(q, k, v)
        (grad,) = torch.autograd.grad(out.square().sum(), q)
        torch.testing.assert_close(out, expected, **TOL)
        torch.testing.assert_close(grad, grad_expected, **TOL)
    assert counters["stats"]["unique_graphs"] == 1


def _transform_cases(dropout_p: float):
    from fastformer.ops.attention import scaled_dot_product_attention
    from fastformer.ops.ffn import ffn
    from fastformer.ops.layer_norm import dropout_add_layer_norm, layer_norm

    w1, b1, w2 = torch.randn(12, E), torch.randn(12), torch.randn(E, 12)
    w, r = torch.randn(E), torch.randn(B, H, S, E)
    p = dropout_p
    return {
        "layer_norm": lambda x: layer_norm(x, (E,), w, None),
        "dropout_add_layer_norm": lambda x: dropout_add_layer_norm(x, r, w, None, 1e-5, p),
        "ffn": lambda x: ffn(x, w1, b1, w2, None, "gelu", p),
        "attention": lambda x: scaled_dot_product_attention(x, x, x, dropout_p=p, is_causal=True),
    }


def _transforms(fn):
    def loss(x):
        return fn(x).square().sum()

    return {
        "jvp": lambda x, t: torch.func.jvp(fn, (x,), (t,)),
        "grad": lambda x, t: torch.func.grad(loss)(x),
        "jacrev": lambda x, t: torch.func.jacrev(loss)(x),
        "vmap_grad": lambda x, t: torch.vmap(torch.func.grad(loss))(torch.stack([x, t])),
    }


@pytest.mark.parametrize("transform", ["jvp", "grad", "jacrev", "vmap_grad"])
@pytest.mark.parametrize("op", ["layer_norm", "dropout_add_layer_norm", "ffn", "attention"])
def test_compiled_transforms_match_eager(op, transform):
    # Compiled, the ops ran their custom ops under a torch.func transform: jvp's tangents came
    # out zero, silently (no forward-mode rule), and grad, jacrev and vmap refused them
    # (autograd.Function without setup_context). Dynamo saw a transform never: the functorch
    # stack's peek is an object it wraps, never None. Dropout (not under vmap: eager refuses
    # randomness="different" and compiled refuses "error" and "same"): the compiled mask's seed
    # is drawn at run time, the same draw as eager's after the same manual_seed.
    p = 0.0 if transform == "vmap_grad" else 0.3
    fn = _transforms(_transform_cases(p)[op])[transform]
    # (B, H, S, E) for attention too. Not views of one tensor: forward AD of a view under
    # jvp fails on such inputs (AOT autograd; a torch INTERNAL ASSERT with F.linear alone).
    x, t = torch.randn(B, H, S, E), torch.randn(B, H, S, E)
    torch.manual_seed(0)
    expected = fn(x, t)
    torch.manual_seed(0)
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(x, t)
    assert expected[-1].abs().max() > 0.1
    torch.testing.assert_close(got, expected, **TOL)
    torch.manual_seed(1)
    again = torch.compile(fn, fullgraph=True, backend="aot_eager")(x, t)
    assert (p == 0 or op == "layer_norm") == bool(torch.equal(again[-1], got[-1]))


@pytest.mark.parametrize("op", ["dropout_add_layer_norm", "ffn", "attention"])
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
def test_compiled_vmap_with_dropout_follows_randomness(op):
    # Compiled, each sample of a vmap draws its own mask (the mask's custom op has no vmap
    # rule): right for "different"; "error" did not raise and "same" gave different masks.
    fn = _transform_cases(0.5)[op]
    x = torch.randn(B, H, S, E).expand(2, B, H, S, E)

    def run(randomness):
        torch._dynamo.reset()
        return torch.compile(torch.vmap(fn, randomness=randomness), fullgraph=True,
                             backend="aot_eager")(x)  # fmt: skip

    out = run("different")
    assert not torch.equal(out[0], out[1])
    with pytest.raises(RuntimeError, match="randomness error mode"):
        run("error")
    with pytest.raises(RuntimeError, match="randomness='same'.* inside torch.compile"):
        run("same")


@pytest.mark.parametrize("device", ["cpu", "meta"])  # meta: the fakes check too
@pytest.mark.parametrize(
    "op, args, message",
    [
        ("attention", ((2, 3, 4), 5, 0.1), "query must be 4-D"),
        ("attention", ((1, 2, 3, 4), -1, 0.1), "seq_k must be >= 0"),
        ("attention", ((1, 2, 3, 4), 5, -1.0), r"dropout_p must be in \[0, 1\)"),
        ("ffn", ((3, 4), -2, 0.1), "d_ff must be >= 0"),
        ("ffn", ((3, 4), 5, 1.5), r"dropout_p must be in \[0, 1\)"),
    ],
)
def test_drawn_keep_mask_ops_check_their_inputs(device, op, args, message):
    # Public ops (torch.ops.fastformer.*): the fakes returned shapes, the kernels crashed or
    # dropped every element (p = 1.5).
    shape, size, p = args
    fn = getattr(torch.ops.fastformer, f"{op}_drawn_keep_mask")
    with pytest.raises(ValueError, match=message):
        fn(torch.empty(shape, device=device), size, p)


def test_global_module_hooks_added_after_compiling_run():
    # A fused layer that guards on global hooks runs a hook registered after compiling (it
    # recompiles, as torch.nn's layers compiled with Module.compile() do; torch.compile(model)
    # of torch.nn modules skips such guards and never runs the hook). Made a constant of the
    # trace (2026-12-02, one commit), a regional compile ignored an output-changing hook that
    # torch.nn's ran: outputs off by 1.3.
    layer = nn.TransformerEncoderLayer(E, H, FF, 0.0, batch_first=True)
    swap(layer)
    layer.compile(fullgraph=True, backend="aot_eager")
    x = torch.randn(B, S, E)
    layer(x)

    def shift(module, args, out):
        return out + 1 if isinstance(module, nn.Linear) else out

    hook = nn.modules.module.register_module_forward_hook(shift)
    try:
        got = layer(x)
        torch._dynamo.reset()
        with torch.compiler.set_stance("force_eager"):
            expected = layer(x)
    finally:
        hook.remove()
    torch.testing.assert_close(got, expected, **TOL)
    assert (got - layer(x)).abs().max() > 0.1


def test_explain_of_a_compiled_model_leaves_its_graph_alone():
    # explain traced the compiled model with its recording on: fullgraph raised, and without
    # it the broken graphs (4 a call of this Transformer) served every later call.
    from fastformer import explain

    model = nn.Transformer(E, H, 1, 1, FF, 0.0, batch_first=True)
    swap(model)
    runs = []

    def counting(gm, _):
        return lambda *args: runs.append(1) or gm(*args)

    compiled = torch.compile(model, fullgraph=True, backend=counting)
    src, tgt = torch.randn(B, S, E), torch.randn(B, T, E)
    compiled(src, tgt)
    text = explain(compiled, src, tgt)
    assert text.startswith("fastformer.explain(Transformer)") and "attention ->" in text, text
    runs.clear()
    compiled(src, tgt)
    assert len(runs) == 1
    # explain inside a compiled function runs eagerly (dynamo refused its set_stance)
    records = torch.compile(lambda x: len(explain(model, x, tgt).records), backend="aot_eager")
    assert records(src) > 0
    # A compiled child is named as the child, not "encoder._orig_mod.layers.0...".
    model.encoder = torch.compile(model.encoder, fullgraph=True, backend=counting)
    text = explain(model, src, tgt)
    assert "encoder.layers.0.self_attn (" in text and "_orig_mod" not in text, text
    # and runs eagerly: the recording neither broke the child's full graph nor stayed in it
    runs.clear()
    model(src, tgt)
    assert len(runs) == 1


def test_backend_choices_are_no_guard_of_a_compiled_graph():
    # The traced backend choice read the op's choice cache: dynamo guarded on the cache, and
    # each change to it (its first fill, a reset past its limit) compiled the graph again.
    from torch._dynamo.utils import counters

    from fastformer.ops import _dispatch

    norm = fnn.LayerNorm(E)
    compiled = torch.compile(norm, fullgraph=True, backend="aot_eager")
    x = torch.randn(B, S, E)
    counters.clear()
    for _ in range(2):
        compiled(x)
    _dispatch._CHOICES.clear()
    compiled(x)
    assert counters["stats"]["unique_graphs"] == 1


def test_value_gets_no_gradient_when_only_the_lse_is_used():
    # Eager calls give value None there (lse does not depend on it); the compiled op's autograd
    # got a zero cotangent for the unused output and returned a zero tensor, which AdamW's
    # weight decay and momentum then moved (0.17 after one step at lr 0.1, decay 0.5).
    from fastformer.ops.attention import scaled_dot_product_attention_with_lse

    q, k, v = (torch.randn(2, 2, 5, 8, requires_grad=True) for _ in range(3))

    def lse_only(q, k, v):
        return scaled_dot_product_attention_with_lse(q, k, v)[1]

    for fn in (lse_only, torch.compile(lse_only, backend="aot_eager", fullgraph=True)):
        dq, dk, dv = torch.autograd.grad(fn(q, k, v).sum(), (q, k, v), allow_unused=True)
        assert dv is None and dq is not None and dk is not None


@pytest.mark.cuda
@pytest.mark.timeout(150)  # inductor compiles a training and an inference graph
def test_reduce_overhead_keeps_the_step_in_cuda_graphs(monkeypatch):
    # Inductor's CUDA graphs refuse a graph holding CPU tensors (a skip, counted and logged) or
    # cut it there (partitions, printed for the GPU log): the ops' seed outputs were CPU
    # scalars. Captured dropout must draw anew each replay; eval must give the eager result.
    from torch._dynamo.utils import counters

    monkeypatch.delenv("FASTFORMER_BACKEND_ATTENTION")  # the Triton kernels on a GPU
    layer = fnn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True).cuda()
    x = torch.randn(4, 32, 64, device="cuda", requires_grad=True)
    kpm = _padding(4, 32).cuda()
    compiled = torch.compile(layer, mode="reduce-overhead")
    counters.clear()
    outs = []
    for _ in range(4):
        out = compiled(x, src_key_padding_mask=kpm)
        out.square().mean().backward()
        outs.append(out.detach().clone())  # cudagraph trees reuse the output's memory
    assert (outs[2] - outs[3]).abs().max() > 1e-3  # replays draw new masks
    assert all(p.grad.isfinite().all() for p in layer.parameters())
    layer.eval()
    with torch.no_grad():
        for _ in range(3):
            out = compiled(x, src_key_padding_mask=kpm).clone()
        expected = layer(x, src_key_padding_mask=kpm)  # (inductor fuses the rest: float32 sums)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    print("cudagraph partitions", counters["inductor"]["cudagraph_partitions"])
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


def test_compiled_ops_return_every_output_on_the_input_device():
    # Inductor's CUDA graphs (mode="reduce-overhead") take no CPU tensor: a CPU seed output
    # skipped a compiled graph's CUDA graphs, or cut it off in a partition returning the ops'
    # tuples. The fakes (what inductor plans with) on fake CUDA inputs, no GPU needed.
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = torch.ops.fastformer
    with FakeTensorMode():
        q = torch.empty(2, 2, 8, 16, device="cuda")
        x, w = torch.empty(4, 16, device="cuda"), torch.empty(16, device="cuda")
        w1, w2 = torch.empty(32, 16, device="cuda"), torch.empty(16, 32, device="cuda")
        calls = {
            "attention": ops.attention(q, q, q, None, None, 0.1, False, None, True),
            "layer_norm": ops.layer_norm(x, w, w, None, 1e-5, 0.1, False, True),
            "ffn": ops.ffn(x, w1, None, w2, None, "relu", 0.1, True),
        }
    for name, outputs in calls.items():
        devices = [t.device.type for t in outputs]
        assert devices == ["cuda"] * len(outputs), (name, devices)


def test_host_seed_reads_a_saved_seed_and_refuses_capture(monkeypatch):
    # The torch backends' backward builds the mask on the host: a compiled call's seed output
    # (on the device) is read there; inside capture it cannot be.
    from fastformer.ops import rng

    assert rng.host_seed(torch.tensor(12345), "attention") == 12345
    assert rng.host_seed(7, "ffn") == 7
    seed = rng.seed_output(99, torch.device("cpu"))
    assert rng.host_seed(seed, "ffn") == 99
    monkeypatch.setattr(rng, "capturing", lambda device: True)
    monkeypatch.setattr(rng, "saved_seed", lambda s: s)  # as a device seed stays a tensor
    with pytest.raises(RuntimeError, match="attention with dropout inside CUDA graph capture"):
        rng.host_seed(seed, "attention")
