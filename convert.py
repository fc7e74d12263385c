"""Convert Llama-family weights between a Hugging Face model directory and a nanollama checkpoint, both ways.

    python convert.py hf2nano HF_DIR OUT_DIR [--dtype bf16|fp32|keep]     # e.g. Meta-Llama-3.1-8B-Instruct
    python convert.py nano2hf CKPT_DIR OUT_DIR [--shard_size 5GB]         # loads with LlamaForCausalLM
    python convert.py nano2gguf CKPT_DIR OUT.gguf [--type f16|bf16|q8_0]  # runs in llama.cpp / Ollama (gguf_export.py)

The families that convert are FAMILIES, by HF model_type: "llama" (Llama-3, SmolLM2), "qwen2" (Qwen2.5: q/k/v
biases) and "qwen3" (per-head q/k norms), each a pair of LlamaConfig switches on the one model. A config.json key
that asks for anything else (sliding windows, experts, an o_proj bias, RoPE scaling other than llama3's) is an error
naming the key. Tensor names only gain or lose "model." (model.py names its modules after LlamaForCausalLM), and
HF's q_proj / k_proj rows are already in the half-split RoPE order of our apply_rope: no tensor is permuted or
transposed, and a round trip is bit-exact.

Memory: an 8B model is 16 GB in bf16, so nothing here holds two copies, or even one: a safetensors header is known
before any weight is read, so checkpoint.write_safetensors writes it first and then streams one tensor at a time.

The tokenizer: hf2nano keeps Meta's tiktoken tokenizer.model, or makes one from a Llama-3 tokenizer.json; any other
byte-level BPE tokenizer.json (SmolLM2, Qwen) stays the checkpoint's tokenizer as it is, with HF's side files beside
it (tokenizer.HF_SIDE_FILES: the chat template among them). nano2hf copies those back and makes the ones missing
(tokenizer.json, tokenizer_config.json with our chat template, generation_config.json). SentencePiece tokenizers
(Llama-2, Mistral) are refused. Output goes to OUT_DIR.tmp, renamed to OUT_DIR only when complete.
"""
import argparse
import base64
import json
import os
import resource
import shutil
import sys
import time
from contextlib import contextmanager

import torch

from checkpoint import (check_tensors, find_checkpoint, read_config, read_layout, read_tensors, stored_shapes,
                        tokenizer_spec_of, write_config, write_safetensors)
from files import NULL, FileError, atomic_dir, check_types, read_json
from model import LLAMA3_ROPE_KEYS, LlamaConfig
from tokenizer import (HF_SIDE_FILES, LLAMA3_PATTERN, SPECIAL_TOKENS, HFEncoding, bos_id, eos_id,
                       hf_tokenizer_json, is_byte_tokenizer, llama3_tokenizer, load_tokenizer, read_chat_template,
                       stop_ids, tokenizer_config, tokenizer_json, tokenizer_name)

CLI_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "keep": None}

HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}  # HF's -> ours
# The model families, by HF model_type (llama.cpp names its architectures the same): the LlamaConfig switches that
# make our one model compute it, its HF class, HF's defaults for keys a config.json may leave out, and the keys
# nano2hf writes so that transformers builds nothing more (full attention, no o_proj or MLP bias).
FAMILIES = {
    "llama": dict(switches={}, architecture="LlamaForCausalLM", defaults=dict(max_position_embeddings=2048),
                  hf_keys=dict(attention_bias=False, mlp_bias=False)),
    "qwen2": dict(switches=dict(qkv_bias=True), architecture="Qwen2ForCausalLM",
                  defaults=dict(max_position_embeddings=32768),
                  hf_keys=dict(use_sliding_window=False, sliding_window=None)),
    "qwen3": dict(switches=dict(qk_norm=True), architecture="Qwen3ForCausalLM",
                  defaults=dict(max_position_embeddings=32768, head_dim=128),
                  hf_keys=dict(attention_bias=False, use_sliding_window=False, sliding_window=None)),
}
SWITCHES = ("qkv_bias", "qk_norm")  # the LlamaConfig fields FAMILIES set
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")


