"""plot.py: the SVG parses, its lines follow the data, ticks are round, edge cases, the atomic write."""
import json
import math
import os
import xml.etree.ElementTree as ET

import pytest

import plot
from plot import nice_ticks, write_loss_plot

SVG = "{http://www.w3.org/2000/svg}"


def metrics(tmp_path, records, tail="", name="run"):
    """A metrics.jsonl in tmp_path/name holding `records` (as train.py writes them), then `tail` as written."""
    os.makedirs(tmp_path / name, exist_ok=True)
    path = tmp_path / name / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return str(path)


def draw(tmp_path, records, tail="", **kw):
    svg = str(tmp_path / "loss.svg")
    write_loss_plot(metrics(tmp_path, records, tail), svg, **kw)
    return ET.parse(svg).getroot()  # valid XML, or this raises


def line(root, cls):
    """The points of the polyline of class `cls`, or None when there is none."""
    found = [p for p in root.iter(SVG + "polyline") if p.get("class") == cls]
    assert len(found) <= 1
    return [tuple(map(float, xy.split(","))) for xy in found[0].get("points").split()] if found else None


def texts(root, anchor=None):
    return [t.text for t in root.iter(SVG + "text") if anchor is None or t.get("text-anchor") == anchor]


def run(n=30, val_every=10, **extra):
    """A run of n steps as train.py logs it: val lines at 0, val_every, ...; train lines with loss, lr, ..."""
    records = []
    for s in range(n + 1):
        if s % val_every == 0:
            records.append({"step": s, "val_loss": 5.0 - 0.09 * s})
        if s:
            loss = 5.2 - 0.1 * s + (0.4 if s % 3 == 0 else 0) - (1.5 if s == 22 else 0)  # lowest at step 22
            lr = 3e-3 * min(1, s / 5) * (0.1 + 0.45 * (1 + math.cos(math.pi * s / n)))
            records.append({"step": s, "loss": loss, "lr": lr, "grad_norm": 1.0, "tok_s": 2e4,
                            **{k: v(s) for k, v in extra.items()}})
    return records


def test_lines_follow_the_data(tmp_path):
    records = run()
    root = draw(tmp_path, records)
    assert (root.get("width"), root.get("height")) == ("720", "400")
    train, val, lr = line(root, "train"), line(root, "val"), line(root, "lr")
    assert (len(train), len(val), len(lr)) == (30, 4, 30)
    assert len([c for c in root.iter(SVG + "circle") if c.get("class") == "val"]) == 4
    assert all(a[0] < b[0] for a, b in zip(train, train[1:]))  # steps run left to right
    losses = [r["loss"] for r in records if "loss" in r]
    ys = [y for _, y in train]
    assert ys.index(max(ys)) == losses.index(min(losses)) == 21  # the lowest loss is the lowest point on screen
    assert ys.index(min(ys)) == losses.index(max(losses))
    # the same linear scale for every point, train and val alike
    scale = (max(ys) - min(ys)) / (min(losses) - max(losses))
    assert all(abs((y - ys[0]) - scale * (v - losses[0])) < 0.2 for y, v in zip(ys, losses))
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    assert all(abs((y - ys[0]) - scale * (v - losses[0])) < 0.2 for (_, y), v in zip(val, vals))
    assert val[0][0] < train[0][0]  # val at step 0 lies left of train's step 1
    lrs = [r["lr"] for r in records if "lr" in r]
    assert [y for _, y in lr].index(min(y for _, y in lr)) == lrs.index(max(lrs))
    assert "run" in texts(root) and {"loss", "step", "learning rate"} <= set(texts(root))
    assert any(t.startswith("train ") for t in texts(root)) and any(t.startswith("val 2.300") for t in texts(root))


@pytest.mark.parametrize("lo,hi", [(0, 60), (0, 2410), (3.3, 6.2), (1.87, 1.93), (0, 3e-3), (0, 6e-5), (5.77, 5.77)])
def test_ticks_are_round(lo, hi):
    ticks, step = nice_ticks(lo, hi)
    mantissa = step / 10 ** math.floor(math.log10(step) + 1e-9)
    assert any(abs(mantissa - m) < 1e-9 for m in (1, 2, 5))
    assert ticks[0] <= lo and ticks[-1] >= hi and 3 <= len(ticks) <= 8
    assert all(abs(t / step - round(t / step)) < 1e-6 for t in ticks)


