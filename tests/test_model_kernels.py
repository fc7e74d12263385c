"""The whole model through the Triton kernels equals the whole model through the reference ops: loss, logits and
the gradient of every weight. This is where the kernels' in-place tricks (RoPE rotating q/k and their grads in
place, SwiGLU writing dg/du over its inputs) meet a real autograd graph. On the CPU the kernels run in the Triton
interpreter (conftest sets TRITON_INTERPRET=1); on CUDA compiled."""
import copy

import pytest
import torch

import kernels
from conftest import DEVICE, random_cu_seqlens, rel_err
from model import Llama, LlamaConfig


def loss_and_grads(model, batch, use_triton, monkeypatch):
    monkeypatch.setattr(kernels, "_use_triton", lambda x: use_triton)
    tokens, labels, cu, max_len = batch
    model.zero_grad()
    loss_sum, n = model(tokens, cu, max_len, labels=labels, reduction="sum")
    (loss_sum / n).backward()
    logits = model(tokens, cu, max_len)
    return loss_sum.detach(), logits.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("activation, tied, n_kv_heads, checkpoint_layers", [("silu", False, 2, 0),
                                                                             ("gelu_tanh", True, 4, 1)])
def test_model_with_kernels_matches_reference(activation, tied, n_kv_heads, checkpoint_layers, monkeypatch):
    cfg = LlamaConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, head_dim=64, ffn_dim=200,
                      vocab_size=301, max_seq_len=64, activation=activation, tie_embeddings=tied)
    model = Llama(cfg).to(DEVICE)
    T = 53
    cu = random_cu_seqlens(T, 20)
    tokens = torch.randint(0, cfg.vocab_size, (T,))
    labels = torch.randint(0, cfg.vocab_size, (T,))
    labels[torch.rand(T) < 0.2] = -100
    max_len = int((cu[1:] - cu[:-1]).max())
    batch = tuple(t.to(DEVICE) for t in (tokens, labels, cu)) + (max_len,)
    ref = loss_and_grads(copy.deepcopy(model), batch, False, monkeypatch)
    model.checkpoint_layers = checkpoint_layers  # the kernels' in-place tricks under recomputation too
    out = loss_and_grads(model, batch, True, monkeypatch)  # on the CPU: Triton's interpreter
    assert rel_err(out[0], ref[0]) < 1e-5
    assert rel_err(out[1], ref[1]) < 1e-5
    for name, g in ref[2].items():
        assert rel_err(out[2][name], g) < 1e-5, name


@pytest.mark.gpu
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "autocast"])
def test_gpu_compiled_model_matches_eager(amp):
    """train.py --compile=True: torch.compile around the model (our ops run eagerly inside it, graph breaks,
    kernels/__init__.py) gives the eager model's loss and gradients; also under bf16 autocast (train.py's default
    on CUDA: model.MasterLinears traced by dynamo), where inductor's fused casts may round elsewhere: bf16's bound."""
    cfg = LlamaConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=300, vocab_size=301,
                      max_seq_len=128)
    model = Llama(cfg).cuda()
    T = 201
    cu = random_cu_seqlens(T, 60).cuda()
    tokens, labels = (torch.randint(0, cfg.vocab_size, (T,), device="cuda") for _ in range(2))
    max_len = int((cu[1:] - cu[:-1]).max())
    results = []
    for run in (copy.deepcopy(model), torch.compile(model)):
        model.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = run(tokens, cu, max_len, labels=labels)
        loss.backward()
        source = run if isinstance(run, Llama) else model  # the compiled wrapper shares model's parameters
        results.append((loss.detach(), {k: p.grad.clone() for k, p in source.named_parameters()}))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    bound = 2e-2 if amp else 1e-5
    assert rel_err(compiled_loss, eager_loss) < bound
    for name, g in eager_grads.items():
        assert rel_err(compiled_grads[name], g) < bound, name
