"""Textual inversion for Stable Diffusion 1.x/2.x: new token embeddings for a frozen model.

kohya-ss sd-scripts' ``train_textual_inversion.py`` (its flags and ``emb_params`` files) on the
project's training core: the SD 1.x/2.x model family and the embedding trainable
(``library.trainables.embeddings``).
"""
from __future__ import annotations

import argparse
from typing import Any, Optional

import train_network
from library.errors import exit_on_user_error
from library.model_loading import StableDiffusionModels
from library.trainables.embeddings import EmbeddingTrainable, lora_option_defaults
from library.training import options
from library.training.families import StableDiffusionFamily
from library.training.trainer import Trainer


class TextualInversionTrainer(Trainer):
    """Trains new token embeddings; ``sdxl_train_textual_inversion.SdxlTextualInversionTrainer`` on SDXL."""

    family_class: type = StableDiffusionFamily

    def __init__(self) -> None:
        super().__init__(self.family_class(), EmbeddingTrainable())

    def encode_prompts(self, args: argparse.Namespace, models: StableDiffusionModels, captions: list[str]) -> Any:
        """The captions rewritten as kohya's trainer does (templates, the token string's vectors)."""
        return super().encode_prompts(args, models, self.trainable.captions(captions))

    def sample_prompt_replacement(self) -> Optional[tuple[str, str]]:
        """kohya's: the token string in sample prompts becomes all its tokens (``tok`` -> ``tok tok1 tok2``)."""
        return self.trainable.prompt_replacement()


def setup_parser() -> argparse.ArgumentParser:
    parser = options.setup_parser(__doc__.splitlines()[0], EmbeddingTrainable())
    # kohya's default format for embeddings; no LoRA options on this command line (the shared checks read their defaults)
    parser.set_defaults(save_model_as="pt", **lora_option_defaults())
    return parser


def main(argv: Optional[list[str]] = None) -> None:
    train_network.main(TextualInversionTrainer, setup_parser, argv)


if __name__ == "__main__":
    exit_on_user_error(main)
