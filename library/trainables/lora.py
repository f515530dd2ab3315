"""The LoRA trainable: a LoRA / LyCORIS network (``--network_module``) on the UNet and text encoders.

What trains is the network's up/down (and type-specific) weights; parameter groups follow kohya's
``--unet_lr`` / ``--text_encoder_lr`` / LoRA+ ratios; files are kohya's LoRA files with kohya's
metadata (``library.lora_files``, ``library.lora_metadata``); a state and a healthy point hold the
network's tensors (small: the healthy point stays in memory).
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from accelerate import Accelerator

from library import ema, fp8_base, lora_effect, lora_files, lora_metadata, optimizers, train_state
from library.errors import UserError
from library.model_loading import StableDiffusionModels
from library.trainables.base import Trainable
from library.training import checks
from networks import network_base, registry

NOTHING_TO_TRAIN = ("--learning_rate/--unet_lr/--text_encoder_lr: every trained part has learning rate 0, nothing "
                    "would train (--learning_rate 0 needs --unet_lr or --text_encoder_lr for the parts to train)")


def add_network_arguments(parser: argparse.ArgumentParser) -> None:
    """LoRA network options (kohya's train_network.py names)."""
    parser.add_argument("--network_module", type=str, default="networks.lora",
                        help="network type (kohya's names, see docs/network_types.md): "
                             f"{', '.join(registry.NETWORK_MODULES)} (default networks.lora)")
    parser.add_argument("--network_dim", type=int, default=None, help="LoRA rank (default 4)")
    parser.add_argument("--network_alpha", type=float, default=1.0,
                        help="LoRA alpha; the output is scaled by alpha/dim (default 1)")
    parser.add_argument("--network_dropout", type=float, default=None,
                        help="dropout probability on the LoRA down output (default off)")
    parser.add_argument("--network_args", type=str, default=None, nargs="*",
                        help="key=value options of the network type, e.g. for networks.lora: conv_dim, conv_alpha, "
                             "rank_dropout, module_dropout, and LoRA+: loraplus_lr_ratio, loraplus_unet_lr_ratio, "
                             "loraplus_text_encoder_lr_ratio (see docs/network_types.md)")
    parser.add_argument("--network_weights", type=str, default=None, help="LoRA file to continue training from")
    parser.add_argument("--base_weights", type=str, default=None, nargs="*",
                        help="LoRA files merged into the base model before training (the new LoRA learns on top)")
    parser.add_argument("--base_weights_multiplier", type=float, default=None, nargs="*",
                        help="strength of each --base_weights file, in order (default 1.0)")
    parser.add_argument("--dim_from_weights", action="store_true",
                        help="take ranks and alphas from --network_weights instead of --network_dim")
    parser.add_argument("--scale_weight_norms", type=float, default=None,
                        help="after each optimizer step, scale down every LoRA module whose weight change "
                             "(up @ down * alpha/dim) has a Frobenius norm above this (kohya's max-norm "
                             "regularisation; 1 is a common value). Default: off (also 0)")
    parser.add_argument("--network_train_unet_only", action="store_true", help="train only the UNet LoRA")
    parser.add_argument("--network_train_text_encoder_only", action="store_true",
                        help="train only the text encoder LoRA")
    parser.add_argument("--unet_lr", type=float, default=None, help="UNet LoRA learning rate (default --learning_rate; 0: the UNet LoRA is not trained)")
    parser.add_argument("--text_encoder_lr", type=float, default=None, nargs="*",
                        help="text encoder LoRA learning rate, one value or one per encoder (default --learning_rate; "
                             "0: that encoder's LoRA is not trained)")


def validate_arguments(args: argparse.Namespace, sdxl: bool = False) -> None:
    """Refuse bad values, and paths that cannot be read or written, before anything is loaded or
    written; ``sdxl``: the model the entry script trains. (The LoRA trainer's whole check, in the
    order its messages have always come; the run's own checks are not yet split out of it.)"""
    positive = {
        "max_train_steps": args.max_train_steps,
        "max_train_epochs": args.max_train_epochs,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "network_dim": args.network_dim,
        "train_batch_size": args.train_batch_size,
    }
    for flag, value in positive.items():
        if value is not None and value <= 0:
            raise UserError(f"--{flag} {value} must be a positive integer")
    if args.network_alpha is not None and not (math.isfinite(args.network_alpha) and args.network_alpha >= 0):
        raise UserError(f"--network_alpha {args.network_alpha} must be a number >= 0 (the LoRA output is scaled by "
                        f"alpha/dim; 0 means alpha = dim, as in kohya)")
    if args.learning_rate is not None and not args.learning_rate >= 0:
        raise UserError(f"--learning_rate {args.learning_rate} must be a number >= 0 (0: only the parts given "
                        f"--unet_lr/--text_encoder_lr train, as in kohya)")
    # kohya: a part whose learning rate is 0 is not trained
    if args.unet_lr is not None and not args.unet_lr >= 0:
        raise UserError(f"--unet_lr {args.unet_lr} must be a positive number (0: do not train the UNet)")
    if args.text_encoder_lr is not None and any(not lr >= 0 for lr in args.text_encoder_lr):
        raise UserError(f"--text_encoder_lr {args.text_encoder_lr}: learning rates must be positive numbers "
                        f"(0: do not train that text encoder)")
    for flag, precision in (("full_fp16", "fp16"), ("full_bf16", "bf16")):
        if getattr(args, flag) and args.mixed_precision != precision:
            raise UserError(f"--{flag} needs --mixed_precision {precision} (got {args.mixed_precision})")
    fp8_base.validate_arguments(args)
    if args.network_train_unet_only and args.network_train_text_encoder_only:
        raise UserError("--network_train_unet_only and --network_train_text_encoder_only exclude each other")
    registry.validate(args.network_module, network_base.parse_network_args(args.network_args),
                      fp8_base.float8_flag(args))
    unet_lr, text_encoder_lrs = optimizers.part_learning_rates(args)
    if (args.network_train_text_encoder_only or unet_lr == 0) and (
            args.network_train_unet_only or all(lr == 0 for lr in text_encoder_lrs)):
        raise UserError(NOTHING_TO_TRAIN)
    if len(args.base_weights_multiplier or []) > len(args.base_weights or []):
        raise UserError(f"--base_weights_multiplier has {len(args.base_weights_multiplier)} values for "
                        f"{len(args.base_weights or [])} --base_weights files: give at most one per file")
    if args.dim_from_weights and not args.network_weights:
        raise UserError("--dim_from_weights needs --network_weights FILE")
    if args.scale_weight_norms is not None and not args.scale_weight_norms >= 0:
        raise UserError(f"--scale_weight_norms {args.scale_weight_norms} must be a positive number (0 = off)")
    if args.network_dropout is not None and not 0 <= args.network_dropout < 1:
        raise UserError(f"--network_dropout {args.network_dropout} must be in [0, 1)")
    checks.validate_run_arguments(args, sdxl)

@dataclass(frozen=True)
class LoraConfig:
    """The LoRA trainable's options, resolved once (``from_args``) after they were checked."""

    network_module: str
    network_dim: Optional[int]
    network_alpha: float
    network_dropout: Optional[float]
    network_args: dict[str, str]  # --network_args parsed (key=value)
    network_weights: Optional[str]  # continue from this LoRA file
    dim_from_weights: bool
    scale_weight_norms: Optional[float]  # max-norm regularisation (None/0: off)
    train_unet: bool
    train_text_encoder: bool
    learning_rate: float
    unet_lr: Optional[float]
    text_encoder_lr: Optional[list[float]]
    full_precision: bool  # --full_fp16/--full_bf16: the LoRA itself in the autocast dtype

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "LoraConfig":
        return cls(
            network_module=args.network_module, network_dim=args.network_dim, network_alpha=args.network_alpha,
            network_dropout=args.network_dropout, network_args=network_base.parse_network_args(args.network_args),
            network_weights=args.network_weights, dim_from_weights=args.dim_from_weights,
            scale_weight_norms=args.scale_weight_norms, train_unet=not args.network_train_text_encoder_only,
            train_text_encoder=not args.network_train_unet_only, learning_rate=args.learning_rate,
            unet_lr=args.unet_lr, text_encoder_lr=args.text_encoder_lr,
            full_precision=bool(args.full_fp16 or args.full_bf16),
        )


class LoraTrainable(Trainable):
    """A LoRA network trained on the family's models (see ``library.trainables.base.Trainable``)."""

    kind = "LoRA"
    writes_models = False

    def __init__(self) -> None:
        self.config: Optional[LoraConfig] = None  # set by ``configure``
        self.module: Optional[network_base.AdapterNetwork] = None
        self.effect: Optional[lora_effect.EffectMonitor] = None  # what the LoRA changes; "does nothing"

    @property
    def network(self) -> network_base.AdapterNetwork:
        return self.module

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_network_arguments(parser)

    def validate_arguments(self, args: argparse.Namespace, sdxl: bool) -> None:
        validate_arguments(args, sdxl)

    def configure(self, args: argparse.Namespace) -> None:
        self.config = LoraConfig.from_args(args)

    def parts(self) -> tuple[bool, bool]:
        return self.config.train_unet, self.config.train_text_encoder

    # -- building ----------------------------------------------------------------------------
    def attach(self, models: StableDiffusionModels, unet_module_names: Optional[dict[str, str]]) -> None:
        """The network created and applied to the parts being trained, ``--network_weights`` loaded."""
        config = self.config
        network = create_network(config, models, unet_module_names)
        network.apply_to(apply_text_encoder=config.train_text_encoder, apply_unet=config.train_unet)
        if not network.all_loras():
            raise UserError(f"--network_module {config.network_module}: no modules in the parts being trained (it "
                            f"has no text encoder modules, or --network_args excluded them all)")
        if config.network_weights and not config.dim_from_weights:
            network.load_weights(config.network_weights)
        if config.scale_weight_norms and not network.supports_max_norm():
            raise UserError(f"--scale_weight_norms: {network.network_module} does not support max-norm "
                            f"regularisation; remove the option")
        self.module = network

    def place(self, device: torch.device, autocast_dtype: torch.dtype) -> None:
        # kohya's --full_fp16/--full_bf16: the LoRA itself in the autocast dtype (no float32 master copy).
        self.module.to(device, dtype=autocast_dtype if self.config.full_precision else None)

    def records_text_encoder_gradients(self) -> bool:
        # a text encoder whose LoRA has learning rate 0 runs without recording gradients
        return self.config.train_text_encoder and any(p.requires_grad for module in self.module.text_encoder_loras
                                                      for p in module.parameters())

    def changes_text_conditioning(self) -> bool:
        # an adapter in a text encoder changes its outputs with its weights and its multiplier, trained or not
        return bool(self.module.text_encoder_loras)

    def param_groups(self) -> list[dict[str, Any]]:
        config = self.config
        param_groups = self.module.prepare_optimizer_params(
            config.text_encoder_lr, config.unet_lr, config.learning_rate,
            network_base.loraplus_ratios(config.network_args))
        if not param_groups:  # e.g. more --text_encoder_lr values than encoders, the used ones 0
            raise UserError(NOTHING_TO_TRAIN)
        return param_groups

    def metadata(self, args: argparse.Namespace, accelerator: Accelerator, models: StableDiffusionModels,
                 data: Any, optimization: Any, progress: train_state.Progress) -> dict[str, str]:
        """kohya's metadata of every LoRA file of the run (main process only)."""
        dataset, validation_dataset = data.dataset, data.validation_dataset
        return lora_metadata.run_metadata(args, models.kind, dataset, {
            "session_id": progress.session_id,
            "training_started_at": progress.training_started_at,
            "num_train_images": dataset.num_train_images,
            "num_reg_images": dataset.num_reg_images,
            "num_validation_images": validation_dataset.num_train_images if validation_dataset else 0,
            "num_batches_per_epoch": len(data),
            "num_epochs": data.num_epochs,
            "optimizer": optimization.optimizer_name + (f"({optimization.optimizer_args})"
                                                        if optimization.optimizer_args else ""),
            "network_args": self.config.network_args,
            "total_batch_size": args.train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps,
        })

    def writer(self, args: argparse.Namespace, metadata: dict[str, str], ema_average: Optional[ema.LoraEma],
               current_metadata: Any, resumed: bool) -> lora_files.LoraWriter:
        writer = lora_files.LoraWriter(args, metadata, ema_average, current_metadata=current_metadata)
        # trained weights (a resumed state, --network_weights) may be saved before this run's first step
        writer.trained = resumed or bool(self.config.network_weights)
        return writer

    def start(self, args: argparse.Namespace, is_main_process: bool) -> None:
        """The monitor of what the LoRA changes (its check step follows the final step count)."""
        self.effect = lora_effect.EffectMonitor(args, self.module, is_main_process)

    # -- during the run ------------------------------------------------------------------------
    def after_optimizer_step(self) -> dict[str, float]:
        """``--scale_weight_norms``: kohya's max-norm regularisation and its scalars."""
        if not self.config.scale_weight_norms:
            return {}
        return max_norm_scalars(self.module.apply_max_norm_regularization(self.config.scale_weight_norms))

    def weights_finite(self) -> bool:
        """Whether every trainable weight is finite (a host sync: only on the non-finite-loss path)."""
        parameters = [parameter for parameter in self.module.parameters() if parameter.requires_grad]
        return bool(torch.stack([torch.isfinite(parameter).all() for parameter in parameters]).all())

    def before_training(self, trainer: Any, run: Any) -> None:
        if run.validator is None:  # the effect monitor measures on a fixed probe of training images instead
            self.effect.probe = lora_effect.training_probe(trainer, run)

    def step_scalars(self, step: int, *, guard_skipped: int, guard_window: Sequence[float], scaler_skipped: int,
                     learning_rates: list[float]) -> dict[str, float]:
        return self.effect.check(step, guard_skipped=guard_skipped, scaler_skipped=scaler_skipped,
                                 learning_rates=learning_rates, guard_window=guard_window)

    def validation_pass(self, run: Any, kind: str, run_pass: Any, batch_loss: Any) -> dict[str, float]:
        return self.effect.validation_pass(run.loss.models.unet, run.validator, kind, run_pass, batch_loss,
                                           run.accelerator)

    def check_written(self, path: str, save_dtype: Optional[torch.dtype]) -> None:
        """The file re-read holds the trained LoRA (catches save bugs)."""
        lora_effect.check_written(self.module, path, save_dtype)

    def weights_for_report(self) -> dict[str, torch.Tensor]:
        return self.module.lora_state_dict()


def create_network(config: LoraConfig, models: StableDiffusionModels,
                   module_names: Optional[dict[str, str]]) -> network_base.AdapterNetwork:
    """The ``--network_module`` type's network for these models (from ``--network_weights`` with
    ``--dim_from_weights``); not yet applied."""
    network_type = registry.network_type(config.network_module)
    if config.dim_from_weights:
        weights = network_base.read_lora_file(config.network_weights)
        network = network_type.create_network_from_weights(1.0, weights, models.text_encoders, models.unet,
                                                           module_names, **config.network_args)
        network.load_weights(config.network_weights)
        return network
    return network_type.create_network(
        1.0,
        config.network_dim,
        config.network_alpha,
        models.vae,
        models.text_encoders,
        models.unet,
        neuron_dropout=config.network_dropout,
        unet_module_names=module_names,
        **config.network_args,
    )


def max_norm_scalars(stats: network_base.MaxNormStats) -> dict[str, float]:
    """kohya's tracker scalars of ``--scale_weight_norms``. Reading them is a second host sync
    per step, paid only when the option is on (the stats exist only after the optimizer step)."""
    keys_scaled, mean_norm, max_norm = torch.stack(
        [stats.keys_scaled.float(), stats.mean_norm.float(), stats.max_norm.float()]).tolist()
    return {"max_norm/keys_scaled": keys_scaled, "max_norm/average_key_norm": mean_norm,
            "max_norm/max_key_norm": max_norm}
