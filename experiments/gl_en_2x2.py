"""The 2x2 on TED gl-en: {ScaleNorm, LayerNorm} x {scaled dot product, QKNorm}, one record per run.

    python -m experiments.gl_en_2x2 pending RECORDS --seeds 1 2 3
        prints "NORM ATTENTION SEED" for every cell and seed without a record in RECORDS/runs.json
    python -m experiments.gl_en_2x2 record RECORDS --arm-dir DIR --norm N --attention A --seed S --data DATA_DIR
        scores DIR/test.hyp against DATA_DIR/test.en, copies it into RECORDS and appends one entry
        to RECORDS/runs.json (under a lock: two runs finish at the same time)
    python -m experiments.gl_en_2x2 report RECORDS --data DATA_DIR
        writes RECORDS/README.md and RECORDS/training-curves.png from runs.json and the hypotheses

A record holds what the report needs: test BLEU (sacrebleu, --tokenize none, the paper's tokenized
BLEU on the Moses-tokenized release) and chrF of the scored checkpoint (on the CPU the model at the budget's end,
checkpoint_last.pt: every run is scored after the same number of updates), the dev and training-loss curves from
fairseq-train's log, the learned g of every attention module, the training time and command, and
the sha1 of every data file, so runs on other data are never mixed into one table.
"""

import argparse
import os
import shutil

from experiments.fairseq_logs import parse_train_log, train_loss_curve
from experiments.gl_en_2x2_records import (
    CELLS,
    TGT,
    data_sha1,
    hyp_name,
    learned_g,
    locked,
    portable_command,
    read_runs,
    scored_dev,
    write_runs,
)
from experiments.gl_en_2x2_report import write_report
from experiments.results import read_commands, train_command
from fairseq_qknorm_cli.files import atomic_path, fail


def pending(records, seeds):
    done = {(r["norm"], r["attention"], r["seed"]) for r in read_runs(records)}
    return [(n, a, s) for s in seeds for n, a in CELLS if (n, a, s) not in done]


def record(args):
    from fairseq_qknorm_cli.score import ScoreError, score_systems

    hyp = os.path.join(args.arm_dir, "test.hyp")
    ref = os.path.join(args.data, f"test.{TGT}")
    try:
        scores = {tok: score_systems(ref, [hyp], tokenize=tok)["systems"][0] for tok in ("none", "13a")}
    except ScoreError as e:
        fail(str(e))
    log = parse_train_log(os.path.join(args.arm_dir, "train.log"))
    if not log["dev"]:
        fail(f"{args.arm_dir}/train.log: no validation with BLEU (did fairseq-train finish?)")
    with open(os.path.join(args.arm_dir, "train_seconds")) as f:
        seconds = int(f.read())
    entry = {
        "norm": args.norm,
        "attention": args.attention,
        "seed": args.seed,
        "updates": log["updates"],
        "test_bleu": round(scores["none"]["bleu"], 2),
        "test_bleu_13a": round(scores["13a"]["bleu"], 2),
        "test_chrf": round(scores["13a"]["chrf"], 2),
        "best_dev_bleu": max(b for _, _, b in log["dev"]),
        "scored_dev": scored_dev(log["dev"], args.checkpoint),
        "checkpoint": args.checkpoint,
        "hyp": hyp_name(args.norm, args.attention, args.seed),
        "dev": log["dev"],
        "train_loss": train_loss_curve(os.path.join(args.arm_dir, "train.log")),
        "g": learned_g(os.path.join(args.arm_dir, "checkpoints", args.checkpoint)),
        "L": log["L"],
        "g0": log["g0"],
        "params": log["params"],
        "train_seconds": seconds,  # of the last fairseq-train process: after its resume, if any
        "resumed_at_updates": log["resumed_at"],
        "threads": int(os.environ.get("OMP_NUM_THREADS", "0")) or None,
        "preset": args.preset,
        "train_command": portable_command(train_command(read_commands(args.commands), args.arm_dir), args.arm_dir)
        if args.commands
        else None,
        "data_sha1": data_sha1(args.data),
    }
    with locked(args.records):
        runs = read_runs(args.records)
        for other in runs:
            if other["data_sha1"] != entry["data_sha1"]:
                fail(
                    f"{args.data}: not the data of the runs recorded in {args.records}/runs.json "
                    f"(sha1 of the files differ); use another RECORDS folder"
                )
        with atomic_path(os.path.join(args.records, entry["hyp"])) as tmp:
            shutil.copyfile(hyp, tmp)
        runs = [r for r in runs if (r["norm"], r["attention"], r["seed"]) != (args.norm, args.attention, args.seed)]
        write_runs(args.records, runs + [entry])
    print(
        f"{args.norm} + {args.attention}, seed {args.seed}: test BLEU {entry['test_bleu']:.2f}, "
        f"chrF {entry['test_chrf']:.2f}, dev BLEU {entry['scored_dev'][2]:.2f}, {entry['updates']} updates"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m experiments.gl_en_2x2",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pending")
    p.add_argument("records")
    p.add_argument("--seeds", type=int, nargs="+", required=True)
    r = sub.add_parser("record")
    r.add_argument("records")
    r.add_argument("--arm-dir", required=True)
    r.add_argument("--norm", choices=("scalenorm", "layernorm"), required=True)
    r.add_argument("--attention", choices=("dot", "qknorm"), required=True)
    r.add_argument("--seed", type=int, required=True)
    r.add_argument("--data", required=True, help="the plain-text corpus: {train,dev,test}.{gl,en}")
    r.add_argument("--preset", required=True)
    r.add_argument("--commands", help="the recipe's WORK/commands.sh (for the training command)")
    r.add_argument(
        "--checkpoint",
        choices=("checkpoint_last.pt", "checkpoint_best.pt"),
        default="checkpoint_last.pt",
        help="the checkpoint DIR/test.hyp was translated with (default: checkpoint_last.pt)",
    )
    t = sub.add_parser("report")
    t.add_argument("records")
    t.add_argument("--data", required=True, help="the plain-text corpus the runs were scored on (its test.en)")
    args = parser.parse_args(argv)
    if args.command == "pending":
        for norm, attention, seed in pending(args.records, args.seeds):
            print(norm, attention, seed)
    elif args.command == "record":
        record(args)
    else:
        write_report(args.records, args.data)


if __name__ == "__main__":
    main()
