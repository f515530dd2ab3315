"""The dataset-derived ``ss_*`` keys of LoRA files, in kohya-ss sd-scripts' two shapes.

Expected values follow kohya's train_network.py (metadata) and train_util.py
(``set_tag_frequency``, ``make_buckets``), worked out by hand for real image folders.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import sdxl_train_network
from library.datasets.dataset import build_dataset
from library.lora_metadata import dataset_metadata, training_metadata

# Exactly the keys each branch of kohya's train_network.py writes (v0.11.1: skip_image_resolution
# follows max_bucket_reso in both shapes).
FOLDER_KEYS = [
    "ss_batch_size_per_device", "ss_total_batch_size", "ss_resolution", "ss_color_aug", "ss_flip_aug",
    "ss_random_crop", "ss_shuffle_caption", "ss_enable_bucket", "ss_bucket_no_upscale", "ss_min_bucket_reso",
    "ss_max_bucket_reso", "ss_skip_image_resolution", "ss_keep_tokens", "ss_dataset_dirs", "ss_reg_dataset_dirs", "ss_tag_frequency",
    "ss_bucket_info",
]
CONFIG_KEYS = ["ss_datasets", "ss_tag_frequency", "ss_dataset_dirs"]
JSON_KEYS = {"ss_dataset_dirs", "ss_reg_dataset_dirs", "ss_tag_frequency", "ss_bucket_info", "ss_datasets"}
DATASET_ENTRY_KEYS = [
    "is_dreambooth", "batch_size_per_device", "num_train_images", "num_reg_images", "resolution", "enable_bucket",
    "min_bucket_reso", "max_bucket_reso", "skip_image_resolution", "tag_frequency", "bucket_info", "resize_interpolation", "subsets",
]
SUBSET_ENTRY_KEYS = [
    "img_count", "num_repeats", "color_aug", "flip_aug", "random_crop", "shuffle_caption", "keep_tokens",
    "keep_tokens_separator", "secondary_separator", "enable_wildcard", "caption_prefix", "caption_suffix",
    "resize_interpolation", "image_dir", "class_tokens", "is_reg",
]


def image(path: Path, size_wh: tuple[int, int], caption: str | None = None) -> None:
    """A real PNG, with a .txt caption beside it when ``caption`` is given."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((size_wh[1], size_wh[0], 3), 90, np.uint8)).save(path)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption + "\n", encoding="utf-8")


def parse(*argv: str):
    return sdxl_train_network.setup_parser().parse_args(["--seed", "1", *argv])


def check_strings(metadata: dict[str, str]) -> dict:
    """Every value is a str; the JSON ones decode. Returns the decoded JSON values."""
    assert all(isinstance(value, str) for value in metadata.values())
    return {key: json.loads(value) for key, value in metadata.items() if key in JSON_KEYS}


def training_keys(args) -> set[str]:
    facts = {"session_id": 1, "training_started_at": 0.0, "num_train_images": 1, "num_reg_images": 0,
             "num_batches_per_epoch": 1, "num_epochs": 1, "optimizer": "AdamW", "total_batch_size": 1,
             "model_name": "m"}
    return set(training_metadata(args, "sdxl", facts))


@pytest.fixture()
def folders(tmp_path: Path) -> Path:
    """Two training folders (plus an empty one) and a reg folder; captions with repeated,
    upper-case and padded tags. Sizes: 100x60 -> bucket (160, 96) exactly, 90x60 -> (160, 96)
    with an aspect error, 64x64 -> (128, 128) (kohya's table for 128x128, steps 32)."""
    image(tmp_path / "train" / "10_sks dog" / "a.png", (100, 60), "sks dog, Red Collar,  red collar ,sitting")
    image(tmp_path / "train" / "10_sks dog" / "b.png", (64, 64), "sks dog, SITTING, sitting,, ")
    image(tmp_path / "train" / "10_sks dog" / "c.png", (64, 64))  # no caption file: the class tokens count
    image(tmp_path / "train" / "3_sks cat" / "d.png", (90, 60), "Cat, cat")
    (tmp_path / "train" / "5_empty").mkdir()
    image(tmp_path / "reg" / "1_dog" / "r1.png", (64, 64), "dog, Photo")
    image(tmp_path / "reg" / "1_dog" / "r2.png", (64, 64), "DOG")
    return tmp_path


