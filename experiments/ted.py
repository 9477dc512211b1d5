"""Extract one language pair from Qi et al. (2018)'s multilingual TED corpus (`ted_talks.tar.gz`,
neulab/word-embeddings-for-nmt): `all_talks_{train,dev,test}.tsv`, a header row naming the columns
(`talk_name`, then one column per language code: en, gl, sk, ar, he, pt-br, ...), one aligned sentence
per row. A talk that has no translation into a language carries `__NULL__` there (`_ _ NULL _ _` once
tokenized); like the corpus' own reader (ted_reader.py), a row is dropped when either side is missing.

Writes OUTDIR/{train,dev,test}.{SRC,TGT}: the plain-text layout every recipe reads.

    python -m experiments.ted ted_talks.tar.gz --src gl --tgt en --out data/ted-gl-en
    python -m experiments.ted DIR_WITH_TSVS   --src gl --tgt en --out data/ted-gl-en
"""

import argparse
import os
import tarfile

from experiments.check_text import utf8_lines
from fairseq_qknorm_cli.files import atomic_paths, fail

SPLITS = ("train", "dev", "test")
NULL_MARKERS = ("__NULL__", "_ _ NULL _ _")


def is_missing(text):
    return not text or any(marker in text for marker in NULL_MARKERS)


def extract_pair(lines, src, tgt, name="<tsv>"):
    """Check the header now, then return an iterator over the (src, tgt) fields of every row of one
    all_talks_*.tsv (LINES: its lines as text), missing sides included."""
    header = next(lines, None)
    if header is None:
        raise ValueError(f"{name}: empty file, expected a header row of language codes")
    columns = header.rstrip("\n").split("\t")
    for lang in (src, tgt):
        if lang not in columns:
            languages = ", ".join(c for c in columns if c != "talk_name")
            raise ValueError(f"{name}: no column for language '{lang}' (the header has: {languages})")
    s, t = columns.index(src), columns.index(tgt)

    def rows():
        for number, line in enumerate(lines, start=2):
            fields = line.rstrip("\n").split("\t")
            if len(fields) != len(columns):
                raise ValueError(f"{name}:{number}: {len(fields)} tab-separated fields, the header has {len(columns)}")
            yield fields[s].strip(), fields[t].strip()

    return rows()


def write_split(lines, src, tgt, out_prefix, name):
    """Write OUT_PREFIX.{src,tgt} (complete files only); return (kept, dropped)."""
    kept = dropped = 0
    rows = extract_pair(iter(lines), src, tgt, name)
    with atomic_paths([f"{out_prefix}.{src}", f"{out_prefix}.{tgt}"]) as (tmp_src, tmp_tgt):
        with open(tmp_src, "w", encoding="utf-8") as fs, open(tmp_tgt, "w", encoding="utf-8") as ft:
            for a, b in rows:
                if is_missing(a) or is_missing(b):
                    dropped += 1
                    continue
                fs.write(a + "\n")
                ft.write(b + "\n")
                kept += 1
    return kept, dropped


def _tsv_sources(source):
    """{split: callable returning a line iterator} for a directory of tsv files or a tar archive."""
    if os.path.isdir(source):
        found = {}
        for split in SPLITS:
            path = os.path.join(source, f"all_talks_{split}.tsv")
            if not os.path.isfile(path):
                fail(f"{source}: no all_talks_{split}.tsv (expected the extracted ted_talks.tar.gz)")
            found[split] = path
        return found
    if os.path.isfile(source):
        return None  # an archive: read in one pass by extract_archive
    fail(f"no such file or directory: {source}")


def extract_archive(archive, src, tgt, outdir):
    """One streaming pass over ted_talks.tar.gz (~350 MB): no temporary copy of the tsv files."""
    done = {}
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:
                split = next((s for s in SPLITS if os.path.basename(member.name) == f"all_talks_{s}.tsv"), None)
                if split is None or not member.isfile():
                    continue
                name = f"{archive}:{member.name}"
                with tar.extractfile(member) as f:
                    done[split] = write_split(utf8_lines(f, name), src, tgt, os.path.join(outdir, split), name)
    except tarfile.TarError as e:
        fail(f"{archive}: not a readable tar archive ({e})")
    missing = [s for s in SPLITS if s not in done]
    if missing:
        fail(f"{archive}: no all_talks_{missing[0]}.tsv inside (is this ted_talks.tar.gz?)")
    return done


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m experiments.ted",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("source", help="ted_talks.tar.gz, or a directory holding all_talks_{train,dev,test}.tsv")
    parser.add_argument("--src", required=True, help="source language code as in the tsv header (e.g. gl)")
    parser.add_argument("--tgt", required=True, help="target language code (e.g. en)")
    parser.add_argument("--out", required=True, help="output directory for {train,dev,test}.{SRC,TGT}")
    args = parser.parse_args(argv)
    if args.src == args.tgt:
        fail("--src and --tgt must differ")
    os.makedirs(args.out, exist_ok=True)
    try:
        paths = _tsv_sources(args.source)
        if paths is None:
            counts = extract_archive(args.source, args.src, args.tgt, args.out)
        else:
            counts = {}
            for split, path in paths.items():
                with open(path, "rb") as f:  # decoded line by line: a UTF-8 error names its line
                    counts[split] = write_split(
                        utf8_lines(f, path), args.src, args.tgt, os.path.join(args.out, split), path
                    )
    except ValueError as e:
        fail(str(e))
    for split in SPLITS:
        kept, dropped = counts[split]
        print(f"{split}: {kept} {args.src}-{args.tgt} pairs, {dropped} rows dropped (a side missing)")


if __name__ == "__main__":
    main()
