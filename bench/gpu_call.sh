#!/usr/bin/env bash
# One device call on a 2-GPU machine: the test suite and the kernel benchmarks on GPU 1 while the end-to-end
# benchmark runs alone on GPU 0. Logs under $OUT. Usage: bash bench/gpu_call.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
out=${OUT:-/tmp}
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 330 python3 -m pytest -q -x -p no:cacheprovider > "$out/pytest.log" 2>&1; echo "pytest rc $?" >> "$out/pytest.log"
  timeout 100 python3 bench/adamw.py > "$out/bench_adamw.log" 2>&1
  timeout 140 python3 bench/cross_entropy.py > "$out/bench_ce.log" 2>&1
) &
CUDA_VISIBLE_DEVICES=0 timeout 560 python3 bench/e2e.py "$@" > "$out/e2e.log" 2>&1
wait
tail -5 "$out/pytest.log"; cat "$out/bench_adamw.log" "$out/bench_ce.log" | grep -v Warning | tail -60; cat "$out/e2e.log" | tail -40
