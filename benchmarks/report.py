"""Statistics, targets and the Markdown tables, from a results JSON alone (no torch needed)."""
import statistics

BASELINE = "stock"  # fairseq's transformer
TARGET_SPEED = 0.97  # QKNorm / stock, median of the per-pair ratios
TARGET_MEMORY = 1.03  # peak RSS, QKNorm / stock
TARGET_ARM = "qknorm"  # transformer_qknorm as a user gets it: l2, learned g
LIKE_FOR_LIKE = {"generate": "stock_beamable"}  # the same decoding algorithm as TARGET_ARM
FUSED, PLAIN = "qknorm", "qknorm_plain"
FUSED_FROM_T = 64  # the fused path must be at least as fast as the plain one from this length on


def spread(values):
    return min(values), statistics.median(values), max(values)


def pair_ratios(values, baseline):
    """Round r of one arm against round r of the other: both ran back to back."""
    return [a / b for a, b in zip(values, baseline)]


def _fmt(x, digits=0):
    return f"{x:,.{digits}f}"


def _ratio(ratios):
    lo, med, hi = spread(ratios)
    return f"**{med:.3f}** ({lo:.3f}–{hi:.3f})" if len(ratios) > 1 else f"**{med:.3f}**"


def _label(group):
    return f"{group['size']} {group['dtype']}"


def _memory(arm, base):
    key = "peak_cuda_mb" if "peak_cuda_mb" in arm else "peak_rss_mb"
    return _fmt(arm[key]), f"{arm[key] / base[key]:.3f}"


def model_table(groups, benchmark, metric, cpu_metric, unit, extra=None):
    head = f"| model | arm | {unit} min | median | max |"
    rule = "|---|---|---:|---:|---:|"
    if extra:
        head += f" {extra[1]} median |"
        rule += "---:|"
    head += (f" ratio to {BASELINE} (median of pairs, min–max) | same, by CPU time |"
             " peak memory MB | memory ratio |")
    rule += "---:|---:|---:|---:|"
    if benchmark == "train":
        head += " activations MiB (ratio) |"
        rule += "---:|"
    rows = [head, rule]
    for g in (g for g in groups if g["benchmark"] == benchmark):
        base = g["arms"][BASELINE]
        for name, arm in g["arms"].items():
            lo, med, hi = spread(arm["metrics"][metric])
            row = f"| {_label(g)} | {name} | {_fmt(lo, 1)} | {_fmt(med, 1)} | {_fmt(hi, 1)} |"
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


def attention_table(groups):
    rows = []
    for g in (g for g in groups if g["benchmark"] == "attention"):
        arms = list(next(iter(g["cases"].values())))
        if not rows:
            rows = ["| model | case | " + " | ".join(f"{a} ms" for a in arms)
                    + f" | {FUSED} / {BASELINE} | {PLAIN} / {FUSED} |",
                    "|---|---|" + "---:|" * (len(arms) + 2)]
        for case, times in g["cases"].items():
            cells = " | ".join(f"{statistics.median(times[a]):.3f}" for a in arms)
            rows.append(f"| {_label(g)} | {case} | {cells} | {_ratio(pair_ratios(times[FUSED], times[BASELINE]))}"
                        f" | {_ratio(pair_ratios(times[PLAIN], times[FUSED]))} |")
    return "\n".join(rows)


