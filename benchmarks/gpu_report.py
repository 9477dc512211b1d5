"""The GPU call's table (benchmarks/gpu_call.sh) from its results file alone (no torch needed): the
ratios to stock with their spread, the peak memory, the attention kernels, and what was not measured.

    python -m benchmarks.gpu_report OUT/gpu-table.json [--markdown OUT/gpu-table.md] [--finish]
    python -m benchmarks.gpu_report OUT/gpu-table.json --section BENCHMARKS.md

--finish, once the measuring process has ended: a part it was still measuring is marked cut off,
the parts it never reached are marked not run, and the results file is rewritten. --section puts
the table into a page's GPU section, between its markers. The last line printed says how many parts
were measured; the exit status is 0 when every part was measured with every arm."""

import argparse
import json
import statistics
import sys
from pathlib import Path

from fairseq_qknorm_cli.files import fail, write_text

from .report import BASELINE, CONTROL, TARGET_MEMORY, TARGET_SPEED, median_interval, pair_ratios, spread, target_arms
from .run import update_markdown

MEASURED = "measured"
BENCHMARK_TITLES = {
    "train": "Training: target tokens per second, fairseq's Trainer (the language model: tokens per second)",
    "generate": "Beam search: sentences per second",
}


def ratio_stats(values, base):
    """The median of the per-round ratios values / base (rounds run back to back), its 95%
    bootstrap interval, min and max; None without a pair."""
    ratios = pair_ratios(values, base)
    if not ratios:
        return None
    lo, med, hi = spread(ratios)
    low, high = median_interval(ratios) if len(ratios) > 1 else (med, med)
    return {"median": statistics.median(ratios), "low": low, "high": high, "min": lo, "max": hi, "pairs": len(ratios)}


def finish(result):
    """The parts of the plan that never finished, marked as such."""
    done = {p["name"] for p in result["parts"]}
    for p in result["parts"]:
        if p["status"] == "running":
            p["status"] = "cut off"
            p["note"] = "the call's time limit ended it (the log shows how far it got)"
    for name in result["meta"]["plan"]:
        if name not in done:
            result["parts"].append(dict(part_fields(name), status="not run", note="the call's time ran out first"))
    return result


def part_fields(name):
    benchmark, model, dtype = name.split("-")
    return {"name": name, "benchmark": benchmark, "model": model, "dtype": dtype}


def _mib(x):
    return "–" if x is None else f"{x / 2**20:,.0f}"


def _kernels(kernels):
    if kernels is None:
        return "–"
    return ", ".join(f"{k} ×{n}" for k, n in sorted(kernels.items())) or "none (matmul + softmax)"


def misses(row, arm):
    """The targets an arm misses in one row: speed below TARGET_SPEED, memory above TARGET_MEMORY."""
    if arm not in target_arms([arm]):
        return []
    out = []
    if row.get("ratio") and row["ratio"]["median"] < TARGET_SPEED:
        out.append("speed")
    if row.get("memory_ratio") is not None and row["memory_ratio"] > TARGET_MEMORY:
        out.append("memory")
    return out


