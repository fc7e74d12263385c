"""One AdamW step of one parameter whose Adam moments are stored in 8 bits, in a single Triton kernel.

Why (optim.AdamW8bit): fp32 moments are 8 of the 16 bytes per parameter of bf16 + Kahan AdamW; here they take 2.
The flat tensor is cut into blocks of QBLOCK = 256 elements (the last may be short); per block and per element
    exp_avg_scale    = max |m|,        exp_avg    (int8)  = sign(m) * round(127 * (|m| / exp_avg_scale)^(1/4))
    exp_avg_sq_scale = max sqrt(v),    exp_avg_sq (uint8) = round(255 * (sqrt(v) / exp_avg_sq_scale)^(1/4))
decoded as m = sign * scale * (|code| / 127)^4, sqrt(v) = scale * (code / 255)^4 (round(x) = floor(x + 0.5); an
all-zero block has scale 0). sqrt(v) is stored, not v: it has the scale of m and |g|, and the update divides by it.
The power p = 4 (M_POWER, S_POWER) spends the codes where Adam needs them: m / sqrt(v) is about as large for small
gradients as for large ones, so small elements need relative precision. A value at a fraction a of its block's max
keeps a relative error below p / (2 * top * a^(1/p)): for m 1.6% at a = 1, 5% at 1e-2, 16% at 1e-4; 0 below 2e-10.
Measured (bench/adamw8bit_codes.py, BENCHMARKS.md) on a small Llama's moments after 300 steps: the Adam direction is
off by 1.5% from coding m and 0.75% from coding sqrt(v) with p = 4; 1.6% / 0.9% with p = 2, which is better early on
but 4.6 times worse once the scales in a block spread log-normally by 2; 2.0% / 1.6% with the dynamic map of
Dettmers et al. (bitsandbytes: a table, coding needs a search); 5.8% / 2.6% linear. After 300 teacher-forced steps
the weights are 4.6% off the fp32-moment path with blocks of 256, 4.2% with 64 (4x the scales: 1 GB for 8B), 5.8%
with 2048. Two exact square roots (sqrt_rn) code it, two squarings decode it: no table, no search.
The guard: a nonzero sqrt(v) never gets code 0 but the smallest level, above its true value. Without it an element
whose sqrt(v) is below half that level (1.5e-11 of its block's max: tests/test_optim8bit.py builds one) while its m,
coded with its own block's max, is not, would step by lr * m_hat / eps, orders of magnitude beyond lr.
A step, per element, in fp32: decode m and s = sqrt(v); kernels/adamw.py's update (its jit helpers) from m, s * s
and g, with the Kahan-compensated weight; s = sqrt(new v); then each block's new max, a reduction along a row of
the program's (ROWS, QBLOCK) tile in registers, and the new codes. Each tensor is read and written once: g, w, comp
(2 bytes each) and the codes (1 each) in, w, comp, codes out: 14 bytes per bf16 parameter (+16 per block for the
scales), 26 with fp32 moments. Parity: codes are exact functions of fp32 values (IEEE div_rn, sqrt_rn), so the
interpreter matches kernels/reference.py wherever the fp32 update does (nearly everywhere: kernels/adamw.py);
compiled, Triton fuses some products into sums: a code moves by one step now and then. No atomics: deterministic.
"""
import torch
import triton
import triton.language as tl
from torch.autograd.graph import increment_version

from .adamw import _adam_direction, _adam_moments, _weight_update
from .reference import ADAMW8BIT_BLOCK, ADAMW8BIT_M_POWER, ADAMW8BIT_S_POWER

QBLOCK = ADAMW8BIT_BLOCK
# Blocks per program: ROWS * QBLOCK = 2048 elements per program and 8 warps, as kernels/adamw.py (8 elements per
# thread: a 16-byte load of each bf16 tensor, 8 bytes of each code).
ROWS = 2048 // QBLOCK
NUM_WARPS = 8


@triton.jit
def _encode(a, TOP: tl.constexpr, POWER: tl.constexpr):
    """round(TOP * a^(1 / POWER)) as int32, for a in [0, 1] (POWER 1, 2 or 4)."""
    if POWER >= 2:
        a = tl.sqrt_rn(a)
    if POWER == 4:
        a = tl.sqrt_rn(a)
    return (a * TOP + 0.5).to(tl.int32)  # truncation: floor, as a * TOP + 0.5 >= 0


@triton.jit
def _decode(code, TOP: tl.constexpr, POWER: tl.constexpr):
    """(code / TOP)^POWER in fp32, for an int32 code in [0, TOP]."""
    x = tl.math.div_rn(code.to(tl.float32), TOP)
    if POWER >= 2:
        x = x * x
    if POWER == 4:
        x = x * x
    return x


