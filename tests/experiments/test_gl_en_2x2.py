"""The gl-en 2x2's records (experiments/gl_en_2x2_records.py), campaign (gl_en_2x2.py) and report
(gl_en_2x2_report.py) on made-up records: which runs are pending, the effects' algebra, and that
the pooled bootstrap scores what sacrebleu scores on the concatenated test sets."""

import json
import random

import pytest
from sacrebleu.metrics import BLEU, CHRF

from experiments import gl_en_2x2, gl_en_2x2_records
from experiments.gl_en_2x2_report import effects, over_seeds, pooled_bootstrap, sentence_statistics, write_report

CELLS = gl_en_2x2_records.CELLS


def test_effects_are_the_2x2_contrasts():
    score = {
        ("scalenorm", "dot"): 10.0,
        ("scalenorm", "qknorm"): 12.0,
        ("layernorm", "dot"): 11.0,
        ("layernorm", "qknorm"): 16.0,
    }
    e = effects(score)
    assert e["QKNorm"] == pytest.approx(((12 - 10) + (16 - 11)) / 2)
    assert e["LayerNorm"] == pytest.approx(((11 - 10) + (16 - 12)) / 2)
    assert e["interaction"] == pytest.approx((16 - 11) - (12 - 10))


def make_records(tmp_path, seeds=(1, 2)):
    """A reference of 60 sentences and, per run, hypotheses that keep a cell-dependent share of its
    words (the paper's system best); runs.json with the fields the report reads."""
    rng = random.Random(0)
    words = [f"w{i}" for i in range(40)]
    ref = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 12))) for _ in range(60)]
    data = tmp_path / "data"
    data.mkdir()
    (data / "test.en").write_text("\n".join(ref) + "\n")
    records = tmp_path / "records"
    records.mkdir()
    keep = {
        ("scalenorm", "dot"): 0.5,
        ("scalenorm", "qknorm"): 0.6,
        ("layernorm", "dot"): 0.55,
        ("layernorm", "qknorm"): 0.8,
    }
    runs = []
    for seed in seeds:
        for cell in CELLS:
            r = random.Random(f"{cell}{seed}")
            hyp = [" ".join(w if r.random() < keep[cell] else "x" for w in line.split()) for line in ref]
            name = gl_en_2x2_records.hyp_name(*cell, seed)
            (records / name).write_text("\n".join(hyp) + "\n")
            bleu = BLEU(tokenize="none", force=True).corpus_score(hyp, [ref]).score
            runs.append(
                {
                    "norm": cell[0],
                    "attention": cell[1],
                    "seed": seed,
                    "updates": 100,
                    "test_bleu": bleu,
                    "test_chrf": 50.0 + 10 * keep[cell] + seed,
                    "best_dev_bleu": bleu,
                    "hyp": name,
                    "dev": [[50, 7.0, 1.0], [100, 6.5, bleu]],
                    "scored_dev": [100, 6.5, bleu],
                    "train_loss": [[20, 9.0], [40, 8.0], [100, 7.0]],
                    "g": {"encoder.layers.0.self_attn": 12.5} if cell[1] == "qknorm" else {},
                    "L": 79,
                    "g0": 12.59,
                    "train_seconds": 60,
                    "train_command": f"fairseq-train $WORK/bin --seed {seed}",
                    "data_sha1": {"test.en": gl_en_2x2_records.sha1(data / "test.en")},
                }
            )
    gl_en_2x2_records.write_runs(str(records), runs)
    return records, data, ref, runs


def test_pending_lists_the_runs_without_a_record(tmp_path):
    records, _, _, _ = make_records(tmp_path, seeds=(1,))
    runs = gl_en_2x2_records.read_runs(str(records))
    gl_en_2x2_records.write_runs(str(records), [r for r in runs if r["attention"] == "dot"])
    assert gl_en_2x2.pending(str(records), [1, 2]) == [
        ("scalenorm", "qknorm", 1),
        ("layernorm", "qknorm", 1),
        *[(*cell, 2) for cell in CELLS],
    ]


@pytest.mark.parametrize("metric", ["bleu", "chrf"])
def test_pooled_bootstrap_scores_the_concatenated_test_sets(tmp_path, metric):
    records, _, ref, runs = make_records(tmp_path)
    boot = pooled_bootstrap(sentence_statistics(str(records), ref, runs, [1, 2], metric), metric)
    sacrebleu_metric = BLEU(tokenize="none", force=True) if metric == "bleu" else CHRF()
    pooled = {}
    for cell in CELLS:
        hyps = [
            line
            for seed in (1, 2)
            for line in (records / gl_en_2x2_records.hyp_name(*cell, seed)).read_text().splitlines()
        ]
        pooled[cell] = sacrebleu_metric.corpus_score(hyps, [ref + ref]).score
    for name, value in effects(pooled).items():
        point, low, high = boot[name]
        assert point == pytest.approx(value)
        assert low < point < high
    assert boot["QKNorm"][1] > 0  # the made-up QKNorm cells keep clearly more of the reference


def test_over_seeds_interval_uses_the_t_quantile(tmp_path):
    _, _, _, runs = make_records(tmp_path)
    mean, half, values = over_seeds(runs, [1, 2], "test_chrf")["QKNorm"]
    # chrF made up as 50 + 10 * keep + seed: the seed cancels in every contrast.
    assert values == pytest.approx([1.75, 1.75]) and mean == pytest.approx(1.75) and half == pytest.approx(0)


