"""FP8 Linear layers: the three products of a Linear on FP8 tensor cores (torch._scaled_mm, e4m3 x e4m3 -> bf16)
with row-wise scales, and our own Triton quantizers that make the e4m3 codes and their scales.

The format, float8_e4m3fn: 1 sign, 4 exponent (bias 7) and 3 mantissa bits, no infinities; the largest finite value
is 448 = 1.75 * 2^8, normal values start at 2^-6, subnormals are the multiples of 2^-9 below it. In the binade
[2^e, 2^(e+1)) neighbouring codes are 2^(e-3) apart, so rounding to the nearest code is off by at most 2^-4 of the
value (normal range) or 2^-10 (subnormal range, absolute).

Quantization of one vector x (a row, or a column), in fp32 (bf16 inputs are widened exactly):
    amax = max_i |x_i|
    s    = max(amax, 1e-12) / 448            the scale, rounded to nearest (the floor: an all-zero row gets a
                                             finite s and codes 0, not 0 / 0)
    r    = 1 / s                             rounded to nearest
    q_i  = RNE(clamp(x_i * r, -448, 448))    x_i * r rounded to nearest fp32, clamped (saturation), then rounded
                                             to the nearest e4m3 value, ties to even
    x_i ~= q_i * s                           (the dequantized value _scaled_mm works with)
Scale choice: amax lands on 448, the top of the format, so the row uses the whole range: every |x_i| >= amax / 2^14.8
(= amax * 2^-6 / 448) is a normal code, with 3 significant bits. (A power-of-two s, as torchao's rowwise recipe
rounds to, would make x_i * r exact but waste up to one binade at the top.) Error bound, per element, with
u = 2^-4 (half a code step, relative):
    |x_i - q_i s| <= u |x_i| + 2^-10 s + 2^-22 |x_i|
the first term for normal codes, the second for subnormal ones (|x_i| < 2^-6 s, an absolute 2^-10 s =
amax / 458,752), the third the fp32 roundings of r and x_i r (2 x 2^-24, rounded up; the rounding of s itself
cancels in q_i s, as r is the inverse of the stored s).
The rounding is done in the kernel itself (_round_to_e4m3: integer arithmetic on the fp32 bits for normal values,
an addition of 2^14 for subnormal ones), and only then converted to e4m3, exactly: the Triton interpreter's own
fp32 -> e4m3 conversion does not round to nearest even (it rounds ties away and drops the carry into the exponent:
124 -> 64), so the kernel's codes would otherwise differ between the GPU and the CPU tests. kernels/reference.py
quantizes with torch's cast instead; the tests require the same codes and scales, bit for bit.

Products. torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=bf16) takes a (M, K) row-major and b (K, N)
column-major e4m3 (b = w.t() of a row-major (N, K) w), scale_a (M, 1) and scale_b (1, N) fp32, and returns
(a @ b) * scale_a * scale_b in bf16, summed in fp32; K and N must be multiples of 16 (we pad M too). A scale must be
constant along the summed dimension, so each operand is scaled along the dimension it keeps:
    forward  y  = x W^T     x per token            W per output channel      rows(x), rows(W)
    dgrad    dx = dy W      dy per token           W per input channel       rows(dy), cols(W)
    wgrad    dW = dy^T x    dy per output channel  x per input channel       cols(dy), cols(x)
rows(t): one scale per row of t; cols(t): one per column (amax over the rows, here over the tokens), the codes
stored transposed (the row-wise codes of t^T), which is the layout _scaled_mm wants. W is quantized in both layouts.

Error of a product. With every operand element within a factor (1 +- u) (normal codes), each term of the fp32 sum
y_mn = sum_k a_mk b_nk is within (2u + u^2) |a_mk b_nk|, so
    |y^_mn - y_mn| <= (2u + u^2) sum_k |a_mk| |b_nk|  +  subnormal terms  +  2^-8 |y^_mn|   (bf16 result)
a bound of ~1/8 of sum |a||b|: loose, as the roundings are nearly independent and cancel. Their RMS: a uniform error
in +-half a step is 2^-3 / sqrt(12) of the binade's base, ~2.6% of |x| averaged over a binade (log-uniform values),
so a product of two quantized operands is off by ~sqrt(2) x 2.6% = 3.7% of its RMS at worst, less where the values
are not spread evenly. Measured on random data (tests, bench/fp8.py): 3.3-3.5% for all three products, bf16 0.2%.

The weight gradient. dW = dy^T x sums over the tokens, so its scales run along the channels, amax over all tokens:
the scheme that is least like the per-token scales of the other two. Measured (bench/fp8_numerics.py, CPU: the
default tiny model of train.py after 100 steps, one micro-batch of 4096 tokens; error vs fp64, mean over the 4
blocks, max over them in brackets):
              y = x W^T                     dx = dy W                     dW = dy^T x
            bf16    fp8                   bf16    fp8                   bf16    fp8
    q       0.19%   1.34% (1.6%)          0.20%   1.83% (1.9%)          0.20%   1.66% (2.6%)
    k       0.19%   1.29% (1.5%)          0.21%   1.89% (2.5%)          0.20%   1.58% (2.7%)
    v       0.24%   2.65% (4.0%)          0.23%   2.26% (3.0%)          0.18%   1.00% (2.0%)
    o       0.18%   1.02% (1.8%)          0.20%   1.87% (2.1%)          0.18%   1.07% (1.5%)
    gate    0.20%   1.73% (1.9%)          0.21%   1.93% (2.1%)          0.17%   0.96% (1.1%)
    up      0.21%   1.89% (2.0%)          0.21%   1.89% (2.1%)          0.18%   0.96% (1.1%)
    down    0.18%   1.09% (1.3%)          0.19%   1.45% (1.6%)          0.17%   0.93% (1.0%)
The weight gradient with column-wise scales loses no more than the other two products. Training the same 100 steps
(4096 tokens each) from one initialisation: train loss (mean of the last 50 steps) / val loss at the end, fp32
2.4490 / 2.5907, FP8 2.4791 / 2.6078 (+1.2% / +0.7%), FP8 with a bf16 dW 2.4269 / 2.5448 (-0.9% / -1.8%): the
runs differ by their rounding paths at a steep point of the curve, +-2% of noise that hides any effect of dW's
scales. So all three products run in FP8 (reference.FP8_WGRAD = True). Where dW would lose: a token far larger than the others (an "attention sink" with
massive activations). Its own rounding (2.6% of a huge value) lands in every element of dW, on top of the other
tokens' sum; in y and dx it stays in its own row. Synthetic, 4096 tokens of N(0, 1) with one token scaled by r,
the error of dW relative to the other tokens' part of it: r = 1: 3.7%, r = 100: 5.5%, r = 1000: 39% (bf16: 0.3%,
0.6%, 4.6%); per-token scales would do no better (7.4% and 62%): it is the outlier's own rounding. Inputs of the
q/k/v, gate/up and o projections are normalised per token (RMSNorm, softmax), so r stays small there; the down
projection's input act(g) * u is where massive activations are born. For a run that sees them, FP8_WGRAD = False
makes dW the bf16 product dy^T x on both paths (torchao's "rowwise_with_gw_hp" recipe), a third of the FP8 FLOPs
given back.

The weight cache. A weight is quantized (both layouts) once per value it takes, not once per use: the codes are kept
on the tensor itself (attribute _fp8_codes) under the key (data_ptr, _version, optimizer steps, dtype, shape), and
made again when the key changes. _version is the tensor's version counter, which in-place writes through torch bump:
a checkpoint's load_state_dict, `with torch.no_grad(): w.add_(...)`, torch's foreach / single-tensor AdamW, and our
AdamW kernels (they record their Triton writes with increment_version; they also step inside backward, where no
optimizer.step() runs). torch's fused AdamW (train.py's default on CUDA) does NOT bump it (measured, torch 2.13), so
the key also holds a count of optimizer.step() calls of any torch optimizer (a global step post-hook, registered
when this module is imported): every step makes new codes for every weight. data_ptr catches a tensor whose memory
was swapped (`w.data = ...`; a deepcopy, which copies the attribute). So every micro-step of one optimizer step
(grad_accum), the recomputed forward of checkpointed blocks and each backward reuse the forward's codes, and the
first forward after an update makes new ones. A write behind both counters (`w.data.copy_(...)` outside
optimizer.step(), a kernel that does not call increment_version) would leave stale codes. The cost: 1 byte per
weight element per layout, held from use to use: for Llama-3-8B's block Linears (7.0G elements) rows(W) is made in
forward and cols(W) in backward, and an entry whose key changed is dropped whole at the weight's next forward, so
the cache holds 14 GB at most and 7 GB at the end of forward, where the activations peak.

Not fused (yet): RMSNorm -> FP8 codes and GLU -> FP8 codes (the plan's ideal) would save writing and reading the
bf16 activation before its row-wise quantization; rows(dy) and cols(dy) (and rows(x) and cols(x)) each read their
input on their own; the column-wise quantizer reads its input twice (amax pass, then codes). The activations kept
for backward stay bf16 (as without FP8), and cols(x) is made in backward: q/k/v share one saved x.
Ideas from torchao's float8 training (the rowwise recipes, which scales the three products use); the code is ours.
"""
import torch
import triton
import triton.language as tl
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import as_rows, reference

