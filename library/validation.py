"""Validation loss (kohya-ss sd-scripts' ``--validation_split`` family): when to validate, the pass, its scalars.

``--validation_split`` (or ``validation_split`` in a dataset config) holds a fraction of each
DreamBooth training subset's images out of training (``datasets.plan.split_train_validation``);
they form a second dataset with the same subset options. A validation pass scores the LoRA on
it with the trainer's own loss (same loss type and weightings as training) at kohya's four
fixed timesteps, 200/400/600/800 by default.

Every input of a pass is a pure function of (validation seed, sample, timestep): the batches
are the validation set's epoch-1 batches under the validation seed, and the noise and the VAE
latent sample are keyed draws (``library/noise.py``) whose epoch slot is ``-1 - timestep``,
which no training draw uses. So every pass sees exactly the same inputs (values are comparable
over time: two passes on the same weights give the same number) and a pass draws from no
training random stream: a run writes the same LoRA whether or how often it validates.

The validation set is read once, at the first pass, and what the frozen VAE (and text encoders,
where nothing in them trains) make of it is kept (``library/fixed_batches.py``): later passes run
the UNet only, with the same bits as reading and encoding the set again.

Differences from kohya, on purpose: kohya re-seeds the global RNGs per pass and draws noise
in sequence (so the number depends on the batch layout); it also validates after the last,
possibly partial, epoch, where this trainer validates at completed epochs only.
"""
from __future__ import annotations

import argparse
from typing import Any, Callable, Iterable, Optional

import numpy as np
import torch
from accelerate.utils import send_to_device
from tqdm import tqdm

from library import sharding
from library.datasets.dataset import StepLayout, TrainDataset, collate_single_batch
from library.errors import UserError

NUM_TIMESTEPS = 4  # kohya's fixed count (its NUM_VALIDATION_TIMESTEPS)
DATASET_EPOCH = 1  # the validation set is always read as its epoch 1: one fixed order, flips and captions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """kohya's validation flags (names, types, defaults)."""
    add = parser.add_argument
    add("--validation_seed", type=int, default=None,
        help="seed of the train/validation split, the validation set's order and captions and the validation "
             "noise (default: --seed; kohya: the global random state)")
    add("--validation_split", type=float, default=0.0,
        help="fraction in [0, 1) of each DreamBooth training subset's images held out for validation loss, "
             "disjoint from the trained ones (kohya's validation part can overlap them); reg images are never "
             "held out; refused for fine-tuning datasets, which kohya does not split (default 0: no validation)")
    add("--validate_every_n_steps", type=int, default=None,
        help="also validate after every N-th optimizer step (default: only at epoch ends)")
    add("--validate_every_n_epochs", type=int, default=None,
        help="validate at the end of every N-th completed epoch (default: every epoch, when there is a validation "
             "set; kohya also validates after a last, partial epoch)")
    add("--max_validation_steps", type=int, default=None,
        help="at most this many validation batches per process and pass (default: the whole validation set)")


