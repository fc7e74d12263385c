"""Varlen causal GQA flash attention (kernels/attention.py) against kernels/reference.py.

CPU: the Triton interpreter at small sizes in fp32, against the reference in fp64 (fp32 rel < 1e-5: the kernels'
dots are exact fp32 there, and "ieee" fp32 on the GPU). bf16 is not tested in the interpreter: its bf16 tl.dot
is broken (triton 3.9 returns garbage), so bf16/fp16 run in the `gpu` tests at real sizes, against an fp32
reference, rel < 1e-2. Fresh random inputs and document boundaries every run.
"""
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import DEVICE, random_cu_seqlens, rel_err

from kernels import reference
from kernels.attention import _forward, _stat_columns, _stats, attention


# ------------------------------------------------------------------------------------------------------ helpers

def doc_lengths(layout, total):
    """Document lengths summing to `total`: 'mixed' (random, always with two length-1 documents, lengths not
    multiples of the blocks), 'single' (one document), 'tiny' (lengths 1..3)."""
    if layout == "single":
        return [total]
    if layout == "tiny":
        return torch.diff(random_cu_seqlens(total, 3)).tolist()
    lengths = torch.diff(random_cu_seqlens(total - 2, max(total // 3, 2))).tolist()
    for _ in range(2):
        lengths.insert(int(torch.randint(0, len(lengths) + 1, (1,))), 1)
    return lengths


def cu_seqlens_of(lengths, device):
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return cu.to(device)


def alpaca_lengths(total):
    """Lognormal document lengths like instruction data: exp(0.8 N(0,1) + ln 180), clipped to [16, 1024]."""
    lengths = []
    while sum(lengths) < total:
        n = int(math.exp(0.8 * torch.randn(()).item() + math.log(180)))
        lengths.append(min(max(n, 16), 1024, total - sum(lengths)))
    return lengths


def make_qkv(T, hq, hkv, d, dtype, device, fused):
    """q, k, v with requires_grad; fused=True gives strided views of one (T, (hq + 2 hkv) * d) projection."""
    if fused:
        qkv = torch.randn(T, (hq + 2 * hkv) * d, dtype=dtype, device=device, requires_grad=True)
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
        return q.view(T, hq, d), k.view(T, hkv, d), v.view(T, hkv, d)
    return tuple(torch.randn(T, h, d, dtype=dtype, device=device, requires_grad=True) for h in (hq, hkv, hkv))


def run_with_grads(fn, q, k, v, do):
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


def reference_with_grads(q, k, v, cu, max_seqlen, scale, do, dtype):
    """The reference op on copies upcast to `dtype` (fp64 oracle on CPU, fp32 on the GPU), with autograd grads."""
    up = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    return run_with_grads(lambda *x: reference.attention(*x, cu, max_seqlen, scale), *up, do.to(dtype))


def check_against_reference(q, k, v, cu, max_seqlen, tol, ref_dtype):
    scale = q.shape[-1] ** -0.5
    do = torch.randn(q.shape, dtype=q.dtype, device=q.device)
    got = run_with_grads(lambda *x: attention(*x, cu, max_seqlen, scale), q, k, v, do)
    want = reference_with_grads(q, k, v, cu, max_seqlen, scale, do, ref_dtype)
    errors = {name: rel_err(g, w) for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)}
    assert all(e < tol for e in errors.values()), errors
    return got


# ------------------------------------------------------------------------------- CPU (interpreter) and small GPU

@pytest.mark.parametrize("hq, hkv, d, layout, fused", [
    (4, 4, 64, "mixed", False),    # GQA ratio 1
    (8, 2, 128, "mixed", True),    # ratio 4, strided views of a fused qkv
    (8, 1, 64, "mixed", True),     # ratio 8, a single kv head
    (4, 1, 128, "single", False),  # one document of length T
    (4, 2, 64, "tiny", True),      # many documents of 1..3 tokens
    (4, 2, 32, "mixed", True),     # the small head dims (LlamaConfig's default is 32)
    (2, 1, 16, "mixed", False),
])
def test_matches_fp64_reference(hq, hkv, d, layout, fused):
    T = int(torch.randint(110, 170, (1,)))
    lengths = doc_lengths(layout, T)
    q, k, v = make_qkv(T, hq, hkv, d, torch.float32, DEVICE, fused)
    check_against_reference(q, k, v, cu_seqlens_of(lengths, DEVICE), max(lengths), 1e-5, torch.float64)


def test_log_sum_exp_saved_for_backward():
    T, hq, hkv, d = int(torch.randint(90, 130, (1,))), 4, 2, 64
    lengths = doc_lengths("mixed", T)
    q, k, v = (x.detach() for x in make_qkv(T, hq, hkv, d, torch.float32, DEVICE, fused=False))
    scale = 0.7 * d ** -0.5
    cu_seqlens = cu_seqlens_of(lengths, DEVICE)
    _, lse2 = _forward(q, k, v, cu_seqlens, max(lengths), scale)
    lse2 = lse2[:, _stat_columns(cu_seqlens, T)]
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(DEVICE)
    pos = torch.arange(T, device=DEVICE)
    allowed = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
    scores = scale * torch.einsum("thd,shd->hts", q.double(), k.double().repeat_interleave(hq // hkv, dim=1))
    lse = scores.masked_fill(~allowed, float("-inf")).logsumexp(-1)  # (Hq, T), natural log
    assert rel_err(lse2 * math.log(2), lse) < 1e-6


def test_stat_columns_start_every_sequence_aligned_and_never_overlap():
    """The row statistics' layout (kernels/attention.py _stat_columns): every sequence starts at a multiple of 4
    columns (a TMA box of fp32 starts 16-byte aligned), its tokens are consecutive, sequences keep their order and
    never share a column, and all fit the buffer _stats allocates (empty sequences included)."""
    lengths = [5, 1, 0, 7, 4, 129, 3, 0, 2]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    T = sum(lengths)
    cols = _stat_columns(cu, T)
    assert cols.shape == (T,) and cols.unique().numel() == T and bool((cols[1:] > cols[:-1]).all())
    for s in range(len(lengths)):
        seq = cols[cu[s]:cu[s + 1]]
        if len(seq):
            assert seq[0] % 4 == 0 and torch.equal(seq, seq[0] + torch.arange(len(seq))), s
    assert cols.max() < _stats(1, T, len(lengths), "cpu").shape[1]


def nan_filled_allocations(monkeypatch):
    """Allocations made from now on come back NaN-filled: any element a kernel fails to write, or reads without
    having written it, shows."""
    def nan_filled(factory):
        def make(*args, **kwargs):
            x = factory(*args, **kwargs)
            return x.fill_(float("nan")) if x.is_floating_point() else x
        return make
    monkeypatch.setattr(torch, "empty", nan_filled(torch.empty))
    monkeypatch.setattr(torch, "empty_like", nan_filled(torch.empty_like))


def test_every_output_written(monkeypatch):
    T = int(torch.randint(100, 140, (1,)))
    lengths = doc_lengths("mixed", T)
    q, k, v = make_qkv(T, 4, 2, 64, torch.float32, DEVICE, fused=False)
    nan_filled_allocations(monkeypatch)
    got = check_against_reference(q, k, v, cu_seqlens_of(lengths, DEVICE), max(lengths), 1e-5, torch.float64)
    assert all(torch.isfinite(x).all() for x in got)


def test_whole_query_blocks_of_sequences_that_start_anywhere(monkeypatch):
    """Long sequences after short ones, starting at tokens 3, 135 and 237 (not multiples of 4), and an empty one:
    the dK/dV kernel's loop over whole query blocks (TMA tiles of q, dO and of lse2, delta at _stat_columns) runs
    for sequences other than the first, where random lengths rarely reach it. NaN-filled allocations: a wrong
    statistics column reads NaN."""
    lengths = [1, 2, 130, 2, 97, 0, 5, 200]
    q, k, v = make_qkv(sum(lengths), 4, 2, 16, torch.float32, DEVICE, fused=False)
    nan_filled_allocations(monkeypatch)
    check_against_reference(q, k, v, cu_seqlens_of(lengths, DEVICE), max(lengths), 1e-5, torch.float64)


def test_cu_seqlens_never_read_on_host(monkeypatch):
    T = int(torch.randint(60, 100, (1,)))
    lengths = doc_lengths("mixed", T)
    cu = cu_seqlens_of(lengths, DEVICE)
    q, k, v = make_qkv(T, 2, 1, 64, torch.float32, DEVICE, fused=False)

    def host_read(*args, **kwargs):
        raise AssertionError("a tensor was read on the host")

    for name in ("item", "tolist", "nonzero", "__bool__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    out = attention(q, k, v, cu, max(lengths), 0.125)
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))


@pytest.mark.parametrize("d", [8, 96, 256])
def test_unsupported_head_dim_is_a_clear_error(d):
    q = torch.randn(8, 2, d, device=DEVICE)
    with pytest.raises(ValueError, match=f"D={d}"):
        attention(q, q, q, cu_seqlens_of([8], DEVICE), 8, 0.1)


def test_dispatch_warns_once_when_a_head_dim_falls_back(monkeypatch):
    """kernels.varlen_attention on CUDA with a head dim the kernel lacks: the reference's result, and one warning."""
    import warnings

    import kernels
    monkeypatch.setattr(kernels, "_use_triton", lambda x: True)
    monkeypatch.setattr(kernels, "_warned", set())
    q = torch.randn(8, 2, 96, device=DEVICE)
    cu = cu_seqlens_of([5, 3], DEVICE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [kernels.varlen_attention(q, q, q, cu, 5, 0.1) for _ in range(2)]
    assert [str(w.message).split(":")[0] for w in caught] == ["head_dim=96"]
    assert all(torch.equal(out, reference.attention(q, q, q, cu, 5, 0.1)) for out in outs)


# ------------------------------------------------------------------------------------------------- autotuning

def test_autotuned_kernels_keep_their_results_on_disk(monkeypatch):
    """Every autotuner of ours asks Triton to keep its results on disk (kernels.common.autotune), and has no config
    with a pre_hook (Triton does not store those). The interpreter never caches: build them as the compiler would."""
    import triton

    from kernels import attention_tuning as tuning
    from kernels.attention import KERNELS
    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    for name, launcher in KERNELS.items():
        assert not any(c.pre_hook for c in tuning.TUNED_CONFIGS[name]), name
        assert tuning.autotuned(tuning.TUNED_CONFIGS[name], launcher.kernel).cache_results, name


def test_autotune_falls_back_where_triton_has_no_disk_cache(monkeypatch):
    import triton

    import kernels.common
    calls = []

    def autotune_without_cache(configs, key, prune_configs_by=None):  # an older Triton's signature
        calls.append((configs, key, prune_configs_by))
        return lambda fn: fn

    monkeypatch.setattr(triton, "autotune", autotune_without_cache)
    kernels.common.autotune(["config"], key=["n"], prune_configs_by={})(None)
    assert calls == [(["config"], ["n"], {})]


# ------------------------------------------------------------------------------------------- GPU, real sizes

@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 64, 32, 16])
def test_gpu_alpaca_16k_bf16(d):
    lengths = alpaca_lengths(16384)
    q, k, v = make_qkv(16384, 32, 8, d, torch.bfloat16, "cuda", fused=False)
    check_against_reference(q, k, v, cu_seqlens_of(lengths, "cuda"), max(lengths), 1e-2, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 32, 16])
@pytest.mark.parametrize("name", ["fwd", "dq", "dkdv"])
def test_gpu_every_listed_config(name, d, monkeypatch):
    """The autotuner may pick any config of the lists: run each alone, bf16, documents of every kind of length."""
    from kernels import attention_tuning as tuning
    from kernels.attention import KERNELS
    lengths = alpaca_lengths(3000) + [1, 2, 1500, 77]
    cu = cu_seqlens_of(lengths, "cuda")
    for config in tuning.TUNED_CONFIGS[name]:
        monkeypatch.setattr(KERNELS[name], "autotuner", tuning.autotuned([config], KERNELS[name].kernel))
        q, k, v = make_qkv(sum(lengths), 16, 4, d, torch.bfloat16, "cuda", fused=False)
        try:
            check_against_reference(q, k, v, cu, max(lengths), 1e-2, torch.float32)
        except AssertionError as e:
            raise AssertionError(f"{name} D={d} config {config}: {e}") from None


@pytest.mark.gpu
@pytest.mark.parametrize("hq, hkv, d", [(24, 8, 128), (8, 8, 64)])  # G = 3 (Llama-3.2-3B), G = 1: one head per tile
def test_gpu_groups_that_allow_one_head_per_tile(hq, hkv, d):
    lengths = alpaca_lengths(4099)
    q, k, v = make_qkv(4099, hq, hkv, d, torch.bfloat16, "cuda", fused=False)
    check_against_reference(q, k, v, cu_seqlens_of(lengths, "cuda"), max(lengths), 1e-2, torch.float32)


@pytest.mark.gpu
def test_gpu_single_4096_document_bf16():
    q, k, v = make_qkv(4096, 32, 8, 128, torch.bfloat16, "cuda", fused=False)
    check_against_reference(q, k, v, cu_seqlens_of([4096], "cuda"), 4096, 1e-2, torch.float32)


@pytest.mark.gpu
def test_gpu_fp16_gqa8_fused_qkv():
    lengths = doc_lengths("mixed", 6001)
    q, k, v = make_qkv(6001, 16, 2, 128, torch.float16, "cuda", fused=True)
    check_against_reference(q, k, v, cu_seqlens_of(lengths, "cuda"), max(lengths), 1e-2, torch.float32)


@pytest.mark.gpu
def test_gpu_backward_is_deterministic():
    lengths = alpaca_lengths(8192)
    cu = cu_seqlens_of(lengths, "cuda")
    q, k, v = make_qkv(8192, 32, 8, 128, torch.bfloat16, "cuda", fused=False)
    do = torch.randn_like(q)
    fn = lambda *x: attention(*x, cu, max(lengths), 128 ** -0.5)
    first, second = run_with_grads(fn, q, k, v, do), run_with_grads(fn, q, k, v, do)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.gpu
def test_gpu_tuning_results_reused_by_the_next_process(tmp_path):
    """The first process times the configs and leaves one .autotune.json per kernel in Triton's cache; a second
    process with the same shapes loads them and times nothing (bench_time is only set by a benchmark)."""
    script = (
        "import torch\n"
        "from kernels.attention import KERNELS, attention\n"
        "q = torch.randn(3000, 8, 128, device='cuda', dtype=torch.bfloat16, requires_grad=True)\n"
        "k, v = (torch.randn(3000, 2, 128, device='cuda', dtype=torch.bfloat16, requires_grad=True) for _ in 'kv')\n"
        "cu = torch.tensor([0, 1000, 3000], dtype=torch.int32, device='cuda')\n"
        "attention(q, k, v, cu, 2000, 128 ** -0.5).sum().backward()\n"
        "print(sorted(name for name, kernel in KERNELS.items() if hasattr(kernel.autotuner, 'bench_time')))\n")
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tuned = [subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True,
                            check=True).stdout.splitlines()[-1] for _ in range(2)]
    assert tuned == ["['dkdv', 'dq', 'fwd']", "[]"], tuned
    assert len(list(tmp_path.rglob("*.autotune.json"))) == 3


