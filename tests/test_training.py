"""End-to-end LoRA training on the tiny models: the loss falls, fp16 uses the scaler, files are right."""
from __future__ import annotations

import csv
import json
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from conftest import model_args, run_trainer
from safetensors import safe_open

import sdxl_train_network
import train_network
from library import losses, noise
from library.datasets import dataset as datasets
from library.lora_metadata import addnet_hashes
from networks import lora

SCRIPTS = {"sdxl": ("sdxl_train_network", sdxl_train_network), "sd15": ("train_network", train_network)}


def common_args(dataset_dir: Path, output_dir: Path, *extra: str) -> list[str]:
    return [
        "--train_data_dir", str(dataset_dir), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output_dir), "--seed", "1", "--max_data_loader_n_workers", "0", *extra,
    ]


def read_log(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def evaluation_losses(name: str, tiny_models, dataset_dir: Path, lora_path: Path, tmp_path: Path) -> dict[float, float]:
    """Mean fp32 loss of the dataset's first batch over 16 fixed keyed draws, without and with the LoRA."""
    module_name, module = SCRIPTS[name]
    trainer = module.SdxlNetworkTrainer() if name == "sdxl" else module.NetworkTrainer()
    parser = module.setup_parser()
    args = parser.parse_args(model_args(tiny_models, name) + common_args(dataset_dir, tmp_path / "eval"))
    models = trainer.load_models(args)
    weights = lora.read_lora_file(str(lora_path))
    network = lora.create_network_from_weights(
        1.0, weights, models.text_encoders, models.unet, trainer.unet_module_names(models)
    )
    network.load_state_dict(weights)
    network.apply_to()
    batch = datasets.build_dataset(args)[0]
    run = train_network.LossContext(
        args, models, noise.training_noise_scheduler(), noise.NoiseOptions.from_args(args),
        losses.LossOptions.from_args(args), nullcontext(), False, torch.device("cpu"),
    )
    results = {}
    with torch.no_grad():
        for multiplier in (0.0, 1.0):
            network.set_multiplier(multiplier)
            draws = []
            for epoch in range(1000, 1016):
                plan = trainer.plan_loss(run, batch, epoch)
                draws.append(losses.normalize(trainer.compute_loss(run, batch, epoch, plan).loss_sum, plan.weight_sum).item())
            results[multiplier] = sum(draws) / len(draws)
    return results


@pytest.mark.device
@pytest.mark.parametrize("name", ["sdxl", "sd15"])
def test_fp16_training_overfits_one_image(name, tiny_models, one_image_dataset, tmp_path):
    """A few dozen fp16 steps with the GradScaler lower the loss on the trained image clearly."""
    output_dir = tmp_path / "out"
    run_trainer(
        SCRIPTS[name][0],
        model_args(tiny_models, name)
        + common_args(
            one_image_dataset, output_dir, "--mixed_precision", "fp16", "--network_dim", "16", "--network_alpha", "16",
            # A random tiny UNet has no path an attention-only LoRA could bend into a denoiser;
            # conv LoRA on the ResNet blocks can, so overfitting is visible within 40 steps.
            "--network_args", "conv_dim=16", "conv_alpha=16", "--learning_rate", "1e-2", "--max_train_steps", "40",
            # the one image encoded once, not at each of the 40 steps by the fp16 VAE (fp16 convolutions on a CPU
            # were most of the run's time); what trains on its latents is the same
            "--grad_norm_log", "--cache_latents",
        ),
    )
    rows = read_log(output_dir / "gradient_logs+last.txt")
    assert len(rows) == 40
    # the scaler was in use at every step (CUDA's fp16 kernels may overflow once and back off)
    assert rows[0]["Scale"] == "65536.0" and all(float(row["Scale"]) >= 2.0**14 for row in rows)
    losses = evaluation_losses(name, tiny_models, one_image_dataset, output_dir / "last.safetensors", tmp_path)
    assert losses[1.0] < 0.6 * losses[0.0], losses


@pytest.mark.device
def test_fp16_gradients_are_scaled_then_unscaled_before_the_step(tiny_models, one_image_dataset, tmp_path):
    """The guard sees scale x gradient; the optimizer sees the unscaled gradient.

    With plain SGD, no clipping and zero-initialised up weights, one step leaves
    ``lora_up = -lr * grad_up`` and the down gradients are zero, so the saved up weights
    reveal the gradient norm the optimizer used.
    """
    learning_rate = 1e-3
    norms = {}
    for unscaled in (False, True):
        output_dir = tmp_path / f"unscaled_{unscaled}"
        extra = ["--grad_norm_unscaled"] if unscaled else []
        run_trainer(
            "sdxl_train_network",
            model_args(tiny_models, "sdxl")
            + common_args(
                one_image_dataset, output_dir, "--mixed_precision", "fp16", "--network_dim", "4",
                "--optimizer_type", "torch.optim.SGD", "--learning_rate", str(learning_rate),
                "--max_grad_norm", "0", "--max_train_steps", "1", "--save_precision", "float",
                "--network_train_unet_only", "--grad_norm_log", *extra,
            ),
        )
        row = read_log(output_dir / "gradient_logs+last.txt")[0]
        norms[unscaled] = (float(row["Gradient Norm"]), float(row["Scale"]))
        if unscaled:
            weights = lora.read_lora_file(str(output_dir / "last.safetensors"))
            up_norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(v) for k, v in weights.items() if "lora_up" in k])
            ).item()
    scaled_norm, scale = norms[False]
    unscaled_norm, _ = norms[True]
    assert scale == 65536.0
    assert scaled_norm == pytest.approx(unscaled_norm * scale, rel=1e-4)
    assert up_norm / learning_rate == pytest.approx(unscaled_norm, rel=1e-3)


