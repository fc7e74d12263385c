"""AdamWKahan (optim.py): equal to torch AdamW on fp32 weights, keeps tiny updates that plain AdamW on bf16 weights
loses, resumes exactly from a state dict, and honours parameter groups and parameters without a gradient. Its fused
Triton step (kernels/adamw.py) equals the reference step (in the interpreter on the CPU, compiled at Llama-3-8B sizes
in the `gpu` tests), and stepping inside backward (optim.step_in_backward) equals backward then step(). Update skips
the clipping pass only where it would multiply by exactly 1, and folds it into our step to the same bits."""
import copy
import gc
import io
import weakref

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from conftest import DEVICE, random_cu_seqlens, rel_err
from kernels import reference
from kernels.adamw import adamw_step
from model import Llama, LlamaConfig
from optim import AdamWKahan, Update, make_optimizer, param_groups, pop_grad_sq, step_in_backward

CFG = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=101, max_seq_len=64)


def true_weight(p, opt):
    """What the optimizer holds: the stored weight plus its Kahan compensation, in fp32."""
    comp = opt.state[p].get("comp")
    return p.float() + (comp.float() if comp is not None else 0)


def test_fp32_equals_torch_adamw():
    shapes = [(37, 19), (5,), (3, 7, 11)]
    ours = [torch.randn(s, requires_grad=True) for s in shapes]
    ref = [p.detach().clone().requires_grad_() for p in ours]
    w0 = [p.detach().clone() for p in ours]
    hyper = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)
    opt, opt_ref = AdamWKahan(ours, **hyper), torch.optim.AdamW(ref, **hyper)
    for _ in range(50):
        for p, q in zip(ours, ref):
            p.grad = torch.randn_like(p) * 10 ** torch.empty(()).uniform_(-3, 1)
            q.grad = p.grad.clone()
        opt.step()
        opt_ref.step()
    for p, q, p0 in zip(ours, ref, w0):
        assert "comp" not in opt.state[p]  # fp32 takes the plain update, no buffer
        assert rel_err(p - p0, q - p0) < 1e-6  # the displacement, a stricter test than the weights themselves
        for key in ("exp_avg", "exp_avg_sq"):
            assert rel_err(opt.state[p][key], opt_ref.state[q][key]) < 1e-6


def skewed_batch(n_tokens, probs):
    """A packed batch whose labels follow a fixed skewed distribution: something consistent to learn."""
    cu = random_cu_seqlens(n_tokens, 64)
    tokens = torch.multinomial(probs, n_tokens, replacement=True)
    labels = torch.multinomial(probs, n_tokens, replacement=True)
    return tokens, labels, cu


def track_at_tiny_lr(*optimizers):
    """The acceptance run of an optimizer for bf16 weights. (a) fp32 weights + torch AdamW, the reference, make the
    gradients of 200 steps at lr 1e-6, where every update is far below half an ulp of a bf16 weight of size ~0.02;
    each of `optimizers` (a constructor taking param groups, lr and betas) steps a bf16 copy of the same
    bf16-representable start with those gradients, so only the optimizer differs. Returns the reference's
    displacements and loss drop, and for each optimizer (the optimizer, the displacements of its true weights,
    the loss drop of its stored bf16 weights); every model is evaluated in fp32."""
    ref = Llama(LlamaConfig(**CFG))
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.bfloat16().float())
    models = [copy.deepcopy(ref).bfloat16() for _ in optimizers]
    w0 = [p.detach().clone() for p in ref.parameters()]
    hyper = dict(lr=1e-6, betas=(0.9, 0.95))
    opts = [torch.optim.AdamW(param_groups(ref, 0.1), **hyper)]
    opts += [make(param_groups(model, 0.1), **hyper) for make, model in zip(optimizers, models)]
    probs = 1.0 / torch.arange(1, CFG["vocab_size"] + 1).float()
    eval_batch = skewed_batch(256, probs)

    def eval_loss(params):
        model = copy.deepcopy(ref)
        with torch.no_grad():
            for p, w in zip(model.parameters(), params):
                p.copy_(w)
            tokens, labels, cu = eval_batch
            return model(tokens, cu, labels=labels).item()

    loss0 = eval_loss(w0)
    for _ in range(200):
        tokens, labels, cu = skewed_batch(128, probs)
        ref(tokens, cu, labels=labels).backward()
        for model in models:
            for pa, p in zip(ref.parameters(), model.parameters()):
                p.grad = pa.grad.bfloat16()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    print(f"\nloss from {loss0:.5f}")
    reference_run = ([p.detach() - p0 for p, p0 in zip(ref.parameters(), w0)], loss0 - eval_loss(ref.parameters()))
    return reference_run, [(opt, [true_weight(p, opt) - p0 for p, p0 in zip(model.parameters(), w0)],
                            loss0 - eval_loss(model.parameters())) for opt, model in zip(opts[1:], models)]


