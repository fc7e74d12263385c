"""One AdamW step of one parameter in a single Triton kernel, with Kahan-compensated updates for bf16 / fp16 weights.

Why bf16 weights need the compensation buffer `comp`, and why it is fp16: optim.py. This file holds the math.
Per element, all in fp32; g the gradient, w the stored weight, t the step count (1 on the first step):
    g = grad * grad_scale                      where given: the clipping factor min(1, clip / norm), read on the
                                               device (optim.Update), so clipping needs no pass of its own
    m = beta1 * m + (1 - beta1) * g            as m + (1 - beta1) * (g - m), one fused multiply-add (torch's lerp_)
    v = beta2 * v + (1 - beta2) * g^2          the last add fused with its multiply (torch's mul_, addcmul_)
    m_hat = m / (1 - beta1^t)          v_hat = v / (1 - beta2^t)
    u = -lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * W)           (decoupled weight decay, on the weight W)
computed, in torch.optim.AdamW's order, with two per-step scalars that the host works out once:
    step_size = lr / (1 - beta1^t)     bc2_sqrt = sqrt(1 - beta2^t)
    denom = sqrt(v) / bc2_sqrt + eps
    u = -lr * weight_decay * W + (-step_size * m) / denom

fp32 weights have no comp: W = w, and w = w * (1 - lr * weight_decay) + (-step_size * m) / denom, as torch does.
bf16 / fp16 weights: W = w + comp, the true weight, and the update is added with Kahan summation:
    y     = u + comp            the update plus what earlier steps failed to add
    w'    = round(w + y)        the new stored weight, rounded to nearest (ties to even) in the weight's dtype
    comp' = fp16(y - (w' - w))  the part of y that rounding dropped (w' - w is exact in fp32), for the next step

Every tensor is read once and written once (for bf16 weights: g, w, comp, m, v in, w, comp, m, v out, 26 bytes
per parameter), where the same update as separate torch ops (kernels/reference.py) reads and writes whole fp32
temporaries. Division and square root are the IEEE-rounded ones (div_rn, sqrt_rn), as torch's: the kernel is
bound by memory, so exactness costs no time. The interpreter then matches the CPU reference bit for bit nearly
everywhere; compiled, Triton fuses some products into their sums, so a weight may differ by one ulp.
"""
import torch
import triton
import triton.language as tl

# Elements per program and warps per program: 2048 / (8 warps x 32 threads) = 8 elements per thread, i.e. one
# 16-byte load per thread of each bf16 / fp16 tensor and two of each fp32 one. Plain constants, not autotuned: an
# elementwise kernel this simple streams at copy bandwidth over a wide range of both (BENCHMARKS.md, Kernels).
BLOCK = 2048
NUM_WARPS = 8


