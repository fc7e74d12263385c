"""GGUF export (gguf_export.py, `convert.py nano2gguf`), checked against independent readers (CPU).

Five checkpoints: the default model's shape (byte tokenizer) and a Llama-3 one (llama architecture), and one of each
family beyond Llama-3, with a tokenizer.json trained in the family's style (tests/test_families.py): SmolLM2
(llama, pre-tokenizer "smollm"), Qwen2.5 (qwen2: q/k/v biases) and Qwen3 (qwen3: q/k norms), Qwen's pre-tokenizer
"qwen2".
- The `gguf` package parses the file; every key llama.cpp's loader reads is there, under the architecture's
  prefix, with the value type it checks, and every tensor has llama.cpp's name, shape (innermost dim first) and
  type. A family's vocabulary is its tokenizer.json's: its tokens, merges and added tokens, even one that lacks
  byte tokens (real SmolLM2 lacks 21).
- Each stored tensor is our weight: f16 / bf16 bit for bit, q8_0 within half a quantization step of every value
  (dequantized by the gguf package's own code).
- The rows llama.cpp rotates: attn_q / attn_k rows in Meta's interleaved RoPE order, and rope_freqs, for the llama
  architecture; as ours for qwen2 / qwen3, which llama.cpp rotates NEOX-style (pairs half a head apart) after the
  bias or the q/k norm. Rotating the file's rows that way reproduces our rotated queries and keys (the other
  order does not).
- The pre-tokenizer names split text as the tokenizers do: llama.cpp's regexes for llama-bpe, qwen2 and smollm.
- transformers' GGUF loader builds a model with our logits and a tokenizer that encodes like ours, for all five.
  (Its qwen3 config ignores attention.key_length, and it knows no "smollm" split: see the tests.)
- llama.cpp itself, when llama-cpp-python is installed (it compiles llama.cpp, ~25 minutes on 2 cores, so it is
  not a test extra and the test skips without it): our token ids, our logits, our greedy choices, and the chat
  template rendering render_chat's ids.
- The command line: one-line errors, nothing left behind, memory far below the model's size.
"""
import ctypes
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import unicodedata

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import regex  # noqa: E402  (installed with transformers)
import torch  # noqa: E402

import convert  # noqa: E402
import gguf_export  # noqa: E402
from checkpoint import load_model, model_tensors, save_checkpoint, tokenizer_spec_of  # noqa: E402
from conftest import rel_err  # noqa: E402
from data.prepare import prepare  # noqa: E402
from model import Llama, LlamaConfig  # noqa: E402
from test_families import CHATML_SPECIALS, NUMBERS_TEXT, QWEN_PATTERN, family_tokenizer  # noqa: E402
from test_hf_interop import (CHAT, MIXED_TEXT, TRAIN_TEXT, comparison_texts, generation_prompt,  # noqa: E402
                             llama3_style_pre_tokenizer, sft_and_text_corpus, train_bpe, train_two_steps)
from test_train import run  # noqa: E402
from tokenizer import (CHAT_TEMPLATE, CHATML_TEMPLATE, GPT2_PATTERN, LLAMA3_PATTERN, SPECIAL_TOKENS,  # noqa: E402
                       encode_text, load_tokenizer, render_chat, tokenizer_json)

V = gguf.GGUFValueType
T = gguf.GGMLQuantizationType
TYPES = {"f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0}

# llama.cpp's regex for tokenizer.ggml.pre = "llama-bpe" (src/llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_LLAMA3): Llama-3's
# pattern with the case-insensitive contractions spelled out
LLAMA_CPP_LLAMA3_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
                          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# ... for "qwen2" (LLAMA_VOCAB_PRE_TYPE_QWEN2): Qwen2's, single digits, spelled the same way
LLAMA_CPP_QWEN2_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
                         r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# ... for "smollm" (LLAMA_VOCAB_PRE_TYPE_SMOLLM): two regexes in turn, each digit, then GPT-2's on the rest

# The default model's shape (train.py: dim 192, 3 heads of 64, 1 kv head, tied, theta 1e4) with 2 layers; and a
# Llama-3 shape: BPE vocabulary with the 256 special tokens, GQA 4:2, head_dim 64 != 128 / 4, untied, llama3
# scaling that matters at these positions (theta 100, original context 32, as tests/test_hf_interop.py).
BYTE_CFG = dict(dim=192, n_layers=2, n_heads=3, n_kv_heads=1, ffn_dim=512, vocab_size=512, tie_embeddings=True,
                rope_theta=10000.0, max_seq_len=512)
LLAMA3_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)
LLAMA3_CFG = dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=256, tie_embeddings=False,
                  rope_theta=100.0, rope_scaling=LLAMA3_SCALING, max_seq_len=128)
