"""Benchmark: fused linear + cross-entropy (kernels/cross_entropy.py) against torch eager, torch.compile, Liger.

h (N, 4096) and W (V, 4096), every label counted; N in {4K, 16K, 64K}, V in {32000, 128256, 152064}.
Timed: forward + backward (the gradients of h and W) of the summed loss, in two settings:
  * bf16 h and W. Contenders: ours; torch eager = (h @ W.T).float() then F.cross_entropy (fp32 logits, the
    usual HF recipe); the same function under torch.compile (dynamic shapes: one compilation for all sizes);
    Liger-Kernel's LigerFusedLinearCrossEntropyLoss when it imports (it sums dW in bf16 by default: less
    precise than ours).
  * "fp32 W (autocast)": fp32 h and W under bf16 autocast, as train.py runs (fp32 master weights): ours and
    torch eager. The matmuls are bf16 there too; the gradients come back in fp32.
FLOPs: the three matmuls, 3 * 2 N H V; "% mm" compares with a bf16 matmul measured in this run.
"peak GB" is the peak memory of forward + backward above the inputs, the returned gradients included; "extra GB"
is that peak less the returned gradients ((N + V) * H values in the inputs' dtypes). For ours that is one chunk
of fp32 logits plus, with bf16 W and several chunks, the fp32 dW sum (V * H * 4 bytes), or with fp32 W the bf16
copy of W the matmuls take (V * H * 2 bytes). Eager and compile are skipped where their fp32 logits would pass
EAGER_MAX_LOGITS_GB or N > COMPILE_MAX_N (time), and any contender that runs out of memory says so.
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


def under_autocast(loss_fn):
    def run(h, w, labels):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return loss_fn(h, w, labels)
    return run


def contenders():
    """{input dtype: [(name, loss function, kind for skip_reason)]}."""
    compiled = torch.compile(torch_eager, dynamic=True)
    bf16 = [("ours", ours, None), ("torch eager", torch_eager, "eager"), ("torch.compile", compiled, "compile")]
    liger = liger_loss_fn()
    if liger is not None:
        bf16.append(("Liger", liger, None))
    fp32 = [("ours, fp32 W (autocast)", under_autocast(ours), None),
            ("torch eager, fp32 W (autocast)", under_autocast(torch_eager), "eager")]
    return {torch.bfloat16: bf16, torch.float32: fp32}


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


def make_inputs(n, v, dtype):
    h = torch.randn(n, H, device="cuda").to(dtype).requires_grad_()
    w = (torch.randn(v, H, device="cuda") * H**-0.5).to(dtype).requires_grad_()
    return h, w, torch.randint(0, v, (n,), device="cuda")


def main():
    only_vocabs = [int(a) for a in sys.argv[1:]]  # e.g. `python bench/cross_entropy.py 32000`: those vocabularies
    torch.manual_seed(0)
    mm_rate = matmul_tflops()
    runs = contenders()
    print(f"fused linear + cross-entropy, H = {H}, forward + backward; bf16 matmul here: {mm_rate:.0f} TFLOP/s; "
          f"our default logits budget {ce.LOGITS_CHUNK_BYTES / 2**30:.2f} GiB per chunk (less the bf16 copy of an "
          f"fp32 W and the fp32 dW sum of a bf16 W where they fit, but at least {ce.MIN_CHUNK_TOKENS} tokens, "
          f"{ce.MIN_CHUNK_TOKENS_FP8} with FP8 gradients)")
    print(f"{'N':>6} {'V':>7}  {'method':<30} {'ms':>8} {'TFLOP/s':>8} {'% mm':>5} {'peak GB':>8} {'extra GB':>9}")
    for n in TOKENS:
        for v in VOCABS:
            if only_vocabs and v not in only_vocabs:
                continue
            first = True
            for dtype, table in runs.items():
                h, w, labels = make_inputs(n, v, dtype)
                grads_gb = (h.numel() * h.element_size() + w.numel() * w.element_size()) / 1e9
                for name, loss_fn, kind in table:
                    head = f"{n:>6} {v:>7}" if first else " " * 14
                    first = False
                    reason = skip_reason(kind, n, v)
                    ms, peak, reason = (None, None, reason) if reason else measure(loss_fn, h, w, labels)
                    if ms is None:
                        print(f"{head}  {name:<30} {reason}", flush=True)
                        continue
                    tflops = 6 * n * H * v / ms / 1e9
                    print(f"{head}  {name:<30} {ms:>8.2f} {tflops:>8.0f} {tflops / mm_rate:>5.0%} {peak:>8.2f} "
                          f"{peak - grads_gb:>9.2f}", flush=True)
                del h, w, labels
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
