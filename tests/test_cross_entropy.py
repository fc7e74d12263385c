"""Fused linear + chunked cross-entropy (kernels/cross_entropy.py) against kernels/reference.py in fp64.

On the CPU the Triton kernel runs in the interpreter at small sizes; the vocabulary is cut into blocks of 256
there, so V = 1003 spans four blocks and the last one is partial. A tiny memory budget (lce: the module's
_default_budget replaced) forces many chunks. Every buffer the module makes with torch.empty starts as NaN, so an
element nobody writes shows up.
"""
from unittest import mock

import pytest
import torch

from conftest import DEVICE, rel_err
from kernels import cross_entropy as ce
from kernels import reference

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
LOSS_TOL = 1e-5  # fp32 logits from exact products of the inputs: the loss is fp32-accurate in bf16 too
N, H, V = 77, 48, 1003


@pytest.fixture(autouse=True)
def small_blocks_and_nan_buffers(monkeypatch):
    if DEVICE == "cpu":
        monkeypatch.setattr(ce, "MAX_BLOCK_V", 256)
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)


def make_inputs(n, h_dim, v, dtype, device=DEVICE, ignore_frac=0.2):
    """Random h, W, labels. W is scaled so the logits have std 3: a peaked softmax, as in a trained model."""
    h = torch.randn(n, h_dim, device=device).to(dtype)
    w = (torch.randn(v, h_dim, device=device) * (3.0 / h_dim**0.5)).to(dtype)
    labels = torch.randint(0, v, (n,), device=device)
    labels[torch.rand(n, device=device) < ignore_frac] = -100
    return h, w, labels


def budget_for_rows(rows, v=V):
    """A budget that holds `rows` tokens of fp32 logits (4 bytes each; the gradient lives inside them)."""
    return rows * v * 4


def lce(h, weight, labels, budget=None, **kwargs):
    """ce.linear_cross_entropy with chunks of fp32 logits that fit `budget` bytes (None: _default_budget's). Forward
    makes the gradients too, so the budget needs to hold during the call only."""
    if budget is None:
        return ce.linear_cross_entropy(h, weight, labels, **kwargs)
    with mock.patch.object(ce, "_default_budget", lambda *args: budget):
        return ce.linear_cross_entropy(h, weight, labels, **kwargs)


def reference_grads(h, w, labels, grad_scale=1.0):
    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    loss, n_valid = reference.linear_cross_entropy(h64, w64, labels)
    (loss * grad_scale).backward()
    return loss, n_valid, h64.grad, w64.grad


def fused_grads(h, w, labels, budget=None):
    h = h.detach().requires_grad_()
    w = w.detach().requires_grad_()
    loss, n_valid = lce(h, w, labels, budget)
    loss.backward()
    return loss, n_valid, h.grad, w.grad


def assert_close(got, want, dtype):
    loss, n_valid, dh, dw = got
    ref_loss, ref_n, ref_dh, ref_dw = want
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert n_valid.dtype == torch.int64 and n_valid.dim() == 0 and n_valid.item() == ref_n.item()
    assert rel_err(loss, ref_loss) < LOSS_TOL
    assert rel_err(dh, ref_dh) < TOL[dtype], "dh"
    assert rel_err(dw, ref_dw) < TOL[dtype], "dW"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("budget", [None, budget_for_rows(16)], ids=["one_chunk", "chunks"])
@pytest.mark.parametrize("ignore_frac", [0.0, 0.2], ids=["all_counted", "some_ignored"])
def test_matches_reference(dtype, budget, ignore_frac, h_dim=H):
    """all_counted takes the path without gathers: chunks are slices of h and dh (dh starts as NaN there). bf16
    over chunks: G of the (up to 77) counted tokens is no larger than an fp32 dW (77 <= 2H), so it is kept whole."""
    h, w, labels = make_inputs(N, h_dim, V, dtype, ignore_frac=ignore_frac)
    got = fused_grads(h, w, labels, budget)
    assert_close(got, reference_grads(h, w, labels), dtype)
    assert (got[2][labels == -100] == 0).all(), "ignored tokens must have zero gradient rows"


