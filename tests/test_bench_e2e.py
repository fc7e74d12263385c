"""bench/e2e.py on the CPU: its documents and batches (every row type must train on the same documents, with the
targets train.py would give them), and one training step of each kind of row with a tiny model. The timing itself
runs only on the GPU (python bench/e2e.py)."""
import importlib.util

import numpy as np
import pytest
import torch

from bench import e2e
from conftest import rel_err
from kernels.common import IGNORE_INDEX
from model import LlamaConfig

VOCAB = 300
TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=VOCAB, tie_embeddings=True,
            max_seq_len=1024, rope_scaling=dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                original_max_position_embeddings=8192))


@pytest.fixture(scope="module")
def docs():
    return e2e.make_documents(40_000, 100, VOCAB)


def doc_list(docs):
    tokens, offsets = docs
    return [tokens[offsets[d]:offsets[d + 1]] for d in range(len(offsets) - 1)]


def check_targets(batch, lengths):
    """Labels are the next token of the same sequence, -100 at each sequence's last token and at pads; positions
    restart at 0 in each sequence; host ints agree with the tensors."""
    cu = batch.cu_seqlens.long()
    assert batch.cu_seqlens.dtype == torch.int32 and batch.positions.dtype == torch.int32
    for s in range(len(cu) - 1):
        a, b = int(cu[s]), int(cu[s + 1])
        n = int(lengths[s])
        assert torch.equal(batch.positions[a:b], torch.arange(b - a, dtype=torch.int32))
        assert torch.equal(batch.labels[a:a + n - 1], batch.tokens[a + 1:a + n])
        assert (batch.labels[a + n - 1:b] == IGNORE_INDEX).all()  # the last real token, then the pads
        assert (batch.tokens[a + n:b] == 0).all()
    assert batch.max_seqlen == int((cu[1:] - cu[:-1]).max())
    assert batch.n_loss_tokens == int((batch.labels != IGNORE_INDEX).sum()) == int(lengths.sum()) - len(lengths)


def test_documents_follow_the_spec(docs):
    tokens, offsets = docs
    lengths = np.diff(offsets)
    assert offsets[-1] >= 40_000 and len(lengths) >= 100 and len(tokens) == offsets[-1]
    assert lengths.min() >= 16 and lengths.max() <= 1024
    assert 150 < np.median(lengths) < 215  # exp(0.8 z + ln 180): median 180
    assert 0.6 < np.log(lengths[(lengths > 16) & (lengths < 1024)]).std() < 0.85  # sigma 0.8, a little clipped
    assert tokens.min() >= 0 and tokens.max() < VOCAB and len(np.unique(tokens)) == VOCAB
    again = e2e.make_documents(40_000, 100, VOCAB)  # fixed seed: every run sees the same documents
    assert np.array_equal(again[0], tokens) and np.array_equal(again[1], offsets)


def test_padding_free_steps_hold_whole_documents_in_order(docs):
    budget, n = 2048, 5
    steps = e2e.build_steps(e2e.Row("free", "", "ours", "padding_free", budget), docs, n)
    served = [t for s in steps for t in np.split(s.batch.tokens.numpy(), s.batch.cu_seqlens[1:-1].numpy())]
    originals = doc_list(docs)
    assert all(np.array_equal(a, b) for a, b in zip(served, originals))  # documents 0, 1, 2, ... each whole
    k = 0
    for s in steps:
        check_targets(s.batch, s.lengths)
        assert s.batch.tokens.numel() == s.lengths.sum() <= budget
        k += len(s.lengths)
        assert s.lengths.sum() + len(originals[k]) > budget  # the next document would not have fitted
    assert e2e.padding_fraction(steps) == 0


def test_packed_steps_are_exactly_the_stream(docs):
    tokens, offsets = docs
    budget, n = 1000, 6
    steps = e2e.build_steps(e2e.Row("packed", "", "ours", "packed", budget), docs, n)
    stream = np.concatenate([s.batch.tokens.numpy() for s in steps])
    assert all(s.batch.tokens.numel() == budget for s in steps)
    assert np.array_equal(stream, tokens[:n * budget])  # nothing skipped, nothing repeated
    for s in steps:
        check_targets(s.batch, s.lengths)
    # a document cut at the end of a step goes on at the start of the next, from position 0
    ends = set(offsets.tolist())
    for i in range(1, n):
        cut = i * budget not in ends
        assert (steps[i - 1].batch.labels[-1] == IGNORE_INDEX) and (steps[i].batch.positions[0] == 0)
        if cut:
            start = offsets[np.searchsorted(offsets, i * budget) - 1]
            assert steps[i - 1].lengths[-1] == i * budget - max(start, (i - 1) * budget)


