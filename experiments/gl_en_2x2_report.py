"""The report of the gl-en 2x2 (README.md and training-curves.png beside runs.json): the four cells,
the two main effects and their interaction, each with two 95% intervals. Its prose is the Markdown
template gl_en_2x2_report.md; this module computes the numbers and tables that fill it.

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
import re
import statistics
from string import Template

import numpy as np

from experiments.corpus_scores import METRICS
from experiments.gl_en_2x2_records import CELLS, TGT, read_runs, scored_dev, sha1
from experiments.results import PAPER_BLEU
from fairseq_qknorm_cli import plots
from fairseq_qknorm_cli.files import fail, write_text
from fairseq_qknorm_cli.score import read_lines

TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gl_en_2x2_report.md")
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


def sentence_statistics(records, ref, runs, seeds, metric):
    """{cell: (seeds x sentences x k) sufficient statistics of `metric` ("bleu" or "chrf")}."""
    statistics_of, _ = METRICS[metric]
    stats = {}
    for cell in CELLS:
        per_seed = []
        for seed in seeds:
            run = next(r for r in runs if (r["norm"], r["attention"], r["seed"]) == (*cell, seed))
            per_seed.append(statistics_of(read_lines(os.path.join(records, run["hyp"]), "hypotheses"), ref))
        stats[cell] = np.stack(per_seed)
    return stats


def pooled_bootstrap(stats, metric):
    """{effect: (point, low, high)}: the effect on the pooled test sets, and its paired-bootstrap
    95% interval over resampled test sentences."""
    _, score_of = METRICS[metric]

    def score(cell, rows=None):
        s = stats[cell] if rows is None else stats[cell][:, rows]
        return float(score_of(s.sum(axis=(0, 1))))

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
    """The template's values for runs trained before the FixNorm projection's cache was fixed
    (dev_curve_valid false): how many, the test scores at the checkpoint their stale logs selected,
    and how far that checkpoint was from the scored one."""
    affected = [r for r in runs if not r.get("dev_curve_valid", True)]
    if not affected:
        return {}
    table = [
        "| cell | test BLEU, at the logged best (before) | at the end of the budget (now) | logged best dev BLEU | dev BLEU at the end |",
        "|---|---|---|---|---|",
    ]
    for cell in CELLS:
        rs = [r for r in affected if (r["norm"], r["attention"]) == cell]
        if rs:
            before = statistics.mean(r["checkpoint_best_by_logged_dev"]["test_bleu"] for r in rs)
            logged = statistics.mean(r["checkpoint_best_by_logged_dev"]["best_dev_bleu"] for r in rs)
            table.append(
                f"| {SHORT[cell]} | {before:.2f} | {statistics.mean(r['test_bleu'] for r in rs):.2f} "
                f"| {logged:.2f} | {statistics.mean(r['scored_dev'][2] for r in rs):.2f} |"
            )
    gaps = [abs(r["test_bleu"] - r["checkpoint_best_by_logged_dev"]["test_bleu"]) for r in affected]
    apart = [
        r["updates"] - scored_dev(r["dev"], "checkpoint_best.pt")[0]
        for r in affected
        if r["test_bleu"] != r["checkpoint_best_by_logged_dev"]["test_bleu"]
    ]
    return {
        "corrected_count": "All" if len(affected) == len(runs) else len(affected),
        "corrected_runs": len(affected),
        "corrected_updates": f"{affected[0]['updates']:,}",
        "correction_table": "\n".join(table),
        "apart_count": len(apart),
        "apart_updates": (f"{min(apart)}" if min(apart) == max(apart) else f"{min(apart)} to {max(apart)}") + " updates"
        if apart
        else "",
        "gap_mean": f"{statistics.mean(g for g in gaps if g):.2f}" if apart else "",
        "gap_max": f"{max(gaps):.2f}",
    }


EFFECT_MEANS = {
    "QKNorm": "QKNorm instead of scaled dot product, averaged over the two norms",
    "LayerNorm": "LayerNorm instead of ScaleNorm, averaged over the two attentions",
    "interaction": "how much more QKNorm gains under LayerNorm than under ScaleNorm",
}


def reading(seeds_ci, boot, unit="BLEU"):
    """What the intervals support, one line per effect."""
    lines = []
    for name, what in EFFECT_MEANS.items():
        point, low, high = boot[name]
        by_boot = "excludes 0" if _excludes_zero(low, high) else "includes 0"
        if seeds_ci is None:
            lines.append(
                f"- **{name}**, {unit} ({what}): {point:+.2f}; the bootstrap interval {by_boot} "
                f"(one complete seed: no interval over seeds yet, so training randomness is not measured)."
            )
            continue
        mean, half, _ = seeds_ci[name]
        by_seeds = "excludes 0" if _excludes_zero(mean - half, mean + half) else "includes 0"
        verdict = {
            ("excludes 0", "excludes 0"): "supported by both intervals",
            ("includes 0", "includes 0"): "not distinguishable from no effect",
            ("excludes 0", "includes 0"): "beyond the test-set noise but not beyond the seed noise",
            ("includes 0", "excludes 0"): "consistent across seeds but within the test-set noise",
        }[by_boot, by_seeds]
        lines.append(
            f"- **{name}**, {unit} ({what}): {point:+.2f} on the pooled test sets; the interval over "
            f"seeds {by_seeds}, the bootstrap interval {by_boot}: {verdict}."
        )
    return lines


def effects_section(records, ref, runs, seeds):
    """The template's values for the effects: their table and what the intervals support."""
    ci = {m: over_seeds(runs, seeds, key) for m, key in (("bleu", "test_bleu"), ("chrf", "test_chrf"))}
    boot = {m: pooled_bootstrap(sentence_statistics(records, ref, runs, seeds, m), m) for m in ("bleu", "chrf")}
    table = [
        "| effect | BLEU, over seeds | BLEU, pooled, paired bootstrap | chrF, over seeds | chrF, pooled, paired bootstrap |",
        "|---|---|---|---|---|",
    ]
    for name in EFFECTS:
        cols = []
        for metric in ("bleu", "chrf"):
            mean, half, _ = ci[metric][name]
            point, low, high = boot[metric][name]
            cols += [_ci(mean, half), f"{point:+.2f} [{low:+.2f}, {high:+.2f}]"]
        table.append(f"| {name} | {' | '.join(cols)} |")
    several = len(seeds) > 1
    return {
        "complete_count": len(seeds),
        "effects_table": "\n".join(table),
        "resamples": RESAMPLES,
        "sentences": f"{len(ref):,}",
        "reading": "\n".join(
            reading(ci["bleu"] if several else None, boot["bleu"])
            + reading(ci["chrf"] if several else None, boot["chrf"], "chrF")
        ),
    }


