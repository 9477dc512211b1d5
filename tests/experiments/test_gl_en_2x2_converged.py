"""The 2x2 to convergence (examples/ted/gl-en-2x2-converged/run.sh, experiments/gl_en_2x2_converged.py)
at smoke size: the stopping rule on made-up curves; one run trained until the rule stops it, its
record and hypotheses; a rerun skips it; an unfinished run resumes from its checkpoint, and one
whose checkpoints are gone restarts from scratch with its earlier curve kept; checkpoints never go
where git would track them."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from sacrebleu.metrics import BLEU

from experiments.gl_en_2x2_converged import stop_reason
from experiments.machine import cpu_name, cpu_with_kernels

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "examples" / "ted" / "gl-en-2x2-converged" / "run.sh"
PINNED = f"{cpu_name()} (AVX2 kernels)"  # the recipe pins torch's AVX2 kernels on every machine


def curve(*bleus, step=100):
    return [[step * (i + 1), b, 5.0 - i * 0.1] for i, b in enumerate(bleus)]


def test_the_recorded_cpu_names_torchs_kernel_set():
    """One model name ("AMD EPYC") covers machines whose torch runs AVX2 or AVX512 kernels, which round
    differently: the name a record keeps must tell them apart. ATEN_CPU_CAPABILITY picks the set."""
    code = "from experiments.machine import cpu_with_kernels; print(cpu_with_kernels())"

    def name(**env):
        environ = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"} | env
        proc = subprocess.run([sys.executable, "-c", code], env=environ, cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    assert name(ATEN_CPU_CAPABILITY="default").endswith(" (DEFAULT kernels)")
    assert name() == cpu_with_kernels() and re.search(r" \((DEFAULT|AVX2|AVX512)\S* kernels\)$", name())


def test_stopping_rule_on_made_up_curves():
    assert stop_reason([], patience=3, max_update=10_000) is None
    # the best (10.0) is 2 validations old: patience 3 not yet used up
    assert stop_reason(curve(5, 10, 9, 9.5), patience=3, max_update=10_000) is None
    assert stop_reason(curve(5, 10, 9, 9.5, 8), patience=3, max_update=10_000) == "plateau"
    # a tie is not an improvement: the first best counts
    assert stop_reason(curve(5, 10, 10, 10, 10), patience=3, max_update=10_000) == "plateau"
    # a new best resets the count
    assert stop_reason(curve(5, 10, 9, 9, 11, 10), patience=3, max_update=10_000) is None
    assert stop_reason(curve(1, 2, 3), patience=3, max_update=300) == "cap"
    assert stop_reason(curve(1, 2, 3), patience=3, max_update=301) is None
    # both at once: the plateau is the reason
    assert stop_reason(curve(3, 2, 1), patience=2, max_update=300) == "plateau"


@pytest.fixture(scope="module")
def gl_en_data(toy_raw, tmp_path_factory):
    """The toy corpus under the gl-en recipe's file names."""
    d = tmp_path_factory.mktemp("gl_en_toy")
    for split in ("train", "dev", "test"):
        shutil.copy(toy_raw / f"{split}.src", d / f"{split}.gl")
        shutil.copy(toy_raw / f"{split}.tgt", d / f"{split}.en")
    return d


def campaign(work, records, data, **env):
    environ = dict(
        os.environ,
        PRESET="smoke",
        CELLS="layernorm.qknorm",
        PATIENCE="2",
        MAX_UPDATE="100",  # the smoke preset on the toy corpus: epochs of about 22 updates
        VALID_EPOCHS="1",
        WORK=str(work),
        RECORDS=str(records),
        DATA_DIR=str(data),
    )
    environ.update(env)
    proc = subprocess.run(["bash", str(RUN)], capture_output=True, text=True, env=environ, cwd=ROOT)
    assert proc.returncode == 0, f"campaign failed ({proc.returncode})\n{proc.stderr[-6000:]}"
    return proc


def entry_of(records):
    runs = json.loads((records / "runs.json").read_text())
    assert [(r["norm"], r["attention"], r["seed"]) for r in runs] == [("layernorm", "qknorm", 1)]
    return runs[0]


