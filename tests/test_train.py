"""train.py and sample.py end to end on a tiny corpus: runs, exact resume, checkpoints, errors."""
import base64
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from checkpoint import load_model, model_tensors, save_checkpoint
from model import Llama, LlamaConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_SHAPE = ["--dim=32", "--n_layers=2", "--n_heads=4", "--n_kv_heads=2", "--ffn_dim=64"]  # a new model's
TINY = TINY_SHAPE + ["--max_seq_len=64", "--tokens_per_micro_step=256", "--grad_accum=2", "--warmup_steps=2",
                     "--eval_tokens=512", "--log_interval=1"]


def run(script, *args, check=True, env=None):
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from data.prepare import prepare
    src = tmp_path_factory.mktemp("src")
    for i in range(40):
        (src / f"doc{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * (1 + i % 5))
    out = str(tmp_path_factory.mktemp("data") / "tiny")
    prepare([str(src)], out, tokenizer="bytes", val_fraction=0.1, seed=0)
    return out


def losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def test_train_learns_then_resume_is_exact(corpus, tmp_path):
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    common = TINY + [f"--data_dir={corpus}", "--max_steps=12", "--eval_interval=6", "--learning_rate=1e-2"]
    out = run("train.py", *common, f"--out_dir={full}").stdout
    assert "val loss" in out and os.path.isfile(os.path.join(full, "ckpt", "model.safetensors"))
    first, last = losses(full)[1], losses(full)[12]
    assert last < first - 0.5, (first, last)
    # stop after 6 steps (as a time-boxed job would), then resume: the same losses as the uninterrupted run
    run("train.py", *common, f"--out_dir={part}", "--stop_at_step=6")
    assert max(losses(part)) == 6
    run("train.py", *common, f"--out_dir={part}", "--init_from=resume")
    assert losses(part) == losses(full)


def test_resume_takes_the_runs_own_settings(corpus, tmp_path):
    """--init_from=resume --out_dir=DIR is the whole command: the run's data, model, schedule and tokens come from
    its train_state.json, and it continues exactly; a setting given again that differs is said in one line."""
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    common = TINY + [f"--data_dir={corpus}", "--max_steps=8", "--eval_interval=4", "--learning_rate=1e-2"]
    run("train.py", *common, f"--out_dir={full}")
    run("train.py", *common, f"--out_dir={part}", "--stop_at_step=4")
    out = run("train.py", "--init_from=resume", f"--out_dir={part}", "--stop_at_step=6").stdout
    assert "resume: the run's own settings" in out and f"data_dir={corpus!r}" in out and "max_steps=8" in out, out
    assert "init_from" not in out, out  # (a resume always changes it: no news)
    out = run("train.py", "--init_from=resume", f"--out_dir={part}", "--log_interval=2").stdout
    assert "resume: changed from the run's settings: log_interval 1 -> 2" in out, out
    assert losses(part) == {k: v for k, v in losses(full).items() if k <= 6 or k % 2 == 0}
    # a model setting given again that differs is refused, naming it
    proc = run("train.py", "--init_from=resume", f"--out_dir={full}", "--max_steps=9", "--dim=64", check=False)
    assert proc.returncode == 1 and "dim=64 (it has 32)" in proc.stderr, proc.stderr
    # the checkpoint itself given as out_dir: the run's folder is named
    proc = run("train.py", "--init_from=resume", f"--out_dir={full}/ckpt", check=False)
    assert proc.returncode == 1 and f"resume names the run's folder, --out_dir={full}\n" in proc.stderr, proc.stderr
    # training a finished run further changes its schedule: said, with no advice that would undo it
    proc = run("train.py", "--init_from=resume", f"--out_dir={full}", "--max_steps=9")
    assert "warning: max_steps 8 -> 9: the learning-rate schedule changes" in proc.stderr, proc.stderr
    assert "--max_steps=8" not in proc.stderr, proc.stderr


def test_sample_runs_from_a_checkpoint(corpus, tmp_path):
    out_dir = str(tmp_path / "run")
    out = run("train.py", *TINY, f"--data_dir={corpus}", f"--out_dir={out_dir}", "--max_steps=2",
              "--eval_interval=2").stdout
    assert f"{json.load(open(os.path.join(corpus, 'meta.json')))['splits']['train']['tokens']:,} train tokens" in out
    assert "block Linears in float32" in out, out  # (on the CPU: no autocast, fp32 weights)
    out = run("sample.py", f"--ckpt={out_dir}/ckpt", "--prompt=def f", "--max_new_tokens=20").stdout
    assert "sample 1" in out and "def f" in out
    out = run("sample.py", f"--ckpt={out_dir}/ckpt", "--prompt=123", "--max_new_tokens=2").stdout
    assert "\n123" in out, out  # a prompt that reads as a number is still text
    # a tiny temperature is greedy sampling (the logits / temperature would overflow to NaN probabilities)
    greedy, tiny = (run("sample.py", f"--ckpt={out_dir}/ckpt", f"--temperature={t}", "--max_new_tokens=8").stdout
                    for t in ("0", "1e-40"))
    assert greedy.split("----")[-1] == tiny.split("----")[-1], (greedy, tiny)
    # the checkpoint as the tokenizer of new data (byte tokens: it has no tokenizer file)
    (tmp_path / "doc.txt").write_text("def g(y):\n    return y\n")
    run("data/prepare.py", "--tokenizer", f"{out_dir}/ckpt", "--out", str(tmp_path / "data"), str(tmp_path / "doc.txt"))
    assert json.load(open(tmp_path / "data" / "meta.json"))["tokenizer"] == "bytes"
    # a shape setting beside a checkpoint to start from would be dropped: refused
    proc = run("train.py", f"--init_from={out_dir}", "--dim=64", f"--data_dir={corpus}",
               f"--out_dir={tmp_path / 'shape'}", check=False)
    assert proc.returncode == 1 and "brings its own model, but dim=64 (it has 32)" in proc.stderr, proc.stderr
    # an out_dir works where a checkpoint is expected: sample.py, and a new run's init_from
    assert "sample 1" in run("sample.py", f"--ckpt={out_dir}", "--max_new_tokens=5").stdout
    run("train.py", *TINY, f"--data_dir={corpus}", f"--out_dir={tmp_path / 'second'}", f"--init_from={out_dir}",
        "--max_steps=1", "--eval_interval=1")
    assert os.path.isfile(tmp_path / "second" / "ckpt" / "model.safetensors")


def test_the_run_is_drawn_and_can_go_to_wandb(corpus, tmp_path):
    """At each evaluation train.py redraws out_dir/loss.svg (plot.py; tests/test_plot.py checks the drawing) with
    the tokens seen; with wandb_log=True the same records go to Weights & Biases (here in its offline mode)."""
    import xml.etree.ElementTree as ET
    wandb = pytest.importorskip("wandb")  # the test extras install it
    out_dir = str(tmp_path / "drawn")
    run("train.py", *TINY, f"--data_dir={corpus}", f"--out_dir={out_dir}", "--max_steps=4", "--eval_interval=2",
        "--wandb_log=True", env={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"})
    svg = ET.parse(os.path.join(out_dir, "loss.svg")).getroot()
    texts = [t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")]
    assert "drawn" in texts and any(t.endswith(" tok") and t != "0 tok" for t in texts), texts
    records = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    tokens = [r["tokens"] for r in records if "tokens" in r]
    assert tokens == sorted(tokens) and tokens[0] > 0
    logged = [os.path.getsize(p) for p in glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))]
    assert len(logged) == 1 and logged[0] > 0, wandb.__version__


def test_user_slips_are_one_line(corpus, tmp_path):
    """An HF directory given as a checkpoint, max_steps inside the warmup, CUDA on a CPU torch: each said in a line;
    a run that fails before its first step leaves no out_dir behind."""
    hf = tmp_path / "Llama-3.2-1B"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama", "hidden_size": 2048}')
    proc = run("train.py", f"--init_from={hf}", f"--data_dir={corpus}", f"--out_dir={tmp_path / 'a'}", check=False)
    assert proc.returncode == 1 and f"{hf} is a Hugging Face model directory: convert it first: python convert.py " \
        f"hf2nano {hf} NEW_DIR" in proc.stderr, proc.stderr
    assert not os.path.exists(tmp_path / "a")  # no out_dir holding only train.lock
    out_dir = str(tmp_path / "short")
    proc = run("train.py", *TINY, f"--data_dir={corpus}", f"--out_dir={out_dir}", "--max_steps=3", "--warmup_steps=30",
               "--eval_interval=3")
    assert "warmup_steps=30 is not below max_steps=3: warmup shortened to 1 step" in proc.stderr, proc.stderr
    lrs = [json.loads(line)["lr"] for line in open(os.path.join(out_dir, "metrics.jsonl")) if '"lr"' in line]
    assert lrs[-1] < lrs[0], lrs  # decayed, not still rising
    # fine-tuning on data in another tokenizer's ids (as many of them: the vocabulary check passes) is refused
    with open(tmp_path / "tokenizer.model", "w") as f:  # the 256 bytes in reverse order
        f.writelines(f"{base64.b64encode(bytes([255 - i])).decode()} {i}\n" for i in range(256))
    (tmp_path / "doc.txt").write_text("def f(x):\n    return x\n" * 20)
    run("data/prepare.py", "--tokenizer", str(tmp_path / "tokenizer.model"), "--out", str(tmp_path / "other"),
        str(tmp_path / "doc.txt"))
    proc = run("train.py", f"--init_from={out_dir}", f"--data_dir={tmp_path / 'other'}",
               f"--out_dir={tmp_path / 'ft'}", check=False)
    assert proc.returncode == 1 and proc.stderr == f"error: the data in {tmp_path / 'other'} was tokenized with " \
        f"tokenizer.model, not with the tokenizer of {out_dir}/ckpt (bytes): prepare it again with --tokenizer " \
        f"{out_dir}/ckpt\n", proc.stderr
    (tmp_path / "a_file").write_text("")
    proc = run("train.py", f"--out_dir={tmp_path / 'a_file'}", f"--data_dir={corpus}", check=False)
    assert proc.returncode == 1 and proc.stderr == f"error: out_dir {tmp_path / 'a_file'} is a file: name a folder\n"
    if not torch.cuda.is_available():
        proc = run("train.py", "--device=cuda", check=False)
        assert proc.returncode == 1 and proc.stderr == "error: device='cuda' but this torch has no CUDA (a CPU " \
            "build, or no GPU visible): use --device=cpu\n", proc.stderr


def test_nan_loss_stops_the_run_before_the_update(corpus, tmp_path):
    out_dir = str(tmp_path / "nan")
    proc = run("train.py", *TINY, f"--data_dir={corpus}", f"--out_dir={out_dir}", "--max_steps=20",
               "--learning_rate=1e30", "--warmup_steps=0", "--grad_clip=1e30", check=False)
    assert proc.returncode == 1 and "non-finite loss or gradient at step" in proc.stderr, proc.stdout + proc.stderr
    assert not os.path.exists(os.path.join(out_dir, "ckpt"))  # nothing was saved from the broken state


@pytest.mark.parametrize("args, message", [
    (["--no_such_key=1"], "unknown setting 'no_such_key'"),
    (["--max_steps=ten"], "'max_steps' must be int (default 600)"),
    (["--learning_rate"], "expected --key=value"),
    (["configs/does_not_exist.py"], "cannot read config file"),
    (["--init_from=/nonexistent/ckpt"], "convert.py hf2nano"),
    (["--data_dir=/nonexistent/data"], "python data/prepare.py"),
    (["--model_preset=llama9"], "is not one of"),
    (["--learning_rate=1e-4"], "min_lr=0.0003 is above learning_rate=0.0001"),
    (["--parallel=tp"], "expected 'none', 'ddp' or 'fsdp'"),
    (["--parallel=ddp"], "runs under torchrun"),
    (["--optimizer_in_backward=True"], "optimizer_in_backward=True needs optimizer_name='adamw_kahan'"),
    (["--optimizer_offload=1.0"], "use it with optimizer_name='adamw8bit' (got 'adamw')"),
    (["--optimizer_offload=2.0"], "optimizer_offload=2.0: expected a share of the optimizer state from 0 to 1"),
    (["--max_seq_len=8192"], "max_seq_len=8192 must be between 1 and tokens_per_micro_step=4096"),
    (["--pack_mode=rows"], "pack_mode='rows': expected one of"),
    (["--eval_interval=0"], "eval_interval=0: expected 1 or more"),
    (["--grad_accum=0"], "grad_accum=0: expected 1 or more"),
    (["--max_steps=-5"], "max_steps=-5: expected 1 or more"),
    (["--grad_clip=-1"], "grad_clip=-1.0: expected 0 or more"),
    (["--beta2=1"], "beta1=0.9, beta2=1.0: each expected in [0, 1)"),
    (["--dtype=fp16"], "dtype='fp16': expected 'auto', 'float32', 'bfloat16' or 'float16'"),
    (["--seed=-1"], "seed=-1: expected 0 .. 2**63 - 1"),
])
def test_configuration_errors_name_the_problem(args, message):
    proc = run("train.py", *args, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--n_layers=0"], "error: the model's settings: n_layers=0: expected a positive int"),
    (["--dim=100"], "error: the model's settings: head_dim=33 must be even for RoPE"),
    (["--activation=relu"], "error: the model's settings: activation='relu': expected one of"),
])
def test_model_setting_errors_are_one_line(corpus, tmp_path, args, message):
    proc = run("train.py", *args, f"--data_dir={corpus}", f"--out_dir={tmp_path / 'm'}", check=False)
    assert proc.returncode == 1 and proc.stderr.startswith(message), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.parametrize("script, flag, setting", [("train.py", "--help", "max_steps"), ("sample.py", "-h", "top_k")])
def test_help_prints_usage_and_settings(script, flag, setting):
    out = run(script, flag).stdout
    assert f"python {script}" in out and f"at the top of {script}" in out and setting in out, out
    default = {"train.py": "--max_seq_len=512  longest document piece;", "sample.py": "--top_k=40  0: no top-k"}
    assert default[script] in out, out  # each setting with its default and its comment


def test_help_into_a_closed_pipe_is_quiet():
    """`python train.py --help | head -2`: the reader may stop before the help is written; it exits 0 without a
    BrokenPipeError. (Here the reader is gone before the first write: the pipe is closed as the process starts.)"""
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), "--help"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    stderr = proc.stderr.read()
    assert proc.wait(timeout=60) == 0 and stderr == "", stderr


