"""Checkpoint directories: what train.py writes, and what sample.py, convert.py and --init_from read.

    DIR/config.json              {"model": LlamaConfig fields, "tokenizer": "bytes", "tokenizer.model" or
                                 "tokenizer.json", "step"}
    DIR/model.safetensors        the weights under model.py's names (a tied lm_head is stored once, as embed_tokens)
    DIR/tokenizer.model          the tokenizer file, when it is not the built-in byte one: tiktoken ranks (Llama-3),
      or DIR/tokenizer.json      or a Hugging Face tokenizer.json kept as it is (SmolLM2, Qwen: their own split
                                 pattern and special tokens); and the tokenizer.HF_SIDE_FILES beside it (put there by
                                 convert.py hf2nano: chat template, generation defaults)
    DIR/optimizer.safetensors    training checkpoints only: every optimizer state tensor, named "{parameter}.{key}"
    DIR/train_state.json         training checkpoints only: step, data-loader cursor, the run's settings

Nothing is pickled: tensors go to safetensors, the rest to JSON, so reading a checkpoint never runs code from it.

Writing streams one tensor at a time: the safetensors header (names, dtypes, shapes, byte ranges) is known before
any tensor is read, so each tensor is gathered (an FSDP shard), copied to the host, written and dropped before
the next one. Host memory holds one tensor, never the model. The same sizes give the checkpoint's bytes before
the first byte is written, so the caller can check the free disk space first (checkpoint_bytes, free_bytes).
A save fills DIR.tmp, fsyncs it, moves DIR to DIR.old, renames DIR.tmp to DIR and deletes DIR.old (files.py): a
crash or a full disk at any point leaves DIR (or DIR.old, which find_checkpoint takes) exactly as it was.

Every damaged or missing file raises files.FileError, whose message names the file and what is wrong: the scripts
print it as one line. read_header checks a whole safetensors header before a byte of data is read, so a file from
anywhere cannot make us allocate, seek or reshape past its own size.
"""
import atexit
import fcntl
import itertools
import json
import math
import os
import shutil
import struct

import torch

from files import FileError, atomic_dir, need, read_json, tmp_path
from kernels.common import ADAMW8BIT_BLOCK
from model import Llama, LlamaConfig
from tokenizer import TOKENIZER_NAMES, load_tokenizer, tokenizer_files, tokenizer_name

FORMAT_VERSION = 2  # 1: train_state.pt (pickle), no longer read
DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
               torch.int8: "I8", torch.uint8: "U8"}  # the 8-bit codes of optim.AdamW8bit, stored as they are
# what a safetensors file read may hold: ours, and the integer and fp8 types Hugging Face files may carry
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()} | {
    "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit


# ---- safetensors, streamed ----

def write_safetensors(path, entries, tensors, metadata=None):
    """Write a safetensors file without holding its tensors: the header from `entries` [(name, dtype, shape)],
    then the bytes of each tensor that `tensors` yields, in the same order (each cast to its entry's dtype and
    copied to the host alone). The file is fsynced before it is closed.

    Format: 8-byte little-endian header length, the JSON header (padded with spaces to a multiple of 8 so the
    data stays aligned), then every tensor's row-major bytes back to back; data_offsets count from the data start."""
    header, offset = {"__metadata__": metadata or {}}, 0
    for name, dtype, shape in entries:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for (name, dtype, shape), t in zip(entries, tensors, strict=True):
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name}: got shape {tuple(t.shape)}, expected {tuple(shape)}")
            t = t.detach().to("cpu", dtype).contiguous()
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)  # the tensor's own memory, no copy
        f.flush()
        os.fsync(f.fileno())


