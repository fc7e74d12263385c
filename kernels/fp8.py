"""FP8 Linear layers: the three products of a Linear on FP8 tensor cores (torch._scaled_mm, e4m3 x e4m3 -> bf16)
with block scales, and our own Triton quantizer that makes the e4m3 codes and their scales in one launch.

The format, float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits, no infinities; the largest finite value is
448, normal values start at 2^-6, subnormals are the multiples of 2^-9 below it. Rounding to the nearest code is off
by at most u = 2^-4 of the value (normal range) or 2^-10 (subnormal range, absolute).

Quantization of one block of x (1 x 128 or 128 x 128 elements), in fp32 (bf16 inputs are widened exactly):
    s   = max(amax, 1e-12) / 448              amax = max |x_i| over the block; rounded to nearest
    r   = 1 / s                               rounded to nearest
    q_i = RNE(clamp(x_i * r, -448, 448))      x_i * r in fp32, saturated, rounded to the nearest e4m3, ties to even
    x_i ~= q_i * s,    |x_i - q_i s| <= u |x_i| + 2^-10 s + 2^-22 |x_i|   (normal, subnormal, fp32 roundings of r)
The GPU rounds with the hardware's conversion (cvt.rn.satfinite), the interpreter with _round_to_e4m3 (its cast does
not round to nearest even), the reference with torch's cast: the tests require the same codes and scales.
Blocks (DeepSeek-V3's recipe, as cuBLAS runs it on Hopper): a scale per 128 elements along the summed dimension K;
activations and gradients 1 x 128 (an outlier spoils 128 values, not a row), weights 128 x 128 (serving W and W^T).
    forward  y  = x W^T      x (T, in) 1 x 128        W (out, in) 128 x 128
    dgrad    dx = dy W       dy (T, out) 1 x 128      W^T (in, out) 128 x 128
    wgrad    dW = dy^T x     dy^T (out, T) 1 x 128    x^T (in, T) 128 x 128
Every block lies inside one 128 x 128 tile: one program reads a tile and writes both layouts (rows and transposed)
with their scales, no pass for maxima; the MLP's h is quantized by the GLU's kernel as it makes each tile
(store_codes; kernels/swiglu.py), never stored. fp8_linears quantizes an input shared by several Linears (q/k/v;
gate/up) once and makes their summed dx as one product (their dy's side by side along K: one fp32 sum); backward
keeps x^T's codes (1 byte per element) instead of x. Weights are quantized at each use (once per step: a cache would
only hold memory). The lm_head's gradient products use the same blocks (kernels/cross_entropy.py's _fp8_pass).
"""
import torch
import triton
import triton.language as tl

from . import reference
from .common import FP8_ALIGN as PAD
from .common import FP8_BLOCK as BLOCK
from .common import as_rows

# The summed dimension K of every operand is padded with zero codes to whole groups of 4 blocks: cuBLAS reads 128 x 128
# scales in groups of 4 along K, while _scaled_mm's shape check passes the ungrouped layout, whose products are wrong
# where K is not a whole number of groups (BENCHMARKS.md). The Llama dims are multiples of 512 already.
K_PAD = 4 * BLOCK
WARPS = 4  # num_warps of _quantize_kernel (one 128 x 128 tile per program): `bench/fp8.py --warps` measures the choice


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
def _scale_and_inverse_rn(amax):
    """s = RN(max(amax, 1e-12) / 448) and r = RN(1 / s) by IEEE divisions (div_rn): the interpreter's path, and the
    oracle of _scale_and_inverse."""
    s = tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)  # common.FP8_AMAX_FLOOR, FP8_MAX
    return s, tl.math.div_rn(1.0, s)


