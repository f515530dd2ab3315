"""networks/convert_to_lora.py: any network type as a plain kohya LoRA/LoCon, checked with diffusers' own
loader (load_lora_weights + fuse_lora): every module is applied and its fused change is the network's
change within the error the converter reports."""
from __future__ import annotations

import json
import math
import re

import pytest
import torch

from library import checkpoint_keys, model_loading
from library.errors import UserError
from networks import convert_to_lora, network_base, registry, resize_lora

# The types diffusers refuses as written (docs/network_types.md, "Which loaders read which file")
TYPES = {
    "loha": ("networks.loha", ["conv_dim=2", "conv_alpha=1"]),
    "lokr": ("networks.lokr", ["conv_dim=2"]),
    "oft": ("networks.oft", ["enable_conv=True"]),
    "ia3": ("lycoris.kohya", ["algo=ia3", "train_on_input=True"]),
}
EPS32 = torch.finfo(torch.float32).eps


def random_network_file(models, module: str, args: list[str], path) -> None:
    """A network of the type with random weights (so that every module changes its layer), saved to ``path``."""
    names = checkpoint_keys.unet_module_name_map(models.unet.config) if models.is_sdxl else None
    network_args = network_base.parse_network_args(args)
    network = registry.network_type(module).create_network(1.0, 4, 1.0, None, models.text_encoders, models.unet,
                                                           unet_module_names=names, **network_args)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in network.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    network_base.save_lora_file(network.lora_state_dict(), str(path), {
        "ss_network_module": module, "ss_network_args": json.dumps(network_args)})


def pipeline(folder, is_sdxl: bool):
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    return (StableDiffusionXLPipeline if is_sdxl else StableDiffusionPipeline).from_pretrained(
        folder, local_files_only=True)


@pytest.mark.parametrize("kind", ["sdxl", "sd15"])
@pytest.mark.parametrize("network_type", TYPES)
def test_diffusers_applies_the_converted_file_within_the_reported_error(network_type, kind, tiny_models, tmp_path):
    module, args = TYPES[network_type]
    folder = tiny_models[kind]
    models = model_loading.load_models(folder, sdxl=kind == "sdxl")
    source, converted = tmp_path / "net.safetensors", tmp_path / "lora.safetensors"
    random_network_file(models, module, args, source)
    pipe = pipeline(folder, models.is_sdxl)
    with pytest.raises(ValueError):  # as written, diffusers' loader refuses the type
        pipe.load_lora_weights(str(source))

    network = convert_to_lora.load_network(models, str(source))
    conversion = convert_to_lora.convert_network(network, dim=3, conv_dim=2)  # below full rank: real errors
    network_base.save_lora_file(conversion.weights, str(converted), {})
    pipe = pipeline(folder, models.is_sdxl)
    pipe.load_lora_weights(str(converted))
    pipe.fuse_lora(lora_scale=1.0)

    theirs = {"unet": dict(pipe.unet.named_modules()), "te0": dict(pipe.text_encoder.named_modules())}
    ours = {"unet": models.unet, "te0": models.text_encoders[0]}
    if models.is_sdxl:
        theirs["te1"], ours["te1"] = dict(pipe.text_encoder_2.named_modules()), models.text_encoders[1]
    where = {id(layer): (part, path) for part, model in ours.items() for path, layer in model.named_modules()}
    reported = {result.name: result for result in conversion.modules}
    assert len(reported) == len(network.all_loras())
    errors = []
    for lora in network.all_loras():
        layer = network.wrapped_module(lora)
        part, path = where[id(layer)]
        fused = getattr(theirs[part][path], "base_layer", theirs[part][path]).weight.detach().double()
        change = convert_to_lora.parameter_changes(network, lora, layer)["weight"]
        result = reported[convert_to_lora.lora_name(lora.lora_name)]
        name = convert_to_lora.lora_name(lora.lora_name)
        down, up = conversion.weights[f"{name}.lora_down.weight"], conversion.weights[f"{name}.lora_up.weight"]
        scale = float(conversion.weights[f"{name}.alpha"]) / result.rank
        # float32: the saved factors, their product (rank terms) and the sum with the weight each round once
        rounding = 2 * EPS32 * (layer.weight.detach().double().norm() + change.norm()
                                + result.rank * up.double().norm() * down.double().norm() * scale)
        difference = float((fused - layer.weight.detach().double() - change).norm())
        assert difference <= result.relative_error * float(change.norm()) + float(rounding), name
        errors.append(result.relative_error)
    assert max(errors) > 0.05  # rank 3 of random changes: the check above is not only rounding
    assert 0 < conversion.overall_error < 1


def test_max_error_picks_the_smallest_rank_and_the_cli_reports(tiny_models, tmp_path, capsys):
    models = model_loading.load_models(tiny_models["sd15_file"], sdxl=False,
                                       model_config_dir=tiny_models["sd15_config"])
    source = tmp_path / "net.safetensors"
    random_network_file(models, "networks.loha", ["conv_dim=2"], source)
    network = convert_to_lora.load_network(models, str(source))
    full = convert_to_lora.convert_network(network, dim=64)
    assert full.overall_error < 1e-6  # full rank reproduces every change
    chosen = convert_to_lora.convert_network(network, dim=64, max_error=0.3).modules
    assert len({result.rank for result in chosen}) > 1  # ranks differ by module
    for lora, result in zip(network.all_loras(), chosen):
        assert result.relative_error <= 0.3
        if result.rank > 1:  # one rank less would not do
            change = convert_to_lora.parameter_changes(network, lora, network.wrapped_module(lora))["weight"]
            assert resize_lora.low_rank_module(change, result.rank - 1, None, None)[2] > 0.3

    out = tmp_path / "lora.safetensors"
    convert_to_lora.main(["--sd_model", str(tiny_models["sd15_file"]), "--model_config_dir",
                          str(tiny_models["sd15_config"]), "--model", str(source), "--save_to", str(out),
                          "--dim", "2", "--max_error", "0.2"])
    printed = capsys.readouterr().out
    overall = float(re.search(r"weights (\S+), output on the probe inputs", printed).group(1))
    assert "stay above --max_error 0.2 at the highest rank allowed" in printed
    weights = network_base.read_lora_file(str(out))
    metadata = network_base.read_lora_metadata(str(out))
    assert metadata["ss_network_module"] == "networks.lora" and "networks.loha" in metadata["ss_training_comment"]
    assert registry.file_network_module(weights, metadata, "out") == "networks.lora"
    assert {float(value) for key, value in weights.items() if key.endswith(".alpha")} == {2.0}  # one alpha
    assert math.isclose(overall, convert_to_lora.convert_network(network, 2, max_error=0.2).overall_error,
                        rel_tol=1e-2)
    with pytest.raises(UserError, match="--max_error 1.5"):
        convert_to_lora.main(["--sd_model", "x", "--model", str(source), "--save_to", str(out), "--max_error", "1.5"])
