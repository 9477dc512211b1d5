"""Small helpers every tool of the project shares: the one-line error exit, and files that appear
under their final name only when complete (written to NAME.tmp, then renamed), so a run killed
half-way never leaves a truncated file that a rerun would trust."""

import os
import sys
from contextlib import contextmanager


def fail(message):
    """End the command with `error: MESSAGE` on stderr and exit status 1 (no traceback)."""
    sys.exit(f"error: {message}")


@contextmanager
def atomic_paths(paths):
    """Yields [PATH.tmp for each PATH] to write to; all renamed to their PATH when the block ends
    without an error, all removed when it raises."""
    tmps = [f"{path}.tmp" for path in paths]
    try:
        yield tmps
    except BaseException:
        for tmp in tmps:
            if os.path.exists(tmp):
                os.remove(tmp)
        raise
    for tmp, path in zip(tmps, paths):
        os.replace(tmp, path)


@contextmanager
def atomic_path(path):
    """atomic_paths for one file: yields PATH.tmp."""
    with atomic_paths([path]) as (tmp,):
        yield tmp


def write_text(path, text):
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