def test_padded_steps_and_hf_inputs(docs):
    bs, n = 8, 4
    steps = e2e.build_steps(e2e.Row("padded", "", "ours", "padded", bs), docs, n)
    originals = doc_list(docs)
    total = 0
    for i, s in enumerate(steps):
        L = int(s.lengths.max())
        assert s.batch.tokens.numel() == bs * L and s.batch.max_seqlen == L
        assert torch.equal(s.batch.cu_seqlens, torch.arange(bs + 1, dtype=torch.int32) * L)
        check_targets(s.batch, s.lengths)
        rows = s.batch.tokens.view(bs, L)
        for r in range(bs):  # documents i * bs .. i * bs + 7, in order, one per row
            assert np.array_equal(rows[r, :s.lengths[r]].numpy(), originals[i * bs + r])
        hf = e2e.hf_inputs(s)
        assert hf["input_ids"].shape == hf["attention_mask"].shape == hf["labels"].shape == (bs, L)
        assert torch.equal(hf["attention_mask"].sum(1), torch.as_tensor(s.lengths))
        # HF trains position t on labels[t + 1]: the same target as our label at t, everywhere
        ours = s.batch.labels.view(bs, L)
        assert torch.equal(hf["labels"][:, 1:], ours[:, :-1]) and (ours[:, -1] == IGNORE_INDEX).all()
        total += bs * L
    real = sum(int(s.lengths.sum()) for s in steps)
    assert e2e.padding_fraction(steps) == pytest.approx(1 - real / total) and 0 < e2e.padding_fraction(steps) < 1


def test_every_row_starts_from_document_zero(docs):
    tokens, offsets = docs
    first = {}
    for layout, size in [("padding_free", 2048), ("packed", 1000), ("padded", 8)]:
        s = e2e.build_steps(e2e.Row("x", "", "ours", layout, size), docs, 1)[0]
        first[layout] = s.batch.tokens[:s.lengths[0]].numpy()
    assert all(np.array_equal(f, tokens[:offsets[1]]) for f in first.values())
    long = e2e.build_steps(e2e.Row("long", "", "ours", "one_doc", 5000), docs, 3)
    assert len(long) == 3 and long[0].batch.cu_seqlens.tolist() == [0, 5000]
    assert np.array_equal(long[0].batch.tokens.numpy(), tokens[:5000])