def test_a_config_file_changes_only_what_it_names(tmp_path):
    # the defaults at the top of train.py stay in force under a config file (no hidden default config)
    config = tmp_path / "mine.py"
    config.write_text("eval_interval = 7\n")
    proc = run("train.py", str(config), "--max_steps=1.5", check=False)
    assert proc.returncode != 0 and "'max_steps' must be int (default 600)" in proc.stderr, proc.stderr


def test_config_file_error_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("max_steps = 3\nlearning_rate = (\n")
    proc = run("train.py", str(bad), check=False)
    assert proc.returncode != 0 and "bad.py" in proc.stderr and "line" in proc.stderr, proc.stderr


def test_one_text_file_trains(tmp_path):
    # a single document: prepare.py holds out its tail as the val document, and train.py evaluates on it
    from data.prepare import prepare
    (tmp_path / "notes.txt").write_text("".join(f"note {i}: remember item {i * 7 % 13}.\n" for i in range(400)))
    prepare([str(tmp_path / "notes.txt")], tmp_path / "data")
    out = run("train.py", *TINY, f"--data_dir={tmp_path / 'data'}", f"--out_dir={tmp_path / 'run'}", "--max_steps=2",
              "--eval_interval=2").stdout
    assert "step 2: val loss" in out, out


def damage(data_dir, how):
    """Break a copy of a prepared dataset in one of the ways a user's files can be broken."""
    if how == "val.bin missing":
        os.remove(data_dir / "val.bin")
    elif how == "idx past the tokens":
        idx = np.load(data_dir / "train.idx.npy")
        idx[-1] += 5
        np.save(data_dir / "train.idx.npy", idx)
    elif how == "val split empty":
        np.save(data_dir / "val.idx.npy", np.zeros(1, dtype=np.int64))
        open(data_dir / "val.bin", "wb").close()
    elif how == "val without targets":  # user-only chats: every mask entry 0
        np.zeros(os.path.getsize(data_dir / "val.bin") // 4, np.uint8).tofile(data_dir / "val.mask.bin")
    elif how == "token past the vocabulary":
        tokens = np.fromfile(data_dir / "val.bin", dtype=np.uint32)
        tokens[3] = 9999
        tokens.tofile(data_dir / "val.bin")
    elif how == "meta.json damaged":
        (data_dir / "meta.json").write_text("{")


@pytest.mark.parametrize("how, message", [
    ("val.bin missing", "val.bin not found"),
    ("idx past the tokens", "train.idx.npy: expected increasing document offsets"),
    ("val split empty", "the val split has no documents"),
    ("val without targets", "has no target token"),
    ("token past the vocabulary", "val.bin: token id 9999"),
    ("meta.json damaged", "meta.json: damaged, not JSON"),
])
def test_data_problems_are_one_error_line(corpus, tmp_path, how, message):
    data_dir = tmp_path / "data"
    shutil.copytree(corpus, data_dir)
    damage(data_dir, how)
    proc = run("train.py", *TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'run'}", check=False)
    assert proc.returncode == 1 and proc.stderr.startswith("error: ") and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_sample_past_max_seq_len(corpus, tmp_path):
    # TINY's max_seq_len is 64: a 191-token prompt is cut to its last 64 tokens, and 150 new tokens go on past 64
    # over the most recent ones; every one of them is generated (greedy: no stop token by chance)
    out_dir = str(tmp_path / "run")
    run("train.py", *TINY, f"--data_dir={corpus}", f"--out_dir={out_dir}", "--max_steps=2", "--eval_interval=2")
    proc = run("sample.py", f"--ckpt={out_dir}/ckpt", "--prompt=" + "def f(x): return x\n" * 10,
               "--max_new_tokens=150", "--temperature=0", "--num_samples=2")
    assert proc.stdout.count("(150 tokens,") == 2, proc.stdout + proc.stderr
    assert "the prompt is 191 tokens, more than the model's max_seq_len (64): it sees only the last 64" in proc.stderr, proc.stderr
    assert "starts over from the last 32" in proc.stderr, proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--temperature=-0.5"], "error: temperature=-0.5: expected 0 (greedy) or more"),
    (["--top_k=-1"], "error: top_k=-1: expected 0 (no top-k filter) or more"),
    (["--num_samples=0"], "error: num_samples=0: expected 1 or more"),
    (["--temperature=1e999"], "error: temperature=inf: expected 0 (greedy) or more, finite"),
    (["--seed=-1"], "error: seed=-1: expected 0 .. 2**63 - 1"),
    (["--max_new_tokens=-1"], "error: max_new_tokens=-1: expected 0 or more"),
    (["--device=gpu"], "error: device='gpu': expected auto, cpu, cuda or cuda:N"),
    (["--device=cuda:x"], "error: device='cuda:x': expected auto, cpu, cuda or cuda:N"),
    (["--device=cuda"], "error: --device=cuda but this torch has no CUDA (a CPU build, or no GPU visible): use "
                        "--device=cpu"),
    (["--device=cuda:1"], "error: --device=cuda:1 but this torch has no CUDA"),
])
def test_sample_setting_errors_are_one_line_before_the_model_loads(args, message):
    # no checkpoint at --ckpt: the setting is reported, not the missing checkpoint; no GPU visible, even on a GPU host
    proc = run("sample.py", "--ckpt=/nonexistent/ckpt", *args, check=False, env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 1 and proc.stderr.startswith(message), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_sample_shows_only_the_end_of_a_long_prompt(tmp_path):
    cfg = LlamaConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=512, max_seq_len=64)
    save_checkpoint(str(tmp_path / "ckpt"), cfg, "bytes", model_tensors(Llama(cfg)))
    prompt = "".join(f"line {i}\n" for i in range(100))  # 790 characters
    out = run("sample.py", f"--ckpt={tmp_path / 'ckpt'}", f"--prompt={prompt}", "--max_new_tokens=5").stdout
    shown = out.split(" ----\n", 1)[1]
    assert shown.startswith("…line 75\n") and shown.startswith("…" + prompt[-200:]), out  # lines 75 .. 99
    assert "line 74\n" not in shown and "line 0\n" not in shown, out
    short = prompt[:500]  # up to 500 characters: shown whole
    out = run("sample.py", f"--ckpt={tmp_path / 'ckpt'}", f"--prompt={short}", "--max_new_tokens=5").stdout
    assert out.split(" ----\n", 1)[1].startswith(short), out


