"""LECO / concept-slider LoRA training for SDXL (no image dataset).

``train_leco.py`` on the SDXL model family; flags and files follow kohya-ss sd-scripts'
``sdxl_train_leco.py``.
"""
from __future__ import annotations

import argparse
from typing import Optional

import train_leco
from library.errors import exit_on_user_error
from library.training.families import SdxlFamily


def setup_parser() -> argparse.ArgumentParser:
    parser = train_leco.setup_parser(__doc__.splitlines()[0])
    SdxlFamily().add_arguments(parser)
    return parser


def main(argv: Optional[list[str]] = None) -> None:
    train_leco.main(SdxlFamily, setup_parser, argv)


if __name__ == "__main__":
    exit_on_user_error(main)
