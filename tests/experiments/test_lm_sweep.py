"""The language-model learning-rate sweep: Wortsman et al.'s sensitivity measure on made-up runs,
and the whole sweep (data preparation, the three arms, results.json, figures, tables) end to end on
a tiny text, in seconds."""

import json
import sys
from pathlib import Path

import pytest
from conftest import run

from experiments.lm_sweep import sensitivity

ROOT = Path(__file__).resolve().parents[2]


def made_up_run(arm, lr, final, initial=10.0, diverged=None):
    losses = [final] * 20 if diverged is None else [final] * 5 + [float("nan")]
    return {
        "arm": arm,
        "lr": lr,
        "seed": 1,
        "loss": losses,
        "diverged": diverged,
        "stats": [{"update": 0, "loss": initial, "max_logit": {}, "min_entropy": {}, "g": {}}],
    }


def test_sensitivity_is_the_mean_excess_over_the_best_rate_capped_at_the_initial_loss():
    runs = [
        made_up_run("stock", 1e-3, 6.0),
        made_up_run("stock", 1e-2, 5.0),
        made_up_run("stock", 1e-1, 12.0),  # worse than at initialization: counts as the initial 10
        made_up_run("stock", 3e-1, 7.0, diverged="non-finite loss at update 6"),  # diverged: the initial 10
        made_up_run("qknorm", 1e-3, 5.5),
        made_up_run("qknorm", 1e-2, 5.0),
    ]
    s = sensitivity(runs)
    assert s["stock"]["best_final"] == 5.0 and s["stock"]["sensitivity"] == pytest.approx((1 + 0 + 5 + 5) / 4)
    assert s["qknorm"]["sensitivity"] == pytest.approx(0.25) and "qk_layernorm" not in s


def test_sweep_runs_end_to_end_on_a_tiny_text(toy_raw, tmp_path):
    out = tmp_path / "out"
    run(
        [
            sys.executable,
            "-m",
            "experiments.lm_sweep",
            "--train",
            toy_raw / "train.tgt",
            "--valid",
            toy_raw / "dev.tgt",
            "--vocab-size",
            "150",
            "--updates",
            "4",
            "--warmup-updates",
            "2",
            "--stats-interval",
            "2",
            "--lrs",
            "1e-3",
            "--work-dir",
            tmp_path / "work",
            "--out-dir",
            out,
        ],
        cwd=ROOT,
    )
    results = json.loads((out / "results.json").read_text())
    assert [r["arm"] for r in results["runs"]] == ["stock", "qknorm", "qk_layernorm"]
    for r in results["runs"]:
        assert len(r["loss"]) == 4 and [s["update"] for s in r["stats"]] == [0, 2, 4]
        assert r["command"].startswith("fairseq-train $WORK/bin --user-dir $USER_DIR ")
        assert str(tmp_path) not in r["command"]
    qknorm = results["runs"][1]
    assert qknorm["qk_scale_init"] > 0 and qknorm["stats"][-1]["g"]  # g0 from --tokens-per-sample, g recorded
    assert "--work-dir $WORK " in results["command"] and "--train train.tgt " in results["command"]
    assert (out / "final_loss_vs_lr.png").stat().st_size > 0 and (out / "max_logit_vs_lr.png").stat().st_size > 0
    assert "| arm | LR sensitivity (bits/token) |" in (out / "tables.md").read_text()


def test_missing_text_is_one_clear_line(tmp_path):
    proc = run(
        [
            sys.executable,
            "-m",
            "experiments.lm_sweep",
            "--train",
            tmp_path / "nope.en",
            "--valid",
            tmp_path / "nope.en",
            "--work-dir",
            tmp_path,
            "--out-dir",
            tmp_path,
        ],
        cwd=ROOT,
        check=False,
        env={"LM_SWEEP_TRAIN": "", "LM_SWEEP_VALID": ""},
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and last.endswith(f"{tmp_path / 'nope.en'}: no such text file")
