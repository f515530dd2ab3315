"""Exponential moving average (EMA) of the LoRA weights, and the weights meant for use.

``--ema_decay D`` keeps, beside the weights the optimizer trains, an average of them that every
optimizer step that trained folds in (every ``--ema_update_every`` such steps):
``average <- average + (1 - decay) * (weights - average)``, one fused ``torch._foreach_lerp_``.
The decay follows diffusers' ``EMAModel`` (``diffusers.training_utils``): at the t-th update
(t = 0 for the first) it is 0 for t = 0 (the average starts as the weights), then
``(1 + t) / (10 + t)``, or with ``--ema_warmup`` ``1 - (1 + t / inv_gamma) ** -power``, capped at D.

Samples, validation and every LoRA file see the weights meant for use (``weights_for_use``): the
average when the EMA is on, a schedule-free optimizer's average otherwise (its eval mode). Training
states keep the training weights and the average as its own component (``LoraEma.state_dict``), so a
resumed run, a rewind to the healthy point and every process hold the same average.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from library import optimizers
from library.errors import UserError

DEVICES = ("same", "cpu")
DEFAULT_INV_GAMMA = 1.0
DEFAULT_POWER = 2 / 3  # diffusers' EMAModel defaults
RAW_SUFFIX = "-raw"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the EMA options (one argument group)."""
    group = parser.add_argument_group(
        "EMA of the LoRA weights", "An exponential moving average of the trained weights, used by samples, "
                                   "validation and saved LoRA files (diffusers' EMAModel schedule).")
    add = group.add_argument
    add("--ema_decay", type=float, default=None, metavar="D",
        help="keep an exponential moving average of the LoRA weights with decay D, 0 < D < 1 (e.g. 0.999; the "
             "average covers about 1/(1-D) updates). Samples, validation and every saved LoRA file use it; "
             "training states keep it beside the training weights. The decay rises to D over the first updates "
             "(see --ema_warmup). Default: off")
    add("--ema_warmup", action="store_true",
        help="decay at the t-th update (t = 0, 1, ...) 1 - (1 + t/--ema_inv_gamma)^-(--ema_power), capped at "
             "--ema_decay (diffusers' use_ema_warmup). Default: diffusers' default rise (1 + t)/(10 + t)")
    add("--ema_inv_gamma", type=float, default=None, metavar="G",
        help="with --ema_warmup: the warm-up's time scale in updates, > 0. Default: 1")
    add("--ema_power", type=float, default=None, metavar="P",
        help="with --ema_warmup: the warm-up's power, > 0 (2/3 reaches a decay of 0.999 at 31.6k updates, 3/4 "
             "at 10k). Default: 2/3")
    add("--ema_update_every", type=int, default=1, metavar="N",
        help="update the average every N optimizer steps that trained (steps the guard, the loss scaler or "
             "a non-finite loss skipped do not count); t counts updates. Default: 1")
    add("--ema_device", type=str, default="same", choices=DEVICES,
        help="where the average lives: same (the LoRA's device) or cpu (saves one float32 copy of the LoRA in "
             "GPU memory; each update then copies the LoRA to the CPU). Default: same")
    add("--ema_save_raw", action="store_true",
        help="with --ema_decay: also write the training weights beside every LoRA file, as "
             f"<file name>{RAW_SUFFIX}.safetensors (metadata ss_weights=raw). Default: off")


