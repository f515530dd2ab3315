#!/usr/bin/env bash
# Creates .venv at the repository root if missing and installs the pinned requirements.
# torch is pinned to 2.13.0: on these machines pip takes the local CPU wheel; on a CUDA
# machine install the CUDA build of torch 2.13.0 first and pip keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r "${1:-requirements.txt}"
