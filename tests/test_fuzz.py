"""Files from anywhere: damaged and hostile copies of every file we read go through the reading paths of the scripts;
each copy must load, or raise files.FileError naming the file. Never another exception, a hang, or an allocation far
beyond the file's size.

Real files are made once: a dataset of chats tokenized by a byte-level BPE trained here (with Qwen2.5's own chat
template), a checkpoint trained two steps on it with 8-bit moments (its train_state.json, optimizer.safetensors
and loader cursor), the Hugging Face directory nano2hf writes from it (sharded, with its index), a dataset tokenized
by a Llama-3-format tokenizer.model, and SmolLM2-135M-Instruct's own tokenizer files (where installed). Each case
copies one folder, damages one file (`damage`: truncations, bit flips, byte runs; edited JSON fields, safetensors
header entries, .npy headers, tokenizer.model lines) and reads the folder as the scripts do (`read_case`).

Seeded: a failure names its case (FUZZ_SEED, the case number) to replay. FUZZ_CASES sets how many (default 200);
`python bench/fuzz.py` runs thousands and prints the error line each kind of damage gives. The second test is not
random: every slot of the small JSON files, each deleted, renamed and set to each odd value (`sweep`);
`python bench/fuzz.py --sweep` does that to every JSON file, the big tokenizer.json files too.
"""
import base64
import functools
import io
import json
import os
import random
import resource
import shutil
import signal
import struct
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import convert  # noqa: E402
from checkpoint import checkpoint_tokenizer, load_model, load_optimizer_state, read_train_state  # noqa: E402
from data.loader import PackedLoader, dataset_tokenizer, eval_batches, read_meta  # noqa: E402
from files import FileError  # noqa: E402
from optim import make_optimizer  # noqa: E402
from tokenizer import load_tokenizer, render_chat  # noqa: E402

TEMPLATE = os.path.join(ROOT, "tests", "templates", "qwen2.5-instruct.jinja")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4, as ever."}]
TOKENS_PER_MICRO_STEP, MAX_SEQ_LEN = 256, 64


# ---- the real files, made once ----

def trained_bpe(folder):
    """tokenizer.json (test_families' SmolLM2-style byte-level BPE, 400 tokens, ChatML's special tokens) and
    tokenizer_config.json holding Qwen2.5's chat template."""
    from test_families import family_tokenizer
    os.makedirs(folder, exist_ok=True)
    path = family_tokenizer("smollm2", os.path.join(folder, "tokenizer.json"), vocab_size=400)
    with open(TEMPLATE, encoding="utf-8") as f:
        config = {"chat_template": f.read(), "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return path


def make_folders(root):
    """{kind: folder} of the pristine files (see the module docstring)."""
    from data.prepare import prepare
    from test_train import TINY, run
    folders = {}
    os.makedirs(root, exist_ok=True)
    chats = os.path.join(root, "chats.jsonl")
    with open(chats, "w") as f:
        for i in range(60):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                                             {"role": "assistant", "content": f"{2 * i}, since {i} + {i} = {2 * i}."}]})
                    + "\n")
    folders["dataset"] = os.path.join(root, "dataset")
    prepare([chats], folders["dataset"], tokenizer=trained_bpe(os.path.join(root, "bpe")), val_fraction=0.2, seed=0)
    out = os.path.join(root, "run")
    run("train.py", *TINY, f"--data_dir={folders['dataset']}", f"--out_dir={out}", "--max_steps=2",
        "--optimizer_name=adamw8bit", "--eval_interval=100", "--max_seq_len=64", "--dim=64")
    folders["checkpoint"] = os.path.join(out, "ckpt")
    folders["hf"] = os.path.join(root, "hf")
    convert.nano2hf(folders["checkpoint"], folders["hf"], shard_size="60KB")
    text = os.path.join(root, "text.txt")
    with open(text, "w") as f:
        f.write(open(os.path.join(ROOT, "checkpoint.py")).read())
    ranks = os.path.join(root, "tokenizer.model")
    with open(ranks, "w") as f:  # the 256 bytes, then a few merges, in Llama-3's tiktoken format
        tokens = [bytes([i]) for i in range(256)] + [b"th", b"the", b"in", b"  ", b"    ", b"def", b"ck"]
        f.writelines(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens))
    folders["tiktoken_dataset"] = os.path.join(root, "tiktoken_dataset")
    prepare([text], folders["tiktoken_dataset"], tokenizer=ranks, val_fraction=0.2, seed=0)
    try:
        from released import write_smollm2_tokenizer
        folders["smollm2_tokenizer"] = write_smollm2_tokenizer(os.path.join(root, "smollm2"))
    except pytest.skip.Exception:
        pass  # the real SmolLM2 is not installed: its cases are left out (make test installs it)
    return folders


