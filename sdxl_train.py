"""Full fine-tuning of SDXL: the UNet (and with --train_text_encoder the text encoders) trained whole.

kohya-ss sd-scripts' ``sdxl_train.py`` (its options, files and names) on the project's training core:
``Trainer(SdxlFamily(), FullModelTrainable("sdxl_train"))`` (docs/training_core.md); the guard, the fp16
loss scaler, self-healing and kill -9-safe states with ``--resume auto`` are the core's.
"""
from __future__ import annotations

import argparse
from typing import Optional

import train_network
from library.errors import exit_on_user_error
from library.full_training_params import Script
from library.trainables.full_model import FullModelTrainable
from library.training import options
from library.training.families import SdxlFamily, StableDiffusionFamily
from library.training.trainer import Trainer

SCRIPT: Script = "sdxl_train"


class FullModelTrainer(Trainer):
    """A full fine-tune of ``family`` by ``script``'s rules (``train_db.py`` / ``fine_tune.py`` use it too)."""

    def __init__(self, family: StableDiffusionFamily = SdxlFamily(), script: Script = SCRIPT) -> None:
        super().__init__(family, FullModelTrainable(script))


def setup_parser(family: StableDiffusionFamily = SdxlFamily(), script: Script = SCRIPT,
                 description: str = __doc__.splitlines()[0]) -> argparse.ArgumentParser:
    """kohya's options of ``script``: the shared ones, the full fine-tune's and the family's."""
    from library import fused_backward

    parser = options.setup_parser(description, FullModelTrainable(script))
    fused_backward.add_arguments(parser)
    family.add_arguments(parser)
    return parser


def main(argv: Optional[list[str]] = None) -> None:
    train_network.main(FullModelTrainer, setup_parser, argv)


if __name__ == "__main__":
    exit_on_user_error(main)
