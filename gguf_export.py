"""A nanollama checkpoint as one GGUF file, the format llama.cpp and Ollama run (`convert.py nano2gguf`).

GGUF v3 is little-endian throughout: b"GGUF", version 3 (u32), tensor count (u64), key/value count (u64); then
the key/value pairs, each a key (string: u64 byte length + UTF-8), a value type (u32) and the value (an array is
element type u32, count u64, elements); then one info per tensor: name, number of dims (u32), the dims (u64 each,
innermost first, so a (rows, cols) matrix is listed as [cols, rows]), ggml type (u32) and the offset of its data
(u64, counted from the data start, a multiple of general.alignment = 32); then zeros up to the alignment and the
tensors' bytes, each padded to 32. As in checkpoint.write_safetensors, everything before the data depends only on
shapes and types: the header goes first and the tensors stream after it one at a time, so memory holds one tensor
(and a chunk of its conversion), never the model. The file is OUT.tmp until complete, then renamed to OUT.

What llama.cpp's llama architecture expects differently from our checkpoint:
- names: embed_tokens -> token_embd, layers.N.self_attn.q_proj -> blk.N.attn_q, ... (TENSOR_NAMES below);
- q_proj / k_proj rows: ours (HF's) hold each head's RoPE pairs half-split, [x_0 .. x_{D/2-1}, y_0 .. y_{D/2-1}];
  llama.cpp rotates adjacent rows (Meta's order x_0, y_0, x_1, y_1, ...), so each head's rows are interleaved;
- llama3 RoPE scaling: a rope_freqs.weight tensor of D/2 factors, by which llama.cpp divides each frequency;
- tied embeddings: no output.weight (llama.cpp then uses token_embd.weight for the output);
- the tokenizer as metadata (tokenizer.ggml.*): the tokens spelled with GPT-2's byte-to-character table and the
  merges, both as in tokenizer.json, token types, special ids, and the chat template.
Types: f16 and bf16 store the matrices as such. q8_0 cuts each row into blocks of 32 values x, each stored as an
fp16 scale d = max|x| / 127 and 32 int8 q = round(x / d): x = q * d within d / 2. Norms and rope_freqs stay f32.
"""
import json
import math
import os
import resource
import struct
import sys
import time

import numpy as np
import torch

from checkpoint import find_checkpoint, read_config, read_layout, read_tensors, tokenizer_spec_of
from model import Llama
from tokenizer import CHAT_TEMPLATE, LLAMA3_PATTERN, load_tokenizer, tokenizer_json

ALIGNMENT = 32
GGML_TYPES = {"f32": 0, "f16": 1, "q8_0": 8, "bf16": 30}
FILE_TYPES = {"f16": 1, "q8_0": 7, "bf16": 32}  # llama.cpp's llama_ftype: "mostly" this type
Q8_BLOCK = 32
VALUE_TYPES = {"u32": 4, "i32": 5, "f32": 6, "bool": 7, "str": 8, "array": 9}
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_UNUSED = 1, 3, 5

# llama.cpp's name for the pre-tokenizer (tokenizer.ggml.pre) that splits text with our regex
PRE_TOKENIZERS = {LLAMA3_PATTERN: "llama-bpe"}

