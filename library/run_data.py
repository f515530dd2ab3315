"""The data of a run: datasets, this process's loader, epochs, and the windows of batches the loop trains.

A *window* is one optimizer step's micro-batches (``--gradient_accumulation_steps`` of them).
:meth:`TrainingData.windows` walks the epochs from where the run is (``Progress``: epoch and
batches done, so a resumed run continues at the batch where it stopped), drops quarantined
images from every batch, and leaves out the windows in which no process has an image left:
they are no optimizer step.
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from accelerate.utils import send_to_device

from library import sharding
from library.datasets import dataset as datasets
from library.datasets.dataset import TrainDataset
from library.train_state import Progress


@dataclass
class Window:
    """The micro-batches of one optimizer step of ``epoch`` (on the device, quarantined images left out;
    empty when this process has none left); ``ends_epoch``: its last batch is the epoch's last."""

    epoch: int
    batches: list[dict[str, Any]] = field(default_factory=list)
    ends_epoch: bool = False
    trains: bool = True  # False: no process has an image left in it (only an epoch end to report)


class TrainingData:
    """The training and validation datasets, this process's loader and the run's step counts."""

    def __init__(self, args: argparse.Namespace, dataset: TrainDataset, validation_dataset: Optional[TrainDataset],
                 rank: int, world_size: int, device: torch.device) -> None:
        self.args = args
        self.dataset = dataset
        self.validation_dataset = validation_dataset
        self.device = device
        self.num_workers = min(args.max_data_loader_n_workers, os.cpu_count() or 1)
        self.sampler = sharding.ShardSampler(dataset, rank, world_size)
        self.loader = sharding.train_loader(dataset, self.sampler, self.num_workers,
                                            args.persistent_data_loader_workers, args.seed)
        self.accumulation = args.gradient_accumulation_steps
        self.steps_per_epoch = math.ceil(len(self.loader) / self.accumulation)
        if args.max_train_epochs is not None:
            args.max_train_steps = args.max_train_epochs * self.steps_per_epoch
        self.num_epochs = math.ceil(args.max_train_steps / self.steps_per_epoch)
        dataset.step_layout = datasets.StepLayout(self.accumulation, world_size, args.max_train_steps)
        self.quarantined: frozenset[int] = frozenset()  # image indices, kept current by the trainer

    def __len__(self) -> int:
        """Batches per epoch on this process."""
        return len(self.loader)

    def windows(self, progress: Progress, max_steps: int, stopped: Callable[[], bool],
                on_epoch_start: Callable[[], None] = lambda: None) -> Iterator[Window]:
        """The windows from where ``progress`` is until ``max_steps`` optimizer steps or ``stopped()``.

        Advances ``progress.batches_done`` by each window's batches before yielding it (the step it
        makes is counted by the trainer); the epoch itself moves on in :meth:`next_epoch`, which the
        trainer calls after a window that ``ends_epoch``. ``on_epoch_start`` runs before an epoch's
        (or a resumed epoch's) first batch is loaded.
        """
        while progress.global_step < max_steps and not stopped():
            epoch = progress.epoch
            if progress.batches_done == 0 or progress.epoch_first_step is None:
                # token warm-up keys captions by the step each batch trains in, counted from here
                progress.epoch_first_step = progress.global_step - progress.batches_done // self.accumulation
            self.dataset.set_epoch(epoch, progress.epoch_first_step)
            self.sampler.start_at(progress.batches_done)
            on_epoch_start()
            batches = iter(self.loader)
            while progress.global_step < max_steps and not stopped():
                position = progress.batches_done
                loaded = list(itertools.islice(batches, self.accumulation))
                progress.batches_done += len(loaded)
                ends_epoch = progress.batches_done >= len(self.loader)
                window = Window(epoch, ends_epoch=ends_epoch)
                if loaded:
                    window.trains = self._any_image_left(position, len(loaded))
                    window.batches = [batch for batch in map(self._without_quarantined, loaded) if batch is not None]
                    window.batches = [send_to_device(batch, self.device) for batch in window.batches]
                else:
                    window.trains = False
                if window.trains or ends_epoch:
                    yield window
                if ends_epoch:
                    break

    def next_epoch(self, progress: Progress) -> None:
        progress.start_next_epoch()

    def batches_since(self, position: tuple[int, int], progress: Progress) -> int:
        """Batches this process trained from ``position`` (epoch, batches done) to where ``progress`` is."""
        return progress.batches_since(position, len(self.loader))

    def _without_quarantined(self, batch: dict[str, Any]) -> Optional[dict[str, Any]]:
        if not self.quarantined:
            return batch
        keep = [self.dataset.image_index_of(sample_id) not in self.quarantined
                for sample_id in batch["sample_indices"].tolist()]
        if all(keep):
            return batch
        return datasets.select_samples(batch, keep) if any(keep) else None

    def _any_image_left(self, position: int, count: int) -> bool:
        """Whether any process's batches at positions ``position..position+count`` keep an image (the
        same answer on every process: it reads the epoch's order, not the loaded batches)."""
        if not self.quarantined:
            return True
        return any(self.dataset.image_index_of(sample_id) not in self.quarantined
                   for offset in range(count)
                   for index in self.sampler.dataset_indices(position + offset)
                   for sample_id in self.dataset.batch_sample_ids(index))
