"""A directory written whole or not at all: filled under a temporary name, then renamed into place.

Checkpoints (checkpoint.py), prepared datasets (data/prepare.py) and conversions (convert.py) are written this way,
so a crash, kill -9 or full disk never leaves a half-written directory under the name a reader looks for. No torch
here: data/prepare.py imports it.
"""
import os
import shutil
from contextlib import contextmanager


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
