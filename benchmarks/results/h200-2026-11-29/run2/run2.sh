#!/usr/bin/env bash
# GPU run 2 (2026-11-29): the `cuda` tests with per-test timeouts and durations (run 1 cut
# them), then a kernel-level profile. Logs under /tmp/r2, tarred to $OUT.
set -u
cd "$(dirname "$0")/.."
cp .gpu-prebuilt/_C*.so .gpu-prebuilt/_build_info.json fastformer/
ln -sfn ../kernels fastformer/kernels
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
O=/tmp/r2; mkdir -p $O
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a $O/summary.txt; }
(sleep 118; tar czf "$OUT/r2.tgz" -C /tmp r2) &  # the logs come back even if a stage overruns
python3 -c 'import torch, fastformer._ext as e; i = e.build_info(); assert i["torch"] == torch.__version__ and e.extension_error() is None' > $O/prebuilt.log 2>&1 || { el "prebuilt unusable"; cat $O/prebuilt.log; exit 1; }
PT="python3 -m pytest -m cuda -q -p no:cacheprovider -ra --timeout 60"
timeout -k 3 75 $PT -n 10 --durations 40 tests --ignore=tests/test_attention.py > $O/tests_other.log 2>&1 & p1=$!
timeout -k 3 75 $PT -n 3 --durations 10 tests/test_attention.py > $O/tests_attention.log 2>&1 & p2=$!
wait $p1; el "tests_other rc=$?"; wait $p2; el "tests_attention rc=$?"
timeout -k 3 38 python3 benchmarks/profile_kernels.py --iters 3 > $O/profile.log 2>&1; el "profile rc=$?"
tar czf "$OUT/r2.tgz" -C /tmp r2
cd $O
grep -h -E "^(FAILED|ERROR)|Timeout|passed|failed" tests_*.log | cut -c1-240 | head -30
grep -h -A40 "slowest" tests_other.log | head -42
cat profile.log | head -100
cat summary.txt
