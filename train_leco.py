"""LECO / concept-slider LoRA training for Stable Diffusion 1.x/2.x (no image dataset).

Flags and files follow kohya-ss sd-scripts' ``train_leco.py``: ``--prompts_file`` (LECO prompt pairs or
ai-toolkit slider targets), ``--max_denoising_steps``, ``--leco_denoise_guidance_scale`` and the LoRA
trainer's model, network, optimizer and output options. The loop is ``library.leco``.
"""
from __future__ import annotations

import argparse
from typing import Optional

from library import config_file, leco
from library.errors import exit_on_user_error
from library.training import options
from library.training.families import StableDiffusionFamily


def setup_parser(description: str = __doc__.splitlines()[0]) -> argparse.ArgumentParser:
    parser = options.setup_parser(description)  # the LoRA trainer's options (the dataset's stay unused)
    leco.add_arguments(parser)
    return parser


def main(family_class: type = StableDiffusionFamily, parser_factory=setup_parser,
         argv: Optional[list[str]] = None) -> None:
    parser = parser_factory()
    args, _ = config_file.parse_args(parser, argv)
    leco.train(family_class(), args)


if __name__ == "__main__":
    exit_on_user_error(main)
