"""Functional ops of fastformer: input checks, backend choice and torch.library registration."""

from fastformer.ops import rng

__all__ = ["rng"]