# ---- configs ----

# The types of the HF config.json keys read here (null: HF's default), checked before any is used
HF_KEY_TYPES = dict(
    model_type=str, hidden_size=int, num_hidden_layers=int, num_attention_heads=int, intermediate_size=int,
    vocab_size=int, num_key_value_heads=(int, NULL), head_dim=(int, NULL), rms_norm_eps=float, rope_theta=float,
    rope_scaling=(dict, NULL), rope_parameters=(dict, NULL), partial_rotary_factor=float, hidden_act=str,
    tie_word_embeddings=bool, max_position_embeddings=int, attention_bias=bool, mlp_bias=bool,
    use_sliding_window=bool, layer_types=(list, NULL))
ROPE_KEY_TYPES = dict(rope_type=str, type=str, rope_theta=float, partial_rotary_factor=float,
                      **{key: float for key in LLAMA3_ROPE_KEYS})


def config_from_hf(hf, path="config.json"):
    """LlamaConfig from an HF config.json dict; anything model.py cannot compute is an error naming its key."""
    def need(key):
        if key not in hf:
            raise FileError(f"{path} has no {key!r}")
        return hf[key]

    check_types(hf, HF_KEY_TYPES, path)
    for key in ("rope_scaling", "rope_parameters"):
        if hf.get(key):
            check_types(hf[key], ROPE_KEY_TYPES, f"{path}: {key}")
    family = FAMILIES.get(hf.get("model_type"))
    if family is None and "model_type" not in hf and isinstance(hf.get("model"), dict):  # ours: {"model": ...}
        raise FileError(f"{path} is a nanollama checkpoint's: nothing to convert, train from it with "
                        f"--init_from={os.path.dirname(path) or '.'}")
    if family is None:
        raise FileError(f"{path}: model_type={hf.get('model_type')!r}, only {', '.join(map(repr, FAMILIES))} "
                        "convert")
    if hf.get("attention_bias"):  # Llama's and Qwen3's bias q, k, v and o; Qwen2's own q/k/v biases need no key
        raise FileError(f"{path}: attention_bias=true (biases on q, k, v and o_proj), but our attention has "
                        "q/k/v biases only (Qwen2's)")
    if hf.get("mlp_bias"):
        raise FileError(f"{path}: mlp_bias=true, but our MLP has no biases")
    if moe := [key for key in MOE_KEYS if hf.get(key)]:
        raise FileError(f"{path}: {moe[0]}={hf[moe[0]]}: a mixture of experts, which our dense MLP is not")
    check_full_attention(hf, path)
    act = hf.get("hidden_act", "silu")
    if act not in HF_ACTIVATIONS:
        raise FileError(f"{path}: hidden_act={act!r}, expected one of {sorted(HF_ACTIVATIONS)}")
    # RoPE: transformers 5 writes rope_parameters = {rope_type, rope_theta, ...}; released Llama configs have a
    # top-level rope_theta and rope_scaling = {rope_type (or the older "type"), factor, ...} or null.
    rope_key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope = hf.get(rope_key) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise FileError(f"{path}: {rope_key}.rope_type={rope_type!r}, only 'llama3' scaling (or none) works")
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise FileError(f"{path}: partial_rotary_factor != 1 is not supported")
    scaling = None
    if rope_type == "llama3":
        if missing := [k for k in LLAMA3_ROPE_KEYS[:3] if k not in rope]:
            raise FileError(f"{path}: {rope_key} (llama3) lacks {missing}")
        scaling = {k: rope[k] for k in LLAMA3_ROPE_KEYS[:3]}
        # absent: transformers falls back to max_position_embeddings too
        scaling["original_max_position_embeddings"] = rope.get("original_max_position_embeddings",
                                                               hf.get("max_position_embeddings", 2048))
    defaults = family["defaults"]
    n_heads, dim = need("num_attention_heads"), need("hidden_size")
    fields = dict(
        dim=dim,
        n_layers=need("num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or defaults.get("head_dim") or (dim // n_heads if n_heads > 0 else None),
        ffn_dim=need("intermediate_size"),
        vocab_size=need("vocab_size"),
        norm_eps=hf.get("rms_norm_eps", 1e-6),  # HF's defaults where a key is absent
        rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
        rope_scaling=scaling,
        tie_embeddings=hf.get("tie_word_embeddings", False),
        activation=HF_ACTIVATIONS[act],
        max_seq_len=hf.get("max_position_embeddings", defaults["max_position_embeddings"]),
        **family["switches"],
    )
    try:
        return LlamaConfig(**fields)
    except ValueError as e:  # LlamaConfig's own checks: sizes positive, heads a multiple of kv heads, ...
        raise FileError(f"{path}: {e}") from None


def check_full_attention(hf, path="config.json"):
    """Every layer attends to its whole document: our kernels have no sliding window. Qwen2/3 configs carry a
    sliding_window that HF uses only under use_sliding_window=true; transformers 5 also lists layer_types."""
    if hf.get("use_sliding_window"):
        raise FileError(f"{path}: use_sliding_window=true (sliding_window={hf.get('sliding_window')}): only "
                        "full attention is supported")
    if sliding := [i for i, kind in enumerate(hf.get("layer_types") or []) if kind != "full_attention"]:
        raise FileError(f"{path}: layer_types has {hf['layer_types'][sliding[0]]!r} at layer {sliding[0]}: "
                        "only full attention is supported")


def model_type(cfg):
    """The family (FAMILIES) whose switches are cfg's: llama, qwen2 (qkv_bias) or qwen3 (qk_norm)."""
    for name, family in FAMILIES.items():
        if all(getattr(cfg, key) == family["switches"].get(key, False) for key in SWITCHES):
            return name
    raise ValueError("qk_norm with qkv_bias: no model family has both (Qwen3's attention_bias would bias o_proj too, "
                     "Qwen2 has no q/k norms)")


def hf_config_from(cfg, dtype, bos=None, eos=None):
    """An HF config.json dict for LlamaForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM (model_type), as
    released configs spell it: top-level rope_theta, full attention everywhere."""
    rope_scaling = None if cfg.rope_scaling is None else {"rope_type": "llama3", **cfg.rope_scaling}
    name = model_type(cfg)
    family = FAMILIES[name]
    windows = {"max_window_layers": cfg.n_layers} if "use_sliding_window" in family["hf_keys"] else {}
    return {
        "architectures": [family["architecture"]],
        "model_type": name,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_dim,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": next(hf for hf, ours in HF_ACTIVATIONS.items() if ours == cfg.activation),
        **family["hf_keys"], **windows,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "bos_token_id": bos,
        "eos_token_id": eos,
    }


def hf_name(name):
    return name if name == "lm_head.weight" else "model." + name


# ---- output ----

@contextmanager
def output_dir(out_dir):
    """Yield OUT_DIR.tmp to fill; rename it to OUT_DIR on success, delete it on any error (files.py). An existing
    OUT_DIR is never replaced."""
    if os.path.exists(out_dir):
        raise FileExistsError(f"{out_dir} exists: remove it or choose another output directory")
    with atomic_dir(out_dir) as tmp:
        yield tmp


def sizes_of(entries):
    """The bytes each of [(name, dtype, shape)] takes in the file."""
    return [torch.Size(shape).numel() * dtype.itemsize for _, dtype, shape in entries]


def summary(n_tensors, n_bytes, t0, out, file_type=None):
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)
    kind = f"{file_type}, " if file_type else ""
    print(f"wrote {out}: {n_tensors} tensors, {kind}{n_bytes / 1e9:.3f} GB in {time.time() - t0:.1f} s, "
          f"peak RSS {peak_mb:.0f} MB")