def test_rows_and_run_order():
    rows = [(m, r) for m in e2e.MODELS for r in e2e.rows_of(m, ckpt8b=4)]
    keys = {m: [r.key for mm, r in rows if mm == m] for m in e2e.MODELS}
    hf_free = ["hf_free", "hf_free_flex", "liger_free", "liger_free_flex"]
    assert keys == {"1b": ["free", "packed", "padded", "hf", "liger", "liger32"] + hf_free,
                    "8b": ["free", "packed", "padded", "hf", "liger", "long"] + hf_free
                    + ["liger_free_nogc", "liger_free_flex_nogc", "free_8bit", "doc8k", "doc8k_8bit", "hf_doc8k",
                       "liger_doc8k", "liger_doc8k_gc", "long128k", "doc8k_accum16", "free_24gb", "doc8k_24gb",
                       "free_48gb", "doc8k_48gb"],
                    "qwen3_8b": ["free"] + hf_free, "smollm2_1_7b": ["free"] + hf_free}
    assert {m: e2e.OPTIMIZER[m] for m in e2e.MODELS} == {"1b": "adamw", "8b": "adamw_kahan",
                                                         "qwen3_8b": "adamw_kahan", "smollm2_1_7b": "adamw"}
    order = e2e.run_order(rows)
    impls = [r.impl for _, r in order]
    assert sorted(order, key=id) == sorted(rows, key=id)
    assert "liger" not in impls[:impls.index("liger")] and set(impls[impls.index("liger"):]) == {"liger"}
    for m in e2e.MODELS:  # keys and labels name one row each
        assert len(set(keys[m])) == len(keys[m]) == len({r.label for mm, r in rows if mm == m})
    classic = {"free", "packed", "padded", "hf", "liger", "liger32", "long"}
    assert all(r.extra == (m in ("1b", "8b") and r.key not in classic) for m, r in rows)
    eight = {r.key: r for m, r in rows if m == "8b"}
    assert eight["free"].size == 8192 and eight["free"].checkpoint == 4 and eight["long"].checkpoint == 32
    # the padding-free HF rows take the free row's steps; 8B: gradient checkpointing as the padded HF rows, but _nogc
    for m, r in rows:
        if r.key.startswith(("hf_free", "liger_free")):
            free = next(f for mm, f in rows if mm == m and f.key == "free")
            assert (r.layout, r.size, r.max_seq_len) == (free.layout, free.size, free.max_seq_len)
            assert r.attn == ("flex_attention" if "_flex" in r.key else "sdpa")
            assert r.checkpoint == (m in ("8b", "qwen3_8b") and not r.key.endswith("_nogc"))
    assert all(eight[k].optimizer == "adamw8bit" and eight[k].checkpoint == e2e.CKPT_8BIT
               for k in ("free_8bit", "doc8k_8bit"))
    assert all(eight[k].layout == "one_doc" and eight[k].size == 8192
               for k in ("doc8k", "doc8k_8bit", "hf_doc8k", "liger_doc8k", "liger_doc8k_gc"))
    assert [eight[k].checkpoint for k in ("doc8k", "hf_doc8k", "liger_doc8k", "liger_doc8k_gc")] == [4, 1, 0, 1]
    long = eight["long128k"]
    assert (long.size, long.max_seq_len, long.checkpoint, long.optimizer, long.warmup, long.steps) == \
        (131072, 131072, 32, "adamw8bit", 1, 2)


def test_select_rows():
    import argparse

    def keys(rows="", model="all", dry=False):
        args = argparse.Namespace(rows=rows, model=model, ckpt8b=2, dry=dry)
        return [(m, r.key) for m, r in e2e.select_rows(args)]
    # a bare run: the classic table of 1b and 8b, as earlier sessions ran it
    assert keys() == [("1b", k) for k in ["free", "packed", "padded", "hf", "liger", "liger32"]] + \
        [("8b", k) for k in ["free", "packed", "padded", "hf", "liger", "long"]]
    assert keys(model="qwen3_8b") == [("qwen3_8b", k) for k in ["free", "hf_free", "hf_free_flex", "liger_free",
                                                                 "liger_free_flex"]]
    assert keys("hf_free,long128k") == [("1b", "hf_free"), ("8b", "hf_free"), ("8b", "long128k")]
    assert len(keys("all", "8b")) == len(e2e.rows_of("8b"))
    with pytest.raises(SystemExit):
        keys("nope")
    with pytest.raises(SystemExit):
        keys("long", "1b")  # a key no row of the model has
    args = argparse.Namespace(rows="long128k", model="8b", ckpt8b=0, dry=True)
    assert e2e.select_rows(args)[0][1].size == 131072 // 16


def test_8bit_rows_checkpoint_as_the_8b_configs():
    import runpy
    import os

    def config(name):
        return runpy.run_path(os.path.join(os.path.dirname(e2e.__file__), "..", "configs", f"llama3_8b_{name}.py"))
    cfg = config("80gb")
    assert cfg["optimizer_name"] == "adamw8bit" and cfg["checkpoint_layers"] == e2e.CKPT_8BIT
    rows = {r.key: r for r in e2e.rows_of("8b")}
    for cap, (ckpt, share) in e2e.CAPS.items():
        cfg = config(f"{cap}gb")
        assert (cfg["optimizer_offload"], cfg["checkpoint_layers"]) == (share, ckpt) and cfg["optimizer_in_backward"]
        for key in (f"free_{cap}gb", f"doc8k_{cap}gb"):
            assert (rows[key].offload, rows[key].cap_gb, rows[key].checkpoint) == (share, cap, ckpt)
            assert rows[key].size == cfg["tokens_per_micro_step"] and rows[key].optimizer == cfg["optimizer_name"]


