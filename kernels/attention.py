"""Causal flash attention over a packed stream of documents (varlen), with grouped-query attention, in Triton.

Shapes: q (T, Hq, D), k and v (T, Hkv, D), T tokens of several documents end to end, `cu_seqlens` (n_docs + 1,)
int32 their boundaries. A token attends to itself and the earlier tokens of its own document, nothing else.
GQA: query head h reads kv head h // G, G = Hq // Hkv, so G query heads share one K/V head.

Forward (FlashAttention-2). For one query row i of head h, with keys j of the same document, j <= i:
    s_ij = scale * q_i . k_j          p_ij = exp(s_ij - lse_i)          o_i = sum_j p_ij v_j
The T x T matrix p is never stored. A program owns a block of BLOCK_M query rows and walks over the key blocks
of its document, BLOCK_N keys at a time, keeping per row a running max m, a running sum l and an unnormalised
output acc, all fp32 ("online softmax"). We work in base 2 (exp2 is the hardware instruction): t = s * log2(e).
For each key block:
    m' = max(m, max_j t_ij)     alpha = 2^(m - m')     p~_ij = 2^(t_ij - m')
    l  = alpha * l + sum_j p~_ij          acc = alpha * acc + p~ @ V
and at the end o = acc / l and, saved for the backward, lse2 = m + log2(l) (the log-sum-exp in base 2, fp32,
laid out (Hq, T)). Rescaling by alpha whenever the max grows keeps every exponent <= 0, so nothing overflows.
Causal skipping: the key blocks that end before the query block's first row need no mask and run first; the
blocks that reach the diagonal get the mask j <= i; blocks right of it (j > i for every pair) are never visited,
which halves the work. Keys past the document's end are loaded as zeros and masked; rows past the end are never stored.

Stacked GQA heads. The G query heads of a group read the same keys and values, so one program may take the same
BLOCK_M query rows of HEADS of them (HEADS divides G) as one tile of HEADS * BLOCK_M rows: each K/V block is
loaded once for all of them, and the matrix products are HEADS times taller. That matters for short documents:
a 180-token document in 128-row blocks computes a tile that is mostly past the diagonal or past its end, while
32-row blocks waste little but make matrix products too small for the tensor cores to run at speed; 4 heads x
32 rows is both. (FlashAttention-3 packs GQA heads the same way for decoding.) Only the row -> (head, position)
map changes: tile row r is position r % BLOCK_M of head r // BLOCK_M.

Backward. With dO the incoming gradient and p recomputed from the saved lse (no second softmax):
    dV_j  = sum_i p_ij dO_i                           dP_ij = dO_i . v_j
    dS_ij = p_ij (dP_ij - delta_i),   delta_i = sum_j p_ij dP_ij = dO_i . o_i
    dQ_i  = scale * sum_j dS_ij k_j                   dK_j  = scale * sum_i dS_ij q_i
dS is the softmax Jacobian applied to dP: d/ds_ij of sum_k dP_ik p_ik = p_ij (dP_ij - sum_k p_ik dP_ik). The sum
over the whole row, delta_i, would need all key blocks at once; since sum_k p_ik (dO_i . v_k) = dO_i . o_i it is
computed per row from O and dO before anything needs it. Two kernels, neither with atomics:
  * dQ (first): a program owns a block of queries (of HEADS heads, as in forward), computes and stores their
    delta, and walks the key blocks from the document start to the diagonal.
  * dK/dV: a program owns a block of keys of one kv head, and loops over the G query heads of its group (HEADS
    at a time) and, for each, over the query blocks of the document from the diagonal down to the end (queries
    above the diagonal never see these keys). dK and dV of the whole group add up in fp32 registers: no
    atomics, no repeated K/V in memory, a fixed summation order, so the result is deterministic.

Varlen indexing without host sync. The grid is 1-D: program id = slot * (H / HEADS) + head tile (heads vary
fastest, so the G query heads of a group run side by side and share K/V blocks in L2). Document i owns the slots
    [cu[i] // B + i,  cu[i+1] // B + i + 1)      (B = the block size of that kernel)
which are at least cdiv(len_i, B) slots (the "+ 1" pays for a partial block) and never overlap the next
document's. So floor(T / B) + n_docs slots, a number known from shapes alone, cover every block of every
document; a program finds its document by a binary search over cu_seqlens (log2(n_docs) cached loads), and the
spare slots (at most one per document) exit at once. Unlike a (cdiv(max_seqlen, B), n_docs, H) grid, this
launches no empty programs for the many short documents of a batch. Inside a document the query blocks run
last-to-first (the last block sees the most keys), so the longest programs start first. The caller's
max_seqlen is only used to bucket autotuning.

Loads. The long loops that stay inside a document (keys left of the diagonal in forward and dQ, queries below it
in dK/dV) read their streamed tiles through TMA descriptors (the Hopper tensor memory accelerator: one thread
issues a whole-tile copy into shared memory, no per-element addresses or masks in registers), over the tensors
viewed as (H, T, D) with a box of (1, BLOCK_N, D) for K/V or (HEADS, BLOCK_M, D) for stacked Q/dO, which is
exactly the stacked tile's row order. On the H200 this made the long-document kernels 7-13% faster than pointer
loads (BENCHMARKS.md). A box only clips at the tensor's end, not a document's, so the blocks that touch a document's
end (the diagonal blocks, dK/dV's last partial query block) keep masked pointer loads. Older GPUs and the
interpreter run the same code: Triton lowers descriptor loads to ordinary loads where there is no TMA.

Offsets: the start row of each program's tiles is computed in int64 once (a scalar), and only small tile-local
offsets (< block * token stride) are int32, so T * H * D may exceed 2^31 at no measurable cost (TMA coordinates
are (head, row, 0), each < 2^31).

Precision: bf16/fp16 inputs, fp32 accumulation and softmax statistics. fp32 inputs are supported (for tests):
their dot products use exact fp32 ("ieee"), not tf32, on the GPU too, with one small fixed tile config.

Ideas from the FlashAttention-2 paper (Tri Dao, 2023) and the Triton "fused attention" tutorial (causal split
into off-diagonal and diagonal loops, exp2 domain, separate dK/dV and dQ passes, TMA descriptors on Hopper);
the code is our own.
"""
import torch
import triton
import triton.language as tl

