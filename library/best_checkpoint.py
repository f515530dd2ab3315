"""The best checkpoint by validation loss, the trend of each validation, and early stopping.

With a validation set (``--validation_split``), every validation pass is compared with the best
value so far (docs/know_your_lora.md):

* **improving**: the loss is below the best by more than ``--best_checkpoint_margin`` (relative,
  default 0.001 = 0.1%). The LoRA as validated is written to ``<output_name>-best.safetensors``
  (atomically, through the run's ``LoraWriter``: same dtype and metadata as every LoRA file, plus
  ``ss_best_step`` and ``ss_best_validation_loss``).
* **plateau**: within the margin of the best (either side).
* **getting worse**: above the best by more than the margin.

A validation pass sees exactly the same inputs every time (``library/validation.py``), so the
differences are the weights', not the noise's; the margin only keeps rounding-level changes from
counting as progress.

``--early_stop_patience N`` (off by default) ends the run after N validations in a row without
improvement; the final ``<output_name>.safetensors`` then holds the best weights (a byte copy of
the best file). The best value, its step and the count without improvement are part of the training state
(``--save_state``), so a resumed run goes on exactly as the uninterrupted one (a rewind of the
self-healing leaves them as they are: the best file stays the best seen).
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from tqdm import tqdm

from library import atomic_files
from library.errors import UserError

IMPROVING, PLATEAU, WORSE = "improving", "plateau", "getting worse"
BEST_SUFFIX = "-best"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--best_checkpoint_margin", type=float, default=0.001,
                        help="with validation: a validation loss counts as an improvement (and is kept as "
                             "<output_name>-best.safetensors) when it is below the best so far by more than this "
                             "fraction of it; within it either way is a plateau (default 0.001)")
    parser.add_argument("--early_stop_patience", type=int, default=None,
                        help="with validation: stop after N validations in a row without improvement; the final "
                             "file then holds the best weights (default: off)")


def validate_arguments(args: argparse.Namespace) -> None:
    if not 0.0 <= args.best_checkpoint_margin < 1.0:
        raise UserError(f"--best_checkpoint_margin {args.best_checkpoint_margin} must be at least 0 and below 1 "
                        f"(a fraction of the best validation loss)")
    if args.early_stop_patience is not None and args.early_stop_patience <= 0:
        raise UserError(f"--early_stop_patience {args.early_stop_patience} must be a positive integer "
                        f"(leave it out to train all steps)")


def best_file_name(output_name: str) -> str:
    """``<output_name>-best.safetensors`` (the writer gives it the ``--save_model_as`` extension; a full model's
    writer its model format's, none for a diffusers folder)."""
    return f"{output_name}{BEST_SUFFIX}.safetensors"


def trend(value: float, best: float, margin: float) -> str:
    """improving / plateau / getting worse of ``value`` against the ``best`` so far (inf: none yet)."""
    if not math.isfinite(value):
        return WORSE
    if not math.isfinite(best) or value < best * (1.0 - margin):
        return IMPROVING
    if value > best * (1.0 + margin):
        return WORSE
    return PLATEAU


@dataclass
class Validated:
    """What one validation pass concluded."""

    trend: str
    best_step: Optional[int]
    best_value: float
    since_best: int  # validations in a row without improvement
    stop: bool  # --early_stop_patience reached


class BestCheckpoint:
    """Follows the validation losses of a run; writes the best file on the main process."""

    STATE_OPTIONAL = True  # a state saved before it existed resumes with no best value yet

    def __init__(self, args: argparse.Namespace, path: str, is_main_process: bool) -> None:
        """``path``: where the best file is written (``LoraWriter.path_of(best_file_name(...))``)."""
        self.args = args
        self.path = path
        self.margin = args.best_checkpoint_margin
        self.patience = args.early_stop_patience
        self.is_main_process = is_main_process
        self.best_value = math.inf
        self.best_step: Optional[int] = None
        self.since_best = 0
        self.stopped_at: Optional[int] = None
        self.history: list[tuple[int, float, str]] = []

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to go on as the uninterrupted one (the training state keeps it)."""
        return {"best_value": self.best_value, "best_step": self.best_step, "since_best": self.since_best}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_value, self.best_step, self.since_best = state["best_value"], state["best_step"], state["since_best"]

    def observe(self, step: int, value: float, write_best: Callable[[dict[str, str]], Optional[str]]) -> Validated:
        """One validation's ``value`` at ``step``; ``write_best(extra_metadata)`` writes the best file
        (called on the main process when the value improves). Prints the trend line."""
        if self.history and self.history[-1][0] == step:  # the epoch's pass after the step's: the same weights
            _, _, verdict = self.history[-1]
            return Validated(verdict, self.best_step, self.best_value, self.since_best, self.stopped_at is not None)
        verdict = trend(value, self.best_value, self.margin)
        if verdict == IMPROVING:
            self.best_value, self.best_step, self.since_best = value, step, 0
            if self.is_main_process:
                write_best({"ss_best_step": str(step), "ss_best_validation_loss": repr(value)})
        else:
            self.since_best += 1
        stop = self.patience is not None and self.since_best >= self.patience
        if stop:
            self.stopped_at = step
        self.history.append((step, value, verdict))
        if self.is_main_process:
            line = f"validation at step {step}: {verdict} (best {self.best_value:.6f} at step {self.best_step}"
            line += f", {self.since_best} validation(s) without improvement)" if self.since_best else ")"
            if stop:
                line += f"; --early_stop_patience {self.patience} reached: stopping, the final file holds the best weights"
            tqdm.write(line)
        return Validated(verdict, self.best_step, self.best_value, self.since_best, stop)

    def scalars(self, kind: str) -> dict[str, float]:
        """Tracker scalars of the latest validation: the best value and the trend as -1/0/1."""
        code = {IMPROVING: -1.0, PLATEAU: 0.0, WORSE: 1.0}[self.history[-1][2]]
        return {f"loss/validation/{kind}_best": self.best_value, f"loss/validation/{kind}_trend": code}

    def final_from_best(self, final_path: str) -> Optional[str]:
        """After an early stop: the final file becomes a byte copy of the best file (atomically; a full
        model's diffusers folder: of the best folder)."""
        if self.stopped_at is None or not self.is_main_process or not os.path.exists(self.path):
            return None
        if os.path.isdir(self.path):
            size = sum(entry.stat().st_size for entry in Path(self.path).rglob("*") if entry.is_file())
            with atomic_files.writing_folder(final_path, size) as temporary:
                shutil.copytree(self.path, temporary, dirs_exist_ok=True)
        else:  # streamed: a full model's checkpoint need not fit in memory twice
            with atomic_files.writing_file(final_path, os.path.getsize(self.path)) as temporary:
                shutil.copyfile(self.path, temporary)
        print(f"early stop: {final_path} holds the best weights (step {self.best_step}, validation loss "
              f"{self.best_value:.6f})", flush=True)
        return final_path


def create(args: argparse.Namespace, has_validation: bool, path: str, is_main_process: bool) -> Optional[BestCheckpoint]:
    """The run's tracker, None without a validation set (saying so when --early_stop_patience was given)."""
    if not has_validation:
        if args.early_stop_patience is not None:
            print("--early_stop_patience: no validation set (set --validation_split): no early stop")
        return None
    return BestCheckpoint(args, path, is_main_process)


def stopped(best: Optional[BestCheckpoint]) -> bool:
    """Whether ``--early_stop_patience`` ended the run (False without a tracker)."""
    return best is not None and best.stopped_at is not None


def observe(best: Optional[BestCheckpoint], kind: str, step: int, scalars: dict[str, float],
            write_best: Callable[[dict[str, str]], Optional[str]]) -> dict[str, float]:
    """The trend of the validation ``scalars`` of ``kind`` ("step"/"epoch") at ``step``: prints it, keeps
    the best file, returns the extra scalars ({} without a tracker)."""
    if best is None:
        return {}
    best.observe(step, scalars[f"loss/validation/{kind}_average"], write_best)
    return best.scalars(kind)
