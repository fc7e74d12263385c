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

Without a GPU: --sass compiles every variant's kernels for sm_90 with the Triton installed here and prints
registers, spills, shared memory and what each loop of the SASS holds (a stand-in driver names the target; the
GPU's Triton may differ); TRITON_INTERPRET=1 ... --dry-run runs this script's timing path on tiny fp32 shapes.
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
    "fused-i64-c": ({"BACKWARD": "fused-i64"}, fused("16x64 h4 w8 s3", "16x64 h2 w8 s2"),
                    "the same, 64 keys per program on 8 warps (spill-free in sm_90 SASS, more instructions per flop)"),
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
    "ws-128x64-s3": (SPLIT, forward_only("128x64 h1 w4 s3 WS=2"), "the same, 3 buffers"),
    "ws-128x128": (SPLIT, forward_only("128x128 h1 w4 s2 WS=2"), "the same, 128 keys per step"),
    "ws-64x128": (SPLIT, forward_only("64x128 h1 w4 s3 WS=2"), "the same, 64 rows"),
    "oneloop-128x64": (SPLIT, forward_only("128x64 h1 w8 s2 WS=1"),
                       "control for ws-128x64: the same single masked loop on 8 warps, not specialized"),
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


def compile_in_this_process(jobs, report=None):
    """Trace a small forward + backward per job with no kernel launched, and compile that job's kernel only
    (report(compiled kernel) -> text to print after OK)."""
    for name, cls, kernel in jobs:
        values, classes, _ = VARIANTS[name]
        pins = {k: parse(v) for k, v in classes[cls].items()}
        t0 = time.time()
        try:
            with settings(values):
                compiled = _trace(pins, kernel)
            extra = f" {classes[cls].get(kernel, values['BACKWARD'])}\n{report(compiled)}" if report else ""
            print(f"OK {name} {cls} {kernel} {time.time() - t0:.1f}s{extra}", flush=True)
        except Exception as e:
            print(f"FAIL {name} {cls} {kernel}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
                  flush=True)


def _trace(pins, target):
    launchers, rows = dict(attn.KERNELS), dict(attn.ROW_KERNELS)
    compiled = []

    class Launch:  # stands in for a TunedKernel: compiles the target's config, launches nothing
        def __init__(self, name):
            self.name = name

        def __call__(self, dtype, grid, *args, **constexprs):
            if self.name == target:
                compiled.append(launchers[self.name].launch(pins[self.name], dtype, grid, args, constexprs,
                                                            warmup=True))

    class RowLaunch:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                if self.name == target:
                    compiled.append(rows[self.name].warmup(*args, grid=grid, **kwargs))
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
    return compiled[0]


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


# ------------------------------------------------------------------------------- --sass: sm_90 code, no GPU

class _Sm90Driver:
    """Stands in for Triton's CUDA driver on a machine without a GPU: names the target (Hopper, sm_90) so that
    Triton compiles (warmup) with its own ptxas; nothing can run."""
    backend = "cuda"

    def is_active(self):
        return True

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def get_benchmarker(self):
        return None

    def get_empty_cache_for_benchmark(self):
        return None

    def map_python_to_cpp_type(self, ty):
        return ty


def sass_report(kernel):
    """Registers, spill stack and shared memory of a compiled kernel, and per loop of its SASS that holds matrix
    instructions (innermost first): instructions / HGMMA / spill LDL+STL / barriers; 'warp-specialized' when the
    Hopper warp specialization split it into partitions."""
    import re
    import tempfile

    import triton
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([cuobjdump, "--dump-sass", f.name], capture_output=True, text=True).stdout
    code = [(int(a, 16), text) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    index = {a: i for i, (a, _) in enumerate(code)}
    loops = []
    for i, (a, text) in enumerate(code):
        jump = re.search(r"BRA\s.*?0x([0-9a-f]+)", text)
        if jump and int(jump.group(1), 16) < a and int(jump.group(1), 16) in index:
            body = [t for _, t in code[index[int(jump.group(1), 16)]:i + 1]]
            count = lambda *ops: sum(any(op in t for op in ops) for t in body)
            if count("HGMMA"):
                loops.append((len(body), count("HGMMA"), count("LDL", "STL"), count("BAR.")))
    regs, stack = (re.search(rf"{key}:(\d+)", usage).group(1) for key in ("REG", "STACK"))
    ws = " warp-specialized" if "ttg.warp_specialize" in kernel.asm["ttgir"] else ""
    return (f"    regs {regs} stack {stack} smem {kernel.metadata.shared} warps {kernel.metadata.num_warps}{ws}; "
            f"loops (ins/HGMMA/LDL+STL/BAR): {' '.join('/'.join(map(str, lp)) for lp in sorted(loops)[:4])}")


def without_gpu_compile_for_sm90():
    global DEVICE
    if not torch.cuda.is_available():
        from triton.runtime import driver
        driver.set_active(_Sm90Driver())
        DEVICE = "cpu"


def sass(names):
    """Compile every kernel of the variants for sm_90 here (this Triton, not necessarily the GPU's) and report."""
    without_gpu_compile_for_sm90()
    compile_in_this_process(compile_jobs(names), report=sass_report)


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
    parser.add_argument("--sass", action="store_true", help="no GPU needed: compile for sm_90, report registers, "
                        "spills, shared memory, loop contents")
    parser.add_argument("--compile", default=None, help=argparse.SUPPRESS)  # JSON job list, for the subprocesses
    args = parser.parse_args()
    if args.compile:
        without_gpu_compile_for_sm90()
        return compile_in_this_process([tuple(j) for j in json.loads(args.compile)])
    if args.sass:
        return sass(args.variants.split(","))
    all_workloads = {"8k": ("one 8K document", [8192]), "16k": ("one 16K document", [16384]),
                     "alpaca": ("alpaca 16K", dict(workloads())["(a) alpaca 16K"])}
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

    keys = args.workloads.split(",")
    risky = [n for n in names if any("WS=2" in label for tiles in VARIANTS[n][1].values() for label in tiles.values())]
    safe = [n for n in names if n not in risky]
    # current and cuDNN first, the warp-specialized forwards last: should one still abort the process here, the
    # rest is already printed
    order = safe[:1] + ["cudnn"] + safe[1:]
    rows, wants = [], {}
    for contenders in (order, risky):
        for key in keys:
            title, lengths = all_workloads[key]
            cls = "short" if key == "alpaca" else "long"
            q, k, v, do, cu = inputs(lengths, seed=1)
            for name in contenders:
                if name == "cudnn" or cls in VARIANTS[name][1]:
                    rows.append(time_one(name, key, title, cls, lengths, (q, k, v, do, cu), wants, bad, args.budget))
            del q, k, v, do
            torch.cuda.empty_cache()
    position = {name: i for i, name in enumerate(order + risky)}
    rows.sort(key=lambda row: (keys.index(row[0]), position[row[1]]))
    print_table(rows, {key: all_workloads[key][0] for key in keys})


def time_one(name, key, title, cls, lengths, data, wants, bad, budget):
    """One table row: (workload key, variant, (ms, TF/s, errors, det) or None, label or note)."""
    if time.time() - START > budget:
        log(f"{title} {name:17s} skipped: past the {budget:.0f}s budget")
        return key, name, None, f"skipped: past the {budget:.0f}s budget"
    if (name, cls) in bad:
        return key, name, None, f"compile failed: {bad[(name, cls)]}"
    q, k, v, do, cu = data
    try:
        if name == "cudnn":
            result, how = run_cudnn(lengths, q, k, v, do)
        else:
            result = run_ours(name, cls, lengths, q, k, v, do, cu)
    except Exception as e:
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}"
        log(f"{title} {name:17s} FAILED {why}")
        return key, name, None, why
    outs, fwd_ms, bwd_ms, fb_ms, det = result
    want = wants.setdefault(key, outs)  # the first one timed (current) is the reference
    abs_err, rel = errors(outs, want)
    flops = sum(2 * L * L * D * HQ for L in lengths)
    rates = (flops / fwd_ms / 1e9, 2.5 * flops / bwd_ms / 1e9, 3.5 * flops / fb_ms / 1e9)
    label = f"cuDNN ({how})" if name == "cudnn" else name
    log(f"{title} {label:17s} fwd {fwd_ms:7.3f} ms {rates[0]:5.0f} | bwd {bwd_ms:7.3f} ms {rates[1]:5.0f} "
        f"| f+b {fb_ms:7.3f} ms {rates[2]:5.0f} TF/s | max|err| {abs_err:.1e} rel {rel:.1e} | "
        f"det {'yes' if det else 'NO'}")
    return key, name, (fwd_ms, bwd_ms, fb_ms, *rates, abs_err, rel, det), label


def print_table(rows, titles):
    print(f"\n{'workload':17s} {'variant':22s} {'fwd':>5s} {'bwd':>5s} {'f+b':>5s} TF/s  {'f+b/cur':>7s} "
          f"{'max|err|':>8s} {'rel':>7s} det")
    current = {}
    for key, name, r, note in rows:
        if r is None:
            print(f"{titles[key]:17s} {name:22s} {note}")
            continue
        current.setdefault(key, r[5])
        print(f"{titles[key]:17s} {note:22s} {r[3]:5.0f} {r[4]:5.0f} {r[5]:5.0f}       {r[5] / current[key]:6.3f}x "
              f"{r[6]:8.1e} {r[7]:7.1e} {'yes' if r[8] else 'NO'}")
    print(f"(TF/s: fwd = sum 2 L^2 D Hq / t, bwd = 2.5 x, f+b = 3.5 x that; f+b/cur and errors against each workload's "
          f"first row, the current kernels; det: two backward runs bitwise equal) total {time.time() - START:.0f}s")


if __name__ == "__main__":
    main()
