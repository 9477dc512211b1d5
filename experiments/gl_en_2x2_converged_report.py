"""The report of the gl-en 2x2 trained to convergence: README.md and dev-curves.png beside runs.json,
from the template gl_en_2x2_converged_report.md. It reports what has landed: curves of runs still
training, the QKNorm - dot difference under a norm once both of its runs have stopped, and the
three effects of the 2x2 once all four cells of a seed have.

Differences and effects are in test BLEU at each run's best-dev checkpoint. Per seed, with a paired
bootstrap over test sentences (1,000 resamples; every run's translation of a drawn sentence kept), the
ten-epoch 2x2's interval (experiments/gl_en_2x2_report.py) for these trained models, beside the same
numbers for the ten-epoch 2x2's runs of the same seed. Over seeds, the mean of the per-seed values
with two intervals: a two-level bootstrap over seeds and test sentences, and a t-interval over the
seeds; and the seed-to-seed spread at convergence beside the ten-epoch 2x2's, from which the
how-many-seeds table is recomputed once a norm has two converged seeds.
"""

import os
import re
import statistics
from string import Template

import numpy as np

from experiments.corpus_scores import bleu_score, bleu_statistics
from experiments.gl_en_2x2_records import CELLS, TGT, read_runs, sha1, stopped
from experiments.gl_en_2x2_report import BOOTSTRAP_SEED, EFFECTS, RESAMPLES, SHORT, T975, effects, replays
from fairseq_qknorm_cli.files import atomic_path, fail, write_text
from fairseq_qknorm_cli.score import read_lines

HERE = os.path.dirname(os.path.abspath(__file__))
TEN_EPOCHS = os.path.join(os.path.dirname(HERE), "examples", "ted", "gl-en-2x2")
TEN_EPOCH_UPDATES = 1400
SMOOTH = 4
NORMS = {"scalenorm": "ScaleNorm", "layernorm": "LayerNorm"}
PAPER = {("scalenorm", "dot"): 22.01, ("layernorm", "qknorm"): 24.21}
COLORS = {
    ("scalenorm", "dot"): "tab:blue",
    ("scalenorm", "qknorm"): "tab:orange",
    ("layernorm", "dot"): "tab:green",
    ("layernorm", "qknorm"): "tab:red",
}


def cell(run):
    return run["norm"], run["attention"]


# ------------------------------------------------------------------ test-set statistics
def corpus_bleu(stats):
    return bleu_score(stats.sum(axis=0))


def paired_bootstrap(stats, combine):
    """combine({cell: corpus BLEU}) -> {name: value}; returns {name: (point, low, high)} with the
    2.5th-97.5th percentiles over resampled test sentences."""
    return seeds_and_sentences_bootstrap({c: [s] for c, s in stats.items()}, combine)


def seeds_and_sentences_bootstrap(stats, combine):
    """The same over seeds and test sentences: stats {cell: [one run's sentence statistics per seed]},
    the same seeds in the same order for every cell; a cell's score is the mean corpus BLEU of its
    seeds. Each resample draws the test sentences and the seeds with replacement, both the same for
    every cell: the differences stay paired by sentence and by seed (the runs of one seed share their
    data order). With one seed it is the paired bootstrap over sentences alone (the seeds are drawn
    by a generator of their own, so the sentence draws are the same)."""
    point = combine({c: statistics.mean(corpus_bleu(s) for s in runs) for c, runs in stats.items()})
    (seeds,) = {len(runs) for runs in stats.values()}
    n = len(next(iter(stats.values()))[0])
    rng, seed_rng = np.random.default_rng(BOOTSTRAP_SEED), np.random.default_rng(BOOTSTRAP_SEED + 1)
    draws = {name: [] for name in point}
    for _ in range(RESAMPLES):
        rows = rng.integers(0, n, n)
        picked = seed_rng.integers(0, seeds, seeds)
        score = {c: statistics.mean(corpus_bleu(runs[i][rows]) for i in picked) for c, runs in stats.items()}
        for name, value in combine(score).items():
            draws[name].append(value)
    return {name: (point[name], *np.percentile(draws[name], [2.5, 97.5])) for name in point}


