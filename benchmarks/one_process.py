"""Training (or generation) time of a few model arms in one process: `python -m benchmarks.one_process`.

The runner (benchmarks.run) gives every arm its own process, and identical code measures a few
percent apart between processes. Here the arms share one process and are interleaved round by
round, so no process offset enters the ratios; with --profile, torch's profiler then says which
operators the time goes to, per arm. The workloads are the runner's: its training steps
(TrainBench), or with --benchmark generate its beam search (GenerateBench, stock_beamable the
like-for-like base). The arms of benchmarks.norm_bounds (one_pass, l2_compiled) put a stand-in in
the place of the l2 norm, to bound what a faster one could gain."""

import argparse
import os
import statistics
import sys

import torch

from . import cpu
from .lengths import read_pair_lengths
from .norm_bounds import STAND_INS, standing_in
from .report import median_interval, pair_ratios
from .run import FULL, LENGTHS_ENV, MODEL_ARMS
from .timing import timed


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.one_process", description=__doc__.split("\n")[0])
    p.add_argument("--benchmark", choices=("train", "generate"), default="train")
    p.add_argument("--size", choices=("glen", "medium", "small", "tiny"), default="small")
    p.add_argument(
        "--arms",
        nargs="+",
        choices=(*MODEL_ARMS, "no_qknorm", *STAND_INS),
        default=["stock", "qknorm", "qknorm_layernorm_learned"],
        help="the first is the base of the ratios; no_qknorm: the plugin's attention without QK-norm; "
        f"{', '.join(STAND_INS)}: qknorm with a stand-in for its norm (benchmarks.norm_bounds)",
    )
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="then profile three rounds of every arm")
    p.add_argument(
        "--flush-denormals",
        action="store_true",
        help="flush denormal floats to zero (torch.set_flush_denormal) in every thread: on a CPU where "
        "arithmetic on denormals is slow, this parts their cost from the arms' own",
    )
    p.add_argument("--lengths-from", default=os.environ.get(LENGTHS_ENV), metavar="SRC,TGT")
    args = p.parse_args(argv)
    if not args.lengths_from or len(args.lengths_from.split(",")) != 2:
        p.error(f"--lengths-from SRC,TGT (or ${LENGTHS_ENV}) is needed")
    if args.rounds < 1 or args.threads < 1:
        p.error("--rounds, --threads: expected positive numbers")
    if args.flush_denormals:  # before torch starts its threads
        try:
            cpu.flush_denormals()
        except RuntimeError as e:
            sys.exit(f"error: --flush-denormals: {e}")
    try:
        read_pair_lengths(*args.lengths_from.split(","))
    except ValueError as e:
        sys.exit(f"error: {e}")
    from .models_bench import GenerateBench, TrainBench

    bench_class = TrainBench if args.benchmark == "train" else GenerateBench
    torch.set_num_threads(args.threads)
    job = dict(FULL, device="cpu", threads=args.threads, seed=1, size=args.size, dtype="fp32")
    job.update(benchmark=args.benchmark, lengths_from=tuple(args.lengths_from.split(",")))
    benches = {}
    for arm in args.arms:
        with standing_in(arm):
            benches[arm] = bench_class(dict(job, arm="qknorm" if arm in STAND_INS else arm))

    def one_round(arm):
        bench = benches[arm]
        with standing_in(arm):
            return timed(lambda: [bench.measure(unit) for unit in range(bench.info["units"])], "cpu")

    seconds = {arm: [] for arm in args.arms}
    for r in range(args.rounds):
        order = args.arms[r % len(args.arms) :] + args.arms[: r % len(args.arms)]
        for arm in order:
            seconds[arm].append(one_round(arm))
    base = seconds[args.arms[0]]
    flushed = ", denormals flushed to zero" if args.flush_denormals else ""
    print(f"Machine: {cpu.describe(cpu.record())}; torch {torch.__version__}{flushed}\n")
    print(
        f"| {args.benchmark} {args.size} fp32, {args.threads} threads | ms per round, median | time / {args.arms[0]} "
        "(median of pairs) | 95% interval (bootstrap) |"
    )
    print("|---|---:|---:|---:|")
    for arm, values in seconds.items():
        ratios = pair_ratios(values, base)
        lo, hi = median_interval(ratios)
        print(
            f"| {arm} | {1000 * statistics.median(values):.1f} | {statistics.median(ratios):.3f} | {lo:.3f}–{hi:.3f} |"
        )
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for arm in benches:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    one_round(arm)
            print(f"\n{arm}, three rounds:")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=40))


if __name__ == "__main__":
    main()
