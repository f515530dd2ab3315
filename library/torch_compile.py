"""kohya's ``--torch_compile`` / ``--dynamo_backend``, and ``accelerate launch``'s dynamo settings.

What is compiled is what kohya compiles: kohya passes the trained models to
``accelerator.prepare``, which wraps them in ``torch.compile`` when the Accelerator was built
with ``dynamo_backend = --dynamo_backend`` (only with ``--torch_compile``). Those are the UNet
when its LoRA trains and the text encoders when theirs does; the adapters are compiled with
them, as their modules hook into the models' layers (every network type, fp8 base layers and
gradient checkpointing included). The VAE is not compiled, and sample images run the
uncompiled models (kohya samples with ``accelerator.unwrap_model``): the compiled ones serve the
training losses (validation: below).

The other compile settings come from where kohya's Accelerator reads them: the environment
that ``accelerate launch --dynamo_mode/--dynamo_use_fullgraph/--dynamo_use_dynamic`` sets
(``ACCELERATE_DYNAMO_MODE``, ...; read by accelerate's ``TorchDynamoPlugin``). ``--dynamo_mode``
here overrides the mode. ``accelerate launch --dynamo_backend X`` alone compiles nothing, as in
kohya (its Accelerator is always given the script's backend, ``NO`` without
``--torch_compile``): the kohya_ss GUI always launches with ``--dynamo_backend no
--dynamo_mode default`` and writes ``dynamo_backend = "no"`` into its TOML, which with
``--torch_compile`` means "not compiled" (one line says so).

The models are compiled lazily: the first training step pays the compile time (minutes on a
CPU, where inductor builds C++ kernels with the system compiler; cached across runs in
``TORCHINDUCTOR_CACHE_DIR``). Only the training calls (gradients on) run the compiled graph: one
graph, compiled once. Calls without gradients (validation, the effect monitor's probe, the NaN
report's probe) run the uncompiled module: TorchDynamo guards the grad mode, the adapters' eval mode
and multiplier, so compiled they would be new graphs, each a compile as long as the training's for a
few forward passes (measured on the tiny SDXL: the effect monitor's first probe recompiled the UNet).
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Callable, Optional

import torch

from library.errors import UserError

# kohya's --dynamo_backend choices (including its "tensort" spelling), and what the GUI's
# accelerate dropdown writes into the TOML too ("no", "tensorrt").
KOHYA_BACKENDS = ("eager", "aot_eager", "inductor", "aot_ts_nvfuser", "nvprims_nvfuser", "cudagraphs", "ofi",
                  "fx2trt", "onnxrt", "tensort", "ipex", "tvm")
NOT_COMPILED = "no"
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``--torch_compile``, ``--dynamo_backend`` (kohya's names and default) and ``--dynamo_mode``."""
    group = parser.add_argument_group("torch.compile")
    group.add_argument("--torch_compile", action="store_true",
                       help="compile the trained models (UNet, text encoders whose LoRA trains) with torch.compile, "
                            "as kohya; the first step then takes the compile time. Default: off")
    group.add_argument("--dynamo_backend", type=str, default="inductor",
                       help=f"torch.compile backend with --torch_compile (default inductor; kohya's names: "
                            f"{', '.join(KOHYA_BACKENDS)}; 'no', which the kohya_ss GUI writes, compiles nothing)")
    group.add_argument("--dynamo_mode", type=str, default=None, choices=MODES,
                       help="torch.compile mode with --torch_compile (default: the one `accelerate launch "
                            "--dynamo_mode` set, else default)")


def backend(args: argparse.Namespace) -> Optional[str]:
    """The backend the run compiles with (lower case), or None when nothing is compiled."""
    name = (args.dynamo_backend or NOT_COMPILED).lower()
    return name if args.torch_compile and name != NOT_COMPILED else None


def validate_arguments(args: argparse.Namespace) -> None:
    """With ``--torch_compile``: the backend must exist in this torch (kohya lists backends of older
    releases). Without it, ``--dynamo_backend`` is inert, as in kohya."""
    name = backend(args)
    if name is None:
        return
    available = torch._dynamo.list_backends(exclude_tags=())
    if name not in available:
        raise UserError(f"--dynamo_backend {args.dynamo_backend}: not a torch.compile backend of this PyTorch "
                        f"{torch.__version__} (available: {', '.join(available)}); or leave out --torch_compile")


def compile_options(args: argparse.Namespace) -> Optional[dict]:
    """``torch.compile`` keyword arguments (None: not compiled): the backend, and the mode, fullgraph
    and dynamic settings ``accelerate launch`` put into the environment, as kohya's Accelerator reads them."""
    name = backend(args)
    if name is None:
        return None
    from accelerate.utils import TorchDynamoPlugin

    plugin = TorchDynamoPlugin(backend=NOT_COMPILED, mode=args.dynamo_mode)  # reads accelerate launch's settings
    options = {"backend": name, "mode": plugin.mode, "fullgraph": plugin.fullgraph}
    if plugin.dynamic is not None:
        options["dynamic"] = plugin.dynamic
    return options


def compiled_for_training(args: argparse.Namespace, models, train_unet: bool, train_text_encoder: bool,
                          announce: Callable[[str], None] = print):
    """``models`` with the trained ones wrapped in ``torch.compile`` (a shallow copy; ``models`` itself,
    used for sampling, keeps the plain modules), or ``models`` unchanged without ``--torch_compile``.
    Call after the network is applied and gradient checkpointing is set."""
    if args.torch_compile and backend(args) is None:
        announce(f"--torch_compile with --dynamo_backend {args.dynamo_backend}: nothing is compiled")
    options = compile_options(args)
    if options is None:
        return models
    compiled = []
    replacements = {}
    if train_unet:
        replacements["unet"] = CompiledForTraining(models.unet, options)
        compiled.append("UNet")
    if train_text_encoder:
        replacements["text_encoders"] = [CompiledForTraining(encoder, options) for encoder in models.text_encoders]
        compiled.append("text encoders")
    settings = ", ".join(f"{key} {value}" for key, value in options.items())
    announce(f"--torch_compile: {' and '.join(compiled)} compiled ({settings}) at the first step; "
             f"sample images use the uncompiled models")
    return dataclasses.replace(models, **replacements)


class CompiledForTraining(torch.nn.Module):
    """``module`` whose calls with gradients on (the training steps) run ``torch.compile(module,
    **options)`` and calls without (validation, probes) the module itself (see the module docstring);
    its attributes (``config``, ``dtype``, ...) are the module's, as ``torch.compile``'s wrapper's are."""

    def __init__(self, module: torch.nn.Module, options: dict) -> None:
        super().__init__()
        self.module = module
        # not registered as a submodule: the module would be registered twice (the compiled wrapper holds it)
        object.__setattr__(self, "compiled", torch.compile(module, **options))

    def forward(self, *args, **kwargs):
        return (self.compiled if torch.is_grad_enabled() else self.module)(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")  # none while being copied or unpickled
            if module is None:
                raise
            return getattr(module, name)
