"""LoKr (kohya's ``networks.lokr``, LyCORIS' tensor names): the weight change is a Kronecker product
``delta W = kron(w1, w2) * alpha / dim``, with ``w2 = w2_a @ w2_b`` at rank ``dim``.

in = in_m * in_n and out = out_l * out_k are split by ``factorization`` (``factor=-1``: the most
balanced pair; ``factor=N``: N and dim / N when N divides it). Keys per module:

* ``lokr_w1`` (out_l, in_m), always full
* Linear and 1x1 conv: ``lokr_w2_a`` (out_k, r), ``lokr_w2_b`` (r, in_n); when
  ``r >= max(out_k, in_n) / 2``: ``lokr_w2`` (out_k, in_n) instead, and alpha = r (scale 1)
* 3x3 conv (``conv_dim``): ``lokr_w2_b`` (r, in_n*kh*kw); with ``use_tucker=True``
  ``lokr_t2`` (r, r, kh, kw), ``lokr_w2_a`` (r, out_k), ``lokr_w2_b`` (r, in_n); full: ``lokr_w2`` (out_k, in_n, kh, kw)
* ``alpha`` (float32 scalar; kohya writes the forced alpha of full modules as int64)

Targets, ranks and network_args are kohya's AdditionalNetwork's plus ``factor``; LoRA+ trains
``lokr_w1`` at the higher rate. kohya's networks.lokr supports only SDXL; SD1.x/2.x work here too.
"""
from __future__ import annotations

import math
from typing import Mapping, Optional

import torch

from library.errors import UserError
from networks import network_base
from networks.network_base import Target, WeightDeltaModule

NETWORK_MODULE = "networks.lokr"
KNOWN_NETWORK_ARGS = (*network_base.ADDITIONAL_NETWORK_ARGS, "factor")