@pytest.fixture(scope="module")
def trained_sdxl_lora(tiny_models, demo_dataset, tmp_path_factory) -> Path:
    """An SDXL LoRA (UNet and both text encoders, conv LoRA on) trained a few fp32 steps."""
    output_dir = tmp_path_factory.mktemp("sdxl_lora")
    run_trainer(
        "sdxl_train_network",
        model_args(tiny_models, "sdxl")
        + common_args(
            demo_dataset, output_dir, "--network_dim", "4", "--network_alpha", "2", "--learning_rate", "1e-2",
            "--max_train_steps", "4", "--output_name", "tiny", "--network_args", "conv_dim=2", "conv_alpha=1",
            "--training_comment", "test run",
        ),
    )
    return output_dir / "tiny.safetensors"


def test_sdxl_lora_file_keys_shapes_alpha_and_metadata(trained_sdxl_lora, tiny_models):
    with safe_open(str(trained_sdxl_lora), "pt") as file:
        keys = set(file.keys())
        metadata = file.metadata()
        tensors = {key: file.get_tensor(key) for key in keys}
    attn = "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q"
    assert tensors[f"{attn}.lora_down.weight"].shape == (4, 64)  # tiny SDXL level 1 has 64 channels
    assert tensors[f"{attn}.lora_up.weight"].shape == (64, 4)
    assert tensors[f"{attn}.alpha"].item() == 2.0
    conv = "lora_unet_input_blocks_1_0_in_layers_2"  # down_blocks.0.resnets.0.conv1, a 3x3 conv
    assert tensors[f"{conv}.lora_down.weight"].shape == (2, 32, 3, 3)
    assert tensors[f"{conv}.alpha"].item() == 1.0
    assert tensors["lora_unet_input_blocks_1_0_emb_layers_1.lora_down.weight"].shape == (4, 128)
    assert tensors["lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight"].shape == (4, 32)
    assert tensors["lora_te2_text_model_encoder_layers_0_mlp_fc1.lora_down.weight"].shape == (4, 64)
    assert all(key.startswith(("lora_unet_", "lora_te1_", "lora_te2_")) for key in keys)
    assert all(key.endswith((".lora_down.weight", ".lora_up.weight", ".alpha")) for key in keys)
    assert not any("down_blocks" in key or "up_blocks" in key for key in keys)  # original block names only
    assert any(tensors[k].abs().sum() > 0 for k in keys if k.endswith("lora_up.weight"))  # it trained

    assert metadata["ss_network_module"] == "networks.lora"
    assert metadata["ss_network_dim"] == "4" and metadata["ss_network_alpha"] == "2.0"
    assert json.loads(metadata["ss_network_args"]) == {"conv_dim": "2", "conv_alpha": "1"}
    assert metadata["ss_base_model_version"] == "sdxl_base_v1-0"
    assert metadata["ss_steps"] == "4" and metadata["ss_training_comment"] == "test run"
    assert metadata["modelspec.architecture"] == "stable-diffusion-xl-v1-base/lora"
    assert metadata["modelspec.resolution"] == "64x64"
    assert addnet_hashes(tensors, metadata)["sshs_model_hash"] == metadata["sshs_model_hash"]


