"""Train a Llama on a packed token stream. Flat on purpose: read it top to bottom.

    python train.py                                  # the default run: a tiny Llama on Python's stdlib
    python train.py configs/llama3_8b.py             # full fine-tuning from converted weights (CUDA)
    python train.py --max_steps=100 --learning_rate=1e-3
    torchrun --standalone --nproc_per_node=8 train.py configs/llama3_8b.py --parallel=fsdp   # 8 GPUs

The settings are the variables at the top of this file, each with its default and a comment (README.md's
"Settings" table lists the most used). A config file (configs/) or --key=value changes the ones it names.
"""
import json
import math
import os
import signal
import sys
import threading
import time
from contextlib import nullcontext

from configurator import apply_overrides, exit_if_help, fits

exit_if_help(__file__)  # before torch's import, which takes seconds

# Steps of varying token counts leave the CUDA caching allocator with blocks of odd sizes; expandable segments let
# it grow and reuse them instead of failing on fragments near the 141-GB limit (read when CUDA starts).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

import kernels  # noqa: F401  (the dispatch point; imported here so a broken install fails early)
from files import FileError
from checkpoint import (checkpoint_bytes, find_checkpoint, free_bytes, load_model, load_optimizer_state,
                        lock_out_dir, model_tensors, optimizer_tensors, read_config, read_train_state,
                        remove_unfinished, save_checkpoint, tokenizer_spec_of)
from data.loader import MODES, PackedLoader, dataset_tokenizer, eval_batches, read_meta
from model import PRESETS, Llama, LlamaConfig
from optim import (KAHAN_OPTIMIZERS, OPTIMIZERS, Update, host_memory_available, host_memory_error, make_optimizer,
                   offloaded_bytes, offloaded_params)
from plot import write_loss_plot
from tokenizer import load_tokenizer, same_encoding, tokenizer_files

# ---- settings; their defaults are the default run (`make train`): a tiny Llama learns to write Python from the
# standard library's own source (byte tokens, nothing downloaded), on a CPU (README.md: how long it takes) ----
out_dir = "out/default"
init_from = "scratch"  # "scratch", "resume" (out_dir/ckpt), or a checkpoint directory (e.g. converted HF weights)
data_dir = "data/cache/stdlib"  # made by `python data/prepare.py` (the stdlib corpus: --stdlib)
require_cuda = False  # configs for real model sizes set this: they would take days on a CPU

# model, when init_from == "scratch": a preset name from model.PRESETS, or the fields below
model_preset = ""
dim = 192
n_layers = 4
n_heads = 3
n_kv_heads = 1
ffn_dim = 512
activation = "silu"
tie_embeddings = True
rope_theta = 10000.0
max_seq_len = 512  # longest document piece; longer documents are split into pieces of this length

# data
tokens_per_micro_step = 4096  # token budget of one forward/backward
grad_accum = 2  # micro-steps per optimizer step, PER RANK: a step is grad_accum x ranks micro-batches
pack_mode = "padding_free"  # "padding_free" (whole sequences), "packed" (fill exactly), "padded" (B x L rows)

# optimizer: AdamW, linear warmup then cosine decay to min_lr
optimizer_name = "adamw"  # "adamw" (plain; on CUDA our fused kernel), "adamw_kahan" (optim.py: for bf16 weights) or
# "adamw8bit" (adamw_kahan with 8-bit moments: 2 bytes of Adam state per parameter instead of 8)
weights_dtype = "float32"  # "float32" (master weights; bf16 compute via autocast) or "bfloat16" (half the memory:
# use with optimizer_name="adamw_kahan", whose compensated updates are not rounded away; gradients are then bf16,
# so micro-steps accumulate in bf16)
learning_rate = 3e-3
min_lr = 3e-4
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0  # clip the global gradient norm to this; 0: no clipping
optimizer_in_backward = False  # update each weight as soon as its gradient is complete, then free the gradient: no
# gradients held at once (16 GB for an 8B model in bf16). Needs optimizer_name="adamw_kahan" or "adamw8bit",
# grad_accum=1 and grad_clip=0 (the global norm is known only after the last update), one process
# (parallel="none"), compile=False (a compiled backward makes every gradient before any is used).
optimizer_offload = 0.0  # the share (0 .. 1) of adamw8bit's state (moments, scales, Kahan comp: 4.1 bytes per
# parameter) kept in pinned host memory and streamed through the GPU beside backward (optim.StateStream), that of
# the last parameters (optim.offloaded_params); the same weights to the bit
checkpoint_layers = 0  # activation checkpointing: the first n blocks recompute their activations in backward
fp8 = False  # the block Linears (q/k/v/o, gate/up, down) in FP8 e4m3 with block scales (kernels/fp8.py), and the
# lm_head's gradient products: needs a Hopper GPU (H100/H200: torch._scaled_mm runs 1 x 128 / 128 x 128 scales on
# sm_90 only); on the CPU an exact simulation, correct but slower
warmup_steps = 30
max_steps = 600
stop_at_step = 0  # stop with a checkpoint after this step, keeping max_steps' schedule (time-boxed jobs); 0: don't

