"""Learning-rate sweep of small decoder-only language models, in the setting Wortsman et al. (2023)
first reported attention-logit growth and learning-rate sensitivity in: fairseq's transformer_lm
(stock), transformer_lm_qknorm with QKNorm (l2, learned g) and with QK LayerNorm, on English text.

    python -m experiments.lm_sweep --train TEXT [TEXT ...] --valid TEXT --work-dir work/lm_sweep \\
        --out-dir examples/lm_sweep [--lrs ...] [--seeds 1 2 3] [--updates 100] [--threads 1]

The text files default to $LM_SWEEP_TRAIN (several: separated by ':') and $LM_SWEEP_VALID. The
text is encoded with a sentencepiece BPE model trained on it (--vocab-size) and binarized by
fairseq-preprocess --only-source once, into WORK/bin. Every run is fairseq's language_modeling
task, model, criterion and Trainer, built from fairseq-train flags (results.json holds each run's
command), with blocks of --tokens-per-sample tokens (--sample-break-mode none). A configuration
of the sweep engine (experiments/sweep.py: the run records, the divergence rule, the tables and the
figures); here the attention statistics are taken on a fixed batch of validation blocks. tables.md
adds the learning-rate sensitivity of Wortsman et al.: the mean, over the swept rates, of
min(final loss, loss at initialization) minus the best final loss of the arm. Rerun with every run
already in OUT/results.json, it trains nothing and writes the figures and tables again.
"""

import functools
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

from experiments import sweep
from fairseq_qknorm_cli.files import fail, write_text

# Every arm: pre-norm with a final LayerNorm, 2 layers, 64 wide, 4 heads (head dim 16), FFN 256,
# shared input/output embeddings, no dropout. Only the attention differs. fairseq's `--arch
# transformer_lm` takes its dataclass defaults, which are post-norm (its named LM architectures and
# transformer_lm_qknorm are pre-norm): --decoder-normalize-before makes the stock arm pre-norm too.
# The arm names are the translation sweep's, so that the two sweeps' tables read alike.
MODEL = [
    "--decoder-normalize-before",
    "--decoder-layers",
    "2",
    "--decoder-embed-dim",
    "64",
    "--decoder-input-dim",
    "64",
    "--decoder-output-dim",
    "64",
    "--decoder-ffn-embed-dim",
    "256",
    "--decoder-attention-heads",
    "4",
    "--share-decoder-input-output-embed",
    "--dropout",
    "0.0",
    "--attention-dropout",
    "0.0",
]
ARMS = {
    "stock": ["--arch", "transformer_lm"],
    # g0 = log2(L^2 - L), L = --tokens-per-sample (every block is that long)
    "qknorm": [
        "--arch",
        "transformer_lm_qknorm",
        "--qk-norm",
        "l2",
        "--qk-scale",
        "learned",
        "--qk-scale-init",
        "auto",
    ],
    "qk_layernorm": ["--arch", "transformer_lm_qknorm", "--qk-norm", "layernorm", "--qk-scale", "none"],
}
TOKENS_PER_SAMPLE = 64
MAX_TOKENS = 1024  # 16 blocks per update
STATS_BLOCKS = 16  # the fixed batch: the first validation blocks


