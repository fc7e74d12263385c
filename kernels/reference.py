"""Plain-PyTorch reference ops: what runs on the CPU, and the oracle every Triton kernel is tested against.

Each function here has the exact signature of its Triton twin in kernels/<op>.py; kernels/__init__.py picks
one of the two by the device of the input. Everything is computed in fp32 (or the input's precision if
higher) and cast back to the input dtype at the end, so the reference is at least as accurate as the kernels.

Shapes follow the packed-stream convention of the whole project: there is no batch dimension. A step is T
tokens of several sequences laid end to end; `cu_seqlens` (int32, n_seqs + 1) holds the sequence boundaries
and `positions` (T,) the position of every token inside its own sequence.
"""
import math

import torch
import torch.nn.functional as F

from .common import (ACTIVATIONS, ADAMW8BIT_BLOCK, ADAMW8BIT_M_POWER, ADAMW8BIT_S_POWER, FP8_ALIGN, FP8_AMAX_FLOOR,
                     FP8_BLOCK, FP8_MAX, IGNORE_INDEX, mix32)


def _up(x):
    """fp32 for half types; fp64 stays fp64 (tests use it as the high-precision oracle)."""
    return x if x.dtype == torch.float64 else x.float()


def rms_norm(x, weight, eps):
    """y = x / sqrt(mean(x^2) + eps) * weight, statistics in fp32. x (..., H), weight (H,)."""
    xf = _up(x)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * _up(weight)).to(x.dtype)


def add_rms_norm(x, delta, weight, eps):
    """(h, y): the residual stream h = x + delta and y = rms_norm(h, weight, eps); the Triton twin fuses the two."""
    h = x + delta
    return h, rms_norm(h, weight, eps)


def glu(gate, up, activation="silu", down=None, fp8=False):
    """h = act(gate) * up. activation "silu" gives SwiGLU, "gelu_tanh" GeGLU (tanh-approximated GELU).
    With `down`, the down projection's weight (D, F): h @ down.T, with fp8 in FP8 (fp8_linears below)."""
    g = _up(gate)
    if activation == "silu":
        a = F.silu(g)
    elif activation == "gelu_tanh":
        a = F.gelu(g, approximate="tanh")
    else:
        raise ValueError(f"unknown activation {activation!r}: expected one of {ACTIVATIONS}")
    h = (a * _up(up)).to(gate.dtype)
    if down is None:
        return h
    return fp8_linears(h, [down])[0].to(h.dtype) if fp8 else F.linear(h, down)


def rope_inv_freq(head_dim, theta, scaling=None):
    """Inverse frequencies 1 / theta^(2i/D), i < D/2, with Meta's llama3 frequency scaling when given.

    llama3 scaling (Llama-3.1's `rope_scaling`): wavelengths 2*pi/f shorter than
    original_max_position_embeddings / high_freq_factor are kept, those longer than
    original_max_position_embeddings / low_freq_factor are divided by `factor`, and the band in between is a
    linear blend of the two, weighted by smooth = (L_orig / wavelen - low) / (high - low).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelen < old_len / high, inv_freq, torch.where(wavelen > old_len / low, inv_freq / factor, blended))


def rope_cache(head_dim, max_positions, theta, scaling=None):
    """cos, sin tables (max_positions, head_dim // 2) in fp32: angle[p, i] = p * inv_freq[i]."""
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(head_dim, theta, scaling))
    return angles.cos(), angles.sin()


