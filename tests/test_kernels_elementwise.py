"""RMSNorm (alone and fused with the residual add), SwiGLU/GeGLU and RoPE Triton kernels against kernels/reference.py
(autograd in fp64), and the in-place contract of kernels/__init__.py checked on both paths for every op.

On the CPU the kernels run in the Triton interpreter at small odd sizes; the `gpu` tests repeat them compiled
at Llama-3-8B sizes, plus a SwiGLU call past 2^31 elements.
"""
import pytest
import torch

from conftest import DEVICE, random_cu_seqlens, rel_err
from kernels import reference
from kernels import rmsnorm as rmsnorm_module
from kernels import swiglu as swiglu_module
from kernels.adamw import adamw_step
from kernels.attention import attention
from kernels.cross_entropy import linear_cross_entropy
from kernels.rmsnorm import add_rms_norm, rms_norm
from kernels.rope import apply_rope
from kernels.swiglu import glu

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}  # ~5x the unit roundoff of bf16 / fp16

# sigmoid(-large) = 1 / (1 + exp(large)) overflows to 1 / inf = 0 in the interpreter's numpy: correct, not noise
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Float tensors from torch.empty / empty_like start as NaN, so an element a kernel never writes shows
    up as NaN in the output (rel_err then returns inf)."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan(t):
        if t.is_floating_point():
            with torch.no_grad():
                t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: nan(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: nan(empty_like(*a, **kw)))


def fp64_leaves(*tensors):
    return [t.detach().double().requires_grad_() for t in tensors]


def assert_close(out, ref, dtype, what):
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"{what}: rel err {err:.2e} >= {TOL[dtype]:.0e}"


# ----------------------------------------------------------------------------------------------- RMSNorm

@pytest.fixture
def rows_split_over_programs(monkeypatch):
    """RMSNorm's backward over at most 3 programs of several rows each (the last one's share may be shorter), each
    with its partial dw row: the split the GPU makes from 2 * SMs rows on, at the small sizes of these tests."""
    real = rmsnorm_module._backward_programs
    monkeypatch.setattr(rmsnorm_module, "_backward_programs", lambda n_rows, device: min(real(n_rows, device), 3))


def check_rms_norm(shape, dtype, device):
    """Forward, dx and dw of rms_norm against the fp64 reference."""
    H = shape[-1]
    x = torch.randn(*shape, dtype=dtype, device=device).requires_grad_()
    w = (1 + 0.5 * torch.randn(H, device=device)).to(dtype).requires_grad_()
    y = rms_norm(x, w, 1e-5)
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    x64, w64 = fp64_leaves(x, w)
    y64 = reference.rms_norm(x64, w64, 1e-5)
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy.double())
    assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype
    for out, ref, what in ((y, y64, "y"), (dx, dx64, "dx"), (dw, dw64, "dw")):
        assert_close(out, ref, dtype, what)


@pytest.mark.usefixtures("rows_split_over_programs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H", [77, 1000])
def test_rms_norm_matches_reference(dtype, H):
    check_rms_norm((3, 13, H), dtype, DEVICE)


@pytest.mark.usefixtures("rows_split_over_programs")
def test_rms_norm_strided_rows_and_expanded_grad():
    """x is a column slice (row stride > H); y.sum(0) hands backward an expanded dy (row stride 0)."""
    H = 77
    x = torch.randn(29, H + 10, device=DEVICE)[:, :H].requires_grad_()
    w = torch.randn(H, device=DEVICE).requires_grad_()
    y = rms_norm(x, w, 1e-6)
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), dy)

    x64, w64 = fp64_leaves(x, w)
    dx64, dw64 = torch.autograd.grad(reference.rms_norm(x64, w64, 1e-6), (x64, w64), dy.double())
    assert_close(y, reference.rms_norm(x64, w64, 1e-6), torch.float32, "y")
    assert_close(dx, dx64, torch.float32, "dx")
    assert_close(dw, dw64, torch.float32, "dw")

    r = torch.randn(H, device=DEVICE)
    x.grad = x64.grad = None
    (rms_norm(x, w, 1e-6).sum(0) * r).sum().backward()
    (reference.rms_norm(x64, w64, 1e-6).sum(0) * r).sum().backward()
    assert_close(x.grad, x64.grad, torch.float32, "dx from an expanded dy")


