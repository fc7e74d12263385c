"""bench/fidelity.py on the CPU: the table's numbers and the verdict, the SVG, and one whole call (every run of a
setting, at once, as train.py subprocesses) with a tiny model for a few steps. The real runs need the GPU."""
import json
import os
import statistics
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


def test_seeds_reach_train_py_name_the_files_and_are_pooled(tmp_path, monkeypatch):
    """--seed: every run gets its seed (the init and the data order) and the files carry it, beside the default's;
    several seeds run at once and their mean curves get a table and files of their own."""
    seen = []

    def fake_run_one(name, key, label, args, common, steps, work, timeout):
        seen.append((name, common))
        seed = int(next(a for a in common if a.startswith("--seed=")).split("=")[1])
        final = {"bf16": 2.0, "fp8": 2.1}.get(key, 2.0) + seed % 2 * 0.2  # two seeds' curves differ by 0.2
        return dict(key=key, label=label, args=args, train={s: final + 1 / s for s in range(1, steps + 1)},
                    val=final, wall=1.0)
    monkeypatch.setattr(fidelity, "run_one", fake_run_one)
    (summary,) = fidelity.fidelity("fp8", "data", work=str(tmp_path), out=str(tmp_path), steps=60, seeds=[7])
    assert summary["seed"] == 7 and len(seen) == 4
    assert all(name == "fp8_seed7" and "--seed=7" in common and "--seed=1337" not in common for name, common in seen)
    assert sorted(os.listdir(tmp_path)) == ["fidelity_fp8_seed7.json", "fidelity_fp8_seed7.svg"]

    out = tmp_path / "two"
    summaries = fidelity.fidelity("fp8", "data", work=str(out), out=str(out), shape="small", steps=60,
                                  seeds=[1337, 8])
    assert [s.get("seed") for s in summaries] == [1337, 8, None] and summaries[2]["seeds"] == [1337, 8]
    assert sorted(os.listdir(out)) == [f"fidelity_fp8_small{n}.{e}" for n in ("", "_pooled", "_seed8")
                                       for e in ("json", "svg")]
    assert all("--dim=1024" in common for _, common in seen[4:])
    assert summaries[0]["runs"][0]["args"][-1] == "--learning_rate=0.0006"
    runs = {r["key"]: r for r in summaries[2]["runs"]}
    assert runs["bf16"]["train_loss"] == pytest.approx(statistics.fmean([summaries[0]["runs"][0]["train_loss"],
                                                                         summaries[1]["runs"][0]["train_loss"]]))
    assert runs["fp8"]["val_loss"] == pytest.approx(2.2)  # the mean of 2.1 and 2.3
    assert runs["fp8"]["curve"][0] == [1, pytest.approx(2.2 + 1)]
    with open(out / "fidelity_fp8_small_pooled.json") as f:
        assert json.load(f) == summaries[2]


