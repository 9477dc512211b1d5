#!/usr/bin/env bash
# Peak learning-rate sweep (issue 6, "High learning rates"): stock attention vs QKNorm (l2, learned g)
# vs QK LayerNorm on a tiny pre-norm translation model, 300 updates each, on the generated toy corpus.
# About 15 minutes on 2 idle CPU cores. Writes examples/lr_sweep/{results.json,*.png} and prints
# the table; the data and the log go to WORK (default work/lr_sweep). Rerunning skips the runs
# already in results.json (same settings); delete it to redo them. Extra flags are passed on,
# e.g. --seeds 1 2 3 or --threads 1.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
VENV=${VENV:-.venv}
WORK=${WORK:-work/lr_sweep}
mkdir -p "$WORK"
PYTHONUNBUFFERED=1 "$VENV/bin/python" -m fairseq_qknorm_cli.lr_sweep \
    --work-dir "$WORK" --out-dir examples/lr_sweep \
    --arms stock qknorm qk_layernorm --lrs 3e-4 1e-3 3e-3 1e-2 3e-2 1e-1 3e-1 --seeds 1 \
    --updates 300 --warmup-updates 75 --stats-interval 10 --threads 2 "$@" 2>&1 | tee "$WORK/sweep.log"
