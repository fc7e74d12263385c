"""Loss fidelity on one H200: does a cheaper training setting reach its baseline's loss? (~5 minutes a call)

    python bench/fidelity.py adamw8bit [--only adamw8bit]  # fp32 Adam moments (adamw_kahan) vs 8-bit (adamw8bit)
    python bench/fidelity.py fp8 [--only fp8]              # bf16 block Linears vs FP8 ones (train.py --fp8=True)
    python bench/fidelity.py fp8 --seed 1338                # the same from another init and data order

The Llama-3.2-1B shape from one random init (seed 1337) on the same data (the stdlib corpus, byte tokens), bf16
weights + Kahan (adamw_kahan unless the arm says otherwise), 500 steps of 8192 tokens (lr 3e-4, warmup 50, cosine to
3e-5, clipping at 1.0, wd 0.1). Each of the setting's two arms (the baseline first) runs again with the peak lr 1.001
times larger: that twin shows how far two runs drift apart from a harmless change, the scale on which to read the
arms' distance; --seed gives every run another init and data order (its files carry the seed in their names),
the spread between seeds being the other scale. All runs (train.py subprocesses) share the GPU at once.
Printed: per run the final train loss (mean of the last 50 steps), the val loss at the end and the wall time, each
loss against its reference (the baseline at the same lr; the baseline's twin against the baseline: the twin drift),
and a one-line verdict. In $OUT (default $BENCH_DIR, /tmp/fidelity_bench): fidelity_<setting>.json (the same numbers),
fidelity_<setting>.svg (every train-loss curve: raw thin, a 20-step mean thick) and each run's metrics.jsonl
(fidelity_<setting>_<run>.jsonl): 6 files, under the device tool's 8; the runs' logs stay in $BENCH_DIR (a failed
run's last lines are printed). `--only ARM` runs that arm and its twin only (the adamw_kahan runs are deterministic:
a rerun gives the same curve to the last digit; the fp8 setting's bf16 arm is the same run).
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from xml.sax.saxutils import escape

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import run_train  # noqa: E402

WORK = os.environ.get("BENCH_DIR", "/tmp/fidelity_bench")
OUT = os.environ.get("OUT", WORK)
STEPS, TOKENS, LR, TWIN = 500, 8192, 3e-4, 1.001  # TWIN: the twins' peak lr factor
WINDOW = 50  # the final train loss: the mean of the last WINDOW steps
MODEL = ["--model_preset=llama3_2_1b", "--max_seq_len=2048"]
TIMEOUT = 500  # s per run: four 1B runs at once took 4-5 minutes; a device call may take 600
SETTINGS = {  # setting: (what it compares, its two arms (key, label, train.py args), the baseline first)
    "adamw8bit": ("fp32 vs 8-bit Adam moments", [
        ("adamw_kahan", "fp32 moments (adamw_kahan)", ["--optimizer_name=adamw_kahan"]),
        ("adamw8bit", "8-bit moments (adamw8bit)", ["--optimizer_name=adamw8bit"])]),
    "fp8": ("bf16 vs FP8 block Linears", [
        ("bf16", "bf16 Linears", ["--optimizer_name=adamw_kahan"]),
        ("fp8", "FP8 Linears (--fp8=True)", ["--optimizer_name=adamw_kahan", "--fp8=True"])]),
}


SEED = 1337


def common_args(data_dir, steps=STEPS, tokens=TOKENS, model=MODEL, seed=SEED):
    """The train.py arguments every run shares (the arm adds its own, the peak lr and its out_dir)."""
    return model + [
        "--init_from=scratch", f"--data_dir={data_dir}", "--weights_dtype=bfloat16",
        f"--tokens_per_micro_step={tokens}", "--grad_accum=1", f"--max_steps={steps}",
        "--warmup_steps=50", "--min_lr=3e-5", "--grad_clip=1.0", "--weight_decay=0.1",
        f"--eval_interval={steps}", "--eval_tokens=65536", "--log_interval=1", "--checkpoint_interval=100000",
        f"--seed={seed}"]


def runs(setting, only=()):
    """[(key, label, train.py args)]: the setting's arms (those in `only`, if given), then their lr x TWIN twins."""
    arms = [arm for arm in SETTINGS[setting][1] if not only or arm[0] in only]
    return ([(key, label, args + [f"--learning_rate={LR:g}"]) for key, label, args in arms]
            + [(f"{key}_twin", f"{label}, lr x {TWIN}", args + [f"--learning_rate={LR * TWIN:g}"])
               for key, label, args in arms])


