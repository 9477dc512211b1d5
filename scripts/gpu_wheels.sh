#!/usr/bin/env bash
# Download, into .whl/ (git-ignored), the wheels that a GPU machine with no network needs to run the
# recipes: fairseq (ve-fairseq, built for CPython 3.12 on x86-64) and those of its real dependencies
# that such a machine's image lacks. torch, numpy, sacrebleu, sentencepiece, scikit-learn, scipy,
# regex, tqdm, packaging, cython, pyyaml, setuptools and pytest are taken from the image, as
# requirements.txt's pins are only what this project is tested with here.
#
#   bash scripts/gpu_wheels.sh            # then carry .whl to the machine (examples/ted/gl-en-2x2-gpu)
#
# Settings (environment): WHEELS (default .whl), PY_VERSION (default 3.12).
# Versions are requirements.txt's pins where it has one. Rerunning downloads only what is missing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

WHEELS=${WHEELS:-.whl}
PY_VERSION=${PY_VERSION:-3.12}
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
die() { echo "error: $*" >&2; exit 1; }

pin() {  # pin NAME: NAME==VERSION from requirements.txt
    local line
    line=$(grep -i -m1 "^$1==" requirements.txt) || die "requirements.txt pins no version of $1"
    echo "$line"
}

# fairseq itself, as scripts/setup.sh installs it; hydra-core and omegaconf are fairseq's config
# system, bitarray its indexed datasets, cffi (with pycparser) a declared need of its C extensions;
# hydra-core needs antlr4-python3-runtime 4.9.
binary=("$(grep -o 've-fairseq==[0-9.]*' scripts/setup.sh)" "$(pin bitarray)" "$(pin hydra-core)"
        "$(pin omegaconf)" "$(pin cffi)" pycparser==3.12)
# antlr4-python3-runtime 4.9.3 is published as source only: built here into a pure-Python wheel.
source_only=(antlr4-python3-runtime==4.9.3)

mkdir -p "$WHEELS"
pip() { "$PYTHON" -m pip --disable-pip-version-check -q "$@"; }
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
echo "| downloading ${binary[*]} for CPython $PY_VERSION into $WHEELS" >&2
pip download --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp "${platforms[@]}" \
    -d "$WHEELS" "${binary[@]}" || die "pip download failed (offline? the wheels come from PyPI)"
for spec in "${source_only[@]}"; do
    name=${spec%%==*}
    if ! ls "$WHEELS/${name//-/_}-${spec##*==}-"*.whl > /dev/null 2>&1; then
        echo "| building a wheel of $spec (source only on PyPI)" >&2
        pip wheel --no-deps -w "$WHEELS" "$spec" || die "could not build a wheel of $spec"
    fi
done

# Two versions of one package would stop the install there: keep one.
dupes=$(ls "$WHEELS"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z' 'a-z' | sort | uniq -d)
[ -z "$dupes" ] || die "$WHEELS holds several versions of: $dupes (delete the ones you do not want)"
echo "| $WHEELS: $(ls "$WHEELS"/*.whl | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1)" >&2
