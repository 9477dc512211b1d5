"""Dev loss and dev BLEU at each validation, read from fairseq-train logs, one line per run.

    python -m experiments.plot_dev OUT.png LABEL=WORK/arms/baseline-seed1/train.log LABEL=... [--title T]

A label ending in "(dashed)" is drawn dashed: an earlier run beside the current one.
"""

import argparse
import sys

from experiments.fairseq_logs import parse_valid_line


def read_valid(path):
    """[(updates, dev loss in bits, dev BLEU)] from fairseq's `valid` lines (--log-format simple)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            valid = parse_valid_line(line)
            if valid and valid[1] is not None:
                rows.append(valid)
    if not rows:
        sys.exit(f"error: {path}: no 'valid on' lines with a bleu (was it trained with --eval-bleu?)")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", help="the PNG to write")
    p.add_argument("runs", nargs="+", metavar="LABEL=TRAIN_LOG")
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    runs = []
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        if not sep:
            p.error(f"expected LABEL=TRAIN_LOG, got {spec!r}")
        runs.append((label, read_valid(path)))

    from fairseq_qknorm_cli import plots

    plots.require_matplotlib()
    plots.dev_curves(
        args.out,
        args.title,
        [(label.removesuffix(" (dashed)"), label.endswith(" (dashed)"), rows) for label, rows in runs],
    )
    print(args.out)


if __name__ == "__main__":
    main()
