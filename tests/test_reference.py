"""Tests of fastformer.reference, the eager ground truth, against torch itself.

Every comparison is against an independent torch implementation (F.scaled_dot_product_attention,
F.layer_norm, torch.nn.Transformer, ...) or a hand composition of torch ops, in float64 where
exactness matters, so each test can fail if the reference is wrong.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fastformer import reference as ref
from fastformer.testing import dropout_sites_one_at_a_time

# torch.nn's own warnings about mixing bool padding masks with float attention masks, its
# nested-tensor prototype, and its fast-path eligibility are expected here.
pytestmark = [
    pytest.mark.filterwarnings("ignore:Support for mismatched:UserWarning"),
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning"),
    pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning"),
]

F64 = torch.float64
ATOL = 1e-10


def _close(a, b, atol=ATOL, rtol=0.0):
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def _qkv(b=2, h=4, hkv=None, lq=7, lk=9, d=16, dv=None, dtype=F64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    hkv = hkv or h
    dv = dv or d
    q = torch.randn(b, h, lq, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, lk, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, lk, dv, generator=g, dtype=dtype)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _grads(out, inputs, seed=1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, inputs, g)


# --------------------------------------------------------------------------- attention


def _sdpa_cases():
    g = torch.Generator().manual_seed(3)
    bool_mask = torch.rand(2, 1, 7, 9, generator=g) > 0.3
    bool_mask[..., 0] = True  # no fully masked row: SDPA's math path would give NaN there
    float_mask = torch.randn(2, 4, 7, 9, generator=g, dtype=F64)
    return {
        "plain": {},
        "bool_mask": {"attn_mask": bool_mask},
        "float_mask": {"attn_mask": float_mask},
        "causal_lq<lk": {"is_causal": True},
        "scale": {"scale": 0.3},
    }


@pytest.mark.parametrize("case", list(_sdpa_cases()))
def test_sdpa_matches_torch(case):
    kwargs = _sdpa_cases()[case]
    q, k, v = _qkv(grad=True)
    out = ref.scaled_dot_product_attention(q, k, v, **kwargs)
    expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
    _close(out, expected)
    for g, ge in zip(_grads(out, (q, k, v)), _grads(expected, (q, k, v)), strict=True):
        _close(g, ge)


@pytest.mark.parametrize("lq,lk", [(9, 4), (1, 5), (5, 5)])
def test_sdpa_causal_top_left_and_lq_ne_lk(lq, lk):
    q, k, v = _qkv(lq=lq, lk=lk, dv=8)
    out = ref.scaled_dot_product_attention(q, k, v, is_causal=True)
    _close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_sdpa_gqa():
    q, k, v = _qkv(h=6, hkv=2, grad=True)
    out = ref.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    expected = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    _close(out, expected)
    for g, ge in zip(_grads(out, (q, k, v)), _grads(expected, (q, k, v)), strict=True):
        _close(g, ge)
    with pytest.raises(ValueError, match="enable_gqa"):
        ref.scaled_dot_product_attention(q, k, v)


def test_sdpa_causal_combined_with_masks_and_lse():
    q, k, v = _qkv(lq=6, lk=8)
    g = torch.Generator().manual_seed(5)
    attn = torch.rand(1, 4, 6, 8, generator=g) > 0.2
    attn[..., 0] = True
    kpm = torch.zeros(2, 8, dtype=torch.bool)
    kpm[1, 5:] = True
    scale = 0.2
    out, lse = ref.scaled_dot_product_attention(
        q, k, v, attn, is_causal=True, scale=scale, key_padding_mask=kpm, return_lse=True
    )
    allowed = attn & torch.ones(6, 8, dtype=torch.bool).tril() & ~kpm[:, None, None, :]
    _close(out, F.scaled_dot_product_attention(q, k, v, allowed, scale=scale))
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, -math.inf)
    assert lse.shape == (2, 4, 6) and lse.dtype == F64
    _close(lse, torch.logsumexp(scores, dim=-1))


def test_sdpa_float_mask_lse():
    q, k, v = _qkv()
    mask = torch.randn(2, 4, 7, 9, dtype=F64)
    _, lse = ref.scaled_dot_product_attention(q, k, v, mask, return_lse=True)
    _close(lse, torch.logsumexp(q @ k.transpose(-1, -2) / 4.0 + mask, dim=-1))


def test_sdpa_dropout_mask_matches_manual():
    q, k, v = _qkv()
    keep = torch.rand(2, 4, 7, 9, generator=torch.Generator().manual_seed(2)) > 0.25
    p = 0.25
    out = ref.scaled_dot_product_attention(q, k, v, dropout_p=p, dropout_mask=keep)
    probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(16), dim=-1)
    _close(out, (probs * keep / (1 - p)) @ v)
    # a broadcastable (per-head-shared) mask too
    keep1 = keep[:1, :1]
    out1 = ref.scaled_dot_product_attention(q, k, v, dropout_p=p, dropout_mask=keep1)
    _close(out1, (probs * keep1 / (1 - p)) @ v)


@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("how", ["bool", "float", "padding"])
def test_sdpa_fully_masked_rows_zero_no_nan(dtype, how):
    q, k, v = _qkv(lq=5, lk=6, dtype=dtype, grad=True)
    allowed = torch.ones(2, 1, 5, 6, dtype=torch.bool)
    allowed[0, :, 2] = False  # query row 2 of batch 0 sees no key
    kwargs = {}
    if how == "bool":
        kwargs["attn_mask"] = allowed
    elif how == "float":
        kwargs["attn_mask"] = torch.zeros(allowed.shape, dtype=dtype).masked_fill(
            ~allowed, -math.inf
        )
    else:  # batch 1 is entirely padding: every row of batch 1 is fully masked
        kwargs["key_padding_mask"] = torch.tensor([[False] * 6, [True] * 6])
    out, lse = ref.scaled_dot_product_attention(q, k, v, return_lse=True, **kwargs)
    dead = (0, slice(None), 2) if how != "padding" else (1,)
    assert torch.all(out[dead] == 0)
    assert torch.all(torch.isneginf(lse[dead]))
    assert not out.isnan().any()
    (out.sum() + lse[torch.isfinite(lse)].sum()).backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.all(q.grad[dead] == 0)
    if dtype == F64 and how != "padding":  # the live rows still match torch
        live = allowed.expand(2, 4, 5, 6).any(-1)
        qd, kd, vd = (t.detach() for t in (q, k, v))
        expected = F.scaled_dot_product_attention(qd, kd, vd, allowed)
        _close(out.detach()[live], expected[live])


def test_sdpa_errors():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="dropout_mask"):
        ref.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout_p"):
        ref.scaled_dot_product_attention(q, k, v, dropout_p=1.5)
    with pytest.raises(ValueError, match="4-D"):
        ref.scaled_dot_product_attention(q[0], k[0], v[0])


# --------------------------------------------------------------------------- norms and FFN


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [(3, 5, 7), (4, 1)])
def test_layer_norm_matches_torch(affine, shape):
    x = torch.randn(shape, dtype=F64) * 3 + 1
    n = shape[-1]
    w = torch.randn(n, dtype=F64) if affine else None
    b = torch.randn(n, dtype=F64) if affine else None
    _close(ref.layer_norm(x, (n,), w, b, 1e-5), F.layer_norm(x, (n,), w, b, 1e-5))
    _close(ref.layer_norm(x, n, w, b, 1e-3), F.layer_norm(x, (n,), w, b, 1e-3))


def test_layer_norm_multi_dim_and_module():
    x = torch.randn(2, 3, 4, 5, dtype=F64)
    w, b = torch.randn(4, 5, dtype=F64), torch.randn(4, 5, dtype=F64)
    _close(ref.layer_norm(x, (4, 5), w, b), F.layer_norm(x, (4, 5), w, b))
    torch_ln = nn.LayerNorm(5, eps=1e-6, dtype=F64)
    nn.init.normal_(torch_ln.weight)
    nn.init.normal_(torch_ln.bias)
    ref_ln = ref.LayerNorm(5, eps=1e-6, dtype=F64)
    ref_ln.load_state_dict(torch_ln.state_dict(), strict=True)
    _close(ref_ln(x), torch_ln(x))
    assert ref.LayerNorm(5, bias=False).state_dict().keys() == {"weight"}


@pytest.mark.parametrize("eps", [None, 1e-3])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_rms_norm_matches_torch(eps, dtype):
    x = torch.randn(3, 6, 10, dtype=dtype) * 0.01  # small values make eps visible
    w = torch.randn(10, dtype=dtype)
    tol = ATOL if dtype == F64 else 1e-5
    _close(ref.rms_norm(x, (10,), w, eps), F.rms_norm(x, (10,), w, eps), atol=tol, rtol=tol)
    _close(
        ref.rms_norm(x, (6, 10), None, eps), F.rms_norm(x, (6, 10), None, eps), atol=tol, rtol=tol
    )
    torch_rms = nn.RMSNorm(10, eps=eps, dtype=dtype)
    nn.init.normal_(torch_rms.weight)
    ref_rms = ref.RMSNorm(10, eps=eps, dtype=dtype)
    ref_rms.load_state_dict(torch_rms.state_dict(), strict=True)
    _close(ref_rms(x), torch_rms(x), atol=tol, rtol=tol)


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_float16_norms_of_large_activations_match_torch(norm):
    # The squares were summed in float16: past |x| ~ 256 they overflowed, every output was 0
    # (3.2-4.2 from float64 where torch's float16 is within 1e-3), and the parity bound, twice
    # that error, let a kernel returning zeros pass.
    x = (torch.randn(4, 512, generator=torch.Generator().manual_seed(0)) * 300).half()
    if norm == "layer_norm":
        got, want = ref.layer_norm(x, 512), F.layer_norm(x, (512,))
    else:
        got, want = ref.rms_norm(x, 512), F.rms_norm(x, (512,))
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_float16_softmax_of_many_keys_does_not_overflow():
    # 70000 equal scores: the float16 sum of their exponentials (1 each) was inf: out 0, lse inf.
    q = torch.zeros(1, 1, 1, 4, dtype=torch.float16)
    k = torch.zeros(1, 1, 70000, 4, dtype=torch.float16)
    out, lse = ref.scaled_dot_product_attention(q, k, torch.ones_like(k), return_lse=True)
    assert torch.allclose(out.float(), torch.ones(1, 1, 1, 4), atol=2e-3)
    assert lse.item() == pytest.approx(math.log(70000), rel=1e-6)


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("prenorm", [True, False])
def test_dropout_add_layer_norm_matches_manual(with_residual, prenorm):
    x = torch.randn(2, 5, 8, dtype=F64)
    residual = torch.randn(2, 5, 8, dtype=F64) if with_residual else None
    w, b = torch.randn(8, dtype=F64), torch.randn(8, dtype=F64)
    keep = torch.rand(2, 5, 8) > 0.3
    p = 0.3
    pre = torch.where(keep, x / (1 - p), torch.zeros_like(x))
    if with_residual:
        pre = pre + residual
    expected = F.layer_norm(pre, (8,), w, b, 1e-6)
    got = ref.dropout_add_layer_norm(x, residual, w, b, 1e-6, p, prenorm, keep_mask=keep)
    if prenorm:
        _close(got[0], expected)
        _close(got[1], pre)
    else:
        _close(got, expected)
    # p = 0: no mask needed, plain add + norm
    got0 = ref.dropout_add_layer_norm(x, residual, w, b)
    _close(got0, F.layer_norm(x if residual is None else x + residual, (8,), w, b))
    with pytest.raises(ValueError, match="keep_mask"):
        ref.dropout_add_layer_norm(x, residual, w, b, dropout_p=0.1)


def _manual_act(name, h):
    if name in ("swiglu", "geglu"):
        half = h.shape[-1] // 2
        gate, up = h[..., :half], h[..., half:]
        return (F.silu(gate) if name == "swiglu" else F.gelu(gate)) * up
    return {
        "relu": torch.relu,
        "gelu": lambda t: 0.5 * t * (1 + torch.erf(t / math.sqrt(2))),
        "gelu_tanh": lambda t: nn.GELU(approximate="tanh")(t),
        "silu": lambda t: t * torch.sigmoid(t),
    }[name](h)


@pytest.mark.parametrize("activation", ref.ACTIVATIONS)
@pytest.mark.parametrize("bias", [True, False])
def test_ffn_matches_linear_composition(activation, bias):
    d_model, d_ff = 8, 12
    gated = activation in ("swiglu", "geglu")
    lin1 = nn.Linear(d_model, 2 * d_ff if gated else d_ff, bias=bias, dtype=F64)
    lin2 = nn.Linear(d_ff, d_model, bias=bias, dtype=F64)
    x = torch.randn(3, 4, d_model, dtype=F64)
    b1 = lin1.bias if bias else None
    b2 = lin2.bias if bias else None
    got = ref.ffn(x, lin1.weight, b1, lin2.weight, b2, activation)
    _close(got, lin2(_manual_act(activation, lin1(x))))
    keep = torch.rand(3, 4, d_ff) > 0.2
    got = ref.ffn(x, lin1.weight, b1, lin2.weight, b2, activation, 0.2, keep_mask=keep)
    _close(got, lin2(_manual_act(activation, lin1(x)) * keep / 0.8))


def test_ffn_errors():
    x, w1, w2 = torch.randn(2, 4), torch.randn(6, 4), torch.randn(4, 6)
    with pytest.raises(ValueError, match="keep_mask"):
        ref.ffn(x, w1, None, w2, None, "relu", dropout_p=0.1)
    with pytest.raises(ValueError, match="activation"):
        ref.ffn(x, w1, None, w2, None, "tanh")
    # A (tokens, d_ff) mask of a 3-D x broadcast into (4, 4, 6) in silence, or failed deep in
    # torch (ffn_keep_mask's shape, which its docstring fed as is).
    x3, keep = torch.randn(4, 1, 4), torch.ones(4, 6, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"keep_mask of shape \(4, 6\) does not broadcast"):
        ref.ffn(x3, w1, None, w2, None, "relu", 0.1, keep_mask=keep)
    out = ref.ffn(x3, w1, None, w2, None, "relu", 0.1, keep_mask=keep.view(4, 1, 6))
    assert out.shape == (4, 1, 4)
    with pytest.raises(ValueError, match=r"keep_mask of shape \(8, 6\) does not broadcast"):
        ref.ffn(torch.randn(2, 4, 4), w1, None, w2, None, "relu", 0.1, keep_mask=keep.repeat(2, 1))


# --------------------------------------------------------------------------- mask helpers


def test_mask_helpers():
    lengths = torch.tensor([3, 0, 5])
    expected = torch.tensor([[j >= n for j in range(5)] for n in (3, 0, 5)])
    assert torch.equal(ref.padding_mask(lengths, 5), expected)
    torch_mask = nn.Transformer.generate_square_subsequent_mask(6)
    assert torch.equal(ref.causal_mask(6, dtype=torch.float32), torch_mask)
    assert torch.equal(ref.causal_mask(6), torch.isinf(torch_mask))
    assert torch.equal(ref.Transformer.generate_square_subsequent_mask(6), torch_mask)
    tgt = torch.tensor([[5, 6, 7, 2], [8, 2, 0, 0]])
    assert ref.shift_right(tgt, 1).tolist() == [[1, 5, 6, 7], [1, 8, 2, 0]]


def test_positional_encoding_formula():
    d_model, length = 6, 7
    pe = ref.PositionalEncoding(d_model, dropout=0.0, max_len=50)
    assert "pe" not in pe.state_dict()
    x = torch.randn(2, length, d_model)
    formula = torch.tensor(
        [
            [(math.sin if i % 2 == 0 else math.cos)(pos / 10000 ** (2 * (i // 2) / d_model))
             for i in range(d_model)]
            for pos in range(length)
        ],
        dtype=torch.float64,
    )  # fmt: skip
    assert (pe(x)[1] - x[1] - formula).abs().max() < 1e-5
    # After .double() the table is the float64 formula, not the float32 one converted (3e-8).
    assert (pe.double().pe[:length] - formula).abs().max() < 1e-14
    table = pe.pe
    assert pe.share_memory().pe is table and table.is_shared()  # only a dtype change rebuilds
    # A round trip through 16 bits kept the table rounded (2e-3 off after bfloat16).
    fresh = ref.PositionalEncoding(d_model, max_len=50).pe
    assert torch.equal(pe.bfloat16().float().pe, fresh)
    # Built on the meta device, then materialized: to_empty() left pe uninitialized (pe is not
    # in the state_dict, so loading one cannot fill it); the table is rebuilt there.
    with torch.device("meta"):
        lazy = ref.PositionalEncoding(d_model, dropout=0.0, max_len=50)
    lazy.to_empty(device="cpu")
    assert torch.equal(lazy.pe, ref.PositionalEncoding(d_model, max_len=50).pe)
    lazy.pe.fill_(7.0)  # as to_empty() from another device leaves it: reset_parameters mends
    lazy.reset_parameters()
    assert torch.equal(lazy.pe, ref.PositionalEncoding(d_model, max_len=50).pe)


# --------------------------------------------------------------------------- modules vs torch.nn


def _copy_weights(src_module, dst_module):
    """Load src's state_dict into dst with strict=True (identical names both ways)."""
    dst_module.load_state_dict(src_module.state_dict(), strict=True)
    return dst_module


