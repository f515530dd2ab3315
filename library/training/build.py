"""Building a run: options resolved, data, models with what trains attached, optimization, states
(resumed) and outputs. ``trainer`` supplies the model family's hooks and the trainable; every
builder here is shared by every trainer.
"""
from __future__ import annotations

import argparse
import functools
import random
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterable, Optional, Protocol

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, broadcast_object_list
from tqdm import tqdm

from library import (
    best_checkpoint, compatibility, debiased_loss, ema, fault_injection, flat_gradients, fp8_base, fused_backward,
    grad_guard, healing, healthy_point, inpainting, lora_files, lora_metadata, loss_scaling, losses, nan_report,
    noise, optimizers, preflight, sampling, torch_compile, tracking, train_state, validation,
)
from library.datasets import caching as dataset_caching, dataset as datasets
from library.errors import UserError
from library.fixed_batches import FixedBatches
from library.model_loading import StableDiffusionModels
from library.run_data import TrainingData
from library.run_outputs import RunOutputs
from library.trainables.base import Trainable
from library.training.config import TrainingConfig
from library.training import gradient_step as step_paths
from library.training.families import StableDiffusionFamily
from library.training.run import LossContext, Optimization, Run
from networks import merge_lora

MIXED_PRECISION_DTYPES = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class Trainer(Protocol):
    """What the builders use of ``library.training.trainer.Trainer`` (its subclasses may override these)."""

    family: StableDiffusionFamily
    trainable: Trainable

    def validate_arguments(self, args: argparse.Namespace) -> None: ...

    def load_models(self, args: argparse.Namespace) -> StableDiffusionModels: ...

    def unet_module_names(self, models: StableDiffusionModels) -> Optional[dict[str, str]]: ...

    def capture_healthy_point(self, states: train_state.RunStates, healer: healing.HealingPolicy,
                              progress: train_state.Progress) -> None: ...

    def fixed_batches(self, run: LossContext, source: Iterable[dict[str, Any]]) -> FixedBatches: ...


def build_run(trainer: Trainer, args: argparse.Namespace, explicit: set[str]) -> Optional[Run]:
    """Options resolved, data, models, what trains, optimization, state (resumed) and outputs; None
    after ``--debug_dataset`` has printed the batches."""
    family, trainable = trainer.family, trainer.trainable
    accelerator = resolve_options(trainer, args, explicit)
    trainable.configure(args)  # its options, final now (aliases, presets applied)
    resume_from = train_state.find_resume_state(args, accelerator.num_processes, family.is_sdxl)  # before any model load
    data = trainable.training_data(args, accelerator)  # None: the image dataset of the options
    if data is None:
        data = build_data(args, accelerator, family.min_bucket_steps)
    if data is None:
        return None
    ema.check_steps(args, args.max_train_steps)  # the steps are known once the data is
    models, loss = build_model(trainer, args, accelerator, data)
    optimization = build_optimization(args, accelerator, trainable, data)
    config = TrainingConfig.from_args(args)  # every option is final now (epochs -> steps, epoch ratio)
    # where the writer puts the best file: a trainable writing whole models names it in its own format
    output_path = getattr(trainable, "output_path", functools.partial(lora_files.output_path, args))
    best = best_checkpoint.create(args, data.validation_dataset is not None,
                                  output_path(best_checkpoint.best_file_name(args.output_name)),
                                  accelerator.is_main_process)
    states, progress, resume_step, captured = build_state(trainer, args, accelerator, optimization, data,
                                                          resume_from, best)
    validator = validation.create(args, data.validation_dataset, accelerator,
                                  loss.noise_scheduler.config.num_train_timesteps, data.num_workers,
                                  functools.partial(trainer.fixed_batches, loss))
    metadata = {} if not accelerator.is_main_process else trainable.metadata(
        args, accelerator, models, data, optimization, progress)
    print(f"training: {data.dataset.num_train_images} {data.dataset.unit}, {len(data)} batches per epoch, {data.num_epochs} "
          f"epochs, {args.max_train_steps} optimizer steps, mixed precision {args.mixed_precision} "
          f"on {accelerator.device.type}")
    outputs = RunOutputs(args, accelerator, with_scaler=optimization.scaler is not None,
                         total_steps=args.max_train_steps, initial_step=progress.global_step,
                         resume_step=resume_step)
    if captured:
        outputs.event(progress.global_step, "healthy", "")  # the initial healthy point (the tools read it)
    writer = trainable.writer(args, metadata, optimization.ema, optimization.healer.metadata,
                              resumed=resume_from is not None)
    trainable.start(args, accelerator.is_main_process)
    return Run(args, config, accelerator, models, trainable, data, loss, optimization, states, progress, validator,
               writer, outputs, best=best)


