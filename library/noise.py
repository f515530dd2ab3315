"""Per-sample noise and timesteps drawn from generators keyed by (seed, epoch, sample index).

A sample gets the same noise, timestep, noise offset, multires noise, input perturbation
and latent sample whatever batch size, accumulation or process count it lands in, which
makes runs reproducible across hardware layouts and resumes exact. Every draw of a sample
has its own stream, so switching one option on never changes the other draws. Draws
happen on the CPU in fp32 (bit-identical on every device) and are then moved to the
training device.

kohya draws one noise-offset strength, one multires scale per octave and one input
perturbation strength for the whole batch, and normalises multires noise by the batch's
std; here each of these is per sample (the only way to be batch-independent).

Entry points: :func:`add_arguments`, :func:`validate_arguments`,
:func:`training_noise_scheduler`, :class:`NoiseOptions`, :func:`draw_timesteps`,
:func:`draw_diffusion_noise`, :func:`draw_latent_samples`.
"""
from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from library.errors import UserError

logger = logging.getLogger(__name__)

# Distinct streams for the different draws of one sample (never renumber: it changes runs).
_STREAM_DIFFUSION = 1  # the base noise
_STREAM_LATENT = 2  # the VAE latent sample
_STREAM_TIMESTEP = 3
_STREAM_OFFSET = 4  # noise offset direction, then its random strength
_STREAM_MULTIRES = 5  # per octave: the scale factor, then the low-resolution noise
_STREAM_INPUT_PERTURBATION = 6  # ip_noise_gamma perturbation, then its random strength
STREAM_INPAINTING_MASK = 7  # --train_inpainting's random mask (library.inpainting)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--noise_offset", type=float, default=None,
        help="add a per-channel offset of this strength to the noise (kohya; e.g. 0.0357 or 0.1; default off)")
    add("--noise_offset_random_strength", action="store_true",
        help="use a random strength in [0, noise_offset) per sample (default: always noise_offset)")
    add("--adaptive_noise_scale", type=float, default=None,
        help="add |latent channel mean| times this value to the noise offset (needs --noise_offset; default off)")
    add("--multires_noise_iterations", type=int, default=None,
        help="add multi-resolution (pyramid) noise with this many octaves (kohya; 6-10 typical; default off)")
    add("--multires_noise_discount", type=float, default=0.3,
        help="weight of each coarser octave of multires noise (default 0.3)")
    add("--ip_noise_gamma", type=float, default=None,
        help="input perturbation: noise the latents with noise + gamma * extra noise, the target keeps the "
             "plain noise (arxiv 2301.11706; about 0.1; default off)")
    add("--ip_noise_gamma_random_strength", action="store_true",
        help="use a random strength in [0, ip_noise_gamma) per sample (default: always ip_noise_gamma)")
    add("--zero_terminal_snr", action="store_true",
        help="rescale the DDPM betas so the last timestep has zero SNR (arxiv 2305.08891; use with "
             "--v_parameterization)")
    add("--min_timestep", type=int, default=None, help="lowest timestep sampled (default 0)")
    add("--max_timestep", type=int, default=None,
        help="timestep bound, exclusive (default 1000); equal to --min_timestep: always that timestep")


@dataclass(frozen=True)
class NoiseOptions:
    """The noise flags, resolved. Built with :meth:`from_args`; the defaults mean plain noise."""

    min_timestep: Optional[int] = None
    max_timestep: Optional[int] = None
    noise_offset: Optional[float] = None
    noise_offset_random_strength: bool = False
    adaptive_noise_scale: Optional[float] = None
    multires_noise_iterations: Optional[int] = None
    multires_noise_discount: float = 0.3
    ip_noise_gamma: Optional[float] = None
    ip_noise_gamma_random_strength: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "NoiseOptions":
        return cls(**{name: getattr(args, name) for name in cls.__dataclass_fields__})


def validate_arguments(args: argparse.Namespace, num_train_timesteps: int) -> None:
    """Raise :class:`UserError` for an invalid noise flag; warn like kohya for odd combinations."""
    low = 0 if args.min_timestep is None else args.min_timestep
    high = num_train_timesteps if args.max_timestep is None else args.max_timestep
    if not (0 <= low <= high <= num_train_timesteps and low < num_train_timesteps):
        raise UserError(
            f"--min_timestep {args.min_timestep} / --max_timestep {args.max_timestep}: need "
            f"0 <= min <= max <= {num_train_timesteps} and min < {num_train_timesteps}"
        )
    if args.adaptive_noise_scale is not None and not args.noise_offset:
        raise UserError(f"--adaptive_noise_scale {args.adaptive_noise_scale} needs --noise_offset (e.g. 0.0357)")
    if args.multires_noise_iterations is not None and args.multires_noise_iterations < 0:
        raise UserError(f"--multires_noise_iterations {args.multires_noise_iterations}: need 0 (off) or more")
    if args.zero_terminal_snr and not getattr(args, "v_parameterization", False):
        logger.warning("--zero_terminal_snr without --v_parameterization: an epsilon model cannot learn the "
                       "zero-SNR timestep; results will be unexpected (as kohya warns)")


