"""The CPU measurement behind kernels/fp8.py's choices: what each FP8 product of a Linear loses, on the tensors
of a real (tiny) training run, and what FP8 does to the loss of that run. Runs on the CPU (the FP8 products are
kernels/reference.py's exact simulation); minutes.

    python bench/fp8_numerics.py [--steps 100] [--grad_accum 1] [--data_dir data/cache/stdlib]
    python bench/fp8_numerics.py --ckpt DIR [--data_dir ...]   # part 1 only, on a trained checkpoint's model

1. Products. The default tiny model of train.py (dim 192, 4 blocks, ffn 512, byte tokens) trains --steps steps in
   fp32 on the stdlib corpus (steps of --grad_accum micro-steps of 4096 tokens); then one micro-batch of 4096
   tokens records, for every block Linear, its input x, weight W and output gradient dy. Each of its three products
   (y = x W^T, dx = dy W, dW = dy^T x) is computed in bf16 (bf16 operands, fp32 sums, bf16 result: what autocast
   does) and in FP8 (our block-scaled recipe), and compared with fp64: relative Frobenius error
   ||out - exact|| / ||exact||, per projection, mean over the blocks. With --ckpt the model is that checkpoint's, in
   fp32 (e.g. bench/fidelity.py --finetune's 183M base: its dims are whole 128-blocks, the tiny model's 192 is one
   and a half), and the micro-batch max(4096, its max_seq_len) val tokens.
2. Training (not with --ckpt). From one initialisation, --steps steps of the same run in fp32, in FP8 (all three
   products), and in FP8 with the weight gradient in bf16 (kernels/reference.FP8_WGRAD = False); train loss (mean of
   the last 50 steps) and val loss at the end.

Measured 2026-12-01 with row-wise scales (`--steps 100 --grad_accum 1`, 52 minutes on a 2-core CPU): BENCHMARKS.md;
training fp32 2.4490 / 2.5907, fp8 2.4791 / 2.6078, fp8 with bf16 dW 2.4269 / 2.5448 (train / val).
"""
import argparse
import copy
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kernels  # noqa: E402
from data.loader import PackedLoader, eval_batches  # noqa: E402
from kernels import reference  # noqa: E402
from checkpoint import load_model  # noqa: E402
from model import Llama, LlamaConfig  # noqa: E402
from optim import Update, make_optimizer  # noqa: E402

# train.py's default run
CFG = dict(dim=192, n_layers=4, n_heads=3, n_kv_heads=1, ffn_dim=512, tie_embeddings=True, rope_theta=10000.0,
           max_seq_len=512)
TOKENS, LR, MIN_LR, WARMUP = 4096, 3e-3, 3e-4, 30
NAMES = ("q", "k", "v", "o", "gate", "up", "down")  # the block Linears: q_proj, ..., down_proj


def lr_at(it, total):
    if it < WARMUP:
        return LR * (it + 1) / WARMUP
    return MIN_LR + 0.5 * (1 + math.cos(math.pi * min(1.0, (it - WARMUP) / max(1, total - WARMUP)))) * (LR - MIN_LR)


def train(model, loader, steps, grad_accum, log_every=50):
    """steps optimizer steps as train.py takes them (AdamW, clipping 1.0, warmup + cosine); the train losses."""
    optimizer = make_optimizer("adamw", model, LR, (0.9, 0.95), 0.1)
    update = Update(optimizer, model.parameters(), 1.0)
    losses, t0 = [], time.time()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps)
        micro = [next(loader) for _ in range(grad_accum)]
        n = sum(b.n_loss_tokens for b in micro)
        total = 0.0
        for b in micro:
            loss_sum, _ = model(b.tokens, b.cu_seqlens, b.max_seqlen, b.positions, b.labels, reduction="sum")
            (loss_sum / n).backward()
            total += loss_sum.item()
        update.grad_norm()
        update.clip_and_step()
        losses.append(total / n)
        if (step + 1) % log_every == 0:
            print(f"  step {step + 1}: loss {sum(losses[-log_every:]) / log_every:.4f} ({time.time() - t0:.0f} s)",
                  flush=True)
    return losses


@torch.no_grad()
def val_loss(model, batches):
    total = count = 0
    for b in batches:
        loss_sum, n = model(b.tokens, b.cu_seqlens, b.max_seqlen, b.positions, b.labels, reduction="sum")
        total, count = total + loss_sum.item(), count + int(n)
    return total / count


