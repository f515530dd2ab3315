"""LoRA network in kohya-ss sd-scripts' format: target modules, key names, scale, save/load.

A LoRA module wraps one Linear/Conv2d of the frozen model by replacing its ``forward``
(the original module is not re-registered, so no weight is stored twice) and adds
``up(down(x)) * multiplier * alpha / dim``. Keys are kohya's:
``<lora_name>.lora_down.weight``, ``<lora_name>.lora_up.weight``, ``<lora_name>.alpha``,
with ``lora_name`` = prefix + module path, dots replaced by underscores. SDXL UNet
paths use the original (single-file) block names, SD1.x/2.x UNet paths the diffusers
ones, exactly as kohya's trainers name them (``networks.network_base`` holds the naming, the
network container and the file I/O every type shares). kohya's block-wise network_args
(per-block ranks and learning-rate weights) are here too; networks.lora_fa and networks.dylora
reuse this network with their own modules.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch

from library import fp8_base
from library.errors import UserError
from networks import network_base
from networks.network_base import LORAPLUS_NETWORK_ARGS, AdapterModule, AdapterNetwork, Target, loraplus_ratios
from networks.network_base import read_lora_file, save_lora_file  # noqa: F401  (the LoRA tools and tests import them from here)

NETWORK_MODULE = "networks.lora"


class LoRAModule(AdapterModule):
    """Low-rank adapter added to the output of one Linear or Conv2d module."""

    def __init__(
        self,
        lora_name: str,
        org_module: torch.nn.Module,
        multiplier: float,
        lora_dim: int,
        alpha: float,
        dropout: Optional[float] = None,
        rank_dropout: Optional[float] = None,
        module_dropout: Optional[float] = None,
    ) -> None:
        super().__init__(lora_name, org_module, multiplier)
        self.lora_dim = lora_dim
        if isinstance(org_module, torch.nn.Conv2d):
            self.lora_down = torch.nn.Conv2d(
                org_module.in_channels, lora_dim, org_module.kernel_size, org_module.stride, org_module.padding, bias=False
            )
            self.lora_up = torch.nn.Conv2d(lora_dim, org_module.out_channels, (1, 1), (1, 1), bias=False)
        else:
            self.lora_down = torch.nn.Linear(org_module.in_features, lora_dim, bias=False)
            self.lora_up = torch.nn.Linear(lora_dim, org_module.out_features, bias=False)
        # Same init as kohya: the product starts at zero, so training starts from the base model.
        torch.nn.init.kaiming_uniform_(self.lora_down.weight, a=math.sqrt(5))
        torch.nn.init.zeros_(self.lora_up.weight)
        alpha = lora_dim if alpha is None or alpha == 0 else alpha
        self.register_buffer("alpha", torch.tensor(float(alpha)))
        self.scale = float(alpha) / lora_dim
        self.dropout = dropout
        self.rank_dropout = rank_dropout
        self.module_dropout = module_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        org_out = self._org_forward(x)
        if network_base.module_dropout_skips(self.module_dropout, self.training):
            return org_out
        lx = self.lora_down(x)
        if self.dropout and self.training:
            lx = torch.nn.functional.dropout(lx, p=self.dropout)
        scale = self.scale
        if self.rank_dropout and self.training:
            keep = (torch.rand((lx.shape[0], self.lora_dim), device=lx.device) > self.rank_dropout).to(lx.dtype)
            if lx.dim() == 4:  # conv: (batch, rank, h, w)
                keep = keep[:, :, None, None]
            elif lx.dim() == 3:  # tokens: (batch, tokens, rank)
                keep = keep[:, None, :]
            lx = lx * keep
            scale = scale / (1.0 - self.rank_dropout)  # keep the expected output unchanged
        return org_out + self.lora_up(lx) * (self.multiplier * scale)

    # -- hooks of networks.network_base ------------------------------------------------
    def loraplus_parameters(self) -> list[torch.nn.Parameter]:
        return [self.lora_up.weight]

    def max_norm_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lora_up.weight, self.lora_down.weight

    def merged_parameters(self, multiplier: float) -> dict[str, torch.Tensor]:
        parts = {"down": self.lora_down.weight, "up": self.lora_up.weight, "alpha": self.alpha}
        dtype = network_base.merge_dtype(self.org_module.weight.dtype)
        weight = fp8_base.frozen_weight(self.org_module, dtype)
        return {"weight": weight + multiplier * lora_delta(parts, dtype)}


class LoRANetwork(AdapterNetwork):
    """All LoRA modules for one UNet and its text encoders.

    Linear and 1x1 conv modules get ``lora_dim``/``alpha``; 3x3 convs of ResNet blocks
    and samplers are targeted only when ``conv_lora_dim`` is given (then the Linear
    and 1x1 modules of those blocks get ``lora_dim`` too, as in kohya).
    ``blocks`` (kohya's block-wise network_args) sizes UNet modules per block instead and sets
    their learning-rate weights. ``modules_dim``/``modules_alpha`` (from ``--dim_from_weights``)
    fix per-module ranks and restrict the network to the modules they name.
    ``make_module(target, dim, alpha)`` builds one module (default: a ``LoRAModule`` with the
    dropouts); networks.lora_fa and networks.dylora pass their own.
    """

    def __init__(
        self,
        text_encoders: list[torch.nn.Module],
        unet: torch.nn.Module,
        *,
        multiplier: float = 1.0,
        lora_dim: int = 4,
        alpha: float = 1.0,
        dropout: Optional[float] = None,
        rank_dropout: Optional[float] = None,
        module_dropout: Optional[float] = None,
        conv_lora_dim: Optional[int] = None,
        conv_alpha: Optional[float] = None,
        unet_module_names: Optional[Mapping[str, str]] = None,
        modules_dim: Optional[Mapping[str, int]] = None,
        modules_alpha: Optional[Mapping[str, float]] = None,
        blocks: Optional[BlockSettings] = None,
        make_module: Optional[Callable[[Target, int, float], torch.nn.Module]] = None,
        network_module: str = NETWORK_MODULE,
    ) -> None:
        if make_module is None:
            def make_module(target: Target, dim: int, module_alpha: float) -> torch.nn.Module:
                return LoRAModule(target.lora_name, target.module, multiplier, dim, module_alpha, dropout,
                                  rank_dropout, module_dropout)

        def size(target: Target, in_unet: bool) -> tuple[Optional[int], Optional[float]]:
            """(rank, alpha) of a target; rank None or 0: no module."""
            if modules_dim is not None:
                name = target.lora_name
                return (modules_dim[name], modules_alpha[name]) if name in modules_dim else (None, None)
            if in_unet and blocks is not None:
                return blocks.size(target)
            if target.kind != "conv":
                return lora_dim, alpha
            return (conv_lora_dim, conv_alpha) if conv_lora_dim else (None, None)

        def create(targets: list[Target], in_unet: bool) -> list[torch.nn.Module]:
            modules = []
            for target in targets:
                dim, module_alpha = size(target, in_unet)
                if not dim:
                    continue
                module = make_module(target, dim, module_alpha)
                if in_unet and blocks is not None and blocks.lr_weights is not None:
                    module.lr_block = blocks.index(target.lora_name)
                    module.lr_weight = blocks.lr_weights[module.lr_block]
                modules.append(module)
            return modules

        text_encoder_classes = network_base.TEXT_ENCODER_TARGET_MODULES if modules_dim is None else \
            tuple(type(encoder).__name__ for encoder in text_encoders)
        text_encoder_loras = [lora for targets in network_base.text_encoder_targets(text_encoders, text_encoder_classes)
                              for lora in create(targets, in_unet=False)]
        with_convs = blocks.conv_dims is not None if blocks is not None else conv_lora_dim
        unet_classes = network_base.UNET_TARGET_MODULES
        if with_convs:
            unet_classes = network_base.UNET_TARGET_MODULES + network_base.UNET_CONV_TARGET_MODULES
        if modules_dim is not None:  # a file's modules: wherever they are (converted LyCORIS files hold conv_in,
            unet_classes = (type(unet).__name__,)  # conv_out and the time embedding, which ComfyUI applies)
        unet_loras = create(network_base.unet_targets(unet, unet_module_names, unet_classes), in_unet=True)
        super().__init__(text_encoder_loras, unet_loras, multiplier, network_module)
        self.lora_dim = lora_dim
        self.alpha = alpha
        self.conv_lora_dim = conv_lora_dim
        self.conv_alpha = conv_alpha


# --------------------------------------------------------------------------- block-wise network_args
# kohya's UNet blocks: SD1.x/2.x 12 down + 1 mid + 12 up (25, diffusers names); SDXL
# 1 (embeddings) + 9 input + 3 middle + 9 output + 1 (out) = 23 (original names).
SD_BLOCKS, SD_MID_BLOCKS = 12, 1
SDXL_BLOCKS, SDXL_MID_BLOCKS = 9, 3
LR_WEIGHT_CURVES = ("cosine", "sine", "linear", "reverse_linear", "zeros")
BLOCKWISE_NETWORK_ARGS = ("block_dims", "block_alphas", "conv_block_dims", "conv_block_alphas", "down_lr_weight",
                          "mid_lr_weight", "up_lr_weight", "block_lr_zero_threshold")
_SD_BLOCK_NAME = re.compile(r"(up|down)_blocks_(\d+)_(resnets|upsamplers|downsamplers|attentions)_(\d+)_")


def block_count(is_sdxl: bool) -> int:
    return 1 + SDXL_BLOCKS * 2 + SDXL_MID_BLOCKS + 1 if is_sdxl else SD_BLOCKS * 2 + SD_MID_BLOCKS


def block_index(lora_name: str, is_sdxl: bool) -> int:
    """kohya's block of a UNet module name (``get_block_index``); -1 (the last entry) outside the blocks."""
    if is_sdxl:
        name = lora_name[len("lora_unet_"):] if lora_name.startswith("lora_unet_") else ""
        for prefix, first in (("input_blocks_", 1), ("middle_block_", 10), ("output_blocks_", 13)):
            if name.startswith(prefix):
                return first + int(name.split("_")[2])
        if name.startswith(("time_embed_", "label_emb_")):
            return 0
        return 22 if name.startswith("out_") else -1
    match = _SD_BLOCK_NAME.search(lora_name)
    if match:
        direction, level, kind, number = match.groups()
        index = 3 * int(level) + (2 if kind in ("upsamplers", "downsamplers") else int(number))
        return 1 + index if direction == "down" else SD_BLOCKS + 1 + index
    return SD_BLOCKS if "mid_block_" in lora_name else -1


def _lr_weight_curve(key: str, text: str, length: int) -> list[float]:
    """kohya's named lr weight curves: ``name`` or ``name+base`` over ``length`` blocks."""
    name, _, base = text.partition("+")
    try:
        offset = float(base) if base else 0.0
    except ValueError:
        offset = None
    if name not in LR_WEIGHT_CURVES or offset is None:
        raise UserError(f"--network_args {key}={text}: give comma-separated numbers or one of "
                        f"{', '.join(LR_WEIGHT_CURVES)} (optionally +base)")
    steps = [i / (length - 1) for i in range(length)]
    curve = {
        "cosine": [math.sin(math.pi * step / 2) for step in reversed(steps)],
        "sine": [math.sin(math.pi * step / 2) for step in steps],
        "linear": steps,
        "reverse_linear": list(reversed(steps)),
        "zeros": [0.0] * length,
    }[name]
    return [value + offset for value in curve]


def _given_lr_weights(network_args: Mapping[str, str], key: str, length: int) -> Optional[list[float]]:
    """``down/mid/up_lr_weight`` as given (a curve is evaluated at ``length`` blocks); None when absent.
    An empty list item is 0 (kohya)."""
    text = network_args.get(key)
    if text is None or text in ("", "None"):
        return None
    if "," not in text and key != "mid_lr_weight":
        return _lr_weight_curve(key, text, length)
    return network_base.read_list(network_args, key, float, empty=0.0)


def _lr_weights(network_args: Mapping[str, str], key: str, length: int, threshold: float) -> list[float]:
    """One of ``down/mid/up_lr_weight`` at ``length`` entries (kohya: longer lists are cut, shorter
    ones filled with 1; weights not above ``threshold`` become 0); all 1 when absent."""
    weights = _given_lr_weights(network_args, key, length)
    if weights is None:
        return [1.0] * length
    if len(weights) != length:
        print(f"--network_args {key}: {len(weights)} values for {length} blocks; "
              f"{'extra ones ignored' if len(weights) > length else 'missing ones set to 1'}")
        weights = (weights + [1.0] * length)[:length]
    return [weight if weight > threshold else 0.0 for weight in weights]


@dataclass(frozen=True)
class BlockSettings:
    """Per-block UNet ranks/alphas and learning-rate weights (lists indexed by ``block_index``)."""

    is_sdxl: bool
    dims: list[int]
    alphas: list[float]
    conv_dims: Optional[list[int]]  # None: 3x3 convs not trained
    conv_alphas: Optional[list[float]]
    lr_weights: Optional[list[float]]  # None: no block learning rates

    def index(self, lora_name: str) -> int:
        return block_index(lora_name, self.is_sdxl)

    def size(self, target: Target) -> tuple[Optional[int], Optional[float]]:
        index = self.index(target.lora_name)
        if target.kind != "conv":
            return self.dims[index], self.alphas[index]
        if self.conv_dims is None:
            return None, None
        return self.conv_dims[index], self.conv_alphas[index]


def block_settings(network_args: Mapping[str, str], is_sdxl: bool, network_dim: int, network_alpha: float,
                   conv_dim: Optional[int], conv_alpha: Optional[float]) -> Optional[BlockSettings]:
    """kohya's block-wise arguments, or None when none of ``block_dims`` and the lr weights is given
    (then block_alphas / conv_block_* are ignored, as in kohya). A block whose lr weight is 0 gets rank 0."""
    lr_keys = ("down_lr_weight", "mid_lr_weight", "up_lr_weight")
    has_lr_weights = any(network_args.get(key) not in (None, "", "None") for key in lr_keys)
    if network_args.get("block_dims") in (None, "", "None") and not has_lr_weights:
        return None
    count = block_count(is_sdxl)
    read = network_base.read_list
    dims = read(network_args, "block_dims", int, count) or [network_dim] * count
    alphas = read(network_args, "block_alphas", float, count) or [network_alpha] * count
    conv_dims = read(network_args, "conv_block_dims", int, count)
    if conv_dims is not None:
        conv_alphas = read(network_args, "conv_block_alphas", float, count) or [conv_alpha or 1.0] * count
    elif conv_dim is not None:
        conv_dims, conv_alphas = [conv_dim] * count, [conv_alpha] * count
    else:
        conv_alphas = None
    lr_weights = None
    if has_lr_weights:
        threshold = network_base.read_number(network_args, "block_lr_zero_threshold", float, default=0.0)
        sides = SDXL_BLOCKS if is_sdxl else SD_BLOCKS
        mid = SDXL_MID_BLOCKS if is_sdxl else SD_MID_BLOCKS
        lr_weights = (_lr_weights(network_args, "down_lr_weight", sides, threshold)
                      + _lr_weights(network_args, "mid_lr_weight", mid, threshold)
                      + _lr_weights(network_args, "up_lr_weight", sides, threshold))
        if is_sdxl:
            lr_weights = [1.0] + lr_weights + [1.0]  # embeddings and out: not block-weighted
        dims = [0 if weight == 0 else dim for dim, weight in zip(dims, lr_weights)]
        if conv_dims is not None:
            conv_dims = [0 if weight == 0 else dim for dim, weight in zip(conv_dims, lr_weights)]
    return BlockSettings(is_sdxl, dims, alphas, conv_dims, conv_alphas, lr_weights)


def dims_from_weights(weights: Mapping[str, torch.Tensor]) -> tuple[dict[str, int], dict[str, float]]:
    """Per-module rank and alpha of a LoRA state dict (for ``--dim_from_weights``)."""
    modules_dim, modules_alpha = {}, {}
    for key, value in weights.items():
        name, _, kind = key.partition(".")
        if kind == "lora_down.weight":
            modules_dim[name] = value.shape[0]
        elif kind == "alpha":
            modules_alpha[name] = float(value)
    for name, dim in modules_dim.items():
        modules_alpha.setdefault(name, float(dim))
    return modules_dim, modules_alpha


DROPOUT_NETWORK_ARGS = ("rank_dropout", "module_dropout")
KNOWN_NETWORK_ARGS = ("conv_dim", "conv_alpha", *DROPOUT_NETWORK_ARGS, *BLOCKWISE_NETWORK_ARGS, *LORAPLUS_NETWORK_ARGS)


def validate_network_args(network_args: Mapping[str, str], known: tuple[str, ...] = KNOWN_NETWORK_ARGS,
                          network_module: str = NETWORK_MODULE) -> None:
    """Refuse unknown or malformed ``--network_args`` before any model is loaded (list lengths
    depend on the model: checked when the network is built)."""
    network_base.check_known_args(network_args, known, network_module)
    for key in ("conv_dim", *DROPOUT_NETWORK_ARGS, "conv_alpha", "block_lr_zero_threshold"):
        network_base.read_number(network_args, key, int if key == "conv_dim" else float)
    for key in ("block_dims", "conv_block_dims"):
        network_base.read_list(network_args, key, int)
    for key in ("block_alphas", "conv_block_alphas"):
        network_base.read_list(network_args, key, float)
    for key in ("down_lr_weight", "mid_lr_weight", "up_lr_weight"):
        _given_lr_weights(network_args, key, SDXL_BLOCKS)
    if any(key in known for key in LORAPLUS_NETWORK_ARGS):
        loraplus_ratios(network_args)


def lora_options(network_args: Mapping[str, str], network_dim: Optional[int], network_alpha: Optional[float],
                 unet_module_names: Optional[Mapping[str, str]]) -> dict:
    """LoRANetwork keyword arguments from kohya's LoRA network_args (shared by networks.lora_fa)."""
    network_dim = network_dim or 4
    network_alpha = network_alpha if network_alpha is not None else 1.0
    conv_dim = network_base.read_number(network_args, "conv_dim", int)
    conv_alpha = network_base.read_number(network_args, "conv_alpha", float)
    if conv_dim and conv_alpha is None:
        conv_alpha = 1.0
    return dict(
        lora_dim=network_dim,
        alpha=network_alpha,
        rank_dropout=network_base.read_number(network_args, "rank_dropout", float),
        module_dropout=network_base.read_number(network_args, "module_dropout", float),
        conv_lora_dim=conv_dim,
        conv_alpha=conv_alpha,
        unet_module_names=unet_module_names,
        # SDXL is named after the original layout (the trainer passes its name map)
        blocks=block_settings(network_args, unet_module_names is not None, network_dim, network_alpha, conv_dim,
                              conv_alpha),
    )


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
) -> LoRANetwork:
    """kohya's ``create_network`` entry point: ``network_args`` are the ``--network_args`` strings."""
    validate_network_args(network_args)
    return LoRANetwork(text_encoders, unet, multiplier=multiplier, dropout=neuron_dropout,
                       **lora_options(network_args, network_dim, network_alpha, unet_module_names))


