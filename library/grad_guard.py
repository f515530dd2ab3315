"""Gradient guard: drop optimizer steps whose gradient norm is abnormal.

The contract is ``docs/grad_guard_spec.md`` (flag names, defaults, the exact
per-step algorithm). This module has three parts, each usable on its own:

* Options: :func:`add_arguments` (the one definition of every guard flag,
  shared by both trainers and ``tools/replay_grad_guard.py``),
  :func:`apply_preset` and :func:`explicit_dests`.
* The decision core, pure Python + numpy: :class:`GuardConfig`,
  :class:`GradGuard` (stateful, ``state_dict``/``load_state_dict``) and
  :class:`GuardDecision`. It knows nothing about models or training loops.
* The measurement, torch: :class:`GradientMonitor` (L2 norm and cosine similarity of
  the trainable gradients over one flat buffer, one host sync per step) and
  :func:`agree_across_processes`.

Per optimizer step (``accelerator.sync_gradients``), after the last backward and
before unscale/clip/``optimizer.step()``, the trainer does::

    measurement = monitor.measure(scale=scale_tensor_or_float_or_None)
    decision = guard.decide(global_step + 1, measurement.norm)   # 1-based step
    if decision.skip:
        optimizer.zero_grad(set_to_none=True)   # no optimizer/scheduler/scaler step
    else:
        ...unscale, clip, optimizer.step(), scaler.update(), lr_scheduler.step()

and saves ``guard.state_dict()`` and ``monitor.state_dict()`` with its train state.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
import math
import sys
from collections import deque
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

from library.errors import UserError
from library.flat_gradients import FlatGradients, views_into

logger = logging.getLogger(__name__)

WINDOW_SIZE = 200
"""Number of recent norms the threshold is computed from."""
WARMUP_THRESHOLD = 200000.0
"""Threshold while the window holds fewer than ``WINDOW_SIZE`` norms."""
STD_MULTIPLIER = 2.5
"""threshold = mean(window) + STD_MULTIPLIER * std(window)."""

PRESETS: dict[str, dict[str, Any]] = {
    "stable": {
        "skip_grad_norm": True,
        "grad_norm_log": True,
        "grad_cosine_log": True,
        # Relative limits, not the fork's absolute ones (200000 before the window is full, a cap in
        # norm units): a gradient's scale depends on the network type (a full-weight delta's is ~150x a
        # LoRA's) and on the loss scale, so an absolute number that suits a LoRA skips every step of
        # LyCORIS Full (docs/grad_guard_spec.md, "The stable preset's relative limits").
        "skip_grad_norm_warmup_factor": 20.0,
        "skip_grad_norm_max_factor": 20.0,
        "nan_to_window": True,
        "inf_to_window": True,
        "skip_nan_immediate": False,
        "skip_inf_immediate": False,
    },
    "minimal": {"skip_grad_norm": True, "grad_norm_log": True},
}
"""What each ``--grad_guard_preset`` sets (argparse dest -> value)."""


# --------------------------------------------------------------------------- options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register every gradient-guard flag on ``parser`` (one argument group)."""
    group = parser.add_argument_group(
        "gradient guard",
        "Watch the L2 norm of the trainable gradients at every optimizer step and drop abnormal updates.",
    )
    add = group.add_argument
    add("--skip_grad_norm", action="store_true",
        help="skip the optimizer step when the gradient L2 norm is above mean + 2.5 * std of the last 200 norms "
             "(200000 until 200 norms are collected). Skipped steps still advance the global step. Default: off")
    add("--skip_grad_norm_max", type=float, default=None, metavar="NORM",
        help="upper cap on that threshold, in gradient-norm units (ignored until the window holds 200 norms). "
             "Default: no cap")
    add("--skip_grad_norm_warmup_factor", type=float, default=None, metavar="FACTOR",
        help="while the window holds fewer than 200 norms, the threshold is FACTOR x the median of the finite, "
             "non-zero norms in it (the current one included) instead of 200000, so that it follows the run's own "
             "gradient scale (network type, loss scale). 20 in --grad_guard_preset stable. "
             "Default: 200000")
    add("--skip_grad_norm_max_factor", type=float, default=None, metavar="FACTOR",
        help="cap the threshold at FACTOR x the median of the finite, non-zero norms in the window (ignored until "
             "it holds 200 norms): a cap in units of the run's own gradient scale; with "
             "--skip_grad_norm_max too, the lower cap applies. 20 in --grad_guard_preset stable. Default: no cap")
    add("--grad_norm_log", action="store_true",
        help="write gradient_logs+<output_name>.txt (CSV, one row per optimizer step). Works without "
             "--skip_grad_norm. Default: off")
    add("--grad_norm_log_dir", type=str, default=None, metavar="DIR",
        help="folder for the gradient log. Default: --output_dir")
    add("--grad_cosine_log", action="store_true",
        help="add a CosineSim column (cosine similarity to the previous step's gradient); keeps an fp32 copy of "
             "the previous gradients (one flat buffer). Needs --grad_norm_log. Default: off")
    add("--nan_to_window", action="store_true",
        help="put NaN norms into the window (the threshold is then NaN, so no threshold skips, until they leave "
             "it 200 steps later). Default: off")
    add("--inf_to_window", action="store_true",
        help="put Inf norms into the window (same effect as --nan_to_window). Default: off")
    add("--skip_nan_immediate", action=argparse.BooleanOptionalAction, default=True,
        help="skip a step whose norm is NaN (the GradScaler then never sees the overflow). Default: on")
    add("--skip_inf_immediate", action=argparse.BooleanOptionalAction, default=True,
        help="skip a step whose norm is Inf. Default: on")
    add("--nan_inf_until_step", type=int, default=None, metavar="N",
        help="use the four NaN/Inf options above for optimizer steps 1..N only; from step N+1 on: NaN/Inf are "
             "kept out of the window and skipped immediately. Default: the whole run")
    add("--auto_cap_release", action="store_true",
        help="with --skip_grad_norm_max (or --skip_grad_norm_max_factor): when the uncapped threshold stays >= "
             "--cap_release_trigger_ratio * max "
             "for --cap_release_trigger_steps steps, raise the cap to max * --cap_release_scale for "
             "--cap_release_length steps. Default: off")
    add("--cap_release_trigger_ratio", type=float, default=0.66, metavar="RATIO",
        help="fraction of --skip_grad_norm_max the uncapped threshold must reach. Default: 0.66")
    add("--cap_release_trigger_steps", type=int, default=200, metavar="STEPS",
        help="consecutive optimizer steps at or above the ratio that start a release. Default: 200")
    add("--cap_release_length", type=int, default=200, metavar="STEPS",
        help="length of a release, in optimizer steps. Default: 200")
    add("--cap_release_scale", type=float, default=3.0, metavar="FACTOR",
        help="cap during a release = --skip_grad_norm_max * FACTOR. Default: 3.0")
    add("--idle_free_phase", action="store_true",
        help="after --idle_max_steps steps without a NaN/Inf entering the window, do not skip by threshold for "
             "--idle_free_len steps (logged as ThreshOff=2; immediate NaN/Inf skips still apply). Default: off")
    add("--idle_max_steps", type=int, default=4000, metavar="STEPS",
        help="optimizer steps without a NaN/Inf window entry that start a free phase. Default: 4000")
    add("--idle_free_len", type=int, default=200, metavar="STEPS",
        help="length of a free phase, in optimizer steps (the starting one included). Default: 200")
    add("--grad_guard_preset", choices=sorted(PRESETS), default=None,
        help="stable = --skip_grad_norm --grad_norm_log --grad_cosine_log --skip_grad_norm_warmup_factor 20 "
             "--skip_grad_norm_max_factor 20 --nan_to_window --inf_to_window --no-skip_nan_immediate --no-skip_inf_immediate; "
             "minimal = --skip_grad_norm --grad_norm_log. Flags given explicitly (command line or config file) "
             "win over the preset. Default: none")
    add("--grad_norm_unscaled", action="store_true",
        help="measure the norm divided by the GradScaler's scale, so a scale change does not shift the window. "
             "Prefer it with fp16 + GradScaler when the scale changes often and your thresholds should not "
             "depend on it; leave it off to keep kohya-comparable (scaled) norms and presets. No effect without "
             "a scaler. Default: off")


