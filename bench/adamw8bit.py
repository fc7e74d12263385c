"""AdamW with 8-bit moments on one H200, everything in one call (~6 minutes):

    python bench/adamw8bit.py [kernel] [memory] [fidelity [adamw8bit]]  # all three by default; logs, SVG in $OUT

kernel: one step over bench/adamw.py's 760M parameters (4 x 4096x14336 + the 128256x4096 embedding; bf16 weights
  and gradients, Kahan comp): our 8-bit kernel (kernels/adamw8bit.py), our fp32-moment kernel (kernels/adamw.py),
  and the 8-bit reference in torch ops (kernels/reference.py). Bytes per parameter, each tensor read and written
  once: 8-bit: g, w, comp 2 each + two codes 1 each in, w, comp, codes out = 14 (+16 per block of 64 for the
  scales, 14.25); fp32 moments: 26. "%copy" against the device-to-device copy bandwidth of the same run.
memory: train.py with configs/llama3_8b_80gb.py's settings (bf16 weights, 8-bit moments, Kahan comp, the step in
  backward, 8K tokens, checkpoint_layers 8) on the Llama-3-8B shape from random init, under an 80 GB cap
  (torch.cuda.set_per_process_memory_fraction in a wrapper that then runs train.py), killed once step 10 is logged,
  before any checkpoint: peak allocated memory (train.py's "peak") and tok/s of steps 4-10.
fidelity: the Llama-3.2-1B shape from the same random init on the same data (the stdlib corpus, byte tokens),
  bf16 weights, 500 steps of 8192 tokens (lr 3e-4, warmup 50, cosine to 3e-5, clipping at 1.0), with fp32 moments
  (adamw_kahan) and with 8-bit moments (adamw8bit), and each again with the peak lr 1.001 times larger: that twin
  shows how far two runs drift apart from a harmless change, the scale on which to read the 8-bit run's distance.
  The four runs share the GPU at once. The final train loss (mean of the last 50 steps) and val loss of each, the
  differences, and the curves in $OUT/adamw8bit_fidelity.svg. `fidelity adamw8bit` runs the 8-bit pair only (the
  fp32 runs are deterministic: a rerun gives the same curve to the last digit).
"""
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
import time
from xml.sax.saxutils import escape

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
WORK = os.environ.get("BENCH_DIR", "/tmp/adamw8bit_bench")
OUT = os.environ.get("OUT", WORK)
CAP_BYTES = 80e9  # the "80 GB" card; an H100 80GB actually offers ~85e9 bytes, so this cap is on the safe side
FIDELITY_STEPS, FIDELITY_TOKENS = 500, 8192
FIDELITY_MODEL = ["--model_preset=llama3_2_1b", "--max_seq_len=2048"]
# Runs train.py in this process after capping the CUDA caching allocator (read at the first CUDA call).
CAP_WRAPPER = """import sys, runpy, torch
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(min(1.0, {cap} / total))
print(f"memory cap: {{{cap} / 1e9:.1f}} GB of {{total / 1e9:.1f}} GB", flush=True)
sys.argv = ["train.py"] + sys.argv[1:]
runpy.run_path("train.py", run_name="__main__")
"""


