"""The GPU call (examples/ted/gl-en-2x2-gpu/run.sh) rehearsed on the CPU the way a GPU machine
without network runs it: a fresh environment holding the GPU image's packages, as CPU builds
(examples/ted/gl-en-2x2-gpu/rehearsal-requirements.txt), tensorboard among them, but neither fairseq
nor this project, so that the call installs both from the wheels of scripts/gpu_wheels.sh; `python3`
alone on PATH; a copy of the working tree as the call carries it, with .gpu-data prepared
beforehand, whose data steps the call must skip; three seeds at the smoke preset under a time limit
that decides the budget; the fp16 sweep beside the runs, one tiny run per arm and seed; and two
injected failures (tests/experiments/fault_injection): the benchmark exits 1 without writing its
JSON, and one run is killed at its first checkpoint. The call must still train,
record and pack every other run, run the checks after the runs, and end within its time limit.

It installs from the package index and trains 24 small runs on the CPU, so it runs only when asked:

    GPU_REHEARSAL=1 .venv/bin/python -m pytest -q tests/experiments/test_gpu_rehearsal.py

Settings (environment): REHEARSAL_DIR (default work/rehearsal: the downloaded packages and the
wheels, kept for the next time, and the last rehearsal's folders), REHEARSAL_PYTHON (default python3.11), TIME_LIMIT (default 540, the
call's), CHECK_SECONDS (the call's default), PRECISION (default bf16), REHEARSAL_RECORD=1 (write the call's log, budget and summary,
with this machine's folders replaced by names, to examples/ted/gl-en-2x2-gpu/rehearsal/).
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from experiments.gl_en_2x2_records import CELLS

pytestmark = pytest.mark.skipif(os.environ.get("GPU_REHEARSAL") != "1", reason="slow: GPU_REHEARSAL=1 runs it")

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "examples" / "ted" / "gl-en-2x2-gpu"
TIME_LIMIT = int(os.environ.get("TIME_LIMIT", "540"))
PRECISION = os.environ.get("PRECISION", "bf16")
SEEDS = (1, 2, 3)
KILLED = ("layernorm", "qknorm", 2)


def run(cmd, **kwargs):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode})\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def environment(cache, dest):
    """A fresh environment in dest with the GPU image's packages, built for the CPU (downloaded
    into cache once, while the requirements do not change)."""
    requirements = HERE / "rehearsal-requirements.txt"
    python = os.environ.get("REHEARSAL_PYTHON", "python3.11")
    wheelhouse, stamp = cache / "wheelhouse", cache / "wheelhouse" / ".requirements.sha1"
    want = hashlib.sha1(requirements.read_bytes()).hexdigest()
    if not stamp.is_file() or stamp.read_text() != want:
        shutil.rmtree(wheelhouse, ignore_errors=True)
        run(
            [python, "-m", "pip", "download", "-q", "--disable-pip-version-check", "-d", wheelhouse, "-r", requirements]
        )
        stamp.write_text(want)
    run([python, "-m", "venv", dest])
    pip = [dest / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index"]
    run([*pip, "--find-links", wheelhouse, "-r", requirements])
    return dest / "bin" / "python3"


def working_tree(dest):
    """What the call carries: the tracked files and the untracked ones that git does not ignore."""
    listed = run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT).stdout.split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)


@pytest.fixture(scope="module")
def rehearsal():
    cache = Path(os.environ.get("REHEARSAL_DIR", ROOT / "work" / "rehearsal")).resolve()
    tmp = cache / "last"  # kept until the next rehearsal, to be read when it fails
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    python = environment(cache, tmp / "env")
    found = run(
        [python, "-c", "import importlib.util as u; print(u.find_spec('fairseq'), u.find_spec('fairseq_qknorm'))"],
        cwd=tmp,
        env={"PATH": os.environ["PATH"]},
    )
    assert found.stdout.split() == ["None", "None"], (
        "the rehearsal's environment must hold neither fairseq nor this project"
    )
    tree = tmp / "tree"
    working_tree(tree)
    # Here, before the call: the wheels for the rehearsal's Python, and the data prepared with the
    # project's own environment (README.md beside run.sh).
    version = run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"]).stdout.strip()
    wheels = cache / f"whl-{version}"
    run(
        ["bash", tree / "scripts" / "gpu_wheels.sh"],
        env=dict(os.environ, WHEELS=wheels, PY_VERSION=version, PYTHON=sys.executable),
    )
    shutil.copytree(wheels, tree / ".whl")
    from fairseq_qknorm_cli.toy_corpus import write_corpus

    corpus = tmp / "corpus"
    write_corpus(corpus, train=400, dev=12, test=12, seed=5)
    for split in ("train", "dev", "test"):
        (corpus / f"{split}.src").rename(corpus / f"{split}.gl")
        (corpus / f"{split}.tgt").rename(corpus / f"{split}.en")
    work = tree / ".gpu-data"
    run(
        ["bash", tree / "examples" / "ted" / "gl-en-2x2-gpu" / "run.sh", "prepare"],
        env=dict(os.environ, VENV=sys.prefix, SMOKE="1", DATA_DIR=corpus, WORK=work),
        cwd=tree,
    )
    # There: python3 alone on PATH, the rehearsal's environment behind it.
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{python}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    out = tmp / "out"
    env = {
        "PATH": f"{bin_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": os.environ["HOME"],
        "LANG": "C.UTF-8",
        **{
            k: os.environ[k]
            for k in ("TMPDIR", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "CHECK_SECONDS")
            if k in os.environ
        },
        "VENV": str(tmp / "no-venv"),  # the project's environment is not there
        "OUT": str(out),
        "WORK": str(work),
        "SMOKE": "1",
        "SEEDS": " ".join(map(str, SEEDS)),
        "MAX_EPOCHS": "",  # the time limit decides
        "TIME_LIMIT": str(TIME_LIMIT),
        "PRECISION": PRECISION,
        # The fp16 sweep beside the runs, as on CUDA, but one tiny run per process: fp16 on a CPU is slow.
        "FP16_SWEEP": "1",
        "FP16_SWEEP_FLAGS": "--lrs 0.3 --updates 4 --warmup-updates 2 --stats-interval 2",
        "PYTHONPATH": str(tree / "tests" / "experiments" / "fault_injection"),
        "FAIL_MODULE": "benchmarks.run",
        "FAIRSEQ_KILL_DURING": "save:1",
        "FAIRSEQ_KILL_ONLY": "arms/{}-{}-seed{}/".format(*KILLED),
    }
    start = time.time()
    proc = subprocess.run(
        ["bash", "examples/ted/gl-en-2x2-gpu/run.sh"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIME_LIMIT + 300,
    )
    seconds = time.time() - start
    (tmp / "call.stderr").write_text(proc.stderr)
    if os.environ.get("REHEARSAL_RECORD") == "1":
        record(out, {str(tree): "$TREE", str(tmp / "env"): "$ENV", str(tmp): "$TMP"}, seconds, proc)
    assert (out / "gl-en-2x2-gpu.tar.gz").is_file(), f"nothing packed ({proc.returncode})\n{proc.stderr[-3000:]}"
    unpacked = tmp / "unpacked"
    with tarfile.open(out / "gl-en-2x2-gpu.tar.gz") as tar:
        tar.extractall(unpacked, filter="data")
    log = (out / "run.log").read_text()
    return dict(proc=proc, seconds=seconds, out=out, unpacked=unpacked, log=log, python=python)


def record(out, names, seconds, proc):
    """The call's output, with this machine's folders as names, for the repository."""
    dest = HERE / "rehearsal"
    dest.mkdir(exist_ok=True)

    def named(text):
        for path, placeholder in sorted(names.items(), key=lambda kv: -len(kv[0])):
            text = text.replace(path, placeholder)
        return text

    for name in ("run.log", "budget.json", "summary.md", "benchmark.log", "mixed-precision.log"):
        if (out / name).is_file():
            (dest / name).write_text(named((out / name).read_text()))
    (dest / "call.txt").write_text(
        f"exit status {proc.returncode} after {seconds:.0f} s (TIME_LIMIT={TIME_LIMIT}, PRECISION={PRECISION})\n"
        f"last line: {named((proc.stderr.strip().splitlines() or [''])[-1])}\n"
    )


def test_the_call_ends_within_its_time_limit_and_says_what_failed(rehearsal):
    proc = rehearsal["proc"]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert (
        proc.stderr.strip().splitlines()[-1]
        == "error: 1 run(s) failed, checks failed: 1 (logs above and in " + str(rehearsal["out"]) + ")"
    )
    assert rehearsal["seconds"] <= TIME_LIMIT + 5


def test_python3_alone_and_fairseq_installed_from_the_wheels(rehearsal):
    log = rehearsal["log"]
    assert f"python: {rehearsal['python'].resolve()}" in log or f"python: {rehearsal['python']}" in log
    assert "install: done, fairseq 0.12.3" in log
    # fairseq's progress bar found tensorboard (the GPU image has it) and imported it
    found = run(
        [rehearsal["python"], "-c", "import fairseq.logging.progress_bar as p; print(p.SummaryWriter is not None)"]
    )
    assert found.stdout.strip() == "True"


def test_the_carried_data_steps_are_skipped(rehearsal):
    for step in ("data", "spm", "encode", "binarize"):
        assert f"{step}: done before, skipped" in rehearsal["log"]


def test_every_run_but_the_killed_one_is_recorded_and_packed(rehearsal):
    records, logs = rehearsal["unpacked"] / "records", rehearsal["unpacked"] / "logs"
    runs = json.loads((records / "runs.json").read_text())
    expected = {(n, a, s) for s in SEEDS for n, a in CELLS} - {KILLED}
    assert {(r["norm"], r["attention"], r["seed"]) for r in runs} == expected
    assert f"runs: {len(expected)} of {len(expected) + 1} recorded" in rehearsal["log"]
    killed = "{}-{}-seed{}".format(*KILLED)
    assert (logs / f"{killed}.train.log").is_file() and not (logs / f"{killed}.generate.log").exists()
    for r in runs:
        assert (records / r["hyp"]).is_file()
        assert (logs / "{norm}-{attention}-seed{seed}.generate.log".format(**r)).is_file()


def test_the_budget_comes_from_the_probe_and_the_time_limit(rehearsal):
    budget = json.loads((rehearsal["out"] / "budget.json").read_text())
    runs = json.loads((rehearsal["unpacked"] / "records" / "runs.json").read_text())
    assert budget["runs_side_by_side"] == 12 and budget["end_reserve_seconds"] >= budget["end_seconds"] > 0
    for r in runs:
        assert f"--max-epoch {budget['epochs']} " in r["train_command"] + " "
        assert f"--{PRECISION}" in r["train_command"]
        # fp16 may skip updates (an overflow); the epochs are the budget's all the same
        assert r["updates"] == budget["updates"] if PRECISION == "bf16" else r["updates"] <= budget["updates"]
        assert len(r["dev"]) == budget["dev_points"]


def test_the_checks_come_after_the_runs_and_the_failed_benchmark_is_logged(rehearsal):
    log, out = rehearsal["log"], rehearsal["out"]
    assert log.index(" recorded in ") < log.index("checks: the mixed-precision tests")
    assert "checks: benchmark exit 1: error: benchmarks.run: failure injected" in log
    assert "checks: mixed-precision tests exit 0" in log
    assert not list(out.glob("benchmark-*.json"))


def test_the_fp16_sweep_ran_beside_and_came_back(rehearsal):
    with tarfile.open(rehearsal["out"] / "fp16-sweep.tar.gz") as tar:
        tar.extractall(rehearsal["unpacked"], filter="data")
    sweep = rehearsal["unpacked"] / "fp16-sweep"
    for arm in ("stock", "qknorm", "qk_layernorm"):
        for seed in (1, 2):
            runs = json.loads((sweep / f"{arm}-seed{seed}" / "results.json").read_text())["runs"]
            assert [(r["arm"], r["lr"], r["seed"], r["outcome"]) for r in runs] == [(arm, 0.3, seed, "finished")]
    assert not (sweep / "data").exists()  # the generated corpus stays there
    assert "fp16 sweep: packed into" in rehearsal["log"]