def table(parts, benchmark):
    rows = [
        f"| model | precision | batch | arm | speed, median | ratio to {BASELINE} | 95% interval | min–max | "
        "peak MiB | memory ratio | attention kernels (SDPA, forward calls per unit) |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for p in parts:
        if p["benchmark"] != benchmark or p["status"] != MEASURED:
            continue
        for s in p["settings"]:
            for arm, row in s["arms"].items():
                r, missed = row.get("ratio"), misses(row, arm)
                speed = f"{statistics.median(row['speed']):,.1f}" if row["speed"] else "–"
                ratio = f"{r['median']:.3f}" if r else "–"
                if "speed" in missed:
                    ratio = f"**{ratio} MISS**"
                memory = "–" if row.get("memory_ratio") is None else f"{row['memory_ratio']:.3f}"
                if "memory" in missed:
                    memory = f"**{memory} MISS**"
                rows.append(
                    f"| {p['model']} | {p['dtype']} | {s['label']} | {arm} | {speed} | {ratio} | "
                    + (f"{r['low']:.3f}–{r['high']:.3f} | {r['min']:.3f}–{r['max']:.3f}" if r else "– | –")
                    + f" | {_mib(row.get('peak_bytes'))} | {memory} | {_kernels(p['arms'][arm].get('attention'))} |"
                )
    return rows if len(rows) > 2 else []


def render(result, level=1):
    """The Markdown page of the results; `level` is that of its first heading."""
    meta, parts = result["meta"], result["parts"]
    m = {k: "–" if v is None else v for k, v in meta["machine"].items()}  # a CPU has no driver, CUDA, cuDNN
    measured = [p for p in parts if p["status"] == MEASURED]
    lines = [
        "#" * level
        + " transformer_qknorm against stock fairseq on a GPU"
        + (" (dry run: tiny sizes)" if meta["smoke"] else ""),
        "",
        f"{m['device']}; driver {m['driver']}; torch {m['torch']}, CUDA {m['cuda']}, cuDNN {m['cudnn']}; "
        f"Python {m['python']}, fairseq {m['fairseq']}; {m['cpu']}, {m['cores']} cores; commit {m['commit']}, "
        f"plugin sha1 {m['plugin_sha1'][:12]}.",
        f"`{meta['command']}`, {meta['date']}: {len(measured)} of {len(meta['plan'])} parts measured.",
        "",
        f"Every arm of a part runs in one process, interleaved unit by unit, the order rotating each round; "
        f"a ratio is the median over rounds of arm / {BASELINE} in the same round, with a 95% bootstrap "
        f"interval and the min–max. {CONTROL} is {BASELINE} again: its ratio is the noise floor. Peak memory: "
        "the arm's own weights and optimizer state, plus the high-water mark of its largest unit "
        "(torch.cuda.max_memory_allocated). Targets for the qknorm arms: speed "
        f"{TARGET_SPEED} or more, memory {TARGET_MEMORY} or less; misses in bold.",
    ]
    for benchmark, title in BENCHMARK_TITLES.items():
        rows = table(parts, benchmark)
        if rows:
            lines += ["", f"{'#' * (level + 1)} {title}", "", *rows]
    notes = [f"- {p['name']}: {p['status']}: {p['note']}" for p in parts if p["status"] != MEASURED]
    for p in parts:
        for arm, a in p.get("arms", {}).items():
            if a.get("error"):
                notes.append(f"- {p['name']}, {arm}: failed: {a['error']}")
            if a.get("skipped_updates"):
                notes.append(
                    f"- {p['name']}, {arm}: {a['skipped_updates']} fp16 updates skipped (overflow), timed all the same"
                )
        if p.get("note") and p["status"] == MEASURED:
            notes.append(f"- {p['name']}: {p['note']}")
        if p.get("profile"):
            pr = p["profile"]
            notes.append(
                f"- {p['name']}: {pr['arm']} at {pr['ratio']:.3f} of {BASELINE} ({pr['setting']}): "
                "torch profiler tables of both in gpu-profile.txt"
            )
    if notes:
        lines += ["", f"{'#' * (level + 1)} Not measured, failed, profiled", "", *notes]
    checked = [
        (p, s, arm) for p in measured for s in p["settings"] for arm in s["arms"] if arm in target_arms(s["arms"])
    ]
    missed = [(p, s, arm) for p, s, arm in checked if misses(s["arms"][arm], arm)]
    lines += ["", f"Targets: {len(checked) - len(missed)} of {len(checked)} arm rows meet both."]
    return "\n".join(lines) + "\n"


def read(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        fail(f"{path}: cannot read the GPU call's results ({e})")


def write(result, path, markdown=None):
    write_text(path, json.dumps(result, indent=1) + "\n")
    if markdown:
        write_text(markdown, render(result))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_report", description=__doc__.split("\n")[0])
    p.add_argument("results", help="the call's gpu-table.json")
    p.add_argument("--markdown", help="write the table here (gpu-table.md)")
    p.add_argument("--finish", action="store_true", help="mark the parts that never finished, rewrite the results")
    p.add_argument("--section", metavar="PAGE", help="put the table into PAGE between its gpu-call markers")
    args = p.parse_args(argv)
    result = read(args.results)
    if args.finish:
        write(finish(result), args.results)
    text = render(result)
    if args.markdown:
        write_text(args.markdown, text)
    if args.section:
        update_markdown(Path(args.section), "gpu-call", render(result, level=3), writer="benchmarks/gpu_report.py")
    measured = sum(p["status"] == MEASURED for p in result["parts"])
    failed = [p["name"] for p in result["parts"] if p["status"] != MEASURED]
    arms = [f"{p['name']} {a}" for p in result["parts"] for a, v in p.get("arms", {}).items() if v.get("error")]
    print(
        f"{measured} of {len(result['meta']['plan'])} parts measured"
        + (f"; not measured: {', '.join(failed)}" if failed else "")
        + (f"; arms failed: {', '.join(arms)}" if arms else ""),
        file=sys.stderr,
    )
    sys.exit(0 if measured == len(result["meta"]["plan"]) and not arms else 1)


if __name__ == "__main__":
    main()
