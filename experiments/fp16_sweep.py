"""The learning-rate sweep in fp16: does attention-logit growth end a mixed-precision run in
fairseq's most reported fp16 failure, `FloatingPointError: Minimum loss scale reached`, and does
QK-norm prevent it? (Wortsman et al. 2023 trace such instabilities to attention logits that grow
without bound; fp16's largest number is 65,504.)

    python -m experiments.fp16_sweep --work-dir work/fp16_sweep --out-dir examples/fp16_sweep \\
        [--arms stock qknorm qk_layernorm] [--lrs 0.03 0.1 0.3] [--seeds 1 2] [--updates 300] [--threads 1]

The runs are the fp32 sweep's (experiments.lr_sweep, a configuration of the sweep engine
experiments/sweep.py: same model, data, optimizer, schedule, no gradient clipping, same seeds), with
`--fp16` added: fairseq's FP16Optimizer (fp16 model, fp32
master weights) and its dynamic loss scaler at fairseq's defaults (initial scale 128, halved on
every overflow, the update skipped; minimum 1e-4). On a machine without CUDA the plugin lets
fairseq run this on the CPU (fairseq_qknorm/fairseq_patches.py, "--fp16 on the CPU").

Per run, per attempted update: the forward loss (bits per token, also for an update that overflowed
and was skipped), whether it was applied, and the loss scale it was taken with. A run ends when
--updates updates have been applied ("finished"), when fairseq stops with "Minimum loss scale
reached" ("minimum loss scale"), or at any other error ("failed"). Every --stats-interval applied
updates, and where a run ends, the fp32 sweep's attention statistics on its fixed dev batch,
computed on a float32 copy of the fp16 weights (so that a logit past 65,504 is measured, not inf),
and the loss of the fp16 model itself on that batch. Writes OUT/results.json (after every run; a
rerun with the same settings skips the runs there), OUT/loss_scale.png and OUT/max_logit_vs_lr.png,
and prints the table beside the fp32 sweep's runs of the same arm, rate and seed.
"""

import argparse
import copy
import dataclasses
import functools
import json
import math
import shlex
import tempfile
import time
from pathlib import Path

from experiments import lr_sweep, sweep
from experiments.portable import portable
from fairseq_qknorm_cli.files import atomic_path

ARMS = lr_sweep.ARMS
# The fp32 sweep's stock logits passed fp16's largest number at 0.3 (up to 1.7e6) and stayed below
# it at 0.1 (up to 3.0e4) and 0.03 (1.8e3).
DEFAULT_LRS = [0.03, 0.1, 0.3]
FP16_MAX = 65504.0
FP32_RESULTS = Path(__file__).resolve().parents[1] / "examples" / "lr_sweep" / "results.json"
MINIMUM_LOSS_SCALE = "Minimum loss scale reached"


SWEEP = dataclasses.replace(lr_sweep.SWEEP, name="fp16_sweep")


def fairseq_flags(bin_dir, arm, lr, seed, updates, warmup, save_dir):
    """The fp32 sweep's fairseq-train flags of this run, with --fp16."""
    return [*SWEEP.fairseq_flags(bin_dir, arm, lr, seed, updates, warmup, save_dir), "--fp16"]


def snapshot(model, criterion, sample, real_queries_and_keys):
    """The fp32 sweep's attention statistics on a float32 copy of the fp16 weights, and the loss
    (bits per token) of the fp16 model itself on the same batch (None when not finite)."""
    import torch

    stats = sweep.attention_statistics(copy.deepcopy(model).float(), criterion, sample, real_queries_and_keys)
    model.eval()
    with torch.no_grad():
        loss, sample_size, _ = criterion(model, sample)
    loss = float(loss) / sample_size / math.log(2)
    return {**stats, "fp16_loss": loss if math.isfinite(loss) else None}