HF_TEMPLATE = "{#- the checkpoint's own HF template #}" + CHAT_TEMPLATE
# The families, as tests/test_families.py shapes them (Qwen3: head_dim 32 != 64 / 4, untied); the tokenizer style;
# the vocabulary padded beyond the tokenizer (as Qwen's 151,936 rows for 151,665 tokens): placeholders in the file
FAMILIES = {
    "smollm2": ("smollm2", dict(dim=96, n_layers=2, n_heads=6, n_kv_heads=2, ffn_dim=96, tie_embeddings=True,
                                rope_theta=100000.0, max_seq_len=128)),
    "qwen2": ("qwen", dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, tie_embeddings=True,
                           norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=128, qkv_bias=True)),
    "qwen3": ("qwen", dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=96,
                           tie_embeddings=False, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=128, qk_norm=True)),
}
VOCAB_PADDING = 5
KINDS = ["bytes", "llama3", *FAMILIES]
ARCHS = {"bytes": "llama", "llama3": "llama", "smollm2": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
PRE = {"bytes": "llama-bpe", "llama3": "llama-bpe", "smollm2": "smollm", "qwen2": "qwen2", "qwen3": "qwen2"}
# Qwen's own chat template comes with the checkpoint (tokenizer_config.json); SmolLM2's has none: ours, ChatML
FAMILY_TEMPLATE = "{#- the family's own HF template #}" + CHATML_TEMPLATE

# q8_0: |x - q * d| <= d / 2, up to float32's rounding of q * d and of the difference (|q| <= 127, 2^-24 each)
HALF_STEP = 0.5 + 2**-16


def unit_scale_model(cfg):
    """Weights of unit-scale activations (attention scores O(1)): RoPE and the Q/K layout really matter. Norm
    weights spread around 1, biases around 0."""
    torch.manual_seed(0)
    model = Llama(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(1 + 0.3 * torch.randn_like(p) if p.ndim == 1 else torch.randn_like(p) * p.shape[1] ** -0.5)
    return model


def tokenizer_json_size(path):
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    return 1 + max([*spec["model"]["vocab"].values(), *(t["id"] for t in spec["added_tokens"])])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{kind: checkpoint dir} for every kind of KINDS."""
    root = tmp_path_factory.mktemp("ckpts")
    cfg = LlamaConfig(**BYTE_CFG)
    save_checkpoint(str(root / "bytes"), cfg, "bytes", model_tensors(unit_scale_model(cfg)))
    # a Llama-3 style tokenizer.model (tiktoken ranks, as hf2nano makes it) with an HF tokenizer_config.json beside,
    # naming bos and eos as Llama-3's does (its chat template writes bos_token)
    tok_dir = root / "tok"
    tok_dir.mkdir()
    tok = train_bpe(llama3_style_pre_tokenizer(), 700)
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.save(str(tok_dir / "tokenizer.json"))
    convert.copy_or_convert_tokenizer(str(tok_dir), str(tok_dir))
    os.remove(tok_dir / "tokenizer.json")
    json.dump({"chat_template": HF_TEMPLATE, "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
              open(tok_dir / "tokenizer_config.json", "w"))
    spec = str(tok_dir / "tokenizer.model")
    cfg = LlamaConfig(**LLAMA3_CFG, vocab_size=load_tokenizer(spec).n_vocab)
    save_checkpoint(str(root / "llama3"), cfg, spec, model_tensors(unit_scale_model(cfg)))
    # the families: their tokenizer.json kept as it is (as hf2nano keeps it), Qwen's with its HF files beside
    for style in ("smollm2", "qwen"):
        (root / style).mkdir()
        family_tokenizer(style, root / style / "tokenizer.json")
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
               "chat_template": FAMILY_TEMPLATE}, open(root / "qwen" / "tokenizer_config.json", "w"))
    for kind, (style, shape) in FAMILIES.items():
        spec = str(root / style / "tokenizer.json")
        cfg = LlamaConfig(**shape, vocab_size=tokenizer_json_size(spec) + VOCAB_PADDING)
        save_checkpoint(str(root / kind), cfg, spec, model_tensors(unit_scale_model(cfg)))
    return {kind: str(root / kind) for kind in KINDS}


@pytest.fixture(scope="module")
def exported(checkpoints, tmp_path_factory):
    """exported(kind, type) -> path of the GGUF file (each made once)."""
    root, made = tmp_path_factory.mktemp("gguf"), {}

    def get(kind, file_type):
        if (kind, file_type) not in made:
            os.makedirs(root / kind, exist_ok=True)
            path = str(root / kind / f"model-{file_type}.gguf")
            gguf_export.nano2gguf(checkpoints[kind], path, file_type)
            made[kind, file_type] = path
        return made[kind, file_type]
    return get


def field(reader, key):
    """(value type, value) of a key; arrays as (ARRAY, element type), [values]."""
    f = reader.fields[key]
    if f.types[0] == V.ARRAY:
        return (V.ARRAY, f.types[1] if len(f.types) > 1 else None), f.contents()
    return f.types[0], f.contents()


def dequantized(tensor):
    """A tensor of a GGUF file as float32, in our (rows, cols) shape, by the gguf package's own code."""
    return torch.from_numpy(np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))


def q8_0_scales(tensor):
    """The fp16 scale d of every block of 32 values of a Q8_0 tensor, repeated for each of its values."""
    blocks = np.asarray(tensor.data).reshape(-1, 34)
    d = torch.from_numpy(blocks[:, :2].copy().view(np.float16).astype(np.float32))
    return d.repeat_interleave(32, dim=1).reshape(-1)


def half_split_to_interleaved(w, n_heads):
    """Independent of gguf_export: per head, row i of the first half then row i of the second half."""
    D = w.shape[0] // n_heads
    order = torch.stack([torch.arange(D // 2), torch.arange(D // 2) + D // 2], dim=1).reshape(-1)
    return w.reshape(n_heads, D, -1)[:, order].reshape(w.shape)


def arch_of(cfg):
    return "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"


def gguf_names(cfg):
    """{our tensor name: llama.cpp's} of the tensors a checkpoint stores."""
    names = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
    if not cfg.tie_embeddings:
        names["lm_head.weight"] = "output.weight"
    parts = [("input_layernorm.weight", "attn_norm.weight"), ("self_attn.q_proj.weight", "attn_q.weight"),
             ("self_attn.k_proj.weight", "attn_k.weight"), ("self_attn.v_proj.weight", "attn_v.weight"),
             ("self_attn.o_proj.weight", "attn_output.weight"), ("post_attention_layernorm.weight", "ffn_norm.weight"),
             ("mlp.gate_proj.weight", "ffn_gate.weight"), ("mlp.up_proj.weight", "ffn_up.weight"),
             ("mlp.down_proj.weight", "ffn_down.weight")]
    if cfg.qkv_bias:
        parts += [(f"self_attn.{x}_proj.bias", f"attn_{x}.bias") for x in "qkv"]
    if cfg.qk_norm:
        parts += [(f"self_attn.{x}_norm.weight", f"attn_{x}_norm.weight") for x in "qk"]
    for i in range(cfg.n_layers):
        for ours, theirs in parts:
            names[f"layers.{i}.{ours}"] = f"blk.{i}.{theirs}"
    return names


def interleaved(cfg, theirs):
    """Does llama.cpp want this tensor's rows interleaved: attn_q / attn_k weights of the llama architecture."""
    return arch_of(cfg) == "llama" and (".attn_q.weight" in theirs or ".attn_k.weight" in theirs)


def gguf_weights(model):
    """{llama.cpp's name: tensor} that a correct export of `model` holds, llama's attn_q / attn_k rows interleaved."""
    cfg, out = model.cfg, {}
    for name, w in model_tensors(model):
        theirs = gguf_names(cfg)[name]
        if interleaved(cfg, theirs):
            w = half_split_to_interleaved(w, cfg.n_heads if ".attn_q." in theirs else cfg.n_kv_heads)
        out[theirs] = w.detach()
    return out


# ---------------------------------------------------------------- the file, as llama.cpp's loader reads it

def expected_vocabulary(kind, ckpt, vocab_size):
    """(tokens, token types, merges) the file must hold: the tokenizer.json's own (a family's, as the checkpoint
    keeps it; ours as tokenizer_json writes it), tokens by id, special tokens control (3), the rest normal (1), ids
    beyond the tokenizer placeholders, unused (5)."""
    if kind in FAMILIES:
        with open(tokenizer_spec_of(ckpt), encoding="utf-8") as f:
            spec = json.load(f)
    else:
        spec = tokenizer_json(load_tokenizer(tokenizer_spec_of(ckpt)))
    by_id = {i: (token, 1) for token, i in spec["model"]["vocab"].items()}
    by_id.update({t["id"]: (t["content"], 3) for t in spec["added_tokens"]})
    assert len(by_id) == vocab_size - (VOCAB_PADDING if kind in FAMILIES else 0)
    pairs = [by_id.get(i, (f"[PAD{i}]", 5)) for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return [t for t, _ in pairs], [k for _, k in pairs], merges


def expected_tokenizer_keys(kind, ckpt):
    """tokenizer.ggml.* (but the arrays): Llama-3's special tokens and a bos before every text for ours; for the
    families, ChatML's, no bos added (their HF tokenizers add none), and their chat template (SmolLM2's checkpoint
    has none: ours, ChatML)."""
    enc = load_tokenizer(tokenizer_spec_of(ckpt))
    ids = {name: enc.encode_single_token(name) for name in enc.special_tokens_set}
    keys = {"tokenizer.ggml.model": (V.STRING, "gpt2"), "tokenizer.ggml.pre": (V.STRING, PRE[kind]),
            "tokenizer.ggml.add_eos_token": (V.BOOL, False)}
    if kind in FAMILIES:
        keys.update({"tokenizer.ggml.bos_token_id": (V.UINT32, ids["<|endoftext|>"]),
                     "tokenizer.ggml.eos_token_id": (V.UINT32, ids["<|endoftext|>"]),
                     "tokenizer.ggml.eot_token_id": (V.UINT32, ids["<|im_end|>"]),
                     "tokenizer.ggml.add_bos_token": (V.BOOL, False),
                     "tokenizer.chat_template": (V.STRING, CHATML_TEMPLATE if kind == "smollm2" else FAMILY_TEMPLATE)})
        return keys
    for key, name in (("bos", "<|begin_of_text|>"), ("eos", "<|end_of_text|>"), ("eot", "<|eot_id|>"),
                      ("eom", "<|eom_id|>"), ("padding", "<|finetune_right_pad_id|>")):
        keys[f"tokenizer.ggml.{key}_token_id"] = (V.UINT32, ids[name])
    keys.update({"tokenizer.ggml.add_bos_token": (V.BOOL, True),
                 "tokenizer.chat_template": (V.STRING, CHAT_TEMPLATE if kind == "bytes" else HF_TEMPLATE)})
    return keys


@pytest.mark.parametrize("file_type", list(TYPES))
@pytest.mark.parametrize("kind", KINDS)
def test_metadata_and_tensors_are_what_llama_cpp_loads(kind, file_type, checkpoints, exported):
    path = exported(kind, file_type)
    with open(path, "rb") as f:
        assert f.read(8) == b"GGUF" + (3).to_bytes(4, "little")
    reader = gguf.GGUFReader(path)
    model = load_model(checkpoints[kind])
    cfg, arch = model.cfg, ARCHS[kind]
    file_types = {"f16": 1, "q8_0": 7, "bf16": 32}  # llama_ftype
    expected = {
        "general.architecture": (V.STRING, arch),
        "general.name": (V.STRING, kind),
        "general.file_type": (V.UINT32, file_types[file_type]),
        "general.quantization_version": (V.UINT32, 2),
        "general.alignment": (V.UINT32, 32),
        f"{arch}.context_length": (V.UINT32, cfg.max_seq_len),
        f"{arch}.embedding_length": (V.UINT32, cfg.dim),
        f"{arch}.block_count": (V.UINT32, cfg.n_layers),
        f"{arch}.feed_forward_length": (V.UINT32, cfg.ffn_dim),
        f"{arch}.attention.head_count": (V.UINT32, cfg.n_heads),
        f"{arch}.attention.head_count_kv": (V.UINT32, cfg.n_kv_heads),
        f"{arch}.attention.layer_norm_rms_epsilon": (V.FLOAT32, pytest.approx(cfg.norm_eps)),
        f"{arch}.rope.freq_base": (V.FLOAT32, cfg.rope_theta),
        f"{arch}.rope.dimension_count": (V.UINT32, cfg.head_dim),
        f"{arch}.vocab_size": (V.UINT32, cfg.vocab_size),
        **expected_tokenizer_keys(kind, checkpoints[kind]),
    }
    if kind in ("llama3", "qwen3"):  # head_dim 64 != 128 / 4, 32 != 64 / 4: llama.cpp would assume dim / n_heads
        expected[f"{arch}.attention.key_length"] = expected[f"{arch}.attention.value_length"] = \
            (V.UINT32, cfg.head_dim)
    found = {key: field(reader, key) for key in reader.fields if not key.startswith("GGUF.")}
    arrays = {key: found.pop(key) for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                                              "tokenizer.ggml.merges")}
    assert found == expected

    # the vocabulary: the tokenizer.json's spelling and merges, special tokens marked control, placeholders unused
    tokens, types, merges = expected_vocabulary(kind, checkpoints[kind], cfg.vocab_size)
    assert arrays["tokenizer.ggml.tokens"] == ((V.ARRAY, V.STRING), tokens)
    assert arrays["tokenizer.ggml.token_type"] == ((V.ARRAY, V.INT32), types)
    assert types.count(3) == (3 if kind in FAMILIES else 256)
    assert arrays["tokenizer.ggml.merges"][1] == merges and (kind == "bytes") == (merges == [])

    # tensors: names, dims innermost first, types (1-D stay f32), data aligned to 32
    want = {name: tuple(t.shape) for name, t in gguf_weights(model).items()}
    if cfg.rope_scaling:
        want["rope_freqs.weight"] = (cfg.head_dim // 2,)
    assert {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors} == want
    assert cfg.tie_embeddings == ("output.weight" not in want)
    assert ("blk.1.attn_v.bias" in want, "blk.1.attn_k_norm.weight" in want) == (arch == "qwen2", arch == "qwen3")
    for t in reader.tensors:
        assert t.tensor_type == (T.F32 if len(want[t.name]) == 1 else TYPES[file_type]), t.name
        assert t.data_offset % 32 == 0


def test_llama_bpe_is_our_split_pattern():
    """tokenizer.ggml.pre = "llama-bpe" makes llama.cpp split with its Llama-3 regex, and transformers with
    LLAMA3_PATTERN: both cut text exactly where our tokenizers do."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    assert GGUF_PRE_TOKENIZER_SPLITS["llama-bpe"] == LLAMA3_PATTERN
    contractions = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    assert LLAMA3_PATTERN.replace(contractions, "") == LLAMA_CPP_LLAMA3_REGEX.replace(
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])", "")
    for text in comparison_texts()[:6] + ["I'VE you'Ll WE'D it'S 'Re"]:
        assert regex.findall(LLAMA_CPP_LLAMA3_REGEX, text) == regex.findall(LLAMA3_PATTERN, text)


def llama_cpp_split(regexes, text):
    """Text cut as llama.cpp's unicode_regex_split cuts it with a list of regexes: each regex in turn cuts every
    piece the one before left, its matches and the text between them each a piece."""
    pieces = [text]
    for pattern in regexes:
        cut = []
        for piece in pieces:
            end = 0
            for m in regex.finditer(pattern, piece):
                cut += [piece[end:m.start()]] * (m.start() > end) + [m.group()]
                end = m.end()
            cut += [piece[end:]] * (end < len(piece))
        pieces = cut
    return pieces


def test_family_pre_tokenizer_names_split_as_their_tokenizers():
    """"qwen2": llama.cpp's and transformers' regexes are the Split regex of Qwen's tokenizer.json (gguf_export's
    QWEN2_PATTERN); "smollm": llama.cpp's two regexes in turn cut text where SmolLM2's Digits + ByteLevel does
    (and the digits matter: GPT-2's regex alone cuts elsewhere)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    assert GGUF_PRE_TOKENIZER_SPLITS["qwen2"] == gguf_export.QWEN2_PATTERN == QWEN_PATTERN
    texts = comparison_texts()[:6] + [NUMBERS_TEXT, "I'VE you'Ll WE'D it'S 'Re"]
    for text in texts:
        assert regex.findall(LLAMA_CPP_QWEN2_REGEX, text) == regex.findall(QWEN_PATTERN, text)
    pre = tokenizers.pre_tokenizers
    smollm = pre.Sequence([pre.Digits(individual_digits=True), pre.ByteLevel(add_prefix_space=False)])
    spell = bytes_to_unicode()  # GPT-2's byte -> character, as tokenizer.json spells bytes
    for text in texts:
        ours = ["".join(spell[b] for b in piece.encode()) for piece in llama_cpp_split([r"\p{N}", GPT2_PATTERN], text)]
        assert ours == [piece for piece, _ in smollm.pre_tokenize_str(text)], text[:80]
    assert llama_cpp_split([GPT2_PATTERN], NUMBERS_TEXT) != llama_cpp_split([r"\p{N}", GPT2_PATTERN], NUMBERS_TEXT)


# ---------------------------------------------------------------- the weights

@pytest.mark.parametrize("file_type", list(TYPES))
@pytest.mark.parametrize("kind", KINDS)
def test_tensors_are_our_weights(kind, file_type, checkpoints, exported):
    """f16 / bf16: our weights rounded, bit for bit. q8_0: every value within half its block's step d / 2, and
    the scale is d = max|x| / 127 (to fp16 rounding)."""
    reader = gguf.GGUFReader(exported(kind, file_type))
    model = load_model(checkpoints[kind])
    want = gguf_weights(model)
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        x, got = want[t.name], dequantized(t).reshape(want[t.name].shape)
        if x.ndim == 1:
            assert torch.equal(got, x), t.name
        elif file_type in ("f16", "bf16"):
            assert torch.equal(got, x.to(torch.float16 if file_type == "f16" else torch.bfloat16).float()), t.name
        else:
            d = q8_0_scales(t)
            err = (x.reshape(-1) - got.reshape(-1)).abs()
            assert (err <= d * HALF_STEP).all(), (t.name, (err - d / 2).max())
            amax = x.reshape(-1, 32).abs().amax(dim=1).repeat_interleave(32)
            assert torch.allclose(d, amax / 127, rtol=2**-10), t.name


def test_q8_0_blocks_edge_cases():
    """Zero blocks, one outlier per block, tiny and large values, a row longer than one block."""
    x = torch.randn(6, 64) * torch.tensor([1e-3, 1.0, 1.0, 50.0, 1e-3, 1e3])[:, None]
    x[1] = 0.0
    x[2, 5] = 40.0  # an outlier: its block's step is large, the other blocks keep theirs
    data = b"".join(gguf_export.encode(x, "q8_0", "x", rows_per_chunk=4))
    blocks = np.frombuffer(data, dtype=np.uint8).reshape(6, 2 * 34)
    got = torch.from_numpy(gguf.quants.dequantize(blocks, T.Q8_0))
    d = torch.from_numpy(blocks.reshape(-1, 34)[:, :2].copy().view(np.float16).astype(np.float32))
    d = d.repeat_interleave(32, dim=1).reshape(6, 64)
    assert ((x - got).abs() <= d * HALF_STEP).all()
    assert torch.equal(got[1], torch.zeros(64))
    assert (got[2, 32:] - x[2, 32:]).abs().max() < 0.1  # the outlier's block only
    # the gguf package's own quantizer (llama.cpp's reference) agrees to within one step
    ref = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(x.numpy(), T.Q8_0), T.Q8_0))
    assert ((ref - got).abs() <= d * 1.01).all()


def meta_rope(x, inv_freq):
    """Meta's RoPE: rotate adjacent pairs (x[2i], x[2i+1]) of each head by pos * inv_freq[i]. x (T, H, D)."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
    angles = torch.outer(torch.arange(x.shape[0], dtype=torch.float64), inv_freq.double()).float()
    return torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)[:, None, :]).reshape(x.shape)


@pytest.mark.parametrize("kind", ["bytes", "llama3", "smollm2"])
def test_q_k_rows_and_rope_freqs_are_what_llama_cpp_rotates(kind, checkpoints, exported):
    """llama.cpp's llama architecture rotates adjacent pairs of attn_q / attn_k outputs by angle
    pos * theta^(-2i/D) / rope_freqs[i]. Done here on the file's tensors, it reproduces our rotated q and k
    (ours in half-split order, re-ordered to compare); the rows as our checkpoint holds them would not."""
    reader = gguf.GGUFReader(exported(kind, "f16"))
    tensors = {t.name: t for t in reader.tensors}
    model = load_model(checkpoints[kind])
    cfg, attn = model.cfg, model.layers[0].self_attn
    D = cfg.head_dim
    inv_freq = cfg.rope_theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    if cfg.rope_scaling:
        inv_freq = inv_freq / dequantized(tensors["rope_freqs.weight"]).double()
    else:
        assert "rope_freqs.weight" not in tensors
    with torch.no_grad():  # f16 weights on both sides: only the layout and the rotation differ
        for proj in (attn.q_proj, attn.k_proj):
            proj.weight.copy_(proj.weight.half().float())
        x = torch.randn(60, cfg.dim)
        positions = torch.arange(60, dtype=torch.int32)
        q, k, _ = attn.qkv(x, model.rope_cos, model.rope_sin, positions)
    interleave = torch.stack([torch.arange(D // 2), torch.arange(D // 2) + D // 2], dim=1).reshape(-1)
    for name, ours, heads, w_ours in (("attn_q", q, cfg.n_heads, attn.q_proj.weight),
                                      ("attn_k", k, cfg.n_kv_heads, attn.k_proj.weight)):
        w = dequantized(tensors[f"blk.0.{name}.weight"]).reshape(heads * D, cfg.dim)
        theirs = meta_rope((x @ w.T).reshape(60, heads, D), inv_freq)
        assert (theirs - ours[..., interleave]).abs().max() < 1e-4, name
        wrong = meta_rope((x @ w_ours.detach().T).reshape(60, heads, D), inv_freq)  # rows not interleaved
        assert (wrong - ours[..., interleave]).abs().max() > 0.1, name
    if cfg.rope_scaling:  # the factors are model.py's scaling: unscaled frequencies would not match
        unscaled = cfg.rope_theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
        theirs = meta_rope((x @ dequantized(tensors["blk.0.attn_q.weight"]).reshape(-1, cfg.dim).T)
                           .reshape(60, cfg.n_heads, D), unscaled)
        assert (theirs - q[..., interleave]).abs().max() > 0.1


def neox_rope(x, inv_freq):
    """llama.cpp's NEOX rotation (qwen2, qwen3): pair (x[i], x[i + D/2]) of each head turned by pos * inv_freq[i]."""
    a, b = x.double().chunk(2, dim=-1)
    angles = torch.outer(torch.arange(x.shape[0], dtype=torch.float64), inv_freq.double())[:, None, :]
    return torch.cat([a * angles.cos() - b * angles.sin(), a * angles.sin() + b * angles.cos()], dim=-1).float()


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_qwen_rows_are_ours_for_llama_cpps_neox_rotation(kind, checkpoints, exported):
    """llama.cpp's qwen2 / qwen3 graphs: q = attn_q x + attn_q.bias (qwen2), or RMS-normalised per head and times
    attn_q_norm (qwen3), then rotated NEOX-style, likewise k. Done here on the file's tensors, it reproduces our
    rotated q and k; Meta's adjacent-pair rotation, which the llama architecture applies, would not."""
    tensors = {t.name: dequantized(t) for t in gguf.GGUFReader(exported(kind, "f16")).tensors}
    model = load_model(checkpoints[kind])
    cfg, attn = model.cfg, model.layers[0].self_attn
    D = cfg.head_dim
    inv_freq = cfg.rope_theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    with torch.no_grad():  # f16 matrices on both sides: only the layout and the rotation differ
        for proj in (attn.q_proj, attn.k_proj):
            proj.weight.copy_(proj.weight.half().float())
        x = torch.randn(60, cfg.dim)
        q, k, _ = attn.qkv(x, model.rope_cos, model.rope_sin, torch.arange(60, dtype=torch.int32))
    for name, ours, heads in (("attn_q", q, cfg.n_heads), ("attn_k", k, cfg.n_kv_heads)):
        y = x @ tensors[f"blk.0.{name}.weight"].reshape(heads * D, cfg.dim).T
        if cfg.qkv_bias:
            y = y + tensors[f"blk.0.{name}.bias"]
        y = y.reshape(60, heads, D)
        if cfg.qk_norm:
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * tensors[f"blk.0.{name}_norm.weight"]
        assert (neox_rope(y, inv_freq) - ours).abs().max() < 1e-4, name
        assert (meta_rope(y, inv_freq) - ours).abs().max() > 0.1, name


# ---------------------------------------------------------------- transformers' GGUF loader

# How far the stored weights may be from ours, as ||stored - ours|| / ||ours|| over all matrices: f16 and bf16 round
# each value within 2^-11 and 2^-8 of itself; q8_0 within d / 2 = max|block| / 254, and max|block| is at most
# sqrt(32) times the block's rms. The logits then move by a small multiple of that: in these two-layer models the
# relative logit error measures 4.7 to 5.4 times the relative weight error, for all three types.
WEIGHT_BOUNDS = {"f16": 2**-11, "bf16": 2**-8, "q8_0": 32**0.5 / 254}
LOGIT_AMPLIFICATION = 8


def hf_from_gguf(path, cfg):
    """transformers' model from the file. Its GGUF loader ignores rope_freqs (llama.cpp's llama3 scaling) and, for
    qwen3, attention.key_length (Qwen3Config's head_dim stays 128), so these are given to it here; everything else
    comes from the file."""
    extra = {}
    if cfg.rope_scaling:
        extra["rope_parameters"] = {"rope_type": "llama3", "rope_theta": cfg.rope_theta, **cfg.rope_scaling}
    if cfg.qk_norm:
        extra["head_dim"] = cfg.head_dim
    return transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                             dtype=torch.float32, **extra).eval()


@pytest.mark.parametrize("file_type", list(TYPES))
@pytest.mark.parametrize("kind", KINDS)
def test_transformers_gguf_model_gives_our_logits(kind, file_type, checkpoints, exported):
    pytest.importorskip("accelerate")  # transformers loads GGUF files only with it
    path = exported(kind, file_type)
    model = load_model(checkpoints[kind])
    cfg = model.cfg
    hf = hf_from_gguf(path, cfg)
    assert hf.config.model_type == ARCHS[kind]
    head_dim = getattr(hf.config, "head_dim", None) or hf.config.hidden_size // hf.config.num_attention_heads
    assert (head_dim, hf.config.num_key_value_heads, hf.config.tie_word_embeddings) == \
        (cfg.head_dim, cfg.n_kv_heads, cfg.tie_embeddings)
    tokens = torch.randint(0, cfg.vocab_size, (60,), generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, 60], dtype=torch.int32)
    with torch.no_grad():
        theirs = hf(input_ids=tokens[None]).logits[0]
        exact = model(tokens, cu)
        # our model with the weights the file stores: the same computation, fp32 rounding apart
        stored = {t.name: dequantized(t) for t in gguf.GGUFReader(path).tensors}
        change = total = 0.0
        for name, p in model_tensors(model):
            gname = gguf_names(cfg)[name]
            w = stored[gname].reshape(p.shape)
            if interleaved(cfg, gname):  # back to our half-split rows
                heads = cfg.n_heads if ".attn_q." in gname else cfg.n_kv_heads
                w = w.reshape(heads, -1, 2, cfg.dim).transpose(1, 2).reshape(p.shape)
            change, total = change + (w - p).double().norm() ** 2, total + p.double().norm() ** 2
            p.copy_(w)
        rounded = model(tokens, cu)
    assert (theirs - rounded).abs().max() < 1e-4
    weight_err = (change / total).sqrt().item()
    assert 0 < weight_err < WEIGHT_BOUNDS[file_type]
    assert rel_err(theirs, exact) < LOGIT_AMPLIFICATION * weight_err, (rel_err(theirs, exact), weight_err)


@pytest.mark.parametrize("kind", ["bytes", "llama3"])
def test_transformers_gguf_tokenizer_encodes_like_ours(kind, checkpoints, exported):
    """The tokenizer transformers builds from the file's metadata: our ids on real text, <|begin_of_text|> first
    (add_bos_token), our special ids, and the chat template gives render_chat's ids."""
    path = exported(kind, "q8_0")
    enc = load_tokenizer(tokenizer_spec_of(checkpoints[kind]))
    hf = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    for text in comparison_texts():
        assert hf.encode(text, add_special_tokens=False) == encode_text(enc, text), text[:80]
    assert hf.encode(TRAIN_TEXT) == [enc.encode_single_token("<|begin_of_text|>")] + encode_text(enc, TRAIN_TEXT)
    assert hf.decode(encode_text(enc, MIXED_TEXT)) == MIXED_TEXT
    assert (hf.bos_token, hf.eos_token) == ("<|begin_of_text|>", "<|end_of_text|>")
    for name in SPECIAL_TOKENS:
        assert hf.convert_tokens_to_ids(name) == enc.encode_single_token(name)
    assert hf.apply_chat_template(CHAT)["input_ids"] == render_chat(enc, CHAT)[0]


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_transformers_gguf_tokenizer_of_a_family_encodes_like_ours(kind, checkpoints, exported):
    """The tokenizer transformers builds from a family's file: our ids on real text, no bos added (add_bos_token
    false, as their HF tokenizers), <|endoftext|> as bos and eos, ChatML's special ids, and the chat template gives
    render_chat's ids. Texts go in NFC: Qwen's tokenizer.json normalizes to it, transformers' GGUF tokenizer does
    not (nor does llama.cpp's, for any Qwen GGUF). transformers knows no "smollm" split and cuts SmolLM2's text
    with GPT-2's regex alone, which parts from Digits + ByteLevel only where two or more whitespace characters
    precede a digit (llama.cpp's own "smollm" split is checked above): those texts are left out for it."""
    path = exported(kind, "q8_0")
    enc = load_tokenizer(tokenizer_spec_of(checkpoints[kind]))
    hf = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    texts = [unicodedata.normalize("NFC", text) for text in comparison_texts() + [NUMBERS_TEXT]]
    if kind == "smollm2":
        texts = [text for text in texts if not regex.search(r"\s\s\p{N}", text)]
    for text in texts:
        assert hf.encode(text, add_special_tokens=False) == encode_text(enc, text), text[:80]
    assert hf.encode(texts[0]) == encode_text(enc, texts[0])  # nothing added
    assert hf.decode(encode_text(enc, texts[1])) == texts[1]
    assert (hf.bos_token, hf.eos_token) == ("<|endoftext|>", "<|endoftext|>")
    for name in CHATML_SPECIALS:
        assert hf.convert_tokens_to_ids(name) == enc.encode_single_token(name)
    assert hf.apply_chat_template(CHAT)["input_ids"] == render_chat(enc, CHAT)[0]


def test_an_output_path_it_cannot_write_is_refused_before_any_work(tmp_path):
    # (the checkpoint does not exist: the output is checked first)
    with pytest.raises(ValueError, match="names a folder: name the file, e.g. .*model.gguf"):
        gguf_export.nano2gguf("/nonexistent", str(tmp_path / "g") + os.sep)
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match=r"its folder cannot be made \(.*f is a file\)"):
        gguf_export.nano2gguf("/nonexistent", str(tmp_path / "f" / "m.gguf"))


