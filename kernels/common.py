"""What the Triton kernels and the plain-torch reference share: the formats both must agree on, bit for bit, and
the helpers the Triton modules (and model.py) share. Importing this needs torch only (the reference runs on
machines without Triton)."""
import inspect

import torch

IGNORE_INDEX = -100  # a label with no target: no loss, no gradient (F.cross_entropy's default ignore_index)
ACTIVATIONS = ("silu", "gelu_tanh")  # of the GLU: act(gate) * up is SwiGLU or GeGLU (tanh-approximated GELU)

# FP8 e4m3 with block scales (kernels/fp8.py explains the format)
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
FP8_AMAX_FLOOR = 1e-12  # a block's amax is taken as at least this: an all-zero block gets a finite scale (codes 0)
FP8_BLOCK = 128  # a scale covers 128 consecutive elements along the summed dimension
FP8_ALIGN = 16  # torch._scaled_mm needs both dims of every weight (N and K of a product) to be multiples of this

# AdamW's moments as 8-bit codes with block scales (kernels/adamw8bit.py explains the codes)
ADAMW8BIT_BLOCK = 64  # elements per scale
ADAMW8BIT_M_POWER = 4  # the companding power of the code of m
ADAMW8BIT_S_POWER = 4  # ... and of the code of sqrt(v)


def mix32(x):
    """A 32-bit integer hash of x in [0, 2^32) (Python ints or int64 tensors): two multiply-xorshift rounds, constants
    from C. Wellons' hash-prospector. kernels/adamw8bit.py's _mix32 computes the same bits on uint32."""
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x = x ^ (x >> 12)
    x = (x * 0x297A2D39) & 0xFFFFFFFF
    return x ^ (x >> 15)


def mm_fp32(a, b, c=None):
    """a @ b of two bf16 (or fp16) matrices, summed and written in fp32 by the GEMM itself (cuBLAS's bf16 x bf16 ->
    fp32 product on CUDA; the fp32 product of the same values elsewhere); with c (fp32), c += a @ b in place, added
    in the GEMM's epilogue. Gradients for fp32 master weights and activations made this way skip the bf16 rounding
    of each product and the casts and adds back in fp32 that autocast pays. Autocast is off inside (torch.compile
    may trace a backward under the forward's autocast); traced, by Dynamo or on subclasses of torch.Tensor, the
    product and the add are taken apart (torch 2.11 cannot trace addmm with out_dtype)."""
    with torch.autocast(a.device.type, enabled=False):
        if not a.is_cuda:
            return a.float() @ b.float() if c is None else c.addmm_(a.float(), b.float())
        if c is None or torch.compiler.is_compiling() or type(c) is not torch.Tensor:
            ab = torch.mm(a, b, out_dtype=torch.float32)
            return ab if c is None else c.add_(ab)
        return torch.addmm(c, a, b, out_dtype=torch.float32, out=c)


def as_rows(t):
    """(..., H) -> (rows, H) with a unit last stride: a view when one exists, else a contiguous copy."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def autotune(configs, key, **kwargs):
    """triton.autotune that keeps its results on disk: a later run that meets the same kernel with the same tuning
    key loads the winning config instead of timing every config again.

    Triton's own cache (`cache_results=True`) writes <kernel name>.autotune.json into Triton's cache directory
    (TRITON_CACHE_DIR, default ~/.triton/cache), keyed by the Triton version and build, the GPU architecture and
    ptxas version, the kernel's source (with the jit functions it calls), the environment variables that change
    compilation, the tuning key's values and the tensor arguments' dtypes, and the configs left after pruning. A
    changed kernel or config list tunes again; to re-tune an unchanged one, delete the cache directory. Configs that
    carry a pre_hook (which it can't store) and the interpreter skip the disk. Without the option: triton.autotune.
    """
    import triton
    if "cache_results" in inspect.signature(triton.autotune).parameters:
        kwargs["cache_results"] = True
    return triton.autotune(configs, key, **kwargs)
