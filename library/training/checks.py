"""The run's own checks, shared by every trainer: each module's ``validate_arguments`` and the paths,
before anything is loaded (a trainable checks its own options first, then calls this)."""
from __future__ import annotations

import argparse
import os

from library import (
    best_checkpoint, compatibility, ema, fault_injection, grad_guard, healing, inpainting, lora_files, lora_metadata,
    loss_scaling, losses, lr_finder, model_loading, noise, optimizers, preflight, sampling, tracking, train_state,
    torch_compile, validation,
)
from library.errors import UserError


def validate_run_arguments(args: argparse.Namespace, sdxl: bool) -> None:
    """Refuse bad values of the run's options, and paths that cannot be read or written (``sdxl``: the
    model the entry script trains)."""
    compatibility.check_arguments(args, sdxl)
    inpainting.validate_arguments(args)
    torch_compile.validate_arguments(args)
    tracking.validate_arguments(args)
    lora_files.validate_arguments(args)
    if os.path.dirname(args.output_name):
        # State rotation and --resume auto look for the run's files in --output_dir itself.
        folder, name = os.path.split(args.output_name)
        raise UserError(f"--output_name {args.output_name}: give a file name without folders; put the folder "
                        f"into --output_dir (e.g. --output_dir {os.path.join(args.output_dir, folder)} "
                        f"--output_name {name})")
    lora_metadata.validate_arguments(args)
    train_state.validate_arguments(args)
    optimizers.validate_args(args)
    ema.validate_arguments(args)
    loss_scaling.validate_arguments(args)
    losses.validate_arguments(args)
    sampling.validate_arguments(args)
    validation.validate_arguments(args)
    best_checkpoint.validate_arguments(args)
    lr_finder.validate_arguments(args)
    for flag in ("save_last_n_steps_state", "save_last_n_epochs_state"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            raise UserError(f"--{flag} {getattr(args, flag)} must be a positive integer")
    grad_guard.validate_arguments(args)
    healing.validate_arguments(args)
    noise.validate_arguments(args, noise.training_noise_scheduler(args.zero_terminal_snr).config.num_train_timesteps)
    fault_injection.parse_injections(args.debug_inject_grad)
    preflight.check_output_paths(args)
    if not args.debug_dataset:  # it shows the dataset and stops: no model, no LoRA read (as in kohya)
        preflight.check_input_files(args)
        model_loading.check_model_paths(args, sdxl=sdxl)

