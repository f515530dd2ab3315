"""LoHa (kohya's ``networks.loha``, LyCORIS' tensor names): the weight change is a Hadamard product
of two low-rank products, ``delta W = (w1_a @ w1_b) * (w2_a @ w2_b) * alpha / dim``.

Keys per module (rank r, in/out features or channels, kernel kh x kw):

* Linear and 1x1 conv: ``hada_w1_a``/``hada_w2_a`` (out, r), ``hada_w1_b``/``hada_w2_b`` (r, in)
* 3x3 conv (``conv_dim``): the same with (r, in*kh*kw) for the ``_b`` tensors; with
  ``use_tucker=True``: ``hada_t1``/``hada_t2`` (r, r, kh, kw), ``hada_w*_a`` (r, out), ``hada_w*_b`` (r, in)
* ``alpha`` (float32 scalar)

Targets, ranks and network_args are kohya's AdditionalNetwork's (``network_base.additional_network``);
LoRA+ trains ``hada_w2_a`` at the higher rate. kohya's networks.loha supports only SDXL; SD1.x/2.x
work here too (prefix ``lora_te_``).
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch

from networks import network_base
from networks.network_base import Target, WeightDeltaModule

NETWORK_MODULE = "networks.loha"
KNOWN_NETWORK_ARGS = network_base.ADDITIONAL_NETWORK_ARGS


def tucker_rebuild(core: torch.Tensor, w_b: torch.Tensor, w_a: torch.Tensor) -> torch.Tensor:
    """(out, in, kh, kw) from a Tucker core (r, r, kh, kw), ``w_b`` (r, in) and ``w_a`` (r, out)."""
    return torch.einsum("ij...,jr,ip->pr...", core, w_b, w_a)


def hadamard_delta(parts: Mapping[str, torch.Tensor], scale: float) -> torch.Tensor:
    """``scale * (w1_a @ w1_b) * (w2_a @ w2_b)`` from one module's tensors (keyed ``hada_w1_a``...):
    (out, in*kh*kw), or (out, in, kh, kw) for a Tucker conv."""
    if "hada_t1" in parts:
        first = tucker_rebuild(parts["hada_t1"], parts["hada_w1_b"], parts["hada_w1_a"])
        second = tucker_rebuild(parts["hada_t2"], parts["hada_w2_b"], parts["hada_w2_a"])
    else:
        first = parts["hada_w1_a"] @ parts["hada_w1_b"]
        second = parts["hada_w2_a"] @ parts["hada_w2_b"]
    return first * second * scale


def module_delta(parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The weight change of one module of a LoHa file (``hada_*`` and ``alpha`` tensors), float32."""
    parts = {name: value.float() for name, value in parts.items()}
    rank = parts["hada_w1_b"].shape[0]
    alpha = float(parts["alpha"]) if "alpha" in parts else rank
    return hadamard_delta(parts, (alpha or rank) / rank)


class LoHaModule(WeightDeltaModule):
    def __init__(self, lora_name: str, org_module: torch.nn.Module, multiplier: float, lora_dim: int,
                 alpha: Optional[float], rank_dropout: Optional[float] = None, module_dropout: Optional[float] = None,
                 use_tucker: bool = False) -> None:
        super().__init__(lora_name, org_module, multiplier, lora_dim, alpha, rank_dropout, module_dropout)
        weight = org_module.weight
        out_dim, in_dim = weight.shape[:2]
        kernel = tuple(weight.shape[2:])
        self.tucker = use_tucker and any(size != 1 for size in kernel)
        normal = torch.nn.init.normal_
        if self.tucker:
            self.hada_t1 = torch.nn.Parameter(normal(torch.empty(lora_dim, lora_dim, *kernel), std=0.1))
            self.hada_w1_a = torch.nn.Parameter(torch.zeros(lora_dim, out_dim))  # zero: the change starts at 0
            self.hada_w1_b = torch.nn.Parameter(normal(torch.empty(lora_dim, in_dim), std=1.0))
            self.hada_t2 = torch.nn.Parameter(normal(torch.empty(lora_dim, lora_dim, *kernel), std=0.1))
            self.hada_w2_a = torch.nn.Parameter(normal(torch.empty(lora_dim, out_dim), std=0.1))
            self.hada_w2_b = torch.nn.Parameter(normal(torch.empty(lora_dim, in_dim), std=1.0))
        else:
            flat_in = weight[0].numel()  # in * kh * kw (in for Linear and 1x1)
            self.hada_w1_a = torch.nn.Parameter(normal(torch.empty(out_dim, lora_dim), std=0.1))
            self.hada_w1_b = torch.nn.Parameter(normal(torch.empty(lora_dim, flat_in), std=1.0))
            self.hada_w2_a = torch.nn.Parameter(torch.zeros(out_dim, lora_dim))  # zero: the change starts at 0
            self.hada_w2_b = torch.nn.Parameter(normal(torch.empty(lora_dim, flat_in), std=1.0))

    def delta_weight(self) -> torch.Tensor:
        return hadamard_delta(dict(self.named_parameters()), self.scale).reshape(self.org_module.weight.shape)

    def loraplus_parameters(self) -> list[torch.nn.Parameter]:
        return [self.hada_w2_a]  # kohya's choice (docs/loha_lokr.md)


def validate_network_args(network_args: Mapping[str, str]) -> None:
    network_base.validate_additional_network_args(network_args, KNOWN_NETWORK_ARGS, NETWORK_MODULE)


def _make_module(multiplier: float, network_args: Mapping[str, str], use_tucker: bool):
    rank_dropout = network_base.read_number(network_args, "rank_dropout", float)
    module_dropout = network_base.read_number(network_args, "module_dropout", float)

    def make(target: Target, dim: int, alpha: float) -> LoHaModule:
        return LoHaModule(target.lora_name, target.module, multiplier, dim, alpha, rank_dropout, module_dropout,
                          use_tucker)
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
) -> network_base.AdapterNetwork:
    """kohya's entry point (see ``networks.registry``); ``--network_dropout`` does not apply (kohya: the same)."""
    validate_network_args(network_args)
    make = _make_module(multiplier, network_args, network_base.read_bool(network_args, "use_tucker"))
    return network_base.additional_network(
        NETWORK_MODULE, make, text_encoders, unet, unet_module_names, multiplier, network_dim or 4,
        network_alpha if network_alpha is not None else 1.0, network_args)


def create_network_from_weights(
    multiplier: float,
    weights: Mapping[str, torch.Tensor],
    text_encoders: list[torch.nn.Module],
    unet: torch.nn.Module,
    unet_module_names: Optional[Mapping[str, str]] = None,
    **network_args: str,
) -> network_base.AdapterNetwork:
    """A network shaped like the LoHa state dict ``weights`` (modules, ranks, alphas, Tucker or not)."""
    validate_network_args(network_args)
    modules = network_base.group_by_module(weights)
    modules_dim = {name: int(parts["hada_w1_b"].shape[0]) for name, parts in modules.items() if "hada_w1_b" in parts}
    use_tucker = any("hada_t1" in parts for parts in modules.values())
    make = _make_module(multiplier, network_args, use_tucker)
    return network_base.additional_network(
        NETWORK_MODULE, make, text_encoders, unet, unet_module_names, multiplier, 4, 1.0, network_args,
        modules_dim, network_base.modules_alpha_from_weights(weights, modules_dim))