@pytest.mark.parametrize("norm", [0.3, 0.999995, 1.0, 2.7])  # clip 1.0: below it, within the margin, at it, above
def test_clip_skipped_only_where_its_scale_is_exactly_one(norm, monkeypatch):
    """Update.clip_and_step(host_norm) skips the pass over the gradients only where torch's scale min(1, clip /
    (norm + 1e-6)) is exactly 1: every step the same weights to the bit as clipping without the host's norm."""
    params = [torch.randn(shape) for shape in [(37, 19), (5,), (3, 7, 11)]]
    grads = [torch.randn_like(p) for p in params]
    total = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
    grads = [g * (norm / total) for g in grads]
    clip, calls = torch.nn.utils.clip_grads_with_norm_, []
    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", lambda *a, **k: calls.append(1) or clip(*a, **k))
    runs = []
    for pass_host_norm in (False, True):
        weights = [p.clone().requires_grad_() for p in params]
        update = Update(torch.optim.AdamW(weights, lr=1e-2), weights, grad_clip=1.0)
        for w, g in zip(weights, grads):
            w.grad = g.clone()
        host_norm = update.grad_norm().item()
        update.clip_and_step(host_norm if pass_host_norm else None)
        runs.append(weights)
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert len(calls) == (1 if norm < 0.9999 else 2)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit"])
@pytest.mark.parametrize("norm", [0.3, 2.7])  # clip 1.0: nothing to clip, then a factor of 0.37
def test_clip_folded_into_our_step_equals_the_clipping_pass(optimizer, norm):
    """Our optimizers take Update's clipping factor into the step (grad_scale) instead of a pass that multiplies
    every gradient first: on fp32 gradients the same product, so the same weights and moments to the bit. make_optimizer
    gives "adamw" (fp32 weights) our kernel where it is fused, torch's otherwise."""
    model = Llama(LlamaConfig(**CFG))
    batch = (torch.randint(0, CFG["vocab_size"], (40,)), torch.tensor([0, 17, 40], dtype=torch.int32))
    runs = []
    for fold in (True, False):
        m = copy.deepcopy(model)
        opt = make_optimizer(optimizer, m, 1e-2, (0.9, 0.95), 0.1, fused=optimizer == "adamw")
        if optimizer == "adamw":
            assert isinstance(opt, AdamWKahan)
            assert isinstance(make_optimizer(optimizer, m, 1e-2, (0.9, 0.95), 0.1), torch.optim.AdamW)
        update = Update(opt, m.parameters(), grad_clip=1.0)
        for _ in range(3):
            loss = m(*batch, labels=torch.roll(batch[0], -1))
            loss.backward()
            total = update.grad_norm()
            for p in m.parameters():  # the norm this test wants, then measured again as a step would
                p.grad.mul_(norm / total)
            update.grad_norm()
            if fold:
                update.clip_and_step()
            else:
                torch.nn.utils.clip_grads_with_norm_(list(m.parameters()), 1.0, update.norm)
                opt.step()
                opt.zero_grad(set_to_none=True)
        runs.append((m, opt))
    (a, opt_a), (b, opt_b) = runs
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
        assert all(torch.equal(opt_a.state[p][k], opt_b.state[q][k]) for k in opt_a.state[p])


