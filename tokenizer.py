"""Tokenizers: text <-> token ids, and chat templates: a conversation -> ids and the loss mask.

Every tokenizer here is a `tiktoken.Encoding`: a regex first splits the text into pieces (words, numbers, runs of
punctuation or whitespace), then byte-pair merges turn each piece's UTF-8 bytes into ids. Three kinds:
  "bytes"            256 byte ids, no merges: a token is one UTF-8 byte. Needs no file; the default for small runs.
  Llama-3            the 128,000 byte-pair ranks of Meta's `tokenizer.model` (each line: "base64(token) rank").
  tokenizer.json     any byte-level BPE of Hugging Face's `tokenizers` (SmolLM2, Qwen2/3, GPT-2, Llama-3's own), read
                     with its own split pattern, normalizer, added tokens and missing bytes: hf_tokenizer_json, and
                     encoding as `tokenizers` does (HFEncoding where tiktoken alone would not).
SentencePiece tokenizers (Llama-2, Mistral, TinyLlama) are refused: their pieces are not byte-level.

The first two append the same 256 Llama-3 special tokens after their regular ids (at 256.. for bytes, at 128000..
for Llama-3). A tokenizer.json brings its own; bos_id, eos_id and eot_id find theirs by name (ROLES).

Chats: render_chat renders the tokenizer's chat template (the Jinja template of the Hugging Face files beside its
file, else ours: Llama-3's, or ChatML for a tokenizer with <|im_start|>) as transformers does, and marks each
assistant turn as the targets.

Special tokens only ever come from code and templates (render_chat, bos_id, ...): text is always encoded as plain
text, so a document or a message that contains the characters "<|eot_id|>" gets the byte-pair tokens of those
characters, never the special id. That keeps user data from injecting control tokens. (`tokenizers` matches
special-token strings anywhere in a text unless told split_special_tokens / encode_special_tokens.)

hf_tokenizer_json reads a Hugging Face tokenizer.json into an Encoding; tokenizer_json writes one from an Encoding.
"""
import base64
import collections
import datetime
import functools
import json
import os
import unicodedata

import jinja2
import jinja2.nodes
import jinja2.sandbox
import regex
import tiktoken

from files import NULL, FileError, check_types, need, read_json

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

# Which special token plays each part, by name, the first one the tokenizer has. Llama-3 names its own. GPT-2,
# SmolLM2 and Qwen2/3 put <|endoftext|> between the documents of their pretraining, so here it both starts (bos)
# and ends (eos) a document (Qwen's config.json has it as bos_token_id too). ChatML ends a turn with <|im_end|>.
ROLES = {"bos": ("<|begin_of_text|>", "<|endoftext|>"), "eos": ("<|end_of_text|>", "<|endoftext|>"),
         "eot": ("<|eot_id|>", "<|im_end|>")}

# What config.json and meta.json call a tokenizer (tokenizer_name): no file, tiktoken ranks, a tokenizer.json
TOKENIZER_NAMES = ("bytes", "tokenizer.model", "tokenizer.json")

SENTENCEPIECE_REFUSED = ("SentencePiece tokenizers (Llama-2, Mistral, TinyLlama) are not supported, only byte-level "
                         "BPE ones (Llama-3, GPT-2, SmolLM2, Qwen2/3)")


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
        head = f.read(4096)
        if any(b < 9 or 13 < b < 32 or b > 126 for b in head):  # a tiktoken file is ASCII text
            raise FileError(f"{path}: binary, not tiktoken ranks: a SentencePiece model (protobuf)? "
                            f"{SENTENCEPIECE_REFUSED}")
        f.seek(0)
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError as e:  # wrong field count, bad base64 (binascii.Error is a ValueError), bad int
                raise FileError(f"{path}:{line_number}: expected 'base64token rank', got {line[:60]!r}") from e
    # tiktoken needs the ranks to be exactly 0..n-1, each once (ranks double as ids)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise FileError(f"{path}: ranks are not 0..{len(ranks) - 1}, each once (duplicate tokens or ranks?)")
    return _encoding(os.path.basename(path), ranks)


