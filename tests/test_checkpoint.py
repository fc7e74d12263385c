"""Checkpoints that survive: a full disk, kill -9 in the middle of a save, a second run on one out_dir, damaged
files. train.py runs as a subprocess; faults are injected by a wrapper that replaces one function of
checkpoint.py (the file writer, or the free-space probe) before train.py starts, or by a real small filesystem."""
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from checkpoint import lock_out_dir
from test_train import ROOT, TINY, corpus, losses, run  # noqa: F401  (corpus: the tiny corpus fixture)

STEPS = ["--max_steps=6", "--checkpoint_interval=2", "--eval_interval=100", "--learning_rate=1e-2"]
# The wrapper: `patch` (Python source) runs after checkpoint is imported and before train.py, in one process.
WRAPPER = """import os, sys, runpy, errno, time
sys.path.insert(0, {root!r})
import checkpoint
{patch}
sys.argv = [{train!r}] + sys.argv[1:]
runpy.run_path({train!r}, run_name="__main__")
"""
# Writes of optimizer.safetensors number 1, 2, ...; those listed in FAIL end in ENOSPC after a few bytes.
FAIL_OPTIMIZER_WRITES = """
real_write, writes = checkpoint.write_safetensors, {{"optimizer": 0, "model": 0}}
def write_safetensors(path, entries, tensors, metadata=None):
    kind = os.path.basename(path).split(".")[0]
    writes[kind] += 1
    if writes[kind] in {fail}.get(kind, ()):
        with open(path, "wb") as f:
            f.write(b"half a file")
        raise OSError(errno.ENOSPC, "No space left on device", path)
    return real_write(path, entries, tensors, metadata)
checkpoint.write_safetensors = write_safetensors
"""


