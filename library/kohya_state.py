"""Continue a kohya-ss run: ``--resume <kohya state folder>``.

kohya's state folders are accelerate's ``save_state`` output plus kohya's ``train_state.json``
(learned from states written by kohya's own train_network.py, accelerate 1.6):

* ``model.safetensors``: the network's state dict under the file's keys (``lora_unet_...lora_down.weight``;
  DyLoRA joined like its files), float32;
* ``optimizer.bin``: ``torch.save(optimizer.state_dict())``: kohya's parameter groups (text encoders,
  then the UNet; LoRA+ and block learning rates add groups), parameters numbered in kohya's order;
* ``scheduler.bin``: the LR schedule's ``state_dict()`` (absent for schedule-free optimizers);
* ``scaler.pt``: torch's GradScaler state (fp16 on CUDA only);
* ``random_states_0.pkl`` (Python, numpy, torch RNGs), ``sampler*.bin``;
* ``train_state.json``: ``{"current_epoch": E, "current_step": S}``, S the optimizer steps done.

What is restored: the network's weights, the optimizer state (kohya's parameter order mapped onto
this trainer's), the LR schedule, the fp16 loss scale, and the step: as kohya does on resume, the run
starts at step S at the beginning of the epoch holding it (with ``--skip_until_initial_step``, at its
batch), and ``--initial_step`` wins over S. Not restored, said in one line: kohya's data order and
random states (the data and noise here are keyed by seed, epoch and sample) and the gradient guard's
history (kohya has none).

Parameter order: kohya builds its network on its own UNet classes, which register a transformer
block's feed-forward between its two attentions (diffusers: after them) and, for SDXL, number blocks
in the original layout (a down block's resnet before its attention). Checked against kohya's
optimizer states for LoRA, LoCon, LoRA-FA, DyLoRA and OFT on SD 1.x and LoRA, LoRA-FA and OFT
on full-size SDXL. kohya's LoRA networks put both SDXL text encoders into one group (this trainer:
one per encoder, for ``--text_encoder_lr`` with two values): its groups and its schedule's
per-group lists are mapped onto ours (:func:`kohya_groups`). kohya's SDXL DyLoRA names both text
encoders' modules alike (``lora_te_``), so only its UNet-only states fit.
"""
from __future__ import annotations

import argparse
import json
import re
import zipfile
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from library.config_file import key_value_items
from library.errors import UserError, first_line

MARKER = "train_state.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.bin"
SCHEDULER_FILE = "scheduler.bin"
SCALER_FILE = "scaler.pt"

_SGM_BLOCK = re.compile(r"^[a-z]+_unet_(input_blocks|middle_block|output_blocks)_(?:(\d+)_)?(\d+)_")  # lora_, oft_
_SGM_SECTIONS = {"input_blocks": 0, "middle_block": 1, "output_blocks": 2}
_TRANSFORMER_CHILD = re.compile(r"^(.*_transformer_blocks_\d+_)(attn1|ff|attn2)_")
_KOHYA_CHILD_RANK = {"attn1": 0, "ff": 1, "attn2": 2}


def is_kohya_state(path: Path) -> bool:
    """Whether ``path`` is a kohya-ss state folder (not one of this trainer's, which have a manifest)."""
    return (path / MARKER).is_file() and (path / MODEL_FILE).is_file() and not (path / "manifest.json").exists()