def reference(setting, key):
    """The run that run `key` is compared with: the baseline at the same lr; for the baseline's twin, the baseline
    (the twin drift); None for the baseline."""
    base = SETTINGS[setting][1][0][0]
    if key == base:
        return None
    return f"{base}_twin" if key.endswith("_twin") and key != f"{base}_twin" else base


def train_losses(metrics_path):
    """{step: train loss} of a train.py metrics.jsonl."""
    with open(metrics_path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def run_one(name, key, label, args, common, steps, work, out, timeout):
    """One train.py run (its files named after `name`: the setting, and the seed if not the default), killed at its final evaluation's line (the final save is not needed): a dict of key,
    label, args, train (its curve {step: loss}), val (the loss at `steps`, or None), wall (s); None if it logged
    nothing. Its metrics.jsonl lands in `out`, its log in `work`."""
    out_dir = os.path.join(work, f"fid_{name}_{key}")
    shutil.rmtree(out_dir, ignore_errors=True)  # train.py appends to metrics.jsonl
    t0 = time.time()
    lines = run_train(common + args + [f"--out_dir={out_dir}"], os.path.join(work, f"fidelity_{name}_{key}.log"),
                      until=f"step {steps}: val loss", timeout=timeout)
    wall = time.time() - t0
    metrics = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(metrics):
        print(f"  {label}: no metrics; the last lines:\n    " + "\n    ".join(lines[-15:]))
        return None
    shutil.copyfile(metrics, os.path.join(out, f"fidelity_{name}_{key}.jsonl"))
    train = train_losses(metrics)
    shutil.rmtree(out_dir, ignore_errors=True)
    val = [float(m.group(1)) for m in (re.match(rf"step {steps}: val loss ([\d.]+)", x) for x in lines) if m]
    return dict(key=key, label=label, args=args, train=train, val=val[0] if val else None, wall=wall)


def summarize(setting, results, window=WINDOW):
    """The table's rows {key: {label, steps, train_loss, val_loss, wall_s, vs, train_diff_pct, val_diff_pct}} (the
    train loss: the mean of the last `window` logged steps; the diffs in % of `vs`, reference()'s run, None where it
    did not run) and the verdict line."""
    rows = {r["key"]: dict(label=r["label"], steps=len(r["train"]),
                           train_loss=statistics.fmean(r["train"][s] for s in sorted(r["train"])[-window:]),
                           val_loss=r["val"], wall_s=r["wall"]) for r in results if r["train"]}

    def diff(a, b):
        return None if a is None or b is None else 100 * (a / b - 1)

    for key, row in rows.items():
        ref = rows.get(reference(setting, key))
        row["vs"] = reference(setting, key) if ref else None
        row["train_diff_pct"] = diff(row["train_loss"], ref and ref["train_loss"])
        row["val_diff_pct"] = diff(row["val_loss"], ref and ref["val_loss"])
    base, test = (arm[0] for arm in SETTINGS[setting][1])
    pairs = [(rows[k]["train_diff_pct"], at) for k, at in ((test, "at lr"), (f"{test}_twin", f"at lr x {TWIN}"))
             if k in rows and rows[k]["vs"]]
    verdict = (f"{test} final-window loss within {max(abs(d) for d, _ in pairs):.2f}% of {base} "
               f"({', '.join(f'{d:+.2f}% {at}' for d, at in pairs)})" if pairs else f"{test} vs {base}: not both run")
    drift = rows.get(f"{base}_twin", {}).get("train_diff_pct")
    verdict += f"; twin drift {drift:+.2f}% ({base} at lr x {TWIN})" if drift is not None else "; no twin drift run"
    if short := [key for key, row in rows.items() if row["val_loss"] is None]:
        verdict += f"; cut short (no final val loss): {', '.join(short)}"
    return rows, verdict


def print_table(rows, window=WINDOW):
    def f(x, spec):  # spec: "+7.2f" or "9.4f"; "-" for None, as wide
        return format(x, spec) if x is not None else "-".rjust(int(spec.lstrip("+").split(".")[0]))

    print(f"  {'run':40s} {'steps':>5s} {f'train loss (last {window})':>21s} {'diff %':>7s} {'val loss':>9s} "
          f"{'diff %':>7s} {'wall s':>7s}  vs")
    for row in rows.values():
        print(f"  {row['label']:40s} {row['steps']:5d} {row['train_loss']:21.4f} {f(row['train_diff_pct'], '+7.2f')} "
              f"{f(row['val_loss'], '9.4f')} {f(row['val_diff_pct'], '+7.2f')} {row['wall_s']:7.0f}  "
              f"{row['vs'] or ''}")


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


def fidelity(setting, data_dir, work=WORK, out=OUT, only=(), steps=STEPS, tokens=TOKENS, model=MODEL,
             timeout=TIMEOUT, seed=SEED):
    """Every run of `setting` at once (runs()), the table and verdict printed; the JSON summary, the SVG and each
    run's metrics.jsonl in `out`, its log in `work`. Returns the summary."""
    what, _ = SETTINGS[setting]
    common = common_args(data_dir, steps, tokens, model, seed)
    name = setting if seed == SEED else f"{setting}_seed{seed}"  # the files' names
    todo = runs(setting, only)
    print(f"\n== fidelity {setting}: {what}; {' '.join(model)}, bf16 weights, {steps} steps of {tokens} tokens, "
          f"the same init and data (seed {seed}); {len(todo)} runs at once", flush=True)
    os.makedirs(out, exist_ok=True)
    os.makedirs(work, exist_ok=True)
    with ThreadPoolExecutor(len(todo)) as pool:
        results = [r for r in pool.map(lambda run: run_one(name, *run, common, steps, work, out, timeout), todo)
                   if r]
    rows, verdict = summarize(setting, results)
    print_table(rows)
    print(f"  {verdict}")
    summary = dict(setting=setting, seed=seed, compares=what, steps=steps, tokens_per_step=tokens, window=WINDOW,
                   common_args=common, runs=[dict(rows[r["key"]], key=r["key"], args=r["args"]) for r in results
                                             if r["key"] in rows], verdict=verdict)
    with open(os.path.join(out, f"fidelity_{name}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if rows:
        path = os.path.join(out, f"fidelity_{name}.svg")
        write_svg(path, {r["label"]: r["train"] for r in results if r["key"] in rows},
                  f"{what}: {' '.join(a.lstrip('-') for a in model)}, bf16 weights + Kahan ({tokens} tokens/step)")
        print(f"  loss curves: {path}")
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("setting", choices=SETTINGS)
    parser.add_argument("--only", nargs="+", default=[], metavar="ARM", help="run these arms (and their twins) only")
    parser.add_argument("--seed", type=int, default=SEED, help="train.py's seed: the init and the data order")
    a = parser.parse_args()
    if bad := set(a.only) - {arm[0] for arm in SETTINGS[a.setting][1]}:
        parser.error(f"--only {' '.join(sorted(bad))}: the arms of {a.setting} are "
                     f"{', '.join(arm[0] for arm in SETTINGS[a.setting][1])}")
    t0 = time.time()
    data_dir = os.path.join(WORK, "data")
    shutil.rmtree(data_dir, ignore_errors=True)
    subprocess.run([sys.executable, "data/prepare.py", "--stdlib", "--out", data_dir], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)
    fidelity(a.setting, data_dir, only=a.only, seed=a.seed)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