@pytest.mark.parametrize("ignore_frac", [0.0, 0.2], ids=["all_counted", "some_ignored"])
def test_matches_reference_with_dw_summed_in_fp32(ignore_frac, monkeypatch):
    """bf16 over chunks with H = 16: G of the 60-77 counted tokens would be larger than an fp32 dW (> 2H), so dW is
    summed in fp32 chunk by chunk and rounded in backward."""
    made = spy_on_dw(monkeypatch)
    test_matches_reference(torch.bfloat16, budget_for_rows(16), ignore_frac, h_dim=16)
    assert made[0][0] == torch.float32


@pytest.mark.parametrize("h_dim, made_dtype", [(32, torch.float32), (48, torch.bfloat16)], ids=["sum", "whole_G"])
def test_dw_over_chunks_is_rounded_once(h_dim, made_dtype, monkeypatch):
    """dW over 77 one-token chunks equals dW from one chunk to far below bf16 resolution: both round one fp32 sum
    once. Adding chunk after chunk into a bf16 dW would round every partial sum. With H = 32, G of 77
    tokens is larger than an fp32 dW (77 > 2H): dW is summed in fp32 over the chunks; with H = 48 G is kept whole
    and dW is one bf16 matmul after the loop."""
    made = spy_on_dw(monkeypatch)
    h, w, labels = make_inputs(N, h_dim, V, torch.bfloat16, ignore_frac=0.0)
    chunked = fused_grads(h, w, labels, budget=1)
    whole = fused_grads(h, w, labels)
    assert made[0][0] == made_dtype and made[1][0] == torch.bfloat16
    assert_close(chunked, reference_grads(h, w, labels), torch.bfloat16)
    assert rel_err(chunked[3], whole[3]) < 1e-3


