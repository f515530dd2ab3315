"""Write a small DreamBooth-style dataset of generated pictures with captions.

    python tools/make_demo_dataset.py --out DIR [--count 8] [--size 96]

Creates ``DIR/10_shape/`` with PNG images of coloured shapes and ``.txt`` captions.
"""
from __future__ import annotations

import argparse
import os

import numpy as np
from PIL import Image, ImageDraw

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40)}
SHAPES = ("circle", "square")


def make_demo_dataset(out_dir: str, count: int = 8, size: int = 96, repeats: int = 10, seed: int = 0) -> str:
    """Write ``count`` images and captions; return the image folder."""
    rng = np.random.default_rng(seed)
    folder = os.path.join(out_dir, f"{repeats}_shape")
    os.makedirs(folder, exist_ok=True)
    colour_names = list(COLOURS)
    for index in range(count):
        colour = colour_names[index % len(colour_names)]
        shape = SHAPES[(index // len(colour_names)) % len(SHAPES)]
        image = Image.new("RGB", (size, size), tuple(int(v) for v in rng.integers(200, 256, 3)))
        draw = ImageDraw.Draw(image)
        margin = int(rng.integers(size // 8, size // 4))
        box = (margin, margin, size - margin, size - margin)
        (draw.ellipse if shape == "circle" else draw.rectangle)(box, fill=COLOURS[colour])
        stem = os.path.join(folder, f"{index:03d}")
        image.save(stem + ".png")
        with open(stem + ".txt", "w", encoding="utf-8") as file:
            file.write(f"a {colour} {shape}\n")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="dataset folder to create")
    parser.add_argument("--count", type=int, default=8, help="number of images (default 8)")
    parser.add_argument("--size", type=int, default=96, help="image side in pixels (default 96)")
    args = parser.parse_args()
    print(make_demo_dataset(args.out, args.count, args.size))


if __name__ == "__main__":
    main()
