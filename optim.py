"""AdamW that does not lose small updates when the weights themselves are bf16.

Why: full fine-tuning Llama-3-8B on one 141 GB GPU leaves no room for fp32 master weights (8B x (4 weights +
4 grads + 8 Adam moments) = 128 GB before any activation). So the weights stay bf16 (16 GB), the Adam moments
stay fp32 (64 GB), and a 16-bit compensation buffer (16 GB) keeps what bf16 cannot hold.

The problem: bf16 has 8 bits of mantissa, so neighbouring values of a weight w are about |w| * 2^-8 apart. An
update u smaller than half that spacing (half an ulp) is rounded away entirely: w + u == w. At lr 1e-6 and
|w| ~ 0.02 every Adam step (|u| <= ~lr) is such an update, and plain bf16 AdamW does not train at all.

The fix, Kahan summation: keep the part of each update that rounding dropped in `comp` and add it to the next:

    y    = u + comp          what should be added this step: the update plus what earlier steps failed to add
    t    = bf16(w + y)       the new weight, rounded
    comp = y - (t - w)       the part of y that did not make it into t (t - w is exact in fp32)
    w    = t

w + comp is the true weight. comp is at most half an ulp of w, so it needs precision, not range: we keep it in
fp16 (11 significant bits, 3 more than bf16, same 2 bytes) even for bf16 weights. Measured on the acceptance
test in tests/test_optim.py (lr 1e-6, 200 steps): with a bf16 comp the norm weights (|w| ~ 1) still lose ~6% of
their displacement, with an fp16 comp under 1%. The price: fp16 resolves a small comp only to its floor of
2^-24 ~ 6e-8 (subnormals), a few % of a 1e-6 update; fine for lr >~ 1e-6, and still better than bf16 above
|w| ~ 2^-7.

The AdamW math, all in fp32 (t = step count, g = gradient, W = w + comp the true weight):

    m = beta1 * m + (1 - beta1) * g            v = beta2 * v + (1 - beta2) * g^2
    m_hat = m / (1 - beta1^t)                  v_hat = v / (1 - beta2^t)
    u = -lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * W)      (decoupled weight decay)

fp32 parameters take the plain update w += u (exactly as torch.optim.AdamW) and get no `comp` buffer.

The idea is "Kahan summation for bf16 training" from Zamirai et al. 2020, "Revisiting BFloat16 Training"; the
optimi library (B. Warner) ships Kahan-compensated optimizers built on it. This code is our own.
"""
import torch


class AdamWKahan(torch.optim.Optimizer):
    """AdamW for parameters of any dtype: fp32 moments, and Kahan-compensated updates for bf16 / fp16 weights.

    State per parameter: step (a CPU scalar tensor, as in torch.optim.AdamW), exp_avg and exp_avg_sq (fp32), and
    for bf16 / fp16 parameters comp (fp16). The loop goes one parameter at a time on purpose: the fp32 temporaries
    of a step are then the size of one tensor (2 GB for the 8B embedding) rather than of the whole model (32 GB per
    temporary for the 8B), which a torch._foreach_ version over all parameters would need.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                    if p.dtype in (torch.bfloat16, torch.float16):
                        state["comp"] = torch.zeros_like(p, dtype=torch.float16)  # fp16 even for bf16: see above
                state["step"] += 1
                t = state["step"].item()
                m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad.float()
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                # m_hat / (sqrt(v_hat) + eps) = (m / (1 - beta1^t)) / (sqrt(v) / sqrt(1 - beta2^t) + eps)
                step_size = lr / (1 - beta1**t)
                denom = (v.sqrt() / (1 - beta2**t) ** 0.5).add_(eps)
                comp = state.get("comp")
                if comp is None:  # fp32 (or fp64): plain AdamW, in torch.optim.AdamW's order of operations
                    p.mul_(1 - lr * wd).addcdiv_(m, denom, value=-step_size)
                    continue
                w, c = p.float(), comp.float()
                u = (w + c).mul_(-lr * wd).addcdiv_(m, denom, value=-step_size)  # decay acts on the true weight
                y = u.add_(c)  # y = u + comp
                new_w = (w + y).to(p.dtype)  # t = w + y, rounded: loses the low part of y ...
                comp.copy_(y.sub_(new_w.float() - w))  # ... which comp = y - (t - w) keeps for the next step
                p.copy_(new_w)
        return loss

    def load_state_dict(self, state_dict):
        # Optimizer.load_state_dict casts every floating state tensor to its parameter's dtype, which would round
        # the fp32 moments of a bf16 parameter to bf16 and break an exact resume: put the saved tensors back.
        super().load_state_dict(state_dict)
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for i, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(i, {}).items():
                if key != "step":
                    self.state[p][key] = value.to(p.device)  # in the dtype it was saved in
