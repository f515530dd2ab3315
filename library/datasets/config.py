"""``--dataset_config`` files in kohya-ss sd-scripts' schema, and the command-line equivalent.

A file has ``[general]``, ``[[datasets]]`` and ``[[datasets.subsets]]`` tables (TOML,
or the same structure in JSON). Every value is looked up like kohya does: subset,
then its dataset, then ``[general]``, then the command-line flag of the same name,
then kohya's default. Validation uses voluptuous; an unknown key, a wrong type or a
bad value is one UserError naming the file, the table and the key.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import toml
from voluptuous import Invalid, MultipleInvalid, Required, Schema

from library.datasets.captions import CaptionOptions
from library.datasets.images import INTERPOLATIONS
from library.errors import UserError


# The largest image side a run trains or samples. The VAE's full-resolution layers hold 128 channels
# x H x W per activation: 17 GB in fp16 at 8192 x 8192, 69 GB at 16384 x 16384 (one layer's input
# and output would not fit in a 141 GB GPU), before the UNet and the gradients.
MAX_SIDE_PX = 8192
TOO_LARGE_FOR_ANY_GPU = "larger images do not fit in a GPU's memory; SDXL trains at 1024"


# -- value validators (each raises Invalid with the phrase that completes "must be ...") ----------
def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise Invalid("must be true or false")
    return value


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise Invalid("must be an integer")
    return value


def _float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Invalid("must be a number")
    return float(value)


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise Invalid("must be a string")
    return value


def _table(value: Any) -> dict:
    if not isinstance(value, dict):
        raise Invalid("must be a table")
    return value


def _resolution(value: Any) -> tuple[int, int]:
    """``512`` or ``[width, height]`` -> (width, height)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value, value)
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return (value[0], value[1])
    raise Invalid("must be an integer or [width, height]")


def _float_pair(value: Any) -> tuple[float, float]:
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return (_float(value[0]), _float(value[1]))
    raise Invalid("must be [min, max] numbers")


# -- kohya's schema, by where a key may appear ---------------------------------------------------
SUBSET_ASCENDABLE = {
    "color_aug": _bool, "face_crop_aug_range": _float_pair, "flip_aug": _bool, "num_repeats": _int,
    "random_crop": _bool, "shuffle_caption": _bool, "keep_tokens": _int, "keep_tokens_separator": _str,
    "secondary_separator": _str, "caption_separator": _str, "enable_wildcard": _bool, "token_warmup_min": _int,
    "token_warmup_step": _float, "caption_prefix": _str, "caption_suffix": _str, "custom_attributes": _table,
    "resize_interpolation": _str,
}
DROPOUT_ASCENDABLE = {"caption_dropout_every_n_epochs": _int, "caption_dropout_rate": _float,
                      "caption_tag_dropout_rate": _float}
DREAMBOOTH_ASCENDABLE = {"caption_extension": _str, "class_tokens": _str, "cache_info": _bool}
DREAMBOOTH_DISTINCT = {Required("image_dir"): _str, "is_reg": _bool, "alpha_mask": _bool}
FINETUNING_DISTINCT = {Required("metadata_file"): _str, "image_dir": _str, "alpha_mask": _bool}
DATASET_ASCENDABLE = {
    "batch_size": _int, "bucket_no_upscale": _bool, "bucket_reso_steps": _int, "enable_bucket": _bool,
    "max_bucket_reso": _int, "min_bucket_reso": _int, "validation_seed": _int, "validation_split": _float,
    "resolution": _resolution, "network_multiplier": _float, "resize_interpolation": _str,
    "skip_image_resolution": _resolution,  # kohya v0.10.2+: size or [width, height]
}

