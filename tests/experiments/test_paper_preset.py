"""The `paper` and `paper_controlled` presets (examples/common.sh): the fairseq-train command of
every arm and pair, checked against the values of the paper's own code (CyndxAI/QKNorm,
QKNorm/configurations.py and controller.py), written out below. Shell only: no training."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# configurations.py. The QKNorm configurations per pair: epoch_size (updates between validations),
# stop_lr, max_epochs; all of them UPFLAT_WU with warmup_steps 8000 at d = 512. The ScaleNorm
# baseline, base(): NO_WU at lr 3e-4, stop_lr 5e-5. Both: lr_decay 0.8, patience 3.
PAPER_CODE_QKNORM = {
    "en-vi": dict(epoch_size=1500, stop_lr=1e-5, max_epochs=200),
    "ar-en": dict(epoch_size=2000, stop_lr=1e-5, max_epochs=200),
    "en-he": dict(epoch_size=2000, stop_lr=1e-5, max_epochs=200),
    "gl-en": dict(epoch_size=100, stop_lr=5e-5, max_epochs=1000),
    "sk-en": dict(epoch_size=600, stop_lr=1e-5, max_epochs=200),
}
PAPER_CODE_WARMUP, PAPER_CODE_DIM = 8000, 512
PAPER_CODE_BASELINE = dict(lr=3e-4, stop_lr=5e-5)
PAPER_CODE_DECAY = dict(lr_shrink=0.8, lr_patience=3)


def train_commands(pair, preset, cells, env=None):
    """{cell: fairseq-train argv} as the recipes build it for each 2x2 cell (scalenorm.dot is the
    paper's baseline, layernorm.qknorm its QKNorm system)."""
    script = f"""
        source examples/common.sh
        set_pair {pair}; set_preset {preset}
        WORK=/work USER_DIR=/plugin DEVICE_FLAGS=--cpu
        for cell in {" ".join(cells)}; do
            IFS=: read -r name arch flags <<< "$(two_by_two_arm "$cell")"
            train_command /save 1 "$arch" $flags
            printf '%s\\n' "== $cell" "${{TRAIN_COMMAND[@]}}"
        done
    """
    env = {k: v for k, v in os.environ.items() if k not in ("LR", "WARMUP", "MAX_UPDATE", "PRESET")}
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    commands, cell = {}, None
    for line in proc.stdout.splitlines():
        if line.startswith("== "):
            cell = line[3:]
            commands[cell] = []
        else:
            commands[cell].append(line)
    return commands


def flags(argv):
    """--flag value pairs of an argv ({flag: value}; a switch: True)."""
    out = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else "--"
            out[arg] = True if nxt.startswith("--") else nxt
    return out


def assert_warmup_flat(f, qknorm):
    assert f["--lr-scheduler"] == "paper_warmup_flat"
    assert int(f["--warmup-updates"]) == PAPER_CODE_WARMUP
    assert float(f["--lr"]) == pytest.approx(PAPER_CODE_DIM**-0.5 * PAPER_CODE_WARMUP**-0.5, rel=1e-5)
    assert f"{float(f['--lr']):.3g}" == "0.000494"
    assert float(f["--stop-lr"]) == qknorm["stop_lr"]


def assert_paper_epochs_decay_and_bleu(f, qknorm):
    # the paper code's epoch: epoch_size updates, then a validation (none at fairseq's epoch ends);
    # its epoch cap in updates; its decay rule; dev BLEU without sacrebleu's tokenization
    assert int(f["--validate-interval-updates"]) == qknorm["epoch_size"]
    assert int(f["--save-interval-updates"]) == qknorm["epoch_size"]
    assert int(f["--validate-interval"]) >= 10**6
    assert int(f["--max-update"]) == qknorm["max_epochs"] * qknorm["epoch_size"]
    assert float(f["--lr-shrink"]) == PAPER_CODE_DECAY["lr_shrink"]
    assert int(f["--lr-patience"]) == PAPER_CODE_DECAY["lr_patience"]
    assert f["--best-checkpoint-metric"] == "bleu" and f["--maximize-best-checkpoint-metric"] is True
    assert f["--eval-bleu"] is True and f["--eval-tokenized-bleu"] is True
    assert "--stop-min-lr" not in f and "--warmup-init-lr" not in f


@pytest.mark.parametrize("pair", sorted(PAPER_CODE_QKNORM))
def test_paper_preset_trains_each_arm_as_the_paper_code(pair):
    qknorm = PAPER_CODE_QKNORM[pair]
    commands = train_commands(pair, "paper", ["scalenorm.dot", "layernorm.qknorm"])
    baseline, system = flags(commands["scalenorm.dot"]), flags(commands["layernorm.qknorm"])
    suffix = "_glen" if pair == "gl-en" else ""
    assert baseline["--arch"] == f"transformer_scalenorm_paper{suffix}"
    assert system["--arch"] == f"transformer_qknorm_paper{suffix}"
    # the baseline: constant rate from the first update, no warm-up
    assert baseline["--lr-scheduler"] == "paper_constant" and "--warmup-updates" not in baseline
    assert float(baseline["--lr"]) == PAPER_CODE_BASELINE["lr"]
    assert float(baseline["--stop-lr"]) == PAPER_CODE_BASELINE["stop_lr"]
    # the QKNorm system: warm-up to d^-0.5 * warmup^-0.5, then flat
    assert_warmup_flat(system, qknorm)
    for f in (baseline, system):
        assert_paper_epochs_decay_and_bleu(f, qknorm)


@pytest.mark.parametrize("pair", ["gl-en", "en-vi"])
def test_paper_controlled_gives_every_2x2_cell_the_qknorm_systems_schedule(pair):
    commands = train_commands(
        pair, "paper_controlled", ["scalenorm.dot", "scalenorm.qknorm", "layernorm.dot", "layernorm.qknorm"]
    )
    schedules = set()
    for argv in commands.values():
        f = flags(argv)
        assert_warmup_flat(f, PAPER_CODE_QKNORM[pair])
        assert_paper_epochs_decay_and_bleu(f, PAPER_CODE_QKNORM[pair])
        schedules.add(tuple(argv[argv.index("--optimizer") : argv.index("--criterion")]))
    assert len(schedules) == 1, schedules  # one schedule, flag for flag


def test_plateau_presets_keep_their_command():
    # the cpu preset (the 2x2 campaigns on CPUs): fairseq's reduce_lr_on_plateau, as before
    f = flags(train_commands("gl-en", "cpu", ["layernorm.qknorm"])["layernorm.qknorm"])
    assert f["--lr-scheduler"] == "reduce_lr_on_plateau" and f["--lr"] == "1e-3"
    assert (f["--lr-shrink"], f["--lr-patience"], f["--warmup-updates"]) == ("0.8", "3", "400")
    assert (f["--warmup-init-lr"], f["--stop-min-lr"], f["--validate-interval"]) == ("5.05e-05", "5e-5", "2")
    assert f["--max-update"] == "1400"
    for absent in ("--eval-tokenized-bleu", "--stop-lr", "--validate-interval-updates", "--save-interval-updates"):
        assert absent not in f


def test_the_2x2_recipes_refuse_the_paper_presets_two_schedules():
    script = "source examples/common.sh; set_pair gl-en; set_preset {}; require_one_schedule"
    proc = subprocess.run(["bash", "-c", script.format("paper")], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode != 0
    assert "the 2x2 needs one for every cell: PRESET=paper_controlled" in proc.stderr
    for preset in ("paper_controlled", "cpu"):
        proc = subprocess.run(["bash", "-c", script.format(preset)], capture_output=True, text=True, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr


def test_paper_preset_command_trains_through_fairseq_train(toy_bin, tmp_path):
    """The paper preset's own command, at toy size: validations only every VALID_UPDATES updates
    (none at fairseq's epoch ends), each one's real dev BLEU handed to the scheduler and saved with
    the checkpoint, and the epoch cap (MAX_PAPER_EPOCHS epochs) ending training."""
    import re

    import torch

    script = f"""
        source examples/common.sh
        set_pair toy; set_preset paper
        WORK={toy_bin} USER_DIR=$(fairseq-qknorm-user-dir) DEVICE_FLAGS=--cpu
        train_command {tmp_path} 1 "$QKNORM_ARCH"
        "${{TRAIN_COMMAND[@]}}"
    """
    from conftest import TINY_MODEL

    env = dict(
        os.environ,
        VENV=str(Path(sys.executable).parent.parent),  # the tests' environment
        MODEL_FLAGS=" ".join(TINY_MODEL),
        VALID_UPDATE_INTERVAL="4",
        MAX_PAPER_EPOCHS="2",
        WARMUP="6",
        LOG_INTERVAL="1",
    )
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=ROOT, env=env)
    log = proc.stdout + proc.stderr
    (tmp_path / "train.log").write_text(log)
    assert proc.returncode == 0, log[-4000:]
    assert "num_updates: 8 >= max_update: 8" in log  # 2 epochs of 4 updates
    valid = [ln for ln in log.splitlines() if "| valid on 'valid' subset |" in ln]
    updates = [int(re.search(r"\| num_updates (\d+)", ln).group(1)) for ln in valid]
    assert updates == [4, 8], valid  # none at fairseq's epoch ends (about every 6 updates here)
    assert "end of epoch 1 " in log
    bleus = [float(re.search(r"\| bleu ([0-9.]+)", ln).group(1)) for ln in valid]
    import fairseq_qknorm  # noqa: F401  (the checkpoints' allow-list, as fairseq's own loads get it)

    state = torch.load(tmp_path / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert state["optimizer_history"][-1]["lr_scheduler_state"]["dev_scores"] == pytest.approx(bleus, abs=0.01)