def read_header(path):
    """(data start, {name: (dtype, shape, (start, end))}) of a safetensors file, the whole header checked first: a
    JSON object whose entries (besides "__metadata__") are {"dtype": one of DTYPES, "shape": [non-negative ints],
    "data_offsets": [start, end]}, end - start = numel x itemsize; sorted by start, the byte ranges tile the data
    after the header exactly, and the data ends where the file ends. Anything else raises FileError naming
    the file (and the tensor)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if n is None or n > size - 8:
                raise FileError(f"{path}: truncated or not a safetensors file ({size} bytes)")
            if n > MAX_HEADER_BYTES:
                raise FileError(f"{path}: not a safetensors file (a header of {n:,} bytes)")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise FileError(f"{path}: missing") from None
    except FileError:
        raise
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8
        raise FileError(f"{path}: damaged header ({str(e)[:100]})") from None
    if not isinstance(header, dict):
        raise FileError(f"{path}: damaged header (a JSON {type(header).__name__}, not an object)")
    data_bytes = size - 8 - n
    layout = {name: _tensor_entry(path, name, entry, data_bytes)
              for name, entry in header.items() if name != "__metadata__"}
    end = 0
    for name, (_, _, (start, stop)) in sorted(layout.items(), key=lambda item: item[1][2]):
        if start != end:
            raise FileError(f"{path}: {name} starts at data byte {start}, expected {end} (tensors overlap or "
                            "leave a gap)")
        end = stop
    if end != data_bytes:
        raise FileError(f"{path}: {'truncated' if end > data_bytes else 'damaged'}: its header describes "
                        f"{8 + n + end} bytes, the file has {size}")
    return 8 + n, layout


def _tensor_entry(path, name, entry, data_bytes):
    """(dtype, shape, (start, end)) of one header entry, each field checked (read_header)."""
    if not isinstance(entry, dict):
        raise FileError(f"{path}: {name}: damaged header (a JSON {type(entry).__name__}, not an object)")
    where = f"{path}: {name}"
    dtype = need(entry, "dtype", str, where)
    shape = need(entry, "shape", list, where)
    offsets = need(entry, "data_offsets", list, where)
    if dtype not in DTYPES:
        raise FileError(f"{where} has dtype {dtype[:20]!r}, expected one of {sorted(DTYPES)}")
    if not all(type(d) is int and d >= 0 for d in shape):
        raise FileError(f"{where}: shape {json.dumps(shape)[:60]} is not a list of non-negative ints")
    if len(offsets) != 2 or not all(type(o) is int for o in offsets) or not 0 <= offsets[0] <= offsets[1]:
        raise FileError(f"{where}: data_offsets {json.dumps(offsets)[:60]} are not two ints 0 <= start <= end")
    start, end = offsets
    if end > data_bytes:
        raise FileError(f"{path}: truncated: {name} ends at data byte {end}, the file holds {data_bytes}")
    if end - start != math.prod(shape) * DTYPES[dtype].itemsize:
        raise FileError(f"{where}: {end - start} bytes for shape {tuple(shape)} of {dtype}")
    return DTYPES[dtype], tuple(shape), (start, end)


def read_layout(path):
    """{name: (dtype, shape)} of a whole safetensors file."""
    return {name: (dtype, shape) for name, (dtype, shape, _) in read_header(path)[1].items()}


def read_tensors(path, names, device="cpu"):
    """Yield the tensors `names` of a safetensors file, one at a time, on `device`. Each is read into memory of its
    own (not memory-mapped), so the host holds one tensor at a time, not the file's pages."""
    data_start, layout = read_header(path)
    with open(path, "rb") as f:
        for name in names:
            dtype, shape, (start, end) = layout[name]
            buffer = torch.empty(end - start, dtype=torch.uint8)
            f.seek(data_start + start)
            if f.readinto(buffer.numpy()) != end - start:
                raise FileError(f"{path}: {name} could not be read whole")
            yield buffer.view(dtype).reshape(shape).to(device)


# ---- what a training checkpoint holds ----

