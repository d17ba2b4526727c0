"""Triton kernel that fills a buffer with `tl.rand(seed, offsets)`: the RNG parity probe.

Every Triton kernel of fastformer draws dropout with `tl.rand(seed, offset)` on int64 offsets;
this kernel lets tests compare that stream with fastformer.ops.rng bit for bit.
"""

import torch
import triton
import triton.language as tl


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
    philox_uniform_kernel[(triton.cdiv(n, block),)](seed, offsets, out, n, BLOCK=block)
    return out
