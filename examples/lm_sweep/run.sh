#!/usr/bin/env bash
# Peak learning-rate sweep of small decoder-only LMs: fairseq's transformer_lm vs transformer_lm_qknorm
# with QKNorm (l2, learned g) vs QK LayerNorm, on English text (experiments/lm_sweep.py says what it
# measures; its --help gives every setting and default). The text is not in the repository: point
# LM_SWEEP_TRAIN (files separated by ':') and LM_SWEEP_VALID at plain English text, one sentence a
# line (the TED and IWSLT'15 English sides of examples/README.md's data). Writes
# examples/lm_sweep/{results.json,tables.md,*.png}; data and log go to WORK (default work/lm_sweep).
# Runs already in results.json (same settings) are skipped. Extra flags are passed on, e.g. --seeds 1 2 3.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
: "${LM_SWEEP_TRAIN:?set LM_SWEEP_TRAIN to the English training text (files separated by :)}"
: "${LM_SWEEP_VALID:?set LM_SWEEP_VALID to the English validation text}"
export LM_SWEEP_TRAIN LM_SWEEP_VALID
WORK=${WORK:-work/lm_sweep}
mkdir -p "$WORK"
PYTHONUNBUFFERED=1 PYTHONPATH=. "${VENV:-.venv}/bin/python" -m experiments.lm_sweep \
    --work-dir "$WORK" --out-dir examples/lm_sweep "$@" 2>&1 | tee "$WORK/sweep.log"
