#!/usr/bin/env bash
# Set up the environment (.venv, or VENV=DIR; PYTHON=python3.12 for a new one on 3.12) if needed,
# and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec "${VENV:-.venv}/bin/python" -m pytest -q "$@" tests