def test_report_names_every_cell_and_refuses_other_references(tmp_path):
    records, data, _, runs = make_records(tmp_path)
    write_report(str(records), str(data))
    text = (records / "README.md").read_text()
    assert "Recorded: 8 of 12 runs; seeds with all four cells: 1, 2." in text
    for name in ("ScaleNorm + scaled dot", "LayerNorm + QKNorm (the paper's system)", "| QKNorm |", "| interaction |"):
        assert name in text
    assert (records / "training-curves.png").read_bytes()[:4] == b"\x89PNG"
    assert "A correction" not in text  # every run's dev curve is valid
    (data / "test.en").write_text("other\n" * 60)
    with pytest.raises(SystemExit, match="not the reference the runs were scored against"):
        write_report(str(records), str(data))
    assert json.loads((records / "runs.json").read_text()) == sorted(
        runs, key=lambda r: (r["seed"], CELLS.index((r["norm"], r["attention"])))
    )


def test_train_log_names_the_updates_a_restarted_run_resumed_at(tmp_path):
    from experiments.fairseq_logs import parse_train_log

    log = tmp_path / "train.log"
    log.write_text(
        "2026-12-01 16:19:58 | INFO | fairseq.trainer | No existing checkpoint found ckpt/checkpoint_last.pt\n"
        "2026-12-01 16:20:01 | INFO | fairseq.trainer | Loaded checkpoint ckpt/checkpoint_last.pt (epoch 1 @ 0 updates)\n"
        "2026-12-01 16:20:01 | INFO | fairseq.trainer | Loaded checkpoint ckpt/checkpoint_last.pt (epoch 2 @ 136 updates)\n"
        "2026-12-01 17:05:35 | INFO | fairseq.trainer | Loaded checkpoint ckpt/checkpoint_last.pt (epoch 6 @ 680 updates)\n"
    )
    assert parse_train_log(log)["resumed_at"] == [136, 680]


def test_runs_with_stale_dev_curves_show_their_scored_model_and_the_earlier_scores(tmp_path):
    records, data, _, runs = make_records(tmp_path)
    for r in runs:
        r.update(
            dev_curve_valid=False,
            best_dev_bleu=None,
            checkpoint_best_by_logged_dev={"test_bleu": r["test_bleu"] - 1, "best_dev_bleu": 3.0},
        )
    gl_en_2x2_records.write_runs(str(records), runs)
    write_report(str(records), str(data))
    text = (records / "README.md").read_text()
    assert "## A correction" in text and "All of these 8 runs" in text
    sd = [r for r in runs if (r["norm"], r["attention"]) == ("scalenorm", "dot")]
    now = sum(r["test_bleu"] for r in sd) / 2
    assert f"| ScaleNorm + dot | {now - 1:.2f} | {now:.2f} | 3.00 |" in text


def test_train_loss_curve_keeps_the_resumed_runs_later_lines(tmp_path):
    from experiments.fairseq_logs import train_loss_curve

    log = tmp_path / "train.log"
    line = "2026-12-01 | INFO | train_inner | epoch 001:     20 / 136 loss={}, nll_loss=4.1, num_updates={}, lr=0.001\n"
    log.write_text(line.format(9.5, 20) + line.format(8.5, 40) + "| Loaded checkpoint\n" + line.format(8.4, 40))
    assert train_loss_curve(log) == [[20, 9.5], [40, 8.4]]


def test_recorded_training_commands_name_no_folder_of_the_machine():
    command = (
        "fairseq-train /data/w/bin --user-dir /src/fairseq_qknorm --save-dir /data/w/arms/qknorm-seed1/checkpoints.tmp"
    )
    assert gl_en_2x2_records.portable_command(command, "/data/w/arms/qknorm-seed1") == (
        "fairseq-train $WORK/bin --user-dir $USER_DIR --save-dir $WORK/arms/qknorm-seed1/checkpoints.tmp"
    )


def test_report_with_one_complete_seed_and_resumed_runs(tmp_path):
    records, data, _, runs = make_records(tmp_path, seeds=(1,))
    runs[0]["resumed_at_updates"] = [40, 80]
    gl_en_2x2_records.write_runs(str(records), runs + [dict(runs[1], seed=2, hyp=runs[1]["hyp"])])
    write_report(str(records), str(data))
    text = (records / "README.md").read_text()
    assert "Recorded: 5 of 12 runs; seeds with all four cells: 1." in text
    assert "one complete seed: no interval over seeds yet" in text
    assert "Resumed here: ScaleNorm + scaled dot (the paper's baseline), seed 1, at update 40 and again at 80." in text
    assert "$" not in text and "<!--" not in text
    # without --update-epoch-batch-itr True the resumed run is a continuation; with it, a replay
    continued, replayed = "is a continuation, not bit-identical", "replays the\nuninterrupted one, bit for bit"
    assert continued in text and replayed not in text
    runs[0]["train_command"] += " --update-epoch-batch-itr True"
    gl_en_2x2_records.write_runs(str(records), runs)
    write_report(str(records), str(data))
    text = (records / "README.md").read_text()
    assert replayed in text and continued not in text


def test_report_without_a_complete_seed_has_no_effects(tmp_path):
    records, data, _, runs = make_records(tmp_path, seeds=(1,))
    gl_en_2x2_records.write_runs(str(records), runs[:3])
    write_report(str(records), str(data))
    text = (records / "README.md").read_text()
    assert "seeds with all four cells: none yet." in text
    assert "## Effects" not in text and "## The cells" in text and "Resumed" not in text
