"""How the attention kernels of kernels/attention.py are launched: tile configs, autotuning, TMA boxes.

A config is (BLOCK_M query rows, BLOCK_N keys, HEADS query heads stacked per tile, warps, pipeline stages). Short
sequences want small BLOCK_M (less of the tile past the diagonal or past the sequence's end), but the tensor cores
want tall tiles, so they stack the heads of a GQA group; long sequences take 64..128-row blocks of one head.

bf16/fp16 on the GPU: autotuned per (bucket of max_seqlen, head dim, GQA group, dtype) over the lists below, the
winners of a sweep on the H200 per workload (short sequences, 2K, 16K) and per GQA group size (G = 1 needs
HEADS = 1); bench/attention_tiles.py re-runs the sweep, BENCHMARKS.md has its results. The tuning results are kept
on disk (kernels.autotune). Every kernel writes all its outputs, so re-running one while tuning is harmless.
fp32 inputs (exact dots, for tests) and the CPU interpreter run one small fixed config instead.

The streamed tiles are read through TMA descriptors whose box is the config's tile, so the descriptors are made
at launch, once the config is known (with_descriptors), not by a config pre_hook: Triton does not keep the
tuning results of configs with a pre_hook on disk.
"""
import contextlib
import os

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from . import autotune

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def config(block_m, block_n, heads, warps, stages, **switches):
    """switches: the kernels' optional constexprs, e.g. EDGES_TMA=True (all three kernels), WS=1 or 2 (forward)."""
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "HEADS": heads, **switches}, num_warps=warps,
                         num_stages=stages)


TUNED_CONFIGS = {
    "fwd": [config(16, 32, 4, 4, 2), config(32, 32, 2, 4, 2), config(64, 64, 2, 4, 2), config(32, 128, 4, 8, 3),
            config(128, 128, 1, 8, 3), config(64, 128, 2, 8, 3), config(64, 32, 1, 4, 3), config(64, 64, 1, 4, 3)],
    "dkdv": [config(16, 64, 2, 4, 2), config(16, 64, 2, 4, 3), config(16, 64, 2, 4, 4), config(32, 128, 2, 8, 3),
             config(64, 128, 1, 8, 2), config(32, 64, 1, 4, 4), config(32, 64, 1, 4, 2), config(16, 64, 4, 4, 2)],
    "dq": [config(32, 32, 4, 8, 3), config(16, 32, 4, 4, 2), config(32, 32, 2, 4, 2), config(32, 64, 4, 8, 3),
           config(64, 64, 2, 8, 3), config(128, 64, 1, 8, 3), config(64, 64, 1, 4, 2)],
    # the fused backward (attention.BACKWARD = "fused-*"): not yet swept (bench/attention_sweep.py times a few);
    # 64 keys for short sequences, 128 for long ones (fewer dQ atomics per matrix product: bytes ~ 1 / BLOCK_N)
    "fused": [config(16, 64, 2, 4, 2, EDGES_TMA=True), config(16, 64, 4, 4, 2, EDGES_TMA=True),
              config(64, 128, 1, 8, 2, EDGES_TMA=True), config(32, 128, 2, 8, 2, EDGES_TMA=True),
              config(64, 64, 1, 4, 2, EDGES_TMA=True)],
}
FP32_CONFIGS = {"fwd": config(32, 32, 1, 8, 1), "dkdv": config(16, 32, 1, 8, 1), "dq": config(32, 32, 1, 8, 1),
                "fused": config(16, 32, 1, 8, 1, EDGES_TMA=True)}
INTERPRET_CONFIGS = {"fwd": config(16, 32, 2, 4, 1), "dkdv": config(16, 32, 2, 4, 1), "dq": config(16, 32, 2, 4, 1),
                     "fused": config(16, 32, 2, 4, 1, EDGES_TMA=True)}  # BLOCK_N > BLOCK_M, 2 heads: general paths
TUNING_KEY = ["seqlen_bucket", "HEAD_DIM", "GROUP"]  # the autotuner adds the tensors' dtypes to the key
TUNING_KEYS = {"fused": TUNING_KEY + ["DQ_MODE"]}  # fixed-point and fp32 dQ are different kernels


def seqlen_bucket(max_seqlen):
    """Autotuning key: the longest sequence rounded up to a power of 2, capped at 8K (past that the work is
    all long-sequence tiles and the best config no longer changes, so a 64K batch doesn't tune again)."""
    return min(triton.next_power_of_2(max(max_seqlen, 1)), 8192)


def heads_that_fit(heads, group):
    """The tile's HEADS must divide the GQA group (a tile never spans two kv heads): halve until it does."""
    while group % heads:
        heads //= 2
    return heads


