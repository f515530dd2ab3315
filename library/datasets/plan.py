"""From dataset specs to a plan: every image with its size and bucket, every sample with a stable id.

A *sample* is one (image, repeat) pair. Sample ids are assigned once, in a fixed
order (datasets, then subsets, images sorted by path, then repeats), so a sample keeps
its id whatever the batch size, epoch or worker count: the trainer keys noise by it.
Image sizes come from file headers (no decode); unreadable images are refused before
training, or skipped with a warning under ``--skip_bad_images``.
"""
from __future__ import annotations

import math
import os
import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional, TypeVar

import numpy as np

from library.datasets import buckets as bucket_rules
from library.datasets.captions import count_tags
from library.datasets.config import DatasetSpec, SubsetSpec
from library.datasets.images import BadImageError, probe_image
from library.datasets.sources import ImageRecord, balance_regularization, list_subset_images, write_info_cache
from library.errors import UserError


@dataclass
class PlannedImage:
    """One image of one subset, placed in a bucket."""

    index: int
    path: str
    caption: str
    size_wh: tuple[int, int]
    bucket_wh: tuple[int, int]
    resized_wh: tuple[int, int]
    aspect_error: float
    num_repeats: int
    subset: SubsetSpec
    dataset_index: int

    @property
    def is_reg(self) -> bool:
        return self.subset.is_reg


@dataclass
class PlannedSubset:
    """A subset that takes part (repeats >= 1, some usable image): kohya's ``dataset.subsets``."""

    spec: SubsetSpec
    img_count: int  # its usable images; for reg subsets also those balancing leaves unused (kohya)


@dataclass
class DatasetPlan:
    """One dataset's images and its samples grouped by bucket (each list of sample ids is sorted)."""

    spec: DatasetSpec
    images: list[PlannedImage] = field(default_factory=list)
    bucket_samples: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    num_train_images: int = 0  # with repeats, as kohya counts them
    num_reg_images: int = 0
    subsets: list[PlannedSubset] = field(default_factory=list)
    # kohya's ``tag_frequency``: folder (or metadata file) name -> tag -> count, reg folders included.
    tag_frequency: dict[str, dict[str, int]] = field(default_factory=dict)
    min_bucket_reso: Optional[int] = None  # on the step grid; None without enable_bucket (kohya)
    max_bucket_reso: Optional[int] = None

    def bucket_info(self) -> Optional[dict[str, Any]]:
        """kohya's ``bucket_info``, None without enable_bucket.

        ``{"buckets": {i: {"resolution": (w, h), "count": samples}}, "mean_img_ar_error": e}``:
        i numbers the used buckets in sorted order, counts include repeats (reg images with
        their balanced repeats), e is the mean |bucket aspect - image aspect| over images
        without repeats (0 when there are none).
        """
        if not self.spec.enable_bucket:
            return None
        buckets = {
            index: {"resolution": bucket, "count": len(self.bucket_samples[bucket])}
            for index, bucket in enumerate(sorted(self.bucket_samples))
        }
        errors = [image.aspect_error for image in self.images]
        mean_error = float(np.mean(np.abs(np.array(errors)))) if errors else 0
        return {"buckets": buckets, "mean_img_ar_error": mean_error}


@dataclass
class Plan:
    datasets: list[DatasetPlan]
    images: list[PlannedImage]
    sample_images: list[int]  # sample id -> image index

    @property
    def subsets(self) -> list[SubsetSpec]:
        return [subset for dataset in self.datasets for subset in dataset.spec.subsets]


T = TypeVar("T")


def split_train_validation(items: list[T], validation_split: float, seed: int) -> tuple[list[T], list[T]]:
    """kohya's per-subset split: ``items`` shuffled with ``random.Random(seed)``, the first
    ``ceil(n * (1 - validation_split))`` (kohya's float formula) train, the rest validate.

    The two parts are disjoint and together are ``items`` (kohya's validation part is cut with
    another formula and can overlap the training part). Each part keeps the order of ``items``,
    so the training part plans exactly like a folder holding only those images. With
    ``0 <= validation_split < 1`` the training part is never empty when ``items`` is not.
    """
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    cut = math.ceil(len(items) * (1 - validation_split))
    return [items[i] for i in sorted(order[:cut])], [items[i] for i in sorted(order[cut:])]


