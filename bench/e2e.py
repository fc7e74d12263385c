"""Benchmark: whole training steps, nanollama against Hugging Face transformers and HF + Liger-Kernel.

    python bench/e2e.py [--model 1b|8b|qwen3_8b|smollm2_1_7b|all] [--steps 8] [--rows free,hf_free,...] [--ckpt8b 0]
                        [--fp8]
    python bench/e2e.py --dry ...   # no GPU: the same rows' code on the CPU, tiny shapes; a smoke test, no numbers

Workload: random-init weights of real shapes (Llama-3.2-1B, Llama-3-8B; --model all is these two), bf16 compute,
AdamW, on synthetic documents whose lengths are exp(0.8 z + ln 180), z ~ N(0, 1), clipped to [16, 1024] tokens
(median 180), token ids uniform below the model's vocabulary; fixed seeds, so every run and every row sees the
same documents, from document 0 on. Our rows pack them with data/loader.py (the padded one pads them to the step's
longest, as the HF rows do) and take a step as train.py does: forward + backward, then optim.Update's grad_norm()
and clip_and_step(); train.py also reads the norm on the host (a sync per step) and so skips the clipping pass
where the norm is under the clip (BENCHMARKS.md measures both).

Rows (all in this one process, one after the other, everything freed in between; --rows picks them by key, or
all of them with --rows all; without --rows, 1b and 8b run the seven kinds listed first, free to long, the table
of earlier sessions, and the other models all their rows):
  free      ours, padding-free: whole documents end to end, as many as fit in the step's token budget
  packed    ours, packed: exactly the budget; the document at the end is cut and goes on in the next step
  padded    ours on the classic padded batch: the same 8 documents per step as the HF rows, each padded to the
            step's longest, given to our model as 8 sequences of L tokens (pads are computed, never counted)
  hf        HF LlamaForCausalLM, SDPA attention, padded batch of 8 documents, bf16 weights, fused torch AdamW
  liger     the same with Liger-Kernel's Llama patches (RoPE, RMSNorm, SwiGLU, fused linear cross-entropy)
  liger32   the same with 32 documents per step (1B only)
  long      8B only: one 65,536-token document per step, every block checkpointed
HF padding-free, on exactly the free row's steps (no pad anywhere, as ours):
  hf_free, hf_free_flex        HF given the step's documents end to end in ONE row (batch 1), position_ids
                               restarting at 0 in each, no attention_mask, the first token of each document
                               unlabelled (TRL's padding_free collator: hf_packed_inputs); SDPA or FlexAttention,
                               transformers building the block-causal mask from position_ids. FlexAttention is
                               torch.compile'd: those rows warm up on every step, then time them again
  liger_free, liger_free_flex  the same with Liger-Kernel
  liger_free_nogc, liger_free_flex_nogc   8B: the same without gradient checkpointing
8B, one document of 8,192 random tokens per step (torchtitan's and Megatron's setting; HF gets no padding):
  doc8k     ours, as free
  hf_doc8k  HF, SDPA, gradient checkpointing
  liger_doc8k, liger_doc8k_gc  HF + Liger without and with gradient checkpointing
8B, ours with the 8-bit optimizer (optim.AdamW8bit: 8-bit moments, Kahan, stepped in backward) and the first 8
blocks checkpointed, as configs/llama3_8b_80gb.py:
  free_8bit   the free workload
  doc8k_8bit  one 8K document per step
  doc8k_accum16  Megatron-Bridge's setting: steps of 16 micro-batches of one 8K document (its global batch of 128
              sequences over 8 GPUs), no block recomputed, the gradients summed in .grad (bf16) and the optimizer
              stepped after the last backward, clipped to 1.0, as train.py does with grad_accum=16
  long128k    one 131,072-token document per step, every block checkpointed; 1 warm-up and 2 timed steps of
              ~55 s each. Memory, expected ~100 GB: bf16 weights 16.1 GB + moment codes 16.1 (and their scales
              0.25) + fp16 Kahan compensation 16.1 = 48.4 GB of state; the blocks' inputs kept for the recompute
              32 x 131072 x 4096 x 2 B = 34.4 GB; the activations of the one block being recomputed and
              differentiated, ~108 KB x 131072 = 14 GB; the final norm, the loss's chunks and the embedding's and
              lm_head's gradients (1 GB each) a few GB more. No gradient of a whole model is ever held.
8B in less memory, as configs/llama3_8b_24gb.py and _48gb.py (CAPS): the GPU capped (set_per_process_memory_fraction,
once the model is built), the 8-bit state in host memory (optimizer_offload); each reports host RSS and link GB/s:
  free_24gb, doc8k_24gb  24 GB: all the state offloaded, every block recomputed
  free_48gb, doc8k_48gb  48 GB: 70% of it offloaded, 16 blocks recomputed
Qwen3-8B and SmolLM2-1.7B (--model qwen3_8b, --model smollm2_1_7b: model.PRESETS' shapes): free, ours, on the 8B
path and on the 1B path respectively, and the HF padding-free rows (Qwen3ForCausalLM and LlamaForCausalLM, made
from convert.hf_config_from as nano2hf writes them; Liger's qwen3 and llama patches), checkpointed as the 8B's.
1B, ours: fp32 master weights under bf16 autocast, our AdamW kernel with the clipping folded in (train.py's default).
8B, ours: bf16 weights, optim.AdamWKahan stepped inside backward (optim.step_in_backward: each gradient is used and
freed as soon as it is complete, so no 16 GB of gradients is ever held), 8192 tokens per step (activations are
~3.5 MB per token: 16K tokens do not fit beside 96 GB of weights, moments and compensation); --ckpt8b N
checkpoints the first N blocks (free, packed, padded, doc8k; Qwen3-8B's free). 8B, HF: gradient checkpointing on
(bs 8 needs it on one GPU), but in the rows that say otherwise: HF's bf16 state is 64 GB (weights, gradients, bf16
Adam moments), so Liger's leaner activations at 8K tokens fit beside it; plain HF's (fp32 logits, unfused MLP)
would not. --fp8: our rows run their block Linears in FP8 (train.py's fp8=True, kernels/fp8.py); their labels say
"fp8".

Columns: tok/s counts real (non-pad) tokens only. MFU = FLOPs / time / 989e12 (the H200's spec bf16 dense peak),
where FLOPs = model.Llama.estimate_flops of the real sequence lengths (6 * matmul params * tokens + causal
attention), the same formula for every row, so pad tokens and recomputation count as no work; "of mm" = FLOPs /
time / 790e12, the bf16 matmul rate measured on the H200 (bench/common.py). peak GB = torch.cuda.
max_memory_allocated over the timed steps: everything the process holds (weights, optimizer state, activations).
pad % = pad tokens / all tokens. MHz = the median SM clock over the timed steps (nvidia-smi): a step that draws the
board's power limit runs below the top clock, and the clock a machine holds there differs from one H200 to the
next. s = the row's wall time, set-up included. Results also go to $OUT/e2e.jsonl, one
JSON object per row, when OUT is set.
"""
import argparse
import contextlib
import gc
import importlib.metadata
import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from unittest import mock

