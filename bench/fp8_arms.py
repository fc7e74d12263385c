"""FP8 ablation arms (issue 43): train.py with only some of its FP8 products in FP8, patched bench-side, no switch.

    python bench/fp8_arms.py --arm=fp8_no_wgrad [--probe=1,250,500 --probe_out=P.json] -- <train.py arguments>
    python bench/fp8_arms.py --selftest [--triton]  # every arm on a tiny model: which products ran in FP8 (below)

bench/fidelity.py --arms runs this as its train.py subprocess: it patches, then runs train.py here as __main__. A
product runs in FP8 iff the arm keeps FP8 on for its module AND for its kind: fwd (y = x W^T), dgrad (dx = dy W),
wgrad (dW = dy^T x). The lm_head's logits are bf16 in every arm; its dgrad (dh = G W) and wgrad (dW = G^T h)
follow the head flag and the kinds. Every product not in FP8 is the bf16 product the model makes with fp8 off.
ARMS lists the arms; "a+b" applies both (fp8_mlp_only+fp8_no_wgrad). What is patched:
  model.Llama.set_fp8        wrapped: then each block's self_attn.fp8 / mlp.fp8 and Llama.fp8 (the head) per arm
  kernels.fp8_linears        -> _Products, an autograd Function making each product either with the kernels' own
                             FP8 functions (CUDA: kernels/fp8.py quantize + forward_gemm / backward_gemms; CPU:
                             kernels/reference.py fp8_quantize + fp8_mm / fp8_mm_sum) or in bf16, where the arm
                             splits the kinds or probes; else the kernels' own fp8_linears
  kernels.glu                fp8 with down, routed as above: h = glu(gate, up) stored, then _Products(h, down) (the
                             fused kernel quantizes h as it would be stored: the same codes)
  kernels.linear_cross_entropy  head dgrad and wgrad differing: called twice, once differentiable in h only
                             (fp8_grads = the arm's dgrad), once in W only (= its wgrad); the loss is the first's
  model.Llama.forward        counts the training steps (forwards with grad: grad_accum=1, as bench/fidelity.py
                             runs) for --probe; prints the peak GPU memory (of the steps not probed) after step 20
                             and at each evaluation
So an arm with every kind in FP8 and no probe runs the kernels untouched ("fp8" is train.py --fp8=True exactly).
--probe=S,..: at those steps every FP8 product (the head's two too) is made both ways and in fp64, and appended to
--probe_out (JSON, written at the next forward): ||P - P64|| / ||P64|| of the FP8 product (fp8), of the bf16 one
(bf16) and of the exact sum of the FP8 operands' products (exact: fp8 minus it = _scaled_mm's accumulation and
bf16 output), the fractions of nonzero operand values coded 0 (a_zero, b_zero) or subnormal (a_sub, b_sub); a is
the 1 x 128-scaled operand (x, dy, dy^T, G, G^T), b the 128 x 128 one (W, W^T, x^T, h^T). The head's on <= 4,096
of the step's tokens. Probing stores each FP8 Linear's input in bf16 (as do split arms): more memory, same values.
--selftest: each product of _Products, the GLU route and the head split against the kernels' own (bit for bit),
then every arm on a tiny model: the flags set, which (module, kind) ran in FP8 or bf16, and the equalities the arms
imply (equal forward -> equal loss; equal backward chain -> equal embedding and norm gradients; ...). On CUDA all of
it on the Triton path; on the CPU the reference's, or with --triton (TRITON_INTERPRET=1) the first part on Triton's.
"""
import json
import os
import runpy
import sys
from collections import Counter
from dataclasses import dataclass, fields

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kernels  # noqa: E402
from kernels import reference  # noqa: E402
from model import Llama, LlamaConfig  # noqa: E402

HEAD_PROBE_TOKENS = 4096  # the head's probe: G of at most this many counted tokens (G is tokens x vocab)


@dataclass(frozen=True)
class Arm:
    fp8: bool = True  # train.py --fp8=True at all
    attn: bool = True  # q/k/v/o in FP8
    mlp: bool = True  # gate/up/down in FP8
    edges: bool = True  # the first and the last block in FP8
    head: bool = True  # the lm_head's gradient products in FP8
    fwd: bool = True  # the kinds of product in FP8, in every module that is
    dgrad: bool = True
    wgrad: bool = True


