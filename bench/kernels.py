"""Benchmark of the elementwise kernels at Llama-3-8B sizes: RMSNorm (hidden 4096), alone and fused with the residual
add before it (add_rms_norm, against the add and rms_norm as two ops), SwiGLU (ffn 14336) and RoPE (32 query / 8 kv
heads of 128), bf16, for T = 4K, 16K and 64K tokens.

Each is timed as forward, and forward + backward (bwd = the difference), against torch eager (the reference),
torch.compile of the reference, and Liger-Kernel when installed. GB/s counts the minimum bytes each pass must
move (every input read once, every output written once); "%copy" compares fwd+bwd with the device-to-device
copy bandwidth measured in the same run. Peak memory is what fwd+bwd allocates above its inputs.

    python bench/kernels.py [op ...]      # op: rms_norm, add_norm, glu, rope (all by default)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `kernels`

import torch  # noqa: E402
import triton  # noqa: E402

from bench.common import copy_bandwidth_gbs, median_ms, peak_memory_gb, try_import_liger  # noqa: E402
from kernels import reference  # noqa: E402
from kernels.rmsnorm import add_rms_norm, rms_norm  # noqa: E402
from kernels.rope import apply_rope  # noqa: E402
from kernels.swiglu import glu  # noqa: E402

HIDDEN, FFN, N_Q, N_KV, HEAD_DIM = 4096, 14336, 32, 8, 128
TOKENS = (4096, 16384, 65536)
DTYPE = torch.bfloat16
EPS = 1e-5
B = 2  # bytes per bf16 element


def packed_positions(T, mean_doc_len=1024):
    """Positions of T tokens packed from documents of random lengths: they restart at 0 at each document."""
    starts = torch.zeros(T, dtype=torch.bool)
    starts[torch.randint(0, T, (T // mean_doc_len,))] = True
    starts[0] = True
    token = torch.arange(T)
    doc_start = torch.where(starts, token, 0).cummax(0).values
    return (token - doc_start).to(torch.int32).cuda()


def liger_ops():
    """Liger's RMSNorm, SiLU-mul and RoPE Functions, each None (with a message) when not importable."""
    ops = {"rms_norm": None, "swiglu": None, "rope": None}
    if try_import_liger() is None:
        return ops
    for name, module, attr in (("rms_norm", "liger_kernel.ops.rms_norm", "LigerRMSNormFunction"),
                               ("swiglu", "liger_kernel.ops.swiglu", "LigerSiLUMulFunction"),
                               ("rope", "liger_kernel.ops.rope", "LigerRopeFunction")):
        try:
            ops[name] = getattr(__import__(module, fromlist=[attr]), attr)
        except Exception as e:
            print(f"[skip] liger {name}: {type(e).__name__}: {e}")
    return ops


def cases(T, cos, sin, compiled, liger):
    """Per op: (name, bytes fwd, bytes bwd, make_inputs() -> (inputs to differentiate, output grads),
    {impl: forward(*inputs)}). Every measurement gets fresh inputs from make_inputs: the in-place kernels
    (ours, Liger's) overwrite their inputs on each of do_bench's repeats, and SwiGLU's then shrink towards 0.
    The time of these elementwise kernels does not depend on the values, but the data stays random."""
    def randn(*shape, grad=True, activation=False):
        t = torch.randn(*shape, dtype=DTYPE, device="cuda", requires_grad=grad)
        t = t.clone() if activation else t  # a non-leaf, as a projection's output is
        torch._dynamo.maybe_mark_dynamic(t, 0)  # tokens vary: one torch.compile serves every T
        return t

    # RMSNorm: fwd reads x, writes y (+ one fp32 rstd per row); bwd reads x, dy, rstd, writes dx (w, dw: 1 row).
    # |w| = 1 (random signs) keeps dy's scale where an implementation writes dx over it repeat after repeat
    # (dx ~ P(w * dy), P a projection); weights around 1 would scale some elements by w^n towards 0 or inf.
    w = torch.randn(HIDDEN, device="cuda").sign().to(DTYPE).requires_grad_()
    norm_impls = {
        "triton": lambda x, w: rms_norm(x, w, EPS),
        "torch eager": lambda x, w: reference.rms_norm(x, w, EPS),
        "torch.compile": lambda x, w: compiled["rms_norm"](x, w, EPS),
    }
    if liger["rms_norm"]:
        norm_impls["liger"] = lambda x, w: liger["rms_norm"].apply(x, w, EPS)
    yield ("rms_norm", 2 * T * HIDDEN * B + 4 * T, 3 * T * HIDDEN * B + 4 * T + 2 * HIDDEN * B,
           lambda: ((randn(T, HIDDEN), w), (randn(T, HIDDEN, grad=False),)), norm_impls)

    # Residual add + RMSNorm, h = x + delta, y = rms_norm(h): fwd reads x, delta, writes h, y (+ rstd); bwd reads h,
    # dy, dh_out (+ rstd), writes dh (+ w, dw). "triton unfused" is the two ops a block ran before the fusion:
    # the same floor of bytes, so its GB/s shows how far from it the two passes are.
    def add_then(norm):
        def add_norm(x, delta, w):
            h = x + delta
            return h, norm(h, w, EPS)
        return add_norm

    add_norm_impls = {
        "triton": lambda x, d, w: add_rms_norm(x, d, w, EPS),
        "triton unfused": add_then(rms_norm),
        "torch eager": lambda x, d, w: reference.add_rms_norm(x, d, w, EPS),
        "torch.compile": lambda x, d, w: compiled["add_rms_norm"](x, d, w, EPS),
    }
    yield ("add_norm", 4 * T * HIDDEN * B + 4 * T, 4 * T * HIDDEN * B + 4 * T + 2 * HIDDEN * B,
           lambda: ((randn(T, HIDDEN), randn(T, HIDDEN), w),
                    (randn(T, HIDDEN, grad=False), randn(T, HIDDEN, grad=False))), add_norm_impls)

    # SwiGLU: fwd reads g, u, writes h; bwd reads g, u, dh, writes dg, du. g and u are activations (non-leaf),
    # as the model's projections give them, so our backward takes the in-place path.
    glu_impls = {
        "triton": lambda g, u: glu(g, u, "silu"),
        "torch eager": lambda g, u: reference.glu(g, u, "silu"),
        "torch.compile": lambda g, u: compiled["glu"](g, u, "silu"),
    }
    if liger["swiglu"]:
        glu_impls["liger"] = lambda g, u: liger["swiglu"].apply(g, u)
    yield ("swiglu", 3 * T * FFN * B, 5 * T * FFN * B,
           lambda: ((randn(T, FFN, activation=True), randn(T, FFN, activation=True)), (randn(T, FFN, grad=False),)),
           glu_impls)

    # RoPE: each pass reads and writes q and k once (+ positions; the cos/sin rows mostly hit in L2).
    positions = packed_positions(T)
    torch._dynamo.maybe_mark_dynamic(positions, 0)
    rope_impls = {
        "triton": lambda q, k: apply_rope(q, k, cos, sin, positions),
        "torch eager": lambda q, k: reference.apply_rope(q, k, cos, sin, positions),
        "torch.compile": lambda q, k: compiled["rope"](q, k, cos, sin, positions),
    }
    if liger["rope"]:
        # Liger takes (B, H, T, D) and cos/sin of the full head dim already gathered per token.
        cos_tok = torch.cat([cos, cos], -1)[positions.long()][None]
        sin_tok = torch.cat([sin, sin], -1)[positions.long()][None]

        def liger_rope(q, k):
            qo, ko = liger["rope"].apply(q[None].transpose(1, 2), k[None].transpose(1, 2), cos_tok, sin_tok)[:2]
            return qo.transpose(1, 2)[0], ko.transpose(1, 2)[0]
        rope_impls["liger"] = liger_rope
    qk_bytes = 2 * T * (N_Q + N_KV) * HEAD_DIM * B + 4 * T
    yield ("rope", qk_bytes, qk_bytes,
           lambda: ((randn(T, N_Q, HEAD_DIM), randn(T, N_KV, HEAD_DIM)),
                    (randn(T, N_Q, HEAD_DIM, grad=False), randn(T, N_KV, HEAD_DIM, grad=False))), rope_impls)


