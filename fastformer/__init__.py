"""fastformer: fused Triton attention and C++/CUDA LayerNorm/FFN kernels for the Transformer.

Drop-in for torch.nn: `fastformer.nn` modules take the same arguments and state_dict keys as
their torch.nn counterparts, and `fastformer.swap(model)` replaces them in an existing model.

    import fastformer
    out = fastformer.scaled_dot_product_attention(q, k, v, key_padding_mask=pad, is_causal=True)
    report = fastformer.swap(model)          # in place; parameters shared, state_dict unchanged
    print(fastformer.explain(model, *inputs))  # which backend runs where, and why
    with fastformer.patch_sdpa():            # F.scaled_dot_product_attention on the kernel
        out = model_that_calls_sdpa(x)
"""

from __future__ import annotations

import importlib
from typing import Any

from fastformer import ops
from fastformer._ext import build_info, cuda_kernels_compiled, extension_error, load_extension

__version__ = "0.1.0"

# Load fastformer._C now so its ops are registered and a torch mismatch warns at import.
load_extension()

# `swap` and `explain` are functions named like their submodules. Imported lazily, the first
# `import fastformer.swap` anywhere would bind the submodule to fastformer.swap and the call
# fastformer.swap(model) would fail; imported here, the function wins (no Triton import).
from fastformer.explain import explain  # noqa: E402
from fastformer.patch import SdpaPatch, patch_sdpa  # noqa: E402
from fastformer.swap import SwapReport, swap  # noqa: E402

# Heavier parts load on first use, so `import fastformer` stays light (no Triton import).
_LAZY = {
    "nn": ("fastformer.nn", None),
    "reference": ("fastformer.reference", None),
    "testing": ("fastformer.testing", None),
    "scaled_dot_product_attention": (
        "fastformer.ops.attention",
        "scaled_dot_product_attention",
    ),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'fastformer' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


__all__ = [
    "SdpaPatch",
    "SwapReport",
    "__version__",
    "build_info",
    "cuda_kernels_compiled",
    "explain",
    "extension_error",
    "nn",
    "ops",
    "patch_sdpa",
    "reference",
    "scaled_dot_product_attention",
    "swap",
]
