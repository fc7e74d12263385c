"""Which 8-bit code and block size for Adam's moments: errors measured on a real training run, on the CPU.

    python data/prepare.py --stdlib --out data/cache/stdlib      # once
    python bench/adamw8bit_codes.py [--steps 300]                  # ~15 minutes on 2 CPU cores

A small Llama (train.py's default shape: dim 192, 4 layers, byte tokens) trains on the stdlib corpus with fp32
weights and torch AdamW (fp32 moments): the reference. Three measurements:
  1. one-shot, at steps 100 and 300: the reference's own m and sqrt(v) coded and decoded, each alone (the other
     exact): rel. error of the Adam direction, ||u' - u|| / ||u|| over all parameters with u = m_hat / (sqrt(v_hat)
     + eps). It is the error that matters: u is about as large for small gradients as for large ones, so a code
     must keep the small elements of a block relatively precise. Per code and block size.
  2. multi-step: variants with coded moments (fp32 weights) take the reference's gradients at every step (teacher
     forcing), so only the moments differ; after N steps, the rel. error of their displacement from the initial
     weights against the reference's (all parameters; the worst tensor), and the val loss of their weights.
  3. synthetic: one-shot error when the scales inside a block spread: per element sigma = exp(spread * N(0, 1)),
     sqrt(v) = sigma, m = sigma * N(0, 0.3) (Adam directions ~0.3), 2^20 elements, blocks of 256.
Codes (8 bits; m signed, 127 levels per sign; sqrt(v) 255 levels; a block scale = its max |x|): "lin" linear,
"pow2" / "pow4" the companded codes of kernels/reference.py (|x / max|^(1/p) coded linearly), "dyn" the dynamic
map of Dettmers et al. 2021 (bitsandbytes; torchao's 8-bit AdamW), which codes v itself (not sqrt v), found by
nearest-entry search. For sqrt(v) every code has the guard (a nonzero value keeps a nonzero code).
"""
import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import torch  # noqa: E402

from data.loader import PackedLoader, eval_batches  # noqa: E402
from kernels import reference  # noqa: E402
from model import Llama, LlamaConfig  # noqa: E402

BLOCKS = (64, 128, 256, 2048)
CODES = ("lin", "pow2", "pow4", "dyn")
BETAS, EPS = (0.9, 0.95), 1e-8


def dynamic_map(signed):
    """The 256 values of the dynamic code (exponent 10^-6 .. 10^0, then a linear fraction with the bits left):
    written from its description in Dettmers et al. 2021, 'Block-wise quantization' / bitsandbytes."""
    values = [0.0, 1.0]
    for i in range(7):  # decades 10^-6 .. 10^0; the finer, the more fraction levels
        n = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
        edges = torch.linspace(0.1, 1, n)
        means = ((edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - 6)).tolist()
        values += means + ([-x for x in means] if signed else [])
    return torch.tensor(sorted(values))


DYN = {True: dynamic_map(True), False: dynamic_map(False)}


def code_decode(x, code, block, signed):
    """x (fp32) coded block-wise with `code` and decoded again."""
    top = 127 if signed else 255
    if code == "dyn":
        if not signed:  # the dynamic code stores v, not sqrt(v)
            x = x * x
        blocks = reference._blocks(x, block)
        scale = blocks.abs().amax(1, keepdim=True)
        a = blocks / torch.where(scale > 0, scale, 1.0)
        table = DYN[signed]
        i = torch.searchsorted(table, a.contiguous()).clamp(1, len(table) - 1)
        lo, hi = table[i - 1], table[i]
        y = torch.where(a - lo <= hi - a, lo, hi)
        if not signed:
            y = torch.where((y == 0) & (a > 0), table[1], y)  # the guard
        y = (y * scale).view(-1)[:x.numel()].view(x.shape)
        return y if signed else y.sqrt()
    power = {"lin": 1, "pow2": 2, "pow4": 4}[code]
    codes, scale = reference.quantize_blockwise(x, top, power, block)
    if not signed:
        codes = torch.where((codes == 0) & (x > 0), 1, codes)  # the guard
    y = reference.dequantize_blockwise(codes, scale, top, power, block)
    return torch.where(x < 0, -y, y) if signed else y


def one_shot(ms, ss, bc1, bc2):
    """rel. error of the direction with m alone coded, then sqrt(v) alone, per block size and code."""
    denom = [s / math.sqrt(bc2) + EPS for s in ss]
    u_norm = math.sqrt(sum((m / bc1 / d).double().pow(2).sum().item() for m, d in zip(ms, denom)))
    print(f"  {'block':>6s} " + " ".join(f"{'m ' + c:>8s}" for c in CODES) + " | " +
          " ".join(f"{'sqrt(v) ' + c:>12s}" for c in CODES))
    for block in BLOCKS:
        err_m = [math.sqrt(sum(((code_decode(m, c, block, True) - m) / bc1 / d).double().pow(2).sum().item()
                               for m, d in zip(ms, denom))) / u_norm for c in CODES]
        err_s = [math.sqrt(sum((m / bc1 / (code_decode(s, c, block, False) / math.sqrt(bc2) + EPS) -
                                m / bc1 / d).double().pow(2).sum().item()
                               for m, s, d in zip(ms, ss, denom))) / u_norm for c in CODES]
        print(f"  {block:6d} " + " ".join(f"{e:8.4f}" for e in err_m) + " | " + " ".join(f"{e:12.4f}" for e in err_s))


