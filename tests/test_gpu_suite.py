"""The logic of benchmarks/run_gpu_suite.sh, with a stub Python that records its commands.

A lent GPU session has one try at this script, so its stages, the parallel split of the tests
and of the parity grid, the benchmark stages (the default `bench`; the full grid only with
SUITE_FULL=1; the warp-specialized attention bench, the FFN's DRELU epilogue bench, the LayerNorm
sweep and the profile only when time is left, or alone with SUITE_EXTRAS_ONLY=1; nothing a stage
started left running; a stage past its box interrupted with SIGINT first), the exit status and the
in-place build fallback are checked here.
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "run_gpu_suite.sh"

# Logs each call; pip fails when STUB_PIP_RC=1; the prebuilt check fails unless
# STUB_PREBUILT_RC=0; check shard 3 fails; check shards take 1 s; pytest and bench leave a
# process running (its pid in $STUB_LOG.left), as a cut pytest leaves its xdist workers; a
# call with FASTFORMER_ATTN_WS or FASTFORMER_FFN_DRELU set is logged with "[WS=value]" or
# "[DRELU=value]" after its arguments.
STUB = """#!/usr/bin/env bash
echo "OMP_NUM_THREADS=${OMP_NUM_THREADS:-} PYTHONPATH=${PYTHONPATH:-} $*${FASTFORMER_ATTN_WS:+ [WS=$FASTFORMER_ATTN_WS]}${FASTFORMER_FFN_DRELU:+ [DRELU=$FASTFORMER_FFN_DRELU]}" >> "$STUB_LOG"
case "$*" in
  "-m pytest"*|"-m fastformer bench"*) sleep 300 & echo $! >> "$STUB_LOG.left" ;;
  "-m fastformer info") if [ -n "${STUB_HANG_INFO:-}" ]; then
      trap 'echo INT >> "$STUB_LOG.signal"; exit 130' INT
      trap 'echo TERM >> "$STUB_LOG.signal"; exit 143' TERM
      sleep 60 & wait
    fi ;;
esac
case "$*" in
  "-m pip install"*) exit "${STUB_PIP_RC:-0}" ;;
  "-c import torch, fastformer._ext"*) exit "${STUB_PREBUILT_RC:-1}" ;;
  *"--shard 3/"*) sleep 1; exit 1 ;;
  *"fastformer check"*) sleep 1 ;;
