"""L and g0 from the training data: g0 = log2(L^2 - L), L = a percentile of sentence lengths.

L counts subword tokens without the </s> that fairseq appends. Each side's percentile is taken
and the larger one is L (the longer side bounds the attention matrices). On TED gl-en with an 8k
joint sentencepiece BPE model this is the English side: 97.5th percentile = 79, the paper's L.
"""

import math
import os

import numpy as np

from .errors import QKNormConfigError


def g0_for_length(length: float) -> float:
    """The paper's initial g: log2(L^2 - L), L = a high percentile of training sentence lengths."""
    if length < 2:
        raise QKNormConfigError(f"--qk-scale-init auto: the length L must be at least 2, got {length}")
    return math.log2(length * length - length)


def length_from_g0(g0: float) -> float:
    """Inverse of g0_for_length, to report L from a checkpoint."""
    return (1 + math.sqrt(1 + 4 * 2.0**g0)) / 2


def length_percentile(lengths, percentile: float) -> int:
    """The `percentile`-th percentile of `lengths`, as an observed length (numpy's "lower"); the
    percentile's range is checked with the flags (check_qk_flags)."""
    lengths = np.asarray(lengths)
    if lengths.size == 0:
        raise QKNormConfigError("--qk-scale-init auto: the training split has no sentences")
    return int(np.percentile(lengths, percentile, method="lower"))


def binarized_lengths(data_dir: str, split: str, src: str, tgt: str, lang: str) -> np.ndarray:
    """Token counts (without </s>) of one side of a fairseq-preprocess'ed split."""
    from fairseq.data import data_utils

    for pair in (f"{src}-{tgt}", f"{tgt}-{src}"):
        prefix = os.path.join(data_dir, f"{split}.{pair}.{lang}")
        if os.path.exists(prefix + ".idx"):
            dataset = data_utils.load_indexed_dataset(prefix, None)
            return np.asarray(dataset.sizes) - 1
    raise QKNormConfigError(
        f"--qk-scale-init auto: no training split '{split}.{src}-{tgt}.{lang}.idx' in {data_dir}; "
        "binarize the training data with fairseq-preprocess or pass --qk-scale-init FLOAT"
    )


def g0_from_data(data: str, split: str, src: str, tgt: str, percentile: float):
    """(L, g0) from the binarized training split (every shard of a colon-separated --data)."""
    shards = [d for d in str(data).split(os.pathsep) if d]
    per_side = []
    for lang in (src, tgt):
        lengths = np.concatenate([binarized_lengths(d, split, src, tgt, lang) for d in shards])
        per_side.append(length_percentile(lengths, percentile))
    length = max(per_side)
    return length, g0_for_length(length)