def measure(forward, make_inputs):
    """Median ms of the forward and of forward + backward, and the peak GB of forward + backward."""
    def fwd_and_bwd(inputs, grads):
        out = forward(*inputs)
        torch.autograd.grad(out if isinstance(out, tuple) else (out,), inputs, grads)

    inputs, grads = make_inputs()
    fwd_and_bwd(inputs, grads)  # compile / warm up
    fwd_ms = median_ms(lambda: forward(*inputs), warmup=5, rep=25)
    inputs, grads = make_inputs()
    total_ms = median_ms(lambda: fwd_and_bwd(inputs, grads), warmup=5, rep=25)
    inputs, grads = make_inputs()
    return fwd_ms, total_ms, peak_memory_gb(lambda: fwd_and_bwd(inputs, grads))


def main():
    torch.manual_seed(0)  # only to make the packing of documents repeatable between runs
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    copy_gbs = copy_bandwidth_gbs()
    print(f"copy bandwidth {copy_gbs:.0f} GB/s (read + write); bwd = (fwd+bwd) - fwd; bf16; "
          f"hidden {HIDDEN}, ffn {FFN}, heads {N_Q}/{N_KV} x {HEAD_DIM}")
    liger = liger_ops()
    compiled = {name: torch.compile(fn) for name, fn in
                (("rms_norm", reference.rms_norm), ("add_rms_norm", reference.add_rms_norm), ("glu", reference.glu),
                 ("rope", reference.apply_rope))}
    cos, sin = (t.cuda() for t in reference.rope_cache(HEAD_DIM, max(TOKENS), 500000.0))
    header = (f"{'op':<9}{'T':>6}  {'impl':<19}{'fwd ms':>8}{'bwd ms':>8}{'f+b ms':>8}"
              f"{'fwd GB/s':>10}{'bwd GB/s':>10}{'f+b %copy':>10}{'peak GB':>9}")
    print(header)
    print("-" * len(header))
    for T in TOKENS:
        for op, bytes_fwd, bytes_bwd, make_inputs, impls in cases(T, cos, sin, compiled, liger):
            if sys.argv[1:] and op not in sys.argv[1:]:
                continue
            for impl, forward in impls.items():
                try:
                    fwd_ms, total_ms, peak = measure(forward, make_inputs)
                except Exception as e:  # an optional competitor failing must not end the table
                    print(f"{op:<9}{T // 1024:>5}K  {impl:<19}[skip] {type(e).__name__}: {str(e)[:60]}")
                    continue
                bwd_ms = total_ms - fwd_ms
                pct = 100 * (bytes_fwd + bytes_bwd) / total_ms / 1e6 / copy_gbs
                print(f"{op:<9}{T // 1024:>5}K  {impl:<19}{fwd_ms:>8.3f}{bwd_ms:>8.3f}{total_ms:>8.3f}"
                      f"{bytes_fwd / fwd_ms / 1e6:>10.0f}{bytes_bwd / max(bwd_ms, 1e-6) / 1e6:>10.0f}"
                      f"{pct:>9.0f}%{peak:>9.2f}")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
