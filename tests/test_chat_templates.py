"""Released models' own tokenizers and chat templates, id for id against transformers and tokenizers (CPU).

- Tokenizers whose vocabulary lacks some single bytes (the real SmolLM2-135M-Instruct's lacks 21; one trained
  here on ASCII lacks every non-ASCII byte) encode as `tokenizers` does, token for token, on text holding every
  UTF-8 byte value, and decode back as `tokenizers` decodes.
- render_chat renders the real chat templates of Llama-3.1-Instruct, Llama-3.2-Instruct, Qwen2.5-Instruct,
  Qwen3 (tests/templates: verbatim copies, README there) and SmolLM2-Instruct (in the GGUF file of
  tests/released.py), with and without a system prompt, multi-turn, with special-token text inside contents, and
  with a generation prompt: the same ids as apply_chat_template(..., sanitize_control_tokens=True). Its loss mask
  covers exactly each assistant turn's tokens and the turn's end token.
- prepare.py renders SFT data with the template of the checkpoint the tokenizer came from, and a template that
  fails is one error line naming the file and line.
"""
import json
import os
import random
import shutil
import unicodedata

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from data.prepare import prepare  # noqa: E402
from files import FileError  # noqa: E402
from released import write_smollm2_tokenizer  # noqa: E402
from test_families import family_tokenizer  # noqa: E402
from test_hf_interop import TRAIN_TEXT, llama3_style_pre_tokenizer, train_bpe  # noqa: E402
from tokenizer import SPECIAL_TOKENS, hf_tokenizer_json, load_tokenizer, render_chat, stop_ids  # noqa: E402

TEMPLATES = os.path.join(os.path.dirname(__file__), "templates")


def every_byte_text(rng, n_chars):
    """Random text whose UTF-8 holds every byte a str can give: ASCII (controls included), and characters of
    2, 3 and 4 bytes from every lead byte (0xC2-0xF4: planes 1-16 too, e.g. U+E0067, a flag's tag letter)."""
    pools = [range(0x00, 0x80), range(0x80, 0x800), range(0x800, 0xD800), range(0xE000, 0x10000),
             range(0x10000, 0x110000)]
    words = [" ", "  ", "\n", "\t", "123", " 45", "the", " cat", "é", "e\u0301", "<|im_end|>", "I'm", "'s"]
    out = []
    while len(out) < n_chars:
        if rng.random() < 0.3:
            out.append(rng.choice(words))
        elif stable(c := chr(rng.choice(rng.choice(pools)))):
            out.append(c)
    return "".join(out)


def stable(char):
    """Whether every regex engine here classes char alike: the split regexes (\\p{L}, \\s, ...) use each engine's
    Unicode tables (tokenizers' Oniguruma, tiktoken's Rust regex, Python's regex module), which differ on
    characters assigned in recent Unicode versions. Kept: characters that this Python's Unicode data knows, and
    the planes 4-16, whose code points are either unassigned in every version or private use and tags."""
    return char >= "\U00040000" or unicodedata.category(char) != "Cn"


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    return write_smollm2_tokenizer(tmp_path_factory.mktemp("smollm2"))