def plan_datasets(specs: list[DatasetSpec], skip_bad_images: bool, min_bucket_steps: int,
                  validation: bool = False) -> Plan:
    """Scan, probe, balance and bucket every dataset; raises UserError when nothing can be trained.

    A dataset with ``validation_split`` keeps only the training part of each non-reg subset
    (:func:`split_train_validation` of its usable images). ``validation=True`` plans the held-out
    parts instead, without reg subsets and without the emptiness checks (the result may be empty).
    """
    plans: list[DatasetPlan] = []
    images: list[PlannedImage] = []
    sample_images: list[int] = []
    no_repeats: list[SubsetSpec] = []  # ignored for num_repeats < 1, like kohya
    for dataset_index, spec in enumerate(specs):
        rule = _bucket_rule(spec, min_bucket_steps)
        plan = DatasetPlan(spec, min_bucket_reso=rule.min_reso, max_bucket_reso=rule.max_reso)
        train_records, reg_records = [], []
        for subset_index, subset in enumerate(spec.subsets):
            splits = spec.validation_split > 0 and not subset.is_reg
            if validation and not splits:
                continue
            if subset.num_repeats < 1:
                if not validation:
                    print(f"{subset.where}: ignoring the subset, num_repeats {subset.num_repeats} is less than 1")
                    no_repeats.append(subset)
                continue
            # Probed before the split, so the split is over usable images whatever --skip_bad_images drops.
            records = _probe_sizes(list_subset_images(subset, subset_index), subset, skip_bad_images)
            records = skip_small_images(records, spec.skip_image_resolution, subset, report=not validation)
            if splits:
                training_part, validation_part = split_train_validation(
                    records, spec.validation_split, spec.validation_seed)
                records = validation_part if validation else training_part
            # Before the emptiness check: kohya records an empty folder as {} too.
            count_tags(plan.tag_frequency.setdefault(base_name(subset.name), {}), _tag_texts(subset, records))
            if not records:
                if not validation:
                    print(f"{subset.where}: ignoring the subset, {subset.name} has no usable images")
                continue
            plan.subsets.append(PlannedSubset(subset, len(records)))
            count = len(records) * subset.num_repeats
            if subset.is_reg:
                plan.num_reg_images += count
                reg_records += records
            else:
                plan.num_train_images += count
                train_records += records
        if reg_records:
            if plan.num_train_images < plan.num_reg_images:
                print(f"{spec.where}: more regularisation than training samples; some reg images are not used")
            reg_records = balance_regularization(plan.num_train_images, reg_records)
        aspect_errors = []
        for record in train_records + reg_records:
            subset = spec.subsets[record.subset_index]
            try:
                choice = rule.select(*record.size_wh)
            except UserError as error:
                raise UserError(f"image {record.path}: {error}") from None
            image = PlannedImage(len(images), record.path, record.caption, record.size_wh, choice.bucket_wh,
                                 choice.resized_wh, choice.aspect_error, record.num_repeats, subset, dataset_index)
            images.append(image)
            plan.images.append(image)
            aspect_errors.append(choice.aspect_error)
            ids = plan.bucket_samples.setdefault(image.bucket_wh, [])
            for _ in range(image.num_repeats):
                ids.append(len(sample_images))
                sample_images.append(image.index)
        plans.append(plan)
        if spec.enable_bucket and not (validation and not plan.bucket_samples):
            counts = {bucket: len(ids) for bucket, ids in plan.bucket_samples.items()}
            print(bucket_rules.summarize(counts, aspect_errors, spec.where + (" (validation)" if validation else "")))
    if validation:
        return Plan(plans, images, sample_images)
    if not sample_images and no_repeats:
        raise UserError(
            f"no images to train on: {no_repeats[0].where} has num_repeats {no_repeats[0].num_repeats}, which "
            f"ignores the subset (as in kohya)"
            + (f", like {len(no_repeats) - 1} other subset(s)" if len(no_repeats) > 1 else "")
            + "; num_repeats must be 1 or more"
        )
    if not sample_images:
        raise UserError(
            "no images to train on: check --train_data_dir (the parent of folders like 10_sks dog) "
            "or the image_dir / metadata_file entries of --dataset_config"
        )
    if not any(plan.num_train_images for plan in plans):
        raise UserError("only regularisation images found: add training images (is_reg = false)")
    return Plan(plans, images, sample_images)


