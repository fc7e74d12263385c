"""train.py on several processes (torchrun, gloo on the CPU, 2 ranks): DDP and FSDP2 train exactly as one process
with the same global batch, resume exactly, and stop together; FP8 under FSDP2. Plus the loader's rank sharding
they rely on.

Equal, not bit-equal: the ranks' gradients and losses are summed in another order than one process sums its
micro-steps (and FSDP takes the gradient norm shard by shard), so results agree to fp32 rounding (losses rel < 1e-6,
weights rel < 1e-4), not to the bit; DDP with one micro-step per rank adds the same two gradients as one process,
and matches to the bit. A distributed run and its own resume do match to the bit. The one process runs with the
ranks' intra-op thread count (1): a CPU matmul or sum splits its work by thread, so 2 threads against 1 is another
summation order too, one that has nothing to do with the ranks.
"""
import json
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from data.loader import MODES, PackedLoader
from test_train import (ROOT, TINY, corpus, losses, run,  # noqa: F401  (corpus: the tiny corpus fixture)
                        sigterm_after_first_step)

# a fresh model and data order every session (printed on failure; NANOLLAMA_TEST_SEED=N repeats one)
SEED = int(os.environ.get("NANOLLAMA_TEST_SEED", random.randrange(10**6)))
# ffn_dim 67: odd-sized weights, which FSDP splits unevenly over 2 ranks
# --device=cpu: these tests are about gloo on the CPU in fp32 (on a GPU machine train.py would pick CUDA and bf16,
# whose rounding the tolerances below are not made for; bench/fsdp_8b.py runs NCCL on GPUs)
STEPS = ["--device=cpu", "--max_steps=6", "--eval_interval=3", "--learning_rate=1e-2", "--grad_clip=0.5", "--ffn_dim=67", f"--seed={SEED}"]
ONE_THREAD = dict(OMP_NUM_THREADS="1")  # 2 ranks on 2 cores; the one process as each rank (module docstring)
ENV = dict(os.environ, PYTHONUNBUFFERED="1", **ONE_THREAD)


def torchrun_command(*args, nproc=2):
    device = [] if any(a.startswith("--device=") for a in args) else ["--device=cpu"]  # gloo, also on GPU machines
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            os.path.join(ROOT, "train.py"), *args, *device]


