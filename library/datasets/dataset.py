"""The training dataset: batches formed within buckets, ordered per epoch by (seed, epoch).

Like kohya's datasets, one item is one whole batch; the DataLoader runs with
``batch_size=1`` and never shuffles. Every random choice is a pure function of its key:
the epoch's batch order of (seed, epoch), a sample's flip, crop, colour jitter and
caption of (seed, epoch, sample id). So a run does not depend on the worker count,
and resuming at any batch of any epoch reproduces it exactly.

A batch is a dict:
  ``images``            float (B, 3, H, W) in [-1, 1]   (absent when latents are cached)
  ``latents``, ``latents_std``  float (B, 4, H/8, W/8), the VAE mean and std times its
                        scaling factor (only with a latent cache; see ``latents.py``)
  ``captions``          list of B processed captions
  ``original_sizes_hw``, ``crop_top_lefts``, ``target_sizes_hw``  long (B, 2): SDXL's
                        size conditioning of the pixels actually trained on
  ``sample_indices``    long (B,): stable sample ids (key the noise)
  ``loss_weights``      float (B,): prior_loss_weight for regularisation samples, else 1
  ``flipped``           bool (B,)
  ``alpha_masks``       float (B, H, W) in [0, 1], only when a sample's subset has alpha_mask
  ``text_encoder_outputs``  (hidden (B, L, D), pooled (B, P)), only with a text cache
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np
import torch

from library import text_encoding
from library.datasets import config as dataset_config
from library.datasets import text_cache
from library.datasets.buckets import center_crop_top_left, random_crop_top_left, sdxl_crop_top_left
from library.datasets.captions import process_caption
from library.datasets.images import INTERPOLATIONS, color_augment, ensure_size, load_image, resize_crop_flip
from library.datasets.plan import Plan, PlannedImage, base_name, plan_datasets
from library.datasets.sources import dreambooth_subsets_from_folders
from library.errors import UserError

# Independent random streams of one sample.
_STREAM_IMAGE = 1
_STREAM_CAPTION = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """kohya's dataset flags (names, defaults); with --dataset_config they are the fallback values."""
    group = parser.add_argument_group("dataset")
    add = group.add_argument
    add("--train_data_dir", type=str, default=None,
        help="folder of <repeats>_<class tokens> subfolders of training images (or the image folder of --in_json)")
    add("--reg_data_dir", type=str, default=None, help="folder of <repeats>_<class tokens> subfolders of "
        "regularisation images; they are repeated to match the training sample count (kohya's rule)")
    add("--dataset_config", type=str, default=None, help="kohya dataset config (.toml or .json): [general], "
        "[[datasets]], [[datasets.subsets]]; replaces --train_data_dir/--reg_data_dir/--in_json")
    add("--in_json", type=str, default=None, help="kohya fine-tuning metadata JSON for the images in --train_data_dir")
    add("--dataset_repeats", type=int, default=1, help="repeats of the --in_json dataset per epoch (default 1)")
    add("--prior_loss_weight", type=float, default=1.0, help="loss weight of regularisation images (default 1.0)")
    add("--caption_extension", type=str, default=".caption",
        help="extension of caption files beside the images (default .caption)")
    add("--resolution", type=str, default=None, help="training resolution in pixels: 'size' or 'width,height'")
    add("--train_batch_size", type=int, default=1, help="images per micro-batch (default 1)")
    add("--enable_bucket", action="store_true", help="aspect-ratio buckets (kohya's table and rule)")
    add("--min_bucket_reso", type=int, default=256, help="smallest bucket side in pixels (default 256)")
    add("--max_bucket_reso", type=int, default=1024, help="largest bucket side in pixels (default 1024)")
    add("--bucket_reso_steps", type=int, default=64,
        help="bucket side step in pixels (default 64; SDXL needs a multiple of 32, SD1/2 of 64)")
    add("--bucket_no_upscale", action="store_true", help="never enlarge images: one bucket per image size")
    add("--skip_image_resolution", type=str, default=None,
        help="leave out images whose original width x height is at most this area: 'size' or 'width,height' "
             "(kohya v0.10.2+; e.g. 768 for a 1024 dataset of a multi-resolution config; default: keep all)")
    add("--shuffle_caption", action="store_true", help="shuffle the caption's separated tags each time")
    add("--caption_separator", type=str, default=",", help="tag separator in captions (default ',')")
    add("--keep_tokens", type=int, default=0, help="leading tags never shuffled or dropped (default 0)")
    add("--keep_tokens_separator", type=str, default="",
        help="tags before this separator (and after a second one) stay fixed, e.g. '|||' (default none)")
    add("--secondary_separator", type=str, default=None,
        help="separator inside a tag, replaced by caption_separator after shuffling (default none)")
    add("--enable_wildcard", action="store_true", help="{a|b} wildcards and one random line of multi-line captions")
    add("--caption_prefix", type=str, default=None, help="text put before every caption (default none)")
    add("--caption_suffix", type=str, default=None, help="text put after every caption (default none)")
    add("--caption_dropout_rate", type=float, default=0.0, help="probability of an empty caption (default 0)")
    add("--caption_dropout_every_n_epochs", type=int, default=0,
        help="empty captions for the whole epoch every N epochs (default 0: never)")
    add("--debug_dataset", action="store_true",
        help="print every batch of the first epoch (images, captions, sizes, crops, flips) and exit "
             "without loading a model or training")
    add("--token_warmup_min", type=int, default=1,
        help="token warm-up: tags kept (after --keep_tokens) at the first step (default 1)")
    add("--token_warmup_step", type=float, default=0,
        help="token warm-up: the step at which captions reach all their tags, growing linearly from "
             "--token_warmup_min; below 1 a fraction of --max_train_steps (default 0: off)")
    add("--caption_tag_dropout_rate", type=float, default=0.0, help="probability of dropping each tag (default 0)")
    add("--color_aug", action="store_true", help="kohya's weak hue/gamma augmentation (not with cached latents)")
    add("--flip_aug", action="store_true", help="mirror images half of the time (cached latents keep both sides)")
    add("--random_crop", action="store_true", help="random instead of centred crops (not with cached latents)")
    add("--alpha_mask", action="store_true",
        help="use the alpha channel as a loss mask (transparent pixels do not count); otherwise alpha is "
             "composited on white")
    add("--cache_info", action="store_true", help="keep captions and sizes in metadata_cache.json per folder")
    add("--resize_interpolation", type=str, default=None, choices=sorted(INTERPOLATIONS),
        help="resize filter (default: area when shrinking, lanczos when enlarging)")
    add("--skip_bad_images", action="store_true",
        help="skip unreadable or empty image files with a warning instead of stopping before training")
    add("--cache_latents", action="store_true", help="encode every image with the VAE once, before training "
        "(refuses color_aug and random_crop; frees the VAE unless images are sampled)")
    add("--cache_latents_to_disk", action="store_true",
        help="keep the latents in <image>_<W>x<H>_sdxl.npz beside each image (implies --cache_latents)")
    add("--vae_batch_size", type=int, default=1, help="images per VAE call while caching latents (default 1)")
    add("--max_data_loader_n_workers", type=int, default=8,
        help="DataLoader worker processes, capped at the CPU count; 0 loads in the main process (default 8)")
    add("--persistent_data_loader_workers", action="store_true",
        help="keep DataLoader workers between epochs (they follow the epoch through shared memory)")
    text_encoding.add_arguments(group)