@pytest.fixture(scope="module")
def stopped(gl_en_data, tmp_path_factory):
    work, records = tmp_path_factory.mktemp("converged_work"), tmp_path_factory.mktemp("converged_records")
    campaign(work, records, gl_en_data)
    return work, records


def test_a_run_stops_by_the_rule_with_its_record(stopped, gl_en_data):
    work, records = stopped
    r = entry_of(records)
    dev = r["dev_curve"]
    assert r["stop_reason"] in ("plateau", "cap")
    assert stop_reason(dev, r["patience"], r["max_update"]) == r["stop_reason"]
    assert stop_reason(dev[:-1], r["patience"], r["max_update"]) is None  # it stopped at the first chance
    assert [u for u, _, _ in dev] == sorted({u for u, _, _ in dev}) and r["updates"] == dev[-1][0]
    assert all(loss is not None and 0 <= bleu <= 100 for _, bleu, loss in dev)
    best = max(range(len(dev)), key=lambda i: (dev[i][1], -i))
    assert r["best_updates"] == dev[best][0]
    assert "--arch transformer_qknorm_paper" in r["train_command"] and "--user-dir $USER_DIR" in r["train_command"]
    assert str(work) not in r["train_command"] and r["threads"] == 1 and r["commit"]
    assert r["cpus"] == [[0, PINNED]]  # what it trained on, from its first update
    assert r["g"] and all(isinstance(g, float) for g in r["g"].values())
    # The committed hypotheses rescore to the recorded BLEU (sacrebleu --tokenize none on test.en).
    hyp = (records / r["hyp"]).read_text().splitlines()
    ref = (gl_en_data / "test.en").read_text().splitlines()
    assert len(hyp) == len(ref) and "▁" not in "".join(hyp)
    assert round(BLEU(tokenize="none").corpus_score(hyp, [ref]).score, 2) == r["test_bleu"]
    assert r["last_test_bleu"] is not None and r["test_chrf"] is not None
    kept = sorted(os.listdir(work / "arms" / "qknorm-seed1" / "checkpoints"))
    assert "checkpoint_best_dev.pt" in kept and "checkpoint_last_scored.pt" in kept
    assert not [k for k in kept if k[len("checkpoint") : -len(".pt")].isdigit()]  # no unscored epoch checkpoints


def test_rerun_skips_a_stopped_run(stopped, gl_en_data):
    work, records = stopped
    before = (records / "runs.json").read_text()
    proc = campaign(work, records, gl_en_data)
    assert "0 runs not stopped yet" in proc.stderr
    assert (records / "runs.json").read_text() == before


def reopen(records, entry):
    entry["stop_reason"] = "running"
    (records / "runs.json").write_text(json.dumps([entry]))


def test_an_unfinished_run_resumes_from_its_checkpoint(stopped, gl_en_data):
    work, records = stopped
    r = entry_of(records)
    r["cpus"] = [[0, "an earlier CPU"]]  # as if it had trained on another machine until now
    reopen(records, r)
    proc = campaign(work, records, gl_en_data, PATIENCE="50", MAX_UPDATE=str(r["updates"] + 1))  # one validation more
    assert "fairseq-train resumes" in proc.stderr
    after = entry_of(records)
    assert after["dev_curve"][: len(r["dev_curve"])] == r["dev_curve"]  # the earlier points kept as they were
    assert len(after["dev_curve"]) > len(r["dev_curve"]) and after["stop_reason"] == "cap"
    # fairseq-train went on a little after the stopping validation, until the driver stopped it
    (resumed_at,) = after["resumed_at_updates"]
    assert resumed_at >= r["updates"] and after["lost_curves"] == []
    assert after["cpus"] == [[0, "an earlier CPU"], [resumed_at, PINNED]]
    train_log = (work / "arms" / "qknorm-seed1" / "train.log").read_text()
    assert f"@ {resumed_at} updates)" in train_log  # fairseq's "Loaded checkpoint ... (epoch E @ N updates)"


