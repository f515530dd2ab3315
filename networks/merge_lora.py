"""Merge network files into a checkpoint, or LoRAs into one LoRA (kohya's flag names; SDXL and SD 1.x/2.x).

    # into a model: single file (or diffusers folder) in, original-layout single file out
    python networks/merge_lora.py --sd_model base.safetensors --save_to merged.safetensors \
        --models a.safetensors b.safetensors --ratios 1.0 0.5 [--lbws JSON JSON] [--save_precision fp16]
    # LoRAs into one LoRA (kohya's merge; --concat stacks the ranks)
    python networks/merge_lora.py --save_to ab.safetensors --models a.safetensors b.safetensors --ratios 1 0.5

``networks/sdxl_merge_lora.py`` (the name kohya's GUI calls for SDXL) is this same tool.

Into a model: the base is loaded with ``library.model_loading.load_models`` (SDXL, SD2 or SD1
detected from the file's keys; ``--v2``/``--sdxl`` for diffusers folders). Each file may be of
any type of ``networks.registry`` (LoRA, LoCon, DyLoRA, LoRA-FA, LoHa, LoKr, OFT, LyCORIS; the
type from its ``ss_network_module``, else its tensor names): its network is rebuilt on the model
by the trainers' own key naming and every module's merged weight (``W + ratio * delta`` in
float32; OFT: the rotated ``W``) replaces the wrapped weight, file after file; the result is
written as a trained full model is (``library.full_model_files.save_model``, kohya's
``save_stable_diffusion_checkpoint``): the original layout, the base file's tensors the model has
no place for (SD 1.x/2.x: all, e.g. EMA weights; SDXL: ``logit_scale``) and, for a ``.ckpt``, its
epoch/step counters carried over; a ``.safetensors`` gets the model spec metadata of a checkpoint
(title: the output's name; ``modelspec.merged_from``: the base model and the LoRAs) unless ``--no_metadata``. Every module of every file must match
a module of the model (otherwise: an error naming the module); a file whose module names are of
the other model family (SD 1.x vs SDXL) is refused before the model is loaded. ``--lbws`` multiplies
each module's ratio by its block's weight (``networks/lora_block_weights.py``; kohya's sdxl_merge_lora
does the same for LoRA, and applies no block weight to OFT).

LoRAs into one LoRA (LoRA-format files only: LoRA, LoCon, DyLoRA, LoRA-FA), as kohya computes it: per
module, with ``s_i = sqrt(alpha_i / alpha_1) * ratio_i`` (``alpha_1``: the first LoRA holding the module)
and ``w_i`` its ``--lbws`` block weight (1 without), each ``lora_down`` is scaled by ``s_i * w_i`` and
each ``lora_up`` by ``|s_i| * w_i``; alpha is ``alpha_1``.

* default: the scaled factors are added (``down = sum down_i``, ``up = sum up_i``; equal ranks needed).
  For one LoRA the delta is ``ratio * |ratio| * delta``; for several it is ``(sum up_i)(sum down_i)``, not
  the sum of the deltas (cross terms): kohya's behaviour, kept for compatible results.
* ``--concat``: the factors are stacked along the rank (rank = the sum of the ranks): the delta is
  ``sum_i ratio_i * |ratio_i| * w_i^2 * delta_i * rank_i / sum(rank)``.
* ``--shuffle``: each module's rank components are permuted (the delta is unchanged); kohya's permutation
  is unseeded, ours is seeded (``SHUFFLE_SEED``), so the same command writes the same bytes.

Metadata as kohya's: the minimal ``ss_*`` keys (dim/alpha: the first LoRA's, ``Dynamic`` when modules
differ), hashes, and (unless ``--no_metadata``) model spec keys with ``modelspec.merged_from``.
Merging is computed in float32 (``--precision`` is accepted for kohya compatibility).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from typing import Mapping, Optional, Sequence  # noqa: E402

import torch  # noqa: E402

from library import checkpoint_files, checkpoint_keys, full_model_files, model_loading  # noqa: E402
from library.checkpoint_files import SAVE_DTYPES  # noqa: E402
from library.errors import UserError, exit_on_user_error  # noqa: E402
from library.lora_metadata import BASE_MODEL_VERSIONS, addnet_hashes, modelspec_metadata  # noqa: E402
from library.tool_paths import check_output_path  # noqa: E402
from library.models import StableDiffusionModels  # noqa: E402
from networks import lora_block_weights, network_base, registry  # noqa: E402
from networks.lora import lora_modules, read_lora_file, save_lora_file  # noqa: E402
from networks.network_base import read_lora_metadata  # noqa: E402


def setup_parser(prog: str = "merge_lora.py") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--sd_model", default=None,
                        help="base model (.safetensors/.ckpt single file or diffusers folder); without it the LoRAs "
                             "are merged into one LoRA")
    parser.add_argument("--save_to", required=True, help="output file: .safetensors, or .ckpt (kohya's torch.save layout; a LoRA also .pt)")
    parser.add_argument("--models", nargs="+", required=True, metavar="LORA", help="LoRA files to merge")
    parser.add_argument("--ratios", type=float, nargs="*", default=None,
                        help="one multiplier per LoRA. Default: 1.0 each")
    parser.add_argument("--lbws", nargs="*", default=None, metavar="JSON",
                        help="one block-weight list per LoRA, e.g. \"[1,0,0,0,1,1,1,1,1,1,1,1]\" (12/20 numbers: SDXL "
                             "presets, 17/26: SD 1.x; see networks/lora_block_weights.py). Default: none")
    parser.add_argument("--save_precision", default=None, choices=[None, "float", "fp16", "bf16"],
                        help="dtype of the saved weights. Default: float")
    parser.add_argument("--precision", default="float", choices=["float", "fp16", "bf16"],
                        help="accepted for kohya compatibility; merging is always computed in float32")
    add_base_model_arguments(parser)
    parser.add_argument("--concat", action="store_true",
                        help="LoRAs into one LoRA: stack the ranks (output rank = sum of the ranks) instead of adding "
                             "the factors (which needs equal ranks)")
    parser.add_argument("--shuffle", action="store_true",
                        help="LoRAs into one LoRA: permute each module's rank components (seeded; the result's "
                             "deltas are unchanged)")
    parser.add_argument("--no_metadata", action="store_true",
                        help="LoRA output: write only the minimal ss_* keys, no model spec metadata; model output: "
                             "no metadata")
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


def merge_into_models(models: StableDiffusionModels, paths: Sequence[str], ratios: Sequence[float],
                      flag: str = "--models", block_weights: Optional[Sequence[Sequence[float]]] = None) -> int:
    """Merge each network file, ratio-weighted, into the matching weights of ``models`` in place, in
    order (any type in ``networks.registry``: the type's own merged weight, e.g. ``W + ratio * delta``
    for LoRA/LoHa/LoKr, the rotated ``W`` for OFT). ``block_weights`` (``--lbws``, one per file, see
    ``networks.lora_block_weights``) multiply each module's ratio by its block's weight. Returns the
    number of modules changed. UserError (naming ``flag`` and the file) when a file does not fit the model."""
    unet_names = checkpoint_keys.unet_module_name_map(models.unet.config) if models.is_sdxl else None
    changed = 0
    for index, (path, ratio) in enumerate(zip(paths, ratios)):
        network = registry.network_from_file(path, models.text_encoders, models.unet, unet_names, flag)
        network.to(dtype=network_base.merge_dtype(models.unet.dtype))  # float64 for a float64 model
        blocks = block_weights[index] if block_weights else None
        changed += network.merge_into_model(
            ratio, lambda name: lora_block_weights.module_weight(blocks, name, models.is_sdxl))
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


SHUFFLE_SEED = 0
"""The seed of ``--shuffle``'s permutations (kohya's are unseeded), so the same command writes the same bytes."""


def merge_loras(loras: Sequence[tuple[str, Mapping[str, torch.Tensor]]], ratios: Sequence[float], *,
                block_weights: Optional[Sequence[Sequence[float]]] = None, concat: bool = False,
                shuffle: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """kohya's LoRA + LoRA merge: ``(state dict, {module: rank of the first LoRA holding it})``.

    Each module's factors are scaled, file after file, by ``s = sqrt(alpha / alpha_first) * ratio``
    (``lora_up`` by ``|s|``; times the module's ``--lbws`` block weight, on both), and then summed
    (equal ranks needed) or, with ``concat``, stacked along the rank; the alpha is the first
    LoRA's. ``shuffle`` permutes each module's rank components (seeded; the delta is unchanged).
    """
    names = [name for _, weights in loras for name in lora_modules(weights)]
    sdxl = lora_block_weights.is_sdxl_lora(names)
    merged: dict[str, torch.Tensor] = {}
    base_alphas: dict[str, float] = {}
    base_ranks: dict[str, int] = {}
    for index, ((path, weights), ratio) in enumerate(zip(loras, ratios)):
        blocks = block_weights[index] if block_weights else None
        for name, parts in lora_modules(weights).items():
            rank = parts["down"].shape[0]
            alpha = float(parts["alpha"].float()) if "alpha" in parts else float(rank)
            base_alpha = base_alphas.setdefault(name, alpha)
            base_ranks.setdefault(name, rank)
            scale = math.sqrt(alpha / base_alpha) * ratio
            block = lora_block_weights.module_weight(blocks, name, sdxl)
            for kind, factor in (("down", scale * block), ("up", abs(scale) * block)):
                key = f"{name}.lora_{kind}.weight"
                value = parts[kind].float() * factor
                if key not in merged:
                    merged[key] = value
                    continue
                previous = merged[key]
                rank_dim = 0 if kind == "down" else 1
                if previous.shape[:rank_dim] + previous.shape[rank_dim + 1:] != value.shape[:rank_dim] + \
                        value.shape[rank_dim + 1:]:
                    raise UserError(f"--models {path}: {name} has {kind} shape {tuple(value.shape)}, an earlier LoRA "
                                    f"{tuple(previous.shape)}: the LoRAs are for different models")
                if concat:
                    merged[key] = torch.cat([previous, value], dim=rank_dim)
                elif previous.shape != value.shape:
                    raise UserError(f"--models {path}: {name} has rank {rank}, an earlier LoRA "
                                    f"{previous.shape[rank_dim]}; merging adds the factors, which needs equal ranks: "
                                    f"use --concat (or resize_lora.py first)")
                else:
                    merged[key] = previous + value
    generator = torch.Generator().manual_seed(SHUFFLE_SEED)
    for name, alpha in base_alphas.items():
        merged[f"{name}.alpha"] = torch.tensor(alpha)
        if shuffle:
            down, up = f"{name}.lora_down.weight", f"{name}.lora_up.weight"
            permutation = torch.randperm(merged[down].shape[0], generator=generator)
            merged[down], merged[up] = merged[down][permutation], merged[up][:, permutation]
    return {key: value.contiguous() for key, value in merged.items()}, base_ranks


def lora_output_metadata(paths: Sequence[str], merged: Mapping[str, torch.Tensor], base_ranks: Mapping[str, int],
                         no_metadata: bool, save_to: str) -> dict[str, str]:
    """kohya's metadata of a merged LoRA: the minimal ``ss_*`` keys (``ss_v2``/``ss_base_model_version`` of the
    first file holding them; dim and alpha those of the first LoRA per module, or ``Dynamic`` when they differ
    between modules), the model spec keys (unless ``no_metadata``) and the additional-networks hashes."""
    sources = [read_lora_metadata(path) for path in paths]
    alphas = {float(value) for key, value in merged.items() if key.endswith(".alpha")}
    ranks = set(base_ranks.values())
    metadata = {"ss_network_module": "networks.lora",
                "ss_network_dim": str(ranks.pop()) if len(ranks) == 1 else "Dynamic",
                "ss_network_alpha": str(alphas.pop()) if len(alphas) == 1 else "Dynamic"}
    for key in ("ss_v2", "ss_base_model_version"):
        value = next((source[key] for source in sources if key in source), None)
        if value is not None:
            metadata[key] = value
    metadata.update(addnet_hashes(merged, metadata))
    if not no_metadata:
        versions = {version: kind for kind, version in BASE_MODEL_VERSIONS.items()}
        kind = versions.get(metadata.get("ss_base_model_version", ""))
        if kind is None:
            kind = "sdxl" if lora_block_weights.is_sdxl_lora([key.partition(".")[0] for key in merged]) else "sd1"
        naming = argparse.Namespace(v_parameterization=False, output_name=Path(save_to).stem,
                                    metadata_merged_from=merged_from(paths))
        size = 1024 if kind == "sdxl" else 512
        metadata.update(modelspec_metadata(naming, kind, (size, size), time.time()))
    return metadata


def merged_from(paths: Sequence[str]) -> str:
    """kohya's ``modelspec.merged_from``: each input's ``modelspec.title``, else its file name without extension."""
    titles = [read_lora_metadata(path).get("modelspec.title") or Path(path).stem for path in paths]
    return ", ".join(titles)


def model_output_metadata(kind: str, sd_model: str, paths: Sequence[str], save_to: str) -> dict[str, str]:
    """kohya's metadata of a merged model: a checkpoint's model spec keys (``merged_from`` the base model and
    the LoRAs; default resolution of the kind; SD2 marked v-prediction, as kohya does, not knowing the base)."""
    naming = argparse.Namespace(v_parameterization=kind == "sd2", output_name=Path(save_to).stem,
                                metadata_merged_from=merged_from([sd_model, *paths]))
    size = {"sdxl": 1024, "sd2": 768, "sd1": 512}[kind]
    return full_model_files.checkpoint_metadata(naming, kind, (size, size), time.time())


def check_ratios(ratios: Sequence[float]) -> None:
    bad = next((ratio for ratio in ratios if not math.isfinite(ratio)), None)
    if bad is not None:
        raise UserError(f"--ratios {bad}: give finite numbers, e.g. 1.0 0.5")


def lora_family(path: str, weights: Mapping[str, torch.Tensor]) -> Optional[str]:
    """``"sdxl"`` or ``"sd"`` (SD 1.x/2.x) from a network file's module names, None when they do not tell."""
    names = {key.partition(".")[0] for key in weights}
    if lora_block_weights.is_sdxl_lora(names):
        return "sdxl"
    sd_names = r"(lora|oft)_unet_(down_blocks|mid_block|up_blocks)_|lora_te_text_model_"
    return "sd" if any(re.match(sd_names, name) for name in names) else None


