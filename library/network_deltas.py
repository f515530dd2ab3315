"""The weight change every module of several network files makes, module by module, for tools that
combine files of any type (``networks.registry``: LoRA, LoCon, DyLoRA, LoRA-FA, LoHa, LoKr, OFT, LyCORIS).

Each file's network is rebuilt by the trainers' own code on a model and its change of a layer is
``merged weight - weight`` at multiplier 1 (``networks.convert_to_lora.parameter_changes``, float64).
The model is either the real base model (``--sd_model``) or, as kohya's LoRA-file tools need none, an
empty one: the architecture of the files' model kind (the shipped config, or ``--model_config_dir``)
on the meta device, each layer made real and zero only while its changes are computed, so memory
stays at the networks plus one layer. A change measured on a zero weight is right only for types
whose change does not depend on the weight; every module is therefore measured on a random weight
too, and a module whose change differs (OFT, iA3, GLoRA, DoRA) is refused with a line asking for
``--sd_model``. Files of another model kind than the first, or holding NaN/Inf, are refused before
anything is built.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Optional, Sequence

import torch

from library import checkpoint_keys, model_loading
from library.checkpoint_keys import ModelKind
from library.errors import UserError
from networks import convert_to_lora, merge_lora, network_base, registry

SDXL_NAME_PARTS = ("_te1_", "_te2_", "unet_input_blocks_", "unet_middle_block_", "unet_output_blocks_")
SD_NAME_PARTS = ("_te_text_model_", "unet_down_blocks_", "unet_mid_block_", "unet_up_blocks_")
KIND_NAMES = {"sdxl": "SDXL", "sd1": "SD1.x", "sd2": "SD2.x"}
SD1_TEXT_ENCODER_LAYERS = 12  # SD2's OpenCLIP has 23: a module in layer 12 or above is SD2's

# A change measured on a random weight may differ from the one on a zero weight by float64 rounding of
# the weight (|W| ~ 1/sqrt(fan_in)) and of the change; base-dependent types differ by O(|change|).
BASE_INDEPENDENCE_RTOL = 1e-6


def file_model_kind(weights: Mapping[str, torch.Tensor], metadata: Mapping[str, str], source: str) -> ModelKind:
    """The model a network file is for: SDXL from its module names (kohya's original-layout UNet names,
    ``te1``/``te2``), SD2 from ``ss_v2``/``ss_base_model_version`` or a text-encoder layer beyond SD1's 12,
    else SD1. UserError naming ``source`` when the names fit neither."""
    names = {key.partition(".")[0] for key in weights}
    is_sdxl = any(part in name for name in names for part in SDXL_NAME_PARTS)
    is_sd = any(part in name for name in names for part in SD_NAME_PARTS)
    if is_sdxl == is_sd:
        version = metadata.get("ss_base_model_version", "")
        if version.startswith("sdxl"):
            return "sdxl"
        raise UserError(f"{source}: cannot tell which model it is for (modules like {sorted(names)[:1]}); "
                        f"not a kohya-named SD1.x/2.x or SDXL network file")
    if is_sdxl:
        return "sdxl"
    version = metadata.get("ss_base_model_version", "")
    if metadata.get("ss_v2") == "True" or version.startswith(("sd_v2", "sd_2")):
        return "sd2"
    layers = [int(part) for name in names if "_te_text_model_encoder_layers_" in name
              for part in [name.split("_te_text_model_encoder_layers_")[1].split("_")[0]] if part.isdigit()]
    return "sd2" if layers and max(layers) >= SD1_TEXT_ENCODER_LAYERS else "sd1"


def files_model_kind(paths: Sequence[str], flag: str) -> ModelKind:
    """The one model kind of all files (see ``file_model_kind``); UserError naming ``flag`` and the
    first file of another kind (a missing, unreadable or non-finite file too). Reads the files, builds nothing."""
    kinds = []
    for path in paths:
        weights = network_base.read_lora_file(path)
        bad_module = network_base.find_non_finite(weights)
        if bad_module is not None:
            raise UserError(f"{flag} {path}: module {bad_module} holds NaN/Inf (a diverged training?); leave the "
                            f"file out")
        kinds.append(file_model_kind(weights, network_base.read_lora_metadata(path), f"{flag} {path}"))
        if kinds[-1] != kinds[0]:
            raise UserError(f"{flag} {path} is a network for {KIND_NAMES[kinds[-1]]}, {paths[0]} one for "
                            f"{KIND_NAMES[kinds[0]]}; merge files of one model")
    return kinds[0]


@dataclass
class ModelForNetworks:
    """The text encoders and UNet the networks are built on; ``base_free``: an empty (meta) model."""

    kind: ModelKind
    text_encoders: list[torch.nn.Module]
    unet: torch.nn.Module
    base_free: bool
    config_dir: Optional[Path] = None  # the architecture of an empty model

    def unet_module_names(self) -> Optional[dict[str, str]]:
        return checkpoint_keys.unet_module_name_map(self.unet.config) if self.kind == "sdxl" else None


def model_for_networks(kind: ModelKind, args: argparse.Namespace) -> ModelForNetworks:
    """``--sd_model`` loaded (its kind must be ``kind``), or without it the empty architecture of ``kind``
    (``--model_config_dir``, else the shipped config)."""
    if args.sd_model:
        model_kind = merge_lora.detect_kind(Path(args.sd_model), args)
        if model_kind != kind:
            raise UserError(f"--sd_model {args.sd_model} is an {KIND_NAMES[model_kind]} model; the --models are "
                            f"networks for {KIND_NAMES[kind]}")
        models = merge_lora.load_base_model(args)
        return ModelForNetworks(kind, list(models.text_encoders), models.unet, base_free=False)
    config_dir = Path(args.model_config_dir) if args.model_config_dir else model_loading.shipped_config_dir(kind)
    unet, _, text_encoders, _ = model_loading.build_empty_models(kind, config_dir, with_vae=False)
    return ModelForNetworks(kind, text_encoders, unet, base_free=True, config_dir=config_dir)


@dataclass
class ModuleChanges:
    """One wrapped layer: its kohya LoRA name, the layer (for its class and weight shape), and per file
    that changes it, ``(file index, {"weight": change, "bias": change?})`` in float64 on the CPU."""

    name: str
    layer: torch.nn.Module
    changes: list[tuple[int, dict[str, torch.Tensor]]]


class NetworkFiles:
    """Network files built on one ``ModelForNetworks``; iterate ``module_changes()``."""

    def __init__(self, paths: Sequence[str], model: ModelForNetworks, flag: str) -> None:
        self.paths = list(paths)
        self.model = model
        self.flag = flag
        unet_names = model.unet_module_names()
        self.networks = [self._network(path, unet_names) for path in paths]
        self.modules: dict[str, list[tuple[int, torch.nn.Module]]] = {}
        for index, network in enumerate(self.networks):
            for lora in network.all_loras():
                self.modules.setdefault(convert_to_lora.lora_name(lora.lora_name), []).append((index, lora))

    def _network(self, path: str, unet_names: Optional[dict[str, str]]) -> network_base.AdapterNetwork:
        model = self.model
        try:
            return registry.network_from_file(path, model.text_encoders, model.unet, unet_names, self.flag).eval()
        except UserError as error:
            if not model.base_free:
                raise
            detail = str(error).split(": ", 1)[-1].split(";")[0]  # the trainers' hints do not apply here
            raise UserError(f"{self.flag} {path} does not fit the {KIND_NAMES[model.kind]} architecture of "
                            f"{model.config_dir} ({detail}); give the model's config folder with "
                            f"--model_config_dir, or the model with --sd_model") from None

    def check_base_independent(self) -> None:
        """Without a base model: measure the first module of every file now, so that a type whose change
        depends on the base weights is refused before any long work."""
        if not self.model.base_free:
            return
        for index, network in enumerate(self.networks):
            lora = next(iter(network.all_loras()), None)
            if lora is not None:
                layer = network.wrapped_module(lora)
                with _real_zero_layer(layer):
                    self._changes(index, lora, layer)

    def module_changes(self) -> Iterator[ModuleChanges]:
        """Every wrapped layer in the files' order (first file first), with each file's change of it."""
        for name, entries in self.modules.items():
            layer = self.networks[entries[0][0]].wrapped_module(entries[0][1])
            changes = []
            for index, lora in entries:
                own_layer = self.networks[index].wrapped_module(lora)
                if self.model.base_free:
                    with _real_zero_layer(own_layer):
                        changes.append((index, self._changes(index, lora, own_layer)))
                else:
                    changes.append((index, self._finite(index, lora, convert_to_lora.parameter_changes(
                        self.networks[index], lora, own_layer))))
            yield ModuleChanges(name, layer, changes)

    def _finite(self, index: int, lora: torch.nn.Module, changes: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not all(bool(torch.isfinite(change).all()) for change in changes.values()):
            raise UserError(f"{self.flag} {self.paths[index]}: module {lora.lora_name} holds NaN/Inf (a diverged "
                            f"training?); leave the file out")
        return changes

    def _changes(self, index: int, lora: torch.nn.Module, layer: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The change on the (real, zero) layer, checked to be the same on a random weight."""
        network = self.networks[index]
        on_zero = self._finite(index, lora, convert_to_lora.parameter_changes(network, lora, layer))
        weight = layer.weight
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            fan_in = max(1, weight[0].numel())
            weight.copy_(torch.randn(weight.shape, generator=generator, dtype=torch.float64) / fan_in ** 0.5)
            try:
                on_random = convert_to_lora.parameter_changes(network, lora, layer)
            finally:
                weight.zero_()
        for key, change in on_zero.items():
            difference = float((on_random[key] - change).norm()) if key in on_random else float("inf")
            bound = BASE_INDEPENDENCE_RTOL * float(change.norm()) + 1e-12
            if not difference <= bound:
                raise UserError(f"{self.flag} {self.paths[index]}: module {lora.lora_name} changes its layer by an "
                                f"amount that depends on the base weights (OFT, iA3, GLoRA, DoRA); give --sd_model "
                                f"(the base model) to merge it")
        return on_zero


class _real_zero_layer:
    """Context: a meta layer's own parameters made real zeros on the CPU, then meta again."""

    def __init__(self, layer: torch.nn.Module) -> None:
        self.layer = layer
        self.was_meta = any(parameter.is_meta for parameter in layer.parameters(recurse=False))

    def __enter__(self) -> torch.nn.Module:
        if self.was_meta:
            self.layer.to_empty(device="cpu", recurse=False)
            with torch.no_grad():
                for parameter in self.layer.parameters(recurse=False):
                    parameter.zero_()
        return self.layer

    def __exit__(self, *exc) -> None:
        if self.was_meta:
            self.layer.to("meta")
