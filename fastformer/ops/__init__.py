"""Functional ops of fastformer: input checks, backend choice and torch.library registration.

`attention`, `layer_norm` and `ffn` register their backends on import (see `_dispatch`);
`rng` is the shared dropout RNG.
"""

import warnings

from fastformer.ops import _dispatch, attention, ffn, layer_norm, rng

# Every op has registered its backends by now: a variable that names none is ignored, say so.
for _message in _dispatch.unknown_backend_variables():
    warnings.warn(_message, stacklevel=2)

__all__ = ["attention", "ffn", "layer_norm", "rng"]