def _seq(x, batch_first):
    """(B, L, E) test data -> the module's layout."""
    return x if batch_first else x.transpose(0, 1)


def _masks(b=3, s=7, t=5):
    src_kpm = torch.zeros(b, s, dtype=torch.bool)
    src_kpm[1, 4:] = True
    src_kpm[2, 6:] = True
    tgt_kpm = torch.zeros(b, t, dtype=torch.bool)
    tgt_kpm[0, 3:] = True  # position 0 stays visible: no fully masked causal row
    return src_kpm, tgt_kpm


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("mask_kind", ["bool2d", "float3d", "float_kpm"])
def test_multihead_attention_matches_torch(batch_first, need_weights, mask_kind):
    torch.manual_seed(0)
    b, lq, lk, e, h = 3, 5, 7, 16, 4
    theirs = nn.MultiheadAttention(e, h, batch_first=batch_first, dtype=F64).eval()
    nn.init.normal_(theirs.in_proj_bias)
    mine = _copy_weights(theirs, ref.MultiheadAttention(e, h, batch_first=batch_first, dtype=F64))
    _copy_weights(mine, theirs)
    query = _seq(torch.randn(b, lq, e, dtype=F64), batch_first)
    memory = _seq(torch.randn(b, lk, e, dtype=F64), batch_first)
    kpm, _ = _masks(b, lk)
    attn_mask = None
    if mask_kind == "bool2d":
        attn_mask = torch.rand(lq, lk) > 0.7
        attn_mask[:, 0] = False
    elif mask_kind == "float3d":
        attn_mask = torch.randn(b * h, lq, lk, dtype=F64)
    else:
        kpm = torch.zeros(b, lk, dtype=F64).masked_fill(kpm, -math.inf)
    kwargs = dict(key_padding_mask=kpm, attn_mask=attn_mask, need_weights=need_weights)
    for avg in (True, False):
        out, w = mine(query, memory, memory, average_attn_weights=avg, **kwargs)
        out_t, w_t = theirs(query, memory, memory, average_attn_weights=avg, **kwargs)
        _close(out, out_t)
        if need_weights:
            _close(w, w_t)
        else:
            assert w is None


