"""Rotary position embedding in Triton: q and k rotated in place, both in one launch.

Each head vector x of size D is split into halves x1 = x[:D/2], x2 = x[D/2:] (the "rotate_half" layout of
Llama in Hugging Face, as in reference.apply_rope). Pair i = (x1_i, x2_i) turns by angle p * inv_freq_i, where
p is the token's position inside its own sequence (packed stream: positions restart at 0 per sequence):
    c, s = cos[p], sin[p]                      (fp32 tables (max_pos, D/2) from reference.rope_cache)
    out1 = x1 * c - x2 * s
    out2 = x2 * c + x1 * s
i.e. out = R(theta) x with R a 2x2 rotation per pair. Backward: R is orthogonal, so
    dx = R(theta)^T dout = R(-theta) dout :   dx1 = d1 * c + d2 * s,   dx2 = d2 * c - d1 * s
the same kernel with sin -> -sin. Nothing of size T is saved: only the (shared) tables and positions.

One program per token: it reads that token's cos/sin row once and rotates all Hq query heads and all Hkv key
heads. q and k may be strided views, e.g. heads of a fused qkv projection (T, (Hq + 2 Hkv) * D); only the last
dim must be contiguous. Forward rotates q and k in place, backward the incoming gradients: what that asks of the
caller is the in-place contract in kernels/__init__.py. (One program per token rotating q and k together is the
layout of Liger-Kernel's RoPE kernel; here it also gathers cos/sin by per-token position, for packed sequences,
and takes strided heads.)
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(X, token, stride_t, stride_h, n_heads, cos, sin,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotate the n_heads head vectors of one token in place; cos, sin are (1, BLOCK_HALF) fp32."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < n_heads) & (dims < HALF)
    first = X + token * stride_t + heads * stride_h + dims  # pointers to x1; x2 sits HALF further
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(X.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(X.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(Q, K, COS, SIN, POS, stride_qt, stride_qh, stride_kt, stride_kh, n_q_heads, n_kv_heads,
                 HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 INVERSE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)  # int64: T * token stride passes 2^31 in long steps
    pos = tl.load(POS + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    cos = tl.load(COS + pos * HALF + dims, mask=dims < HALF, other=0.0)[None, :]
    sin = tl.load(SIN + pos * HALF + dims, mask=dims < HALF, other=0.0)[None, :]
    if INVERSE:  # backward: rotate by -theta
        sin = -sin
    _rotate_heads(Q, token, stride_qt, stride_qh, n_q_heads, cos, sin, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(K, token, stride_kt, stride_kh, n_kv_heads, cos, sin, HALF, BLOCK_HKV, BLOCK_HALF)


def _rotate_(q, k, cos, sin, positions, inverse):
    """Rotate q (T, Hq, D) and k (T, Hkv, D) in place by +theta (or -theta when inverse), one launch."""
    T, n_q_heads, D = q.shape
    n_kv_heads = k.shape[1]
    HALF = D // 2
    BLOCK_HQ, BLOCK_HKV = triton.next_power_of_2(n_q_heads), triton.next_power_of_2(n_kv_heads)
    BLOCK_HALF = triton.next_power_of_2(HALF)
    # 32 query heads x 64 pairs = 2048 values per half tile: 8 warps give each thread 8 of them, half what 4 warps
    # would, so each thread needs fewer registers and more programs fit on an SM.
    num_warps = min(max(BLOCK_HQ * BLOCK_HALF // 256, 1), 8)
    if T > 0:
        _rope_kernel[(T,)](q, k, cos, sin, positions, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                           n_q_heads, n_kv_heads, HALF=HALF, BLOCK_HQ=BLOCK_HQ, BLOCK_HKV=BLOCK_HKV,
                           BLOCK_HALF=BLOCK_HALF, INVERSE=inverse, num_warps=num_warps)


def _rotatable_in_place(x):
    """Can x (T, H, D) be rotated in place: unit last stride, and every element at its own address?"""
    T, H, D = x.shape
    token_span = (H - 1) * x.stride(1) + D  # the memory one token's heads cover
    return x.stride(2) == 1 and (H == 1 or x.stride(1) >= D) and (T == 1 or x.stride(0) >= token_span)


def _check_inputs(q, k, cos, sin, positions):
    assert q.dim() == 3 and k.dim() == 3, f"q, k must be (T, H, D), got {tuple(q.shape)}, {tuple(k.shape)}"
    T, _, D = q.shape
    assert k.shape[0] == T and k.shape[2] == D, f"k {tuple(k.shape)} does not match q {tuple(q.shape)}"
    assert D % 2 == 0, f"head_dim {D} must be even"
    assert q.dtype == k.dtype, f"q is {q.dtype} but k is {k.dtype}"
    for name, x in (("q", q), ("k", k)):
        assert _rotatable_in_place(x), (
            f"{name} must have a contiguous last dim and non-overlapping heads/tokens "
            f"(strides {x.stride()}); token and head strides may be anything larger")
    assert cos.shape == sin.shape and cos.dim() == 2 and cos.shape[1] == D // 2, \
        f"cos/sin must be (max_positions, {D // 2}), got {tuple(cos.shape)}, {tuple(sin.shape)}"
    assert cos.is_contiguous() and sin.is_contiguous(), "cos and sin tables must be contiguous"
    assert cos.dtype == torch.float32 and sin.dtype == torch.float32, "cos/sin tables must be fp32"
    assert positions.shape == (T,) and positions.is_contiguous(), f"positions must be contiguous ({T},)"
    assert cos.device == sin.device == positions.device == q.device == k.device, "all inputs on one device"
    assert positions.dtype in (torch.int32, torch.int64), f"positions must be integers, got {positions.dtype}"


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, positions):
        _check_inputs(q, k, cos, sin, positions)
        # In place, and autograd is not told: ctx.mark_dirty(q, k) is refused when the inputs are views and the
        # Function has two outputs, and for the outputs of a multi-view op such as qkv.split(); bumping the version
        # counters would make autograd reject v (q, k and v of one split share qkv's counter). So autograd sees q
        # and k as the un-rotated inputs, with the rotation as this Function's backward.
        _rotate_(q, k, cos, sin, positions, inverse=False)
        ctx.save_for_backward(cos, sin, positions)
        return q, k

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin, positions = ctx.saved_tensors
        # The grads are ours to rotate in place when an op made them for us (attention's backward, a matmul's);
        # copied first: a grad whose elements share memory (the stride-0 grad of out.sum()), and dk being dq.
        if not _rotatable_in_place(dq):
            dq = dq.clone(memory_format=torch.contiguous_format)
        if not _rotatable_in_place(dk) or dk.data_ptr() == dq.data_ptr():
            dk = dk.clone(memory_format=torch.contiguous_format)
        _rotate_(dq, dk, cos, sin, positions, inverse=True)
        return dq, dk, None, None, None


def apply_rope(q, k, cos, sin, positions):
    """Rotate q (T, Hq, D) and k (T, Hkv, D) IN PLACE by each token's position; returns (q, k).

    cos, sin: fp32 (max_positions, D/2) from reference.rope_cache; positions: (T,) int32. The returned
    tensors share q's and k's memory; use them, not the inputs, from here on (kernels/__init__.py).
    """
    return _RoPE.apply(q, k, cos, sin, positions)
