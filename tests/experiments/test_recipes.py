"""The recipe end to end at smoke size on the generated corpus: data from DATA_DIR, sentencepiece,
fairseq-preprocess, both arms through fairseq-train / fairseq-generate, scoring with significance,
the per-run results and the gathered table; then a rerun skips finished steps and redoes a step
whose stamp is gone (a step killed half-way)."""

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "examples" / "ted" / "run.sh"


def recipe(args, work, data_dir, **env):
    environ = dict(
        os.environ,
        PRESET="smoke",
        MAX_UPDATE="8",
        WORK=str(work),
        DATA_DIR=str(data_dir),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"),
    )
    environ.update(env)
    return subprocess.run(["bash", *map(str, args)], capture_output=True, text=True, env=environ, cwd=ROOT)


def check(proc):
    assert proc.returncode == 0, (
        f"recipe failed ({proc.returncode})\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    )
    return proc


@pytest.fixture(scope="module")
def smoke_run(toy_raw, tmp_path_factory):
    work = tmp_path_factory.mktemp("recipe_work")
    proc = check(recipe([RUN, "toy"], work, toy_raw))
    return work, proc


def test_both_arms_are_trained_translated_and_scored(smoke_run, toy_raw):
    work, proc = smoke_run
    n_test = len((toy_raw / "test.tgt").read_text().splitlines())
    result = json.loads((work / "main" / "results.json").read_text())
    assert result["arms"] == ["baseline", "qknorm"] and list(result["seeds"]) == ["1"]
    base, qk = result["seeds"]["1"]["baseline"], result["seeds"]["1"]["qknorm"]
    for arm, entry in (("baseline", base), ("qknorm", qk)):
        hyps = (work / "arms" / f"{arm}-seed1" / "test.hyp").read_text().splitlines()
        assert len(hyps) == n_test  # every test sentence translated, none dropped by batching
        assert entry["updates"] == 8 and entry["params"] > 0 and entry["train_seconds"] is not None
        assert 0 <= entry["bleu"] <= 100 and 0 <= entry["chrf"] <= 100
        assert f"--arch transformer_{'scalenorm' if arm == 'baseline' else 'qknorm'}_paper " in entry["train_command"]
        assert "--user-dir" in entry["train_command"] and "--required-batch-size-multiple 1" in entry["train_command"]
    assert base["p_value"] is None and 0 <= qk["p_value"] <= 1  # significance of QKNorm against the baseline
    assert "tok:none" in result["signatures"]["bleu (paper-comparable)"] and "tok:13a" in result["signatures"]["bleu"]
    # The sentencepiece-decoded hypotheses are plain text, like the references.
    assert "▁" not in (work / "arms" / "qknorm-seed1" / "test.hyp").read_text()
    markdown = (work / "main" / "results.md").read_text()
    assert "| 1 | qknorm |" in markdown and "fairseq-generate" in markdown
    assert markdown in proc.stdout  # run.sh ends by printing the table


def test_gathered_table_lists_the_pair(smoke_run):
    work, _ = smoke_run
    proc = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "python"), "-m", "experiments.results", "table", str(work)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| toy |"))
    result = json.loads((work / "main" / "results.json").read_text())
    assert f"{result['mean']['qknorm']['bleu']:.2f}" in row and "| smoke |" in row


def test_rerun_skips_finished_steps_and_redoes_an_unfinished_one(smoke_run, toy_raw):
    work, _ = smoke_run
    hyp = work / "arms" / "qknorm-seed1" / "test.hyp"
    before = hyp.read_text()
    # A generation killed half-way: no stamp, a truncated output.
    (work / "stamps" / "qknorm.seed1.generate").unlink()
    hyp.write_text(before.splitlines()[0] + "\n")
    proc = check(recipe([RUN, "toy"], work, toy_raw))
    for name in (
        "data",
        "spm",
        "encode",
        "binarize",
        "baseline.seed1.train",
        "qknorm.seed1.train",
        "baseline.seed1.generate",
    ):
        assert f"{name}: done before, skipped" in proc.stderr
    assert "qknorm.seed1.generate: running" in proc.stderr
    assert hyp.read_text() == before
    # The same translation again: the scores, keyed by the translations' content, stay valid.
    assert "main.seed1.score: done before, skipped" in proc.stderr


def test_bad_settings_fail_with_one_clear_line(tmp_path, toy_raw):
    proc = recipe([RUN, "xx-en"], tmp_path, toy_raw)
    assert proc.returncode != 0 and "error: unknown pair 'xx-en'" in proc.stderr
    proc = recipe([RUN, "toy"], tmp_path, toy_raw, PRESET="huge")
    assert proc.returncode != 0 and "error: unknown PRESET 'huge'" in proc.stderr
    proc = recipe([RUN, "gl-en"], tmp_path, toy_raw)  # toy_raw has src/tgt files, not gl/en
    assert proc.returncode != 0 and "missing or empty train.gl" in proc.stderr
    proc = recipe([ROOT / "examples" / "ted" / "ablation.sh", "no-such", "toy"], tmp_path, toy_raw)
    assert proc.returncode != 0 and "error: unknown ablation 'no-such'" in proc.stderr


def test_two_runs_on_one_work_do_a_step_once(tmp_path):
    """Two recipe runs sharing WORK (one per arm, say): the second waits for a step the first is
    doing, then skips it, instead of running it into the same files at the same time."""
    script = (
        'source examples/common.sh; set_pair toy; set_preset smoke; mkdir -p "$WORK/stamps"; '
        'slow() { echo start >> "$WORK/calls"; sleep 2; echo end >> "$WORK/calls"; }; step demo - slow'
    )
    env = dict(os.environ, WORK=str(tmp_path))
    runs = [
        subprocess.Popen(["bash", "-c", script], stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT) for _ in range(2)
    ]
    logs = [p.communicate()[1] for p in runs]
    assert [p.returncode for p in runs] == [0, 0], logs
    assert (tmp_path / "calls").read_text() == "start\nend\n"
    assert sum("demo: done before, skipped" in log for log in logs) == 1
    assert sum("another run of this WORK is doing it, waiting" in log for log in logs) == 1
