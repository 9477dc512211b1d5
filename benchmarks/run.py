"""Benchmark transformer_qknorm against fairseq's transformer: training, generation, the attention
layer alone and peak memory, each model arm in its own process, arms interleaved round by round.
`memory` runs the training workload once more, one round, in processes whose allocator returns
freed blocks to the system, for a peak memory that follows the memory in use.

    python -m benchmarks.run                      # CPU, both sizes (train, generate, memory: 28 to 32 min on 2 cores)
    python -m benchmarks.run --device cuda        # GPU, fp16 and bf16
    python -m benchmarks.run --quick              # tiny sizes, one round: checks that it runs
    python -m benchmarks.run --render FILE.json   # the Markdown tables of earlier results

Writes benchmarks/results/<device>-<date>.json and the tables into BENCHMARKS.md (between markers).
"""

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

from experiments.portable import portable
from fairseq_qknorm_cli.files import write_text

from . import cpu, report
from .lengths import read_pair_lengths
from .variants import QK_VARIANTS

ROOT = Path(__file__).resolve().parents[1]
MODEL_ARMS = ("stock", "stock_control", "stock_beamable", *QK_VARIANTS, "scalenorm_paper")
GENERATE_ONLY = ("stock_beamable",)  # in training it is stock
# Run beside every other arm, so that each arm has a back-to-back reference in every round.
# stock_control is stock again in a second process: how far apart identical code measures within
# a batch, the noise floor that every ratio of that batch carries.
BASELINES = {
    "train": ("stock", "stock_control"),
    "memory": ("stock", "stock_control"),
    "generate": ("stock", "stock_control", "stock_beamable"),
}
BENCHMARKS = ("train", "generate", "attention", "memory")
LENGTHS_ENV = "BENCH_LENGTHS_FROM"

