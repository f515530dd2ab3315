"""Caption files and kohya's caption transforms (prefix/suffix, dropout, wildcards, token warm-up,
shuffle, tag dropout).

``process_caption`` follows kohya-ss sd-scripts' ``process_caption`` step by step;
the only difference is the randomness: every draw comes from the generator it is
given, which the dataset keys by (seed, epoch, sample), so a caption does not depend
on batch size, worker count or the order samples are loaded in.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np

from library.errors import UserError

_WILDCARD = re.compile(r"\{([^}]+)\}")


@dataclass(frozen=True)
class CaptionOptions:
    """The caption settings of one subset (kohya's names and defaults)."""

    shuffle_caption: bool = False
    caption_separator: str = ","
    keep_tokens: int = 0
    keep_tokens_separator: str = ""
    secondary_separator: Optional[str] = None
    enable_wildcard: bool = False
    caption_prefix: Optional[str] = None
    caption_suffix: Optional[str] = None
    caption_dropout_rate: float = 0.0
    caption_dropout_every_n_epochs: int = 0
    caption_tag_dropout_rate: float = 0.0
    token_warmup_min: int = 1
    token_warmup_step: float = 0  # steps, or a fraction (< 1) of --max_train_steps

    @property
    def is_random(self) -> bool:
        """Whether the processed caption can differ between epochs or samples."""
        return bool(
            self.shuffle_caption
            or self.caption_dropout_rate > 0
            or self.caption_dropout_every_n_epochs > 0
            or self.caption_tag_dropout_rate > 0
            or self.enable_wildcard
            or self.token_warmup_step > 0
        )


def read_caption_file(image_path: str, caption_extension: str, enable_wildcard: bool) -> Optional[str]:
    """The caption beside ``image_path``, or None when there is no caption file.

    kohya's lookup: ``<stem><ext>``, then, for face-crop names ``a_b_x_y_w_h``, ``a_b<ext>``.
    The first line is the caption; with wildcards all non-empty lines are kept
    (one is chosen per sample). An empty file is a UserError, as in kohya.
    """
    stem = os.path.splitext(image_path)[0]
    candidates = [stem + caption_extension]
    parts = stem.split("_")
    if len(parts) >= 5:
        candidates.append("_".join(parts[:-4]) + caption_extension)
    for caption_path in candidates:
        if not os.path.isfile(caption_path):
            continue
        try:
            # utf-8-sig: Windows Notepad saves UTF-8 with a byte-order mark, which would otherwise
            # reach the tokenizer glued to the first word (usually the trigger word)
            with open(caption_path, encoding="utf-8-sig") as file:
                lines = file.readlines()
        except UnicodeDecodeError:
            raise UserError(f"caption file {caption_path} is not UTF-8 text; save it as UTF-8") from None
        if not lines:
            raise UserError(f"caption file {caption_path} is empty; write a caption or delete the file")
        if enable_wildcard:
            return "\n".join(line.strip() for line in lines if line.strip())
        return lines[0].strip()
    return None


def count_tags(counts: dict[str, int], texts: Iterable[str]) -> None:
    """Add each text's tags to ``counts`` as kohya's ``set_tag_frequency`` does for ss_tag_frequency.

    kohya splits at "," whatever ``caption_separator`` is, strips and lower-cases each
    tag and counts every occurrence (a tag twice in one caption counts twice); an image's
    repeats do not count.
    """
    for text in texts:
        for tag in text.split(","):
            tag = tag.strip().lower()
            if tag:
                counts[tag] = counts.get(tag, 0) + 1


def _split_tags(text: str, separator: str) -> list[str]:
    return [tag.strip() for tag in text.split(separator) if tag.strip()]


def process_caption(options: CaptionOptions, caption: str, epoch: int, rng: np.random.Generator,
                    step: int = 0, max_train_steps: int = 0) -> str:
    """The caption a sample is trained with in ``epoch`` (1-based), drawing from ``rng``.
    ``step`` (optimizer steps done before this sample's step) and ``max_train_steps`` matter
    only for token warm-up."""
    if options.caption_prefix:
        caption = options.caption_prefix + " " + caption
    if options.caption_suffix:
        caption = caption + " " + options.caption_suffix

    dropped = options.caption_dropout_rate > 0 and rng.random() < options.caption_dropout_rate
    every_n = options.caption_dropout_every_n_epochs
    if dropped or (every_n > 0 and epoch % every_n == 0):
        return ""

    if options.enable_wildcard:
        lines = caption.split("\n")
        if len(lines) > 1:
            caption = lines[int(rng.integers(len(lines)))]
        caption = _replace_wildcards(caption, rng)
    else:
        caption = caption.split("\n")[0]

    if options.shuffle_caption or options.caption_tag_dropout_rate > 0 or options.token_warmup_step > 0:
        caption = _shuffle_and_drop_tags(options, caption, rng, step, _warmup_steps(options, max_train_steps))

    if options.secondary_separator:
        caption = caption.replace(options.secondary_separator, options.caption_separator)
    return caption


def _replace_wildcards(caption: str, rng: np.random.Generator) -> str:
    """``{a|b|c}`` -> one of a, b, c; ``{{`` and ``}}`` are literal braces."""
    open_marker, close_marker = "\u2985", "\u2986"
    while open_marker in caption or close_marker in caption:
        open_marker += "\u2985"
        close_marker += "\u2986"
    caption = caption.replace("{{", open_marker).replace("}}", close_marker)

    def choose(match: re.Match) -> str:
        options = match.group(1).split("|")
        return options[int(rng.integers(len(options)))]

    caption = _WILDCARD.sub(choose, caption)
    return caption.replace(open_marker, "{").replace(close_marker, "}")


def _warmup_steps(options: CaptionOptions, max_train_steps: int) -> int:
    """Length of kohya's token warm-up in steps (a value below 1 is a fraction of the run); 0 = off."""
    if 0 < options.token_warmup_step < 1:
        return math.floor(options.token_warmup_step * max_train_steps)
    return int(options.token_warmup_step)


def _shuffle_and_drop_tags(options: CaptionOptions, caption: str, rng: np.random.Generator, step: int = 0,
                           warmup_steps: int = 0) -> str:
    """kohya's tag handling: fixed head, warm-up cut, shuffled/dropped middle, fixed tail; joined with ", "."""
    separator = options.caption_separator
    fixed_head: list[str] = []
    fixed_tail: list[str] = []
    keep_separator = options.keep_tokens_separator
    if keep_separator and keep_separator in caption:
        head, flexible_part = caption.split(keep_separator, 1)
        if keep_separator in flexible_part:
            flexible_part, tail = flexible_part.split(keep_separator, 1)
            fixed_tail = _split_tags(tail, separator)
        fixed_head = _split_tags(head, separator)
        flexible = _split_tags(flexible_part, separator)
    else:
        tags = [tag.strip() for tag in caption.strip().split(separator)]
        flexible = tags
        if options.keep_tokens > 0:
            fixed_head = tags[: options.keep_tokens]
            flexible = tags[options.keep_tokens :]

    if warmup_steps and step < warmup_steps:  # kohya's token warm-up: min tags at step 0, all at the end
        minimum = options.token_warmup_min
        # kohya's expression exactly (the division first): the rounding decides the count at some steps
        flexible = flexible[: math.floor(step * ((len(flexible) - minimum) / warmup_steps)) + minimum]
    if options.shuffle_caption:
        flexible = [flexible[i] for i in rng.permutation(len(flexible))]
    if options.caption_tag_dropout_rate > 0:
        flexible = [tag for tag in flexible if rng.random() >= options.caption_tag_dropout_rate]
    return ", ".join(fixed_head + flexible + fixed_tail)
