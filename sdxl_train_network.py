"""LoRA training for SDXL: two text encoders, pooled conditioning and size/crop embeddings.

``train_network.NetworkTrainer`` on the SDXL model family (``library.training.families.SdxlFamily``);
flags and files follow kohya-ss sd-scripts' ``sdxl_train_network.py``.
"""
from __future__ import annotations

import argparse
from typing import Optional

import train_network
from library.errors import exit_on_user_error
from library.training.families import SdxlFamily


class SdxlNetworkTrainer(train_network.NetworkTrainer):
    family_class = SdxlFamily


def setup_parser() -> argparse.ArgumentParser:
    parser = train_network.setup_parser()
    parser.description = __doc__.splitlines()[0]
    SdxlFamily().add_arguments(parser)
    return parser


def main(argv: Optional[list[str]] = None) -> None:
    train_network.main(SdxlNetworkTrainer, setup_parser, argv)


if __name__ == "__main__":
    exit_on_user_error(main)