@dataclass(frozen=True)
class EmaConfig:
    """The EMA options (``--ema_*``); ``decay`` None: no EMA. Raises ``UserError`` when invalid."""

    decay: Optional[float] = None
    warmup: bool = False
    inv_gamma: Optional[float] = None
    power: Optional[float] = None
    update_every: int = 1
    device: str = "same"
    save_raw: bool = False

    def __post_init__(self) -> None:
        if self.decay is not None and not (math.isfinite(self.decay) and 0 < self.decay < 1):
            raise UserError(f"--ema_decay {self.decay} must be between 0 and 1, both excluded (e.g. 0.999)")
        if not (isinstance(self.update_every, int) and self.update_every >= 1):
            raise UserError(f"--ema_update_every {self.update_every} must be a whole number of optimizer steps >= 1")
        for flag, value in (("ema_inv_gamma", self.inv_gamma), ("ema_power", self.power)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise UserError(f"--{flag} {value} must be a number > 0")
            if value is not None and not self.warmup:
                raise UserError(f"--{flag} shapes the warm-up of --ema_warmup: add --ema_warmup, or remove it")
        if self.device not in DEVICES:
            raise UserError(f"--ema_device {self.device}: valid are {', '.join(DEVICES)}")
        if self.decay is None:
            given = [flag for flag, value in (("ema_warmup", self.warmup), ("ema_update_every", self.update_every != 1),
                                              ("ema_device", self.device != "same"), ("ema_save_raw", self.save_raw))
                     if value]
            if given:
                raise UserError(f"--{given[0]} needs --ema_decay D (the EMA is off without it)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EmaConfig":
        return cls(args.ema_decay, args.ema_warmup, args.ema_inv_gamma, args.ema_power, args.ema_update_every,
                   args.ema_device, args.ema_save_raw)

    @property
    def warmup_shape(self) -> tuple[float, float]:
        """(inv_gamma, power) of ``--ema_warmup``, diffusers' defaults where not given."""
        return (DEFAULT_INV_GAMMA if self.inv_gamma is None else self.inv_gamma,
                DEFAULT_POWER if self.power is None else self.power)

    def decay_at(self, update: int) -> float:
        """The decay of the ``update``-th update (1 = the first), as diffusers' ``EMAModel.get_decay``
        computes it for ``optimization_step = update`` (``update_after_step`` 0, ``min_decay`` 0)."""
        t = update - 1
        if t <= 0:
            return 0.0
        if self.warmup:
            inv_gamma, power = self.warmup_shape
            rising = 1 - (1 + t / inv_gamma) ** -power
        else:
            rising = (1 + t) / (10 + t)
        return min(rising, self.decay)

    def averaging(self) -> Optional[dict[str, object]]:
        """What shapes the average (a resumed run must share it: ``train_state.protected_arguments``);
        None when off."""
        if self.decay is None:
            return None
        return {"decay": self.decay, "warmup": self.warmup, "inv_gamma": self.inv_gamma, "power": self.power,
                "update_every": self.update_every}

    def file_metadata(self, weights: str) -> dict[str, str]:
        """The LoRA metadata of a file holding ``weights`` ("ema" or "raw")."""
        warmup = "default"
        if self.warmup:
            inv_gamma, power = self.warmup_shape
            warmup = f"power inv_gamma={inv_gamma} power={power:.6g}"
        return {"ss_weights": weights, "ss_ema_decay": str(self.decay), "ss_ema_warmup": warmup,
                "ss_ema_update_every": str(self.update_every)}


def validate_arguments(args: argparse.Namespace) -> None:
    """One line, exit 2, for a bad EMA value (before anything loads)."""
    EmaConfig.from_args(args)


def check_steps(args: argparse.Namespace, total_steps: int) -> None:
    """Refuse an ``--ema_update_every`` the run never reaches (``total_steps``: --max_train_steps, known
    once the data is): the average would never update and every file would hold the untrained LoRA."""
    config = EmaConfig.from_args(args)
    if config.decay is not None and config.update_every > total_steps:
        raise UserError(f"--ema_update_every {config.update_every}: the run trains {total_steps} optimizer steps, "
                        f"so the average would never update and every LoRA file would hold the untrained "
                        f"weights; give at most {total_steps}")


def raw_file_name(file_name: str) -> str:
    """The name of the training weights' file beside ``file_name`` (``--ema_save_raw``):
    ``last.safetensors`` -> ``last-raw.safetensors``, ``last-step00000100.safetensors`` ->
    ``last-step00000100-raw.safetensors``."""
    stem, extension = os.path.splitext(file_name)
    return f"{stem}{RAW_SUFFIX}{extension}"


class LoraEma:
    """The moving average of ``parameters`` (the trainable LoRA parameters, updated in place by the
    optimizer) in float32 on ``config.device``.

    Invariants: ``average`` holds one float32 tensor per parameter; ``updates`` counts the updates
    folded in (diffusers' ``optimization_step``), ``trained_steps`` the optimizer steps that trained.
    Only ``after_optimizer_step`` changes them (and ``load_state_dict``). Between ``swapped_in`` and
    its end the parameters hold the average and the training weights wait in a copy.
    """

    def __init__(self, parameters: Sequence[torch.Tensor], config: EmaConfig) -> None:
        self.parameters = list(parameters)
        self.config = config
        first = self.parameters[0]
        self.device = first.device if config.device == "same" else torch.device("cpu")
        self.average = [parameter.detach().to(self.device, torch.float32, copy=True) for parameter in self.parameters]
        # The lerp needs its two lists on one device in one dtype: otherwise the weights are first copied
        # into this buffer (pinned, so that a GPU copies to it directly).
        needs_staging = any(p.device != self.device or p.dtype != torch.float32 for p in self.parameters)
        pin = self.device.type == "cpu" and first.device.type == "cuda"
        self.staging = None if not needs_staging else [
            torch.empty(average.shape, dtype=torch.float32, device=self.device, pin_memory=pin) for average in self.average]
        self.updates = 0
        self.trained_steps = 0
        self._training_weights: Optional[list[torch.Tensor]] = None

    def memory_bytes(self) -> int:
        """What the average holds (and the staging buffer, when there is one)."""
        copies = 1 if self.staging is None else 2
        return copies * sum(average.numel() * average.element_size() for average in self.average)

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """Fold the weights in, at every ``update_every``-th call: call it after each optimizer step that
        trained (never after a skipped one), once the weights are final (after max-norm scaling)."""
        self.trained_steps += 1
        if self.trained_steps % self.config.update_every:
            return
        self.updates += 1
        weights = self.parameters
        if self.staging is not None:
            torch._foreach_copy_(self.staging, weights)
            weights = self.staging
        torch._foreach_lerp_(self.average, weights, 1.0 - self.config.decay_at(self.updates))

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Within the block the parameters hold the average (cast to their dtype); after it the
        training weights, bit for bit (kept in a copy on the average's device meanwhile)."""
        self._training_weights = [parameter.detach().to(self.device, copy=True) for parameter in self.parameters]
        self._copy_into_parameters(self.average)
        try:
            yield
        finally:
            self._copy_into_parameters(self._training_weights)
            self._training_weights = None

    @contextlib.contextmanager
    def training_weights(self) -> Iterator[None]:
        """Within ``swapped_in``: the training weights back for the block (``--ema_save_raw``'s file)."""
        self._copy_into_parameters(self._training_weights)
        try:
            yield
        finally:
            self._copy_into_parameters(self.average)

    @torch.no_grad()
    def _copy_into_parameters(self, values: list[torch.Tensor]) -> None:
        torch._foreach_copy_(self.parameters, values)

    def state_dict(self) -> dict[str, object]:
        """References to the average and the counts (as torch's ``state_dict``: copy before changing it)."""
        return {"updates": self.updates, "trained_steps": self.trained_steps, "average": self.average}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Copy a ``state_dict`` in; ``ValueError`` when its tensors do not fit these parameters."""
        average = state["average"]
        shapes = [tuple(tensor.shape) for tensor in average]
        if shapes != [tuple(tensor.shape) for tensor in self.average]:
            raise ValueError(f"its average holds {len(shapes)} tensors that do not match the "
                             f"{len(self.average)} trainable LoRA parameters")
        torch._foreach_copy_(self.average, list(average))
        self.updates = int(state["updates"])
        self.trained_steps = int(state["trained_steps"])


def create(args: argparse.Namespace, parameters: Sequence[torch.Tensor]) -> Optional[LoraEma]:
    """The run's EMA of the trainable ``parameters`` (None without ``--ema_decay``); says what it holds."""
    config = EmaConfig.from_args(args)
    if config.decay is None:
        return None
    average = LoraEma(parameters, config)
    print(f"EMA of the LoRA weights: decay {config.decay}, {'power' if config.warmup else 'default'} warm-up, "
          f"every {config.update_every} trained step(s), {average.memory_bytes() / 2**20:.2f} MiB on "
          f"{average.device.type}")
    return average


@contextlib.contextmanager
def weights_for_use(optimizer: torch.optim.Optimizer, average: Optional[LoraEma]) -> Iterator[None]:
    """Within the block the LoRA holds the weights meant for use, what samples, validation and saved
    files see: the EMA (``average``) when on, else a schedule-free optimizer's averaged weights
    (eval mode); a no-op for other optimizers. Every process must enter and leave at the same points.

    On leaving, the EMA's training weights are back. A schedule-free optimizer stays in eval mode
    until the next step enters train mode (``optimizers.enter_train_mode``): a training state saved
    after the block holds the average the files hold, and a run resumed from it goes back to training
    as the uninterrupted run does, bit for bit (eval -> train is not an exact round trip).
    """
    optimizers.enter_eval_mode(optimizer)
    with average.swapped_in() if average is not None else contextlib.nullcontext():
        yield