def test_tokenizer_json_without_every_byte_exports(tmp_path):
    """Real SmolLM2's tokenizer.json has no token for 21 of the 256 bytes, which tiktoken cannot load: the export
    takes the file's vocabulary as it is, and transformers' tokenizer from the GGUF encodes as `tokenizers` does."""
    pre = tokenizers.pre_tokenizers
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = pre.Sequence([pre.Digits(individual_digits=True), pre.ByteLevel(add_prefix_space=False)])
    tok.decoder = tokenizers.decoders.ByteLevel()
    # no initial alphabet: only the bytes the training text holds get a token
    tok.train_from_iterator([TRAIN_TEXT * 4], tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=CHATML_SPECIALS, show_progress=False))
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    vocab = tok.get_vocab()
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    assert sum(c in vocab for c in bytes_to_unicode().values()) < 200  # of the 256
    cfg = LlamaConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=len(vocab),
                      tie_embeddings=True, max_seq_len=64)
    save_checkpoint(str(tmp_path / "ckpt"), cfg, str(tmp_path / "tok" / "tokenizer.json"),
                    model_tensors(unit_scale_model(cfg)))
    out = str(tmp_path / "new" / "m.gguf")  # (a folder not made yet: made, as the folder outputs make theirs)
    gguf_export.nano2gguf(str(tmp_path / "ckpt"), out, "f16")
    reader = gguf.GGUFReader(out)
    assert reader.fields["tokenizer.ggml.tokens"].contents() == sorted(vocab, key=vocab.get)
    assert reader.fields["tokenizer.ggml.pre"].contents() == "smollm"
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "new"), gguf_file="m.gguf")
    for text in [TRAIN_TEXT] + TRAIN_TEXT.splitlines():
        if not regex.search(r"\s\s\p{N}", text):  # as above: transformers splits SmolLM2's text as GPT-2's
            assert hf.encode(text, add_special_tokens=False) == tok.encode(text).ids, text


