"""Corpus BLEU and chrF from per-sentence sufficient statistics, so that a resampled test set (a
paired bootstrap) is scored by summing rows instead of scoring its text again.

The numbers are sacrebleu's: BLEU with `--tokenize none` and chrF with its defaults (6 character
orders, no word n-grams, beta 2), through sacrebleu's public API only. BLEU's statistics are the
counts its sentence scores carry and its corpus score is `BLEU.compute_bleu`; chrF's statistics
are counted with sacrebleu's character n-gram helper, and its score follows sacrebleu's chrF
(precision and recall averaged over the orders that occur). Both equal sacrebleu's `corpus_score`
on the same sentences (tests/experiments/test_corpus_scores.py).
"""

import numpy as np
from sacrebleu.metrics import BLEU, CHRF
from sacrebleu.metrics.helpers import extract_all_char_ngrams

CHRF_BETA = CHRF.BETA


def bleu_statistics(hyps, refs):
    """One row per sentence: 4 matching n-gram counts, 4 n-gram totals, hypothesis and reference
    length."""
    metric = BLEU(tokenize="none", force=True, effective_order=True)  # effective_order: sentence scores only
    rows = []
    for hyp, ref in zip(hyps, refs, strict=True):
        s = metric.sentence_score(hyp, [ref])
        rows.append([*s.counts, *s.totals, s.sys_len, s.ref_len])
    return np.asarray(rows, dtype=np.int64).reshape(-1, 10)


def bleu_score(total):
    """Corpus BLEU from summed bleu_statistics rows."""
    total = [int(x) for x in total]
    return BLEU.compute_bleu(total[0:4], total[4:8], total[8], total[9], smooth_method="exp").score


def chrf_statistics(hyps, refs):
    """One row per sentence: per character order 1-6, the hypothesis n-grams (0 when the reference
    has none of that order), the reference n-grams and the matching ones."""
    rows = []
    for hyp, ref in zip(hyps, refs, strict=True):
        row = []
        for h, r in zip(extract_all_char_ngrams(hyp, CHRF.CHAR_ORDER), extract_all_char_ngrams(ref, CHRF.CHAR_ORDER)):
            matching = sum(min(count, r[gram]) for gram, count in h.items() if gram in r)
            row += [sum(h.values()) if r else 0, sum(r.values()), matching]
        rows.append(row)
    return np.asarray(rows, dtype=np.int64).reshape(-1, 3 * CHRF.CHAR_ORDER)


def chrf_score(total):
    """Corpus chrF from summed chrf_statistics rows: the F-beta of the precision and the recall
    averaged over the orders present in both hypothesis and reference."""
    precision = recall = 0.0
    orders = 0
    for n_hyp, n_ref, n_match in np.asarray(total).reshape(-1, 3).tolist():
        if n_hyp > 0 and n_ref > 0:
            precision += n_match / n_hyp
            recall += n_match / n_ref
            orders += 1
    if orders == 0:
        return 0.0
    precision, recall = precision / orders, recall / orders
    if precision + recall == 0:
        return 0.0
    factor = CHRF_BETA**2
    f_score = (1 + factor) * precision * recall  # in sacrebleu's order of operations: the same float
    f_score /= factor * precision + recall
    return 100 * f_score


# name: (per-sentence statistics, corpus score from their sum)
METRICS = {"bleu": (bleu_statistics, bleu_score), "chrf": (chrf_statistics, chrf_score)}