# eval, logging, checkpoints
eval_interval = 100
eval_tokens = 65536  # tokens of the val split per evaluation (the same ones every time)
log_interval = 10
checkpoint_interval = 200
wandb_log = False  # also log to Weights & Biases (needs `pip install wandb`, imported only then; offline:
# WANDB_MODE=offline). metrics.jsonl and its picture, loss.svg, are written in out_dir either way
wandb_project = "nanollama"
wandb_run_name = ""  # "": the out_dir's name
save_optimizer_state = True  # False: checkpoints hold the weights only (the result of a fine-tune; a quarter of the
# bytes with AdamW-Kahan and bf16 weights) and cannot be resumed
seed = 1337
device = "auto"  # "auto": cuda if available, else cpu
dtype = "auto"  # "auto": bfloat16 autocast on CUDA, float32 on CPU
compile = False
parallel = "none"  # under torchrun: "ddp" (a full copy per GPU) or "fsdp" (FSDP2: weights and moments sharded)

# the settings above that a new model takes as its LlamaConfig fields (with the data's vocab_size); a resume keeps them
MODEL_SETTINGS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "activation", "tie_embeddings", "rope_theta")
given = set()  # the settings a config file or flag set: on resume, every other one is the run's own
config = apply_overrides(globals(), given=given)

# A resume continues a run with the run's own settings (its train_state.json): those not set again here are
# taken from it, so `--init_from=resume --out_dir=DIR` is the whole command. Where it runs is this command's.
train_state = None
if init_from == "resume":
    try:
        train_state = read_train_state(find_checkpoint(os.path.join(out_dir, "ckpt")))
    except FileError as e:
        if os.path.isfile(os.path.join(out_dir, "config.json")):  # the checkpoint itself, not the run's folder
            run_dir = os.path.dirname(os.path.normpath(out_dir)) or "."
            hint = f". {out_dir} is a checkpoint: resume names the run's folder, --out_dir={run_dir}"
        else:
            hint = "" if os.path.exists(os.path.join(out_dir, "ckpt")) else \
                ". Nothing to resume yet: start with init_from=scratch"
        sys.exit(f"error: init_from=resume: {e}{hint}")
    runs_here = given | {"init_from", "out_dir", "stop_at_step", "device", "parallel"}
    taken = {k: v for k, v in train_state["config"].items() if k in config and k not in runs_here and config[k] != v}
    if wrong := [k for k, v in taken.items() if not fits(v, config[k])]:
        sys.exit(f"error: {os.path.join(out_dir, 'ckpt', 'train_state.json')}: config.{wrong[0]} is "
                 f"{train_state['config'][wrong[0]]!r:.60}, the setting is a {type(config[wrong[0]]).__name__}")
    globals().update(taken)
    config.update(taken)
    if taken:
        print(f"resume: the run's own settings {', '.join(f'{k}={v!r}' for k, v in taken.items())}", flush=True)

# ---- set-up ----
# torchrun starts one process per GPU and tells each who it is; a plain `python train.py` is rank 0 of 1
rank = int(os.environ.get("RANK", 0))  # among all processes
local_rank = int(os.environ.get("LOCAL_RANK", 0))  # on this machine: the GPU to use
world_size = int(os.environ.get("WORLD_SIZE", 1))
if device == "auto":
    device = "cuda" if torch.cuda.is_available() else "cpu"
if device.split(":")[0] not in ("cpu", "cuda"):
    sys.exit(f"error: device={device!r}: expected 'auto', 'cpu', 'cuda' or 'cuda:N'")
if device.startswith("cuda") and not torch.cuda.is_available():
    sys.exit(f"error: device={device!r} but this torch has no CUDA (a CPU build, or no GPU visible): use "
             "--device=cpu")
if device == "cuda" and parallel != "none":
    device = f"cuda:{local_rank}"  # one GPU per process
device_type = device.split(":")[0]


