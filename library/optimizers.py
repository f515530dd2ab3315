"""Optimizer and learning-rate scheduler construction, with kohya's flag names and semantics.

Entry scripts call ``add_arguments`` when building the parser, ``validate_args`` right after
parsing (so a typo, a missing package, an argument the optimizer rejects or a learning rate
whose update overflows fails before any model is loaded), then ``build_optimizer`` and
``build_lr_scheduler`` once the trainable parameters are known.

Optimizer packages (requirements.txt installs them) are imported only when their optimizer is
chosen: bitsandbytes (8-bit and paged optimizers), lion-pytorch (Lion), dadaptation (DAdapt*),
prodigyopt (Prodigy), schedulefree (*ScheduleFree), and by dotted path e.g.
prodigyplus.ProdigyPlusScheduleFree or pytorch_optimizer.CAME (the kohya_ss GUI's list).

Schedule-free optimizers keep two sets of weights: the ones gradients are taken at (train mode)
and the averaged ones to use (eval mode). As in kohya, they keep their own schedule (the LR
scheduler is constant) and the trainer switches them: to eval mode for sampling, validation and
saving (``library.ema.weights_for_use``), so samples and files see the averaged weights, and back to
train mode before the next step (``enter_train_mode``).
"""
from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import logging
import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import torch

from library.config_file import boolean_word, key_value_items
from library.errors import UserError, first_line

logger = logging.getLogger(__name__)
# bitsandbytes (installed for the 8-bit optimizers; peft imports it too, in every run) warns at
# import, on CPUs with AVX512-BF16, that the optional `kernels` package for a 4-bit matmul is
# missing. Nothing here uses that matmul, and the line would send users installing things.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

DEFAULT_OPTIMIZER = "AdamW"
DEFAULT_LEARNING_RATE = 2e-6  # kohya's default for --learning_rate (train_network.py keeps it)


@dataclass(frozen=True)
class _KnownOptimizer:
    name: str  # kohya's spelling, shown in messages; matched case-insensitively
    module: str
    class_name: str
    nesterov: bool = False  # SGD with Nesterov momentum (momentum defaults to 0.9)


_KNOWN_OPTIMIZERS = {
    known.name.lower(): known
    for known in (
        _KnownOptimizer("AdamW", "torch.optim", "AdamW"),
        _KnownOptimizer("AdamW8bit", "bitsandbytes.optim", "AdamW8bit"),
        _KnownOptimizer("PagedAdamW", "bitsandbytes.optim", "PagedAdamW"),
        _KnownOptimizer("PagedAdamW8bit", "bitsandbytes.optim", "PagedAdamW8bit"),
        _KnownOptimizer("PagedAdamW32bit", "bitsandbytes.optim", "PagedAdamW32bit"),
        _KnownOptimizer("Lion", "lion_pytorch", "Lion"),
        _KnownOptimizer("Lion8bit", "bitsandbytes.optim", "Lion8bit"),
        _KnownOptimizer("PagedLion8bit", "bitsandbytes.optim", "PagedLion8bit"),
        _KnownOptimizer("SGDNesterov", "torch.optim", "SGD", nesterov=True),
        _KnownOptimizer("SGDNesterov8bit", "bitsandbytes.optim", "SGD8bit", nesterov=True),
        _KnownOptimizer("DAdaptation", "dadaptation.experimental", "DAdaptAdamPreprint"),
        _KnownOptimizer("DAdaptAdamPreprint", "dadaptation.experimental", "DAdaptAdamPreprint"),
        _KnownOptimizer("DAdaptAdaGrad", "dadaptation", "DAdaptAdaGrad"),
        _KnownOptimizer("DAdaptAdam", "dadaptation", "DAdaptAdam"),
        _KnownOptimizer("DAdaptAdan", "dadaptation", "DAdaptAdan"),
        _KnownOptimizer("DAdaptAdanIP", "dadaptation.experimental", "DAdaptAdanIP"),
        _KnownOptimizer("DAdaptLion", "dadaptation", "DAdaptLion"),
        _KnownOptimizer("DAdaptSGD", "dadaptation", "DAdaptSGD"),
        _KnownOptimizer("Prodigy", "prodigyopt", "Prodigy"),
        _KnownOptimizer("Adafactor", "transformers.optimization", "Adafactor"),
        _KnownOptimizer("AdamWScheduleFree", "schedulefree", "AdamWScheduleFree"),
        _KnownOptimizer("RAdamScheduleFree", "schedulefree", "RAdamScheduleFree"),
        _KnownOptimizer("SGDScheduleFree", "schedulefree", "SGDScheduleFree"),
    )
}

# pip names of optimizer packages whose import name differs (for the install hint).
_PIP_NAMES = {
    "lion_pytorch": "lion-pytorch",
    "prodigyplus": "prodigy-plus-schedule-free",
    "pytorch_optimizer": "pytorch-optimizer",
}
# Packages requirements.txt installs for optimizers: a missing one gets a "pip install" hint.
_OPTIMIZER_PACKAGES = {known.module.partition(".")[0] for known in _KNOWN_OPTIMIZERS.values()} | set(_PIP_NAMES)

# Schedules diffusers implements (diffusers.optimization.get_scheduler) ...
_DIFFUSERS_SCHEDULERS = (
    "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup", "piecewise_constant",
)
# ... the ones kohya takes from transformers (its pin, 4.54, has these names), and Adafactor's own (a proxy
# that reports Adafactor's lr; kohya's spelling "adafactor:<initial lr>", plain "adafactor" here too).
_TRANSFORMERS_SCHEDULERS = ("inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay",
                            "reduce_lr_on_plateau")
