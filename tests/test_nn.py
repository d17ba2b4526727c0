"""fastformer.nn against torch.nn and fastformer.reference.

Every comparison shares the weights (same state_dict) and applies the parity rule of
fastformer.testing to the outputs, the input gradients and every parameter gradient: the
torch.nn (or reference) module run in float64 is the truth, the same module in float32 sets the
error budget. Most tests force the attention op's "torch" backend (the Triton interpreter is
slow on CPU); `test_triton_attention_path` runs the Triton kernel itself.
"""

import copy
import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fastformer
import fastformer.nn as fnn
from fastformer import reference
from fastformer.explain import explain
from fastformer.testing import (
    assert_parity,
    compare_with_reference,
    dropout_sites_one_at_a_time,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:Support for mismatched:UserWarning"),
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning"),
    pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning"),
    pytest.mark.filterwarnings("ignore:Converting mask without torch.bool:UserWarning"),
]

E, H, FF, B, S, T = 16, 2, 32, 3, 7, 5


@pytest.fixture(autouse=True)
def torch_attention(monkeypatch):
    """The attention op's torch backend: the Triton interpreter is too slow for every test."""
    monkeypatch.setenv("FASTFORMER_BACKEND_ATTENTION", "torch")


def module_parity(fast, ref, args, kwargs=None, arg_names=None):
    """Parity of fast(*args, **kwargs) with ref (same parameter names) for the output, the
    gradients of the args that require grad and of every parameter."""
    kwargs = kwargs or {}
    names = [n for n, _ in fast.named_parameters()]
    params = [p.detach().clone().requires_grad_() for _, p in fast.named_parameters()]

    def call(module):
        def fn(*flat):
            inputs, weights = flat[: len(args)], flat[len(args) :]
            return torch.func.functional_call(module, dict(zip(names, weights)), inputs, kwargs)

        return fn

    labels = [n for a, n in zip(args, arg_names or [f"arg{i}" for i in range(len(args))])]
    labels = [n for a, n in zip(args, labels) if a.requires_grad] + names
    results = compare_with_reference(call(fast), call(ref), [*args, *params], names=labels)
    assert len(results) == 1 + len(labels)
    assert_parity(results)
    return results


def _randn(*shape, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).requires_grad_(grad)


def _padding(batch, length, seed=0):
    """(batch, length) bool, True = padding at the end of each row; never a full row."""
    lengths = torch.randint(1, length + 1, (batch,), generator=torch.Generator().manual_seed(seed))
    lengths[0] = length
    return reference.padding_mask(lengths, length)


def _seq(batch_first, length, seed=0):
    shape = (B, length, E) if batch_first else (length, B, E)
    return _randn(*shape, seed=seed)