def test_warmup_meets_every_kernel_shape(docs):
    steps = e2e.build_steps(e2e.Row("padded", "", "ours", "padded", 8), docs, 11)
    order = e2e.warmup_order(steps, 3)
    assert order[:3] == [0, 1, 2] and len(set(order)) == len(order)
    seen = {e2e.kernel_shape(steps[i]) for i in order}
    assert all(e2e.kernel_shape(s) in seen for s in steps)
    assert e2e.kernel_shape(steps[0])[0] >= steps[0].batch.max_seqlen > e2e.kernel_shape(steps[0])[0] // 2


def test_one_step_of_ours_trains(docs):
    cfg = LlamaConfig(**TINY)
    model, update = e2e.build_ours(cfg, "cpu")
    step = e2e.build_steps(e2e.Row("free", "", "ours", "padding_free", 2048), docs, 1)[0]
    before = [p.detach().clone() for p in model.parameters()]
    loss, grad_norm = e2e.ours_step(model, update, step.batch)
    assert abs(loss.item() - np.log(VOCAB)) < 0.5 and grad_norm.item() > 0  # random init: about ln(vocab)
    assert all(p.grad is None for p in model.parameters())  # zero_grad after the step
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))  # every weight moved


def test_one_step_of_ours_bf16_kahan_in_backward(docs):
    model, update = e2e.build_ours(LlamaConfig(**TINY), "cpu", "adamw_kahan", checkpoint_layers=1)
    assert isinstance(update.optimizer, e2e.optim.AdamWKahan) and update.in_backward
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    step = e2e.build_steps(e2e.Row("packed", "", "ours", "packed", 1024), docs, 1)[0]
    before = [p.detach().clone() for p in model.parameters()]
    loss, grad_norm = e2e.ours_step(model, update, step.batch)
    assert np.isfinite(loss.item()) and grad_norm.item() > 0  # the norm the hooks summed up
    assert all(p.grad is None for p in model.parameters())  # each gradient freed once used
    assert sum(not torch.equal(a, p) for a, p in zip(before, model.parameters())) > len(before) // 2


def load_ours(hf, ours):
    """Our weights into the HF model (convert.py's names: HF's are ours under "model.", but lm_head)."""
    hf.load_state_dict({e2e.convert.hf_name(n): t for n, t in ours.state_dict().items()}, strict=True)


def assert_hf_loss_is_ours(hf, ours, step, inputs):
    """With our weights (fp32), HF's loss on its inputs for the step is our loss on the step's batch: same targets."""
    load_ours(hf.float(), ours)
    with torch.no_grad():
        b = step.batch
        ref = ours(b.tokens, b.cu_seqlens, b.max_seqlen, b.positions, b.labels)
        assert rel_err(hf(**inputs).loss, ref) < 1e-5


@pytest.mark.parametrize("layout, size, make_inputs", [("padded", 8, e2e.hf_inputs),
                                                       ("padding_free", 2048, e2e.hf_packed_inputs)])
def test_hf_step_trains_and_sees_our_targets(docs, layout, size, make_inputs):
    """HF on its padded (B, L) batch and on a free row's step packed into one row (sdpa: the flex rows' backward
    needs the GPU): its loss is ours with our weights, and an hf_step on those inputs trains."""
    pytest.importorskip("transformers")
    cfg = LlamaConfig(**TINY)
    hf, optimizer = e2e.build_hf(cfg, "cpu")
    assert hf.dtype == torch.bfloat16 and hf.training and hf.config._attn_implementation == "sdpa"
    step = e2e.build_steps(e2e.Row(layout, "", "hf", layout, size), docs, 1)[0]
    inputs = make_inputs(step)
    assert_hf_loss_is_ours(hf, e2e.build_ours(cfg, "cpu")[0], step, inputs)
    hf.to(torch.bfloat16)
    before = [p.detach().clone() for p in hf.parameters()]
    loss = e2e.hf_step(hf, optimizer, inputs)
    assert abs(loss.item() - np.log(VOCAB)) < 0.5
    assert all(p.grad is None for p in hf.parameters())
    # every matrix moved (a norm weight of 1 does not at this lr: bf16 weights round 1 + 3e-4 back to 1)
    assert all(not torch.equal(a, p) for a, p in zip(before, hf.parameters()) if p.dim() == 2)