def test_checkpoint_round_trip(tmp_path):
    for tied in (False, True):
        model = Llama(LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=1, ffn_dim=48, vocab_size=70,
                                  tie_embeddings=tied))
        save_checkpoint(str(tmp_path / "ck"), model.cfg, "bytes", model_tensors(model))
        loaded = load_model(str(tmp_path / "ck"))
        for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
            assert torch.equal(a, b), name
        assert (loaded.lm_head.weight is loaded.embed_tokens.weight) == tied
    # a checkpoint whose weights don't fit its config is refused with the tensor's name
    cfg_path = tmp_path / "ck" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model"]["ffn_dim"] = 50
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="mlp.gate_proj.weight"):
        load_model(str(tmp_path / "ck"))


def test_bf16_weights_with_kahan_adamw_train(corpus, tmp_path):
    out_dir = str(tmp_path / "bf16")
    run("train.py", *TINY, f"--data_dir={corpus}", f"--out_dir={out_dir}", "--max_steps=12", "--eval_interval=6",
        "--learning_rate=1e-2", "--weights_dtype=bfloat16", "--optimizer_name=adamw_kahan")
    assert losses(out_dir)[12] < losses(out_dir)[1] - 0.5
    assert load_model(os.path.join(out_dir, "ckpt")).embed_tokens.weight.dtype == torch.bfloat16
    # bf16 weights with plain AdamW would silently lose small updates: refused with the reason
    proc = run("train.py", f"--data_dir={corpus}", "--weights_dtype=bfloat16", check=False)
    assert proc.returncode != 0 and "adamw_kahan" in proc.stderr


