"""Benchmark: where the time of one training step goes, by kind of GPU kernel (torch.profiler).

    python bench/profile_step.py [--model 8b|1b] [--row doc8k|free|doc8k_8bit|free_8bit] [--steps 3] [--fp8]
                                 [--list KIND] [--gaps]

Builds bench/e2e.py's row on the Llama-3-8B shape (random init, bf16 weights, the optimizer stepped inside backward,
as the 8B config trains) or on the Llama-3.2-1B shape (--model 1b, row free: fp32 weights under autocast, our fused
AdamW after backward, as the 1B config trains), warms up, then profiles --steps steps and sums the CUDA kernels' time
by kind: GEMMs (cuBLAS: the Linears, the lm_head inside the fused cross-entropy), attention (our forward, dK/dV and
dQ kernels), cross-entropy, RMSNorm, GLU, RoPE, the optimizer, FP8 quantization (--fp8: the block Linears in FP8,
their GEMMs counted with the others), and the rest (elementwise ops, copies, reductions, gradient-norm sums). Each
kind's time is a ceiling on what a faster kernel of that kind can win: halving it saves half. Also the measured FLOPs
of the kind where they are known (the model's matmul FLOPs for GEMMs, the causal attention FLOPs for attention)
against the H200's spec peak (989 TFLOP/s) and its measured matmul rate (790).

"idle" is the step's wall time minus all kernel time: the GPU waiting for the host (launches, Python, hooks, syncs).
--gaps says where: the idle time summed by the kernels on either side of each gap, and for the longest gaps the host
ops that ran during them (recording the host's ops slows it a little: take the step time from a run without --gaps).
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
    parser.add_argument("--gaps", action="store_true",
                        help="also sum the idle gaps by the kernels around them, and name the host ops in them")
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
    activities = [torch.profiler.ProfilerActivity.CUDA] + ([torch.profiler.ProfilerActivity.CPU] if args.gaps else [])
    with torch.profiler.profile(activities=activities) as prof, GpuClocks() as clocks:
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


def gaps_of(spans):
    """The GPU's idle gaps, spans = sorted (start us, end us, name) of every kernel: (start, end, kernel before,
    kernel after) for each. A gap starts where every kernel so far has ended (kernels on other streams may
    overlap), and is named by the kernel that ended last."""
    end, before = None, None
    for start, stop, name in spans:
        if end is not None and start > end:
            yield end, start, before, name
        if end is None or stop > end:
            end, before = stop, name


def idle_gaps(spans, steps):
    """The idle gaps summed as {(kind before, kind after): (ms per step, gaps per step)} and the same keyed by the
    two kernels' names."""
    by_kind, by_name = {}, {}
    for start, end, before, after in gaps_of(spans):
        for table, key in ((by_kind, (kind_of(before), kind_of(after))), (by_name, (before[:45], after[:45]))):
            ms, n = table.get(key, (0.0, 0))
            table[key] = (ms + (end - start) / 1e3 / steps, n + 1 / steps)
    return by_kind, by_name


def host_during_gaps(spans, host_spans, steps, pairs):
    """What the host was doing while the GPU sat idle: for each (kernel before, kernel after) pair of names in
    pairs, {host op: ms per step} of the host ops' (host_spans: (start us, end us, name)) time inside those gaps.
    Nested ops each count (an op and the runtime call inside it), so a gap spent in one call shows as that call
    and every op around it, each with the gap's whole length. One sweep: the gaps come in time order, so an op
    that ended before one gap overlaps no later gap."""
    found = {pair: {} for pair in pairs}
    host_spans, next_op, open_ops = sorted(host_spans), 0, []
    for start, end, before, after in gaps_of(spans):
        while next_op < len(host_spans) and host_spans[next_op][0] < end:
            open_ops.append(host_spans[next_op])
            next_op += 1
        open_ops = [op for op in open_ops if op[1] > start]
        inside = found.get((before[:45], after[:45]))
        for op_start, op_end, name in open_ops if inside is not None else ():
            overlap = min(end, op_end) - max(start, op_start)
            inside[name] = inside.get(name, 0.0) + overlap / 1e3 / steps
    return found


def print_gaps(prof, steps):
    """Where the host launches late: the idle gaps summed by the kinds, then by the names, of the kernels around,
    and for the longest, the host ops that ran during them (the profile recorded the host's ops too)."""
    spans, host_spans = [], []
    for e in prof.events():
        if e.time_range.end <= e.time_range.start:
            continue
        if e.device_type == torch.autograd.DeviceType.CUDA:
            spans.append((e.time_range.start, e.time_range.end, e.name))
        elif e.device_type == torch.autograd.DeviceType.CPU and not e.is_async:
            host_spans.append((e.time_range.start, e.time_range.end, e.name))
    spans.sort()
    tables = idle_gaps(spans, steps)
    for title, table in zip(("kinds", "kernels"), tables):
        print(f"idle gaps by the {title} around them (ms per step, gaps per step):")
        for (a, b), (ms, n) in sorted(table.items(), key=lambda kv: -kv[1][0])[:10]:
            print(f"  {ms:8.2f} {n:6.0f}  {a} -> {b}")
    longest = [pair for pair, _ in sorted(tables[1].items(), key=lambda kv: -kv[1][0])[:4]]
    print("the host during the 4 longest of those (ms per step inside the gaps; nested ops each count):")
    for (a, b), inside in host_during_gaps(spans, host_spans, steps, longest).items():
        print(f"  {a} -> {b}:")
        for name, ms in sorted(inside.items(), key=lambda kv: -kv[1])[:8]:
            print(f"    {ms:8.2f}  {name[:100]}")


if __name__ == "__main__":
    main()