import numpy as np
import torch
import torch._dynamo.utils

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import convert  # noqa: E402
import data.loader  # noqa: E402
import optim  # noqa: E402
from bench.common import H200_MATMUL_FLOPS, H200_PEAK_FLOPS, GpuClocks, try_import_liger  # noqa: E402
from data.loader import PackedLoader, make_batch  # noqa: E402
from kernels.common import IGNORE_INDEX  # noqa: E402
from model import PRESETS, Llama, LlamaConfig  # noqa: E402

SEED = 1234
LR, BETAS, WEIGHT_DECAY, GRAD_CLIP = 3e-4, (0.9, 0.95), 0.1, 1.0  # train.py's kind of settings
WARMUP = 3  # the first steps compile and autotune the Triton kernels


@dataclass
class Row:
    key: str  # its name for --rows
    label: str
    impl: str  # "ours", "hf" or "liger"
    layout: str  # "padding_free", "packed", "padded" or "one_doc"
    size: int  # tokens per step (padding_free, packed, one_doc) or documents per step (padded)
    checkpoint: int = 0  # ours: the first n blocks recompute their activations; HF: 1 = gradient checkpointing
    max_seq_len: int = 1024  # our model's RoPE table (the longest document)
    warmup: int = WARMUP
    steps: int = 0  # 0: --steps
    attn: str = "sdpa"  # HF rows: attn_implementation, "sdpa" or "flex_attention"
    optimizer: str = ""  # ours: optim.make_optimizer's name; "": the model's own (OPTIMIZER)
    offload: float = 0.0  # ours, adamw8bit: the share of its state in host memory (optim.offloaded_params)
    cap_gb: int = 0  # the GPU memory this row may use (torch.cuda.set_per_process_memory_fraction), GB; 0: all
    accum: int = 1  # ours: micro-steps per optimizer step (gradients summed, the optimizer after the last backward)
    extra: bool = False  # runs only when --rows names it (or all): a bare run keeps the table BENCHMARKS.md quotes


