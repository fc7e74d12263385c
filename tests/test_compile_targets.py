"""Every Triton kernel of bf16 training compiles, offline, for sm_80 (A100), sm_86 (A10, RTX 3090) and sm_89
(RTX 4090, L4, L40S), within each GPU's shared memory per block; the FP8 quantizers for sm_90, the only GPU that runs
FP8. bench/compile_targets.py --quick compiles them (with the arguments the wrappers launch them with at Llama-3-8B
sizes; the attention kernels with the HEADS = 1 config that every GQA group can fall back to) in a subprocess without
TRITON_INTERPRET, since the interpreter compiles nothing: ~45 compiles, under a minute on one core. The full run
(every attention tile config, and sm_90) is the bench script's."""
import glob
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from kernels import rmsnorm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = (80, 86, 89)
# Shared memory per block, the opt-in maximum of each compute capability (CUDA C programming guide)
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
FP8_KERNELS = {"_quantize_kernel", "_glu_codes_kernel"}  # compiled for sm_90 only


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """bench/compile_targets.py --quick's rows: {kernel, fn, config, target, shared, limit, seconds, error}."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton_cache"))  # cold, and not the user's cache
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "compile_targets.py"), "--quick", "--json"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def launched_kernels():
    """The names of the kernels in kernels/*.py that are launched with a grid: *_kernel and _attn_*."""
    names = set()
    for path in glob.glob(os.path.join(ROOT, "kernels", "*.py")):
        with open(path) as f:
            names |= set(re.findall(r"^def (_\w+_kernel|_attn_\w+)\(", f.read(), re.MULTILINE))
    return names


def test_every_kernel_compiles_for_every_target(rows):
    failed = [(r["kernel"], r["target"], r["error"]) for r in rows if r["error"]]
    assert not failed, failed
    compiled = {(r["fn"], r["target"]) for r in rows}
    kernels = launched_kernels()
    assert len(kernels) >= 13, kernels  # the regex still finds them
    missing = [(fn, cc) for fn in sorted(kernels - FP8_KERNELS) for cc in TARGETS if (fn, cc) not in compiled]
    missing += [(fn, 90) for fn in sorted(FP8_KERNELS) if (fn, 90) not in compiled]
    assert not missing, f"kernels bench/compile_targets.py does not compile: {missing}"


def test_shared_memory_fits_every_target(rows):
    assert all(r["limit"] == SHARED_LIMIT[r["target"]] for r in rows), {r["target"]: r["limit"] for r in rows}
    too_big = [(r["kernel"], r["config"], r["target"], r["shared"]) for r in rows
               if r["shared"] is not None and r["shared"] > r["limit"]]
    assert not too_big, too_big


def test_rmsnorm_backward_stages_fit_shared_memory():
    """3 pipeline stages of the fused add's three fp32 rows at hidden 4096 (train.py's fp32 master weights) need
    104 KB on sm_86 / sm_89, past their 99 KB: one stage there. On the H200 (and in the interpreter, no limit) the
    choice is the one made before GPUs of less shared memory were considered, and bf16 rows keep 3 stages."""
    fp32_rows, bf16_rows = [torch.empty(0, dtype=torch.float32)] * 3, [torch.empty(0, dtype=torch.bfloat16)] * 3
    assert [rmsnorm._backward_stages(4096, SHARED_LIMIT[cc], *fp32_rows) for cc in (80, 86, 89, 90)] == [3, 1, 1, 3]
    assert rmsnorm._backward_stages(4096, None, *fp32_rows) == 3
    assert rmsnorm._backward_stages(4096, SHARED_LIMIT[86], *bf16_rows) == 3
    assert rmsnorm._backward_stages(16384, None, *fp32_rows) == 1  # 192 KB per stage: no pipelining anywhere
