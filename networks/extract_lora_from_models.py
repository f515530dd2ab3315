"""Extract a LoRA from a base and a fine-tuned checkpoint by SVD of their weight differences (kohya's tool
and flags; SDXL and SD 1.x/2.x).

    python networks/extract_lora_from_models.py --model_org BASE --model_tuned TUNED --save_to OUT.safetensors \
        [--sdxl | --v2 [--v_parameterization]] [--dim 4] [--conv_dim R] [--clamp_quantile 0.99] \
        [--min_diff 0.01] [--save_precision float|fp16|bf16] [--device cuda] [--no_metadata]

The modules are kohya's LoRA network's on these models (the Linear and 1x1 conv layers of the text
encoders' attention/MLP and of the UNet's transformer blocks; with ``--conv_dim`` also the ResNet
blocks' and samplers' layers, 3x3 convs at rank ``--conv_dim``). For each, ``delta = W_tuned - W_org``
(the stored values differenced in float64, so exactly) is split by SVD (float32, as kohya) into its
best rank-``r`` approximation, ``r = min(--dim, in, out)``: ``lora_up = U S``, ``lora_down = V^T``,
both clamped to the ``--clamp_quantile`` quantile of their joined values, ``alpha = r`` (scale 1).
If no text-encoder weight differs by more than ``--min_diff``, only the UNet is extracted.

Streamed: the two models are never loaded. One module's pair of weights is read at a time from the
files (single files in the original layout, or diffusers folders), so the memory is one module's
weights and factors, not two models (kohya's tool holds both). A single file's architecture is the
shipped config of its kind, or ``--model_config_dir``.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from typing import Optional, Sequence  # noqa: E402

import torch  # noqa: E402

from library import checkpoint_keys, model_loading  # noqa: E402
from library.checkpoint_keys import ModelKind  # noqa: E402
from library.errors import UserError, exit_on_user_error  # noqa: E402
from library.lora_files import SAVE_DTYPES  # noqa: E402
from library.lora_metadata import addnet_hashes, modelspec_metadata, wall_clock  # noqa: E402
from library.model_weights import KIND_NAMES, ModelWeights, model_kind_of  # noqa: E402
from networks import network_base, resize_lora  # noqa: E402
from networks.lora import NETWORK_MODULE  # noqa: E402

LOAD_DTYPES = {None: None, "float": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# kohya's modelspec.implementation of a LoRA: SDXL's reference code, else diffusers.
IMPLEMENTATION_DIFFUSERS = "diffusers"


@dataclass(frozen=True)
class ExtractTarget:
    """One module to extract: kohya's LoRA name, where its weight is (component, diffusers name), its shape."""

    lora_name: str
    component: str
    weight_name: str
    shape: tuple[int, ...]

    @property
    def is_conv3x3(self) -> bool:
        return len(self.shape) == 4 and tuple(self.shape[2:]) != (1, 1)

    def wanted_rank(self, dim: int, conv_dim: Optional[int]) -> int:
        """``--conv_dim`` for 3x3 convs, else ``--dim``."""
        return conv_dim if self.is_conv3x3 and conv_dim is not None else dim

    def rank(self, dim: int, conv_dim: Optional[int]) -> int:
        """kohya's rank: the wanted rank capped at the in and out channels."""
        return min(self.wanted_rank(dim, conv_dim), self.shape[0], self.shape[1])


@dataclass
class Extraction:
    """The extracted LoRA's tensors and each module's relative error ||delta - LoRA delta|| / ||delta||."""

    weights: dict[str, torch.Tensor]
    errors: dict[str, float]
    text_encoder_extracted: bool


