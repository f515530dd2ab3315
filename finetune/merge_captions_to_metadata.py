"""kohya's finetune/merge_captions_to_metadata.py: captions into the fine-tuning metadata JSON.

    python finetune/merge_captions_to_metadata.py IMAGE_DIR meta_cap.json [--in_json FILE]
        [--caption_extension .caption] [--full_path] [--recursive]

Each image's ``<stem><caption_extension>`` text becomes its entry's ``caption``. Without ``--in_json``
an existing ``out_json`` is updated; other entries and fields are kept.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402

from library.datasets.finetune_metadata import add_merge_arguments, merge_text_files  # noqa: E402
from library.errors import exit_on_user_error  # noqa: E402


def setup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_merge_arguments(parser, "caption", default_extension=".caption")
    parser.add_argument("--caption_extention", type=str, default=None,
                        help="old misspelt name of --caption_extension, kept for kohya's command lines")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = setup_parser().parse_args(argv)
    extension = args.caption_extention if args.caption_extention is not None else args.caption_extension
    merge_text_files(args.train_data_dir, args.out_json, args.in_json, extension, "caption", args.full_path,
                     args.recursive, args.debug)


if __name__ == "__main__":
    exit_on_user_error(main)
