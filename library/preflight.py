"""Checks of the files and folders the options name, made before any model is loaded.

A careless path should cost one line in the first seconds of a run, not a traceback after
the model load or after training: every output folder must be creatable and writable, and
every LoRA file the run reads must be a readable safetensors file of finite numbers. Nothing
here writes. (The model paths are checked by ``model_loading.check_model_paths``.)
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from library.checkpoint_files import is_safetensors, load_pickled_state_dict
from library.errors import UserError, first_line


def require_writable_folder(flag: str, folder: str | os.PathLike) -> None:
    """``folder`` exists as a writable folder, or can be created: its nearest existing ancestor
    is a writable folder. Raises ``UserError`` naming ``flag`` otherwise."""
    problem = _folder_problem(Path(folder))
    if problem:
        raise UserError(f"{flag} {folder}: {problem}; give a folder you can write to")


def require_writable_file(flag: str, path: str | os.PathLike) -> None:
    """``path`` can be written as a file: it is no folder, and it is writable or can be created."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {path}: is a folder; give a file path")
    problem = _folder_problem(path.absolute().parent)
    if path.exists() and not os.access(path, os.W_OK):
        problem = "the file is not writable"
    if problem:
        raise UserError(f"{flag} {path}: {problem}; give a file path you can write to")


def _folder_problem(folder: Path) -> str | None:
    """Why ``folder`` cannot be written to or created, or None."""
    if folder.exists():
        if not folder.is_dir():
            return f"{folder} exists and is not a folder"
        return None if os.access(folder, os.W_OK | os.X_OK) else f"{folder} is not writable"
    ancestor = folder.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{ancestor} is a file, so {folder} cannot be created"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"{ancestor} is not writable, so {folder} cannot be created"
    return None


def check_output_paths(args: argparse.Namespace) -> None:
    """Every place a run writes to can be written: ``--output_dir``, ``--logging_dir``,
    ``--grad_norm_log_dir``, ``--log_jsonl``, ``--console_log_file``."""
    for flag in ("output_dir", "logging_dir", "grad_norm_log_dir"):
        if getattr(args, flag, None):
            require_writable_folder(f"--{flag}", getattr(args, flag))
    for flag in ("log_jsonl", "console_log_file"):
        if getattr(args, flag, None):
            require_writable_file(f"--{flag}", getattr(args, flag))


def check_lora_file(flag: str, path: str | os.PathLike) -> None:
    """``path`` is a readable LoRA file (safetensors, or kohya's ``--save_model_as ckpt|pt`` torch file)
    whose floating-point tensors are all finite.

    Reads a safetensors file one tensor at a time, so the check costs the file's size in reading, not
    in memory. A LoRA holding NaN/Inf would make every training step NaN (or poison the base model as
    ``--base_weights``); a kohya-ss LoRA saved from a diverged run can hold them.
    """
    if not os.path.isfile(path):
        raise UserError(f"{flag} {path}: no such file; give a LoRA .safetensors (or .ckpt/.pt) file")
    try:
        for key, tensor in _lora_tensors(str(path)):
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise UserError(f"{flag} {path}: {key} holds NaN/Inf; the file comes from a diverged run, "
                                f"use an earlier save")
    except UserError:
        raise
    except Exception as error:  # safetensors and torch.load raise several types for damaged or foreign files
        kind = "safetensors file" if is_safetensors(str(path)) else "torch state dict"
        raise UserError(f"{flag} {path}: not a readable {kind} ({first_line(error)})") from None


def _lora_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    if not is_safetensors(path):
        yield from load_pickled_state_dict(Path(path)).items()
        return
    with safe_open(path, framework="pt", device="cpu") as file:
        for key in file.keys():
            yield key, file.get_tensor(key)


def check_input_files(args: argparse.Namespace) -> None:
    """The LoRA files the run reads (``--network_weights``, ``--base_weights``) and the
    ``--resume`` folder exist and are usable. The state itself is verified when it is loaded."""
    if args.network_weights:
        check_lora_file("--network_weights", args.network_weights)
    for path in args.base_weights or []:
        check_lora_file("--base_weights", path)
    if args.resume and args.resume != "auto" and not os.path.isdir(args.resume):
        raise UserError(f"--resume {args.resume}: no such state folder (give a *-state folder of this trainer, "
                        f"or auto)")
