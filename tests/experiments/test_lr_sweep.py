"""The learning-rate sweep (experiments.lr_sweep, on the engine experiments.sweep): the divergence
rule, and one tiny sweep through the real command line (3 arms x 2 learning rates x 5 updates):
what results.json holds, that QKNorm's logits stay within g, the figures, reuse of finished runs,
and bad input."""

import json
import math
import sys

import numpy as np
import pytest
import torch
from conftest import run

from experiments.sweep import WINDOW, divergence, loss_summary, seed_table
from fairseq_qknorm.length_prior import g0_for_length

SWEEP = [sys.executable, "-m", "experiments.lr_sweep"]
TINY = [
    "--lrs",
    "1e-3",
    "3e-3",
    "--updates",
    "5",
    "--warmup-updates",
    "2",
    "--stats-interval",
    "2",
    "--seeds",
    "1",
    "--threads",
    "1",
]
MODULES = ["encoder self 0", "encoder self 1", "decoder self 0", "decoder self 1", "decoder cross 0", "decoder cross 1"]


def test_divergence_rule_flags_non_finite_and_rising_losses():
    falling = [10.0 - 0.1 * i for i in range(30)]
    assert divergence(falling) is None
    assert loss_summary(falling)["final"] == pytest.approx(sum(falling[-WINDOW:]) / WINDOW)

    with_nan = falling[:12] + [float("nan")] + falling[13:]
    assert "update 13" in divergence(with_nan)
    assert divergence(falling[:5] + [float("inf")]) is not None
    assert "update 4" in divergence(falling[:3] + [None])  # a step fairseq refused (non-finite gradients)
    assert math.isnan(loss_summary(with_nan)["final"])

    # Noisy but falling: single losses above the first one do not count, the windowed means do.
    noisy = [10.0 - 0.05 * i + (0.8 if i % 2 else 0.0) for i in range(2 * WINDOW)]
    assert noisy[1] > noisy[0] and divergence(noisy) is None
    rising = falling[:WINDOW] + [falling[0] + 0.5 + 0.1 * i for i in range(WINDOW)]
    assert "above" in divergence(rising)
    # A run that came back down below its start by the end of the window is not diverged.
    assert divergence(falling[:WINDOW] + [falling[0] + 1] + [falling[-1]] * (WINDOW - 1)) is None


def test_seed_table_gives_each_arm_and_rate_its_mean_range_and_divergences():
    def fake_run(arm, lr, seed, final, diverged=None, logit=5.0):
        stats = [{"max_logit": {"m": logit}, "min_entropy": {"m": 0.1 * seed}, "g": {}}]
        return {
            "arm": arm,
            "lr": lr,
            "seed": seed,
            "loss": [9.0] * WINDOW + [final] * WINDOW,
            "diverged": diverged,
            "stats": stats,
        }

    runs = [
        fake_run("qknorm", 0.01, 1, 2.0),
        fake_run("qknorm", 0.01, 2, 3.0, logit=9.0),
        fake_run("qknorm", 0.01, 3, 4.0, diverged="loss above its start"),
        fake_run("stock", 0.01, 1, float("nan"), diverged="non-finite loss at update 3", logit=float("inf")),
        fake_run("stock", 0.01, 2, 5.0),
    ]
    rows = seed_table(runs, ["stock", "qknorm"]).splitlines()[2:]
    assert rows == [
        "| stock | 0.01 | 2 | 5.000 (5.000..5.000) | 1 | 5.00 | 0.100 |",  # the NaN run: counted, not averaged
        "| qknorm | 0.01 | 3 | 3.000 (2.000..4.000) | 1 | 9.00 | 0.100 |",
    ]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    work, out = tmp_path_factory.mktemp("lr_sweep_work"), tmp_path_factory.mktemp("lr_sweep_out")
    proc = run([*SWEEP, "--work-dir", work, "--out-dir", out, "--arms", "stock", "qknorm", "qk_layernorm", *TINY])
    return work, out, proc, json.loads((out / "results.json").read_text())


