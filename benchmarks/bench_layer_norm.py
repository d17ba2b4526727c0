"""LayerNorm (and dropout + residual add + LayerNorm): fastformer vs the eager reference,
F.layer_norm and torch.compile on the full GPU grid of fastformer.cli.cases (bf16, GB/s)."""

import pytest

from fastformer.cli.cases import MODES, layer_norm_cases
from fastformer.cli.impls import layer_norm_bench

IMPLS = ["fastformer", "reference", "torch", "torch.compile"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "case", layer_norm_cases("cuda", quick=False, full=True), ids=lambda c: c.name
)
def test_layer_norm(op_benchmark, case, impl, mode):
    op_benchmark(layer_norm_bench, case, impl, mode)