def test_one_step_of_ours_8bit_in_backward(docs):
    """The 8-bit rows: optim.AdamW8bit on bf16 weights, inside backward, the one_doc layout."""
    model, update = e2e.build_ours(LlamaConfig(**TINY), "cpu", "adamw8bit", checkpoint_layers=2)
    assert isinstance(update.optimizer, e2e.optim.AdamW8bit) and update.in_backward and model.checkpoint_layers == 2
    step = e2e.build_steps(e2e.Row("doc8k_8bit", "", "ours", "one_doc", 700), docs, 2)[0]
    before = [p.detach().clone() for p in model.parameters()]
    loss, grad_norm = e2e.ours_step(model, update, step.batch)
    assert abs(loss.item() - np.log(VOCAB)) < 0.5 and grad_norm.item() > 0
    assert all(p.grad is None for p in model.parameters())
    assert any(p.dtype == torch.bfloat16 and update.optimizer.state[p]["exp_avg"].dtype == torch.int8
               for p in model.parameters())  # 8-bit codes for the matrices
    assert sum(not torch.equal(a, p) for a, p in zip(before, model.parameters())) > len(before) // 2


def test_hf_packed_inputs_carry_our_targets(docs):
    step = e2e.build_steps(e2e.Row("hf_free", "", "hf", "padding_free", 2048), docs, 1)[0]
    hf = e2e.hf_packed_inputs(step)
    b, T = step.batch, step.batch.tokens.numel()
    assert hf["input_ids"].shape == hf["position_ids"].shape == hf["labels"].shape == (1, T)
    assert "attention_mask" not in hf and hf["use_cache"] is False
    assert torch.equal(hf["input_ids"][0], b.tokens) and torch.equal(hf["position_ids"][0], b.positions.long())
    # HF trains position t on labels[t + 1]: our label at t everywhere (-100 after each document's last token)
    assert torch.equal(hf["labels"][0, 1:], b.labels[:-1]) and b.labels[-1] == IGNORE_INDEX
    assert int((hf["labels"][0, 1:] != IGNORE_INDEX).sum()) == b.n_loss_tokens
    assert len(step.lengths) > 3 and (hf["labels"][0, b.cu_seqlens[:-1].long()] == IGNORE_INDEX).all()


@pytest.mark.parametrize("attn", ["sdpa", "flex_attention"])
def test_hf_padding_free_packing_is_exact(attn):
    """The HF padding-free rows' claim: three documents packed in one row by hf_packed_inputs are three documents.
    Each one's logits inside the pack are those of the document run alone, and the loss of the pack is the
    token-weighted mean of the documents' own losses. FlexAttention runs forward on the CPU (compiled by inductor
    to C++), which is all this needs; its backward raises NotImplementedError on the CPU in torch 2.13, so the
    training step of the flex rows runs on the GPU only."""
    pytest.importorskip("transformers")
    if attn == "flex_attention" and importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        pytest.skip("this torch has no torch.nn.attention.flex_attention")
    cfg = LlamaConfig(**dict(TINY, n_layers=3))
    hf, _ = e2e.build_hf(cfg, "cpu", attn=attn)
    hf.float()
    assert hf.config._attn_implementation == attn
    lengths = [11, 37, 23]  # odd lengths: no document fills a block of any kernel
    tokens = np.random.default_rng(0).integers(0, VOCAB, sum(lengths))
    ends = np.cumsum(lengths)
    pieces = [(int(e - n), int(e)) for n, e in zip(lengths, ends)]
    inputs = e2e.hf_packed_inputs(e2e.make_step(tokens, pieces))
    with torch.no_grad():
        packed = hf(**inputs)
        alone = [hf(input_ids=inputs["input_ids"][:, a:b], labels=inputs["input_ids"][:, a:b], use_cache=False)
                 for a, b in pieces]
        one_long = hf(input_ids=inputs["input_ids"], use_cache=False).logits  # no position_ids: one document
    for (a, b), out in zip(pieces, alone):
        assert (packed.logits[0, a:b] - out.logits[0]).abs().max() < 1e-5
    weights = [n - 1 for n in lengths]  # HF's mean over the tokens that have a target
    mean = sum(w * out.loss for w, out in zip(weights, alone)) / sum(weights)
    assert abs(packed.loss - mean) < 5e-6  # a few fp32 ulps of ~5.7; labels unmasked at the starts: ~5e-5 off
    # the check has teeth: read as one 71-token document, the later documents see the earlier ones
    assert (one_long[0, lengths[0]:] - packed.logits[0, lengths[0]:]).abs().max() > 1e-3


