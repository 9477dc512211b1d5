"""Configuration errors of the plugin: a ValueError for code that calls fairseq as a library, and a
single line `error: ...` (exit status 2) for a person at the command line, instead of a traceback
through fairseq's training loop."""
import sys


class QKNormConfigError(ValueError):
    pass


def _excepthook(kind, value, tb, _default=sys.excepthook):
    if issubclass(kind, QKNormConfigError):
        print(f"error: {value}", file=sys.stderr)
        sys.exit(2)
    _default(kind, value, tb)


def install_excepthook():
    if sys.excepthook is not _excepthook:
        sys.excepthook = _excepthook
