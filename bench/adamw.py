"""Benchmark of one AdamW step over a representative subset of Llama-3-8B's parameters: 4 matrices of 4096 x 14336
(the size of an MLP's gate, up and down projections) and the 128256 x 4096 embedding, 760M parameters (~9.5% of
the 8.03B; all of it would not fit next to the other rows). "8B ms" scales each row's time to the whole 8B.

Rows: our Triton kernels on bf16 weights with Kahan compensation, with fp32 moments (kernels/adamw.py) and with 8-bit
moments (kernels/adamw8bit.py), and kernels/adamw.py on fp32 weights; the reference per-parameter torch path
(kernels/reference.py, what the CPU runs) on bf16 weights, eager with either moments and through torch.compile;
torch.optim.AdamW(fused=True) on fp32 weights and on bf16 weights (torch then keeps the moments in bf16 too and
rounds tiny updates away: not the same optimizer, shown for speed only).

GB/s counts the bytes one step must move, every tensor read once and written once (B per parameter):
    bf16 + Kahan, fp32 moments:   read g, w, comp (2 each), m, v (4 each), write w, comp, m, v          = 14 + 12 = 26
    bf16 + Kahan, 8-bit moments:  read g, w, comp (2 each), the codes of m, v (1 each), write them all  = 8 + 6 = 14,
                                  + two fp32 scales read and written per block of 64 (16 / 64)                 = 14.25
    fp32 weights:                 read g, w, m, v (4 each), write w, m, v                                = 16 + 12 = 28
    torch fused, bf16 weights:    read g, w, m, v (2 each), write w, m, v                                  = 8 + 6 = 14
so the reference's GB/s is an effective rate (it really moves ~200 B per parameter). "%copy" compares with the
device-to-device copy bandwidth measured in the same run; "temp GB" is what one step allocates above its inputs.

    python bench/adamw.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `kernels`

import torch  # noqa: E402

from bench.common import copy_bandwidth_gbs, median_ms, peak_memory_gb  # noqa: E402
from kernels import reference  # noqa: E402
from kernels.adamw import adamw_step  # noqa: E402
from kernels.adamw8bit import adamw8bit_step  # noqa: E402

SHAPES = [(4096, 14336)] * 4 + [(128256, 4096)]
N_PARAMS = sum(r * c for r, c in SHAPES)
LLAMA3_8B_PARAMS = 8.03e9
HYPER = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
EIGHT_BIT_BYTES = 14 + 16 / reference.ADAMW8BIT_BLOCK  # per parameter, as above


def make_params(dtype):
    """Weights (init scale) and gradients, random: never zeros."""
    weights = [(0.02 * torch.randn(s, device="cuda")).to(dtype) for s in SHAPES]
    grads = [(1e-3 * torch.randn(s, device="cuda")).to(dtype) for s in SHAPES]
    return weights, grads


def fp32_moments(w):
    """(m, v) of w in fp32, random."""
    return torch.rand_like(w, dtype=torch.float32) * 1e-4, torch.rand_like(w, dtype=torch.float32) * 1e-7


def eight_bit_moments(w):
    """(m codes, m scales, sqrt(v) codes, sqrt(v) scales) of w as optim.AdamW8bit holds them, random."""
    blocks = -(-w.numel() // reference.ADAMW8BIT_BLOCK)
    m_codes = torch.randint(-127, 128, w.shape, dtype=torch.int8, device="cuda")
    v_codes = torch.randint(0, 256, w.shape, dtype=torch.uint8, device="cuda")
    return m_codes, torch.rand(blocks, device="cuda") * 1e-4, v_codes, torch.rand(blocks, device="cuda") * 1e-3


def our_step_fn(step_op, dtype, moments=fp32_moments):
    """One step over every parameter with step_op (ours or the reference's); the state as optim's Kahan AdamWs hold
    it (no compensation for fp32 weights)."""
    weights, grads = make_params(dtype)
    states = [moments(w) for w in weights]
    comps = [None if dtype == torch.float32 else (torch.randn_like(w, dtype=torch.float16) * 1e-6) for w in weights]

    def step():
        for w, g, state, c in zip(weights, grads, states, comps):
            step_op(w, g, *state, c, step=10, **HYPER)
    return step


def torch_fused_step_fn(dtype):
    weights, grads = make_params(dtype)
    for w, g in zip(weights, grads):
        w.grad = g
    opt = torch.optim.AdamW(weights, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            weight_decay=HYPER["weight_decay"], fused=True)
    opt.step()  # creates the state (random moments from the first step, not zeros)
    return opt.step


ROWS = [  # name, the step's builder, bytes per parameter
    ("ours bf16 + Kahan (Triton)", lambda: our_step_fn(adamw_step, torch.bfloat16), 26),
    ("ours bf16 + Kahan, 8-bit moments (Triton)",
     lambda: our_step_fn(adamw8bit_step, torch.bfloat16, eight_bit_moments), EIGHT_BIT_BYTES),
    ("ours fp32 (Triton)", lambda: our_step_fn(adamw_step, torch.float32), 28),
    ("reference torch ops bf16 + Kahan", lambda: our_step_fn(reference.adamw_step, torch.bfloat16), 26),
    ("reference torch ops, 8-bit moments",
     lambda: our_step_fn(reference.adamw8bit_step, torch.bfloat16, eight_bit_moments), EIGHT_BIT_BYTES),
    ("reference, torch.compile, bf16 + Kahan",
     lambda: our_step_fn(torch.compile(reference.adamw_step), torch.bfloat16), 26),
    ("torch AdamW fused, fp32 weights", lambda: torch_fused_step_fn(torch.float32), 28),
    ("torch AdamW fused, bf16 weights+state", lambda: torch_fused_step_fn(torch.bfloat16), 14),
]


def main():
    copy_gbs = copy_bandwidth_gbs()
    print(f"AdamW step over {N_PARAMS / 1e6:.0f}M parameters (4 x 4096x14336 + 128256x4096), "
          f"copy bandwidth {copy_gbs:.0f} GB/s")
    print(f"{'':42s} {'ms':>8s} {'GB/s':>7s} {'%copy':>6s} {'temp GB':>8s} {'8B ms':>7s}")
    for name, make, bytes_per_param in ROWS:
        try:
            step = make()
            step()  # compile / warm up
            ms = median_ms(step)
            temp_gb = peak_memory_gb(step)
        except Exception as e:  # one failing row (a torch.compile version clash, say) must not hide the others
            print(f"{name:42s} [skip] {type(e).__name__}: {str(e)[:80]}")
            step = None
            torch.cuda.empty_cache()
            continue
        gbs = bytes_per_param * N_PARAMS / ms / 1e6
        print(f"{name:42s} {ms:8.2f} {gbs:7.0f} {100 * gbs / copy_gbs:5.0f}% {temp_gb:8.2f} "
              f"{ms * LLAMA3_8B_PARAMS / N_PARAMS:7.0f}", flush=True)
        del step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
