"""FP8 Linear layers (kernels/fp8.py): the Triton quantizers against kernels/reference.py (the same codes and scales,
bit for bit), fp8_linear and the fused GLU against the reference simulation and against fp32 math within the error
bound of e4m3, the weight cache against every optimizer, the model with fp8 on vs off, and train.py --fp8=True.

On the CPU the quantizers run in the Triton interpreter and the products in the reference's simulation of
torch._scaled_mm (so the Triton path equals the reference bit for bit); on a CUDA machine the same tests run the
compiled kernels and the real _scaled_mm (equal codes, products close), and the `gpu` tests add real sizes.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import kernels
from conftest import DEVICE, random_cu_seqlens, rel_err
from kernels import fp8, reference
from model import Llama, LlamaConfig
from optim import Update, make_optimizer
from test_train import TINY, corpus, losses, run  # noqa: F401  (corpus: the tiny corpus fixture)

U = 2.0**-4  # half an e4m3 code step, relative: 3 mantissa bits
FP32_SLACK = 2.0**-22  # the fp32 roundings of r = 1 / s and x * r (kernels/fp8.py)


def bits(codes):
    return codes.view(torch.uint8)


def assert_same_product(out, ref, what, tol=2e-3):
    """The Triton path's product against the reference's: bit for bit where both simulate _scaled_mm (the CPU),
    up to the order of the fp32 sum and the bf16 rounding after it on CUDA."""
    if out.is_cuda:
        assert rel_err(out, ref) < tol, (what, rel_err(out, ref))
    else:
        assert torch.equal(out, ref), what


def e4m3_values():
    """Every finite e4m3 value, ascending (-448 .. 448, one zero)."""
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return v[v.isfinite()].unique()


def hard_rows(C, dtype):
    """Rows that test the quantizer's corners, (15, C): ordinary, all zero, one huge outlier, tiny values, values
    beneath the fp32 normal range, exact ties between e4m3 codes (amax 448 makes the scale exactly 1), both zeros."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(15, C, generator=g)
    x[1] = 0
    x[2, C // 3] = 3e4  # one outlier: the rest of its row falls to subnormal codes or 0
    x[3] *= 1e-30
    x[4] = torch.randn(C, generator=g) * 1e-38  # fp32 subnormals in fp32 input (0 in bf16)
    values = e4m3_values()
    mids = (values[1:] + values[:-1]) / 2  # ties: round to the even code
    for r, v in ((5, mids), (6, mids * (1 + 2**-20)), (7, mids * (1 - 2**-20)), (8, values)):
        row = v[torch.randint(0, len(v), (C,), generator=g)]
        row[0] = 448.0  # the scale: 448 / 448 = 1 (the floor is far below)
        x[r] = row
    x[9] = -0.0
    x[10] = x[10] * 1e5
    x[11] = torch.where(torch.rand(C, generator=g) < 0.5, 0.0, x[11])
    x[12] = x[12].abs() * 1e-3 + 1.0  # a narrow range: all codes normal and close together
    x[13] = -x[13].abs()
    x[14] = 1e-12 * torch.randn(C, generator=g)  # about the floor of amax
    return x.to(dtype)


# --------------------------------------------------------------------------- quantizers: kernel == reference

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R, C", [(1, 16), (15, 48), (37, 80), (15, 5000)])  # 5000: two chunks of a row
def test_row_quantizer_matches_reference(dtype, R, C):
    x = torch.cat([hard_rows(C, dtype), torch.randn(max(R - 15, 0), C).to(dtype)])[:R] if R >= 15 else \
        torch.randn(R, C).to(dtype)
    x = x.to(DEVICE)
    q, s = fp8.quantize_rows(x)
    q_ref, s_ref = reference.fp8_quantize_rows(x)
    assert q.shape == (-(-R // 16) * 16, C) and s.shape == (q.shape[0],)
    assert torch.equal(bits(q[:R]), bits(q_ref)), (bits(q[:R]) != bits(q_ref)).nonzero()[:5]
    assert torch.equal(s[:R], s_ref)
    assert (bits(q[R:]) == 0).all()  # the padding rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R, C", [(1, 16), (15, 48), (37, 80), (200, 40)])  # 200: several row blocks
def test_column_quantizer_matches_reference(dtype, R, C):
    rows = torch.cat([hard_rows(R, dtype), torch.randn(max(C - 15, 0), R).to(dtype)])[:C] if C >= 15 else \
        torch.randn(C, R).to(dtype)
    x = rows.t().contiguous().to(DEVICE)  # (R, C): the hard cases are its columns now
    q, s = fp8.quantize_cols(x)
    q_ref, s_ref = reference.fp8_quantize_cols(x)
    assert q.shape == (C, -(-R // 16) * 16) and s.shape == (C,)
    assert torch.equal(bits(q[:, :R]), bits(q_ref)), (bits(q[:, :R]) != bits(q_ref)).nonzero()[:5]
    assert torch.equal(s, s_ref)
    assert (bits(q[:, R:]) == 0).all()  # the padding columns (tokens)


def test_quantizers_take_strided_rows():
    x = torch.randn(21, 100, device=DEVICE)[:, 10:58]  # row stride 100, 48 columns
    for ours, ref in ((fp8.quantize_rows, reference.fp8_quantize_rows),
                      (fp8.quantize_cols, reference.fp8_quantize_cols)):
        (q, s), (q_ref, s_ref) = ours(x), ref(x)
        n = q_ref.shape[1] if ours is fp8.quantize_cols else q_ref.shape[0]
        got = q[:, :n] if ours is fp8.quantize_cols else q[:n]
        assert torch.equal(bits(got), bits(q_ref)) and torch.equal(s[:len(s_ref)], s_ref)


def test_reference_rounds_to_nearest_even_with_saturation():
    """The oracle itself: torch's cast after the clamp is round-to-nearest-even onto the e4m3 grid."""
    values = e4m3_values().double()
    x = torch.cat([torch.randn(4000) * 100, torch.randn(4000) * 1e-2, (values[1:] + values[:-1]) / 2]).float()
    x[0] = 448.0
    q, s = reference.fp8_quantize_rows(x[None])
    assert s.item() == 1.0
    got = q.float()[0].double()
    dist = (x.double()[:, None] - values[None, :]).abs()
    nearest = dist.min(1).values
    assert torch.equal((got - x.double()).abs(), nearest)  # a nearest value ...
    ties = (dist == nearest[:, None]).sum(1) == 2
    codes = bits(q[0]).int()
    assert ties.sum() > 100 and (codes[ties] & 1 == 0).all()  # ... and the even one at a tie


def test_quantization_error_bound():
    """|x - q s| <= u |x| + 2^-10 s + 2^-22 |x| elementwise (kernels/fp8.py), and the scale puts amax on 448."""
    x = torch.cat([hard_rows(300, torch.float32), torch.randn(50, 300) * torch.logspace(-20, 20, 50)[:, None]])
    q, s = reference.fp8_quantize_rows(x)
    err = (x.double() - q.double() * s.double()[:, None]).abs()
    bound = (U + FP32_SLACK) * x.double().abs() + 2.0**-10 * s.double()[:, None]
    assert (err <= bound).all()
    amax = x.abs().amax(1)
    top = q.float().abs().amax(1)
    assert torch.equal(top[amax > 1e-12], torch.full_like(top[amax > 1e-12], 448.0))


# --------------------------------------------------------------------------- products

def linear_grads(fn, x, w, dy):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = fn(x, w)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    return y, dx, dw


@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                              (torch.bfloat16, torch.bfloat16)])
def test_fp8_linear_kernel_path_equals_the_simulation(x_dtype, w_dtype):
    """On the CPU the Triton module's fp8_linear (interpreter quantizers, simulated _scaled_mm) is the reference's
    bit for bit: the same codes, the same product."""
    x = torch.randn(3, 13, 80, device=DEVICE).to(x_dtype)  # 39 tokens: padded to 48 inside
    w = (torch.randn(48, 80, device=DEVICE) * 0.05).to(w_dtype)
    dy = torch.randn(3, 13, 48, device=DEVICE).to(torch.bfloat16)
    ours, ref = linear_grads(fp8.fp8_linear, x, w, dy), linear_grads(reference.fp8_linear, x, w, dy)
    for a, b, what in zip(ours, ref, ("y", "dx", "dW")):
        assert_same_product(a, b, what)
    y, dx, dw = ours
    assert y.dtype == dx.dtype == x_dtype and dw.dtype == w_dtype
    assert torch.equal(y, y.to(torch.bfloat16).to(y.dtype))  # bf16 values, as _scaled_mm makes them
    with torch.autocast(DEVICE, dtype=torch.bfloat16):  # the dtype F.linear would give, and the same values
        for fn in (fp8.fp8_linear, reference.fp8_linear):
            out = fn(x, w)
            assert out.dtype == torch.bfloat16
            assert_same_product(out.to(y.dtype), y if fn is fp8.fp8_linear else ref[0], "y under autocast")
    assert y.shape == (3, 13, 48) and dx.shape == x.shape and dw.shape == w.shape


def product_bound(a, b):
    """Elementwise bound on |fp8_mm(rows(a), rows(b)) - a b^T| for a (M, K), b (N, K) (kernels/fp8.py): with
    e_a = (u + 2^-22)|a| + 2^-10 s_a the bound of one quantized element and |a^| <= |a| + e_a,
        |a^ b^ - a b| <= e_a |b| + |a^| e_b     summed over K,
    plus the fp32 sum and the two scale products ((K + 2) 2^-24 of sum |a^||b^|) and the bf16 rounding of the result
    (half a step of 8 significant bits: 2^-8 of it)."""
    a, b = a.double(), b.double()
    s_a = reference.fp8_quantize_rows(a)[1].double()[:, None]
    s_b = reference.fp8_quantize_rows(b)[1].double()[:, None]
    e_a = (U + FP32_SLACK) * a.abs() + 2.0**-10 * s_a
    e_b = (U + FP32_SLACK) * b.abs() + 2.0**-10 * s_b
    quant = e_a @ b.abs().t() + (a.abs() + e_a) @ e_b.t()
    summed = (a.abs() + e_a) @ (b.abs() + e_b).t() * (a.shape[1] + 2) * 2.0**-24
    exact = a @ b.t()
    return exact, quant + summed + 2.0**-8 * (exact.abs() + quant + summed)


def test_fp8_products_within_the_e4m3_bound_of_fp32_math():
    """y, dx and dW of fp8_linear against fp64 math: every element within product_bound, and the relative
    Frobenius error near the ~3% that 3 mantissa bits give random data (kernels/fp8.py: ~sqrt(2) x 2.6% at
    most), where bf16 (8 bits) is at ~0.3%. The elementwise bound is ~(2u) sum |a||b|, loose by ~sqrt(K) against
    a sum of random-signed terms, which is why the typical error is the Frobenius one."""
    torch.manual_seed(0)
    M, K, N = 77, 96, 64
    x = torch.randn(M, K) * torch.logspace(-2, 2, M)[:, None]  # rows of very different sizes (per-token scales)
    w = torch.randn(N, K) * 0.02
    w[:, 5] *= 30  # an outlier input channel
    dy = torch.randn(M, N) * torch.logspace(-3, 0, M)[:, None]
    y, dx, dw = linear_grads(reference.fp8_linear, x, w, dy)
    for out, (a, b), what in ((y, (x, w), "y"), (dx, (dy, w.t()), "dx"), (dw, (dy.t(), x.t()), "dW")):
        exact, bound = product_bound(a, b)
        assert (out.double() - exact).abs().le(bound).all(), what
        assert 0.005 < rel_err(out, exact) < 0.05, (what, rel_err(out, exact))


def test_fp8_mm_simulates_torch_scaled_mm_on_cpu():
    """Where this torch has a CPU torch._scaled_mm with row-wise scales, the simulation agrees with it."""
    a, sa = reference.fp8_quantize_rows(torch.randn(40, 64))
    b, sb = reference.fp8_quantize_rows(torch.randn(32, 64))
    try:
        out = torch._scaled_mm(a, b.t(), scale_a=sa[:, None], scale_b=sb[None, :], out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"no CPU torch._scaled_mm with row-wise scales here: {e}")
    assert rel_err(reference.fp8_mm(a, sa, b, sb), out) < 2e-3


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_fused_glu_down_projection_in_fp8(activation):
    """kernels.glu(..., down, fp8=True): forward and the gradients of gate, up and down against the reference
    (h = act(g) * u in fp32 then the simulated FP8 product). The GLU kernel and torch round act(g) differently in
    the last fp32 bit, which can move a code of h by one step: close, not equal."""
    from kernels.swiglu import glu
    torch.manual_seed(0)
    T, F_, D = 37, 96, 48
    g, u = torch.randn(T, F_, device=DEVICE), torch.randn(T, F_, device=DEVICE)
    down = torch.randn(D, F_, device=DEVICE) * 0.05
    dout = torch.randn(T, D, device=DEVICE)
    results = []
    for fn in (glu, reference.glu):
        leaves = [t.clone().requires_grad_() for t in (g, u, down)]
        out = fn(leaves[0] * 1, leaves[1] * 1, activation, leaves[2], True)  # non-leaves, as in the model
        results.append([out, *torch.autograd.grad(out, leaves, dout)])
    for a, b, what in zip(*results, ("out", "dgate", "dup", "ddown")):
        assert rel_err(a, b) < 3e-3, (what, rel_err(a, b))
    exact = F.linear((F.silu(g) if activation == "silu" else F.gelu(g, approximate="tanh")) * u, down)
    assert rel_err(results[0][0], exact) < 0.05


# --------------------------------------------------------------------------- the weight cache

def count_weight_quantizations(monkeypatch, weight):
    calls = {"rows": 0, "cols": 0}
    for name in ("quantize_rows", "quantize_cols"):
        real = getattr(fp8, name)

        def spy(t, real=real, layout=name[-4:]):
            if t is weight:
                calls[layout] += 1
            return real(t)
        monkeypatch.setattr(fp8, name, spy)
    return calls


def test_weight_is_quantized_once_per_version(monkeypatch):
    w = torch.nn.Parameter(torch.randn(32, 48, device=DEVICE) * 0.1)
    calls = count_weight_quantizations(monkeypatch, w)
    x = torch.randn(20, 48, device=DEVICE, requires_grad=True)
    for _ in range(3):  # three micro-steps of one optimizer step: forward and backward each
        fp8.fp8_linear(x, w).float().sum().backward()
    assert calls == {"rows": 1, "cols": 1}
    opt = torch.optim.SGD([w], lr=0.1)
    opt.step()  # a new value: new codes, at the next use
    fp8.fp8_linear(x, w).float().sum().backward()
    assert calls == {"rows": 2, "cols": 2}
    assert torch.equal(bits(fp8.weight_codes(w, "rows")[0]), bits(reference.fp8_quantize_rows(w.detach())[0]))
    with torch.no_grad():
        w.mul_(2)  # any in-place write through torch
    fp8.fp8_linear(x, w)
    assert calls["rows"] == 3
    w.data = torch.randn(32, 48, device=DEVICE)  # swapped memory: a new data_ptr (the version counter may not move)
    y = fp8.fp8_linear(x, w)
    assert calls["rows"] == 4
    assert_same_product(y, reference.fp8_linear(x, w.detach()), "y")


@pytest.mark.parametrize("name, dtype, fused, in_backward, triton_path", [
    ("adamw", torch.float32, False, False, False), ("adamw", torch.float32, True, False, False),
    ("adamw_kahan", torch.bfloat16, False, False, False), ("adamw_kahan", torch.bfloat16, False, False, True),
    ("adamw_kahan", torch.float32, False, True, True), ("adamw_kahan", torch.bfloat16, False, True, False),
    ("adamw8bit", torch.bfloat16, False, False, False), ("adamw8bit", torch.bfloat16, False, True, True)])
def test_every_optimizer_step_makes_new_weight_codes(name, dtype, fused, in_backward, triton_path, monkeypatch):
    """Every optimizer of optim.py, stepped after backward or inside it, on the reference or the Triton path (in the
    interpreter), leaves codes that are made again at the next use: torch's fused AdamW, which does not bump the
    version counter, through the count of optimizer steps; our kernels, stepping inside backward where no
    optimizer.step() runs, through increment_version."""
    monkeypatch.setattr(kernels, "_use_triton", lambda x: triton_path)
    check_codes_follow_updates(name, dtype, fused, in_backward, DEVICE)


def check_codes_follow_updates(name, dtype, fused, in_backward, device):
    model = torch.nn.Linear(64, 64, bias=False, device=device).to(dtype)  # 4096 elements: AdamW8bit's 8-bit path
    update = Update(make_optimizer(name, model, 1e-3, (0.9, 0.95), 0.1, fused=fused), model.parameters(),
                    in_backward=in_backward)
    w = model.weight
    for _ in range(2):
        codes = fp8.weight_codes(w, "rows")
        before, version = w.detach().clone(), w._version
        model(torch.randn(8, 64, device=device).to(dtype)).float().sum().backward()
        update.clip_and_step()
        assert not torch.equal(w.detach(), before)
        new = fp8.weight_codes(w, "rows")
        assert new is not codes and torch.equal(bits(new[0]), bits(reference.fp8_quantize_rows(w.detach())[0]))
        if name != "adamw":  # ours: the version counter itself moves
            assert w._version != version


# --------------------------------------------------------------------------- the model

CFG = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96, vocab_size=97, max_seq_len=64)


def batch(T, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu = random_cu_seqlens(T, 24, generator=g)
    tokens = torch.randint(0, vocab, (T,), generator=g)
    labels = torch.randint(0, vocab, (T,), generator=g)
    labels[torch.rand(T, generator=g) < 0.2] = -100
    return tokens, labels, cu


def loss_and_grads(model, tokens, labels, cu):
    model.zero_grad()
    loss = model(tokens, cu, labels=labels)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def test_set_fp8_routes_every_block_linear_and_checks_dims(monkeypatch):
    model = Llama(LlamaConfig(**CFG))
    used = []
    real = kernels.fp8_linear
    monkeypatch.setattr(kernels, "fp8_linear", lambda x, w: used.append(w) or real(x, w))
    real_glu = reference.glu

    def glu(gate, up, activation, down, use_fp8):
        if use_fp8:
            used.append(down)
        return real_glu(gate, up, activation, down, use_fp8)
    monkeypatch.setattr(reference, "glu", glu)
    tokens, labels, cu = batch(50, CFG["vocab_size"])
    model(tokens, cu, labels=labels)
    assert used == []  # off by default
    model.set_fp8(True)
    model(tokens, cu, labels=labels)
    expected = [getattr(getattr(layer, part), proj).weight for layer in model.layers for part, proj in
                (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
                 ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))]
    assert sorted(map(id, used)) == sorted(map(id, expected))  # each block Linear once; lm_head not
    with pytest.raises(ValueError, match="ffn_dim=40"):
        Llama(LlamaConfig(**{**CFG, "ffn_dim": 40})).set_fp8(True)
    model.layers[0].self_attn.q_proj.register_forward_hook(lambda *a: None)
    with pytest.raises(RuntimeError, match="hooks would not run"):
        model(tokens, cu, labels=labels)


def test_model_fp8_on_vs_off_on_cpu():
    """The tiny model with fp8 on vs off, at init: the loss within 1e-3 (relative), every gradient within 15%
    (each product errs by ~3%, and they compound through the blocks; measured: loss 1.4e-4, gradients 8.3% at most,
    those of q_proj and k_proj, which are small at init: the attention is nearly uniform)."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**CFG))
    tokens, labels, cu = batch(90, CFG["vocab_size"])
    ref_loss, ref_grads = loss_and_grads(model, tokens, labels, cu)
    model.set_fp8(True)
    loss, grads = loss_and_grads(model, tokens, labels, cu)
    assert rel_err(loss, ref_loss) < 1e-3, (loss, ref_loss)
    for name, g in ref_grads.items():
        assert rel_err(grads[name], g) < 0.15, (name, rel_err(grads[name], g))


def test_model_fp8_trains_like_fp32():
    """25 AdamW steps on one batch (overfitting it, loss 4.6 -> ~0.03): at every step the fp8 model's loss is within
    3% of the initial loss of fp32's (measured: 1.9% at most, in the steep first steps; relative to the loss
    itself the curves drift apart by up to 9% near the end, where it is ~0.1 and the two runs take different
    paths: a pointwise relative bound would test chaos, not FP8)."""
    curves = []
    for on in (False, True):
        torch.manual_seed(0)
        model = Llama(LlamaConfig(**CFG))
        model.set_fp8(on)
        tokens, labels, cu = batch(96, CFG["vocab_size"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        curve = []
        for _ in range(25):
            loss = model(tokens, cu, labels=labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            curve.append(loss.item())
        curves.append(curve)
    ref, got = curves
    assert ref[-1] < 0.05 and got[-1] < 0.05  # both learn the batch
    assert max(abs(a - b) for a, b in zip(got, ref)) < 0.03 * ref[0], list(zip(got, ref))


def test_model_fp8_kernel_path_matches_reference_path(monkeypatch):
    """The whole model with fp8 through the Triton kernels (interpreter) vs the reference ops: the same FP8
    products, but RMSNorm, RoPE, attention and the GLU round differently in fp32's last bit, which can move a
    code by a step: close, not equal (measured: the same loss, gradients within 9e-5)."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**CFG)).to(DEVICE)
    model.set_fp8(True)
    tokens, labels, cu = (t.to(DEVICE) for t in batch(53, CFG["vocab_size"]))
    monkeypatch.setattr(kernels, "_use_triton", lambda x: False)
    ref_loss, ref_grads = loss_and_grads(copy.deepcopy(model), tokens, labels, cu)
    monkeypatch.setattr(kernels, "_use_triton", lambda x: True)
    loss, grads = loss_and_grads(model, tokens, labels, cu)
    assert rel_err(loss, ref_loss) < 1e-4
    for name, g in ref_grads.items():  # (on CUDA _scaled_mm's own sums add their bf16 rounding differences)
        assert rel_err(grads[name], g) < (1e-2 if DEVICE == "cpu" else 5e-2), (name, rel_err(grads[name], g))


def test_train_py_fp8_on_the_cpu(corpus, tmp_path):  # noqa: F811
    """train.py --fp8=True runs the simulation on the CPU (and says so), learns, and resumes exactly."""
    common = TINY + [f"--data_dir={corpus}", "--max_steps=6", "--eval_interval=6", "--learning_rate=1e-2", "--fp8=True",
                     "--device=cpu"]
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    out = run("train.py", *common, f"--out_dir={full}").stdout
    assert "fp8 on the CPU" in out
    assert losses(full)[6] < losses(full)[1] - 0.3
    run("train.py", *common, f"--out_dir={part}", "--stop_at_step=3")
    run("train.py", *common, f"--out_dir={part}", "--init_from=resume")
    assert losses(part) == losses(full)
    proc = run("train.py", *common, f"--out_dir={tmp_path / 'odd'}", "--ffn_dim=40", check=False)
    assert proc.returncode != 0 and "ffn_dim=40 not a multiple of 16" in proc.stderr


def test_bench_fp8_measures_one_shape():
    """bench/fp8.py's measurement of one shape, with a stand-in timer (the timing itself needs the GPU): every row
    runs, and the errors are FP8's and bf16's."""
    from bench import fp8 as bench
    calls = []
    times, quant, errors = bench.measure(40, 64, 48, DEVICE, timer=lambda fn: calls.append(fn()) or 1.0)
    assert list(times) == ["bf16", "fp8", "fp8 cached", "fp8 gemms"] and len(quant) == 4 and len(calls) == 8
    for fp8_err, bf16_err, between in errors:  # y, dx, dW
        assert 0.01 < fp8_err < 0.06 and bf16_err < 0.005 and abs(between - fp8_err) < 0.01


def test_fp8_numerics_records_every_product():
    """bench/fp8_numerics.py's measurement on a tiny model and batch: seven Linears per block, three products each,
    bf16 far below FP8, and the model left as it was (fp8 off, no gradients)."""
    from types import SimpleNamespace

    from bench import fp8_numerics
    model = Llama(LlamaConfig(**CFG))
    tokens, labels, cu = batch(64, CFG["vocab_size"])
    b = SimpleNamespace(tokens=tokens, labels=labels, cu_seqlens=cu, max_seqlen=int((cu[1:] - cu[:-1]).max()),
                        positions=None)
    errors = fp8_numerics.product_errors(model, b)
    assert {name for name, _, _ in errors} == set(fp8_numerics.NAMES)
    for (name, product, kind), errs in errors.items():
        assert len(errs) == CFG["n_layers"]
        if kind == "fp8":
            assert max(errors[(name, product, "bf16")]) < 0.01 < min(errs) < max(errs) < 0.1, (name, product, errs)
    assert not model.layers[0].mlp.fp8 and all(p.grad is None for p in model.parameters())


# --------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("M, K, N", [(8192, 4096, 1024), (1000, 4096, 14336), (777, 14336, 4096)])
def test_gpu_fp8_linear_matches_the_simulation(M, K, N):
    """torch._scaled_mm and our compiled quantizers against the reference's simulation of the same products: the
    codes and scales bit for bit, the products up to _scaled_mm's own order of the fp32 sum (then bf16 rounding)."""
    torch.manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(N, K, device="cuda") * 0.02).to(torch.bfloat16)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    for t in (x, w, dy):
        q, s = fp8.quantize_rows(t)
        q_ref, s_ref = reference.fp8_quantize_rows(t)
        assert torch.equal(bits(q[:len(t)]), bits(q_ref)) and torch.equal(s[:len(t)], s_ref)
        q, s = fp8.quantize_cols(t)
        q_ref, s_ref = reference.fp8_quantize_cols(t)
        assert torch.equal(bits(q[:, :len(t)]), bits(q_ref)) and torch.equal(s, s_ref)
    ours, ref = linear_grads(fp8.fp8_linear, x, w, dy), linear_grads(reference.fp8_linear, x, w, dy)
    for a, b, what in zip(ours, ref, ("y", "dx", "dW")):
        assert a.dtype == b.dtype and rel_err(a, b) < 2e-3, (what, rel_err(a, b))