def same_encoding(a, b):
    """True when two tokenizers encode alike: the same ranks, specials and split regex (whatever their files)."""
    return (a._mergeable_ranks, a._special_tokens, a._pat_str) == (b._mergeable_ranks, b._special_tokens, b._pat_str)


def is_byte_tokenizer(enc):
    """True when enc encodes exactly as byte_tokenizer() does."""
    return same_encoding(enc, byte_tokenizer())


def tokenizer_file(spec):
    """The file a load_tokenizer spec reads: spec itself, or the tokenizer.model (first) or tokenizer.json in the
    directory spec; None for "bytes"."""
    if spec == "bytes":
        return None
    path = os.path.join(spec, "tokenizer.model") if os.path.isdir(spec) else spec
    if os.path.isdir(spec) and not os.path.isfile(path):
        path = os.path.join(spec, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileError(f"tokenizer {spec!r}: missing; expected 'bytes', a Llama-3 tokenizer.model file, a "
                        "tokenizer.json file, or a directory containing one")
    return path


def is_json_file(path):
    """Told apart by content, so that a checkpoint holding a tokenizer.json named tokenizer.model still reads."""
    with open(path, "rb") as f:
        return f.read(1) == b"{"


def tokenizer_name(spec):
    """What a checkpoint or a dataset calls its copy of the tokenizer (config.json's / meta.json's "tokenizer"):
    "bytes" (no file), "tokenizer.json" (a Hugging Face tokenizer.json, kept as it is) or "tokenizer.model"
    (tiktoken ranks, read with Llama-3's split pattern and special tokens)."""
    path = tokenizer_file(spec)
    return TOKENIZER_NAMES[0] if path is None else TOKENIZER_NAMES[2 if is_json_file(path) else 1]


def load_tokenizer(spec):
    """spec: "bytes", a Llama-3 `tokenizer.model` file, a Hugging Face `tokenizer.json` file, or a directory that
    contains one (tokenizer.model first). The chat template of the Hugging Face files beside the file, if any,
    comes with it (enc.chat_template, enc.template_names, enc.template_path: read_chat_template); render_chat
    renders it. enc.path is the file read."""
    path = tokenizer_file(spec)
    if path is None:
        return byte_tokenizer()
    enc = hf_tokenizer_json(path) if is_json_file(path) else llama3_tokenizer(path)
    enc.chat_template, enc.template_names, enc.template_path = read_chat_template(os.path.dirname(path))
    enc.path = path
    return enc


# Hugging Face files that travel with the tokenizer from an HF directory, through datasets and training, back to HF.
HF_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                 "generation_config.json")


def tokenizer_files(spec):
    """{name in a checkpoint or dataset: source file} of the tokenizer files it keeps: none for "bytes", else the
    tokenizer file itself (as tokenizer.model or tokenizer.json: tokenizer_name) and the HF_SIDE_FILES beside it."""
    if spec == "bytes":
        return {}
    path = tokenizer_file(spec)
    beside = {name: os.path.join(os.path.dirname(path), name) for name in HF_SIDE_FILES}
    side = {name: source for name, source in beside.items() if os.path.isfile(source)}
    return {**side, tokenizer_name(spec): path}  # the tokenizer itself wins a name clash


def special_token(enc, role):
    """The name of the special token that plays `role` ("bos", "eos" or "eot") in enc: see ROLES."""
    for name in ROLES[role]:
        if name in enc.special_tokens_set:
            return name
    message = f"no {role} token among its special tokens (expected one of {', '.join(ROLES[role])})"
    path = getattr(enc, "path", None)  # set by load_tokenizer: then the file is at fault
    raise FileError(f"{path}: {message}") if path else ValueError(f"tokenizer {enc.name}: {message}")


