"""Check a parallel corpus in the recipes' plain-text layout and copy it: IN/{train,dev,test}.{SRC,TGT}
(one sentence per line, the two sides aligned by line number) to OUT/, the same names.

    python -m experiments.check_text IN_DIR --src gl --tgt en --out OUT_DIR

What each kind of bad input gets, and why:
- not UTF-8: an error naming the file and line. sentencepiece, fairseq-preprocess and sacrebleu all
  read UTF-8; failing later would name a copy of the file and a byte offset, not the line to fix.
- the two sides with different line counts: an error. fairseq-preprocess binarizes each side on its
  own and never compares them; every pair after the first missing line would be misaligned.
- a carriage return inside a line: an error. Python's and fairseq's text readers end a line there, so
  that side would gain a line downstream. Windows line ends (CRLF) are read as plain line ends.
- an empty or whitespace-only side in train: the pair is dropped and counted, as fairseq's
  prepare-*.sh scripts do (clean-corpus-n.perl, minimum length 1) and as the TED reader drops rows
  with a side missing: such a pair teaches the model nothing but noise.
- the same in dev or test: an error naming the file and line. These sets are fixed by their release
  and the references are scored line by line against the translations: dropping the pair would score
  another test set than the one reported, keeping it would score a translation of nothing (or against
  an empty reference). Either is a choice to make knowingly, in the file.
Outputs are written to temporary names and renamed only once every split has passed: an error
leaves nothing in OUT_DIR.
"""

import argparse
import itertools
import os

from fairseq_qknorm_cli.files import atomic_paths, fail

SPLITS = ("train", "dev", "test")
SHOWN = 5  # line numbers listed in the log of dropped pairs


class TextError(ValueError):
    pass


def utf8_lines(binary_lines, name):
    """Yield the text of each line of a binary file (split on '\\n' only, line end removed), decoded
    line by line so that an error can name the line (a text-mode reader decodes in 8 KiB blocks)."""
    for number, raw in enumerate(binary_lines, start=1):
        raw = raw.rstrip(b"\n")
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TextError(
                f"{name}:{number}: not valid UTF-8 ({e.reason}, byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line);"
                " convert the file to UTF-8 (e.g. iconv -f LATIN1 -t UTF-8)"
            ) from None
        if "\r" in text:
            raise TextError(
                f"{name}:{number}: a carriage return (\\r) inside the line: text tools would split the line there;"
                " replace it (e.g. tr '\\r' ' ')"
            )
        yield text


def read_lines(path):
    """Yield (line number, text) of a UTF-8 text file."""
    with open(path, "rb") as f:
        yield from enumerate(utf8_lines(f, path), start=1)


def copy_split(src_path, tgt_path, out_src, out_tgt, drop_blank):
    """Copy one split, checked; return (pairs kept, line numbers of the pairs dropped)."""
    kept, dropped = 0, []
    src_lines, tgt_lines = read_lines(src_path), read_lines(tgt_path)
    with open(out_src, "w", encoding="utf-8") as fs, open(out_tgt, "w", encoding="utf-8") as ft:
        for s, t in itertools.zip_longest(src_lines, tgt_lines):
            if s is None or t is None:
                short, long_path, long_lines, n = (
                    (src_path, tgt_path, tgt_lines, t[0]) if s is None else (tgt_path, src_path, src_lines, s[0])
                )
                total = n + sum(1 for _ in long_lines)
                raise TextError(
                    f"{short} has {n - 1} lines, {long_path} has {total}: the two sides must have one sentence per line, aligned"
                )
            number = s[0]
            blank = [path for path, (_, text) in ((src_path, s), (tgt_path, t)) if not text.strip()]
            if blank:
                if drop_blank:
                    dropped.append(number)
                    continue
                raise TextError(
                    f"{blank[0]}:{number}: empty or whitespace-only line in a dev/test set; such pairs are dropped from"
                    " train only (the references must stay those of the released set): remove or fix the pair on both sides"
                )
            fs.write(s[1] + "\n")
            ft.write(t[1] + "\n")
            kept += 1
    return kept, dropped


def check_corpus(in_dir, src, tgt, out_dir):
    """Check and copy every split; return {split: (kept, dropped line numbers)}. On error, nothing is
    left in out_dir."""
    inputs = {(split, lang): os.path.join(in_dir, f"{split}.{lang}") for split in SPLITS for lang in (src, tgt)}
    for path in inputs.values():
        if not os.path.isfile(path):
            raise TextError(f"{path}: no such file (expected {{train,dev,test}}.{{{src},{tgt}}} in {in_dir})")
    os.makedirs(out_dir, exist_ok=True)
    keys = list(inputs)
    counts = {}
    with atomic_paths([os.path.join(out_dir, os.path.basename(inputs[key])) for key in keys]) as tmps:
        tmp = dict(zip(keys, tmps))
        for split in SPLITS:
            counts[split] = copy_split(
                inputs[split, src], inputs[split, tgt], tmp[split, src], tmp[split, tgt], drop_blank=split == "train"
            )
            if counts[split][0] == 0:
                raise TextError(f"{inputs[split, src]}: no sentence pairs")
    return counts


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m experiments.check_text",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("in_dir", help="directory holding {train,dev,test}.{SRC,TGT}")
    parser.add_argument("--src", required=True, help="source language code (the file extension)")
    parser.add_argument("--tgt", required=True, help="target language code")
    parser.add_argument("--out", required=True, help="output directory (the same file names)")
    args = parser.parse_args(argv)
    try:
        counts = check_corpus(args.in_dir, args.src, args.tgt, args.out)
    except (TextError, OSError) as e:
        fail(str(e))
    for split in SPLITS:
        kept, dropped = counts[split]
        line = f"{split}: {kept} sentence pairs"
        if dropped:
            shown = ", ".join(map(str, dropped[:SHOWN])) + (", ..." if len(dropped) > SHOWN else "")
            line += f", {len(dropped)} dropped (an empty or whitespace-only side: line {shown})"
        print(line)


if __name__ == "__main__":
    main()