LR_SCHEDULERS = _DIFFUSERS_SCHEDULERS + _TRANSFORMERS_SCHEDULERS + ("adafactor",)
# Schedules that ignore warmup: a warmup given with them is a mistake (kohya raises too).
_NO_WARMUP = ("constant", "piecewise_constant", "adafactor", "reduce_lr_on_plateau")
# --lr_scheduler_args keys the diffusers schedules accept; the others come from flags.
_DIFFUSERS_SCHEDULER_KWARGS = ("step_rules", "last_epoch")
# Optimizer packages whose step runs on CPU tensors like on the GPU: ``validate_args`` takes a
# test step with them. Others (bitsandbytes, arbitrary dotted paths) may need the GPU.
_TEST_STEP_MODULES = ("torch.optim", "transformers.", "lion_pytorch", "dadaptation", "prodigyopt")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the optimizer and learning-rate scheduler options (kohya names and defaults)."""
    parser.add_argument(
        "--optimizer_type", type=str, default=DEFAULT_OPTIMIZER,
        help=f"optimizer (case-insensitive): {', '.join(known.name for known in _KNOWN_OPTIMIZERS.values())}; "
        "or a class of torch.optim by name (e.g. Adam), or any class by dotted path (e.g. torch.optim.SGD). "
        f"Default: {DEFAULT_OPTIMIZER}.",
    )
    parser.add_argument(
        "--use_8bit_adam", action="store_true",
        help="old spelling of --optimizer_type AdamW8bit (needs bitsandbytes). Default: off.",
    )
    parser.add_argument(
        "--use_lion_optimizer", action="store_true",
        help="old spelling of --optimizer_type Lion (needs lion-pytorch). Default: off.",
    )
    parser.add_argument(
        "--optimizer_args", type=str, default=None, nargs="*",
        help='extra optimizer arguments as key=value, values read as Python literals, else as text '
        '(e.g. "weight_decay=0.01 betas=0.9,0.999"). Default: none.',
    )
    parser.add_argument(
        "--learning_rate", type=_non_negative_float, default=DEFAULT_LEARNING_RATE,
        help="learning rate (>= 0) of the parts without their own --unet_lr/--text_encoder_lr; 0: those parts are "
        f"not trained (kohya). Default: {DEFAULT_LEARNING_RATE:g}.",
    )
    parser.add_argument(
        "--max_grad_norm", type=_non_negative_float, default=1.0,
        help="clip the L2 norm of the gradients to this value; 0 disables clipping. Default: 1.0.",
    )
    parser.add_argument(
        "--lr_scheduler", type=_scheduler_name_text, default="constant", metavar="NAME",
        help=f"learning-rate schedule: {', '.join(LR_SCHEDULERS)} (also adafactor:<initial lr>, kohya's spelling); "
        "reduce_lr_on_plateau lowers the rate when the training loss stops falling (torch's ReduceLROnPlateau, "
        "its arguments from --lr_scheduler_args, e.g. patience=200 factor=0.5; patience counts optimizer steps). "
        "Default: constant.",
    )
    parser.add_argument(
        "--lr_scheduler_type", type=str, default="",
        help="custom scheduler class instead of --lr_scheduler: a name in torch.optim.lr_scheduler "
        "(e.g. StepLR) or a dotted path; arguments from --lr_scheduler_args. Default: none.",
    )
    parser.add_argument(
        "--lr_scheduler_args", type=str, default=None, nargs="*",
        help='extra scheduler arguments as key=value (e.g. "T_max=100", or step_rules=... for '
        "piecewise_constant). Default: none.",
    )
    parser.add_argument(
        "--lr_warmup_steps", type=_steps_or_ratio, default=0,
        help="warmup length in optimizer steps (integer), or as a fraction of the training steps "
        "(a number below 1, or a percentage like 10%%). Default: 0.",
    )
    parser.add_argument(
        "--lr_decay_steps", type=_steps_or_ratio, default=0,
        help="decay length for warmup_stable_decay, in optimizer steps or as a fraction of the "
        "training steps like --lr_warmup_steps. Default: 0.",
    )
    parser.add_argument(
        "--lr_scheduler_num_cycles", type=_positive_int, default=1,
        help="number of cosine decays from the peak to the floor: hard restarts for cosine_with_restarts, "
        "also used by cosine_with_min_lr and warmup_stable_decay. Default: 1.",
    )
    parser.add_argument(
        "--lr_scheduler_power", type=float, default=1.0,
        help="exponent of the polynomial schedule (1 = linear). Default: 1.0.",
    )
    parser.add_argument(
        "--lr_scheduler_timescale", type=_positive_int, default=None,
        help="timescale in optimizer steps for inverse_sqrt. Default: the warmup steps, or 10000 without warmup.",
    )
    parser.add_argument(
        "--lr_scheduler_min_lr_ratio", type=float, default=None,
        help="final learning rate as a fraction of the initial one, for cosine_with_min_lr (required) "
        "and warmup_stable_decay (default 0). Default: none.",
    )


def validate_args(args: argparse.Namespace) -> None:
    """Check the optimizer and scheduler options before any model loads; raise ``UserError``.

    Imports the chosen optimizer's package (so a missing one is reported now) and the custom
    scheduler class. Builds the optimizer on stand-in weights (one per learning rate of
    ``--learning_rate``/``--unet_lr``/``--text_encoder_lr``, in the dtype the LoRA will have)
    and, for optimizers that run on CPU tensors, takes one step with a gradient of ones, so an
    argument the optimizer rejects (``betas=0.9``) or a learning rate whose update overflows
    fails now. When the run's length is known (``--max_train_steps`` without
    ``--max_train_epochs``) the schedule is built on them too. Does not mutate ``args``.
    """
    optimizer = _test_optimizer(args)
    optimizer_class = type(optimizer)
    if is_schedule_free(optimizer_class):
        _note_ignored_schedule(args, optimizer_class)
        return
    optimizer_kwargs = _optimizer_kwargs(args)
    scheduler_kwargs = parse_key_value_args(args.lr_scheduler_args, "--lr_scheduler_args")
    steps = getattr(args, "max_train_steps", None)
    if steps and steps > 0 and getattr(args, "max_train_epochs", None) is None:
        build_lr_scheduler(args, optimizer, steps)
    if args.lr_scheduler_type:
        _resolve_class(args.lr_scheduler_type, torch.optim.lr_scheduler, "--lr_scheduler_type")
        _refuse_warmup(args, f"--lr_scheduler_type {args.lr_scheduler_type}")
        return
    name, _ = scheduler_name(args.lr_scheduler)
    adafactor_own_lr = _is_adafactor(optimizer_class) and bool(
        optimizer_kwargs.get("relative_step", True) or optimizer_kwargs.get("warmup_init", False)
    )
    if name == "adafactor" and not adafactor_own_lr:
        raise UserError(
            "--lr_scheduler adafactor needs --optimizer_type Adafactor with relative_step=True (its default)"
        )
    if name in _NO_WARMUP and not adafactor_own_lr:  # Adafactor's own lr: build_lr_scheduler says it ignores it
        _refuse_warmup(args, f"--lr_scheduler {args.lr_scheduler}")
    if name in _DIFFUSERS_SCHEDULERS:
        _diffusers_scheduler_kwargs(name, scheduler_kwargs)


def scheduler_name(text: str) -> tuple[str, Optional[float]]:
    """``--lr_scheduler`` as (name, Adafactor's initial lr or None): kohya writes ``adafactor:<lr>``.
    UserError naming the valid names for anything else unknown."""
    name, colon, value = text.partition(":")
    if name == "adafactor" and colon:
        try:
            return name, float(value)
        except ValueError:
            raise UserError(f"--lr_scheduler {text}: the initial learning rate after 'adafactor:' is not a number "
                            f"(e.g. adafactor:1e-3)") from None
    if text not in LR_SCHEDULERS:
        raise UserError(f"--lr_scheduler {text!r} is unknown; valid: {', '.join(LR_SCHEDULERS)}, adafactor:<lr>")
    return text, None


class ReduceLROnLossPlateau(torch.optim.lr_scheduler.ReduceLROnPlateau):
    """``--lr_scheduler reduce_lr_on_plateau``: torch's ReduceLROnPlateau on the training loss.

    The trainer steps schedules without arguments; this one compares the loss handed to
    :meth:`observe_loss` (the optimizer step's loss; a non-finite one is skipped). kohya passes
    this schedule warmup arguments it does not take and fails while building it.
    """

    latest_loss: Optional[float] = None

    def observe_loss(self, loss: float) -> None:
        self.latest_loss = loss

    def step(self, metrics: Optional[float] = None, epoch: Optional[int] = None) -> None:  # noqa: D102
        metrics = self.latest_loss if metrics is None else metrics
        if metrics is not None and math.isfinite(metrics):
            super().step(metrics)


def step_schedule(scheduler: Any, loss: float) -> None:
    """Advance ``scheduler`` after an optimizer step whose loss was ``loss``."""
    if isinstance(scheduler, ReduceLROnLossPlateau):
        scheduler.observe_loss(loss)
    scheduler.step()


def effective_optimizer_type(args: argparse.Namespace) -> str:
    """``--optimizer_type`` after kohya's old flags ``--use_8bit_adam``/``--use_lion_optimizer``."""
    optimizer_type = args.optimizer_type or DEFAULT_OPTIMIZER
    old_flags = [
        (flag, name)
        for flag, name in (("--use_8bit_adam", "AdamW8bit"), ("--use_lion_optimizer", "Lion"))
        if getattr(args, flag[2:], False)
    ]
    if len(old_flags) > 1:
        raise UserError("--use_8bit_adam and --use_lion_optimizer exclude each other; use --optimizer_type instead")
    if old_flags:
        flag, name = old_flags[0]
        if optimizer_type.lower() not in (DEFAULT_OPTIMIZER.lower(), name.lower()):
            raise UserError(f"{flag} conflicts with --optimizer_type {optimizer_type}; give only --optimizer_type")
        return name
    return optimizer_type


def resolve_optimizer_class(optimizer_type: str) -> type:
    """The optimizer class ``--optimizer_type`` names; raises ``UserError`` naming what is wrong.

    Known kohya names are case-insensitive; other names are looked up in ``torch.optim``
    (case-sensitive, like kohya) or imported as a dotted ``module.Class`` path.
    """
    known = _KNOWN_OPTIMIZERS.get(optimizer_type.lower())
    if known is None:
        return _resolve_class(optimizer_type, torch.optim, "--optimizer_type")
    module = _import_module(known.module, f"--optimizer_type {known.name}")
    optimizer_class = getattr(module, known.class_name, None)
    if optimizer_class is None:
        package = _pip_name(known.module)
        raise UserError(
            f"--optimizer_type {known.name}: the installed {package} has no {known.class_name}; pip install -U {package}"
        )
    return optimizer_class


def is_schedule_free(optimizer_class: type) -> bool:
    """Whether the optimizer has train and eval modes (schedulefree's *ScheduleFree,
    prodigyplus.ProdigyPlusScheduleFree): the trainer switches its modes and it keeps its own
    schedule. kohya decides by the name ending in ScheduleFree; the modes are what matter."""
    return callable(getattr(optimizer_class, "train", None)) and callable(getattr(optimizer_class, "eval", None))


def enter_train_mode(optimizer: torch.optim.Optimizer) -> None:
    """Put a schedule-free optimizer's parameters at its training point (needed before each
    step, also after loading a state saved in eval mode); no-op for other optimizers and when
    already there."""
    if is_schedule_free(type(optimizer)):
        optimizer.train()


def enter_eval_mode(optimizer: torch.optim.Optimizer) -> None:
    """Put a schedule-free optimizer's parameters at the averaged weights meant for use (what
    samples, validation and saved files must see); no-op for other optimizers. Every process
    must switch at the same points (kohya's optimizer_eval_fn/optimizer_train_fn): the switch
    moves the weights, and the processes' weights must stay identical."""
    if is_schedule_free(type(optimizer)):
        optimizer.eval()


def parse_key_value_args(items: Sequence[str] | None, flag: str) -> dict[str, Any]:
    """Parse kohya-style ``key=value`` items (``--optimizer_args``, ``--lr_scheduler_args``).

    A value is a Python literal when ``ast.literal_eval`` reads it (``0.01``, ``True``,
    ``None``, ``0.9,0.999`` -> tuple), ``true``/``false`` in any case are booleans, anything
    else is kept as text. An item may hold several pairs separated by spaces (as kohya_ss GUI
    passes them). Raises ``UserError`` naming ``flag`` for an item that is not ``key=value``.
    """
    parsed: dict[str, Any] = {}
    for pair in key_value_items(items):
        key, separator, text = pair.partition("=")
        key = key.strip()
        if not separator or not key.isidentifier():
            raise UserError(f"{flag}: {pair!r} is not key=value (e.g. weight_decay=0.01 betas=0.9,0.999)")
        parsed[key] = _parse_value(text.strip())
    return parsed


def build_optimizer(
    args: argparse.Namespace, param_groups: Iterable[Any]
) -> tuple[str, str, torch.optim.Optimizer]:
    """Build the optimizer kohya's ``get_optimizer`` would build for these options.

    ``param_groups`` is what torch optimizers take (not empty): tensors or dicts with ``params``
    and an optional per-group ``lr`` (groups without one get ``--learning_rate``). The dicts are
    not mutated. Returns ``(class path, arguments text, optimizer)`` as kohya does, e.g.
    ``("torch.optim.adamw.AdamW", "weight_decay=0.01", ...)``; ``metadata_value`` joins the two
    for ``ss_optimizer``. Kohya's adjustments: SGDNesterov* get ``nesterov=True`` and
    ``momentum=0.9`` unless given; Adafactor defaults to ``relative_step=True`` (also forced by
    ``warmup_init=True``), in which case it computes its own learning rate, so no ``lr`` is
    passed and per-group ``lr`` values are dropped (``build_lr_scheduler`` then uses Adafactor's
    schedule). Raises ``UserError`` for unknown names, missing packages, bad arguments.
    """
    param_groups = list(param_groups)
    optimizer_class, kwargs, optimizer = _instantiate(args, param_groups)
    if _is_adafactor(optimizer_class) and kwargs["relative_step"] and any(
            isinstance(group, dict) and group.get("lr") is not None for group in param_groups):
        logger.warning("Adafactor with relative_step=True computes its own learning rate; per-group lrs are ignored")
    if optimizer_class.__module__.startswith(("dadaptation", "prodigyopt")):
        _warn_about_adaptive_lr(args.learning_rate, param_groups)
    name = f"{optimizer_class.__module__}.{optimizer_class.__name__}"
    arguments = ",".join(f"{key}={value}" for key, value in kwargs.items())
    return name, arguments, optimizer


def _instantiate(args: argparse.Namespace, param_groups: list[Any]
                 ) -> tuple[type, dict[str, Any], torch.optim.Optimizer]:
    """``(class, keyword arguments after kohya's adjustments, optimizer)`` for ``param_groups``
    (not mutated); silent, unlike :func:`build_optimizer`."""
    optimizer_type = effective_optimizer_type(args)
    optimizer_class = resolve_optimizer_class(optimizer_type)
    known = _KNOWN_OPTIMIZERS.get(optimizer_type.lower())
    kwargs = _optimizer_kwargs(args)
    _check_argument_kinds(optimizer_class, kwargs)
    lr: float | None = _check_learning_rate(args.learning_rate)
    groups = [dict(group) if isinstance(group, dict) else group for group in param_groups]
    if not groups:
        raise ValueError("build_optimizer needs at least one parameter or parameter group")
    fixed_kwargs: dict[str, Any] = {}

    if known is not None and known.nesterov:
        kwargs.setdefault("momentum", 0.9)
        fixed_kwargs["nesterov"] = True
    if _is_adafactor(optimizer_class):
        kwargs.setdefault("relative_step", True)
        if kwargs.get("warmup_init", False) and not kwargs["relative_step"]:
            logger.info("Adafactor: warmup_init=True needs relative_step=True; setting it")
            kwargs["relative_step"] = True
        if kwargs["relative_step"]:
            lr = None
            for group in groups:
                if isinstance(group, dict):
                    group.pop("lr", None)

    try:
        optimizer = optimizer_class(groups, lr=lr, **fixed_kwargs, **kwargs)
    except (TypeError, ValueError) as error:
        given = " ".join(args.optimizer_args or ()) or "(none)"
        raise UserError(
            f"--optimizer_args {given}: {optimizer_class.__name__} rejected them: {' '.join(str(error).split())}"
        ) from None
    _refuse_vanishing_eps(optimizer)
    if callable(getattr(optimizer, "train", None)):
        optimizer.train()  # schedule-free optimizers start in training mode (kohya does the same)
    return optimizer_class, kwargs, optimizer


def _check_argument_kinds(optimizer_class: type, kwargs: dict[str, Any]) -> None:
    """Check each argument against the kind of the optimizer's default for it, and read booleans.

    Refused, naming the argument and what it takes: one value where a tuple is taken (``betas=0.9``:
    the optimizer's own error is ``'float' object is not subscriptable``), text where a number is taken
    (schedule-free's ``warmup_steps=abc`` fails only at the first step, after the model load), and
    anything but a boolean where one is taken (Prodigy's ``safeguard_warmup=maybe`` would reach it as a
    true string). Booleans are read as ``--network_args`` reads them (true/false, 1/0, yes/no; any
    case) and replaced in ``kwargs``. Arguments whose default is None or absent are the optimizer's to judge.
    """
    try:
        parameters = inspect.signature(optimizer_class).parameters
    except (TypeError, ValueError):  # a class without an inspectable signature: the optimizer decides
        return
    name = optimizer_class.__name__
    for key, value in kwargs.items():
        default = parameters[key].default if key in parameters else None
        shown = ",".join(str(item) for item in value) if isinstance(value, (tuple, list)) else value
        if isinstance(default, tuple) and not (isinstance(value, (tuple, list)) and len(value) == len(default)):
            raise UserError(f"--optimizer_args {key}={shown}: {name} takes {len(default)} comma-separated values "
                            f"for {key}, e.g. {key}={','.join(str(item) for item in default)}")
        if isinstance(default, bool):
            kwargs[key] = boolean_word(str(value))
            if kwargs[key] is None:
                raise UserError(f"--optimizer_args {key}={shown}: {name} takes true or false for {key} "
                                f"(True/False, 1/0, yes/no; default {default})")
        elif isinstance(default, (int, float)) and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise UserError(f"--optimizer_args {key}={shown}: {name} takes a number for {key} (default {default})")


def part_learning_rates(args: argparse.Namespace) -> tuple[float, list[float]]:
    """(UNet, [text encoder ...]) learning rates: ``--unet_lr``/``--text_encoder_lr`` (one value for
    every encoder, or one per encoder), else ``--learning_rate``. A part at 0 is not trained (kohya)."""
    unet_lr = args.unet_lr if getattr(args, "unet_lr", None) is not None else args.learning_rate
    return unet_lr, list(getattr(args, "text_encoder_lr", None) or [args.learning_rate])


def _learning_rates(args: argparse.Namespace) -> dict[str, float]:
    """The distinct positive learning rates of the run's parameter groups, each by the flag giving it."""
    rates = {"--learning_rate": args.learning_rate}
    unet_lr = getattr(args, "unet_lr", None)
    if unet_lr:
        rates["--unet_lr"] = unet_lr
    for index, lr in enumerate(getattr(args, "text_encoder_lr", None) or []):
        if lr:
            rates[f"--text_encoder_lr (value {index + 1})"] = lr
    distinct: dict[float, str] = {}
    for flag, lr in rates.items():
        distinct.setdefault(lr, flag)
    return {flag: lr for lr, flag in distinct.items()}


def _test_optimizer(args: argparse.Namespace) -> torch.optim.Optimizer:
    """The run's optimizer on one stand-in weight per learning rate, after one test step with a
    gradient of ones where that step can run on the CPU (see ``validate_args``)."""
    dtype = (torch.float16 if getattr(args, "full_fp16", False)
             else torch.bfloat16 if getattr(args, "full_bf16", False) else torch.float32)
    _check_learning_rate(args.learning_rate)
    rates = _learning_rates(args)
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1, dtype=dtype))], "lr": lr} for lr in rates.values()]
    optimizer_class, _, optimizer = _instantiate(args, groups)
    if not optimizer_class.__module__.startswith(_TEST_STEP_MODULES):
        return optimizer
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            parameter.grad = torch.ones_like(parameter)
    flag, largest = max(rates.items(), key=lambda item: item[1])
    dtype_name = str(dtype).removeprefix("torch.")
    try:
        optimizer.step()
    except (RuntimeError, TypeError, ValueError, ArithmeticError) as error:
        if "overflow" in str(error):
            raise UserError(f"{flag} {largest:g}: {optimizer_class.__name__}'s update overflows {dtype_name} "
                            f"({first_line(error)}); use a learning rate like 1e-4") from None
        given = " ".join(args.optimizer_args or ()) or "(none)"
        raise UserError(f"--optimizer_args {given}: a test step of {optimizer_class.__name__} failed: "
                        f"{' '.join(str(error).split())}") from None
    optimizer.zero_grad(set_to_none=True)
    for (flag, lr), group in zip(rates.items(), optimizer.param_groups):
        if not all(torch.isfinite(parameter).all() for parameter in group["params"]):
            raise UserError(f"{flag} {lr:g}: one {optimizer_class.__name__} step with it moves a weight to "
                            f"Inf/NaN in {dtype_name}; use a learning rate like 1e-4")
    return optimizer