def check_add_rms_norm(shape, dtype, device, delta_dtype=None, h_used=True):
    """h, y and the gradients of x, delta, w of add_rms_norm against the fp64 reference; h exactly x + delta.
    delta_dtype bf16 with an fp32 x: the stream under autocast over fp32 weights (the kernel writes dh in both
    dtypes); the other way round; fp16 with bf16, both narrower than h. h_used=False: the final norm, where only y
    reaches the loss (backward gets no dh_out)."""
    H = shape[-1]
    x = torch.randn(*shape, dtype=dtype, device=device).requires_grad_()
    delta = (0.5 * torch.randn(*shape, device=device)).to(delta_dtype or dtype).requires_grad_()
    w = (1 + 0.5 * torch.randn(H, device=device)).to(dtype).requires_grad_()
    h, y = add_rms_norm(x, delta, w, 1e-5)
    h_dtype = torch.promote_types(dtype, delta.dtype)
    assert h.dtype == y.dtype == h_dtype
    if h_dtype == torch.float32 or device == "cuda":  # (the interpreter rounds fp32 to bf16 towards 0, not nearest)
        assert torch.equal(h, x + delta)
    outs = (h, y) if h_used else (y,)
    grads = tuple(torch.randn_like(t) for t in outs)
    dx, dd, dw = torch.autograd.grad(outs, (x, delta, w), grads)
    x64, d64, w64 = fp64_leaves(x, delta, w)
    outs64 = reference.add_rms_norm(x64, d64, w64, 1e-5)
    dx64, dd64, dw64 = torch.autograd.grad(outs64[2 - len(outs):], (x64, d64, w64), [g.double() for g in grads])
    assert (dx.dtype, dd.dtype, dw.dtype) == (dtype, delta.dtype, dtype)
    for out, ref, what in ((h, outs64[0], "h"), (y, outs64[1], "y"), (dx, dx64, "dx"), (dd, dd64, "ddelta"),
                           (dw, dw64, "dw")):
        assert_close(out, ref, {"ddelta": delta.dtype, "h": h_dtype, "y": h_dtype}.get(what, dtype), what)


