"""OFT (kohya's ``networks.oft``): orthogonal fine-tuning of the UNet.

Each wrapped module's weight W (out rows) is split into ``dim`` blocks of ``out / dim`` rows;
block k becomes ``R_k^T W_k`` with the Cayley rotation ``R = (I + Q)(I - Q)^-1`` of the
skew-symmetric ``Q = B - B^T`` (``B``: the trained ``oft_blocks``), ``||Q||_F`` clamped to
``alpha * out`` (kohya's constraint), and the multiplier interpolating ``R`` with the identity.
Keys: ``oft_unet_<module>.oft_blocks`` (dim, out/dim, out/dim) and ``.alpha`` (float32 scalar).

Targets (kohya's): the UNet attention projections (to_q/k/v/out), with ``enable_all_linear=True``
every Linear/1x1 conv of the transformer blocks, with ``enable_conv=True`` also the ResNet and
sampler convs. No text encoder modules: kohya's OFT asserts on ``--network_train_text_encoder_only``
and otherwise trains the UNet only while treating the text encoders as trained; here the text
encoders simply stay frozen. kohya reads ``enable_*=False`` as true (``bool("False")``); here
it is false. No LoRA+ (no up/down parts) and no ``--scale_weight_norms``.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch

from library import fp8_base
from library.errors import UserError
from networks import network_base
from networks.network_base import AdapterModule, AdapterNetwork, Target

NETWORK_MODULE = "networks.oft"
PREFIX_UNET = "oft_unet"
ATTENTION_MODULES = ("Attention",)  # diffusers' name of kohya's CrossAttention
KNOWN_NETWORK_ARGS = ("enable_all_linear", "enable_conv")


class OFTModule(AdapterModule):
    def __init__(self, lora_name: str, org_module: torch.nn.Module, multiplier: float, dim: int,
                 alpha: float) -> None:
        super().__init__(lora_name, org_module, multiplier)
        out_dim = org_module.weight.shape[0]
        if dim <= 0 or out_dim % dim:
            divisors = [d for d in (1, 2, 4, 8, 16, 32) if out_dim % d == 0]
            raise UserError(f"--network_dim {dim}: {NETWORK_MODULE} splits the {out_dim} outputs of {lora_name} "
                            f"into dim blocks, so dim must divide them (e.g. {', '.join(map(str, divisors))})")
        self.lora_dim = dim
        self.block_size = out_dim // dim
        self.register_buffer("alpha", torch.tensor(float(alpha)))
        self.constraint = float(alpha) * out_dim  # kohya: alpha * out (the paper: alpha * out^2)
        self.oft_blocks = torch.nn.Parameter(torch.zeros(dim, self.block_size, self.block_size))

    def rotation(self, multiplier: float) -> torch.Tensor:
        """The per-block rotations (dim, n, n) in float32 (float64 on a float64 layer), interpolated
        with I by ``multiplier``."""
        blocks = self.oft_blocks.to(network_base.merge_dtype(self.org_module.weight.dtype))
        skew = blocks - blocks.transpose(1, 2)
        norm = torch.linalg.vector_norm(skew)
        skew = skew * ((norm.clamp(max=self.constraint) + 1e-8) / (norm + 1e-8))
        identity = torch.eye(self.block_size, device=skew.device, dtype=skew.dtype).expand_as(skew)
        rotation = (identity + skew) @ torch.linalg.inv(identity - skew)
        return multiplier * (rotation - identity) + identity

    def rotated_weight(self, multiplier: float) -> torch.Tensor:
        """W with block k replaced by ``R_k^T W_k`` (float32, or float64 on a float64 layer; W's shape;
        autocast off: the inverse and the rotation need float32 even in fp16/bf16 training)."""
        weight = fp8_base.frozen_weight(self.org_module, network_base.merge_dtype(self.org_module.weight.dtype))
        with torch.autocast(weight.device.type, enabled=False):
            blocks = weight.reshape(self.lora_dim, self.block_size, -1)
            rotated = torch.einsum("knm,knp->kmp", self.rotation(multiplier), blocks)
        return rotated.reshape(weight.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.multiplier == 0:
            return self.org_forward(x)
        org = self.org_module
        weight = self.rotated_weight(self.multiplier).to(x.dtype)
        if isinstance(org, torch.nn.Conv2d):
            return torch.nn.functional.conv2d(x, weight, org.bias, org.stride, org.padding, org.dilation, org.groups)
        return torch.nn.functional.linear(x, weight, org.bias)

    def merged_parameters(self, multiplier: float) -> dict[str, torch.Tensor]:
        return {"weight": self.rotated_weight(multiplier)}


def validate_network_args(network_args: Mapping[str, str]) -> None:
    network_base.check_known_args(network_args, KNOWN_NETWORK_ARGS, NETWORK_MODULE)
    for key in KNOWN_NETWORK_ARGS:
        network_base.read_bool(network_args, key)


def _targets(unet: torch.nn.Module, unet_module_names: Optional[Mapping[str, str]], all_linear: bool,
             conv: bool) -> list[Target]:
    classes = network_base.UNET_TARGET_MODULES if all_linear else ATTENTION_MODULES
    if conv:
        classes = classes + network_base.UNET_CONV_TARGET_MODULES
    targets = network_base.unet_targets(unet, unet_module_names, classes, PREFIX_UNET)
    return [target for target in targets if conv or target.kind != "conv"]


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
) -> AdapterNetwork:
    """kohya's entry point (see ``networks.registry``): ``--network_dim`` is the number of blocks,
    ``--network_alpha`` the constraint (kohya's default without it: 1e-3)."""
    validate_network_args(network_args)
    dim = network_dim or 4
    alpha = network_alpha if network_alpha is not None else 1e-3
    targets = _targets(unet, unet_module_names, network_base.read_bool(network_args, "enable_all_linear"),
                       network_base.read_bool(network_args, "enable_conv"))
    modules = [OFTModule(target.lora_name, target.module, multiplier, dim, alpha) for target in targets]
    return AdapterNetwork([], modules, multiplier, NETWORK_MODULE)


def create_network_from_weights(
    multiplier: float,
    weights: Mapping[str, torch.Tensor],
    text_encoders: list[torch.nn.Module],
    unet: torch.nn.Module,
    unet_module_names: Optional[Mapping[str, str]] = None,
    **network_args: str,
) -> AdapterNetwork:
    """A network with the modules of the OFT state dict ``weights`` (their block counts and alphas)."""
    validate_network_args(network_args)
    modules = network_base.group_by_module(weights)
    chosen = []
    for target in _targets(unet, unet_module_names, all_linear=True, conv=True):
        parts = modules.get(target.lora_name)
        if parts is not None and "oft_blocks" in parts:
            alpha = float(parts["alpha"]) if "alpha" in parts else 1e-3
            chosen.append(OFTModule(target.lora_name, target.module, multiplier, int(parts["oft_blocks"].shape[0]),
                                    alpha))
    return AdapterNetwork([], chosen, multiplier, NETWORK_MODULE)