def torchrun(*args, check=True):
    proc = subprocess.run(torchrun_command(*args), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun train.py {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


def records(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def assert_close_runs(out_a, out_b, rel=1e-6, weights_rel=1e-4, grad_norm_rel=1e-4):
    """Same steps, losses (train and val) within rel; grad norms within grad_norm_rel; final weights within
    weights_rel. The weights' relative error is about their gradients' relative error: Adam moves every element by
    ~lr per step whatever its gradient's size (1e-2 here, on weights of ~2e-2). And q and k's gradients at init are
    sums that cancel (the softmax backward of near-uniform attention, ~1e-3 of v and o's), so an ulp of reordering
    in the terms is many ulp of the sum: ~2e-7 at most seeds, a few 1e-6 at some. The grad norm is the most
    sensitive record: it is the derivative at weights that differ by those roundings, and at lr 1e-2 a late step can
    amplify them ~100x. A real error is of order 1e-1: ranks that never all-reduce end with weights 0.3-0.4 apart."""
    a, b = ({(r["step"], k): r[k] for r in records(d) for k in ("loss", "val_loss", "grad_norm") if k in r}
            for d in (out_a, out_b))
    assert a.keys() == b.keys() and len(a) > 10
    for key in a:
        tol = grad_norm_rel if key[1] == "grad_norm" else rel
        assert abs(a[key] - b[key]) <= tol * abs(a[key]), (key, a[key], b[key], f"seed {SEED}")
    wa, wb = (load_file(os.path.join(d, "ckpt", "model.safetensors")) for d in (out_a, out_b))
    assert wa.keys() == wb.keys()
    for name in wa:
        err = ((wa[name] - wb[name]).norm() / wa[name].norm()).item()
        assert err < weights_rel, (name, err, f"seed {SEED}")


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    """out_dir of a 6-step run, made once per (mode, micro-steps per rank): "ddp" and "fsdp" on 2 ranks (with 2
    micro-steps, rank 0 takes micro-batches 0 and 2 of each step, rank 1 takes 1 and 3), "none" one process with
    twice the micro-steps: the same global batch."""
    made = {}

    def get(mode, accum=2):
        if (mode, accum) not in made:
            out_dir = str(tmp_path_factory.mktemp(f"{mode}{accum}"))
            args = [*TINY, *STEPS, f"--data_dir={corpus}", f"--out_dir={out_dir}"]
            if mode == "none":
                run("train.py", *args, f"--grad_accum={2 * accum}", env=ONE_THREAD)
            else:
                torchrun(*args, f"--grad_accum={accum}", f"--parallel={mode}")
            made[mode, accum] = out_dir
        return made[mode, accum]
    return get


def batch_lists(batch):
    return batch.tokens.tolist(), batch.labels.tolist(), batch.cu_seqlens.tolist(), batch.positions.tolist()


@pytest.mark.parametrize("mode", MODES)
def test_loader_ranks_interleave_one_stream(corpus, mode):
    rounds = 20  # ~3 epochs of the tiny corpus: the shares cross epoch boundaries
    make = lambda **kw: PackedLoader(corpus, "train", 256, 64, mode=mode, seed=SEED, **kw)  # noqa: E731
    single = make()
    stream = [batch_lists(b) for _, b in zip(range(4 * rounds), single)]
    for world_size in (2, 3):
        shards = [make(rank=r, world_size=world_size) for r in range(world_size)]
        iters = [iter(s) for s in shards]
        for i in range(rounds):
            for r in range(world_size):
                assert batch_lists(next(iters[r])) == stream[i * world_size + r], (mode, world_size, i, r)
            # every rank holds the cursor of one loader that served all i + 1 rounds
            reference = make()
            for _ in zip(range((i + 1) * world_size), reference):
                pass
            assert all(s.state_dict() == reference.state_dict() for s in shards)
        # resume rank 1 from that cursor: it goes on with its share of the stream
        resumed = make(rank=1, world_size=world_size)
        resumed.load_state_dict(json.loads(json.dumps(shards[0].state_dict())))
        assert batch_lists(next(iter(resumed))) == batch_lists(next(iters[1]))
    with pytest.raises(ValueError, match="rank 2"):
        make(rank=2, world_size=2)


@pytest.mark.parametrize("mode, accum", [("ddp", 2), ("fsdp", 2), ("ddp", 1)])
def test_distributed_run_equals_one_process(runs, mode, accum):
    assert_close_runs(runs("none", accum), runs(mode, accum))
    grad_norms = [r["grad_norm"] for r in records(runs(mode, accum)) if "grad_norm" in r]
    assert max(grad_norms) > 0.5  # clipping at 0.5 took part: the clipped norm is computed over all ranks
    if (mode, accum) == ("ddp", 1):
        # One micro-step per rank: the all-reduce adds the same two micro-step gradients that one process adds, in
        # the same order (a + b), and the scalings by 2 are exact: weights and grad norms to the bit.
        assert grad_norms == [r["grad_norm"] for r in records(runs("none", 1)) if "grad_norm" in r], f"seed {SEED}"
        wa, wb = (load_file(os.path.join(runs(m, 1), "ckpt", "model.safetensors")) for m in ("none", "ddp"))
        assert all(torch.equal(wa[name], wb[name]) for name in wa), f"seed {SEED}"


def test_fsdp_with_activation_checkpointing_equals_one_process(runs, corpus, tmp_path):
    # checkpoint(block) re-runs a sharded block's forward in backward: FSDP2 gathers its weights again for it
    out_dir = str(tmp_path / "fsdp_ckpt")
    torchrun(*TINY, *STEPS, f"--data_dir={corpus}", f"--out_dir={out_dir}", "--grad_accum=2", "--parallel=fsdp",
             "--checkpoint_layers=2")
    assert_close_runs(runs("none", 2), out_dir)


def test_fsdp_fp8_equals_one_process_to_the_bit(corpus, tmp_path):
    """FP8 block Linears (on the CPU the exact simulation) under FSDP2: each block's weights are gathered whole for
    its products, so every code and product is the one process's. With one micro-step per rank the reduce-scatter
    adds the same two gradients, and without clipping (whose norm FSDP sums shard by shard) every update is the
    same: weights to the bit after 4 steps."""
    args = [*TINY, "--device=cpu", "--max_steps=4", "--eval_interval=2", "--learning_rate=1e-2", "--grad_clip=0",
            f"--seed={SEED}", "--fp8=True", f"--data_dir={corpus}"]  # (TINY's ffn_dim 64: FP8 needs multiples of 16)
    one, sharded = str(tmp_path / "one"), str(tmp_path / "fsdp")
    run("train.py", *args, "--grad_accum=2", f"--out_dir={one}", env=ONE_THREAD)
    torchrun(*args, "--grad_accum=1", "--parallel=fsdp", f"--out_dir={sharded}")
    wa, wb = (load_file(os.path.join(d, "ckpt", "model.safetensors")) for d in (one, sharded))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[name], wb[name]) for name in wa), f"seed {SEED}"
    assert losses(sharded) == pytest.approx(losses(one), rel=1e-6)  # (the logged mean: summed in another order)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_distributed_resume_is_exact(runs, corpus, tmp_path, mode):
    part, single = str(tmp_path / "part"), str(tmp_path / "single")
    args = [*TINY, *STEPS, f"--data_dir={corpus}", "--grad_accum=2", f"--parallel={mode}"]
    torchrun(*args, f"--out_dir={part}", "--stop_at_step=3")
    assert max(losses(part)) == 3
    shutil.copytree(part, single)
    torchrun(*args, f"--out_dir={part}", "--init_from=resume")
    assert losses(part) == losses(runs(mode))  # to the bit
    for name, w in load_file(os.path.join(runs(mode), "ckpt", "model.safetensors")).items():
        assert torch.equal(w, load_file(os.path.join(part, "ckpt", "model.safetensors"))[name]), name
    # the checkpoint holds whole tensors, whatever the mode: one process resumes it (grad_accum 2 x 2 ranks = 4)
    run("train.py", *TINY, *STEPS, f"--data_dir={corpus}", "--grad_accum=4", f"--out_dir={single}",
        "--init_from=resume", env=ONE_THREAD)
    assert_close_runs(runs("none"), single)


def test_nan_loss_stops_every_rank(corpus, tmp_path):
    out_dir = str(tmp_path / "nan")
    proc = torchrun(*TINY, f"--data_dir={corpus}", f"--out_dir={out_dir}", "--max_steps=20", "--learning_rate=1e30",
                    "--warmup_steps=0", "--grad_clip=1e30", "--parallel=ddp", check=False)  # a hang fails by timeout
    assert proc.returncode == 1 and "non-finite loss or gradient at step" in proc.stderr, proc.stdout + proc.stderr
    assert not os.path.exists(os.path.join(out_dir, "ckpt"))


def test_sigterm_stops_all_ranks_with_one_checkpoint(corpus, tmp_path):
    """A scheduler stopping torchrun: it passes SIGTERM to every rank; they finish the step, save it, exit."""
    out_dir = str(tmp_path / "term")
    proc = subprocess.Popen(torchrun_command(*TINY, f"--data_dir={corpus}", f"--out_dir={out_dir}",
                                             "--max_steps=100000", "--eval_interval=100000", "--parallel=fsdp"),
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = sigterm_after_first_step(proc, out_dir, timeout=25)  # torchrun kills ranks not done in 30 s
    assert "interrupted: stopping after step" in output, output
    assert " per rank) |" in output, output  # throughput per process: these ranks are CPU processes, not GPUs
    state = json.load(open(os.path.join(out_dir, "ckpt", "train_state.json")))
    assert state["step"] == max(losses(out_dir)) > 0, output


def test_torchrun_without_parallel_is_refused(corpus):
    proc = torchrun(*TINY, f"--data_dir={corpus}", check=False)
    assert proc.returncode != 0 and "parallel='none'" in proc.stderr, proc.stderr
