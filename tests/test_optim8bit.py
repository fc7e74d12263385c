"""AdamW8bit (optim.py): its fused step (kernels/adamw8bit.py, in the interpreter on the CPU, compiled in the `gpu`
tests) equals the reference step; the block-wise codes stay within their error bound on adversarial blocks, and the
guard keeps a vanishing v from blowing up the update; it tracks fp32 AdamW at lr 1e-6 as AdamWKahan does; its state
round-trips exactly; stepping inside backward equals backward then step; and train.py with it learns, stores the
codes as they are (I8 / U8) and resumes to the bit."""
import copy
import functools
import math
import os

import pytest
import torch

from checkpoint import read_layout
from conftest import DEVICE, random_cu_seqlens, rel_err
from kernels import reference
from kernels.adamw8bit import adamw8bit_step
from kernels.common import ADAMW8BIT_BLOCK as QBLOCK
from kernels.common import ADAMW8BIT_M_POWER, ADAMW8BIT_S_POWER
from model import PRESETS, Llama, LlamaConfig
from optim import (AdamW8bit, StateStream, Update, host_memory_available, host_memory_error, offloaded_bytes,
                   offloaded_params, param_groups, pop_grad_sq)
from test_optim import CFG, in_poisoned_buffer, resumed_states, track_at_tiny_lr, train_steps
from test_train import TINY, corpus, losses, run  # noqa: F401  (corpus: the tiny corpus fixture)

CODE_KEYS = ("exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale")


