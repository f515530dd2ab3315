"""Diffusion losses: loss types, timestep weightings, masks, and exact normalisation over a window.

Every loss is computed from fp32 copies of the prediction and target, whatever the
autocast dtype. A micro-batch yields two numbers (:class:`WeightedLoss`):

* ``loss_sum``   = sum over latent elements e of  w_e * loss_e, where
  w_e = per-sample weight (``prior_loss_weight``) * timestep weight (min-SNR, debiased,
  ...) * mask_e (the sample's mask at latent resolution, 1 without one);
* ``weight_sum`` = how many latent elements count: all of them (``--masked_loss_normalization
  image``, kohya's rule and the default), or the sum of mask_e (``mask``: the unmasked area).

With ``--loss_normalization exact`` (the default) the loss of one optimizer step is
sum(loss_sum) / sum(weight_sum) over the whole accumulation window and all processes:
a per-element mean, the same however the window is split into micro-batches and processes.
Per-sample and timestep weights stay in the numerator only: they scale the loss as in kohya
(a window of one reg image with prior_loss_weight 0.5 has half the loss), and do not cancel
out. With equal batch sizes and full windows this is exactly kohya's loss (masks included:
kohya divides a masked sample's loss by its whole image, so a small mask gives a small loss;
``mask`` divides by the mask's area instead, so every sample's unmasked pixels weigh the same
whatever the mask's size). ``micro`` is kohya's older rule: per micro-batch the mean over
elements per sample, weighted, averaged over the batch; the window divides by
``gradient_accumulation_steps``.

Numerical contract: for finite inputs with |prediction|, |target| <= 65504 (the fp16
range), loss sums, weight sums, the normalised loss and all gradients are finite:
SNR 0 (the last step of --zero_terminal_snr) and huge SNRs are handled as documented at
:func:`timestep_weights`, Huber thresholds are kept positive, a sample whose mask is all
zero adds 0 to the loss sum (and, with ``mask`` normalisation, to the weight sum), and a window
whose weight sum is 0 has loss 0 and zero gradient.

How the trainer uses it (per optimizer step; see :func:`micro_batch_objective`)::

    weights = [batch_weights(...) for each micro-batch of the window]    # no model needed
    denominator = reduce_sum(window_denominator([w.weight_sum ...], ...))  # all processes
    for each micro-batch:  accelerator.backward(micro_batch_objective(batch_loss(...).loss_sum,
                               denominator, num_processes * gradient_accumulation_steps))
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from library.datasets.images import load_image
from library.errors import UserError

LOSS_TYPES = ("l2", "l1", "huber", "smooth_l1")
HUBER_SCHEDULES = ("constant", "exponential", "snr")
NORMALIZATIONS = ("exact", "micro")
MASKED_NORMALIZATIONS = ("image", "mask")
WEIGHTING_SNR_MAX = 1000.0
"""kohya's cap on the SNR in scale_v_pred_loss_like_noise_pred, v_pred_like_loss and debiased estimation."""
WEIGHTING_SNR_MIN = 1e-3
"""Floor on the SNR where a weighting divides by it (v_pred_like_loss, debiased estimation for epsilon).

SD's standard schedule never goes below SNR 4.7e-3, so the floor only acts on the tail of
--zero_terminal_snr (SNR -> 0, where 1/sqrt(snr) and 1/snr are unbounded); there it caps
the debiased weight at 1/sqrt(1e-3) = 31.6 and v_pred_like_loss's 1/scale at 1001."""
MASK_FLOOR = 1e-6
"""Mask values below this count as 0: a window whose only weight is a few near-zero mask values
would make 1/weight_sum overflow fp32 (an 8-bit alpha mask's smallest non-zero value, area-averaged
over an 8x8 cell, is 1/255/64 = 6e-5, well above)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--v_parameterization", action="store_true",
        help="train v-prediction (SD2.x 768-v models) instead of epsilon prediction")
    add("--loss_type", type=str, default="l2", choices=LOSS_TYPES,
        help="loss per latent element: l2 (default), l1, huber (2c(sqrt(d^2+c^2)-c)) or smooth_l1 "
             "(2(sqrt(d^2+c^2)-c))")
    add("--huber_schedule", type=str, default="snr", choices=HUBER_SCHEDULES,
        help="how the Huber threshold c varies with the timestep: constant (huber_c * huber_scale), exponential "
             "(huber_scale * huber_c^(t/T)) or snr (between 1 and huber_c by noise level; default snr)")
    add("--huber_c", type=float, default=0.1, help="Huber threshold c, > 0 (default 0.1)")
    add("--huber_scale", type=float, default=1.0,
        help="multiplier of the constant and exponential Huber thresholds, > 0 (default 1.0)")
    add("--min_snr_gamma", type=float, default=None,
        help="min-SNR weighting: min(SNR, gamma)/SNR (epsilon) or min(SNR, gamma)/(SNR+1) (v); 5 is the paper's "
             "choice (default off)")
    add("--scale_v_pred_loss_like_noise_pred", action="store_true",
        help="weight v-prediction losses by SNR/(SNR+1) to match epsilon-prediction losses")
    add("--v_pred_like_loss", type=float, default=None,
        help="add this multiple of a v-prediction-like loss: weight 1 + value * (SNR+1)/SNR (default off)")
    add("--debiased_estimation_loss", action="store_true",
        help="weight by 1/sqrt(SNR) (epsilon) or 1/(SNR+1) (v), SNR capped at 1000")
    add("--masked_loss", action="store_true",
        help="weight the loss by each sample's mask (the alpha channel of alpha_mask subsets). Alpha masks are "
             "applied whenever present, as in kohya; this flag checks that some subset has them")
    add("--masked_loss_normalization", type=str, default="image", choices=MASKED_NORMALIZATIONS,
        help="what a masked sample's loss is divided by (with --loss_normalization exact): image (default, kohya's "
             "rule): all its latent elements, so a small mask gives a small loss; mask: the mask's area (its "
             "values summed), so the unmasked pixels of every sample weigh the same")
    add("--loss_normalization", type=str, default="exact", choices=NORMALIZATIONS,
        help="exact (default): the step's loss is the weighted sum over the whole accumulation window and all "
             "processes divided by the number of unmasked latent elements; micro: kohya's mean per micro-batch, "
             "divided by gradient_accumulation_steps")


def validate_arguments(args: argparse.Namespace) -> None:
    """Raise :class:`UserError` naming the flag when a loss flag has an invalid value."""
    if args.loss_type not in LOSS_TYPES:
        raise UserError(f"--loss_type {args.loss_type}: choose one of {', '.join(LOSS_TYPES)}")
    if args.huber_schedule not in HUBER_SCHEDULES:
        raise UserError(f"--huber_schedule {args.huber_schedule}: choose one of {', '.join(HUBER_SCHEDULES)}")
    if args.masked_loss_normalization not in MASKED_NORMALIZATIONS:
        raise UserError(f"--masked_loss_normalization {args.masked_loss_normalization}: choose one of "
                        f"{', '.join(MASKED_NORMALIZATIONS)}")
    if args.loss_normalization not in NORMALIZATIONS:
        raise UserError(f"--loss_normalization {args.loss_normalization}: choose one of {', '.join(NORMALIZATIONS)}")
    if not args.huber_c > 0:
        raise UserError(f"--huber_c {args.huber_c}: must be > 0 (default 0.1)")
    if not args.huber_scale > 0:
        raise UserError(f"--huber_scale {args.huber_scale}: must be > 0 (default 1.0)")
    if args.min_snr_gamma is not None and args.min_snr_gamma < 0:
        raise UserError(f"--min_snr_gamma {args.min_snr_gamma}: must be > 0 (e.g. 5), or 0/absent for off")
    if args.v_pred_like_loss is not None and args.v_pred_like_loss < 0:
        raise UserError(f"--v_pred_like_loss {args.v_pred_like_loss}: must be >= 0 (e.g. 0.1)")
    # kohya refuses both: each weighting converts between epsilon and v losses, so one of the two is meaningless
    if args.scale_v_pred_loss_like_noise_pred and not args.v_parameterization:
        raise UserError("--scale_v_pred_loss_like_noise_pred scales a v-prediction loss like an epsilon one: it "
                        "needs --v_parameterization (kohya refuses it without)")
    if args.v_pred_like_loss and args.v_parameterization:
        raise UserError("--v_pred_like_loss adds a v-prediction-like term to an epsilon-prediction loss: with "
                        "--v_parameterization the loss already is one; remove one of them (kohya refuses both)")
    if args.masked_loss and not getattr(args, "alpha_mask", False) and not getattr(args, "dataset_config", None):
        raise UserError("--masked_loss needs masks: add --alpha_mask (images with an alpha channel), or alpha_mask = "
                        "true on subsets in --dataset_config")


def check_masks(args: argparse.Namespace, masked_images: Sequence[str]) -> None:
    """With ``--masked_loss``: some image has an alpha mask (``masked_images``: the files of subsets with
    ``alpha_mask``), and not every mask is empty. A fully transparent image weighs nothing: when all are,
    the loss and every gradient are 0 and the run "trains" an unchanged LoRA. Reads images until the
    first with a visible pixel (usually the first one)."""
    if not args.masked_loss:
        return
    if not masked_images:
        raise UserError(f"--masked_loss: no subset of --dataset_config {args.dataset_config} sets alpha_mask = "
                        f"true, so there are no masks; set it on the subsets whose images carry masks, or remove "
                        f"--masked_loss")
    for path in dict.fromkeys(masked_images):
        if load_image(path, keep_alpha=True).getchannel("A").getbbox() is not None:
            return
    raise UserError(f"--masked_loss: the alpha mask of every image is empty (fully transparent, e.g. "
                    f"{masked_images[0]}): the loss and its gradient would be 0 and nothing would train; give "
                    f"images whose alpha channel is nonzero where they should be learned")


@dataclass(frozen=True)
class LossOptions:
    """The loss flags, resolved. Built with :meth:`from_args`; the defaults are plain L2, exact."""

    loss_type: str = "l2"
    huber_c: float = 0.1
    huber_scale: float = 1.0
    huber_schedule: str = "snr"
    min_snr_gamma: Optional[float] = None
    scale_v_pred_loss_like_noise_pred: bool = False
    v_pred_like_loss: Optional[float] = None
    debiased_estimation_loss: bool = False
    v_parameterization: bool = False
    loss_normalization: str = "exact"
    masked_loss_normalization: str = "image"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "LossOptions":
        return cls(**{name: getattr(args, name) for name in cls.__dataclass_fields__})


def diffusion_target(
    noise_scheduler, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor, v_parameterization: bool
) -> torch.Tensor:
    """What the UNet must predict: the noise, or the velocity for v-parameterisation."""
    if v_parameterization:
        return noise_scheduler.get_velocity(latents, noise, timesteps)
    return noise


# --------------------------------------------------------------------------- pieces


def timestep_snr(alphas_cumprod: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
    """SNR = alphas_cumprod / (1 - alphas_cumprod) of each timestep, float64 on the CPU, (B,).

    0 at the last step of a zero-terminal-SNR schedule. Taken from the schedule actually used
    (kohya computes its SNR table before rescaling for --zero_terminal_snr, so its SNR
    weightings silently keep the original schedule's SNRs; this one does not).
    """
    alpha_bar = alphas_cumprod.detach().to("cpu", torch.float64)[timesteps.detach().cpu().long()]
    return alpha_bar / (1.0 - alpha_bar)


def timestep_weights(options: LossOptions, snr: torch.Tensor) -> torch.Tensor:
    """The product of the enabled SNR weightings (kohya's ``post_process_loss``), fp32 (B,).

    With s the SNR, applied in kohya's order:
      min_snr_gamma g: epsilon g / max(s, g) (= min(s, g)/s, and 1 at s = 0, its limit);
                       v     min(s, g) / (s + 1) (0 at s = 0);
      scale_v_pred_loss_like_noise_pred: c / (c + 1), c = min(s, 1000) (0 at s = 0);
      v_pred_like_loss v: 1 + v * (f + 1) / f, f = clamp(s, 1e-3, 1000);
      debiased_estimation_loss: epsilon 1 / sqrt(f); v 1 / (min(s, 1000) + 1).
    Every factor is finite and >= 0 for every s in [0, inf].
    """
    snr = snr.to(torch.float64)
    weight = torch.ones_like(snr)
    capped = snr.clamp(max=WEIGHTING_SNR_MAX)
    floored = snr.clamp(min=WEIGHTING_SNR_MIN, max=WEIGHTING_SNR_MAX)
    if options.min_snr_gamma:
        gamma = float(options.min_snr_gamma)
        if options.v_parameterization:
            weight = weight * torch.minimum(snr, torch.full_like(snr, gamma)) / (snr + 1)
        else:
            weight = weight * gamma / torch.maximum(snr, torch.full_like(snr, gamma))
    if options.scale_v_pred_loss_like_noise_pred:
        weight = weight * capped / (capped + 1)
    if options.v_pred_like_loss:
        weight = weight * (1 + options.v_pred_like_loss * (floored + 1) / floored)
    if options.debiased_estimation_loss:
        weight = weight * (1 / (capped + 1) if options.v_parameterization else 1 / floored.sqrt())
    return weight.float()


def huber_thresholds(
    options: LossOptions, alphas_cumprod: torch.Tensor, timesteps: torch.Tensor, num_train_timesteps: int
) -> Optional[torch.Tensor]:
    """kohya's ``get_huber_threshold_if_needed``: the Huber c per sample, fp32 CPU (B,), or None
    for l1/l2.

    constant: huber_c * huber_scale; exponential: huber_scale * huber_c ** (t / T);
    snr: (1 - huber_c) / (1 + sigma)**2 + huber_c with sigma = sqrt((1 - a) / a), a =
    alphas_cumprod[t], written as a / (sqrt(a) + sqrt(1 - a))**2 so a = 0 gives huber_c
    (huber_scale is not used, as in kohya). The result is kept >= the smallest normal fp32
    so that a tiny c never underflows to 0 (where the loss would have no gradient at d = 0).
    """
    if options.loss_type not in ("huber", "smooth_l1"):
        return None
    t = timesteps.detach().cpu().to(torch.float64)
    c, scale = float(options.huber_c), float(options.huber_scale)
    if options.huber_schedule == "constant":
        result = torch.full_like(t, c * scale)
    elif options.huber_schedule == "exponential":
        result = scale * torch.exp(t * (torch.log(torch.tensor(c, dtype=torch.float64)) / num_train_timesteps))
    else:
        alpha_bar = alphas_cumprod.detach().to("cpu", torch.float64)[timesteps.detach().cpu().long()]
        result = (1 - c) * alpha_bar / (alpha_bar.sqrt() + (1 - alpha_bar).sqrt()) ** 2 + c
    return result.float().clamp(min=torch.finfo(torch.float32).tiny)


def elementwise_loss(
    prediction: torch.Tensor, target: torch.Tensor, loss_type: str = "l2", huber_c: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """kohya's ``conditional_loss`` with reduction none, in fp32 whatever the input dtypes.

    l2 d**2, l1 |d|, huber 2c(sqrt(d**2 + c**2) - c), smooth_l1 2(sqrt(d**2 + c**2) - c) with
    d = prediction - target and ``huber_c`` (B,) > 0. sqrt(d**2 + c**2) - c is evaluated by
    :class:`_HypotMinusC`: accurate for |d| << c and |d| >> c, gradient finite for any c > 0.
    """
    difference = prediction.float() - target.float()
    if loss_type == "l2":
        return difference.square()
    if loss_type == "l1":
        return difference.abs()
    if loss_type not in ("huber", "smooth_l1"):
        raise ValueError(f"unknown loss type {loss_type!r}")
    if huber_c is None:
        raise ValueError(f"loss type {loss_type} needs huber_c")
    c = huber_c.to(difference.device, torch.float32).view(-1, *([1] * (difference.dim() - 1)))
    distance = _HypotMinusC.apply(difference, c)
    return 2 * c * distance if loss_type == "huber" else 2 * distance


class _HypotMinusC(torch.autograd.Function):
    """sqrt(d**2 + c**2) - c for c > 0 (broadcast against d), no gradient for c.

    The naive form loses every digit to cancellation when |d| << c, and its autograd
    squares c (0 for c < 1e-19 in fp32, then 0/0 at d = 0). Here the value is
    d * (d / (h + c)) with h = hypot(d, c) (which neither overflows nor underflows; the
    ratio is in [0, 1]) and the gradient is d / h, with h >= c > 0.
    """

    @staticmethod
    def forward(ctx, difference: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        hypotenuse = torch.hypot(difference, c)
        ctx.save_for_backward(difference, hypotenuse)
        return difference * (difference / (hypotenuse + c))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        difference, hypotenuse = ctx.saved_tensors
        return grad * (difference / hypotenuse), None


def mask_to_latent(mask: torch.Tensor, latent_hw: tuple[int, int]) -> torch.Tensor:
    """A mask (B, H, W) or (B, 1, H, W) in [0, 1] at pixel resolution, area-averaged down to
    (B, 1, h, w) fp32 (kohya's ``apply_masked_loss``: each latent cell gets the mean of its pixels)."""
    if mask.dim() == 3:
        mask = mask.unsqueeze(1)
    return F.interpolate(mask.to(torch.float32), size=tuple(latent_hw), mode="area")


# --------------------------------------------------------------------------- per micro-batch


@dataclass
class BatchWeights:
    """Everything about a micro-batch's loss that does not depend on the model.

    ``per_sample``: fp32 (B,), dataset weight times timestep weight. ``mask``: fp32
    (B, 1, h, w) or None. ``huber_c``: fp32 (B,) or None. ``weight_sum``: fp32 scalar, this
    micro-batch's share of the window denominator (exact: the number of latent elements that
    count, channels included; micro: 1). All on the CPU until :func:`batch_loss` moves them.
    """

    per_sample: torch.Tensor
    mask: Optional[torch.Tensor]
    huber_c: Optional[torch.Tensor]
    weight_sum: torch.Tensor


def batch_weights(
    options: LossOptions,
    alphas_cumprod: torch.Tensor,
    timesteps: torch.Tensor,
    sample_weights: torch.Tensor,
    latent_shape: tuple[int, int, int],
    mask: Optional[torch.Tensor] = None,
) -> BatchWeights:
    """The weights of a micro-batch, from its timesteps and data only (no model, no latents).

    ``alphas_cumprod``: the scheduler's (``noise_scheduler.alphas_cumprod``, any device).
    ``sample_weights``: (B,) the batch's ``loss_weights``. ``latent_shape``: (C, h, w) of
    one sample's latents. ``mask``: (B, 1, h, w) from :func:`mask_to_latent`, or None (values
    below :data:`MASK_FLOOR` count as 0).
    """
    num_train_timesteps = alphas_cumprod.shape[0]
    per_sample = sample_weights.detach().to("cpu", torch.float32) * timestep_weights(
        options, timestep_snr(alphas_cumprod, timesteps)
    )
    channels, height, width = latent_shape
    if mask is not None:
        mask = mask.detach().to("cpu", torch.float32)
        mask = torch.where(mask >= MASK_FLOOR, mask, torch.zeros_like(mask))
        if mask.shape != (per_sample.shape[0], 1, height, width):
            raise ValueError(f"mask {tuple(mask.shape)} does not match latents {(per_sample.shape[0], *latent_shape)}")
    if options.loss_normalization == "micro":
        weight_sum = torch.tensor(1.0)
    elif mask is None or options.masked_loss_normalization == "image":
        weight_sum = torch.tensor(float(per_sample.shape[0] * channels * height * width))
    else:
        weight_sum = mask.sum(dtype=torch.float64).float() * channels
    return BatchWeights(
        per_sample, mask, huber_thresholds(options, alphas_cumprod, timesteps, num_train_timesteps), weight_sum
    )


@dataclass
class WeightedLoss:
    """A micro-batch's loss: ``loss_sum`` fp32 scalar carrying the graph, ``weight_sum`` fp32 scalar,
    ``per_sample`` fp32 (B,) detached: each sample's mean loss over its latent elements (masked ones
    count 0, weights not applied), and ``inputs_finite`` bool (B,) when the trainer checked its inputs."""

    loss_sum: torch.Tensor
    weight_sum: torch.Tensor
    per_sample: Optional[torch.Tensor] = None
    inputs_finite: Optional[torch.Tensor] = None


def batch_loss(
    prediction: torch.Tensor, target: torch.Tensor, weights: BatchWeights, options: LossOptions
) -> WeightedLoss:
    """The micro-batch's weighted loss, from fp32 copies of ``prediction`` and ``target`` (B, C, h, w).

    exact: ``loss_sum`` = sum over samples i and elements e of per_sample_i * mask_ie * loss_ie.
    micro: ``loss_sum`` = mean over i of per_sample_i * mean over e of mask_ie * loss_ie
    (kohya's batch loss). Nothing is mutated.
    """
    device = prediction.device
    loss = elementwise_loss(prediction, target, options.loss_type, weights.huber_c)
    if weights.mask is not None:
        loss = loss * weights.mask.to(device)
    reduce_dims = list(range(1, loss.dim()))
    micro = options.loss_normalization == "micro"
    per_sample = loss.mean(dim=reduce_dims) if micro else loss.sum(dim=reduce_dims)
    weighted = per_sample * weights.per_sample.to(device)
    loss_sum = weighted.mean() if micro else weighted.sum()
    per_sample_mean = per_sample if micro else per_sample / (loss[0].numel() if loss.shape[0] else 1)
    return WeightedLoss(loss_sum, weights.weight_sum.to(device), per_sample_mean.detach())


# --------------------------------------------------------------------------- per window


def window_denominator(
    weight_sums: Sequence[torch.Tensor], normalization: str = "exact", accumulation_steps: int = 1
) -> torch.Tensor:
    """This process's denominator for one accumulation window, fp32 scalar (device of the inputs).

    exact: the sum of the window's ``weight_sum`` values. micro: ``accumulation_steps``
    whatever the window's length (kohya divides a short last window by the full count too).
    The trainer sums this over processes before use (``accelerator.reduce(..., "sum")``).
    """
    if normalization == "micro":
        device = weight_sums[0].device if weight_sums else "cpu"
        return torch.tensor(float(accumulation_steps), device=device)
    if not weight_sums:
        return torch.tensor(0.0)
    return torch.stack([value.float() for value in weight_sums]).sum()


def normalize(total: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """``total / denominator``, and 0 with zero gradient when ``denominator`` is 0 (an empty window)."""
    positive = denominator > 0
    return torch.where(positive, total / torch.where(positive, denominator, torch.ones_like(denominator)),
                       torch.zeros_like(total))


def micro_batch_objective(loss_sum: torch.Tensor, denominator: torch.Tensor, gradient_divisor: float) -> torch.Tensor:
    """What to pass to ``accelerator.backward`` for one micro-batch of a window.

    ``denominator``: :func:`window_denominator` summed over all processes. ``gradient_divisor``:
    what the machinery divides gradients by afterwards: 1 in our trainer (its accelerator has
    gradient_accumulation_steps=1 and gradients are SUMMED over processes); a loop using
    accelerate's accumulation and DDP averaging would pass ``num_processes *
    gradient_accumulation_steps``. The gradients accumulated over the window are then exactly
    those of sum(all loss_sum) / denominator; in micro mode, exactly kohya's.
    """
    return normalize(loss_sum, denominator) * gradient_divisor