def resumed(runs):
    """The runs that a stopped campaign resumed, in the order of the report's tables."""
    return sorted(
        (r for r in runs if r.get("resumed_at_updates")),
        key=lambda r: (r["seed"], CELLS.index((r["norm"], r["attention"]))),
    )


def resumed_runs(runs):
    """The runs that a stopped campaign resumed, and at which updates."""
    return "; ".join(
        f"{NAMES[r['norm'], r['attention']]}, seed {r['seed']}, at update "
        + " and again at ".join(str(u) for u in r["resumed_at_updates"])
        for r in resumed(runs)
    )


def replays(run):
    """Whether a resume of RUN replays it: fairseq regroups each epoch's batches from the seed and the
    epoch (--update-epoch-batch-itr True) rather than once per process, from the epoch it starts in."""
    return "--update-epoch-batch-itr True" in run["train_command"]


def fill(template, flags, values):
    """The template with its conditional blocks (between `<!-- if NAME -->` and `<!-- end NAME -->`
    lines) kept where flags[NAME] holds and dropped elsewhere, and its $placeholders filled."""
    block = re.compile(r"<!-- if (\w+) -->\n(.*?)<!-- end \1 -->\n", re.DOTALL)
    while block.search(template):
        template = block.sub(lambda m: m.group(2) if flags[m.group(1)] else "", template)
    return Template(template).substitute(values).rstrip("\n") + "\n"


def write_report(records, data_dir):
    """README.md and training-curves.png in RECORDS, from the template gl_en_2x2_report.md; DATA_DIR
    holds the test references the runs were scored against (checked by sha1: they are not kept in
    RECORDS)."""
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
    corrected = correction(runs)
    effect_values = effects_section(records, ref, runs, seeds) if seeds else {}
    paper_baseline, paper_qknorm = PAPER_BLEU["gl-en"]
    values = {
        "recorded": len(runs),
        "planned": len(CELLS) * 3,
        "complete_seeds": ", ".join(map(str, seeds)) or "none yet",
        "run_count": len(runs),
        "cell_table": "\n".join(cell_table(runs)),
        "g_table": "\n".join(g_table(runs)),
        "paper_baseline": f"{paper_baseline:.2f}",
        "paper_qknorm": f"{paper_qknorm:.2f}",
        "paper_gain": f"{paper_qknorm - paper_baseline:+.2f}",
        "resumed_runs": resumed_runs(runs),
        **corrected,
        **effect_values,
    }
    flags = {
        "corrected": bool(corrected),
        "apart": bool(corrected.get("apart_count")),
        "effects": bool(seeds),
        "resumed": bool(values["resumed_runs"]),
        "continued": any(not replays(r) for r in resumed(runs)),
        "replayed": any(replays(r) for r in resumed(runs)),
    }
    with open(TEMPLATE, encoding="utf-8") as f:
        text = fill(f.read(), flags, values)
    training_figure(records, runs)
    write_text(os.path.join(records, "README.md"), text)
