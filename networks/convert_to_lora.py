"""Convert any network file into a plain kohya LoRA/LoCon that every loader reads (SDXL and SD 1.x/2.x).

    python networks/convert_to_lora.py --sd_model BASE --model NET.safetensors --save_to OUT.safetensors \
        [--dim 32] [--conv_dim R] [--max_error 0.01] [--save_precision fp16]

The network (any ``networks.registry`` type: LoHa, LoKr, OFT, LyCORIS iA3/GLoRA/BOFT/Full/..., or a
LoRA) is rebuilt on the base model as ``networks/merge_lora.py`` does, and each module's weight change
``delta = merged weight - base weight`` (what the module does at multiplier 1; for OFT and iA3 it
depends on the base weight, hence ``--sd_model``) is approximated by its best rank-``r`` LoRA
module (SVD, as kohya's extract and resize tools do): ``lora_down``/``lora_up``/``alpha`` keys under
kohya's names (``oft_unet_*`` becomes ``lora_unet_*``), 3x3 convs as LoCon modules. Every module's
alpha is ``--dim`` (its scale ``dim / rank``): diffusers reads per-module alphas that differ from the
most common one wrongly for SD 1.x files (alpha_pattern; found with its own loader), a single alpha
reaches every loader intact.

Rank per module: ``--dim`` (``--conv_dim`` for 3x3 convs, default ``--dim``), capped by the weight's
own rank; with ``--max_error E`` the smallest rank whose relative error is at most ``E`` (up to that
cap). The relative error of a module is ``||delta - LoRA delta||_F / ||delta||_F``; one line per module
and the overall error (the same over all modules' deltas together) are printed, and modules that stay
above ``--max_error`` at the cap are named. A LoRA cannot hold a bias or a norm layer: LyCORIS Full's
bias changes and ``train_norm`` modules are dropped, with one line saying how many (and their size).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Callable, Optional, Sequence  # noqa: E402

import torch  # noqa: E402

from library import checkpoint_keys  # noqa: E402
from library.errors import UserError, exit_on_user_error  # noqa: E402
from library.lora_files import SAVE_DTYPES  # noqa: E402
from library.lora_metadata import addnet_hashes  # noqa: E402
from library.models import StableDiffusionModels  # noqa: E402
from networks import merge_lora, network_base, registry, resize_lora  # noqa: E402


@dataclass(frozen=True)
class ConvertedModule:
    """One module's outcome: its LoRA name, the rank written and the relative (Frobenius) error of its delta."""

    name: str
    rank: int
    relative_error: float
    delta_norm: float  # ||delta||_F, for the overall error


@dataclass
class Conversion:
    """A converted network: the LoRA state dict, a result per module, and what a LoRA cannot hold."""

    weights: dict[str, torch.Tensor]
    modules: list[ConvertedModule]
    dropped: list[str]  # "name: what" for bias changes and norm modules
    dropped_norm: float  # ||dropped changes||_F

    @property
    def overall_error(self) -> float:
        """||all deltas - all LoRA deltas||_F / ||all deltas||_F over every converted module."""
        total = sum(module.delta_norm ** 2 for module in self.modules)
        error = sum((module.relative_error * module.delta_norm) ** 2 for module in self.modules)
        return math.sqrt(error / total) if total > 0 else 0.0


def lora_name(name: str) -> str:
    """kohya's LoRA key prefix for a module of any type (kohya's OFT writes ``oft_unet_``)."""
    return "lora_unet_" + name[len("oft_unet_"):] if name.startswith("oft_unet_") else name


