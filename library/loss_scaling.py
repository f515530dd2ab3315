"""Loss scaling for fp16 training: one scaler with the mechanics, pluggable policies for the scale.

accelerate gives no GradScaler on CPU, so the trainer owns its loss scaling. It is split in two:

* :class:`LossScaler` does the mechanics, once, for every policy: multiply the loss by the scale,
  unscale the gradients in place with fused ops while detecting inf/NaN, agree on the overflow
  across processes, skip the optimizer step on overflow, save and load its state. It is modelled
  on ``torch.amp.GradScaler`` (same call order, same guarantees) but knows nothing about how the
  next scale is chosen.
* A *policy* decides the next scale from one bit per iteration, "overflow or not", and its own
  counters. Built-ins: ``dynamic`` (torch's rule, the default), ``static``, ``aggressive`` and
  ``floored``; users add their own with ``--loss_scaler module:Class`` or
  ``--loss_scaler path/to/file.py:Class`` (``docs/loss_scaling.md``, ``examples/loss_scaler_plugin.py``).

Per optimizer step (``accelerator.sync_gradients``) the trainer does::

    accelerator.backward(scaler.scale(loss))      # every micro-batch
    ...                                            # measure the still-scaled gradients
    scaler.unscale_(optimizer)                     # optional: step() unscales if not done yet
    clip_grad_norm_(...)
    stepped = scaler.step(optimizer)               # False: inf/NaN somewhere, optimizer untouched
    scaler.update()                                # the policy picks the next scale

Entry points: :func:`add_arguments`, :func:`validate_arguments`, :func:`create_loss_scaler`,
:func:`register_loss_scaler`.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import inspect
import logging
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional

import numpy as np
import torch

from library.errors import UserError
from library.optimizers import parse_key_value_args

logger = logging.getLogger(__name__)

DEFAULT_LOSS_SCALER = "dynamic"
REQUIRED_POLICY_METHODS = ("initial_scale", "next_scale", "state_dict", "load_state_dict")
"""What a policy class must define (a :class:`ScalePolicy` subclass inherits the last two)."""


def to_float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (inf when too large): the scale lives in a float32
    tensor, so this is the value the loss is really multiplied by."""
    with np.errstate(over="ignore"):
        return float(np.float32(value))


# --------------------------------------------------------------------------- policies


class ScalePolicy:
    """Base class for scale policies (optional: any class with the four methods works).

    A policy never sees tensors, optimizers or processes. :class:`LossScaler` asks it for the
    :meth:`initial_scale` once, then calls :meth:`next_scale` once per iteration (per
    ``update()``) with the scale in force and whether that iteration overflowed. Every process
    calls it with the same arguments in the same order, so a deterministic policy keeps the
    processes in agreement. The scaler rounds the returned scale to float32 and refuses values
    that are not finite and > 0 after rounding.

    Keyword arguments of ``__init__`` are the ``--loss_scaler_args`` keys. Subclasses list the
    attributes that change during training in ``STATE_FIELDS`` (plain ints, floats, bools); the
    inherited :meth:`state_dict`/:meth:`load_state_dict` save and restore exactly those.
    """

    STATE_FIELDS: tuple[str, ...] = ()

    def initial_scale(self) -> float:
        """The scale of the first iteration."""
        raise NotImplementedError

    def next_scale(self, scale: float, overflow: bool) -> float:
        """The scale of the next iteration, given this iteration's ``scale`` and ``overflow``.

        May update the policy's counters; must not depend on anything but its arguments and
        the policy's own state.
        """
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The counters named in ``STATE_FIELDS`` (JSON-able)."""
        return {name: getattr(self, name) for name in self.STATE_FIELDS}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output; the constructor arguments stay the current ones."""
        for name in self.STATE_FIELDS:
            setattr(self, name, state[name])


_REGISTRY: dict[str, type] = {}


