"""fairseq's own distributed training of the QKNorm model: several processes.

The recipe's train_arm with NPROC=2 trains through torchrun with two CPU processes (gloo), with
validation, --eval-bleu and checkpointing; its logged command, rerun with a larger budget (as after
a kill), resumes from checkpoint_last.pt through rank 0's broadcast of the checkpoint. Each rank
records its g values before its first update and after every update (a test-only sitecustomize on
PYTHONPATH): they must be equal bit for bit across ranks, and equal to the checkpoints' g. The
command the recipe builds for GPUs (NCCL) is checked without running it."""

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import RECORD_G, read_records, run

import fairseq_qknorm  # noqa: F401  (allow-lists fairseq checkpoint classes for torch.load)

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = ROOT / ".venv" / "bin"
UPDATES, RESUMED_UPDATES = 4, 6


def recipe_env(work, hooks, records):
    python_path = os.pathsep.join(filter(None, [str(hooks), os.environ.get("PYTHONPATH")]))
    return dict(
        PRESET="smoke",
        MAX_UPDATE=str(UPDATES),
        NPROC="2",
        DEVICE_FLAGS="--cpu",
        WORK=str(work),
        PYTHONPATH=python_path,
        QK_G_RECORD_DIR=str(records),
        PATH=f"{VENV_BIN}:{os.environ['PATH']}",
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
    )


@pytest.fixture(scope="module")
def distributed(toy_bin, tmp_path_factory):
    """The QKNorm arm trained by the recipe with NPROC=2 (4 updates), then resumed to 6 updates
    with its logged command: (arm dir, recipe output, resume output, checkpoint_last g at 4
    updates, per-rank g records)."""
    work, hooks, records = (tmp_path_factory.mktemp(name) for name in ("dist_work", "dist_hooks", "dist_g"))
    (work / "bin").symlink_to(toy_bin / "bin")  # the binarized data, as prepare() leaves it
    (hooks / "sitecustomize.py").write_text(RECORD_G)
    env = recipe_env(work, hooks, records)
    arm = work / "arms" / "qknorm-seed1"
    trained = run(
        [
            "bash",
            "-c",
            "source examples/common.sh && set_pair toy && set_preset smoke && setup_work "
            '&& train_arm "$WORK/arms/qknorm-seed1" transformer_qknorm_paper',
        ],
        env=env,
        cwd=ROOT,
    )
    g_at_4 = checkpoint_g(arm / "checkpoints" / "checkpoint_last.pt")

    # As if killed after update 4 of a 6-update budget: the checkpoints where fairseq-train wrote
    # them, and the same logged command with the larger budget.
    command = shlex.split((work / "commands.sh").read_text().strip().splitlines()[-1])
    save_dir = Path(command[command.index("--save-dir") + 1])
    shutil.copytree(arm / "checkpoints", save_dir)
    command[command.index("--max-update") + 1] = str(RESUMED_UPDATES)
    resumed = run(command, env=env)
    return arm, trained, resumed.stdout + resumed.stderr, g_at_4, records


def checkpoint_g(path):
    model = torch.load(path)["model"]  # weights_only=True, torch's default
    return {
        name: [float(x).hex() for x in value.flatten().tolist()]
        for name, value in model.items()
        if name.endswith("qk_scale.g")
    }


def test_recipe_trains_validates_and_saves_with_two_cpu_processes(distributed):
    arm, trained, _, _, _ = distributed
    command = next(
        line for line in (arm.parents[1] / "commands.sh").read_text().splitlines() if "fairseq-train" in line
    )
    assert command.startswith("torchrun --standalone --nproc-per-node 2 ")
    for flag in (
        "--distributed-world-size 2",
        "--distributed-backend gloo",
        "--ddp-backend legacy_ddp",
        "--cpu",
        "--user-dir",
        "--max-tokens 512",
    ):  # the smoke preset's 1,024 tokens per update, over 2 ranks
        assert flag in command
    log = (arm / "train.log").read_text()
    assert "distributed init (rank 0)" in log and "distributed init (rank 1)" in log
    assert "training on 2 devices" in log and "num_updates 4" in log
    assert "valid on 'valid' subset" in log and "| bleu " in log, log[-3000:]  # --eval-bleu over both ranks' shards
    assert (arm / "checkpoints" / "checkpoint_best.pt").is_file()
    assert (arm / "train_seconds").is_file()
    # A new process reads the distributed checkpoint with the plugin's allow-list (torch's safe unpickler).
    assert "one g per attention module" in (arm / "inspect.txt").read_text(), (arm / "inspect.log").read_text()[-2000:]
    assert "2 processes (gloo), --max-tokens 512 per process" in trained.stderr


