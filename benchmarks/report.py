"""Statistics, targets and the Markdown tables, from a results JSON alone (no torch needed)."""

import random
import statistics

from . import cpu

BASELINE = "stock"  # fairseq's transformer
CONTROL = "stock_control"  # stock again, in a second process of the same batch
TARGET_SPEED = 0.97  # QK-norm / stock, median of the per-pair ratios
TARGET_MEMORY = 1.03  # peak memory and activations, QK-norm / stock
LIKE_FOR_LIKE = "stock_beamable"  # in generation: the same decoding algorithm as the QK-norm arms
FUSED, PLAIN = "qknorm", "qknorm_plain"
FUSED_FROM_T = 64  # the fused path must be at least as fast as the plain one from this length on


def spread(values):
    return min(values), statistics.median(values), max(values)


def pair_ratios(values, baseline):
    """Round r of one arm against round r of the other: both ran back to back."""
    return [a / b for a, b in zip(values, baseline)]


def median_interval(values, level=0.95, draws=2000, seed=0):
    """A percentile-bootstrap interval for the median of `values` (per-pair ratios, say)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    tail = (1 - level) / 2
    return medians[int(tail * draws)], medians[int((1 - tail) * draws) - 1]


def _fmt(x, digits=0):
    return f"{x:,.{digits}f}"


def _ratio(ratios):
    lo, med, hi = spread(ratios)
    return f"**{med:.3f}** ({lo:.3f}–{hi:.3f})" if len(ratios) > 1 else f"**{med:.3f}**"


def _label(group):
    return f"{group['size']} {group['dtype']}"


def _batch_label(group):
    """The arms of one benchmark run in batches, each with its own stock: say which batch."""
    return _label(group) + (f" #{group['batch']}" if group.get("batch", 1) > 1 else "")


def target_arms(arms):
    """Every QK-norm variant (transformer_qknorm with any --qk-norm / --qk-scale) is held to the targets."""
    return [a for a in arms if a.startswith("qknorm") and a != PLAIN]


def _memory_key(arm):
    return "peak_cuda_mb" if "peak_cuda_mb" in arm else "peak_rss_mb"


def _memory_ratio(arm, base):
    return arm[_memory_key(arm)] / base[_memory_key(base)]


def _memory(arm, base):
    return _fmt(arm[_memory_key(arm)]), f"{_memory_ratio(arm, base):.3f}"


def model_table(groups, benchmark, metric, cpu_metric, unit, extra=None):
    head = f"| model | arm | {unit} min | median | max |"
    rule = "|---|---|---:|---:|---:|"
    if extra:
        head += f" {extra[1]} median |"
        rule += "---:|"
    head += f" ratio to {BASELINE} (median of pairs, min–max) | same, by CPU time | peak memory MB | memory ratio |"
    rule += "---:|---:|---:|---:|"
    if benchmark == "train":
        head += " activations MiB (ratio) |"
        rule += "---:|"
    rows = [head, rule]
    for g in (g for g in groups if g["benchmark"] == benchmark):
        base = g["arms"][BASELINE]
        for name, arm in g["arms"].items():
            lo, med, hi = spread(arm["metrics"][metric])
            row = f"| {_batch_label(g)} | {name} | {_fmt(lo, 1)} | {_fmt(med, 1)} | {_fmt(hi, 1)} |"
            if extra:
                row += f" {_fmt(statistics.median(arm['metrics'][extra[0]]), 1)} |"
            ratio = _ratio(pair_ratios(arm["metrics"][metric], base["metrics"][metric]))
            cpu = statistics.median(pair_ratios(arm["metrics"][cpu_metric], base["metrics"][cpu_metric]))
            row += " {} | {:.3f} | {} | {} |".format(ratio, cpu, *_memory(arm, base))
            if benchmark == "train":
                act, base_act = arm["info"]["activations_mb"], base["info"]["activations_mb"]
                row += f" {act:,.1f} ({act / base_act:.3f}) |"
            rows.append(row)
    return "\n".join(rows)


def memory_table(groups):
    rows = [
        f"| model | arm | peak memory MB | ratio to {BASELINE} | at start MB |",
        "|---|---|---:|---:|---:|",
    ]
    for g in (g for g in groups if g["benchmark"] == "memory"):
        base = g["arms"][BASELINE]
        for name, arm in g["arms"].items():
            rows.append(
                f"| {_batch_label(g)} | {name} | {' | '.join(_memory(arm, base))} | {_fmt(arm['start_rss_mb'])} |"
            )
    return "\n".join(rows)


def attention_table(groups):
    rows = []
    for g in (g for g in groups if g["benchmark"] == "attention"):
        arms = list(next(iter(g["cases"].values())))
        if not rows:
            rows = [
                "| model | case | "
                + " | ".join(f"{a} ms" for a in arms)
                + f" | {FUSED} / {BASELINE} | {PLAIN} / {FUSED} |",
                "|---|---|" + "---:|" * (len(arms) + 2),
            ]
        for case, times in g["cases"].items():
            cells = " | ".join(f"{statistics.median(times[a]):.3f}" for a in arms)
            rows.append(
                f"| {_label(g)} | {case} | {cells} | {_ratio(pair_ratios(times[FUSED], times[BASELINE]))}"
                f" | {_ratio(pair_ratios(times[PLAIN], times[FUSED]))} |"
            )
    return "\n".join(rows)


CHECKS = {  # (benchmark, check) -> (what, goal); the columns of the targets table
    ("train", "wps"): ("train wps", f">= {TARGET_SPEED}"),
    ("train", "activations"): ("activations", f"<= {TARGET_MEMORY}"),
    ("train", "memory"): ("train peak memory", f"<= {TARGET_MEMORY}"),
    ("memory", "peak"): ("train peak memory, freed memory returned", f"<= {TARGET_MEMORY}"),
    ("generate", "speed"): ("generate sent/s", f">= {TARGET_SPEED}"),
    ("generate", "like for like"): (f"generate / {LIKE_FOR_LIKE}", f">= {TARGET_SPEED}"),
    ("generate", "memory"): ("generate peak memory", f"<= {TARGET_MEMORY}"),
}


SPEED = {"train": "wps", "generate": "sentences_per_s"}


def noise_floor(groups):
    """{(benchmark, batch label): stock_control / stock}: what identical code measures as a ratio in
    that batch. A speed ratio of the same batch is no more certain than this one is far from 1."""
    return {
        (g["benchmark"], _batch_label(g)): statistics.median(
            pair_ratios(
                g["arms"][CONTROL]["metrics"][SPEED[g["benchmark"]]],
                g["arms"][BASELINE]["metrics"][SPEED[g["benchmark"]]],
            )
        )
        for g in groups
        if g["benchmark"] in SPEED and CONTROL in g["arms"]
    }


def within_noise(groups, checks):
    """The speed misses that identical code matched: the arm is no further below 1 than its batch's
    stock_control is from 1. A miss outside this set is a measured cost."""
    floor, batch_of = noise_floor(groups), {}
    for g in groups:
        if g["benchmark"] in SPEED:
            for name in g["arms"]:
                batch_of[(g["benchmark"], _label(g), name)] = _batch_label(g)
    out = set()
    for model, arm, key, value, ok in checks:
        benchmark = key[0]
        control = floor.get((benchmark, batch_of.get((benchmark, model, arm))))
        if not ok and key[1] in ("wps", "speed", "like for like") and control is not None:
            if 1 - value <= abs(1 - control):
                out.add((model, arm, key))
    return out


def targets(groups):
    """(model, arm, (benchmark, check), measured, passed) for every target the issue sets: every
    QK-norm arm against the stock run of its own batch; the fused against the plain attention."""
    out = []

    def check(g, arm, key, value):
        goal = CHECKS[key][1]
        out.append(
            (_label(g), arm, key, value, value >= TARGET_SPEED if goal.startswith(">") else value <= TARGET_MEMORY)
        )

    for g in groups:
        if g["benchmark"] == "memory":
            base = g["arms"][BASELINE]
            for name in target_arms(g["arms"]):
                arm = g["arms"][name]
                if arm["info"].get("freed_memory_returned"):  # else it is the train peak again
                    check(g, name, ("memory", "peak"), _memory_ratio(arm, base))
        if g["benchmark"] in ("train", "generate"):
            base = g["arms"][BASELINE]
            metric = "wps" if g["benchmark"] == "train" else "sentences_per_s"
            for name in target_arms(g["arms"]):
                arm = g["arms"][name]
                speed = statistics.median(pair_ratios(arm["metrics"][metric], base["metrics"][metric]))
                if g["benchmark"] == "train":
                    check(g, name, ("train", "wps"), speed)
                    check(
                        g,
                        name,
                        ("train", "activations"),
                        arm["info"]["activations_mb"] / base["info"]["activations_mb"],
                    )
                else:
                    check(g, name, ("generate", "speed"), speed)
                    if LIKE_FOR_LIKE in g["arms"]:
                        same = g["arms"][LIKE_FOR_LIKE]["metrics"][metric]
                        check(
                            g,
                            name,
                            ("generate", "like for like"),
                            statistics.median(pair_ratios(arm["metrics"][metric], same)),
                        )
                check(g, name, (g["benchmark"], "memory"), _memory_ratio(arm, base))
        if g["benchmark"] == "attention":
            for case, times in g["cases"].items():
                if "fwd+bwd" in case and int(case.split("T=")[1].split()[0]) >= FUSED_FROM_T:
                    gain = statistics.median(pair_ratios(times[PLAIN], times[FUSED]))
                    out.append((_label(g), case, ("attention", f"{PLAIN} / {FUSED} time"), gain, gain >= 1.0))
    return out


def targets_tables(checks, noise=frozenset()):
    """One row per model and QK-norm arm, one column per target; then the attention targets.
    `noise`: the (model, arm, key) of the misses within their batch's noise floor, marked †."""
    cells, keys = {}, [k for k in CHECKS if any(c[2] == k for c in checks)]
    for model, arm, key, value, ok in checks:
        if key in CHECKS:
            mark = " †" if (model, arm, key) in noise else ""
            cells.setdefault((model, arm), {})[key] = f"{value:.3f}" if ok else f"**{value:.3f} MISS**{mark}"
    lines = []
    if cells:
        lines += [
            "| model | arm | " + " | ".join(f"{CHECKS[k][0]} {CHECKS[k][1]}" for k in keys) + " |",
            "|---|---|" + "---:|" * len(keys),
        ]
        lines += [
            f"| {model} | {arm} | " + " | ".join(row.get(k, "") for k in keys) + " |"
            for (model, arm), row in cells.items()
        ]
    attention = [c for c in checks if c[2] not in CHECKS]
    if attention:
        lines += ["", "| model | case | fused attention: qknorm_plain / qknorm time >= 1.0 |", "|---|---|---:|"]
        lines += [
            f"| {model} | {case} | {value:.3f}{'' if ok else ' MISS'} |" for model, case, _, value, ok in attention
        ]
    missed = sum(not c[4] for c in checks)
    summary = f"{len(checks) - missed} of {len(checks)} targets met" + (
        f"; {missed} missed (in bold)" if missed else ""
    )
    if noise:
        summary += (
            f", {len(noise)} of them within the noise floor (†: the arm is no further below 1 than "
            f"{CONTROL}, identical to {BASELINE}, measured in the same batch)"
        )
    lines += ["", summary + "."]
    return "\n".join(lines)