def settings_error():
    """What is wrong with the settings taken together, or None; checked before any work (the checks against files
    come where each file is read)."""
    if parallel not in ("none", "ddp", "fsdp"):
        return f"parallel={parallel!r}: expected 'none', 'ddp' or 'fsdp'"
    if parallel == "none" and world_size > 1:
        return f"torchrun started {world_size} processes but parallel='none': pass --parallel=ddp or --parallel=fsdp"
    if parallel != "none" and "RANK" not in os.environ:
        return f"parallel={parallel!r} runs under torchrun: torchrun --standalone --nproc_per_node=N train.py ..."
    if require_cuda and device_type != "cuda":
        return ("this config trains a real-size model and needs a CUDA GPU (device is cpu). "
                "For a CPU run use the default: python train.py")
    if not 1 <= max_seq_len <= tokens_per_micro_step:
        return (f"max_seq_len={max_seq_len} must be between 1 and tokens_per_micro_step={tokens_per_micro_step}: "
                "a document piece has to fit in one micro-step")
    for name in ("max_steps", "grad_accum", "tokens_per_micro_step", "eval_interval", "log_interval",
                 "checkpoint_interval", "eval_tokens"):
        if globals()[name] < 1:
            return f"{name}={globals()[name]}: expected 1 or more"
    for name in ("warmup_steps", "stop_at_step", "grad_clip", "learning_rate", "min_lr", "weight_decay"):
        if globals()[name] < 0:
            return f"{name}={globals()[name]}: expected 0 or more"
    if not 0 <= seed < 2**63:
        return f"seed={seed}: expected 0 .. 2**63 - 1"
    if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
        return f"beta1={beta1}, beta2={beta2}: each expected in [0, 1) (the moments' decay per step)"
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        return f"dtype={dtype!r}: expected 'auto', 'float32', 'bfloat16' or 'float16'"
    if pack_mode not in MODES:
        return f"pack_mode={pack_mode!r}: expected one of {', '.join(MODES)}"
    if min_lr > learning_rate:
        return f"min_lr={min_lr} is above learning_rate={learning_rate}: the cosine 'decay' would rise"
    if optimizer_name not in OPTIMIZERS:
        return f"optimizer_name={optimizer_name!r}: expected one of {', '.join(map(repr, OPTIMIZERS))}"
    if weights_dtype not in ("float32", "bfloat16"):
        return f"weights_dtype={weights_dtype!r}: expected 'float32' or 'bfloat16'"
    if weights_dtype == "bfloat16" and optimizer_name not in KAHAN_OPTIMIZERS:
        return ("weights_dtype='bfloat16' with plain AdamW loses small updates to rounding: "
                "use --optimizer_name=adamw_kahan")
    if optimizer_in_backward and (optimizer_name not in KAHAN_OPTIMIZERS or grad_accum != 1 or grad_clip
                                  or parallel != "none" or compile):
        return (f"optimizer_in_backward=True needs optimizer_name='adamw_kahan' or 'adamw8bit', grad_accum=1, "
                f"grad_clip=0, parallel='none' and compile=False (got {optimizer_name!r}, {grad_accum}, "
                f"{grad_clip}, {parallel!r}, {compile}): each weight is updated during backward, before a later "
                "micro-step, the global gradient norm or other ranks exist, and a compiled backward would make all "
                "gradients at once")
    if not 0 <= optimizer_offload <= 1:
        return f"optimizer_offload={optimizer_offload}: expected a share of the optimizer state from 0 to 1"
    if optimizer_offload and optimizer_name != "adamw8bit":
        return (f"optimizer_offload={optimizer_offload} keeps adamw8bit's state in host memory: use it with "
                f"optimizer_name='adamw8bit' (got {optimizer_name!r})")
    if optimizer_name in KAHAN_OPTIMIZERS and parallel == "fsdp":
        return f"optimizer_name={optimizer_name!r} is not tested under FSDP yet: use parallel='none' or 'ddp'"
    if fp8 and device_type == "cuda" and torch.cuda.get_device_capability(device) != (9, 0):
        return (f"fp8=True needs a Hopper GPU (compute capability 9.0: torch._scaled_mm runs the 1 x 128 / 128 x "
                f"128 block scales on sm_90 only); {torch.cuda.get_device_name(device)} has "
                f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}")
    if model_preset and model_preset not in PRESETS:
        return f"model_preset={model_preset!r} is not one of {', '.join(PRESETS)}"


if error := settings_error():
    sys.exit(f"error: {error}")
