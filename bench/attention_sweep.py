"""One GPU call: the candidate variants of the attention kernels against the current ones and SDPA-cuDNN.

    python bench/attention_sweep.py [--workloads 8k,16k,alpaca] [--variants a,b,...] [--budget 200] [--jobs 16]

Workloads (32 q heads, 8 kv heads, D 128, bf16, causal): one 8K document, one 16K document, 16K tokens of
alpaca-like documents (bench/attention.py's batch). Each variant is a forward config and a backward (mode +
configs) of kernels/attention.py, pinned (no autotuning), for "long" documents (8K, 16K) and "short" ones
(alpaca): VARIANTS below says which switch each one flips and why it might win. For each variant and workload:
max |err| of out, dQ, dK, dV against the current kernels (same inputs), whether two backward runs agree bitwise,
and triton.testing.do_bench medians (warm-up excluded, L2 flushed between runs) of forward, backward (on a kept
graph) and forward + backward, as TF/s with bench/attention.py's FLOP count (fwd = sum 2 L^2 D Hq, bwd = 2.5 x,
f+b = 3.5 x). SDPA-cuDNN runs the dense equivalent (not for alpaca: unequal documents).

Every kernel is compiled first, one subprocess per group of jobs (--jobs at once, the risky warp-specialized
forwards each alone: a compiler abort then loses only that variant), into Triton's disk cache, which the timing
process then reads. Progress lines carry the elapsed time; past --budget seconds the remaining timings are
skipped and the table printed. Whole run ~2-3 min on an H200 host (16 cores), most of it compilation.
"""
import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.attention import D, HKV, HQ, SCALE, workloads  # noqa: E402
from kernels import attention as attn  # noqa: E402
from kernels import attention_tuning as tuning  # noqa: E402

START = time.time()
CURRENT = {  # the autotuner's picks (BENCHMARKS.md, TMA session), pinned
    "long": {"fwd": "32x128 h4 w8 s3", "dq": "32x64 h4 w8 s3", "dkdv": "64x128 h1 w8 s2"},
    "short": {"fwd": "16x32 h4 w4 s2", "dq": "32x32 h4 w8 s3", "dkdv": "16x64 h2 w4 s2"},
}
EDGES = {cls: {name: label + " EDGES_TMA" for name, label in tiles.items()} for cls, tiles in CURRENT.items()}


def fused(long, short):
    return {"long": {"fwd": EDGES["long"]["fwd"], "fused": long + " EDGES_TMA"},
            "short": {"fwd": EDGES["short"]["fwd"], "fused": short + " EDGES_TMA"}}


def forward_only(label):
    return {"long": {**CURRENT["long"], "fwd": label}}  # long documents only: one head per tile


# name: (settings of kernels/attention.py, {class: {kernel: "BMxBN hHEADS wWARPS sSTAGES [SWITCH[=v]...]"}}, why)
SPLIT = {"BACKWARD": "split"}
VARIANTS = {
    "current": (SPLIT, CURRENT, "the kernels as autotuned today"),
    "edges": (SPLIT, EDGES,
              "diagonal / partial blocks as TMA tiles too: no per-element addresses or masks on the loads that "
              "dominate short documents (alpaca)"),
    "fused-i64": ({"BACKWARD": "fused-i64"}, fused("16x128 h4 w8 s2", "16x64 h2 w4 s2"),
                  "one backward kernel: 5 matrix products instead of 7 (-29% MMA work), dQ summed by TMA reductions "
                  "as exact int64 fixed point (deterministic)"),
    "fused-i64-b": ({"BACKWARD": "fused-i64"}, fused("16x128 h2 w8 s2", "16x64 h4 w8 s2"),
                    "the same, other tiles (no spills in sm_90 SASS, smaller or larger query tiles)"),
    "fused-i32": ({"BACKWARD": "fused-i32"}, fused("16x128 h4 w8 s2", "16x64 h2 w4 s2"),
                  "int32 fixed point: half the reduction bytes and staging memory, ~1e-4 coarser dQ"),
    "fused-f32": ({"BACKWARD": "fused-f32"}, fused("16x128 h4 w8 s2", "16x64 h2 w4 s2"),
                  "fp32 TMA reductions (FlashAttention-3's): the speed limit of fusing; not bitwise reproducible"),
    "fused-i64-atomics": ({"BACKWARD": "fused-i64", "FUSED_DQ_TMA": False}, fused("16x128 h4 w8 s2", "16x64 h2 w4 s2"),
                          "fused-i64 with per-element atomics (in case this Triton has no TMA reductions)"),
    "ws+fused-i64": ({"BACKWARD": "fused-i64"},
                     {"long": {"fwd": "128x64 h1 w4 s2 WS=2", "fused": "16x128 h4 w8 s2 EDGES_TMA"},
                      "short": fused("16x128 h4 w8 s2", "16x64 h2 w4 s2")["short"]},
                     "the two together (no new binaries): what f+b they give"),
    "ws-128x64": (SPLIT, forward_only("128x64 h1 w4 s2 WS=2"),
                  "warp-specialized forward: a producer warpgroup and two consumer warpgroups that sync by "
                  "mbarriers, so one's softmax can overlap the other's matrix products (FlashAttention-3's shape)"),
    "ws-128x128": (SPLIT, forward_only("128x128 h1 w4 s2 WS=2"), "the same, 128 keys per step"),
    "ws-64x128": (SPLIT, forward_only("64x128 h1 w4 s3 WS=2"), "the same, 64 rows"),
    "oneloop-128x64": (SPLIT, forward_only("128x64 h1 w4 s2 WS=1"),
                       "control for ws-128x64: the same single masked loop, not specialized"),
}