from . import attention_tuning as tuning

LOG2E = 1.4426950408889634  # log2(e): exp(x) = 2^(x * log2(e))
# Powers of 2 (tl.arange), >= 16 (the smallest tl.dot). 256 is left out: the tile lists were swept at D = 128, and
# at 256 the dK/dV accumulators of most of them no longer fit in registers.
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)


@triton.jit
def _locate_block(cu_seqlens, n_docs, slot, BLOCK: tl.constexpr):
    """Flat slot -> (document start, document length, block index in the document); see the module docstring."""
    lo = 0  # the document is the last one whose first slot, cu[i] // BLOCK + i, is <= slot
    hi = n_docs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        found = tl.load(cu_seqlens + mid) // BLOCK + mid <= slot
        lo = tl.where(found, mid, lo)
        hi = tl.where(found, hi, mid)
    doc_start = tl.load(cu_seqlens + lo)
    doc_len = tl.load(cu_seqlens + lo + 1) - doc_start
    return doc_start, doc_len, slot - (doc_start // BLOCK + lo)


# ----------------------------------------------------------------------------------------------------- forward

@triton.jit
def _fwd_step(acc, m_i, l_i, q, k, v, qk_scale, offs_m, offs_n, CAUSAL_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One key block of the online softmax: fold p~ = 2^(t - m') of this block into (acc, m, l)."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N); t = qk * qk_scale
    if CAUSAL_MASK:
        qk = tl.where(offs_m[:, None] >= offs_n[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # finite: the first diagonal block has each row's own key
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])  # one fused multiply-add per score (qk_scale > 0)
    alpha = tl.math.exp2(m_i - m_new)  # 0 on the first block (m_i = -inf)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _stacked_rows(BLOCK_M: tl.constexpr, HEADS: tl.constexpr):
    """A query tile of HEADS * BLOCK_M rows holds the same BLOCK_M query rows for HEADS heads of one GQA group
    (they read the same K/V). Tile row r is row r % BLOCK_M of the block, in the tile's head r // BLOCK_M."""
    r = tl.arange(0, HEADS * BLOCK_M)
    return r % BLOCK_M, r // BLOCK_M


@triton.jit(do_not_specialize=["n_docs"])  # varies every batch: don't recompile when it is 1 or % 16 == 0
def _attn_fwd(Q, K, V, O, LSE2, cu_seqlens, n_docs, n_heads, T, qk_scale, seqlen_bucket,
              stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, KD, VD,
              GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              HEADS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One program = BLOCK_M query rows of one document, in HEADS query heads of one GQA group stacked in one
    tile. seqlen_bucket: autotuning key only."""
    n_tiles = n_heads // HEADS
    head0 = (tl.program_id(0) % n_tiles) * HEADS  # heads vary fastest: a GQA group reads the same K/V together
    doc_start, doc_len, local = _locate_block(cu_seqlens, n_docs, tl.program_id(0) // n_tiles, BLOCK_M)
    q_block = tl.cdiv(doc_len, BLOCK_M) - 1 - local  # longest rows (most keys) first: better tail balance
    if q_block < 0:
        return
    kv_head = head0 // GROUP
    q_lo = q_block * BLOCK_M
    rows, heads = _stacked_rows(BLOCK_M, HEADS)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    offs_m = q_lo + rows  # positions inside the document
    row_ok = offs_m < doc_len

    q_row0 = (doc_start + q_lo).to(tl.int64)
    q_tile = rows[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(Q + q_row0 * stride_qt + head0 * stride_qh + q_tile, mask=row_ok[:, None], other=0.0)
    k_tile = cols[:, None] * stride_kt + dims[None, :]
    v_tile = cols[:, None] * stride_vt + dims[None, :]

    m_i = tl.full([HEADS * BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([HEADS * BLOCK_M], tl.float32)
    acc = tl.zeros([HEADS * BLOCK_M, HEAD_DIM], tl.float32)
    diag_lo = q_lo // BLOCK_N * BLOCK_N  # the first key block that reaches the diagonal
    # keys [0, diag_lo): left of the diagonal, all inside the document: no mask, TMA tiles
    for kv_lo in range(0, diag_lo, BLOCK_N):
        k = KD.load([kv_head, doc_start + kv_lo, 0]).reshape([BLOCK_N, HEAD_DIM])
        v = VD.load([kv_head, doc_start + kv_lo, 0]).reshape([BLOCK_N, HEAD_DIM])
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k, v, qk_scale, offs_m, kv_lo + cols, False, DOT_PRECISION)
    # keys [diag_lo, q_lo + BLOCK_M) on the diagonal: causal mask, and no loads past the document's end. Pointer
    # loads: a scalar pointer to the tile's first row, advanced by BLOCK_N rows per step, plus int32 tile offsets
    k_rows = K + (doc_start + diag_lo).to(tl.int64) * stride_kt + kv_head * stride_kh
    v_rows = V + (doc_start + diag_lo).to(tl.int64) * stride_vt + kv_head * stride_vh
    for kv_lo in range(diag_lo, tl.minimum(q_lo + BLOCK_M, doc_len), BLOCK_N):
        offs_n = kv_lo + cols
        k = tl.load(k_rows + k_tile, mask=(offs_n < doc_len)[:, None], other=0.0)
        v = tl.load(v_rows + v_tile, mask=(offs_n < doc_len)[:, None], other=0.0)
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k, v, qk_scale, offs_m, offs_n, True, DOT_PRECISION)
        k_rows += BLOCK_N * stride_kt
        v_rows += BLOCK_N * stride_vt

    o_tile = rows[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(O + q_row0 * stride_ot + head0 * stride_oh + o_tile, (acc / l_i[:, None]).to(O.dtype.element_ty),
             mask=row_ok[:, None])
    lse_rows = LSE2 + head0.to(tl.int64) * T + doc_start  # row statistics are laid out (Hq, T)
    tl.store(lse_rows + heads * T + offs_m, m_i + tl.math.log2(l_i), mask=row_ok)


# ---------------------------------------------------------------------------------------------------- backward

@triton.jit
def _dkdv_step(dk, dv, k, v, q, do, lse2, delta, qk_scale, offs_m, offs_n,
               CAUSAL_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add one query tile's share to dK and dV, all in the transposed (keys x queries) orientation."""
    pT = tl.math.exp2(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale - lse2[None, :])
    if CAUSAL_MASK:
        pT = tl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
    dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)  # dV += P^T dO
    dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # dP^T = V dO^T
    dsT = pT * (dpT - delta[None, :])  # dS^T = P^T * (dP^T - delta)
    dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=DOT_PRECISION)  # dK += dS^T Q  (scale applied at the end)
    return dk, dv


@triton.jit(do_not_specialize=["n_docs"])
def _attn_bwd_dkdv(Q, K, V, DO, DK, DV, LSE2, DELTA, cu_seqlens, n_docs, n_kv_heads, T, qk_scale, scale,
                   seqlen_bucket,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                   stride_dkt, stride_dkh, stride_dvt, stride_dvh, QD, DOD,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HEADS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One program = BLOCK_N keys of one document and one kv head; loops over the GROUP query heads, HEADS at a
    time stacked in query tiles of HEADS * BLOCK_M rows."""
    tl.static_assert(BLOCK_N % BLOCK_M == 0)  # the masked loop must end exactly past the diagonal
    kv_head = tl.program_id(0) % n_kv_heads
    doc_start, doc_len, kv_block = _locate_block(cu_seqlens, n_docs, tl.program_id(0) // n_kv_heads, BLOCK_N)
    kv_lo = kv_block * BLOCK_N  # block 0 sees every query of the document: the heaviest come first already
    if kv_lo >= doc_len:
        return
    rows, heads = _stacked_rows(BLOCK_M, HEADS)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    offs_n = kv_lo + cols
    col_ok = (offs_n < doc_len)[:, None]
    kv_row0 = (doc_start + kv_lo).to(tl.int64)
    k = tl.load(K + kv_row0 * stride_kt + kv_head * stride_kh + cols[:, None] * stride_kt + dims[None, :],
                mask=col_ok, other=0.0)
    v = tl.load(V + kv_row0 * stride_vt + kv_head * stride_vh + cols[:, None] * stride_vt + dims[None, :],
                mask=col_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    diag_end = tl.minimum(kv_lo + BLOCK_N, doc_len)
    q_tile = rows[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    do_tile = rows[:, None] * stride_dot + heads[:, None] * stride_doh + dims[None, :]
    stat_tile = heads * T  # row statistics are laid out (Hq, T)

    for g in range(0, GROUP, HEADS):
        head0 = kv_head * GROUP + g
        q_rows = Q + kv_row0 * stride_qt + head0 * stride_qh  # scalar row pointers + int32 tiles, as in forward
        do_rows = DO + kv_row0 * stride_dot + head0 * stride_doh
        lse_rows = LSE2 + head0.to(tl.int64) * T + doc_start + stat_tile
        delta_rows = DELTA + head0.to(tl.int64) * T + doc_start + stat_tile
        # Query rows past the document's end load q = dO = delta = 0, so they add 0 to dV and dK.
        # queries [kv_lo, kv_lo + BLOCK_N) on the diagonal: causal mask
        for q_lo in range(kv_lo, diag_end, BLOCK_M):
            offs_m = q_lo + rows
            ok = offs_m < doc_len
            q = tl.load(q_rows + q_tile, mask=ok[:, None], other=0.0)
            do = tl.load(do_rows + do_tile, mask=ok[:, None], other=0.0)
            lse2 = tl.load(lse_rows + offs_m, mask=ok, other=0.0)
            delta = tl.load(delta_rows + offs_m, mask=ok, other=0.0)
            dk, dv = _dkdv_step(dk, dv, k, v, q, do, lse2, delta, qk_scale, offs_m, offs_n, True, DOT_PRECISION)
            q_rows += BLOCK_M * stride_qt
            do_rows += BLOCK_M * stride_dot
        # queries [kv_lo + BLOCK_N, doc_len) below the diagonal: they see every key of the block, no mask;
        # the whole query blocks as TMA tiles, then the partial last one (if any) with masked loads
        full_end = kv_lo + BLOCK_N + (doc_len - kv_lo - BLOCK_N) // BLOCK_M * BLOCK_M
        for q_lo in range(kv_lo + BLOCK_N, full_end, BLOCK_M):
            offs_m = q_lo + rows
            q = QD.load([head0, doc_start + q_lo, 0]).reshape([HEADS * BLOCK_M, HEAD_DIM])
            do = DOD.load([head0, doc_start + q_lo, 0]).reshape([HEADS * BLOCK_M, HEAD_DIM])
            lse2 = tl.load(lse_rows + offs_m)
            delta = tl.load(delta_rows + offs_m)
            dk, dv = _dkdv_step(dk, dv, k, v, q, do, lse2, delta, qk_scale, offs_m, offs_n, False, DOT_PRECISION)
        q_rows = Q + (doc_start + full_end).to(tl.int64) * stride_qt + head0 * stride_qh
        do_rows = DO + (doc_start + full_end).to(tl.int64) * stride_dot + head0 * stride_doh
        for q_lo in range(tl.maximum(full_end, kv_lo + BLOCK_N), doc_len, BLOCK_M):  # at most one block
            offs_m = q_lo + rows
            ok = offs_m < doc_len
            q = tl.load(q_rows + q_tile, mask=ok[:, None], other=0.0)
            do = tl.load(do_rows + do_tile, mask=ok[:, None], other=0.0)
            lse2 = tl.load(lse_rows + offs_m, mask=ok, other=0.0)
            delta = tl.load(delta_rows + offs_m, mask=ok, other=0.0)
            dk, dv = _dkdv_step(dk, dv, k, v, q, do, lse2, delta, qk_scale, offs_m, offs_n, False, DOT_PRECISION)

    dk_ptrs = DK + kv_row0 * stride_dkt + kv_head * stride_dkh + cols[:, None] * stride_dkt + dims[None, :]
    dv_ptrs = DV + kv_row0 * stride_dvt + kv_head * stride_dvh + cols[:, None] * stride_dvt + dims[None, :]
    tl.store(dk_ptrs, (dk * scale).to(DK.dtype.element_ty), mask=col_ok)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=col_ok)


@triton.jit
def _dq_step(dq, q, do, k, v, lse2, delta, qk_scale, offs_m, offs_n,
             CAUSAL_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add one key block's share to dQ."""
    p = tl.math.exp2(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale - lse2[:, None])
    if CAUSAL_MASK:
        p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # dP = dO V^T
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)  # dQ += dS K  (scale applied at the end)


@triton.jit(do_not_specialize=["n_docs"])
def _attn_bwd_dq(Q, K, V, O, DO, DQ, LSE2, DELTA, cu_seqlens, n_docs, n_heads, T, qk_scale, scale, seqlen_bucket,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                 stride_dot, stride_doh, stride_dqt, stride_dqh, KD, VD,
                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 HEADS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One program = BLOCK_M query rows of one document in HEADS query heads of one GQA group, as in forward.
    It also computes delta = rowsum(dO * O) of its rows, and stores it for the dK/dV kernel that runs next."""
    n_tiles = n_heads // HEADS
    head0 = (tl.program_id(0) % n_tiles) * HEADS
    doc_start, doc_len, local = _locate_block(cu_seqlens, n_docs, tl.program_id(0) // n_tiles, BLOCK_M)
    q_block = tl.cdiv(doc_len, BLOCK_M) - 1 - local  # longest rows first
    if q_block < 0:
        return
    kv_head = head0 // GROUP
    q_lo = q_block * BLOCK_M
    rows, heads = _stacked_rows(BLOCK_M, HEADS)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    offs_m = q_lo + rows
    ok = offs_m < doc_len
    q_row0 = (doc_start + q_lo).to(tl.int64)
    q = tl.load(Q + q_row0 * stride_qt + head0 * stride_qh + rows[:, None] * stride_qt + heads[:, None] * stride_qh
                + dims[None, :], mask=ok[:, None], other=0.0)
    do = tl.load(DO + q_row0 * stride_dot + head0 * stride_doh + rows[:, None] * stride_dot
                 + heads[:, None] * stride_doh + dims[None, :], mask=ok[:, None], other=0.0)
    o = tl.load(O + q_row0 * stride_ot + head0 * stride_oh + rows[:, None] * stride_ot + heads[:, None] * stride_oh
                + dims[None, :], mask=ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # rows past the end: computed, never stored
    stats = head0.to(tl.int64) * T + doc_start + heads * T + offs_m  # row statistics (Hq, T) of these rows
    tl.store(DELTA + stats, delta, mask=ok)
    lse2 = tl.load(LSE2 + stats, mask=ok, other=0.0)
    k_tile = cols[:, None] * stride_kt + dims[None, :]
    v_tile = cols[:, None] * stride_vt + dims[None, :]

    dq = tl.zeros([HEADS * BLOCK_M, HEAD_DIM], tl.float32)
    diag_lo = q_lo // BLOCK_N * BLOCK_N  # as in forward
    for kv_lo in range(0, diag_lo, BLOCK_N):  # left of the diagonal: no mask, TMA tiles (as in forward)
        k = KD.load([kv_head, doc_start + kv_lo, 0]).reshape([BLOCK_N, HEAD_DIM])
        v = VD.load([kv_head, doc_start + kv_lo, 0]).reshape([BLOCK_N, HEAD_DIM])
        dq = _dq_step(dq, q, do, k, v, lse2, delta, qk_scale, offs_m, kv_lo + cols, False, DOT_PRECISION)
    k_rows = K + (doc_start + diag_lo).to(tl.int64) * stride_kt + kv_head * stride_kh
    v_rows = V + (doc_start + diag_lo).to(tl.int64) * stride_vt + kv_head * stride_vh
    for kv_lo in range(diag_lo, tl.minimum(q_lo + BLOCK_M, doc_len), BLOCK_N):  # the diagonal: causal mask
        offs_n = kv_lo + cols
        k = tl.load(k_rows + k_tile, mask=(offs_n < doc_len)[:, None], other=0.0)
        v = tl.load(v_rows + v_tile, mask=(offs_n < doc_len)[:, None], other=0.0)
        dq = _dq_step(dq, q, do, k, v, lse2, delta, qk_scale, offs_m, offs_n, True, DOT_PRECISION)
        k_rows += BLOCK_N * stride_kt
        v_rows += BLOCK_N * stride_vt

    dq_tile = rows[:, None] * stride_dqt + heads[:, None] * stride_dqh + dims[None, :]
    tl.store(DQ + q_row0 * stride_dqt + head0 * stride_dqh + dq_tile, (dq * scale).to(DQ.dtype.element_ty),
             mask=ok[:, None])


# ------------------------------------------------------------------------------------------------------ launch
# Which tile config runs, and how the TMA descriptors are made: kernels/attention_tuning.py.

KERNELS = {"fwd": tuning.TunedKernel(_attn_fwd, "fwd"), "dq": tuning.TunedKernel(_attn_bwd_dq, "dq"),
           "dkdv": tuning.TunedKernel(_attn_bwd_dkdv, "dkdv")}


def _slots(T, n_docs, block):
    return T // block + n_docs  # flat slots covering every block of every document (_locate_block)


def _forward(q, k, v, cu_seqlens, max_seqlen, scale):
    T, Hq, D = q.shape
    n_docs = cu_seqlens.shape[0] - 1
    o = torch.empty((T, Hq, D), device=q.device, dtype=q.dtype)
    lse2 = torch.empty((Hq, T), device=q.device, dtype=torch.float32)
    grid = lambda meta: (_slots(T, n_docs, meta["BLOCK_M"]) * (Hq // meta["HEADS"]),)
    KERNELS["fwd"](q.dtype, grid,
                   q, k, v, o, lse2, cu_seqlens, n_docs, Hq, T, scale * LOG2E, tuning.seqlen_bucket(max_seqlen),
                   q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0),
                   o.stride(1), GROUP=Hq // k.shape[1], HEAD_DIM=D)
    return o, lse2


def _backward(do, q, k, v, o, lse2, cu_seqlens, max_seqlen, scale):
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    n_docs = cu_seqlens.shape[0] - 1
    bucket = tuning.seqlen_bucket(max_seqlen)
    delta = torch.empty((Hq, T), device=q.device, dtype=torch.float32)  # written by the dQ kernel, read by dK/dV
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    KERNELS["dq"](q.dtype, lambda meta: (_slots(T, n_docs, meta["BLOCK_M"]) * (Hq // meta["HEADS"]),),
                  q, k, v, o, do, dq, lse2, delta, cu_seqlens, n_docs, Hq, T, scale * LOG2E, scale, bucket,
                  q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0),
                  o.stride(1), do.stride(0), do.stride(1), dq.stride(0), dq.stride(1), GROUP=Hq // Hkv, HEAD_DIM=D)
    KERNELS["dkdv"](q.dtype, lambda meta: (_slots(T, n_docs, meta["BLOCK_N"]) * Hkv,),
                    q, k, v, do, dk, dv, lse2, delta, cu_seqlens, n_docs, Hkv, T, scale * LOG2E, scale, bucket,
                    q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0),
                    do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), GROUP=Hq // Hkv,
                    HEAD_DIM=D)
    return dq, dk, dv


class _Attention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, scale):
        o, lse2 = _forward(q, k, v, cu_seqlens, max_seqlen, scale)
        ctx.save_for_backward(q, k, v, o, lse2, cu_seqlens)
        ctx.max_seqlen, ctx.scale = max_seqlen, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse2, cu_seqlens = ctx.saved_tensors
        dq, dk, dv = _backward(_tma_ready(do), q, k, v, o, lse2, cu_seqlens, ctx.max_seqlen, ctx.scale)
        return dq, dk, dv, None, None, None


def _tma_ready(x):
    """The kernels take any token/head strides (e.g. q, k, v sliced out of one fused qkv projection), but TMA
    needs the head dim contiguous, the other strides and the start 16-byte aligned; otherwise we pay one copy."""
    aligned = x.data_ptr() % 16 == 0 and all(s * x.element_size() % 16 == 0 for s in x.stride()[:-1])
    return x if x.stride(-1) == 1 and aligned else x.clone(memory_format=torch.contiguous_format)


def attention(q, k, v, cu_seqlens, max_seqlen, scale):
    """Causal attention inside each packed document, GQA by head groups; same contract as reference.attention.

    q (T, Hq, D), k and v (T, Hkv, D), Hq a multiple of Hkv, D in SUPPORTED_HEAD_DIMS, bf16 / fp16 (fp32 for tests);
    cu_seqlens int32 (n_docs + 1) on the device; max_seqlen (python int) >= the longest document, used only to
    pick tuned tile sizes; scale = softmax scale. Returns (T, Hq, D); differentiable w.r.t. q, k, v. Never reads
    cu_seqlens on the host.
    """
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or k.shape != v.shape or q.shape[0] != k.shape[0]:
        raise ValueError(f"expected q (T, Hq, D), k and v (T, Hkv, D); got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    D = q.shape[2]
    if D not in SUPPORTED_HEAD_DIMS or k.shape[2] != D:
        raise ValueError(f"attention kernel supports head dim D in {SUPPORTED_HEAD_DIMS}, got D={D} "
                         f"(k/v D={k.shape[2]}); use kernels.reference.attention for other sizes")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"Hq={q.shape[1]} is not a multiple of Hkv={k.shape[1]}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"expected q, k, v all bf16, fp16 or fp32; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not scale > 0:
        raise ValueError(f"softmax scale must be positive, got {scale}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens must be int32 on {q.device}, got {cu_seqlens.dtype} on {cu_seqlens.device}")
    if q.shape[0] == 0:  # no tokens: an empty (0, Hq, D) output, still in the graph (a TMA box needs T > 0)
        return q.clone()
    q, k, v = _tma_ready(q), _tma_ready(k), _tma_ready(v)
    return _Attention.apply(q, k, v, cu_seqlens, int(max_seqlen), float(scale))