def _fits_group(configs, named_args, **kwargs):
    """Autotuner pruning: drop the configs whose HEADS does not divide this call's GQA group."""
    return [c for c in configs if kwargs["GROUP"] % c.kwargs["HEADS"] == 0]


def _kv_box(args):
    return [1, args["BLOCK_N"], args["HEAD_DIM"]]  # BLOCK_N keys of one kv head


def _q_box(args):
    return [args["HEADS"], args["BLOCK_M"], args["HEAD_DIM"]]  # BLOCK_M rows of HEADS query heads: a stacked tile


# The kernels' TMA descriptor arguments: the (T, H, D) tensor each one reads, viewed as (H, T, D), and its box.
DESCRIPTORS = {"KD": ("K", _kv_box), "VD": ("V", _kv_box), "QD": ("Q", _q_box), "DOD": ("DO", _q_box),
               "DQD": ("DQ_ACC", _q_box)}


def with_descriptors(kernel):
    """The kernel, with its TMA descriptor arguments made at launch from its tensors and the config's tile."""
    def make(tensor, box):
        return lambda args: TensorDescriptor.from_tensor(args[tensor].transpose(0, 1), box(args))

    return triton.heuristics({name: make(tensor, box) for name, (tensor, box) in DESCRIPTORS.items()
                              if name in kernel.arg_names})(kernel)


def autotuned(configs, kernel, key=TUNING_KEY):
    # do_bench's default timing (100 ms per config): the best tiles of a long sequence are within a few % of each
    # other, and shorter timing picked worse ones (BENCHMARKS.md)
    return autotune(configs, key=key, prune_configs_by={"early_config_prune": _fits_group})(kernel)


_allocator_set = False


def _device_descriptor_memory():
    """Descriptors made inside a kernel (tl.make_tensor_descriptor, the forward's WS configs) need global scratch
    memory from an allocator registered with Triton, once per process."""
    global _allocator_set
    if not _allocator_set:
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8,
                                                                         device="cpu" if INTERPRET else "cuda"))
        _allocator_set = True


class TunedKernel:
    """One attention kernel and its launch configuration: autotuned over TUNED_CONFIGS[name] for 16-bit inputs on
    the GPU, FP32_CONFIGS[name] for fp32 (exact "ieee" dots, not tf32), INTERPRET_CONFIGS[name] in the interpreter.
    `kernel` runs any config given in full: kernel[grid](*args, BLOCK_M=..., ..., num_warps=..., num_stages=...)."""

    def __init__(self, kernel, name):
        self.kernel = with_descriptors(kernel)
        key = TUNING_KEYS.get(name, TUNING_KEY)
        self.autotuner = None if INTERPRET else autotuned(TUNED_CONFIGS[name], self.kernel, key)
        self.fixed = (INTERPRET_CONFIGS if INTERPRET else FP32_CONFIGS)[name]
        self.pinned = None  # a config that replaces both the autotuner and the fixed one (pinned(), for sweeps)
        self.device_descriptors = any(c.kwargs.get("WS", 0) for c in TUNED_CONFIGS[name])

    def __call__(self, dtype, grid, *args, **constexprs):
        """Launch on `args` (the kernel's arguments up to its descriptors) and `constexprs` (GROUP, HEAD_DIM);
        grid(meta) -> the launch grid, meta holding the config's BLOCK_M, BLOCK_N and HEADS."""
        if self.pinned is None and self.autotuner is not None and dtype != torch.float32:
            if self.device_descriptors:
                _device_descriptor_memory()
            self.autotuner[grid](*args, DOT_PRECISION="tf32", **constexprs)  # 16-bit dots: the flag is moot
            return
        self.launch(self.pinned or self.fixed, dtype, grid, args, constexprs)

    def launch(self, config, dtype, grid, args, constexprs, warmup=False):
        """Run (or with warmup=True only compile) one given config."""
        meta = dict(config.kwargs, HEADS=heads_that_fit(config.kwargs["HEADS"], constexprs["GROUP"]))
        if meta.get("WS", 0):
            _device_descriptor_memory()
        kwargs = dict(DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32", **constexprs, **meta,
                      num_warps=config.num_warps, num_stages=config.num_stages)
        if warmup:
            return self.kernel.warmup(*args, grid=grid(meta), **kwargs)
        self.kernel[grid(meta)](*args, **kwargs)


@contextlib.contextmanager
def pinned(kernels, configs):
    """Run kernels[name] with configs[name] (a triton.Config, or None for the usual choice) inside the block."""
    before = {name: kernels[name].pinned for name in configs}
    try:
        for name, config in configs.items():
            kernels[name].pinned = config
        yield
    finally:
        for name, config in before.items():
            kernels[name].pinned = config
