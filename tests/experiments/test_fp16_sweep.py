"""The fp16 learning-rate sweep (experiments.fp16_sweep): what one run records, how a run that
fairseq stops with "Minimum loss scale reached" is recorded, and one tiny sweep through the command
line (results.json, the figures, the table beside the fp32 sweep)."""

import json
import math
import sys

import pytest
from conftest import build_model, run

from experiments import fp16_sweep, lr_sweep

SWEEP = [sys.executable, "-m", "experiments.fp16_sweep"]
TINY = ["--lrs", "0.3", "--updates", "3", "--warmup-updates", "2", "--stats-interval", "2", "--seeds", "1"]
MODULES = ["encoder self 0", "encoder self 1", "decoder self 0", "decoder self 1", "decoder cross 0", "decoder cross 1"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("fp16_sweep_work")
    lr_sweep.prepare_data(work)
    return work


def train_run(work, arm, lr, seed, updates, warmup, stats_interval):
    return fp16_sweep.train_run(fp16_sweep.SWEEP, work / "bin", work, arm, lr, seed, updates, warmup, stats_interval)


def test_a_run_records_every_attempted_update_and_its_loss_scale(work):
    run = train_run(work, "qknorm", 0.01, 1, 3, 2, 2)
    assert run["outcome"] == "finished" and run["stopped_at_update"] is None and run["error"] is None
    assert run["applied"].count(True) == 3
    assert len(run["loss"]) == len(run["applied"]) == len(run["loss_scale"])
    assert run["loss_scale"][0] == 128.0  # fairseq's default initial scale
    assert all(0 < loss < 20 for loss in run["loss"])
    assert run["command"].startswith("fairseq-train $WORK/bin --user-dir $USER_DIR ")
    assert run["command"].split()[-1] == "--fp16"
    assert [s["update"] for s in run["stats"]] == [0, 2, 3]
    for s in run["stats"]:
        assert list(s["max_logit"]) == MODULES and 0 < s["fp16_loss"] < 20
        for m in MODULES:  # unit q and k: no logit exceeds g
            assert s["max_logit"][m] <= s["g"][m] + 1e-3
    assert run["max_logit"] == max(v for s in run["stats"] for v in s["max_logit"].values())


def test_minimum_loss_scale_is_recorded_as_the_outcome(work, monkeypatch):
    # Overflowing from the first update, with a minimum one halving away: fairseq's own
    # FloatingPointError, whatever its NaN-detector rerun raises after it.
    flags = fp16_sweep.fairseq_flags
    forced = ["--fp16-init-scale", "1000000", "--min-loss-scale", "500000"]
    monkeypatch.setattr(fp16_sweep, "fairseq_flags", lambda *a: [*flags(*a), *forced])
    run = train_run(work, "stock", 0.01, 1, 3, 2, 2)
    assert run["outcome"] == "minimum loss scale" and run["stopped_at_update"] == 1
    assert run["error"].startswith("FloatingPointError: Minimum loss scale reached (500000.0)")
    assert run["applied"] == [False] and run["loss_scale"] == [1e6] and run["final_loss_scale"] == 1e6
    assert [s["update"] for s in run["stats"]] == [0, 0]
    assert run["first_non_finite"] is None  # the scaled gradients overflowed, the forward pass did not


def test_first_non_finite_names_the_module_where_the_forward_pass_leaves_fp16():
    import torch

    model, _ = build_model()
    model.half()
    model.encoder.layers[1].fc1.weight.data[0, 0] = float("inf")
    tokens = torch.tensor([[5, 6, 7, 8, 2]])
    sample = {"net_input": {"src_tokens": tokens, "src_lengths": torch.tensor([5]), "prev_output_tokens": tokens}}
    found = fp16_sweep.first_non_finite(model, lambda m, s: m(**s["net_input"]), sample)
    assert found["module"] == "encoder.layers.1.fc1" and found["kind"] == "Linear"
    assert 0 < found["largest_input"] < 65504
    model.encoder.layers[1].fc1.weight.data[0, 0] = 0.0
    assert fp16_sweep.first_non_finite(model, lambda m, s: m(**s["net_input"]), sample) is None


def test_fairseq_error_finds_the_floating_point_error_another_error_hid():
    try:
        try:
            raise FloatingPointError("Minimum loss scale reached (0.0001). Your loss is probably exploding.")
        except FloatingPointError:
            raise StopIteration  # noqa: B904 - as fairseq's rerun raises it
    except StopIteration as e:
        hidden = e
    assert isinstance(fp16_sweep.fairseq_error(hidden), FloatingPointError)
    assert fp16_sweep.fairseq_error(ValueError("x")).args == ("x",)


def test_table_sits_beside_the_fp32_run_of_the_same_arm_rate_and_seed():
    run = {
        "arm": "stock",
        "lr": 0.3,
        "seed": 2,
        "outcome": "minimum loss scale",
        "stopped_at_update": 98,
        "loss": [9.0, None],
        "applied": [True, False],
        "loss_scale": [128.0, 64.0],
        "final_loss_scale": 64.0,
        "max_logit": 70000.0,
        "stats": [{"update": 0, "max_logit": {"m": 5.0}}, {"update": 97, "max_logit": {"m": 70000.0}}],
    }
    fp32 = {("stock", 0.3, 2): {"final": 6.595, "diverged": None, "max_logit": 661664.62}}
    [row] = fp16_sweep.markdown_table([run], fp32).splitlines()[2:]
    assert row == (
        "| stock | 0.3 | 2 | minimum loss scale at update 98 | 1 | 1 | 128 -> 64 | nan | 70000.0 | 97 | 6.595 | 661664.6 |"
    )


def test_sweep_command_writes_results_figures_and_table(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    proc = run([*SWEEP, "--work-dir", work, "--out-dir", out, "--arms", "qk_layernorm", *TINY])
    results = json.loads((out / "results.json").read_text())
    [r] = results["runs"]
    assert (r["arm"], r["lr"], r["seed"], r["outcome"]) == ("qk_layernorm", 0.3, 1, "finished")
    assert results["settings"]["precision"] == "--fp16" and results["settings"]["updates"] == 3
    assert all(math.isfinite(x) for x in r["loss_scale"])
    for name in ("loss_scale.png", "max_logit_vs_lr.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| qk_layernorm | 0.3 | 1 | finished | 3 |" in proc.stdout
    # 3 updates are not the fp32 sweep's settings: nothing is put beside them
    assert "ran other settings: no fp32 runs beside these" in proc.stdout
