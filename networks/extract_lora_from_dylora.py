"""Cut a DyLoRA file into LoRA files of lower ranks (kohya's extract_lora_from_dylora.py flags).

    python networks/extract_lora_from_dylora.py --model dylora.safetensors --save_to out.safetensors --unit 4

DyLoRA trains every rank that is a multiple of its ``unit`` at once: the first ``r`` rows of each
``lora_down`` and columns of each ``lora_up`` form a LoRA of rank ``r``. As kohya's script does, a file
is written for every multiple of ``--unit`` below the file's rank: ``out-0004.safetensors``,
``out-0008.safetensors``, ... (``{name}-{rank:04d}{suffix}``), with the tensors sliced and every alpha
kept (kohya's choice; the cut then applies with scale ``alpha / r``), and the source's metadata with
``ss_network_dim`` the new rank and kohya's ``ss_training_comment``. Each file carries its own addnet hashes
(kohya's script writes each file's hashes into the next one).

``--unit`` must be below the file's rank and a multiple of the unit the file was trained with
(``ss_network_args`` ``unit``; LyCORIS DyLoRA: ``block_size``), as other ranks were never trained as a cut.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import json  # noqa: E402
from typing import Mapping, Sequence  # noqa: E402

import torch  # noqa: E402

from library.errors import UserError, exit_on_user_error  # noqa: E402
from library.lora_metadata import addnet_hashes  # noqa: E402
from library.tool_paths import check_output_path  # noqa: E402
from networks import network_base  # noqa: E402

OUTPUT_SUFFIXES = (".safetensors", ".ckpt", ".pt")
DYLORA_TYPES = {"networks.dylora": "unit", "lycoris.kohya": "block_size"}  # ss_network_module -> its unit key


def setup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="extract_lora_from_dylora.py", description=__doc__.splitlines()[0])
    parser.add_argument("--unit", type=int, required=True,
                        help="rank step: a file is written for every multiple of it below the file's rank")
    parser.add_argument("--save_to", required=True, metavar="OUT",
                        help="base name of the files to write: OUT-0004.safetensors, ... (.safetensors; .ckpt/.pt: a "
                             "state dict without metadata)")
    parser.add_argument("--model", required=True, metavar="DYLORA", help="the DyLoRA file to cut")
    return parser


def output_path(save_to: str, rank: int) -> str:
    """kohya's name of the rank-``rank`` file: ``{save_to without suffix}-{rank:04d}{suffix}``."""
    stem, suffix = Path(save_to).stem, Path(save_to).suffix
    return str(Path(save_to).with_name(f"{stem}-{rank:04d}{suffix}"))


def trained_unit(metadata: Mapping[str, str], source: str) -> int:
    """The unit the file was trained with (1 when its metadata does not say); UserError when the metadata
    names a type other than DyLoRA, whose ranks are not ordered."""
    module = metadata.get("ss_network_module")
    try:
        network_args = json.loads(metadata.get("ss_network_args") or "{}")
    except json.JSONDecodeError:
        network_args = {}
    network_args = network_args if isinstance(network_args, dict) else {}
    is_dylora = module == "networks.dylora" or (module == "lycoris.kohya" and network_args.get("algo") == "dylora")
    if module is not None and not is_dylora:
        raise UserError(f"{source}: a {module} file, not DyLoRA: its ranks are not trained as nested cuts "
                        f"(reduce a LoRA's rank with networks/resize_lora.py)")
    if module is None:
        return 1
    try:
        return int(network_args.get(DYLORA_TYPES[module], 1))
    except (TypeError, ValueError):
        return 1


def file_rank(weights: Mapping[str, torch.Tensor], source: str) -> int:
    """The largest ``lora_down`` rank (kohya's "max rank"); UserError for a file without LoRA modules."""
    ranks = [value.shape[0] for key, value in weights.items() if "lora_down" in key]
    if not ranks:
        raise UserError(f"{source}: no lora_down tensors; not a DyLoRA file")
    return max(ranks)


def cut(weights: Mapping[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """The first ``rank`` rows of every ``lora_down`` and columns of every ``lora_up``; other tensors as they are."""
    result = {}
    for key, value in weights.items():
        if "lora_down" in key:
            result[key] = value[:rank].contiguous()
        elif "lora_up" in key:
            result[key] = value[:, :rank].contiguous()
        else:
            result[key] = value
    return result


def cut_metadata(metadata: Mapping[str, str], weights: Mapping[str, torch.Tensor], original_rank: int,
                 rank: int) -> dict[str, str]:
    """kohya's metadata of a cut: the source's, with the new ``ss_network_dim`` and comment, and its own hashes."""
    result = {key: value for key, value in metadata.items() if not key.startswith("sshs_")}
    comment = metadata.get("ss_training_comment", "")
    result["ss_training_comment"] = f"split from DyLoRA, rank {original_rank} to {rank}; {comment}"
    result["ss_network_dim"] = str(rank)
    result.update(addnet_hashes(weights, result))
    return result


def main(argv: Sequence[str] | None = None) -> None:
    args = setup_parser().parse_args(argv)
    if args.unit < 1:
        raise UserError(f"--unit must be a rank >= 1 (got {args.unit})")
    if not Path(args.model).is_file():
        raise UserError(f"--model {args.model} does not exist")
    check_output_path("--save_to", args.save_to, [], OUTPUT_SUFFIXES)
    source = f"--model {args.model}"
    metadata = network_base.read_lora_metadata(args.model)
    unit = trained_unit(metadata, source)
    weights = network_base.read_lora_file(args.model)
    original_rank = file_rank(weights, source)
    if args.unit >= original_rank:
        raise UserError(f"--unit {args.unit}: the file's rank is {original_rank}; give a unit below it "
                        f"(a multiple of {unit}) to write the ranks below {original_rank}")
    if args.unit % unit:
        raise UserError(f"--unit {args.unit}: the file was trained with unit {unit}, so only multiples of {unit} "
                        f"are trained ranks; give a multiple of {unit}")
    ranks = list(range(args.unit, original_rank, args.unit))
    for rank in ranks:
        check_output_path("--save_to", output_path(args.save_to, rank), [("--model", args.model)], OUTPUT_SUFFIXES)
    for rank in ranks:
        state = cut(weights, rank)
        path = output_path(args.save_to, rank)
        network_base.save_lora_file(state, path, cut_metadata(metadata, state, original_rank, rank))
        print(f"saved {path}: rank {rank} of {original_rank}")


if __name__ == "__main__":
    exit_on_user_error(main)