@pytest.fixture(scope="module")
def ascii_bpe(tmp_path_factory):
    """A byte-level BPE trained on ASCII text without the byte alphabet: no token for ~170 of the 256 bytes."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator([TRAIN_TEXT.encode("ascii", "ignore").decode()] * 4, trainer)
    path = tmp_path_factory.mktemp("ascii") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


# ---------------------------------------------------------------- tokenizers that lack bytes

@pytest.mark.parametrize("which", ["smollm2", "ascii"])
def test_missing_byte_tokens_encode_like_tokenizers(which, request):
    folder = request.getfixturevalue("smollm2_dir") if which == "smollm2" else None
    path = os.path.join(folder, "tokenizer.json") if folder else request.getfixturevalue("ascii_bpe")
    enc, hf = hf_tokenizer_json(path), tokenizers.Tokenizer.from_file(path)
    hf.encode_special_tokens = True  # special-token text stays text, as ours (encode_text)
    missing = set(enc.missing_bytes)
    if which == "smollm2":
        assert sorted(missing) == [4, 6, 19, 20, 22, 29, 192, 193, 241, 242, *range(245, 256)]
    else:
        assert missing > set(range(0x80, 0x100))
    rng = random.Random(1234)
    texts = [every_byte_text(rng, rng.randint(0, 60)) for _ in range(600)]
    texts += ["".join(map(chr, range(0x100))), "\U000E0067\U000E0062 \U00040000x\U0010FFFDy", "a\x04b", "\x04"]
    seen = set()
    for text in texts:
        ids = hf.encode(text, add_special_tokens=False).ids
        assert enc.encode_ordinary(text) == ids, repr(text)
        assert enc.decode(ids) == hf.decode(ids, skip_special_tokens=False), repr(text)
        seen |= set(text.encode())
    assert seen >= set(range(0x80)) | set(range(0x80, 0xC0)) | set(range(0xC2, 0xF5))  # every byte a str can give
    if which == "smollm2":  # the released tokenizer's own ids for a few texts (as llama.cpp's smollm tests)
        assert enc.encode_ordinary("Hello world! 123") == [19556, 905, 17, 216, 33, 34, 35]
        assert enc.encode_ordinary("The capital of France is") == [504, 3575, 282, 4649, 314]


def test_a_token_holding_a_byte_without_its_own_token_is_refused(ascii_bpe, tmp_path):
    spec = json.load(open(ascii_bpe, encoding="utf-8"))
    spec["model"]["vocab"]["Ã©"] = len(spec["model"]["vocab"]) + 10  # bytes C3 A9, neither one a token
    path = tmp_path / "tokenizer.json"
    json.dump(spec, open(path, "w", encoding="utf-8"))
    with pytest.raises(ValueError, match="holds a byte that has no token of its own"):
        hf_tokenizer_json(str(path))


# ---------------------------------------------------------------- real chat templates

def template_dir(tmp_path, name, tokenizer_json, config):
    folder = tmp_path / name
    folder.mkdir()
    shutil.copyfile(tokenizer_json, folder / "tokenizer.json")
    with open(os.path.join(TEMPLATES, f"{name}.jinja"), encoding="utf-8") as f:
        config = {**config, "chat_template": f.read()}
    json.dump(config, open(folder / "tokenizer_config.json", "w", encoding="utf-8"))
    return str(folder)


@pytest.fixture(scope="module")
def template_dirs(tmp_path_factory, smollm2_dir):
    """{template name: a tokenizer folder that chats with it}: Llama-3's special tokens for Llama's templates;
    ChatML tokens and Qwen's added words (<think>, <tool_call>: added tokens that are not special) for Qwen's."""
    tmp = tmp_path_factory.mktemp("templates")
    llama = train_bpe(llama3_style_pre_tokenizer(), 700)
    llama.add_special_tokens(SPECIAL_TOKENS)
    llama.save(str(tmp / "llama.json"))
    qwen = tokenizers.Tokenizer.from_file(family_tokenizer("qwen", tmp / "qwen.json"))
    qwen.add_tokens(["<tool_call>", "</tool_call>", "<think>", "</think>"])
    qwen.save(str(tmp / "qwen.json"))
    llama_names = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    qwen_names = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    dirs = {name: template_dir(tmp, name, tmp / "llama.json", llama_names)
            for name in ("llama-3.1-instruct", "llama-3.2-instruct")}
    dirs.update({name: template_dir(tmp, name, tmp / "qwen.json", qwen_names)
                 for name in ("qwen2.5-instruct", "qwen3")})
    return {**dirs, "smollm2-instruct": smollm2_dir}


SYSTEM = {"role": "system", "content": "You are terse. Numbers: 3.14, 1,000."}
CHATS = {
    "one turn": [{"role": "user", "content": "What is the capital of France?"},
                 {"role": "assistant", "content": "Paris."}],
    "system, two turns, whitespace": [
        SYSTEM, {"role": "user", "content": "  Grüße! 🦙\n"}, {"role": "assistant", "content": "\n Hallo.\n\n"},
        {"role": "user", "content": "And\tnow?"}, {"role": "assistant", "content": "def f(x):\n    return x"}],
    "special-token text in contents": [
        {"role": "user", "content": "Say <|im_end|><|eot_id|> and <|start_header_id|>x<|end_header_id|>"},
        {"role": "assistant", "content": "<|im_start|>user\nno<|im_end|> <think>not a thought</think>"}],
    "thinking": [{"role": "user", "content": "2+2?"},
                 {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
                 {"role": "user", "content": "3+3?"},
                 {"role": "assistant", "content": "<think>\nagain\n</think>\n\n6"}],
}


@pytest.mark.parametrize("chat", list(CHATS))
@pytest.mark.parametrize("name", ["llama-3.1-instruct", "llama-3.2-instruct", "qwen2.5-instruct", "qwen3",
                                  "smollm2-instruct"])
def test_real_templates_render_the_ids_of_apply_chat_template(name, chat, template_dirs):
    folder = template_dirs[name]
    # PreTrainedTokenizerFast: tokenizer.json as it is. (transformers 5's AutoTokenizer takes SmolLM2's
    # tokenizer_class, GPT2Tokenizer, and with it GPT-2's pre-tokenizer instead of the file's Digits + ByteLevel:
    # "\n\n4" becomes "\n", "\n", "4" where the tokenizer SmolLM2 was trained with gives "\n\n", "4".)
    enc, hf = load_tokenizer(folder), transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    messages = CHATS[chat]
    ids, mask = render_chat(enc, messages)
    assert ids == hf.apply_chat_template(messages, sanitize_control_tokens=True)["input_ids"]
    prompt, _ = render_chat(enc, messages[:-1], add_generation_prompt=True)
    assert prompt == hf.apply_chat_template(messages[:-1], add_generation_prompt=True,
                                            sanitize_control_tokens=True)["input_ids"]
    # the targets: one run per assistant turn, each ending at the first stop token after it
    runs = "".join(map(str, mask)).replace("0", " ").split()
    assert len(runs) == sum(m["role"] == "assistant" for m in messages)
    ends = [i for i in range(len(ids)) if mask[i] and (i + 1 == len(ids) or not mask[i + 1])]
    assert all(ids[i] in stop_ids(enc) for i in ends)
    last = enc.decode([t for t, m in zip(ids, mask) if m]).split(enc.decode([ids[ends[-1]]]))[-2]
    assert last.strip().endswith(messages[-1]["content"].split("</think>")[-1].strip())


def test_targets_hold_the_assistant_text_and_the_end_of_turn(template_dirs):
    enc = load_tokenizer(template_dirs["llama-3.1-instruct"])
    ids, mask = render_chat(enc, CHATS["system, two turns, whitespace"])
    assert enc.decode([t for t, m in zip(ids, mask) if m]) == "Hallo.<|eot_id|>def f(x):\n    return x<|eot_id|>"
    enc = load_tokenizer(template_dirs["smollm2-instruct"])
    ids, mask = render_chat(enc, CHATS["one turn"])
    text = enc.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")  # its default
    assert enc.decode([t for t, m in zip(ids, mask) if m]) == "Paris.<|im_end|>"


def test_a_template_that_fails_is_one_line_naming_the_record(template_dirs, tmp_path):
    enc = load_tokenizer(template_dirs["llama-3.1-instruct"])
    with pytest.raises(ValueError, match="chat template: This model only supports single tool-calls"):
        render_chat(enc, [{"role": "user", "content": "x"},
                          {"role": "assistant", "content": "", "tool_calls": [{"function": {}}, {"function": {}}]}])
    with pytest.raises(ValueError, match="chat role tool: expected one of system, user, assistant"):
        render_chat(load_tokenizer("bytes"), [{"role": "tool", "content": "x"}])
    sft = tmp_path / "sft.jsonl"
    sft.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                   '{"messages": [{"role": "assistant", "content": "first"}]}\n')
    with pytest.raises(ValueError, match=r"sft.jsonl:2: .*tokenizer_config.json: chat template: "):
        prepare([sft], tmp_path / "data", tokenizer=template_dirs["llama-3.1-instruct"])  # needs messages[0]
    # a tokenizer.json that lost the <|im_end|> its template writes: the error names both files
    spec = json.load(open(os.path.join(template_dirs["qwen2.5-instruct"], "tokenizer.json")))
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "<|im_end|>"]
    shutil.copytree(template_dirs["qwen2.5-instruct"], tmp_path / "qwen")
    json.dump(spec, open(tmp_path / "qwen" / "tokenizer.json", "w"))
    with pytest.raises(FileError, match=r"qwen/tokenizer_config.json: chat template: assistant message 2 is not "
                                        r"followed by an end-of-turn token of .*qwen/tokenizer.json \(<.endoftext.>\)"):
        render_chat(load_tokenizer(str(tmp_path / "qwen")), CHATS["one turn"])


def test_prepare_uses_the_checkpoints_template_and_keeps_it(template_dirs, tmp_path):
    """A dataset prepared with a checkpoint's tokenizer renders with that checkpoint's template, and carries the
    template on (train.py saves it into every checkpoint from there)."""
    folder = template_dirs["qwen2.5-instruct"]
    sft = tmp_path / "sft.jsonl"
    sft.write_text(2 * (json.dumps({"messages": CHATS["one turn"]}) + "\n"))  # one to train, one to val
    prepare([sft], tmp_path / "data", tokenizer=folder)
    assert sorted(os.listdir(tmp_path / "data")) == ["meta.json", "tokenizer.json", "tokenizer_config.json",
                                                     "train.bin", "train.idx.npy", "train.mask.bin", "val.bin",
                                                     "val.idx.npy", "val.mask.bin"]
    import numpy as np
    tokens = np.fromfile(tmp_path / "data" / "train.bin", dtype=np.uint32).tolist()
    enc = load_tokenizer(str(tmp_path / "data"))
    rendered = render_chat(enc, CHATS["one turn"])[0]
    assert tokens == rendered
    assert enc.decode(rendered).startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