# ---------------------------------------------------------------- refusals and the command line

def test_each_config_gets_its_architecture_or_a_refusal():
    assert [gguf_export.architecture(LlamaConfig(**switches)) for switches in
            ({}, dict(qkv_bias=True), dict(qk_norm=True))] == ["llama", "qwen2", "qwen3"]
    with pytest.raises(ValueError, match="activation='gelu_tanh': llama.cpp's llama, qwen2 and qwen3 architectures "
                                         "have SwiGLU"):
        gguf_export.architecture(LlamaConfig(activation="gelu_tanh"))
    # a field added to LlamaConfig later: at its default the model is what it was; any other value is refused by
    # name until the export learns it
    Extended = dataclasses.make_dataclass("Extended", [("sliding_window", int, dataclasses.field(default=0))],
                                          bases=(LlamaConfig,))
    assert gguf_export.architecture(Extended(qk_norm=True)) == "qwen3"
    with pytest.raises(ValueError, match="config sliding_window=4096: the GGUF export knows the llama, qwen2 and "
                                         "qwen3 architectures"):
        gguf_export.architecture(Extended(sliding_window=4096))
    for switches, message in ((dict(qk_norm=True, qkv_bias=True), "qk_norm with qkv_bias"),
                              (dict(qk_norm=True, rope_scaling=LLAMA3_SCALING),
                               r"rope_scaling \(llama3\): llama.cpp's qwen3 architecture has no RoPE scaling"),
                              (dict(qkv_bias=True, dim=64, n_heads=4, head_dim=32),
                               r"n_heads \* head_dim = 128 != dim = 64: llama.cpp's qwen2 architecture")):
        with pytest.raises(ValueError, match=message):
            gguf_export.architecture(LlamaConfig(**switches))