@pytest.mark.parametrize("dtype, delta_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                                (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                (torch.float16, torch.bfloat16)])
@pytest.mark.parametrize("H", [77, 1000])
@pytest.mark.parametrize("h_used", [True, False])
@pytest.mark.usefixtures("rows_split_over_programs")
def test_add_rms_norm_matches_reference(dtype, delta_dtype, H, h_used):
    check_add_rms_norm((3, 13, H), dtype, DEVICE, delta_dtype, h_used)


@pytest.mark.usefixtures("rows_split_over_programs")
def test_add_rms_norm_strided_rows_and_expanded_grads():
    """x and delta are column slices (row strides > H); h.sum(0) and y.sum(0) hand backward expanded dh_out, dy."""
    H = 77
    x = torch.randn(29, H + 10, device=DEVICE)[:, :H].requires_grad_()
    delta = torch.randn(29, H + 3, device=DEVICE)[:, 3:].requires_grad_()
    w = torch.randn(H, device=DEVICE).requires_grad_()
    r, s = torch.randn(H, device=DEVICE), torch.randn(H, device=DEVICE)

    def loss(h, y):
        return (h.sum(0) * r).sum() + (y.sum(0) * s).sum()

    loss(*add_rms_norm(x, delta, w, 1e-6)).backward()
    x64, d64, w64 = fp64_leaves(x, delta, w)
    loss(*reference.add_rms_norm(x64, d64, w64, 1e-6)).backward()
    for t, t64, what in ((x, x64, "dx"), (delta, d64, "ddelta"), (w, w64, "dw")):
        assert_close(t.grad, t64.grad, torch.float32, what)


# ------------------------------------------------------------------------------------------- SwiGLU/GeGLU

@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("F", [77, 1000])
def test_glu_matches_reference(activation, dtype, F):
    """Leaf inputs (user data): backward must leave them untouched and allocate the gradients."""
    g = (2 * torch.randn(3, 13, F, device=DEVICE)).to(dtype).requires_grad_()
    u = torch.randn(3, 13, F, dtype=dtype, device=DEVICE).requires_grad_()
    g_before, u_before = g.detach().clone(), u.detach().clone()
    h = glu(g, u, activation)
    dh = torch.randn_like(h)
    dg, du = torch.autograd.grad(h, (g, u), dh)

    g64, u64 = fp64_leaves(g, u)
    h64 = reference.glu(g64, u64, activation)
    dg64, du64 = torch.autograd.grad(h64, (g64, u64), dh.double())
    assert h.dtype == dtype
    assert_close(h, h64, dtype, "h")
    assert_close(dg, dg64, dtype, "dg")
    assert_close(du, du64, dtype, "du")
    assert torch.equal(g, g_before) and torch.equal(u, u_before), "leaf inputs were overwritten"


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_glu_overwrites_chunks_of_a_fused_projection(activation):
    """The model's case: gate and up are the two halves of one (T, 2F) projection output. Backward writes
    dg, du over them, and the gradient still reaches the projection's input and weight correctly. F > 1024:
    each row is split over two programs."""
    T, C, F = 7, 19, 1100
    x = torch.randn(T, C, device=DEVICE, requires_grad=True)
    w = torch.randn(C, 2 * F, device=DEVICE, requires_grad=True)
    g, u = (x @ w).chunk(2, dim=-1)  # strided views, row stride 2F
    h = glu(g, u, activation)
    dh = torch.randn_like(h)
    dx, dw = torch.autograd.grad(h, (x, w), dh)

    x64, w64 = fp64_leaves(x, w)
    g64, u64 = (x64 @ w64).chunk(2, dim=-1)
    h64 = reference.glu(g64, u64, activation)
    dx64, dw64, dg64, du64 = torch.autograd.grad(h64, (x64, w64, g64, u64), dh.double())
    assert_close(h, h64, torch.float32, "h")
    assert_close(dx, dx64, torch.float32, "dx")
    assert_close(dw, dw64, torch.float32, "dw")
    # In place: the memory of g and u now holds their gradients. (detach: autograd, seeing the chunks of a
    # split modified, would refuse to use them as its views again; we only read the memory.)
    assert_close(g.detach(), dg64, torch.float32, "dg in g's memory")
    assert_close(u.detach(), du64, torch.float32, "du in u's memory")


def check_glu_with_down(T, F, D, dtype, activation, down_dtype):
    """glu(..., down=W): out = glu(g, u) @ W^T, with g and u the two halves of one projection output (the
    in-place backward path) and W possibly fp32 under bf16 activations (fp32 master weights) or bf16 under fp32:
    forward and the gradients of the projection output and of W against the fp64 reference."""
    x = (1.5 * torch.randn(T, 2 * F, device=DEVICE)).to(dtype).requires_grad_()
    w = (torch.randn(D, F, device=DEVICE) / F**0.5).to(down_dtype).requires_grad_()
    g, u = x.clone().chunk(2, dim=-1)
    out = glu(g, u, activation, down=w)
    dout = torch.randn_like(out)
    dx, dw = torch.autograd.grad(out, (x, w), dout)
    x64, w64 = fp64_leaves(x, w)
    out64 = reference.glu(*x64.chunk(2, dim=-1), activation, down=w64)
    dx64, dw64 = torch.autograd.grad(out64, (x64, w64), dout.double())
    assert out.dtype == dtype and dw.dtype == down_dtype
    assert_close(out, out64, dtype, "out")
    assert_close(dx, dx64, dtype, "d(gate, up)")
    assert_close(dw, dw64, max(dtype, down_dtype, key=TOL.get), "d(down)")  # in W's dtype: the coarser bound


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype, down_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_glu_with_fused_down_projection(activation, dtype, down_dtype):
    check_glu_with_down(37, 1030, 19, dtype, activation, down_dtype)


def test_glu_with_frozen_down_projection():
    """down without a gradient (frozen): backward skips dW_down and still gets d(gate, up) right."""
    x = torch.randn(29, 2 * 70, device=DEVICE, requires_grad=True)
    w = torch.randn(11, 70, device=DEVICE)
    g, u = x.clone().chunk(2, dim=-1)
    (dx,) = torch.autograd.grad(glu(g, u, "silu", down=w), x, torch.ones(29, 11, device=DEVICE))
    x64 = fp64_leaves(x)[0]
    (dx64,) = torch.autograd.grad(reference.glu(*x64.chunk(2, dim=-1), "silu", down=w.double()), x64,
                                  torch.ones(29, 11, dtype=torch.float64, device=DEVICE))
    assert_close(dx, dx64, torch.float32, "d(gate, up)")


def test_glu_stale_saved_input_fails_loudly():
    """An op that saved g before glu's backward overwrote it must raise, not use a gradient as g."""
    g = torch.randn(5, 33, device=DEVICE, requires_grad=True).clone()
    u = torch.randn(5, 33, device=DEVICE, requires_grad=True).clone()
    z = (g * g).sum()  # saves g; created first, so its backward runs after glu's
    h = glu(g, u)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (z + h.sum()).backward()


def test_glu_int64_offsets(monkeypatch):
    """The LONG_INDEXING path (taken past 2^31 elements), forced at a small size."""
    monkeypatch.setattr(swiglu_module, "_needs_int64", lambda *views: True)
    g = torch.randn(3, 2100, device=DEVICE, requires_grad=True)
    u = torch.randn(3, 2100, device=DEVICE, requires_grad=True)
    h = glu(g, u, "gelu_tanh")
    dh = torch.randn_like(h)
    dg, du = torch.autograd.grad(h, (g, u), dh)
    g64, u64 = fp64_leaves(g, u)
    h64 = reference.glu(g64, u64, "gelu_tanh")
    dg64, du64 = torch.autograd.grad(h64, (g64, u64), dh.double())
    for out, ref, what in ((h, h64, "h"), (dg, dg64, "dg"), (du, du64, "du")):
        assert_close(out, ref, torch.float32, what)


# -------------------------------------------------------------------------------------------------- RoPE

def packed_positions(T, max_len, device=DEVICE):
    """Positions restarting at 0 in each document of a random packing, ending in two documents of length 1."""
    cu = random_cu_seqlens(T - 2, max_len).long()
    doc_start = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])
    positions = torch.cat([torch.arange(T - 2) - doc_start, torch.zeros(2, dtype=torch.long)])
    return positions.to(torch.int32).to(device)


