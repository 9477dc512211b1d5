"""The learning-rate sweep engine: train every (seed, arm, peak learning rate) of a grid as real
fairseq training and record what attention does on the way. experiments/lr_sweep.py (a tiny
translation model) and experiments/lm_sweep.py (small language models) are configurations of it: a
Sweep names the task, the arms, the model every arm shares and the fixed batch its attention
statistics are taken on.

Every run is fairseq's task, model, criterion and Trainer, built in-process from fairseq-train flags
(the run's record holds the equivalent fairseq-train command, with the machine's folders written as
$WORK and $USER_DIR). Per run it records the training loss of every update (bits per token, as
fairseq logs it) and, every --stats-interval updates on one fixed batch of validation items, each
attention module's largest pre-softmax logit over real query/key pairs, its smallest per-head
entropy and, for QKNorm, the learned g.

A run counts as diverged when a loss or gradient is not finite, or when the mean loss of the last
WINDOW updates rises above the mean of the first WINDOW; it is stopped there. OUT/results.json is
kept up to date after every run: a rerun with the same settings skips the runs already there (and
with every run there, only writes the figures and tables again). Sweeps may run in several
processes into one OUT (one per arm, say): each re-reads results.json under a lock (OUT/.runs.lock)
before it starts a run and when it adds one, so none loses another's runs.
"""

import argparse
import contextlib
import fcntl
import json
import logging
import math
import shlex
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

from experiments.machine import machine
from experiments.portable import portable
from fairseq_qknorm_cli.files import atomic_path, fail, write_text
from fairseq_qknorm_cli.logs import setup_logging

WINDOW = 10  # updates averaged for the start, final and best loss and the divergence rule


@dataclass(frozen=True)
class Sweep:
    """What one sweep sets; everything else (optimizer, schedule, divergence rule, records, tables,
    figures) is the engine's and the same for every sweep."""

    name: str  # its module, experiments.NAME
    task: list  # fairseq-train's task flags
    arms: dict  # arm name -> its flags; tables and figures list the arms in this order
    model: list  # the model flags every arm shares
    criterion: list
    max_tokens: int
    stats_items: int  # the fixed batch: the first items of the validation split
    # (fixed batch, padding index) -> (where -> the real (query, key) positions of the module at where)
    real_positions: Callable
    # the command line's defaults, and what --work-dir and --out-dir hold
    lrs: list
    updates: int
    warmup_updates: int
    stats_interval: int
    threads: int
    work_dir_holds: str
    out_dir_holds: str

    def fairseq_flags(self, bin_dir, arm, lr, seed, updates, warmup, save_dir):
        """The fairseq-train flags of one run."""
        from fairseq_qknorm import USER_DIR

        return [
            str(bin_dir),
            "--user-dir",
            USER_DIR,
            *self.task,
            *self.arms[arm],
            *self.model,
            *training_flags(lr, seed, updates, warmup, save_dir, self.criterion, self.max_tokens),
        ]

    def attention_snapshot(self, model, criterion, sample):
        """attention_statistics of the model on the fixed batch `sample`."""
        return attention_statistics(model, criterion, sample, self.real_positions(sample, criterion.padding_idx))

    def log(self, message):
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} | INFO | {self.name} | {message}", flush=True)


def training_flags(lr, seed, updates, warmup, save_dir, criterion, max_tokens):
    """The fairseq-train flags every sweep run shares: Adam, a linear warm-up to the peak rate LR
    and inverse_sqrt decay, no gradient clipping (divergence is what is measured), max_tokens per
    update, on the CPU, nothing saved."""
    # fmt: off
    return [
        "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--adam-eps", "1e-8", "--weight-decay", "0.0",
        "--lr", repr(lr), "--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(warmup), "--warmup-init-lr", "0",
        "--clip-norm", "0", *criterion,
        "--max-tokens", str(max_tokens), "--required-batch-size-multiple", "1", "--max-update", str(updates),
        "--seed", str(seed), "--cpu", "--num-workers", "0", "--save-dir", str(save_dir), "--no-save",
        # No prefetching thread: a run stops mid-epoch, and a thread left filling its buffer
        # aborts the interpreter at exit ("terminate called without an active exception").
        "--data-buffer-size", "0",
    ]
    # fmt: on