ARMS = {  # name: (arm, label)
    "bf16": (Arm(fp8=False), "bf16 Linears"),
    "fp8": (Arm(), "FP8 (--fp8=True)"),
    "fp8_attn_only": (Arm(mlp=False), "FP8 q/k/v/o + head grads, MLP bf16"),
    "fp8_mlp_only": (Arm(attn=False), "FP8 MLP + head grads, attention bf16"),
    "fp8_no_edges": (Arm(edges=False), "FP8, first+last block bf16"),
    "fp8_no_wgrad": (Arm(wgrad=False), "FP8 fwd+dgrad (wgrad bf16)"),
    "fp8_no_dgrad": (Arm(dgrad=False), "FP8 fwd+wgrad (dgrad bf16)"),
    "fp8_fwd_only": (Arm(dgrad=False, wgrad=False), "FP8 forward only"),
    "fp8_no_head": (Arm(head=False), "FP8 blocks, lm_head grads bf16"),
}


def arm_of(name):
    """The Arm of an ARMS name, or of names joined by '+' (each one's changes from Arm() applied in turn)."""
    changes = {}
    for part in name.split("+"):
        if part not in ARMS:
            raise ValueError(f"arm {part!r}: expected one of {', '.join(ARMS)} (or several joined by '+')")
        arm = ARMS[part][0]
        changes.update({f.name: getattr(arm, f.name) for f in fields(Arm)
                        if getattr(arm, f.name) != getattr(Arm(), f.name)})
    return Arm(**changes)


def label_of(name):
    return " + ".join(ARMS[part][1] for part in name.split("+"))


class _State:
    """What the patches read: the arm, whether FP8 Linears go through _Products, the probe, the step count."""
    arm, products, split_head = Arm(), False, False
    probe_steps, probe_out = frozenset(), None
    step, probing, memory_at, peaks = 0, False, 0, (0, 0)
    records, unsaved, names, calls = [], False, {}, Counter()


S = _State()
ORIG = {}  # the functions the patches replace


def configure(arm, probe_steps=(), probe_out=None, force_products=False):
    """Set the arm (and probe) for the models made from now on; install() the patches first."""
    S.arm, S.probe_steps, S.probe_out = arm, frozenset(probe_steps), probe_out
    S.products = arm.fp8 and (not (arm.fwd and arm.dgrad and arm.wgrad) or bool(probe_steps) or force_products)
    S.split_head = arm.fp8 and arm.head and arm.dgrad != arm.wgrad
    S.step, S.probing, S.memory_at, S.peaks, S.records, S.unsaved, S.calls = 0, False, 0, (0, 0), [], False, Counter()


def install():
    """Patch model.Llama and kernels (once; each patch reads S, and passes through where the arm needs nothing)."""
    if ORIG:
        return
    ORIG.update(set_fp8=Llama.set_fp8, forward=Llama.forward, fp8_linears=kernels.fp8_linears, glu=kernels.glu,
                lce=kernels.linear_cross_entropy)
    Llama.set_fp8, Llama.forward = _set_fp8, _forward
    kernels.fp8_linears, kernels.glu, kernels.linear_cross_entropy = _fp8_linears, _glu, _linear_cross_entropy


# ---------------------------------------------------------------------------------------------- the patches
def _set_fp8(self, on=True):
    ORIG["set_fp8"](self, on)
    S.names = {id(p): name.removesuffix(".weight") for name, p in self.named_parameters()}
    if on:
        arm, n = S.arm, len(self.layers)
        for i, layer in enumerate(self.layers):
            block = arm.edges or 0 < i < n - 1
            layer.self_attn.fp8, layer.mlp.fp8 = block and arm.attn, block and arm.mlp
        self.fp8 = arm.head and (arm.dgrad or arm.wgrad)  # (the head has no FP8 forward)


def _forward(self, *args, **kwargs):
    if torch.is_grad_enabled():  # a training step (train.py evaluates under no_grad)
        _save_probe()
        S.step += 1
        S.probing = S.step in S.probe_steps  # (stays on through this step's backward)
        if S.probing and _cuda():
            S.peaks = _peaks()
        if S.step == 21:
            _print_memory()
    else:
        S.probing = False
        _save_probe()
        if S.step and S.memory_at != S.step:  # the first evaluation after training steps
            _print_memory()
    return ORIG["forward"](self, *args, **kwargs)


def _cuda():
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _peaks():
    """(allocated, reserved) peak bytes of the steps so far, the probed ones left out (_save_probe resets the peaks
    after them)."""
    return tuple(max(a, b) for a, b in zip(S.peaks, (torch.cuda.max_memory_allocated(),
                                                     torch.cuda.max_memory_reserved())))


def _print_memory():
    S.memory_at = S.step
    if _cuda():
        allocated, reserved = _peaks()
        print(f"fp8_arms: after step {S.step}: peak GPU memory {allocated / 1e9:.2f} GB allocated, "
              f"{reserved / 1e9:.2f} GB reserved (probed steps not counted)", flush=True)