def prepare_data(work_dir: Path, train, valid, vocab_size) -> Path:
    """WORK/bin: the text, BPE-encoded by a sentencepiece model trained on the training text and
    binarized by fairseq-preprocess --only-source; built under a temporary name, then renamed."""
    bin_dir = work_dir / "bin"
    if (bin_dir / "dict.txt").exists():
        return bin_dir
    tmp = work_dir / "bin.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    tools = Path(sys.executable).parent

    def step(*cmd, stdout=None):
        print(f"| preparing data: {shlex.join(map(str, cmd))}", flush=True)
        proc = subprocess.run([str(c) for c in cmd], stdout=stdout, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            fail(f"{cmd[0]} failed:\n{proc.stderr[-2000:]}")

    step(
        tools / "fairseq-qknorm-spm-train",
        "--input",
        ",".join(map(str, train)),
        "--model_prefix",
        tmp / "spm",
        "--vocab_size",
        vocab_size,
    )
    for split, files in (("train", train), ("valid", [valid])):
        with open(tmp / f"{split}.sp", "w") as out:
            step(tools / "fairseq-qknorm-spm-encode", "--model", tmp / "spm.model", *files, stdout=out)
    step(
        tools / "fairseq-preprocess",
        "--only-source",
        "--trainpref",
        tmp / "train.sp",
        "--validpref",
        tmp / "valid.sp",
        "--destdir",
        tmp,
        "--workers",
        "1",
    )
    os.replace(tmp, bin_dir)
    return bin_dir


def real_positions(sample, padding_idx):
    """The real (query, key) positions of the fixed batch of validation blocks, the same for every
    self-attention module; the causal mask's -inf logits are left out of the largest logit."""
    valid = sample["net_input"]["src_tokens"].ne(padding_idx)
    return lambda where: (valid, valid)


SWEEP = sweep.Sweep(
    name="lm_sweep",
    task=["--task", "language_modeling", "--sample-break-mode", "none", "--tokens-per-sample", str(TOKENS_PER_SAMPLE)],
    arms=ARMS,
    model=MODEL,
    criterion=["--criterion", "cross_entropy"],
    max_tokens=MAX_TOKENS,
    stats_items=STATS_BLOCKS,
    real_positions=real_positions,
    lrs=[3e-3, 1e-2, 3e-2, 1e-1, 3e-1],
    updates=100,
    warmup_updates=25,
    stats_interval=20,
    threads=1,
    work_dir_holds="the binarized text (made once)",
    out_dir_holds="results.json, the figures and the tables",
)


def sensitivity(runs):
    """Wortsman et al.'s learning-rate sensitivity per arm, over its seeds' mean final loss at each
    rate: mean over rates of min(final loss, initial loss) minus the arm's best; a diverged run
    counts as the initial loss (bits per token)."""
    out = {}
    for arm in ARMS:
        rows = [sweep.summarize(r) for r in runs if r["arm"] == arm]
        if not rows:
            continue
        initial = max(r["stats"][0]["loss"] for r in runs if r["arm"] == arm)
        per_lr = {}
        for lr in sorted({r["lr"] for r in rows}):
            finals = [
                r["final"] if r["final"] is not None and math.isfinite(r["final"]) else initial
                for r in rows
                if r["lr"] == lr
            ]
            per_lr[lr] = min(sum(finals) / len(finals), initial)
        best = min(per_lr.values())
        out[arm] = {
            "sensitivity": sum(v - best for v in per_lr.values()) / len(per_lr),
            "best_final": best,
            "initial": initial,
            "lrs": len(per_lr),
        }
    return out


def sensitivity_table(runs):
    lines = [
        "| arm | LR sensitivity (bits/token) | best final loss | loss at initialization | rates |",
        "|---|---:|---:|---:|---:|",
    ]
    for arm, s in sensitivity(runs).items():
        lines.append(f"| {arm} | {s['sensitivity']:.3f} | {s['best_final']:.3f} | {s['initial']:.3f} | {s['lrs']} |")
    return "\n".join(lines)


def _text_files(value):
    return [Path(p) for p in value.split(os.pathsep) if p] if value else []


def parse_args(argv=None):
    p = sweep.argument_parser(SWEEP, __doc__)
    p.add_argument(
        "--train",
        nargs="+",
        type=Path,
        default=_text_files(os.environ.get("LM_SWEEP_TRAIN")),
        metavar="TEXT",
        help="English training text, one sentence a line (default: $LM_SWEEP_TRAIN)",
    )
    p.add_argument(
        "--valid",
        type=Path,
        default=os.environ.get("LM_SWEEP_VALID"),
        metavar="TEXT",
        help="validation text: the fixed batch of the attention statistics (default: $LM_SWEEP_VALID)",
    )
    p.add_argument("--vocab-size", type=sweep.positive_int, default=4000, help="sentencepiece BPE vocabulary")
    args = sweep.parse_args(p, argv)
    if not args.train or not args.valid:
        p.error("--train and --valid (or $LM_SWEEP_TRAIN and $LM_SWEEP_VALID) are needed")
    for path in [*args.train, args.valid]:
        if not path.is_file():
            p.error(f"{path}: no such text file")
    return args


def main(argv=None):
    args = parse_args(argv)
    settings = {
        "model": MODEL,
        "arms": ARMS,
        "max_tokens": MAX_TOKENS,
        "tokens_per_sample": TOKENS_PER_SAMPLE,
        "vocab_size": args.vocab_size,
        "text": [p.name for p in [*args.train, args.valid]],
        "stats_blocks": STATS_BLOCKS,
        "window": sweep.WINDOW,
    }
    # The results name the text files, not where they were on this machine.
    named = {path: path.name for path in [*args.train, args.valid]}
    prepare = functools.partial(prepare_data, args.work_dir, args.train, args.valid, args.vocab_size)
    runs = sweep.run_sweep(SWEEP, args, argv, settings, prepare, named_paths=named)
    sweep.write_figures(runs, ARMS, args.out_dir, args.updates)
    tables = [sweep.markdown_table(runs, ARMS), sweep.seed_table(runs, ARMS), sensitivity_table(runs)]
    write_text(str(args.out_dir / "tables.md"), "\n\n".join(tables) + "\n")
    print("\n\n".join(tables))


if __name__ == "__main__":
    main()