def bos_id(enc):
    return enc.encode_single_token(special_token(enc, "bos"))


def eos_id(enc):
    return enc.encode_single_token(special_token(enc, "eos"))


def eot_id(enc):
    return enc.encode_single_token(special_token(enc, "eot"))


def stop_ids(enc):
    """The ids that end a generation: the end of a text, and the end of a chat turn (when enc has one)."""
    has_eot = any(name in enc.special_tokens_set for name in ROLES["eot"])
    return {eos_id(enc), eot_id(enc)} if has_eot else {eos_id(enc)}


def is_chatml(enc):
    """Does enc chat in ChatML (SmolLM2, Qwen) rather than in Llama-3's format?"""
    return "<|im_start|>" in enc.special_tokens_set


def encode_text(enc, text, added_words=True):
    """Text as plain text: special-token strings inside it are NOT turned into special ids (as `tokenizers` with
    split_special_tokens=True). Added tokens that are not special (HFEncoding.added_words: Qwen's <think>) are
    matched, as `tokenizers` matches them, unless added_words=False."""
    if not added_words and isinstance(enc, HFEncoding):
        return enc.encode_plain(text)
    return enc.encode_ordinary(text)


def render_chat(enc, messages, add_generation_prompt=False):
    """A conversation [{"role", "content", ...}] -> (ids, loss_mask), through enc's chat template (chat_template_of:
    the checkpoint's own Jinja template, or ours), id for id what transformers' apply_chat_template(messages,
    sanitize_control_tokens=True) gives: the template's text is rendered with jinja2 as transformers renders it
    (render_template), special-token text the template writes becomes special ids, and special-token text inside a
    message stays plain text (encode_rendered), so no data can inject a control token.

    loss_mask[i] = 1 where token i is a target: each assistant turn's tokens, from the first token after the
    template's generation prompt (what a model writes when prompted, e.g. "<|im_start|>assistant\\n" before it, and
    Qwen3's "<think>...</think>" in it) through the turn's end token (<|eot_id|>, <|im_end|>), so the model learns
    to stop; 0 for everything else. The prompt of assistant turn i is the conversation before it rendered with
    add_generation_prompt: the whole conversation must start with that text (else ValueError naming the turn), and
    the turn's targets start at the first token where the two encodings part (a token that joins the prompt's
    last bytes with the turn's first ones counts as the turn's).
    """
    if not messages:
        raise ValueError("empty conversation")
    text = render_template(enc, messages, add_generation_prompt)
    ids = encode_rendered(enc, text)
    mask = [0] * len(ids)
    stops, start = stop_ids(enc), 0
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render_template(enc, messages[:turn], add_generation_prompt=True)
        if not text.startswith(prompt):
            raise template_error(enc, f"the conversation before message {turn + 1} renders differently on its own "
                                      "than inside the whole conversation, so its assistant tokens cannot be told")
        prompt_ids = encode_rendered(enc, prompt)
        start = max(start, next((i for i, (a, b) in enumerate(zip(prompt_ids, ids)) if a != b), len(prompt_ids)))
        end = next((i for i in range(start, len(ids)) if ids[i] in stops), None)
        if end is None:
            raise template_error(enc, f"assistant message {turn + 1} is not followed by an end-of-turn token of "
                                      f"{getattr(enc, 'path', enc.name)} "
                                      f"({', '.join(enc.decode([i]) for i in sorted(stops))})")
        mask[start:end + 1] = [1] * (end + 1 - start)
        start = end + 1
    return ids, mask


