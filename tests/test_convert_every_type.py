"""networks/convert_to_lora.py on every network type, SD 1.5 and SDXL: the errors it prints are those of the file it
writes (recomputed here from the original and the written file with this file's own code: weights with bias
changes and norm layers, and the layers' outputs on the documented probe inputs), and the converted file is read
back by our own loader (the trainer's --network_weights --dim_from_weights) and merge tool (merge_lora.py).

CI converts every type once, on SD 1.5 or SDXL (each kind gets types of every family; LyCORIS Full on both),
so the suite stays short; ``pytest --full_matrix`` runs every type on both kinds."""
from __future__ import annotations

import math
import re
import zlib

import pytest
import torch
import torch.nn.functional as F
from conftest import cast_models, full_matrix
from test_convert_to_lora import random_network_file

import sdxl_train_network
import train_network
from library import checkpoint_keys, model_loading
from library.trainables.lora import LoraConfig, create_network
from networks import convert_to_lora, merge_lora, network_base, registry

LABELS = list(registry.EXAMPLE_NETWORKS)
# The (type, kind) cases CI runs: each type once, the kinds alternating over the families (LoRA, LoHa, LoKr,
# OFT, ...), LyCORIS Full (bias changes, norm layers, modules outside kohya's blocks) on both.
SDXL_CASES = ("networks.lora (LoCon)", "networks.lora_fa", "networks.lokr", "lycoris locon", "lycoris loha",
              "lycoris glora", "lycoris diag-oft", "lycoris full")
CASES = [(label, kind) for label in LABELS for kind in ("sd15", "sdxl")
         if full_matrix() or (kind == "sdxl") == (label in SDXL_CASES) or label == "lycoris full"]
PRINT_ROUNDING = 1e-6  # the converter prints 6 significant digits of numbers below 1 (the bound)


def load(tiny_models, kind: str):
    return model_loading.load_models(tiny_models[f"{kind}_file"], sdxl=kind == "sdxl",
                                     model_config_dir=tiny_models[f"{kind}_config"])


def random_type_file(models, label: str, path) -> None:
    """The type's network with random weights (every module changes its layer; Full's biases too), saved."""
    module, _, _ = registry.EXAMPLE_NETWORKS[label]
    random_network_file(models, module, registry.example_network_args(label, 2), path)


def network_changes(network, lora, layer) -> dict[str, torch.Tensor]:
    """The network's change of the layer's parameters at multiplier 1, float64 (the models are float64; code
    that only computes in float32, as lycoris' OFT rotations, in float32)."""
    base = {name: value.detach().clone() for name, value in layer.named_parameters(recurse=False)}
    try:
        merged = network.merged_parameters(lora, 1.0)
    except RuntimeError:
        layer.float(), lora.float()
        merged = network.merged_parameters(lora, 1.0)
        layer.double(), lora.double()
    return {name: merged[name].double() - base[name] for name in merged}


def written_change(weights, name: str, shape) -> torch.Tensor | None:
    if f"{name}.lora_down.weight" not in weights:
        return None
    down, up = weights[f"{name}.lora_down.weight"].double(), weights[f"{name}.lora_up.weight"].double()
    alpha = float(weights[f"{name}.alpha"])
    return (up.flatten(1) @ down.flatten(1)).reshape(shape) * alpha / down.shape[0]


def probe(layer, name: str) -> torch.Tensor:
    """The converter's documented probe: 4 standard normal samples, 8x8 pixels for convs and GroupNorms, from a
    generator seeded with the CRC-32 of the module's key prefix."""
    if isinstance(layer, torch.nn.Linear):
        shape = (layer.in_features,)
    elif isinstance(layer, torch.nn.LayerNorm):
        shape = tuple(layer.normalized_shape)
    else:
        shape = (layer.weight.shape[1] if isinstance(layer, torch.nn.Conv2d) else layer.num_channels, 8, 8)
    return torch.randn((4, *shape), generator=torch.Generator().manual_seed(zlib.crc32(name.encode())),
                       dtype=torch.float64)


