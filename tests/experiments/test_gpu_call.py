"""The one GPU command (benchmarks/gpu_call.sh), dry-run at tiny sizes on the CPU (on a GPU where
there is one): every part of its plan measured, every arm beside stock, ratios with their spread,
the attention kernels and a profile, packed into OUT's few files; with the measuring process killed
once after its first part, which the call survives by starting it again on the parts left. Then, in
one process, what a part does when an arm raises (out of memory), when stock raises, when the time
runs out, and after a crash."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_call.sh"
FAULTS = ROOT / "tests" / "experiments" / "fault_injection"


@pytest.fixture(scope="module")
def lengths(toy_raw):
    return f"{toy_raw / 'train.src'},{toy_raw / 'train.tgt'}"


@pytest.fixture(scope="module")
def dry_run(lengths, tmp_path_factory):
    out, work = tmp_path_factory.mktemp("out"), tmp_path_factory.mktemp("work")
    env = dict(
        os.environ,
        VENV=sys.prefix,
        SMOKE="1",
        OUT=str(out),
        WORK=str(work),
        LENGTHS_FROM=lengths,
        OMP_NUM_THREADS="1",
        # every QK-norm arm "below target": the first part is profiled, whatever the noise
        GPU_CALL_FLAGS="--profile-below 10 --profiles 1",
        # the measuring process killed right after its third write of the results: the first part's
        PYTHONPATH=str(FAULTS),
        KILL_AFTER_WRITE="gpu-table.json:3",
        KILL_MARK=str(work / "killed"),
    )
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"gpu_call.sh failed ({proc.returncode})\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return out, proc, json.loads((out / "gpu-table.json").read_text())


def test_every_part_is_measured_and_packed_after_a_crash(dry_run):
    from benchmarks.gpu_call import ARMS, GENERATE_ONLY, PLAN

    out, proc, result = dry_run
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all(re.fullmatch(r"[A-Za-z0-9._-]+", f) and (out / f).is_file() for f in files)
    assert {"gpu-call.log", "gpu-table.json", "gpu-table.md", "gpu-profile.txt"} <= set(files)
    assert proc.stderr.strip().splitlines()[-1].endswith(f"{len(PLAN)} of {len(PLAN)} parts measured")
    log = (out / "gpu-call.log").read_text()
    assert "measuring: exit 137 (killed)" in log and "measuring: started again on the parts left" in log
    assert len(result["meta"]["resumed"]) == 1  # the first part kept, the rest measured by the second process
    assert [p["name"] for p in result["parts"]] == PLAN == result["meta"]["plan"]
    for part in result["parts"]:
        arms = [*ARMS, *GENERATE_ONLY] if part["benchmark"] == "generate" else list(ARMS)
        assert part["status"] == "measured" and part["rounds"] == 2, part["name"]
        assert list(part["arms"]) == arms and not any(a["error"] for a in part["arms"].values())
        assert [s["label"] for s in part["settings"]] == (
            ["4 sentences", "8 sentences"] if part["benchmark"] == "generate" else ["64 tokens", "128 tokens"]
        )
        for setting in part["settings"]:
            assert list(setting["arms"]) == arms
            for arm, row in setting["arms"].items():
                assert len(row["speed"]) == 2 and all(v > 0 for v in row["speed"])
                assert (
                    row["ratio"]["pairs"] == 2 and row["ratio"]["low"] <= row["ratio"]["median"] <= row["ratio"]["high"]
                )
                assert row["ratio"]["median"] == 1.0 or arm != "stock"
                assert (row["peak_bytes"] is not None) == torch.cuda.is_available()
        # every translation arm trains through SDPA in its self attention; the kernels are named
        attention = part["arms"]["stock"]["attention"]
        assert attention and all(isinstance(n, int) and n > 0 for n in attention.values()), part["name"]
    machine = result["meta"]["machine"]
    assert {"device", "driver", "torch", "cuda", "cudnn", "commit", "plugin_sha1"} <= set(machine)
    assert machine["torch"] == torch.__version__


def test_the_table_and_the_profile(dry_run):
    out, _, result = dry_run
    table = (out / "gpu-table.md").read_text()
    assert "## Training" in table and "## Beam search" in table
    assert "`SMOKE=1 GPU_CALL_FLAGS=" in table and "TIME_LIMIT=540 bash benchmarks/gpu_call.sh`" in table
    for part in result["parts"]:
        assert f"| {part['model']} | {part['dtype']} | {part['settings'][0]['label']} | qknorm |" in table
    rows = sum(len(s["arms"]) - 2 for p in result["parts"] for s in p["settings"])  # stock, stock_control
    rows -= sum(len(p["settings"]) for p in result["parts"] if p["benchmark"] == "generate")  # stock_beamable
    assert re.search(rf"Targets: \d+ of {rows} arm rows meet both\.", table)
    # one profile (--profiles 1), of the first part: stock and its slowest QK-norm arm
    (first,) = [p for p in result["parts"] if p.get("profile")]
    assert result["profiles"] == [first["name"]] == [result["meta"]["plan"][0]]
    profile = (out / "gpu-profile.txt").read_text()
    assert profile.count("\n## ") + profile.startswith("## ") == 1
    assert "### stock\n" in profile and f"### {first['profile']['arm']}\n" in profile and "Self CPU" in profile


def run_call(tmp_path, lengths, *flags):
    from benchmarks import gpu_call

    out = tmp_path / "out"
    gpu_call.main(["--out", str(out), "--lengths-from", lengths, "--smoke", "--profiles", "0", *flags])
    return out, json.loads((out / "gpu-table.json").read_text())


def build_arms_with(monkeypatch, change):
    """Every part of the call builds each arm through change(benchmark, dtype, arm, build), build
    being the part's own (benchmarks.gpu_bench.build_part, patched on MONKEYPATCH)."""
    from benchmarks import gpu_bench

    real = gpu_bench.build_part

    def build_part(benchmark, model, dtype, *args, **kwargs):
        part = real(benchmark, model, dtype, *args, **kwargs)
        build = part.build
        part.build = lambda arm: change(benchmark, dtype, arm, build)
        return part

    monkeypatch.setattr(gpu_bench, "build_part", build_part)