MODELS = {"1b": "llama3_2_1b", "8b": "llama3_8b", "qwen3_8b": "qwen3_8b", "smollm2_1_7b": "smollm2_1_7b"}
NAMES = {"1b": "1B", "8b": "8B", "qwen3_8b": "Qwen3-8B", "smollm2_1_7b": "SmolLM2-1.7B"}
# The 1B path (1B, SmolLM2-1.7B): fp32 master weights, torch AdamW, clipping; the 8B path (8B, Qwen3-8B): bf16
# weights, Kahan-compensated AdamW inside backward
OPTIMIZER = {"1b": "adamw", "8b": "adamw_kahan", "qwen3_8b": "adamw_kahan", "smollm2_1_7b": "adamw"}
# Megatron-Bridge's Llama-3-8B rate (docs/performance-summary.md): global batch 128 sequences of 8,192 tokens on 8
# H100s, so 16 micro-batches of one 8K sequence per GPU per optimizer step; doc8k_accum16 takes steps of that size
ACCUM_MEGATRON = 16
CKPT_8BIT = 8  # configs/llama3_8b_80gb.py's checkpoint_layers, for the 8-bit optimizer rows (a test keeps it so)
# GB of GPU memory: (checkpoint_layers, optimizer_offload) of configs/llama3_8b_{24,48}gb.py (a test keeps them so)
CAPS = {24: (32, 1.0), 48: (16, 0.7)}


def hf_free_rows(size, grad_ckpt):
    """HF and HF + Liger, padding-free (hf_packed_inputs) on the free row's steps, SDPA and FlexAttention."""
    gc = " +GC" if grad_ckpt else ""
    return [Row(f"{impl}_free{key}", f"{name} pf {attn_label}{gc}", impl, "padding_free", size,
                checkpoint=int(grad_ckpt), attn=attn)
            for impl, name in (("hf", "HF"), ("liger", "HF+Liger"))
            for attn, key, attn_label in (("sdpa", "", "sdpa"), ("flex_attention", "_flex", "flex"))]


def rows_of(model_key, ckpt8b=0):
    """The model's rows in table order (the module docstring says what each is); ckpt8b: the checkpointed blocks of
    the 8B path's rows that take --ckpt8b."""
    if model_key == "smollm2_1_7b":  # the 1B path
        return [Row("free", "ours padding-free", "ours", "padding_free", 16384)] + hf_free_rows(16384, grad_ckpt=False)
    if model_key == "qwen3_8b":  # the 8B path
        return ([Row("free", "ours padding-free", "ours", "padding_free", 8192, checkpoint=ckpt8b)]
                + hf_free_rows(8192, grad_ckpt=True))
    if model_key == "1b":
        return [Row("free", "ours padding-free", "ours", "padding_free", 16384),
                Row("packed", "ours packed", "ours", "packed", 16384),
                Row("padded", "ours padded bs8", "ours", "padded", 8),
                Row("hf", "HF bs8", "hf", "padded", 8),
                Row("liger", "HF+Liger bs8", "liger", "padded", 8),
                Row("liger32", "HF+Liger bs32", "liger", "padded", 32)] + extras(hf_free_rows(16384, grad_ckpt=False))
    classic = [Row("free", "ours padding-free", "ours", "padding_free", 8192, checkpoint=ckpt8b),
               Row("packed", "ours packed", "ours", "packed", 8192, checkpoint=ckpt8b),
               Row("padded", "ours padded bs8", "ours", "padded", 8, checkpoint=ckpt8b),
               Row("hf", "HF bs8 +GC", "hf", "padded", 8, checkpoint=1),
               Row("liger", "HF+Liger bs8 +GC", "liger", "padded", 8, checkpoint=1),
               Row("long", "ours 64K doc", "ours", "one_doc", 65536, checkpoint=32, max_seq_len=65536, warmup=2,
                   steps=2)]
    more = [Row("liger_free_nogc", "HF+Liger pf sdpa", "liger", "padding_free", 8192),
            Row("liger_free_flex_nogc", "HF+Liger pf flex", "liger", "padding_free", 8192, attn="flex_attention"),
            Row("free_8bit", "ours padding-free 8-bit", "ours", "padding_free", 8192, checkpoint=CKPT_8BIT,
                optimizer="adamw8bit"),
            Row("doc8k", "ours 8K doc", "ours", "one_doc", 8192, checkpoint=ckpt8b, max_seq_len=8192),
            Row("doc8k_8bit", "ours 8K doc 8-bit", "ours", "one_doc", 8192, checkpoint=CKPT_8BIT, max_seq_len=8192,
                optimizer="adamw8bit"),
            Row("hf_doc8k", "HF 8K doc +GC", "hf", "one_doc", 8192, checkpoint=1),
            Row("liger_doc8k", "HF+Liger 8K doc", "liger", "one_doc", 8192),
            Row("liger_doc8k_gc", "HF+Liger 8K doc +GC", "liger", "one_doc", 8192, checkpoint=1),
            Row("long128k", "ours 128K doc 8-bit", "ours", "one_doc", 131072, checkpoint=32, max_seq_len=131072,
                warmup=1, steps=2, optimizer="adamw8bit"),
            Row("doc8k_accum16", "ours 8K doc x16 8-bit", "ours", "one_doc", 8192, max_seq_len=8192, warmup=2,
                steps=2, optimizer="adamw8bit", accum=ACCUM_MEGATRON)]
    for cap, (ckpt, share) in CAPS.items():  # configs/llama3_8b_24gb.py and _48gb.py: state offloaded, GPU capped
        more += [Row(f"free_{cap}gb", f"ours pf offload {cap}GB", "ours", "padding_free", 8192, checkpoint=ckpt,
                     optimizer="adamw8bit", offload=share, cap_gb=cap),
                 Row(f"doc8k_{cap}gb", f"ours 8K doc offload {cap}GB", "ours", "one_doc", 8192, checkpoint=ckpt,
                     max_seq_len=8192, optimizer="adamw8bit", offload=share, cap_gb=cap)]
    return classic + extras(hf_free_rows(8192, grad_ckpt=True) + more)


