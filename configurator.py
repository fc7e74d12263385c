"""Overrides for a flat script's module-level settings, nanoGPT style:

    python train.py [configs/some.py ...] [--key=value ...]
    python train.py --help                          # (or -h) the script's usage and its settings' names

A config file is plain Python whose top-level assignments override the script's defaults; `--key=value` then
overrides single settings, with the value parsed as a Python literal (strings may go unquoted). Every key must
already exist in the script and keep its type (an int may become a float); anything else is an error that names
the file or flag and the key.
"""
import ast
import os
import sys
import textwrap


def _check(key, value, defaults, where):
    if key not in defaults:
        close = [k for k in defaults if k.split("_")[0] == key.split("_")[0]]
        hint = f" (did you mean {', '.join(close[:4])}?)" if close else ""
        raise SystemExit(f"error: {where}: unknown setting {key!r}{hint}")
    old = defaults[key]
    ok = (old is None or value is None or type(value) is type(old)
          or (isinstance(old, float) and type(value) is int)
          or (isinstance(old, (list, tuple, dict)) and isinstance(value, (list, tuple, dict))))
    if not ok:
        raise SystemExit(f"error: {where}: {key!r} must be {type(old).__name__} (default {old!r}), "
                         f"got {type(value).__name__} {value!r}")
    return float(value) if isinstance(old, float) and type(value) is int else value


def _parse_literal(text):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word: a string


def _settings(namespace):
    """The settings of a script: its lower-case globals of plain types (an UPPER_CASE name is a constant)."""
    return {k: v for k, v in namespace.items() if not k.startswith("_") and not k.isupper()
            and isinstance(v, (int, float, bool, str, list, tuple, dict, type(None)))}


def _print_help(namespace, settings):
    """The script's docstring (its usage lines), then where its settings are and their names."""
    script = os.path.basename(namespace.get("__file__", "the script"))
    print((namespace.get("__doc__") or "").strip() + "\n")
    print(textwrap.fill(f"Settings (each a variable at the top of {script}, with its default and a comment): "
                        + ", ".join(settings), width=116, break_on_hyphens=False))


def apply_overrides(namespace, argv=None):
    """Apply config files and --key=value flags from argv to `namespace` (a script's globals()); return the
    resulting settings as a dict (for logging and checkpoints). -h or --help prints the usage and exits 0."""
    argv = sys.argv[1:] if argv is None else argv
    defaults = _settings(namespace)
    if "-h" in argv or "--help" in argv:
        _print_help(namespace, defaults)
        raise SystemExit(0)
    for arg in argv:
        if arg.startswith("--"):
            if "=" not in arg:
                raise SystemExit(f"error: {arg!r}: expected --key=value")
            key, text = arg[2:].split("=", 1)
            namespace[key] = _check(key, _parse_literal(text), defaults, arg)
        else:
            try:
                source = open(arg).read()
            except OSError as e:
                raise SystemExit(f"error: cannot read config file {arg!r}: {e.strerror}")
            file_ns = {}
            try:
                exec(compile(source, arg, "exec"), file_ns)
            except Exception as e:
                line = getattr(e, "lineno", None)
                raise SystemExit(f"error: config file {arg}{f', line {line}' if line else ''}: {type(e).__name__}: {e}")
            for key, value in _settings(file_ns).items():
                namespace[key] = _check(key, value, defaults, arg)
    return {k: namespace[k] for k in defaults}
