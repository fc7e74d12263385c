"""Tile-shape sweep for the attention kernels: how the autotune lists of kernels/attention_tuning.py were chosen.

    python bench/attention_tiles.py [--kernels fwd,dq,dkdv] [--workloads a,b,d] [--lists] [--top 8] [--jobs 16]

Times each kernel alone (triton.testing.do_bench median) with every tile shape of a grid of candidates:
(BLOCK_M query rows, BLOCK_N keys, HEADS stacked query heads, warps, pipeline stages), on the workloads of
bench/attention.py (32 q heads, 8 kv heads, D 128, bf16). --lists times only the configs of the autotune lists.
Every config's outputs are checked against the autotuned run's (rel err; dK/dV differ by ~1e-4 when HEADS
changes the order in which the group's heads are summed). TF/s here count the kernel's real matrix work: causal
L^2 D Hq per matrix product, 2 products in forward, 3 in dQ, 4 in dK/dV. Candidates are compiled first, in
--jobs processes (ptxas is single-threaded; ~210 configs: the whole sweep of three workloads took ~2.5 min on
the H200 host with 16 cores).
"""
import argparse
import itertools
import math
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.attention import D, HKV, HQ, workloads  # noqa: E402
from kernels import attention_tuning as tuning  # noqa: E402
from kernels.attention import KERNELS, _stat_columns, attention  # noqa: E402

OUTPUTS = {"fwd": (3, 4), "dq": (5, 7), "dkdv": (4, 5)}  # argument positions of each kernel's outputs
MATMULS = {"fwd": 2, "dq": 3, "dkdv": 4}


def candidates(name, lists_only):
    if lists_only:
        return list(tuning.TUNED_CONFIGS[name])
    if name == "dkdv":  # BLOCK_N keys per program, query tiles of HEADS x BLOCK_M rows, BLOCK_M must divide BLOCK_N
        grid = [(bm, bn, h, w, s) for bn, (bm, h), w, s in itertools.product(
            [64, 128], [(16, 1), (16, 2), (16, 4), (32, 1), (32, 2), (32, 4), (64, 1), (64, 2)], [4, 8], [2, 3, 4])]
        grid += [(bm, 32, h, 4, s) for (bm, h), s in itertools.product([(16, 2), (16, 4), (32, 1), (32, 2)], [2, 3])]
    else:  # fwd and dq: query tiles of HEADS x BLOCK_M = 64 or 128 rows, BLOCK_N keys per step
        grid = [(bm, bn, h, w, s) for (bm, h), bn, s in itertools.product(
            [(16, 4), (32, 2), (64, 1), (32, 4), (64, 2), (128, 1)], [32, 64, 128], [2, 3])
            for w in ([4] if bm * h == 64 else [4, 8])]
    return [tuning.config(*c) for c in grid]


