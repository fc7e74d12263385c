"""Fused output projection + cross-entropy that never holds the whole [tokens, vocab] logits matrix.

With h (N, H) the last hidden states, W (V, H) the output embedding and y (N,) the next-token labels
(IGNORE_INDEX = -100: no target), the loss of the step is the sum over counted tokens i of
    z_i    = W h_i                                   (V logits of token i)
    lse_i  = log sum_v exp(z_iv)                     (log-sum-exp over the vocabulary)
    loss_i = lse_i - z_i,y_i
Backward, written out. The softmax p_i = exp(z_i - lse_i) gives
    g_iv  = p_iv - [v == y_i]                                               (d loss_i / d z_iv)
    dh_i  = sum_v g_iv W_v            i.e.  dh = G W
    dW    = sum_i g_i h_i^T           i.e.  dW = G^T h

The tokens go through in chunks whose fp32 logits fit a memory budget (_default_budget): per chunk, one matmul
gives the logits, one Triton kernel turns them into the loss and G (written over the logits), and two more
matmuls fold G into dh and dW at once (or, for a 16-bit W over several chunks where G of every counted token is no
bigger than an fp32 sum of dW, G is kept and dW is one matmul after the loop: _chunked_pass; with fp8_grads the
two are FP8 products of G's codes, made chunk by chunk: _fp8_pass). So every gradient is
made in forward (the loss is the model's last op); backward only multiplies them by the upstream gradient, and can
run once. The kernel finds lse with the online log-sum-exp over blocks of the vocabulary, m the running max and s
the running sum of exp(z - m):
    m' = max(m, max(block)),   s' = s * exp(m - m') + sum(exp(block - m')),   lse = m + log(s)
then re-reads the row and writes g. Logits and sums are fp32 (_chunked_pass). Ideas from Liger-Kernel's fused
linear cross-entropy (gradients made in forward, chunking by tokens) and the online softmax of the Triton
fused-attention tutorial; the code is our own.
"""
import torch
import triton
import triton.language as tl

from . import fp8
from .common import FP8_ALIGN, IGNORE_INDEX, as_rows

LOGITS_CHUNK_BYTES = 1 << 30  # default memory of one chunk's fp32 logits and a matmul copy of W (if one is made)
# The dW matmul of a chunk of n tokens reads and writes the fp32 sum (8 V H bytes) for 2 n V H flops: n / 4
# flops per byte. At 1024 tokens that is the H100's ridge (~240 flop/byte: 790 TFLOP/s over 3.35 TB/s), where the
# sum's traffic slows the product; from 2048 on it is twice the ridge (the H200's is ~165). BENCHMARKS.md measures it.
MIN_CHUNK_TOKENS = 2048
# The FP8 pass sums no dW chunk by chunk (it keeps G^T's codes for one product after the loop): there the floor only
# keeps each chunk's products large, which 1024 tokens already do; more would only cost memory.
MIN_CHUNK_TOKENS_FP8 = 1024
MAX_BLOCK_V = 8192  # vocabulary entries one program handles per step of its loop
INT32_MAX_NUMEL = 2**31  # from this offset (in elements) on, a chunk's addresses need int64


# ----------------------------------------------------------------------------------------------------------
# Triton kernel: loss and logits gradient of each row of a logits chunk
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _load_logits(logits_row, cols, V):
    """One block of a logits row in fp32; lanes past the vocabulary hold -inf (zero mass)."""
    in_vocab = cols < V
    z = tl.load(logits_row + cols, mask=in_vocab, other=0.0).to(tl.float32)
    return tl.where(in_vocab, z, float("-inf"))


