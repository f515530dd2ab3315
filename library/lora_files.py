"""Where and when LoRA files are written during a run: kohya's names, save points, rotation."""
from __future__ import annotations

import argparse
import os
from typing import Mapping, Optional

import torch

from library.errors import UserError
from library.lora_metadata import addnet_hashes
from networks.lora import LoRANetwork, save_lora_file

SAVE_DTYPES = {None: None, "float": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output_dir", type=str, default=None, help="folder for LoRA files and logs (required)")
    parser.add_argument("--output_name", type=str, default=None,
                        help="base name of the LoRA files, without extension (default 'last')")
    parser.add_argument("--save_model_as", type=str, default="safetensors", choices=["safetensors", "ckpt", "pt"],
                        help="LoRA file format (default safetensors; the only one this trainer writes)")
    parser.add_argument("--save_precision", type=str, default=None, choices=[None, "float", "fp16", "bf16"],
                        help="dtype of saved weights (default: the training dtype: float32, or fp16/bf16 with "
                             "--full_fp16/--full_bf16)")
    parser.add_argument("--save_every_n_epochs", type=int, default=None, help="also save a LoRA every N epochs")
    parser.add_argument("--save_every_n_steps", type=int, default=None, help="also save a LoRA every N optimizer steps")
    parser.add_argument("--save_n_epoch_ratio", type=int, default=None,
                        help="save about N times over the run: sets --save_every_n_epochs to epochs // N (at least 1)")
    parser.add_argument("--save_last_n_epochs", type=int, default=None,
                        help="keep only the last N per-epoch LoRA files (older ones are removed)")
    parser.add_argument("--save_last_n_steps", type=int, default=None,
                        help="keep only per-step LoRA files of the last N steps (older ones are removed)")
    parser.add_argument("--no_metadata", action="store_true", help="write no ss_* training metadata into LoRA files")


def validate_arguments(args: argparse.Namespace) -> None:
    if not args.output_dir:
        raise UserError("--output_dir is required: the folder where LoRA files are written")
    if args.save_model_as != "safetensors":
        raise UserError(f"--save_model_as {args.save_model_as}: only safetensors is supported (it is what LoRA loaders read)")
    if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        raise UserError(f"--output_dir {args.output_dir} exists and is not a folder")
    for flag in ("save_every_n_epochs", "save_every_n_steps", "save_n_epoch_ratio", "save_last_n_epochs",
                 "save_last_n_steps"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise UserError(f"--{flag} {value} must be a positive integer")
    if args.output_name is None:
        args.output_name = "last"


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


class LoraWriter:
    """Writes the network at save points and removes files that fall out of the kept range."""

    def __init__(self, args: argparse.Namespace, metadata: Mapping[str, str]) -> None:
        self.args = args
        self.metadata = dict(metadata)
        self.save_dtype = SAVE_DTYPES[args.save_precision]

    def write(self, network: LoRANetwork, file_name: str, step: int, epoch: int) -> Optional[str]:
        """Save ``network`` as ``file_name`` in the output folder; None when refused (NaN/Inf)."""
        path = os.path.join(self.args.output_dir, file_name)
        state = network.lora_state_dict(self.save_dtype)
        metadata = dict(self.metadata)
        metadata.update({"ss_steps": str(step), "ss_epoch": str(epoch)})
        if not self.args.no_metadata:
            metadata.update(addnet_hashes(state, metadata))
        else:
            metadata = {key: value for key, value in metadata.items() if key.startswith("modelspec.")}
        try:
            save_lora_file(state, path, metadata)
        except FloatingPointError as error:
            print(f"\n{error}; the previous files are kept", flush=True)
            return None
        print(f"\nsaved {path}", flush=True)
        return path

    def on_step(self, network: LoRANetwork, step: int, epoch: int) -> None:
        every = self.args.save_every_n_steps
        if every and step % every == 0:
            self.write(network, step_file_name(self.args.output_name, step), step, epoch)
            keep = self.args.save_last_n_steps
            if keep:
                # kohya keeps files of the last N steps: remove the save point N steps back.
                old_step = step - (keep // every + 1) * every
                if old_step > 0:
                    self._remove(step_file_name(self.args.output_name, old_step))

    def on_epoch_end(self, network: LoRANetwork, step: int, epoch: int, is_last_epoch: bool) -> None:
        every = self.args.save_every_n_epochs
        if every and epoch % every == 0 and not is_last_epoch:
            self.write(network, epoch_file_name(self.args.output_name, epoch), step, epoch)
            keep = self.args.save_last_n_epochs
            if keep:
                old_epoch = epoch - every * keep
                if old_epoch > 0:
                    self._remove(epoch_file_name(self.args.output_name, old_epoch))

    def _remove(self, file_name: str) -> None:
        path = os.path.join(self.args.output_dir, file_name)
        if os.path.exists(path):
            os.remove(path)
            print(f"removed old {path}", flush=True)