def test_multihead_attention_unbatched():
    theirs = nn.MultiheadAttention(8, 2, dtype=F64)
    mine = _copy_weights(theirs, ref.MultiheadAttention(8, 2, dtype=F64))
    x, kpm = torch.randn(4, 8, dtype=F64), torch.tensor([False, False, True, False])
    _close(mine(x, x, x, kpm)[0], theirs(x, x, x, kpm)[0])


def test_multihead_attention_takes_batch_first_by_name_only():
    # torch's fifth positional argument is add_bias_kv, which the reference lacks: a positional
    # batch_first here would have stood for it silently.
    with pytest.raises(TypeError):
        ref.MultiheadAttention(8, 2, 0.0, True, True)
    assert ref.MultiheadAttention(8, 2, 0.0, True, batch_first=True).batch_first


LAYER_KW = dict(d_model=16, nhead=4, dim_feedforward=24, dropout=0.0, dtype=F64)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_layer_matches_torch(norm_first, batch_first, activation):
    torch.manual_seed(0)
    kw = dict(LAYER_KW, norm_first=norm_first, batch_first=batch_first, activation=activation)
    theirs = nn.TransformerEncoderLayer(**kw).eval()
    mine = _copy_weights(theirs, ref.TransformerEncoderLayer(**kw)).eval()
    src = _seq(torch.randn(3, 7, 16, dtype=F64), batch_first)
    kpm, _ = _masks()
    causal = nn.Transformer.generate_square_subsequent_mask(7, dtype=F64)
    for mask, is_causal in [(None, False), (causal, True), (causal.isinf(), False)]:
        out = mine(src, mask, kpm, is_causal=is_causal)
        _close(out, theirs(src, mask, kpm, is_causal=is_causal))


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("batch_first", [True, False])
def test_decoder_layer_matches_torch(norm_first, batch_first):
    torch.manual_seed(0)
    kw = dict(LAYER_KW, norm_first=norm_first, batch_first=batch_first)
    theirs = nn.TransformerDecoderLayer(**kw).eval()
    mine = _copy_weights(theirs, ref.TransformerDecoderLayer(**kw)).eval()
    tgt = _seq(torch.randn(3, 5, 16, dtype=F64, requires_grad=True), batch_first)
    memory = _seq(torch.randn(3, 7, 16, dtype=F64), batch_first)
    src_kpm, tgt_kpm = _masks()
    causal = nn.Transformer.generate_square_subsequent_mask(5, dtype=F64)
    memory_mask = torch.rand(5, 7) > 0.8
    memory_mask[:, 0] = False
    args = (tgt, memory, causal, memory_mask, tgt_kpm, src_kpm)
    out = mine(*args, tgt_is_causal=True)
    expected = theirs(*args, tgt_is_causal=True)
    _close(out, expected)
    _close(_grads(out, tgt)[0], _grads(expected, tgt)[0])


