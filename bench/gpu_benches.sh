#!/usr/bin/env bash
# One device call: install the optional Liger-Kernel wheel (carried in .whl/), then run every kernel benchmark.
# Usage on the device: bash bench/gpu_benches.sh   (logs under $OUT when set)
set -uo pipefail
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
log=${OUT:-/tmp}
for b in kernels cross_entropy attention; do
  echo "===== bench/$b.py ($(date -u +%FT%TZ))"
  timeout 200 python3 bench/$b.py 2>&1 | tee "$log/bench_$b.log"
done
