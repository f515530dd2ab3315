"""How an optimizer step turns the window's loss into an update: the strategy ``Trainer.train_step`` calls.

The loop's order is the same for both; only where the gradients live differs:

    backward (each micro-batch) -> measure -> guard, healing -> apply or discard

* :class:`UnfusedStep` (the default): each micro-batch's backward accumulates into ``.grad``; ``measure``
  gathers the gradients into the flat buffer (summed over processes), lets the debug faults in and
  measures them; ``apply`` unscales, clips and steps (``Trainer.optimizer_step``), ``discard`` drops them.
* :class:`FusedStep` (``--fused_backward_pass`` / ``--fused_optimizer_groups``, full fine-tuners): the
  window's one backward is kept for ``measure``, which runs the measuring pass of
  ``library.fused_backward.FusedBackward`` (the whole step's norm, the scaler's overflow check, the clip
  norm; only the gradients that complete last are kept, within a memory budget); ``apply`` steps the kept
  ones, then runs the second pass that steps each other parameter (or group) as its gradient appears,
  ``discard`` drops the kept gradients and the graph. docs/fused_backward.md.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from accelerate import Accelerator

from library import fault_injection, optimizers, sharding
from library.fused_backward import FusedBackward
from library.grad_guard import GradientMeasurement

if TYPE_CHECKING:
    from library.training.config import TrainingConfig
    from library.training.run import Optimization


class UnfusedStep:
    """Gradients held in ``.grad`` (the flat buffer's views) from the backward to the optimizer step."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator

    def backward(self, objective: torch.Tensor) -> None:
        self.accelerator.backward(objective)

    def measure(self, optimization: "Optimization", step: int, window_loss: torch.Tensor,
                riders: Optional[torch.Tensor]) -> GradientMeasurement:
        sharding.sum_gradients_across_processes(optimization.gradients)
        fault_injection.inject(optimization.injections, step, self.accelerator.process_index,
                               optimization.trainable_params)
        scaler = optimization.scaler
        return optimization.monitor.measure(scale=scaler.get_scale_tensor() if scaler else None, loss=window_loss,
                                            riders=riders)

    def discard(self, optimization: "Optimization") -> None:
        optimization.optimizer.zero_grad(set_to_none=True)

    def apply(self, trainer: Any, config: "TrainingConfig", optimization: "Optimization", loss: float) -> None:
        trainer.optimizer_step(config, optimization.optimizer, optimization.lr_scheduler, optimization.scaler,
                               optimization.trainable_params, loss)


class FusedStep:
    """The update applied during a second backward over the window's graph (``FusedBackward``): no full
    gradient is held. One micro-batch per step (``--gradient_accumulation_steps 1``, checked before)."""

    def __init__(self, fused: FusedBackward, announce: Callable[[str], None] = print) -> None:
        self.fused_backward = fused
        self._objective: Optional[torch.Tensor] = None
        self._announce: Optional[Callable[[str], None]] = announce  # once, after the first applied step

    def backward(self, objective: torch.Tensor) -> None:
        """Keep the (scaled) objective: ``measure`` runs its backward."""
        if self._objective is not None:
            raise RuntimeError("a fused backward takes one micro-batch per optimizer step")
        self._objective = objective

    def measure(self, optimization: "Optimization", step: int, window_loss: torch.Tensor,
                riders: Optional[torch.Tensor]) -> GradientMeasurement:
        objective, self._objective = self._objective, None
        return self.fused_backward.measure(objective, loss_value=window_loss, riders=riders)

    def discard(self, optimization: "Optimization") -> None:
        self.fused_backward.discard()

    def apply(self, trainer: Any, config: "TrainingConfig", optimization: "Optimization", loss: float) -> None:
        """Unscale, clip (the whole step's coefficient) and step each parameter as the second pass reaches
        it; the scaler and the LR schedule as ``Trainer.optimizer_step`` (the schedule advances only when
        the step was applied)."""
        fused = self.fused_backward
        stepped = fused.apply()  # False: the scaler found inf/NaN, nothing changed
        if stepped and self._announce is not None:
            self._announce(
                f"fused backward: the measuring pass kept {fused.kept_gradient_bytes / 2**30:.3g} GiB of the gradients "
                f"that complete last; the applying pass computed {fused.recomputed_gradients} of "
                f"{len(fused.parameters)} gradients again (--fused_backward_kept_gradient_gib)")
            self._announce = None
        if optimization.scaler is not None:
            optimization.scaler.update()
        if stepped:
            optimizers.step_schedule(optimization.lr_scheduler, loss)