@contextlib.contextmanager
def settings(values):
    """kernels/attention.py's module settings (BACKWARD, FUSED_DQ_TMA) for the duration of the block."""
    before = {name: getattr(attn, name) for name in values}
    try:
        for name, value in values.items():
            setattr(attn, name, value)
        yield
    finally:
        for name, value in before.items():
            setattr(attn, name, value)


SPECIAL = {"long": "8k,16k", "short": "alpaca"}


def log(message):
    line = f"[{time.time() - START:6.1f}s] {message}"
    print(line, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "attention_sweep.log"), "a") as f:
            f.write(line + "\n")


def parse(label):
    """'16x128 h4 w8 s2 EDGES_TMA WS=2' -> triton.Config."""
    tile, heads, warps, stages, *switches = label.split()
    block_m, block_n = map(int, tile.split("x"))
    kwargs = {}
    for s in switches:
        name, _, value = s.partition("=")
        kwargs[name] = int(value) if value else True
    return tuning.config(block_m, block_n, int(heads[1:]), int(warps[1:]), int(stages[1:]), **kwargs)


# --------------------------------------------------------------------------------------------------- compiling

def job_key(name, cls, kernel):
    """What makes a kernel binary: its config (and, for the fused backward's kernels, the module settings)."""
    values, classes, _ = VARIANTS[name]
    fused_part = json.dumps(values, sort_keys=True) if kernel in ("fused", "prep", "dq_out") else ""
    return (kernel, classes[cls].get(kernel, ""), fused_part)


def kernels_of(name, cls):
    values, classes, _ = VARIANTS[name]
    return list(classes[cls]) + (["prep", "dq_out"] if values["BACKWARD"] != "split" else [])


def compile_jobs(names):
    """One (variant, class, kernel) job per distinct kernel binary."""
    jobs, seen = [], set()
    for name in names:
        for cls in VARIANTS[name][1]:
            for kernel in kernels_of(name, cls):
                if job_key(name, cls, kernel) not in seen:
                    seen.add(job_key(name, cls, kernel))
                    jobs.append((name, cls, kernel))
    return jobs


def compile_in_this_process(jobs):
    """Trace a small forward + backward per job with no kernel launched, and compile that job's kernel only."""
    for name, cls, kernel in jobs:
        values, classes, _ = VARIANTS[name]
        pins = {k: parse(v) for k, v in classes[cls].items()}
        t0 = time.time()
        try:
            with settings(values):
                _trace(pins, kernel)
            print(f"OK {name} {cls} {kernel} {time.time() - t0:.1f}s", flush=True)
        except Exception as e:
            print(f"FAIL {name} {cls} {kernel}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
                  flush=True)


