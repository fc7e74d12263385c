"""Causal flash attention over a packed stream of sequences (varlen), with grouped-query attention, in Triton.

q (T, Hq, D), k and v (T, Hkv, D): T tokens of sequences end to end, cu_seqlens (n_seqs + 1,) int32 their bounds.
A token attends to itself and the earlier tokens of its sequence; query head h reads kv head h // (Hq // Hkv).

Forward (FlashAttention-2). For a query row i and the keys j <= i of its sequence:
    s_ij = scale * q_i . k_j          p_ij = exp(s_ij - lse_i)          o_i = sum_j p_ij v_j
p is never stored: a program walks the key blocks of its query block keeping per row a running max m, sum l and
unnormalised output acc, in fp32 and in base 2 (t = s * log2(e); exp2 is the hardware instruction). Per key block:
    m' = max(m, max_j t_ij)     alpha = 2^(m - m')     p~_ij = 2^(t_ij - m')
    l  = alpha * l + sum_j p~_ij          acc = alpha * acc + p~ @ V
then o = acc / l and, saved for backward, lse2 = m + log2(l). Every exponent stays <= 0: nothing overflows. Key
blocks left of the diagonal need no mask, the diagonal ones get j <= i, those right of it are never visited.

Backward, with p recomputed from lse2 and dO the incoming gradient:
    dV_j  = sum_i p_ij dO_i                           dP_ij = dO_i . v_j
    dS_ij = p_ij (dP_ij - delta_i),   delta_i = sum_j p_ij dP_ij = dO_i . o_i
    dQ_i  = scale * sum_j dS_ij k_j                   dK_j  = scale * sum_i dS_ij q_i
dS_ij = d/ds_ij of sum_k dP_ik p_ik (the softmax Jacobian applied to dP); delta needs only O and dO. Two kernels, no
atomics: dQ per query block (storing delta), then dK/dV per key block, summed over its GQA group's query heads.

A program may stack the same query rows of several heads of a GQA group in one tile (_stacked_rows), and finds its
sequence without the host reading cu_seqlens (_locate_block). bf16/fp16 inputs (fp32 for tests), fp32 accumulation and
statistics; tiles: kernels/attention_tuning.py. After FlashAttention-2 (Tri Dao) and Triton's fused-attention tutorial.
"""
import torch
import triton
import triton.language as tl

from . import attention_tuning as tuning

LOG2E = 1.4426950408889634  # log2(e): exp(x) = 2^(x * log2(e))
# Powers of 2 (tl.arange), >= 16 (the smallest tl.dot). 256 is left out: the tile lists were swept at D = 128, and
# at 256 the dK/dV accumulators of most of them do not fit in registers.
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)


