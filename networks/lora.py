"""LoRA network in kohya-ss sd-scripts' format: target modules, key names, scale, save/load.

A LoRA module wraps one Linear/Conv2d of the frozen model by replacing its ``forward``
(the original module is not re-registered, so no weight is stored twice) and adds
``up(down(x)) * multiplier * alpha / dim``. Keys are kohya's:
``<lora_name>.lora_down.weight``, ``<lora_name>.lora_up.weight``, ``<lora_name>.alpha``,
with ``lora_name`` = prefix + module path, dots replaced by underscores. SDXL UNet
paths use the original (single-file) block names, SD1.x/2.x UNet paths the diffusers
ones, exactly as kohya's trainers name them.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save

from library.errors import UserError

UNET_TARGET_MODULES = ("Transformer2DModel",)
UNET_CONV_TARGET_MODULES = ("ResnetBlock2D", "Downsample2D", "Upsample2D")
TEXT_ENCODER_TARGET_MODULES = ("CLIPAttention", "CLIPSdpaAttention", "CLIPMLP")

PREFIX_UNET = "lora_unet"
PREFIX_TEXT_ENCODER = "lora_te"  # SD1.x/2.x; SDXL uses lora_te1 / lora_te2


class LoRAModule(torch.nn.Module):
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
        super().__init__()
        self.lora_name = lora_name
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
        self.multiplier = multiplier
        self.dropout = dropout
        self.rank_dropout = rank_dropout
        self.module_dropout = module_dropout
        # A plain list keeps the wrapped module out of this module's children and state dict.
        self._org_module = [org_module]
        self._org_forward = None

    def apply_to(self) -> None:
        """Route the wrapped module's forward through this adapter."""
        org_module = self._org_module[0]
        self._org_forward = org_module.forward
        org_module.forward = self.forward

    def restore(self) -> None:
        """Undo ``apply_to``: the wrapped module computes its original output again."""
        if self._org_forward is not None:
            self._org_module[0].forward = self._org_forward
            self._org_forward = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        org_out = self._org_forward(x)
        if self.module_dropout and self.training and torch.rand(()) < self.module_dropout:
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


def _lora_targets(
    root: torch.nn.Module,
    prefix: str,
    target_classes: Iterable[str],
    rename: Optional[Callable[[str], str]] = None,
) -> list[tuple[str, torch.nn.Module]]:
    """(lora_name, module) for every Linear/Conv2d inside a module of a target class.

    ``rename`` maps a module path to the one the key is named after.
    """
    targets = []
    seen = set()
    target_classes = tuple(target_classes)
    for name, module in root.named_modules():
        if module.__class__.__name__ not in target_classes:
            continue
        for child_name, child in module.named_modules():
            if not isinstance(child, (torch.nn.Linear, torch.nn.Conv2d)) or not child_name:
                continue
            path = f"{name}.{child_name}" if name else child_name
            if path in seen:
                continue
            seen.add(path)
            if rename is not None:
                path = rename(path)
            targets.append((f"{prefix}.{path}".replace(".", "_"), child))
    return targets


def _text_model_path(path: str) -> str:
    """kohya names text encoder modules ``text_model.encoder...``; transformers 5's
    CLIPTextModel has dropped the ``text_model.`` level from its module paths."""
    return path if path.startswith("text_model.") else f"text_model.{path}"


def _is_linear_like(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear) or (
        isinstance(module, torch.nn.Conv2d) and tuple(module.kernel_size) == (1, 1)
    )


@dataclass(frozen=True)
class MaxNormStats:
    """What ``LoRANetwork.apply_max_norm_regularization`` did: 0-dim tensors on the network's
    device, so that reading them (``.item()``, only when logging) is the caller's choice of sync."""

    keys_scaled: torch.Tensor  # int64: number of modules scaled down
    mean_norm: torch.Tensor  # mean over modules of ||delta W||_F after scaling
    max_norm: torch.Tensor  # max over modules of the same


