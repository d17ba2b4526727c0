"""Triton kernels of fastformer (installed as fastformer.kernels).

Kernels take tensors and return tensors: no autograd, no validation, no policy; the ops in
fastformer.ops check inputs before calling them.
"""