def targets(groups):
    """(what, measured, goal, passed) for every target the issue sets."""
    out = []
    for g in groups:
        if g["benchmark"] in ("train", "generate") and TARGET_ARM in g["arms"] and BASELINE in g["arms"]:
            arm, base = g["arms"][TARGET_ARM], g["arms"][BASELINE]
            metric = "wps" if g["benchmark"] == "train" else "sentences_per_s"
            speed = statistics.median(pair_ratios(arm["metrics"][metric], base["metrics"][metric]))
            out.append((f"{g['benchmark']} {_label(g)}: {metric} {TARGET_ARM} / {BASELINE}",
                        speed, f">= {TARGET_SPEED}", speed >= TARGET_SPEED))
            same = LIKE_FOR_LIKE.get(g["benchmark"])
            if same in g["arms"]:
                speed = statistics.median(pair_ratios(arm["metrics"][metric], g["arms"][same]["metrics"][metric]))
                out.append((f"{g['benchmark']} {_label(g)}: {metric} {TARGET_ARM} / {same} (like for like)",
                            speed, f">= {TARGET_SPEED}", speed >= TARGET_SPEED))
            key = "peak_cuda_mb" if "peak_cuda_mb" in arm else "peak_rss_mb"
            memory = arm[key] / base[key]
            out.append((f"{g['benchmark']} {_label(g)}: peak memory {TARGET_ARM} / {BASELINE}",
                        memory, f"<= {TARGET_MEMORY}", memory <= TARGET_MEMORY))
        if g["benchmark"] == "attention":
            for case, times in g["cases"].items():
                if "fwd+bwd" in case and int(case.split("T=")[1].split()[0]) >= FUSED_FROM_T:
                    gain = statistics.median(pair_ratios(times[PLAIN], times[FUSED]))
                    out.append((f"attention {_label(g)} {case}: {PLAIN} / {FUSED} time", gain, ">= 1.0", gain >= 1.0))
    return out


def _beamable_note(groups):
    arms = {name for g in groups if g["benchmark"] == "generate" for name, a in g["arms"].items()
            if a["info"].get("beamable")}
    if not arms:
        return "No arm used beamable cross attention."
    return (f"Beamable cross attention (one copy of the encoder's keys and values per sentence): "
            f"{', '.join(sorted(arms))}; fairseq's SequenceGenerator does not switch it on for `stock`.")


def render(result):
    meta, s = result["meta"], result["settings"]
    groups = result["groups"]
    lines = [
        f"Measured {meta['date']} on {meta['device_name']}; torch {meta['torch']}, fairseq {meta['fairseq']}, "
        f"{meta['threads']} threads, {s['repeats']} interleaved rounds; load average (1 min) "
        f"{meta['load_start'][0]:.2f} at start, {meta['load_end'][0]:.2f} at end; commit {meta['commit']}.",
        f"Command: `{meta['command']}`. Raw numbers: `{meta['results_file']}`.",
        "",
    ]
    if any(g["benchmark"] == "train" for g in groups):
        info = next(g for g in groups if g["benchmark"] == "train")["arms"][BASELINE]["info"]
        lines += [f"**Training**: target tokens per second (fairseq's wps) over {info['batches']} fixed batches "
                  f"({info['sentences']} sentence pairs, --max-tokens {s['max_tokens']}); forward, label-smoothed "
                  "cross entropy, backward, Adam step.", "",
                  model_table(groups, "train", "wps", "wps_cpu", "wps"), ""]
    if any(g["benchmark"] == "generate" for g in groups):
        info = next(g for g in groups if g["benchmark"] == "generate")["arms"][BASELINE]["info"]
        lines += [f"**Generation**: SequenceGenerator, beam {info['beam']}, {info['sentences']} source sentences, "
                  f"incremental decoding, every hypothesis forced to {info['length']} tokens + </s>. "
                  + _beamable_note(groups), "",
                  model_table(groups, "generate", "sentences_per_s", "sentences_per_cpu_s", "sentences/s",
                              extra=("tokens_per_s", "tokens/s")), ""]
    if any(g["benchmark"] == "attention" for g in groups):
        lines += [f"**Attention layer alone** (median ms per call; ratios: median of per-round ratios). "
                  f"fwd+bwd: {s['attention_tokens']} tokens per batch, padded; step: one decoding step of "
                  f"{s['gen_sentences']} x beam {s['beam']} hypotheses against a cache of "
                  f"{s['attention_cache']} (cross: the encoder states, beamable).", "",
                  attention_table(groups), ""]
    checks = targets(groups)
    if checks:
        lines += ["**Targets**", "", "| target | measured | goal | |", "|---|---:|---|---|"]
        lines += [f"| {what} | {value:.3f} | {goal} | {'pass' if ok else 'MISS'} |" for what, value, goal, ok in checks]
    return "\n".join(lines) + "\n"