def new_state(p):
    """What AdamW8bit.step_param creates for a parameter of >= min_8bit_size elements."""
    n_blocks = -(-p.numel() // QBLOCK)
    return dict(p=p.clone(), exp_avg=torch.zeros_like(p, dtype=torch.int8),
                exp_avg_scale=torch.zeros(n_blocks, device=p.device),
                exp_avg_sq=torch.zeros_like(p, dtype=torch.uint8),
                exp_avg_sq_scale=torch.zeros(n_blocks, device=p.device),
                comp=None if p.dtype == torch.float32 else torch.zeros_like(p, dtype=torch.float16))


def step_both(ours, ref, g, step, lr=1e-3, weight_decay=0.1, beta2=0.95, grad_scale=None):
    """One step through the kernel and the reference (the gradient g times grad_scale, where given); each also adds
    the squared norm of that gradient to a grad_sq, which must agree to fp32's rounding of sums in another order
    (the kernel's: per program, then torch's sum)."""
    hyper = dict(lr=lr, beta1=0.9, beta2=beta2, eps=1e-8, weight_decay=weight_decay, step=step)
    sums = []
    for fn, s in ((adamw8bit_step, ours), (reference.adamw8bit_step, ref)):
        grad_sq = [torch.full((1,), 0.5, device=g.device)]  # (appended to)
        fn(s["p"], g, s["exp_avg"], s["exp_avg_scale"], s["exp_avg_sq"], s["exp_avg_sq_scale"], s["comp"], **hyper,
           grad_sq=grad_sq, grad_scale=grad_scale)
        sums.append(pop_grad_sq(grad_sq, g.device))
    exact = 0.5 + (g.double() * (1.0 if grad_scale is None else grad_scale.double())).square().sum()
    assert all(abs(x.item() - exact) <= 1e-5 * exact for x in sums), (sums, exact)


def decoded(s):
    """(m, sqrt(v)) in fp32 from a state's codes and scales."""
    m = reference.dequantize_blockwise(s["exp_avg"].abs(), s["exp_avg_scale"], 127, ADAMW8BIT_M_POWER)
    return (torch.where(s["exp_avg"] < 0, -m, m),
            reference.dequantize_blockwise(s["exp_avg_sq"], s["exp_avg_sq_scale"], 255, ADAMW8BIT_S_POWER))


def check_codes(ours, ref):
    """Codes at most one step apart, and equal in all but 0.1% of the elements; scales (each block's max) equal to
    rel 1e-6 (a few fp32 ulps). The codes are exact functions of the fp32 moments, which the interpreter computes as
    torch does nearly everywhere: the ~1-ulp differences of kernels/adamw.py (fused multiply-adds) show in the scales
    now and then (and carry over to the next steps' scales), in a code only where one lands on a rounding boundary
    (rare). Compiled, Triton fuses more products into sums."""
    for key in ("exp_avg", "exp_avg_sq"):
        diff = (ours[key].int() - ref[key].int()).abs()
        assert diff.max().item() <= 1 and (diff > 0).float().mean().item() <= 1e-3, key
    for key in ("exp_avg_scale", "exp_avg_sq_scale"):
        assert ((ours[key] - ref[key]).abs() <= ref[key].abs() * 1e-6).all(), key


def check_weights(w0, ours, ref):
    """As test_optim.check_against_reference: fp32 weights' displacement, bf16 / fp16 true weights (p + comp) to 1e-3,
    and the stored weights equal almost everywhere. fp32: each element's displacement to 2e-6 of the displacements'
    RMS (fp32 rounding), except at most 0.1% of the elements (and one), those to 1e-2: a moment an ulp apart (the
    kernel's fused multiply-adds) can fall on the other side of its stochastic rounding's threshold at some step
    (check_codes allows such codes), and that element's update then differs by a share of a code step."""
    if w0.dtype == torch.float32:
        d = ref["p"] - w0
        err = ((ours["p"] - w0) - d).abs() / d.square().mean().sqrt()
        assert (err > 2e-6).sum().item() <= max(1, 1e-3 * err.numel()) and err.max().item() < 1e-2, err.max()
        return
    true_w, ref_true_w = (s["p"].float() + s["comp"].float() for s in (ours, ref))
    assert rel_err(true_w - w0.float(), ref_true_w - w0.float()) < 1e-3
    assert (ours["p"] != ref["p"]).float().mean().item() < 0.01


# (weight dtype, gradient dtype, lr), as test_optim.KERNEL_CASES
KERNEL_CASES = [(torch.float32, torch.float32, 1e-2), (torch.bfloat16, torch.bfloat16, 1e-3),
                (torch.bfloat16, torch.bfloat16, 1e-5), (torch.bfloat16, torch.float32, 1e-3),
                (torch.float16, torch.float16, 1e-4)]


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("p_dtype, g_dtype, lr", KERNEL_CASES)
def test_fused_step_matches_reference(p_dtype, g_dtype, lr, weight_decay):
    # 5 steps with gradients of scales 1e-3 to 10, every second one times a clipping factor. Shapes: several
    # programs with a short last block; one program, mostly masked (3 blocks of 8, the last short); whole blocks
    # only. Every tensor sits in a buffer whose tail a store past the end would overwrite (with the codes of zeros,
    # or a scale): NaN, or codes -128 (never written) and 77.
    for shape in [(4099,), (37, 19), (2 * 2048 + 3 * QBLOCK,)]:
        w0 = (0.02 * torch.randn(shape, device=DEVICE)).to(p_dtype)
        ref = new_state(w0)
        ours, tails = {"comp": None}, {}
        for key, t in ref.items():
            if t is None:
                continue
            if t.is_floating_point():
                ours[key], buffer = in_poisoned_buffer(t)
            else:
                buffer = torch.full((t.numel() + 77,), -128 if t.dtype == torch.int8 else 77, dtype=t.dtype,
                                    device=t.device)
                ours[key] = buffer[:t.numel()].view(t.shape)
            tails[key] = buffer[t.numel():]
        for step in range(1, 6):
            g = (torch.randn(shape, device=DEVICE) * 10 ** torch.empty(()).uniform_(-3, 1)).to(g_dtype)
            scale = torch.empty((), device=DEVICE).uniform_(0.05, 1.0) if step % 2 == 0 else None  # clipping
            step_both(ours, ref, g, step, lr, weight_decay, grad_scale=scale)
        check_codes(ours, ref)
        check_weights(w0, ours, ref)
        for key, tail in tails.items():
            assert (tail.isnan().all() if tail.is_floating_point() else (tail == tail[0]).all()), (shape, key)


@pytest.mark.parametrize("path", ["triton", "reference"])
def test_contract_updates_its_state_in_place(path):
    # kernels/__init__.py's in-place contract: p, the codes, the scales and comp change in place; grad does not.
    n = 3 * QBLOCK + 5
    p = torch.randn(n, device=DEVICE).to(torch.bfloat16)
    grad = torch.randn(n, device=DEVICE).to(torch.bfloat16)
    state = dict(p=p, exp_avg=torch.randint(-127, 128, (n,), dtype=torch.int8, device=DEVICE),
                 exp_avg_scale=torch.rand(4, device=DEVICE),
                 exp_avg_sq=torch.randint(0, 256, (n,), dtype=torch.uint8, device=DEVICE),
                 exp_avg_sq_scale=torch.rand(4, device=DEVICE),
                 comp=(1e-3 * torch.randn(n, device=DEVICE)).to(torch.float16))
    before, grad0 = {k: t.clone() for k, t in state.items()}, grad.clone()
    fn = adamw8bit_step if path == "triton" else reference.adamw8bit_step
    assert fn(p, grad, *(state[k] for k in CODE_KEYS), state["comp"], 1e-2, 0.9, 0.95, 1e-8, 0.1, 3) is None
    assert not any(torch.equal(t, before[k]) for k, t in state.items()) and torch.equal(grad, grad0)


def adversarial_gradients(device, subnormals=True):
    """Blocks (of QBLOCK elements) that stress a block-wise code, as the first step's gradient: all zeros; one
    outlier 1e6 times the rest; mixed signs over 12 orders of magnitude; tiny values beside one large; fp32
    subnormals (~1e-42; the compiled kernel may flush those to zero: not on CUDA); a short last block of 3."""
    b = QBLOCK
    gen = torch.Generator().manual_seed(0)
    blocks = [torch.zeros(b),
              torch.cat([torch.tensor([1e3]), 1e-3 * torch.randn(b - 1, generator=gen)]),
              torch.randn(b, generator=gen).sign() * 10 ** torch.empty(b).uniform_(-6, 6, generator=gen),
              torch.cat([1e-30 * torch.rand(b - 1, generator=gen), torch.tensor([1.0])])]
    if subnormals:
        blocks.append(1e-42 * torch.randint(-20, 21, (b,), generator=gen).float())
    blocks.append(torch.randn(3, generator=gen))
    return torch.cat(blocks).to(device)


@pytest.mark.parametrize("top, power", [(127, ADAMW8BIT_M_POWER), (255, ADAMW8BIT_S_POWER)])
def test_code_error_bound_on_adversarial_blocks(top, power):
    # Per element, with a = |x| / (its block's max) and r = a^(1/p) rounded to the nearest j / top (|r - j/top| <=
    # 1/(2 top)): |a - (j/top)^p| <= p * (r + 1/(2 top))^(p-1) / (2 top), times the block's max; plus a few fp32
    # roundings of the ops themselves (2^-21 of the max, or one subnormal step). Relative to the value itself that
    # is about p / (2 top a^(1/p)): 5% at a = 0.025 for m (p = 2, top 127). An all-zero block codes to zeros with
    # scale 0.
    x = adversarial_gradients("cpu")
    x = torch.cat([x, -x]) if top == 127 else x.abs()
    codes, scale = reference.quantize_blockwise(x, top, power)
    assert codes.min() >= 0 and codes.max() <= top
    back = reference.dequantize_blockwise(codes, scale, top, power)
    blocks = reference._blocks(x.double(), QBLOCK)
    block_max = blocks.abs().amax(1, keepdim=True)
    r = (blocks.abs() / block_max.clamp_min(1e-300)) ** (1 / power)
    bound = (power * (r + 0.5 / top) ** (power - 1) * 0.5 / top + 2.0**-21) * block_max + 2.0**-149
    err = (reference._blocks(back.double(), QBLOCK) - blocks.abs()).abs()
    assert (err <= bound).all(), (err / bound).max().item()
    assert torch.equal(scale[0], torch.tensor(0.0)) and (codes[:QBLOCK] == 0).all()


def test_stochastic_code_is_unbiased_within_one_step():
    # The step's codes (u given): each element gets one of the two levels around its value (error below one level
    # gap, the nearest code's bound doubled), and over K draws their mean is the value: within 6 standard deviations
    # of a mean of K two-point draws, gap / (2 sqrt(K)), plus fp32 roundings (2^-21 of the block's max).
    k = 256
    x = adversarial_gradients("cpu").abs()
    blocks = reference._blocks(x.double(), QBLOCK)
    block_max = blocks.amax(1, keepdim=True)
    r = (blocks / block_max.clamp_min(1e-300)) ** (1 / ADAMW8BIT_S_POWER)
    gap = ((torch.floor(r * 255).clamp(max=254) + 1) / 255) ** 4 - (torch.floor(r * 255).clamp(max=254) / 255) ** 4
    slack = 2.0**-21 * block_max + 2.0**-149
    total = torch.zeros_like(blocks)
    for _ in range(k):
        codes, scale = reference.quantize_blockwise(x, 255, ADAMW8BIT_S_POWER, u=torch.rand(x.shape))
        back = reference._blocks(reference.dequantize_blockwise(codes, scale, 255, ADAMW8BIT_S_POWER).double(),
                                 QBLOCK)
        assert ((back - blocks).abs() <= gap * block_max + slack).all()
        total += back
    assert ((total / k - blocks).abs() <= 6 * gap * block_max / (2 * k**0.5) + slack).all()


def test_codes_follow_a_decaying_moment():
    # Why the step rounds its codes stochastically. One block: element 0 gets a gradient of 1 at every step, the
    # others 1e-2 once, then 0 (an embedding row whose token stopped coming). Their sqrt(v) decays by sqrt(beta2)
    # per step, 2.5% at beta2 = 0.95, while the block's max grows; where a code step is ~5% of the value, nearest
    # rounding gives the same code back step after step and the decoded sqrt(v) follows the max instead: several
    # times too large after 100 steps (so their updates are as many times too small). Stochastic rounding is right
    # in expectation: within 10% on average.
    n, beta2 = QBLOCK, 0.95
    g1 = 1e-2 * torch.empty(n, device=DEVICE).uniform_(0.5, 2)
    g1[0] = 1.0
    w0 = torch.zeros(n, device=DEVICE)
    ours, v32 = new_state(w0), torch.zeros(n, device=DEVICE)
    near_codes, near_scale = torch.zeros(n, dtype=torch.int32), torch.zeros(1)
    for step in range(1, 101):
        g = g1 if step == 1 else torch.cat([g1[:1], torch.zeros(n - 1, device=DEVICE)])
        adamw8bit_step(ours["p"], g, *(ours[k] for k in CODE_KEYS), None, 0.0, 0.9, beta2, 1e-8, 0.0, step)
        v32 = beta2 * v32 + (1 - beta2) * g * g
        s = reference.dequantize_blockwise(near_codes, near_scale, 255, ADAMW8BIT_S_POWER)
        near_codes, near_scale = reference.quantize_blockwise((beta2 * s * s + (1 - beta2) * g.cpu() ** 2).sqrt(),
                                                              255, ADAMW8BIT_S_POWER)
    true_s = v32[1:].sqrt().cpu()
    nearest = reference.dequantize_blockwise(near_codes, near_scale, 255, ADAMW8BIT_S_POWER)[1:] / true_s
    stochastic = decoded(ours)[1].cpu()[1:] / true_s
    assert nearest.mean() > 3 and abs(stochastic.mean().item() - 1) < 0.1, (nearest.mean(), stochastic.mean())


def test_fused_step_on_adversarial_blocks():
    # The kernel codes the adversarial blocks (as the first step's m = 0.1 g and sqrt(v) = sqrt(0.05) |g|) exactly
    # as the reference; in the interpreter, to the bit.
    g = adversarial_gradients(DEVICE, subnormals=DEVICE == "cpu")
    w0 = (0.02 * torch.randn(g.shape, device=DEVICE)).bfloat16()
    ours, ref = new_state(w0), new_state(w0)
    m32, v32 = torch.zeros_like(g), torch.zeros_like(g)  # fp32 moments, for comparison
    for step in (1, 2):
        step_both(ours, ref, g if step == 1 else -g, step)
        reference.adamw_step(w0.float(), g if step == 1 else -g, m32, v32, None, 1e-3, 0.9, 0.95, 1e-8, 0.1, step)
    check_codes(ours, ref)
    check_weights(w0, ours, ref)
    assert (ours["exp_avg_sq"][v32 > 0] > 0).all()  # the guard: no nonzero v codes to 0 (1e-30^2 is 0 in fp32)


def test_guard_keeps_a_vanishing_v_from_exploding_the_update():
    # One block: element 0 gets +1e6 then -9e5 (its m cancels to ~0 while its v stays huge); the others get 0, then
    # 1e-6, then nothing (g = 0: an embedding row not in the batch). After step 2 the block's max of m is small and
    # that of sqrt(v) huge, so the small elements' sqrt(v) (~1e-12 of the max) is below half the first code step
    # while their m is not: coded as 0, step 3 would divide m by eps alone, a step of ~30 lr. The guard codes it as
    # the smallest nonzero level, above the true value: the step is smaller than the true one (~0.5 lr), never larger.
    lr, n = 1e-3, QBLOCK
    w0 = torch.zeros(n, device=DEVICE)
    ours, ref = new_state(w0), new_state(w0)
    m32, v32 = torch.zeros(n, device=DEVICE), torch.zeros(n, device=DEVICE)  # fp32 moments, for comparison
    g1, g2 = torch.zeros(n, device=DEVICE), torch.full((n,), 1e-6, device=DEVICE)
    g1[0], g2[0] = 1e6, -9e5
    for step, g in ((1, g1), (2, g2)):
        step_both(ours, ref, g, step, lr, 0.0)
        reference.adamw_step(w0.clone(), g, m32, v32, None, lr, 0.9, 0.95, 1e-8, 0.0, step)
    unguarded, _ = reference.quantize_blockwise(v32.sqrt(), 255, ADAMW8BIT_S_POWER)
    assert (unguarded[1:] == 0).all() and (ours["exp_avg"][1:] != 0).all()  # the trap ...
    assert (ours["exp_avg_sq"][1:] == 1).all()  # ... and the guard
    w_before = ours["p"].clone()
    step_both(ours, ref, torch.zeros(n, device=DEVICE), 3, lr, 0.0)
    true_step = w0.clone()
    reference.adamw_step(true_step, torch.zeros(n, device=DEVICE), m32, v32, None, lr, 0.9, 0.95, 1e-8, 0.0, 3)
    moved = (ours["p"] - w_before)[1:].abs()
    assert (moved <= true_step[1:].abs()).all() and true_step[1:].abs().max() < lr
    check_codes(ours, ref)


@pytest.mark.slow
def test_tracks_fp32_adamw_at_tiny_lr_like_kahan():
    # test_optim's acceptance run of AdamWKahan (track_at_tiny_lr): bf16 weights with Kahan and 8-bit moments on
    # every tensor (min_8bit_size=0) against fp32 weights with torch's AdamW.
    torch.manual_seed(0)
    (disp_a, drop_a), [(opt_b, disp_b, drop_b)] = track_at_tiny_lr(functools.partial(AdamW8bit, min_8bit_size=0))
    assert all("exp_avg_scale" in state and "comp" in state for state in opt_b.state.values())
    err_b = [rel_err(d, da) for d, da in zip(disp_b, disp_a)]
    glob = math.sqrt(sum((d - da).double().pow(2).sum().item() for d, da in zip(disp_b, disp_a)) /
                     sum(da.double().pow(2).sum().item() for da in disp_a))
    print(f"rel err of displacement vs fp32 AdamW (all tensors / worst tensor): 8-bit + Kahan {glob:.2e} / "
          f"{max(err_b):.2e}; loss drop: fp32 {drop_a:.3e}, 8-bit + Kahan {drop_b:.3e}")
    assert drop_a > 1e-4
    assert abs(drop_b - drop_a) < 0.05 * drop_a  # AdamWKahan's bound on the loss
    assert max(err_b) < 0.03


@pytest.mark.parametrize("offload", [False, True])
def test_state_dict_round_trip_is_exact(offload):
    # bf16 matrices with 8-bit moments (min_8bit_size below their sizes) and fp32 norms with fp32 moments; offload:
    # the 8-bit state of every parameter through StateStream (on the CPU, host memory is the parameters' own).
    def make(groups):
        return AdamW8bit(groups, lr=1e-3, min_8bit_size=1000,
                         offload=[p for g in groups for p in g["params"]] if offload else ())
    for p, state in resumed_states(make):
        eight_bit = p.numel() >= 1000
        assert state.keys() == ({"step", "exp_avg", "exp_avg_sq"} | (set(CODE_KEYS) if eight_bit else set())
                                | ({"comp"} if p.dtype == torch.bfloat16 else set()))
        assert state["exp_avg"].dtype == (torch.int8 if eight_bit else torch.float32) and state["step"].item() == 10


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_step_in_backward_equals_backward_then_step(device, monkeypatch):
    # test_optim's check for AdamWKahan, with AdamW8bit on every tensor (tied embeddings, one checkpointed block):
    # on the CPU bit for bit; on CUDA the codes may differ by one step where a library matmul rounds differently.
    monkeypatch.setattr("test_optim.AdamWKahan", lambda *a, **k: AdamW8bit(*a, **k, min_8bit_size=0))
    cfg = dict(CFG, tie_embeddings=True) if device == "cpu" else dict(CFG, dim=256, tie_embeddings=True)
    model0 = Llama(LlamaConfig(**cfg)).to(device=device, dtype=torch.bfloat16)
    model0.checkpoint_layers = 1
    batches = []
    for _ in range(3):
        cu = random_cu_seqlens(96, 64)
        tokens, labels = torch.randint(0, cfg["vocab_size"], (2, 96))
        batches.append((tokens.to(device), labels.to(device), cu.to(device)))
    plain, in_bwd = copy.deepcopy(model0), copy.deepcopy(model0)
    opt_plain, _ = train_steps(plain, batches, in_backward=False)
    opt_in_bwd, _ = train_steps(in_bwd, batches, in_backward=True)
    assert isinstance(opt_in_bwd, AdamW8bit)
    for p, q in zip(in_bwd.parameters(), plain.parameters()):
        s, r = opt_in_bwd.state[p], opt_plain.state[q]
        assert s.keys() == r.keys() and "exp_avg_scale" in s and s["step"].item() == 3
        if device == "cpu":
            assert torch.equal(p, q) and all(torch.equal(s[key], r[key]) for key in s)
        else:
            assert rel_err(p.float() + s["comp"].float(), q.float() + r["comp"].float()) < 1e-3
            assert (s["exp_avg"].int() - r["exp_avg"].int()).abs().max() <= 1


@pytest.mark.parametrize("p_dtype", [torch.float32, torch.bfloat16])
def test_fused_step_in_pieces_equals_whole(p_dtype):
    # The kernel on pieces (offload's StateStream, `start`) codes each element as on the whole tensor: the same
    # random bits, the same blocks; so the pieces give the whole step's weights, codes and scales to the bit.
    n, cut = 3 * 2048 + 5 * QBLOCK + 17, 2048 + 3 * QBLOCK  # a short last block; a cut inside a program's tile
    whole = new_state((0.02 * torch.randn(n, device=DEVICE)).to(p_dtype))
    pieces = {k: (t.clone() if t is not None else None) for k, t in whole.items()}
    for step in range(1, 4):
        g = torch.randn(n, device=DEVICE).to(p_dtype)
        hyper = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=step)
        adamw8bit_step(whole["p"], g, *(whole[k] for k in (*CODE_KEYS, "comp")), **hyper)
        for lo, hi in ((0, cut), (cut, n)):
            s = {k: None if t is None else t[lo // QBLOCK: -(-hi // QBLOCK)] if k.endswith("scale") else t[lo:hi]
                 for k, t in pieces.items()}
            adamw8bit_step(s["p"], g[lo:hi], *(s[k] for k in (*CODE_KEYS, "comp")), **hyper, start=lo)
    for key, t in whole.items():
        assert t is None or torch.equal(t, pieces[key]), key


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("in_backward, share", [(True, 1.0), (True, 0.6), (False, 1.0)])
def test_offloaded_state_trains_the_same_weights(device, in_backward, share, monkeypatch):
    # AdamW8bit with `share` of its state in host memory against all of it beside the weights, 3 steps of a tied
    # Llama with a checkpointed block: weights and every state tensor equal to the bit; the offloaded state on the
    # host (pinned beside a GPU), the rest with the weights. Pieces of 2,048 elements, so most tensors pass in
    # several, with a short one at the end, through the 3 slots in turn.
    monkeypatch.setattr(StateStream, "PIECE", 2048)
    cfg = dict(CFG, tie_embeddings=True, dim=128, ffn_dim=200)
    model0 = Llama(LlamaConfig(**cfg)).to(device=device, dtype=torch.bfloat16)
    model0.checkpoint_layers = 1
    batches = [(*torch.randint(0, cfg["vocab_size"], (2, 96), device=device), random_cu_seqlens(96, 64).to(device))
               for _ in range(3)]
    runs = []
    for offload in (0.0, share):
        model = copy.deepcopy(model0)
        opt = AdamW8bit(param_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95), min_8bit_size=0,
                        offload=offloaded_params(model, offload))
        update, norms = Update(opt, model.parameters(), in_backward=in_backward), []
        for tokens, labels, cu in batches:
            model(tokens, cu, labels=labels).backward()
            norms.append(update.grad_norm().item())
            update.clip_and_step()
        runs.append((model, opt, norms))
    (resident, opt_r, norms_r), (offloaded, opt_o, norms_o) = runs
    if device == "cuda":
        torch.cuda.synchronize()  # the last pieces' state on its way back to the host
    assert norms_o == pytest.approx(norms_r, rel=1e-6)  # the same squares, summed per piece on the reference
    params = list(offloaded.parameters())
    hosted = offloaded_params(offloaded, share)
    n_hosted = sum(p.numel() for p in hosted)
    assert hosted == params[len(params) - len(hosted):] and n_hosted >= share * sum(p.numel() for p in params)
    assert n_hosted - hosted[0].numel() < share * sum(p.numel() for p in params)  # the fewest that make the share
    for p, q in zip(params, resident.parameters()):
        s, r = opt_o.state[p], opt_r.state[q]
        assert torch.equal(p, q) and s.keys() == r.keys() and s["step"].item() == 3
        for key in set(s) - {"step"}:
            assert torch.equal(s[key].to(device), r[key]), key
            on_host = any(p is h for h in hosted)
            assert s[key].device.type == ("cpu" if on_host else device), key
            assert s[key].is_pinned() == (on_host and device == "cuda"), key


