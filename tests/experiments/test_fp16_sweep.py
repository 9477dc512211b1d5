"""The fp16 learning-rate sweep (experiments.fp16_sweep, the fp32 sweep's runs with --fp16 and their
own training loop on the sweep engine) end to end on two tiny runs: what each record holds per
attempted update, the command with no folder of the machine, and a rerun that trains nothing."""

import json
import math
import sys

from conftest import run

SWEEP = [sys.executable, "-m", "experiments.fp16_sweep"]
TINY = ["--arms", "stock", "qknorm", "--lrs", "0.1", "--updates", "3", "--warmup-updates", "2", "--stats-interval", "2"]


def test_tiny_fp16_sweep_records_every_attempted_update(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    proc = run([*SWEEP, "--work-dir", work, "--out-dir", out, *TINY, "--threads", "1"])
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["precision"] == "--fp16" and results["command"].startswith(
        "python -m experiments.fp16_sweep --work-dir $WORK "
    )
    assert [r["arm"] for r in results["runs"]] == ["stock", "qknorm"]
    for r in results["runs"]:
        assert r["outcome"] == "finished" and r["applied"].count(True) == 3
        assert len(r["loss"]) == len(r["applied"]) == len(r["loss_scale"])
        assert all(loss is None or math.isfinite(loss) for loss in r["loss"])
        assert r["command"].startswith("fairseq-train DATA_BIN --user-dir USER_DIR ") and r["command"].endswith(
            " --fp16"
        )
        assert str(tmp_path) not in r["command"]
        assert [s["update"] for s in r["stats"]] == [0, 2, 3] and all("fp16_loss" in s for s in r["stats"])
    for name in ("loss_scale.png", "max_logit_vs_lr.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert "| stock | 0.1 | 1 | finished | 3 |" in proc.stdout

    again = run([*SWEEP, "--work-dir", work, "--out-dir", out, *TINY, "--threads", "1"])
    assert "keeping 2 finished runs" in again.stdout and "update 2 | attempts" not in again.stdout
    assert json.loads((out / "results.json").read_text())["runs"] == results["runs"]
