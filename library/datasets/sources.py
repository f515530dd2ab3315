"""Where images and captions come from: DreamBooth folders and kohya's fine-tuning metadata files.

``dreambooth_subsets_from_folders`` turns ``--train_data_dir`` / ``--reg_data_dir``
into subset tables (kohya: one subset per ``<repeats>_<class tokens>`` folder);
``list_subset_images`` lists the images of one subset with their raw captions and,
when known without opening the image, their sizes.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

from library import atomic_files
from library.datasets.captions import read_caption_file
from library.datasets.config import SubsetSpec
from library.datasets.images import IMAGE_EXTENSIONS, is_image_file
from library.errors import UserError

INFO_CACHE_FILE = "metadata_cache.json"  # kohya's cache_info file, one per image folder


@dataclass
class ImageRecord:
    """One image of one subset: its path, raw caption and upright size (width, height)."""

    path: str
    caption: str
    size_wh: Optional[tuple[int, int]]
    subset_index: int
    num_repeats: int
    # Fine-tuning only: the entry's "tags", which kohya counts for ss_tag_frequency (DreamBooth
    # counts the caption), and the entry's place in kohya's order (longest image key first).
    tags: Optional[str] = None
    tags_order: int = 0


def dreambooth_subsets_from_folders(train_data_dir: Optional[str], reg_data_dir: Optional[str]) -> list[dict]:
    """kohya's subsets for ``<repeats>_<class tokens>`` subfolders (sorted by name for determinism)."""
    subsets = []
    for flag, base, is_reg in (("--train_data_dir", train_data_dir, False), ("--reg_data_dir", reg_data_dir, True)):
        if not base:  # unset, or the empty string kohya_ss GUI writes for an unused folder
            continue
        if not os.path.isdir(base):
            raise UserError(f"{flag} {base} is not a folder")
        found, no_repeats = [], []
        for name in sorted(os.listdir(base)):
            folder = os.path.join(base, name)
            if not os.path.isdir(folder):
                continue
            repeats_text, _, class_tokens = name.partition("_")
            try:
                num_repeats = int(repeats_text)
            except ValueError:
                print(f"ignoring {folder}: folder names must be <repeats>_<class tokens>, e.g. 10_sks dog")
                continue
            if num_repeats < 1:
                print(f"ignoring {folder}: the repeat count {num_repeats} is less than 1")
                no_repeats.append(name)
                continue
            found.append({"image_dir": folder, "num_repeats": num_repeats, "is_reg": is_reg,
                          "class_tokens": class_tokens})
        if not found and no_repeats:
            raise UserError(f"{flag} {base}: the repeat count of {no_repeats[0]} is less than 1, so it is ignored "
                            f"(as in kohya); the count before _ must be 1 or more (e.g. 10_sks dog)")
        if not found:
            has_images = any(is_image_file(name) for name in os.listdir(base))
            hint = " (it holds images directly: move them into a subfolder such as 10_sks dog)" if has_images else ""
            raise UserError(
                f"{flag} {base} has no <repeats>_<class tokens> subfolders{hint}; "
                f"the flag names the parent of folders like 10_sks dog"
            )
        subsets += found
    return subsets


def list_subset_images(subset: SubsetSpec, subset_index: int) -> list[ImageRecord]:
    """The images of ``subset`` with their raw captions, sorted by path."""
    if subset.metadata_file is not None:
        return _finetuning_images(subset, subset_index)
    return _dreambooth_images(subset, subset_index)


def _glob_images(folder: str) -> list[str]:
    return sorted(
        os.path.join(folder, name)
        for name in os.listdir(folder)
        if is_image_file(name) and os.path.isfile(os.path.join(folder, name))
    )


