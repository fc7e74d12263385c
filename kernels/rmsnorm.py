"""RMSNorm in Triton, alone or fused with the residual add before it: one row of the hidden state per program,
statistics in fp32.

Forward, for each row x of length H (r is the row's inverse root-mean-square):
    r = 1 / sqrt(mean(x^2) + eps)        x^ = x * r        y = x^ * w
Only x and r (one fp32 per row) are saved: x^ is cheap to recompute.

Backward. With g = dy * w (the gradient reaching x^), and since dr/dx_j = -r^3 x_j / H:
    dx_i = r * g_i  -  (r^3 / H) * x_i * sum_j g_j x_j
         = r * (g_i - x^_i * mean(g * x^))
    dw   = sum over rows of dy * x^
dw is a sum over every row, i.e. a reduction across programs. Instead of atomics, each program walks a contiguous
block of rows, keeps its own fp32 running sum of dy * x^ (a row of length H) and writes it out once; torch sums
those few partial rows at the end (the "partial dw" of the Triton layer-norm tutorial and Liger-Kernel's RMSNorm).

Fused residual add (add_rms_norm). In a block, h = x + delta (delta: the attention's or the MLP's output) is the
residual stream, and the next norm reads it again. Fused, the forward reads x and delta and writes h, rounded to
its dtype before the statistics (so h and y are exactly what `x + delta` followed by rms_norm gives), and
y = rms_norm(h). In backward h has two consumers: y, and its later uses (the next residual add), whose gradient
dh_out autograd would add to the norm's in another elementwise pass; the kernel adds it in the same pass, in fp32:
    dh = dh_out + dx(above, with x = h)
and the add's gradient is the identity: dx = ddelta = dh, one tensor handed to both, as torch's x + delta does
(where their dtypes differ, the kernel writes dh in both: no cast pass after it). Elements moved: forward 4 (read
x, delta; write h, y) instead of 5 (the add's 3, the norm's 2), backward 4 (read h, dy, dh_out; write dh), not 6.
"""
import torch
import triton
import triton.language as tl

from .common import as_rows


