"""Batches with a real-looking length distribution: sentence-pair lengths (whitespace tokens) drawn
from a parallel corpus with a fixed seed, filled with random token ids. The ids do not change the
speed; the lengths, hence the padding and the batch shapes, do."""

import numpy as np
import torch
from fairseq.data import LanguagePairDataset


def random_pairs(lengths: np.ndarray, n: int, dictionary, seed: int, max_len: int) -> LanguagePairDataset:
    """n sentence pairs with lengths drawn from `lengths` (capped at max_len), each ending in </s>
    like fairseq's binarized data. Source left-padded, target right-padded: fairseq's defaults."""
    rng = np.random.default_rng(seed)
    picked = np.minimum(lengths[rng.integers(0, len(lengths), n)], max_len)
    gen = torch.Generator().manual_seed(seed)

    def sentence(length):
        ids = torch.randint(dictionary.nspecial, len(dictionary), (int(length),), generator=gen)
        return torch.cat([ids, torch.tensor([dictionary.eos()])])

    src = [sentence(a) for a, _ in picked]
    tgt = [sentence(b) for _, b in picked]
    return LanguagePairDataset(src, picked[:, 0] + 1, dictionary, tgt, picked[:, 1] + 1, dictionary, shuffle=False)


def training_batches(dataset: LanguagePairDataset, max_tokens: int, seed: int):
    """fairseq's batching (sorted by length, --max-tokens), the batches in a seeded random order."""
    batches = dataset.batch_by_size(dataset.ordered_indices(), max_tokens=max_tokens)
    order = np.random.default_rng(seed).permutation(len(batches))
    return [dataset.collater([dataset[int(i)] for i in batches[j]]) for j in order]


def one_batch(dataset: LanguagePairDataset):
    return dataset.collater([dataset[i] for i in range(len(dataset))])
