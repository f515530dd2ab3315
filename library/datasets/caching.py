"""Filling the dataset's caches before training, then freeing the models training no longer needs."""
from __future__ import annotations

import argparse
import ctypes
import gc
import sys
from typing import Optional

import torch

from library import sampling, text_encoding
from library.datasets import latents, text_cache
from library.datasets.dataset import TrainDataset


def cache_before_training(args: argparse.Namespace, dataset: TrainDataset, models, accelerator,
                          autocast_dtype: torch.dtype, validation_dataset: Optional[TrainDataset] = None) -> None:
    """Cache latents (``--cache_latents``) and SDXL text encoder outputs (``--cache_text_encoder_outputs``)
    of ``dataset`` and, when given, of ``validation_dataset`` (its own stores, same models and options).

    Call after the models are placed on their device. Mutates the datasets (their stores)
    and ``models``: the VAE, and the text encoders when their outputs are cached, are
    dropped (``models.vae = None``, ``models.text_encoders = []``) unless images are sampled
    later (``sampling.is_scheduled``). The freed memory is returned to the OS, and on
    CUDA the allocator's cache is emptied unless ``--highvram``.
    """
    keeps_models_for_sampling = sampling.is_scheduled(args)
    cached = [each for each in (dataset, validation_dataset) if each is not None]
    if args.cache_latents:
        for each in cached:
            each.latent_store = latents.cache_latents(
                each.plan.images, models.vae, to_disk=args.cache_latents_to_disk, is_sdxl=models.is_sdxl,
                vae_batch_size=args.vae_batch_size, is_main_process=accelerator.is_main_process,
                wait_for_everyone=accelerator.wait_for_everyone,
            )
        if not keeps_models_for_sampling:
            models.vae = None
    if getattr(args, "cache_text_encoder_outputs", False):
        def encode_parts(captions: list[str]):
            return text_encoding.encode_sdxl_parts(models.tokenizers, models.text_encoders, captions,
                                                   args.max_token_length, weighted=args.weighted_captions)

        autocast = torch.autocast(accelerator.device.type, dtype=autocast_dtype,
                                  enabled=args.mixed_precision != "no")
        for each in cached:
            with autocast:
                each.text_store = text_cache.cache_text_encoder_outputs(
                    each.plan.images, encode_parts, text_cache.text_encoders_fingerprint(models.text_encoders),
                    args.max_token_length,
                    weighted_captions=args.weighted_captions,
                    # one writer: other processes encode into memory
                    to_disk=args.cache_text_encoder_outputs_to_disk and accelerator.is_main_process,
                )
        if not keeps_models_for_sampling:
            models.text_encoders = []
    gc.collect()
    release_freed_memory(accelerator.device, keep_device_cache=getattr(args, "highvram", False))


def release_freed_memory(device: torch.device, keep_device_cache: bool = False) -> None:
    """Hand memory of freed tensors back: host heap pages to the OS, and the CUDA cache unless kept.

    glibc serves tensors below its mmap threshold (which grows to 32 MiB as large blocks
    are freed) from the heap, and a freed heap block stays in the process: without
    ``malloc_trim`` the dropped SDXL text encoders (about 3 GiB in fp32) would stay resident
    for the whole run. Elsewhere (no glibc) this is a no-op on the host side.
    """
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to trim
            pass
    if device.type == "cuda" and not keep_device_cache:
        torch.cuda.empty_cache()