def test_tokenizer_without_a_llama_cpp_pre_tokenizer_is_refused(tmp_path):
    """Digits of a whole run kept together (Digits(individual_digits=false)) is a split llama.cpp has no name for:
    one line that says so, and nothing written."""
    family_tokenizer("digit_runs", tmp_path / "tokenizer.json")
    cfg = LlamaConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=64,
                      vocab_size=tokenizer_json_size(tmp_path / "tokenizer.json"))
    save_checkpoint(str(tmp_path / "ckpt"), cfg, str(tmp_path / "tokenizer.json"), model_tensors(Llama(cfg)))
    with pytest.raises(ValueError, match=r"tokenizer.json: pre_tokenizer .*Digits.*: llama.cpp knows no "
                                         r"pre-tokenizer that splits text this way") as error:
        gguf_export.nano2gguf(str(tmp_path / "ckpt"), str(tmp_path / "m.gguf"))
    assert "\n" not in str(error.value)
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "tokenizer.json"]


def test_cli_exports_a_train_py_checkpoint_and_errors_are_one_line(tmp_path):
    """A checkpoint as train.py leaves it (optimizer state and all) exports through the command line."""
    data = str(tmp_path / "data")
    prepare([sft_and_text_corpus(tmp_path / "sft.jsonl")], data, tokenizer="bytes", val_fraction=0.1, seed=0)
    ckpt = train_two_steps(data, str(tmp_path / "run"))
    assert os.path.isfile(os.path.join(ckpt, "optimizer.safetensors"))
    out = str(tmp_path / "m.gguf")
    proc = run("convert.py", "nano2gguf", ckpt, out, "--type", "q8_0")
    # into a pipe, no line per tensor: an export this quick (under the progress line's 2 s) prints its summary alone
    assert proc.stdout.startswith(f"wrote {out}: 20 tensors") and "peak RSS" in proc.stdout, proc.stdout
    assert proc.stdout.count("\n") == 1, proc.stdout
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.file_type"].contents() == 7 and reader.fields["general.name"].contents() == "run"
    assert not os.path.exists(out + ".tmp")
    proc = run("convert.py", "nano2gguf", ckpt, out, check=False)  # never overwrites
    assert (proc.returncode, proc.stderr) == (1, f"error: {out} exists: remove it or choose another output file\n")

    gelu = str(tmp_path / "gelu")
    cfg = LlamaConfig(**{**BYTE_CFG, "activation": "gelu_tanh"})
    save_checkpoint(gelu, cfg, "bytes", model_tensors(Llama(cfg)))
    proc = run("convert.py", "nano2gguf", gelu, str(tmp_path / "g.gguf"), check=False)
    assert proc.returncode == 1 and proc.stderr.startswith("error: activation='gelu_tanh'"), proc.stderr
    assert proc.stderr.count("\n") == 1


