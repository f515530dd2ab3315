"""LoRA training for SDXL: two text encoders, pooled conditioning and size/crop embeddings.

A thin subclass of ``train_network.NetworkTrainer``; flags and files follow kohya-ss
sd-scripts' ``sdxl_train_network.py``.
"""
from __future__ import annotations

import argparse
from typing import Any, Optional

import torch

import train_network
from library import checkpoint_keys, text_encoding
from library.datasets import text_cache
from library.errors import exit_on_user_error
from library.model_loading import StableDiffusionModels


class SdxlNetworkTrainer(train_network.NetworkTrainer):
    is_sdxl = True

    def unet_module_names(self, models: StableDiffusionModels) -> Optional[dict[str, str]]:
        """SDXL LoRA keys use the original block names (``input_blocks_4_1_...``) like kohya's files."""
        return checkpoint_keys.unet_module_name_map(models.unet.config)

    def encode_prompts(
        self, args: argparse.Namespace, models: StableDiffusionModels, captions: list[str]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Penultimate hidden states of both encoders, concatenated, and text encoder 2's pooled projection
        (kohya's rule, ``--max_token_length`` chunking and ``--weighted_captions``, see ``library.text_encoding``)."""
        return text_encoding.encode_sdxl(models.tokenizers, models.text_encoders, captions, args.max_token_length,
                                         weighted=args.weighted_captions)

    def predict(
        self, models: StableDiffusionModels, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
        conditioning: Any, batch: dict[str, Any],
    ) -> torch.Tensor:
        hidden_states, pooled = conditioning
        # SDXL's micro-conditioning: original size, crop top-left and target size, per image.
        time_ids = torch.cat(
            [batch["original_sizes_hw"], batch["crop_top_lefts"], batch["target_sizes_hw"]], dim=1
        ).to(noisy_latents.device, dtype=noisy_latents.dtype)
        return models.unet(
            noisy_latents,
            timesteps,
            train_network.in_autocast_dtype(hidden_states),
            added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids},
        ).sample


def setup_parser() -> argparse.ArgumentParser:
    parser = train_network.setup_parser()
    parser.description = __doc__.splitlines()[0]
    text_cache.add_arguments(parser)
    return parser


def main(argv: Optional[list[str]] = None) -> None:
    train_network.main(SdxlNetworkTrainer, setup_parser, argv)


if __name__ == "__main__":
    exit_on_user_error(main)