@triton.jit
def _cross_entropy_rows_kernel(
    logits_ptr, grad_ptr, labels_ptr, loss_ptr,
    V, logits_row_stride, grad_row_stride,
    WRITE_GRAD: tl.constexpr, INT64_OFFSETS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One program per row: loss = lse - z[label]; with WRITE_GRAD, grad row = g (see the module docstring).

    The grad row may start where the logits row starts, in fp32 (same bytes) or in bf16 (the first half of
    the row's bytes). Either way every logit is read before the bytes it sits in are overwritten (see pass 2).
    """
    row = tl.program_id(0)
    if INT64_OFFSETS:
        row = row.to(tl.int64)
    logits_row = logits_ptr + row * logits_row_stride
    label = tl.load(labels_ptr + row)
    block = tl.arange(0, BLOCK_V)

    # Read the target logit before pass 1: pass 2 may overwrite it, and the reductions in pass 1 make every
    # warp finish this load before any warp gets to pass 2.
    z_label = tl.load(logits_row + label).to(tl.float32)

    # Pass 1: online log-sum-exp over the vocabulary, one block at a time.
    m = float("-inf")
    s = 0.0
    for start in range(0, V, BLOCK_V):
        z = _load_logits(logits_row, start + block, V)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    tl.store(loss_ptr + row, lse - z_label)

    # Pass 2: g = softmax - one_hot, written in the gradient's dtype.
    if WRITE_GRAD:
        grad_row = grad_ptr + row * grad_row_stride
        for start in range(0, V, BLOCK_V):
            cols = start + block
            z = _load_logits(logits_row, cols, V)
            g = tl.exp(z - lse) - tl.where(cols == label, 1.0, 0.0)
            # A bf16 g of this block lands on the fp32 logits [start / 2, (start + BLOCK_V) / 2): in this block
            # (the first one) or in earlier ones, which other warps may still be reading. The barrier waits
            # for every warp's loads so far. (An fp32 g lands on its own logit, read by the same thread.)
            tl.debug_barrier()
            tl.store(grad_row + cols, g.to(grad_ptr.dtype.element_ty), mask=cols < V)


def _cross_entropy_rows(logits, grad, labels, loss):
    """Launch: loss[i] for every row of `logits` (n, V) fp32, and g into `grad` (n, V) unless grad is None."""
    n, V = logits.shape
    write_grad = grad is not None
    grad = grad if write_grad else logits  # a pointer the kernel never touches without WRITE_GRAD
    block_v = min(MAX_BLOCK_V, triton.next_power_of_2(V))
    largest_offset = max(n * logits.stride(0), n * grad.stride(0))  # in elements, past the last row
    _cross_entropy_rows_kernel[(n,)](
        logits, grad, labels, loss,
        V, logits.stride(0), grad.stride(0), WRITE_GRAD=write_grad, INT64_OFFSETS=largest_offset >= INT32_MAX_NUMEL,
        BLOCK_V=block_v, num_warps=max(1, min(16, block_v // 512)),
    )


# ----------------------------------------------------------------------------------------------------------
# The chunked forward, which also makes the gradients
# ----------------------------------------------------------------------------------------------------------
def _matmul(a, b, out_dtype=None, out=None, accumulate=False):
    """a @ b with fp32 sums, as a new tensor of out_dtype or into `out` (out += a @ b when accumulate).

    The result dtype is a's (the matmul dtype) or fp32: bf16 products on the tensor cores, fp32 result.
    """
    if out is None:
        out = torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    beta = 1.0 if accumulate else 0.0  # beta = 0: `out` is not read, so it may start uninitialised
    if not a.is_cuda:  # CPU tests: oneDNN's bf16 matmul reads a strided G past its V columns (0 * NaN there)
        a = a.contiguous()
    if out.dtype == a.dtype:
        return torch.addmm(out, a, b, beta=beta, out=out)
    if a.is_cuda:  # cuBLAS with an fp32 result (an fp32 `out` here needs torch >= 2.10)
        return torch.addmm(out, a, b, beta=beta, out_dtype=out.dtype, out=out)
    return torch.addmm(out, a.to(out.dtype), b.to(out.dtype), beta=beta, out=out)  # CPU tests: same sums


def _rows_per_chunk(n_rows, V, budget_bytes):
    """Tokens per chunk: as many rows of fp32 logits as the budget holds (at least one), spread evenly."""
    most = max(1, budget_bytes // (V * 4))
    n_chunks = triton.cdiv(n_rows, most)
    return triton.cdiv(n_rows, n_chunks)


def _default_budget(V, weight_copy_bytes, dw_sum_bytes=0, min_tokens=MIN_CHUNK_TOKENS):
    """Bytes for a chunk's fp32 logits: what LOGITS_CHUNK_BYTES leaves beside the matmul copy of W (fp32 W under
    autocast) and the fp32 sum of dW (bf16 W, several chunks), but at least min_tokens rows. A sum too big to
    leave that many rows beside it (V >= ~64K at H = 4096) is not counted: the bound is out of reach there anyway,
    and smaller chunks would only cost time (each chunk is one more read and write of the sum).

    Memory of the whole op, beyond the inputs and the returned gradients: one chunk of fp32 logits (G lives inside
    it), plus with fp32 W under autocast (train.py's fp32 master weights) the bf16 copy of W the matmuls take (dW
    then sums straight into the fp32 gradient backward returns), with a 16-bit W and several chunks the fp32 sum
    of dW (it lives until backward, where the 16-bit gradient is made from it) or instead, where it is no larger,
    the 16-bit G of every counted token (freed in forward once dW is made from it, with the counted rows of h), and
    with ignored tokens the gather of each chunk's rows of h. The budget counts the sum's bytes either way."""
    floor = min_tokens * V * 4
    beside_copy_and_sum = LOGITS_CHUNK_BYTES - weight_copy_bytes - dw_sum_bytes
    if dw_sum_bytes and beside_copy_and_sum >= floor:
        return beside_copy_and_sum
    return max(LOGITS_CHUNK_BYTES - weight_copy_bytes, floor)


def _grad_view(logits_buf, dtype):
    """The gradient buffer inside the fp32 logits buffer: itself for fp32, else the first half of each row (G is
    stored in the matmul dtype: row i of a bf16 G is the first half of the bytes of row i of the fp32 logits, a
    (n, V) view of row stride 2V, which cuBLAS reads as is)."""
    if dtype == torch.float32:
        return logits_buf
    return logits_buf.view(dtype)[:, :logits_buf.shape[1]]  # (chunk, V) with row stride 2V


def _chunked_pass(h, weight, rows, labels, budget_bytes, dh, dw_dtype, fp8_weight=None):
    """The chunk loop over the counted tokens: rows `rows` of h (all of them when rows is None), labels `labels`,
    in chunks whose fp32 logits take at most budget_bytes (at least one token each).

    weight is already in the matmul dtype; h is cast to it chunk by chunk. Fills the rows of dh in place when
    dh is given, and returns (loss of each counted token, dW or None). dW is made when dw_dtype is given: in
    that dtype from a single chunk; over several chunks, when G of every counted token takes no more memory than
    an fp32 sum of dW would (n_rows <= 2H for a 16-bit W), G is kept whole and dW made by one matmul after the
    loop, in dw_dtype (no fp32 sum read and written once per chunk, no rounding pass in backward); else as an
    fp32 sum over the chunks.

    Precision: the logits are fp32 (bf16 products, fp32 sums and result): rounded to bf16 they would err by
    |z| * 2^-9, a 5% error in exp(z) at |z| = 25. G is stored in the matmul dtype, the one the next two matmuls
    take. dh_i is one matmul over the whole vocabulary (summed in fp32, rounded once), but dW sums over chunks, and
    adding chunk after chunk into a bf16 dW would round every partial sum (a known accuracy bug of fused
    linear-cross-entropy codes): so dW is summed in fp32 and rounded once, in backward (or, G kept whole, made by
    one product with fp32 sums, rounded once).

    fp8_weight (W itself, for the codes of its tiles): dh and dW are made by FP8 products instead (_fp8_pass).
    """
    V, H = weight.shape
    n_rows = labels.numel()
    need_grad = dh is not None or dw_dtype is not None
    chunk = _rows_per_chunk(n_rows, V, budget_bytes)
    if fp8_weight is not None and need_grad:
        return _fp8_pass(h, weight, fp8_weight, rows, labels, chunk, dh, dw_dtype)
    n_chunks = triton.cdiv(n_rows, chunk)

    logits_buf = torch.empty(chunk, V, dtype=torch.float32, device=h.device)
    grad_buf = _grad_view(logits_buf, weight.dtype) if need_grad else None
    dw = None
    whole_grad = dw_dtype is not None and n_chunks > 1 and _whole_grad_fits(n_rows, H, weight.dtype, dw_dtype)
    if whole_grad:
        grad_buf = torch.empty(n_rows, V, dtype=weight.dtype, device=h.device)
    elif dw_dtype is not None:
        dw = torch.empty(V, H, dtype=dw_dtype if n_chunks == 1 else torch.float32, device=h.device)
    loss_rows = torch.empty(n_rows, dtype=torch.float32, device=h.device)

    for start in range(0, n_rows, chunk):
        n = min(chunk, n_rows - start)
        h_chunk = h[start:start + n] if rows is None else h.index_select(0, rows[start:start + n])
        h_chunk = h_chunk.to(weight.dtype)
        logits = _matmul(h_chunk, weight.T, out=logits_buf[:n])
        grad = (grad_buf[start:start + n] if whole_grad else grad_buf[:n]) if need_grad else None
        _cross_entropy_rows(logits, grad, labels[start:start + n], loss_rows[start:start + n])
        if dh is not None and rows is None:
            _matmul(grad, weight, out=dh[start:start + n])
        elif dh is not None:
            dh.index_copy_(0, rows[start:start + n], _matmul(grad, weight, out_dtype=dh.dtype))
        if dw is not None:
            _matmul(grad.T, h_chunk, out=dw, accumulate=start > 0)
    if whole_grad:
        logits_buf = logits = None  # from here on the op holds G (at most an fp32 dW's size), h's counted rows, dW
        h_rows = h if rows is None else h.index_select(0, rows)
        dw = _matmul(grad_buf.T, h_rows.to(weight.dtype), out_dtype=dw_dtype)
    return loss_rows, dw


def _fp8_pass(h, weight, fp8_weight, rows, labels, chunk, dh, dw_dtype):
    """_chunked_pass with dh and dW from FP8 products (kernels/fp8.py's blocks, as the block Linears' backward):
        dh = q1(G) q128(W^T)^T      dW = q1(G^T) q128(h^T)^T      (q1: 1 x 128 scales, q128: 128 x 128)
    Each chunk's G (in the matmul dtype, inside its logits) is quantized in one launch into its row codes, for its
    rows of dh, and its columns of G^T's codes. chunk is rounded up to 512 tokens (K_PAD), so no block of 128 tokens
    of G^T spans two chunks. dW comes back as a function of the loss's gradient g: backward makes it by one product
    with g folded into G^T's scales, so no pass over dW scales it (and it is rounded once). Memory beside a chunk's
    logits: G^T's codes, ~1.03 n V bytes (n counted tokens), held until backward in place of dW (2 V H for bf16 W),
    and W^T's, V H bytes, during the loop; against the bf16 path's whole bf16 G (2 n V) or fp32 sum of dW (4 V H),
    or nothing more where dW sums into W's own fp32 gradient (fp32 W under autocast: there this path takes more)."""
    V, H = weight.shape
    n_rows = labels.numel()
    dev = h.device
    chunk = triton.cdiv(chunk, fp8.K_PAD) * fp8.K_PAD
    logits_buf = torch.empty(min(chunk, n_rows), V, dtype=torch.float32, device=dev)
    grad_buf = _grad_view(logits_buf, weight.dtype)
    loss_rows = torch.empty(n_rows, dtype=torch.float32, device=dev)
    w_cols = fp8.quantize(fp8_weight, cols=fp8.BLOCK)[1] if dh is not None else None  # W^T (H, V): dh's operand
    if dw_dtype is not None:  # G^T (V, n_rows), its columns written chunk by chunk
        n_pad = triton.cdiv(n_rows, fp8.K_PAD) * fp8.K_PAD
        gt_codes = torch.empty((V, n_pad), dtype=torch.float8_e4m3fn, device=dev)
        gt_scales = torch.empty((n_pad // fp8.BLOCK, V), dtype=torch.float32, device=dev)
    for start in range(0, n_rows, chunk):
        n = min(chunk, n_rows - start)
        h_chunk = h[start:start + n] if rows is None else h.index_select(0, rows[start:start + n])
        logits = _matmul(h_chunk.to(weight.dtype), weight.T, out=logits_buf[:n])
        grad = grad_buf[:n]
        _cross_entropy_rows(logits, grad, labels[start:start + n], loss_rows[start:start + n])
        into = None
        if dw_dtype is not None:
            end = start + triton.cdiv(n, fp8.K_PAD) * fp8.K_PAD
            into = (gt_codes[:, start:end], gt_scales[start // fp8.BLOCK:end // fp8.BLOCK])
        g_rows = fp8.quantize(grad, rows=1 if dh is not None else 0, cols=1 if into else 0, col_codes=into)[0]
        if dh is not None:
            dh_chunk = fp8.scaled_mm(*g_rows, *w_cols, out_dtype=dh.dtype)[:n]
            if rows is None:
                dh[start:start + n] = dh_chunk
            else:
                dh.index_copy_(0, rows[start:start + n], dh_chunk)
    if dw_dtype is None:
        return loss_rows, None
    h_cols = fp8.quantize(as_rows(h if rows is None else h.index_select(0, rows)), cols=fp8.BLOCK)[1]

    def dw_of(grad_loss):  # backward's: d(grad_loss * loss)/dW, grad_loss in G^T's scales (no pass over dW)
        return fp8.scaled_mm(gt_codes, gt_scales * grad_loss, *h_cols, out_dtype=dw_dtype)
    return loss_rows, dw_of


def _whole_grad_fits(n_rows, H, mm_dtype, dw_dtype):
    """Whether G of all n_rows tokens (in the matmul dtype) takes no more memory than the fp32 sum of dW it
    replaces: n_rows * V * 2 <= V * H * 4 for 16-bit G; only where dW has the matmul's 16-bit dtype (an fp32 dW is
    summed in place, and cuBLAS makes no bf16 product of fp16 operands or the reverse)."""
    return dw_dtype == mm_dtype != torch.float32 and n_rows * 2 <= H * 4


def _loss_and_grads(h, weight, labels, need_dh, need_dw, fp8_grads=False):
    """(loss_sum, n_valid, dh or None, dW or None): the whole computation; the gradients are of loss_sum.

    The matmuls run in the inputs' dtype, or under torch.autocast in its dtype (as F.linear would there).
    dh comes back in h's dtype; dW in W's dtype, or as an fp32 sum that backward rounds to W's dtype, or (FP8) as
    the function of the loss's gradient that makes it (_fp8_pass).
    The chunks' budget is _default_budget's. Ignored tokens are dropped before the chunking (one nonzero(), the
    call's only host sync), so they cost no matmul and their rows of dh stay zero; when none is ignored the chunks
    are plain slices of h and dh. The chunk loop itself never syncs. fp8_grads: dh and dW by FP8 products
    (_fp8_pass) where V and H are multiples of 16 (torch._scaled_mm's need), else as without.
    """
    assert h.dim() == 2 and weight.dim() == 2 and h.shape[1] == weight.shape[1], (h.shape, weight.shape)
    assert labels.shape == h.shape[:1], (labels.shape, h.shape)
    device = h.device.type
    if torch.is_autocast_enabled(device):
        mm_dtype = torch.get_autocast_dtype(device)
    else:
        assert h.dtype == weight.dtype, (h.dtype, weight.dtype)
        mm_dtype = h.dtype
    assert mm_dtype in (torch.float32, torch.bfloat16, torch.float16), mm_dtype

    is_counted = labels != IGNORE_INDEX
    n_valid = is_counted.sum()  # on the device: no sync
    rows = is_counted.nonzero().squeeze(1)  # the call's one host sync: nonzero() must know its size
    n_rows = rows.numel()
    if n_rows == labels.numel():
        rows = None  # every token counts: chunks are slices, and every row of dh gets written
    dh = None
    if need_dh:  # ignored tokens keep zero rows
        dh = torch.empty(h.shape, dtype=h.dtype, device=h.device) if rows is None else torch.zeros_like(h)
    if n_rows == 0:  # nothing counted: loss 0, gradients 0
        dw = torch.zeros_like(weight) if need_dw else None
        return torch.zeros((), dtype=torch.float32, device=h.device), n_valid, dh, dw
    with torch.autocast(device, enabled=False):  # our matmuls pick their own dtypes
        weight_mm = weight.to(mm_dtype)  # fp32 W under autocast: the one bf16 copy of W
        V = weight.shape[0]
        copy_bytes = weight_mm.numel() * weight_mm.element_size() if weight_mm is not weight else 0
        # a separate fp32 sum of dW exists when W is not fp32 (else it is W's gradient) and one chunk won't do
        fp8_ok = fp8_grads and weight.shape[0] % FP8_ALIGN == 0 and weight.shape[1] % FP8_ALIGN == 0
        min_tokens = MIN_CHUNK_TOKENS_FP8 if fp8_ok else MIN_CHUNK_TOKENS
        several_chunks = n_rows * V * 4 > _default_budget(V, copy_bytes, 0, min_tokens)
        sum_bytes = weight.numel() * 4 if need_dw and weight.dtype != torch.float32 and several_chunks else 0
        budget_bytes = _default_budget(V, copy_bytes, sum_bytes, min_tokens)
        labels = labels.contiguous() if rows is None else labels[rows]
        fp8_weight = weight if fp8_ok else None
        loss_rows, dw = _chunked_pass(h, weight_mm, rows, labels, budget_bytes, dh,
                                      weight.dtype if need_dw else None, fp8_weight)
    return loss_rows.sum(), n_valid, dh, dw


# ----------------------------------------------------------------------------------------------------------
# autograd and the public function
# ----------------------------------------------------------------------------------------------------------
def _scaled(grad, scale, dtype):
    """grad * scale in `dtype`: in place when grad has that dtype, else one fused multiply-and-round of an fp32
    sum into a new tensor (a separate cast would be one more pass over V * H values)."""
    if grad is None:
        return None
    if grad.dtype == dtype:
        return grad.mul_(scale)
    return torch.mul(grad, scale, out=torch.empty(grad.shape, dtype=dtype, device=grad.device))


class LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, fp8_grads):
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss_sum, n_valid, dh, dw = _loss_and_grads(h, weight, labels, need_dh, need_dw, fp8_grads)
        ctx.grads = (dh, dw)  # gradients of loss_sum, already made (but FP8's dW): backward only scales them
        ctx.weight_dtype = weight.dtype  # dW may come as an fp32 sum; dh is always in h's dtype
        ctx.mark_non_differentiable(n_valid)
        return loss_sum, n_valid

    @staticmethod
    def backward(ctx, grad_loss, grad_n_valid):
        if ctx.grads is None:
            raise RuntimeError("linear_cross_entropy: backward can run only once (its gradients were made in "
                               "forward and are scaled in place)")
        dh, dw = ctx.grads
        ctx.grads = None  # drop our references: autograd can then take dW as W.grad without a copy
        # grad_loss is a 0-dim tensor on the GPU. Skipping the product when it is 1 would need a host sync to
        # look, and in this project it is 1 / (tokens of the optimizer step) anyway, so always multiply: one
        # pass over dh and dW, small next to the three matmuls (FP8's dW, a callable, takes it in its scales).
        dh = None if dh is None else dh.mul_(grad_loss)
        dw = dw(grad_loss) if callable(dw) else _scaled(dw, grad_loss, ctx.weight_dtype)
        return dh, dw, None, None


def linear_cross_entropy(h, weight, labels, fp8_grads=False):
    """Summed cross-entropy of logits = h @ weight.T against labels (-100 = ignore), and the count of tokens.

    h (N, H), weight (V, H), labels (N,) int64 with values in [0, V) or -100 (not checked: that would be another
    host sync). Returns (loss_sum fp32 scalar, n_valid int64 scalar), like the reference.
    Differentiable in h and weight. The tokens go through in chunks whose fp32 logits fit _default_budget.
    fp8_grads: the two gradient products (dh = G W, dW = G^T h) in FP8 e4m3 with block scales (_fp8_pass); the
    logits stay a bf16 product with fp32 sums.
    """
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return LinearCrossEntropy.apply(h, weight, labels, fp8_grads)
    loss_sum, n_valid, _, _ = _loss_and_grads(h, weight, labels, False, False)
    return loss_sum, n_valid
