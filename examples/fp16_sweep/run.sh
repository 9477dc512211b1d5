#!/usr/bin/env bash
# The learning-rate sweep in fp16 (experiments/fp16_sweep.py says what it measures; its --help gives
# every setting and default): stock attention, QKNorm and QK LayerNorm with fairseq's --fp16 at the
# peak rates where the fp32 sweep's stock logits reached fp16's range. fp16 runs on the CPU here
# (the plugin's "--fp16 on the CPU"), at a speed that depends on the CPU's fp16 support: the records'
# runs (one thread, beside other training) took 1 to 4 minutes each on an Intel Xeon with AVX-512, and
# 14 to 41 minutes on an AMD EPYC. Writes examples/fp16_sweep/{results.json,*.png} and prints the
# tables beside the fp32 sweep's runs; data and log go to WORK (default work/fp16_sweep). Runs already
# in results.json (same settings) are skipped, also those another run of this script, at the same
# time, has added. Extra flags are passed on, e.g. --lrs 0.1 0.3 --seeds 1 2.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
WORK=${WORK:-work/fp16_sweep}
mkdir -p "$WORK"
PYTHONUNBUFFERED=1 PYTHONPATH=. "${VENV:-.venv}/bin/python" -m experiments.fp16_sweep \
    --work-dir "$WORK" --out-dir examples/fp16_sweep "$@" 2>&1 | tee -a "$WORK/sweep.log"