def apply_preset(args: argparse.Namespace, explicit: set[str]) -> None:
    """Apply ``args.grad_guard_preset`` in place: set each preset dest not in ``explicit``.

    ``explicit`` holds the argparse dests the user set explicitly (command line or
    config file); those keep the user's value. Without a preset nothing changes.
    """
    preset_name = getattr(args, "grad_guard_preset", None)
    if preset_name is None:
        return
    if preset_name not in PRESETS:
        raise UserError(f"--grad_guard_preset {preset_name!r} is unknown; valid: {', '.join(sorted(PRESETS))}")
    for dest, value in PRESETS[preset_name].items():
        if dest not in explicit:
            setattr(args, dest, value)


def explicit_dests(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The dests of ``parser`` that ``argv`` sets explicitly (a plain command line, no config file).

    Re-parses ``argv`` with every default suppressed, so only given options appear.
    Call it after the normal parse succeeded (errors would already have exited).
    """
    saved_defaults = [(action, action.default) for action in parser._actions]
    saved_parser_defaults = parser._defaults
    try:
        for action, _ in saved_defaults:
            action.default = argparse.SUPPRESS
        parser._defaults = {}
        namespace, _ = parser.parse_known_args(list(argv))
    finally:
        for action, default in saved_defaults:
            action.default = default
        parser._defaults = saved_parser_defaults
    return set(vars(namespace))


# --------------------------------------------------------------------------- decision core


@dataclass(frozen=True)
class NanInfOptions:
    """The four NaN/Inf options; the guard replaces them once at ``--nan_inf_until_step``."""

    nan_to_window: bool = False
    inf_to_window: bool = False
    skip_nan_immediate: bool = True
    skip_inf_immediate: bool = True


FORCED_NAN_INF_OPTIONS = NanInfOptions(False, False, True, True)
"""The options in force after ``--nan_inf_until_step``."""


@dataclass(frozen=True)
class GuardConfig:
    """Validated guard options; field names are the argparse dests. Raises ``UserError`` when invalid."""

    skip_grad_norm: bool = False
    skip_grad_norm_max: float | None = None
    skip_grad_norm_warmup_factor: float | None = None
    skip_grad_norm_max_factor: float | None = None
    nan_to_window: bool = False
    inf_to_window: bool = False
    skip_nan_immediate: bool = True
    skip_inf_immediate: bool = True
    nan_inf_until_step: int | None = None
    auto_cap_release: bool = False
    cap_release_trigger_ratio: float = 0.66
    cap_release_trigger_steps: int = 200
    cap_release_length: int = 200
    cap_release_scale: float = 3.0
    idle_free_phase: bool = False
    idle_max_steps: int = 4000
    idle_free_len: int = 200
    grad_norm_unscaled: bool = False

    def __post_init__(self) -> None:
        def positive(name: str, value: float | None, unit: str) -> None:
            if value is not None and not (math.isfinite(value) and value > 0):
                raise UserError(f"--{name} must be a positive {unit} (got {value})")

        positive("skip_grad_norm_max", self.skip_grad_norm_max, "gradient norm")
        positive("skip_grad_norm_warmup_factor", self.skip_grad_norm_warmup_factor, "factor")
        positive("skip_grad_norm_max_factor", self.skip_grad_norm_max_factor, "factor")
        positive("cap_release_trigger_ratio", self.cap_release_trigger_ratio, "fraction")
        positive("cap_release_scale", self.cap_release_scale, "factor")
        for name in ("nan_inf_until_step", "cap_release_trigger_steps", "cap_release_length",
                     "idle_max_steps", "idle_free_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"--{name} must be a whole number of optimizer steps >= 1 (got {value})")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GuardConfig:
        """Read the guard options from parsed args (after :func:`apply_preset`); warn about inert ones."""
        config = cls._read(args)
        if config.auto_cap_release and config.skip_grad_norm_max is None and config.skip_grad_norm_max_factor is None:
            logger.warning("--auto_cap_release has no effect without --skip_grad_norm_max or "
                           "--skip_grad_norm_max_factor")
        return config

    @classmethod
    def _read(cls, args: argparse.Namespace) -> GuardConfig:
        values: dict[str, Any] = {}
        for field in fields(cls):
            value = getattr(args, field.name, field.default)
            if value is not None and field.type in ("float", "float | None"):
                value = _as_number(field.name, value, float)
            elif value is not None and field.type in ("int", "int | None"):
                value = _as_number(field.name, value, int)
            elif field.type == "bool":
                value = bool(value)
            values[field.name] = value
        return cls(**values)

    @property
    def nan_inf_options(self) -> NanInfOptions:
        return NanInfOptions(self.nan_to_window, self.inf_to_window,
                             self.skip_nan_immediate, self.skip_inf_immediate)


def validate_arguments(args: argparse.Namespace) -> None:
    """Raise the ``UserError`` a bad guard option gives (``--nan_inf_until_step 0``,
    ``--skip_grad_norm_max -1``, ...) before anything loads. Silent: the warnings about inert
    options come from :meth:`GuardConfig.from_args`, once the preset is applied."""
    GuardConfig._read(args)


def _as_number(name: str, value: Any, kind: type) -> float | int:
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise UserError(f"--{name} must be a{'n integer' if kind is int else ' number'} (got {value!r})") from None
    if kind is int and number != value and not isinstance(value, str):
        raise UserError(f"--{name} must be an integer (got {value!r})")
    return number


@dataclass(frozen=True)
class GuardDecision:
    """One step's outcome: ``skip`` the update?, the ``threshold`` compared against (NaN if poisoned),
    and ``thresh_off`` (0 normal, 1 threshold is NaN, 2 idle-free phase) as logged."""

    skip: bool
    threshold: float
    thresh_off: int


class GradGuard:
    """The per-step decision of ``docs/grad_guard_spec.md`` ("The exact per-step algorithm").

    Call :meth:`decide` once per optimizer step with the 1-based step and the norm.
    The guard neither sees tensors nor touches the optimizer; the caller acts on the
    returned :class:`GuardDecision`.

    Invariants:
      * ``window`` holds at most ``WINDOW_SIZE`` floats; NaN/Inf only when the
        options in force at that step let them in.
      * ``release > 0`` only with ``auto_cap_release`` and a cap (``skip_grad_norm_max`` or
        ``skip_grad_norm_max_factor``).
      * ``free_count == 0`` whenever not ``in_free``.
      * ``skipped_steps`` counts the ``decide`` calls that returned ``skip=True``.
      * The NaN/Inf options equal the config's until the ``--nan_inf_until_step``
        switch, then ``FORCED_NAN_INF_OPTIONS`` for good.
    """

    def __init__(self, config: GuardConfig, announce: Callable[[str], None] = print) -> None:
        """``announce`` receives the one line printed when ``--nan_inf_until_step`` switches."""
        self.config = config
        self._announce = announce
        self._window: deque[float] = deque(maxlen=WINDOW_SIZE)
        self._trigger = 0
        self._release = 0
        self._idle = 0
        self._free_count = 0
        self._in_free = False
        self._switched = False
        self._options = config.nan_inf_options
        self.skipped_steps = 0

    @property
    def window(self) -> tuple[float, ...]:
        """The gradient norms in the window now, oldest first (its limits act once it holds ``WINDOW_SIZE``)."""
        return tuple(self._window)

    @property
    def options(self) -> NanInfOptions:
        """The NaN/Inf options in force for the next step."""
        return self._options

    def decide(self, step: int, norm: float, agree: Callable[[bool], bool] | None = None) -> GuardDecision:
        """Update the state with optimizer step ``step`` (1-based) and its ``norm``; return the decision.

        ``agree`` (optional) maps the local skip to the one shared by all processes,
        e.g. ``lambda skip: agree_across_processes(skip, accelerator)``; the returned
        decision and ``skipped_steps`` use the shared value.
        """
        config = self.config
        norm = float(norm)
        # Not in the literal algorithm, but equal to it for consecutive steps: a run resumed (or
        # a log replayed) past N without having switched switches before its first step.
        self._maybe_switch(step, after_step=False)
        options = self._options
        is_nan = math.isnan(norm)
        is_inf = math.isinf(norm)

        # 1. window
        appended = False
        if not (is_nan or is_inf):
            self._window.append(norm)
        elif (is_nan and options.nan_to_window) or (is_inf and options.inf_to_window):
            self._window.append(norm)
            appended = True

        # 2. idle bookkeeping
        if self._in_free:
            self._free_count += 1
            if self._free_count >= config.idle_free_len:
                self._in_free = False
                self._free_count = 0
        elif appended:
            self._idle = 0
        else:
            self._idle += 1
            if config.idle_free_phase and self._idle >= config.idle_max_steps:
                self._in_free = True
                self._idle = 0
                self._free_count = 0

        # 3. pre-cap threshold (the relative warm-up threshold and cap: this project's, off by default)
        window_full = len(self._window) == WINDOW_SIZE
        relative = config.skip_grad_norm_warmup_factor is not None or config.skip_grad_norm_max_factor is not None
        typical = _typical_norm(self._window) if relative else None
        if window_full:
            pre = _window_threshold(self._window)
        elif config.skip_grad_norm_warmup_factor is None:
            pre = WARMUP_THRESHOLD
        else:
            pre = math.inf if typical is None else config.skip_grad_norm_warmup_factor * typical

        # 4. cap and auto cap release
        cap = config.skip_grad_norm_max
        if config.skip_grad_norm_max_factor is not None and typical is not None:
            relative_cap = config.skip_grad_norm_max_factor * typical
            cap = relative_cap if cap is None else min(cap, relative_cap)
        effective_max = cap
        if config.auto_cap_release and cap is not None:
            if self._release > 0:
                effective_max = cap * config.cap_release_scale
                pre = effective_max
                self._release -= 1
            elif not math.isnan(pre) and pre >= config.cap_release_trigger_ratio * cap:
                self._trigger += 1
                if self._trigger >= config.cap_release_trigger_steps:
                    self._release = config.cap_release_length
                    self._trigger = 0
            else:
                self._trigger = 0

        # 5. threshold (the cap only applies once the window is full)
        threshold = pre
        if effective_max is not None and threshold > effective_max:
            threshold = effective_max
        if not window_full:
            threshold = pre

        # 6. ThreshOff
        thresh_off = 2 if self._in_free else (1 if math.isnan(threshold) else 0)

        # 7. decision
        if not config.skip_grad_norm:
            skip = False
        elif (is_nan and options.skip_nan_immediate) or (is_inf and options.skip_inf_immediate):
            skip = True
        elif self._in_free:
            skip = False
        else:
            skip = norm > threshold
        if agree is not None:
            skip = bool(agree(skip))
        if skip:
            self.skipped_steps += 1

        # 8. --nan_inf_until_step
        self._maybe_switch(step, after_step=True)
        return GuardDecision(skip=skip, threshold=threshold, thresh_off=thresh_off)

    def _maybe_switch(self, step: int, after_step: bool) -> None:
        until = self.config.nan_inf_until_step
        if until is None or self._switched:
            return
        reached = step >= until if after_step else step > until
        if reached:
            self._options = FORCED_NAN_INF_OPTIONS
            self._switched = True
            self._announce(
                f"gradient guard: --nan_inf_until_step {until} reached at step {step}: NaN/Inf norms are now "
                f"kept out of the window and skipped immediately")

    def state_dict(self) -> dict[str, Any]:
        """Plain, strictly JSON-able state (non-finite window values stored as the strings "nan"/"inf")."""
        return {
            "window": [value if math.isfinite(value) else repr(value) for value in self._window],
            "trigger": self._trigger,
            "release": self._release,
            "idle": self._idle,
            "free_count": self._free_count,
            "in_free": self._in_free,
            "switched": self._switched,
            "nan_inf_options": dataclasses.asdict(self._options),
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output. The config stays the current one.

        The saved NaN/Inf options are restored only if the saved run had switched and
        ``--nan_inf_until_step`` is still given; otherwise the current flags apply.
        """
        self._window = deque((float(value) for value in state["window"]), maxlen=WINDOW_SIZE)
        self._trigger = int(state["trigger"])
        self._release = int(state["release"])
        self._idle = int(state["idle"])
        self._free_count = int(state["free_count"])
        self._in_free = bool(state["in_free"])
        self.skipped_steps = int(state["skipped_steps"])
        self._switched = bool(state["switched"]) and self.config.nan_inf_until_step is not None
        self._options = (NanInfOptions(**state["nan_inf_options"]) if self._switched
                         else self.config.nan_inf_options)


def print_to_stderr(line: str) -> None:
    print(line, file=sys.stderr)


def replay_decisions(rows: Sequence[tuple[int, float]], config: GuardConfig, events: Sequence[Sequence[str]] = (),
                     announce: Callable[[str], None] = print_to_stderr) -> list[tuple[int, float, GuardDecision]]:
    """A fresh :class:`GradGuard` over a log's (step, norm) ``rows``, as training decided them (the replay
    and plot tools); (step, norm, decision) per row. ``events``: the
    run's (Step, Event, Detail) rows: after a ``healthy`` step the guard's state is kept, after a
    ``rewind`` step the state kept at the step in its Detail comes back, as in training."""
    guard = GradGuard(config, announce=announce)
    healthy_steps = {int(step) for step, kind, _ in events if kind == "healthy"}
    rewinds = {int(step): int(detail) for step, kind, detail in events if kind == "rewind"}
    first_step = rows[0][0] if rows else 0
    kept = {step: copy.deepcopy(guard.state_dict()) for step in healthy_steps | set(rewinds.values())
            if step < first_step}  # the run's initial state: before the log's first row
    results = []
    for step, norm in rows:
        results.append((step, norm, guard.decide(step, norm)))
        if step in rewinds:
            if rewinds[step] not in kept:
                raise UserError(f"the events file has a rewind at step {step} to step {rewinds[step]}, but no healthy "
                                f"point at that step: it belongs to another log")
            guard.load_state_dict(copy.deepcopy(kept[rewinds[step]]))
        elif step in healthy_steps:
            kept[step] = copy.deepcopy(guard.state_dict())
    return results


def _typical_norm(window: Iterable[float]) -> float | None:
    """The median of the window's finite, non-zero norms (the current one included): the run's own gradient
    scale, which the relative limits are multiples of, robust to the spikes and NaN/Inf the guard is there
    for; None while the window holds no such norm."""
    values = np.fromiter(window, dtype=np.float64)
    values = values[np.isfinite(values) & (values > 0)]
    return float(np.median(values)) if values.size else None


def _window_threshold(window: Iterable[float]) -> float:
    """mean + 2.5 * population std in float64 with numpy semantics (NaN/Inf give NaN)."""
    values = np.fromiter(window, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        return float(np.mean(values) + STD_MULTIPLIER * np.std(values))


# --------------------------------------------------------------------------- measurement


@dataclass(frozen=True)
class GradientMeasurement:
    """``norm``: what the guard compares and the log writes (scaled, or unscaled with
    ``--grad_norm_unscaled``); ``cosine``: similarity to the previous step's gradient
    (NaN when off, on the first step, or when either norm is 0 or not finite);
    ``scale``: the scale passed in (1.0 without a scaler); ``loss``: the ``loss`` tensor passed
    in, read in the same host sync (NaN when none was passed); ``riders``: the values of the 1-D
    ``riders`` tensor passed in, read in that sync too (the healing policy's per-sample losses)."""

    norm: float
    cosine: float
    scale: float
    loss: float = math.nan
    riders: list[float] = dataclasses.field(default_factory=list)


class GradientMonitor:
    """L2 norm (and optional cosine) of the trainable parameters' ``.grad`` over one flat buffer.

    * Given a :class:`library.flat_gradients.FlatGradients` (the trainer's, gathered for this step),
      the gradients already are one flat buffer: the norm is one ``vector_norm`` of it (fp32
      accumulation), whatever the number of parameters. Given parameters, their gradients are
      first copied into a flat fp32 buffer of the monitor's own (one ``_foreach_copy_``).
      On CPU the norm is taken over rows of :data:`CPU_NORM_ROW` values, then over the rows' norms: torch's
      CPU reduction of one long vector accumulates in a few float32 lanes (relative error 4e-4 at 7.8 M
      values, against 3e-8 by rows, in the same time).
    * With ``cosine=True`` one flat fp32 buffer of the total size holds the previous step's
      gradient (4 bytes per trainable value): each step takes the dot product of the current
      gradient with it, then copies the current one over it. On CPU this runs in chunks of
      ``chunk_numel`` values so each chunk is still in cache for the copy; on CUDA it is one chunk
      (few kernel launches). The norm does not depend on the chunks: it is bit-identical with and
      without cosine, so enabling the cosine log cannot change a decision.
    * :meth:`measure` never modifies gradients and does exactly one host sync.
      Parameters whose ``.grad`` is None count as zero.
    """

    def __init__(self, parameters: Iterable[torch.Tensor] | FlatGradients, *, cosine: bool = False,
                 unscaled: bool = False, chunk_numel: int | None = None) -> None:
        """``parameters``: the trainable parameters (``requires_grad``), all on one device, or the
        :class:`FlatGradients` holding their gradients. ``unscaled``: report norm / scale
        (``--grad_norm_unscaled``). ``chunk_numel``: values per cosine chunk (default: 2**18 on
        CPU, everything at once elsewhere)."""
        self._flat_gradients = parameters if isinstance(parameters, FlatGradients) else None
        if self._flat_gradients is not None:
            self._parameters = self._flat_gradients.parameters
        else:
            self._parameters = [p for p in dict.fromkeys(parameters) if p.requires_grad]
        self.cosine = cosine
        self.unscaled = unscaled
        devices = {p.device for p in self._parameters}
        if len(devices) > 1:
            raise ValueError(f"GradientMonitor needs all parameters on one device, got {sorted(map(str, devices))}")
        self._device = devices.pop() if devices else torch.device("cpu")
        self.numel = sum(p.numel() for p in self._parameters)
        if chunk_numel is None:
            chunk_numel = CPU_CHUNK_NUMEL if self._device.type == "cpu" else max(self.numel, 1)
        self._chunks = [(start, min(start + chunk_numel, self.numel)) for start in range(0, self.numel, chunk_numel)]
        self._has_previous = False
        self._previous_norm = math.nan
        self._previous = torch.zeros(self.numel, dtype=torch.float32, device=self._device) if cosine else None
        self._gathered: torch.Tensor | None = None  # the copy of separate gradients (without FlatGradients)
        self._gathered_views: list[torch.Tensor] = []

    def measure(self, scale: float | torch.Tensor | None = None, loss: torch.Tensor | None = None,
                riders: torch.Tensor | None = None) -> GradientMeasurement:
        """Measure the current gradients. ``scale``: the GradScaler's current scale (pass the
        scale tensor to avoid a second sync), None without a scaler. ``loss`` (0-dim) and ``riders``
        (1-D) are read in the same host sync. With cosine, the current gradient becomes the
        previous one."""
        flat = self._flat_gradients.flat if self._flat_gradients is not None else self._gather()
        scaled_norm = _flat_norm(flat)
        dot = self._dot_and_keep(flat) if self.cosine else None
        return self.conclude(scaled_norm, dot, scale, loss, riders)

    @property
    def has_previous(self) -> bool:
        """Whether the previous gradient is kept (cosine on, after a first step or a resume)."""
        return self._has_previous

    def previous_views(self) -> list[torch.Tensor]:
        """With cosine: the previous gradient's buffer as one view per parameter (shaped flat), for a
        caller that measures gradients one at a time (``library.fused_backward``) and keeps them here."""
        return [view.reshape(-1) for view in views_into(self._previous, self._parameters)]

    def conclude(self, scaled_norm: torch.Tensor, dot: torch.Tensor | None, scale: float | torch.Tensor | None = None,
                 loss: torch.Tensor | None = None, riders: torch.Tensor | None = None) -> GradientMeasurement:
        """The measurement from a step's (scaled) gradient ``norm`` and its ``dot`` product with the
        previous gradient (None: no cosine this step), in one host sync; what :meth:`measure` returns
        once it has computed them, for a caller that computed them itself. With cosine the step's
        gradient must already have been copied over the previous one."""
        scalars = [scaled_norm]
        if dot is not None:
            scalars.append(dot)
        if isinstance(scale, torch.Tensor):
            scalars.append(scale.detach().reshape(()).to(device=scaled_norm.device, dtype=torch.float32))
        if loss is not None:  # the step's loss rides along, so bookkeeping costs no extra sync
            scalars.append(loss.detach().reshape(()).to(device=scaled_norm.device, dtype=torch.float32))
        stacked = torch.stack(scalars)
        if riders is not None:
            stacked = torch.cat([stacked, riders.detach().reshape(-1).to(device=stacked.device, dtype=torch.float32)])
        values = stacked.tolist()  # the one host sync
        rider_values = values[len(scalars):]
        del values[len(scalars):]

        loss_value = values.pop() if loss is not None else math.nan
        raw_norm = values[0]
        scale_value = values[-1] if isinstance(scale, torch.Tensor) else (1.0 if scale is None else float(scale))
        cosine = math.nan
        if self.cosine:
            if dot is not None:
                cosine = _cosine(values[1], raw_norm, self._previous_norm)
            self._has_previous = True
            self._previous_norm = raw_norm
        norm = raw_norm
        if self.unscaled:
            norm = raw_norm / scale_value if scale_value else math.nan
        return GradientMeasurement(norm=norm, cosine=cosine, scale=scale_value, loss=loss_value, riders=rider_values)

    def _gather(self) -> torch.Tensor:
        """The parameters' separate gradients copied into one flat fp32 buffer (None as zeros)."""
        if self._gathered is None:
            self._gathered = torch.zeros(self.numel, dtype=torch.float32, device=self._device)
            self._gathered_views = views_into(self._gathered, self._parameters)
        present, views = [], []
        for parameter, view in zip(self._parameters, self._gathered_views):
            if parameter.grad is None:
                view.zero_()
            else:
                present.append(parameter.grad)
                views.append(view)
        if present:
            torch._foreach_copy_(views, present)
        return self._gathered

    def _dot_and_keep(self, flat: torch.Tensor) -> torch.Tensor | None:
        """Dot product of ``flat`` with the previous gradient (None on the first step), chunk by
        chunk, each chunk then copied over the previous one."""
        dots = []
        for start, end in self._chunks:
            current, previous = flat[start:end], self._previous[start:end]
            if self._has_previous:
                dots.append(torch.dot(current.float(), previous))
            previous.copy_(current)
        return torch.stack(dots).sum() if dots else None

    def state_dict(self) -> dict[str, Any]:
        """``previous_gradient``: a copy of the flat fp32 previous gradient (None before the
        first step or without cosine) and its scaled ``previous_norm``."""
        previous = self._previous.clone() if self.cosine and self._has_previous else None
        return {"previous_gradient": previous, "previous_norm": self._previous_norm}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output. A previous gradient of another size (different
        network) is dropped with a warning: the first cosine after resume is then NaN."""
        previous = state.get("previous_gradient")
        self._has_previous = False
        self._previous_norm = math.nan
        if not self.cosine or previous is None:
            return
        if previous.numel() != self.numel:
            logger.warning("gradient guard: the resumed previous gradient has %d values but the trainable "
                           "parameters have %d; the first CosineSim after resume is nan",
                           previous.numel(), self.numel)
            return
        self._previous.copy_(previous.reshape(-1))
        self._has_previous = True
        self._previous_norm = float(state["previous_norm"])


CPU_CHUNK_NUMEL = 1 << 18
"""Values per cosine chunk on CPU (1 MiB fp32: stays in cache between the dot and the copy)."""


CPU_NORM_ROW = 4096
"""Values per row of the CPU norm (see :class:`GradientMonitor`)."""
CPU_NORM_BLOCK_ROWS = 4096
"""Rows per block of the CPU norm: at most 64 MiB of a low-precision buffer upcast at once."""


def _flat_norm(flat: torch.Tensor) -> torch.Tensor:
    """L2 norm of a 1-D tensor with float32 accumulation: one reduction off the CPU, by rows on it."""
    if flat.device.type != "cpu" or flat.numel() <= CPU_NORM_ROW:
        return torch.linalg.vector_norm(flat, dtype=torch.float32)
    whole = flat.numel() - flat.numel() % CPU_NORM_ROW
    # Blocks of rows: a bf16/fp16 buffer is upcast one block at a time, never whole (a full model's
    # gradients: a float32 copy of a full-size SDXL UNet's would be 9.6 GiB). Each row's norm is the same.
    rows = flat[:whole].view(-1, CPU_NORM_ROW)
    parts = [torch.linalg.vector_norm(block, dim=1, dtype=torch.float32) for block in rows.split(CPU_NORM_BLOCK_ROWS)]
    if whole < flat.numel():
        parts.append(torch.linalg.vector_norm(flat[whole:], dtype=torch.float32).reshape(1))
    return torch.linalg.vector_norm(torch.cat(parts))


def _cosine(dot: float, norm_a: float, norm_b: float) -> float:
    values = (dot, norm_a, norm_b)
    if not all(math.isfinite(value) for value in values) or norm_a == 0 or norm_b == 0:
        return math.nan
    return max(-1.0, min(1.0, dot / (norm_a * norm_b)))


def agree_across_processes(skip: bool, accelerator: Any) -> bool:
    """Skip on every process if any process wants to (all-reduce MAX of a flag).

    Costs one all-reduce and one host sync; with a single process it returns ``skip``.
    Pass it to :meth:`GradGuard.decide` as ``agree=``.
    """
    if accelerator.num_processes <= 1:
        return skip
    flag = torch.tensor([1.0 if skip else 0.0], device=accelerator.device)
    return bool(accelerator.reduce(flag, reduction="max").item() > 0)
