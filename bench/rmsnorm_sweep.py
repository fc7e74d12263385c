"""Tuning sweep for kernels/rmsnorm.py (GPU): forward warps, and backward programs-per-SM x warps, kernel-only; each
for rms_norm alone and fused with the residual add (add=True: 4 bytes moved per element, not 2 / 3).

    python bench/rmsnorm_sweep.py

Prints each variant's median time and its share of the copy bandwidth measured in the same run; the choices in
kernels/rmsnorm.py (_num_warps, _backward_programs) come from this (BENCHMARKS.md).
"""
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kernels.rmsnorm as R  # noqa: E402
from bench.common import copy_bandwidth_gbs, median_ms  # noqa: E402

H, BLOCK, EPS = 4096, 4096, 1e-5


def main():
    bw = copy_bandwidth_gbs()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"copy {bw:.0f} GB/s, {sms} SMs, hidden {H}, bf16")
    for T in (16384, 65536):
        x, d, dy, dh_out = (torch.randn(T, H, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        w = torch.randn(H, device="cuda", dtype=torch.bfloat16)
        y, h, dx, rstd = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x), torch.empty(T, device="cuda")
        for add in (False, True):
            moved = (4, 4) if add else (2, 3)  # elements per row element, fwd and bwd
            for warps in (4, 8, 16, 32):
                ms = median_ms(lambda: R._rms_norm_fwd_kernel[(T,)](x, d, h, y, w, rstd, H, H, H, H, EPS, ADD=add,
                                                                    BLOCK=BLOCK, num_warps=warps))
                print(f"fwd add={add} T={T} warps={warps}: {ms * 1e3:.0f} us  "
                      f"{moved[0] * T * H * 2 / ms / 1e6 / bw:.0%} of copy")
            for per_sm in (1, 2, 4, 8, 16):
                rows_per_program = triton.cdiv(T, min(T, per_sm * sms))
                n = triton.cdiv(T, rows_per_program)
                partial = torch.empty(n, H, device="cuda")
                for warps in (4, 8, 16, 32):
                    def bwd():
                        R._rms_norm_bwd_kernel[(n,)](x, w, rstd, dy, dh_out, dx, partial, H, H, H, H, T, H,
                                                     rows_per_program, ADD=add, BLOCK=BLOCK, num_warps=warps)
                        partial.sum(0)
                    ms = median_ms(bwd)
                    print(f"bwd add={add} T={T} programs/SM={per_sm} warps={warps}: {ms * 1e3:.0f} us  "
                          f"{moved[1] * T * H * 2 / ms / 1e6 / bw:.0%} of copy")


if __name__ == "__main__":
    main()