# ---- one progress line for a long conversion: hf2nano's, nano2hf's and nano2gguf's ----

def clock_time(seconds):
    """65 -> '1:05', 3725 -> '1:02:05'."""
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


class Progress:
    """The tensors written so far as one line: "writing: 12/291 tensors, 3.21/16.06 GB, 0:41 elapsed, ETA 2:45".

    An 8B model is hundreds of tensors and minutes of writing; a line per tensor would bury the other messages.
    On a terminal the line is rewritten in place (a carriage return) after each tensor and erased at the end,
    where the summary line takes its place (an unfinished one stays, above the error). Elsewhere (a log file) a
    new line comes at most every `every` seconds. The ETA counts bytes, not tensors (an embedding weighs a
    thousand norms): the bytes left at the rate so far.

        with Progress(len(sizes), sum(sizes)) as progress:
            write(progress.track(tensors, sizes))
    """

    def __init__(self, total, total_bytes, out=None, clock=time.monotonic, every=2.0):
        self.total, self.total_bytes, self.every, self.clock = total, total_bytes, every, clock
        self.out = out or sys.stdout
        self.terminal = self.out.isatty()
        self.done = self.written = self.width = 0
        self.start = self.last_shown = clock()

    def __enter__(self):
        return self

    def __exit__(self, *error):
        if self.terminal and self.width:
            self.out.write("\r" + " " * self.width + "\r" if self.done == self.total else "\n")
            self.out.flush()

    def track(self, tensors, sizes):
        """Yield each of `tensors`, counting it (sizes[i] bytes) as written when the writer asks for the next."""
        for tensor, n_bytes in zip(tensors, sizes):
            yield tensor
            self.update(n_bytes)

    def update(self, n_bytes):
        """One more tensor of n_bytes written."""
        self.done += 1
        self.written += n_bytes
        now = self.clock()
        if self.terminal:
            line = self.line(now)
            self.out.write("\r" + line.ljust(self.width))  # the spaces cover a longer line's end
            self.width = max(self.width, len(line))
        elif now - self.last_shown >= self.every:
            self.out.write(self.line(now) + "\n")
            self.last_shown = now
        else:
            return
        self.out.flush()  # a log file is block-buffered: the line would come minutes late

    def line(self, now):
        elapsed = now - self.start
        eta = clock_time(elapsed * (self.total_bytes - self.written) / self.written) if self.written else "?"
        return (f"writing: {self.done}/{self.total} tensors, {self.written / 1e9:.2f}/{self.total_bytes / 1e9:.2f} "
                f"GB, {clock_time(elapsed)} elapsed, ETA {eta}")


