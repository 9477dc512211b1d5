"""Corpus BLEU and chrF from summed sentence statistics (experiments/corpus_scores.py) are
sacrebleu's corpus scores, to the last bit, on whole and on resampled test sets."""

import random

import numpy as np
import pytest
from sacrebleu.metrics import BLEU, CHRF

from experiments.corpus_scores import METRICS

SACREBLEU = {"bleu": lambda: BLEU(tokenize="none", force=True), "chrf": CHRF}


def corpus(seed):
    """References and hypotheses with the awkward cases: empty lines, lines shorter than the highest
    n-gram order, punctuation, repeated words, non-ASCII text."""
    rng = random.Random(seed)
    words = ["a", "the", "cat", "sat", "ö", "çà", ",", ".", "on", "mat", "x", "réunion", "a"]
    ref = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 15))) for _ in range(80)]
    hyp = [" ".join(w for w in line.split() if rng.random() < 0.7) for line in ref]
    hyp[3], ref[5], hyp[7] = "", "a", "a a a a a a a"
    return hyp, ref


@pytest.mark.parametrize("metric", ["bleu", "chrf"])
def test_summed_statistics_give_sacrebleus_corpus_score(metric):
    statistics, score = METRICS[metric]
    hyp, ref = corpus(0)
    stats = statistics(hyp, ref)
    assert stats.shape[0] == len(hyp)
    assert score(stats.sum(axis=0)) == SACREBLEU[metric]().corpus_score(hyp, [ref]).score
    rng = np.random.default_rng(1)
    for _ in range(5):
        rows = rng.integers(0, len(hyp), len(hyp))
        resampled = SACREBLEU[metric]().corpus_score([hyp[i] for i in rows], [[ref[i] for i in rows]]).score
        assert score(stats[rows].sum(axis=0)) == resampled


@pytest.mark.parametrize("metric", ["bleu", "chrf"])
def test_a_perfect_and_an_empty_translation(metric):
    statistics, score = METRICS[metric]
    ref = ["the cat sat on the mat", "a réunion ."]
    assert score(statistics(ref, ref).sum(axis=0)) == pytest.approx(100)
    assert score(statistics(["", ""], ref).sum(axis=0)) == 0