def capture_launches(lengths, run=True):
    """Run forward + backward once through attention(); return {kernel: (grid, args, constexprs)} of its launches
    (run=False: record them without running, enough to compile)."""
    T = sum(lengths)
    q = torch.randn(T, HQ, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(T, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    calls, launchers = {}, dict(KERNELS)

    def recorder(name):
        def record(dtype, grid, *args, **constexprs):
            calls[name] = (grid, args, constexprs)
            if run:
                launchers[name](dtype, grid, *args, **constexprs)
        return record

    KERNELS.update({name: recorder(name) for name in launchers})
    try:
        out = attention(q, k, v, cu.cuda(), max(lengths), D ** -0.5)
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    finally:
        KERNELS.update(launchers)
    torch.cuda.synchronize()
    return calls


def launcher(name, calls, config, compile_only=False):
    grid, args, constexprs = calls[name]
    kwargs = dict(DOT_PRECISION="tf32", **constexprs, **config.kwargs, num_warps=config.num_warps,
                  num_stages=config.num_stages)
    kernel = KERNELS[name].kernel  # makes the TMA descriptors for this config's tiles
    if compile_only:
        return lambda: kernel.warmup(*args, grid=grid(config.kwargs), **kwargs)
    return lambda: kernel[grid(config.kwargs)](*args, **kwargs)


def label(c):
    return f"{c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']} h{c.kwargs['HEADS']} w{c.num_warps} s{c.num_stages}"


def compile_shard(shard, n_shards, names, lists_only):
    calls = capture_launches(workloads()[0][1], run=False)  # every workload compiles to the same binaries
    jobs = [(name, c) for name in names for c in candidates(name, lists_only)][shard::n_shards]
    for name, c in jobs:
        try:
            launcher(name, calls, c, compile_only=True)()
        except Exception as e:  # e.g. out of shared memory: reported again, as failed, when timed
            print(f"[compile] {name} {label(c)}: {type(e).__name__}", flush=True)


def sweep(name, calls, lengths, lists_only, top):
    import triton.testing
    outs = [calls[name][1][i] for i in OUTPUTS[name]]
    cu = torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32)
    stat_columns = _stat_columns(cu, sum(lengths)).to(outs[0].device)  # lse2, delta (H, W): these columns written

    def written(o):
        return o.float()[:, stat_columns] if o.dim() == 2 else o.float()
    want = [written(o).clone() for o in outs]  # written by the autotuned run
    rows = []
    for c in candidates(name, lists_only):
        try:
            run = launcher(name, calls, c)
            for o in outs:
                o.fill_(float("nan"))
            run()
            errs = [((written(o) - w).norm() / w.norm()).item() for o, w in zip(outs, want)]
            err = math.nan if any(map(math.isnan, errs)) else max(errs)  # (max() would pass a NaN over)
            rows.append((triton.testing.do_bench(run, warmup=10, rep=60, return_mode="median"), label(c), err))
        except Exception as e:
            rows.append((float("inf"), label(c), type(e).__name__))
    for o, w in zip(outs, want):  # a failed config leaves NaN, and dK/dV reads the delta that dQ writes
        if o.dim() == 2:
            o[:, stat_columns] = w
        else:
            o.copy_(w)
    rows.sort(key=lambda r: r[0])
    flops = MATMULS[name] * sum(L * L * D * HQ for L in lengths)
    failed = [f"{lab}: {err}" for _, lab, err in rows if not (isinstance(err, float) and err < 1e-2)]
    print(f"  {name}: {len(rows)} configs" + (f", failed or wrong: {', '.join(failed)}" if failed else ""))
    listed = {label(c) for c in tuning.TUNED_CONFIGS[name]}
    for rank, (ms, lab, err) in enumerate(rows, 1):
        if rank <= top or (lab in listed and not lists_only):
            print(f"    {rank:3d} {lab:20s} {ms:8.4f} ms {flops / ms / 1e9:7.1f} TF/s  err {err:.1e}"
                  + ("  (listed)" if lab in listed else ""))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", default="fwd,dq,dkdv")
    parser.add_argument("--workloads", default="a,b,d", help="letters of bench/attention.py's workloads")
    parser.add_argument("--lists", action="store_true", help="time only the autotune lists' configs")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--compile-shard", default=None, help=argparse.SUPPRESS)  # i/n, for the subprocesses
    args = parser.parse_args()
    names = args.kernels.split(",")
    if set(names) - set(OUTPUTS):
        sys.exit(f"--kernels: unknown {set(names) - set(OUTPUTS)}; the kernels are fwd, dq, dkdv")
    all_workloads = {name[1]: (name, lengths) for name, lengths in workloads()}  # "(c) 1 x 8K" -> "c"
    letters = args.workloads.split(",")
    if set(letters) - set(all_workloads):
        sys.exit(f"--workloads: unknown {','.join(sorted(set(letters) - set(all_workloads)))}; the workloads are "
                 f"{', '.join(name for name, _ in all_workloads.values())}")
    if not torch.cuda.is_available():
        sys.exit("bench/attention_tiles.py needs a CUDA GPU")
    if args.compile_shard:
        shard, n = map(int, args.compile_shard.split("/"))
        return compile_shard(shard, n, names, args.lists)
    shards = [subprocess.Popen([sys.executable, __file__, "--kernels", args.kernels, "--compile-shard", f"{i}/{args.jobs}"]
                               + (["--lists"] if args.lists else [])) for i in range(args.jobs)]
    for p in shards:
        p.wait()
    for letter in letters:
        workload, lengths = all_workloads[letter]
        print(f"{workload} ({len(lengths)} documents)", flush=True)
        calls = capture_launches(lengths)
        for name in names:  # dQ before dK/dV, as in backward: dQ writes the delta that dK/dV reads
            sweep(name, calls, lengths, args.lists, args.top)


if __name__ == "__main__":
    main()
