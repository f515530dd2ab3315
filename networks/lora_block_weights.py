"""kohya's ``--lbws`` (LoRA Block Weight) of the merge tools: one JSON list of per-block multipliers per LoRA.

A list has 12, 17, 20 or 26 numbers; its length says which of the 26 blocks ``BASE`` (the text
encoders), ``IN00``-``IN11``, ``MID``, ``OUT00``-``OUT11`` it sets, in that order (the other
blocks keep 1), as the LoRA Block Weight extension's presets:

* 12 (SDXL attention blocks): BASE, IN04, IN05, IN07, IN08, MID, OUT00-OUT05
* 17 (SD 1.x attention blocks): BASE, IN01, IN02, IN04, IN05, IN07, IN08, MID, OUT03-OUT11
* 20 (SDXL all blocks): BASE, IN00-IN08, MID, OUT00-OUT08
* 26 (SD 1.x all blocks): every block

A module's block comes from its kohya name: text encoder modules are BASE; SDXL's (original-layout)
``input_blocks_N`` are IN{N}, ``middle_block`` MID, ``output_blocks_N`` OUT{N}; SD 1.x's
(diffusers-layout) ``down_blocks_i_{resnets|attentions}_j`` are IN{3i+j+1}, ``down_blocks_i_downsamplers``
IN{3i+3}, ``mid_block`` MID, ``up_blocks_i_{resnets|attentions}_j`` OUT{3i+j}, ``up_blocks_i_upsamplers``
OUT{3i+2}. Modules of no block (e.g. SDXL's time embedding) keep their weight.
"""
from __future__ import annotations

import json
import re
from typing import Optional, Sequence

from library.errors import UserError

BLOCKS = ["BASE", *(f"IN{i:02d}" for i in range(12)), "MID", *(f"OUT{i:02d}" for i in range(12))]
_IN, _MID, _OUT = 1, 13, 14  # index of IN00, MID, OUT00 in BLOCKS

TARGET_BLOCKS = {
    12: ["BASE", "IN04", "IN05", "IN07", "IN08", "MID", *(f"OUT{i:02d}" for i in range(6))],
    17: ["BASE", "IN01", "IN02", "IN04", "IN05", "IN07", "IN08", "MID", *(f"OUT{i:02d}" for i in range(3, 12))],
    20: ["BASE", *(f"IN{i:02d}" for i in range(9)), "MID", *(f"OUT{i:02d}" for i in range(9))],
    26: BLOCKS,
}

_SD1_UNET_BLOCK = re.compile(r"(up|down)_blocks_(\d+)_(resnets|upsamplers|downsamplers|attentions)_(\d+)_")


def parse_lbws(lbws: Sequence[str], models: Sequence[str]) -> list[list[float]]:
    """Each ``--lbws`` JSON list as the 26 block multipliers (``BLOCKS`` order); UserError naming the
    flag and what is valid for a malformed one, a length other than 12/17/20/26, lists of different
    lengths, or not one list per ``--models`` file."""
    if len(lbws) != len(models):
        raise UserError(f"--lbws: {len(lbws)} list(s) for {len(models)} --models; give one per LoRA, "
                        f"e.g. --lbws \"[1,1,1,1,1,1,1,1,1,1,1,1]\" for each")
    parsed = []
    for text in lbws:
        try:
            values = json.loads(text)
        except json.JSONDecodeError:
            values = None
        if not isinstance(values, list) or not all(isinstance(value, (int, float)) and not isinstance(value, bool)
                                                   for value in values):
            raise UserError(f"--lbws {text}: give a JSON list of numbers, e.g. \"[1,0.5,1,1,1,1,1,1,1,1,1,1]\"")
        if len(values) not in TARGET_BLOCKS:
            raise UserError(f"--lbws {text}: {len(values)} numbers; give {', '.join(map(str, TARGET_BLOCKS))} "
                            f"(12/20: SDXL, 17/26: SD 1.x block presets)")
        parsed.append(values)
    if len({len(values) for values in parsed}) > 1:
        raise UserError(f"--lbws: the lists have different lengths ({', '.join(str(len(v)) for v in parsed)}); "
                        f"give every LoRA the same preset length")
    weights = []
    for values in parsed:
        block_weights = [1.0] * len(BLOCKS)
        for block, value in zip(TARGET_BLOCKS[len(values)], values):
            block_weights[BLOCKS.index(block)] = float(value)
        weights.append(block_weights)
    return weights


def block_index(lora_name: str, sdxl: bool) -> Optional[int]:
    """The ``BLOCKS`` index of a module's kohya name (``lora_unet_...``, ``lora_te1_...``; OFT's
    ``oft_unet_`` too), or None when it belongs to no block."""
    if "text_model_encoder_" in lora_name:
        return 0
    name = re.sub(r"^(lora|oft)_unet_", "", lora_name)
    if name == lora_name:
        return None
    if sdxl:
        if name.startswith(("time_embed_", "label_emb_")):
            return _IN
        for prefix, base in (("input_blocks_", _IN), ("output_blocks_", _OUT)):
            if name.startswith(prefix):
                return base + int(name[len(prefix):].split("_")[0])
        if name.startswith("middle_block_"):
            return _MID
        return 23 if name.startswith("out_") else None
    match = _SD1_UNET_BLOCK.search(name)
    if match:
        up_down, i, kind, j = match.group(1), int(match.group(2)), match.group(3), int(match.group(4))
        if up_down == "down":
            if kind == "upsamplers":
                return None
            return _IN + (3 * (i + 1) if kind == "downsamplers" else 3 * i + j + 1)
        if kind == "downsamplers":
            return None
        return _OUT + (3 * i + 2 if kind == "upsamplers" else 3 * i + j)
    return _MID if name.startswith("mid_block_") else None


def module_weight(block_weights: Optional[Sequence[float]], lora_name: str, sdxl: bool) -> float:
    """The multiplier of a module: its block's, or 1 (no ``--lbws``, or a module of no block)."""
    if block_weights is None:
        return 1.0
    index = block_index(lora_name, sdxl)
    return 1.0 if index is None else block_weights[index]


def is_sdxl_lora(lora_names: Sequence[str]) -> bool:
    """Whether module names are SDXL's kohya names (original-layout UNet blocks, two text encoders)."""
    return any(re.match(r"(lora|oft)_unet_(input_blocks|middle_block|output_blocks)_|lora_te[12]_", name)
               for name in lora_names)