def perturb(module, seed=0):
    """Move every parameter off its init (LayerNorm 1/0, zero biases), so that a mixed-up
    weight or bias changes the output, not only a gradient."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return module


def _pair(torch_cls, fast_cls, *args, **kwargs):
    """The torch.nn module and a fastformer one holding the same (perturbed) weights."""
    torch_module = perturb(torch_cls(*args, **kwargs))
    fast = fast_cls(*args, **kwargs)
    fast.load_state_dict(torch_module.state_dict(), strict=True)
    return torch_module, fast


# --------------------------------------------------------------------------- state_dict and init


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_state_dict_and_init_match_torch(norm_first):
    kw = dict(num_encoder_layers=2, num_decoder_layers=1, dim_feedforward=FF, norm_first=norm_first)
    torch.manual_seed(0)
    theirs = nn.Transformer(E, H, **kw)
    torch.manual_seed(0)
    ours = fnn.Transformer(E, H, **kw)
    a, b = theirs.state_dict(), ours.state_dict()
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key  # same seed, same init
    fresh = fnn.Transformer(E, H, **kw)
    fresh.load_state_dict(a, strict=True)
    nn.Transformer(E, H, **kw).load_state_dict(b, strict=True)
    assert isinstance(ours.encoder.layers[1].self_attn, fnn.MultiheadAttention)
    assert isinstance(ours.decoder.layers[0].norm3, fnn.LayerNorm)


# --------------------------------------------------------------------------- whole model parity


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_parity_with_torch(batch_first, norm_first):
    kw = dict(num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=FF, dropout=0.0)
    kw |= dict(batch_first=batch_first, norm_first=norm_first)
    theirs, ours = _pair(nn.Transformer, fnn.Transformer, E, H, **kw)
    src, tgt = _seq(batch_first, S, seed=1), _seq(batch_first, T, seed=2)
    src_kpm = _padding(B, S, seed=3)
    masks = dict(
        tgt_mask=nn.Transformer.generate_square_subsequent_mask(T),
        tgt_is_causal=True,
        src_key_padding_mask=src_kpm,
        tgt_key_padding_mask=_padding(B, T, seed=4),
        memory_key_padding_mask=src_kpm,
    )
    module_parity(ours, theirs, (src, tgt), masks, ["src", "tgt"])


def test_swapped_float64_transformer_matches_torch():
    # A float64 model (gradcheck, numerics) keeps working after swap: the attention op takes
    # float64 on its torch backend, the LayerNorm and FFN ops in their C++ kernels.
    from fastformer.swap import swap

    kw = dict(num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=FF, dropout=0.0)
    theirs = perturb(nn.Transformer(E, H, batch_first=True, **kw)).double()
    ours = copy.deepcopy(theirs)
    swap(ours)
    assert isinstance(ours.encoder.layers[0].self_attn, fnn.MultiheadAttention)
    src, tgt = _seq(True, S, seed=1).double(), _seq(True, T, seed=2).double()
    src_kpm = _padding(B, S, seed=3)
    masks = dict(
        tgt_mask=nn.Transformer.generate_square_subsequent_mask(T, dtype=torch.float64),
        tgt_is_causal=True,
        src_key_padding_mask=src_kpm,
        memory_key_padding_mask=src_kpm,
    )
    outs = [model(src, tgt, **masks) for model in (theirs, ours)]
    assert outs[1].dtype == torch.float64
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-12)
    grads = [torch.autograd.grad(o.square().sum(), [src, *m.parameters()]) for o, m in
             zip(outs, (theirs, ours))]  # fmt: skip
    for mine, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(mine, want, rtol=0, atol=1e-11)


# --------------------------------------------------------------------------- layers and masks


def _mask_cases():
    g = torch.Generator().manual_seed(5)
    blocked = torch.rand(S, S, generator=g) > 0.6
    blocked.fill_diagonal_(False)  # nn convention: True = NOT allowed; no fully masked row
    per_head = torch.rand(B * H, S, S, generator=g) > 0.6
    per_head[:, torch.arange(S), torch.arange(S)] = False
    float_kpm = torch.randn(B, S, generator=g)
    float_kpm[1, -2:] = float("-inf")
    causal = nn.Transformer.generate_square_subsequent_mask(S)
    causal_bias = causal + torch.randn(S, S, generator=g)  # ALiBi-style: not only causal
    return {
        "bool_attn_mask": dict(src_mask=blocked),
        "float_attn_mask": dict(src_mask=torch.randn(S, S, generator=g)),
        "per_head_float_mask": dict(src_mask=torch.randn(B * H, S, S, generator=g)),
        "per_head_bool_mask": dict(src_mask=per_head),
        "bool_padding": dict(src_key_padding_mask=_padding(B, S, seed=6)),
        "float_padding": dict(src_key_padding_mask=float_kpm),
        "float_padding_bool_mask": dict(src_mask=blocked, src_key_padding_mask=float_kpm),
        "bool_padding_float_mask": dict(src_mask=causal, src_key_padding_mask=_padding(B, S)),
        "causal_hint_and_padding": dict(
            src_mask=causal, is_causal=True, src_key_padding_mask=_padding(B, S, seed=7)
        ),
        # torch.nn: the hint drops src_mask (no padding mask) / is ignored (padding mask).
        "causal_hint_biased_mask": dict(src_mask=causal_bias, is_causal=True),
        "causal_hint_biased_mask_and_padding": dict(
            src_mask=causal_bias, is_causal=True, src_key_padding_mask=_padding(B, S, seed=7)
        ),
    }


@pytest.mark.parametrize("case", list(_mask_cases()))
def test_encoder_layer_masks(case):
    masks = _mask_cases()[case]
    theirs, ours = _pair(
        nn.TransformerEncoderLayer, fnn.TransformerEncoderLayer, E, H, FF, dropout=0.0
    )
    module_parity(ours, theirs, (_seq(False, S),), masks, ["src"])


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("training", [False, True])
def test_decoder_layer_cross_attention_masks(norm_first, training):
    theirs, ours = _pair(
        nn.TransformerDecoderLayer, fnn.TransformerDecoderLayer, E, H, FF, dropout=0.0,
        batch_first=True, norm_first=norm_first,
    )  # fmt: skip
    theirs.train(training), ours.train(training)
    g = torch.Generator().manual_seed(8)
    memory_mask = torch.rand(T, S, generator=g) > 0.7
    memory_mask[:, 0] = False
    masks = dict(
        tgt_mask=reference.causal_mask(T),
        memory_mask=memory_mask,
        tgt_key_padding_mask=_padding(B, T, seed=9),
        memory_key_padding_mask=torch.randn(B, S, generator=g),  # float: added
    )
    module_parity(ours, theirs, (_seq(True, T), _seq(True, S, seed=1)), masks, ["tgt", "memory"])


def _causal_bias(length, seed=0):
    """A float mask that is the causal mask plus a bias (ALiBi-style), not the causal mask."""
    blocked = torch.ones(length, length, dtype=torch.bool).triu(1)
    return _randn(length, length, seed=seed, grad=False).masked_fill(blocked, float("-inf"))


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer_causal_hints_with_biased_masks_and_padding(norm_first):
    """With key padding masks torch.nn applies tgt_mask / memory_mask as given (the is_causal
    hints are ignored), so the biases count."""
    theirs, ours = _pair(
        nn.TransformerDecoderLayer, fnn.TransformerDecoderLayer, E, H, FF, dropout=0.0,
        batch_first=True, norm_first=norm_first,
    )  # fmt: skip
    masks = dict(
        tgt_mask=_causal_bias(T, seed=3),
        memory_mask=_randn(T, S, seed=4, grad=False),
        tgt_key_padding_mask=_padding(B, T, seed=9),
        memory_key_padding_mask=_padding(B, S, seed=10),
        tgt_is_causal=True,
        memory_is_causal=True,
    )
    module_parity(ours, theirs, (_seq(True, T), _seq(True, S, seed=1)), masks, ["tgt", "memory"])


def _attention_grads(module, x, kpm, mask):
    """The output of self-attention with is_causal=True and the gradients of x, the mask and
    the parameters (None where the mask is not read)."""
    mask = mask.clone().requires_grad_()
    call = dict(key_padding_mask=kpm, need_weights=False, attn_mask=mask, is_causal=True)
    out = module(x, x, x, **call)[0]
    inputs = [x, mask, *module.parameters()]
    return out, torch.autograd.grad(out.square().sum(), inputs, allow_unused=True)


@pytest.mark.parametrize("padding", [False, True])
def test_multihead_attention_causal_hint_with_a_mask_follows_torch(padding):
    """torch.nn reads is_causal as a hint only without a key_padding_mask (attn_mask dropped);
    with one it applies attn_mask as given, and a float mask gets its gradient."""
    theirs, ours = _pair(nn.MultiheadAttention, fnn.MultiheadAttention, E, H, batch_first=True)
    kpm = _padding(B, S, seed=2) if padding else None
    x, mask = _randn(B, S, E), _causal_bias(S)
    expected, expected_grads = _attention_grads(theirs, x, kpm, mask)
    out, grads = _attention_grads(ours, x, kpm, mask)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert (grads[1] is None) == (not padding)  # the mask is read only with a padding mask
    for got, want in zip(grads, expected_grads):
        assert (got is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_causal_hint_drops_a_mask_of_another_length_as_torch_does():
    # torch.nn never reads a hinted mask without padding, so a (max_len, max_len) causal mask
    # given for a shorter sequence runs there; it raised a shape error after fastformer.swap.
    theirs, ours = _pair(nn.TransformerDecoderLayer, fnn.TransformerDecoderLayer, E, H, FF, 0.0)
    longer = nn.Transformer.generate_square_subsequent_mask(T + 6)
    args = (_seq(False, T), _seq(False, S, seed=1))
    module_parity(ours, theirs, args, dict(tgt_mask=longer, tgt_is_causal=True), ["tgt", "memory"])
    with pytest.raises(TypeError, match="attn_mask must be a bool tensor"):  # its dtype still
        ours(*args, tgt_mask=longer.int(), tgt_is_causal=True)


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm", "MultiheadAttention"])
def test_a_list_input_gets_torch_nn_s_error(kind):
    # It raised "AttributeError: 'list' object has no attribute 'is_nested'" from fastformer.
    theirs, ours = _pair(
        getattr(nn, kind), getattr(fnn, kind), *((E, H) if kind[0] == "M" else (E,))
    )
    args = ([[0.5] * E],) * (3 if kind[0] == "M" else 1)
    with pytest.raises(Exception) as want:
        theirs(*args)
    with pytest.raises(type(want.value), match=re.escape(str(want.value))):
        ours(*args)


@pytest.mark.parametrize("kpm_dtype, mask_dtype", [("bool", "float32"), ("float16", "float32")])
def test_mismatched_mask_dtypes_give_torch_nn_s_deprecation_warning(kpm_dtype, mask_dtype):
    theirs, ours = _pair(nn.MultiheadAttention, fnn.MultiheadAttention, E, H, batch_first=True)
    x = _randn(B, S, E)
    kpm = torch.zeros(B, S, dtype=getattr(torch, kpm_dtype))
    masks = dict(
        key_padding_mask=kpm, attn_mask=torch.zeros(S, S, dtype=getattr(torch, mask_dtype))
    )
    for module in (theirs, ours):
        with pytest.warns(
            UserWarning, match="Support for mismatched key_padding_mask and attn_mask"
        ):
            module(x, x, x, need_weights=False, **masks)
    with warnings.catch_warnings():  # same dtypes: none
        warnings.simplefilter("error")
        same = dict(key_padding_mask=kpm.bool(), attn_mask=torch.zeros(S, S, dtype=torch.bool))
        ours(x, x, x, need_weights=False, **same)


@pytest.mark.parametrize(
    "module_dtype, mask_dtype",
    [("float32", "float16"), ("float32", "bfloat16"), ("bfloat16", "float16")],
)
def test_a_float_mask_of_another_dtype_with_bool_padding_runs_as_in_torch_nn(
    module_dtype, mask_dtype
):
    # torch.nn adds the bool padding as a float mask of the query's dtype, which promotes the
    # attn_mask; fastformer passed the float16 mask of a float32 module on and the op raised.
    dtype = getattr(torch, module_dtype)
    theirs, ours = _pair(nn.MultiheadAttention, fnn.MultiheadAttention, E, H, batch_first=True)
    theirs, ours = theirs.to(dtype), ours.to(dtype)
    x = _randn(B, S, E).to(dtype)
    mask = (_randn(S, S) * 0.5).to(getattr(torch, mask_dtype))
    kpm = _padding(B, S, seed=2)
    call = dict(key_padding_mask=kpm, attn_mask=mask, need_weights=False)
    expected, out = theirs(x, x, x, **call)[0], ours(x, x, x, **call)[0]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("padding", [False, True])
def test_a_swapped_reference_attention_takes_a_float16_mask_as_the_reference(padding):
    # The reference adds the mask to float32 scores; the swapped module passed the float16 mask
    # to the op, which raised.
    theirs = reference.MultiheadAttention(E, H, dropout=0.0, batch_first=True)
    holder = nn.Sequential(copy.deepcopy(theirs))
    fastformer.swap(holder)
    assert type(holder[0]).__name__ == "ReferenceMultiheadAttention"
    x, mask = _randn(B, S, E), (_randn(S, S) * 0.5).half()
    call = dict(attn_mask=mask, key_padding_mask=_padding(B, S, seed=2) if padding else None)
    expected, out = theirs(x, x, x, **call)[0], holder[0](x, x, x, **call)[0]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_encoder_layer_unbatched_input():
    theirs, ours = _pair(
        nn.TransformerEncoderLayer, fnn.TransformerEncoderLayer, E, H, FF, dropout=0.0
    )
    kpm = torch.zeros(S, dtype=torch.bool)
    kpm[-2:] = True
    module_parity(ours, theirs, (_randn(S, E),), dict(src_key_padding_mask=kpm), ["src"])


@pytest.mark.parametrize("activation", ["gelu_tanh", "silu", "swiglu", "geglu"])
@pytest.mark.parametrize("norm_first", [False, True])
def test_layers_with_extra_activations_match_reference(activation, norm_first):
    kw = dict(dropout=0.0, activation=activation, norm_first=norm_first, batch_first=True)
    ref = perturb(reference.TransformerDecoderLayer(E, H, FF, **kw))
    ours = fnn.TransformerDecoderLayer(E, H, FF, **kw)
    ours.load_state_dict(ref.state_dict(), strict=True)
    gated = activation in ("swiglu", "geglu")
    assert ours.linear1.out_features == (2 * FF if gated else FF)
    args = (_seq(True, T), _seq(True, S, seed=1))
    module_parity(ours, ref, args, dict(tgt_is_causal=True), ["tgt", "memory"])


def test_torch_activation_callables_are_fused():
    for activation in (F.gelu, nn.GELU("tanh"), nn.SiLU()):
        theirs, ours = _pair(
            nn.TransformerEncoderLayer, fnn.TransformerEncoderLayer, E, H, FF, dropout=0.0,
            activation=activation,
        )  # fmt: skip
        text = explain(ours, _seq(False, S))
        assert "ffn -> eager" not in text, text
        module_parity(ours, theirs, (_seq(False, S),), None, ["src"])


def test_custom_activation_falls_back_with_reason():
    def cube(x):
        return x**3

    theirs, ours = _pair(
        nn.TransformerEncoderLayer, fnn.TransformerEncoderLayer, E, H, FF, dropout=0.0,
        activation=cube,
    )  # fmt: skip
    text = explain(ours, _seq(False, S))
    assert "ffn -> eager" in text and "custom callable" in text, text
    module_parity(ours, theirs, (_seq(False, S),), None, ["src"])


# --------------------------------------------------------------------------- MultiheadAttention


def _mha_case(name):
    """(constructor kwargs, forward args builder) for each projection layout."""
    q, k, v = _randn(T, B, E, seed=1), _randn(S, B, E, seed=2), _randn(S, B, E, seed=3)
    cases = {
        "self": ({}, (q, q, q)),
        "cross_key_is_value": ({}, (q, k, k)),
        "distinct_qkv": ({}, (q, k, v)),
        "kdim_vdim": (dict(kdim=12, vdim=10), (q, _randn(S, B, 12, seed=4), _randn(S, B, 10))),
        "no_bias": (dict(bias=False), (q, k, v)),
        "batch_first": (dict(batch_first=True), tuple(t.transpose(0, 1) for t in (q, k, k))),
        "unbatched": ({}, (q[:, 0], k[:, 0], v[:, 0])),
    }
    return cases[name]


class _Route(nn.Module):
    """Calls an attention module with its inputs picked from `flat` by `index`; returns the
    output only (so `q is k is v` survives compare_with_reference's copies)."""

    def __init__(self, inner, index, kwargs):
        super().__init__()
        self.inner, self.index, self.kwargs = inner, index, kwargs

    def forward(self, *flat):
        return self.inner(*(flat[i] for i in self.index), **self.kwargs)[0]


@pytest.mark.parametrize(
    "case",
    [
        "self",
        "cross_key_is_value",
        "distinct_qkv",
        "kdim_vdim",
        "no_bias",
        "batch_first",
        "unbatched",
    ],
)
def test_multihead_attention_projections(case):
    kwargs, args = _mha_case(case)
    theirs, ours = _pair(nn.MultiheadAttention, fnn.MultiheadAttention, E, H, **kwargs)
    assert ours.fallback_reasons == []
    unbatched = case == "unbatched"
    seq_k = args[1].shape[1 if kwargs.get("batch_first") else 0]
    kpm = _padding(1 if unbatched else B, seq_k, seed=11)
    masks = dict(need_weights=False, key_padding_mask=kpm[0] if unbatched else kpm)
    distinct = list({id(t): t for t in args}.values())  # keeps `q is k` through the comparison
    index = [next(i for i, d in enumerate(distinct) if d is t) for t in args]
    module_parity(_Route(ours, index, masks), _Route(theirs, index, masks), tuple(distinct))
    text = explain(ours, *args, **masks)
    assert "attention -> torch" in text, text


def test_multihead_attention_is_causal_without_mask():
    theirs, ours = _pair(nn.MultiheadAttention, fnn.MultiheadAttention, E, H, batch_first=True)
    x = _randn(B, S, E)
    out, weights = ours(x, x, x, need_weights=False, is_causal=True)
    assert weights is None
    expected = theirs(x, x, x, need_weights=False, attn_mask=reference.causal_mask(S))[0]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["need_weights", "add_bias_kv", "add_zero_attn"])
