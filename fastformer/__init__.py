"""fastformer: fused Triton attention and C++/CUDA LayerNorm/FFN kernels for the Transformer.

Drop-in for torch.nn: `fastformer.nn` modules take the same arguments and state_dict keys as
their torch.nn counterparts, and `fastformer.swap(model)` replaces them in an existing model.
"""

from fastformer import ops
from fastformer._ext import build_info, cuda_kernels_compiled, extension_error, load_extension

__version__ = "0.1.0"

# Load fastformer._C now so its ops are registered and a torch mismatch warns at import.
load_extension()

__all__ = ["__version__", "build_info", "cuda_kernels_compiled", "extension_error", "ops"]
