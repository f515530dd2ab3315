"""kohya's finetune/prepare_buckets_latents.py: buckets into the metadata JSON, latents cached beside the images.

    python finetune/prepare_buckets_latents.py IMAGE_DIR meta_cap.json meta_lat.json MODEL
        [--max_resolution 1024,1024] [--batch_size 4] [--mixed_precision fp16] [--full_path] [--flip_aug]

Every entry gets ``train_resolution`` (its bucket); each image's latents go to
``<stem>_<W>x<H>_sdxl.npz`` (``_sd.npz`` for SD1/2), which ``--cache_latents_to_disk`` training at the
same bucket settings reuses. See library/datasets/prepare_latents.py.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402

from library.datasets.prepare_latents import add_arguments, prepare_buckets_latents  # noqa: E402
from library.errors import exit_on_user_error  # noqa: E402


def setup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    prepare_buckets_latents(setup_parser().parse_args(argv))


if __name__ == "__main__":
    exit_on_user_error(main)