def test_results_json_records_every_run(sweep):
    work, _, proc, results = sweep
    # commands as a reader runs them: the machine's folders as $WORK and $USER_DIR
    assert results["command"].startswith("python -m experiments.lr_sweep --work-dir $WORK --out-dir ")
    assert {(r["arm"], r["lr"]) for r in results["runs"]} == {
        (arm, lr) for arm in ("stock", "qknorm", "qk_layernorm") for lr in (1e-3, 3e-3)
    }
    assert results["settings"]["updates"] == 5 and results["machine"]["torch"]
    assert results["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()  # what rounded the numbers
    for r in results["runs"]:
        assert r["seed"] == 1 and r["diverged"] is None
        assert len(r["loss"]) == len(r["gnorm"]) == 5
        assert all(math.isfinite(x) and 0 < x < 20 for x in r["loss"]), r["loss"]
        assert r["command"].startswith("fairseq-train $WORK/bin --user-dir $USER_DIR --task translation ")
        assert f"--lr {r['lr']!r}" in r["command"] and "--save-dir SAVE_DIR" in r["command"]
        assert str(work) not in r["command"]
        assert [s["update"] for s in r["stats"]] == [0, 2, 4, 5]
        for s in r["stats"]:
            assert list(s["max_logit"]) == MODULES and list(s["min_entropy"]) == MODULES
            assert all(math.isfinite(v) for v in s["max_logit"].values())
            # per-head entropy of a softmax: between 0 and log(number of keys)
            assert all(0 <= v <= math.log(40) for v in s["min_entropy"].values())
    # The table has one row per run, and diverged = no everywhere.
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| stock") or line.startswith("| qk")]
    assert len(rows) == 6 and all("| no |" in row for row in rows)


def test_g_is_recorded_for_qknorm_only(sweep):
    work, _, _, results = sweep

    # The paper's g0 from the generated training data (word level): L = the larger side's 97.5th
    # percentile of sentence lengths.
    def percentile(side):
        with open(work / "raw" / f"train.{side}") as f:
            return int(np.percentile([len(line.split()) for line in f], 97.5, method="lower"))

    g0 = g0_for_length(max(percentile("src"), percentile("tgt")))
    for r in results["runs"]:
        if r["arm"] != "qknorm":
            assert all(s["g"] == {} for s in r["stats"])
            continue
        assert r["qk_scale_init"] == pytest.approx(g0)
        first, last = r["stats"][0]["g"], r["stats"][-1]["g"]
        assert sorted(first) == sorted(MODULES) and all(g == pytest.approx(g0) for g in first.values())
        assert any(last[m] != first[m] for m in MODULES)  # g is learned, and recorded as it moves
        for s in r["stats"]:
            # unit q and k: no logit can exceed g
            for m in MODULES:
                assert s["max_logit"][m] <= s["g"][m] + 1e-4


def test_figures_are_written(sweep):
    _, out, _, _ = sweep
    for name in ("final_loss_vs_lr.png", "max_logit_vs_lr.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert not list(out.glob("*.tmp"))


def test_rerun_keeps_finished_runs_and_refuses_other_settings(sweep):
    work, out, _, results = sweep
    proc = run([*SWEEP, "--work-dir", work, "--out-dir", out, "--arms", "qknorm", *TINY])
    assert "keeping 6 finished runs" in proc.stdout and "seed 1 | update" not in proc.stdout  # nothing trained
    assert json.loads((out / "results.json").read_text())["runs"] == results["runs"]

    longer = [*TINY, "--updates", "6"]
    proc = run([*SWEEP, "--work-dir", work, "--out-dir", out, *longer], check=False)
    assert proc.returncode == 1 and "holds runs with other settings" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert json.loads((out / "results.json").read_text())["runs"] == results["runs"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lrs", "0.1", "fast"], "argument --lrs: expected a positive number, got 'fast'"),
        (["--lrs", "-1"], "argument --lrs: expected a positive number, got '-1'"),
        (["--arms", "stock", "flash"], "argument --arms: invalid choice: 'flash'"),
        (["--updates", "10", "--warmup-updates", "20"], "--warmup-updates 20 exceeds --updates 10"),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, flags, message):
    proc = run([*SWEEP, "--work-dir", tmp_path / "w", "--out-dir", tmp_path / "o", *flags], check=False)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()
