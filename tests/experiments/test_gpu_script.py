"""The one-call GPU campaign (examples/ted/gl-en-2x2-gpu/run.sh) dry-run at smoke size on the CPU
(or on a GPU, where there is one): the probe, the budget sized from it, the four cells trained side
by side, translated, scored and recorded in the gl-en 2x2 schema, the checks after them, all packed
into a few files; and the budget arithmetic on its own. fairseq being importable, nothing is
installed (tests/experiments/test_gpu_rehearsal.py runs the call as a bare GPU machine would)."""

import json
import math
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

from experiments.gl_en_2x2_records import CELLS
from experiments.gpu_budget import plan, seeds

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "examples" / "ted" / "gl-en-2x2-gpu" / "run.sh"
SCHEMA = {
    "norm",
    "attention",
    "seed",
    "updates",
    "test_bleu",
    "test_chrf",
    "best_dev_bleu",
    "hyp",
    "dev",
    "g",
    "L",
    "g0",
    "train_seconds",
    "preset",
    "train_command",
    "data_sha1",
}


def script(*args, **env):
    environ = dict(os.environ, VENV=sys.prefix, **{k: str(v) for k, v in env.items()})
    return subprocess.run(
        ["bash", str(RUN), *args], capture_output=True, text=True, env=environ, cwd=ROOT, timeout=3600
    )


@pytest.fixture(scope="module")
def gl_en(tmp_path_factory):
    """A small corpus under TED gl-en's file names."""
    from fairseq_qknorm_cli.toy_corpus import write_corpus

    d = tmp_path_factory.mktemp("gl_en")
    write_corpus(d, train=400, dev=12, test=12, seed=5)
    for split in ("train", "dev", "test"):
        (d / f"{split}.src").rename(d / f"{split}.gl")
        (d / f"{split}.tgt").rename(d / f"{split}.en")
    return d


@pytest.fixture(scope="module")
def dry_run(gl_en, tmp_path_factory):
    out, work = tmp_path_factory.mktemp("out"), tmp_path_factory.mktemp("work")
    proc = script(SMOKE=1, DATA_DIR=gl_en, WORK=work, OUT=out)
    assert proc.returncode == 0, f"run.sh failed ({proc.returncode})\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    unpacked = tmp_path_factory.mktemp("unpacked")
    with tarfile.open(out / "gl-en-2x2-gpu.tar.gz") as tar:
        tar.extractall(unpacked, filter="data")
    return out, unpacked, proc, work


def test_out_holds_what_the_device_tool_returns(dry_run):
    out, _, _, _ = dry_run
    files = sorted(p.name for p in out.iterdir())
    assert all((out / f).is_file() and re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files) and len(files) <= 8
    assert {
        "gl-en-2x2-gpu.tar.gz",
        "run.log",
        "budget.json",
        "summary.md",
        "mixed-precision.log",
        "benchmark.log",
        "benchmark-cpu-quick.json",
    } <= set(files)
    log = (out / "run.log").read_text()
    assert "checks: mixed-precision tests exit 0" in log and "checks: benchmark exit 0" in log
    assert "runs: 4 of 4 recorded" in log
    # the checks come after the runs, which have the time first
    assert log.index("runs: 4 of 4 recorded") < log.index("checks: mixed-precision tests exit")
    # without CUDA the CUDA cases (4 of mixed precision, 1 of attention) are reported skipped, not
    # passed; with CUDA they pass
    tests = (out / "mixed-precision.log").read_text()
    assert ("5 passed" if torch.cuda.is_available() else "5 skipped") in tests, tests[-2000:]


def test_every_cell_is_recorded_with_the_campaign_schema_and_the_same_budget(dry_run, gl_en):
    _, unpacked, _, _ = dry_run
    records = unpacked / "records"
    runs = json.loads((records / "runs.json").read_text())
    budget = json.loads((records / "budget.json").read_text())
    assert sorted((r["norm"], r["attention"]) for r in runs) == sorted(CELLS) and {r["seed"] for r in runs} == {1}
    n_test = len((gl_en / "test.en").read_text().splitlines())
    for r in runs:
        assert SCHEMA <= set(r), SCHEMA - set(r)
        assert r["updates"] == budget["updates"] == budget["epochs"] * budget["updates_per_epoch"]
        assert len(r["dev"]) == budget["dev_points"]
        assert (
            r["preset"] == "smoke-gpu" and ("--fp16" if torch.cuda.is_available() else "--bf16") in r["train_command"]
        )
        assert f"--max-update {budget['updates']}" in r["train_command"]
        assert f"--max-epoch {budget['epochs']}" in r["train_command"]
        assert len((records / r["hyp"]).read_text().splitlines()) == n_test
        assert bool(r["g"]) == (r["attention"] == "qknorm")
        name = f"{r['norm']}-{r['attention']}-seed{r['seed']}"
        for log in (f"{name}.train.log", f"{name}.generate.log", f"probe-{name}.train.log"):
            assert (unpacked / "logs" / log).is_file(), log
    assert 1 <= budget["epochs"] <= 2 and budget["runs_side_by_side"] == 4
    assert all(p["rate"] > 0 and p["updates"] == 4 and p["end_seconds"] > 0 for p in budget["probe"])
    # the time kept to translate and record is the longest the probe took, over the safety share
    assert budget["end_seconds"] == max(p["end_seconds"] for p in budget["probe"])
    assert budget["end_reserve_seconds"] >= budget["end_seconds"]
    summary = (records / "summary.md").read_text()
    assert f"{budget['epochs']} epochs ({budget['updates']} updates)" in summary
    assert "Stopped by: the budget (--max-epoch, --max-update)" in summary


