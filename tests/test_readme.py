"""The README's Python examples run as written, given the tensors they leave to the reader; the
README's and docs' links and file names point at files that exist."""

import pathlib
import re
import types

import torch

import fastformer

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks/results/README.md"]
# A file name in backticks under one of the tree's folders, e.g. `kernels/attention.py`.
_TREE_PATH = re.compile(
    r"`((?:csrc|kernels|fastformer|tests|benchmarks|scripts|docs|\.ci)/[^`\s*<]*)`"
)
_BUILT = {"fastformer/_build_info.json"}  # written by the build, not tracked


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _names_the_api_example_leaves_to_the_reader() -> dict:
    """Small inputs for every name the example uses without defining it."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    B, H, L, D, E, F = 2, 4, 6, 8, 32, 64
    model = torch.nn.Transformer(E, 4, 1, 1, F, dropout=0.1, batch_first=True)
    return dict(
        q=randn(B, H, L, D), k=randn(B, H, L, D), v=randn(B, H, L, D),
        pad=torch.tensor([[False] * L, [False] * (L - 2) + [True] * 2]),
        x=randn(B, L, E), residual=randn(B, L, E), weight=randn(E), bias=randn(E),
        w1=randn(F, E), b1=randn(F), w2=randn(E, F), b2=randn(E),
        model=model, src=randn(B, L, E), tgt=randn(B, L - 1, E),
        hf_model=_CallsSdpa(), batch=dict(q=randn(B, H, L, D), k=randn(B, H, L, D)),
    )  # fmt: skip


class _CallsSdpa(torch.nn.Module):
    """Stands for a model that calls F.scaled_dot_product_attention itself."""

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> types.SimpleNamespace:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True)
        return types.SimpleNamespace(loss=out.square().mean())


def test_readme_has_the_examples_this_file_runs():
    blocks = _python_blocks()
    assert len(blocks) == 2, "README's python blocks changed: update tests/test_readme.py"
    assert "fastformer.swap(model)" in blocks[0] and "torchrun" in blocks[1]


def test_api_example_runs(monkeypatch, capsys):
    monkeypatch.setenv("FASTFORMER_BACKEND_ATTENTION", "torch")  # the interpreter is slow
    names = _names_the_api_example_leaves_to_the_reader()
    model = names["model"]
    exec(_python_blocks()[0], names)  # noqa: S102 - the README's own example
    assert isinstance(model.encoder.layers[0], fastformer.nn.TransformerEncoderLayer)
    assert names["out"].shape == names["q"].shape and names["h"].shape == names["x"].shape
    assert names["y"].shape == names["x"].shape
    assert names["loss"].dim() == 0 and torch.isfinite(names["loss"])
    printed = capsys.readouterr().out
    assert str(names["report"]) in printed and "attention" in printed


def test_multi_gpu_example_compiles_and_its_imports_exist():
    # It needs torchrun and GPUs to run; its syntax and what it imports from torch can be checked.
    block = _python_blocks()[1]
    compile(block, "README.md", "exec")
    from torch.distributed.fsdp import fully_shard  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_docs_links_reach_existing_files_and_headings():
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if "://" in target:
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.is_file():
                broken.append(f"{doc.name}: {target} (no such file)")
            elif anchor:
                prose = re.sub(r"```.*?```", "", file.read_text(), flags=re.S)  # not code comments
                headings = re.findall(r"^#+ (.*)$", prose, flags=re.M)
                if anchor not in {_anchor(h) for h in headings}:
                    broken.append(f"{doc.name}: {target} (no such heading)")
    assert not broken, broken


def test_docs_name_files_that_exist():
    named = {m for doc in DOCS for m in _TREE_PATH.findall(doc.read_text())}
    assert len(named) > 20, "the pattern no longer finds the docs' file names"
    files = {p.split("::")[0].rstrip("/") for p in named}  # a pytest node id names its file
    missing = sorted(p for p in files if p not in _BUILT and not (ROOT / p).exists())
    assert not missing, missing
