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
own rank; with ``--max_error E`` the smallest rank whose relative weight error ``||delta - LoRA delta||_F /
||delta||_F`` is at most ``E`` (up to that cap); modules that stay above it at the cap are named.

The errors printed are those of the file written (its factors as saved, ``--save_precision`` included),
against everything the network changes, per module and overall (over all modules together):
* on the weights: ``||change - written change|| / ||change||`` over each layer's parameters, bias included;
* on the output: the same for the layer's output change on fixed probe inputs (a batch of 4 standard
  normal samples of the layer's input shape, 8x8 pixels for convs, from a generator seeded with the CRC-32 of
  the module's key prefix), as Linear/Conv2d/norm layers are affine in their parameters.
A LoRA cannot hold a bias change or a norm layer (LyCORIS Full's bias changes, ``train_norm`` modules), nor a
change of a higher rank than it is given: one line each says how many modules lose what, as a share of the
network's change on the weights and on the output. The last line says which loaders apply the original file
as written (the README's loader table), for which the original is the better choice.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import zlib  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Callable, Optional, Sequence  # noqa: E402

import torch  # noqa: E402

from library import checkpoint_keys  # noqa: E402
from library.errors import UserError, exit_on_user_error  # noqa: E402
from library.lora_files import SAVE_DTYPES  # noqa: E402
from library.lora_metadata import addnet_hashes  # noqa: E402
from library.models import StableDiffusionModels  # noqa: E402
from networks import merge_lora, network_base, registry, resize_lora  # noqa: E402
from networks.lora import lora_delta  # noqa: E402


PROBE_BATCH = 4
"""Probe inputs per module: a batch of this many seeded standard-normal samples ..."""
PROBE_SIZE = 8
"""... of the module's input shape, with PROBE_SIZE x PROBE_SIZE pixels for convs and GroupNorms."""

# Which loaders apply a type as written (README, "Network files in other programs": checked with ComfyUI's and
# diffusers' own loaders); lycoris.kohya files by their modules' algo. A type missing here: none known.
BOTH_LOADERS = ("ComfyUI", "diffusers")
APPLIED_AS_WRITTEN = {
    "networks.lora": BOTH_LOADERS, "networks.dylora": BOTH_LOADERS, "networks.lora_fa": BOTH_LOADERS,
    "networks.loha": ("ComfyUI",), "networks.lokr": ("ComfyUI",), "networks.oft": (),
    "LoConModule": BOTH_LOADERS, "LohaModule": ("ComfyUI",), "LokrModule": ("ComfyUI",), "GLoRAModule": ("ComfyUI",),
    "DiagOFTModule": ("ComfyUI",), "ButterflyOFTModule": ("ComfyUI",), "FullModule": ("ComfyUI",),
    "DyLoraModule": ("ComfyUI",), "IA3Module": (),
}


@dataclass(frozen=True)
class ConvertedModule:
    """One module's outcome: its LoRA name, the rank written (0: not written) and what the written module misses
    of the network's change, measured on the parameters (Frobenius norms over weight and bias together) and on
    the layer's output for the module's probe inputs (:func:`probe_input`). ``*_missed``: the norm of (network
    change - written change); ``rank_*``: of its weight part alone (what a higher rank would recover);
    ``bias_*``: of the bias change (which no LoRA holds)."""

    name: str
    rank: int
    change_norm: float
    missed_norm: float
    rank_missed_norm: float
    bias_norm: float
    effect_norm: float  # ||output change|| on the probe inputs
    output_missed_norm: float
    output_rank_missed_norm: float
    output_bias_norm: float
    layer: str  # the wrapped layer's class name

    @property
    def relative_error(self) -> float:
        """||change - written change|| / ||change|| over the layer's parameters (0 for no change)."""
        return self.missed_norm / self.change_norm if self.change_norm > 0 else 0.0

    @property
    def rank_error(self) -> float:
        """||weight change - written weight change|| / ||weight change||: what ``--max_error`` bounds."""
        weight_norm = math.sqrt(max(self.change_norm ** 2 - self.bias_norm ** 2, 0.0))
        return self.rank_missed_norm / weight_norm if weight_norm > 0 else 0.0

    @property
    def output_error(self) -> float:
        """||output change - written output change|| / ||output change|| on the probe inputs."""
        return self.output_missed_norm / self.effect_norm if self.effect_norm > 0 else 0.0


def _ratio(modules: Sequence[ConvertedModule], numerator: str, denominator: str) -> float:
    """sqrt(sum of squares of ``numerator``) / sqrt(sum of squares of ``denominator``) over ``modules``."""
    total = sum(getattr(module, denominator) ** 2 for module in modules)
    part = sum(getattr(module, numerator) ** 2 for module in modules)
    return math.sqrt(part / total) if total > 0 else 0.0


@dataclass
class Conversion:
    """A converted network: the LoRA state dict (in the dtype it is saved in) and a result per module."""

    weights: dict[str, torch.Tensor]
    modules: list[ConvertedModule]

    @property
    def overall_error(self) -> float:
        """||all changes - all written changes|| / ||all changes|| over every module's parameters."""
        return _ratio(self.modules, "missed_norm", "change_norm")

    @property
    def overall_output_error(self) -> float:
        """The same over every module's output change on its probe inputs."""
        return _ratio(self.modules, "output_missed_norm", "effect_norm")

    @property
    def not_written(self) -> list[ConvertedModule]:
        """Modules a LoRA cannot hold at all (norm layers)."""
        return [module for module in self.modules if module.rank == 0]

    @property
    def with_bias_change(self) -> list[ConvertedModule]:
        return [module for module in self.modules if module.rank > 0 and module.bias_norm > 0]

    @property
    def rank_limited(self) -> list[ConvertedModule]:
        """Written modules whose weight change needs a higher rank than written (beyond float32 rounding)."""
        return [module for module in self.modules if module.rank > 0
                and module.rank_missed_norm > RANK_ROUNDING * module.change_norm]


RANK_ROUNDING = 1e-6
"""A written module's weight error at or below this (relative) is rounding of the float32 factors, not rank."""


def lora_name(name: str) -> str:
    """kohya's LoRA key prefix for a module of any type (kohya's OFT writes ``oft_unet_``)."""
    return "lora_unet_" + name[len("oft_unet_"):] if name.startswith("oft_unet_") else name


def probe_input(layer: torch.nn.Module, name: str) -> torch.Tensor:
    """The fixed probe inputs of the module ``name`` (its original key prefix) wrapping ``layer``: float64,
    standard normal from a generator seeded with the CRC-32 of ``name``, ``PROBE_BATCH`` samples of the
    layer's input shape."""
    if isinstance(layer, torch.nn.Linear):
        shape: tuple[int, ...] = (layer.in_features,)
    elif isinstance(layer, torch.nn.Conv2d):
        shape = (layer.in_channels, PROBE_SIZE, PROBE_SIZE)
    elif isinstance(layer, torch.nn.GroupNorm):
        shape = (layer.num_channels, PROBE_SIZE, PROBE_SIZE)
    elif isinstance(layer, torch.nn.LayerNorm):
        shape = tuple(layer.normalized_shape)
    else:
        raise UserError(f"module {name}: a {type(layer).__name__} layer, which this converter cannot measure")
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn((PROBE_BATCH, *shape), generator=generator, dtype=torch.float64)


def output_change(layer: torch.nn.Module, change: dict[str, torch.Tensor], probe: torch.Tensor) -> torch.Tensor:
    """What a change of the layer's parameters (missing ones: 0) changes in its output for ``probe``: the layer's
    function with the change as its parameters, as Linear, Conv2d and the norm layers are affine in theirs."""
    parameters = {name: change.get(name, torch.zeros_like(value, dtype=torch.float64))
                  for name, value in layer.named_parameters(recurse=False)}
    return torch.func.functional_call(layer, parameters, (probe,))


def measure_module(name: str, original_name: str, layer: torch.nn.Module, changes: dict[str, torch.Tensor],
                   written: Optional[torch.Tensor], rank: int) -> ConvertedModule:
    """Compare the network's parameter ``changes`` of ``layer`` (float64) with the ``written`` weight change
    (float64; None: nothing written) on the parameters and on the layer's output for its probe inputs."""
    probe = probe_input(layer, original_name)
    kept = {"weight": written} if written is not None else {}
    missed = {key: value - kept[key] if key in kept else value for key, value in changes.items()}
    weight_missed = {"weight": missed["weight"]}
    bias = {"bias": changes["bias"]} if "bias" in changes else {}

    def norm(values: dict[str, torch.Tensor]) -> float:
        return math.sqrt(sum(float(value.pow(2).sum()) for value in values.values()))

    return ConvertedModule(
        name=name, rank=rank, change_norm=norm(changes), missed_norm=norm(missed),
        rank_missed_norm=norm(weight_missed) if written is not None else 0.0, bias_norm=norm(bias),
        effect_norm=float(output_change(layer, changes, probe).norm()),
        output_missed_norm=float(output_change(layer, missed, probe).norm()),
        output_rank_missed_norm=float(output_change(layer, weight_missed, probe).norm()) if written is not None else 0.0,
        output_bias_norm=float(output_change(layer, bias, probe).norm()) if bias else 0.0,
        layer=type(layer).__name__)


def convert_network(network: network_base.AdapterNetwork, dim: int, conv_dim: Optional[int] = None,
                    max_error: Optional[float] = None,
                    report: Optional[Callable[[ConvertedModule], None]] = None,
                    save_dtype: torch.dtype = torch.float32) -> Conversion:
    """Every module of ``network`` (built on its models with its weights, not applied) as a LoRA module:
    rank ``dim`` (``conv_dim`` for 3x3 convs), or with ``max_error`` the smallest rank up to that whose
    relative weight error is at most ``max_error``. The weights are cast to ``save_dtype`` and the errors are
    those of the cast weights (what a file saved in that dtype does). ``report`` receives each module's result."""
    weights: dict[str, torch.Tensor] = {}
    modules = []
    method, param = (None, None) if max_error is None else ("sv_fro", math.sqrt(max(0.0, 1.0 - max_error ** 2)))
    for lora in network.all_loras():
        layer = network.wrapped_module(lora)
        changes = parameter_changes(network, lora, layer)
        name = lora_name(lora.lora_name)
        written, rank = None, 0
        if isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d)):
            delta = changes["weight"]
            is_conv3x3 = delta.dim() == 4 and tuple(delta.shape[2:]) != (1, 1)
            cap = (conv_dim or dim) if is_conv3x3 else dim  # low_rank_module caps it at the delta's own rank
            parts, _, _ = resize_lora.low_rank_module(delta, cap, method, param, alpha=float(dim))
            parts = {key: value.to(save_dtype) for key, value in parts.items()}
            weights[f"{name}.lora_down.weight"] = parts["down"]
            weights[f"{name}.lora_up.weight"] = parts["up"]
            weights[f"{name}.alpha"] = parts["alpha"]
            written, rank = lora_delta(parts, torch.float64), parts["down"].shape[0]
        result = measure_module(name, lora.lora_name, layer, changes, written, rank)
        modules.append(result)
        if report is not None:
            report(result)
    return Conversion(weights, modules)


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
    ranks = sorted({module.rank for module in conversion.modules if module.rank})
    metadata["ss_network_module"] = "networks.lora"
    metadata["ss_network_dim"] = str(ranks[0]) if len(ranks) == 1 else "Dynamic"
    metadata["ss_network_alpha"] = str(float(args.dim))
    metadata["ss_network_args"] = json.dumps({"conv_dim": str(args.conv_dim or args.dim),
                                              "conv_alpha": str(float(args.dim))})
    metadata["ss_training_comment"] = (f"converted from {Path(source_path).name} "
                                       f"({source.get('ss_network_module', 'unknown type')}) with "
                                       f"relative error {conversion.overall_error:.3g} (weights), "
                                       f"{conversion.overall_output_error:.3g} (output on probe inputs)")
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