def test_multihead_attention_fallbacks_match_torch(case):
    kwargs = {"add_bias_kv": True} if case == "add_bias_kv" else {}
    kwargs |= {"add_zero_attn": True} if case == "add_zero_attn" else {}
    theirs, ours = _pair(nn.MultiheadAttention, fnn.MultiheadAttention, E, H, **kwargs)
    q, k = _randn(T, B, E, grad=False), _randn(S, B, E, seed=1, grad=False)
    call = dict(need_weights=case == "need_weights", key_padding_mask=_padding(B, S))
    expected = theirs(q, k, k, **call)
    got = ours(q, k, k, **call)
    torch.testing.assert_close(got[0], expected[0], atol=0, rtol=0)  # torch.nn's own path
    if case == "need_weights":
        torch.testing.assert_close(got[1], expected[1], atol=0, rtol=0)
    else:
        assert any(case in r for r in ours.fallback_reasons)
    text = explain(ours, q, k, k, **call)
    assert "MultiheadAttention -> torch.nn" in text and case in text, text


def test_fully_masked_rows_give_zero_like_the_reference():
    ref = perturb(reference.MultiheadAttention(E, H, batch_first=True))
    ours = fnn.MultiheadAttention(E, H, batch_first=True)
    ours.load_state_dict(ref.state_dict(), strict=True)
    kpm = _padding(B, S)
    kpm[1] = True  # every key of batch 1 is padding
    args = (_randn(B, T, E, seed=1), _randn(B, S, E, seed=2))

    class CrossAttention(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, q, kv):
            return self.inner(q, kv, kv, key_padding_mask=kpm, need_weights=False)[0]

    results = module_parity(CrossAttention(ours), CrossAttention(ref), args, None, ["q", "kv"])
    assert all(math.isfinite(r.error) for r in results)


# --------------------------------------------------------------------------- norms and FFN


@pytest.mark.parametrize(
    "case",
    ["affine", "no_bias", "no_affine", "2d_shape", "rms", "rms_eps", "rms_no_affine"],
)
def test_norms_match_torch(case):
    make = {
        "affine": (nn.LayerNorm, fnn.LayerNorm, (E,), {}),
        "no_bias": (nn.LayerNorm, fnn.LayerNorm, (E,), dict(bias=False)),
        "no_affine": (nn.LayerNorm, fnn.LayerNorm, (E,), dict(elementwise_affine=False)),
        "2d_shape": (nn.LayerNorm, fnn.LayerNorm, ((4, E),), dict(eps=1e-3)),
        "rms": (nn.RMSNorm, fnn.RMSNorm, (E,), {}),
        "rms_eps": (nn.RMSNorm, fnn.RMSNorm, (E,), dict(eps=1e-3)),
        "rms_no_affine": (nn.RMSNorm, fnn.RMSNorm, (E,), dict(elementwise_affine=False)),
    }
    torch_cls, fast_cls, args, kwargs = make[case]
    theirs, ours = _pair(torch_cls, fast_cls, *args, **kwargs)
    module_parity(ours, theirs, (_randn(B, 4, E) * 3 + 1,), None, ["input"])


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm", "PostLN", "PreLN"])
def test_eps_zero_runs_torch_nn_path_with_reason(kind):
    # torch.nn takes eps=0; the ops refuse eps <= 0, so the modules run torch.nn's path.
    make = {
        "LayerNorm": (nn.LayerNorm, fnn.LayerNorm, (E,), dict(eps=0.0)),
        "RMSNorm": (nn.RMSNorm, fnn.RMSNorm, (E,), dict(eps=0.0)),
        "PostLN": (nn.TransformerEncoderLayer, fnn.TransformerEncoderLayer, (E, H, FF, 0.0),
                   dict(layer_norm_eps=0.0)),
        "PreLN": (nn.TransformerEncoderLayer, fnn.TransformerEncoderLayer, (E, H, FF, 0.0),
                  dict(layer_norm_eps=0.0, norm_first=True)),
    }  # fmt: skip
    torch_cls, fast_cls, args, kwargs = make[kind]
    theirs, ours = _pair(torch_cls, fast_cls, *args, **kwargs)
    assert any("eps=0.0" in why for why in ours.fallback_reasons)
    module_parity(ours, theirs, (_randn(B, 4, E) * 3 + 1,), None, ["input"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_rms_norm_default_eps_is_torchs(dtype):
    # F.rms_norm's eps=None is float32's epsilon for 16-bit inputs (not the input dtype's):
    # at this scale the two eps differ in the output by ~50%.
    theirs, ours = _pair(nn.RMSNorm, fnn.RMSNorm, (E,))
    x = (_randn(B, 4, E, grad=False) * 0.02).to(dtype)
    expected = theirs.to(dtype)(x)
    torch.testing.assert_close(ours.to(dtype)(x), expected, atol=0, rtol=0.02)
    weight = theirs.weight.detach().double()
    got = reference.rms_norm(x.double(), (E,), weight, eps=reference.rms_norm_eps(dtype))
    torch.testing.assert_close(got.to(dtype), expected, atol=0, rtol=0.02)


class _ReferenceFFN(nn.Module):
    """reference.ffn with copies of a FeedForward's linears."""

    def __init__(self, ffn: fnn.FeedForward, activation: str):
        super().__init__()
        self.linear1, self.linear2 = copy.deepcopy(ffn.linear1), copy.deepcopy(ffn.linear2)
        self.activation = activation

    def forward(self, x):
        l1, l2 = self.linear1, self.linear2
        return reference.ffn(x, l1.weight, l1.bias, l2.weight, l2.bias, self.activation)


@pytest.mark.parametrize("activation", list(reference.ACTIVATIONS))
def test_feed_forward_matches_reference(activation):
    ours = perturb(fnn.FeedForward(E, FF, dropout=0.0, activation=activation))
    assert ours.fallback_reasons == []
    module_parity(ours, _ReferenceFFN(ours, activation), (_randn(B, S, E),), None, ["x"])


def test_feed_forward_custom_callable_runs_unfused():
    ours = fnn.FeedForward(E, FF, dropout=0.0, activation=torch.tanh)
    assert any("custom callable" in r for r in ours.fallback_reasons)
    x = _randn(B, S, E, grad=False)
    expected = ours.linear2(torch.tanh(ours.linear1(x)))
    torch.testing.assert_close(ours(x), expected, atol=0, rtol=0)


def test_layers_read_parameters_set_as_plain_tensors():
    # The layers read children and parameters from the module's registries (host time) and
    # fall back to the attribute for anything else: a weight swapped for a plain tensor (the
    # way some weight-sharing code does it) and a norm without bias still give torch.nn's
    # results.
    torch.manual_seed(0)
    ref = nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True, bias=False).eval()
    ours = copy.deepcopy(ref)
    fastformer.swap(ours)
    for layer in (ref, ours):
        weight = layer.linear1.weight.detach() * 0.5
        del layer.linear1.weight
        layer.linear1.weight = weight
    assert "weight" not in ours.linear1._parameters and ours.norm1.bias is None
    x = _randn(B, S, E, grad=False)
    torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)


