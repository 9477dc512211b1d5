"""The learning-rate sweep in fp16: does attention-logit growth end a mixed-precision run in
fairseq's most reported fp16 failure, `FloatingPointError: Minimum loss scale reached`, and does
QK-norm prevent it? (Wortsman et al. 2023 trace such instabilities to attention logits that grow
without bound; fp16's largest number is 65,504.)

    python -m experiments.fp16_sweep --work-dir work/fp16_sweep --out-dir examples/fp16_sweep \\
        [--arms stock qknorm qk_layernorm] [--lrs 0.03 0.1 0.3] [--seeds 1 2] [--updates 300] [--threads 1] \\
        [--device cuda]

The runs are the fp32 sweep's (experiments.lr_sweep, a configuration of the sweep engine
experiments/sweep.py: same model, data, optimizer, schedule, no gradient clipping, same seeds), with
`--fp16` added (and, with --device cuda, without `--cpu`: fairseq's fp16 on real kernels), and
their own training loop: fairseq's FP16Optimizer (fp16 model, fp32
master weights) and its dynamic loss scaler at fairseq's defaults (initial scale 128, halved on
every overflow, the update skipped; minimum 1e-4). On a machine without CUDA the plugin lets
fairseq run this on the CPU (fairseq_qknorm/fairseq_patches.py, "--fp16 on the CPU").

Per run, per attempted update: the forward loss (bits per token, also for an update that overflowed
and was skipped), whether it was applied, the loss scale it was taken with, and the first module
whose fp16 output was not finite in its forward pass, if any (forward hooks on the fp16 model). A
run ends when --updates updates have been applied ("finished"), when fairseq stops with "Minimum
loss scale reached" ("minimum loss scale"), or at any other error ("failed"). Every
--stats-interval applied updates, and where a run ends, on its fixed dev batch and on a float32
copy of the fp16 weights (so that a value past 65,504 is measured, not inf): the fp32 sweep's
attention statistics, and the largest absolute value of the attention logits (per module), the
output logits before the softmax, the feed-forward hidden activations and each layer's output;
and the loss of the fp16 model itself on that batch. A run that ends also records its overflow
site (the first module whose fp16 output was not finite in the failing forward pass), the largest
value of every module's input and output on the failing batch in float32, and the site's value at
every snapshot. Writes OUT/results.json (after every run; a rerun with the same settings skips the
runs there), OUT/loss_scale.png, OUT/max_logit_vs_lr.png and, where runs ended,
OUT/overflow_sites.png, and prints the table beside the fp32 sweep's runs of the same arm, rate
and seed, and where forward passes overflowed.

A sweep run in parts, one process per arm and seed as the GPU call (examples/ted/gl-en-2x2-gpu/)
runs it, becomes one results.json and its figures with

    python -m experiments.fp16_sweep merge PART/results.json... --out-dir OUT --command "what ran them"
"""

import argparse
import contextlib
import copy
import dataclasses
import functools
import json
import math
import re
import shlex
import sys
import tempfile
import time
import traceback
from pathlib import Path

from experiments import lr_sweep, sweep
from fairseq_qknorm import USER_DIR
from fairseq_qknorm_cli.files import atomic_path, fail

ARMS = lr_sweep.ARMS
# The fp32 sweep's stock logits passed fp16's largest number at 0.3 (up to 1.7e6) and stayed below
# it at 0.1 (up to 3.0e4) and 0.03 (1.8e3).
DEFAULT_LRS = [0.03, 0.1, 0.3]
FP16_MAX = 65504.0
FP32_RESULTS = Path(__file__).resolve().parents[1] / "examples" / "lr_sweep" / "results.json"
MINIMUM_LOSS_SCALE = "Minimum loss scale reached"
SWEEP = dataclasses.replace(lr_sweep.SWEEP, name="fp16_sweep", lrs=DEFAULT_LRS, threads=1)


def fairseq_flags(bin_dir, arm, lr, seed, updates, warmup, save_dir, device="cpu"):
    """The fp32 sweep's fairseq-train flags of this run, with --fp16 (and on CUDA, without --cpu)."""
    flags = [*SWEEP.fairseq_flags(bin_dir, arm, lr, seed, updates, warmup, save_dir), "--fp16"]
    return flags if device == "cpu" else [f for f in flags if f != "--cpu"]