def response(layer, weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if isinstance(layer, torch.nn.Linear):
        return F.linear(x, weight, bias)
    if isinstance(layer, torch.nn.Conv2d):
        return F.conv2d(x, weight, bias, layer.stride, layer.padding, layer.dilation, layer.groups)
    if isinstance(layer, torch.nn.GroupNorm):
        return F.group_norm(x, layer.num_groups, weight, bias, layer.eps)
    return F.layer_norm(x, layer.normalized_shape, weight, bias, layer.eps)


def printed_errors(output: str) -> tuple[dict[str, tuple[float, float]], tuple[float, float]]:
    """Per module (weights, output) and overall (weights, output) as the converter printed them."""
    modules = {name: (float(weights), float(out)) for name, weights, out in
               re.findall(r"^(\S+): rank \d+, relative error: weights (\S+), output ([^\s,]+)", output, re.M)}
    modules.update({name: (1.0, 1.0) for name in re.findall(r"^(\S+): a \w+ \(norm layer\): not written", output, re.M)})
    overall = re.search(r"weights (\S+), output on the probe inputs (\S+);", output)
    return modules, (float(overall.group(1)), float(overall.group(2)))


def trainer_loads(tiny_models, kind: str, path, models) -> network_base.AdapterNetwork:
    """What ``--network_module networks.lora --network_weights PATH --dim_from_weights`` builds in the trainer
    on ``models`` (not applied: the models are unchanged)."""
    script, trainer = ((sdxl_train_network, sdxl_train_network.SdxlNetworkTrainer) if kind == "sdxl"
                       else (train_network, train_network.NetworkTrainer))
    args = script.setup_parser().parse_args([
        "--pretrained_model_name_or_path", str(tiny_models[f"{kind}_file"]), "--model_config_dir",
        str(tiny_models[f"{kind}_config"]), "--output_dir", "unused", "--network_module", "networks.lora",
        "--network_weights", str(path), "--dim_from_weights"])
    return create_network(LoraConfig.from_args(args), models, trainer().unet_module_names(models))


@pytest.mark.slow
@pytest.mark.parametrize(("label", "kind"), CASES)
def test_printed_error_is_the_written_files_and_our_tools_read_it(label, kind, tiny_models, tmp_path, capsys):
    models = load(tiny_models, kind)
    source, converted = tmp_path / "net.safetensors", tmp_path / "lora.safetensors"
    random_type_file(models, label, source)
    capsys.readouterr()
    convert_to_lora.main(["--sd_model", str(tiny_models[f"{kind}_file"]), "--model_config_dir",
                          str(tiny_models[f"{kind}_config"]), "--model", str(source), "--save_to", str(converted),
                          "--dim", "3", "--conv_dim", "2"])  # below full rank: real errors
    output = capsys.readouterr().out
    printed, printed_overall = printed_errors(output)

    # the same numbers, measured independently on the two files
    cast_models(models, torch.float64)
    names = checkpoint_keys.unet_module_name_map(models.unet.config) if models.is_sdxl else None
    network = registry.network_from_file(str(source), models.text_encoders, models.unet, names, "--model").double()
    network.eval()
    weights = network_base.read_lora_file(str(converted))
    totals = dict(change=0.0, missed=0.0, effect=0.0, output_missed=0.0)
    biased = 0
    for lora in network.all_loras():
        layer = network.wrapped_module(lora)
        name = convert_to_lora.lora_name(lora.lora_name)
        change = network_changes(network, lora, layer)
        written = written_change(weights, name, layer.weight.shape)
        missed = dict(change)
        if written is not None:
            missed["weight"] = change["weight"] - written
        biased += written is not None and "bias" in change and bool(change["bias"].any())
        x = probe(layer, lora.lora_name)
        no_bias = torch.zeros(layer.weight.shape[0], dtype=torch.float64)
        effect = response(layer, change["weight"], change.get("bias", no_bias), x)
        output_missed = response(layer, missed["weight"], missed.get("bias", no_bias), x)
        squares = dict(change=sum(float(v.pow(2).sum()) for v in change.values()),
                       missed=sum(float(v.pow(2).sum()) for v in missed.values()),
                       effect=float(effect.pow(2).sum()), output_missed=float(output_missed.pow(2).sum()))
        for key, value in squares.items():
            totals[key] += value
        measured = (math.sqrt(squares["missed"] / squares["change"]), math.sqrt(squares["output_missed"] / squares["effect"]))
        assert printed[name] == pytest.approx(measured, abs=PRINT_ROUNDING), name
    assert len(printed) == len(network.all_loras())
    measured_overall = (math.sqrt(totals["missed"] / totals["change"]),
                        math.sqrt(totals["output_missed"] / totals["effect"]))
    assert printed_overall == pytest.approx(measured_overall, abs=PRINT_ROUNDING)
    assert 0.01 < measured_overall[1] < 1  # rank 3 of random changes: not only rounding
    if biased:  # LyCORIS Full: the bias changes a LoRA cannot hold are counted and said
        assert f"a LoRA cannot hold bias changes: {biased} module(s)" in output
    loaders = convert_to_lora.loaders_applying(network)
    assert loaders == convert_to_lora.APPLIED_AS_WRITTEN.get(registry.EXAMPLE_NETWORKS[label][0], loaders)
    if loaders:
        assert f"give {' and '.join(loaders)} the original" in output

    # our loader and merge tool read every module the converter wrote
    modules = network_base.group_by_module(weights)
    if kind == "sd15" and label == "lycoris full":  # the case: outside kohya's target blocks
        assert {"lora_unet_conv_in", "lora_unet_conv_out", "lora_unet_time_embedding_linear_1"} <= set(modules)
    # (merge_lora.py's main merges with merge_into_models; its command line and saving: test_merge_lora.py)
    base = load(tiny_models, kind)
    loaded = trainer_loads(tiny_models, kind, converted, base)
    assert {lora.lora_name for lora in loaded.all_loras()} == set(modules)
    assert merge_lora.merge_into_models(base, [str(converted)], [1.0]) == len(modules)