# ------------------------------------------------------------------ the figure
def paired_differences(runs):
    """{(norm, seed): [[updates, QKNorm - dot dev BLEU], ...]} at the validations both runs have."""
    out = {}
    by_key = {(r["norm"], r["attention"], r["seed"]): r for r in runs}
    for (norm, attention, seed), dot in sorted(by_key.items()):
        qk = by_key.get((norm, "qknorm", seed))
        if attention != "dot" or qk is None:
            continue
        a, b = {u: bleu for u, bleu, _ in dot["dev_curve"]}, {u: bleu for u, bleu, _ in qk["dev_curve"]}
        common = sorted(set(a) & set(b))
        if common:
            out[norm, seed] = [[u, round(b[u] - a[u], 2)] for u in common]
    return out


def seed_style(seed):
    """The line style of a seed's curves, in both panels: seed 1 solid, 2 dashed, 3 dash-dotted (dotted
    is for the curves of lost checkpoints)."""
    return ["-", "--", "-."][(seed - 1) % 3]


def figure(path, runs):
    from matplotlib.figure import Figure

    from fairseq_qknorm_cli import plots

    plots.require_matplotlib()
    fig = Figure(figsize=(13, 5))
    left, right = fig.subplots(1, 2)
    for r in runs:
        color, style = COLORS[cell(r)], seed_style(r["seed"])
        for lost in r.get("lost_curves", []):
            u, b = zip(*[(p[0], p[1]) for p in lost["dev_curve"]]) if lost["dev_curve"] else ((), ())
            left.plot(u, b, ":", color=color, alpha=0.35, linewidth=1)
        if r["dev_curve"]:
            u, b, _ = zip(*r["dev_curve"])
            left.plot(u, b, style, color=color, marker=".", label=f"{SHORT[cell(r)]}, seed {r['seed']}")
        if r.get("best_updates"):
            best = next(p for p in r["dev_curve"] if p[0] == r["best_updates"])
            left.plot([best[0]], [best[1]], "o", color=color, markerfacecolor="none", markersize=10)
    left.set(xlabel="updates", ylabel="dev BLEU", title="True dev BLEU (circles: each run's best)")
    left.grid(alpha=0.3)
    if left.get_legend_handles_labels()[0]:
        left.legend(fontsize=8)
    for (norm, seed), diff in paired_differences(runs).items():
        u, d = zip(*diff)
        color = COLORS[norm, "qknorm"]
        style = seed_style(seed)
        right.plot(u, d, style, marker=".", color=color, alpha=0.4, label=f"{NORMS[norm]}: QKNorm - dot, seed {seed}")
        # the trend under the validation-to-validation noise: the mean of the last SMOOTH validations
        mean = [statistics.mean(d[max(0, i + 1 - SMOOTH) : i + 1]) for i in range(len(d))]
        right.plot(
            u, mean, style, color=color, linewidth=2.5, label=f"seed {seed}, mean of the last {SMOOTH} validations"
        )
    right.axhline(0, color="black", linewidth=0.8)
    right.axvline(TEN_EPOCH_UPDATES, color="grey", linewidth=1)
    right.set(xlabel="updates", ylabel="dev BLEU difference", title="QKNorm minus scaled dot, by norm")
    right.grid(alpha=0.3)
    if right.get_legend_handles_labels()[0]:
        right.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)


# ------------------------------------------------------------------ the sections
def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def hours(seconds):
    return f"{seconds / 3600:.1f} h"