def noise_table(groups):
    floor = noise_floor(groups)
    if not floor:
        return ""
    rows = [
        f"| benchmark | batch | {CONTROL} / {BASELINE} (median of pairs) |",
        "|---|---|---:|",
        *(f"| {benchmark} | {batch} | {ratio:.3f} |" for (benchmark, batch), ratio in floor.items()),
    ]
    deviations = sorted(abs(1 - r) for r in floor.values())
    rows += [
        "",
        f"Identical code, two processes of one batch: {len(deviations)} batches, distance from 1 median "
        f"{statistics.median(deviations):.3f}, largest {deviations[-1]:.3f}.",
    ]
    return "\n".join(rows)


def _beamable_note(groups):
    arms = {
        name
        for g in groups
        if g["benchmark"] == "generate"
        for name, a in g["arms"].items()
        if a["info"].get("beamable")
    }
    if not arms:
        return "No arm used beamable cross attention."
    return (
        f"Beamable cross attention (one copy of the encoder's keys and values per sentence): "
        f"{', '.join(sorted(arms))}; fairseq's SequenceGenerator does not switch it on for `stock`."
    )


def render(result):
    meta, s = result["meta"], result["settings"]
    groups = result["groups"]
    machine = meta["device_name"]
    if meta["device"] == "cpu" and "cpu_flags" in meta:  # results from before the ISA was recorded lack it
        machine += f" ({cpu.isa(meta)})"
    lines = [
        f"Measured {meta['date']} on {machine}; torch {meta['torch']}, fairseq {meta['fairseq']}, "
        f"{meta['threads']} threads, {s['repeats']} interleaved rounds; load average (1 min) "
        f"{meta['load_start'][0]:.2f} at start, {meta['load_end'][0]:.2f} at end; commit {meta['commit']}.",
        f"Command: `{meta['command']}`. Raw numbers: `{meta['results_file']}`.",
        "",
    ]
    if meta.get("note"):
        lines[1:1] = [f"Machine: {meta['note']}"]
    if any(g["benchmark"] == "train" for g in groups):
        info = next(g for g in groups if g["benchmark"] == "train")["arms"][BASELINE]["info"]
        lines += [
            f"**Training**: target tokens per second (fairseq's wps) over {info['batches']} fixed batches "
            f"({info['sentences']} sentence pairs, --max-tokens {s['max_tokens']}); forward, label-smoothed "
            "cross entropy, backward, Adam step.",
            "",
            model_table(groups, "train", "wps", "wps_cpu", "wps"),
            "",
        ]
    if any(g["benchmark"] == "generate" for g in groups):
        info = next(g for g in groups if g["benchmark"] == "generate")["arms"][BASELINE]["info"]
        lines += [
            f"**Generation**: SequenceGenerator, beam {info['beam']}, {info['sentences']} source sentences, "
            f"incremental decoding, every hypothesis forced to {info['length']} tokens + </s>. "
            + _beamable_note(groups),
            "",
            model_table(
                groups,
                "generate",
                "sentences_per_s",
                "sentences_per_cpu_s",
                "sentences/s",
                extra=("tokens_per_s", "tokens/s"),
            ),
            "",
        ]
    if any(g["benchmark"] == "attention" for g in groups):
        lines += [
            f"**Attention layer alone** (median ms per call; ratios: median of per-round ratios). "
            f"fwd+bwd: {s['attention_tokens']} tokens per batch, padded; step: one decoding step of "
            f"{s['gen_sentences']} x beam {s['beam']} hypotheses against a cache of "
            f"{s['attention_cache']} (cross: the encoder states, beamable).",
            "",
            attention_table(groups),
            "",
        ]
    if any(g["benchmark"] == "memory" for g in groups):
        lines += [
            "**Peak memory, freed memory returned**: the training workload again, every batch once, each arm "
            "in its own process, where the C library returns every freed block of 128 KiB or more to the "
            "system (glibc's M_MMAP_THRESHOLD fixed): the peak resident memory then follows the memory in "
            "use, not the order in which the allocator's heap was filled.",
            "",
            memory_table(groups),
            "",
        ]
    if noise_floor(groups):
        lines += [
            f"**Noise floor**: {CONTROL} is {BASELINE} again in a second process of every batch.",
            "",
            noise_table(groups),
            "",
        ]
    checks = targets(groups)
    if checks:
        lines += [
            f"**Targets**: every QK-norm arm / the stock run of its own batch (generation also / "
            f"{LIKE_FOR_LIKE}); speed: median of per-round ratios.",
            "",
            targets_tables(checks, within_noise(groups, checks)),
        ]
    return "\n".join(lines) + "\n"
