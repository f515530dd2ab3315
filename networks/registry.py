"""Which module implements each ``--network_module`` name.

A network type is a Python module with (kohya's entry points, ``network_args`` being the
``--network_args`` strings):

* ``validate_network_args(network_args: Mapping[str, str]) -> None``: UserError (one line
  naming the key and the valid ones) for an unknown or malformed argument; called before any
  model is loaded.
* ``create_network(multiplier, network_dim, network_alpha, vae, text_encoders, unet,
  neuron_dropout=None, unet_module_names=None, **network_args) -> AdapterNetwork``
* ``create_network_from_weights(multiplier, weights, text_encoders, unet,
  unet_module_names=None, **network_args) -> AdapterNetwork``: a network shaped like the state
  dict ``weights`` (``--dim_from_weights``, merging); the caller loads ``weights`` into it.

Optionally ``check_float8_base(network_args, flag) -> None``: UserError when the type cannot compute
with frozen weights stored in float8 (``flag``: ``--fp8_base`` or ``--fp8_base_unet``); absent: it can.

and ``KNOWN_NETWORK_ARGS`` (tuple): the network_args it accepts (the tools pass a file's
``ss_network_args`` restricted to them, e.g. LoKr's ``factor``, when rebuilding its network).

The trainer and the tools go through this table only; they never branch on the type.
"""
from __future__ import annotations

import importlib
import json
from types import ModuleType
from typing import Mapping, Optional, Sequence

import torch

from library.errors import UserError
from networks import network_base

# --network_module name (as kohya's GUI writes it) -> our module.
NETWORK_MODULES = {
    "networks.lora": "networks.lora",
    "networks.dylora": "networks.dylora",
    "networks.lora_fa": "networks.lora_fa",
    "networks.loha": "networks.loha",
    "networks.lokr": "networks.lokr",
    "networks.oft": "networks.oft",
    "lycoris.kohya": "networks.lycoris_kohya",
}

# The 16 "LoRA type" choices of the kohya_ss GUI, one small working setting each: label -> (--network_module,
# --network_alpha, --network_args); CONV_RANK in the args stands for the conv rank. Shared by the tests and
# benchmarks that go over every type (docs/network_types.md describes each).
EXAMPLE_NETWORKS: dict[str, tuple[str, float, tuple[str, ...]]] = {
    "networks.lora (Standard)": ("networks.lora", 1.0, ()),
    "networks.lora (LoCon)": ("networks.lora", 1.0, ("conv_dim=CONV_RANK", "conv_alpha=1")),
    "networks.dylora": ("networks.dylora", 1.0, ("conv_dim=CONV_RANK", "unit=1")),
    "networks.lora_fa": ("networks.lora_fa", 1.0, ("conv_dim=CONV_RANK", "conv_alpha=1")),
    "networks.loha": ("networks.loha", 1.0, ("conv_dim=CONV_RANK", "conv_alpha=1")),
    "networks.lokr": ("networks.lokr", 1.0, ("conv_dim=CONV_RANK", "conv_alpha=1")),
    "networks.oft": ("networks.oft", 0.01, ("enable_conv=True",)),
    **{f"lycoris {algo}": ("lycoris.kohya", 1.0, (f"algo={algo}", "conv_dim=CONV_RANK", "conv_alpha=1", *extra))
       for algo, extra in (("locon", ()), ("loha", ()), ("lokr", ("factor=-1",)), ("ia3", ()), ("glora", ()),
                           ("dylora", ("block_size=1",)), ("diag-oft", ()), ("boft", ()), ("full", ()))},
}


def example_network_args(label: str, conv_rank: int) -> list[str]:
    """The ``--network_args`` of ``EXAMPLE_NETWORKS[label]`` with ``conv_rank`` filled in."""
    return [arg.replace("CONV_RANK", str(conv_rank)) for arg in EXAMPLE_NETWORKS[label][2]]


def network_type(name: str) -> ModuleType:
    """The module implementing ``--network_module name``; UserError naming the available ones."""
    if name not in NETWORK_MODULES:
        raise UserError(f"--network_module {name}: not available (available: {', '.join(NETWORK_MODULES)})")
    return importlib.import_module(NETWORK_MODULES[name])


def validate(name: str, network_args: Mapping[str, str], float8_flag: Optional[str] = None) -> None:
    """Refuse an unknown ``--network_module``, ``--network_args`` it does not accept, or float8 base
    weights (``float8_flag``: the flag given, or None) it cannot compute with (before loading models)."""
    type_module = network_type(name)
    type_module.validate_network_args(network_args)
    check_float8_base = getattr(type_module, "check_float8_base", None)
    if float8_flag is not None and check_float8_base is not None:
        check_float8_base(network_args, float8_flag)


