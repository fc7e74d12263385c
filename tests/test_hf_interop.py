"""Hugging Face interop, proven against transformers and tokenizers themselves (CPU, fp32).

- convert.py hf2nano: tiny random LlamaForCausalLMs (GQA, llama3 RoPE scaling, tied and untied embeddings,
  head_dim != dim / n_heads, GeGLU), saved sharded by transformers, converted, must give HF's logits, loss and
  gradients of every weight on a packed stream (HF runs each document alone).
- convert.py nano2hf: the export loads in transformers with the same logits and bit-identical weights; a second
  import gives our weights back bit for bit.
- tokenizer.hf_tokenizer_json: byte-level BPEs trained here with `tokenizers` encode like `tokenizers` does.
- tokenizer.tokenizer_json: our tokenizers written for HF encode like tiktoken, and the chat template renders
  render_chat's ids; a checkpoint goes HF -> hf2nano -> train.py -> nano2hf -> HF with its tokenizer files.
- Bad inputs fail with errors that name the culprit, and leave no output directory behind.
"""
import json
import os
import random
import re
import shutil
import subprocess
import sys

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import tiktoken  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import convert  # noqa: E402
import checkpoint  # noqa: E402
from checkpoint import load_model, model_tensors, save_checkpoint, tokenizer_spec_of  # noqa: E402
from conftest import random_cu_seqlens, rel_err  # noqa: E402
from data.prepare import prepare  # noqa: E402
from files import FileError  # noqa: E402
from model import PRESETS, Llama, LlamaConfig  # noqa: E402
from test_train import TINY, TINY_SHAPE, run  # noqa: E402
from tokenizer import (CHAT_TEMPLATE, LLAMA3_PATTERN, SPECIAL_TOKENS, bos_id, byte_tokenizer,  # noqa: E402
                       encode_rendered, encode_text, hf_tokenizer_json, is_byte_tokenizer, load_tokenizer,
                       render_chat, tokenizer_config, tokenizer_json)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRAIN_TEXT = """\
The quick brown fox jumps over the lazy dog. It isn't the first time, and they'll say it won't be the last:
foxes have jumped over dogs since 1066, or so the story goes. Numbers like 3.14159, 2718281828 and 1,000,000
are split into groups of at most three digits before any merge happens.

def fibonacci(n: int) -> int:
    \"\"\"Return the n-th Fibonacci number.\"\"\"
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

if __name__ == "__main__":
\tprint({"key": [1, 2, 3], 'other': None})  # tabs, quotes, brackets

Grüße aus München! Ça va très bien, merci. Ελληνικά γράμματα, русский текст, 日本語のテキスト, 中文字符,
한국어 문장, emoji 🦙🔥👍🏽 and combining marks: é = e\u0301.
   Leading spaces, trailing spaces   \n\n\n  blank lines\r\nand Windows line ends.
"""

MIXED_TEXT = """\
Llamas (🦙) don't "jump"; they're calm.\tTabs\t\tand    runs of spaces   
for i in range(10_000): x += i ** 2  # 12345678 digits, 0xDEADBEEF, 3.5e-7
Übergrößenträger ΑΒΓ αβγ Привет мир こんにちは世界 你好 안녕하세요 ‍👩‍💻 \u00a0nbsp \u200bzwsp
  \n\n  \r\n mixed\x00control\x7fchars\u2028and a line separator. I'VE, You'LL, WE'D (case-insensitive 's).
"""


def llama3_style_pre_tokenizer():
    """Llama-3's tokenizer.json: the Llama-3 regex, then bytes -> GPT-2 characters with no regex of its own."""
    pre = tokenizers.pre_tokenizers
    return pre.Sequence([pre.Split(tokenizers.Regex(LLAMA3_PATTERN), behavior="isolated"),
                         pre.ByteLevel(add_prefix_space=False, use_regex=False)])


def train_bpe(pre_tokenizer, vocab_size, special_first=()):
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_first),
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
                                             show_progress=False)
    tok.train_from_iterator([TRAIN_TEXT] * 4, trainer)
    return tok


def all_splits_merges(path_in, path_out):
    """Rewrite a tokenizer.json the way tiktoken-derived files (Llama-3's) are made: every split of every token
    into two tokens is a merge, grouped by the id of the token made, and whole-word lookups first."""
    spec = json.load(open(path_in, encoding="utf-8"))
    vocab = spec["model"]["vocab"]
    merges = []
    for token, i in sorted(vocab.items(), key=lambda kv: kv[1]):
        splits = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        merges += sorted(splits, key=lambda ab: (vocab[ab[0]], vocab[ab[1]]))
    spec["model"]["merges"] = [list(m) for m in merges]
    spec["model"]["ignore_merges"] = True
    json.dump(spec, open(path_out, "w", encoding="utf-8"))
    return len(merges)


def comparison_texts():
    """Lots of real text: our sources, transformers' Llama, and the two paragraphs above."""
    paths = [os.path.join(ROOT, p) for p in ("model.py", "checkpoint.py", "convert.py", "kernels/reference.py")]
    paths.append(os.path.join(os.path.dirname(transformers.__file__), "models", "llama", "modeling_llama.py"))
    texts = [open(p, encoding="utf-8").read() for p in paths if os.path.isfile(p)]
    return [TRAIN_TEXT, MIXED_TEXT] + texts + [line for t in texts for line in t.splitlines(keepends=True)]