FULL = dict(
    sizes=("glen", "small"),
    repeats=5,
    train_sentences=64,
    max_tokens=1024,
    gen_sentences=64,
    beam=5,
    max_len=256,
    attention_lengths=(16, 64, 256),
    attention_tokens=2048,
    attention_cache=64,
    attention_seconds=0.25,
)
QUICK = dict(
    sizes=("tiny",),
    repeats=1,
    train_sentences=12,
    max_tokens=64,
    gen_sentences=4,
    beam=5,
    max_len=8,
    attention_lengths=(4, 8),
    attention_tokens=16,
    attention_cache=4,
    attention_seconds=0.0,
)


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="tiny model, one round (what the test runs)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument(
        "--dtype",
        nargs="+",
        choices=("fp32", "fp16", "bf16"),
        help="precisions to run, one after the other (default: fp32 on cpu, fp16 bf16 on cuda)",
    )
    p.add_argument("--sizes", nargs="+", choices=("glen", "medium", "small"), help="model sizes (default: glen small)")
    p.add_argument("--benchmarks", nargs="+", choices=BENCHMARKS, default=list(BENCHMARKS))
    p.add_argument(
        "--arms",
        nargs="+",
        choices=MODEL_ARMS,
        default=list(MODEL_ARMS),
        help="model arms for train and generate (stock and stock_control always run: the ratios and "
        "their noise floor need them)",
    )
    p.add_argument("--repeats", type=int, help="interleaved rounds (default 5; 1 with --quick)")
    p.add_argument("--threads", type=int, default=2, help="torch threads in every worker (default 2)")
    p.add_argument(
        "--workers",
        type=int,
        default=7,
        help="model arms alive at once (default 7): the arms run in batches of this many, the "
        "baselines (stock, stock_control; stock_beamable in generation) in every batch. Each glen training "
        "worker holds about 2 GB",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--note", default="", help="what else ran on the machine, written into the results")
    p.add_argument(
        "--lengths-from",
        default=os.environ.get(LENGTHS_ENV),
        metavar="SRC,TGT",
        help=f"parallel text whose sentence lengths the batches copy, e.g. the TED gl-en training "
        f"text (default: ${LENGTHS_ENV})",
    )
    p.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument(
        "--markdown",
        metavar="FILE",
        help="file whose results section is rewritten (default: BENCHMARKS.md, none with --quick)",
    )
    p.add_argument("--render", metavar="JSON", help="only print (and write to --markdown) the tables of a results file")
    args = p.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats: expected a positive number")
    if args.threads < 1:
        p.error("--threads: expected a positive number")
    if args.device == "cpu" and args.dtype and args.dtype != ["fp32"]:
        p.error("--dtype fp16/bf16: only with --device cuda")
    if args.workers < len(BASELINES["generate"]) + 1:
        p.error(f"--workers: expected at least {len(BASELINES['generate']) + 1} (the baselines and one arm)")
    if not args.render and not args.lengths_from:
        p.error(
            f"--lengths-from SRC,TGT (or ${LENGTHS_ENV}) is needed: the parallel text whose sentence "
            "lengths the batches copy"
        )
    if not args.render and len(args.lengths_from.split(",")) != 2:
        p.error(f"--lengths-from: expected SRC,TGT (two files), got {args.lengths_from!r}")
    args.arms = ["stock", "stock_control", *(a for a in args.arms if a not in ("stock", "stock_control"))]
    return args


def settings_for(args):
    s = dict(QUICK if args.quick else FULL)
    if args.sizes and not args.quick:
        s["sizes"] = tuple(args.sizes)
    if args.repeats:
        s["repeats"] = args.repeats
    if args.benchmarks == ["memory"]:  # one round is all that runs
        s["repeats"] = 1
    s["dtypes"] = tuple(args.dtype or (["fp16", "bf16"] if args.device == "cuda" else ["fp32"]))
    return s


_START = time.monotonic()


def log(msg):
    print(f"| {time.monotonic() - _START:6.1f}s {msg}", file=sys.stderr, flush=True)


class Worker:
    """A forked (cpu) or spawned (cuda: no CUDA state may cross a fork) benchmark process."""

    def __init__(self, ctx, job, label):
        from .worker import serve

        self.label = label
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, job), daemon=True)
        self.proc.start()
        child.close()
        self.info = self._receive()["info"]

    def _receive(self):
        try:
            msg = self.conn.recv()
        except EOFError:
            self.proc.join()
            raise RuntimeError(f"{self.label}: the worker died (exit code {self.proc.exitcode})") from None
        if "error" in msg:
            raise RuntimeError(f"{self.label}: the worker failed:\n{msg['error']}")
        return msg

    def measure(self, unit):
        self.conn.send(("measure", unit))
        return self._receive()

    def close(self):
        self.conn.send(("stop", None))
        stats = self._receive()
        self.proc.join()
        return stats


def arm_batches(benchmark, arms, workers):
    """The arms' processes, in batches of at most `workers`, each with the baselines."""
    if benchmark == "attention":
        return [["all"]]  # one process: every arm is one module
    base = [a for a in BASELINES[benchmark] if a in arms]
    rest = [a for a in arms if a not in base and (benchmark == "generate" or a not in GENERATE_ONLY)]
    size = workers - len(base)
    return [base + rest[i : i + size] for i in range(0, len(rest), size)] or [base]


