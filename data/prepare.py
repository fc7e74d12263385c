"""Tokenize a corpus once into flat token files that data/loader.py memory-maps.

    python data/prepare.py --out DIR [--tokenizer bytes|PATH] [--val_fraction 0.01] [--seed 1337] [--overwrite] INPUT...
    python data/prepare.py --stdlib --out DIR [--tokenizer ...]  # every *.py file of this Python's standard library

Inputs are files and folders (walked recursively in sorted order, hidden entries skipped, each file read once):
  - a text file is one pretraining document: bos + tokens + eos (tokenizer.ROLES), every token a target. Binary
    files (a NUL byte, or not valid UTF-8) are skipped and counted.
  - a .jsonl file holds one JSON object per line, each one document (.json: one JSON array of them; any letter case):
        {"text": "..."}                                   a pretraining document, as above
        {"prompt": "...", "response": "..."}             SFT: a user turn and an assistant turn
        {"messages": [{"role": ..., "content": ...}]}    SFT: any system/user/assistant conversation
    SFT documents go through the tokenizer's chat template (tokenizer.render_chat); only assistant tokens are targets.
Documents with no text are skipped and counted. A split with no target token at all (only user turns) is an error.

Output, in DIR, for split in (train, val):
    {split}.bin        uint32, the tokens of all documents of the split end to end
    {split}.idx.npy    int64 (n_docs + 1,), document d is tokens[idx[d]:idx[d + 1]]
    {split}.mask.bin   uint8, 1 where the token is a target (predicted by the loss); only when some token is not
    meta.json          tokenizer, vocab_size, bos_id, eos_id, per-split doc and token counts, sources
with a copy of the tokenizer file (tokenizer.model or .json) and its chat template files: DIR is self-contained.
Val: a seeded shuffle of the documents (at least one of two or more); a corpus of ONE document (one text file)
gives its last val_fraction of tokens, at least MIN_VAL_TAIL, at most a tenth (one conversation is refused: it is
not cut). DIR is written whole or not at all (files.atomic_dir); --overwrite replaces a dataset already there.
"""
import argparse
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root, for `python data/...`
from files import atomic_dir  # noqa: E402
from tokenizer import (bos_id, encode_text, eos_id, load_tokenizer, render_chat, tokenizer_files,  # noqa: E402
                       tokenizer_name)

# ----------------------------------------------------------------------------------------------------------------
# Reading inputs: files -> documents (token ids + loss mask)


def list_files(inputs, out_dir=None):
    """Each input file, and every file under each input folder, in sorted order, each file once (an input named
    twice, or inside another, would put a document in train and val alike); hidden names and the dataset's own
    folder out_dir skipped."""
    seen = set()
    for path in inputs:
        if os.path.isfile(path):
            files = [path]
        elif os.path.isdir(path):
            files = []
            for folder, subfolders, names in os.walk(path):
                subfolders[:] = sorted(d for d in subfolders if not d.startswith(".")
                                       and not (out_dir and os.path.realpath(os.path.join(folder, d)) == out_dir))
                files += [os.path.join(folder, name) for name in sorted(names) if not name.startswith(".")]
        else:
            raise FileNotFoundError(f"input {path!r}: no such file or folder")
        for file in files:
            if (real := os.path.realpath(file)) not in seen:
                seen.add(real)
                yield file


def text_document(enc, text):
    """A pretraining document: every token, including <|end_of_text|>, is a target."""
    ids = [bos_id(enc)] + encode_text(enc, text) + [eos_id(enc)]
    return ids, None  # mask None = all ones


def chat_document(enc, messages):
    """A conversation through the tokenizer's own chat template (tokenizer.render_chat): assistant turns are the
    targets."""
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"each message must be an object with string 'role' and 'content', got {m!r:.80}")
    return render_chat(enc, messages)