def _trace(pins, target):
    launchers, rows = dict(attn.KERNELS), dict(attn.ROW_KERNELS)

    class Launch:  # stands in for a TunedKernel: compiles the target's config, launches nothing
        def __init__(self, name):
            self.name = name

        def __call__(self, dtype, grid, *args, **constexprs):
            if self.name == target:
                launchers[self.name].launch(pins[self.name], dtype, grid, args, constexprs, warmup=True)

    class RowLaunch:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                if self.name == target:
                    rows[self.name].warmup(*args, grid=grid, **kwargs)
            return launch

    attn.KERNELS.update({name: Launch(name) for name in launchers})
    attn.ROW_KERNELS.update({name: RowLaunch(name) for name in rows})
    try:  # same shapes and divisibility as the timed runs (T % 16 == 0), so the same binaries
        q, k, v, _, cu = inputs([300, 212])
        out = attn.attention(q, k, v, cu, 300, SCALE)
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    finally:
        attn.KERNELS.update(launchers)
        attn.ROW_KERNELS.update(rows)


def compile_all(names, n_jobs, timeout):
    """Shards of jobs in subprocesses; returns {(variant, class): failure reason} for the jobs that failed."""
    jobs = compile_jobs(names)
    risky = [j for j in jobs if "WS=2" in VARIANTS[j[0]][1][j[1]].get(j[2], "")]
    rest = [j for j in jobs if j not in risky]
    n_rest = max(1, n_jobs - len(risky))
    shards = [[j] for j in risky] + [rest[i::n_rest] for i in range(n_rest) if rest[i::n_rest]]
    log(f"compiling {len(jobs)} kernels in {len(shards)} processes")

    def run(shard):
        try:
            p = subprocess.run([sys.executable, __file__, "--compile", json.dumps(shard)], capture_output=True,
                               text=True, timeout=timeout)
            out, err = p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            out, err = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
        done = {tuple(line.split()[1:4]) for line in out.splitlines() if line.startswith("OK ")}
        failed = {}
        for name, cls, kernel in shard:
            if (name, cls, kernel) not in done:
                why = [line for line in out.splitlines() if line.startswith(f"FAIL {name} {cls} {kernel}")]
                tail = [line for line in err.strip().splitlines() if "rror" in line or "ssert" in line][-1:]
                failed[(name, cls, kernel)] = (why[0].split(": ", 1)[1] if why else
                                               f"compiler process died ({(tail or [err.strip()[-200:]])[0][:200]})")
        return failed

    failed = {}
    with ThreadPoolExecutor(max_workers=len(shards)) as pool:
        for result in pool.map(run, shards):
            failed.update(result)
    for (name, cls, kernel), why in failed.items():
        log(f"[compile failed] {name} ({cls}) {kernel}: {why}")
    failed_keys = {job_key(*job): why for job, why in failed.items()}
    bad = {}  # (variant, class) -> why, for every variant that needs a kernel that failed
    for name in names:
        for cls in VARIANTS[name][1]:
            for kernel in kernels_of(name, cls):
                if job_key(name, cls, kernel) in failed_keys:
                    bad[(name, cls)] = f"{kernel}: {failed_keys[job_key(name, cls, kernel)]}"
    log(f"compiled in {time.time() - START:.0f}s; {len(failed)} of {len(jobs)} kernels failed")
    return bad


# ----------------------------------------------------------------------------------------------------- timing

DEVICE, DTYPE, DRY_RUN = "cuda", torch.bfloat16, False


def inputs(lengths, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    T = sum(lengths)
    q = torch.randn(T, HQ, D, device=DEVICE, dtype=DTYPE, generator=g).requires_grad_()
    k, v = (torch.randn(T, HKV, D, device=DEVICE, dtype=DTYPE, generator=g).requires_grad_() for _ in range(2))
    do = torch.randn(T, HQ, D, device=DEVICE, dtype=DTYPE, generator=g)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return q, k, v, do, cu.to(DEVICE)


def bench(fn, long):
    if DRY_RUN:  # the interpreter: one call, just to run the code
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=400 if long else 150, return_mode="median")


