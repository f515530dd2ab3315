"""LoRA training for Stable Diffusion 1.x/2.x, and the trainer shared with SDXL.

Flags, defaults and output files follow kohya-ss sd-scripts. The loop reads top to
bottom: batch -> noise -> forward -> loss -> backward -> guard -> step -> log -> save;
each concern it touches lives in one ``library/`` module.
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import random
import sys
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, broadcast_object_list
from tqdm import tqdm

from library import (
    compatibility, config_file, ema, fault_injection, flat_gradients, fp8_base, grad_guard, healing, lora_files,
    loss_scaling, losses, model_loading, nan_report, noise, optimizers, torch_compile,
)
from library import lora_metadata, preflight, sampling, sharding, text_encoding, tracking, train_state, validation
from library import best_checkpoint, debiased_loss, lora_effect, lr_finder
from library.datasets import caching as dataset_caching, dataset as datasets, latents as cached_latents
from library.errors import ArgumentParser, UserError, exit_on_user_error
from library.model_loading import StableDiffusionModels
from library.run_data import TrainingData, Window
from library.run_outputs import RunOutputs, StepResult
from networks import merge_lora, network_base, registry

NOTHING_TO_TRAIN = ("--learning_rate/--unet_lr/--text_encoder_lr: every trained part has learning rate 0, nothing "
                    "would train (--learning_rate 0 needs --unet_lr or --text_encoder_lr for the parts to train)")
MIXED_PRECISION_DTYPES = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


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


def setup_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    config_file.add_arguments(parser)
    model_loading.add_arguments(parser)
    datasets.add_arguments(parser)
    validation.add_arguments(parser)
    best_checkpoint.add_arguments(parser)
    lr_finder.add_arguments(parser)
    lora_files.add_arguments(parser)
    lora_metadata.add_arguments(parser)
    add_training_arguments(parser)
    fp8_base.add_arguments(parser)
    tracking.add_arguments(parser)
    add_network_arguments(parser)
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
    compatibility.add_arguments(parser)
    torch_compile.add_arguments(parser)
    return parser


def validate_arguments(args: argparse.Namespace, sdxl: bool = False) -> None:
    """Refuse bad values, and paths that cannot be read or written, before anything is loaded or
    written; ``sdxl``: the model the entry script trains."""
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
    compatibility.check_arguments(args, sdxl)
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


@dataclass
class LossContext:
    """What computing a batch's loss needs, fixed for the whole run. ``check_inputs``: also say per
    sample whether the UNet's inputs (latents, frozen text-encoder outputs) are finite (quarantine)."""

    args: argparse.Namespace
    models: StableDiffusionModels
    noise_scheduler: Any
    noise_options: noise.NoiseOptions
    loss_options: losses.LossOptions
    autocast: Any
    train_text_encoder: bool
    device: torch.device
    check_inputs: bool = False
    debiased: Optional[debiased_loss.DebiasedLoss] = None  # --debiased_loss: the base model's loss beside it


@dataclass
class Optimization:
    """What turns gradients into updates, and what watches them: optimizer, learning-rate schedule, the
    fp16 loss scaler (None otherwise), the gradient guard and its monitor, the healing policy, and the
    EMA of the weights (None without ``--ema_decay``)."""

    trainable_params: list[torch.nn.Parameter]
    gradients: flat_gradients.FlatGradients  # the step's .grad as views of one buffer
    optimizer: torch.optim.Optimizer
    optimizer_name: str
    optimizer_args: str
    lr_scheduler: Any
    scaler: Optional[loss_scaling.LossScaler]
    guard: grad_guard.GradGuard
    monitor: grad_guard.GradientMonitor
    healer: healing.HealingPolicy
    agree: Optional[Callable[[bool], bool]]  # the guard's decision shared by the processes
    injections: dict[int, fault_injection.Injection]
    ema: Optional[ema.LoraEma] = None

    def unscaled(self, measured: grad_guard.GradientMeasurement) -> float:
        """The measured norm without the loss scale (what the runaway test compares across scale changes)."""
        if self.scaler is None or self.monitor.unscaled or not measured.scale:
            return measured.norm
        return measured.norm / measured.scale


@dataclass
class Run:
    """One training run as the builders made it; the loop, the events and the finish read it."""

    args: argparse.Namespace
    accelerator: Accelerator
    models: StableDiffusionModels
    network: network_base.AdapterNetwork
    data: TrainingData
    loss: LossContext
    optimization: Optimization
    states: train_state.RunStates
    progress: train_state.Progress
    validator: Optional[validation.Validation]
    writer: lora_files.LoraWriter
    outputs: RunOutputs
    average_loss: float = math.nan
    stopped: Optional[str] = None  # why the self-healing stopped the run
    best: Optional[best_checkpoint.BestCheckpoint] = None  # with validation: the best file, early stop
    effect: Optional[lora_effect.EffectMonitor] = None  # what the LoRA changes; the "does nothing" warning

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def save_state(self, name: str) -> bool:
        """Write state folder ``name``; False when refused (untrained weights, or see ``RunStates.save``)."""
        if not self.writer.trained:  # nothing worth resuming, and it would replace an earlier run's state
            print(f"\nnot saving state {name}: it would hold the initial, untrained LoRA (no optimizer step of this "
                  f"run has trained it yet)", flush=True)
            return False
        self.outputs.flush()
        return self.states.save(name, self.progress)

    def weights_for_use(self) -> AbstractContextManager[None]:
        """The context in which the LoRA holds the weights samples, validation and files see (the EMA,
        schedule-free's average); training states are saved outside it."""
        return ema.weights_for_use(self.optimization.optimizer, self.optimization.ema)


