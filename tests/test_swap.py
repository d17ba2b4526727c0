"""fastformer.swap: replaces modules in place, shares every Parameter, keeps the state_dict keys
and the results (parity rule against an unswapped copy of the same model)."""

import copy
import importlib
import warnings

import pytest
import torch
from torch import nn

import fastformer.nn as fnn
from fastformer import reference
from fastformer.explain import explain
from fastformer.nn.attention import ReferenceMultiheadAttention
from fastformer.swap import SwapReport, swap
from fastformer.testing import assert_parity, compare_with_reference

# `import fastformer.swap as m` would give the function fastformer.swap, not the submodule.
swap_module = importlib.import_module("fastformer.swap")

pytestmark = [
    pytest.mark.filterwarnings("ignore:Support for mismatched:UserWarning"),
    pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning"),
]

E, H, FF, B, S, T = 16, 2, 32, 3, 7, 5


@pytest.fixture(autouse=True)
def torch_attention(monkeypatch):
    """The attention op's torch backend: the Triton interpreter is too slow for every test."""
    monkeypatch.setenv("FASTFORMER_BACKEND_ATTENTION", "torch")


def _model_parity(fast, ref, args, kwargs=None):
    """Parity rule for the output and every parameter gradient (args: no gradient)."""
    names = [n for n, _ in fast.named_parameters()]
    params = [p.detach().clone().requires_grad_() for _, p in fast.named_parameters()]

    def call(module):
        def fn(*flat):
            inputs, weights = flat[: len(args)], flat[len(args) :]
            return torch.func.functional_call(module, dict(zip(names, weights)), inputs, kwargs)

        return fn

    results = compare_with_reference(call(fast), call(ref), [*args, *params], names=names)
    assert len(results) == 1 + len(names)
    assert_parity(results)