def sigterm_after_first_step(proc, out_dir, timeout):
    """Send SIGTERM to a training process (train.py or torchrun) once a step is logged; its output."""
    def step_logged():
        try:
            return bool(losses(out_dir))
        except (OSError, ValueError):  # no file yet, or its last line half written
            return False

    try:
        deadline = time.time() + 60
        while not step_logged():
            assert time.time() < deadline and proc.poll() is None, "training did not start"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        return proc.communicate(timeout=timeout)[0]
    finally:
        proc.kill()


def test_sigterm_in_the_first_evaluation_stops_at_once(corpus, tmp_path):
    # Nothing to save before the first step: the run ends at once, with a message and no checkpoint (a real-size
    # model's evaluation on a CPU would otherwise hold the stop for minutes: train.py's wakeup-fd thread).
    data_dir, out_dir = tmp_path / "data", tmp_path / "run"
    shutil.copytree(corpus, data_dir)
    tokens, idx = np.fromfile(data_dir / "train.bin", dtype=np.uint32), np.load(data_dir / "train.idx.npy")
    copies = 300_000 // len(tokens) + 1  # a val split of 300K tokens: an evaluation of many seconds
    np.tile(tokens, copies).tofile(data_dir / "val.bin")
    np.save(data_dir / "val.idx.npy", np.append(0, (idx[1:] + len(tokens) * np.arange(copies)[:, None]).ravel()))
    args = TINY + [f"--data_dir={data_dir}", f"--out_dir={out_dir}", "--eval_tokens=300000", "--device=cpu"]
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=ROOT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        lines = [proc.stdout.readline() for _ in range(3)]
        assert "step 0: evaluating" in lines[-1], lines
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        t0 = time.time()
        err = proc.communicate(timeout=30)[1]
    finally:
        proc.kill()
    assert proc.returncode == 130 and "interrupted before the first step" in err, err
    assert time.time() - t0 < 5 and not os.path.exists(out_dir / "ckpt")