class NetworkTrainer:
    """Trains a LoRA on SD1.x/2.x; ``sdxl_train_network.SdxlNetworkTrainer`` overrides the model hooks."""

    is_sdxl = False

    # -- model hooks (overridden for SDXL) -----------------------------------------------
    def load_models(self, args: argparse.Namespace) -> StableDiffusionModels:
        return model_loading.load_models(
            args.pretrained_model_name_or_path,
            sdxl=self.is_sdxl,
            v2=args.v2 and not self.is_sdxl,
            model_config_dir=args.model_config_dir,
            tokenizer_cache_dir=args.tokenizer_cache_dir,
            vae_path=args.vae,
            device=model_loading.load_device(args),
            stored_as=fp8_base.stored_as_rule(args),
        )

    def unet_module_names(self, models: StableDiffusionModels) -> Optional[dict[str, str]]:
        """SD1.x/2.x LoRA keys use the diffusers module paths as they are."""
        return None

    def encode_prompts(self, args: argparse.Namespace, models: StableDiffusionModels, captions: list[str]) -> Any:
        """Text conditioning for the UNet: CLIP hidden states (``--clip_skip``, ``--max_token_length``,
        ``--weighted_captions`` aware)."""
        return text_encoding.encode_sd(
            models.tokenizers[0], models.text_encoders[0], captions, args.max_token_length, args.clip_skip,
            weighted=args.weighted_captions,
        )

    def predict(
        self, models: StableDiffusionModels, noisy_latents: torch.Tensor, timesteps: torch.Tensor, conditioning: Any,
        batch: dict[str, Any],
    ) -> torch.Tensor:
        return models.unet(noisy_latents, timesteps, in_autocast_dtype(conditioning)).sample

    # -- the run -----------------------------------------------------------------------
    def train(self, args: argparse.Namespace, explicit: set[str]) -> None:
        """Build the run, train it window by window, finish it (exit code 1 when it failed)."""
        run = self.build_run(args, explicit)
        if run is None:  # --debug_dataset printed the first epoch's batches
            return
        with run.outputs:
            if lr_finder.requested(args):  # everything it touches is put back
                lr_finder.find(self, run)
                if args.find_lr_only:
                    return
            if run.validator is None:  # the effect monitor measures on a fixed probe of training images instead
                run.effect.probe = lora_effect.training_probe(self, run)
            self.after_start(run)
            for window in run.data.windows(run.progress, args.max_train_steps,
                                           lambda: run.outputs.stop.requested or best_checkpoint.stopped(run.best),
                                           on_epoch_start=run.network.train):
                if window.trains:
                    result = self.train_step(run, window)
                    self.record(run, result)
                    self.heal(run, result, window)
                    if run.stopped:
                        break
                    self.after_step(run, result.step, window.epoch)
                if window.ends_epoch:
                    run.data.next_epoch(run.progress)
                    self.after_epoch(run, window.epoch)
        self.finish(run)

    # -- building it -----------------------------------------------------------------------
    def build_run(self, args: argparse.Namespace, explicit: set[str]) -> Optional[Run]:
        """Options resolved, data, models, network, optimization, state (resumed) and outputs; None
        after ``--debug_dataset`` has printed the batches."""
        accelerator = self.resolve_options(args, explicit)
        resume_from = train_state.find_resume_state(args, accelerator.num_processes, self.is_sdxl)  # before any model load
        data = self.build_data(args, accelerator)
        if data is None:
            return None
        ema.check_steps(args, args.max_train_steps)  # the steps are known once the data is
        models, network, loss = self.build_model(args, accelerator, data)
        optimization = self.build_optimization(args, accelerator, network, data)
        best = best_checkpoint.create(args, data.validation_dataset is not None, lora_files.output_path(
            args, best_checkpoint.best_file_name(args.output_name)), accelerator.is_main_process)
        states, progress, resume_step, captured = self.build_state(args, accelerator, network, optimization, data,
                                                                   resume_from, best)
        validator = validation.create(args, data.validation_dataset, accelerator,
                                      loss.noise_scheduler.config.num_train_timesteps, data.num_workers)
        metadata = {} if not accelerator.is_main_process else self.run_metadata(
            args, accelerator, models, network, data, optimization, progress)
        print(f"training: {data.dataset.num_train_images} images, {len(data)} batches per epoch, {data.num_epochs} "
              f"epochs, {args.max_train_steps} optimizer steps, mixed precision {args.mixed_precision} "
              f"on {accelerator.device.type}")
        outputs = RunOutputs(args, accelerator, with_scaler=optimization.scaler is not None,
                             total_steps=args.max_train_steps, initial_step=progress.global_step,
                             resume_step=resume_step)
        if captured:
            outputs.event(progress.global_step, "healthy", "")  # the initial healthy point (the tools read it)
        writer = lora_files.LoraWriter(args, metadata, optimization.ema, current_metadata=optimization.healer.metadata)
        writer.trained = resume_from is not None or bool(args.network_weights)
        return Run(args, accelerator, models, network, data, loss, optimization, states, progress, validator,
                   writer, outputs, best=best,
                   effect=lora_effect.EffectMonitor(args, network, accelerator.is_main_process))

    def resolve_options(self, args: argparse.Namespace, explicit: set[str]) -> Accelerator:
        """Check every option, apply aliases and presets, start accelerate and seed the RNGs."""
        validate_arguments(args, sdxl=self.is_sdxl)
        tracking.setup_console_log(args)
        compatibility.apply_aliases(args)
        sampling.drop_unused_prompt_file(args)  # before loading: decides whether sampling keeps the VAE/text encoders
        grad_guard.apply_preset(args, explicit)
        healing.apply_preset(args, explicit)
        if args.nan_report:  # known now (the preset may turn it on); found taken mid-run it was a traceback
            report = nan_report.report_path(args.output_dir, args.output_name)
            if report.is_dir():
                raise UserError(f"--nan_report: {report}, where the report is written, is a folder; move it away "
                                f"or choose another --output_name")
            preflight.require_writable_file("--nan_report", report)
        accelerator = Accelerator(
            cpu=not torch.cuda.is_available(),  # without it torchrun on a CPU machine gives N unsynchronised rank-0s
            gradient_accumulation_steps=1,  # the loop forms accumulation windows itself (exact loss normalisation)
            mixed_precision="no",  # autocast and the loss scaler are ours: accelerate drops both on CPU
            log_with=tracking.tracker_names(args),
            project_dir=tracking.tracker_dir(args),
            kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(minutes=args.ddp_timeout))]
            if args.ddp_timeout else None,
        )
        if args.seed is None:
            args.seed = shared_random_seed(accelerator)
            print(f"--seed not given: using {args.seed}")
        seed_everything(args.seed)
        return accelerator

    def build_data(self, args: argparse.Namespace, accelerator: Accelerator) -> Optional[TrainingData]:
        """The datasets (checked before any model loads) and this process's loader; None after
        ``--debug_dataset`` printed the first epoch as training would see it."""
        min_bucket_steps = 32 if self.is_sdxl else 64
        dataset = datasets.build_dataset(args, min_bucket_steps)
        dataset.poisoned = healing.parse_sample_injections(args.debug_inject_sample)
        healing.check_sample_injections(dataset.poisoned, [image.path for image in dataset.plan.images])
        losses.check_masks(args, [image.path for image in dataset.plan.images if image.subset.alpha_mask])
        validation_dataset = datasets.build_validation_dataset(args, dataset, min_bucket_steps)
        if args.debug_dataset:  # captions as at the start of training (token warm-up)
            dataset.step_layout = datasets.StepLayout(args.gradient_accumulation_steps, 1, args.max_train_steps)
            for line in dataset.describe_epoch(1):
                print(line)
            return None
        return TrainingData(args, dataset, validation_dataset, accelerator.process_index, accelerator.num_processes,
                            accelerator.device)

    def build_model(self, args: argparse.Namespace, accelerator: Accelerator, data: TrainingData
                    ) -> tuple[StableDiffusionModels, network_base.AdapterNetwork, LossContext]:
        """Models loaded (base weights merged, fp8), the network applied and placed, caches filled."""
        device = accelerator.device
        autocast_dtype = MIXED_PRECISION_DTYPES[args.mixed_precision]
        models = self.load_models(args)
        compatibility.select_attention(args, models.unet, device.type, announce=print)
        if args.base_weights:
            merge_lora.merge_base_weights(models, args.base_weights, args.base_weights_multiplier)
        fp8_base.store_frozen_weights(args, models, autocast_dtype)  # before the network wraps the layers
        noise_scheduler = noise.training_noise_scheduler(args.zero_terminal_snr)
        network = self.create_network(args, models)
        train_text_encoder = not args.network_train_unet_only
        network.apply_to(apply_text_encoder=train_text_encoder, apply_unet=not args.network_train_text_encoder_only)
        if not network.all_loras():
            raise UserError(f"--network_module {args.network_module}: no modules in the parts being trained (it has "
                            f"no text encoder modules, or --network_args excluded them all)")
        if args.network_weights and not args.dim_from_weights:
            network.load_weights(args.network_weights)
        if args.scale_weight_norms and not network.supports_max_norm():
            raise UserError(f"--scale_weight_norms: {network.network_module} does not support max-norm "
                            f"regularisation; remove the option")
        self.place_models(args, models, device, autocast_dtype, train_text_encoder)
        # kohya's --full_fp16/--full_bf16: the LoRA itself in the autocast dtype (no float32 master copy).
        network.to(device, dtype=autocast_dtype if args.full_fp16 or args.full_bf16 else None)
        dataset_caching.cache_before_training(args, data.dataset, models, accelerator, autocast_dtype,
                                              data.validation_dataset)
        if args.gradient_checkpointing:
            self.enable_gradient_checkpointing(models, train_text_encoder)
        train_unet = not args.network_train_text_encoder_only
        loss = LossContext(
            args, torch_compile.compiled_for_training(args, models, train_unet, train_text_encoder), noise_scheduler,
            noise.NoiseOptions.from_args(args), losses.LossOptions.from_args(args),
            torch.autocast(device.type, dtype=autocast_dtype, enabled=args.mixed_precision != "no"),
            # a text encoder whose LoRA has learning rate 0 runs without recording gradients
            train_text_encoder and any(p.requires_grad for module in network.text_encoder_loras
                                       for p in module.parameters()),
            device,
            check_inputs=args.quarantine_bad_samples,
            debiased=debiased_loss.create(args, network, device, data.steps_per_epoch),
        )
        return models, network, loss

    def build_optimization(self, args: argparse.Namespace, accelerator: Accelerator,
                           network: network_base.AdapterNetwork, data: TrainingData) -> Optimization:
        param_groups = network.prepare_optimizer_params(
            args.text_encoder_lr, args.unet_lr, args.learning_rate,
            network_base.loraplus_ratios(network_base.parse_network_args(args.network_args)))
        if not param_groups:  # e.g. more --text_encoder_lr values than encoders, the used ones 0
            raise UserError(NOTHING_TO_TRAIN)
        trainable_params = [p for group in param_groups for p in group["params"]]
        gradients = flat_gradients.FlatGradients(trainable_params)  # each step's .grad views of one buffer
        optimizer_name, optimizer_args, optimizer = optimizers.build_optimizer(args, param_groups)
        lora_files.apply_epoch_ratio(args, data.num_epochs)
        lr_scheduler = optimizers.build_lr_scheduler(args, optimizer, args.max_train_steps)
        scaler = loss_scaling.create_loss_scaler(args, accelerator.device)
        guard = grad_guard.GradGuard(grad_guard.GuardConfig.from_args(args), announce=tqdm.write)
        agree = (lambda skip: grad_guard.agree_across_processes(skip, accelerator)) if accelerator.num_processes > 1 else None
        log_cosine = accelerator.is_main_process and args.grad_norm_log and args.grad_cosine_log
        monitor = grad_guard.GradientMonitor(gradients, cosine=log_cosine, unscaled=args.grad_norm_unscaled)
        dataset = data.dataset
        healer = healing.HealingPolicy(healing.HealingConfig.from_args(args), len(dataset.plan.images),
                                       describe=lambda image: (dataset.plan.images[image].path,
                                                               dataset.plan.images[image].caption))
        return Optimization(trainable_params, gradients, optimizer, optimizer_name, optimizer_args, lr_scheduler,
                            scaler, guard, monitor, healer, agree,
                            fault_injection.parse_injections(args.debug_inject_grad), ema.create(args, trainable_params))

    def build_state(self, args: argparse.Namespace, accelerator: Accelerator, network: network_base.AdapterNetwork,
                    optimization: Optimization, data: TrainingData, resume_from: Optional[Path],
                    best: Optional[best_checkpoint.BestCheckpoint] = None
                    ) -> tuple[train_state.RunStates, train_state.Progress, Optional[int], bool]:
        """The run's state store and progress, resumed from the state ``resume_from`` (found by
        ``train_state.find_resume_state`` before the models loaded) when given; the resumed step
        (None: a fresh run); whether the state now is the first healthy point (a fresh run's initial
        state, or a resumed state that kept none)."""
        store = train_state.StateStore(
            args.output_dir, args.output_name, train_state.protected_arguments(args, accelerator.num_processes),
            save_dtype=lora_files.SAVE_DTYPES[args.save_precision],
            before_rename=fault_injection.state_write_hook(args.debug_kill_in_state_write),
        )
        progress = train_state.Progress(
            seed=args.seed, training_started_at=lora_metadata.wall_clock(),
            session_id=random.Random(args.seed).randint(0, 2**32),
        )
        stateful = {"optimizer": optimization.optimizer, "lr_scheduler": optimization.lr_scheduler,
                    "grad_guard": optimization.guard, "grad_monitor": optimization.monitor,
                    "healing": optimization.healer}
        if optimization.scaler is not None:
            stateful["loss_scaler"] = optimization.scaler
        if optimization.ema is not None:
            stateful["ema"] = optimization.ema
        if best is not None:  # the best value so far (a rewind keeps it: the best file stays the best seen)
            stateful["best_checkpoint"] = best
        states = train_state.RunStates(store, network, stateful, not_captured=("healing", "best_checkpoint"))
        resumed = states.resume(resume_from, accelerator.device)
        if resumed and (args.initial_step is not None or args.initial_epoch is not None):
            print("--initial_step/--initial_epoch: ignored, the run continues at the resumed state's step")
        progress = resumed or train_state.initial_progress(args, data.steps_per_epoch, progress)
        healer = optimization.healer
        data.quarantined = healer.quarantined_images
        captured = healer.config.rewind_on_divergence and states.healthy_point is None
        if captured:
            self.capture_healthy_point(states, healer, progress)
        return states, progress, progress.global_step if resumed else None, captured

    def run_metadata(self, args: argparse.Namespace, accelerator: Accelerator, models: StableDiffusionModels,
                     network: network_base.AdapterNetwork, data: TrainingData, optimization: Optimization,
                     progress: train_state.Progress) -> dict[str, str]:
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
            "network_args": network_base.parse_network_args(args.network_args),
            "total_batch_size": args.train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps,
        })

    # -- one step -------------------------------------------------------------------------
    def train_step(self, run: Run, window: Window) -> StepResult:
        """Forward and backward the window, measure, let the guard and the healing policy decide, step."""
        args, optimization, accelerator = run.args, run.optimization, run.accelerator
        step = run.progress.global_step + 1
        optimizers.enter_train_mode(optimization.optimizer)  # schedule-free: save points leave it at its average
        samples = healing.WindowSamples(accelerator.process_index, accelerator.num_processes,
                                        args.gradient_accumulation_steps, run.data.dataset.max_batch_size)
        window_loss = self.backward_window(run.loss, window.batches, window.epoch, accelerator, optimization.scaler,
                                           samples)
        sharding.sum_gradients_across_processes(optimization.gradients)
        fault_injection.inject(optimization.injections, step, accelerator.process_index, optimization.trainable_params)
        scaler = optimization.scaler
        measured = optimization.monitor.measure(scale=scaler.get_scale_tensor() if scaler else None,
                                                loss=window_loss, riders=samples.reduced)
        decision = optimization.guard.decide(step, measured.norm, optimization.agree)
        outcome = healing.StepOutcome(
            step, healing.WindowSamples.outcomes(measured.riders, run.data.dataset.image_index_of), measured.loss,
            optimization.unscaled(measured), has_scaler=scaler is not None)
        verdict = optimization.healer.assess(outcome)
        if verdict.problem == "non-finite loss" and not verdict.rewind and not weights_finite(run.network):
            verdict = optimization.healer.weights_diverged(verdict)
        max_norm_logs = {}
        if decision.skip or not verdict.train:
            optimization.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer_step(args, optimization.optimizer, optimization.lr_scheduler, scaler,
                                optimization.trainable_params, measured.loss)
            if args.scale_weight_norms:
                max_norm_logs = max_norm_scalars(run.network.apply_max_norm_regularization(args.scale_weight_norms))
        stepped = not decision.skip and verdict.train and not (scaler is not None and scaler.last_step_skipped)
        if stepped and optimization.ema is not None:  # a skipped step leaves the average as it is
            optimization.ema.after_optimizer_step()
        verdict = optimization.healer.conclude(verdict, healing.step_kind(stepped, decision.skip, verdict))
        run.progress.global_step = step
        return StepResult(step, window.epoch, measured.loss, measured, decision, verdict, stepped,
                          optimization.lr_scheduler.get_last_lr(), max_norm_logs, samples=outcome.samples)

    def record(self, run: Run, result: StepResult) -> None:
        """The step's counts and average loss, then its row, bar, scalars and JSON line."""
        optimization = run.optimization
        if result.stepped:
            run.writer.trained = True
        run.average_loss = run.progress.record_loss(result.loss, window=run.data.steps_per_epoch)
        scaler = optimization.scaler
        run.outputs.record(result, run.average_loss, skipped=optimization.guard.skipped_steps,
                           non_finite_losses=run.progress.non_finite_losses,
                           overflows=scaler.overflow_count if scaler else None,
                           extra={**debiased_scalars(run), **run.effect.check(
                               result.step, guard_skipped=optimization.guard.skipped_steps,
                               guard_window=optimization.guard.window,
                               scaler_skipped=scaler.overflow_count if scaler else 0,
                               learning_rates=result.learning_rates)})

    # -- healing --------------------------------------------------------------------------
    def heal(self, run: Run, result: StepResult, window: Window) -> None:
        """Act on the step's healing verdict: name quarantined images, write the NaN report, rewind to
        the healthy point or stop, or keep the state as the new healthy point (docs/healing.md)."""
        healer, outputs, verdict = run.optimization.healer, run.outputs, result.verdict
        for entry in verdict.quarantined:
            outputs.event(result.step, "quarantine", entry.file,
                          f"step {result.step}: quarantined {entry.file} (caption {entry.caption!r}): {entry.reason}; "
                          f"it is left out for the rest of the run",
                          count=("train/quarantined_samples", len(healer.quarantine)),
                          fields={"file": entry.file, "caption": entry.caption, "reason": entry.reason})
        if verdict.report and healer.config.nan_report:
            self.write_nan_report(run, result, window)
        if verdict.stop:
            run.stopped = f"step {result.step}: {verdict.stop_reason}"
        elif verdict.rewind:
            self.rewind(run, result.step, verdict.rewind)
        elif healer.snapshot_due(result.step, result.stepped):
            self.capture_healthy_point(run.states, healer, run.progress)
            outputs.event(result.step, "healthy", "")
        run.data.quarantined = healer.quarantined_images  # after a rewind, which lifts uncertain ones

    @staticmethod
    def capture_healthy_point(states: train_state.RunStates, healer: healing.HealingPolicy,
                              progress: train_state.Progress) -> None:
        states.capture(progress.global_step, position=(progress.epoch, progress.batches_done))
        healer.mark_healthy(progress.global_step)

    def rewind(self, run: Run, step: int, reason: str) -> None:
        """Back to the healthy point: its weights, optimizer, schedule, scaler, guard and RNG; a lower
        learning rate; the batches trained since then are not trained again (the data goes on)."""
        optimization, healer = run.optimization, run.optimization.healer
        batches_skipped = run.data.batches_since(run.states.healthy_point["position"], run.progress)
        event = healer.rewound(step, reason, batches_skipped)
        run.states.restore(run.device)
        abandoned = run.writer.mark_abandoned(event.to_step) if run.accelerator.is_main_process else []
        lowered = healing.scale_learning_rates(optimization.optimizer, optimization.lr_scheduler,
                                               healer.lr_multiplier)
        run.progress.loss_history = []  # the average restarts from the healthy point's weights
        rates = healing.describe_rates(healing.learning_rates(optimization.optimizer))
        run.outputs.event(
            step, "rewind", str(event.to_step),
            f"step {step}: {reason}: rewound to the healthy point of step {event.to_step}, learning rate now {rates}"
            + ("" if lowered else " (unchanged: the optimizer sets its own step size)")
            + f", {batches_skipped} batches of the diverged span skipped (rewind {len(healer.rewinds)} of "
              f"{healer.config.max_rewinds})"
            + (f"; the files of the diverged span are renamed: {', '.join(abandoned)}" if abandoned else ""),
            count=("train/rewinds", len(healer.rewinds)),
            fields={"to_step": event.to_step, "reason": reason, "learning_rate": event.lr_scale * run.args.learning_rate,
                    "lr_scale": event.lr_scale, "batches_skipped": batches_skipped})

    def write_nan_report(self, run: Run, result: StepResult, window: Window) -> None:
        """The first non-finite loss (with a re-run of the forward under hooks) or gradient, explained
        in ``<output_name>-nan_report.txt`` (main process)."""
        if not run.accelerator.is_main_process:
            return
        kind, healer = result.verdict.report, run.optimization.healer
        dataset = run.data.dataset
        samples = [nan_report.SampleLine(dataset.image_of(sample.sample_id).path,
                                         dataset.image_of(sample.sample_id).caption, sample.loss,
                                         sample.image in healer.quarantined_images)
                   for sample in result.samples]
        probe = self.probe_forward(run, window) if kind == "loss" else None
        path = nan_report.report_path(run.args.output_dir, run.args.output_name)
        text = nan_report.format_report(
            kind, result.step, result.epoch, samples, probe,
            result.measured.scale if run.optimization.scaler else None, list(healer.recent_norms),
            healing.learning_rates(run.optimization.optimizer), healing.report_note(result.verdict,
                                                                                  run.optimization.scaler is not None))
        nan_report.write_report(path, text, start_new=len(healer.reported) == 1)
        tqdm.write(f"step {result.step}: first non-finite {kind}; what it was: {path}")

    def probe_forward(self, run: Run, window: Window) -> nan_report.ForwardProbe:
        """Re-run the window's forward (no gradient, the RNGs put back) with hooks on every module."""
        models = run.models
        named = [("unet", models.unet)] + ([(f"text_encoder{index + 1}", encoder)
                                            for index, encoder in enumerate(models.text_encoders)]
                                           if run.loss.train_text_encoder else [])
        devices = [run.device] if run.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad(), \
                nan_report.probe_forward(named, models.unet) as probe:
            for batch in window.batches:
                plan = self.plan_loss(run.loss, batch, window.epoch)
                with run.loss.autocast:
                    self.compute_loss(run.loss, batch, window.epoch, plan)
        return probe

    # -- events -----------------------------------------------------------------------------
    def after_start(self, run: Run) -> None:
        with run.weights_for_use():  # samples, validation and files see the EMA / schedule-free's average
            sampling.sample_images(run.args, run.accelerator, run.models, run.network, run.device, when="first",
                                   step=run.progress.global_step)

    def after_step(self, run: Run, step: int, epoch: int) -> None:
        """Validation, LoRA file, sample images and state of a step save point (every process calls it)."""
        args = run.args
        with run.weights_for_use():  # every step on every process, as kohya
            if run.validator is not None and run.validator.due_after_step(step):  # before this step's state
                self.validate(run, "step", f"after step {step}")
            if run.accelerator.is_main_process:
                run.writer.on_step(run.network, step, epoch)
                sampling.sample_images(args, run.accelerator, run.models, run.network, run.device, when="step",
                                       step=step)
        if run.accelerator.is_main_process and args.save_state and args.save_every_n_steps \
                and step % args.save_every_n_steps == 0:
            if run.save_state(train_state.step_state_name(args.output_name, step)):
                run.states.store.rotate("step", step, args.save_every_n_steps, train_state.kept_states(args)[0])

    def after_epoch(self, run: Run, epoch: int) -> None:
        """Validation, LoRA file, sample images and state of an epoch save point."""
        args, step = run.args, run.progress.global_step
        with run.weights_for_use():
            if run.validator is not None and run.validator.due_after_epoch(epoch):
                self.validate(run, "epoch", f"after epoch {epoch} (step {step})")
            if run.accelerator.is_main_process:
                run.writer.on_epoch_end(run.network, step, epoch, is_last_epoch=epoch == run.data.num_epochs)
                sampling.sample_images(args, run.accelerator, run.models, run.network, run.device, when="epoch",
                                       step=step, epoch=epoch)
        every = args.save_every_n_epochs
        if run.accelerator.is_main_process and args.save_state and every and epoch % every == 0 \
                and epoch != run.data.num_epochs:
            if run.save_state(train_state.epoch_state_name(args.output_name, epoch)):
                run.states.store.rotate("epoch", epoch, every, train_state.kept_states(args)[1])

    def validate(self, run: Run, kind: str, where: str) -> None:
        """A validation pass on every process; its scalars are logged at the current step like the step's."""
        batch_loss = functools.partial(self.validation_loss, run.loss)
        scalars = run.effect.validation_pass(
            run.loss.models.unet, run.validator, kind,
            lambda: run.validator.run(kind, run.network, batch_loss, run.average_loss, where), batch_loss,
            run.accelerator)
        scalars.update(best_checkpoint.observe(run.best, kind, run.progress.global_step, scalars, functools.partial(
            run.writer.write, run.network, best_checkpoint.best_file_name(run.args.output_name),
            run.progress.global_step, run.progress.epoch)))
        run.outputs.scalars(run.progress.global_step, scalars)

    # -- the end ----------------------------------------------------------------------------
    def finish(self, run: Run) -> None:
        """Interrupted: state and exit code 128 + signal. Stopped by the healing, or failed at the end:
        the last healthy weights, one line, exit code 1. Otherwise the final file, state and summary."""
        args, accelerator, progress, stop = run.args, run.accelerator, run.progress, run.outputs.stop
        healer = run.optimization.healer
        if stop.requested:
            if args.save_state and accelerator.is_main_process:
                saved = run.save_state(train_state.step_state_name(args.output_name, progress.global_step))
                print(f"interrupted at step {progress.global_step}; "
                      + ("state saved" if saved else "its state was refused (see above)")
                      + ". Resume with the same command plus --resume auto", flush=True)
            else:
                print(f"interrupted at step {progress.global_step}; no state saved (--save_state is off)",
                      flush=True)
            sys.exit(stop.exit_code)
        failure = run.stopped or healer.failure_at_end()
        if failure:
            self.finish_failed(run, failure)
        saved = None
        with run.weights_for_use():  # the file holds the EMA / schedule-free's average, the state the training weights
            if args.debug_report_weights:
                fault_injection.report_weights(accelerator.process_index, run.network.lora_state_dict())
            if accelerator.is_main_process:
                epoch = progress.epoch - (1 if progress.batches_done == 0 else 0)
                saved = run.writer.write(run.network, lora_files.final_file_name(args.output_name),
                                         progress.global_step, epoch)
                if saved:  # the file re-read holds the trained LoRA (catches save bugs)
                    lora_effect.check_written(run.network, saved, run.writer.save_dtype)
                if saved and run.best is not None:
                    run.best.final_from_best(saved)
        if accelerator.is_main_process:
            if args.save_state or args.save_state_on_train_end:  # kohya: --save_state also saves the last state
                run.save_state(train_state.final_state_name(args.output_name))
            if saved is None:
                sys.exit(1)
        print("done: " + healer.summary(progress.global_step, run.average_loss, len(progress.loss_history),
                                        healing.learning_rates(run.optimization.optimizer)))

    def finish_failed(self, run: Run, failure: str) -> None:
        """Write the healthy point's weights as ``<output_name>-last_healthy.safetensors`` (none without a
        healthy point: rewinding off) and exit with code 1."""
        args, progress, healer = run.args, run.progress, run.optimization.healer
        summary = healer.summary(progress.global_step, run.average_loss, len(progress.loss_history),
                                 healing.learning_rates(run.optimization.optimizer))
        written = None
        if run.states.healthy_point is not None:
            weights_step = run.states.restore(run.device)
            with run.weights_for_use():
                if run.accelerator.is_main_process:
                    run.writer.metadata["ss_last_healthy_step"] = str(weights_step)
                    written = run.writer.write(run.network, lora_files.last_healthy_file_name(args.output_name),
                                               weights_step, progress.epoch)
        earlier = [path for _, path in run.writer.written if path != written]
        if written:
            outcome = f"the last healthy weights (step {weights_step}) are in {written}"
        elif run.states.healthy_point is None:
            outcome = "no last healthy weights written (no healthy point is kept without --rewind_on_divergence)"
        else:
            outcome = "no last healthy weights written (see above)"
        outcome += (f"; written before the failure: {', '.join(earlier)}" if earlier else
                    "; this run wrote no other LoRA file" if run.accelerator.is_main_process else "")
        print(f"failed: {failure}; {outcome}; {summary}", flush=True)
        sys.exit(1)

    def backward_window(
        self, run: "LossContext", window: list[dict[str, Any]], epoch: int, accelerator: Accelerator, scaler,
        samples: Optional[healing.WindowSamples] = None,
    ) -> torch.Tensor:
        """Forward and backward every micro-batch of one accumulation window; returns the window's loss
        (a 0-dim tensor: the gradient monitor reads it in its one host sync per step). ``samples``
        collects each sample's loss and input finiteness, summed over processes with the window loss.

        The loss is normalised over the whole window and all processes (``--loss_normalization
        exact``): the weight denominator is known before the first backward, because weights
        depend only on the batches and their keyed timesteps, not on the model.
        """
        plans = [self.plan_loss(run, batch, epoch) for batch in window]
        local = losses.window_denominator(
            [plan.weight_sum for plan in plans], run.loss_options.loss_normalization, run.args.gradient_accumulation_steps
        )
        denominator = accelerator.reduce(local.to(run.device), reduction="sum")
        window_loss_sum = torch.zeros((), device=run.device)
        for batch, plan in zip(window, plans):
            with run.autocast:
                result = self.compute_loss(run, batch, epoch, plan)
            # Gradients are summed over processes afterwards, so each process's share of the
            # global sum / global denominator adds up to exactly the full-batch gradient.
            objective = losses.micro_batch_objective(result.loss_sum, denominator, 1.0)
            accelerator.backward(scaler.scale(objective) if scaler else objective)
            window_loss_sum += result.loss_sum.detach()
            if samples is not None:
                samples.add(batch["sample_indices"], result.per_sample, result.inputs_finite, "padding" in batch)
        if samples is None:
            return losses.normalize(accelerator.reduce(window_loss_sum, reduction="sum"), denominator)
        samples.reduced = accelerator.reduce(samples.vector(window_loss_sum), reduction="sum")
        return losses.normalize(samples.reduced[0], denominator)

    # -- pieces of the loop --------------------------------------------------------------
    def create_network(self, args: argparse.Namespace, models: StableDiffusionModels) -> network_base.AdapterNetwork:
        """The ``--network_module`` type's network for these models (from ``--network_weights`` with
        ``--dim_from_weights``); not yet applied."""
        module_names = self.unet_module_names(models)
        network_type = registry.network_type(args.network_module)
        network_args = network_base.parse_network_args(args.network_args)
        if args.dim_from_weights:
            weights = network_base.read_lora_file(args.network_weights)
            network = network_type.create_network_from_weights(1.0, weights, models.text_encoders, models.unet,
                                                               module_names, **network_args)
            network.load_weights(args.network_weights)
            return network
        return network_type.create_network(
            1.0,
            args.network_dim,
            args.network_alpha,
            models.vae,
            models.text_encoders,
            models.unet,
            neuron_dropout=args.network_dropout,
            unet_module_names=module_names,
            **network_args,
        )

    def place_models(
        self, args: argparse.Namespace, models: StableDiffusionModels, device: torch.device,
        autocast_dtype: torch.dtype, train_text_encoder: bool,
    ) -> None:
        """Frozen weights go to the device in the autocast dtype (less memory, no per-step cast);
        float8 weights (``--fp8_base``) stay float8."""
        for model in [models.unet, models.vae, *models.text_encoders]:
            model.requires_grad_(False)
        for model in [models.unet, *models.text_encoders]:
            fp8_base.move(model, device, autocast_dtype)
        vae_dtype = torch.float32 if args.no_half_vae else autocast_dtype
        torch.nn.Module.to(models.vae, device, dtype=vae_dtype)
        models.vae.eval()
        models.unet.eval()
        for text_encoder in models.text_encoders:
            text_encoder.eval()

    def enable_gradient_checkpointing(self, models: StableDiffusionModels, train_text_encoder: bool) -> None:
        # diffusers/transformers only checkpoint in training mode; the models have no dropout.
        models.unet.enable_gradient_checkpointing()
        models.unet.train()
        if train_text_encoder:
            for text_encoder in models.text_encoders:
                text_encoder.gradient_checkpointing_enable()
                text_encoder.train()

    def plan_loss(
        self, run: "LossContext", batch: dict[str, Any], epoch: int, timesteps: Optional[torch.Tensor] = None
    ) -> losses.BatchWeights:
        """The batch's loss weights (per-sample, SNR, mask) without running the model; ``timesteps``
        (long (B,)) replaces the keyed draw (validation's fixed timesteps)."""
        if "latents" in batch:
            latent_hw = tuple(batch["latents"].shape[2:])
        else:
            latent_hw = (batch["images"].shape[2] // 8, batch["images"].shape[3] // 8)
        if timesteps is None:
            timesteps = noise.draw_timesteps(
                run.args.seed, epoch, batch["sample_indices"].tolist(), run.noise_scheduler.config.num_train_timesteps,
                run.args.min_timestep, run.args.max_timestep,
            )
        masks = batch.get("alpha_masks")
        mask = None if masks is None else losses.mask_to_latent(masks, latent_hw)
        channels = run.models.unet.config.in_channels
        return losses.batch_weights(
            run.loss_options, run.noise_scheduler.alphas_cumprod, timesteps, batch["loss_weights"],
            (channels, *latent_hw), mask,
        )

    def compute_loss(
        self, run: "LossContext", batch: dict[str, Any], epoch: int, plan: losses.BatchWeights,
        timesteps: Optional[torch.Tensor] = None, seed: Optional[int] = None,
    ) -> losses.WeightedLoss:
        """The batch's weighted fp32 loss sum: encode, add keyed noise, predict, compare with the target.

        The latent sample and the noise are keyed by (``seed`` or ``--seed``, ``epoch``, sample);
        ``timesteps`` (long (B,), those ``plan`` was made with) replaces the keyed timestep draw.
        """
        args, models, device = run.args, run.models, run.device
        seed = args.seed if seed is None else seed
        sample_indices = batch["sample_indices"].tolist()
        with torch.no_grad():
            if "latents" in batch:  # cached VAE mean/std: the same keyed sample as encode_latents
                latents = cached_latents.sample_cached_latents(batch, seed, epoch).to(device)
            else:
                latents = encode_latents(models.vae, batch["images"], seed, epoch, sample_indices)
        if "text_encoder_outputs" in batch:  # cached SDXL conditioning (text encoders frozen)
            conditioning = tuple(tensor.to(device) for tensor in batch["text_encoder_outputs"])
        else:
            with nullcontext() if run.train_text_encoder else torch.no_grad():
                conditioning = self.encode_prompts(args, models, batch["captions"])
        drawn = noise.draw_diffusion_noise(
            seed, epoch, sample_indices, tuple(latents.shape[1:]), run.noise_scheduler.config.num_train_timesteps,
            options=run.noise_options, latents=latents,
        ).to(device)
        if timesteps is not None:
            drawn = replace(drawn, timesteps=timesteps.to(device))
        noisy_latents = run.noise_scheduler.add_noise(latents, drawn.input_noise, drawn.timesteps)
        with compatibility.offloaded_activations(args, device):
            prediction = self.predict(models, noisy_latents, drawn.timesteps, conditioning, batch)
        target = losses.diffusion_target(run.noise_scheduler, latents, drawn.noise, drawn.timesteps,
                                         args.v_parameterization)
        result = losses.batch_loss(prediction, target, plan, run.loss_options)
        if run.debiased is not None and torch.is_grad_enabled():  # training steps (not validation, not probes)
            self.add_base_loss(run, batch, noisy_latents, drawn.timesteps, conditioning, target, plan, result)
        if run.check_inputs:  # the inputs a sample brings: its latents, and the text conditioning when frozen
            frozen_conditioning = () if run.train_text_encoder and "text_encoder_outputs" not in batch else (conditioning,)
            result.inputs_finite = healing.inputs_finite(latents, *frozen_conditioning)
        return result

    def add_base_loss(self, run: "LossContext", batch: dict[str, Any], noisy_latents: torch.Tensor,
                      timesteps: torch.Tensor, conditioning: Any, target: torch.Tensor, plan: losses.BatchWeights,
                      result: losses.WeightedLoss) -> None:
        """``--debiased_loss``: the same inputs through the base model (library/debiased_loss.py)."""
        with run.debiased.base_model():
            if run.train_text_encoder and "text_encoder_outputs" not in batch:
                conditioning = self.encode_prompts(run.args, run.models, batch["captions"])
            with compatibility.offloaded_activations(run.args, run.device):
                prediction = self.predict(run.models, noisy_latents, timesteps, conditioning, batch)
            base = losses.batch_loss(prediction, target, plan, run.loss_options)
        run.debiased.add(result.per_sample, base.per_sample)

    def validation_loss(
        self, run: "LossContext", batch: dict[str, Any], timesteps: torch.Tensor, epoch: int, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch's normalised loss at ``timesteps`` (long (B,)) with draws keyed by (``seed``, ``epoch``),
        through the training loss path, and its weight sum (``library.validation.BatchLoss``)."""
        plan = self.plan_loss(run, batch, epoch, timesteps)
        with run.autocast:
            result = self.compute_loss(run, batch, epoch, plan, timesteps=timesteps, seed=seed)
        return losses.normalize(result.loss_sum, result.weight_sum), result.weight_sum

    def optimizer_step(self, args, optimizer, lr_scheduler, scaler, trainable_params, loss: float) -> None:
        """Unscale, clip, step; the LR schedule advances only when the optimizer really stepped (the
        scaler's ``last_step_skipped`` tells the caller; the schedule sees the step's ``loss``:
        reduce_lr_on_plateau)."""
        if scaler is not None:
            scaler.unscale_(optimizer)
        if args.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(trainable_params, args.max_grad_norm)
        if scaler is not None:
            stepped = scaler.step(optimizer)  # False: an inf/NaN gradient (on any process), step skipped
            scaler.update()
        else:
            optimizer.step()
            stepped = True
        if stepped:
            optimizers.step_schedule(lr_scheduler, loss)
        optimizer.zero_grad(set_to_none=True)


def in_autocast_dtype(hidden_states: torch.Tensor) -> torch.Tensor:
    """Text encoder hidden states cast once to the active autocast dtype, as kohya casts them to the
    weight dtype; without it autocast casts them again in every cross-attention key/value projection
    and its LoRA (542 casts per full-size SDXL step). The same values either way. Left as they are
    when they carry gradients (a text encoder trains): the sum of their gradients stays in float32."""
    device_type = hidden_states.device.type
    if hidden_states.requires_grad or not torch.is_autocast_enabled(device_type):
        return hidden_states
    return hidden_states.to(torch.get_autocast_dtype(device_type))


def tokenize(tokenizer, captions: list[str]) -> torch.Tensor:
    """77-token ids (batch, 77); chunked tokenisation is ``text_encoding.tokenize``."""
    return text_encoding.tokenize(tokenizer, captions)[:, 0]


def encode_latents(vae, images: torch.Tensor, seed: int, epoch: int, sample_indices: list[int]) -> torch.Tensor:
    """Scaled VAE latents in fp32, sampled with keyed noise so each image's sample is reproducible."""
    distribution = vae.encode(images.to(vae.device, dtype=vae.dtype)).latent_dist
    mean, std = distribution.mean.float(), distribution.std.float()
    eps = noise.draw_latent_samples(seed, epoch, sample_indices, tuple(mean.shape[1:])).to(mean.device)
    return (mean + std * eps) * vae.config.scaling_factor


def debiased_scalars(run: Run) -> dict[str, float]:
    """The step's ``--debiased_loss`` scalars ({} without the option)."""
    return run.loss.debiased.take(run.accelerator) if run.loss.debiased is not None else {}


def max_norm_scalars(stats: network_base.MaxNormStats) -> dict[str, float]:
    """kohya's tracker scalars of ``--scale_weight_norms``. Reading them is a second host sync
    per step, paid only when the option is on (the stats exist only after the optimizer step)."""
    keys_scaled, mean_norm, max_norm = torch.stack(
        [stats.keys_scaled.float(), stats.mean_norm.float(), stats.max_norm.float()]).tolist()
    return {"max_norm/keys_scaled": keys_scaled, "max_norm/average_key_norm": mean_norm,
            "max_norm/max_key_norm": max_norm}


def weights_finite(network: torch.nn.Module) -> bool:
    """Whether every trainable weight is finite (a host sync: only on the non-finite-loss path)."""
    parameters = [parameter for parameter in network.parameters() if parameter.requires_grad]
    return bool(torch.stack([torch.isfinite(parameter).all() for parameter in parameters]).all())


def shared_random_seed(accelerator: Accelerator) -> int:
    """A random seed for a run without ``--seed``, the same on every process (drawn by the main one)."""
    seed = [random.randint(0, 2**31 - 1)]
    if accelerator.num_processes > 1:
        broadcast_object_list(seed)
    return seed[0]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def main(trainer_class: type = NetworkTrainer, parser_factory=setup_parser, argv: Optional[list[str]] = None) -> None:
    """Parse the command line (and ``--config_file``) and train."""
    parser = parser_factory()
    args, explicit = config_file.parse_args(parser, argv)
    fault_injection.simulate_full_disk(args)
    trainer_class().train(args, explicit)


if __name__ == "__main__":
    exit_on_user_error(main)

