"""One AdamW step of one parameter whose Adam moments are stored in 8 bits, in a single Triton kernel.

Why (optim.AdamW8bit): fp32 moments are 8 of the 16 bytes per parameter of bf16 + Kahan AdamW; here they take 2.
The flat tensor is cut into blocks of QBLOCK = 64 elements (the last may be short); per block and per element
    exp_avg_scale    = max |m|,        exp_avg    (int8)  = sign(m) * j,  |m|     ~ exp_avg_scale * (j / 127)^4
    exp_avg_sq_scale = max sqrt(v),    exp_avg_sq (uint8) = j,            sqrt(v) ~ exp_avg_sq_scale * (j / 255)^4
(an all-zero block has scale 0). sqrt(v) is stored, not v: it has the scale of m and |g|, and the update divides
by it. The power 4 spends the codes where Adam needs them: m / sqrt(v) is about as large for small gradients as for
large ones, so small elements need relative precision: a level at a fraction a of its block's max is 4 / (top *
a^(1/4)) of itself from the next (for m: 3% at a = 1, 10% at 1e-2, 31% at 1e-4). The scales of blocks of 64 cost
0.125 bytes per parameter. The alternatives (power 2, linear codes, Dettmers et al.'s dynamic map, blocks of 256)
are measured in BENCHMARKS.md. Rounding is stochastic: j is the level just below the value or the one above, the
latter with probability (value - level below) / (level gap), so the decoded moment is right in expectation. Nearest
rounding is not: where a code step is larger than what one step of the moving average moves (with beta2 = 0.95,
sqrt(v) falls by at most 2.5% a step), it gives the same code back every step, so the sqrt(v) of an element whose
gradients shrink follows its block's max instead of decaying, and its updates shrink. The random bits: a hash of
(element offset, step), reference.code_random_bits, so the kernel and kernels/reference.py code a step identically,
and a parameter stepped in pieces (optim.py's offload; `start`: a piece's offset) as when stepped whole.
The guard: a nonzero sqrt(v) gets the smallest level, never code 0; else an element whose sqrt(v) falls to 0 while
its m, coded with its own block's max, does not would step by lr * m_hat / eps, orders of magnitude beyond lr.
A step, per element, in fp32: decode m and s = sqrt(v); kernels/adamw.py's update (its jit helpers) from m, s * s and
g, with the Kahan-compensated weight; s = sqrt(new v); each block's new max, a row reduction of the program's (ROWS,
QBLOCK) tile in registers; the new codes. Each tensor is read and written once: 14 bytes per bf16 parameter (+16 per
block for the scales), 26 with fp32 moments. The codes are exact functions of fp32 values (div_rn, sqrt_rn), so the
interpreter matches the reference wherever kernels/adamw.py's update does; compiled, a code may move by one step.
"""
import torch
import triton
import triton.language as tl

from .adamw import _adam_direction, _adam_moments, _weight_update, check_grad_scale, check_step_tensors, grad_sq_parts
from .common import ADAMW8BIT_BLOCK, ADAMW8BIT_M_POWER, ADAMW8BIT_S_POWER, mix32

QBLOCK = ADAMW8BIT_BLOCK
# Blocks per program: ROWS * QBLOCK = 2048 elements per program and 8 warps, as kernels/adamw.py (8 elements per
# thread: a 16-byte load of each bf16 tensor, 8 bytes of each code).
ROWS = 2048 // QBLOCK
NUM_WARPS = 8


@triton.jit
def _mix32(x):
    """kernels/common.mix32 on uint32 (the multiplications wrap modulo 2^32, the shifts are logical)."""
    x = x ^ (x >> 15)
    x = x * 0x2C1B3C6D
    x = x ^ (x >> 12)
    x = x * 0x297A2D39
    return x ^ (x >> 15)


@triton.jit
def _fraction_of_max(x, row_max):
    """x / row_max (x >= 0, a (ROWS, QBLOCK) tile; row_max its rows' max, 0 for an all-zero row) as x * (1 / row_max):
    one IEEE division per block, not per element. Rows whose max is below 2^-100 are scaled by 2^64 first (exact),
    since 1 / a subnormal overflows."""
    k = tl.where(row_max < 2.0**-100, 2.0**64, 1.0)
    return (x * k[:, None]) * tl.math.div_rn(1.0, tl.where(row_max > 0, row_max * k, 1.0))[:, None]


@triton.jit
def _encode_stochastic(a, u, TOP: tl.constexpr, POWER: tl.constexpr):
    """The code below a's companded value, or the one above with probability (a - its level) / (the level above -
    its level), decided by u uniform in [0, 1): the decoded level is a in expectation (int32, a in [0, 1])."""
    r = a
    if POWER >= 2:
        r = tl.sqrt_rn(r)
    if POWER == 4:
        r = tl.sqrt_rn(r)
    below = tl.minimum((r * TOP).to(tl.int32), TOP - 1)
    lo = _decode(below, TOP, POWER)
    hi = _decode(below + 1, TOP, POWER)
    return below + (u * (hi - lo) < a - lo).to(tl.int32)


@triton.jit
def _decode(code, TOP: tl.constexpr, POWER: tl.constexpr):
    """(code * fp32(1 / TOP))^POWER in fp32, for an int32 code in [0, TOP]."""
    x = code.to(tl.float32) * (1.0 / TOP)
    if POWER >= 2:
        x = x * x
    if POWER == 4:
        x = x * x
    return x


