"""Overrides for a flat script's module-level settings, nanoGPT style:

    python train.py [configs/some.py ...] [--key=value ...]

A config file is plain Python whose top-level assignments override the script's defaults; `--key=value` then
overrides single settings, with the value parsed as a Python literal (strings may go unquoted). Every key must
already exist in the script and keep its type (an int may become a float); anything else is an error that names
the file or flag and the key.
"""
import ast
import sys


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
    return {k: v for k, v in namespace.items()
            if not k.startswith("_") and isinstance(v, (int, float, bool, str, list, tuple, dict, type(None)))}


def apply_overrides(namespace, argv=None):
    """Apply config files and --key=value flags from argv to `namespace` (a script's globals()); return the
    resulting settings as a dict (for logging and checkpoints)."""
    argv = sys.argv[1:] if argv is None else argv
    defaults = _settings(namespace)
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