# ---- how the scripts read each folder ----

def read_dataset(folder):
    """train.py's reads of a dataset: meta.json, the tokenizer, the splits (a batch of each)."""
    vocab_size = read_meta(folder)["vocab_size"]
    dataset_tokenizer(folder)
    next(iter(PackedLoader(folder, "train", TOKENS_PER_MICRO_STEP, MAX_SEQ_LEN, vocab_size=vocab_size)))
    eval_batches(folder, "val", TOKENS_PER_MICRO_STEP, MAX_SEQ_LEN, max_batches=1, vocab_size=vocab_size)


def read_checkpoint(folder, dataset):
    """sample.py's reads (the model, its tokenizer) and train.py --init_from=resume's (the optimizer state, the
    loader cursor of `dataset`)."""
    model = load_model(folder)
    render_chat(checkpoint_tokenizer(folder), CHAT)
    state = read_train_state(folder)
    load_optimizer_state(model, make_optimizer("adamw8bit", model, 1e-3, (0.9, 0.95), 0.1), folder)
    loader = PackedLoader(dataset, "train", TOKENS_PER_MICRO_STEP, MAX_SEQ_LEN, seed=1337)
    loader.load_state_dict(state["loader"], os.path.join(folder, "train_state.json"))


def read_hf(folder, out):
    """convert.py hf2nano's reads (config.json, the index, every shard, the tokenizer files); its output is
    deleted after."""
    try:
        convert.hf2nano(folder, out)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def read_tokenizer(folder):
    """load_tokenizer on a tokenizer folder, and a chat rendered with its template."""
    render_chat(load_tokenizer(os.path.join(folder, "tokenizer.json")), CHAT)


# ---- damage ----

ODD_VALUES = [None, True, False, 0, -1, 1, 3, 2**31, 2**63, -2**40, 1e308, -0.5, float("nan"), "", "x", "../../x",
              "F32", "I8", "tokenizer.json", [], [0], [-1, 3], [3, 1], [0, 2**62], [1.5, 2], {}, {"a": 1}, [[[]]]]


def json_slots(obj, path=(), sample=False):
    """Every (container, key, path from the root) of a JSON tree, depth first; sample: of a container of more than
    12, only the first and last 2."""
    items = list(obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ())
    for key, value in items[:2] + items[-2:] if sample and len(items) > 12 else items:
        yield obj, key, path + (key,)
        yield from json_slots(value, path + (key,), sample)


def edit_json(obj, rng):
    """One structured edit of a JSON tree, in place: a value replaced (by an odd value, or one of another slot),
    a key or item deleted, a key renamed."""
    slots = list(json_slots(obj))
    if not slots:
        return rng.choice(ODD_VALUES)
    container, key, _ = rng.choice(slots)
    how = rng.random()
    if how < 0.6:
        container[key] = rng.choice(ODD_VALUES)
    elif how < 0.75:
        container[key] = rng.choice(slots)[0]  # a container from elsewhere: types swapped across the tree
    elif how < 0.9 or not isinstance(container, dict):
        del container[key]
    else:
        container[key + "_"] = container.pop(key)
    return obj


