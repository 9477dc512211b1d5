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

    # The same sweep run in two parts (one process per arm, as the GPU call does), merged
    parts = []
    for i, r in enumerate(results["runs"]):
        parts.append(tmp_path / f"part{i}.json")
        parts[-1].write_text(json.dumps({**results, "runs": [r]}))
    merged = run([*SWEEP, "merge", *reversed(parts), "--out-dir", tmp_path / "merged", "--command", "two parts"])
    assert json.loads((tmp_path / "merged" / "results.json").read_text())["runs"] == results["runs"]
    assert "| stock | 0.1 | 1 | finished | 3 |" in merged.stdout
    assert (tmp_path / "merged" / "loss_scale.png").is_file()


def test_on_cuda_the_runs_are_the_same_but_for_cpu(tmp_path):
    from experiments.fp16_sweep import fairseq_flags, parse_args

    on_cpu = fairseq_flags("BIN", "qknorm", 0.3, 1, 300, 75, "SAVE")
    on_cuda = fairseq_flags("BIN", "qknorm", 0.3, 1, 300, 75, "SAVE", device="cuda")
    assert "--cpu" in on_cpu and [f for f in on_cpu if f != "--cpu"] == on_cuda and on_cuda[-1] == "--fp16"
    assert parse_args(["--work-dir", str(tmp_path), "--out-dir", str(tmp_path)]).device == "cpu"
