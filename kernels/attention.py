"""Causal flash attention over a packed stream of sequences (varlen), with grouped-query attention, in Triton.

q (T, Hq, D), k and v (T, Hkv, D): T tokens of several sequences end to end, cu_seqlens (n_seqs + 1,) int32 their
boundaries. A token attends to itself and the earlier tokens of its own sequence. GQA: query head h reads kv head
h // G, G = Hq // Hkv.

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
dS is the softmax Jacobian applied to dP: d/ds_ij of sum_k dP_ik p_ik = p_ij (dP_ij - sum_k p_ik dP_ik); delta's
sum over the whole row is computed from O and dO alone. Two kernels, no atomics: dQ per query block (it also
stores delta), then dK/dV per key block, summing over its GQA group's query heads; both recompute P and dP, so 7
matrix products per pair of tiles. BACKWARD = "fused-*" (opt-in) has one kernel per key block do all 5 and add
its dQ share of each query tile into an accumulator: deterministic as integers, round(2^e_i dQ share) with a row
exponent e_i from a bound on |dQ_i| (_dq_exponent), since integer addition is exact in any order.

A program may stack the same query rows of several heads of a GQA group in one tile (_stacked_rows), and finds
its sequence without the host reading cu_seqlens (_locate_block). bf16/fp16 inputs (fp32 for tests), fp32
accumulation and statistics. Tile configs, their switches (EDGES_TMA, the forward's WS) and autotuning:
kernels/attention_tuning.py; bench/attention_sweep.py times the variants. After the FlashAttention-2 paper (Tri
Dao, 2023), FlashAttention-3 (Shah et al., 2024: warp specialization, dQ by TMA reductions) and the Triton
fused-attention tutorial; the code is our own.
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
def _locate_block(cu_seqlens, n_seqs, slot, BLOCK: tl.constexpr, LOOP_FREE: tl.constexpr = False):
    """Flat slot -> (sequence start, sequence length, block index in the sequence).

    The grid is 1-D: program id = slot * (heads / HEADS) + head tile, heads fastest, so the query heads of a group
    run side by side and share K/V blocks in L2. Sequence i owns the slots
        [cu[i] // BLOCK + i,  cu[i+1] // BLOCK + i + 1)
    which are at least cdiv(len_i, BLOCK) (the "+ 1" pays for a partial block) and never overlap the next
    sequence's. So T // BLOCK + n_seqs slots, known from shapes alone, cover every block of every sequence, with
    at most one spare slot per sequence (it exits at once), and no empty programs for short sequences as a
    (cdiv(max_seqlen, BLOCK), n_seqs, H) grid would launch. A program finds its sequence by binary search, or
    (LOOP_FREE, for Triton's Hopper warp specialization, which takes no loop besides the one it splits) by
    four rounds of counting how many of 64 evenly spaced sequences start at or before the slot (n_seqs <= 64^4,
    more than any batch has: every sequence has a token).
    """
    lo = 0  # the sequence is the last one whose first slot, cu[i] // BLOCK + i, is <= slot
    if LOOP_FREE:
        i = tl.arange(0, 64)
        span = n_seqs  # the sequence is in [lo, lo + span)
        for _ in tl.static_range(4):
            step = tl.cdiv(span, 64)
            idx = lo + i * step
            ok = i * step < span
            starts_before = ok & (tl.load(cu_seqlens + idx, mask=ok, other=0) // BLOCK + idx <= slot)
            c = tl.sum(starts_before.to(tl.int32), 0) - 1  # >= 0: sequence lo starts at or before the slot
            lo = lo + c * step
            span = tl.minimum(step, span - c * step)
    else:
        hi = n_seqs
        while hi - lo > 1:
            mid = (lo + hi) // 2
            found = tl.load(cu_seqlens + mid) // BLOCK + mid <= slot
            lo = tl.where(found, mid, lo)
            hi = tl.where(found, hi, mid)
    seq_start = tl.load(cu_seqlens + lo)
    seq_len = tl.load(cu_seqlens + lo + 1) - seq_start
    return seq_start, seq_len, slot - (seq_start // BLOCK + lo)


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
def _attn_fwd(Q, K, V, O, LSE2, cu_seqlens, n_seqs, n_heads, T, qk_scale, seqlen_bucket,
              stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, QD, KD, VD,
              GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              HEADS: tl.constexpr, DOT_PRECISION: tl.constexpr, EDGES_TMA: tl.constexpr = False,
              WS: tl.constexpr = 0):
    """One program = BLOCK_M query rows of one sequence, in HEADS query heads of one GQA group stacked in one
    tile. seqlen_bucket: autotuning key only. Config switches (kernels/attention_tuning.py):
      EDGES_TMA  the diagonal key blocks (and q) are TMA tiles too: keys past the sequence's end are masked by
                 causality anyway (j > i for every row i inside it), rows past it are computed and not stored.
      WS = 1     one loop over every key block, each masked, q, K and V through descriptors made on the device;
      WS = 2     the same loop warp-specialized (tl.range(warp_specialize=True)); one head per tile. On Hopper
                 (num_warps=4) Triton then gives the loads to a producer warpgroup and splits the 128-row tile over
                 two consumer warpgroups that sync through barriers in shared memory, not the CTA-wide barrier of
                 the pipelined loop, so one can run its softmax while the other's matrix products run
                 (FlashAttention-3's producer/consumer structure, without its explicit ping-pong). That pass wants
                 one loop of device-made descriptor loads, no early exit, no other loop (BENCHMARKS.md: triton
                 3.6 aborted on the two loops below), hence this path."""
    n_tiles = n_heads // HEADS
    head0 = (tl.program_id(0) % n_tiles) * HEADS  # heads vary fastest: a GQA group reads the same K/V together
    seq_start, seq_len, local = _locate_block(cu_seqlens, n_seqs, tl.program_id(0) // n_tiles, BLOCK_M, WS > 0)
    q_block = tl.cdiv(seq_len, BLOCK_M) - 1 - local  # longest rows (most keys) first: better tail balance
    if WS > 0:  # no early exit (no branches for warp specialization): a spare slot runs no keys, stores nothing
        seq_len = tl.where(q_block < 0, 0, seq_len)
        q_block = tl.maximum(q_block, 0)
    elif q_block < 0:
        return
    kv_head = head0 // GROUP
    q_lo = q_block * BLOCK_M
    rows, heads = _stacked_rows(BLOCK_M, HEADS)
    dims = tl.arange(0, HEAD_DIM)
    offs_m = q_lo + rows  # positions inside the sequence
    row_ok = offs_m < seq_len

    # The tile's first row as an int64 scalar, the offsets inside the tile int32: T * H * D may pass 2^31.
    q_row0 = (seq_start + q_lo).to(tl.int64)
    if WS > 0:  # (the warp specialization fails on a 3-D box: one head per tile here)
        tl.static_assert(HEADS == 1)
        qd = tl.make_tensor_descriptor(Q + head0 * stride_qh, shape=[T, HEAD_DIM], strides=[stride_qt, 1],
                                       block_shape=[BLOCK_M, HEAD_DIM])
        q = qd.load([seq_start + q_lo, 0])
    elif EDGES_TMA:  # rows past the sequence's end read the next one's (or TMA's zeros): never stored
        q = QD.load([head0, seq_start + q_lo, 0]).reshape([HEADS * BLOCK_M, HEAD_DIM])
    else:
        q_tile = rows[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
        q = tl.load(Q + q_row0 * stride_qt + head0 * stride_qh + q_tile, mask=row_ok[:, None], other=0.0)

    m_i = tl.full([HEADS * BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([HEADS * BLOCK_M], tl.float32)
    acc = tl.zeros([HEADS * BLOCK_M, HEAD_DIM], tl.float32)
    if WS > 0:
        acc, m_i, l_i = _fwd_one_loop(acc, m_i, l_i, q, K, V, kv_head, seq_start, seq_len, q_lo, T, qk_scale,
                                      stride_kt, stride_kh, stride_vt, stride_vh, offs_m, HEAD_DIM, BLOCK_M,
                                      BLOCK_N, WS == 2, DOT_PRECISION)
    else:
        acc, m_i, l_i = _fwd_two_loops(acc, m_i, l_i, q, K, V, KD, VD, kv_head, seq_start, seq_len, q_lo, qk_scale,
                                       stride_kt, stride_kh, stride_vt, stride_vh, offs_m, HEAD_DIM, BLOCK_M,
                                       BLOCK_N, EDGES_TMA, DOT_PRECISION)

    o_tile = rows[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(O + q_row0 * stride_ot + head0 * stride_oh + o_tile, (acc / l_i[:, None]).to(O.dtype.element_ty),
             mask=row_ok[:, None])
    lse_rows = LSE2 + head0.to(tl.int64) * T + seq_start  # row statistics are laid out (Hq, T)
    tl.store(lse_rows + heads * T + offs_m, m_i + tl.math.log2(l_i), mask=row_ok)


@triton.jit
def _fwd_two_loops(acc, m_i, l_i, q, K, V, KD, VD, kv_head, seq_start, seq_len, q_lo, qk_scale,
                   stride_kt, stride_kh, stride_vt, stride_vh, offs_m, HEAD_DIM: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EDGES_TMA: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """Keys left of the diagonal block without a mask, then the diagonal ones with the causal mask."""
    cols = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    diag_lo = q_lo // BLOCK_N * BLOCK_N  # the first key block that reaches the diagonal
    # keys [0, diag_lo): left of the diagonal, all inside the sequence: no mask, TMA tiles (Hopper's tensor memory
    # accelerator copies a whole tile to shared memory: no per-element addresses or masks in registers). A box
    # clips only at the tensor's end, not a sequence's, so (unless EDGES_TMA) the blocks that touch a sequence's
    # end keep masked pointer loads. Where there is no TMA (older GPUs, the interpreter), Triton lowers these to
    # plain loads.
    for kv_lo in range(0, diag_lo, BLOCK_N):
        k = KD.load([kv_head, seq_start + kv_lo, 0]).reshape([BLOCK_N, HEAD_DIM])
        v = VD.load([kv_head, seq_start + kv_lo, 0]).reshape([BLOCK_N, HEAD_DIM])
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k, v, qk_scale, offs_m, kv_lo + cols, False, DOT_PRECISION)
    # keys [diag_lo, q_lo + BLOCK_M) on the diagonal: causal mask, and no loads past the sequence's end. Pointer
    # loads: a scalar pointer to the tile's first row, advanced by BLOCK_N rows per step, plus int32 tile offsets
    k_tile = cols[:, None] * stride_kt + dims[None, :]
    v_tile = cols[:, None] * stride_vt + dims[None, :]
    k_rows = K + (seq_start + diag_lo).to(tl.int64) * stride_kt + kv_head * stride_kh
    v_rows = V + (seq_start + diag_lo).to(tl.int64) * stride_vt + kv_head * stride_vh
    for kv_lo in range(diag_lo, tl.minimum(q_lo + BLOCK_M, seq_len), BLOCK_N):
        offs_n = kv_lo + cols
        if EDGES_TMA:
            k = KD.load([kv_head, seq_start + kv_lo, 0]).reshape([BLOCK_N, HEAD_DIM])
            v = VD.load([kv_head, seq_start + kv_lo, 0]).reshape([BLOCK_N, HEAD_DIM])
        else:
            k = tl.load(k_rows + k_tile, mask=(offs_n < seq_len)[:, None], other=0.0)
            v = tl.load(v_rows + v_tile, mask=(offs_n < seq_len)[:, None], other=0.0)
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k, v, qk_scale, offs_m, offs_n, True, DOT_PRECISION)
        k_rows += BLOCK_N * stride_kt
        v_rows += BLOCK_N * stride_vt
    return acc, m_i, l_i


@triton.jit
def _fwd_one_loop(acc, m_i, l_i, q, K, V, kv_head, seq_start, seq_len, q_lo, T, qk_scale,
                  stride_kt, stride_kh, stride_vt, stride_vh, offs_m, HEAD_DIM: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """Every key block [0, q_lo + BLOCK_M) in one loop, each with the causal mask (one compare and select per
    score more than the unmasked loop), K/V read through descriptors made here, on the device (Triton's Hopper
    warp specialization does not split a tile read through host-made descriptors)."""
    cols = tl.arange(0, BLOCK_N)
    kd = tl.make_tensor_descriptor(K + kv_head * stride_kh, shape=[T, HEAD_DIM], strides=[stride_kt, 1],
                                   block_shape=[BLOCK_N, HEAD_DIM])
    vd = tl.make_tensor_descriptor(V + kv_head * stride_vh, shape=[T, HEAD_DIM], strides=[stride_vt, 1],
                                   block_shape=[BLOCK_N, HEAD_DIM])
    for kv_lo in tl.range(0, tl.minimum(q_lo + BLOCK_M, seq_len), BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = kd.load([seq_start + kv_lo, 0])
        v = vd.load([seq_start + kv_lo, 0])
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k, v, qk_scale, offs_m, kv_lo + cols, True, DOT_PRECISION)
    return acc, m_i, l_i


# ---------------------------------------------------------------------------------------------------- backward

@triton.jit
def _dkdv_step(dk, dv, k, v, q, do, lse2, delta, qk_scale, offs_m, offs_n,
               CAUSAL_MASK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add one query tile's share to dK and dV, all in the transposed (keys x queries) orientation; also return
    dS^T (16-bit), for the fused backward's dQ."""
    pT = tl.math.exp2(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale - lse2[None, :])
    if CAUSAL_MASK:
        pT = tl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
    dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)  # dV += P^T dO
    dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # dP^T = V dO^T
    dsT = (pT * (dpT - delta[None, :])).to(q.dtype)  # dS^T = P^T * (dP^T - delta)
    dk = tl.dot(dsT, q, dk, input_precision=DOT_PRECISION)  # dK += dS^T Q  (scale applied at the end)
    return dk, dv, dsT


@triton.jit
def _pow2(e):
    """2^e for int32 e in [-126, 127], built from the exponent bits (exact; exp2 is an approximation)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _dq_exponent(DON, KV_MAX, stats, ok, BITS: tl.constexpr):
    """Row i's fixed-point exponent e_i (int32): |sum of round(2^e_i c)| over all its dQ shares c stays < 2^(BITS-2).

    dQ_i = sum_j dS_ij k_j and |dS_ij| = p_ij |dP_ij - delta_i| <= p_ij 2 |dO_i| max_j |v_j| (|dP_ij| and
    |delta_i| = |dO_i . o_i| are both <= |dO_i| max_j |v_j|, o_i being a mean of the v_j), so with sum_j p_ij = 1
    every component of every share, and of their sum, is <= B_i = 2 |dO_i| max_j |v_j| max_jd |k_jd|. B_i < 2^b
    with b from B_i's exponent bits (integer arithmetic: the fused kernel and the final conversion get the same
    e_i), and e_i = BITS - 3 - b leaves a factor 2 for rounding (16-bit dS, approximate exp2)."""
    bound = 2.0 * tl.load(DON + stats, mask=ok, other=0.0) * (tl.load(KV_MAX) * tl.load(KV_MAX + 1))
    b = ((bound.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126  # bound < 2^b (bound >= 0)
    return tl.minimum(tl.maximum((BITS - 3) - b, -120), 120)  # B = 0 (dO_i = 0): e = 120, its shares are all 0


@triton.jit
def _dq_share(dsT, k, DQD, head0, row0, acc_ptrs, ok, DON, KV_MAX, stats, DQ_MODE: tl.constexpr, DQ_TMA: tl.constexpr,
              DOT_PRECISION: tl.constexpr):
    """The fused backward's dQ: this tile's dS K (scale applied at the end), added into the accumulator by atomics.
    DQ_MODE 0: fp32 atomics, whose order (so the last bits) varies run to run. 32 / 64: round(2^e_i dS K) as
    int32 / int64 (_dq_exponent): integer sums are exact in any order, so dQ is deterministic; the resolution is
    2^-e_i ~ B_i 2^-29 (int32, ~1e-4 of a typical long-sequence dQ, under bf16's rounding) or B_i 2^-61 (int64).
    DQ_TMA: one bulk TMA reduction of the tile (FlashAttention-3's way; no per-element addresses in registers; int64
    goes as uint64, the same bits). Its rows past the sequence's end are exactly 0 (their dS is), so adding them to
    the next sequence's rows is harmless. Otherwise (the interpreter has no TMA reductions) per-element atomics."""
    dq = tl.dot(tl.trans(dsT), k, input_precision=DOT_PRECISION)  # (HEADS * BLOCK_M, HEAD_DIM)
    if DQ_MODE != 0:
        dq = dq * _pow2(_dq_exponent(DON, KV_MAX, stats, ok, DQ_MODE))[:, None]
        if DQ_MODE == 32:
            dq = (dq + tl.where(dq >= 0, 0.5, -0.5)).to(tl.int32)  # nearest: the conversion truncates
        else:
            dq = dq.to(tl.int64)
    if DQ_TMA:
        if DQ_MODE == 64:
            dq = dq.to(tl.uint64, bitcast=True)
        DQD.atomic_add([head0, row0, 0], dq.reshape(DQD.block_shape))
    else:
        tl.atomic_add(acc_ptrs, dq, mask=ok[:, None], sem="relaxed")


@triton.jit(do_not_specialize=["n_seqs"])
def _attn_bwd_dkdv(Q, K, V, DO, DK, DV, LSE2, DELTA, DON, KV_MAX, DQ_ACC, cu_seqlens, n_seqs, n_kv_heads, T,
                   qk_scale, scale, seqlen_bucket,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                   stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_at, stride_ah, QD, DOD, DQD,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HEADS: tl.constexpr, DOT_PRECISION: tl.constexpr, EDGES_TMA: tl.constexpr = False,
                   DQ_MODE: tl.constexpr = -1, DQ_TMA: tl.constexpr = False):
    """One program = BLOCK_N keys of one sequence and one kv head; loops over the GROUP query heads, HEADS at a
    time stacked in query tiles of HEADS * BLOCK_M rows, and for each over the query blocks from the diagonal to
    the sequence's end (queries above the diagonal never see these keys). dK and dV of the whole group add up in
    fp32 registers: no atomics, no repeated K/V in memory, a fixed summation order (deterministic).
      EDGES_TMA  the diagonal and the partial last query blocks are TMA tiles too; rows past the sequence's end
                 read lse2 = +inf, so their p = 2^-inf = 0 and they add exactly 0 (q, dO there are finite: the next
                 sequence's rows, or TMA's zeros past the tensor's end).
      DQ_MODE    -1: dK, dV only (the split backward). 0, 32, 64: the fused backward, which also adds each tile's
                 dQ share into DQ_ACC (_dq_share): 5 matrix products per tile pair instead of 7 in all."""
    tl.static_assert(BLOCK_N % BLOCK_M == 0)  # the masked loop must end exactly past the diagonal
    kv_head = tl.program_id(0) % n_kv_heads
    seq_start, seq_len, kv_block = _locate_block(cu_seqlens, n_seqs, tl.program_id(0) // n_kv_heads, BLOCK_N)
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
    acc_tile = rows[:, None] * stride_at + heads[:, None] * stride_ah + dims[None, :]
    stat_tile = heads * T  # row statistics are laid out (Hq, T)

    for g in range(0, GROUP, HEADS):
        head0 = kv_head * GROUP + g
        q_rows = Q + kv_row0 * stride_qt + head0 * stride_qh  # scalar row pointers + int32 tiles, as in forward
        do_rows = DO + kv_row0 * stride_dot + head0 * stride_doh
        lse_rows = LSE2 + head0.to(tl.int64) * T + seq_start + stat_tile
        delta_rows = DELTA + head0.to(tl.int64) * T + seq_start + stat_tile
        stat_rows = head0.to(tl.int64) * T + seq_start + stat_tile  # for DON (fused backward)
        # Query rows past the sequence's end load q = dO = delta = 0 (or, with EDGES_TMA, lse2 = inf): they add 0.
        # queries [kv_lo, kv_lo + BLOCK_N) on the diagonal: causal mask
        for q_lo in range(kv_lo, diag_end, BLOCK_M):
            offs_m = q_lo + rows
            ok = offs_m < seq_len
            if EDGES_TMA:
                q = QD.load([head0, seq_start + q_lo, 0]).reshape([HEADS * BLOCK_M, HEAD_DIM])
                do = DOD.load([head0, seq_start + q_lo, 0]).reshape([HEADS * BLOCK_M, HEAD_DIM])
                lse2 = tl.load(lse_rows + offs_m, mask=ok, other=float("inf"))
            else:
                q = tl.load(q_rows + q_tile, mask=ok[:, None], other=0.0)
                do = tl.load(do_rows + do_tile, mask=ok[:, None], other=0.0)
                lse2 = tl.load(lse_rows + offs_m, mask=ok, other=0.0)
            delta = tl.load(delta_rows + offs_m, mask=ok, other=0.0)
            dk, dv, dsT = _dkdv_step(dk, dv, k, v, q, do, lse2, delta, qk_scale, offs_m, offs_n, True,
                                     DOT_PRECISION)
            if DQ_MODE >= 0:
                acc_ptrs = DQ_ACC + (seq_start + q_lo).to(tl.int64) * stride_at + head0 * stride_ah + acc_tile
                _dq_share(dsT, k, DQD, head0, seq_start + q_lo, acc_ptrs, ok, DON, KV_MAX, stat_rows + offs_m,
                          DQ_MODE, DQ_TMA, DOT_PRECISION)
            q_rows += BLOCK_M * stride_qt
            do_rows += BLOCK_M * stride_dot
        # queries [kv_lo + BLOCK_N, seq_len) below the diagonal: they see every key of the block, no mask;
        # the whole query blocks as TMA tiles, then the partial last one (if any)
        full_end = kv_lo + BLOCK_N + (seq_len - kv_lo - BLOCK_N) // BLOCK_M * BLOCK_M
        for q_lo in range(kv_lo + BLOCK_N, full_end, BLOCK_M):
            offs_m = q_lo + rows
            q = QD.load([head0, seq_start + q_lo, 0]).reshape([HEADS * BLOCK_M, HEAD_DIM])
            do = DOD.load([head0, seq_start + q_lo, 0]).reshape([HEADS * BLOCK_M, HEAD_DIM])
            lse2 = tl.load(lse_rows + offs_m)
            delta = tl.load(delta_rows + offs_m)
            dk, dv, dsT = _dkdv_step(dk, dv, k, v, q, do, lse2, delta, qk_scale, offs_m, offs_n, False,
                                     DOT_PRECISION)
            if DQ_MODE >= 0:
                acc_ptrs = DQ_ACC + (seq_start + q_lo).to(tl.int64) * stride_at + head0 * stride_ah + acc_tile
                _dq_share(dsT, k, DQD, head0, seq_start + q_lo, acc_ptrs, offs_m < seq_len, DON, KV_MAX,
                          stat_rows + offs_m, DQ_MODE, DQ_TMA, DOT_PRECISION)
        q_rows = Q + (seq_start + full_end).to(tl.int64) * stride_qt + head0 * stride_qh
        do_rows = DO + (seq_start + full_end).to(tl.int64) * stride_dot + head0 * stride_doh
        for q_lo in range(tl.maximum(full_end, kv_lo + BLOCK_N), seq_len, BLOCK_M):  # at most one block
            offs_m = q_lo + rows
            ok = offs_m < seq_len
            if EDGES_TMA:
                q = QD.load([head0, seq_start + q_lo, 0]).reshape([HEADS * BLOCK_M, HEAD_DIM])
                do = DOD.load([head0, seq_start + q_lo, 0]).reshape([HEADS * BLOCK_M, HEAD_DIM])
                lse2 = tl.load(lse_rows + offs_m, mask=ok, other=float("inf"))
            else:
                q = tl.load(q_rows + q_tile, mask=ok[:, None], other=0.0)
                do = tl.load(do_rows + do_tile, mask=ok[:, None], other=0.0)
                lse2 = tl.load(lse_rows + offs_m, mask=ok, other=0.0)
            delta = tl.load(delta_rows + offs_m, mask=ok, other=0.0)
            dk, dv, dsT = _dkdv_step(dk, dv, k, v, q, do, lse2, delta, qk_scale, offs_m, offs_n, False,
                                     DOT_PRECISION)
            if DQ_MODE >= 0:
                acc_ptrs = DQ_ACC + (seq_start + q_lo).to(tl.int64) * stride_at + head0 * stride_ah + acc_tile
                _dq_share(dsT, k, DQD, head0, seq_start + q_lo, acc_ptrs, ok, DON, KV_MAX, stat_rows + offs_m,
                          DQ_MODE, DQ_TMA, DOT_PRECISION)

    dk_ptrs = DK + kv_row0 * stride_dkt + kv_head * stride_dkh + cols[:, None] * stride_dkt + dims[None, :]
    dv_ptrs = DV + kv_row0 * stride_dvt + kv_head * stride_dvh + cols[:, None] * stride_dvt + dims[None, :]
    tl.store(dk_ptrs, (dk * scale).to(DK.dtype.element_ty), mask=col_ok)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=col_ok)


@triton.jit
def _attn_bwd_prep(O, DO, K, V, DELTA, DON, KV_MAX, DQ_ACC, T, n_kv_heads, stride_ot, stride_oh, stride_dot,
                   stride_doh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_ah,
                   HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, DQ_MODE: tl.constexpr):
    """Fused backward, before the main kernel, for BLOCK_T tokens of one query head: delta_i = dO_i . o_i, the
    dQ accumulator zeroed, and for fixed-point dQ |dO_i| and (query heads < Hkv, for their kv head) max |k_jd|,
    max_j |v_j| folded into KV_MAX by atomic max (order-free)."""
    head = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = t < T
    rows = t.to(tl.int64)[:, None]
    dims = tl.arange(0, HEAD_DIM)[None, :]
    o = tl.load(O + rows * stride_ot + head * stride_oh + dims, mask=ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + rows * stride_dot + head * stride_doh + dims, mask=ok[:, None], other=0.0).to(tl.float32)
    stats = head.to(tl.int64) * T + t
    tl.store(DELTA + stats, tl.sum(o * do, 1), mask=ok)
    tl.store(DQ_ACC + rows * stride_at + head * stride_ah + dims,
             tl.zeros([BLOCK_T, HEAD_DIM], DQ_ACC.dtype.element_ty), mask=ok[:, None])
    if DQ_MODE > 0:
        tl.store(DON + stats, tl.sqrt(tl.sum(do * do, 1)), mask=ok)
        if head < n_kv_heads:
            k = tl.load(K + rows * stride_kt + head * stride_kh + dims, mask=ok[:, None], other=0.0).to(tl.float32)
            v = tl.load(V + rows * stride_vt + head * stride_vh + dims, mask=ok[:, None], other=0.0).to(tl.float32)
            tl.atomic_max(KV_MAX, tl.max(tl.max(tl.abs(k), 1), 0))
            tl.atomic_max(KV_MAX + 1, tl.max(tl.sqrt(tl.sum(v * v, 1)), 0))


@triton.jit
def _attn_bwd_dq_out(DQ_ACC, DQ, DON, KV_MAX, T, scale, stride_at, stride_ah, stride_dqt, stride_dqh,
                     HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, DQ_MODE: tl.constexpr):
    """Fused backward, after the main kernel: dQ = scale * accumulator (times 2^-e_i when fixed-point)."""
    head = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = t < T
    rows = t.to(tl.int64)[:, None]
    dims = tl.arange(0, HEAD_DIM)[None, :]
    acc = tl.load(DQ_ACC + rows * stride_at + head * stride_ah + dims, mask=ok[:, None], other=0)
    if DQ_MODE == 64:
        acc = acc.to(tl.int64, bitcast=True)  # uint64 where TMA summed it
    acc = acc.to(tl.float32)
    if DQ_MODE > 0:
        acc = acc * _pow2(-_dq_exponent(DON, KV_MAX, head.to(tl.int64) * T + t, ok, DQ_MODE))[:, None]
    tl.store(DQ + rows * stride_dqt + head * stride_dqh + dims, (acc * scale).to(DQ.dtype.element_ty),
             mask=ok[:, None])


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
def _attn_bwd_dq(Q, K, V, O, DO, DQ, LSE2, DELTA, cu_seqlens, n_seqs, n_heads, T, qk_scale, scale, seqlen_bucket,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                 stride_dot, stride_doh, stride_dqt, stride_dqh, KD, VD,
                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 HEADS: tl.constexpr, DOT_PRECISION: tl.constexpr, EDGES_TMA: tl.constexpr = False):
    """One program = BLOCK_M query rows of one sequence in HEADS query heads of one GQA group, as in forward.
    It also computes delta = rowsum(dO * O) of its rows, and stores it for the dK/dV kernel that runs next.
    EDGES_TMA: the diagonal key blocks are TMA tiles too (keys past the sequence's end get p = 0 by causality)."""
    n_tiles = n_heads // HEADS
    head0 = (tl.program_id(0) % n_tiles) * HEADS
    seq_start, seq_len, local = _locate_block(cu_seqlens, n_seqs, tl.program_id(0) // n_tiles, BLOCK_M)
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
    stats = head0.to(tl.int64) * T + seq_start + heads * T + offs_m  # row statistics (Hq, T) of these rows
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
        if EDGES_TMA:
            k = KD.load([kv_head, seq_start + kv_lo, 0]).reshape([BLOCK_N, HEAD_DIM])
            v = VD.load([kv_head, seq_start + kv_lo, 0]).reshape([BLOCK_N, HEAD_DIM])
        else:
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
           "dkdv": tuning.TunedKernel(_attn_bwd_dkdv, "dkdv"), "fused": tuning.TunedKernel(_attn_bwd_dkdv, "fused")}

# How backward gets dQ. "split" (the default): a dQ kernel, then the dK/dV kernel, 7 matrix products per pair of
# tiles (both recompute P and dP), deterministic. "fused-i64" / "fused-i32": one kernel, 5 products, dQ summed as
# fixed-point integers by atomics (deterministic; _dq_share). "fused-f32": the same with fp32 atomics (faster, not
# bitwise reproducible). The fused ones cost an accumulator of T * Hq * D * 8 (i64) or 4 bytes.
BACKWARD = "split"
DQ_MODES = {"fused-f32": 0, "fused-i32": 32, "fused-i64": 64}
_ACCUMULATOR_DTYPES = {0: torch.float32, 32: torch.int32, 64: torch.int64}
FUSED_DQ_TMA = not tuning.INTERPRET  # the fused dQ summed by TMA reductions (the interpreter has none: atomics)
ROW_KERNELS = {"prep": _attn_bwd_prep, "dq_out": _attn_bwd_dq_out}  # the fused backward's small kernels
_ROWS_PER_PROGRAM = 64


def _slots(T, n_seqs, block):
    return T // block + n_seqs  # flat slots covering every block of every sequence (_locate_block)


def _forward(q, k, v, cu_seqlens, max_seqlen, scale):
    T, Hq, D = q.shape
    n_seqs = cu_seqlens.shape[0] - 1
    o = torch.empty((T, Hq, D), device=q.device, dtype=q.dtype)
    lse2 = torch.empty((Hq, T), device=q.device, dtype=torch.float32)
    grid = lambda meta: (_slots(T, n_seqs, meta["BLOCK_M"]) * (Hq // meta["HEADS"]),)
    KERNELS["fwd"](q.dtype, grid,
                   q, k, v, o, lse2, cu_seqlens, n_seqs, Hq, T, scale * LOG2E, tuning.seqlen_bucket(max_seqlen),
                   q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0),
                   o.stride(1), GROUP=Hq // k.shape[1], HEAD_DIM=D)
    return o, lse2


def _backward(do, q, k, v, o, lse2, cu_seqlens, max_seqlen, scale):
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    delta = torch.empty((q.shape[1], q.shape[0]), device=q.device, dtype=torch.float32)  # (Hq, T), rowsum(dO o)
    if BACKWARD == "split":
        _launch_dq(do, q, k, v, o, lse2, delta, dq, cu_seqlens, max_seqlen, scale)  # dQ, and delta for dK/dV
        _launch_dkdv("dkdv", do, q, k, v, lse2, delta, (delta, delta, q), dk, dv, cu_seqlens, max_seqlen, scale,
                     DQ_MODE=-1)
    else:
        _backward_fused(DQ_MODES[BACKWARD], do, q, k, v, o, lse2, delta, dq, dk, dv, cu_seqlens, max_seqlen, scale)
    return dq, dk, dv


def _launch_dq(do, q, k, v, o, lse2, delta, dq, cu_seqlens, max_seqlen, scale):
    T, Hq, D = q.shape
    n_seqs = cu_seqlens.shape[0] - 1
    KERNELS["dq"](q.dtype, lambda meta: (_slots(T, n_seqs, meta["BLOCK_M"]) * (Hq // meta["HEADS"]),),
                  q, k, v, o, do, dq, lse2, delta, cu_seqlens, n_seqs, Hq, T, scale * LOG2E, scale,
                  tuning.seqlen_bucket(max_seqlen), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
                  v.stride(1), o.stride(0), o.stride(1), do.stride(0), do.stride(1), dq.stride(0), dq.stride(1),
                  GROUP=Hq // k.shape[1], HEAD_DIM=D)


def _launch_dkdv(name, do, q, k, v, lse2, delta, fused, dk, dv, cu_seqlens, max_seqlen, scale, **constexprs):
    """The dK/dV kernel; fused = (|dO| rows, KV_MAX, dQ accumulator (T, Hq, D)), unread when DQ_MODE = -1."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    n_seqs = cu_seqlens.shape[0] - 1
    acc = fused[2]
    KERNELS[name](q.dtype, lambda meta: (_slots(T, n_seqs, meta["BLOCK_N"]) * Hkv,),
                  q, k, v, do, dk, dv, lse2, delta, *fused, cu_seqlens, n_seqs, Hkv, T, scale * LOG2E, scale,
                  tuning.seqlen_bucket(max_seqlen), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
                  v.stride(1), do.stride(0), do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
                  acc.stride(0), acc.stride(1), GROUP=Hq // Hkv, HEAD_DIM=D, **constexprs)


def _backward_fused(mode, do, q, k, v, o, lse2, delta, dq, dk, dv, cu_seqlens, max_seqlen, scale):
    """One dK/dV/dQ kernel between two row kernels: delta, |dO| and the zeroed accumulator before, dQ after."""
    T, Hq, D = q.shape
    dnorm = torch.empty_like(delta)
    kv_max = torch.zeros(2, device=q.device, dtype=torch.float32)
    dtype = torch.uint64 if mode == 64 and FUSED_DQ_TMA else _ACCUMULATOR_DTYPES[mode]  # TMA adds no int64
    acc = torch.empty((T, Hq, D), device=q.device, dtype=dtype)
    rows = (triton.cdiv(T, _ROWS_PER_PROGRAM), Hq)
    ROW_KERNELS["prep"][rows](o, do, k, v, delta, dnorm, kv_max, acc, T, k.shape[1], o.stride(0), o.stride(1),
                              do.stride(0), do.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                              acc.stride(0), acc.stride(1), HEAD_DIM=D, BLOCK_T=_ROWS_PER_PROGRAM, DQ_MODE=mode)
    _launch_dkdv("fused", do, q, k, v, lse2, delta, (dnorm, kv_max, acc), dk, dv, cu_seqlens, max_seqlen, scale,
                 DQ_MODE=mode, DQ_TMA=FUSED_DQ_TMA)
    ROW_KERNELS["dq_out"][rows](acc, dq, dnorm, kv_max, T, scale, acc.stride(0), acc.stride(1), dq.stride(0),
                                dq.stride(1), HEAD_DIM=D, BLOCK_T=_ROWS_PER_PROGRAM, DQ_MODE=mode)

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
