"""Functional ops of fastformer: input checks, backend choice and torch.library registration.

`attention`, `layer_norm` and `ffn` register their backends on import (see `_dispatch`);
`rng` is the shared dropout RNG.
"""

from fastformer.ops import attention, ffn, layer_norm, rng

__all__ = ["attention", "ffn", "layer_norm", "rng"]