def grad_norms(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [r["grad_norm"] for r in map(json.loads, f) if "grad_norm" in r]


def test_optimizer_in_backward_trains_like_a_step_after_backward(corpus, tmp_path):
    # The same updates, made during backward instead of after it: the same losses, to the bit. One block uses
    # activation checkpointing in both runs (it must not change anything either).
    after, during = str(tmp_path / "after"), str(tmp_path / "during")
    # On the CPU on any machine: on CUDA the attention autotuner, timing each run afresh, may pick other tiles
    # (another summation order) in the two runs. tests/test_optim.py compares the two paths on CUDA in one process.
    common = TINY + [f"--data_dir={corpus}", "--max_steps=6", "--eval_interval=6", "--learning_rate=1e-2",
                     "--optimizer_name=adamw_kahan", "--grad_accum=1", "--grad_clip=0", "--checkpoint_layers=1",
                     "--device=cpu"]
    run("train.py", *common, f"--out_dir={after}")
    run("train.py", *common, f"--out_dir={during}", "--optimizer_in_backward=True")
    assert losses(during) == losses(after)
    resumed = str(tmp_path / "resumed")  # and a stop + resume in the middle changes nothing either
    run("train.py", *common, f"--out_dir={resumed}", "--optimizer_in_backward=True", "--stop_at_step=3")
    run("train.py", *common, f"--out_dir={resumed}", "--optimizer_in_backward=True", "--init_from=resume")
    assert losses(resumed) == losses(after)
    for a, b in zip(grad_norms(during), grad_norms(after)):  # the hooks' norm, summed in another order
        assert abs(a - b) <= 1e-5 * b
    proc = run("train.py", *common, f"--out_dir={tmp_path / 'new'}", "--checkpoint_layers=3", check=False)
    assert proc.returncode != 0 and "checkpoint_layers=3: expected 0 .. n_layers=2" in proc.stderr, proc.stderr


def test_sigterm_with_optimizer_in_backward_saves_a_whole_step(corpus, tmp_path):
    """The weights change during backward: a stop must wait for the end of the step, so the checkpoint holds
    exactly `step` updates of every weight (each parameter's own Adam step count says how many it took)."""
    out_dir = str(tmp_path / "term")
    args = TINY + [f"--data_dir={corpus}", f"--out_dir={out_dir}", "--max_steps=100000", "--eval_interval=100000",
                   "--optimizer_name=adamw_kahan", "--grad_accum=1", "--grad_clip=0", "--optimizer_in_backward=True"]
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=ROOT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = sigterm_after_first_step(proc, out_dir, timeout=60)
    assert proc.returncode == 130 and "interrupted: stopping after step" in output, output
    state = json.load(open(os.path.join(out_dir, "ckpt", "train_state.json")))
    optimizer_state = load_file(os.path.join(out_dir, "ckpt", "optimizer.safetensors"))
    adam_steps = {int(t) for name, t in optimizer_state.items() if name.endswith(".step")}
    assert adam_steps == {state["step"]} and state["step"] == max(losses(out_dir)), (adam_steps, state["step"])
