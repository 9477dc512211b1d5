"""The gl-en 2x2 on one GPU in one timed command: how many seeds, how many updates, and what came out.

    python -m experiments.gpu_budget seeds [--cores N] [--max-seeds M] [--time-limit SECONDS]
        prints the seeds to run side by side ("1 2 3"): one training process per core, four cells
        a seed, two cores left for the rest, and a seed per 1,200 s of the call's time limit
    python -m experiments.gpu_budget size PROBE_DIR... --deadline EPOCH_SECONDS --out BUDGET_JSON
        reads the probe (every run trained side by side for a few updates, validated once, then
        translated the test set and was recorded) and prints "MAX_UPDATE MAX_EPOCH VALID_EPOCHS
        WARMUP STOP_HOURS TRAIN_UNTIL": the most whole epochs that every run trains by TRAIN_UNTIL
        (epoch seconds), validated at most --dev-points times, TRAIN_UNTIL leaving before --deadline
        the time that translating and recording took in the probe; writes what it measured to
        BUDGET_JSON
    python -m experiments.gpu_budget summary RECORDS --budget BUDGET_JSON --logs LOGS
        prints the 2x2 table of RECORDS/runs.json (mean and sd over seeds) with the budget and whether
        the runs converged, and writes it to RECORDS/summary.md

The probe's numbers come from fairseq-train's own log: updates per second (`ups`, each interval
after the first, whose time includes the first batches' setup), updates per epoch (`N / E`), and the
seconds from `begin validation` to the `valid` line plus the checkpoint's `writing took`. What the
probe's wall time (DIR/train_seconds) holds beyond those is start-up and shut-down, the same for
every run whatever its length. DIR/end_seconds is the time from the end of training to the record:
the test set translated with a barely trained model, whose hypotheses tend to run to the length
limit, so an upper bound for the trained ones.
"""

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
from datetime import datetime

from experiments.fairseq_logs import parse_train_log, parse_valid_line
from experiments.gl_en_2x2_records import CELLS, read_runs
from experiments.gl_en_2x2_report import cell_table
from fairseq_qknorm_cli.files import fail, write_text

INNER = re.compile(r"epoch \d+:\s+\d+ / (\d+) .*\bups=([\d.]+)")
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) ")
WRITE = re.compile(r"writing took ([\d.]+) seconds")


# Runs side by side share the GPU and the cores. Measured on an H200 with 16 cores: 8 runs beside six
# fp16-sweep processes trained 1.9 updates/s each, and their probe (start, 100 updates, one
# validation, the test set) did not end in 190 s. So a seed more for every SECONDS_PER_SEED of the
# time limit, as far as the cores go.
SECONDS_PER_SEED = 1200


