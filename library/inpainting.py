"""``--train_inpainting`` (kohya sd-scripts v0.10.4+): training an inpainting model's 9-channel UNet input.

Each step the UNet sees, concatenated on the channel axis in kohya's (and diffusers') order:

====  =====================================================================
0-3   the noisy latents (the usual input)
4     the mask at latent resolution (1 = the region to regenerate)
5-8   the VAE latents of the masked image: the image times (1 - mask)
====  =====================================================================

The mask is drawn at image resolution, for every sample and step anew, by a procedural generator with
kohya's kinds (``library/mask_generator.py`` there): fractional-Brownian-motion clouds, random
polygons, rectangles / ellipses, and a cloud united with a polygon or shape; the wobbly ellipse of
kohya's sampling masks is :func:`wobbly_ellipse_mask`. Here every draw comes from a generator keyed by
(seed, epoch, sample index), as the noise is (``library.noise``): a sample gets the same mask whatever
batch, accumulation or process it lands in, and a resumed run draws the same masks. The mask goes to
latent resolution by nearest-neighbour sampling (``F.interpolate``'s default, as diffusers' inpainting
pipelines do at inference).

Entry points: :func:`add_arguments`, :func:`validate_arguments`, :func:`check_model`,
:func:`conditioning_channels`, :func:`random_mask`.
"""
from __future__ import annotations

import argparse
import math
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw

from library import noise
from library.errors import UserError

INPAINTING_IN_CHANNELS = 9  # 4 latent + 1 mask + 4 masked-image latent channels

# kohya's mask kinds and their probabilities (random_mask in its mask_generator.py).
MASK_KINDS = ("cloud", "polygon", "shape")
MASK_KIND_WEIGHTS = (0.40, 0.35, 0.25)
CLOUD_UNION_PROBABILITY = 0.33  # a cloud is united with a polygon or a shape this often
MIN_COVERAGE, MAX_COVERAGE = 0.1, 0.6  # the area fraction range of one polygon / shape


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--train_inpainting", action="store_true",
        help="train an inpainting model (a 9-channel UNet input, e.g. sd-v1-5-inpainting or "
             "sd_xl_base_1.0_inpainting): each step a random mask (clouds, polygons, rectangles, ellipses) is "
             "drawn per image, and the UNet sees the noisy latents, the mask and the masked image's latents. "
             "Cannot be used with --cache_latents (kohya v0.10.4+)")


def validate_arguments(args: argparse.Namespace) -> None:
    """kohya's refusal of latent caching: the masked image is encoded every step from the image."""
    if args.train_inpainting:
        for flag in ("cache_latents", "cache_latents_to_disk"):
            if getattr(args, flag):
                raise UserError(f"--{flag} cannot be used with --train_inpainting: a new random mask is drawn "
                                f"from each image every step, so the images are encoded every step (drop --{flag})")


def check_model(train_inpainting: bool, unet_in_channels: int, model_path: str) -> None:
    """The UNet's input (its ``conv_in``, as the checkpoint has it) matches ``--train_inpainting``."""
    if train_inpainting and unet_in_channels != INPAINTING_IN_CHANNELS:
        raise UserError(f"--train_inpainting: {model_path} is not an inpainting model (its UNet conv_in takes "
                        f"{unet_in_channels} channels, inpainting needs {INPAINTING_IN_CHANNELS}); give an "
                        f"inpainting checkpoint such as sd-v1-5-inpainting or sd_xl_base_1.0_inpainting")
    if not train_inpainting and unet_in_channels == INPAINTING_IN_CHANNELS:
        raise UserError(f"--pretrained_model_name_or_path: {model_path} is an inpainting model (a "
                        f"{INPAINTING_IN_CHANNELS}-channel UNet conv_in); train it with --train_inpainting")
    if not train_inpainting and unet_in_channels != 4:
        raise UserError(f"--pretrained_model_name_or_path: {model_path} has a UNet conv_in of {unet_in_channels} "
                        f"channels; a Stable Diffusion model has 4 (or {INPAINTING_IN_CHANNELS} with "
                        f"--train_inpainting)")


# ---------------------------------------------------------------------------
# Masks: float32 (H, W) tensors, 1 = region to regenerate, 0 = keep
# ---------------------------------------------------------------------------