FP8_MAX = reference.FP8_MAX
AMAX_FLOOR = reference.FP8_AMAX_FLOOR
PAD = 16  # _scaled_mm wants K and N multiples of 16: the token dimension of every code tensor is padded to it


@triton.jit
def _round_to_e4m3(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, returned as that (exact) fp32 value."""
    bits = v.to(tl.int32, bitcast=True)
    a = tl.abs(v)
    abits = a.to(tl.int32, bitcast=True)
    # normal (a >= 2^-6): 3 of the 23 mantissa bits stay; adding 2^19 - 1 plus the lowest kept bit, then clearing the
    # 20 dropped bits, rounds to nearest with ties to even (a carry moves into the exponent, as it should)
    normal = ((abits + 0x7FFFF + ((abits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    # subnormal (a < 2^-6): the multiples of 2^-9; a + 2^14 lies in [2^14, 2^15), whose fp32 step is 2^-9, so the
    # addition itself rounds a to nearest even, and subtracting 2^14 again is exact
    subnormal = (a + 16384.0) - 16384.0
    r = tl.where(a >= 0.015625, normal, subnormal)
    return tl.where(bits < 0, -r, r)  # bits < 0: the sign bit, so -0.0 stays -0.0 as in torch's cast


@triton.jit
def _scale_and_inverse(amax):
    s = tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)  # AMAX_FLOOR, FP8_MAX; div_rn: rounded to nearest
    return s, tl.math.div_rn(1.0, s)


@triton.jit
def _codes(x, inv):
    return _round_to_e4m3(tl.clamp(x * inv, -448.0, 448.0))


@triton.jit
def _quantize_rows_kernel(X, Q, S, stride_x, stride_q, n_rows, n_cols, BLOCK: tl.constexpr):
    """Program r: the codes of row r of X into Q and its scale into S. Rows from n_rows on (padding) are 0."""
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride passes 2^31 in long steps
    n_read = tl.where(row < n_rows, n_cols, 0)  # a padding row reads nothing
    amax = tl.full([], 0.0, tl.float32)
    for start in range(0, n_cols, BLOCK):  # a row up to BLOCK long is read once; a longer one twice
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + cols, mask=cols < n_read, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
    s, inv = _scale_and_inverse(amax)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_x + cols, mask=cols < n_read, other=0.0).to(tl.float32)
        tl.store(Q + row * stride_q + cols, _codes(x, inv).to(Q.dtype.element_ty), mask=cols < n_cols)
    tl.store(S + row, s)


@triton.jit
def _column_amax_kernel(X, AMAX, stride_x, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (i, j): the max |x| of each column of the tile (rows block i, columns block j), max-ed into AMAX
    (zeroed first) with an atomic max: the order of the programs does not change the result."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.atomic_max(AMAX + cols, tl.max(tl.abs(x), axis=0), mask=cols < n_cols)


@triton.jit
def _quantize_columns_kernel(X, AMAX, QT, S, stride_x, stride_qt, n_rows, n_rows_padded, n_cols,
                             BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (i, j): the codes of the tile (rows block i, columns block j) of X, stored transposed into QT
    (n_cols, n_rows_padded); padding rows give code 0. The programs of row block 0 write the scales."""
    pid_r = tl.program_id(0)
    rows = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)  # int64: cols * stride_qt passes 2^31
    col_ok = cols < n_cols
    s, inv = _scale_and_inverse(tl.load(AMAX + cols, mask=col_ok, other=0.0))
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=(rows[:, None] < n_rows) & col_ok[None, :],
                other=0.0).to(tl.float32)
    q = _codes(x, inv[None, :])
    tl.store(QT + cols[None, :] * stride_qt + rows[:, None], q.to(QT.dtype.element_ty),
             mask=(rows[:, None] < n_rows_padded) & col_ok[None, :])
    if pid_r == 0:
        tl.store(S + cols, s, mask=col_ok)