# ---- HF -> nanollama ----

def hf_weight_files(hf_dir):
    """{HF tensor name: file} from model.safetensors.index.json, or the names in a single model.safetensors."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index, {"weight_map": dict})["weight_map"]
        for name, file in weight_map.items():  # shards inside hf_dir only: "../x", "/x" or "config.json" is none
            if not isinstance(file, str) or os.path.isabs(file) or ".." in file.split("/") \
                    or not file.endswith(".safetensors"):
                raise FileError(f"{index}: weight_map[{name!r}] is {json.dumps(file)[:60]}, not a .safetensors file in "
                                f"{hf_dir}")
            if not os.path.isfile(os.path.join(hf_dir, file)):
                raise FileError(f"{index}: weight_map[{name!r}] is {file}, which is missing")
        return {name: os.path.join(hf_dir, file) for name, file in weight_map.items()}
    single = os.path.join(hf_dir, "model.safetensors")
    if os.path.isfile(single):
        return {name: single for name in read_layout(single)}
    raise FileError(f"{hf_dir}: no model.safetensors.index.json or model.safetensors (.bin is not supported)")


def hf_to_ours(hf_names, cfg):
    """{our name: HF name} of the tensors we keep. Skipped: rotary inv_freq buffers (recomputed from the config)
    and, with tied embeddings, an lm_head.weight some checkpoints store anyway (HF ignores it too)."""
    ours = {}
    for hf in hf_names:
        if hf.endswith("rotary_emb.inv_freq") or (cfg.tie_embeddings and hf == "lm_head.weight"):
            continue
        ours[hf if hf == "lm_head.weight" else hf.removeprefix("model.")] = hf
    return ours


def copy_or_convert_tokenizer(hf_dir, out):
    """Give the checkpoint its tokenizer; returns its config.json name. A tokenizer.model (tiktoken format):
    Meta's file when the HF directory has it (at the top or in original/), else one converted from a Llama-3
    tokenizer.json, checked to load back identically. Any other tokenizer.json (SmolLM2, Qwen, GPT-2: their own
    split pattern and special tokens, which a tokenizer.model cannot hold; our byte tokenizer exported) is the
    tokenizer as it is. The HF directory's chat template goes beside it (HF_SIDE_FILES), whichever it is."""
    refused = None
    for candidate in (os.path.join(hf_dir, "tokenizer.model"), os.path.join(hf_dir, "original", "tokenizer.model")):
        if os.path.isfile(candidate):
            try:
                llama3_tokenizer(candidate)
            except ValueError as e:  # a SentencePiece model (Llama 2) or something else: not tiktoken ranks
                print(f"tokenizer: skipping {candidate}, not a tiktoken file ({e})")
                refused = e
                continue
            shutil.copyfile(candidate, os.path.join(out, "tokenizer.model"))
            print(f"tokenizer: copied {candidate}")
            return "tokenizer.model"
    source = os.path.join(hf_dir, "tokenizer.json")
    if not os.path.isfile(source):
        if refused:  # e.g. a SentencePiece tokenizer.model alone
            raise refused
        raise FileError(f"{hf_dir}: no tiktoken tokenizer.model and no tokenizer.json")
    hf_enc = hf_tokenizer_json(source)
    if not is_llama3_like(hf_enc) or is_byte_tokenizer(hf_enc):  # bytes: kept as a file, so its template stays
        shutil.copyfile(source, os.path.join(out, "tokenizer.json"))
        print(f"tokenizer: kept {source} as the tokenizer ({len(hf_enc._mergeable_ranks)} byte-pair tokens, "
              f"{len(hf_enc._special_tokens)} special)")
        return "tokenizer.json"
    ranks = hf_enc._mergeable_ranks  # tiktoken's documented way to extend an Encoding reads these fields too
    path = os.path.join(out, "tokenizer.model")
    with open(path, "w") as f:
        for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")
    # load_tokenizer reads this file with Llama-3's split pattern and special tokens: it must match the source
    try:
        ours = load_tokenizer(path)
    except ValueError as e:
        raise ValueError(f"{source}: its regular tokens do not have ids 0..n-1, as tokenizer.model needs ({e})")
    # tokenizer.model gets Llama-3.1's 256 special tokens at ids n..n+255 (see tokenizer.py): the source's must
    # sit there too. Names may differ (Llama-3.0 has reserved tokens where 3.1 named some), but a name that both
    # use, other than a reserved placeholder, must mean the same id: the chat template looks tokens up by name.
    ours_by_id = {i: name for name, i in ours._special_tokens.items()}
    renamed = []
    for name, i in sorted(hf_enc._special_tokens.items(), key=lambda item: item[1]):
        if i not in ours_by_id:
            raise ValueError(f"{source}: special token {name!r} has id {i}, outside tokenizer.model's special ids "
                             f"{min(ours_by_id)}..{max(ours_by_id)}")
        if ours._special_tokens.get(name, i) != i and not name.startswith("<|reserved_special_token_"):
            raise ValueError(f"{source}: special token {name!r} has id {i}, tokenizer.model gives it "
                             f"{ours._special_tokens[name]}")
        if ours_by_id[i] != name:
            renamed.append(f"{i} {name} -> {ours_by_id[i]}")
    print(f"tokenizer: converted {source} ({len(ranks)} byte-pair tokens, {len(hf_enc._special_tokens)} special)")
    if renamed:
        print(f"tokenizer: {len(renamed)} special tokens keep their ids under Llama-3.1 names: {renamed[:3]} ...")
    return "tokenizer.model"