# ---------------------------------------------------------------------------------------------
# Losses: the divergence rule and the summaries
# ---------------------------------------------------------------------------------------------
def window_means(losses, window=WINDOW):
    """Mean of every `window` consecutive losses (fewer at the start)."""
    return [sum(losses[max(0, i + 1 - window) : i + 1]) / (i + 1 - max(0, i + 1 - window)) for i in range(len(losses))]


def divergence(losses, window=WINDOW):
    """Why a run with these per-update losses counts as diverged, or None: a loss that is not a
    finite number (None stands for a step fairseq refused: non-finite gradients), or a mean of the
    last `window` losses above the mean of the first `window`. Batches differ in difficulty, so
    single losses are compared only through these means."""
    for i, loss in enumerate(losses):
        if loss is None or not math.isfinite(loss):
            return f"non-finite loss at update {i + 1}"
    if len(losses) >= 2 * window:
        start, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
        if last > start:
            return f"mean loss of updates {len(losses) - window + 1}-{len(losses)} ({last:.3f}) above that of the first {window} ({start:.3f})"
    return None


def loss_summary(losses, window=WINDOW):
    """start, final, best: means over `window` updates (first, last, lowest); NaN when undefined."""
    before_non_finite = []
    for loss in losses:
        if loss is None or not math.isfinite(loss):
            break
        before_non_finite.append(loss)
    means = window_means(before_non_finite, window)
    nan = float("nan")
    return {
        "start": sum(before_non_finite[:window]) / len(before_non_finite[:window]) if before_non_finite else nan,
        "final": means[-1] if before_non_finite and len(before_non_finite) == len(losses) else nan,
        "best": min(means[window - 1 :] or means) if means else nan,
    }


# ---------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------
def attention_statistics(model, criterion, sample, real_queries_and_keys):
    """On the fixed batch: its loss (bits per token) and, per attention module ("decoder cross 1"),
    the largest pre-softmax logit over real query/key pairs, the smallest per-head entropy (nats,
    averaged over the real queries of that head) and g when the module has one;
    real_queries_and_keys(where) gives the (query, key) masks of the module at where."""
    import torch

    from fairseq_qknorm.qknorm_attention import QKNormAttention
    from fairseq_qknorm_cli.attention_stats import AttentionStats, attention_module, recording_attention, sort_key

    stats = {}

    def on_attention(where, weights, logits):
        stats.setdefault(where, AttentionStats()).add(weights, logits, *real_queries_and_keys(where))

    model.eval()
    with torch.no_grad(), recording_attention(model, on_attention):
        loss, sample_size, _ = criterion(model, sample)
    g = {}
    for name, module in model.named_modules():
        where = attention_module(name)
        if where is not None and isinstance(module, QKNormAttention) and module.qk_scale is not None:
            g[f"{where[0]} {where[1]}"] = module.qk_scale.g.tolist()
    order = sorted(stats, key=sort_key)
    return {
        "loss": float(loss) / sample_size / math.log(2),
        "max_logit": {f"{w[0]} {w[1]}": stats[w].logit_max for w in order},
        "min_entropy": {f"{w[0]} {w[1]}": stats[w].min_head_entropy() for w in order},
        "g": g,
    }


class FairseqRun(NamedTuple):
    cfg: object
    task: object
    model: object
    criterion: object
    trainer: object
    epoch_itr: object
    fixed_batch: dict  # the first stats_items validation items, one batch


def build_run(flags, seed, stats_items):
    """What fairseq-train builds from these flags (task, model, criterion, Trainer, the first
    epoch's batches), with the fixed batch of the attention statistics."""
    from fairseq import options, tasks, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.logging import metrics
    from fairseq.trainer import Trainer

    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), flags))
    metrics.reset()
    utils.set_torch_seed(seed)
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    criterion = task.build_criterion(cfg.criterion)
    task.load_dataset("valid")
    dev = task.dataset("valid")
    fixed_batch = dev.collater([dev[i] for i in range(min(stats_items, len(dev)))])
    trainer = Trainer(cfg, task, model, criterion)  # with --fp16 it casts the model, in place
    return FairseqRun(cfg, task, model, criterion, trainer, trainer.get_train_iterator(epoch=1), fixed_batch)


