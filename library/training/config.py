"""The training loop's own options, resolved once from the command line (``TrainingConfig``).

The loop reads these typed fields instead of the argparse namespace, so a second trainer hands it
a config rather than faking a namespace. The builders still read the namespace (see
docs/training_core.md, "What still reads the namespace").
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from library import train_state


@dataclass(frozen=True)
class SavePoints:
    """When the run writes its training states (kohya's ``--save_state`` family of options)."""

    save_state: bool  # a state at every file save point, and at the end
    save_state_on_train_end: bool
    every_n_steps: Optional[int]
    every_n_epochs: Optional[int]
    keep_last_n_steps: Optional[int]  # rotation: ``--save_last_n_steps_state`` (or the files' value)
    keep_last_n_epochs: Optional[int]

    def step_state_due(self, step: int) -> bool:
        return self.save_state and bool(self.every_n_steps) and step % self.every_n_steps == 0

    def epoch_state_due(self, epoch: int, num_epochs: int) -> bool:
        every = self.every_n_epochs
        return self.save_state and bool(every) and epoch % every == 0 and epoch != num_epochs


@dataclass(frozen=True)
class TrainingConfig:
    """What the loop, its events and the finish read. Resolved by ``from_args`` once every option is
    final: after presets, the random seed, ``--max_train_epochs`` (-> steps) and
    ``--save_n_epoch_ratio`` (-> every n epochs) were applied."""

    output_dir: str
    output_name: str
    seed: int
    max_train_steps: int
    gradient_accumulation_steps: int
    mixed_precision: str
    learning_rate: float  # the base rate a rewind's event reports scaled
    max_grad_norm: Optional[float]  # clip threshold (0/None: no clipping)
    saves: SavePoints
    debug_report_weights: bool = False  # the tests' multi-process agreement check

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TrainingConfig":
        keep_steps, keep_epochs = train_state.kept_states(args)
        return cls(
            output_dir=args.output_dir,
            output_name=args.output_name,
            seed=args.seed,
            max_train_steps=args.max_train_steps,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            mixed_precision=args.mixed_precision,
            learning_rate=args.learning_rate,
            max_grad_norm=args.max_grad_norm,
            saves=SavePoints(args.save_state, args.save_state_on_train_end, args.save_every_n_steps,
                             args.save_every_n_epochs, keep_steps, keep_epochs),
            debug_report_weights=bool(args.debug_report_weights),
        )