def create_network_from_weights(
    multiplier: float,
    weights: Mapping[str, torch.Tensor],
    text_encoders: list[torch.nn.Module],
    unet: torch.nn.Module,
    unet_module_names: Optional[Mapping[str, str]] = None,
    **network_args: str,
) -> LoRANetwork:
    """A network shaped like a saved file (``--dim_from_weights``, merging): same modules, ranks and
    alphas. Of ``network_args`` the dropouts and block learning-rate weights apply (kohya: the
    same); the shape comes from the file."""
    validate_network_args(network_args)
    modules_dim, modules_alpha = dims_from_weights(weights)
    options = lora_options(network_args, None, None, unet_module_names)  # dropouts and block lr weights
    return LoRANetwork(text_encoders, unet, multiplier=multiplier, modules_dim=modules_dim, modules_alpha=modules_alpha,
                       **options)


# --------------------------------------------------------------------------- offline tools
# Shared by networks/check_lora_weights.py, resize_lora.py and merge_lora.py.


LORA_TENSOR_KINDS = {"lora_down.weight": "down", "lora_up.weight": "up", "alpha": "alpha"}


def is_plain_lora(weights: Mapping[str, torch.Tensor]) -> bool:
    """Whether every module of a state dict is a plain LoRA module (``LORA_TENSOR_KINDS`` only)."""
    return bool(weights) and all(key.partition(".")[2] in LORA_TENSOR_KINDS for key in weights)


