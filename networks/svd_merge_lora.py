"""Merge network files of any type into one LoRA of a chosen rank by SVD (kohya's svd_merge_lora.py flags).

    python networks/svd_merge_lora.py --save_to merged.safetensors --models a.safetensors b.safetensors \
        --ratios 1.0 0.5 --new_rank 16 [--new_conv_rank 8] [--lbws "[...]" "[...]"] [--save_precision fp16]

For every module, the ratio-weighted sum of the files' weight changes ``D = sum ratio_i * lbw_i * delta_i``
(float64; ``lbw_i``: the file's block weight of the module, see ``networks.lora_block_weights``) is
replaced by its best rank-``r`` approximation (SVD, ``networks.resize_lora.low_rank_module``):
``r = --new_rank`` (``--new_conv_rank`` for 3x3 convs), at most the layer's input and output channels,
as kohya caps it. Up and down share ``sqrt(S)``; alpha is the rank (scale 1), as kohya writes it.
kohya clamps the factors at their 0.99 quantile; that only adds error (the unclamped factors are the
best approximation, Eckart-Young), so it is left out.

Any type the trainers write is read (LoRA, LoCon, DyLoRA, LoRA-FA, LoHa, LoKr, LyCORIS), ranks and
types mixed: each file's change is what its own network adds to the layer (``library.network_deltas``),
so no base model is needed. OFT, iA3, GLoRA and DoRA change a layer by an amount that depends on its
weight: give ``--sd_model`` (the base model) to merge them; without it they are refused. (kohya's tool
reads only lora_down/lora_up modules and silently skips all others.)

One line per module gives its rank and relative error ``||D - LoRA delta||_F / ||D||_F``; the last
line the overall error (over all modules' changes together) and the largest.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
from dataclasses import dataclass  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
from typing import Callable, Optional, Sequence  # noqa: E402

import torch  # noqa: E402

from library import network_deltas  # noqa: E402
from library.errors import UserError, exit_on_user_error  # noqa: E402
from library.lora_files import SAVE_DTYPES  # noqa: E402
from library.lora_metadata import BASE_MODEL_VERSIONS, addnet_hashes, modelspec_metadata, wall_clock  # noqa: E402
from library.tool_paths import check_output_path  # noqa: E402
from networks import lora_block_weights, merge_lora, network_base, resize_lora  # noqa: E402

OUTPUT_SUFFIXES = (".safetensors", ".ckpt", ".pt")



@dataclass(frozen=True)
class MergedModule:
    """One module's outcome: its LoRA name, the rank written and the relative (Frobenius) error of its change."""

    name: str
    rank: int
    relative_error: float
    delta_norm: float  # ||summed change||_F, for the overall error


@dataclass
class SvdMerge:
    """The merged LoRA state dict, a result per module, and what a LoRA cannot hold."""

    weights: dict[str, torch.Tensor]
    modules: list[MergedModule]
    dropped: list[str]  # "name: what" for bias changes and norm modules
    dropped_norm: float  # ||dropped changes||_F

    @property
    def overall_error(self) -> float:
        """||all changes - all LoRA changes||_F / ||all changes||_F over every merged module."""
        total = sum(module.delta_norm ** 2 for module in self.modules)
        error = sum((module.relative_error * module.delta_norm) ** 2 for module in self.modules)
        return math.sqrt(error / total) if total > 0 else 0.0

def setup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="svd_merge_lora.py", description=__doc__.splitlines()[0])
    parser.add_argument("--save_precision", default=None, choices=[None, "float", "fp16", "bf16"],
                        help="dtype of the saved weights. Default: --precision")
    parser.add_argument("--precision", default="float", choices=["float", "fp16", "bf16"],
                        help="kohya's merge dtype; here it only sets the saved dtype when --save_precision is not "
                             "given (the merge and SVD are computed in float64). Default: float")
    parser.add_argument("--save_to", required=True, metavar="OUT",
                        help="the LoRA to write (.safetensors; .ckpt/.pt: a state dict without metadata)")
    parser.add_argument("--models", nargs="+", required=True, metavar="NET",
                        help="network files to merge (any type, one model kind)")
    parser.add_argument("--ratios", type=float, nargs="*", default=None,
                        help="one multiplier per file. Default: 1.0 each")
    parser.add_argument("--lbws", type=str, nargs="*", default=None,
                        help="one block-weight list per file, JSON, e.g. \"[1,0,0,1,1,1,1,1,1,1,1,1]\": 17 or 26 "
                             "values for SD1.x/2.x, 12 or 20 for SDXL (see README). Default: none")
    parser.add_argument("--new_rank", type=int, default=4, help="rank of the output LoRA. Default: 4")
    parser.add_argument("--new_conv_rank", type=int, default=None,
                        help="rank of 3x3 conv modules. Default: --new_rank")
    parser.add_argument("--device", default=None, help="device of the SVD, e.g. cuda. Default: the CPU")
    parser.add_argument("--no_metadata", action="store_true",
                        help="write only kohya's minimal ss_* keys and hashes, no modelspec.* keys")
    parser.add_argument("--sd_model", default=None,
                        help="the base model (single file or diffusers folder); needed only for OFT/iA3/GLoRA/DoRA "
                             "files, whose change depends on the base weights. Default: none")
    merge_lora.add_base_model_arguments(parser)
    return parser


