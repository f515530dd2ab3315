"""kohya's fine-tuning metadata JSON as its ``finetune/`` preparation scripts build it.

The file maps an image key to a dict: ``{"<key>": {"caption": ..., "tags": ..., "train_resolution": [w, h]}}``.
The key is the image's file stem, or with ``--full_path`` the image path as found under the
image folder (``str(Path(train_data_dir) / name)``, so relative when the folder is). The scripts
update such a file field by field: ``merge_captions_to_metadata.py`` sets ``caption`` from caption
files, ``merge_dd_tags_to_metadata.py`` sets ``tags`` from tag files, ``prepare_buckets_latents.py``
sets ``train_resolution`` (kohya keeps entries and fields it does not set, in their order). The
trainer reads the file with ``--in_json`` (``library.datasets.sources``).
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Optional

from library import atomic_files
from library.datasets.images import is_image_file
from library.errors import UserError
from library.tool_paths import check_output_path

Metadata = dict[str, dict]


def find_images(train_data_dir: str, recursive: bool) -> list[Path]:
    """The images in ``train_data_dir`` (and its subfolders with ``recursive``), sorted as kohya's
    ``glob_images_pathlib`` sorts them (by path); names as found under the folder as given."""
    folder = Path(train_data_dir)
    if not folder.is_dir():
        raise UserError(f"train_data_dir {train_data_dir} is not a folder; give the folder holding the images")
    candidates = folder.rglob("*") if recursive else folder.glob("*")
    return sorted(path for path in candidates if is_image_file(path.name) and path.is_file())


def image_key(image_path: Path | str, full_path: bool) -> str:
    """kohya's metadata key: the path as found with ``--full_path``, else the file stem."""
    return str(image_path) if full_path else os.path.splitext(os.path.basename(image_path))[0]


def check_key_options(full_path: bool, recursive: bool) -> None:
    """kohya refuses ``--recursive`` without ``--full_path``: stems of subfolders would collide."""
    if recursive and not full_path:
        raise UserError("--recursive needs --full_path (images of different folders may share a file name)")


def read_metadata(path: str, flag: str) -> Metadata:
    """A metadata JSON file (``flag`` names where it came from in errors)."""
    try:
        with open(path, encoding="utf-8") as file:
            metadata = json.load(file)
    except FileNotFoundError:
        raise UserError(f"{flag} {path} does not exist; give the metadata JSON written by the previous step") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"{flag} {path} is not a metadata JSON file ({error})") from None
    if not isinstance(metadata, dict) or not all(isinstance(entry, dict) for entry in metadata.values()):
        raise UserError(f"{flag} {path} is not kohya metadata: it must map image keys to {{\"caption\": ...}} objects")
    return metadata


def write_metadata(path: str, metadata: Metadata) -> None:
    """Write ``metadata`` as kohya does (``json.dumps(indent=2)``, UTF-8) through the atomic writer."""
    atomic_files.write_file(path, json.dumps(metadata, indent=2))


def check_out_json(out_json: str, train_data_dir: str) -> None:
    """``out_json`` must be a ``.json`` file name (the trainer reads ``.jsonl`` as JSON lines)."""
    check_output_path("out_json", out_json, [("train_data_dir", train_data_dir)], suffixes=(".json",))


def merge_text_files(train_data_dir: str, out_json: str, in_json: Optional[str], extension: str, field: str,
                     full_path: bool, recursive: bool, debug: bool = False) -> Metadata:
    """kohya's ``merge_captions_to_metadata`` / ``merge_dd_tags_to_metadata``: for every image, the text
    of ``<image stem><extension>`` (stripped) becomes ``metadata[key][field]``; the metadata starts from
    ``in_json``, else from ``out_json`` when it exists (updated in place), else empty. Writes ``out_json``.

    Every image needs its text file (kohya stops at the first missing one); the error names them all.
    """
    check_key_options(full_path, recursive)
    check_out_json(out_json, train_data_dir)
    if not extension:
        raise UserError(f"--caption_extension is empty; give the {field} files' extension, e.g. .txt")
    images = find_images(train_data_dir, recursive)
    print(f"found {len(images)} images.")
    if in_json is None and os.path.isfile(out_json):
        in_json = out_json
    if in_json is not None:
        print(f"loading existing metadata: {in_json} ({field} of existing images will be overwritten)")
        metadata = read_metadata(in_json, "--in_json")
    else:
        print("new metadata will be created")
        metadata = {}
    text_paths = [Path(f"{path.with_suffix('')}{extension}") for path in images]  # kohya: with_suffix(extension)
    missing = [str(path) for path in text_paths if not path.is_file()]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise UserError(f"{missing[0]}{more} not found: every image needs its {field} file "
                        f"(<image name>{extension}); pass --caption_extension with the files' extension")
    for image_path, text_path in zip(images, text_paths):
        try:
            text = text_path.read_text(encoding="utf-8").strip()
        except UnicodeDecodeError as error:
            raise UserError(f"{text_path} is not UTF-8 text ({error}); save it as UTF-8") from None
        key = image_key(image_path, full_path)
        metadata.setdefault(key, {})[field] = text
        if debug:
            print(f"{key} {text}")
    write_metadata(out_json, metadata)
    print(f"wrote {out_json} ({len(images)} images, {len(metadata)} entries)")
    return metadata


def add_merge_arguments(parser: argparse.ArgumentParser, field: str, default_extension: str) -> None:
    """kohya's options of the two merge scripts (names, defaults); ``field`` is what the text files hold."""
    parser.add_argument("train_data_dir", type=str, help="folder of the training images")
    parser.add_argument("out_json", type=str, help="metadata JSON to write (.json)")
    parser.add_argument("--in_json", type=str, default=None,
                        help="metadata JSON to start from (default: out_json when it exists, else a new file)")
    parser.add_argument("--caption_extension", type=str, default=default_extension,
                        help=f"extension of the {field} files (default: {default_extension})")
    parser.add_argument("--full_path", action="store_true",
                        help="metadata keys are image paths, not file stems (several image folders; default: off)")
    parser.add_argument("--recursive", action="store_true",
                        help="also take images in subfolders (needs --full_path; default: off)")
    parser.add_argument("--debug", action="store_true", help=f"print each image's {field}")