def factorization(dimension: int, factor: int = -1) -> tuple[int, int]:
    """(m, n), m <= n, m * n = ``dimension``: ``factor`` and its cofactor when it divides the dimension,
    else the largest divisor m not above ``factor`` (any, for -1) that is at most about sqrt(dimension)
    (kohya's and LyCORIS' rule)."""
    if factor > 0 and dimension % factor == 0:
        return tuple(sorted((factor, dimension // factor)))
    limit = dimension if factor < 0 else factor
    chosen = 1
    for divisor in range(2, dimension + 1):
        if dimension % divisor:
            continue
        if divisor > limit:
            break
        chosen = divisor
        if divisor >= dimension // divisor:
            break
    return tuple(sorted((chosen, dimension // chosen)))


def kaiming(shape: tuple[int, ...]) -> torch.Tensor:
    tensor = torch.empty(shape)
    torch.nn.init.kaiming_uniform_(tensor, a=math.sqrt(5))
    return tensor


def kronecker_delta(parts: Mapping[str, torch.Tensor], scale: float) -> torch.Tensor:
    """``scale * kron(w1, w2)`` from one module's tensors (``lokr_*`` names): (out, in*kh*kw),
    or (out, in, kh, kw) when w2 keeps the kernel (Tucker or full conv)."""
    if "lokr_w2" in parts:
        w2 = parts["lokr_w2"]
    elif "lokr_t2" in parts:  # (out_k, in_n, kh, kw)
        w2 = torch.einsum("ij...,ip,jr->pr...", parts["lokr_t2"], parts["lokr_w2_a"], parts["lokr_w2_b"])
    else:
        w2 = parts["lokr_w2_a"] @ parts["lokr_w2_b"]
    w1 = parts["lokr_w1"]
    w1 = w1.reshape(*w1.shape, *([1] * (w2.dim() - w1.dim())))
    return torch.kron(w1, w2.contiguous()) * scale  # kron needs a contiguous w2 (einsum output is not)


def module_delta(parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The weight change of one module of a LoKr file (``lokr_*`` and ``alpha`` tensors), float32."""
    parts = {name: value.float() for name, value in parts.items()}
    if "lokr_w2" in parts:
        return kronecker_delta(parts, 1.0)  # full w2: scale 1
    rank = parts["lokr_w2_a"].shape[0 if "lokr_t2" in parts else 1]
    alpha = float(parts["alpha"]) if "alpha" in parts else rank
    return kronecker_delta(parts, (alpha or rank) / rank)


class LoKrModule(WeightDeltaModule):
    def __init__(self, lora_name: str, org_module: torch.nn.Module, multiplier: float, lora_dim: int,
                 alpha: Optional[float], rank_dropout: Optional[float] = None, module_dropout: Optional[float] = None,
                 factor: int = -1, use_tucker: bool = False) -> None:
        weight = org_module.weight
        out_dim, in_dim = weight.shape[:2]
        kernel = tuple(weight.shape[2:])
        in_m, in_n = factorization(in_dim, factor)
        out_l, out_k = factorization(out_dim, factor)
        full = lora_dim >= max(out_k, in_n) / 2  # a low-rank w2 would be no smaller
        # kohya: a full w2 has scale 1 (alpha = dim)
        super().__init__(lora_name, org_module, multiplier, lora_dim, lora_dim if full else alpha, rank_dropout,
                         module_dropout)
        self.tucker = use_tucker and any(size != 1 for size in kernel) and not full
        self.lokr_w1 = torch.nn.Parameter(kaiming((out_l, in_m)))
        if full:
            self.lokr_w2 = torch.nn.Parameter(torch.zeros(out_k, in_n, *(kernel if any(s != 1 for s in kernel) else ())))
        elif self.tucker:
            self.lokr_t2 = torch.nn.Parameter(kaiming((lora_dim, lora_dim, *kernel)))
            self.lokr_w2_a = torch.nn.Parameter(kaiming((lora_dim, out_k)))
            self.lokr_w2_b = torch.nn.Parameter(torch.zeros(lora_dim, in_n))
        else:
            self.lokr_w2_a = torch.nn.Parameter(kaiming((out_k, lora_dim)))
            self.lokr_w2_b = torch.nn.Parameter(torch.zeros(lora_dim, in_n * math.prod(kernel)))
        # zero w2 (or w2_b): the change starts at 0

    def delta_weight(self) -> torch.Tensor:
        return kronecker_delta(dict(self.named_parameters()), self.scale).reshape(self.org_module.weight.shape)

    def loraplus_parameters(self) -> list[torch.nn.Parameter]:
        return [self.lokr_w1]  # kohya's choice (docs/loha_lokr.md)


def validate_network_args(network_args: Mapping[str, str]) -> None:
    network_base.validate_additional_network_args(network_args, KNOWN_NETWORK_ARGS, NETWORK_MODULE)
    check_factor(network_args)


def check_factor(network_args: Mapping[str, str]) -> None:
    """UserError unless ``factor`` is absent, -1 or >= 1 (also for lycoris.kohya's algo=lokr). kohya and
    LyCORIS take 0 without a word and split every layer as 1 x its size: a 1x1 ``lokr_w1``, no Kronecker
    structure left. Files written that way still load (``create_network_from_weights`` does not check)."""
    factor = network_base.read_number(network_args, "factor", int, minimum=None)
    if factor is not None and factor != -1 and factor < 1:
        raise UserError(f"--network_args factor={network_args['factor']}: LoKr's factor must be -1 (the most "
                        f"balanced split of each layer) or a whole number >= 1")


def _make_module(multiplier: float, network_args: Mapping[str, str], use_tucker: bool):
    rank_dropout = network_base.read_number(network_args, "rank_dropout", float)
    module_dropout = network_base.read_number(network_args, "module_dropout", float)
    factor = network_base.read_number(network_args, "factor", int, default=-1, minimum=None)

    def make(target: Target, dim: int, alpha: float) -> LoKrModule:
        return LoKrModule(target.lora_name, target.module, multiplier, dim, alpha, rank_dropout, module_dropout,
                          factor, use_tucker)
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
    """A network shaped like the LoKr state dict ``weights``; ``factor`` comes from network_args (kohya)."""
    validate_network_args(network_args)
    modules_dim = {}
    for name, parts in network_base.group_by_module(weights).items():
        if "lokr_w2" in parts:  # full: its alpha is the rank it was built with (large enough to select it)
            modules_dim[name] = int(float(parts["alpha"])) if "alpha" in parts else int(max(parts["lokr_w2"].shape[:2]))
        elif "lokr_w2_a" in parts:
            modules_dim[name] = int(parts["lokr_w2_a"].shape[0 if "lokr_t2" in parts else 1])
    use_tucker = any(key.endswith(".lokr_t2") for key in weights)
    make = _make_module(multiplier, network_args, use_tucker)
    return network_base.additional_network(
        NETWORK_MODULE, make, text_encoders, unet, unet_module_names, multiplier, 4, 1.0, network_args,
        modules_dim, network_base.modules_alpha_from_weights(weights, modules_dim))