@pytest.fixture(scope="module")
def llama3_tokenizer_json(tmp_path_factory):
    """A Llama-3 style tokenizer.json: regular ids 0..n-1, then Llama-3's 256 special tokens at n.. ."""
    tok = train_bpe(llama3_style_pre_tokenizer(), 700)
    tok.add_special_tokens(SPECIAL_TOKENS)
    path = str(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    tok.save(path)
    return path


# ---------------------------------------------------------------- tokenizer.json -> tiktoken

def assert_encodes_like(enc, hf, texts):
    for text in texts:
        ids = hf.encode(text, add_special_tokens=False).ids
        assert enc.encode_ordinary(text) == ids, text[:80]
        assert enc.decode(ids) == text


@pytest.mark.parametrize("style", ["llama3", "llama3_all_splits", "gpt2"])
def test_hf_tokenizer_json_encodes_like_tokenizers(style, llama3_tokenizer_json, tmp_path):
    path = str(tmp_path / "tokenizer.json")
    if style == "llama3":
        shutil.copyfile(llama3_tokenizer_json, path)
    elif style == "llama3_all_splits":  # several merges make the same token, as in Llama-3's file
        n_merges = all_splits_merges(llama3_tokenizer_json, path)
        assert n_merges > len(json.load(open(llama3_tokenizer_json))["model"]["merges"])
    else:  # GPT-2: the regex lives in ByteLevel, the special token comes first (id 0, inside the vocab)
        tok = train_bpe(tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False), 600, ["<|endoftext|>"])
        tok.save(path)
    hf = tokenizers.Tokenizer.from_file(path)
    enc = hf_tokenizer_json(path)
    assert enc.n_vocab == hf.get_vocab_size()
    assert_encodes_like(enc, hf, comparison_texts())
    # added tokens are special tokens: matched in text by both when allowed, with the same ids
    specials = ["<|endoftext|>"] if style == "gpt2" else ["<|begin_of_text|>", "<|eot_id|>", "<|python_tag|>"]
    text = f"{specials[0]}Hello{specials[-1]} world{specials[0]}\n"
    ids = hf.encode(text, add_special_tokens=False).ids
    assert enc.encode(text, allowed_special="all") == ids
    assert [i for i in ids if i in {hf.token_to_id(s) for s in specials}]  # they really were matched
    assert enc.decode(ids) == text
    for name in specials:
        assert enc.encode_single_token(name) == hf.token_to_id(name)


def test_converted_tokenizer_model_loads_the_same(llama3_tokenizer_json, tmp_path):
    """hf2nano's tokenizer.model (tiktoken ranks) read back by load_tokenizer: same ids as the tokenizer.json."""
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    shutil.copyfile(llama3_tokenizer_json, hf_dir / "tokenizer.json")
    out = tmp_path / "out"
    out.mkdir()
    convert.copy_or_convert_tokenizer(str(hf_dir), str(out))
    shutil.copyfile(llama3_tokenizer_json, tmp_path / "json_named.model")  # as save_checkpoint would copy it
    hf = tokenizers.Tokenizer.from_file(llama3_tokenizer_json)
    specs = (out / "tokenizer.model", out, llama3_tokenizer_json, hf_dir, tmp_path / "json_named.model")
    for spec in map(str, specs):
        enc = load_tokenizer(spec)
        assert_encodes_like(enc, hf, comparison_texts()[:4])
        assert enc.n_vocab == hf.get_vocab_size()
        for name in SPECIAL_TOKENS:
            assert enc.encode_single_token(name) == hf.token_to_id(name)


LLAMA3_0_SPECIAL_TOKENS = (
    ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>" for i in range(4)]
    + ["<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>"]
    + [f"<|reserved_special_token_{i}|>" for i in range(5, 251)])


