"""Per-sample noise and timesteps drawn from generators keyed by (seed, epoch, sample index).

A sample gets the same noise, timestep and latent sample whatever batch size,
accumulation or process count it lands in, which makes runs reproducible across
hardware layouts and resumes exact. Draws happen on the CPU (bit-identical on every
device) and are then moved to the training device.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

import torch

from library.errors import UserError

# Distinct streams for the different draws of one sample.
_STREAM_DIFFUSION = 1
_STREAM_LATENT = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--noise_offset", type=float, default=None,
                        help="add a per-channel offset of this strength to the noise (kohya; e.g. 0.0357; default off)")
    parser.add_argument("--min_timestep", type=int, default=None, help="lowest timestep sampled (default 0)")
    parser.add_argument("--max_timestep", type=int, default=None, help="timestep bound, exclusive (default 1000)")


def sample_generator(seed: int, epoch: int, sample_index: int, stream: int) -> torch.Generator:
    """A CPU generator determined only by its key."""
    # Mix the key into one 63-bit seed (splitmix64-style constants spread nearby keys apart).
    mixed = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + sample_index * 0x94D049BB133111EB + stream) & (
        (1 << 63) - 1
    )
    return torch.Generator("cpu").manual_seed(mixed)


@dataclass
class DiffusionNoise:
    noise: torch.Tensor
    timesteps: torch.Tensor


def draw_diffusion_noise(
    seed: int,
    epoch: int,
    sample_indices: list[int],
    latent_shape: tuple[int, ...],
    num_train_timesteps: int,
    min_timestep: Optional[int] = None,
    max_timestep: Optional[int] = None,
    noise_offset: Optional[float] = None,
) -> DiffusionNoise:
    """Noise of ``(batch,) + latent_shape`` and integer timesteps, one keyed draw per sample."""
    low = 0 if min_timestep is None else min_timestep
    high = num_train_timesteps if max_timestep is None else max_timestep
    noises, timesteps = [], []
    for sample_index in sample_indices:
        generator = sample_generator(seed, epoch, sample_index, _STREAM_DIFFUSION)
        noise = torch.randn(latent_shape, generator=generator)
        if noise_offset:
            offset = torch.randn((latent_shape[0], 1, 1), generator=generator)
            noise = noise + noise_offset * offset
        noises.append(noise)
        timesteps.append(int(torch.randint(low, high, (1,), generator=generator)))
    return DiffusionNoise(torch.stack(noises), torch.tensor(timesteps, dtype=torch.long))


def draw_latent_samples(seed: int, epoch: int, sample_indices: list[int], shape: tuple[int, ...]) -> torch.Tensor:
    """Standard normal draws for sampling the VAE's latent distribution, one per sample."""
    return torch.stack(
        [torch.randn(shape, generator=sample_generator(seed, epoch, i, _STREAM_LATENT)) for i in sample_indices]
    )


def validate_arguments(args: argparse.Namespace, num_train_timesteps: int) -> None:
    low = 0 if args.min_timestep is None else args.min_timestep
    high = num_train_timesteps if args.max_timestep is None else args.max_timestep
    if not 0 <= low < high <= num_train_timesteps:
        raise UserError(
            f"--min_timestep {args.min_timestep} / --max_timestep {args.max_timestep}: need 0 <= min < max <= {num_train_timesteps}"
        )


def training_noise_scheduler():
    """The DDPM schedule SD/SDXL were trained with (kohya's fixed choice for LoRA training)."""
    from diffusers import DDPMScheduler

    return DDPMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000, clip_sample=False
    )