def parse_resolution(text: Optional[str]) -> tuple[int, int]:
    """``--resolution`` as (height, width); kohya writes 'W,H' or one size for both."""
    if text is None:
        raise UserError("--resolution is required (e.g. --resolution 1024 or --resolution 1024,768)")
    width, height = dataset_config.parse_resolution_wh(text, "--resolution")
    return height, width


def _seed64(seed: int) -> int:
    return int(seed) & 0xFFFFFFFFFFFFFFFF


@dataclass(frozen=True)
class StepLayout:
    """How batches map to optimizer steps (set by the trainer before the data loader starts)."""

    accumulation_steps: int = 1
    world_size: int = 1
    max_train_steps: int = 0


class TrainDataset(torch.utils.data.Dataset):
    """Batches of one bucket each; ``set_epoch`` reorders them, also inside persistent workers."""

    unit = "images"  # what the run's first line counts (a trainable's own samples name theirs)

    def __init__(self, plan: Plan, seed: int) -> None:
        self.plan = plan
        self.seed = seed
        self.latent_store = None  # set by caching.cache_before_training
        self.text_store = None
        # --debug_inject_sample: image file name (or stem) -> value written into its latents or pixels
        self.poisoned: dict[str, float] = {}
        # Workers hold copies of this object; the epoch reaches them through shared memory.
        self._shared_epoch = multiprocessing.Value("i", 1, lock=False)
        # For token warm-up: the optimizer steps done when the epoch's first batch trains.
        self._shared_first_step = multiprocessing.Value("q", 0, lock=False)
        self.step_layout = StepLayout()
        self._order_epoch: Optional[int] = None
        self._batches: list[list[int]] = []
        self.set_epoch(1)

    # -- facts the trainer reports ---------------------------------------------------------
    @property
    def resolution_hw(self) -> tuple[int, int]:
        width, height = self.plan.datasets[0].spec.resolution_wh
        return height, width

    @property
    def num_train_images(self) -> int:
        return sum(dataset.num_train_images for dataset in self.plan.datasets)

    @property
    def num_reg_images(self) -> int:
        return sum(dataset.num_reg_images for dataset in self.plan.datasets)

    @property
    def max_batch_size(self) -> int:
        return max(dataset.spec.batch_size for dataset in self.plan.datasets)

    def image_index_of(self, sample_id: int) -> int:
        return self.plan.sample_images[sample_id]

    def dataset_dirs(self, reg: bool = False) -> dict[str, dict[str, int]]:
        """kohya's ``ss_dataset_dirs`` of a folder run (``ss_reg_dataset_dirs`` with ``reg``):
        folder (or metadata file) name -> {"n_repeats": the subset's own repeats, "img_count"}."""
        return {
            base_name(subset.spec.name): {"n_repeats": subset.spec.num_repeats, "img_count": subset.img_count}
            for dataset in self.plan.datasets
            for subset in dataset.subsets
            if subset.spec.is_reg == reg
        }

    def tag_frequency(self) -> dict[str, dict[str, int]]:
        """kohya's ``ss_tag_frequency``: folder name -> tag -> count over raw captions, reg folders
        included; a folder used by several datasets is taken from the first (kohya's merge)."""
        merged: dict[str, dict[str, int]] = {}
        for dataset in self.plan.datasets:
            for folder, counts in dataset.tag_frequency.items():
                merged.setdefault(folder, counts)
        return merged

    # -- epoch order -----------------------------------------------------------------------
    def set_epoch(self, epoch: int, first_step: int = 0) -> None:
        """Order the batches for ``epoch`` (1-based), whose first batch trains after ``first_step``
        optimizer steps; workers pick the new epoch up on their next item."""
        self._shared_first_step.value = int(first_step)
        self._shared_epoch.value = int(epoch)
        self._order(int(epoch))

    @property
    def epoch(self) -> int:
        return int(self._shared_epoch.value)

    def _order(self, epoch: int) -> None:
        if self._order_epoch == epoch:
            return
        rng = np.random.default_rng([_seed64(self.seed), epoch])
        batches = []
        for dataset in self.plan.datasets:
            batch_size = dataset.spec.batch_size
            for bucket in sorted(dataset.bucket_samples):
                ids = dataset.bucket_samples[bucket]
                shuffled = [ids[i] for i in rng.permutation(len(ids))]
                batches += [shuffled[i : i + batch_size] for i in range(0, len(shuffled), batch_size)]
        self._batches = [batches[i] for i in rng.permutation(len(batches))]
        self._order_epoch = epoch

    def batch_sample_ids(self, batch_index: int) -> list[int]:
        self._order(self.epoch)
        return self._batches[batch_index]

    def __len__(self) -> int:
        return len(self._batches)

    # -- items -----------------------------------------------------------------------------
    def __getitem__(self, batch_index: int) -> dict[str, Any]:
        epoch = self.epoch
        self._order(epoch)
        sample_ids = self._batches[batch_index]
        layout = self.step_layout  # batch i of each process trains in the epoch's step i // accumulation
        step = self._shared_first_step.value + batch_index // layout.world_size // layout.accumulation_steps
        samples = [self.make_sample(sample_id, epoch, step) for sample_id in sample_ids]
        return _collate_samples(samples)

    def describe_epoch(self, epoch: int = 1) -> Iterator[str]:
        """``--debug_dataset``: one line per batch and per sample of ``epoch``, in training order
        (one process, no accumulation), as kohya's debug_dataset prints them."""
        self.set_epoch(epoch)
        yield f"epoch {epoch}: {len(self)} batches"
        for batch_index in range(len(self)):
            batch = self[batch_index]
            shape = tuple((batch["latents"] if "latents" in batch else batch["images"]).shape)
            yield f"batch {batch_index + 1}/{len(self)}: {shape[0]} x {shape[2]}x{shape[3]} (height x width)"
            for row, sample_id in enumerate(batch["sample_indices"].tolist()):
                yield (f"  {self.image_of(sample_id).path}, loss weight: {float(batch['loss_weights'][row])}, "
                       f"caption: \"{batch['captions'][row]}\", original size: "
                       f"{tuple(batch['original_sizes_hw'][row].tolist())}, crop top left: "
                       f"{tuple(batch['crop_top_lefts'][row].tolist())}, target size: "
                       f"{tuple(batch['target_sizes_hw'][row].tolist())}, flipped: {bool(batch['flipped'][row])}")

    def image_of(self, sample_id: int) -> PlannedImage:
        return self.plan.images[self.plan.sample_images[sample_id]]

    def make_sample(self, sample_id: int, epoch: int, step: int = 0) -> dict[str, Any]:
        """One sample of ``epoch`` trained after ``step`` optimizer steps: pixels (or cached
        latents), conditioning sizes, caption, weight."""
        image = self.image_of(sample_id)
        subset = image.subset
        image_rng = np.random.default_rng([_seed64(self.seed), epoch, sample_id, _STREAM_IMAGE])
        caption_rng = np.random.default_rng([_seed64(self.seed), epoch, sample_id, _STREAM_CAPTION])
        flipped = bool(subset.flip_aug and image_rng.random() < 0.5)
        sample: dict[str, Any] = {"sample_id": sample_id, "flipped": flipped}
        if self.latent_store is not None:
            crop = center_crop_top_left(image.resized_wh, image.bucket_wh)
            sample["latents"], sample["latents_std"], sample["alpha_mask"] = self.latent_store.get(image.index, flipped)
        else:
            if subset.random_crop:
                crop = random_crop_top_left(image.resized_wh, image.bucket_wh, image_rng)
            else:
                crop = center_crop_top_left(image.resized_wh, image.bucket_wh)
            decoded = load_image(image.path, keep_alpha=subset.alpha_mask)
            ensure_size(image.path, decoded, image.size_wh)
            array = resize_crop_flip(decoded, image.resized_wh, image.bucket_wh, crop, flipped,
                                     subset.resize_interpolation)
            rgb = np.ascontiguousarray(array[:, :, :3])
            if subset.color_aug:
                rgb = color_augment(rgb, image_rng)
            sample["image"] = torch.from_numpy(np.ascontiguousarray(rgb)).permute(2, 0, 1).float().div(127.5).sub(1.0)
            sample["alpha_mask"] = (
                torch.from_numpy(array[:, :, 3].astype(np.float32) / 255.0) if subset.alpha_mask else None
            )
        if self.poisoned:
            self._poison(sample, image.path)
        sample["original_size_hw"] = (image.size_wh[1], image.size_wh[0])
        sample["crop_top_left"] = sdxl_crop_top_left(crop, image.resized_wh, image.bucket_wh, flipped)
        sample["target_size_hw"] = (image.bucket_wh[1], image.bucket_wh[0])
        if self.text_store is not None:
            sample["text_encoder_outputs"] = self.text_store.get(image.index)
            sample["caption"] = self.text_store.caption_of[image.index]
        else:
            sample["caption"] = process_caption(subset.captions, image.caption, epoch, caption_rng, step,
                                                self.step_layout.max_train_steps)
        spec = self.plan.datasets[image.dataset_index].spec
        sample["loss_weight"] = spec.prior_loss_weight if image.is_reg else 1.0
        sample["uses_alpha_mask"] = subset.alpha_mask
        return sample


    def _poison(self, sample: dict[str, Any], path: str) -> None:
        """``--debug_inject_sample``: a corrupt image, as a bad cached latent or an fp16 VAE NaN gives one."""
        name = os.path.basename(path)
        value = self.poisoned.get(name, self.poisoned.get(os.path.splitext(name)[0]))
        if value is not None:
            key = "latents" if "latents" in sample else "image"
            sample[key] = torch.full_like(sample[key], value)


