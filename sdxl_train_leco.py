"""LECO / concept-slider LoRA training for SDXL (no image dataset).

``train_leco.py`` on the SDXL model family; flags and files follow kohya-ss sd-scripts'
``sdxl_train_leco.py``.
"""
from __future__ import annotations

import argparse
from typing import Optional

import train_leco
import train_network
from library.errors import exit_on_user_error
from library.training.families import SdxlFamily


class SdxlLecoTrainer(train_leco.LecoTrainer):
    def __init__(self) -> None:
        super().__init__(SdxlFamily())


def setup_parser() -> argparse.ArgumentParser:
    return train_leco.setup_parser(SdxlFamily(), __doc__.splitlines()[0])


def main(argv: Optional[list[str]] = None) -> None:
    train_network.main(SdxlLecoTrainer, setup_parser, argv)


if __name__ == "__main__":
    exit_on_user_error(main)
