"""A training loss you can read: each sample's loss divided by the base model's on the same inputs.

The raw training loss mostly tells which timesteps were drawn (it differs by orders of magnitude
between t = 0 and t = 999), not whether the LoRA learns. With ``--debiased_loss`` every
micro-batch runs one more UNet forward, without gradient, with the network's multiplier at 0 (the
adapters then add exactly 0: the frozen base model), on the same latents, noise, timesteps and
conditioning (re-encoded without the LoRA when a text encoder trains), and logs

* ``loss/debiased``: the mean over the step's samples of ``loss_i / base_loss_i`` (1: as good as the
  base model; below 1: better on its own training images), and ``loss/debiased_average`` (the
  mean over the last epoch's steps, as ``loss/average``), in the progress bar (``dbl_loss``), the
  trackers and ``--log_jsonl``, beside the raw loss.

Cost: one no-grad forward per micro-batch (about a third of a step where the UNet dominates;
measured in benchmarks/bench_debiased_loss.py). The extra forward draws no random number (the
RNGs are forked around it, LoRA dropouts are off in it), so a run writes the same LoRA with or
without the option. Without the option nothing runs; the validation set's debiased value is
``effect/val_rel`` (library/lora_effect.py), which costs nothing per step.
"""
from __future__ import annotations

import argparse
import contextlib
import math
from typing import Any, Iterator, Optional

import torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debiased_loss", action="store_true",
                        help="also log each step's loss divided by the base model's on the same inputs (loss/debiased; "
                             "one extra no-grad UNet forward per micro-batch). Default: off")


class DebiasedLoss:
    """The base-model switch and the step's collected ratios (one instance per run)."""

    def __init__(self, network: Any, device: torch.device, window: int) -> None:
        self.network = network
        self.device = device
        self.window = window  # steps of the running average (the epoch's, as loss/average)
        self._ratios: list[torch.Tensor] = []
        self.history: list[float] = []

    @contextlib.contextmanager
    def base_model(self) -> Iterator[None]:
        """The frozen base model: multiplier 0, adapters in eval mode, no gradient, RNGs untouched."""
        multiplier, training = self.network.multiplier, self.network.training
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            self.network.set_multiplier(0.0)
            self.network.eval()
            try:
                yield
            finally:
                self.network.set_multiplier(multiplier)
                self.network.train(training)

    def add(self, per_sample: torch.Tensor, base_per_sample: torch.Tensor) -> None:
        """One micro-batch's per-sample losses with and without the LoRA."""
        self._ratios.append((per_sample.detach().float() / base_per_sample.float()).flatten())

    def clear(self) -> None:
        """Forget the collected ratios (of steps that are not the run's, e.g. --find_lr's)."""
        self._ratios = []

    def take(self, accelerator: Any) -> dict[str, float]:
        """The step's scalars (mean over every process's samples), and the collected ratios cleared."""
        if not self._ratios:
            return {}
        ratios = torch.cat(self._ratios)
        self._ratios = []
        totals = torch.stack([ratios.double().sum(), torch.tensor(float(ratios.numel()), dtype=torch.float64,
                                                                    device=ratios.device)])
        total, count = accelerator.reduce(totals.to(self.device), reduction="sum").tolist()
        value = total / count if count else math.nan
        self.history = (self.history + [value])[-self.window:]
        finite = [item for item in self.history if math.isfinite(item)]
        return {"loss/debiased": value, "loss/debiased_average": sum(finite) / len(finite) if finite else math.nan}


def create(args: argparse.Namespace, network: Any, device: torch.device, window: int) -> Optional[DebiasedLoss]:
    return DebiasedLoss(network, device, window) if args.debiased_loss else None
