"""Training batches cut from the memory-mapped token files that data/prepare.py writes.

A batch (one micro-step's tokens) has no batch dimension: it is ONE row of T tokens holding several sequences end
to end, and attention, positions and labels never look across a sequence boundary (-100: no target, ignored by the
loss; also where the next token's loss mask is 0, the prompt side of SFT data: see prepare.py):
    tokens      a b c d e | f g h | i j k l             (T,)  int64
    cu_seqlens  0         5       8         12          (n_seqs + 1,) int32: sequence s is tokens[cu[s]:cu[s+1]]
    positions   0 1 2 3 4   0 1 2   0 1 2 3             (T,)  int32: restart at 0 in each sequence
    labels      b c d e -   g h -   j k l -             (T,)  int64: the next token of the same sequence, or -100
    seqlens     5           3       4                   (n_seqs,) host numpy: the lengths; max_seqlen = 5
A "sequence" is a document or a piece of one: a document longer than max_seq_len is cut into pieces of max_seq_len
tokens from its start, each a sequence of its own (positions from 0). A piece's last token gets label -100 even
where the document goes on: one target lost per cut keeps "no label crosses a boundary" free of exceptions.

Three ways to fill a batch of tokens_per_micro_step tokens (`mode`):
  padding_free  whole sequences, as many as fit; T varies (<= tokens_per_micro_step); never spans two epochs.
  packed        exactly tokens_per_micro_step tokens, a fixed shape (CUDA graphs, torch.compile): the last sequence
                is cut, and its rest opens the next batch as a new sequence (from position 0), across epochs too.
  padded        rows of max_seq_len tokens (tokens_per_micro_step // max_seq_len of them), one sequence per row,
                padded with token 0 and label -100: the flattened (B, T) batch, to measure what packing saves.
Epoch e visits every document once, in a permutation seeded with seed + e (padding_free and packed: every token
exactly once). The loader is a cursor (epoch, doc, offset) into that stream: all state_dict() needs to resume. With
world_size W, rank r serves the batches r, r + W, ... of that one stream, walking all of it (the others' batches cost
only host arithmetic): every rank holds a single loader's cursor, so a checkpoint resumes under any W.
"""
import json
import os
from dataclasses import dataclass, replace

import numpy as np
import torch

from files import FileError, need, read_json
from kernels.common import IGNORE_INDEX
from tokenizer import TOKENIZER_NAMES, load_tokenizer

MODES = ("padding_free", "packed", "padded")


@dataclass
class Batch:
    tokens: torch.Tensor  # (T,) int64
    labels: torch.Tensor  # (T,) int64, next token of the same sequence, or IGNORE_INDEX
    cu_seqlens: torch.Tensor  # (n_seqs + 1,) int32
    positions: torch.Tensor  # (T,) int32, restart at 0 in each sequence
    seqlens: np.ndarray  # (n_seqs,) int64 on the host: FLOP counts and max_seqlen without a device sync
    n_loss_tokens: int  # (labels != IGNORE_INDEX).sum(), as a host int: no device sync to normalise the loss

    @property
    def max_seqlen(self):
        """The longest sequence, a host int (the attention kernels size their grids with it)."""
        return int(self.seqlens.max())

    def to(self, device):
        """A copy on `device` (asynchronous when the source is pinned); the host ints stay host ints."""
        tensors = ("tokens", "labels", "cu_seqlens", "positions")
        return replace(self, **{name: getattr(self, name).to(device, non_blocking=True) for name in tensors})


def read_meta(data_dir):
    """meta.json of a prepared dataset (data/prepare.py), its fields checked: a FileError naming file and key."""
    path = os.path.join(data_dir, "meta.json")
    if not os.path.exists(path):
        raise FileError(f"{path} not found: run python data/prepare.py --out {data_dir} ... first")
    meta = read_json(path, {"tokenizer": str, "vocab_size": int, "splits": dict})
    if meta["tokenizer"] not in TOKENIZER_NAMES:  # a file name inside data_dir, never a path out of it
        raise FileError(f"{path}: tokenizer is {json.dumps(meta['tokenizer'])[:60]}, expected one of "
                        f"{', '.join(TOKENIZER_NAMES)}")
    if meta["vocab_size"] <= 0:
        raise FileError(f"{path}: vocab_size is {meta['vocab_size']}")
    return meta