def _pair(norm_first, batch_first, **extra):
    """A torch.nn.Transformer and a reference one with identical weights (float64, eval)."""
    torch.manual_seed(0)
    kw = dict(
        d_model=16,
        nhead=4,
        num_encoder_layers=2,
        num_decoder_layers=2,
        dim_feedforward=24,
        dropout=0.0,
        norm_first=norm_first,
        batch_first=batch_first,
        dtype=F64,
        **extra,
    )
    theirs = nn.Transformer(**kw).eval()
    for name, p in theirs.named_parameters():  # non-trivial norms and biases
        if p.dim() == 1:
            nn.init.normal_(p, mean=1.0 if "norm" in name else 0.0, std=0.3)
    mine = _copy_weights(theirs, ref.Transformer(**kw)).eval()
    return theirs, mine


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_matches_torch(norm_first, batch_first):
    theirs, mine = _pair(norm_first, batch_first)
    src = _seq(torch.randn(3, 7, 16, dtype=F64), batch_first)
    tgt = _seq(torch.randn(3, 5, 16, dtype=F64), batch_first)
    src_kpm, tgt_kpm = _masks()
    kwargs = dict(
        tgt_mask=nn.Transformer.generate_square_subsequent_mask(5, dtype=F64),
        src_key_padding_mask=src_kpm,
        tgt_key_padding_mask=tgt_kpm,
        memory_key_padding_mask=src_kpm,
        tgt_is_causal=True,
    )
    # With grad enabled (parameters require grad) torch.nn takes its plain math path.
    out, expected = mine(src, tgt, **kwargs), theirs(src, tgt, **kwargs)
    _close(out, expected)
    # Parameter gradients, matched by name.
    out.square().sum().backward()
    expected.square().sum().backward()
    mine_params = dict(mine.named_parameters())
    for name, p in theirs.named_parameters():
        _close(mine_params[name].grad, p.grad, atol=1e-9)
    # Under no_grad torch.nn's encoder takes the nested-tensor fast path (post-norm,
    # batch_first), which writes 0 at padded src positions of the encoder output instead of
    # the computed values. Those positions are masked out of the decoder's cross-attention by
    # memory_key_padding_mask, so the decoder output must still agree everywhere.
    with torch.no_grad():
        _close(mine(src, tgt, **kwargs), theirs(src, tgt, **kwargs))