def _perturb(model, seed=0):
    """Move every parameter off its init (LayerNorm 1/0, zero biases)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _padding(batch, length, seed=0):
    lengths = torch.randint(1, length + 1, (batch,), generator=torch.Generator().manual_seed(seed))
    lengths[0] = length
    return reference.padding_mask(lengths, length)


def _types(model):
    return {name: type(m) for name, m in model.named_modules()}


def test_swap_torch_transformer_in_place():
    model = _perturb(nn.Transformer(E, H, 2, 2, FF, dropout=0.0, batch_first=True))
    original = copy.deepcopy(model)
    params = list(model.parameters())
    modules = dict(model.named_modules())
    keys = list(model.state_dict())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    report = swap(model)

    assert isinstance(report, SwapReport) and report.left == []
    # 1 transformer + 2 stacks + 2 norms + 2 x (layer, attn, 2 norms) + 2 x (layer, 2 attn, 3 norms)
    assert len(report.replaced) == 25
    assert ("encoder.layers.1.self_attn", nn.MultiheadAttention, fnn.MultiheadAttention) in (
        report.replaced
    )
    assert all(p is q for p, q in zip(params, model.parameters()))
    assert len(params) == len(list(model.parameters()))
    assert all(m is modules[n] for n, m in model.named_modules())  # same module objects
    assert list(model.state_dict()) == keys
    assert isinstance(model.decoder.layers[1].norm3, fnn.LayerNorm)

    src, tgt = torch.randn(B, S, E), torch.randn(B, T, E)
    kpm = _padding(B, S)
    masks = dict(src_key_padding_mask=kpm, memory_key_padding_mask=kpm, tgt_is_causal=True)
    masks |= dict(tgt_mask=nn.Transformer.generate_square_subsequent_mask(T))
    _model_parity(model, original, (src, tgt), masks)

    before = [p.detach().clone() for p in params]
    model(src, tgt, **masks).square().mean().backward()
    optimizer.step()  # the optimizer made before the swap updates the swapped model
    assert all(not torch.equal(b, p) for b, p in zip(before, params) if p.grad is not None)
    assert optimizer.state[params[0]]["step"] == 1


def test_swap_reference_model():
    torch.manual_seed(0)
    model = reference.TransformerModel(13, 13, E, H, 1, 1, FF, dropout=0.0, share_embeddings=True)
    model = _perturb(model)
    original = copy.deepcopy(model)
    params = list(model.parameters())
    report = swap(model)
    kinds = {(old, new) for _, old, new in report.replaced}
    assert kinds == {
        (reference.MultiheadAttention, ReferenceMultiheadAttention),
        (reference.LayerNorm, fnn.LayerNorm),
        (reference.TransformerEncoderLayer, fnn.TransformerEncoderLayer),
        (reference.TransformerDecoderLayer, fnn.TransformerDecoderLayer),
    }
    assert all(p is q for p, q in zip(params, model.parameters()))
    assert isinstance(model.transformer.encoder.layers[0].self_attn, fnn.MultiheadAttention)

    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(2, 13, (B, S), generator=g), torch.randint(2, 13, (B, T), generator=g)
    src[1, -3:] = 0  # padding at the end (pad_id 0)
    _model_parity(model, original, (src, tgt))
    model.loss(src, tgt).backward()


def test_swapped_model_decoder_reads_no_causal_mask(monkeypatch):
    # The model's decoder passes is_causal alone (torch.nn's twin gets the mask it needs): the
    # swapped self-attention, which keeps the reference's causal-with-mask, would otherwise send
    # the (T, T) mask to the kernels, which then read it instead of skipping the future's tiles.
    from fastformer.nn import _ops

    calls = []
    sdpa = _ops._attention.scaled_dot_product_attention

    def record(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        calls.append((attn_mask is not None, is_causal))
        return sdpa(q, k, v, attn_mask, dropout_p, is_causal, **kw)

    monkeypatch.setattr(_ops._attention, "scaled_dot_product_attention", record)
    model = reference.TransformerModel(13, 13, E, H, 1, 1, FF, dropout=0.0)
    swap(model)
    g = torch.Generator().manual_seed(1)
    model(torch.randint(2, 13, (B, S), generator=g), torch.randint(2, 13, (B, T), generator=g))
    assert calls == [(False, False), (False, True), (False, False)]  # enc, dec self, cross


def test_model_with_another_decoder_gets_the_causal_mask():
    # Only the reference's own decoder takes is_causal alone; torch.nn's (here a subclass of
    # nn.Transformer, which an exact type check missed) raises without the mask.
    class Subclass(nn.Transformer):
        pass

    model = reference.TransformerModel(13, 13, E, H, 1, 1, FF, dropout=0.0)
    model.transformer = Subclass(E, H, 1, 1, FF, dropout=0.0, batch_first=True)
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(2, 13, (B, S), generator=g), torch.randint(2, 13, (B, T), generator=g)
    assert model(src, tgt).shape == (B, T, 13)


def _causal_bias(length, seed=0):
    """A float mask that is the causal mask plus a bias (ALiBi-style), not the causal mask."""
    g = torch.Generator().manual_seed(seed)
    blocked = torch.ones(length, length, dtype=torch.bool).triu(1)
    return torch.randn(length, length, generator=g).masked_fill(blocked, float("-inf"))


class _ReferenceSelfAttention(nn.Module):
    """A reference MultiheadAttention called as the reference allows: is_causal with a mask,
    need_weights left at its default (False: no weights)."""

    def __init__(self):
        super().__init__()
        self.attn = reference.MultiheadAttention(E, H, batch_first=True)

    def forward(self, x, attn_mask, key_padding_mask=None):
        out, weights = self.attn(x, x, x, key_padding_mask, attn_mask=attn_mask, is_causal=True)
        if weights is not None:
            raise AssertionError("need_weights must default to False, as in the reference")
        return out


def _reference_case(kind, padding):
    """(reference module, inputs, masks): is_causal with a causal-plus-bias float mask."""
    g = torch.Generator().manual_seed(2)
    x, memory = torch.randn(B, T, E, generator=g), torch.randn(B, S, E, generator=g)
    kpm = _padding(B, T, seed=3) if padding else None
    if kind == "attention":
        return (
            _ReferenceSelfAttention(),
            (x,),
            dict(attn_mask=_causal_bias(T), key_padding_mask=kpm),
        )
    layer_args = (E, H, FF, 0.0, "relu", 1e-5, True)
    if kind == "encoder_layer":
        masks = dict(src_mask=_causal_bias(T), src_key_padding_mask=kpm, is_causal=True)
        return reference.TransformerEncoderLayer(*layer_args), (x,), masks
    masks = dict(tgt_mask=_causal_bias(T), tgt_key_padding_mask=kpm, tgt_is_causal=True)
    masks |= dict(memory_mask=torch.randn(T, S, generator=g), memory_is_causal=True)
    return reference.TransformerDecoderLayer(*layer_args), (x, memory), masks


@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("kind", ["attention", "encoder_layer", "decoder_layer"])
def test_swapped_reference_modules_keep_is_causal_with_a_mask(kind, padding):
    """The reference applies is_causal together with the mask; the swapped modules must too
    (torch.nn's hint would drop the mask, or is_causal), and keep need_weights=False."""
    model, args, masks = _reference_case(kind, padding)
    model = _perturb(model)
    original = copy.deepcopy(model)
    swap(model)
    assert not any(isinstance(m, reference.MultiheadAttention) for m in model.modules())
    _model_parity(model, original, args, masks)


@pytest.mark.parametrize("case", ["causal_with_mask", "row_without_keys"])
def test_swapped_reference_attention_weights_match_the_reference(case):
    """need_weights=True leaves the fused path: it must still compute the reference's function.
    torch.nn's drops is_causal or the mask (a bias without the causal mask here, so that
    dropping either changes the result), and gave NaN weights and output to a row whose every
    key is masked, where the reference gives 0."""
    original = _perturb(reference.MultiheadAttention(E, H, batch_first=True))
    model = copy.deepcopy(original)
    swap(model)
    x, mask = torch.randn(B, T, E), torch.randn(T, T)
    kw = dict(attn_mask=mask, is_causal=True, need_weights=True)
    if case == "row_without_keys":
        mask = torch.zeros(T, T, dtype=torch.bool)
        mask[1] = True  # True = not allowed: row 1 sees no key
        kw = dict(attn_mask=mask, need_weights=True)
    expected = original(x, x, x, **kw)
    got = model(x, x, x, **kw)
    assert "MultiheadAttention -> the reference" in explain(model, x, x, x, **kw)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


class HandWritten(nn.Module):
    """A model written with torch.nn pieces, not nn.Transformer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, E)
        self.attn = nn.MultiheadAttention(E, H, batch_first=True)
        self.norm = nn.LayerNorm(E)
        self.cross = nn.MultiheadAttention(E, H, kdim=12, vdim=12, batch_first=True)
        self.head = nn.Sequential(nn.RMSNorm(E), nn.Linear(E, 4))

    def forward(self, x, memory, kpm):
        h = self.embed(x)
        h = self.norm(h + self.attn(h, h, h, key_padding_mask=kpm, need_weights=False)[0])
        h = h + self.cross(h, memory, memory, need_weights=False)[0]
        return self.head(h)


def test_swap_hand_written_model():
    model = _perturb(HandWritten())
    original = copy.deepcopy(model)
    report = swap(model)
    assert [name for name, _, _ in report.replaced] == ["attn", "norm", "cross", "head.0"]
    assert type(model.embed) is nn.Linear
    args = (torch.randn(B, S, 8), torch.randn(B, T, 12), _padding(B, S))
    _model_parity(model, original, args)
    text = explain(model, *args)
    assert "attn (MultiheadAttention)" in text and "attention ->" in text, text


def test_include_by_class_is_exact_and_bad_arguments_are_refused():
    # A class matched by its name: include=[reference.LayerNorm] also swapped torch.nn's
    # LayerNorm. And include="LayerNorm" iterated as letters: nothing swapped, no error.
    model = nn.Sequential(nn.LayerNorm(E), reference.LayerNorm(E))
    report = swap(model, include=[reference.LayerNorm])
    assert [name for name, _, _ in report.replaced] == ["1"]
    assert type(model[0]) is nn.LayerNorm
    with pytest.raises(TypeError, match=r"include must be a list of classes or names, got 'Lay"):
        swap(model, include="LayerNorm")
    with pytest.raises(TypeError, match="exclude items must be classes or names, got int"):
        swap(model, exclude=[3])
    with pytest.raises(TypeError, match="model must be an nn.Module, got str"):
        swap("model")
    with pytest.raises(TypeError, match="module must be an nn.Module, got str"):
        explain("model", torch.randn(2, E))


def test_include_and_exclude():
    model = nn.Transformer(E, H, 1, 1, FF)
    report = swap(model, include=["MultiheadAttention"])
    assert {new for _, _, new in report.replaced} == {fnn.MultiheadAttention}
    assert ("encoder.norm", nn.LayerNorm, "not selected by include") in report.left
    assert type(model.encoder.layers[0]) is nn.TransformerEncoderLayer

    model = nn.Transformer(E, H, 1, 1, FF)
    report = swap(model, exclude=["decoder*", nn.LayerNorm])
    replaced = {name for name, _, _ in report.replaced}
    assert "encoder.layers.0.self_attn" in replaced and "encoder.layers.0" in replaced
    assert not any(name.startswith("decoder") or "norm" in name for name in replaced)
    assert type(model.decoder.layers[0].self_attn) is nn.MultiheadAttention
    assert ("encoder.norm", nn.LayerNorm, "excluded by exclude") in report.left
    # An excluded norm keeps torch's computation too: the swapped layer fused it before.
    text = explain(model.encoder.layers[0], torch.randn(S, B, E))
    assert "attention ->" in text and "ffn ->" in text, text
    assert "dropout_add_layer_norm -> eager (x2)" in text, text
    assert "torch.nn.modules.normalization.LayerNorm is not fastformer's" in text, text


def test_subclasses_are_left_with_a_reason():
    class MyNorm(nn.LayerNorm):
        def forward(self, x):
            return super().forward(x) * 2

    model = nn.Sequential(MyNorm(E), nn.LayerNorm(E))
    report = swap(model)
    assert [name for name, _, _ in report.replaced] == ["1"]
    ((name, kind, reason),) = report.left
    assert name == "0" and kind is MyNorm and "subclass of torch.nn.LayerNorm" in reason
    assert type(model[0]) is MyNorm


class MyNorm(nn.LayerNorm):
    pass


def test_include_or_exclude_items_that_select_nothing_warn():
    # A misspelled name swapped nothing (or everything) without a word.
    model = nn.Transformer(E, H, 1, 1, FF)
    with pytest.warns(UserWarning, match="include item 'LayerNrom' matches none") as seen:
        report = swap(model, include=["LayerNrom", "encoder.*"], exclude=[nn.RMSNorm])
    assert "exclude item torch.nn.RMSNorm matches none" in str(seen[1].message)
    assert len(seen) == 2 and seen[0].filename == __file__  # the caller's line
    assert type(model.encoder.layers[0]) is fnn.TransformerEncoderLayer and report.replaced
    with warnings.catch_warnings():  # swapped modules and subclasses are selected too
        warnings.simplefilter("error")
        swap(model, include=["encoder.*", "LayerNorm"])
        swap(nn.Sequential(MyNorm(E)), exclude=[MyNorm])


def test_torchscript_and_parametrized_modules_are_refused_or_left_with_a_reason():
    # They were left silently ("replaced 0, left 0"): the user thought the swap had worked.
    scripted = torch.jit.script(nn.Sequential(nn.LayerNorm(E)))
    with pytest.raises(TypeError, match="model is a TorchScript module"):
        swap(scripted)
    x = torch.randn(S, B, E)
    model = nn.Sequential(
        torch.jit.trace(nn.TransformerEncoderLayer(E, H, FF, dropout=0.0), x),
        nn.LayerNorm(E),
        nn.LayerNorm(E),
    )
    torch.nn.utils.parametrize.register_parametrization(model[2], "weight", nn.Identity())
    report = swap(model)
    assert [name for name, _, _ in report.replaced] == ["1"]
    reasons = {name: reason for name, _, reason in report.left}
    assert reasons["0"].startswith("TorchScript (scripted or traced)"), reasons
    assert reasons["2"].startswith("parametrized (torch.nn.utils.parametrize"), reasons


def test_modules_whose_instance_replaces_a_method_are_left_with_a_reason():
    # torch.nn's forward calls self._ff_block; the fastformer forward does not, so a patched
    # instance lost its patch (silently different outputs).
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0)
    original = layer._ff_block
    layer._ff_block = lambda x: 0.0 * original(x)
    x = torch.randn(S, B, E)
    want = layer(x)
    report = swap(nn.Sequential(layer))
    ((name, kind, reason),) = report.left
    assert kind is nn.TransformerEncoderLayer and "['_ff_block']" in reason, reason
    assert type(layer) is nn.TransformerEncoderLayer
    torch.testing.assert_close(layer(x), want)


def test_swap_twice_is_a_no_op_and_report_prints():
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, FF), 2, nn.LayerNorm(E))
    report = swap(model)
    text = str(report)
    assert "replaced 10" in text
    assert "layers.0.self_attn" in text
    assert "torch.nn.MultiheadAttention" in text and "fastformer.nn.MultiheadAttention" in text
    again = swap(model)
    assert again.replaced == [] and again.left == []


def test_failed_state_dict_check_undoes_the_swap(monkeypatch):
    class Renamed(fnn.LayerNorm):
        def _save_to_state_dict(self, destination, prefix, keep_vars):
            super()._save_to_state_dict(destination, prefix + "renamed_", keep_vars)

    monkeypatch.setitem(swap_module._FROM_TORCH, nn.LayerNorm, Renamed)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, FF), 1, nn.LayerNorm(E))
    before = _types(model)
    with pytest.raises(RuntimeError, match="state_dict keys"):
        swap(model)
    assert _types(model) == before


def test_swapped_layers_run_the_fused_ops():
    model = nn.TransformerEncoderLayer(E, H, FF, batch_first=True)
    swap(model)
    text = explain(model, torch.randn(B, S, E))
    for call in ("attention ->", "dropout_add_layer_norm ->", "ffn ->"):
        assert call in text, text
    assert "torch.nn" not in text.split("\n", 1)[1], text


def test_package_level_swap_and_explain():
    """fastformer.swap / fastformer.explain are the functions, even after something imported
    the submodules of the same names (as this file does)."""
    import fastformer

    model = nn.Sequential(nn.LayerNorm(E))
    assert callable(fastformer.swap) and callable(fastformer.explain)
    assert fastformer.swap(model).replaced
    assert "layer_norm ->" in fastformer.explain(model, torch.randn(B, E))


def _hooked_calls(model, register, x):
    """Names of the sub-modules whose hooks ran in a forward and backward of `model` on `x`,
    with hooks installed by `register(model, record)`; also the output."""
    names = {m: n for n, m in model.named_modules()}
    seen = []

    def record(module, *args):
        seen.append(names.get(module, "?"))

    handles = register(model, record)
    try:
        out = model(x)
        out.sum().backward()
    finally:
        for h in handles:
            h.remove()
    return sorted(seen), out


def _own_hooks(model, record):
    return [
        model.linear1.register_forward_hook(record),
        model.dropout.register_forward_pre_hook(record),
        model.norm2.register_full_backward_hook(record),
        model.dropout1.register_full_backward_pre_hook(record),
    ]


def _global_forward_hook(model, record):
    return [nn.modules.module.register_module_forward_hook(record)]


def _global_backward_hook(model, record):
    return [nn.modules.module.register_module_full_backward_hook(record)]


def _global_backward_pre_hook(model, record):
    return [nn.modules.module.register_module_full_backward_pre_hook(record)]


@pytest.mark.parametrize(
    "register",
    [_own_hooks, _global_forward_hook, _global_backward_hook, _global_backward_pre_hook],
)
def test_hooks_of_sub_modules_run_as_in_torch_nn(register):
    """A sub-module the fused ops stand for (linear1, dropout, norm2, dropout1) still runs the
    hooks attached to it, its own or global ones (profilers register those): with hooks the
    layer runs those sub-modules, with the same results."""
    torch.manual_seed(0)
    ref = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True)
    fast = copy.deepcopy(ref)
    swap(fast)
    x = torch.randn(B, S, E, requires_grad=True)
    want, ref_out = _hooked_calls(ref, register, x)
    got, fast_out = _hooked_calls(fast, register, x)
    assert want and got == want
    torch.testing.assert_close(fast_out, ref_out)
    handles = register(fast, lambda *args: None)
    try:
        hooked = explain(fast, x)
    finally:
        for h in handles:
            h.remove()
    assert "ffn -> eager" in hooked and "without hooks" in hooked, hooked
    assert "ffn -> eager" not in explain(fast, x)  # hooks removed: fused again


@pytest.mark.parametrize("layer_cls", [nn.TransformerEncoderLayer, nn.TransformerDecoderLayer])
def test_hooks_of_the_activation_module_run_as_in_torch_nn(layer_cls):
    # nn.GELU() is the child module `activation`: the fused FFN skipped its hooks.
    ref, fast = (layer_cls(E, H, FF, dropout=0.0, activation=nn.GELU()) for _ in range(2))
    fast.load_state_dict(ref.state_dict())  # (deepcopy: torch's decoder layer loses nn.GELU)
    swap(fast)
    for layer in (ref, fast):
        layer.activation.register_forward_hook(lambda module, args, out: out * 0)
    x, memory = torch.randn(S, B, E), torch.randn(S + 1, B, E)
    extra = (memory,) if layer_cls is nn.TransformerDecoderLayer else ()
    torch.testing.assert_close(fast(x, *extra), ref(x, *extra))
    assert "activation GELU runs hooks" in fast.fallback_reasons[0]


def test_swapped_reference_attention_calls_its_out_proj():
    # The reference's attention calls out_proj as a module (torch.nn's reads its weight): the
    # swapped one ran F.linear on out_proj's weight, so out_proj's hooks never ran and a pruned
    # out_proj used a stale weight (a no-grad forward off by 0.5; training it raised).
    from torch.nn.utils import prune

    layers = []
    for swapped in (False, True):
        torch.manual_seed(0)
        layer = reference.TransformerEncoderLayer(E, H, FF, 0.0, batch_first=False)
        prune.l1_unstructured(layer.self_attn.out_proj, "weight", 0.5)
        calls = []
        layer.self_attn.out_proj.register_forward_hook(
            lambda module, args, out, calls=calls: calls.append(tuple(args[0].shape))
        )
        if swapped:
            swap(layer)
        layers.append((layer, calls))
    x = torch.randn(S, B, E)
    outs = []
    for layer, calls in layers:
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
        for _ in range(2):  # the pruned weight follows weight_orig through training
            optimizer.zero_grad()
            layer(x).square().mean().backward()
            optimizer.step()
        with torch.no_grad():
            layer.self_attn.out_proj.weight_orig.mul_(2.0)
            outs.append(layer(x))
        assert calls == [(B, S, E)] * 3  # batch first, as the reference calls it
    assert isinstance(layers[1][0].self_attn, ReferenceMultiheadAttention)
    torch.testing.assert_close(outs[1], outs[0])


def test_inference_mode_and_torch_export():
    """A swapped model runs under torch.inference_mode, and torch.export keeps its ops as the
    fastformer custom ops; both give the torch.nn model's outputs."""
    torch.manual_seed(0)
    ref = nn.Transformer(E, H, 1, 1, FF, dropout=0.0, batch_first=True).eval()
    fast = copy.deepcopy(ref)
    swap(fast)
    src, tgt = torch.randn(B, S, E), torch.randn(B, T, E)
    kwargs = {"tgt_mask": nn.Transformer.generate_square_subsequent_mask(T)}
    with torch.inference_mode():
        want = ref(src, tgt, **kwargs)
        got = fast(src, tgt, **kwargs)
    torch.testing.assert_close(got, want)
    exported = torch.export.export(fast, (src, tgt), kwargs)
    ops = {str(n.target) for n in exported.graph.nodes if "fastformer" in str(n.target)}
    assert {"fastformer.attention.default", "fastformer.layer_norm.default"} <= ops, ops
    assert "fastformer.ffn.default" in ops, ops
    torch.testing.assert_close(exported.module()(src, tgt, **kwargs), want)


def test_torch_export_of_a_training_layer_with_an_unbounded_sequence_dim():
    # The attention check of dropout's counter range (seq_q * calls(seq_k) < 2**32) put a guard
    # on the symbolic sizes; export's solver failed on it for an unbounded Dim ("Cannot create
    # Dim with inconsistent min=1, max=-oo"), where torch.nn's layer exports.
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, FF, dropout=0.1, batch_first=True)
    swap(layer)
    seq = torch.export.Dim("seq")
    exported = torch.export.export(layer, (torch.randn(B, S, E),), dynamic_shapes=({1: seq},))
    x = torch.randn(B, 3 * S, E)
    outs = []
    for module in (exported.module(), layer):
        torch.manual_seed(1)
        outs.append(module(x))
    torch.testing.assert_close(outs[0], outs[1])