# ---------------------------------------------------------------------------------------------
# Where an fp16 forward pass overflows
# ---------------------------------------------------------------------------------------------
# What the sweep follows of a forward pass: the attention logits (recorded from inside each
# attention module, as "encoder self 0"), and the output of every module that computes (each
# Linear, Embedding and norm; dropout passes its input on) and of every layer, by fairseq's module
# names. Named groups of them, drawn and tabled together:
OUTPUT_LOGITS = "decoder.output_projection"  # before the softmax
GROUPS = {
    "output logits": re.compile(rf"^{re.escape(OUTPUT_LOGITS)}$"),
    "ffn hidden": re.compile(r"\.fc1$"),  # before the activation
    "layer output": re.compile(r"^(encoder|decoder)\.layers\.\d+$"),  # the residual stream after the layer
}
ATTENTION_LOGITS = "attention logits"


def followed(name, module):
    """Whether the sweep records the largest value of module's output."""
    import torch
    from fairseq.modules import FairseqDropout

    computes = next(module.children(), None) is None and not isinstance(module, (FairseqDropout, torch.nn.Dropout))
    return computes or bool(GROUPS["layer output"].match(name))


def grouped(measured):
    """A largest_values record reduced to its groups, {group: {name: value}}: what every snapshot
    keeps (all of it, for every module at every snapshot, would not fit in results.json)."""
    outputs = measured["outputs"]
    return {
        ATTENTION_LOGITS: measured[ATTENTION_LOGITS],
        **{
            group: {name: v for name, v in outputs.items() if pattern.search(name)} for group, pattern in GROUPS.items()
        },
    }


def site_value(measured, site):
    """The largest value that `measured` (largest_values) holds for site (first_non_finite's): a
    module's output or input, or for an attention module that overflowed inside (fairseq's fused
    path calls no projection module), its logits; None where it holds none."""
    from fairseq_qknorm_cli.attention_stats import attention_module

    if not measured or not site:
        return None
    for recorded in (measured["outputs"], measured["inputs"]):
        if site in recorded:
            return recorded[site]
    where = attention_module(site)
    return None if where is None else measured[ATTENTION_LOGITS].get(f"{where[0]} {where[1]}")


def tensors(value):
    """The floating-point tensors in a module's input or output (tensors, tuples, lists, dicts)."""
    import torch

    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors(v)


def largest_abs(x):
    """The largest |value| among x's finite entries (masked attention logits are -inf by design)."""
    finite = x[x.isfinite()]
    return float(finite.abs().max()) if finite.numel() else None


def largest_values(model, criterion, sample):
    """One forward pass of model on sample (loss included): the largest |value| of the attention
    logits, {"attention logits": {"encoder self 0": ...}}, of every followed module's output,
    {"outputs": {"decoder.output_projection": ..., ...}}, and of every module's input, {"inputs":
    {"input of decoder.layers.1.final_layer_norm": ...}} (a pre-norm's input is the residual stream
    within a layer: first_non_finite's "input of NAME")."""
    import torch

    from fairseq_qknorm_cli.attention_stats import recording_attention, sort_key

    logits, outputs, inputs = {}, {}, {}

    def record(into, key, value):
        value = None if value is None else largest_abs(value)
        if value is not None:
            into[key] = max(into.get(key, value), value)

    handles = []
    for name, module in model.named_modules():
        if followed(name, module):
            handles.append(
                # the first tensor: a decoder layer also returns its attention weights
                module.register_forward_hook(
                    lambda m, args, out, name=name: record(outputs, name, next(tensors(out), None))
                )
            )
        if name:  # the model's own input is tokens

            def record_inputs(m, args, out, name=name):
                for x in tensors(args):
                    record(inputs, f"input of {name}", x)

            handles.append(module.register_forward_hook(record_inputs))

    model.eval()
    try:
        with torch.no_grad(), recording_attention(model, lambda where, _, x: record(logits, where, x)):
            criterion(model, sample)
    finally:
        for handle in handles:
            handle.remove()
    return {
        ATTENTION_LOGITS: {f"{w[0]} {w[1]}": logits[w] for w in sorted(logits, key=sort_key)},
        "outputs": outputs,
        "inputs": inputs,
    }