def test_checkpoints_never_go_where_git_would_track_them(gl_en_data, tmp_path):
    repo = tmp_path / "clone"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text("/work/\n")

    def run(arm_dir):
        cmd = [sys.executable, "-m", "experiments.gl_en_2x2_converged", "run", str(tmp_path / "records")]
        cmd += ["--arm-dir", str(arm_dir), "--norm", "layernorm", "--attention", "qknorm", "--seed", "1"]
        cmd += ["--data", str(gl_en_data), "--bin", "-", "--spm", "-", "--user-dir", "-", "--", "false"]
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)

    refused = run(repo / "arms" / "qknorm-seed1")
    assert refused.returncode != 0 and "git would track its checkpoints" in refused.stderr
    assert "Traceback" not in refused.stderr and not (repo / "arms").exists()
    for allowed in (repo / "work" / "arms" / "qknorm-seed1", tmp_path / "work" / "arms" / "qknorm-seed1"):
        proc = run(allowed)  # past the check: the stand-in for fairseq-train (`false`) fails
        assert "fairseq-train failed with exit status 1" in proc.stderr, proc.stderr[-2000:]


def test_the_report_reads_the_records(stopped, gl_en_data):
    from experiments.gl_en_2x2_converged_report import write_report
    from experiments.gl_en_2x2_records import write_runs

    work, records = stopped
    write_report(str(records), str(gl_en_data))
    text = (records / "README.md").read_text()
    assert (
        "1 of 4 runs stopped" in text
        and "ScaleNorm + dot seed 1: not started" in text
        and "$" not in text.replace("```sh", "")
    )  # every placeholder filled
    assert (records / "dev-curves.png").stat().st_size > 10_000
    # a record whose hypotheses no longer give its BLEU: no page
    runs = (records / "runs.json").read_text()
    r = entry_of(records)
    (records / "runs.json").write_text(json.dumps([dict(r, test_bleu=r["test_bleu"] + 0.01)]))
    try:
        with pytest.raises(SystemExit, match=f"{r['hyp']}: scores {r['test_bleu']:.2f} BLEU against test.en"):
            write_report(str(records), str(gl_en_data))
    finally:
        (records / "runs.json").write_text(runs)

    def page_of(*records_of_runs):
        """The report of these runs; the fixture's record is put back after."""
        write_runs(str(records), list(records_of_runs))
        try:
            write_report(str(records), str(gl_en_data))
            return (records / "README.md").read_text()
        finally:
            (records / "runs.json").write_text(runs)

    # a run started later but earlier in the 2x2 comes first, on the status line and in the table
    text = page_of(r, dict(r, norm="scalenorm", attention="dot", stop_reason="running", best_updates=None))
    stop = r["stop_reason"]
    assert text.index("ScaleNorm + dot seed 1: running") < text.index(f"LayerNorm + QKNorm seed 1: {stop}")
    assert text.index("| ScaleNorm + dot | 1 | running") < text.index(f"| LayerNorm + QKNorm | 1 | {stop}")
    # both runs of a norm stopped: the answer sends the reader on to the sections on seeds, and every
    # link within the page leads to one of its headings (GitHub's anchors: lower case, spaces to -)
    text = page_of(r, dict(r, attention="dot" if r["attention"] == "qknorm" else "qknorm"))
    anchors = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}
    links = set(re.findall(r"\]\(#([^)]+)\)", text))
    assert {"over-seeds", "how-many-seeds"} <= links <= anchors, (links, anchors)


def test_the_results_table_shows_stopped_runs_and_how_far_the_others_are(stopped):
    from experiments.results import format_converged

    _, records = stopped
    done = entry_of(records)
    running = dict(done, attention="dot", stop_reason="running", updates=60, dev_curve=curve(1.5, 2.25))
    rows = {line.split(" | ")[0]: line for line in format_converged([done, running]) if line.startswith("| ")}
    assert rows["| layernorm + qknorm"].startswith(
        f"| layernorm + qknorm | 1 | {done['test_bleu']:.2f} | {done['test_chrf']:.1f} | {done['updates']:,} ({done['stop_reason']}) |"
    )
    assert rows["| layernorm + dot"] == "| layernorm + dot | 0 | - | - | 60 (running) | 2.25 |"
    assert rows["| scalenorm + dot"] == "| scalenorm + dot | 0 | - | - | not started | - |"


