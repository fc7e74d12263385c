"""Which scales torch._scaled_mm runs fastest on the H200: row-wise against block scales (1 x 128 and 128 x 128,
cuBLAS), at the Llama-3-8B products' shapes, with each product's error against fp64. About 15 seconds.

    python bench/fp8_scalings.py

Columns (ms, medians of do_bench; a, b random, a's rows of varied size): bf16 a @ b^T; row = one scale per row of a
and of b; 1x128 = one per 128 elements along K for both operands; 1x128 x 128x128 = a per 1 x 128, b per 128 x 128
tile (kernels/fp8.py's recipe). Errors: ||out - exact|| / ||exact||. The last two rows have a K that is not a
multiple of 512 (wgrad over 8,112 or 8,128 tokens): row-wise scales slow down there, which kernels/fp8.py avoids
by padding every K to 512 (cuBLAS also misreads 128 x 128 scales when K is not a whole number of 4 blocks).
"""
import torch
from triton.testing import do_bench

F8, BF = torch.float8_e4m3fn, torch.bfloat16
SHAPES = [(8192, 4096, 4096, "q/o fwd"), (8192, 28672, 4096, "gate+up fwd"), (8192, 4096, 14336, "down fwd"),
          (8192, 1024, 4096, "k fwd"), (8192, 6144, 4096, "qkv fwd"), (4096, 4096, 8192, "q wgrad"),
          (14336, 4096, 8192, "gate wgrad"), (4096, 14336, 8192, "down wgrad"), (4096, 4096, 8112, "wgrad K=8112"),
          (4096, 4096, 8128, "wgrad K=8128")]


def rows(x):
    s = x.abs().amax(1, keepdim=True).clamp(min=1e-12) / 448
    return (x / s).clamp(-448, 448).to(F8), s


def blocks(x, block_rows):
    """Codes and scales of x (R, C) per block_rows x 128 block, scales laid out as torch._scaled_mm checks them."""
    R, C = x.shape
    Rp, Cp = -(-R // block_rows) * block_rows, -(-C // 128) * 128
    xp = torch.nn.functional.pad(x, (0, Cp - C, 0, Rp - R)).view(Rp // block_rows, block_rows, Cp // 128, 128)
    s = xp.abs().amax((1, 3), keepdim=True).clamp(min=1e-12) / 448
    codes = (xp / s).clamp(-448, 448).to(F8).view(Rp, Cp)[:R, :C].contiguous()
    s = s.view(Rp // block_rows, Cp // 128)
    return codes, (s.t().contiguous().t() if block_rows == 1 else s)  # 1 x 128: (R, K/128) with stride (1, R)


def main():
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'product':<14}{'M':>6}{'N':>6}{'K':>6}  {'bf16':>7}{'row':>7}{'1x128':>7}{'1x128 x 128x128':>17}   "
          f"error: row / 1x128 / 1x128 x 128x128 / bf16")
    for M, N, K, name in SHAPES:
        a = torch.randn(M, K, device="cuda") * (1 + 3 * torch.rand(M, 1, device="cuda"))
        b = torch.randn(N, K, device="cuda")
        exact = a.double() @ b.double().t()
        (ra, sa), (rb, sb) = rows(a), rows(b)
        (ba, bsa), (bb, bsb), (tb, tsb) = blocks(a, 1), blocks(b, 1), blocks(b, 128)
        runs = {"bf16": lambda: a.to(BF) @ b.to(BF).t(),
                "row": lambda: torch._scaled_mm(ra, rb.t(), scale_a=sa, scale_b=sb.t(), out_dtype=BF),
                "1x128": lambda: torch._scaled_mm(ba, bb.t(), scale_a=bsa, scale_b=bsb.t(), out_dtype=BF),
                "tile": lambda: torch._scaled_mm(ba, tb.t(), scale_a=bsa, scale_b=tsb.t(), out_dtype=BF)}
        ms = {k: do_bench(f) for k, f in runs.items()}
        err = {k: ((f().double() - exact).norm() / exact.norm()).item() for k, f in runs.items()}
        print(f"{name:<14}{M:>6}{N:>6}{K:>6}  {ms['bf16']:7.3f}{ms['row']:7.3f}{ms['1x128']:7.3f}{ms['tile']:17.3f}   "
              f"{err['row']:.2e} / {err['1x128']:.2e} / {err['tile']:.2e} / {err['bf16']:.2e}")


if __name__ == "__main__":
    main()