def _fp8_linears(x, weights):
    return _Products.apply(x, *weights) if S.products else ORIG["fp8_linears"](x, weights)


def _glu(gate, up, activation="silu", down=None, fp8=False):
    if not (fp8 and down is not None and S.products):
        return ORIG["glu"](gate, up, activation, down, fp8)
    return _Products.apply(ORIG["glu"](gate, up, activation), down)[0].to(gate.dtype)


def _linear_cross_entropy(h, weight, labels, fp8_grads=False):
    grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    if grad and S.probing and S.arm.fp8:
        _probe_head(h, weight, labels)
    if not (grad and fp8_grads and S.split_head):
        if grad:
            _log(["lm_head"], "dgrad", fp8_grads)
            _log(["lm_head"], "wgrad", fp8_grads)
        return ORIG["lce"](h, weight, labels, fp8_grads)
    _log(["lm_head"], "dgrad", S.arm.dgrad)
    _log(["lm_head"], "wgrad", S.arm.wgrad)
    loss, n_valid = ORIG["lce"](h, weight.detach(), labels, S.arm.dgrad)  # its gradient: dh only
    loss_w, _ = ORIG["lce"](h.detach(), weight, labels, S.arm.wgrad)  # dW only
    return loss + (loss_w - loss_w.detach()), n_valid  # the value: `loss`'s exactly (x - x = 0)


def _log(names, kind, fp8):
    for name in names:
        S.calls[name, kind, "fp8" if fp8 else "bf16"] += 1


# --------------------------------------------------------------------- the three products, either way
def _fwd8(rows, weights, dtype, triton):
    if triton:  # kernels/fp8.py _FP8Linears.forward's products
        from kernels import fp8
        x_rows = fp8.quantize(rows, rows=1)[0]
        return [fp8.forward_gemm(x_rows, w, rows.shape[0]).to(dtype) for w in weights]
    x_rows = reference.fp8_quantize(rows)  # kernels/reference.py _FP8Linears.forward's
    return [reference.fp8_mm(*x_rows, *reference.fp8_quantize(w, reference.FP8_BLOCK)).to(dtype) for w in weights]


def _dgrad8(dys, weights, x_dtype, triton):
    if triton:  # dx = [dy_1 .. dy_n] [W_1; ..; W_n], one product (backward_gemms)
        from kernels import fp8
        return fp8.backward_gemms(dys, weights, None, x_dtype, True, [False] * len(weights))[0]
    return reference.fp8_mm_sum([(*reference.fp8_quantize(dy), *reference.fp8_quantize(w.t(), reference.FP8_BLOCK))
                                 for dy, w in zip(dys, weights)], x_dtype)


def _wgrad8(dys, rows, weights, need, triton):
    if triton:
        from kernels import fp8
        x_cols = fp8.quantize(rows, cols=fp8.BLOCK)[1]  # (forward keeps these codes; here made from the kept x)
        return fp8.backward_gemms(dys, weights, x_cols, rows.dtype, False, need)[1]
    x_cols = reference.fp8_quantize(rows.t(), reference.FP8_BLOCK)
    return [reference.fp8_mm(*reference.fp8_quantize(dy.t()), *x_cols, w.dtype) if n else None
            for dy, w, n in zip(dys, weights, need)]


def _fwd16(rows, weights, dtype):  # F.linear in the dtype the model's own Linears compute in (autocast's)
    with torch.autocast(rows.device.type, enabled=False):
        return [F.linear(rows.to(dtype), w.to(dtype)) for w in weights]


def _dgrad16(dys, weights, x_dtype, dtype):  # what autograd makes of them: one dx per Linear, summed
    with torch.autocast(dys[0].device.type, enabled=False):
        dx = None
        for dy, w in zip(dys, weights):
            part = dy.to(dtype) @ w.to(dtype)
            dx = part if dx is None else dx + part
        return dx.to(x_dtype)


def _wgrad16(dys, rows, weights, need, dtype):
    with torch.autocast(rows.device.type, enabled=False):
        return [(dy.to(dtype).t() @ rows.to(dtype)).to(w.dtype) if n else None for dy, w, n in zip(dys, weights, need)]