def test_offloaded_bytes_and_the_host_memory_check():
    # Llama-3-8B in bf16: 8.03e9 parameters at 4.125 bytes (configs/llama3_8b_24gb.py's 33.1 GB); fp32 weights have
    # no comp; a machine without the memory gets one line that says what to change, before any step.
    with torch.device("meta"):
        model = Llama(LlamaConfig(**PRESETS["llama3_8b"])).to(torch.bfloat16)
    assert offloaded_bytes(model.parameters()) == pytest.approx(8.03e9 * 4.125, rel=1e-3)
    assert offloaded_bytes([torch.empty(64 * 100)]) == 64 * 100 * 2 + 100 * 8
    assert offloaded_bytes([torch.empty(100)]) == 0  # below min_8bit_size: fp32 moments, on the GPU
    hosted = offloaded_params(model, 0.7)
    assert host_memory_error(hosted, 24e9) is None and host_memory_error(hosted, None) is None
    error = host_memory_error(hosted, 16e9)
    assert "needs 23.3 GB of pinned host memory" in error and "16.0 GB available" in error
    assert "lower optimizer_offload" in error
    assert host_memory_available() is None or host_memory_available() > 0


def test_train_py_learns_and_resumes_exactly(corpus, tmp_path):
    # bf16 weights, 8-bit moments, the step in backward (configs/llama3_8b_80gb.py's optimizer) on the CPU. dim 64:
    # the embedding and the (64, 64+) matrices get 8-bit moments, the (32, 64) k / v projections and the norms fp32.
    common = TINY + [f"--data_dir={corpus}", "--dim=64", "--ffn_dim=128", "--max_steps=12", "--eval_interval=6",
                     "--learning_rate=1e-2", "--weights_dtype=bfloat16", "--optimizer_name=adamw8bit",
                     "--grad_accum=1", "--grad_clip=0", "--optimizer_in_backward=True", "--device=cpu"]
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    run("train.py", *common, f"--out_dir={full}")
    assert losses(full)[12] < losses(full)[1] - 0.5, losses(full)
    layout = read_layout(os.path.join(full, "ckpt", "optimizer.safetensors"))
    dtypes = {key.rsplit(".", 1)[1]: dtype for key, (dtype, _) in layout.items()}
    assert layout["embed_tokens.weight.exp_avg"][0] == torch.int8 and dtypes["exp_avg_sq_scale"] == torch.float32
    assert layout["embed_tokens.weight.exp_avg_sq"][0] == torch.uint8
    assert layout["layers.0.self_attn.k_proj.weight.exp_avg"][0] == torch.float32  # 2048 < 4096 elements
    # The other run keeps the state in host memory (optimizer_offload), stops at 6 and resumes with half of it
    # there: the same losses.
    run("train.py", *common, f"--out_dir={part}", "--stop_at_step=6", "--optimizer_offload=1.0")
    run("train.py", *common, f"--out_dir={part}", "--init_from=resume", "--optimizer_offload=0.5")
    assert losses(part) == losses(full)


