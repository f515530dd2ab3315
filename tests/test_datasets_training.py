"""A dataset config as kohya_ss GUI users write it trains end to end on the tiny SDXL, with and without caches."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import model_args, run_trainer
from safetensors import safe_open
from test_datasets import write_config, write_image

from library.errors import UserError


@pytest.fixture()
def gui_dataset(tmp_path):
    """Two training folders (one of RGBA images with odd sizes), a regularisation folder, a GUI-style TOML."""
    rng = np.random.default_rng(0)
    for index, size in enumerate([(128, 128), (160, 96), (100, 130)]):
        write_image(tmp_path / "img" / "20_sks dog" / f"dog{index}.jpg", size,
                    caption=f"sks dog, photo, tag{index}, outdoors")
    for index, size in enumerate([(96, 96), (150, 90)]):
        pixels = rng.integers(0, 256, (size[1], size[0], 4), dtype=np.uint8)
        pixels[:, : size[0] // 3, 3] = 0
        write_image(tmp_path / "img" / "10_sks toy" / f"toy{index}.png", size, mode="RGBA", pixels=pixels,
                    caption="sks toy ||| red, small")
    for index in range(3):
        write_image(tmp_path / "reg" / "1_dog" / f"reg{index}.webp", (128, 128))
    config = write_config(tmp_path, f"""
[general]
shuffle_caption = false
caption_extension = '.txt'
keep_tokens = 1
enable_bucket = true
min_bucket_reso = 64
max_bucket_reso = 256
bucket_reso_steps = 32
bucket_no_upscale = false

[[datasets]]
resolution = 128
batch_size = 2

  [[datasets.subsets]]
  image_dir = '{tmp_path / "img" / "20_sks dog"}'
  class_tokens = 'sks dog'
  num_repeats = 2
  flip_aug = true

  [[datasets.subsets]]
  image_dir = '{tmp_path / "img" / "10_sks toy"}'
  class_tokens = 'sks toy'
  num_repeats = 1
  alpha_mask = true
  keep_tokens_separator = '|||'

  [[datasets.subsets]]
  is_reg = true
  image_dir = '{tmp_path / "reg" / "1_dog"}'
  class_tokens = 'dog'
  num_repeats = 1
""")
    return tmp_path, config


def common(output_dir, *extra):
    return ["--output_dir", str(output_dir), "--seed", "1", "--max_data_loader_n_workers", "0", "--network_dim", "4",
            "--learning_rate", "1e-3", "--output_name", "gui", *extra]


def test_gui_dataset_config_trains_end_to_end(tiny_models, gui_dataset, capsys):
    root, config = gui_dataset
    run_trainer("sdxl_train_network", model_args(tiny_models, "sdxl") + common(
        root / "out", "--dataset_config", str(config), "--max_train_steps", "3", "--max_token_length", "150",
        "--shuffle_caption", "--prior_loss_weight", "0.5"))
    output = capsys.readouterr().out
    # reg images are repeated up to the 8 training samples: 2 (dog0) + 1 (toy0) + 8 (reg) in the square bucket
    for bucket in ("(128, 128), count: 11", "(160, 96), count: 3", "(96, 160), count: 2"):  # the bucket summary
        assert f"resolution {bucket}" in output, output
    with safe_open(str(root / "out" / "gui.safetensors"), "pt") as file:
        metadata = file.metadata()
    assert metadata["ss_num_train_images"] == "8" and metadata["ss_num_reg_images"] == "3"
    dirs = json.loads(metadata["ss_dataset_dirs"])
    # kohya leaves regularisation folders out of ss_dataset_dirs with a config file; ss_datasets has them
    assert dirs["20_sks dog"] == {"n_repeats": 2, "img_count": 3} and "1_dog" not in dirs
    reg_subsets = [subset for dataset in json.loads(metadata["ss_datasets"]) for subset in dataset["subsets"]
                   if subset.get("is_reg")]
    assert [(subset["image_dir"], subset["img_count"]) for subset in reg_subsets] == [("1_dog", 3)]


def test_cached_run_writes_and_reuses_caches(tiny_models, gui_dataset):
    root, config = gui_dataset
    argv = model_args(tiny_models, "sdxl") + common(
        root / "cached", "--dataset_config", str(config), "--max_train_steps", "2", "--cache_latents_to_disk",
        "--cache_text_encoder_outputs_to_disk", "--network_train_unet_only", "--vae_batch_size", "2",
        "--mixed_precision", "bf16")
    run_trainer("sdxl_train_network", argv)
    latent_files = sorted(name for name in os.listdir(root / "img" / "10_sks toy") if name.endswith("_sdxl.npz"))
    assert latent_files == ["toy0_0096x0096_sdxl.npz", "toy1_0150x0090_sdxl.npz"]
    assert os.path.isfile(root / "img" / "20_sks dog" / "dog0_te_outputs.npz")
    stamps = {path: path.stat().st_mtime_ns for path in root.rglob("*.npz")}
    run_trainer("sdxl_train_network", argv)
    assert {path: path.stat().st_mtime_ns for path in root.rglob("*.npz")} == stamps  # all fresh: reused
    with safe_open(str(root / "cached" / "gui.safetensors"), "pt") as file:
        assert all(key.startswith("lora_unet_") for key in file.keys())


def test_text_cache_with_trained_text_encoders_is_refused_before_loading(tiny_models, gui_dataset):
    root, config = gui_dataset
    with pytest.raises(UserError, match="--network_train_unet_only"):
        run_trainer("sdxl_train_network", model_args(tiny_models, "sdxl") + common(
            root / "refused", "--dataset_config", str(config), "--cache_text_encoder_outputs"))