def seeds(cores, max_seeds, time_limit=None):
    n = min(max_seeds, (cores - 2) // len(CELLS))
    if time_limit is not None:
        n = min(n, time_limit // SECONDS_PER_SEED)
    return list(range(1, max(1, n) + 1))


def _stamp(line):
    m = STAMP.match(line)
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() if m else None


def read_probe(run_dir):
    """What one probe run measured: rate (updates/s), updates per epoch, seconds per validation
    (with its checkpoint), its updates and wall seconds, and the seconds from the end of training
    to the record."""
    log_path = os.path.join(run_dir, "train.log")
    seconds_path = os.path.join(run_dir, "train_seconds")
    end_path = os.path.join(run_dir, "end_seconds")
    for path in (log_path, seconds_path):
        if not os.path.isfile(path):
            fail(f"{path}: missing (did the probe's fairseq-train finish?)")
    if not os.path.isfile(end_path):
        fail(f"{end_path}: missing (was the probe's run translated and recorded?)")
    ups, per_epoch, validations, writes, begin = [], None, [], [], None
    with open(log_path, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = INNER.search(line)
            if m:
                per_epoch, rate = int(m.group(1)), float(m.group(2))
                ups.append(rate)
            elif 'begin validation on "valid" subset' in line:
                begin = _stamp(line)
            elif parse_valid_line(line) and begin is not None and _stamp(line) is not None:
                validations.append(_stamp(line) - begin + 1)  # whole seconds in the log: at most 1 s more
                begin = None
            m = WRITE.search(line)
            if m:
                writes.append(float(m.group(1)))
    if len(ups) < 2 or min(ups[1:]) <= 0:
        fail(f"{log_path}: fewer than two train_inner lines with ups= (probe too short for --log-interval?)")
    if not validations:
        fail(f"{log_path}: no validation with BLEU (the probe validates once, at its end)")
    rate = len(ups[1:]) / sum(1 / u for u in ups[1:])  # equal intervals of updates: the harmonic mean
    updates = parse_train_log(log_path)["updates"]
    with open(seconds_path) as f:
        seconds = int(f.read())
    with open(end_path) as f:
        end = int(f.read())
    validation = statistics.mean(validations) + (statistics.mean(writes) if writes else 0.0)
    fixed = max(0.0, seconds - updates / rate - len(validations) * validation)
    return {
        "dir": os.path.basename(os.path.normpath(run_dir)),
        "updates": updates,
        "seconds": seconds,
        "ups": ups,
        "rate": round(rate, 3),
        "updates_per_epoch": per_epoch,
        "validation_seconds": round(validation, 2),
        "fixed_seconds": round(fixed, 1),
        "end_seconds": end,
    }


def plan(updates_per_epoch, rate, validation, fixed, available, dev_points, max_epochs=None, safety=0.9):
    """(epochs, validate every N epochs): the most whole epochs whose training, validations and
    fixed costs fit in `available` seconds (a `safety` share of it), validated at most `dev_points`
    times when that leaves at least one epoch per validation; None when not one epoch fits."""
    best = None
    for every in range(1, 10_000):
        period = every * updates_per_epoch / rate + validation
        periods = int(((available - fixed) * safety) // period) if available > fixed else 0
        if max_epochs:
            periods = min(periods, max_epochs // every)
        if periods < 1:
            break
        best = (periods * every, every)
        if periods <= dev_points:
            break
    return best


def size(args):
    probes = [read_probe(d) for d in args.probe_dirs]
    rate = min(p["rate"] for p in probes)  # every run gets the same updates: the slowest sets them
    per_epoch = min(p["updates_per_epoch"] for p in probes)
    validation = max(p["validation_seconds"] for p in probes)
    fixed = max(p["fixed_seconds"] for p in probes)
    end = args.end_seconds if args.end_seconds is not None else max(p["end_seconds"] for p in probes)
    end_reserve = math.ceil(end / args.safety)
    train_until = math.floor(args.deadline - end_reserve)
    now = time.time()
    available = train_until - now
    chosen = plan(per_epoch, rate, validation, fixed, available, args.dev_points, args.max_epochs, args.safety)
    if chosen is None:
        fail(
            f"{available:.0f} s left for training: not enough for one epoch ({per_epoch} updates at "
            f"{rate:.2f}/s, {fixed:.0f} s start-up, {validation:.0f} s per validation; {end_reserve} s "
            f"kept after it to translate and record)"
        )
    epochs, every = chosen
    updates = epochs * per_epoch
    warmup = max(1, round(args.warmup_share * updates))
    # fairseq's --stop-time-hours counts from its trainer's start, after most of the start-up, and
    # validates once more when it stops: a safety net that ends training by TRAIN_UNTIL.
    stop_hours = round(max(available - fixed - validation, available / 2) / 3600, 4)
    budget = {
        "runs_side_by_side": len(probes),
        "probe": probes,
        "rate_updates_per_second": rate,
        "updates_per_epoch": per_epoch,
        "validation_seconds": validation,
        "fixed_seconds": fixed,
        "end_seconds": end,
        "end_reserve_seconds": end_reserve,
        "available_seconds": round(available),
        "epochs": epochs,
        "updates": updates,
        "validate_every_epochs": every,
        "dev_points": epochs // every,
        "warmup_updates": warmup,
        "stop_time_hours": stop_hours,
        "estimated_seconds": round(fixed + updates / rate + epochs // every * validation),
        "train_until": train_until,
    }
    write_text(args.out, json.dumps(budget, indent=1) + "\n")
    print(
        f"| budget: {epochs} epochs ({updates} updates) per run, validated every {every} epoch(s), warm-up "
        f"{warmup}; measured {rate:.2f} updates/s per run with {len(probes)} side by side, {validation:.0f} s per "
        f"validation, {fixed:.0f} s start-up: about {budget['estimated_seconds']} of {available:.0f} s left for "
        f"training; then {end_reserve} s to translate and record ({end} s in the probe)",
        file=sys.stderr,
    )
    print(updates, epochs, every, warmup, stop_hours, train_until)


def run_status(run, logs):
    """Why a run stopped, and whether its dev BLEU was still rising at its last validation."""
    log = os.path.join(logs, f"{run['norm']}-{run['attention']}-seed{run['seed']}.train.log")
    stopped_by = parse_train_log(log)["stopped_by"] if os.path.isfile(log) else None
    dev = [b for _, _, b in run["dev"]]
    rising = bool(dev) and dev[-1] >= max(dev)
    if not stopped_by or "max_update" in stopped_by:  # --max-epoch ends training without a word
        why = "the budget (--max-epoch, --max-update)"
    elif "learning rate" in stopped_by:
        why = "the paper's stop (the learning rate fell below its stop rate)"
    else:
        why = f"cut short ({stopped_by})"
    return why, rising


def summary(args):
    runs = read_runs(args.records)
    if not runs:
        fail(f"{args.records}/runs.json: no runs recorded")
    with open(args.budget, encoding="utf-8") as f:
        budget = json.load(f)
    lines = [
        "# gl-en 2x2 at the paper's size, one GPU",
        "",
        f"Budget: {budget['epochs']} epochs ({budget['updates']} updates) per run, "
        f"{budget['runs_side_by_side']} runs side by side, validated every {budget['validate_every_epochs']} "
        f"epoch(s); warm-up {budget['warmup_updates']} updates. Measured by the probe: "
        f"{budget['rate_updates_per_second']:.2f} updates/s per run (the slowest cell), "
        f"{budget['validation_seconds']:.0f} s per validation, {budget['fixed_seconds']:.0f} s start-up, "
        f"{budget['end_seconds']:.0f} s from the end of training to the record.",
        "",
        *cell_table(runs),
        "",
    ]
    means = {}
    for norm, attention in CELLS:
        bleu = [r["test_bleu"] for r in runs if (r["norm"], r["attention"]) == (norm, attention)]
        means[norm, attention] = statistics.mean(bleu) if bleu else None
    if None not in means.values():
        for norm in ("scalenorm", "layernorm"):
            lines.append(
                f"- QKNorm minus scaled dot product under {norm}: "
                f"{means[norm, 'qknorm'] - means[norm, 'dot']:+.2f} test BLEU (difference of means)"
            )
        for attention in ("dot", "qknorm"):
            lines.append(
                f"- LayerNorm minus ScaleNorm with {attention}: "
                f"{means['layernorm', attention] - means['scalenorm', attention]:+.2f} test BLEU"
            )
    statuses = [run_status(r, args.logs) for r in runs]
    reasons = sorted({why for why, _ in statuses})
    rising = sum(1 for _, r in statuses if r)
    lines += [
        "",
        f"Stopped by: {'; '.join(reasons)}. Dev BLEU was at its best at the last validation in "
        f"{rising} of {len(runs)} runs" + (" (still rising: not converged)." if rising else "."),
    ]
    by_budget = [r for r, (why, _) in zip(runs, statuses) if why.startswith("the budget")]
    short = [r["updates"] for r in by_budget if r["updates"] < budget["updates"]]
    if short:
        lines.append(
            f"{len(short)} of {len(runs)} runs made fewer updates than the budget's {budget['updates']} "
            f"(at least {min(short)}): fp16 updates skipped for a gradient overflow use a batch without "
            "counting, so every run trained the budget's epochs."
        )
    text = "\n".join(lines) + "\n"
    write_text(os.path.join(args.records, "summary.md"), text)
    print(text, end="")


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m experiments.gpu_budget",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("seeds")
    s.add_argument("--cores", type=int, default=os.cpu_count())
    s.add_argument("--max-seeds", type=int, default=3)
    s.add_argument("--time-limit", type=int, help="seconds for the whole call: a seed per %d" % SECONDS_PER_SEED)
    z = sub.add_parser("size")
    z.add_argument("probe_dirs", nargs="+", metavar="PROBE_DIR")
    z.add_argument(
        "--deadline", type=float, required=True, help="epoch seconds by which every run must be translated and recorded"
    )
    z.add_argument(
        "--end-seconds",
        type=int,
        help="seconds from the end of training to the record (default: the longest the probe measured)",
    )
    z.add_argument("--out", required=True, help="where to write what was measured and chosen (JSON)")
    z.add_argument("--dev-points", type=int, default=4, help="at most this many validations per run (default 4)")
    z.add_argument("--max-epochs", type=int, help="never more epochs than this")
    z.add_argument("--warmup-share", type=float, default=0.25, help="warm-up updates as a share of the budget")
    z.add_argument("--safety", type=float, default=0.9, help="share of the time left that is planned (default 0.9)")
    m = sub.add_parser("summary")
    m.add_argument("records")
    m.add_argument("--budget", required=True)
    m.add_argument("--logs", required=True)
    args = parser.parse_args(argv)
    if args.command == "seeds":
        if args.cores < 1 or args.max_seeds < 1 or (args.time_limit is not None and args.time_limit < 1):
            parser.error("--cores, --max-seeds and --time-limit: expected positive numbers")
        print(*seeds(args.cores, args.max_seeds, args.time_limit))
    elif args.command == "size":
        if args.dev_points < 1 or (args.max_epochs is not None and args.max_epochs < 1):
            parser.error("--dev-points and --max-epochs: expected positive numbers")
        if args.end_seconds is not None and args.end_seconds < 0:
            parser.error("--end-seconds: expected a number of seconds")
        if not 0 < args.warmup_share < 1 or not 0 < args.safety <= 1:
            parser.error("--warmup-share: expected a share between 0 and 1; --safety: between 0 and 1")
        size(args)
    else:
        if not os.path.isfile(args.budget):
            fail(f"--budget {args.budget}: no such file")
        summary(args)


if __name__ == "__main__":
    main()
