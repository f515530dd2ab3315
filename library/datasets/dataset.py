"""The training dataset: samples with repeats, an epoch order keyed by (seed, epoch), batches.

Like kohya's datasets, one item is one whole batch; the DataLoader runs with
``batch_size=1`` and never shuffles, so the order (and so the run) is a pure function
of the seed and the epoch, which makes resuming and sharding exact.
"""
from __future__ import annotations

import argparse
import math
from typing import Any, Optional

import numpy as np
import torch

from library.datasets.dreambooth import ImageEntry, discover
from library.datasets.images import load_rgb, resize_and_crop
from library.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--train_data_dir", type=str, default=None,
                        help="folder of <repeats>_<class tokens> subfolders holding training images")
    parser.add_argument("--reg_data_dir", type=str, default=None,
                        help="folder of <repeats>_<class tokens> subfolders holding regularisation images")
    parser.add_argument("--prior_loss_weight", type=float, default=1.0,
                        help="loss weight of regularisation images (default 1.0)")
    parser.add_argument("--caption_extension", type=str, default=".caption",
                        help="extension of caption files beside the images (default .caption)")
    parser.add_argument("--resolution", type=str, default=None,
                        help="training resolution in pixels: 'size' or 'width,height' (required)")
    parser.add_argument("--train_batch_size", type=int, default=1, help="images per micro-batch (default 1)")
    parser.add_argument("--max_data_loader_n_workers", type=int, default=8,
                        help="DataLoader worker processes, capped at the CPU count; 0 loads in the main process (default 8)")


def parse_resolution(text: Optional[str]) -> tuple[int, int]:
    """``--resolution`` as (height, width); kohya writes 'W,H' or one size for both."""
    if text is None:
        raise UserError("--resolution is required (e.g. --resolution 1024 or --resolution 1024,768)")
    parts = [part.strip() for part in str(text).split(",")]
    try:
        sizes = [int(part) for part in parts]
    except ValueError:
        raise UserError(f"--resolution {text}: expected 'size' or 'width,height' in pixels") from None
    if len(sizes) not in (1, 2) or min(sizes) < 64 or any(size % 8 for size in sizes):
        raise UserError(f"--resolution {text}: sizes must be multiples of 8 and at least 64 ('size' or 'width,height')")
    width, height = (sizes[0], sizes[0]) if len(sizes) == 1 else sizes
    return height, width


class TrainDataset(torch.utils.data.Dataset):
    """Batches of images at one resolution, with SDXL size/crop conditioning per image."""

    def __init__(
        self,
        entries: list[ImageEntry],
        resolution_hw: tuple[int, int],
        batch_size: int,
        seed: int,
        prior_loss_weight: float = 1.0,
    ) -> None:
        if batch_size <= 0:
            raise UserError(f"--train_batch_size {batch_size} must be at least 1")
        self.resolution_hw = resolution_hw
        self.batch_size = batch_size
        self.seed = seed
        self.prior_loss_weight = prior_loss_weight
        train = [entry for entry in entries if not entry.is_reg for _ in range(entry.num_repeats)]
        reg = [entry for entry in entries if entry.is_reg for _ in range(entry.num_repeats)]
        if reg:
            # kohya: regularisation samples are cycled to as many as the training samples.
            reg = (reg * math.ceil(len(train) / len(reg)))[: len(train)]
        self.samples: list[ImageEntry] = train + reg
        self.num_train_images = len({entry.path for entry in entries if not entry.is_reg})
        self.num_reg_images = len({entry.path for entry in entries if entry.is_reg})
        self.batches: list[list[int]] = []
        self.set_epoch(1)

    def set_epoch(self, epoch: int) -> None:
        """Shuffle the samples for ``epoch`` (1-based) with an RNG keyed by (seed, epoch)."""
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.samples)).tolist()
        self.batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, batch_index: int) -> dict[str, Any]:
        images, captions, original_sizes, crops, weights = [], [], [], [], []
        for sample_index in self.batches[batch_index]:
            entry = self.samples[sample_index]
            image = load_rgb(entry.path)
            pixels, crop_top_left = resize_and_crop(image, self.resolution_hw)
            images.append(torch.from_numpy(pixels).permute(2, 0, 1))
            captions.append(entry.caption)
            original_sizes.append((image.height, image.width))
            crops.append(crop_top_left)
            weights.append(self.prior_loss_weight if entry.is_reg else 1.0)
        return {
            # uint8 HWC -> float CHW in [-1, 1], the VAE's input range
            "images": torch.stack(images).float().div(127.5).sub(1.0),
            "captions": captions,
            "original_sizes_hw": torch.tensor(original_sizes, dtype=torch.long),
            "crop_top_lefts": torch.tensor(crops, dtype=torch.long),
            "target_sizes_hw": torch.tensor([self.resolution_hw] * len(captions), dtype=torch.long),
            "sample_indices": torch.tensor(self.batches[batch_index], dtype=torch.long),
            "loss_weights": torch.tensor(weights, dtype=torch.float32),
        }


def build_dataset(args: argparse.Namespace) -> TrainDataset:
    """The dataset described by the command-line dataset flags."""
    if not args.train_data_dir:
        raise UserError("--train_data_dir is required: a folder of <repeats>_<class tokens> subfolders of images")
    resolution_hw = parse_resolution(args.resolution)
    entries = discover(args.train_data_dir, args.caption_extension, is_reg=False, flag="--train_data_dir")
    if args.reg_data_dir:
        entries += discover(args.reg_data_dir, args.caption_extension, is_reg=True, flag="--reg_data_dir")
    for entry in entries:
        load_rgb(entry.path)  # refuse an unreadable image before any compute is spent
    return TrainDataset(entries, resolution_hw, args.train_batch_size, args.seed, args.prior_loss_weight)


def collate_single_batch(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The DataLoader runs with batch_size=1 over batches: unwrap the one item."""
    return items[0]
