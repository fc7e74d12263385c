"""How the attention kernels of kernels/attention.py are launched: tile configs, autotuning, TMA boxes.

A config is (BLOCK_M query rows, BLOCK_N keys, HEADS query heads stacked per tile, warps, pipeline stages). Short
sequences want small BLOCK_M (less of the tile past the diagonal or past the sequence's end), but the tensor cores
want tall tiles, so they stack the heads of a GQA group; long sequences take 64..128-row blocks of one head.

bf16/fp16 on the GPU: autotuned per (bucket of max_seqlen, head dim, GQA group, dtype) over the lists below, the
winners of a sweep on the H200 per workload (short sequences, 2K, 16K) and per GQA group size (G = 1 needs
HEADS = 1); BENCHMARKS.md has its results (bench/attention_tiles.py, deleted; git log). The tuning results are kept
on disk (kernels.autotune). Every kernel writes all its outputs, so re-running one while tuning is harmless.
fp32 inputs (exact dots, for tests) and the CPU interpreter run one small fixed config instead.

The streamed tiles are read through TMA descriptors whose box is the config's tile, so the descriptors are made
at launch, once the config is known (with_descriptors), not by a config pre_hook: Triton does not keep the
tuning results of configs with a pre_hook on disk.
"""
import os

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from .common import autotune

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def config(block_m, block_n, heads, warps, stages):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "HEADS": heads}, num_warps=warps,
                         num_stages=stages)


# Tuned on the H200 (227 KB of shared memory per block). Some of these configs do not fit sm_86's / sm_89's 99 KB
# (bench/compile_targets.py lists each one's bytes per GPU): there Triton's autotuner times a config whose kernel
# raises OutOfResources as inf and never picks it. The HEADS = 1 configs of each list, the only ones a GQA group of
# 1 or of odd size may run, include some that fit (tests/test_compile_targets.py), so every group keeps a choice.
TUNED_CONFIGS = {
    "fwd": [config(16, 32, 4, 4, 2), config(32, 32, 2, 4, 2), config(64, 64, 2, 4, 2), config(32, 128, 4, 8, 3),
            config(128, 128, 1, 8, 3), config(64, 128, 2, 8, 3), config(64, 32, 1, 4, 3), config(64, 64, 1, 4, 3)],
    "dkdv": [config(16, 64, 2, 4, 2), config(16, 64, 2, 4, 3), config(16, 64, 2, 4, 4), config(32, 128, 2, 8, 3),
             config(64, 128, 1, 8, 2), config(32, 64, 1, 4, 4), config(32, 64, 1, 4, 2), config(16, 64, 4, 4, 2)],
    "dq": [config(32, 32, 4, 8, 3), config(16, 32, 4, 4, 2), config(32, 32, 2, 4, 2), config(32, 64, 4, 8, 3),
           config(64, 64, 2, 8, 3), config(128, 64, 1, 8, 3), config(64, 64, 1, 4, 2)],
}
FP32_CONFIGS = {"fwd": config(32, 32, 1, 8, 1), "dkdv": config(16, 32, 1, 8, 1), "dq": config(32, 32, 1, 8, 1)}
INTERPRET_CONFIGS = {"fwd": config(16, 32, 2, 4, 1), "dkdv": config(16, 32, 2, 4, 1),
                     "dq": config(16, 32, 2, 4, 1)}  # BLOCK_N > BLOCK_M and 2 heads: the general paths
TUNING_KEY = ["seqlen_bucket", "HEAD_DIM", "GROUP"]  # the autotuner adds the tensors' dtypes to the key


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


def _stat_box(args):
    return [args["HEADS"], args["BLOCK_M"]]  # the row statistics (lse2, delta) of a stacked query tile


def _heads_first(x):
    return x.transpose(0, 1)  # (T, H, D) -> (H, T, D): a box of one head's consecutive tokens


# The kernels' TMA descriptor arguments: the tensor each one reads, the view the descriptor is made of, and its box.
DESCRIPTORS = {"KD": ("K", _heads_first, _kv_box), "VD": ("V", _heads_first, _kv_box),
               "QD": ("Q", _heads_first, _q_box), "DOD": ("DO", _heads_first, _q_box),
               "LSED": ("LSE2", lambda x: x, _stat_box), "DELTAD": ("DELTA", lambda x: x, _stat_box)}


def with_descriptors(kernel):
    """The kernel, with its TMA descriptor arguments made at launch from its tensors and the config's tile."""
    def make(tensor, view, box):
        return lambda args: TensorDescriptor.from_tensor(view(args[tensor]), box(args))

    return triton.heuristics({name: make(*how) for name, how in DESCRIPTORS.items()
                              if name in kernel.arg_names})(kernel)


def autotuned(configs, kernel):
    # do_bench's default timing per config, not a shorter one: the best tiles of a long sequence are close to each
    # other, and shorter timing cannot tell them apart reliably
    return autotune(configs, key=TUNING_KEY, prune_configs_by={"early_config_prune": _fits_group})(kernel)


class TunedKernel:
    """One attention kernel and its launch configuration: autotuned over TUNED_CONFIGS[name] for 16-bit inputs on
    the GPU, FP32_CONFIGS[name] for fp32 (exact "ieee" dots, not tf32), INTERPRET_CONFIGS[name] in the interpreter.
    `kernel` runs any config given in full: kernel[grid](*args, BLOCK_M=..., ..., num_warps=..., num_stages=...)."""

    def __init__(self, kernel, name):
        self.kernel = with_descriptors(kernel)
        self.autotuner = None if INTERPRET else autotuned(TUNED_CONFIGS[name], self.kernel)
        self.fixed = (INTERPRET_CONFIGS if INTERPRET else FP32_CONFIGS)[name]

    def __call__(self, dtype, grid, *args, **constexprs):
        """Launch on `args` (the kernel's arguments up to its descriptors) and `constexprs` (GROUP, HEAD_DIM);
        grid(meta) -> the launch grid, meta holding the config's BLOCK_M, BLOCK_N and HEADS."""
        if self.autotuner is not None and dtype != torch.float32:
            self.autotuner[grid](*args, DOT_PRECISION="tf32", **constexprs)  # 16-bit dots: the flag is moot
            return
        fixed = self.fixed
        meta = dict(fixed.kwargs, HEADS=heads_that_fit(fixed.kwargs["HEADS"], constexprs["GROUP"]))
        self.kernel[grid(meta)](*args, DOT_PRECISION="ieee", **constexprs, **meta, num_warps=fixed.num_warps,
                                num_stages=fixed.num_stages)