def train_run(engine, bin_dir, work_dir, arm, lr, seed, updates, warmup, stats_interval):
    """Train one arm at one peak learning rate in fp16; returns its record for results.json (the
    sweep engine's train_run signature; engine: the Sweep, whose log it writes to)."""
    import torch
    from fairseq import options, tasks, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.logging import metrics
    from fairseq.trainer import Trainer

    from fairseq_qknorm import USER_DIR

    log = engine.log

    with tempfile.TemporaryDirectory(prefix=f"{engine.name}_") as save_dir:
        flags = fairseq_flags(bin_dir, arm, lr, seed, updates, warmup, save_dir)
        cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), flags))
        metrics.reset()
        utils.set_torch_seed(seed)
        task = tasks.setup_task(cfg.task)
        model = task.build_model(cfg.model)
        criterion = task.build_criterion(cfg.criterion)
        task.load_dataset("valid")
        dev = task.dataset("valid")
        fixed_batch = dev.collater([dev[i] for i in range(min(engine.stats_items, len(dev)))])
        real_queries_and_keys = engine.real_positions(fixed_batch, criterion.padding_idx)
        trainer = Trainer(cfg, task, model, criterion)  # casts model to fp16, in place
        epoch_itr = trainer.get_train_iterator(epoch=1)

        # The forward loss of every attempted update, also of one the loss scaler then skips
        # (Trainer.train_step returns None for those).
        forward = {}
        fairseq_task_step = task.train_step

        def task_step(sample, *args, **kwargs):
            loss, sample_size, logging_output = fairseq_task_step(sample, *args, **kwargs)
            forward["loss"] = float(loss.detach()) / max(sample_size, 1) / math.log(2)
            return loss, sample_size, logging_output

        task.train_step = task_step

        record = {
            "arm": arm,
            "lr": lr,
            "seed": seed,
            "command": portable(
                "fairseq-train " + shlex.join(flags), {save_dir: "SAVE_DIR", work_dir: "$WORK", USER_DIR: "$USER_DIR"}
            ),
            "params": sum(p.numel() for p in model.parameters()),
            "qk_scale_init": cfg.model.qk_scale_init if getattr(cfg.model, "qk_scale", "none") != "none" else None,
            "outcome": None,
            "stopped_at_update": None,
            "error": None,
            "loss": [],  # per attempted update: forward loss, bits/token (None: not finite)
            "applied": [],  # per attempted update: False where fairseq skipped it (overflow)
            "loss_scale": [],  # per attempted update: the scale its backward pass used
            "stats": [],
        }
        scaler = trainer.optimizer.scaler

        def take_snapshot():
            statistics = snapshot(model, criterion, fixed_batch, real_queries_and_keys)
            record["stats"].append({"update": trainer.get_num_updates(), **statistics})

        start = time.time()
        take_snapshot()
        while record["outcome"] is None:
            trainer.begin_epoch(epoch_itr.next_epoch_idx)
            for sample in epoch_itr.next_epoch_itr(shuffle=True):
                forward.clear()
                scale = float(scaler.loss_scale)
                try:
                    applied = trainer.train_step([sample]) is not None
                except Exception as e:  # noqa: BLE001 - every way a run ends is an outcome
                    applied = False
                    cause = fairseq_error(e)
                    minimum = isinstance(cause, FloatingPointError) and MINIMUM_LOSS_SCALE in str(cause)
                    record["outcome"] = "minimum loss scale" if minimum else "failed"
                    record["error"] = describe(cause) + (
                        "" if cause is e else f" (then, while fairseq handled it: {describe(e)})"
                    )
                loss = forward.get("loss")
                record["loss"].append(loss if loss is not None and math.isfinite(loss) else None)
                record["applied"].append(applied)
                record["loss_scale"].append(scale)
                done = trainer.get_num_updates()
                if record["outcome"] is None and done >= updates:
                    record["outcome"] = "finished"
                if record["outcome"] is not None:
                    if record["outcome"] != "finished":
                        record["stopped_at_update"] = done + 1  # the update fairseq was attempting
                    take_snapshot()
                    log(progress_line(record))
                    break
                if applied and done % stats_interval == 0:
                    take_snapshot()
                    log(progress_line(record))
        if record["outcome"] != "finished":
            log(f"{arm} lr {lr:g} seed {seed} | stopped at update {record['stopped_at_update']}: {record['error']}")
            record["first_non_finite"] = first_non_finite(model, criterion, sample)
            log(
                f"{arm} lr {lr:g} seed {seed} | first non-finite output on the last batch: {record['first_non_finite']}"
            )
        record["final_loss_scale"] = float(scaler.loss_scale)
        record["max_logit"] = max(sweep._finite(v for s in record["stats"] for v in s["max_logit"].values()))
        record["seconds"] = round(time.time() - start, 1)
        record["torch_threads"] = torch.get_num_threads()
    return record


def first_non_finite(model, criterion, sample):
    """Where the fp16 forward pass of this batch first leaves fp16's range: the first module, in
    the order the pass runs them, whose output holds an inf or a NaN, with the largest magnitude
    among its (finite) inputs; None when the whole pass is finite. (fairseq's NanDetector answers
    this too, but its backward hooks fail under torch 2.13; these are forward hooks only.)"""
    import torch

    def tensors(x):
        if torch.is_tensor(x):
            return [x] if x.is_floating_point() else []
        if isinstance(x, (list, tuple)):
            return [t for item in x for t in tensors(item)]
        if isinstance(x, dict):
            return [t for item in x.values() for t in tensors(item)]
        return []

    found = []

    def hook(name, module, inputs, output):
        if not found and any(not torch.isfinite(t).all() for t in tensors(output)):
            largest = max((float(t.float().abs().max()) for t in tensors(inputs) if t.numel()), default=None)
            found.append({"module": name, "kind": type(module).__name__, "largest_input": largest})

    handles = [m.register_forward_hook(functools.partial(hook, name)) for name, m in model.named_modules() if name]
    try:
        model.train()  # as the update ran it (dropout is 0)
        with torch.no_grad():
            criterion(model, sample)
    finally:
        for handle in handles:
            handle.remove()
    return found[0] if found else None