def run_group(ctx, benchmark, size, dtype, names, job_base, repeats):
    label = f"{benchmark} {size} {dtype}"
    job = dict(job_base, benchmark=benchmark, size=size, dtype=dtype)
    if benchmark == "memory":  # every batch once: the peak, not the speed
        repeats = 1
    workers = {}
    try:
        for name in names:  # one after the other, so that no build or warm-up overlaps another
            log(f"{label}: starting {name}")
            workers[name] = Worker(ctx, dict(job, arm=name), f"{label} {name}")
        units = {w.info["units"] for w in workers.values()}
        if len(units) != 1:
            raise RuntimeError(f"{label}: the arms got different numbers of batches: {units}")
        (n_units,) = units
        rounds = {name: [] for name in names}
        for r in range(repeats):
            parts = {name: [] for name in names}
            # A B C, then B C A, ...: batch by batch, each arm in every position of the order, so
            # that an effect of running right after a given arm cannot favour one arm.
            order = names[r % len(names) :] + names[: r % len(names)]
            for unit in range(n_units):
                for name in order:
                    parts[name].append(workers[name].measure(unit))
            for name in names:
                rounds[name].append(parts[name] if benchmark == "attention" else round_metrics(benchmark, parts[name]))
            log(
                f"{label}: round {r + 1}/{repeats} "
                + " ".join(f"{n}={_headline(benchmark, m[-1])}" for n, m in rounds.items())
            )
        stats = {name: w.close() for name, w in workers.items()}
    finally:
        for w in workers.values():
            if w.proc.is_alive():
                w.proc.kill()
    group = {"benchmark": benchmark, "size": size, "dtype": dtype}
    if benchmark == "attention":
        measured = [parts[0] for parts in rounds["all"]]
        group["info"] = workers["all"].info
        group["cases"] = {
            case: {arm: [m[case][arm] for m in measured] for arm in measured[0][case]} for case in measured[0]
        }
        return group
    group["arms"] = {
        name: dict(
            stats[name], info=workers[name].info, metrics={k: [m[k] for m in rounds[name]] for k in rounds[name][0]}
        )
        for name in names
    }
    if benchmark == "generate":  # the forced lengths make every arm do the same work: check it
        tokens = {n: a["metrics"]["output_tokens"] for n, a in group["arms"].items()}
        if len({tuple(t) for t in tokens.values()}) != 1:
            raise RuntimeError(f"{label}: the arms generated different numbers of tokens: {tokens}")
    return group


def round_metrics(benchmark, parts):
    """One arm's speeds over one round, from the sums over its units."""
    total = {k: sum(p[k] for p in parts) for k in parts[0]}
    if benchmark in ("train", "memory"):
        return {
            "wps": total["target_tokens"] / total["seconds"],
            "wps_cpu": total["target_tokens"] / total["cpu_seconds"],
        }
    return {
        "sentences_per_s": total["sentences"] / total["seconds"],
        "tokens_per_s": total["output_tokens"] / total["seconds"],
        "sentences_per_cpu_s": total["sentences"] / total["cpu_seconds"],
        "output_tokens": total["output_tokens"],
    }


def _headline(benchmark, m):
    if benchmark in ("train", "memory"):
        return f"{m['wps']:.0f}wps"
    if benchmark == "generate":
        return f"{m['sentences_per_s']:.2f}sent/s"
    return "done"


def git_commit():
    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        except OSError:  # no git on the machine (a lent GPU machine, say)
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+modified" if git("status", "--porcelain", "fairseq_qknorm") else "")


def record_folders(args, src, tgt):
    """{folder: variable} of the folders a results file names, so that it names none of this
    machine's: the repository as ".", the text of --lengths-from as $DATA_DIR, and a --results-dir
    or --markdown outside the repository as $RESULTS_DIR or $MARKDOWN."""
    folders = {ROOT: "."}
    src_dir, tgt_dir = os.path.dirname(os.path.abspath(src)), os.path.dirname(os.path.abspath(tgt))
    if src_dir == tgt_dir:
        folders[src_dir] = "$DATA_DIR"
    else:
        folders.update({src_dir: "$SRC_DIR", tgt_dir: "$TGT_DIR"})
    for path, name in ((args.results_dir, "$RESULTS_DIR"), (args.markdown, "$MARKDOWN")):
        if path and not Path(path).resolve().is_relative_to(ROOT):
            folders[path] = name
    return folders


def section(meta):
    """The section of BENCHMARKS.md a result goes to: one per CPU model, so that one CPU's results
    stand beside another's instead of replacing them, and one for CUDA."""
    return f"cpu ({meta['device_name']})" if meta["device"] == "cpu" else meta["device"]


