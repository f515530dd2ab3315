"""The diffusion loss of a batch and the backward of an accumulation window.

batch -> latents (keyed VAE sample) -> conditioning -> keyed noise and timesteps -> UNet -> weighted
loss. ``hooks`` is the trainer: its model hooks (``encode_prompts``, ``predict``: the model family's)
and its ``plan_loss`` / ``compute_loss``, so a trainer subclass that overrides one of them is the one used.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from typing import Any, Callable, Optional, Protocol

import torch
from accelerate import Accelerator
from accelerate.utils import send_to_device

from library import compatibility, healing, inpainting, losses, noise
from library.datasets import latents as cached_latents
from library.model_loading import StableDiffusionModels
from library.training.run import LossContext


class LossHooks(Protocol):
    """What the loss path calls back into (``library.training.trainer.Trainer`` provides it)."""

    def encode_prompts(self, args: Any, models: StableDiffusionModels, captions: list[str]) -> Any: ...

    def predict(self, models: StableDiffusionModels, noisy_latents: torch.Tensor, timesteps: torch.Tensor,
                conditioning: Any, batch: dict[str, Any]) -> torch.Tensor: ...

    def plan_loss(self, run: LossContext, batch: dict[str, Any], epoch: int,
                  timesteps: Optional[torch.Tensor] = None) -> losses.BatchWeights: ...

    def compute_loss(self, run: LossContext, batch: dict[str, Any], epoch: int, plan: losses.BatchWeights,
                     timesteps: Optional[torch.Tensor] = None, seed: Optional[int] = None) -> losses.WeightedLoss: ...


def backward_window(
    hooks: LossHooks, run: LossContext, window: list[dict[str, Any]], epoch: int, accelerator: Accelerator, scaler,
    samples: Optional[healing.WindowSamples] = None, backward: Optional[Callable[[torch.Tensor], None]] = None,
) -> torch.Tensor:
    """Forward and backward every micro-batch of one accumulation window; returns the window's loss
    (a 0-dim tensor: the gradient monitor reads it in its one host sync per step). ``samples``
    collects each sample's loss and input finiteness, summed over processes with the window loss.
    ``backward``: what runs each micro-batch's (scaled) objective's backward (default
    ``accelerator.backward``; a fused backward keeps it for its measuring pass).

    The loss is normalised over the whole window and all processes (``--loss_normalization
    exact``): the weight denominator is known before the first backward, because weights
    depend only on the batches and their keyed timesteps, not on the model.
    """
    plans = [hooks.plan_loss(run, batch, epoch) for batch in window]
    local = losses.window_denominator(
        [plan.weight_sum for plan in plans], run.loss_options.loss_normalization, run.args.gradient_accumulation_steps
    )
    denominator = accelerator.reduce(local.to(run.device), reduction="sum")
    window_loss_sum = torch.zeros((), device=run.device)
    for batch, plan in zip(window, plans):
        with run.autocast:
            result = hooks.compute_loss(run, batch, epoch, plan)
        # Gradients are summed over processes afterwards, so each process's share of the
        # global sum / global denominator adds up to exactly the full-batch gradient.
        objective = losses.micro_batch_objective(result.loss_sum, denominator, 1.0)
        (backward or accelerator.backward)(scaler.scale(objective) if scaler else objective)
        window_loss_sum += result.loss_sum.detach()
        if samples is not None:
            samples.add(batch["sample_indices"], result.per_sample, result.inputs_finite, "padding" in batch)
    if samples is None:
        return losses.normalize(accelerator.reduce(window_loss_sum, reduction="sum"), denominator)
    samples.reduced = accelerator.reduce(samples.vector(window_loss_sum), reduction="sum")
    return losses.normalize(samples.reduced[0], denominator)


def plan_loss(run: LossContext, batch: dict[str, Any], epoch: int, timesteps: Optional[torch.Tensor] = None
              ) -> losses.BatchWeights:
    """The batch's loss weights (per-sample, SNR, mask) without running the model; ``timesteps``
    (long (B,)) replaces the keyed draw (validation's fixed timesteps), as do the batch's own
    ``timesteps`` (a trainable's batches: ``Trainable.training_data``)."""
    if timesteps is None:
        timesteps = batch.get("timesteps")
    if "latents" in batch:
        latent_hw = tuple(batch["latents"].shape[2:])
    elif "latent_distribution" in batch:  # a fixed batch encoded once (library/fixed_batches.py)
        latent_hw = tuple(batch["latent_distribution"][0].shape[2:])
    else:
        latent_hw = (batch["images"].shape[2] // 8, batch["images"].shape[3] // 8)
    if timesteps is None:
        timesteps = noise.draw_timesteps(
            run.args.seed, epoch, batch["sample_indices"].tolist(), run.noise_scheduler.config.num_train_timesteps,
            run.args.min_timestep, run.args.max_timestep,
        )
    masks = batch.get("alpha_masks")
    mask = None if masks is None else losses.mask_to_latent(masks, latent_hw)
    channels = run.models.unet.config.out_channels  # the latent channels (an inpainting UNet takes 9 in)
    return losses.batch_weights(
        run.loss_options, run.noise_scheduler.alphas_cumprod, timesteps, batch["loss_weights"],
        (channels, *latent_hw), mask,
    )


def compute_loss(
    hooks: LossHooks, run: LossContext, batch: dict[str, Any], epoch: int, plan: losses.BatchWeights,
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
        else:  # the VAE's distribution: a fixed batch's, encoded once (library/fixed_batches.py), or the images'
            distribution = (send_to_device(batch["latent_distribution"], device) if "latent_distribution" in batch
                            else latent_distribution(models.vae, batch["images"]))
            latents = sample_latents(distribution, models.vae.config.scaling_factor, seed, epoch, sample_indices)
        if run.inpainting:  # no cached latents (refused): the images are here
            masks = inpainting.training_masks(seed, epoch, sample_indices, *batch["images"].shape[2:])
            extra_input = inpainting.conditioning_channels(
                batch["images"].to(device), masks,
                lambda masked: encode_latents(models.vae, masked, seed, epoch, sample_indices)).to(device)
    if "text_encoder_outputs" in batch:  # cached conditioning (text encoders frozen): the dataset's, a fixed batch's
        conditioning = send_to_device(batch["text_encoder_outputs"], device)
    else:
        with nullcontext() if run.train_text_encoder else torch.no_grad():
            conditioning = hooks.encode_prompts(args, models, batch["captions"])
    drawn = noise.draw_diffusion_noise(
        seed, epoch, sample_indices, tuple(latents.shape[1:]), run.noise_scheduler.config.num_train_timesteps,
        options=run.noise_options, latents=latents,
    ).to(device)
    if timesteps is not None:
        drawn = replace(drawn, timesteps=timesteps.to(device))
    noisy_latents = run.noise_scheduler.add_noise(latents, drawn.input_noise, drawn.timesteps)
    unet_input = noisy_latents
    if run.inpainting:  # kohya's channel order: noisy latents, mask, masked-image latents
        unet_input = torch.cat([noisy_latents, extra_input.to(noisy_latents.dtype)], dim=1)
    with compatibility.offloaded_activations(args, device):
        prediction = hooks.predict(models, unet_input, drawn.timesteps, conditioning, batch)
    target = losses.diffusion_target(run.noise_scheduler, latents, drawn.noise, drawn.timesteps,
                                     args.v_parameterization)
    result = losses.batch_loss(prediction, target, plan, run.loss_options)
    if run.debiased is not None and torch.is_grad_enabled():  # training steps (not validation, not probes)
        add_base_loss(hooks, run, batch, unet_input, drawn.timesteps, conditioning, target, plan, result)
    if run.check_inputs:  # the inputs a sample brings: its latents, and the text conditioning when frozen
        frozen_conditioning = () if run.train_text_encoder and "text_encoder_outputs" not in batch else (conditioning,)
        result.inputs_finite = healing.inputs_finite(latents, *frozen_conditioning)
    return result


def add_base_loss(hooks: LossHooks, run: LossContext, batch: dict[str, Any], noisy_latents: torch.Tensor,
                  timesteps: torch.Tensor, conditioning: Any, target: torch.Tensor, plan: losses.BatchWeights,
                  result: losses.WeightedLoss) -> None:
    """``--debiased_loss``: the same inputs through the base model (library/debiased_loss.py)."""
    with run.debiased.base_model():
        if run.train_text_encoder and "text_encoder_outputs" not in batch:
            conditioning = hooks.encode_prompts(run.args, run.models, batch["captions"])
        with compatibility.offloaded_activations(run.args, run.device):
            prediction = hooks.predict(run.models, noisy_latents, timesteps, conditioning, batch)
        base = losses.batch_loss(prediction, target, plan, run.loss_options)
    run.debiased.add(result.per_sample, base.per_sample)


def validation_loss(
    hooks: LossHooks, run: LossContext, batch: dict[str, Any], timesteps: torch.Tensor, epoch: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's normalised loss at ``timesteps`` (long (B,)) with draws keyed by (``seed``, ``epoch``),
    through the training loss path, and its weight sum (``library.validation.BatchLoss``)."""
    plan = hooks.plan_loss(run, batch, epoch, timesteps)
    with run.autocast:
        result = hooks.compute_loss(run, batch, epoch, plan, timesteps=timesteps, seed=seed)
    return losses.normalize(result.loss_sum, result.weight_sum), result.weight_sum


def encode_latents(vae, images: torch.Tensor, seed: int, epoch: int, sample_indices: list[int]) -> torch.Tensor:
    """Scaled VAE latents in fp32, sampled with keyed noise so each image's sample is reproducible."""
    return sample_latents(latent_distribution(vae, images), vae.config.scaling_factor, seed, epoch, sample_indices)


def latent_distribution(vae, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's latent mean and std of ``images`` (unscaled, fp32, on the VAE's device)."""
    distribution = vae.encode(images.to(vae.device, dtype=vae.dtype)).latent_dist
    return distribution.mean.float(), distribution.std.float()


def sample_latents(distribution: tuple[torch.Tensor, torch.Tensor], scaling_factor: float, seed: int, epoch: int,
                   sample_indices: list[int]) -> torch.Tensor:
    """``(mean + std * eps) * scaling_factor`` with ``eps`` keyed by (``seed``, ``epoch``, sample), where the mean is."""
    mean, std = distribution
    eps = noise.draw_latent_samples(seed, epoch, sample_indices, tuple(mean.shape[1:])).to(mean.device)
    return (mean + std * eps) * scaling_factor


def fixed_batch_encoder(hooks: LossHooks, run: LossContext) -> Optional[Callable[[dict[str, Any]], dict[str, Any]]]:
    """What encodes a batch scored again and again once (``library.fixed_batches``), or None when its inputs
    must be encoded at every pass: inpainting (its masked images are drawn anew for every timestep) or a
    VAE with a trainable weight (none here trains one; checked, not assumed)."""
    vae = run.models.vae
    if run.inpainting or (vae is not None and any(parameter.requires_grad for parameter in vae.parameters())):
        return None
    return lambda batch: encode_fixed_batch(hooks, run, batch)


def encode_fixed_batch(hooks: LossHooks, run: LossContext, batch: dict[str, Any]) -> dict[str, Any]:
    """``batch`` with what the frozen models make of it computed now, as ``compute_loss`` computes it (the
    same calls, under the same autocast: a pass on the result gives the same bits): the VAE's latent
    distribution (``latent_distribution``) in place of the images and, when nothing in the text encoders'
    forward can change (``run.text_encoding_fixed``), the conditioning (``text_encoder_outputs``) beside the
    captions. Kept where the batch is (a validation batch on the CPU). ``batch`` itself is not changed."""
    encoded = dict(batch)
    place = batch["sample_indices"].device
    with torch.no_grad(), run.autocast:
        if "images" in batch and "latents" not in batch:
            encoded["latent_distribution"] = send_to_device(latent_distribution(run.models.vae, batch["images"]), place)
            del encoded["images"]
        if run.text_encoding_fixed and "captions" in batch and "text_encoder_outputs" not in batch:
            encoded["text_encoder_outputs"] = send_to_device(
                hooks.encode_prompts(run.args, run.models, batch["captions"]), place)
    return encoded