if warmup_steps >= max_steps:  # the whole run would be warmup: the lr still rising at the end
    short = max(1, max_steps // 10)
    print(f"note: warmup_steps={warmup_steps} is not below max_steps={max_steps}: warmup shortened to {short} "
          f"step{'s' * (short > 1)} (a tenth of the run)", file=sys.stderr)
    warmup_steps = config["warmup_steps"] = short
if wandb_log:
    try:
        import wandb
    except ImportError:
        sys.exit("error: wandb_log=True needs the wandb package: pip install wandb")
if dtype == "auto":
    dtype = "bfloat16" if device_type == "cuda" else "float32"
amp_dtype = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
torch.manual_seed(seed)  # the same seed on every rank: the same initial weights (FSDP relies on it)
ckpt_dir = os.path.join(out_dir, "ckpt")

if init_from not in ("scratch", "resume"):  # fine-tuning: the weights come first, the data is tokenized with them
    try:
        source_cfg = read_config(find_checkpoint(init_from))["model"]
    except FileError as e:
        hint = "" if os.path.exists(init_from) else \
            f". Convert Hugging Face weights first: python convert.py hf2nano HF_DIR {init_from}"
        sys.exit(f"error: init_from: {e}{hint}")
    # the checkpoint brings its model: a shape setting given as well would be silently dropped
    if clash := [f"{k}={config[k]!r} (it has {getattr(source_cfg, k)!r})" for k in MODEL_SETTINGS
                 if k in given and config[k] != getattr(source_cfg, k)]:
        sys.exit(f"error: init_from={init_from} brings its own model, but {', '.join(clash)}: drop these settings "
                 "(a new shape trains from init_from=scratch)")
if not os.path.isfile(os.path.join(data_dir, "meta.json")):
    hint = "python data/prepare.py --stdlib --out " + data_dir if data_dir.endswith("stdlib") else \
        f"python data/prepare.py --out {data_dir} YOUR_FILES ..."
    sys.exit(f"error: no prepared data in {data_dir!r} (meta.json missing). Run first: {hint}")
try:
    meta = read_meta(data_dir)
except FileError as e:
    sys.exit(f"error: {e}: prepare the data again")
if init_from == "scratch":  # the new model's shape, checked before any work
    fields = dict(PRESETS[model_preset]) if model_preset else \
        {**{k: config[k] for k in MODEL_SETTINGS}, "vocab_size": meta["vocab_size"]}
    try:
        model_cfg = LlamaConfig(**{**fields, "max_seq_len": max_seq_len})
    except ValueError as e:
        sys.exit(f"error: the model's settings: {e}")


def lr_at(it, schedule=config):
    """Linear warmup to learning_rate, then cosine decay to min_lr at max_steps (of this run, or of `schedule`)."""
    lr, lr_min, warmup, total = (schedule[k] for k in ("learning_rate", "min_lr", "warmup_steps", "max_steps"))
    if it < warmup:
        return lr * (it + 1) / warmup
    progress = min(1.0, (it - warmup) / max(1, total - warmup))
    return lr_min + 0.5 * (1 + math.cos(math.pi * progress)) * (lr - lr_min)


# One run per out_dir, and a new run never replaces another's checkpoint: it resumes it or goes elsewhere.
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # until training starts: exit cleanly (atexit runs)
try:
    out_dir_lock = lock_out_dir(out_dir) if rank == 0 else None  # held until this process ends
except FileError as e:
    sys.exit(f"error: {e}")
try:
    existing = find_checkpoint(ckpt_dir)
except FileError:
    existing = None
if existing and init_from != "resume":
    sys.exit(f"error: {out_dir} already holds a checkpoint ({existing}): continue it with --init_from=resume, or "
             f"write this run elsewhere with --out_dir=NEW_DIR (or delete {existing} first)")
if init_from == "resume":
    saved, done = train_state["config"], train_state["step"]
    # The checkpoint fixes the model and the optimizer's kind: a setting that would change them is a mistake.
    fixed = ("model_preset", *MODEL_SETTINGS, "weights_dtype", "optimizer_name")
    if changed := [f"{k}={config[k]!r} (it has {saved[k]!r})" for k in fixed if k in saved and saved[k] != config[k]]:
        sys.exit(f"error: init_from=resume continues the model and optimizer of {existing}, but "
                 f"{', '.join(changed)}: drop these settings, or start a new run with --init_from={existing} "
                 "--out_dir=NEW_DIR")
    if done >= max_steps or 0 < stop_at_step <= done:
        print(f"nothing to do: {existing} is at step {done}, and max_steps={max_steps}"
              f"{f', stop_at_step={stop_at_step}' if stop_at_step else ''}. Raise max_steps to train further")
        sys.exit(0)
    schedule = ("learning_rate", "min_lr", "warmup_steps", "max_steps")
    if moved := [k for k in schedule if k in saved and saved[k] != config[k]]:
        # (the old max_steps cannot be kept where the run has reached it: training further is the change asked for)
        keep = [k for k in moved if k != "max_steps" or saved[k] > done]
        print(f"warning: {', '.join(f'{k} {saved[k]} -> {config[k]}' for k in moved)}: the learning-rate schedule "
              f"changes, lr at step {done} goes from {lr_at(done, saved):.3g} to {lr_at(done):.3g}" +
              (f". To keep {'the rest of ' * (keep != moved)}the old schedule, resume with "
               f"{' '.join(f'--{k}={saved[k]}' for k in keep)}" if keep else ""), file=sys.stderr)
    if other := [k for k in sorted(given - {"init_from"}) if k in saved and saved[k] != config[k]
                 and k not in fixed + schedule]:
        print("resume: changed from the run's settings: " +
              ", ".join(f"{k} {saved[k]!r} -> {config[k]!r}" for k in other), flush=True)
# Every rank has passed the same checks, so a configuration error stops all of them alike, before they connect.
if parallel != "none":  # NCCL between GPUs, gloo between CPU processes (the tests)
    if device_type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=torch.device(device))
    else:
        dist.init_process_group("gloo")


def print0(*args, **kwargs):
    """Every rank runs this same script; rank 0 speaks for all of them."""
    if rank == 0:
        print(*args, **kwargs)


