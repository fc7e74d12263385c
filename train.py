"""Train a Llama on a packed token stream. Flat on purpose: read it top to bottom.

    python train.py                                  # the embedded default: a tiny Llama on Python's stdlib
    python train.py configs/llama3_8b.py             # full fine-tuning from converted weights (CUDA)
    python train.py --max_steps=100 --learning_rate=1e-3

Every setting below can be overridden by a config file or --key=value (configurator.py).
"""
import json
import math
import os
import signal
import sys
import time

import numpy as np
import torch

import kernels  # noqa: F401  (the dispatch point; imported here so a broken install fails early)
from checkpoint import find_checkpoint, load_model, save_checkpoint, tokenizer_spec_of
from configurator import apply_overrides
from data.loader import PackedLoader, eval_batches
from model import PRESETS, Llama, LlamaConfig

# ---- settings (defaults = the embedded default run) ----
out_dir = "out/default"
init_from = "scratch"  # "scratch", "resume" (out_dir/ckpt), or a checkpoint directory (e.g. converted HF weights)
data_dir = "data/cache/stdlib"  # made by `python data/prepare.py` (the stdlib corpus: --stdlib)
require_cuda = False  # configs for real model sizes set this: they would take days on a CPU
# model, when init_from == "scratch": a preset name from model.PRESETS, or the fields below
model_preset = ""
dim = 192
n_layers = 4
n_heads = 6
n_kv_heads = 2
ffn_dim = 512
activation = "silu"
tie_embeddings = True
rope_theta = 10000.0
max_seq_len = 512  # longest document piece; longer documents are split into pieces of this length
# data
tokens_per_micro_step = 4096  # token budget of one forward/backward
grad_accum = 2  # micro-steps per optimizer step
pack_mode = "padding_free"  # "padding_free" (whole documents), "packed" (fill exactly), "padded" (B x L rows)
# optimizer: AdamW, linear warmup then cosine decay to min_lr
learning_rate = 3e-3
min_lr = 3e-4
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
warmup_steps = 100
max_steps = 5000
stop_at_step = 0  # stop with a checkpoint after this step, keeping max_steps' schedule (time-boxed jobs); 0: don't
# eval, logging, checkpoints
eval_interval = 250
eval_tokens = 65536  # tokens of the val split per evaluation (the same ones every time)
log_interval = 10
checkpoint_interval = 500
seed = 1337
device = "auto"  # "auto": cuda if available, else cpu
dtype = "auto"  # "auto": bfloat16 autocast on CUDA, float32 on CPU
compile = False

# with no config file on the command line, the embedded default run's configs/default.py applies
_argv = sys.argv[1:]
if not any(a.endswith(".py") for a in _argv):
    _argv = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "default.py")] + _argv
config = apply_overrides(globals(), _argv)

# ---- set-up ----
if device == "auto":
    device = "cuda" if torch.cuda.is_available() else "cpu"
if require_cuda and device != "cuda":
    sys.exit("error: this config trains a real-size model and needs a CUDA GPU (device is cpu). "
             "For a CPU run use the default: python train.py")
if model_preset and model_preset not in PRESETS:
    sys.exit(f"error: model_preset={model_preset!r} is not one of {', '.join(PRESETS)}")
if dtype == "auto":
    dtype = "bfloat16" if device == "cuda" else "float32"
amp_dtype = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
torch.manual_seed(seed)
ckpt_dir = os.path.join(out_dir, "ckpt")

if init_from not in ("scratch", "resume"):  # fine-tuning: the weights come first, the data is tokenized with them
    try:
        find_checkpoint(init_from)
    except FileNotFoundError as e:
        sys.exit(f"error: init_from: {e}. Convert Hugging Face weights first: python convert.py hf2nano HF_DIR {init_from}")
if not os.path.isfile(os.path.join(data_dir, "meta.json")):
    hint = "python data/prepare.py --stdlib --out " + data_dir if data_dir.endswith("stdlib") else \
        f"python data/prepare.py --out {data_dir} YOUR_FILES ..."
    sys.exit(f"error: no prepared data in {data_dir!r} (meta.json missing). Run first: {hint}")
with open(os.path.join(data_dir, "meta.json")) as f:
    meta = json.load(f)

train_state = None
if init_from == "scratch":
    fields = dict(PRESETS[model_preset]) if model_preset else dict(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, ffn_dim=ffn_dim, activation=activation,
        tie_embeddings=tie_embeddings, rope_theta=rope_theta, vocab_size=meta["vocab_size"])
    model = Llama(LlamaConfig(**{**fields, "max_seq_len": max_seq_len}))
    tokenizer_spec = meta["tokenizer"] if meta["tokenizer"] == "bytes" else os.path.join(data_dir, meta["tokenizer"])
else:
    try:
        source = find_checkpoint(ckpt_dir if init_from == "resume" else init_from)
    except FileNotFoundError as e:
        sys.exit(f"error: init_from=resume: {e}. Nothing to resume yet: start with init_from=scratch")
    model = load_model(source, max_seq_len=max_seq_len)
    tokenizer_spec = tokenizer_spec_of(source)
    if init_from == "resume":
        train_state = torch.load(os.path.join(source, "train_state.pt"), weights_only=False)
if meta["vocab_size"] > model.cfg.vocab_size:
    sys.exit(f"error: the data in {data_dir} was tokenized with a vocabulary of {meta['vocab_size']} tokens, "
             f"the model has only {model.cfg.vocab_size}: prepare the data with the model's tokenizer")
model.to(device)
raw_model = model
if compile:
    model = torch.compile(model)

decay = [p for n, p in raw_model.named_parameters() if p.dim() >= 2]
no_decay = [p for n, p in raw_model.named_parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}],
                              lr=learning_rate, betas=(beta1, beta2), fused=(device == "cuda"))