def loaders_applying(network: network_base.AdapterNetwork) -> tuple[str, ...]:
    """The loaders of ``APPLIED_AS_WRITTEN`` that apply every module of ``network`` as written."""
    kinds = {network.network_module} if network.network_module in APPLIED_AS_WRITTEN else \
        {type(lora).__name__ for lora in network.all_loras()}
    if not kinds or not kinds <= set(APPLIED_AS_WRITTEN):
        return ()
    return tuple(loader for loader in BOTH_LOADERS if all(loader in APPLIED_AS_WRITTEN[kind] for kind in kinds))


def print_module(result: ConvertedModule) -> None:
    if result.rank == 0:
        print(f"{result.name}: a {result.layer} (norm layer): not written, relative error 1", flush=True)
        return
    bias = ", its bias change not written" if result.bias_norm > 0 else ""
    print(f"{result.name}: rank {result.rank}, relative error: weights {result.relative_error:.6g}, output "
          f"{result.output_error:.6g}{bias}", flush=True)


def print_losses(conversion: Conversion, args: argparse.Namespace) -> None:
    """One line per thing the LoRA format cannot carry (bias changes, norm layers, the rank), with its share of
    the network's change on the parameters and on the output for the probe inputs."""
    modules = conversion.modules

    def share(parts: Sequence[ConvertedModule], weight_part: str, output_part: str) -> str:
        def of_all(part: str, whole: str) -> float:
            total = sum(getattr(module, whole) ** 2 for module in modules)
            return math.sqrt(sum(getattr(module, part) ** 2 for module in parts) / total) if total > 0 else 0.0
        return (f"{of_all(weight_part, 'change_norm'):.6g} of the network's change on the weights, "
                f"{of_all(output_part, 'effect_norm'):.6g} on the output")

    if conversion.with_bias_change:
        biased = conversion.with_bias_change
        print(f"a LoRA cannot hold bias changes: {len(biased)} module(s) change their bias (first: {biased[0].name}); "
              f"not written: {share(biased, 'bias_norm', 'output_bias_norm')}")
    if conversion.not_written:
        dropped = conversion.not_written
        print(f"a LoRA cannot hold norm layers: {len(dropped)} module(s) not written (first: {dropped[0].name}): "
              f"{share(dropped, 'change_norm', 'effect_norm')}")
    if conversion.rank_limited:
        limited = conversion.rank_limited
        worst = max(limited, key=lambda module: module.output_rank_missed_norm / (module.effect_norm or 1.0))
        ranks = f"--dim {args.dim}" + (f" / --conv_dim {args.conv_dim}" if args.conv_dim else "")
        print(f"the rank ({ranks}) is below what {len(limited)} module(s) change (largest output loss "
              f"{worst.output_rank_missed_norm / (worst.effect_norm or 1.0):.6g} in {worst.name}); lost to the rank: "
              f"{share(limited, 'rank_missed_norm', 'output_rank_missed_norm')}")