def resolve_options(trainer: Trainer, args: argparse.Namespace, explicit: set[str]) -> Accelerator:
    """Check every option, apply aliases and presets, start accelerate and seed the RNGs."""
    trainer.validate_arguments(args)
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


def build_data(args: argparse.Namespace, accelerator: Accelerator, min_bucket_steps: int) -> Optional[TrainingData]:
    """The datasets (checked before any model loads) and this process's loader; None after
    ``--debug_dataset`` printed the first epoch as training would see it."""
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


def build_model(trainer: Trainer, args: argparse.Namespace, accelerator: Accelerator, data: TrainingData
                ) -> tuple[StableDiffusionModels, LossContext]:
    """Models loaded (base weights merged, fp8), what trains attached and placed, caches filled."""
    trainable = trainer.trainable
    device = accelerator.device
    autocast_dtype = MIXED_PRECISION_DTYPES[args.mixed_precision]
    models = trainer.load_models(args)
    inpainting.check_model(getattr(args, "train_inpainting", False), models.unet.config.in_channels,
                           args.pretrained_model_name_or_path)
    compatibility.select_attention(args, models.unet, device.type, announce=print)
    if args.base_weights:
        merge_lora.merge_base_weights(models, args.base_weights, args.base_weights_multiplier)
    fp8_base.store_frozen_weights(args, models, autocast_dtype)  # before the network wraps the layers
    noise_scheduler = noise.training_noise_scheduler(args.zero_terminal_snr)
    trainable.attach(models, trainer.unet_module_names(models))
    train_unet, train_text_encoder = trainable.parts()
    # a trainable that trains whole models places them itself (optional hook; the LoRA has none)
    place_models(args, models, device, autocast_dtype, getattr(trainable, "trained_models", list)())
    trainable.place(device, autocast_dtype)
    dataset_caching.cache_before_training(args, data.dataset, models, accelerator, autocast_dtype,
                                          data.validation_dataset)
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(models, train_text_encoder)
    loss = LossContext(
        args, torch_compile.compiled_for_training(args, models, train_unet, train_text_encoder), noise_scheduler,
        noise.NoiseOptions.from_args(args), losses.LossOptions.from_args(args),
        torch.autocast(device.type, dtype=autocast_dtype, enabled=args.mixed_precision != "no"),
        trainable.records_text_encoder_gradients(),
        device,
        check_inputs=args.quarantine_bad_samples,
        debiased=debiased_loss.create(args, trainable.module, device, data.steps_per_epoch),
        inpainting=getattr(args, "train_inpainting", False),
        text_encoding_fixed=not trainable.changes_text_conditioning(),
    )
    return models, loss


