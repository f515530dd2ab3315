"""DyLoRA (kohya's ``networks.dylora``): a LoRA trained so that its first ranks work on their own.

Each training forward draws a rank ``b`` (a multiple of ``unit`` below ``dim``) from torch's CPU
generator, which is in the run's state (runs and resumes are reproducible) and which gradient
checkpointing restores before it recomputes a block, so the recomputation draws the same rank
(kohya draws from Python's ``random``: with checkpointing, its backward uses another rank's scale
than its forward, 0.04 apart in the weights after 3 steps on the tiny SDXL); only rows
``b .. b+unit-1`` of down and columns of up receive gradients (the other rank slices are frozen for that step, as in kohya),
and the output is scaled by ``sqrt(dim / (b + unit))``. In eval mode (sampling, validation) the
module is a plain LoRA at full rank. Files are plain LoRA files: ``lora_down.weight`` (rank, in)
or (rank, in, kh, kw), ``lora_up.weight`` (out, rank) or (out, rank, 1, 1), ``alpha``; smaller
ranks are cut from them with ``networks/extract_lora_from_dylora.py`` (kohya's flags).

Differences from kohya (see docs/network_types.md): SDXL text encoders are named
``lora_te1_``/``lora_te2_`` (kohya names both ``lora_te_``, so te2 overwrites te1 in its files);
``conv_dim`` may differ from ``network_dim`` (kohya asserts they are equal, which the GUI's
defaults break) and ``conv_alpha`` is used for 3x3 convs (kohya ignores it).
"""
from __future__ import annotations

import math
from typing import Mapping, Optional

import torch

from library import fp8_base
from library.errors import UserError
from networks import lora, network_base
from networks.network_base import AdapterModule, Target

NETWORK_MODULE = "networks.dylora"
KNOWN_NETWORK_ARGS = ("conv_dim", "conv_alpha", "unit", *network_base.LORAPLUS_NETWORK_ARGS)