def train_run(sweep, bin_dir, work_dir, arm, lr, seed, updates, warmup, stats_interval):
    """Train one arm at one peak learning rate; returns its record for results.json."""
    import torch
    from fairseq.logging import metrics

    from fairseq_qknorm import USER_DIR

    with tempfile.TemporaryDirectory(prefix=f"{sweep.name}_") as save_dir:  # fairseq's crash.pt, if any
        flags = sweep.fairseq_flags(bin_dir, arm, lr, seed, updates, warmup, save_dir)
        cfg, _, model, criterion, trainer, epoch_itr, fixed_batch = build_run(flags, seed, sweep.stats_items)

        command = "fairseq-train " + shlex.join(flags)
        record = {
            "arm": arm,
            "lr": lr,
            "seed": seed,
            "command": portable(command, {save_dir: "SAVE_DIR", work_dir: "$WORK", USER_DIR: "$USER_DIR"}),
            "params": sum(p.numel() for p in model.parameters()),
            # the g0 the model was built with (`auto` resolved from the data); None: no g
            "qk_scale_init": cfg.model.qk_scale_init if getattr(cfg.model, "qk_scale", "none") != "none" else None,
            "loss": [],
            "gnorm": [],
            "stats": [],
            "diverged": None,
        }

        def snapshot():
            record["stats"].append(
                {"update": len(record["loss"]), **sweep.attention_snapshot(model, criterion, fixed_batch)}
            )

        start = time.time()
        snapshot()
        while len(record["loss"]) < updates and record["diverged"] is None:
            trainer.begin_epoch(epoch_itr.next_epoch_idx)
            for sample in epoch_itr.next_epoch_itr(shuffle=True):
                try:
                    # The gradient norm is logged to the active aggregators, not returned.
                    with metrics.aggregate() as step_metrics:
                        loss = trainer.train_step([sample])["loss"]
                    gnorm = step_metrics.get_smoothed_values()["gnorm"]
                except FloatingPointError:  # fairseq's answer to non-finite gradients
                    loss, gnorm = None, None
                record["loss"].append(loss)
                record["gnorm"].append(gnorm)
                record["diverged"] = divergence(record["loss"])
                done = len(record["loss"])
                stop = record["diverged"] is not None or done >= updates
                if stop or done % stats_interval == 0:
                    # At a stop for non-finite gradients fairseq has not applied the step: this
                    # is the model just before it.
                    snapshot()
                    sweep.log(progress_line(record))
                if stop:
                    break
        if record["diverged"] is not None:
            sweep.log(f"{arm} lr {lr:g} seed {seed} | diverged, stopped: {record['diverged']}")
        record["seconds"] = round(time.time() - start, 1)
        record["torch_threads"] = torch.get_num_threads()
    return record


def progress_line(record):
    s, loss, gnorm = record["stats"][-1], record["loss"][-1], record["gnorm"][-1]
    line = (
        f"{record['arm']} lr {record['lr']:g} seed {record['seed']} | update {s['update']} | "
        f"loss {fmt(loss, '.3f')} | gnorm {fmt(gnorm, '.3f')} | fixed-batch loss {fmt(s['loss'], '.3f')} | "
        f"max logit {fmt(max(s['max_logit'].values()), '.2f')} | min entropy {fmt(min(s['min_entropy'].values()), '.3f')}"
    )
    if s["g"]:
        line += f" | g {fmt(min(s['g'].values()), '.3f')}..{fmt(max(s['g'].values()), '.3f')}"
    return line