def validate_arguments(args: argparse.Namespace) -> None:
    """Refuse a bad validation flag (one UserError line naming it) before anything loads."""
    if not 0.0 <= args.validation_split < 1.0:
        raise UserError(f"--validation_split {args.validation_split} must be at least 0 and below 1 "
                        f"(the fraction of each training subset's images kept for validation)")
    for flag in ("validate_every_n_steps", "validate_every_n_epochs", "max_validation_steps"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise UserError(f"--{flag} {value} must be a positive integer (leave it out for the default)")


def fixed_timesteps(min_timestep: Optional[int], max_timestep: Optional[int], num_train_timesteps: int) -> list[int]:
    """kohya's validation timesteps: the inner 4 of 6 evenly spaced points from min to max
    (``--min_timestep`` or 0, ``--max_timestep`` or the schedule length): 200, 400, 600, 800 by default."""
    low = 0 if min_timestep is None else min_timestep
    high = num_train_timesteps if max_timestep is None else max_timestep
    return [int(t) for t in np.linspace(low, high, NUM_TIMESTEPS + 2, dtype=int)[1:-1]]


def draw_epoch(timestep: int) -> int:
    """The epoch slot of validation's keyed noise and latent draws at ``timestep``: negative,
    so no training draw (epochs >= 1) shares its key even when the validation seed is ``--seed``."""
    return -1 - timestep


# (batch, timesteps (B,), epoch slot of the draws, seed of the draws) -> the batch's normalised
# loss, a 0-dim tensor, and its weight sum (0: nothing in the batch counts, e.g. fully masked).
BatchLoss = Callable[[dict[str, Any], torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]]

# The validation loader -> its batches as the passes read them: read and encoded once (Trainer.fixed_batches,
# library/fixed_batches.py); without it the loader is read at every pass.
FixedBatchesOf = Callable[[Iterable[dict[str, Any]]], Iterable[dict[str, Any]]]


class Validation:
    """The validation set of a run, its schedule and its passes.

    Every process must call :meth:`run` at the same points (it ends in one all-reduce); the
    ``due_*`` decisions depend only on the step and epoch, which all processes share.
    """

    def __init__(self, args: argparse.Namespace, dataset: TrainDataset, accelerator: Any,
                 num_train_timesteps: int, num_workers: int,
                 fixed_batches: Optional[FixedBatchesOf] = None) -> None:
        self.args = args
        self.dataset = dataset
        self.accelerator = accelerator
        self.timesteps = fixed_timesteps(args.min_timestep, args.max_timestep, num_train_timesteps)
        self.last_per_timestep: dict[int, float] = {}  # the latest pass's mean loss at each timestep
        # Captions as training ends (token warm-up over), in one fixed epoch.
        dataset.step_layout = StepLayout(max_train_steps=args.max_train_steps)
        dataset.set_epoch(DATASET_EPOCH, first_step=args.max_train_steps)
        # This process's share, without the training loader's padding batches (nothing here needs
        # equal counts); the first --max_validation_steps of them.
        shard = [index for index in sharding.ShardSampler(dataset, accelerator.process_index,
                                                          accelerator.num_processes) if index >= 0]
        shard = shard[: args.max_validation_steps]
        num_workers = min(num_workers, len(shard))  # a worker per batch at most: passes can be short
        self.loader = torch.utils.data.DataLoader(
            dataset, batch_size=1, sampler=shard, collate_fn=collate_single_batch, num_workers=num_workers,
            persistent_workers=args.persistent_data_loader_workers and num_workers > 0,
            # Its own generator: iterating a DataLoader draws a worker seed from the global torch RNG otherwise.
            generator=torch.Generator(),
        )
        self.batches = fixed_batches(self.loader) if fixed_batches is not None else self.loader

    def due_after_step(self, step: int) -> bool:
        every = self.args.validate_every_n_steps
        return every is not None and step % every == 0

    def due_after_epoch(self, epoch: int) -> bool:
        """``epoch``: the 1-based number of the epoch just completed."""
        every = self.args.validate_every_n_epochs
        return every is None or epoch % every == 0

    def loss(self, network: torch.nn.Module, batch_loss: BatchLoss) -> float:
        """The mean loss over every (batch, fixed timestep) of the validation set on all processes.

        ``network`` is put in eval mode (LoRA dropouts off) and back in train mode; no gradient
        is recorded and no global RNG is drawn from. Batches in which nothing counts (weight
        sum 0) are left out of the mean.
        """
        return self.losses(network, batch_loss)[0]

    def losses(self, network: torch.nn.Module, batch_loss: BatchLoss) -> tuple[float, dict[int, float]]:
        """:meth:`loss` and the mean loss at each fixed timestep (``{timestep: value}``) of the same pass."""
        return pass_losses(self.batches, network, batch_loss, self.timesteps, self.dataset.seed, self.accelerator)

    def run(self, kind: str, network: torch.nn.Module, batch_loss: BatchLoss, average_train_loss: float,
            where: str) -> dict[str, float]:
        """One pass; returns kohya's scalars ``loss/validation/<kind>_average`` and ``_divergence``
        (validation minus ``average_train_loss``) and prints one line on the main process.
        ``kind``: "step" or "epoch"; ``where``: the point of training, for the printed line."""
        value, self.last_per_timestep = self.losses(network, batch_loss)
        divergence = value - average_train_loss
        if self.accelerator.is_local_main_process:
            tqdm.write(f"validation loss {where}: {value:.6f} (validation - average training loss: {divergence:+.6f})")
        return {f"loss/validation/{kind}_average": value, f"loss/validation/{kind}_divergence": divergence}


def pass_losses(batches: Iterable[dict[str, Any]], network: torch.nn.Module, batch_loss: BatchLoss,
                timesteps: list[int], seed: int, accelerator: Any) -> tuple[float, dict[int, float]]:
    """The mean loss over every (batch, timestep) on all processes, and the mean at each timestep: a
    validation pass over ``batches`` (a validation set's, or the effect monitor's probe of training
    images), with keyed noise and latent draws (``draw_epoch``, ``seed``). ``network`` in eval mode
    meanwhile; batches in which nothing counts (weight sum 0) are left out."""
    device = accelerator.device
    loss_sum, count = torch.zeros((), dtype=torch.float64, device=device), 0
    timestep_sums = torch.zeros(2, len(timesteps), dtype=torch.float64, device=device)  # sums, counts
    network.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                batch = send_to_device(batch, device)
                size = len(batch["sample_indices"])
                for index, timestep in enumerate(timesteps):
                    loss, weight_sum = batch_loss(batch, torch.full((size,), timestep, dtype=torch.long),
                                                  draw_epoch(timestep), seed)
                    if weight_sum > 0:
                        loss_sum += loss.double()
                        count += 1
                        timestep_sums[0, index] += loss.double()
                        timestep_sums[1, index] += 1
    finally:
        network.train()
    totals = torch.cat([torch.stack([loss_sum, torch.tensor(float(count), dtype=torch.float64, device=device)]),
                        timestep_sums.flatten()])
    totals = accelerator.reduce(totals, reduction="sum").tolist()
    loss_sum, count = totals[:2]
    sums, counts = totals[2:2 + len(timesteps)], totals[2 + len(timesteps):]
    per_timestep = {timestep: (total / n if n else float("nan")) for timestep, total, n in zip(timesteps, sums, counts)}
    return (loss_sum / count if count else float("nan")), per_timestep


def create(args: argparse.Namespace, dataset: Optional[TrainDataset], accelerator: Any, num_train_timesteps: int,
           num_workers: int, fixed_batches: Optional[FixedBatchesOf] = None) -> Optional[Validation]:
    """The run's :class:`Validation`, or None without a validation set (saying so when a validation
    schedule flag was given: kohya ignores them silently)."""
    if dataset is None:
        given = [flag for flag in ("validate_every_n_steps", "validate_every_n_epochs", "max_validation_steps")
                 if getattr(args, flag) is not None]
        if given:
            print(f"--{', --'.join(given)}: no validation set (set --validation_split or validation_split in "
                  f"the dataset config): no validation")
        return None
    print(f"validation: {dataset.num_train_images} images (with repeats), {len(dataset)} batches, "
          f"timesteps {fixed_timesteps(args.min_timestep, args.max_timestep, num_train_timesteps)}")
    return Validation(args, dataset, accelerator, num_train_timesteps, num_workers, fixed_batches)
