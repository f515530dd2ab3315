"""Merge network files into a checkpoint, or LoRAs into one LoRA (kohya's flag names; SDXL and SD 1.x/2.x).

    # into a model: single file (or diffusers folder) in, original-layout single file out
    python networks/merge_lora.py --sd_model base.safetensors --save_to merged.safetensors \
        --models a.safetensors b.safetensors --ratios 1.0 0.5 [--save_precision fp16]
    # LoRAs into one LoRA (ranks concatenated)
    python networks/merge_lora.py --save_to ab.safetensors --models a.safetensors b.safetensors --ratios 1 0.5

Into a model: the base is loaded with ``library.model_loading.load_models`` (SDXL, SD2 or SD1
detected from the file's keys; ``--v2``/``--sdxl`` for diffusers folders). Each file may be of
any type of ``networks.registry`` (LoRA, LoCon, DyLoRA, LoRA-FA, LoHa, LoKr, OFT, LyCORIS; the
type from its ``ss_network_module``, else its tensor names): its network is rebuilt on the model
by the trainers' own key naming and every module's merged weight (``W + ratio * delta`` in
float32; OFT: the rotated ``W``) replaces the wrapped weight, file after file; the result is
written with ``save_single_file`` in the original layout. Every module of every file must match
a module of the model (otherwise: an error naming the module).

LoRAs into one LoRA (LoRA-format files only: LoRA, LoCon, DyLoRA, LoRA-FA): the down weights are
stacked and the up weights concatenated per module (kohya's ``--concat``), each pair scaled so
the merged module's delta is exactly the sum of the ``ratio``-weighted deltas; the merged rank
is the sum of the ranks, alpha equals the rank (scale 1). Modules present in only some LoRAs are kept.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
from typing import Mapping, Optional, Sequence  # noqa: E402

import torch  # noqa: E402

from library import checkpoint_files, checkpoint_keys, model_loading  # noqa: E402
from library.errors import UserError, exit_on_user_error  # noqa: E402
from library.lora_files import SAVE_DTYPES  # noqa: E402
from library.lora_metadata import addnet_hashes  # noqa: E402
from library.models import StableDiffusionModels  # noqa: E402
from networks import network_base, registry  # noqa: E402
from networks.lora import lora_modules, module_scale, read_lora_file, save_lora_file  # noqa: E402
from networks.network_base import read_lora_metadata  # noqa: E402


def setup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="merge_lora.py", description=__doc__.splitlines()[0])
    parser.add_argument("--sd_model", default=None,
                        help="base model (.safetensors/.ckpt single file or diffusers folder); without it the LoRAs "
                             "are merged into one LoRA")
    parser.add_argument("--save_to", required=True, help="output .safetensors file")
    parser.add_argument("--models", nargs="+", required=True, metavar="LORA", help="LoRA files to merge")
    parser.add_argument("--ratios", type=float, nargs="*", default=None,
                        help="one multiplier per LoRA. Default: 1.0 each")
    parser.add_argument("--save_precision", default=None, choices=[None, "float", "fp16", "bf16"],
                        help="dtype of the saved weights. Default: float")
    parser.add_argument("--precision", default="float", choices=["float", "fp16", "bf16"],
                        help="accepted for kohya compatibility; merging is always computed in float32")
    add_base_model_arguments(parser)
    parser.add_argument("--concat", action="store_true",
                        help="accepted for kohya compatibility; LoRAs are always merged by concatenating ranks")
    parser.add_argument("--no_metadata", action="store_true",
                        help="LoRA output: write only the minimal ss_* keys, no modelspec/training metadata")
    return parser


def add_base_model_arguments(parser: argparse.ArgumentParser) -> None:
    """How the tools read ``--sd_model`` (a single file's architecture and tokenizers, a folder's kind)."""
    parser.add_argument("--v2", action="store_true", help="a diffusers-folder --sd_model is SD 2.x")
    parser.add_argument("--sdxl", action="store_true", help="a diffusers-folder --sd_model is SDXL")
    parser.add_argument("--model_config_dir", default=None,
                        help="architecture configs of a single-file --sd_model (see the trainers). "
                             "Default: the shipped config of the detected kind")
    parser.add_argument("--tokenizer_cache_dir", default=None,
                        help="kohya tokenizer cache (loading a model needs its tokenizers). Default: none")


def load_base_model(args: argparse.Namespace) -> StableDiffusionModels:
    """``--sd_model``, its kind detected (see :func:`detect_kind`), in float32 on the CPU."""
    sd_model = Path(args.sd_model)
    kind = detect_kind(sd_model, args)
    return model_loading.load_models(sd_model, sdxl=kind == "sdxl", v2=kind == "sd2",
                                     model_config_dir=args.model_config_dir,
                                     tokenizer_cache_dir=args.tokenizer_cache_dir)


def resolve_ratios(models: Sequence[str], ratios: Optional[Sequence[float]]) -> list[float]:
    if not ratios:
        return [1.0] * len(models)
    if len(ratios) != len(models):
        raise UserError(f"--ratios: {len(ratios)} value(s) for {len(models)} --models; give one ratio per LoRA")
    return [float(ratio) for ratio in ratios]


def detect_kind(path: Path, args: argparse.Namespace) -> model_loading.ModelKind:
    """SDXL/SD2/SD1 of ``--sd_model``: from the single file's keys, or the flags for a folder."""
    if path.is_dir():
        if args.sdxl or (path / "text_encoder_2").is_dir():
            return "sdxl"
        return "sd2" if args.v2 else "sd1"
    if not path.is_file():
        raise UserError(f"--sd_model {path} does not exist")
    with checkpoint_files.CheckpointReader(path, "--sd_model") as reader:
        kind = model_loading.detect_checkpoint_kind(reader.keys())
    if kind is None:
        raise UserError(f"--sd_model {path}: not a Stable Diffusion checkpoint with text encoders "
                        f"(no SD1/SD2/SDXL text encoder keys)")
    return kind


