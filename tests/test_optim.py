"""AdamWKahan (optim.py): equal to torch AdamW on fp32 weights, keeps tiny updates that plain AdamW on bf16 weights
loses, resumes exactly from a state dict, and honours parameter groups and parameters without a gradient."""
import copy
import io

import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from conftest import random_cu_seqlens, rel_err
from model import Llama, LlamaConfig
from optim import AdamWKahan

CFG = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=101, max_seq_len=64)


def param_groups(model, weight_decay=0.1):
    """As train.py does it: decay the matrices, not the norms."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


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


def test_bf16_kahan_keeps_tiny_updates_that_plain_adamw_loses():
    # (a) fp32 weights + torch AdamW, the reference; (b) bf16 weights + AdamWKahan; (c) bf16 weights + torch AdamW.
    # All three start from the same bf16-representable weights and get the same gradients, those of (a), so only
    # the optimizer differs. At lr 1e-6 every update is far below half an ulp of a bf16 weight of size ~0.02.
    ref = Llama(LlamaConfig(**CFG))
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.bfloat16().float())
    kahan, plain = copy.deepcopy(ref).bfloat16(), copy.deepcopy(ref).bfloat16()
    w0 = [p.detach().clone() for p in ref.parameters()]
    hyper = dict(lr=1e-6, betas=(0.9, 0.95))
    opt_a = torch.optim.AdamW(param_groups(ref), **hyper)
    opt_b = AdamWKahan(param_groups(kahan), **hyper)
    opt_c = torch.optim.AdamW(param_groups(plain), **hyper)
    probs = 1.0 / torch.arange(1, CFG["vocab_size"] + 1).float()
    eval_batch = skewed_batch(256, probs)

    def eval_loss(params):  # every model's weights evaluated in fp32, so that only the weights differ
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
        for pa, pb, pc in zip(ref.parameters(), kahan.parameters(), plain.parameters()):
            pb.grad, pc.grad = pa.grad.bfloat16(), pa.grad.bfloat16()
        for opt in (opt_a, opt_b, opt_c):
            opt.step()
            opt.zero_grad(set_to_none=True)

    pa, pb, pc = list(ref.parameters()), list(kahan.parameters()), list(plain.parameters())
    disp_a = [p.detach() - p0 for p, p0 in zip(pa, w0)]
    disp_b = [true_weight(p, opt_b) - p0 for p, p0 in zip(pb, w0)]
    disp_c = [p.float() - p0 for p, p0 in zip(pc, w0)]
    err_b = max(rel_err(d, da) for d, da in zip(disp_b, disp_a))  # the worst tensor of (b) ...
    err_c = min(rel_err(d, da) for d, da in zip(disp_c, disp_a))  # ... and the best of (c)
    drop_a, drop_b, drop_c = (loss0 - eval_loss(ps) for ps in (pa, pb, pc))  # (b): its bf16 weights alone
    print(f"\nrel err of displacement: kahan (worst tensor) {err_b:.2e}, plain bf16 (best tensor) {err_c:.2e}; "
          f"loss drop from {loss0:.5f}: "
          f"fp32 {drop_a:.3e}, kahan bf16 {drop_b:.3e}, plain bf16 {drop_c:.3e}")
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


def test_state_dict_round_trip_is_exact():
    model0 = mixed_dtype_llama()
    grads = [[torch.randn_like(p) for p in model0.parameters()] for _ in range(10)]

    def train(model, opt, grads):
        for gs in grads:
            for p, g in zip(model.parameters(), gs):
                p.grad = g.clone()
            opt.step()
            opt.zero_grad(set_to_none=True)

    whole = copy.deepcopy(model0)
    opt_whole = AdamWKahan(param_groups(whole), lr=1e-3)
    train(whole, opt_whole, grads)
    for how in ("torch.save", "dcp"):
        first = copy.deepcopy(model0)
        opt_first = AdamWKahan(param_groups(first), lr=1e-3)
        train(first, opt_first, grads[:5])
        resumed = mixed_dtype_llama()  # fresh weights, overwritten by the checkpoint
        opt_resumed = AdamWKahan(param_groups(resumed), lr=1e-3)
        save_and_load(first, opt_first, resumed, opt_resumed, how)
        train(resumed, opt_resumed, grads[5:])

        for p, q in zip(whole.parameters(), resumed.parameters()):
            assert p.dtype == q.dtype and torch.equal(p, q), how
            s, r = opt_whole.state[p], opt_resumed.state[q]
            assert s.keys() == r.keys() == {"step", "exp_avg", "exp_avg_sq"} | ({"comp"} if "comp" in s else set())
            assert ("comp" in s) == (p.dtype == torch.bfloat16)
            for key in s:
                assert s[key].dtype == r[key].dtype and torch.equal(s[key], r[key]), (how, key)
            assert s["exp_avg"].dtype == torch.float32 and s["step"].item() == 10


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
