"""``--cache_latents`` / ``--cache_latents_to_disk``: VAE latents computed once, before training.

What is cached: the VAE's latent *distribution* (mean and standard deviation,
unscaled, float32) rather than one sample of it as kohya does. The trainer then
draws ``mean + std * eps`` with ``eps`` keyed by (seed, epoch, sample), exactly what
it does without a cache, so a cached run trains on the same latents as an uncached
one (up to VAE arithmetic) and each epoch still sees a fresh sample.

Disk files sit beside the image with kohya's name ``<stem>_<W>x<H>_sdxl.npz``
(``_sd.npz`` for SD1/2; W x H is the image size) and kohya's keys (``latents`` =
the mean, ``original_size``, ``crop_ltrb``, ``latents_flipped``, ``alpha_mask``), so
kohya can read them, plus ``latents_std`` / ``latents_flipped_std`` and
``cache_meta``: what the pixels fed to the VAE depended on (image file size and
mtime, bucket, resize, crop, alpha handling, interpolation) and a VAE fingerprint.
A file whose metadata differs is stale: it is rebuilt, never used. Every entry's keys carry
kohya v0.11.1's suffix ``_<h>x<w>`` (the latent height and width: ``latents_128x96``,
``original_size_128x96``, ...; kohya v0.10.2+ writes SD/SDXL caches so, since one image may
be used at several buckets by a multi-resolution dataset config); entries without a suffix
(kohya before v0.10.2, this trainer before v0.11.1 support) are still read when their
``latents`` have this bucket's latent size, as kohya v0.11.1 reads them, and are dropped
from a file when an entry is written into it.

A file written by kohya's ``--cache_latents_to_disk`` (no ``cache_meta``; also kohya's oldest name
``<stem>.npz``, which kohya v0.11.1 still uses when it exists) is used when it fits the
run as kohya's own check would take it and more: latents of this bucket's latent size, the image's
``original_size`` and kohya's ``crop_ltrb`` for this bucket, flipped latents when ``flip_aug`` is on,
an alpha mask when ``alpha_mask`` is. It holds one VAE *sample*, not the distribution: those images
train on that fixed sample at every step, as in kohya (its ``std`` is taken as 0); delete the files
for a fresh sample per step. One line says how many were reused. kohya records neither the image's
date nor the VAE: a kohya file is trusted to come from this image and this model, as kohya trusts it.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from library import atomic_files, noise
from library.datasets.buckets import center_crop_top_left
from library.datasets.images import ensure_size, load_image, resize_crop_flip
from library.datasets.plan import PlannedImage, variants_by_path
from library.errors import UserError

CACHE_FORMAT = 1


@dataclass(frozen=True)
class LatentVariant:
    """Everything the pixels fed to the VAE depend on, for one image."""

    bucket_wh: tuple[int, int]
    resized_wh: tuple[int, int]
    crop_top_left: tuple[int, int]
    alpha_mask: bool
    interpolation: Optional[str]


@dataclass
class CachedLatents:
    """One image's cached distribution (unscaled), its mirrored twin when flip_aug is on, its alpha mask."""

    mean: torch.Tensor
    std: torch.Tensor
    mean_flipped: Optional[torch.Tensor] = None
    std_flipped: Optional[torch.Tensor] = None
    alpha_mask: Optional[torch.Tensor] = None


def variant_of(image: PlannedImage) -> LatentVariant:
    return LatentVariant(image.bucket_wh, image.resized_wh, center_crop_top_left(image.resized_wh, image.bucket_wh),
                         image.subset.alpha_mask, image.subset.resize_interpolation)


def npz_path(image: PlannedImage, is_sdxl: bool) -> str:
    width, height = image.size_wh
    return f"{os.path.splitext(image.path)[0]}_{width:04d}x{height:04d}{'_sdxl' if is_sdxl else '_sd'}.npz"


def kohya_old_npz_path(image: PlannedImage) -> str:
    """kohya's oldest cache name, ``<stem>.npz`` (unsuffixed keys), which kohya v0.11.1 still reads
    (and writes) when it exists; read here, never written."""
    return os.path.splitext(image.path)[0] + ".npz"


