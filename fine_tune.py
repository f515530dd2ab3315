"""Full fine-tuning of SD 1.x/2.x: the UNet (and with --train_text_encoder the text encoder) trained whole.

kohya-ss sd-scripts' ``fine_tune.py`` (``--in_json`` metadata from the Finetuning tab's preparation
scripts, ``--learning_rate_te``) on the training core; see ``sdxl_train.py``.
"""
from __future__ import annotations

import functools
from typing import Optional

import sdxl_train
import train_network
from library.errors import exit_on_user_error
from library.training.families import StableDiffusionFamily

trainer = functools.partial(sdxl_train.FullModelTrainer, StableDiffusionFamily(), "fine_tune")
setup_parser = functools.partial(sdxl_train.setup_parser, StableDiffusionFamily(), "fine_tune", __doc__.splitlines()[0])


def main(argv: Optional[list[str]] = None) -> None:
    train_network.main(trainer, setup_parser, argv)


if __name__ == "__main__":
    exit_on_user_error(main)
