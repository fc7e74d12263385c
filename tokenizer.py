"""Tokenizers: text <-> token ids, and the Llama-3 chat template.

Every tokenizer here is a `tiktoken.Encoding`: a regex first splits the text into pieces (words, numbers, runs of
punctuation or whitespace), then byte-pair merges turn each piece's UTF-8 bytes into ids. Two vocabularies:

  "bytes"            256 byte ids, no merges: a token is one UTF-8 byte. Needs no file; the default for small runs.
  Llama-3            the 128,000 byte-pair ranks of Meta's `tokenizer.model` (each line: "base64(token) rank").

Both append the same 256 Llama-3 special tokens after their regular ids (at 256.. for bytes, at 128000.. for
Llama-3), so the chat template and the bos/eos/eot helpers are written once for both.

Special tokens only ever come from code (render_chat, bos_id, ...): text is always encoded as plain text, so a
document that contains the characters "<|eot_id|>" gets the byte-pair tokens of those characters, never the
special id. That is what keeps user data from injecting control tokens. (Hugging Face's tokenizers match
special-token strings anywhere in a text, even with add_special_tokens=False; split_special_tokens=True does not.)

hf_tokenizer_json reads a Hugging Face tokenizer.json into an Encoding; tokenizer_json writes one from an Encoding.
"""
import base64
import json
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
] + [f"<|reserved_special_token_{i}|>" for i in range(2, 247)]
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


def is_byte_tokenizer(enc):
    """True when enc encodes exactly as byte_tokenizer() does: the same ranks, specials and split regex."""
    ref = byte_tokenizer()
    return (enc._mergeable_ranks, enc._special_tokens, enc._pat_str) == \
        (ref._mergeable_ranks, ref._special_tokens, ref._pat_str)


