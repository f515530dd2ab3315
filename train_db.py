"""DreamBooth full fine-tuning of SD 1.x/2.x: the UNet and the text encoder trained whole.

kohya-ss sd-scripts' ``train_db.py`` (DreamBooth folders, ``--reg_data_dir``, ``--prior_loss_weight``,
``--stop_text_encoder_training -1``) on the training core; see ``sdxl_train.py``.
"""
from __future__ import annotations

import functools
from typing import Optional

import sdxl_train
import train_network
from library.errors import exit_on_user_error
from library.training.families import StableDiffusionFamily

trainer = functools.partial(sdxl_train.FullModelTrainer, StableDiffusionFamily(), "train_db")
setup_parser = functools.partial(sdxl_train.setup_parser, StableDiffusionFamily(), "train_db", __doc__.splitlines()[0])


def main(argv: Optional[list[str]] = None) -> None:
    train_network.main(trainer, setup_parser, argv)


if __name__ == "__main__":
    exit_on_user_error(main)