def run_table(runs):
    lines = [
        "| cell | seed | stop | updates (epochs) | best dev BLEU at updates (epoch) "
        "| test BLEU / chrF, best | test BLEU / chrF, last | train time | rate at the end |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        best = next((p for p in r["dev_curve"] if p[0] == r["best_updates"]), None)
        lr = r["lr_curve"][-1][1] if r["lr_curve"] else None
        lines.append(
            f"| {SHORT[cell(r)]} | {r['seed']} | {r['stop_reason']} | {r['updates']:,} ({r['epochs']}) | "
            + (f"{best[1]:.2f} at {best[0]:,} ({r['best_epoch']})" if best else "-")
            + f" | {fmt(r['test_bleu'])} / {fmt(r['test_chrf'])} | {fmt(r['last_test_bleu'])} / "
            f"{fmt(r['last_test_chrf'])} | {hours(r['train_seconds'])} | {fmt(lr, '.2e')} |"
        )
    return "\n".join(lines)


def difference_summary(runs):
    diffs = paired_differences(runs)
    if not diffs:
        return "No norm has both of its runs validated yet."
    lines = []
    for (norm, seed), diff in diffs.items():
        early = [d for u, d in diff if u <= TEN_EPOCH_UPDATES]
        late = diff[-SMOOTH:]
        span = (
            f"over the last {len(late)} validations both runs have ({late[0][0]:,} to {late[-1][0]:,} updates)"
            if len(late) > 1
            else f"at the one validation both runs have ({late[0][0]:,} updates)"
        )
        lines.append(
            f"- {NORMS[norm]}, seed {seed}: QKNorm - dot {fmt(statistics.mean(early) if early else None, '+.2f')} dev BLEU "
            f"on average up to {TEN_EPOCH_UPDATES:,} updates, {statistics.mean(d for _, d in late):+.2f} {span}."
        )
    return "\n".join(lines)


def test_statistics(records, ref, runs):
    """Per-sentence BLEU statistics of the runs' committed hypotheses, each checked against the test
    BLEU its record holds: the report stands on the files a reader can re-score."""
    stats = {}
    for r in runs:
        path = os.path.join(records, r["hyp"])
        stats[r["norm"], r["attention"], r["seed"]] = s = bleu_statistics(read_lines(path, "hyp"), ref)
        bleu = round(corpus_bleu(s), 2)
        if bleu != r["test_bleu"]:
            fail(f"{path}: scores {bleu:.2f} BLEU against test.{TGT}, its record says {r['test_bleu']}")
    return stats


def ten_epoch_statistics(ref, ref_sha1, seeds):
    """The ten-epoch 2x2's test statistics for SEEDS, when its references are these: the same
    differences and effects at 1,400 updates, bootstrapped the same way, beside the converged ones."""
    ten = [r for r in ten_epoch_runs() if r["seed"] in seeds and r["data_sha1"].get(f"test.{TGT}") == ref_sha1]
    return test_statistics(TEN_EPOCHS, ref, ten)


def effects_section(runs, stats, ten_stats):
    by_key = {(r["norm"], r["attention"], r["seed"]): r for r in runs if stopped(r)}
    lines = ["## What the stopped runs say", ""]
    pairs = sorted({(n, s) for n, a, s in by_key if (n, "dot", s) in by_key and (n, "qknorm", s) in by_key})
    if not pairs:
        return "\n".join(
            lines + ["No norm has both of its runs stopped yet: the difference is read from the curves above."]
        )
    lines += [
        "QKNorm minus scaled dot product in test BLEU at the best-dev checkpoints, with its paired-bootstrap",
        "95% interval over test sentences:",
        "",
        "| norm | seed | scaled dot | QKNorm | QKNorm - dot [95% interval] | the same at ten epochs |",
        "|---|---|---|---|---|---|",
    ]

    def difference(at, norm, seed):
        if (norm, "dot", seed) not in at or (norm, "qknorm", seed) not in at:
            return "-"
        pair = {"dot": at[norm, "dot", seed], "qknorm": at[norm, "qknorm", seed]}
        (point, low, high) = paired_bootstrap(pair, lambda s: {"d": s["qknorm"] - s["dot"]})["d"]
        return f"{point:+.2f} [{low:+.2f}, {high:+.2f}]"

    for norm, seed in pairs:
        lines.append(
            f"| {NORMS[norm]} | {seed} | {by_key[norm, 'dot', seed]['test_bleu']:.2f} | "
            f"{by_key[norm, 'qknorm', seed]['test_bleu']:.2f} | {difference(stats, norm, seed)} "
            f"| {difference(ten_stats, norm, seed)} |"
        )
    complete = sorted(s for s in {k[2] for k in by_key} if all((*c, s) in by_key for c in CELLS))
    if complete:
        lines += [
            "",
            "The three effects of the 2x2 (QKNorm = mean of QKNorm - dot under each norm; LayerNorm = mean of",
            "LayerNorm - ScaleNorm under each attention; interaction = how much more QKNorm gains under",
            "LayerNorm than under ScaleNorm), test BLEU, paired bootstrap:",
            "",
            "| models | seed | " + " | ".join(EFFECTS) + " |",
            "|---|---|" + "---|" * len(EFFECTS),
        ]
        for when, at in (("converged", stats), (f"ten epochs ({TEN_EPOCH_UPDATES:,} updates)", ten_stats)):
            for seed in complete:
                if not all((*c, seed) in at for c in CELLS):
                    continue
                boot = paired_bootstrap({c: at[(*c, seed)] for c in CELLS}, effects)
                lines.append(
                    f"| {when} | {seed} | "
                    + " | ".join(f"{boot[e][0]:+.2f} [{boot[e][1]:+.2f}, {boot[e][2]:+.2f}]" for e in EFFECTS)
                    + " |"
                )
    lines += [
        "",
        "The interval measures how much the choice of test sentences moves the difference, for these",
        "trained models; it says nothing about how much another seed would",
        "([How many seeds](#how-many-seeds)).",
    ]
    return "\n".join(lines)


def ten_epoch_runs():
    return read_runs(TEN_EPOCHS) if os.path.exists(os.path.join(TEN_EPOCHS, "runs.json")) else []


def beside_table(runs):
    ten = ten_epoch_runs()
    lines = [
        "| cell | paper (full size, GPU) | ten epochs, seed 1 | ten epochs, mean of 3 seeds | converged, seed 1 (best dev) "
        "| converged, mean of the stopped seeds |",
        "|---|---|---|---|---|---|",
    ]
    for c in CELLS:
        t1 = [r["test_bleu"] for r in ten if cell(r) == c and r["seed"] == 1]
        ta = [r["test_bleu"] for r in ten if cell(r) == c]
        conv = [r for r in runs if cell(r) == c and r["seed"] == 1]
        now = conv[0]["test_bleu"] if conv and stopped(conv[0]) else None
        done = [r["test_bleu"] for r in runs if cell(r) == c and stopped(r)]
        state = "still training" if conv and not stopped(conv[0]) else "not started"
        lines.append(
            f"| {SHORT[c]} | {fmt(PAPER.get(c))} | {fmt(t1[0] if t1 else None)} | "
            f"{fmt(statistics.mean(ta) if ta else None)} | {fmt(now) if now is not None else state} | "
            + (f"{statistics.mean(done):.2f} ({len(done)} seed{'s' * (len(done) > 1)})" if done else "-")
            + " |"
        )
    lines.append("")
    lines.append("Test BLEU, sacrebleu `--tokenize none`; the paper reports only its baseline and its system.")
    return "\n".join(lines)


def epochs_to_plateau(runs):
    done = [r for r in runs if stopped(r)]
    if not done:
        return "No run has stopped yet."
    return "\n".join(
        f"- {SHORT[cell(r)]}, seed {r['seed']}: best dev BLEU at epoch {r['best_epoch']} "
        f"({r['best_updates']:,} updates), stopped ({r['stop_reason']}) at epoch {r['epochs']} ({r['updates']:,} updates)."
        for r in done
    )


def stopped_seeds(runs, cells):
    """The seeds whose runs of every one of CELLS have stopped."""
    done = {(r["norm"], r["attention"], r["seed"]) for r in runs if stopped(r)}
    return sorted({s for _, _, s in done if all((*c, s) in done for c in cells)})


def comparisons(runs):
    """[(name, cells, combine, seeds)]: QKNorm - dot under each norm, then the 2x2's three effects,
    each over the seeds that have all of its cells stopped."""
    out = []
    for norm in NORMS:
        pair = ((norm, "dot"), (norm, "qknorm"))
        out.append(
            (
                f"QKNorm - dot under {NORMS[norm]}",
                pair,
                lambda s, p=pair: {"d": s[p[1]] - s[p[0]]},
                stopped_seeds(runs, pair),
            )
        )
    for name in EFFECTS:
        out.append((f"{name} (2x2 effect)", CELLS, lambda s, n=name: {"d": effects(s)[n]}, stopped_seeds(runs, CELLS)))
    return out


def seed_sd(values):
    return statistics.stdev(values) if len(values) > 1 else None


def over_seeds_section(runs, stats):
    """Per cell, mean and SD over its stopped seeds; each comparison's mean over seeds with a 95%
    interval that counts seeds and test sentences, beside the t-interval over seeds alone."""
    lines = ["## Over seeds", ""]
    lines += [
        "Per cell, test BLEU and chrF at the best-dev checkpoint, mean (standard deviation) over the seeds",
        "whose run has stopped:",
        "",
        "| cell | seeds | test BLEU, mean (SD) | chrF, mean (SD) | per seed (BLEU) |",
        "|---|---|---|---|---|",
    ]
    for c in CELLS:
        rs = sorted((r for r in runs if cell(r) == c and stopped(r)), key=lambda r: r["seed"])
        if not rs:
            lines.append(f"| {SHORT[c]} | 0 | - | - | - |")
            continue
        cols = []
        for key in ("test_bleu", "test_chrf"):
            values = [r[key] for r in rs]
            sd = seed_sd(values)
            cols.append(f"{statistics.mean(values):.2f}" + (f" ({sd:.2f})" if sd is not None else ""))
        per_seed = ", ".join(f"{r['seed']}: {r['test_bleu']:.2f}" for r in rs)
        lines.append(f"| {SHORT[c]} | {len(rs)} | {cols[0]} | {cols[1]} | {per_seed} |")
    lines += [
        "",
        "Each comparison as the mean over seeds of the per-seed values (test BLEU), with two 95% intervals:",
        "a two-level bootstrap that draws the test sentences and the seeds with replacement, both the same",
        f"for every cell ({RESAMPLES:,} resamples; it counts both sources of chance, but with few seeds it",
        "sees little of their spread and runs narrow), and a t-interval over the per-seed values (it counts",
        "the seeds only, on this one test set, and is wide with few seeds):",
        "",
        "| comparison | seeds | mean | 95%, seeds and sentences (bootstrap) | 95%, seeds (t) | per seed |",
        "|---|---|---|---|---|---|",
    ]
    for name, cells, combine, seeds in comparisons(runs):
        if not seeds:
            lines.append(f"| {name} | 0 | - | - | - | - |")
            continue
        runs_of = {c: [stats[(*c, s)] for s in seeds] for c in cells}
        (point, low, high) = seeds_and_sentences_bootstrap(runs_of, combine)["d"]
        # per seed from the hypotheses, unrounded, as in the per-seed tables above
        values = [combine({c: corpus_bleu(stats[(*c, s)]) for c in cells})["d"] for s in seeds]
        sd = seed_sd(values)
        t = "-" if sd is None else interval(statistics.mean(values), T975[len(values) - 1] * sd / len(values) ** 0.5)
        per_seed = ", ".join(f"{s}: {v:+.2f}" for s, v in zip(seeds, values))
        lines.append(f"| {name} | {len(seeds)} | {point:+.2f} | [{low:+.2f}, {high:+.2f}] | {t} | {per_seed} |")
    lines += ["", "### How much seeds move the results", "", *spread_table(runs)]
    return "\n".join(lines)


def interval(mean, half):
    return f"[{mean - half:+.2f}, {mean + half:+.2f}]"


def qknorm_minus_dot_by_seed(runs):
    """{norm: [QKNorm - dot test BLEU per seed]} over the seeds with both runs of the norm stopped
    (every run of RUNS counts as stopped when it has a test BLEU)."""
    score = {(r["norm"], r["attention"], r["seed"]): r["test_bleu"] for r in runs if r.get("test_bleu") is not None}
    out = {}
    for norm in NORMS:
        seeds = sorted(s for n, a, s in score if (n, a) == (norm, "dot") and (norm, "qknorm", s) in score)
        out[norm] = [score[norm, "qknorm", s] - score[norm, "dot", s] for s in seeds]
    return out


def spread_table(runs):
    """The seed-to-seed standard deviation at convergence beside the ten-epoch 2x2's."""
    ten = ten_epoch_runs()
    done = [r for r in runs if stopped(r)]

    def sd_of(values):
        sd = seed_sd(values)
        return (
            f"{sd:.2f} ({len(values)} seeds)" if sd is not None else f"- ({len(values)} seed{'s' * (len(values) != 1)})"
        )

    lines = [
        "Standard deviation over seeds of test BLEU (best-dev checkpoint for the converged runs):",
        "",
        "| quantity | converged | ten epochs (1,400 updates) |",
        "|---|---|---|",
    ]
    for c in CELLS:
        lines.append(
            f"| {SHORT[c]} | {sd_of([r['test_bleu'] for r in done if cell(r) == c])} "
            f"| {sd_of([r['test_bleu'] for r in ten if cell(r) == c])} |"
        )
    conv, at_ten = qknorm_minus_dot_by_seed(done), qknorm_minus_dot_by_seed(ten)
    for norm in NORMS:
        lines.append(f"| QKNorm - dot under {NORMS[norm]} | {sd_of(conv[norm])} | {sd_of(at_ten[norm])} |")
    return lines


def seeds_section(runs):
    """How large a QKNorm - dot difference n seeds resolve: from the converged runs' own spread once
    a norm has two seeds of both runs stopped, until then from the ten-epoch 2x2's."""
    converged = {n: d for n, d in qknorm_minus_dot_by_seed([r for r in runs if stopped(r)]).items() if len(d) > 1}
    if converged:
        diffs = list(converged.values())
        source = "the converged runs (" + ", ".join(f"{NORMS[n]}: {len(d)} seeds" for n, d in converged.items())
    else:
        diffs = [d for d in qknorm_minus_dot_by_seed(ten_epoch_runs()).values() if len(d) > 1]
        source = "the ten-epoch 2x2, as no norm has two converged seeds yet (3 seeds per norm"
    if not diffs:
        return "Too few seeds to estimate how seeds spread."
    # pooled over the norms: each norm's variance weighted by its degrees of freedom
    sd = (sum((len(d) - 1) * statistics.variance(d) for d in diffs) / sum(len(d) - 1 for d in diffs)) ** 0.5
    lines = [
        f"How much seeds move QKNorm - dot is taken from {source};",
        f"standard deviation {sd:.2f} test BLEU, pooled over the norms). The 95% half-width of the mean",
        "difference that n seeds per cell would give (t over seeds):",
        "",
        "| seeds per cell | 95% half-width, QKNorm - dot under one norm |",
        "|---|---|",
    ]
    for n in (2, 3, 5, 8):
        lines.append(f"| {n} | {T975[n - 1] * sd / n**0.5:.2f} BLEU |")
    lines += [
        "",
        "A difference smaller than the half-width is not resolved by that many seeds. A standard deviation",
        "estimated from few seeds is itself uncertain (its 95% interval runs from 0.52 to 6.3 times the",
        "estimate with 3 seeds, 0.45 to 32 times with 2): read the table as an order of magnitude.",
    ]
    return "\n".join(lines)


def on_cpus(cpus):
    """Where a run trained, from its record's [[updates, cpu model], ...] ("" where not recorded)."""
    return ", then ".join(f"{cpu} from {u:,} updates" if u else cpu for u, cpu in cpus)


def how_it_ran(runs):
    lines = []
    for r in runs:
        reproduced = []
        for lost in r.get("lost_curves", []):
            earlier = {p[0]: p[1] for p in lost["dev_curve"]}
            same = [(earlier[u], b) for u, b, _ in r["dev_curve"] if u in earlier]
            if same:
                exact = sum(a == b for a, b in same)
                worst = max(abs(a - b) for a, b in same)
                where = on_cpus(lost.get("cpus", []))
                reproduced.append(
                    f"{exact} of {len(same)} validations measured twice agree exactly (largest difference {worst:.2f})"
                    + (f", the earlier on {where}" if where else "")
                )
        resumed = [f"{u:,}" for u in r.get("resumed_at_updates", [])]
        resumed = " and ".join([", ".join(resumed[:-1]), resumed[-1]] if len(resumed) > 1 else resumed)
        lost = len(r.get("lost_curves", []))
        restarts = sum(c.get("note", "").startswith("checkpoints lost") for c in r.get("lost_curves", []))
        lines.append(
            f"- {SHORT[cell(r)]}, seed {r['seed']}: commit {r['commit']}, {r['threads']} thread(s), "
            + (f"on {on_cpus(r['cpus'])}, " if r.get("cpus") else "")
            + (f"resumed at {resumed} updates" if resumed else "never resumed")
            + (", with `--update-epoch-batch-itr True`" if replays(r) else "")
            + (
                f"; restarted from its first update {restarts} time(s), its checkpoints lost with a machine"
                if restarts
                else ""
            )
            + (f"; {lost} earlier partial curve(s)" if lost else "")
            + (f" ({'; '.join(reproduced)})" if reproduced else "")
            + "."
        )
    lines += [
        "",
        "Each run's fairseq-train command is in runs.json (`train_command`). The CPU is named where the"
        " record holds it (runs started or resumed after the driver began to record it), with torch's CPU"
        " kernels since they were pinned: torch's AVX2 and AVX512 kernels round differently, on CPUs of one"
        " model name too, so a validation measured twice is expected to agree exactly only under the same"
        " kernels and, in a run trained without `--update-epoch-batch-itr True`, without a resume between,"
        " which changes how fairseq groups the batches; with it (the runs that say so above), a resume"
        " replays the run bit for bit. The recipe runs torch's AVX2 kernels on every machine"
        " (`ATEN_CPU_CAPABILITY=avx2`), so that a run restarted on another machine repeats its curve"
        " ([examples/interrupt/RESULTS.md](../../interrupt/RESULTS.md#across-machines-torchs-cpu-kernels)). Until the"
        " plugin fixed it ([docs/changes.md](../../../docs/changes.md)), fairseq's `reduce_lr_on_plateau`"
        " forgot at every resume its count of validations without a better dev BLEU and the step of the"
        " checkpoint's own validation: a run resumed after warm-up under it may have lowered its rate later than the"
        " same run uninterrupted. The seed-1 runs' resumes all came before the fix. Seed 2's ScaleNorm runs"
        " moved to it at 2,720 (QKNorm) and 2,992 (dot) updates of curves since lost with their machine, each"
        " resumed from a validation better than its best before, after which the count is zero whatever it"
        " was: nothing was lost there. Their current curves started under the fix, with"
        " `--update-epoch-batch-itr True` and the AVX2 kernels pinned: two of their earlier partial curves"
        " were stopped to restart them, one (1,360 updates each) for the flag, one for the kernels"
        " (the note in runs.json), so that a resume, and a restart on any machine, replays them.",
    ]
    return "\n".join(lines)


def status(runs):
    """How many of the seeds' four runs have stopped, each run's state, the cells not started."""
    done = sum(map(stopped, runs))
    seeds = sorted({r["seed"] for r in runs})
    recorded = {(r["norm"], r["attention"], r["seed"]) for r in runs}
    parts = [f"{SHORT[cell(r)]} seed {r['seed']}: {r['stop_reason']} at {r['updates']:,} updates" for r in runs]
    parts += [f"{SHORT[c]} seed {s}: not started" for s in seeds for c in CELLS if (*c, s) not in recorded]
    return f"{done} of {len(CELLS) * len(seeds)} runs stopped ({'; '.join(parts)})."


def answer(runs):
    """The question's answer in one paragraph, or why there is none yet."""
    by_seed = qknorm_minus_dot_by_seed([r for r in runs if stopped(r)])
    said = []
    for norm in ("layernorm", "scalenorm"):
        diffs = by_seed[norm]
        if diffs:
            seeds = stopped_seeds(runs, ((norm, "dot"), (norm, "qknorm")))
            dot, qk = (
                statistics.mean(r["test_bleu"] for r in runs if (*cell(r), r["seed"]) in {(norm, a, s) for s in seeds})
                for a in ("dot", "qknorm")
            )
            said.append(
                f"Under {NORMS[norm]}, converged ({len(diffs)} seed{'s' * (len(diffs) > 1)}): QKNorm {qk:.2f} against "
                f"scaled dot {dot:.2f} test BLEU ({statistics.mean(diffs):+.2f}"
                + (f"; per seed {', '.join(f'{d:+.2f}' for d in diffs)}" if len(diffs) > 1 else "")
                + ")."
            )
    if not said:
        return (
            "No answer yet: no norm has both of its runs stopped. The curves below show where the runs stand;"
            " their difference is not a result until the rule stops them."
        )
    return (
        " ".join(said)
        + " Intervals that count the seeds as well as the test sentences: [Over seeds](#over-seeds); how many"
        " seeds would resolve what: [How many seeds](#how-many-seeds)."
    )


def write_report(records, data_dir):
    """README.md and dev-curves.png in RECORDS; DATA_DIR holds test.en (checked by sha1)."""
    runs = read_runs(records)  # in the 2x2's order: write_runs keeps runs.json so
    if not runs:
        fail(f"{records}/runs.json: no runs recorded yet")
    ref_path = os.path.join(data_dir, f"test.{TGT}")
    if not os.path.exists(ref_path):
        fail(f"--data {data_dir}: no test.{TGT}")
    ref_sha1 = sha1(ref_path)
    if ref_sha1 != runs[0]["data_sha1"][f"test.{TGT}"]:
        fail(f"--data {data_dir}: test.{TGT} is not the reference the runs were scored against (sha1 differs)")
    ref = read_lines(ref_path, "--data")
    done = [r for r in runs if stopped(r)]
    stats = test_statistics(records, ref, done)
    ten_stats = ten_epoch_statistics(ref, ref_sha1, {r["seed"] for r in done})
    patience, max_update = runs[0]["patience"], runs[0]["max_update"]
    # updates per epoch and per validation, from the longest curve (the records keep no settings)
    longest = max(runs, key=lambda r: r["epochs"])
    epoch_updates = longest["updates"] / longest["epochs"] if longest["epochs"] else None
    # fairseq-train saves (and the driver validates) every --save-interval epochs
    valid_epochs = int(re.search(r"--save-interval (\d+)", runs[0]["train_command"]).group(1))
    with open(os.path.join(HERE, "gl_en_2x2_converged_report.md"), encoding="utf-8") as f:
        template = Template(f.read())
    figure(os.path.join(records, "dev-curves.png"), runs)
    text = template.substitute(
        status=status(runs),
        answer=answer(runs),
        difference_summary=difference_summary(runs),
        smooth=SMOOTH,
        run_table=run_table(runs),
        effects=effects_section(runs, stats, ten_stats),
        beside_table=beside_table(runs),
        valid_epochs=valid_epochs,
        updates_per_validation=f"{round(valid_epochs * epoch_updates):,}" if epoch_updates else "?",
        patience=patience,
        patience_epochs=patience * valid_epochs,
        max_update=f"{max_update:,}",
        cap_epochs=round(max_update / epoch_updates) if epoch_updates else "?",
        cap_factor=round(max_update / TEN_EPOCH_UPDATES),
        epochs_to_plateau=epochs_to_plateau(runs),
        over_seeds=over_seeds_section(runs, stats),
        seeds=seeds_section(runs),
        how_it_ran=how_it_ran(runs),
    )
    write_text(os.path.join(records, "README.md"), text)