def test_bf16_kahan_keeps_tiny_updates_that_plain_adamw_loses():
    # (a) fp32 weights + torch AdamW, the reference; (b) bf16 weights + AdamWKahan; (c) bf16 weights + torch AdamW.
    (disp_a, drop_a), [(_, disp_b, drop_b), (_, disp_c, drop_c)] = track_at_tiny_lr(AdamWKahan, torch.optim.AdamW)
    err_b = max(rel_err(d, da) for d, da in zip(disp_b, disp_a))  # the worst tensor of (b) ...
    err_c = min(rel_err(d, da) for d, da in zip(disp_c, disp_a))  # ... and the best of (c)
    print(f"rel err of displacement: kahan (worst tensor) {err_b:.2e}, plain bf16 (best tensor) {err_c:.2e}; "
          f"loss drop: fp32 {drop_a:.3e}, kahan bf16 {drop_b:.3e}, plain bf16 {drop_c:.3e}")
    assert err_b < 1e-2
    assert err_c > 0.5
    assert drop_a > 1e-4  # the reference learned something measurable ...
    assert abs(drop_b - drop_a) < 0.05 * drop_a  # ... which the bf16 weights of (b) learned too ...
    assert abs(drop_c) < 0.5 * drop_a  # ... and those of (c) mostly did not


def mixed_dtype_llama():
    """bf16 matrices (Kahan path) and fp32 norms (plain path) in one model."""
    model = Llama(LlamaConfig(**CFG)).bfloat16()
    for p in model.parameters():
        if p.dim() < 2:
            p.data = p.data.float()
    return model


def save_and_load(model, opt, fresh_model, fresh_opt, how):
    """Checkpoint (model, opt) and load it into (fresh_model, fresh_opt): through torch.save of the plain state
    dicts, or through torch.distributed.checkpoint's get/set_optimizer_state_dict as train.py does."""
    if how == "dcp":
        sd = get_optimizer_state_dict(model, opt)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": sd if how == "dcp" else opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)
    fresh_model.load_state_dict(ckpt["model"])
    if how == "dcp":
        set_optimizer_state_dict(fresh_model, fresh_opt, ckpt["optimizer"])
    else:
        fresh_opt.load_state_dict(ckpt["optimizer"])


def resumed_states(make_optimizer):
    """A mixed-dtype Llama trained 10 steps in one go, and 5 + 5 with a save and load in between (torch.save, then
    dcp), with make_optimizer(param_groups): the weights, the state's keys and every state tensor agree to the bit.
    Yields (parameter, its optimizer state) of the uninterrupted run, per parameter and way of saving."""
    model0 = mixed_dtype_llama()
    grads = [[torch.randn_like(p) for p in model0.parameters()] for _ in range(10)]

    def train(model, opt, grads):
        for gs in grads:
            for p, g in zip(model.parameters(), gs):
                p.grad = g.clone()
            opt.step()
            opt.zero_grad(set_to_none=True)

    whole = copy.deepcopy(model0)
    opt_whole = make_optimizer(param_groups(whole, 0.1))
    train(whole, opt_whole, grads)
    for how in ("torch.save", "dcp"):
        first = copy.deepcopy(model0)
        opt_first = make_optimizer(param_groups(first, 0.1))
        train(first, opt_first, grads[:5])
        resumed = mixed_dtype_llama()  # fresh weights, overwritten by the checkpoint
        opt_resumed = make_optimizer(param_groups(resumed, 0.1))
        save_and_load(first, opt_first, resumed, opt_resumed, how)
        train(resumed, opt_resumed, grads[5:])
        for p, q in zip(whole.parameters(), resumed.parameters()):
            assert p.dtype == q.dtype and torch.equal(p, q), how
            s, r = opt_whole.state[p], opt_resumed.state[q]
            assert s.keys() == r.keys(), how
            for key in s:
                assert s[key].dtype == r[key].dtype and torch.equal(s[key], r[key]), (how, key)
            yield p, s


def test_state_dict_round_trip_is_exact():
    for p, state in resumed_states(lambda groups: AdamWKahan(groups, lr=1e-3)):
        assert state.keys() == {"step", "exp_avg", "exp_avg_sq"} | ({"comp"} if p.dtype == torch.bfloat16 else set())
        assert state["exp_avg"].dtype == torch.float32 and state["step"].item() == 10