def fairseq_error(error):
    """The FloatingPointError fairseq raised, when another error hid it. On a FloatingPointError
    ("Minimum loss scale reached", non-finite gradients), Trainer.train_step reruns the step under
    its NanDetector before re-raising; under torch 2.13 that rerun itself fails (StopIteration in
    torch's backward-hook code), raised while the FloatingPointError is being handled."""
    cause = error
    while cause is not None and not isinstance(cause, FloatingPointError):
        cause = cause.__context__
    return cause or error


def describe(error):
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}".rstrip(": ")


def progress_line(record):
    s = record["stats"][-1]
    skipped = record["applied"].count(False)
    return (
        f"{record['arm']} lr {record['lr']:g} seed {record['seed']} | update {s['update']} | "
        f"attempts {len(record['applied'])} ({skipped} skipped) | loss scale {record['loss_scale'][-1]:g} | "
        f"loss {sweep._fmt(record['loss'][-1], '.3f')} | fp16 fixed-batch loss {sweep._fmt(s['fp16_loss'], '.3f')} | "
        f"max logit {sweep._fmt(max(s['max_logit'].values()), '.2f')}"
    )


# ---------------------------------------------------------------------------------------------
# Summaries, beside the fp32 sweep
# ---------------------------------------------------------------------------------------------
def applied_losses(run):
    return [loss for loss, applied in zip(run["loss"], run["applied"]) if applied]


def summarize(run):
    """One table row."""
    losses = applied_losses(run)
    window = sweep.WINDOW
    final = sum(losses[-window:]) / window if run["outcome"] == "finished" and len(losses) >= window else math.nan
    return {
        "arm": run["arm"],
        "lr": run["lr"],
        "seed": run["seed"],
        "outcome": run["outcome"],
        "stopped_at_update": run["stopped_at_update"],
        "updates": run["applied"].count(True),
        "skipped": run["applied"].count(False),
        "first_scale": run["loss_scale"][0],
        "final_scale": run["final_loss_scale"],
        "final": final,
        "max_logit": run["max_logit"],
        # the first update whose snapshot saw a logit past fp16's range (float32 copy)
        "past_fp16_at": next(
            (s["update"] for s in run["stats"] if max(sweep._finite(s["max_logit"].values()), default=0) > FP16_MAX),
            None,
        ),
    }


def fp32_runs(path=FP32_RESULTS):
    """The fp32 sweep's runs, by (arm, lr, seed), with the settings they ran with."""
    if not path.exists():
        return {}, None
    data = json.loads(path.read_text(encoding="utf-8"))
    return {(r["arm"], r["lr"], r["seed"]): sweep.summarize(r) for r in data["runs"]}, data["settings"]


