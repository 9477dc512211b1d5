"""Sentence-pair lengths of a parallel corpus (numpy only: read before fairseq is imported)."""

import functools

import numpy as np


@functools.cache  # every workload of a process reads the same text: once
def read_pair_lengths(src_path: str, tgt_path: str) -> np.ndarray:
    """(n, 2) source and target lengths of the non-empty pairs of a parallel corpus."""
    try:
        with open(src_path, encoding="utf-8") as s, open(tgt_path, encoding="utf-8") as t:
            src, tgt = [len(x.split()) for x in s], [len(x.split()) for x in t]
    except OSError as e:
        raise ValueError(f"--lengths-from: cannot read {e.filename}: {e.strerror}") from None
    if len(src) != len(tgt):
        raise ValueError(f"--lengths-from: {src_path} has {len(src)} lines, {tgt_path} {len(tgt)}")
    pairs = np.array([(a, b) for a, b in zip(src, tgt) if a and b], dtype=np.int64).reshape(-1, 2)
    if len(pairs) == 0:
        raise ValueError(f"--lengths-from: no non-empty sentence pairs in {src_path}, {tgt_path}")
    return pairs
