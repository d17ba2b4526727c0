"""Triton kernels that expose `tl.rand` / `tl.randint4x` on int64 offsets: the RNG parity probes.

fastformer's Triton kernels draw dropout from Triton's Philox (`tl.randint4x`, see
kernels/attention.py); these kernels let tests compare that stream with fastformer.ops.rng
bit for bit.
"""

import torch
import triton
import triton.language as tl

from .launcher import launch


@triton.jit
def philox_uniform_kernel(seed, offsets_ptr, out_ptr, n, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = idx < n
    offsets = tl.load(offsets_ptr + idx, mask=valid, other=0)
    tl.store(out_ptr + idx, tl.rand(seed, offsets), mask=valid)


def philox_uniform(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """tl.rand(seed, offsets) for a contiguous int64 `offsets`; float32 of the same shape."""
    out = torch.empty(offsets.shape, dtype=torch.float32, device=offsets.device)
    n = offsets.numel()
    block = 1024
    grid = (triton.cdiv(n, block),)
    launch(philox_uniform_kernel, grid, (seed, offsets, out, n), block, {"BLOCK": block}, {})
    return out


@triton.jit
def philox4x32_kernel(seed, offsets_ptr, out_ptr, n, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = idx < n
    offsets = tl.load(offsets_ptr + idx, mask=valid, other=0)
    w0, w1, w2, w3 = tl.randint4x(seed, offsets)
    # Each uint32 word widened to int64 without sign extension.
    tl.store(out_ptr + idx, w0.to(tl.int64) & 0xFFFFFFFF, mask=valid)
    tl.store(out_ptr + n + idx, w1.to(tl.int64) & 0xFFFFFFFF, mask=valid)
    tl.store(out_ptr + 2 * n + idx, w2.to(tl.int64) & 0xFFFFFFFF, mask=valid)
    tl.store(out_ptr + 3 * n + idx, w3.to(tl.int64) & 0xFFFFFFFF, mask=valid)


def philox4x32(seed: int, offsets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """tl.randint4x(seed, offsets) for a contiguous int64 `offsets`: four int64 tensors."""
    n = offsets.numel()
    out = torch.empty((4, n), dtype=torch.int64, device=offsets.device)
    block = 1024
    grid = (max(triton.cdiv(n, block), 1),)
    launch(philox4x32_kernel, grid, (seed, offsets, out, n), block, {"BLOCK": block}, {})
    return tuple(w.view(offsets.shape) for w in out)