def kohya_step(path: Path) -> int:
    """The optimizer steps done when the kohya state was written (``current_step``)."""
    try:
        return int(json.loads((path / MARKER).read_text())["current_step"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UserError(f"--resume {path}: {MARKER} is unreadable ({first_line(error)})") from None


_SDXL_KEY = re.compile(r"^[a-z]+_(te[12]_|unet_(input_blocks|middle_block|output_blocks)_)")
_SD_KEY = re.compile(r"^[a-z]+_(te_|unet_(down_blocks|mid_block|up_blocks)_)")
_BLOCKWISE_ARGS = ("block_dims", "conv_block_dims", "down_lr_weight", "mid_lr_weight", "up_lr_weight")


def check_before_loading(path: Path, args: argparse.Namespace, sdxl: bool) -> None:
    """What a kohya state's files tell before any model loads, refused as ``UserError``: a cut
    ``train_state.json``; a ``model.safetensors`` of the other model family (``sdxl``: this trainer's) or,
    for ``networks.lora``, of another rank than ``--network_dim`` (read from its header); a damaged
    ``optimizer.bin``/``scheduler.bin``/``scaler.pt`` (torch.save's zip archive, checksums tested)."""
    kohya_step(path)
    model = path / MODEL_FILE
    try:
        with safe_open(str(model), framework="pt") as file:
            shapes = {key: file.get_slice(key).get_shape() for key in file.keys()}
    except Exception as error:  # safetensors raises several types for damaged files
        raise UserError(f"--resume {path} ({MODEL_FILE}): not a readable safetensors file ({first_line(error)}); "
                        f"use an intact state") from None
    state_sdxl = any(_SDXL_KEY.match(key) for key in shapes)
    if state_sdxl != sdxl and (state_sdxl or any(_SD_KEY.match(key) for key in shapes)):
        family, script = ("SDXL", "sdxl_train_network.py") if state_sdxl else ("SD 1.x/2.x", "train_network.py")
        raise UserError(f"--resume {path} ({MODEL_FILE}): a kohya-ss state of an {family} LoRA; continue it with "
                        f"{script} on its model")
    network_args = dict(item.partition("=")[::2] for item in key_value_items(args.network_args))
    if args.network_module == "networks.lora" and not args.dim_from_weights \
            and not any(network_args.get(name) not in (None, "", "None") for name in _BLOCKWISE_ARGS):
        ranks = sorted({shape[0] for key, shape in shapes.items()
                        if key.endswith(".lora_down.weight") and len(shape) == 2})  # conv layers: conv_dim
        dim = args.network_dim or 4
        if ranks and ranks != [dim]:
            raise UserError(f"--resume {path} ({MODEL_FILE}): its LoRA has rank {'/'.join(map(str, ranks))}, this "
                            f"run --network_dim {dim}; resume with the --network_dim (and --network_args) that "
                            f"wrote it")
    for name in (OPTIMIZER_FILE, SCHEDULER_FILE, SCALER_FILE):
        problem = _torch_file_problem(path / name)
        if problem:
            raise UserError(f"--resume {path}: {name} is damaged ({problem}); use an intact state")


def _torch_file_problem(file: Path) -> Optional[str]:
    """Why ``file`` (when present) is not an intact ``torch.save`` archive, or None."""
    if not file.is_file():
        return None
    if not zipfile.is_zipfile(file):
        return "not a torch.save archive: cut or overwritten?"
    try:
        with zipfile.ZipFile(file) as archive:
            bad = archive.testzip()
    except (OSError, zipfile.BadZipFile, EOFError) as error:
        return first_line(error)
    return f"checksum mismatch in {bad}" if bad else None


def _torch_load(path: Path, name: str) -> Any:
    """A state file read with torch.load; ``UserError`` naming it when it cannot be."""
    try:
        return torch.load(path / name, map_location="cpu", weights_only=False)
    except Exception as error:  # unpickling raises many types for a damaged file
        raise UserError(f"--resume {path}: {name} is damaged ({first_line(error)}); use an intact state") from None


def kohya_module_order(names: list[str]) -> list[str]:
    """Module names (``lora_name``s, in this trainer's order) in the order kohya's network creates them.

    A stable sort: SDXL UNet modules by their original-layout block (section, block, sub-block), then
    inside a transformer block attn1, ff, attn2; everything else keeps its place.
    """
    first_seen: dict[str, int] = {}

    def key(index_name: tuple[int, str]) -> tuple:
        index, name = index_name
        block = _SGM_BLOCK.match(name)
        position = (_SGM_SECTIONS[block.group(1)], int(block.group(2) or 0), int(block.group(3))) if block else ()
        child = _TRANSFORMER_CHILD.match(name)
        container = child.group(1) if child else name
        first = first_seen.setdefault(container, index)
        return position, first, _KOHYA_CHILD_RANK[child.group(2)] if child else 0, index

    return [name for _, name in sorted(enumerate(names), key=key)]


def kohya_parameter_order(network: torch.nn.Module, group_params: list[list[torch.nn.Parameter]]
                          ) -> list[list[torch.nn.Parameter]]:
    """Each optimizer group's parameters in kohya's order: its modules in :func:`kohya_module_order`, each
    module's parameters in registration order (the same in kohya's module classes)."""
    owner = {id(parameter): lora.lora_name for lora in network.all_loras() for parameter in lora.parameters()}
    ordered = []
    for params in group_params:
        by_module: dict[str, list[torch.nn.Parameter]] = {}
        for parameter in params:
            by_module.setdefault(owner[id(parameter)], []).append(parameter)
        ordered.append([p for name in kohya_module_order(list(by_module)) for p in by_module[name]])
    return ordered


def kohya_groups(optimizer: torch.optim.Optimizer, network: torch.nn.Module, kohya_sizes: list[int]
                 ) -> list[list[int]]:
    """kohya's parameter groups as lists of this optimizer's group indices. kohya's SD/SDXL networks put
    the modules of both SDXL text encoders into one group (a second for their LoRA+ parts), where this
    trainer has groups per encoder; otherwise the groups are the same. ValueError naming the sizes when
    neither grouping has kohya's sizes."""
    groups = optimizer.param_groups
    sizes = [len(group["params"]) for group in groups]
    encoder_of = {id(p): lora.lora_name.split("_")[1] for lora in network.text_encoder_loras for p in lora.parameters()}
    per_encoder: dict[str, list[int]] = {}
    rest = []
    for index, group in enumerate(groups):
        encoder = encoder_of.get(id(group["params"][0]))
        if encoder is None:
            rest.append([index])
        else:
            per_encoder.setdefault(encoder, []).append(index)
    candidates = [[[index] for index in range(len(groups))]]
    if len(per_encoder) > 1 and len({len(indices) for indices in per_encoder.values()}) == 1:
        candidates.append([list(indices) for indices in zip(*per_encoder.values())] + rest)
    for candidate in candidates:
        if [sum(sizes[index] for index in members) for members in candidate] == kohya_sizes:
            return candidate
    raise ValueError(f"parameter groups of {kohya_sizes} parameters, this run has {sizes}")


def optimizer_state_in_our_order(optimizer: torch.optim.Optimizer, network: torch.nn.Module,
                                 kohya_state: dict[str, Any], mapping: list[list[int]]) -> dict[str, Any]:
    """kohya's ``optimizer.state_dict()`` renumbered for ``optimizer`` (its groups mapped by ``mapping``, from
    :func:`kohya_groups`; this trainer's order). ValueError naming the difference when the parameters' shapes
    do not match."""
    groups = optimizer.param_groups
    kohya_param_groups = kohya_state["param_groups"]
    ours = optimizer.state_dict()
    our_index = {id(p): index for group, saved in zip(groups, ours["param_groups"])
                 for p, index in zip(group["params"], saved["params"])}
    kohya_order = kohya_parameter_order(
        network, [[p for index in members for p in groups[index]["params"]] for members in mapping])
    state = {}
    for params, kohya_group in zip(kohya_order, kohya_param_groups):
        for parameter, kohya_index in zip(params, kohya_group["params"]):
            values = kohya_state["state"].get(kohya_index)
            if values is None:
                continue
            state[our_index[id(parameter)]] = {name: _shaped(value, parameter, f"{name} of parameter {kohya_index}")
                                               for name, value in values.items()}
    kohya_group_of = _kohya_group_of(mapping)
    param_groups = [{**kohya_param_groups[kohya_group_of[index]], "params": saved["params"]}
                    for index, saved in enumerate(ours["param_groups"])]
    return {"state": state, "param_groups": param_groups}


def scheduler_state_in_our_order(state: dict[str, Any], mapping: list[list[int]]) -> dict[str, Any]:
    """kohya's LR schedule state for this optimizer's groups: its per-group lists (``base_lrs``,
    ``_last_lr``, ``lr_lambdas``, ...) repeated for the groups :func:`kohya_groups` mapped together.
    ValueError when its group count is not kohya's optimizer's."""
    kohya_group_of = _kohya_group_of(mapping)
    if len(state.get("base_lrs", mapping)) != len(mapping):
        raise ValueError(f"the schedule has {len(state['base_lrs'])} parameter groups, kohya's optimizer "
                         f"{len(mapping)}")
    return {key: [value[k] for k in kohya_group_of] if isinstance(value, list) and len(value) == len(mapping)
            else value for key, value in state.items()}


def _kohya_group_of(mapping: list[list[int]]) -> list[int]:
    """For each of this optimizer's groups, the kohya group holding it."""
    return [k for _, k in sorted((index, k) for k, members in enumerate(mapping) for index in members)]


def _shaped(value: Any, parameter: torch.nn.Parameter, what: str) -> Any:
    """A per-parameter state tensor in the parameter's shape: kohya's DyLoRA keeps its conv slices flat
    ((1, in) for our (1, in, 1, 1)), the same values in the same order. ValueError when it cannot be."""
    if not torch.is_tensor(value) or value.dim() == 0 or value.shape == parameter.shape:
        return value
    if value.numel() != parameter.numel():
        raise ValueError(f"{what} has shape {tuple(value.shape)}, the parameter in kohya's order is "
                         f"{tuple(parameter.shape)}")
    return value.reshape(parameter.shape)


def restore(path: Path, network: torch.nn.Module, components: dict[str, Any], device: torch.device) -> None:
    """Load a kohya state folder into ``network`` and ``components`` (this trainer's names: optimizer,
    lr_scheduler, loss_scaler, ...) and print one line saying what was restored and what was not.
    UserError when its network does not fit this run's (``--network_*`` options differ)."""
    step = kohya_step(path)
    network.load_weights_from(load_file(path / MODEL_FILE), f"--resume {path} ({MODEL_FILE})")
    network.to(device)
    restored, missed = ["LoRA weights"], []
    optimizer = components.get("optimizer")
    mapping = None  # kohya's groups as ours (kohya_groups), once its optimizer state fits
    if optimizer is not None and (path / OPTIMIZER_FILE).is_file():
        kohya_optimizer = _torch_load(path, OPTIMIZER_FILE)
        try:
            kohya_sizes = [len(group["params"]) for group in kohya_optimizer["param_groups"]]
            groups = kohya_groups(optimizer, network, kohya_sizes)
            optimizer.load_state_dict(optimizer_state_in_our_order(optimizer, network, kohya_optimizer, groups))
            mapping = groups
            restored.append(f"{type(optimizer).__name__} state")
        except (ValueError, KeyError, RuntimeError) as error:
            missed.append(f"the optimizer state ({first_line(error)}: were --network_args, --unet_lr, "
                          f"--text_encoder_lr or --optimizer_type different?)")
    scheduler = components.get("lr_scheduler")
    if scheduler is not None and (path / SCHEDULER_FILE).is_file():
        if mapping is None:  # its per-group learning rates would land on other groups
            missed.append("the LR schedule (it goes with the optimizer state)")
        else:
            try:
                scheduler.load_state_dict(scheduler_state_in_our_order(
                    _torch_load(path, SCHEDULER_FILE), mapping))
                restored.append("LR schedule")
            except (ValueError, KeyError, RuntimeError, TypeError) as error:
                missed.append(f"the LR schedule ({first_line(error)})")
    scaler = components.get("loss_scaler")
    if scaler is not None and (path / SCALER_FILE).is_file():
        scale = float(_torch_load(path, SCALER_FILE)["scale"])
        scaler.load_state_dict({"policy": "kohya (torch GradScaler)", "scale": scale, "overflow_count": 0,
                                "policy_state": {}})
        restored.append(f"loss scale {scale:g}")
    missed.append("kohya's data order and random states (this trainer keys data and noise by seed, epoch and "
                  "sample)")
    if "grad_guard" in components:
        missed.append("the gradient guard's history (kohya has none)")
    print(f"--resume {path}: kohya-ss state at step {step}: restored {', '.join(restored)}; not restored: "
          f"{'; '.join(missed)}")


def resume_step(resume: Optional[str]) -> Optional[int]:
    """The step a ``--resume`` kohya state folder continues at (None: not a kohya state)."""
    if not resume or resume == "auto" or not is_kohya_state(Path(resume)):
        return None
    return kohya_step(Path(resume))
