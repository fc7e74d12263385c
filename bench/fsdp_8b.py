"""Training throughput and memory per GPU of train.py under FSDP2 on 2 GPUs, Llama-3-8B shape, from scratch.

    python bench/fsdp_8b.py          # on a machine with 2 GPUs (H200); about 6 minutes; logs under $OUT when set
    python bench/fsdp_8b.py 1B       # only the runs whose name contains "1B" (about 3 minutes)

Runs train.py through torchrun on the stdlib corpus (prepared first if missing), 8192 tokens per micro-step per
GPU, one micro-step per step, and reads its metrics.jsonl: tok/s per GPU and MFU are medians over steps 6-15 (the
first steps autotune and compile the Triton kernels); peak memory is rank 0's torch.cuda.max_memory_allocated
(FSDP gives every rank the same share). Each run is killed once step 15 is logged, so no 100-GB checkpoint is
written.

Llama-3-8B does not fit on ONE 141-GB GPU for full training: fp32 weights, gradients and two AdamW moments are
8.0e9 x 16 B = 128 GB before any activation. So the 1-GPU vs 2-GPU comparison runs at the Llama-3.2-1B shape:
one process, then DDP and FSDP2 on 2 GPUs (same tokens per GPU: twice the global batch).
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "data", "cache", "stdlib")
STEPS = 15
BUDGET_S = 330  # a run that could end past this is skipped: the whole script stays under 6 minutes
COMMON = ["--data_dir=" + DATA, "--tokens_per_micro_step=8192", "--grad_accum=1", "--max_seq_len=4096",
          "--max_steps=1000", "--warmup_steps=5", "--learning_rate=3e-4", "--min_lr=3e-5", "--log_interval=1",
          "--eval_interval=100000", "--eval_tokens=8192", "--checkpoint_interval=100000"]
RUNS = [  # name, model preset, GPUs, parallel, time limit (s)
    ("8B   FSDP2 x2", "llama3_8b", 2, "fsdp", 150),
    ("1B   1 GPU", "llama3_2_1b", 1, "none", 60),
    ("1B   FSDP2 x2", "llama3_2_1b", 2, "fsdp", 60),
    ("1B   DDP x2", "llama3_2_1b", 2, "ddp", 60),
]


def median(values):
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")


def process_tree(pid):
    """pid and every process below it, from /proc: torchrun may start its ranks outside its own process group,
    so killing the group alone can leave ranks running (seen on the H200 x2: the DDP run after three others found
    the 8B run's ranks still holding 105 GB of each GPU)."""
    tree, todo = [pid], [pid]
    while todo:
        parent = todo.pop()
        try:
            for task in os.listdir(f"/proc/{parent}/task"):
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    kids = [int(c) for c in f.read().split()]
                tree += kids
                todo += kids
        except OSError:  # already gone
            pass
    return tree


def kill_tree(pid, limit_s=60):
    """SIGKILL pid and all its descendants, then wait until the descendants are gone (their GPU memory with them;
    pid itself is the caller's child: it stays a zombie until the caller reaps it with wait())."""
    pids = process_tree(pid)
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.time() + limit_s
    while time.time() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids[1:]):
        time.sleep(0.5)


def run(name, preset, n_gpus, parallel, limit_s, log_dir):
    """Train until step STEPS is logged (or the limit); return (tok/s per GPU, MFU, peak GB) or an error line."""
    out_dir = tempfile.mkdtemp(prefix="bench_fsdp_")
    args = COMMON + [f"--model_preset={preset}", f"--out_dir={out_dir}"]
    if parallel == "none":
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n_gpus}",
               os.path.join(ROOT, "train.py"), *args, f"--parallel={parallel}"]
    log_path = os.path.join(log_dir, "fsdp_bench_" + "_".join(name.split()).replace("x2", "2gpu") + ".log")
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")  # less fragmentation
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline, records = time.time() + limit_s, []
        while time.time() < deadline and proc.poll() is None:
            time.sleep(1)
            try:
                with open(os.path.join(out_dir, "metrics.jsonl")) as f:
                    records = [r for r in map(json.loads, f.read().splitlines()) if "tok_s" in r]
            except (OSError, ValueError):
                continue
            if records and records[-1]["step"] >= STEPS:
                break
        kill_tree(proc.pid)  # every rank at once, finished or not; nothing to save
        proc.wait()
    subprocess.run(["rm", "-rf", out_dir])
    steady = [r for r in records if 6 <= r["step"] <= STEPS]
    if not steady:
        with open(log_path) as f:  # the ranks' own error lines, not torchrun's report around them
            errors = [line.rstrip() for line in f if "error" in line.lower() and "elastic" not in line][:8]
        return f"no steady steps ({len(records)} logged, exit {proc.returncode}); log {log_path}:\n" + "\n".join(errors)
    return (median([r["tok_s"] / n_gpus for r in steady]), median([r.get("mfu", float("nan")) for r in steady]),
            max(r.get("peak_mem_gb", float("nan")) for r in steady), len(steady))


def main():
    import torch
    n_visible = torch.cuda.device_count()
    if n_visible < 2:
        sys.exit(f"error: this benchmark needs 2 GPUs, found {n_visible}")
    log_dir = os.environ.get("OUT", tempfile.gettempdir())
    if not os.path.isfile(os.path.join(DATA, "meta.json")):
        print("preparing the stdlib corpus ...", flush=True)
        subprocess.run([sys.executable, os.path.join(ROOT, "data", "prepare.py"), "--stdlib", "--out", DATA],
                       cwd=ROOT, check=True)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)} x {n_visible}; "
          f"8192 tokens per GPU per step, steps 6-{STEPS} (medians); logs in {log_dir}", flush=True)
    t0, rows, errors = time.time(), [], []
    only = sys.argv[1:]  # name filters, e.g. "1B"
    for name, preset, n_gpus, parallel, limit_s in RUNS:
        if only and not any(word in name for word in only):
            continue
        if time.time() - t0 + limit_s > BUDGET_S:
            errors.append(f"{name}: skipped (time budget)")
            continue
        t = time.time()
        result = run(name, preset, n_gpus, parallel, limit_s, log_dir)
        if isinstance(result, str):
            errors.append(f"{name}: {result}")
        else:
            rows.append((name, *result, time.time() - t))
        print(f"  {name}: done in {time.time() - t:.0f} s", flush=True)
    print(f"\n{'run':<15} {'tok/s/GPU':>10} {'MFU':>6} {'peak GB/GPU':>12} {'steps':>6} {'wall s':>7}")
    for name, tok_s, mfu, peak, n, wall in rows:
        print(f"{name:<15} {tok_s:>10,.0f} {100 * mfu:>5.1f}% {peak:>12.1f} {n:>6} {wall:>7.0f}")
    for line in errors:
        print(line)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
