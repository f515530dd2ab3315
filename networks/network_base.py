"""The layer every network type shares: targets, kohya naming, the network container, files, arguments.

A network type (``networks.lora``, ``networks.loha``, ...) builds one adapter module per target
and hands them to :class:`AdapterNetwork`, which does the rest the trainer needs: hooking the
modules in, optimizer parameter groups (kohya's learning-rate rules, LoRA+), max-norm, the
state dict that is saved, loading a file, and merging into the model.

Adapter modules are duck-typed, so that a type may hold modules of another library (LyCORIS):
each has ``lora_name`` (its key prefix in files), ``multiplier``, ``apply_to()`` (route the
wrapped module's forward through the adapter), ``restore()`` (undo it) and parameters/buffers
(its state dict is the file's ``<lora_name>.*`` keys). Optional per-module hooks, each with an
:class:`AdapterNetwork` method of the same name a subclass may override instead:

* ``loraplus_parameters() -> list[Parameter]``: the "up" parameters LoRA+ trains at
  ``lr * ratio``; absent or empty: the type has none and LoRA+ ratios are refused.
* ``max_norm_weights() -> (up, down)``: the factors of ``delta W = up @ down * alpha / rank``
  (any shapes whose first dimensions are out and rank); absent: ``--scale_weight_norms`` is refused.
* ``merged_parameters(multiplier) -> {"weight": W', ...}``: the wrapped module's parameters
  with the adapter merged in (in ``merge_dtype``), for ``networks/merge_lora.py`` and ``--base_weights``.
* ``lr_block`` / ``lr_weight`` / ``lr_override`` (attributes, default None / 1 / None): the
  module's learning rate is ``lr_override`` or its part's lr times ``lr_weight``; modules of a
  part with equal (block, weight, override) share an optimizer group (kohya's block-wise
  ``down_lr_weight``/``mid_lr_weight``/``up_lr_weight``, and ``network_reg_lrs``).
* ``wrapped_module``: the network method giving the wrapped Linear/Conv2d (default ``lora.org_module``),
  and ``frozen_weight``: its base weight (default: the wrapped module's, dequantized from float8).

Naming is kohya's: ``<prefix>_<module path with dots as underscores>``; prefixes ``lora_unet``,
``lora_te`` (SD1.x/2.x) or ``lora_te1``/``lora_te2`` (SDXL). SDXL UNet paths are the original
(single-file, SGM) block names, given by the trainer as ``unet_module_names``; text encoder paths
keep the ``text_model.`` level that transformers 5 dropped.
"""
from __future__ import annotations

import ast
import io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional, Sequence, TypeVar

import torch
from safetensors import safe_open
from safetensors.torch import save

from library import atomic_files, checkpoint_files, fp8_base
from library.config_file import boolean_word, key_value_items
from library.errors import UserError, first_line

UNET_TARGET_MODULES = ("Transformer2DModel",)
UNET_CONV_TARGET_MODULES = ("ResnetBlock2D", "Downsample2D", "Upsample2D")
TEXT_ENCODER_TARGET_MODULES = ("CLIPAttention", "CLIPSdpaAttention", "CLIPMLP")

PREFIX_UNET = "lora_unet"
PREFIX_TEXT_ENCODER = "lora_te"  # SD1.x/2.x; SDXL uses lora_te1 / lora_te2


# --------------------------------------------------------------------------- targets
@dataclass(frozen=True)
class Target:
    """One Linear/Conv2d of the model an adapter may wrap."""

    lora_name: str  # kohya's key prefix, e.g. lora_unet_input_blocks_4_1_proj_in
    module: torch.nn.Module
    path: str  # kohya's module path (dots, no prefix), e.g. input_blocks.4.1.proj_in; what regex options match

    @property
    def kind(self) -> str:
        """"linear", "conv1x1" or "conv" (any other kernel size): kohya sizes them differently."""
        if isinstance(self.module, torch.nn.Linear):
            return "linear"
        return "conv1x1" if tuple(self.module.kernel_size) == (1, 1) else "conv"


def find_targets(
    root: torch.nn.Module,
    prefix: str,
    target_classes: Iterable[str],
    rename: Optional[Callable[[str], str]] = None,
) -> list[Target]:
    """Every Linear/Conv2d inside a module whose class name is in ``target_classes``, in module order.

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
            targets.append(Target(f"{prefix}.{path}".replace(".", "_"), child, path))
    return targets


def text_model_path(path: str) -> str:
    """kohya names text encoder modules ``text_model.encoder...``; transformers 5's
    CLIPTextModel has dropped the ``text_model.`` level from its module paths."""
    return path if path.startswith("text_model.") else f"text_model.{path}"


def text_encoder_prefixes(count: int, base: str = PREFIX_TEXT_ENCODER) -> list[str]:
    """``lora_te`` for one text encoder, ``lora_te1``/``lora_te2`` for SDXL's two."""
    return [base] if count == 1 else [f"{base}{index + 1}" for index in range(count)]