def test_hf_rows_of_a_qwen3_model_are_qwen3(docs):
    """build_hf follows convert.py's mapping: a qk_norm config is HF's Qwen3ForCausalLM, which computes what ours
    does (our weights, fp32, a packed free step: the same loss)."""
    pytest.importorskip("transformers")
    cfg = LlamaConfig(**dict(TINY, n_heads=4, n_kv_heads=2, head_dim=32, norm_eps=1e-6, rope_theta=1e6,
                             rope_scaling=None, tie_embeddings=False, qk_norm=True))
    hf, _ = e2e.build_hf(cfg, "cpu")
    assert type(hf).__name__ == "Qwen3ForCausalLM" and hf.dtype == torch.bfloat16
    ours, _ = e2e.build_ours(cfg, "cpu")
    with torch.no_grad():
        for layer in ours.layers:  # q/k norm weights start at 1 in both: make them matter
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    step = e2e.build_steps(e2e.Row("hf_free", "", "hf", "padding_free", 2048), docs, 1)[0]
    assert_hf_loss_is_ours(hf, ours, step, e2e.hf_packed_inputs(step))


def test_models_are_presets_of_model_py():
    for m, preset in e2e.MODELS.items():
        assert preset in e2e.PRESETS and m in e2e.NAMES
    q, s = e2e.PRESETS["qwen3_8b"], e2e.PRESETS["smollm2_1_7b"]
    assert q["qk_norm"] and q["n_layers"] == 36 and s["vocab_size"] == 49152 and s["n_kv_heads"] == 32


def test_dry_shapes_keep_the_family():
    for m in e2e.MODELS:
        real, dry = e2e.model_shapes(m), e2e.model_shapes(m, dry=True)
        assert real is e2e.PRESETS[e2e.MODELS[m]] and dry["n_layers"] == 2 and dry["vocab_size"] == 512
        for switch in ("qk_norm", "qkv_bias", "tie_embeddings", "rope_scaling", "rope_theta"):
            assert dry.get(switch) == real.get(switch)
        assert (dry["n_kv_heads"] == dry["n_heads"]) == (real["n_kv_heads"] == real["n_heads"])
        LlamaConfig(**dry)  # a valid config
    rows = {r.key: e2e.dry_row(r) for r in e2e.rows_of("8b")}
    assert rows["long128k"].size == 8192 and rows["padded"].size == 8 and rows["free"].size == 512
    assert all(r.warmup == 1 and r.steps == 1 for r in rows.values())


@pytest.mark.parametrize("model_key,key", [("1b", "free"), ("1b", "hf_free"), ("8b", "doc8k_8bit"),
                                           ("8b", "doc8k_accum16"), ("qwen3_8b", "hf_free")])
def test_run_row_on_the_cpu(model_key, key):
    """run_row's own wiring (what --dry runs): builds, warms up, times a row and fills its record."""
    if key.startswith("hf"):
        pytest.importorskip("transformers")
    row = e2e.dry_row(next(r for r in e2e.rows_of(model_key) if r.key == key))
    docs = e2e.make_documents(40_000, 100, 512)
    rec = e2e.run_row(model_key, row, docs, 1, "cpu", dry=True)
    assert rec["steps"] == 1 and rec["tok_s"] > 0 and rec["pad"] == 0 and rec["graphs_compiled_while_timed"] == 0
    assert abs(rec["loss"] - np.log(512)) < 0.5 and rec["tok_step"] <= row.size * row.accum
    assert all(e2e.skip_reason(r, True, True, dry=False) is None for r in e2e.rows_of(model_key))
    assert e2e.skip_reason(e2e.Row("x", "", "liger", "padding_free", 1), True, False, dry=False)
    assert e2e.skip_reason(e2e.Row("x", "", "hf", "padding_free", 1, attn="flex_attention"), True, True, dry=True)