def register_loss_scaler(name: str) -> Callable[[type], type]:
    """Class decorator: make the policy class selectable as ``--loss_scaler name``.

    The class is checked for :data:`REQUIRED_POLICY_METHODS` when it is registered. Registering
    another class under a taken name raises ``UserError``; re-registering the same class (a module
    imported again) replaces it. A plugin module decorated this way can also be selected as
    ``--loss_scaler path/to/file.py:name``.
    """
    if not name or ":" in name or name != name.strip():
        raise ValueError(f"loss scaler name {name!r} must be non-empty, without ':' or surrounding spaces")

    def decorator(cls: type) -> type:
        _check_policy_class(cls, name)
        known = _REGISTRY.get(name)
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise UserError(f"loss scaler {name!r} is already registered by {known.__module__}.{known.__qualname__}")
        _REGISTRY[name] = cls
        return cls

    return decorator


def _check_policy_class(cls: Any, spec: str) -> None:
    if not isinstance(cls, type):
        raise UserError(f"--loss_scaler {spec}: {cls!r} is not a class")
    for method in REQUIRED_POLICY_METHODS:
        implementation = getattr(cls, method, None)
        inherited_stub = method in ("initial_scale", "next_scale") and implementation is getattr(ScalePolicy, method)
        if not callable(implementation) or inherited_stub:
            raise UserError(
                f"--loss_scaler {spec}: {cls.__name__} has no method {method}(); a loss scale policy needs "
                f"{', '.join(REQUIRED_POLICY_METHODS)} (see docs/loss_scaling.md)"
            )


def available_loss_scalers() -> list[str]:
    """Registered names, sorted."""
    return sorted(_REGISTRY)