# Ctrl-C and SIGTERM. Before this run's first step there is nothing to save: a stop ends the run at once. Python
# runs a signal handler only between two torch ops, and one op of a real-size model on a CPU (its random init, the
# first evaluation) can take minutes; so a thread waits on the wakeup fd, which the signal writes to immediately.
stop_requested = False
before_first_step = True


def exit_before_first_step():
    print0("interrupted before the first step: stopping now (nothing to save yet)", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(130)


def exit_when_signalled(fd):
    while os.read(fd, 1):
        if before_first_step:
            exit_before_first_step()


def stop_on_signal(signum, frame):
    global stop_requested
    if before_first_step:
        exit_before_first_step()
    # A stop must not land in the middle of a step whose updates have begun: several ranks must stop at the same
    # step to save together, and an update in backward changes the weights before the step ends. Then the signal
    # is only noted here, and the end of the step (where the ranks exchange their loss anyway) saves and stops.
    if parallel == "none" and not update.in_backward:
        raise KeyboardInterrupt  # SIGTERM (a scheduler stopping the job) saves like Ctrl-C
    stop_requested = True


signal.signal(signal.SIGTERM, stop_on_signal)
signal.signal(signal.SIGINT, stop_on_signal)
wakeup_read, wakeup_write = os.pipe()
os.set_blocking(wakeup_write, False)
signal.set_wakeup_fd(wakeup_write, warn_on_full_buffer=False)
threading.Thread(target=exit_when_signalled, args=(wakeup_read,), daemon=True).start()
print0(f"initialising a new {model_preset or f'{n_layers}-layer'} model on {device} ..." if init_from == "scratch"
       else f"loading {ckpt_dir if init_from == 'resume' else init_from} ...", flush=True)
if init_from == "scratch":
    with torch.device(device):  # initialised where it lives: an 8B model's random init on a CPU takes minutes
        model = Llama(model_cfg)
    tokenizer_spec = meta["tokenizer"] if meta["tokenizer"] == "bytes" else os.path.join(data_dir, meta["tokenizer"])
else:
    source = existing if init_from == "resume" else find_checkpoint(init_from)
    try:  # straight onto the GPU, one tensor at a time; under FSDP each rank shards its CPU copy below
        model = load_model(source, device="cpu" if parallel == "fsdp" else device, max_seq_len=max_seq_len)
        tokenizer_spec = tokenizer_spec_of(source)
    except FileError as e:
        sys.exit(f"error: {e}")
if meta["vocab_size"] > model.cfg.vocab_size:
    sys.exit(f"error: the data in {data_dir} was tokenized with a vocabulary of {meta['vocab_size']} tokens, "
             f"the model has only {model.cfg.vocab_size}: prepare the data with the model's tokenizer")
if init_from != "scratch":  # token ids mean something only in the tokenizer they came from: the model's
    try:
        same = same_encoding(dataset_tokenizer(data_dir), load_tokenizer(tokenizer_spec))
    except FileError as e:
        sys.exit(f"error: {e}")
    if not same:
        sys.exit(f"error: the data in {data_dir} was tokenized with {meta['tokenizer']}, not with the tokenizer of "
                 f"{source} ({os.path.basename(tokenizer_spec)}): prepare it again with --tokenizer {source}")
model.to(device=device, dtype=getattr(torch, weights_dtype))  # converted HF weights may come as bf16
if not 0 <= checkpoint_layers <= model.cfg.n_layers:
    sys.exit(f"error: checkpoint_layers={checkpoint_layers}: expected 0 .. n_layers={model.cfg.n_layers}")
model.checkpoint_layers = checkpoint_layers
if fp8:
    try:
        model.set_fp8(True)
    except ValueError as e:
        sys.exit(f"error: {e}")
    if device_type == "cpu":
        print0("fp8 on the CPU: every FP8 product is simulated exactly (e4m3 codes, fp32 sums, bf16 results), "
               "correct but slower than fp32")
raw_model = model
if parallel == "fsdp":
    # FSDP2: each block's weights are one group, sharded over the ranks and gathered whole just for its forward
    # and backward; gradients are reduce-scattered back into shards. The root group holds the rest (embedding,
    # final norm): a tied lm_head.weight IS embed_tokens.weight, so the shared tensor lives in that one group.
    # Mixed precision (on CUDA): bf16 copies for compute, fp32 shards for the optimizer, fp32 gradient reduction.
    # Inputs are not cast: the RoPE tables passed to each block must stay fp32.
    # The mesh is explicit: fully_shard's default picks CUDA whenever a GPU is visible, even for --device=cpu.
    mp = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    mesh = init_device_mesh(device_type, (world_size,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)  # in place: raw_model is now the FSDP root, its parameters DTensor shards
if compile:
    model = torch.compile(model)
if parallel == "ddp":  # a full copy per rank; gradients are averaged over the ranks during backward
    model = DistributedDataParallel(model, device_ids=[local_rank] if device_type == "cuda" else None,
                                    broadcast_buffers=False)  # the only buffers, the RoPE tables, never change

hosted = offloaded_params(raw_model, optimizer_offload)
optimizer = make_optimizer(optimizer_name, raw_model, learning_rate, (beta1, beta2), weight_decay,
                           fused=device_type == "cuda", offload=hosted)
if hosted:  # pinned at the first step: say now what it takes, and stop now if the host lacks it
    if error := host_memory_error(hosted, host_memory_available()):
        sys.exit(f"error: optimizer_offload={optimizer_offload}: {error}")
    print0(f"optimizer state of {len(hosted)} parameters in host memory: {offloaded_bytes(hosted) / 1e9:.1f} GB")
update = Update(optimizer, raw_model.parameters(), grad_clip, in_backward=optimizer_in_backward)

try:  # the data's own problems (missing or damaged files, an empty split, token ids past the vocabulary)
    loader = PackedLoader(data_dir, "train", tokens_per_micro_step, max_seq_len, mode=pack_mode, seed=seed,
                          vocab_size=raw_model.cfg.vocab_size, rank=rank, world_size=world_size)
    val_batches = eval_batches(data_dir, "val", tokens_per_micro_step, max_seq_len, vocab_size=raw_model.cfg.vocab_size,
                               max_batches=max(1, eval_tokens // tokens_per_micro_step))
except (OSError, ValueError) as e:
    sys.exit(f"error: {e}")
if not any(b.n_loss_tokens for b in val_batches):  # only user turns: the val loss would be 0 / 0
    sys.exit(f"error: the val split of {data_dir} has no target token in the {sum(len(b.tokens) for b in val_batches)} "
             "tokens evaluated (eval_tokens): no assistant turn with text. Prepare it again with another --seed")
step = 0
if train_state is not None:
    # Checkpoints hold whole tensors keyed by parameter name whatever the mode, so any run resumes under any mode
    # and number of ranks; under FSDP each rank keeps its shard of each tensor as it is read.
    t0 = time.time()
    try:
        load_optimizer_state(raw_model, optimizer, existing)
    except FileError as e:
        sys.exit(f"error: {e}")
    try:
        loader.load_state_dict(train_state["loader"], os.path.join(existing, "train_state.json"))
    except FileError as e:  # damaged, or a loader cursor for other data
        sys.exit(f"error: {e}. Is data_dir={data_dir!r} the data it was trained on? (the run had "
                 f"{train_state['config'].get('data_dir')!r})")
    step = train_state["step"]
    print0(f"resuming {existing} at step {step} (optimizer state loaded in {time.time() - t0:.1f} s)")
batches = iter(loader)
os.makedirs(out_dir, exist_ok=True)
metrics_file = open(os.path.join(out_dir, "metrics.jsonl"), "a") if rank == 0 else None
if wandb_log and rank == 0:
    try:
        wandb.init(project=wandb_project, name=wandb_run_name or os.path.basename(os.path.abspath(out_dir)),
                   config=config)
    except Exception as e:  # wandb's own errors (not logged in, no network): one line, not its traceback
        sys.exit(f"error: wandb_log=True: {type(e).__name__}: {e} (to log without an account: WANDB_MODE=offline)")


def autocast():
    return torch.autocast(device_type=device_type, dtype=amp_dtype, enabled=amp_dtype is not None)


def loss_sum_of(batch):
    """(summed loss, counted tokens) of one micro-batch."""
    with autocast():
        return model(batch.tokens, batch.cu_seqlens, batch.max_seqlen, batch.positions, batch.labels, reduction="sum")


@torch.no_grad()
def evaluate():
    """Mean loss over val_batches; the ranks take turns (batch i goes to rank i % world_size) and add up."""
    model.eval()
    total, count = 0.0, 0
    n_rounds = math.ceil(len(val_batches) / world_size)
    for i in range(rank, n_rounds * world_size, world_size):
        # A rank with no batch left in the last round runs one anyway and ignores it: FSDP ranks gather each
        # block's weights together, so they must all run the same number of forwards.
        loss_sum, n = loss_sum_of(val_batches[min(i, len(val_batches) - 1)].to(device))
        if i < len(val_batches):
            total, count = total + loss_sum.item(), count + int(n)
    model.train()
    if world_size > 1:
        sums = torch.tensor([total, count], dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        total, count = sums.tolist()
    return total / max(count, 1)


def log(record):
    if rank == 0:
        metrics_file.write(json.dumps(record) + "\n")
        metrics_file.flush()
        if wandb_log:
            wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])


def rank0_says(value):
    """Rank 0's value, on every rank: one look at the disk decides for all of them."""
    if world_size > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        value = box[0]
    return value


def size(n_bytes):
    return f"{n_bytes / 1e9:.1f} GB" if n_bytes >= 1e8 else f"{n_bytes / 1e6:.2f} MB"


def save(final):
    """Checkpoint the state after the last completed step (a step cut short by Ctrl-C is redone on resume); True
    if it was saved. The disk is checked first. When the whole training state does not fit (or writing it fails),
    a final save keeps the weights alone, the result of training; an interval save is skipped. The previous
    checkpoint stays until a new one is whole. Every rank calls this (FSDP gathers each tensor from all ranks)."""
    weights = model_tensors(raw_model)
    choices = [optimizer_tensors(raw_model, optimizer) if save_optimizer_state else []]
    if final and choices[0]:
        choices.append([])  # the weights alone
    state = {"step": step_done, "loader": loader_state, "config": config, "tokens": tokens_done}
    spare = 2**16 + sum(map(os.path.getsize, tokenizer_files(tokenizer_spec).values()))  # JSON, tokenizer files
    for optimizer_state in choices:
        what = f"the step-{step_done} " + ("checkpoint" if optimizer_state else "weights")
        need, problem = checkpoint_bytes(weights) + checkpoint_bytes(optimizer_state) + spare, None
        if rank == 0:
            remove_unfinished(ckpt_dir)  # a save killed earlier: its space counts as free
            if need > (free := free_bytes(ckpt_dir)):
                problem = f"{what} needs {size(need)}, {size(free)} are free at {out_dir}"
        if rank0_says(problem) is None:
            print0(f"saving {what} ({size(need)}) to {ckpt_dir} ...", flush=True)
            t0 = time.time()
            try:
                save_checkpoint(ckpt_dir, raw_model.cfg, tokenizer_spec, weights, optimizer_state, state, rank == 0)
            except OSError as e:
                problem = f"writing {what} failed: {e}"
        if rank0_says(problem) is None:
            print0(f"saved {what} in {time.time() - t0:.1f} s" + ("" if optimizer_state or not save_optimizer_state
                   else ": without the optimizer state this run cannot resume; --init_from starts a new one from it"))
            return True
        print0(f"warning: {problem}: " + ("trying the weights alone" if optimizer_state and final else
               "not saved" + (", the previous checkpoint stays" if os.path.exists(ckpt_dir) else "")), file=sys.stderr)
    return False


def save_final():
    """The last save of a run; when not even the weights could be saved, one error line and exit code 1."""
    if not save(final=True):
        print0(f"error: step {step_done} could not be saved (see above); {ckpt_dir} holds no newer checkpoint",
               file=sys.stderr)
        finish(1)


def finish(code):
    if wandb_log and rank == 0:
        wandb.finish(exit_code=code)
    if parallel != "none":
        dist.destroy_process_group()
        # Leave without the interpreter's teardown: DDP / FSDP still hold the process group, whose worker threads
        # would be destroyed while Python finalizes, which can abort a rank after a finished, saved run
        # ("terminate called without an active exception").
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def stop_on_non_finite(loss, grad_norm, applied):
    """A NaN/inf loss or gradient: stop without saving (the last checkpoint is the last good state)."""
    print0(f"error: non-finite loss or gradient at step {step} (loss {loss}, grad norm {grad_norm}); " +
           ("the update WAS applied (optimizer_in_backward): the weights in memory may be damaged, nothing was saved. "
            if applied else "the update was not applied. ") +
           (f"The last good checkpoint is {ckpt_dir}." if os.path.exists(ckpt_dir) else "No checkpoint was saved yet."),
           file=sys.stderr)
    finish(1)


linears_dtype = "FP8" if fp8 else str(amp_dtype or getattr(torch, weights_dtype)).removeprefix("torch.")
print0(f"model: {raw_model.num_params() / 1e6:.2f}M parameters ({raw_model.cfg.n_layers} layers, dim {raw_model.cfg.dim}), "
       f"device {device}, dtype {dtype}, block Linears in {linears_dtype}, {tokens_per_micro_step} tokens x "
       f"{grad_accum} micro-steps"
       f"{f' x {world_size} ranks ({parallel})' if world_size > 1 else ''} per step, "
       f"{meta['splits']['train']['tokens']:,} train tokens")
if device_type == "cuda":
    print0("the first steps of new shapes compile and tune the Triton kernels (about a minute for 8B); the results "
           "are cached in TRITON_CACHE_DIR (default ~/.triton/cache), so later runs start in seconds")
if device_type == "cpu" and raw_model.num_params() > 1e9:
    print0(f"warning: {raw_model.num_params() / 1e9:.2f}B parameters on a CPU: expect minutes for every step and "
           "every evaluation batch (a real-size model wants a CUDA GPU)")
peak_flops = 989e12  # dense bf16 spec peak of an H100 / H200: MFU as published numbers count it
first_val = None
t_start = time.time()
t_last, tokens_since, flops_since = time.time(), 0, 0.0
tokens_seen = (train_state or {}).get("tokens", 0)  # by the whole run, over all ranks (the plot's second scale)
step_done, loader_state, tokens_done = step, loader.state_dict(), tokens_seen  # a checkpoint's: the last step
try:
    while True:
        last = step == max_steps or step == stop_at_step > 0
        if step % eval_interval == 0 or last or before_first_step:  # a resumed run, too, says where it starts
            if before_first_step:  # the first evaluation of a big model can take a while: say what it is doing
                print0(f"step {step}: evaluating {sum(len(b.tokens) for b in val_batches):,} val tokens ...",
                       flush=True)
            val = evaluate()
            first_val = val if first_val is None else first_val
            print0(f"step {step}: val loss {val:.4f}")
            log({"step": step, "val_loss": val})
            if rank == 0:  # the run as a picture, redrawn at each evaluation
                write_loss_plot(metrics_file.name, os.path.join(out_dir, "loss.svg"))
        if last:
            break
        if before_first_step:  # from here on, a stop saves (stop_on_signal)
            before_first_step = False
            signal.set_wakeup_fd(-1)
        lr = lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        micro = [next(batches) for _ in range(grad_accum)]  # this rank's share of the step
        n_step = sum(b.n_loss_tokens for b in micro)  # known on the host: no sync
        if world_size > 1:  # the whole step's count, over all ranks: one tiny collective before the backward passes
            n_all = torch.tensor(n_step, dtype=torch.int64, device=device)
            dist.all_reduce(n_all)
            n_step = int(n_all.item())
        step_loss = torch.zeros((), device=device)
        for i, batch in enumerate(micro):
            # Ranks exchange gradients once per step, in the last micro-step's backward; before it each rank
            # accumulates its own (under FSDP: whole, unsharded fp32 gradients, held until that last backward).
            sync = i == len(micro) - 1
            if parallel == "fsdp":
                raw_model.set_requires_gradient_sync(sync)
            with model.no_sync() if parallel == "ddp" and not sync else nullcontext():
                loss_sum, _ = loss_sum_of(batch.to(device))
                if not update.safe_to_backward(loss_sum):  # an update inside backward would apply it
                    stop_on_non_finite(loss_sum.item(), "not computed", applied=False)
                # Normalising by the whole step's token count makes M micro-steps on W ranks exactly one big step:
                # the gradient is sum(loss) / N over all of them. DDP and FSDP AVERAGE the ranks' gradients (sum / W),
                # so each rank scales its share by W to turn that average back into the sum.
                (loss_sum * world_size / max(n_step, 1)).backward()
            step_loss += loss_sum.detach()
        grad_norm = update.grad_norm()  # the whole step's, a device tensor
        tokens = sum(int(b.tokens.numel()) for b in micro)
        flops = sum(raw_model.estimate_flops(b.seqlens) for b in micro)
        totals = torch.tensor([0.0, tokens, flops, stop_requested], dtype=torch.float64, device=device)
        totals[0] = step_loss
        if world_size > 1:  # the step's loss sum, tokens and FLOPs over all ranks, and whether any must stop
            dist.all_reduce(totals)
        loss_sum, tokens, flops, stop = totals.tolist()  # one sync per step: needed to stop on NaN before the update
        loss = loss_sum / max(n_step, 1)  # every rank sees the same loss and norm, so a NaN stops them all
        grad_norm = grad_norm.item()  # computed before the sync above: no second wait
        if not math.isfinite(loss) or not math.isfinite(grad_norm):
            stop_on_non_finite(loss, grad_norm, applied=update.in_backward)
        update.clip_and_step(grad_norm)
        step += 1
        tokens_seen += int(tokens)
        step_done, loader_state, tokens_done = step, loader.state_dict(), tokens_seen
        tokens_since, flops_since = tokens_since + tokens, flops_since + flops
        if step % log_interval == 0 or step == max_steps:
            dt = time.time() - t_last
            line = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tok_s": tokens_since / dt,
                    "tokens": tokens_seen}
            msg = f"step {step}/{max_steps} | loss {loss:.4f} | lr {lr:.2e} | {line['tok_s']:,.0f} tok/s"
            if world_size > 1:
                msg += f" ({line['tok_s'] / world_size:,.0f} per {'GPU' if device_type == 'cuda' else 'rank'})"
            if device_type == "cuda":
                line["mfu"] = flops_since / dt / (peak_flops * world_size)
                line["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9  # rank 0's GPU
                msg += f" | MFU {100 * line['mfu']:.1f}% | peak {line['peak_mem_gb']:.1f} GB"
            end = min(max_steps, stop_at_step or max_steps)  # where this run stops
            eta = (time.time() - t_start) / max(1, step - (train_state or {}).get("step", 0)) * (end - step)
            print0(msg + f" | ETA {eta / 60:.1f} min", flush=True)
            log(line)
            t_last, tokens_since, flops_since = time.time(), 0, 0.0
        if stop:  # a rank was told to stop (Ctrl-C, SIGTERM): all ranks save this step together, and exit
            print0(f"interrupted: stopping after step {step}")
            save_final()
            finish(130)
        if step % checkpoint_interval == 0 and step not in (max_steps, stop_at_step):
            save(final=False)
except KeyboardInterrupt:
    print0(f"interrupted during step {step}")
    save_final()
    finish(130)
save_final()
print0(f"val loss: {first_val:.4f} at the start of this run -> {val:.4f} at step {step}")
finish(0)