def lora_modules(weights: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Group a kohya LoRA state dict by module: ``{lora_name: {"down", "up", "alpha"?}}`` in file order.

    Raises ``UserError`` naming the module when a down or up weight is missing, or when a module
    holds other tensors too (LyCORIS LoCon's Tucker ``lora_mid`` or DoRA ``dora_scale``): the
    tools built on this would silently drop them.
    """
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in weights.items():
        name, _, kind = key.partition(".")
        if kind in LORA_TENSOR_KINDS:
            modules.setdefault(name, {})[LORA_TENSOR_KINDS[kind]] = value
    for key in weights:
        name, _, kind = key.partition(".")
        if name in modules and kind not in LORA_TENSOR_KINDS:
            raise UserError(f"LoRA module {name} also holds {kind} (a LyCORIS LoCon with use_tucker/dora_wd?): "
                            f"only plain LoRA modules (lora_down, lora_up, alpha) are handled here")
    for name, parts in modules.items():
        if "down" not in parts or "up" not in parts:
            missing = "lora_down.weight" if "down" not in parts else "lora_up.weight"
            raise UserError(f"LoRA module {name} has no {missing}; the file is incomplete or not a kohya LoRA")
    return modules


def module_scale(parts: Mapping[str, torch.Tensor]) -> float:
    """alpha / rank of one module (alpha defaults to the rank, as in kohya)."""
    rank = parts["down"].shape[0]
    alpha = float(parts["alpha"]) if "alpha" in parts else float(rank)
    return alpha / rank


def lora_delta(parts: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight change ``up @ down * alpha / rank`` in the wrapped module's weight shape
    (``(out, in)`` for Linear, ``(out, in, kh, kw)`` for Conv2d), computed in ``dtype``."""
    down, up = parts["down"].to(dtype), parts["up"].to(dtype)
    delta = up.reshape(up.shape[0], -1) @ down.reshape(down.shape[0], -1)
    if down.dim() == 4:
        delta = delta.reshape(up.shape[0], *down.shape[1:])
    return delta * module_scale(parts)