# ---- compiled, on a CUDA machine ----

@pytest.mark.gpu
@pytest.mark.parametrize("shape, p_dtype, lr", [((128256, 4096), torch.bfloat16, 1e-5),  # the 8B embedding
                                                ((4097, 14337), torch.float32, 1e-2),     # odd, fp32
                                                ((14336, 4096), torch.bfloat16, 1e-3),    # an 8B MLP matrix
                                                ((1, 4096 + 77), torch.float16, 1e-4)])   # one short row
def test_gpu_fused_step_llama_sizes(shape, p_dtype, lr):
    # Each step from equal states. Compiled, the fp32 moments differ from torch's by an ulp here and there, which
    # moves a code by one step now and then; the next steps carry such a difference on, and a one-step difference
    # of a small code is a large one of its decoded moment (the power-4 code), so codes several steps apart are no
    # sign of a wrong kernel (BENCHMARKS.md, the 8-bit section, has what the H200 showed).
    w = (0.02 * torch.randn(shape, device="cuda")).to(p_dtype)
    ref = new_state(w)
    for step in range(1, 4):
        ours, w = {k: None if t is None else t.clone() for k, t in ref.items()}, ref["p"].clone()
        g = torch.randn(shape, device="cuda").to(p_dtype) * 10.0 ** (-1 - step)
        step_both(ours, ref, g, step, lr)
        check_codes(ours, ref)
        check_weights(w, ours, ref)