def build_optimization(args: argparse.Namespace, accelerator: Accelerator, trainable: Trainable,
                       data: TrainingData) -> Optimization:
    """The trainable's parameter groups, optimizer, schedule, loss scaler, guard, healing and EMA."""
    param_groups = trainable.param_groups()
    fused = fused_backward.FusedOptions.from_args(args, optimizers.effective_optimizer_type(args), announce=print) \
        if trainable.writes_models else fused_backward.FusedOptions()  # kohya: the full fine-tuners' options
    if fused.groups:  # kohya's split; one optimizer holds the groups, each stepped alone (GroupStep)
        param_groups = fused_backward.split_into_groups(param_groups, fused.groups)
    trainable_params = [p for group in param_groups for p in group["params"]]
    # each step's .grad views of one buffer (a whole model's accumulate into it: one copy of its gradients);
    # a fused backward never holds every gradient at once
    gradients = None if fused.enabled else flat_gradients.FlatGradients(
        trainable_params, accumulate_in_place=getattr(trainable, "accumulates_gradients_in_place", False))
    optimizer_name, optimizer_args, optimizer = optimizers.build_optimizer(args, param_groups)
    lora_files.apply_epoch_ratio(args, data.num_epochs)
    lr_scheduler = optimizers.build_lr_scheduler(args, optimizer, args.max_train_steps)
    scaler = loss_scaling.create_loss_scaler(args, accelerator.device)
    guard = grad_guard.GradGuard(grad_guard.GuardConfig.from_args(args), announce=tqdm.write)
    agree = (lambda skip: grad_guard.agree_across_processes(skip, accelerator)) if accelerator.num_processes > 1 else None
    if fused.enabled and args.grad_cosine_log:
        print(f"--grad_cosine_log: off with {fused.flag} (it keeps the previous step's whole gradient, the memory "
              f"the fused backward saves); the guard's norm is unchanged")
        args.grad_cosine_log = False
    log_cosine = accelerator.is_main_process and args.grad_norm_log and args.grad_cosine_log
    if fused.enabled:
        fused_pass = fused_backward.FusedBackward(
            [optimizer] if fused.fused_backward_pass else fused_backward.group_steps(optimizer),
            per_parameter=fused.fused_backward_pass, max_grad_norm=args.max_grad_norm, scaler=scaler,
            cosine=log_cosine, unscaled=args.grad_norm_unscaled, rounding_seed=args.seed,
            backward=lambda tensor, retain, inputs: accelerator.backward(tensor, retain_graph=retain, inputs=inputs),
            kept_gradient_bytes=fused_backward.kept_gradient_budget(fused.kept_gradient_gib, accelerator.device))
        monitor, gradient_step = fused_pass.monitor, step_paths.FusedStep(fused_pass, announce=tqdm.write)
    else:
        monitor = grad_guard.GradientMonitor(gradients, cosine=log_cosine, unscaled=args.grad_norm_unscaled)
        gradient_step = step_paths.UnfusedStep(accelerator)
    dataset = data.dataset
    healer = healing.HealingPolicy(healing.HealingConfig.from_args(args), len(dataset.plan.images),
                                   describe=lambda image: (dataset.plan.images[image].path,
                                                           dataset.plan.images[image].caption))
    return Optimization(trainable_params, gradients, optimizer, optimizer_name, optimizer_args, lr_scheduler,
                        scaler, guard, monitor, healer, agree,
                        fault_injection.parse_injections(args.debug_inject_grad), ema.create(args, trainable_params),
                        gradient_step=gradient_step)


def build_state(trainer: Trainer, args: argparse.Namespace, accelerator: Accelerator, optimization: Optimization,
                data: TrainingData, resume_from: Optional[Path], best: Optional[best_checkpoint.BestCheckpoint] = None
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
    place = healthy_point.HealthyPointPlace(
        optimization.healer.config.healthy_point_location,
        healthy_point.folder_path(args.output_dir, args.output_name) / healthy_point.file_name(
            accelerator.process_index),
        before_rename=fault_injection.state_write_hook(args.debug_kill_in_healthy_point_write))
    states = train_state.RunStates(store, trainer.trainable.module, stateful,
                                   not_captured=("healing", "best_checkpoint"), place=place)
    resumed = states.resume(resume_from, accelerator.device)
    if resumed and (args.initial_step is not None or args.initial_epoch is not None):
        print("--initial_step/--initial_epoch: ignored, the run continues at the resumed state's step")
    progress = resumed or train_state.initial_progress(args, data.steps_per_epoch, progress)
    healer = optimization.healer
    data.quarantined = healer.quarantined_images
    captured = healer.config.rewind_on_divergence and states.healthy_point is None
    if captured:
        trainer.capture_healthy_point(states, healer, progress)
    return states, progress, progress.global_step if resumed else None, captured


def place_models(args: argparse.Namespace, models: StableDiffusionModels, device: torch.device,
                 autocast_dtype: torch.dtype, trained: list[torch.nn.Module] = ()) -> None:
    """Frozen weights go to the device in the autocast dtype (less memory, no per-step cast);
    float8 weights (``--fp8_base``) stay float8. ``trained``: models the trainable places itself."""
    for model in [models.unet, models.vae, *models.text_encoders]:
        model.requires_grad_(False)
    for model in [models.unet, *models.text_encoders]:
        if not any(model is own for own in trained):
            fp8_base.move(model, device, autocast_dtype)
    vae_dtype = torch.float32 if args.no_half_vae else autocast_dtype
    torch.nn.Module.to(models.vae, device, dtype=vae_dtype)
    models.vae.eval()
    models.unet.eval()
    for text_encoder in models.text_encoders:
        text_encoder.eval()


def enable_gradient_checkpointing(models: StableDiffusionModels, train_text_encoder: bool) -> None:
    # diffusers/transformers only checkpoint in training mode; the models have no dropout.
    models.unet.enable_gradient_checkpointing()
    models.unet.train()
    if train_text_encoder:
        for text_encoder in models.text_encoders:
            text_encoder.gradient_checkpointing_enable()
            text_encoder.train()


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
