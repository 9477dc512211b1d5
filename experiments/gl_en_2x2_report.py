"""The report of the gl-en 2x2 (README.md and training-curves.png beside runs.json): the four cells,
the two main effects and their interaction, each with two 95% intervals.

- Over seeds: each seed gives one estimate of an effect (its four runs); the interval is the mean
  +- t(0.975, n-1) * sd / sqrt(n). It measures how much training randomness moves the effect.
- Paired bootstrap on the pooled test sets: the test sentences are resampled (1,000 times, with
  replacement), every run's translation of a drawn sentence is kept, and each cell's corpus BLEU
  (chrF) is computed over all its seeds; the interval is the 2.5th-97.5th percentile of the effect.
  It measures how much the choice of test sentences moves the effect, for these trained models.

Effects, in BLEU points, from the cells' scores (S = ScaleNorm, L = LayerNorm, d = dot, q = QKNorm):
  QKNorm    = ((Sq - Sd) + (Lq - Ld)) / 2
  LayerNorm = ((Ld - Sd) + (Lq - Sq)) / 2
  interaction = (Lq - Ld) - (Sq - Sd)   (how much more QKNorm helps under LayerNorm)
"""

import os
import statistics

import numpy as np

from experiments.gl_en_2x2_records import CELLS, TGT, read_runs, scored_dev, sha1
from fairseq_qknorm_cli.files import fail, write_text
from fairseq_qknorm_cli.score import read_lines

NAMES = {
    ("scalenorm", "dot"): "ScaleNorm + scaled dot (the paper's baseline)",
    ("scalenorm", "qknorm"): "ScaleNorm + QKNorm",
    ("layernorm", "dot"): "LayerNorm + scaled dot",
    ("layernorm", "qknorm"): "LayerNorm + QKNorm (the paper's system)",
}
SHORT = {
    ("scalenorm", "dot"): "ScaleNorm + dot",
    ("scalenorm", "qknorm"): "ScaleNorm + QKNorm",
    ("layernorm", "dot"): "LayerNorm + dot",
    ("layernorm", "qknorm"): "LayerNorm + QKNorm",
}
EFFECTS = ("QKNorm", "LayerNorm", "interaction")
RESAMPLES = 1000
BOOTSTRAP_SEED = 12345
# t(0.975, df) for the over-seed intervals (df = seeds - 1).
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def effects(score):
    """score[(norm, attention)] -> the three effects."""
    sd, sq = score["scalenorm", "dot"], score["scalenorm", "qknorm"]
    ld, lq = score["layernorm", "dot"], score["layernorm", "qknorm"]
    return {
        "QKNorm": ((sq - sd) + (lq - ld)) / 2,
        "LayerNorm": ((ld - sd) + (lq - sq)) / 2,
        "interaction": (lq - ld) - (sq - sd),
    }


def complete_seeds(runs):
    """The seeds that have all four cells."""
    cells = {}
    for r in runs:
        cells.setdefault(r["seed"], set()).add((r["norm"], r["attention"]))
    return sorted(s for s, c in cells.items() if c == set(CELLS))


def over_seeds(runs, seeds, metric):
    """{effect: (mean, half-width or None, per-seed values)} from the seeds' own estimates."""
    per_seed = []
    for seed in seeds:
        score = {(r["norm"], r["attention"]): r[metric] for r in runs if r["seed"] == seed}
        per_seed.append(effects(score))
    out = {}
    for name in EFFECTS:
        values = [e[name] for e in per_seed]
        half = T975[len(values) - 1] * statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else None
        out[name] = (statistics.mean(values), half, values)
    return out


def sentence_statistics(records, ref, runs, seeds, metric_name):
    """{cell: (seeds x sentences x k) sacrebleu sufficient statistics} and the metric object."""
    from sacrebleu.metrics import BLEU, CHRF

    metric = BLEU(tokenize="none", force=True) if metric_name == "bleu" else CHRF()
    stats = {}
    for cell in CELLS:
        per_seed = []
        for seed in seeds:
            run = next(r for r in runs if (r["norm"], r["attention"], r["seed"]) == (*cell, seed))
            hyps = read_lines(os.path.join(records, run["hyp"]), "hypotheses")
            per_seed.append(np.asarray(metric._extract_corpus_statistics(hyps, [ref]), dtype=np.float64))
        stats[cell] = np.stack(per_seed)
    return stats, metric