def print_loader_advice(network: network_base.AdapterNetwork, conversion: Conversion, source: str) -> None:
    """Which loaders are better served by the original file (they apply it as written, exactly)."""
    loaders = loaders_applying(network)
    if not loaders:
        print(f"{source}: no loader in the README's table applies this type as written; use the converted file")
        return
    others = [loader for loader in BOTH_LOADERS if loader not in loaders]
    error = conversion.overall_output_error
    names = " and ".join(loaders)
    verdict = (f"the conversion loses {error:.3g} of its output change: give {names} the original"
               if error > RANK_ROUNDING else "the conversion is exact up to rounding: either file does")
    print(f"{names} appl{'ies' if len(loaders) == 1 else 'y'} {source} as written; {verdict}"
          + (f"; the converted file is for {', '.join(others)}" if others else ""))


def main(argv: Sequence[str] | None = None) -> None:
    args = setup_parser().parse_args(argv)
    validate(args)
    source = network_base.read_lora_metadata(args.model) if Path(args.model).is_file() else {}
    kind = merge_lora.detect_kind(Path(args.sd_model), args)
    merge_lora.check_networks_fit([args.model], "--sd_model", args.sd_model, kind, "--model")  # reads the file
    models = merge_lora.load_base_model(args)
    network = load_network(models, args.model)
    dtype = SAVE_DTYPES[args.save_precision] or torch.float32
    conversion = convert_network(network, args.dim, args.conv_dim, args.max_error, print_module, save_dtype=dtype)
    print_losses(conversion, args)
    if args.max_error is not None:
        above = [module.name for module in conversion.modules if module.rank and module.rank_error > args.max_error]
        if above:
            print(f"{len(above)} module(s) stay above --max_error {args.max_error} at the highest rank allowed "
                  f"(first: {above[0]}); raise --dim/--conv_dim")
    network_base.save_lora_file(conversion.weights, args.save_to, output_metadata(source, conversion, args.model, args))
    written = [module for module in conversion.modules if module.rank]
    worst_weights = max(conversion.modules, key=lambda module: module.relative_error)
    worst_output = max(conversion.modules, key=lambda module: module.output_error)
    print(f"saved {args.save_to}: {len(written)} LoRA modules ({models.kind}), ranks "
          f"{json.dumps(sorted({module.rank for module in written}))}; relative error of what it writes "
          f"(everything the network changes included): weights {conversion.overall_error:.6g}, output on the probe "
          f"inputs {conversion.overall_output_error:.6g}; largest: weights {worst_weights.relative_error:.6g} "
          f"({worst_weights.name}), output {worst_output.output_error:.6g} ({worst_output.name})")
    print_loader_advice(network, conversion, args.model)


if __name__ == "__main__":
    exit_on_user_error(main)