def test_the_paired_bootstrap_of_a_difference():
    from experiments.corpus_scores import bleu_statistics
    from experiments.gl_en_2x2_converged_report import corpus_bleu, paired_bootstrap

    refs = ["the cat sat on the mat .", "a dog ran in the park", "it is raining today", "we like green tea"]
    hyps = ["the cat is on the mat .", "a dog runs in a park", "it rains today", "we like tea"]
    stats = bleu_statistics(hyps, refs)
    assert corpus_bleu(stats) == pytest.approx(BLEU(tokenize="none").corpus_score(hyps, [refs]).score)
    # a system against itself: no difference in any resample; against a worse one: a positive one
    same = paired_bootstrap({"a": stats, "b": stats}, lambda s: {"d": s["a"] - s["b"]})["d"]
    assert same == (0.0, 0.0, 0.0)
    worse = bleu_statistics(["the mat", "a park", "today", "tea"], refs)
    point, low, high = paired_bootstrap({"a": stats, "b": worse}, lambda s: {"d": s["a"] - s["b"]})["d"]
    assert point > 0 and low <= point <= high


def test_the_effects_stand_beside_the_same_effects_at_ten_epochs():
    from experiments.corpus_scores import bleu_statistics
    from experiments.gl_en_2x2_converged_report import effects_section
    from experiments.gl_en_2x2_records import CELLS

    refs = ["the cat sat on the mat .", "a dog ran in the park", "it is raining today", "we like green tea"]
    good, poor = ["the cat sat on the mat .", "a dog ran in a park", "it rains today", "we like tea"], ["the mat"] * 4
    runs = [dict(norm=n, attention=a, seed=1, stop_reason="plateau", test_bleu=0.0) for n, a in CELLS]
    # converged: only LayerNorm + QKNorm is good; at ten epochs only ScaleNorm + QKNorm
    stats = {(n, a, 1): bleu_statistics(good if (n, a) == ("layernorm", "qknorm") else poor, refs) for n, a in CELLS}
    ten = {(n, a, 1): bleu_statistics(good if (n, a) == ("scalenorm", "qknorm") else poor, refs) for n, a in CELLS}
    text = effects_section(runs, stats, ten)
    rows = {line.split(" | ")[0]: line.split(" | ") for line in text.splitlines() if line.startswith("| ")}
    converged, ten_epochs = rows["| converged"], rows["| ten epochs (1,400 updates)"]
    interaction = 4  # models, seed, QKNorm, LayerNorm, interaction
    assert converged[interaction].startswith("+") and ten_epochs[interaction].startswith("-")
    layernorm_row = rows["| LayerNorm"]
    assert layernorm_row[4].startswith("+") and layernorm_row[5].startswith("+0.00")


def test_a_run_whose_checkpoints_are_gone_restarts_with_its_curve_kept(stopped, gl_en_data):
    work, records = stopped
    r = entry_of(records)
    r.update(resumed_at_updates=[20, 40], commit="0000000")  # as if resumed twice, from older code
    reopen(records, r)
    shutil.rmtree(work / "arms" / "qknorm-seed1")
    proc = campaign(work, records, gl_en_data, MAX_UPDATE="20")  # capped at its first validation
    assert "restarting from scratch" in proc.stderr and "fairseq-train starts" in proc.stderr
    after = entry_of(records)
    # what described the lost curve goes with it: the record's fields describe the new curve
    lost = after["lost_curves"][-1]
    assert lost["dev_curve"] == r["dev_curve"] and lost["cpus"] == r["cpus"]
    assert lost["resumed_at_updates"] == [20, 40] and lost["commit"] == "0000000"
    assert after["cpus"] == [[0, PINNED]] and after["resumed_at_updates"] == [] and after["commit"] != "0000000"
    assert len(after["dev_curve"]) == 1 and after["stop_reason"] == "cap"