def _padded(n):
    return triton.cdiv(n, PAD) * PAD


def quantize_rows(x):
    """Row-wise e4m3 codes of x (R, C), bf16 or fp32 with a unit last stride: (codes (R16, C) float8_e4m3fn, scales
    (R16,) fp32), R16 = R rounded up to a multiple of 16 (the extra rows: codes 0). One program per row."""
    R, C = x.shape
    assert x.stride(1) == 1 or C <= 1, "quantize_rows: the last dim must be contiguous"
    codes = torch.empty((_padded(R), C), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(_padded(R), dtype=torch.float32, device=x.device)
    BLOCK = min(triton.next_power_of_2(max(C, 1)), 4096)
    if codes.shape[0]:
        _quantize_rows_kernel[(codes.shape[0],)](x, codes, scales, x.stride(0), codes.stride(0), R, C, BLOCK=BLOCK,
                                                 num_warps=min(max(BLOCK // 512, 4), 16))
    return codes, scales


def quantize_cols(x):
    """Column-wise e4m3 codes of x (R, C): (codes (C, R16), scales (C,)), one scale per column (amax over the R
    rows), the codes stored transposed, i.e. the row-wise codes of x^T, padded with zero columns to R16. Two
    launches: the column maxima (an atomic max over row blocks), then the codes."""
    R, C = x.shape
    assert x.stride(1) == 1 or C <= 1, "quantize_cols: the last dim must be contiguous"
    codes = torch.empty((C, _padded(R)), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(C, dtype=torch.float32, device=x.device)
    amax = torch.zeros(C, dtype=torch.float32, device=x.device)
    if R > 0 and C > 0:
        BLOCK_R, BLOCK_C = 64, 64
        _column_amax_kernel[(triton.cdiv(R, BLOCK_R), triton.cdiv(C, BLOCK_C))](
            x, amax, x.stride(0), R, C, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=4)
    if C > 0:  # (at least one row block, which writes the scales, also for R = 0)
        BLOCK_R, BLOCK_C = 128, 32
        _quantize_columns_kernel[(max(1, triton.cdiv(codes.shape[1], BLOCK_R)), triton.cdiv(C, BLOCK_C))](
            x, amax, codes, scales, x.stride(0), codes.stride(0), R, codes.shape[1], C,
            BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=4)
    return codes, scales


def scaled_mm(a, scale_a, b, scale_b):
    """(a * scale_a[:, None]) @ (b * scale_b[:, None])^T in bf16, for row-major e4m3 codes a (M, K) and b (N, K):
    torch._scaled_mm on CUDA (b.t() is the column-major operand it takes); elsewhere (the interpreter tests)
    kernels/reference.py's simulation of it."""
    if not a.is_cuda:
        return reference.fp8_mm(a, scale_a, b, scale_b)
    return torch._scaled_mm(a, b.t(), scale_a=scale_a[:, None], scale_b=scale_b[None, :], out_dtype=torch.bfloat16,
                            use_fast_accum=False)


_optimizer_steps = 0  # optimizer.step() calls so far, of any torch optimizer: part of the weight cache's key


def _count_optimizer_step(optimizer, args, kwargs):
    global _optimizer_steps
    _optimizer_steps += 1


register_optimizer_step_post_hook(_count_optimizer_step)


def weight_codes(weight, layout):
    """rows(W) (layout "rows") or cols(W) ("cols") of a weight (N, K): kept on the weight until it changes (the
    module docstring: the weight cache)."""
    key = (weight.data_ptr(), weight._version, _optimizer_steps, weight.dtype, tuple(weight.shape))
    cache = getattr(weight, "_fp8_codes", None)
    if cache is None or cache[0] != key:
        cache = (key, {})
        weight._fp8_codes = cache
    if layout not in cache[1]:
        with torch.no_grad():
            cache[1][layout] = (quantize_rows if layout == "rows" else quantize_cols)(weight)
    return cache[1][layout]


def _check_weight(weight):
    N, K = weight.shape
    assert N % PAD == 0 and K % PAD == 0, f"fp8: weight {tuple(weight.shape)}: both dims must be multiples of {PAD}"


def forward_gemm(x, weight):
    """y = x W^T (M, N), x (M, K) rows, W (N, K): x per token, W per output channel."""
    _check_weight(weight)
    return scaled_mm(*quantize_rows(x), *weight_codes(weight, "rows"))[:x.shape[0]]


def dgrad_gemm(dy, weight):
    """dx = dy W (M, K), dy (M, N): dy per token, W per input channel."""
    return scaled_mm(*quantize_rows(dy), *weight_codes(weight, "cols"))[:dy.shape[0]]


def wgrad_gemm(dy, x):
    """dW = dy^T x (N, K), dy (M, N), x (M, K): dy per output channel, x per input channel, both over the tokens;
    in bf16 with reference.FP8_WGRAD = False."""
    if not reference.FP8_WGRAD:
        return dy.to(torch.bfloat16).t() @ x.to(torch.bfloat16)
    return scaled_mm(*quantize_cols(dy), *quantize_cols(x))


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        rows = as_rows(x)
        ctx.save_for_backward(rows, weight)  # x in its own dtype: cols(x) is made in backward (module docstring)
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        y = forward_gemm(rows, weight).to(reference.fp8_out_dtype(x))  # (no copy when bf16, as under autocast)
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        rows, weight = ctx.saved_tensors
        dy = as_rows(dy)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = dgrad_gemm(dy, weight).to(ctx.x_dtype).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            dw = wgrad_gemm(dy, rows).to(weight.dtype)
        return dx, dw


def fp8_linear(x, weight):
    """y = x W^T for x (..., K), weight (N, K), N and K multiples of 16, with all three products of forward and
    backward in FP8 e4m3 (the module docstring). y holds bf16 values (_scaled_mm's result) in the dtype F.linear
    would give it (reference.fp8_out_dtype: bf16 under autocast); dx has x's dtype, dW the weight's."""
    return _FP8Linear.apply(x, weight)
