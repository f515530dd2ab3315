"""Training options users pass every day: continuing from weights, bf16, epochs and rotation, dropouts, wandb."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import model_args, run_trainer, train_expecting_user_error

from networks import lora


def args_for(tiny_models, dataset: Path, output_dir: Path, *extra: str) -> list[str]:
    return model_args(tiny_models, "sdxl") + [
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output_dir), "--seed", "2", "--max_data_loader_n_workers", "0",
        "--network_train_unet_only", *extra,
    ]


def test_continue_from_network_weights_and_dim_from_weights(tiny_models, demo_dataset, tmp_path, capsys):
    first = tmp_path / "first"
    run_trainer("sdxl_train_network", args_for(tiny_models, demo_dataset, first, "--network_dim", "8",
                                               "--network_alpha", "4", "--max_train_steps", "2"))
    weights = first / "last.safetensors"
    # --dim_from_weights takes ranks and alphas from the file and starts from its values
    second = tmp_path / "second"
    run_trainer("sdxl_train_network", args_for(tiny_models, demo_dataset, second, "--network_weights", str(weights),
                                               "--dim_from_weights", "--max_train_steps", "1"))
    saved, continued = lora.read_lora_file(str(weights)), lora.read_lora_file(str(second / "last.safetensors"))
    assert saved.keys() == continued.keys()
    assert all(saved[key].shape == continued[key].shape for key in saved)
    assert continued["lora_unet_input_blocks_4_1_proj_in.alpha"].item() == 4.0
    # the same file with another --network_dim is refused by name
    error = train_expecting_user_error(args_for(
        tiny_models, demo_dataset, tmp_path / "third", "--network_weights", str(weights), "--network_dim", "4",
        "--max_train_steps", "1"), capsys)
    assert "--network_weights" in error
    # the same rank with another alpha: training would use one scale and save the other
    error = train_expecting_user_error(args_for(
        tiny_models, demo_dataset, tmp_path / "fourth", "--network_weights", str(weights), "--network_dim", "8",
        "--max_train_steps", "1"), capsys)
    assert "alpha is 4, this network's is 1; pass the file's alpha with --network_alpha" in error
    run_trainer("sdxl_train_network", args_for(tiny_models, demo_dataset, tmp_path / "fifth", "--network_weights",
                                               str(weights), "--network_dim", "8", "--network_alpha", "4",
                                               "--max_train_steps", "1"))
    # a bf16 file stores alpha 0.3 as 0.30078125: the same --network_alpha still matches it
    run_trainer("sdxl_train_network", args_for(tiny_models, demo_dataset, tmp_path / "bf16", "--network_dim", "8",
                                               "--network_alpha", "0.3", "--save_precision", "bf16",
                                               "--max_train_steps", "1"))
    run_trainer("sdxl_train_network", args_for(tiny_models, demo_dataset, tmp_path / "bf16_more", "--network_weights",
                                               str(tmp_path / "bf16" / "last.safetensors"), "--network_dim", "8",
                                               "--network_alpha", "0.3", "--max_train_steps", "1"))


def test_bf16_epochs_rotation_and_dropouts(tiny_models, demo_dataset, tmp_path):
    output_dir = tmp_path / "out"
    run_trainer("sdxl_train_network", args_for(
        tiny_models, demo_dataset, output_dir, "--mixed_precision", "bf16", "--max_train_epochs", "4",
        "--save_every_n_epochs", "1", "--save_last_n_epochs", "2", "--network_dropout", "0.1",
        "--network_args", "rank_dropout=0.1", "module_dropout=0.1", "--save_precision", "bf16",
    ))
    files = sorted(path.name for path in output_dir.glob("*.safetensors"))
    # epochs 1-3 were saved as epoch files, only the last 2 kept; epoch 4 is the final file
    assert files == ["last-000002.safetensors", "last-000003.safetensors", "last.safetensors"]
    weights = lora.read_lora_file(str(output_dir / "last.safetensors"))
    assert {value.dtype for value in weights.values()} == {torch.bfloat16}
    assert all(torch.isfinite(value.float()).all() for value in weights.values())


def test_wandb_logs_offline(tiny_models, demo_dataset, tmp_path, offline_wandb):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle --w 64 --h 64 --s 1 --d 1\n")
    run_trainer("sdxl_train_network", args_for(
        tiny_models, demo_dataset, tmp_path / "out", "--max_train_steps", "2", "--log_with", "wandb",
        "--wandb_run_name", "tiny-run", "--log_tracker_name", "tiny-project",
        "--sample_prompts", str(prompts), "--sample_every_n_steps", "2",
    ))
    runs = list(offline_wandb.glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))
    # the sample image went to wandb as kohya sends it: sample_0
    assert [path.name.startswith("sample_0") for path in runs[0].rglob("media/images/*.png")] == [True]