def record_document(enc, record):
    """One .jsonl record -> (ids, mask), or None when it holds no text."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if "text" in record and record.keys() & {"prompt", "response", "messages"}:
        raise ValueError("a record is a 'text' or a chat ('prompt' + 'response', or 'messages'), not both")
    if "text" in record:
        if not isinstance(record["text"], str):
            raise ValueError("'text' must be a string")
        return text_document(enc, record["text"]) if record["text"].strip() else None
    if "prompt" in record or "response" in record:
        prompt, response = record.get("prompt"), record.get("response")
        if not (isinstance(prompt, str) and isinstance(response, str)):
            raise ValueError("'prompt' and 'response' must both be present, as strings")
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    elif "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list):
            raise ValueError("'messages' must be a list")
    else:
        raise ValueError("expected a 'text', 'prompt' + 'response', or 'messages' key")
    document = chat_document(enc, messages)
    return document if any(m["content"].strip() for m in messages) else None


def parse_json(raw, where):
    try:
        return json.loads(raw)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{where}: {e}") from e
    except RecursionError:
        raise ValueError(f"{where}: JSON nested too deeply to read") from None


def read_records(path):
    """Yield (where, record) for each record of a .jsonl file (one JSON value per non-blank line) or of a .json
    file (one JSON array); `where` names the file and line or record for error messages."""
    with open(path, "rb") as f:
        if path.lower().endswith(".jsonl"):
            for line_number, line in enumerate(f, 1):
                if line.strip():
                    yield f"{path}:{line_number}", parse_json(line, f"{path}:{line_number}")
            return
        records = parse_json(f.read(), path)
    if not isinstance(records, list):
        raise ValueError(f"{path}: a .json file must hold one JSON array of records, this one holds "
                         f"{'an object' if isinstance(records, dict) else type(records).__name__} (one record per "
                         "line: name it .jsonl; plain text: .txt)")
    for i, record in enumerate(records, 1):
        yield f"{path}: record {i}", record


def read_documents(enc, paths, stats):
    """Yield (ids, mask) for every document of every file; count files, skips and tokens in `stats`."""
    for path in paths:
        stats["files"] += 1
        if path.lower().endswith((".jsonl", ".json")):
            for where, record in read_records(path):
                try:
                    document = record_document(enc, record)
                except ValueError as e:
                    raise ValueError(f"{where}: {e}") from e
                if document is None:
                    stats["empty"] += 1
                else:
                    yield document
            continue
        with open(path, "rb") as f:
            raw = f.read()
        try:
            if b"\0" in raw:
                raise UnicodeDecodeError("utf-8", raw, 0, 1, "NUL byte")
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            stats["binary"] += 1
            continue
        if text.strip():
            yield text_document(enc, text)
        else:
            stats["empty"] += 1


# ----------------------------------------------------------------------------------------------------------------
# Writing the dataset


def write_split(folder, split, all_tokens, all_mask, offsets, doc_ids):
    """Copy documents `doc_ids` (in order) from the all.* staging files into {split}.bin / .idx.npy / .mask.bin.
    Returns the split's meta entry and its number of targets (tokens the loss predicts: mask 1, not a document's
    first token)."""
    lengths = offsets[doc_ids + 1] - offsets[doc_ids]
    idx = np.zeros(len(doc_ids) + 1, dtype=np.int64)
    np.cumsum(lengths, out=idx[1:])
    np.save(os.path.join(folder, f"{split}.idx.npy"), idx)
    any_masked, targets = False, 0
    mask_path = os.path.join(folder, f"{split}.mask.bin")
    with open(os.path.join(folder, f"{split}.bin"), "wb") as ftok, open(mask_path, "wb") as fmask:
        for d in doc_ids:
            start, end = offsets[d], offsets[d + 1]
            ftok.write(all_tokens[start:end].tobytes())
            fmask.write(all_mask[start:end].tobytes())
            any_masked = any_masked or not all_mask[start:end].all()
            targets += int(np.count_nonzero(all_mask[start + 1:end]))
    if not any_masked:
        os.remove(mask_path)  # no mask file = every token is a target
    return {"docs": len(doc_ids), "tokens": int(idx[-1])}, targets


MIN_VAL_TAIL = 1000


def val_tail(n_tokens, val_fraction):
    """How many tokens at the end of a corpus's only document become the val document: val_fraction of them, at
    least MIN_VAL_TAIL but at most a tenth of the document; 0 (no val) under 2 tokens, which hold no target."""
    tail = min(max(round(n_tokens * val_fraction), MIN_VAL_TAIL), n_tokens // 10)
    return tail if tail >= 2 else 0


def choose_val(n_docs, val_fraction, seed):
    """Boolean (n_docs,): which documents go to val. A seeded shuffle; at least 1 val and 1 train doc if n >= 2."""
    is_val = np.zeros(n_docs, dtype=bool)
    if n_docs >= 2:
        n_val = min(n_docs - 1, max(1, round(n_docs * val_fraction)))
        is_val[np.random.default_rng(seed).permutation(n_docs)[:n_val]] = True
    return is_val


def write_dataset(paths, out_dir, tokenizer, val_fraction, seed, sources, overwrite=False):
    """Tokenize the documents of `paths` into out_dir; returns the meta dict (also saved as meta.json). An earlier
    dataset in out_dir is replaced only with overwrite=True."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction {val_fraction}: expected 0 <= val_fraction < 1")
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise FileExistsError(f"--out {out_dir} is a file: name a folder")
    if os.path.exists(os.path.join(out_dir, "meta.json")) and not overwrite:
        raise FileExistsError(f"{out_dir} holds a dataset already: pass --overwrite to replace it, or choose another "
                              "--out")
    if os.path.exists(out_dir) and os.listdir(out_dir) and not os.path.exists(os.path.join(out_dir, "meta.json")):
        raise FileExistsError(f"{out_dir} exists and is not a dataset written by prepare.py: refusing to replace it")
    enc = load_tokenizer(tokenizer)
    try:
        os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        raise FileExistsError(f"--out {out_dir}: its folder cannot be made ({e.filename} is a file)") from None
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=os.path.dirname(out_dir))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private (0o700); the dataset is an ordinary folder
    with atomic_dir(out_dir, tmp):  # renamed to out_dir when whole (an earlier dataset there is replaced)
        # 1. Stream every document into staging files all.bin / all.mask.bin, remembering each document's length.
        stats = {"files": 0, "binary": 0, "empty": 0, "chats": 0}
        lengths, n_tokens, last_report, t0 = [], 0, time.time(), time.time()
        with open(os.path.join(tmp, "all.bin"), "wb") as ftok, open(os.path.join(tmp, "all.mask.bin"), "wb") as fmask:
            for ids, mask in read_documents(enc, paths, stats):
                ftok.write(np.array(ids, dtype=np.uint32).tobytes())
                fmask.write(np.ones(len(ids), np.uint8).tobytes() if mask is None else bytes(mask))
                lengths.append(len(ids))
                n_tokens += len(ids)
                stats["chats"] += mask is not None
                if time.time() - last_report > 2:
                    print(f"  {stats['files']} files, {len(lengths)} docs, {n_tokens / 1e6:.1f}M tokens", flush=True)
                    last_report = time.time()
        if not lengths:
            raise ValueError(f"no documents in {sources} ({stats['binary']} binary, {stats['empty']} empty skipped)")

        # 2. Split by document (one text document: cut off its tail) and write the final files.
        if len(lengths) == 1 and stats["chats"]:
            raise ValueError(f"one conversation in {sources}: val needs a second one (a conversation is not cut in "
                             "two, as one text document is)")
        tail = val_tail(lengths[0], val_fraction) if len(lengths) == 1 else 0
        if tail:
            lengths = [lengths[0] - tail, tail]
            is_val = np.array([False, True])
        else:
            is_val = choose_val(len(lengths), val_fraction, seed)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        all_tokens = np.memmap(os.path.join(tmp, "all.bin"), dtype=np.uint32, mode="r")
        all_mask = np.memmap(os.path.join(tmp, "all.mask.bin"), dtype=np.uint8, mode="r")
        splits = {}
        for split, docs in (("train", ~is_val), ("val", is_val)):
            splits[split], targets = write_split(tmp, split, all_tokens, all_mask, offsets, np.flatnonzero(docs))
            if splits[split]["docs"] and not targets:  # user-only chats: the loss would count nothing
                raise ValueError(f"the {split} split has no target token: none of its {splits[split]['docs']} "
                                 "documents has an assistant turn with text" + (
                                     " (another --seed or a larger --val_fraction picks other val documents)"
                                     if split == "val" else ""))
        del all_tokens, all_mask  # close the memmaps before deleting their files
        os.remove(os.path.join(tmp, "all.bin"))
        os.remove(os.path.join(tmp, "all.mask.bin"))

        for name, source in tokenizer_files(tokenizer).items():  # the tokenizer and its chat template travel along
            shutil.copyfile(source, os.path.join(tmp, name))
        meta = {
            "tokenizer": tokenizer_name(tokenizer),
            "vocab_size": enc.n_vocab,
            "bos_id": bos_id(enc),
            "eos_id": eos_id(enc),
            "splits": splits,
            "sources": sources,
        }
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2)
    print(f"wrote {out_dir}: train {splits['train']['docs']} docs {splits['train']['tokens']:,} tokens, "
          f"val {splits['val']['docs']} docs {splits['val']['tokens']:,} tokens"
          f"{' (the tail of the only document)' if tail else ''}, vocab {enc.n_vocab} | "
          f"{stats['files']} files read, skipped {stats['binary']} binary and {stats['empty']} empty | "
          f"{time.time() - t0:.1f}s", flush=True)
    return meta