@register_loss_scaler("dynamic")
class DynamicPolicy(ScalePolicy):
    """``torch.amp.GradScaler``'s rule, exactly (float32 arithmetic included).

    On overflow: ``scale *= backoff_factor`` and the clean-step counter restarts at 0.
    On a clean step: the counter counts; when it reaches ``growth_interval``, ``scale *=
    growth_factor`` (kept only if still finite in float32) and the counter restarts at 0.
    """

    STATE_FIELDS = ("growth_tracker",)

    def __init__(self, *, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        self.init_scale = _scale_arg("init_scale", init_scale)
        self.growth_factor = _factor_arg("growth_factor", growth_factor, above_one=True)
        self.backoff_factor = _factor_arg("backoff_factor", backoff_factor, above_one=False)
        self.growth_interval = _steps_arg("growth_interval", growth_interval)
        self.growth_tracker = 0

    def initial_scale(self) -> float:
        return self.init_scale

    def next_scale(self, scale: float, overflow: bool) -> float:
        if overflow:
            self.growth_tracker = 0
            return scale * self.backoff_factor
        return self._count_clean_step(scale)

    def _count_clean_step(self, scale: float) -> float:
        """Count a clean step; grow the scale when ``growth_interval`` of them are in a row."""
        self.growth_tracker += 1
        if self.growth_tracker < self.growth_interval:
            return scale
        self.growth_tracker = 0
        grown = to_float32(scale * self.growth_factor)
        return grown if math.isfinite(grown) else scale


@register_loss_scaler("static")
class StaticPolicy(ScalePolicy):
    """A fixed ``scale`` (default 65536 = 2**16, dynamic's starting scale, so switching between
    the two changes nothing until dynamic's first change). An overflow still skips its step, but
    the scale never falls: pick it from the ``Scale`` column of an earlier dynamic run."""

    def __init__(self, *, scale: float = 2.0**16) -> None:
        self.scale = _scale_arg("scale", scale)

    def initial_scale(self) -> float:
        return self.scale

    def next_scale(self, scale: float, overflow: bool) -> float:
        return self.scale


@register_loss_scaler("aggressive")
class AggressivePolicy(DynamicPolicy):
    """Backs off hard, grows sooner, capped: ``dynamic``'s rule with other factors and a cap.

    On overflow: ``scale *= backoff_factor`` (0.25) and the clean-step counter restarts at 0.
    On a clean step: the counter counts; when it reaches ``growth_interval`` (1500), ``scale =
    min(scale * growth_factor, max_scale)`` (x1.8, cap 2**24) and the counter restarts at 0 (also
    when the scale is already at the cap).
    """

    def __init__(self, *, init_scale: float = 2.0**16, growth_factor: float = 1.8, backoff_factor: float = 0.25,
                 growth_interval: int = 1500, max_scale: float = 2.0**24) -> None:
        super().__init__(init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                         growth_interval=growth_interval)
        self.max_scale = _scale_arg("max_scale", max_scale)
        if self.init_scale > self.max_scale:
            raise UserError(f"--loss_scaler_args init_scale={init_scale} must not exceed max_scale={max_scale}")

    def next_scale(self, scale: float, overflow: bool) -> float:
        next_scale = super().next_scale(scale, overflow)
        return next_scale if overflow else min(next_scale, self.max_scale)


@register_loss_scaler("floored")
class FlooredPolicy(DynamicPolicy):
    """Backs off steeply but never below a floor; sporadic overflows do not delay growth.

    On overflow: ``scale = max(scale * backoff_factor, min_scale)`` (x0.3, floor 2**12). Unlike
    ``dynamic``, an overflow does *not* restart the clean-step counter, unless it is the
    ``pause_after``-th (5th) overflow in a row: then growth *pauses*, which means the counter is
    set to 0 and stays there through further overflows; the pause ends with the next clean
    step, which counts as the first clean step again.
    On a clean step: the overflow streak ends; the counter counts; when it reaches
    ``growth_interval`` (2000), ``scale *= growth_factor`` (x2) and the counter restarts at 0.
    A scale that would leave float32 stays where it is.
    """

    STATE_FIELDS = ("growth_tracker", "overflow_streak")

    def __init__(self, *, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.3,
                 growth_interval: int = 2000, min_scale: float = 2.0**12, pause_after: int = 5) -> None:
        super().__init__(init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                         growth_interval=growth_interval)
        self.min_scale = _scale_arg("min_scale", min_scale)
        self.pause_after = _steps_arg("pause_after", pause_after)
        if self.init_scale < self.min_scale:
            raise UserError(f"--loss_scaler_args init_scale={init_scale} must not be below min_scale={min_scale}")
        self.overflow_streak = 0

    @property
    def growth_paused(self) -> bool:
        """True from the ``pause_after``-th consecutive overflow until the next clean step."""
        return self.overflow_streak >= self.pause_after

    def next_scale(self, scale: float, overflow: bool) -> float:
        if overflow:
            self.overflow_streak += 1
            if self.growth_paused:
                self.growth_tracker = 0
            return max(scale * self.backoff_factor, self.min_scale)
        self.overflow_streak = 0
        return self._count_clean_step(scale)


def _scale_arg(key: str, value: Any) -> float:
    number = _number_arg(key, value)
    rounded = to_float32(number)
    if not (math.isfinite(rounded) and rounded > 0):
        raise UserError(f"--loss_scaler_args {key}={value!r}: must be a number > 0 that fits float32 (e.g. 65536)")
    return rounded


def _factor_arg(key: str, value: Any, above_one: bool) -> float:
    number = _number_arg(key, value)
    if above_one and not (math.isfinite(number) and number > 1):
        raise UserError(f"--loss_scaler_args {key}={value!r}: must be a number > 1")
    if not above_one and not 0 < number < 1:
        raise UserError(f"--loss_scaler_args {key}={value!r}: must be a number between 0 and 1 (exclusive)")
    return number


def _steps_arg(key: str, value: Any) -> int:
    whole = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and value == int(value)
    if not whole or value < 1:
        raise UserError(f"--loss_scaler_args {key}={value!r}: must be a whole number of steps >= 1")
    return int(value)


def _number_arg(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"--loss_scaler_args {key}={value!r}: must be a number")
    return float(value)


# --------------------------------------------------------------------------- the scaler


_EXTERNAL_STEP = -1
"""The key of :meth:`LossScaler.record_step`'s step among the per-optimizer states (ids are > 0)."""


@dataclass
class _OptimizerState:
    """Per optimizer, between two ``update()`` calls."""

    found_inf: Optional[torch.Tensor] = None  # set by unscale_: 1-element float32, > 0 on overflow
    overflow: Optional[bool] = None  # found_inf read on the host (by step or update)
    stepped: bool = False  # step() was called


class LossScaler:
    """Loss scaling mechanics for any policy (the counterpart of ``torch.amp.GradScaler``).

    Per iteration, for each optimizer: :meth:`scale` the loss of every backward, optionally
    :meth:`unscale_` (to clip or inspect gradients), :meth:`step`, then :meth:`update` once.

    Invariants:
      * The scale is a float32 value > 0 held twice: a 0-dim float32 tensor on ``device``
        (:meth:`get_scale_tensor`, used by :meth:`scale` and :meth:`unscale_`) and the same value
        as a Python float (:meth:`get_scale`). Only :meth:`update` and :meth:`load_state_dict`
        change it, so reading it never waits for the device.
      * :meth:`unscale_` runs at most once per optimizer per iteration and must come before that
        optimizer's :meth:`step`; :meth:`step` runs at most once per optimizer per iteration.
      * The overflow flag is the MAX over every process of the default ``torch.distributed``
        group (or ``process_group``) when one is initialised with more than one process, so every
        process skips the same steps and its policy sees the same sequence: the scales stay equal.
        :meth:`unscale_` is then a collective: every process must call it (directly or through
        :meth:`step`) the same number of times.
      * An overflowing :meth:`step` does not call ``optimizer.step()``: parameters and optimizer
        state are untouched (the gradients are left unscaled and non-finite; zero them as usual).
      * ``overflow_count`` counts skipped optimizer steps; ``last_step_skipped`` tells whether the
        latest :meth:`step` skipped.
    """

    def __init__(self, policy: Any, device: torch.device | str = "cpu", *, name: Optional[str] = None,
                 process_group: Any = None) -> None:
        """``policy``: an object with :data:`REQUIRED_POLICY_METHODS` (e.g. a :class:`ScalePolicy`).
        ``name``: shown in messages and saved in the state (default: the policy's class name).
        ``process_group``: the group the overflow flag is reduced over (default: the world)."""
        self.policy = policy
        self.name = name or type(policy).__name__
        self.device = torch.device(device)
        self.process_group = process_group
        initial = self._checked_scale(policy.initial_scale(), "initial_scale()")
        self._scale_value = initial
        self._scale = torch.full((), initial, dtype=torch.float32, device=self.device)
        self._per_optimizer: dict[int, _OptimizerState] = {}
        self.overflow_count = 0
        self.last_step_skipped = False

    # -- reading the scale
    def get_scale(self) -> float:
        """The current scale as a Python float (no device sync)."""
        return self._scale_value

    def get_scale_tensor(self) -> torch.Tensor:
        """The current scale as the live 0-dim float32 tensor on ``device`` (no sync; updated in
        place by :meth:`update`: do not modify it, clone it to keep a value)."""
        return self._scale

    # -- the iteration
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (same shape; dtype by torch's promotion rules: fp32 for an fp32 loss)."""
        return loss * self._scale.to(device=loss.device, non_blocking=True)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale in place and record whether any is inf/NaN.

        Fused: one ``torch._amp_foreach_non_finite_check_and_unscale_`` per (device, dtype) group;
        fp16/bf16 gradients are allowed (multiplied in float32, stored back in their dtype).
        Sparse gradients are coalesced first. No host sync; with several processes one all-reduce.
        Raises ``RuntimeError`` when called twice, or after :meth:`step`, in one iteration.
        """
        state = self._per_optimizer.setdefault(id(optimizer), _OptimizerState())
        if state.stepped:
            raise RuntimeError("LossScaler.unscale_() called after step() for this optimizer; call update() first")
        if state.found_inf is not None:
            raise RuntimeError("LossScaler.unscale_() already called for this optimizer since the last update()")
        inverse_scale = self._scale.double().reciprocal().float()
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for parameter in _parameters(optimizer):
            grad = parameter.grad
            if grad is None:
                continue
            if grad.is_sparse:
                parameter.grad = grad = grad.coalesce()
                grad = grad._values()
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
        found_per_device: dict[torch.device, torch.Tensor] = {}
        for (device, _), grads in groups.items():
            if device not in found_per_device:
                found_per_device[device] = torch.zeros(1, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, found_per_device[device], inverse_scale.to(device, non_blocking=True)
            )
        found_inf = torch.zeros(1, dtype=torch.float32, device=self.device)
        for found in found_per_device.values():
            found_inf += found.to(self.device, non_blocking=True)
        self._agree_across_processes(found_inf)
        state.found_inf = found_inf

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> bool:
        """Unscale if :meth:`unscale_` was not called, then ``optimizer.step(*args, **kwargs)``
        unless a gradient (on any process) is inf/NaN. Returns True if the optimizer stepped.
        One host sync (reading the overflow flag). Closures are not supported."""
        if "closure" in kwargs:
            raise RuntimeError("LossScaler.step() does not support closures")
        state = self._per_optimizer.setdefault(id(optimizer), _OptimizerState())
        if state.stepped:
            raise RuntimeError("LossScaler.step() already called for this optimizer since the last update()")
        if state.found_inf is None:
            self.unscale_(optimizer)
        state.overflow = bool(state.found_inf.item() > 0)
        state.stepped = True
        self.last_step_skipped = state.overflow
        if state.overflow:
            self.overflow_count += 1
            return False
        optimizer.step(*args, **kwargs)
        return True

    def record_step(self, overflow: bool) -> bool:
        """Count one optimizer step whose gradients the caller unscaled and checked itself, as
        :meth:`step` counts it, without calling an optimizer: ``library.fused_backward`` applies each
        parameter's update during the backward, so the gradients never exist at once for
        :meth:`unscale_`. ``overflow``: an unscaled gradient was inf/NaN (the caller's check, agreed over
        the processes). Returns True when the caller may apply the update; end the iteration with
        :meth:`update` as usual."""
        state = self._per_optimizer.setdefault(_EXTERNAL_STEP, _OptimizerState())
        if state.stepped:
            raise RuntimeError("LossScaler.record_step() already called since the last update()")
        state.overflow = bool(overflow)
        state.stepped = True
        self.last_step_skipped = state.overflow
        if state.overflow:
            self.overflow_count += 1
        return not state.overflow

    def update(self) -> None:
        """End the iteration: ask the policy for the next scale given whether any optimizer
        overflowed. Needs at least one :meth:`unscale_` or :meth:`step` since the last update.
        Raises ``UserError`` if the policy returns something that is not a finite float32 > 0."""
        if not self._per_optimizer:
            raise RuntimeError("LossScaler.update() needs unscale_() or step() since the last update()")
        overflow = False
        for state in self._per_optimizer.values():
            if state.overflow is None:
                state.overflow = bool(state.found_inf.item() > 0)
            overflow = overflow or state.overflow
        self._per_optimizer.clear()
        self._set_scale(self._checked_scale(self.policy.next_scale(self._scale_value, overflow), "next_scale()"))

    # -- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """``{"policy": name, "scale": float, "overflow_count": int, "policy_state": dict}`` (JSON-able)."""
        return {
            "policy": self.name,
            "scale": self._scale_value,
            "overflow_count": self.overflow_count,
            "policy_state": self.policy.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (between iterations). The scale and ``overflow_count``
        are always restored; the policy's counters only when the saved policy has the same name
        (otherwise a warning: the current policy starts its counters afresh at the saved scale)."""
        self._set_scale(self._checked_scale(state["scale"], "the saved state"))
        self.overflow_count = int(state["overflow_count"])
        self._per_optimizer.clear()
        if state.get("policy") == self.name:
            self.policy.load_state_dict(state["policy_state"])
        else:
            logger.warning("loss scaler: the saved state is from %r, this run uses %r; keeping the saved scale %s "
                           "but not the saved policy counters", state.get("policy"), self.name, state["scale"])

    # -- internals
    def _set_scale(self, value: float) -> None:
        self._scale_value = value
        self._scale.fill_(value)

    def _checked_scale(self, value: Any, source: str) -> float:
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        rounded = to_float32(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
        if not (math.isfinite(rounded) and rounded > 0):
            raise UserError(f"--loss_scaler {self.name}: {source} gave {value!r}; a loss scale must be a finite "
                            f"number > 0 that fits float32 (if every step overflows, the gradients are not finite "
                            f"at any scale: check the learning rate and the data)")
        return rounded

    def _agree_across_processes(self, found_inf: torch.Tensor) -> None:
        distributed = torch.distributed
        if not (distributed.is_available() and distributed.is_initialized()):
            return
        if distributed.get_world_size(self.process_group) > 1:
            distributed.all_reduce(found_inf, op=distributed.ReduceOp.MAX, group=self.process_group)


def _parameters(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]


# --------------------------------------------------------------------------- options and plugins


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``--loss_scaler`` and ``--loss_scaler_args`` (one argument group)."""
    group = parser.add_argument_group(
        "loss scaling", "How the fp16 loss scale is chosen. Only used with --mixed_precision fp16."
    )
    group.add_argument(
        "--loss_scaler", type=str, default=DEFAULT_LOSS_SCALER, metavar="NAME",
        help="loss scale policy; only used with --mixed_precision fp16. dynamic = torch GradScaler's rule "
             "(start 65536, x0.5 on overflow, x2 after 2000 clean steps); static = a fixed scale (65536); "
             "aggressive = x0.25 on overflow, x1.8 after 1500 clean steps, at most 2**24; floored = x0.3 on "
             "overflow but never below 4096, x2 after 2000 clean steps; or a plugin policy class as "
             "module.path:Class or path/to/file.py:Class (docs/loss_scaling.md). An overflow (inf/NaN gradient "
             "on any process) always skips its optimizer step. Default: dynamic",
    )
    group.add_argument(
        "--loss_scaler_args", type=str, default=None, nargs="*", metavar="KEY=VALUE",
        help="arguments of the --loss_scaler policy as key=value, values read as Python literals (e.g. "
             "\"init_scale=1024 growth_interval=500\"). Keys: dynamic init_scale, growth_factor, backoff_factor, "
             "growth_interval; static scale; aggressive those of dynamic + max_scale; floored those of dynamic + "
             "min_scale, pause_after; a plugin: its constructor's keyword arguments. Default: none",
    )


def validate_arguments(args: argparse.Namespace) -> None:
    """Fail fast: with fp16, load the ``--loss_scaler`` policy and build it from ``--loss_scaler_args``
    (then discard it), raising the ``UserError`` :func:`create_loss_scaler` would raise later.
    Meant for the entry scripts' argument check, before any model is loaded."""
    if getattr(args, "mixed_precision", "no") == "fp16":
        name, policy_class = resolve_loss_scaler(getattr(args, "loss_scaler", None) or DEFAULT_LOSS_SCALER)
        LossScaler(build_policy(policy_class, parse_key_value_args(args.loss_scaler_args, "--loss_scaler_args"), name),
                   "cpu", name=name)


def create_loss_scaler(args: argparse.Namespace, device: torch.device | str,
                       process_group: Any = None) -> Optional[LossScaler]:
    """The scaler for ``--loss_scaler``/``--loss_scaler_args`` on ``device``; None unless
    ``args.mixed_precision == "fp16"`` (bf16 and fp32 need no loss scaling; the options are then
    ignored with a warning if given). Imports a plugin if one is named. Raises ``UserError`` for
    an unknown name, a plugin that cannot be loaded or lacks a required method, an unknown or
    invalid argument."""
    spec = getattr(args, "loss_scaler", None) or DEFAULT_LOSS_SCALER
    items = getattr(args, "loss_scaler_args", None)
    if getattr(args, "mixed_precision", "no") != "fp16":
        if spec != DEFAULT_LOSS_SCALER or items:
            logger.warning("--loss_scaler/--loss_scaler_args are ignored without --mixed_precision fp16")
        return None
    name, policy_class = resolve_loss_scaler(spec)
    policy = build_policy(policy_class, parse_key_value_args(items, "--loss_scaler_args"), name)
    return LossScaler(policy, device, name=name, process_group=process_group)


def resolve_loss_scaler(spec: str) -> tuple[str, type]:
    """``(name, policy class)`` for a registered name, ``module.path:Attribute`` or
    ``path/to/file.py:Attribute`` (Attribute: a class, or a name the module registered).
    Checks the class for :data:`REQUIRED_POLICY_METHODS`. Raises ``UserError``."""
    if ":" not in spec:
        policy_class = _REGISTRY.get(spec)
        if policy_class is None:
            raise UserError(
                f"--loss_scaler {spec!r} is unknown; available: {', '.join(available_loss_scalers())}, "
                f"or a plugin as module.path:Class or path/to/file.py:Class"
            )
        return spec, policy_class
    source, _, attribute = spec.rpartition(":")
    if not source or not attribute:
        raise UserError(f"--loss_scaler {spec!r}: a plugin is module.path:Class or path/to/file.py:Class")
    module = _import_plugin(spec, source)
    found = getattr(module, attribute, None)
    if found is None:
        found = _REGISTRY.get(attribute)
    if not isinstance(found, type):
        raise UserError(f"--loss_scaler {spec}: {source} has no class (or registered loss scaler) {attribute!r}")
    _check_policy_class(found, spec)
    return spec, found


def build_policy(policy_class: type, kwargs: Mapping[str, Any], name: str) -> Any:
    """``policy_class(**kwargs)`` after checking the keys against its constructor. Raises ``UserError``
    naming the valid keys for an unknown key or a missing required one, and for a ``TypeError`` or
    ``ValueError`` the constructor raises (how plugins refuse bad values)."""
    try:
        parameters = inspect.signature(policy_class).parameters.values()
    except (TypeError, ValueError):
        parameters = None
    if parameters is not None and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        accepted = [p.name for p in parameters
                    if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        valid = ", ".join(accepted) or "none"
        for key in kwargs:
            if key not in accepted:
                raise UserError(f"--loss_scaler_args {key}: not an argument of loss scaler {name}; valid keys: {valid}")
        for p in parameters:
            if p.default is inspect.Parameter.empty and p.kind is not inspect.Parameter.VAR_POSITIONAL \
                    and p.name not in kwargs:
                raise UserError(f"--loss_scaler {name} needs --loss_scaler_args {p.name}=VALUE")
    try:
        return policy_class(**kwargs)
    except (TypeError, ValueError) as error:
        reason = " ".join(str(error).split())
        raise UserError(f"--loss_scaler_args: loss scaler {name} rejected them: {reason}") from None


def _import_plugin(spec: str, source: str) -> Any:
    if source.endswith(".py") or os.sep in source or "/" in source:
        path = os.path.abspath(os.path.expanduser(source))
        if not os.path.isfile(path):
            raise UserError(f"--loss_scaler {spec}: no such file {source}")
        # One module per file path: importing it again (a second run in this process) reuses it.
        module_name = "loss_scaler_plugin_" + hashlib.sha1(path.encode()).hexdigest()[:12]
        if module_name in sys.modules:
            return sys.modules[module_name]
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        if module_spec is None or module_spec.loader is None:
            raise UserError(f"--loss_scaler {spec}: {source} is not a Python file")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
        return module
    try:
        return importlib.import_module(source)
    except ModuleNotFoundError as error:
        if error.name and (source == error.name or source.startswith(error.name + ".")):
            raise UserError(f"--loss_scaler {spec}: no module named {error.name!r} (give module.path:Class "
                            f"importable from here, or path/to/file.py:Class)") from None
        raise

