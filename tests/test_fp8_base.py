"""--fp8_base / --fp8_base_unet: frozen Linear/Conv2d weights stored as float8, upcast layer by layer."""
from __future__ import annotations

import argparse
import copy
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import model_args, run_trainer, train_expecting_user_error
from safetensors import safe_open
from torch.utils.checkpoint import checkpoint

import sdxl_train_network
from library import fp8_base, model_loading
from networks import lora, oft

FLOAT8 = torch.float8_e4m3fn
PRECISIONS = {"fp16": torch.float16, "bf16": torch.bfloat16}


def stored_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [module for module in model.modules() if fp8_base.is_stored_in_float8(module, "weight")]


def scaled_float8(weight: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``weight`` as float8 of ``weight / scale`` with the per-tensor scale ``amax / 448``, and that scale."""
    scale = float(weight.detach().abs().max() / 448)
    return (weight / scale).to(FLOAT8), scale


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.Conv2d(8, 8, 1, bias=False),
                               torch.nn.Flatten(2), torch.nn.Linear(25, 16), torch.nn.Linear(16, 16))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("scale", [1.0, 0.0123, 3.7e-5, 2.5, 300.0])
def test_upcast_equals_torchs_float8_conversion_bit_for_bit(precision, scale):
    """Every finite float8 value times the layer's scale, as the layer computes with it (the CPU
    rearranges bits instead of calling torch's scalar conversion) equals the plain cast and multiply."""
    compute_dtype = PRECISIONS[precision]
    codes = torch.arange(256, dtype=torch.uint8).view(FLOAT8)
    layer = torch.nn.Linear(len(codes), 1, bias=False)
    layer.weight = torch.nn.Parameter(codes[~codes.float().isnan()].reshape(1, -1), requires_grad=False)
    layer.float8_scale = scale
    expected = layer.weight.to(compute_dtype).mul_(scale)
    upcast = fp8_base.frozen_weight(layer, compute_dtype)
    assert upcast.dtype == compute_dtype and torch.equal(upcast.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("checkpointed", [False, True])
def test_stored_layers_compute_like_their_rounded_weights(precision, checkpointed):
    """Outputs and gradients (input and a float32 LoRA around a stored layer) equal those of the
    same layers holding the scaled-float8-rounded weights in the compute dtype, with and without
    gradient checkpointing; the stored weights are float8, everything else the compute dtype."""
    compute_dtype = PRECISIONS[precision]
    model, reference = small_model(), small_model()
    with torch.no_grad():
        for layer in stored_layers(reference):
            stored, scale = scaled_float8(layer.weight)
            layer.weight.copy_(stored.float() * scale)
    assert fp8_base.store_in_float8(model, compute_dtype) == 4
    fp8_base.move(model, torch.device("cpu"), compute_dtype)
    reference.requires_grad_(False).to(compute_dtype)
    assert [p.dtype for p in model.parameters()] == [FLOAT8, compute_dtype, FLOAT8, FLOAT8, compute_dtype, FLOAT8,
                                                     compute_dtype]
    adapters = []
    for network_model in (model, reference):  # the network wraps the layer after it is stored
        adapter = lora.LoRAModule("lora_unet_3", network_model[3], 1.0, 2, 2.0)
        torch.nn.init.normal_(adapter.lora_up.weight)
        adapter.apply_to()
        adapters.append(adapter)
    adapters[1].load_state_dict(adapters[0].state_dict())

    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    results = []
    for network_model, adapter in zip((model, reference), adapters):
        inputs = x.detach().clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=compute_dtype):
            output = checkpoint(network_model, inputs, use_reentrant=False) if checkpointed else network_model(inputs)
        output.float().square().sum().backward()
        results.append((output, inputs.grad, adapter.lora_down.weight.grad))
    (output, input_grad, lora_grad), (expected, expected_input_grad, expected_lora_grad) = results
    assert output.dtype == compute_dtype and torch.equal(output, expected)
    assert input_grad.dtype == torch.float32 and torch.equal(input_grad, expected_input_grad)
    assert lora_grad.dtype == torch.float32 and lora_grad.abs().sum() > 0 and torch.equal(lora_grad, expected_lora_grad)


def test_backward_keeps_the_float8_weight_not_an_upcast_copy():
    """What autograd keeps for a stored layer's backward is its float8 weight: no compute-dtype copy
    of the weight outlives the layer call (a plain bf16 layer keeps its bf16 weight)."""
    def saved_while(layer: torch.nn.Module) -> list[tuple[torch.dtype, tuple[int, ...]]]:
        saved = []

        def pack(tensor):
            saved.append((tensor.dtype, tuple(tensor.shape)))
            return tensor

        x = torch.randn(3, 64, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                layer(x).sum().backward()
        return saved

    torch.manual_seed(0)
    plain = torch.nn.Linear(64, 32).requires_grad_(False).to(torch.bfloat16)
    stored = copy.deepcopy(plain)
    fp8_base.store_in_float8(stored, torch.bfloat16)
    weight_shape = (32, 64)
    assert any(dtype == torch.bfloat16 and sorted(shape) == [32, 64] for dtype, shape in saved_while(plain))
    kept = saved_while(stored)
    assert (FLOAT8, weight_shape) in kept
    assert not any(dtype != FLOAT8 and sorted(shape) == [32, 64] for dtype, shape in kept)


@pytest.mark.parametrize("source", ["sdxl_file", "sdxl"])
def test_weights_are_read_straight_into_float8(tiny_models, source):
    """With the loading rule of --fp8_base the stored weights come out of the loader in float8 with
    their scale (the same as float32 loading then scaling and casting); biases, norms, embeddings
    and the VAE stay float32."""
    config = {"model_config_dir": tiny_models["sdxl_config"]} if source.endswith("_file") else {}
    plain = model_loading.load_models(tiny_models[source], sdxl=True, **config)
    args = argparse.Namespace(fp8_base=True, fp8_base_unet=False, base_weights=None)
    stored = model_loading.load_models(tiny_models[source], sdxl=True, stored_as=fp8_base.stored_as_rule(args),
                                       **config)
    for plain_model, stored_model in zip([plain.unet, *plain.text_encoders, plain.vae],
                                         [stored.unet, *stored.text_encoders, stored.vae]):
        is_vae = stored_model is stored.vae
        for (name, expected), (_, value) in zip(plain_model.named_parameters(), stored_model.named_parameters()):
            module = stored_model.get_submodule(name.rpartition(".")[0])
            float8 = not is_vae and fp8_base.is_stored_in_float8(module, name.rpartition(".")[2])
            assert value.dtype == (FLOAT8 if float8 else torch.float32), name
            if float8:
                expected, scale = scaled_float8(expected)
                assert module.float8_scale == scale, name
            assert torch.equal(value, expected), name
    assert stored_layers(stored.unet) and stored_layers(stored.text_encoders[1])


def test_small_weights_keep_their_precision():
    """Weights of std 0.004 (SD layers have such; below float8's normal range, 2^-6) stay within a
    few percent through the scaled float8 layer and through what reads the stored weight (a LoRA's
    merge, OFT's rotation), where a plain float8 cast loses about 14%; an all-zero weight gets
    scale 1 (not 0 or NaN)."""
    torch.manual_seed(0)
    layer = torch.nn.Conv2d(64, 64, 3)
    torch.nn.init.normal_(layer.weight, std=0.004)
    weight = layer.weight.detach().clone()
    x = torch.randn(2, 64, 8, 8)
    expected = torch.nn.functional.conv2d(x, weight, layer.bias).detach()

    def error(output: torch.Tensor) -> float:
        return float((output.detach().float() - expected).norm() / expected.norm())

    plain = torch.nn.functional.conv2d(x, weight.to(FLOAT8).float(), layer.bias)
    assert error(plain) > 0.10
    fp8_base.store_in_float8(layer, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert error(layer(x)) < 0.07
    adapter = lora.LoRAModule("lora_unet_conv", layer, 1.0, 2, 2.0)  # lora_up starts at zero
    merged = adapter.merged_parameters(1.0)["weight"]
    assert error(torch.nn.functional.conv2d(x, merged, layer.bias)) < 0.07
    rotation = oft.OFTModule("oft_unet_conv", layer, 1.0, 4, 1.0)  # no rotation yet
    rotation.apply_to()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert error(layer(x)) < 0.07

    zero = torch.nn.Linear(4, 4)
    torch.nn.init.zeros_(zero.weight)
    fp8_base.store_in_float8(zero, torch.bfloat16)
    assert zero.float8_scale == 1.0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(zero(torch.ones(1, 4)).float(), zero.bias.detach()[None].bfloat16().float())


def training_args(tiny_models, dataset: Path, output_dir: Path, *extra: str) -> list[str]:
    return model_args(tiny_models, "sdxl") + [
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output_dir), "--output_name", "run", "--seed", "5", "--max_data_loader_n_workers", "0",
        "--network_dim", "4", "--network_alpha", "4", "--learning_rate", "1e-2", "--max_train_steps", "2", *extra,
    ]


@pytest.fixture
def observed_steps(monkeypatch) -> list[dict]:
    """What the models hold while training: recorded after each step's backward (the trainer unchanged)."""
    steps: list[dict] = []
    original = sdxl_train_network.SdxlNetworkTrainer.backward_window

    def backward_window(self, run, *args, **kwargs):
        loss = original(self, run, *args, **kwargs)
        models = run.models

        def dtypes(model, stored: bool) -> set[torch.dtype]:
            return {p.dtype for module in model.modules() for name, p in module.named_parameters(recurse=False)
                    if fp8_base.is_stored_in_float8(module, name) == stored}

        steps.append({
            "loss": float(loss),
            "unet": (dtypes(models.unet, True), dtypes(models.unet, False)),
            "text_encoders": [(dtypes(te, True), dtypes(te, False)) for te in models.text_encoders],
            "vae": {p.dtype for p in models.vae.parameters()} if models.vae is not None else set(),
        })
        return loss

    monkeypatch.setattr(sdxl_train_network.SdxlNetworkTrainer, "backward_window", backward_window)
    return steps


@pytest.mark.device
@pytest.mark.parametrize("flag,precision", [("--fp8_base", "bf16"), ("--fp8_base", "fp16"),
                                            ("--fp8_base_unet", "bf16")])
def test_training_with_float8_base_weights(flag, precision, tiny_models, one_image_dataset, tmp_path,
                                           observed_steps):
    """The frozen weights are float8 during training (text encoders too with --fp8_base only), the
    loss is finite, the float32 LoRA of UNet and text encoders moves, and the file is a normal
    float32 kohya LoRA with ss_fp8_base* metadata; sampling runs through the float8 layers."""
    compute_dtype = PRECISIONS[precision]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle --w 64 --h 64 --s 1 --d 7\n")
    output_dir = tmp_path / "out"
    run_trainer("sdxl_train_network", training_args(
        tiny_models, one_image_dataset, output_dir, flag, "--mixed_precision", precision,
        "--sample_prompts", str(prompts), "--sample_at_first", "--gradient_checkpointing"))

    assert len(observed_steps) == 2
    text_encoders_float8 = flag == "--fp8_base"
    for step in observed_steps:
        assert np.isfinite(step["loss"])
        assert step["unet"] == ({FLOAT8}, {compute_dtype})
        expected_te = ({FLOAT8}, {compute_dtype}) if text_encoders_float8 else ({compute_dtype}, {compute_dtype})
        assert step["text_encoders"] == [expected_te, expected_te]
        assert step["vae"] == {compute_dtype}
    assert len(list((output_dir / "sample").glob("run_000000_00_*_7.png"))) == 1

    saved = lora.read_lora_file(str(output_dir / "run.safetensors"))
    assert {value.dtype for value in saved.values()} == {torch.float32}
    for prefix in ("lora_unet_", "lora_te1_", "lora_te2_"):
        ups = [value for key, value in saved.items() if key.startswith(prefix) and key.endswith("lora_up.weight")]
        assert ups and all(torch.isfinite(up).all() for up in ups)
        assert any(up.abs().sum() > 0 for up in ups), prefix  # lora_up starts at zero
    with safe_open(str(output_dir / "run.safetensors"), framework="pt") as file:
        metadata = file.metadata()
    assert (metadata["ss_fp8_base"], metadata["ss_fp8_base_unet"]) == (
        str(flag == "--fp8_base"), str(flag == "--fp8_base_unet"))
    fresh = model_loading.load_models(tiny_models["sdxl_file"], sdxl=True, model_config_dir=tiny_models["sdxl_config"])
    network = lora.create_network_from_weights(1.0, saved, fresh.text_encoders, fresh.unet,
                                               sdxl_train_network.SdxlNetworkTrainer().unet_module_names(fresh))
    network.load_state_dict(saved, strict=True)


def test_cached_text_encoder_outputs_are_the_same_with_fp8_base(tiny_models, one_image_dataset, tmp_path,
                                                                observed_steps):
    """With cached outputs the text encoders keep the compute dtype: the cache written without
    --fp8_base is the one --fp8_base finds and uses; the UNet is float8 all the same."""
    dataset = tmp_path / "dataset"
    shutil.copytree(one_image_dataset, dataset)
    options = ("--mixed_precision", "bf16", "--network_train_unet_only", "--cache_text_encoder_outputs_to_disk",
               "--max_train_steps", "1")
    run_trainer("sdxl_train_network", training_args(tiny_models, dataset, tmp_path / "plain", *options))
    (cache,) = dataset.rglob("*_te_outputs.npz")
    written = cache.read_bytes()
    run_trainer("sdxl_train_network", training_args(tiny_models, dataset, tmp_path / "fp8", *options, "--fp8_base"))
    assert cache.read_bytes() == written
    assert observed_steps[-1]["unet"] == ({FLOAT8}, {torch.bfloat16})


@pytest.mark.parametrize("flag", ["--fp8_base", "--fp8_base_unet"])
def test_fp8_base_needs_mixed_precision(flag, tiny_models, one_image_dataset, tmp_path, capsys):
    error = train_expecting_user_error(training_args(tiny_models, one_image_dataset, tmp_path / "out", flag), capsys)
    assert f"{flag} needs --mixed_precision fp16 or bf16 (got no)" in error
    assert not (tmp_path / "out").exists()


def test_lycoris_needs_bypass_mode_with_fp8_base(tiny_models, one_image_dataset, tmp_path, capsys):
    """LyCORIS outside bypass mode adds its change to the frozen weight itself: refused before loading."""
    argv = training_args(tiny_models, one_image_dataset, tmp_path / "out", "--fp8_base", "--mixed_precision", "bf16",
                         "--network_module", "lycoris.kohya", "--network_args", "algo=loha")
    error = train_expecting_user_error(argv, capsys)
    assert "--fp8_base with --network_module lycoris.kohya algo=loha" in error and "bypass_mode=True" in error
    run_trainer("sdxl_train_network", argv + ["bypass_mode=True"])
    assert (tmp_path / "out" / "run.safetensors").is_file()
