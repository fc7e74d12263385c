"""Benchmark: fused linear + cross-entropy (kernels/cross_entropy.py) against torch eager, torch.compile, Liger.

bf16 h (N, 4096) and W (V, 4096), every label counted; N in {4K, 16K, 64K}, V in {32000, 128256, 152064}.
Timed: forward + backward (the gradients of h and W) of the summed loss.
Contenders: ours; torch eager = (h @ W.T).float() then F.cross_entropy (fp32 logits, the usual HF recipe);
the same function under torch.compile (dynamic shapes: one compilation for all sizes); Liger-Kernel's
LigerFusedLinearCrossEntropyLoss when it imports (it sums dW in bf16 by default: less precise than ours).
FLOPs: the three matmuls, 3 * 2 N H V; "% mm" compares with a bf16 matmul measured in this run.
"peak GB" is the peak memory above the inputs, the two gradients included; "extra GB" is that peak less
the gradients ((N + V) * H bf16): for ours, one chunk of logits (LOGITS_CHUNK_BYTES) and, with several
chunks, the fp32 dW sum (V * H * 4 bytes). Eager and compile are skipped where their fp32 logits would pass EAGER_MAX_LOGITS_GB
or N > COMPILE_MAX_N (time), and any contender that runs out of memory says so.
"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import matmul_tflops, median_ms, peak_memory_gb, try_import_liger  # noqa: E402
from kernels import cross_entropy as ce  # noqa: E402

H = 4096
TOKENS = [4096, 16384, 65536]
VOCABS = [32000, 128256, 152064]
EAGER_MAX_LOGITS_GB = 40
COMPILE_MAX_N = 16384


def torch_eager(h, w, labels):
    return F.cross_entropy((h @ w.T).float(), labels, ignore_index=-100, reduction="sum")


def ours(h, w, labels):
    return ce.linear_cross_entropy(h, w, labels)[0]


def liger_loss_fn():
    if try_import_liger() is None:
        return None
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        loss_module = LigerFusedLinearCrossEntropyLoss(reduction="sum")
    except Exception as e:  # an API change
        print(f"[skip] Liger: {type(e).__name__}: {e}")
        return None

    def liger(h, w, labels):
        out = loss_module(w, h, labels)
        return out if torch.is_tensor(out) else out[0]  # some versions return (loss, extras...)
    return liger


def contenders():
    compiled = torch.compile(torch_eager, dynamic=True)
    table = [("ours", ours, None), ("torch eager", torch_eager, "eager"), ("torch.compile", compiled, "compile")]
    liger = liger_loss_fn()
    if liger is not None:
        table.append(("Liger", liger, None))
    return table


def skip_reason(kind, n, v):
    logits_gb = n * v * 4 / 1e9
    if kind in ("eager", "compile") and logits_gb > EAGER_MAX_LOGITS_GB:
        return f"skipped: fp32 logits {logits_gb:.0f} GB > {EAGER_MAX_LOGITS_GB}"
    if kind == "compile" and n > COMPILE_MAX_N:
        return f"skipped: N > {COMPILE_MAX_N} (keeps the run short)"
    return None


def measure(loss_fn, h, w, labels):
    """(ms, peak GB, None) of forward + backward, or (None, None, why not); the gradients are not kept."""
    def step():
        torch.autograd.grad(loss_fn(h, w, labels), (h, w))
    try:
        return median_ms(step), peak_memory_gb(step), None
    except torch.cuda.OutOfMemoryError:
        return None, None, "out of memory"
    except Exception as e:  # e.g. a torch.compile failure: report it and go on with the others
        return None, None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:60]}"
    finally:
        torch.cuda.empty_cache()


def main():
    torch.manual_seed(0)
    mm_rate = matmul_tflops()
    runs = contenders()
    print(f"fused linear + cross-entropy, bf16, H = {H}, forward + backward; bf16 matmul here: {mm_rate:.0f} "
          f"TFLOP/s; our logits budget {ce.LOGITS_CHUNK_BYTES / 2**30:.2f} GiB per chunk")
    print(f"{'N':>6} {'V':>7}  {'method':<14} {'ms':>8} {'TFLOP/s':>8} {'% mm':>5} {'peak GB':>8} {'extra GB':>9}")
    for n in TOKENS:
        for v in VOCABS:
            h = torch.randn(n, H, device="cuda", dtype=torch.bfloat16).requires_grad_()
            w = (torch.randn(v, H, device="cuda") * H**-0.5).to(torch.bfloat16).requires_grad_()
            labels = torch.randint(0, v, (n,), device="cuda")
            grads_gb = (n + v) * H * 2 / 1e9
            for i, (name, loss_fn, kind) in enumerate(runs):
                head = f"{n:>6} {v:>7}" if i == 0 else " " * 14
                reason = skip_reason(kind, n, v)
                ms, peak, reason = (None, None, reason) if reason else measure(loss_fn, h, w, labels)
                if ms is None:
                    print(f"{head}  {name:<14} {reason}", flush=True)
                    continue
                tflops = 6 * n * H * v / ms / 1e9
                print(f"{head}  {name:<14} {ms:>8.2f} {tflops:>8.0f} {tflops / mm_rate:>5.0%} {peak:>8.2f} "
                      f"{peak - grads_gb:>9.2f}", flush=True)
            del h, w, labels
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
