"""Shared fixtures. Any hub access during tests is a bug, so the hub is switched off first."""
from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny SDXL, SD1.x and SD2.x built once per session (a few seconds).

    Keys: ``root``, ``tokenizers`` (kohya --tokenizer_cache_dir layout), and for
    NAME in ``sdxl``, ``sd15``, ``sd2``: NAME (diffusers folder), ``NAME_file``
    (original-layout .safetensors), ``NAME_config`` (configs + tokenizers, no
    weights; a --model_config_dir). Treat them as read-only.
    """
    from tools.build_tiny_models import build_tiny_models

    return build_tiny_models(tmp_path_factory.mktemp("tiny_models"))