def _refuse_vanishing_eps(optimizer: torch.optim.Optimizer) -> None:
    """UserError when an Adam-style ``eps`` is 0 in the dtype the optimizer computes in.

    With ``--full_fp16`` torch's AdamW (and Prodigy, DAdapt*) compute in fp16, where 1e-8
    rounds to 0: a parameter whose gradient is still 0 (every lora_down at the first step)
    then gets 0/0 = NaN. bitsandbytes and Adafactor (tuple eps) compute in float32 internally.
    """
    if type(optimizer).__module__.startswith("bitsandbytes"):
        return
    for group in optimizer.param_groups:
        eps = group.get("eps")
        if not isinstance(eps, float) or eps <= 0:
            continue
        for dtype in {parameter.dtype for parameter in group["params"]}:
            if torch.tensor(eps, dtype=dtype).item() == 0:
                raise UserError(
                    f"--optimizer_type {type(optimizer).__name__} computes in {str(dtype).removeprefix('torch.')} "
                    f"(--full_fp16), where its eps {eps:g} is 0 and a zero gradient gives NaN: add --optimizer_args "
                    f"eps=1e-4 (or larger), use an 8-bit bitsandbytes optimizer, or drop --full_fp16")


def metadata_value(optimizer_name: str, optimizer_arguments: str) -> str:
    """kohya's ``ss_optimizer`` text: ``name(arguments)``, or just ``name`` without arguments."""
    return f"{optimizer_name}({optimizer_arguments})" if optimizer_arguments else optimizer_name