def merge_into_models(models: StableDiffusionModels, paths: Sequence[str],
                      ratios: Sequence[float], flag: str = "--models") -> int:
    """Merge each network file, ratio-weighted, into the matching weights of ``models`` in place, in
    order (any type in ``networks.registry``: the type's own merged weight, e.g. ``W + ratio * delta``
    for LoRA/LoHa/LoKr, the rotated ``W`` for OFT). Returns the number of modules changed. UserError
    (naming ``flag`` and the file) when a file does not fit the model."""
    unet_names = checkpoint_keys.unet_module_name_map(models.unet.config) if models.is_sdxl else None
    changed = 0
    for path, ratio in zip(paths, ratios):
        network = registry.network_from_file(path, models.text_encoders, models.unet, unet_names, flag)
        network.to(dtype=network_base.merge_dtype(models.unet.dtype))  # float64 for a float64 model
        changed += network.merge_into_model(ratio)
    return changed


def merge_base_weights(models: StableDiffusionModels, paths: Sequence[str],
                       multipliers: Optional[Sequence[float]]) -> None:
    """``--base_weights``: merge network files into the frozen models before training (kohya's order:
    before the trained network is created). A file without a multiplier gets 1.0."""
    multipliers = list(multipliers or [])
    for index, path in enumerate(paths):
        multiplier = multipliers[index] if index < len(multipliers) else 1.0
        changed = merge_into_models(models, [path], [multiplier], flag="--base_weights")
        print(f"merged {path} into the base model ({changed} modules, multiplier {multiplier})")