def test_checkpoint_that_does_not_match_its_config_is_refused(checkpoints, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    cfg = LlamaConfig(**BYTE_CFG)
    tensors = [(n, t[:, :64] if n.endswith("k_proj.weight") else t) for n, t in model_tensors(Llama(cfg))]
    save_checkpoint(ckpt, cfg, "bytes", tensors)
    with pytest.raises(ValueError, match=r"model.safetensors: layers.0.self_attn.k_proj.weight has shape \(64, 64\), "
                                         r"config.json implies \(64, 192\)"):
        gguf_export.nano2gguf(ckpt, str(tmp_path / "m.gguf"))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_failed_export_leaves_nothing(checkpoints, tmp_path):
    """An error in the middle of the tensors (a weight beyond float16's range) removes the partial file."""
    ckpt = str(tmp_path / "big")
    model = unit_scale_model(LlamaConfig(**BYTE_CFG))
    with torch.no_grad():
        model.layers[1].mlp.up_proj.weight[3, 7] = 1e6
    save_checkpoint(ckpt, model.cfg, "bytes", model_tensors(model))
    out = str(tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="layers.1.ffn_up.weight|blk.1.ffn_up.weight: values beyond float16's"):
        gguf_export.nano2gguf(ckpt, out, "f16")
    assert sorted(os.listdir(tmp_path)) == ["big"]
    gguf_export.nano2gguf(ckpt, out, "bf16")  # bf16 has the range
    assert gguf.GGUFReader(out).tensors[0].name == "token_embd.weight"


# ---------------------------------------------------------------- the progress line (convert.Progress)

class FakeClock:
    """time.monotonic, moved by hand."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_on_a_terminal_is_one_line_rewritten_then_erased():
    clock, out = FakeClock(), Terminal()
    with convert.Progress(3, 4e9, out=out, clock=clock) as progress:
        clock.now += 1200
        progress.update(1e9)  # a quarter in 20 minutes: the 3 GB left take an hour
        clock.now += 300
        progress.update(2e9)  # 3 GB in 1500 s: the last GB takes 500 s
        clock.now += 490
        progress.update(1e9)
    first = "writing: 1/3 tensors, 1.00/4.00 GB, 20:00 elapsed, ETA 1:00:00"
    second = "writing: 2/3 tensors, 3.00/4.00 GB, 25:00 elapsed, ETA 8:20"
    third = "writing: 3/3 tensors, 4.00/4.00 GB, 33:10 elapsed, ETA 0:00"
    # a shorter line is padded over the longer one's end; at the end the line is blanked for the summary
    assert out.getvalue() == ("\r" + first + "\r" + second.ljust(len(first)) + "\r" + third.ljust(len(first))
                              + "\r" + " " * len(first) + "\r")


def test_progress_on_a_terminal_keeps_an_unfinished_line_above_the_error():
    clock, out = FakeClock(), Terminal()
    with pytest.raises(OSError, match="disk full"):
        with convert.Progress(3, 3e9, out=out, clock=clock) as progress:
            clock.now += 5
            progress.update(1e9)
            raise OSError("disk full")
    assert out.getvalue() == "\rwriting: 1/3 tensors, 1.00/3.00 GB, 0:05 elapsed, ETA 0:10\n"


def test_progress_in_a_log_is_a_line_every_two_seconds_at_most():
    clock, out = FakeClock(), io.StringIO()
    with convert.Progress(100, 100e6, out=out, clock=clock) as progress:
        for _ in range(100):  # a tensor every 0.25 s: 25 s in all
            clock.now += 0.25
            progress.update(1e6)
    lines = out.getvalue().split("\n")
    assert len(lines) == 13 and lines[-1] == "" and "\r" not in out.getvalue()  # at 2, 4, ... 24 s
    assert lines[0] == "writing: 8/100 tensors, 0.01/0.10 GB, 0:02 elapsed, ETA 0:23"
    assert lines[-2] == "writing: 96/100 tensors, 0.10/0.10 GB, 0:24 elapsed, ETA 0:01"


def test_progress_counts_a_tensor_once_the_writer_asks_for_the_next():
    progress = convert.Progress(2, 30, out=io.StringIO(), clock=FakeClock())
    tensors = progress.track(iter(["a", "b"]), [10, 20])
    assert next(tensors) == "a" and progress.done == 0  # handed to the writer, not written yet
    assert next(tensors) == "b" and (progress.done, progress.written) == (1, 10)
    assert next(tensors, None) is None and (progress.done, progress.written) == (2, 30)


def test_each_conversion_shows_one_progress_line(tmp_path, monkeypatch):
    """nano2hf (over several shards), hf2nano and nano2gguf, on a terminal: the lines printed before the tensors,
    then one line rewritten once per tensor up to n/n, then the summary in its place."""
    cfg = LlamaConfig(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=512, max_seq_len=64)
    ckpt, hf, nano, out = (str(tmp_path / name) for name in ("ckpt", "hf", "nano", "m.gguf"))
    save_checkpoint(ckpt, cfg, "bytes", model_tensors(Llama(cfg)))
    for conversion in (lambda: convert.nano2hf(ckpt, hf, shard_size="20KB"), lambda: convert.hf2nano(hf, nano),
                       lambda: gguf_export.nano2gguf(ckpt, out)):
        monkeypatch.setattr(sys, "stdout", Terminal())
        conversion()
        progress, _, summary = sys.stdout.getvalue().partition("\r")[2].rpartition("\r")
        n = int(re.fullmatch(r"wrote .*: (\d+) tensors, .* MB\n", summary).group(1))
        assert "\n" not in progress and progress.endswith(" ")
        assert re.findall(r"writing: (\d+)/(\d+) tensors", progress) == [(str(i), str(n)) for i in range(1, n + 1)]


GROWTH_SCRIPT = """
import sys
import gguf_export


def peak_rss_mb():  # VmHWM: this process's own peak
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM")).split()[1]) / 1024


gguf_export.nano2gguf(sys.argv[4], sys.argv[5], "q8_0")  # a small model first: one-time imports and caches
for file_type, out in (("f16", sys.argv[2]), ("q8_0", sys.argv[3])):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux: reset the peak-RSS mark to the current RSS
    before = peak_rss_mb()
    gguf_export.nano2gguf(sys.argv[1], out, file_type)
    print("growth MB", peak_rss_mb() - before)
"""


def test_export_streams_without_holding_the_model(checkpoints, tmp_path):
    """A 124 MB checkpoint exports with the peak resident memory growing by a small part of it (one tensor in
    flight), where building the file in memory would grow by the model and the file."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    cfg = LlamaConfig(dim=768, n_layers=5, n_heads=6, n_kv_heads=2, ffn_dim=2048, vocab_size=512, max_seq_len=64)
    with torch.device("meta"):
        shapes = [(name, p.shape) for name, p in model_tensors(Llama(cfg))]
    entries = [(name, torch.randn(shape)) for name, shape in shapes]
    model_mb = sum(t.numel() * 4 for _, t in entries) / 2**20
    save_checkpoint(str(tmp_path / "ckpt"), cfg, "bytes", entries)
    del entries
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # glibc returns freed blocks above this size to the system at once (by default the threshold adapts upward
    # and freed tensors stay in the heap, which measures the allocator rather than the export)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(2**20))
    out = subprocess.run([sys.executable, "-c", GROWTH_SCRIPT, str(tmp_path / "ckpt"), str(tmp_path / "f16.gguf"),
                          str(tmp_path / "q8.gguf"), checkpoints["bytes"], str(tmp_path / "warm.gguf")],
                         cwd=root, env=env, capture_output=True, text=True, check=True).stdout
    growth = [float(g) for g in re.findall(r"growth MB (\S+)", out)]
    assert model_mb > 100 and len(growth) == 2 and max(growth) < 0.25 * model_mb, (growth, model_mb)
    assert os.path.getsize(tmp_path / "f16.gguf") > model_mb / 2 * 2**20


# ---------------------------------------------------------------- llama.cpp itself (llama-cpp-python, when installed)

# llama.cpp also rounds activations (the f16 KV cache; q8_0 matmuls quantize their input to q8_0 too): twice the
# error transformers shows with the same weights, about (measured here: 1.3e-3, 9.4e-3, 3.5e-2 for the Llama-3 shape)
LLAMA_CPP_BOUNDS = {"f16": 5e-3, "bf16": 3e-2, "q8_0": 8e-2}


@pytest.fixture
def llama_cpp(monkeypatch):
    """llama-cpp-python, with weight repacking off: the repacked (AMX) q8_0 kernels die of SIGILL on machines that
    list AMX but do not let a process use it (a sandbox seen here). Repacking changes speed, not the model."""
    module = pytest.importorskip("llama_cpp")  # compiles llama.cpp when installed: not among the test extras
    defaults = module.llama_cpp.llama_model_default_params

    def no_repacking():
        params = defaults()
        params.use_extra_bufts = False
        return params
    monkeypatch.setattr(module.llama_cpp, "llama_model_default_params", no_repacking)
    return module


@pytest.mark.parametrize("file_type", list(TYPES))
@pytest.mark.parametrize("kind", KINDS)
def test_llama_cpp_runs_the_export_like_our_model(kind, file_type, checkpoints, exported, llama_cpp):
    """llama.cpp tokenizes as we do (texts in NFC, which Qwen's tokenizer.json applies and llama.cpp does not),
    adds a bos where ours does (not for the families), computes our logits (within LLAMA_CPP_BOUNDS; for the
    llama3 shape only with rope_freqs applied), decodes greedily as we would, and renders our chat template's ids
    (llama.cpp recognises the template as Llama-3's, or as ChatML for the families)."""
    path = exported(kind, file_type)
    model = load_model(checkpoints[kind])
    enc = load_tokenizer(tokenizer_spec_of(checkpoints[kind]))
    llm = llama_cpp.Llama(model_path=path, n_ctx=128, logits_all=True, verbose=False, n_threads=2)
    for text in [unicodedata.normalize("NFC", t) for t in comparison_texts()[:8] + [NUMBERS_TEXT]]:
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == encode_text(enc, text), text[:80]
    text = unicodedata.normalize("NFC", TRAIN_TEXT[:100])
    prompt = llm.tokenize(text.encode(), add_bos=True, special=False)
    bos = [] if kind in FAMILIES else [enc.encode_single_token("<|begin_of_text|>")]
    assert prompt == bos + encode_text(enc, text)

    def our_logits(ids, model=model):
        with torch.no_grad():
            return model(torch.tensor(ids), torch.tensor([0, len(ids)], dtype=torch.int32))

    prompt = prompt[:48]
    llm.eval(prompt)
    theirs, ours = torch.tensor(np.array(llm.scores[:len(prompt)])), our_logits(prompt)
    err = rel_err(theirs, ours)
    assert err < LLAMA_CPP_BOUNDS[file_type], err
    if model.cfg.rope_scaling:  # without the scaling (rope_freqs) our logits would be far from llama.cpp's
        assert rel_err(theirs, our_logits(prompt, load_model(checkpoints[kind], rope_scaling=None))) > 5 * err
    # greedy decoding: each token llama.cpp picks is our model's choice too, or a near-tie with it (a gap within
    # the logit differences just measured, which the rounding of weights and activations can flip)
    llm.reset()
    continuation = [t for _, t in zip(range(24), llm.generate(prompt, temp=0.0))]
    after = our_logits(prompt + continuation)[len(prompt) - 1:-1]
    gap = after.max(dim=1).values - after[torch.arange(24), continuation]
    assert (gap <= 2 * (theirs - ours).abs().max()).all(), gap
    # the chat template in the file: llama.cpp recognises its format and renders render_chat's ids
    messages = (llama_cpp.llama_chat_message * len(CHAT))(
        *[llama_cpp.llama_chat_message(m["role"].encode(), m["content"].encode()) for m in CHAT])
    template = llm.metadata["tokenizer.chat_template"].encode()
    buffer = ctypes.create_string_buffer(4096)
    answer = [enc.encode_single_token("<|im_start|>")] + encode_text(enc, "assistant\n") if kind in FAMILIES \
        else generation_prompt(enc)
    for add_prompt, tail in ((False, []), (True, answer)):
        n = llama_cpp.llama_chat_apply_template(template, messages, len(CHAT), add_prompt, buffer, len(buffer))
        rendered = llm.tokenize(buffer.raw[:n], add_bos=True, special=True)
        assert rendered == render_chat(enc, CHAT)[0] + tail
