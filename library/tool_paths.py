"""Checks every file tool makes on its output path before it reads any model: the path is a
file the tool writes (not a folder, not one of its own inputs), with a suffix the tool can write.
A missing parent folder is fine: the atomic writer creates it.

A tool that writes over its own input loses the user's original (a base checkpoint replaced by
the merge, a LoRA replaced by a lossy copy of itself), so the tools refuse that in one line.
"""
from __future__ import annotations

import os
from typing import Iterable, Optional, Sequence

from library.errors import UserError


def same_file(first: str, second: str) -> bool:
    """Whether two paths name the same file: the same real path, or (both existing) the same inode."""
    if os.path.realpath(first) == os.path.realpath(second):
        return True
    try:
        return os.path.samefile(first, second)
    except OSError:
        return False


def check_output_path(flag: str, path: str, inputs: Iterable[tuple[str, Optional[str]]],
                      suffixes: Sequence[str] = (".safetensors",)) -> None:
    """Refuse an output ``path`` (given as ``flag``) that is an existing folder, lacks one of
    ``suffixes``, or is one of the tool's ``inputs`` (``(flag, path)`` pairs; None paths are skipped).
    Raises ``UserError`` naming the flag; nothing is read or written."""
    if not path or not path.strip():
        raise UserError(f"{flag} is empty; give the file to write")
    if os.path.isdir(path):
        raise UserError(f"{flag} {path} is a folder; give a file name ending in {' or '.join(suffixes)}")
    if not path.lower().endswith(tuple(suffix.lower() for suffix in suffixes)):
        raise UserError(f"{flag} {path}: only {' or '.join(suffixes)} is written")
    for input_flag, input_path in inputs:
        if input_path is not None and same_file(path, input_path):
            raise UserError(f"{flag} {path} is the same file as {input_flag}; writing it would replace the input, "
                            f"give another output name")
