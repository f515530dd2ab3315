"""Where the self-healing's healthy point lives: in CPU memory, or in a file on disk when it does not fit.

The healthy point (``train_state.RunStates.capture``) is everything a rewind puts back: the trained
tensors, the optimizer, schedule, loss scaler, guard, EMA and the RNGs. For a LoRA that is megabytes and
it stays in memory, as it always did. For a full fine-tune it is the whole model plus its optimizer
state: a full-size SDXL UNet with AdamW is 28.7 GiB, which a machine that trains it seldom has spare.

``--healthy_point_location`` (:data:`LOCATIONS`): ``memory``; ``disk``; ``auto`` (default): memory when
the point is at most :data:`MEMORY_SHARE` of the memory available when it is taken, else disk, decided
at every capture. On disk the point is one file per process, ``<output_dir>/<output_name>-healthy/
healthy_point.pt`` (``healthy_point.rank<k>.pt`` for process k > 0), written by ``torch.save`` straight
from the live tensors (no copy in memory) through ``library.atomic_files`` (a temporary, fsynced, renamed:
a kill leaves the previous point or the new one, never a half-written one). A rewind reads it back
(``torch.load`` with ``mmap``), so it restores the very values the memory copy would: the same bytes
after the rewind (tests/test_full_fine_tuning.py).

The folder is never a resume state (it holds no manifest, its name does not end in ``-state``). A state
saved while the point is on disk holds it as a hard link of the file (no copy; a copy where the
filesystem has no hard links), so a resumed run rewinds exactly as the uninterrupted one, and the
folder is not needed once the process ends: ``RunStates.close`` removes this process's file (and the
folder once empty) at the end of every run; a run killed with SIGKILL leaves it, and the next run of
the same ``--output_dir``/``--output_name`` removes it before its first capture.
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import psutil
import torch

from library import atomic_files
from library.checkpoint_files import file_sha256

LOCATIONS = ("auto", "memory", "disk")

MEMORY_SHARE = 0.25
"""``auto`` keeps the point in memory when it is at most this share of the memory available at the
capture: the copy itself, plus the one a rewind makes while it restores, plus room for everything else
the run and the machine hold."""

FOLDER_SUFFIX = "-healthy"
STATE_FILE = "healthy_point.pt"
"""The point's name in a state folder (a hard link of the healthy folder's file)."""


def folder_path(output_dir: str | os.PathLike, output_name: str) -> Path:
    return Path(output_dir) / f"{output_name}{FOLDER_SUFFIX}"


def file_name(process_index: int) -> str:
    """This process's file in the healthy folder (every process keeps its own point: its RNGs differ)."""
    return STATE_FILE if process_index == 0 else f"healthy_point.rank{process_index}.pt"


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in a nested state (dicts, lists, tuples)."""
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(item) for item in value)
    return 0


def is_on_disk(point: Optional[dict[str, Any]]) -> bool:
    """Whether a healthy point (``RunStates.healthy_point``) is a file rather than tensors in memory."""
    return point is not None and "file" in point


@dataclass
class HealthyPointPlace:
    """Where this process keeps its healthy point: ``location`` (one of :data:`LOCATIONS`) and, for the
    disk, ``path`` (this process's file). ``before_rename(temporary)`` runs when a disk point is
    written and not yet renamed into place (``--debug_kill_in_healthy_point_write``)."""

    location: str = "memory"
    path: Optional[Path] = None
    before_rename: Optional[Callable[[Path], None]] = None
    label: str = "healthy point"  # what the lines call it
    announced: Optional[str] = None  # the location the last line named

    def __post_init__(self) -> None:
        if self.location not in LOCATIONS:
            raise ValueError(f"healthy point location {self.location!r}, expected one of {LOCATIONS}")
        if self.location != "memory" and self.path is None:
            raise ValueError("a healthy point that may go to disk needs its file's path")

    def on_disk(self, size: int) -> bool:
        """Whether a point of ``size`` bytes goes to disk now."""
        if self.location != "auto":
            return self.location == "disk"
        return size > MEMORY_SHARE * psutil.virtual_memory().available

    def write(self, step: int, position: list[int], payload: dict[str, Any]) -> dict[str, Any]:
        """Write ``payload`` (network, components, RNGs: the live objects' state, not copies) to this
        process's file, atomically; the point that names it."""
        started = time.perf_counter()
        with atomic_files.writing_file(self.path, tensor_bytes(payload)) as temporary:
            torch.save(payload, temporary)
            if self.before_rename is not None:
                self.before_rename(temporary)
        size = self.path.stat().st_size
        self._announce("disk", f"{self.label}: {size / 2**30:.2f} GiB written to {self.path} in "
                               f"{time.perf_counter() - started:.1f} s (--healthy_point_location {self.location})")
        # no checksum here: hashing while writing tripled the write's time; a state that links the file
        # computes it once (``checksum``)
        return {"step": step, "position": list(position), "file": str(self.path), "bytes": size}

    def kept_in_memory(self, size: int) -> None:
        """A point of ``size`` bytes went to memory (says so when an earlier one went to disk)."""
        if self.announced is not None:
            self._announce("memory", f"{self.label}: {size / 2**30:.2f} GiB kept in memory again "
                                     f"(--healthy_point_location {self.location})")

    def _announce(self, where: str, line: str) -> None:
        if self.announced != where:
            print(line, flush=True)
            self.announced = where

    def link(self, point: dict[str, Any]) -> dict[str, Any]:
        """Take the disk point ``point`` (a resumed state's file) as this process's file: a hard link
        (a copy without them), so that rotating that state away leaves the point whole."""
        atomic_files.link_file(Path(point["file"]), self.path)
        return {**point, "file": str(self.path)}

    def beside(self, name: str, label: str) -> "HealthyPointPlace":
        """The same location for another point of this process (the learning-rate finder's), in file ``name``."""
        return dataclasses.replace(self, path=self.path.with_name(name) if self.path else None, before_rename=None,
                                   label=label, announced=None)

    def clear(self, remove_folder: bool = False) -> None:
        """Remove this process's file and its temporaries (a killed write's); with ``remove_folder``, the
        folder too once no other process's file is in it (at the end: at the start another process may be
        creating it)."""
        if self.path is None or not self.path.parent.is_dir():
            return
        for entry in self.path.parent.iterdir():
            if entry.name == self.path.name or atomic_files.is_temporary(entry.name, self.path.name):
                entry.unlink(missing_ok=True)
        if remove_folder:
            try:
                self.path.parent.rmdir()
            except OSError:  # another process's file is still there
                pass


def checksum(point: dict[str, Any]) -> str:
    """The SHA-256 of a disk point's file (a state's manifest lists it), computed once per point."""
    if "sha256" not in point:
        point["sha256"] = file_sha256(point["file"])
    return point["sha256"]


def read(point: dict[str, Any]) -> dict[str, Any]:
    """The payload of a disk point (network, components, RNGs), mapped from its file: the caller copies
    what it keeps, so that no live tensor shares memory with the file."""
    return torch.load(point["file"], map_location="cpu", weights_only=False, mmap=True)
