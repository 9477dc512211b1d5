"""The paper code's learning-rate schedules (fairseq_qknorm/paper_lr_schedulers.py): the rate at
chosen updates, the decay on made-up sequences of dev scores, the stop, and the state a resumed run
gets back; in-process here, and through fairseq-train (below). Last, fairseq's own
reduce_lr_on_plateau resumed (fairseq_patches section 9)."""

import pytest
import torch
from fairseq.optim import FairseqOptimizer

import fairseq_qknorm  # noqa: F401
from fairseq_qknorm.errors import QKNormConfigError
from fairseq_qknorm.paper_lr_schedulers import (
    PaperConstantConfig,
    PaperConstantSchedule,
    PaperWarmupFlatConfig,
    PaperWarmupFlatSchedule,
)


class SGD(FairseqOptimizer):
    """The smallest fairseq optimizer: the schedulers only read and set its rate."""

    def __init__(self):
        super().__init__(None)
        self._optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)


def constant(lr=1e-3, stop_lr=5e-4, maximize=True, **kwargs):
    cfg = PaperConstantConfig(
        lr=[lr], stop_lr=stop_lr, stop_min_lr=-1.0, maximize_best_checkpoint_metric=maximize, **kwargs
    )
    return PaperConstantSchedule(cfg, SGD())


def warmup_flat(lr=1e-3, warmup=10, stop_lr=5e-4, **kwargs):
    cfg = PaperWarmupFlatConfig(
        lr=[lr],
        warmup_updates=warmup,
        stop_lr=stop_lr,
        stop_min_lr=-1.0,
        maximize_best_checkpoint_metric=True,
        **kwargs,
    )
    return PaperWarmupFlatSchedule(cfg, SGD())


def validate(scheduler, num_updates, score):
    """What fairseq-train does around a validation after NUM_UPDATES updates: the update's
    step_update, then the score (fairseq_patches section 8), then the stop question."""
    scheduler.step_update(num_updates)
    scheduler.step_validation(score)
    return scheduler.should_stop()


def test_constant_rate_from_the_first_update():
    s = constant(lr=3e-4)
    assert s.optimizer.get_lr() == 3e-4  # before the first update: no warm-up
    for n in (0, 1, 500, 10_000):
        assert s.step_update(n) == 3e-4


def test_warmup_is_linear_to_the_peak_then_flat():
    # update k (counted from 1) trains at peak * k / warmup: the paper code's
    # d^-0.5 * k * warmup^-1.5 with peak = d^-0.5 * warmup^-0.5
    peak = 512**-0.5 * 8000**-0.5
    assert f"{peak:.3g}" == "0.000494"  # the paper code's QKNorm peak, d = 512
    s = warmup_flat(lr=peak, warmup=8000)
    assert s.optimizer.get_lr() == pytest.approx(512**-0.5 * 1 * 8000**-1.5)  # update 1
    for done, k in ((0, 1), (1, 2), (3999, 4000), (7998, 7999)):
        assert s.step_update(done) == pytest.approx(512**-0.5 * k * 8000**-1.5, rel=1e-12)
    for done in (7999, 8000, 20_000):
        assert s.step_update(done) == pytest.approx(peak, rel=1e-12)


# A made-up dev BLEU sequence, one score per validation, with the paper code's rule worked out by
# hand: decay when a score is below the minimum of the three before it (equal is not below).
SCORES = [10.0, 12.0, 11.0, 13.0, 10.5, 11.0, 10.4, 10.4, 12.0, 9.0, 20.0, 8.0]
# decays:   -     -     -     -     yes   -     yes   -     -     yes   -     yes
#  (10.5 < min(12, 11, 13) = 11; 11.0 not < 10.5; 10.4 < min(13, 10.5, 11); 10.4 not < 10.4;
#   9.0 < min(10.4, 10.4, 12); 20 no; 8.0 < min(12, 9, 20))
DECAYS_AFTER = [0, 0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 4]


def test_decay_on_a_made_up_dev_bleu_sequence():
    s = constant(lr=1e-3, stop_lr=1e-9)
    for i, (score, decays) in enumerate(zip(SCORES, DECAYS_AFTER)):
        assert not validate(s, 100 * (i + 1), score)
        assert s.decays == decays, f"after score {i}: {s.dev_scores}"
        assert s.optimizer.get_lr() == pytest.approx(1e-3 * 0.8**decays)
        assert s.step_update(100 * (i + 1)) == pytest.approx(1e-3 * 0.8**decays)  # the rate stays