class LoRANetwork(torch.nn.Module):
    """All LoRA modules for one UNet and its text encoders.

    Linear and 1x1 conv modules get ``lora_dim``/``alpha``; 3x3 convs of ResNet blocks
    and samplers are targeted only when ``conv_lora_dim`` is given (then the Linear
    and 1x1 modules of those blocks get ``lora_dim`` too, as in kohya).
    ``modules_dim``/``modules_alpha`` (from ``--dim_from_weights``) fix per-module
    ranks and restrict the network to the modules they name.
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
    ) -> None:
        super().__init__()
        self.multiplier = multiplier
        self.lora_dim = lora_dim
        self.alpha = alpha
        self.conv_lora_dim = conv_lora_dim
        self.conv_alpha = conv_alpha

        def create(targets: list[tuple[str, torch.nn.Module]]) -> list[LoRAModule]:
            modules = []
            for lora_name, child in targets:
                if modules_dim is not None:
                    if lora_name not in modules_dim:
                        continue
                    dim, module_alpha = modules_dim[lora_name], modules_alpha[lora_name]
                elif _is_linear_like(child):
                    dim, module_alpha = lora_dim, alpha
                elif conv_lora_dim:
                    dim, module_alpha = conv_lora_dim, conv_alpha
                else:
                    continue
                modules.append(
                    LoRAModule(lora_name, child, multiplier, dim, module_alpha, dropout, rank_dropout, module_dropout)
                )
            return modules

        self.text_encoder_loras: list[LoRAModule] = []
        for index, text_encoder in enumerate(text_encoders):
            prefix = PREFIX_TEXT_ENCODER if len(text_encoders) == 1 else f"{PREFIX_TEXT_ENCODER}{index + 1}"
            self.text_encoder_loras += create(
                _lora_targets(text_encoder, prefix, TEXT_ENCODER_TARGET_MODULES, _text_model_path)
            )

        unet_classes = UNET_TARGET_MODULES
        if conv_lora_dim or modules_dim is not None:
            unet_classes = UNET_TARGET_MODULES + UNET_CONV_TARGET_MODULES
        rename = unet_module_names.__getitem__ if unet_module_names is not None else None
        self.unet_loras: list[LoRAModule] = create(_lora_targets(unet, PREFIX_UNET, unet_classes, rename))

        for lora in self.text_encoder_loras + self.unet_loras:
            if lora.lora_name in self._modules:
                raise ValueError(f"duplicate LoRA module name {lora.lora_name}")
            self.add_module(lora.lora_name, lora)
        self._max_norm_groups: Optional[list[list[LoRAModule]]] = None  # see apply_max_norm_regularization

    # -- wiring --------------------------------------------------------------------
    def apply_to(self, apply_text_encoder: bool = True, apply_unet: bool = True) -> None:
        """Hook the adapters into the model; the parts not applied are dropped."""
        if not apply_text_encoder:
            self._drop(self.text_encoder_loras)
            self.text_encoder_loras = []
        if not apply_unet:
            self._drop(self.unet_loras)
            self.unet_loras = []
        self._max_norm_groups = None  # the module lists may have changed
        for lora in self.text_encoder_loras + self.unet_loras:
            lora.apply_to()

    def _drop(self, loras: list[LoRAModule]) -> None:
        for lora in loras:
            del self._modules[lora.lora_name]

    def restore(self) -> None:
        for lora in self.text_encoder_loras + self.unet_loras:
            lora.restore()

    def set_multiplier(self, multiplier: float) -> None:
        self.multiplier = multiplier
        for lora in self.text_encoder_loras + self.unet_loras:
            lora.multiplier = multiplier

    def prepare_optimizer_params(
        self, text_encoder_lr: Optional[list[float]], unet_lr: Optional[float], default_lr: float,
        loraplus: tuple[Optional[float], Optional[float]] = (None, None),
    ) -> list[dict]:
        """Parameter groups: one per text encoder, one for the UNet (kohya's lr rules).

        ``text_encoder_lr`` may hold one value for all text encoders or one per encoder;
        a missing value falls back to ``default_lr``. ``loraplus``: the (text encoder, UNet)
        LoRA+ ratios (see ``loraplus_ratios``): a part with a ratio gets a second group, its
        lora_up weights at lr * ratio. A part whose lr is 0 is not trained (kohya): its
        parameters get no group and ``requires_grad`` False.
        """
        parts: list[tuple[list[LoRAModule], float, Optional[float]]] = []
        if self.text_encoder_loras:
            by_prefix: dict[str, list[LoRAModule]] = {}
            for lora in self.text_encoder_loras:
                by_prefix.setdefault(lora.lora_name.split("_")[1], []).append(lora)
            for index, loras in enumerate(by_prefix.values()):
                lr = default_lr
                if text_encoder_lr:
                    lr = text_encoder_lr[min(index, len(text_encoder_lr) - 1)]
                parts.append((loras, lr, loraplus[0]))
        if self.unet_loras:
            parts.append((self.unet_loras, unet_lr if unet_lr is not None else default_lr, loraplus[1]))
        groups = []
        for loras, lr, ratio in parts:
            if lr == 0:
                for lora in loras:
                    lora.requires_grad_(False)
                continue
            up = [lora.lora_up.weight for lora in loras] if ratio is not None else []
            up_ids = {id(weight) for weight in up}
            rest = [p for lora in loras for p in lora.parameters() if id(p) not in up_ids]
            groups.append({"params": rest, "lr": lr})
            if up:
                groups.append({"params": up, "lr": lr * ratio})
        return groups

    # -- max-norm regularisation (--scale_weight_norms) --------------------------------
    @torch.no_grad()
    def apply_max_norm_regularization(self, max_norm: float) -> MaxNormStats:
        """Scale down every LoRA module whose weight change is larger than ``max_norm``.

        Same result as kohya's ``apply_max_norm_regularization``: with ``W = up @ down * alpha / rank``
        (conv weights flattened to ``(out, rank)`` @ ``(rank, in*kh*kw)``), a module with
        ``||W||_F > max_norm`` gets both weights multiplied in place by ``sqrt(max_norm / ||W||_F)``,
        so its ``||W||_F`` becomes ``max_norm``; the others are left bit-identical. Returns the
        number of modules scaled and the mean and max of ``||W||_F`` after scaling, as device
        tensors: nothing here waits for the GPU, as this runs after every optimizer step.
        """
        if self._max_norm_groups is None:
            # Modules whose flattened (out, rank, k) shapes agree are stacked for one bmm; the
            # modules are fixed once built (apply_to resets this), so group them only once.
            groups: dict[tuple[int, int, int], list[LoRAModule]] = {}
            for lora in self.text_encoder_loras + self.unet_loras:
                up, down = lora.lora_up.weight, lora.lora_down.weight
                groups.setdefault((up.shape[0], down.shape[0], down[0].numel()), []).append(lora)
            self._max_norm_groups = list(groups.values())
        loras = [lora for group in self._max_norm_groups for lora in group]  # the order of `norms`
        if not loras:
            zero = torch.zeros(())
            return MaxNormStats(zero.long(), zero, zero)

        unscaled = []  # ||up @ down||_F / rank per module, group by group
        for group in self._max_norm_groups:
            rank = group[0].lora_dim
            # Weights are read here, not cached: .to() and load_state_dict(assign=True) replace tensors.
            up = torch.stack([lora.lora_up.weight.reshape(-1, rank) for lora in group]).float()
            down = torch.stack([lora.lora_down.weight.reshape(rank, -1) for lora in group]).float()
            # ||U D||_F^2 = trace(U^T U D D^T) = sum((U^T U) * (D D^T)): two rank x rank Gram
            # matrices instead of the (out x k) product.
            squared = (torch.bmm(up.mT, up) * torch.bmm(down, down.mT)).sum((1, 2))
            unscaled.append(squared.clamp(min=0).sqrt() / rank)  # clamp: rounding can dip below 0
        # alpha from the buffer, as kohya reads it from the state dict (it is what the file holds).
        norms = torch.cat(unscaled) * torch.stack([lora.alpha for lora in loras]).float().abs()

        # kohya's arithmetic: ratio is exactly 1 unless norm > max_norm, and max_norm / norm then.
        clamped = norms.clamp(min=max_norm / 2)
        ratio = clamped.clamp(max=max_norm) / clamped
        # Multiplying by sqrt(1) = 1 leaves a weight bit-identical, so every module is multiplied
        # and no Python branch on a device value is needed.
        factors = list(ratio.sqrt().unbind())
        torch._foreach_mul_([lora.lora_up.weight for lora in loras], factors)
        torch._foreach_mul_([lora.lora_down.weight for lora in loras], factors)
        scaled_norms = norms * ratio
        return MaxNormStats((ratio != 1).sum(), scaled_norms.mean(), scaled_norms.max())

    # -- files ---------------------------------------------------------------------
    def lora_state_dict(self, dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
        """Detached CPU copies of every key, cast to ``dtype`` when given."""
        state = {}
        for key, value in self.state_dict().items():
            value = value.detach().to("cpu")
            if dtype is not None:
                value = value.to(dtype)
            state[key] = value.contiguous()
        return state

    def load_weights(self, path: str) -> None:
        """Load a kohya LoRA file into this network; every key and shape must match."""
        weights = read_lora_file(path)
        own = self.state_dict()
        missing = sorted(set(own) - set(weights))
        unexpected = sorted(set(weights) - set(own))
        if missing or unexpected:
            detail = f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}"
            raise UserError(
                f"--network_weights {path}: keys do not match this network ({len(missing)} missing, "
                f"{len(unexpected)} unexpected; {detail}); check --network_dim, --network_args and the base model"
            )
        for key, value in weights.items():
            if value.shape != own[key].shape:
                raise UserError(
                    f"--network_weights {path}: {key} has shape {tuple(value.shape)}, this network needs "
                    f"{tuple(own[key].shape)}; pass the file's rank with --network_dim or use --dim_from_weights"
                )
            # The modules' output scale was fixed from --network_alpha when they were built; a
            # different alpha in the file would be saved back while training used the other one.
            # Compared in the file's dtype: a bf16/fp16 file stores the alpha rounded.
            if key.endswith(".alpha") and not torch.equal(own[key].to(value.dtype), value):
                raise UserError(
                    f"--network_weights {path}: {key} is {float(value):g}, this network's is {float(own[key]):g}; "
                    f"pass the file's alpha with --network_alpha (conv_alpha for conv modules) or use "
                    f"--dim_from_weights"
                )
        self.load_state_dict({k: v.to(own[k].dtype) for k, v in weights.items()}, strict=True)


def read_lora_file(path: str) -> dict[str, torch.Tensor]:
    """All tensors of a LoRA safetensors file; a missing or corrupt file is a UserError."""
    if not os.path.isfile(path):
        raise UserError(f"LoRA file {path} does not exist")
    try:
        with safe_open(path, framework="pt", device="cpu") as file:
            return {key: file.get_tensor(key) for key in file.keys()}
    except Exception as error:  # safetensors raises several types for damaged files
        raise UserError(f"LoRA file {path} is not a readable safetensors file ({error})") from None


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


def find_non_finite(state: Mapping[str, torch.Tensor]) -> Optional[str]:
    """Name of the first LoRA module holding NaN/Inf, or None when all are finite."""
    for key, value in state.items():
        if value.is_floating_point() and not torch.isfinite(value).all():
            return key.partition(".")[0]
    return None


def canonical_safetensors_bytes(state: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> bytes:
    """A safetensors file whose header JSON has sorted keys, so equal contents give equal bytes.

    safetensors writes the metadata map in a per-process random order; a resumed run must be
    able to reproduce an uninterrupted run's file byte for byte. Tensor offsets are relative
    to the end of the header, so rewriting the header leaves the data untouched.
    """
    data = save(dict(state), dict(metadata))
    header_length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_length])
    canonical = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    canonical += b" " * (-len(canonical) % 8)  # the format pads the header to 8 bytes
    return len(canonical).to_bytes(8, "little") + canonical + data[8 + header_length :]


def save_lora_file(state: Mapping[str, torch.Tensor], path: str, metadata: Mapping[str, str]) -> None:
    """Write a LoRA safetensors file atomically (temp name in the same folder, then rename).

    Refuses non-finite weights so that a diverged run never replaces a good file.
    """
    bad_module = find_non_finite(state)
    if bad_module is not None:
        raise FloatingPointError(f"not saving {path}: LoRA module {bad_module} holds NaN/Inf")
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    temp_path = os.path.join(directory, f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        with open(temp_path, "wb") as file:
            file.write(canonical_safetensors_bytes(state, metadata))
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp_path, path)
    finally:
        if os.path.exists(temp_path):
            os.remove(temp_path)


def parse_network_args(pairs: Optional[list[str]]) -> dict[str, str]:
    """``--network_args key=value ...`` as a dict of strings; a malformed item is a UserError."""
    parsed = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--network_args: '{pair}' is not key=value (e.g. conv_dim=4 conv_alpha=1)")
        parsed[key.strip()] = value.strip()
    return parsed


def _optional_number(network_args: Mapping[str, str], key: str, kind: type):
    if key not in network_args or network_args[key] in ("", "None"):
        return None
    try:
        value = kind(network_args[key])
    except ValueError:
        raise UserError(f"--network_args {key}={network_args[key]} is not a {kind.__name__}") from None
    if value < 0 or (kind is float and key.endswith("dropout") and value >= 1):
        raise UserError(f"--network_args {key}={network_args[key]} is out of range")
    return value


LORAPLUS_NETWORK_ARGS = ("loraplus_lr_ratio", "loraplus_unet_lr_ratio", "loraplus_text_encoder_lr_ratio")
KNOWN_NETWORK_ARGS = ("conv_dim", "conv_alpha", "rank_dropout", "module_dropout", *LORAPLUS_NETWORK_ARGS)
# kohya's block-wise options for networks.lora, not implemented here (refused by name, not as unknown).
BLOCKWISE_NETWORK_ARGS = ("block_dims", "block_alphas", "conv_block_dims", "conv_block_alphas", "down_lr_weight",
                          "mid_lr_weight", "up_lr_weight", "block_lr_zero_threshold")


def loraplus_ratios(network_args: Mapping[str, str]) -> tuple[Optional[float], Optional[float]]:
    """LoRA+ (kohya's network_args): the (text encoder, UNet) multipliers of the lora_up learning
    rate; a part-specific ratio wins over ``loraplus_lr_ratio``. None: plain LoRA for that part."""
    ratios = {key: _optional_number(network_args, key, float) for key in LORAPLUS_NETWORK_ARGS}
    for key, ratio in ratios.items():
        if ratio is not None and not ratio > 0:
            raise UserError(f"--network_args {key}={network_args[key]} must be a positive number")
    general = ratios["loraplus_lr_ratio"]
    text_encoder, unet = ratios["loraplus_text_encoder_lr_ratio"], ratios["loraplus_unet_lr_ratio"]
    return (text_encoder if text_encoder is not None else general, unet if unet is not None else general)


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
    blockwise = sorted(set(network_args) & set(BLOCKWISE_NETWORK_ARGS))
    if blockwise:
        raise UserError(f"--network_args {blockwise[0]}: block-wise ranks and learning rates are not supported "
                        f"by this trainer (supported: {', '.join(KNOWN_NETWORK_ARGS)})")
    unknown = sorted(set(network_args) - set(KNOWN_NETWORK_ARGS))
    if unknown:
        raise UserError(f"--network_args: unknown key {unknown[0]} (valid: {', '.join(KNOWN_NETWORK_ARGS)})")
    conv_dim = _optional_number(network_args, "conv_dim", int)
    conv_alpha = _optional_number(network_args, "conv_alpha", float)
    if conv_dim and conv_alpha is None:
        conv_alpha = 1.0
    return LoRANetwork(
        text_encoders,
        unet,
        multiplier=multiplier,
        lora_dim=network_dim or 4,
        alpha=network_alpha if network_alpha is not None else 1.0,
        dropout=neuron_dropout,
        rank_dropout=_optional_number(network_args, "rank_dropout", float),
        module_dropout=_optional_number(network_args, "module_dropout", float),
        conv_lora_dim=conv_dim,
        conv_alpha=conv_alpha,
        unet_module_names=unet_module_names,
    )


def create_network_from_weights(
    multiplier: float,
    weights: Mapping[str, torch.Tensor],
    text_encoders: list[torch.nn.Module],
    unet: torch.nn.Module,
    unet_module_names: Optional[Mapping[str, str]] = None,
) -> LoRANetwork:
    """A network shaped like a saved file (``--dim_from_weights``): same modules, ranks and alphas."""
    modules_dim, modules_alpha = dims_from_weights(weights)
    return LoRANetwork(
        text_encoders,
        unet,
        multiplier=multiplier,
        unet_module_names=unet_module_names,
        modules_dim=modules_dim,
        modules_alpha=modules_alpha,
    )


# --------------------------------------------------------------------------- offline tools
# Shared by networks/check_lora_weights.py, resize_lora.py and merge_lora.py.


def lora_modules(weights: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Group a kohya LoRA state dict by module: ``{lora_name: {"down", "up", "alpha"?}}`` in file order.

    Raises ``UserError`` naming the module when a down or up weight is missing.
    """
    kinds = {"lora_down.weight": "down", "lora_up.weight": "up", "alpha": "alpha"}
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in weights.items():
        name, _, kind = key.partition(".")
        if kind in kinds:
            modules.setdefault(name, {})[kinds[kind]] = value
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