def extras(rows):
    """The rows marked extra: a bare run (no --rows) leaves them out."""
    return [replace(r, extra=True) for r in rows]


def run_order(rows):
    """Liger patches transformers' Llama classes for the whole process, and for good: every plain-HF row must run
    before the first Liger row. A stable sort keeps the rest in order."""
    return sorted(rows, key=lambda r: r[1].impl == "liger")


# ---- the documents and the steps cut from them ----

@dataclass
class Step:
    batch: object  # data.loader.Batch: what our model takes (padded: B rows of L tokens, end to end)
    lengths: np.ndarray  # the real length of each sequence in it: tok/s and FLOPs count these, never pads


def make_documents(min_tokens, min_docs, vocab_size, seed=SEED):
    """(tokens, offsets), laid out like a prepared split: document d is tokens[offsets[d]:offsets[d + 1]]. At
    least min_tokens tokens in at least min_docs documents; lengths exp(0.8 z + ln 180) rounded and clipped to
    [16, 1024]; ids uniform in [0, vocab_size)."""
    rng = np.random.default_rng(seed)
    lengths = np.zeros(0, dtype=np.int64)
    while lengths.sum() < min_tokens or len(lengths) < min_docs:
        z = rng.standard_normal(1024)
        more = np.clip(np.rint(np.exp(0.8 * z + np.log(180))), 16, 1024).astype(np.int64)
        lengths = np.concatenate([lengths, more])
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.random.default_rng(seed + 1).integers(0, vocab_size, int(offsets[-1]), dtype=np.int64)
    return tokens, offsets


def padded_pieces(offsets, batch_size, n_steps):
    """batch_size whole documents per step, in order from document 0."""
    if (n_steps * batch_size) >= len(offsets):
        raise ValueError("not enough documents for the steps asked for")
    return [[(int(offsets[d]), int(offsets[d + 1])) for d in range(i * batch_size, (i + 1) * batch_size)]
            for i in range(n_steps)]


def make_step(tokens, pieces, padded=False):
    """A Step of these sequences: end to end (data.loader.make_batch: labels = next token of the same sequence,
    -100 at its last), or padded to the longest with token 0 and label -100, one per row of L tokens."""
    lengths = np.array([end - start for start, end in pieces], dtype=np.int64)
    batch = make_batch(tokens, None, pieces, row_len=int(lengths.max()) if padded else None)
    return Step(batch, lengths)


def build_steps(row, docs, n_steps):
    """The row's n_steps steps (warm-up and timed): built once, before anything is timed. padding_free and packed:
    data/loader.py's batches of row.size tokens, the documents in order (no document of the real rows is longer than
    their max_seq_len, so only packed cuts one, at the end of a step)."""
    tokens, offsets = docs
    if row.layout == "one_doc":  # the first row.size tokens of the stream as one document, the same every step
        if len(tokens) < row.size:
            raise ValueError(f"{len(tokens)} tokens of documents, {row.size} asked for")
        return [make_step(tokens, [(0, row.size)])] * n_steps
    if row.layout == "padded":
        return [make_step(tokens, p, padded=True) for p in padded_pieces(offsets, row.size, n_steps)]
    # PackedLoader reads a prepared split's files; these documents are in memory, so read_split hands them over
    with mock.patch.object(data.loader, "read_split", lambda *args: (tokens, None, offsets)):
        loader = PackedLoader(None, "documents", row.size, min(row.max_seq_len, row.size), mode=row.layout,
                              shuffle=False)
    return [Step(batch, batch.seqlens) for _, batch in zip(range(n_steps), loader)]


def hf_inputs(step):
    """HF's (B, L) input_ids, attention_mask (1 = real token) and labels for a padded step. HF shifts the labels
    itself (position t is trained to predict labels[t + 1]), so labels = input_ids with -100 at the pads gives the
    targets of our batch.labels: the next token of the same document, and none after its last token."""
    B = len(step.lengths)
    ids = step.batch.tokens.view(B, -1)
    real = step.batch.positions.view(B, -1).long() < torch.as_tensor(step.lengths).view(B, 1)
    return dict(input_ids=ids, attention_mask=real.long(), labels=ids.masked_fill(~real, IGNORE_INDEX))


