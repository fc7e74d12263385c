"""Checkpoint directories: what train.py writes, and what sample.py, convert.py and --init_from read.

    DIR/config.json        {"model": LlamaConfig fields, "tokenizer": "bytes" or "tokenizer.model"}
    DIR/model.safetensors  the weights under model.py's names (a tied lm_head.weight is stored once, as
                           embed_tokens.weight)
    DIR/tokenizer.model    a copy of the tokenizer file, when the tokenizer is not the built-in byte one
    DIR/tokenizer.json ... the HF_SIDE_FILES found beside that tokenizer file (put there by convert.py hf2nano),
                           kept so that convert.py nano2hf exports them again (chat template, generation defaults)
    DIR/train_state.pt     optimizer, step, data loader position, RNG states (only in training checkpoints)

A save goes to DIR.tmp first and is renamed into place only when complete, so a crash mid-save leaves the
previous checkpoint intact.
"""
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from model import Llama, LlamaConfig

# Hugging Face files that travel with the tokenizer from an HF directory, through training, back to HF.
HF_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                 "generation_config.json")


def tokenizer_files(tokenizer_spec):
    """{name in the checkpoint: source file} of the tokenizer files a checkpoint keeps: none for "bytes", else
    the tokenizer file itself (as tokenizer.model) and the HF_SIDE_FILES in its directory."""
    if tokenizer_spec == "bytes":
        return {}
    beside = {name: os.path.join(os.path.dirname(tokenizer_spec), name) for name in HF_SIDE_FILES}
    return {"tokenizer.model": tokenizer_spec, **{name: path for name, path in beside.items() if os.path.isfile(path)}}


def save_checkpoint(out_dir, model, tokenizer_spec, train_state=None):
    """Write the checkpoint atomically: DIR.tmp is filled, the old DIR moved aside, DIR.tmp renamed to DIR."""
    tmp, old = out_dir + ".tmp", out_dir + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    tokenizer_name = "bytes" if tokenizer_spec == "bytes" else "tokenizer.model"
    for name, source in tokenizer_files(tokenizer_spec).items():
        shutil.copyfile(source, os.path.join(tmp, name))
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump({"model": model.cfg.to_dict(), "tokenizer": tokenizer_name}, f, indent=2)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.cfg.tie_embeddings:
        state.pop("lm_head.weight")
    save_file(state, os.path.join(tmp, "model.safetensors"))
    if train_state is not None:
        torch.save(train_state, os.path.join(tmp, "train_state.pt"))
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(out_dir):
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def find_checkpoint(ckpt_dir):
    """The directory to load: DIR, or DIR.old when a crash hit between the two renames of a save."""
    for d in (ckpt_dir, ckpt_dir + ".old"):
        if os.path.isfile(os.path.join(d, "config.json")) and os.path.isfile(os.path.join(d, "model.safetensors")):
            return d
    raise FileNotFoundError(f"no checkpoint in {ckpt_dir!r}: expected config.json and model.safetensors there")


def tokenizer_spec_of(ckpt_dir):
    """The load_tokenizer() spec of a checkpoint: "bytes" or the path of its tokenizer file."""
    ckpt_dir = find_checkpoint(ckpt_dir)
    with open(os.path.join(ckpt_dir, "config.json")) as f:
        name = json.load(f)["tokenizer"]
    return name if name == "bytes" else os.path.join(ckpt_dir, name)


def load_model(ckpt_dir, device="cpu", dtype=None, **config_overrides):
    """Build the Llama of a checkpoint and load its weights (strictly: a missing or unexpected tensor is an
    error naming it). config_overrides change config fields that don't touch weight shapes (max_seq_len)."""
    ckpt_dir = find_checkpoint(ckpt_dir)
    with open(os.path.join(ckpt_dir, "config.json")) as f:
        cfg = LlamaConfig(**{**json.load(f)["model"], **config_overrides})
    with torch.device("meta"):
        model = Llama(cfg)
    state = load_file(os.path.join(ckpt_dir, "model.safetensors"), device=str(device))
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    expected = set(model.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(f"{ckpt_dir}/model.safetensors does not match the config: "
                         f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    for name, p in model.state_dict().items():
        if p.shape != state[name].shape:
            raise ValueError(f"{ckpt_dir}/model.safetensors: {name} has shape {tuple(state[name].shape)}, "
                             f"the config expects {tuple(p.shape)}")
    model.load_state_dict(state, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.build_rope_cache(device)  # built on the meta device above: compute it for real
    return model.to(dtype=dtype) if dtype is not None else model