def training_noise_scheduler(zero_terminal_snr: bool = False):
    """The DDPM schedule SD/SDXL were trained with (kohya's fixed choice for LoRA training).

    With ``zero_terminal_snr`` the betas are rescaled as in kohya's
    ``fix_noise_scheduler_betas_for_zero_terminal_snr`` (arxiv 2305.08891, algorithm 1:
    sqrt(alphas_cumprod) shifted so the last is 0 and rescaled so the first is unchanged);
    diffusers implements that same algorithm behind ``rescale_betas_zero_snr``. The last
    timestep then has ``alphas_cumprod == 0``: SNR 0, the noisy input is pure noise.
    """
    from diffusers import DDPMScheduler

    return DDPMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
        clip_sample=False, rescale_betas_zero_snr=zero_terminal_snr,
    )


def sample_generator(seed: int, epoch: int, sample_index: int, stream: int) -> torch.Generator:
    """A CPU generator determined only by its key."""
    # Mix the key into one 63-bit seed (splitmix64-style constants spread nearby keys apart).
    mixed = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + sample_index * 0x94D049BB133111EB + stream) & (
        (1 << 63) - 1
    )
    return torch.Generator("cpu").manual_seed(mixed)


@dataclass
class DiffusionNoise:
    """One batch's draws, on the CPU, fp32.

    ``noise``: what the model learns to predict (or to build the v target from).
    ``input_noise``: what is added to the latents: ``noise`` plus the input perturbation
    when ``ip_noise_gamma`` is on, otherwise the very same tensor as ``noise``.
    ``timesteps``: long (B,).
    """

    noise: torch.Tensor
    timesteps: torch.Tensor
    input_noise: torch.Tensor

    def to(self, device: torch.device | str) -> "DiffusionNoise":
        noise = self.noise.to(device)
        input_noise = noise if self.input_noise is self.noise else self.input_noise.to(device)
        return DiffusionNoise(noise, self.timesteps.to(device), input_noise)


def draw_timesteps(
    seed: int, epoch: int, sample_indices: Sequence[int], num_train_timesteps: int,
    min_timestep: Optional[int] = None, max_timestep: Optional[int] = None,
) -> torch.Tensor:
    """Integer timesteps, long (B,), uniform in [min, max) (always ``min`` when min == max).

    Cheap and model-free: the trainer can look ahead over an accumulation window and get
    exactly the timesteps :func:`draw_diffusion_noise` will return for the same samples.
    """
    low = 0 if min_timestep is None else min_timestep
    high = num_train_timesteps if max_timestep is None else max_timestep
    timesteps = []
    for sample_index in sample_indices:
        generator = sample_generator(seed, epoch, sample_index, _STREAM_TIMESTEP)
        timesteps.append(int(torch.randint(low, high, (1,), generator=generator)) if low < high else low)
    return torch.tensor(timesteps, dtype=torch.long)


