"""What one training run is made of, as the builders made it: the loss path's fixed inputs
(``LossContext``), what turns gradients into updates (``Optimization``) and the run itself (``Run``).

They hold no loop logic: ``library.training.trainer`` reads them step by step, and the trainable
(``library.trainables``) owns what trains (for a LoRA: the network and its files).
"""
from __future__ import annotations

import argparse
import math
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from accelerate import Accelerator

from library import best_checkpoint, debiased_loss, ema, fault_injection, flat_gradients, grad_guard, healing
from library import loss_scaling, losses, noise, train_state, validation
from library.model_loading import StableDiffusionModels
from library.run_data import TrainingData
from library.run_outputs import RunOutputs
from library.training.config import TrainingConfig

if TYPE_CHECKING:  # the trainable's own types; the core reads them through ``Trainable``
    from library.trainables.base import Trainable


@dataclass
class LossContext:
    """What computing a batch's loss needs, fixed for the whole run. ``check_inputs``: also say per
    sample whether the UNet's inputs (latents, frozen text-encoder outputs) are finite (quarantine)."""

    args: argparse.Namespace
    models: StableDiffusionModels
    noise_scheduler: Any
    noise_options: noise.NoiseOptions
    loss_options: losses.LossOptions
    autocast: Any
    train_text_encoder: bool
    device: torch.device
    check_inputs: bool = False
    debiased: Optional[debiased_loss.DebiasedLoss] = None  # --debiased_loss: the base model's loss beside it
    inpainting: bool = False  # --train_inpainting: the UNet also sees a random mask and the masked image
    # nothing in the text encoders' forward can change (Trainable.changes_text_conditioning): a fixed batch's
    # conditioning is encoded once (library/fixed_batches.py)
    text_encoding_fixed: bool = False


@dataclass
class Optimization:
    """What turns gradients into updates, and what watches them: optimizer, learning-rate schedule, the
    fp16 loss scaler (None otherwise), the gradient guard and its monitor, the healing policy, the
    EMA of the weights (None without ``--ema_decay``) and how a step's gradients become the update
    (``gradient_step``: unfused, or applied during the backward with ``--fused_backward_pass``)."""

    trainable_params: list[torch.nn.Parameter]
    gradients: Optional[flat_gradients.FlatGradients]  # the step's .grad as views of one buffer (None: fused)
    optimizer: torch.optim.Optimizer
    optimizer_name: str
    optimizer_args: str
    lr_scheduler: Any
    scaler: Optional[loss_scaling.LossScaler]
    guard: grad_guard.GradGuard
    monitor: grad_guard.GradientMonitor
    healer: healing.HealingPolicy
    agree: Optional[Callable[[bool], bool]]  # the guard's decision shared by the processes
    injections: dict[int, fault_injection.Injection]
    ema: Optional[ema.LoraEma] = None
    gradient_step: Any = None  # library.training.gradient_step: UnfusedStep, or FusedStep (update in backward)

    def unscaled(self, measured: grad_guard.GradientMeasurement) -> float:
        """The measured norm without the loss scale (what the runaway test compares across scale changes)."""
        if self.scaler is None or self.monitor.unscaled or not measured.scale:
            return measured.norm
        return measured.norm / measured.scale


@dataclass
class Run:
    """One training run as the builders made it; the loop, the events and the finish read it.

    ``trainable`` is what trains (``library.trainables``); ``network`` is its module (for the LoRA
    trainable the LoRA network, under kohya's name), ``writer`` its files."""

    args: argparse.Namespace
    config: TrainingConfig
    accelerator: Accelerator
    models: StableDiffusionModels
    trainable: "Trainable"
    data: TrainingData
    loss: LossContext
    optimization: Optimization
    states: train_state.RunStates
    progress: train_state.Progress
    validator: Optional[validation.Validation]
    writer: Any  # the trainable's file writer (lora_files.LoraWriter for a LoRA)
    outputs: RunOutputs
    average_loss: float = math.nan
    stopped: Optional[str] = None  # why the self-healing stopped the run
    best: Optional[best_checkpoint.BestCheckpoint] = None  # with validation: the best file, early stop

    @property
    def network(self) -> torch.nn.Module:
        return self.trainable.module

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def save_state(self, name: str) -> bool:
        """Write state folder ``name``; False when refused (untrained weights, or see ``RunStates.save``)."""
        if not self.writer.trained:  # nothing worth resuming, and it would replace an earlier run's state
            print(f"\nnot saving state {name}: it would hold the initial, untrained {self.trainable.kind} (no "
                  f"optimizer step of this run has trained it yet)", flush=True)
            return False
        self.outputs.flush()
        return self.states.save(name, self.progress)

    def weights_for_use(self) -> AbstractContextManager[None]:
        """The context in which the trained module holds the weights samples, validation and files see
        (the EMA, schedule-free's average); training states are saved outside it."""
        return ema.weights_for_use(self.optimization.optimizer, self.optimization.ema)