def vae_fingerprint(vae) -> str:
    """A short hash of the VAE's first and last encoder weights (dtype-independent up to fp16)."""
    digest = hashlib.sha1()
    for tensor in (vae.encoder.conv_in.weight, vae.encoder.conv_out.weight):
        digest.update(tensor.detach().to("cpu", torch.float16).numpy().tobytes())
    digest.update(str(vae.config.latent_channels).encode())
    return digest.hexdigest()[:16]


def kohya_crop_ltrb(bucket_wh: tuple[int, int], original_wh: tuple[int, int]) -> tuple[float, ...]:
    """kohya's ``crop_ltrb`` file field (``BucketManager.get_crop_ltrb``: its own convention, floats),
    so kohya reads these caches and a kohya file is recognised as made for this bucket."""
    bucket_aspect = bucket_wh[0] / bucket_wh[1]
    image_aspect = original_wh[0] / original_wh[1]
    if bucket_aspect > image_aspect:
        width, height = bucket_wh[1] * image_aspect, bucket_wh[1]
    else:
        width, height = bucket_wh[0], bucket_wh[0] / image_aspect
    left, top = (bucket_wh[0] - width) // 2, (bucket_wh[1] - height) // 2
    return float(left), float(top), float(left + width), float(top + height)


class LatentStore:
    """Cached latents by image index, in memory or as npz files; returns them scaled for the UNet."""

    def __init__(self, scaling_factor: float) -> None:
        self.scaling_factor = scaling_factor
        self.in_memory: dict[int, CachedLatents] = {}
        self.on_disk: dict[int, tuple[str, str]] = {}  # image index -> (npz path, key suffix)

    def __contains__(self, image_index: int) -> bool:
        return image_index in self.in_memory or image_index in self.on_disk

    def get(self, image_index: int, flipped: bool) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(mean, std) scaled by the VAE's scaling factor, and the alpha mask (H, W), mirrored if ``flipped``."""
        if image_index in self.in_memory:
            entry = self.in_memory[image_index]
        else:
            path, suffix = self.on_disk[image_index]
            entry = _read_entry(path, suffix, flipped)
        mean, std = (entry.mean_flipped, entry.std_flipped) if flipped else (entry.mean, entry.std)
        if std is None:  # a kohya file: one fixed sample
            std = torch.zeros_like(mean)
        mask = entry.alpha_mask
        if mask is not None and flipped:
            mask = torch.flip(mask, dims=[1])
        return mean * self.scaling_factor, std * self.scaling_factor, mask


def sample_cached_latents(batch: dict, seed: int, epoch: int) -> torch.Tensor:
    """The batch's latents, ``mean + std * eps`` with the same keyed ``eps`` as ``encode_latents``."""
    mean, std = batch["latents"], batch["latents_std"]
    eps = noise.draw_latent_samples(seed, epoch, batch["sample_indices"].tolist(), tuple(mean.shape[1:]))
    return mean + std * eps.to(mean.device)


def _read_entry(path: str, suffix: str, flipped: bool) -> CachedLatents:
    with np.load(path) as npz:
        def tensor(key: str) -> Optional[torch.Tensor]:
            key += suffix
            return torch.from_numpy(npz[key]) if key in npz.files else None

        if flipped:
            return CachedLatents(torch.empty(0), torch.empty(0), tensor("latents_flipped"),
                                 tensor("latents_flipped_std"), tensor("alpha_mask"))
        return CachedLatents(tensor("latents"), tensor("latents_std"), alpha_mask=tensor("alpha_mask"))


def latent_size_suffix(bucket_wh: tuple[int, int]) -> str:
    """kohya v0.11.1's key suffix of an SD/SDXL latent cache entry: ``_<latent h>x<latent w>``."""
    return f"_{bucket_wh[1] // 8}x{bucket_wh[0] // 8}"


def _variant_suffixes(variants: set[LatentVariant]) -> dict[LatentVariant, str]:
    """Key suffixes of one file's entries: kohya's ``_<latent h>x<latent w>``; when two variants of
    one file share a latent size (alpha handling or resize differs), the others get ``_alpha``,
    and ``_2``, ``_3``... if still ambiguous (kohya has one entry per size)."""
    suffixes: dict[LatentVariant, str] = {}
    taken: dict[str, int] = {}
    sizes = [latent_size_suffix(variant.bucket_wh) for variant in variants]
    for variant in sorted(variants, key=repr):
        suffix = latent_size_suffix(variant.bucket_wh)
        if variant.alpha_mask and sizes.count(suffix) > 1:
            suffix += "_alpha"
        taken[suffix] = taken.get(suffix, 0) + 1
        suffixes[variant] = suffix if taken[suffix] == 1 else f"{suffix}_{taken[suffix]}"
    return suffixes