def test_a_probe_cut_off_by_the_time_limit_ends_with_one_line_and_packs(gl_en, tmp_path):
    # The time limit leaves the probe no time: its runs are killed at once, none is measured. The call
    # must say so on its last line, after packing what there is (it once ended silently here: a
    # pipeline on the missing probe results failed under `set -o pipefail`).
    out = tmp_path / "out"
    proc = script(SMOKE=1, DATA_DIR=gl_en, WORK=tmp_path / "work", OUT=out, TIME_LIMIT=400, CHECK_SECONDS=390)
    pack = out / "gl-en-2x2-gpu.tar.gz"
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == (
        f"error: probe: none of the 4 runs finished (logs in {pack})"
    ), proc.stderr[-3000:]
    with tarfile.open(pack) as tar:
        assert {"records", "logs"} <= set(tar.getnames())
    assert "probe: 4 runs" in (out / "run.log").read_text()


def test_a_probe_that_leaves_no_epoch_still_runs_the_checks(gl_en, tmp_path):
    # END_RESERVE keeps more than the time limit for recording: no epoch fits. Nothing trains, but the
    # checks need no budget: they run, and the last line says what happened. The probe gets half the
    # time before the checks' 300 s: TIME_LIMIT leaves it minutes, for a machine busy with other tests.
    out = tmp_path / "out"
    proc = script(SMOKE=1, DATA_DIR=gl_en, WORK=tmp_path / "work", OUT=out, TIME_LIMIT=1500, END_RESERVE=100000)
    last = proc.stderr.strip().splitlines()[-1]
    expected = "error: no budget: no run trained; checks failed: "
    assert proc.returncode == 1 and last.startswith(expected), proc.stderr[-3000:]
    log = (out / "run.log").read_text()
    assert "not enough for one epoch" in log and "checks: mixed-precision tests exit" in log
    assert not (tmp_path / "work" / "arms").exists() and (out / "gl-en-2x2-gpu.tar.gz").exists()  # nothing trained


def test_the_budget_keeps_the_measured_end_before_the_deadline(dry_run, tmp_path):
    _, _, _, work = dry_run
    probes = sorted(str(p) for p in (work / "probe").iterdir())
    measured = max(int((work / "probe" / p / "end_seconds").read_text()) for p in probes)
    deadline = int(time.time()) + 3600
    for end in (None, 100):
        proc = subprocess.run(
            [sys.executable, "-m", "experiments.gpu_budget", "size", *probes, "--deadline", str(deadline)]
            + ["--out", str(tmp_path / "b.json"), "--max-epochs", "3"]
            + (["--end-seconds", str(end)] if end is not None else []),
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert proc.returncode == 0, proc.stderr
        updates, epochs, every, _, stop_hours, train_until = proc.stdout.split()
        budget = json.loads((tmp_path / "b.json").read_text())
        assert int(train_until) == budget["train_until"] == deadline - math.ceil((end or measured) / 0.9)
        assert int(epochs) == budget["epochs"] == 3 and int(updates) == 3 * budget["updates_per_epoch"]
        assert 3 % int(every) == 0
        assert 0 < float(stop_hours) * 3600 <= int(train_until) - time.time()


def test_plan_fits_the_time_and_spaces_the_validations():
    # 100 updates per epoch at 10/s: 10 s an epoch, 5 s a validation, 20 s start-up, 200 s left
    epochs, every = plan(100, 10.0, 5.0, 20.0, 200.0, dev_points=8)
    assert 20 + epochs * 10 + epochs // every * 5 <= 200 * 0.9 and epochs % every == 0
    assert epochs // every <= 8
    longer, _ = plan(100, 10.0, 5.0, 20.0, 2000.0, dev_points=8)
    assert longer > epochs
    assert plan(100, 10.0, 5.0, 20.0, 2000.0, dev_points=8, max_epochs=3) == (3, 1)
    assert plan(100, 10.0, 5.0, 20.0, 25.0, dev_points=8) is None  # not one epoch fits


def test_seeds_leave_two_cores_and_run_four_cells_a_seed():
    assert seeds(16, 3) == [1, 2, 3] and seeds(16, 5) == [1, 2, 3] and seeds(2, 3) == [1]
    # the time limit counts too: one seed in nine minutes, two in forty, as the cores allow
    assert seeds(10, 3, 540) == [1] and seeds(10, 3, 2400) == [1, 2] and seeds(10, 3, 3600) == [1, 2]


def test_bad_input_fails_with_one_line(tmp_path):
    for proc, message in (
        (script("bogus"), "unknown mode 'bogus'"),
        (script("prepare", DATA_DIR=""), "DATA_DIR="),
        (script(PRECISION="fp8", WORK=tmp_path / "w", OUT=tmp_path / "o", SMOKE=1, DATA_DIR=tmp_path), "PRECISION=fp8"),
    ):
        assert proc.returncode != 0 and message in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.gpu_budget",
            "size",
            str(tmp_path / "none"),
            "--deadline",
            "0",
            "--out",
            str(tmp_path / "b.json"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'none'}/train.log: missing (did the probe's fairseq-train finish?)"
    ]