def fused_qkv(T, n_q, n_kv, D, dtype, device=DEVICE):
    """q, k, v as head views of one (T, (n_q + 2 n_kv) D) activation, as a fused projection gives them."""
    leaf = torch.randn(T, (n_q + 2 * n_kv) * D, dtype=dtype, device=device, requires_grad=True)
    qkv = leaf.clone()  # a non-leaf activation, like the projection's output
    q, k, v = qkv.split([n_q * D, n_kv * D, n_kv * D], dim=-1)
    return leaf, qkv, q.view(T, n_q, D), k.view(T, n_kv, D), v.view(T, n_kv, D)


def rope_tables(D, max_positions, theta, device=DEVICE):
    return [t.to(device) for t in reference.rope_cache(D, max_positions, theta)]


def check_rope(T, n_q, n_kv, D, dtype, device=DEVICE, max_doc=9):
    positions = packed_positions(T, max_doc, device)
    cos, sin = rope_tables(D, max_doc + 3, 500000.0, device)
    leaf, qkv, q, k, v = fused_qkv(T, n_q, n_kv, D, dtype, device)
    v_before = v.detach().clone()
    q2, k2 = apply_rope(q, k, cos, sin, positions)
    assert q2.data_ptr() == q.data_ptr() and k2.data_ptr() == k.data_ptr(), "rope must rotate in place"
    assert q2.stride() == q.stride() and k2.stride() == k.stride()
    assert torch.equal(v, v_before), "rope wrote outside q and k"

    dq, dk, dv = torch.randn_like(q2), torch.randn_like(k2), torch.randn_like(v)
    dq_in, dk_in = dq.clone(), dk.clone()
    (dleaf,) = torch.autograd.grad((q2, k2, v), leaf, (dq, dk, dv))

    leaf64 = fp64_leaves(leaf)[0]
    q64, k64, v64 = leaf64.split([n_q * D, n_kv * D, n_kv * D], dim=-1)
    q64, k64 = reference.apply_rope(q64.view(T, n_q, D), k64.view(T, n_kv, D), cos, sin, positions)
    v64 = v64.view(T, n_kv, D)
    (dleaf64,) = torch.autograd.grad((q64, k64, v64), leaf64, (dq_in.double(), dk_in.double(), dv.double()))
    assert_close(q2, q64, dtype, "q")
    assert_close(k2, k64, dtype, "k")
    assert_close(dleaf, dleaf64, dtype, "d(qkv)")
    # The incoming grads themselves were rotated (backward made no new buffer for them).
    dq64, dk64, _ = dleaf64.split([n_q * D, n_kv * D, n_kv * D], dim=-1)
    assert_close(dq, dq64.view(T, n_q, D), dtype, "dq rotated in place")
    assert_close(dk, dk64.view(T, n_kv, D), dtype, "dk rotated in place")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128])