@triton.jit
def _scale_and_inverse(amax):
    """_scale_and_inverse_rn's s and r, bit for bit, without div_rn's range checks and branches (GPU only). Each is a
    guess corrected by its remainder, which an fma gets exactly:
        s = q + (a - 448 q) c    q = a c, c = RN(1/448): a guess within an ulp corrected with a reciprocal within
                                 half an ulp rounds to the correctly rounded quotient (Markstein)
        r = y + y (1 - s y)      y = rcp.approx(s), the hardware's reciprocal (within an ulp): one Newton step
    s lies in [2^-49, 2^120], far from where div_rn takes its slow path. tests/test_fp8.py compares the two for every
    positive fp32 amax."""
    a = tl.maximum(amax, 1e-12)  # common.FP8_AMAX_FLOOR
    c: tl.constexpr = 1.0 / 448.0  # common.FP8_MAX; a constexpr rounds to fp32 in the multiply: RN(1/448)
    q = a * c
    s = tl.fma(tl.fma(-q, 448.0, a), c, q)
    y = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [s], dtype=tl.float32, is_pure=True, pack=1)
    return s, tl.fma(y, tl.fma(-s, y, 1.0), y)


@triton.jit
def _codes(x, amax, HW_CAST: tl.constexpr):
    """The e4m3 codes of x for the block maxima amax (broadcast against x), and the scales. HW_CAST: the GPU's own
    conversion (cvt.rn.satfinite: to nearest even, saturated to +-448, one instruction per two codes) and the
    branch-free _scale_and_inverse, so that an element costs a multiply and half a conversion; else the divisions,
    a clamp and _round_to_e4m3 (the interpreter)."""
    if HW_CAST:
        s, r = _scale_and_inverse(amax)
        return (x * r).to(tl.float8e4nv, fp_downcast_rounding="rtne"), s
    s, r = _scale_and_inverse_rn(amax)
    return _round_to_e4m3(tl.clamp(x * r, -448.0, 448.0)).to(tl.float8e4nv), s