def test_groups_and_parameters_without_grad():
    # Two groups with their own weight decay and lr; `frozen` never has a gradient, `sometimes` only on even steps.
    # Against torch AdamW (fp32) on the same groups: fp32 weights equal, bf16 true weights close.
    for dtype in (torch.float32, torch.bfloat16):
        shapes = dict(w1=(23, 9), w2=(4, 13), norm=(17,), frozen=(6, 5), sometimes=(11,))
        ref = {n: torch.randn(s).to(dtype).float().requires_grad_() for n, s in shapes.items()}
        ours = {n: p.detach().to(dtype).requires_grad_() for n, p in ref.items()}
        w0 = {n: p.detach().clone() for n, p in ref.items()}

        def groups(ps):
            return [{"params": [ps["w1"], ps["w2"], ps["frozen"]], "weight_decay": 0.5},
                    {"params": [ps["norm"], ps["sometimes"]], "weight_decay": 0.0, "lr": 3e-3}]

        opt, opt_ref = AdamWKahan(groups(ours), lr=1e-2), torch.optim.AdamW(groups(ref), lr=1e-2)
        for i in range(20):
            for n in ("w1", "w2", "norm") + (("sometimes",) if i % 2 == 0 else ()):
                ours[n].grad = torch.randn_like(ours[n])
                ref[n].grad = ours[n].grad.float()
            for o in (opt, opt_ref):
                o.step()
                o.zero_grad(set_to_none=True)
        assert ours["frozen"] not in opt.state and torch.equal(ours["frozen"].float(), w0["frozen"])
        assert opt.state[ours["sometimes"]]["step"].item() == 10
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        for n in ("w1", "w2", "norm", "sometimes"):
            assert rel_err(true_weight(ours[n], opt) - w0[n], ref[n].detach() - w0[n]) < tol, (dtype, n)


# ---- the fused step (kernels/adamw.py) against the reference step ----

def new_state(p):
    """What AdamWKahan.step_param creates for p: fp32 moments, and an fp16 comp for a bf16 / fp16 weight."""
    comp = None if p.dtype == torch.float32 else torch.zeros_like(p, dtype=torch.float16)
    return dict(exp_avg=torch.zeros_like(p, dtype=torch.float32), exp_avg_sq=torch.zeros_like(p, dtype=torch.float32),
                comp=comp)


def run_both(grads, lr, weight_decay, ours, ref):
    """The same steps, with the same gradients, through the kernel and the reference, each on its own weight and
    state (dicts p, exp_avg, exp_avg_sq, comp), and the squared norm of each gradient from what each appends to a
    grad_sq list. Every second step the gradients are scaled by a random clipping factor (grad_scale)."""
    hyper = dict(lr=lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=weight_decay)
    for step, g in enumerate(grads, start=1):
        scale = torch.empty((), device=g.device).uniform_(0.05, 1.0) if step % 2 == 0 else None
        lists = [[torch.full((1,), 0.5, device=g.device)] for _ in range(2)]  # grad_sq: appended to
        adamw_step(ours["p"], g, ours["exp_avg"], ours["exp_avg_sq"], ours["comp"], step=step, **hyper,
                   grad_sq=lists[0], grad_scale=scale)
        reference.adamw_step(ref["p"], g, ref["exp_avg"], ref["exp_avg_sq"], ref["comp"], step=step, **hyper,
                             grad_sq=lists[1], grad_scale=scale)
        assert [len(x) for x in lists] == [2, 2], [len(x) for x in lists]  # one tensor appended by each
        sums = [pop_grad_sq(x, g.device) for x in lists]
        scaled = g.double() * (1.0 if scale is None else scale.double())
        exact = 0.5 + scaled.square().sum()  # fp32 sums in two orders (per program, then torch's; torch's)
        assert all(abs(x.item() - exact) <= 1e-5 * exact for x in sums) and lists == [[], []], (sums, exact)


def check_against_reference(w0, ours, ref):
    """Moments: equal up to fp32 rounding (rel 1e-6). Weights: the displacement from w0 of the true weight
    p + comp. fp32: rel 1e-6, which is honest because the weights have Llama's init scale (std 0.02) and the test
    lr is 1e-2, so the displacement (~1e-2) is ~1e7 ulps of w and one-ulp differences of w (the kernel's FMAs
    round differently from torch's separate ops) stay near 1e-8. bf16 / fp16: rel 1e-3. A different rounding of
    an intermediate moves the true weight by at most one fp16 ulp of comp (|comp| <= ~half an ulp of w: that is
    ~2^-20 |w|, or the fp16 floor of 6e-8), and such flips are rare (an fp32 ulp of the update against an fp16
    ulp of comp); 1e-3 holds even at lr 1e-5, where one flip is ~1e-3 of that element's displacement. The stored
    weights themselves must agree almost everywhere: a wrong rounding mode (truncation) differs in half of them."""
    for key in ("exp_avg", "exp_avg_sq"):
        assert rel_err(ours[key], ref[key]) < 1e-6, key
    if w0.dtype == torch.float32:
        assert rel_err(ours["p"] - w0, ref["p"] - w0) < 1e-6
        return
    true_w, ref_true_w = (s["p"].float() + s["comp"].float() for s in (ours, ref))
    assert rel_err(true_w - w0.float(), ref_true_w - w0.float()) < 1e-3
    assert (ours["p"] != ref["p"]).float().mean().item() < 0.01