def prepare(inputs, out_dir, tokenizer="bytes", val_fraction=0.01, seed=1337, overwrite=False):
    """Tokenize text files, folders and .jsonl files into out_dir (see the module docstring)."""
    inputs = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    inputs = [os.fspath(p) for p in inputs]
    for path in inputs:  # fail before any work, not halfway through
        if not os.path.exists(path):
            raise FileNotFoundError(f"input {path!r}: no such file or folder")
    return write_dataset(list_files(inputs, os.path.realpath(out_dir)), out_dir, os.fspath(tokenizer), val_fraction,
                         seed, sources=inputs, overwrite=overwrite)


def stdlib_files():
    """Every *.py file of this Python's standard library (not the installed packages), in sorted path order."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in ("site-packages", "dist-packages")]
        paths += [os.path.join(folder, name) for name in files if name.endswith(".py")]
    return root, sorted(paths)


def prepare_stdlib(out_dir, val_fraction=0.01, seed=1337, tokenizer="bytes", overwrite=False):
    """The built-in corpus: the standard library's Python source (stdlib_files), nothing to download."""
    root, paths = stdlib_files()
    return write_dataset(paths, out_dir, os.fspath(tokenizer), val_fraction, seed,
                         sources=[f"python stdlib *.py under {root}"], overwrite=overwrite)