class _Record(torch.autograd.Function):
    """An fp32 Linear that keeps (x, W, dy) of its backward in RECORDS."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        RECORDS.append((x.reshape(-1, x.shape[-1]), weight, dy.reshape(-1, dy.shape[-1])))
        return dy @ weight, dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


RECORDS = []


def bf16_mm(a, b):
    """a @ b^T with bf16 operands, fp32 sums, a bf16 result."""
    return (a.to(torch.bfloat16).float() @ b.to(torch.bfloat16).float().t()).to(torch.bfloat16)


def rel(out, exact):
    return ((out.double() - exact).norm() / exact.norm()).item()


def product_errors(model, batch):
    """{(name, product, kind): [rel err per block]} on the tensors one micro-batch records."""
    RECORDS.clear()
    model.set_fp8(True)  # routes the block Linears through kernels.fp8_linears / reference.fp8_linears: record them
    saved = kernels.fp8_linears, reference.fp8_linears
    kernels.fp8_linears = reference.fp8_linears = lambda x, weights: [_Record.apply(x, w) for w in weights]
    try:
        loss_sum, n = model(batch.tokens, batch.cu_seqlens, batch.max_seqlen, batch.positions, batch.labels,
                            reduction="sum")
        (loss_sum / n).backward()
    finally:
        kernels.fp8_linears, reference.fp8_linears = saved
        model.set_fp8(False)
        model.zero_grad()
    name_of = {id(p): n.split(".")[-2].removesuffix("_proj") for n, p in model.named_parameters()}
    q, mm = reference.fp8_quantize, reference.fp8_mm
    errors = {}
    for x, w, dy in RECORDS:
        name = name_of[id(w)]
        x64, w64, dy64 = x.double(), w.double(), dy.double()
        exact = {"y": x64 @ w64.t(), "dx": dy64 @ w64, "dW": dy64.t() @ x64}
        bf16 = {"y": bf16_mm(x, w), "dx": bf16_mm(dy, w.t()), "dW": bf16_mm(dy.t(), x.t())}
        fp8 = {"y": mm(*q(x), *q(w, 128)), "dx": mm(*q(dy), *q(w.t(), 128)), "dW": mm(*q(dy.t()), *q(x.t(), 128))}
        for product in exact:
            for kind, out in (("bf16", bf16), ("fp8", fp8)):
                errors.setdefault((name, product, kind), []).append(rel(out[product], exact[product]))
    return errors


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--grad_accum", type=int, default=1)
    parser.add_argument("--data_dir", default="data/cache/stdlib")
    parser.add_argument("--ckpt", help="measure the products of this checkpoint's model instead of training one")
    args = parser.parse_args()
    torch.manual_seed(1337)
    if args.ckpt:
        try:  # a wrong path, or data of a larger vocabulary than the model's: one line, no traceback
            model = load_model(args.ckpt, dtype=torch.float32)
            tokens = max(TOKENS, model.cfg.max_seq_len)
            batch = next(iter(PackedLoader(args.data_dir, "val", tokens, model.cfg.max_seq_len, seed=1337,
                                           vocab_size=model.cfg.vocab_size)))
        except (OSError, ValueError) as e:  # (FileError is a ValueError)
            sys.exit(f"error: {e}")
        print(f"{args.ckpt}: {model.cfg.n_layers} blocks, dim {model.cfg.dim}, ffn {model.cfg.ffn_dim}; one "
              f"micro-batch of {tokens} tokens; torch {torch.__version__}, {torch.get_num_threads()} threads",
              flush=True)
        print_errors(product_errors(model, batch), model.cfg.n_layers)
        return
    with open(os.path.join(args.data_dir, "meta.json")) as f:
        meta_vocab = json.load(f)["vocab_size"]
    model0 = Llama(LlamaConfig(**CFG, vocab_size=meta_vocab))
    val = eval_batches(args.data_dir, "val", TOKENS, CFG["max_seq_len"], vocab_size=meta_vocab, max_batches=8)

    def loader():
        return iter(PackedLoader(args.data_dir, "train", TOKENS, CFG["max_seq_len"], seed=1337,
                                 vocab_size=meta_vocab))

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.steps} steps of {TOKENS} x "
          f"{args.grad_accum} tokens")
    runs = {}
    for label, fp8, wgrad_fp8 in (("fp32", False, True), ("fp8", True, True), ("fp8, bf16 dW", True, False)):
        print(f"{label}:", flush=True)
        model = copy.deepcopy(model0)
        model.set_fp8(fp8)
        reference.FP8_WGRAD = wgrad_fp8
        try:
            losses = train(model, loader(), args.steps, args.grad_accum)
            runs[label] = (sum(losses[-50:]) / len(losses[-50:]), val_loss(model, val))
        finally:
            reference.FP8_WGRAD = True
        if label == "fp32":
            print_errors(product_errors(model, next(loader())), CFG["n_layers"])
    print("\n2. training: train loss (mean of the last 50 steps), val loss at the end")
    for label, (train_loss, v) in runs.items():
        print(f"  {label:14} train {train_loss:.4f}  val {v:.4f}")


def print_errors(errors, n_blocks):
    print(f"\n1. relative error of each product vs fp64, mean over the {n_blocks} blocks (max in brackets)")
    print(f"{'':8}" + "".join(f"{p + ' ' + k:>20}" for p in ("y", "dx", "dW") for k in ("bf16", "fp8")))
    for name in NAMES:
        cells = []
        for p in ("y", "dx", "dW"):
            for k in ("bf16", "fp8"):
                e = errors[(name, p, k)]
                cells.append(f"{sum(e) / len(e):.2e} ({max(e):.1e})")
        print(f"{name:8}" + "".join(f"{c:>20}" for c in cells), flush=True)
    print()


if __name__ == "__main__":
    main()