class _Products(torch.autograd.Function):
    """ys_i = x W_i^T for weights that share x (kernels.fp8_linears' contract), each of the three products in FP8 or
    bf16 as S.arm says (and both ways, plus fp64, at a probed step). Keeps x itself (bf16) for backward, where the
    kernels' FP8 path keeps its column codes: the same codes, made in backward."""

    @staticmethod
    def forward(ctx, x, *weights):
        arm, probing = S.arm, S.probing
        rows = kernels.as_rows(x)
        triton = kernels._use_triton(rows)
        dtype = reference.fp8_out_dtype(x)  # the dtype F.linear would give (autocast's)
        names = [S.names.get(id(w), f"?{tuple(w.shape)}") for w in weights]
        ys8 = _fwd8(rows, weights, dtype, triton) if arm.fwd or probing else None
        ys16 = _fwd16(rows, weights, dtype) if probing or not arm.fwd else None
        if probing:
            for name, w, y8, y16 in zip(names, weights, ys8, ys16):
                _record(name, "fwd", y8, y16, [(rows, w)])
        _log(names, "fwd", arm.fwd)
        ctx.save_for_backward(rows, *weights)
        ctx.meta = (x.shape, x.dtype, dtype, triton, probing, names)
        return tuple(y.view(*x.shape[:-1], w.shape[0]) for y, w in zip(ys8 if arm.fwd else ys16, weights))

    @staticmethod
    def backward(ctx, *dys):
        rows, *weights = ctx.saved_tensors
        x_shape, x_dtype, dtype, triton, probing, names = ctx.meta
        arm = S.arm
        dys = [kernels.as_rows(dy) for dy in dys]
        dx = None
        if ctx.needs_input_grad[0]:
            dx8 = _dgrad8(dys, weights, x_dtype, triton) if arm.dgrad or probing else None
            dx16 = _dgrad16(dys, weights, x_dtype, dtype) if probing or not arm.dgrad else None
            if probing:
                _record("+".join(names), "dgrad", dx8, dx16, [(dy, w.t()) for dy, w in zip(dys, weights)])
            _log(names, "dgrad", arm.dgrad)
            dx = (dx8 if arm.dgrad else dx16).view(x_shape)
        need = list(ctx.needs_input_grad[1:])
        dws = [None] * len(weights)
        if any(need):
            dws8 = _wgrad8(dys, rows, weights, need, triton) if arm.wgrad or probing else None
            dws16 = _wgrad16(dys, rows, weights, need, dtype) if probing or not arm.wgrad else None
            if probing:
                for name, dy, n, dw8, dw16 in zip(names, dys, need, dws8, dws16):
                    if n:
                        _record(name, "wgrad", dw8, dw16, [(dy.t(), rows.t())])
            _log([name for name, n in zip(names, need) if n], "wgrad", arm.wgrad)
            dws = dws8 if arm.wgrad else dws16
        return dx, *dws


# ----------------------------------------------------------------------------------------------- the probe
def _dequantized(t, block_rows):
    """(the values of t's e4m3 codes times their scales in fp64, the codes as fp64): reference.fp8_quantize's
    blocks (1 x 128 or 128 x 128), the same codes as the Triton quantizer's (tests/test_fp8.py)."""
    codes, scales = reference.fp8_quantize(t, block_rows)
    R, C = codes.shape
    s = scales.t() if block_rows == 1 else scales.repeat_interleave(reference.FP8_BLOCK, 0)[:R]
    codes = codes.float().double()
    return codes * s.repeat_interleave(reference.FP8_BLOCK, 1)[:, :C].double(), codes


def _rel(p, ref):
    norm = ref.norm().item()
    return None if p is None or norm == 0 else ((p.double() - ref).norm() / norm).item()


def _record(name, kind, p8, p16, pairs):
    """One probe record of a product P = sum_i a_i b_i^T (a_i: 1 x 128 blocks, b_i: 128 x 128), made as p8 (FP8) and
    p16 (bf16): errors against the fp64 product, and the exact fp64 sum of the FP8 codes' products."""
    with torch.no_grad(), torch.autocast(pairs[0][0].device.type, enabled=False):
        ref = exact = None
        counts = Counter()
        for a, b in pairs:
            a, b = a.contiguous(), b.contiguous()
            r = a.double() @ b.double().t()
            ref = r if ref is None else ref + r
            del r
            qa, ca = _dequantized(a, 1)
            qb, cb = _dequantized(b, reference.FP8_BLOCK)
            e = qa @ qb.t()
            exact = e if exact is None else exact + e
            for side, t, c in (("a", a, ca), ("b", b, cb)):
                nonzero = t != 0
                counts[side] += int(nonzero.sum())
                counts[side + "_zero"] += int((nonzero & (c == 0)).sum())
                counts[side + "_sub"] += int((nonzero & (c.abs() < 2.0**-6)).sum())
            del qa, qb, e, ca, cb
        rec = dict(step=S.step, name=name, kind=kind, fp8=_rel(p8, ref), exact=_rel(exact, ref), bf16=_rel(p16, ref),
                   rms=ref.norm().item() / ref.numel() ** 0.5)
        for key in ("a_zero", "a_sub", "b_zero", "b_sub"):
            rec[key] = counts[key] / max(counts[key[0]], 1)
    S.records.append(rec)
    S.unsaved = True


