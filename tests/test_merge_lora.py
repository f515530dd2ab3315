"""networks/merge_lora.py: a merged checkpoint renders what base + LoRA renders in diffusers;
LoRAs merged into one LoRA carry exactly the ratio-weighted sum of the deltas."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TRAIN_SCRIPTS, model_args, run_trainer

from library.errors import UserError
from networks import merge_lora
from networks.lora import lora_delta, lora_modules, read_lora_file

REPO_ROOT = Path(__file__).resolve().parent.parent


def train(kind: str, tiny_models, dataset: Path, output_dir: Path, seed: int) -> Path:
    run_trainer(TRAIN_SCRIPTS[kind], model_args(tiny_models, kind) + [
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output_dir), "--output_name", f"lora{seed}", "--seed", str(seed),
        "--max_data_loader_n_workers", "0", "--network_dim", "4", "--network_alpha", "2",
        "--learning_rate", "3e-2", "--max_train_steps", "3",
    ])
    return output_dir / f"lora{seed}.safetensors"


@pytest.fixture(scope="module")
def loras(tiny_models, demo_dataset, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("merge_loras")
    return {kind: (train(kind, tiny_models, demo_dataset, root / kind, 1),
                   train(kind, tiny_models, demo_dataset, root / kind, 2)) for kind in TRAIN_SCRIPTS}


def render(pipe) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator("cpu").manual_seed(0)
    return pipe("a red circle", num_inference_steps=2, height=64, width=64, generator=generator,
                output_type="np").images[0]


def load_pipeline(kind: str, path: Path, tiny_models):
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    pipeline_class = StableDiffusionXLPipeline if kind == "sdxl" else StableDiffusionPipeline
    return pipeline_class.from_single_file(str(path), config=str(tiny_models[f"{kind}_config"]), local_files_only=True)


@pytest.mark.parametrize("kind", ["sdxl", "sd15"])
def test_merged_checkpoint_matches_base_plus_lora(kind, loras, tiny_models, tmp_path):
    first, second = loras[kind]
    merged = tmp_path / "merged.safetensors"
    result = subprocess.run([sys.executable, str(REPO_ROOT / "networks" / "merge_lora.py"),
                             "--sd_model", str(tiny_models[f"{kind}_file"]),
                             "--model_config_dir", str(tiny_models[f"{kind}_config"]),
                             "--save_to", str(merged), "--models", str(first), str(second), "--ratios", "1.0", "0.5"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr

    base = load_pipeline(kind, tiny_models[f"{kind}_file"], tiny_models)
    plain = render(base)
    base.load_lora_weights(str(first), adapter_name="first")
    base.load_lora_weights(str(second), adapter_name="second")
    base.set_adapters(["first", "second"], adapter_weights=[1.0, 0.5])
    with_lora = render(base)
    from_merged = render(load_pipeline(kind, merged, tiny_models))
    assert np.abs(with_lora - plain).max() > 1e-3  # the LoRAs do change the image
    np.testing.assert_allclose(from_merged, with_lora, atol=2e-4)


def test_loras_merged_into_one_lora_sum_the_deltas(loras, tmp_path):
    first, second = loras["sdxl"]
    out = tmp_path / "ab.safetensors"
    merge_lora.main(["--save_to", str(out), "--models", str(first), str(second), "--ratios", "1.0", "-0.5"])
    merged = lora_modules(read_lora_file(str(out)))
    a, b = lora_modules(read_lora_file(str(first))), lora_modules(read_lora_file(str(second)))
    assert set(merged) == set(a) | set(b)
    for name, parts in merged.items():
        assert parts["down"].shape[0] == a[name]["down"].shape[0] + b[name]["down"].shape[0]
        expected = lora_delta(a[name], torch.float64) - 0.5 * lora_delta(b[name], torch.float64)
        torch.testing.assert_close(lora_delta(parts, torch.float64), expected, rtol=1e-5, atol=1e-8)


def test_merge_user_errors(loras, tiny_models, tmp_path):
    first, _ = loras["sdxl"]
    with pytest.raises(UserError, match="--ratios"):
        merge_lora.main(["--save_to", str(tmp_path / "x.safetensors"), "--models", str(first), "--ratios", "1", "2"])
    sd15_lora = loras["sd15"][0]
    with pytest.raises(UserError, match="match nothing"):
        merge_lora.main(["--sd_model", str(tiny_models["sdxl_file"]), "--model_config_dir",
                         str(tiny_models["sdxl_config"]), "--save_to", str(tmp_path / "x.safetensors"),
                         "--models", str(sd15_lora)])
    assert not (tmp_path / "x.safetensors").exists()