def text_encoder_targets(
    text_encoders: Sequence[torch.nn.Module],
    target_classes: Iterable[str] = TEXT_ENCODER_TARGET_MODULES,
    base_prefix: str = PREFIX_TEXT_ENCODER,
) -> list[list[Target]]:
    """The targets of each text encoder (one list per encoder), named with its kohya prefix."""
    prefixes = text_encoder_prefixes(len(text_encoders), base_prefix)
    return [find_targets(encoder, prefix, target_classes, text_model_path)
            for encoder, prefix in zip(text_encoders, prefixes)]


def unet_targets(
    unet: torch.nn.Module,
    unet_module_names: Optional[Mapping[str, str]],
    target_classes: Iterable[str] = UNET_TARGET_MODULES,
    prefix: str = PREFIX_UNET,
) -> list[Target]:
    """The UNet's targets; ``unet_module_names`` (SDXL) maps diffusers paths to the original layout's."""
    rename = unet_module_names.__getitem__ if unet_module_names is not None else None
    return find_targets(unet, prefix, target_classes, rename)


# --------------------------------------------------------------------------- adapter modules
class AdapterModule(torch.nn.Module):
    """Base of this project's adapter modules: wraps one Linear/Conv2d by replacing its ``forward``.

    The wrapped module is not registered as a child (a plain list holds it), so its weight is
    not stored twice and the state dict holds only the adapter's own tensors. Subclasses
    implement ``forward(x)`` with ``self.org_forward(x)`` as the frozen output.
    """

    def __init__(self, lora_name: str, org_module: torch.nn.Module, multiplier: float) -> None:
        super().__init__()
        self.lora_name = lora_name
        self.multiplier = multiplier
        self._org_module = [org_module]
        self._org_forward: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    @property
    def org_module(self) -> torch.nn.Module:
        """The wrapped Linear/Conv2d."""
        return self._org_module[0]

    def org_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._org_forward(x)

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


