"""A run's metrics.jsonl as one 720x400 SVG, no plotting library: train loss (a line) and val loss (dots joined by a
line) against step, with the tokens seen under each step label when known; the learning rate as a thin dashed line
against a right-hand axis; 1-2-5 ticks, a light grid, the run's directory name as the title, the latest values in the
legend. No finite loss yet: a frame that says "no steps yet". Written whole or not at all (temporary file, os.replace).
"""
import json
import math
import os
from xml.sax.saxutils import escape

W, H = 720, 400
L, R, T, B = 64, 650, 44, 328  # the plot area: left, right, top, bottom
FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
TRAIN, VAL, LR, GRID, INK = "#2563eb", "#ea580c", "#6b7280", "#e5e7eb", "#374151"
DASH = ' stroke-dasharray="5 3"'


def read_metrics(path):
    """({step: train record}, {step: val record}). A later line for a step wins (a resumed run repeats the steps
    after its checkpoint); a line that does not parse (one cut short by a crash mid-write) is skipped."""
    train, val = {}, {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
                step = int(record["step"])
            except (ValueError, KeyError, TypeError, OverflowError):
                continue
            if "val_loss" in record:
                val[step] = record
            elif "loss" in record:
                train[step] = record
    return train, val


def series(records, key):
    """[(step, value)] in step order, the records whose value is a finite number (NaN and inf are skipped)."""
    values = [(s, r.get(key)) for s, r in sorted(records.items())]
    return [(s, float(v)) for s, v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def nice_ticks(lo, hi, n=5):
    """Ticks at multiples of a 1-2-5 step, at most about n intervals, from at or below lo to at or above hi."""
    if hi <= lo:
        lo, hi = lo - (abs(lo) * 0.1 or 1), hi + (abs(hi) * 0.1 or 1)
    mag = 10 ** math.floor(math.log10((hi - lo) / n))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag * n >= hi - lo)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [round(i * step, 12) for i in range(first, last + 1)], step


def label(v, step):
    return f"{v:,.{max(0, -math.floor(math.log10(step) + 1e-9))}f}" if v else "0"


def tokens_label(n):
    unit = next(((u, d) for u, d in (("B", 1e9), ("M", 1e6), ("K", 1e3)) if n >= d), ("", 1))
    v = n / unit[1]  # 2 significant digits from 1K up: "5.1K tok", "31K tok", "1.6M tok"
    return f"{v:.{1 if 0 < v < 10 and unit[0] else 0}f}{unit[0]} tok"


def tokens_at(step, points):
    """Tokens seen by `step`, linear between the logged (step, tokens) points, proportional past the last."""
    s0, t0 = 0, 0.0
    for s1, t1 in points:
        if step <= s1:
            return t0 + (t1 - t0) * (step - s0) / max(s1 - s0, 1)
        s0, t0 = s1, t1
    return t0 * step / max(s0, 1)


def text(x, y, s, size=11, fill=INK, anchor="middle", extra=""):
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" fill="{fill}" text-anchor="{anchor}"{extra}>'
            f'{escape(s)}</text>')


def polyline(points, cls, color, width, extra=""):
    xy = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    return (f'<polyline class="{cls}" points="{xy}" fill="none" stroke="{color}" stroke-width="{width}" '
            f'stroke-linejoin="round" stroke-linecap="round"{extra}/>')