def test_logged_command_resumes_from_checkpoint_last(distributed):
    arm, _, resumed, g_at_4, records = distributed
    assert re.search(r"Loaded checkpoint .*checkpoint_last\.pt \(epoch \d+ @ 4 updates\)", resumed), resumed[-3000:]
    assert f"num_updates {RESUMED_UPDATES}" in resumed
    # Both ranks resumed from the checkpoint (rank 1 from rank 0's broadcast), not from a new init.
    for rank in (0, 1):
        starts = [r for r in read_records(records, rank) if r["start"]]
        assert [r["update"] for r in starts] == [0, UPDATES]
        assert starts[1]["g"] == g_at_4


def test_g_is_identical_across_ranks_after_every_update(distributed):
    arm, _, _, _, records = distributed
    rank0, rank1 = read_records(records, 0), read_records(records, 1)
    assert [r["update"] for r in rank0] == [0, 1, 2, 3, 4, 4, 5, 6]  # before, after each update, resumed
    assert [r["update"] for r in rank1] == [r["update"] for r in rank0]
    for r0, r1 in zip(rank0, rank1):
        assert len(r0["g"]) == 3  # smoke model: encoder self, decoder self and cross attention
        assert r0["g"] == r1["g"], f"g differs between ranks at update {r0['update']}"
    # Not vacuous: the ranks trained on different sentences, and g moved.
    assert all(r0["ids"] != r1["ids"] for r0, r1 in zip(rank0, rank1) if not r0["start"])
    assert rank0[-1]["g"] != rank0[0]["g"]
    # The saved model is the ranks' model.
    assert checkpoint_g(arm / "checkpoints.tmp" / "checkpoint_last.pt") == rank0[-1]["g"]


# The command for GPUs, without running it: a fake CUDA device count, fairseq-train not run.
DRY = """
source examples/common.sh
set_pair toy; set_preset smoke
WORK=$1 USER_DIR=/user-dir
python() { if [[ "$*" == *device_count* ]]; then echo "$GPUS"; else command python "$@"; fi; }
run_logged() { printf '%s\\n' "$@" > "$WORK/command"; mkdir -p "$dir/checkpoints.tmp"; touch "$dir/checkpoints.tmp/checkpoint_best.pt"; }
train_arm "$WORK/arm" transformer_scalenorm_paper
"""


def dry(tmp_path, **env):
    environ = dict(os.environ, PATH=f"{VENV_BIN}:{os.environ['PATH']}", GPUS="4", DEVICE_FLAGS="")
    environ.update(env)
    proc = subprocess.run(
        ["bash", "-c", DRY, "dry", str(tmp_path)], capture_output=True, text=True, env=environ, cwd=ROOT
    )
    command = (tmp_path / "command").read_text().splitlines() if proc.returncode == 0 else None
    return proc, command


def test_gpu_command_uses_nccl_one_process_per_gpu(tmp_path):
    proc, command = dry(tmp_path, NPROC="4")
    assert proc.returncode == 0, proc.stderr
    assert command[:5] == ["torchrun", "--standalone", "--nproc-per-node", "4", "--no-python"]
    assert command[command.index("--max-tokens") + 1] == "256"  # 1,024 per update over 4 GPUs
    joined = " ".join(command)
    assert "--distributed-backend nccl" in joined and "--distributed-world-size 4" in joined
    assert "--cpu" not in command and "--user-dir" in command


def test_one_process_command_is_plain_fairseq_train(tmp_path):
    proc, command = dry(tmp_path, DEVICE_FLAGS="--cpu")
    assert proc.returncode == 0, proc.stderr
    assert command[0] == "fairseq-train" and command[command.index("--max-tokens") + 1] == "1024"
    assert not any(c.startswith("--distributed") or c == "--ddp-backend" for c in command)


def test_bad_process_counts_fail_with_one_clear_line(tmp_path):
    proc, _ = dry(tmp_path, NPROC="two")
    assert proc.returncode != 0 and proc.stderr.strip().endswith(
        "error: NPROC=two: expected a number of processes (1 or more)"
    )
    proc, _ = dry(tmp_path, NPROC="8")
    assert proc.returncode != 0 and "error: NPROC=8: torch sees 4 GPU(s)" in proc.stderr