def _fp8_ab(a, b, out_dtype, triton):
    """a b^T with a's codes 1 x 128 and b's 128 x 128 (a, b contiguous), as the head's kernel makes dh and dW."""
    if triton:
        from kernels import fp8
        return fp8.scaled_mm(*fp8.quantize(a, rows=1)[0], *fp8.quantize(b, rows=fp8.BLOCK)[0],
                             out_dtype=out_dtype)[:a.shape[0], :b.shape[0]]
    return reference.fp8_mm(*reference.fp8_quantize(a), *reference.fp8_quantize(b, reference.FP8_BLOCK), out_dtype)


def _probe_head(h, weight, labels):
    """The head's dh = G W and dW = G^T h (kernels/cross_entropy.py's _fp8_pass, as reference._FP8HeadGrads
    simulates it) on the step's first HEAD_PROBE_TOKENS counted tokens, G = softmax(logits) - onehot in the matmul
    dtype, without the loss's 1 / tokens (a factor on G^T's scales)."""
    device = h.device.type
    mm = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
    with torch.no_grad(), torch.autocast(device, enabled=False):
        rows = (labels != -100).nonzero().squeeze(1)[:HEAD_PROBE_TOKENS]
        hh, w = h.detach()[rows].to(mm), weight.detach().to(mm)
        g = reference.logits_grad(hh.float() @ w.float().t(), labels[rows]).to(mm)
        triton = kernels._use_triton(hh)
        wt = w.t().contiguous()
        _record("lm_head", "dgrad", _fp8_ab(g, wt, h.dtype, triton), (g @ w).to(h.dtype), [(g, wt)])
        gt, ht = g.t().contiguous(), hh.t().contiguous()
        _record("lm_head", "wgrad", _fp8_ab(gt, ht, weight.dtype, triton), (gt @ hh).to(weight.dtype), [(gt, ht)])


def _save_probe():
    """After a probed step: its records written, the fp64 memory it took handed back (the runs beside share the GPU)."""
    if S.unsaved and S.probe_out:
        tmp = S.probe_out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(dict(arm=S.arm.__dict__, records=S.records), f)
        os.replace(tmp, S.probe_out)
    if S.unsaved and _cuda():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    S.unsaved = False


# ----------------------------------------------------------------------------------------------- the self test
def _check(ok, what):
    print(f"  {'ok' if ok else 'FAILED'}: {what}", flush=True)
    if not ok:
        raise AssertionError(what)


def _grads(fn, inputs, douts):
    """(outputs, gradients of inputs) of fn(*inputs) for the outputs' gradients douts."""
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    outs = fn(*inputs)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    return [o.detach() for o in outs], torch.autograd.grad(outs, inputs, douts)