def resolve_device(name: Optional[str]) -> torch.device:
    if name is None:
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UserError(f"--device {name}: not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name}: no CUDA device is available here; leave --device out for the CPU")
    return device


def validate(args: argparse.Namespace) -> None:
    """Everything the options alone show to be wrong (files, counts, ranks, output path), before reading weights."""
    for flag in ("new_rank", "new_conv_rank"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UserError(f"--{flag} must be a rank >= 1 (got {value})")
    merge_lora.resolve_ratios(args.models, args.ratios)
    if args.lbws:
        lora_block_weights.parse_lbws(args.lbws, args.models)
    for path in args.models:
        if not Path(path).is_file():
            raise UserError(f"--models {path} does not exist")
    check_output_path("--save_to", args.save_to, [("--models", path) for path in args.models]
                      + [("--sd_model", args.sd_model)], OUTPUT_SUFFIXES)
    resolve_device(args.device)


def svd_merge(files: network_deltas.NetworkFiles, ratios: Sequence[float],
              block_weights: Sequence[Optional[Sequence[float]]], new_rank: int,
              new_conv_rank: int, device: torch.device = torch.device("cpu"),
              report: Optional[Callable[[MergedModule], None]] = None) -> SvdMerge:
    """One LoRA module per layer the files change: the best rank-``new_rank`` (3x3 convs: ``new_conv_rank``;
    at most the layer's channels) approximation of ``sum ratio_i * block weight_i * change_i``, alpha = rank.
    ``block_weights``: per file, the 26 block multipliers of ``--lbws`` or None. Bias changes and norm layers,
    which a LoRA cannot hold, are listed in ``dropped``."""
    weights: dict[str, torch.Tensor] = {}
    modules, dropped = [], []
    dropped_squares = 0.0
    is_sdxl = files.model.kind == "sdxl"
    for module in files.module_changes():
        factors = [ratios[index] * lora_block_weights.module_weight(block_weights[index], module.name, is_sdxl)
                   for index, _ in module.changes]
        if not isinstance(module.layer, (torch.nn.Linear, torch.nn.Conv2d)):
            dropped.append(f"{module.name}: a {type(module.layer).__name__} (norm layer) module")
            dropped_squares += sum(float((factor * change).pow(2).sum()) for factor, (_, changes)
                                   in zip(factors, module.changes) for change in changes.values())
            continue
        delta = sum(factor * changes["weight"] for factor, (_, changes) in zip(factors, module.changes))
        bias = sum(factor * changes["bias"] for factor, (_, changes) in zip(factors, module.changes)
                   if "bias" in changes)
        if isinstance(bias, torch.Tensor) and bool(bias.any()):
            dropped.append(f"{module.name}: its bias change")
            dropped_squares += float(bias.pow(2).sum())
        out_channels, in_channels = delta.shape[:2]
        is_conv3x3 = delta.dim() == 4 and tuple(delta.shape[2:]) != (1, 1)
        rank = min(new_conv_rank if is_conv3x3 else new_rank, in_channels, out_channels)
        parts, _, error = resize_lora.low_rank_module(delta.to(device), rank, None, None, scale=1.0)
        if parts["down"].shape[0] < rank:  # an all-zero change (rank 1): zeros of kohya's rank, same delta
            parts = zero_padded(parts, rank)
        weights[f"{module.name}.lora_down.weight"] = parts["down"].cpu()
        weights[f"{module.name}.lora_up.weight"] = parts["up"].cpu()
        weights[f"{module.name}.alpha"] = parts["alpha"].cpu()
        result = MergedModule(module.name, parts["down"].shape[0], error, float(delta.norm()))
        modules.append(result)
        if report is not None:
            report(result)
    return SvdMerge(weights, modules, dropped, math.sqrt(dropped_squares))


def zero_padded(parts: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """A module of scale 1 widened to ``rank`` with zero rows/columns (its delta unchanged), alpha = ``rank``."""
    missing = rank - parts["down"].shape[0]
    down = torch.cat([parts["down"], parts["down"].new_zeros(missing, *parts["down"].shape[1:])])
    up = torch.cat([parts["up"], parts["up"].new_zeros(parts["up"].shape[0], missing, *parts["up"].shape[2:])], dim=1)
    return {"down": down, "up": up, "alpha": torch.tensor(float(rank))}


def parse_block_weights(lbws: Optional[Sequence[str]], models: Sequence[str], kind: str
                        ) -> list[Optional[list[float]]]:
    """``--lbws`` as 26 block multipliers per file (None each without it). The list length says the model
    (12/20: SDXL, 17/26: SD1.x/2.x, as kohya decides); one of the other model than the files' is refused,
    where kohya would apply it to the text encoders only."""
    if not lbws:
        return [None] * len(models)
    weights = lora_block_weights.parse_lbws(lbws, models)
    length = len(json.loads(lbws[0]))
    if (length in (12, 20)) != (kind == "sdxl"):
        valid = "12 or 20" if kind == "sdxl" else "17 or 26"
        raise UserError(f"--lbws: {length} numbers is the {'SDXL' if length in (12, 20) else 'SD1.x/2.x'} preset, "
                        f"but the --models are {network_deltas.KIND_NAMES[kind]} networks; give {valid} numbers")
    return weights


def output_metadata(paths: Sequence[str], kind: str, weights: dict[str, torch.Tensor], args: argparse.Namespace,
                    new_conv_rank: int) -> dict[str, str]:
    """kohya's: the minimal network keys (``ss_v2`` and ``ss_base_model_version`` from the first file that has
    them), the addnet hashes, and unless ``--no_metadata`` the model spec (title: the output's name,
    merged_from: the inputs' titles)."""
    sources = [network_base.read_lora_metadata(path) for path in paths]
    metadata = {"ss_network_module": "networks.lora", "ss_network_dim": str(args.new_rank),
                "ss_network_alpha": str(args.new_rank)}
    v2 = next((source["ss_v2"] for source in sources if "ss_v2" in source), None)
    base_model = next((source["ss_base_model_version"] for source in sources if "ss_base_model_version" in source),
                      None)
    if v2 is not None:
        metadata["ss_v2"] = v2
    metadata["ss_base_model_version"] = base_model or BASE_MODEL_VERSIONS[kind]
    metadata["ss_network_args"] = json.dumps({"conv_dim": new_conv_rank, "conv_alpha": new_conv_rank})
    metadata.update(addnet_hashes(weights, metadata))
    if args.no_metadata:
        return metadata
    prediction = next((source["modelspec.prediction_type"] for source in sources
                       if "modelspec.prediction_type" in source), None)
    spec_args = argparse.Namespace(
        output_name=Path(args.save_to).stem, v_parameterization=prediction == "v" if prediction else kind == "sd2",
        metadata_merged_from=", ".join(source.get("modelspec.title") or Path(path).stem
                                       for path, source in zip(paths, sources)))
    resolution = 1024 if kind == "sdxl" else 768 if spec_args.v_parameterization else 512
    metadata.update(modelspec_metadata(spec_args, kind, (resolution, resolution), wall_clock()))
    return metadata


def main(argv: Sequence[str] | None = None) -> None:
    args = setup_parser().parse_args(argv)
    validate(args)
    ratios = merge_lora.resolve_ratios(args.models, args.ratios)
    kind = network_deltas.files_model_kind(args.models, "--models")
    block_weights = parse_block_weights(args.lbws, args.models, kind)
    for path, weights in zip(args.models, block_weights):
        if weights is not None:
            print(f"{Path(path).name}: block weights " + ", ".join(
                f"{name} {value:g}" for name, value in zip(lora_block_weights.BLOCKS, weights)))
    new_conv_rank = args.new_conv_rank if args.new_conv_rank is not None else args.new_rank
    files = network_deltas.NetworkFiles(args.models, network_deltas.model_for_networks(kind, args), "--models")
    files.check_base_independent()

    def report(result: MergedModule) -> None:
        print(f"{result.name}: rank {result.rank}, relative error {result.relative_error:.3g}", flush=True)

    merged = svd_merge(files, ratios, block_weights, args.new_rank, new_conv_rank, resolve_device(args.device),
                       report)
    if not merged.modules:
        raise UserError("--models: the files change no Linear/Conv2d layer; nothing to merge")
    if merged.dropped:
        print(f"not representable in a LoRA, dropped: {len(merged.dropped)} ({merged.dropped[0]}, ...), "
              f"||change|| {merged.dropped_norm:.3g}")
    dtype = SAVE_DTYPES[args.save_precision] or SAVE_DTYPES[args.precision]
    weights = {key: value.to(dtype) for key, value in merged.weights.items()}
    network_base.save_lora_file(weights, args.save_to, output_metadata(args.models, kind, weights, args, new_conv_rank))
    worst = max(merged.modules, key=lambda module: module.relative_error)
    print(f"saved {args.save_to}: {len(merged.modules)} LoRA modules from {len(args.models)} files "
          f"({network_deltas.KIND_NAMES[kind]}), ranks {json.dumps(sorted({m.rank for m in merged.modules}))}, "
          f"overall relative error {merged.overall_error:.3g}, largest {worst.relative_error:.3g} ({worst.name})")


if __name__ == "__main__":
    exit_on_user_error(main)