def hf_packed_inputs(step):
    """HF's padding-free inputs for a step of sequences laid end to end, as TRL's padding_free collator makes them:
    ONE row (batch 1) of all T tokens, position_ids restarting at 0 in each sequence, no attention_mask, no KV cache
    (use_cache=False), labels = the tokens with -100 at the first token of every sequence. HF shifts the
    labels inside the loss (position t is trained on labels[t + 1]), so that -100 is what stops the last token of
    one document from predicting the first of the next: the targets are our batch.labels, and the count is ours.

    The attention is block-causal because transformers 5 reads the packing from position_ids when it gets no
    attention_mask and no cache: masking_utils._preprocess_mask_arguments calls find_packed_sequence_indices (a new
    sequence wherever a position is not the previous one + 1), and create_causal_mask then ANDs the causal mask with
    packed_sequence_mask_function (query and key in the same sequence): for sdpa a (1, 1, T, T) boolean mask, for
    flex_attention a BlockMask (read in transformers 5.24's masking_utils.py; there since huggingface/transformers
    PR 39194, July 2025). One sequence (one_doc) is no packing: plain causal (SDPA's is_causal, flash).
    tests/test_bench_e2e.py checks that each document's logits in the pack are those of the document alone."""
    b = step.batch
    labels = b.tokens.clone()
    labels[b.cu_seqlens[:-1].long()] = IGNORE_INDEX
    return dict(input_ids=b.tokens.view(1, -1), position_ids=b.positions.long().view(1, -1),
                labels=labels.view(1, -1), use_cache=False)


def padding_fraction(steps):
    real = sum(int(s.lengths.sum()) for s in steps)
    return 1 - real / sum(s.batch.tokens.numel() for s in steps)


def kernel_shape(step):
    """What makes our Triton kernels compile or autotune again: the attention autotunes once per longest document
    rounded up to a power of 2 (capped at 8K, kernels/attention.py), and Triton compiles a kernel again when an
    integer argument such as the token count turns divisible by 16, or equal to 1."""
    b = step.batch
    return min(1 << max(b.max_seqlen - 1, 0).bit_length(), 8192), b.tokens.numel() % 16 == 0, len(step.lengths) == 1


def warmup_order(steps, n_warmup):
    """Indices of the warm-up steps: the first n_warmup, then once more every later step whose kernel_shape the
    warm-up has not met yet, so that no compilation or autotuning happens while the clock runs."""
    order = list(range(n_warmup))
    seen = {kernel_shape(steps[i]) for i in order}
    for i in range(n_warmup, len(steps)):
        if kernel_shape(steps[i]) not in seen:
            seen.add(kernel_shape(steps[i]))
            order.append(i)
    return order


# ---- the models and their training steps ----

def build_ours(cfg, device, optimizer_name="adamw", checkpoint_layers=0, fp8=False, offload=0.0, accum=1):
    """(model, optim.Update), as train.py builds them: "adamw" keeps fp32 weights under our fused AdamW and
    clipping (train.py's default); "adamw_kahan" and "adamw8bit" (optim.KAHAN_OPTIMIZERS) make the weights bf16 and
    step each one inside backward (the Update keeps the optimizer alive, the hooks hold it only weakly), or with
    accum > 1 micro-steps after the last one's backward, clipped; fp8: the block Linears in FP8 (Llama.set_fp8);
    offload: the share of adamw8bit's state in host memory."""
    bf16_kahan = optimizer_name in optim.KAHAN_OPTIMIZERS
    in_backward = bf16_kahan and accum == 1
    with torch.device(device):  # initialised where it lives: an 8B init on the CPU takes minutes
        model = Llama(cfg)
    model.checkpoint_layers = checkpoint_layers
    model.set_fp8(fp8)
    if bf16_kahan:
        model.to(torch.bfloat16)
    optimizer = optim.make_optimizer(optimizer_name, model, LR, BETAS, WEIGHT_DECAY, fused=device == "cuda",
                                     offload=optim.offloaded_params(model, offload))
    return model, optim.Update(optimizer, model.parameters(), 0.0 if in_backward else GRAD_CLIP,
                               in_backward=in_backward)


def ours_step(model, update, batch):
    """One training step as train.py takes it: the summed loss over the counted tokens of its micro-batches (batch,
    or a list of them: gradient accumulation), a backward per micro-batch, then the update (clip and AdamW, or
    nothing left to do when backward stepped); returns (mean loss, gradient norm)."""
    micro = batch if isinstance(batch, list) else [batch]
    n_loss_tokens, loss = max(sum(b.n_loss_tokens for b in micro), 1), 0.0
    for b in micro:
        device_type = b.tokens.device.type
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=device_type == "cuda"):
            loss_sum, _ = model(b.tokens, b.cu_seqlens, b.max_seqlen, b.positions, b.labels, reduction="sum")
        (loss_sum / n_loss_tokens).backward()
        loss = loss + loss_sum.detach() / n_loss_tokens
    grad_norm = update.grad_norm()
    update.clip_and_step()
    return loss, grad_norm