def test_llama3_0_special_names_convert_but_moved_names_do_not(llama3_tokenizer_json, tmp_path):
    """Llama-3.0 named fewer special tokens than 3.1 (whose names tokenizer.model uses): same ids, fine. A name
    whose id moved would make the chat template emit wrong ids: an error."""
    assert len(LLAMA3_0_SPECIAL_TOKENS) == 256
    spec = json.load(open(llama3_tokenizer_json))
    for token, name in zip(spec["added_tokens"], LLAMA3_0_SPECIAL_TOKENS):
        token["content"] = name
    for case, names in (("v3_0", LLAMA3_0_SPECIAL_TOKENS), ("moved", None)):
        if names is None:  # swap two named tokens
            a, b = spec["added_tokens"][7], spec["added_tokens"][9]
            a["content"], b["content"] = b["content"], a["content"]
        (tmp_path / case).mkdir()
        json.dump(spec, open(tmp_path / case / "tokenizer.json", "w"))
    out = tmp_path / "out"
    out.mkdir()
    convert.copy_or_convert_tokenizer(str(tmp_path / "v3_0"), str(out))
    enc, n = load_tokenizer(str(out)), len(spec["model"]["vocab"])
    assert [enc.encode_single_token(t) - n for t in ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")] == [0, 1, 9]
    with pytest.raises(ValueError, match=f"'<.eot_id.>' has id {n + 7}, tokenizer.model gives it {n + 9}"):
        convert.copy_or_convert_tokenizer(str(tmp_path / "moved"), str(out))


def test_tokenizer_json_errors(llama3_tokenizer_json, tmp_path):
    # not byte-level: a whitespace-split BPE
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator([TRAIN_TEXT], tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"],
                                                                        show_progress=False))
    tok.save(str(tmp_path / "ws.json"))
    with pytest.raises(ValueError, match="pre_tokenizer is \\['Whitespace'\\]"):
        hf_tokenizer_json(str(tmp_path / "ws.json"))
    # merges out of id order: tiktoken ranks cannot express it
    spec = json.load(open(llama3_tokenizer_json))
    merges = spec["model"]["merges"]
    merges[3], merges[200] = merges[200], merges[3]
    json.dump(spec, open(tmp_path / "swapped.json", "w"))
    with pytest.raises(ValueError, match="merge 4 .* not in merge order"):
        hf_tokenizer_json(str(tmp_path / "swapped.json"))
    # an added token with no text would match between every two characters of a chat
    spec = json.load(open(llama3_tokenizer_json))
    spec["added_tokens"][1]["content"] = ""
    json.dump(spec, open(tmp_path / "empty.json", "w"))
    with pytest.raises(FileError, match="empty.json: added token .* is not {'content': non-empty string"):
        hf_tokenizer_json(str(tmp_path / "empty.json"))
    # no vocabulary
    json.dump({**spec, "model": {k: v for k, v in spec["model"].items() if k != "vocab"}},
              open(tmp_path / "novocab.json", "w"))
    with pytest.raises(FileError, match="novocab.json: model: no 'vocab'"):
        hf_tokenizer_json(str(tmp_path / "novocab.json"))
    # no added tokens at all: it loads, and a chat names the file that lacks the begin-of-text token
    del spec["added_tokens"]
    os.mkdir(tmp_path / "plain")
    json.dump(spec, open(tmp_path / "plain" / "tokenizer.json", "w"))
    plain = load_tokenizer(str(tmp_path / "plain"))
    text = "<|begin_of_text|>Hi!<|eot_id|>"
    assert encode_rendered(plain, text) == encode_text(plain, text)  # nothing to match: all of it is text
    with pytest.raises(FileError, match="plain/tokenizer.json: no bos token among its special tokens"):
        render_chat(plain, CHAT)
    # a GPT-2 pattern tokenizer cannot become a tokenizer.model (which always splits with Llama-3's regex): it
    # stays the checkpoint's tokenizer as it is
    gpt2 = train_bpe(tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False), 400)
    hf_dir = tmp_path / "gpt2"
    hf_dir.mkdir()
    gpt2.save(str(hf_dir / "tokenizer.json"))
    assert convert.copy_or_convert_tokenizer(str(hf_dir), str(tmp_path)) == "tokenizer.json"
    assert (tmp_path / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
    assert not (tmp_path / "tokenizer.model").exists()


# ---------------------------------------------------------------- tiktoken -> tokenizer.json

CHAT = [{"role": "system", "content": "Answer in one line. Numbers: 3.14159, 1,000,000."},
        {"role": "user", "content": "Grüße aus München! 日本語 🦙🔥👍🏽   spaces\tand tabs\n\nblank line  "},
        {"role": "assistant", "content": "\n It isn't hard: def f(x):\n    return x ** 2\n"}]  # stripped by both


def generation_prompt(enc):
    return [enc.encode_single_token("<|start_header_id|>")] + encode_text(enc, "assistant") + \
        [enc.encode_single_token("<|end_header_id|>")] + encode_text(enc, "\n\n")


def assert_hf_tokenizer_like_ours(hf_dir, enc, texts=(TRAIN_TEXT, MIXED_TEXT)):
    """transformers' AutoTokenizer of hf_dir encodes and decodes like enc, and its chat template gives
    render_chat's ids (and the assistant header after them, when asked for a generation prompt)."""
    hf = transformers.AutoTokenizer.from_pretrained(hf_dir)
    for text in texts:
        ids = encode_text(enc, text)
        assert hf.encode(text, add_special_tokens=False) == ids, text[:80]
        assert hf.decode(ids) == text
    assert hf.apply_chat_template(CHAT)["input_ids"] == render_chat(enc, CHAT)[0]
    with_prompt = hf.apply_chat_template(CHAT[:2], add_generation_prompt=True)["input_ids"]
    assert with_prompt == render_chat(enc, CHAT[:2])[0] + generation_prompt(enc)
    return hf


def write_tokenizer_files(enc, path):
    os.makedirs(path, exist_ok=True)
    json.dump(tokenizer_json(enc), open(os.path.join(path, "tokenizer.json"), "w"))
    json.dump(tokenizer_config(enc), open(os.path.join(path, "tokenizer_config.json"), "w"))
    return str(path)


@pytest.mark.parametrize("kind", ["bytes", "llama3_ranks"])
def test_tokenizer_json_encodes_like_tiktoken(kind, llama3_tokenizer_json, tmp_path):
    if kind == "bytes":
        enc = byte_tokenizer()
    else:  # a tokenizer.model (tiktoken ranks) as hf2nano makes it; its tokenizer.json is not used
        convert.copy_or_convert_tokenizer(os.path.dirname(llama3_tokenizer_json), str(tmp_path))
        enc = load_tokenizer(str(tmp_path / "tokenizer.model"))
    hf_dir = write_tokenizer_files(enc, tmp_path / "hf")
    hf = assert_hf_tokenizer_like_ours(hf_dir, enc, comparison_texts())
    assert hf.encode(TRAIN_TEXT) == [bos_id(enc)] + encode_text(enc, TRAIN_TEXT)  # as data/prepare.py starts
    assert len(hf) == enc.n_vocab and hf.bos_token_id == bos_id(enc)
    # our reader of tokenizer.json gives back the very Encoding it was written from
    back = hf_tokenizer_json(os.path.join(hf_dir, "tokenizer.json"))
    assert (back._mergeable_ranks, back._special_tokens, back._pat_str) == \
        (enc._mergeable_ranks, enc._special_tokens, enc._pat_str)
    # Special-token strings in text: HF matches them before anything else, even with add_special_tokens=False
    # (that only drops the <|begin_of_text|> added in front); encode_text never does. transformers'
    # split_special_tokens=True encodes them as plain text, like encode_text.
    text = "a<|eot_id|>b <|begin_of_text|>\n"
    plain = [encode_text(enc, s) for s in ("a", "b", " ", "\n")]
    eot = enc.encode_single_token("<|eot_id|>")
    matched = plain[0] + [eot] + plain[1] + plain[2] + [bos_id(enc)] + plain[3]
    assert hf.encode(text, add_special_tokens=False) == matched
    assert hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] == encode_text(enc, text)