def dataset_tokenizer(data_dir):
    """The tokenizer the dataset in data_dir was prepared with (its vocabulary checked against meta.json's)."""
    meta, meta_path = read_meta(data_dir), os.path.join(data_dir, "meta.json")
    spec = meta["tokenizer"] if meta["tokenizer"] == "bytes" else os.path.join(data_dir, meta["tokenizer"])
    if spec != "bytes" and not os.path.exists(spec):
        raise FileError(f"{meta_path}: its tokenizer {meta['tokenizer']!r} is not in {data_dir}")
    enc = load_tokenizer(spec)
    if enc.n_vocab != meta["vocab_size"]:
        raise FileError(f"{meta_path}: vocab_size is {meta['vocab_size']}, its tokenizer {meta['tokenizer']} has "
                        f"{enc.n_vocab}")
    return enc


def read_offsets(path):
    """The int64 document offsets of a .idx.npy file, its header checked against the file's size before anything
    is read (np.load would believe the header's shape)."""
    try:
        with open(path, "rb") as f:
            read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                           (2, 0): np.lib.format.read_array_header_2_0}.get(np.lib.format.read_magic(f))
            if read_header is None:
                raise ValueError("an unknown .npy version")
            shape, fortran, dtype = read_header(f, max_header_size=10_000)
            data_start = f.tell()
    except FileNotFoundError:
        raise FileError(f"{path} not found: run python data/prepare.py --out {os.path.dirname(path)} ... first") \
            from None
    except Exception as e:  # noqa: BLE001  numpy parses the header with ast and tokenize: any error means damaged
        raise FileError(f"{path}: damaged, not a .npy file ({str(e)[:100]})") from None
    if dtype != np.int64 or len(shape) != 1 or fortran:
        raise FileError(f"{path}: holds {dtype} of shape {shape}, expected one row of int64 offsets")
    if data_start + shape[0] * 8 != os.path.getsize(path):
        raise FileError(f"{path}: damaged: its header says {shape[0]} offsets, the file holds "
                        f"{(os.path.getsize(path) - data_start) / 8:g}")
    return np.fromfile(path, dtype=np.int64, offset=data_start)


def read_split(data_dir, split, vocab_size=None):
    """(tokens, mask or None, offsets) of a split; tokens and mask are memory-mapped. Checks that the files agree."""
    bin_path, idx_path, mask_path = (os.path.join(data_dir, split + ext) for ext in (".bin", ".idx.npy", ".mask.bin"))
    if not os.path.exists(bin_path):
        raise FileError(f"{bin_path} not found: run python data/prepare.py --out {data_dir} ... first")
    offsets = read_offsets(idx_path)
    n_tokens, rest = divmod(os.path.getsize(bin_path), 4)
    if len(offsets) < 2 or n_tokens == 0:
        raise FileError(f"{bin_path}: the {split} split has no documents")
    if rest or offsets[0] != 0 or offsets[-1] != n_tokens or np.any(np.diff(offsets) <= 0):
        raise FileError(f"{idx_path}: expected increasing document offsets from 0 to {n_tokens}, "
                        f"the number of uint32 tokens in {bin_path}")
    tokens = np.memmap(bin_path, dtype=np.uint32, mode="r")
    if vocab_size is not None and tokens.max() >= vocab_size:  # one vectorised pass over the file
        position = int(np.argmax(tokens >= vocab_size))
        raise FileError(f"{bin_path}: token id {tokens[position]} at position {position} is >= vocab_size "
                        f"{vocab_size} (prepared with another tokenizer?)")
    mask = None
    if os.path.exists(mask_path):
        mask = np.memmap(mask_path, dtype=np.uint8, mode="r")
        if len(mask) != n_tokens:
            raise FileError(f"{mask_path}: {len(mask)} entries for {n_tokens} tokens")
    return tokens, mask, offsets