def test_decay_with_another_patience_and_factor():
    s = constant(lr=1.0, stop_lr=1e-9, lr_patience=1, lr_shrink=0.5)
    for i, score in enumerate([5.0, 4.0, 4.0, 6.0, 3.0]):  # worse than the one before: 4, 3
        validate(s, i + 1, score)
    assert s.decays == 2 and s.optimizer.get_lr() == 0.25


def test_decay_when_lower_is_better():
    # --best-checkpoint-metric loss: worse is above the maximum of the previous ones
    s = constant(lr=1.0, stop_lr=1e-9, maximize=False)
    for i, score in enumerate([5.0, 4.0, 4.5, 3.0, 4.6, 4.6, 4.0, 4.7]):
        validate(s, i + 1, score)
    assert s.decays == 2  # 4.6 > max(4, 4.5, 3); 4.7 > max(4.6, 4.6, 4)


def test_stop_once_the_rate_is_below_stop_lr():
    # 1e-3 * 0.8^3 = 5.12e-4 is not below 5e-4; 0.8^4 = 4.1e-4 is: the fourth decay stops training
    s = constant(lr=1e-3, stop_lr=5e-4)
    stops = [validate(s, 100 * (i + 1), score) for i, score in enumerate(SCORES)]
    assert stops == [False] * 11 + [True]
    assert s.should_stop()  # and it stays so


def test_no_decay_during_warmup_and_no_stop_until_after_it():
    # Falling scores throughout; warm-up of 10 updates, a validation every 2 updates.
    s = warmup_flat(lr=1e-3, warmup=10, stop_lr=0.9e-3)
    falling = [10.0 - i for i in range(9)]
    stops = [validate(s, 2 * (i + 1), score) for i, score in enumerate(falling)]
    # validations after 2..8 updates: warming up, scores only recorded; after 10 (= warmup) the
    # paper code decays, to 8e-4, below --stop-lr already, but stops only after 12
    assert s.dev_scores == falling
    assert stops[:5] == [False] * 5 and stops[5] is True
    assert s.decays == 5  # validations after 10, 12, 14, 16, 18 updates
    assert s.step_update(18) == pytest.approx(1e-3 * 0.8**5)


def test_state_round_trip_resumes_the_rule():
    s = constant(lr=1e-3, stop_lr=1e-9)
    for i, score in enumerate(SCORES[:7]):
        validate(s, i + 1, score)
    state = s.state_dict()
    assert state == {"best": None, "dev_scores": SCORES[:7], "decays": 2}
    resumed = constant(lr=1e-3, stop_lr=1e-9)
    resumed.load_state_dict(state)
    for i, score in enumerate(SCORES[7:]):
        validate(resumed, 8 + i, score)
    assert resumed.decays == DECAYS_AFTER[-1] and resumed.dev_scores == SCORES


def test_scores_are_kept_as_plain_floats():
    import numpy as np

    s = constant()
    validate(s, 1, np.float64(12.5))  # fairseq's BLEU can be a numpy float
    assert type(s.state_dict()["dev_scores"][0]) is float  # loads under torch's safe unpickler


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: constant(lr_shrink=1.0), "--lr-shrink must be between 0 and 1"),
        (lambda: constant(lr_patience=0), "--lr-patience must be 1 or more"),
        (lambda: warmup_flat(warmup=0), "--warmup-updates must be 1 or more"),
        (
            lambda: PaperConstantSchedule(
                PaperConstantConfig(lr=[1e-3], stop_min_lr=1e-5, maximize_best_checkpoint_metric=True), SGD()
            ),
            "use --stop-lr to stop at a rate, not --stop-min-lr",
        ),
    ],
)
def test_bad_settings_are_one_line_errors(make, message):
    with pytest.raises(QKNormConfigError, match=message):
        make()