@pytest.mark.parametrize("backend", ["default", "torch"])
def test_ops_ignore_the_default_device(monkeypatch, backend):
    # Under `with torch.device(...)` / torch.set_default_device, tensors the ops made without a
    # device (the host seed draw, seed scalars, the torch backend's masks) landed there: a
    # dropout call raised "item() cannot be called on meta tensors" (on a GPU machine with
    # default device cuda, draws would have gone to the wrong generator and device).
    if backend == "torch":
        monkeypatch.setenv("FASTFORMER_BACKEND_ATTENTION", "torch")
        monkeypatch.setenv("FASTFORMER_BACKEND_LAYER_NORM", "torch")
        monkeypatch.setenv("FASTFORMER_BACKEND_FFN", "torch")
    torch.manual_seed(0)
    model = nn.Transformer(E, H, 1, 1, FF, dropout=0.1, batch_first=True)
    swap(model)
    src, tgt = torch.randn(B, S, E), torch.randn(B, T, E)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, 3:] = True
    kwargs = {"src_key_padding_mask": pad, "tgt_is_causal": True}
    kwargs["tgt_mask"] = nn.Transformer.generate_square_subsequent_mask(T, device="cpu")
    runs = []
    for default in ("cpu", "meta"):
        with torch.device(default):
            torch.manual_seed(1)
            out = model(src, tgt, **kwargs)
            grads = torch.autograd.grad(out.square().sum(), list(model.parameters()))
        runs.append((out, grads))
    (want, want_grads), (got, got_grads) = runs
    assert got.device.type == "cpu"
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_every_tensor_factory_in_the_ops_names_its_device():
    # The test above covers the paths a model takes; this holds the rule for the others (a
    # new torch.zeros(...) without device= would follow the default device).
    import ast
    import pathlib

    import fastformer.kernels

    root = pathlib.Path(fastformer.ops.__file__).parent.parent  # (kernels: mapped elsewhere)
    kernels = pathlib.Path(fastformer.kernels.__file__).parent
    factories = {"arange", "empty", "full", "ones", "rand", "randint", "randn", "tensor", "zeros"}
    missing = []
    paths = [*root.glob("ops/*.py"), *root.glob("nn/*.py"), root / "testing.py"]
    paths += kernels.glob("*.py")
    assert len(paths) > 10 and root / "ops" / "attention.py" in paths, paths
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            func = node.func
            if isinstance(func.value, ast.Name) and func.value.id == "torch":
                keywords = {k.arg for k in node.keywords}
                if func.attr in factories and not keywords & {"device", None}:
                    missing.append(f"{path.name}:{node.lineno} torch.{func.attr}")
    assert not missing, missing


