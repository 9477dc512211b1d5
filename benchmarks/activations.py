"""Activation memory of every model arm, without timing: `python -m benchmarks.activations`.

MiB of tensors that autograd keeps for backward in one training forward (model and label-smoothed
cross entropy) on the largest batch of the training benchmark, parameters left out; and the ratio to
stock. An exact count, so a busy machine does not change it, and it takes seconds per arm where the
training benchmark at glen size takes minutes."""

import argparse
import os
import sys

from .lengths import read_pair_lengths
from .run import FULL, GENERATE_ONLY, LENGTHS_ENV, MODEL_ARMS


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.activations", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", choices=("glen", "small", "tiny"), default=["glen", "small"])
    p.add_argument(
        "--lengths-from",
        default=os.environ.get(LENGTHS_ENV),
        metavar="SRC,TGT",
        help=f"as for benchmarks.run (default: ${LENGTHS_ENV})",
    )
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if not args.lengths_from or len(args.lengths_from.split(",")) != 2:
        p.error(f"--lengths-from SRC,TGT (or ${LENGTHS_ENV}) is needed")
    try:
        lengths = read_pair_lengths(*args.lengths_from.split(","))
    except ValueError as e:
        sys.exit(f"error: {e}")
    from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion

    from .arms import SIZES, build_model
    from .data import random_pairs, training_batches
    from .models_bench import activations_mb

    print("| model | arm | activations MiB | ratio to stock |\n|---|---|---:|---:|")
    for size in args.sizes:
        stock = None
        for arm in (a for a in MODEL_ARMS if a not in (*GENERATE_ONLY, "stock_control")):
            model, task = build_model(arm, SIZES[size], args.seed)
            criterion = LabelSmoothedCrossEntropyCriterion(task, sentence_avg=False, label_smoothing=0.1)
            data = random_pairs(lengths, FULL["train_sentences"], task.source_dictionary, args.seed, FULL["max_len"])
            batches = training_batches(data, FULL["max_tokens"], args.seed)
            largest = max(batches, key=lambda b: b["net_input"]["src_tokens"].numel() + b["target"].numel())
            mib = activations_mb(model.train(), lambda: criterion(model, largest))  # noqa: B023 (called here)
            stock = stock or mib
            print(f"| {size} fp32 | {arm} | {mib:,.1f} | {mib / stock:.3f} |", flush=True)


if __name__ == "__main__":
    main()