def convert_network(network: network_base.AdapterNetwork, dim: int, conv_dim: Optional[int] = None,
                    max_error: Optional[float] = None,
                    report: Optional[Callable[[ConvertedModule], None]] = None) -> Conversion:
    """Every module of ``network`` (built on its models with its weights, not applied) as a LoRA module:
    rank ``dim`` (``conv_dim`` for 3x3 convs), or with ``max_error`` the smallest rank up to that whose
    relative error is at most ``max_error``. ``report`` receives each module's result."""
    weights: dict[str, torch.Tensor] = {}
    modules, dropped = [], []
    dropped_squares = 0.0
    method, param = (None, None) if max_error is None else ("sv_fro", math.sqrt(max(0.0, 1.0 - max_error ** 2)))
    for lora in network.all_loras():
        layer = network.wrapped_module(lora)
        changes = parameter_changes(network, lora, layer)
        if not isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d)):
            dropped.append(f"{lora.lora_name}: a {type(layer).__name__} (norm layer) module")
            dropped_squares += sum(float(change.pow(2).sum()) for change in changes.values())
            continue
        delta = changes["weight"]
        if "bias" in changes and bool(changes["bias"].any()):
            dropped.append(f"{lora.lora_name}: its bias change")
            dropped_squares += float(changes["bias"].pow(2).sum())
        is_conv3x3 = delta.dim() == 4 and tuple(delta.shape[2:]) != (1, 1)
        cap = (conv_dim or dim) if is_conv3x3 else dim  # low_rank_module caps it at the delta's own rank
        parts, _, error = resize_lora.low_rank_module(delta, cap, method, param, alpha=float(dim))
        name = lora_name(lora.lora_name)
        weights[f"{name}.lora_down.weight"] = parts["down"]
        weights[f"{name}.lora_up.weight"] = parts["up"]
        weights[f"{name}.alpha"] = parts["alpha"]
        result = ConvertedModule(name, parts["down"].shape[0], error, float(delta.norm()))
        modules.append(result)
        if report is not None:
            report(result)
    return Conversion(weights, modules, dropped, math.sqrt(dropped_squares))


@torch.no_grad()
def parameter_changes(network: network_base.AdapterNetwork, lora: torch.nn.Module, layer: torch.nn.Module
                      ) -> dict[str, torch.Tensor]:
    """What merging ``lora`` at multiplier 1 changes in ``layer``'s parameters, in float64.

    The layer and the module are merged in float64 (``network_base.merge_dtype``), so a change far smaller
    than the weight keeps its digits, and are cast back (exactly) to their dtypes afterwards. Code that
    computes in float32 only (LyCORIS' OFT and BOFT rotations) fails on float64 tensors: such a module is
    merged in its own dtype instead.
    """
    dtypes = (layer.weight.dtype, next((p.dtype for p in lora.parameters()), layer.weight.dtype))
    base = {name: value.detach().double() for name, value in layer.named_parameters(recurse=False)}
    try:
        layer.to(torch.float64)
        lora.to(torch.float64)
        merged = network.merged_parameters(lora, 1.0)
    except RuntimeError:  # float32-only code: "expected ... same dtype"
        layer.to(dtypes[0])
        lora.to(dtypes[1])
        merged = network.merged_parameters(lora, 1.0)
    finally:
        layer.to(dtypes[0])
        lora.to(dtypes[1])
    return {key: value.double() - base[key] for key, value in merged.items()}


def load_network(models: StableDiffusionModels, path: str) -> network_base.AdapterNetwork:
    """The network of ``path`` on ``models`` (weights loaded, not applied), in eval mode (no dropout)."""
    unet_names = checkpoint_keys.unet_module_name_map(models.unet.config) if models.is_sdxl else None
    return registry.network_from_file(path, models.text_encoders, models.unet, unet_names, "--model").eval()


def output_metadata(source: dict[str, str], conversion: Conversion, source_path: str, args: argparse.Namespace
                    ) -> dict[str, str]:
    """The source's metadata as a kohya LoRA's: type, ranks, alpha, conv settings, and what it came from."""
    metadata = {key: value for key, value in source.items() if not key.startswith("sshs_")}
    ranks = sorted({module.rank for module in conversion.modules})
    metadata["ss_network_module"] = "networks.lora"
    metadata["ss_network_dim"] = str(ranks[0]) if len(ranks) == 1 else "Dynamic"
    metadata["ss_network_alpha"] = str(float(args.dim))
    metadata["ss_network_args"] = json.dumps({"conv_dim": str(args.conv_dim or args.dim),
                                              "conv_alpha": str(float(args.dim))})
    metadata["ss_training_comment"] = (f"converted from {Path(source_path).name} "
                                       f"({source.get('ss_network_module', 'unknown type')}) with "
                                       f"relative error {conversion.overall_error:.3g}")
    metadata.update(addnet_hashes(conversion.weights, metadata))
    return metadata