def synthetic():
    n, block = 1 << 20, 256
    gen = torch.Generator().manual_seed(0)
    print(f"  {'spread':>6s} " + " ".join(f"{'m ' + c:>8s}" for c in CODES) + " | " +
          " ".join(f"{'sqrt(v) ' + c:>12s}" for c in CODES))
    for spread in (0.5, 1.0, 2.0, 3.0):
        s = torch.exp(spread * torch.randn(n, generator=gen))
        m = s * 0.3 * torch.randn(n, generator=gen)
        u = m / s
        err_m = [(((code_decode(m, c, block, True) - m) / s).norm() / u.norm()).item() for c in CODES]
        err_s = [((m / code_decode(s, c, block, False) - u).norm() / u.norm()).item() for c in CODES]
        print(f"  {spread:6.1f} " + " ".join(f"{e:8.4f}" for e in err_m) + " | " +
              " ".join(f"{e:12.4f}" for e in err_s))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--data_dir", default="data/cache/stdlib")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    torch.manual_seed(0)
    print("synthetic blocks of 256, scales spread log-normally: rel. error of the Adam direction")
    synthetic()
    cfg = LlamaConfig(dim=192, n_layers=4, n_heads=3, n_kv_heads=1, ffn_dim=512, vocab_size=512, max_seq_len=512,
                      tie_embeddings=True)
    model = Llama(cfg)
    params = list(model.parameters())
    names = [name for name, _ in model.named_parameters()]
    loader = iter(PackedLoader(args.data_dir, "train", 2048, 512, seed=0, vocab_size=512))
    val = eval_batches(args.data_dir, "val", 4096, 512, max_batches=2, vocab_size=512)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=BETAS, eps=EPS, weight_decay=0.0)
    w0 = [p.detach().clone() for p in params]
    variants = [(c, c, 256) for c in CODES] + [("pow4", "pow4", 64), ("pow4", "pow4", 2048), ("pow2", "pow2", 64)]
    states = [dict(w=[p.detach().clone() for p in params], m=[torch.zeros_like(p) for p in params],
                   s=[torch.zeros_like(p) for p in params]) for _ in variants]

    @torch.no_grad()
    def val_loss(weights):
        saved = [p.detach().clone() for p in params]
        for p, w in zip(params, weights):
            p.copy_(w)
        total = sum(model(b.tokens, b.cu_seqlens, b.max_seqlen, b.positions, b.labels, reduction="sum")[0].item()
                    for b in val)
        for p, w in zip(params, saved):
            p.copy_(w)
        return total / sum(b.n_loss_tokens for b in val)

    t0 = time.time()
    for step in range(1, args.steps + 1):
        batch = next(loader)
        loss_sum, n = model(batch.tokens, batch.cu_seqlens, batch.max_seqlen, batch.positions, batch.labels,
                            reduction="sum")
        (loss_sum / n).backward()
        lr = args.lr * min(1.0, step / 30)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        bc1, bc2 = 1 - BETAS[0] ** step, 1 - BETAS[1] ** step
        with torch.no_grad():
            for (code_m, code_s, block), st in zip(variants, states):
                for i, p in enumerate(params):
                    g = p.grad
                    m = st["m"][i].lerp_(g, 1 - BETAS[0])
                    s = st["s"][i].square().mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1]).sqrt_()
                    st["w"][i].addcdiv_(m, s / math.sqrt(bc2) + EPS, value=-lr / bc1)
                    st["m"][i] = code_decode(m, code_m, block, True)
                    st["s"][i] = code_decode(s, code_s, block, False)
        opt.zero_grad(set_to_none=True)
        if step in (100, args.steps):
            print(f"\nstep {step} (train loss {(loss_sum / n).item():.3f}, {time.time() - t0:.0f} s)")
            print("one-shot: rel. error of the Adam direction, m coded alone | sqrt(v) coded alone")
            ms = [opt.state[p]["exp_avg"] for p in params]
            ss = [opt.state[p]["exp_avg_sq"].sqrt() for p in params]
            one_shot(ms, ss, bc1, bc2)
            ref_disp = [p.detach() - p0 for p, p0 in zip(params, w0)]
            ref_norm = math.sqrt(sum(d.double().pow(2).sum().item() for d in ref_disp))
            print(f"multi-step (teacher-forced): displacement rel. error vs fp32 moments; val loss "
                  f"(fp32 moments: {val_loss([p.detach() for p in params]):.4f})")
            for (code_m, code_s, block), st in zip(variants, states):
                diffs = [(w - p0) - d for w, p0, d in zip(st["w"], w0, ref_disp)]
                errs = [x.double().norm().item() / d.double().norm().item() for x, d in zip(diffs, ref_disp)]
                total = math.sqrt(sum(x.double().pow(2).sum().item() for x in diffs)) / ref_norm
                worst = max(range(len(errs)), key=errs.__getitem__)
                print(f"  m {code_m:4s} sqrt(v) {code_s:4s} block {block:5d}: all {total:.4f}, worst tensor "
                      f"{errs[worst]:.4f} ({names[worst]}), val loss {val_loss(st['w']):.4f}", flush=True)


if __name__ == "__main__":
    main()
