"""The records of the 2x2 on TED gl-en ({ScaleNorm, LayerNorm} x {scaled dot product, QKNorm}): the
cells, the files a records folder holds, and reading and writing its runs.json. The campaigns
(gl_en_2x2, gl_en_2x2_converged), the report and the results table read and write records through
this module only; it imports none of them.

A records folder holds runs.json, one entry per run (cell and seed), and each run's detokenized
test hypotheses (hyp_name). An entry holds what the reports need: the test scores, the dev and
training-loss curves from fairseq-train's log, the learned g of every attention module, the
training time and command (with the machine's folders written as $WORK and $USER_DIR), and the
sha1 of every data file, so runs on other data are never mixed into one table.
"""

import fcntl
import hashlib
import json
import os
import re
from contextlib import contextmanager

from experiments.portable import portable
from fairseq_qknorm_cli.files import fail, write_text

CELLS = (("scalenorm", "dot"), ("scalenorm", "qknorm"), ("layernorm", "dot"), ("layernorm", "qknorm"))
SRC, TGT = "gl", "en"


def stopped(run):
    """Whether the stopping rule has stopped the run (a converged-campaign entry)."""
    return run["stop_reason"] not in ("running", None)


def hyp_name(norm, attention, seed):
    return f"{norm}-{attention}-seed{seed}.hyp"


def read_runs(records):
    path = os.path.join(records, "runs.json")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            fail(f"{path}: not valid JSON ({e.msg} at line {e.lineno})")


def write_runs(records, runs):
    path = os.path.join(records, "runs.json")
    runs = sorted(runs, key=lambda r: (r["seed"], CELLS.index((r["norm"], r["attention"]))))
    write_text(path, json.dumps(runs, indent=1) + "\n")


@contextmanager
def locked(records):
    """Held while a run reads and rewrites runs.json: two runs may finish at the same time."""
    with open(os.path.join(records, ".runs.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def sha1(path):
    with open(path, "rb") as f:
        return hashlib.sha1(f.read()).hexdigest()


def data_sha1(data_dir):
    return {
        f"{split}.{lang}": sha1(os.path.join(data_dir, f"{split}.{lang}"))
        for split in ("train", "dev", "test")
        for lang in (SRC, TGT)
    }


def learned_g(checkpoint):
    """{module name: g} of every attention module (empty for scaled dot product)."""
    # Imported here: torch and fairseq load in seconds, and only recording a run needs them.
    from fairseq_qknorm_cli.inspect_checkpoints import G_SUFFIX, load_checkpoint

    return {
        k[: -len(G_SUFFIX)]: [round(float(x), 4) for x in v.flatten()] if v.numel() > 1 else round(float(v), 4)
        for k, v in load_checkpoint(checkpoint)["model"].items()
        if k.endswith(G_SUFFIX)
    }


def portable_command(command, arm_dir):
    """The command with the folders of the machine it ran on written as the recipe's variables:
    $WORK (the arm directory's WORK/arms/NAME) and $USER_DIR."""
    if command is None:
        return None
    work = os.path.dirname(os.path.dirname(os.path.abspath(arm_dir)))
    return portable(re.sub(r"--user-dir \S+", "--user-dir $USER_DIR", command), {work: "$WORK"})


def scored_dev(dev, checkpoint):
    """[updates, dev loss, dev BLEU] of the validation of the scored checkpoint: fairseq-train
    validates at --max-update, and checkpoint_best.pt is the first validation with the best BLEU."""
    if checkpoint == "checkpoint_last.pt":
        return dev[-1]
    best = max(b for _, _, b in dev)
    return next(d for d in dev if d[2] == best)
