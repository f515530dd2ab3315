"""LoRA-FA (kohya's ``networks.lora_fa``): LoRA whose down projection is frozen at its random init.

Same modules, keys (``lora_down.weight``, ``lora_up.weight``, ``alpha``), shapes and network_args
as ``networks.lora`` (block-wise arguments included), without LoRA+ (only ``lora_up`` trains).
As in kohya (after the LoRA-FA paper) the down weight starts from a normal distribution with
std ``sqrt(2 / (in_features + rank))`` and is never updated; it is saved, so a file is a plain
LoRA that any LoRA loader reads.
"""
from __future__ import annotations

import math
from typing import Mapping, Optional

import torch

from networks import lora
from networks.network_base import Target

NETWORK_MODULE = "networks.lora_fa"
# kohya's lora_fa reads no LoRA+ ratios: with a frozen down they would only rescale the lr.
KNOWN_NETWORK_ARGS = ("conv_dim", "conv_alpha", *lora.DROPOUT_NETWORK_ARGS, *lora.BLOCKWISE_NETWORK_ARGS)


class LoRAFAModule(lora.LoRAModule):
    """A ``LoRAModule`` whose ``lora_down`` is frozen (``requires_grad`` stays False)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        org = self.org_module
        in_dim = org.in_channels if isinstance(org, torch.nn.Conv2d) else org.in_features
        torch.nn.init.normal_(self.lora_down.weight, std=math.sqrt(2.0 / (in_dim + self.lora_dim)))
        self.lora_down.requires_grad_(False)

    def requires_grad_(self, requires_grad: bool = True) -> "LoRAFAModule":
        self.lora_up.requires_grad_(requires_grad)
        self.lora_down.requires_grad_(False)
        return self

    def loraplus_parameters(self) -> list[torch.nn.Parameter]:
        return []


def validate_network_args(network_args: Mapping[str, str]) -> None:
    lora.validate_network_args(network_args, KNOWN_NETWORK_ARGS, NETWORK_MODULE)


def _make_module(multiplier: float, dropout: Optional[float], rank_dropout: Optional[float],
                 module_dropout: Optional[float]):
    def make(target: Target, dim: int, alpha: float) -> LoRAFAModule:
        return LoRAFAModule(target.lora_name, target.module, multiplier, dim, alpha, dropout, rank_dropout,
                            module_dropout)
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
    """kohya's entry point (see ``networks.registry``)."""
    validate_network_args(network_args)
    options = lora.lora_options(network_args, network_dim, network_alpha, unet_module_names)
    make = _make_module(multiplier, neuron_dropout, options["rank_dropout"], options["module_dropout"])
    return lora.LoRANetwork(text_encoders, unet, multiplier=multiplier, make_module=make,
                            network_module=NETWORK_MODULE, **options)


def create_network_from_weights(
    multiplier: float,
    weights: Mapping[str, torch.Tensor],
    text_encoders: list[torch.nn.Module],
    unet: torch.nn.Module,
    unet_module_names: Optional[Mapping[str, str]] = None,
    **network_args: str,
) -> lora.LoRANetwork:
    """A network shaped like the LoRA-FA state dict ``weights`` (modules, ranks, alphas; block lr weights apply)."""
    validate_network_args(network_args)
    modules_dim, modules_alpha = lora.dims_from_weights(weights)
    options = lora.lora_options(network_args, None, None, unet_module_names)
    make = _make_module(multiplier, None, options["rank_dropout"], options["module_dropout"])
    return lora.LoRANetwork(text_encoders, unet, multiplier=multiplier, modules_dim=modules_dim,
                            modules_alpha=modules_alpha, make_module=make, network_module=NETWORK_MODULE, **options)