def setup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="extract_lora_from_models.py", description=__doc__.splitlines()[0])
    parser.add_argument("--v2", action="store_true", help="the models are Stable Diffusion 2.x")
    parser.add_argument("--v_parameterization", action="store_true", default=None,
                        help="metadata: the models are v-parameterization. Default: the same as --v2")
    parser.add_argument("--sdxl", action="store_true", help="the models are SDXL")
    parser.add_argument("--load_precision", default=None, choices=[None, "float", "fp16", "bf16"],
                        help="round the weights to this precision when read (kohya: the models' dtype). "
                             "Default: as stored")
    parser.add_argument("--save_precision", default=None, choices=[None, "float", "fp16", "bf16"],
                        help="dtype of the saved weights. Default: float")
    parser.add_argument("--model_org", required=True,
                        help="the original (base) model: .safetensors/.ckpt single file or diffusers folder")
    parser.add_argument("--model_tuned", required=True,
                        help="the tuned model; the LoRA is the change from --model_org to it (same formats)")
    parser.add_argument("--save_to", required=True, help="the LoRA file to write (.safetensors)")
    parser.add_argument("--dim", type=int, default=4,
                        help="rank of the LoRA (capped at each module's in/out size, as kohya). Default: 4")
    parser.add_argument("--conv_dim", type=int, default=None,
                        help="rank of 3x3 conv modules; given, the ResNet blocks are extracted too. Default: none")
    parser.add_argument("--device", default=None, help="device of the SVD, e.g. cuda. Default: the CPU")
    parser.add_argument("--clamp_quantile", type=float, default=0.99,
                        help="clamp the factors to this quantile of their values, in [0, 1]. Default: 0.99")
    parser.add_argument("--min_diff", type=float, default=0.01,
                        help="the text encoders are extracted only if some weight differs by more than this. "
                             "Default: 0.01")
    parser.add_argument("--no_metadata", action="store_true",
                        help="write only kohya's minimal ss_* metadata (no modelspec)")
    parser.add_argument("--load_original_model_to", default=None,
                        help="accepted for kohya compatibility (where kohya loads the SDXL base); no model is "
                             "loaded here, the weights are streamed")
    parser.add_argument("--load_tuned_model_to", default=None,
                        help="accepted for kohya compatibility (where kohya loads the tuned SDXL); no model is "
                             "loaded here, the weights are streamed")
    parser.add_argument("--model_config_dir", default=None,
                        help="architecture configs of single-file models (diffusers-format folder, no weights). "
                             "Default: the shipped config of the detected kind")
    return parser


def validate(args: argparse.Namespace) -> None:
    """The options alone, before any file is read."""
    resize_lora.validate_ranks_and_output(args, "dim", "conv_dim", input_flags=("model_org", "model_tuned"))
    if not 0 <= args.clamp_quantile <= 1:
        raise UserError(f"--clamp_quantile {args.clamp_quantile}: give a quantile in [0, 1], e.g. 0.99")
    model_loading.model_kind(sdxl=args.sdxl, v2=args.v2)
    if args.device is not None:
        try:
            device = torch.device(args.device)
        except RuntimeError as error:
            raise UserError(f"--device {args.device}: not a device name (cpu, cuda, cuda:0, ...)") from error
        if device.type == "cuda" and not torch.cuda.is_available():
            raise UserError(f"--device {args.device}: torch sees no CUDA device; leave --device out for the CPU")


def models_kind(args: argparse.Namespace) -> ModelKind:
    """The kind both models are, which must be the one --sdxl/--v2 select."""
    org = model_kind_of(Path(args.model_org), "--model_org")
    tuned = model_kind_of(Path(args.model_tuned), "--model_tuned")
    if org != tuned:
        raise UserError(f"--model_org {args.model_org} is {KIND_NAMES[org]}, --model_tuned {args.model_tuned} is "
                        f"{KIND_NAMES[tuned]}: a LoRA is extracted from two models of the same architecture")
    selected = model_loading.model_kind(sdxl=args.sdxl, v2=args.v2)
    if org != selected:
        hint = {"sdxl": "pass --sdxl", "sd2": "pass --v2", "sd1": "drop --sdxl/--v2"}[org]
        raise UserError(f"--model_org {args.model_org} is {KIND_NAMES[org]}, not {KIND_NAMES[selected]}; {hint}")
    return org


def architecture(args: argparse.Namespace, kind: ModelKind) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    """The UNet and text encoders on the meta device: a folder --model_org's own configs, else
    --model_config_dir or the shipped config of ``kind``."""
    if Path(args.model_org).is_dir():
        config_dir = Path(args.model_org)
    elif args.model_config_dir is not None:
        config_dir = Path(args.model_config_dir)  # a missing config file is a UserError naming the flag
    else:
        config_dir = model_loading.shipped_config_dir(kind)
    unet, _, text_encoders, _ = model_loading.build_empty_models(kind, config_dir, with_vae=False)
    return unet, text_encoders