def test_how_it_ran_names_the_cpus_of_a_run_and_of_its_lost_curve():
    from experiments.gl_en_2x2_converged_report import how_it_ran

    lost = dict(dev_curve=curve(1.0, 2.0), cpus=[[0, "CPU A"]], note="checkpoints lost; restarted from scratch")
    run = dict(norm="scalenorm", attention="qknorm", seed=2, commit="abc1234", threads=1, dev_curve=curve(1.0, 2.5))
    run.update(resumed_at_updates=[100], lost_curves=[lost], cpus=[[0, "CPU B"], [100, "CPU C"]])
    run.update(train_command="fairseq-train $WORK/bin --seed 2")
    (line,) = [x for x in how_it_ran([run]).splitlines() if x.startswith("- ")]
    assert line.startswith("- ScaleNorm + QKNorm, seed 2: commit abc1234, 1 thread(s), on CPU B, then CPU C from 100")
    assert "1 of 2 validations measured twice agree exactly (largest difference 0.50), the earlier on CPU A" in line
    assert "from 100 updates, resumed at 100 updates;" in line
    run["resumed_at_updates"] = [100, 200, 1632]
    assert "resumed at 100, 200 and 1,632 updates;" in how_it_ran([run])
    run["train_command"] += " --update-epoch-batch-itr True"  # its resumes replay it
    assert "resumed at 100, 200 and 1,632 updates, with `--update-epoch-batch-itr True`;" in how_it_ran([run])
    # a record from before the CPU was recorded names none
    old = {k: v for k, v in run.items() if k != "cpus"}
    old["lost_curves"] = [{k: v for k, v in lost.items() if k != "cpus"}]
    assert "CPU" not in how_it_ran([old]).split("\n\n")[0]


def test_the_difference_summary_reads_early_and_late_validations():
    from experiments.gl_en_2x2_converged_report import difference_summary

    def run(attention, *bleus, step=700):
        return dict(norm="layernorm", attention=attention, seed=1, dev_curve=curve(*bleus, step=step))

    # up to 1,400 updates (two validations 700 apart): -1 and -2; the last four: -2, +1, +2, +3
    (line,) = difference_summary([run("dot", 5, 6, 7, 8, 9, 10), run("qknorm", 4, 4, 8, 10, 12)]).splitlines()
    assert line == (
        "- LayerNorm, seed 1: QKNorm - dot -1.50 dev BLEU on average up to 1,400 updates,"
        " +1.00 over the last 4 validations both runs have (1,400 to 3,500 updates)."
    )
    (line,) = difference_summary([run("dot", 5), run("qknorm", 3, 4)]).splitlines()
    assert line.endswith("-2.00 at the one validation both runs have (700 updates).")
    assert difference_summary([run("dot", 5)]) == "No norm has both of its runs validated yet."


REFS = ["the cat sat on the mat .", "a dog ran in the park", "it is raining today", "we like green tea"]
GOOD = ["the cat sat on the mat .", "a dog ran in a park", "it rains today", "we like tea"]
POOR = ["the mat", "a park", "today", "tea"]


def test_the_bootstrap_over_seeds_and_sentences():
    from experiments.corpus_scores import bleu_statistics
    from experiments.gl_en_2x2_converged_report import paired_bootstrap, seeds_and_sentences_bootstrap

    # forty sentences: the sentences' own chance small beside two seeds that disagree
    good, poor = bleu_statistics(GOOD * 10, REFS * 10), bleu_statistics(POOR * 10, REFS * 10)

    def diff(s):
        return {"d": s["qk"] - s["dot"]}

    # one seed per cell: the paired bootstrap over sentences, draw for draw
    one = seeds_and_sentences_bootstrap({"qk": [good], "dot": [poor]}, diff)["d"]
    assert one == paired_bootstrap({"qk": good, "dot": poor}, diff)["d"]
    # seeds that agree add nothing; seeds that disagree move the mean and widen the interval
    agree = seeds_and_sentences_bootstrap({"qk": [good, good], "dot": [poor, poor]}, diff)["d"]
    assert agree[0] == pytest.approx(one[0]) and agree[2] - agree[1] <= one[2] - one[1] + 1e-9
    disagree = seeds_and_sentences_bootstrap({"qk": [good, poor], "dot": [poor, poor]}, diff)["d"]
    assert disagree[0] == pytest.approx(one[0] / 2)
    assert disagree[1] <= 0.0 + 1e-9 and disagree[2] - disagree[1] > one[2] - one[1]  # a draw of two poor seeds


