#!/usr/bin/env bash
# Set up and run the test suite (what CI runs). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh requirements-dev.txt
export HF_HUB_OFFLINE=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/python -m pytest -q "$@"
