"""fairseq-qknorm-score: sacrebleu BLEU and chrF for one or more systems against one reference, and
with two or more systems sacrebleu's paired bootstrap resampling test against the first one.

    fairseq-qknorm-score --ref test.en baseline.hyp qknorm.hyp [--json] [--tokenize none]

Calls sacrebleu's Python API directly (fairseq-score --sacrebleu is broken with sacrebleu 2.x) and
does not import fairseq, so it starts in about half a second. Recipes can import score_systems().
"""

import argparse
import json
import os
import sys
from contextlib import contextmanager

from sacrebleu.metrics import BLEU, CHRF
from sacrebleu.significance import PairedTest

METRICS = ("bleu", "chrf")


class ScoreError(ValueError):
    """Bad input; the message is one line that names the file or option."""


def read_lines(path, role):
    """The file's lines with trailing whitespace removed, as sacrebleu's own CLI reads them.
    Split on '\\n' only: str.splitlines() would also split on form feeds and U+2028 and break the
    line alignment with the reference."""
    if not os.path.isfile(path):
        raise ScoreError(f"{role}: no such file: {path}")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ScoreError(f"{role} {path}: cannot read ({e.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ScoreError(f"{role} {path}: not valid UTF-8 ({e.reason} at line {line}, byte {e.start})") from None
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line.rstrip() for line in lines]