def is_llama3_like(enc):
    """Does a tokenizer.model (Llama-3's split pattern, special tokens named as Llama-3's, no normalizer) encode as
    enc does? Then hf2nano converts it into one, else it keeps the tokenizer.json."""
    return enc._pat_str == LLAMA3_PATTERN and SPECIAL_TOKENS[0] in enc._special_tokens \
        and not isinstance(enc, HFEncoding)  # SPECIAL_TOKENS[0]: Llama-3's bos


def hf2nano(hf_dir, out_dir, dtype=None):
    """dtype: torch dtype for every tensor, or None to keep each tensor's own."""
    t0 = time.time()
    config = os.path.join(hf_dir, "config.json")
    cfg = config_from_hf(read_json(config), config)
    files = hf_weight_files(hf_dir)
    names = hf_to_ours(files, cfg)  # our name -> HF name
    layouts = {file: read_layout(file) for file in sorted(set(files.values()))}  # each header checked whole
    found = {}
    for ours, hf in names.items():
        if hf not in layouts[files[hf]]:
            raise FileError(f"{files[hf]} lacks {hf}, which model.safetensors.index.json lists in it")
        found[ours] = layouts[files[hf]][hf][1]
    expected = stored_shapes(cfg)
    index = os.path.join(hf_dir, "model.safetensors.index.json")  # what lists the tensors: the index, or the file
    check_tensors(found, expected, index if os.path.isfile(index) else os.path.join(hf_dir, "model.safetensors"),
                  lambda n: names.get(n, hf_name(n)), config, lambda n: files[names[n]])
    read_chat_template(hf_dir)  # a damaged tokenizer_config.json or template: refused now, not at the first chat

    with output_dir(out_dir) as tmp:
        tokenizer_name = copy_or_convert_tokenizer(hf_dir, tmp)
        for side in HF_SIDE_FILES:
            if os.path.isfile(os.path.join(hf_dir, side)):
                shutil.copyfile(os.path.join(hf_dir, side), os.path.join(tmp, side))
        write_config(tmp, cfg, tokenizer_name)
        # one shard after the other, one tensor at a time
        position = {n: i for i, n in enumerate(expected)}
        order = sorted(expected, key=lambda n: (files[names[n]], position[n]))
        entries = [(n, dtype or layouts[files[names[n]]][names[n]][0], expected[n]) for n in order]
        sizes = sizes_of(entries)

        def tensors():
            for file in layouts:
                yield from read_tensors(file, [names[n] for n in order if files[names[n]] == file])

        with Progress(len(entries), sum(sizes)) as progress:
            write_safetensors(os.path.join(tmp, "model.safetensors"), entries, progress.track(tensors(), sizes),
                              {"format": "pt"})
    summary(len(entries), sum(sizes), t0, out_dir)


