"""LoRA training for Stable Diffusion 1.x/2.x, and the trainer shared with SDXL.

Flags, defaults and output files follow kohya-ss sd-scripts. The loop reads top to
bottom: batch -> noise -> forward -> loss -> backward -> guard -> step -> log -> save;
each concern it touches lives in one ``library/`` module.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import math
import os
import random
import sys
from contextlib import nullcontext
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Optional

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, broadcast_object_list, send_to_device
from tqdm import tqdm

from library import (
    compatibility, config_file, fault_injection, flat_gradients, fp8_base, grad_guard, lora_files, loss_scaling, losses,
    model_loading, noise, optimizers, torch_compile,
)
from library import lora_metadata, preflight, sampling, sharding, text_encoding, tracking, train_state, validation
from library.datasets import caching as dataset_caching, dataset as datasets, latents as cached_latents
from library.errors import ArgumentParser, UserError, exit_on_user_error
from library.grad_log import GradientLog, install_flush_handlers
from library.interrupts import StopRequest
from library.model_loading import StableDiffusionModels
from networks import merge_lora, network_base, registry

NOTHING_TO_TRAIN = "--unet_lr/--text_encoder_lr: every trained part has learning rate 0, nothing would train"
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
    lora_files.add_arguments(parser)
    lora_metadata.add_arguments(parser)
    add_training_arguments(parser)
    fp8_base.add_arguments(parser)
    tracking.add_arguments(parser)
    add_network_arguments(parser)
    noise.add_arguments(parser)
    losses.add_arguments(parser)
    optimizers.add_arguments(parser)
    grad_guard.add_arguments(parser)
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
    if args.learning_rate is not None and not args.learning_rate > 0:
        raise UserError(f"--learning_rate {args.learning_rate} must be a positive number")
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
    registry.validate(args.network_module, network_base.parse_network_args(args.network_args))
    if (args.network_train_text_encoder_only or args.unet_lr == 0) and (
            args.network_train_unet_only or (args.text_encoder_lr and all(lr == 0 for lr in args.text_encoder_lr))):
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
    compatibility.refuse_unsupported(args)
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
    loss_scaling.validate_arguments(args)
    losses.validate_arguments(args)
    sampling.validate_arguments(args)
    validation.validate_arguments(args)
    for flag in ("save_last_n_steps_state", "save_last_n_epochs_state"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            raise UserError(f"--{flag} {getattr(args, flag)} must be a positive integer")
    grad_guard.validate_arguments(args)
    noise.validate_arguments(args, noise.training_noise_scheduler(args.zero_terminal_snr).config.num_train_timesteps)
    fault_injection.parse_injections(args.debug_inject_grad)
    preflight.check_output_paths(args)
    if not args.debug_dataset:  # it shows the dataset and stops: no model, no LoRA read (as in kohya)
        preflight.check_input_files(args)
        model_loading.check_model_paths(args, sdxl=sdxl)


@dataclass
class LossContext:
    """What computing a batch's loss needs, fixed for the whole run."""

    args: argparse.Namespace
    models: StableDiffusionModels
    noise_scheduler: Any
    noise_options: noise.NoiseOptions
    loss_options: losses.LossOptions
    autocast: Any
    train_text_encoder: bool
    device: torch.device


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
        validate_arguments(args, sdxl=self.is_sdxl)
        tracking.setup_console_log(args)
        compatibility.apply_aliases(args)
        sampling.drop_unused_prompt_file(args)  # before loading: decides whether sampling keeps the VAE/text encoders
        grad_guard.apply_preset(args, explicit)
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

        min_bucket_steps = 32 if self.is_sdxl else 64
        dataset = datasets.build_dataset(args, min_bucket_steps)
        validation_dataset = datasets.build_validation_dataset(args, dataset, min_bucket_steps)
        if args.debug_dataset:  # captions as at the start of training (token warm-up)
            dataset.step_layout = datasets.StepLayout(args.gradient_accumulation_steps, 1, args.max_train_steps)
            for line in dataset.describe_epoch(1):
                print(line)
            return
        device = accelerator.device
        autocast_dtype = MIXED_PRECISION_DTYPES[args.mixed_precision]

        models = self.load_models(args)
        compatibility.select_attention(args, models.unet, device.type, announce=print)
        if args.base_weights:
            merge_lora.merge_base_weights(models, args.base_weights, args.base_weights_multiplier)
        fp8_base.store_frozen_weights(args, models, autocast_dtype)  # before the network wraps the layers
        noise_scheduler = noise.training_noise_scheduler(args.zero_terminal_snr)
        network = self.create_network(args, models)
        train_unet = not args.network_train_text_encoder_only
        train_text_encoder = not args.network_train_unet_only
        network.apply_to(apply_text_encoder=train_text_encoder, apply_unet=train_unet)
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
        dataset_caching.cache_before_training(args, dataset, models, accelerator, autocast_dtype, validation_dataset)
        if args.gradient_checkpointing:
            self.enable_gradient_checkpointing(models, train_text_encoder)

        param_groups = network.prepare_optimizer_params(
            args.text_encoder_lr, args.unet_lr, args.learning_rate,
            network_base.loraplus_ratios(network_base.parse_network_args(args.network_args)))
        if not param_groups:  # e.g. more --text_encoder_lr values than encoders, the used ones 0
            raise UserError(NOTHING_TO_TRAIN)
        trainable_params = [p for group in param_groups for p in group["params"]]
        gradients = flat_gradients.FlatGradients(trainable_params)  # each step's .grad views of one buffer
        optimizer_name, optimizer_args, optimizer = optimizers.build_optimizer(args, param_groups)

        num_workers = min(args.max_data_loader_n_workers, os.cpu_count() or 1)
        sampler = sharding.ShardSampler(dataset, accelerator.process_index, accelerator.num_processes)
        dataloader = sharding.train_loader(dataset, sampler, num_workers, args.persistent_data_loader_workers,
                                           args.seed)
        steps_per_epoch = math.ceil(len(dataloader) / args.gradient_accumulation_steps)
        if args.max_train_epochs is not None:
            args.max_train_steps = args.max_train_epochs * steps_per_epoch
        num_epochs = math.ceil(args.max_train_steps / steps_per_epoch)
        lora_files.apply_epoch_ratio(args, num_epochs)
        dataset.step_layout = datasets.StepLayout(args.gradient_accumulation_steps, accelerator.num_processes,
                                                  args.max_train_steps)
        validator = validation.create(args, validation_dataset, accelerator, noise_scheduler.config.num_train_timesteps,
                                      num_workers)
        lr_scheduler = optimizers.build_lr_scheduler(args, optimizer, args.max_train_steps)
        scaler = loss_scaling.create_loss_scaler(args, device)
        guard = grad_guard.GradGuard(grad_guard.GuardConfig.from_args(args), announce=tqdm.write)
        agree = (lambda skip: grad_guard.agree_across_processes(skip, accelerator)) if accelerator.num_processes > 1 else None
        injections = fault_injection.parse_injections(args.debug_inject_grad)
        grad_log = GradientLog.from_args(args, with_scale=scaler is not None) if accelerator.is_main_process else None
        log_cosine = grad_log is not None and grad_log.with_cosine
        monitor = grad_guard.GradientMonitor(gradients, cosine=log_cosine, unscaled=args.grad_norm_unscaled)

        # -- resume -------------------------------------------------------------------------
        store = train_state.StateStore(
            args.output_dir, args.output_name, train_state.protected_arguments(args, accelerator.num_processes),
            save_dtype=lora_files.SAVE_DTYPES[args.save_precision],
            before_rename=fault_injection.state_write_hook(args.debug_kill_in_state_write),
        )
        progress_state = train_state.Progress(
            seed=args.seed, training_started_at=lora_metadata.wall_clock(),
            session_id=random.Random(args.seed).randint(0, 2**32),
        )
        stateful = {"optimizer": optimizer, "lr_scheduler": lr_scheduler, "grad_guard": guard, "grad_monitor": monitor}
        if scaler is not None:
            stateful["loss_scaler"] = scaler
        states = train_state.RunStates(store, network, stateful)
        resumed = states.resume(args.resume, device)
        if resumed and (args.initial_step is not None or args.initial_epoch is not None):
            print("--initial_step/--initial_epoch: ignored, the run continues at the resumed state's step")
        progress_state = resumed or train_state.initial_progress(args, steps_per_epoch, progress_state)
        resume_step = progress_state.global_step if resumed else None  # logs keep their rows up to it
        if grad_log is not None:
            grad_log.start(resume_step=resume_step)

        def save_state(name: str) -> bool:
            return states.save(name, progress_state)

        keep_step_states, keep_epoch_states = train_state.kept_states(args)

        metadata = {} if not accelerator.is_main_process else lora_metadata.run_metadata(  # only the main process writes
            args,
            models.kind,
            dataset,
            {
                "session_id": progress_state.session_id,
                "training_started_at": progress_state.training_started_at,
                "num_train_images": dataset.num_train_images,
                "num_reg_images": dataset.num_reg_images,
                "num_validation_images": validation_dataset.num_train_images if validation_dataset else 0,
                "num_batches_per_epoch": len(dataloader),
                "num_epochs": num_epochs,
                "optimizer": optimizer_name + (f"({optimizer_args})" if optimizer_args else ""),
                "network_args": network_base.parse_network_args(args.network_args),
                "total_batch_size": args.train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps,
            },
        )
        writer = lora_files.LoraWriter(args, metadata)
        tracking.init_trackers(accelerator, args)
        jsonl = None
        if args.log_jsonl and accelerator.is_main_process:
            jsonl = tracking.JsonlLog(args.log_jsonl, resume_step)

        print(
            f"training: {dataset.num_train_images} images, {len(dataloader)} batches per epoch, "
            f"{num_epochs} epochs, {args.max_train_steps} optimizer steps, mixed precision {args.mixed_precision} "
            f"on {device.type}"
        )
        run = LossContext(
            args, torch_compile.compiled_for_training(args, models, train_unet, train_text_encoder), noise_scheduler,
            noise.NoiseOptions.from_args(args), losses.LossOptions.from_args(args),
            torch.autocast(device.type, dtype=autocast_dtype, enabled=args.mixed_precision != "no"),
            # a text encoder whose LoRA has learning rate 0 runs without recording gradients
            train_text_encoder and any(p.requires_grad for module in network.text_encoder_loras
                                       for p in module.parameters()),
            device,
        )
        progress = tqdm(
            total=args.max_train_steps, initial=progress_state.global_step, desc="steps",
            disable=not accelerator.is_local_main_process,
        )
        flush_logs = grad_log.flush if grad_log is not None else (lambda: None)
        remove_exit_flush = install_flush_handlers(flush_logs, signals=())
        stop = StopRequest(on_force=flush_logs)
        avr_loss = float("nan")

        def validate(kind: str, where: str) -> None:
            """A validation pass on every process; its scalars are logged at the current step like the step's."""
            scalars = validator.run(kind, network, functools.partial(self.validation_loss, run), avr_loss, where)
            accelerator.log(scalars, step=progress_state.global_step)
            if jsonl is not None:
                jsonl.append(progress_state.global_step, scalars)

        try:
            # Schedule-free optimizers: samples, validation and files see the averaged weights (eval
            # mode). A resumed state was saved in eval mode: train mode comes after this sample.
            with optimizers.averaged_weights(optimizer):
                sampling.sample_images(args, accelerator, models, network, device, when="first",
                                       step=progress_state.global_step)
            while progress_state.global_step < args.max_train_steps:
                epoch = progress_state.epoch
                first_step = progress_state.global_step - progress_state.batches_done // args.gradient_accumulation_steps
                dataset.set_epoch(epoch, first_step)
                sampler.start_at(progress_state.batches_done)
                network.train()
                batches = iter(dataloader)
                while progress_state.global_step < args.max_train_steps and not stop.requested:
                    window = [send_to_device(batch, device)
                              for batch in itertools.islice(batches, args.gradient_accumulation_steps)]
                    if not window:
                        break
                    window_loss = self.backward_window(run, window, epoch, accelerator, scaler)
                    sharding.sum_gradients_across_processes(gradients)
                    step = progress_state.global_step + 1
                    fault_injection.inject(injections, step, accelerator.process_index, trainable_params)
                    measured = monitor.measure(scale=scaler.get_scale() if scaler else None, loss=window_loss)
                    loss_value = measured.loss
                    decision = guard.decide(step, measured.norm, agree)
                    max_norm_logs = {}
                    if decision.skip:
                        optimizer.zero_grad(set_to_none=True)
                    else:
                        self.optimizer_step(args, optimizer, lr_scheduler, scaler, trainable_params)
                        if args.scale_weight_norms:
                            max_norm_logs = max_norm_scalars(network.apply_max_norm_regularization(args.scale_weight_norms))
                    progress_state.global_step = step
                    progress_state.batches_done += len(window)
                    avr_loss = progress_state.record_loss(loss_value, window=steps_per_epoch)
                    if grad_log is not None:
                        grad_log.append(
                            epoch=epoch, step=step, norm=measured.norm, threshold=decision.threshold,
                            loss=loss_value, thresh_off=decision.thresh_off,
                            scale=measured.scale if scaler else None, cosine=measured.cosine if log_cosine else None,
                        )
                    logs = self.report(args, accelerator, progress, progress_state, guard, scaler, lr_scheduler,
                                       loss_value, avr_loss, measured, decision, max_norm_logs)
                    if jsonl is not None:
                        jsonl.append(step, logs)
                    with optimizers.averaged_weights(optimizer):  # every step on every process, as kohya
                        if validator is not None and validator.due_after_step(step):  # before this step's state
                            validate("step", f"after step {step}")
                        if accelerator.is_main_process:
                            writer.on_step(network, step, epoch)
                            sampling.sample_images(args, accelerator, models, network, device, when="step",
                                                   step=step)
                            if args.save_state and args.save_every_n_steps and step % args.save_every_n_steps == 0:
                                flush_logs()
                                if save_state(train_state.step_state_name(args.output_name, step)):
                                    store.rotate("step", step, args.save_every_n_steps, keep_step_states)
                if stop.requested:
                    break
                if progress_state.batches_done >= len(dataloader):  # the epoch is complete
                    progress_state.epoch += 1
                    progress_state.batches_done = 0
                    with optimizers.averaged_weights(optimizer):
                        if validator is not None and validator.due_after_epoch(epoch):
                            validate("epoch", f"after epoch {epoch} (step {progress_state.global_step})")
                        if accelerator.is_main_process:
                            writer.on_epoch_end(network, progress_state.global_step, epoch,
                                                is_last_epoch=epoch == num_epochs)
                            sampling.sample_images(args, accelerator, models, network, device, when="epoch",
                                                   step=progress_state.global_step, epoch=epoch)
                            every = args.save_every_n_epochs
                            if args.save_state and every and epoch % every == 0 and epoch != num_epochs:
                                flush_logs()
                                if save_state(train_state.epoch_state_name(args.output_name, epoch)):
                                    store.rotate("epoch", epoch, every, keep_epoch_states)
        finally:
            progress.close()
            flush_logs()
            remove_exit_flush()
            stop.uninstall()
            if jsonl is not None:
                jsonl.close()
            accelerator.end_training()

        if stop.requested:
            if args.save_state and accelerator.is_main_process:
                saved = save_state(train_state.step_state_name(args.output_name, progress_state.global_step))
                print(f"interrupted at step {progress_state.global_step}; "
                      + ("state saved" if saved else "its state was refused (see above)")
                      + ". Resume with the same command plus --resume auto", flush=True)
            else:
                print(f"interrupted at step {progress_state.global_step}; no state saved (--save_state is off)",
                      flush=True)
            sys.exit(stop.exit_code)
        # schedule-free: the file holds the averaged weights (an interrupted run's state, above, stays in train mode)
        optimizers.enter_eval_mode(optimizer)
        if args.debug_report_weights:
            fault_injection.report_weights(accelerator.process_index, network.lora_state_dict())
        if accelerator.is_main_process:
            epoch = progress_state.epoch - (1 if progress_state.batches_done == 0 else 0)
            saved = writer.write(network, lora_files.final_file_name(args.output_name),
                                 progress_state.global_step, epoch)
            if args.save_state or args.save_state_on_train_end:  # kohya: --save_state also saves the last state
                save_state(train_state.final_state_name(args.output_name))
            if saved is None:
                sys.exit(1)
        print(f"done: {progress_state.global_step} steps, final average loss {avr_loss:.4f}, "
              f"skipped steps {guard.skipped_steps}")

    def backward_window(
        self, run: "LossContext", window: list[dict[str, Any]], epoch: int, accelerator: Accelerator, scaler,
    ) -> torch.Tensor:
        """Forward and backward every micro-batch of one accumulation window; returns the window's loss
        (a 0-dim tensor: the gradient monitor reads it in its one host sync per step).

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
        total = accelerator.reduce(window_loss_sum, reduction="sum")
        return losses.normalize(total, denominator)

    def report(self, args, accelerator, progress, progress_state, guard, scaler, lr_scheduler,
               loss_value: float, avr_loss: float, measured, decision, max_norm_logs: dict[str, float]
               ) -> dict[str, float]:
        """Progress bar postfix and tracker scalars of one optimizer step."""
        postfix = {"avr_loss": f"{avr_loss:.4f}"}
        if max_norm_logs:  # kohya's progress bar names
            postfix["Keys Scaled"] = int(max_norm_logs["max_norm/keys_scaled"])
            postfix["Average key norm"] = f"{max_norm_logs['max_norm/average_key_norm']:.4f}"
        if args.skip_grad_norm:
            postfix["skipped"] = guard.skipped_steps
        if progress_state.non_finite_losses:
            postfix["nonfinite"] = progress_state.non_finite_losses
        if scaler:
            postfix["overflows"] = scaler.overflow_count
        progress.set_postfix(postfix, refresh=False)
        progress.update(1)
        logs = {
            "loss/current": loss_value,
            "loss/average": avr_loss,
            "train/skipped_steps": guard.skipped_steps,
            "train/grad_norm": measured.norm,
            "train/grad_threshold": decision.threshold,
        }
        if scaler:
            logs["train/loss_scale"] = measured.scale
        if args.grad_cosine_log and args.grad_norm_log:
            logs["train/grad_cosine"] = measured.cosine
        for index, lr in enumerate(lr_scheduler.get_last_lr()):
            logs[f"lr/group{index}"] = lr
        logs.update(max_norm_logs)
        accelerator.log(logs, step=progress_state.global_step)
        return logs

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
        prediction = self.predict(models, noisy_latents, drawn.timesteps, conditioning, batch)
        target = losses.diffusion_target(run.noise_scheduler, latents, drawn.noise, drawn.timesteps,
                                         args.v_parameterization)
        return losses.batch_loss(prediction, target, plan, run.loss_options)

    def validation_loss(
        self, run: "LossContext", batch: dict[str, Any], timesteps: torch.Tensor, epoch: int, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch's normalised loss at ``timesteps`` (long (B,)) with draws keyed by (``seed``, ``epoch``),
        through the training loss path, and its weight sum (``library.validation.BatchLoss``)."""
        plan = self.plan_loss(run, batch, epoch, timesteps)
        with run.autocast:
            result = self.compute_loss(run, batch, epoch, plan, timesteps=timesteps, seed=seed)
        return losses.normalize(result.loss_sum, result.weight_sum), result.weight_sum

    def optimizer_step(self, args, optimizer, lr_scheduler, scaler, trainable_params) -> None:
        """Unscale, clip, step; the LR schedule advances only when the optimizer really stepped."""
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
            lr_scheduler.step()
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


def max_norm_scalars(stats: network_base.MaxNormStats) -> dict[str, float]:
    """kohya's tracker scalars of ``--scale_weight_norms``. Reading them is a second host sync
    per step, paid only when the option is on (the stats exist only after the optimizer step)."""
    keys_scaled, mean_norm, max_norm = torch.stack(
        [stats.keys_scaled.float(), stats.mean_norm.float(), stats.max_norm.float()]).tolist()
    return {"max_norm/keys_scaled": keys_scaled, "max_norm/average_key_norm": mean_norm,
            "max_norm/max_key_norm": max_norm}


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
    trainer_class().train(args, explicit)


if __name__ == "__main__":
    exit_on_user_error(main)