@pytest.mark.gpu
def test_gpu_model_fp8_matches_the_simulation_and_bf16(monkeypatch):
    """A small model on CUDA with fp8 (Triton quantizers, _scaled_mm) against the same model through the reference
    ops (NANOLLAMA_REFERENCE: the simulated products) and against bf16, under autocast as train.py runs it."""
    cfg = LlamaConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512, vocab_size=301,
                      max_seq_len=128)
    torch.manual_seed(0)
    model = Llama(cfg).cuda()
    tokens, labels, cu = (t.cuda() for t in batch(301, cfg.vocab_size))

    def run_model(fp8_on, use_triton):
        monkeypatch.setattr(kernels, "_use_triton", lambda x: use_triton)
        m = copy.deepcopy(model)
        m.set_fp8(fp8_on)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return loss_and_grads(m, tokens, labels, cu)

    (loss, grads), (sim_loss, sim_grads), (bf16_loss, bf16_grads) = (
        run_model(True, True), run_model(True, False), run_model(False, True))
    assert rel_err(loss, sim_loss) < 1e-3 and rel_err(loss, bf16_loss) < 1e-2
    for name, g in sim_grads.items():
        assert rel_err(grads[name], g) < 5e-2, (name, rel_err(grads[name], g))
        assert rel_err(grads[name], bf16_grads[name]) < 0.15, (name, rel_err(grads[name], bf16_grads[name]))
