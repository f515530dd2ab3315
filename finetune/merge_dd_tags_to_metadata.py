"""kohya's finetune/merge_dd_tags_to_metadata.py: tagger tags into the fine-tuning metadata JSON.

    python finetune/merge_dd_tags_to_metadata.py IMAGE_DIR meta_cap_dd.json [--in_json meta_cap.json]
        [--caption_extension .txt] [--full_path] [--recursive]

Each image's ``<stem><caption_extension>`` text (e.g. from a WD14 tagger) becomes its entry's ``tags``;
the trainer appends them to the caption. Without ``--in_json`` an existing ``out_json`` is updated.
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
    add_merge_arguments(parser, "tags", default_extension=".txt")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = setup_parser().parse_args(argv)
    merge_text_files(args.train_data_dir, args.out_json, args.in_json, args.caption_extension, "tags",
                     args.full_path, args.recursive, args.debug)


if __name__ == "__main__":
    exit_on_user_error(main)