def fmt(x, spec):
    return "nan" if x is None or not math.isfinite(x) else format(x, spec)


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------
def summarize(run):
    """One table row: losses, divergence, and the extremes of the attention statistics."""
    stats = run["stats"]
    losses = loss_summary(run["loss"])
    return {
        "arm": run["arm"],
        "lr": run["lr"],
        "seed": run["seed"],
        "updates": len(run["loss"]),
        **losses,
        "diverged": run["diverged"],
        "max_logit": max(finite(v for s in stats for v in s["max_logit"].values()), default=math.nan),
        "min_entropy": min(finite(v for s in stats for v in s["min_entropy"].values()), default=math.nan),
        "g_final": sorted(finite(stats[-1]["g"].values())) or None,
    }


def finite(values):
    """The finite numbers among values (results.json stores NaN and infinities as null)."""
    return [v for v in values if v is not None and math.isfinite(v)]


def markdown_table(runs, arms):
    """One row per run, the arms in the order of `arms`."""
    lines = [
        "| arm | peak lr | seed | updates | start loss | final loss | best loss | diverged | max logit | "
        "min entropy | final g (min..max) |",
        "|" + "---|" * 11,
    ]
    for row in sorted((summarize(r) for r in runs), key=lambda r: (list(arms).index(r["arm"]), r["lr"], r["seed"])):
        g = f"{row['g_final'][0]:.2f}..{row['g_final'][-1]:.2f}" if row["g_final"] else "-"
        lines.append(
            f"| {row['arm']} | {row['lr']:g} | {row['seed']} | {row['updates']} | {fmt(row['start'], '.3f')} | "
            f"{fmt(row['final'], '.3f')} | {fmt(row['best'], '.3f')} | {'yes' if row['diverged'] else 'no'} | "
            f"{fmt(row['max_logit'], '.2f')} | {fmt(row['min_entropy'], '.3f')} | {g} |"
        )
    return "\n".join(lines)


def seed_table(runs, arms):
    """One row per arm and learning rate over its seeds: the mean final loss and the seeds' range
    (how far one seed is from another says what a difference between arms is worth), how many seeds
    diverged, and the attention extremes over all of them."""
    rows = [summarize(r) for r in runs]
    lines = [
        "| arm | peak lr | seeds | final loss, mean (min..max) | diverged | max logit | min entropy |",
        "|" + "---|" * 7,
    ]
    for arm in arms:
        for lr in sorted({r["lr"] for r in rows if r["arm"] == arm}):
            group = [r for r in rows if r["arm"] == arm and r["lr"] == lr]
            final = finite(r["final"] for r in group)
            loss = f"{sum(final) / len(final):.3f} ({min(final):.3f}..{max(final):.3f})" if final else "nan"
            lines.append(
                f"| {arm} | {lr:g} | {len(group)} | {loss} | {sum(bool(r['diverged']) for r in group)} | "
                f"{fmt(max(finite(r['max_logit'] for r in group), default=math.nan), '.2f')} | "
                f"{fmt(min(finite(r['min_entropy'] for r in group), default=math.nan), '.3f')} |"
            )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Figures (matplotlib without pyplot: no display, no global state)