# Defaults (kohya's dataclasses) of every value a subset or dataset resolves.
SUBSET_DEFAULTS: dict[str, Any] = {
    "image_dir": None, "metadata_file": None, "num_repeats": 1, "is_reg": False, "class_tokens": None,
    "caption_extension": ".caption", "cache_info": False, "alpha_mask": False, "color_aug": False,
    "flip_aug": False, "random_crop": False, "face_crop_aug_range": None, "token_warmup_min": 1,
    "token_warmup_step": 0, "custom_attributes": None, "resize_interpolation": None, "shuffle_caption": False,
    "caption_separator": ",", "keep_tokens": 0, "keep_tokens_separator": "", "secondary_separator": None,
    "enable_wildcard": False, "caption_prefix": None,
    "caption_suffix": None, "caption_dropout_rate": 0.0, "caption_dropout_every_n_epochs": 0,
    "caption_tag_dropout_rate": 0.0,
}
DATASET_DEFAULTS: dict[str, Any] = {
    "resolution": None, "batch_size": 1, "enable_bucket": False, "min_bucket_reso": 256, "max_bucket_reso": 1024,
    "bucket_reso_steps": 64, "bucket_no_upscale": False, "prior_loss_weight": 1.0, "network_multiplier": 1.0,
    "validation_seed": None, "validation_split": 0.0, "resize_interpolation": None, "skip_image_resolution": None,
}
# Command-line names that differ from the config names (kohya's map).
ARGPARSE_RENAMES = {"train_batch_size": "batch_size", "dataset_repeats": "num_repeats"}
# Keys of kohya's schema this trainer does not implement: accepted only at their defaults.
UNSUPPORTED = {"face_crop_aug_range": None, "network_multiplier": 1.0}


def _merge(*schemas: dict) -> dict:
    merged: dict = {}
    for schema in schemas:
        merged.update(schema)
    return merged


_DB_SUBSET = _merge(SUBSET_ASCENDABLE, DREAMBOOTH_DISTINCT, DREAMBOOTH_ASCENDABLE, DROPOUT_ASCENDABLE)
_FT_SUBSET = _merge(SUBSET_ASCENDABLE, FINETUNING_DISTINCT, DROPOUT_ASCENDABLE)
_DB_DATASET = _merge(DATASET_ASCENDABLE, SUBSET_ASCENDABLE, DREAMBOOTH_ASCENDABLE, DROPOUT_ASCENDABLE,
                     {"subsets": [_DB_SUBSET]})
_FT_DATASET = _merge(DATASET_ASCENDABLE, SUBSET_ASCENDABLE, DROPOUT_ASCENDABLE, {"subsets": [_FT_SUBSET]})
_GENERAL = _merge(DATASET_ASCENDABLE, SUBSET_ASCENDABLE, DREAMBOOTH_ASCENDABLE, DROPOUT_ASCENDABLE)


def _dataset(value: Any) -> dict:
    """A [[datasets]] table: DreamBooth subsets (image_dir) or fine-tuning ones (metadata_file), not both."""
    value = _table(value)
    subsets = value.get("subsets", [])
    if not isinstance(subsets, list) or not all(isinstance(subset, dict) for subset in subsets):
        raise Invalid("must be a list of [[datasets.subsets]] tables", path=["subsets"])
    for index, subset in enumerate(subsets):
        if "conditioning_data_dir" in subset:
            raise Invalid("ControlNet subsets (conditioning_data_dir) are not supported by this trainer",
                          path=["subsets", index, "conditioning_data_dir"])
    finetuning = ["metadata_file" in subset for subset in subsets]
    if any(finetuning) and not all(finetuning):
        raise Invalid("mixes DreamBooth subsets (image_dir) and fine-tuning subsets (metadata_file); "
                      "put them in separate [[datasets]]")
    return Schema(_FT_DATASET if any(finetuning) else _DB_DATASET)(value)


USER_CONFIG_SCHEMA = Schema({"general": _GENERAL, "datasets": [_dataset]})


# -- resolved specifications ---------------------------------------------------------------------
@dataclass
class SubsetSpec:
    """One subset with every value resolved (kohya's names)."""

    image_dir: Optional[str]
    metadata_file: Optional[str]
    num_repeats: int
    is_reg: bool
    class_tokens: Optional[str]
    caption_extension: str
    cache_info: bool
    alpha_mask: bool
    color_aug: bool
    flip_aug: bool
    random_crop: bool
    resize_interpolation: Optional[str]
    captions: CaptionOptions
    where: str

    @property
    def name(self) -> str:
        return self.image_dir if self.metadata_file is None else self.metadata_file


@dataclass
class DatasetSpec:
    """One dataset (its own resolution, batch size and buckets) and its subsets."""

    resolution_wh: tuple[int, int]
    batch_size: int
    enable_bucket: bool
    min_bucket_reso: int
    max_bucket_reso: int
    bucket_reso_steps: int
    bucket_no_upscale: bool
    prior_loss_weight: float
    is_finetuning: bool
    where: str
    resize_interpolation: Optional[str] = None  # the dataset's own value (kohya's metadata reports it)
    # Fraction of each DreamBooth training subset's images held out for validation, and the seed of
    # that split (``validation_seed``, else the training ``--seed``); see ``plan.split_train_validation``.
    validation_split: float = 0.0
    validation_seed: int = 0
    # kohya's skip_image_resolution (v0.10.2+): images whose original width x height is at most
    # this (width, height)'s area are left out before the split and bucketing; None keeps all.
    skip_image_resolution: Optional[tuple[int, int]] = None
    subsets: list[SubsetSpec] = field(default_factory=list)


