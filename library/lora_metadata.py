"""Metadata written into LoRA files: kohya's ``ss_*`` keys, ``modelspec.*`` and addnet hashes.

A1111, ComfyUI and LoRA browsers read these keys; their names and string formats
follow kohya-ss sd-scripts.
"""
from __future__ import annotations

import argparse
import base64
import datetime
import hashlib
import io
import json
import mimetypes
import os
import time
from typing import TYPE_CHECKING, Any, Mapping

import torch
from safetensors.torch import save

from library.checkpoint_files import file_sha256
from library.errors import UserError
from library.datasets.plan import DatasetPlan, base_name

if TYPE_CHECKING:
    from library.datasets.dataset import TrainDataset

ARCHITECTURES = {"sd1": "stable-diffusion-v1", "sd2": "stable-diffusion-v2-512", "sdxl": "stable-diffusion-xl-v1-base"}
BASE_MODEL_VERSIONS = {"sd1": "sd_v1", "sd2": "sd_2.0", "sdxl": "sdxl_base_v1-0"}
IMPLEMENTATION = "https://github.com/Stability-AI/generative-models"


def training_metadata(args: argparse.Namespace, model_kind: str, facts: Mapping[str, Any]) -> dict[str, str]:
    """kohya's ``ss_*`` metadata of a run; ``facts`` holds what the trainer computed
    (image counts, batches per epoch, epochs, optimizer string, session id, start time).
    The dataset's own keys come from ``dataset_metadata``."""
    metadata: dict[str, Any] = {
        "ss_session_id": facts["session_id"],
        "ss_training_started_at": facts["training_started_at"],
        "ss_output_name": args.output_name,
        "ss_learning_rate": args.learning_rate,
        "ss_text_encoder_lr": args.text_encoder_lr[0] if args.text_encoder_lr and len(args.text_encoder_lr) == 1 else args.text_encoder_lr,
        "ss_unet_lr": args.unet_lr,
        "ss_num_train_images": facts["num_train_images"],
        "ss_num_reg_images": facts["num_reg_images"],
        # kohya's validation keys: the held-out images with repeats, and the flags as given
        "ss_num_validation_images": facts.get("num_validation_images", 0),
        "ss_validation_seed": args.validation_seed,
        "ss_validation_split": args.validation_split,
        "ss_max_validation_steps": args.max_validation_steps,
        "ss_validate_every_n_epochs": args.validate_every_n_epochs,
        "ss_validate_every_n_steps": args.validate_every_n_steps,
        "ss_num_batches_per_epoch": facts["num_batches_per_epoch"],
        "ss_num_epochs": facts["num_epochs"],
        "ss_gradient_checkpointing": args.gradient_checkpointing,
        "ss_gradient_accumulation_steps": args.gradient_accumulation_steps,
        "ss_max_train_steps": args.max_train_steps,
        "ss_lr_warmup_steps": args.lr_warmup_steps,
        "ss_lr_scheduler": args.lr_scheduler,
        "ss_network_module": args.network_module,
        "ss_network_dim": args.network_dim,
        "ss_network_alpha": args.network_alpha,
        "ss_network_dropout": args.network_dropout,
        "ss_mixed_precision": args.mixed_precision,
        "ss_full_fp16": bool(args.full_fp16),
        "ss_v2": bool(args.v2),
        "ss_base_model_version": BASE_MODEL_VERSIONS[model_kind],
        "ss_clip_skip": args.clip_skip,
        "ss_max_token_length": args.max_token_length,
        "ss_cache_latents": bool(args.cache_latents),
        "ss_lowram": bool(args.lowram),
        "ss_seed": args.seed,
        "ss_noise_offset": args.noise_offset,
        "ss_noise_offset_random_strength": bool(args.noise_offset_random_strength),
        "ss_ip_noise_gamma_random_strength": bool(args.ip_noise_gamma_random_strength),
        "ss_caption_dropout_rate": args.caption_dropout_rate,
        "ss_caption_dropout_every_n_epochs": args.caption_dropout_every_n_epochs,
        "ss_caption_tag_dropout_rate": args.caption_tag_dropout_rate,
        "ss_face_crop_aug_range": args.face_crop_aug_range,
        "ss_scale_weight_norms": args.scale_weight_norms,
        "ss_fp8_base": bool(args.fp8_base),
        "ss_fp8_base_unet": bool(args.fp8_base_unet),
        "ss_resize_interpolation": args.resize_interpolation,
        "ss_training_comment": args.training_comment,
        "ss_optimizer": facts["optimizer"],
        "ss_max_grad_norm": args.max_grad_norm,
        "ss_prior_loss_weight": args.prior_loss_weight,
        "ss_loss_type": args.loss_type,
        "ss_huber_schedule": args.huber_schedule,
        "ss_huber_c": args.huber_c,
        "ss_huber_scale": args.huber_scale,
        "ss_min_snr_gamma": args.min_snr_gamma,
        "ss_debiased_estimation": bool(args.debiased_estimation_loss),
        "ss_zero_terminal_snr": bool(args.zero_terminal_snr),
        "ss_ip_noise_gamma": args.ip_noise_gamma,
        "ss_multires_noise_iterations": args.multires_noise_iterations,
        "ss_multires_noise_discount": args.multires_noise_discount,
        "ss_adaptive_noise_scale": args.adaptive_noise_scale,
        "ss_min_timestep": args.min_timestep,
        "ss_max_timestep": args.max_timestep,
        "ss_network_args": json.dumps(facts.get("network_args", {})),
    }
    return {key: str(value) for key, value in metadata.items()}