@triton.jit
def _adamw8bit_kernel(P, G, C, M, M_SCALE, S, S_SCALE, G_SQ, G_SCALE, n, n_blocks, one_minus_beta1, beta2,
                      one_minus_beta2, eps, neg_step_size, bc2_sqrt, decay, neg_lr_wd, seed, start,
                      HAS_COMP: tl.constexpr, SUM_G_SQ: tl.constexpr, HAS_G_SCALE: tl.constexpr,
                      M_POWER: tl.constexpr, S_POWER: tl.constexpr, QBLOCK: tl.constexpr,
                      ROWS: tl.constexpr):
    # The program's ROWS blocks as rows of a (ROWS, QBLOCK) tile; int64: a tensor may hold 2^31 elements or more.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
    mask = offs < n
    row_mask = rows < n_blocks
    w = tl.load(P + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_G_SCALE:  # the clipping factor (kernels/adamw.py)
        g = g * tl.load(G_SCALE)
    m_code = tl.load(M + offs, mask=mask, other=0).to(tl.int32)
    s_code = tl.load(S + offs, mask=mask, other=0).to(tl.int32)
    m_scale = tl.load(M_SCALE + rows, mask=row_mask, other=0.0)
    s_scale = tl.load(S_SCALE + rows, mask=row_mask, other=0.0)
    c = w  # (unused without comp)
    if HAS_COMP:
        c = tl.load(C + offs, mask=mask, other=0.0).to(tl.float32)

    if SUM_G_SQ:  # this program's part of the squared gradient norm (g is 0 past n)
        tl.store(G_SQ + tl.program_id(0), tl.sum(tl.sum(g * g, axis=1), axis=0))
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
    bits = _mix32((offs + start).to(tl.uint32) ^ seed.to(tl.uint32))  # reference.code_random_bits
    m_code = _encode_stochastic(_fraction_of_max(m_abs, m_max), (bits & 0xFFFF).to(tl.float32) * 2.0**-16, 127,
                                M_POWER)
    s_code = _encode_stochastic(_fraction_of_max(s, s_max), (bits >> 16).to(tl.float32) * 2.0**-16, 255, S_POWER)
    s_code = tl.where((s_code == 0) & (s > 0), 1, s_code)  # the guard: a nonzero sqrt(v) stays nonzero
    tl.store(M + offs, tl.where(m < 0, -m_code, m_code).to(tl.int8), mask=mask)
    tl.store(S + offs, s_code.to(tl.uint8), mask=mask)
    tl.store(M_SCALE + rows, m_max, mask=row_mask)
    tl.store(S_SCALE + rows, s_max, mask=row_mask)


def adamw8bit_step(p, grad, exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale, comp, lr, beta1, beta2, eps,
                   weight_decay, step, grad_sq=None, start=0, grad_scale=None):
    """One AdamW step of one parameter with 8-bit moments, in place on p, the codes, the scales and comp; the
    signature and contract of kernels/reference.adamw8bit_step (comp: fp16 for bf16 / fp16 p, None for fp32 p;
    grad_sq gets the partial sums of the gradient's squares appended; start: the flat index of p's first element
    in the parameter it is a piece of; grad_scale: as kernels/adamw.py's)."""
    assert exp_avg.dtype == torch.int8 and exp_avg_sq.dtype == torch.uint8, \
        f"adamw8bit_step: the codes must be int8 / uint8, not {exp_avg.dtype} / {exp_avg_sq.dtype}"
    check_step_tensors("adamw8bit_step", p, grad, comp, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    n = p.numel()
    n_blocks = triton.cdiv(n, QBLOCK)
    for name, scale in (("exp_avg_scale", exp_avg_scale), ("exp_avg_sq_scale", exp_avg_sq_scale)):
        assert scale.dtype == torch.float32 and scale.numel() == n_blocks and scale.is_contiguous(), \
            f"adamw8bit_step: {name} must be {n_blocks} contiguous fp32 values (one per {QBLOCK} elements), " \
            f"not {scale.numel()} {scale.dtype}"
    assert start % QBLOCK == 0, f"adamw8bit_step: start={start} must be a multiple of {QBLOCK}"
    check_grad_scale("adamw8bit_step", p, grad_scale)
    if n == 0:
        return
    lr, beta1, beta2, eps, weight_decay = (float(x) for x in (lr, beta1, beta2, eps, weight_decay))
    grid = (triton.cdiv(n_blocks, ROWS),)
    g_sq = grad_sq_parts(grid[0], grad_sq, p.device)
    _adamw8bit_kernel[grid](
        p, grad, comp if comp is not None else p, exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale,
        g_sq if g_sq is not None else p, grad_scale if grad_scale is not None else p, n, n_blocks,
        1 - beta1, beta2, 1 - beta2, eps, -lr / (1 - beta1**step), (1 - beta2**step) ** 0.5,
        1 - lr * weight_decay, -lr * weight_decay, mix32(int(step)), start,
        HAS_COMP=comp is not None, SUM_G_SQ=g_sq is not None, HAS_G_SCALE=grad_scale is not None,
        M_POWER=ADAMW8BIT_M_POWER, S_POWER=ADAMW8BIT_S_POWER,
        QBLOCK=QBLOCK, ROWS=ROWS, num_warps=NUM_WARPS)