def load_tokenizer(spec):
    """spec: "bytes", a Llama-3 `tokenizer.model` file, a Hugging Face `tokenizer.json` file, or a directory that
    contains one (tokenizer.model first)."""
    if spec == "bytes":
        return byte_tokenizer()
    path = os.path.join(spec, "tokenizer.model") if os.path.isdir(spec) else spec
    if os.path.isdir(spec) and not os.path.isfile(path):
        path = os.path.join(spec, "tokenizer.json")
    if os.path.isfile(path):
        with open(path, "rb") as f:  # told apart by content, so a tokenizer.json saved as tokenizer.model works
            is_json = f.read(1) == b"{"
        return hf_tokenizer_json(path) if is_json else llama3_tokenizer(path)
    raise ValueError(
        f"tokenizer {spec!r}: expected 'bytes', a Llama-3 tokenizer.model file, a tokenizer.json file, "
        "or a directory containing one"
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
        <|start_header_id|>{role}<|end_header_id|>\\n\\n{content, stripped}<|eot_id|>     (once per message)

    loss_mask[i] = 1 where token i is a target the model is trained to predict: the tokens of assistant contents
    and the <|eot_id|> that ends each assistant turn (so the model learns to stop). Role, header and all other
    tokens get 0. Pieces are encoded separately and contents stripped of surrounding whitespace, as Meta's
    chat_format.py does: nothing merges across pieces, and the ids equal those of the whole rendered text.
    """
    start, end, eot = (enc.encode_single_token(t) for t in ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"))
    ids, mask = [bos_id(enc)], [0]
    for message in messages:
        role, content = message["role"], message["content"]
        if role not in CHAT_ROLES:
            raise ValueError(f"chat role {role!r}: expected one of {', '.join(CHAT_ROLES)}")
        header = [start] + encode_text(enc, role) + [end] + encode_text(enc, "\n\n")
        body = encode_text(enc, content.strip()) + [eot]
        ids += header + body
        mask += [0] * len(header) + [int(role == "assistant")] * len(body)
    return ids, mask


# render_chat as a Jinja template, for Hugging Face's apply_chat_template (tokenizer_config.json): the same text,
# hence the same ids (a stripped content cannot merge with the "\n\n" before it), except where a content holds a
# special token's text, which HF turns into the special id and render_chat keeps as text.
CHAT_TEMPLATE = (
    "{{- '<|begin_of_text|>' }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('chat role ' + message['role'] + ': expected one of system, user, assistant') }}"
    "{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + (message['content'] | trim)"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)

# ---- Hugging Face tokenizer.json (byte-level BPE) -> the same tiktoken Encoding ----

# GPT-2's split, which a ByteLevel pre-tokenizer with use_regex=true applies (tiktoken's "gpt2" pattern).
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def _gpt2_char_to_byte():
    """GPT-2's byte-level alphabet: tokenizer.json spells every byte as one printable character. The 188
    printable Latin-1 bytes stand for themselves; the other 68 (control bytes, space, 0x7f-0xa0, 0xad) become
    chr(256), chr(257), ... in byte order, which is why a leading space shows up as 'Ġ' (chr(288))."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(b for b in range(256) if b not in printable)})
    return table


def _hf_split_pattern(pre, path):
    """The one regex tiktoken must split with to cut text where the tokenizer.json pre-tokenizer does."""
    steps = (pre["pretokenizers"] if pre["type"] == "Sequence" else [pre]) if pre else []
    kinds = [step["type"] for step in steps]
    if kinds and kinds[-1] == "ByteLevel" and not steps[-1].get("add_prefix_space", True):
        use_regex = steps[-1].get("use_regex", True)
        if kinds == ["ByteLevel"] and use_regex:
            return GPT2_PATTERN
        split = steps[0]
        if kinds == ["Split", "ByteLevel"] and not use_regex and "Regex" in split["pattern"] \
                and split.get("behavior") == "Isolated" and not split.get("invert"):
            return split["pattern"]["Regex"]
    raise ValueError(f"{path}: pre_tokenizer is {kinds} ({json.dumps(pre)[:300]}); byte-level BPE needs "
                     "ByteLevel(use_regex=true) or Split(Regex, Isolated) + ByteLevel(use_regex=false), "
                     "both with add_prefix_space=false")


def hf_tokenizer_json(path):
    """A tiktoken Encoding that encodes like the byte-level BPE of a Hugging Face `tokenizer.json` (Llama-3's,
    GPT-2's, or one trained with the `tokenizers` library), its added tokens as special tokens.

    tokenizer.json spells each token with GPT-2's byte-to-character table; mapping back gives the token's bytes,
    and tiktoken's rank of a token is its id. The two libraries merge differently: HF applies the listed merges
    (a, b), lowest list position first; tiktoken merges any adjacent pair whose concatenation is a token, lowest
    rank (= id) first. They agree when the list is ordered by the id of what each merge makes, which we check:
    merge i makes a token whose id is no smaller than merge i-1's. Llama-3's file (made from tiktoken ranks)
    lists every two-token split of every token, so tiktoken merges no pair that HF lacks; a trained BPE's merges
    follow the greedy order its trainer applied. tests/test_hf_interop.py compares the two libraries token for
    token on a large text, for both kinds.
    """
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or spec.get("normalizer") or model.get("byte_fallback") \
            or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        found = {k: model.get(k) for k in ("type", "byte_fallback", "continuing_subword_prefix", "end_of_word_suffix")}
        raise ValueError(f"{path}: not a byte-level BPE tokenizer: model {found}, normalizer "
                         f"{(spec.get('normalizer') or {}).get('type')}")
    pattern = _hf_split_pattern(spec.get("pre_tokenizer"), path)
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    char_to_byte = _gpt2_char_to_byte()
    ranks = {}
    for token, i in model["vocab"].items():
        if token in special:
            continue
        try:
            ranks[bytes(char_to_byte[c] for c in token)] = i
        except KeyError as e:
            raise ValueError(f"{path}: vocab token {token!r} has character {e.args[0]!r}, not a GPT-2 byte") from None
    if missing := [b for b in range(256) if bytes([b]) not in ranks]:
        raise ValueError(f"{path}: no token for the bytes {missing[:8]}: tiktoken needs all 256")
    vocab, last = model["vocab"], -1
    for n, merge in enumerate(model.get("merges", [])):
        a, b = merge.split(" ") if isinstance(merge, str) else merge  # older files: "a b", newer: [a, b]
        ids = [vocab.get(a), vocab.get(b), vocab.get(a + b)]
        if None in ids or ids[2] < last:
            raise ValueError(f"{path}: merge {n} ({a!r}, {b!r}) has ids {ids}, the merge before made id {last}: "
                             "ids are not in merge order, so tiktoken ranks cannot reproduce this tokenizer")
        last = ids[2]
    rank_ids = set(ranks.values())
    if clash := [name for name, i in special.items() if i in rank_ids]:
        raise ValueError(f"{path}: added tokens {clash[:3]} share ids with byte-pair tokens")
    return tiktoken.Encoding(os.path.basename(path), pat_str=pattern, mergeable_ranks=ranks, special_tokens=special)


# ---- a tiktoken Encoding -> Hugging Face tokenizer files that encode the same ----

def _last_merge(ranks, token):
    """The two tokens that tiktoken joins last when it merges `token`'s bytes, or None if its merging never
    reaches `token` (then only a whole-piece lookup finds it). tiktoken's rule: join the adjacent pair whose
    concatenation has the lowest rank, until no pair's concatenation is a token."""
    parts = [token[i:i + 1] for i in range(len(token))]
    pair_ranks = [ranks.get(a + b, len(ranks)) for a, b in zip(parts, parts[1:])]  # len(ranks): not a token
    while len(parts) > 2:
        best = min(pair_ranks)
        if best == len(ranks):
            return None
        i = pair_ranks.index(best)  # the leftmost, as tiktoken
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
        del pair_ranks[i]
        if i > 0:
            pair_ranks[i - 1] = ranks.get(parts[i - 1] + parts[i], len(ranks))
        if i < len(parts) - 1:
            pair_ranks[i] = ranks.get(parts[i] + parts[i + 1], len(ranks))
    return parts


def tokenizer_json(enc):
    """A Hugging Face tokenizer.json (as a dict) whose byte-level BPE encodes every text as `enc` does.

    vocab: each regular token spelled with GPT-2's byte-to-character table, its id its tiktoken rank. Special
    tokens become added tokens with their ids. The pre-tokenizer splits with enc's regex, then spells bytes as
    characters (ByteLevel without a regex of its own).

    merges: for each token that merging can make, the pair tiktoken joins last when it merges the token's bytes
    (_last_merge), listed in id order. Why HF then encodes as tiktoken does: inside a longer piece, the joins
    that build a token t are the ones tiktoken makes on t's bytes alone (each step joins the lowest-rank pair,
    and no pair reaching outside t is joined before t is whole, since parts only grow), so every pair tiktoken
    joins is the listed pair of the token it makes. tiktoken joins the pair that makes the lowest rank (= id);
    HF the listed pair that comes first in the list, i.e. makes the lowest id. Every pair tiktoken may join is
    listed and HF joins only listed pairs, so both join the same pair at every step (the leftmost on a tie).
    A piece that is itself a token is looked up whole by both (ignore_merges), which also finds the tokens that
    merging never makes. A token can have a smaller id than its parts: why the merges follow ids, not lengths.

    post_processor: encode(text) puts <|begin_of_text|> first, as Llama-3's tokenizer.json does (and as
    data/prepare.py starts every document); encode(text, add_special_tokens=False) gives enc's ids exactly.
    """
    byte_to_char = {b: c for c, b in _gpt2_char_to_byte().items()}
    ranks = enc._mergeable_ranks  # tiktoken's documented way to extend an Encoding reads these fields too

    def spell(token):
        return "".join(byte_to_char[b] for b in token)

    merges = []
    for token, _ in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1 and (pair := _last_merge(ranks, token)):
            merges.append(f"{spell(pair[0])} {spell(pair[1])}")  # "a b": no spelled token holds a space
    specials = sorted(enc._special_tokens.items(), key=lambda item: item[1])
    bos = "<|begin_of_text|>"
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for name, i in specials],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": enc._pat_str}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id(enc)], "tokens": [bos]}},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": {spell(token): rank for token, rank in ranks.items()}, "merges": merges},
    }


def tokenizer_config():
    """Hugging Face's tokenizer_config.json beside a tokenizer_json(): loads as PreTrainedTokenizerFast (which
    uses tokenizer.json as it is), bos/eos named, decoding leaves spaces alone, render_chat's chat template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "chat_template": CHAT_TEMPLATE,
    }