def test_a_failing_arm_or_stock_stays_in_its_part(lengths, tmp_path, monkeypatch):
    def failing(benchmark, dtype, arm, build):
        if (dtype, arm) == ("fp16", "stock") or (benchmark, arm) == ("generate", "qknorm_layernorm_none"):
            raise ValueError("injected")
        runner = build(arm)
        if arm == "qknorm_rmsnorm_none":  # out of memory on its third unit, in the untimed round
            calls, run = [], runner.run

            def run_out_of_memory(setting, unit):
                calls.append(unit)
                if len(calls) == 3:
                    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
                return run(setting, unit)

            runner.run = run_out_of_memory
        return runner

    build_arms_with(monkeypatch, failing)
    out, result = run_call(tmp_path, lengths, "--parts", "train-glen-fp16", "train-glen-bf16", "generate-glen-bf16")
    fp16, bf16, generate = result["parts"]
    assert fp16["status"] == "failed" and fp16["note"] == "stock failed: no ratios"
    assert fp16["arms"]["stock"]["error"] == "ValueError: injected"
    for part, failed, error in (
        (bf16, "qknorm_rmsnorm_none", "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
        (generate, "qknorm_layernorm_none", "ValueError: injected"),
    ):
        assert part["status"] == "measured" and part["arms"][failed]["error"] == error
        for setting in part["settings"]:
            assert failed not in setting["arms"] and {"stock", "stock_control", "qknorm"} <= set(setting["arms"])
            assert all(len(row["speed"]) == 2 for row in setting["arms"].values())
    table = (out / "gpu-table.md").read_text()
    assert "- train-glen-fp16: failed: stock failed: no ratios" in table
    assert "- train-glen-bf16, qknorm_rmsnorm_none: failed: OutOfMemoryError: CUDA out of memory" in table


def test_a_part_out_of_time_is_cut_off_and_a_crashed_one_failed_on_resume(lengths, tmp_path, monkeypatch):
    from benchmarks import gpu_call, gpu_report

    monkeypatch.setattr(gpu_call, "MIN_PART_SECONDS", 0.5)

    def slow(benchmark, dtype, arm, build):  # every unit takes half a second: a part cannot fit in one
        runner = build(arm)
        run = runner.run

        def slow_run(setting, unit):
            time.sleep(0.5)
            return run(setting, unit)

        runner.run = slow_run
        return runner

    with monkeypatch.context() as slowed:
        build_arms_with(slowed, slow)
        # a second: the first part starts and is cut off, no time is left for the second
        out, result = run_call(tmp_path, lengths, "--parts", "train-glen-fp16", "train-lm-bf16", "--seconds", "1")
    first, second = result["parts"]
    assert first["status"] == "cut off" and first["note"] == "its time ran out in the untimed round"
    assert second["status"] == "not run"
    # as if the process had died during the first part: --resume records it as failed, measures the rest
    result["parts"] = [dict(first, status="running")]
    (out / "gpu-table.json").write_text(json.dumps(result))
    _, resumed = run_call(tmp_path, lengths, "--parts", "train-glen-fp16", "train-lm-bf16", "--resume")
    first, second = resumed["parts"]
    assert first["status"] == "failed" and first["note"].startswith("the measuring process ended during this part")
    assert second["status"] == "measured" and second["model"] == "lm" and len(resumed["meta"]["resumed"]) == 1
    # the end of a call whose process was stopped: its running part cut off, the parts never reached not run
    resumed["parts"] = [dict(first, status="running")]
    (out / "gpu-table.json").write_text(json.dumps(resumed))
    with pytest.raises(SystemExit) as end:
        gpu_report.main([str(out / "gpu-table.json"), "--finish"])
    assert end.value.code == 1
    finished = json.loads((out / "gpu-table.json").read_text())
    assert [(p["name"], p["status"]) for p in finished["parts"]] == [
        ("train-glen-fp16", "cut off"),
        ("train-lm-bf16", "not run"),
    ]


def test_bad_input_fails_with_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_call", "--out", str(tmp_path), "--lengths-from", "a,b"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "error: --lengths-from: cannot read a: No such file or directory"
    ]
    proc = subprocess.run(
        ["bash", str(SCRIPT)],
        env=dict(os.environ, VENV=sys.prefix, TIME_LIMIT="soon", OUT=str(tmp_path)),
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert (
        proc.returncode == 1
        and proc.stderr.strip().splitlines()[-1]
        == "error: TIME_LIMIT=soon: expected a positive whole number of seconds"
    )
