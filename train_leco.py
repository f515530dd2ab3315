"""LECO / concept-slider LoRA training for Stable Diffusion 1.x/2.x (no image dataset).

Flags and files follow kohya-ss sd-scripts' ``train_leco.py``: ``--prompts_file`` (LECO prompt pairs or
ai-toolkit slider targets), ``--max_denoising_steps``, ``--leco_denoise_guidance_scale`` and the LoRA
trainer's model, network, optimizer and output options. The loop is the project's training core:
``Trainer(StableDiffusionFamily(), LecoTrainable())`` (docs/training_core.md); the guard, the fp16 loss
scaler, self-healing and kill -9-safe states with ``--resume auto`` are the core's.
"""
from __future__ import annotations

import argparse
from typing import Optional

import train_network
from library.errors import exit_on_user_error
from library.trainables.leco import LecoTrainable
from library.training import options
from library.training.families import StableDiffusionFamily
from library.training.trainer import Trainer


class LecoTrainer(Trainer):
    """LECO on ``family`` (``sdxl_train_leco.py``: SDXL)."""

    def __init__(self, family: StableDiffusionFamily = StableDiffusionFamily()) -> None:
        super().__init__(family, LecoTrainable())


def setup_parser(family: StableDiffusionFamily = StableDiffusionFamily(),
                 description: str = __doc__.splitlines()[0]) -> argparse.ArgumentParser:
    """The shared options (the image dataset's are refused), the LoRA's and LECO's, the family's."""
    parser = options.setup_parser(description, LecoTrainable())
    family.add_arguments(parser)
    return parser


def main(argv: Optional[list[str]] = None) -> None:
    train_network.main(LecoTrainer, setup_parser, argv)


if __name__ == "__main__":
    exit_on_user_error(main)