def base_name(path: str) -> str:
    """A folder's or file's own name, as kohya's metadata keys it (a trailing slash is ignored)."""
    return os.path.basename(os.path.normpath(path))


def _tag_texts(subset: SubsetSpec, records: list[ImageRecord]) -> list[str]:
    """What kohya counts tags in: a DreamBooth image's raw caption (class tokens when it has no
    caption file); a fine-tuning entry's "tags" only, longest image key first."""
    if subset.metadata_file is None:
        return [record.caption for record in records]
    return [record.tags for record in sorted(records, key=lambda record: record.tags_order) if record.tags]


def _bucket_rule(spec: DatasetSpec, min_bucket_steps: int) -> bucket_rules.BucketRule:
    if not spec.enable_bucket:
        return bucket_rules.BucketRule(spec.resolution_wh, enable_bucket=False)
    if spec.bucket_reso_steps % min_bucket_steps:
        raise UserError(
            f"{spec.where}: bucket_reso_steps {spec.bucket_reso_steps} must be a multiple of {min_bucket_steps} "
            f"for this model (kohya's rule)"
        )
    min_reso, max_reso = bucket_rules.adjust_bucket_limits(
        spec.resolution_wh, spec.min_bucket_reso, spec.max_bucket_reso, spec.bucket_reso_steps, spec.where
    )
    if spec.bucket_no_upscale:
        print(f"{spec.where}: min_bucket_reso and max_bucket_reso are ignored with bucket_no_upscale")
    return bucket_rules.BucketRule(spec.resolution_wh, True, min_reso, max_reso, spec.bucket_reso_steps,
                                   spec.bucket_no_upscale)


def skip_small_images(records: list[ImageRecord], skip_image_resolution: Optional[tuple[int, int]],
                      subset: SubsetSpec, report: bool = True) -> list[ImageRecord]:
    """kohya's ``skip_image_resolution``: drop images whose original ``width * height`` is at most
    the threshold's area (so 768 also drops 1024x576 but keeps 800x768), before the validation
    split, regularisation balancing and bucketing, as kohya's DreamBooth and fine-tuning datasets do."""
    if skip_image_resolution is None:
        return records
    limit = skip_image_resolution[0] * skip_image_resolution[1]
    kept = [record for record in records if record.size_wh[0] * record.size_wh[1] > limit]
    if report and len(kept) < len(records):
        print(f"filtered {len(records) - len(kept)} images by original resolution from {subset.name}")
    return kept


def _probe_sizes(records: list[ImageRecord], subset: SubsetSpec, skip_bad_images: bool) -> list[ImageRecord]:
    """Fill in sizes from file headers; refuse (or skip, with a warning) files that cannot be read."""
    usable = []
    probed_any = False
    for record in records:
        if record.size_wh is not None and os.path.isfile(record.path):
            usable.append(record)
            continue
        try:
            record.size_wh = probe_image(record.path)
            probed_any = True
        except (BadImageError, FileNotFoundError) as error:
            if not skip_bad_images:
                raise BadImageError(str(error)) from None
            print(f"warning: skipping {record.path}: {error}")
            continue
        usable.append(record)
    if subset.cache_info and subset.metadata_file is None and probed_any and usable:
        write_info_cache(subset, usable)
    return usable


def variants_by_path(images: list[PlannedImage], key) -> dict[str, set]:
    """For each file path, the distinct ``key(image)`` values it is used with."""
    variants: dict[str, set] = defaultdict(set)
    for image in images:
        variants[image.path].add(key(image))
    return variants