def build_hf(cfg, device, liger=False, grad_ckpt=False, attn="sdpa"):
    """(HF model of our config's shape, fused torch AdamW): LlamaForCausalLM, or Qwen3ForCausalLM for a qk_norm
    config (convert.hf_config_from, the mapping nano2hf writes); bf16 weights (so bf16 Adam moments), attention attn
    ("sdpa" or "flex_attention", HF's attn_implementation), no KV cache, in training mode. liger: Liger-Kernel's
    patches first (they replace transformers' classes of that model type, so they must come before the model is
    built), fused linear cross-entropy included."""
    import transformers
    hf_dict = convert.hf_config_from(cfg, torch.bfloat16)
    if liger:
        import liger_kernel.transformers
        apply = getattr(liger_kernel.transformers, "apply_liger_kernel_to_" + hf_dict["model_type"])
        apply(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True)
    hf_cfg = transformers.AutoConfig.for_model(**hf_dict, use_cache=False, attn_implementation=attn)
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = getattr(transformers, hf_dict["architectures"][0])(hf_cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    if grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model, torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY,
                                    fused=device == "cuda")


def hf_step(model, optimizer, inputs):
    """One training step of the HF model: mean loss over the labelled tokens, backward, clip, AdamW."""
    loss = model(**inputs).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


# ---- one row ----

def run_row(model_key, row, docs, n_steps, device="cuda", dry=False, fp8=False):
    """Build the row's steps and model, warm up, time; the table's record. Everything it allocated is garbage
    when it returns. device="cpu" (--dry) runs the same code without the GPU's clock and memory counters."""
    preset = model_shapes(model_key, dry)
    timed = row.steps or n_steps
    steps = build_steps(row, docs, (row.warmup + timed) * row.accum)
    if row.impl == "ours":
        cfg = LlamaConfig(**{**preset, "max_seq_len": row.max_seq_len})
        model, update = build_ours(cfg, device, row.optimizer or OPTIMIZER[model_key], row.checkpoint, fp8,
                                   row.offload, row.accum)
        inputs = [s.batch.to(device) for s in steps]
        if row.accum > 1:  # a step is a list of micro-batches (one_doc rows: every step's shapes are the same)
            inputs = [inputs[i:i + row.accum] for i in range(0, len(inputs), row.accum)]
        step = lambda x: ours_step(model, update, x)[0]  # noqa: E731
    else:
        cfg = LlamaConfig(**preset)  # HF's max_position_embeddings: the released model's
        model, optimizer = build_hf(cfg, device, liger=row.impl == "liger", grad_ckpt=bool(row.checkpoint),
                                    attn=row.attn)
        make_inputs = hf_inputs if row.layout == "padded" else hf_packed_inputs
        inputs = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in make_inputs(s).items()} for s in steps]
        if row.impl == "liger":
            inputs = [dict(x, skip_logits=True) for x in inputs]  # the fused linear cross-entropy: no logits
        step = lambda x: hf_step(model, optimizer, x)  # noqa: E731
    cuda = device == "cuda"
    if cuda and row.cap_gb:  # from here on (the model is built: an 8B init passes through fp32)
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(row.cap_gb * 1e9 / torch.cuda.get_device_properties(0).total_memory)
    # torch.compile'd FlexAttention (and its BlockMask) can compile again on a shape it has not met: dynamo makes a
    # dimension dynamic only once it has seen it change (T, but also the mask's count of 128-token blocks). So these
    # rows warm up on every step, and the timed steps repeat shapes already compiled.
    order = range(len(inputs)) if row.attn == "flex_attention" else warmup_order(steps[::row.accum], row.warmup)
    for i in order:
        step(inputs[i])
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    graphs = compiled_graphs()
    with GpuClocks() if cuda else contextlib.nullcontext() as clocks:
        t0 = time.perf_counter()
        for i in range(row.warmup, row.warmup + timed):
            loss = step(inputs[i])
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    graphs = compiled_graphs() - graphs
    timed_steps = steps[row.warmup * row.accum:]
    with torch.device("meta"):  # the FLOP count needs only the shapes: the same formula for every row
        flops_model = Llama(LlamaConfig(**preset))
    flops = sum(flops_model.estimate_flops(s.lengths) for s in timed_steps)
    real = sum(int(s.lengths.sum()) for s in timed_steps)
    moved = 2 * optim.offloaded_bytes(optim.offloaded_params(model, row.offload)) * timed / seconds / 1e9
    offloaded = dict(host_gb=host_rss_gb(), link_gbs=moved) if row.offload else {}
    return offloaded | dict(tok_step=sum(s.batch.tokens.numel() for s in timed_steps) / timed, tok_s=real / seconds,
                mfu=flops / seconds / H200_PEAK_FLOPS, of_matmul=flops / seconds / H200_MATMUL_FLOPS,
                peak_gb=torch.cuda.max_memory_allocated() / 1e9 if cuda else float("nan"),
                pad=padding_fraction(timed_steps), loss=loss.item(), steps=timed, graphs_compiled_while_timed=graphs,
                clock_mhz=clocks.medians()[0] if cuda and clocks.medians() else None)