def update_markdown(path: Path, name: str, table: str, writer: str = "benchmarks/run.py"):
    """Replace the section `name` between its markers; add the section if it is missing."""
    begin, end = f"<!-- BEGIN {name} results (written by {writer}) -->", f"<!-- END {name} results -->"
    text = path.read_text() if path.exists() else ""
    block = f"{begin}\n{table}{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + block + "\n"
    write_text(path, text)


def render_to(result, markdown):
    table = report.render(result)
    print(table)
    if markdown:
        update_markdown(Path(markdown), section(result["meta"]), table)


def main(argv=None):
    args = parse_args(argv)
    markdown = args.markdown if args.markdown is not None else (None if args.quick else str(ROOT / "BENCHMARKS.md"))
    if args.render:
        try:
            result = json.loads(Path(args.render).read_text())
        except (OSError, ValueError) as e:
            sys.exit(f"error: --render {args.render}: cannot read a results file ({e})")
        render_to(result, markdown)
        return
    s = settings_for(args)
    src, tgt = args.lengths_from.split(",")
    try:
        read_pair_lengths(src, tgt)
    except ValueError as e:
        sys.exit(f"error: {e}")
    # Imported here, once, before the workers fork: they start without importing fairseq again.
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():  # the workers are spawned: no fork issue
        sys.exit("error: --device cuda: torch sees no CUDA device")
    import fairseq
    import torch._dynamo  # noqa: F401  (torch.optim imports it on first use: seconds, once here)

    from . import arms, attention_bench, data, models_bench  # noqa: F401

    date = datetime.datetime.now()
    out = Path(args.results_dir) / f"{args.device}{'-quick' if args.quick else ''}-{date:%Y-%m-%d-%H%M}.json"
    folders = record_folders(args, src, tgt)
    command = shlex.join(argv if argv is not None else sys.argv[1:])
    machine = cpu.record()
    meta = {
        "date": date.isoformat(timespec="seconds"),
        "device": args.device,
        "device_name": f"{machine['cpu']}, {machine['cores']} cores" if args.device == "cpu" else "cuda",
        **machine,
        "torch": torch.__version__,
        "fairseq": fairseq.__version__,
        "python": platform.python_version(),
        "threads": args.threads,
        "commit": git_commit(),
        "load_start": os.getloadavg(),
        "note": args.note,
        "command": "python -m benchmarks.run " + portable(command, folders),
        "results_file": os.path.relpath(out, ROOT)
        if out.resolve().is_relative_to(ROOT)
        else portable(str(out), folders),
    }
    job_base = dict(
        device=args.device,
        threads=args.threads,
        seed=args.seed,
        lengths_from=(src, tgt),
        **{k: v for k, v in s.items() if k not in ("sizes", "dtypes", "repeats")},
    )
    ctx = multiprocessing.get_context("spawn" if args.device == "cuda" else "fork")
    groups = []
    try:
        for dtype in s["dtypes"]:
            for size in s["sizes"]:
                for benchmark in args.benchmarks:
                    for batch, names in enumerate(arm_batches(benchmark, args.arms, args.workers), 1):
                        group = run_group(ctx, benchmark, size, dtype, names, job_base, s["repeats"])
                        groups.append(dict(group, batch=batch))
    except RuntimeError as e:
        sys.exit(f"error: {e}")
    meta["load_end"] = os.getloadavg()
    if args.device == "cuda":
        first = groups[0]["info"] if "info" in groups[0] else next(iter(groups[0]["arms"].values()))["info"]
        meta["device_name"] = first["device_name"]
    result = {"meta": meta, "settings": dict(s, lengths_from=portable(args.lengths_from, folders)), "groups": groups}
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text(out, json.dumps(result, indent=1) + "\n")
    log(f"wrote {out}")
    render_to(result, markdown)


if __name__ == "__main__":
    main()
