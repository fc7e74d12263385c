"""bench/fidelity.py on the CPU: the table's numbers and the verdict, the SVG, and one whole call (every run of a
setting, at once, as train.py subprocesses) with a tiny model for a few steps. The real runs need the GPU."""
import json
import os
import xml.etree.ElementTree as ET

import pytest

from bench import fidelity
from test_train import corpus  # noqa: F401 (the tiny corpus fixture)

TINY = ["--dim=32", "--n_layers=2", "--n_heads=4", "--n_kv_heads=2", "--ffn_dim=64", "--max_seq_len=32",
        "--device=cpu"]
SVG = "{http://www.w3.org/2000/svg}"


def curve(final, steps=100):
    """A falling loss that ends at `final`."""
    return {s: final + 1 / s - 1 / steps for s in range(1, steps + 1)}


def result(key, label, final, val):
    return dict(key=key, label=label, args=[], train=curve(final), val=val, wall=1.0)


def test_each_run_is_compared_with_its_reference_and_the_verdict_says_how_far():
    losses = {"bf16": (2.0, 1.7), "fp8": (2.02, 1.7), "bf16_twin": (1.99, 1.8), "fp8_twin": (1.99, None)}
    results = [result(key, label, *losses[key]) for key, label, _ in fidelity.runs("fp8")]
    rows, verdict = fidelity.summarize("fp8", results, window=10)
    assert [r["vs"] for r in rows.values()] == [None, "bf16", "bf16", "bf16_twin"]
    assert rows["fp8"]["train_loss"] == pytest.approx(2.02 + sum(1 / s for s in range(91, 101)) / 10 - 0.01)
    assert rows["fp8"]["train_diff_pct"] == pytest.approx(100 * (rows["fp8"]["train_loss"] / rows["bf16"]["train_loss"]
                                                                 - 1))
    assert rows["fp8_twin"]["train_diff_pct"] == pytest.approx(100 * (rows["fp8_twin"]["train_loss"]
                                                                      / rows["bf16_twin"]["train_loss"] - 1))
    assert rows["bf16_twin"]["val_diff_pct"] == pytest.approx(100 * (1.8 / 1.7 - 1))
    assert rows["fp8_twin"]["val_diff_pct"] is None  # no val loss: killed before the end
    assert verdict.startswith("fp8 final-window loss within 1.00% of bf16 (+1.00% at lr, +0.00% at lr x 1.001)")
    assert verdict.endswith("twin drift -0.50% (bf16 at lr x 1.001); cut short (no final val loss): fp8_twin")
    fidelity.print_table(rows)


def test_only_runs_an_arm_and_its_twin_and_compares_nothing_it_lacks():
    todo = fidelity.runs("adamw8bit", only=["adamw8bit"])
    assert [key for key, _, _ in todo] == ["adamw8bit", "adamw8bit_twin"]
    assert [args for _, _, args in todo] == [["--optimizer_name=adamw8bit", "--learning_rate=0.0003"],
                                             ["--optimizer_name=adamw8bit", "--learning_rate=0.0003003"]]
    rows, verdict = fidelity.summarize("adamw8bit", [result(k, label, 2.0, 1.7) for k, label, _ in todo])
    assert all(r["vs"] is None and r["train_diff_pct"] is None for r in rows.values())
    assert verdict == "adamw8bit vs adamw_kahan: not both run; no twin drift run"


def test_fp8_arm_is_the_bf16_arm_plus_fp8():
    (_, _, bf16), (_, _, fp8) = fidelity.SETTINGS["fp8"][1]
    assert fp8 == bf16 + ["--fp8=True"] and bf16 == fidelity.SETTINGS["adamw8bit"][1][0][2]


def test_svg_parses_with_a_raw_and_a_smoothed_line_per_curve(tmp_path):
    path = str(tmp_path / "c.svg")
    curves = {f"run <{i}> & co": curve(2 + 0.1 * i) for i in range(4)}
    fidelity.write_svg(path, curves, "a < b & c")
    root = ET.parse(path).getroot()
    lines = root.findall(f"{SVG}polyline")
    assert len(lines) == 2 * len(curves)
    assert all(len(p.get("points").split()) == 100 for p in lines)
    assert [t.text for t in root.iter(f"{SVG}text")][-4:] == list(curves)


def test_another_seed_reaches_train_py_and_names_the_files(tmp_path, monkeypatch):
    """--seed: every run gets it (the init and the data order), and the files carry it, beside the default's."""
    seen = []

    def fake_run_one(name, key, label, args, common, steps, work, out, timeout):
        seen.append((name, common))
        return dict(key=key, label=label, args=args, train={s: 2.0 + 1 / s for s in range(1, steps + 1)}, val=2.0, wall=1.0)
    monkeypatch.setattr(fidelity, "run_one", fake_run_one)
    summary = fidelity.fidelity("fp8", "data", work=str(tmp_path), out=str(tmp_path), steps=60, seed=7)
    assert summary["seed"] == 7 and len(seen) == 4
    assert all(name == "fp8_seed7" and "--seed=7" in common and "--seed=1337" not in common for name, common in seen)
    assert sorted(os.listdir(tmp_path)) == ["fidelity_fp8_seed7.json", "fidelity_fp8_seed7.svg"]


@pytest.mark.slow
def test_a_tiny_fp8_call_runs_every_arm_and_writes_its_files(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # four train.py at once: each with all cores' threads spin-wait
    out = str(tmp_path / "out")
    summary = fidelity.fidelity("fp8", corpus, work=str(tmp_path / "work"), out=out, steps=3, tokens=128,
                                model=TINY, timeout=120)
    keys = ["bf16", "fp8", "bf16_twin", "fp8_twin"]
    assert [r["key"] for r in summary["runs"]] == keys
    assert all(r["steps"] == 3 and r["val_loss"] is not None for r in summary["runs"])
    assert summary["runs"][1]["train_diff_pct"] != 0  # fp8 products: another run
    assert "fp8 final-window loss within" in summary["verdict"] and "twin drift" in summary["verdict"]
    assert "cut short" not in summary["verdict"]
    with open(os.path.join(out, "fidelity_fp8.json")) as f:
        assert json.load(f) == summary
    assert len(ET.parse(os.path.join(out, "fidelity_fp8.svg")).getroot().findall(f"{SVG}polyline")) == 8
    for key in keys:
        with open(os.path.join(out, f"fidelity_fp8_{key}.jsonl")) as f:
            assert sum("loss" in json.loads(line) for line in f) == 3
    assert len(os.listdir(out)) == 6  # what the device tool brings back: 8 files at most
    with open(tmp_path / "work" / "fidelity_fp8_fp8.log") as f:
        assert "fp8 on the CPU" in f.read()  # train.py did run the fp8 arm in FP8
    assert sorted(os.listdir(tmp_path / "work")) == sorted(f"fidelity_fp8_{key}.log" for key in keys)  # no out_dir
