"""Shared test set-up. Without CUDA, Triton kernels run in the interpreter: TRITON_INTERPRET must be set before
triton is first imported, which is why it happens here, at collection time."""
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n N (make test): N workers share the cores, a thread each,
    torch.set_num_threads(1)  # and so do the train.py processes the tests start
    os.environ.setdefault("OMP_NUM_THREADS", "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


def rel_err(out, ref):
    """||out - ref|| / ||ref|| in fp64; NaN anywhere gives inf."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def random_cu_seqlens(total, max_len, generator=None, min_len=1):
    """Random document lengths (some of length 1) summing to `total`, as int32 cu_seqlens."""
    lengths = []
    left = total
    while left > 0:
        n = int(torch.randint(min_len, max_len + 1, (1,), generator=generator))
        n = min(n, left)
        lengths.append(n)
        left -= n
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return cu