def merge_loras(loras: Sequence[tuple[str, Mapping[str, torch.Tensor]]], ratios: Sequence[float]
                ) -> dict[str, torch.Tensor]:
    """One LoRA whose every module's delta is ``sum(ratio_i * delta_i)`` (ranks concatenated, alpha = rank)."""
    pieces: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for (path, weights), ratio in zip(loras, ratios):
        for name, parts in lora_modules(weights).items():
            factor = ratio * module_scale(parts)
            root = math.sqrt(abs(factor))
            down = parts["down"].float() * (root if factor >= 0 else -root)
            up = parts["up"].float() * root
            if name in pieces and pieces[name][0][0].shape[1:] != down.shape[1:]:
                raise UserError(f"--models {path}: {name} has input shape {tuple(down.shape[1:])}, an earlier LoRA "
                                f"{tuple(pieces[name][0][0].shape[1:])}: the LoRAs are for different models")
            pieces.setdefault(name, []).append((down, up))
    merged: dict[str, torch.Tensor] = {}
    for name, parts in pieces.items():
        down = torch.cat([down for down, _ in parts], dim=0)
        up = torch.cat([up for _, up in parts], dim=1)
        merged[f"{name}.lora_down.weight"] = down.contiguous()
        merged[f"{name}.lora_up.weight"] = up.contiguous()
        merged[f"{name}.alpha"] = torch.tensor(float(down.shape[0]))
    return merged


def lora_output_metadata(paths: Sequence[str], ratios: Sequence[float], merged: Mapping[str, torch.Tensor],
                         no_metadata: bool) -> dict[str, str]:
    first = read_lora_metadata(paths[0])
    ranks = sorted({int(value.shape[0]) for key, value in merged.items() if key.endswith(".lora_down.weight")})
    metadata = {key: value for key, value in first.items()
                if key in ("ss_base_model_version", "ss_v2", "ss_network_module")}
    metadata.setdefault("ss_network_module", "networks.lora")
    metadata["ss_network_dim"] = str(ranks[0]) if len(ranks) == 1 else "Dynamic"
    metadata["ss_network_alpha"] = metadata["ss_network_dim"]
    metadata["ss_training_comment"] = "merged: " + json.dumps(
        [{"model": Path(path).name, "ratio": ratio} for path, ratio in zip(paths, ratios)])
    if not no_metadata:
        metadata.update({key: value for key, value in first.items() if key.startswith("modelspec.")})
        metadata.update(addnet_hashes(merged, metadata))
    return metadata


def main(argv: Sequence[str] | None = None) -> None:
    args = setup_parser().parse_args(argv)
    ratios = resolve_ratios(args.models, args.ratios)
    if not args.save_to.endswith(".safetensors"):
        raise UserError(f"--save_to {args.save_to}: only .safetensors is written")
    save_dtype = SAVE_DTYPES[args.save_precision]
    if args.sd_model is None:
        loras = [(path, read_lora_file(path)) for path in args.models]
        for path, weights in loras:
            registry.require_lora_format(weights, read_lora_metadata(path), f"--models {path}",
                                         "merging into one LoRA (merge other types into a model with --sd_model)")
        merged = merge_loras(loras, ratios)
        metadata = lora_output_metadata(args.models, ratios, merged, args.no_metadata)
        if save_dtype is not None:
            merged = {key: value.to(save_dtype) for key, value in merged.items()}
        save_lora_file(merged, args.save_to, metadata)
        print(f"saved {args.save_to}: {len(merged) // 3} modules from {len(loras)} LoRAs")
        return
    models = load_base_model(args)
    changed = merge_into_models(models, args.models, ratios)
    bad = next((name for name, tensor in checkpoint_files.iter_model_tensors(models)
                if tensor.is_floating_point() and not torch.isfinite(tensor).all()), None)
    if bad is not None:
        raise UserError(f"the merged model holds NaN/Inf in {bad}; check --models/--ratios")
    checkpoint_files.save_single_file(models, args.save_to, dtype=save_dtype)
    print(f"saved {args.save_to}: {changed} module weights changed ({models.kind}, {len(args.models)} networks)")


if __name__ == "__main__":
    exit_on_user_error(main)
