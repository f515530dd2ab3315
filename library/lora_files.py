"""Where and when LoRA files are written during a run: kohya's names, save points, rotation."""
from __future__ import annotations

import argparse
import os
import shutil
from typing import Callable, Mapping, Optional

import torch

from library import atomic_files
from library.checkpoint_files import SAVE_DTYPES, add_save_precision_argument
from library.ema import LoraEma, raw_file_name
from library.errors import UserError
from library.lora_metadata import addnet_hashes
from networks.lora import LoRANetwork, save_lora_file
from networks.network_base import find_non_finite



def add_arguments(parser: argparse.ArgumentParser, formats: bool = True) -> None:
    """The output options; ``formats``: with the LoRA file format ones (a full-model trainer has its own)."""
    parser.add_argument("--output_dir", type=str, default=None, help="folder for LoRA files and logs (required)")
    parser.add_argument("--output_name", type=str, default=None,
                        help="base name of the LoRA files, without extension (default 'last')")
    if formats:
        parser.add_argument("--save_model_as", type=str, default="safetensors", choices=["safetensors", "ckpt", "pt"],
                            help="LoRA file format: safetensors (default; with kohya's metadata), or ckpt/pt: a "
                                 "torch.save state dict without metadata, as kohya writes them")
        add_save_precision_argument(parser, "LoRA weights")
    parser.add_argument("--save_every_n_epochs", type=int, default=None, help="also save a LoRA every N epochs")
    parser.add_argument("--save_every_n_steps", type=int, default=None, help="also save a LoRA every N optimizer steps")
    parser.add_argument("--save_n_epoch_ratio", type=int, default=None,
                        help="save about N times over the run: sets --save_every_n_epochs to epochs // N (at least 1)")
    parser.add_argument("--save_last_n_epochs", type=int, default=None,
                        help="keep only the last N per-epoch LoRA files: after saving epoch E, the one of epoch "
                             "E - N * --save_every_n_epochs is removed (kohya's rule; default: keep all)")
    parser.add_argument("--save_last_n_steps", type=int, default=None,
                        help="keep only per-step LoRA files of the last N steps (N counts steps, not saves): after "
                             "saving step S, the one of step S - N - 1 rounded down to a multiple of "
                             "--save_every_n_steps is removed (kohya's rule; default: keep all)")
    parser.add_argument("--no_metadata", action="store_true", help="write no ss_* training metadata into LoRA files")