def test_tokenizer_json_merges_like_tiktoken_on_odd_ranks():
    """Rank tables made to trip the merge list: ids in random order (a token may have a smaller id than its
    parts, so tiktoken's merges do not come in id order) and tokens that no merge reaches."""
    rng = random.Random(0)
    for _ in range(4):
        words = {rng.choice(["", " "]) + "".join(rng.choice("ab") for _ in range(rng.randint(1, 6)))
                 for _ in range(200)} | {"  ", "   ", "\n\n"}
        words = sorted(w for w in words if len(w) > 1)
        ids = rng.sample(range(256, 256 + len(words)), len(words))
        ranks = {bytes([i]): i for i in range(256)} | {w.encode(): i for w, i in zip(words, ids)}
        specials = {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
        enc = tiktoken.Encoding("odd", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
        hf = tokenizers.Tokenizer.from_str(json.dumps(tokenizer_json(enc)))
        for _ in range(100):
            text = "".join(rng.choice("aab  \n") for _ in range(rng.randint(1, 80)))
            assert hf.encode(text, add_special_tokens=False).ids == enc.encode_ordinary(text), text


# ---------------------------------------------------------------- weights

CASES = {
    # GQA 4:2, head_dim 32 != 64 / 4, llama3 scaling that matters at these positions, untied, SwiGLU
    "gqa_llama3_untied": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
                              hidden_act="silu", rope_theta=100.0,
                              rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                high_freq_factor=4.0, original_max_position_embeddings=32)),
    # MQA, head_dim 16 != 64 / 8, tied embeddings, GeGLU, no scaling; the tokenizer comes as a tiktoken tokenizer.model
    "mqa_tied_gelu": dict(num_attention_heads=8, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True,
                          hidden_act="gelu_pytorch_tanh", rope_theta=10000.0, rope_scaling=None),
}


def tiny_hf_model(vocab_size, **kw):
    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=88, num_hidden_layers=2,
                                   max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=vocab_size - 256,
                                   eos_token_id=vocab_size - 255, **kw)
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # unit-scale weights: attention scores O(1), so RoPE and the layout really matter
        for name, p in hf.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, p.shape[1] ** -0.5)
    return hf


def save_hf_dir(hf, path, tokenizer_json, as_tiktoken=False):
    """Sharded weights and a tokenizer.json, or (as_tiktoken) Meta's layout of Llama-3 repos: the tiktoken file
    in original/tokenizer.model, here beside a SentencePiece-like binary tokenizer.model that must be skipped."""
    hf.save_pretrained(path, max_shard_size="40KB")
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))  # sharded
    if as_tiktoken:
        os.makedirs(os.path.join(path, "original"))
        convert.copy_or_convert_tokenizer(os.path.dirname(tokenizer_json), os.path.join(path, "original"))
        with open(os.path.join(path, "tokenizer.model"), "wb") as f:
            f.write(b"\x0a\x0b\x00\x12<unk>\x1a\xff\x00")
    else:
        shutil.copyfile(tokenizer_json, os.path.join(path, "tokenizer.json"))


def packed_docs(vocab_size, total=97):
    cu = random_cu_seqlens(total, 40, min_len=2)
    tokens = torch.randint(0, vocab_size, (total,))
    labels = torch.roll(tokens, -1)
    labels[cu[1:].long() - 1] = -100  # the last token of a document predicts nothing
    return tokens, labels, cu


def hf_per_document(hf, tokens, cu):
    """HF's logits of each document run alone (batch 1, positions from 0) and the summed next-token loss."""
    logits, loss = [], 0.0
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        out = hf(input_ids=tokens[s:e][None]).logits[0]
        logits.append(out)
        loss = loss + F.cross_entropy(out[:-1], tokens[s + 1:e], reduction="sum")
    return torch.cat(logits), loss


