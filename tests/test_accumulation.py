"""Exact loss normalisation end to end: how a step's samples are split into micro-batches does not matter."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import model_args, run_trainer
from PIL import Image

from library.sharding import PaddedBatches, ShardSampler
from networks import lora


@pytest.fixture(scope="module")
def rgba_dataset(tmp_path_factory) -> tuple[Path, Path]:
    """Four training images whose alpha covers different areas, and two regularisation images."""
    root = tmp_path_factory.mktemp("rgba")
    rng = np.random.default_rng(3)
    folders = (root / "train" / "1_thing", root / "reg" / "1_other")
    for folder in folders:
        folder.mkdir(parents=True)
    for index, rows in enumerate((8, 24, 40, 64)):
        pixels = rng.integers(0, 256, (64, 64, 4), dtype=np.uint8)
        pixels[..., 3] = 0
        pixels[:rows, :, 3] = 255
        Image.fromarray(pixels, "RGBA").save(folders[0] / f"{index}.png")
        (folders[0] / f"{index}.txt").write_text(f"thing {index}")
    for index in range(2):
        pixels = rng.integers(0, 256, (64, 64, 4), dtype=np.uint8)
        pixels[..., 3] = 255
        Image.fromarray(pixels, "RGBA").save(folders[1] / f"{index}.png")
    return root / "train", root / "reg"


def one_step(tiny_models, rgba_dataset, output_dir: Path, batch: int, accumulation: int, *extra: str):
    train_dir, reg_dir = rgba_dataset
    run_trainer(
        "sdxl_train_network",
        model_args(tiny_models, "sdxl") + [
            "--train_data_dir", str(train_dir), "--reg_data_dir", str(reg_dir), "--prior_loss_weight", "0.5",
            "--caption_extension", ".txt", "--resolution", "64", "--output_dir", str(output_dir),
            "--seed", "11", "--max_data_loader_n_workers", "0", "--network_train_unet_only", "--network_dim", "4",
            "--alpha_mask", "--masked_loss", "--mixed_precision", "no", "--optimizer_type", "torch.optim.SGD",
            "--learning_rate", "1.0", "--max_grad_norm", "0", "--max_train_steps", "1", "--save_precision", "float",
            "--train_batch_size", str(batch), "--gradient_accumulation_steps", str(accumulation), *extra,
        ],
    )
    return lora.read_lora_file(str(output_dir / "last.safetensors"))


def max_relative_difference(a: dict, b: dict) -> float:
    ups = [key for key in a if "lora_up" in key]  # one SGD step from zero: up = -lr * gradient
    numerator = max((a[key] - b[key]).abs().max().item() for key in ups)
    return numerator / max(a[key].abs().max().item() for key in ups)


def test_one_step_is_the_same_for_every_split_and_micro_is_not(tiny_models, rgba_dataset, tmp_path):
    # 4 training + 4 (balanced) regularisation samples: one optimizer step sees all 8.
    full = one_step(tiny_models, rgba_dataset, tmp_path / "8x1", 8, 1)
    for batch, accumulation in ((1, 8), (2, 4), (4, 2), (3, 3)):  # 3 x 3: micro-batches of 3, 3 and 2
        split = one_step(tiny_models, rgba_dataset, tmp_path / f"{batch}x{accumulation}", batch, accumulation)
        assert max_relative_difference(full, split) < 1e-5, (batch, accumulation)
    micro_full = one_step(tiny_models, rgba_dataset, tmp_path / "micro8x1", 8, 1, "--loss_normalization", "micro")
    micro_split = one_step(tiny_models, rgba_dataset, tmp_path / "micro3x3", 3, 3, "--loss_normalization", "micro")
    # kohya's mean of micro-batch means weighs the samples of the short micro-batch more
    assert max_relative_difference(micro_full, micro_split) > 1e-2


def test_shards_cover_every_batch_once_and_padding_weighs_nothing():
    class Batches(torch.utils.data.Dataset):
        def __len__(self):
            return 7

        def __getitem__(self, index):
            return {"images": torch.zeros(1, 3, 64, 64), "loss_weights": torch.ones(1), "index": index}

    samplers = [ShardSampler(Batches(), rank, 3) for rank in range(3)]
    shards = [list(sampler) for sampler in samplers]
    assert {len(shard) for shard in shards} == {3}  # every process runs the same number of micro-batches
    real = sorted(index for shard in shards for index in shard if index >= 0)
    assert real == list(range(7))  # no duplicates, no gaps
    padded = PaddedBatches(Batches())
    padding = [padded[index] for shard in shards for index in shard if index < 0]
    assert len(padding) == 2
    assert all(batch["loss_weights"].sum() == 0 and batch["alpha_masks"].sum() == 0 for batch in padding)
    samplers[1].start_at(2)  # resume: skip this process's first two batches, for one pass only
    assert list(samplers[1]) == shards[1][2:] and list(samplers[1]) == shards[1]
