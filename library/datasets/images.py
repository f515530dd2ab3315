"""Reading image files the way users' datasets need: EXIF orientation, RGBA, clear errors."""
from __future__ import annotations

import os

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from library.errors import UserError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def is_image_file(path: str) -> bool:
    return path.lower().endswith(IMAGE_EXTENSIONS)


def load_rgb(path: str) -> Image.Image:
    """The image upright (EXIF orientation applied) in RGB; alpha is composited on white.

    An unreadable, truncated or zero-size file is a UserError naming the path.
    """
    if os.path.getsize(path) == 0:
        raise UserError(f"image {path} is empty (0 bytes); remove it or replace it")
    try:
        with Image.open(path) as image:
            image.load()
            image = ImageOps.exif_transpose(image)
    except (UnidentifiedImageError, OSError, SyntaxError) as error:
        raise UserError(f"image {path} cannot be read ({error}); remove it or replace it") from None
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def resize_and_crop(
    image: Image.Image, target_hw: tuple[int, int], crop_top_left: tuple[int, int] | None = None
) -> tuple[np.ndarray, tuple[int, int]]:
    """Scale ``image`` to cover ``target_hw`` keeping its aspect ratio, then crop to it.

    Returns the HxWx3 uint8 array and the crop's (top, left) in resized pixels: SDXL's
    ``crop_coords_top_left`` conditioning. The crop is centred unless given.
    """
    target_h, target_w = target_hw
    width, height = image.size
    scale = max(target_w / width, target_h / height)
    resized_w, resized_h = max(target_w, round(width * scale)), max(target_h, round(height * scale))
    if (resized_w, resized_h) != (width, height):
        resample = Image.Resampling.LANCZOS if scale < 1 else Image.Resampling.BICUBIC
        image = image.resize((resized_w, resized_h), resample)
    if crop_top_left is None:
        crop_top_left = ((resized_h - target_h) // 2, (resized_w - target_w) // 2)
    top, left = crop_top_left
    array = np.array(image)[top : top + target_h, left : left + target_w]
    return np.ascontiguousarray(array), (top, left)
