"""Benchmark: where the time of one training step goes, by kind of GPU kernel (torch.profiler).

    python bench/profile_step.py [--model 8b|1b] [--row doc8k|free|doc8k_8bit|free_8bit] [--steps 3] [--fp8]
                                 [--list KIND] [--gaps]

Builds bench/e2e.py's row on the Llama-3-8B shape (random init, bf16 weights, the optimizer stepped inside backward,
as the 8B config trains) or on the Llama-3.2-1B shape (--model 1b, row free: fp32 weights under autocast, fused
torch AdamW after backward, as the 1B config trains), warms up, then profiles --steps steps and sums the CUDA
kernels' time by kind: GEMMs (cuBLAS: the Linears, the lm_head inside the fused cross-entropy), attention (our
forward, dK/dV and dQ kernels), cross-entropy, RMSNorm, GLU, RoPE, the optimizer, FP8 quantization (--fp8: the block
Linears in FP8, their GEMMs counted with the others), and the rest (elementwise ops, copies, reductions, gradient-
norm sums). "idle" is the step's wall time minus all kernel time: the GPU waiting for the host (launches, Python,
hooks); --gaps says where: the idle time summed by the kernels on either side of each gap. Each kind's time is a
ceiling on what a faster kernel of that kind can win: halving it saves half. Also the measured FLOPs of the kind
where they are known (the model's matmul FLOPs for GEMMs, the causal attention FLOPs for attention) against the
H200's spec peak (989 TFLOP/s) and its measured matmul rate (790).
"""
import argparse
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import H200_MATMUL_FLOPS, H200_PEAK_FLOPS, GpuClocks  # noqa: E402
from bench.e2e import (MODELS, NAMES, OPTIMIZER, WARMUP, build_ours, build_steps, make_documents,  # noqa: E402
                       ours_step, rows_of, warmup_order)
from model import PRESETS, Llama, LlamaConfig  # noqa: E402

# (kind, pattern of the CUDA kernel names), first match wins
KINDS = [("attention", r"_attn_"), ("FP8 quantization", r"^_quantize_kernel"),
         ("cross-entropy", r"cross_entropy"), ("RMSNorm", r"rms_norm"),
         ("GLU", r"_glu_"), ("RoPE", r"_rope_"), ("optimizer", r"adamw|FusedAdam"),
         ("GEMM", r"gemm|nvjet|xmma|cutlass|cublas|sm90_|Kernel2")]