def test_lookup_matches_getattr():
    from fastformer.nn._lookup import child, param

    layer = nn.TransformerEncoderLayer(E, H, FF, bias=False)
    assert child(layer, "linear1") is layer.linear1 and child(layer, "activation") is F.relu
    assert param(layer.linear1, "weight") is layer.linear1.weight
    assert param(layer.linear1, "bias") is None
    layer.linear1.extra = torch.ones(1)
    assert param(layer.linear1, "extra") is layer.linear1.extra
    with pytest.raises(AttributeError):
        param(layer.linear1, "missing")


def test_positional_encoding_matches_reference():
    ours, ref = (
        fnn.PositionalEncoding(E, dropout=0.0, max_len=50),
        reference.PositionalEncoding(E, 0.0, 50),
    )
    x = _randn(B, S, E, grad=False)
    torch.testing.assert_close(ours(x), ref(x), atol=0, rtol=0)
    assert ours.state_dict() == {}


# --------------------------------------------------------------------------- dropout


@pytest.mark.parametrize("norm_first", [False, True])
def test_dropout_is_reproducible_with_the_seed(norm_first):
    layer = fnn.TransformerDecoderLayer(E, H, FF, dropout=0.3, norm_first=norm_first)
    tgt, memory = _seq(False, T, seed=1), _seq(False, S, seed=2)

    def run(seed):
        torch.manual_seed(seed)
        return layer(tgt, memory, tgt_is_causal=True)

    first, again, other = run(0), run(0), run(1)
    torch.testing.assert_close(first, again, atol=0, rtol=0)
    assert (first - other).abs().max() > 1e-3  # a new seed, new masks
    layer.eval()
    evaluated = layer(tgt, memory, tgt_is_causal=True)
    assert (first - evaluated).abs().max() > 1e-3  # dropout did apply in training
    torch.testing.assert_close(evaluated, layer(tgt, memory, tgt_is_causal=True), atol=0, rtol=0)


def test_dropout_rate_of_feed_forward():
    ff = fnn.FeedForward(E, 4096, dropout=0.25, activation="relu")
    with torch.no_grad():
        ff.linear1.weight.zero_(), ff.linear1.bias.fill_(1.0)  # hidden = 1 everywhere
        ff.linear2.weight.fill_(1.0), ff.linear2.bias.zero_()
    torch.manual_seed(0)
    out = ff(torch.zeros(8, E))  # = (number kept) / (1 - p) per row
    kept = out / (1 / 0.75)
    assert abs(kept.mean().item() / 4096 - 0.75) < 0.01


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "case, error, words",
    [
        ("query_4d", ValueError, ["query", "(2, 3, 5, 16)"]),
        ("key_dim", ValueError, ["key", "last dim 16"]),
        ("mask_shape", ValueError, ["attn_mask", "(5, 7)", "(4, 4)"]),
        ("kpm_shape", ValueError, ["key_padding_mask", "(3, 7)", "(3, 5)"]),
        ("kpm_dtype", TypeError, ["key_padding_mask", "torch.int64"]),
        ("kpm_unbatched", ValueError, ["key_padding_mask", "1-D", "unbatched", "(1, 7)"]),
        ("activation", ValueError, ["activation", "'tanh'"]),
        ("activation_type", TypeError, ["activation", "int"]),
        ("max_len", ValueError, ["max_len", "60"]),
    ],
)
def test_errors_name_the_argument(case, error, words):
    mha = fnn.MultiheadAttention(E, H)
    q, k = torch.randn(T, B, E), torch.randn(S, B, E)
    calls = {
        "query_4d": lambda: mha(torch.randn(2, 3, 5, E), k, k, need_weights=False),
        "key_dim": lambda: mha(q, torch.randn(S, B, 8), k, need_weights=False),
        "mask_shape": lambda: mha(q, k, k, attn_mask=torch.ones(4, 4), need_weights=False),
        "kpm_shape": lambda: mha(q, k, k, torch.zeros(B, 5, dtype=torch.bool), need_weights=False),
        "kpm_dtype": lambda: mha(q, k, k, torch.zeros(B, S, dtype=torch.long), need_weights=False),
        "kpm_unbatched": lambda: mha(
            q[:, 0], k[:, 0], k[:, 0], torch.zeros(1, S, dtype=torch.bool), need_weights=False
        ),
        "activation": lambda: fnn.TransformerEncoderLayer(E, H, activation="tanh"),
        "activation_type": lambda: fnn.FeedForward(E, activation=3),
        "max_len": lambda: fnn.PositionalEncoding(E, max_len=50)(torch.randn(1, 60, E)),
    }
    with pytest.raises(error) as info:
        calls[case]()
    for word in words:
        assert word in str(info.value), str(info.value)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("kind", ["fastformer", "reference", "swapped_encoder", "decoder_layer"])
def test_a_causal_bias_mask_is_refused(kind, need_weights):
    # torch's CausalBias is an SDPA mask whose tensor values are uninitialized memory; torch.nn's
    # MultiheadAttention adds them to the scores without an error (need_weights or not).
    from torch.nn.attention.bias import causal_upper_left

    x, mask = torch.randn(B, T, E), causal_upper_left(T, T)
    mods = {
        "fastformer": lambda: fnn.MultiheadAttention(E, H, batch_first=True),
        "reference": lambda: reference.MultiheadAttention(E, H, batch_first=True),
    }
    if kind in mods:
        call = lambda: mods[kind]()(x, x, x, attn_mask=mask, need_weights=need_weights)  # noqa: E731
    elif kind == "swapped_encoder":
        enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 32, batch_first=True), 2)
        fastformer.swap(enc)
        call = lambda: enc(x, mask=mask)  # noqa: E731
    else:
        layer = fnn.TransformerDecoderLayer(E, H, 32, batch_first=True)
        call = lambda: layer(x, x, memory_mask=mask)  # noqa: E731
    with pytest.raises(TypeError, match=r"^attn_mask .*is a torch.nn.attention.bias.CausalBias"):
        call()


# --------------------------------------------------------------------------- autocast


def _autocast_pairs():
    """kind -> (torch class, fastformer class, constructor args and kwargs, number of inputs)."""
    layer = dict(dropout=0.0)
    return {
        "LayerNorm": (nn.LayerNorm, fnn.LayerNorm, (E,), {}, 1),
        "RMSNorm": (nn.RMSNorm, fnn.RMSNorm, (E,), {}, 1),
        "MultiheadAttention": (nn.MultiheadAttention, fnn.MultiheadAttention, (E, H), {}, 3),
        "EncoderLayer": (nn.TransformerEncoderLayer, fnn.TransformerEncoderLayer, (E, H, FF), layer, 1),
        "EncoderLayerPreLN": (
            nn.TransformerEncoderLayer, fnn.TransformerEncoderLayer, (E, H, FF),
            dict(layer, norm_first=True), 1,
        ),
        "DecoderLayer": (nn.TransformerDecoderLayer, fnn.TransformerDecoderLayer, (E, H, FF), layer, 2),
        "DecoderLayerPreLN": (
            nn.TransformerDecoderLayer, fnn.TransformerDecoderLayer, (E, H, FF),
            dict(layer, norm_first=True), 2,
        ),
    }  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", list(_autocast_pairs()))