def test_rope_matches_reference(dtype, D):
    check_rope(T=37, n_q=4, n_kv=2, D=D, dtype=dtype)


def test_rope_grads_that_cannot_be_rotated_in_place():
    """out.sum() hands backward stride-0 grads; q + k (Hq == Hkv) hands it one tensor as both dq and dk.
    Both must be copied first, and the gradients must still be right."""
    T, H, D = 19, 2, 64
    positions = packed_positions(T, 5)
    cos, sin = rope_tables(D, 8, 10000.0)
    for loss_fn in (lambda q, k: q.sum() + k.sum(), lambda q, k: ((q + k) * q.detach()).sum()):
        q_leaf = torch.randn(T, H, D, device=DEVICE, requires_grad=True)
        k_leaf = torch.randn(T, H, D, device=DEVICE, requires_grad=True)
        q2, k2 = apply_rope(q_leaf.clone(), k_leaf.clone(), cos, sin, positions)
        loss_fn(q2, k2).backward()
        q64, k64 = fp64_leaves(q_leaf, k_leaf)
        loss_fn(*reference.apply_rope(q64, k64, cos, sin, positions)).backward()
        assert_close(q_leaf.grad, q64.grad, torch.float32, "dq")
        assert_close(k_leaf.grad, k64.grad, torch.float32, "dk")


# ------------------------------------------------ the in-place contract of kernels/__init__.py, on both paths

TRITON_OPS = dict(rms_norm=rms_norm, add_rms_norm=add_rms_norm, glu=glu, apply_rope=apply_rope, attention=attention,
                  linear_cross_entropy=linear_cross_entropy, adamw_step=adamw_step)


def op(path, name):
    """The Triton twin (run by the interpreter on the CPU) or the reference."""
    return TRITON_OPS[name] if path == "triton" else getattr(reference, name)