def damage_bytes(data, rng):
    how = rng.randrange(5)
    if how == 0 or not data:
        return data[:rng.randrange(len(data) + 1)]  # truncated (possibly empty)
    data = bytearray(data)
    if how == 1:
        for _ in range(rng.randint(1, 4)):  # bit flips
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
    elif how == 2:
        i = rng.randrange(len(data))  # a run of random bytes
        data[i:i + 16] = bytes(rng.randrange(256) for _ in range(min(16, len(data) - i)))
    elif how == 3:
        data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))  # garbage appended
    else:
        i = rng.randrange(len(data))
        data[i:i] = data[i:i + rng.randint(1, 64)]  # bytes repeated in place
    return bytes(data)


def damage_json(data, rng):
    return json.dumps(edit_json(json.loads(data), rng)).encode()


def damage_safetensors(data, rng):
    """An edited header entry (the header re-packed so that its length is right), or a wrong header length."""
    n = struct.unpack("<Q", data[:8])[0]
    if rng.random() < 0.15:
        return struct.pack("<Q", rng.choice([0, 1, n - 1, n + 8, 2**40, 2**64 - 1])) + data[8:]
    header = edit_json(json.loads(data[8:8 + n]), rng)
    packed = json.dumps(header).encode()
    return struct.pack("<Q", len(packed)) + packed + data[8 + n:]