def render_template(enc, messages, add_generation_prompt=False):
    """The text of enc's chat template for `messages`, rendered as transformers renders it (jinja2's sandbox with
    trim_blocks and lstrip_blocks, its raise_exception, strftime_now and tojson; the tokenizer_config's bos_token,
    eos_token, ... as variables). Special-token text inside a message's strings is wrapped in two private-use
    markers (CONTROL_MARKS) that encode_rendered reads: the same marking as transformers' sanitize_control_tokens."""
    template, names = chat_template_of(enc)
    marked = _mark_control_tokens(messages, _control_token_pattern(enc, template))
    try:
        return _compiled(template).render(messages=marked, tools=None, documents=None,
                                          add_generation_prompt=add_generation_prompt, **names)
    except jinja2.TemplateError as e:  # the template's raise_exception: it refuses the conversation
        raise template_error(enc, str(e)) from None
    except Exception as e:  # noqa: BLE001  a template is a program from a file: whatever else it raises is a bug in it
        raise template_error(enc, f"{type(e).__name__}: {e}") from None


def template_error(enc, message):
    """The error of enc's chat template: a FileError naming the template's file when it came from one."""
    path = getattr(enc, "template_path", None)
    return FileError(f"{path}: chat template: {message}") if path else ValueError(f"chat template: {message}")


CONTROL_MARKS = ("\U000f0000", "\U000f0001")  # transformers' markers (Unicode private use plane 15)


def encode_rendered(enc, text):
    """A rendered chat -> ids, as transformers' encode_marked_chat: the text is cut at marked control tokens (their
    text encoded as plain text) and at lone markers (dropped); the other pieces match every added token
    (special or not) as its id. Each piece but the first is encoded after a "\\n" that is then removed, where that
    leaves the newline's own ids in front (transformers' guard against a SentencePiece prefix space)."""
    start, end = CONTROL_MARKS
    names = sorted(enc.special_tokens_set, key=len, reverse=True)  # leftmost-longest, as tokenizers matches
    any_name = "|".join(map(regex.escape, names)) or "(?!)"  # no added tokens: a pattern that never matches
    pieces = regex.split(f"{start}({any_name}){end}|[{start}{end}]", text)
    added = regex.compile(any_name)
    newline = encode_text(enc, "\n")

    def encode(piece, as_text):
        if as_text:
            return encode_text(enc, piece, added_words=False)
        ids, at = [], 0
        for match in added.finditer(piece):
            ids += encode_text(enc, piece[at:match.start()]) + [enc.encode_single_token(match.group())]
            at = match.end()
        return ids + encode_text(enc, piece[at:])

    ids = encode(pieces[0], False)
    for i, piece in enumerate(pieces[1:], 1):
        if piece:
            piece_ids = encode("\n" + piece, i % 2 == 1)
            ids += piece_ids[len(newline):] if piece_ids[:len(newline)] == newline else encode(piece, i % 2 == 1)
    return ids


def _control_token_pattern(enc, template):
    """The regex of the tokens that count as control tokens in messages (transformers' _get_control_tokens): every
    special token, and each added word (a non-special added token) that the template's literal text holds."""
    literals = _template_literals(template)
    words = getattr(enc, "added_words", ())
    tokens = [t for t in enc.special_tokens_set if t not in words or (t in literals and not t.isspace())]
    return regex.compile("|".join(map(regex.escape, sorted(tokens, key=len, reverse=True))) or "(?!)")


def _mark_control_tokens(value, pattern):
    """value (strings, lists and dicts of them) with each control token in its strings wrapped in CONTROL_MARKS;
    markers already in a string are removed first, so none can be forged."""
    start, end = CONTROL_MARKS
    if isinstance(value, str):
        return pattern.sub(f"{start}\\g<0>{end}", value.replace(start, "").replace(end, ""))
    if isinstance(value, dict):
        return {key: _mark_control_tokens(item, pattern) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_mark_control_tokens(item, pattern) for item in value]
    return value


@functools.lru_cache(maxsize=16)
def _compiled(template):
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template: {e}") from None


def _raise_template_error(message):
    raise jinja2.TemplateError(message)


