"""Overrides for a flat script's module-level settings, nanoGPT style:

    python train.py [configs/some.py ...] [--key=value ...]
    python train.py --help                          # (or -h) the script's usage, its settings' defaults and comments

A config file is plain Python whose top-level assignments override the script's defaults; `--key=value` then
overrides single settings, with the value parsed as a Python literal (strings may go unquoted; a text setting
takes any value that is not a string literal as its text: --prompt=123 is "123"). Every key must already exist in
the script and keep its type (an int may become a float); anything else is an error that names the file or flag
and the key.
"""
import ast
import os
import sys


SETTING_TYPES = (int, float, bool, str, list, tuple, dict, type(None))  # a setting's value: a plain literal


def fits(value, default):
    """May a setting whose default is `default` take `value`? The same type, an int for a float, or None."""
    return (default is None or value is None or type(value) is type(default)
            or (isinstance(default, float) and type(value) is int)
            or (isinstance(default, (list, tuple, dict)) and isinstance(value, (list, tuple, dict))))


def _check(key, value, defaults, where):
    if key not in defaults:
        close = [k for k in defaults if k.split("_")[0] == key.split("_")[0]]
        hint = f" (did you mean {', '.join(close[:4])}?)" if close else ""
        raise SystemExit(f"error: {where}: unknown setting {key!r}{hint}")
    old = defaults[key]
    if not fits(value, old):
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
            and isinstance(v, SETTING_TYPES)}


def exit_if_help(script, argv=None):
    """-h or --help: print the script's usage (its docstring) and each setting with its default and comment, read
    from the script's source without running it (so before the script imports torch), and exit 0."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" not in argv and "--help" not in argv:
        return
    with open(script, encoding="utf-8") as f:
        source = f.read()
    tree = ast.parse(source)
    lines = source.splitlines()
    out = [(ast.get_docstring(tree) or "").strip() + "\n",
           f"Settings (variables at the top of {os.path.basename(script)}; change them with a config file or "
           "--key=value):"]
    for node in tree.body:
        if any(isinstance(n, ast.Name) and n.id == "apply_overrides" for n in ast.walk(node)) and \
                not isinstance(node, ast.ImportFrom):
            break  # the settings end where they are applied
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        name = node.targets[0].id
        try:
            value = ast.literal_eval(node.value)
        except ValueError:
            continue
        if name.startswith("_") or name.isupper() or not isinstance(value, SETTING_TYPES):
            continue
        comment = [lines[node.lineno - 1][node.end_col_offset:].strip().removeprefix("#").strip()]
        for line in lines[node.end_lineno:]:  # comment lines right below continue it (a blank line ends it)
            if not comment[0] or not line.startswith("#"):
                break
            comment.append(line.removeprefix("#").strip())
        out.append(f"  --{name}={value!r}" + (f"  {' '.join(comment)}" if comment[0] else ""))
    try:
        print("\n".join(out), flush=True)
    except BrokenPipeError:  # `--help | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (so the exit's flush finds no pipe)
    raise SystemExit(0)


def apply_overrides(namespace, argv=None, given=None):
    """Apply config files and --key=value flags from argv to `namespace` (a script's globals()); return the
    resulting settings as a dict (for logging and checkpoints). The names set are added to the set `given`, if
    one is passed (train.py's resume takes every other setting from the run it continues)."""
    argv = sys.argv[1:] if argv is None else argv
    exit_if_help(namespace.get("__file__", ""), argv)
    defaults = _settings(namespace)
    given = set() if given is None else given
    for arg in argv:
        if arg.startswith("--"):
            if "=" not in arg:
                raise SystemExit(f"error: {arg!r}: expected --key=value")
            key, text = arg[2:].split("=", 1)
            value = _parse_literal(text)
            if isinstance(defaults.get(key, 0), (str, type(None))) and not isinstance(value, (str, type(None))):
                value = text  # a text setting takes the text as typed: --prompt=123 is "123", not an int
            namespace[key] = _check(key, value, defaults, arg)
            given.add(key)
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
                given.add(key)
    return {k: namespace[k] for k in defaults}