def pooled_bootstrap(stats, metric):
    """{effect: (point, low, high)}: the effect on the pooled test sets, and its paired-bootstrap
    95% interval over resampled test sentences."""

    def score(cell, rows=None):
        s = stats[cell] if rows is None else stats[cell][:, rows]
        return float(metric._compute_score_from_stats(s.sum(axis=(0, 1)).tolist()).score)

    point = effects({cell: score(cell) for cell in CELLS})
    n = next(iter(stats.values())).shape[1]
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    draws = {name: [] for name in EFFECTS}
    for _ in range(RESAMPLES):
        rows = rng.integers(0, n, n)
        for name, value in effects({cell: score(cell, rows) for cell in CELLS}).items():
            draws[name].append(value)
    return {name: (point[name], *np.percentile(draws[name], [2.5, 97.5])) for name in EFFECTS}


def training_figure(records, runs):
    """The cells' training loss (mean over seeds, smoothed over 100 updates) beside every run's
    test and dev BLEU."""
    from fairseq_qknorm_cli import plots

    plots.require_matplotlib()
    curves, scores = {}, {}
    for cell in CELLS:
        rs = [r for r in runs if (r["norm"], r["attention"]) == cell]
        if not rs:
            continue
        losses = [dict(map(tuple, r["train_loss"])) for r in rs]  # {updates: loss} per run
        common = sorted(set.intersection(*map(set, losses)))
        mean = [statistics.mean(loss[u] for loss in losses) for u in common]
        window = 5  # train_inner lines are 20 updates apart
        curves[SHORT[cell]] = [
            (common[i], statistics.mean(mean[max(0, i - window + 1) : i + 1])) for i in range(len(common))
        ]
        scores[SHORT[cell]] = [{"test BLEU": r["test_bleu"], "dev BLEU": r["scored_dev"][2]} for r in rs]
    return plots.training_and_scores(
        os.path.join(records, "training-curves.png"),
        "TED gl-en, the 2x2: training loss (mean over seeds, smoothed over 100 updates) and the scored models' BLEU",
        curves,
        scores,
    )


def _ci(mean, half):
    return f"{mean:+.2f}" if half is None else f"{mean:+.2f} [{mean - half:+.2f}, {mean + half:+.2f}]"


def _excludes_zero(low, high):
    return low > 0 or high < 0