def resolve_step_count(value: int | float, num_training_steps: int, flag: str = "--lr_warmup_steps") -> int:
    """Steps meant by a ``--lr_warmup_steps``-style value: a float is a fraction of ``num_training_steps``
    (truncated, like kohya), an int a step count. Raises ``UserError`` for negative values."""
    if isinstance(value, bool) or value < 0:
        raise UserError(f"{flag} {value}: give a step count >= 0 or a fraction below 1")
    if isinstance(value, float):
        return int(value * num_training_steps)
    return int(value)


def build_lr_scheduler(
    args: argparse.Namespace,
    optimizer: torch.optim.Optimizer,
    num_training_steps: int,
    num_processes: int = 1,
) -> torch.optim.lr_scheduler.LRScheduler:
    """Build the learning-rate scheduler for ``num_training_steps`` optimizer steps.

    ``num_processes``: accelerate's prepared scheduler steps once per process for each
    optimizer step, so (like kohya) the schedule is built for ``num_training_steps *
    num_processes`` scheduler steps; integer warmup/decay steps are multiplied too (kohya does
    not, which shortens warmup on several GPUs), so the flags always count optimizer steps.
    Fractions are resolved against the multiplied total, as in kohya.

    With an Adafactor that computes its own learning rate (``relative_step=True``) the result
    is Adafactor's proxy schedule whatever ``--lr_scheduler`` says (as kohya). A schedule-free
    optimizer gets a schedule that never changes the learning rate, whatever the scheduler
    options say (kohya's dummy scheduler; ``validate_args`` says they are ignored). Raises
    ``UserError`` for unknown names, bad ``--lr_scheduler_args``, and warmup lengths that do
    not fit the schedule.
    """
    if num_training_steps < 1 or num_processes < 1:
        raise ValueError(f"num_training_steps ({num_training_steps}) and num_processes ({num_processes}) must be >= 1")
    if is_schedule_free(type(optimizer)):
        # factor 1 and no iterations: ConstantLR then only reports the optimizer's own lr
        return torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)
    total_steps = num_training_steps * num_processes
    warmup_steps = _scaled_steps(args.lr_warmup_steps, total_steps, num_processes, "--lr_warmup_steps")
    decay_steps = _scaled_steps(getattr(args, "lr_decay_steps", 0), total_steps, num_processes, "--lr_decay_steps")
    kwargs = parse_key_value_args(args.lr_scheduler_args, "--lr_scheduler_args")
    name, adafactor_initial_lr = scheduler_name(args.lr_scheduler)

    if args.lr_scheduler_type:
        _refuse_warmup(args, f"--lr_scheduler_type {args.lr_scheduler_type}")
        scheduler_class = _resolve_class(args.lr_scheduler_type, torch.optim.lr_scheduler, "--lr_scheduler_type")
        return _construct(scheduler_class, "--lr_scheduler_args", optimizer, **kwargs)

    adafactor_own_lr = _is_adafactor(type(optimizer)) and optimizer.defaults.get("relative_step", False)
    if name == "adafactor" or adafactor_own_lr:
        if not adafactor_own_lr:
            raise UserError(
                "--lr_scheduler adafactor needs --optimizer_type Adafactor with relative_step=True (its default)"
            )
        if name != "adafactor":
            logger.warning(f"Adafactor with relative_step=True sets its own learning rate; ignoring --lr_scheduler {name}")
        if args.lr_warmup_steps:  # kohya ignores it silently (the GUI's Finetuning preset "adafactor" sets 10%)
            logger.warning(f"Adafactor with relative_step=True sets its own learning rate (warmup_init=True is its "
                           f"warm-up); ignoring --lr_warmup_steps {args.lr_warmup_steps}")
        from transformers.optimization import AdafactorSchedule

        return AdafactorSchedule(optimizer, initial_lr=adafactor_initial_lr or args.learning_rate)

    if name in _NO_WARMUP:
        _refuse_warmup(args, f"--lr_scheduler {name}")
    if warmup_steps > total_steps:
        raise UserError(
            f"--lr_warmup_steps {args.lr_warmup_steps} gives {warmup_steps} steps, more than the {total_steps} "
            "training steps; lower it"
        )
    cycles = args.lr_scheduler_num_cycles
    min_lr_ratio = getattr(args, "lr_scheduler_min_lr_ratio", None)

    if name in _DIFFUSERS_SCHEDULERS:
        from diffusers.optimization import get_scheduler

        return get_scheduler(
            name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps,
            num_cycles=cycles, power=args.lr_scheduler_power, **_diffusers_scheduler_kwargs(name, kwargs),
        )

    import transformers.optimization as schedules

    if name == "inverse_sqrt":
        timescale = getattr(args, "lr_scheduler_timescale", None)
        timescale = None if timescale is None else timescale * num_processes
        return _construct(schedules.get_inverse_sqrt_schedule, "--lr_scheduler_args", optimizer,
                          num_warmup_steps=warmup_steps, timescale=timescale, **kwargs)
    if name == "reduce_lr_on_plateau":
        return _construct(ReduceLROnLossPlateau, "--lr_scheduler_args", optimizer, **kwargs)
    if name in ("cosine_with_min_lr", "cosine_warmup_with_min_lr"):
        # the second also starts its warmup from warmup_lr_rate (--lr_scheduler_args) instead of 0 and may take
        # min_lr instead of the ratio; kohya passes it decay steps it does not take and fails while building it
        if min_lr_ratio is None and "min_lr" not in kwargs:
            raise UserError(f"--lr_scheduler {name} needs --lr_scheduler_min_lr_ratio (e.g. 0.1)")
        factory = (schedules.get_cosine_with_min_lr_schedule_with_warmup if name == "cosine_with_min_lr"
                   else schedules.get_cosine_with_min_lr_schedule_with_warmup_lr_rate)
        if min_lr_ratio is not None:
            kwargs["min_lr_rate"] = min_lr_ratio
        return _construct(factory, "--lr_scheduler_args", optimizer, num_warmup_steps=warmup_steps,
                          num_training_steps=total_steps, num_cycles=cycles / 2, **kwargs)
    # warmup_stable_decay
    if decay_steps < 1 or warmup_steps + decay_steps > total_steps:
        raise UserError(
            f"--lr_scheduler warmup_stable_decay needs --lr_decay_steps >= 1 with warmup + decay <= {total_steps} "
            f"training steps (got warmup {warmup_steps}, decay {decay_steps})"
        )
    return _construct(schedules.get_wsd_schedule, "--lr_scheduler_args", optimizer,
                      num_warmup_steps=warmup_steps, num_decay_steps=decay_steps,
                      num_stable_steps=total_steps - warmup_steps - decay_steps,
                      num_cycles=cycles / 2, min_lr_ratio=min_lr_ratio or 0.0, **kwargs)


