"""DreamBooth-style folders: ``<repeats>_<class tokens>`` subfolders of images with captions."""
from __future__ import annotations

import os
from dataclasses import dataclass

from library.datasets.images import is_image_file
from library.errors import UserError


@dataclass(frozen=True)
class ImageEntry:
    """One image of the dataset with everything needed to make a training sample."""

    path: str
    caption: str
    num_repeats: int
    is_reg: bool


def read_caption(image_path: str, caption_extension: str, fallback: str) -> str:
    """The caption file beside the image (first line), or ``fallback`` when there is none."""
    caption_path = os.path.splitext(image_path)[0] + caption_extension
    if not os.path.isfile(caption_path):
        return fallback
    try:
        with open(caption_path, encoding="utf-8") as file:
            lines = [line.strip() for line in file.read().splitlines() if line.strip()]
    except UnicodeDecodeError:
        raise UserError(f"caption file {caption_path} is not UTF-8 text") from None
    return lines[0] if lines else fallback


def discover(data_dir: str, caption_extension: str, is_reg: bool, flag: str) -> list[ImageEntry]:
    """Every image under ``data_dir``'s ``N_name`` subfolders, sorted for determinism."""
    if not os.path.isdir(data_dir):
        raise UserError(f"{flag} {data_dir} is not a folder")
    entries = []
    for subfolder in sorted(os.listdir(data_dir)):
        subfolder_path = os.path.join(data_dir, subfolder)
        if not os.path.isdir(subfolder_path):
            continue
        repeats_text, sep, class_tokens = subfolder.partition("_")
        if not sep or not repeats_text.isdigit() or int(repeats_text) <= 0:
            print(f"ignoring {subfolder_path}: folder names must be <repeats>_<class tokens>, e.g. 10_sks dog")
            continue
        for name in sorted(os.listdir(subfolder_path)):
            path = os.path.join(subfolder_path, name)
            if os.path.isfile(path) and is_image_file(name):
                caption = read_caption(path, caption_extension, class_tokens)
                entries.append(ImageEntry(path, caption, int(repeats_text), is_reg))
    if not entries:
        raise UserError(
            f"{flag} {data_dir} has no images: expected subfolders named <repeats>_<class tokens> "
            f"(e.g. 10_sks dog) holding .png/.jpg/.jpeg/.webp/.bmp files"
        )
    return entries
