"""The embedded default corpus: a deterministic synthetic language pair, generated, not downloaded.

The source language has a small grammar (determiners, adjectives, nouns, verbs, relative clauses);
the target language maps every word through a fixed lexicon, puts adjectives after their noun and
verbs at the end of each clause, like a Romance/SOV hybrid. It is learnable in minutes on a CPU,
so the pipeline's BLEU, chrF and significance test mean something; it is not a stand-in for TED.
Writes {train,dev,test}.{src,tgt} in the layout of the real corpora.
"""

import argparse
import os
import random

from .files import write_text

CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"


def _lexicon(rng, n, used):
    words = []
    while len(words) < n:
        w = "".join(rng.choice(CONSONANTS) + rng.choice(VOWELS) for _ in range(rng.randint(1, 3)))
        if w not in used:
            used.add(w)
            words.append(w)
    return words


def make_language_pair(seed=1):
    rng = random.Random(seed)
    used = set()
    classes = {"det": 6, "adj": 40, "noun": 120, "verb": 60, "rel": 2}
    src = {c: _lexicon(rng, n, used) for c, n in classes.items()}
    tgt = {c: _lexicon(rng, n, used) for c, n in classes.items()}
    lexicon = {s: t for c in classes for s, t in zip(src[c], tgt[c])}
    return src, lexicon


def _noun_phrase(rng, src):
    words = [("det", rng.choice(src["det"]))]
    words += [("adj", rng.choice(src["adj"])) for _ in range(rng.choice([0, 0, 1, 2]))]
    words.append(("noun", rng.choice(src["noun"])))
    return words


def _clause(rng, src, depth):
    """(subject, verb, object, relative clause or None); a relative clause is (rel word, clause)."""
    subject, verb, obj = _noun_phrase(rng, src), rng.choice(src["verb"]), _noun_phrase(rng, src)
    rel = None
    if depth < 2 and rng.random() < 0.35:
        rel = (rng.choice(src["rel"]), _clause(rng, src, depth + 1))
    return subject, verb, obj, rel


def _source_words(clause):
    subject, verb, obj, rel = clause
    words = [w for _, w in subject] + [verb] + [w for _, w in obj]
    return words + ([rel[0]] + _source_words(rel[1]) if rel else [])


def _target_order(clause):
    """Subject, object, verb; adjectives after their noun; relative clauses likewise."""
    subject, verb, obj, rel = clause

    def noun_phrase(phrase):
        return (
            [w for c, w in phrase if c == "det"]
            + [w for c, w in phrase if c == "noun"]
            + [w for c, w in phrase if c == "adj"]
        )

    words = noun_phrase(subject) + noun_phrase(obj) + [verb]
    return words + ([rel[0]] + _target_order(rel[1]) if rel else [])


def sentence_pair(rng, src, lexicon):
    clause = _clause(rng, src, 0)
    return " ".join(_source_words(clause)), " ".join(lexicon[w] for w in _target_order(clause))


def write_corpus(outdir, train=4000, dev=300, test=300, seed=1):
    src, lexicon = make_language_pair(seed)
    rng = random.Random(seed + 1)
    os.makedirs(outdir, exist_ok=True)
    for split, n in (("train", train), ("dev", dev), ("test", test)):
        pairs = [sentence_pair(rng, src, lexicon) for _ in range(n)]
        for side, idx in (("src", 0), ("tgt", 1)):
            path = os.path.join(outdir, f"{split}.{side}")
            write_text(path, "".join(p[idx] + "\n" for p in pairs))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir")
    parser.add_argument("--train", type=int, default=4000)
    parser.add_argument("--dev", type=int, default=300)
    parser.add_argument("--test", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    write_corpus(args.outdir, args.train, args.dev, args.test, args.seed)
    print(f"wrote {args.train}/{args.dev}/{args.test} sentence pairs to {args.outdir}/{{train,dev,test}}.{{src,tgt}}")


if __name__ == "__main__":
    main()