def activation(*shape):
    """A non-leaf tensor, as a projection's output is: where the Triton twins may reuse memory."""
    return torch.randn(*shape, device=DEVICE, requires_grad=True).clone()


@pytest.mark.parametrize("path", ["triton", "reference"])
def test_contract_ops_that_write_no_input(path):
    """rms_norm, add_rms_norm, attention and linear_cross_entropy leave every input as it was, forward and
    backward."""
    T, H, V = 23, 64, 50
    cu = torch.tensor([0, 9, 23], dtype=torch.int32, device=DEVICE)
    x, w, h, emb, delta = activation(T, H), activation(H), activation(T, H), activation(V, H), activation(T, H)
    q, k, v = activation(T, 4, 32), activation(T, 2, 32), activation(T, 2, 32)
    labels = torch.randint(0, V, (T,), device=DEVICE)
    inputs = (x, w, h, emb, delta, q, k, v, labels, cu)
    before = [t.detach().clone() for t in inputs]
    outs = (op(path, "rms_norm")(x, w, 1e-5), *op(path, "add_rms_norm")(x, delta, w, 1e-5),
            op(path, "attention")(q, k, v, cu, 14, 0.2), op(path, "linear_cross_entropy")(h, emb, labels)[0])
    sum(out.sum() for out in outs).backward()
    assert all(torch.equal(t, b) for t, b in zip(inputs, before))


@pytest.mark.parametrize("path", ["triton", "reference"])
def test_contract_rope_returns_the_rotation(path):
    """Both return the rotated q, k: Triton's are q and k themselves, rotated in place; the reference's are new
    tensors, q and k left as they were. Nothing else of the projection (v) is written."""
    T, D = 19, 32
    positions = packed_positions(T, 7)
    cos, sin = rope_tables(D, 10, 10000.0)
    _, _, q, k, v = fused_qkv(T, 4, 2, D, torch.float32)
    q0, k0, v0 = (t.detach().clone() for t in (q, k, v))
    q2, k2 = op(path, "apply_rope")(q, k, cos, sin, positions)
    want_q, want_k = reference.apply_rope(q0, k0, cos, sin, positions)
    assert_close(q2, want_q, torch.float32, "q")
    assert_close(k2, want_k, torch.float32, "k")
    in_place = q2.data_ptr() == q.data_ptr() and k2.data_ptr() == k.data_ptr()
    assert in_place if path == "triton" else not in_place and torch.equal(q, q0) and torch.equal(k, k0)
    assert torch.equal(v, v0)


@pytest.mark.parametrize("path", ["triton", "reference"])
def test_contract_glu_backward_may_overwrite_gate_and_up(path):
    """Triton's backward leaves the gradients of non-leaf gate and up in their memory, the reference leaves them as
    they were; leaves (user data) keep their values on both paths."""
    gate, up = activation(5, 40), activation(5, 40)
    gate.retain_grad()
    up.retain_grad()
    gate0, up0 = gate.detach().clone(), up.detach().clone()
    op(path, "glu")(gate, up).sum().backward()
    if path == "triton":
        assert torch.equal(gate.detach(), gate.grad) and torch.equal(up.detach(), up.grad)
    else:
        assert torch.equal(gate, gate0) and torch.equal(up, up0)
    leaves = [torch.randn(5, 40, device=DEVICE, requires_grad=True) for _ in range(2)]
    before = [t.detach().clone() for t in leaves]
    op(path, "glu")(*leaves).sum().backward()
    assert all(torch.equal(t, b) for t, b in zip(leaves, before))