# ---------------------------------------------------------------------------------------------
# helpers


def _optimizer_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs = parse_key_value_args(args.optimizer_args, "--optimizer_args")
    for reserved, instead in (("lr", "--learning_rate"), ("params", "the trainer")):
        if reserved in kwargs:
            raise UserError(f"--optimizer_args: {reserved}= is set by {instead}; remove it from --optimizer_args")
    return kwargs


def _parse_value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        try:
            return float(text)  # inf, -inf, nan (e.g. Prodigy's growth_rate=inf, its default)
        except ValueError:
            return text


def _resolve_class(path: str, default_module: Any, flag: str) -> type:
    """A class by dotted path, or by bare name in ``default_module`` (kohya's rule)."""
    module_name, _, class_name = path.rpartition(".")
    if module_name:
        module = _import_module(module_name, f"{flag} {path}")
    else:
        module = default_module
    found = getattr(module, class_name, None)
    if not isinstance(found, type):
        if flag == "--optimizer_type" and not module_name:
            valid = ", ".join(known.name for known in _KNOWN_OPTIMIZERS.values())
            raise UserError(f"--optimizer_type {path!r} is unknown; valid: {valid}, or a dotted path like torch.optim.SGD")
        raise UserError(f"{flag} {path}: {getattr(module, '__name__', module_name)} has no class {class_name}")
    return found