@functools.lru_cache(maxsize=16)
def _template_literals(template):
    """The template's literal text and string constants, joined by NULs so no match spans two of them."""
    ast = _compiled(template).environment.parse(template)
    literals = {node.data for node in ast.find_all(jinja2.nodes.TemplateData)}
    literals |= {node.value for node in ast.find_all(jinja2.nodes.Const) if isinstance(node.value, str)}
    return "\0".join(literals)


def chat_template_of(enc):
    """(template, {"bos_token": ..., ...}): the chat template enc was loaded with (load_tokenizer: the Hugging Face
    files beside its tokenizer file), else ours: ChatML for a tokenizer with <|im_start|>, Llama-3's otherwise."""
    if getattr(enc, "chat_template", None):
        return enc.chat_template, enc.template_names
    return (CHATML_TEMPLATE, {}) if is_chatml(enc) else \
        (CHAT_TEMPLATE, {"bos_token": special_token(enc, "bos"), "eos_token": special_token(enc, "eos")})


def read_chat_template(folder):
    """The chat template of the Hugging Face files in folder, as transformers reads it: chat_template.jinja, else
    tokenizer_config.json's "chat_template" (a string, or a list of named ones: "default"); and the special-token
    names its tokenizer_config.json gives (bos_token, ...); and the file the template came from. (None, {}, None)
    where there is none."""
    config, template = {}, None
    path = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(path):
        config = read_json(path)
        template = config.get("chat_template")
        if isinstance(template, list):
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                            None)
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        path = jinja
        try:
            with open(jinja, encoding="utf-8") as f:
                template = f.read()
        except ValueError as e:  # not UTF-8
            raise FileError(f"{jinja}: damaged ({e})") from None
    if template is not None:
        if not isinstance(template, str):
            raise FileError(f"{path}: chat_template is {json.dumps(template)[:40]}, expected a string")
        try:
            _compiled(template)
        except ValueError as e:  # a Jinja syntax error
            raise FileError(f"{path}: {e}") from None
    names = {}
    for key in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value  # {"content": ..., ...}: an AddedToken
        if isinstance(value, str):
            names[key] = value
    return template, names, path if template is not None else None


# Our chat templates, for tokenizers that bring none: Llama-3's format (contents stripped) and ChatML (SmolLM2's
# and Qwen2.5's text without their default system message).
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('chat role ' + message['role'] + ': expected one of system, user, assistant') }}"
    "{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + (message['content'] | trim)"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('chat role ' + message['role'] + ': expected one of system, user, assistant') }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

# ---- Hugging Face tokenizer.json (byte-level BPE) -> the same tiktoken Encoding ----

# GPT-2's split, which a ByteLevel pre-tokenizer with use_regex=true applies (tiktoken's "gpt2" pattern).
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def gpt2_digits_pattern(individual):
    r"""Sequence[Digits(individual_digits), ByteLevel(use_regex=true)] (SmolLM2's pre-tokenizer) as one regex.

    Digits cuts the numeric characters out of the text (\p{N}: Rust's char::is_numeric), each one a piece of its
    own (individual) or each run of them; ByteLevel then splits every other run with GPT-2's regex, and such a run
    ends at a digit as the text ends at its end. Over the whole text that is GPT-2's regex with: no " ?\p{N}+"
    (no run holds a digit), the digits as pieces, and "\s+(?!\S)" (whitespace up to the last space before a
    non-space) told that a digit ends a run too: "\s+(?![^\s\p{N}])". No other alternative matches a digit, so
    no piece crosses one.
    """
    digits = r"\p{N}" if individual else r"\p{N}+"
    return rf"'s|'t|'re|'ve|'m|'ll|'d| ?\p{{L}}+|{digits}| ?[^\s\p{{L}}\p{{N}}]+|\s+(?![^\s\p{{N}}])|\s+"