def full_tensor(t):
    """A whole tensor from an FSDP shard (a collective: every rank calls it, in the same order); else t itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def stored(state, cfg):
    """The weights of a state dict that a checkpoint stores: all but a tied lm_head.weight, which IS
    embed_tokens.weight and is stored once, under that name (load_model ties it again)."""
    return {name: t for name, t in state.items() if not (cfg.tie_embeddings and name == "lm_head.weight")}


def model_tensors(model):
    """[(name, tensor)] of the weights to store, in model order."""
    return list(stored(model.state_dict(), model.cfg).items())


def stored_shapes(cfg):
    """{name: shape} of the weights a checkpoint of this config stores, in model order."""
    with torch.device("meta"):  # shapes only: allocates nothing
        return {name: tuple(t.shape) for name, t in stored(Llama(cfg).state_dict(), cfg).items()}


def check_tensors(found, expected, where, display=str, config="config.json", file_of=None):
    """found, expected: {our name: shape}. Every expected tensor present with its shape, nothing else, or a
    FileError. display(our name) is the name the user's file has; where, config and file_of(our name) name the file
    that lists the tensors, the config.json and the file a tensor is in."""
    missing = [display(n) for n in expected if n not in found]
    unexpected = [display(n) for n in found if n not in expected]
    if missing or unexpected:
        raise FileError(f"{where} does not match {config}: missing tensors {missing[:5]}, unexpected tensors "
                        f"{unexpected[:5]}")
    for name, shape in expected.items():
        if tuple(found[name]) != shape:
            raise FileError(f"{file_of(name) if file_of else where}: {display(name)} has shape "
                            f"{tuple(found[name])}, {config} implies {shape}")


def optimizer_tensors(model, optimizer):
    """[(f"{parameter name}.{state key}", tensor)] of every optimizer state tensor (moments, Kahan buffers, Adam
    step counts), in parameter order. Parameters the optimizer has not stepped yet have no state and no entry."""
    if hasattr(optimizer, "wait_for_state"):  # optim.AdamW8bit's offloaded state may be on its way to the host
        optimizer.wait_for_state()
    return [(f"{name}.{key}", value) for name, p in model.named_parameters()
            for key, value in optimizer.state.get(p, {}).items()]


def load_optimizer_state(model, optimizer, ckpt_dir):
    """Put the state of ckpt_dir/optimizer.safetensors into `optimizer`, one tensor at a time, on each parameter's
    device (optim.AdamW8bit's offloaded state: in pinned host memory) and in the dtype it was saved in; under FSDP
    each rank keeps its own shard. Adam's step count lives on
    the CPU unless the optimizer is fused or capturable (as torch.optim.AdamW.load_state_dict places it)."""
    path = os.path.join(ckpt_dir, "optimizer.safetensors")
    params = dict(model.named_parameters())
    group_of = {p: group for group in optimizer.param_groups for p in group["params"]}
    layout = read_layout(path)
    check_optimizer_layout(path, layout, params)
    for name, value in zip(layout, read_tensors(path, layout)):
        param_name, key = name.rsplit(".", 1)
        p = params[param_name]
        group = group_of[p]
        if key == "step":
            if not 0 <= value.item() < 2**31:
                raise FileError(f"{path}: {name} is {value.item()}")
            on_device = group.get("fused") or group.get("capturable")
            value = value.to(p.device) if on_device else value
        elif hasattr(p, "device_mesh"):  # an FSDP shard: keep this rank's part of the whole tensor
            from torch.distributed.tensor import distribute_tensor
            value = distribute_tensor(value.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
        elif hasattr(optimizer, "place"):  # optim.AdamWKahan and AdamW8bit (offloaded state: host memory)
            value = optimizer.place(p, value, f"{param_name}.exp_avg_scale" in layout)
        else:
            value = value.to(p.device)
        optimizer.state[p][key] = value


def check_optimizer_layout(path, layout, params):
    """Each tensor of optimizer.safetensors (its layout {name: (dtype, shape)}) belongs to a parameter of `params`
    {name: parameter}, and each parameter's state has the keys, shapes and dtypes optim.py gives it: step (an fp32
    scalar), exp_avg and exp_avg_sq (the parameter's shape: fp32 or the parameter's dtype, or int8 / uint8 codes
    with fp32 exp_avg_scale and exp_avg_sq_scale, one per block), and comp (fp16) where weights are compensated."""
    states = {}
    for name, entry in layout.items():
        param_name, _, key = name.rpartition(".")
        if param_name not in params:
            raise FileError(f"{path}: {name} belongs to no parameter of this model")
        states.setdefault(param_name, {})[key] = entry
    for param_name, state in states.items():
        p = params[param_name]
        coded, blocks = "exp_avg_scale" in state, (-(-p.numel() // ADAMW8BIT_BLOCK),)
        moments = ({torch.int8}, {torch.uint8}) if coded else ({torch.float32, p.dtype},) * 2
        expected = {"step": ({torch.float32}, ()), "exp_avg": (moments[0], p.shape), "exp_avg_sq": (moments[1], p.shape)}
        if coded:
            expected |= {"exp_avg_scale": ({torch.float32}, blocks), "exp_avg_sq_scale": ({torch.float32}, blocks)}
        if "comp" in state:
            expected["comp"] = ({torch.float16}, p.shape)
        if state.keys() != expected.keys():
            raise FileError(f"{path}: {param_name} has optimizer state {sorted(state)}, expected {sorted(expected)}")
        for key, (dtype, shape) in state.items():
            if dtype not in expected[key][0] or shape != tuple(expected[key][1]):
                raise FileError(f"{path}: {param_name}.{key} is {dtype} of shape {shape}, expected "
                                f"{sorted(map(str, expected[key][0]))} of shape {tuple(expected[key][1])}")


def checkpoint_bytes(entries):
    """Bytes the tensors [(name, tensor)] take in a safetensors file (the JSON files are a few KB)."""
    return sum(t.numel() * t.element_size() for _, t in entries)


def free_bytes(ckpt_dir):
    """Free bytes on the filesystem that holds (or will hold) ckpt_dir."""
    path = os.path.abspath(ckpt_dir)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


# ---- writing ----

def remove_unfinished(ckpt_dir):
    """Delete DIR.tmp left by a save that was killed (its space is free again before the next save is planned)."""
    shutil.rmtree(tmp_path(ckpt_dir), ignore_errors=True)


def save_checkpoint(ckpt_dir, cfg, tokenizer_spec, weights, optimizer_state=(), train_state=None, write=True):
    """Write a checkpoint atomically (see the module docstring). weights, optimizer_state: [(name, tensor)] as
    model_tensors / optimizer_tensors give them; train_state: a JSON-able dict, written with the optimizer state.
    Under FSDP every rank calls this with write=True on one rank only: all of them gather each tensor in turn.
    An error while writing removes DIR.tmp, leaves DIR as it was, and is raised after the other ranks' gathers."""
    parts = [("model.safetensors", weights)] + ([("optimizer.safetensors", optimizer_state)] if optimizer_state else [])
    gathered = (full_tensor(t) for _, entries in parts for _, t in entries)
    if not write:
        for _ in gathered:
            pass
        return
    try:
        with atomic_dir(ckpt_dir, old=ckpt_dir + ".old", durable=True) as tmp:
            for name, source in tokenizer_files(tokenizer_spec).items():
                shutil.copyfile(source, os.path.join(tmp, name))
            write_config(tmp, cfg, tokenizer_name(tokenizer_spec), None if train_state is None else train_state["step"])
            for file, entries in parts:
                layout = [(name, t.dtype, tuple(t.shape)) for name, t in entries]
                write_safetensors(os.path.join(tmp, file), layout, itertools.islice(gathered, len(entries)),
                                  {"format": "pt"})
            if optimizer_state and train_state is not None:
                write_json(os.path.join(tmp, "train_state.json"), train_state)
    except BaseException:
        for _ in gathered:  # the other ranks still gather every tensor: take part to the end, then fail
            pass
        raise