@triton.jit
def _locate_block(cu_seqlens, n_seqs, slot, BLOCK: tl.constexpr):
    """Flat slot -> (sequence start, sequence length, block index in the sequence, where the sequence's row
    statistics start: _stat_columns).

    The grid is 1-D: program id = slot * (heads / HEADS) + head tile, heads fastest, so the query heads of a group
    run side by side and share K/V blocks in L2. Sequence i owns the slots
        [cu[i] // BLOCK + i,  cu[i+1] // BLOCK + i + 1)
    which are at least cdiv(len_i, BLOCK) (the "+ 1" pays for a partial block) and never overlap the next
    sequence's. So T // BLOCK + n_seqs slots, known from shapes alone, cover every block of every sequence, with
    at most one spare slot per sequence (it exits at once), and no empty programs for short sequences as a
    (cdiv(max_seqlen, BLOCK), n_seqs, H) grid would launch. A program finds its sequence by binary search.
    """
    lo = 0  # the sequence is the last one whose first slot, cu[i] // BLOCK + i, is <= slot
    hi = n_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        found = tl.load(cu_seqlens + mid) // BLOCK + mid <= slot
        lo = tl.where(found, mid, lo)
        hi = tl.where(found, hi, mid)
    seq_start = tl.load(cu_seqlens + lo)
    seq_len = tl.load(cu_seqlens + lo + 1) - seq_start
    return seq_start, seq_len, slot - (seq_start // BLOCK + lo), 4 * lo + (seq_start + 3) // 4 * 4


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
    (HEADS divides G). Tile row r is row r % BLOCK_M of the block, in the tile's head r // BLOCK_M.

    The heads of a group read the same keys and values, so each K/V block is loaded once for all of them, and
    the matrix products are HEADS times taller. That matters for short sequences: 128-row blocks of one head
    compute mostly past the diagonal or past the sequence's end, while 32-row blocks waste little but are too
    small for the tensor cores; 4 heads x 32 rows is both. (FlashAttention-3 packs GQA heads so for decoding.)"""
    r = tl.arange(0, HEADS * BLOCK_M)
    return r % BLOCK_M, r // BLOCK_M


@triton.jit(do_not_specialize=["n_seqs"])  # varies every batch: don't recompile when it is 1 or % 16 == 0
def _attn_fwd(Q, K, V, O, LSE2, cu_seqlens, n_seqs, n_heads, stride_stat, qk_scale, seqlen_bucket,
              stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, KD, VD,
              GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              HEADS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One program = BLOCK_M query rows of one sequence, in HEADS query heads of one GQA group stacked in one
    tile. seqlen_bucket: autotuning key only."""
    n_tiles = n_heads // HEADS
    head0 = (tl.program_id(0) % n_tiles) * HEADS  # heads vary fastest: a GQA group reads the same K/V together
    seq_start, seq_len, local, stat_start = _locate_block(cu_seqlens, n_seqs, tl.program_id(0) // n_tiles, BLOCK_M)
    q_block = tl.cdiv(seq_len, BLOCK_M) - 1 - local  # longest rows (most keys) first: better tail balance
    if q_block < 0:
        return
    kv_head = head0 // GROUP
    q_lo = q_block * BLOCK_M
    rows, heads = _stacked_rows(BLOCK_M, HEADS)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    offs_m = q_lo + rows  # positions inside the sequence
    row_ok = offs_m < seq_len

    # The tile's first row as an int64 scalar, the offsets inside the tile int32: T * H * D may pass 2^31.
    q_row0 = (seq_start + q_lo).to(tl.int64)
    q_tile = rows[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(Q + q_row0 * stride_qt + head0 * stride_qh + q_tile, mask=row_ok[:, None], other=0.0)
    k_tile = cols[:, None] * stride_kt + dims[None, :]
    v_tile = cols[:, None] * stride_vt + dims[None, :]

    m_i = tl.full([HEADS * BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([HEADS * BLOCK_M], tl.float32)
    acc = tl.zeros([HEADS * BLOCK_M, HEAD_DIM], tl.float32)
    diag_lo = q_lo // BLOCK_N * BLOCK_N  # the first key block that reaches the diagonal
    # keys [0, diag_lo): left of the diagonal, all inside the sequence: no mask, TMA tiles (Hopper's tensor memory
    # accelerator copies a whole tile to shared memory: no per-element addresses or masks in registers). A box
    # clips only at the tensor's end, not a sequence's, so the blocks that touch a sequence's end keep masked
    # pointer loads. Where there is no TMA (older GPUs, the interpreter), Triton lowers these to plain loads.
    for kv_lo in range(0, diag_lo, BLOCK_N):
        k = KD.load([kv_head, seq_start + kv_lo, 0]).reshape([BLOCK_N, HEAD_DIM])
        v = VD.load([kv_head, seq_start + kv_lo, 0]).reshape([BLOCK_N, HEAD_DIM])
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k, v, qk_scale, offs_m, kv_lo + cols, False, DOT_PRECISION)
    # keys [diag_lo, q_lo + BLOCK_M) on the diagonal: causal mask, and no loads past the sequence's end. Pointer
    # loads: a scalar pointer to the tile's first row, advanced by BLOCK_N rows per step, plus int32 tile offsets
    k_rows = K + (seq_start + diag_lo).to(tl.int64) * stride_kt + kv_head * stride_kh
    v_rows = V + (seq_start + diag_lo).to(tl.int64) * stride_vt + kv_head * stride_vh
    for kv_lo in range(diag_lo, tl.minimum(q_lo + BLOCK_M, seq_len), BLOCK_N):
        offs_n = kv_lo + cols
        k = tl.load(k_rows + k_tile, mask=(offs_n < seq_len)[:, None], other=0.0)
        v = tl.load(v_rows + v_tile, mask=(offs_n < seq_len)[:, None], other=0.0)
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k, v, qk_scale, offs_m, offs_n, True, DOT_PRECISION)
        k_rows += BLOCK_N * stride_kt
        v_rows += BLOCK_N * stride_vt

    o_tile = rows[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(O + q_row0 * stride_ot + head0 * stride_oh + o_tile, (acc / l_i[:, None]).to(O.dtype.element_ty),
             mask=row_ok[:, None])
    lse_rows = LSE2 + head0.to(tl.int64) * stride_stat + stat_start  # row statistics: (Hq, _stat_columns)
    tl.store(lse_rows + heads * stride_stat + offs_m, m_i + tl.math.log2(l_i), mask=row_ok)


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


@triton.jit(do_not_specialize=["n_seqs"])
def _attn_bwd_dkdv(Q, K, V, DO, DK, DV, LSE2, DELTA, cu_seqlens, n_seqs, n_kv_heads, stride_stat, qk_scale, scale,
                   seqlen_bucket,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                   stride_dkt, stride_dkh, stride_dvt, stride_dvh, QD, DOD, LSED, DELTAD,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HEADS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One program = BLOCK_N keys of one sequence and one kv head; loops over the GROUP query heads, HEADS at a
    time stacked in query tiles of HEADS * BLOCK_M rows, and for each over the query blocks from the diagonal to
    the sequence's end (queries above the diagonal never see these keys). dK and dV of the whole group add up in
    fp32 registers: no atomics, no repeated K/V in memory, a fixed summation order (deterministic)."""
    tl.static_assert(BLOCK_N % BLOCK_M == 0)  # the masked loop must end exactly past the diagonal
    kv_head = tl.program_id(0) % n_kv_heads
    seq_start, seq_len, kv_block, stat_start = _locate_block(cu_seqlens, n_seqs, tl.program_id(0) // n_kv_heads,
                                                             BLOCK_N)
    kv_lo = kv_block * BLOCK_N  # block 0 sees every query of the sequence: the heaviest come first already
    if kv_lo >= seq_len:
        return
    rows, heads = _stacked_rows(BLOCK_M, HEADS)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    offs_n = kv_lo + cols
    col_ok = (offs_n < seq_len)[:, None]
    kv_row0 = (seq_start + kv_lo).to(tl.int64)
    k = tl.load(K + kv_row0 * stride_kt + kv_head * stride_kh + cols[:, None] * stride_kt + dims[None, :],
                mask=col_ok, other=0.0)
    v = tl.load(V + kv_row0 * stride_vt + kv_head * stride_vh + cols[:, None] * stride_vt + dims[None, :],
                mask=col_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    diag_end = tl.minimum(kv_lo + BLOCK_N, seq_len)
    q_tile = rows[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    do_tile = rows[:, None] * stride_dot + heads[:, None] * stride_doh + dims[None, :]
    stat_tile = heads * stride_stat  # row statistics: (Hq, _stat_columns)

    for g in range(0, GROUP, HEADS):
        head0 = kv_head * GROUP + g
        q_rows = Q + kv_row0 * stride_qt + head0 * stride_qh  # scalar row pointers + int32 tiles, as in forward
        do_rows = DO + kv_row0 * stride_dot + head0 * stride_doh
        lse_rows = LSE2 + head0.to(tl.int64) * stride_stat + stat_start + stat_tile
        delta_rows = DELTA + head0.to(tl.int64) * stride_stat + stat_start + stat_tile
        # Query rows past the sequence's end load q = dO = delta = 0, so they add 0 to dV and dK.
        # queries [kv_lo, kv_lo + BLOCK_N) on the diagonal: causal mask
        for q_lo in range(kv_lo, diag_end, BLOCK_M):
            offs_m = q_lo + rows
            ok = offs_m < seq_len
            q = tl.load(q_rows + q_tile, mask=ok[:, None], other=0.0)
            do = tl.load(do_rows + do_tile, mask=ok[:, None], other=0.0)
            lse2 = tl.load(lse_rows + offs_m, mask=ok, other=0.0)
            delta = tl.load(delta_rows + offs_m, mask=ok, other=0.0)
            dk, dv = _dkdv_step(dk, dv, k, v, q, do, lse2, delta, qk_scale, offs_m, offs_n, True, DOT_PRECISION)
            q_rows += BLOCK_M * stride_qt
            do_rows += BLOCK_M * stride_dot
        # queries [kv_lo + BLOCK_N, seq_len) below the diagonal: they see every key of the block, no mask;
        # the whole query blocks as TMA tiles, lse2 and delta too (pointer loads of them would have each thread
        # load its columns one by one, which makes the loop spill registers), then the partial last one (if any)
        # with masked loads
        full_end = kv_lo + BLOCK_N + (seq_len - kv_lo - BLOCK_N) // BLOCK_M * BLOCK_M
        for q_lo in range(kv_lo + BLOCK_N, full_end, BLOCK_M):
            offs_m = q_lo + rows
            q = QD.load([head0, seq_start + q_lo, 0]).reshape([HEADS * BLOCK_M, HEAD_DIM])
            do = DOD.load([head0, seq_start + q_lo, 0]).reshape([HEADS * BLOCK_M, HEAD_DIM])
            lse2 = LSED.load([head0, stat_start + q_lo]).reshape([HEADS * BLOCK_M])
            delta = DELTAD.load([head0, stat_start + q_lo]).reshape([HEADS * BLOCK_M])
            dk, dv = _dkdv_step(dk, dv, k, v, q, do, lse2, delta, qk_scale, offs_m, offs_n, False, DOT_PRECISION)
        q_rows = Q + (seq_start + full_end).to(tl.int64) * stride_qt + head0 * stride_qh
        do_rows = DO + (seq_start + full_end).to(tl.int64) * stride_dot + head0 * stride_doh
        for q_lo in range(tl.maximum(full_end, kv_lo + BLOCK_N), seq_len, BLOCK_M):  # at most one block
            offs_m = q_lo + rows
            ok = offs_m < seq_len
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


@triton.jit(do_not_specialize=["n_seqs"])
def _attn_bwd_dq(Q, K, V, O, DO, DQ, LSE2, DELTA, cu_seqlens, n_seqs, n_heads, stride_stat, qk_scale, scale,
                 seqlen_bucket,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                 stride_dot, stride_doh, stride_dqt, stride_dqh, KD, VD,
                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 HEADS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One program = BLOCK_M query rows of one sequence in HEADS query heads of one GQA group, as in forward.
    It also computes delta = rowsum(dO * O) of its rows, and stores it for the dK/dV kernel that runs next."""
    n_tiles = n_heads // HEADS
    head0 = (tl.program_id(0) % n_tiles) * HEADS
    seq_start, seq_len, local, stat_start = _locate_block(cu_seqlens, n_seqs, tl.program_id(0) // n_tiles, BLOCK_M)
    q_block = tl.cdiv(seq_len, BLOCK_M) - 1 - local  # longest rows first
    if q_block < 0:
        return
    kv_head = head0 // GROUP
    q_lo = q_block * BLOCK_M
    rows, heads = _stacked_rows(BLOCK_M, HEADS)
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    offs_m = q_lo + rows
    ok = offs_m < seq_len
    q_row0 = (seq_start + q_lo).to(tl.int64)
    q = tl.load(Q + q_row0 * stride_qt + head0 * stride_qh + rows[:, None] * stride_qt + heads[:, None] * stride_qh
                + dims[None, :], mask=ok[:, None], other=0.0)
    do = tl.load(DO + q_row0 * stride_dot + head0 * stride_doh + rows[:, None] * stride_dot
                 + heads[:, None] * stride_doh + dims[None, :], mask=ok[:, None], other=0.0)
    o = tl.load(O + q_row0 * stride_ot + head0 * stride_oh + rows[:, None] * stride_ot + heads[:, None] * stride_oh
                + dims[None, :], mask=ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # rows past the end: computed, never stored
    stats = head0.to(tl.int64) * stride_stat + stat_start + heads * stride_stat + offs_m  # these rows' statistics
    tl.store(DELTA + stats, delta, mask=ok)
    lse2 = tl.load(LSE2 + stats, mask=ok, other=0.0)
    k_tile = cols[:, None] * stride_kt + dims[None, :]
    v_tile = cols[:, None] * stride_vt + dims[None, :]

    dq = tl.zeros([HEADS * BLOCK_M, HEAD_DIM], tl.float32)
    diag_lo = q_lo // BLOCK_N * BLOCK_N  # as in forward
    for kv_lo in range(0, diag_lo, BLOCK_N):  # left of the diagonal: no mask, TMA tiles (as in forward)
        k = KD.load([kv_head, seq_start + kv_lo, 0]).reshape([BLOCK_N, HEAD_DIM])
        v = VD.load([kv_head, seq_start + kv_lo, 0]).reshape([BLOCK_N, HEAD_DIM])
        dq = _dq_step(dq, q, do, k, v, lse2, delta, qk_scale, offs_m, kv_lo + cols, False, DOT_PRECISION)
    k_rows = K + (seq_start + diag_lo).to(tl.int64) * stride_kt + kv_head * stride_kh
    v_rows = V + (seq_start + diag_lo).to(tl.int64) * stride_vt + kv_head * stride_vh
    for kv_lo in range(diag_lo, tl.minimum(q_lo + BLOCK_M, seq_len), BLOCK_N):  # the diagonal: causal mask
        offs_n = kv_lo + cols
        k = tl.load(k_rows + k_tile, mask=(offs_n < seq_len)[:, None], other=0.0)
        v = tl.load(v_rows + v_tile, mask=(offs_n < seq_len)[:, None], other=0.0)
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


def _stats(H, T, n_seqs, device):
    """The (H, W) fp32 buffer of per-row statistics (lse2, delta) of T tokens in n_seqs sequences (_stat_columns)."""
    return torch.empty((H, (T + 3) // 4 * 4 + 4 * n_seqs), device=device, dtype=torch.float32)


def _stat_columns(cu_seqlens, T):
    """Where each token's row statistics lie in the (H, W) buffers: token t of sequence s at column
    4 s + roundup4(cu[s]) + (t - cu[s]). Each sequence starts 16-byte aligned, as a TMA box of fp32 must (the dK/dV
    kernel reads them so); the 4 s keeps sequences apart, and all fit in W = roundup4(T) + 4 n_seqs columns. A kernel
    finds its sequence's start from s and cu[s] alone (_locate_block). The columns between sequences are never read."""
    starts, lengths = cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths, output_size=T)
    return 4 * seq + (starts[seq] + 3) // 4 * 4 + torch.arange(T, device=cu_seqlens.device) - starts[seq]


def _slots(T, n_seqs, block):
    return T // block + n_seqs  # flat slots covering every block of every sequence (_locate_block)


def _forward(q, k, v, cu_seqlens, max_seqlen, scale):
    T, Hq, D = q.shape
    n_seqs = cu_seqlens.shape[0] - 1
    o = torch.empty((T, Hq, D), device=q.device, dtype=q.dtype)
    lse2 = _stats(Hq, T, n_seqs, q.device)
    grid = lambda meta: (_slots(T, n_seqs, meta["BLOCK_M"]) * (Hq // meta["HEADS"]),)
    KERNELS["fwd"](q.dtype, grid,
                   q, k, v, o, lse2, cu_seqlens, n_seqs, Hq, lse2.stride(0), scale * LOG2E,
                   tuning.seqlen_bucket(max_seqlen),
                   q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0),
                   o.stride(1), GROUP=Hq // k.shape[1], HEAD_DIM=D)
    return o, lse2


def _backward(do, q, k, v, o, lse2, cu_seqlens, max_seqlen, scale):
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    n_seqs = cu_seqlens.shape[0] - 1
    bucket = tuning.seqlen_bucket(max_seqlen)
    delta = torch.empty_like(lse2)  # written by the dQ kernel, read by dK/dV
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    KERNELS["dq"](q.dtype, lambda meta: (_slots(T, n_seqs, meta["BLOCK_M"]) * (Hq // meta["HEADS"]),),
                  q, k, v, o, do, dq, lse2, delta, cu_seqlens, n_seqs, Hq, lse2.stride(0), scale * LOG2E, scale, bucket,
                  q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0),
                  o.stride(1), do.stride(0), do.stride(1), dq.stride(0), dq.stride(1), GROUP=Hq // Hkv, HEAD_DIM=D)
    KERNELS["dkdv"](q.dtype, lambda meta: (_slots(T, n_seqs, meta["BLOCK_N"]) * Hkv,),
                    q, k, v, do, dk, dv, lse2, delta, cu_seqlens, n_seqs, Hkv, lse2.stride(0), scale * LOG2E, scale,
                    bucket,
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
    """Causal attention inside each packed sequence, GQA by head groups; same contract as reference.attention.

    q (T, Hq, D), k and v (T, Hkv, D), Hq a multiple of Hkv, D in SUPPORTED_HEAD_DIMS, bf16 / fp16 (fp32 for tests);
    cu_seqlens int32 (n_seqs + 1) on the device; max_seqlen (python int) >= the longest sequence, used only to
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