class HFEncoding(tiktoken.Encoding):
    """An Encoding that encodes plain text exactly as `tokenizers` does with a tokenizer.json where tiktoken alone
    would not (tests/test_tokenizer_real.py compares the two on text holding every byte value):

    - added words: added tokens that are not special (Qwen's <think>, <tool_call>) are matched in any text, as
      `tokenizers` matches them, and the text between them is encoded on its own;
    - NFC: with the normalizer {"type": "NFC"} (Qwen2/3) text is put in Unicode's composed form first, so "e" +
      U+0301 encodes as "é";
    - missing bytes: a vocabulary may lack single-byte tokens (SmolLM2 has none for 21 bytes that never occur in
      its training data: 4, 6, 19, 20, 22, 29, 192, 193, 241-255). `tokenizers`' BPE drops a byte it has no token
      for and merges the bytes on either side of it as if they were adjacent; tiktoken needs every byte. So a
      text holding such a byte is split into pre-tokenizer pieces here (the same regex, with the `regex` module
      tiktoken itself depends on), its missing bytes deleted from each piece, and the rest merged by tiktoken's
      byte-pair encoder. Texts without one (nearly all) take tiktoken's fast path.
    Special tokens stay text (encode_text); only encode_ordinary is changed, the one call nanollama makes.
    """

    def __init__(self, name, *, nfc=False, missing_bytes=(), added_words=(), **kwargs):
        super().__init__(name, **kwargs)
        self.nfc = nfc
        self.missing_bytes = bytes(sorted(missing_bytes))
        self.added_words = tuple(added_words)
        self._pieces = regex.compile(self._pat_str)
        longest_first = sorted(self.added_words, key=len, reverse=True)  # tokenizers matches leftmost-longest
        self._added = regex.compile("|".join(map(regex.escape, longest_first))) if added_words else None

    def encode_ordinary(self, text):
        if self._added is None:
            return self.encode_plain(text)
        ids, start = [], 0
        for match in self._added.finditer(text):
            ids += self.encode_plain(text[start:match.start()]) + [self._special_tokens[match.group()]]
            start = match.end()
        return ids + self.encode_plain(text[start:])

    def encode_plain(self, text):
        """text without added words: NFC, then byte pairs (missing bytes dropped)."""
        if self.nfc:
            text = unicodedata.normalize("NFC", text)
        if not self.missing_bytes:
            return super().encode_ordinary(text)
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates (from JSON's "\\ud800"): U+FFFD, as tiktoken does
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            data = text.encode("utf-8")
        if len(data.translate(None, self.missing_bytes)) == len(data):
            return super().encode_ordinary(text)
        ids = []
        for piece in self._pieces.findall(text):
            kept = piece.encode("utf-8").translate(None, self.missing_bytes)
            if kept:
                ids += self._encode_single_piece(kept)
        return ids


def _gpt2_char_to_byte():
    """GPT-2's byte-level alphabet: tokenizer.json spells every byte as one printable character. The 188
    printable Latin-1 bytes stand for themselves; the other 68 (control bytes, space, 0x7f-0xa0, 0xad) become
    chr(256), chr(257), ... in byte order, which is why a leading space shows up as 'Ġ' (chr(288))."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(b for b in range(256) if b not in printable)})
    return table


def pre_tokenizer_steps(pre):
    """The steps of a tokenizer.json pre_tokenizer: a Sequence's, or itself; [] for none or any other shape."""
    steps = pre.get("pretokenizers") if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre] if pre \
        else []
    is_steps = isinstance(steps, list) and all(isinstance(s, dict) and isinstance(s.get("type"), str) for s in steps)
    return steps if is_steps else []