@triton.jit
def store_codes(x, pid_r, pid_c, n_rows, n_cols, Q, S, QT, ST, stride_q, stride_qt, rows_q, cols_q, rows_qt,
                ROWS: tl.constexpr, COLS: tl.constexpr, B: tl.constexpr, HW_CAST: tl.constexpr):
    """Quantize tile (pid_r, pid_c) of an (n_rows, n_cols) tensor, x (B x B, fp32, B = 128), in the layouts asked.
    ROWS = 1: its codes into Q (rows_q, cols_q; row stride stride_q) with one scale per row of the tile, into S
    (cols_q / B, rows_q); ROWS = B: one scale for the tile, into S (rows_q / B, cols_q / B). COLS = 1 / B: the same
    for x^T, codes into QT (n_cols, rows_qt; row stride stride_qt), one scale per column of the tile into ST
    (rows_qt / B, n_cols), or one per tile into ST (n_cols / B, rows_qt / B; row stride stride_qt / B). Elements past
    n_rows / n_cols are padding: x must hold 0 there (the callers' loads fill in 0), so they get codes 0."""
    rows = pid_r.to(tl.int64) * B + tl.arange(0, B)  # int64: rows * stride passes 2^31
    cols = pid_c.to(tl.int64) * B + tl.arange(0, B)
    col_in = cols < n_cols
    a = tl.abs(x)
    if ROWS == 1:
        q, s = _codes(x, tl.max(a, axis=1)[:, None], HW_CAST)
        tl.store(S + pid_c * rows_q + rows[:, None], s, mask=rows[:, None] < rows_q)
    elif ROWS == B:
        q, s = _codes(x, tl.max(tl.max(a, axis=1), axis=0), HW_CAST)
        tl.store(S + pid_r * (cols_q // B) + pid_c, s, mask=pid_r * B < rows_q)
    if ROWS != 0:
        tl.store(Q + rows[:, None] * stride_q + cols[None, :], q,
                 mask=(rows < rows_q)[:, None] & (cols < cols_q)[None, :])
    if COLS == 1:
        q, s = _codes(x, tl.max(a, axis=0)[None, :], HW_CAST)
        tl.store(ST + pid_r * n_cols + cols[None, :], s, mask=col_in[None, :])
    elif COLS == B:
        q, s = _codes(x, tl.max(tl.max(a, axis=1), axis=0), HW_CAST)
        tl.store(ST + pid_c * (stride_qt // B) + pid_r, s, mask=pid_c * B < n_cols)
    if COLS != 0:
        tl.store(QT + cols[None, :] * stride_qt + rows[:, None], q,
                 mask=(rows < rows_qt)[:, None] & col_in[None, :])


@triton.jit(do_not_specialize=["n_rows"])
def _quantize_kernel(X, stride_x, Q, S, QT, ST, stride_q, stride_qt, n_rows, n_cols, rows_q, cols_q, rows_qt,
                     ROWS: tl.constexpr, COLS: tl.constexpr, B: tl.constexpr, HW_CAST: tl.constexpr):
    """Program (i, j): tile (i, j) of X read once and quantized in the layouts asked (store_codes). (Compiled for the
    H200 with n_rows = 1, which Triton specializes by default, the padding came out wrong.)"""
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows = pid_r.to(tl.int64) * B + tl.arange(0, B)
    cols = pid_c.to(tl.int64) * B + tl.arange(0, B)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=(rows < n_rows)[:, None] & (cols < n_cols)[None, :],
                other=0.0).to(tl.float32)
    store_codes(x, pid_r, pid_c, n_rows, n_cols, Q, S, QT, ST, stride_q, stride_qt, rows_q, cols_q, rows_qt, ROWS, COLS,
                B, HW_CAST)


def _scales(block_rows, n_rows, n_cols, device):
    """The scales of codes (n_rows, n_cols) in the layout torch._scaled_mm reads (reference.fp8_quantize)."""
    if block_rows == 1:
        return torch.empty((triton.cdiv(n_cols, BLOCK), n_rows), dtype=torch.float32, device=device)
    return torch.empty((triton.cdiv(n_rows, BLOCK), triton.cdiv(n_cols, BLOCK)), dtype=torch.float32, device=device)


def quantize(x, rows=0, cols=0, row_codes=None, col_codes=None):
    """The e4m3 codes of x (R, C) (bf16 or fp32, unit last stride) in one launch: (row_codes, col_codes), each
    (codes, scales) or None. rows = 1 or 128: codes (R16, C512) of x, one scale per block of `rows` rows x 128
    columns; cols = 1 or 128: codes (C, R512) of x^T, one scale per block of `cols` columns x 128 rows of x. R16 = R
    rounded up to 16 (PAD), C512 and R512 (the K of the product) to 512 (K_PAD); the padding gets codes 0. The scales
    as reference.fp8_quantize lays them out. row_codes (rows = 1), col_codes: (codes, scales) of those shapes to
    write into, views of wider ones (backward_gemms lays several side by side; the fused cross-entropy writes each
    chunk's columns of G^T): the codes' rows may be strided; col_codes' scales then have, for cols = 128, the codes'
    row stride / 128, and for cols = 1 are rows of a contiguous (blocks, C) tensor."""
    assert x.stride(1) == 1 or x.shape[1] <= 1, "fp8.quantize: the last dim must be contiguous"
    return quantize_tiles(_quantize_kernel, (x, x.stride(0)), *x.shape, rows, cols, row_codes, col_codes)


def quantize_tiles(kernel, sources, R, C, rows=0, cols=0, row_codes=None, col_codes=None, **meta):
    """quantize's buffers and launch, for any kernel that makes the (R, C) tensor's 128 x 128 tiles itself from its
    first arguments, `sources`, and hands them to store_codes: quantize's kernel loads them, kernels/swiglu.py's
    makes them (the MLP's h = act(g) u, never stored)."""
    assert rows in (0, 1, BLOCK) and cols in (0, 1, BLOCK), (rows, cols)
    rows_q, cols_q, rows_qt = triton.cdiv(R, PAD) * PAD, triton.cdiv(C, K_PAD) * K_PAD, triton.cdiv(R, K_PAD) * K_PAD
    dev = sources[0].device
    if row_codes is not None:
        q, s = row_codes
        assert rows == 1 and q.shape == (rows_q, cols_q) and q.stride(1) == 1, "fp8.quantize: row_codes' codes"
        assert s.shape == (cols_q // BLOCK, rows_q) and s.is_contiguous(), "fp8.quantize: row_codes' scales"
    else:
        q = torch.empty((rows_q, cols_q), dtype=torch.float8_e4m3fn, device=dev) if rows else None
        s = _scales(rows, rows_q, cols_q, dev) if rows else None
    if col_codes is not None:
        qt, st = col_codes
        assert cols and qt.shape == (C, rows_qt) and qt.stride(1) == 1, "fp8.quantize: col_codes' codes"
        if cols == BLOCK:
            assert st.shape == (triton.cdiv(C, BLOCK), rows_qt // BLOCK) and \
                st.stride() == (qt.stride(0) // BLOCK, 1), "fp8.quantize: col_codes' scales"
        else:
            assert st.shape == (rows_qt // BLOCK, C) and st.is_contiguous(), "fp8.quantize: col_codes' scales"
    else:
        qt = torch.empty((C, rows_qt), dtype=torch.float8_e4m3fn, device=dev) if cols else None
        st = _scales(cols, C, rows_qt, dev) if cols else None
    grid = (triton.cdiv(rows_qt if cols else rows_q, BLOCK), triton.cdiv(cols_q if rows else C, BLOCK))
    if (rows or cols) and grid[0] > 0 and grid[1] > 0:  # (neither layout asked for: nothing to launch)
        kernel[grid](*sources, q, s, qt, st, q.stride(0) if rows else 0, qt.stride(0) if cols else 0, R, C, rows_q,
                     cols_q, rows_qt, ROWS=rows, COLS=cols, B=BLOCK, HW_CAST=dev.type == "cuda",
                     **{"num_warps": WARPS, **meta})
    return (q, s) if rows else None, (qt, st) if cols else None


def scaled_mm(a, scale_a, b, scale_b, out_dtype=torch.bfloat16):
    """a b^T for e4m3 codes a (M, K) with 1 x 128 scales and b (N, K) with 128 x 128 scales, as quantize lays them
    out: one fp32 sum rounded to out_dtype. torch._scaled_mm on CUDA (b.t() and the scales' transposes are the
    layouts it takes); elsewhere (the interpreter tests) kernels/reference.py's simulation of it."""
    if not a.is_cuda:
        return reference.fp8_mm(a, scale_a, b, scale_b, out_dtype)
    return torch._scaled_mm(a, b.t(), scale_a=scale_a.t(), scale_b=scale_b.t(), out_dtype=out_dtype)


def _check_weight(weight):
    N, K = weight.shape
    assert N % PAD == 0 and K % PAD == 0, f"fp8: weight {tuple(weight.shape)}: both dims must be multiples of {PAD}"


def forward_gemm(x_rows, weight, M):
    """y = x W^T (M, N) in bf16 for x's row codes (quantize(x (M, K), rows=1)) and W (N, K)."""
    _check_weight(weight)
    return scaled_mm(*x_rows, *quantize(weight, rows=BLOCK)[0])[:M]


def backward_gemms(dys, weights, x_cols, dx_dtype, need_dx, need_dws):
    """(dx, [dW_i]) of y_i = x W_i^T (Linears that share x) for dy_i (M, N_i): dW_i = dy_i^T x (N_i, K) in W_i's
    dtype, and dx = sum_i dy_i W_i (M, K) in dx_dtype as ONE product [dy_1 ... dy_n] [W_1; ...; W_n]: every dy_i's
    row codes written side by side (each N_i padded to K_PAD with zero codes, so no block spans two), one fp32 sum,
    one rounding (no bf16 partial sums, no casts to x's dtype and adds). x_cols: x^T's codes (quantize(x,
    cols=128)), None where no dW is needed. One quantize per dy makes both its layouts; a product not needed is
    skipped (None)."""
    M = dys[0].shape[0]
    assert len(dys) == len(weights) == len(need_dws), (len(dys), len(weights), len(need_dws))
    for w in weights:
        _check_weight(w)
    widths = [triton.cdiv(w.shape[0], K_PAD) * K_PAD for w in weights]
    if need_dx:
        rows_q, width = triton.cdiv(M, PAD) * PAD, sum(widths)
        dy_codes = torch.empty((rows_q, width), dtype=torch.float8_e4m3fn, device=dys[0].device)
        dy_scales = _scales(1, rows_q, width, dys[0].device)
    dws, start = [], 0
    for dy, w, n, need_dw in zip(dys, weights, widths, need_dws):
        into = (dy_codes[:, start:start + n], dy_scales[start // BLOCK:(start + n) // BLOCK]) if need_dx else None
        dy_cols = quantize(dy, rows=1 if need_dx else 0, cols=1 if need_dw else 0, row_codes=into)[1]
        start += n
        dws.append(scaled_mm(*dy_cols, *x_cols, out_dtype=w.dtype) if need_dw else None)
    dy_cols = None  # (freed before the dx product)
    if not need_dx:
        return None, dws
    K = weights[0].shape[1]  # every W_i^T's codes (K, N_i padded) side by side, as dy's, and their scales
    w_codes = torch.empty((K, width), dtype=torch.float8_e4m3fn, device=dys[0].device)
    w_scales = _scales(BLOCK, K, width, dys[0].device)
    start = 0
    for w, n in zip(weights, widths):
        into = (w_codes[:, start:start + n], w_scales[:, start // BLOCK:(start + n) // BLOCK])
        quantize(w, cols=BLOCK, col_codes=into)
        start += n
    return scaled_mm(dy_codes, dy_scales, w_codes, w_scales, out_dtype=dx_dtype)[:M], dws


class _FP8Linears(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, *weights):
        rows = as_rows(x)
        need_dw = any(ctx.needs_input_grad[1:])  # (x's codes are not kept where no weight needs a gradient)
        x_rows, x_cols = quantize(rows, rows=1, cols=BLOCK if need_dw else 0)
        out_dtype = reference.fp8_out_dtype(x)  # (no copy when bf16, as under autocast)
        ys = [forward_gemm(x_rows, w, rows.shape[0]).to(out_dtype).view(*x.shape[:-1], w.shape[0]) for w in weights]
        ctx.save_for_backward(*(x_cols or ()), *weights)  # x^T's codes: 1 byte per element
        ctx.x_shape, ctx.x_dtype, ctx.n_saved = x.shape, x.dtype, 2 if need_dw else 0
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys):
        saved = ctx.saved_tensors  # once: a checkpointed block's saved tensors can be unpacked only once
        x_cols, weights = saved[:ctx.n_saved] or None, saved[ctx.n_saved:]
        dx, dws = backward_gemms([as_rows(dy) for dy in dys], weights, x_cols, ctx.x_dtype, ctx.needs_input_grad[0],
                                 ctx.needs_input_grad[1:])
        return None if dx is None else dx.view(ctx.x_shape), *dws


def fp8_linears(x, weights):
    """[x W^T for W in weights] for x (..., K) and weights (N_i, K), N_i and K multiples of 16, all three products of
    forward and backward in FP8 e4m3, x quantized once for all of them (the module docstring). Each y holds bf16
    values (_scaled_mm's) in the dtype F.linear would give it (reference.fp8_out_dtype: bf16 under autocast); dx
    has x's dtype, each dW its weight's."""
    return _FP8Linears.apply(x, *weights)