@pytest.mark.gpu
def test_gpu_offsets_past_2_pow_31():
    """T * Hq * D > 2^31: the documents at the end of the stream address past int32 range; check them (and the
    first one) against the reference run on just their tokens."""
    hq, hkv, d = 16, 2, 128
    T = 2**31 // (hq * d) + 3001
    lengths = torch.diff(random_cu_seqlens(T, 1024)).tolist()
    cu = cu_seqlens_of(lengths, "cuda")
    q, k, v = (torch.randn(T, h, d, dtype=torch.bfloat16, device="cuda", requires_grad=True) for h in (hq, hkv, hkv))
    do = torch.randn_like(q)
    got = run_with_grads(lambda *x: attention(*x, cu, max(lengths), d ** -0.5), q, k, v, do)
    starts = cu.tolist()
    for first, last in [(0, 1), (len(lengths) - 3, len(lengths))]:  # document index ranges to check
        lo, hi = starts[first], starts[last]
        sub_cu = cu_seqlens_of(lengths[first:last], "cuda")
        want = reference_with_grads(q[lo:hi], k[lo:hi], v[lo:hi], sub_cu, 1024, d ** -0.5, do[lo:hi], torch.float32)
        errors = [rel_err(g[lo:hi], w) for g, w in zip(got, want)]
        assert max(errors) < 1e-2, errors