TENSOR_NAMES = {  # ours -> GGUF's; "layers.N." becomes "blk.N."
    "embed_tokens.weight": "token_embd.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}

# LlamaConfig fields the llama architecture expresses. Any other field (the model-family work adds some) must
# keep its default, which leaves the model a plain Llama; otherwise the export stops and names it.
LLAMA_FIELDS = {"dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size", "norm_eps",
                "rope_theta", "rope_scaling", "tie_embeddings", "activation", "max_seq_len"}


def gguf_name(name):
    if name.startswith("layers."):
        _, n, rest = name.split(".", 2)
        return f"blk.{n}.{TENSOR_NAMES[rest]}"
    return TENSOR_NAMES[name]


def check_config(cfg):
    if cfg.activation != "silu":
        raise ValueError(f"activation={cfg.activation!r}: llama.cpp's llama architecture has SwiGLU (silu) only")
    default = type(cfg)()
    for key, value in cfg.to_dict().items():
        if key not in LLAMA_FIELDS and value != getattr(default, key):
            raise ValueError(f"config {key}={value!r}: the GGUF export knows only the llama architecture, "
                             "which cannot express it")


# ---- key/value metadata ----

def pack_string(text):
    data = text.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def pack_value(kind, value):
    if kind == "str":
        return pack_string(value)
    return struct.pack({"u32": "<I", "i32": "<i", "f32": "<f", "bool": "<?"}[kind], value)


def pack_kv(key, kind, value):
    """kind: "u32", "i32", "f32", "bool", "str", or a list of one of them, e.g. ["str"], for an array."""
    if isinstance(kind, list):
        items = (np.asarray(value, "<i4").tobytes() if kind[0] == "i32"
                 else b"".join(pack_value(kind[0], v) for v in value))
        body = struct.pack("<IIQ", VALUE_TYPES["array"], VALUE_TYPES[kind[0]], len(value)) + items
    else:
        body = struct.pack("<I", VALUE_TYPES[kind]) + pack_value(kind, value)
    return pack_string(key) + body


def model_metadata(cfg, name, file_type):
    meta = [
        ("general.architecture", "str", "llama"),
        ("general.name", "str", name),
        ("general.file_type", "u32", FILE_TYPES[file_type]),
        ("general.quantization_version", "u32", 2),
        ("general.alignment", "u32", ALIGNMENT),
        ("llama.context_length", "u32", cfg.max_seq_len),
        ("llama.embedding_length", "u32", cfg.dim),
        ("llama.block_count", "u32", cfg.n_layers),
        ("llama.feed_forward_length", "u32", cfg.ffn_dim),
        ("llama.attention.head_count", "u32", cfg.n_heads),
        ("llama.attention.head_count_kv", "u32", cfg.n_kv_heads),
        ("llama.attention.layer_norm_rms_epsilon", "f32", cfg.norm_eps),
        ("llama.rope.freq_base", "f32", cfg.rope_theta),
        ("llama.rope.dimension_count", "u32", cfg.head_dim),
        ("llama.vocab_size", "u32", cfg.vocab_size),
    ]
    if cfg.head_dim != cfg.dim // cfg.n_heads:  # llama.cpp's default is dim / n_heads
        meta += [("llama.attention.key_length", "u32", cfg.head_dim),
                 ("llama.attention.value_length", "u32", cfg.head_dim)]
    return meta


def chat_template(ckpt):
    """The checkpoint's own HF chat template (chat_template.jinja, or tokenizer_config.json's), else ours."""
    jinja = os.path.join(ckpt, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    config = os.path.join(ckpt, "tokenizer_config.json")
    template = None
    if os.path.isfile(config):
        with open(config, encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
    if isinstance(template, list):  # older HF files: [{"name": ..., "template": ...}]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template or CHAT_TEMPLATE


def tokenizer_metadata(enc, vocab_size, ckpt):
    """tokenizer.ggml.*: GPT-2 byte-level BPE, spelled as tokenizer.json spells it (tokenizer.tokenizer_json)."""
    if enc._pat_str not in PRE_TOKENIZERS:
        raise ValueError(f"the tokenizer splits text with {enc._pat_str!r}: llama.cpp knows no pre-tokenizer "
                         "name for that pattern")
    if enc.n_vocab > vocab_size:
        raise ValueError(f"the tokenizer has {enc.n_vocab} tokens, the model's vocab_size is {vocab_size}")
    spec = tokenizer_json(enc)
    # ids the tokenizer never produces (a vocab_size padded beyond it) get placeholder tokens, as llama.cpp's own
    # converter writes them
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [TOKEN_UNUSED] * vocab_size
    for token, i in spec["model"]["vocab"].items():
        tokens[i], types[i] = token, TOKEN_NORMAL
    for added in spec["added_tokens"]:
        tokens[added["id"]], types[added["id"]] = added["content"], TOKEN_CONTROL
    meta = [
        ("tokenizer.ggml.model", "str", "gpt2"),
        ("tokenizer.ggml.pre", "str", PRE_TOKENIZERS[enc._pat_str]),
        ("tokenizer.ggml.tokens", ["str"], tokens),
        ("tokenizer.ggml.token_type", ["i32"], types),
        ("tokenizer.ggml.merges", ["str"], spec["model"]["merges"]),
    ]
    special = enc._special_tokens
    for key, token in (("bos", "<|begin_of_text|>"), ("eos", "<|end_of_text|>"), ("eot", "<|eot_id|>"),
                       ("eom", "<|eom_id|>"), ("padding", "<|finetune_right_pad_id|>")):
        if token in special:
            meta.append((f"tokenizer.ggml.{key}_token_id", "u32", special[token]))
    # data/prepare.py starts every document with <|begin_of_text|>: so does llama.cpp when it tokenizes a prompt
    meta += [("tokenizer.ggml.add_bos_token", "bool", "<|begin_of_text|>" in special),
             ("tokenizer.ggml.add_eos_token", "bool", False),
             ("tokenizer.chat_template", "str", chat_template(ckpt))]
    return meta


# ---- tensors ----

def rope_freq_factors(cfg):
    """llama3 scaling as llama.cpp applies it: frequency i is divided by factor i. Meta's rule (model.py's
    rope_inv_freq): wavelengths below original_max / high_freq_factor keep their frequency (factor 1), those above
    original_max / low_freq_factor are divided by `factor`, and in between the scaled frequency is the blend
    (1 - s) * f / factor + s * f with s = (original_max / wavelength - low) / (high - low)."""
    s = cfg.rope_scaling
    factor, low, high, old_len = (s[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                 "original_max_position_embeddings"))
    factors = []
    for i in range(0, cfg.head_dim, 2):
        wavelen = 2 * math.pi * cfg.rope_theta ** (i / cfg.head_dim)
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def interleave_rope_rows(w, n_heads):
    """Per head, rows [x_0 .. x_{D/2-1}, y_0 .. y_{D/2-1}] (half-split) -> [x_0, y_0, x_1, y_1, ...] (Meta's)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def tensor_type(shape, file_type):
    """1-D tensors (norms) stay f32, as llama.cpp expects; q8_0 needs rows of whole blocks (f16 otherwise)."""
    if len(shape) == 1:
        return "f32"
    if file_type == "q8_0" and shape[-1] % Q8_BLOCK:
        return "f16"
    return file_type


def nbytes(shape, kind):
    n = math.prod(shape)
    return n // Q8_BLOCK * (2 + Q8_BLOCK) if kind == "q8_0" else n * (4 if kind == "f32" else 2)


def quantize_q8_0(x):
    """(n,) float values, n a multiple of 32 -> (n / 32, 34) uint8: per block the fp16 scale d, then 32 int8.
    q = round(x / d) uses d as stored (rounded to fp16), so that x - q * d is within d / 2 as dequantized."""
    blocks = x.float().reshape(-1, Q8_BLOCK)
    d = (blocks.abs().amax(dim=1, keepdim=True) / 127).half()
    if not torch.isfinite(d).all():
        raise ValueError("a weight too large for q8_0's fp16 scale (|x| > 127 * 65504)")
    q = (blocks / torch.where(d == 0, 1.0, d.float())).round().clamp(-127, 127).to(torch.int8)
    return torch.cat([d.view(torch.uint8), q.view(torch.uint8)], dim=1)


def encode(t, kind, name, rows_per_chunk):
    """Yield the bytes of tensor t as ggml type `kind`, a few rows at a time (bounded temporary memory)."""
    for chunk in t.reshape(-1, t.shape[-1]).split(rows_per_chunk):
        if kind == "q8_0":
            out = quantize_q8_0(chunk)
        else:
            if kind == "f16" and chunk.float().abs().amax() >= 65520:  # rounds to inf
                raise ValueError(f"{name}: values beyond float16's range (65504): export with --type bf16")
            out = chunk.to({"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[kind])
        yield out.contiguous().view(torch.uint8).numpy().tobytes()


def plan_tensors(cfg, weights, file_type):
    """[(GGUF name, our name or None for rope_freqs, shape, ggml type)] in file order; checks the checkpoint."""
    with torch.device("meta"):
        expected = {n: tuple(t.shape) for n, t in Llama(cfg).state_dict().items()}
    if cfg.tie_embeddings:
        expected.pop("lm_head.weight")
    found = {n: shape for n, (_, shape) in read_layout(weights).items()}
    if found != expected:
        missing, extra = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
        shapes = [f"{n} {found[n]} (config: {s})" for n, s in expected.items() if found.get(n, s) != s]
        raise ValueError(f"{weights} does not match config.json: missing {missing[:5]}, unexpected {extra[:5]}, "
                         f"shapes {shapes[:5]}")
    plan = []
    for name, shape in expected.items():
        plan.append((gguf_name(name), name, shape, tensor_type(shape, file_type)))
        if name == "embed_tokens.weight" and cfg.rope_scaling is not None:
            plan.append(("rope_freqs.weight", None, (cfg.head_dim // 2,), "f32"))
    return plan


def tensor_info(name, shape, kind, offset):
    dims = tuple(reversed(shape))  # innermost first
    return (pack_string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
            + struct.pack("<IQ", GGML_TYPES[kind], offset))


def padding(n):
    return b"\0" * (-n % ALIGNMENT)


def write_gguf(path, metadata, plan, tensors, rows_per_chunk):
    """metadata: [(key, kind, value)]; plan: [(name, _, shape, kind)]; tensors: yields each planned tensor."""
    infos, offset = [], 0
    for name, _, shape, kind in plan:
        infos.append(tensor_info(name, shape, kind, offset))
        offset += nbytes(shape, kind) + (-nbytes(shape, kind) % ALIGNMENT)
    header = b"GGUF" + struct.pack("<IQQ", 3, len(plan), len(metadata))
    header += b"".join(pack_kv(*kv) for kv in metadata) + b"".join(infos)
    with open(path, "wb") as f:
        f.write(header + padding(len(header)))
        for (name, _, shape, kind), t in zip(plan, tensors, strict=True):
            written = 0
            for data in encode(t, kind, name, rows_per_chunk):
                f.write(data)
                written += len(data)
            assert written == nbytes(shape, kind), (name, written)
            f.write(padding(written))
        f.flush()
        os.fsync(f.fileno())


def model_name(ckpt):
    """general.name: the checkpoint directory's name, or its run's (out/NAME/ckpt)."""
    path = os.path.abspath(ckpt)
    return os.path.basename(os.path.dirname(path)) if os.path.basename(path) == "ckpt" else os.path.basename(path)


def nano2gguf(ckpt_dir, out_path, file_type="f16", rows_per_chunk=4096):
    t0 = time.time()
    if file_type not in FILE_TYPES:
        raise ValueError(f"--type {file_type}: expected one of {', '.join(FILE_TYPES)}")
    if os.path.exists(out_path):
        raise FileExistsError(f"{out_path} exists: remove it or choose another output file")
    ckpt = find_checkpoint(ckpt_dir)
    cfg = read_config(ckpt)["model"]
    check_config(cfg)
    weights = os.path.join(ckpt, "model.safetensors")
    plan = plan_tensors(cfg, weights, file_type)
    enc = load_tokenizer(tokenizer_spec_of(ckpt))
    metadata = model_metadata(cfg, model_name(ckpt), file_type) + tokenizer_metadata(enc, cfg.vocab_size, ckpt)
    fallback = [name for name, _, shape, kind in plan if len(shape) > 1 and kind != file_type]
    if fallback:
        print(f"{len(fallback)} tensors stored as f16: their rows are not whole q8_0 blocks ({fallback[:3]} ...)")

    def tensors():
        names = [ours for _, ours, _, _ in plan if ours is not None]
        stream = read_tensors(weights, names)
        for i, (name, ours, _, kind) in enumerate(plan, 1):
            t = rope_freq_factors(cfg) if ours is None else next(stream)
            if ours and ours.endswith(("q_proj.weight", "k_proj.weight")):
                t = interleave_rope_rows(t, cfg.n_heads if "q_proj" in ours else cfg.n_kv_heads)
            print(f"[{i}/{len(plan)}] {name} {kind} {tuple(t.shape)}")
            yield t

    tmp = out_path + ".tmp"
    try:
        write_gguf(tmp, metadata, plan, tensors(), rows_per_chunk)
        os.replace(tmp, out_path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)
    print(f"wrote {out_path}: {len(plan)} tensors, {file_type}, {os.path.getsize(out_path) / 1e9:.3f} GB in "
          f"{time.time() - t0:.1f} s, peak RSS {peak_mb:.0f} MB")
