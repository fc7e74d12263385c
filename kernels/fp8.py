"""FP8 Linear layers: the three products of a Linear on FP8 tensor cores (torch._scaled_mm, e4m3 x e4m3 -> bf16)
with row-wise scales, and our own Triton quantizer that makes the e4m3 codes and their scales.

The format, float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits, no infinities; the largest finite value is
448, normal values start at 2^-6, subnormals are the multiples of 2^-9 below it. Rounding to the nearest code is off
by at most u = 2^-4 of the value (normal range) or 2^-10 (subnormal range, absolute).

Quantization of one vector x (a row, or a column), in fp32 (bf16 inputs are widened exactly):
    s   = max(amax, 1e-12) / 448              amax = max_i |x_i|; rounded to nearest; the floor: an all-zero row
    r   = 1 / s                               gets a finite s and codes 0; r rounded to nearest
    q_i = RNE(clamp(x_i * r, -448, 448))      x_i * r in fp32, saturated, rounded to the nearest e4m3, ties to even
    x_i ~= q_i * s,    |x_i - q_i s| <= u |x_i| + 2^-10 s + 2^-22 |x_i|   (normal, subnormal, fp32 roundings of r)
amax lands on 448, so a row uses the whole range (a power-of-two s, as torchao rounds to, wastes up to a binade).
The kernel rounds itself (_round_to_e4m3, integer arithmetic on the fp32 bits) and converts exactly: the Triton
interpreter's own fp32 -> e4m3 cast does not round to nearest even. kernels/reference.py uses torch's cast; the
tests require the same codes and scales, bit for bit, in the interpreter and on the H200.

Products. torch._scaled_mm scales each operand along the dimension it keeps (a scale must be constant along the
summed one): rows(t) has one scale per row of t, cols(t) one per column, its codes stored transposed.
    forward  y  = x W^T     x per token            W per output channel      rows(x), rows(W)
    dgrad    dx = dy W      dy per token           W per input channel       rows(dy), cols(W)
    wgrad    dW = dy^T x    dy per output channel  x per input channel       cols(dy), cols(x)
Each product errs by ~sqrt(2) x 2.6% RMS (two operands, a uniform error in +-half a step averaged over a binade;
measured in BENCHMARKS.md), the weight gradient no worse than the other two except for a token with massive
activations, whose own rounding lands in every element of dW: FP8_WGRAD = False (kernels/reference.py) makes dW
the bf16 product.

Sharing. Linears that read one input (q/k/v; gate/up) take it in one call, fp8_linears(x, weights): x is quantized
once, both layouts from the same two passes (the maxima of its rows and columns, then both codes), and backward
keeps cols(x), 1 byte per element, instead of the bf16 x. Weights are quantized at each use, one layout each: a
weight is used once per step (unless checkpointing or accumulation reuse it), so a cache would only hold memory.
Not fused (yet): the quantization into the RMSNorm and GLU kernels that make x. Ideas from torchao's float8
training (its row-wise recipes); the code is ours.
"""
import torch
import triton
import triton.language as tl

from . import as_rows, reference

PAD = 16  # _scaled_mm wants K and N multiples of 16: the token dimension of every code tensor is padded to it
# (BLOCK_R, BLOCK_C, num_warps) of the maxima pass and of the codes pass: the fastest of `bench/fp8.py --tiles` on
# the H200 (BENCHMARKS.md)
AMAX_TILE, CODES_TILE = (128, 64, 4), (64, 128, 8)


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
    # x's sign bit put back on by bits, so that a tiny negative x gives -0.0 as torch's cast does (compiled for the
    # H200, tl.where(bits < 0, -r, r) gave +0.0 there)
    return (r.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def _scale_and_inverse(amax):
    s = tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)  # reference.FP8_AMAX_FLOOR, FP8_MAX; div_rn: to nearest
    return s, tl.math.div_rn(1.0, s)


@triton.jit
def _amax_kernel(X, ROW_AMAX, COL_AMAX, stride_x, n_rows, n_cols,
                 ROWS: tl.constexpr, COLS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (i, j): the max |x| of each row and each column of tile (i, j), max-ed into ROW_AMAX / COL_AMAX
    (zeroed first) with atomic maxima: exact, so the order of the programs does not change the result."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # int64: rows * stride passes 2^31
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    a = tl.abs(tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32))
    if ROWS:
        tl.atomic_max(ROW_AMAX + rows, tl.max(a, axis=1), mask=rows < n_rows)
    if COLS:
        tl.atomic_max(COL_AMAX + cols, tl.max(a, axis=0), mask=cols < n_cols)