def _import_module(module_name: str, what: str) -> Any:
    """Import ``module_name`` for ``what`` (e.g. "--optimizer_type Lion"); UserError in one line
    when it cannot be, with the pip command for the optimizer packages of requirements.txt."""
    top_level = module_name.partition(".")[0]
    try:
        return importlib.import_module(module_name)
    except ImportError as error:
        missing = getattr(error, "name", None) or ""
        if missing.partition(".")[0] == top_level and top_level in _OPTIMIZER_PACKAGES:  # not a dependency of it
            package = _pip_name(module_name)
            raise UserError(f"{what} needs the {package} package: pip install {package}") from None
        raise UserError(f"{what}: cannot import {module_name} ({first_line(error)}); install it or fix the path") from None


def _pip_name(module_name: str) -> str:
    top_level = module_name.partition(".")[0]
    return _PIP_NAMES.get(top_level, top_level)


def _construct(factory: Any, flag: str, *args: Any, **kwargs: Any) -> Any:
    try:
        return factory(*args, **kwargs)
    except (TypeError, ValueError) as error:
        raise UserError(f"{flag}: {getattr(factory, '__name__', factory)} rejected them: {' '.join(str(error).split())}") from None


def _diffusers_scheduler_kwargs(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    extra = {key: value for key, value in kwargs.items() if key in _DIFFUSERS_SCHEDULER_KWARGS}
    rejected = sorted(set(kwargs) - set(extra))
    if rejected:
        raise UserError(
            f"--lr_scheduler_args: {', '.join(rejected)} not accepted by --lr_scheduler {name}; accepted: "
            f"{', '.join(_DIFFUSERS_SCHEDULER_KWARGS)} (cycles and power have their own --lr_scheduler_* flags)"
        )
    if name == "piecewise_constant" and not isinstance(extra.get("step_rules"), str):
        raise UserError('--lr_scheduler piecewise_constant needs --lr_scheduler_args step_rules="1:10,0.1:20,0.01"')
    return extra


def _scaled_steps(value: int | float, total_steps: int, num_processes: int, flag: str) -> int:
    if isinstance(value, float):
        return resolve_step_count(value, total_steps, flag)
    return resolve_step_count(value, total_steps, flag) * num_processes


def _note_ignored_schedule(args: argparse.Namespace, optimizer_class: type) -> None:
    """One warning line naming the scheduler options a schedule-free optimizer ignores (kohya
    ignores them silently; the kohya_ss GUI always writes --lr_scheduler)."""
    given = [f"--{flag} {value}" for flag, value in (
        ("lr_scheduler", args.lr_scheduler if args.lr_scheduler != "constant" else None),
        ("lr_scheduler_type", args.lr_scheduler_type),
        ("lr_warmup_steps", args.lr_warmup_steps),
        ("lr_scheduler_args", " ".join(args.lr_scheduler_args or ())),
    ) if value]
    if not given:
        return
    try:
        takes_warmup = "warmup_steps" in inspect.signature(optimizer_class).parameters
    except (TypeError, ValueError):
        takes_warmup = False
    hint = "; for a warmup give --optimizer_args warmup_steps=N" if takes_warmup else ""
    logger.warning(f"--optimizer_type {optimizer_class.__name__} keeps its own schedule: {', '.join(given)} "
                   f"ignored, as in kohya{hint}")


def _refuse_warmup(args: argparse.Namespace, what: str) -> None:
    if args.lr_warmup_steps:
        raise UserError(
            f"--lr_warmup_steps {args.lr_warmup_steps} has no effect with {what}; set it to 0 "
            "or use a schedule with warmup (e.g. constant_with_warmup)"
        )


def _check_learning_rate(learning_rate: Any) -> float:
    if isinstance(learning_rate, bool) or not isinstance(learning_rate, (int, float)) or not (
        math.isfinite(learning_rate) and learning_rate >= 0
    ):
        raise UserError(f"--learning_rate {learning_rate}: give a number >= 0 (e.g. 1e-4; 0 with --unet_lr/"
                        f"--text_encoder_lr trains only the parts given there)")
    return float(learning_rate)


def _is_adafactor(optimizer_class: type) -> bool:
    return optimizer_class.__name__ == "Adafactor" and optimizer_class.__module__.startswith("transformers")


def _warn_about_adaptive_lr(learning_rate: float, groups: list[Any]) -> None:
    group_lrs = {group.get("lr", learning_rate) for group in groups if isinstance(group, dict)}
    first_lr = next((group.get("lr", learning_rate) for group in groups if isinstance(group, dict)), learning_rate)
    if first_lr <= 0.1:
        logger.warning(f"D-Adaptation/Prodigy expect a learning rate around 1.0, got {first_lr}")
    if len(group_lrs) > 1:
        logger.warning(f"D-Adaptation/Prodigy use only the first learning rate ({first_lr}) of several: {sorted(group_lrs)}")


# argparse types: they raise ArgumentTypeError, which argparse and --config_file report with the flag


def _scheduler_name_text(text: str) -> str:
    """``--lr_scheduler`` checked by :func:`scheduler_name` (so a config file's value is checked as a flag's)."""
    try:
        scheduler_name(text)
    except UserError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("--lr_scheduler ")) from None
    return text


def _non_negative_float(text: str) -> float:
    value = _number(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def _steps_or_ratio(text: str) -> int | float:
    """kohya's int_or_float: ``100`` steps, ``0.1`` or ``10%`` a fraction of the training steps."""
    text = text.strip()
    if text.endswith("%"):
        percent = _number(text[:-1])
        if not 0 <= percent <= 100:
            raise argparse.ArgumentTypeError(f"a percentage must be between 0% and 100%, got {text!r}")
        return percent / 100
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    if value.is_integer():
        return int(value)
    if value < 1:
        return value
    raise argparse.ArgumentTypeError(f"give a whole number of steps or a fraction below 1, got {text!r}")


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
    return value