def tokenizer_arg(spec):
    """--tokenizer as load_tokenizer reads it. A folder without a tokenizer file of its own but with a nanollama
    checkpoint (or a run's ckpt/) in it: the tokenizer its config.json names ("bytes" has no file)."""
    if os.path.isdir(spec) and not any(os.path.isfile(os.path.join(spec, name))
                                       for name in ("tokenizer.model", "tokenizer.json")):
        from checkpoint import find_checkpoint, tokenizer_spec_of  # (imports torch: only here)
        try:
            find_checkpoint(spec)
        except ValueError:
            return spec  # load_tokenizer says what is missing
        return tokenizer_spec_of(spec)
    return spec


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="*", help="text files, folders, .jsonl files")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--stdlib", action="store_true", help="use the Python standard library as the corpus")
    parser.add_argument("--tokenizer", default="bytes",
                        help="'bytes', a tokenizer.model or tokenizer.json, or a folder holding one (a checkpoint)")
    parser.add_argument("--val_fraction", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--overwrite", action="store_true", help="replace a dataset already in --out")
    args = parser.parse_args()
    if args.stdlib == bool(args.inputs):
        parser.error("give either --stdlib or input files/folders (not both)")
    if args.seed < 0:
        parser.error(f"--seed {args.seed}: expected 0 or more")
    try:
        tokenizer = tokenizer_arg(args.tokenizer)
        if args.stdlib:
            prepare_stdlib(args.out, args.val_fraction, args.seed, tokenizer, args.overwrite)
        else:
            prepare(args.inputs, args.out, tokenizer, args.val_fraction, args.seed, args.overwrite)
    except (ValueError, OSError) as e:  # bad input: say what and where, without a traceback
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