@contextlib.contextmanager
def first_non_finite(model):
    """While active, the forward passes of model report into the dict yielded, as "site", the first
    module whose output holds a value that is not finite, in the order a pass computes them (a
    module ends after the modules inside it: the innermost one that made it); "input of NAME" when
    NAME's input already holds one that no module output held: it was made between modules (the
    embedding's scaling, a residual addition). The first site found is kept."""
    found = {}

    def check(name, value):
        if "site" not in found and any(not bool(t.isfinite().all()) for t in tensors(value)):
            found["site"] = name

    handles = []
    for name, module in model.named_modules():
        name = name or "model"
        handles.append(module.register_forward_pre_hook(lambda m, args, name=name: check(f"input of {name}", args)))
        handles.append(module.register_forward_hook(lambda m, args, out, name=name: check(name, out)))
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


def snapshot(model, criterion, sample):
    """(stats, measured) on the fixed batch `sample`. measured: largest_values on a float32 copy of
    the fp16 weights (so that a value past 65,504 is measured, not inf). stats: on the same copy,
    the fp32 sweep's attention statistics and measured's groups ("max_abs"); and the loss (bits per
    token) of the fp16 model itself (None when not finite)."""
    import torch

    fp32 = copy.deepcopy(model).float()
    measured = largest_values(fp32, criterion, sample)
    stats = {**SWEEP.attention_snapshot(fp32, criterion, sample), "max_abs": grouped(measured)}
    model.eval()
    with torch.no_grad():
        loss, sample_size, _ = criterion(model, sample)
    loss = float(loss) / sample_size / math.log(2)
    return {**stats, "fp16_loss": loss if math.isfinite(loss) else None}, measured


