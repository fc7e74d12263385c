"""The one dispatch point for every hot op: CUDA tensors run our Triton kernels, anything else the plain-torch
reference (kernels/reference.py). The Triton modules are imported on first CUDA use, so a machine without Triton
trains on the CPU all the same. NANOLLAMA_REFERENCE=1 forces the reference on CUDA too (A/B checks of a model).

In-place contract. The twins compute the same values, but the Triton ones reuse memory the reference leaves alone:
  * add_rms_norm(x, delta, ...) writes no input, as rms_norm: h = x + delta is a new tensor. Its backward, like
    torch's x + delta, hands one gradient tensor to both x and delta (where their dtypes agree): the incoming
    gradient of two branches, so no backward may write it in place (RoPE's rotates only the gradients attention makes).
  * apply_rope(q, k, ...) returns the rotated (q, k): Triton rotates q and k themselves (the reference makes new
    tensors) and, in backward, the incoming gradients, in place. So use only the returned tensors; don't pass in a
    tensor another op saved for its backward (autograd is not told of the rotation); and feed the rotated q, k only
    to ops whose backward makes fresh gradients (attention does; `q + x` hands one gradient to both branches, and
    rotating it in place would leak into x's).
  * glu(gate, up, ...): Triton's backward writes the gradients of gate and up over gate and up, unless they are
    leaves (user data), views of leaves, or have overlapping rows; the reference leaves them. After backward,
    read neither: an op that saved them for its own backward fails loudly (their version counters are bumped).
  * adamw_step updates p, exp_avg, exp_avg_sq and comp in place on both paths, adamw8bit_step also the scales;
    both append their partial sums of the gradient's squares to grad_sq when given. No op writes any other input.
tests/test_kernels_elementwise.py checks this contract on both paths.

Under torch.compile (train.py --compile=True) every op here is a graph break (`torch.compiler.disable`) and runs
eagerly: the kernels are fused already, and tracing them fails (Inductor cannot compile the attention kernel;
aot_autograd refuses "input mutations on views with different dtypes"); the glue between them is still compiled.
"""
import os
import warnings

import torch

from . import reference
from .reference import rope_cache  # the cache builder is plain torch on every device

_FORCE_REFERENCE = os.environ.get("NANOLLAMA_REFERENCE", "0") == "1"


def _use_triton(x):
    return x.is_cuda and not _FORCE_REFERENCE


_warned = set()


def _warn_once(message):
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


@torch.compiler.disable
def rms_norm(x, weight, eps):
    if _use_triton(x):
        from .rmsnorm import rms_norm as triton_rms_norm
        return triton_rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


@torch.compiler.disable
def add_rms_norm(x, delta, weight, eps):
    """(h, y) = (x + delta, rms_norm(x + delta, weight, eps)): a residual add fused into the norm that follows it."""
    if _use_triton(x):
        from .rmsnorm import add_rms_norm as triton_add_rms_norm
        return triton_add_rms_norm(x, delta, weight, eps)
    return reference.add_rms_norm(x, delta, weight, eps)


@torch.compiler.disable
def glu(gate, up, activation="silu", down=None, fp8=False):
    if _use_triton(gate):
        from .swiglu import glu as triton_glu
        return triton_glu(gate, up, activation, down, fp8)
    return reference.glu(gate, up, activation, down, fp8)


@torch.compiler.disable
def fp8_linears(x, weights):
    """[x (..., K) @ W^T for W (N_i, K) in weights], x quantized once, FP8 e4m3 operands in forward and backward
    (kernels/fp8.py): bf16 values, in the dtype F.linear would give (bf16 under autocast)."""
    if _use_triton(x):
        from .fp8 import fp8_linears as triton_fp8_linears
        return triton_fp8_linears(x, weights)
    return reference.fp8_linears(x, weights)


@torch.compiler.disable
def apply_rope(q, k, cos, sin, positions):
    """Returns the rotated (q, k): on CUDA q and k themselves, rotated in place (the contract above)."""
    if _use_triton(q):
        from .rope import apply_rope as triton_apply_rope
        return triton_apply_rope(q, k, cos, sin, positions)
    return reference.apply_rope(q, k, cos, sin, positions)


@torch.compiler.disable
def varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale):
    # (not named `attention`: importing the submodule kernels.attention would shadow it)
    if _use_triton(q):
        from .attention import SUPPORTED_HEAD_DIMS
        from .attention import attention as triton_attention
        if q.shape[-1] in SUPPORTED_HEAD_DIMS:
            return triton_attention(q, k, v, cu_seqlens, max_seqlen, scale)
        _warn_once(f"head_dim={q.shape[-1]}: the Triton attention kernel takes head dims {SUPPORTED_HEAD_DIMS}, so "
                   f"attention runs kernels/reference.py's loop over the sequences of every batch in Python: "
                   f"correct, but many times slower")
    return reference.attention(q, k, v, cu_seqlens, max_seqlen, scale)


@torch.compiler.disable
def linear_cross_entropy(h, weight, labels, fp8_grads=False):
    if _use_triton(h):
        from .cross_entropy import linear_cross_entropy as triton_linear_cross_entropy
        return triton_linear_cross_entropy(h, weight, labels, fp8_grads)
    return reference.linear_cross_entropy(h, weight, labels, fp8_grads)


@torch.compiler.disable
def adamw_step(p, grad, exp_avg, exp_avg_sq, comp, lr, beta1, beta2, eps, weight_decay, step, grad_sq=None,
               grad_scale=None):
    """One AdamW(-Kahan) step of one parameter, in place (see reference.adamw_step); grad_sq, a list or None, gets
    a 1-D fp32 tensor appended whose sum is the gradient's squared norm; grad_scale, one fp32 value on p's device
    or None, multiplies the gradient (clipping). fp64 stays on the reference."""
    args = (p, grad, exp_avg, exp_avg_sq, comp, lr, beta1, beta2, eps, weight_decay, step, grad_sq, grad_scale)
    if _use_triton(p) and p.dtype != torch.float64:
        from .adamw import adamw_step as triton_adamw_step
        return triton_adamw_step(*args)
    return reference.adamw_step(*args)


@torch.compiler.disable
def adamw8bit_step(p, grad, exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale, comp, lr, beta1, beta2, eps,
                   weight_decay, step, grad_sq=None, start=0, grad_scale=None):
    """One AdamW(-Kahan) step with 8-bit block-wise moments, in place (see reference.adamw8bit_step); grad_sq and
    grad_scale as adamw_step's; start: p is a piece of a parameter from that flat index on (optim.py's offload)."""
    args = (p, grad, exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale, comp, lr, beta1, beta2, eps, weight_decay,
            step, grad_sq, start, grad_scale)
    if _use_triton(p) and p.dtype != torch.float64:
        from .adamw8bit import adamw8bit_step as triton_adamw8bit_step
        return triton_adamw8bit_step(*args)
    return reference.adamw8bit_step(*args)
