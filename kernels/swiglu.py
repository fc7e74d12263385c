"""Gated linear units in Triton: h = act(g) * u, for SwiGLU (act = silu) and GeGLU (act = tanh-GELU).

Forward, elementwise on gate g and up u (computed in fp32, stored in the input dtype):
    silu(g)      = g * sigmoid(g)
    gelu_tanh(g) = 0.5 g (1 + tanh(z)),  z = sqrt(2/pi) (g + 0.044715 g^3)
                 = g * sigmoid(2z)                  (as 0.5 (1 + tanh(z)) = sigmoid(2z); no tanh needed)
    h = act(g) * u

Backward, with dh the gradient of h:
    dg = dh * u * act'(g)        du = dh * act(g)
    silu'(g)      = s + g s (1 - s),                                 s = sigmoid(g)
    gelu_tanh'(g) = s + g s (1 - s) * 2 sqrt(2/pi) (1 + 3 * 0.044715 g^2),  s = sigmoid(2z)
act(g) is recomputed from g, so only g and u are saved: nothing else of size (T, F).

With the down projection fused in (`down` = W_down, (D, F)): out = h W_down^T, and backward first makes h
again from g and u (one elementwise pass) for
    dW_down = dout^T h        dh = dout W_down
so h, the input the down projection would otherwise keep for its dW (T x F values per layer), is never held
between forward and backward, for one extra read of g and u. In FP8 (use_fp8: kernels/fp8.py) h is not even
stored: _glu_codes_kernel makes its e4m3 codes from g and u tile by tile (rows in forward, h^T's in backward).

Backward writes dg over g and du over u, which nothing needs once their gradients exist: two (T, F) buffers, the
largest activations of the MLP (as Liger-Kernel's and Unsloth's SwiGLU do). What that asks of the caller is the
in-place contract in kernels/__init__.py; _may_overwrite and the version counters guard it.
"""
import torch
import triton
import triton.language as tl
from torch.autograd.graph import increment_version

from . import fp8
from .common import ACTIVATIONS, as_rows, mm_fp32
from .fp8 import store_codes

@triton.jit
def _row_and_cols(n_cols, BLOCK: tl.constexpr, LONG_INDEXING: tl.constexpr):
    """Program pid handles BLOCK columns of one row: rows are split into cdiv(n_cols, BLOCK) programs."""
    pid = tl.program_id(0)
    if LONG_INDEXING:
        pid = pid.to(tl.int64)  # everything derived from it (row, cols, offsets) is then int64
    blocks_per_row = tl.cdiv(n_cols, BLOCK)
    row = pid // blocks_per_row
    cols = (pid % blocks_per_row) * BLOCK + tl.arange(0, BLOCK)
    return row, cols


@triton.jit
def _act_and_derivative(g, ACTIVATION: tl.constexpr):
    """act(g) and act'(g) in fp32 (see the module docstring)."""
    if ACTIVATION == "silu":
        s = tl.sigmoid(g)
        ds = 1.0
    else:  # gelu_tanh
        k = 0.7978845608028654  # sqrt(2 / pi)
        s = tl.sigmoid(2.0 * k * (g + 0.044715 * g * g * g))
        ds = 2.0 * k * (1.0 + 3.0 * 0.044715 * g * g)
    return g * s, s + g * s * (1.0 - s) * ds


