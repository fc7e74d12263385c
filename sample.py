"""Generate text from a checkpoint directory, with a KV cache.

    python sample.py --ckpt=out/default/ckpt --prompt="def fibonacci(n):" --max_new_tokens=200
    python sample.py --ckpt=out/sft/ckpt --chat=True --prompt="What is the capital of France?"  # one reply
    python sample.py --ckpt=out/sft/ckpt --chat=True [--system="Be brief."]                    # a conversation

With chat=True the turns go through the checkpoint's own chat template (the one it was fine-tuned with:
tokenizer.render_chat), generation stops at the template's end-of-turn token, and without a prompt each line you
type is a user turn answered in the same conversation (an empty line or Ctrl-D ends it).

The model sees at most its max_seq_len tokens: of a longer prompt, the last max_seq_len; past that many tokens in
all, generation goes on over the most recent ones (see generate).
"""
import os
import re
import sys
import time

from configurator import apply_overrides, exit_if_help

exit_if_help(__file__)  # before importing torch, which is slow

import torch  # noqa: E402

from files import FileError
from checkpoint import checkpoint_tokenizer, load_model
from tokenizer import bos_id, encode_text, render_chat, stop_ids

ckpt = "out/default/ckpt"
prompt = None  # text to continue ("import " when not given), or with chat=True the user's message
chat = False  # render the prompt as a chat through the checkpoint's chat template (no prompt: a conversation)
system = ""  # with chat=True: a system message to start the conversation with
max_new_tokens = 300
temperature = 0.8
top_k = 40  # 0: no top-k filter
num_samples = 1
seed = 1337
device = "auto"

apply_overrides(globals())
if device == "auto":
    device = "cuda" if torch.cuda.is_available() else "cpu"


def next_token(logits):
    """Sample from softmax(logits / temperature) restricted to the top_k logits; greedy at temperature 0."""
    if temperature == 0:
        return int(logits.argmax())
    logits = (logits - logits.max()) / temperature  # <= 0: no overflow at a tiny temperature (greedy, in effect)
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1))