def test_encoder_nested_fast_path_differs_only_at_padding():
    # torch.nn.TransformerEncoder (enable_nested_tensor=True) in eval + no_grad packs the
    # batch as a nested tensor and returns 0 at padded positions; the reference computes
    # them like any other. Compare non-padded positions only.
    torch.manual_seed(0)
    kw = dict(LAYER_KW, batch_first=True)
    theirs = nn.TransformerEncoder(nn.TransformerEncoderLayer(**kw), 2, enable_nested_tensor=True)
    mine = _copy_weights(theirs, ref.TransformerEncoder(ref.TransformerEncoderLayer(**kw), 2))
    theirs.eval()
    src = torch.randn(3, 7, 16, dtype=F64)
    kpm, _ = _masks()
    with torch.no_grad():
        out, expected = mine(src, src_key_padding_mask=kpm), theirs(src, src_key_padding_mask=kpm)
    _close(out[~kpm], expected[~kpm])
    assert torch.all(expected[kpm] == 0)  # documents the fast path's behaviour


def test_state_dict_round_trip():
    theirs, _ = _pair(norm_first=False, batch_first=True)
    mine = ref.Transformer(16, 4, 2, 2, 24, dropout=0.0, batch_first=True, dtype=F64)
    mine.load_state_dict(theirs.state_dict(), strict=True)
    back = nn.Transformer(16, 4, 2, 2, 24, dropout=0.0, batch_first=True, dtype=F64)
    back.load_state_dict(mine.state_dict(), strict=True)
    assert list(mine.state_dict()) == list(theirs.state_dict())
    for name, t in theirs.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name
    src, tgt = torch.randn(2, 6, 16, dtype=F64), torch.randn(2, 4, 16, dtype=F64)
    _close(mine.eval()(src, tgt), back.eval()(src, tgt))