def draw_diffusion_noise(
    seed: int,
    epoch: int,
    sample_indices: Sequence[int],
    latent_shape: tuple[int, ...],
    num_train_timesteps: int,
    min_timestep: Optional[int] = None,
    max_timestep: Optional[int] = None,
    noise_offset: Optional[float] = None,
    *,
    options: Optional[NoiseOptions] = None,
    latents: Optional[torch.Tensor] = None,
) -> DiffusionNoise:
    """Noise of ``(B,) + latent_shape`` (C, H, W) and timesteps, one keyed draw per sample.

    ``options`` carries every noise flag (:meth:`NoiseOptions.from_args`); the three
    positional ``min_timestep``/``max_timestep``/``noise_offset`` are the older way to pass
    a subset of them and are only allowed when ``options`` is None. ``latents`` (B, C, H, W)
    are needed only for ``adaptive_noise_scale`` (read, never modified). Order as kohya:
    base noise, + offset, then multires on top; the input perturbation is added last.
    """
    if options is None:
        options = NoiseOptions(min_timestep=min_timestep, max_timestep=max_timestep, noise_offset=noise_offset)
    elif (min_timestep, max_timestep, noise_offset) != (None, None, None):
        raise TypeError("pass min_timestep, max_timestep and noise_offset inside options, not beside it")
    if options.adaptive_noise_scale is not None and options.noise_offset and latents is None:
        raise ValueError("adaptive_noise_scale needs the latents")
    channel_means = None
    if latents is not None and options.adaptive_noise_scale is not None:
        channel_means = latents.detach().float().mean(dim=(2, 3)).abs().cpu()  # (B, C)
    noises, input_noises = [], []
    for position, sample_index in enumerate(sample_indices):
        noise = torch.randn(latent_shape, generator=sample_generator(seed, epoch, sample_index, _STREAM_DIFFUSION))
        if options.noise_offset:
            means = None if channel_means is None else channel_means[position]
            noise = noise + _offset(seed, epoch, sample_index, latent_shape[0], options, means)
        if options.multires_noise_iterations:
            noise = _multires(noise, seed, epoch, sample_index, options)
        noises.append(noise)
        if options.ip_noise_gamma:
            input_noises.append(noise + _input_perturbation(seed, epoch, sample_index, latent_shape, options))
    timesteps = draw_timesteps(
        seed, epoch, sample_indices, num_train_timesteps, options.min_timestep, options.max_timestep
    )
    noise_batch = torch.stack(noises)
    input_noise = torch.stack(input_noises) if input_noises else noise_batch
    return DiffusionNoise(noise_batch, timesteps, input_noise)


def _offset(
    seed: int, epoch: int, sample_index: int, channels: int, options: NoiseOptions,
    channel_means: Optional[torch.Tensor],
) -> torch.Tensor:
    """kohya's ``apply_noise_offset`` for one sample: strength * N(0, 1) per channel, shape (C, 1, 1)."""
    generator = sample_generator(seed, epoch, sample_index, _STREAM_OFFSET)
    direction = torch.randn((channels, 1, 1), generator=generator)
    random_factor = torch.rand((), generator=generator)
    strength = torch.tensor(float(options.noise_offset))
    if options.noise_offset_random_strength:
        strength = strength * random_factor
    if channel_means is not None:  # adaptive: per channel, never negative (as kohya)
        strength = (strength + options.adaptive_noise_scale * channel_means).clamp(min=0.0).view(channels, 1, 1)
    return strength * direction


def _multires(noise: torch.Tensor, seed: int, epoch: int, sample_index: int, options: NoiseOptions) -> torch.Tensor:
    """kohya's ``pyramid_noise_like`` for one sample (C, H, W).

    Octave i adds N(0, 1) noise drawn at (H, W) / r**i (r uniform in [2, 4), floored, at
    least 1) and bilinearly upsampled, times discount**i; it stops after the first octave
    that reaches one pixel. The sum is divided by its std (this sample's, not the batch's).
    """
    generator = sample_generator(seed, epoch, sample_index, _STREAM_MULTIRES)
    channels, height, width = noise.shape
    noise = noise.clone()
    for octave in range(options.multires_noise_iterations):
        ratio = float(torch.rand((), generator=generator)) * 2 + 2
        low_height, low_width = max(1, int(height / ratio**octave)), max(1, int(width / ratio**octave))
        low = torch.randn((1, channels, low_height, low_width), generator=generator)
        upsampled = F.interpolate(low, size=(height, width), mode="bilinear")[0]
        noise += upsampled * options.multires_noise_discount**octave
        if low_height == 1 or low_width == 1:
            break
    return noise / noise.std() if noise.numel() > 1 else noise


def _input_perturbation(
    seed: int, epoch: int, sample_index: int, latent_shape: tuple[int, ...], options: NoiseOptions
) -> torch.Tensor:
    """ip_noise_gamma's extra noise for one sample: gamma (or gamma * U[0, 1)) * N(0, 1)."""
    generator = sample_generator(seed, epoch, sample_index, _STREAM_INPUT_PERTURBATION)
    perturbation = torch.randn(latent_shape, generator=generator)
    random_factor = float(torch.rand((), generator=generator))
    strength = options.ip_noise_gamma * (random_factor if options.ip_noise_gamma_random_strength else 1.0)
    return strength * perturbation


def draw_latent_samples(seed: int, epoch: int, sample_indices: Sequence[int], shape: tuple[int, ...]) -> torch.Tensor:
    """Standard normal draws for sampling the VAE's latent distribution, one per sample."""
    return torch.stack(
        [torch.randn(shape, generator=sample_generator(seed, epoch, i, _STREAM_LATENT)) for i in sample_indices]
    )