def read_safetensors_dir(path):
    state = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(path, name)))
    return state


@pytest.mark.parametrize("case", list(CASES))
def test_hf_roundtrip_matches_transformers(case, llama3_tokenizer_json, tmp_path):
    vocab_size = hf_tokenizer_json(llama3_tokenizer_json).n_vocab
    hf = tiny_hf_model(vocab_size, **CASES[case])
    hf_dir, nano_dir, back_dir = (str(tmp_path / d) for d in ("hf", "nano", "back"))
    save_hf_dir(hf, hf_dir, llama3_tokenizer_json, as_tiktoken=case == "mqa_tied_gelu")
    convert.hf2nano(hf_dir, nano_dir)
    ours = load_model(nano_dir)
    assert ours.cfg.head_dim == CASES[case]["head_dim"] != ours.cfg.dim // ours.cfg.n_heads
    assert ours.cfg.tie_embeddings == CASES[case]["tie_word_embeddings"]
    hf_tokenizer = tokenizers.Tokenizer.from_file(llama3_tokenizer_json)
    assert_encodes_like(load_tokenizer(tokenizer_spec_of(nano_dir)), hf_tokenizer, [TRAIN_TEXT, MIXED_TEXT])

    # forward: packed stream vs each document alone in HF
    tokens, labels, cu = packed_docs(vocab_size)
    hf_logits, hf_loss = hf_per_document(hf, tokens, cu)
    our_logits = ours(tokens, cu)
    assert (our_logits - hf_logits).abs().max().item() < 1e-4
    loss_sum, n_valid = ours(tokens, cu, labels=labels, reduction="sum")
    assert n_valid.item() == tokens.numel() - (cu.numel() - 1)
    assert rel_err(loss_sum, hf_loss) < 1e-5
    # backward: the gradient of every weight
    loss_sum.backward()
    hf_loss.backward()
    for name, p in ours.named_parameters():
        hf_p = hf.get_parameter(convert.hf_name(name))
        assert rel_err(p.grad, hf_p.grad) < 1e-4, name
    if CASES[case]["rope_scaling"]:  # the comparison resolves the llama3 scaling: without it we would fail
        unscaled = load_model(nano_dir, rope_scaling=None)
        assert (unscaled(tokens, cu) - hf_logits).abs().max().item() > 1e-2

    # export: transformers loads it, same logits, bit-identical weights, and it imports back bit-exact
    convert.nano2hf(nano_dir, back_dir, shard_size="30KB")
    assert os.path.isfile(os.path.join(back_dir, "model.safetensors.index.json"))
    assert os.path.isfile(os.path.join(back_dir, "tokenizer.model"))
    # the HF source's tokenizer.json carried through, or (from a tokenizer.model alone) one written from it
    assert_hf_tokenizer_like_ours(back_dir, load_tokenizer(tokenizer_spec_of(nano_dir)))
    carried = open(os.path.join(back_dir, "tokenizer.json"), "rb").read() == open(llama3_tokenizer_json, "rb").read()
    assert carried == os.path.isfile(os.path.join(hf_dir, "tokenizer.json"))
    back = transformers.LlamaForCausalLM.from_pretrained(back_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        # within fp32 rounding (~1e-7), not bit for bit: the weights are compared bit for bit below, and one CI run
        # under CPU load gave this second instance logits that differed in their last bits
        assert rel_err(hf_per_document(back, tokens, cu)[0], hf_logits) < 1e-6
    assert back.config.rope_parameters == hf.config.rope_parameters
    assert back.config.tie_word_embeddings == hf.config.tie_word_embeddings
    original, exported = read_safetensors_dir(hf_dir), read_safetensors_dir(back_dir)
    assert original.keys() == exported.keys()
    for name in original:
        assert original[name].dtype == exported[name].dtype and torch.equal(original[name], exported[name]), name
    convert.hf2nano(back_dir, str(tmp_path / "again"))
    first, second = (load_file(os.path.join(d, "model.safetensors")) for d in (nano_dir, str(tmp_path / "again")))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_hf2nano_dtype_cast(llama3_tokenizer_json, tmp_path):
    hf = tiny_hf_model(hf_tokenizer_json(llama3_tokenizer_json).n_vocab, **CASES["gqa_llama3_untied"])
    save_hf_dir(hf, str(tmp_path / "hf"), llama3_tokenizer_json)
    edit_tensor(str(tmp_path / "hf"), "model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(16))  # ignored
    convert.hf2nano(str(tmp_path / "hf"), str(tmp_path / "nano"), dtype=torch.bfloat16)
    state = load_file(str(tmp_path / "nano" / "model.safetensors"))
    for name, t in state.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, hf.get_parameter(convert.hf_name(name)).bfloat16())
    convert.nano2hf(str(tmp_path / "nano"), str(tmp_path / "back"))  # one shard: no index
    assert json.load(open(tmp_path / "back" / "config.json"))["torch_dtype"] == "bfloat16"
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert all(torch.equal(back[convert.hf_name(n)], t) for n, t in state.items())


def test_export_of_a_checkpoint_trained_here(tmp_path):
    """A checkpoint as train.py saves it (byte tokenizer, our config defaults) exports to a working HF model."""
    cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=72, vocab_size=512, tie_embeddings=True,
                      activation="gelu_tanh", max_seq_len=64)
    model = Llama(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(1.0 if p.ndim == 1 else 0.0, 0.3 if p.ndim == 1 else p.shape[1] ** -0.5)
    save_checkpoint(str(tmp_path / "ckpt"), model.cfg, "bytes", model_tensors(model))
    convert.nano2hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    hf_cfg = json.load(open(tmp_path / "hf" / "config.json"))
    assert (hf_cfg["bos_token_id"], hf_cfg["eos_token_id"]) == (256, 257) and hf_cfg["rope_scaling"] is None
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    tokens, cu = torch.randint(0, 512, (50,)), torch.tensor([0, 50], dtype=torch.int32)
    with torch.no_grad():
        assert (model(tokens, cu) - hf(input_ids=tokens[None]).logits[0]).abs().max().item() < 1e-4


# ---------------------------------------------------------------- HF -> train.py -> HF, tokenizer included

def sft_and_text_corpus(path):
    """A jsonl of chat conversations and plain texts, enough tokens for two tiny steps and an eval."""
    with open(path, "w", encoding="utf-8") as f:
        for i in range(30):
            messages = [{"role": "user", "content": f"Question {i}: {TRAIN_TEXT[40 * i:40 * i + 80]}"},
                        {"role": "assistant", "content": MIXED_TEXT[20 * i % 200:20 * i % 200 + 60]}]
            f.write(json.dumps({"messages": messages}) + "\n")
            f.write(json.dumps({"text": TRAIN_TEXT[i:] + MIXED_TEXT[:i]}) + "\n")
    return str(path)


def train_two_steps(data_dir, out_dir, *args):
    """Two steps of a TINY run; from init_from's model where args name one (train.py refuses a shape beside it)."""
    fine_tune = any(a.startswith("--init_from=") for a in args)
    settings = [a for a in TINY if not (fine_tune and a in TINY_SHAPE)]
    run("train.py", *settings, f"--data_dir={data_dir}", f"--out_dir={out_dir}", "--max_steps=2", "--eval_interval=2",
        "--device=cpu", *args)
    return os.path.join(out_dir, "ckpt")


def test_llama3_style_model_fine_tuned_here_goes_back_to_hf(llama3_tokenizer_json, tmp_path):
    """HF dir with tokenizer.json and a chat template -> hf2nano -> train.py --init_from -> nano2hf: the export
    carries the HF tokenizer files through training, transformers loads it, and computes our logits."""
    hf_dir, nano, export = (str(tmp_path / d) for d in ("hf", "nano", "export"))
    vocab_size = hf_tokenizer_json(llama3_tokenizer_json).n_vocab
    tiny_hf_model(vocab_size, **CASES["gqa_llama3_untied"]).save_pretrained(hf_dir)
    shutil.copyfile(llama3_tokenizer_json, os.path.join(hf_dir, "tokenizer.json"))
    hf_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                 "eos_token": "<|eot_id|>", "chat_template": "{#- the HF directory's own #}" + CHAT_TEMPLATE}
    json.dump(hf_config, open(os.path.join(hf_dir, "tokenizer_config.json"), "w"))
    convert.hf2nano(hf_dir, nano)
    enc = load_tokenizer(tokenizer_spec_of(nano))
    data = str(tmp_path / "data")
    prepare([sft_and_text_corpus(tmp_path / "sft.jsonl")], data, tokenizer=os.path.join(nano, "tokenizer.model"),
            val_fraction=0.1, seed=0)
    ckpt = train_two_steps(data, str(tmp_path / "run"), f"--init_from={nano}")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):  # kept by save_checkpoint
        assert open(os.path.join(ckpt, name), "rb").read() == open(os.path.join(hf_dir, name), "rb").read(), name
    convert.nano2hf(ckpt, export)

    hf_tokenizer = assert_hf_tokenizer_like_ours(export, enc)
    assert hf_tokenizer.chat_template == hf_config["chat_template"]  # the HF directory's, carried through
    ids = torch.tensor(render_chat(enc, CHAT)[0])
    trained = load_model(ckpt, max_seq_len=len(ids))  # train.py saved max_seq_len=64
    before = load_file(os.path.join(nano, "model.safetensors"))
    assert not torch.equal(trained.layers[0].self_attn.q_proj.weight, before["layers.0.self_attn.q_proj.weight"])
    hf = transformers.LlamaForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    with torch.no_grad():
        ours = trained(ids, torch.tensor([0, len(ids)], dtype=torch.int32))
        assert (ours - hf(input_ids=ids[None]).logits[0]).abs().max().item() < 1e-4


