"""Compile the Triton kernels of bf16 training offline (no GPU needed) for the GPUs we have not run: sm_80 (A100),
sm_86 (A10, RTX 3090), sm_89 (RTX 4090, L4, L40S), beside sm_90 (H200); each kernel's shared memory is checked
against the target's per-block limit.

Each kernel is compiled with the arguments its Python wrapper really launches it with at Llama-3-8B sizes (hidden
4096, FFN 14336, 32 query / 8 kv heads of 128, vocab 128256, 8K tokens): the wrapper runs on CPU tensors with the
launch replaced by a recorder (`launches`), and the recorded call is compiled through Triton's own argument binding
(`compile_for`: the signature, constexprs and alignment specialization of a launch on that GPU). The attention
kernels are compiled for every tile config of kernels/attention_tuning.py's TUNED_CONFIGS, and sm_90 beside the
others; --quick (tests/test_compile_targets.py) compiles one config per attention kernel (quick_config) and sm_80,
sm_86, sm_89 only. The FP8 quantizers run on sm_90 only (train.py refuses fp8 elsewhere): compiled for sm_90, and
in the full run for sm_89 as information.

    python bench/compile_targets.py            # ~140 compiles: ~7 minutes on one CPU core
    python bench/compile_targets.py --quick    # ~45 compiles: under a minute
    python bench/compile_targets.py --json     # rows as one JSON list instead of a table

Runs without TRITON_INTERPRET (the interpreter compiles nothing): it is removed before triton is imported.
"""
import json
import os
import sys
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, set so that it does not warn
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `kernels`

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

# Shared memory per block (bytes), the opt-in maximum (CUDA C programming guide, compute capabilities table): what
# torch.cuda.get_device_properties(...).shared_memory_per_block_optin reports, and what Triton checks at load.
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
TARGETS = (80, 86, 89)  # the GPUs the kernels had never been compiled for
H200 = 90  # beside them in the full run, for comparison
HIDDEN, FFN, N_Q, N_KV, HEAD_DIM, VOCAB, TOKENS = 4096, 14336, 32, 8, 128, 128256, 8192
EPS = 1e-5