def extract_targets(unet: torch.nn.Module, text_encoders: Sequence[torch.nn.Module], kind: ModelKind,
                    with_convs: bool) -> tuple[list[ExtractTarget], list[ExtractTarget]]:
    """(text encoder targets, UNet targets) of kohya's LoRA network on these models: its module set and names
    (``networks.network_base``'s targets; 3x3 convs only ``with_convs``)."""
    def located(targets: Sequence[network_base.Target], component: str, model: torch.nn.Module) -> list[ExtractTarget]:
        names = {id(module): name for name, module in model.named_modules()}
        return [ExtractTarget(target.lora_name, component, f"{names[id(target.module)]}.weight",
                              tuple(target.module.weight.shape))
                for target in targets if with_convs or target.kind != "conv"]

    text_targets = []
    for index, (encoder, targets) in enumerate(zip(text_encoders, network_base.text_encoder_targets(text_encoders))):
        component = "text_encoder" if index == 0 else f"text_encoder_{index + 1}"
        text_targets += located(targets, component, encoder)
    unet_names = checkpoint_keys.unet_module_name_map(unet.config) if kind == "sdxl" else None
    classes = network_base.UNET_TARGET_MODULES + (network_base.UNET_CONV_TARGET_MODULES if with_convs else ())
    return text_targets, located(network_base.unet_targets(unet, unet_names, classes), "unet", unet)


def check_shapes(targets: Sequence[ExtractTarget], sources: Sequence[ModelWeights]) -> None:
    """Every target's weight is in both models with the architecture's shape (headers only)."""
    for target in targets:
        for source in sources:
            found = source.shape(target.component, target.weight_name)
            if tuple(found) != target.shape:
                raise UserError(f"{source.flag} {source.path}: {target.component} {target.weight_name} has shape "
                                f"{list(found)}, the architecture {list(target.shape)}: the models have different "
                                f"architectures (or --model_config_dir does not describe them)")


class DeltaReader:
    """``tuned - org`` of one weight at a time, in float64 on ``device`` (exact for fp16/bf16/fp32 weights),
    each weight first rounded to ``load_dtype`` when given (kohya's --load_precision)."""

    def __init__(self, org: ModelWeights, tuned: ModelWeights, load_dtype: Optional[torch.dtype],
                 device: torch.device):
        self.org, self.tuned, self.load_dtype, self.device = org, tuned, load_dtype, device

    def delta(self, target: ExtractTarget) -> torch.Tensor:
        pair = []
        for source in (self.tuned, self.org):
            weight = source.get(target.component, target.weight_name)
            if self.load_dtype is not None:
                weight = weight.to(self.load_dtype)
            pair.append(weight.to(self.device, torch.float64))
        return pair[0] - pair[1]


def text_encoders_differ(reader: DeltaReader, targets: Sequence[ExtractTarget], min_diff: float) -> bool:
    """kohya's rule: some text-encoder weight differs by more than ``min_diff`` (stops at the first)."""
    for target in targets:
        largest = float(reader.delta(target).abs().max())
        if largest > min_diff:
            print(f"text encoder is different: {largest:.3g} > --min_diff {min_diff} ({target.lora_name})", flush=True)
            return True
    return False