def test_arms_calls_pool_into_each_seeds_difference_and_their_statistics(tmp_path, monkeypatch):
    """--arms fp8: per seed bf16 and fp8 with the fp8 setting's train.py arguments; two calls' JSON files pool into
    one table: fp8's val loss in % of the same seed's bf16, per seed, then their mean, sd and se."""
    def fake_run_one(name, key, label, args, common, steps, work, timeout):
        seed = int(next(a for a in common if a.startswith("--seed=")).split("=")[1])
        final = 2.0 * (1 + seed / 100) if key == "fp8" else 2.0  # fp8 `seed` % above bf16
        return dict(key=key, label=label, args=args, train={s: final for s in range(1, steps + 1)}, val=final,
                    wall=1.0)
    monkeypatch.setattr(fidelity, "run_one", fake_run_one)
    one = fidelity.arms_fidelity(["fp8"], "data", work=str(tmp_path), out=str(tmp_path / "a"), shape="small",
                                 seeds=[1, 2], steps=60)
    (_, _, bf16), (_, _, fp8) = fidelity.SETTINGS["fp8"][1]
    assert [(r["key"], r["args"]) for r in one["runs"] if r["seed"] == 1] == [
        ("bf16", bf16 + ["--learning_rate=0.0006"]), ("fp8", fp8 + ["--learning_rate=0.0006"]),
        ("bf16_twin", bf16 + ["--learning_rate=0.0006006"])]
    assert one["table"]["bf16_twin"]["val"]["mean"] == pytest.approx(0)  # its reference: bf16
    fidelity.arms_fidelity(["fp8"], "data", work=str(tmp_path), out=str(tmp_path / "b"), shape="small", seeds=[4],
                           steps=60, twins="none")
    pooled = fidelity.pool_calls([str(tmp_path / d / "fidelity_fp8_arms_small.json") for d in "ab"],
                                 out=str(tmp_path / "pooled"))
    val = pooled["table"]["fp8"]["val"]
    assert {s: c[0] for s, c in val["per_seed"].items()} == pytest.approx({1: 1.0, 2: 2.0, 4: 4.0})
    assert (val["n"], val["mean"], val["sd"]) == (3, pytest.approx(7 / 3), pytest.approx(statistics.stdev([1, 2, 4])))
    assert val["se"] == pytest.approx(val["sd"] / 3 ** 0.5)
    assert os.path.exists(tmp_path / "pooled" / "fidelity_fp8_arms_pooled_diff.svg")


@pytest.mark.slow
def test_a_tiny_fp8_call_runs_every_arm_and_writes_its_files(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # four train.py at once: each with all cores' threads spin-wait
    out = str(tmp_path / "out")
    tiny = dict(fidelity.SHAPES["1b"], model=TINY, tokens=128)
    (summary,) = fidelity.fidelity("fp8", corpus, work=str(tmp_path / "work"), out=out, steps=3, timeout=120,
                                   shape="tiny", shapes={"tiny": tiny})
    keys = ["bf16", "fp8", "bf16_twin", "fp8_twin"]
    assert [r["key"] for r in summary["runs"]] == keys
    assert all(r["steps"] == 3 and r["val_loss"] is not None for r in summary["runs"])
    assert all([s for s, _ in r["curve"]] == [1, 2, 3] for r in summary["runs"])
    assert summary["runs"][1]["train_diff_pct"] != 0  # fp8 products: another run
    assert "fp8 final-window loss within" in summary["verdict"] and "twin drift" in summary["verdict"]
    assert "cut short" not in summary["verdict"]
    with open(os.path.join(out, "fidelity_fp8_tiny.json")) as f:
        assert json.load(f) == summary
    assert len(ET.parse(os.path.join(out, "fidelity_fp8_tiny.svg")).getroot().findall(f"{SVG}polyline")) == 8
    assert len(os.listdir(out)) == 2  # what the device tool brings back: 8 files at most
    with open(tmp_path / "work" / "fidelity_fp8_tiny_fp8.log") as f:
        assert "fp8 on the CPU" in f.read()  # train.py did run the fp8 arm in FP8
    assert sorted(os.listdir(tmp_path / "work")) == sorted(f"fidelity_fp8_tiny_{key}.log" for key in keys)  # no out_dir


@pytest.mark.slow
def test_finetune_trains_a_base_and_starts_every_run_from_it(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    work = tmp_path / "work"
    tiny = dict(fidelity.SHAPES["small"], model=TINY, tokens=128, eval_tokens=128)
    (summary,) = fidelity.fidelity("fp8", corpus, work=str(work), out=str(tmp_path / "out"), only=["fp8"], steps=2,
                                   timeout=120, shape="tiny", shapes={"tiny": tiny}, finetune=True)
    assert [r["key"] for r in summary["runs"]] == ["fp8", "fp8_twin"] and summary["finetune"]
    assert summary["runs"][0]["args"][-1] == f"--learning_rate={tiny['lr'] / 3:g}"
    base = work / "fid_base" / "ckpt"
    assert f"--init_from={base}" in summary["common_args"]
    for key in ("fp8", "fp8_twin"):
        with open(work / f"fidelity_fp8_tiny_finetune_{key}.log") as f:
            log = f.read()
        assert f"loading {base}" in log and "step 2: val loss" in log