def compile_for(kernel, capability, kwargs):
    """triton.compile of JITFunction `kernel` for cuda sm_<capability>, as the launch kernel[grid](**kwargs) on that
    GPU would compile it (Triton's binder makes the signature, constexprs and specialization)."""
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    bind = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = bind(**kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def launches(kernels, call):
    """[(kernel, kwargs)] of each launch of any of `kernels` (JITFunctions or Autotuners) that call() makes, every
    argument by name; none of them runs (the wrappers' Python runs on CPU tensors up to the launch)."""
    seen = []

    def recorder(kernel):
        return lambda *args, grid, warmup, **kwargs: seen.append((kernel, {**dict(zip(kernel.arg_names, args)),
                                                                           **kwargs}))
    for kernel in kernels:
        kernel.run = recorder(kernel)
    try:
        call()
    finally:
        for kernel in kernels:
            del kernel.run
    return seen


def _empty(*shape, dtype=torch.bfloat16, grad=False):
    return torch.empty(shape, dtype=dtype).requires_grad_(grad)  # never written: its pages are never touched


def _backward(outputs, grads):
    torch.autograd.backward(list(outputs), grads)


def kernel_launches(capability):
    """[(name, JITFunction, kwargs)]: each non-attention kernel of bf16 training as its wrapper launches it on an
    sm_<capability> GPU. RMSNorm in train.py's default dtypes (fp32 master weights under bf16 autocast: an fp32
    residual stream h and a bf16 delta), where its backward holds the most bytes per row; the others in bf16, AdamW on
    bf16 weights with Kahan comp (configs/llama3_8b.py) and on fp32 ones."""
    from kernels import adamw, adamw8bit, cross_entropy, rmsnorm, rope, swiglu
    out = []

    def record(names, kernels, call):
        recorded = launches(kernels, call)
        assert len(recorded) == len(names), (names, len(recorded))
        out.extend((name, kernel, kwargs) for name, (kernel, kwargs) in zip(names, recorded))

    w = _empty(HIDDEN, dtype=torch.float32, grad=True)
    x, delta = _empty(TOKENS, HIDDEN, dtype=torch.float32, grad=True), _empty(TOKENS, HIDDEN, grad=True)
    record(["rmsnorm_fwd", "rmsnorm_bwd"], [rmsnorm._rms_norm_fwd_kernel, rmsnorm._rms_norm_bwd_kernel],
           lambda: _backward(rmsnorm.add_rms_norm(x, delta, w, EPS), [_empty(TOKENS, HIDDEN, dtype=torch.float32)] * 2))
    # The backward's device queries, answered for the GPU: rows per program as on an A100 (2 programs on each of 108
    # SMs; the CPU's 1 would be specialized into a constant), pipeline stages within the target's shared memory.
    bwd = out[-1][2]
    bwd["rows_per_program"] = triton.cdiv(TOKENS, 2 * 108)
    rows = [bwd["X"], bwd["DY"]] + ([bwd["DH_OUT"]] if bwd["ADD"] else [])
    bwd["STAGES"] = rmsnorm._backward_stages(bwd["BLOCK"], SHARED_LIMIT[capability], *rows)
    q, k = _empty(TOKENS, N_Q, HEAD_DIM, grad=True), _empty(TOKENS, N_KV, HEAD_DIM, grad=True)
    cos, sin = (_empty(TOKENS, HEAD_DIM // 2, dtype=torch.float32) for _ in "cs")  # RoPE tables
    positions = _empty(TOKENS, dtype=torch.int32)
    record(["rope_fwd", "rope_bwd"], [rope._rope_kernel], lambda: _backward(
        rope.apply_rope(q * 1, k * 1, cos, sin, positions), [_empty(*q.shape), _empty(*k.shape)]))
    gate, up = _empty(TOKENS, FFN, grad=True), _empty(TOKENS, FFN, grad=True)
    record(["glu_fwd", "glu_bwd"], [swiglu._glu_fwd_kernel, swiglu._glu_bwd_kernel],
           lambda: _backward([swiglu.glu(gate * 1, up * 1)], [_empty(TOKENS, FFN)]))
    logits = _empty(256, VOCAB, dtype=torch.float32)  # a chunk's fp32 logits; G in bf16 over their first halves
    record(["cross_entropy_rows"], [cross_entropy._cross_entropy_rows_kernel],
           lambda: cross_entropy._cross_entropy_rows(logits, cross_entropy._grad_view(logits, torch.bfloat16),
                                                     _empty(256, dtype=torch.int64), _empty(256, dtype=torch.float32)))
    n = HIDDEN * FFN  # an MLP matrix
    p, g, comp = _empty(n), _empty(n), _empty(n, dtype=torch.float16)
    m, v = _empty(n, dtype=torch.float32), _empty(n, dtype=torch.float32)
    step = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=10)
    record(["adamw_bf16"], [adamw._adamw_kernel], lambda: adamw.adamw_step(p, g, m, v, comp, **step, grad_sq=[]))
    p32, g32 = _empty(n, dtype=torch.float32), _empty(n, dtype=torch.float32)
    record(["adamw_fp32"], [adamw._adamw_kernel], lambda: adamw.adamw_step(p32, g32, m, v, None, **step))
    blocks = triton.cdiv(n, adamw8bit.QBLOCK)
    record(["adamw8bit_bf16"], [adamw8bit._adamw8bit_kernel], lambda: adamw8bit.adamw8bit_step(
        p, g, _empty(n, dtype=torch.int8), _empty(blocks, dtype=torch.float32), _empty(n, dtype=torch.uint8),
        _empty(blocks, dtype=torch.float32), comp, **step, grad_sq=[]))
    return out


def fp8_launches():
    """[(name, JITFunction, kwargs)]: the FP8 quantizers (of an activation, rows and x^T's tiles; of the MLP's h) with
    the GPU's conversion (HW_CAST, which the CPU's launch turns off)."""
    from kernels import fp8, swiglu
    out = []
    for name, kernel, call in (
            ("fp8_quantize", fp8._quantize_kernel,
             lambda: fp8.quantize(_empty(TOKENS, HIDDEN), rows=1, cols=fp8.BLOCK)),
            ("fp8_glu_codes", swiglu._glu_codes_kernel,
             lambda: swiglu._glu_codes(_empty(TOKENS, FFN), _empty(TOKENS, FFN), "silu", rows=1))):
        (kernel, kwargs), = launches([kernel], call)
        out.append((name, kernel, {**kwargs, "HW_CAST": True}))
    return out


def quick_config(configs):
    """The config the test compiles: the smallest of those with HEADS = 1 (the only ones a GQA group of 1 or of an
    odd size may run), by rows of K/V in flight, BLOCK_N x stages. Where it fits a target, every group has a config
    that does: the autotuner skips the others there (kernels/attention_tuning.py)."""
    return min((c for c in configs if c.kwargs["HEADS"] == 1), key=lambda c: c.kwargs["BLOCK_N"] * c.num_stages)


def attention_launches(quick):
    """[(name, JITFunction, kwargs)]: the attention kernels as kernels/attention.py launches them on an 8K-token
    document, one entry per tile config of TUNED_CONFIGS (quick: quick_config's), the TMA descriptors made as at
    launch (attention_tuning.with_descriptors)."""
    from kernels import attention
    q = _empty(TOKENS, N_Q, HEAD_DIM, grad=True)
    k, v = _empty(TOKENS, N_KV, HEAD_DIM, grad=True), _empty(TOKENS, N_KV, HEAD_DIM, grad=True)
    cu = torch.tensor([0, TOKENS], dtype=torch.int32)
    names = {tuned.autotuner: name for name, tuned in attention.KERNELS.items()}
    recorded = launches(names, lambda: _backward([attention.attention(q, k, v, cu, TOKENS, HEAD_DIM ** -0.5)],
                                                 [_empty(*q.shape)]))
    out = []
    for autotuner, kwargs in recorded:
        name = names[autotuner]
        tuned = attention.KERNELS[name].kernel  # triton.heuristics making the descriptors, around the JITFunction
        configs = attention.tuning.TUNED_CONFIGS[name]
        for i, config in enumerate(configs):
            if quick and config is not quick_config(configs):
                continue
            full = {**kwargs, **config.kwargs}
            full.update({arg: make(full) for arg, make in tuned.values.items()})
            out.append((f"attn_{name} #{i}", tuned.fn, {**full, "num_warps": config.num_warps,
                                                       "num_stages": config.num_stages}))
    return out


def compile_all(entries, capability):
    """Rows {kernel, fn, target, shared, limit, seconds, error} of compiling each entry for sm_<capability>."""
    rows = []
    for name, kernel, kwargs in entries:
        config = " ".join(f"{k}={kwargs[k]}" for k in ("BLOCK_M", "BLOCK_N", "HEADS", "STAGES", "num_warps",
                                                      "num_stages") if k in kwargs)
        row = dict(kernel=name, fn=kernel.__name__, config=config, target=capability, limit=SHARED_LIMIT[capability],
                   shared=None, error=None)
        start = time.time()
        try:
            row["shared"] = compile_for(kernel, capability, kwargs).metadata.shared
        except Exception as e:  # a kernel that does not compile for this target: a row that says why
            row["error"] = f"{type(e).__name__}: {str(e).strip()[:300]}"
        row["seconds"] = round(time.time() - start, 2)
        rows.append(row)
    return rows


def main(argv):
    quick = "--quick" in argv
    with tempfile.TemporaryDirectory() as cache:
        os.environ.setdefault("TRITON_CACHE_DIR", cache)  # a cold cache: every kernel compiled, times comparable
        rows = []
        for cc in TARGETS if quick else TARGETS + (H200,):
            rows += compile_all(kernel_launches(cc) + attention_launches(quick), cc)
        for cc in (H200,) if quick else (H200, 89):  # sm_89 has FP8 tensor cores too: for information
            rows += compile_all(fp8_launches(), cc)
    if "--json" in argv:
        print(json.dumps(rows))
        return
    print(f"{'kernel':20} {'config':56} {'sm':>3} {'shared B':>9} {'limit B':>8} {'s':>5}  result")
    for r in sorted(rows, key=lambda r: (r["kernel"], r["target"])):
        result = r["error"] or ("fits" if r["shared"] <= r["limit"] else "TOO BIG")
        shared = "-" if r["shared"] is None else r["shared"]
        print(f"{r['kernel']:20} {r['config']:56} {r['target']:>3} {shared:>9} {r['limit']:>8} {r['seconds']:>5}  "
              f"{result}")


if __name__ == "__main__":
    main(sys.argv[1:])