def dry_run_setup():
    """--dry-run (with TRITON_INTERPRET=1, no GPU): tiny shapes in fp32 through the interpreter, no compile step,
    one call per timing: checks this script's own code, not the kernels' speed."""
    global DEVICE, DTYPE, DRY_RUN, HQ, HKV, D, SCALE
    DEVICE, DTYPE, DRY_RUN = "cpu", torch.float32, True
    HQ, HKV, D = 4, 1, 64
    SCALE = D ** -0.5
    return {"8k": ("one 8K document (dry run: 256)", [256]), "16k": ("one 16K document (dry run: 384)", [384]),
            "alpaca": ("alpaca 16K (dry run: 256)", [40, 100, 17, 99])}


def measure(fwd, inputs_, do, long):
    """(outputs (out, dq, dk, dv), fwd ms, bwd ms, f+b ms, backward bitwise reproducible)."""
    out = fwd()
    grads = torch.autograd.grad(out, inputs_, do, retain_graph=True)
    again = torch.autograd.grad(out, inputs_, do, retain_graph=True)
    det = all(torch.equal(a, b) for a, b in zip(grads, again))
    fwd_ms = bench(fwd, long)
    bwd_ms = bench(lambda: torch.autograd.grad(out, inputs_, do, retain_graph=True), long)
    fb_ms = bench(lambda: torch.autograd.grad(fwd(), inputs_, do), long)
    return (out.detach(), *grads), fwd_ms, bwd_ms, fb_ms, det


def run_ours(name, cls, lengths, q, k, v, do, cu):
    values, classes, _ = VARIANTS[name]
    pins = {kernel: parse(label) for kernel, label in classes[cls].items()}
    pins.update({kernel: parse(label) for kernel, label in CURRENT[cls].items() if kernel not in pins})
    with settings(values), tuning.pinned(attn.KERNELS, pins):
        return measure(lambda: attn.attention(q, k, v, cu, max(lengths), SCALE), (q, k, v), do, cls == "long")


