"""A nanollama checkpoint as one GGUF file, the format llama.cpp and Ollama run (`convert.py nano2gguf`).

GGUF v3 is little-endian throughout: b"GGUF", version 3 (u32), tensor count (u64), key/value count (u64); then
the key/value pairs, each a key (string: u64 byte length + UTF-8), a value type (u32) and the value (an array is
element type u32, count u64, elements); then one info per tensor: name, number of dims (u32), the dims (u64 each,
innermost first, so a (rows, cols) matrix is listed as [cols, rows]), ggml type (u32) and the offset of its data
(u64, counted from the data start, a multiple of general.alignment = 32); then zeros up to the alignment and the
tensors' bytes, each padded to 32. As in checkpoint.write_safetensors, the header goes first and the tensors stream
after it one at a time, so memory holds one tensor, never the model. The file is OUT.tmp until complete.

What llama.cpp expects differently from our checkpoint. The architecture, named as the family's HF model_type
(convert.FAMILIES); the name prefixes the model's keys, "qwen2.context_length", ...:
- llama (ours, Llama-3, SmolLM2): llama.cpp rotates adjacent rows of attn_q / attn_k (Meta's order x_0, y_0, x_1,
  y_1, ...), ours (HF's) hold each head's RoPE pairs half-split, [x_0 .. x_{D/2-1}, y_0 .. y_{D/2-1}]: each head's
  rows are interleaved. llama3 RoPE scaling: a rope_freqs.weight tensor of D/2 factors dividing the frequencies;
- qwen2 (qkv_bias: + attn_q.bias, attn_k.bias, attn_v.bias) and qwen3 (qk_norm: + attn_q_norm.weight,
  attn_k_norm.weight): llama.cpp rotates NEOX-style, pairs half a head apart, so the rows stay as ours.
Names: TENSOR_NAMES (layers.N.self_attn.q_proj -> blk.N.attn_q, ...); tied embeddings store no output.weight.
The tokenizer as metadata (tokenizer.ggml.*), from a tokenizer.json: the checkpoint's own (SmolLM2, Qwen) or the
one tokenizer.tokenizer_json writes of ours. Its tokens as it spells them (GPT-2's byte-to-character table), its
merges, token types, special ids, whether it puts a bos before every text, llama.cpp's name for its pre-tokenizer
(PRE_TOKENIZERS), and the chat template.
Types: f16 and bf16 store the matrices as such; q8_0 cuts each row into blocks of 32 values x, each stored as an
fp16 scale d = max|x| / 127 and 32 int8 q = round(x / d). Norms, biases and rope_freqs stay f32.
"""
import collections
import json
import math
import os
import struct
import time

import numpy as np
import torch

from checkpoint import (check_tensors, find_checkpoint, read_config, read_layout, read_tensors, stored_shapes,
                        tokenizer_spec_of)
from convert import Progress, model_type, summary
from files import read_json
from tokenizer import (LLAMA3_PATTERN, ROLES, chat_template_of, load_tokenizer, pre_tokenizer_steps, tokenizer_json,
                       tokenizer_name)

ALIGNMENT = 32
GGML_TYPES = {"f32": 0, "f16": 1, "q8_0": 8, "bf16": 30}
FILE_TYPES = {"f16": 1, "q8_0": 7, "bf16": 32}  # llama.cpp's llama_ftype: "mostly" this type
Q8_BLOCK = 32
VALUE_TYPES = {"u32": 4, "i32": 5, "f32": 6, "bool": 7, "str": 8, "array": 9}
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5

# Qwen2's split regex (Qwen2.5's and Qwen3's tokenizer.json): Llama-3's with single digits
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                 r"|\s+(?!\S)|\s+")

# tokenizer.json pre-tokenizers (pre_tokenizer_key) -> llama.cpp's name for the same split (tokenizer.ggml.pre)
PRE_TOKENIZERS = {
    (("ByteLevel", False, True),): "gpt-2",  # GPT-2's regex
    (("Digits", True), ("ByteLevel", False, True)): "smollm",  # each digit alone, then GPT-2's regex
    (("Split", LLAMA3_PATTERN, "Isolated", False), ("ByteLevel", False, False)): "llama-bpe",  # ours, Llama-3
    (("Split", QWEN2_PATTERN, "Isolated", False), ("ByteLevel", False, False)): "qwen2",  # Qwen2.5, Qwen3
}

