"""Tokenizers: text <-> token ids, and the Llama-3 chat template.

Every tokenizer here is a `tiktoken.Encoding`: a regex first splits the text into pieces (words, numbers, runs of
punctuation or whitespace), then byte-pair merges turn each piece's UTF-8 bytes into ids. Two vocabularies:

  "bytes"            256 byte ids, no merges: a token is one UTF-8 byte. Needs no file; the default for small runs.
  Llama-3            the 128,000 byte-pair ranks of Meta's `tokenizer.model` (each line: "base64(token) rank").

Both append the same 256 Llama-3 special tokens after their regular ids (at 256.. for bytes, at 128000.. for
Llama-3), so the chat template and the bos/eos/eot helpers are written once for both.

Special tokens only ever come from code (render_chat, bos_id, ...): text is always encoded as plain text, so a
document that contains the characters "<|eot_id|>" gets the byte-pair tokens of those characters, never the
special id. That is what keeps user data from injecting control tokens.
"""
import base64
import os

import tiktoken

# Llama-3's pre-tokenizer split (Meta's llama-models, llama3 tokenizer.py): contractions, letter runs with one
# optional leading non-letter, numbers of 1-3 digits, punctuation runs, newlines, other whitespace.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)

# The 256 special tokens of Llama-3.1, in id order (the first one gets id n_regular_tokens).
SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",  # end of message (a tool call follows)
    "<|eot_id|>",  # end of turn
    "<|python_tag|>",
] + [f"<|reserved_special_token_{i}|>" for i in range(2, 248)]
assert len(SPECIAL_TOKENS) == 256

CHAT_ROLES = ("system", "user", "assistant")


def _encoding(name, mergeable_ranks):
    """A tiktoken Encoding with the Llama-3 split regex and the special tokens placed after the regular ids."""
    n = len(mergeable_ranks)
    special = {token: n + i for i, token in enumerate(SPECIAL_TOKENS)}
    return tiktoken.Encoding(name, pat_str=LLAMA3_PATTERN, mergeable_ranks=mergeable_ranks, special_tokens=special)


def byte_tokenizer():
    """Ids 0..255 are the bytes themselves (no merges), 256..511 the special tokens: n_vocab = 512."""
    return _encoding("nanollama-bytes", {bytes([i]): i for i in range(256)})


def llama3_tokenizer(path):
    """The Llama-3 tokenizer from its `tokenizer.model` file: one "base64(token) rank" line per regular token."""
    ranks = {}
    with open(path, "rb") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError as e:  # wrong field count, bad base64 (binascii.Error is a ValueError), bad int
                raise ValueError(f"{path}:{line_number}: expected 'base64token rank', got {line[:60]!r}") from e
    # tiktoken needs the ranks to be exactly 0..n-1, each once (ranks double as ids)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not 0..{len(ranks) - 1}, each once (duplicate tokens or ranks?)")
    return _encoding(os.path.basename(path), ranks)


def load_tokenizer(spec):
    """spec: "bytes", a Llama-3 `tokenizer.model` file, or a directory that contains one."""
    if spec == "bytes":
        return byte_tokenizer()
    path = os.path.join(spec, "tokenizer.model") if os.path.isdir(spec) else spec
    if os.path.isfile(path):
        return llama3_tokenizer(path)
    raise ValueError(
        f"tokenizer {spec!r}: expected 'bytes', a Llama-3 tokenizer.model file, or a directory containing one"
    )


def bos_id(enc):
    return enc.encode_single_token("<|begin_of_text|>")


def eos_id(enc):
    return enc.encode_single_token("<|end_of_text|>")


def eot_id(enc):
    return enc.encode_single_token("<|eot_id|>")


def encode_text(enc, text):
    """Text as plain text: special-token strings inside it are NOT turned into special ids.
    (encode_ordinary is tiktoken's encode(text, allowed_special=set(), disallowed_special=()).)"""
    return enc.encode_ordinary(text)


def render_chat(enc, messages):
    """Llama-3 chat template -> (ids, loss_mask).

        <|begin_of_text|>
        <|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>     (once per message)

    loss_mask[i] = 1 where token i is a target the model is trained to predict: the tokens of assistant contents
    and the <|eot_id|> that ends each assistant turn (so the model learns to stop). Role, header and all other
    tokens get 0. Pieces are encoded separately, as Meta's chat_format.py does, so nothing merges across them.
    """
    start, end, eot = (enc.encode_single_token(t) for t in ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"))
    ids, mask = [bos_id(enc)], [0]
    for message in messages:
        role, content = message["role"], message["content"]
        if role not in CHAT_ROLES:
            raise ValueError(f"chat role {role!r}: expected one of {', '.join(CHAT_ROLES)}")
        header = [start] + encode_text(enc, role) + [end] + encode_text(enc, "\n\n")
        body = encode_text(enc, content) + [eot]
        ids += header + body
        mask += [0] * len(header) + [int(role == "assistant")] * len(body)
    return ids, mask