# (weight dtype, gradient dtype, lr): fp32 as torch.optim.AdamW; bf16 with updates above and far below half an ulp
# of the weights (|w| ~ 0.02: half an ulp ~ 3e-5 to 6e-5), the regime Kahan summation exists for; bf16 weights with
# fp32 gradients; fp16 weights (an fp16 comp as well).
KERNEL_CASES = [(torch.float32, torch.float32, 1e-2), (torch.bfloat16, torch.bfloat16, 1e-3),
                (torch.bfloat16, torch.bfloat16, 1e-5), (torch.bfloat16, torch.float32, 1e-3),
                (torch.float16, torch.float16, 1e-4)]


def in_poisoned_buffer(t, tail=77):
    """A copy of t at the head of a flat buffer whose last `tail` elements are NaN: a store past t's last element
    (a missing mask) would overwrite them. Returns (the copy, the buffer)."""
    buffer = torch.full((t.numel() + tail,), float("nan"), dtype=t.dtype, device=t.device)
    head = buffer[:t.numel()].view(t.shape)
    head.copy_(t)
    return head, buffer


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("p_dtype, g_dtype, lr", KERNEL_CASES)
def test_fused_step_matches_reference(p_dtype, g_dtype, lr, weight_decay):
    # In the interpreter on the CPU (conftest sets TRITON_INTERPRET=1), compiled on a CUDA machine; 5 steps,
    # gradients of scales 1e-3 to 10.
    for shape in [(4099,), (37, 19)]:  # (37, 19): one program, mostly masked
        w0 = (0.02 * torch.randn(shape, device=DEVICE)).to(p_dtype)
        ref = dict(p=w0.clone(), **new_state(w0))
        ours, buffers = {"comp": None}, []
        for key, t in ref.items():
            if t is not None:
                ours[key], buffer = in_poisoned_buffer(t)
                buffers.append(buffer[t.numel():])
        grads = [(torch.randn(shape, device=DEVICE) * 10 ** torch.empty(()).uniform_(-3, 1)).to(g_dtype)
                 for _ in range(5)]
        run_both(grads, lr, weight_decay, ours, ref)
        check_against_reference(w0, ours, ref)
        assert all(tail.isnan().all() for tail in buffers), shape


@pytest.mark.gpu
@pytest.mark.parametrize("shape, p_dtype, lr", [((128256, 4096), torch.bfloat16, 1e-5),  # the 8B embedding
                                                ((4097, 14337), torch.float32, 1e-2)])   # odd, fp32
def test_gpu_fused_step_llama_sizes(shape, p_dtype, lr):
    w0 = (0.02 * torch.randn(shape, device="cuda")).to(p_dtype)
    ours, ref = dict(p=w0.clone(), **new_state(w0)), dict(p=w0.clone(), **new_state(w0))
    grads = [torch.randn(shape, device="cuda").to(p_dtype) * 10.0 ** (-1 - i) for i in range(3)]
    run_both(grads, lr, 0.1, ours, ref)
    check_against_reference(w0, ours, ref)


@pytest.mark.gpu
def test_gpu_fused_step_past_2_31_elements():
    # 2^31 + 1001 bf16 weights (30 GB with gradient and state): the element offsets need int64. The reference runs
    # on copies of the first and last 10^6 elements only (the update is elementwise).
    n, k = 2**31 + 1001, 10**6
    p = torch.empty(n, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02)
    ours, grad = dict(p=p, **new_state(p)), torch.empty_like(p)
    ends = (slice(0, k), slice(n - k, n))
    w0 = [p[s].clone() for s in ends]
    refs = [dict(p=w.clone(), **new_state(w)) for w in w0]
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    for step in (1, 2):
        grad.normal_()
        adamw_step(ours["p"], grad, ours["exp_avg"], ours["exp_avg_sq"], ours["comp"], step=step, **hyper)
        for s, ref in zip(ends, refs):
            reference.adamw_step(ref["p"], grad[s], ref["exp_avg"], ref["exp_avg_sq"], ref["comp"], step=step, **hyper)
    for s, w, ref in zip(ends, w0, refs):
        check_against_reference(w, {key: t[s] for key, t in ours.items()}, ref)


