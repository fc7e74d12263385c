"""Loss fidelity on one H200: does a cheaper training setting reach its baseline's loss? (~5 minutes a call)

    python bench/fidelity.py adamw8bit [--only adamw8bit]  # fp32 Adam moments (adamw_kahan) vs 8-bit (adamw8bit)
    python bench/fidelity.py fp8 [--only fp8]              # bf16 block Linears vs FP8 ones (train.py --fp8=True)
    python bench/fidelity.py fp8 --shape small --finetune --seed 1337 1338  # from a trained model, two data orders
    python bench/fidelity.py fp8 --shape small --finetune --vocab 32768     # a real vocabulary (a byte-pair one)

Every run: the stdlib corpus (byte tokens), bf16 weights + Kahan (adamw_kahan unless the arm says otherwise), 500
steps of a SHAPES entry (`1b`, the default: the Llama-3.2-1B shape, 8,192 tokens a step, lr 3e-4 -> 3e-5; `small`:
a 183M Llama, 16,384 tokens, lr 6e-4 -> 6e-6), warmup 50, cosine, clip 1.0, wd 0.1, from the random init of
--seed (default 1337; the seed also sets the data order). `--finetune` first trains one bf16 base by that schedule
(seed 1337) and starts every run from its weights at a third of the peak lr. Why: from a random init the loss
still falls fast, so two runs of the same setting a few steps out of step end further apart than the 1% to resolve;
continued from a trained model, nanollama's main use, they stay close (BENCHMARKS.md has both).
Each arm (the baseline first) runs again with the peak lr 1.001 times larger: that twin shows how far two runs drift
apart from a harmless change, the scale on which to read the arms' distance; the seeds are the other scale. All
runs of all seeds (train.py subprocesses) share the GPU at once. Printed per seed, and with several seeds for the
runs' mean curves over them: per run the final train loss (mean of the last 50 steps), the val loss at the end and
the wall time, each loss against its reference (the baseline at the same lr; the baseline's twin against the
baseline: the twin drift), and a one-line verdict. In $OUT (default $BENCH_DIR, /tmp/fidelity_bench):
fidelity_<name>.json (those numbers and every run's curve) and .svg (every curve: raw thin, a 20-step mean thick)
per seed, and fidelity_<name>_pooled.json/.svg for the mean curves: 8 files for 3 seeds, the device tool's limit.
The logs stay in $BENCH_DIR. `--only ARM` runs that arm and its twin only. `--vocab V`: instead of byte tokens, a
byte-level BPE of V tokens trained on the same corpus (Llama-3's split; by the `tokenizers` library, a bench-only
dependency here as Liger is in bench/e2e.py), so that the lm_head and its softmax have a real vocabulary's size;
`--data DIR`: a dataset data/prepare.py wrote (e.g. made where the stdlib is whole: some Pythons ship it without
its tests, a third of the text). The file names get _vocab<V> for any tokenizer but bytes.
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
STEPS, TWIN = 500, 1.001  # TWIN: the twins' peak lr factor
WINDOW = 50  # the final train loss: the mean of the last WINDOW steps
SHAPES = {  # the model (train.py args), tokens per step, the peak and final lr, val tokens per evaluation
    "1b": dict(model=["--model_preset=llama3_2_1b", "--max_seq_len=2048"], tokens=8192, lr=3e-4, min_lr=3e-5,
               eval_tokens=65536),
    "small": dict(model=["--dim=1024", "--n_layers=12", "--n_heads=8", "--n_kv_heads=2", "--ffn_dim=4096",
                         "--max_seq_len=2048"], tokens=16384, lr=6e-4, min_lr=6e-6, eval_tokens=262144),
}
TIMEOUT = 540  # s per run: four 1B runs at once took 4-5 minutes; a device call may take 600
SETTINGS = {  # setting: (what it compares, its two arms (key, label, train.py args), the baseline first)
    "adamw8bit": ("fp32 vs 8-bit Adam moments", [
        ("adamw_kahan", "fp32 moments (adamw_kahan)", ["--optimizer_name=adamw_kahan"]),
        ("adamw8bit", "8-bit moments (adamw8bit)", ["--optimizer_name=adamw8bit"])]),
    "fp8": ("bf16 vs FP8 block Linears and lm_head gradients", [
        ("bf16", "bf16 Linears", ["--optimizer_name=adamw_kahan"]),
        ("fp8", "FP8 (--fp8=True)", ["--optimizer_name=adamw_kahan", "--fp8=True"])]),
}


SEED = 1337
FINETUNE_LR = 1 / 3  # --finetune: the runs' peak lr, as a fraction of the shape's (the base trains at the shape's)


def bpe_tokenizer(vocab_size, work):
    """A byte-level BPE of vocab_size tokens (one of them <|endoftext|>, the documents' bos and eos) trained on
    the stdlib corpus, as work/tokenizer.json, which tokenizer.py reads like Llama-3's or Qwen's."""
    try:
        import tokenizers
    except ImportError:
        sys.exit("error: --vocab trains its tokenizer with the `tokenizers` library: pip install tokenizers")
    from data.prepare import stdlib_files
    from tokenizer import LLAMA3_PATTERN
    pre = tokenizers.pre_tokenizers
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = pre.Sequence([pre.Split(tokenizers.Regex(LLAMA3_PATTERN), behavior="isolated"),
                                      pre.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=pre.ByteLevel.alphabet(), show_progress=False)
    def texts():  # the files prepare.py reads (it skips those that are not UTF-8)
        for path in stdlib_files()[1]:
            with open(path, "rb") as f:
                raw = f.read()
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError:
                continue
    t0 = time.time()
    tok.train_from_iterator(texts(), trainer)
    path = os.path.join(work, "tokenizer.json")
    tok.save(path)
    print(f"  tokenizer: a byte-level BPE of {tok.get_vocab_size()} tokens ({time.time() - t0:.0f} s)", flush=True)
    return path


def common_args(data_dir, shape, steps=STEPS, seed=SEED, init="scratch"):
    """The train.py arguments every run of a SHAPES entry shares (the arm adds its own, the peak lr, its out_dir);
    init: train.py's init_from (a checkpoint directory: the model comes from it, its shape arguments go unused)."""
    return shape["model"] + [
        f"--init_from={init}", f"--data_dir={data_dir}", "--weights_dtype=bfloat16",
        f"--tokens_per_micro_step={shape['tokens']}", "--grad_accum=1", f"--max_steps={steps}",
        "--warmup_steps=50", f"--min_lr={shape['min_lr']:g}", "--grad_clip=1.0", "--weight_decay=0.1",
        f"--eval_interval={steps}", f"--eval_tokens={shape['eval_tokens']}", "--log_interval=1",
        "--checkpoint_interval=100000", f"--seed={seed}"]


def runs(setting, only=(), lr=SHAPES["1b"]["lr"]):
    """[(key, label, train.py args)]: the setting's arms (those in `only`, if given), then their lr x TWIN twins."""
    arms = [arm for arm in SETTINGS[setting][1] if not only or arm[0] in only]
    return ([(key, label, args + [f"--learning_rate={lr:g}"]) for key, label, args in arms]
            + [(f"{key}_twin", f"{label}, lr x {TWIN}", args + [f"--learning_rate={lr * TWIN:g}"])
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


def run_one(name, key, label, args, common, steps, work, timeout):
    """One train.py run (its out_dir and log named after `name`: the setting, shape and seed), killed at its final
    evaluation's line (the final save is not needed): a dict of key, label, args, train (its curve {step: loss}), val
    (the loss at `steps`, or None), wall (s); None if it logged nothing. Its log lands in `work`."""
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
    pad = 0.05 * (hi - lo) or 0.05 * abs(lo) or 1.0  # one value (two steps' curves): a band around it
    lo, hi = lo - pad, hi + pad

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


def train_base(data_dir, spec, steps, work, timeout):
    """--finetune's base: one bf16 run of the shape from a random init (seed SEED), its weights saved at the end.
    Returns the checkpoint directory."""
    out_dir = os.path.join(work, "fid_base")
    shutil.rmtree(out_dir, ignore_errors=True)
    args = common_args(data_dir, spec, steps) + ["--optimizer_name=adamw_kahan", f"--learning_rate={spec['lr']:g}",
                                                 f"--checkpoint_interval={steps}", "--save_optimizer_state=False",
                                                 f"--out_dir={out_dir}"]
    t0 = time.time()
    lines = run_train(args, os.path.join(work, "fidelity_base.log"), timeout=timeout)
    ckpt = os.path.join(out_dir, "ckpt")
    if not os.path.isfile(os.path.join(ckpt, "config.json")):
        sys.exit("error: the base run saved no checkpoint; its last lines:\n    " + "\n    ".join(lines[-15:]))
    print(f"  base: {next((x for x in reversed(lines) if x.startswith('val loss')), lines[-1])} "
          f"({time.time() - t0:.0f} s)", flush=True)
    return ckpt


def pooled(results):
    """The runs of several seeds as one run per key: its train curve the mean over the seeds at every step all of
    them logged, its val and wall the means (val None unless every seed has one)."""
    by_key = {}
    for r in results:
        by_key.setdefault(r["key"], []).append(r)
    out = []
    for key, rs in by_key.items():
        steps = sorted(set.intersection(*(set(r["train"]) for r in rs)))
        vals = [r["val"] for r in rs]
        out.append(dict(key=key, label=rs[0]["label"], args=rs[0]["args"],
                        train={s: statistics.fmean(r["train"][s] for r in rs) for s in steps},
                        val=None if None in vals else statistics.fmean(vals),
                        wall=statistics.fmean(r["wall"] for r in rs)))
    return out


def report(setting, results, name, title, out, **extra):
    """Print the table and verdict of `results`; write fidelity_<name>.json (the rows, the verdict and every run's
    curve as [step, loss] pairs) and fidelity_<name>.svg. Returns the JSON's dict."""
    rows, verdict = summarize(setting, results)
    print_table(rows)
    print(f"  {verdict}")
    summary = dict(setting=setting, compares=SETTINGS[setting][0], window=WINDOW, **extra,
                   runs=[dict(rows[r["key"]], key=r["key"], args=r["args"],
                              curve=[[s, r["train"][s]] for s in sorted(r["train"])]) for r in results
                         if r["key"] in rows], verdict=verdict)
    with open(os.path.join(out, f"fidelity_{name}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if rows:
        path = os.path.join(out, f"fidelity_{name}.svg")
        write_svg(path, {r["label"]: r["train"] for r in results if r["key"] in rows}, title)
        print(f"  loss curves: {path}")
    return summary


def fidelity(setting, data_dir, work=WORK, out=OUT, only=(), shape="1b", seeds=(SEED,), steps=STEPS,
             timeout=TIMEOUT, shapes=SHAPES, finetune=False, vocab=None):
    """Every run of `setting` for every seed at once (runs()), a table and verdict printed per seed (and for the
    seeds' mean curves if several), their files in `out` (report()), the logs in `work`. Returns the summaries,
    one per seed, then the pooled one."""
    what, _ = SETTINGS[setting]
    spec = shapes[shape]
    # the files' names: the 1b shape's from a random init as before, seed 1337 unnamed
    tag = (setting if shape == "1b" else f"{setting}_{shape}") + ("_finetune" if finetune else "") + \
        (f"_vocab{vocab}" if vocab else "")
    names = {seed: tag if seed == SEED else f"{tag}_seed{seed}" for seed in seeds}
    lr = spec["lr"] * (FINETUNE_LR if finetune else 1)
    todo = [(seed, run) for seed in seeds for run in runs(setting, only, lr)]
    print(f"\n== fidelity {setting}: {what}; {' '.join(spec['model'])}, bf16 weights, {steps} steps of "
          f"{spec['tokens']} tokens of {f'a {vocab}-token BPE' if vocab else 'bytes'} from "
          f"{'a trained bf16 base' if finetune else 'a random init'}, the same init and "
          f"data per seed (seeds {', '.join(map(str, seeds))}); {len(todo)} runs at once", flush=True)
    os.makedirs(out, exist_ok=True)
    os.makedirs(work, exist_ok=True)
    init = train_base(data_dir, spec, steps, work, timeout) if finetune else "scratch"
    with ThreadPoolExecutor(len(todo)) as pool:
        results = list(pool.map(lambda t: run_one(names[t[0]], *t[1], common_args(data_dir, spec, steps, t[0], init),
                                                  steps, work, timeout), todo))
    title = (f"{what}: {' '.join(a.lstrip('-') for a in spec['model'])}, bf16 weights + Kahan "
             f"({spec['tokens']} tokens/step{', from a trained base' if finetune else ''}"
             f"{f', a {vocab}-token BPE' if vocab else ''})")
    summaries = []
    for seed in seeds:
        print(f"\n  seed {seed}:")
        mine = [r for (s, _), r in zip(todo, results) if s == seed and r]
        summaries.append(report(setting, mine, names[seed], f"{title}, seed {seed}", out, seed=seed, shape=shape,
                                vocab=vocab, steps=steps, tokens_per_step=spec["tokens"],
                                finetune=finetune, common_args=common_args(data_dir, spec, steps, seed, init)))
    if len(seeds) > 1:
        print(f"\n  the mean curves over seeds {', '.join(map(str, seeds))}:")
        summaries.append(report(setting, pooled([r for r in results if r]), f"{tag}_pooled",
                                f"{title}, mean of seeds {', '.join(map(str, seeds))}", out, seeds=list(seeds),
                                shape=shape, vocab=vocab, finetune=finetune, steps=steps,
                                tokens_per_step=spec["tokens"]))
    return summaries


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("setting", choices=SETTINGS)
    parser.add_argument("--only", nargs="+", default=[], metavar="ARM", help="run these arms (and their twins) only")
    parser.add_argument("--shape", choices=SHAPES, default="1b", help="the model, tokens per step and lr (SHAPES)")
    parser.add_argument("--finetune", action="store_true", help="train a bf16 base first; every run starts from it")
    parser.add_argument("--seed", type=int, nargs="+", default=[SEED],
                        help="train.py's seed (the init and the data order); several: all their runs at once")
    parser.add_argument("--vocab", type=int, help="a byte-level BPE of this many tokens instead of bytes (a "
                        "multiple of 16, as the FP8 lm_head needs)")
    parser.add_argument("--data", help="a dataset prepared by data/prepare.py, instead of preparing the stdlib here")
    a = parser.parse_args()
    if bad := set(a.only) - {arm[0] for arm in SETTINGS[a.setting][1]}:
        parser.error(f"--only {' '.join(sorted(bad))}: the arms of {a.setting} are "
                     f"{', '.join(arm[0] for arm in SETTINGS[a.setting][1])}")
    if len(set(a.seed)) != len(a.seed) or len(a.seed) > 3:
        parser.error(f"--seed {' '.join(map(str, a.seed))}: at most 3 distinct seeds (the device tool brings back 8 "
                     "files: 2 per seed and 2 for their mean)")
    if a.vocab is not None and (a.vocab % 16 or a.vocab < 512 or a.data):
        parser.error(f"--vocab {a.vocab}: a multiple of 16, at least 512, and no --data")
    t0 = time.time()
    os.makedirs(WORK, exist_ok=True)
    data_dir = a.data or os.path.join(WORK, "data")
    if not a.data:
        tokenizer = bpe_tokenizer(a.vocab, WORK) if a.vocab else "bytes"
        shutil.rmtree(data_dir, ignore_errors=True)
        # val: 3% with a BPE (its ~4x fewer tokens would leave less than eval_tokens in 1%)
        subprocess.run([sys.executable, "data/prepare.py", "--stdlib", "--tokenizer", tokenizer, "--out", data_dir,
                        f"--val_fraction={0.03 if a.vocab else 0.01}"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    try:
        with open(os.path.join(data_dir, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"error: --data {data_dir}: no dataset of data/prepare.py there ({e})")
    vocab = meta["vocab_size"] if meta["tokenizer"] != "bytes" else None
    train, per_run = meta["splits"]["train"]["tokens"], STEPS * SHAPES[a.shape]["tokens"]
    print(f"  data: {train:,} train / {meta['splits']['val']['tokens']:,} val tokens ({meta['tokenizer']}, "
          f"{meta['vocab_size']:,} ids); a run reads {per_run:,}, {per_run / train:.2f} epochs", flush=True)
    fidelity(a.setting, data_dir, only=a.only, shape=a.shape, seeds=a.seed, finetune=a.finetune, vocab=vocab)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
