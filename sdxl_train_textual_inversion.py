"""Textual inversion for SDXL: one new embedding per text encoder (``clip_l`` and ``clip_g``).

``train_textual_inversion.TextualInversionTrainer`` on the SDXL model family; flags and files follow
kohya-ss sd-scripts' ``sdxl_train_textual_inversion.py``.
"""
from __future__ import annotations

import argparse
from typing import Optional

import train_network
import train_textual_inversion
from library.errors import exit_on_user_error
from library.training.families import SdxlFamily


class SdxlTextualInversionTrainer(train_textual_inversion.TextualInversionTrainer):
    family_class = SdxlFamily


def setup_parser() -> argparse.ArgumentParser:
    parser = train_textual_inversion.setup_parser()
    parser.description = __doc__.splitlines()[0]
    SdxlFamily().add_arguments(parser)  # refused with textual inversion: the text encoders' input trains
    return parser


def main(argv: Optional[list[str]] = None) -> None:
    train_network.main(SdxlTextualInversionTrainer, setup_parser, argv)


if __name__ == "__main__":
    exit_on_user_error(main)
