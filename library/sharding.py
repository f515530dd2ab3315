"""Which batches each process trains, in what order, from where: sharding and mid-epoch resume.

One dataset item is one whole batch, ordered per epoch by (seed, epoch). Process ``rank``
of ``world_size`` takes batches ``rank, rank + world_size, ...``: every batch exactly once
per epoch, no duplicates and no gaps. When the count does not divide evenly, the shorter
processes get padding batches (a real batch with every loss weight and mask at zero), so
all processes run the same number of micro-batches (DDP needs that) while the padding
adds nothing to the exactly-normalised loss.
"""
from __future__ import annotations

import math
from typing import Any, Iterator

import torch

from library.datasets.dataset import collate_single_batch
from library.flat_gradients import FlatGradients


class ShardSampler(torch.utils.data.Sampler):
    """Batch indices for one process; padding is encoded as ``-1 - index``."""

    def __init__(self, dataset: torch.utils.data.Dataset, rank: int = 0, world_size: int = 1) -> None:
        self.dataset = dataset
        self.rank = rank
        self.world_size = world_size
        self.start = 0

    def batches_per_process(self) -> int:
        return math.ceil(len(self.dataset) / self.world_size)

    def start_at(self, local_batches_done: int) -> None:
        """Skip this many of this process's batches in the next pass only (mid-epoch resume)."""
        self.start = local_batches_done

    def __iter__(self) -> Iterator[int]:
        start, self.start = self.start, 0
        total = len(self.dataset)
        for position in range(start, self.batches_per_process()):
            index = position * self.world_size + self.rank
            yield index if index < total else -1 - (index % total)

    def __len__(self) -> int:
        return self.batches_per_process()

    def dataset_indices(self, position: int) -> list[int]:
        """The dataset batch each process trains at its ``position`` (padding: the batch it copies)."""
        total = len(self.dataset)
        return [(position * self.world_size + rank) % total for rank in range(self.world_size)]


class PaddedBatches(torch.utils.data.Dataset):
    """Resolves ``ShardSampler`` indices; a padding index gives a batch that weighs nothing."""

    def __init__(self, dataset: torch.utils.data.Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        if index >= 0:
            return self.dataset[index]
        batch = dict(self.dataset[-1 - index])
        batch["padding"] = True
        batch["loss_weights"] = torch.zeros_like(batch["loss_weights"])
        images = batch.get("latents", batch.get("images"))
        batch["alpha_masks"] = torch.zeros((images.shape[0], images.shape[2], images.shape[3]))
        return batch


def train_loader(dataset: torch.utils.data.Dataset, sampler: ShardSampler, num_workers: int,
                 persistent_workers: bool, seed: int) -> torch.utils.data.DataLoader:
    """The training DataLoader: one dataset item is one whole batch (ordered per epoch by
    (seed, epoch)), ``sampler`` picks this process's share, padding indices resolved."""
    return torch.utils.data.DataLoader(
        PaddedBatches(dataset),
        batch_size=1,
        sampler=sampler,
        collate_fn=collate_single_batch,
        num_workers=num_workers,
        # Its own generator: each iter() would otherwise draw a worker seed from the global torch
        # RNG, which dropout uses, so a resumed run would drop out differently.
        generator=torch.Generator().manual_seed(seed),
        persistent_workers=persistent_workers and num_workers > 0,
    )


def sum_gradients_across_processes(gradients: FlatGradients) -> None:
    """Gather the step's gradients into the flat buffer (``FlatGradients.gather``), then replace them by
    their sum over all processes with one all-reduce of it. A parameter keeps ``.grad`` None only
    when no process computed a gradient for it.

    The trainer does this itself instead of wrapping the network in DDP: the LoRA network's
    own forward is never called (its modules hook into the UNet), and the loss is already a
    global sum over the denominator of all processes, so a plain SUM is the exact gradient.
    """
    gradients.gather()
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1):
        return
    # One flag per parameter travels in the same buffer: a parameter without a gradient on every
    # process (e.g. DyLoRA's rank slices not drawn this step) must stay None, as in a 1-process
    # run, where optimizers skip it (a zero gradient would still move AdamW's moments). A missing
    # gradient is zero in the buffer, so the sum is right for the others.
    everywhere_here = gradients.all_have_gradients()
    flags = gradients.gradient_flags()
    torch.distributed.all_reduce(gradients.flat_with_flags(), op=torch.distributed.ReduceOp.SUM)
    if everywhere_here:  # then every parameter has a gradient: no flag to read (no host sync)
        return
    gradients.attach_received(flags.tolist())
