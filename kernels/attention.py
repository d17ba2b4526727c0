"""Triton fused scaled-dot-product attention, FlashAttention-2 style: forward and backward.

Layout: q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), last stride 1 (the launchers copy
otherwise); every other stride is passed to the kernels, so transposed views need no copy.
Offsets inside one (batch, head) slice are int32 (int64 block starts cost up to 60 registers on
sm_90); the launchers copy strided views whose slice would overflow, and the op routes tensors
whose contiguous slice still would (L * D >= 2**31) to the torch backend.
Query head h reads key/value head h // (H // Hkv) (grouped-query attention).

Forward (`attn_fwd`, one program per (query block, batch*head)): online softmax in fp32 on
log2-prescaled scores (exp2), keeps only O and the row log-sum-exp (natural log, fp32), plus
the row statistics the backward takes P from when the caller keeps a `stat` (see Backward). Key
tiles that causal masking hides are never visited (the loop bound is cut), and the per-element
bound / causal masks are only computed on the few edge tiles.

Backward: `attn_bwd_dq` (one program per query block, loop over key blocks) computes its rows'
delta = rowsum(dO * O) - dLSE and stores it, then `attn_bwd_dkdv` (one program per key block,
loop over query blocks from the causal start) reads it; both recompute P from the saved LSE,
or, when the caller keeps a `stat` (the op does for float32 inputs and float masks), from the
row max and log2 of the row sum saved apart: float32 rounds their sum at the max's magnitude.
No atomics: the result is deterministic. For fp16/bf16 head dims > 128 dK and dV are two
launches (PART) so that each fits in registers; configs choose (key x query) or (query x key)
tiles for both. With GQA, dK/dV are written per query head (fp32) and summed over each group
in torch. A float attn_mask that needs a gradient gets dS written to an fp32
(B, H, Lq, Lk) buffer (only in that case), reduced in torch over the mask's broadcast dims.

Masks: attn_mask is read per tile through its (B, H, Lq, Lk) broadcast strides (stride 0 on
broadcast dims, never materialized); bool (as uint8) -> -inf where 0, float added to the scores.
key_padding_mask (B, Lk) is read per key tile as uint8, nonzero = padding. Key tiles that are all
padding are skipped: the leading and trailing ones through the loop bounds (the launcher passes
each batch's first and last kept key), and a dK/dV program whose key block is all padding does
no work. (Not with a runtime `if` inside the key loop: on sm_90 that turns off Triton's software
pipelining of the K/V loads, measured: 24 KB instead of 64 KB of pipelined shared memory.)
A query row with every key masked gives O = 0, LSE = -inf and zero gradients.

Dropout: one Philox4x32-10 call serves 8 scores of a row, 16 bits each (8x less Philox work than
a `tl.rand` per score, which by instruction count cost several times the attention math on
sm_90; not measured on a GPU). With C = 4 * cdiv(Lk, 32) calls per row and key column
j = 32 g + 8 w + 2 c + l (w, c in 0..3, l in 0..1), score (b, h, i, j) is kept when
    w0, w1, w2, w3 = tl.randint4x(seed, ((b*H + h) << 32) + i*C + 4 g + c)     (int64 offset)
    u16 = (w_w >> (16 * l)) & 0xFFFF >= t,   t = round(p * 65536) (`dropout_threshold`)
(fastformer.ops.attention.dropout_keep_mask regenerates it); kept probabilities are scaled by
1/(1-p). Why this column order: a thread of a tensor-core accumulator tile (mma.sync and wgmma
alike) holds columns 8 w + 2 c + {0, 1} of its rows for one c and every w, so the 8 halves of
one call are 8 scores of one thread and `_dropout_keep` assembles its [BLOCK_M, BLOCK_N] tile in
registers. With consecutive columns a call (the previous scheme) the words had to cross threads:
6 extra layout conversions through shared memory a forward tile (sm_90 SASS: STS 9 -> 41,
BAR 11 -> 19); now none in the forward and dq kernels, nor in dK/dV's qk_tiles configs. Key
tiles start at multiples of BLOCK_N, 16 or a multiple of 32, so a tile covers whole 32-column
blocks or one half of one (BLOCK_N 16 draws the block's 4 calls and uses half of each). The
backward regenerates the same numbers; nothing of size Lq x Lk is stored.

Configs: small autotune lists per architecture (sm_80 and sm_90 tables keyed on kernel, dtype
class, head-dim bucket and feature class; the autotune key adds head dims, causal, mask kind,
padding, dropout and power-of-two sequence buckets); under TRITON_INTERPRET=1 one fixed small
config. A new key's candidates (a backward's dq and dK/dV ones together) are compiled at once in
threads before the autotuner times them, and its choice is kept in Triton's cache directory.
On sm_90 the lists also hold TMA twins of their 16-bit configs (FASTFORMER_ATTN_TMA=0: none):
the loops read K and V (fwd, dq) or Q and dO (dkdv) through per-slice tensor descriptors
(`tma_ok`). With FASTFORMER_ATTN_WS=1 the forwards without masks, padding or dropout (causal
or not) also tune warp-specialized tiles (`ws_candidates`: a TMA producer warpgroup and two
consumer warpgroups, Triton's automatic warp specialization).
`compile_report(arch)` (or `python -m fastformer.kernels.attention 90 80`) compiles every
config of an arch table without a GPU and reports the cubins' registers, spills (stack frame)
and shared memory (`--heaviest-only`: the heaviest feature classes at their heaviest tiles).
"""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import math
import os
import re
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation

from . import launcher

LOG2E = 1.4426950408889634
MASK_NONE, MASK_BOOL, MASK_FLOAT = 0, 1, 2
INT32_LIMIT = 2**31  # offsets inside one (batch, head) slice are int32
MAX_GRID_YZ = 65535  # CUDA's limit on grid dims 1 and 2 (dim 0: 2**31 - 1)
KV_RANGE_BLOCK = 1024  # key_padding_mask columns attn_kv_range reads a step


def qk_scale(scale: float) -> float:
    """scale * log2(e), the kernels' float32 score factor, at least float32's smallest normal.

    A factor that rounds to 0 in float32 (scale < ~1e-45) gave masked keys -inf * 0 = NaN;
    raised to 2**-126, every visible key's exp2(s - max) is still exactly 1 (|s| * 2**-126
    is far below float32's resolution near 1), the uniform average torch's SDPA gives.
    """
    return max(scale * LOG2E, 2.0**-126)


# --------------------------------------------------------------------------- shared helpers
# fmt: off
# (kernel argument lists stay grouped by role; one argument per line would triple the file)


@triton.jit
def _load_rows(base, start, offs, n_rows, stride, cols, N_COLS: tl.constexpr,
               BLOCK_COLS: tl.constexpr):
    # Rows start + offs (< n_rows) of a (rows, head dim) tile, zero outside. Offsets inside one
    # (batch, head) slice are int32 (the op checks they fit): int64 block starts measured up to
    # 60 more registers on sm_90, as the loop-invariant part got hoisted and kept live. A row
    # mask keeps loads vectorized (constant along the contiguous dim); the column mask is only
    # there for non-power-of-two head dims.
    rows = start + offs
    ptrs = base + rows[:, None] * stride + cols[None, :]
    if N_COLS == BLOCK_COLS:
        x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    else:
        x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < N_COLS), other=0.0)
    return x


@triton.jit
def _store_rows(base, start, offs, n_rows, stride, cols, x, N_COLS: tl.constexpr,
                BLOCK_COLS: tl.constexpr):
    rows = start + offs
    ptrs = base + rows[:, None] * stride + cols[None, :]
    if N_COLS == BLOCK_COLS:
        tl.store(ptrs, x, mask=rows[:, None] < n_rows)
    else:
        tl.store(ptrs, x, mask=(rows[:, None] < n_rows) & (cols[None, :] < N_COLS))


@triton.jit
def _slice_descriptor(base, n_rows, stride, N_COLS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                      BLOCK_COLS: tl.constexpr):
    # A TMA descriptor of one (batch, head) slice, (n_rows, N_COLS) at `stride`: its loads are
    # exact to the slice in any layout, zero past n_rows and N_COLS, like _load_rows (the
    # launcher checks TMA's 16-byte alignment of the base and the stride: `tma_ok`).
    return tl.make_tensor_descriptor(base, shape=[n_rows, N_COLS], strides=[stride, 1],
                                     block_shape=[BLOCK_ROWS, BLOCK_COLS])


@triton.jit
def _tile_rows(base, start, offs, n_rows, stride, cols, N_COLS: tl.constexpr,
               BLOCK_COLS: tl.constexpr, USE_TMA: tl.constexpr):
    # _load_rows, or with USE_TMA the same tile through `base`, a _slice_descriptor.
    if USE_TMA:
        x = base.load([start, 0])
    else:
        x = _load_rows(base, start, offs, n_rows, stride, cols, N_COLS, BLOCK_COLS)
    return x


@triton.jit
def _key_kept(kpm_base, cols, stride_pn, Lk):
    # True for keys that take part: in range and not padding.
    pad = tl.load(kpm_base + cols * stride_pn, mask=cols < Lk, other=1)
    return pad == 0


@triton.jit
def _apply_attn_mask(s, mask_base, rows_rel, rows, cols, Lq, Lk, stride_mm, stride_mn,
                     MASK_KIND: tl.constexpr):
    # s: (queries `rows`, keys `cols`) scores (_unscaled's); mask_base + rows_rel * stride_mm
    # addresses those rows (fwd/dq advance mask_base to their first row, in int64).
    ptrs = mask_base + rows_rel[:, None] * stride_mm + cols[None, :] * stride_mn
    inside = (rows[:, None] < Lq) & (cols[None, :] < Lk)
    if MASK_KIND == 1:
        # Outside: not allowed. (Allowed, a dK/dV tile's padded rows, whose q is 0, scored NaN
        # against a NaN key the mask hides, and made its dK and dV NaN; the reference's are 0.)
        allowed = tl.load(ptrs, mask=inside, other=0)
        s = tl.where(allowed != 0, s, float("-inf"))
    elif MASK_KIND == 2:
        s = s + tl.load(ptrs, mask=inside, other=0.0).to(tl.float32)
    return s


@triton.jit
def _dropout_calls(Lk):
    # Philox calls per query row: 4 per block of 32 key columns (see the module docstring).
    return tl.cdiv(Lk, 32) * 4


@triton.jit
def _philox(seed, lo, hi):
    # = tl.randint4x(seed, (hi << 32) + lo) for a uint32 tile `lo` and a uint32 scalar `hi`.
    zero = lo * 0
    return tl.philox(seed, lo, zero + hi, zero, zero)