def train_run(config, bin_dir, work_dir, arm, lr, seed, updates, warmup, stats_interval, device="cpu"):
    """Train one arm at one peak learning rate in fp16 on device; returns its record for
    results.json (the arguments of the engine's sweep.train_run)."""
    import torch
    from fairseq import utils

    log = config.log

    with tempfile.TemporaryDirectory(prefix="fp16_sweep_") as save_dir:
        flags = fairseq_flags(bin_dir, arm, lr, seed, updates, warmup, save_dir, device)
        cfg, task, model, criterion, trainer, epoch_itr, fixed_batch = sweep.build_run(flags, seed, config.stats_items)
        if device == "cuda":  # the Trainer moved the model; the statistics' batch follows it
            fixed_batch = utils.move_to_cuda(fixed_batch)

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
            "command": "fairseq-train " + shlex.join(flags),
            "params": sum(p.numel() for p in model.parameters()),
            "qk_scale_init": cfg.model.qk_scale_init if getattr(cfg.model, "qk_scale", "none") != "none" else None,
            "outcome": None,
            "stopped_at_update": None,
            "error": None,
            # where the run ended: forward_overflow of the failing attempt, largest_values of its
            # batch on a float32 copy of the fp16 weights, and (overflow_site_values) the site's
            # largest value at each snapshot, where it is a followed module or an attention's logits
            "overflow_site": None,
            "failing_batch": None,
            "loss": [],  # per attempted update: forward loss, bits/token (None: not finite)
            "applied": [],  # per attempted update: False where fairseq skipped it (overflow)
            "loss_scale": [],  # per attempted update: the scale its backward pass used
            # per attempted update: the first module whose fp16 output was not finite in its
            # forward pass (first_non_finite); None: the forward pass was finite
            "forward_overflow": [],
            "stats": [],
        }
        # The paths of this machine: the data, the plugin, the temporary save directory.
        for path, name in ((str(bin_dir), "DATA_BIN"), (USER_DIR, "USER_DIR"), (save_dir, "SAVE_DIR")):
            record["command"] = record["command"].replace(path, name)
        scaler = trainer.optimizer.scaler

        measured = []  # largest_values of each snapshot: stats keep its groups only

        def take_snapshot():
            stats, values = snapshot(model, criterion, fixed_batch)
            record["stats"].append({"update": trainer.get_num_updates(), **stats})
            measured.append(values)

        start = time.time()
        take_snapshot()
        while record["outcome"] is None:
            trainer.begin_epoch(epoch_itr.next_epoch_idx)
            for sample in epoch_itr.next_epoch_itr(shuffle=True):
                forward.clear()
                scale = float(scaler.loss_scale)
                try:
                    # Only the attempt's own forward pass: after "Minimum loss scale reached" fairseq
                    # re-runs it under its NaN detector, which adds nothing where this one found the site.
                    with first_non_finite(model) as overflow:
                        applied = trainer.train_step([sample]) is not None
                except FloatingPointError as e:
                    applied = False
                    minimum = MINIMUM_LOSS_SCALE in str(e)
                    record["outcome"] = "minimum loss scale" if minimum else "failed"
                    record["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                except Exception as e:  # noqa: BLE001 - any other way a run ends is an outcome too
                    applied = False
                    record["outcome"] = "failed"
                    record["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    log(f"{arm} lr {lr:g} seed {seed} | {traceback.format_exc()}")
                loss = forward.get("loss")
                record["loss"].append(loss if loss is not None and math.isfinite(loss) else None)
                record["applied"].append(applied)
                record["loss_scale"].append(scale)
                record["forward_overflow"].append(overflow.get("site"))
                done = trainer.get_num_updates()
                if record["outcome"] is None and done >= updates:
                    record["outcome"] = "finished"
                if record["outcome"] is not None:
                    if record["outcome"] != "finished":
                        record["stopped_at_update"] = done + 1  # the update fairseq was attempting
                        record["overflow_site"] = record["forward_overflow"][-1]
                        # The failing batch again, on a float32 copy: how far past 65,504 each site went.
                        failing = utils.move_to_cuda(sample) if device == "cuda" else sample
                        record["failing_batch"] = largest_values(copy.deepcopy(model).float(), criterion, failing)
                    take_snapshot()
                    log(progress_line(record))
                    break
                if applied and done % stats_interval == 0:
                    take_snapshot()
                    log(progress_line(record))
        if record["outcome"] != "finished":
            log(f"{arm} lr {lr:g} seed {seed} | stopped at update {record['stopped_at_update']}: {record['error']}")
        record["final_loss_scale"] = float(scaler.loss_scale)
        record["max_logit"] = max(sweep.finite(v for s in record["stats"] for v in s["max_logit"].values()))
        # over the fixed batch's snapshots and, where the run ended, its failing batch
        if record["overflow_site"] is not None:  # at every snapshot
            record["overflow_site_values"] = [site_value(m, record["overflow_site"]) for m in measured]
        measured.append(record["failing_batch"] or {"outputs": {}})
        record["max_output_logit"] = max(sweep.finite(m["outputs"].get(OUTPUT_LOGITS) for m in measured), default=None)
        record["seconds"] = round(time.time() - start, 1)
        record["torch_threads"] = torch.get_num_threads()
    return record


def progress_line(record):
    s = record["stats"][-1]
    skipped = record["applied"].count(False)
    return (
        f"{record['arm']} lr {record['lr']:g} seed {record['seed']} | update {s['update']} | "
        f"attempts {len(record['applied'])} ({skipped} skipped) | loss scale {record['loss_scale'][-1]:g} | "
        f"loss {sweep.fmt(record['loss'][-1], '.3f')} | fp16 fixed-batch loss {sweep.fmt(s['fp16_loss'], '.3f')} | "
        f"max logit {sweep.fmt(max(s['max_logit'].values()), '.2f')} | "
        f"max |output logit| {sweep.fmt(s['max_abs']['output logits'].get(OUTPUT_LOGITS), '.1f')}"
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
        "max_output_logit": run.get("max_output_logit"),  # not in records made before it was measured
        # the first update whose snapshot saw a logit past fp16's range (float32 copy)
        "past_fp16_at": next(
            (s["update"] for s in run["stats"] if max(sweep.finite(s["max_logit"].values()), default=0) > FP16_MAX),
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
        "final loss | max logit | first logit > 65,504 at | max output logit | fp32: final loss | fp32: max logit |",
        "|" + "---|" * 13,
    ]
    for row in sorted((summarize(r) for r in runs), key=lambda r: (list(ARMS).index(r["arm"]), r["lr"], r["seed"])):
        ref = fp32.get((row["arm"], row["lr"], row["seed"]))
        outcome = row["outcome"] + (f" at update {row['stopped_at_update']}" if row["stopped_at_update"] else "")
        fp32_final = "-" if ref is None else sweep.fmt(ref["final"], ".3f") + (" (diverged)" if ref["diverged"] else "")
        lines.append(
            f"| {row['arm']} | {row['lr']:g} | {row['seed']} | {outcome} | {row['updates']} | {row['skipped']} | "
            f"{row['first_scale']:g} -> {row['final_scale']:g} | {sweep.fmt(row['final'], '.3f')} | "
            f"{sweep.fmt(row['max_logit'], '.1f')} | {row['past_fp16_at'] if row['past_fp16_at'] is not None else '-'} | "
            f"{cell(row['max_output_logit'], '.1f')} | {fp32_final} | {'-' if ref is None else sweep.fmt(ref['max_logit'], '.1f')} |"
        )
    return "\n".join(lines)


def cell(x, spec):
    """x formatted for a table; "-" where there is no number."""
    return "-" if x is None else format(x, spec)


def longest_skip_streak(run):
    longest = streak = 0
    for applied in run["applied"]:
        streak = 0 if applied else streak + 1
        longest = max(longest, streak)
    return longest


def overflow_table(runs):
    """One row per run with an fp16 forward pass that was not finite: its skipped updates (in these
    300-update runs the loss scale only falls: fairseq raises it after --fp16-scale-window updates
    without an overflow, 16,384 on one device; so a run started at 128 ends at its 21st overflow,
    in a row or not), those whose forward pass was not finite and where, and, for a run that ended,
    its failing pass's overflow site and how large the values were on its batch in float32."""
    lines = [
        "| arm | peak lr | seed | outcome | skipped (most in a row) | of them, forward pass not finite: where | "
        "overflow site, failing pass | its largest value, failing batch (fp32) | "
        "largest output logit, failing batch | largest attention logit, failing batch |",
        "|" + "---|" * 10,
    ]
    overflowed = [r for r in runs if any(r.get("forward_overflow") or [])]
    for r in sorted(overflowed, key=lambda r: (list(ARMS).index(r["arm"]), r["lr"], r["seed"])):
        sites = [site for site in r["forward_overflow"] if site is not None]
        where = ", ".join(f"{site} ({sites.count(site)})" for site in sorted(set(sites)))
        outcome = r["outcome"] + (f" at update {r['stopped_at_update']}" if r["stopped_at_update"] else "")
        failing = r["failing_batch"]
        attention = max(sweep.finite(failing[ATTENTION_LOGITS].values()), default=None) if failing else None
        lines.append(
            f"| {r['arm']} | {r['lr']:g} | {r['seed']} | {outcome} | "
            f"{r['applied'].count(False)} ({longest_skip_streak(r)}) | {len(sites)}: {where} | "
            f"{r['overflow_site'] or '-'} | {cell(site_value(failing, r['overflow_site']), ',.0f')} | "
            f"{cell(failing and failing['outputs'].get(OUTPUT_LOGITS), ',.0f')} | {cell(attention, ',.1f')} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------
def plot_loss_scale(runs, path):
    """The loss scale of every attempted update, one panel per peak rate, one colour per arm."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

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
    # every arm in the legend, also one that ran at some rates only
    handles = [Line2D([], [], color=f"C{i}", label=arm) for i, arm in enumerate(arms)]
    axes[0].legend(handles=handles)
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


def plot_layer_output(runs, path):
    """The largest layer output (the residual stream) of every run over the updates, one panel per
    peak rate, one colour per arm, x where a run ended, fp16's largest number drawn across."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    lrs = sorted({r["lr"] for r in runs})
    fig = Figure(figsize=(4.6 * len(lrs), 4.4), dpi=80, layout="constrained")
    axes = fig.subplots(1, len(lrs), sharey=True, squeeze=False)[0]
    arms = [a for a in ARMS if any(r["arm"] == a for r in runs)]
    for ax, lr in zip(axes, lrs):
        for run in (r for r in runs if r["lr"] == lr and "stats" in r and "max_abs" in r["stats"][0]):
            color = f"C{arms.index(run['arm'])}"
            updates = [s["update"] for s in run["stats"]]
            ys = [max(s["max_abs"]["layer output"].values()) for s in run["stats"]]
            ax.plot(updates, ys, color=color, linewidth=1, alpha=0.8)
            if run["outcome"] != "finished":
                ax.plot(updates[-1], ys[-1], "x", color="black", markersize=8)
        ax.axhline(FP16_MAX, color="grey", linestyle="--", linewidth=1)
        ax.set_yscale("log")
        ax.set_xlabel("update")
        ax.set_title(f"peak lr {lr:g}", fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel("largest layer output, fixed batch (fp32 copy)")
    handles = [Line2D([], [], color=f"C{i}", label=arm) for i, arm in enumerate(arms)]
    handles += [
        Line2D([], [], marker="x", color="black", linestyle="none", label="run ended"),
        Line2D([], [], color="grey", linestyle="--", label="65,504 (fp16's largest number)"),
    ]
    axes[0].legend(handles=handles, fontsize=8)
    with atomic_path(str(path)) as tmp:
        fig.savefig(tmp, format="png")


def plot_overflow_sites(runs, path):
    """One panel per run that ended: over the updates, the largest value of each group on the fixed
    batch (float32 copy of the fp16 weights) and, thick, of the module where the failing fp16 forward
    pass overflowed; stars: the same on the failing batch; dashed: fp16's largest number."""
    from matplotlib.figure import Figure

    ended = [r for r in runs if r["outcome"] != "finished" and r.get("failing_batch")]
    ended.sort(key=lambda r: (list(ARMS).index(r["arm"]), r["lr"], r["seed"]))
    columns = min(max(len(ended), 1), 4)
    rows = max(math.ceil(len(ended) / columns), 1)
    fig = Figure(figsize=(4.6 * columns, 4.2 * rows), dpi=80, layout="constrained")
    axes = fig.subplots(rows, columns, sharey=True, squeeze=False).flatten()
    for ax in axes[len(ended) :]:
        ax.set_visible(False)
    for ax, run in zip(axes, ended):
        updates = [s["update"] for s in run["stats"]]
        site = run["overflow_site"]
        failing = grouped(run["failing_batch"])
        for i, group in enumerate([ATTENTION_LOGITS, *GROUPS]):
            ys = [max(sweep.finite(s["max_abs"][group].values()), default=math.nan) for s in run["stats"]]
            ax.plot(updates, ys, color=f"C{i}", linewidth=1, label=group)
            star = max(sweep.finite(failing[group].values()), default=math.nan)
            ax.plot(run["stopped_at_update"], star, "*", color=f"C{i}", markersize=11)
        if "overflow_site_values" in run:
            ys = [math.nan if y is None else y for y in run["overflow_site_values"]]
            ax.plot(updates, ys, color="black", linewidth=3, alpha=0.5, label=site)
            star = site_value(run["failing_batch"], site)
            ax.plot(run["stopped_at_update"], math.nan if star is None else star, "*", color="black", markersize=11)
        ax.axhline(FP16_MAX, color="grey", linestyle="--", linewidth=1)
        ax.set_yscale("log")
        ax.set_xlabel("update")
        ax.set_title(
            f"{run['arm']}, lr {run['lr']:g}, seed {run['seed']}: ended at update {run['stopped_at_update']}\n"
            f"first non-finite: {site or 'none in the forward pass'}",
            fontsize=9,
        )
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    for ax in axes[::columns]:
        ax.set_ylabel("largest |value| (fixed batch; stars: failing batch)")
    with atomic_path(str(path)) as tmp:
        fig.savefig(tmp, format="png")


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def parse_args(argv=None):
    parser = sweep.argument_parser(SWEEP, __doc__)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the runs train")
    args = sweep.parse_args(parser, argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device here")
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
    if args.device == "cuda":  # other kernels: runs on the CPU and on CUDA are not one table
        import torch

        settings["device"] = f"cuda: {torch.cuda.get_device_name()}"
    train = functools.partial(train_run, device=args.device)
    runs = sweep.run_sweep(SWEEP, args, argv, settings, lambda: lr_sweep.prepare_data(args.work_dir), train=train)
    report(runs, {**settings, **{k: getattr(args, k) for k in RUN_LENGTH}}, args.out_dir)


RUN_LENGTH = ("updates", "warmup_updates", "stats_interval")


def report(runs, settings, out_dir):
    """The figures in out_dir, and the table printed, beside the fp32 sweep's runs where it ran the
    same settings."""
    fp32, fp32_settings = fp32_runs()
    same = fp32_settings is not None and all(
        fp32_settings.get(k) == v for k, v in settings.items() if k not in ("precision", "device")
    )
    if not same:
        SWEEP.log(f"{FP32_RESULTS} ran other settings: no fp32 runs beside these")
        fp32 = {}
    plot_loss_scale(runs, out_dir / "loss_scale.png")
    plot_max_logit(runs, fp32, out_dir / "max_logit_vs_lr.png")
    figures = [out_dir / "loss_scale.png", out_dir / "max_logit_vs_lr.png"]
    print(markdown_table(runs, fp32))
    if any("forward_overflow" in r for r in runs):  # records made before these were measured have none
        figures.append(out_dir / "layer_output.png")
        plot_layer_output(runs, figures[-1])
    if any(r["outcome"] != "finished" and r.get("failing_batch") for r in runs):
        figures.append(out_dir / "overflow_sites.png")
        plot_overflow_sites(runs, figures[-1])
    if any(any(r.get("forward_overflow") or []) for r in runs):
        print()
        print(overflow_table(runs))
    SWEEP.log(f"wrote {out_dir / 'results.json'}, {', '.join(map(str, figures))}")


def merge(parts, out_dir, command):
    """One sweep from the results.json of processes that each ran a part of it (the GPU call runs
    one per arm and seed): their settings must agree, and no run may come twice. Writes
    OUT/results.json, with `command` for what ran the parts, and the figures."""
    loaded = [json.loads(Path(p).read_text(encoding="utf-8")) for p in parts]
    settings = loaded[0]["settings"]
    for path, data in zip(parts, loaded):
        if data["settings"] != settings:
            fail(f"{path}: its settings differ from those of {parts[0]}")
    runs = sorted(
        (r for data in loaded for r in data["runs"]), key=lambda r: (list(ARMS).index(r["arm"]), r["lr"], r["seed"])
    )
    keys = [(r["arm"], r["lr"], r["seed"]) for r in runs]
    if len(set(keys)) != len(keys):
        fail(f"{', '.join(map(str, parts))}: a run comes more than once")
    out_dir.mkdir(parents=True, exist_ok=True)
    sweep.write_json(
        out_dir / "results.json",
        {"command": command, "settings": settings, "machine": loaded[0]["machine"], "runs": runs},
    )
    report(runs, settings, out_dir)
    return runs


def merge_main(argv):
    parser = argparse.ArgumentParser(
        prog="python -m experiments.fp16_sweep merge", description=merge.__doc__.split(":")[0]
    )
    parser.add_argument("parts", nargs="+", type=Path, metavar="RESULTS_JSON")
    parser.add_argument("--out-dir", type=Path, required=True, help="where results.json and the figures go")
    parser.add_argument("--command", required=True, help="what ran the parts, for the record")
    args = parser.parse_args(argv)
    for path in args.parts:
        if not path.is_file():
            parser.error(f"{path}: no such file")
    merge(args.parts, args.out_dir, args.command)


if __name__ == "__main__":
    if sys.argv[1:2] == ["merge"]:
        merge_main(sys.argv[2:])
    else:
        main()
