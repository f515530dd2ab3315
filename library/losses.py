"""Diffusion training targets and losses, always computed in fp32."""
from __future__ import annotations

import argparse

import torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--v_parameterization", action="store_true",
                        help="train v-prediction (SD2.x 768-v models) instead of epsilon prediction")


def diffusion_target(
    noise_scheduler, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor, v_parameterization: bool
) -> torch.Tensor:
    """What the UNet must predict: the noise, or the velocity for v-parameterisation."""
    if v_parameterization:
        return noise_scheduler.get_velocity(latents, noise, timesteps)
    return noise


def per_sample_loss(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error per sample, from fp32 copies whatever the autocast dtype."""
    squared_error = torch.nn.functional.mse_loss(prediction.float(), target.float(), reduction="none")
    return squared_error.mean(dim=list(range(1, squared_error.dim())))


def weighted_batch_loss(per_sample: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """kohya's reduction: per-sample losses times their weights (prior_loss_weight), averaged."""
    return (per_sample * weights.to(per_sample.device)).mean()
