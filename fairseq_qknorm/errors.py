"""Errors a person at the command line should see as one line, not as a traceback through
fairseq's training loop: the plugin's configuration errors (a ValueError for library callers), and
a checkpoint that torch's safe unpickler refused. fairseq often re-raises errors inside its own
(`Cannot load model parameters from checkpoint ...`), so the whole chain is searched."""

import pickle
import re
import sys
import traceback


class QKNormConfigError(ValueError):
    pass


def _chain(error):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def one_line(error):
    """The line to show for `error`, or None when it deserves the full traceback."""
    for e in _chain(error):
        if isinstance(e, QKNormConfigError):
            return str(e)
        if isinstance(e, pickle.UnpicklingError) and "Weights only load failed" in str(e):
            # torch names the refused global on a line of its long message ("... GLOBAL posix.system ...").
            refused = re.search(r"GLOBAL ([\w.]+)", str(e))
            what = refused.group(1) if refused else "an object torch's safe loader does not allow"
            path = _checkpoint_path(e)
            where = f" {path}" if path else ""
            return (
                f"refused to load checkpoint{where}: it holds {what}, which fairseq checkpoints never "
                "hold; nothing in it was run (a file you trust: name it in FAIRSEQ_QKNORM_TRUSTED_CHECKPOINT)"
            )
    return None


def _checkpoint_path(error):
    # Every checkpoint load of fairseq goes through fairseq_patches.load_checkpoint_safely.
    for frame, _ in traceback.walk_tb(error.__traceback__):
        if frame.f_code.co_name == "load_checkpoint_safely":
            return frame.f_locals.get("path")
    return None


def excepthook(kind, value, tb, _default=sys.excepthook):
    """sys.excepthook that prints one_line(value), when there is one, instead of the traceback."""
    line = one_line(value)
    if line is None:
        return _default(kind, value, tb)
    print(f"error: {line}", file=sys.stderr)
    sys.exit(2)