def unit_checks(device):
    """_Products, the GLU route and the head split against the kernels' own functions (ORIG) and plain bf16 autograd,
    bit for bit, on the path kernels picks (Triton on CUDA or under kernels._use_triton; else the reference): for
    each split of the kinds, each product is the kernels' FP8 one or the bf16 one, as the arm says."""
    gen = torch.Generator().manual_seed(1)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=torch.bfloat16)
    T, K, F_ = 200, 128, 256
    x, ws = randn(T, K), [randn(n, K, scale=0.05) for n in (128, 64, 64)]
    dys = [randn(T, w.shape[0]) for w in ws]
    fp8_ref = _grads(lambda x, *ws: ORIG["fp8_linears"](x, list(ws)), [x, *ws], dys)
    bf16_ref = [_grads(lambda x, w: F.linear(x, w), [x, w], [dy]) for w, dy in zip(ws, dys)]  # one Linear each
    for dgrad, wgrad in ((True, True), (True, False), (False, True), (False, False)):
        configure(Arm(dgrad=dgrad, wgrad=wgrad), force_products=True)
        (ys, (dx, *dws)) = _grads(lambda x, *ws: _fp8_linears(x, list(ws)), [x, *ws], dys)
        what = f"_Products with dgrad {'fp8' if dgrad else 'bf16'}, wgrad {'fp8' if wgrad else 'bf16'}"
        _check(all(torch.equal(a, b) for a, b in zip(ys, fp8_ref[0])), f"{what}: y = the kernels' FP8 y")
        if dgrad:
            _check(torch.equal(dx, fp8_ref[1][0]), f"{what}: dx (of q, k, v) = the kernels' FP8 dx")
        else:
            one = _grads(lambda x, w: _fp8_linears(x, [w]), [x, ws[0]], dys[:1])[1][0]
            _check(torch.equal(one, bf16_ref[0][1][0]), f"{what}: dx (of one Linear) = bf16 autograd's")
        for i, dw in enumerate(dws):
            want = fp8_ref[1][1 + i] if wgrad else bf16_ref[i][1][1]
            _check(torch.equal(dw, want), f"{what}: dW {i} = {'the kernels FP8' if wgrad else 'bf16 autograd'}'s")
    configure(Arm(), force_products=True)
    gate, up, down, dout = randn(T, F_), randn(T, F_), randn(K, F_, scale=0.05), randn(T, K)
    # (gate and up as outputs of an op, as in the model: the Triton GLU's backward may then write over them)
    fused = _grads(lambda g, u, d: ORIG["glu"](g * 1, u * 1, "silu", d, True), [gate, up, down], [dout])
    mine = _grads(lambda g, u, d: _glu(g * 1, u * 1, "silu", d, True), [gate, up, down], [dout])
    _check(torch.equal(fused[0][0], mine[0][0]) and all(torch.equal(a, b) for a, b in zip(fused[1], mine[1])),
           "the GLU through _Products (h stored, then quantized) = the fused FP8 GLU: out, dgate, dup, dW_down")
    V = 512
    h, w = randn(T, K), randn(V, K, scale=0.05)
    labels = torch.randint(0, V, (T,), generator=gen).to(device)
    labels[::7] = -100
    ce = {fp8: _grads(lambda h, w: ORIG["lce"](h, w, labels, fp8)[0], [h, w], None) for fp8 in (True, False)}
    for dgrad in (True, False):
        configure(Arm(dgrad=dgrad, wgrad=not dgrad))
        loss, (dh, dw) = _grads(lambda h, w: _linear_cross_entropy(h, w, labels, True)[0], [h, w], None)
        _check(torch.equal(loss[0], ce[True][0][0]) and torch.equal(dh, ce[dgrad][1][0])
               and torch.equal(dw, ce[not dgrad][1][1]), f"the head split, dgrad {'fp8' if dgrad else 'bf16'} and "
               f"wgrad {'bf16' if dgrad else 'fp8'}: the loss, dh and dW of the kernels' calls")
    a, b = randn(T, K), randn(96, K)
    ref = reference.fp8_mm(*reference.fp8_quantize(a), *reference.fp8_quantize(b, reference.FP8_BLOCK))
    got = _fp8_ab(a, b, torch.bfloat16, kernels._use_triton(a))
    _check(torch.equal(got, ref) if device == "cpu" else _rel(got, ref.double()) < 2e-3,
           "the probe's FP8 product (the head's) = the reference's simulation")