def dataset_metadata(args: argparse.Namespace, dataset: TrainDataset, total_batch_size: int) -> dict[str, str]:
    """kohya's dataset ``ss_*`` keys, in its two shapes.

    With ``--dataset_config``: ``ss_datasets`` (every dataset with its subsets),
    ``ss_tag_frequency`` and ``ss_dataset_dirs``. Otherwise (DreamBooth folders or
    ``--in_json``) the run's dataset flags, ``ss_dataset_dirs``, ``ss_reg_dataset_dirs``,
    ``ss_tag_frequency`` and ``ss_bucket_info``. Nested values are JSON as kohya writes them.
    """
    if args.dataset_config:
        return _config_metadata(dataset)
    planned = dataset.plan.datasets[0]  # folder runs have one dataset
    spec = planned.spec
    metadata = {
        "ss_batch_size_per_device": args.train_batch_size,
        "ss_total_batch_size": total_batch_size,
        "ss_resolution": tuple(spec.resolution_wh),  # kohya's parsed --resolution: "(1024, 1024)"
        "ss_color_aug": bool(args.color_aug),
        "ss_flip_aug": bool(args.flip_aug),
        "ss_random_crop": bool(args.random_crop),
        "ss_shuffle_caption": bool(args.shuffle_caption),
        "ss_enable_bucket": bool(spec.enable_bucket),
        "ss_bucket_no_upscale": bool(spec.enable_bucket and spec.bucket_no_upscale),
        "ss_min_bucket_reso": planned.min_bucket_reso,
        "ss_max_bucket_reso": planned.max_bucket_reso,
        "ss_skip_image_resolution": spec.skip_image_resolution,  # kohya's parsed value: "(768, 768)" or "None"
        "ss_keep_tokens": args.keep_tokens,
        "ss_dataset_dirs": json.dumps(dataset.dataset_dirs()),
        "ss_reg_dataset_dirs": json.dumps(dataset.dataset_dirs(reg=True)),
        "ss_tag_frequency": json.dumps(dataset.tag_frequency()),
        "ss_bucket_info": json.dumps(planned.bucket_info()),
    }
    return {key: str(value) for key, value in metadata.items()}


def _config_metadata(dataset: TrainDataset) -> dict[str, str]:
    """The ``--dataset_config`` shape: reg subsets appear in ``ss_datasets`` only, and a
    folder name met again in ``ss_dataset_dirs`` gets " (2)", " (3)"... as in kohya."""
    datasets = [_dataset_entry(planned) for planned in dataset.plan.datasets]
    dirs: dict[str, dict[str, int]] = {}
    for planned in dataset.plan.datasets:
        for subset in planned.subsets:
            if subset.spec.is_reg:
                continue
            name, number = base_name(subset.spec.name), 2
            key = name
            while key in dirs:
                key, number = f"{name} ({number})", number + 1
            dirs[key] = {"n_repeats": subset.spec.num_repeats, "img_count": subset.img_count}
    return {
        "ss_datasets": json.dumps(datasets),
        "ss_tag_frequency": json.dumps(dataset.tag_frequency()),
        "ss_dataset_dirs": json.dumps(dirs),
    }