@triton.jit
def _dropout_keep(seed, drop_base, rows, col0, offs_n, Lk, drop_t):
    # Keep-mask of the (rows, col0 + offs_n) tile, offs_n = arange(BLOCK_N). Key column
    # j = 32 g + 8 w + 2 c + l takes 16-bit half l of word w of the Philox call at counter
    # drop_base + i * _dropout_calls(Lk) + 4 g + c. drop_base holds the (b, h) part (plus, in
    # fwd/dq, the block's first row: `rows` are then block-local). A thread of an MMA
    # accumulator holds columns 8 w + 2 c + {0, 1} for one c and every w, i.e. all 8 halves of
    # its calls, so the tile is assembled in registers (joins and a permute) without moving
    # data between threads. col0 is a multiple of BLOCK_N: 16 (half a block: half of each call
    # unused) or a multiple of 32.
    BLOCK_N: tl.constexpr = offs_n.shape[0]
    BLOCK_M: tl.constexpr = rows.shape[0]
    tl.static_assert(BLOCK_N == 16 or BLOCK_N % 32 == 0, "dropout tiles: BLOCK_N 16 or 32k")
    # tl.randint4x(seed, offset) with an int64 offset is tl.philox(seed, low 32 bits, high 32
    # bits, 0, 0): the high half is (b, h), one scalar, and the low half never carries (the op
    # checks Lq * calls < 2**32), so the per-score counters stay 32-bit.
    hi = (drop_base >> 32).to(tl.uint32)
    lo = (drop_base & 0xFFFFFFFF).to(tl.uint32) + rows[:, None].to(tl.uint32) * _dropout_calls(Lk)
    if BLOCK_N == 16:
        calls = (col0 // 32) * 4 + tl.arange(0, 4)
    else:
        calls = col0 // 8 + tl.arange(0, BLOCK_N // 8)
    w0, w1, w2, w3 = _philox(seed, lo + calls[None, :].to(tl.uint32), hi)
    if BLOCK_N == 16:
        upper = (col0 // 16) % 2 == 1  # the block's columns 16-31: words 2 and 3
        x = tl.join(tl.where(upper, w2, w0), tl.where(upper, w3, w1))  # [m, c, w % 2]
        x = tl.join(x & 0xFFFF, x >> 16)  # [m, c, w % 2, l]
        x = tl.permute(x, (0, 2, 1, 3))  # [m, w % 2, c, l]
    else:
        x = tl.join(tl.join(w0, w1), tl.join(w2, w3))  # [m, 4 g + c, w % 2, w // 2]
        x = tl.join(x & 0xFFFF, x >> 16)  # [m, 4 g + c, w % 2, w // 2, l]
        x = tl.reshape(x, (BLOCK_M, BLOCK_N // 32, 4, 2, 2, 2))  # [m, g, c, w % 2, w // 2, l]
        x = tl.permute(x, (0, 1, 4, 3, 2, 5))  # [m, g, w // 2, w % 2, c, l]
    lanes = tl.reshape(x, (BLOCK_M, BLOCK_N))
    return lanes.to(tl.int32) >= drop_t


@triton.jit
def _key_range(KvRange, off_b, row0, Lk, IS_CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key loop of one query block: [lo, hi) holds every key it can see; tiles in
    [lo, full_hi) are in range and (causal) left of the diagonal: no per-element bound mask."""
    lo = 0
    hi = Lk
    if HAS_KPM:
        # Leading and trailing all-padding tiles are skipped: KvRange[b] = (first kept key,
        # last kept key + 1), computed once per call by the launcher.
        lo = (tl.load(KvRange + 2 * off_b) // BLOCK_N) * BLOCK_N
        hi = tl.load(KvRange + 2 * off_b + 1)
    limit = hi
    if IS_CAUSAL:
        # Keys past the block's last row are hidden from all its rows: never visited.
        hi = tl.minimum(hi, row0 + BLOCK_M)
        limit = tl.minimum(hi, row0)
    full_hi = lo + (tl.maximum(limit - lo, 0) // BLOCK_N) * BLOCK_N
    return lo, hi, full_hi


@triton.jit
def _lse_log2(Lse, row_ptrs, rows, Lq):
    # LSE in log2 units; rows with LSE = -inf (fully masked) become +inf so that P = 0 there.
    lse = tl.load(Lse + row_ptrs, mask=rows < Lq, other=0.0)
    return tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)


@triton.jit
def _row_lse(Lse, Stat, row_ptrs, rows, Lq, ROW_STAT: tl.constexpr):
    # (hi, lo) of _probs. With ROW_STAT, the forward's row max and log2 of its sum (Stat):
    # their float32 sum, the LSE, rounds at the max's magnitude, a relative error of P of
    # 2**-24 * |LSE| (past |LSE| ~ 900 float32 gradients missed the parity bound, dq 134x at
    # 2.8e4), and a row whose every score carries a bias of, say, -1e9 has an LSE of -1e9 +
    # log(Lk), which float32 rounds to -1e9: P came out 1 instead of 1 / Lk. Else the LSE in
    # log2 units (both halves; lo unused).
    if ROW_STAT:
        hi = tl.load(Stat + 2 * row_ptrs, mask=rows < Lq, other=float("inf"))
        lo = tl.load(Stat + 2 * row_ptrs + 1, mask=rows < Lq, other=0.0)
        return hi, lo
    lse = _lse_log2(Lse, row_ptrs, rows, Lq)
    return lse, lse


@triton.jit
def _probs(s, s_scale, hi, lo, MASK_KIND: tl.constexpr, ROW_STAT: tl.constexpr):
    # P from scores and broadcast (hi, lo) of _row_lse: the forward's exp2 of the score less
    # the row max, exactly as it took it (a float mask's in natural units, `_exp_diff`), then
    # less log2 of the sum. Without ROW_STAT one FMA less a score: exp2(s * s_scale - LSE).
    if MASK_KIND == 2:
        return tl.math.exp2((s - hi) * 1.4426950408889634 - lo)
    if ROW_STAT:
        return tl.math.exp2((s * s_scale - hi) - lo)
    return tl.math.exp2(s * s_scale - hi)


@triton.jit
def _batch_head(H):
    # (batch, head) of a program of `bh_grid` as int64, and b * H + h as int32 (B * H < 2**31:
    # fastformer.ops.attention's shape reasons): as an int64 held through the key loop it cost
    # the d256 forward's TMA twins, at 255 registers, a spill more.
    off_b = tl.program_id(2)
    off_h = tl.program_id(1)
    return off_b.to(tl.int64), off_h.to(tl.int64), off_b * H + off_h


@triton.jit
def _query_block(IS_CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr):
    # A causal query block's key loop grows with its index: the grid runs them last first, so
    # that the blocks still running at the end of the grid are the short ones (longest first).
    # Every block computes what it did in index order: the same bits. Not with key padding:
    # there ptxas spilled 8-32 bytes in six fwd / dq configs (sm_80, and fp32 on sm_90).
    if IS_CAUSAL and not HAS_KPM:
        return tl.num_programs(0) - 1 - tl.program_id(0)
    return tl.program_id(0)


@triton.jit
def _resolved_seed(seed, Seed, HAS_DROPOUT: tl.constexpr):
    # seed < 0: the seed is at Seed, drawn on the device inside CUDA graph capture so that each
    # replay uses a new one; otherwise it is the launch argument itself and Seed is not read.
    if HAS_DROPOUT:
        # A launch argument in int32's range is typed int32 and the loaded seed int64: Triton
        # 3.6 refused the branch until both were int64 (H200, 2026-11-30: every captured
        # dropout call failed with the -1 of then).
        seed = seed.to(tl.int64)
        if seed < 0:
            seed = tl.load(Seed)
    return seed


@triton.jit
def attn_kv_range(Kpm, KvRange, Lk, stride_pb, stride_pn, BLOCK_N: tl.constexpr):
    """KvRange[b] = (first kept key, last kept key + 1) of key_padding_mask row b, (0, 0) when
    every key is padding; grid (B,). One launch instead of a dozen torch ops (host time)."""
    off_b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    first = tl.full([BLOCK_N], Lk, dtype=tl.int32)
    last = tl.zeros([BLOCK_N], dtype=tl.int32)
    for start in range(0, Lk, BLOCK_N):
        cols = start + offs
        pad = tl.load(Kpm + off_b * stride_pb + cols * stride_pn, mask=cols < Lk, other=1)
        first = tl.minimum(first, tl.where(pad == 0, cols, Lk))
        last = tl.maximum(last, tl.where(pad == 0, cols + 1, 0))
    hi = tl.max(last, 0)
    lo = tl.where(hi == 0, 0, tl.min(first, 0))
    tl.store(KvRange + 2 * off_b, lo)
    tl.store(KvRange + 2 * off_b + 1, hi)


@triton.jit
def _unscaled(s, qk_scale, MASK_KIND: tl.constexpr):
    # (scores, the scale still to apply). Scores stay unscaled (masks select on them as they
    # are) so that exp2(s * scale - max or LSE) is one FMA a score. A float mask adds to scaled
    # scores in natural units, as torch does, and they stay so (`_exp_diff`): in log2 units a
    # bias of finfo.min (Hugging Face's masks) would overflow to -inf, masking a key that
    # softmax still weighs.
    if MASK_KIND == 2:
        return s * (qk_scale * 0.6931471805599453), 1.0
    return s, qk_scale


@triton.jit
def _exp_diff(s, s_scale, m, MASK_KIND: tl.constexpr):
    # exp(scores - m): scores (and m) in natural units with a float mask (_unscaled), the
    # difference taken before the conversion to log2 units; else exp2(s * s_scale - m).
    if MASK_KIND == 2:
        return tl.math.exp2((s - m) * 1.4426950408889634)
    return tl.math.exp2(s * s_scale - m)


# --------------------------------------------------------------------------- forward


@triton.jit
def _fwd_tile(
    acc, l_i, m_i, q, k_base, v_base, mask_base, kpm_base, start_n, row0, rows_local, offs_n,
    offs_d, offs_dv, stride_kn, stride_vn, stride_mm, stride_mn, stride_pn,
    seed, drop_t, drop_base, qk_scale, Lq, Lk,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PREC: tl.constexpr, EDGE: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    cols = start_n + offs_n
    k = _tile_rows(k_base, start_n, offs_n, Lk, stride_kn, offs_d, HEAD_D, BLOCK_D, USE_TMA)
    # The row max of unscaled scores, then scaled (s_scale > 0 commutes with max): ~10% fewer
    # instructions in the d64 key loop on sm_90 than scaling every score for the max first.
    s, s_scale = _unscaled(tl.dot(q, tl.trans(k), input_precision=DOT_PREC), qk_scale, MASK_KIND)
    if MASK_KIND != 0:
        s = _apply_attn_mask(s, mask_base, rows_local, row0 + rows_local, cols, Lq, Lk,
                             stride_mm, stride_mn, MASK_KIND)
    if HAS_KPM:
        s = tl.where(_key_kept(kpm_base, cols, stride_pn, Lk)[None, :], s, float("-inf"))
    if EDGE:  # only the tiles that cross the key bound or the causal diagonal
        visible = cols[None, :] < Lk
        if IS_CAUSAL:
            visible = visible & (cols[None, :] <= row0 + rows_local[:, None])
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * s_scale)
    # A row with nothing visible yet has m = -inf: subtract 0 instead, so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = _exp_diff(s, s_scale, m_safe[:, None], MASK_KIND)
    alpha = _exp_diff(m_i, 1.0, m_safe, MASK_KIND)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if HAS_DROPOUT:
        p = tl.where(_dropout_keep(seed, drop_base, rows_local, start_n, offs_n, Lk, drop_t), p,
                     0.0)
    v = _tile_rows(v_base, start_n, offs_n, Lk, stride_vn, offs_dv, HEAD_DV, BLOCK_DV, USE_TMA)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def _two_ranges(lo, mid, hi, UPPER_FIRST: tl.constexpr):
    # The bounds (lo_a, hi_a, lo_b, hi_b) of two loops over [lo, mid) and [mid, hi), in that
    # order or, UPPER_FIRST, the other: which loop comes first decides, per kernel and config,
    # whether ptxas serializes its wgmma (C7515) or spills.
    if UPPER_FIRST:
        return mid, hi, lo, mid
    return lo, mid, mid, hi


@triton.jit
def _fwd_loop(
    acc, l_i, m_i, q, k_base, v_base, mask_base, kpm_base, lo, hi, row0, rows_local, offs_n,
    offs_d, offs_dv, stride_kn, stride_vn, stride_mm, stride_mn, stride_pn,
    seed, drop_t, drop_base, qk_scale, Lq, Lk,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PREC: tl.constexpr, EDGE: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr, WARP_SPEC: tl.constexpr,
):
    # Branch-free body: a runtime `if` in the loop would turn off Triton's software pipelining.
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        acc, l_i, m_i = _fwd_tile(
            acc, l_i, m_i, q, k_base, v_base, mask_base, kpm_base, start_n, row0, rows_local,
            offs_n, offs_d, offs_dv, stride_kn, stride_vn, stride_mm, stride_mn, stride_pn,
            seed, drop_t, drop_base, qk_scale, Lq, Lk,
            HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, IS_CAUSAL, MASK_KIND, HAS_KPM, HAS_DROPOUT,
            DOT_PREC, EDGE, USE_TMA,
        )
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["seed"])
def attn_fwd(
    Q, K, V, Out, Lse, Stat, Mask, Kpm, KvRange, Seed,
    seed, drop_t, qk_scale, out_scale,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
    stride_mb, stride_mh, stride_mm, stride_mn, stride_pb, stride_pn,
    H, GROUP, Lq, Lk, SEQ_Q_BUCKET, SEQ_K_BUCKET,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, ROW_STAT: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr, WARP_SPEC: tl.constexpr,
):
    """O and LSE for one (query block, batch*head); grid `bh_grid`."""
    seed = _resolved_seed(seed, Seed, HAS_DROPOUT)
    start_m = _query_block(IS_CAUSAL, HAS_KPM)
    off_b, off_h, off_bh = _batch_head(H)
    off_hkv = off_h // GROUP
    row0 = start_m * BLOCK_M
    rows_local = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q_base = Q + off_b * stride_qb + off_h * stride_qh
    if WARP_SPEC:  # Triton's warp specialization took the loop only with Q through TMA too
        q_base = _slice_descriptor(q_base, Lq, stride_qm, HEAD_D, BLOCK_M, BLOCK_D)
    q = _tile_rows(q_base, row0, rows_local, Lq, stride_qm, offs_d, HEAD_D, BLOCK_D, WARP_SPEC)
    k_base = K + off_b * stride_kb + off_hkv * stride_kh
    v_base = V + off_b * stride_vb + off_hkv * stride_vh
    if USE_TMA:
        k_base = _slice_descriptor(k_base, Lk, stride_kn, HEAD_D, BLOCK_N, BLOCK_D)
        v_base = _slice_descriptor(v_base, Lk, stride_vn, HEAD_DV, BLOCK_N, BLOCK_DV)
    mask_base = Mask + off_b * stride_mb + off_h * stride_mh + row0.to(tl.int64) * stride_mm
    kpm_base = Kpm + off_b * stride_pb
    drop_base = (off_bh.to(tl.int64) << 32) + row0.to(tl.int64) * _dropout_calls(Lk)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    lo, hi, full_hi = _key_range(KvRange, off_b, row0, Lk, IS_CAUSAL, HAS_KPM, BLOCK_M, BLOCK_N)
    if WARP_SPEC:
        # Every tile in the edge loop, under the key-bound (and causal) mask: Triton 3.6 and 3.9
        # failed to compile a loop after a warp-specialized one. No masks, padding or dropout
        # (`ws_candidates`).
        tl.static_assert(USE_TMA and MASK_KIND == 0)
        tl.static_assert(not HAS_KPM and not HAS_DROPOUT)
        full_hi = lo
    # With a mask (16-bit, d <= 64) and key padding the edge tiles come first, then the full
    # ones: in the other order ptxas serialized every wgmma of the d64 (128, 64, 8, 3) tile
    # (C7515, sm_90, Triton 3.6). Without key padding that order serialized the (128, 32, 8, 3)
    # and (64, 32, 4, 3) (3.6), and the full tiles first the (128, 64, 8, 3) not causal: each
    # takes the order that ptxas did not serialize. Larger heads keep the full tiles first: the
    # other order spilled 48 bytes in the d128 (128, 64, 8, 3) (3.9) and 24 in the d256
    # (128, 16, 8, 2) TMA twin (3.8); with it serialized every d128 tile causal without key
    # padding (3.6). But not causal, with dropout and no key padding, the full tiles first
    # spilled 8-32 bytes in the d128 (128, 64, 8, 3) (3.6, 3.9).
    EDGE_FIRST: tl.constexpr = (
        DOT_PREC != "ieee"
        and MASK_KIND != 0
        and (
            (BLOCK_D <= 64 and (HAS_KPM or (not IS_CAUSAL and BLOCK_N == 64)))
            or (BLOCK_D == 128 and not IS_CAUSAL and not HAS_KPM and HAS_DROPOUT)
        )
    )
    lo_a, hi_a, lo_b, hi_b = _two_ranges(lo, full_hi, hi, EDGE_FIRST)
    acc, l_i, m_i = _fwd_loop(
        acc, l_i, m_i, q, k_base, v_base, mask_base, kpm_base, lo_a, hi_a, row0, rows_local,
        offs_n, offs_d, offs_dv, stride_kn, stride_vn, stride_mm, stride_mn, stride_pn,
        seed, drop_t, drop_base, qk_scale, Lq, Lk,
        HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, IS_CAUSAL, MASK_KIND, HAS_KPM, HAS_DROPOUT,
        DOT_PREC, EDGE_FIRST, BLOCK_N, USE_TMA, False,
    )
    acc, l_i, m_i = _fwd_loop(
        acc, l_i, m_i, q, k_base, v_base, mask_base, kpm_base, lo_b, hi_b, row0, rows_local,
        offs_n, offs_d, offs_dv, stride_kn, stride_vn, stride_mm, stride_mn, stride_pn,
        seed, drop_t, drop_base, qk_scale, Lq, Lk,
        HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, IS_CAUSAL, MASK_KIND, HAS_KPM, HAS_DROPOUT,
        DOT_PREC, not EDGE_FIRST, BLOCK_N, USE_TMA, WARP_SPEC,
    )

    empty = l_i == 0.0  # every key masked: O = 0, LSE = -inf
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc * (out_scale / l_safe)[:, None]
    if MASK_KIND == 2:  # m in natural units (_unscaled)
        lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(l_safe) * 0.6931471805599453)
    else:
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    _store_rows(Out + off_b * stride_ob + off_h * stride_oh, row0, rows_local, Lq, stride_om,
                offs_dv, out.to(Out.dtype.element_ty), HEAD_DV, BLOCK_DV)
    rows = row0 + rows_local
    row_ptrs = off_bh.to(tl.int64) * Lq + rows
    tl.store(Lse + row_ptrs, lse, mask=rows < Lq)
    if ROW_STAT:  # the backward's (hi, lo): _row_lse; empty rows P = 0
        tl.store(Stat + 2 * row_ptrs, tl.where(empty, float("inf"), m_i), mask=rows < Lq)
        tl.store(Stat + 2 * row_ptrs + 1, tl.where(empty, 0.0, tl.math.log2(l_safe)),
                 mask=rows < Lq)


# --------------------------------------------------------------------------- backward


@triton.jit
def _dkdv_tile_t(
    dk, dv, k, v, q_base, do_base, Lse, Stat, Delta, mask_base, start_m, col0, offs_m, offs_n,
    offs_d, offs_dv, bh_row0, stride_qm, stride_dom, stride_mm, stride_mn,
    seed, drop_t, out_scale, drop_base, qk_scale, Lq, Lk,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASK_KIND: tl.constexpr, ROW_STAT: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    CAUSAL_TILE: tl.constexpr, USE_TMA: tl.constexpr,
):
    # Both accumulators, on transposed tiles (keys x queries) so that P^T and dS^T come out
    # directly as the first dot operand (the Triton tutorial's form; fewest registers with
    # both accumulators live, measured on sm_90). With dropout the keep-mask, laid out for
    # (query x key) tensor-core tiles (_dropout_keep), is transposed here: 4 more layout
    # conversions through shared memory a tile (sm_90); the qk_tiles configs avoid them.
    rows = start_m + offs_m
    cols = col0 + offs_n
    q = _tile_rows(q_base, start_m, offs_m, Lq, stride_qm, offs_d, HEAD_D, BLOCK_D, USE_TMA)
    do = _tile_rows(do_base, start_m, offs_m, Lq, stride_dom, offs_dv, HEAD_DV, BLOCK_DV,
                    USE_TMA)
    hi, lo = _row_lse(Lse, Stat, bh_row0 + rows, rows, Lq, ROW_STAT)
    s_t, s_scale = _unscaled(tl.dot(k, tl.trans(q), input_precision=DOT_PREC), qk_scale,
                             MASK_KIND)
    if MASK_KIND != 0:
        # Read in the mask's own (query, key) orientation, whose rows are contiguous (fewer
        # registers than a transposed read, measured on sm_90).
        s_t = tl.trans(_apply_attn_mask(tl.trans(s_t), mask_base, rows, rows, cols, Lq, Lk,
                                        stride_mm, stride_mn, MASK_KIND))
    if CAUSAL_TILE:
        s_t = tl.where(cols[:, None] <= rows[None, :], s_t, float("-inf"))
    p_t = _probs(s_t, s_scale, hi[None, :], lo[None, :], MASK_KIND, ROW_STAT)
    if MASK_KIND == 2:
        # At most 1: k @ q^T may round a score of ~1e3 an ulp above the forward's q @ k^T, its
        # row max, and a dominant P came out 1 + 1.2e-4 (dV 5x the parity bound; the
        # reference's P is 1). Here only: the dq kernel has the forward's orientation, and
        # the cap cost its sm_90 fp16 d64 config a spill.
        p_t = tl.where(p_t > 1.0, 1.0, p_t)  # (tl.minimum would turn a NaN into 1)
    if HAS_DROPOUT:
        keep_t = tl.trans(_dropout_keep(seed, drop_base, rows, col0, offs_n, Lk, drop_t))
    pd_t = p_t  # dV = (P * keep / (1 - p))^T dO
    if HAS_DROPOUT:
        pd_t = tl.where(keep_t, p_t * out_scale, 0.0)
    dv = tl.dot(pd_t.to(do.dtype), do, dv, input_precision=DOT_PREC)
    delta = tl.load(Delta + bh_row0 + rows, mask=rows < Lq, other=0.0)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
    if HAS_DROPOUT:
        dp_t = tl.where(keep_t, dp_t * out_scale, 0.0)
    ds_t = p_t * (dp_t - delta[None, :])  # dK = scale * dS^T Q, dS = P * (dP - delta)
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PREC)
    return dk, dv


@triton.jit
def _dkdv_tile_n(
    dk, dv, k, v, q_base, do_base, Lse, Stat, Delta, mask_base, start_m, col0, offs_m, offs_n,
    offs_d, offs_dv, bh_row0, stride_qm, stride_dom, stride_mm, stride_mn,
    seed, drop_t, out_scale, drop_base, qk_scale, Lq, Lk,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASK_KIND: tl.constexpr, ROW_STAT: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    CAUSAL_TILE: tl.constexpr, PART: tl.constexpr, USE_TMA: tl.constexpr,
):
    # Scores as (queries x keys) with K and V as the second dot operand, which wgmma reads from
    # shared memory instead of registers. PART 1: dV, 2: dK (one accumulator: for 16-bit head
    # dims > 128 this is what fits without spills, measured on sm_90); 0: both (QK_TILES
    # configs: this orientation takes _dropout_keep's tile as it comes, no conversion).
    rows = start_m + offs_m
    cols = col0 + offs_n
    q = _tile_rows(q_base, start_m, offs_m, Lq, stride_qm, offs_d, HEAD_D, BLOCK_D, USE_TMA)
    do = _tile_rows(do_base, start_m, offs_m, Lq, stride_dom, offs_dv, HEAD_DV, BLOCK_DV,
                    USE_TMA)
    hi, lo = _row_lse(Lse, Stat, bh_row0 + rows, rows, Lq, ROW_STAT)
    s, s_scale = _unscaled(tl.dot(q, tl.trans(k), input_precision=DOT_PREC), qk_scale, MASK_KIND)
    if MASK_KIND != 0:
        s = _apply_attn_mask(s, mask_base, rows, rows, cols, Lq, Lk, stride_mm, stride_mn,
                             MASK_KIND)
    if CAUSAL_TILE:
        s = tl.where(cols[None, :] <= rows[:, None], s, float("-inf"))
    p = _probs(s, s_scale, hi[:, None], lo[:, None], MASK_KIND, ROW_STAT)
    pd = p  # P * keep / (1 - p): dV = pd^T dO, and dS = pd * dP - P * delta
    if HAS_DROPOUT:
        pd = tl.where(_dropout_keep(seed, drop_base, rows, col0, offs_n, Lk, drop_t),
                      p * out_scale, 0.0)
    if PART != 2:
        dv = tl.dot(tl.trans(pd.to(do.dtype)), do, dv, input_precision=DOT_PREC)
    if PART != 1:
        delta = tl.load(Delta + bh_row0 + rows, mask=rows < Lq, other=0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = pd * dp - p * delta[:, None]  # dK = scale * dS^T Q
        dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk, input_precision=DOT_PREC)
    return dk, dv


@triton.jit
def _dkdv_loop(
    dk, dv, k, v, q_base, do_base, Lse, Stat, Delta, mask_base, lo, hi, col0, offs_m, offs_n,
    offs_d, offs_dv, bh_row0, stride_qm, stride_dom, stride_mm, stride_mn,
    seed, drop_t, out_scale, drop_base, qk_scale, Lq, Lk,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASK_KIND: tl.constexpr, ROW_STAT: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    CAUSAL_TILE: tl.constexpr, PART: tl.constexpr, QK_TILES: tl.constexpr, BLOCK_M: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    for start_m in range(lo, hi, BLOCK_M):
        if PART == 0 and not QK_TILES:
            dk, dv = _dkdv_tile_t(
                dk, dv, k, v, q_base, do_base, Lse, Stat, Delta, mask_base, start_m, col0, offs_m,
                offs_n, offs_d, offs_dv, bh_row0, stride_qm, stride_dom, stride_mm, stride_mn,
                seed, drop_t, out_scale, drop_base, qk_scale, Lq, Lk,
                HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, MASK_KIND, ROW_STAT, HAS_DROPOUT, DOT_PREC,
                CAUSAL_TILE, USE_TMA,
            )
        else:
            dk, dv = _dkdv_tile_n(
                dk, dv, k, v, q_base, do_base, Lse, Stat, Delta, mask_base, start_m, col0, offs_m,
                offs_n, offs_d, offs_dv, bh_row0, stride_qm, stride_dom, stride_mm, stride_mn,
                seed, drop_t, out_scale, drop_base, qk_scale, Lq, Lk,
                HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, MASK_KIND, ROW_STAT, HAS_DROPOUT, DOT_PREC,
                CAUSAL_TILE, PART, USE_TMA,
            )
    return dk, dv


@triton.jit(do_not_specialize=["seed"])
def attn_bwd_dkdv(
    Q, K, V, DO, Lse, Stat, Delta, DK, DV, Mask, Kpm, Seed,
    seed, drop_t, out_scale, qk_scale, sm_scale,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    stride_mb, stride_mh, stride_mm, stride_mn, stride_pb, stride_pn,
    H, GROUP, Lq, Lk, SEQ_Q_BUCKET, SEQ_K_BUCKET,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, ROW_STAT: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PREC: tl.constexpr, PART: tl.constexpr,
    QK_TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr,
):
    """dK, dV of one (key block, batch*query head); grid `bh_grid`.

    PART (see dkdv_parts): 0 computes both, on (key x query) tiles, or on (query x key) tiles
    when QK_TILES (a config choice); 1 only dV, 2 only dK (fp16/bf16 head dims > 128: two
    launches, each holding one accumulator, as both together do not fit in registers)."""
    seed = _resolved_seed(seed, Seed, HAS_DROPOUT)
    off_b, off_h, off_bh = _batch_head(H)
    off_hkv = off_h // GROUP
    col0 = tl.program_id(0) * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    cols = col0 + offs_n
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    k = _load_rows(K + off_b * stride_kb + off_hkv * stride_kh, col0, offs_n, Lk, stride_kn,
                   offs_d, HEAD_D, BLOCK_D)
    if PART == 1:
        v = k  # unused: dV needs no V
    else:
        v = _load_rows(V + off_b * stride_vb + off_hkv * stride_vh, col0, offs_n, Lk, stride_vn,
                       offs_dv, HEAD_DV, BLOCK_DV)
    q_base = Q + off_b * stride_qb + off_h * stride_qh
    do_base = DO + off_b * stride_dob + off_h * stride_doh
    if USE_TMA:
        q_base = _slice_descriptor(q_base, Lq, stride_qm, HEAD_D, BLOCK_M, BLOCK_D)
        do_base = _slice_descriptor(do_base, Lq, stride_dom, HEAD_DV, BLOCK_M, BLOCK_DV)
    mask_base = Mask + off_b * stride_mb + off_h * stride_mh
    drop_base = off_bh.to(tl.int64) << 32
    bh_row0 = off_bh.to(tl.int64) * Lq
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    # Two query loops, over [lo, mid) and [mid, hi). Causal: [lo, mid) are the blocks that cross
    # the diagonal (masked), and the blocks above the first key are skipped. Not causal, 16-bit,
    # (query x key) tiles, dropout or a mask at d > 64: [mid, hi) is the partial last block, so
    # that the loop has a second one beside it. With one loop over every block ptxas serialized
    # the wgmma of 26 non-causal kernels (C7515; sm_90, Triton 3.6), among them every dK/dV tile
    # of the paper's encoder (d64, key padding, dropout), and the d128 masked (32, 64, 8, 2)
    # without key padding (3.6, 3.8) or with a bool mask (3.8); the loops only split the range.
    # The d64 (key x query) tiles without dropout keep one loop: there the split serialized the
    # (32, 128, 8, 3) (without a mask; with a bool mask and no key padding).
    EDGE_LOOP: tl.constexpr = not IS_CAUSAL and DOT_PREC != "ieee" and (
        QK_TILES or PART != 0 or HAS_DROPOUT or (MASK_KIND != 0 and BLOCK_D > 64)
    )
    lo = 0
    mid = 0
    hi = Lq
    if IS_CAUSAL:
        lo = (col0 // BLOCK_M) * BLOCK_M
        mid = tl.minimum(tl.cdiv(col0 + BLOCK_N - 1, BLOCK_M) * BLOCK_M, Lq)
        mid = tl.maximum(mid, lo)
    if EDGE_LOOP:
        mid = (Lq // BLOCK_M) * BLOCK_M
    if HAS_KPM:
        kept = _key_kept(Kpm + off_b * stride_pb, cols, stride_pn, Lk)
        any_kept = tl.max(kept.to(tl.int32), 0) > 0  # else a block of padding: dK = dV = 0
        hi = tl.where(any_kept, hi, lo)
        mid = tl.where(any_kept, mid, lo)
    # 16-bit: the loop over [mid, hi) first (causal: the blocks past the diagonal). In the other
    # order ptxas serialized every wgmma of the kernel (C7515, "non wgmma instructions defining
    # accumulator registers"; causal, padded, masked and dropout, sm_90, Triton 3.6). float32
    # (FMA dots, no wgmma) keeps the diagonal first: the other order spilled 8-88 bytes at d256.
    # So does the 64 x 64 (query x key) tile, the H200's dropout winner (27-31% less time than
    # the others, 12-04): the other order spilled 8 bytes with dropout (3.6, 3.8); this one is
    # serialized under 3.6 only (causal; not causal it is not).
    LOWER_FIRST: tl.constexpr = DOT_PREC == "ieee" or (QK_TILES and BLOCK_M == 64 and BLOCK_N == 64)
    lo_a, hi_a, lo_b, hi_b = _two_ranges(lo, mid, hi, not LOWER_FIRST)
    dk, dv = _dkdv_loop(
        dk, dv, k, v, q_base, do_base, Lse, Stat, Delta, mask_base, lo_a, hi_a, col0, offs_m,
        offs_n, offs_d, offs_dv, bh_row0, stride_qm, stride_dom, stride_mm, stride_mn,
        seed, drop_t, out_scale, drop_base, qk_scale, Lq, Lk,
        HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, MASK_KIND, ROW_STAT, HAS_DROPOUT, DOT_PREC,
        IS_CAUSAL and LOWER_FIRST, PART, QK_TILES, BLOCK_M, USE_TMA,
    )
    dk, dv = _dkdv_loop(
        dk, dv, k, v, q_base, do_base, Lse, Stat, Delta, mask_base, lo_b, hi_b, col0, offs_m,
        offs_n, offs_d, offs_dv, bh_row0, stride_qm, stride_dom, stride_mm, stride_mn,
        seed, drop_t, out_scale, drop_base, qk_scale, Lq, Lk,
        HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, MASK_KIND, ROW_STAT, HAS_DROPOUT, DOT_PREC,
        IS_CAUSAL and not LOWER_FIRST, PART, QK_TILES, BLOCK_M, USE_TMA,
    )
    if HAS_KPM:
        # P was not masked for padding keys here (it is per key, constant over the loop): every
        # contribution to a padding key's dK/dV is zero, so zero those rows once.
        dk = tl.where(kept[:, None], dk, 0.0)
        dv = tl.where(kept[:, None], dv, 0.0)
    if PART != 1:
        _store_rows(DK + off_b * stride_dkb + off_h * stride_dkh, col0, offs_n, Lk, stride_dkn,
                    offs_d, (dk * sm_scale).to(DK.dtype.element_ty), HEAD_D, BLOCK_D)
    if PART != 2:
        _store_rows(DV + off_b * stride_dvb + off_h * stride_dvh, col0, offs_n, Lk, stride_dvn,
                    offs_dv, dv.to(DV.dtype.element_ty), HEAD_DV, BLOCK_DV)


@triton.jit
def _dq_tile(
    dq, q, do, lse, lse_lo, delta, k_base, v_base, mask_base, ds_base, kpm_base, start_n, row0,
    rows_local, offs_n, offs_d, offs_dv, stride_kn, stride_vn, stride_mm, stride_mn, stride_pn,
    seed, drop_t, out_scale, drop_base, qk_scale, Lq, Lk,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, ROW_STAT: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, WRITE_DS: tl.constexpr, DOT_PREC: tl.constexpr,
    EDGE: tl.constexpr, USE_TMA: tl.constexpr,
):
    cols = start_n + offs_n
    k = _tile_rows(k_base, start_n, offs_n, Lk, stride_kn, offs_d, HEAD_D, BLOCK_D, USE_TMA)
    v = _tile_rows(v_base, start_n, offs_n, Lk, stride_vn, offs_dv, HEAD_DV, BLOCK_DV, USE_TMA)
    s, s_scale = _unscaled(tl.dot(q, tl.trans(k), input_precision=DOT_PREC), qk_scale, MASK_KIND)
    if MASK_KIND != 0:
        s = _apply_attn_mask(s, mask_base, rows_local, row0 + rows_local, cols, Lq, Lk,
                             stride_mm, stride_mn, MASK_KIND)
    if HAS_KPM:
        s = tl.where(_key_kept(kpm_base, cols, stride_pn, Lk)[None, :], s, float("-inf"))
    if EDGE:
        visible = cols[None, :] < Lk
        if IS_CAUSAL:
            visible = visible & (cols[None, :] <= row0 + rows_local[:, None])
        s = tl.where(visible, s, float("-inf"))
    p = _probs(s, s_scale, lse[:, None], lse_lo[:, None], MASK_KIND, ROW_STAT)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
    if HAS_DROPOUT:
        keep = _dropout_keep(seed, drop_base, rows_local, start_n, offs_n, Lk, drop_t)
        dp = tl.where(keep, dp * out_scale, 0.0)
    ds = p * (dp - delta[:, None])
    if WRITE_DS:  # ds_base: this block's first row in the (B, H, Lq, Lk) fp32 buffer
        ptrs = ds_base + (rows_local[:, None] * Lk + cols[None, :])
        tl.store(ptrs, ds, mask=(row0 + rows_local[:, None] < Lq) & (cols[None, :] < Lk))
    dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
    return dq


@triton.jit
def _dq_loop(
    dq, q, do, lse, lse_lo, delta, k_base, v_base, mask_base, ds_base, kpm_base, lo, hi, row0,
    rows_local, offs_n, offs_d, offs_dv, stride_kn, stride_vn, stride_mm, stride_mn, stride_pn,
    seed, drop_t, out_scale, drop_base, qk_scale, Lq, Lk,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, ROW_STAT: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, WRITE_DS: tl.constexpr, DOT_PREC: tl.constexpr,
    EDGE: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr,
):
    for start_n in range(lo, hi, BLOCK_N):
        dq = _dq_tile(
            dq, q, do, lse, lse_lo, delta, k_base, v_base, mask_base, ds_base, kpm_base, start_n,
            row0, rows_local, offs_n, offs_d, offs_dv, stride_kn, stride_vn, stride_mm, stride_mn,
            stride_pn, seed, drop_t, out_scale, drop_base, qk_scale, Lq, Lk,
            HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, IS_CAUSAL, MASK_KIND, ROW_STAT, HAS_KPM,
            HAS_DROPOUT, WRITE_DS, DOT_PREC, EDGE, USE_TMA,
        )
    return dq


@triton.jit(do_not_specialize=["seed"])
def attn_bwd_dq(
    Q, K, V, DO, Lse, Stat, Delta, DQ, Mask, Kpm, KvRange, DS, Out, DLse, Seed,
    seed, drop_t, out_scale, qk_scale, sm_scale,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm, stride_ob, stride_oh, stride_om,
    stride_mb, stride_mh, stride_mm, stride_mn, stride_pb, stride_pn,
    H, GROUP, Lq, Lk, SEQ_Q_BUCKET, SEQ_K_BUCKET,
    HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, ROW_STAT: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, WRITE_DS: tl.constexpr, HAS_DLSE: tl.constexpr,
    DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """dQ (and dS if WRITE_DS) of one (query block, batch*head), and its rows of Delta for
    attn_bwd_dkdv, which runs after it; grid `bh_grid`."""
    seed = _resolved_seed(seed, Seed, HAS_DROPOUT)
    start_m = _query_block(IS_CAUSAL, HAS_KPM)
    off_b, off_h, off_bh = _batch_head(H)
    off_hkv = off_h // GROUP
    row0 = start_m * BLOCK_M
    rows_local = tl.arange(0, BLOCK_M)
    rows = row0 + rows_local
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    bh_row0 = off_bh.to(tl.int64) * Lq
    # delta = rowsum(dO * O) - dLSE here rather than in a kernel of its own: one launch less
    # (host time per call), and O is read where dO already is. Before q is loaded: O is dead
    # by then (one fp16 d64 config spilled with q live across it).
    do = _load_rows(DO + off_b * stride_dob + off_h * stride_doh, row0, rows_local, Lq,
                    stride_dom, offs_dv, HEAD_DV, BLOCK_DV)
    o = _load_rows(Out + off_b * stride_ob + off_h * stride_oh, row0, rows_local, Lq, stride_om,
                   offs_dv, HEAD_DV, BLOCK_DV)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        # d lse / d s = P, so the LSE cotangent folds into delta: dS = P * (dP - delta + dLSE).
        delta -= tl.load(DLse + bh_row0 + rows, mask=rows < Lq, other=0.0)
    q = _load_rows(Q + off_b * stride_qb + off_h * stride_qh, row0, rows_local, Lq, stride_qm,
                   offs_d, HEAD_D, BLOCK_D)
    lse, lse_lo = _row_lse(Lse, Stat, bh_row0 + rows, rows, Lq, ROW_STAT)
    tl.store(Delta + bh_row0 + rows, delta, mask=rows < Lq)
    k_base = K + off_b * stride_kb + off_hkv * stride_kh
    v_base = V + off_b * stride_vb + off_hkv * stride_vh
    if USE_TMA:
        k_base = _slice_descriptor(k_base, Lk, stride_kn, HEAD_D, BLOCK_N, BLOCK_D)
        v_base = _slice_descriptor(v_base, Lk, stride_vn, HEAD_DV, BLOCK_N, BLOCK_DV)
    mask_base = Mask + off_b * stride_mb + off_h * stride_mh + row0.to(tl.int64) * stride_mm
    ds_base = DS + (bh_row0 + row0) * Lk
    kpm_base = Kpm + off_b * stride_pb
    drop_base = (off_bh.to(tl.int64) << 32) + row0.to(tl.int64) * _dropout_calls(Lk)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, hi, full_hi = _key_range(KvRange, off_b, row0, Lk, IS_CAUSAL, HAS_KPM, BLOCK_M, BLOCK_N)
    # With a mask, dropout and key padding (16-bit, d <= 128, or not causal) the edge tiles (the
    # diagonal's, the range's ends) come first, then the full ones. In the other order ptxas
    # serialized every wgmma of the d64 (128, 64, 8, 2) tile (C7515, sm_90, Triton 3.6), and
    # the d256 (128, 16, 8, 3) spilled 8 bytes not causal (3.9). Without key padding this order
    # serialized the d64 and d128 tiles (3.6), but for the d128 (64, 32, 4, 3), which spilled
    # 8-16 bytes the other way (3.6, 3.8), as did the d256 not causal (32 bytes, 3.9).
    # Elsewhere the full tiles stay first: the other order spilled 24 bytes in the causal d64
    # (64, 64, 4, 2) on sm_80 (3.8), 64 in the causal d256 (128, 16, 8, 3) (3.9) and 8-16 in
    # float32 d128.
    EDGE_FIRST: tl.constexpr = (
        DOT_PREC != "ieee"
        and (BLOCK_D <= 128 or not IS_CAUSAL)
        and MASK_KIND != 0
        and HAS_DROPOUT
        and (HAS_KPM or BLOCK_D > 128 or (BLOCK_D == 128 and BLOCK_M == 64))
    )
    lo_a, hi_a, lo_b, hi_b = _two_ranges(lo, full_hi, hi, EDGE_FIRST)
    dq = _dq_loop(
        dq, q, do, lse, lse_lo, delta, k_base, v_base, mask_base, ds_base, kpm_base, lo_a, hi_a,
        row0,
        rows_local, offs_n, offs_d, offs_dv, stride_kn, stride_vn, stride_mm, stride_mn,
        stride_pn, seed, drop_t, out_scale, drop_base, qk_scale, Lq, Lk,
        HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, IS_CAUSAL, MASK_KIND, ROW_STAT, HAS_KPM, HAS_DROPOUT,
        WRITE_DS, DOT_PREC, EDGE_FIRST, BLOCK_N, USE_TMA,
    )
    dq = _dq_loop(
        dq, q, do, lse, lse_lo, delta, k_base, v_base, mask_base, ds_base, kpm_base, lo_b, hi_b,
        row0,
        rows_local, offs_n, offs_d, offs_dv, stride_kn, stride_vn, stride_mm, stride_mn,
        stride_pn, seed, drop_t, out_scale, drop_base, qk_scale, Lq, Lk,
        HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, IS_CAUSAL, MASK_KIND, ROW_STAT, HAS_KPM, HAS_DROPOUT,
        WRITE_DS, DOT_PREC, not EDGE_FIRST, BLOCK_N, USE_TMA,
    )
    _store_rows(DQ + off_b * stride_dqb + off_h * stride_dqh, row0, rows_local, Lq, stride_dqm,
                offs_d, (dq * sm_scale).to(DQ.dtype.element_ty), HEAD_D, BLOCK_D)


# fmt: on


# --------------------------------------------------------------------------- configs


class Config(NamedTuple):
    """One launch configuration: tile sizes (query rows, key rows), warps, pipeline stages,
    and for dK/dV with both accumulators (PART 0) the tile orientation: (key x query) tiles,
    or (query x key) tiles when qk_tiles (the orientation of the dropout keep-mask). tma: the
    loop's tiles through TMA descriptors; ws (forward, with tma): the key loop warp-specialized
    (`ws_candidates`)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    qk_tiles: bool = False
    tma: bool = False
    ws: bool = False


# The interpreter runs one fixed small config (fast tests); GPUs autotune over small lists keyed
# by (kernel, arch family, dtype class, head-dim bucket, feature class). The feature class
# matters because dropout (a Philox call per 8 scores) and mask tiles cost registers: "base" = no
# attn_mask / padding / dropout (causal allowed), "padded" = key padding alone, "masked" =
# attn_mask (with or without key padding), "dropout" = dropout without attn_mask,
# "masked_dropout" = dropout with attn_mask (the dropout list less _MASKED_DROPOUT_SPILLS);
# "plain" = base without causal, only for _PLAIN_KEYS. Every entry is
# checked by compile_report() in CI: no stack frame (spills) with Triton 3.6 and 3.8, smem
# within the arch's limit, wgmma for fp16/bf16 on sm_90.
INTERPRET_CONFIG = Config(32, 32, 4, 1)
FEATURE_CLASSES = ("base", "padded", "masked", "dropout", "masked_dropout")
_C = Config


def _QK(block_m: int, block_n: int, num_warps: int, num_stages: int) -> Config:
    return Config(block_m, block_n, num_warps, num_stages, qk_tiles=True)


# fmt: off
# (kernel, dtype class, bucket): (base, masked, dropout) config lists ("padded" gets base +
# masked, see _with_padded). Config = (BLOCK_M query rows, BLOCK_N keys, warps, stages); dkdv
# programs own BLOCK_N keys and step over BLOCK_M queries, fwd/dq programs own BLOCK_M queries
# and step over BLOCK_N keys.
_SM90 = {
    # dropout: (64, 32, 4, 3) holds 157 registers at d64 (3 blocks, 12 warps an SM, where
    # (128, 32, 8, 3) fits 1 block of 8): more warps to overlap the Philox ALU work with the
    # MMAs (dropout tripled the forward's time on an H200 with (128, 32, 8, 3) alone).
    # (128, 64, 8, 3) fits dropout without spills since the keep-mask needs no conversion.
    # base: (128, 64, 4, 3) won on an H200 (0.716 ms against 0.811 for (128, 128, 8, 3), d64
    # s2048): one warpgroup a CTA, two CTAs an SM (255 registers). (64, 128, 4, 2) is built the
    # same way (178-226 registers) with 128-key tiles: its Q K^T wgmma reads 25% fewer
    # shared-memory bytes a FLOP (Q and K both come from shared memory) and it rescales O half
    # as often a score.
    ("fwd", "16bit", 64): ([_C(128, 64, 4, 3), _C(128, 128, 8, 3), _C(64, 128, 4, 2)],
                           [_C(128, 64, 8, 3), _C(128, 32, 8, 3)],
                           [_C(128, 32, 8, 3), _C(64, 32, 4, 3), _C(128, 64, 8, 3)]),
    ("fwd", "16bit", 128): ([_C(128, 64, 8, 3), _C(128, 128, 8, 2)], [_C(128, 64, 8, 3)],
                            [_C(128, 32, 8, 3), _C(64, 32, 4, 3), _C(128, 64, 8, 3)]),
    # dropout: 16-key tiles use half of each Philox call; 32 keys fit too (not with a float
    # mask: _MASKED_DROPOUT_SPILLS).
    ("fwd", "16bit", 256): ([_C(128, 64, 8, 2), _C(128, 32, 8, 2)], [_C(128, 32, 8, 2)],
                            [_C(128, 32, 8, 2), _C(128, 16, 8, 2)]),
    # dropout: (query x key) tiles take the keep-mask without conversions. Of those, 32-query
    # tiles run their score products on mma.sync, and the 64 x 64 and 128 x 64 tiles all on
    # wgmma with ~35% fewer SASS instructions a score (sm_90 cubins) but spill a few bytes with
    # Triton 3.8 (_VERSION_SPILLS). The (key x query) tile is the previous default.
    # base: (128, 64) query x key tiles, 13.0 SASS instructions a score in the key loop against
    # 13.8 for (64, 128, 8, 2) and 17.1 for (32, 128, 8, 3) (causal or padded; Triton 3.6).
    ("dkdv", "16bit", 64): ([_C(32, 128, 8, 3), _C(64, 128, 8, 2), _QK(128, 64, 8, 2)],
                            [_C(32, 128, 8, 3)],
                            [_QK(32, 128, 8, 3), _QK(64, 64, 4, 3), _QK(128, 64, 8, 2),
                             _C(32, 128, 8, 3)]),
    # dropout: (16, 128, 8, 2) spilled 8 bytes with the previous dropout scheme's tile.
    # base: (128, 64) query x key tiles, 14.7 SASS instructions a score in the key loop (no
    # mask) against 17.6 for (32, 128, 8, 2) (sm_90, Triton 3.6).
    ("dkdv", "16bit", 128): ([_C(32, 128, 8, 2), _C(32, 64, 8, 2), _QK(128, 64, 8, 2)],
                             [_C(32, 64, 8, 2)], [_C(32, 64, 8, 2), _QK(32, 64, 8, 2)]),
    ("dkdv", "16bit", 256): ([_C(32, 64, 8, 2)], [_C(16, 64, 8, 2)], [_C(16, 64, 8, 2)]),
    # base: 128-key tiles, 6.8 SASS instructions a score in the key loop (no mask) against 8.3
    # for (128, 64, 8, 2) and 9.2 for (128, 32, 4, 3) (sm_90, Triton 3.6); 252 registers.
    ("dq", "16bit", 64): ([_C(128, 32, 4, 3), _C(128, 64, 8, 2), _C(128, 128, 8, 3)],
                          [_C(128, 32, 8, 3)],
                          [_C(128, 32, 8, 3), _C(64, 32, 4, 3), _C(128, 64, 8, 2)]),
    ("dq", "16bit", 128): ([_C(128, 32, 8, 2), _C(128, 64, 8, 2)], [_C(128, 32, 8, 2)],
                           [_C(128, 32, 8, 2), _C(64, 32, 4, 3)]),
    ("dq", "16bit", 256): ([_C(64, 32, 8, 2)], [_C(64, 16, 8, 2)], [_C(64, 16, 8, 2)]),
    # fp32 runs "ieee" dots on FMA units, whose operand layouts need many registers: small tiles.
    # (fwd with dropout: 8 warps; with 4 the dropout tile assembly spilled, up to 2.5 KB at D256.)
    # Where a list's tile spilled 8-24 bytes in a feature twin (FEATURE_TWINS; sm_90 or sm_80,
    # Triton 3.6, 3.8 or 3.9), it holds the one candidate that compiled cleanly in every class it
    # serves, twins included, on both archs under all three versions: fwd d64/d128 dropout one
    # stage (as sm_80's d256 masked dropout), dK/dV d64/d128 4 warps and one stage.
    ("fwd", "fp32", 64): ([_C(32, 16, 4, 2)], [_C(32, 16, 4, 2)], [_C(32, 16, 8, 1)]),
    ("fwd", "fp32", 128): ([_C(32, 16, 4, 2)], [_C(32, 16, 4, 2)], [_C(32, 16, 8, 1)]),
    ("fwd", "fp32", 256): ([_C(32, 16, 4, 2)], [_C(32, 16, 4, 2)], [_C(32, 16, 8, 2)]),
    # dkdv masked / dropout: the base configs spilled 4-260 bytes with a float mask or the
    # transposed 32-column keep-mask tile (sm_90 or sm_80, Triton 3.6 or 3.8); these do not.
    # dropout: (16, 32, 8, 2) spilled 8 bytes without a mask (Triton 3.8).
    ("dkdv", "fp32", 64): ([_C(16, 32, 4, 2)], [_C(16, 32, 4, 2)], [_C(16, 16, 4, 1)]),
    # masked: (16, 16, 8, 2) spilled 16 bytes with Triton 3.8 (sm_90) once the grid gave batch
    # and head a dim each, at 80 registers; 4 warps do not (128-142 registers, 3.6 and 3.8).
    ("dkdv", "fp32", 128): ([_C(16, 32, 8, 2)], [_C(16, 16, 4, 1)], [_C(16, 16, 4, 1)]),
    # dropout: no candidate of seven compiled every twin cleanly under 3.6 (sm_90, 8 bytes).
    ("dkdv", "fp32", 256): ([_C(16, 16, 4, 2)], [_C(16, 16, 8, 2)], [_C(16, 16, 8, 2)]),
    ("dq", "fp32", 64): ([_C(16, 16, 4, 2)], [_C(16, 16, 4, 2)], [_C(16, 16, 8, 2)]),
    ("dq", "fp32", 128): ([_C(16, 16, 4, 2)], [_C(16, 16, 8, 2)], [_C(16, 16, 8, 1)]),
    # masked: (16, 16, 4, 2) spilled 16 bytes with the float mask's row statistics (_row_lse),
    # and (32, 16, 8, 2) 16 with a bool mask and no key padding (3.6); (16, 16, 4, 3) did not.
    # dropout: 16 with Triton 3.6 once float32 kept them too (ROW_STAT), where (16, 16, 8, 2)
    # compiles cleanly for every class, sm_90 and sm_80, 3.6 and 3.8 (75-171 registers).
    ("dq", "fp32", 256): ([_C(16, 16, 4, 2)], [_C(16, 16, 4, 3)], [_C(16, 16, 8, 2)]),
}
# sm_80 (and the fallback for other archs): mma.sync, 164 KB smem on A100 (99 KB on sm_86/89;
# the autotuner drops configs that do not fit).
_SM80 = {
    # masked: (64, 64, 4, 3) spilled 8 bytes with Triton 3.6 (not 3.8); dq d128 dropout:
    # (64, 16, 4, 2) spilled 16.
    ("fwd", "16bit", 64): ([_C(128, 64, 4, 3), _C(64, 64, 4, 3)], [_C(64, 32, 4, 3)],
                           [_C(64, 32, 4, 2)]),
    ("fwd", "16bit", 128): ([_C(128, 64, 8, 2), _C(64, 64, 4, 2)], [_C(64, 32, 8, 2)],
                            [_C(64, 32, 8, 2)]),
    # dropout: 32-key tiles (whole Philox calls) next to the 16-key ones, where they fit.
    ("fwd", "16bit", 256): ([_C(64, 64, 8, 2), _C(64, 32, 8, 2)], [_C(64, 32, 8, 2)],
                            [_C(64, 32, 8, 2), _C(64, 16, 4, 2)]),
    # dkdv dropout, (query x key) tiles: 64 x 64 and 128-key tiles spilled 12-996 bytes.
    ("dkdv", "16bit", 64): ([_C(32, 128, 8, 2), _C(32, 64, 4, 2)], [_C(16, 128, 8, 2)],
                            [_QK(64, 32, 4, 2), _QK(32, 32, 4, 2)]),
    ("dkdv", "16bit", 128): ([_C(32, 64, 8, 2)], [_C(32, 64, 8, 2)], [_QK(16, 64, 8, 2)]),
    ("dkdv", "16bit", 256): ([_C(32, 64, 8, 2)], [_C(16, 64, 8, 2)], [_C(16, 64, 8, 2)]),
    ("dq", "16bit", 64): ([_C(128, 32, 8, 2), _C(64, 64, 4, 2)], [_C(64, 32, 4, 2)],
                          [_C(64, 32, 4, 2)]),
    ("dq", "16bit", 128): ([_C(128, 32, 8, 2), _C(64, 32, 4, 2)], [_C(64, 32, 4, 2)],
                           [_C(32, 32, 4, 2), _C(32, 16, 4, 2)]),
    ("dq", "16bit", 256): ([_C(64, 32, 8, 2)], [_C(64, 16, 8, 2)],
                           [_C(64, 32, 8, 2), _C(64, 16, 8, 2)]),
    **{key: lists for key, lists in _SM90.items() if key[1] == "fp32"},
    # dropout: (32, 16, 8, 1) spilled 8 bytes with Triton 3.9 (sm_80 only).
    ("fwd", "fp32", 128): ([_C(32, 16, 4, 2)], [_C(32, 16, 4, 2)], [_C(32, 16, 8, 2)]),
    # sm_80 spilled 4-8 bytes with these sm_90 configs: dkdv d64 (16, 32, 4, 2) causal and
    # (16, 32, 8, 2) with a float mask, d256 (16, 16, 4, 2) causal; dq d256 (16, 16, 4, 2) and
    # (16, 16, 8, 2) causal (Triton 3.6 or 3.8). dkdv d64 dropout: (16, 32, 8, 2) spilled 8
    # bytes in Triton 3.6's own compile (its cubin), (16, 32, 4, 2) 8-16 with either version.
    ("dkdv", "fp32", 64): ([_C(16, 32, 8, 2)], [_C(16, 32, 4, 2)], [_C(16, 16, 4, 1)]),
    # d256 dropout: (16, 16, 8, 2) spilled 8 bytes with Triton 3.8 once the grid gave batch
    # and head a dim each (3.8 held it at 128 registers); (16, 16, 4, 1) takes 216, 3.6 and 3.8.
    ("dkdv", "fp32", 256): ([_C(16, 16, 8, 2)], [_C(16, 16, 8, 2)], [_C(16, 16, 4, 1)]),
    # (32, 16, 8, 2) spills 20 bytes with key padding and Triton 3.6 (_VERSION_SPILLS); masked
    # and dropout: (32, 16, 8, 2) and (16, 16, 8, 2) spilled 8-24 bytes in feature twins (3.6,
    # 3.8 or 3.9), these did in none ((16, 16, 4, 2) spilled 8 bytes with 3.6 once float32 kept
    # the row statistics, ROW_STAT).
    ("dq", "fp32", 256): ([_C(32, 16, 8, 2)], [_C(16, 16, 4, 3)], [_C(16, 32, 8, 2)]),
}


# Base configs that spill with key padding + causal (compile_report, Triton 3.6 or 3.8): not
# "padded" candidates. (kernel, bucket, config) per arch; 16-bit tables only. (dq d64
# (128, 128, 8, 3): 32-48 bytes since dq computes delta.)
_PADDED_SPILLS = {
    90: {("fwd", 64, _C(128, 64, 4, 3)), ("fwd", 128, _C(128, 128, 8, 2)),
         ("dkdv", 128, _C(32, 128, 8, 2)), ("dq", 64, _C(128, 128, 8, 3))},
    80: {("fwd", 64, _C(64, 64, 4, 3)), ("fwd", 128, _C(128, 64, 8, 2)),
         ("dkdv", 64, _C(32, 64, 4, 2)), ("dq", 64, _C(64, 64, 4, 2))},
}


# Dropout configs that spill with an attn_mask too (a float mask's tile and the row statistics of
# _row_lse; compile_report, Triton 3.6 or 3.8): not "masked_dropout" candidates. (kernel,
# dtype class, bucket, config) per arch; _MASKED_DROPOUT_EXTRA gives lists left empty others.
# sm_80 fwd d256 (64, 16, 4, 2): 8 bytes with a float32 Out (the op's out32), Triton 3.6.
_MASKED_DROPOUT_SPILLS = {
    90: {("fwd", "16bit", 256, _C(128, 32, 8, 2)), ("dkdv", "16bit", 64, _QK(64, 64, 4, 3))},
    80: {("dq", "16bit", 256, _C(64, 32, 8, 2)), ("fwd", "fp32", 256, _C(32, 16, 8, 2)),
         ("fwd", "16bit", 256, _C(64, 16, 4, 2))},
}
# (arch, kernel, dtype class, bucket) -> configs: fp32 d256 (32, 16, 8, 1), one stage, 240-246
# registers on sm_80 (3.6, 3.8).
_MASKED_DROPOUT_EXTRA = {(80, "fwd", "fp32", 256): [_C(32, 16, 8, 1)]}


def _with_padded(
    arch: int, kernel: str, dclass: str, bucket: int, lists: tuple
) -> tuple[list[Config], ...]:
    # Key padding alone costs a byte a key and a select a score: most base configs fit it (and
    # run it as fast as no padding, less the skipped tiles), next to the float-mask ones. With
    # only the latter, padded calls ran at the masked configs' speed: 0.716 ms against 0.757
    # without padding, for 25% fewer keys (H200, d64 s2048). Dropout with an attn_mask gets the
    # dropout configs that fit a float mask too.
    base, masked, dropout = lists
    fits = [c for c in base if (kernel, bucket, c) not in _PADDED_SPILLS[arch]]
    spills = _MASKED_DROPOUT_SPILLS[arch]
    masked_dropout = [c for c in dropout if (kernel, dclass, bucket, c) not in spills]
    masked_dropout += _MASKED_DROPOUT_EXTRA.get((arch, kernel, dclass, bucket), [])
    return base, list(dict.fromkeys(fits + masked)), masked, dropout, masked_dropout


# Configs that spill with one Triton version only (that version's compile_report): left out
# while it runs, so that every config in use compiles without spills. (kernel, arch, bucket,
# feature class, config). The dkdv d64 entry of 3.6 (4 bytes) showed only once the check read
# Triton's own cubins: a separate ptxas run had reported no spill.
_VERSION_SPILLS = {
    (3, 6): {
        ("dq", 80, 256, "padded", _C(32, 16, 8, 2)),
        ("dkdv", 80, 64, "padded", _C(16, 32, 8, 2)),
        # 8 bytes once the diagonal's query blocks came last (ptxas had serialized it).
        ("dkdv", 90, 128, "masked_dropout", _C(32, 64, 8, 2)),
        # fp32, not causal: 216 and 24 bytes.
        ("fwd", 90, 128, "base", _C(32, 16, 4, 2)),
        ("dq", 80, 256, "base", _C(32, 16, 8, 2)),  # fp32, causal: 24 bytes
    },
    (3, 8): {
        ("dkdv", 90, 64, "dropout", _QK(128, 64, 8, 2)),
        ("dkdv", 90, 64, "masked_dropout", _QK(128, 64, 8, 2)),
        ("dkdv", 90, 128, "masked_dropout", _C(32, 64, 8, 2)),
        ("dkdv", 90, 128, "padded", _QK(128, 64, 8, 2)),
        # fp32, not causal: 8 bytes.
        ("dkdv", 80, 128, "padded", _C(16, 32, 8, 2)),
    },
    # 8-144 bytes.
    (3, 9): {
        ("dkdv", 90, 64, "dropout", _QK(64, 64, 4, 3)),
        ("dkdv", 90, 64, "dropout", _QK(128, 64, 8, 2)),
        ("dkdv", 90, 64, "masked_dropout", _QK(128, 64, 8, 2)),
        ("dkdv", 90, 128, "base", _QK(128, 64, 8, 2)),
        ("dkdv", 90, 128, "masked_dropout", _C(32, 64, 8, 2)),
        ("dkdv", 90, 128, "padded", _QK(128, 64, 8, 2)),
        ("dkdv", 90, 256, "base", _C(16, 16, 4, 2)),  # fp32
        ("dq", 90, 64, "masked_dropout", _C(128, 64, 8, 2)),
        ("dq", 90, 256, "masked_dropout", _C(64, 16, 8, 2)),
        # causal without key padding (16-32 and 16 bytes; `compile_jobs(twins=True)`)
        ("fwd", 90, 128, "masked_dropout", _C(128, 64, 8, 3)),
        ("fwd", 90, 128, "masked_dropout", _C(64, 32, 4, 3)),
        ("fwd", 90, 256, "dropout", _C(128, 32, 8, 2)),
        ("dkdv", 90, 256, "masked_dropout", _C(16, 64, 8, 2)),  # bool mask (a twin): 8 bytes
        # fp32, not causal: 8 bytes.
        ("dkdv", 80, 128, "padded", _C(16, 32, 8, 2)),
    },
}


def _triton_version() -> tuple[int, int]:
    return tuple(int(x) for x in triton.__version__.split(".")[:2])


# What takes the place of a version's spilling configs in the lists they would leave empty:
# 0 spills and wgmma under that version (compile_report). CONFIGS key -> configs. The d256 dq's
# one 0-spill wgmma tile under 3.9 is deeper and taller: 64-row tiles spilled 56-632 bytes.
_VERSION_EXTRA = {
    (3, 6): {
        ("fwd", 90, "fp32", 128, "base"): [_C(32, 16, 8, 2)],
        ("dq", 80, "fp32", 256, "base"): [_C(32, 16, 8, 3)],
    },
    (3, 9): {
        ("dq", 90, "16bit", 256, "masked_dropout"): [_C(128, 16, 8, 3)],
        ("dkdv", 90, "16bit", 256, "masked_dropout"): [_C(16, 64, 8, 3)],
        ("dkdv", 90, "fp32", 256, "base"): [_C(16, 16, 4, 1)],
    },
}


def _for_this_triton(key: tuple, configs: list[Config]) -> list[Config]:
    kernel, arch, _, bucket, fclass = key
    version = _triton_version()
    spills = _VERSION_SPILLS.get(version, set())
    kept = [c for c in configs if (kernel, arch, bucket, fclass, c) not in spills]
    return kept + _VERSION_EXTRA.get(version, {}).get(key, [])


# The CONFIGS keys (arch, kernel, dclass, bucket) with a "plain" list, for non-causal calls
# without masks, padding or dropout: the base configs, and on sm_90 the TMA-only tiles of
# _TMA_EXTRA[(kernel, bucket, "plain")], which spill with the causal diagonal's mask.
_PLAIN_KEYS = {(90, "dkdv", "16bit", 64)}


def listed_configs(kernel: str, arch: int, dclass: str, bucket: int, fclass: str) -> list[Config]:
    """The tables' configs of one CONFIGS key, before the Triton version's changes."""
    table = _SM90 if arch == 90 else _SM80
    lists = _with_padded(arch, kernel, dclass, bucket, table[(kernel, dclass, bucket)])
    if fclass == "plain":
        return lists[0]
    return lists[FEATURE_CLASSES.index(fclass)]


CONFIGS: dict[tuple[str, int, str, int, str], list[Config]] = {
    key: _for_this_triton(key, listed_configs(*key))
    for key in [
        (kernel, arch, dclass, bucket, fclass)
        for arch, table in ((90, _SM90), (80, _SM80))
        for kernel, dclass, bucket in table
        for fclass in FEATURE_CLASSES
    ] + [(kernel, arch, dclass, bucket, "plain") for arch, kernel, dclass, bucket in _PLAIN_KEYS]
}
# fmt: on
# The most query rows of a dq block: its dS stores (a float mask's gradient) address
# rows * Lk inside the block in int32 (TMA twins keep their config's block shape).
DQ_MAX_BLOCK_M = max(
    c.block_m for key, configs in CONFIGS.items() if key[0] == "dq" for c in configs
)
KERNELS = {"fwd": attn_fwd, "dkdv": attn_bwd_dkdv, "dq": attn_bwd_dq}
_CHECKED_KERNELS = {**KERNELS, "kv_range": attn_kv_range}
# The kernels' pointer (tensor) arguments.
_FP32_POINTERS = {"Lse", "Stat", "Delta", "DLse", "DS"}
_POINTERS = {"Q", "K", "V", "Out", "DO", "DQ", "DK", "DV", "Mask", "Kpm", "KvRange", "Seed"}
_POINTERS |= _FP32_POINTERS
# Re-tune when any of these change; Triton's autotuner adds the tensor dtypes itself.
# (`_tune_key` keeps a kernel's own: Triton 3.9 refuses a key name that is not an argument.)
_TUNE_KEY = [
    "HEAD_D",
    "HEAD_DV",
    "IS_CAUSAL",
    "MASK_KIND",
    "ROW_STAT",
    "HAS_KPM",
    "HAS_DROPOUT",
    "PART",
    "WRITE_DS",
    "SEQ_Q_BUCKET",
    "SEQ_K_BUCKET",
]
INTERPRETED = not isinstance(attn_fwd, triton.runtime.JITFunction)
# Every compile and launch asks for FMA contraction, as every config was tuned and checked with:
# Triton's default until 3.9, which warns that 3.10 turns it off.
COMPILE_OPTIONS = {"enable_fp_fusion": True}


def _tune_key(fn) -> list[str]:
    """The names of _TUNE_KEY that are arguments of the kernel `fn` (Triton <= 3.8 dropped the
    others silently)."""
    return [name for name in _TUNE_KEY if name in fn.arg_names]


def dropout_threshold(dropout_p: float) -> int:
    """The kernels' integer dropout threshold: a score is kept when its 16-bit lane >= this."""
    return round(dropout_p * 65536)


def bh_grid(blocks: int, batch: int, heads: int) -> tuple[int, int, int]:
    """The grid of the three attention kernels: (blocks along the sequence, heads, batch).

    The sequence blocks of one (batch, head) come first in launch order, so the programs running
    at once share that head's keys and values in L2 (causal query blocks without key padding in
    reverse order: `_query_block`). Batch and heads get a grid dim each, each up to MAX_GRID_YZ:
    in one dim, B * H could not pass 65535 (B = 2048 with H = 32 is 65536). Larger batches or
    head counts take the torch backend (fastformer.ops.attention)."""
    return (blocks, heads, batch)


def _cdiv(a: int, b: int) -> int:
    # triton.cdiv and triton.next_power_of_2 are constexpr functions: ~2 us a call on the host.
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 0


def block_dim(d: int) -> int:
    """Padded tile width of a head dim: next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, _next_power_of_2(d))


def dim_bucket(d: int, dv: int) -> int:
    """Config-table bucket of the head dims: 64, 128 or 256."""
    return max(64, block_dim(max(d, dv)))


def dtype_class(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "16bit"


def arch_family(device: torch.device) -> int:
    """90 for Hopper and Blackwell datacenter parts, 80 for everything else."""
    major, _ = torch.cuda.get_device_capability(device)
    return 90 if major in (9, 10) else 80


def dkdv_parts(dtype: torch.dtype, d: int, dv: int) -> tuple[int, ...]:
    """PART values of the dK/dV launches: (0,) one launch for both, (1, 2) dV then dK.

    fp16/bf16 head dims > 128 split: both accumulators plus K and V tiles do not fit in
    registers on sm_90 without spills. fp32 tiles are small enough to keep both.
    """
    return (1, 2) if dim_bucket(d, dv) > 128 and dtype != torch.float32 else (0,)


def _seq_bucket(n: int) -> int:
    # Autotune once per power-of-two sequence length, not per exact length.
    return _next_power_of_2(max(n, 64))


def feature_class(mask_kind: int, has_kpm: bool, has_dropout: bool) -> str:
    """ "base", "padded", "masked", "dropout" or "masked_dropout": which config list a call
    uses (see CONFIGS)."""
    if has_dropout:
        return "dropout" if mask_kind == MASK_NONE else "masked_dropout"
    if mask_kind != MASK_NONE:
        return "masked"
    return "padded" if has_kpm else "base"


def config_class(kernel: str, arch: int, dclass: str, bucket: int, meta: dict) -> str:
    """The feature class whose CONFIGS list tunes a launch with these constants."""
    fclass = feature_class(meta["MASK_KIND"], meta["HAS_KPM"], meta["HAS_DROPOUT"])
    plain = fclass == "base" and not meta["IS_CAUSAL"]
    return "plain" if plain and (kernel, arch, dclass, bucket, "plain") in CONFIGS else fclass


def _constexprs(kernel: str, c: Config) -> dict:
    # The launch constants a config sets: its tiles, TMA loads in its loop, dK/dV's tile
    # orientation and the forward's warp specialization.
    blocks = {"BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "USE_TMA": c.tma}
    if kernel == "fwd":
        return {**blocks, "WARP_SPEC": c.ws}
    return {**blocks, "QK_TILES": c.qk_tiles} if kernel == "dkdv" else blocks


def _tune_bench(kernel_call, quantiles):
    # Triton's default times each candidate for 25 + 100 ms; the candidates of one key differ
    # by 5-40 % on kernels of 0.05-2 ms, which 5 + 25 ms (>= 10 runs) tells apart, and a model
    # tunes ~20 candidates on its first step.
    return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


@functools.cache
def _autotuned(kernel: str, arch: int, dclass: str, bucket: int, fclass: str, tma: bool = False):
    listed = CONFIGS[(kernel, arch, dclass, bucket, fclass)]
    if tma:
        listed = listed + tma_candidates(kernel, arch, dclass, bucket, fclass, WS)
    configs = [
        triton.Config(
            {**_constexprs(kernel, c), **COMPILE_OPTIONS},
            num_warps=c.num_warps,
            num_stages=c.num_stages,
        )
        for c in listed
    ]
    # cache_results: the choice of each key is kept in Triton's cache directory, so a later
    # process (the next training run, bench or test) does not tune it again.
    fn = KERNELS[kernel]
    tune = triton.autotune(
        configs=configs, key=_tune_key(fn), do_bench=_tune_bench, cache_results=True
    )
    return tune(fn)


# --------------------------------------------------------------------------- TMA loads
# On sm_90 and newer each kernel also tunes a twin of each 16-bit config whose loop reads its
# tiles (K and V in fwd and dq, Q and dO in dkdv) through TMA descriptors (one per program and
# slice, made on the device: `_slice_descriptor`); FASTFORMER_ATTN_TMA=0 (read at import) leaves
# them out. sm_90 compile: 186-201 registers instead of 249-255 for the d64 (128, 64, 4, 3)
# forward, 6% fewer SASS instructions in its key loop. On by default since the H200 run of
# 2026-12-04: the GPU tests and the parity grid passed with them, the twin test gave the pointer
# loads' bits, and they won the d64 forward and dK/dV by 7-19% (benchmarks/NOTES.md).
TMA = os.environ.get("FASTFORMER_ATTN_TMA", "1") != "0"
# Twins that spill (compile_report, Triton 3.6 or 3.8): (kernel, bucket, feature class, config).
# The split d256 dK/dV (PART 1 and 2) has none: its twins took 20-90 more registers than the
# pointer loads, and the dK part spilled 4-832 bytes.
_TMA_SPILLS = {
    ("fwd", 256, "masked_dropout", _C(128, 32, 8, 2)),
    ("fwd", 256, "masked", _C(128, 32, 8, 2)),
    ("fwd", 256, "padded", _C(128, 64, 8, 2)),
    ("dkdv", 128, "masked_dropout", _QK(32, 64, 8, 2)),
}
# Twins that spill with one Triton version only, where the pointer-load config does not, and
# TMA-only tiles (_TMA_EXTRA, named with tma=True) that spill with one version only.
_TMA_VERSION_SPILLS = {
    (3, 9): {
        # 32 bytes once the diagonal's query blocks came last (ptxas had serialized the kernel).
        ("dkdv", 64, "masked_dropout", _QK(32, 128, 8, 3)),
        ("dkdv", 128, "dropout", _QK(32, 64, 8, 2)),
        ("dq", 256, "masked_dropout", _C(128, 16, 8, 3)),
        # 120 bytes (3.9 spilled with pointer loads too, 168 bytes).
        ("dkdv", 64, "plain", _QK(128, 128, 8, 2)._replace(tma=True)),
        ("dkdv", 64, "plain", _QK(128, 128, 8, 3)._replace(tma=True)),
    },
}


# TMA-only tiles: bigger or deeper-pipelined tiles that the pointer loads leave no registers
# for (the d64 (128, 64, 4, 3) forward was at 255 with them), tuned with the twins. 0 spills with
# TMA, causal or not (sm_90, Triton 3.6 and 3.8). (kernel, bucket, feature class) -> configs.
_TMA_EXTRA = {
    ("fwd", 64, "base"): [
        _C(128, 128, 8, 4, tma=True),
        _C(256, 64, 8, 3, tma=True),
        _C(128, 64, 4, 4, tma=True),
    ],
    # (128, 128, 8, 3): the Triton tutorial's Hopper tile for d128, a stage more than the
    # table's (128, 128, 8, 2); 203-211 registers, 230,400 bytes of shared memory (the limit is
    # 232,448), 0 spills under Triton 3.6, 3.8 and 3.9. d128's forward was 0.70x cuDNN's on the
    # H200 (12-04), where the two d128 twins lost to the pointer loads by 2-10%. Not yet timed.
    ("fwd", 128, "base"): [_C(128, 64, 8, 4, tma=True), _C(128, 128, 8, 3, tma=True)],
    # dK/dV (128 x 128) query x key tiles of the "plain" list: 9.4 SASS instructions a score in
    # the query loop against 12.4 for (64, 128, 8, 2) and 15.9 for (32, 128, 8, 3) (sm_90,
    # Triton 3.6). Causal, they spill (8-104 bytes); not causal, 245-254 registers with TMA,
    # and 8 bytes of spills with pointer loads since the partial last query block has a loop
    # of its own (attn_bwd_dkdv: before it, ptxas serialized their wgmma).
    ("dkdv", 64, "plain"): [
        _QK(128, 128, 8, 3)._replace(tma=True),
        _QK(128, 128, 8, 2)._replace(tma=True),
    ],
}

# Warp-specialized forward tiles (Triton's automatic warp specialization on sm_90, the shape of
# FlashAttention-3): a producer warpgroup issues the TMA loads, and the compiler splits the
# 128 query rows between two consumer warpgroups. num_warps 4 becomes 12 warps at 168
# registers (the file's cap for 384 threads), 0 spills (sm_90, Triton 3.6, 3.8 and 3.9); with 8
# warps the compiler leaves the loop alone. One key loop, every tile under the bound and causal
# masks: a second loop for the edge tiles after the specialized one failed to compile. Calls
# without masks, padding or dropout, causal or not (`ws_candidates`; the others not tried).
# Not timed on a GPU yet: FASTFORMER_ATTN_WS=1 (read at import) lets them tune; the compile
# check builds them either way.
_WS_TILES = {
    64: [_C(128, 64, 4, 3, tma=True, ws=True), _C(128, 128, 4, 3, tma=True, ws=True)],
    128: [_C(128, 64, 4, 3, tma=True, ws=True), _C(128, 128, 4, 2, tma=True, ws=True)],
}
WS = os.environ.get("FASTFORMER_ATTN_WS", "0").strip().lower() in ("1", "true", "yes", "on")


def tma_candidates(
    kernel: str, arch: int, dclass: str, bucket: int, fclass: str, ws: bool = True
) -> list[Config]:
    """What TMA adds to one CONFIGS list (sm_90 table, 16-bit): the TMA twin of each config,
    less the spilling, and the TMA-only tiles, with `ws` the warp-specialized ones
    (`ws_candidates`)."""
    if arch != 90 or dclass != "16bit" or kernel not in KERNELS:
        return []
    if kernel == "dkdv" and bucket > 128:
        return []
    configs = CONFIGS[(kernel, arch, dclass, bucket, fclass)]
    spills = _TMA_SPILLS | _TMA_VERSION_SPILLS.get(_triton_version(), set())
    twins = [c._replace(tma=True) for c in configs if (kernel, bucket, fclass, c) not in spills]
    extra = [
        c
        for c in _TMA_EXTRA.get((kernel, bucket, fclass), [])
        if (kernel, bucket, fclass, c) not in spills
    ]
    return twins + extra + (ws_candidates(kernel, bucket, fclass) if ws else [])


def ws_candidates(kernel: str, bucket: int, fclass: str) -> list[Config]:
    """The warp-specialized forward tiles of a call without masks, padding or dropout (the
    "base" list, causal or not), head-dim bucket 64 or 128, sm_90 and TMA loads (Q's too):
    `_WS_TILES`."""
    return list(_WS_TILES.get(bucket, [])) if (kernel, fclass) == ("fwd", "base") else []


def tma_ok(kernel: str, *tensors: torch.Tensor) -> bool:
    """Whether `kernel`'s TMA twins may tune for the tensors its loop reads (K and V for dq,
    Q and dO for dkdv; Q, K and V for fwd, whose warp-specialized tiles load Q through TMA
    too): enabled (TMA), a 16-bit CUDA call on sm_90 or newer, and every
    (batch, head) slice meeting TMA's alignment (base and row stride multiples of 16 bytes; the
    kernels' last stride is 1)."""
    if not TMA or kernel not in KERNELS:
        return False
    t = tensors[0]
    if t.device.type != "cuda" or t.dtype not in (torch.float16, torch.bfloat16):
        return False
    if torch.cuda.get_device_capability(t.device)[0] < 9:
        return False
    return all(_tma_aligned(x) for x in tensors)


def _tma_aligned(x: torch.Tensor) -> bool:
    # Slice bases (data_ptr + b * stride_b + h * stride_h) and rows 16-byte aligned, rows
    # distinct (a broadcast row stride of 0 is not a TMA layout).
    step = 16 // x.element_size()
    strides = x.stride()[:3]
    return x.data_ptr() % 16 == 0 and strides[2] > 0 and all(st % step == 0 for st in strides)


def _ensure_allocator() -> None:
    """Device-made descriptors need Triton's scratch allocator (per thread: a context
    variable); set one on the torch caching allocator, never over the user's."""
    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(_scratch)


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    # The caching allocator's blocks are 512-byte aligned, above the 128 TMA needs.
    return torch.empty(size, dtype=torch.int8, device="cuda")


class _Launch(NamedTuple):
    kernel: str
    grid: object  # the grid, or a function of the config's constants that gives it
    args: tuple
    meta: dict
    tma: bool = False  # also tune the TMA twins of the configs (tma_ok said yes)


def _precompile(launches: list[_Launch], q: torch.Tensor) -> None:
    """Compile every autotune candidate of the (CUDA) launches whose key is new, all at once, in
    threads, so that the autotuner then only times them: it compiles one after another (~1-2 s
    of one core each), and Triton releases the GIL for most of a compile (a d64 backward's 8
    sm_90 candidates in 2.5 s instead of 4.3 on the 2-core CI VM). Best effort: a candidate
    that fails here is compiled (and its error met) by the autotuner."""
    jobs = []
    for launch in launches:
        if _tuned_key(launch.kernel, launch.args, launch.meta, q, launch.tma) not in _TUNED:
            tuned = _autotuned(
                launch.kernel, *_table_key(launch.kernel, launch.meta, q, launch.tma)
            )
            jobs += [(launch, c) for c in tuned.configs] if len(tuned.configs) > 1 else []
    if len(jobs) >= 2 and (os.cpu_count() or 1) >= 2:
        _compile_at_once(jobs)


def _compile_at_once(jobs: list[tuple[_Launch, triton.Config]]) -> None:
    """Compile each (launch, autotune config) into the JIT cache its launch will look up
    (`warmup` under Triton's AsyncCompileMode with a thread pool: triton-lang/triton#7306)."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # Triton before 3.4: the autotuner compiles them
        return
    pool = ThreadPoolExecutor(min(len(jobs), os.cpu_count() or 1))
    with pool, AsyncCompileMode(pool, ignore_errors=True):
        for launch, c in jobs:
            try:
                KERNELS[launch.kernel].warmup(
                    *launch.args, **launch.meta, **c.all_kwargs(), grid=launch.grid
                )
            except Exception:  # raised before its compile started: the autotuner reports it
                pass


def _table_key(
    kernel: str, meta: dict, q: torch.Tensor, tma: bool = False
) -> tuple[int, str, int, str, bool]:
    # (arch, dtype class, head-dim bucket, feature class, TMA twins): which candidates tune a
    # launch.
    arch, dclass = arch_family(q.device), dtype_class(q.dtype)
    bucket = dim_bucket(meta["HEAD_D"], meta["HEAD_DV"])
    return arch, dclass, bucket, config_class(kernel, arch, dclass, bucket, meta), tma


# Held while a launch tunes a new key (first calls only: tuned keys launch without it). One
# Autotuner serves every key of its (kernel, arch, dtype class, head-dim bucket, feature class),
# and keeps the last key's state: two threads tuning two of its keys at once crashed in it
# (`nargs` set to None by the other thread: TypeError) or stored the other key's `best_config`.
_TUNE_LOCK = threading.Lock()


def _launch(
    kernel: str,
    grid,
    args: tuple,
    meta: dict,
    q: torch.Tensor,
    config: Config | None,
    then: tuple[_Launch, ...] = (),
    tma: bool = False,
) -> None:
    # then: the launches that follow this one in the same call (a backward's dK/dV after dq),
    # whose new keys' candidates compile together with this one's. tma: tma_ok(...) of the
    # launch's K and V (the TMA twins join its candidates).
    if config is None and (INTERPRETED or q.device.type != "cuda"):
        config = INTERPRET_CONFIG
    if config is not None:
        _check_ws(kernel, config, meta)
        blocks = _constexprs(kernel, config)
        if config.tma and not INTERPRETED:
            _ensure_allocator()
        options = dict(blocks, num_warps=config.num_warps, num_stages=config.num_stages)
        options.update(COMPILE_OPTIONS)
        fixed_key = (kernel, config, *meta.items())
        launcher.launch(KERNELS[kernel], grid(blocks), args, fixed_key, meta, options)
        return
    key = _tuned_key(kernel, args, meta, q, tma)
    best = _TUNED.get(key)
    if tma:
        _ensure_allocator()
    if best is None:
        _refuse_tuning_in_capture(kernel, q)
        with _TUNE_LOCK:
            best = _TUNED.get(key)  # None unless another thread tuned the key while this waited
            if best is None:
                _tune(kernel, grid, args, meta, q, key, then, tma)  # its first launch too
                return
    launcher.launch(KERNELS[kernel], grid(best), args, (key, *best.items()), meta, best)


def _check_ws(kernel: str, config: Config, meta: dict) -> None:
    # A fixed config (tests): the warp-specialized loop takes no masks, padding or dropout (the
    # "base" feature class, whose lists `ws_candidates` joins).
    fclass = feature_class(meta["MASK_KIND"], meta["HAS_KPM"], meta["HAS_DROPOUT"])
    if config.ws and not (kernel == "fwd" and config.tma and fclass == "base"):
        raise ValueError(
            f"config {config}: warp specialization is for TMA forwards without masks, padding "
            "or dropout"
        )


def _tune(kernel: str, grid, args: tuple, meta: dict, q, key: tuple, then: tuple, tma: bool):
    """Tune `key` (the autotuner's first launch of it) and keep its choice in _TUNED."""
    table_key = _table_key(kernel, meta, q, tma)
    tuned = _autotuned(kernel, *table_key)
    known = len(tuned.cache)
    _precompile([_Launch(kernel, grid, args, meta, tma), *then], q)
    tuned[grid](*args, **meta)  # tunes on the first call of its key
    _TUNED[key] = tuned.best_config.all_kwargs()
    timed = len(tuned.configs) > 1 and len(tuned.cache) > known  # it benchmarked just now
    timings = getattr(tuned, "configs_timings", None) if timed else None
    _log_tuning(kernel, table_key[3], key, tuned.best_config, timings)


def _refuse_tuning_in_capture(kernel: str, q: torch.Tensor) -> None:
    """A launch whose key this process never tuned compiles (or loads) and times its
    candidates: inside CUDA graph capture that fails with an opaque capture error. (No CUDA
    context, no capture: nothing is asked then.)"""
    if (
        q.device.type == "cuda"
        and torch.cuda.is_initialized()
        and torch.cuda.is_current_stream_capturing()
    ):
        raise RuntimeError(
            f"fastformer attention: the {kernel} kernel meets a new shape class inside CUDA "
            f"graph capture (q {tuple(q.shape)}, {q.dtype}), and compiling or tuning it there "
            "would break the capture. Run one step outside capture first with the same shapes."
        )


def _config_name(config) -> str:
    # A triton.Config as "BLOCK_M x BLOCK_N, warps w, stages s[, qk][, tma]".
    kw = config.kwargs
    qk = ", qk" if kw.get("QK_TILES") else ""
    tma = ", tma" if kw.get("USE_TMA") else ""
    ws = ", ws" if kw.get("WARP_SPEC") else ""
    return f"{kw['BLOCK_M']}x{kw['BLOCK_N']} w{config.num_warps} s{config.num_stages}{qk}{tma}{ws}"


def _log_tuning(kernel: str, fclass: str, key: tuple, best, timings: dict | None) -> None:
    _, device, seq_q, seq_k, *rest = key
    meta = dict(item for item in rest if isinstance(item, tuple))
    dtype = next(item for item in rest if isinstance(item, torch.dtype))  # the query's
    entry = {"kernel": kernel, "feature_class": fclass, "device": str(device), "dtype": str(dtype)}
    entry.update(seq_q_bucket=seq_q, seq_k_bucket=seq_k, **meta)
    entry["chosen"] = _config_name(best)
    if timings:
        entry["ms"] = {_config_name(c): _median_ms(t) for c, t in timings.items()}
    TUNING_LOG.append(entry)


def _median_ms(timing) -> float | None:
    # The autotuner's timing of one config: [median, p20, p80] ms, or inf when it did not fit.
    ms = float(timing[0] if isinstance(timing, (list, tuple)) else timing)
    return ms if math.isfinite(ms) else None


# What each autotuned key chose, and (when it benchmarked) every candidate's median ms: the
# bench stores it, so a GPU run shows which configs win without a profiler.
TUNING_LOG: list[dict] = []


# Launch kwargs of the config Triton's autotuner chose, by _tuned_key. Later calls launch it
# directly: Autotuner.run spends ~60 us of host time a call building its key from ~55 arguments
# (list membership tests; Triton 3.6 and 3.8, 2-core CI VM), about 5x a launch's own share, and
# a short attention call is bound by host time.
_TUNED: dict[tuple, dict] = {}
_SEQ_BUCKET_ARGS = {
    name: (fn.arg_names.index("SEQ_Q_BUCKET"), fn.arg_names.index("SEQ_K_BUCKET"))
    for name, fn in KERNELS.items()
}
# Positions of the tensor arguments: their dtypes by index (~1.4 us a key on the CI VM) rather
# than by testing each of ~55 arguments (~4.5 us), 4 launches an attention fwd+bwd.
_TENSOR_ARGS = {
    name: tuple(i for i, arg in enumerate(fn.arg_names) if arg in _POINTERS)
    for name, fn in KERNELS.items()
}


def _tuned_key(kernel: str, args: tuple, meta: dict, q: torch.Tensor, tma: bool = False) -> tuple:
    # At least what Triton's autotuner keys on (_TUNE_KEY and every tensor argument's dtype),
    # so the config read back after a tuned call is the one for this key; plus the device and
    # whether TMA twins were candidates (a TMA choice must not serve a call that cannot use it).
    iq, ik = _SEQ_BUCKET_ARGS[kernel]
    dtypes = [getattr(args[i], "dtype", None) for i in _TENSOR_ARGS[kernel]]
    return (kernel, q.device, args[iq], args[ik], *meta.items(), *dtypes, tma)


# --------------------------------------------------------------------------- launchers
# fmt: off


class _Mask(NamedTuple):
    tensor: torch.Tensor
    strides: tuple[int, ...]
    kind: int


def _attn_mask(mask: torch.Tensor | None, shape: tuple[int, ...], dummy: torch.Tensor) -> _Mask:
    # Broadcast through strides (0 on broadcast dims): the mask is never materialized.
    if mask is None:
        return _Mask(dummy, (0, 0, 0, 0), MASK_NONE)
    kind = MASK_BOOL if mask.dtype == torch.bool else MASK_FLOAT
    if kind == MASK_BOOL:
        mask = mask.view(torch.uint8)
    mask = mask[(None,) * (4 - mask.dim())].expand(shape)
    return _Mask(mask, tuple(mask.stride()), kind)


class _Padding(NamedTuple):
    tensor: torch.Tensor  # (B, Lk) uint8, nonzero = padding
    kv_range: torch.Tensor  # (B, 2) int32: first kept key, last kept key + 1 ((0, 0) if none)
    strides: tuple[int, int]


def _padding(
    kpm: torch.Tensor | None, dummy: torch.Tensor, kv_range: torch.Tensor | None = None
) -> _Padding:
    if kpm is None:
        return _Padding(dummy, dummy, (0, 0))
    kpm = _kpm_layout(kpm)
    if kv_range is None:
        kv_range = key_range(kpm)
    return _Padding(kpm, kv_range, (kpm.stride(0), kpm.stride(1)))


# The seed argument that sends the kernels to Seed: negative, and of int64's class, as host
# seeds in [2**32, 2**63) are. Triton types a do_not_specialize int by its range, so -1 (int32)
# made other kernels: the first captured call compiled and loaded 3 of them inside capture.
_SEED_IN_MEMORY = -(2**62)


def _seed_args(seed: int | torch.Tensor, device: torch.device) -> tuple[torch.Tensor, int]:
    """(Seed pointer, seed argument) of a launch: an int seed is passed as the argument; a
    seed tensor (drawn on the device inside CUDA graph capture) is read by the kernels from
    memory, which the argument `_SEED_IN_MEMORY` tells them."""
    if isinstance(seed, torch.Tensor):
        return seed, _SEED_IN_MEMORY
    # With an int seed the kernels never read Seed: an uninitialized tensor of the call's own.
    # Not one kept across calls: one made in inductor's CUDA-graph warm-up lives in the graph
    # pool, which cudagraph trees refuse ("tensor(s) in the cudagraph pool not tracked as
    # outputs", H200, 2026-12-04).
    return torch.empty((), dtype=torch.int64, device=device), seed


def _stat_arg(
    mask: _Mask, stat: torch.Tensor | None, lse: torch.Tensor
) -> tuple[torch.Tensor, bool]:
    """(the Stat argument of a launch, its ROW_STAT): `stat` when the caller keeps one (the op
    does for float masks and float32 inputs), a scratch buffer for a float mask without one
    (its kernels always take P from the split statistics), else lse (never read)."""
    if stat is not None:
        return stat, True
    if mask.kind == MASK_FLOAT:
        return lse.new_empty(*lse.shape, 2), True
    return lse, False


def _on_device_of(fn):
    """`fn` run with its first argument's CUDA device current. Triton launches on the current
    device and its current stream, whatever device the tensors are on: a model on cuda:1 in a
    process whose current device is cuda:0 would launch there, on memory of another GPU."""

    @functools.wraps(fn)
    def run(first: torch.Tensor, *args, **kwargs):
        device = first.device
        if device.type != "cuda" or device.index == torch.cuda.current_device():
            return fn(first, *args, **kwargs)
        with torch.cuda.device(device):
            return fn(first, *args, **kwargs)

    return run


@_on_device_of
def key_range(key_padding_mask: torch.Tensor) -> torch.Tensor:
    """(B, 2) int32: each batch row's first kept key and last kept key + 1, (0, 0) when every
    key is padding; one attn_kv_range launch. The forward's can serve its backward."""
    kpm = _kpm_layout(key_padding_mask)
    b, lk = kpm.shape
    if b == 0 or lk == 0:  # nothing to launch over; no key is kept
        return torch.zeros(b, 2, dtype=torch.int32, device=kpm.device)
    kv_range = torch.empty(b, 2, dtype=torch.int32, device=kpm.device)
    block = min(max(16, _next_power_of_2(lk)), KV_RANGE_BLOCK)
    options = {"BLOCK_N": block, "num_warps": 4, **COMPILE_OPTIONS}
    launcher.launch(attn_kv_range, (b,), (kpm, kv_range, lk, *kpm.stride()), block, {}, options)
    return kv_range


def _kpm_layout(kpm: torch.Tensor) -> torch.Tensor:
    """The (B, Lk) key padding mask as uint8, copied when its key offsets (key * stride, int32
    in the kernels) would pass 2**31: a strided view (a column of a wider buffer) read the
    last keys' flags 2 GiB before the mask."""
    kpm = kpm.view(torch.uint8)
    if max(kpm.shape[1] - 1, 0) * kpm.stride(1) >= INT32_LIMIT:
        return kpm.contiguous()
    return kpm


def slice_extent(x: torch.Tensor) -> int:
    """Largest element offset inside one (batch, head) slice of a 4-D tensor: the kernels
    address within a slice in int32, so it must stay below INT32_LIMIT."""
    _, _, rows, cols = x.shape
    _, _, row_stride, col_stride = x.stride()  # never negative in PyTorch
    return max(rows - 1, 0) * row_stride + max(cols - 1, 0) * col_stride


def _kernel_layout(x: torch.Tensor) -> torch.Tensor:
    # The kernels take every stride but the last: copy only when the last one is not 1, or
    # when a strided slice would overflow int32 offsets (a contiguous one fits: the op checks).
    if x.is_contiguous() or (x.stride(-1) == 1 and slice_extent(x) < INT32_LIMIT):
        return x  # (x.contiguous() would be x itself)
    return x.contiguous()


def _empty_like_order(q: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """An empty (B, H, L, Dv) tensor whose batch, head and sequence dims lie in memory in the
    order of q's (say (B, L, H, Dv) for heads split off a (B, L, H * D) projection), so that the
    caller merges the heads of the output back with a view, not a copy (as torch's SDPA)."""
    order = _memory_order(q.stride()[:3], q.shape[:3])
    if order == (0, 1, 2):
        return q.new_empty(shape)
    out = q.new_empty(*(shape[i] for i in order), shape[3]).permute(*_INVERSE[order], 3)
    # Dense: every offset is below numel, so only a large one needs the slice's extent.
    if out.numel() < INT32_LIMIT or slice_extent(out) < INT32_LIMIT:
        return out
    return q.new_empty(shape)


def _memory_order(strides: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[int, ...]:
    """The dims in memory order, outermost first (ties keep their order). A size-1 dim says
    nothing of the layout, so it keeps its place in (B, H, L) relative to the others. An
    expanded (stride 0) query is no projection's split to merge back: (B, H, L), contiguous as
    torch's SDPA output (an expanded batch had made the output's batch innermost)."""
    if any(s == 0 and n > 1 for s, n in zip(strides, sizes)):
        return (0, 1, 2)
    laid = sorted((i for i in range(3) if sizes[i] > 1), key=lambda i: -strides[i])
    for i in (i for i in range(3) if i not in laid):
        laid.insert(next((j for j, d in enumerate(laid) if d > i), len(laid)), i)
    return tuple(laid)


# The inverse of each order of the (B, H, L) dims: out.permute(*_INVERSE[order]) maps a tensor
# allocated in `order` back to (B, H, L).
_INVERSE = {
    order: tuple(order.index(i) for i in range(3)) for order in itertools.permutations(range(3))
}


def _tile_one_buffer(parts: tuple[torch.Tensor, ...]) -> bool:
    """Whether (B, H, L, D) `parts` are the head splits of consecutive slices of one dense
    (B, L, n * H * D) or (L, B, n * H * D) tensor (n = len(parts)), as nn.MultiheadAttention's
    packed projections make them: same shape, strides and storage, heads and head dims
    contiguous, part i at offset i * H * D, and (B, L) rows of n * H * D elements without gaps."""
    first = parts[0]
    (_, h, _, d), stride = first.shape, first.stride()
    if first.numel() == 0 or stride[3] != 1 or (h > 1 and stride[1] != d):
        return False
    width = h * d
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for i, t in enumerate(parts):
        same = t.shape == first.shape and t.stride() == stride and t.dtype == first.dtype
        if not same or t.untyped_storage().data_ptr() != storage:
            return False
        if t.storage_offset() != offset + i * width:
            return False
    expected = len(parts) * width  # rows of n * H * D elements, inner (B or L) dim first
    for dim in sorted((i for i in (0, 2) if first.shape[i] > 1), key=lambda i: stride[i]):
        if stride[dim] != expected:
            return False
        expected *= first.shape[dim]
    return True


def grads_like(*inputs: torch.Tensor) -> list[torch.Tensor]:
    """Empty gradient tensors for q, k, v (or some of them), laid out in memory as the inputs
    are: views of one fresh buffer with the inputs' geometry when they tile one buffer together
    (`_tile_one_buffer`: heads split off a packed projection), else `torch.empty_like` (the
    same strides for a dense input). The caller's backward of its head split is then a view of
    that buffer, not a stack and a copy (fastformer.nn.MultiheadAttention)."""
    for group in (inputs, inputs[1:]):  # q, k, v packed; or k, v packed (cross-attention)
        if len(group) > 1 and _tile_one_buffer(group):
            first = group[0]
            buf = first.new_empty(len(group) * first.numel())
            width = first.shape[1] * first.shape[3]
            views = [
                buf.as_strided(first.shape, first.stride(), i * width) for i in range(len(group))
            ]
            return [torch.empty_like(t) for t in inputs[: len(inputs) - len(group)]] + views
    return [torch.empty_like(t) for t in inputs]


def _meta(
    q, k, v, mask: _Mask, kpm, dropout_p: float, is_causal: bool, row_stat: bool
) -> dict:
    d, dv = q.shape[-1], v.shape[-1]
    return {
        "HEAD_D": d,
        "HEAD_DV": dv,
        "BLOCK_D": block_dim(d),
        "BLOCK_DV": block_dim(dv),
        "IS_CAUSAL": bool(is_causal),
        "MASK_KIND": mask.kind,
        "ROW_STAT": row_stat,
        "HAS_KPM": kpm is not None,
        "HAS_DROPOUT": dropout_p > 0.0,
        # fp32 inputs get true fp32 products (not tf32); fp16/bf16 use tensor cores.
        "DOT_PREC": "ieee" if q.dtype == torch.float32 else "tf32",
    }


@_on_device_of
def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    seed: int | torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    config: Config | None = None,
    kv_range: torch.Tensor | None = None,
    like_query: bool = False,
    stat: torch.Tensor | None = None,
    out32: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention forward; inputs are trusted (fastformer.ops.attention validates them).

    Args:
        q: (B, H, Lq, D) fp16/bf16/fp32; k: (B, Hkv, Lk, D), v: (B, Hkv, Lk, Dv), same dtype,
            H % Hkv == 0.
        attn_mask: None, bool (True = attend) or float (added), broadcastable to (B, H, Lq, Lk).
        key_padding_mask: None or (B, Lk) bool, True = padding.
        seed: dropout seed (ignored when dropout_p == 0): an int in [0, 2**63), or a 0-dim
            int64 tensor on q's device that the kernels read (seeds drawn on the device inside
            CUDA graph capture).
        config: fixed tile config instead of the autotuned/interpreter one (tests).
        kv_range: key_range(key_padding_mask) when the caller has it already.
        like_query: out in q's order of dims in memory (see `_empty_like_order`), else
            contiguous.
        stat: None, or a (B, H, Lq, 2) float32 tensor that receives each row's score max and
            log2 of its exponential sum, for attention_backward (its `stat`): the LSE alone
            loses the sum's log where a large negative bias dominates a row, and float32
            gradients missed the parity bound past |LSE| ~ 900. With a float attn_mask and no
            `stat` a scratch buffer takes them.
        out32: None, or a contiguous (B, H, Lq, Dv) float32 tensor that receives O before its
            rounding to q's dtype (out is then its copy), for attention_backward's `out`: the
            backward's delta = rowsum(dO * O) is as exact as this O.

    Returns:
        out (B, H, Lq, Dv) in q's dtype, lse (B, H, Lq) fp32 (natural log; -inf when every key
        of the row is masked).
    """
    q, k, v = _kernel_layout(q), _kernel_layout(k), _kernel_layout(v)
    b, h, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    shape = (b, h, lq, v.shape[-1])
    out = _empty_like_order(q, shape) if like_query else q.new_empty(shape)
    lse = torch.empty(b, h, lq, dtype=torch.float32, device=q.device)
    if out.numel() == 0 or lk == 0:  # nothing to compute, or every row fully masked
        if out32 is not None:
            out32.zero_()
        return out.zero_(), lse.fill_(float("-inf"))
    o = out if out32 is None else out32  # what the kernel writes
    mask = _attn_mask(attn_mask, (b, h, lq, lk), q)
    pad = _padding(key_padding_mask, q, kv_range)
    stat, row_stat = _stat_arg(mask, stat, lse)
    meta = _meta(q, k, v, mask, key_padding_mask, dropout_p, is_causal, row_stat)
    args = (
        q, k, v, o, lse, stat, mask.tensor, pad.tensor, pad.kv_range,
        *_seed_args(seed, q.device),
        dropout_threshold(dropout_p), qk_scale(scale), 1.0 / (1.0 - dropout_p), *q.stride()[:3],
        *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *mask.strides, *pad.strides, h,
        h // hkv, lq, lk, _seq_bucket(lq), _seq_bucket(lk),
    )
    grid = lambda c: bh_grid(_cdiv(lq, c["BLOCK_M"]), b, h)
    _launch("fwd", grid, args, meta, q, config, tma=tma_ok("fwd", q, k, v))
    if out32 is not None:
        out.copy_(out32)
    return out, lse


@_on_device_of
def attention_backward(
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    seed: int | torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    mask_grad: bool,
    config: Config | None = None,
    kv_range: torch.Tensor | None = None,
    like_inputs: bool = False,
    stat: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of attention_forward's (out, lse) w.r.t. q, k, v and a float attn_mask.

    Args:
        grad_out: (B, H, Lq, Dv) cotangent of out; grad_lse: None or (B, H, Lq) of lse.
        out, lse: what attention_forward returned for these inputs (same seed, int or tensor);
            out may be its `out32` instead (float32, for any q dtype).
        mask_grad: also return d attn_mask (float mask only), shaped and typed like attn_mask.
        kv_range: key_range(key_padding_mask) when the caller has it (the forward's).
        like_inputs: dq, dk, dv laid out in memory as q, k, v are (see `grads_like`), else
            contiguous.
        stat: what attention_forward wrote into its `stat`, or None: P then comes from lse,
            which loses precision where |lse| is large (a large negative bias on every key of
            a row; float32 logits past ~900).

    Returns:
        (dq, dk, dv, dmask or None), dq/dk/dv in the dtype and shape of q/k/v.
    """
    q, k, v = _kernel_layout(q), _kernel_layout(k), _kernel_layout(v)
    grad_out, out = _kernel_layout(grad_out), _kernel_layout(out)
    b, h, lq, d = q.shape
    hkv, lk, dv = k.shape[1], k.shape[2], v.shape[3]
    group = h // hkv if h and hkv else 1  # no query heads: nothing to compute, dk = dv = 0
    # Every element of dq, dk, dv is written by the kernels (zeros where nothing is visible).
    if group == 1 and like_inputs:
        dq, dk, dv_ = grads_like(q, k, v)
    elif group == 1:
        dq, dk, dv_ = (t.new_empty(t.shape) for t in (q, k, v))
    else:  # GQA: per-query-head dK/dV in fp32, summed over each group below (deterministic)
        dq = grads_like(q)[0] if like_inputs else q.new_empty(q.shape)
        dk = torch.empty(b, h, lk, d, dtype=torch.float32, device=q.device)
        dv_ = torch.empty(b, h, lk, dv, dtype=torch.float32, device=q.device)
    ds = None
    if mask_grad and attn_mask is not None:  # skipped tiles are never written: start at 0
        ds = torch.zeros(b, h, lq, lk, dtype=torch.float32, device=q.device)
    if q.numel() == 0 or lk == 0:  # no scores: every gradient is 0
        for t in (dq, dk, dv_):
            t.zero_()
    else:
        _backward_kernels(
            grad_out, grad_lse, q, k, v, out, lse, attn_mask, key_padding_mask, seed, dropout_p,
            is_causal, scale, dq, dk, dv_, ds, config, kv_range, stat,
        )
    if group > 1:
        dk = dk.view(b, hkv, group, lk, d).sum(2).to(q.dtype)
        dv_ = dv_.view(b, hkv, group, lk, dv).sum(2).to(q.dtype)
    dmask = None
    if ds is not None:
        shape4 = (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)
        dmask = ds.sum_to_size(shape4).view(attn_mask.shape).to(attn_mask.dtype)
    return dq, dk, dv_, dmask


def _backward_kernels(
    grad_out,
    grad_lse,
    q,
    k,
    v,
    out,
    lse,
    attn_mask,
    key_padding_mask,
    seed,
    dropout_p,
    is_causal,
    scale,
    dq,
    dk,
    dv,
    ds,
    config,
    kv_range,
    stat,
) -> None:
    b, h, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    delta = torch.empty(b, h, lq, dtype=torch.float32, device=q.device)  # written by dq
    dlse = delta if grad_lse is None else grad_lse.float().contiguous()
    mask = _attn_mask(attn_mask, (b, h, lq, lk), q)
    pad = _padding(key_padding_mask, q, kv_range)
    seed_ptr, seed = _seed_args(seed, q.device)
    if mask.kind == MASK_FLOAT and stat is None:  # from lse: (lse, 0) (_row_lse)
        hi = torch.where(lse == float("-inf"), float("inf"), lse)
        stat = torch.stack((hi, torch.zeros_like(hi)), -1)
    stat, row_stat = _stat_arg(mask, stat, lse)
    meta = _meta(q, k, v, mask, key_padding_mask, dropout_p, is_causal, row_stat)
    common = (
        seed, dropout_threshold(dropout_p), 1.0 / (1.0 - dropout_p), qk_scale(scale), scale,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *grad_out.stride()[:3],
    )
    tail = (*mask.strides, *pad.strides, h, h // hkv, lq, lk, _seq_bucket(lq), _seq_bucket(lk))
    args = (
        q, k, v, grad_out, lse, stat, delta, dk, dv, mask.tensor, pad.tensor, seed_ptr, *common,
        *dk.stride()[:3], *dv.stride()[:3], *tail,
    )
    dq_args = (
        q, k, v, grad_out, lse, stat, delta, dq, mask.tensor, pad.tensor, pad.kv_range,
        delta if ds is None else ds, out, dlse, seed_ptr, *common, *dq.stride()[:3],
        *out.stride()[:3], *tail,
    )
    dq_meta = {**meta, "WRITE_DS": ds is not None, "HAS_DLSE": grad_lse is not None}
    dkdv_grid = lambda c: bh_grid(_cdiv(lk, c["BLOCK_N"]), b, h)
    tma = tma_ok("dkdv", q, grad_out)
    dkdv = tuple(
        _Launch("dkdv", dkdv_grid, args, {**meta, "PART": part}, tma)
        for part in dkdv_parts(q.dtype, meta["HEAD_D"], meta["HEAD_DV"])
    )
    # dK/dV read the delta dq writes: dq first.
    dq_grid = lambda c: bh_grid(_cdiv(lq, c["BLOCK_M"]), b, h)
    _launch("dq", dq_grid, dq_args, dq_meta, q, config, then=dkdv, tma=tma_ok("dq", k, v))
    for launch in dkdv:
        _launch(*launch[:4], q, config, tma=launch.tma)
# fmt: on


# --------------------------------------------------------------------------- compile check (sm_90, sm_80)

_TRITON_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_FLOAT_ARGS = {"qk_scale", "out_scale", "sm_scale"}
_HELPER_KERNELS = ("kv_range",)  # no matrix products, no feature variants
# Arguments that are 1 in the usual contiguous case: Triton specializes them to constants.
_ONE_ARGS = {"stride_mn", "stride_pn", "GROUP"}


class Variant(NamedTuple):
    """The constexpr features a compile check turns on."""

    name: str
    is_causal: bool
    mask_kind: int
    has_kpm: bool
    has_dropout: bool
    out32: bool = False  # Out float32 for 16-bit q (the op's out32)


# The variant each feature class is checked with: its heaviest combination of features.
CHECK_VARIANTS = {
    "base": Variant("causal", True, MASK_NONE, False, False),
    "padded": Variant("padding", True, MASK_NONE, True, False),
    "masked": Variant("masks", True, MASK_FLOAT, True, False),
    "dropout": Variant("dropout", True, MASK_NONE, True, True),
    "masked_dropout": Variant("all", True, MASK_FLOAT, True, True),
    "plain": Variant("plain", False, MASK_NONE, False, False),
}
# The classes `compile_jobs(heaviest_only=True)` keeps: every feature at once (the others are
# subsets of it), causal or not. (The unmasked causal and plain paths were kept too until CI's
# time ran short: 145 kernels under 3.9 then, 72 without them.)
HEAVIEST_CLASSES = (
    "masked_dropout",
    "masked_dropout_out32",
    "masked_dropout_nc",
    "masked_dropout_out32_nc",
)
# Float-mask classes again with a float32 Out: the fwd and dq specializations of 16-bit calls
# whose float32 mask needs a gradient (dq loads the float32 O for delta, 2x its registers).
OUT32_CLASSES = ("masked", "masked_dropout")
CHECK_VARIANTS.update(
    {
        f"{c}_out32": CHECK_VARIANTS[c]._replace(name=CHECK_VARIANTS[c].name + "-out32", out32=True)
        for c in OUT32_CLASSES
    }
)
# Each causal class once more without causal (base's twin is "plain"): a non-causal kernel is
# not a lighter copy of the causal one. Before they were checked, ptxas serialized the wgmma of
# 26 non-causal dK/dV kernels (Triton 3.6), and 5 fp32 or d256 kernels spilled 8-216 bytes
# not causal only (3.6, 3.8, 3.9).
NONCAUSAL_TWIN = {
    c: "plain" if c == "base" else f"{c}_nc" for c, v in CHECK_VARIANTS.items() if v.is_causal
}
CHECK_VARIANTS.update(
    {
        NONCAUSAL_TWIN[c]: v._replace(name=v.name + "-nc", is_causal=False)
        for c, v in list(CHECK_VARIANTS.items())
        if v.is_causal and c != "base"
    }
)


def _feature_twins(c: str, v: Variant) -> dict[str, Variant]:
    twins = {}
    if v.has_kpm and (v.mask_kind != MASK_NONE or v.has_dropout):
        twins[f"{c}_nokpm"] = v._replace(name=v.name + "-nokpm", has_kpm=False)
    if v.mask_kind == MASK_FLOAT and not v.out32:  # a bool mask has no gradient
        bool_mask = v._replace(name=v.name + "-bool", mask_kind=MASK_BOOL)
        twins[f"{c}_bool"] = bool_mask
        twins[f"{c}_bool_nokpm"] = bool_mask._replace(name=v.name + "-bool-nokpm", has_kpm=False)
    return twins


# Each class with a mask or dropout once more without key padding, and with a bool mask: the
# classes hold key padding and a float mask (the heaviest), yet a kernel without them is not a
# lighter copy either. Compiled for every config (3.6, sm_90), they found 67 serialized kernels
# and 13 spills (fwd and dq with a mask and no key padding among them, the calls of most
# torch users), before the key loops' orders took key padding into account. Not in CI's check
# (`compile_jobs(twins=True)`, `--twins`; ~600 more sm_90 kernels): their problems under 3.6,
# 3.8 and 3.9 are listed in benchmarks/NOTES.md.
FEATURE_TWINS = {c: _feature_twins(c, v) for c, v in CHECK_VARIANTS.items()}
CHECK_VARIANTS.update({t: v for twins in FEATURE_TWINS.values() for t, v in twins.items()})


def _compile_inputs(
    kernel: str, dtype: torch.dtype, head_dim: int, config: Config, variant: Variant, part: int = 0
) -> tuple[dict, dict, dict]:
    """ASTSource signature, constexprs and attrs of one kernel specialization, as a launch with
    contiguous inputs (sizes multiples of 16) would produce them."""
    fn = _CHECKED_KERNELS[kernel]
    ty = _TRITON_DTYPE[dtype]
    constexprs = {
        "HEAD_D": head_dim,
        "HEAD_DV": head_dim,
        "BLOCK_D": block_dim(head_dim),
        "BLOCK_DV": block_dim(head_dim),
        "IS_CAUSAL": variant.is_causal,
        "MASK_KIND": variant.mask_kind,
        # as the op launches them (fastformer.ops.attention._new_stat)
        "ROW_STAT": variant.mask_kind == MASK_FLOAT or dtype == torch.float32,
        "HAS_KPM": variant.has_kpm,
        "HAS_DROPOUT": variant.has_dropout,
        "DOT_PREC": "ieee" if dtype == torch.float32 else "tf32",
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "PART": part,
        "QK_TILES": config.qk_tiles,
        "USE_TMA": config.tma,
        "WARP_SPEC": config.ws,
        "WRITE_DS": variant.mask_kind == MASK_FLOAT,
        "HAS_DLSE": True,
    }
    constexprs.update({name: 1 for name in _ONE_ARGS})
    constexprs = {name: value for name, value in constexprs.items() if name in fn.arg_names}
    signature, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in _POINTERS:
            signature[name] = "*" + _pointer_type(name, ty, variant)
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name == "seed":
            signature[name] = "i64"
        elif name in _FLOAT_ARGS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith(("stride", "Lq", "Lk", "SEQ")):
                attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def _pointer_type(name: str, ty: str, variant: Variant) -> str:
    if name in _FP32_POINTERS or (name == "Out" and variant.out32):
        return "fp32"
    if name == "KvRange":
        return "i32"
    if name == "Seed":
        return "i64"
    if name == "Kpm" or (name == "Mask" and variant.mask_kind == MASK_BOOL):
        return "u8"
    if name == "Mask":
        return "fp32"  # a float mask may be fp32 for any q dtype: the most shared memory
    return ty


def _cubin_usage(cubin: bytes) -> dict:
    """Registers, stack frame (spills) and local memory of the one kernel of a cubin Triton
    built (fastformer._cuobjdump says why the cubin and not a second ptxas run)."""
    from fastformer import _cuobjdump

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        (usage,) = _cuobjdump.resource_usage(path).values()
    return {"registers": usage["REG"], "stack": usage["STACK"], "local": usage["LOCAL"]}


# ptxas -v's line of the kernel's registers ("ptxas info    : Used 138 registers, ..."; Triton
# 3.9 runs ptxas-blackwell, whose lines begin "ptxas-blackwell info").
_PTXAS_REGISTERS = re.compile(r" info +: Used \d+ registers")


def _ptxas_log(ptx: str, arch: int, printed: str) -> str:
    """ptxas's log (`-v`) of the kernel: the one Triton's compile printed, else, when the compile
    was a cache hit and printed nothing, that of a second ptxas run on the PTX (~0.15 s of CPU).
    That run lacks Triton's -lineinfo and --regAllocOptLevel=2 (3.8); on every sm_90 kernel of
    the check under 3.6 and 3.8 the two logs agreed on C7515."""
    if _PTXAS_REGISTERS.search(printed):
        return printed
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(arch).path, "-v", f"--gpu-name={sm_arch_from_capability(arch)}"]
        done = subprocess.run([*cmd, src, "-o", src + ".cubin"], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ptxas failed on a PTX Triton built: {done.stderr[-2000:]}")
    return done.stderr


def _wgmma_serialized(ptxas_log: str) -> bool:
    """Whether ptxas serialized the kernel's wgmma: its note C7515 ("wgmma.mma_async
    instructions are serialized due to ..."), after which each wgmma waits for the one before
    it, in every loop of the kernel. Triton prints ptxas's notes only with
    TRITON_DUMP_PTXAS_LOG=1, and only when it compiles."""
    if not _PTXAS_REGISTERS.search(ptxas_log):  # -v always reports them: not ptxas's log
        raise RuntimeError(f"not a ptxas -v log: {ptxas_log[-2000:]!r}")
    return "C7515" in ptxas_log


def _compile_logged(source, arch: int, options: dict) -> tuple:
    """triton.compile for sm_`arch`, and what it printed: ptxas's log when it compiled."""
    from triton.backends.compiler import GPUTarget

    printed = io.StringIO()
    with triton.knobs.nvidia.scope(), contextlib.redirect_stdout(printed):
        triton.knobs.nvidia.dump_ptxas_log = True
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    return compiled, printed.getvalue()


def compile_one(
    kernel: str,
    dtype: torch.dtype,
    head_dim: int,
    config: Config,
    variant: Variant,
    arch: int = 90,
    part: int = 0,
) -> dict:
    """Compile one kernel specialization for sm_`arch` (no GPU needed) and describe it."""
    if INTERPRETED:
        raise RuntimeError("compile checks need the real Triton JIT: unset TRITON_INTERPRET")
    signature, constexprs, attrs = _compile_inputs(kernel, dtype, head_dim, config, variant, part)
    source = triton.compiler.ASTSource(
        fn=_CHECKED_KERNELS[kernel], signature=signature, constexprs=constexprs, attrs=attrs
    )
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages, **COMPILE_OPTIONS}
    compiled, printed = _compile_logged(source, arch, options)
    ptx = compiled.asm["ptx"]  # (the MMA instructions are named there)
    ttgir = compiled.asm["ttgir"]
    return {
        "kernel": kernel,
        "arch": arch,
        "dtype": str(dtype).removeprefix("torch."),
        "head_dim": head_dim,
        "config": list(config),
        "variant": "-" if kernel in _HELPER_KERNELS else variant.name,
        "part": part,
        "wgmma": "wgmma" in ptx,
        # Dots of fewer than 64 rows a warpgroup fall back to mma.sync next to wgmma (the
        # query-block scores of dK/dV tiles of 16 or 32 queries): reported, not a failure.
        "mma_sync": "mma.sync" in ptx,
        # A ws config whose loop the compiler left unspecialized would tune as a duplicate.
        "warp_specialized": "ttg.warp_specialize" in ttgir,
        "wgmma_serialized": "wgmma" in ptx and _wgmma_serialized(_ptxas_log(ptx, arch, printed)),
        "shared": int(compiled.metadata.shared),
        **_cubin_usage(compiled.asm["cubin"]),
    }


def _compile_job(job: tuple) -> dict:
    kernel, dtype_name, head_dim, config, variant_class, arch, part = job
    return compile_one(
        kernel,
        getattr(torch, dtype_name),
        head_dim,
        Config(*config),
        CHECK_VARIANTS[variant_class],
        arch,
        part,
    )


def compile_jobs(arch: int = 90, heaviest_only: bool = False, twins: bool = False) -> list[tuple]:
    """Every kernel specialization the compile check builds for the `arch` config table.

    Each (kernel, head-dim bucket, config, dK/dV part, feature class) is compiled in fp16 (fp32
    for the fp32 table) at the largest head dim of its bucket, with the heaviest feature
    combination of its class (CHECK_VARIANTS). Every class, not only the heaviest that uses a
    config: a lighter one spilled where the heaviest did not (sm_80 fp32, 4-12 bytes). The
    first base config of the 128 and 256 buckets is also compiled in bf16 (wgmma there too;
    same code and registers as fp16 but for the MMA type). On sm_90 the TMA candidates too
    (`tma_candidates`). The float-mask classes of fwd and dq once more with a float32 Out
    (OUT32_CLASSES). Each causal variant once more without causal (NONCAUSAL_TWIN). Plus the
    key-range kernel. `twins`: also each class without key padding and with a bool mask
    (FEATURE_TWINS).

    `heaviest_only`: the feature classes of HEAVIEST_CLASSES only, and one config per
    specialization (kernel, dtype, bucket, feature class, dK/dV part, TMA or not), the one with
    the most tile elements per warp, then the most stages (`_heaviest`): each kernel at its
    heaviest feature set, its config most likely to spill or run out of shared memory (CI's
    spill canary under the newest Triton, 3.9: 72 sm_90 kernels; every config is checked under
    the GPU machine's Triton).
    """
    jobs = set()
    for (kernel, table_arch, dclass, bucket, fclass), configs in CONFIGS.items():
        if table_arch != arch:
            continue
        dtype = "float32" if dclass == "fp32" else "float16"
        parts = dkdv_parts(getattr(torch, dtype), bucket, bucket) if kernel == "dkdv" else (0,)
        out32 = dclass == "16bit" and fclass in OUT32_CLASSES and kernel in ("fwd", "dq")
        tma = tma_candidates(kernel, arch, dclass, bucket, fclass, ws=True)
        classes = [fclass, fclass + "_out32"] if out32 else [fclass]
        classes += [NONCAUSAL_TWIN[c] for c in classes if c in NONCAUSAL_TWIN]
        if twins:
            classes += [t for c in classes for t in FEATURE_TWINS[c]]
        for config, part, vclass in itertools.product([*configs, *tma], parts, classes):
            jobs.add((kernel, dtype, bucket, tuple(config), vclass, arch, part))
        for config, part, vclass in itertools.product(configs[:1], parts, ("base", "plain")):
            if dclass == "16bit" and fclass == "base" and bucket > 64:
                jobs.add((kernel, "bfloat16", bucket, tuple(config), vclass, arch, part))
    if heaviest_only:
        jobs = _heaviest({job for job in jobs if job[4] in HEAVIEST_CLASSES})
    else:
        jobs = sorted(jobs)
    jobs.append(("kv_range", "float16", 64, (0, KV_RANGE_BLOCK, 4, 1), "base", arch, 0))
    return jobs


def _heaviest(jobs: set[tuple]) -> list[tuple]:
    # Registers go with the accumulator elements each thread holds; shared memory with the
    # tiles in flight (stages).
    def weight(job: tuple) -> tuple:
        c = Config(*job[3])
        return (c.block_m * c.block_n / c.num_warps, c.num_stages, job)

    groups: dict[tuple, list[tuple]] = {}
    for job in jobs:
        kernel, dtype, bucket, config, fclass, _, part = job
        c = Config(*config)
        key = (kernel, dtype, bucket, fclass, part, c.tma, c.ws)
        groups.setdefault(key, []).append(job)
    return sorted(max(group, key=weight) for group in groups.values())


def compile_report(
    arch: int = 90, workers: int = 2, heaviest_only: bool = False, twins: bool = False
) -> list[dict]:
    """Compile every config of the `arch` table (see compile_jobs; `heaviest_only`: one config
    per kernel specialization) without a GPU: registers, stack frame (spills), smem and whether
    wgmma was used, one dict per compiled kernel. Needs TRITON_INTERPRET unset and cuobjdump
    (Triton's wheel ships it)."""
    return list(_compile_report_rows(arch, workers, heaviest_only, twins))


def _compile_report_rows(
    arch: int, workers: int, heaviest_only: bool, twins: bool = False
) -> Iterator[dict]:
    # Row by row as they are done: `main` prints each, and the test waiting for it reads a job
    # that prints nothing for minutes as stalled.
    from concurrent.futures import ProcessPoolExecutor

    jobs = compile_jobs(arch, heaviest_only, twins)
    if workers <= 1:
        yield from map(_compile_job, jobs)
        return
    with ProcessPoolExecutor(max_workers=workers) as pool:
        yield from pool.map(_compile_job, jobs)


# Opt-in shared memory per block: A100 (sm_80) and H100/H200 (sm_90).
MAX_SHARED = {80: 163 * 1024, 90: 227 * 1024}

# sm_90 configs whose kernels ptxas serializes (C7515: each wgmma waits for the one before it),
# under Triton 3.6, 3.8 or 3.9, kept as tuning candidates: each one's feature class has a
# config that is not serialized (check_compile_report makes sure), and the autotuner times
# both. (kernel, head-dim bucket, check class, config less its TMA flag); an entry holds for
# the class's FEATURE_TWINS too. Any other serialized kernel fails the compile check.
SERIALIZED_OK = {
    # The 64 x 64 (query x key) tile keeps the diagonal's query blocks first (3.6 only; the
    # other order spilled): serialized, and still the H200's dropout winner (27-31% less time,
    # 12-04). Without key padding not causal too.
    ("dkdv", 64, "dropout", _QK(64, 64, 4, 3)),
    ("dkdv", 64, "dropout_nc", _QK(64, 64, 4, 3)),
    # Not causal, (key x query) tiles with dropout: serialized (3.6) with one query loop or two;
    # with a mask too, when it is bool.
    ("dkdv", 64, "dropout_nc", _C(32, 128, 8, 3)),
    ("dkdv", 64, "masked_dropout_nc", _C(32, 128, 8, 3)),
    # A mask and dropout without key padding: serialized with the edge tiles first (3.6), 8-16
    # bytes of spills with the full ones first (3.6, 3.8; attn_bwd_dq's EDGE_FIRST).
    ("dq", 128, "masked_dropout", _C(64, 32, 4, 3)),
    ("dq", 128, "masked_dropout_out32", _C(64, 32, 4, 3)),
}
_CLASS_OF = {v.name: c for c, v in CHECK_VARIANTS.items()}


def _serialized_ok(row: dict) -> bool:
    config = Config(*row["config"])._replace(tma=False)
    fclass = _CLASS_OF[row["variant"]]
    return any(
        (kernel, bucket, c) == (row["kernel"], row["head_dim"], config)
        and (fclass == ok_class or fclass in FEATURE_TWINS[ok_class])
        for kernel, bucket, ok_class, c in SERIALIZED_OK
    )


def _without_clean_config(report: list[dict]) -> list[str]:
    # The kernels whose every config is serialized (the tolerated ones, SERIALIZED_OK). A kernel
    # compiled with one config only (`heaviest_only`) is judged by the full check.
    groups: dict[tuple, list[dict]] = {}
    for r in report:
        key = (r["arch"], r["kernel"], r["dtype"], r["head_dim"], r["variant"], r.get("part", 0))
        groups.setdefault(key, []).append(r)
    return [
        f"sm_{key[0]} {key[1]} {key[2]} d{key[3]} {key[4]} part {key[5]}: every config serialized"
        for key, rows in groups.items()
        if len(rows) > 1 and all(r.get("wgmma_serialized") for r in rows)
    ]


def check_compile_report(report: list[dict]) -> list[str]:
    """Problems in a compile report: spills, smem over the arch's limit, fp16/bf16 matrix
    products without wgmma on sm_90, and wgmma that ptxas serialized (but SERIALIZED_OK, and
    not in every config of a kernel)."""
    problems = []
    for r in report:
        name = f"sm_{r['arch']} {r['kernel']} {r['dtype']} d{r['head_dim']} {r['config']} "
        name += r["variant"]
        if r["stack"] != 0 or r["local"] != 0:
            problems.append(f"{name}: spills (stack frame {r['stack']}, local {r['local']} bytes)")
        if r["shared"] > MAX_SHARED[r["arch"]]:
            problems.append(f"{name}: {r['shared']} bytes of shared memory")
        needs_wgmma = r["arch"] == 90 and r["dtype"] != "float32"
        needs_wgmma = needs_wgmma and r["kernel"] not in _HELPER_KERNELS
        if needs_wgmma and not r["wgmma"]:
            problems.append(f"{name}: no wgmma in the PTX")
        if Config(*r["config"]).ws and not r.get("warp_specialized"):
            problems.append(f"{name}: ws config not warp-specialized by the compiler")
        if r.get("wgmma_serialized") and not _serialized_ok(r):
            problems.append(f"{name}: wgmma serialized by ptxas (C7515)")
    return problems + _without_clean_config(report)


def main() -> None:
    """`python -m fastformer.kernels.attention [--heaviest-only] [--twins] [arch ...]` (default
    90): print the compile report of each arch table as JSON lines (`compile_jobs`)."""
    import json
    import sys

    flags = {"--heaviest-only", "--twins"}
    args = sys.argv[1:]
    archs = [int(a) for a in args if a not in flags] or [90]
    for arch in archs:
        for row in _compile_report_rows(arch, 2, "--heaviest-only" in args, "--twins" in args):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
