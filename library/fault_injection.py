"""Test hooks (hidden from --help): faults injected where they really happen.

``--debug_inject_grad STEP=nan|inf[@RANK] ...`` makes the trainer write the value into the
first trainable gradient right after the backward of the step's last micro-batch, before the
guard measures. The GradScaler, the gradient guard and the multi-process agreement then meet a
real non-finite gradient; nothing is mocked.

``--debug_kill_in_state_write K`` SIGKILLs the process while the K-th state is written;
``--debug_kill_in_healthy_point_write K`` while the K-th healthy point is written to disk
(``library.healthy_point``).

``--debug_disk_full_after_bytes N`` makes the disk look full once the run's file writes
(``library.atomic_files``: LoRA files, states, logs, caches) took N bytes: the write that
exceeds it stores what fits and fails with ENOSPC, as on a full disk, so the real error path
runs (tests need no small filesystem, which needs root to mount).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from library import atomic_files
from library.errors import UserError

VALUES = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug_inject_grad", type=str, nargs="*", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--debug_kill_in_state_write", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--debug_kill_in_healthy_point_write", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--debug_report_weights", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--debug_disk_full_after_bytes", type=int, default=None, help=argparse.SUPPRESS)


def simulate_full_disk(args: argparse.Namespace) -> None:
    """Apply ``--debug_disk_full_after_bytes`` to this process's file writes (off without it)."""
    atomic_files.simulate_full_disk(args.debug_disk_full_after_bytes)


@dataclass(frozen=True)
class Injection:
    value: float
    rank: Optional[int]  # None: every process


def parse_injections(items: Optional[Sequence[str]]) -> dict[int, Injection]:
    """``["3=nan", "7=inf@1"]`` -> {3: Injection(nan, None), 7: Injection(inf, 1)}."""
    injections = {}
    for item in items or []:
        step_text, _, rest = item.partition("=")
        value_text, _, rank_text = rest.partition("@")
        if not step_text.isdigit() or value_text not in VALUES or (rank_text and not rank_text.isdigit()):
            raise UserError(f"--debug_inject_grad {item}: expected STEP=nan|inf|-inf[@RANK], e.g. 3=nan or 5=inf@1")
        injections[int(step_text)] = Injection(VALUES[value_text], int(rank_text) if rank_text else None)
    return injections


def inject(injections: dict[int, Injection], step: int, rank: int, parameters: Sequence[torch.Tensor]) -> None:
    """Write the value planned for optimizer ``step`` (1-based) into one gradient element."""
    injection = injections.get(step)
    if injection is None or (injection.rank is not None and injection.rank != rank):
        return
    for parameter in parameters:
        if parameter.grad is not None:
            parameter.grad.view(-1)[0] = injection.value
            return


def state_write_hook(kill_at: Optional[int]) -> Optional[Callable[[Path], None]]:
    """With ``--debug_kill_in_state_write K`` (or ``--debug_kill_in_healthy_point_write K``): SIGKILL this
    process while the K-th state (healthy point) of the run is written (its files are complete but it is
    not yet renamed into place)."""
    if kill_at is None:
        return None
    written = {"count": 0}

    def hook(temporary: Path) -> None:
        written["count"] += 1
        if written["count"] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def weights_sha256(state: dict[str, torch.Tensor]) -> str:
    """A SHA-256 over the keys and values of a LoRA state dict, in key order."""
    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(key.encode())
        digest.update(state[key].detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def report_weights(rank: int, state: dict[str, torch.Tensor]) -> None:
    """Print one line with a SHA-256 of this process's LoRA weights (multi-process tests compare ranks)."""
    # One write of a short line is atomic on a pipe, so the lines of several processes never interleave.
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"\nrank {rank} lora_sha256 {weights_sha256(state)}\n".encode())