esac
exit 0
"""


def _run_suite(
    tmp_path: Path,
    pip_rc: int,
    prebuilt_rc: int | None = None,
    carried: bool = False,
    **extra_env: str,
) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run the suite with the stub; prebuilt_rc: None = no build in place, else the exit
    status of the check of the build in place (carried: that build waits in .gpu-prebuilt/
    instead of fastformer/); extra_env: more environment variables."""
    root = tmp_path / "repo"
    (root / "benchmarks").mkdir(parents=True)
    (root / "fastformer").mkdir()
    (root / "kernels").mkdir()
    if prebuilt_rc is not None:
        where = root / (".gpu-prebuilt" if carried else "fastformer")
        where.mkdir(exist_ok=True)
        (where / "_build_info.json").write_text("{}")
        (where / "_C.cpython-312-x86_64-linux-gnu.so").write_text("")
    shutil.copy(SCRIPT, root / "benchmarks")
    stub = tmp_path / "python"
    stub.write_text(STUB)
    stub.chmod(0o755)
    log = tmp_path / "calls.log"
    env = {**os.environ, "PYTHON": str(stub), "STUB_LOG": str(log), "STUB_PIP_RC": str(pip_rc)}
    env["STUB_PREBUILT_RC"] = str(prebuilt_rc)
    env.update(CHECK_SHARDS="4", PYTHONPATH="")
    for name in ("SUITE_FULL", "SUITE_PROFILE_BEFORE_S"):
        env.pop(name, None)
    env.update(extra_env)
    done = subprocess.run(
        ["bash", str(root / "benchmarks" / "run_gpu_suite.sh"), str(tmp_path / "out")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done, log.read_text().splitlines()


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_suite_runs_every_stage_and_counts_failures(tmp_path):
    done, calls = _run_suite(tmp_path, pip_rc=0)
    assert done.returncode == 1, done.stdout + done.stderr  # check shard 3 of 4 failed
    commands = [c.split(" ", 2)[2] for c in calls]
    assert commands[0].startswith("-c import torch, triton")  # the versions, for machine.log
    commands = commands[1:]
    assert commands[0].startswith("-m pip install --no-build-isolation --no-deps --no-index")
    pytest = "-m pytest -m cuda or gpu_too -v -p no:cacheprovider -ra --timeout 80"
    pytest += " --timeout-method thread"
    assert f"{pytest} --durations 20 -n 4 tests/test_attention.py" in commands
    assert any("-n 4 tests --ignore=tests/test_attention.py" in c for c in commands)
    checks = sorted(c for c in commands if "fastformer check" in c)
    check = "-m fastformer check --device cuda --max-seconds 105 --ops"
    shards = [f"{check} attention --shard {k}/4" for k in (1, 2, 3, 4)]
    assert checks == sorted([f"{check} layer_norm,ffn", *shards])
    # One OpenMP thread pair a process: 16 processes share 16 cores.
    threads = [c.split()[0] for c in calls if "-m pytest" in c or "fastformer check" in c]
    assert threads and all(t == "OMP_NUM_THREADS=2" for t in threads), calls
    # The benchmark last and alone: the default run exactly as a user starts it (no full grid
    # without SUITE_FULL=1), then the DRELU bench (FASTFORMER_FFN_DRELU=epilogue), the ws bench
    # (FASTFORMER_ATTN_WS=1), the LayerNorm sweep and the profile (the stub suite is
    # well under 400 s).
    out = tmp_path / "out"
    after = _after_bench(out)
    assert commands[-len(after) - 1 :] == [
        f"-m fastformer bench --max-seconds 170 --out {out}/bench",
        *after,
    ]
    assert [c for c in commands if "fastformer bench" in c] == commands[-5:-2]
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "skipped" not in summary
    assert "verify-check3" in summary and "rc=1" in summary
    # The four 1-second shards ran at once, not one after another.
    verify = [line for line in summary.splitlines() if line.startswith("verify-")]
    assert max(int(line.split()[-1].rstrip("s")) for line in verify) < 4
    # Nothing a stage started runs on after it: not beside the next stage, not after the suite.
    left = [int(pid) for pid in (tmp_path / "calls.log.left").read_text().split()]
    assert len(left) == 5 and not any(_running(pid) for pid in left)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has ended (its parent, the stub, is gone)


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_suite_falls_back_to_an_in_place_build(tmp_path):
    done, calls = _run_suite(tmp_path, pip_rc=1)
    assert done.returncode == 1, done.stdout + done.stderr  # only the failing shard counts
    root = tmp_path / "repo"
    assert any("setup.py build_ext --inplace" in c for c in calls)
    assert (root / "fastformer" / "kernels").resolve() == (root / "kernels").resolve()
    later = [c for c in calls if "fastformer check" in c or "fastformer bench" in c]
    assert later and all(c.split(" ")[1] == f"PYTHONPATH={root}" for c in later)


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
@pytest.mark.parametrize("prebuilt_rc", [0, 1])
def test_suite_uses_a_matching_build_in_place_and_rebuilds_a_stale_one(tmp_path, prebuilt_rc):
    done, calls = _run_suite(tmp_path, pip_rc=0, prebuilt_rc=prebuilt_rc)
    assert done.returncode == 1, done.stdout + done.stderr  # only the failing shard counts
    root = tmp_path / "repo"
    built = any("-m pip install" in c for c in calls)
    assert built == bool(prebuilt_rc)
    later = [c for c in calls if "fastformer check" in c or "fastformer bench" in c]
    in_place = [c.split(" ")[1] == f"PYTHONPATH={root}" for c in later]
    assert later and all(in_place) if prebuilt_rc == 0 else not any(in_place)


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_suite_copies_a_carried_build_in_before_the_check(tmp_path):
    done, calls = _run_suite(tmp_path, pip_rc=0, prebuilt_rc=0, carried=True)
    assert done.returncode == 1, done.stdout + done.stderr  # only the failing shard counts
    fastformer = tmp_path / "repo" / "fastformer"
    assert (fastformer / "_build_info.json").exists()
    assert (fastformer / "_C.cpython-312-x86_64-linux-gnu.so").exists()
    assert not any("-m pip install" in c for c in calls)


def _after_bench(out) -> list[str]:  # the stages after the default bench
    return [
        f"-m fastformer bench --no-model --ops ffn --max-seconds 30 --out {out}/bench-drelu "
        "[DRELU=epilogue]",
        "-m fastformer bench --no-model --ops attention --cases s8192d64,h16s2048d128 "
        f"--max-seconds 45 --out {out}/bench-ws [WS=1]",
        f"benchmarks/sweep_layer_norm.py --out {out}/sweep_layer_norm.json",
        "benchmarks/profile_kernels.py --iters 3",
    ]


# The optional stages of each flag, between the default bench and the LayerNorm sweep:
# (commands with {out} for the output folder, their stage names).
_OPTIONAL_STAGES = {
    "SUITE_FULL": (
        [
            "-m fastformer bench --no-model --full --ops attention --max-seconds 100 "
            "--out {out}/bench-full-attention",
            "-m fastformer bench --no-model --full --ops layer_norm,ffn --max-seconds 60 "
            "--out {out}/bench-full-ops",
            "-m fastformer bench --full --ops  --max-seconds 170 --out {out}/bench-full-model",
        ],
        ["bench_full_attention", "bench_full_ops", "bench_full_model"],
    ),
}


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
@pytest.mark.parametrize("flag", sorted(_OPTIONAL_STAGES))
def test_suite_optional_stages_run_after_the_default_bench(tmp_path, flag):
    """SUITE_FULL=1: the full grid and model variants."""
    done, calls = _run_suite(tmp_path, pip_rc=0, **{flag: "1"})
    assert done.returncode == 1, done.stdout + done.stderr  # only the failing shard counts
    commands = [c.split(" ", 2)[2] for c in calls]
    out = tmp_path / "out"
    extra, stages = _OPTIONAL_STAGES[flag]
    assert commands[-len(extra) - len(_after_bench(out)) - 1 :] == [
        f"-m fastformer bench --max-seconds 170 --out {out}/bench",
        *(command.format(out=out) for command in extra),
        *_after_bench(out),
    ]
    summary = (out / "summary.txt").read_text()
    for name in stages:
        assert f"{name} rc=0" in summary


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_suite_skips_the_profile_past_its_time(tmp_path):
    """Past SUITE_PROFILE_BEFORE_S (400 s unless set; 0 here: always past) the DRELU bench,
    the ws bench, the LayerNorm sweep and the profile are skipped, said so in summary.txt, and
    not counted as failures."""
    done, calls = _run_suite(tmp_path, pip_rc=0, SUITE_PROFILE_BEFORE_S="0")
    assert done.returncode == 1, done.stdout + done.stderr  # only the failing shard counts
    commands = [c.split(" ", 2)[2] for c in calls]
    assert commands[-1] == f"-m fastformer bench --max-seconds 170 --out {tmp_path}/out/bench"
    assert not any("profile_kernels" in c or "sweep_layer_norm" in c for c in commands)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    skipped = [line for line in summary.splitlines() if "skipped" in line]
    assert len(skipped) == 4
    for stage, line in zip(("bench_drelu", "bench_ws", "sweep_layer_norm", "profile"), skipped):
        assert re.fullmatch(stage + r": skipped \(elapsed \d+s\)", line)
    assert "suite: 1 failed stage(s)" in summary


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_suite_extras_only_runs_the_time_left_stages_whatever_the_time(tmp_path):
    """SUITE_EXTRAS_ONLY=1 (a second call after a suite run): the build check and info, then
    the stages that otherwise need time left, even past SUITE_PROFILE_BEFORE_S's default; no
    tests, parity grid or default bench. An explicit SUITE_PROFILE_BEFORE_S still applies."""
    done, calls = _run_suite(tmp_path, pip_rc=0, prebuilt_rc=0, SUITE_EXTRAS_ONLY="1")
    assert done.returncode == 0, done.stdout + done.stderr  # no check shard ran to fail
    commands = [c.split(" ", 2)[2] for c in calls]
    assert not any("-m pytest" in c or "fastformer check" in c for c in commands)
    out = tmp_path / "out"
    assert commands[-len(_after_bench(out)) - 2 :] == [
        "-m fastformer info",
        "-m fastformer info --json",
        *_after_bench(out),
    ]
    again = tmp_path / "again"
    again.mkdir()
    done, calls = _run_suite(
        again, pip_rc=0, prebuilt_rc=0, SUITE_EXTRAS_ONLY="1", SUITE_PROFILE_BEFORE_S="0"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    commands = [c.split(" ", 2)[2] for c in calls]
    assert commands[-2:] == ["-m fastformer info", "-m fastformer info --json"]


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_a_stage_past_its_box_is_interrupted_first(tmp_path):
    """The box ends a stage with SIGINT (KeyboardInterrupt: pytest prints its failures so far,
    bench writes its results), SIGKILL only 15 s later; the stage counts as failed (124)."""
    done, _ = _run_suite(tmp_path, pip_rc=0, STUB_HANG_INFO="1")
    assert done.returncode == 2, done.stdout + done.stderr  # info and check shard 3 failed
    assert (tmp_path / "calls.log.signal").read_text() == "INT\n"
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert re.search(r"^info +rc=124 +1[5-9]s$", summary, re.M), summary