def _dataset_entry(planned: DatasetPlan) -> dict[str, Any]:
    """One dataset of ``ss_datasets``, keys in kohya's order."""
    spec = planned.spec
    subsets = []
    for subset in planned.subsets:
        sub = subset.spec
        entry: dict[str, Any] = {
            "img_count": subset.img_count,
            "num_repeats": sub.num_repeats,
            "color_aug": bool(sub.color_aug),
            "flip_aug": bool(sub.flip_aug),
            "random_crop": bool(sub.random_crop),
            "shuffle_caption": bool(sub.captions.shuffle_caption),
            "keep_tokens": sub.captions.keep_tokens,
            "keep_tokens_separator": sub.captions.keep_tokens_separator,
            "secondary_separator": sub.captions.secondary_separator,
            "enable_wildcard": bool(sub.captions.enable_wildcard),
            "caption_prefix": sub.captions.caption_prefix,
            "caption_suffix": sub.captions.caption_suffix,
            "resize_interpolation": sub.resize_interpolation,
        }
        if sub.image_dir:
            entry["image_dir"] = base_name(sub.image_dir)
        if spec.is_finetuning:
            entry["metadata_file"] = base_name(sub.metadata_file)
        else:
            entry["class_tokens"] = sub.class_tokens
            entry["is_reg"] = sub.is_reg
        subsets.append(entry)
    return {
        "is_dreambooth": not spec.is_finetuning,
        "batch_size_per_device": spec.batch_size,
        "num_train_images": planned.num_train_images,
        "num_reg_images": planned.num_reg_images,
        "resolution": tuple(spec.resolution_wh),
        "enable_bucket": bool(spec.enable_bucket),
        "min_bucket_reso": planned.min_bucket_reso,
        "max_bucket_reso": planned.max_bucket_reso,
        "skip_image_resolution": spec.skip_image_resolution,
        "tag_frequency": planned.tag_frequency,
        "bucket_info": planned.bucket_info(),
        "resize_interpolation": spec.resize_interpolation,
        "subsets": subsets,
    }


def wall_clock() -> float:
    """Seconds since the epoch, or ``SOURCE_DATE_EPOCH`` when set (reproducible files: two runs
    of the same settings then write byte-identical LoRA files)."""
    fixed = os.environ.get("SOURCE_DATE_EPOCH")
    return float(fixed) if fixed else time.time()


# kohya's --metadata_* options -> the model spec keys they fill (when given).
MODELSPEC_OPTIONS = ("title", "author", "description", "license", "tags", "usage_hint", "thumbnail", "merged_from",
                     "trigger_phrase", "preprocessor", "is_negative_embedding")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """kohya's ``--metadata_*`` options (model spec fields of the saved LoRA files)."""
    for name in MODELSPEC_OPTIONS:
        default = " (default --output_name)" if name == "title" else ""
        extra = "; a file path is stored as a data URL" if name == "thumbnail" else ""
        parser.add_argument(f"--metadata_{name}", type=str, default=None,
                            help=f"modelspec.{name} of the saved LoRA files{default}{extra}")


def validate_arguments(args: argparse.Namespace) -> None:
    """Refuse an unreadable ``--metadata_thumbnail`` before anything loads."""
    thumbnail = args.metadata_thumbnail
    if thumbnail and not thumbnail.startswith("data:") and not os.path.isfile(thumbnail):
        raise UserError(f"--metadata_thumbnail {thumbnail}: no such file (give an image file or a data: URL)")


def _data_url(path: str) -> str:
    if path.startswith("data:"):
        return path
    mime = mimetypes.guess_type(path)[0] or "application/octet-stream"
    try:
        with open(path, "rb") as file:
            return f"data:{mime};base64,{base64.b64encode(file.read()).decode('ascii')}"
    except OSError as error:
        raise UserError(f"--metadata_thumbnail {path}: cannot read it ({error.strerror})") from None