def cell_table(runs):
    lines = [
        "| cell | seeds | test BLEU, mean (sd) | chrF, mean (sd) | dev BLEU, mean | per seed (BLEU) | updates | train time, mean |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cell in CELLS:
        rs = sorted((r for r in runs if (r["norm"], r["attention"]) == cell), key=lambda r: r["seed"])
        if not rs:
            lines.append(f"| {NAMES[cell]} | 0 | - | - | - | - | - | - |")
            continue

        def mean_sd(key):
            values = [r[key] for r in rs]  # noqa: B023 (called in this iteration)
            sd = f" ({statistics.stdev(values):.2f})" if len(values) > 1 else ""
            return f"{statistics.mean(values):.2f}{sd}"

        per_seed = ", ".join(f"{r['seed']}: {r['test_bleu']:.2f}" for r in rs)
        # a resumed run's train_seconds cover only the part after its resume
        whole = [r["train_seconds"] for r in rs if not r.get("resumed_at_updates")]
        minutes = f"{statistics.mean(whole) / 60:.0f} min" if whole else "-"
        if len(whole) < len(rs):
            minutes += f" ({len(rs) - len(whole)} resumed left out)"
        lines.append(
            f"| {NAMES[cell]} | {len(rs)} | {mean_sd('test_bleu')} | {mean_sd('test_chrf')} "
            f"| {statistics.mean(r['scored_dev'][2] for r in rs):.2f} | {per_seed} "
            f"| {', '.join(sorted({str(r['updates']) for r in rs}))} | {minutes} |"
        )
    return lines


def g_table(runs):
    lines = ["| run | g0 (L) | encoder self | decoder self | decoder cross |", "|---|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: (CELLS.index((r["norm"], r["attention"])), r["seed"])):
        if not r["g"]:
            continue
        groups = {"encoder self": [], "decoder self": [], "decoder cross": []}
        for name, g in sorted(r["g"].items(), key=lambda kv: int(kv[0].split(".")[2])):
            kind = (
                "encoder self"
                if name.startswith("encoder")
                else "decoder cross"
                if name.endswith("encoder_attn")
                else "decoder self"
            )
            groups[kind].append(g if isinstance(g, float) else statistics.mean(g))
        cols = " | ".join(", ".join(f"{g:.2f}" for g in groups[k]) for k in groups)
        lines.append(f"| {SHORT[r['norm'], r['attention']]}, seed {r['seed']} | {r['g0']:.2f} ({r['L']}) | {cols} |")
    return lines


def correction(runs):
    """For runs trained before the FixNorm projection's cache was fixed: what their logs got wrong,
    and what the test scores were at the checkpoint those logs selected."""
    affected = [r for r in runs if not r.get("dev_curve_valid", True)]
    if not affected:
        return []
    lines = [
        "## A correction: the dev numbers these runs logged",
        "",
        f"{'All' if len(affected) == len(runs) else len(affected)} of these {len(runs)} runs were trained with a "
        "version of the plugin whose FixNorm output projection",
        "cached its unit-length matrix for inference and refreshed it when the weight's version changed;",
        "fairseq's optimizers update `p.data`, which leaves the version alone. So from the second",
        "validation on, fairseq-train measured dev loss and dev BLEU with the output projection of the first",
        "validation, and picked `checkpoint_best.pt` by those numbers. Training itself was unaffected: it",
        "normalizes afresh at every step, and the learning rate rose through its warm-up to the peak and was",
        "never reduced, so no decision of the scheduler depended on the stale numbers. A new process",
        "(fairseq-generate, fairseq-validate) always saw the right model. The plugin now drops the cache in",
        "train() and eval().",
        "",
        "These runs are scored again at `checkpoint_last.pt` (the same model for every run: update",
        f"{affected[0]['updates']:,}), with the fixed plugin: the test set translated as run.sh now does it",
        "(fairseq-generate, beam 4, length penalty 0.6), the dev set the same way (sacrebleu 13a), and the",
        "dev loss by fairseq-validate with the batches of training (`--max-tokens 4096",
        "--required-batch-size-multiple 1`). Before, they were scored at the checkpoint the stale dev BLEU",
        "picked:",
        "",
        "| cell | test BLEU, at the logged best (before) | at the end of the budget (now) | logged best dev BLEU | dev BLEU at the end |",
        "|---|---|---|---|---|",
    ]
    for cell in CELLS:
        rs = [r for r in affected if (r["norm"], r["attention"]) == cell]
        if rs:
            before = statistics.mean(r["checkpoint_best_by_logged_dev"]["test_bleu"] for r in rs)
            logged = statistics.mean(r["checkpoint_best_by_logged_dev"]["best_dev_bleu"] for r in rs)
            lines.append(
                f"| {SHORT[cell]} | {before:.2f} | {statistics.mean(r['test_bleu'] for r in rs):.2f} "
                f"| {logged:.2f} | {statistics.mean(r['scored_dev'][2] for r in rs):.2f} |"
            )
    gaps = [abs(r["test_bleu"] - r["checkpoint_best_by_logged_dev"]["test_bleu"]) for r in affected]
    apart = [
        r["updates"] - scored_dev(r["dev"], "checkpoint_best.pt")[0]
        for r in affected
        if r["test_bleu"] != r["checkpoint_best_by_logged_dev"]["test_bleu"]
    ]
    lines += [
        "",
        f"In {len(apart)} of the {len(affected)} runs the two are different checkpoints, "
        + (f"{min(apart)} updates" if min(apart) == max(apart) else f"{min(apart)} to {max(apart)} updates")
        + " apart; "
        f"their test BLEU differs by {statistics.mean(g for g in gaps if g):.2f} on average and by up to {max(gaps):.2f}. "
        "At this budget a run's score depends on the exact checkpoint about as much as on its cell."
        if apart
        else "",
        "",
        "runs.json keeps the logged dev curves (`dev`, marked `dev_curve_valid: false`) and the earlier",
        "scores (`checkpoint_best_by_logged_dev`); `best_dev_bleu` is empty, as the true dev BLEU of the",
        "intermediate models was not kept. Retraining (the same commands) would log true curves.",
        "",
    ]
    return lines


def reading(seeds_ci, boot, unit="BLEU"):
    """What the intervals support, in words, effect by effect."""
    lines = []
    for name, what in (
        ("QKNorm", "QKNorm instead of scaled dot product, averaged over the two norms"),
        ("LayerNorm", "LayerNorm instead of ScaleNorm, averaged over the two attentions"),
        ("interaction", "how much more QKNorm gains under LayerNorm than under ScaleNorm"),
    ):
        mean, half, _ = seeds_ci[name] if seeds_ci else (None, None, None)
        point, low, high = boot[name]
        by_boot = "excludes 0" if _excludes_zero(low, high) else "includes 0"
        if half is not None:
            by_seeds = "excludes 0" if _excludes_zero(mean - half, mean + half) else "includes 0"
            verdict = (
                "supported by both intervals"
                if by_boot == by_seeds == "excludes 0"
                else "not distinguishable from no effect"
                if by_boot == by_seeds == "includes 0"
                else "beyond the test-set noise but not beyond the seed noise"
                if by_boot == "excludes 0"
                else "consistent across seeds but within the test-set noise"
            )
            lines.append(
                f"- **{name}**, {unit} ({what}): {point:+.2f} on the pooled test sets; the interval over "
                f"seeds {by_seeds}, the bootstrap interval {by_boot}: {verdict}."
            )
        else:
            lines.append(
                f"- **{name}**, {unit} ({what}): {point:+.2f}; the bootstrap interval {by_boot} "
                f"(one complete seed: no interval over seeds yet, so training randomness is not measured)."
            )
    return lines


def write_report(records, data_dir):
    """README.md and training-curves.png in RECORDS; DATA_DIR holds the test references the runs were
    scored against (checked by sha1: they are not kept in RECORDS)."""
    runs = read_runs(records)
    if not runs:
        fail(f"{records}/runs.json: no runs recorded yet")
    seeds = complete_seeds(runs)
    ref_path = os.path.join(data_dir, f"test.{TGT}")
    if not os.path.exists(ref_path):
        fail(f"--data {data_dir}: no test.{TGT}")
    if sha1(ref_path) != runs[0]["data_sha1"][f"test.{TGT}"]:
        fail(f"--data {data_dir}: test.{TGT} is not the reference the runs were scored against (sha1 differs)")
    ref = read_lines(ref_path, "--data")
    md = [
        "# The 2x2 on TED gl-en: does QK-norm itself help?",
        "",
        "The paper's QKNorm system differs from its baseline in two things: ScaleNorm becomes LayerNorm, and",
        "scaled dot-product attention becomes QKNorm. This experiment trains all four combinations with",
        "everything else equal (PreNorm, FixNorm, shared embeddings, word dropout 0.1, data, sentencepiece",
        "model, budget, seeds) and separates the two.",
        "",
        f"Recorded: {len(runs)} of {len(CELLS) * 3} runs; seeds with all four cells: "
        f"{', '.join(map(str, seeds)) or 'none yet'}.",
        "",
        "## The cells",
        "",
        *cell_table(runs),
        "",
        "Every run is scored with its model at the end of the budget (`checkpoint_last.pt`), on test and dev",
        "alike. Test BLEU: sacrebleu, `--tokenize none` on the Moses-tokenized release (the paper's tokenized",
        "BLEU); chrF: sacrebleu's default; dev BLEU: sacrebleu's 13a against dev.en (fairseq-train's `--eval-bleu`",
        "scores against the references it decodes from the binarized data, and reads a little higher).",
        "Each run's detokenized test hypotheses are in this folder (runs.json names them).",
        "",
    ]
    md += correction(runs)
    if seeds:
        ci = {m: over_seeds(runs, seeds, key) for m, key in (("bleu", "test_bleu"), ("chrf", "test_chrf"))}
        boot = {}
        for metric in ("bleu", "chrf"):
            stats, scorer = sentence_statistics(records, ref, runs, seeds, metric)
            boot[metric] = pooled_bootstrap(stats, scorer)
        md += [
            "## Effects",
            "",
            f"Over the {len(seeds)} complete seed(s). Each cell: effect [95% interval].",
            "",
            "| effect | BLEU, over seeds | BLEU, pooled, paired bootstrap | chrF, over seeds | chrF, pooled, paired bootstrap |",
            "|---|---|---|---|---|",
        ]
        for name in EFFECTS:
            cols = []
            for metric in ("bleu", "chrf"):
                mean, half, _ = ci[metric][name]
                point, low, high = boot[metric][name]
                cols += [_ci(mean, half), f"{point:+.2f} [{low:+.2f}, {high:+.2f}]"]
            md.append(f"| {name} | {' | '.join(cols)} |")
        md += [
            "",
            "QKNorm = mean of (QKNorm - dot) under each norm; LayerNorm = mean of (LayerNorm - ScaleNorm) "
            "under each attention; interaction = (LayerNorm: QKNorm - dot) - (ScaleNorm: QKNorm - dot).",
            f"Over seeds: mean +- t * sd / sqrt(n). Paired bootstrap: {RESAMPLES} resamples of the "
            f"{next(iter(stats.values())).shape[1]:,} test sentences, every seed's translation of each drawn "
            "sentence kept (experiments/gl_en_2x2_report.py).",
            "",
            "## What the numbers support",
            "",
            *reading(ci["bleu"] if len(seeds) > 1 else None, boot["bleu"]),
            *reading(ci["chrf"] if len(seeds) > 1 else None, boot["chrf"], "chrF"),
            "",
        ]
    md += [
        "## Training curves",
        "",
        "![training loss and BLEU](training-curves.png)",
        "",
        "Training loss is what fairseq-train logs every 20 updates (dropout and word dropout on); test and",
        "dev BLEU are those of the scored models. The dev curves are not drawn: for runs trained before the",
        "correction above they measured a stale output projection after the first validation.",
        "",
        "## The learned g",
        "",
        "g of every attention module of the scored model (layers in order), against g0 = log2(L^2 - L):",
        "",
        *g_table(runs),
        "",
    ]
    md += [
        "## Beside the paper and the toy corpus",
        "",
        "- The paper (gl-en, full size: 4+4 layers, width 512, dropout 0.4, trained to convergence on a GPU):",
        "  baseline 22.01 -> QKNorm 24.21 BLEU (+2.20), the two changes together; it did not separate them.",
        "- The toy corpus 2x2 (examples/ted/RESULTS-toy-ablations.md, 3 seeds): QKNorm +4.4 BLEU under",
        "  ScaleNorm, +5.4 under LayerNorm; LayerNorm +0.4 with scaled dot, +1.5 with QKNorm (at checkpoints",
        "  picked by the same stale dev BLEU: see the correction there).",
        "- This run is the `cpu` preset (width 128, 4+4 layers, 4 heads, dropout 0.1, 1,400 updates of",
        "  4,096 tokens, about 12 epochs): small models, far from converged. Its absolute BLEU is not",
        "  the paper's; what it measures is the direction and size of each change at this budget.",
        "",
        "## How it ran",
        "",
        "```sh",
        "DATA_DIR=path/to/ted-gl-en bash examples/ted/gl-en-2x2/run.sh   # trains what has no record yet",
        ".venv/bin/python -m experiments.gl_en_2x2 report examples/ted/gl-en-2x2 --data path/to/ted-gl-en   # this page",
        "```",
        "",
        "Data: TED gl-en as ../shared/data/ted-gl-en holds it (the CMU 11-731 extraction of Qi et al.'s",
        "corpus: 11,233 / 742 / 1,112 sentence pairs; runs.json records the sha1 of every file). Each",
        "entry of runs.json holds its fairseq-train command, dev and training-loss curves, learned g and training time;",
        "two runs trained side by side with one thread each, on a 2-core machine that other jobs also",
        "used at times: the training times say how long a run took there, not what a run costs.",
        "",
    ]
    resumed = [r for r in runs if r.get("resumed_at_updates")]
    if resumed:
        md += [
            "Resumed runs: a campaign stopped mid-run continues from the run's checkpoint_last.pt, as",
            "fairseq-train does when restarted on the same --save-dir. Resumed here: "
            + "; ".join(
                f"{NAMES[r['norm'], r['attention']]}, seed {r['seed']}, at update "
                + " and again at ".join(str(u) for u in r["resumed_at_updates"])
                for r in sorted(resumed, key=lambda r: (r["seed"], CELLS.index((r["norm"], r["attention"]))))
            )
            + ". fairseq restores the weights, the optimizer and the data position, so such a run trains",
            "the same number of updates on the same batches; it is not bit-identical to an uninterrupted run",
            "(fairseq-train seeds torch's random state from --seed when it starts, so dropout draws other",
            "masks after a resume), and its train time counts only the part after the last resume, so the",
            "table leaves it out of the mean.",
            "",
        ]
    if runs:
        training_figure(records, runs)
    write_text(os.path.join(records, "README.md"), "\n".join(md))
