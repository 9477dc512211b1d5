#!/usr/bin/env bash
# The learning-rate sweep in fp16 (experiments/fp16_sweep.py says what it measures; its --help gives
# every setting and default): stock attention, QKNorm and QK LayerNorm with fairseq's --fp16 at the
# peak rates where the fp32 sweep's stock logits reached fp16's range. fp16 runs on the CPU here
# (the plugin's "--fp16 on the CPU"), many times slower than fp32: about 10 minutes a run on a loaded
# 2-core machine. Writes examples/fp16_sweep/{results.json,*.png} and prints the table beside the fp32
# sweep's runs; data and log go to WORK (default work/fp16_sweep). Runs already in results.json (same
# settings) are skipped. Extra flags are passed on, e.g. --lrs 0.1 0.3 --seeds 1 2.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
WORK=${WORK:-work/fp16_sweep}
mkdir -p "$WORK"
PYTHONUNBUFFERED=1 PYTHONPATH=. "${VENV:-.venv}/bin/python" -m experiments.fp16_sweep \
    --work-dir "$WORK" --out-dir examples/fp16_sweep "$@" 2>&1 | tee -a "$WORK/sweep.log"