def kernel():
    import torch

    from bench.adamw import N_PARAMS, SHAPES
    from bench.common import copy_bandwidth_gbs, median_ms, peak_memory_gb
    from kernels import reference
    from kernels.adamw import adamw_step
    from kernels.adamw8bit import QBLOCK, adamw8bit_step
    hyper = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=10)

    def make(step_op, eight_bit):
        ws = [(0.02 * torch.randn(s, device="cuda")).bfloat16() for s in SHAPES]
        gs = [(1e-3 * torch.randn(s, device="cuda")).bfloat16() for s in SHAPES]
        cs = [torch.randn_like(w, dtype=torch.float16) * 1e-6 for w in ws]
        if eight_bit:  # the codes and scales of random moments
            states = []
            for w in ws:
                nb = -(-w.numel() // reference.ADAMW8BIT_BLOCK)
                states.append((torch.randint(-127, 128, w.shape, dtype=torch.int8, device="cuda"),
                               torch.rand(nb, device="cuda") * 1e-4,
                               torch.randint(0, 256, w.shape, dtype=torch.uint8, device="cuda"),
                               torch.rand(nb, device="cuda") * 1e-3))
        else:
            states = [(torch.rand_like(w, dtype=torch.float32) * 1e-4, torch.rand_like(w, dtype=torch.float32) * 1e-7)
                      for w in ws]

        def step():
            for w, g, s, c in zip(ws, gs, states, cs):
                step_op(w, g, *s, c, **hyper)
        return step

    copy_gbs = copy_bandwidth_gbs()
    rows = [("ours 8-bit moments (Triton)", lambda: make(adamw8bit_step, True), 14 + 16 / QBLOCK),
            ("ours fp32 moments (Triton)", lambda: make(adamw_step, False), 26),
            ("reference torch ops, 8-bit", lambda: make(reference.adamw8bit_step, True), 14 + 16 / QBLOCK)]
    print(f"\n== kernel: AdamW step over {N_PARAMS / 1e6:.0f}M bf16 parameters + Kahan, copy bandwidth "
          f"{copy_gbs:.0f} GB/s")
    print(f"{'':32s} {'ms':>8s} {'GB/s':>7s} {'%copy':>6s} {'temp GB':>8s} {'8B ms':>7s}")
    for name, build, bytes_per_param in rows:
        step = build()
        step()
        ms = median_ms(step)
        temp = peak_memory_gb(step)
        gbs = bytes_per_param * N_PARAMS / ms / 1e6
        print(f"{name:32s} {ms:8.2f} {gbs:7.0f} {100 * gbs / copy_gbs:5.0f}% {temp:8.2f} {ms * 8.03e9 / N_PARAMS:7.0f}",
              flush=True)
        del step
        torch.cuda.empty_cache()


def run_train(name, args, until=None, cap=None, timeout=300):
    """train.py (under the memory cap when given), killed at the first output line starting with `until`;
    returns its output lines."""
    command = [sys.executable, "-c", CAP_WRAPPER.format(cap=cap)] if cap else [sys.executable, "train.py"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    proc = subprocess.Popen(command + args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    watchdog = threading.Timer(timeout, proc.kill)
    watchdog.start()
    lines = []
    with open(os.path.join(OUT, f"adamw8bit_{name}.log"), "w") as log:
        for line in proc.stdout:
            lines.append(line.rstrip())
            log.write(line)
            if until and line.startswith(until):
                proc.kill()
    proc.wait()
    watchdog.cancel()
    return lines


def memory():
    args = ["configs/llama3_8b_80gb.py", "--init_from=scratch", "--model_preset=llama3_8b", f"--data_dir={WORK}/data",
            f"--out_dir={WORK}/run8b", "--max_steps=1000", "--warmup_steps=5", "--eval_interval=100000",
            "--eval_tokens=8192", "--checkpoint_interval=100000"]
    print("\n== memory: train.py, configs/llama3_8b_80gb.py on the Llama-3-8B shape, 80 GB cap", flush=True)
    lines = run_train("memory", args, until="step 10/", cap=CAP_BYTES, timeout=240)
    steps = [re.search(r"^step (\d+)/\d+ .*\| ([\d,]+) tok/s .*MFU ([\d.]+)% \| peak ([\d.]+) GB", line)
             for line in lines]
    steps = [m for m in steps if m]
    for line in lines:
        if line.startswith(("memory cap", "model:")) or "out of memory" in line.lower() or line.startswith("error"):
            print("  " + line[:300])
    if not steps:
        print("  no step logged; the last lines:\n    " + "\n    ".join(lines[-15:]))
        return
    timed = [m for m in steps if int(m.group(1)) >= 4] or steps
    tok_s = statistics.median(float(m.group(2).replace(",", "")) for m in timed)
    mfu = statistics.median(float(m.group(3)) for m in timed)
    print(f"  steps logged: {len(steps)}; peak allocated {max(float(m.group(4)) for m in steps):.1f} GB; "
          f"median {tok_s:,.0f} tok/s, MFU {mfu:.1f}% over steps {timed[0].group(1)}-{timed[-1].group(1)}")


def train_losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def write_svg(path, curves, title):
    """Loss curves {name: {step: loss}} as a plain SVG line chart (raw as thin lines, a 20-step mean as thick)."""
    width, height, left, right, top, bottom = 900, 500, 70, 20, 40, 50
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e"]
    all_steps = [s for c in curves.values() for s in c]
    smin, smax = min(all_steps), max(all_steps)
    values = sorted(v for c in curves.values() for s, v in c.items() if s >= smin + (smax - smin) * 0.02)
    lo, hi = values[0], values[int(0.99 * (len(values) - 1))]  # the first steps' high losses are off the chart
    lo, hi = lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo)

    def xy(s, v):
        x = left + (s - smin) / max(1, smax - smin) * (width - left - right)
        y = top + (hi - min(max(v, lo), hi)) / (hi - lo) * (height - top - bottom)
        return f"{x:.1f},{y:.1f}"

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="12">', f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="22" text-anchor="middle" font-size="15">{escape(title)}</text>',
           f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{height - top - bottom}" fill="none" '
           f'stroke="#888"/>']
    for i in range(6):
        v = lo + (hi - lo) * i / 5
        y = xy(smin, v).split(",")[1]
        out.append(f'<line x1="{left}" y1="{y}" x2="{width - right}" y2="{y}" stroke="#eee"/>')
        out.append(f'<text x="{left - 6}" y="{float(y) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    for i in range(6):
        s = smin + (smax - smin) * i / 5
        x = xy(s, lo).split(",")[0]
        out.append(f'<text x="{x}" y="{height - bottom + 18}" text-anchor="middle">{s:.0f}</text>')
    out.append(f'<text x="{width / 2}" y="{height - 10}" text-anchor="middle">step</text>')
    out.append(f'<text x="16" y="{height / 2}" transform="rotate(-90 16 {height / 2})" text-anchor="middle">'
               f'train loss</text>')
    for k, (name, curve) in enumerate(curves.items()):
        steps = sorted(curve)
        raw = " ".join(xy(s, curve[s]) for s in steps)
        mean = [statistics.fmean(curve[t] for t in steps[max(0, i - 19):i + 1]) for i in range(len(steps))]
        smooth = " ".join(xy(s, v) for s, v in zip(steps, mean))
        color = colors[k % len(colors)]
        out.append(f'<polyline points="{raw}" fill="none" stroke="{color}" stroke-width="0.6" opacity="0.35"/>')
        out.append(f'<polyline points="{smooth}" fill="none" stroke="{color}" stroke-width="2"/>')
        out.append(f'<line x1="{width - right - 260}" y1="{top + 20 + 18 * k}" x2="{width - right - 230}" '
                   f'y2="{top + 20 + 18 * k}" stroke="{color}" stroke-width="2"/>')
        out.append(f'<text x="{width - right - 224}" y="{top + 24 + 18 * k}">{escape(name)}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


FIDELITY_ARMS = [  # (name, optimizer, peak lr): the lr x 1.001 twins measure how far two runs drift apart anyway
    ("fp32 moments (adamw_kahan)", "adamw_kahan", 3e-4), ("8-bit moments (adamw8bit)", "adamw8bit", 3e-4),
    ("fp32 moments, lr x 1.001", "adamw_kahan", 3.003e-4), ("8-bit moments, lr x 1.001", "adamw8bit", 3.003e-4)]


def fidelity_arm(name, optimizer, lr, common):
    """One fidelity run: (name, its train-loss curve {step: loss}, val loss at the end, wall s), or None."""
    out_dir = f"{WORK}/fid_{optimizer}_{lr:g}"
    t0 = time.time()
    # killed at the final evaluation's line: the final save (weights) is not needed
    lines = run_train(f"fidelity_{optimizer}_{lr:g}", common + [f"--optimizer_name={optimizer}",
                      f"--learning_rate={lr}", f"--out_dir={out_dir}"], until=f"step {FIDELITY_STEPS}: val loss",
                      timeout=400)
    try:
        train = train_losses(out_dir)
    except OSError:
        print(f"  {name}: no metrics; the last lines:\n    " + "\n    ".join(lines[-15:]))
        return None
    val = [float(m.group(1)) for m in (re.match(rf"step {FIDELITY_STEPS}: val loss ([\d.]+)", x) for x in lines) if m]
    shutil.copyfile(os.path.join(out_dir, "metrics.jsonl"), os.path.join(OUT, f"adamw8bit_fidelity_{optimizer}_{lr:g}"
                                                                                 ".jsonl"))
    shutil.rmtree(out_dir, ignore_errors=True)
    return name, train, val[0] if val else float("nan"), time.time() - t0


def fidelity(only=()):
    print(f"\n== fidelity: Llama-3.2-1B shape, bf16 weights, {FIDELITY_STEPS} steps of {FIDELITY_TOKENS} tokens, "
          "same init and data; four runs at once on the GPU", flush=True)
    common = FIDELITY_MODEL + [
        "--init_from=scratch", f"--data_dir={WORK}/data", "--weights_dtype=bfloat16",
        f"--tokens_per_micro_step={FIDELITY_TOKENS}", "--grad_accum=1", f"--max_steps={FIDELITY_STEPS}",
        "--warmup_steps=50", "--min_lr=3e-5", "--grad_clip=1.0", "--weight_decay=0.1",
        f"--eval_interval={FIDELITY_STEPS}", "--eval_tokens=65536", "--log_interval=1", "--checkpoint_interval=100000",
        "--seed=1337"]
    arms = [arm for arm in FIDELITY_ARMS if not only or arm[1] in only]
    with ThreadPoolExecutor(len(arms)) as pool:
        results = [r for r in pool.map(lambda arm: fidelity_arm(*arm, common), arms) if r]
    final = {name: statistics.fmean(train[s] for s in sorted(train)[-50:]) for name, train, _, _ in results}
    print(f"  {'':28s} {'steps':>5s} {'train loss (last 50)':>20s} {'val loss':>9s} {'wall s':>7s}")
    for name, train, val, wall in results:
        print(f"  {name:28s} {len(train):5d} {final[name]:20.4f} {val:9.4f} {wall:7.0f}")
    for a, b in ((0, 1), (2, 3), (0, 2), (1, 3)):
        na, nb = FIDELITY_ARMS[a][0], FIDELITY_ARMS[b][0]
        if na in final and nb in final:
            print(f"  {nb} vs {na}: final train loss {100 * (final[nb] / final[na] - 1):+.2f}%")
    if results:
        path = os.path.join(OUT, "adamw8bit_fidelity.svg")
        title = f"Llama-3.2-1B shape, bf16 weights + Kahan: fp32 vs 8-bit Adam moments ({FIDELITY_TOKENS} tokens/step)"
        write_svg(path, {name: train for name, train, _, _ in results}, title)
        print(f"  loss curves: {path}")


def main():
    only = [a for a in sys.argv[1:] if a in ("adamw_kahan", "adamw8bit")]  # fidelity: these optimizers' runs only
    parts = [a for a in sys.argv[1:] if a not in only] or ["kernel", "memory", "fidelity"]
    os.makedirs(OUT, exist_ok=True)
    t0 = time.time()
    if "memory" in parts or "fidelity" in parts:
        shutil.rmtree(WORK + "/data", ignore_errors=True)
        subprocess.run([sys.executable, "data/prepare.py", "--stdlib", "--out", f"{WORK}/data"], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)
    for part in parts:
        start = time.time()
        {"kernel": kernel, "memory": memory, "fidelity": lambda: fidelity(only)}[part]()
        print(f"({part}: {time.time() - start:.0f} s)", flush=True)
    shutil.rmtree(os.path.join(WORK, "run8b"), ignore_errors=True)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
