"""FP8 Linears (kernels/fp8.py) against bf16 at the Llama-3-8B block shapes: forward + backward times and TFLOP/s,
the quantizer's GB/s, and the error of each FP8 product. One H200, about a minute.

    python bench/fp8.py [--tokens 8192] [--warps]

Shapes, the block's Linears grouped as model.py calls them (hidden 4096, 32 query / 8 kv heads of 128, ffn 14336):
q, k, v share one input (4096 -> 4096, 1024, 1024), o (4096 -> 4096), gate and up share one (4096 -> 14336 x 2),
down (14336 -> 4096; in the model its product runs inside kernels.glu, here alone). "block" adds them up: the time
a block spends in its Linears, forward + backward.
Rows (medians of triton.testing.do_bench; x, W, dy random bf16: x, dy ~ N(0, 1), W ~ N(0, 0.02^2)):
  bf16         ys = x W^T through autograd (dx = sum dy W, dW = dy^T x)
  fp8          kernels.fp8.fp8_linears forward + backward, every quantization included (x's both ways once, each
               dy both ways, each W once per layout: as in training, where every step changes W)
  fp8 gemms    the torch._scaled_mm calls alone on codes made beforehand: fp8's ceiling without quantization
TFLOP/s counts 6 M N K for every row (three products of 2 M N K), whatever the precision.
Quantizer: fp8.quantize of x (M, K) and of the first dy (M, N), both layouts (as x's); GB/s counts the 4 bytes
per element it moves (bf16 read once, two codes written; the scales are 1/32 more). The copy bandwidth measured
in the same run is the ceiling. --warps: instead, the quantizers' GB/s per num_warps (warps() says which tensors).
MLP: one block's whole MLP as model.py runs it (measure_mlp), bf16 and FP8.
Errors: ||out - ref|| / ||ref|| per product of the first Linear of a group, against fp32 products of the same bf16
data, for fp8 and for bf16 (bf16 products round only their result), and fp8 against bf16.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `kernels`

import torch  # noqa: E402

from bench.common import copy_bandwidth_gbs, matmul_tflops, median_ms  # noqa: E402
from kernels import fp8  # noqa: E402

HIDDEN, FFN, Q_DIM, KV_DIM = 4096, 14336, 32 * 128, 8 * 128
SHAPES = [("q, k, v", HIDDEN, (Q_DIM, KV_DIM, KV_DIM)), ("o", Q_DIM, (HIDDEN,)), ("gate, up", HIDDEN, (FFN, FFN)),
          ("down", FFN, (HIDDEN,))]


def rel(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def fp8_block_tflops(n=8192):
    """The dense e4m3 product rate of torch._scaled_mm with our block scales (1 x 128 by 128 x 128), n x n x n: the
    FP8 ceiling."""
    a = fp8.quantize(torch.randn(n, n, device="cuda"), rows=1)[0]
    b = fp8.quantize(torch.randn(n, n, device="cuda"), rows=128)[0]
    return 2 * n**3 / median_ms(lambda: fp8.scaled_mm(*a, *b)) / 1e9


def measure(M, K, Ns, device="cuda", timer=median_ms):
    """One group of Linears sharing x (M, K): {row: ms} of forward + backward, the quantizer's GB/s [x, dy], and per
    product (y, dx, dW) of the first Linear the relative errors (fp8 vs fp32, bf16 vs fp32, fp8 vs bf16)."""
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16, requires_grad=True)
    ws = [(torch.randn(N, K, device=device) * 0.02).to(torch.bfloat16).requires_grad_() for N in Ns]
    dys = [torch.randn(M, N, device=device, dtype=torch.bfloat16) for N in Ns]

    def bf16_step():
        torch.autograd.grad([x @ w.t() for w in ws], (x, *ws), dys)

    def fp8_step():
        torch.autograd.grad(fp8.fp8_linears(x, ws), (x, *ws), dys)

    with torch.no_grad():
        x_rows, x_cols = fp8.quantize(x, rows=1, cols=128)
        codes = [((fp8.quantize(w, rows=128)[0], fp8.quantize(w, cols=128)[1]), fp8.quantize(dy, 1, 1))
                 for w, dy in zip(ws, dys)]

    def gemms():
        for (w_rows, w_cols), (dy_rows, dy_cols) in codes:
            fp8.scaled_mm(*x_rows, *w_rows)
            fp8.scaled_mm(*dy_rows, *w_cols)
            fp8.scaled_mm(*dy_cols, *x_cols)

    times = {"bf16": timer(bf16_step), "fp8": timer(fp8_step), "fp8 gemms": timer(gemms)}
    quant = [4 * t.numel() / timer(lambda: fp8.quantize(t, 1, 128)) / 1e6 for t in (x.detach(), dys[0])]
    w, dy = ws[0], dys[0]
    xf, wf, dyf = x.detach().float(), w.detach().float(), dy.float()
    exact = (xf @ wf.t(), dyf @ wf, dyf.t() @ xf)
    y = fp8.fp8_linears(x, [w])[0]
    ours = (y, *torch.autograd.grad(y, (x, w), dy))
    y = x @ w.t()
    bf16 = (y, *torch.autograd.grad(y, (x, w), dy))
    errors = [(rel(o, e), rel(b, e), rel(o, b.float())) for o, b, e in zip(ours, bf16, exact)]
    return times, quant, errors


def measure_mlp(M, device="cuda", timer=median_ms, hidden=HIDDEN, ffn=FFN):
    """One 8B block's MLP as model.py runs it, forward + backward, {row: ms}: bf16 (gate/up Linears, the GLU kernel
    with the down product fused) and fp8 (fp8_linears for gate/up, the GLU's FP8 down product, h quantized by the
    GLU kernel as it makes it)."""
    from kernels.swiglu import glu
    x = torch.randn(M, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    ws = [(torch.randn(*shape, device=device) * 0.02).to(torch.bfloat16).requires_grad_()
          for shape in ((ffn, hidden), (ffn, hidden), (hidden, ffn))]
    dout = torch.randn(M, hidden, device=device, dtype=torch.bfloat16)

    def bf16_mlp(x, w_gate, w_up, w_down):
        return glu(x @ w_gate.t(), x @ w_up.t(), "silu", down=w_down)

    def fp8_mlp(x, w_gate, w_up, w_down):
        return glu(*fp8.fp8_linears(x, [w_gate, w_up]), "silu", down=w_down, use_fp8=True)

    def step(mlp):  # (x * 1: a non-leaf input, as the norm's output in the model)
        return lambda: torch.autograd.grad(mlp(x * 1, *ws), (x, *ws), dout)
    return {"bf16": timer(step(bf16_mlp)), "fp8": timer(step(fp8_mlp))}


def warps(M):
    """GB/s per num_warps (bytes read and written per element: bf16 2, a code 1): fp8.quantize for the layouts the
    products use (x (tokens x 4096) rows 1 x 128 + x^T 128 x 128, dy (tokens x 14336) both 1 x 128, W (14336 x 4096)
    128 x 128 one layout), and the GLU kernel quantizing h as it makes it from g and u (h's rows 1 x 128, or h^T
    128 x 128). Returns the fastest num_warps of each kernel over its cases."""
    from kernels import swiglu
    x = torch.randn(M, HIDDEN, device="cuda", dtype=torch.bfloat16)
    g, u = (torch.randn(M, FFN, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(FFN, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    kernels = [(fp8, [("x 1+128", x, 4, lambda: fp8.quantize(x, 1, 128)),
                      ("dy 1+1", g, 4, lambda: fp8.quantize(g, 1, 1)),
                      ("W rows", w, 3, lambda: fp8.quantize(w, rows=128)),
                      ("W^T", w, 3, lambda: fp8.quantize(w, cols=128))]),
               (swiglu, [("h rows", g, 5, lambda: swiglu._glu_codes(g, u, "silu", rows=1)),
                         ("h^T", g, 5, lambda: swiglu._glu_codes(g, u, "silu", cols=128))])]
    bests = []
    for module, cases in kernels:
        print(f"{module.__name__ + ' warps':<22}" + "".join(f"{name:>10}" for name, *_ in cases))
        best = (float("inf"), module.WARPS)
        for n in (4, 8, 16):
            module.WARPS = n
            ms = [median_ms(fn) for *_, fn in cases]
            print(f"{n:<22}" + "".join(f"{b * t.numel() / m / 1e6:>10.0f}" for (_, t, b, _), m in zip(cases, ms)),
                  flush=True)
            best = min(best, (sum(ms), n))
        module.WARPS = best[1]
        bests.append(best[1])
    h = swiglu._glu_h(g, u, "silu")
    for name, rows, cols in (("h rows", 1, 0), ("h^T", 0, 128)):
        apart = median_ms(lambda: swiglu._glu_h(g, u, "silu")) + median_ms(lambda: fp8.quantize(h, rows, cols))
        print(f"{name}: the GLU kernel storing h, then fp8.quantize(h) {apart:.3f} ms; made in one kernel "
              f"{median_ms(lambda: swiglu._glu_codes(g, u, 'silu', rows, cols)):.3f} ms")
    return bests


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--warps", action="store_true", help="the quantizer's GB/s per num_warps, nothing else")
    args = parser.parse_args()
    M = args.tokens
    if not torch.cuda.is_available():
        sys.exit("bench/fp8.py needs a CUDA GPU")
    import triton
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  {M} tokens")
    copy_gbs = copy_bandwidth_gbs()
    if args.warps:
        print(f"copy {copy_gbs:.0f} GB/s")
        return print("fastest: fp8.WARPS = {}, swiglu.WARPS = {}".format(*warps(M)))
    print(f"ceilings: bf16 matmul {matmul_tflops():.0f} TFLOP/s, fp8 block-scaled _scaled_mm {fp8_block_tflops():.0f} "
          f"TFLOP/s (8192^3), copy {copy_gbs:.0f} GB/s")
    header = (f"{'shape':<10}{'K -> N':>24}  {'row':<11}{'f+b ms':>8}{'TFLOP/s':>9}{'speedup':>9}   "
              f"quantizer GB/s: x, dy")
    print(header + "\n" + "-" * len(header))
    block, errors = {}, []
    for name, K, Ns in SHAPES:
        times, quant, errs = measure(M, K, Ns)
        errors.append((name, errs))
        for i, (row, ms) in enumerate(times.items()):
            block[row] = block.get(row, 0.0) + ms
            first = i == 0
            shape = f"{K} -> {', '.join(map(str, Ns))}"
            print(f"{name if first else '':<10}{shape if first else '':>24}  {row:<11}{ms:>8.3f}"
                  f"{6 * M * sum(Ns) * K / ms / 1e9:>9.0f}{times['bf16'] / ms:>8.2f}x"
                  + ("   " + "".join(f"{g:>8.0f}" for g in quant) if first else ""), flush=True)
        torch.cuda.empty_cache()
    block_flops = 6 * M * sum(sum(Ns) * K for _, K, Ns in SHAPES)
    for i, (row, ms) in enumerate(block.items()):
        print(f"{'block' if i == 0 else '':<10}{'7 Linears' if i == 0 else '':>24}  {row:<11}{ms:>8.3f}"
              f"{block_flops / ms / 1e9:>9.0f}{block['bf16'] / ms:>8.2f}x")
    mlp_flops = 6 * M * 3 * FFN * HIDDEN
    print(f"\nMLP (gate, up, GLU, down), forward + backward, {M} tokens:")
    for row, ms in (mlp := measure_mlp(M)).items():
        print(f"  {row:<10}{ms:>8.3f} ms{mlp_flops / ms / 1e9:>7.0f} TFLOP/s{mlp['bf16'] / ms:>7.2f}x", flush=True)
    print("\nrelative error vs fp32 products of the same bf16 data: fp8 / bf16 (fp8 vs bf16)")
    print(f"{'shape':<10}" + "".join(f"{p:>30}" for p in ("y = x W^T", "dx = dy W", "dW = dy^T x")))
    for name, errs in errors:
        print(f"{name:<10}" + "".join(f"{f'{a:.2e} / {b:.2e} ({c:.2e})':>30}" for a, b, c in errs))


if __name__ == "__main__":
    main()