@triton.jit
def _adamw8bit_kernel(P, G, C, M, M_SCALE, S, S_SCALE, n, n_blocks, one_minus_beta1, beta2, one_minus_beta2, eps,
                      neg_step_size, bc2_sqrt, decay, neg_lr_wd, HAS_COMP: tl.constexpr, M_POWER: tl.constexpr,
                      S_POWER: tl.constexpr, QBLOCK: tl.constexpr, ROWS: tl.constexpr):
    # The program's ROWS blocks as rows of a (ROWS, QBLOCK) tile; int64: a tensor may hold 2^31 elements or more.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
    mask = offs < n
    row_mask = rows < n_blocks
    w = tl.load(P + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    m_code = tl.load(M + offs, mask=mask, other=0).to(tl.int32)
    s_code = tl.load(S + offs, mask=mask, other=0).to(tl.int32)
    m_scale = tl.load(M_SCALE + rows, mask=row_mask, other=0.0)
    s_scale = tl.load(S_SCALE + rows, mask=row_mask, other=0.0)
    c = w  # (unused without comp)
    if HAS_COMP:
        c = tl.load(C + offs, mask=mask, other=0.0).to(tl.float32)

    m = _decode(tl.abs(m_code), 127, M_POWER) * m_scale[:, None]
    m = tl.where(m_code < 0, -m, m)
    s = _decode(s_code, 255, S_POWER) * s_scale[:, None]
    m, v = _adam_moments(g, m, s * s, one_minus_beta1, beta2, one_minus_beta2)
    s = tl.sqrt_rn(v)
    adam = _adam_direction(m, s, neg_step_size, bc2_sqrt, eps)
    new_w, c = _weight_update(P, w, c, adam, decay, neg_lr_wd, HAS_COMP)
    tl.store(P + offs, new_w.to(P.dtype.element_ty), mask=mask)
    if HAS_COMP:
        tl.store(C + offs, c.to(tl.float16), mask=mask)

    # New codes: the elements outside the tensor are 0 (g, m and v loaded as 0), so they change no block's max.
    m_abs = tl.abs(m)
    m_max = tl.max(m_abs, axis=1)
    s_max = tl.max(s, axis=1)
    m_code = _encode(tl.math.div_rn(m_abs, tl.where(m_max > 0, m_max, 1.0)[:, None]), 127, M_POWER)
    s_code = _encode(tl.math.div_rn(s, tl.where(s_max > 0, s_max, 1.0)[:, None]), 255, S_POWER)
    s_code = tl.where((s_code == 0) & (s > 0), 1, s_code)  # the guard: a nonzero sqrt(v) stays nonzero
    tl.store(M + offs, tl.where(m < 0, -m_code, m_code).to(tl.int8), mask=mask)
    tl.store(S + offs, s_code.to(tl.uint8), mask=mask)
    tl.store(M_SCALE + rows, m_max, mask=row_mask)
    tl.store(S_SCALE + rows, s_max, mask=row_mask)


def adamw8bit_step(p, grad, exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale, comp, lr, beta1, beta2, eps,
                   weight_decay, step):
    """One AdamW step of one parameter with 8-bit moments, in place on p, the codes, the scales and comp; the
    signature and contract of kernels/reference.adamw8bit_step (comp: fp16 for bf16 / fp16 p, None for fp32 p)."""
    assert p.dtype in (torch.float32, torch.bfloat16, torch.float16), \
        f"adamw8bit_step: unsupported weight dtype {p.dtype}"
    assert grad.dtype in (p.dtype, torch.float32), f"adamw8bit_step: gradient {grad.dtype} for a {p.dtype} weight"
    assert exp_avg.dtype == torch.int8 and exp_avg_sq.dtype == torch.uint8, \
        f"adamw8bit_step: the codes must be int8 / uint8, not {exp_avg.dtype} / {exp_avg_sq.dtype}"
    assert (comp is None) == (p.dtype == torch.float32), \
        f"adamw8bit_step: comp (fp16) goes with bf16 / fp16 weights only (weight {p.dtype}, comp " \
        f"{comp is not None}); stochastic rounding (no comp) runs on the reference only"
    assert comp is None or comp.dtype == torch.float16, f"adamw8bit_step: comp must be fp16, not {comp.dtype}"
    named = {name: t for name, t in dict(p=p, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, comp=comp).items()
             if t is not None}
    assert all(t.shape == p.shape for t in named.values()), \
        f"adamw8bit_step: shapes differ: {', '.join(f'{n} {tuple(t.shape)}' for n, t in named.items())}"
    assert all(t.is_contiguous() for t in named.values()), \
        f"adamw8bit_step: not contiguous: {', '.join(n for n, t in named.items() if not t.is_contiguous())}"
    n = p.numel()
    n_blocks = triton.cdiv(n, QBLOCK)
    for name, scale in (("exp_avg_scale", exp_avg_scale), ("exp_avg_sq_scale", exp_avg_sq_scale)):
        assert scale.dtype == torch.float32 and scale.numel() == n_blocks and scale.is_contiguous(), \
            f"adamw8bit_step: {name} must be {n_blocks} contiguous fp32 values (one per {QBLOCK} elements), " \
            f"not {scale.numel()} {scale.dtype}"
    if n == 0:
        return
    lr, beta1, beta2, eps, weight_decay = (float(x) for x in (lr, beta1, beta2, eps, weight_decay))
    _adamw8bit_kernel[(triton.cdiv(n_blocks, ROWS),)](
        p, grad, comp if comp is not None else p, exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale, n, n_blocks,
        1 - beta1, beta2, 1 - beta2, eps, -lr / (1 - beta1**step), (1 - beta2**step) ** 0.5,
        1 - lr * weight_decay, -lr * weight_decay,
        HAS_COMP=comp is not None, M_POWER=ADAMW8BIT_M_POWER, S_POWER=ADAMW8BIT_S_POWER, QBLOCK=QBLOCK, ROWS=ROWS,
        num_warps=NUM_WARPS)
    increment_version(p)  # Triton's write is invisible to torch: tell p's version counter (kernels/fp8.py's cache)