def _dreambooth_images(subset: SubsetSpec, subset_index: int) -> list[ImageRecord]:
    folder = subset.image_dir
    if not os.path.isdir(folder):
        raise UserError(f"{subset.where}: image_dir {folder} is not a folder (relative paths start at the "
                        f"working directory, as in kohya)")
    info_path = os.path.join(folder, INFO_CACHE_FILE)
    if subset.cache_info and os.path.isfile(info_path):
        with open(info_path, encoding="utf-8") as file:
            cached = json.load(file)
        return [
            ImageRecord(path, meta["caption"], tuple(meta["resolution"]), subset_index, subset.num_repeats)
            for path, meta in sorted(cached.items())
            if os.path.isfile(path)
        ]
    records = []
    missing = []
    for path in _glob_images(folder):
        caption = read_caption_file(path, subset.caption_extension, subset.captions.enable_wildcard)
        if caption is None:
            missing.append(path)
            caption = subset.class_tokens or ""
        records.append(ImageRecord(path, caption, None, subset_index, subset.num_repeats))
    if missing:
        fallback = f"class tokens '{subset.class_tokens}'" if subset.class_tokens else "an empty caption"
        shown = ", ".join(os.path.basename(path) for path in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        print(f"{len(missing)} images in {folder} have no {subset.caption_extension} caption file "
              f"({shown}{more}): using {fallback}")
    return records


def write_info_cache(subset: SubsetSpec, records: list[ImageRecord]) -> None:
    """kohya's ``cache_info``: captions and sizes of a folder in ``metadata_cache.json``."""
    info = {record.path: {"caption": record.caption, "resolution": list(record.size_wh)} for record in records}
    path = os.path.join(subset.image_dir, INFO_CACHE_FILE)
    atomic_files.write_file(path, json.dumps(info, ensure_ascii=False, indent=2))
    print(f"cached image info of {subset.image_dir} in {path}")


def _finetuning_images(subset: SubsetSpec, subset_index: int) -> list[ImageRecord]:
    """kohya's fine-tuning metadata: ``{image: {"caption", "tags", "image_size"}}`` (.json) or JSON lines."""
    path = subset.metadata_file
    if not os.path.isfile(path):
        raise UserError(f"{subset.where}: metadata_file {path} not found")
    try:
        with open(path, encoding="utf-8-sig") as file:
            if path.endswith(".jsonl"):
                metadata = {}
                for line in file:
                    if line.strip():
                        entry = json.loads(line)
                        metadata[entry["image_path"]] = entry
            else:
                metadata = json.load(file)
    except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as error:
        raise UserError(f"{subset.where}: metadata_file {path} is not kohya metadata JSON ({error})") from None
    if not isinstance(metadata, dict):
        raise UserError(f"{subset.where}: metadata_file {path} must map image names to {{\"caption\": ...}}")
    records = []
    kohya_order = {key: rank for rank, key in enumerate(sorted(metadata, key=len, reverse=True))}
    for image_key in sorted(metadata):
        entry = metadata[image_key] or {}
        image_path = _resolve_image(image_key, subset, path)
        caption = entry.get("caption") or ""
        tags = entry.get("tags")
        if tags:
            if subset.captions.enable_wildcard:
                tags = tags.replace("\n", subset.captions.caption_separator)
                caption = "\n".join(f"{line}{subset.captions.caption_separator}{tags}"
                                    for line in caption.split("\n") if line.strip())
            else:
                caption = (caption + subset.captions.caption_separator if caption else "") + tags
        size = entry.get("image_size")
        records.append(ImageRecord(image_path, caption, tuple(size) if size else None, subset_index,
                                   subset.num_repeats, tags or None, kohya_order[image_key]))
    return records


def _resolve_image(image_key: str, subset: SubsetSpec, metadata_path: str) -> str:
    """An absolute key as is; a relative one under image_dir, trying image extensions when it has none."""
    if os.path.isabs(image_key):
        candidate = image_key
    else:
        if subset.image_dir is None:
            raise UserError(f"{subset.where}: {metadata_path} has relative image names ({image_key}): set image_dir")
        candidate = os.path.join(subset.image_dir, image_key)
    if os.path.isfile(candidate):
        return candidate
    for extension in IMAGE_EXTENSIONS + tuple(e.upper() for e in IMAGE_EXTENSIONS):
        if os.path.isfile(candidate + extension):
            return candidate + extension
    raise UserError(f"{subset.where}: image {candidate} listed in {metadata_path} not found")


def balance_regularization(train_samples: int, reg_records: list[ImageRecord]) -> list[ImageRecord]:
    """kohya's rule: regularisation repeats add up to (at least) the training sample count.

    The first pass takes reg images in order with their own repeats until the count is
    reached (later images are dropped); further passes add one repeat per image in
    order. Mutates ``num_repeats`` and returns the reg images that are used.
    """
    used: list[ImageRecord] = []
    total = 0
    first_pass = True
    while total < train_samples and reg_records:
        for record in reg_records:
            if first_pass:
                used.append(record)
                total += record.num_repeats
            else:
                record.num_repeats += 1
                total += 1
            if total >= train_samples:
                break
        first_pass = False
    return used