def load_user_config(path: str) -> dict:
    """Read a .toml or .json dataset config; syntax errors name the file."""
    if not os.path.isfile(path):
        raise UserError(f"--dataset_config {path}: file not found")
    try:
        with open(path, encoding="utf-8-sig") as file:  # with or without Notepad's byte-order mark
            if path.lower().endswith(".json"):
                return json.load(file)
            if path.lower().endswith(".toml"):
                return toml.load(file)
    except (toml.TomlDecodeError, json.JSONDecodeError, UnicodeDecodeError) as error:
        kind = os.path.splitext(path)[1][1:].upper()
        raise UserError(f"--dataset_config {path}: not valid {kind} ({error})") from None
    raise UserError(f"--dataset_config {path}: expected a .toml or .json file")


def validate_user_config(config: dict, path: str) -> dict:
    """The config with values converted; raises one UserError for the first problem found."""
    try:
        return USER_CONFIG_SCHEMA(config)
    except MultipleInvalid as errors:
        error = sorted(errors.errors, key=lambda e: [str(p) for p in e.path])[0]
        raise UserError(f"--dataset_config {path}: {_describe(error, config)}") from None


def _location(path: list) -> str:
    """['datasets', 0, 'subsets', 1, 'x'] -> '[[datasets]] #1, [[datasets.subsets]] #2'."""
    if not path:
        return "top level"
    if path[0] == "general":
        return "[general]"
    parts = []
    if path[0] == "datasets" and len(path) > 1 and isinstance(path[1], int):
        parts.append(f"[[datasets]] #{path[1] + 1}")
        if len(path) > 3 and path[2] == "subsets" and isinstance(path[3], int):
            parts.append(f"[[datasets.subsets]] #{path[3] + 1}")
    return ", ".join(parts) or "top level"


def _valid_keys(path: list, config: dict) -> list[str]:
    if len(path) <= 1:
        return ["general", "datasets"]
    if path[0] == "general":
        return sorted(_GENERAL)
    finetuning = False
    try:
        finetuning = any("metadata_file" in s for s in config["datasets"][path[1]].get("subsets", []))
    except (KeyError, IndexError, TypeError, AttributeError):
        pass
    if len(path) > 3 and path[2] == "subsets":
        schema = _FT_SUBSET if finetuning else _DB_SUBSET
    else:
        schema = _FT_DATASET if finetuning else _DB_DATASET
    return sorted(str(key) for key in schema)


def _value_at(config: Any, path: list) -> Any:
    for part in path:
        try:
            config = config[part]
        except (KeyError, IndexError, TypeError):
            return None
    return config