def _hf_split_pattern(pre, path):
    """The one regex tiktoken must split with to cut text where the tokenizer.json pre-tokenizer does."""
    steps = pre_tokenizer_steps(pre)
    kinds = [step["type"] for step in steps]
    if kinds and kinds[-1] == "ByteLevel" and not steps[-1].get("add_prefix_space", True):
        use_regex = steps[-1].get("use_regex", True)
        if kinds == ["ByteLevel"] and use_regex:  # GPT-2
            return GPT2_PATTERN
        if kinds == ["Digits", "ByteLevel"] and use_regex:  # SmolLM2
            return gpt2_digits_pattern(steps[0].get("individual_digits", False))
        split = steps[0]
        if kinds == ["Split", "ByteLevel"] and not use_regex and isinstance(split.get("pattern"), dict) \
                and isinstance(split["pattern"].get("Regex"), str) \
                and split.get("behavior") == "Isolated" and not split.get("invert"):  # Llama-3, Qwen2/3
            return split["pattern"]["Regex"]
    raise FileError(f"{path}: pre_tokenizer is {kinds} ({json.dumps(pre)[:300]}); byte-level BPE needs "
                    "ByteLevel(use_regex=true), Digits + ByteLevel(use_regex=true), or Split(Regex, Isolated) + "
                    "ByteLevel(use_regex=false), all with add_prefix_space=false")


def _sentencepiece_sign(spec):
    """What marks a tokenizer.json as a SentencePiece tokenizer converted by transformers (Llama-2, Mistral,
    TinyLlama: "▁" for a space, unknown characters as <0xNN> byte tokens), or None."""
    model = spec.get("model") or {}
    if model.get("type") == "Unigram":
        return "a Unigram model"
    if model.get("byte_fallback"):
        return "model.byte_fallback=true"
    if "Metaspace" in json.dumps([spec.get("pre_tokenizer"), spec.get("decoder")]):
        return "a Metaspace pre-tokenizer"
    if "\u2581" in json.dumps(spec.get("normalizer"), ensure_ascii=False):
        return "a normalizer that writes spaces as '\u2581'"
    return None


