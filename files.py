"""Files in and out: a directory written whole or not at all, and files read with what they hold checked.

Writing: checkpoints (checkpoint.py), prepared datasets (data/prepare.py) and conversions (convert.py) are filled
under a temporary name, then renamed into place, so a crash, kill -9 or full disk never leaves a half-written
directory under the name a reader looks for.

Reading: a file we read may come from anywhere: downloaded, copied, half-written, edited by hand, or made to do harm.
Every reader checks what a file holds before anything is used, allocated or sized by it, and raises FileError,
whose message names the file and what is wrong (the scripts print it as one line, never a traceback).
read_json and need are the checks JSON files share; the safetensors, tokenizer and dataset readers add their own.

No torch here: data/prepare.py imports it.
"""
import json
import os
import shutil
from contextlib import contextmanager


NULL = type(None)  # JSON's null, in the type tuples of need and check_types
JSON_NAMES = {NULL: "null", dict: "an object", list: "a list", str: "a string", bool: "true or false",
              int: "an integer", float: "a number"}


class FileError(ValueError):
    """A file we read is missing, damaged or of the wrong kind; the message names it (and the key or line)."""


def read_json(path, fields=None):
    """The JSON object in `path`, with each key of `fields` {key: type or tuple of types} present and of its type
    (see need). Anything else (missing, unreadable, not JSON, not an object) is a FileError naming the file."""
    try:
        with open(path, "rb") as f:
            obj = json.loads(f.read())
    except FileNotFoundError:
        raise FileError(f"{path}: missing") from None
    except OSError as e:
        raise FileError(f"{path}: cannot be read ({e.strerror})") from None
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, absurd nesting, a 5,000-digit int
        raise FileError(f"{path}: damaged, not JSON ({str(e)[:100]})") from None
    if not isinstance(obj, dict):
        raise FileError(f"{path}: damaged (a JSON {type(obj).__name__}, not an object)")
    for key, types in (fields or {}).items():
        need(obj, key, types, path)
    return obj


def check_types(obj, types, path):
    """Each key of `types` {key: type or tuple of types} that obj has is of its type (see need)."""
    for key in types.keys() & obj.keys():
        need(obj, key, types[key], path)


def need(obj, key, types, path):
    """obj[key], checked to be of `types` (a type or a tuple; float admits int, int never admits bool): a FileError
    naming the file and the key otherwise."""
    types = types if isinstance(types, tuple) else (types,)
    if key not in obj:
        raise FileError(f"{path}: no {key!r}")
    value = obj[key]
    if float in types:
        types += (int,)
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        names = " or ".join(JSON_NAMES.get(t, t.__name__) for t in types if t is not int or float not in types)
        raise FileError(f"{path}: {key} is {json.dumps(value)[:40]}, expected {names}")
    return value


def tmp_path(target):
    """Where atomic_dir fills `target` by default."""
    return target.rstrip("/") + ".tmp"


@contextmanager
def atomic_dir(target, tmp=None, old=None, durable=False):
    """Yield a directory to fill. When the block ends, it becomes `target`; on any error it is deleted and target
    stays as it was.

    tmp: the directory to fill; default tmp_path(target), made afresh (a killed run's leftover is deleted first).
    An existing target is replaced in two renames, target -> old (default tmp + ".old") and tmp -> target, then old
    is deleted: a crash between them leaves old whole (checkpoint.find_checkpoint reads DIR.old). durable: fsync
    the names in tmp before the renames and those in target's parent after them (a power cut keeps them too)."""
    if tmp is None:
        tmp = tmp_path(target)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    old = old or tmp + ".old"
    try:
        yield tmp
        if durable:
            fsync_dir(tmp)
        if os.path.exists(target):  # only old, no target: a crash came between two renames; old stays till below
            shutil.rmtree(old, ignore_errors=True)
            os.replace(target, old)
        os.replace(tmp, target)
        if durable:
            fsync_dir(os.path.dirname(os.path.abspath(target)))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def fsync_dir(path):
    """Make the names in a directory (new files, renames) durable, not only the files' bytes."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
