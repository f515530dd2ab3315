"""kohya's ``finetune/prepare_buckets_latents.py``: bucket every image, cache its latents beside it,
record the bucket as ``train_resolution`` in the metadata JSON.

Buckets follow kohya's table for ``--max_resolution`` (``library.datasets.buckets``). Latents are
written by the trainer's own cache writer (``library.datasets.latents``): ``<stem>_<W>x<H>_sdxl.npz``
(``_sd.npz`` for SD1/2) beside the image with kohya v0.11.1's keys, so ``sdxl_train_network.py`` /
kohya's ``sdxl_train.py`` with ``--in_json ... --cache_latents_to_disk`` at the same bucket settings use
them instead of encoding again (ours checks image, bucket and VAE; kohya checks the latent size).
kohya v0.11.1's own script computes the latents but no longer writes them (its ``cache_batch_latents``
writes nothing to disk since the caching strategies), so its trainer encodes again there.

Sizes are the upright sizes (EXIF orientation applied, as the trainer reads images); kohya uses the
stored pixel size, so for an EXIF-rotated photo ``train_resolution`` can differ from kohya's.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

import torch

from library.checkpoint_keys import ModelKind
from library.datasets.buckets import BucketRule
from library.datasets.captions import CaptionOptions
from library.datasets.config import SubsetSpec
from library.datasets.finetune_metadata import (check_key_options, check_out_json, find_images, image_key,
                                                read_metadata, write_metadata)
from library.datasets.images import BadImageError, probe_image
from library.datasets.latents import cache_latents
from library.datasets.plan import PlannedImage
from library.errors import UserError
from library.model_loading import load_vae, shipped_config_dir
from library.model_weights import model_kind_of

MIXED_PRECISION_DTYPES = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def parse_max_resolution(text: str) -> tuple[int, int]:
    """kohya's ``--max_resolution 'width,height'``."""
    try:
        width, height = (int(part) for part in text.split(","))
    except ValueError:
        raise UserError(f"--max_resolution {text!r}: give 'width,height', e.g. 1024,1024") from None
    if width <= 0 or height <= 0:
        raise UserError(f"--max_resolution {text!r}: width and height must be positive")
    return width, height


