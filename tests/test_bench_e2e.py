"""bench/e2e.py on the CPU: its documents and batches (every row type must train on the same documents, with the
targets train.py would give them), and one training step of each kind of row with a tiny model. The timing itself
runs only on the GPU (python bench/e2e.py)."""
import numpy as np
import pytest
import torch

from bench import e2e
from conftest import rel_err
from data.loader import IGNORE
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
        assert (batch.labels[a + n - 1:b] == IGNORE).all()  # the last real token, then the pads
        assert (batch.tokens[a + n:b] == 0).all()
    assert batch.max_seqlen == int((cu[1:] - cu[:-1]).max())
    assert batch.n_loss_tokens == int((batch.labels != IGNORE).sum()) == int(lengths.sum()) - len(lengths)


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
        assert (steps[i - 1].batch.labels[-1] == IGNORE) and (steps[i].batch.positions[0] == 0)
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
        assert torch.equal(hf["labels"][:, 1:], ours[:, :-1]) and (ours[:, -1] == IGNORE).all()
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
    assert keys == {"1b": ["free", "packed", "padded", "hf", "liger", "liger32"],
                    "8b": ["free", "packed", "padded", "hf", "liger", "long"]}
    order = e2e.run_order(rows)
    impls = [r.impl for _, r in order]
    assert sorted(order, key=id) == sorted(rows, key=id)
    assert "liger" not in impls[:impls.index("liger")] and set(impls[impls.index("liger"):]) == {"liger"}
    eight = {r.key: r for m, r in rows if m == "8b"}
    assert eight["free"].size == 8192 and eight["free"].checkpoint == 4 and eight["long"].checkpoint == 32


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
    model, update = e2e.build_ours(LlamaConfig(**TINY), "cpu", bf16_kahan=True, checkpoint_layers=1)
    assert isinstance(update.optimizer, e2e.optim.AdamWKahan) and update.in_backward
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    step = e2e.build_steps(e2e.Row("packed", "", "ours", "packed", 1024), docs, 1)[0]
    before = [p.detach().clone() for p in model.parameters()]
    loss, grad_norm = e2e.ours_step(model, update, step.batch)
    assert np.isfinite(loss.item()) and grad_norm.item() > 0  # the norm the hooks summed up
    assert all(p.grad is None for p in model.parameters())  # each gradient freed once used
    assert sum(not torch.equal(a, p) for a, p in zip(before, model.parameters())) > len(before) // 2


def test_hf_step_trains_and_sees_our_targets(docs):
    pytest.importorskip("transformers")
    cfg = LlamaConfig(**TINY)
    hf, optimizer = e2e.build_hf(cfg, "cpu")
    assert hf.dtype == torch.bfloat16 and hf.training and hf.config._attn_implementation == "sdpa"
    step = e2e.build_steps(e2e.Row("padded", "", "hf", "padded", 8), docs, 1)[0]
    inputs = e2e.hf_inputs(step)
    # with our weights (in fp32), HF's loss on its padded (B, L) batch is ours on the same batch: same targets
    ours, _ = e2e.build_ours(cfg, "cpu")
    hf.float().load_state_dict({("" if n == "lm_head.weight" else "model.") + n: t
                                for n, t in ours.state_dict().items()}, strict=True)
    with torch.no_grad():
        b = step.batch
        ref = ours(b.tokens, b.cu_seqlens, b.max_seqlen, b.positions, b.labels)
        assert rel_err(hf(**inputs).loss, ref) < 1e-5
    hf.to(torch.bfloat16)
    before = [p.detach().clone() for p in hf.parameters()]
    loss = e2e.hf_step(hf, optimizer, inputs)
    assert abs(loss.item() - np.log(VOCAB)) < 0.5
    assert all(p.grad is None for p in hf.parameters())
    # every matrix moved (a norm weight of 1 does not at this lr: bf16 weights round 1 + 3e-4 back to 1)
    assert all(not torch.equal(a, p) for a, p in zip(before, hf.parameters()) if p.dim() == 2)


def test_one_step_of_ours_in_fp8(docs):
    """--fp8: the block Linears in FP8 (on the CPU the exact simulation of kernels/reference.py)."""
    model, update = e2e.build_ours(LlamaConfig(**TINY), "cpu", fp8=True)
    assert all(layer.self_attn.fp8 and layer.mlp.fp8 for layer in model.layers)
    step = e2e.build_steps(e2e.Row("free", "", "ours", "padding_free", 1024), docs, 1)[0]
    loss, grad_norm = e2e.ours_step(model, update, step.batch)
    assert abs(loss.item() - np.log(VOCAB)) < 0.5 and grad_norm.item() > 0