def hf_tokenizer_json(path):
    """A tiktoken Encoding that encodes like the byte-level BPE of a Hugging Face `tokenizer.json` (Llama-3's,
    GPT-2's, SmolLM2's, Qwen2/3's, or one trained with the `tokenizers` library), its added tokens as special
    tokens. Its pre-tokenizer becomes tiktoken's split regex (_hf_split_pattern); an NFC normalizer, added tokens
    that are not special, or single bytes without a token make it an HFEncoding.
    A SentencePiece tokenizer.json (byte_fallback, Metaspace: Llama-2, Mistral, TinyLlama) is refused.

    tokenizer.json spells each token with GPT-2's byte-to-character table; mapping back gives the token's bytes,
    and tiktoken's rank of a token is its id. The two libraries merge differently: HF applies the listed merges
    (a, b), lowest list position first; tiktoken merges any adjacent pair whose concatenation is a token, lowest
    rank (= id) first. They agree when the list is ordered by the id of what each merge makes, which we check:
    merge i makes a token whose id is no smaller than merge i-1's. Llama-3's file (made from tiktoken ranks)
    lists every two-token split of every token, so tiktoken merges no pair that HF lacks; a trained BPE's merges
    follow the greedy order its trainer applied. tests/test_hf_interop.py and tests/test_families.py compare the
    two libraries token for token on a large text, for every kind of pre-tokenizer.
    """
    spec = read_json(path, {"model": dict})
    check_types(spec, {"normalizer": (dict, NULL), "added_tokens": list}, path)
    model = spec["model"]
    check_types(model, {"vocab": dict, "merges": list}, f"{path}: model")
    if sign := _sentencepiece_sign(spec):
        raise FileError(f"{path}: a SentencePiece tokenizer ({sign}). {SENTENCEPIECE_REFUSED}")
    need(model, "vocab", dict, f"{path}: model")
    for token, i in model["vocab"].items():
        if type(i) is not int or not 0 <= i < 2**31:
            raise FileError(f"{path}: vocab token {token[:40]!r} has id {json.dumps(i)[:40]}")
    for t in spec.get("added_tokens", []):
        if not isinstance(t, dict) or not isinstance(t.get("content"), str) or not t["content"] \
                or type(t.get("id")) is not int or not 0 <= t["id"] < 2**31:  # "" would match everywhere
            raise FileError(f"{path}: added token {json.dumps(t)[:80]} is not {{'content': non-empty string, "
                            "'id': id}")
    for n, merge in enumerate(model.get("merges", [])):
        if not (isinstance(merge, str) and merge.count(" ") == 1 or isinstance(merge, list) and len(merge) == 2
                and all(isinstance(part, str) for part in merge)):
            raise FileError(f"{path}: merge {n} is {json.dumps(merge)[:60]}, expected 'a b' or [a, b]")
    normalizer = (spec.get("normalizer") or {}).get("type")
    if model.get("type") != "BPE" or normalizer not in (None, "NFC") \
            or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        found = {k: model.get(k) for k in ("type", "continuing_subword_prefix", "end_of_word_suffix")}
        raise FileError(f"{path}: not a byte-level BPE tokenizer: model {found}, normalizer {normalizer} "
                        "(none or NFC works)")
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
            raise FileError(f"{path}: vocab token {token!r} has character {e.args[0]!r}, not a GPT-2 byte") from None
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if holder := next((token for token in ranks if len(token) > 1 and any(b in missing for b in token)), None):
        raise FileError(f"{path}: token {holder!r} holds a byte that has no token of its own, which byte-pair "
                        "merges cannot make")
    vocab, last = model["vocab"], -1
    for n, merge in enumerate(model.get("merges", [])):
        a, b = merge.split(" ") if isinstance(merge, str) else merge  # tokenizer.json spells a merge "a b" or [a, b]
        ids = [vocab.get(a), vocab.get(b), vocab.get(a + b)]
        if None in ids or ids[2] < last:
            raise FileError(f"{path}: merge {n} ({a!r}, {b!r}) has ids {ids}, the merge before made id {last}: "
                            "ids are not in merge order, so tiktoken ranks cannot reproduce this tokenizer")
        last = ids[2]
    rank_ids = set(ranks.values())
    for kind, ids in (("vocab", list(ranks.values())), ("added", list(special.values()))):
        if len(set(ids)) < len(ids):  # tiktoken would panic, not raise
            raise FileError(f"{path}: two {kind} tokens share id {collections.Counter(ids).most_common(1)[0][0]}")
    if clash := [name for name, i in special.items() if i in rank_ids]:
        raise FileError(f"{path}: added tokens {clash[:3]} share ids with byte-pair tokens")
    flagged = [t["content"] for t in spec.get("added_tokens", [])
               if any(t.get(flag) for flag in ("lstrip", "rstrip", "single_word"))]
    if flagged:
        raise FileError(f"{path}: added tokens {flagged[:3]} strip whitespace or match single words "
                        "(lstrip/rstrip/single_word), which we do not reproduce")
    words = [t["content"] for t in spec.get("added_tokens", []) if not t.get("special")]
    try:  # the split pattern comes from the file: tiktoken and regex compile it
        if normalizer is None and not missing and not words:
            return tiktoken.Encoding(os.path.basename(path), pat_str=pattern, mergeable_ranks=ranks,
                                     special_tokens=special)
        return HFEncoding(os.path.basename(path), nfc=normalizer == "NFC", missing_bytes=missing, added_words=words,
                          pat_str=pattern, mergeable_ranks=ranks, special_tokens=special)
    except (ValueError, regex.error) as e:
        raise FileError(f"{path}: {str(e)[:200]}") from None


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
    bos = special_token(enc, "bos")
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


def tokenizer_config(enc):
    """Hugging Face's tokenizer_config.json for enc's tokenizer.json: loads as PreTrainedTokenizerFast (which
    uses tokenizer.json as it is), bos/eos named, decoding leaves spaces alone, render_chat's chat template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": special_token(enc, "bos"),
        "eos_token": special_token(enc, "eos"),
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "chat_template": CHATML_TEMPLATE if is_chatml(enc) else CHAT_TEMPLATE,
    }