def test_errors_dropout_without_mask():
    q, k, v = _qkv()
    x = torch.randn(2, 3, 4)
    w1, w2 = torch.randn(5, 4), torch.randn(4, 5)
    for call in (
        lambda: ref.scaled_dot_product_attention(q, k, v, dropout_p=0.5),
        lambda: ref.dropout_add_layer_norm(x, x, None, None, dropout_p=0.5),
        lambda: ref.ffn(x, w1, None, w2, None, dropout_p=0.5),
    ):
        with pytest.raises(ValueError):
            call()


# --------------------------------------------------------------------------- the paper's model


def test_transformer_model_wiring_matches_torch():
    """TransformerModel = embeddings * sqrt(d) + PE -> nn.Transformer with causal/padding
    masks -> generator; rebuilt here from torch.nn parts with the same weights."""
    torch.manual_seed(0)
    model = ref.TransformerModel(
        11, 11, 16, 4, 2, 2, 24, dropout=0.0, share_embeddings=True, pad_id=0
    ).double()
    model.eval()
    assert model.tgt_embed is model.src_embed
    assert model.generator.weight is model.tgt_embed.weight
    theirs = nn.Transformer(16, 4, 2, 2, 24, dropout=0.0, batch_first=True, dtype=F64).eval()
    theirs.load_state_dict(model.transformer.state_dict(), strict=True)
    src = torch.tensor([[5, 6, 7, 8, 2], [9, 4, 2, 0, 0]])
    tgt_in = torch.tensor([[1, 3, 4, 5], [1, 10, 0, 0]])
    emb = model.src_embed.weight * 4.0  # sqrt(16)
    pe = model.pos_encoding.pe.double()
    hidden = theirs(
        emb[src] + pe[:5],
        emb[tgt_in] + pe[:4],
        tgt_mask=nn.Transformer.generate_square_subsequent_mask(4, dtype=F64),
        src_key_padding_mask=src == 0,
        tgt_key_padding_mask=tgt_in == 0,
        memory_key_padding_mask=src == 0,
    )
    _close(model(src, tgt_in), model.generator(hidden))


