"""Attention: fastformer vs the eager reference, torch.compile, each SDPA backend and
FlexAttention on the full GPU grid of fastformer.cli.cases (bf16)."""

import pytest

from fastformer.cli.cases import MODES, attention_cases
from fastformer.cli.impls import SDPA_BACKENDS, attention_bench

IMPLS = ["fastformer", "reference", "torch.compile", "flex"] + [f"sdpa-{b}" for b in SDPA_BACKENDS]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "case", attention_cases("cuda", quick=False, full=True), ids=lambda c: c.name
)
def test_attention(op_benchmark, case, impl, mode):
    op_benchmark(attention_bench, case, impl, mode)