def validate_arguments(args: argparse.Namespace) -> None:
    if not args.output_dir:
        raise UserError("--output_dir is required: the folder where LoRA files are written")
    if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        raise UserError(f"--output_dir {args.output_dir} exists and is not a folder")
    for flag in ("save_every_n_epochs", "save_every_n_steps", "save_n_epoch_ratio", "save_last_n_epochs",
                 "save_last_n_steps"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise UserError(f"--{flag} {value} must be a positive integer")
    if args.output_name is None:
        args.output_name = "last"
    if not args.output_name.strip():
        raise UserError(f"--output_name {args.output_name!r}: give a file name without extension, e.g. --output_name "
                        f"my_lora (an empty name writes the hidden file .safetensors; leave the option out for "
                        f"kohya's default 'last')")


def apply_epoch_ratio(args: argparse.Namespace, num_epochs: int) -> None:
    """``--save_n_epoch_ratio N``: every ``num_epochs // N`` epochs (at least 1), as kohya computes it.
    It replaces ``--save_every_n_epochs`` for LoRA files and states alike."""
    if args.save_n_epoch_ratio:
        args.save_every_n_epochs = max(num_epochs // args.save_n_epoch_ratio, 1)


def epoch_stem(output_name: str, epoch: int) -> str:
    """kohya's name of an epoch save point; LoRA files and state folders add their suffix."""
    return f"{output_name}-{epoch:06d}"


def step_stem(output_name: str, step: int) -> str:
    """kohya's name of a step save point; LoRA files and state folders add their suffix."""
    return f"{output_name}-step{step:08d}"


def epoch_file_name(output_name: str, epoch: int) -> str:
    return epoch_stem(output_name, epoch) + ".safetensors"


def step_file_name(output_name: str, step: int) -> str:
    return step_stem(output_name, step) + ".safetensors"


def final_file_name(output_name: str) -> str:
    return f"{output_name}.safetensors"


ABANDONED_SUFFIX = "-abandoned"
"""Added to the name of a file written in a span that a rewind abandoned (``LoraWriter.mark_abandoned``)."""


def abandoned_file_name(path: str) -> str:
    """``last-step00000012.safetensors`` -> ``last-step00000012-abandoned.safetensors``."""
    stem, extension = os.path.splitext(path)
    return f"{stem}{ABANDONED_SUFFIX}{extension}"


def rename_abandoned(written: list[tuple[int, str]], after_step: int) -> tuple[list[tuple[int, str]], list[str]]:
    """Rename each (step, path) of ``written`` saved after ``after_step`` to ``abandoned_file_name``
    (replacing an older one of that name, file or folder); (what is still written under its name, the
    new paths)."""
    renamed, kept = [], []
    for step, path in written:
        if step > after_step and os.path.exists(path):
            target = abandoned_file_name(path)
            if os.path.isdir(target):  # a full model saved as a diffusers folder
                shutil.rmtree(target)
            atomic_files.rename_file(path, target)
            renamed.append(target)
        else:
            kept.append((step, path))
    return kept, renamed


def last_healthy_file_name(output_name: str) -> str:
    """The file a failed run writes its last healthy weights to (the final name stays free)."""
    return f"{output_name}-last_healthy.safetensors"


# -- rotation: kohya's formulas (train_util.get_remove_step_no / get_remove_epoch_no), for files and states
def output_path(args: argparse.Namespace, file_name: str) -> str:
    """Where a LoRA file ``file_name`` is written: in ``--output_dir``, with the ``--save_model_as`` extension."""
    return os.path.join(args.output_dir, f"{os.path.splitext(file_name)[0]}.{args.save_model_as}")


def step_to_remove(step: int, every: int, keep: Optional[int]) -> Optional[int]:
    """The save point that falls out of "the last ``keep`` steps" once step ``step`` is saved
    (saves every ``every`` steps), or None. kohya removes exactly this one, not every older one:
    ``step - keep - 1`` rounded down to a multiple of ``every`` (every 2, keep 2: step 8 removes 4,
    steps 6 and 8 stay)."""
    if not keep:
        return None
    old_step = step - keep - 1
    old_step -= old_step % every
    return old_step if old_step > 0 else None


def epoch_to_remove(epoch: int, every: int, keep: Optional[int]) -> Optional[int]:
    """The epoch save point removed once epoch ``epoch`` is saved (saves every ``every`` epochs),
    or None. Unlike steps, kohya counts saves here: ``epoch - every * keep``."""
    if not keep:
        return None
    old_epoch = epoch - every * keep
    return old_epoch if old_epoch > 0 else None


def save_refusal(state: Mapping[str, torch.Tensor], save_dtype: Optional[torch.dtype]) -> Optional[str]:
    """Why the LoRA ``state`` (in its training dtype) must not be saved, or None when it may.

    Non-finite weights mean the run diverged; finite weights beyond the range of ``save_dtype``
    (fp16 ends at 65504) would reach the file as Inf. LoRA files and training states both obey
    this, so a diverged run never replaces, rotates away or points ``--resume auto`` past a good one.
    """
    bad_module = find_non_finite(state)
    if bad_module is not None:
        return f"LoRA module {bad_module} holds NaN/Inf (the training diverged)"
    if save_dtype is None:
        return None
    for key, value in state.items():
        if key.endswith(".alpha"):  # kept in float32 when out of range (see cast_for_saving)
            continue
        if value.is_floating_point() and not torch.isfinite(value.to(save_dtype)).all():
            precision = next(name for name, dtype in SAVE_DTYPES.items() if dtype == save_dtype)
            return (f"LoRA module {key.partition('.')[0]} holds values beyond the range of --save_precision "
                    f"{precision} (they would be saved as Inf; the training diverged)")
    return None


def cast_for_saving(state: Mapping[str, torch.Tensor], save_dtype: Optional[torch.dtype]) -> dict[str, torch.Tensor]:
    """``state`` in ``save_dtype``, except an ``alpha`` that the dtype cannot hold, which stays float32.

    A full-rank LoKr's alpha is its --network_dim (the GUI's LoKr presets use 100000, beyond fp16's
    65504); kohya would write Inf, and Inf/rank breaks readers that use it. It is a constant, not a
    trained weight, so it keeps its value instead of the file being refused.
    """
    if save_dtype is None:
        return dict(state)
    cast = {}
    for key, value in state.items():
        converted = value.to(save_dtype)
        keep = key.endswith(".alpha") and value.is_floating_point() and not torch.isfinite(converted).all()
        cast[key] = value.float() if keep else converted
    return cast


class LoraWriter:
    """Writes the network at save points and removes files that fall out of the kept range.

    With an ``ema`` the network is written while it holds the average (``ema.weights_for_use``), its
    metadata says so, and ``--ema_save_raw`` writes the training weights beside every file
    (``ema.raw_file_name``), removed with it.

    ``trained`` says whether the weights are trained (set by the trainer: a fresh run's LoRA is not until
    an optimizer step trains it); untrained weights are never written, so a run whose steps were all
    skipped replaces no earlier file with the initial LoRA. ``written``: (step, path) of every file this
    run wrote and still has under that name.
    """

    def __init__(self, args: argparse.Namespace, metadata: Mapping[str, str], ema: Optional[LoraEma] = None,
                 current_metadata: Callable[[], Mapping[str, str]] = dict, modelspec_only: bool = False) -> None:
        """``metadata``: the run's; ``current_metadata()``: what changes during the run (rewinds, quarantined
        samples), asked at every write; ``modelspec_only``: the files carry only the ``modelspec.*`` keys
        (kohya's embedding files), as with ``--no_metadata``."""
        self.modelspec_only = modelspec_only
        self.args = args
        self.metadata = dict(metadata)
        self.current_metadata = current_metadata
        self.save_dtype = SAVE_DTYPES[args.save_precision]
        self.ema = ema
        self.trained = True
        self.written: list[tuple[int, str]] = []

    def write(self, network: LoRANetwork, file_name: str, step: int, epoch: int,
              extra_metadata: Optional[Mapping[str, str]] = None) -> Optional[str]:
        """Save ``network`` as ``file_name`` (its extension: ``--save_model_as``) in the output folder (and its
        raw weights beside it with ``--ema_save_raw``); None when refused (see ``save_refusal``), in which case
        nothing is written. ``extra_metadata``: this file's own entries (e.g. the best checkpoint's)."""
        extra_metadata = extra_metadata or {}
        if not self.trained:
            print(f"\nnot saving {self._path(file_name)}: it would hold the initial, untrained LoRA (no optimizer "
                  f"step of this run has trained it yet); no file written or removed", flush=True)
            return None
        if self.ema is None:
            return self._write(network, file_name, step, epoch, extra_metadata)
        if self.ema.updates == 0:  # it holds the untrained weights: writing it would replace a good file with them
            print(f"\nnot saving {self._path(file_name)}: the EMA has not updated yet (its first update is after "
                  f"{self.ema.config.update_every} trained steps, --ema_update_every); no file written or removed",
                  flush=True)
            return None
        path = self._write(network, file_name, step, epoch, {**self.ema.config.file_metadata("ema"), **extra_metadata})
        if path is not None and self.ema.config.save_raw:
            with self.ema.training_weights():
                self._write(network, raw_file_name(file_name), step, epoch, self.ema.config.file_metadata("raw"))
        return path

    def _write(self, network: LoRANetwork, file_name: str, step: int, epoch: int,
               weights_metadata: Mapping[str, str]) -> Optional[str]:
        path = self._path(file_name)
        trained = network.lora_state_dict()
        state = cast_for_saving(trained, self.save_dtype)
        if find_non_finite(state) is not None:  # say why from the weights as trained: diverged, or overflowed
            refusal = save_refusal(trained, self.save_dtype)
            print(f"\nnot saving {path}: {refusal}; no file written or removed", flush=True)
            return None
        metadata = {**self.metadata, **self.current_metadata()}
        metadata.update({"ss_steps": str(step), "ss_epoch": str(epoch), **weights_metadata})
        if not (self.args.no_metadata or self.modelspec_only):
            metadata.update(addnet_hashes(state, metadata))
        else:
            metadata = {key: value for key, value in metadata.items() if key.startswith("modelspec.")}
        save_lora_file(state, path, metadata)
        self.written.append((step, path))
        print(f"\nsaved {path}", flush=True)
        return path

    def mark_abandoned(self, after_step: int) -> list[str]:
        """Rename the files this run wrote after ``after_step`` (a rewind went back to it: they hold weights
        of the diverged span) to ``abandoned_file_name``, replacing an older file of that name; the new
        paths. The final name of each is free again, for the run's later save at that step."""
        self.written, renamed = rename_abandoned(self.written, after_step)
        return renamed

    def on_step(self, network: LoRANetwork, step: int, epoch: int) -> None:
        every = self.args.save_every_n_steps
        if every and step % every == 0:
            # the old file goes only once the new one is on disk (never for a refused save)
            if self.write(network, step_file_name(self.args.output_name, step), step, epoch):
                old_step = step_to_remove(step, every, self.args.save_last_n_steps)
                if old_step is not None:
                    self._remove(step_file_name(self.args.output_name, old_step))

    def on_epoch_end(self, network: LoRANetwork, step: int, epoch: int, is_last_epoch: bool) -> None:
        every = self.args.save_every_n_epochs
        if every and epoch % every == 0 and not is_last_epoch:
            if self.write(network, epoch_file_name(self.args.output_name, epoch), step, epoch):
                old_epoch = epoch_to_remove(epoch, every, self.args.save_last_n_epochs)
                if old_epoch is not None:
                    self._remove(epoch_file_name(self.args.output_name, old_epoch))

    def _path(self, file_name: str) -> str:
        return output_path(self.args, file_name)

    def _remove(self, file_name: str) -> None:
        for name in (file_name, raw_file_name(file_name)) if self.ema is not None else (file_name,):
            path = self._path(name)
            self.written = [(step, written) for step, written in self.written if written != path]
            if os.path.exists(path):
                os.remove(path)
                print(f"removed old {path}", flush=True)