def system_names(paths):
    """Shortest path suffix that tells the systems apart: 'Baseline/test.hyp' and 'QKNorm/test.hyp'
    rather than two 'test.hyp'."""
    parts = [os.path.normpath(p).split(os.sep) for p in paths]
    for depth in range(1, max(len(p) for p in parts) + 1):
        names = [os.path.join(*p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return list(paths)  # the same path given twice


@contextmanager
def sacrebleu_seed(seed):
    """sacrebleu's paired test reads its seed from $SACREBLEU_SEED only; set it for the call."""
    old = os.environ.get("SACREBLEU_SEED")
    os.environ["SACREBLEU_SEED"] = str(seed)
    try:
        yield
    finally:
        if old is None:
            del os.environ["SACREBLEU_SEED"]
        else:
            os.environ["SACREBLEU_SEED"] = old


def make_metrics(tokenize, lowercase):
    try:
        # force: with --tokenize none the text is tokenized on purpose; don't warn that it looks so.
        bleu = BLEU(tokenize=tokenize, lowercase=lowercase, force=tokenize == "none")
    except (ImportError, RuntimeError, OSError) as e:
        reason = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise ScoreError(f"--tokenize {tokenize} is not available here: {reason}") from None
    return {"bleu": bleu, "chrf": CHRF(lowercase=lowercase)}


def score_systems(ref_path, sys_paths, tokenize="13a", lowercase=False, bootstrap=1000, seed=12345):
    """Score each system against the reference; with two or more systems, add sacrebleu's paired
    bootstrap test of each later system against the first. Returns a JSON-ready dict:

    {"ref", "tokenize", "lowercase", "signatures": {"bleu", "chrf"},
     "bootstrap", "seed" (paired only),
     "systems": [{"name", "path", "bleu", "chrf",
                  "ci": {metric: {"mean", "halfwidth"}} (paired only, 95% bootstrap CI),
                  "delta": {metric: score - first's}, "p_value": {metric: p} (later systems only)}]}
    Raises ScoreError on bad input.
    """
    if not sys_paths:
        raise ScoreError("give at least one system output file")
    if bootstrap < 1:
        raise ScoreError(f"--bootstrap must be a positive number of resamples, got {bootstrap}")
    if seed < 1:  # sacrebleu treats seed 0 as "unseeded" for the compared systems
        raise ScoreError(f"--seed must be a positive integer, got {seed}")
    refs = read_lines(ref_path, "--ref")
    if not refs:
        raise ScoreError(f"--ref {ref_path} is empty (no lines)")
    hyps = []
    for path in sys_paths:
        lines = read_lines(path, "system output")
        if len(lines) != len(refs):
            raise ScoreError(
                f"line count mismatch: system output {path} has {len(lines)} lines, --ref {ref_path} has {len(refs)}"
            )
        hyps.append(lines)
    metrics = make_metrics(tokenize, lowercase)
    names = system_names(sys_paths)
    result = {"ref": ref_path, "tokenize": tokenize, "lowercase": lowercase}
    systems = [{"name": n, "path": p, **dict.fromkeys(METRICS)} for n, p in zip(names, sys_paths)]

    if len(sys_paths) == 1:
        for key, metric in metrics.items():
            systems[0][key] = metric.corpus_score(hyps[0], [refs]).score
        result["signatures"] = {key: metric.get_signature().format() for key, metric in metrics.items()}
        result["systems"] = systems
        return result

    with sacrebleu_seed(seed):
        test = PairedTest(list(zip(names, hyps)), metrics, [refs], test_type="bs", n_samples=bootstrap)
        signatures, columns = test()
    # sacrebleu keys its results by the metric's display name (BLEU, chrF2, ...): map back to ours.
    by_name = {name: key for name, m in test.metrics.items() for key, ours in metrics.items() if m is ours}
    for name, key in by_name.items():
        first = float(columns[name][0].score)
        for i, (entry, res) in enumerate(zip(systems, columns[name])):
            entry[key] = float(res.score)
            entry.setdefault("ci", {})[key] = {"mean": float(res.mean), "halfwidth": float(res.ci)}
            if i == 0:
                continue
            delta = entry[key] - first
            # P(|resampled delta| >= |observed delta|) is 1 when the observed delta is 0. sacrebleu
            # 2.6 counts strictly greater resampled deltas and so reports 1/(N+1), "significant",
            # for a system identical to the baseline.
            p_value = 1.0 if delta == 0 else float(res.p_value)
            entry.setdefault("delta", {})[key] = delta
            entry.setdefault("p_value", {})[key] = p_value
    result["signatures"] = {key: signatures[name].format() for name, key in by_name.items()}
    result.update(bootstrap=bootstrap, seed=seed, systems=systems)
    return result


def format_table(result):
    """One row per system: score, and when paired: bootstrap mean ± 95% CI, delta, p-value."""
    systems = result["systems"]
    paired = len(systems) > 1
    width = max(len("system"), *(len(s["name"]) for s in systems))
    header = f"{'system':<{width}}"
    for key in METRICS:
        label = "BLEU" if key == "bleu" else "chrF"
        header += f"  {label:>6}" + (f"  {'mean ± 95% CI':>15}  {'delta':>6}  {'p':>7} " if paired else "")
    rows = [header]
    for s in systems:
        row = f"{s['name']:<{width}}"
        for key in METRICS:
            row += f"  {s[key]:6.2f}"
            if paired:
                ci = s["ci"][key]
                row += f"  {ci['mean']:7.2f} ± {ci['halfwidth']:5.2f}"
                if "p_value" in s:
                    p = s["p_value"][key]
                    row += f"  {s['delta'][key]:+6.2f}  {p:7.4f}{'*' if p < 0.05 else ' '}"
                else:
                    row += f"  {'':>6}  {'':>7} "
        rows.append(row.rstrip())
    rows.append("")
    for key in METRICS:
        rows.append(f"{key}: {result['signatures'][key]}")
    if paired:
        rows.append(
            f"paired bootstrap resampling ({result['bootstrap']} resamples, seed {result['seed']}) "
            f"against {systems[0]['name']}; * p < 0.05"
        )
    rows.append(f"reference: {result['ref']}")
    return "\n".join(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="fairseq-qknorm-score",
        description="sacrebleu BLEU and chrF of system outputs; paired bootstrap test against the first system.",
    )
    parser.add_argument("--ref", required=True, help="reference file, one segment per line")
    parser.add_argument("systems", nargs="+", metavar="SYS", help="system output files, aligned with --ref")
    parser.add_argument(
        "--tokenize",
        default="13a",
        choices=sorted(BLEU.TOKENIZERS),
        help="sacrebleu BLEU tokenizer (default: %(default)s; 'none' for already tokenized text)",
    )
    parser.add_argument("--lowercase", action="store_true", help="case-insensitive BLEU and chrF")
    parser.add_argument(
        "--bootstrap",
        type=int,
        default=1000,
        help="paired bootstrap resamples, with two or more systems (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=12345, help="bootstrap seed, >= 1 (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    try:
        result = score_systems(
            args.ref,
            args.systems,
            tokenize=args.tokenize,
            lowercase=args.lowercase,
            bootstrap=args.bootstrap,
            seed=args.seed,
        )
    except ScoreError as e:
        sys.exit(f"error: {e}")
    print(json.dumps(result, indent=2) if args.json else format_table(result))


if __name__ == "__main__":
    main()