@triton.jit
def _round_to_bf16(x):
    """x (fp32) rounded to the nearest bf16, ties to even, returned as an fp32 that bf16 holds exactly.

    Done on the bits because the Triton interpreter truncates in x.to(tl.bfloat16) (the GPU rounds to nearest):
    the CPU tests would otherwise test a different rounding than the one the GPU runs. bf16 is the top 16 bits of
    an fp32; adding 0x7FFF plus the lowest kept bit carries into the kept bits exactly when the dropped 16 bits
    are above half, or exactly half with an odd kept part (a carry out of the mantissa correctly bumps the
    exponent, up to inf). NaN is passed through: its bits could otherwise carry into the sign."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return tl.where(x == x, bits.to(tl.float32, bitcast=True), x)


@triton.jit
def _adam_moments(g, m, v, one_minus_beta1, beta2, one_minus_beta2):
    """The new moments m, v (fp32) from the gradient g (fp32)."""
    m = tl.fma(one_minus_beta1, g - m, m)  # m + (1 - beta1) * (g - m), rounded once, as torch's lerp
    v = tl.fma(one_minus_beta2 * g, g, v * beta2)  # beta2 * v + (1 - beta2) * g * g, as torch's mul_, addcmul_
    return m, v


@triton.jit
def _adam_direction(m, sqrt_v, neg_step_size, bc2_sqrt, eps):
    """-lr * m_hat / (sqrt(v_hat) + eps), from the new m and sqrt(v)."""
    denom = tl.math.div_rn(sqrt_v, bc2_sqrt) + eps
    return tl.math.div_rn(neg_step_size * m, denom)


@triton.jit
def _weight_update(P, w, c, adam, decay, neg_lr_wd, HAS_COMP: tl.constexpr):
    """(new weight, new comp), both fp32 holding values of their storage dtypes, from the stored weight w, its
    comp c (HAS_COMP: bf16 / fp16 weights of pointer P) and the Adam direction; without comp, new comp is c."""
    if HAS_COMP:
        y = ((w + c) * neg_lr_wd + adam) + c  # y = u + comp, with the decay acting on the true weight w + comp
        if P.dtype.element_ty == tl.bfloat16:
            new_w = _round_to_bf16(w + y)
        else:  # fp16: the interpreter's cast rounds to nearest like the GPU's
            new_w = (w + y).to(P.dtype.element_ty).to(tl.float32)
        c = y - (new_w - w)
    else:
        new_w = w * decay + adam
    return new_w, c


@triton.jit
def _adamw_kernel(P, G, M, V, C, G_SQ, G_SCALE, n, one_minus_beta1, beta2, one_minus_beta2, eps, neg_step_size,
                  bc2_sqrt, decay, neg_lr_wd, HAS_COMP: tl.constexpr, SUM_G_SQ: tl.constexpr,
                  HAS_G_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    # int64 offsets: a tensor may hold 2^31 elements or more, and pid * BLOCK would overflow int32 there
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    w = tl.load(P + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_G_SCALE:
        g = g * tl.load(G_SCALE)
    m = tl.load(M + offs, mask=mask, other=0.0)
    v = tl.load(V + offs, mask=mask, other=0.0)
    c = w  # (unused without comp)
    if HAS_COMP:
        c = tl.load(C + offs, mask=mask, other=0.0).to(tl.float32)

    if SUM_G_SQ:  # this program's part of the squared gradient norm (g is 0 past n)
        tl.store(G_SQ + tl.program_id(0), tl.sum(g * g, axis=0))
    m, v = _adam_moments(g, m, v, one_minus_beta1, beta2, one_minus_beta2)
    adam = _adam_direction(m, tl.sqrt_rn(v), neg_step_size, bc2_sqrt, eps)
    new_w, c = _weight_update(P, w, c, adam, decay, neg_lr_wd, HAS_COMP)
    if HAS_COMP:
        tl.store(C + offs, c.to(tl.float16), mask=mask)
    tl.store(P + offs, new_w.to(P.dtype.element_ty), mask=mask)
    tl.store(M + offs, m, mask=mask)
    tl.store(V + offs, v, mask=mask)


def grad_sq_parts(n_programs, grad_sq, device):
    """Where the step kernels write each program's sum of g^2 (fp32, one per program) when grad_sq, a list, is to
    get them: the buffer is appended to it, and whoever wants the squared gradient norm sums all the buffers of a
    step at once (optim.step_in_backward: two launches per step, not two per parameter). A fixed order, no
    atomics: the norm is the same from run to run. The kernel reads g anyway: no second pass over the gradient."""
    if grad_sq is None:
        return None
    assert isinstance(grad_sq, list), "grad_sq: a list, which gets the partial sums of g^2 appended"
    grad_sq.append(torch.empty(n_programs, dtype=torch.float32, device=device))
    return grad_sq[-1]


def check_grad_scale(fn, p, grad_scale):
    """grad_scale (None, or one fp32 value on p's device) as fn's kernel reads it."""
    assert grad_scale is None or (grad_scale.numel() == 1 and grad_scale.dtype == torch.float32
                                  and grad_scale.device == p.device), \
        f"{fn}: grad_scale must be one fp32 value on {p.device}, not {grad_scale.numel()} {grad_scale.dtype} on " \
        f"{grad_scale.device}"


def check_step_tensors(fn, p, grad, comp, **moments):
    """The checks of fn's (adamw_step's, adamw8bit_step's) tensors: the weight's dtype, the gradient's and comp's
    that go with it, and one shape and contiguous memory for all of them: the kernel walks the flat memory of every
    tensor with one offset, so they must be laid out the same way."""
    assert p.dtype in (torch.float32, torch.bfloat16, torch.float16), f"{fn}: unsupported weight dtype {p.dtype}"
    assert grad.dtype in (p.dtype, torch.float32), f"{fn}: gradient {grad.dtype} for a {p.dtype} weight"
    assert (comp is None) == (p.dtype == torch.float32), \
        f"{fn}: comp (fp16) goes with bf16 / fp16 weights only (weight {p.dtype}, comp {comp is not None})"
    assert comp is None or comp.dtype == torch.float16, f"{fn}: comp must be fp16, not {comp.dtype}"
    named = {name: t for name, t in dict(p=p, grad=grad, **moments, comp=comp).items() if t is not None}
    assert all(t.shape == p.shape for t in named.values()), \
        f"{fn}: shapes differ: {', '.join(f'{n} {tuple(t.shape)}' for n, t in named.items())}"
    assert all(t.is_contiguous() for t in named.values()), \
        f"{fn}: not contiguous: {', '.join(n for n, t in named.items() if not t.is_contiguous())}"


def adamw_step(p, grad, exp_avg, exp_avg_sq, comp, lr, beta1, beta2, eps, weight_decay, step, grad_sq=None,
               grad_scale=None):
    """One AdamW step of one parameter, in place on p, exp_avg, exp_avg_sq and comp; the signature and the
    contract of kernels/reference.adamw_step (comp: fp16 for bf16 / fp16 p, None for fp32 p; step counts this
    step; grad_sq, a list, gets the partial sums of the gradient's squares appended; grad_scale, one fp32 value on
    the device or None, multiplies the gradient). An optimizer update has no backward: no autograd.Function here."""
    assert exp_avg.dtype == exp_avg_sq.dtype == torch.float32, \
        f"adamw_step: the moments must be fp32, not {exp_avg.dtype} / {exp_avg_sq.dtype}"
    check_step_tensors("adamw_step", p, grad, comp, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    check_grad_scale("adamw_step", p, grad_scale)
    n = p.numel()
    if n == 0:
        return
    lr, beta1, beta2, eps, weight_decay = (float(x) for x in (lr, beta1, beta2, eps, weight_decay))
    grid = (triton.cdiv(n, BLOCK),)
    g_sq = grad_sq_parts(grid[0], grad_sq, p.device)
    # The scalars, in double on the host, exactly as the reference hands them to torch (rounded to fp32 there).
    _adamw_kernel[grid](
        p, grad, exp_avg, exp_avg_sq, comp if comp is not None else p, g_sq if g_sq is not None else p,
        grad_scale if grad_scale is not None else p, n,
        1 - beta1, beta2, 1 - beta2, eps, -lr / (1 - beta1**step), (1 - beta2**step) ** 0.5,
        1 - lr * weight_decay, -lr * weight_decay,
        HAS_COMP=comp is not None, SUM_G_SQ=g_sq is not None, HAS_G_SCALE=grad_scale is not None, BLOCK=BLOCK,
        num_warps=NUM_WARPS)