@triton.jit(do_not_specialize=["n_rows"])
def _codes_kernel(X, ROW_AMAX, COL_AMAX, Q, S, QT, ST, stride_x, stride_q, stride_qt, n_rows, n_rows_padded, n_cols,
                  ROWS: tl.constexpr, COLS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (i, j): tile (i, j) of X read once; its row-wise codes into Q (n_rows_padded, n_cols) and its
    column-wise codes, transposed, into QT (n_cols, n_rows_padded); padding rows give code 0. The programs of column
    block 0 write the row scales S, those of row block 0 the column scales ST. (Compiled for the H200 with n_rows
    = 1, which Triton specializes by default, the padding codes came out wrong: hence do_not_specialize.)"""
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c.to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)  # int64: cols * stride_qt passes 2^31
    row_in, row_out, col_ok = rows < n_rows, rows < n_rows_padded, cols < n_cols
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=row_in[:, None] & col_ok[None, :],
                other=0.0).to(tl.float32)
    out = row_out[:, None] & col_ok[None, :]
    x = tl.where(row_in[:, None], x, 0.0)  # the padding tokens: codes 0 (the weight gradient sums over them)
    if ROWS:
        s, inv = _scale_and_inverse(tl.load(ROW_AMAX + rows, mask=row_in, other=0.0))
        q = _round_to_e4m3(tl.clamp(x * inv[:, None], -448.0, 448.0))
        tl.store(Q + rows[:, None] * stride_q + cols[None, :], q.to(Q.dtype.element_ty), mask=out)
        if pid_c == 0:
            tl.store(S + rows, s, mask=row_out)
    if COLS:
        s, inv = _scale_and_inverse(tl.load(COL_AMAX + cols, mask=col_ok, other=0.0))
        q = _round_to_e4m3(tl.clamp(x * inv[None, :], -448.0, 448.0))
        tl.store(QT + cols[None, :] * stride_qt + rows[:, None], q.to(QT.dtype.element_ty), mask=out)
        if pid_r == 0:
            tl.store(ST + cols, s, mask=col_ok)


def _padded(n):
    return triton.cdiv(n, PAD) * PAD


def quantize(x, rows=True, cols=True):
    """The e4m3 codes of x (R, C) (bf16 or fp32, unit last stride) with row-wise scales, column-wise scales, or both
    from the same two passes over x: (row_codes, col_codes), each None unless asked for.
        row_codes = (codes (R16, C), scales (R16,)),   x ~= codes * scales[:, None]
        col_codes = (codes (C, R16), scales (C,)),     x^T ~= codes * scales[:, None]  (the row codes of x^T)
    R16 = R rounded up to a multiple of 16; the padding rows (tokens) get codes 0."""
    R, C = x.shape
    assert x.stride(1) == 1 or C <= 1, "fp8.quantize: the last dim must be contiguous"
    R16, dev = _padded(R), x.device
    q = torch.empty((R16, C), dtype=torch.float8_e4m3fn, device=dev) if rows else None
    s = torch.empty(R16, dtype=torch.float32, device=dev) if rows else None
    qt = torch.empty((C, R16), dtype=torch.float8_e4m3fn, device=dev) if cols else None
    st = torch.empty(C, dtype=torch.float32, device=dev) if cols else None
    row_amax = torch.zeros(R if rows else 1, dtype=torch.float32, device=dev)
    col_amax = torch.zeros(C if cols else 1, dtype=torch.float32, device=dev)
    if R > 0 and C > 0:
        BLOCK_R, BLOCK_C, warps = AMAX_TILE
        _amax_kernel[(triton.cdiv(R, BLOCK_R), triton.cdiv(C, BLOCK_C))](
            x, row_amax, col_amax, x.stride(0), R, C, ROWS=rows, COLS=cols, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C,
            num_warps=warps)
    if C > 0:  # (at least one row block, which writes the column scales, also for R = 0)
        BLOCK_R, BLOCK_C, warps = CODES_TILE
        _codes_kernel[(max(1, triton.cdiv(R16, BLOCK_R)), triton.cdiv(C, BLOCK_C))](
            x, row_amax, col_amax, q, s, qt, st, x.stride(0), C, R16, R, R16, C,
            ROWS=rows, COLS=cols, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=warps)
    return (q, s) if rows else None, (qt, st) if cols else None


def scaled_mm(a, scale_a, b, scale_b):
    """(a * scale_a[:, None]) @ (b * scale_b[:, None])^T in bf16, for row-major e4m3 codes a (M, K) and b (N, K):
    torch._scaled_mm on CUDA (b.t() is the column-major operand it takes); elsewhere (the interpreter tests)
    kernels/reference.py's simulation of it."""
    if not a.is_cuda:
        return reference.fp8_mm(a, scale_a, b, scale_b)
    return torch._scaled_mm(a, b.t(), scale_a=scale_a[:, None], scale_b=scale_b[None, :], out_dtype=torch.bfloat16,
                            use_fast_accum=False)


def _check_weight(weight):
    N, K = weight.shape
    assert N % PAD == 0 and K % PAD == 0, f"fp8: weight {tuple(weight.shape)}: both dims must be multiples of {PAD}"


def forward_gemm(x_rows, weight, M):
    """y = x W^T (M, N) for x's row codes (fp8.quantize of x (M, K)) and W (N, K): x per token, W per output channel."""
    _check_weight(weight)
    return scaled_mm(*x_rows, *quantize(weight, cols=False)[0])[:M]


def wgrad_input(x):
    """What the weight gradient reads of a Linear's input x: its column codes, or x itself where
    reference.FP8_WGRAD is off (dW in bf16)."""
    return quantize(x, rows=False)[1] if reference.FP8_WGRAD else x


def backward_gemms(dy, weight, x_saved, need_dx=True, need_dw=True):
    """(dx, dW) of y = x W^T for dy (M, N): dx = dy W (M, K), dy per token and W per input channel; dW = dy^T x
    (N, K), dy per output channel and x per input channel, both over the tokens. x_saved: wgrad_input(x) (None
    without need_dw). The two codes of dy come from one fp8.quantize; a product not needed is skipped (None)."""
    wgrad_fp8 = need_dw and reference.FP8_WGRAD
    dy_rows, dy_cols = quantize(dy, rows=need_dx, cols=wgrad_fp8) if need_dx or wgrad_fp8 else (None, None)
    dx = scaled_mm(*dy_rows, *quantize(weight, rows=False)[1])[:dy.shape[0]] if need_dx else None
    if not need_dw:
        return dx, None
    dw = scaled_mm(*dy_cols, *x_saved) if wgrad_fp8 else dy.to(torch.bfloat16).t() @ x_saved.to(torch.bfloat16)
    return dx, dw


class _FP8Linears(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, *weights):
        rows = as_rows(x)
        need_dw = any(ctx.needs_input_grad[1:])  # (x is not kept where no weight needs a gradient)
        x_rows, x_cols = quantize(rows, rows=True, cols=need_dw and reference.FP8_WGRAD)
        out_dtype = reference.fp8_out_dtype(x)  # (no copy when bf16, as under autocast)
        ys = [forward_gemm(x_rows, w, rows.shape[0]).to(out_dtype).view(*x.shape[:-1], w.shape[0]) for w in weights]
        x_saved = () if not need_dw else x_cols if reference.FP8_WGRAD else (rows,)  # codes: 1 byte per element
        ctx.save_for_backward(*x_saved, *weights)
        ctx.x_shape, ctx.x_dtype, ctx.n_saved = x.shape, x.dtype, len(x_saved)
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys):
        x_saved, weights = ctx.saved_tensors[:ctx.n_saved], ctx.saved_tensors[ctx.n_saved:]
        x_saved = x_saved if ctx.n_saved != 1 else x_saved[0]  # (codes, scales), or x
        dx, dws = None, []
        for dy, w, need_dw in zip(dys, weights, ctx.needs_input_grad[1:]):
            part, dw = backward_gemms(as_rows(dy), w, x_saved, ctx.needs_input_grad[0], need_dw)
            if part is not None:  # summed in x's dtype, in the weights' order (as reference._FP8Linears)
                dx = part.to(ctx.x_dtype) if dx is None else dx.add_(part.to(ctx.x_dtype))
            dws.append(None if dw is None else dw.to(w.dtype))
        if dx is not None:
            dx = dx.view(ctx.x_shape)
        return dx, *dws


def fp8_linears(x, weights):
    """[x W^T for W in weights] for x (..., K) and weights (N_i, K), N_i and K multiples of 16, all three products of
    forward and backward in FP8 e4m3, x quantized once for all of them (the module docstring). Each y holds bf16
    values (_scaled_mm's) in the dtype F.linear would give it (reference.fp8_out_dtype: bf16 under autocast); dx
    has x's dtype, each dW its weight's."""
    return _FP8Linears.apply(x, *weights)