def apply_rope(q, k, cos, sin, positions):
    """Rotate q (T, Hq, D) and k (T, Hkv, D) by the angle of each token's own position (half-split layout).

    With x = [x1, x2] split in halves along D and (c, s) = cos/sin[positions]:
        out = [x1 * c - x2 * s,  x2 * c + x1 * s]
    Returns new tensors (the Triton twin rotates in place and returns its inputs).
    """
    c = cos[positions.long()][:, None, :]
    s = sin[positions.long()][:, None, :]

    def rotate(x):
        x1, x2 = _up(x).chunk(2, dim=-1)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def attention(q, k, v, cu_seqlens, max_seqlen, scale):
    """Causal softmax attention inside each packed sequence, none across sequences; GQA by head groups.

    q (T, Hq, D), k and v (T, Hkv, D) with Hq a multiple of Hkv: query head h reads kv head h // (Hq // Hkv).
    out[t] = sum_{s in seq(t), s <= t} softmax_s(scale * q[t] . k[s]) v[s]. Returns (T, Hq, D).
    `max_seqlen` is unused here (the kernels size their grid with it).
    """
    group = q.shape[1] // k.shape[1]
    bounds = cu_seqlens.tolist()
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        qd, kd, vd = (_up(x[start:end]).transpose(0, 1) for x in (q, k, v))  # (H, L, D)
        kd, vd = kd.repeat_interleave(group, dim=0), vd.repeat_interleave(group, dim=0)
        od = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)
        outs.append(od.transpose(0, 1))
    return torch.cat(outs).to(q.dtype)


def linear_cross_entropy(h, weight, labels, fp8_grads=False):
    """Summed next-token cross-entropy of logits = h @ weight.T, and the number of counted tokens.

    h (N, H), weight (V, H), labels (N,) int64 with -100 = ignore. Returns (loss_sum fp32 scalar, n_valid int64 scalar):
    the caller divides by the token count of the whole optimizer step, so micro-steps add up exactly.
    fp8_grads (where V and H are multiples of 16): the gradients as _FP8HeadGrads makes them.
    """
    if fp8_grads and weight.shape[0] % FP8_ALIGN == 0 and weight.shape[1] % FP8_ALIGN == 0 and torch.is_grad_enabled():
        return _FP8HeadGrads.apply(h, weight, labels)
    logits = _up(h) @ _up(weight).T
    loss_sum = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss_sum, (labels != IGNORE_INDEX).sum()