def train_patched(patch, *args, popen=False):
    command = [sys.executable, "-c", WRAPPER.format(root=ROOT, train=os.path.join(ROOT, "train.py"), patch=patch),
               *TINY, *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if popen:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def saved_step(ckpt):
    with open(os.path.join(ckpt, "config.json")) as f:
        return json.load(f)["step"]


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """An uninterrupted 6-step run: the losses every interrupted run must reproduce after its resume."""
    out_dir = str(tmp_path_factory.mktemp("reference"))
    run("train.py", *TINY, *STEPS, f"--data_dir={corpus}", f"--out_dir={out_dir}")
    return out_dir


def test_checkpoint_holds_no_pickle_and_files_share_permissions(reference):
    ckpt = os.path.join(reference, "ckpt")
    assert sorted(os.listdir(ckpt)) == ["config.json", "model.safetensors", "optimizer.safetensors",
                                        "train_state.json"]
    assert len({os.stat(os.path.join(ckpt, name)).st_mode for name in os.listdir(ckpt)}) == 1
    assert saved_step(ckpt) == 6


def test_full_disk_at_an_interval_save_warns_and_trains_on(corpus, reference, tmp_path):
    out_dir = str(tmp_path / "run")
    proc = train_patched(FAIL_OPTIMIZER_WRITES.format(fail={"optimizer": (2,)}), *STEPS, f"--data_dir={corpus}",
                         f"--out_dir={out_dir}")
    assert proc.returncode == 0, proc.stderr
    assert "warning: writing the step-4 checkpoint failed: [Errno 28] No space left on device" in proc.stderr
    assert "the previous checkpoint stays" in proc.stderr
    assert losses(out_dir) == losses(reference) and saved_step(os.path.join(out_dir, "ckpt")) == 6
    assert not os.path.exists(os.path.join(out_dir, "ckpt.tmp"))


def test_full_disk_at_the_final_save_keeps_the_weights(corpus, tmp_path):
    out_dir = str(tmp_path / "run")
    proc = train_patched(FAIL_OPTIMIZER_WRITES.format(fail={"optimizer": (3,)}), *STEPS, f"--data_dir={corpus}",
                         f"--out_dir={out_dir}")
    assert proc.returncode == 0, proc.stderr
    assert "writing the step-6 checkpoint failed" in proc.stderr and "trying the weights alone" in proc.stderr
    assert "saved the step-6 weights" in proc.stdout
    ckpt = os.path.join(out_dir, "ckpt")
    assert sorted(os.listdir(ckpt)) == ["config.json", "model.safetensors"] and saved_step(ckpt) == 6
    proc = run("train.py", *TINY, *STEPS, f"--data_dir={corpus}", f"--out_dir={out_dir}", "--init_from=resume",
               check=False)
    assert proc.returncode == 1 and "holds weights only" in proc.stderr and "--init_from=" in proc.stderr


def test_nothing_saved_exits_non_zero_and_the_previous_checkpoint_resumes_exactly(corpus, reference, tmp_path):
    out_dir = str(tmp_path / "run")
    fail = {"optimizer": (3,), "model": (4, 5)}  # step 6: the whole state, then the weights alone
    proc = train_patched(FAIL_OPTIMIZER_WRITES.format(fail=fail), *STEPS, f"--data_dir={corpus}", f"--out_dir={out_dir}")
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: step 6 could not be saved"), proc.stderr
    ckpt = os.path.join(out_dir, "ckpt")
    assert saved_step(ckpt) == 4 and not os.path.exists(ckpt + ".tmp")
    run("train.py", *TINY, *STEPS, f"--data_dir={corpus}", f"--out_dir={out_dir}", "--init_from=resume")
    assert losses(out_dir) == losses(reference)


def test_the_disk_is_checked_before_writing(corpus, tmp_path):
    """The whole state does not fit, the weights do: interval saves are skipped, the final one keeps the weights."""
    out_dir = str(tmp_path / "run")
    proc = train_patched("checkpoint.free_bytes = lambda path: 2**16 + 200_000", *STEPS, f"--data_dir={corpus}",
                         f"--out_dir={out_dir}")
    assert proc.returncode == 0, proc.stderr
    assert "warning: the step-2 checkpoint needs 0.49 MB, 0.27 MB are free at " + out_dir in proc.stderr
    assert "not saved" in proc.stderr and "saved the step-6 weights" in proc.stdout
    assert sorted(os.listdir(os.path.join(out_dir, "ckpt"))) == ["config.json", "model.safetensors"]


def test_a_real_small_filesystem(corpus, tmp_path):
    """The same on a 1 MB tmpfs (where this machine lets the test mount one): no fault is injected."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        out_dir = str(mount / "run")
        proc = run("train.py", *TINY, *STEPS, f"--data_dir={corpus}", f"--out_dir={out_dir}", "--dim=64",
                   "--ffn_dim=128", check=False)
        assert proc.returncode == 0, proc.stderr
        assert "checkpoint needs" in proc.stderr and "saved the step-6 weights" in proc.stdout
        assert not os.path.exists(os.path.join(out_dir, "ckpt.tmp"))
    finally:
        subprocess.run(["umount", str(mount)])


def test_kill_9_during_a_save_leaves_the_previous_checkpoint(corpus, reference, tmp_path):
    out_dir = str(tmp_path / "run")
    hang = """
real_write, writes = checkpoint.write_safetensors, [0]
def write_safetensors(path, entries, tensors, metadata=None):
    writes[0] += 1
    if writes[0] == 6:  # step 6's optimizer state: half written, then wait to be killed
        with open(path, "wb") as f:
            f.write(b"half a file")
        print("SAVING", flush=True)
        time.sleep(120)
    return real_write(path, entries, tensors, metadata)
checkpoint.write_safetensors = write_safetensors
"""
    proc = train_patched(hang, *STEPS, f"--data_dir={corpus}", f"--out_dir={out_dir}", popen=True)
    try:
        for line in proc.stdout:
            if line.startswith("SAVING"):
                break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    ckpt = os.path.join(out_dir, "ckpt")
    assert saved_step(ckpt) == 4 and os.path.exists(ckpt + ".tmp")  # what the killed save left
    run("train.py", *TINY, *STEPS, f"--data_dir={corpus}", f"--out_dir={out_dir}", "--init_from=resume")
    assert losses(out_dir) == losses(reference) and not os.path.exists(ckpt + ".tmp")


def test_one_run_per_out_dir(corpus, reference, tmp_path):
    out_dir = str(tmp_path / "locked")
    lock = lock_out_dir(out_dir)  # this test process plays the run that holds it
    try:
        proc = run("train.py", *TINY, f"--data_dir={corpus}", f"--out_dir={out_dir}", check=False)
        assert proc.returncode == 1 and f"in use by another training run (PID {os.getpid()})" in proc.stderr
    finally:
        lock.close()
    # a new run never replaces a checkpoint: it says how to resume, or where to go instead
    proc = run("train.py", *TINY, *STEPS, f"--data_dir={corpus}", f"--out_dir={reference}", check=False)
    assert proc.returncode == 1 and "already holds a checkpoint" in proc.stderr and "--init_from=resume" in proc.stderr
    assert saved_step(os.path.join(reference, "ckpt")) == 6


def test_resume_refuses_a_new_shape_and_says_when_there_is_nothing_to_do(corpus, reference, tmp_path):
    common = [*TINY, *STEPS, f"--data_dir={corpus}", f"--out_dir={reference}", "--init_from=resume"]
    proc = run("train.py", *common, "--dim=64", check=False)
    assert proc.returncode == 1 and "dim=64 (it has 32)" in proc.stderr, proc.stderr
    proc = run("train.py", *common)
    assert "nothing to do" in proc.stdout and "is at step 6" in proc.stdout
    out_dir = str(tmp_path / "longer")
    run("train.py", *TINY, *STEPS, f"--data_dir={corpus}", f"--out_dir={out_dir}", "--stop_at_step=4")
    proc = run("train.py", *TINY, *STEPS, f"--data_dir={corpus}", f"--out_dir={out_dir}", "--init_from=resume",
               "--max_steps=12", "--stop_at_step=5")
    assert "warning: max_steps 6 -> 12: the learning-rate schedule changes" in proc.stderr, proc.stderr
    assert "--max_steps=6" in proc.stderr


def damage(ckpt, case):
    """Break one file of the checkpoint directory ckpt, as a crash, a full disk or an old version would."""
    path = {"model": "model.safetensors", "optimizer": "optimizer.safetensors", "config": "config.json",
            "state": "train_state.json"}
    kind, how = case.split(":")
    target = os.path.join(ckpt, path.get(kind, ""))
    if how == "missing":
        os.remove(target)
    elif how == "empty":
        open(target, "w").close()
    elif how == "truncated":
        os.truncate(target, os.path.getsize(target) // 2)
    elif how == "newer":  # written by a later nanollama, whose format this one cannot know
        with open(target) as f:
            config = json.load(f)
        with open(target, "w") as f:
            json.dump({**config, "format": config["format"] + 1}, f)
    elif how == "pickle":  # a checkpoint of the previous format
        os.remove(os.path.join(ckpt, "train_state.json"))
        with open(os.path.join(ckpt, "train_state.pt"), "wb") as f:
            f.write(b"PK\x03\x04 pickled")


DAMAGE = {  # case: what the one error line must say
    "model:truncated": "model.safetensors: truncated",
    "model:empty": "model.safetensors: truncated or not a safetensors file",
    "model:missing": "model.safetensors: missing",
    "optimizer:truncated": "optimizer.safetensors: truncated",
    "optimizer:missing": "optimizer.safetensors: missing",
    "config:truncated": "config.json: damaged",
    "config:newer": "config.json: format 3, this nanollama reads format 2: update nanollama",
    "state:empty": "train_state.json: damaged",
    "state:pickle": "train_state.pt is a pickled training state of an older nanollama",
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_checkpoint_is_one_error_line(corpus, reference, tmp_path, case):
    out_dir = str(tmp_path / "run")
    shutil.copytree(reference, out_dir)
    ckpt = os.path.join(out_dir, "ckpt")
    damage(ckpt, case)
    commands = [["train.py", *TINY, *STEPS, "--max_steps=8", f"--data_dir={corpus}", f"--out_dir={out_dir}",
                 "--init_from=resume"]]
    if case.split(":")[0] in ("model", "config"):  # what the other scripts read
        commands += [["sample.py", f"--ckpt={ckpt}", "--max_new_tokens=4"],
                     ["convert.py", "nano2hf", ckpt, str(tmp_path / "hf")]]
    for command in commands:  # train.py may warn first (max_steps 6 -> 8); then one error line ends it
        proc = run(*command, check=False)
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode != 0 and "Traceback" not in proc.stderr and last.startswith("error: "), \
            (command[0], proc.stderr)
        assert DAMAGE[case] in last, (command[0], last)