# ---------------------------------------------------------------------------------------------
def plot_against_lr(runs, arms, path, value, ylabel, title, log_y=False):
    """One line per arm (mean over seeds) of value(row) against the peak learning rate, shaded over
    the seeds' range when there are several; a diverged run is marked with an x, drawn at the top of
    the plot when its value is not a number."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.8), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    rows = [summarize(r) for r in runs]
    values = finite(value(r) for r in rows)
    top = max(values) * (1.3 if log_y else 1.05) if values else 1.0
    for i, arm in enumerate(a for a in arms if any(r["arm"] == a for r in rows)):
        color = f"C{i}"
        lrs = sorted({r["lr"] for r in rows if r["arm"] == arm})
        ys, lo, hi, x_div, y_div = [], [], [], [], []
        for lr in lrs:
            vals = [value(r) for r in rows if r["arm"] == arm and r["lr"] == lr]
            ok = finite(vals)
            ys.append(sum(ok) / len(ok) if ok else top)
            lo.append(min(ok, default=top))
            hi.append(max(ok, default=top))
            if any(r["diverged"] for r in rows if r["arm"] == arm and r["lr"] == lr):
                x_div.append(lr)
                y_div.append(ys[-1])
        ax.plot(lrs, ys, "o-", color=color, label=arm)
        if lo != hi:
            ax.fill_between(lrs, lo, hi, color=color, alpha=0.15, linewidth=0)
        ax.plot(x_div, y_div, "x", color="black", markersize=11, markeredgewidth=2)
    ax.plot([], [], "x", color="black", markersize=9, markeredgewidth=2, label="diverged (stopped there)")
    ax.set_xscale("log")
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("peak learning rate (inverse_sqrt schedule)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    with atomic_path(str(path)) as tmp:
        fig.savefig(tmp, format="png")


def write_figures(runs, arms, out_dir, updates):
    """OUT/final_loss_vs_lr.png and OUT/max_logit_vs_lr.png."""
    seeds = len({r["seed"] for r in runs})
    over_seeds = f" ({seeds} seeds: mean, shaded min..max)" if seeds > 1 else ""
    plot_against_lr(
        runs,
        arms,
        out_dir / "final_loss_vs_lr.png",
        lambda r: r["final"],
        f"training loss, mean of the last {WINDOW} updates (bits/token)",
        f"Final loss after {updates} updates vs peak learning rate{over_seeds}",
    )
    plot_against_lr(
        runs,
        arms,
        out_dir / "max_logit_vs_lr.png",
        lambda r: r["max_logit"],
        "largest pre-softmax attention logit (any module, any snapshot)",
        f"Attention logit growth vs peak learning rate{over_seeds}",
        log_y=True,
    )


def write_json(path, data):
    def clean(x):  # strict JSON: NaN and infinities become null
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    write_text(str(path), json.dumps(clean(data), indent=1, allow_nan=False) + "\n")


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def positive_float(value):
    try:
        x = float(value)
    except ValueError:
        x = float("nan")
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}")
    return x


def positive_int(value):
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return n


def argument_parser(sweep, doc):
    """The command line of experiments.NAME: the grid, run and folder flags every sweep takes, with
    the sweep's defaults; the description is the first line of doc."""
    parser = argparse.ArgumentParser(
        prog=f"python -m experiments.{sweep.name}",
        description=doc.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--lrs", nargs="+", type=positive_float, default=sweep.lrs, metavar="LR", help="peak learning rates"
    )
    arms = list(sweep.arms)
    parser.add_argument(
        "--arms", nargs="+", choices=arms, default=arms, metavar="ARM", help=f"variants: {', '.join(arms)}"
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[1], metavar="SEED")
    parser.add_argument("--updates", type=positive_int, default=sweep.updates, help="updates per run")
    parser.add_argument(
        "--warmup-updates", type=positive_int, default=sweep.warmup_updates, help="linear warm-up of inverse_sqrt"
    )
    parser.add_argument(
        "--stats-interval",
        type=positive_int,
        default=sweep.stats_interval,
        help="attention statistics every N updates (and at update 0 and the last)",
    )
    parser.add_argument("--threads", type=positive_int, default=sweep.threads, help="torch CPU threads")
    parser.add_argument("--work-dir", type=Path, required=True, help=sweep.work_dir_holds)
    parser.add_argument("--out-dir", type=Path, required=True, help=sweep.out_dir_holds)
    return parser


def parse_args(parser, argv):
    """parser's arguments, with the errors that argparse cannot see alone as its one-line usage
    errors."""
    args = parser.parse_args(argv)
    if args.warmup_updates > args.updates:
        parser.error(f"--warmup-updates {args.warmup_updates} exceeds --updates {args.updates}")
    for flag, path in (("--work-dir", args.work_dir), ("--out-dir", args.out_dir)):
        if path.exists() and not path.is_dir():
            parser.error(f"{flag} {path}: exists and is not a directory")
    return args


