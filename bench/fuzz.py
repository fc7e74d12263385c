"""The fuzz test of tests/test_fuzz.py at length: many damaged copies of every file we read, each loaded by the
scripts' reading paths; prints, per file, how many loaded and how many were refused, and the error lines users see.

    python bench/fuzz.py [--cases 5000] [--seed 0]
    python bench/fuzz.py --sweep     # every edit of every slot of every JSON file (test_fuzz.sweep), ~11,500

Any case that ends other than "loaded" or a FileError naming its file stops the run with its replay seed (or, with
--sweep, its file, slot and edit).
"""
import argparse
import collections
import contextlib
import io
import os
import re
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import test_fuzz  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sweep", action="store_true", help="every JSON edit instead of random damage")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        with contextlib.redirect_stdout(io.StringIO()):
            folders = test_fuzz.make_folders(os.path.join(root, "pristine"))
        scratch = os.path.join(root, "scratch")
        if args.sweep:
            files = [f"{kind}/{name}" for kind in sorted(folders) for name in sorted(os.listdir(folders[kind]))
                     if name.endswith(".json")]
            outcomes, what = test_fuzz.sweep(folders, scratch, files), "edits of every JSON slot"
        else:
            outcomes = ((f"{kind}/{name}", outcome) for kind, name, _, outcome in
                        (test_fuzz.run_case(folders, scratch, args.seed, case) for case in range(args.cases)))
            what = f"cases (seed {args.seed})"
        counts, lines = collections.defaultdict(collections.Counter), collections.defaultdict(dict)
        t0, n = time.time(), 0
        with contextlib.redirect_stdout(io.StringIO()):
            for n, (file, outcome) in enumerate(outcomes, 1):
                counts[file][outcome == "loaded"] += 1
                if outcome != "loaded":
                    shown = outcome.replace(scratch + "/", "").replace(root + "/", "")
                    key = re.sub(r"[-\d.e+]+", "N", shown)[:70]  # one line per kind of message
                    lines[file].setdefault(key, shown)
                if n % 500 == 0:
                    print(f"{n} cases, {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    print(f"{n} {what} in {time.time() - t0:.0f} s: every one loaded or raised FileError naming its file\n")
    print(f"{'file':<48} {'loaded':>7} {'refused':>8}")
    for file in sorted(counts):
        print(f"{file:<48} {counts[file][True]:>7} {counts[file][False]:>8}")
    for file in sorted(lines):
        print(f"\n{file}: {len(lines[file])} kinds of error line")
        for shown in list(lines[file].values())[:12]:
            print(f"  error: {shown[:160]}")


if __name__ == "__main__":
    main()
