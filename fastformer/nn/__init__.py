"""Drop-in torch.nn modules on fastformer's fused ops.

Each class takes the same constructor arguments and forward arguments as its torch.nn
counterpart (most subclass it) and has the same parameter names, shapes and initialisation,
so `load_state_dict(..., strict=True)` works in both directions. What the fused ops cannot do
falls back to torch.nn's computation with the reason recorded (`module.fallback_reasons`,
`fastformer.explain(model, *inputs)`), never to a different result.
"""

from fastformer.nn.attention import MultiheadAttention
from fastformer.nn.ffn import FeedForward
from fastformer.nn.layer_norm import LayerNorm, RMSNorm
from fastformer.nn.transformer import (
    PositionalEncoding,
    Transformer,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)

__all__ = [
    "FeedForward",
    "LayerNorm",
    "MultiheadAttention",
    "PositionalEncoding",
    "RMSNorm",
    "Transformer",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
]