class DyLoRAModule(AdapterModule):
    """One LoRA module whose rank slices are separate parameters (so that each can be frozen per step)."""

    def __init__(self, lora_name: str, org_module: torch.nn.Module, multiplier: float, lora_dim: int,
                 alpha: Optional[float], unit: int = 1) -> None:
        super().__init__(lora_name, org_module, multiplier)
        if lora_dim % unit:
            raise UserError(f"--network_args unit={unit}: {lora_name} has rank {lora_dim}, which is not a multiple "
                            f"of unit; give a unit dividing --network_dim (and conv_dim)")
        self.lora_dim = lora_dim
        self.unit = unit
        alpha = lora_dim if alpha is None or alpha == 0 else float(alpha)
        self.register_buffer("alpha", torch.tensor(float(alpha)))
        self.scale = float(alpha) / lora_dim
        weight = org_module.weight
        # down rows: (1, in) or (1, in, kh, kw); up columns: (out, 1) or (out, 1, 1, 1)
        down_shape = (1, *weight.shape[1:]) if weight.dim() == 4 else (1, weight.shape[1])
        up_shape = (weight.shape[0], 1, 1, 1) if weight.dim() == 4 else (weight.shape[0], 1)
        self.lora_A = torch.nn.ParameterList([torch.nn.Parameter(torch.empty(down_shape)) for _ in range(lora_dim)])
        self.lora_B = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(up_shape)) for _ in range(lora_dim)])
        for row in self.lora_A:  # kohya's init, row by row
            torch.nn.init.kaiming_uniform_(row, a=math.sqrt(5))

    def down_weight(self) -> torch.Tensor:
        return torch.cat(tuple(self.lora_A), dim=0)

    def up_weight(self) -> torch.Tensor:
        return torch.cat(tuple(self.lora_B), dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        org_out = self.org_forward(x)
        factor = 1.0
        if self.training:
            trainable = int(torch.randint(self.lora_dim, ()))
            trainable -= trainable % self.unit
            for index, (down, up) in enumerate(zip(self.lora_A, self.lora_B)):
                train = trainable <= index < trainable + self.unit
                down.requires_grad_(train)
                up.requires_grad_(train)
            factor = math.sqrt(self.lora_dim / (trainable + self.unit))
        down, up = self.down_weight(), self.up_weight()
        hidden = network_base.conv_or_linear(self.org_module, down, x)
        if down.dim() == 4:
            out = torch.nn.functional.conv2d(hidden, up)
        else:
            out = torch.nn.functional.linear(hidden, up)
        return org_out + out * (self.multiplier * self.scale * factor)

    # -- kohya's file layout: lora_down.weight / lora_up.weight instead of the slices --------
    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        state = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        for index in range(self.lora_dim):
            del state[f"{prefix}lora_A.{index}"], state[f"{prefix}lora_B.{index}"]
        down, up = self.down_weight(), self.up_weight()
        state[f"{prefix}lora_down.weight"] = down if keep_vars else down.detach()
        state[f"{prefix}lora_up.weight"] = up if keep_vars else up.detach()
        return state

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        down = state_dict.pop(f"{prefix}lora_down.weight", None)
        up = state_dict.pop(f"{prefix}lora_up.weight", None)
        if down is not None and up is not None:
            expected_down, expected_up = self.down_weight().shape, self.up_weight().shape
            if down.shape != expected_down or up.shape != expected_up:
                error_msgs.append(f"{prefix}lora_down/up.weight: shapes {tuple(down.shape)}/{tuple(up.shape)}, "
                                  f"expected {tuple(expected_down)}/{tuple(expected_up)}")
                return
            for index in range(self.lora_dim):
                state_dict[f"{prefix}lora_A.{index}"] = down[index : index + 1]
                state_dict[f"{prefix}lora_B.{index}"] = up[:, index : index + 1]
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    # -- hooks of networks.network_base ------------------------------------------------
    def loraplus_parameters(self) -> list[torch.nn.Parameter]:
        return list(self.lora_B)

    def merged_parameters(self, multiplier: float) -> dict[str, torch.Tensor]:
        parts = {"down": self.down_weight(), "up": self.up_weight(), "alpha": self.alpha}
        dtype = network_base.merge_dtype(self.org_module.weight.dtype)
        weight = fp8_base.frozen_weight(self.org_module, dtype)
        return {"weight": weight + multiplier * lora.lora_delta(parts, dtype)}


def validate_network_args(network_args: Mapping[str, str]) -> None:
    network_base.check_known_args(network_args, KNOWN_NETWORK_ARGS, NETWORK_MODULE)
    network_base.read_number(network_args, "conv_dim", int)
    network_base.read_number(network_args, "conv_alpha", float)
    if network_base.read_number(network_args, "unit", int, default=1) == 0:
        raise UserError("--network_args unit=0 is out of range (a positive divisor of --network_dim)")
    network_base.loraplus_ratios(network_args)


def _make_module(multiplier: float, unit: int):
    def make(target: Target, dim: int, alpha: float) -> DyLoRAModule:
        return DyLoRAModule(target.lora_name, target.module, multiplier, dim, alpha, unit)
    return make


def create_network(
    multiplier: float,
    network_dim: Optional[int],
    network_alpha: Optional[float],
    vae: Optional[torch.nn.Module],
    text_encoders: list[torch.nn.Module],
    unet: torch.nn.Module,
    neuron_dropout: Optional[float] = None,
    unet_module_names: Optional[Mapping[str, str]] = None,
    **network_args: str,
) -> lora.LoRANetwork:
    """kohya's entry point (see ``networks.registry``); ``--network_dropout`` does not apply (kohya: the same)."""
    validate_network_args(network_args)
    conv_dim = network_base.read_number(network_args, "conv_dim", int)
    conv_alpha = network_base.read_number(network_args, "conv_alpha", float, default=network_alpha)
    unit = network_base.read_number(network_args, "unit", int, default=1)
    return lora.LoRANetwork(
        text_encoders, unet, multiplier=multiplier, lora_dim=network_dim or 4,
        alpha=network_alpha if network_alpha is not None else 1.0, conv_lora_dim=conv_dim, conv_alpha=conv_alpha,
        unet_module_names=unet_module_names, make_module=_make_module(multiplier, unit),
        network_module=NETWORK_MODULE,
    )


def create_network_from_weights(
    multiplier: float,
    weights: Mapping[str, torch.Tensor],
    text_encoders: list[torch.nn.Module],
    unet: torch.nn.Module,
    unet_module_names: Optional[Mapping[str, str]] = None,
    **network_args: str,
) -> lora.LoRANetwork:
    """A network shaped like the DyLoRA state dict ``weights`` (modules, ranks, alphas; ``unit`` from network_args)."""
    validate_network_args(network_args)
    modules_dim, modules_alpha = lora.dims_from_weights(weights)
    unit = network_base.read_number(network_args, "unit", int, default=1)
    return lora.LoRANetwork(text_encoders, unet, multiplier=multiplier, unet_module_names=unet_module_names,
                            modules_dim=modules_dim, modules_alpha=modules_alpha,
                            make_module=_make_module(multiplier, unit), network_module=NETWORK_MODULE)
