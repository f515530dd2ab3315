"""Dataset throughput: image check scan, decode+resize+crop, and cached-latent batches (memory and disk).

    python benchmarks/bench_dataset.py [--count 48] [--image_size 1344x896] [--resolution 1024] [--batch_size 4]

Writes ``count`` JPEG photos-like images into a temporary DreamBooth folder, then prints
images per second for: the up-front check (each file decoded once), producing training
batches from pixels (decode, EXIF, resize, crop, flip, caption), and producing batches
from cached latents held in memory and read from kohya-style ``.npz`` files. The cached
latents are random tensors of the real shape written through the real cache code: the
VAE is not what is measured here. A batch from the cache should take a small fraction
of a training step (an SDXL step is ~0.5-1 s on a GPU, seconds on a CPU).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

import sdxl_train_network  # noqa: E402
from library.datasets import latents  # noqa: E402
from library.datasets.dataset import build_dataset  # noqa: E402
from library.datasets.plan import plan_datasets  # noqa: E402
from library.datasets.dataset import dataset_specs  # noqa: E402


def write_images(folder: str, count: int, size_wh: tuple[int, int]) -> None:
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    width, height = size_wh
    x = np.linspace(0, 1, width)[None, :, None]
    y = np.linspace(0, 1, height)[:, None, None]
    for index in range(count):
        colour = rng.uniform(0, 255, (1, 1, 3))
        pixels = colour * x + (255 - colour) * y + rng.normal(0, 12, (height, width, 3))
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(os.path.join(folder, f"{index:04d}.jpg"),
                                                                       quality=90)
        with open(os.path.join(folder, f"{index:04d}.txt"), "w", encoding="utf-8") as file:
            file.write("sks photo, outdoors, tag a, tag b, tag c\n")


def rate(label: str, images: int, seconds: float, batches: int | None = None) -> None:
    per_batch = f", {1000 * seconds / batches:7.2f} ms per batch" if batches else ""
    print(f"{label:<44} {images / seconds:9.1f} images/s{per_batch}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=48, help="images to generate (default 48)")
    parser.add_argument("--image_size", type=str, default="1344x896",
                        help="generated image size WxH (default 1344x896)")
    parser.add_argument("--resolution", type=str, default="1024", help="training resolution (default 1024)")
    parser.add_argument("--batch_size", type=int, default=4, help="train batch size (default 4)")
    options = parser.parse_args()
    size_wh = tuple(int(v) for v in options.image_size.lower().split("x"))
    torch.set_num_threads(1)  # one DataLoader worker's view

    with tempfile.TemporaryDirectory() as root:
        write_images(os.path.join(root, "1_sks"), options.count, size_wh)
        argv = ["--train_data_dir", root, "--resolution", options.resolution, "--caption_extension", ".txt",
                "--enable_bucket", "--bucket_reso_steps", "32", "--max_bucket_reso", "2048", "--seed", "0",
                "--train_batch_size", str(options.batch_size), "--flip_aug", "--shuffle_caption"]
        args = sdxl_train_network.setup_parser().parse_args(argv)
        print(f"{options.count} JPEG images of {size_wh[0]}x{size_wh[1]}, resolution {options.resolution}, "
              f"batch {options.batch_size}, 1 thread")

        start = time.perf_counter()
        plan_datasets(dataset_specs(args), skip_bad_images=False, min_bucket_steps=32)
        rate("check scan (decode, size, EXIF, buckets)", options.count, time.perf_counter() - start)

        dataset = build_dataset(args, min_bucket_steps=32)
        start = time.perf_counter()
        for index in range(len(dataset)):
            dataset[index]
        rate("decode + resize + crop + flip + caption", options.count, time.perf_counter() - start, len(dataset))

        store = latents.LatentStore(scaling_factor=0.13025)
        for image in dataset.plan.images:
            width, height = image.bucket_wh
            shape = (4, height // 8, width // 8)
            store.in_memory[image.index] = latents.CachedLatents(
                torch.randn(shape), torch.rand(shape), torch.randn(shape), torch.rand(shape))
        dataset.latent_store = store
        start = time.perf_counter()
        for index in range(len(dataset)):
            latents.sample_cached_latents(dataset[index], 0, 1)
        rate("cached latents in memory (+ keyed sample)", options.count, time.perf_counter() - start, len(dataset))

        disk = latents.LatentStore(scaling_factor=0.13025)
        for image in dataset.plan.images:
            path = latents.npz_path(image, is_sdxl=True)
            latents._write_entry(path, "", image, {"benchmark": True}, store.in_memory[image.index])
            disk.on_disk[image.index] = (path, "")
        dataset.latent_store = disk
        start = time.perf_counter()
        for index in range(len(dataset)):
            latents.sample_cached_latents(dataset[index], 0, 1)
        rate("cached latents from .npz (+ keyed sample)", options.count, time.perf_counter() - start, len(dataset))


if __name__ == "__main__":
    main()
