"""Learning-rate sweep: does QK normalization keep a tiny translation model trainable at high peak
learning rates? (Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training
instabilities": attention logits grow at high learning rates until training diverges;
qk-layernorm prevents it.)

    python -m experiments.lr_sweep --work-dir work/lr_sweep --out-dir examples/lr_sweep \\
        [--arms stock qknorm qk_layernorm] [--lrs 3e-4 1e-3 ...] [--seeds 1] [--updates 300] [--threads 2]

A configuration of the sweep engine (experiments/sweep.py, which says what a run records and when
it counts as diverged): fairseq's translation task on the generated toy corpus, word level,
binarized once into WORK/bin; the attention statistics are taken on a fixed batch of dev
sentences. Writes OUT/results.json, OUT/final_loss_vs_lr.png and OUT/max_logit_vs_lr.png, and
prints the table. Rerun with every run already in OUT/results.json, it trains nothing and writes
the figures and the table again.
"""

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from experiments import sweep
from fairseq_qknorm_cli.files import fail

# Same dims for every arm: pre-norm, 2+2 layers, 64 wide, 4 heads (head dim 16), shared
# embeddings, no dropout (nothing to hide a divergence). Only the attention differs.
MODEL = [
    "--encoder-layers",
    "2",
    "--decoder-layers",
    "2",
    "--encoder-embed-dim",
    "64",
    "--decoder-embed-dim",
    "64",
    "--encoder-ffn-embed-dim",
    "256",
    "--decoder-ffn-embed-dim",
    "256",
    "--encoder-attention-heads",
    "4",
    "--decoder-attention-heads",
    "4",
    "--encoder-normalize-before",
    "--decoder-normalize-before",
    "--share-all-embeddings",
    "--dropout",
    "0.0",
]
ARMS = {
    "stock": ["--arch", "transformer"],
    # g0 = log2(L^2 - L), L = 97.5th percentile of the binarized training lengths (the paper's rule)
    "qknorm": ["--arch", "transformer_qknorm", "--qk-norm", "l2", "--qk-scale", "learned", "--qk-scale-init", "auto"],
    "qk_layernorm": ["--arch", "transformer_qknorm", "--qk-norm", "layernorm", "--qk-scale", "none"],
}
MAX_TOKENS = 1024
CORPUS = {"train": 4000, "dev": 200, "seed": 1}  # the generated toy corpus, word level (no subwords)
STATS_SENTENCES = 32  # the fixed batch: the first dev sentences


def prepare_data(work_dir: Path) -> Path:
    """WORK/bin: the generated toy corpus, binarized by fairseq-preprocess with a joined dictionary.
    Built under a temporary name and renamed, so an existing WORK/bin is complete and is reused."""
    from fairseq_qknorm_cli.toy_corpus import write_corpus

    bin_dir = work_dir / "bin"
    if (bin_dir / "dict.src.txt").exists():
        return bin_dir
    if bin_dir.exists():
        fail(f"{bin_dir} exists but has no dict.src.txt (not made by this script?); delete it")
    raw, tmp = work_dir / "raw", work_dir / "bin.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted run
    write_corpus(raw, train=CORPUS["train"], dev=CORPUS["dev"], test=0, seed=CORPUS["seed"])
    cmd = [
        str(Path(sys.executable).parent / "fairseq-preprocess"),
        "--source-lang",
        "src",
        "--target-lang",
        "tgt",
        "--trainpref",
        str(raw / "train"),
        "--validpref",
        str(raw / "dev"),
        "--joined-dictionary",
        "--destdir",
        str(tmp),
        "--workers",
        "1",
    ]
    print(f"| preparing data: {shlex.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        fail(f"fairseq-preprocess failed:\n{proc.stderr[-2000:]}")
    os.replace(tmp, bin_dir)
    return bin_dir


def real_positions(sample, padding_idx):
    """The real (query, key) positions of each attention module of the fixed batch: source tokens
    for the encoder, target tokens for the decoder's queries."""
    from fairseq_qknorm_cli.attention_stats import query_and_key_mask

    net_input = sample["net_input"]
    src_valid, tgt_valid = net_input["src_tokens"].ne(padding_idx), net_input["prev_output_tokens"].ne(padding_idx)
    return lambda where: query_and_key_mask(where, src_valid, tgt_valid)


SWEEP = sweep.Sweep(
    name="lr_sweep",
    task=["--task", "translation", "--source-lang", "src", "--target-lang", "tgt"],
    arms=ARMS,
    model=MODEL,
    criterion=["--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1"],
    max_tokens=MAX_TOKENS,
    stats_items=STATS_SENTENCES,
    real_positions=real_positions,
    lrs=[3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1],
    updates=300,
    warmup_updates=75,
    stats_interval=10,
    threads=2,
    work_dir_holds="data (generated and binarized once)",
    out_dir_holds="results.json and the figures",
)


def parse_args(argv=None):
    return sweep.parse_args(sweep.argument_parser(SWEEP, __doc__), argv)


def main(argv=None):
    args = parse_args(argv)
    settings = {
        "model": MODEL,
        "arms": ARMS,
        "max_tokens": MAX_TOKENS,
        "corpus": CORPUS,
        "stats_sentences": STATS_SENTENCES,
        "window": sweep.WINDOW,
    }
    runs = sweep.run_sweep(SWEEP, args, argv, settings, lambda: prepare_data(args.work_dir))
    sweep.write_figures(runs, ARMS, args.out_dir, args.updates)
    print(sweep.markdown_table(runs, ARMS))
    if len({r["seed"] for r in runs}) > 1:
        print()
        print(sweep.seed_table(runs, ARMS))
    SWEEP.log(
        f"wrote {args.out_dir / 'results.json'}, {args.out_dir / 'final_loss_vs_lr.png'}, {args.out_dir / 'max_logit_vs_lr.png'}"
    )


if __name__ == "__main__":
    main()
