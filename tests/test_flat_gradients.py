"""Gradients in one flat buffer: the same optimizer steps as separate gradients, None kept apart from zero."""
from __future__ import annotations

import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from library import sharding
from library.flat_gradients import FlatGradients
from library.grad_guard import GradientMonitor


class Branches(torch.nn.Module):
    """A layer always used, one used only on some steps (module dropout's effect), slices frozen per
    step (DyLoRA's), and one layer whose output never reaches the loss (a text encoder's last layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.always = torch.nn.Linear(6, 6)
        self.sometimes = torch.nn.Linear(6, 6)
        self.slices = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(6)) for _ in range(3)])
        self.unused = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        for index, piece in enumerate(self.slices):
            piece.requires_grad_(index == step % 3)
        out = self.always(x) + torch.stack(tuple(self.slices)).sum(0)
        if step % 2:
            out = out + self.sometimes(x)
        self.unused(x)
        return out.square().mean()


def train(flat: bool, steps: int = 6, micro_batches: int = 2) -> tuple[list[torch.Tensor], list[list[bool]]]:
    """Weights after ``steps`` AdamW steps (weight decay: a zero gradient would still move a weight),
    and per step which parameters had a gradient at the optimizer step."""
    torch.manual_seed(0)
    model = Branches()
    parameters = list(model.parameters())
    optimizer = torch.optim.AdamW(parameters, lr=0.1, weight_decay=0.1)
    gradients = FlatGradients(parameters) if flat else None
    present = []
    for step in range(steps):
        for micro in range(micro_batches):
            model(torch.randn(4, 6), step + micro * (step % 2)).backward()
        if flat:
            gradients.gather()
            for parameter, view in zip(gradients.parameters, gradients.views):
                assert parameter.grad is None or parameter.grad is view  # the optimizer steps on the buffer
        present.append([p.grad is not None for p in parameters])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in parameters], present


def test_optimizer_steps_are_those_of_separate_gradients_with_none_kept():
    flat_weights, flat_present = train(flat=True)
    plain_weights, plain_present = train(flat=False)
    assert flat_present == plain_present
    assert not all(all(step) for step in plain_present)  # some gradients were None
    assert all(torch.equal(a, b) for a, b in zip(flat_weights, plain_weights))


def test_gradients_accumulated_in_place_are_the_separate_ones_with_no_second_copy():
    """A whole model's mode (``accumulate_in_place``): each step's backward passes (two micro-batches)
    add into the zeroed buffer itself, so the gradients exist once; every parameter the loss reaches
    gets the same values and updates as separate gradients, bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))
    reference = [p.detach().clone() for p in model.parameters()]

    def run(in_place: bool) -> list[torch.Tensor]:
        with torch.no_grad():
            for parameter, value in zip(model.parameters(), reference):
                parameter.copy_(value)
        parameters = list(model.parameters())
        optimizer = torch.optim.AdamW(parameters, lr=0.1, weight_decay=0.1)
        gradients = FlatGradients(parameters, accumulate_in_place=in_place)
        generator = torch.Generator().manual_seed(1)
        for _ in range(3):
            gradients.attach()
            for _ in range(2):
                model(torch.randn(4, 6, generator=generator)).square().mean().backward()
            if in_place:  # autograd added into the buffer: no gradient tensor of its own
                storage = gradients.flat.untyped_storage().data_ptr()
                assert all(p.grad.untyped_storage().data_ptr() == storage for p in parameters)
            gradients.gather()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return [p.detach().clone() for p in parameters]

    in_place, separate = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(in_place, separate))
    assert not all(torch.equal(a, b) for a, b in zip(in_place, reference))  # it trained


def test_the_monitor_reads_the_buffer_with_one_norm():
    torch.manual_seed(1)
    model = Branches()
    gradients = FlatGradients(model.parameters())
    monitor = GradientMonitor(gradients, cosine=True, chunk_numel=7)
    separate = GradientMonitor(gradients.parameters, cosine=True, chunk_numel=7)
    for step in range(3):
        model(torch.randn(4, 6), step).backward()
        gradients.gather()
        ours, reference = monitor.measure(), separate.measure()
        assert ours.norm == reference.norm
        assert math.isnan(ours.cosine) if step == 0 else ours.cosine == pytest.approx(reference.cosine, abs=1e-7)
        model.zero_grad(set_to_none=True)
    assert torch.equal(monitor.state_dict()["previous_gradient"], separate.state_dict()["previous_gradient"])


def test_the_norm_of_a_large_buffer_keeps_float32_accuracy_on_the_cpu():
    """Full-size LoRA buffers hold millions of values. torch's CPU reduction of one long vector sums in a
    few float32 lanes (relative error 4e-4 here); the monitor sums rows of 4096, then the rows' norms.
    Rounding errors of such a two-level sum grow like sqrt(4096 + rows) float32 ulps (random signs); the
    tolerance is 8 times that."""
    generator = torch.Generator().manual_seed(0)
    sizes = torch.randint(100, 40000, (400,), generator=generator).tolist()
    parameters = [torch.nn.Parameter(torch.zeros(size)) for size in sizes]
    for parameter in parameters:
        parameter.grad = torch.randn(parameter.numel(), generator=generator) * torch.rand(1, generator=generator) * 10
    gradients = FlatGradients(parameters)
    gradients.gather()
    exact = gradients.flat.double().norm().item()
    rows = math.ceil(gradients.numel / 4096)
    tolerance = 8 * math.sqrt(4096 + rows) * torch.finfo(torch.float32).eps / 2
    assert abs(GradientMonitor(gradients).measure().norm - exact) / exact < tolerance
    assert abs(GradientMonitor(parameters).measure().norm - exact) / exact < tolerance


def test_mixed_dtypes_are_refused():
    with pytest.raises(ValueError, match="one device in one dtype"):
        FlatGradients([torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _summing_worker(rank: int, port: int, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        both, rank0_only, nowhere = (torch.nn.Parameter(torch.zeros(3)) for _ in range(3))
        gradients = FlatGradients([both, rank0_only, nowhere])
        loss = (both * (rank + 1)).sum() + (rank0_only.sum() * 5 if rank == 0 else 0)
        loss.backward()
        sharding.sum_gradients_across_processes(gradients)
        results[rank] = [None if p.grad is None else p.grad.tolist() for p in gradients.parameters]
        assert all(p.grad is None or p.grad is view for p, view in zip(gradients.parameters, gradients.views))
    finally:
        dist.destroy_process_group()


def test_two_processes_sum_and_keep_none_where_no_process_has_a_gradient():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_summing_worker, args=(_free_port(), results), nprocs=2)
        results = dict(results)
    # both: 1 + 2 on every value; rank0_only: rank 0's 5 on both ranks; nowhere: None on both
    assert results[0] == results[1] == [[3.0] * 3, [5.0] * 3, None]