@pytest.mark.parametrize(
    "make",
    [
        lambda: reference.LayerNorm(E, bias=False),
        lambda: reference.LayerNorm(E, elementwise_affine=False),
        lambda: reference.RMSNorm(E),
        lambda: reference.RMSNorm(E, eps=1e-3, elementwise_affine=False),
    ],
    ids=["layer_norm_no_bias", "layer_norm_no_affine", "rms_norm", "rms_norm_no_affine"],
)
def test_every_reference_norm_is_swapped(make):
    # Only the reference's LayerNorm with a bias was swapped by a test: its RMSNorm could have
    # been left out of the table, and a bias-free LayerNorm left with "parameters differ".
    model = _perturb(nn.Sequential(make()))
    original = copy.deepcopy(model)
    report = swap(model)
    assert report.left == [] and len(report.replaced) == 1, str(report)
    assert type(model[0]) in (fnn.LayerNorm, fnn.RMSNorm)
    _model_parity(model, original, (torch.randn(B, S, E) * 3 + 1,))


def test_swapped_reference_attention_has_torch_nn_s_attributes():
    # A swapped reference attention is a torch.nn.MultiheadAttention: the attributes and the
    # empty parameter slots torch's has (q/k/v_proj_weight None, kdim, ...) must be there for
    # code that reads them.
    model = nn.Sequential(reference.MultiheadAttention(E, H, batch_first=True))
    swap(model)
    mha, theirs = model[0], nn.MultiheadAttention(E, H, batch_first=True)
    assert isinstance(mha, nn.MultiheadAttention)
    assert mha._parameters.keys() == theirs._parameters.keys()
    for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight", "bias_k", "bias_v"):
        assert getattr(mha, name) is None, name
    assert (mha.kdim, mha.vdim, mha._qkv_same_embed_dim, mha.add_zero_attn) == (E, E, True, False)


def test_a_class_item_selects_its_exact_class_only():
    # include=[nn.Module], a base of every kind, selects nothing (isinstance would select all).
    model = nn.Sequential(nn.LayerNorm(E))
    with pytest.warns(UserWarning, match="include item torch.nn.Module matches none"):
        report = swap(model, include=[nn.Module])
    assert report.replaced == [] and type(model[0]) is nn.LayerNorm
