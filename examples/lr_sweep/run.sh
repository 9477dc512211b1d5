#!/usr/bin/env bash
# Peak learning-rate sweep: stock attention vs QKNorm (l2, learned g) vs QK LayerNorm on a tiny
# pre-norm translation model on the generated toy corpus (experiments/lr_sweep.py says what it
# measures; its --help gives every setting and default). About 15 minutes on 2 idle CPU cores.
# Writes examples/lr_sweep/{results.json,*.png} and prints the table; data and log go to WORK
# (default work/lr_sweep). Runs already in results.json (same settings) are skipped. Extra flags
# are passed on, e.g. --seeds 1 2 3 or --threads 1.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
WORK=${WORK:-work/lr_sweep}
mkdir -p "$WORK"
PYTHONUNBUFFERED=1 PYTHONPATH=. "${VENV:-.venv}/bin/python" -m experiments.lr_sweep \
    --work-dir "$WORK" --out-dir examples/lr_sweep "$@" 2>&1 | tee "$WORK/sweep.log"