def test_byte_model_trained_here_goes_to_hf_and_back(tmp_path):
    """The default model (byte tokenizer, from scratch): nano2hf writes a tokenizer transformers loads and that
    encodes like ours; hf2nano of the export gives the byte tokenizer (its tokenizer.json, beside the chat template
    the HF directory carries) and bit-equal weights back."""
    data = str(tmp_path / "data")
    prepare([sft_and_text_corpus(tmp_path / "sft.jsonl")], data, tokenizer="bytes", val_fraction=0.1, seed=0)
    ckpt = train_two_steps(data, str(tmp_path / "run"))
    export, back = str(tmp_path / "export"), str(tmp_path / "back")
    convert.nano2hf(ckpt, export)
    assert_hf_tokenizer_like_ours(export, byte_tokenizer())
    config_path = os.path.join(export, "tokenizer_config.json")
    hf_config = json.load(open(config_path))
    hf_config["chat_template"] = "{#- the HF directory's own #}" + hf_config["chat_template"]
    json.dump(hf_config, open(config_path, "w"))
    convert.hf2nano(export, back)
    assert is_byte_tokenizer(load_tokenizer(tokenizer_spec_of(back)))
    assert sorted(os.listdir(back)) == ["config.json", "generation_config.json", "model.safetensors",
                                        "tokenizer.json", "tokenizer_config.json"]
    assert load_tokenizer(tokenizer_spec_of(back)).chat_template == hf_config["chat_template"]  # kept
    first, second = (load_file(os.path.join(d, "model.safetensors")) for d in (ckpt, back))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert json.load(open(os.path.join(back, "config.json")))["model"] == \
        json.load(open(os.path.join(ckpt, "config.json")))["model"]


