"""Aspect-ratio buckets, with exactly kohya-ss sd-scripts' table and assignment rule.

All sizes here are (width, height), as in kohya's code and logs. The rule, also in
docs/datasets.md:

* Table (``enable_bucket`` without ``bucket_no_upscale``): for the training area
  A = W*H, the square side floor(sqrt(A)/s)*s, and for every width w from
  ``min_bucket_reso`` to ``max_bucket_reso`` in steps s the pair
  h = min(max, floor(floor(A/w)/s)*s) when h >= min, both (w, h) and (h, w).
* Assignment: an image whose exact size is in the table keeps it; otherwise it
  takes the first table entry (sorted by width, then height) with the smallest
  |bucket aspect - image aspect|. It is scaled to cover the bucket (by height if the
  image is wider than the bucket, else by width), sizes rounded half up, and the
  excess is cropped.
* ``bucket_no_upscale``: no table. An image larger than A is shrunk to area ~A
  keeping its aspect, with one side on the step grid (the side whose rounding keeps
  the aspect best); then the bucket is that size floored to multiples of s and the
  rest is cropped. Smaller images are never scaled.
* Without ``enable_bucket`` there is one bucket, the resolution, and every image is
  scaled to cover it and cropped.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from library.errors import UserError


def make_bucket_resolutions(
    max_reso: tuple[int, int], min_size: int = 256, max_size: int = 1024, divisible: int = 64
) -> list[tuple[int, int]]:
    """kohya's predefined bucket table for the training area ``max_reso`` (w, h), sorted."""
    max_area = max_reso[0] * max_reso[1]
    resolutions = set()
    side = int(math.sqrt(max_area) // divisible) * divisible
    resolutions.add((side, side))
    width = min_size
    while width <= max_size:
        height = min(max_size, int((max_area // width) // divisible) * divisible)
        if height >= min_size:
            resolutions.add((width, height))
            resolutions.add((height, width))
        width += divisible
    return sorted(resolutions)


def adjust_bucket_limits(
    resolution_wh: tuple[int, int], min_reso: int, max_reso: int, steps: int, where: str
) -> tuple[int, int]:
    """Put min/max bucket sizes on the step grid (min down, max up) as kohya does, and check them.

    ``where`` names the source of the values in error messages.
    """
    if steps <= 0:
        raise UserError(f"{where}: bucket_reso_steps {steps} must be a positive integer (e.g. 64)")
    if min_reso % steps:
        adjusted = min_reso - min_reso % steps
        print(f"{where}: min_bucket_reso {min_reso} adjusted to a multiple of bucket_reso_steps: {adjusted}")
        min_reso = adjusted
    if max_reso % steps:
        adjusted = max_reso + steps - max_reso % steps
        print(f"{where}: max_bucket_reso {max_reso} adjusted to a multiple of bucket_reso_steps: {adjusted}")
        max_reso = adjusted
    if min(resolution_wh) < min_reso:
        raise UserError(
            f"{where}: min_bucket_reso {min_reso} is larger than the resolution's shorter side "
            f"{min(resolution_wh)}; lower min_bucket_reso or raise the resolution"
        )
    if max(resolution_wh) > max_reso:
        raise UserError(
            f"{where}: max_bucket_reso {max_reso} is smaller than the resolution's longer side "
            f"{max(resolution_wh)}; raise max_bucket_reso or lower the resolution"
        )
    return min_reso, max_reso


@dataclass(frozen=True)
class BucketChoice:
    """Where one image goes: its bucket, the size it is scaled to before cropping, the aspect error."""

    bucket_wh: tuple[int, int]
    resized_wh: tuple[int, int]
    aspect_error: float


class BucketRule:
    """Assigns images to buckets with kohya's rule (see the module docstring)."""

    def __init__(
        self,
        resolution_wh: tuple[int, int],
        enable_bucket: bool,
        min_reso: Optional[int] = None,
        max_reso: Optional[int] = None,
        steps: Optional[int] = None,
        no_upscale: bool = False,
    ) -> None:
        self.resolution_wh = tuple(resolution_wh)
        self.max_area = resolution_wh[0] * resolution_wh[1]
        self.no_upscale = bool(enable_bucket and no_upscale)
        self.steps = steps
        # kohya's dataset reports these (None without buckets) in its LoRA metadata.
        self.min_reso, self.max_reso = (min_reso, max_reso) if enable_bucket else (None, None)
        if not enable_bucket:
            self.table = [self.resolution_wh]
        elif self.no_upscale:
            self.table = []
        else:
            self.table = make_bucket_resolutions(resolution_wh, min_reso, max_reso, steps)
        self._table_set = set(self.table)
        self._table_aspects = np.array([w / h for w, h in self.table]) if self.table else None

    def _round_to_steps(self, value: float) -> int:
        value = int(value + 0.5)
        return value - value % self.steps

    def select(self, width: int, height: int) -> BucketChoice:
        """The bucket of a ``width`` x ``height`` image (upright pixels)."""
        aspect = width / height
        if not self.no_upscale:
            bucket = (width, height)
            if bucket not in self._table_set:
                bucket = self.table[int(np.abs(self._table_aspects - aspect).argmin())]
            if aspect > bucket[0] / bucket[1]:  # image wider than the bucket: match heights
                scale = bucket[1] / height
            else:
                scale = bucket[0] / width
            resized = (int(width * scale + 0.5), int(height * scale + 0.5))
        else:
            if width * height > self.max_area:
                resized_w = math.sqrt(self.max_area * aspect)
                resized_h = self.max_area / resized_w
                width_rounded = self._round_to_steps(resized_w)
                height_for_width = self._round_to_steps(width_rounded / aspect)
                height_rounded = self._round_to_steps(resized_h)
                width_for_height = self._round_to_steps(height_rounded * aspect)
                if min(width_rounded, height_for_width, height_rounded, width_for_height) <= 0:
                    raise UserError(
                        f"an image of {width}x{height} is too narrow for bucket_reso_steps {self.steps}"
                    )
                error_by_width = abs(width_rounded / height_for_width - aspect)
                error_by_height = abs(width_for_height / height_rounded - aspect)
                if error_by_width < error_by_height:
                    resized = (width_rounded, int(width_rounded / aspect + 0.5))
                else:
                    resized = (int(height_rounded * aspect + 0.5), height_rounded)
            else:
                resized = (width, height)
            bucket = (resized[0] - resized[0] % self.steps, resized[1] - resized[1] % self.steps)
            if min(bucket) <= 0:
                raise UserError(
                    f"an image of {width}x{height} is smaller than bucket_reso_steps {self.steps}: "
                    f"with bucket_no_upscale it gets no bucket; remove it or lower bucket_reso_steps"
                )
        return BucketChoice(tuple(bucket), resized, bucket[0] / bucket[1] - aspect)


def center_crop_top_left(resized_wh: tuple[int, int], bucket_wh: tuple[int, int]) -> tuple[int, int]:
    """The (top, left) of a centred ``bucket_wh`` window in a ``resized_wh`` image (kohya: excess // 2)."""
    return (resized_wh[1] - bucket_wh[1]) // 2, (resized_wh[0] - bucket_wh[0]) // 2


def random_crop_top_left(
    resized_wh: tuple[int, int], bucket_wh: tuple[int, int], rng: np.random.Generator
) -> tuple[int, int]:
    """A uniformly random (top, left), each axis in [0, excess] inclusive as kohya draws it."""
    top = int(rng.integers(0, resized_wh[1] - bucket_wh[1] + 1))
    left = int(rng.integers(0, resized_wh[0] - bucket_wh[0] + 1))
    return top, left


def sdxl_crop_top_left(
    crop_top_left: tuple[int, int], resized_wh: tuple[int, int], bucket_wh: tuple[int, int], flipped: bool
) -> tuple[int, int]:
    """SDXL's ``crop_coords_top_left`` of the pixels actually trained on.

    The crop offset in the resized image; for a mirrored sample the left offset is
    measured in the mirrored image (kohya's flip handling: left' = width - right).
    """
    top, left = crop_top_left
    if flipped:
        left = resized_wh[0] - bucket_wh[0] - left
    return top, left


def summarize(buckets: dict[tuple[int, int], int], aspect_errors: list[float], title: str) -> str:
    """kohya-style bucket summary: one line per bucket (w, h) with its sample count."""
    lines = [f"{title}: number of images (including repeats) per bucket"]
    for index, (bucket, count) in enumerate(sorted(buckets.items())):
        lines.append(f"  bucket {index}: resolution {bucket}, count: {count}")
    mean_error = float(np.mean(np.abs(aspect_errors))) if aspect_errors else 0.0
    lines.append(f"  mean ar error (without repeats): {mean_error}")
    return "\n".join(lines)