def extract(reader: DeltaReader, text_targets: Sequence[ExtractTarget], unet_targets: Sequence[ExtractTarget],
            dim: int, conv_dim: Optional[int], clamp_quantile: float, min_diff: float) -> Extraction:
    """The LoRA of every target (text encoders only if they differ, see ``text_encoders_differ``)."""
    with_text = text_encoders_differ(reader, text_targets, min_diff)
    if not with_text:
        print(f"text encoder is the same (no weight differs by more than --min_diff {min_diff}): "
              f"extracting the UNet only", flush=True)
    targets = [*(text_targets if with_text else []), *unet_targets]
    weights: dict[str, torch.Tensor] = {}
    errors: dict[str, float] = {}
    for index, target in enumerate(targets):
        with torch.no_grad():
            parts, _, error = resize_lora.low_rank_module(
                reader.delta(target), target.rank(dim, conv_dim), None, None, fixed_rank=True,
                clamp_quantile=clamp_quantile, compute_dtype=torch.float32)
        weights[f"{target.lora_name}.lora_up.weight"] = parts["up"].cpu()
        weights[f"{target.lora_name}.lora_down.weight"] = parts["down"].cpu()
        weights[f"{target.lora_name}.alpha"] = parts["alpha"].cpu()
        errors[target.lora_name] = error
        if (index + 1) % max(1, len(targets) // 10) == 0 or index + 1 == len(targets):
            print(f"{index + 1}/{len(targets)} modules", flush=True)
    return Extraction(weights, errors, with_text)


def base_model_version(kind: ModelKind, v_parameterization: bool) -> str:
    """kohya's ss_base_model_version of an extracted LoRA: sd_v1/sd_v2 (+ "_v"), or SDXL's."""
    if kind == "sdxl":
        return "sdxl_base_v1-0"
    return ("sd_v2" if kind == "sd2" else "sd_v1") + ("_v" if v_parameterization else "")


def output_metadata(args: argparse.Namespace, kind: ModelKind, weights: dict[str, torch.Tensor]) -> dict[str, str]:
    """kohya's metadata of an extracted LoRA: the minimal ss_* keys, the model spec (unless --no_metadata),
    and the additional-networks hashes (kohya writes them always)."""
    v_parameterization = args.v2 if args.v_parameterization is None else args.v_parameterization
    network_args = {} if args.conv_dim is None else {"conv_dim": str(args.conv_dim),
                                                     "conv_alpha": str(float(args.conv_dim))}
    metadata = {
        "ss_v2": str(args.v2),
        "ss_base_model_version": base_model_version(kind, bool(v_parameterization)),
        "ss_network_module": NETWORK_MODULE,
        "ss_network_dim": str(args.dim),
        "ss_network_alpha": str(float(args.dim)),
        "ss_network_args": json.dumps(network_args),
    }
    if not args.no_metadata:
        resolution = 1024 if kind == "sdxl" else 768 if kind == "sd2" and v_parameterization else 512
        spec_args = SimpleNamespace(output_name=Path(args.save_to).stem, v_parameterization=bool(v_parameterization))
        metadata.update(modelspec_metadata(spec_args, kind, (resolution, resolution), wall_clock()))
        if kind != "sdxl":
            metadata["modelspec.implementation"] = IMPLEMENTATION_DIFFUSERS
    metadata.update(addnet_hashes(weights, metadata))
    return metadata


def main(argv: Sequence[str] | None = None) -> None:
    args = setup_parser().parse_args(argv)
    validate(args)
    kind = models_kind(args)
    unet, text_encoders = architecture(args, kind)
    text_targets, unet_targets = extract_targets(unet, text_encoders, kind, args.conv_dim is not None)
    device = torch.device(args.device) if args.device else torch.device("cpu")
    with ModelWeights(Path(args.model_org), "--model_org", kind, (unet, text_encoders)) as org, \
            ModelWeights(Path(args.model_tuned), "--model_tuned", kind, (unet, text_encoders)) as tuned:
        check_shapes([*text_targets, *unet_targets], [org, tuned])
        capped = [target.lora_name for target in [*text_targets, *unet_targets]
                  if target.rank(args.dim, args.conv_dim) < target.wanted_rank(args.dim, args.conv_dim)]
        if capped:
            print(f"{len(capped)} module(s) have fewer channels than the rank asked for (first: {capped[0]}): their "
                  f"rank is min(rank, in, out), as kohya's", flush=True)
        extraction = extract(DeltaReader(org, tuned, LOAD_DTYPES[args.load_precision], device), text_targets,
                             unet_targets, args.dim, args.conv_dim, args.clamp_quantile, args.min_diff)
    save_dtype = SAVE_DTYPES[args.save_precision] or torch.float32
    weights = {key: value.to(save_dtype) for key, value in extraction.weights.items()}
    network_base.save_lora_file(weights, args.save_to, output_metadata(args, kind, weights))
    errors = extraction.errors
    worst = max(errors, key=errors.__getitem__)
    mean = math.fsum(errors.values()) / len(errors)
    print(f"saved {args.save_to}: {len(errors)} modules ({KIND_NAMES[kind]}, "
          f"{'text encoders and UNet' if extraction.text_encoder_extracted else 'UNet only'}), relative error of "
          f"the weight changes: mean {mean:.3g}, largest {errors[worst]:.3g} ({worst})")


if __name__ == "__main__":
    exit_on_user_error(main)