def _stored_suffix(npz, suffix: str, bucket_wh: tuple[int, int]) -> Optional[str]:
    """The suffix under which ``npz`` holds the entry keyed ``suffix``: itself, or ``""`` for a
    file written before v0.11.1's suffixes whose unsuffixed ``latents`` have this bucket's latent
    size (kohya v0.11.1's fallback); None when it holds neither."""
    names = set(npz.files)
    if "latents" + suffix in names:
        return suffix
    legacy_ok = suffix == latent_size_suffix(bucket_wh) and "latents" in names
    if legacy_ok and tuple(npz["latents"].shape[-2:]) == (bucket_wh[1] // 8, bucket_wh[0] // 8):
        return ""
    return None


def _expected_meta(image: PlannedImage, variant: LatentVariant, vae_id: str) -> dict:
    stat = os.stat(image.path)
    return {
        "format": CACHE_FORMAT, "image_bytes": stat.st_size, "image_mtime_ns": stat.st_mtime_ns,
        "original_size": list(image.size_wh), "bucket": list(variant.bucket_wh), "resized": list(variant.resized_wh),
        "crop_top_left": list(variant.crop_top_left), "alpha_mask": variant.alpha_mask,
        "interpolation": variant.interpolation, "vae": vae_id,
    }


def _fresh_suffix(path: str, suffix: str, expected: dict, needs_flip: bool) -> Optional[str]:
    """The suffix of the npz's entry made from exactly these pixels with this VAE, or None."""
    if not os.path.isfile(path):
        return None
    try:
        with np.load(path) as npz:
            stored_suffix = _stored_suffix(npz, suffix, tuple(expected["bucket"]))
            names = set(npz.files)
            if stored_suffix is None or "cache_meta" + stored_suffix not in names:
                return None
            stored = json.loads(str(npz["cache_meta" + stored_suffix]))
    except Exception:  # unreadable or truncated file: rebuild it
        return None
    flipped_stored = stored.pop("flip", False)
    required = {"latents", "latents_std"} | ({"latents_flipped", "latents_flipped_std"} if needs_flip else set())
    if expected["alpha_mask"]:
        required.add("alpha_mask")
    fresh = (stored == expected and (flipped_stored or not needs_flip)
             and all(k + stored_suffix in names for k in required))
    return stored_suffix if fresh else None


def _kohya_suffix(path: str, suffix: str, image: PlannedImage, variant: LatentVariant, needs_flip: bool,
                  latent_channels: int) -> Optional[str]:
    """The suffix of the npz's kohya-ss entry (no ``cache_meta``) made for this image at this bucket
    (latent size, original size, crop), with the flipped latents and alpha mask the run needs; None
    when there is none."""
    if not os.path.isfile(path):
        return None
    width, height = variant.bucket_wh
    try:
        with np.load(path) as npz:
            stored_suffix = _stored_suffix(npz, suffix, variant.bucket_wh)
            if stored_suffix is None:
                return None
            names = set(npz.files)
            if "cache_meta" + stored_suffix in names:
                return None
            if needs_flip and "latents_flipped" + stored_suffix not in names:
                return None
            if variant.alpha_mask and "alpha_mask" + stored_suffix not in names:
                return None
            shape_ok = npz["latents" + stored_suffix].shape == (latent_channels, height // 8, width // 8)
            size_ok = npz["original_size" + stored_suffix].tolist() == list(image.size_wh)
            crop_ok = (npz["crop_ltrb" + stored_suffix].tolist()
                       == list(kohya_crop_ltrb(variant.bucket_wh, image.size_wh)))
    except Exception:  # unreadable, truncated or missing fields: not usable
        return None
    return stored_suffix if shape_ok and size_ok and crop_ok else None


def _write_entry(path: str, suffix: str, image: PlannedImage, meta: dict, entry: CachedLatents) -> None:
    """Write one entry to ``path`` atomically, keeping the file's entries for other latent sizes
    (unsuffixed entries of older files are dropped: stale, or the one being replaced)."""
    arrays: dict[str, np.ndarray] = {}
    if os.path.isfile(path):
        replaced = {base + suffix for base in _ENTRY_KEYS} | set(_ENTRY_KEYS)
        try:
            with np.load(path) as npz:
                arrays = {key: npz[key] for key in npz.files if key not in replaced}
        except Exception:  # a damaged file is replaced
            arrays = {}
    arrays["latents" + suffix] = entry.mean.numpy()
    arrays["latents_std" + suffix] = entry.std.numpy()
    arrays["original_size" + suffix] = np.array(image.size_wh)
    arrays["crop_ltrb" + suffix] = np.array(kohya_crop_ltrb(image.bucket_wh, image.size_wh))
    if entry.mean_flipped is not None:
        arrays["latents_flipped" + suffix] = entry.mean_flipped.numpy()
        arrays["latents_flipped_std" + suffix] = entry.std_flipped.numpy()
    if entry.alpha_mask is not None:
        arrays["alpha_mask" + suffix] = entry.alpha_mask.numpy()
    arrays["cache_meta" + suffix] = np.array(json.dumps({**meta, "flip": entry.mean_flipped is not None}))
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    atomic_files.write_file(path, buffer.getvalue())


_ENTRY_KEYS = ("latents", "latents_std", "latents_flipped", "latents_flipped_std", "alpha_mask", "original_size",
               "crop_ltrb", "cache_meta")


def _pixels(image: PlannedImage, variant: LatentVariant) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The VAE input (3, H, W) in [-1, 1] and the alpha mask (H, W) in [0, 1] when alpha_mask is on."""
    decoded = load_image(image.path, keep_alpha=variant.alpha_mask)
    ensure_size(image.path, decoded, image.size_wh)
    array = resize_crop_flip(decoded, variant.resized_wh, variant.bucket_wh, variant.crop_top_left, False,
                             variant.interpolation)
    pixels = torch.from_numpy(np.ascontiguousarray(array[:, :, :3])).permute(2, 0, 1).float().div(127.5).sub(1.0)
    mask = torch.from_numpy(array[:, :, 3].astype(np.float32) / 255.0) if variant.alpha_mask else None
    return pixels, mask


def _encode(vae, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        distribution = vae.encode(pixels.to(vae.device, dtype=vae.dtype)).latent_dist
    return distribution.mean.float().cpu(), distribution.std.float().cpu()


def _check_finite(image: PlannedImage, *tensors: torch.Tensor) -> None:
    if not all(torch.isfinite(tensor).all() for tensor in tensors):
        raise UserError(
            f"the VAE latents of {image.path} contain NaN or Inf (the VAE overflowed in half precision?): "
            f"pass --no_half_vae (and delete the cache if you keep it on disk)"
        )


def _check_cached_finite(image: PlannedImage, path: str, suffix: str) -> None:
    """A reused cache file (ours or kohya's) holding NaN/Inf latents is refused like fresh ones from the VAE:
    used as is, every step of its image would be skipped as a non-finite loss, with no file named."""
    with np.load(path) as npz:
        names = [key + suffix for key in ("latents", "latents_std", "latents_flipped", "latents_flipped_std")]
        if all(np.isfinite(npz[name]).all() for name in names if name in npz.files):
            return
    raise UserError(f"latent cache {path} (of {image.path}) holds NaN or Inf latents: delete it so that it is "
                    f"rebuilt (and pass --no_half_vae if the VAE that wrote it overflowed in half precision)")


def cache_latents(
    images: list[PlannedImage],
    vae,
    to_disk: bool,
    is_sdxl: bool,
    vae_batch_size: int = 1,
    is_main_process: bool = True,
    wait_for_everyone: Callable[[], None] = lambda: None,
) -> LatentStore:
    """Encode every image once (or reuse fresh npz files) and return the store the dataset reads.

    Images are encoded in groups of up to ``vae_batch_size`` sharing bucket and alpha
    handling. With ``to_disk`` only the main process writes files; the others wait and read.
    """
    store = LatentStore(float(vae.config.scaling_factor))
    vae_id = vae_fingerprint(vae)
    variants = variants_by_path(images, variant_of)
    needs_flip_by_path = {path: False for path in variants}
    for image in images:
        needs_flip_by_path[image.path] |= image.subset.flip_aug
    pending: list[tuple[PlannedImage, LatentVariant, str, str, dict]] = []
    seen: dict[tuple[str, LatentVariant], int] = {}
    stale = from_kohya = 0
    for image in images:
        variant = variant_of(image)
        if (image.path, variant) in seen:  # the same pixels already planned: share the entry
            continue
        seen[(image.path, variant)] = image.index
        suffix = _variant_suffixes(variants[image.path])[variant]
        path = npz_path(image, is_sdxl)
        meta = _expected_meta(image, variant, vae_id)
        needs_flip = needs_flip_by_path[image.path]
        fresh = _fresh_suffix(path, suffix, meta, needs_flip) if to_disk else None
        kohyas = None
        if to_disk and fresh is None:
            for candidate in (path, kohya_old_npz_path(image)):
                kohyas = _kohya_suffix(candidate, suffix, image, variant, needs_flip, int(vae.config.latent_channels))
                if kohyas is not None:
                    break
        if fresh is not None or kohyas is not None:
            reused = (path, fresh) if fresh is not None else (candidate, kohyas)
            _check_cached_finite(image, *reused)
            from_kohya += kohyas is not None
            store.on_disk[image.index] = reused
            continue
        if to_disk and os.path.isfile(path):
            stale += 1
        pending.append((image, variant, path, suffix, meta))
    if from_kohya:
        print(f"reused {from_kohya} latent cache files written by kohya-ss (one fixed VAE sample each, as in kohya; "
              f"delete them for a fresh sample per step)")
    if stale:
        print(f"rebuilding {stale} stale latent cache files (image, bucket or VAE changed)")
    if to_disk and not is_main_process:
        wait_for_everyone()  # the main process writes the files
        for image, variant, path, suffix, meta in pending:
            written = _fresh_suffix(path, suffix, meta, needs_flip_by_path[image.path])
            if written is None:
                raise UserError(f"latent cache {path} was not written by the main process")
            store.on_disk[image.index] = (path, written)
        return _share(store, images, seen)
    groups: dict[tuple, list] = {}
    for item in pending:
        groups.setdefault((item[1].bucket_wh, item[1].alpha_mask), []).append(item)
    done = 0
    for group in groups.values():
        for start in range(0, len(group), max(1, vae_batch_size)):
            chunk = group[start : start + max(1, vae_batch_size)]
            loaded = [_pixels(image, variant) for image, variant, *_ in chunk]
            pixels = torch.stack([pixel for pixel, _ in loaded])
            means, stds = _encode(vae, pixels)
            flip = any(needs_flip_by_path[image.path] for image, *_ in chunk)
            means_flipped, stds_flipped = _encode(vae, torch.flip(pixels, dims=[3])) if flip else (None, None)
            for row, (image, variant, path, suffix, meta) in enumerate(chunk):
                entry = CachedLatents(means[row].clone(), stds[row].clone(),
                                      means_flipped[row].clone() if flip else None,
                                      stds_flipped[row].clone() if flip else None, loaded[row][1])
                _check_finite(image, entry.mean, entry.std, *([entry.mean_flipped, entry.std_flipped] if flip else []))
                if to_disk:
                    _write_entry(path, suffix, image, meta, entry)
                    store.on_disk[image.index] = (path, suffix)
                else:
                    store.in_memory[image.index] = entry
            done += len(chunk)
        print(f"cached latents: {done}/{len(pending)}")
    if to_disk:
        wait_for_everyone()
    return _share(store, images, seen)


def _share(store: LatentStore, images: list[PlannedImage], seen: dict) -> LatentStore:
    """Images whose pixels equal an already cached image's (same file, same variant) share its entry."""
    for image in images:
        owner = seen[(image.path, variant_of(image))]
        if image.index == owner:
            continue
        if owner in store.in_memory:
            store.in_memory[image.index] = store.in_memory[owner]
        elif owner in store.on_disk:
            store.on_disk[image.index] = store.on_disk[owner]
    return store