@pytest.mark.gpu
def test_gpu_fused_step_past_2_31_elements():
    # 2^31 + 1001 bf16 weights (~17 GB with gradient and state): the offsets need int64. The reference runs on
    # the first and the last whole blocks (10^6 elements' worth) only: blocks are independent.
    n = 2**31 + 1001
    k = (10**6 // QBLOCK) * QBLOCK
    p = torch.empty(n, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02)
    ours, grad = new_state(p), torch.empty_like(p)
    del p
    n_blocks = -(-n // QBLOCK)
    last = (n_blocks - k // QBLOCK) * QBLOCK  # the first element of the last k // QBLOCK blocks
    ends = [(slice(0, k), slice(0, k // QBLOCK)), (slice(last, n), slice(last // QBLOCK, n_blocks))]
    def pieces():
        return [{key: (t[s] if key in ("exp_avg_scale", "exp_avg_sq_scale") else t[e]) for key, t in ours.items()}
                for e, s in ends]
    # Each step from equal states: a code one apart after a step (allowed) moves the next m by ~beta1 of a code
    # step, to which that step's own stochastic rounding can add one more.
    for step in (1, 2):
        refs = [{key: t.clone() for key, t in part.items()} for part in pieces()]
        w0 = [r["p"].clone() for r in refs]
        grad.normal_()
        hyper = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=step)
        adamw8bit_step(ours["p"], grad, ours["exp_avg"], ours["exp_avg_scale"], ours["exp_avg_sq"],
                       ours["exp_avg_sq_scale"], ours["comp"], **hyper)
        for (e, _), r in zip(ends, refs):
            reference.adamw8bit_step(r["p"], grad[e], r["exp_avg"], r["exp_avg_scale"], r["exp_avg_sq"],
                                     r["exp_avg_sq_scale"], r["comp"], **hyper, start=e.start)
        for part, r, w in zip(pieces(), refs, w0):
            check_codes(part, r)
            check_weights(w, part, r)
