"""train.py on the Llama-3-8B shape, one H200: a cold and a warm start; saving and resuming the whole state.

    python bench/train_8b.py startup      # ~3 minutes
    python bench/train_8b.py checkpoint   # >= 100 GB of free disk (the device's x2 kind); ~5 minutes

startup: two runs from scratch in one fresh TRITON_CACHE_DIR, each killed once step 2 is logged (no checkpoint):
the first compiles and tunes every Triton kernel for these shapes, the second finds them in the cache.
checkpoint, run A: the 8B config's optimizer (bf16 weights, AdamW-Kahan with fp32 moments and fp16 compensation, the step in
backward) on the Llama-3-8B shape from random init, 2 steps, then the final save of the whole state (~96 GB).
Run B: resume it (the page cache dropped first, so the state comes from the disk) for one more step; its final
save would need another ~96 GB beside the first one, which the disk does not have: it must say so and save the
weights alone. For each run: wall seconds from "model:" to the first logged step (Triton compiles and tunes the
kernels on a cold cache), the save and load seconds train.py reports, and the process's peak
resident host memory (VmHWM, polled from /proc). Logs go to $OUT when set.
"""
import os
import re
import shutil
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORK = os.environ.get("BENCH_DIR", "/tmp/ckpt_bench")
LOG = os.environ.get("OUT", WORK)
ARGS = ["configs/llama3_8b.py", "--init_from=scratch", "--model_preset=llama3_8b", f"--data_dir={WORK}/data",
        f"--out_dir={WORK}/run", "--eval_interval=1000", "--eval_tokens=8192", "--checkpoint_interval=1000",
        "--warmup_steps=1"]


def run(name, *args, until=None, env=()):
    """Run train.py (killed at the first line that starts with `until`); return its output lines with the seconds
    since launch, its peak host RSS in GB and its exit code."""
    proc = subprocess.Popen([sys.executable, "train.py", *ARGS, *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1", **dict(env)))
    peak = [0]

    def poll():
        while proc.poll() is None:
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    peak[0] = max(peak[0], int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)))
            except (OSError, AttributeError):
                pass
            time.sleep(0.2)

    threading.Thread(target=poll, daemon=True).start()
    t0, lines = time.time(), []
    with open(os.path.join(LOG, f"train_8b_{name}.log"), "w") as log:
        for line in proc.stdout:
            lines.append((time.time() - t0, line.rstrip()))
            log.write(f"{lines[-1][0]:8.1f} {line}")
            print(f"[{name} {lines[-1][0]:6.1f}s] {line}", end="", flush=True)
            if until and line.startswith(until):
                proc.kill()
    proc.wait()
    return lines, peak[0] / 2**20, proc.returncode


def seconds_between(lines, first, then):
    start = next(t for t, line in lines if line.startswith(first))
    return next(t for t, line in lines if line.startswith(then) and t >= start) - start


def reported(lines, pattern):
    found = [re.search(pattern, line) for _, line in lines]
    return next((m.group(1) for m in found if m), "-")


def startup():
    env = {"TRITON_CACHE_DIR": f"{WORK}/triton_cache"}
    print("\nstart        | model line -> step 1 (s) | model line -> step 2 (s) | launch -> step 2 (s)")
    for name in ("cold", "warm"):
        shutil.rmtree(f"{WORK}/run", ignore_errors=True)
        lines, _, _ = run(name, "--max_steps=50", until="step 2/", env=env)
        launch = next(t for t, line in lines if line.startswith("step 2/"))
        print(f"{name:12s} | {seconds_between(lines, 'model:', 'step 1/'):24.1f} | "
              f"{seconds_between(lines, 'model:', 'step 2/'):24.1f} | {launch:19.1f}", flush=True)


def checkpoint():
    print(f"free disk at {WORK}: {shutil.disk_usage(WORK).free / 1e9:.1f} GB", flush=True)
    a, rss_a, rc_a = run("A", "--max_steps=2")
    subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True)
    b, rss_b, rc_b = run("B", "--init_from=resume", "--max_steps=3")
    rows = [("A: scratch, 2 steps, save", rc_a, seconds_between(a, "model:", "step 1/"),
             reported(a, r"saved the step-2 checkpoint in ([\d.]+) s"), "-", rss_a),
            ("B: resume, 1 step, save", rc_b, seconds_between(b, "model:", "step 3/"),
             reported(b, r"saved the step-3 weights in ([\d.]+) s"),
             reported(b, r"optimizer state loaded in ([\d.]+) s"), rss_b)]
    print("\nrun                          | exit | model line -> first step (s) | save (s) | load opt. (s) | peak RSS (GB)")
    for name, rc, first, save, load, rss in rows:
        print(f"{name:28s} | {rc:4d} | {first:28.1f} | {save:>8s} | {load:>13s} | {rss:.1f}")
    for _, line in a + b:
        if line.startswith(("saving", "warning", "error", "resuming")):
            print(line)


def main():
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(LOG, exist_ok=True)
    subprocess.run([sys.executable, "data/prepare.py", "--out", f"{WORK}/data", "--val_fraction", "0.2",
                    *[os.path.join(ROOT, d) for d in ("kernels", "tests", "bench", "train.py")]], cwd=ROOT, check=True)
    for part in sys.argv[1:] or ["startup", "checkpoint"]:
        {"startup": startup, "checkpoint": checkpoint}[part]()
    shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
