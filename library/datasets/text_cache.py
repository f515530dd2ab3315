"""``--cache_text_encoder_outputs`` (+ ``_to_disk``) for SDXL: encode every caption once, before training.

Only valid when the text encoders are frozen (``--network_train_unet_only``; ``sdxl_train.py``: without
``--train_text_encoder``) and a
sample's caption never changes (no shuffle, dropout, tag dropout or wildcards):
otherwise the cache would train on captions the run did not ask for, so the run is
refused before any model is loaded. Captions are encoded with the trainer's own
function (``library.text_encoding``), so cached and uncached runs condition the UNet
identically. Disk files are kohya's ``<stem>_te_outputs.npz`` (``hidden_state1``,
``hidden_state2``, ``pool2``) plus ``cache_meta`` (caption, max_token_length,
weighted_captions, text encoder fingerprint); a file whose metadata differs is rebuilt,
never used.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
from typing import Callable, Optional

import numpy as np
import torch

from library import atomic_files
from library.datasets.captions import process_caption
from library.datasets.config import SubsetSpec
from library.datasets.plan import PlannedImage
from library.errors import UserError

CACHE_FORMAT = 1
TE_OUTPUTS_SUFFIX = "_te_outputs.npz"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache_text_encoder_outputs", action="store_true",
                        help="encode every caption once before training (SDXL; needs --network_train_unet_only "
                             "and captions without shuffle/dropout; frees the text encoders when possible)")
    parser.add_argument("--cache_text_encoder_outputs_to_disk", action="store_true",
                        help="also keep them in <image>_te_outputs.npz beside each image (implies "
                             "--cache_text_encoder_outputs)")


def validate(args: argparse.Namespace, subsets: list[SubsetSpec]) -> None:
    """Refuse a text cache that would be wrong, naming the option that conflicts."""
    if getattr(args, "cache_text_encoder_outputs_to_disk", False):
        args.cache_text_encoder_outputs = True
    if not getattr(args, "cache_text_encoder_outputs", False):
        return
    # A full fine-tuner says it with --train_text_encoder (refused with the cache in its own checks).
    if not args.network_train_unet_only and getattr(args, "train_text_encoder", None) is not False:
        raise UserError("--cache_text_encoder_outputs needs --network_train_unet_only: a text encoder that is "
                        "being trained cannot have its outputs cached")
    for subset in subsets:
        options = subset.captions
        conflicts = [name for name, on in (
            ("shuffle_caption", options.shuffle_caption),
            ("caption_dropout_rate", options.caption_dropout_rate > 0),
            ("caption_dropout_every_n_epochs", options.caption_dropout_every_n_epochs > 0),
            ("caption_tag_dropout_rate", options.caption_tag_dropout_rate > 0),
            ("enable_wildcard", options.enable_wildcard),
            ("token_warmup_step", options.token_warmup_step > 0),
        ) if on]
        if conflicts:
            raise UserError(f"--cache_text_encoder_outputs cannot be used with {', '.join(conflicts)} "
                            f"({subset.where}): cached outputs would ignore them; turn one of them off")


def fixed_caption(image: PlannedImage) -> str:
    """The caption an image is always trained with when nothing about it is random."""
    return process_caption(image.subset.captions, image.caption, epoch=1, rng=np.random.default_rng(0))


def text_encoders_fingerprint(text_encoders) -> str:
    """A short hash of the first values of every weight of the text encoders as they run (after the
    cast to the training dtype): another model, or LoRAs merged in with --base_weights, give
    another fingerprint."""
    digest = hashlib.sha1()
    for encoder in text_encoders:
        for name, weight in encoder.state_dict().items():
            digest.update(name.encode())
            digest.update(weight.detach().reshape(-1)[:64].to("cpu", torch.float32).numpy().tobytes())
    return digest.hexdigest()[:16]


class TextOutputStore:
    """SDXL conditioning per caption: (hidden states 1 and 2 concatenated, pooled), float32 on the CPU."""

    def __init__(self) -> None:
        self.by_caption: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.caption_of: dict[int, str] = {}  # image index -> caption

    def get(self, image_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.by_caption[self.caption_of[image_index]]


def _npz_path(image: PlannedImage) -> str:
    return os.path.splitext(image.path)[0] + TE_OUTPUTS_SUFFIX


def _read_fresh(path: str, meta: dict) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    if not os.path.isfile(path):
        return None
    try:
        with np.load(path) as npz:
            if "cache_meta" not in npz.files or json.loads(str(npz["cache_meta"])) != meta:
                return None
            hidden = torch.from_numpy(np.concatenate([npz["hidden_state1"], npz["hidden_state2"]], axis=-1))
            return hidden, torch.from_numpy(npz["pool2"])
    except Exception:  # damaged file: rebuild it
        return None


def cache_text_encoder_outputs(
    images: list[PlannedImage],
    encode_parts: Callable[[list[str]], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    fingerprint: str,
    max_token_length: Optional[int],
    to_disk: bool,
    batch_size: int = 8,
    weighted_captions: bool = False,
) -> TextOutputStore:
    """Encode each distinct caption once with ``encode_parts`` (captions -> hidden1, hidden2, pooled).
    ``max_token_length`` and ``weighted_captions`` say how ``encode_parts`` encodes: files made otherwise are stale."""
    store = TextOutputStore()
    captions_by_path: dict[str, set[str]] = {}
    for image in images:
        caption = fixed_caption(image)
        store.caption_of[image.index] = caption
        captions_by_path.setdefault(image.path, set()).add(caption)
    # A file holds one caption: images used with two different captions stay in memory only.
    disk_path_of = {caption: None for caption in store.caption_of.values()}
    if to_disk:
        for image in images:
            caption = store.caption_of[image.index]
            if len(captions_by_path[image.path]) == 1 and disk_path_of[caption] is None:
                disk_path_of[caption] = _npz_path(image)
    meta_of = {caption: {"format": CACHE_FORMAT, "caption": caption, "max_token_length": max_token_length,
                         "weighted_captions": weighted_captions, "text_encoders": fingerprint}
               for caption in disk_path_of}
    pending = []
    for caption, path in disk_path_of.items():
        cached = _read_fresh(path, meta_of[caption]) if path else None
        if cached is not None:
            store.by_caption[caption] = cached
        else:
            pending.append(caption)
    for start in range(0, len(pending), batch_size):
        chunk = pending[start : start + batch_size]
        with torch.no_grad():
            hidden1, hidden2, pooled = (t.float().cpu() for t in encode_parts(chunk))
        for row, caption in enumerate(chunk):
            parts = (hidden1[row].clone(), hidden2[row].clone(), pooled[row].clone())
            if not all(torch.isfinite(part).all() for part in parts):
                raise UserError(f"text encoder outputs for caption {caption!r} contain NaN or Inf; "
                                f"try --mixed_precision no or bf16")
            store.by_caption[caption] = (torch.cat(parts[:2], dim=-1), parts[2])
            path = disk_path_of[caption]
            if path is not None:
                buffer = io.BytesIO()
                np.savez(buffer, hidden_state1=parts[0].numpy(), hidden_state2=parts[1].numpy(),
                         pool2=parts[2].numpy(), cache_meta=np.array(json.dumps(meta_of[caption])))
                atomic_files.write_file(path, buffer.getvalue())
    print(f"cached text encoder outputs: {len(pending)} captions encoded, "
          f"{len(disk_path_of) - len(pending)} read from disk")
    return store