loader = PackedLoader(data_dir, "train", tokens_per_micro_step, max_seq_len, mode=pack_mode, seed=seed,
                      vocab_size=model.cfg.vocab_size)
step = 0
if train_state is not None:
    optimizer.load_state_dict(train_state["optimizer"])
    loader.load_state_dict(train_state["loader"])
    step = train_state["step"]
batches = iter(loader)
val_batches = eval_batches(data_dir, "val", tokens_per_micro_step, max_seq_len,
                           max_batches=max(1, eval_tokens // tokens_per_micro_step))
os.makedirs(out_dir, exist_ok=True)
metrics_file = open(os.path.join(out_dir, "metrics.jsonl"), "a")


def lr_at(it):
    """Linear warmup to learning_rate, then cosine decay to min_lr at max_steps."""
    if it < warmup_steps:
        return learning_rate * (it + 1) / warmup_steps
    progress = min(1.0, (it - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (learning_rate - min_lr)


def autocast():
    return torch.autocast(device_type=device, dtype=amp_dtype, enabled=amp_dtype is not None)


def loss_sum_of(batch):
    """(summed loss, counted tokens) of one micro-batch."""
    with autocast():
        return model(batch.tokens, batch.cu_seqlens, batch.max_seqlen, batch.positions, batch.labels, reduction="sum")


@torch.no_grad()
def evaluate():
    model.eval()
    total, count = 0.0, 0
    for batch in val_batches:
        loss_sum, n = loss_sum_of(batch.to(device))
        total, count = total + loss_sum.item(), count + int(n)
    model.train()
    return total / max(count, 1)


def log(record):
    metrics_file.write(json.dumps(record) + "\n")
    metrics_file.flush()


def save(reason):
    """Checkpoint the state after the last completed step (a step cut short by Ctrl-C is redone on resume)."""
    state = {"optimizer": optimizer.state_dict(), "loader": loader_state, "step": step_done, "config": config}
    save_checkpoint(ckpt_dir, raw_model, tokenizer_spec, state)
    print(f"saved checkpoint at step {step_done} to {ckpt_dir} ({reason})")


def stop_on_signal(signum, frame):
    raise KeyboardInterrupt  # SIGTERM (a scheduler stopping the job) saves like Ctrl-C


signal.signal(signal.SIGTERM, stop_on_signal)
print(f"model: {raw_model.num_params() / 1e6:.2f}M parameters ({raw_model.cfg.n_layers} layers, dim {raw_model.cfg.dim}), "
      f"device {device}, dtype {dtype}, {tokens_per_micro_step} tokens x {grad_accum} micro-steps per step, "
      f"{meta['splits']['train']['tokens'] / 1e6:.1f}M train tokens")
peak_flops = 790e12  # bf16 dense matmul rate measured on the H200 (BENCHMARKS.md)
first_val = None
t_start = time.time()
t_last, tokens_since, flops_since = time.time(), 0, 0.0
step_done, loader_state = step, loader.state_dict()  # what a checkpoint holds: the last completed step
try:
    while True:
        last = step == max_steps or step == stop_at_step > 0
        if step % eval_interval == 0 or last:
            val = evaluate()
            first_val = val if first_val is None else first_val
            print(f"step {step}: val loss {val:.4f}")
            log({"step": step, "val_loss": val})
        if last:
            break
        lr = lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        micro = [next(batches) for _ in range(grad_accum)]
        n_step = sum(b.n_loss_tokens for b in micro)  # known on the host: no sync
        step_loss = torch.zeros((), device=device)
        for batch in micro:
            loss_sum, _ = loss_sum_of(batch.to(device))
            # normalising by the whole step's token count makes M micro-steps exactly one big step
            (loss_sum / max(n_step, 1)).backward()
            step_loss += loss_sum.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), grad_clip)
        loss = step_loss.item() / max(n_step, 1)  # one sync per step: needed to stop on NaN before the update
        if not math.isfinite(loss) or not math.isfinite(grad_norm.item()):
            print(f"error: non-finite loss or gradient at step {step} (loss {loss}, grad norm {grad_norm.item()}); "
                  "the update was not applied. " + (f"The last good checkpoint is {ckpt_dir}."
                                                    if os.path.exists(ckpt_dir) else "No checkpoint was saved yet."),
                  file=sys.stderr)
            sys.exit(1)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        step_done, loader_state = step, loader.state_dict()
        tokens_since += sum(int(b.tokens.numel()) for b in micro)
        flops_since += sum(raw_model.estimate_flops(np.diff(b.cu_seqlens.numpy())) for b in micro)
        if step % log_interval == 0 or step == max_steps:
            dt = time.time() - t_last
            line = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm.item(), "tok_s": tokens_since / dt}
            msg = f"step {step}/{max_steps} | loss {loss:.4f} | lr {lr:.2e} | {line['tok_s']:,.0f} tok/s"
            if device == "cuda":
                line["mfu"] = flops_since / dt / peak_flops
                line["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9
                msg += f" | MFU {100 * line['mfu']:.1f}% | peak {line['peak_mem_gb']:.1f} GB"
            eta = (time.time() - t_start) / max(1, step - (train_state or {}).get("step", 0)) * (max_steps - step)
            print(msg + f" | ETA {eta / 60:.1f} min", flush=True)
            log(line)
            t_last, tokens_since, flops_since = time.time(), 0, 0.0
        if step % checkpoint_interval == 0 and step not in (max_steps, stop_at_step):
            save("interval")
except KeyboardInterrupt:
    print(f"interrupted during step {step}")
    save("interrupted")
    sys.exit(130)
save("done" if step == max_steps else "stop_at_step")
print(f"val loss: {first_val:.4f} at the start of this run -> {val:.4f} at step {step}")