def test_cli_error_is_one_line(hf_dir, tmp_path):
    broken = str(tmp_path / "hf")
    shutil.copytree(hf_dir, broken)
    os.remove(os.path.join(broken, "tokenizer.json"))
    proc = run("convert.py", "hf2nano", broken, str(tmp_path / "out"), check=False)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == f"error: {broken}: no tiktoken tokenizer.model and no tokenizer.json\n"


# ---------------------------------------------------------------- configs

LLAMA3_1_8B_CONFIG = {  # as released on the Hub (transformers 4.x format)
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}
LLAMA3_2_1B_CONFIG = {
    **LLAMA3_1_8B_CONFIG, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "head_dim": 64,
    "rope_scaling": {**LLAMA3_1_8B_CONFIG["rope_scaling"], "factor": 32.0}, "tie_word_embeddings": True,
}


def test_config_from_hf_released_and_transformers5_formats():
    for released, preset in ((LLAMA3_1_8B_CONFIG, "llama3_1_8b"), (LLAMA3_2_1B_CONFIG, "llama3_2_1b")):
        cfg = convert.config_from_hf(released)
        assert cfg == LlamaConfig(**PRESETS[preset])
        # what transformers 5 writes (rope_parameters) reads the same, and so does our own export
        modern = transformers.LlamaConfig(**released).to_dict()
        assert "rope_parameters" in modern
        assert convert.config_from_hf(modern) == cfg
        assert convert.config_from_hf(convert.hf_config_from(cfg, torch.bfloat16)) == cfg