def check_networks_fit(paths: Sequence[str], model_flag: str, model_path: str, model_kind: str, flag: str) -> None:
    """Before the model is loaded: every network file is readable and not for the other model family
    (an SD 1.x LoRA on an SDXL model or the reverse), from its module names."""
    for path in paths:
        family = lora_family(path, read_lora_file(path))
        model_family = "sdxl" if model_kind == "sdxl" else "sd"
        if family is not None and family != model_family:
            names = {"sdxl": "SDXL", "sd": "SD 1.x/2.x"}
            raise UserError(f"{flag} {path} is a network for {names[family]} (its module names) but {model_flag} "
                            f"{model_path} is {names[model_family]}; give a base model of the network's kind")


def main(argv: Sequence[str] | None = None, prog: str = "merge_lora.py") -> None:
    args = setup_parser(prog).parse_args(argv)
    ratios = resolve_ratios(args.models, args.ratios)
    check_ratios(ratios)
    block_weights = lora_block_weights.parse_lbws(args.lbws, args.models) if args.lbws else None
    inputs = [("--sd_model", args.sd_model), *(("--models", path) for path in args.models)]
    # kohya writes a .ckpt (and a LoRA as .ckpt/.pt) when the name says so; the GUI's Merge tab offers .ckpt
    suffixes = checkpoint_files.SINGLE_FILE_SUFFIXES if args.sd_model is not None else (".safetensors", ".ckpt", ".pt")
    check_output_path("--save_to", args.save_to, inputs, suffixes)
    save_dtype = SAVE_DTYPES[args.save_precision]
    if args.sd_model is None:
        loras = [(path, read_lora_file(path)) for path in args.models]
        for path, weights in loras:
            registry.require_lora_format(weights, read_lora_metadata(path), f"--models {path}",
                                         "merging into one LoRA (merge other types into a model with --sd_model)")
        merged, base_ranks = merge_loras(loras, ratios, block_weights=block_weights, concat=args.concat,
                                         shuffle=args.shuffle)
        if save_dtype is not None:
            merged = {key: value.to(save_dtype) for key, value in merged.items()}
        metadata = lora_output_metadata(args.models, merged, base_ranks, args.no_metadata, args.save_to)
        save_lora_file(merged, args.save_to, metadata)
        ranks = sorted({int(value.shape[0]) for key, value in merged.items() if key.endswith(".lora_down.weight")})
        print(f"saved {args.save_to}: {len(merged) // 3} modules from {len(loras)} LoRAs "
              f"({'concatenated' if args.concat else 'merged'}), ranks {json.dumps(ranks)}")
        return
    kind = detect_kind(Path(args.sd_model), args)
    check_networks_fit(args.models, "--sd_model", args.sd_model, kind, "--models")
    models = load_base_model(args)
    changed = merge_into_models(models, args.models, ratios, block_weights=block_weights)
    bad = next((name for name, tensor in checkpoint_files.iter_model_tensors(models)
                if tensor.is_floating_point() and not torch.isfinite(tensor).all()), None)
    if bad is not None:
        raise UserError(f"the merged model holds NaN/Inf in {bad}; check --models/--ratios")
    source = checkpoint_files.read_source_checkpoint(args.sd_model, models, "--sd_model")
    metadata = None if args.no_metadata else model_output_metadata(kind, args.sd_model, args.models, args.save_to)
    model_format = full_model_files.ModelFormat(single_file=True, safetensors=checkpoint_files.is_safetensors(args.save_to))
    full_model_files.save_model(models, args.save_to, model_format, save_dtype, metadata=metadata, source=source)
    print(f"saved {args.save_to}: {changed} module weights changed ({models.kind}, {len(args.models)} networks)")


if __name__ == "__main__":
    exit_on_user_error(main)