# The special tokens llama.cpp is told about, by name, the first one the tokenizer has (tokenizer.ROLES: what plays
# bos, eos and a chat turn's end in training and sampling here)
SPECIAL_KEYS = {"bos": ROLES["bos"], "eos": ROLES["eos"], "eot": ROLES["eot"], "eom": ("<|eom_id|>",),
                "padding": ("<|finetune_right_pad_id|>",)}

TENSOR_NAMES = {  # ours -> GGUF's; "layers.N." becomes "blk.N."
    "embed_tokens.weight": "token_embd.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}

# LlamaConfig fields the three architectures express. Any other field (one added later) must keep its default;
# otherwise the export stops and names it.
KNOWN_FIELDS = {"dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size", "norm_eps",
                "rope_theta", "rope_scaling", "tie_embeddings", "activation", "max_seq_len", "qkv_bias", "qk_norm"}


def gguf_name(name):
    if name.startswith("layers."):
        _, n, rest = name.split(".", 2)
        return f"blk.{n}.{TENSOR_NAMES[rest]}"
    return TENSOR_NAMES[name]


def architecture(cfg):
    """llama.cpp's architecture that computes what cfg does: qwen3 (qk_norm), qwen2 (qkv_bias) or llama; a config
    none of them can express is an error naming what."""
    if cfg.activation != "silu":
        raise ValueError(f"activation={cfg.activation!r}: llama.cpp's llama, qwen2 and qwen3 architectures have "
                         "SwiGLU (silu) only")
    default = type(cfg)()
    for key, value in cfg.to_dict().items():
        if key not in KNOWN_FIELDS and value != getattr(default, key):
            raise ValueError(f"config {key}={value!r}: the GGUF export knows the llama, qwen2 and qwen3 "
                             "architectures, which cannot express it")
    arch = model_type(cfg)  # llama.cpp's name for each family is HF's model_type
    if arch != "llama" and cfg.rope_scaling is not None:  # its graph passes no frequency factors to RoPE
        raise ValueError(f"rope_scaling (llama3): llama.cpp's {arch} architecture has no RoPE scaling factors")
    if arch == "qwen2" and cfg.n_heads * cfg.head_dim != cfg.dim:  # it sizes attn_q and attn_output by dim
        raise ValueError(f"n_heads * head_dim = {cfg.n_heads * cfg.head_dim} != dim = {cfg.dim}: llama.cpp's qwen2 "
                         "architecture needs them equal")
    return arch


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


def model_metadata(cfg, arch, name, file_type):
    meta = [
        ("general.architecture", "str", arch),
        ("general.name", "str", name),
        ("general.file_type", "u32", FILE_TYPES[file_type]),
        ("general.quantization_version", "u32", 2),
        ("general.alignment", "u32", ALIGNMENT),
        (f"{arch}.context_length", "u32", cfg.max_seq_len),
        (f"{arch}.embedding_length", "u32", cfg.dim),
        (f"{arch}.block_count", "u32", cfg.n_layers),
        (f"{arch}.feed_forward_length", "u32", cfg.ffn_dim),
        (f"{arch}.attention.head_count", "u32", cfg.n_heads),
        (f"{arch}.attention.head_count_kv", "u32", cfg.n_kv_heads),
        (f"{arch}.attention.layer_norm_rms_epsilon", "f32", cfg.norm_eps),
        (f"{arch}.rope.freq_base", "f32", cfg.rope_theta),
        (f"{arch}.rope.dimension_count", "u32", cfg.head_dim),
        (f"{arch}.vocab_size", "u32", cfg.vocab_size),
    ]
    if cfg.head_dim != cfg.dim // cfg.n_heads:  # llama.cpp's default is dim / n_heads
        meta += [(f"{arch}.attention.key_length", "u32", cfg.head_dim),
                 (f"{arch}.attention.value_length", "u32", cfg.head_dim)]
    return meta


def tokenizer_json_of(ckpt):
    """(tokenizer.json as a dict, where it comes from): a checkpoint's own tokenizer.json is read as it is (it may
    lack byte tokens, which tiktoken could not load); ours (bytes, tokenizer.model) becomes the one
    tokenizer.tokenizer_json writes, which encodes as it does."""
    spec = tokenizer_spec_of(ckpt)
    enc = load_tokenizer(spec)  # checks the file whole
    if spec != "bytes" and tokenizer_name(spec) == "tokenizer.json":
        return read_json(spec), spec
    return tokenizer_json(enc), spec


def pre_tokenizer_key(pre):
    """A tokenizer.json pre_tokenizer as the tuple of what each of its steps does (the keys of PRE_TOKENIZERS)."""
    described = []
    for step in pre_tokenizer_steps(pre):
        kind = step.get("type")
        if kind == "ByteLevel":
            described.append((kind, step.get("add_prefix_space", True), step.get("use_regex", True)))
        elif kind == "Digits":
            described.append((kind, step.get("individual_digits", False)))
        elif kind == "Split":
            described.append((kind, (step.get("pattern") or {}).get("Regex"), step.get("behavior"),
                              step.get("invert", False)))
        else:
            described.append((kind,))
    return tuple(described)


def pre_tokenizer_name(spec, source):
    """llama.cpp's name for how a byte-level BPE tokenizer.json splits text (tokenizer.ggml.pre)."""
    model, normalizer = spec.get("model") or {}, (spec.get("normalizer") or {}).get("type")
    # NFC is Qwen's; llama.cpp does not apply it (nor to any Qwen GGUF): text with decomposed accents differs
    if model.get("type") != "BPE" or model.get("byte_fallback") or normalizer not in (None, "NFC"):
        raise ValueError(f"{source}: not a byte-level BPE tokenizer (model {model.get('type')}, byte_fallback "
                         f"{model.get('byte_fallback')}, normalizer {normalizer})")
    steps = pre_tokenizer_key(spec.get("pre_tokenizer"))
    if steps not in PRE_TOKENIZERS:
        raise ValueError(f"{source}: pre_tokenizer {json.dumps(spec.get('pre_tokenizer'))[:200]}: llama.cpp knows no "
                         "pre-tokenizer that splits text this way (exported: GPT-2's ByteLevel, SmolLM2's Digits + "
                         "ByteLevel, Split with Llama-3's or Qwen2's regex)")
    return PRE_TOKENIZERS[steps]


def added_token_type(added):
    """CONTROL for an added token the tokenizer marks special or that looks like a control token (<|...|>), else
    USER_DEFINED (Qwen's <think>): llama.cpp matches both whole in a text. So decides llama.cpp's own converter."""
    content = added["content"]
    return TOKEN_CONTROL if added.get("special") or (content.startswith("<|") and content.endswith("|>")) \
        else TOKEN_USER_DEFINED


def vocabulary(spec, vocab_size, source):
    """(tokens, types): a string and a type for every id below vocab_size: the vocab's tokens NORMAL, the added
    tokens as added_token_type says; ids the tokenizer never produces (a vocab_size padded beyond it) get
    placeholders, UNUSED, as llama.cpp's converter writes them."""
    tokens, types = [f"[PAD{i}]" for i in range(vocab_size)], [TOKEN_UNUSED] * vocab_size
    entries = [(i, token, TOKEN_NORMAL) for token, i in spec["model"]["vocab"].items()]
    entries += [(t["id"], t["content"], added_token_type(t)) for t in spec.get("added_tokens") or []]
    for i, token, kind in entries:
        if i >= vocab_size:
            raise ValueError(f"{source}: token {token!r} has id {i}, beyond the model's vocab_size {vocab_size}")
        tokens[i], types[i] = token, kind
    if twice := [token for token, n in collections.Counter(tokens).items() if n > 1]:
        raise ValueError(f"{source}: {twice[0]!r} is the token of two ids, which llama.cpp refuses")
    return tokens, types


def merges_of(spec, source):
    """The merges as "a b" strings (newer tokenizer.json files list them as [a, b])."""
    merges = spec["model"].get("merges") or []
    pairs = [m if isinstance(m, str) else " ".join(m) for m in merges]
    if any(m.count(" ") != 1 for m in pairs):  # a byte-level token spells a space as "Ġ", never " "
        raise ValueError(f"{source}: a merge with a space inside a token: not a byte-level BPE")
    return pairs


def leading_special(spec):
    """The special token the tokenizer puts before every text (a post_processor template that starts with one),
    or None."""
    post = spec.get("post_processor") or {}
    for step in post.get("processors") or [post]:
        if step.get("type") == "TemplateProcessing" and step.get("single"):
            return step["single"][0].get("SpecialToken", {}).get("id")
    return None


def tokenizer_metadata(ckpt, vocab_size):
    """tokenizer.ggml.*: GPT-2 byte-level BPE, from the checkpoint's tokenizer.json (tokenizer_json_of)."""
    spec, source = tokenizer_json_of(ckpt)
    pre = pre_tokenizer_name(spec, source)
    tokens, types = vocabulary(spec, vocab_size, source)
    meta = [
        ("tokenizer.ggml.model", "str", "gpt2"),
        ("tokenizer.ggml.pre", "str", pre),
        ("tokenizer.ggml.tokens", ["str"], tokens),
        ("tokenizer.ggml.token_type", ["i32"], types),
        ("tokenizer.ggml.merges", ["str"], merges_of(spec, source)),
    ]
    ids = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec.get("added_tokens") or []}}
    # a bos before every text as the tokenizer puts it (ours: <|begin_of_text|>, as data/prepare.py starts every
    # document); SmolLM2's and Qwen's put none, and llama.cpp then adds none to a prompt either
    first = leading_special(spec)
    if first is not None and first not in ids:
        raise ValueError(f"{source}: its post_processor puts {first!r} before every text, a token it does not have")
    for key, names in SPECIAL_KEYS.items():
        name = first if key == "bos" and first else next((n for n in names if n in ids), None)
        if name is not None:
            meta.append((f"tokenizer.ggml.{key}_token_id", "u32", ids[name]))
    template, _ = chat_template_of(load_tokenizer(tokenizer_spec_of(ckpt)))  # the one render_chat renders
    meta += [("tokenizer.ggml.add_bos_token", "bool", first is not None),
             ("tokenizer.ggml.add_eos_token", "bool", False),
             ("tokenizer.chat_template", "str", template)]
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
    """1-D tensors (norms, biases) stay f32, as llama.cpp expects; q8_0 needs rows of whole blocks (f16 otherwise)."""
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
    expected = stored_shapes(cfg)
    check_tensors({n: shape for n, (_, shape) in read_layout(weights).items()}, expected, weights)
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
    if not os.path.basename(out_path):
        raise ValueError(f"output {out_path!r} names a folder: name the file, e.g. "
                         f"{os.path.join(out_path or '.', 'model.gguf')}")
    try:  # its folder, made as the folder outputs make theirs: before the work, which may take minutes
        os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        raise ValueError(f"output {out_path}: its folder cannot be made ({e.filename} is a file)") from None
    ckpt = find_checkpoint(ckpt_dir)
    cfg = read_config(ckpt)["model"]
    arch = architecture(cfg)
    weights = os.path.join(ckpt, "model.safetensors")
    plan = plan_tensors(cfg, weights, file_type)
    metadata = model_metadata(cfg, arch, model_name(ckpt), file_type) + tokenizer_metadata(ckpt, cfg.vocab_size)
    fallback = [name for name, _, shape, kind in plan if len(shape) > 1 and kind != file_type]
    if fallback:
        print(f"{len(fallback)} tensors stored as f16: their rows are not whole q8_0 blocks ({fallback[:3]} ...)")

    def tensors():
        names = [ours for _, ours, _, _ in plan if ours is not None]
        stream = read_tensors(weights, names)
        for _, ours, _, _ in plan:
            t = rope_freq_factors(cfg) if ours is None else next(stream)
            if arch == "llama" and ours and ours.endswith(("q_proj.weight", "k_proj.weight")):
                t = interleave_rope_rows(t, cfg.n_heads if "q_proj" in ours else cfg.n_kv_heads)
            yield t

    sizes = [nbytes(shape, kind) for _, _, shape, kind in plan]
    tmp = out_path + ".tmp"
    try:
        with Progress(len(plan), sum(sizes)) as progress:
            write_gguf(tmp, metadata, plan, progress.track(tensors(), sizes), rows_per_chunk)
        os.replace(tmp, out_path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    summary(len(plan), os.path.getsize(out_path), t0, out_path, file_type)