def write_loss_plot(metrics_path, svg_path):
    """Draw the run whose metrics.jsonl is `metrics_path` into `svg_path`, replacing it atomically. Tokens seen:
    from the cumulative "tokens" key of the train lines (train.py's), not shown without one. Raises OSError when
    metrics_path cannot be read (the SVG is then left as it was)."""
    train, val = read_metrics(metrics_path)
    loss, val_loss, lr = series(train, "loss"), series(val, "val_loss"), series(train, "lr")
    tokens = series(train, "tokens")
    name = os.path.basename(os.path.dirname(os.path.abspath(metrics_path)))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
           f'font-family="{FONT}">', f'<rect width="{W}" height="{H}" fill="white"/>',
           text(L, 27, name if len(name) <= 26 else name[:25] + "…", 16, "#111827", "start", ' font-weight="bold"')]
    if not loss and not val_loss:
        out += [f'<rect x="{L}" y="{T}" width="{R - L}" height="{B - T}" fill="none" stroke="{GRID}"/>',
                text((L + R) / 2, (T + B) / 2, "no steps yet", 14, LR)]
    else:
        xt, _ = nice_ticks(0, max(s for s, _ in loss + val_loss + lr + [(5, 0)]), 6)
        values = [v for _, v in loss + val_loss]
        yt, ystep = nice_ticks(min(values), max(values), 6)
        X = lambda s: L + (s - xt[0]) / (xt[-1] - xt[0]) * (R - L)  # noqa: E731
        Y = lambda v: B - (v - yt[0]) / (yt[-1] - yt[0]) * (B - T)  # noqa: E731
        for v in yt:
            out += [f'<line x1="{L}" x2="{R}" y1="{Y(v):.1f}" y2="{Y(v):.1f}" stroke="{GRID}"/>',
                    text(L - 7, Y(v) + 4, label(v, ystep), anchor="end")]
        for s in xt:
            out += [f'<line x1="{X(s):.1f}" x2="{X(s):.1f}" y1="{T}" y2="{B}" stroke="{GRID}"/>',
                    text(X(s), B + 16, f"{s:,.0f}")]
            if tokens:
                n = tokens_at(s, tokens)
                out.append(text(X(s), B + 30, tokens_label(n), 10, LR))
        out += [f'<path d="M{L},{T}V{B}H{R}" fill="none" stroke="{INK}"/>',
                text((L + R) / 2, B + (54 if tokens else 40), "step"),
                text(18, (T + B) / 2, "loss", extra=f' transform="rotate(-90 18 {(T + B) / 2})"')]
        if lr:
            lt, lstep = nice_ticks(0, max(v for _, v in lr) or 1)
            Ylr = lambda v: B - v / lt[-1] * (B - T)  # noqa: E731
            out += [text(R + 7, Ylr(v) + 4, label(v, lstep), 10, LR, "start") for v in lt]
            out += [f'<line x1="{R}" x2="{R}" y1="{T}" y2="{B}" stroke="{LR}"/>',
                    text(W - 10, (T + B) / 2, "learning rate", 11, LR,
                         extra=f' transform="rotate(90 {W - 10} {(T + B) / 2})"'),
                    polyline([(X(s), Ylr(v)) for s, v in lr], "lr", LR, 1, DASH)]
        if loss:
            out.append(polyline([(X(s), Y(v)) for s, v in loss], "train", TRAIN, 1.6))
            if len(loss) == 1:  # a polyline of one point draws nothing
                out.append(f'<circle cx="{X(loss[0][0]):.1f}" cy="{Y(loss[0][1]):.1f}" r="2.5" fill="{TRAIN}"/>')
        if val_loss:
            out.append(polyline([(X(s), Y(v)) for s, v in val_loss], "val", VAL, 1.6))
            out += [f'<circle class="val" cx="{X(s):.1f}" cy="{Y(v):.1f}" r="3.2" fill="{VAL}" stroke="white"/>'
                    for s, v in val_loss]
        legend = ([(f"train {loss[-1][1]:.3f}", TRAIN, "")] if loss else []) + \
                 ([(f"val {val_loss[-1][1]:.3f}", VAL, "")] if val_loss else []) + \
                 ([(f"lr {lr[-1][1]:.2e}", LR, DASH)] if lr else [])
        x = R
        for entry, color, dash in reversed(legend):  # right-aligned in the title row
            x -= 30 + 6.5 * len(entry)
            out += [f'<line x1="{x:.1f}" x2="{x + 20:.1f}" y1="23" y2="23" stroke="{color}" stroke-width="2"{dash}/>',
                    text(x + 25, 27, entry, 11, INK, "start")]
    out.append("</svg>\n")
    tmp = f"{svg_path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("\n".join(out))
        os.replace(tmp, svg_path)
    finally:
        if os.path.exists(tmp):  # only when writing or renaming failed
            os.remove(tmp)
