"""fairseq-qknorm-score: BLEU against an independent corpus-BLEU written here, chrF's fixed points,
the paired bootstrap test, the published en-vi system outputs, and bad input."""

import json
import math
import os
import random
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import run, tool

from fairseq_qknorm_cli.score import score_systems


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def corpus_bleu(hyps, refs):
    """Papineni et al. corpus BLEU on whitespace tokens: clipped n-gram precisions 1..4, geometric
    mean, brevity penalty; no smoothing (the test data has matches at every order)."""
    matches, totals = [0] * 4, [0] * 4
    hyp_len = ref_len = 0
    for hyp, ref in zip(hyps, refs):
        h, r = hyp.split(), ref.split()
        hyp_len, ref_len = hyp_len + len(h), ref_len + len(r)
        for n in range(1, 5):
            h_ngrams = Counter(tuple(h[i : i + n]) for i in range(len(h) - n + 1))
            r_ngrams = Counter(tuple(r[i : i + n]) for i in range(len(r) - n + 1))
            matches[n - 1] += sum(min(c, r_ngrams[g]) for g, c in h_ngrams.items())
            totals[n - 1] += max(len(h) - n + 1, 0)
    log_precision = sum(math.log(m / t) for m, t in zip(matches, totals)) / 4
    brevity = 1.0 if hyp_len > ref_len else math.exp(1 - ref_len / hyp_len)
    return 100 * brevity * math.exp(log_precision)


REFS = [
    "the cat sat on the mat today",
    "a quick brown fox jumps over the lazy dog",
    "there is a red book on the kitchen table",
    "he said that he would come back tomorrow",
]
SHORT_HYPS = [
    "the cat sat on a mat",
    "a fast brown fox jumps over the dog",  # brevity penalty < 1
    "there is book on the kitchen table",
    "he said he would come back tomorrow",
]
LONG_HYPS = [
    "the cat sat on the mat today again and again",
    "a quick brown fox jumps over the very lazy dog",
    "there is a red book on the the kitchen table",
    "he said that he would come back tomorrow night",
]


@pytest.mark.parametrize("hyps", [SHORT_HYPS, LONG_HYPS], ids=["shorter", "longer"])
def test_bleu_matches_independent_corpus_bleu(tmp_path, hyps):
    ref, hyp = write(tmp_path / "ref", REFS), write(tmp_path / "hyp", hyps)
    result = score_systems(str(ref), [str(hyp)], tokenize="none")
    expected = corpus_bleu(hyps, REFS)
    assert 0 < expected < 100
    assert result["systems"][0]["bleu"] == pytest.approx(expected, rel=1e-6)
    assert "tok:none" in result["signatures"]["bleu"]


def test_chrf_fixed_points_and_lowercase(tmp_path):
    ref = write(tmp_path / "ref", REFS)
    same = write(tmp_path / "same", REFS)
    disjoint = write(tmp_path / "disjoint", ["1234567 890 98765 4321 0"] * len(REFS))
    upper = write(tmp_path / "upper", [r.upper() for r in REFS])
    scores = {p.name: score_systems(str(ref), [str(p)])["systems"][0] for p in (same, disjoint, upper)}
    assert scores["same"]["chrf"] == pytest.approx(100) and scores["same"]["bleu"] == pytest.approx(100)
    assert scores["disjoint"]["chrf"] == 0 and scores["disjoint"]["bleu"] == pytest.approx(0, abs=1e-6)
    assert scores["upper"]["bleu"] < 1 and scores["upper"]["chrf"] < 50
    lowered = score_systems(str(ref), [str(upper)], lowercase=True)
    assert lowered["systems"][0]["bleu"] == pytest.approx(100) and lowered["systems"][0]["chrf"] == pytest.approx(100)
    assert "case:lc" in lowered["signatures"]["bleu"]


def perturb(rng, words, vocab, rate):
    return " ".join(rng.choice(vocab) if rng.random() < rate else w for w in words)


@pytest.fixture(scope="module")
def paired_files(tmp_path_factory):
    """100 references; a good system (5% of words replaced) and a poor one (40%)."""
    d = tmp_path_factory.mktemp("paired")
    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(300)]
    refs = [[rng.choice(vocab) for _ in range(rng.randint(8, 15))] for _ in range(100)]
    return {
        "ref": write(d / "ref", [" ".join(r) for r in refs]),
        "good": write(d / "good", [perturb(rng, r, vocab, 0.05) for r in refs]),
        "poor": write(d / "poor", [perturb(rng, r, vocab, 0.4) for r in refs]),
    }


