"""spm_train / spm_encode / spm_decode for the recipes: the sentencepiece wheel ships the library
but not the C++ command-line tools. Flags follow the C++ tools for the options the recipes use."""

import argparse
import os
import sys

from .files import fail


def train_main(argv=None):
    parser = argparse.ArgumentParser(prog="fairseq-qknorm-spm-train", description="Train a sentencepiece model.")
    parser.add_argument("--input", required=True, help="comma-separated training text files")
    parser.add_argument("--model_prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    parser.add_argument("--vocab_size", type=int, default=8000)
    parser.add_argument("--model_type", default="bpe", choices=["bpe", "unigram", "char", "word"])
    parser.add_argument("--character_coverage", type=float, default=1.0)
    parser.add_argument("--input_sentence_size", type=int, default=0, help="sample this many sentences (0: all)")
    parser.add_argument("--seed", type=int, default=0, help="random seed for --input_sentence_size sampling")
    args = parser.parse_args(argv)
    import sentencepiece as spm

    inputs = args.input.split(",")
    for path in inputs:
        if not os.path.isfile(path):
            fail(f"--input: no such file: {path}")
    spm.set_random_generator_seed(args.seed)
    tmp_prefix = args.model_prefix + ".tmp"
    try:
        spm.SentencePieceTrainer.train(
            input=inputs,
            model_prefix=tmp_prefix,
            vocab_size=args.vocab_size,
            model_type=args.model_type,
            character_coverage=args.character_coverage,
            input_sentence_size=args.input_sentence_size,
            shuffle_input_sentence=args.input_sentence_size > 0,
            hard_vocab_limit=False,
            minloglevel=1,
        )
    except RuntimeError as e:
        fail(f"sentencepiece training failed: {str(e).strip().splitlines()[-1]}")
    for ext in (".model", ".vocab"):  # complete files only: a killed run leaves nothing behind
        os.replace(tmp_prefix + ext, args.model_prefix + ext)


def _load(model_path):
    import sentencepiece as spm

    if not os.path.isfile(model_path):
        fail(f"--model: no such sentencepiece model: {model_path}")
    return spm.SentencePieceProcessor(model_file=model_path)


def _lines(inputs):
    if not inputs:
        yield from sys.stdin
        return
    for path in inputs:
        if not os.path.isfile(path):
            fail(f"no such input file: {path}")
        with open(path, encoding="utf-8", errors="strict") as f:
            try:
                yield from f
            except UnicodeDecodeError as e:
                fail(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})")


def _convert_args(argv, prog, description, format_flag):
    """The shared command line of spm-encode / spm-decode: (model, format, input lines)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--model", required=True)
    parser.add_argument(format_flag, default="piece", choices=["piece", "id"])
    parser.add_argument("inputs", nargs="*", help="files (default: standard input)")
    args = parser.parse_args(argv)
    return _load(args.model), getattr(args, format_flag[2:]), _lines(args.inputs)


def encode_main(argv=None):
    sp, fmt, lines = _convert_args(argv, "fairseq-qknorm-spm-encode", "Text to subword pieces.", "--output_format")
    out_type = str if fmt == "piece" else int
    for line in lines:
        pieces = sp.encode(line.rstrip("\n"), out_type=out_type)
        sys.stdout.write(" ".join(map(str, pieces)) + "\n")


def decode_main(argv=None):
    sp, fmt, lines = _convert_args(argv, "fairseq-qknorm-spm-decode", "Subword pieces to text.", "--input_format")
    for line in lines:
        tokens = line.split()
        if fmt == "id":
            tokens = list(map(int, tokens))
        sys.stdout.write(sp.decode(tokens) + "\n")
