"""FFN: fastformer vs the eager reference, torch's own ops, torch.compile and the two bare
GEMMs on the full GPU grid of fastformer.cli.cases (bf16)."""

import pytest

from fastformer.cli.cases import MODES, ffn_cases
from fastformer.cli.impls import ffn_bench

IMPLS = ["fastformer", "reference", "torch", "torch.compile", "gemm-only"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", ffn_cases("cuda", quick=False, full=True), ids=lambda c: c.name)
def test_ffn(op_benchmark, case, impl, mode):
    op_benchmark(ffn_bench, case, impl, mode)