def damage_npy(data, rng):
    """An .npy file with another shape, dtype or order in its header, over the same data."""
    f = io.BytesIO(data)
    version = np.lib.format.read_magic(f)
    shape, fortran_order, dtype = (np.lib.format.read_array_header_1_0 if version == (1, 0) else
                                   np.lib.format.read_array_header_2_0)(f)
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": fortran_order, "shape": shape}
    header[rng.choice(list(header))] = rng.choice(
        [(), (3, 2), (2**40,), (shape[0] + 1,), "<i4", ">i8", "|O", "<f8", True, (0,)])
    text = repr(header).encode()  # written by hand: numpy's writer refuses the odd values
    text += b" " * (-(len(text) + 11) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text + data[f.tell():]


def damage_lines(data, rng):
    """tokenizer.model: a line deleted, repeated, swapped with another, or with a field edited."""
    lines = data.decode().splitlines(keepends=True)
    i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
    how = rng.randrange(4)
    if how == 0:
        del lines[i]
    elif how == 1:
        lines.insert(i, lines[j])
    elif how == 2:
        lines[i], lines[j] = lines[j], lines[i]
    else:
        token, rank = lines[i].split()
        lines[i] = rng.choice([f"{token} {rank} 7\n", f"{token}\n", f"{token} -{rank}\n", f"!!!! {rank}\n",
                               f"{token} 99999999999999999999\n", f"{token} {rank}.5\n", f"{token} {j}\n"])
    return "".join(lines).encode()


def damage(path, rng):
    """Damage the file at path in place (or delete it); returns what was done."""
    with open(path, "rb") as f:
        data = f.read()
    name = os.path.basename(path)
    structured = {".json": damage_json, ".safetensors": damage_safetensors, ".npy": damage_npy,
                  ".model": damage_lines}.get(os.path.splitext(name)[1])
    how = rng.random()
    if how < 0.05:
        os.remove(path)
        return "deleted"
    try:
        damaged, what = (structured(data, rng), "edited") if structured and how < 0.6 else \
            (damage_bytes(data, rng), "bytes")
    except (ValueError, IndexError, struct.error):  # the file did not parse as its kind: damage its bytes
        damaged, what = damage_bytes(data, rng), "bytes"
    with open(path, "wb") as f:
        f.write(damaged)
    return what


# ---- the property ----

class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang()


def run_case(folders, scratch, seed, case):
    """Damage one file of one folder (chosen by seed and case), read the folder; returns (kind, file, what,
    outcome) where outcome is "loaded" or the FileError's message. Anything else raises AssertionError."""
    rng = random.Random(f"{seed}-{case}")
    kind = rng.choice(sorted(folders))
    folder = fresh_copy(folders, scratch, kind)
    name = rng.choice(sorted(os.listdir(folder)))
    what = damage(os.path.join(folder, name), rng)
    return kind, name, what, read_case(folders, scratch, kind, name, f"case {seed}-{case}: {kind}/{name} {what}")


def fresh_copy(folders, scratch, kind):
    folder = os.path.join(scratch, kind)
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(folders[kind], folder)
    return folder


def read_case(folders, scratch, kind, name, label):
    """Read scratch/kind as the scripts do: "loaded", or the message of a FileError that names `name`; anything
    else (another exception, a FileError naming another file, no answer in 60 s) raises AssertionError(label...)."""
    readers = {"dataset": read_dataset, "tiktoken_dataset": read_dataset, "smollm2_tokenizer": read_tokenizer,
               "checkpoint": lambda f: read_checkpoint(f, folders["dataset"]),
               "hf": lambda f: read_hf(f, os.path.join(scratch, "converted"))}
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(60)
    try:
        readers[kind](os.path.join(scratch, kind))
        return "loaded"
    except FileError as e:
        assert name in str(e), f"{label}: the error does not name it: {e}"
        return str(e)
    except Hang:
        raise AssertionError(f"{label}: no answer in 60 s") from None
    except Exception as e:  # noqa: BLE001  the property under test: nothing but FileError escapes
        raise AssertionError(f"{label}: {type(e).__name__}: {e}") from e
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def sweep(folders, scratch, files):
    """Each "kind/name.json" of files edited in every slot (json_slots, sampled) every way: deleted, renamed (a
    dict's key), set to each of ODD_VALUES; each copy read as run_case reads. Yields (file, outcome)."""
    for file in files:
        kind, name = file.split("/")
        path = os.path.join(fresh_copy(folders, scratch, kind), name)
        with open(path) as f:
            pristine = f.read()
        for container, key, slot in json_slots(json.loads(pristine), sample=True):
            for edit in ["delete"] + ["rename"] * isinstance(container, dict) + [("set", v) for v in ODD_VALUES]:
                tree = json.loads(pristine)
                target = functools.reduce(lambda c, k: c[k], slot[:-1], tree)
                if edit == "delete":
                    del target[key]
                elif edit == "rename":
                    target[key + "_"] = target.pop(key)
                else:
                    target[key] = edit[1]
                with open(path, "w") as f:
                    json.dump(tree, f)
                yield file, read_case(folders, scratch, kind, name, f"{file} {'/'.join(map(str, slot))} {edit}")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return make_folders(str(tmp_path_factory.mktemp("pristine")))


def test_damaged_files_load_or_name_themselves(folders, tmp_path):
    seed, n = int(os.environ.get("FUZZ_SEED", random.randrange(10**6))), int(os.environ.get("FUZZ_CASES", 200))
    print(f"FUZZ_SEED={seed}")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    outcomes = [run_case(folders, str(tmp_path), seed, case) for case in range(n)]
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert grown_mb < 500, f"peak memory grew by {grown_mb:.0f} MB over files of at most a few MB"
    errors = sum(outcome != "loaded" for *_, outcome in outcomes)
    assert errors > n // 3, f"only {errors} of {n} damaged copies were refused: is the damage reaching the readers?"


SWEPT = ["checkpoint/config.json", "checkpoint/train_state.json", "checkpoint/tokenizer_config.json",
         "dataset/meta.json", "dataset/tokenizer.json", "dataset/tokenizer_config.json", "hf/config.json",
         "hf/model.safetensors.index.json", "hf/tokenizer_config.json", "tiktoken_dataset/meta.json"]


def test_every_edit_of_every_json_slot_loads_or_names_its_file(folders, tmp_path):
    """The JSON files' structure, exhaustively (sweep; the big lists and dicts sampled): 4,210 cases."""
    outcomes = list(sweep(folders, str(tmp_path), SWEPT))
    refused = {file for file, outcome in outcomes if outcome != "loaded"}
    assert len(outcomes) > 4000 and refused == set(SWEPT), refused