def finished_runs(results_path, settings):
    """The runs of an earlier sweep into the same results.json; it must have had the same settings
    (a sweep is one table: runs of other lengths or models are not comparable)."""
    if not results_path.exists():
        return []
    try:
        old = json.loads(results_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        fail(f"{results_path}: not valid JSON; delete it to start again")
    if old.get("settings") != json.loads(json.dumps(settings)):
        fail(
            f"{results_path} holds runs with other settings (--updates, --warmup-updates, --stats-interval "
            "or the model); use another --out-dir or delete it"
        )
    return old["runs"]


@contextlib.contextmanager
def locked(out_dir):
    """Held while a sweep reads or rewrites OUT/results.json: another process may be sweeping into
    the same OUT. The lock goes with its process, also when it is killed."""
    with open(out_dir / ".runs.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def same_run(a, b):
    return (a["arm"], a["lr"], a["seed"]) == (b["arm"], b["lr"], b["seed"])


def run_sweep(sweep, args, argv, settings, prepare, named_paths=None, train=train_run):
    """Train every (seed, arm, learning rate) of args not yet in OUT/results.json, adding each run
    to it as it ends, so that a stopped sweep continues where it stopped; returns all runs there.
    settings: what else makes runs comparable (the model, the data); prepare() makes the binarized
    data and returns its folder; argv: the sweep's command line, recorded with --work-dir as $WORK
    and each path of named_paths ({path: name}) as its name; train: train_run, or a sweep's own
    training loop with train_run's arguments. results.json is re-read before every run and every
    write, under the lock: runs another process adds meanwhile are kept, and skipped here."""
    settings = {
        "updates": args.updates,
        "warmup_updates": args.warmup_updates,
        "stats_interval": args.stats_interval,
        **settings,
    }
    results_path = args.out_dir / "results.json"
    args.work_dir.mkdir(parents=True, exist_ok=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)

    def read():
        with locked(args.out_dir):
            return finished_runs(results_path, settings)

    runs = read()
    if runs:
        sweep.log(f"{results_path}: keeping {len(runs)} finished runs with the same settings (delete it to redo them)")

    setup_logging(sys.stdout)  # fairseq-train's log format
    import torch

    torch.set_num_threads(args.threads)
    # Deprecation notices of hydra and torch that fairseq triggers once per run: not about the sweep.
    for message in (r"(?s).*hydra\.cc", r"(?s).*'pin_memory'", r"(?s).*torch\.cuda\.amp\.autocast"):
        warnings.filterwarnings("ignore", message=message)
    import fairseq

    logging.getLogger("fairseq").setLevel(logging.WARNING)  # fairseq's build logs; our lines say what ran
    logging.getLogger("fairseq.nan_detector").setLevel(logging.ERROR)  # it reruns a diverged step, verbosely
    for name in ("hydra", "matplotlib"):  # their DEBUG lines (hydra's setup lowers the root level)
        logging.getLogger(name).setLevel(logging.WARNING)

    bin_dir = prepare()
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    header = {
        "command": f"python -m experiments.{sweep.name} "
        + portable(shlex.join(argv), {args.work_dir: "$WORK", **(named_paths or {})}),
        "settings": settings,
        "machine": {
            **machine(),
            "torch": torch.__version__,
            "fairseq": fairseq.__version__,
            "torch_threads": args.threads,
        },
    }

    def add(run=None):
        """results.json re-read, with run added unless another process added it first, and written."""
        with locked(args.out_dir):
            runs = finished_runs(results_path, settings)
            if run is not None and any(same_run(r, run) for r in runs):
                sweep.log(
                    f"{run['arm']} lr {run['lr']:g} seed {run['seed']}: another process added it first; kept that one"
                )
            elif run is not None:
                runs.append(run)
            write_json(results_path, {**header, "runs": runs})
        return runs

    for seed in args.seeds:
        for arm in args.arms:
            for lr in args.lrs:
                if any(same_run(r, {"arm": arm, "lr": lr, "seed": seed}) for r in read()):
                    continue
                add(
                    train(
                        sweep,
                        bin_dir,
                        args.work_dir,
                        arm,
                        lr,
                        seed,
                        args.updates,
                        args.warmup_updates,
                        args.stats_interval,
                    )
                )
    return add()