def selftest(triton=False):
    """unit_checks, then every arm on a tiny Llama (4 blocks; one batch forward and backward, bf16 weights, autocast
    on CUDA): the flags each sets, which products ran in FP8 (S.calls), and what the arms imply: a run of the same
    forward has the same loss; of the same backward chain (every dgrad and the head's dh made alike), the same
    embedding and norm gradients; of the same dy and x, the same weight gradient. Prints each check; raises on the
    first that fails. On CUDA the Triton path runs, else kernels/reference.py; triton on the CPU (TRITON_INTERPRET=1):
    the unit checks on the Triton path (the interpreter is too slow for the model)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if triton and device == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("error: --selftest --triton on the CPU needs TRITON_INTERPRET=1")
        kernels._use_triton = lambda x: True  # as tests/test_fp8.py does: the Triton path on CPU tensors
    install()
    on = f"{device} ({'Triton' if triton or device == 'cuda' else 'reference'} path)"
    print(f"selftest on {on}: the products", flush=True)
    unit_checks(device)
    if triton and device == "cpu":
        print("selftest passed (unit checks only)")
        return
    cfg = LlamaConfig(dim=128, n_layers=4, n_heads=2, n_kv_heads=1, ffn_dim=256, vocab_size=512, max_seq_len=128)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (320,), generator=gen).to(device)
    labels = torch.roll(tokens, -1)
    cu = torch.tensor([0, 100, 228, 320], dtype=torch.int32, device=device)
    n = cfg.n_layers

    def run(name, force=False, probe=False):
        configure(arm_of(name), probe_steps=(1,) if probe else (), force_products=force)
        torch.manual_seed(0)
        model = Llama(cfg).to(device=device, dtype=torch.bfloat16)
        if S.arm.fp8:
            model.set_fp8(True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = model(tokens, cu, labels=labels)
        loss.backward()
        _save_probe()
        return dict(loss=loss.detach().double(), model=model, calls=Counter(S.calls), records=list(S.records),
                    grads={k: p.grad.double() for k, p in model.named_parameters()})

    names = ["fp8", "bf16", "fp8_no_wgrad", "fp8_no_dgrad", "fp8_fwd_only", "fp8_no_head",
             "fp8_no_head+fp8_no_dgrad", "fp8_no_head+fp8_no_wgrad", "fp8_attn_only", "fp8_mlp_only", "fp8_no_edges"]
    r = {name: run(name) for name in names}
    r["fp8 again"], r["fp8 via _Products"], r["fp8 probed"] = run("fp8"), run("fp8", force=True), run("fp8", probe=True)
    rerun = max(_rel(g, r["fp8"]["grads"][k]) or 0.0 for k, g in r["fp8 again"]["grads"].items())
    tol = 0.0 if rerun == 0 and torch.equal(r["fp8 again"]["loss"], r["fp8"]["loss"]) else 10 * rerun + 1e-6
    print(f"selftest on {on}: the arms on a tiny model; fp8 run twice "
          f"{'bit for bit equal' if tol == 0 else f'differs by {rerun:.1e}: equal below {tol:.1e}'}", flush=True)
    lin = [k for k in r["fp8"]["grads"] if k.endswith("_proj.weight")] + ["lm_head.weight"]
    chain = [k for k in r["fp8"]["grads"] if "norm" in k or k == "embed_tokens.weight"]

    def diff(a, b, key=None):
        return (_rel(a["loss"], b["loss"]) if key is None else _rel(a["grads"][key], b["grads"][key])) or 0.0

    def same(a, b, keys, what):
        worst = max(diff(r[a], r[b], k) for k in keys)
        _check(worst <= tol, f"{a} = {b}: {what} (largest difference {worst:.1e})")

    def differ(a, b, keys, what):
        least = min(diff(r[a], r[b], k) for k in keys)
        _check(least > tol, f"{a} != {b}: {what} (smallest difference {least:.1e})")

    same("fp8", "fp8 via _Products", [None, *r["fp8"]["grads"]], "_Products (all FP8) is the kernels' path: loss, "
         "every gradient")
    same("fp8", "fp8 probed", [None, *r["fp8"]["grads"]], "probing changes nothing")
    differ("fp8", "bf16", [None], "the loss")
    for name in ("fp8_no_wgrad", "fp8_no_dgrad", "fp8_fwd_only", "fp8_no_head"):
        same("fp8", name, [None], "the loss (the same FP8 forward; the head's logits bf16 in both)")
    same("fp8", "fp8_no_wgrad", chain, "embedding and norm gradients (dgrad and dh FP8 in both)")
    differ("fp8", "fp8_no_wgrad", lin, "every Linear's weight gradient and the head's (wgrad bf16)")
    same("fp8", "fp8_no_dgrad", ["lm_head.weight"], "the head's dW (the same G and h, FP8 in both)")
    differ("fp8", "fp8_no_dgrad", chain, "the embedding and norm gradients (dgrad bf16)")
    differ("fp8", "fp8_no_head", ["lm_head.weight", "norm.weight"], "the head's dW and the final norm's (dh)")
    same("fp8_fwd_only", "fp8_no_head", ["lm_head.weight"], "the head's dW (bf16 in both)")
    same("fp8_fwd_only", "fp8_no_head+fp8_no_dgrad", chain, "embedding and norm gradients (every dgrad and dh bf16)")
    differ("fp8_fwd_only", "fp8_no_head+fp8_no_dgrad", lin[:-1], "every block Linear's weight gradient (wgrad)")
    last = f"layers.{n - 1}.mlp."
    same("fp8_fwd_only", "fp8_no_head+fp8_no_wgrad", [last + "down_proj.weight"], "the last down_proj's dW (the same "
         "dy and h, bf16 in both)")
    differ("fp8_fwd_only", "fp8_no_head+fp8_no_wgrad", [last + "gate_proj.weight", last + "up_proj.weight"],
           "the last gate/up dW (their dy through the down projection's dgrad: FP8 vs bf16)")
    same("fp8_no_head", "fp8_no_head+fp8_no_wgrad", chain, "embedding and norm gradients (dgrad FP8 in both)")
    differ("fp8", "bf16", lin, "every weight gradient")

    kinds = {"fp8": (1, 1, 1, 1), "fp8_no_wgrad": (1, 1, 0, 1), "fp8_no_dgrad": (1, 0, 1, 1),
             "fp8_fwd_only": (1, 0, 0, 0), "fp8_no_head": (1, 1, 1, 0)}
    for name, (fwd, dgrad, wgrad, head) in kinds.items():
        calls = r["fp8 via _Products" if name == "fp8" else name]["calls"]
        seen = {(kind, mode) for (module, kind, mode) in calls if module != "lm_head"}
        mode = {1: "fp8", 0: "bf16"}
        want = set() if name == "fp8_no_head" else {("fwd", mode[fwd]), ("dgrad", mode[dgrad]), ("wgrad", mode[wgrad])}
        _check(seen == want, f"{name}: the block Linears ran " + (f"fwd {mode[fwd]}, dgrad {mode[dgrad]}, wgrad "
               f"{mode[wgrad]}" if want else "the kernels' own FP8 path (not _Products)") + f" ({sorted(seen)})")
        want_head = {("dgrad", mode[dgrad and head]), ("wgrad", mode[wgrad and head])}
        got_head = {(kind, m) for (module, kind, m) in calls if module == "lm_head"}
        _check(got_head == want_head, f"{name}: the head's products {sorted(got_head)}")
        modules = {module for (module, kind, m) in calls if kind == "wgrad" and module != "lm_head"}
        if want:
            _check(len(modules) == 7 * n, f"{name}: every block Linear went through _Products ({len(modules)} of "
                   f"{7 * n})")
    records = r["fp8 probed"]["records"]
    got = Counter((rec["kind"], rec["name"] == "lm_head") for rec in records)
    _check(got == {("fwd", False): 7 * n, ("dgrad", False): 4 * n, ("wgrad", False): 7 * n, ("dgrad", True): 1,
                   ("wgrad", True): 1}, f"the probe recorded every product once ({dict(got)})")
    _check(all(0 < rec["fp8"] < 0.2 and rec["bf16"] < rec["fp8"] and rec["exact"] <= 0.2 for rec in records),
           f"the probe's errors: FP8 {min(x['fp8'] for x in records):.3f}-{max(x['fp8'] for x in records):.3f}, "
           f"bf16 up to {max(x['bf16'] for x in records):.4f}")

    def flags(name):
        m = r[name]["model"]
        return [(layer.self_attn.fp8, layer.mlp.fp8) for layer in m.layers], m.fp8

    _check(flags("fp8_attn_only") == ([(True, False)] * n, True), "fp8_attn_only: q/k/v/o FP8, MLP bf16, head FP8")
    _check(flags("fp8_mlp_only") == ([(False, True)] * n, True), "fp8_mlp_only: MLP FP8, attention bf16")
    _check(flags("fp8_no_edges") == ([(False, False)] + [(True, True)] * (n - 2) + [(False, False)], True),
           "fp8_no_edges: blocks 0 and n-1 bf16, the others FP8")
    _check(flags("fp8_no_head")[1] is False and flags("fp8_fwd_only")[1] is False,
           "no head FP8 in fp8_no_head, fp8_fwd_only")
    for name in ("fp8_attn_only", "fp8_mlp_only", "fp8_no_edges"):
        differ(name, "fp8", [None], "the loss")
        differ(name, "bf16", [None], "the loss")
    print("selftest passed")


def main():
    args = sys.argv[1:]
    if "--selftest" in args:
        return selftest(triton="--triton" in args)
    if "--" not in args:
        sys.exit("usage: python bench/fp8_arms.py --arm=NAME [--probe=S1,S2 --probe_out=FILE] -- <train.py args>")
    cut = args.index("--")
    ours, train_args = dict(a.lstrip("-").split("=", 1) for a in args[:cut]), args[cut + 1:]
    if set(ours) - {"arm", "probe", "probe_out"} or "arm" not in ours:
        sys.exit(f"error: fp8_arms.py takes --arm=NAME, --probe=S1,S2, --probe_out=FILE before '--', not {args[:cut]}")
    arm = arm_of(ours["arm"])
    if arm.fp8 != ("--fp8=True" in train_args):
        sys.exit(f"error: arm {ours['arm']} {'needs' if arm.fp8 else 'takes no'} --fp8=True among train.py's args")
    probe = [int(s) for s in ours.get("probe", "").split(",") if s]
    if probe and not ours.get("probe_out"):
        sys.exit("error: --probe needs --probe_out=FILE")
    install()
    configure(arm, probe, ours.get("probe_out"))
    print(f"fp8_arms: arm {ours['arm']}: {arm}; FP8 Linears through "
          f"{'bench/fp8_arms.py _Products' if S.products else 'the kernels untouched'}"
          f"{f'; head split (dgrad {arm.dgrad}, wgrad {arm.wgrad})' if S.split_head else ''}"
          f"{f'; probe at steps {probe}' if probe else ''}", flush=True)
    sys.argv = [os.path.join(ROOT, "train.py"), *train_args]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