def write_config(ckpt_dir, cfg, tokenizer, step=None):
    """ckpt_dir/config.json: the format version, the model config, the tokenizer file's name, the training step."""
    write_json(os.path.join(ckpt_dir, "config.json"),
               {"format": FORMAT_VERSION, "model": cfg.to_dict(), "tokenizer": tokenizer, "step": step})


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())




def lock_out_dir(out_dir):
    """Hold out_dir/train.lock for the life of this process, so that two runs never write one out_dir. The lock
    is flock's: the kernel releases it when the process ends, however it ends (kill -9 too). Keep the returned
    file object alive. A second process gets a FileError naming the holder's PID. A run that ends having
    written nothing else (an error in its settings or data) leaves no out_dir behind: _remove_lock_alone."""
    created = not os.path.exists(out_dir)
    if not created and not os.path.isdir(out_dir):
        raise FileError(f"out_dir {out_dir} is a file: name a folder")
    os.makedirs(out_dir, exist_ok=True)
    atexit.register(_remove_lock_alone, out_dir, created)
    f = open(os.path.join(out_dir, "train.lock"), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise FileError(f"{out_dir} is in use by another training run (PID {holder}): wait for it to end, "
                        "or choose another --out_dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def _remove_lock_alone(out_dir, created):
    """At exit: when train.lock is all out_dir holds, remove it (and out_dir, if this run made it)."""
    try:
        if os.listdir(out_dir) == ["train.lock"]:
            os.remove(os.path.join(out_dir, "train.lock"))
            if created:
                os.rmdir(out_dir)
    except OSError:
        pass  # another process took it meanwhile, or it is gone: nothing of ours to clean


# ---- reading ----

def find_checkpoint(ckpt_dir):
    """The directory to load: DIR, or DIR.old when a crash hit between the two renames of a save; a training run's
    out_dir names its checkpoint too (DIR/ckpt, or DIR/ckpt.old)."""
    for d in (ckpt_dir, ckpt_dir + ".old", os.path.join(ckpt_dir, "ckpt"), os.path.join(ckpt_dir, "ckpt.old")):
        if os.path.isfile(os.path.join(d, "config.json")):
            return d
    raise FileError(f"no checkpoint in {ckpt_dir!r}: expected config.json and model.safetensors there (or in "
                    f"{os.path.join(ckpt_dir, 'ckpt')}, a training run's)")


def read_config(ckpt_dir):
    """config.json of a checkpoint: {"model": LlamaConfig, "tokenizer": ..., "step": int or None}."""
    path = os.path.join(ckpt_dir, "config.json")
    if "model_type" in read_json(path):  # transformers' config.json: an HF directory, not converted yet
        raise FileError(f"{ckpt_dir} is a Hugging Face model directory: convert it first: python convert.py "
                        f"hf2nano {ckpt_dir} NEW_DIR")
    meta = read_json(path, {"model": dict, "tokenizer": str})
    if meta.get("format", FORMAT_VERSION) != FORMAT_VERSION:  # (hf2nano wrote none before it wrote version 2)
        raise FileError(f"{path}: format {json.dumps(meta['format'])[:20]}, this nanollama reads format "
                        f"{FORMAT_VERSION}" + (": update nanollama" if type(meta["format"]) is int
                                               and meta["format"] > FORMAT_VERSION else ""))
    if meta["tokenizer"] not in TOKENIZER_NAMES:  # a file name inside the checkpoint, never a path out of it
        raise FileError(f"{path}: tokenizer is {json.dumps(meta['tokenizer'])[:60]}, expected one of "
                        f"{', '.join(TOKENIZER_NAMES)}")
    if "step" in meta:
        need(meta, "step", (int, type(None)), path)
    try:
        meta["model"] = LlamaConfig(**meta["model"])
    except (TypeError, ValueError) as e:
        raise FileError(f"{path}: bad model config ({e})") from None
    return meta


def tokenizer_spec_of(ckpt_dir):
    """The load_tokenizer() spec of a checkpoint: "bytes" or the path of its tokenizer file."""
    ckpt_dir = find_checkpoint(ckpt_dir)
    name = read_config(ckpt_dir)["tokenizer"]
    if name == "bytes":
        return name
    path = os.path.join(ckpt_dir, name)
    if not os.path.isfile(path):
        raise FileError(f"{path}: missing (config.json names it as the tokenizer)")
    return path


def checkpoint_tokenizer(ckpt_dir):
    """The tokenizer of a checkpoint (load_tokenizer), checked to fit its model: no id past vocab_size."""
    spec, vocab_size = tokenizer_spec_of(ckpt_dir), read_config(find_checkpoint(ckpt_dir))["model"].vocab_size
    enc = load_tokenizer(spec)
    if enc.n_vocab > vocab_size:
        raise FileError(f"{spec}: ids up to {enc.n_vocab - 1}, past the model's vocab_size {vocab_size}")
    return enc


def read_train_state(ckpt_dir):
    """train_state.json of a training checkpoint: {"step", "loader", "config"}; a FileError that says why
    a checkpoint cannot be resumed otherwise."""
    path = os.path.join(ckpt_dir, "train_state.json")
    if not os.path.exists(path):
        if os.path.exists(os.path.join(ckpt_dir, "train_state.pt")):
            raise FileError(
                f"{ckpt_dir}/train_state.pt is a pickled training state of an older nanollama, which is not read "
                "(unpickling runs code from the file). Its weights load: --init_from=" + ckpt_dir +
                " starts a new run from them with a fresh optimizer")
        raise FileError(f"{ckpt_dir} holds weights only (no train_state.json, no optimizer state): it cannot "
                        f"be resumed. Start a new run from it: --init_from={ckpt_dir} --out_dir=NEW_DIR")
    state = read_json(path, {"step": int, "loader": dict, "config": dict})
    if state["step"] < 0:
        raise FileError(f"{path}: step is {state['step']}")
    read_layout(os.path.join(ckpt_dir, "optimizer.safetensors"))  # whole, before any training starts
    return state


def load_model(ckpt_dir, device="cpu", dtype=None, **config_overrides):
    """Build the Llama of a checkpoint and load its weights (strictly: a missing or unexpected tensor is an
    error naming it). config_overrides change config fields that don't touch weight shapes (max_seq_len)."""
    ckpt_dir = find_checkpoint(ckpt_dir)
    cfg = read_config(ckpt_dir)["model"]
    for key, value in config_overrides.items():
        setattr(cfg, key, value)
    path = os.path.join(ckpt_dir, "model.safetensors")
    layout = read_layout(path)
    with torch.device("meta"):
        model = Llama(cfg)
    expected = {name: tuple(p.shape) for name, p in model_tensors(model)}
    check_tensors({name: shape for name, (_, shape) in layout.items()}, expected, path,
                  config=os.path.join(ckpt_dir, "config.json"))
    for name in expected:
        if not layout[name][0].is_floating_point or layout[name][0].itemsize == 1:
            raise FileError(f"{path}: {name} is {layout[name][0]}, expected a 16-, 32- or 64-bit float")
    state = dict(zip(expected, read_tensors(path, expected, device)))
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(state, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.build_rope_cache(device)  # built on the meta device above: compute it for real
    return model.to(dtype=dtype) if dtype is not None else model
