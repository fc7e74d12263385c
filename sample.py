"""Generate text from a checkpoint directory, with a KV cache.

    python sample.py --ckpt=out/default/ckpt --prompt="def fibonacci(n):" --max_new_tokens=200
"""
import os
import sys
import time

import torch

from checkpoint import CheckpointError, load_model, tokenizer_spec_of
from configurator import apply_overrides
from tokenizer import bos_id, eos_id, eot_id, load_tokenizer

ckpt = "out/default/ckpt"
prompt = "import "
max_new_tokens = 300
temperature = 0.8
top_k = 40  # 0: no top-k filter
num_samples = 1
seed = 1337
device = "auto"

apply_overrides(globals())
if device == "auto":
    device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(seed)


def next_token(logits):
    """Sample from softmax(logits / temperature) restricted to the top_k logits; greedy at temperature 0."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1))


def generate(model, prompt_ids, n_new, stop_ids):
    """prompt_ids + up to n_new sampled ids; the prompt is run once (prefill), then one token per step."""
    cache = model.new_cache(len(prompt_ids) + n_new)
    ids = list(prompt_ids)
    logits = model.decode(torch.tensor(ids, device=device), cache, 0).float()
    for _ in range(n_new):
        token = next_token(logits)
        ids.append(token)
        if token in stop_ids or len(ids) >= model.cfg.max_seq_len:
            break
        logits = model.decode(torch.tensor([token], device=device), cache, len(ids) - 1).float()
    return ids


def main():
    try:
        model = load_model(ckpt, device=device)
        enc = load_tokenizer(tokenizer_spec_of(ckpt))
    except (CheckpointError, OSError) as e:
        hint = "" if os.path.exists(ckpt) else \
            ". Train one first (python train.py) or convert HF weights (python convert.py hf2nano ...)"
        sys.exit(f"error: {e}{hint}")
    model.eval()
    prompt_ids = [bos_id(enc)] + enc.encode(prompt, disallowed_special=())
    stop_ids = {eos_id(enc), eot_id(enc)}
    for i in range(num_samples):
        t0 = time.time()
        ids = generate(model, prompt_ids, max_new_tokens, stop_ids)
        new = len(ids) - len(prompt_ids)
        text = enc.decode([t for t in ids[1:] if t < enc.n_vocab and t not in stop_ids])
        print(f"---- sample {i + 1} ({new} tokens, {new / (time.time() - t0):.1f} tok/s) ----\n{text}")


if __name__ == "__main__":
    main()