@pytest.mark.parametrize("case", ["ignored_span", "single_token", "all_ignored"])
def test_ignored_tokens(case):
    h, w, labels = make_inputs(N, H, V, torch.bfloat16, ignore_frac=0.0)
    if case == "ignored_span":  # a run of ignored tokens three chunks long
        labels[10:60] = -100
    elif case == "single_token":
        labels[:] = -100
        labels[N // 2] = 7
    else:
        labels[:] = -100
    loss, n_valid, dh, dw = got = fused_grads(h, w, labels, budget_for_rows(16))
    if case == "all_ignored":
        assert loss.item() == 0.0 and n_valid.item() == 0
        assert (dh == 0).all() and (dw == 0).all()
    else:
        assert_close(got, reference_grads(h, w, labels), torch.bfloat16)
        assert (dh[labels == -100] == 0).all()


@pytest.mark.parametrize("mode", ["no_grad", "inputs_without_grad"])
def test_loss_only_paths(mode, monkeypatch):
    """Without autograd only the loss is made: the kernel is launched with no gradient buffer."""
    launches = []
    real_launch = ce._cross_entropy_rows

    def spy(logits, grad, *args):
        launches.append(grad)
        return real_launch(logits, grad, *args)

    monkeypatch.setattr(ce, "_cross_entropy_rows", spy)
    h, w, labels = make_inputs(N, H, V, torch.bfloat16)
    if mode == "no_grad":
        h.requires_grad_()
        w.requires_grad_()
        with torch.no_grad():
            loss, n_valid = lce(h, w, labels, budget_for_rows(16))
    else:
        loss, n_valid = lce(h, w, labels, budget_for_rows(16))
    ref_loss, ref_n = reference.linear_cross_entropy(h.detach().double(), w.detach().double(), labels)
    assert not loss.requires_grad
    assert rel_err(loss, ref_loss) < LOSS_TOL and n_valid.item() == ref_n.item()
    assert len(launches) > 1 and all(g is None for g in launches)


@pytest.mark.parametrize("which", ["h", "weight"])
def test_one_input_needs_grad(which):
    h, w, labels = make_inputs(N, H, V, torch.float32)
    h_leaf = h.clone().requires_grad_(which == "h")
    w_leaf = w.clone().requires_grad_(which == "weight")
    loss, _ = lce(h_leaf, w_leaf, labels, budget_for_rows(16))
    loss.backward()
    _, _, ref_dh, ref_dw = reference_grads(h, w, labels)
    if which == "h":
        assert w_leaf.grad is None and rel_err(h_leaf.grad, ref_dh) < TOL[torch.float32]
    else:
        assert h_leaf.grad is None and rel_err(w_leaf.grad, ref_dw) < TOL[torch.float32]


def test_gradient_accumulation():
    """4 micro-steps, each loss divided by the token count of the whole step, add up to the one big step."""
    dtype, micro = torch.bfloat16, 4
    h, w, labels = make_inputs(micro * 31, H, V, dtype)
    labels[31:62] = -100  # one micro-step counts nothing
    n_step = (labels != -100).sum()
    h_leaf, w_leaf = h.clone().requires_grad_(), w.clone().requires_grad_()
    total = 0.0
    for part_h, part_labels in zip(h_leaf.chunk(micro), labels.chunk(micro)):
        loss, _ = lce(part_h, w_leaf, part_labels, budget_for_rows(8))
        (loss / n_step).backward()
        total = total + loss.detach()
    ref_loss, _, ref_dh, ref_dw = reference_grads(h, w, labels, grad_scale=1.0 / n_step.item())
    assert rel_err(total, ref_loss) < LOSS_TOL
    assert rel_err(h_leaf.grad, ref_dh) < TOL[dtype]
    assert rel_err(w_leaf.grad, ref_dw) < TOL[dtype]


def test_tied_weights():
    """The output matrix is also the input embedding: its gradient is the sum of both uses."""
    dtype = torch.float32
    _, w, labels = make_inputs(N, H, V, dtype)
    token_ids = torch.randint(0, V, (N,), device=DEVICE)

    def model_loss(weight, loss_fn):
        hidden = torch.tanh(weight[token_ids] * 4.0) * 2.0  # embedding lookup, then some "model"
        return loss_fn(hidden, weight, labels)[0]

    w_leaf = w.clone().requires_grad_()
    model_loss(w_leaf, lambda *a: lce(*a, budget_for_rows(16))).backward()
    w64 = w.double().requires_grad_()
    model_loss(w64, reference.linear_cross_entropy).backward()
    assert rel_err(w_leaf.grad, w64.grad) < TOL[dtype]


@pytest.mark.parametrize("grad_scale", [0.37, -2.5])
def test_grad_output_scales_gradients(grad_scale):
    dtype = torch.bfloat16
    h, w, labels = make_inputs(N, H, V, dtype)
    h_leaf, w_leaf = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, _ = lce(h_leaf, w_leaf, labels, budget_for_rows(16))
    dh, dw = torch.autograd.grad(loss, (h_leaf, w_leaf), grad_outputs=torch.tensor(grad_scale, device=DEVICE))
    _, _, ref_dh, ref_dw = reference_grads(h, w, labels, grad_scale)
    assert rel_err(dh, ref_dh) < TOL[dtype] and rel_err(dw, ref_dw) < TOL[dtype]


def test_autocast_with_fp32_params():
    """Under bf16 autocast (fp32 master weights, as train.py runs on CUDA) the matmuls run in bf16, like F.linear
    would, and the gradients come back in fp32."""
    h, w, labels = make_inputs(N, H, V, torch.float32)
    h_leaf, w_leaf = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        loss, n_valid = lce(h_leaf, w_leaf, labels, budget_for_rows(16))
    loss.backward()
    assert h_leaf.grad.dtype == torch.float32 and w_leaf.grad.dtype == torch.float32
    want = reference_grads(h.bfloat16(), w.bfloat16(), labels)  # the inputs the matmuls really saw
    assert_close((loss, n_valid, h_leaf.grad, w_leaf.grad), want, torch.bfloat16)


def test_int64_offsets(monkeypatch):
    """The int64-offset variant of the kernel (used from 2^31 logits per chunk on), forced at a small size."""
    monkeypatch.setattr(ce, "INT32_MAX_NUMEL", 1)
    h, w, labels = make_inputs(N, H, V, torch.float32)
    got = fused_grads(h, w, labels, budget_for_rows(16))
    assert_close(got, reference_grads(h, w, labels), torch.float32)


def test_backward_twice_raises():
    h, w, labels = make_inputs(N, H, V, torch.float32)
    loss, _ = ce.linear_cross_entropy(h.requires_grad_(), w, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        loss.backward()


def test_rows_per_chunk():
    assert ce._rows_per_chunk(1000, 100, budget_bytes=10 * 100 * 4) == 10  # exactly the budget
    assert ce._rows_per_chunk(1000, 100, budget_bytes=1) == 1  # at least one row
    assert ce._rows_per_chunk(1000, 100, budget_bytes=1 << 40) == 1000  # never more than the rows
    assert ce._rows_per_chunk(1000, 100, budget_bytes=400 * 100 * 4) == 334  # 3 even chunks, not 400+400+200
    assert ce._rows_per_chunk(4103, 128256, budget_bytes=1 << 30) == 2052  # 2093 fit: 2 chunks of 2052


def test_default_budget():
    """1 GiB for the logits, the bf16 copy of W and the fp32 sum of dW together, but never fewer than
    MIN_CHUNK_TOKENS tokens; a sum that cannot fit beside that many is not counted."""
    assert ce._default_budget(128256, 0) == ce.LOGITS_CHUNK_BYTES  # bf16 W: no copy
    assert ce._default_budget(32000, 32000 * 4096 * 2) == ce.LOGITS_CHUNK_BYTES - 32000 * 4096 * 2
    assert ce._default_budget(128256, 128256 * 4096 * 2) == ce.MIN_CHUNK_TOKENS * 128256 * 4
    assert ce._default_budget(32000, 0, 32000 * 4096 * 4) == ce.LOGITS_CHUNK_BYTES - 32000 * 4096 * 4
    assert ce._default_budget(128256, 0, 128256 * 4096 * 4) == ce.LOGITS_CHUNK_BYTES  # sum > 1 GiB: not counted


def test_chunk_floor_is_smaller_where_no_dw_sums_chunk_by_chunk(monkeypatch):
    """The floor of a chunk: MIN_CHUNK_TOKENS where dW may be summed chunk by chunk in fp32 (its product must stay
    compute-bound), MIN_CHUNK_TOKENS_FP8 for FP8 gradients (G^T's codes kept whole: no sum)."""
    budgets = []
    monkeypatch.setattr(ce, "_chunked_pass", lambda *a: budgets.append(a[4]) or (torch.zeros(a[3].numel()), None))
    monkeypatch.setattr(ce, "LOGITS_CHUNK_BYTES", 1)  # every budget is its floor
    monkeypatch.setattr(ce, "MIN_CHUNK_TOKENS", 6)
    monkeypatch.setattr(ce, "MIN_CHUNK_TOKENS_FP8", 3)
    h, w, labels = make_inputs(40, 32, 1008, torch.bfloat16, ignore_frac=0.0)
    for fp8_grads, floor in [(False, 6), (True, 3)]:
        ce._loss_and_grads(h, w, labels, False, True, fp8_grads=fp8_grads)
        assert budgets[-1] == floor * 1008 * 4, fp8_grads


def test_default_chunking_leaves_room_for_the_dw_sum(monkeypatch):
    """bf16 W over several chunks: the chunk shrinks so that it and the fp32 sum of dW share the budget."""
    budgets = []
    real = ce._chunked_pass
    monkeypatch.setattr(ce, "_chunked_pass", lambda *a: budgets.append(a[4]) or real(*a))
    monkeypatch.setattr(ce, "LOGITS_CHUNK_BYTES", 60 * 1003 * 4)  # 60 rows of V = 1003 fp32 logits
    monkeypatch.setattr(ce, "MIN_CHUNK_TOKENS", 4)
    V, H = 1003, 5  # the fp32 sum of dW: V * H * 4 bytes = 5 rows of logits
    for N, expected_rows in [(50, 60), (150, 55)]:  # one chunk: no sum; several: 60 - 5 rows
        h = torch.randn(N, H, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(V, H, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        ce.linear_cross_entropy(h, w, torch.randint(0, V, (N,), device=DEVICE))[0].backward()
        assert budgets[-1] == expected_rows * V * 4, (N, budgets[-1] // (V * 4))


def spy_on_dw(monkeypatch):
    """Records (dtype, data_ptr) of the dW that forward makes, to compare with the gradient autograd ends up with.
    Only the address is kept: one more reference to the tensor would make autograd copy it."""
    made = []
    real = ce._loss_and_grads

    def spy(*args):
        out = real(*args)
        made.append((out[3].dtype, out[3].data_ptr()))
        return out

    monkeypatch.setattr(ce, "_loss_and_grads", spy)
    return made


@pytest.mark.parametrize("mode", ["fp32", "amp"])
@pytest.mark.parametrize("budget", [None, budget_for_rows(16)], ids=["one_chunk", "chunks"])
def test_fp32_weight_grad_is_the_sum(mode, budget, monkeypatch):
    """fp32 W: dW is summed (or, from one chunk, written) straight into the tensor that becomes W.grad: no
    separate sum and no copy. "amp" is fp32 params under bf16 autocast (the matmuls see bf16 inputs)."""
    made = spy_on_dw(monkeypatch)
    h, w, labels = make_inputs(N, H, V, torch.float32)
    h_leaf, w_leaf = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=mode == "amp"):
        loss, n_valid = lce(h_leaf, w_leaf, labels, budget)
    (loss * 0.5).backward()
    assert len(made) == 1 and made[0][0] == torch.float32
    assert w_leaf.grad.data_ptr() == made[0][1], "W.grad must be the tensor dW was summed into"
    if mode == "amp":
        h, w = h.bfloat16(), w.bfloat16()  # the inputs the matmuls really saw
    want = reference_grads(h, w, labels, grad_scale=0.5)
    assert_close((loss, n_valid, h_leaf.grad, w_leaf.grad), want, torch.bfloat16 if mode == "amp" else torch.float32)


# ---------------------------------------------------------------------------------------------------------
# GPU: real sizes (run on the H200)
# ---------------------------------------------------------------------------------------------------------
def fused_grads_with_peak_memory(h, w, labels, budget=None):
    """fused_grads through the dispatcher, and its peak memory above what was allocated before (bytes)."""
    from kernels import linear_cross_entropy

    h_leaf, w_leaf = h.clone().requires_grad_(), w.clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    if budget is None:
        loss, n_valid = linear_cross_entropy(h_leaf, w_leaf, labels)
    else:
        loss, n_valid = lce(h_leaf, w_leaf, labels, budget)
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return (loss, n_valid, h_leaf.grad, w_leaf.grad), peak


def fp8_grads(h, w, labels, grad_scale, fused, budget=None, amp=False, need=("h", "weight")):
    h, w = h.detach().requires_grad_("h" in need), w.detach().requires_grad_("weight" in need)
    with torch.autocast(h.device.type, dtype=torch.bfloat16, enabled=amp):
        if fused:
            loss, n_valid = lce(h, w, labels, budget, fp8_grads=True)
        else:
            loss, n_valid = reference.linear_cross_entropy(h, w, labels, fp8_grads=True)
    (loss * grad_scale).backward()
    return loss, n_valid, h.grad, w.grad


def with_the_simulations_g():
    """ce._cross_entropy_rows, then G overwritten by the simulation's (reference.logits_grad of the same fp32
    logits, which both paths make bit for bit alike here), rounded to G's dtype. The kernel's own G differs in a
    last bit now and then (everywhere in the interpreter, whose cast to bf16 truncates), and an FP8 code moves by a
    whole step where that crosses a rounding boundary."""
    real = ce._cross_entropy_rows

    def rows(logits, grad, labels, loss):
        z = logits.clone()
        real(logits, grad, labels, loss)
        grad.copy_(reference.logits_grad(z, labels))
    return rows


# The FP8 products against the simulation's, for the same codes: on the CPU the same simulation (equal bit for bit);
# on the GPU _scaled_mm's tensor cores add the e4m3 products of a block of 128 along K in an accumulator narrower
# than fp32, so the two differ by more than fp32 rounding: 2e-3, as tests/test_fp8.py allows. The FP8 products' own
# error is 10x that or more (the test's second bound), so the bound still tells the two paths apart.
FP8_MM_TOL = 2e-3 if DEVICE == "cuda" else 0.0
FP8_CASES = [(torch.float32, 0.0, False), (torch.bfloat16, 0.0, False), (torch.float32, 0.2, False),
             (torch.bfloat16, 0.2, False), (torch.float32, 0.2, True)]


@pytest.mark.parametrize("dtype, ignore_frac, amp", FP8_CASES,
                         ids=["fp32", "bf16", "fp32_some_ignored", "bf16_some_ignored", "amp"])
def test_fp8_grads_match_the_simulation(dtype, ignore_frac, amp, monkeypatch):
    """dh = q1(G) q128(W^T)^T and dW = q1(G^T) q128(h^T)^T (FP8 e4m3, block scales) over chunks of 512 tokens, G^T's
    codes written chunk by chunk, equal to kernels/reference.py's simulation for the same G up to the tensor cores'
    FP8 sums (FP8_MM_TOL); and as far from the exact gradients as FP8 products are (the second bound), so the FP8
    path is the one that ran. The loss is the exact one. amp: fp32 h and W under bf16 autocast (train.py's
    fp32 master weights): bf16 operands and G, fp32 dh and dW."""
    n, h_dim, v = 1100, 64, 496  # chunks of 512 counted tokens: 3, or 2 with 20% ignored; V: 3 blocks of 128 + a part
    h, w, labels = make_inputs(n, h_dim, v, dtype, ignore_frac=ignore_frac)
    monkeypatch.setattr(ce, "_cross_entropy_rows", with_the_simulations_g())
    got = fp8_grads(h, w, labels, 0.37, True, budget_for_rows(300, v), amp)
    sim = fp8_grads(h, w, labels, 0.37, False, amp=amp)
    exact = reference_grads(h, w, labels, 0.37)
    assert rel_err(got[0], exact[0]) < (1e-3 if amp else LOSS_TOL) and got[1].item() == exact[1].item()
    for i, name in ((2, "dh"), (3, "dW")):
        assert got[i].dtype == dtype and sim[i].dtype == dtype
        assert rel_err(got[i], sim[i]) <= FP8_MM_TOL, (name, rel_err(got[i], sim[i]))
        assert 1e-2 < rel_err(got[i], exact[i]) < 0.06, (name, rel_err(got[i], exact[i]))


@pytest.mark.parametrize("which", ["h", "weight"])
def test_fp8_grads_of_one_input(which, monkeypatch):
    """Only dh (G's row codes alone) or only dW (G^T's codes alone): each as the simulation makes it."""
    h, w, labels = make_inputs(700, 64, 496, torch.bfloat16, ignore_frac=0.1)
    monkeypatch.setattr(ce, "_cross_entropy_rows", with_the_simulations_g())
    got = fp8_grads(h, w, labels, 1.0, True, budget_for_rows(300, 496), need=(which,))
    sim = fp8_grads(h, w, labels, 1.0, False, need=(which,))
    i = 2 if which == "h" else 3
    assert got[5 - i] is None and rel_err(got[i], sim[i]) <= FP8_MM_TOL


def test_fp8_grads_only_where_the_dims_are_multiples_of_16():
    """V = 1003: torch._scaled_mm takes no such operand, so fp8_grads keeps the bf16 products, bit for bit."""
    h, w, labels = make_inputs(N, H, V, torch.bfloat16)
    got = fp8_grads(h, w, labels, 1.0, True, budget_for_rows(16))
    want = fused_grads(h, w, labels, budget_for_rows(16))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("V_gpu", [128256, 32003])
def test_gpu_real_sizes(V_gpu):
    n, h_dim, dtype = 4096 + 7, 4096, torch.bfloat16
    h, w, labels = make_inputs(n, h_dim, V_gpu, dtype, device="cuda")
    got, peak = fused_grads_with_peak_memory(h, w, labels)
    # Peak = the two gradients, G of every token (no larger than an fp32 dW sum) and one chunk of fp32 logits: far below
    # the [N, V] fp32 logits (2.1 GB at V = 128K) that an unfused version holds several times over.
    grads = (n * h_dim + V_gpu * h_dim) * 2
    bound = grads + V_gpu * h_dim * 4 + ce.LOGITS_CHUNK_BYTES * 1.15 + (256 << 20)
    assert peak < bound, (peak / 1e9, bound / 1e9)
    assert_close(got, reference_grads(h, w, labels), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp32", "bf16", "amp"])
def test_gpu_many_chunks(mode, monkeypatch):
    """Many chunks (the fp32 dW sum across them), a long ignored span. fp32 is checked to 1e-5
    (with TF32 off); "amp" is fp32 params under bf16 autocast, as train.py runs, checked like bf16."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    n, h_dim, v = 4096 + 7, 1024, 32003
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    h, w, labels = make_inputs(n, h_dim, v, dtype, device="cuda")
    labels[1000:2500] = -100
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "amp"):
        got, _ = fused_grads_with_peak_memory(h, w, labels, budget=budget_for_rows(300, v))
    if mode == "amp":
        assert got[2].dtype == torch.float32 and got[3].dtype == torch.float32
        h, w = h.bfloat16(), w.bfloat16()  # what the matmuls saw
    assert_close(got, reference_grads(h, w, labels), torch.float32 if mode == "fp32" else torch.bfloat16)
    assert (got[2][labels == -100] == 0).all()


@pytest.mark.gpu
def test_gpu_fp8_grads_real_size(monkeypatch):
    """Llama-3's head (V 128,256, H 4,096), 8,192 tokens in 4 chunks: cuBLAS's FP8 products against the simulation
    for the same G, and as far from the exact gradients as FP8 products are."""
    n, h_dim, v = 8192, 4096, 128256
    h, w, labels = make_inputs(n, h_dim, v, torch.bfloat16, device="cuda", ignore_frac=0.1)
    monkeypatch.setattr(ce, "_cross_entropy_rows", with_the_simulations_g())
    got = fp8_grads(h, w, labels, 1.0, True)
    sim = fp8_grads(h, w, labels, 1.0, False)
    exact = fused_grads(h, w, labels)
    for i, name in ((2, "dh"), (3, "dW")):
        assert rel_err(got[i], sim[i]) < FP8_MM_TOL, (name, rel_err(got[i], sim[i]))
        assert 1e-2 < rel_err(got[i], exact[i]) < 0.06, (name, rel_err(got[i], exact[i]))


@pytest.mark.gpu
@pytest.mark.parametrize("chunks", ["default", "five"])
def test_gpu_fp32_weight_under_autocast(chunks, monkeypatch):
    """train.py's setting: fp32 h and W, bf16 autocast. W.grad is the fp32 tensor dW was summed into, and the
    peak holds only the gradients, the bf16 copy of W and one chunk of logits: at most LOGITS_CHUNK_BYTES
    together with the default budget (one chunk here; MIN_CHUNK_TOKENS does not bind at this V)."""
    made = spy_on_dw(monkeypatch)
    n, h_dim, v = 4096 + 7, 4096, 32003
    h, w, labels = make_inputs(n, h_dim, v, torch.float32, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got, peak = fused_grads_with_peak_memory(h, w, labels,
                                                 None if chunks == "default" else budget_for_rows(n // 5 + 1, v))
    assert got[2].dtype == torch.float32 and got[3].dtype == torch.float32
    assert got[3].data_ptr() == made[0][1], "W.grad must be the tensor dW was summed into"
    grads = (n * h_dim + v * h_dim) * 4
    assert peak < grads + ce.LOGITS_CHUNK_BYTES * 1.10, (peak / 1e9, grads / 1e9)
    assert_close(got, reference_grads(h.bfloat16(), w.bfloat16(), labels), torch.bfloat16)


@pytest.mark.gpu
def test_gpu_loss_only_memory():
    """Under no_grad only one chunk of fp32 logits is allocated: no gradient buffers."""
    n, h_dim, v = 4096 + 7, 4096, 128256
    h, w, labels = make_inputs(n, h_dim, v, torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        loss, n_valid = ce.linear_cross_entropy(h, w, labels)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < ce.LOGITS_CHUNK_BYTES * 1.15 + (64 << 20), peak / 1e9
    ref_loss, ref_n = reference.linear_cross_entropy(h.double(), w.double(), labels)
    assert rel_err(loss, ref_loss) < LOSS_TOL and n_valid.item() == ref_n.item()