# ---- nanollama -> HF ----

def parse_size(text):
    """'5GB' -> 5_000_000_000 (decimal units, as transformers' max_shard_size); a positive number of bytes."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    unit = next((u for u in units if text.upper().endswith(u)), "")
    try:
        size = float(text[: len(text) - len(unit)]) * units.get(unit, 1)
    except ValueError:
        size = float("nan")
    if not 1 <= size < float("inf"):  # (NaN fails it too)
        raise ValueError(f"--shard_size {text!r}: expected a size such as 5GB, 500MB or a number of bytes")
    return int(size)


def plan_shards(entries, shard_size):
    """Split [(name, dtype, shape)] into consecutive groups of at most shard_size bytes (a bigger tensor alone)."""
    shards, size = [[]], 0
    for entry in entries:
        nbytes = torch.Size(entry[2]).numel() * entry[1].itemsize
        if shards[-1] and size + nbytes > shard_size:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def write_hf_tokenizer(enc, spec, ckpt, out):
    """Give the HF directory a tokenizer that transformers loads: each HF_SIDE_FILES file the checkpoint holds
    (from hf2nano, kept through training) is copied; tokenizer.json, tokenizer_config.json (chat template) and
    generation_config.json (stop at the end of text or of a chat turn) it lacks are made from `enc`. A
    tokenizer.model is copied too, for Meta's tools and for hf2nano."""
    made = {"tokenizer.json": lambda: tokenizer_json(enc), "tokenizer_config.json": lambda: tokenizer_config(enc),
            "generation_config.json": lambda: {"bos_token_id": bos_id(enc), "eos_token_id": sorted(stop_ids(enc))}}
    if tokenizer_name(spec) == "tokenizer.model":
        shutil.copyfile(spec, os.path.join(out, "tokenizer.model"))
    for name in HF_SIDE_FILES:
        if os.path.isfile(os.path.join(ckpt, name)):
            shutil.copyfile(os.path.join(ckpt, name), os.path.join(out, name))
        elif name in made:
            with open(os.path.join(out, name), "w", encoding="utf-8") as f:
                json.dump(made[name](), f, ensure_ascii=False)
            print(f"tokenizer: wrote {name}")


