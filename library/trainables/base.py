"""``Trainable``: what the training core (``library.training``) asks of the thing that trains.

The core owns the loop, the guard, the scaler, healing, EMA, states and outputs; a trainable says
which tensors train and how (parameter groups and learning rates), where they live in the models, how
they are written to files, what a state and a healthy point hold, and what its files' metadata say.
docs/training_core.md explains each hook and what a full-model trainable has to provide.

``Trainable`` is an abstract base class: the hooks every trainable must answer are abstract (a
trainable lacking one cannot be created); the others have the default a trainable without that concern needs (no options checked twice, no
monitor, no scalars of its own, the image dataset and the diffusion loss), so a trainable defines
only what it does.
"""
from __future__ import annotations

import abc
import argparse
from typing import Any, Optional, Sequence

import torch
from accelerate import Accelerator

from library.model_loading import StableDiffusionModels


class Trainable(abc.ABC):
    kind: str = "weights"  # what the messages call it ("LoRA")
    writes_models: bool = False  # its files are whole models (own --save_model_as / --save_precision), not LoRA-like
    module: Optional[torch.nn.Module] = None  # what trains once ``attach`` ran; a state component ("network")

    @abc.abstractmethod
    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Its own options (one argparse definition each)."""

    @abc.abstractmethod
    def validate_arguments(self, args: argparse.Namespace, sdxl: bool) -> None:
        """Refuse bad values of its options (``UserError``) before anything is loaded."""

    @abc.abstractmethod
    def configure(self, args: argparse.Namespace) -> None:
        """Resolve its options once into its own typed config (after presets and aliases); the hooks
        below read that config, not the namespace."""

    @abc.abstractmethod
    def parts(self) -> tuple[bool, bool]:
        """Which models it trains: (the UNet, the text encoders). The core switches gradient
        checkpointing, ``torch.compile`` and gradient recording on for those."""

    @abc.abstractmethod
    def attach(self, models: StableDiffusionModels, unet_module_names: Optional[dict[str, str]]) -> None:
        """Create what trains on ``models`` (before they are placed on the device); raise
        ``UserError`` when nothing would train."""

    @abc.abstractmethod
    def place(self, device: torch.device, autocast_dtype: torch.dtype) -> None:
        """Move what trains to the device in its training dtype (``--full_fp16`` / ``--full_bf16``)."""

    @abc.abstractmethod
    def records_text_encoder_gradients(self) -> bool:
        """Whether the text encoders' forward must record gradients."""

    def changes_text_conditioning(self) -> bool:
        """Whether the text encoders' outputs for the same captions can differ between passes: something of
        it is in their forward (weights it trains, an adapter whose multiplier the effect monitor sets to 0,
        new token vectors). False lets a batch scored again and again keep its conditioning
        (library/fixed_batches.py). The default, True, is never wrong (the captions are encoded at every pass)."""
        return True

    @abc.abstractmethod
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups with their learning rates (``UserError`` when none trains)."""

    def after_optimizer_step(self) -> dict[str, float]:
        """Work after a real optimizer step (e.g. max-norm regularisation); the scalars it logs."""
        return {}

    @abc.abstractmethod
    def weights_finite(self) -> bool:
        """Whether every trained weight is finite (a host sync; only asked on the non-finite path)."""

    @abc.abstractmethod
    def metadata(self, args: argparse.Namespace, accelerator: Accelerator, models: StableDiffusionModels,
                 data: Any, optimization: Any, progress: Any) -> dict[str, str]:
        """The metadata every file of the run carries (main process only)."""

    @abc.abstractmethod
    def writer(self, args: argparse.Namespace, metadata: dict[str, str], ema_average: Any, current_metadata: Any,
               resumed: bool) -> Any:
        """Its files' writer: ``on_step``, ``on_epoch_end``, ``write``, ``mark_abandoned``, ``written``,
        ``save_dtype`` and ``trained`` (whether the weights are worth a state or a file yet: set when
        ``resumed`` or started from trained weights) (``library.lora_files.LoraWriter`` is the LoRA one)."""

    def training_data(self, args: argparse.Namespace, accelerator: Accelerator) -> Optional[Any]:
        """Its own batches, for a trainer without an image dataset (LECO's prompt pairs): an object
        with ``library.run_data.TrainingData``'s interface whose batches carry ``sample_indices``,
        ``loss_weights``, ``latents`` (for their shape) and ``timesteps`` (the plan's), each drawn
        keyed by the seed and its position so a resumed run draws the same. None (the default): the
        image dataset the options describe."""
        return None

    def compute_loss(self, hooks: Any, run: Any, batch: dict[str, Any], epoch: int, plan: Any,
                     timesteps: Optional[torch.Tensor] = None, seed: Optional[int] = None) -> Any:
        """A micro-batch's ``losses.WeightedLoss`` (``hooks``: the trainer's model hooks, ``run``: the
        ``LossContext``) for a trainable with its own batches (``training_data``), which computes its own
        target here. None (the default): the core's diffusion loss of an image batch
        (``library.training.diffusion_loss.compute_loss``)."""
        return None

    def start(self, args: argparse.Namespace, is_main_process: bool) -> None:
        """Ready its per-run monitors once every option (the step count) is final."""

    def before_training(self, trainer: Any, run: Any) -> None:
        """Last preparation once the run is built and the learning-rate finder (if any) ran: e.g. the
        LoRA's effect monitor takes its fixed probe of training images when there is no validation split."""

    def step_scalars(self, step: int, *, guard_skipped: int, guard_window: Sequence[float], scaler_skipped: int,
                     learning_rates: list[float]) -> dict[str, float]:
        """Scalars of its own logged with a step's (e.g. what the LoRA changes; ``guard_window``: the
        guard's norms now)."""
        return {}

    def validation_pass(self, run: Any, kind: str, run_pass: Any, batch_loss: Any) -> dict[str, float]:
        """``run_pass()`` (the validation pass and its scalars), with its own scalars added."""
        return run_pass()

    @abc.abstractmethod
    def check_written(self, path: str, save_dtype: Optional[torch.dtype]) -> None:
        """Re-read the final file just written and warn when it does not hold what trained."""

    @abc.abstractmethod
    def weights_for_report(self) -> dict[str, torch.Tensor]:
        """The trained tensors by name (``--debug_report_weights``: processes agree)."""
