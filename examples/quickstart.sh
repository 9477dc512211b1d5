#!/usr/bin/env bash
# The whole pipeline in one command: set up .venv, then baseline vs QKNorm on the embedded toy
# corpus (generated, deterministic: see examples/README.md), scoring with significance, the table.
# Under 10 minutes on 2 CPU cores. The same on real TED data is one variable away:
#   PAIR=gl-en bash examples/quickstart.sh                        (downloads ted_talks.tar.gz)
#   PAIR=gl-en DATA_DIR=/path/to/ted-gl-en bash examples/quickstart.sh   (offline, plain text)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
PAIR=${PAIR:-toy}
if [ "$PAIR" = toy ]; then export PRESET=${PRESET:-toy}; else export PRESET=${PRESET:-cpu}; fi
bash examples/ted/run.sh "$PAIR"
echo
echo "All finished runs under ${WORK:-work/}:"
.venv/bin/python -m experiments.results table "${WORK:-work}"