# ---------------------------------------------------------------------------------------------
# Through fairseq-train: fairseq_cli.train's own main, with the plugin from --user-dir. Only the
# dev score of each validation is made up (fairseq's get_valid_stats sets it from the update count),
# so the decays are known in advance; everything else is fairseq's training loop.
# ---------------------------------------------------------------------------------------------
DRIVER = """
import os, sys
import fairseq_cli.train as train
scores = dict(pair.split(":") for pair in os.environ["DEV_SCORES_BY_UPDATE"].split(","))
fairseq_get_valid_stats = train.get_valid_stats
def get_valid_stats(cfg, trainer, stats, *args):
    stats["bleu"] = float(scores[str(trainer.get_num_updates())])
    return fairseq_get_valid_stats(cfg, trainer, stats, *args)
train.get_valid_stats = get_valid_stats
sys.argv[0] = "fairseq-train"
train.cli_main()
"""
# Validations every 2 updates; warm-up of 10 updates. Falling at 8 (no decay: warming up), then
# below the minimum of the three before it at 12, 16 and 18: three decays, the third to
# 1e-3 * 0.8^3 = 5.12e-4, below --stop-lr 6e-4: training stops after 18 updates.
DEV_SCORES_BY_UPDATE = {2: 5, 4: 6, 6: 7, 8: 1, 10: 8, 12: 0.5, 14: 9, 16: 0.4, 18: 0.3, 20: 10, 22: 11}


def logged_rates(log):
    """{num_updates: lr} from fairseq's per-update log lines (the rate set for the next update)."""
    import re

    rates = {}
    for line in log.splitlines():
        m_lr, m_n = re.search(r"\blr=([0-9.e-]+)", line), re.search(r"\bnum_updates=(\d+)", line)
        if m_lr and m_n and "| valid |" not in line:
            rates[int(m_n.group(1))] = float(m_lr.group(1))
    return rates


def train_with_made_up_scores(toy_bin, save, max_update, scheduler_flags):
    import sys

    from conftest import COMMON_TRAIN_FLAGS, TINY_MODEL, USER_DIR, run

    flags = [
        *COMMON_TRAIN_FLAGS, "--log-interval", "1", "--criterion", "cross_entropy", "--max-tokens", "1500",
        *scheduler_flags, "--best-checkpoint-metric", "bleu", "--maximize-best-checkpoint-metric",
        "--validate-interval-updates", "2", "--save-interval-updates", "2", "--keep-interval-updates", "1",
        "--validate-interval", "1000000", "--max-update", str(max_update), "--save-dir", str(save),
    ]  # fmt: skip
    scores = ",".join(f"{u}:{s}" for u, s in DEV_SCORES_BY_UPDATE.items())
    driver = [sys.executable, "-c", DRIVER]
    model = ["--user-dir", USER_DIR, "--arch", "transformer_qknorm", *TINY_MODEL]
    return run([*driver, toy_bin / "bin", *model, *flags], env={"DEV_SCORES_BY_UPDATE": scores})


def checkpoint_state(path):
    state = torch.load(path, map_location="cpu", weights_only=True)  # as the plugin loads it
    last = state["optimizer_history"][-1]
    return last["num_updates"], last["lr_scheduler_state"]


WARMUP_FLAT = ["--lr-scheduler", "paper_warmup_flat", "--lr", "1e-3", "--warmup-updates", "10", "--stop-lr", "6e-4"]