def test_lora_file_loads_back_bit_exactly(trained_sdxl_lora, tiny_models):
    trainer = sdxl_train_network.SdxlNetworkTrainer()
    args = sdxl_train_network.setup_parser().parse_args(model_args(tiny_models, "sdxl"))
    models = trainer.load_models(args)
    network = lora.create_network(
        1.0, 4, 2.0, None, models.text_encoders, models.unet,
        unet_module_names=trainer.unet_module_names(models), conv_dim="2", conv_alpha="1",
    )
    network.load_weights(str(trained_sdxl_lora))
    saved = lora.read_lora_file(str(trained_sdxl_lora))
    reloaded = network.lora_state_dict()
    assert reloaded.keys() == saved.keys()
    assert all(torch.equal(reloaded[key], saved[key]) for key in saved)


def test_sd1_lora_uses_kohya_diffusers_style_names(tiny_models, demo_dataset, tmp_path):
    run_trainer(
        "train_network",
        model_args(tiny_models, "sd15") + common_args(demo_dataset, tmp_path, "--max_train_steps", "1"),
    )
    with safe_open(str(tmp_path / "last.safetensors"), "pt") as file:
        keys = set(file.keys())
        metadata = file.metadata()
    assert "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight" in keys
    assert "lora_unet_mid_block_attentions_0_proj_in.alpha" in keys
    assert "lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight" in keys
    assert all(key.startswith(("lora_unet_", "lora_te_")) for key in keys)
    assert metadata["modelspec.architecture"] == "stable-diffusion-v1/lora"


def test_saved_lora_is_accepted_by_diffusers_and_changes_the_image(trained_sdxl_lora, tiny_models):
    """diffusers' own kohya loader puts exactly our weights into every targeted module."""
    from diffusers import StableDiffusionXLPipeline

    from library.checkpoint_keys import unet_module_name_map

    pipe = StableDiffusionXLPipeline.from_pretrained(str(tiny_models["sdxl"]), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)

    def render():
        generator = torch.Generator("cpu").manual_seed(0)
        return pipe("a red circle", num_inference_steps=2, height=64, width=64, generator=generator,
                    output_type="np").images[0]

    before = render()
    pipe.load_lora_weights(str(trained_sdxl_lora))
    after = render()
    assert abs(after - before).max() > 1e-4

    saved = lora.read_lora_file(str(trained_sdxl_lora))
    original_names = unet_module_name_map(pipe.unet.config)
    received = {}
    for prefix, model, rename in (
        ("lora_unet_", pipe.unet, original_names.__getitem__),
        ("lora_te1_", pipe.text_encoder, lambda path: path if path.startswith("text_model.") else f"text_model.{path}"),
        ("lora_te2_", pipe.text_encoder_2, lambda path: path),
    ):
        for path, module in model.named_modules():
            if hasattr(module, "lora_A") and "default_0" in module.lora_A:
                received[prefix + rename(path).replace(".", "_")] = module
    expected = {key.partition(".")[0] for key in saved}
    assert set(received) == expected
    for name, module in received.items():
        down, up, alpha = saved[f"{name}.lora_down.weight"], saved[f"{name}.lora_up.weight"], saved[f"{name}.alpha"]
        assert torch.equal(module.lora_A["default_0"].weight.data, down)
        assert torch.equal(module.lora_B["default_0"].weight.data, up)
        assert module.scaling["default_0"] == pytest.approx(alpha.item() / down.shape[0])


def test_sd1_from_diffusers_folder_with_vae_override_and_sd2_v_prediction(tiny_models, demo_dataset, tmp_path):
    run_trainer(
        "train_network",
        ["--pretrained_model_name_or_path", str(tiny_models["sd15"]), "--vae", str(Path(tiny_models["sd15"]) / "vae"),
         "--no_half_vae", "--mixed_precision", "fp16"]
        + common_args(demo_dataset, tmp_path / "sd15", "--max_train_steps", "2"),
    )
    run_trainer(
        "train_network",
        model_args(tiny_models, "sd2") + ["--v2", "--v_parameterization"]
        + common_args(demo_dataset, tmp_path / "sd2", "--max_train_steps", "2"),
    )
    with safe_open(str(tmp_path / "sd2" / "last.safetensors"), "pt") as file:
        metadata = file.metadata()
    assert metadata["ss_v2"] == "True" and metadata["modelspec.prediction_type"] == "v"
    assert metadata["modelspec.architecture"] == "stable-diffusion-v2-768-v/lora"
    assert (tmp_path / "sd15" / "last.safetensors").is_file()