def test_folder_run_writes_kohyas_flags_dirs_tags_and_buckets(folders):
    args = parse("--train_data_dir", str(folders / "train"), "--reg_data_dir", str(folders / "reg"),
                 "--caption_extension", ".txt", "--resolution", "128", "--enable_bucket", "--min_bucket_reso", "70",
                 "--max_bucket_reso", "250", "--bucket_reso_steps", "32", "--train_batch_size", "2", "--flip_aug",
                 "--shuffle_caption", "--keep_tokens", "1")
    dataset = build_dataset(args, min_bucket_steps=32)
    metadata = dataset_metadata(args, dataset, total_batch_size=8)
    assert list(metadata) == FOLDER_KEYS
    decoded = check_strings(metadata)
    assert {key: metadata[key] for key in FOLDER_KEYS if key not in JSON_KEYS} == {
        "ss_batch_size_per_device": "2", "ss_total_batch_size": "8", "ss_resolution": "(128, 128)",
        "ss_color_aug": "False", "ss_flip_aug": "True", "ss_random_crop": "False", "ss_shuffle_caption": "True",
        "ss_enable_bucket": "True", "ss_bucket_no_upscale": "False",
        "ss_min_bucket_reso": "64", "ss_max_bucket_reso": "256",  # put on the step grid, as kohya reports them
        "ss_skip_image_resolution": "None",
        "ss_keep_tokens": "1",
    }
    # Raw captions split at ",", stripped, lower-cased, every occurrence counted once per image
    # (not per repeat); reg folders included; an empty folder is recorded as {} (kohya).
    tags = {
        "10_sks dog": {"sks dog": 3, "red collar": 2, "sitting": 3},
        "3_sks cat": {"cat": 2},
        "5_empty": {},
        "1_dog": {"dog": 2, "photo": 1},
    }
    assert metadata["ss_tag_frequency"] == json.dumps(tags)  # values and key order
    assert decoded["ss_dataset_dirs"] == {"10_sks dog": {"n_repeats": 10, "img_count": 3},
                                          "3_sks cat": {"n_repeats": 3, "img_count": 1}}
    assert decoded["ss_reg_dataset_dirs"] == {"1_dog": {"n_repeats": 1, "img_count": 2}}
    # 33 training samples; the two reg images are repeated up to 33 samples, all in (128, 128).
    errors = [0.0, 0.0, 0.0, 0.0, abs(160 / 96 - 100 / 60), abs(160 / 96 - 90 / 60)]
    assert decoded["ss_bucket_info"] == {
        "buckets": {"0": {"resolution": [128, 128], "count": 2 * 10 + 33},
                    "1": {"resolution": [160, 96], "count": 10 + 3}},
        "mean_img_ar_error": pytest.approx(sum(errors) / 6, rel=1e-12),
    }
    assert training_keys(args).isdisjoint(metadata)


def test_folder_run_without_buckets(folders):
    args = parse("--train_data_dir", str(folders / "train"), "--resolution", "64,96", "--caption_extension", ".txt")
    metadata = dataset_metadata(args, build_dataset(args, min_bucket_steps=32), total_batch_size=1)
    check_strings(metadata)
    assert metadata["ss_bucket_info"] == "null" and metadata["ss_reg_dataset_dirs"] == "{}"
    assert metadata["ss_resolution"] == "(64, 96)"
    assert (metadata["ss_enable_bucket"], metadata["ss_min_bucket_reso"], metadata["ss_max_bucket_reso"]) == (
        "False", "None", "None")


def test_in_json_counts_only_tags_in_kohyas_order(tmp_path):
    image(tmp_path / "img" / "one.png", (64, 64))
    image(tmp_path / "img" / "three.png", (64, 64))
    (tmp_path / "meta.json").write_text(json.dumps({
        "one.png": {"caption": "A photo, red", "tags": "red, Round"},
        "three.png": {"caption": "ignored, for tags", "tags": "blue, red"},
    }), encoding="utf-8")
    args = parse("--in_json", str(tmp_path / "meta.json"), "--train_data_dir", str(tmp_path / "img"),
                 "--resolution", "64", "--dataset_repeats", "3")
    metadata = dataset_metadata(args, build_dataset(args, min_bucket_steps=32), total_batch_size=1)
    assert list(metadata) == FOLDER_KEYS
    # kohya reads entries longest image key first: three.png's tags come before one.png's.
    assert metadata["ss_tag_frequency"] == json.dumps({"meta.json": {"blue": 1, "red": 2, "round": 1}})
    assert json.loads(metadata["ss_dataset_dirs"]) == {"meta.json": {"n_repeats": 3, "img_count": 2}}