@pytest.mark.parametrize("path", ["triton", "reference"])
def test_contract_adamw_step_updates_its_state_in_place(path):
    p = torch.randn(300, device=DEVICE).to(torch.bfloat16)
    grad = torch.randn(300, device=DEVICE).to(torch.bfloat16)
    exp_avg, exp_avg_sq = torch.rand(300, device=DEVICE), torch.rand(300, device=DEVICE)
    comp = (1e-3 * torch.randn(300, device=DEVICE)).to(torch.float16)
    grad_sq = [torch.full((1,), 2.0, device=DEVICE)]
    state = (p, exp_avg, exp_avg_sq, comp)
    before, grad0 = [t.clone() for t in state], grad.clone()
    assert op(path, "adamw_step")(p, grad, exp_avg, exp_avg_sq, comp, 1e-2, 0.9, 0.95, 1e-8, 0.1, 3, grad_sq) is None
    assert not any(torch.equal(t, b) for t, b in zip(state, before)) and torch.equal(grad, grad0)
    assert len(grad_sq) == 2 and grad_sq[0].item() == 2.0  # appended to, the list's tensors untouched
    assert abs(torch.cat(grad_sq).sum().item() - 2.0 - grad.double().square().sum().item()) < 1e-3


# ------------------------------------------------------------------------ GPU: Llama-3-8B sizes, compiled

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H", [4096, 16384])
def test_gpu_rms_norm_llama_sizes(dtype, H):
    check_rms_norm((4096 if H == 4096 else 1024, H), dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, delta_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                                (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                (torch.float16, torch.bfloat16)])
@pytest.mark.parametrize("h_used", [True, False])
def test_gpu_add_rms_norm_llama_sizes(dtype, delta_dtype, h_used):
    check_add_rms_norm((4096, 4096), dtype, "cuda", delta_dtype, h_used)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_glu_llama_sizes(activation, dtype):
    T, F = 4096, 14336
    x = torch.randn(T, 2 * F, dtype=dtype, device="cuda", requires_grad=True)
    g, u = x.clone().chunk(2, dim=-1)  # non-leaf views: the in-place backward path
    h = glu(g, u, activation)
    dh = torch.randn_like(h)
    (dx,) = torch.autograd.grad(h, x, dh)
    x64 = fp64_leaves(x)[0]
    h64 = reference.glu(*x64.chunk(2, dim=-1), activation)
    (dx64,) = torch.autograd.grad(h64, x64, dh.double())
    assert_close(h, h64, dtype, "h")
    assert_close(dx, dx64, dtype, "d(gate, up)")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, down_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_gpu_glu_with_fused_down_projection(dtype, down_dtype):
    check_glu_with_down(4099, 14336, 4096, dtype, "silu", down_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2**31 // 14336 + 128, 14336), (2**31 + 2**20,)], ids=["2d", "1d"])
def test_gpu_glu_past_2_31_elements(shape):
    """bf16 gate and up of more than 2^31 elements each (~4.3 GB): values at the far end must be right."""
    g_leaf = torch.randn(shape, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    u_leaf = torch.randn(shape, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    assert g_leaf.numel() > 2**31
    g, u = g_leaf.clone(), u_leaf.clone()  # activations: backward overwrites them in place
    h = glu(g, u, "silu")
    dh = torch.randn_like(h)
    dg, du = torch.autograd.grad(h, (g, u), dh)
    assert dg.data_ptr() == g.data_ptr()
    tail = (slice(-16, None),) if len(shape) == 2 else (slice(-100_000, None),)
    head = (slice(0, 16),) if len(shape) == 2 else (slice(0, 100_000),)
    for where in (head, tail):
        g64, u64 = fp64_leaves(g_leaf[where], u_leaf[where])
        h64 = reference.glu(g64, u64, "silu")
        dg64, du64 = torch.autograd.grad(h64, (g64, u64), dh[where].double())
        assert_close(h[where], h64, torch.bfloat16, "h")
        assert_close(dg[where], dg64, torch.bfloat16, "dg")
        assert_close(du[where], du64, torch.bfloat16, "du")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_rope_llama_sizes(dtype):
    check_rope(T=4096, n_q=32, n_kv=8, D=128, dtype=dtype, device="cuda", max_doc=2048)
