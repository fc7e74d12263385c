"""AdamW with 8-bit moments on one H200, both parts in one call:

    python bench/adamw8bit.py [kernel] [memory]  # both by default; logs in $OUT

kernel: one step over bench/adamw.py's 760M parameters (4 x 4096x14336 + the 128256x4096 embedding; bf16 weights
  and gradients, Kahan comp): our 8-bit kernel (kernels/adamw8bit.py), our fp32-moment kernel (kernels/adamw.py),
  and the 8-bit reference in torch ops (kernels/reference.py). Bytes per parameter, each tensor read and written
  once: 8-bit: g, w, comp 2 each + two codes 1 each in, w, comp, codes out = 14 (+16 per block of 64 for the
  scales, 14.25); fp32 moments: 26. "%copy" against the device-to-device copy bandwidth of the same run.
memory: train.py with configs/llama3_8b_80gb.py's settings (bf16 weights, 8-bit moments, Kahan comp, the step in
  backward, 8K tokens, checkpoint_layers 8) on the Llama-3-8B shape from random init, under an 80 GB cap
  (torch.cuda.set_per_process_memory_fraction in a wrapper that then runs train.py), killed once step 10 is logged,
  before any checkpoint: peak allocated memory (train.py's "peak") and tok/s of steps 4-10.
The loss fidelity of 8-bit moments against fp32 ones (the 1B runs): python bench/fidelity.py adamw8bit.
"""
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
WORK = os.environ.get("BENCH_DIR", "/tmp/adamw8bit_bench")
OUT = os.environ.get("OUT", WORK)
CAP_BYTES = 80e9  # the "80 GB" card; an H100 80GB actually offers ~85e9 bytes, so this cap is on the safe side
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


def memory():
    from bench.common import run_train
    args = ["configs/llama3_8b_80gb.py", "--init_from=scratch", "--model_preset=llama3_8b", f"--data_dir={WORK}/data",
            f"--out_dir={WORK}/run8b", "--max_steps=1000", "--warmup_steps=5", "--eval_interval=100000",
            "--eval_tokens=8192", "--checkpoint_interval=100000"]
    print("\n== memory: train.py, configs/llama3_8b_80gb.py on the Llama-3-8B shape, 80 GB cap", flush=True)
    lines = run_train(args, os.path.join(OUT, "adamw8bit_memory.log"), until="step 10/", timeout=240,
                      launcher=("-c", CAP_WRAPPER.format(cap=CAP_BYTES)))
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


def main():
    parts = sys.argv[1:] or ["kernel", "memory"]
    if unknown := [p for p in parts if p not in ("kernel", "memory")]:
        sys.exit(f"error: {' '.join(unknown)}: the parts are kernel and memory (the loss fidelity runs are "
                 "python bench/fidelity.py adamw8bit)")
    os.makedirs(OUT, exist_ok=True)
    t0 = time.time()
    if "memory" in parts:
        shutil.rmtree(WORK + "/data", ignore_errors=True)
        subprocess.run([sys.executable, "data/prepare.py", "--stdlib", "--out", f"{WORK}/data"], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)
    for part in parts:
        start = time.time()
        {"kernel": kernel, "memory": memory}[part]()
        print(f"({part}: {time.time() - start:.0f} s)", flush=True)
    shutil.rmtree(os.path.join(WORK, "run8b"), ignore_errors=True)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
