"""The loaded base model as one value: what loading produces and saving, merging and training read.

Its own module so that the file readers/writers (``library.checkpoint_files``) and the loader
(``library.model_loading``) can both name it without importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from library.checkpoint_keys import ModelKind

if TYPE_CHECKING:  # heavy imports stay lazy so `--help` is fast
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTokenizer


@dataclass
class StableDiffusionModels:
    """One base model, fp32 on CPU. SDXL: two tokenizers and text encoders (CLIP-L, then bigG with projection)."""

    kind: ModelKind
    tokenizers: list[CLIPTokenizer]
    text_encoders: list[torch.nn.Module]
    vae: AutoencoderKL
    unet: UNet2DConditionModel
    scheduler_config: dict[str, Any]
    name: str

    @property
    def is_sdxl(self) -> bool:
        return self.kind == "sdxl"
