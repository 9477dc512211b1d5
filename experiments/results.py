"""Results of the recipes (examples/): one file per run, one table for everything finished.

    python -m experiments.results pair WORK RUN --pair P --preset X --seeds 1 2 --arms baseline qknorm
        reads WORK/RUN/seed{S}/score.{13a,none}.json (fairseq-qknorm-score --json, one system per arm)
        and, next to each system's hypotheses, train.log, train_seconds and inspect.txt;
        writes WORK/RUN/results.json and results.md
    python -m experiments.results table [DIR ...]
        finds every results.json under DIR (default: work/) and prints one Markdown table, the main
        comparisons next to the paper's numbers, the ablations after them

BLEU is reported twice: `--tokenize none` on the Moses-tokenized references is the paper's
tokenized BLEU (the comparable number); sacrebleu's default 13a is what its signature says.
"""

import argparse
import glob
import json
import os
import re
import statistics

from experiments.fairseq_logs import parse_train_log
from experiments.gl_en_2x2_records import CELLS, read_runs, stopped
from fairseq_qknorm_cli.files import fail, write_text

# Henry et al. (2020), Table 1: tokenized BLEU of the baseline (Transformers without Tears) and QKNorm.
PAPER_BLEU = {
    "en-vi": (32.79, 33.24),
    "ar-en": (36.09, 36.75),
    "en-he": (28.28, 28.96),
    "gl-en": (22.01, 24.21),
    "sk-en": (32.58, 33.23),
}
TOKENIZATIONS = ("none", "13a")


def _read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        fail(f"missing {path} (has that step finished?)")
    except json.JSONDecodeError as e:
        fail(f"{path}: not valid JSON ({e.msg} at line {e.lineno})")


def _is_training(command):
    """A fairseq-train command line, alone or under torchrun (the recipes' NPROC > 1)."""
    return command.startswith("fairseq-train ") or (command.startswith("torchrun ") and " fairseq-train " in command)


def train_command(commands, arm_dir):
    return next((c for c in reversed(commands) if _is_training(c) and f"{arm_dir}/checkpoints.tmp" in c), None)


def read_commands(path):
    """WORK/commands.sh without repeats; of several trainings into one --save-dir (an interrupted
    try, then the one that finished) only the last is kept, in its place."""
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip()]
    key = [re.search(r"--save-dir (\S+)", c).group(1) if _is_training(c) and "--save-dir" in c else c for c in lines]
    last = {k: i for i, k in enumerate(key)}
    return [c for i, (c, k) in enumerate(zip(lines, key)) if last[k] == i]


def gather_pair(work, run, pair, preset, seeds, arms):
    commands = read_commands(os.path.join(work, "commands.sh"))
    result = {"pair": pair, "preset": preset, "run": run, "arms": arms, "seeds": {}, "signatures": {}}
    for seed in seeds:
        scores = {tok: _read_json(os.path.join(work, run, f"seed{seed}", f"score.{tok}.json")) for tok in TOKENIZATIONS}
        if [len(s["systems"]) for s in scores.values()] != [len(arms)] * len(TOKENIZATIONS):
            fail(f"{work}/{run}/seed{seed}: the scores hold a different number of systems than --arms {' '.join(arms)}")
        per_arm = {}
        for i, arm in enumerate(arms):
            arm_dir = os.path.dirname(scores["none"]["systems"][i]["path"])  # the arm's test.hyp
            entry = {
                "bleu": scores["none"]["systems"][i]["bleu"],
                "bleu_13a": scores["13a"]["systems"][i]["bleu"],
                "chrf": scores["13a"]["systems"][i]["chrf"],
                "ci": scores["none"]["systems"][i].get("ci", {}).get("bleu"),
                "p_value": scores["none"]["systems"][i].get("p_value", {}).get("bleu"),
                "p_value_13a": scores["13a"]["systems"][i].get("p_value", {}).get("bleu"),
                "p_value_chrf": scores["13a"]["systems"][i].get("p_value", {}).get("chrf"),
                "hypotheses": scores["none"]["systems"][i]["path"],
                "train_seconds": None,
                "train_command": train_command(commands, arm_dir),
            }
            if os.path.isfile(os.path.join(arm_dir, "train_seconds")):
                with open(os.path.join(arm_dir, "train_seconds")) as f:
                    entry["train_seconds"] = int(f.read().strip())
            if os.path.isfile(os.path.join(arm_dir, "train.log")):
                entry.update(parse_train_log(os.path.join(arm_dir, "train.log")))
            if os.path.isfile(os.path.join(arm_dir, "inspect.txt")):
                with open(os.path.join(arm_dir, "inspect.txt"), encoding="utf-8") as f:
                    entry["inspect"] = f.read()
            per_arm[arm] = entry
        result["seeds"][str(seed)] = per_arm
        result["signatures"] = {
            "bleu (paper-comparable)": scores["none"]["signatures"]["bleu"],
            "bleu": scores["13a"]["signatures"]["bleu"],
            "chrf": scores["13a"]["signatures"]["chrf"],
        }
        result["bootstrap"] = {"resamples": scores["none"].get("bootstrap"), "seed": scores["none"].get("seed")}
    result["mean"] = {
        arm: {
            key: statistics.mean(result["seeds"][str(s)][arm][key] for s in seeds)
            for key in ("bleu", "bleu_13a", "chrf")
        }
        for arm in arms
    }
    result["commands"] = commands
    return result


