#!/usr/bin/env bash
# Second device call (2 GPUs): the 1B single-GPU / DDP / FSDP2 scaling rows, then train.py itself with the 8B
# config's settings on GPU 0 while the optimizer and train tests run on GPU 1. Logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
python3 bench/fsdp_8b.py 1B > "$out/fsdp.log" 2>&1
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_optim.py tests/test_train.py > "$out/pytest_train.log" 2>&1
  echo "pytest rc $?" >> "$out/pytest_train.log"
) &
[ -f data/cache/stdlib/meta.json ] || python3 data/prepare.py --stdlib --out data/cache/stdlib > /dev/null
CUDA_VISIBLE_DEVICES=0 timeout -s KILL 150 python3 train.py configs/llama3_8b.py --init_from=scratch --model_preset=llama3_8b \
  --data_dir=data/cache/stdlib --out_dir=/tmp/t8b --max_steps=1000 --warmup_steps=5 --eval_interval=100000 \
  --eval_tokens=8192 --checkpoint_interval=100000 > "$out/train8b.log" 2>&1
echo "train.py rc $?" >> "$out/train8b.log"
wait
grep -v -i warn "$out/fsdp.log" | tail -12; tail -4 "$out/pytest_train.log"; tail -30 "$out/train8b.log"
