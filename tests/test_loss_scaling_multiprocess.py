"""Two CPU processes (gloo): an inf gradient on one rank makes both ranks skip and back off."""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 2
PATTERN = ["clean", "inf@1", "clean", "nan@0", "clean"]
"""Per iteration: clean everywhere, or a non-finite gradient on one rank only."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, port: int, policy: str, out_dir: str) -> None:
    from library.loss_scaling import LossScaler, available_loss_scalers
    from library.loss_scaling import _REGISTRY as registry

    assert policy in available_loss_scalers()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        torch.manual_seed(0)  # same weights on both ranks
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = LossScaler(registry[policy](growth_interval=2), "cpu", name=policy)
        inputs = torch.linspace(-1.0, 1.0, 4) * (rank + 1)  # different data per rank, like DDP shards
        record = {"scales": [], "stepped": [], "weights_changed": []}
        for plan in PATTERN:
            before = model.weight.detach().clone()
            scaler.scale(model(inputs).square().sum()).backward()
            if plan != "clean":
                value, _, bad_rank = plan.partition("@")
                if rank == int(bad_rank):
                    model.weight.grad.view(-1)[0] = float(value)
            scaler.unscale_(optimizer)  # the all-reduce of the overflow flag happens here
            record["stepped"].append(scaler.step(optimizer))
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            record["scales"].append(scaler.get_scale())
            record["weights_changed"].append(not torch.equal(model.weight, before))
        record["overflow_count"] = scaler.overflow_count
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
        dist.barrier()  # leave together: gloo can abort a process whose peer tears down first
    finally:
        dist.destroy_process_group()
    # Skip interpreter teardown: torch's gloo threads sometimes abort a spawned process there
    # ("terminate called without an active exception") after all the work is written.
    os._exit(0)


def test_an_overflow_on_one_rank_skips_and_backs_off_on_every_rank(tmp_path):
    mp.spawn(_worker, args=(_free_port(), "dynamic", str(tmp_path)), nprocs=WORLD_SIZE, join=True)
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    for record in records:
        # dynamic, growth_interval=2: clean, inf on rank 1 (x0.5), clean, NaN on rank 0 (x0.5), clean
        # (each overflow restarted the clean-step counter, so no growth)
        assert record["stepped"] == [True, False, True, False, True]
        assert record["weights_changed"] == record["stepped"]
        assert record["scales"] == [65536.0, 32768.0, 32768.0, 16384.0, 16384.0]
        assert record["overflow_count"] == 2
    assert records[0] == records[1]