def conv_or_linear(org_module: torch.nn.Module, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x`` through a layer shaped like ``org_module`` (same stride, padding...) with ``weight``, no bias."""
    if isinstance(org_module, torch.nn.Conv2d):
        return torch.nn.functional.conv2d(x, weight, None, org_module.stride, org_module.padding,
                                          org_module.dilation, org_module.groups)
    return torch.nn.functional.linear(x, weight)


def merge_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype a merge into weights of ``weight_dtype`` is computed in: float32, or float64 for float64
    weights. fp16/bf16/float8 weights are merged in float32 and cast back once; a float64 model keeps
    its precision."""
    return torch.float64 if weight_dtype == torch.float64 else torch.float32


def module_dropout_skips(module_dropout: Optional[float], training: bool) -> bool:
    """kohya's module dropout: during training the whole adapter is skipped with this probability."""
    return bool(module_dropout) and training and bool(torch.rand(()) < module_dropout)


class WeightDeltaModule(AdapterModule):
    """An adapter whose change is a whole weight delta (LoHa, LoKr): ``out + layer(x, delta) * multiplier``.

    Subclasses implement ``delta_weight()``: the change in the wrapped weight's shape, already
    scaled by ``alpha / lora_dim``. kohya's rank dropout drops output rows of the delta; module
    dropout skips the adapter.
    """

    def __init__(self, lora_name: str, org_module: torch.nn.Module, multiplier: float, lora_dim: int,
                 alpha: Optional[float], rank_dropout: Optional[float] = None,
                 module_dropout: Optional[float] = None) -> None:
        super().__init__(lora_name, org_module, multiplier)
        self.lora_dim = lora_dim
        alpha = lora_dim if alpha is None or alpha == 0 else float(alpha)
        self.register_buffer("alpha", torch.tensor(float(alpha)))
        self.scale = float(alpha) / lora_dim
        self.rank_dropout = rank_dropout
        self.module_dropout = module_dropout

    def delta_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        org_out = self.org_forward(x)
        if module_dropout_skips(self.module_dropout, self.training):
            return org_out
        delta = self.delta_weight()
        factor = self.multiplier
        if self.rank_dropout and self.training:
            keep = (torch.rand(delta.shape[0], device=delta.device) > self.rank_dropout).to(delta.dtype)
            delta = delta * keep.view(-1, *([1] * (delta.dim() - 1)))
            factor = factor / (1.0 - self.rank_dropout)  # keep the expected output unchanged
        return org_out + conv_or_linear(self.org_module, delta, x) * factor

    def merged_parameters(self, multiplier: float) -> dict[str, torch.Tensor]:
        dtype = merge_dtype(self.org_module.weight.dtype)
        weight = fp8_base.frozen_weight(self.org_module, dtype)
        return {"weight": weight + multiplier * self.delta_weight().to(dtype)}


# --------------------------------------------------------------------------- the network
@dataclass(frozen=True)
class MaxNormStats:
    """What ``apply_max_norm_regularization`` did: 0-dim tensors on the network's device, so
    that reading them (``.item()``, only when logging) is the caller's choice of sync."""

    keys_scaled: torch.Tensor  # int64: number of modules scaled down
    mean_norm: torch.Tensor  # mean over modules of ||delta W||_F after scaling
    max_norm: torch.Tensor  # max over modules of the same


class AdapterNetwork(torch.nn.Module):
    """All adapter modules of one UNet and its text encoders (see the module docstring).

    ``text_encoder_loras``/``unet_loras`` are kohya's attribute names. The modules are
    registered under their ``lora_name``, so the state dict keys are the file's.
    ``network_module`` is the ``--network_module`` name, used in messages.
    """

    def __init__(
        self,
        text_encoder_loras: Sequence[torch.nn.Module],
        unet_loras: Sequence[torch.nn.Module],
        multiplier: float = 1.0,
        network_module: str = "networks.lora",
    ) -> None:
        super().__init__()
        self.multiplier = multiplier
        self.network_module = network_module
        self.text_encoder_loras: list[torch.nn.Module] = list(text_encoder_loras)
        self.unet_loras: list[torch.nn.Module] = list(unet_loras)
        for lora in self.text_encoder_loras + self.unet_loras:
            if lora.lora_name in self._modules:
                raise ValueError(f"duplicate network module name {lora.lora_name}")
            self.add_module(lora.lora_name, lora)
        self._max_norm_groups: Optional[list[list[torch.nn.Module]]] = None  # see apply_max_norm_regularization

    def all_loras(self) -> list[torch.nn.Module]:
        return self.text_encoder_loras + self.unet_loras

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
        for lora in self.all_loras():
            lora.apply_to()

    def _drop(self, loras: list[torch.nn.Module]) -> None:
        for lora in loras:
            del self._modules[lora.lora_name]

    def restore(self) -> None:
        for lora in self.all_loras():
            lora.restore()

    def set_multiplier(self, multiplier: float) -> None:
        self.multiplier = multiplier
        for lora in self.all_loras():
            lora.multiplier = multiplier

    # -- per-module hooks (a subclass may override these instead of the modules) ------
    def loraplus_parameters(self, lora: torch.nn.Module) -> list[torch.nn.Parameter]:
        hook = getattr(lora, "loraplus_parameters", None)
        return list(hook()) if hook is not None else []

    def max_norm_weights(self, lora: torch.nn.Module) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        hook = getattr(lora, "max_norm_weights", None)
        return hook() if hook is not None else None

    def merged_parameters(self, lora: torch.nn.Module, multiplier: float) -> dict[str, torch.Tensor]:
        hook = getattr(lora, "merged_parameters", None)
        if hook is None:
            raise UserError(f"{self.network_module}: module {lora.lora_name} cannot be merged into a model")
        return hook(multiplier)

    def wrapped_module(self, lora: torch.nn.Module) -> torch.nn.Module:
        """The Linear/Conv2d ``lora`` wraps."""
        return lora.org_module

    def frozen_weight(self, lora: torch.nn.Module, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The base weight ``lora`` adapts (without the adapter; a float8 one dequantized) in ``dtype``,
        by default the dtype merges are computed in (``merge_dtype``)."""
        layer = self.wrapped_module(lora)
        return fp8_base.frozen_weight(layer, dtype or merge_dtype(layer.weight.dtype))

    def lr_group(self, lora: torch.nn.Module) -> tuple[Optional[int], float, Optional[float]]:
        """(block, lr weight, lr override) of ``lora``: see the module docstring."""
        return getattr(lora, "lr_block", None), float(getattr(lora, "lr_weight", 1.0)), getattr(lora, "lr_override", None)

    # -- optimizer -------------------------------------------------------------------
    def text_encoder_groups(self) -> list[list[torch.nn.Module]]:
        """Text encoder modules per encoder, in order (grouped by the name's second field: te, te1, te2)."""
        by_prefix: dict[str, list[torch.nn.Module]] = {}
        for lora in self.text_encoder_loras:
            by_prefix.setdefault(lora.lora_name.split("_")[1], []).append(lora)
        return list(by_prefix.values())

    def prepare_optimizer_params(
        self, text_encoder_lr: Optional[list[float]], unet_lr: Optional[float], default_lr: float,
        loraplus: tuple[Optional[float], Optional[float]] = (None, None),
    ) -> list[dict]:
        """Parameter groups: per text encoder and for the UNet (kohya's lr rules).

        ``text_encoder_lr`` may hold one value for all text encoders or one per encoder;
        a missing value falls back to ``default_lr``. ``loraplus``: the (text encoder, UNet)
        LoRA+ ratios (see ``loraplus_ratios``): a part with a ratio gets a second group, its
        modules' ``loraplus_parameters`` at lr * ratio; a ratio for a type without such
        parameters is a UserError. ``lr_group`` refines the lr per module (groups in order of
        first appearance). Parameters whose lr is 0 are not trained (kohya): they get no group
        and ``requires_grad`` False; frozen parameters (``requires_grad`` False) get no group.
        """
        parts: list[tuple[list[torch.nn.Module], float, Optional[float]]] = []
        for index, loras in enumerate(self.text_encoder_groups()):
            lr = default_lr
            if text_encoder_lr:
                lr = text_encoder_lr[min(index, len(text_encoder_lr) - 1)]
            parts.append((loras, lr, loraplus[0]))
        if self.unet_loras:
            parts.append((self.unet_loras, unet_lr if unet_lr is not None else default_lr, loraplus[1]))
        groups = []
        for loras, part_lr, ratio in parts:
            up = [p for lora in loras for p in self.loraplus_parameters(lora)] if ratio is not None else []
            if ratio is not None and not up:
                raise UserError(f"--network_args loraplus_*_lr_ratio: {self.network_module} has no up/down "
                                f"parts, LoRA+ does not apply to it; remove the loraplus ratios")
            up_ids = {id(weight) for weight in up}
            by_group: dict[tuple[Optional[int], float, Optional[float]], list[torch.nn.Module]] = {}
            for lora in loras:
                by_group.setdefault(self.lr_group(lora), []).append(lora)
            for (_, weight, override), members in by_group.items():
                lr = override if override is not None else part_lr * weight
                if lr == 0:
                    for lora in members:
                        lora.requires_grad_(False)
                    continue
                params = [p for lora in members for p in lora.parameters() if p.requires_grad]
                rest = [p for p in params if id(p) not in up_ids]
                plus = [p for p in params if id(p) in up_ids]
                if rest:
                    groups.append({"params": rest, "lr": lr})
                if plus:
                    groups.append({"params": plus, "lr": lr * ratio})
        return groups

    # -- max-norm regularisation (--scale_weight_norms) --------------------------------
    def supports_max_norm(self) -> bool:
        """Whether every module has up/down factors that ``apply_max_norm_regularization`` can scale."""
        return all(self.max_norm_weights(lora) is not None for lora in self.all_loras())

    @torch.no_grad()
    def apply_max_norm_regularization(self, max_norm: float) -> MaxNormStats:
        """Scale down every module whose weight change is larger than ``max_norm``.

        Same result as kohya's ``apply_max_norm_regularization``: with ``W = up @ down * alpha / rank``
        (conv weights flattened to ``(out, rank)`` @ ``(rank, in*kh*kw)``), a module with
        ``||W||_F > max_norm`` gets both factors multiplied in place by ``sqrt(max_norm / ||W||_F)``,
        so its ``||W||_F`` becomes ``max_norm``; the others are left bit-identical. Returns the
        number of modules scaled and the mean and max of ``||W||_F`` after scaling, as device
        tensors: nothing here waits for the GPU, as this runs after every optimizer step.
        Needs ``max_norm_weights`` on every module (see ``supports_max_norm``).
        """
        if self._max_norm_groups is None:
            # Modules whose flattened (out, rank, k) shapes agree are stacked for one bmm; the
            # modules are fixed once built (apply_to resets this), so group them only once.
            groups: dict[tuple[int, int, int], list[torch.nn.Module]] = {}
            for lora in self.all_loras():
                up, down = self.max_norm_weights(lora)
                groups.setdefault((up.shape[0], down.shape[0], down[0].numel()), []).append(lora)
            self._max_norm_groups = list(groups.values())
        loras = [lora for group in self._max_norm_groups for lora in group]  # the order of `norms`
        if not loras:
            zero = torch.zeros(())
            return MaxNormStats(zero.long(), zero, zero)

        unscaled = []  # ||up @ down||_F / rank per module, group by group
        ups, downs = [], []
        for group in self._max_norm_groups:
            # Weights are read here, not cached: .to() and load_state_dict(assign=True) replace tensors.
            pairs = [self.max_norm_weights(lora) for lora in group]
            ups += [up for up, _ in pairs]
            downs += [down for _, down in pairs]
            rank = pairs[0][1].shape[0]
            up = torch.stack([up.reshape(-1, rank) for up, _ in pairs]).float()
            down = torch.stack([down.reshape(rank, -1) for _, down in pairs]).float()
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
        torch._foreach_mul_(ups, factors)
        torch._foreach_mul_(downs, factors)
        scaled_norms = norms * ratio
        return MaxNormStats((ratio != 1).sum(), scaled_norms.mean(), scaled_norms.max())

    # -- merging ---------------------------------------------------------------------
    @torch.no_grad()
    def merge_into_model(self, multiplier: float, module_weight: Optional[Callable[[str], float]] = None) -> int:
        """Write every module's ``merged_parameters(multiplier)`` into the wrapped module's parameters
        (cast to their dtype), in place; ``module_weight(lora_name)`` (optional, e.g. ``--lbws``) scales
        each module's multiplier. Call before ``apply_to``. Returns the number of modules merged."""
        for lora in self.all_loras():
            org_module = self.wrapped_module(lora)
            weight = 1.0 if module_weight is None else module_weight(lora.lora_name)
            for name, value in self.merged_parameters(lora, multiplier * weight).items():
                own = getattr(org_module, name)
                if value.shape != own.shape:
                    raise UserError(f"{lora.lora_name}: merging gives a {tuple(value.shape)} {name} for a "
                                    f"{tuple(own.shape)} one; the file is for another model")
                own.copy_(value.to(own.dtype))
        return len(self.all_loras())

    # -- files ---------------------------------------------------------------------
    def lora_state_dict(self, dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
        """Detached CPU copies of every key, floating-point ones cast to ``dtype`` when given."""
        state = {}
        for key, value in self.state_dict().items():
            value = value.detach().to("cpu")
            if dtype is not None and value.is_floating_point():
                value = value.to(dtype)
            state[key] = value.contiguous()
        return state

    def training_state_dict(self) -> dict[str, torch.Tensor]:
        """What a training state folder keeps of the network (``library.train_state``): by default
        the file's tensors; a type whose file is not its parameters (LyCORIS) keeps its own."""
        return self.lora_state_dict()

    def load_training_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load what ``training_state_dict`` returned (resuming)."""
        self.load_state_dict(state)

    def load_weights(self, path: str, flag: str = "--network_weights") -> None:
        """Load a file written by this network type into this network; every key and shape must match
        (UserError naming ``flag`` and the file otherwise)."""
        self.load_weights_from(read_lora_file(path), f"{flag} {path}")

    def load_weights_from(self, weights: Mapping[str, torch.Tensor], source: str) -> None:
        """``load_weights`` for a state dict; ``source`` names it in errors (e.g. "--network_weights FILE")."""
        own = self.state_dict()
        missing = sorted(set(own) - set(weights))
        unexpected = sorted(set(weights) - set(own))
        if missing or unexpected:
            detail = f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}"
            from_file = (" (or build the network from the file's own modules with --dim_from_weights)"
                         if source.startswith("--network_weights") else "")
            raise UserError(
                f"{source}: keys do not match this network ({len(missing)} missing, "
                f"{len(unexpected)} unexpected; {detail}); check --network_module, --network_dim, --network_args "
                f"and the base model{from_file}"
            )
        for key, value in weights.items():
            if value.shape != own[key].shape:
                raise UserError(
                    f"{source}: {key} has shape {tuple(value.shape)}, this network needs "
                    f"{tuple(own[key].shape)}; pass the file's rank with --network_dim or use --dim_from_weights"
                )
            # The modules' output scale was fixed from --network_alpha when they were built; a
            # different alpha in the file would be saved back while training used the other one.
            # Compared in the file's dtype: a bf16/fp16 file stores the alpha rounded.
            if key.endswith(".alpha") and not torch.equal(own[key].to(value.dtype), value):
                raise UserError(
                    f"{source}: {key} is {float(value):g}, this network's is {float(own[key]):g}; "
                    f"pass the file's alpha with --network_alpha (conv_alpha for conv modules) or use "
                    f"--dim_from_weights"
                )
        self.load_state_dict({k: v.to(own[k].dtype) for k, v in weights.items()}, strict=True)


# --------------------------------------------------------------------------- files
def read_lora_file(path: str) -> dict[str, torch.Tensor]:
    """All tensors of a network file (safetensors, or a ``.ckpt``/``.pt`` state dict as kohya's
    ``--save_model_as`` writes them); a missing or corrupt file is a UserError."""
    if os.path.isdir(path):
        raise UserError(f"LoRA file {path} is a folder; give the network file (.safetensors) inside it")
    if not os.path.isfile(path):
        raise UserError(f"LoRA file {path} does not exist")
    if not checkpoint_files.is_safetensors(path):
        try:
            weights = checkpoint_files.load_pickled_state_dict(Path(path))
        except Exception as error:  # torch.load raises several types for damaged files
            raise UserError(f"LoRA file {path} is not a network file: {first_line(error)}") from None
        if not all(isinstance(value, torch.Tensor) for value in weights.values()):
            raise UserError(f"LoRA file {path} holds other objects than tensors; not a LoRA state dict")
        return dict(weights)
    try:
        with safe_open(path, framework="pt", device="cpu") as file:
            return {key: file.get_tensor(key) for key in file.keys()}
    except Exception as error:  # safetensors raises several types for damaged files
        raise UserError(f"LoRA file {path} is not a readable safetensors file ({error})") from None


def read_lora_metadata(path: str) -> dict[str, str]:
    """The metadata map of a network safetensors file (empty when it has none, and for ``.ckpt``/``.pt``)."""
    if not checkpoint_files.is_safetensors(path):
        return {}
    try:
        with safe_open(path, framework="pt", device="cpu") as file:
            return dict(file.metadata() or {})
    except Exception as error:  # safetensors raises several types for damaged files
        raise UserError(f"LoRA file {path} is not a readable safetensors file ({error})") from None


def find_non_finite(state: Mapping[str, torch.Tensor]) -> Optional[str]:
    """Name of the first module holding NaN/Inf, or None when all are finite."""
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
    """Write a network file atomically (``library.atomic_files``): safetensors, or for a ``.ckpt``/``.pt``
    path (kohya's ``--save_model_as``) ``torch.save`` of the state dict without the metadata, as kohya
    writes them.

    Refuses non-finite weights so that a diverged run never replaces a good file.
    """
    bad_module = find_non_finite(state)
    if bad_module is not None:
        raise FloatingPointError(f"not saving {path}: LoRA module {bad_module} holds NaN/Inf")
    if checkpoint_files.is_safetensors(path):
        data = canonical_safetensors_bytes(state, metadata)
    else:
        buffer = io.BytesIO()
        torch.save(dict(state), buffer)
        data = buffer.getvalue()
    atomic_files.write_file(path, data)


def group_by_module(weights: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """A state dict grouped by module: ``{lora_name: {tensor name: tensor}}`` in file order
    (``lora_unet_x.hada_w1_a`` -> ``{"lora_unet_x": {"hada_w1_a": ...}}``)."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in weights.items():
        name, _, tensor_name = key.partition(".")
        modules.setdefault(name, {})[tensor_name] = value
    return modules


# --------------------------------------------------------------------------- network_args
def parse_network_args(items: Optional[list[str]]) -> dict[str, str]:
    """``--network_args key=value ...`` as a dict of strings (an item may hold several pairs separated
    by spaces, as ``--optimizer_args``); a malformed pair is a UserError."""
    parsed = {}
    for pair in key_value_items(items):
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--network_args: '{pair}' is not key=value (e.g. conv_dim=4 conv_alpha=1)")
        parsed[key.strip()] = value.strip()
    return parsed


def check_known_args(network_args: Mapping[str, str], known: Iterable[str], network_module: str) -> None:
    """UserError naming the first key of ``network_args`` that ``network_module`` does not know, and the valid ones."""
    known = tuple(known)
    unknown = sorted(set(network_args) - set(known))
    if unknown:
        raise UserError(f"--network_args: unknown key {unknown[0]} for {network_module} (valid: {', '.join(known)})")


def _is_none(value: str) -> bool:
    return value in ("", "None", "none")


Number = TypeVar("Number", int, float)


def _parse(text: str, kind: type[Number]) -> Number:
    """``text`` as ``kind``; ints also from a whole float ("4.0", as kohya's int(float(...)) readers).
    ValueError when it is neither."""
    if kind is float:
        return float(text)
    try:
        return int(text)
    except ValueError:
        as_float = float(text)
        if not as_float.is_integer():
            raise
        return int(as_float)


def read_number(network_args: Mapping[str, str], key: str, kind: type[Number], default: Optional[Number] = None,
                minimum: Optional[float] = 0, below: Optional[float] = None) -> Optional[Number]:
    """``key`` as an int or float (kohya's strings: "4", "-1", "0.1"; "" and "None" give ``default``).

    The value must be >= ``minimum`` (None: any) and < ``below`` (None: no bound; a float
    option ending in ``dropout`` must be below 1). Otherwise a UserError naming the key.
    """
    text = network_args.get(key)
    if text is None or _is_none(text):
        return default
    try:
        value = _parse(text, kind)
    except ValueError:
        raise UserError(f"--network_args {key}={text} is not a {kind.__name__}") from None
    if kind is float and key.endswith("dropout") and below is None:
        below = 1
    if (minimum is not None and value < minimum) or (below is not None and value >= below):
        raise UserError(f"--network_args {key}={text} is out of range")
    return value


def read_bool(network_args: Mapping[str, str], key: str, default: bool = False) -> bool:
    """``key`` as a boolean: "True"/"true"/"1" or "False"/"false"/"0" (any case; "" and "None"
    give ``default``). The GUI writes Python's ``False``: a non-empty string is not true here."""
    text = network_args.get(key)
    if text is None or _is_none(text):
        return default
    value = boolean_word(text)
    if value is None:
        raise UserError(f"--network_args {key}={text} is not a boolean (True/False, 1/0)")
    return value


def read_list(network_args: Mapping[str, str], key: str, kind: type[Number], length: Optional[int] = None,
              empty: Optional[Number] = None) -> Optional[list[Number]]:
    """``key`` as a comma-separated list (optionally in brackets: "[1, 2]"); None when absent.

    ``length``: the number of items required; ``empty``: the value of an empty item (kohya reads
    "1,,1" as 0 for lr weights), None: empty items are an error.
    """
    text = network_args.get(key)
    if text is None or _is_none(text):
        return None
    items = [item.strip() for item in text.strip().strip("[]").split(",")]
    values = []
    for item in items:
        if not item and empty is not None:
            values.append(empty)
            continue
        try:
            values.append(_parse(item, kind))
        except ValueError:
            raise UserError(f"--network_args {key}={text}: '{item}' is not a {kind.__name__} "
                            f"(give a comma-separated list)") from None
    if length is not None and len(values) != length:
        raise UserError(f"--network_args {key}={text}: {len(values)} values, this model needs {length}")
    return values


LORAPLUS_NETWORK_ARGS = ("loraplus_lr_ratio", "loraplus_unet_lr_ratio", "loraplus_text_encoder_lr_ratio")


def loraplus_ratios(network_args: Mapping[str, str]) -> tuple[Optional[float], Optional[float]]:
    """LoRA+ (kohya's network_args): the (text encoder, UNet) multipliers of the up parameters'
    learning rate; a part-specific ratio wins over ``loraplus_lr_ratio``. None: plain for that part."""
    ratios = {key: read_number(network_args, key, float) for key in LORAPLUS_NETWORK_ARGS}
    for key, ratio in ratios.items():
        if ratio is not None and not ratio > 0:
            raise UserError(f"--network_args {key}={network_args[key]} must be a positive number")
    general = ratios["loraplus_lr_ratio"]
    text_encoder, unet = ratios["loraplus_text_encoder_lr_ratio"], ratios["loraplus_unet_lr_ratio"]
    return (text_encoder if text_encoder is not None else general, unet if unet is not None else general)


# --------------------------------------------------------------------------- kohya's LyCORIS-family networks
# networks.loha and networks.lokr share kohya's AdditionalNetwork rules: which modules, ranks,
# per-module learning rates, and these network_args.
ADDITIONAL_NETWORK_ARGS = ("conv_dim", "conv_alpha", "rank_dropout", "module_dropout", "use_tucker", "verbose",
                           "exclude_patterns", "include_patterns", "network_reg_lrs", "network_reg_dims",
                           *LORAPLUS_NETWORK_ARGS)


def read_patterns(network_args: Mapping[str, str], key: str) -> list[re.Pattern]:
    """``key`` as kohya writes it: a Python list of regular expressions (or one), e.g. ``[r'.*attn2.*']``."""
    text = network_args.get(key)
    if text is None or _is_none(text):
        return []
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text  # a bare pattern
    patterns = value if isinstance(value, list) else [value]
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(str(pattern)))
        except re.error as error:
            raise UserError(f"--network_args {key}: '{pattern}' is not a regular expression ({error})") from None
    return compiled


def read_regex_map(network_args: Mapping[str, str], key: str, kind: type[Number]) -> dict[str, Number]:
    """``key`` as ``regex1=value1,regex2=value2`` (kohya's network_reg_dims / network_reg_lrs)."""
    text = network_args.get(key)
    if text is None or _is_none(text):
        return {}
    mapping = {}
    for pair in filter(None, (item.strip() for item in text.split(","))):
        pattern, sep, value = pair.rpartition("=")
        try:
            re.compile(pattern)
            mapping[pattern] = _parse(value.strip(), kind)
        except (ValueError, re.error):
            sep = ""
        if not sep or not pattern:
            raise UserError(f"--network_args {key}: '{pair}' is not regex={kind.__name__} "
                            f"(e.g. {key}=.*attn1.*=8,.*ff.*=4)")
    return mapping


def validate_additional_network_args(network_args: Mapping[str, str], known: Iterable[str],
                                     network_module: str) -> None:
    """Refuse unknown or malformed arguments of a kohya LyCORIS-family type (see ``additional_network``)."""
    check_known_args(network_args, known, network_module)
    read_number(network_args, "conv_dim", int)
    read_number(network_args, "conv_alpha", float)
    read_number(network_args, "rank_dropout", float)
    read_number(network_args, "module_dropout", float)
    read_bool(network_args, "use_tucker")
    read_bool(network_args, "verbose")
    read_patterns(network_args, "exclude_patterns")
    read_patterns(network_args, "include_patterns")
    read_regex_map(network_args, "network_reg_lrs", float)
    read_regex_map(network_args, "network_reg_dims", int)
    loraplus_ratios(network_args)


def additional_network(
    network_module: str,
    make_module: Callable[[Target, int, float], torch.nn.Module],
    text_encoders: Sequence[torch.nn.Module],
    unet: torch.nn.Module,
    unet_module_names: Optional[Mapping[str, str]],
    multiplier: float,
    lora_dim: int,
    alpha: float,
    network_args: Mapping[str, str],
    modules_dim: Optional[Mapping[str, int]] = None,
    modules_alpha: Optional[Mapping[str, float]] = None,
) -> AdapterNetwork:
    """kohya's AdditionalNetwork (networks.loha / networks.lokr): one ``make_module(target, dim, alpha)``
    per chosen Linear/Conv2d.

    Linear and 1x1 conv modules get ``lora_dim``/``alpha``, 3x3 convs ``conv_dim``/``conv_alpha``
    (only with ``conv_dim``, which also adds the ResNet/sampler blocks' Linear and 1x1 modules);
    ``network_reg_dims`` (regex on the module path) overrides the rank (alpha stays ``alpha``),
    ``exclude_patterns`` drops modules unless ``include_patterns`` matches them, ``network_reg_lrs``
    gives matching modules their own learning rate. ``modules_dim``/``modules_alpha`` (from a
    file) fix the modules and their ranks instead.
    """
    conv_dim = read_number(network_args, "conv_dim", int)
    conv_alpha = read_number(network_args, "conv_alpha", float, default=1.0)
    exclude = read_patterns(network_args, "exclude_patterns")
    include = read_patterns(network_args, "include_patterns")
    reg_dims = read_regex_map(network_args, "network_reg_dims", int)
    reg_lrs = read_regex_map(network_args, "network_reg_lrs", float)

    def create(targets: list[Target]) -> list[torch.nn.Module]:
        modules = []
        for target in targets:
            excluded = any(pattern.fullmatch(target.path) for pattern in exclude)
            if excluded and not any(pattern.fullmatch(target.path) for pattern in include):
                continue
            if modules_dim is not None:
                if target.lora_name not in modules_dim:
                    continue
                dim, module_alpha = modules_dim[target.lora_name], modules_alpha[target.lora_name]
            else:
                dim = next((d for pattern, d in reg_dims.items() if re.fullmatch(pattern, target.path)), None)
                module_alpha = alpha
                if dim is None and target.kind != "conv":
                    dim = lora_dim
                elif dim is None and conv_dim:
                    dim, module_alpha = conv_dim, conv_alpha
            if not dim:
                continue
            module = make_module(target, dim, module_alpha)
            module.lr_override = next((lr for pattern, lr in reg_lrs.items() if re.fullmatch(pattern, target.path)),
                                      None)
            modules.append(module)
        return modules

    text_encoder_loras = [module for targets in text_encoder_targets(text_encoders) for module in create(targets)]
    unet_classes = UNET_TARGET_MODULES
    if conv_dim or modules_dim is not None:
        unet_classes = UNET_TARGET_MODULES + UNET_CONV_TARGET_MODULES
    unet_loras = create(unet_targets(unet, unet_module_names, unet_classes))
    if read_bool(network_args, "verbose"):
        for module in text_encoder_loras + unet_loras:
            print(f"{module.lora_name}: dim {module.lora_dim}, alpha {float(module.alpha):g}")
    return AdapterNetwork(text_encoder_loras, unet_loras, multiplier, network_module)


def modules_alpha_from_weights(weights: Mapping[str, torch.Tensor], modules_dim: Mapping[str, int]) -> dict[str, float]:
    """Per-module alpha of a state dict (``<name>.alpha``), the rank where a module has none (kohya)."""
    return {name: float(weights[f"{name}.alpha"]) if f"{name}.alpha" in weights else float(dim)
            for name, dim in modules_dim.items()}