def test_one_step_of_ours_in_fp8(docs):
    """--fp8: the block Linears in FP8 (on the CPU the exact simulation of kernels/reference.py)."""
    model, update = e2e.build_ours(LlamaConfig(**TINY), "cpu", fp8=True)
    assert all(layer.self_attn.fp8 and layer.mlp.fp8 for layer in model.layers)
    step = e2e.build_steps(e2e.Row("free", "", "ours", "padding_free", 1024), docs, 1)[0]
    loss, grad_norm = e2e.ours_step(model, update, step.batch)
    assert abs(loss.item() - np.log(VOCAB)) < 0.5 and grad_norm.item() > 0


def test_gpu_clocks_reads_the_samples_of_nvidia_smi(tmp_path, monkeypatch):
    """bench.common.GpuClocks on a stand-in nvidia-smi: medians of the whole samples, an "[N/A]" and a cut-off line
    left out; with no nvidia-smi at all, no samples and no error."""
    import os
    import time

    from bench.common import GpuClocks
    monkeypatch.setattr(GpuClocks, "bus_id", staticmethod(lambda: "0"))
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nprintf '1600, 1980, 690.5, 700.00\\n1700, 1980, 650.0, 700.00\\n"
                    "[N/A], 1980, 1.0, 700.00\\n1650, 19'\nexec sleep 30\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with GpuClocks() as clocks:
        time.sleep(0.5)
    assert clocks.medians() == (1700.0, 1980.0, 690.5, 700.0)
    assert "median 1,700 MHz" in str(clocks)
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with GpuClocks() as clocks:
        pass
    assert clocks.medians() is None and "no samples" in str(clocks)


def test_profile_step_idle_gaps():
    """bench/profile_step.py --gaps: a gap opens only once every kernel so far has ended (an overlapping kernel
    closes none), and is named by the kernel that ended last and the one that starts it; sums are per step."""
    from bench.profile_step import idle_gaps
    spans = [(0, 10, "_attn_fwd"), (15, 20, "nvjet_sm90_gemm"), (16, 30, "Memset (Device)"), (25, 28, "_attn_bwd_dq"),
             (40, 50, "_adamw_kernel"), (50, 55, "_adamw_kernel"), (61, 70, "nvjet_sm90_gemm")]
    by_kind, by_name = idle_gaps(spans, steps=2)
    assert by_kind == {("attention", "GEMM"): (0.0025, 0.5), ("other", "optimizer"): (0.005, 0.5),
                       ("optimizer", "GEMM"): (0.003, 0.5)}
    assert by_name[("Memset (Device)", "_adamw_kernel")] == (0.005, 0.5)


def test_profile_step_host_during_gaps(capsys):
    """--gaps names the host ops inside the gaps of the chosen kernel pairs: each op counts its overlap with them
    (nested ones too), ops outside every such gap count nothing; print_gaps reads a real profile's events."""
    from bench.profile_step import host_during_gaps, print_gaps
    spans = [(0, 10, "nvjet_a"), (40, 50, "nvjet_b"), (50, 60, "nvjet_a"), (70, 80, "nvjet_b"), (81, 90, "_adamw")]
    host = [(5, 45, "aten::addmm"), (12, 38, "cudaStreamSynchronize"), (1, 9, "aten::empty"),
            (60, 62, "cudaLaunchKernel"), (80, 81, "aten::add_"), (0, 90, "autograd::engine::evaluate_function")]
    found = host_during_gaps(spans, host, steps=2, pairs=[("nvjet_a", "nvjet_b")])
    assert found == {("nvjet_a", "nvjet_b"): {"aten::addmm": pytest.approx(0.015),
                                               "cudaStreamSynchronize": pytest.approx(0.013),
                                               "autograd::engine::evaluate_function": pytest.approx(0.02),
                                               "cudaLaunchKernel": pytest.approx(0.001)}}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(8, 8) @ torch.ones(8, 8)
    print_gaps(prof, steps=1)  # no GPU kernel here, so no gap: the tables print empty
    assert "the host during the 4 longest" in capsys.readouterr().out
