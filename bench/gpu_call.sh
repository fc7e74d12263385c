#!/usr/bin/env bash
# One device call on a 2-GPU machine: the tests on GPU 1 (the `gpu` ones first, then the rest while time lasts)
# while the end-to-end benchmark runs alone on GPU 0. Logs under $OUT. Usage: bash bench/gpu_call.sh [e2e args]
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
out=${OUT:-/tmp}
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 250 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=12 > "$out/pytest_gpu.log" 2>&1
  echo "pytest -m gpu rc $?" >> "$out/pytest_gpu.log"
  timeout 300 python3 -m pytest -q -m "not gpu" -p no:cacheprovider --durations=12 > "$out/pytest_rest.log" 2>&1
  echo "pytest -m 'not gpu' rc $?" >> "$out/pytest_rest.log"
) &
CUDA_VISIBLE_DEVICES=0 timeout 560 python3 bench/e2e.py "$@" > "$out/e2e.log" 2>&1
wait
tail -25 "$out/pytest_gpu.log"; tail -8 "$out/pytest_rest.log"; grep -v -i "warn\|backend impl" "$out/e2e.log" | tail -22