def test_autocast_gives_torch_dtypes(kind, dtype):
    torch_cls, fast_cls, args, kwargs, n_inputs = _autocast_pairs()[kind]
    theirs, ours = _pair(torch_cls, fast_cls, *args, **kwargs)
    x = torch.randn(S, B, E, dtype=dtype)
    extra = {"need_weights": False} if kind == "MultiheadAttention" else {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = theirs(*(x,) * n_inputs, **extra), ours(*(x,) * n_inputs, **extra)
    expected, got = (expected[0], got[0]) if isinstance(got, tuple) else (expected, got)
    assert got.dtype == expected.dtype, (kind, dtype)
    torch.testing.assert_close(got.float(), expected.float(), atol=0.1, rtol=0.05)
    got.float().sum().backward()  # the casts are differentiable down to float32 weights
    assert all(p.grad is not None and p.grad.dtype == p.dtype for p in ours.parameters())


def test_autocast_rounds_a_float_mask_as_torch_does():
    # Under autocast torch.nn's attention adds the float mask in the autocast dtype. Columns of
    # 1000 and 1001.5 are one bfloat16 value (its spacing there is 4): torch's softmax spreads
    # evenly over them, a float32 mask would not (the outputs then differ by up to ~1).
    torch.manual_seed(0)
    theirs, ours = _pair(nn.MultiheadAttention, fnn.MultiheadAttention, E, H, batch_first=True)
    x = torch.randn(B, S, E)
    mask = torch.full((S, S), 1000.0)
    mask[:, 1::2] = 1001.5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = theirs(x, x, x, attn_mask=mask, need_weights=False)[0]
        got = ours(x, x, x, attn_mask=mask, need_weights=False)[0]
    torch.testing.assert_close(got.float(), expected.float(), atol=0.05, rtol=0)  # ~1 bf16 ulp


def test_float32_mask_of_a_bfloat16_module_is_not_rounded_without_autocast():
    # torch.nn's SDPA adds a float32 mask to bfloat16 scores as it is (an ALiBi-style bias);
    # the module rounded it to bfloat16, which the autocast test above needs only under autocast.
    torch.manual_seed(0)
    theirs, ours = _pair(nn.MultiheadAttention, fnn.MultiheadAttention, E, H, batch_first=True)
    theirs, ours = theirs.bfloat16(), ours.bfloat16()
    x = torch.randn(B, S, E, dtype=torch.bfloat16)
    mask = torch.full((S, S), 1000.0)
    mask[:, 1::2] = 1001.5
    padding = torch.full((B, S), 1000.0)
    padding[:, 1::2] = 1001.5
    for masks in (dict(attn_mask=mask), dict(key_padding_mask=padding)):
        expected = theirs(x, x, x, need_weights=False, **masks)[0]
        got = ours(x, x, x, need_weights=False, **masks)[0]
        torch.testing.assert_close(got.float(), expected.float(), atol=0.05, rtol=0)


def test_bool_mask_plus_float16_padding_of_a_float32_module_as_in_torch():
    # torch.nn makes the bool mask a float one of the query's dtype before adding the float16
    # padding (float32 then); in float16 the sum would be refused by the op as a mismatch.
    torch.manual_seed(0)
    theirs, ours = _pair(nn.MultiheadAttention, fnn.MultiheadAttention, E, H, batch_first=True)
    x, mask = torch.randn(B, S, E), torch.rand(S, S) > 0.3
    mask.fill_diagonal_(True)
    padding = torch.randn(B, S, dtype=torch.float16)
    masks = dict(attn_mask=mask, key_padding_mask=padding, need_weights=False)
    with pytest.warns(UserWarning, match="mismatched key_padding_mask"):
        expected = theirs(x, x, x, **masks)[0]
    torch.testing.assert_close(ours(x, x, x, **masks)[0], expected)


@pytest.mark.parametrize("autocast", [False, True])
def test_float64_mask_of_a_float32_module_raises_as_in_torch(autocast):
    # torch.nn refuses it ("Expected attn_mask dtype to be bool or float or to match query
    # dtype"); autocast leaves float64 as it is. The module cast it and computed.
    theirs, ours = _pair(nn.MultiheadAttention, fnn.MultiheadAttention, E, H, batch_first=True)
    x, mask = torch.randn(B, S, E), torch.randn(S, S, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with pytest.raises(RuntimeError, match="attn_mask dtype"):
            theirs(x, x, x, attn_mask=mask, need_weights=False)
        with pytest.raises(TypeError, match="attn_mask must be bool or float"):
            ours(x, x, x, attn_mask=mask, need_weights=False)


@pytest.mark.parametrize("kind", ["EncoderLayer", "DecoderLayerPreLN"])
def test_float32_block_inside_autocast_with_backward_under_autocast(kind):
    # A float32 sub-block (autocast switched off around it) whose backward runs where autocast
    # is on, as `loss.backward()` inside the training step's autocast region does. The FFN's
    # C++ ops called at::mm there, which returned bfloat16 to their float32 passes (an error).
    # The FFN's gradients are now those without autocast; the projections' are torch's own
    # linear backward, which autocast takes to bfloat16 there (in torch.nn too).
    torch_cls, fast_cls, args, kwargs, n_inputs = _autocast_pairs()[kind]
    theirs, ours = _pair(torch_cls, fast_cls, *args, **kwargs)
    x = _randn(S, B, E)
    grads = {}
    for name, module, autocast in (
        ("plain", ours, False),
        ("ours", ours, True),
        ("theirs", theirs, True),
    ):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            with torch.autocast("cpu", enabled=False):
                out = module(*(x,) * n_inputs)
            assert out.dtype == torch.float32
            grads[name] = dict(
                zip(
                    dict(module.named_parameters()),
                    torch.autograd.grad(out.square().mean(), list(module.parameters())),
                )
            )
    for name, grad in grads["ours"].items():
        scale = float(grads["plain"][name].abs().max())
        torch.testing.assert_close(grad, grads["theirs"][name], atol=0.05 * scale, rtol=0, msg=name)
        if name.startswith("linear"):  # the FFN op's parameters
            torch.testing.assert_close(grad, grads["plain"][name], atol=0, rtol=0, msg=name)


def test_per_sample_gradients_and_jvp_match_torch():
    # torch.func over a swapped layer (per-sample gradients: vmap of grad; jvp with frozen
    # weights, which forward-mode AD through the kernels answered with zeros).
    torch.manual_seed(0)
    theirs = nn.TransformerEncoderLayer(E, H, FF, 0.0, batch_first=True).double()
    ours = copy.deepcopy(theirs)
    fastformer.swap(ours)
    x, pad = _randn(B, S, E, grad=False).double(), _padding(B, S)

    def per_sample(module):
        def loss(params, xi, pi):
            out = torch.func.functional_call(module, params, (xi,), {"src_key_padding_mask": pi})
            return out.square().sum()

        params = {k: v.detach() for k, v in module.named_parameters()}
        return torch.func.vmap(torch.func.grad(loss), (None, 0, 0))(
            params, x[:, None], pad[:, None]
        )

    expected, got = per_sample(theirs), per_sample(ours)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-10, atol=1e-10)
    ours.requires_grad_(False)
    theirs.requires_grad_(False)
    tangent = torch.randn_like(x)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):  # has forward AD
        want = torch.func.jvp(lambda t: theirs(t, src_key_padding_mask=pad), (x,), (tangent,))
    have = torch.func.jvp(lambda t: ours(t, src_key_padding_mask=pad), (x,), (tangent,))
    for g, w in zip(have, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_meta_device_model_runs_like_torch():
    # Models built on the meta device (shape inference, deferred init before `to_empty`):
    # the ops' autocast guard asked torch.is_autocast_enabled("meta"), which raises.
    def model():
        torch.manual_seed(0)
        kw = dict(dim_feedforward=FF, dropout=0.1, batch_first=True, device="meta")
        return nn.Transformer(E, H, 1, 1, **kw)

    ours, theirs = model(), model()
    fastformer.swap(ours)
    src, tgt = torch.empty(B, S, E, device="meta"), torch.empty(B, T, E, device="meta")
    pad = torch.zeros(B, S, dtype=torch.bool, device="meta")
    for module in (ours, theirs):
        out = module(src, tgt, src_key_padding_mask=pad, memory_key_padding_mask=pad)
        assert out.shape == (B, T, E) and out.device.type == "meta"
        out.sum().backward()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert p.grad is not None and p.grad.shape == q.grad.shape, name
    ours.to_empty(device="cpu")  # uninitialized memory: give it values
    for p in ours.parameters():
        nn.init.normal_(p.detach(), std=0.1)
    assert ours(torch.randn(B, S, E), torch.randn(B, T, E)).isfinite().all()


# --------------------------------------------------------------------------- the other paths


def test_triton_attention_path(monkeypatch):
    """The Triton kernel (interpreted on CPU) behind MultiheadAttention, padding included."""
    monkeypatch.delenv("FASTFORMER_BACKEND_ATTENTION")
    theirs, ours = _pair(nn.MultiheadAttention, fnn.MultiheadAttention, 32, 2, batch_first=True)
    x = _randn(2, 9, 32)
    kpm = _padding(2, 9)
    text = explain(ours, x, x, x, key_padding_mask=kpm, need_weights=False)
    assert "attention -> triton" in text, text  # conftest sets TRITON_INTERPRET=1 on CPU

    class Self(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x, x, x, key_padding_mask=kpm, need_weights=False)[0]

    module_parity(Self(ours), Self(theirs), (x,), None, ["x"])


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("case", ["self", "batch_first", "cross_key_is_value", "distinct_qkv"])
def test_attention_gradients_skip_the_head_split_copies(monkeypatch, case, backend):
    """With the Triton kernel, dq, dk and dv come back laid out as the projections' head views
    (one buffer for a packed projection), and the heads' split passes them to the projection as
    its gradient without a stack and a copy. The torch backend's gradients take that path only
    where torch's kernels happen to lay them out so. Both give torch.nn's gradients."""
    from fastformer.nn import attention as fnn_attention

    monkeypatch.setenv("FASTFORMER_BACKEND_ATTENTION", backend)
    offsets = []

    def spy(grads, parts):
        offsets.append(found := split_offset(grads, parts))
        return found

    split_offset = fnn_attention._offset_in_one_buffer
    monkeypatch.setattr(fnn_attention, "_offset_in_one_buffer", spy)
    kwargs, args = _mha_case(case)
    theirs, ours = _pair(nn.MultiheadAttention, fnn.MultiheadAttention, E, H, **kwargs)
    seq_k = args[1].shape[1 if kwargs.get("batch_first") else 0]
    masks = dict(need_weights=False, key_padding_mask=_padding(B, seq_k, seed=11))
    distinct = list({id(t): t for t in args}.values())
    index = [next(i for i, d in enumerate(distinct) if d is t) for t in args]
    module_parity(_Route(ours, index, masks), _Route(theirs, index, masks), tuple(distinct))
    splits = {"self": 1, "batch_first": 2, "cross_key_is_value": 2, "distinct_qkv": 3}[case]
    assert len(offsets) >= splits  # every projection's split ran its backward
    if backend == "triton":
        assert None not in offsets, offsets


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize(
    "n, layout",
    [(n, layout) for n in (1, 2, 3) for layout in ("contiguous", "one_buffer")]
    + [(2, "missing"), (3, "missing")],
)
def test_split_heads_backward(n, batch_first, layout):
    """The heads' split gives the gradient autograd gives its views, whether the gradients come
    as separate tensors (a stack and a copy), in one buffer laid out as the views are (no
    copy), or with one of them missing (zeros)."""
    from fastformer.kernels.attention import grads_like
    from fastformer.nn.attention import _head_views, _split_heads

    x = _randn(*((B, S) if batch_first else (S, B)), n * E)
    grads = [_randn(B, H, S, E // H, seed=i, grad=False) for i in range(n)]
    if layout == "one_buffer":
        views = _head_views(x.detach(), n, H, batch_first)
        grads = [buf.copy_(g) for buf, g in zip(grads_like(*views), grads)]
        assert len({g.untyped_storage().data_ptr() for g in grads}) == 1
    if layout == "missing":
        grads[0] = None
    outs = _split_heads(x, n, H, batch_first)
    used = [(o, g) for o, g in zip(outs, grads) if g is not None]
    got = torch.autograd.grad([o for o, _ in used], x, [g for _, g in used])[0]
    views = _head_views(x, n, H, batch_first)
    used = [(o, g) for o, g in zip(views, grads) if g is not None]
    expected = torch.autograd.grad([o for o, _ in used], x, [g for _, g in used])[0]
    assert torch.equal(got, expected)


def test_torch_encoder_nested_path_falls_back_to_torch():
    """An unswapped torch.nn.TransformerEncoder hands fastformer layers nested tensors in
    inference; the layer then runs torch.nn's own path (same result)."""
    layer = fnn.TransformerEncoderLayer(E, H, FF, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    theirs = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(E, H, FF, batch_first=True), 2, enable_nested_tensor=True
    ).eval()
    theirs.load_state_dict(encoder.state_dict())
    x, kpm = torch.randn(B, S, E), _padding(B, S)
    with torch.no_grad():
        torch.testing.assert_close(
            encoder(x, src_key_padding_mask=kpm), theirs(x, src_key_padding_mask=kpm)
        )
        text = explain(encoder, x, src_key_padding_mask=kpm)
    assert "layers.1 (TransformerEncoderLayer)" in text and "nested-tensor input" in text, text


def test_nested_input_with_fastformers_own_activation_is_a_clear_error():
    # torch.nn's path, which nested input takes, called the string: "'str' object is not
    # callable".
    layer = fnn.TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True, activation="silu")
    nested = torch.nested.nested_tensor([torch.randn(5, E), torch.randn(3, E)])
    with torch.no_grad(), pytest.raises(ValueError, match="no activation 'silu'.*F.silu"):
        layer.eval()(nested)


@pytest.mark.parametrize("kind", ["fastformer", "swapped reference"])
def test_nested_input_with_is_causal_is_a_clear_error(kind):
    # torch.nn's nested path ignores is_causal (a non-causal output); fastformer raised
    # "NestedTensorImpl doesn't support sizes" building the mask.
    if kind == "fastformer":
        mha = fnn.MultiheadAttention(E, H, batch_first=True)
    else:
        model = nn.Sequential(reference.MultiheadAttention(E, H, batch_first=True))
        fastformer.swap(model)
        mha = model[0]
    nested = torch.nested.nested_tensor([torch.randn(5, E), torch.randn(3, E)])
    with torch.no_grad(), pytest.raises(ValueError, match="is_causal=True is not supported"):
        mha.eval()(nested, nested, nested, need_weights=False, is_causal=True)


def test_head_dims_past_the_kernels_take_torch_nns_path():
    # head_dim 512: the op refuses it, so the module ran into its ValueError where torch.nn works.
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(1024, 2, batch_first=True)
    ours = fnn.MultiheadAttention(1024, 2, batch_first=True)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 5, 1024)
    assert ours.fallback_reasons == ["head_dim 512: the fused op takes up to 256"]
    want = theirs(x, x, x, need_weights=False)[0]
    torch.testing.assert_close(ours(x, x, x, need_weights=False)[0], want)


def test_rms_norm_takes_its_input_by_torchs_keyword():
    torch.manual_seed(0)
    x = torch.randn(2, E)
    theirs, ours = nn.RMSNorm(E), fnn.RMSNorm(E)
    torch.testing.assert_close(ours(x=x), theirs(x=x))


def test_explain_reports_backends_and_unswapped_modules():
    model = nn.Sequential(
        fnn.TransformerEncoderLayer(E, H, FF, batch_first=True, activation=torch.tanh),
        nn.LayerNorm(E),
    )
    text = explain(model, torch.randn(B, S, E))
    assert isinstance(text, str) and text.records
    assert "0.self_attn (MultiheadAttention)" in text
    assert "FASTFORMER_BACKEND_ATTENTION=torch forces torch" in text
    assert "dropout_add_layer_norm" in text and "ffn -> eager" in text
    assert "1 (LayerNorm)" in text and "fastformer.swap" in text
    encoder = fnn.TransformerEncoder(model[0], 1)
    text = explain(encoder, torch.randn(B, S, E), mask=reference.causal_mask(S))
    assert "mask -> applied as given" in text and "pass is_causal=True" in text, text


def test_explain_names_the_root_reference_modules_and_a_run_without_fastformer():
    from fastformer.nn import _record

    hooks = len(_record.OWN_HOOKS)
    text = explain(fnn.LayerNorm(E), torch.randn(B, S, E))
    assert "\n(root) (LayerNorm)\n    layer_norm -> " in text, text
    text = explain(reference.LayerNorm(E), torch.randn(B, S, E))
    assert "(root) (LayerNorm)" in text and "fastformer.swap(model) replaces it" in text, text
    text = explain(nn.Linear(E, E), torch.randn(B, S, E))
    assert text.endswith(
        "0 calls\n    no fastformer module ran (fastformer.swap(model) replaces torch.nn ones)"
    )
    norm = fnn.LayerNorm(E)
    text = explain(nn.Sequential(norm, norm), torch.randn(B, S, E))
    assert text.startswith("fastformer.explain(Sequential): 2 calls\n") and " (x2)" in text, text
    assert len(_record.OWN_HOOKS) == hooks  # each explain's hook id is forgotten with it


def test_explain_records_a_module_its_model_calls_without_owning_it():
    # A module kept outside the model's children (in a plain list) runs in the same thread
    class Borrows(nn.Module):
        def __init__(self, norm):
            super().__init__()
            self.norms = [norm]

        def forward(self, x):
            return self.norms[0](x)

    text = explain(Borrows(fnn.LayerNorm(E)), torch.randn(B, S, E))
    assert len(text.records) == 1 and "? (LayerNorm)" in text, text


def test_explain_records_its_model_and_not_other_threads_models():
    # The recording was a process global: calls another thread made meanwhile (another model)
    # were listed as "?" modules of the explained one. Calls of the explained model's own
    # modules from worker threads (branches run in a pool) still count.
    import threading
    from concurrent.futures import ThreadPoolExecutor

    class Branches(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = fnn.LayerNorm(E), fnn.LayerNorm(E)

        def forward(self, x):
            with ThreadPoolExecutor(2) as pool:
                return sum(pool.map(lambda m: m(x), (self.a, self.b)))

    other, started, stop = fnn.LayerNorm(E), threading.Event(), threading.Event()

    def busy():
        x = torch.randn(B, S, E)
        while not stop.is_set():
            other(x)
            started.set()

    thread = threading.Thread(target=busy)
    thread.start()
    try:
        assert started.wait(timeout=60)
        text = explain(fnn.LayerNorm(E), torch.randn(B, S, E))
        branches = explain(Branches(), torch.randn(B, S, E))
    finally:
        stop.set()
        thread.join()
    assert len(text.records) == 1 and all(r.module is not other for r in text.records)
    assert (
        len(branches.records) == 2 and "a (LayerNorm)" in branches and "b (LayerNorm)" in branches
    )


def test_explain_calls_of_two_threads_may_end_in_any_order():
    # recording() saved and restored one global store: when the first explain ended before the
    # second, the second recorded nothing and its finished store stayed on for every later
    # forward. And each explain's global hook noted every unswapped module into that one store:
    # one module run while two explains ran was listed twice.
    import threading

    from fastformer.nn import _record

    a_ran, b_ran, a_done = threading.Event(), threading.Event(), threading.Event()

    def model() -> nn.Module:
        return nn.Sequential(fnn.LayerNorm(E), nn.LayerNorm(E))  # one fastformer, one not

    class First(nn.Module):  # runs its model, then waits inside explain until Second's ran
        def __init__(self):
            super().__init__()
            self.m = model()

        def forward(self, x):
            y = self.m(x)
            a_ran.set()
            assert b_ran.wait(timeout=60)
            return y

    class Second(nn.Module):  # runs its model while First's explain runs, ends after it
        def __init__(self):
            super().__init__()
            self.m = model()

        def forward(self, x):
            assert a_ran.wait(timeout=60)
            y = self.m(x)
            b_ran.set()
            assert a_done.wait(timeout=60)
            return y

    x, got = torch.randn(B, S, E), {}
    serial = len(explain(model(), x).records)

    def first():
        got["first"] = explain(First(), x).records
        a_done.set()

    def second():
        got["second"] = explain(Second(), x).records

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not _record.active()
    assert serial == 2 and len(got["first"]) == len(got["second"]) == serial, got
    # torch.compile compiles again: each explain's own set_stance block restored the stance it
    # found, so out of order "force_eager" stayed on and compiled models ran eagerly.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.compile(lambda t: t * 2, backend="eager")(x)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.cuda
@pytest.mark.parametrize("norm_first", [False, True])
def test_cuda_transformer_parity_bf16(norm_first, monkeypatch):
    # The attention a GPU user gets (Triton, fp32 accumulation), not the torch backend: that one
    # computes in bf16, while torch.nn's side runs SDPA's fused kernels, whose smaller error sets
    # the bound. With it, 5 decoder gradients came out 1.1-1.3x over their bound on an H200
    # (Post-LN), while the same test passes on CPU, where both sides compute in bf16.
    monkeypatch.delenv("FASTFORMER_BACKEND_ATTENTION", raising=False)
    torch.manual_seed(0)
    kw = dict(num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=256, dropout=0.0)
    theirs, ours = _pair(
        nn.Transformer, fnn.Transformer, 128, 2, **kw, batch_first=True, norm_first=norm_first
    )
    theirs, ours = theirs.cuda().bfloat16(), ours.cuda().bfloat16()
    src = torch.randn(2, 97, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    tgt = torch.randn(2, 33, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kpm = _padding(2, 97).cuda()
    masks = dict(src_key_padding_mask=kpm, memory_key_padding_mask=kpm, tgt_is_causal=True)
    masks["tgt_mask"] = reference.causal_mask(33, device="cuda")  # torch.nn needs it with the hint
    module_parity(ours, theirs, (src, tgt), masks, ["src", "tgt"])


@pytest.mark.cuda
def test_cuda_autocast_gives_torch_dtypes():
    kw = dict(num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=64, dropout=0.0)
    for norm_first in (False, True):
        theirs, ours = _pair(nn.Transformer, fnn.Transformer, 32, 2, **kw, norm_first=norm_first)
        theirs, ours = theirs.cuda(), ours.cuda()
        x = torch.randn(9, 2, 32, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            expected, got = theirs(x, x), ours(x, x)
        assert got.dtype == expected.dtype


@pytest.mark.cuda
def test_cuda_graph_training_step_with_dropout(monkeypatch):
    # A whole Post-LN Transformer training step (forward, backward, Adam) with dropout in all
    # its places, captured once in a CUDA graph: every replay drops other elements (the seeds are
    # drawn on the device), so two replays from the same weights give different gradients, both
    # finite, and eager steps around the graph still work.
    # The Triton kernels: the module's torch backend refuses a seed drawn on the device (it
    # failed so on an H200, 2026-11-30 s8).
    monkeypatch.delenv("FASTFORMER_BACKEND_ATTENTION", raising=False)
    torch.manual_seed(0)
    kw = dict(num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=256, dropout=0.1)
    model = fnn.Transformer(128, 4, **kw, batch_first=True).cuda().bfloat16()
    src = torch.randn(4, 64, 128, device="cuda", dtype=torch.bfloat16)
    tgt = torch.randn(4, 48, 128, device="cuda", dtype=torch.bfloat16)
    masks = dict(tgt_mask=reference.causal_mask(48, device="cuda"), tgt_is_causal=True)
    params = list(model.parameters())

    def step():
        out = model(src, tgt, **masks)
        return torch.autograd.grad(out.float().square().mean(), params)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (autotuning) outside the capture, as torch advises
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = step()
    replays = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        replays.append([g.clone() for g in grads])
    assert all(torch.isfinite(g).all() for g in replays[0] + replays[1])
    assert any(not torch.equal(a, b) for a, b in zip(*replays))
    assert all(torch.isfinite(g).all() for g in step())


def _checkpointed_grads(layer: nn.Module, x: torch.Tensor, mode: str) -> list[torch.Tensor]:
    from torch.utils.checkpoint import checkpoint

    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    torch.manual_seed(5)  # the same dropout masks in each mode
    out = layer(x) if mode == "none" else checkpoint(layer, x, use_reentrant=mode == "reentrant")
    out.square().sum().backward()
    return [out.detach(), x.grad, *(p.grad for p in layer.parameters())]


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_activation_checkpointing_gives_the_same_bits(mode):
    """torch.utils.checkpoint over a layer with dropout: the recomputed forward draws the same
    seeds (checkpoint restores the generator), so the C++ autograd nodes of the LayerNorm and
    FFN ops and the attention op give gradients bit-identical to a plain backward's."""
    layer = fnn.TransformerEncoderLayer(E, H, FF, dropout=0.3, batch_first=True)
    x = torch.randn(B, S, E)
    plain = _checkpointed_grads(layer, x, "none")
    again = _checkpointed_grads(layer, x, mode)
    assert len(plain) == len(again) > 2
    for a, b in zip(plain, again):
        assert torch.equal(a, b)


@pytest.mark.parametrize("p", [0.995, 0.99995])
@pytest.mark.parametrize("kind", ["attention", "encoder_layer"])
def test_dropout_closer_to_1_than_the_ops_take_runs_torch_nns_path(kind, p):
    # torch.nn takes any dropout in [0, 1]; the ops refuse p past their keep threshold's 0.1%
    # bias (attention 0.99237, the others 0.99991): a swapped training model raised there. Such
    # a sub-layer runs torch.nn's path and says why: the same draws from the same seed where
    # all of them do (a layer at 0.995 keeps its fused FFN and norms, with their own draws).
    if kind == "attention":
        ref, fast = _pair(nn.MultiheadAttention, fnn.MultiheadAttention, E, H, dropout=p)
        call = lambda m, x: m(x, x, x, need_weights=False)[0]  # noqa: E731
    else:
        ref, fast = _pair(nn.TransformerEncoderLayer, fnn.TransformerEncoderLayer, E, H, 32, p)
        call = lambda m, x: m(x)  # noqa: E731
    if kind == "attention" or p > 0.9999:  # the layer's own dropouts: the elementwise limit
        assert any("dropout p=" in r for r in fast.fallback_reasons)
    x = torch.randn(5, 2, E)
    outs = []
    for module in (ref.train(), fast.train()):
        torch.manual_seed(3)
        outs.append(call(module, x))
    if kind == "attention" or p > 0.9999:
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert outs[1].shape == x.shape and torch.isfinite(outs[1]).all()


def test_torch_jit_script_refuses_every_module_with_one_clear_error():
    # TorchScript cannot compile modules that call the ops from Python; it failed with type
    # errors from deep inside them (or "Can't redefine method" on a second try). Each module,
    # and a swapped torch.nn model, now names itself and the ways out.
    modules = [
        fnn.LayerNorm(E), fnn.RMSNorm(E), fnn.FeedForward(E, 32), fnn.MultiheadAttention(E, H),
        fnn.TransformerEncoderLayer(E, H, 32), fnn.TransformerDecoderLayer(E, H, 32),
        fnn.Transformer(E, H, 1, 1, 32),
    ]  # fmt: skip
    swapped = nn.Sequential(nn.Linear(E, E), nn.LayerNorm(E))
    fastformer.swap(swapped)
    for module in [*modules, swapped]:
        with pytest.raises(RuntimeError, match="torch.jit.script cannot compile fastformer.nn"):
            torch.jit.script(module)


@pytest.mark.parametrize(
    "op", ["attention", "ffn", "dropout_add_layer_norm", "encoder_layer"]
)  # fmt: skip
def test_torch_jit_trace_draws_a_dropout_seed_each_call(op):
    # A trace recorded the eager paths: a seed drawn at trace time was a constant (one mask for
    # every call), so dropout was refused. The ops' custom ops, which a trace records now, draw
    # theirs each run: a new mask a call, the eager call's under the same torch.manual_seed.
    from fastformer.ops import attention, ffn, layer_norm

    x = torch.randn(2, 4, E)
    w1, w2 = torch.randn(32, E), torch.randn(E, 32)
    calls = {
        "attention": lambda x: attention.scaled_dot_product_attention(
            *(x.view(2, 4, H, E // H).transpose(1, 2),) * 3, dropout_p=0.5
        ),
        "ffn": lambda x: ffn.ffn(x, w1, None, w2, None, "relu", 0.5),
        "dropout_add_layer_norm": lambda x: layer_norm.dropout_add_layer_norm(
            x, x, None, None, dropout_p=0.5
        ),
        "encoder_layer": fnn.TransformerEncoderLayer(E, H, 32, 0.5).train(),
    }
    traced = torch.jit.trace(calls[op], (x,), check_trace=False)
    assert not torch.equal(traced(x), traced(x))
    torch.manual_seed(5)
    got = traced(x)
    torch.manual_seed(5)
    torch.testing.assert_close(got, calls[op](x), rtol=0, atol=0)


def test_torch_jit_trace_refuses_a_seed_drawn_on_the_host_while_tracing():
    # What the ops no longer do under a trace (test above); a path that did would bake the
    # seed into the trace as a constant.
    from fastformer.ops import rng

    with pytest.raises(RuntimeError, match="cannot be recorded by torch.jit.trace"):
        torch.jit.trace(lambda: torch.tensor(rng.call_seed(torch.device("cpu"), 0.5)), ())


def test_torch_jit_trace_of_a_swapped_layer_checks_saves_and_trains(tmp_path):
    # The eager paths depend on grad mode: the trace's own check (a rerun under no_grad)
    # failed, a trace under grad held Python Functions torch.jit.save refuses, and a trace
    # under no_grad kept no pre / activation for a backward. It records the custom ops now.
    torch.manual_seed(0)
    ref = nn.TransformerEncoderLayer(E, H, 32, 0.0, batch_first=True)
    fast = copy.deepcopy(ref)
    fastformer.swap(fast)
    x, y = torch.randn(B, S, E), torch.randn(B + 1, S + 2, E)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            traced = torch.jit.trace(fast, (x,))  # check_trace: the rerun agrees
        torch.jit.save(traced, tmp_path / "layer.pt")
        loaded = torch.jit.load(tmp_path / "layer.pt")
        kinds = {n.kind() for n in loaded.inlined_graph.nodes()}
        assert {"fastformer::attention", "fastformer::ffn", "fastformer::layer_norm"} <= kinds
        got, want = loaded(y), ref(y)
        torch.testing.assert_close(got, want)
        grads = torch.autograd.grad(got.square().sum(), list(loaded.parameters()))
        expected = torch.autograd.grad(want.square().sum(), list(ref.parameters()))
        for g, e in zip(grads, expected):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_jit_trace_keeps_rows_without_keys_at_zero(monkeypatch, dtype):
    # The torch backend skipped zeroing rows that every mask leaves without a key when the
    # example had none: a trace then froze that choice, and such rows came out NaN.
    from fastformer.ops import attention

    monkeypatch.setenv("FASTFORMER_BACKEND_ATTENTION", "torch")
    q, k, v = (torch.randn(2, H, 5, 8, generator=torch.Generator().manual_seed(i)).to(dtype)
               for i in range(3))  # fmt: skip
    lse = attention.scaled_dot_product_attention_with_lse
    for name, mask in (("key_padding_mask", torch.zeros(2, 5, dtype=torch.bool)),
                       ("attn_mask", torch.zeros(5, 5))):  # fmt: skip

        def fn(q, k, v, m, name=name):
            return lse(q, k, v, **{name: m})

        traced = torch.jit.trace(fn, (q, k, v, mask), check_trace=False)
        emptied = mask.clone()
        emptied[1] = True if mask.dtype == torch.bool else float("-inf")
        for got, want in zip(traced(q, k, v, emptied), fn(q, k, v, emptied)):
            assert not got.isnan().any(), name
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_module_input_errors_name_the_module_s_arguments(monkeypatch):
    # FeedForward's wrong width was reported as the op's "w1 must have shape ...", an argument
    # its caller never passed; MultiheadAttention checked its masks after the projection GEMMs.
    with pytest.raises(ValueError, match=r"x must have last dim d_model=16, got shape \(2, 9\)"):
        fnn.FeedForward(16, 32)(torch.randn(2, 9))
    # a linear1 that is no plain Linear (quantized, wrapped) still runs the unfused path
    quantized = torch.ao.quantization.quantize_dynamic(fnn.FeedForward(16, 32).eval(), {nn.Linear})
    assert quantized(torch.randn(2, 16)).shape == (2, 16)
    mha = fnn.MultiheadAttention(E, H, batch_first=True)
    monkeypatch.setattr(mha, "_project", lambda *a: pytest.fail("projected before the checks"))
    x = torch.randn(B, S, E)
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):
        mha(x, x, x, key_padding_mask=torch.zeros(B, S + 1, dtype=torch.bool), need_weights=False)


def test_forward_pre_hook_of_linear1_runs():
    # A pre-hook (no test had one) must send FeedForward down the unfused path that runs it.
    torch.manual_seed(0)
    ff = fnn.FeedForward(8, 16, dropout=0.0)
    ff.linear1.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    x = torch.randn(3, 8)
    torch.testing.assert_close(ff(x), ff.linear2(F.relu(ff.linear1(x))))


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_other_plain_activations_keep_torch_s_init(activation):
    # Only the default activation's init was compared: linear1 rebuilt for every activation
    # (not only the gated ones) drew other weights from the same seed.
    torch.manual_seed(0)
    ours = fnn.TransformerEncoderLayer(16, 2, 32, activation=activation)
    torch.manual_seed(0)
    theirs = nn.TransformerEncoderLayer(16, 2, 32)
    for (n1, a), (n2, b) in zip(ours.state_dict().items(), theirs.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b), n1


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_each_dropout_module_acts_where_torch_nn_s_does(kind, norm_first):
    """p = 1 in one dropout module at a time (0 in the others), in training: deterministic,
    and each module (dropout, dropout1-3, the attentions') must act where torch.nn's does (the
    layers' other dropout tests set one p for all, so a dropout1 read for dropout2 passed)."""
    torch_cls, fast_cls = {
        "encoder": (nn.TransformerEncoderLayer, fnn.TransformerEncoderLayer),
        "decoder": (nn.TransformerDecoderLayer, fnn.TransformerDecoderLayer),
    }[kind]
    theirs, ours = _pair(
        torch_cls, fast_cls, E, H, FF, dropout=0.0, batch_first=True, norm_first=norm_first
    )
    args = (_seq(True, T),) if kind == "encoder" else (_seq(True, T), _seq(True, S, seed=1))
    for _ in dropout_sites_one_at_a_time(theirs, ours):
        module_parity(ours, theirs, args, None, ["x", "memory"])


@pytest.mark.parametrize("norm_first", [False, True])
def test_a_dropout_module_in_eval_mode_does_not_drop_in_a_training_layer(norm_first):
    # torch.nn's residual dropout is a module of its own: its training flag decides, not the
    # layer's (the fused op read drop.training; the layer's flag passed every other test).
    theirs, ours = _pair(
        nn.TransformerEncoderLayer, fnn.TransformerEncoderLayer, E, H, FF, dropout=0.0,
        batch_first=True, norm_first=norm_first,
    )  # fmt: skip
    for layer in (theirs, ours):
        layer.train()
        layer.dropout1.p = 0.5
        layer.dropout1.eval()
    module_parity(ours, theirs, (_seq(True, S),), None, ["src"])


def test_pre_ln_fallback_reasons_name_the_norm_fused_with_each_dropout():
    # Pre-LN fuses dropout_i's residual add with norm_(i+1) (norm1 runs on its own).
    layer = fnn.TransformerEncoderLayer(E, H, FF, norm_first=True)
    layer.norm2.eps = 0.0
    assert any(r.startswith("norm2 + dropout1: eps=0.0") for r in layer.fallback_reasons), (
        layer.fallback_reasons
    )
    decoder = fnn.TransformerDecoderLayer(E, H, FF, norm_first=True)
    decoder.norm3.eps = 0.0
    assert any(r.startswith("norm3 + dropout2: eps=0.0") for r in decoder.fallback_reasons), (
        decoder.fallback_reasons
    )


def test_positional_encoding_takes_max_len_positions():
    ours = fnn.PositionalEncoding(E, dropout=0.0, max_len=S)
    x = _randn(B, S, E, grad=False)
    torch.testing.assert_close(ours(x), reference.PositionalEncoding(E, 0.0, S)(x), atol=0, rtol=0)


def test_encoder_keeps_the_enable_nested_tensor_argument():
    # Accepted and ignored, but kept as torch.nn keeps it (code reading the attribute).
    layer = fnn.TransformerEncoderLayer(E, H, FF)
    for flag in (True, False):
        encoder = fnn.TransformerEncoder(layer, 1, enable_nested_tensor=flag)
        assert encoder.enable_nested_tensor is flag


@pytest.mark.parametrize("mask", ["none", "biased_causal"])
@pytest.mark.parametrize("batch_first", [False, True])
def test_multihead_attention_is_causal_with_need_weights_follows_torch(batch_first, mask):
    # need_weights=True takes torch.nn's path. is_causal alone: it needs the (Lq, Lk) mask
    # is_causal stands for, sized from the sequence dim of each layout (cross-attention with
    # Lq != Lk != batch). With an attn_mask: torch.nn applies that mask as given (the hint is
    # not used for the weights), so a bias on the causal mask counts.
    theirs, ours = _pair(
        nn.MultiheadAttention, fnn.MultiheadAttention, E, H, batch_first=batch_first
    )
    q, k = _seq(batch_first, T, seed=1), _seq(batch_first, S, seed=2)
    blocked = torch.ones(T, S, dtype=torch.bool).triu(1)
    if mask == "none":
        out, weights = ours(q, k, k, need_weights=True, is_causal=True)
        want, want_weights = theirs(q, k, k, need_weights=True, attn_mask=blocked)
    else:
        biased = _randn(T, S, seed=3, grad=False).masked_fill(blocked, float("-inf"))
        out, weights = ours(q, k, k, need_weights=True, attn_mask=biased, is_causal=True)
        want, want_weights = theirs(q, k, k, need_weights=True, attn_mask=biased, is_causal=True)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_infinite_eps_runs_torch_nn_path_with_reason(kind):
    # torch.nn takes eps=inf (the output is then the bias, or 0); the ops take a finite eps.
    theirs, ours = _pair(getattr(nn, kind), getattr(fnn, kind), E, eps=math.inf)
    assert any("eps=inf" in why for why in ours.fallback_reasons), ours.fallback_reasons
    module_parity(ours, theirs, (_randn(B, 4, E) * 3 + 1,), None, ["input"])


@pytest.mark.parametrize("activation", list(reference.ACTIVATIONS))
def test_feed_forward_with_a_hook_runs_the_same_function(activation):
    # A hook on linear1 makes the FFN run unfused (torch.nn's modules and the eager activation,
    # gated ones included): it must still be the reference's function.
    ours = perturb(fnn.FeedForward(E, FF, dropout=0.0, activation=activation))
    ours.linear1.register_forward_hook(lambda module, args, out: None)
    assert "linear1 is not a plain nn.Linear without hooks" in ours.fallback_reasons
    module_parity(ours, _ReferenceFFN(ours, activation), (_randn(B, S, E),), None, ["x"])