def adamw_step(p, grad, exp_avg, exp_avg_sq, comp, lr, beta1, beta2, eps, weight_decay, step, grad_sq=None,
               grad_scale=None):
    """One AdamW step of one parameter, in place on p, exp_avg, exp_avg_sq (fp32) and comp (fp16; None for an
    fp32 / fp64 p, which then takes the plain update, in torch.optim.AdamW's order of operations). `step` is
    the step count, this step included (1 on the first). grad_sq (a list, or None) gets a 1-D fp32 tensor appended
    whose sum is the gradient's squared L2 norm (here one value; the kernels' hold one partial sum per program).
    grad_scale (one fp32 value, or None) multiplies the gradient in fp32 first: clipping by optim.Update.
    The math: kernels/adamw.py; why comp: optim.py."""
    m, v, g = exp_avg, exp_avg_sq, grad.float()
    if grad_scale is not None:
        g = g * grad_scale.reshape(())
    if grad_sq is not None:
        grad_sq.append(g.square().sum().reshape(1))
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    denom = (v.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
    if comp is None:
        p.mul_(1 - lr * weight_decay).addcdiv_(m, denom, value=-step_size)
        return
    w, c = p.float(), comp.float()
    u = (w + c).mul_(-lr * weight_decay).addcdiv_(m, denom, value=-step_size)  # decay acts on the true weight
    y = u.add_(c)  # y = u + comp
    new_w = (w + y).to(p.dtype)  # w + y, rounded: loses the low part of y ...
    comp.copy_(y.sub_(new_w.float() - w))  # ... which comp = y - (new_w - w) keeps for the next step
    p.copy_(new_w)


# ---- AdamW with 8-bit block-wise moments: the layout and the codes are explained in kernels/adamw8bit.py ----
def _blocks(x, block):
    """x's flat memory as rows of `block` elements, the last row padded with zeros."""
    flat = x.reshape(-1)
    return torch.cat([flat, flat.new_zeros(-flat.numel() % block)]).view(-1, block)


def code_random_bits(n, step, device=None, start=0):
    """The random bits of a step's codes: for element i of a tensor, mix32((i mod 2^32) xor mix32(step)); the code
    of m uses the low 16 bits, that of sqrt(v) the high 16 (quantize_blockwise's u = bits / 2^16). Every tensor
    draws the same bits at a step: their rounding errors never meet in one sum that matters. A piece of a tensor
    (elements start .. start + n - 1) draws the bits of those elements."""
    i = torch.arange(start, start + n, dtype=torch.int64, device=device)
    return mix32((i & 0xFFFFFFFF) ^ mix32(step))


def quantize_blockwise(x, top, power, block=ADAMW8BIT_BLOCK, u=None):
    """(codes, scales) of fp32 x: per block of `block` elements of its flat memory the scale max |x| (fp32,
    ceil(numel / block) of them) and per element a code j in [0, top] whose level scale * (j / top)^power is next to
    |x| (int32, x's shape, 0 in an all-zero block). u=None: the nearest code of the companded value, round(top *
    (|x| / scale)^(1 / power)) with round(y) = floor(y + 0.5). u (uniform in [0, 1), x's shape): stochastic, the
    level above with probability (|x| - level below) / (level above - level below), so E[level] = |x|.
    The sign is the caller's."""
    a = _blocks(x, block).abs()
    scale = a.amax(1)
    k = torch.where(scale < 2.0**-100, 2.0**64, 1.0)  # as the kernel: x * (1 / max), exact scaling by 2^64 where
    a = (a * k[:, None]) * (1.0 / torch.where(scale > 0, scale * k, 1.0))[:, None]  # 1 / max would overflow
    r = a
    for _ in range({1: 0, 2: 1, 4: 2}[power]):
        r = r.sqrt()
    if u is None:
        codes = (r * top + 0.5).to(torch.int32)  # truncation: floor, as the value is >= 0
    else:
        below = (r * top).to(torch.int32).clamp(max=top - 1)
        lo, hi = (dequantize_blockwise(c, torch.ones_like(scale), top, power, block).view(-1, block)
                  for c in (below, below + 1))
        up = _blocks(u, block) * (hi - lo) < a - lo
        codes = below + up.to(torch.int32)
    return codes.view(-1)[:x.numel()].view(x.shape), scale


def dequantize_blockwise(codes, scale, top, power, block=ADAMW8BIT_BLOCK):
    """scale * (codes * fp32(1 / top))^power, in fp32 and codes' shape: the magnitudes quantize_blockwise coded."""
    a = _blocks(codes.to(torch.int32), block).float() * torch.tensor(1.0 / top, dtype=torch.float32)
    for _ in range({1: 0, 2: 1, 4: 2}[power]):
        a = a * a
    return (a * scale[:, None]).view(-1)[:codes.numel()].view(codes.shape)


def adamw8bit_step(p, grad, exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale, comp, lr, beta1, beta2, eps,
                   weight_decay, step, grad_sq=None, start=0, grad_scale=None):
    """One AdamW step of one parameter whose moments are 8-bit codes with a scale per ADAMW8BIT_BLOCK elements
    (exp_avg int8 and exp_avg_scale for m; exp_avg_sq uint8 and exp_avg_sq_scale for sqrt(v)), all updated in
    place, as are p and comp. The codes are decoded, adamw_step (above) updates p, comp and the decoded fp32
    moments, and the new moments are coded again, stochastically with code_random_bits(numel, step, start), with the
    guard of kernels/adamw8bit.py (a nonzero sqrt(v) keeps a nonzero code). comp: fp16 for bf16 / fp16 p (Kahan),
    None for fp32 / fp64 p. grad_sq, grad_scale: as adamw_step's. start: p is a piece of a parameter, starting at
    its flat index start (a multiple of the block), and draws that piece's random bits."""
    top_m, top_s, pm, ps = 127, 255, ADAMW8BIT_M_POWER, ADAMW8BIT_S_POWER
    m = dequantize_blockwise(exp_avg.abs(), exp_avg_scale, top_m, pm)
    m = torch.where(exp_avg < 0, -m, m)
    s = dequantize_blockwise(exp_avg_sq, exp_avg_sq_scale, top_s, ps)
    v = s * s
    adamw_step(p, grad, m, v, comp, lr, beta1, beta2, eps, weight_decay, step, grad_sq, grad_scale)
    bits = code_random_bits(p.numel(), step, p.device, start).view(p.shape)
    codes, scale = quantize_blockwise(m, top_m, pm, u=(bits & 0xFFFF).float() * 2.0**-16)
    exp_avg.copy_(torch.where(m < 0, -codes, codes))
    exp_avg_scale.copy_(scale)
    s = v.sqrt()
    codes, scale = quantize_blockwise(s, top_s, ps, u=(bits >> 16).float() * 2.0**-16)
    exp_avg_sq.copy_(torch.where((codes == 0) & (s > 0), 1, codes))
    exp_avg_sq_scale.copy_(scale)


# ---- FP8 (e4m3) linear layers: the format, the rounding, the scales and the error bound are in kernels/fp8.py ----


def fp8_quantize(x, block_rows=1):
    """e4m3 codes of x (R, C), any float dtype, one scale per block of block_rows (1 or 128) rows x 128 columns
    (the product sums over C): (codes (R, C) float8_e4m3fn, scales), x[r, c] ~= codes[r, c] * its block's scale. The
    scales laid out as torch._scaled_mm reads them: 1 x 128: (ceil(C / 128), R), scales[c // 128, r]; 128 x 128:
    (ceil(R / 128), ceil(C / 128)), scales[r // 128, c // 128]. In fp32: scale =
    max(amax, FP8_AMAX_FLOOR) / 448 (amax = max |x| of the block), codes = x * (1 / scale) clamped to +-448 and
    rounded to nearest e4m3, ties to even (torch's cast)."""
    xf = x.float()
    R, C = xf.shape
    br, k = block_rows, -(-C // FP8_BLOCK)
    Rp = -(-R // br) * br
    blocks = F.pad(xf, (0, k * FP8_BLOCK - C, 0, Rp - R)).view(Rp // br, br, k, FP8_BLOCK)
    amax = blocks.abs().amax((1, 3), keepdim=True)
    # (448 as a tensor on x's device: torch on CUDA divides by a Python number as a multiplication by its reciprocal,
    # one rounding more, which moves some scales by one step from the exact quotient the kernel computes)
    scale = amax.clamp_min(FP8_AMAX_FLOOR) / torch.tensor(FP8_MAX, device=x.device)
    codes = (blocks * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    codes, scale = codes.view(Rp, k * FP8_BLOCK)[:R, :C], scale.view(Rp // br, k)
    return codes, scale.t().contiguous() if br == 1 else scale


def fp8_mm(a, scale_a, b, scale_b, out_dtype=torch.bfloat16):
    """a b^T in out_dtype for e4m3 codes a (M, K) with 1 x 128 scales and b (N, K) with 128 x 128 scales
    (fp8_quantize's layouts): torch._scaled_mm simulated. Per block of 128 along K the products of two e4m3 values
    are exact in fp32, summed in fp32 (in another order than the GPU's), times the block's two scales; the blocks'
    results are summed in fp32 and rounded to out_dtype once."""
    return fp8_mm_sum([(a, scale_a, b, scale_b)], out_dtype)


def fp8_mm_sum(products, out_dtype=torch.bfloat16):
    """sum_i a_i b_i^T over products (a_i, scale_a_i, b_i, scale_b_i) (fp8_mm's operands, one M and N) as ONE
    simulated _scaled_mm over their summed dims laid side by side: one fp32 sum, product after product, block after
    block, rounded to out_dtype once. (Autocast is off here: it would run the fp32 products in bf16.)"""
    M, N = products[0][0].shape[0], products[0][2].shape[0]
    acc = torch.zeros(M, N, device=products[0][0].device)
    with torch.autocast(acc.device.type, enabled=False):
        for a, scale_a, b, scale_b in products:
            for j in range(-(-a.shape[1] // FP8_BLOCK)):
                ks = slice(j * FP8_BLOCK, (j + 1) * FP8_BLOCK)
                part = a[:, ks].float() @ b[:, ks].float().t()
                scale_b_rows = scale_b[:, j].repeat_interleave(FP8_BLOCK)[:N]
                acc += part * (scale_a[j][:, None] * scale_b_rows[None, :])
    return acc.to(out_dtype)


def fp8_out_dtype(x):
    """The dtype of an FP8 product's result: the one F.linear would give (autocast's when it is on, else x's). Its
    values are bf16's, as _scaled_mm makes them, widened where the dtype is wider."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class _FP8Linears(torch.autograd.Function):
    """ys_i = x W_i^T for weights that share the input x, all three products of each Linear in FP8 (the simulation
    of kernels/fp8.py's), q1(t) / q128(t) the codes of t with 1 x 128 / 128 x 128 scales (fp8_quantize):
        y  = q1(x) q128(W)^T        dx = sum_i q1(dy_i) q128(W_i^T)^T  (one fp32 sum over the weights in their order)
        dW = q1(dy^T) q128(x^T)^T   (blocks of 128 tokens)
    y in bf16 (in fp8_out_dtype), dx rounded once to x's dtype, dW to W's."""

    @staticmethod
    def forward(ctx, x, *weights):
        rows = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(rows, *weights)
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        x_rows = fp8_quantize(rows)
        return tuple(fp8_mm(*x_rows, *fp8_quantize(w, FP8_BLOCK)).to(fp8_out_dtype(x)).view(*x.shape[:-1], w.shape[0])
                     for w in weights)

    @staticmethod
    def backward(ctx, *dys):
        rows, *weights = ctx.saved_tensors
        dys = [dy.reshape(-1, w.shape[0]) for dy, w in zip(dys, weights)]
        dx = fp8_mm_sum([(*fp8_quantize(dy), *fp8_quantize(w.t(), FP8_BLOCK)) for dy, w in zip(dys, weights)],
                        ctx.x_dtype)
        dws = [fp8_mm(*fp8_quantize(dy.t()), *fp8_quantize(rows.t(), FP8_BLOCK), w.dtype)
               for dy, w in zip(dys, weights)]
        return dx.view(ctx.x_shape), *dws


def fp8_linears(x, weights):
    """[x (..., K) @ W^T for W (N_i, K) in weights] with e4m3 operands and block scales in forward and backward
    (_FP8Linears); the results' values are bf16, as torch._scaled_mm's, in fp8_out_dtype(x)."""
    return _FP8Linears.apply(x, *weights)


def logits_grad(z, labels):
    """G = d loss / d z of each row: softmax(z) - onehot(label), z the logits."""
    g = torch.softmax(z, dim=1)
    g[torch.arange(len(labels)), labels] -= 1.0
    return g


class _FP8HeadGrads(torch.autograd.Function):
    """linear_cross_entropy's loss, with its gradients made from the logits' gradient G (rounded to the matmul
    dtype, as kernels/cross_entropy.py stores it; the logits from operands in that dtype, as its products take
    them) by FP8 products over the counted tokens c (the simulation of
    kernels/cross_entropy.py's _fp8_pass):
        dh_c = q1(G_c) q128(W^T)^T      dW = q1(G_c^T) q128(h_c^T)^T      (blocks of 128 counted tokens)
    in h's and W's dtypes, times the loss's incoming gradient: dh after its product, dW by G^T's scales."""

    @staticmethod
    def forward(ctx, h, weight, labels):
        device = h.device.type
        ctx.mm_dtype = mm = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
        with torch.autocast(device, enabled=False):  # the operands in the matmul dtype, the sums in fp32 (or fp64)
            logits = _up(h.to(mm)) @ _up(weight.to(mm)).T
        ctx.save_for_backward(h, weight, labels, logits)
        n_valid = (labels != IGNORE_INDEX).sum()
        ctx.mark_non_differentiable(n_valid)
        return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum"), n_valid

    @staticmethod
    def backward(ctx, grad_loss, grad_n_valid):
        h, weight, labels, logits = ctx.saved_tensors
        counted = (labels != IGNORE_INDEX).nonzero().squeeze(1)
        g = logits_grad(logits[counted].float(), labels[counted]).to(ctx.mm_dtype)
        with torch.autocast(h.device.type, enabled=False):
            dh = torch.zeros_like(h)
            dh[counted] = fp8_mm(*fp8_quantize(g), *fp8_quantize(weight.t(), FP8_BLOCK), h.dtype)
            gt_codes, gt_scales = fp8_quantize(g.t())
            dw = fp8_mm(gt_codes, gt_scales * grad_loss, *fp8_quantize(h[counted].t(), FP8_BLOCK), weight.dtype)
        return dh.mul_(grad_loss), dw, None
