"""Interrupted training through the recipe, at smoke size: examples/interrupt/run.sh trains one arm
straight through and once more with three kill -9s, rerunning the same recipe command after each:
half-way through fairseq's copy of checkpoint_best.pt to checkpoint_last.pt, mid-epoch, half-way
through a checkpoint's torch.save (the copy and the save injected by tests/experiments/fault_injection). Every
rerun must start from the last complete checkpoint_last.pt, lose at most one save interval (an
epoch, in the recipes), never leave a truncated checkpoint under a final name, and finish with the
uninterrupted run's weights, bit for bit: the recipes' --update-epoch-batch-itr True makes a resumed
run a replay (examples/interrupt/RESULTS.md)."""

import os
import re
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
MAX_UPDATE = 50  # smoke preset on the tests' corpus: epochs of 22 updates, so 3 epochs
KILL_AFTER = 26  # updates after the (fresh) start of attempt 2: early in epoch 2


@pytest.fixture(scope="module")
def experiment(toy_raw, tmp_path_factory):
    work = tmp_path_factory.mktemp("interrupt_work")
    env = dict(
        os.environ,
        PRESET="smoke",
        MAX_UPDATE=str(MAX_UPDATE),
        KILL_AFTER=str(KILL_AFTER),
        WORK=str(work),
        DATA_DIR=str(toy_raw),
        DEVICE_FLAGS="--cpu",
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"),
    )
    proc = subprocess.run(
        ["bash", ROOT / "examples" / "interrupt" / "run.sh"], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, f"run.sh failed ({proc.returncode})\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return work


def attempt(work, n):
    return int((work / "attempts" / "seed1" / f"{n}.rc").read_text()), (
        work / "attempts" / "seed1" / f"{n}.log"
    ).read_text()


def updates_logged(log):
    return [int(u) for u in re.findall(r"num_updates=(\d+)", log)]


def resumed_from(log):
    """(file, updates) of the checkpoint fairseq-train restored; None when it started afresh."""
    m = re.search(r"Loaded checkpoint (\S+) \(epoch \d+ @ (\d+) updates\)", log)
    return m and (Path(m[1]).name, int(m[2]))


def saved_updates(log):
    return [int(u) for u in re.findall(r"Saved checkpoint \S+ \(epoch \d+ @ (\d+) updates", log)]


def last_fairseq_line(log):
    """The last line fairseq-train logged before it died (bash's "Killed" report follows it)."""
    return [line for line in log.splitlines() if " | INFO | " in line][-1]


def epoch_length(log):
    return int(re.search(r"epoch \d+: +\d+ / +(\d+)", log)[1])


def final_names_complete(work):
    """Every checkpoint under its final name (not *.tmp) is a whole zip archive, as torch.save writes."""
    for path in (work / "arms" / "interrupted-seed1").glob("checkpoints*/checkpoint*.pt"):
        assert zipfile.is_zipfile(path) and zipfile.ZipFile(path).testzip() is None, f"truncated: {path}"


def check_resumed(work, n, fresh=False):
    """Attempt n started from checkpoint_last.pt as the attempts before it last saved it completely
    (from nothing when none did: fresh), losing at most one epoch of the attempt before."""
    _, before = attempt(work, n - 1)
    _, log = attempt(work, n)
    lost_from = 0
    if fresh:
        assert "No existing checkpoint found" in log and resumed_from(log) is None
    else:
        assert "No existing checkpoint found" not in log, f"attempt {n} started afresh instead of resuming"
        assert resumed_from(log), f"attempt {n} did not resume:\n{log[-3000:]}"
        name, lost_from = resumed_from(log)
        previous_saves = [u for k in range(1, n) for u in saved_updates(attempt(work, k)[1])]
        assert name == "checkpoint_last.pt" and lost_from == max(previous_saves)
    assert 0 <= max(updates_logged(before)) - lost_from <= epoch_length(before)
    assert min(updates_logged(log)) == lost_from + 1  # training goes on from the next update


def files_after(work, n):
    """{checkpoint file: "complete" | "truncated"} after attempt n."""
    lines = (work / "attempts" / "seed1" / f"{n}.files").read_text().splitlines()
    return {name: state for name, _, state in (line.split() for line in lines)}


def test_kill_during_checkpoint_copy_leaves_no_truncated_checkpoint(experiment):
    rc, log = attempt(experiment, 1)
    assert rc != 0
    # killed after checkpoint_best.pt was written, while it was being copied to checkpoint_last.pt
    assert "| Finished saving checkpoint to " in last_fairseq_line(log) and last_fairseq_line(log).endswith(
        "checkpoint_best.pt"
    )
    files = files_after(experiment, 1)
    assert files["checkpoints.tmp/checkpoint_best.pt"] == "complete"
    assert "truncated" in files.values()  # the half-written copy, under a temporary name only
    for name, state in files.items():
        assert state == "complete" or name.endswith(".tmp"), f"truncated checkpoint under its final name: {name}"
    # no complete checkpoint_last.pt: the rerun starts afresh, and does not die on the broken copy
    check_resumed(experiment, 2, fresh=True)


def test_kill_mid_epoch_then_rerun_resumes(experiment):
    rc, log = attempt(experiment, 2)
    assert rc != 0 and max(updates_logged(log)) >= KILL_AFTER
    done, of = map(int, re.findall(r"epoch \d+: +(\d+) / +(\d+)", log)[-1])
    assert 0 < done < of  # mid-epoch
    check_resumed(experiment, 3)


def test_kill_during_torch_save_then_rerun_resumes(experiment):
    rc, log = attempt(experiment, 3)
    assert rc != 0
    # killed between "Saving checkpoint to X" and "Finished saving": inside torch.save
    assert "| Saving checkpoint to " in last_fairseq_line(log)
    files = files_after(experiment, 3)
    assert any(name.endswith(".pt.tmp") and state == "truncated" for name, state in files.items())
    assert all(state == "complete" for name, state in files.items() if name.endswith(".pt"))
    check_resumed(experiment, 4)


def test_rerun_finishes_as_the_uninterrupted_run(experiment):
    """The resumed run reaches MAX_UPDATE and validates there, as the uninterrupted one does, with the
    same weights and dev BLEU: a replay, not only a continuation (without the recipes'
    --update-epoch-batch-itr True the weights differ by about 0.02 here: examples/interrupt/RESULTS.md)."""
    rc, log = attempt(experiment, 4)
    assert rc == 0 and max(updates_logged(log)) == MAX_UPDATE
    assert (experiment / "stamps" / "interrupted.seed1.train").is_file()
    arms = {name: experiment / "arms" / f"{name}-seed1" for name in ("uninterrupted", "interrupted")}
    assert not (arms["interrupted"] / "checkpoints.tmp").exists()
    final_names_complete(experiment)

    def last_validation(arm):
        return re.findall(
            r"valid on 'valid' subset .*?\| bleu ([\d.]+) .*?\| num_updates (\d+)", (arm / "train.log").read_text()
        )[-1]

    assert last_validation(arms["interrupted"])[1] == last_validation(arms["uninterrupted"])[1] == str(MAX_UPDATE)
    assert last_validation(arms["interrupted"]) == last_validation(arms["uninterrupted"])
    from fairseq_qknorm.fairseq_patches import fairseq_checkpoint_globals

    with torch.serialization.safe_globals(fairseq_checkpoint_globals()):
        uninterrupted, interrupted = (
            torch.load(arm / "checkpoints" / "checkpoint_last.pt", weights_only=True)["model"] for arm in arms.values()
        )
    assert uninterrupted.keys() == interrupted.keys()
    differ = [k for k in uninterrupted if not torch.equal(uninterrupted[k], interrupted[k])]
    assert not differ, (
        f"the resumed run's weights differ from the uninterrupted run's in {len(differ)} tensors: {differ[:3]}"
    )
