"""The command line every trainer built on the core shares, and the LoRA trainer's parser."""
from __future__ import annotations

import argparse
from typing import Any, Optional

from library import (
    best_checkpoint, compatibility, config_file, debiased_loss, ema, fault_injection, fp8_base, grad_guard, healing,
    inpainting, lora_files, lora_metadata, loss_scaling, losses, lr_finder, model_loading, noise, optimizers, sampling,
    torch_compile, tracking, train_state, validation,
)
from library.datasets import dataset as datasets
from library.errors import ArgumentParser
from library.trainables import lora


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the run itself (steps, precision, logging) shared by every trainer."""
    parser.add_argument("--max_train_steps", type=int, default=1600, help="optimizer steps to train (default 1600)")
    parser.add_argument("--max_train_epochs", type=int, default=None,
                        help="epochs to train; overrides --max_train_steps when given")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: a random one, printed)")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1,
                        help="micro-batches per optimizer step (default 1)")
    parser.add_argument("--gradient_checkpointing", action="store_true",
                        help="recompute activations in backward to save memory")
    parser.add_argument("--mixed_precision", type=str, default="no", choices=["no", "fp16", "bf16"],
                        help="autocast dtype (default no); fp16 adds the loss scaler chosen with --loss_scaler")
    parser.add_argument("--full_fp16", action="store_true",
                        help="keep the LoRA weights, gradients and optimizer state in fp16 too (needs --mixed_precision "
                             "fp16; less memory, less precise updates). Default: float32 LoRA weights")
    parser.add_argument("--full_bf16", action="store_true",
                        help="keep the LoRA weights, gradients and optimizer state in bf16 too (needs --mixed_precision "
                             "bf16). Default: float32 LoRA weights")
    parser.add_argument("--no_half_vae", action="store_true", help="keep the VAE in float32 under mixed precision")
    parser.add_argument("--clip_skip", type=int, default=None,
                        help="use the output of the N-th last text encoder layer (SD1.x/2.x; default: the last)")
    parser.add_argument("--training_comment", type=str, default=None, help="comment stored in the LoRA metadata")


def setup_parser(description: str, trainable: Optional[Any] = None) -> argparse.ArgumentParser:
    """The LoRA trainer's command line (kohya's ``train_network.py`` options, in its groups' order);
    with ``trainable`` its options replace the LoRA's, and one that writes whole models
    (``trainable.writes_models``: a full fine-tune) brings its own file format options
    (``--save_model_as``, ``--save_precision``) and kohya's full-fine-tune compatibility options."""
    writes_models = trainable is not None and trainable.writes_models
    parser = ArgumentParser(description=description)
    config_file.add_arguments(parser)
    model_loading.add_arguments(parser)
    datasets.add_arguments(parser)
    inpainting.add_arguments(parser)
    validation.add_arguments(parser)
    best_checkpoint.add_arguments(parser)
    lr_finder.add_arguments(parser)
    lora_files.add_arguments(parser, formats=not writes_models)
    lora_metadata.add_arguments(parser)
    add_training_arguments(parser)
    fp8_base.add_arguments(parser)
    tracking.add_arguments(parser)
    if trainable is None:
        lora.add_network_arguments(parser)
    else:
        trainable.add_arguments(parser)
    noise.add_arguments(parser)
    losses.add_arguments(parser)
    debiased_loss.add_arguments(parser)
    optimizers.add_arguments(parser)
    ema.add_arguments(parser)
    grad_guard.add_arguments(parser)
    healing.add_arguments(parser)
    loss_scaling.add_arguments(parser)
    train_state.add_arguments(parser)
    fault_injection.add_arguments(parser)
    sampling.add_arguments(parser)
    compatibility.add_arguments(parser, lora=not writes_models)
    torch_compile.add_arguments(parser)
    return parser