@triton.jit
def _rms_norm_fwd_kernel(X, DELTA, HX, Y, W, RSTD, stride_x, stride_d, stride_h, stride_y, H, eps,
                         ADD: tl.constexpr, BLOCK: tl.constexpr):
    """y = rms_norm(x) * w; with ADD, of h = x + delta instead, h written to HX (DELTA and HX unused without ADD)."""
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride passes 2^31 at 512K tokens of hidden 4096
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:  # h rounded to its dtype before the statistics: the h that backward reads and that x + delta gives
        h = (x + tl.load(DELTA + row * stride_d + cols, mask=mask, other=0.0).to(tl.float32)).to(HX.dtype.element_ty)
        tl.store(HX + row * stride_h + cols, h, mask=mask)
        x = h.to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)  # masked lanes are 0: they add nothing to the sum
    tl.store(Y + row * stride_y + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(X, W, RSTD, DY, DH_OUT, DX, DX_LOW, DW_PARTIAL, stride_x, stride_dy, stride_dho, stride_dx,
                         stride_dxl, n_rows, H, rows_per_program, ADD: tl.constexpr, LOW: tl.constexpr,
                         BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """dx of rms_norm (X: the normalised input, h when fused); with ADD, plus dh_out (DH_OUT unused without ADD);
    with LOW, the same dx also in DX_LOW's narrower dtype (the fused add's input of that dtype)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)  # this program's share of dw = sum_rows dy * x^
    first = pid.to(tl.int64) * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    # int64 bounds, so `row` is int64 too. STAGES (_backward_stages): the next rows' loads are in flight while this
    # row is reduced, instead of each row's loads waiting for the previous row's block-wide sum (BENCHMARKS.md)
    for row in tl.range(first, last, num_stages=STAGES):
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        x_hat = x * rstd
        g = dy * w
        dx = (g - x_hat * (tl.sum(g * x_hat, axis=0) / H)) * rstd
        if ADD:  # dh = dh_out + the norm's dx, summed in fp32 and rounded once
            dx += tl.load(DH_OUT + row * stride_dho + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        if LOW:
            tl.store(DX_LOW + row * stride_dxl + cols, dx.to(DX_LOW.dtype.element_ty), mask=mask)
        dw += dy * x_hat
    tl.store(DW_PARTIAL + pid * H + cols, dw, mask=mask)


def _num_warps(block):
    """About 16 values of a row per thread (8 warps at hidden 4096), 4 to 16 warps: wider programs spend longer in
    their block-wide reductions, which in backward stall the row loop (32 warps against 8: BENCHMARKS.md)."""
    return min(max(block // 512, 4), 16)


def _backward_programs(n_rows, device):
    """Two programs per SM: one per SM leaves memory bandwidth idle, more gain nothing and add partial-dw rows to
    sum. Off CUDA (the interpreter) there are no SMs to fill: a program per row, the launch the GPU makes for up to
    2 * SMs rows."""
    if device.type != "cuda":
        return n_rows
    return min(n_rows, 2 * torch.cuda.get_device_properties(device).multi_processor_count)


def _backward_stages(block, shared_bytes, *rows):
    """Software-pipeline stages of the backward's row loop: 3, while the rows in flight (x, dy and dh_out of `block`
    elements each, the tensors in `rows`) fit in ~192 KB of the SM's shared memory and in shared_bytes, the GPU's
    shared memory per block (None: no limit); else 1 (no pipelining). The H200 has 227 KB per block, sm_86 / sm_89
    99 KB: 3 stages of the fused add's fp32 rows at hidden 4096 take 104 KB, a kernel Triton refuses to launch there
    (bench/compile_targets.py)."""
    budget = 192 << 10 if shared_bytes is None else min(192 << 10, shared_bytes)
    return 3 if budget // (block * sum(t.element_size() for t in rows)) >= 3 else 1


def _shared_memory_per_block(device):
    """The most shared memory one program may use on `device` (the opt-in limit); None off CUDA (the interpreter)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


class _RMSNorm(torch.autograd.Function):
    """rms_norm(x) (delta None: one output, y), or add_rms_norm(x, delta) (two outputs, h and y)."""

    @staticmethod
    def forward(ctx, x, delta, weight, eps):
        H = x.shape[-1]
        assert weight.shape == (H,), f"weight must be ({H},), got {tuple(weight.shape)}"
        assert weight.is_contiguous(), "weight must be contiguous"
        assert delta is None or delta.shape == x.shape, f"delta {tuple(delta.shape)} != x {tuple(x.shape)}"
        BLOCK = triton.next_power_of_2(H)
        assert BLOCK <= 16384, f"hidden size {H} > 16384: one row no longer fits a program"
        x_rows = as_rows(x)
        n_rows = x_rows.shape[0]
        d_rows, h_rows = x_rows, x_rows  # without delta: unused stand-ins, and the normalised input is x itself
        if delta is not None:
            d_rows = as_rows(delta)
            h_rows = torch.empty((n_rows, H), dtype=torch.promote_types(x.dtype, delta.dtype), device=x.device)
        y = torch.empty((n_rows, H), dtype=h_rows.dtype, device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        if n_rows > 0:
            _rms_norm_fwd_kernel[(n_rows,)](x_rows, d_rows, h_rows, y, weight, rstd, x_rows.stride(0),
                                            d_rows.stride(0), h_rows.stride(0), y.stride(0), H, eps,
                                            ADD=delta is not None, BLOCK=BLOCK, num_warps=_num_warps(BLOCK))
        ctx.save_for_backward(h_rows, weight, rstd)
        ctx.shape, ctx.dtypes = x.shape, None if delta is None else (x.dtype, delta.dtype)
        ctx.set_materialize_grads(False)  # no zeros for an unused h (the final norm's): the kernel skips dh_out
        return y.view(x.shape) if delta is None else (h_rows.view(x.shape), y.view(x.shape))

    @staticmethod
    def backward(ctx, *grads):
        dh_out, dy = grads if ctx.dtypes else (None, grads[0])
        h_rows, weight, rstd = ctx.saved_tensors
        n_rows, H = h_rows.shape
        if dy is None:  # y not used (only h was): rare, so no kernel variant for it
            dy = torch.zeros_like(h_rows)
        BLOCK = triton.next_power_of_2(H)
        dy_rows = as_rows(dy)  # row stride 0 when expanded, as the grad of y.sum(0) is
        dho_rows = dy_rows if dh_out is None else as_rows(dh_out)  # a stand-in without dh_out, unused
        dh = torch.empty((n_rows, H), dtype=h_rows.dtype, device=h_rows.device)
        # x and delta of two dtypes (fp32 stream, bf16 delta under autocast): dh in both, from one pass (two inputs
        # both narrower than h, as fp16 + bf16, are cast below)
        narrower = {t for t in ctx.dtypes or () if t != dh.dtype}
        low_dtype = narrower.pop() if len(narrower) == 1 else None
        dh_low = dh if low_dtype is None else torch.empty((n_rows, H), dtype=low_dtype, device=h_rows.device)
        n_programs = _backward_programs(n_rows, h_rows.device)
        dw = None
        if n_programs > 0:
            rows_per_program = triton.cdiv(n_rows, n_programs)
            n_programs = triton.cdiv(n_rows, rows_per_program)  # so that no program is left without rows
            dw_partial = torch.empty((n_programs, H), dtype=torch.float32, device=h_rows.device)
            rows = [h_rows, dy_rows] + ([] if dh_out is None else [dho_rows])  # the rows the loop reads
            stages = _backward_stages(BLOCK, _shared_memory_per_block(h_rows.device), *rows)
            _rms_norm_bwd_kernel[(n_programs,)](h_rows, weight, rstd, dy_rows, dho_rows, dh, dh_low, dw_partial,
                                                h_rows.stride(0), dy_rows.stride(0), dho_rows.stride(0), dh.stride(0),
                                                dh_low.stride(0), n_rows, H, rows_per_program,
                                                ADD=dh_out is not None, LOW=low_dtype is not None, BLOCK=BLOCK,
                                                STAGES=stages, num_warps=_num_warps(BLOCK))
            dw = dw_partial.sum(0).to(weight.dtype)
        elif ctx.needs_input_grad[2]:
            dw = torch.zeros_like(weight)
        dh, dh_low = dh.view(ctx.shape), dh_low.view(ctx.shape)
        if ctx.dtypes is None:
            return dh, None, dw, None
        # The add's gradient: one tensor for both inputs when their dtypes agree, as torch's x + delta hands out.
        return tuple(dh if t == dh.dtype else dh_low if t == low_dtype else dh.to(t) for t in ctx.dtypes) + (dw, None)


def rms_norm(x, weight, eps):
    """y = x / sqrt(mean(x^2, -1) + eps) * weight over the last dim of x (..., H); y has x's dtype."""
    return _RMSNorm.apply(x, None, weight, eps)


def add_rms_norm(x, delta, weight, eps):
    """(h, y) = (x + delta, rms_norm(x + delta, weight, eps)) in one pass; x and delta of one shape (..., H). h and y
    have the dtype of x + delta. Writes no input; backward gives x and delta one gradient tensor (module docstring)."""
    return _RMSNorm.apply(x, delta, weight, eps)
