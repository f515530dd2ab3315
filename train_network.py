"""LoRA training for Stable Diffusion 1.x/2.x, and the trainer shared with SDXL.

Flags, defaults and output files follow kohya-ss sd-scripts. The loop itself is the project's
training core (``library.training``: batch -> noise -> forward -> loss -> backward -> guard -> step
-> log -> save); this script composes it from the SD 1.x/2.x model family and the LoRA trainable
(``library.trainables.lora``), and keeps kohya's ``NetworkTrainer`` for its users.
"""
from __future__ import annotations

import argparse
from typing import Optional

from library import config_file, fault_injection
from library.errors import exit_on_user_error
from library.trainables.lora import (  # noqa: F401  (kohya's users and the tests import them from here)
    NOTHING_TO_TRAIN, add_network_arguments, validate_arguments,
)
from library.training.diffusion_loss import encode_latents  # noqa: F401
from library.training.families import StableDiffusionFamily, in_autocast_dtype  # noqa: F401
from library.training.options import add_training_arguments  # noqa: F401
from library.training import options
from library.training.run import LossContext, Optimization, Run  # noqa: F401
from library.training.trainer import Trainer
from library.trainables.lora import LoraTrainable


def setup_parser() -> argparse.ArgumentParser:
    return options.setup_parser(__doc__.splitlines()[0])


class NetworkTrainer(Trainer):
    """Trains a LoRA on SD1.x/2.x; ``sdxl_train_network.SdxlNetworkTrainer`` trains it on SDXL."""

    family_class: type = StableDiffusionFamily

    def __init__(self) -> None:
        super().__init__(self.family_class(), LoraTrainable())


def main(trainer_class: type = NetworkTrainer, parser_factory=setup_parser, argv: Optional[list[str]] = None) -> None:
    """Parse the command line (and ``--config_file``) and train."""
    parser = parser_factory()
    args, explicit = config_file.parse_args(parser, argv)
    fault_injection.simulate_full_disk(args)
    trainer_class().train(args, explicit)


if __name__ == "__main__":
    exit_on_user_error(main)