class _Draws:
    """Uniform draws from one keyed CPU generator (every mask decision reads from it in a fixed order)."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def uniform(self, low: float = 0.0, high: float = 1.0) -> float:
        return low + (high - low) * torch.rand((), generator=self.generator).item()

    def integer(self, low: int, high: int) -> int:
        """An integer in [low, high], both included."""
        return int(torch.randint(low, high + 1, (), generator=self.generator).item())

    def choice(self, options: Sequence, weights: Optional[Sequence[float]] = None):
        weights = torch.tensor(weights if weights is not None else [1.0] * len(options), dtype=torch.float64)
        return options[int(torch.multinomial(weights, 1, generator=self.generator).item())]


def _rasterized(width: int, height: int, draw: Callable[[ImageDraw.ImageDraw], None]) -> torch.Tensor:
    image = Image.new("L", (width, height), 0)
    draw(ImageDraw.Draw(image))
    return torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(height, width).float().div_(255.0)


def cloud_mask(width: int, height: int, draws: _Draws, coverage: float, octaves: int = 4, persistence: float = 0.5,
               base_scale: float = 16.0) -> torch.Tensor:
    """Fractional Brownian motion: octaves of bicubically upsampled uniform noise, each twice as fine and
    ``persistence`` times as strong; the ``coverage`` fraction of highest values is masked."""
    field = torch.zeros(height, width)
    amplitude, total, scale = 1.0, 0.0, base_scale
    for _ in range(octaves):
        coarse = torch.rand(1, 1, max(2, int(height / scale)), max(2, int(width / scale)), generator=draws.generator)
        field += amplitude * F.interpolate(coarse, size=(height, width), mode="bicubic", align_corners=False)[0, 0]
        total += amplitude
        amplitude *= persistence
        scale *= 2.0
    field /= total
    kept = min(height * width, max(1, round(height * width * (1.0 - coverage))))
    cutoff = field.flatten().kthvalue(kept).values
    return (field > cutoff).float()


def polygon_mask(width: int, height: int, draws: _Draws, polygons: int = 1, points: int = 6,
                 irregularity: float = 0.4) -> torch.Tensor:
    """``polygons`` roughly convex polygons of ``points`` vertices, each covering MIN..MAX_COVERAGE of the area."""
    min_radius = math.sqrt(MIN_COVERAGE * width * height / math.pi)
    max_radius = math.sqrt(MAX_COVERAGE * width * height / math.pi)
    shapes = []
    for _ in range(polygons):
        radius = draws.uniform(min_radius, max_radius)
        cx, cy = draws.uniform(0.2 * radius, width - 0.2 * radius), draws.uniform(0.2 * radius, height - 0.2 * radius)
        angles = sorted(draws.uniform(0.0, 2 * math.pi) for _ in range(points))
        shapes.append([(cx + r * math.cos(a), cy + r * math.sin(a))
                       for a, r in ((a, radius * draws.uniform(1.0 - irregularity, 1.0)) for a in angles)])
    return _rasterized(width, height, lambda canvas: [canvas.polygon(shape, fill=255) for shape in shapes])


def shape_mask(width: int, height: int, draws: _Draws, shape: str = "random") -> torch.Tensor:
    """One axis-aligned rectangle or ellipse (``shape``: rectangle, ellipse or random), sides drawn so its
    box covers about MIN..MAX_COVERAGE of the area."""
    box_w = draws.integer(int(width * MIN_COVERAGE ** 0.5), int(width * MAX_COVERAGE ** 0.5))
    box_h = draws.integer(int(height * MIN_COVERAGE ** 0.5), int(height * MAX_COVERAGE ** 0.5))
    x0, y0 = draws.integer(0, width - box_w), draws.integer(0, height - box_h)
    box = [x0, y0, x0 + box_w, y0 + box_h]
    ellipse = shape == "ellipse" or (shape == "random" and draws.uniform() < 0.5)
    return _rasterized(width, height, lambda canvas: (canvas.ellipse if ellipse else canvas.rectangle)(box, fill=255))


def wobbly_ellipse_mask(width: int, height: int, draws: _Draws, coverage: float = 0.2, wobble: float = 0.5,
                        octaves: int = 4, persistence: float = 0.5, points: int = 128) -> torch.Tensor:
    """One connected blob: a rotated ellipse of about ``coverage`` of the area whose radius varies along
    the outline by periodic harmonics (kohya's default mask for inpainting samples)."""
    cx, cy = draws.uniform(0.25, 0.75) * width, draws.uniform(0.25, 0.75) * height
    aspect, rotation = draws.uniform(0.6, 1.4), draws.uniform(0.0, math.pi)
    base = math.sqrt(coverage * width * height / (math.pi * aspect))
    a, b = base * math.sqrt(aspect), base / math.sqrt(aspect)
    thetas = torch.arange(points, dtype=torch.float64) * (2 * math.pi / points)
    wave = torch.zeros(points, dtype=torch.float64)
    amplitude, total = 1.0, 0.0
    for k in range(1, octaves + 1):
        wave += amplitude * torch.cos(k * thetas + draws.uniform(0.0, 2 * math.pi))
        total += amplitude
        amplitude *= persistence
    wave /= total
    if wave.std(unbiased=False) > 1e-6:
        wave = wave / wave.std(unbiased=False) * wobble
    outline = []
    for theta, w in zip(thetas.tolist(), wave.tolist()):
        t = theta - rotation
        r = a * b / math.sqrt((b * math.cos(t)) ** 2 + (a * math.sin(t)) ** 2)
        r = max(r * (1.0 + w), 1.0)
        outline.append((cx + r * math.cos(theta), cy + r * math.sin(theta)))
    return _rasterized(width, height, lambda canvas: canvas.polygon(outline, fill=255))


def random_mask(width: int, height: int, generator: torch.Generator) -> tuple[torch.Tensor, str]:
    """A training mask of kohya's kinds and probabilities, and its kind's name: ``cloud`` (40%, masking
    10-30% of the area; a third of them united with a polygon or a shape: ``cloud+polygon`` /
    ``cloud+shape``), ``polygon`` (35%, one or two polygons) or ``shape`` (25%, a rectangle or an ellipse)."""
    draws = _Draws(generator)
    kind = draws.choice(MASK_KINDS, MASK_KIND_WEIGHTS)
    if kind == "cloud":
        mask = cloud_mask(width, height, draws, coverage=draws.uniform(0.1, 0.3))
        if draws.uniform() < CLOUD_UNION_PROBABILITY:
            second = draws.choice(("polygon", "shape"))
            other = polygon_mask(width, height, draws) if second == "polygon" else shape_mask(width, height, draws)
            return torch.maximum(mask, other), f"cloud+{second}"
        return mask, kind
    if kind == "polygon":
        return polygon_mask(width, height, draws, polygons=draws.integer(1, 2)), kind
    return shape_mask(width, height, draws), kind


def training_masks(seed: int, epoch: int, sample_indices: Sequence[int], height: int, width: int) -> torch.Tensor:
    """(B, 1, H, W) float32 masks, each keyed by (``seed``, ``epoch``, sample index)."""
    masks = [random_mask(width, height, noise.sample_generator(seed, epoch, index, noise.STREAM_INPAINTING_MASK))[0]
             for index in sample_indices]
    return torch.stack(masks).unsqueeze(1)


def sample_mask(width: int, height: int, seed: int) -> torch.Tensor:
    """The (H, W) wobbly-ellipse mask of a sample image whose prompt gives no ``--mask``."""
    return wobbly_ellipse_mask(width, height, _Draws(torch.Generator("cpu").manual_seed(seed)))


# ---------------------------------------------------------------------------
# The UNet's extra input
# ---------------------------------------------------------------------------

def conditioning_channels(images: torch.Tensor, masks: torch.Tensor, encode: Callable[[torch.Tensor], torch.Tensor]
                          ) -> torch.Tensor:
    """(B, 5, h, w): the masks at latent resolution and the latents of the masked images.

    ``images``: (B, 3, H, W) in [-1, 1]; ``masks``: (B, 1, H, W), 1 = regenerate; ``encode``: images to
    scaled latents. A masked pixel becomes 0 (mid-grey), as in diffusers' inpainting pipelines.
    """
    masks = masks.to(images.device, images.dtype)
    masked_latents = encode(images * (1.0 - masks))
    latent_masks = F.interpolate(masks, size=tuple(masked_latents.shape[2:]))  # nearest
    return torch.cat([latent_masks.to(masked_latents.dtype), masked_latents], dim=1)



def sample_inputs(image_path: Optional[str], mask_path: Optional[str], width: int, height: int, seed: int
                  ) -> dict[str, Any]:
    """The inpainting pipeline's inputs for a sample prompt: ``--img`` resized to the sample size (none:
    a mid-grey image with everything masked, so the model draws the whole picture), ``--mask`` (white =
    regenerate; none: the wobbly-ellipse blob of :func:`sample_mask` keyed by the prompt's seed), and
    strength 1 (the masked region starts from pure noise). OSError when a file cannot be read."""
    if image_path is None:
        image = Image.new("RGB", (width, height), (128, 128, 128))
        mask = Image.new("L", (width, height), 255)
    else:
        with Image.open(image_path) as opened:
            image = opened.convert("RGB").resize((width, height), Image.LANCZOS)
        if mask_path is not None:
            with Image.open(mask_path) as opened:
                mask = opened.convert("L").resize((width, height), Image.NEAREST)
        else:
            blob = sample_mask(width, height, seed).mul(255).to(torch.uint8)
            mask = Image.fromarray(blob.numpy())  # uint8 (H, W): mode L
    return {"image": image, "mask_image": mask, "strength": 1.0}