def test_tick_labels_in_the_svg_are_round(tmp_path):
    root = draw(tmp_path, run())
    left = sorted(float(t) for t in texts(root, "end"))  # the loss axis
    gaps = {round(b - a, 9) for a, b in zip(left, left[1:])}
    assert len(gaps) == 1 and gaps.pop() in (0.1, 0.2, 0.5, 1.0, 2.0)
    bottom = [t for t in texts(root, "middle") if t.replace(",", "").isdigit()]
    assert bottom == ["0", "5", "10", "15", "20", "25", "30"]


def test_tokens_seen(tmp_path):
    root = draw(tmp_path, run(400, 100, tokens=lambda s: 8192 * s))  # from train.py's lines, when they hold it
    assert "1.6M tok" in texts(root) and "0 tok" in texts(root)
    assert not any(t.endswith(" tok") for t in texts(draw(tmp_path, run(400, 100))))  # else not shown


def test_edge_cases(tmp_path):
    one = draw(tmp_path, run(1, 10))  # val at step 0, one train step
    assert len(line(one, "train")) == 1 and len(line(one, "val")) == 1
    assert line(draw(tmp_path, [{"step": 0, "val_loss": 5.77}]), "train") is None
    no_val = draw(tmp_path, [r for r in run() if "loss" in r])
    assert line(no_val, "val") is None and len(line(no_val, "train")) == 30
    assert not any(t.startswith("val") for t in texts(no_val))
    bad = run()
    train = [r for r in bad if "loss" in r]
    train[2]["loss"], train[4]["loss"] = float("nan"), float("inf")
    [r for r in bad if "val_loss" in r][-1]["val_loss"] = float("-inf")
    root = draw(tmp_path, bad, tail='{"step": 31, "loss": 1.9, "lr": 0.0003, "grad_n')  # killed mid-write
    assert (len(line(root, "train")), len(line(root, "val")), len(line(root, "lr"))) == (28, 3, 30)
    assert max(x for x, _ in line(root, "lr")) == max(x for x, _ in line(draw(tmp_path, run()), "lr"))
    # a resumed run logs the steps after its checkpoint again: the later line wins
    resumed = run(20) + [{"step": 16, "loss": 0.5, "lr": 1e-3}]
    train = line(draw(tmp_path, resumed), "train")
    assert len(train) == 20 and max(train, key=lambda p: p[1]) == train[15]
    for empty in ([], [{"step": 1, "loss": float("nan"), "lr": 1e-3}]):
        root = draw(tmp_path, empty)
        assert "no steps yet" in texts(root) and not list(root.iter(SVG + "polyline"))
    assert "no steps yet" in texts(draw(tmp_path, [], tail='{"step": 1, "lo'))


def test_atomic_write(tmp_path, monkeypatch):
    path, svg = metrics(tmp_path, run()), str(tmp_path / "loss.svg")
    with open(svg, "w") as f:
        f.write("old")
    real_replace, seen = os.replace, []

    def replace(src, dst):  # at the rename: the target still old, the new file complete
        seen.append(open(dst).read())
        ET.parse(src)
        real_replace(src, dst)
    monkeypatch.setattr(plot.os, "replace", replace)
    write_loss_plot(path, svg)
    assert seen == ["old"] and ET.parse(svg).getroot().tag == SVG + "svg"
    assert sorted(os.listdir(tmp_path)) == ["loss.svg", "run"]

    def fail(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(plot.os, "replace", fail)
    before = open(svg).read()
    with pytest.raises(OSError):
        write_loss_plot(path, svg)
    assert open(svg).read() == before and sorted(os.listdir(tmp_path)) == ["loss.svg", "run"]  # no temporary left
    with pytest.raises(FileNotFoundError):
        write_loss_plot(str(tmp_path / "none" / "metrics.jsonl"), svg)
    assert open(svg).read() == before