def run_cudnn(lengths, q, k, v, do):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if len(set(lengths)) != 1:
        raise NotImplementedError("no dense equivalent for unequal documents")
    B, L = len(lengths), lengths[0]
    dense = lambda x, h: x.detach().view(B, L, h, D).transpose(1, 2).contiguous().requires_grad_()
    qb, kb, vb = dense(q, HQ), dense(k, HKV), dense(v, HKV)
    dob = do.view(B, L, HQ, D).transpose(1, 2)

    def attempt(kb, vb, **kwargs):
        def fwd():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=SCALE, **kwargs)
        return measure(fwd, (qb, kb, vb), dob, True)

    try:
        result, how = attempt(kb, vb, enable_gqa=True), "enable_gqa"
    except Exception:  # this torch's cuDNN path may not take GQA: repeat K/V to the query heads
        rep = lambda x: x.detach().repeat_interleave(HQ // HKV, dim=1).contiguous().requires_grad_()
        result, how = attempt(rep(kb), rep(vb)), "K/V repeated"
    outs = result[0]
    as_thd = lambda x: x.transpose(1, 2).reshape(B * L, -1, D)
    outs = (as_thd(outs[0]), as_thd(outs[1]), *(as_thd(g) for g in outs[2:]))
    if outs[2].shape[1] != HKV:  # repeated heads: sum dK, dV over each group's copies
        outs = (*outs[:2], *(g.view(B * L, HKV, HQ // HKV, D).sum(2) for g in outs[2:]))
    return (outs, *result[1:]), how


def errors(got, want):
    """Max |err| over out, dQ, dK, dV, and the worst ||err|| / ||want||."""
    abs_err = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want))
    rel = max(((g.float() - w.float()).norm() / w.float().norm()).item() for g, w in zip(got, want))
    return abs_err, rel


# ------------------------------------------------------------------------------------------------------- main

def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="8k,16k,alpaca")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--budget", type=float, default=210, help="seconds; later timings are skipped")
    parser.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--compile-timeout", type=float, default=90)
    parser.add_argument("--dry-run", action="store_true", help="TRITON_INTERPRET=1, CPU: exercise this script")
    parser.add_argument("--compile", default=None, help=argparse.SUPPRESS)  # JSON job list, for the subprocesses
    args = parser.parse_args()
    if args.compile:
        return compile_in_this_process([tuple(j) for j in json.loads(args.compile)])
    all_workloads = {"8k": ("one 8K document", [8192]), "16k": ("one 16K document", [16384]),
                     "alpaca": ("alpaca 16K", dict(workloads())["(a) alpaca 16K"]), "4x2k": ("4 x 2K", [2048] * 4)}
    if args.dry_run:
        all_workloads = dry_run_setup()
    elif not torch.cuda.is_available():
        sys.exit("bench/attention_sweep.py needs a CUDA GPU (or --dry-run with TRITON_INTERPRET=1)")
    import triton
    names = args.variants.split(",")
    unknown = set(names) - set(VARIANTS)
    if unknown:
        sys.exit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    gpu = "CPU interpreter" if args.dry_run else torch.cuda.get_device_name()
    log(f"{gpu} | torch {torch.__version__} | triton {triton.__version__} | Hq={HQ} Hkv={HKV} D={D} {DTYPE} causal")
    for name in names:
        log(f"  {name:17s} {VARIANTS[name][2]}")
    bad = {} if args.dry_run else compile_all(names, args.jobs, args.compile_timeout)

    rows = []
    for key in args.workloads.split(","):
        title, lengths = all_workloads[key]
        cls = "short" if key == "alpaca" else "long"
        flops = sum(2 * L * L * D * HQ for L in lengths)
        q, k, v, do, cu = inputs(lengths, seed=1)
        want = None
        contenders = [n for n in names if cls in VARIANTS[n][1]] + ["cudnn"]
        for name in contenders:
            if time.time() - START > args.budget:
                log(f"{title:17s} {name:17s} skipped: past the {args.budget:.0f}s budget")
                continue
            if (name, cls) in bad:
                rows.append((title, name, None, f"compile failed: {bad[(name, cls)]}"))
                continue
            try:
                if name == "cudnn":
                    result, how = run_cudnn(lengths, q, k, v, do)
                    name = f"SDPA-cuDNN ({how})"
                else:
                    result = run_ours(name, cls, lengths, q, k, v, do, cu)
            except Exception as e:
                why = f"{type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}"
                rows.append((title, name, None, why))
                log(f"{title:17s} {name:17s} FAILED {rows[-1][3]}")
                continue
            outs, fwd_ms, bwd_ms, fb_ms, det = result
            want = outs if want is None else want  # the first variant (current) is the reference
            abs_err, rel = errors(outs, want)
            rates = (flops / fwd_ms / 1e9, 2.5 * flops / bwd_ms / 1e9, 3.5 * flops / fb_ms / 1e9)
            rows.append((title, name, (fwd_ms, bwd_ms, fb_ms, *rates, abs_err, rel, det), ""))
            log(f"{title:17s} {name:17s} fwd {fwd_ms:7.3f} ms {rates[0]:5.0f} | bwd {bwd_ms:7.3f} ms {rates[1]:5.0f} "
                f"| f+b {fb_ms:7.3f} ms {rates[2]:5.0f} TF/s | max|err| {abs_err:.1e} rel {rel:.1e} | "
                f"det {'yes' if det else 'NO'}")
        del q, k, v, do
        torch.cuda.empty_cache()
    print_table(rows)


def print_table(rows):
    print(f"\n{'workload':17s} {'variant':26s} {'fwd':>5s} {'bwd':>5s} {'f+b':>5s} TF/s  {'f+b vs cur':>10s} "
          f"{'max|err|':>8s} {'rel':>7s} det")
    current = {}
    for title, name, r, note in rows:
        if r is None:
            print(f"{title:17s} {name:26s} {note}")
            continue
        current.setdefault(title, r[5])
        print(f"{title:17s} {name:26s} {r[3]:5.0f} {r[4]:5.0f} {r[5]:5.0f}       {r[5] / current[title]:9.3f}x "
              f"{r[6]:8.1e} {r[7]:7.1e} {'yes' if r[8] else 'NO'}")
    print(f"(TF/s: fwd = sum 2 L^2 D Hq / t, bwd = 2.5 x, f+b = 3.5 x that; errors against the first row of each "
          f"workload; det: two backward runs bitwise equal) total {time.time() - START:.0f}s")


if __name__ == "__main__":
    main()