# Files of these types hold only lora_down / lora_up / alpha tensors (LoRA, LoCon, DyLoRA, LoRA-FA):
# LoRA tools (resizing, merging into one LoRA) read them all.
LORA_FORMAT_SUFFIXES = ("lora_down.weight", "lora_up.weight", "alpha")
# Every network file's module names start so (kohya's LoRA/LyCORIS prefixes, kohya's OFT); checkpoints' do not.
NETWORK_KEY_PREFIXES = ("lora_", "oft_")
CHECKPOINT_KEY_PREFIXES = ("model.", "conditioner.", "first_stage_model.", "cond_stage_model.", "text_encoders.")
# Our types' tensor names, to recognise a file without ss_network_module metadata.
_SUFFIX_PREFIXES = {"networks.loha": "hada_", "networks.lokr": "lokr_", "networks.oft": "oft_blocks"}


def file_network_module(weights: Mapping[str, torch.Tensor], metadata: Mapping[str, str], source: str) -> str:
    """The ``--network_module`` that wrote a network file: its ``ss_network_module`` when listed here,
    else recognised from its tensor names (LyCORIS' other names: lycoris.kohya)."""
    if weights and not any(key.startswith(NETWORK_KEY_PREFIXES) for key in weights):
        example = next(iter(weights))
        what = " (a Stable Diffusion checkpoint?)" if example.startswith(CHECKPOINT_KEY_PREFIXES) else ""
        raise UserError(f"{source}: not a network file{what}: its tensors are named like {example}, a network "
                        f"file's like {NETWORK_KEY_PREFIXES[0]}unet_...")
    name = metadata.get("ss_network_module")
    if name in NETWORK_MODULES:
        return name
    suffixes = {key.partition(".")[2] for key in weights}
    if suffixes and suffixes <= set(LORA_FORMAT_SUFFIXES):
        return "networks.lora"
    own = {module: {suffix for suffix in suffixes if suffix.startswith(prefix)}
           for module, prefix in _SUFFIX_PREFIXES.items()}
    for module, found in own.items():
        if found and suffixes - found <= {"alpha"}:
            return module
    if "lycoris.kohya" in NETWORK_MODULES and suffixes:
        return "lycoris.kohya"
    raise UserError(f"{source}: not a network file of a known type (tensor names like "
                    f"{', '.join(sorted(suffixes)[:3]) or 'none'}; types: {', '.join(NETWORK_MODULES)})")


def require_lora_format(weights: Mapping[str, torch.Tensor], metadata: Mapping[str, str], source: str,
                        task: str) -> None:
    """UserError (one line naming ``source`` and its type) unless the file holds LoRA-format modules."""
    if not any(key.endswith(".lora_down.weight") for key in weights):
        name = file_network_module(weights, metadata, source)
        raise UserError(f"{source}: a {name} file; {task} works on LoRA/LoCon files only (lora_down/lora_up)")


def file_network_args(metadata: Mapping[str, str], type_module: ModuleType) -> dict[str, str]:
    """The file's ``ss_network_args`` that ``type_module`` accepts (string values only)."""
    try:
        stored = json.loads(metadata.get("ss_network_args") or "{}")
    except json.JSONDecodeError:
        return {}
    known = getattr(type_module, "KNOWN_NETWORK_ARGS", ())
    return {key: value for key, value in (stored if isinstance(stored, dict) else {}).items()
            if key in known and isinstance(value, str)}


def network_from_file(
    path: str,
    text_encoders: Sequence[torch.nn.Module],
    unet: torch.nn.Module,
    unet_module_names: Optional[Mapping[str, str]],
    flag: str,
    multiplier: float = 1.0,
) -> network_base.AdapterNetwork:
    """The network a file holds, built on these models with the file's weights loaded (not applied).
    UserError naming ``flag`` and the file when it does not fit the models."""
    source = f"{flag} {path}"
    weights = network_base.read_lora_file(path)
    metadata = network_base.read_lora_metadata(path)
    type_module = network_type(file_network_module(weights, metadata, source))
    network = type_module.create_network_from_weights(multiplier, weights, list(text_encoders), unet,
                                                      unet_module_names, **file_network_args(metadata, type_module))
    built = {lora.lora_name for lora in network.all_loras()}
    unmatched = sorted(set(network_base.group_by_module(weights)) - built)
    if unmatched:
        raise UserError(f"{source}: {len(unmatched)} module(s) match nothing in the model (first: {unmatched[0]}); "
                        f"is it a network for this kind of model?")
    network.load_weights_from(weights, source)
    return network
