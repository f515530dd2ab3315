#!/usr/bin/env bash
# Set up and run the test suite (what CI runs). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh requirements-dev.txt
export HF_HUB_OFFLINE=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Two workers, each taking whole test files (module fixtures are built once): the tests run one
# intra-op thread each, so a 2-core machine runs the suite in about 12 minutes instead of 20.
# Extra arguments come after, so `-n 0` runs it in one process.
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
