#!/usr/bin/env bash
# The lent GPU machine (the `device` tool) has CUDA torch, transformers, accelerate, safetensors,
# numpy, pytest and more, but no package registry. Two steps:
#   bash scripts/gpu_setup.sh download   # here (pip works): wheels of what it lacks into .whl/
#   bash scripts/gpu_setup.sh install    # there: installs them into /tmp/site, never a torch;
#                                        # then `export PYTHONPATH=/tmp/site`
# Versions are requirements.txt's pins (transformers/diffusers/peft too, so both machines run the
# same code); bitsandbytes (43 MB) is left out: the 64 MiB the device tool carries would not hold it.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(diffusers==0.42.1 transformers==5.23.0 peft==0.21.2 toml==0.10.2 voluptuous==0.16.0
        lycoris-lora==4.1.3 importlib_metadata prodigyopt==1.1.2 lion-pytorch==0.2.5 schedulefree==1.4.1
        prodigy-plus-schedule-free==2.0.1 pytorch-optimizer==4.1.0)
SDIST_ONLY=(dadaptation==3.2)  # no wheel on PyPI: built here (pure Python)
case "${1:-}" in
download)
    mkdir -p .whl
    python=.venv/bin/python; [ -x "$python" ] || python=python3
    "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl "${WHEELS[@]}"
    "$python" -m pip wheel --quiet --no-deps -w .whl "${SDIST_ONLY[@]}"
    du -sh .whl ;;
install)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python3 -c "import torch, diffusers, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'diffusers', diffusers.__version__, 'transformers', transformers.__version__)" ;;
*)
    echo "usage: bash scripts/gpu_setup.sh download|install" >&2; exit 2 ;;
esac