def made_up_runs(test_bleu):
    """Stopped runs of every cell, {(norm, attention, seed): test BLEU}."""
    return [
        dict(norm=n, attention=a, seed=s, stop_reason="plateau", test_bleu=b, test_chrf=b + 20.0)
        for (n, a, s), b in test_bleu.items()
    ]


def test_the_over_seeds_section_and_how_many_seeds(monkeypatch):
    import numpy as np

    from experiments import gl_en_2x2_converged_report as report
    from experiments.gl_en_2x2_records import CELLS

    bleu = {(n, a, s): 10.0 + s + (0.5 * s if a == "qknorm" else 0.0) for n, a in CELLS for s in (1, 2, 3)}
    del bleu["layernorm", "qknorm", 3]  # its third seed still trains
    runs = made_up_runs(bleu)
    # made-up sentence statistics whose "corpus BLEU" is their sum: ten sentences of a tenth each
    monkeypatch.setattr(report, "corpus_bleu", lambda s: float(s.sum()))
    stats = {k: np.full((10, 1), b / 10) for k, b in bleu.items()}
    text, spread = report.over_seeds_section(runs, stats).split("### How much seeds move the results")
    rows = {line.split(" | ")[0]: line.split(" | ") for line in text.splitlines() if line.startswith("| ")}
    # per cell: mean (SD) over the stopped seeds
    assert rows["| ScaleNorm + QKNorm"][1:4] == ["3", "13.00 (1.50)", "33.00 (1.50)"]
    assert rows["| LayerNorm + QKNorm"][1:3] == ["2", "12.25 (1.06)"]
    # QKNorm - dot per seed is 0.5 s: mean +1.00, t-interval over 3 seeds = 1 +- 4.303 * 0.5 / sqrt(3)
    scalenorm = rows["| QKNorm - dot under ScaleNorm"]
    assert scalenorm[1:3] == ["3", "+1.00"] and scalenorm[4] == "[-0.24, +2.24]"
    assert scalenorm[5] == "1: +0.50, 2: +1.00, 3: +1.50 |"
    # the bootstrap draws seeds (these sentences all weigh the same): within the seeds' own range
    low, high = (float(x) for x in scalenorm[3].strip("[]").split(", "))
    assert 0.5 <= low < 1.0 < high <= 1.5
    assert rows["| QKNorm - dot under LayerNorm"][1] == "2"  # only the seeds with both runs stopped
    assert rows["| QKNorm (2x2 effect)"][1] == "2"
    # the spread: SD of QKNorm - dot at convergence, and how many seeds now reads the converged runs
    assert "| ScaleNorm + QKNorm | 1.50 (3 seeds) |" in spread and "| LayerNorm + QKNorm | 1.06 (2 seeds) |" in spread
    assert "| QKNorm - dot under ScaleNorm | 0.50 (3 seeds) |" in spread
    how_many = report.seeds_section(runs)
    assert "taken from the converged runs (ScaleNorm: 3 seeds, LayerNorm: 2 seeds" in how_many
    pooled = ((2 * 0.5**2 + 1 * 0.125) / 3) ** 0.5  # ScaleNorm: SD 0.5 over 3 seeds; LayerNorm: 0.125 variance over 2
    assert (
        f"standard deviation {pooled:.2f} test BLEU" in how_many
        and f"| 3 | {4.303 * pooled / 3**0.5:.2f} BLEU |" in how_many
    )
    one_seed = made_up_runs({k: v for k, v in bleu.items() if k[2] == 1})
    assert "taken from the ten-epoch 2x2, as no norm has two converged seeds yet" in report.seeds_section(one_seed)