def generate(model, prompt_ids, n_new, stops):
    """prompt_ids + n_new sampled ids (fewer only after a stop token). The prompt is run once (prefill), then one
    token per step. Positions end at max_seq_len (the RoPE tables do): a longer prompt is cut to its last
    max_seq_len tokens, and when the cache is full it starts over with the last max_seq_len // 2 tokens, prefilled
    from position 0 again, as training cuts a long document into pieces that each start at position 0."""
    window = model.cfg.max_seq_len
    cache_len = min(window, len(prompt_ids) + n_new)
    cache = model.new_cache(cache_len)
    ids = list(prompt_ids)
    context = ids[-window:]
    logits = model.decode(torch.tensor(context, device=device), cache, 0).float()
    n_cached = len(context)
    for _ in range(n_new):
        token = next_token(logits)
        ids.append(token)
        if token in stops or len(ids) == len(prompt_ids) + n_new:
            break
        if n_cached == cache_len:  # full: start over from the most recent tokens
            context = ids[-max(1, window // 2):]
            logits = model.decode(torch.tensor(context, device=device), cache, 0).float()
            n_cached = len(context)
        else:
            logits = model.decode(torch.tensor([token], device=device), cache, n_cached).float()
            n_cached += 1
    return ids


def notes(prompt_ids, window):
    if len(prompt_ids) > window:
        print(f"note: the prompt is {len(prompt_ids)} tokens, more than the model's max_seq_len ({window}): it sees "
              f"only the last {window}", file=sys.stderr)
    if len(prompt_ids) + max_new_tokens > window:
        print(f"note: past {window} tokens (max_seq_len) the model sees only the most recent ones: each time its "
              f"cache is full it starts over from the last {max(1, window // 2)}", file=sys.stderr)


def reply(model, enc, messages, stops):
    """The assistant's next message in `messages`, rendered with the chat template's generation prompt."""
    prompt_ids = render_chat(enc, messages, add_generation_prompt=True)[0]
    notes(prompt_ids, model.cfg.max_seq_len)
    new = generate(model, prompt_ids, max_new_tokens, stops)[len(prompt_ids):]
    return enc.decode([t for t in new if t not in stops])


def converse(model, enc, stops):
    """--chat without a prompt: each line typed is a user turn; the conversation is kept."""
    messages = [{"role": "system", "content": system}] if system else []
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        answer = reply(model, enc, messages, stops)
        messages.append({"role": "assistant", "content": answer})
        print(answer, flush=True)


def settings_error():
    """What is wrong with the settings, as one line, or None. Checked before the model loads (a big one loads
    slowly), and in words rather than the traceback torch would give some time later."""
    if not 0 <= temperature < float("inf"):
        return f"temperature={temperature}: expected 0 (greedy) or more, finite"
    if not 0 <= seed < 2**63:
        return f"seed={seed}: expected 0 .. 2**63 - 1"
    if top_k < 0:
        return f"top_k={top_k}: expected 0 (no top-k filter) or more"
    if num_samples < 1:
        return f"num_samples={num_samples}: expected 1 or more"
    if max_new_tokens < 0:
        return f"max_new_tokens={max_new_tokens}: expected 0 or more"
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        return f"device={device!r}: expected auto, cpu, cuda or cuda:N"
    if device.startswith("cuda") and not torch.cuda.is_available():
        return f"--device={device} but this torch has no CUDA (a CPU build, or no GPU visible): use --device=cpu"
    return None


# A prompt longer than this many characters is shown only by its last PROMPT_TAIL ones: a pasted file would push
# the generated text off the screen
LONG_PROMPT, PROMPT_TAIL = 500, 200


def sample_text(enc, prompt_ids, ids, stops):
    """The sample as printed: the prompt's text, cut to its end when long ("…" + the tail), then the new text."""
    def text(part):
        return enc.decode([t for t in part if t < enc.n_vocab and t not in stops])

    whole, prompt_text = text(ids[1:]), text(prompt_ids[1:])  # [1:]: not the bos
    if len(prompt_text) > LONG_PROMPT and whole.startswith(prompt_text):
        return "…" + prompt_text[-PROMPT_TAIL:] + whole[len(prompt_text):]
    return whole


def main():
    error = settings_error()
    if error:
        sys.exit(f"error: {error}")
    torch.manual_seed(seed)
    try:
        model = load_model(ckpt, device=device)
        enc = checkpoint_tokenizer(ckpt)
    except (FileError, OSError) as e:
        hint = "" if os.path.exists(ckpt) else \
            ". Train one first (python train.py) or convert HF weights (python convert.py hf2nano ...)"
        sys.exit(f"error: {e}{hint}")
    model.eval()
    stops = stop_ids(enc)  # end of text or of a chat turn: Llama-3 <|end_of_text|> <|eot_id|>, ChatML <|im_end|>
    if chat:
        try:
            if prompt is None:
                return converse(model, enc, stops)
            first = [{"role": "system", "content": system}] if system else []
            return print(reply(model, enc, first + [{"role": "user", "content": prompt}], stops))
        except ValueError as e:  # the template refuses the conversation
            sys.exit(f"error: {e}")
    prompt_ids = [bos_id(enc)] + encode_text(enc, "import " if prompt is None else prompt)
    notes(prompt_ids, model.cfg.max_seq_len)
    for i in range(num_samples):
        t0 = time.time()
        ids = generate(model, prompt_ids, max_new_tokens, stops)
        new = len(ids) - len(prompt_ids)
        ended = ", ended by a stop token" if new and ids[-1] in stops else ""
        text = sample_text(enc, prompt_ids, ids, stops)
        print(f"---- sample {i + 1} ({new} tokens{ended}, {new / (time.time() - t0):.1f} tok/s) ----\n{text}")


if __name__ == "__main__":
    main()
