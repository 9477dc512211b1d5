#!/usr/bin/env bash
# Create or reuse a virtual environment (.venv, or VENV=DIR) and install everything the project needs.
# PYTHON=python3.12 makes a new one with that interpreter (default: python3); 3.11 and 3.12 are tested.
# Idempotent: a stamp records what was installed; nothing is reinstalled while it matches.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=${VENV:-.venv}
FAIRSEQ_DIST=ve-fairseq==0.12.3
fail() { echo "error: $*" >&2; exit 1; }
version_of() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])'; }

interpreter() {
    if "$1" -c '' 2>/dev/null; then echo "$1"; return; fi
    # A pyenv shim is on PATH for every installed version but runs only the selected one.
    local version
    version=$(pyenv whence "$1" 2>/dev/null | tail -n 1) || true
    [ -n "$version" ] || fail "PYTHON=$1: no such interpreter"
    echo "$(pyenv root)/versions/$version/bin/$1"
}

if [ -n "${PYTHON:-}" ] || [ ! -x "$VENV/bin/python" ]; then
    PYTHON=${PYTHON:-python3}
    python=$(interpreter "$PYTHON")
    version=$(version_of "$python")
    # ve-fairseq has wheels for these two only; any other Python would build fairseq from source.
    case $version in 3.11 | 3.12) ;; *) fail "PYTHON=$PYTHON is Python $version; the project needs 3.11 or 3.12" ;; esac
    if [ -x "$VENV/bin/python" ] && [ "$(version_of "$VENV/bin/python")" != "$version" ]; then
        fail "$VENV holds Python $(version_of "$VENV/bin/python"), not $version: pass VENV=.venv${version/./} for a second environment"
    fi
    [ -x "$VENV/bin/python" ] || "$python" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
# pip, after an install, lists every declared requirement that is missing, as an ERROR. ve-fairseq's
# torchaudio is missing on purpose (below): that line, and pip's heading when nothing else follows
# it, are dropped; every other line of pip's output, and its exit status, pass through.
pip_install() {
    # pip's stdout goes to fd 3 (the terminal), its stderr through the filter; pipefail keeps pip's status.
    { pip install "$@" 2>&1 >&3 3>&- | awk '
        /^ERROR: pip.s dependency resolver does not currently take into account/ { heading = $0; next }
        /^ve-fairseq [^ ]+ requires torchaudio/ { next }
        { if (heading != "") { print heading; heading = "" } print }' >&2 3>&-; } 3>&1
}

want=$(cat requirements.txt setup.py scripts/setup.sh | sha1sum | cut -d' ' -f1)
stamp=$VENV/.fairseq-qknorm-installed
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    exit 0
fi
echo "| setting up $VENV (Python $(version_of "$VENV/bin/python"): torch, $FAIRSEQ_DIST, sentencepiece, sacrebleu) ..." >&2
# torch first, so that nothing below can replace it. A torch 2.13.0 already in the environment is
# kept, whichever build it is; otherwise pip takes a CPU build where one lies in its find-links
# (Python 3.11 here), else PyPI's, which is the CUDA build (2.6 GB of wheels; it runs on a CPU too).
pip install torch==2.13.0
# fairseq without its declared dependencies: they name torchaudio, which translation never
# uses and whose wheel does not load beside torch 2.13. The real needs are in requirements.txt.
pip install --no-deps "$FAIRSEQ_DIST"
pip_install -r requirements.txt
pip_install --no-deps -e .
"$VENV/bin/python" -c "import torch; print('| torch', torch.__version__, 'CUDA', torch.version.cuda)" >&2
echo "$want" > "$stamp"
