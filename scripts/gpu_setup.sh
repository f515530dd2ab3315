#!/usr/bin/env bash
# The lent GPU machine (the `device` tool) has CUDA torch, transformers, accelerate, safetensors,
# numpy, pytest and more, but no package registry. Here (pip works) download, there install:
#   bash scripts/gpu_setup.sh download            # wheels of what it lacks into .whl/ (21 MB)
#   bash scripts/gpu_setup.sh install             # there: into /tmp/site, never a torch;
#                                                 # then `export PYTHONPATH=/tmp/site`
# Versions are requirements.txt's pins (transformers/diffusers/peft too, so both machines run the
# same code). bitsandbytes (43 MB, the 8-bit optimizers) has its own pair, as the 64 MiB the device
# tool carries per call would not hold it with the rest:
#   bash scripts/gpu_setup.sh download-bnb        # into .gpu_assets/bnb/
#   bash scripts/gpu_setup.sh install-bnb         # there: into /tmp/site
# kohya-ss/sd-scripts' own trainer for the side-by-side (bench_gpu_sdxl.py --kohya_dir), kept out of
# the project in ignored folders. It runs with its own pins where ours break it (transformers 5 has
# no CLIPFeatureExtractor and other module paths; diffusers 0.42 needs a newer huggingface_hub):
#   bash scripts/gpu_setup.sh download-kohya CHECKOUT  # CHECKOUT: a kohya-ss/sd-scripts tree; copies its
#                                                 # trainer code into .gpu_assets/sd-scripts (3.6 MB),
#                                                 # its wheels into .gpu_assets/kohya-wheels (19 MB) and
#                                                 # OpenCV + torchvision into .gpu_assets/kohya-vision
#                                                 # (57 MB: carry it alone)
#   bash scripts/gpu_setup.sh install-kohya       # there: into /tmp/site-kohya (bench_gpu_sdxl.py
#                                                 # --kohya_site /tmp/site-kohya puts it first)
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(diffusers==0.42.1 transformers==5.23.0 peft==0.21.2 toml==0.10.2 voluptuous==0.16.0
        lycoris-lora==4.1.3 importlib_metadata prodigyopt==1.1.2 lion-pytorch==0.2.5 schedulefree==1.4.1
        prodigy-plus-schedule-free==2.0.1 pytorch-optimizer==4.1.0)
SDIST_ONLY=(dadaptation==3.2)  # no wheel on PyPI: built here (pure Python)
BNB_WHEELS=(bitsandbytes==0.50.2)
# kohya's requirements.txt pins where the GPU machine's packages do not run its code. requests and
# its dependencies: transformers 4.54 checks for them at import. torchvision 0.26.0 is the PyPI
# build for the machine's torch 2.11 (+cu130); kohya imports it and OpenCV at module level.
KOHYA_WHEELS=(transformers==4.54.1 tokenizers==0.21.4 huggingface-hub==0.34.3 diffusers==0.32.1
              imagesize==1.4.1 einops==0.7.0 requests==2.32.5 urllib3==2.5.0 idna==3.10
              charset-normalizer==3.4.3 certifi==2025.8.3)
KOHYA_VISION=(opencv-python-headless==4.10.0.84 torchvision==0.26.0)
python=.venv/bin/python; [ -x "$python" ] || python=python3

download() {  # download DIR WHEEL...: the GPU machine's Python 3.12, manylinux x86_64
    local dir=$1; shift
    mkdir -p "$dir"
    "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d "$dir" "$@"
    du -sh "$dir"
}

install() {  # install TARGET DIR...: the wheels of the folders, never a torch
    local target=$1; shift
    local wheels=()
    for dir in "$@"; do [ -d "$dir" ] && wheels+=("$dir"/*.whl); done
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "${wheels[@]}"
}

case "${1:-}" in
download)
    download .whl "${WHEELS[@]}"
    "$python" -m pip wheel --quiet --no-deps -w .whl "${SDIST_ONLY[@]}" ;;
install)
    install /tmp/site .whl
    PYTHONPATH=/tmp/site python3 -c "import torch, diffusers, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'diffusers', diffusers.__version__, 'transformers', transformers.__version__)" ;;
download-bnb)
    download .gpu_assets/bnb "${BNB_WHEELS[@]}" ;;
install-bnb)
    install /tmp/site .gpu_assets/bnb
    PYTHONPATH=/tmp/site python3 -c "import bitsandbytes; print('bitsandbytes', bitsandbytes.__version__)" ;;
download-kohya)
    checkout=${2:?usage: bash scripts/gpu_setup.sh download-kohya KOHYA_SD_SCRIPTS_CHECKOUT}
    rm -rf .gpu_assets/sd-scripts && mkdir -p .gpu_assets/sd-scripts
    # the trainer: entry scripts and the library/networks packages (its configs, docs and tests are not needed)
    (cd "$checkout" && find . -maxdepth 1 -name '*.py' -print0 && find library networks -name '*.py' -print0) |
        (cd "$checkout" && xargs -0 tar -cf -) | tar -xf - -C .gpu_assets/sd-scripts
    du -sh .gpu_assets/sd-scripts
    download .gpu_assets/kohya-wheels "${KOHYA_WHEELS[@]}"
    download .gpu_assets/kohya-vision "${KOHYA_VISION[@]}" ;;
install-kohya)
    install /tmp/site-kohya .gpu_assets/kohya-wheels .gpu_assets/kohya-vision
    PYTHONPATH=/tmp/site-kohya:/tmp/site python3 -c "import transformers, diffusers, torchvision, cv2; print('kohya stack: transformers', transformers.__version__, 'diffusers', diffusers.__version__, 'torchvision', torchvision.__version__, 'cv2', cv2.__version__)" ;;
*)
    echo "usage: bash scripts/gpu_setup.sh download|install|download-bnb|install-bnb|download-kohya CHECKOUT|install-kohya" >&2
    exit 2 ;;
esac
