"""Print a safetensors file's header metadata as readable JSON.

    python tools/show_metadata.py FILE [--tensors] [--raw]

Only the header is read (no tensor data), so it is instant on a 7 GB checkpoint. For a network
file of any type (LoRA, LoCon, DyLoRA, LoRA-FA, LoHa, LoKr, OFT, LyCORIS) a ``network`` entry gives
its type, module count and per-module tensor names.
Values that hold JSON themselves (kohya's ``ss_network_args``, ``ss_dataset_dirs``,
``ss_tag_frequency``, ``ss_datasets`` ...) are parsed, so the output nests instead of
showing escaped strings; ``--raw`` prints the strings as stored. ``--tensors`` adds each
tensor's dtype and shape.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import json  # noqa: E402
from typing import Any, Sequence  # noqa: E402

from library.errors import UserError, exit_on_user_error  # noqa: E402

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit


def read_header(path: str | Path) -> dict[str, Any]:
    """The parsed safetensors header (tensor entries and ``__metadata__``); UserError when unreadable."""
    path = Path(path)
    try:
        with open(path, "rb") as file:
            length_bytes = file.read(8)
            if len(length_bytes) != 8:
                raise UserError(f"{path}: too short to be a safetensors file")
            length = int.from_bytes(length_bytes, "little")
            if length > MAX_HEADER_BYTES:
                raise UserError(f"{path}: not a safetensors file (header length {length} bytes)")
            header_bytes = file.read(length)
    except OSError as error:
        raise UserError(f"{path}: cannot read ({error.strerror or error})") from None
    try:
        header = json.loads(header_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UserError(f"{path}: not a safetensors file (the header is not JSON)") from None
    if not isinstance(header, dict):
        raise UserError(f"{path}: not a safetensors file (the header is not a JSON object)")
    return header


def expand_json_strings(value: Any) -> Any:
    """Replace strings holding a JSON object/array (recursively) by the parsed value."""
    if isinstance(value, str):
        text = value.strip()
        if text[:1] in ("{", "[") and text[-1:] in ("}", "]"):
            try:
                return expand_json_strings(json.loads(text))
            except json.JSONDecodeError:
                return value
        return value
    if isinstance(value, dict):
        return {key: expand_json_strings(item) for key, item in value.items()}
    if isinstance(value, list):
        return [expand_json_strings(item) for item in value]
    return value


def network_summary(tensor_names: Sequence[str], metadata: dict[str, str]) -> dict[str, Any] | None:
    """For a network file (any type of ``networks.registry``): its type (``ss_network_module`` or
    recognised from the tensor names), module count and per-module tensor names; None otherwise."""
    from networks import registry  # imports torch: only for files that may be networks

    suffixes = sorted({name.partition(".")[2] for name in tensor_names if "." in name})
    if not any(name.startswith(("lora_", "oft_")) for name in tensor_names):
        return None
    try:
        network_module = registry.file_network_module(dict.fromkeys(tensor_names), metadata, "")
    except UserError:
        return None
    return {"type": network_module, "modules": len({name.partition(".")[0] for name in tensor_names}),
            "tensor_names": suffixes}


def describe(path: str | Path, *, tensors: bool = False, raw: bool = False) -> dict[str, Any]:
    """``{"metadata": {...}, "tensor_count": N[, "network": {...}][, "tensors": {name: "dtype [shape]"}]}``
    of a file (``network``: see ``network_summary``)."""
    header = read_header(path)
    metadata = header.pop("__metadata__", None) or {}
    result: dict[str, Any] = {
        "metadata": dict(sorted(metadata.items())) if raw else expand_json_strings(dict(sorted(metadata.items()))),
        "tensor_count": len(header),
    }
    network = network_summary(list(header), metadata)
    if network is not None:
        result["network"] = network
    if tensors:
        result["tensors"] = {name: f"{entry.get('dtype')} {entry.get('shape')}" for name, entry in sorted(header.items())}
    return result


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="show_metadata.py",
                                     description="Print a safetensors file's metadata as JSON (header only).")
    parser.add_argument("file", metavar="FILE", help="a .safetensors file (LoRA or checkpoint)")
    parser.add_argument("--tensors", action="store_true", help="also list every tensor's dtype and shape. Default: off")
    parser.add_argument("--raw", action="store_true",
                        help="print metadata strings as stored, without parsing nested JSON. Default: off")
    args = parser.parse_args(argv)
    print(json.dumps(describe(args.file, tensors=args.tensors, raw=args.raw), indent=2, ensure_ascii=False))


if __name__ == "__main__":
    exit_on_user_error(main)
