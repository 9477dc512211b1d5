"""L and g0 from the training data: g0 = log2(L^2 - L), L = a percentile of sentence lengths.

L counts subword tokens without the </s> that fairseq appends. Each side's percentile is taken
and the larger one is L (the longer side bounds the attention matrices). On TED gl-en with an 8k
joint sentencepiece BPE model this is the English side: 97.5th percentile = 79, the paper's L.
"""

import math
import os
from typing import Dict, Tuple

import numpy as np

from .errors import QKNormConfigError


def g0_for_length(length: float) -> float:
    """The paper's initial g: log2(L^2 - L), L = a high percentile of training sentence lengths."""
    if length < 2:
        raise QKNormConfigError(f"--qk-scale-init auto: the length L must be at least 2, got {length}")
    return math.log2(length * length - length)


def length_from_g0(g0: float) -> float:
    """Inverse of g0_for_length, to report L from a checkpoint; inf for a g0 beyond any float length."""
    try:
        return (1 + math.sqrt(1 + 4 * 2.0**g0)) / 2
    except OverflowError:
        return math.inf


def length_percentile(lengths, percentile: float) -> int:
    """The `percentile`-th percentile of `lengths`, as an observed length (numpy's "lower"); the
    percentile's range is checked with the flags (check_qk_flags)."""
    lengths = np.asarray(lengths)
    if lengths.size == 0:
        raise QKNormConfigError("--qk-scale-init auto: the training split has no sentences")
    return int(np.percentile(lengths, percentile, method="lower"))


def training_pairs(task, split: str) -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
    """{language pair: (source sizes, target sizes)} of every pair the task reads from SPLIT, in
    every shard of its data. Sizes as the task's datasets hold them: </s> included, and any token
    the task puts in front (the multilingual task's language tokens). Read through the task's own
    loading, so that what counts is what it trains on, then dropped: fairseq-train loads the
    split itself, later, for its first epoch."""
    data = getattr(getattr(task, "cfg", None), "data", None) or getattr(getattr(task, "args", None), "data", None)
    if not data:
        raise QKNormConfigError("--qk-scale-init auto needs the task's binarized training data; pass a number instead")
    pairs = {}
    for epoch in range(1, len(str(data).split(os.pathsep)) + 1):  # fairseq reads shard (epoch - 1) % shards
        try:
            datasets = _pair_datasets(task, split, epoch)
        except FileNotFoundError as e:
            raise QKNormConfigError(
                f"--qk-scale-init auto: no training split '{split}' in {data} ({e}); binarize the training "
                "data with fairseq-preprocess or pass --qk-scale-init FLOAT"
            ) from None
        for name, dataset in datasets:
            src, tgt = _pair_sizes(dataset, task)
            before = pairs.get(name, (np.zeros(0, np.int64), np.zeros(0, np.int64)))
            pairs[name] = (np.concatenate([before[0], src]), np.concatenate([before[1], tgt]))
    return pairs


def _pair_datasets(task, split, epoch):
    manager = getattr(task, "data_manager", None)
    if manager is not None:  # translation_multi_simple_epoch: one dataset per language pair, before sampling
        datasets, _ = manager.load_split_datasets(split, True, epoch=epoch, combine=True, shard_epoch=epoch)
        return [(key.split(":", 1)[-1], dataset) for key, dataset in datasets]
    kept = task.datasets.pop(split, None)
    task.load_dataset(split, epoch=epoch, combine=True)
    dataset = task.datasets.pop(split)
    if kept is not None:
        task.datasets[split] = kept
    return [(f"{task.cfg.source_lang}-{task.cfg.target_lang}", dataset)]


def _pair_sizes(dataset, task):
    inner = dataset
    while not hasattr(inner, "src_sizes") and hasattr(inner, "dataset"):  # wrappers (TransformEosLangPairDataset)
        inner = inner.dataset
    if getattr(inner, "tgt_sizes", None) is None:
        raise QKNormConfigError(
            f"--qk-scale-init auto: the task {type(task).__name__} gives no sentence pairs to measure; "
            "pass --qk-scale-init FLOAT"
        )
    return np.asarray(inner.src_sizes, dtype=np.int64), np.asarray(inner.tgt_sizes, dtype=np.int64)


def pairs_within(pairs, max_positions) -> Tuple[Dict[str, Tuple[np.ndarray, np.ndarray]], int]:
    """(the pairs fairseq-train keeps, how many it skips): those whose sides, </s> included, fit
    max_positions = (source, target), None where unbounded (fairseq's filter_indices_by_size)."""
    kept, skipped = {}, 0
    for name, (src, tgt) in pairs.items():
        fits = np.ones(len(src), dtype=bool)
        for sizes, bound in zip((src, tgt), max_positions or (None, None)):
            if bound is not None:
                fits &= sizes <= bound
        kept[name] = (src[fits], tgt[fits])
        skipped += int((~fits).sum())
    return kept, skipped


def g0_from_pairs(pairs: Dict[str, Tuple[np.ndarray, np.ndarray]], percentile: float):
    """(L, g0) from {language pair: (source sizes, target sizes)}, sizes with </s>: L counts the
    tokens without it. Each side's percentile over all pairs; the longer side is L."""
    per_side = [
        length_percentile(np.concatenate([sides[i] for sides in pairs.values()]) - 1, percentile) for i in (0, 1)
    ]
    length = max(per_side)
    return length, g0_for_length(length)
