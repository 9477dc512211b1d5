#!/usr/bin/env bash
# Set up the environment (.venv, or VENV=DIR; PYTHON=python3.12 for a new one on 3.12) if needed,
# check the code with the linter and the formatter (ruff, pyproject.toml), and run the test suite:
# tests/plugin (what pip installs) and tests/experiments (recipes, sweeps, benchmarks, the GPU script).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
VENV=${VENV:-.venv}
"$VENV/bin/ruff" check --quiet . || { echo "error: ruff check found the problems above (ruff check --fix fixes some)" >&2; exit 1; }
"$VENV/bin/ruff" format --check --quiet . || { echo "error: files not formatted as ruff format would (run: $VENV/bin/ruff format .)" >&2; exit 1; }
# One thread per process: with a pytest worker per core, a second torch / OpenMP thread in each worker
# and in each fairseq-train it starts finds no free core and stalls the work it waits on (a tiny
# fairseq-train took 11 s with one thread, 23 to 76 s with two, beside two busy cores).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
# One pytest worker per core (pytest-xdist), each test file on one worker: the files' fixtures (a
# trained toy model, a smoke campaign) are built once. The experiments' long files first, so that the
# plugin's many short ones fill the workers up at the end. TEST_WORKERS=0: everything in this process.
exec "$VENV/bin/python" -m pytest -q -n "${TEST_WORKERS:-auto}" --dist loadfile "$@" tests/experiments tests/plugin
