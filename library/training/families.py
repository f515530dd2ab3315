"""The model families a trainer can train on: SD 1.x/2.x and SDXL.

A family is one axis of a trainer (what trains is the other, ``library.trainables``): how the models
load, how prompts become the UNet's conditioning, how the UNet is called, what its blocks are named
in files, and the options only it has.
"""
from __future__ import annotations

import argparse
from typing import Any, Mapping, Optional

import torch

from library import checkpoint_keys, fp8_base, model_loading, text_encoding
from library.datasets import text_cache
from library.model_loading import StableDiffusionModels


class StableDiffusionFamily:
    """SD 1.x/2.x: one CLIP text encoder (``--clip_skip``), ``--v2`` checkpoints."""

    is_sdxl = False
    min_bucket_steps = 64  # kohya's bucket resolution step for the family

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Options only this family has (none: SD 1.x/2.x's live with the shared ones, as in kohya)."""

    def load_models(self, args: argparse.Namespace,
                    load_dtypes: Optional[Mapping[str, torch.dtype]] = None) -> StableDiffusionModels:
        """The models from ``--pretrained_model_name_or_path``; float32, or per component as
        ``load_dtypes`` says (``model_loading.stored_in_dtypes``)."""
        return model_loading.load_models(
            args.pretrained_model_name_or_path,
            sdxl=self.is_sdxl,
            v2=args.v2 and not self.is_sdxl,
            model_config_dir=args.model_config_dir,
            tokenizer_cache_dir=args.tokenizer_cache_dir,
            vae_path=args.vae,
            device=model_loading.load_device(args),
            stored_as=model_loading.stored_in_dtypes(load_dtypes or {}, fp8_base.stored_as_rule(args)),
        )

    def unet_module_names(self, models: StableDiffusionModels) -> Optional[dict[str, str]]:
        """SD1.x/2.x LoRA keys use the diffusers module paths as they are."""
        return None

    def encode_prompts(self, args: argparse.Namespace, models: StableDiffusionModels, captions: list[str]) -> Any:
        """Text conditioning for the UNet: CLIP hidden states (``--clip_skip``, ``--max_token_length``,
        ``--weighted_captions`` aware)."""
        return text_encoding.encode_sd(
            models.tokenizers[0], models.text_encoders[0], captions, args.max_token_length, args.clip_skip,
            weighted=args.weighted_captions,
        )

    def predict(
        self, models: StableDiffusionModels, noisy_latents: torch.Tensor, timesteps: torch.Tensor, conditioning: Any,
        batch: dict[str, Any],
    ) -> torch.Tensor:
        return models.unet(noisy_latents, timesteps, in_autocast_dtype(conditioning)).sample


class SdxlFamily(StableDiffusionFamily):
    """SDXL: two text encoders, pooled conditioning and size/crop embeddings."""

    is_sdxl = True
    min_bucket_steps = 32

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        text_cache.add_arguments(parser)  # --cache_text_encoder_outputs (kohya's sdxl_train_util)

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
            in_autocast_dtype(hidden_states),
            added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids},
        ).sample


def in_autocast_dtype(hidden_states: torch.Tensor) -> torch.Tensor:
    """Text encoder hidden states cast once to the active autocast dtype, as kohya casts them to the
    weight dtype; without it autocast casts them again in every cross-attention key/value projection
    and its LoRA (542 casts per full-size SDXL step). The same values either way. Left as they are
    when they carry gradients (a text encoder trains): the sum of their gradients stays in float32."""
    device_type = hidden_states.device.type
    if hidden_states.requires_grad or not torch.is_autocast_enabled(device_type):
        return hidden_states
    return hidden_states.to(torch.get_autocast_dtype(device_type))