def load_prepare_vae(model_name_or_path: str, kind: ModelKind, model_config_dir: Optional[str], dtype: torch.dtype):
    """The model's VAE in ``dtype`` on the preferred device (CUDA when present, as kohya)."""
    config_dir = Path(model_config_dir) if model_config_dir else shipped_config_dir(kind)
    config_file = config_dir / "vae" / "config.json"
    if not config_file.is_file():
        raise UserError(f"--model_config_dir {config_dir} has no vae/config.json")
    vae = load_vae(model_name_or_path, vae_config=json.loads(config_file.read_text(encoding="utf-8")),
                   flag="model_name_or_path")
    vae.to(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    return (vae if dtype == torch.float32 else vae.to(dtype=dtype)).eval()


def prepare_buckets_latents(args: argparse.Namespace) -> dict:
    """Run the script on parsed ``args`` (kohya's names); returns the metadata written to ``out_json``."""
    check_key_options(args.full_path, args.recursive)
    check_out_json(args.out_json, args.train_data_dir)
    max_resolution = parse_max_resolution(args.max_resolution)
    if args.bucket_reso_steps <= 0:
        raise UserError(f"--bucket_reso_steps {args.bucket_reso_steps} must be a positive integer (e.g. 64)")
    if args.batch_size < 1:
        raise UserError(f"--batch_size {args.batch_size} must be 1 or more")
    if args.bucket_reso_steps % 8:
        print("bucket resolutions used in training are multiples of 8")
    if args.bucket_reso_steps % 32:
        print("--bucket_reso_steps is not a multiple of 32: the buckets do not work with SDXL")
    images = find_images(args.train_data_dir, args.recursive)
    print(f"found {len(images)} images.")
    metadata = read_metadata(args.in_json, "in_json")
    kind = model_kind_of(Path(args.model_name_or_path), "model_name_or_path")  # names the cache files
    rule = BucketRule(max_resolution, True, args.min_bucket_reso, args.max_bucket_reso, args.bucket_reso_steps,
                      args.bucket_no_upscale)
    if args.bucket_no_upscale:
        print("min_bucket_reso and max_bucket_reso are ignored with bucket_no_upscale (each image's bucket comes "
              "from its size)")
    subset = SubsetSpec(image_dir=args.train_data_dir, metadata_file=None, num_repeats=1, is_reg=False,
                        class_tokens=None, caption_extension="", cache_info=False, alpha_mask=bool(args.alpha_mask),
                        color_aug=False, flip_aug=args.flip_aug, random_crop=False, resize_interpolation=None,
                        captions=CaptionOptions(), where="prepare_buckets_latents")
    planned: list[PlannedImage] = []
    bucket_counts: dict[tuple[int, int], int] = {}
    for image_path in images:
        try:
            size = probe_image(str(image_path))
        except BadImageError as error:  # kohya logs it and goes on
            print(f"skipped: {error}")
            continue
        try:
            choice = rule.select(*size)
        except UserError as error:  # an image too small or narrow for the bucket steps: name it
            raise UserError(f"{image_path}: {error}") from None
        key = image_key(image_path, args.full_path)
        width, height = choice.bucket_wh
        metadata.setdefault(key, {})["train_resolution"] = [width - width % 8, height - height % 8]
        bucket_counts[choice.bucket_wh] = bucket_counts.get(choice.bucket_wh, 0) + 1
        planned.append(PlannedImage(len(planned), str(image_path), "", size, choice.bucket_wh, choice.resized_wh,
                                    choice.aspect_error, 1, subset, 0))
    if planned:
        vae = load_prepare_vae(args.model_name_or_path, kind, args.model_config_dir,
                               MIXED_PRECISION_DTYPES[args.mixed_precision])
        with torch.no_grad():
            cache_latents(planned, vae, to_disk=True, is_sdxl=kind == "sdxl", vae_batch_size=args.batch_size)
    for index, bucket in enumerate(sorted(bucket_counts)):
        print(f"bucket {index} {bucket}: {bucket_counts[bucket]}")
    if planned:
        print(f"mean ar error: {sum(abs(image.aspect_error) for image in planned) / len(planned)}")
    write_metadata(args.out_json, metadata)
    print(f"wrote {args.out_json} ({len(planned)} images with train_resolution)")
    return metadata


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """kohya's options of ``prepare_buckets_latents.py`` (names, defaults) and ``--model_config_dir``."""
    parser.add_argument("train_data_dir", type=str, help="folder of the training images")
    parser.add_argument("in_json", type=str, help="metadata JSON to read (from merge_captions_to_metadata.py)")
    parser.add_argument("out_json", type=str, help="metadata JSON to write (.json)")
    parser.add_argument("model_name_or_path", type=str,
                        help="base model whose VAE encodes the latents (diffusers folder or .safetensors/.ckpt)")
    parser.add_argument("--v2", action="store_true", help="not used (kept for kohya's command lines)")
    parser.add_argument("--batch_size", type=int, default=1, help="images per VAE batch (default: 1)")
    parser.add_argument("--max_data_loader_n_workers", type=int, default=None,
                        help="accepted for kohya's command lines; images are read in this process (default: none)")
    parser.add_argument("--max_resolution", type=str, default="512,512",
                        help="training area 'width,height' the bucket table is built for (default: 512,512)")
    parser.add_argument("--min_bucket_reso", type=int, default=256, help="smallest bucket side, pixels (default: 256)")
    parser.add_argument("--max_bucket_reso", type=int, default=1024, help="largest bucket side, pixels (default: 1024)")
    parser.add_argument("--bucket_reso_steps", type=int, default=64,
                        help="bucket side step, pixels; a multiple of 32 for SDXL (default: 64)")
    parser.add_argument("--bucket_no_upscale", action="store_true",
                        help="one bucket per image size, images never enlarged (default: off)")
    parser.add_argument("--mixed_precision", type=str, default="no", choices=["no", "fp16", "bf16"],
                        help="VAE precision (default: no, float32)")
    parser.add_argument("--full_path", action="store_true",
                        help="metadata keys are image paths, not file stems (default: off)")
    parser.add_argument("--flip_aug", action="store_true",
                        help="also cache the latents of the mirrored images, for flip_aug training (default: off)")
    parser.add_argument("--alpha_mask", type=str, default="",
                        help="any non-empty value: cache each image's alpha channel as its loss mask (kohya's "
                             "string option; default: off)")
    parser.add_argument("--skip_existing", action="store_true",
                        help="accepted for kohya's command lines: a cache entry made from the same image, bucket "
                             "and VAE is always kept, any other is rebuilt")
    parser.add_argument("--recursive", action="store_true",
                        help="also take images in subfolders (needs --full_path; default: off)")
    parser.add_argument("--model_config_dir", type=str, default=None,
                        help="(ours) diffusers-format config folder whose vae/config.json describes a single-file "
                             "model's VAE (default: the shipped SDXL / SD1.5 config)")