def test_dataset_config_writes_ss_datasets(folders):
    root = folders
    config = root / "dataset.toml"
    config.write_text(f"""
[general]
caption_extension = ".txt"
enable_bucket = true
min_bucket_reso = 64
max_bucket_reso = 256
bucket_reso_steps = 32

[[datasets]]
resolution = 128
batch_size = 2
resize_interpolation = "lanczos"

  [[datasets.subsets]]
  image_dir = '{root / "train" / "10_sks dog"}'
  num_repeats = 2
  class_tokens = "sks dog"
  flip_aug = true
  caption_prefix = "photo of"

  [[datasets.subsets]]
  image_dir = '{root / "train" / "3_sks cat"}'
  class_tokens = "cat"
  shuffle_caption = true
  keep_tokens = 1
  resize_interpolation = "area"

  [[datasets.subsets]]
  image_dir = '{root / "reg" / "1_dog"}'
  is_reg = true
  class_tokens = "dog"

[[datasets]]
resolution = 64
enable_bucket = false

  [[datasets.subsets]]
  image_dir = '{root / "train" / "10_sks dog"}'
  caption_extension = ".none"
""", encoding="utf-8")
    args = parse("--dataset_config", str(config))
    metadata = dataset_metadata(args, build_dataset(args, min_bucket_steps=32), total_batch_size=4)
    assert list(metadata) == CONFIG_KEYS
    decoded = check_strings(metadata)
    first, second = decoded["ss_datasets"]
    assert list(first) == DATASET_ENTRY_KEYS and all(list(s) == SUBSET_ENTRY_KEYS for s in first["subsets"])
    common = {"color_aug": False, "random_crop": False, "keep_tokens_separator": "", "secondary_separator": None,
              "enable_wildcard": False, "caption_suffix": None, "is_reg": False}
    assert first == {
        "is_dreambooth": True, "batch_size_per_device": 2, "num_train_images": 3 * 2 + 1, "num_reg_images": 2,
        "resolution": [128, 128], "enable_bucket": True, "min_bucket_reso": 64, "max_bucket_reso": 256,
        "skip_image_resolution": None,
        "tag_frequency": {"10_sks dog": {"sks dog": 3, "red collar": 2, "sitting": 3}, "3_sks cat": {"cat": 2},
                          "1_dog": {"dog": 2, "photo": 1}},
        "bucket_info": {
            # (128, 128): b, c x 2 and the reg images up to the 7 training samples; (160, 96): a x 2, d
            "buckets": {"0": {"resolution": [128, 128], "count": 4 + 7}, "1": {"resolution": [160, 96], "count": 3}},
            "mean_img_ar_error": pytest.approx((abs(160 / 96 - 100 / 60) + abs(160 / 96 - 90 / 60)) / 6, rel=1e-12),
        },
        "resize_interpolation": "lanczos",
        "subsets": [
            {**common, "img_count": 3, "num_repeats": 2, "flip_aug": True, "shuffle_caption": False, "keep_tokens": 0,
             "caption_prefix": "photo of", "resize_interpolation": "lanczos", "image_dir": "10_sks dog",
             "class_tokens": "sks dog"},
            {**common, "img_count": 1, "num_repeats": 1, "flip_aug": False, "shuffle_caption": True, "keep_tokens": 1,
             "caption_prefix": None, "resize_interpolation": "area", "image_dir": "3_sks cat", "class_tokens": "cat"},
            {**common, "img_count": 2, "num_repeats": 1, "flip_aug": False, "shuffle_caption": False,
             "keep_tokens": 0, "caption_prefix": None, "resize_interpolation": "lanczos", "image_dir": "1_dog",
             "class_tokens": "dog", "is_reg": True},
        ],
    }
    # No caption files under ".none" and no class tokens: empty captions, no tags.
    assert second["tag_frequency"] == {"10_sks dog": {}} and second["bucket_info"] is None
    assert (second["enable_bucket"], second["min_bucket_reso"], second["resolution"]) == (False, None, [64, 64])
    assert [s["img_count"] for s in second["subsets"]] == [3]
    # Reg folders stay out of ss_dataset_dirs; a folder met again is numbered (kohya).
    assert decoded["ss_dataset_dirs"] == {"10_sks dog": {"n_repeats": 2, "img_count": 3},
                                          "3_sks cat": {"n_repeats": 1, "img_count": 1},
                                          "10_sks dog (2)": {"n_repeats": 1, "img_count": 3}}
    # A folder used by two datasets keeps the first dataset's counts.
    assert decoded["ss_tag_frequency"] == first["tag_frequency"]
    assert training_keys(args).isdisjoint(metadata)