@pytest.mark.parametrize("key, value, message", [
    ("attention_bias", True, "attention_bias=true"),
    ("mlp_bias", True, "mlp_bias=true"),
    ("model_type", "mistral", "model_type='mistral'"),
    ("hidden_act", "relu", "hidden_act='relu'"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling.rope_type='yarn'"),
    ("rope_scaling", {"type": "dynamic", "factor": 2.0}, "rope_scaling.rope_type='dynamic'"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, "lacks \\['low_freq_factor', 'high_freq_factor'\\]"),
    ("hidden_size", None, "no 'hidden_size'"),
])
def test_config_errors_name_the_key(key, value, message):
    hf = dict(LLAMA3_1_8B_CONFIG)
    if value is None:
        del hf[key]
    else:
        hf[key] = value
    with pytest.raises(ValueError, match=message):
        convert.config_from_hf(hf)


def test_shard_size_is_a_positive_size():
    assert [convert.parse_size(s) for s in ("5GB", "1.5kb", "1024")] == [5 * 10**9, 1500, 1024]
    for bad in ("abc", "0", "-1", "0.5", "infGB", "nanMB", "", "5GiB"):
        with pytest.raises(ValueError, match=f"--shard_size '{bad}': expected a size such as 5GB"):
            convert.parse_size(bad)


def test_a_nanollama_checkpoint_is_not_converted_again():
    ours = {"format": 2, "model": {"dim": 32, "n_layers": 1}, "tokenizer": "bytes"}
    with pytest.raises(ValueError, match="ck/config.json is a nanollama checkpoint's: nothing to convert, train "
                                         "from it with --init_from=ck"):
        convert.config_from_hf(ours, "ck/config.json")


# ---------------------------------------------------------------- bad checkpoints leave nothing behind

@pytest.fixture(scope="module")
def hf_dir(llama3_tokenizer_json, tmp_path_factory):
    hf = tiny_hf_model(hf_tokenizer_json(llama3_tokenizer_json).n_vocab, **CASES["gqa_llama3_untied"])
    path = str(tmp_path_factory.mktemp("hf") / "hf")
    save_hf_dir(hf, path, llama3_tokenizer_json)
    return path


def edit_tensor(hf_dir, name, new_tensor=None):
    """Replace (or with None, delete) one tensor in a sharded HF directory, index included."""
    index_path = os.path.join(hf_dir, "model.safetensors.index.json")
    index = json.load(open(index_path))
    shard = os.path.join(hf_dir, index["weight_map"].get(name) or sorted(set(index["weight_map"].values()))[0])
    state = load_file(shard)
    if new_tensor is None:
        del state[name], index["weight_map"][name]
    else:
        state[name] = new_tensor
        index["weight_map"][name] = os.path.basename(shard)
    save_file(state, shard, metadata={"format": "pt"})
    json.dump(index, open(index_path, "w"))


def break_config(hf_dir, **changes):
    path = os.path.join(hf_dir, "config.json")
    cfg = json.load(open(path))
    cfg.update(changes)
    json.dump(cfg, open(path, "w"))


BREAKAGES = {
    "attention_bias": (lambda d: break_config(d, attention_bias=True), ValueError, "attention_bias"),
    "rope_type": (lambda d: break_config(d, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
                  ValueError, "rope_parameters.rope_type='longrope'"),
    "missing": (lambda d: edit_tensor(d, "model.layers.1.mlp.up_proj.weight"), ValueError,
                "missing tensors \\['model.layers.1.mlp.up_proj.weight'\\]"),
    "shape": (lambda d: edit_tensor(d, "model.layers.0.self_attn.k_proj.weight", torch.zeros(32, 64)), ValueError,
              "model.layers.0.self_attn.k_proj.weight has shape \\(32, 64\\), .*config.json implies \\(64, 64\\)"),
    "unexpected": (lambda d: edit_tensor(d, "model.layers.0.self_attn.q_proj.bias", torch.zeros(128)), ValueError,
                   "unexpected tensors \\['model.layers.0.self_attn.q_proj.bias'\\]"),
    "no_tokenizer": (lambda d: os.remove(os.path.join(d, "tokenizer.json")), FileError, "no tokenizer.json"),
    "bad_template": (lambda d: open(os.path.join(d, "chat_template.jinja"), "w").write("{% if %}"), FileError,
                     "chat_template.jinja: .*"),
}


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_hf2nano_errors_leave_nothing(breakage, hf_dir, tmp_path):
    broken = str(tmp_path / "hf")
    shutil.copytree(hf_dir, broken)
    damage, error, message = BREAKAGES[breakage]
    damage(broken)
    out = str(tmp_path / "out")
    with pytest.raises(error, match=message):
        convert.hf2nano(broken, out)
    assert not os.path.exists(out) and not os.path.exists(out + ".tmp")


def test_existing_output_is_not_touched(hf_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="exists"):
        convert.hf2nano(hf_dir, str(out))
    assert (out / "keep.txt").read_text() == "mine" and not os.path.exists(str(out) + ".tmp")


# ---------------------------------------------------------------- streaming: memory stays far below the model

GROWTH_SCRIPT = """
import sys
import checkpoint
import convert
from model import LlamaConfig


def peak_rss_mb():  # VmHWM: this process's own peak (ru_maxrss would also count the parent at fork)
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM")).split()[1]) / 1024


checkpoint.stored_shapes(LlamaConfig())  # one-time imports (meta tensors) before measuring
growth = []
for argv in sys.argv[1:]:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux: reset the peak-RSS mark to the current RSS
    before = peak_rss_mb()
    sys.argv = ["convert.py", *argv.split("|")]
    convert.main()
    growth.append(peak_rss_mb() - before)
print("growth MB", *growth)
"""


def test_cli_streams_without_holding_the_model(llama3_tokenizer_json, tmp_path):
    """A 100 MB model converted both ways through the command line: the peak resident memory grows by a small
    part of the model (a shard memory-mapped, a tensor in flight), where collect-then-save would grow by all."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    vocab_size = hf_tokenizer_json(llama3_tokenizer_json).n_vocab
    hf_cfg = dict(model_type="llama", hidden_size=768, num_hidden_layers=4, num_attention_heads=6,
                  num_key_value_heads=2, intermediate_size=2048, vocab_size=vocab_size, tie_word_embeddings=False)
    json.dump(hf_cfg, open(hf_dir / "config.json", "w"))
    shutil.copyfile(llama3_tokenizer_json, hf_dir / "tokenizer.json")
    weight_map, shard, n_bytes = {}, {}, 0

    def flush():
        file = f"model-{len(set(weight_map.values())) + 1}.safetensors"
        save_file(shard, str(hf_dir / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
        shard.clear()

    for name, shape in checkpoint.stored_shapes(convert.config_from_hf(hf_cfg)).items():
        shard[convert.hf_name(name)] = torch.randn(shape)
        n_bytes += shard[convert.hf_name(name)].numel() * 4
        if sum(t.numel() * 4 for t in shard.values()) > 20e6:
            flush()
    flush()
    json.dump({"weight_map": weight_map}, open(hf_dir / "model.safetensors.index.json", "w"))
    model_mb = n_bytes / 2**20
    assert model_mb > 90

    nano, back = str(tmp_path / "nano"), str(tmp_path / "back")
    out = subprocess.run([sys.executable, "-c", GROWTH_SCRIPT, f"hf2nano|{hf_dir}|{nano}",
                          f"nano2hf|{nano}|{back}|--shard_size|20MB"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    growth_in, growth_out = map(float, re.search(r"growth MB (\S+) (\S+)", out).groups())
    assert growth_in < 0.4 * model_mb and growth_out < 0.4 * model_mb, (growth_in, growth_out, model_mb)
    assert out.count("peak RSS") == 2 and "model.layers.0." not in out  # the summary lines, no line per tensor
    original, exported = read_safetensors_dir(str(hf_dir)), read_safetensors_dir(back)
    assert original.keys() == exported.keys() and all(torch.equal(original[k], exported[k]) for k in original)