def _describe(error: Invalid, config: dict) -> str:
    path = [getattr(part, "schema", part) for part in error.path]  # Required("x") -> "x"
    key = path[-1] if path and isinstance(path[-1], str) else None
    where = _location(path)
    message = error.error_message
    if message == "extra keys not allowed" and key is not None:
        valid = _valid_keys(path, config)
        close = difflib.get_close_matches(key, valid, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else f" (valid keys: {', '.join(valid)})"
        return f"{where}: unknown key '{key}'{hint}"
    if message == "required key not provided" and key is not None:
        return f"{where}: '{key}' is required"
    if message.startswith("expected a list") or message.startswith("expected list"):
        return f"{where}: '{key}' must be a list of tables ([[{'.'.join(str(p) for p in path if isinstance(p, str))}]])"
    if message.startswith("expected a dictionary") or message.startswith("expected dict"):
        return f"{where}: '{key}' must be a table" if key else f"{where}: must be a table"
    if key is not None:
        return f"{where}: '{key}' {message}, got {_value_at(config, path)!r}"
    return f"{where}: {message}"


# -- blueprint: resolve every value through kohya's fallback chain -------------------------------
def argparse_values(args: argparse.Namespace) -> dict[str, Any]:
    """The command-line values under their config names (``train_batch_size`` -> ``batch_size``)."""
    values = {ARGPARSE_RENAMES.get(name, name): value for name, value in vars(args).items()}
    resolution = getattr(args, "resolution", None)
    values["resolution"] = parse_resolution_wh(resolution, "--resolution") if resolution is not None else None
    skip = getattr(args, "skip_image_resolution", None)
    values["skip_image_resolution"] = parse_skip_image_resolution(skip, "--skip_image_resolution")
    return values


def parse_skip_image_resolution(value: Any, where: str) -> Optional[tuple[int, int]]:
    """kohya's ``skip_image_resolution``: 'size', 'width,height', an int or [width, height] -> (width, height);
    a threshold on the original image area, so any non-negative sizes (no multiple-of-8 rule)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            sizes = [int(part.strip()) for part in value.split(",")]
        except ValueError:
            raise UserError(f"{where} {value}: expected 'size' or 'width,height' in pixels") from None
    else:
        sizes = list(value) if isinstance(value, (tuple, list)) else [value]
    if len(sizes) == 1:
        sizes = sizes * 2
    if len(sizes) != 2 or any(isinstance(size, bool) or not isinstance(size, int) or size < 0 for size in sizes):
        raise UserError(f"{where} {value}: expected 'size' or 'width,height', non-negative whole pixels")
    return (sizes[0], sizes[1])


def parse_resolution_wh(text: Any, flag: str) -> tuple[int, int]:
    """'512', '512,768', 512 or (w, h) -> (width, height), each a multiple of 8 from 64 to ``MAX_SIDE_PX``."""
    if isinstance(text, (tuple, list)):
        sizes = list(text)
    else:
        try:
            sizes = [int(part.strip()) for part in str(text).split(",")]
        except ValueError:
            raise UserError(f"{flag} {text}: expected 'size' or 'width,height' in pixels") from None
    if len(sizes) == 1:
        sizes = sizes * 2
    if len(sizes) != 2 or min(sizes) < 64 or any(size % 8 for size in sizes):
        raise UserError(f"{flag} {text}: sizes must be multiples of 8 and at least 64 ('size' or 'width,height')")
    if max(sizes) > MAX_SIDE_PX:
        raise UserError(f"{flag} {text}: at most {MAX_SIDE_PX} px per side ({TOO_LARGE_FOR_ANY_GPU})")
    return (int(sizes[0]), int(sizes[1]))


def _lookup(key: str, layers: list[dict], default: Any) -> Any:
    for layer in layers:
        value = layer.get(key)
        if value is not None:
            return value
    return default


def build_specs(user_config: dict, args: argparse.Namespace, source: str) -> list[DatasetSpec]:
    """Resolve a (validated) user config against the command line into dataset specs.

    ``source`` names where the config came from (``--dataset_config FILE`` or the
    command-line flags) for error messages.
    """
    general = user_config.get("general", {})
    command_line = argparse_values(args)
    specs = []
    for dataset_index, dataset in enumerate(user_config.get("datasets", [])):
        from_file = source.startswith("--dataset_config")
        dataset_where = f"{source} [[datasets]] #{dataset_index + 1}" if from_file else source
        layers = [dataset, general, command_line]
        values = {key: _lookup(key, layers, default) for key, default in DATASET_DEFAULTS.items()}
        subsets = dataset.get("subsets", [])
        spec = DatasetSpec(
            resolution_wh=_required_resolution(values["resolution"], dataset_where),
            batch_size=values["batch_size"],
            enable_bucket=values["enable_bucket"],
            min_bucket_reso=values["min_bucket_reso"],
            max_bucket_reso=values["max_bucket_reso"],
            bucket_reso_steps=values["bucket_reso_steps"],
            bucket_no_upscale=values["bucket_no_upscale"],
            prior_loss_weight=float(values["prior_loss_weight"]),
            is_finetuning=any("metadata_file" in subset for subset in subsets),
            where=dataset_where,
            resize_interpolation=values["resize_interpolation"],
            validation_split=float(values["validation_split"]),
            # kohya: without validation_seed the split follows the training --seed
            validation_seed=(values["validation_seed"] if values["validation_seed"] is not None
                             else command_line.get("seed") or 0),
            skip_image_resolution=parse_skip_image_resolution(values["skip_image_resolution"],
                                                              f"{dataset_where}: skip_image_resolution"),
        )
        _check_dataset(spec, values)
        for subset_index, subset in enumerate(subsets):
            subset_where = (
                f"{dataset_where}, [[datasets.subsets]] #{subset_index + 1}"
                if from_file else f"{source} ({subset.get('image_dir')})"
            )
            resolved = {key: _lookup(key, [subset] + layers, default) for key, default in SUBSET_DEFAULTS.items()}
            spec.subsets.append(_subset_spec(resolved, subset_where, values["resize_interpolation"]))
        specs.append(spec)
    return specs


def _required_resolution(value: Any, where: str) -> tuple[int, int]:
    if value is None:
        raise UserError(f"{where}: no resolution: pass --resolution (e.g. 1024) or set resolution in the config")
    return parse_resolution_wh(value, f"{where}: resolution")


def _check(condition: bool, where: str, message: str) -> None:
    if not condition:
        raise UserError(f"{where}: {message}")


def _check_dataset(spec: DatasetSpec, values: dict) -> None:
    where = spec.where
    _check(spec.batch_size >= 1, where, f"batch_size {spec.batch_size} must be at least 1")
    _check(spec.bucket_reso_steps >= 1, where, f"bucket_reso_steps {spec.bucket_reso_steps} must be a positive "
           f"multiple of 64 (SD1.x/2.x) or 32 (SDXL), as in kohya")
    _check(spec.min_bucket_reso > 0 and spec.max_bucket_reso > 0, where, "bucket sizes must be positive")
    for key, default in UNSUPPORTED.items():
        if key in values and values[key] not in (None, default):
            raise UserError(f"{where}: {key} = {values[key]!r} is not supported by this trainer (remove it)")
    interpolation = values["resize_interpolation"]
    _check(interpolation is None or interpolation in INTERPOLATIONS, where,
           f"resize_interpolation {interpolation!r} must be one of {', '.join(INTERPOLATIONS)}")
    split = spec.validation_split
    _check(0.0 <= split < 1.0, where, f"validation_split {split} must be at least 0 and below 1 "
                                      f"(the fraction of each training subset's images kept for validation)")
    # kohya splits only DreamBooth datasets: its validation set of a fine-tuning dataset is the
    # whole training set, a number that says nothing about over-fitting.
    _check(not (split and spec.is_finetuning), where,
           f"validation_split {split} needs DreamBooth subsets (image_dir); fine-tuning datasets (metadata_file, "
           f"--in_json) cannot be split here (kohya would validate on the training images)")


def _subset_spec(values: dict, where: str, dataset_interpolation: Optional[str]) -> SubsetSpec:
    for key, default in UNSUPPORTED.items():
        if key in values and values[key] not in (None, default):
            raise UserError(f"{where}: {key} = {values[key]!r} is not supported by this trainer (remove it)")
    for key in ("caption_dropout_rate", "caption_tag_dropout_rate"):
        _check(0.0 <= values[key] <= 1.0, where, f"{key} {values[key]} must be between 0 and 1")
    for key in ("keep_tokens", "caption_dropout_every_n_epochs", "token_warmup_min", "token_warmup_step"):
        _check(values[key] >= 0, where, f"{key} {values[key]} must not be negative")
    interpolation = values["resize_interpolation"] or dataset_interpolation
    _check(interpolation is None or interpolation in INTERPOLATIONS, where,
           f"resize_interpolation {interpolation!r} must be one of {', '.join(INTERPOLATIONS)}")
    extension = values["caption_extension"]
    if extension and not extension.startswith("."):
        extension = "." + extension
    separator = values["caption_separator"]
    _check(bool(separator), where, "caption_separator must not be empty")
    captions = CaptionOptions(
        shuffle_caption=values["shuffle_caption"],
        caption_separator=separator,
        keep_tokens=values["keep_tokens"],
        keep_tokens_separator=values["keep_tokens_separator"] or "",
        secondary_separator=values["secondary_separator"],
        enable_wildcard=values["enable_wildcard"],
        caption_prefix=values["caption_prefix"],
        caption_suffix=values["caption_suffix"],
        caption_dropout_rate=float(values["caption_dropout_rate"]),
        caption_dropout_every_n_epochs=values["caption_dropout_every_n_epochs"],
        caption_tag_dropout_rate=float(values["caption_tag_dropout_rate"]),
        token_warmup_min=values["token_warmup_min"],
        token_warmup_step=float(values["token_warmup_step"]),
    )
    return SubsetSpec(
        image_dir=values["image_dir"],
        metadata_file=values["metadata_file"],
        num_repeats=values["num_repeats"],
        is_reg=bool(values["is_reg"]),
        class_tokens=values["class_tokens"],
        caption_extension=extension,
        cache_info=values["cache_info"],
        alpha_mask=values["alpha_mask"],
        color_aug=values["color_aug"],
        flip_aug=values["flip_aug"],
        random_crop=values["random_crop"],
        resize_interpolation=interpolation,
        captions=captions,
        where=where,
    )


