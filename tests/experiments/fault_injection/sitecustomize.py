"""Fault injection for the interrupted-training checks (tests/experiments/test_interrupt.py, examples/interrupt/run.sh)
and the rehearsal of the GPU call (tests/experiments/test_gpu_rehearsal.py).

Put this folder on PYTHONPATH and set FAIRSEQ_KILL_DURING=WHAT:N to have fairseq-train SIGKILL itself
half-way through its N-th checkpoint write of kind WHAT (counted from 1 in each process):
  save  torch.save of a checkpoint (fairseq writes NAME.pt.tmp, then renames it to NAME.pt)
  copy  the copy of that checkpoint to its other names (fairseq: shutil.copyfile, e.g.
        checkpoint_best.pt -> checkpoint_last.pt, or -> checkpoint_last.pt.tmp where the copy
        is made atomic)
Half the bytes reach the file, then the process dies as from `kill -9`: no cleanup, no exception
handler, no atexit. With FAIRSEQ_KILL_ONLY=TEXT as well, only a fairseq-train whose command line
holds TEXT (one run's --save-dir, say) does so.
FAIL_MODULE=NAME makes `python -m NAME` exit 1 at its start, before it writes anything.
KILL_AFTER_WRITE=NAME:N, with KILL_MARK=PATH, makes a process SIGKILL itself right after its N-th
complete write of a file named NAME (the os.replace of fairseq_qknorm_cli.files' atomic writes),
once: it creates PATH as it dies, and no process kills itself while PATH exists.
Any other process, or no variable, is left untouched.
"""

import os
import signal
import sys


def _die_half_way(write_half):
    write_half()
    os.kill(os.getpid(), signal.SIGKILL)


def _install(what, nth):
    count = 0

    def due():
        nonlocal count
        count += 1
        return count == nth

    if what == "save":
        import io

        import torch

        original_save = torch.save

        def save(obj, f, *args, **kwargs):
            if not (getattr(f, "name", str(f)).endswith(".pt.tmp") and due()):
                return original_save(obj, f, *args, **kwargs)
            buffer = io.BytesIO()
            original_save(obj, buffer, *args, **kwargs)
            data = buffer.getvalue()

            def write_half():
                f.write(data[: len(data) // 2])
                f.flush()

            _die_half_way(write_half)

        torch.save = save
    elif what == "copy":
        import shutil

        original_copyfile = shutil.copyfile

        def copyfile(src, dst, *args, **kwargs):
            if not (str(dst).endswith((".pt", ".pt.tmp")) and due()):
                return original_copyfile(src, dst, *args, **kwargs)

            def write_half():
                with open(src, "rb") as source, open(dst, "wb") as target:
                    data = source.read()
                    target.write(data[: len(data) // 2])

            _die_half_way(write_half)

        shutil.copyfile = copyfile


_spec = os.environ.get("FAIRSEQ_KILL_DURING")
_only = os.environ.get("FAIRSEQ_KILL_ONLY", "")
if _spec and os.path.basename(sys.argv[0] if sys.argv else "") == "fairseq-train" and _only in " ".join(sys.orig_argv):
    _what, _, _nth = _spec.partition(":")
    if _what not in ("save", "copy") or not _nth.isdigit() or int(_nth) < 1:
        sys.exit(f"error: FAIRSEQ_KILL_DURING={_spec}: expected save:N or copy:N, N >= 1")
    _install(_what, int(_nth))

_module = os.environ.get("FAIL_MODULE")
if _module and sys.orig_argv[1:3] == ["-m", _module]:
    print(f"error: {_module}: failure injected by tests/experiments/fault_injection (FAIL_MODULE)", file=sys.stderr)
    os._exit(1)  # sys.exit here would stop the interpreter's start-up with a fatal error instead

_kill_write = os.environ.get("KILL_AFTER_WRITE")
if _kill_write and not os.path.exists(os.environ["KILL_MARK"]):
    _name, _, _nth = _kill_write.rpartition(":")
    _writes = 0
    _replace = os.replace

    def _replace_then_die(src, dst, *args, **kwargs):
        global _writes
        _replace(src, dst, *args, **kwargs)
        if os.path.basename(dst) == _name:
            _writes += 1
            if _writes == int(_nth) and not os.path.exists(os.environ["KILL_MARK"]):
                open(os.environ["KILL_MARK"], "w").close()
                os.kill(os.getpid(), signal.SIGKILL)

    os.replace = _replace_then_die