def modelspec_metadata(
    args: argparse.Namespace, model_kind: str, resolution_hw: tuple[int, int], timestamp: float,
    adapter: str | None = "lora",
) -> dict[str, str]:
    """Stability AI's model spec keys for a LoRA of ``model_kind`` (``adapter=None``: for a whole
    checkpoint, as kohya's fine-tuning scripts write them: the architecture without ``/lora``)."""
    architecture = ARCHITECTURES[model_kind]
    if model_kind == "sd2" and args.v_parameterization:
        architecture = "stable-diffusion-v2-768-v"
    metadata = {
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": f"{architecture}/{adapter}" if adapter else architecture,
        "modelspec.implementation": IMPLEMENTATION,
        # kohya's title without --output_name: "LoRA@<timestamp>" / "Checkpoint@<timestamp>"
        "modelspec.title": args.output_name or f"{'LoRA' if adapter else 'Checkpoint'}@{timestamp}",
        "modelspec.resolution": f"{resolution_hw[1]}x{resolution_hw[0]}",
        "modelspec.date": datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).isoformat(timespec="seconds"),
        "modelspec.prediction_type": "v" if args.v_parameterization else "epsilon",
    }
    for name in MODELSPEC_OPTIONS:
        value = getattr(args, f"metadata_{name}", None)
        if value:
            metadata[f"modelspec.{name}"] = _data_url(value) if name == "thumbnail" else value
    return metadata


def addnet_hashes(state: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> dict[str, str]:
    """``sshs_model_hash`` and ``sshs_legacy_hash`` as the additional-networks extension computes them.

    Only the immutable ``ss_*`` training metadata takes part, so editing a title later
    does not change the hash.
    """
    training_only = {key: value for key, value in metadata.items() if key.startswith("ss_")}
    data = save(dict(state), training_only)
    header_length = int.from_bytes(data[:8], "little")
    model_hash = hashlib.sha256(data[8 + header_length :]).hexdigest()
    return {"sshs_model_hash": model_hash, "sshs_legacy_hash": legacy_hash(io.BytesIO(data))}


def legacy_hash(file: io.BufferedIOBase) -> str:
    """A1111's old short hash: SHA-256 of the 64 KiB at offset 1 MiB, first 8 hex digits."""
    file.seek(0x100000)
    return hashlib.sha256(file.read(0x10000)).hexdigest()[:8]


def base_model_metadata(args: argparse.Namespace) -> dict[str, str]:
    """kohya's keys naming the base model and ``--vae``: ``ss_sd_model_name`` / ``ss_vae_name``
    (file or folder name) and, for single files, the legacy hash (``ss_sd_model_hash``) and the
    SHA-256 (``ss_new_sd_model_hash``) by which sites such as civitai recognise the base model."""
    metadata = {}
    for part, path in (("sd_model", args.pretrained_model_name_or_path), ("vae", args.vae)):
        if not path:
            continue
        if os.path.isfile(path):
            with open(path, "rb") as file:
                metadata[f"ss_{part}_hash"] = legacy_hash(file)
            metadata[f"ss_new_{part}_hash"] = file_sha256(path)
        metadata[f"ss_{part}_name"] = os.path.basename(path.rstrip("/\\")) if os.path.exists(path) else path
    return metadata


def run_metadata(args: argparse.Namespace, model_kind: str, dataset: TrainDataset,
                 facts: Mapping[str, Any]) -> dict[str, str]:
    """All metadata a LoRA file of this run carries: kohya's ``ss_*`` keys (training, dataset,
    base model) and the model spec. ``facts``: what ``training_metadata`` needs, plus
    ``total_batch_size``."""
    metadata = training_metadata(args, model_kind, facts)
    metadata.update(dataset_metadata(args, dataset, facts["total_batch_size"]))
    metadata.update(base_model_metadata(args))
    metadata.update(modelspec_metadata(args, model_kind, dataset.resolution_hw, facts["training_started_at"]))
    return metadata