def nano2hf(ckpt_dir, out_dir, shard_size="5GB"):
    t0 = time.time()
    ckpt = find_checkpoint(ckpt_dir)
    cfg = read_config(ckpt)["model"]
    weights = os.path.join(ckpt, "model.safetensors")
    layout = read_layout(weights)
    expected = stored_shapes(cfg)
    check_tensors({n: shape for n, (_, shape) in layout.items()}, expected, weights,
                  config=os.path.join(ckpt, "config.json"))
    entries = [(hf_name(n), layout[n][0], expected[n]) for n in expected]
    shards = plan_shards(entries, parse_size(shard_size))
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    if len(shards) == 1:
        files = ["model.safetensors"]  # HF's convention: no index for a single file
    spec = tokenizer_spec_of(ckpt)
    enc = load_tokenizer(spec)
    dtypes = {dtype for _, dtype, _ in entries}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32

    with output_dir(out_dir) as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config_from(cfg, dtype, bos_id(enc), eos_id(enc)), f, indent=2)
        write_hf_tokenizer(enc, spec, ckpt, tmp)
        total = sum(sizes_of(entries))
        with Progress(len(entries), total) as progress:  # one line over all the shards
            for file, shard in zip(files, shards):
                tensors = read_tensors(weights, [name.removeprefix("model.") for name, _, _ in shard])
                write_safetensors(os.path.join(tmp, file), shard, progress.track(tensors, sizes_of(shard)),
                                  {"format": "pt"})
        if len(files) > 1:
            weight_map = {name: file for file, shard in zip(files, shards) for name, _, _ in shard}
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    summary(len(entries), total, t0, out_dir)


def main():
    import gguf_export  # here: it imports this module (FAMILIES, Progress)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("hf2nano", help="Hugging Face Llama directory -> nanollama checkpoint")
    p.add_argument("hf_dir")
    p.add_argument("out_dir")
    p.add_argument("--dtype", choices=sorted(CLI_DTYPES), default="keep")
    p = sub.add_parser("nano2hf", help="nanollama checkpoint -> Hugging Face Llama directory")
    p.add_argument("ckpt_dir")
    p.add_argument("out_dir")
    p.add_argument("--shard_size", default="5GB")
    p = sub.add_parser("nano2gguf", help="nanollama checkpoint -> one GGUF file for llama.cpp / Ollama")
    p.add_argument("ckpt_dir")
    p.add_argument("out_path")
    p.add_argument("--type", choices=sorted(gguf_export.FILE_TYPES), default="f16")
    args = parser.parse_args()
    try:
        if args.command == "hf2nano":
            hf2nano(args.hf_dir, args.out_dir, CLI_DTYPES[args.dtype])
        elif args.command == "nano2hf":
            nano2hf(args.ckpt_dir, args.out_dir, args.shard_size)
        else:
            gguf_export.nano2gguf(args.ckpt_dir, args.out_path, args.type)
    except (ValueError, OSError) as e:  # a bad or damaged input: what and where, without a traceback
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