def kind_of(name):
    return next((kind for kind, pattern in KINDS if re.search(pattern, name, re.IGNORECASE)), "other")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="8b", choices=["8b", "1b"])
    parser.add_argument("--row", default="doc8k", choices=["doc8k", "free", "doc8k_8bit", "free_8bit"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fp8", action="store_true", help="the block Linears in FP8 (train.py's fp8=True)")
    parser.add_argument("--list", metavar="KIND", choices=[kind for kind, _ in KINDS] + ["other"],
                        help="also list the 15 longest kernels of one kind (e.g. other)")
    parser.add_argument("--gaps", action="store_true", help="also sum the idle gaps by the kernels around them")
    args = parser.parse_args()
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    row = next((r for r in rows_of(args.model) if r.key == args.row and r.impl == "ours"), None)
    if row is None:
        sys.exit(f"profile_step.py: no row {args.row!r} of ours for --model {args.model}")
    preset = PRESETS[MODELS[args.model]]
    docs = make_documents(max(row.size, 16384) * (WARMUP + args.steps + 1), 32 * (WARMUP + args.steps + 1),
                          preset["vocab_size"])
    steps = build_steps(row, docs, WARMUP + args.steps)
    model, update = build_ours(LlamaConfig(**{**preset, "max_seq_len": row.max_seq_len}), "cuda",
                               row.optimizer or OPTIMIZER[args.model], row.checkpoint, args.fp8)
    batches = [s.batch.to("cuda") for s in steps]
    for i in warmup_order(steps, WARMUP):  # and every profiled step whose shapes would compile something new
        ours_step(model, update, batches[i])
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof, GpuClocks() as clocks:
        t0 = time.perf_counter()
        for batch in batches[WARMUP:]:
            ours_step(model, update, batch)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.steps * 1e3
    per_kind = {}
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if us and event.device_type == torch.autograd.DeviceType.CUDA:
            kind = kind_of(event.key)
            per_kind[kind] = per_kind.get(kind, 0.0) + us / 1e3 / args.steps
    with torch.device("meta"):
        meta = Llama(LlamaConfig(**preset))
    lengths = [s.lengths for s in steps[WARMUP:]]
    tokens = sum(int(n.sum()) for n in lengths) / args.steps
    flops = sum(meta.estimate_flops(n) for n in lengths) / args.steps
    gemm = 6 * meta.matmul_params() * tokens  # estimate_flops = this + the causal attention's FLOPs
    known = {"GEMM": gemm, "attention": flops - gemm}
    mfu = flops / wall * 1e3 / H200_PEAK_FLOPS
    print(f"{NAMES[args.model]}, row {row.key} ({row.label}{', fp8' if args.fp8 else ''}), {tokens:,.0f} tokens "
          f"per step, {args.steps} profiled steps: "
          f"{wall:.1f} ms per step (profiled), {tokens / wall * 1e3:,.0f} tok/s, MFU {mfu:.1%}")
    print(clocks)
    print(f"{'kind':<15}{'ms/step':>9}{'share':>8}{'TFLOP/s':>9}{'% spec':>8}{'% mm':>7}")
    busy = sum(per_kind.values())
    for kind, ms in sorted(per_kind.items(), key=lambda kv: -kv[1]) + [("idle", max(0.0, wall - busy))]:
        rate = known.get(kind, 0) / ms / 1e9 if kind in known and ms else None
        cols = f"{rate:9.0f}{rate * 1e12 / H200_PEAK_FLOPS:8.1%}{rate * 1e12 / H200_MATMUL_FLOPS:7.1%}" if rate else ""
        print(f"{kind:<15}{ms:9.1f}{ms / wall:8.1%}{cols}")
    kernels = sorted(((getattr(e, "device_time_total", 0) or 0, e.count, e.key) for e in prof.key_averages()
                      if e.device_type == torch.autograd.DeviceType.CUDA), reverse=True)
    listed = [("the 12 longest kernels", kernels[:12])]
    if args.list:
        listed.append((f"the 15 longest of kind {args.list}", [k for k in kernels if kind_of(k[2]) == args.list][:15]))
    for title, top in listed:
        print(f"{title} (ms per step, launches per step):")
        for us, count, name in top:
            print(f"  {us / 1e3 / args.steps:8.2f} {count / args.steps:6.0f}  {kind_of(name):<13} {name[:90]}")
    if args.gaps:
        print_gaps(prof, args.steps)


def idle_gaps(spans, steps):
    """The GPU's idle time between consecutive kernels, spans = sorted (start us, end us, name) of every kernel, as
    {(kind before, kind after): (ms per step, gaps per step)} and the same keyed by the two kernels' names. A gap
    starts where every kernel so far has ended (kernels on other streams may overlap)."""
    by_kind, by_name, end, before = {}, {}, None, None
    for start, stop, name in spans:
        if end is not None and start > end:
            for table, key in ((by_kind, (kind_of(before), kind_of(name))), (by_name, (before[:45], name[:45]))):
                ms, n = table.get(key, (0.0, 0))
                table[key] = (ms + (start - end) / 1e3 / steps, n + 1 / steps)
        if end is None or stop > end:
            end, before = stop, name
    return by_kind, by_name


def print_gaps(prof, steps):
    """Where the host launches late: the idle gaps summed by the kinds, then by the names, of the kernels around."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    for title, table in zip(("kinds", "kernels"), idle_gaps(spans, steps)):
        print(f"idle gaps by the {title} around them (ms per step, gaps per step):")
        for (a, b), (ms, n) in sorted(table.items(), key=lambda kv: -kv[1][0])[:10]:
            print(f"  {ms:8.2f} {n:6.0f}  {a} -> {b}")


if __name__ == "__main__":
    main()