def host_rss_gb():
    """This process's resident host memory now, GB (offloaded state included: pinned pages are resident)."""
    with open("/proc/self/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith("VmRSS:"))) * 1024 / 1e9


def pinned_copy_gbs(n_bytes=1 << 30):
    """The host link's rate with nothing else running: GB/s of a pinned host -> GPU and a GPU -> host copy of
    n_bytes each, at once on two streams (StateStream's pattern), counting both directions."""
    host_in, host_out = (torch.empty(n_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2))
    dev_in, dev_out = (torch.empty(n_bytes, dtype=torch.uint8, device="cuda") for _ in range(2))
    streams = [torch.cuda.Stream() for _ in range(2)]
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(streams[0]):
            dev_in.copy_(host_in, non_blocking=True)
        with torch.cuda.stream(streams[1]):
            host_out.copy_(dev_out, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 2 * n_bytes / sorted(times)[2] / 1e9


def model_shapes(model_key, dry=False):
    """The model's LlamaConfig fields: model.PRESETS' real shapes, or for --dry the same family (GQA or not, tied
    embeddings, q/k norms) at a size a CPU trains in a moment: 2 blocks of width 64, a vocabulary of 512."""
    preset = PRESETS[MODELS[model_key]]
    if not dry:
        return preset
    kv_heads = 4 if preset["n_kv_heads"] == preset["n_heads"] else 2
    return dict(preset, dim=64, n_layers=2, n_heads=4, n_kv_heads=kv_heads, head_dim=16, ffn_dim=128, vocab_size=512)


def dry_row(row):
    """--dry: the row with 1/16 of its tokens per step (padded rows: as many documents), 1 warm-up and 1 timed
    step: every code path of the row, none of its cost (the CPU runs attention on long documents slowly)."""
    size = row.size if row.layout == "padded" else row.size // 16
    return replace(row, size=size, warmup=1, steps=1)


def skip_reason(row, have_hf, have_liger, dry):
    """Why the row cannot run here, or None."""
    if row.impl != "ours" and not have_hf:
        return "transformers is not installed"
    if row.impl == "liger" and dry:
        return "Liger-Kernel's Triton kernels need a GPU"
    if row.impl == "liger" and not have_liger:
        return "Liger-Kernel is not installed"
    if row.attn == "flex_attention" and dry:
        return "FlexAttention has no backward on the CPU"
    return None


def compiled_graphs():
    """How many graphs torch.compile has made in this process (the flex_attention rows compile; a compile while
    the clock runs would be timed as training, so run_row counts them and main() warns)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


COLUMNS = (f"{'model':<13}{'row':<24}{'tok/step':>9}{'ckpt':>6}{'tok/s':>10}{'MFU':>8}{'of mm':>8}{'peak GB':>9}"
           f"{'pad %':>7}{'MHz':>6}{'s':>6}")


def format_row(rec):
    head = f"{rec['model']:<13}{rec['row']:<24}"
    if "tok_s" not in rec:
        return head + f"  {rec['error']}"
    return head + (f"{rec['tok_step']:>9,.0f}{rec['ckpt']:>6}{rec['tok_s']:>10,.0f}{100 * rec['mfu']:>7.1f}%"
                   f"{100 * rec['of_matmul']:>7.1f}%{rec['peak_gb']:>9.1f}{100 * rec['pad']:>6.1f}%"
                   f"{'' if rec.get('clock_mhz') is None else format(rec['clock_mhz'], '.0f'):>6}"
                   f"{rec['seconds']:>6.0f}"
                   + (f"  host {rec['host_gb']:.1f} GB, link {rec['link_gbs']:.1f} GB/s" if "host_gb" in rec else ""))


def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=[*MODELS, "all"], default="all", help="all: 1b and 8b")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per row (after the warm-up)")
    parser.add_argument("--rows", default="", help="comma list of row keys, of: " + ", ".join(all_keys()) + "; "
                        "or all. Without it: 1b and 8b run the classic table (free ... long), the other models all "
                        "their rows")
    parser.add_argument("--ckpt8b", type=int, default=0,
                        help="checkpointed blocks in the 8B-path rows free, packed, padded, doc8k")
    parser.add_argument("--fp8", action="store_true", help="our rows: the block Linears in FP8 (kernels/fp8.py)")
    parser.add_argument("--dry", action="store_true",
                        help="no GPU: every selected row's code on the CPU, tiny shapes, 1/16 of the tokens, 1 timed "
                             "step; its numbers mean nothing (a smoke test of the wiring)")
    return parser.parse_args()


def all_keys():
    return sorted({r.key for m in MODELS for r in rows_of(m)})


def select_rows(args):
    """[(model key, Row)] that --model and --rows ask for, in rows_of's order; exits on a key that names none."""
    wanted = set(filter(None, args.rows.split(",")))
    if wanted - set(all_keys()) - {"all"}:
        sys.exit(f"--rows: unknown {', '.join(sorted(wanted - set(all_keys()) - {'all'}))}; the rows are "
                 f"{', '.join(all_keys())}")
    rows = [(m, r) for m in (["1b", "8b"] if args.model == "all" else [args.model])
            for r in rows_of(m, args.ckpt8b) if r.key in wanted or "all" in wanted or not (wanted or r.extra)]
    if not rows:
        sys.exit(f"--rows {args.rows}: no such row for --model {args.model}")
    return [(m, dry_row(r)) for m, r in rows] if args.dry else rows


def main():
    args = parse_args()
    rows = select_rows(args)
    # Rows of very different sizes follow each other in one process: expandable segments let the allocator reuse
    # the memory a freed 8B model leaves behind instead of failing on its fragments (read when CUDA starts).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if args.dry:
        args.steps, device = 1, "cpu"
        print("DRY RUN on the CPU: tiny models, 1/16 of the tokens; the numbers below mean nothing")
    elif torch.cuda.is_available():
        device = "cuda"
        print(torch.cuda.get_device_name(), end=" | ")
    else:
        sys.exit("bench/e2e.py needs a CUDA GPU (--dry runs its code on the CPU)")
    print(f"torch {torch.__version__} | triton {version('triton')} | transformers {version('transformers')} | "
          f"liger-kernel {version('liger_kernel')}")
    print(f"MFU against {H200_PEAK_FLOPS / 1e12:.0f} TFLOP/s (H200 spec, bf16 dense), 'of mm' against "
          f"{H200_MATMUL_FLOPS / 1e12:.0f} (bf16 matmul measured on the H200); {1 if args.dry else WARMUP} warm-up "
          f"steps (+ one per new kernel shape), then {args.steps} timed; tok/s and MFU count real tokens only",
          flush=True)
    have_hf = importlib.util.find_spec("transformers") is not None
    have_liger = not args.dry and any(r.impl == "liger" for _, r in rows) and try_import_liger() is not None
    # enough documents for the hungriest row: 16K tokens, or 32 documents, per step; the longest one_doc row. The
    # same lengths for every model, token ids below each one's vocabulary (so the Llamas share their documents)
    n = WARMUP + args.steps + 1
    n_tokens = max([n * 16384] + [r.size for _, r in rows if r.layout == "one_doc"])
    vocab = {m: model_shapes(m, args.dry)["vocab_size"] for m, _ in rows}
    by_vocab = {v: make_documents(n_tokens, n * 32, v) for v in set(vocab.values())}
    out = os.environ.get("OUT")
    jsonl = open(os.path.join(out, "e2e.jsonl"), "w") if out else None
    records, start = {}, time.time()
    if device == "cuda" and any(r.offload for _, r in rows):
        print(f"host link, pinned copies alone: {pinned_copy_gbs():.1f} GB/s (in + out at once)", flush=True)
    print(COLUMNS, flush=True)
    for model_key, row in run_order(rows):
        name = f"{NAMES[model_key]} {row.label}"
        label = row.label + (" fp8" if args.fp8 and row.impl == "ours" else "")
        rec = dict(model=NAMES[model_key], row=label, ckpt=row.checkpoint)
        reason = skip_reason(row, have_hf, have_liger, args.dry)
        if reason:
            print(f"[skip] {name}: {reason}", flush=True)
            rec["error"] = "skipped: " + reason
        else:
            t0 = time.time()
            try:
                rec.update(run_row(model_key, row, by_vocab[vocab[model_key]], args.steps, device, args.dry,
                                   args.fp8))
                rec["seconds"] = time.time() - t0
                print(format_row(rec), flush=True)
                if rec["graphs_compiled_while_timed"]:
                    print(f"[warn] {name}: torch.compile made {rec['graphs_compiled_while_timed']} graph(s) during "
                          "the timed steps: their compile time is in the row's time", flush=True)
            except Exception as e:  # e.g. out of memory: say so, free it, go on with the next row
                rec["error"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
                print(f"[fail] {name}: {rec['error'][len('failed: '):]} ({time.time() - t0:.0f} s)", flush=True)
        torch._dynamo.reset()  # the flex rows' compiled graphs: no row inherits them, nor their recompile count
        if device == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0)  # (a capped row's cap)
        gc.collect()
        torch.cuda.empty_cache()
        records[(model_key, row.key)] = rec
        if jsonl:
            jsonl.write(json.dumps(rec) + "\n")
            jsonl.flush()
    print("\n" + COLUMNS)
    for model_key, row in rows:  # the table in the rows' own order
        print(format_row(records[(model_key, row.key)]))
    print(f"total {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