def make_batch(tokens, mask, pieces, row_len=None):
    """The Batch of sequences `pieces` = [(start, end), ...] of the token file, end to end (or one per row of
    row_len tokens, padded, when row_len is given: cu_seqlens and seqlens then delimit the rows, pads included).
    Work is numpy over the slices, never a loop over tokens."""
    lengths = np.array([end - start for start, end in pieces], dtype=np.int64)
    cu = np.zeros(len(pieces) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    ids = np.concatenate([tokens[start:end] for start, end in pieces]).astype(np.int64)
    labels = np.full_like(ids, IGNORE_INDEX)
    labels[:-1] = ids[1:]  # the target of token t is token t + 1 ...
    labels[cu[1:] - 1] = IGNORE_INDEX  # ... except for the last token of a sequence: its next token is in another one
    if mask is not None:  # ... and except where the next token is not a target
        is_target = np.concatenate([mask[start:end] for start, end in pieces])
        labels[:-1][is_target[1:] == 0] = IGNORE_INDEX
    positions = np.arange(len(ids)) - np.repeat(cu[:-1], lengths)
    if row_len is not None:  # padded: sequence i goes to the start of row i, the rest of the row is padding
        where = np.repeat(np.arange(len(pieces)) * row_len, lengths) + positions
        size = len(pieces) * row_len
        ids, labels = _scatter(ids, where, size, fill=0), _scatter(labels, where, size, fill=IGNORE_INDEX)
        positions = np.tile(np.arange(row_len), len(pieces))
        lengths = np.full(len(pieces), row_len, dtype=np.int64)
        cu = np.arange(len(pieces) + 1) * row_len
    return Batch(
        tokens=torch.from_numpy(ids),
        labels=torch.from_numpy(labels),
        cu_seqlens=torch.from_numpy(cu.astype(np.int32)),
        positions=torch.from_numpy(positions.astype(np.int32)),
        seqlens=lengths,
        n_loss_tokens=int(np.count_nonzero(labels != IGNORE_INDEX)),
    )


def _scatter(values, where, size, fill):
    out = np.full(size, fill, dtype=values.dtype)
    out[where] = values
    return out


class PackedLoader:
    """Yields a Batch per micro-step, forever, epoch after epoch (see the module docstring for the modes); with
    world_size > 1, only this rank's share: the batches rank, rank + world_size, ... of the single stream."""

    def __init__(self, data_dir, split, tokens_per_micro_step, max_seq_len, mode="padding_free", seed=1337,
                 vocab_size=None, shuffle=True, rank=0, world_size=1):
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} must be in [0, world_size={world_size})")
        if not 1 <= max_seq_len <= tokens_per_micro_step:
            raise ValueError(f"max_seq_len {max_seq_len} must be between 1 and tokens_per_micro_step "
                             f"{tokens_per_micro_step}: a sequence has to fit in one batch")
        self.tokens, self.mask, self.offsets = read_split(data_dir, split, vocab_size)
        self.n_docs = len(self.offsets) - 1
        self.tokens_per_micro_step, self.max_seq_len, self.mode = tokens_per_micro_step, max_seq_len, mode
        self.seed, self.shuffle, self.rank, self.world_size = seed, shuffle, rank, world_size
        # The cursor: the next token to serve is token `offset` of document order(epoch)[doc].
        self.epoch, self.doc, self.offset = 0, 0, 0
        self._order_of_epoch = (None, None)

    def order(self, epoch):
        """The documents of an epoch, in visiting order (cached: a permutation of n_docs per epoch)."""
        if self._order_of_epoch[0] != epoch:
            if self.shuffle:
                order = np.random.default_rng(self.seed + epoch).permutation(self.n_docs)
            else:
                order = np.arange(self.n_docs)
            self._order_of_epoch = (epoch, order)
        return self._order_of_epoch[1]

    def _next_piece_length(self):
        """Tokens left in the current max_seq_len piece of the current document (pieces count from its start)."""
        d = self.order(self.epoch)[self.doc]
        doc_length = int(self.offsets[d + 1] - self.offsets[d])
        piece_end = (self.offset // self.max_seq_len + 1) * self.max_seq_len
        return min(doc_length, piece_end) - self.offset

    def _take(self, n):
        """Serve the next n tokens (n <= _next_piece_length()) as one sequence (start, end); advance the cursor."""
        d = self.order(self.epoch)[self.doc]
        start = int(self.offsets[d]) + self.offset
        self.offset += n
        if start + n == self.offsets[d + 1]:  # document finished: next one, or next epoch
            self.doc, self.offset = self.doc + 1, 0
            if self.doc == self.n_docs:
                self.epoch, self.doc = self.epoch + 1, 0
        return start, start + n

    def _next_pieces(self):
        """The (start, end) sequences of the next batch."""
        budget, pieces = self.tokens_per_micro_step, []
        if self.mode == "padded":
            return [self._take(self._next_piece_length()) for _ in range(budget // self.max_seq_len)]
        if self.mode == "packed":
            while budget > 0:
                pieces.append(self._take(min(self._next_piece_length(), budget)))
                budget -= pieces[-1][1] - pieces[-1][0]
            return pieces
        epoch = self.epoch  # padding_free: whole pieces while they fit, and not past the end of the epoch
        while self.epoch == epoch and self._next_piece_length() <= budget:
            pieces.append(self._take(self._next_piece_length()))
            budget -= pieces[-1][1] - pieces[-1][0]
        return pieces  # never empty: a piece is <= max_seq_len <= tokens_per_micro_step

    def __iter__(self):
        """Batches forever. The loader is its own cursor: iterating it again goes on where it stopped."""
        row_len = self.max_seq_len if self.mode == "padded" else None
        while True:
            for r in range(self.world_size):  # one batch per rank; this rank builds only its own
                pieces = self._next_pieces()
                if r == self.rank:
                    batch = make_batch(self.tokens, self.mask, pieces, row_len)
            yield batch

    def state_dict(self):
        """Where the stream stands after the last batch yielded, the same on every rank: after the last round of
        world_size batches (a prefetching wrapper must account for its queue)."""
        return {"epoch": self.epoch, "doc": self.doc, "offset": self.offset, "seed": self.seed, "n_docs": self.n_docs}

    def load_state_dict(self, state, source="the loader state"):
        """Go on from a state_dict(). A state of other data (another seed or number of documents), or one whose
        cursor is outside these documents, is a FileError naming `source` (the file the state came from)."""
        epoch, doc, offset, seed, n_docs = (need(state, key, int, source)
                                            for key in ("epoch", "doc", "offset", "seed", "n_docs"))
        if (seed, n_docs) != (self.seed, self.n_docs):
            raise FileError(f"{source}: the loader state is for seed {seed} and {n_docs} documents, this loader "
                            f"has seed {self.seed} and {self.n_docs} documents")
        if epoch < 0 or not 0 <= doc < n_docs:
            raise FileError(f"{source}: the loader is at epoch {epoch}, document {doc} of {n_docs}")
        d = self.order(epoch)[doc]
        if not 0 <= offset < self.offsets[d + 1] - self.offsets[d]:
            raise FileError(f"{source}: the loader is at token {offset} of a document of "
                            f"{self.offsets[d + 1] - self.offsets[d]}")
        self.epoch, self.doc, self.offset = epoch, doc, offset


def eval_batches(data_dir, split, tokens_per_micro_step, max_seq_len, max_batches=None, vocab_size=None):
    """One deterministic pass over a split, documents in file order, padding_free (at most max_batches batches)."""
    loader = PackedLoader(data_dir, split, tokens_per_micro_step, max_seq_len, vocab_size=vocab_size, shuffle=False)
    stream, batches = iter(loader), []
    while loader.epoch == 0 and len(batches) != max_batches:
        batches.append(next(stream))
    return batches