def markdown_table(runs, fp32):
    lines = [
        "| arm | peak lr | seed | fp16: outcome | updates applied | skipped | loss scale (first -> last) | "
        "final loss | max logit | first logit > 65,504 at | fp32: final loss | fp32: max logit |",
        "|" + "---|" * 12,
    ]
    for row in sorted((summarize(r) for r in runs), key=lambda r: (list(ARMS).index(r["arm"]), r["lr"], r["seed"])):
        ref = fp32.get((row["arm"], row["lr"], row["seed"]))
        outcome = row["outcome"] + (f" at update {row['stopped_at_update']}" if row["stopped_at_update"] else "")
        fp32_final = (
            "-" if ref is None else sweep._fmt(ref["final"], ".3f") + (" (diverged)" if ref["diverged"] else "")
        )
        lines.append(
            f"| {row['arm']} | {row['lr']:g} | {row['seed']} | {outcome} | {row['updates']} | {row['skipped']} | "
            f"{row['first_scale']:g} -> {row['final_scale']:g} | {sweep._fmt(row['final'], '.3f')} | "
            f"{sweep._fmt(row['max_logit'], '.1f')} | {row['past_fp16_at'] if row['past_fp16_at'] is not None else '-'} | "
            f"{fp32_final} | {'-' if ref is None else sweep._fmt(ref['max_logit'], '.1f')} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------
def plot_loss_scale(runs, path):
    """The loss scale of every attempted update, one panel per peak rate, one colour per arm."""
    from matplotlib.figure import Figure

    lrs = sorted({r["lr"] for r in runs})
    fig = Figure(figsize=(4.2 * len(lrs), 4.2), dpi=100, layout="constrained")
    axes = fig.subplots(1, len(lrs), sharey=True, squeeze=False)[0]
    arms = [a for a in ARMS if any(r["arm"] == a for r in runs)]
    for ax, lr in zip(axes, lrs):
        for i, arm in enumerate(arms):
            for j, run in enumerate(r for r in runs if r["arm"] == arm and r["lr"] == lr):
                scales = run["loss_scale"] + [run["final_loss_scale"]]
                ax.step(
                    range(len(scales)), scales, where="post", color=f"C{i}", alpha=0.8, label=arm if j == 0 else None
                )
                if run["outcome"] != "finished":
                    ax.plot(len(scales) - 1, scales[-1], "x", color="black", markersize=10, markeredgewidth=2)
        ax.axhline(1e-4, color="grey", linestyle=":", linewidth=1)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("attempted update")
        ax.set_title(f"peak lr {lr:g}", fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel("fp16 loss scale (x: run stopped; dotted: minimum 1e-4)")
    axes[0].legend()
    with atomic_path(str(path)) as tmp:
        fig.savefig(tmp, format="png")


def plot_max_logit(runs, fp32, path):
    """The largest attention logit per run against the peak rate, fp16 (filled) beside fp32 (open),
    with fp16's largest number drawn across."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.8), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    for i, arm in enumerate(a for a in ARMS if any(r["arm"] == a for r in runs)):
        rows = [summarize(r) for r in runs if r["arm"] == arm]
        shift = 1 + 0.06 * (i - 1)  # arms side by side at each rate
        ax.plot(
            [r["lr"] * shift for r in rows], [r["max_logit"] for r in rows], "o", color=f"C{i}", label=f"{arm}, fp16"
        )
        stopped = [r for r in rows if r["outcome"] != "finished"]
        ax.plot(
            [r["lr"] * shift for r in stopped], [r["max_logit"] for r in stopped], "x", color="black", markersize=11
        )
        ref = [
            fp32[k]
            for k in sorted(fp32)
            if k[0] == arm and k[1] in {r["lr"] for r in rows} and k[2] in {r["seed"] for r in rows}
        ]
        ax.plot(
            [r["lr"] * shift for r in ref],
            [r["max_logit"] for r in ref],
            "o",
            mfc="none",
            color=f"C{i}",
            label=f"{arm}, fp32",
        )
    ax.plot([], [], "x", color="black", markersize=9, label="fp16 run stopped")
    ax.axhline(FP16_MAX, color="grey", linestyle="--", linewidth=1, label="65,504 (fp16's largest number)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("peak learning rate (inverse_sqrt schedule)")
    ax.set_ylabel("largest pre-softmax attention logit over training")
    ax.set_title("Attention logits, fp16 runs beside the fp32 sweep (same seeds)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    with atomic_path(str(path)) as tmp:
        fig.savefig(tmp, format="png")


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m experiments.fp16_sweep",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sweep.add_sweep_args(parser, ARMS, DEFAULT_LRS, updates=300, warmup_updates=75, stats_interval=10, threads=1)
    parser.add_argument("--work-dir", type=Path, required=True, help="data (generated and binarized once)")
    parser.add_argument("--out-dir", type=Path, required=True, help="results.json and the figures")
    args = parser.parse_args(argv)
    sweep.check_sweep_args(parser, args)
    return args


def main(argv=None):
    args = parse_args(argv)
    settings = {
        "model": lr_sweep.MODEL,
        "arms": ARMS,
        "max_tokens": lr_sweep.MAX_TOKENS,
        "corpus": lr_sweep.CORPUS,
        "stats_sentences": lr_sweep.STATS_SENTENCES,
        "precision": "--fp16",
    }
    prepare = lambda: lr_sweep.prepare_data(args.work_dir)  # noqa: E731
    runs = sweep.run_sweep(SWEEP, args, argv, settings, prepare, train=train_run)
    fp32, fp32_settings = fp32_runs()
    same = fp32_settings is not None and all(fp32_settings.get(k) == v for k, v in settings.items() if k != "precision")
    run_length = ("updates", "warmup_updates", "stats_interval")
    same = same and all(fp32_settings[k] == getattr(args, k) for k in run_length)
    if not same:
        SWEEP.log(f"{FP32_RESULTS.name} of the fp32 sweep ran other settings: no fp32 runs beside these")
        fp32 = {}
    plot_loss_scale(runs, args.out_dir / "loss_scale.png")
    plot_max_logit(runs, fp32, args.out_dir / "max_logit_vs_lr.png")
    print(markdown_table(runs, fp32))
    SWEEP.log(
        f"wrote {args.out_dir / 'results.json'}, {args.out_dir / 'loss_scale.png'}, {args.out_dir / 'max_logit_vs_lr.png'}"
    )


if __name__ == "__main__":
    main()