def test_paired_identical_systems_no_difference(paired_files, tmp_path):
    f = paired_files
    copy = tmp_path / "good_copy"
    copy.write_bytes(f["good"].read_bytes())
    result = score_systems(str(f["ref"]), [str(f["good"]), str(copy)], tokenize="none", bootstrap=200)
    second = result["systems"][1]
    for metric in ("bleu", "chrf"):
        assert second["delta"][metric] == 0
        assert second["p_value"][metric] == 1.0


def test_paired_much_better_system_is_significant(paired_files):
    f = paired_files
    result = score_systems(str(f["ref"]), [str(f["poor"]), str(f["good"])], tokenize="none", bootstrap=500)
    poor, good = result["systems"]
    assert "p_value" not in poor and set(poor["ci"]) == {"bleu", "chrf"}
    for metric in ("bleu", "chrf"):
        assert good["delta"][metric] == pytest.approx(good[metric] - poor[metric])
        assert good["delta"][metric] > 10
        assert good["p_value"][metric] < 0.05
        ci = good["ci"][metric]
        assert abs(ci["mean"] - good[metric]) < 3 * ci["halfwidth"] and ci["halfwidth"] > 0
    assert "bs:500" in result["signatures"]["bleu"] and "seed:12345" in result["signatures"]["bleu"]


def test_paired_deterministic_with_seed(paired_files):
    f = paired_files
    args = (str(f["ref"]), [str(f["poor"]), str(f["good"])])
    a = score_systems(*args, tokenize="none", bootstrap=200, seed=7)
    b = score_systems(*args, tokenize="none", bootstrap=200, seed=7)
    c = score_systems(*args, tokenize="none", bootstrap=200, seed=8)
    assert a == b
    assert a["systems"][1]["ci"]["bleu"] != c["systems"][1]["ci"]["bleu"]


def shared_data():
    # The real-data folder beside the repository (../shared/data), as CI has it; SHARED_DATA overrides.
    here = Path(os.environ.get("SHARED_DATA", Path(__file__).resolve().parents[3] / "shared" / "data"))
    if (here / "iwslt15-en-vi" / "test.vi").is_file():
        return here / "iwslt15-en-vi"
    pytest.skip(f"IWSLT'15 en-vi data not found under {here} (set SHARED_DATA)")


def test_published_en_vi_outputs_cli():
    """The QKNorm authors' tst2013 outputs: tokenized BLEU 32.49 (baseline) and 33.24 (QKNorm)."""
    d = shared_data()
    outputs = [d / "system_outputs" / s / "test.en.bpe.best_trans.nobpe" for s in ("Baseline", "QKNorm")]
    proc = run([tool("fairseq-qknorm-score"), "--ref", d / "test.vi", *outputs, "--tokenize", "none", "--json"])
    baseline, qknorm = json.loads(proc.stdout)["systems"]
    assert baseline["name"].startswith("Baseline/") and qknorm["name"].startswith("QKNorm/")
    assert round(baseline["bleu"], 2) == 32.49
    assert round(qknorm["bleu"], 2) == 33.24
    assert qknorm["delta"]["bleu"] == pytest.approx(qknorm["bleu"] - baseline["bleu"])


def test_bad_input_one_line_error(tmp_path):
    ref = write(tmp_path / "ref.txt", REFS)
    short = write(tmp_path / "short.hyp", REFS[:3])
    bad_utf8 = tmp_path / "latin1.hyp"
    bad_utf8.write_bytes(b"caf\xe9\n" * len(REFS))
    empty = write(tmp_path / "empty.ref", [])
    cases = {  # arguments -> words the message must contain
        (ref, short): ["short.hyp", "ref.txt", "3", "4"],
        (ref, tmp_path / "missing.hyp"): ["missing.hyp", "no such file"],
        (tmp_path / "missing.ref", short): ["missing.ref", "no such file"],
        (ref, bad_utf8): ["latin1.hyp", "UTF-8"],
        (empty, short): ["empty.ref", "empty"],
    }
    for (ref_path, sys_path), words in cases.items():
        proc = run([tool("fairseq-qknorm-score"), "--ref", ref_path, sys_path], check=False)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode != 0 and proc.stdout == "", proc
        assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
        for word in words:
            assert word in lines[0], (word, lines[0])


def test_does_not_import_fairseq():
    code = "import sys, fairseq_qknorm_cli.score; print('fairseq' in sys.modules)"
    assert run([sys.executable, "-c", code]).stdout.strip() == "False"
