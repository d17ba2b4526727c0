"""The suite's own option: `--sample-cases` (tests/conftest.py), which CI's stages on other torch
and Triton versions pass to run every test on a part of its grid."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).parent


def _collect(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=TESTS.parent,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _collected(*args: str) -> list[str]:
    out = _collect(*args)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [line for line in out.stdout.splitlines() if "::" in line]


def _by_test(ids: list[str]) -> dict[str, list[str]]:
    groups = defaultdict(list)
    for nodeid in ids:
        groups[nodeid.split("[")[0]].append(nodeid)
    return groups


def test_sample_cases_keeps_every_test_on_every_nth_case():
    files = ["tests/test_ffn.py", "tests/test_attention.py::test_compile_report"]
    everything = _by_test(_collected(*files))
    sampled = _by_test(_collected("--sample-cases=3", *files))
    assert sampled.keys() == everything.keys()
    compile_report = "tests/test_attention.py::test_compile_report"
    assert len(everything[compile_report]) > 1
    for name, ids in everything.items():
        # every_case: each arch's compile check is its own check, never sampled away
        expected = ids if name == compile_report else ids[::3]
        assert sampled[name] == expected, name
    assert sum(map(len, sampled.values())) < sum(map(len, everything.values())) * 0.5


def test_sample_cases_below_one_is_an_error():
    out = _collect("--sample-cases=0", "tests/test_ffn.py")
    assert out.returncode != 0
    assert "--sample-cases must be >= 1, got 0" in out.stderr + out.stdout


def test_each_test_draws_from_a_seed_of_its_own_id(tmp_path):
    # Two tests print their first draw; run in either order, each prints the same numbers.
    (tmp_path / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    (tmp_path / "test_draws.py").write_text(
        "import torch\n"
        "def test_a(): print('A', torch.rand(2).tolist())\n"
        "def test_b(): print('B', torch.rand(2).tolist())\n"
    )

    def draws(*ids: str) -> dict[str, str]:
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-s", "-q", "-p", "no:cacheprovider", *ids],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return dict(re.findall(r"([AB]) (\[[^]]*\])", out.stdout))

    both = draws("test_draws.py::test_a", "test_draws.py::test_b")
    assert both == draws("test_draws.py::test_b", "test_draws.py::test_a")
    assert both == {**draws("test_draws.py::test_b"), **draws("test_draws.py::test_a")}
    assert len(both) == 2 and both["A"] != both["B"]