# ---- the optimizer step inside backward (optim.step_in_backward) ----

def train_steps(model, batches, in_backward):
    """3 steps of AdamWKahan, either backward then step() or stepping inside backward; returns the optimizer and
    the squared global gradient norm of each step."""
    opt = AdamWKahan(param_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95))
    grad_sq = step_in_backward(opt) if in_backward else None
    norms = []
    for tokens, labels, cu in batches:
        loss = model(tokens, cu, labels=labels)
        if in_backward:
            loss.backward()
            assert all(p.grad is None for p in model.parameters())  # consumed and freed
            norms.append(pop_grad_sq(grad_sq, tokens.device).item())
        else:
            loss.backward()
            norms.append(sum(p.grad.double().pow(2).sum() for p in model.parameters()).item())
            opt.step()
            opt.zero_grad(set_to_none=True)
    return opt, norms


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype, tied, checkpoint_layers", [(torch.float32, False, 0), (torch.bfloat16, True, 1)])
def test_step_in_backward_equals_backward_then_step(device, dtype, tied, checkpoint_layers):
    # On the CPU both paths run the same reference ops, so they must agree bit for bit. On CUDA they run the Triton
    # kernels, the model's included (head_dim 64: the attention kernel's), which have no atomics either; the
    # tolerance only leaves room for library matmuls. A model op reading a weight after its update would be off by
    # ~lr / |w| ~ 5% in its gradient. Tied embeddings: the hook must fire once, after both uses have added up.
    # Activation checkpointing: the recomputed forward of a block must still see its weights before the update.
    cfg = dict(CFG, tie_embeddings=tied) if device == "cpu" else dict(CFG, dim=256, tie_embeddings=tied)
    model0 = Llama(LlamaConfig(**cfg)).to(device=device, dtype=dtype)
    model0.checkpoint_layers = checkpoint_layers
    w0 = [p.detach().float() for p in model0.parameters()]
    batches = []
    for _ in range(3):
        cu = random_cu_seqlens(96, 64)
        tokens, labels = torch.randint(0, cfg["vocab_size"], (2, 96))
        batches.append((tokens.to(device), labels.to(device), cu.to(device)))
    plain, in_bwd = copy.deepcopy(model0), copy.deepcopy(model0)
    opt_plain, norms_plain = train_steps(plain, batches, in_backward=False)
    opt_in_bwd, norms_in_bwd = train_steps(in_bwd, batches, in_backward=True)

    tol = 0.0 if device == "cpu" else (1e-5 if dtype == torch.float32 else 1e-3)
    for a, b in zip(norms_in_bwd, norms_plain):
        assert abs(a - b) <= 1e-5 * b  # fp32 norms of up to 10^4 elements, summed in backward's order, against fp64
    for p, q, p0 in zip(in_bwd.parameters(), plain.parameters(), w0):
        s, r = opt_in_bwd.state[p], opt_plain.state[q]
        assert s.keys() == r.keys() and s["step"].item() == r["step"].item() == 3
        assert not torch.equal(true_weight(p, opt_in_bwd), p0)  # it trained
        if tol == 0.0:
            assert torch.equal(p, q) and all(torch.equal(s[key], r[key]) for key in s)
        else:
            assert rel_err(true_weight(p, opt_in_bwd) - p0, true_weight(q, opt_plain) - p0) < tol
            assert all(rel_err(s[key], r[key]) < tol for key in ("exp_avg", "exp_avg_sq"))


def test_step_in_backward_lets_model_and_optimizer_be_freed():
    model = Llama(LlamaConfig(**CFG))
    opt = AdamWKahan(param_groups(model, 0.1), lr=1e-3)
    step_in_backward(opt)
    weight = weakref.ref(model.embed_tokens.weight)
    del model, opt
    gc.collect()
    assert weight() is None  # a hook holding the optimizer would keep every parameter (and its state) alive
