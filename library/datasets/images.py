"""Reading image files the way users' datasets need: EXIF orientation, RGBA, 16-bit, clear errors.

Two entry points: ``probe_image`` decodes a file once to check it (a truncated file has an
intact header and would otherwise fail mid-training) and reports its upright size, so a
whole dataset is checked before training; ``load_image`` decodes one image upright. Both
use the orientation found in the header, so the size ``probe_image`` reports is exactly the
size ``load_image`` returns.
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np
from PIL import Image, UnidentifiedImageError

from library.errors import UserError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
_ORIENTATION_TAG = 0x0112
# EXIF orientation -> the transpose that makes the image upright (as PIL's ImageOps.exif_transpose).
_UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
# --resize_interpolation names (kohya's, cv2 flavoured) -> PIL filters; "area" is PIL's box filter.
INTERPOLATIONS = {
    "lanczos": Image.Resampling.LANCZOS,
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "linear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "cubic": Image.Resampling.BICUBIC,
    "area": Image.Resampling.BOX,
    "box": Image.Resampling.BOX,
}


# PIL's modes of 16-bit grayscale PNGs ("I" in older Pillow versions). PIL's convert("RGB")
# clips their 0..65535 values at 255, which turns almost every pixel white.
_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")


class BadImageError(UserError):
    """An image file that cannot be used (empty, unreadable, truncated); the message names it."""


def is_image_file(path: str) -> bool:
    return path.lower().endswith(IMAGE_EXTENSIONS)


def _orientation(image: Image.Image) -> int:
    """The EXIF orientation stored in the header (1 when absent); never decodes pixels."""
    exif_bytes = image.info.get("exif")
    if not exif_bytes:
        return 1
    exif = Image.Exif()
    try:
        exif.load(exif_bytes)
        orientation = int(exif.get(_ORIENTATION_TAG, 1))
    except Exception:  # a damaged EXIF block is ignored, like viewers do
        return 1
    return orientation if orientation in _UPRIGHT else 1


def probe_image(path: str) -> tuple[int, int]:
    """Upright (width, height) of a file that decodes completely; raises BadImageError naming the file.

    The whole file is decoded once (a truncated file has an intact header); JPEGs at 1/8 scale
    through libjpeg's draft mode, which still reads every byte of the compressed data. About
    10 ms for a 1 megapixel JPEG, 20-40 ms for a PNG.
    """
    try:
        if os.path.getsize(path) == 0:
            raise BadImageError(f"image {path} is empty (0 bytes); remove or replace it, or pass --skip_bad_images")
        with Image.open(path) as image:
            width, height = image.size
            orientation = _orientation(image)
            if image.format == "JPEG":
                image.draft("RGB", (1, 1))
            image.load()
    except BadImageError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise BadImageError(
            f"image {path} cannot be read ({error}); remove or replace it, or pass --skip_bad_images"
        ) from None
    if width <= 0 or height <= 0:
        raise BadImageError(f"image {path} has no pixels ({width}x{height}); remove or replace it")
    return (height, width) if orientation in (5, 6, 7, 8) else (width, height)


def load_image(path: str, keep_alpha: bool = False) -> Image.Image:
    """The decoded image, upright, as RGB, or as RGBA when ``keep_alpha``.

    Without ``keep_alpha`` transparent pixels are composited on white. With it the RGB
    channels are kept as stored (as kohya does for ``alpha_mask``) and opaque images get
    an alpha of 255. A file that fails to decode raises BadImageError naming it.
    """
    try:
        with Image.open(path) as image:
            orientation = _orientation(image)
            image.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise BadImageError(f"image {path} cannot be decoded ({error}); remove or replace it") from None
    if orientation in _UPRIGHT:
        image = image.transpose(_UPRIGHT[orientation])
    if image.mode in _SIXTEEN_BIT_MODES:
        image = eight_bit_gray(image)
    has_alpha = image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (
        image.mode == "P" and "transparency" in image.info
    )
    if keep_alpha:
        return image.convert("RGBA")
    if has_alpha:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def eight_bit_gray(image: Image.Image) -> Image.Image:
    """A 16-bit grayscale image (``_SIXTEEN_BIT_MODES``) as 8-bit "L": 0..65535 scaled to 0..255, rounded."""
    values = np.asarray(image).astype(np.float64)
    return Image.fromarray(np.clip(np.rint(values / 257.0), 0, 255).astype(np.uint8), "L")


def ensure_size(path: str, image: Image.Image, expected_wh: tuple[int, int]) -> None:
    """Refuse an image whose decoded size differs from the size its bucket was chosen for."""
    if image.size != tuple(expected_wh):
        raise UserError(
            f"image {path} is {image.width}x{image.height} but the dataset planned {expected_wh[0]}x{expected_wh[1]}: "
            f"it changed after the scan, or image_size in the metadata / metadata_cache.json is wrong"
        )


def resize_image(image: Image.Image, size_wh: tuple[int, int], interpolation: Optional[str] = None) -> Image.Image:
    """``image`` scaled to ``size_wh``; kohya's default filter: area when shrinking, else Lanczos."""
    if image.size == tuple(size_wh):
        return image
    if interpolation is None:
        shrinking = image.width >= size_wh[0] and image.height >= size_wh[1]
        interpolation = "area" if shrinking else "lanczos"
    return image.resize(tuple(size_wh), INTERPOLATIONS[interpolation])


def resize_crop_flip(
    image: Image.Image,
    resized_wh: tuple[int, int],
    bucket_wh: tuple[int, int],
    crop_top_left: tuple[int, int],
    flip: bool,
    interpolation: Optional[str] = None,
) -> np.ndarray:
    """Scale to ``resized_wh``, cut the ``bucket_wh`` window at ``crop_top_left``, mirror if ``flip``.

    Returns an HxWxC uint8 array (C = 3, or 4 for RGBA input).
    """
    top, left = crop_top_left
    width, height = bucket_wh
    resized = resize_image(image, resized_wh, interpolation)
    window = resized.crop((left, top, left + width, top + height))
    if flip:
        window = window.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.array(window, dtype=np.uint8)


def color_augment(pixels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """kohya's weak colour augmentation on an RGB uint8 array.

    With probability 0.33: half of the time a hue shift of up to +-8 (of 180) degrees,
    else kohya's "gamma" ``clip(pixels ** g, 0, 255)`` with g in [0.95, 1.05]
    (applied to 0..255 values, as kohya does).
    """
    if rng.random() > 0.33:
        return pixels
    if rng.random() > 0.5:
        shift = rng.uniform(-8.0, 8.0)
        hsv = np.asarray(Image.fromarray(pixels, "RGB").convert("HSV")).copy()
        # PIL's hue runs 0..255 where cv2's runs 0..180.
        hsv[:, :, 0] = ((hsv[:, :, 0].astype(np.float32) + shift * 256.0 / 180.0) % 256).astype(np.uint8)
        return np.asarray(Image.fromarray(hsv, "HSV").convert("RGB"))
    gamma = rng.uniform(0.95, 1.05)
    return np.clip(pixels.astype(np.float64) ** gamma, 0, 255).astype(np.uint8)