def select_samples(batch: dict[str, Any], keep: list[bool]) -> dict[str, Any]:
    """``batch`` with only the samples where ``keep`` is True (every per-sample field)."""
    rows = torch.tensor([index for index, kept in enumerate(keep) if kept], dtype=torch.long)
    selected: dict[str, Any] = {}
    for key, value in batch.items():
        if key == "captions":
            selected[key] = [value[index] for index in rows.tolist()]
        elif key == "text_encoder_outputs":
            selected[key] = tuple(part[rows.to(part.device)] for part in value)
        elif torch.is_tensor(value):
            selected[key] = value[rows.to(value.device)]
        else:
            selected[key] = value
    return selected


def _collate_samples(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack one bucket's samples into the batch dict described in the module docstring."""
    batch: dict[str, Any] = {
        "captions": [sample["caption"] for sample in samples],
        "original_sizes_hw": torch.tensor([sample["original_size_hw"] for sample in samples], dtype=torch.long),
        "crop_top_lefts": torch.tensor([sample["crop_top_left"] for sample in samples], dtype=torch.long),
        "target_sizes_hw": torch.tensor([sample["target_size_hw"] for sample in samples], dtype=torch.long),
        "sample_indices": torch.tensor([sample["sample_id"] for sample in samples], dtype=torch.long),
        "loss_weights": torch.tensor([sample["loss_weight"] for sample in samples], dtype=torch.float32),
        "flipped": torch.tensor([sample["flipped"] for sample in samples], dtype=torch.bool),
    }
    if "latents" in samples[0]:
        batch["latents"] = torch.stack([sample["latents"] for sample in samples])
        batch["latents_std"] = torch.stack([sample["latents_std"] for sample in samples])
    else:
        batch["images"] = torch.stack([sample["image"] for sample in samples])
    if any(sample["uses_alpha_mask"] for sample in samples):
        height, width = samples[0]["target_size_hw"]
        batch["alpha_masks"] = torch.stack([
            sample["alpha_mask"] if sample["alpha_mask"] is not None else torch.ones(height, width)
            for sample in samples
        ])
    if "text_encoder_outputs" in samples[0]:
        batch["text_encoder_outputs"] = (
            torch.stack([sample["text_encoder_outputs"][0] for sample in samples]),
            torch.stack([sample["text_encoder_outputs"][1] for sample in samples]),
        )
    return batch


def dataset_specs(args: argparse.Namespace) -> list[dataset_config.DatasetSpec]:
    """The dataset specs of the run: from --dataset_config, --in_json or DreamBooth folders."""
    if args.dataset_config:
        ignored = [flag for flag in ("train_data_dir", "reg_data_dir", "in_json") if getattr(args, flag, None)]
        if ignored:
            print(f"--dataset_config is given: ignoring {', '.join('--' + flag for flag in ignored)}")
        user_config = dataset_config.load_user_config(args.dataset_config)
        user_config = dataset_config.validate_user_config(user_config, args.dataset_config)
        source = f"--dataset_config {args.dataset_config}"
    elif args.in_json:
        user_config = {"datasets": [{"subsets": [{"image_dir": args.train_data_dir, "metadata_file": args.in_json}]}]}
        source = f"--in_json {args.in_json}"
    else:
        if not args.train_data_dir:
            raise UserError("no dataset: pass --train_data_dir (a folder of <repeats>_<class tokens> subfolders) "
                            "or --dataset_config FILE.toml")
        subsets = dreambooth_subsets_from_folders(args.train_data_dir, args.reg_data_dir)
        user_config = {"datasets": [{"subsets": subsets}]}
        source = f"--train_data_dir {args.train_data_dir}"
    return dataset_config.build_specs(user_config, args, source)


def validate_latent_cache(args: argparse.Namespace, specs: list[dataset_config.DatasetSpec]) -> None:
    """kohya's rule: cached latents cannot change per step, so color_aug and random_crop are refused."""
    if args.cache_latents_to_disk:
        args.cache_latents = True
    if not args.cache_latents:
        return
    for spec in specs:
        for subset in spec.subsets:
            for option in ("color_aug", "random_crop"):
                if getattr(subset, option):
                    raise UserError(f"--cache_latents cannot be used with {option} ({subset.where}): cached "
                                    f"latents would not change between steps; turn one of them off")


def build_dataset(args: argparse.Namespace, min_bucket_steps: int = 64) -> TrainDataset:
    """The dataset of the run, checked before any model is loaded.

    ``min_bucket_steps`` is what bucket_reso_steps must be a multiple of (kohya: 64 for
    SD1/2, 32 for SDXL). Raises UserError for any dataset mistake, naming its source.
    """
    if args.vae_batch_size < 1:
        raise UserError(f"--vae_batch_size {args.vae_batch_size} must be at least 1")
    specs = dataset_specs(args)
    validate_latent_cache(args, specs)
    text_cache.validate(args, [subset for spec in specs for subset in spec.subsets])
    plan = plan_datasets(specs, args.skip_bad_images, min_bucket_steps)
    if getattr(args, "weighted_captions", False):  # a bad weight is reported now, not at its first batch
        for image in plan.images:
            options = image.subset.captions
            text_encoding.parse_weighted_caption(
                " ".join(filter(None, [options.caption_prefix, image.caption, options.caption_suffix])))
    seed = args.seed if args.seed is not None else 0
    return TrainDataset(plan, seed)


def build_validation_dataset(args: argparse.Namespace, train: TrainDataset,
                             min_bucket_steps: int = 64) -> Optional[TrainDataset]:
    """The images ``validation_split`` holds out of ``train``'s datasets, planned with the same
    subset options (resolution, buckets, captions), or None when no dataset has a split.

    Its draws (batch order, flips, captions) are keyed by ``--validation_seed`` (default
    ``--seed``). Raises UserError when the split holds out no image at all.
    """
    specs = [planned.spec for planned in train.plan.datasets]
    if not any(spec.validation_split for spec in specs):
        return None
    plan = plan_datasets(specs, args.skip_bad_images, min_bucket_steps, validation=True)
    if not plan.sample_images:
        splits = sorted({spec.validation_split for spec in specs if spec.validation_split})
        raise UserError(f"validation_split {', '.join(map(str, splits))} holds out no image: a subset of n images "
                        f"keeps ceil(n * (1 - validation_split)) for training; raise it or add images")
    return TrainDataset(plan, args.validation_seed if args.validation_seed is not None else train.seed)


def collate_single_batch(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The DataLoader runs with batch_size=1 over batches: unwrap the one item."""
    return items[0]