def test_fairseq_train_warms_up_decays_on_dev_scores_stops_and_resumes(toy_bin, tmp_path):
    # First up to an epoch cap: the paper code's max_epochs is --max-update (epochs x updates per
    # epoch), here 6 epochs of 2 updates. Then the same command with a larger cap resumes from the
    # checkpoint, continues the decay rule from its dev scores and stops at the rate.
    first = train_with_made_up_scores(toy_bin, tmp_path, max_update=12, scheduler_flags=WARMUP_FLAT)
    num_updates, state = checkpoint_state(tmp_path / "checkpoint_last.pt")
    assert num_updates == 12 and state["decays"] == 1 and len(state["dev_scores"]) == 6
    resumed = train_with_made_up_scores(toy_bin, tmp_path, max_update=100, scheduler_flags=WARMUP_FLAT)
    log = resumed.stdout + resumed.stderr
    assert "stopping training" not in first.stdout + first.stderr and "Loaded checkpoint" in log
    rates = {**logged_rates(first.stdout + first.stderr), **logged_rates(log)}
    assert sorted(rates) == list(range(1, 19)), log[-3000:]  # stopped after 18 updates, not at 100
    # the rate logged after n updates is the one for update n + 1: a linear warm-up over 10 updates,
    # flat, then the decays after the validations at 12 and 16 updates
    want = {n: 1e-3 * min(n + 1, 10) / 10 for n in range(1, 13)}
    want.update({n: 8e-4 for n in range(13, 17)})
    want.update({n: 6.4e-4 for n in range(17, 19)})
    for n, lr in want.items():
        assert rates[n] == pytest.approx(lr, rel=1e-4), f"update {n}: {rates[n]} != {lr}"
    assert "stopping training because the learning rate (0.000512) is below --stop-lr (0.0006)" in log
    num_updates, state = checkpoint_state(tmp_path / "checkpoint_last.pt")
    assert num_updates == 18 and state["decays"] == 3
    assert state["dev_scores"] == [float(DEV_SCORES_BY_UPDATE[u]) for u in range(2, 19, 2)]
    # every validation was saved (--save-interval-updates): the best dev score (9) is at 14 updates
    assert checkpoint_state(tmp_path / "checkpoint_best.pt")[0] == 14


# ---------------------------------------------------------------------------------------------
# fairseq's reduce_lr_on_plateau, which fairseq-train steps at each epoch's end with its score,
# after saving that epoch's checkpoint. 2 updates an epoch (800 sentences, 400 a batch).
# ---------------------------------------------------------------------------------------------
# Patience 2: no better score at 4, 6 and 8 (the third in a row: decay), at 10; better at 12; not at
# 14, 16 and 18 (decay). A run stopped after epoch 3 (6 updates) saved 1 bad validation before 6's.
PLATEAU_SCORES = {2: 5, 4: 4, 6: 4, 8: 3, 10: 2, 12: 6, 14: 1, 16: 1, 18: 1, 20: 1}
PLATEAU = ["--lr-scheduler", "reduce_lr_on_plateau", "--lr", "1e-3", "--lr-shrink", "0.5", "--lr-patience", "2"]


def train_on_plateau(toy_bin, save, max_epoch):
    import sys

    from conftest import COMMON_TRAIN_FLAGS, TINY_MODEL, USER_DIR, run

    flags = [
        *COMMON_TRAIN_FLAGS, "--log-interval", "1", "--criterion", "cross_entropy", "--batch-size", "400",
        "--max-tokens", "100000", *PLATEAU, "--best-checkpoint-metric", "bleu", "--maximize-best-checkpoint-metric",
        "--max-epoch", str(max_epoch), "--save-dir", str(save),
    ]  # fmt: skip
    scores = ",".join(f"{u}:{s}" for u, s in PLATEAU_SCORES.items())
    model = ["--user-dir", USER_DIR, "--arch", "transformer_qknorm", *TINY_MODEL]
    proc = run([sys.executable, "-c", DRIVER, toy_bin / "bin", *model, *flags], env={"DEV_SCORES_BY_UPDATE": scores})
    return proc.stdout + proc.stderr


def test_reduce_lr_on_plateau_resumed_decays_where_the_run_uninterrupted_does(toy_bin, tmp_path):
    straight = logged_rates(train_on_plateau(toy_bin, tmp_path / "straight", max_epoch=10))
    # the rate logged after n updates is the one for update n + 1: decays after the validations at
    # 8 and 18 updates
    want = {n: 1e-3 if n <= 8 else 5e-4 if n <= 18 else 2.5e-4 for n in range(1, 21)}
    assert straight == pytest.approx(want, rel=1e-4)

    first = logged_rates(train_on_plateau(toy_bin, tmp_path / "resumed", max_epoch=3))
    num_updates, state = checkpoint_state(tmp_path / "resumed" / "checkpoint_last.pt")
    log = train_on_plateau(toy_bin, tmp_path / "resumed", max_epoch=10)
    # fairseq alone forgot the count and 6's step, and decayed only after 18 updates
    assert {**first, **logged_rates(log)} == pytest.approx(want, rel=1e-4)
    assert num_updates == 6 and state.get("num_bad_epochs") == 1  # saved before 6's step
    assert "reduce_lr_on_plateau resumed: 1 validation(s) without improvement" in log