def _fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def _duration(seconds):
    return (
        "-"
        if seconds is None
        else f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
        if seconds >= 3600
        else f"{seconds // 60}m{seconds % 60:02d}s"
    )


def format_pair(result):
    arms, first = result["arms"], result["arms"][0]
    lines = [
        f"# {result['pair']}: {', '.join(arms)} (preset {result['preset']}, run {result['run']})",
        "",
        "| seed | system | BLEU | 95% CI | Δ | p | BLEU 13a | chrF | best dev BLEU | updates | train time | params |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for seed, per_arm in result["seeds"].items():
        for arm in arms:
            e = per_arm[arm]
            ci = "-" if not e["ci"] else f"{e['ci']['mean']:.2f} ± {e['ci']['halfwidth']:.2f}"
            delta = "" if arm == first else f"{e['bleu'] - per_arm[first]['bleu']:+.2f}"
            lines.append(
                f"| {seed} | {arm} | {e['bleu']:.2f} | {ci} | {delta} | {_fmt(e['p_value'], '.4f') if arm != first else ''} "
                f"| {e['bleu_13a']:.2f} | {e['chrf']:.2f} | {_fmt(e.get('best_dev_bleu'))} | {_fmt(e.get('updates'), 'd')} "
                f"| {_duration(e['train_seconds'])} | {_fmt(e.get('params'), ',')} |"
            )
    if len(result["seeds"]) > 1:
        for arm in arms:
            m = result["mean"][arm]
            lines.append(
                f"| mean | {arm} | {m['bleu']:.2f} | | {'' if arm == first else format(m['bleu'] - result['mean'][first]['bleu'], '+.2f')} "
                f"| | {m['bleu_13a']:.2f} | {m['chrf']:.2f} | | | | |"
            )
    lines += [
        "",
        f"BLEU: tokenized BLEU as in the paper (sacrebleu `--tokenize none` on the text as released, Moses-tokenized for TED and IWSLT); "
        f"p: paired bootstrap ({result['bootstrap']['resamples']} resamples) against {first}; 95% CI: bootstrap mean ± half-width.",
        "",
        "Signatures:",
        "",
    ]
    lines += [f"- {k}: `{v}`" for k, v in result["signatures"].items()]
    lines += ["", "Training (dev BLEU at each validation, as `--eval-bleu` reports it: updates: BLEU):", ""]
    for seed, per_arm in result["seeds"].items():
        for arm in arms:
            e = per_arm[arm]
            curve = ", ".join(f"{u}: {b:.2f}" for u, b in e.get("dev_bleu") or [])
            lines.append(f"- {arm} seed {seed}: {curve or '-'}; ended: {e.get('stopped_by') or 'update budget'}")
    inspected = [
        (seed, arm, e["inspect"])
        for seed, per_arm in result["seeds"].items()
        for arm, e in per_arm.items()
        if e.get("inspect")
    ]
    for seed, arm, text in inspected:
        lines += ["", f"QK inspection, {arm} seed {seed}:", "", "```", text.rstrip(), "```"]
    lines += ["", "Commands (in order):", "", "```sh", *result["commands"], "```", ""]
    return "\n".join(lines)


def pair_main(args):
    result = gather_pair(os.path.abspath(args.work), args.run, args.pair, args.preset, args.seeds, args.arms)
    out = os.path.join(args.work, args.run)
    write_text(os.path.join(out, "results.json"), json.dumps(result, indent=2) + "\n")
    write_text(os.path.join(out, "results.md"), format_pair(result))


def format_table(results):
    main = [r for r in results if r["run"] == "main"]
    ablations = [r for r in results if r["run"] != "main"]
    lines = []
    if main:
        lines += [
            "| pair | preset | seeds | baseline BLEU | QKNorm BLEU | Δ | p (first seed) | chrF base → QK | paper baseline | paper QKNorm | paper Δ |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sorted(main, key=lambda r: (r["pair"], r["preset"])):
            base, qk = r["arms"][0], r["arms"][1]
            m = r["mean"]
            p = next(iter(r["seeds"].values()))[qk]["p_value"]
            paper = PAPER_BLEU.get(r["pair"])
            paper_cols = f"{paper[0]:.2f} | {paper[1]:.2f} | {paper[1] - paper[0]:+.2f}" if paper else "- | - | -"
            lines.append(
                f"| {r['pair']} | {r['preset']} | {len(r['seeds'])} | {m[base]['bleu']:.2f} | {m[qk]['bleu']:.2f} "
                f"| {m[qk]['bleu'] - m[base]['bleu']:+.2f} | {_fmt(p, '.4f')} | {m[base]['chrf']:.1f} → {m[qk]['chrf']:.1f} | {paper_cols} |"
            )
    if ablations:
        lines += [
            "",
            "| pair | preset | ablation | system | seeds | BLEU | Δ vs first | p (first seed) | chrF |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sorted(ablations, key=lambda r: (r["pair"], r["preset"], r["run"])):
            first = r["arms"][0]
            for arm in r["arms"]:
                m = r["mean"][arm]
                p = next(iter(r["seeds"].values()))[arm]["p_value"]
                delta = "" if arm == first else f"{m['bleu'] - r['mean'][first]['bleu']:+.2f}"
                lines.append(
                    f"| {r['pair']} | {r['preset']} | {r['run']} | {arm} | {len(r['seeds'])} | {m['bleu']:.2f} | {delta} "
                    f"| {_fmt(p, '.4f') if arm != first else ''} | {m['chrf']:.1f} |"
                )
    if lines:
        lines += [
            "",
            "BLEU: tokenized BLEU (sacrebleu `--tokenize none` on the text as released, Moses-tokenized for TED and IWSLT), as the paper reports; "
            "mean over seeds; p: paired bootstrap against the first system. Per-run details: each results.md.",
        ]
    return "\n".join(lines)


# The committed records of the TED gl-en 2x2 (examples/ted/gl-en-2x2/run.sh) and of the same 2x2 trained
# to convergence (examples/ted/gl-en-2x2-converged/run.sh), shown with every table.
TWO_BY_TWO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "ted", "gl-en-2x2")
CONVERGED = TWO_BY_TWO + "-converged"


def format_two_by_two(runs):
    """The 2x2's cells, mean test BLEU and chrF over the seeds recorded so far."""
    lines = ["| TED gl-en 2x2 at ten epochs (1,400 updates), cpu preset | seeds | BLEU | chrF |", "|---|---|---|---|"]
    for norm, attention in CELLS:
        rs = [r for r in runs if (r["norm"], r["attention"]) == (norm, attention)]
        if rs:
            lines.append(
                f"| {norm} + {attention} | {len(rs)} | {statistics.mean(r['test_bleu'] for r in rs):.2f} "
                f"| {statistics.mean(r['test_chrf'] for r in rs):.1f} |"
            )
    return lines + [
        "",
        "The effects with their intervals, training curves and learned g: examples/ted/gl-en-2x2/README.md.",
    ]


def format_converged(runs):
    """The converged 2x2's cells: test BLEU and chrF at the best-dev checkpoint of the runs the
    stopping rule has stopped, mean over their seeds; where it has stopped none, how far the runs
    still training have come."""
    lines = [
        "| TED gl-en 2x2 to convergence, cpu preset | seeds stopped | BLEU | chrF | updates | best dev BLEU |",
        "|---|---|---|---|---|---|",
    ]
    for norm, attention in CELLS:
        rs = [r for r in runs if (r["norm"], r["attention"]) == (norm, attention)]
        done = [r for r in rs if stopped(r)]
        shown = done or rs
        updates = ", ".join(f"{r['updates']:,} ({r['stop_reason']})" for r in shown) or "not started"
        best = [max((b for _, b, _ in r["dev_curve"]), default=None) for r in shown]
        if done:
            bleu = f"{statistics.mean(r['test_bleu'] for r in done):.2f}"
            chrf = f"{statistics.mean(r['test_chrf'] for r in done):.1f}"
        else:
            bleu = chrf = "-"
        lines.append(
            f"| {norm} + {attention} | {len(done)} | {bleu} | {chrf} | {updates} | {', '.join(_fmt(b) for b in best) or '-'} |"
        )
    return lines + [
        "",
        "BLEU, chrF: test, at each stopped run's best-dev checkpoint, mean over the stopped seeds; runs still "
        "training show only their dev BLEU so far. Differences with their intervals, dev curves and the "
        "stopping rule: examples/ted/gl-en-2x2-converged/README.md.",
    ]


def table_main(args):
    paths = sorted({p for d in args.dirs for p in glob.glob(os.path.join(d, "**", "results.json"), recursive=True)})
    two_by_two = os.path.join(TWO_BY_TWO, "runs.json")
    converged = os.path.join(CONVERGED, "runs.json")
    if not paths and not os.path.exists(two_by_two):
        fail(f"no results.json under {', '.join(args.dirs)} (run examples/ted/run.sh first)")
    lines = [format_table([_read_json(p) for p in paths])] if paths else []
    if os.path.exists(two_by_two):
        lines += ["", *format_two_by_two(read_runs(TWO_BY_TWO))]
    if os.path.exists(converged):
        lines += ["", *format_converged(read_runs(CONVERGED))]
    print("\n".join(lines).strip("\n"))


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m experiments.results",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pair", help="write WORK/RUN/results.{json,md} for one finished run")
    p.add_argument("work")
    p.add_argument("run")
    p.add_argument("--pair", required=True)
    p.add_argument("--preset", required=True)
    p.add_argument("--seeds", nargs="+", required=True)
    p.add_argument("--arms", nargs="+", required=True, help="system names; the first is the reference of the tests")
    p.set_defaults(func=pair_main)
    t = sub.add_parser("table", help="one table of every results.json under the given directories")
    t.add_argument("dirs", nargs="*", default=["work"])
    t.set_defaults(func=table_main)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
