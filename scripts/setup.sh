#!/usr/bin/env bash
# Create or reuse .venv in the project root and install everything the project needs.
# Idempotent: a stamp records what was installed; nothing is reinstalled while it matches.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
FAIRSEQ_DIST=ve-fairseq==0.12.3

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }

want=$(cat requirements.txt setup.py scripts/setup.sh | sha1sum | cut -d' ' -f1)
stamp=.venv/.fairseq-qknorm-installed
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    exit 0
fi
echo "| setting up .venv (torch CPU, $FAIRSEQ_DIST, sentencepiece, sacrebleu) ..." >&2
# torch first, from the pinned CPU build, so nothing below can pull in a CUDA build.
pip install torch==2.13.0
# fairseq without its declared dependencies: they name torchaudio, which translation never
# uses and whose wheel does not load beside torch 2.13. The real needs are in requirements.txt.
# (pip then reports that ve-fairseq "requires torchaudio, which is not installed": expected.)
pip install --no-deps "$FAIRSEQ_DIST"
pip install -r requirements.txt
pip install --no-deps -e .
echo "$want" > "$stamp"
