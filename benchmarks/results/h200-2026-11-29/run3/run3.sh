#!/usr/bin/env bash
# GPU run 3 (2026-11-29): the non-attention `cuda` tests, verbose (live per-test results), one
# CPU thread per worker, stacks dumped on a per-test timeout; then the attention benchmark cases
# with key padding / dropout that run 1 did not reach. Logs under /tmp/r3, tarred to $OUT.
set -u
cd "$(dirname "$0")/.."
cp .gpu-prebuilt/_C*.so .gpu-prebuilt/_build_info.json fastformer/
ln -sfn ../kernels fastformer/kernels
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 MKL_NUM_THREADS=2
O=/tmp/r3; mkdir -p $O
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a $O/summary.txt; }
(sleep 192; tar czf "$OUT/r3.tgz" -C /tmp r3) &  # the logs come back even if a stage overruns
timeout -k 3 115 python3 -m pytest -m cuda -v -p no:cacheprovider -ra -n 8 --timeout 80 \
  --timeout-method thread --durations 40 tests --ignore=tests/test_attention.py > $O/tests_other.log 2>&1
el "tests_other rc=$?"
timeout -k 3 45 python3 -m fastformer bench --no-model --ops attention --cases pad25,drop0.1 \
  --max-seconds 33 --out $O/bench-attention > $O/bench_attention.log 2>&1
el "bench_attention rc=$?"
timeout -k 3 30 python3 -m fastformer bench --no-model --ops layer_norm,ffn --cases n16384,512x2048 \
  --max-seconds 18 --out $O/bench-ops > $O/bench_ops.log 2>&1
el "bench_ops rc=$?"
tar czf "$OUT/r3.tgz" -C /tmp r3
cd $O
grep -E "PASSED|FAILED|ERROR|SKIPPED" tests_other.log | sed 's/^\[gw[0-9]*\] *//' | awk '{print $1, $NF}' | sort | uniq -c | sort -rn | head -5
grep -E "FAILED|ERROR|Timeout" tests_other.log | cut -c1-200 | head -20
grep -h -A42 "slowest" tests_other.log | head -44
tail -n 16 bench_attention.log; tail -n 14 bench_ops.log
cat summary.txt
