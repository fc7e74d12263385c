"""FP8 Linear (kernels/fp8.py) against bf16 at the Llama-3-8B block shapes: forward + backward times and TFLOP/s,
the quantizers' GB/s, and the error of each FP8 product. One H200, about a minute.

    python bench/fp8.py [--tokens 8192]

Shapes, the block's Linears as model.py has them (hidden 4096, 32 query / 8 kv heads of 128, ffn 14336): q and o
(4096 -> 4096), k and v (4096 -> 1024), gate and up (4096 -> 14336), down (14336 -> 4096; in the model its
product runs inside kernels.glu, here alone). "block" adds up one block's seven Linears (2 qo + 2 kv + 2 gate/up +
down): the time a block spends in its Linears, forward + backward.
Rows (medians of triton.testing.do_bench; x, W, dy random bf16: x, dy ~ N(0, 1), W ~ N(0, 0.02^2)):
  bf16         y = x W^T and its backward through autograd (dx = dy W, dW = dy^T x)
  fp8          kernels.fp8.fp8_linear forward + backward, every quantization included: the weight's codes are made
               in each call (its version is bumped before it), as at grad_accum=1 where every step changes W
  fp8 cached   the same with the weight's codes kept from call to call (micro-steps 2.. of a step, grad_accum > 1)
  fp8 gemms    the three torch._scaled_mm calls alone on codes made beforehand: fp8's ceiling without quantization
TFLOP/s counts 6 M N K for every row (three products of 2 M N K), whatever the precision.
Quantizers: quantize_rows / quantize_cols of the bf16 x (M, K) and dy (M, N); GB/s counts the bytes each must move
(read 2 bytes, write 1 per element, plus the fp32 scales); quantize_cols reads its input twice (column maxima, then
codes) but is counted once. The copy bandwidth measured in the same run is the ceiling.
Errors: ||out - ref|| / ||ref|| per product, against fp32 products of the same bf16 data, for fp8 and for bf16
(bf16 products round only their result), and fp8 against bf16.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `kernels`

import torch  # noqa: E402
from torch.autograd.graph import increment_version  # noqa: E402

from bench.common import copy_bandwidth_gbs, matmul_tflops, median_ms  # noqa: E402
from kernels import fp8  # noqa: E402

HIDDEN, FFN, Q_DIM, KV_DIM = 4096, 14336, 32 * 128, 8 * 128
SHAPES = [("q, o", HIDDEN, Q_DIM, 2), ("k, v", HIDDEN, KV_DIM, 2), ("gate, up", HIDDEN, FFN, 2), ("down", FFN, HIDDEN, 1)]


def rel(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def fp8_rowwise_tflops(n=8192):
    """The dense e4m3 product rate of torch._scaled_mm with row-wise scales, n x n x n: the FP8 ceiling."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    sa, sb = torch.ones(n, device="cuda"), torch.ones(n, device="cuda")
    return 2 * n**3 / median_ms(lambda: fp8.scaled_mm(a, sa, b, sb)) / 1e9


def measure(M, K, N, device="cuda", timer=median_ms):
    """One shape: {row: ms} of forward + backward, the quantizers' GB/s [rows(x), cols(x), rows(dy), cols(dy)], and
    per product (y, dx, dW) the relative errors (fp8 vs fp32, bf16 vs fp32, fp8 vs bf16). timer(fn) -> ms."""
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(N, K, device=device) * 0.02).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(M, N, device=device, dtype=torch.bfloat16)

    def bf16_step():
        torch.autograd.grad(x @ w.t(), (x, w), dy)

    def fp8_step(fresh):
        if fresh:
            increment_version(w)  # as an optimizer step does: the weight's codes are made again
        torch.autograd.grad(fp8.fp8_linear(x, w), (x, w), dy)

    with torch.no_grad():
        codes = (fp8.quantize_rows(x), fp8.quantize_rows(w), fp8.quantize_rows(dy), fp8.quantize_cols(w),
                 fp8.quantize_cols(dy), fp8.quantize_cols(x))

    def gemms():
        fp8.scaled_mm(*codes[0], *codes[1])
        fp8.scaled_mm(*codes[2], *codes[3])
        fp8.scaled_mm(*codes[4], *codes[5])

    times = {"bf16": timer(bf16_step), "fp8": timer(lambda: fp8_step(True)),
             "fp8 cached": timer(lambda: fp8_step(False)), "fp8 gemms": timer(gemms)}
    quant = []
    for t in (x.detach(), dy):
        for fn, n_scales in ((fp8.quantize_rows, t.shape[0]), (fp8.quantize_cols, t.shape[1])):
            quant.append((3 * t.numel() + 4 * n_scales) / timer(lambda: fn(t)) / 1e6)
    xf, wf, dyf = x.detach().float(), w.detach().float(), dy.float()
    exact = (xf @ wf.t(), dyf @ wf, dyf.t() @ xf)
    y = fp8.fp8_linear(x, w)
    ours = (y, *torch.autograd.grad(y, (x, w), dy))
    y = x @ w.t()
    bf16 = (y, *torch.autograd.grad(y, (x, w), dy))
    errors = [(rel(o, e), rel(b, e), rel(o, b.float())) for o, b, e in zip(ours, bf16, exact)]
    return times, quant, errors


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    M = parser.parse_args().tokens
    if not torch.cuda.is_available():
        sys.exit("bench/fp8.py needs a CUDA GPU")
    import triton
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  {M} tokens")
    copy_gbs = copy_bandwidth_gbs()
    print(f"ceilings: bf16 matmul {matmul_tflops():.0f} TFLOP/s, fp8 row-wise _scaled_mm {fp8_rowwise_tflops():.0f} "
          f"TFLOP/s (8192^3), copy {copy_gbs:.0f} GB/s")
    header = (f"{'shape':<10}{'K -> N':>13}  {'row':<11}{'f+b ms':>8}{'TFLOP/s':>9}{'speedup':>9}   "
              f"quantizer GB/s: rows(x) cols(x) rows(dy) cols(dy)")
    print(header + "\n" + "-" * len(header))
    block, errors = {}, []
    for name, K, N, count in SHAPES:
        times, quant, errs = measure(M, K, N)
        errors.append((name, errs))
        for i, (row, ms) in enumerate(times.items()):
            block[row] = block.get(row, 0.0) + count * ms
            first = i == 0
            print(f"{name if first else '':<10}{f'{K} -> {N}' if first else '':>13}  {row:<11}{ms:>8.3f}"
                  f"{6 * M * N * K / ms / 1e9:>9.0f}{times['bf16'] / ms:>8.2f}x"
                  + ("   " + "".join(f"{g:>8.0f}" for g in quant) if first else ""), flush=True)
        torch.cuda.empty_cache()
    block_flops = 6 * M * sum(count * N * K for _, K, N, count in SHAPES)
    for i, (row, ms) in enumerate(block.items()):
        print(f"{'block' if i == 0 else '':<10}{'7 Linears' if i == 0 else '':>13}  {row:<11}{ms:>8.3f}"
              f"{block_flops / ms / 1e9:>9.0f}{block['bf16'] / ms:>8.2f}x")
    print("\nrelative error vs fp32 products of the same bf16 data: fp8 / bf16 (fp8 vs bf16)")
    print(f"{'shape':<10}" + "".join(f"{p:>30}" for p in ("y = x W^T", "dx = dy W", "dW = dy^T x")))
    for name, errs in errors:
        print(f"{name:<10}" + "".join(f"{f'{a:.2e} / {b:.2e} ({c:.2e})':>30}" for a, b, c in errs))


if __name__ == "__main__":
    main()