def setup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="convert_to_lora.py", description=__doc__.splitlines()[0])
    parser.add_argument("--sd_model", required=True,
                        help="the base model the network was trained on (.safetensors/.ckpt single file or diffusers "
                             "folder): OFT's and iA3's change depends on its weights")
    parser.add_argument("--model", required=True, metavar="NET", help="network file to convert (any type)")
    parser.add_argument("--save_to", required=True, metavar="OUT", help="the LoRA to write (.safetensors)")
    parser.add_argument("--dim", type=int, default=32,
                        help="rank of Linear and 1x1 conv modules (the most with --max_error). Default: 32")
    parser.add_argument("--conv_dim", type=int, default=None, help="rank of 3x3 conv modules. Default: --dim")
    parser.add_argument("--max_error", type=float, default=None,
                        help="per module, the smallest rank (up to --dim/--conv_dim) whose relative error "
                             "||delta - LoRA delta|| / ||delta|| is at most this, e.g. 0.01. Default: the fixed rank")
    parser.add_argument("--save_precision", default=None, choices=[None, "float", "fp16", "bf16"],
                        help="dtype of the saved weights. Default: float")
    merge_lora.add_base_model_arguments(parser)
    return parser


def validate(args: argparse.Namespace) -> None:
    resize_lora.validate_ranks_and_output(args, "dim", "conv_dim", input_flags=("model", "sd_model"))
    if args.max_error is not None and not 0 <= args.max_error < 1:
        raise UserError(f"--max_error {args.max_error}: give a relative error in [0, 1), e.g. 0.01")


def main(argv: Sequence[str] | None = None) -> None:
    args = setup_parser().parse_args(argv)
    validate(args)
    source = network_base.read_lora_metadata(args.model) if Path(args.model).is_file() else {}
    kind = merge_lora.detect_kind(Path(args.sd_model), args)
    merge_lora.check_networks_fit([args.model], "--sd_model", args.sd_model, kind, "--model")  # reads the file
    models = merge_lora.load_base_model(args)
    network = load_network(models, args.model)

    def report(result: ConvertedModule) -> None:
        print(f"{result.name}: rank {result.rank}, relative error {result.relative_error:.3g}", flush=True)

    conversion = convert_network(network, args.dim, args.conv_dim, args.max_error, report)
    if conversion.dropped:
        print(f"not representable in a LoRA, dropped: {len(conversion.dropped)} ({conversion.dropped[0]}, ...), "
              f"||change|| {conversion.dropped_norm:.3g}")
    if args.max_error is not None:
        above = [module.name for module in conversion.modules if module.relative_error > args.max_error]
        if above:
            print(f"{len(above)} module(s) stay above --max_error {args.max_error} at the highest rank allowed "
                  f"(first: {above[0]}); raise --dim/--conv_dim")
    dtype = SAVE_DTYPES[args.save_precision] or torch.float32
    weights = {key: value.to(dtype) for key, value in conversion.weights.items()}
    network_base.save_lora_file(weights, args.save_to, output_metadata(source, conversion, args.model, args))
    worst = max(conversion.modules, key=lambda module: module.relative_error)
    print(f"saved {args.save_to}: {len(conversion.modules)} LoRA modules ({models.kind}), ranks "
          f"{json.dumps(sorted({module.rank for module in conversion.modules}))}, overall relative error "
          f"{conversion.overall_error:.3g}, largest {worst.relative_error:.3g} ({worst.name})")


if __name__ == "__main__":
    exit_on_user_error(main)