@triton.jit
def _glu_fwd_kernel(G, U, H, stride_g, stride_u, stride_h, n_cols,
                    ACTIVATION: tl.constexpr, BLOCK: tl.constexpr, LONG_INDEXING: tl.constexpr):
    row, cols = _row_and_cols(n_cols, BLOCK, LONG_INDEXING)
    mask = cols < n_cols
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    a, _ = _act_and_derivative(g, ACTIVATION)
    tl.store(H + row * stride_h + cols, (a * u).to(H.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd_kernel(G, U, DH, DG, DU, stride_g, stride_u, stride_dh, stride_dg, stride_du, n_cols,
                    ACTIVATION: tl.constexpr, BLOCK: tl.constexpr, LONG_INDEXING: tl.constexpr):
    row, cols = _row_and_cols(n_cols, BLOCK, LONG_INDEXING)
    mask = cols < n_cols
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(DH + row * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
    a, da = _act_and_derivative(g, ACTIVATION)
    # DG and DU are usually G and U themselves: each element is read above before it is overwritten here.
    tl.store(DG + row * stride_dg + cols, (dh * u * da).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + row * stride_du + cols, (dh * a).to(DU.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_rows"])
def _glu_codes_kernel(G, U, stride_g, stride_u, Q, S, QT, ST, stride_q, stride_qt, n_rows, n_cols, rows_q,
                      cols_q, rows_qt, ROWS: tl.constexpr, COLS: tl.constexpr, B: tl.constexpr, HW_CAST: tl.constexpr,
                      ACTIVATION: tl.constexpr):
    """FP8 codes of tile (i, j) of h = act(g) * u, made as _glu_fwd_kernel makes it and rounded to g's dtype as it
    stores it, then quantized by fp8.store_codes (fp8.quantize_tiles' layouts): the same codes as quantizing the
    stored h, without storing it and reading it back."""
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows = pid_r.to(tl.int64) * B + tl.arange(0, B)
    cols = pid_c.to(tl.int64) * B + tl.arange(0, B)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a, _ = _act_and_derivative(g, ACTIVATION)
    h = (a * u).to(G.dtype.element_ty).to(tl.float32)  # 0 past the tensor (act(0) 0), as store_codes needs
    store_codes(h, pid_r, pid_c, n_rows, n_cols, Q, S, QT, ST, stride_q, stride_qt, rows_q, cols_q, rows_qt, ROWS,
                COLS, B, HW_CAST)


WARPS = 16  # num_warps of _glu_codes_kernel (two 128 x 128 tiles in fp32 per program): `bench/fp8.py --warps`


def _glu_codes(g, u, activation, rows=0, cols=0):
    """fp8.quantize(h, rows, cols) of h = act(g) * u (in g's dtype), with h never stored."""
    return fp8.quantize_tiles(_glu_codes_kernel, (g, u, g.stride(0), u.stride(0)), *g.shape, rows, cols,
                              ACTIVATION=activation, num_warps=WARPS)


def _needs_int64(*row_views):
    """Does the offset row * row_stride + col of the last element of any (rows, F) view reach 2^31? (The FFN
    activations of a 128K-token step do: 2^17 x 14336 elements.) Then LONG_INDEXING makes the offsets int64."""
    return any((t.shape[0] - 1) * t.stride(0) + t.shape[1] >= 2**31 for t in row_views)


def _launch(kernel, row_views, strided_args, activation):
    """One program per BLOCK columns of each row of the first (rows, F) view."""
    n_rows, n_cols = row_views[0].shape
    BLOCK = min(1024, triton.next_power_of_2(n_cols))  # 1024 bf16 = 4 warps x 32 threads x one 16-byte vector
    grid = (n_rows * triton.cdiv(n_cols, BLOCK),)
    if grid[0] > 0:
        kernel[grid](*row_views, *strided_args, n_cols, ACTIVATION=activation, BLOCK=BLOCK,
                     LONG_INDEXING=_needs_int64(*row_views), num_warps=4)


def _glu_h(g, u, activation):
    """h = act(g) * u for g, u (rows, F), stored in g's dtype."""
    h = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    _launch(_glu_fwd_kernel, (g, u, h), (g.stride(0), u.stride(0), h.stride(0)), activation)
    return h


def _may_overwrite(t, rows):
    """May backward write t's gradient over `rows`, t's (rows, F) memory? Only for the output of an autograd
    op (not a leaf: user data such as a parameter or a test input, nor a view of one) whose rows do not overlap
    each other (an expanded tensor's do): the others get a freshly allocated gradient."""
    root = t._base if t._base is not None else t  # a view's _base is the tensor that owns the memory
    return root.grad_fn is not None and rows.stride(0) >= rows.shape[1]


class _GLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, activation, down, use_fp8):
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}: expected one of {ACTIVATIONS}")
        assert gate.shape == up.shape, f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape"
        assert gate.dtype == up.dtype, f"gate is {gate.dtype} but up is {up.dtype}"
        g, u = as_rows(gate), as_rows(up)  # a chunk of a fused (T, 2F) projection: a view of row stride 2F
        # a weight of another dtype than the activations: the products take its copy in theirs, as F.linear's would
        # under autocast; for an fp32 master weight dW_down is written in fp32 by its GEMM (mm_fp32), other dtypes
        # get theirs from autograd's cast. (FP8 quantizes the weight itself.)
        ctx.master = False
        if down is not None and not use_fp8 and down.dtype != gate.dtype:
            ctx.master = down.dtype == torch.float32
            down = down.to(gate.dtype)
        ctx.save_for_backward(g, u, down)
        ctx.activation, ctx.shape, ctx.fp8 = activation, gate.shape, use_fp8
        ctx.overwrite_g = _may_overwrite(gate, g)
        ctx.overwrite_u = _may_overwrite(up, u) and up.data_ptr() != gate.data_ptr()  # glu(x, x): not twice
        if down is None:
            return _glu_h(g, u, activation).view(gate.shape)
        if use_fp8:  # h's codes made straight from g and u: h is never stored
            out = fp8.forward_gemm(_glu_codes(g, u, activation, rows=1)[0], down, g.shape[0]).to(gate.dtype)
        else:
            out = _glu_h(g, u, activation) @ down.T
        return out.view(*gate.shape[:-1], down.shape[0])  # h is dropped here: backward makes it again

    @staticmethod
    def backward(ctx, dout):
        g, u, down = ctx.saved_tensors
        d_down = None
        if down is None:
            dh = as_rows(dout)
        else:
            dout = as_rows(dout)  # (T, D)
            need_down = ctx.needs_input_grad[3]
            if ctx.fp8:  # dW_down reads h^T's codes, made again from g and u (h is never stored)
                h_cols = _glu_codes(g, u, ctx.activation, cols=fp8.BLOCK)[1] if need_down else None
                dh, (d_down,) = fp8.backward_gemms([dout], [down], h_cols, g.dtype, True, [need_down])
                del h_cols
            else:
                if need_down:  # dW_down needs h: make it again, use it, free it before dh is allocated
                    h = _glu_h(g, u, ctx.activation)
                    d_down = mm_fp32(dout.T, h) if ctx.master else dout.T @ h
                    del h
                dh = dout @ down
        dg = g if ctx.overwrite_g else torch.empty(g.shape, dtype=g.dtype, device=g.device)
        du = u if ctx.overwrite_u else torch.empty(u.shape, dtype=u.dtype, device=u.device)
        _launch(_glu_bwd_kernel, (g, u, dh, dg, du),
                (g.stride(0), u.stride(0), dh.stride(0), dg.stride(0), du.stride(0)), ctx.activation)
        # Triton's writes are invisible to autograd: record them, so that another op that saved g or u for its own
        # backward and runs later fails with "modified by an inplace operation" instead of reading gradients as
        # activations. (The counter is shared by every view of the same memory: an op that saved another slice of
        # the projection's output would fail too; in a Llama MLP none does.)
        for t, overwritten in ((g, ctx.overwrite_g), (u, ctx.overwrite_u)):
            if overwritten:
                increment_version(t)
        return dg.view(ctx.shape), du.view(ctx.shape), None, d_down, None


def glu(gate, up, activation="silu", down=None, use_fp8=False):
    """h = act(gate) * up, act = silu (SwiGLU) or tanh-approximated GELU (GeGLU); gate, up (..., F).
    With `down` (D, F), the down projection's weight: h @ down.T, without keeping h for backward; with use_fp8 that
    product and its two gradients in FP8 (kernels/fp8.py: forward_gemm, backward_gemms).

    Backward overwrites gate and up with their gradients (unless they are leaves): see kernels/__init__.py.
    """
    if down is not None:
        assert down.shape[-1] == gate.shape[-1], f"down {tuple(down.shape)} does not take gate {tuple(gate.shape)}"
    return _GLU.apply(gate, up, activation, down, use_fp8)