def test_transformer_model_overfits():
    torch.manual_seed(0)
    sentences = [[5, 6, 7, 8, 2], [9, 10, 11, 2, 0], [12, 13, 14, 15, 2], [16, 17, 2, 0, 0]]
    src = torch.tensor(sentences)
    # target: the source words reversed, then EOS (2), then padding (0)
    reverse = [[t for t in row if t not in (0, 2)][::-1] + [2] for row in sentences]
    tgt = torch.tensor([row + [0] * (5 - len(row)) for row in reverse])
    model = ref.TransformerModel(20, 20, 32, 4, 2, 2, 64, dropout=0.0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(300):
        opt.zero_grad()
        loss = model.loss(src, tgt)
        loss.backward()
        opt.step()
        if loss.item() < 0.05:
            break
    assert model.loss(src, tgt).item() < 0.1
    # label smoothing goes to torch's cross-entropy: the smoothed loss is larger
    assert model.loss(src, tgt, label_smoothing=0.1).item() > model.loss(src, tgt).item()


def test_transformer_model_training_dropout_runs():
    torch.manual_seed(0)
    model = ref.TransformerModel(12, 12, 16, 4, 1, 1, 32, dropout=0.5, norm_first=True)
    src, tgt = torch.tensor([[3, 4, 5, 0]]), torch.tensor([[6, 7, 0]])
    model.train()
    a, b = model(src, tgt), model(src, tgt)
    assert not torch.equal(a, b)  # dropout active
    model.loss(src, tgt).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval()
    torch.testing.assert_close(model(src, tgt), model(src, tgt), atol=0, rtol=0)


def test_sdpa_scale_zero_is_a_scale_not_the_default():
    # SDPA takes scale=0.0 as given (uniform attention); a falsy test took the default 1/sqrt(D).
    q, k, v = _qkv()
    out = ref.scaled_dot_product_attention(q, k, v, scale=0.0)
    _close(out, F.scaled_dot_product_attention(q, k, v, scale=0.0))


def test_dropout_p_1_keeps_nothing_whatever_the_mask():
    # p = 1 drops everything (F.dropout(x, 1.0) is 0): a keep-mask of True must not let values
    # through unscaled.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 8, generator=g, dtype=F64)
    w1, b1 = torch.randn(12, 8, generator=g, dtype=F64), torch.randn(12, generator=g, dtype=F64)
    w2, b2 = torch.randn(8, 12, generator=g, dtype=F64), torch.randn(8, generator=g, dtype=F64)
    keep = torch.ones(3, 4, 12, dtype=torch.bool)
    _close(ref.ffn(x, w1, b1, w2, b2, "relu", 1.0, keep_mask=keep), b2.expand(3, 4, 8))
    q, k, v = _qkv()
    out = ref.scaled_dot_product_attention(
        q, k, v, dropout_p=1.0, dropout_mask=torch.ones(2, 4, 7, 9, dtype=torch.bool)
    )
    _close(out, torch.zeros_like(out))


def test_module_dropout_keeps_a_fraction_1_minus_p():
    # The modules draw their own keep-masks: True with probability 1 - p, kept values scaled by
    # 1 / (1 - p) (a mask kept with probability p passed every other test).
    torch.manual_seed(0)
    mha = ref.MultiheadAttention(16, 2, dropout=0.25, batch_first=True, dtype=F64).train()
    x = torch.randn(4, 32, 16, dtype=F64)
    _, weights = mha(x, x, x, need_weights=True, average_attn_weights=False)
    assert weights.shape == (4, 2, 32, 32)
    assert abs((weights == 0).double().mean().item() - 0.25) < 0.02  # 4 sigma
    assert abs(weights.sum(-1).mean().item() - 1.0) < 0.02  # rows still sum to 1 on average


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_each_dropout_acts_where_torch_nn_s_does(kind, norm_first):
    """In training, p = 1 in one dropout at a time (0 in the others) makes the output
    deterministic: the attention probabilities', the FFN's inner one and each residual one must
    drop what torch.nn's layer drops (in eval, where every other test runs, none of them acts)."""
    torch.manual_seed(0)
    kw = dict(LAYER_KW, norm_first=norm_first, batch_first=True)
    if kind == "encoder":
        theirs, mine = nn.TransformerEncoderLayer(**kw), ref.TransformerEncoderLayer(**kw)
    else:
        theirs, mine = nn.TransformerDecoderLayer(**kw), ref.TransformerDecoderLayer(**kw)
    for name, p in theirs.named_parameters():  # non-zero biases: a dropped branch still shows
        if p.dim() == 1:
            nn.init.normal_(p, mean=1.0 if "norm" in name else 0.0, std=0.3)
    _copy_weights(theirs, mine)
    x, memory = torch.randn(3, 5, 16, dtype=F64), torch.randn(3, 7, 16, dtype=F64)
    args = (x,) if kind == "encoder" else (x, memory)
    sites = []
    for name in dropout_sites_one_at_a_time(theirs, mine):
        sites.append(name)
        _close(mine(*args), theirs(*args))
    assert len(sites) == (4 if kind == "encoder" else 6)


def test_positional_encoding_dropout_applies_to_the_sum():
    # forward is dropout(x + pe): p = 1 in training leaves nothing (not x + dropout(pe)).
    pe = ref.PositionalEncoding(6, dropout=1.0, max_len=20).train()
    x = torch.randn(2, 5, 6)
    assert torch.equal(pe(x), torch.zeros_like(x))
    assert torch.equal(pe.eval()(x), x + pe.pe[:5])


def test_init_matches_torch_with_the_same_seed():
    # Same constructor, same seed, same weights as torch.nn (out_proj.bias zeroed, xavier-uniform
    # matrices): only loaded state_dicts were compared before.
    cases = [
        (lambda: nn.MultiheadAttention(16, 4), lambda: ref.MultiheadAttention(16, 4)),
        (lambda: nn.Transformer(16, 4, 2, 2, 24), lambda: ref.Transformer(16, 4, 2, 2, 24)),
    ]
    for make_theirs, make_mine in cases:
        torch.manual_seed(0)
        theirs = make_theirs().state_dict()
        torch.manual_seed(0)
        mine = make_mine().state_dict()
        assert list(mine) == list(theirs)
        for name, t in theirs.items():
            assert torch.equal(mine[name], t), name


def test_transformer_model_loss_ignores_padding_targets():
    torch.manual_seed(0)
    model = ref.TransformerModel(11, 11, 16, 4, 1, 1, 24, dropout=0.0).double().eval()
    src = torch.tensor([[5, 6, 7, 2], [8, 9, 2, 0]])
    tgt = torch.tensor([[3, 4, 2, 0, 0], [5, 2, 0, 0, 0]])
    logits = model(src, ref.shift_right(tgt, model.bos_id))
    real = tgt != model.pad_id
    _close(model.loss(src, tgt), F.cross_entropy(logits[real], tgt[real]))


def test_transformer_model_embedding_init():
    # N(0, d_model^-0.5): times sqrt(d_model) in _embed, the embeddings have unit scale.
    torch.manual_seed(0)
    model = ref.TransformerModel(1000, 1000, 64, 4, 1, 1, 32)
    for embed in (model.src_embed, model.tgt_embed):
        assert embed.weight.std().item() == pytest.approx(64**-0.5, rel=0.03)


@pytest.mark.parametrize("need_weights", [False, True])
def test_multihead_attention_bool_mask_with_float_padding_matches_torch(need_weights):
    # A bool attn_mask together with a float key_padding_mask (each case of
    # test_multihead_attention_matches_torch has one of the two only).
    torch.manual_seed(0)
    b, lq, lk, e, h = 3, 5, 7, 16, 4
    theirs = nn.MultiheadAttention(e, h, batch_first=True, dtype=F64).eval()
    nn.init.normal_(theirs.in_proj_bias)
    mine = _copy_weights(theirs, ref.MultiheadAttention(e, h, batch_first=True, dtype=F64))
    query, memory = torch.randn(b, lq, e, dtype=F64), torch.randn(b, lk, e, dtype=F64)
    attn_mask = torch.rand(lq, lk) > 0.7
    attn_mask[:, 0] = False
    kpm = torch.randn(b, lk, dtype=F64)
    kwargs = dict(key_padding_mask=kpm, attn_mask=attn_mask, need_weights=need_weights)
    out, w = mine(query, memory, memory, **kwargs)
    out_t, w_t = theirs(query, memory, memory, **kwargs)
    _close(out, out_t)
    if need_weights:
        _close(w, w_t)
