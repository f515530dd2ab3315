"""Runs that heal themselves: forward overflows told from gradient overflows, bad samples
quarantined, divergence rewound to the last healthy point with a lower learning rate.

The contract is ``docs/healing.md``. Three parts, like the gradient guard's module:

* Options: :func:`add_arguments` (one definition of every flag), :data:`PRESET` (what
  ``--grad_guard_preset stable`` turns on), :func:`validate_arguments`.
* The decision core, pure Python: :class:`HealingPolicy` (stateful, ``state_dict`` /
  ``load_state_dict``). Once per optimizer step the trainer hands it the step's per-sample
  losses and gradient norm (:class:`StepOutcome`) and acts on the :class:`Verdict`. It never sees
  a tensor, a model or an optimizer.
* The measurement, torch: :class:`WindowSamples` collects each micro-batch's per-sample losses
  and input finiteness into one vector that is summed over processes in the window's one
  all-reduce and read in the step's one host sync (``GradientMonitor.measure``'s riders).

Per optimizer step the trainer does::

    verdict = policy.assess(outcome)            # after guard.decide, before the optimizer
    if verdict.train and not guard_skip: optimizer_step()
    if verdict.rewind: run_states.restore(healthy_point); scale learning rates; policy.rewound(...)
    elif policy.snapshot_due(step): capture; policy.mark_healthy(step)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch

from library import healthy_point
from library.errors import UserError

PRESET: dict[str, Any] = {"rewind_on_divergence": True, "quarantine_bad_samples": True, "nan_report": True}
"""What ``--grad_guard_preset stable`` adds (argparse dest -> value); flags given explicitly win."""

MAX_QUARANTINED_FRACTION = 0.5
"""A run that would quarantine more than this share of its images stops: the cause is not the images
(an fp16 VAE that overflows on most images, say) and training on what is left is not what was asked."""

STRIKES_TO_QUARANTINE = 2
"""Non-finite losses with finite inputs, while the rest of the step was finite, that quarantine an image."""

RECENT_NORMS = 10
"""Gradient norms kept for the NaN report."""

FAILED_END_STEPS = 10
"""A run whose last this many steps (or all its steps, when fewer) trained none failed: no "done"."""

STEP_KINDS = ("trained", "guard", "scaler", "loss", "gradient", "runaway")
"""How a step ended: the optimizer stepped, or the guard, the loss scaler, a non-finite loss, a
non-finite gradient without a scaler, or a runaway (rewound) kept it from stepping."""


# --------------------------------------------------------------------------- options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the self-healing flags (one argument group)."""
    group = parser.add_argument_group(
        "self-healing", "Rewind a diverging run, quarantine bad samples, explain the first NaN (docs/healing.md). "
                        "On in --grad_guard_preset stable.")
    add = group.add_argument
    add("--rewind_on_divergence", action=argparse.BooleanOptionalAction, default=False,
        help="when the run diverges (non-finite losses at --divergence_nan_steps consecutive steps, non-finite "
             "weights, or a loss / gradient-norm runaway), restore the last healthy point kept in memory, multiply "
             "the learning rate by --rewind_lr_factor and go on with the next batches. Default: off (on in the "
             "stable preset)")
    add("--rewind_every_n_steps", type=int, default=50, metavar="N",
        help="keep the run's state as the healthy point every N optimizer steps while the run is healthy (the "
             "initial state is the first one; one copy of the trained weights and optimizer state, where "
             "--healthy_point_location says). "
             "Default: 50")
    add("--healthy_point_location", choices=healthy_point.LOCATIONS, default="auto",
        help="where the healthy point is kept: memory (CPU memory), disk (one file per process in "
             "<output_dir>/<output_name>-healthy/, written atomically at each healthy point and removed when the "
             "run ends; a state saved meanwhile holds a hard link of it), or auto: memory while the point is at most "
             f"{healthy_point.MEMORY_SHARE * 100:.0f}%% of the available memory, else disk (a full fine-tune's weights and "
             "optimizer state; docs/full_fine_tuning.md says what a write costs). A rewind from either gives the "
             "same weights. Default: auto")
    add("--rewind_lr_factor", type=float, default=0.1, metavar="F",
        help="learning rate multiplier at each rewind, 0 < F < 1 (all groups and the schedule). Default: 0.1")
    add("--max_rewinds", type=int, default=8, metavar="N",
        help="rewinds allowed; the run that diverges once more stops, writes the last healthy weights as "
             "<output_name>-last_healthy.safetensors and exits with code 1. Default: 8")
    add("--divergence_nan_steps", type=int, default=2, metavar="N",
        help="consecutive optimizer steps whose every sample has a non-finite loss (with finite inputs) that "
             "count as divergence. Default: 2")
    add("--divergence_window", type=int, default=20, metavar="N",
        help="steps whose median loss and gradient norm are compared with those before the healthy point. "
             "Default: 20")
    add("--divergence_loss_ratio", type=float, default=3.0, metavar="R",
        help="a runaway: the median loss of the last --divergence_window steps above R times the median at the "
             "healthy point (0: off). Default: 3")
    add("--divergence_grad_ratio", type=float, default=20.0, metavar="R",
        help="a runaway: the median unscaled gradient norm of the last --divergence_window steps above R times "
             "the median at the healthy point, which the guard's window absorbs (0: off). Default: 20")
    add("--quarantine_bad_samples", action=argparse.BooleanOptionalAction, default=False,
        help="exclude an image for the rest of the run (and after resume) when its inputs (latents, frozen text "
             "encoder outputs) are non-finite, or its loss is non-finite twice while the rest of its step is "
             "finite; its step is skipped and one line names it. Default: off (on in the stable preset)")
    add("--nan_report", action=argparse.BooleanOptionalAction, default=False,
        help="the first non-finite loss and the first non-finite gradient write <output_name>-nan_report.txt "
             "into --output_dir: samples, their inputs, the first module whose output is non-finite (a re-run of "
             "the forward with hooks), loss scale, gradient norms, learning rate. Default: off (on in the stable "
             "preset)")
    parser.add_argument("--debug_inject_sample", type=str, nargs="*", default=None, help=argparse.SUPPRESS)


@dataclass(frozen=True)
class HealingConfig:
    """The self-healing options (field names are the argparse dests). Raises ``UserError`` when invalid."""

    rewind_on_divergence: bool = False
    rewind_every_n_steps: int = 50
    healthy_point_location: str = "auto"
    rewind_lr_factor: float = 0.1
    max_rewinds: int = 8
    divergence_nan_steps: int = 2
    divergence_window: int = 20
    divergence_loss_ratio: float = 3.0
    divergence_grad_ratio: float = 20.0
    quarantine_bad_samples: bool = False
    nan_report: bool = False
    # the VAE encodes every step in half precision (the one cause of NaN latents --no_half_vae fixes)
    half_precision_vae: bool = False

    def __post_init__(self) -> None:
        for name in ("rewind_every_n_steps", "divergence_nan_steps", "divergence_window"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise UserError(f"--{name} {getattr(self, name)} must be a whole number of optimizer steps >= 1")
        if not (isinstance(self.max_rewinds, int) and self.max_rewinds >= 0):
            raise UserError(f"--max_rewinds {self.max_rewinds} must be a whole number >= 0")
        if self.healthy_point_location not in healthy_point.LOCATIONS:
            raise UserError(f"--healthy_point_location {self.healthy_point_location}: expected one of "
                            f"{', '.join(healthy_point.LOCATIONS)}")
        if not 0 < self.rewind_lr_factor < 1:
            raise UserError(f"--rewind_lr_factor {self.rewind_lr_factor} must be between 0 and 1 (e.g. 0.1)")
        for name in ("divergence_loss_ratio", "divergence_grad_ratio"):
            value = getattr(self, name)
            if not (math.isfinite(value) and (value == 0 or value > 1)):
                raise UserError(f"--{name} {value} must be a number > 1 (0: off)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "HealingConfig":
        options = {item.name: getattr(args, item.name, item.default) for item in fields(cls)}
        options["half_precision_vae"] = (getattr(args, "mixed_precision", "no") != "no"
                                         and not getattr(args, "no_half_vae", False)
                                         and not getattr(args, "cache_latents", False))  # cached: checked up front
        return cls(**options)


REWIND_OPTIONS = ("rewind_every_n_steps", "rewind_lr_factor", "max_rewinds", "healthy_point_location")
"""Options that shape the rewinds only: given without rewinding, they would do nothing."""


def apply_preset(args: argparse.Namespace, explicit: set[str]) -> None:
    """``--grad_guard_preset stable`` turns the healing on; flags in ``explicit`` keep the user's value.
    Then refuses a rewind option the user gave (``explicit``) while rewinding stays off (as the EMA's
    options without ``--ema_decay``)."""
    if getattr(args, "grad_guard_preset", None) == "stable":
        for dest, value in PRESET.items():
            if dest not in explicit:
                setattr(args, dest, value)
    given = [dest for dest in REWIND_OPTIONS if dest in explicit]
    if given and not args.rewind_on_divergence:
        raise UserError(f"--{given[0]} shapes the rewinds of --rewind_on_divergence, which is off: add "
                        f"--rewind_on_divergence (or --grad_guard_preset stable), or remove --{given[0]}")


def validate_arguments(args: argparse.Namespace) -> None:
    """One line, exit 2, for a bad self-healing value (before anything loads)."""
    HealingConfig.from_args(args)
    parse_sample_injections(args.debug_inject_sample)


def parse_sample_injections(items: Optional[Sequence[str]]) -> dict[str, float]:
    """``--debug_inject_sample NAME=nan|inf`` (hidden, for tests): the image whose file name (or name
    without extension) is NAME gets that value in every latent element. ``{NAME: value}``."""
    values = {"nan": math.nan, "inf": math.inf}
    injections = {}
    for item in items or []:
        name, _, value = item.rpartition("=")
        if not name or value not in values:
            raise UserError(f"--debug_inject_sample {item}: expected NAME=nan or NAME=inf (NAME: an image file name)")
        injections[name] = values[value]
    return injections


def check_sample_injections(injections: Mapping[str, float], image_paths: Sequence[str]) -> None:
    """Every ``--debug_inject_sample`` NAME names an image of the training set (file name, with or without
    its extension): one that matches none would inject nothing, silently."""
    names = {os.path.basename(path) for path in image_paths}
    names |= {os.path.splitext(name)[0] for name in names}
    for name in injections:
        if name not in names:
            raise UserError(f"--debug_inject_sample {name}=...: no image of the training set is named {name} "
                            f"(give an image's file name, with or without its extension)")


# --------------------------------------------------------------------------- decision core


@dataclass(frozen=True)
class SampleOutcome:
    """One sample of a step: its ``image`` (index in the dataset plan), mean ``loss`` over its latent
    elements, whether its ``inputs_finite`` (latents, frozen text-encoder outputs), and whether it is
    ``padding`` (a weightless copy that evens out processes)."""

    sample_id: int
    image: int
    loss: float
    inputs_finite: bool
    padding: bool = False


@dataclass(frozen=True)
class StepOutcome:
    """What the trainer measured at optimizer step ``step`` (1-based): every sample of the window on
    every process, the window ``loss``, the ``grad_norm`` divided by the loss scale, and whether a
    loss scaler deals with non-finite gradients (``has_scaler``)."""

    step: int
    samples: tuple[SampleOutcome, ...]
    loss: float
    grad_norm: float
    has_scaler: bool = False


@dataclass(frozen=True)
class Quarantine:
    """An image excluded from training: at ``step``, ``reason``; ``certain``: its inputs were non-finite
    (a rewind lifts only the uncertain ones of the diverged span)."""

    image: int
    file: str
    caption: str
    step: int
    reason: str
    certain: bool


@dataclass(frozen=True)
class Rewind:
    """At ``step`` the run went back to the healthy point of ``to_step`` because of ``reason``; the
    learning rate is now ``lr_scale`` times the configured one; ``batches_skipped`` (per process) were
    trained after the healthy point and are not trained again."""

    step: int
    to_step: int
    reason: str
    lr_scale: float
    batches_skipped: int


@dataclass(frozen=True)
class Verdict:
    """What the trainer does with a step.

    ``train``: the optimizer may step (False: a non-finite loss, which no loss scale fixes, or
    without a loss scaler a non-finite gradient). ``problem``: why not, for the report and log.
    ``quarantined``: images quarantined at this step. ``rewind``: the reason to go back to the
    healthy point now (None: no rewind). ``stop``: rewinds are exhausted, or too many images are
    bad: the run stops (``stop_reason``). ``report``: this is the first non-finite loss, or the
    first non-finite gradient: write the NaN report (when on)."""

    train: bool = True
    problem: Optional[str] = None
    quarantined: tuple[Quarantine, ...] = ()
    rewind: Optional[str] = None
    stop: bool = False
    stop_reason: Optional[str] = None
    report: Optional[str] = None


HEALTHY = Verdict()


@dataclass
class _Restorable:
    """The part of the policy's state that a rewind puts back as it was at the healthy point."""

    nan_streak: int = 0
    strikes: dict[int, int] = field(default_factory=dict)
    recent_losses: list[float] = field(default_factory=list)
    recent_norms: list[float] = field(default_factory=list)
    reference: Optional[tuple[float, float]] = None  # median (loss, unscaled norm) at the healthy point


def step_kind(stepped: bool, guard_skipped: bool, verdict: Verdict) -> str:
    """How a step ended (:data:`STEP_KINDS`), in the order the causes act."""
    if stepped:
        return "trained"
    if guard_skipped:
        return "guard"
    if verdict.problem == "non-finite loss":
        return "loss"
    if verdict.problem and verdict.problem.startswith("non-finite gradient") and not verdict.train:
        return "gradient"
    if verdict.rewind or verdict.stop:
        return "runaway"
    return "scaler"


def report_note(verdict: Verdict, has_scaler: bool) -> str:
    """What the NaN report says happened to the step."""
    if verdict.problem == "non-finite loss":
        note = ("The loss itself is non-finite: the forward overflowed (or an input is non-finite), which no "
                "loss scale can fix. The step was skipped without touching the optimizer or the loss scale.")
    elif has_scaler:
        note = ("The loss is finite but a gradient overflowed in the backward: the loss scaler skips this step and "
                "lowers its scale (normal now and then in fp16).")
    else:
        note = "The loss is finite but a gradient is non-finite; without a loss scaler the step was skipped."
    if verdict.quarantined:
        note += " Quarantined: " + ", ".join(entry.file for entry in verdict.quarantined) + "."
    if verdict.rewind:
        note += f" The run rewinds to its healthy point ({verdict.rewind})."
    return note


class HealingPolicy:
    """The per-step decisions of ``docs/healing.md``.

    Invariants:
      * A step with a non-finite loss never trains (and never reaches the loss scaler); without
        a scaler a non-finite gradient never trains either.
      * ``quarantine`` only grows, except that a rewind lifts the uncertain quarantines made
        after the healthy point it returns to.
      * ``rewinds`` only grows; ``lr_scale`` (the last rewind's) is ``rewind_lr_factor ** len(rewinds)``.
      * The healthy point is marked only at steps that trained with finite losses, no divergence
        streak and no runaway; the initial state (``mark_healthy(start_step)``) is the first.
    """

    STATE_OPTIONAL = True  # a state written before self-healing existed resumes with a fresh policy

    def __init__(self, config: HealingConfig, num_images: int,
                 describe: Callable[[int], tuple[str, str]] = lambda image: (str(image), "")) -> None:
        """``num_images``: images in the training set; ``describe(image)`` -> (file, caption)."""
        self.config = config
        self.num_images = num_images
        self._describe = describe
        self.quarantine: list[Quarantine] = []
        self.rewinds: list[Rewind] = []
        self.nonfinite_loss_steps = 0  # steps not trained because a loss was non-finite
        self.nonfinite_grad_steps = 0  # steps not trained because, without a scaler, a gradient was non-finite
        self.reported: list[str] = []  # kinds of NaN report written ("loss", "gradient")
        self.counts: dict[str, int] = {kind: 0 for kind in STEP_KINDS}  # every step of the run, by how it ended
        self.last_kinds: deque[str] = deque(maxlen=FAILED_END_STEPS)
        self.recent_norms: deque[float] = deque(maxlen=RECENT_NORMS)
        self.now = _Restorable()
        self.healthy_step: Optional[int] = None
        self.healthy: Optional[_Restorable] = None
        self.healthy_lr_scale = 1.0

    # -- what the trainer asks
    @property
    def quarantined_images(self) -> frozenset[int]:
        return frozenset(entry.image for entry in self.quarantine)

    def snapshot_due(self, step: int, trained: bool) -> bool:
        """Whether the state after ``step`` is the new healthy point: ``--rewind_every_n_steps`` steps after
        the last one, at the first step that trained with nothing amiss."""
        return (self.config.rewind_on_divergence and self.healthy_step is not None
                and step - self.healthy_step >= self.config.rewind_every_n_steps and trained
                and self.now.nan_streak == 0 and self._runaway() is None)

    # -- the step
    def assess(self, outcome: StepOutcome) -> Verdict:
        """Classify one optimizer step (see the module docstring); updates the policy's counters."""
        self.recent_norms.append(outcome.grad_norm)
        losses_finite = all(math.isfinite(sample.loss) for sample in outcome.samples) and math.isfinite(outcome.loss)
        if losses_finite:
            self.now.nan_streak = 0
            self._record(outcome.loss, outcome.grad_norm)
            if math.isfinite(outcome.grad_norm):
                runaway = self._runaway() if self.config.rewind_on_divergence else None
                return self._diverged(runaway) if runaway is not None else HEALTHY
            report = self._first("gradient")
            if outcome.has_scaler:  # the scaler's business: it skips the step and lowers its scale
                return Verdict(report=report, problem="non-finite gradient") if report else HEALTHY
            self.nonfinite_grad_steps += 1
            return Verdict(train=False, problem="non-finite gradient (no loss scaler)", report=report)
        return self._nonfinite_loss(outcome)

    def _nonfinite_loss(self, outcome: StepOutcome) -> Verdict:
        self.nonfinite_loss_steps += 1
        report = self._first("loss")
        real = [sample for sample in outcome.samples if not sample.padding]
        bad_inputs = [s for s in outcome.samples if not math.isfinite(s.loss) and not s.inputs_finite]
        bad_loss = [s for s in outcome.samples if not math.isfinite(s.loss) and s.inputs_finite]
        finite = [s for s in real if math.isfinite(s.loss)]
        quarantined: list[Quarantine] = []
        if self.config.quarantine_bad_samples:
            for sample in bad_inputs:
                quarantined += self._quarantine(sample.image, outcome.step, "its inputs are non-finite", True)
            if finite:
                for sample in bad_loss:
                    strikes = self.now.strikes.get(sample.image, 0) + 1
                    self.now.strikes[sample.image] = strikes
                    if strikes >= STRIKES_TO_QUARANTINE:
                        quarantined += self._quarantine(
                            sample.image, outcome.step,
                            f"its loss was non-finite {strikes} times while the rest of its step was finite", False)
        verdict = Verdict(train=False, problem="non-finite loss", quarantined=tuple(quarantined), report=report)
        if len(self.quarantine) > MAX_QUARANTINED_FRACTION * self.num_images:
            return replace(verdict, stop=True, stop_reason=(
                f"{len(self.quarantine)} of {self.num_images} images quarantined: more than "
                f"{MAX_QUARANTINED_FRACTION:.0%} of the data is bad, so the images are not the cause"
                + self._bad_inputs_advice()))
        if bad_loss and not finite:  # every sample of the step: the model, not one sample
            self.now.nan_streak += 1
            if self.now.nan_streak >= self.config.divergence_nan_steps:
                return self._diverged(f"non-finite loss at {self.now.nan_streak} consecutive steps", verdict)
        return verdict

    def _bad_inputs_advice(self) -> str:
        """What the stop line adds when images were quarantined for non-finite inputs: --no_half_vae only
        where the VAE runs in half precision (on a float32 one it changes nothing)."""
        if not any(entry.certain for entry in self.quarantine):
            return ""
        if self.config.half_precision_vae:
            return " (non-finite latents on most images: a half-precision VAE overflows, try --no_half_vae)"
        return (" (non-finite inputs on most images, with the VAE in float32: check the images and the text "
                "encoder outputs; the quarantine lines above name the files)")

    def weights_diverged(self, verdict: Verdict) -> Verdict:
        """The trainer found non-finite weights (it checks only after a non-finite loss)."""
        return self._diverged("non-finite weights", verdict)

    def _diverged(self, reason: str, verdict: Verdict = HEALTHY) -> Verdict:
        """A rewind (or, with the rewinds used up, a stop) when rewinding is on; else ``verdict``."""
        if not self.config.rewind_on_divergence or self.healthy_step is None:
            return verdict
        if len(self.rewinds) >= self.config.max_rewinds:
            return replace(verdict, train=False, stop=True,
                           stop_reason=f"{reason}, and --max_rewinds {self.config.max_rewinds} rewinds are used up")
        return replace(verdict, train=False, rewind=reason)

    def rewound(self, step: int, reason: str, batches_skipped: int) -> Rewind:
        """The trainer restored the healthy point at ``step``: lower the learning rate, put the
        restorable state back and lift the uncertain quarantines of the diverged span."""
        event = Rewind(step, self.healthy_step, reason, self.lr_scale * self.config.rewind_lr_factor, batches_skipped)
        self.rewinds.append(event)
        self.now = _copy(self.healthy)
        self.last_kinds.clear()
        self.quarantine = [entry for entry in self.quarantine if entry.certain or entry.step <= self.healthy_step]
        return event

    @property
    def lr_scale(self) -> float:
        """The learning rates' multiplier now: the last rewind's (1 before any)."""
        return self.rewinds[-1].lr_scale if self.rewinds else 1.0

    @property
    def lr_multiplier(self) -> float:
        """What the learning rates restored from the healthy point are multiplied by after a rewind."""
        return self.lr_scale / self.healthy_lr_scale

    def mark_healthy(self, step: int) -> None:
        """The state after ``step`` was captured as the healthy point. Its medians become the
        runaway reference once ``--divergence_window`` steps are known."""
        if len(self.now.recent_losses) >= self.config.divergence_window:
            self.now.reference = (statistics.median(self.now.recent_losses),
                                  statistics.median(self.now.recent_norms))
        self.healthy_step = step
        self.healthy = _copy(self.now)
        self.healthy_lr_scale = self.lr_scale

    # -- helpers
    def _record(self, loss: float, norm: float) -> None:
        """Keep the last ``--divergence_window`` finite (loss, norm) pairs."""
        if not math.isfinite(norm):
            return
        window, now = self.config.divergence_window, self.now
        now.recent_losses = (now.recent_losses + [loss])[-window:]
        now.recent_norms = (now.recent_norms + [norm])[-window:]
        if now.reference is None and len(now.recent_losses) == window and self.healthy is not None:
            # the first healthy point (the initial state) has no steps before it: its reference is
            # the first window after it, for the healthy point too (a rewind to it keeps it)
            now.reference = (statistics.median(now.recent_losses), statistics.median(now.recent_norms))
            if self.healthy.reference is None:
                self.healthy.reference = now.reference

    def _runaway(self) -> Optional[str]:
        """Why the last window ran away from the healthy point's medians, or None. Right after a healthy
        point the window is the reference's own, so the ratios start at 1."""
        now, config = self.now, self.config
        if now.reference is None or len(now.recent_losses) < config.divergence_window:
            return None
        reference_loss, reference_norm = now.reference
        loss, norm = statistics.median(now.recent_losses), statistics.median(now.recent_norms)
        if config.divergence_loss_ratio and reference_loss > 0 and loss > config.divergence_loss_ratio * reference_loss:
            return (f"loss runaway: median loss of the last {config.divergence_window} steps {loss:.4g} is "
                    f"{loss / reference_loss:.1f}x the {reference_loss:.4g} at the healthy point")
        if config.divergence_grad_ratio and reference_norm > 0 and norm > config.divergence_grad_ratio * reference_norm:
            return (f"gradient-norm runaway: median of the last {config.divergence_window} steps {norm:.4g} is "
                    f"{norm / reference_norm:.1f}x the {reference_norm:.4g} at the healthy point")
        return None

    def _quarantine(self, image: int, step: int, reason: str, certain: bool) -> list[Quarantine]:
        if image in self.quarantined_images:
            return []
        file, caption = self._describe(image)
        entry = Quarantine(image, file, caption, step, reason, certain)
        self.quarantine.append(entry)
        self.now.strikes.pop(image, None)
        return [entry]

    def _first(self, kind: str) -> Optional[str]:
        if kind in self.reported:
            return None
        self.reported.append(kind)
        return kind

    def conclude(self, verdict: Verdict, kind: str) -> Verdict:
        """Count the step by how it ended (one of :data:`STEP_KINDS`); a run in which no step trained
        for :data:`FAILED_END_STEPS` steps (the guard or the scaler skipping them all) is stuck: that
        is a divergence too. Returns the verdict the trainer acts on."""
        self.counts[kind] += 1
        self.last_kinds.append(kind)
        if verdict.rewind or verdict.stop or len(self.last_kinds) < FAILED_END_STEPS or "trained" in self.last_kinds:
            return verdict
        return self._diverged(f"no step trained in the last {FAILED_END_STEPS} ({self._skip_reasons()})", verdict)

    # -- the run's account
    def failure_at_end(self) -> Optional[str]:
        """Why the run failed, else None: its last :data:`FAILED_END_STEPS` steps (all, when fewer)
        trained none, or its last ``--divergence_nan_steps`` steps had non-finite losses on every
        sample (the final weights overflow the forward)."""
        hint = "" if self.config.rewind_on_divergence else (
            "; --rewind_on_divergence (in --grad_guard_preset stable) rewinds such a run and lowers its learning rate")
        if self.now.nan_streak >= self.config.divergence_nan_steps:
            return (f"the last {self.now.nan_streak} steps had a non-finite loss on every sample: the final weights "
                    f"overflow the forward{hint}")
        if not self.last_kinds or "trained" in self.last_kinds:
            return None
        return f"none of the last {len(self.last_kinds)} steps trained ({self._skip_reasons()}){hint}"

    def _skip_reasons(self) -> str:
        """What kept the last steps from training, e.g. ``guard 6, scaler 4``."""
        return ", ".join(f"{kind} {self.last_kinds.count(kind)}" for kind in STEP_KINDS[1:] if kind in self.last_kinds)

    def summary(self, steps: int, average_loss: float, average_over: int,
                learning_rates: Sequence[Optional[float]]) -> str:
        """The end-of-run line: steps, what kept steps from training, quarantines, rewinds, the average loss."""
        counts = self.counts
        line = (f"{steps} steps, {counts['trained']} trained; skipped: guard {counts['guard']}, loss scaler "
                f"{counts['scaler']}, non-finite loss {counts['loss']}, non-finite gradient {counts['gradient']}; "
                f"quarantined samples {len(self.quarantine)}; rewinds {len(self.rewinds)}")
        if self.rewinds:
            line += f" (learning rate now {describe_rates(learning_rates)}, x{self.lr_scale:g})"
        if average_over:
            shown = f"{average_loss:.4f}" if abs(average_loss) >= 0.01 else f"{average_loss:.4g}"  # LECO's: ~1e-6
            line += f"; final average loss {shown} over the last {average_over} steps"
        else:
            line += "; no finite loss to average"
        return line

    # -- state
    def state_dict(self) -> dict[str, Any]:
        """Plain, JSON-able state (non-finite floats as strings)."""
        return {
            "quarantine": [asdict(entry) for entry in self.quarantine],
            "rewinds": [asdict(event) for event in self.rewinds],
            "lr_scale": self.lr_scale,
            "nonfinite_loss_steps": self.nonfinite_loss_steps,
            "nonfinite_grad_steps": self.nonfinite_grad_steps,
            "reported": list(self.reported),
            "counts": dict(self.counts),
            "last_kinds": list(self.last_kinds),
            "recent_norms": [_json_float(value) for value in self.recent_norms],
            "now": _restorable_state(self.now),
            "healthy_step": self.healthy_step,
            "healthy": _restorable_state(self.healthy) if self.healthy is not None else None,
            "healthy_lr_scale": self.healthy_lr_scale,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.quarantine = [Quarantine(**entry) for entry in state["quarantine"]]
        self.rewinds = [Rewind(**event) for event in state["rewinds"]]
        self.nonfinite_loss_steps = int(state["nonfinite_loss_steps"])
        self.nonfinite_grad_steps = int(state["nonfinite_grad_steps"])
        self.reported = list(state["reported"])
        self.counts = {kind: int(state["counts"].get(kind, 0)) for kind in STEP_KINDS}
        self.last_kinds = deque(state["last_kinds"], maxlen=FAILED_END_STEPS)
        self.recent_norms = deque((float(value) for value in state["recent_norms"]), maxlen=RECENT_NORMS)
        self.now = _restorable_from(state["now"])
        self.healthy_step = state["healthy_step"]
        self.healthy = _restorable_from(state["healthy"]) if state["healthy"] is not None else None
        self.healthy_lr_scale = float(state["healthy_lr_scale"])

    # -- what the run reports
    def metadata(self) -> dict[str, str]:
        """LoRA metadata: ``ss_rewinds`` and ``ss_quarantined_samples`` (JSON), only when there are any,
        so a healthy run's files are what they were without the policy."""
        metadata = {}
        if self.rewinds:
            metadata["ss_rewinds"] = json.dumps([asdict(event) for event in self.rewinds])
        if self.quarantine:
            metadata["ss_quarantined_samples"] = json.dumps(
                [{"file": q.file, "caption": q.caption, "step": q.step, "reason": q.reason} for q in self.quarantine])
        return metadata


def _json_float(value: float) -> Any:
    return value if math.isfinite(value) else repr(value)


def _copy(restorable: _Restorable) -> _Restorable:
    return _restorable_from(_restorable_state(restorable))


def _restorable_state(restorable: _Restorable) -> dict[str, Any]:
    state = asdict(restorable)
    state["strikes"] = {str(image): count for image, count in restorable.strikes.items()}
    return state


def _restorable_from(state: Mapping[str, Any]) -> _Restorable:
    values = dict(state)
    values["strikes"] = {int(image): int(count) for image, count in values["strikes"].items()}
    values["recent_losses"] = [float(value) for value in values["recent_losses"]]
    values["recent_norms"] = [float(value) for value in values["recent_norms"]]
    values["reference"] = tuple(values["reference"]) if values["reference"] is not None else None
    return _Restorable(**values)


# --------------------------------------------------------------------------- measurement


SLOT_VALUES = 4
"""Per sample slot of the window vector: present (1 sample, 2 padding, 0 empty), sample id, loss, inputs finite."""


class WindowSamples:
    """Per-sample losses and input finiteness of one accumulation window, as one flat vector.

    The vector is ``[window loss sum, slots of process 0, slots of process 1, ...]`` with
    ``accumulation_steps * max_batch_size`` slots per process; each process fills its own slots and
    the trainer sums the vector over processes (the window's existing all-reduce), so every process
    reads every sample of the step from the one host sync that reads the gradient norm.
    """

    def __init__(self, rank: int, world_size: int, accumulation_steps: int, max_batch_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.slots = accumulation_steps * max_batch_size
        self._rows: list[torch.Tensor] = []
        self.reduced: Optional[torch.Tensor] = None  # the vector summed over processes (set by the trainer)

    def add(self, sample_indices: torch.Tensor, per_sample_loss: torch.Tensor,
            inputs_finite: Optional[torch.Tensor], padding: bool) -> None:
        """One micro-batch: sample ids (B,), its per-sample losses (B,) and input finiteness (B,) or None."""
        present = torch.full_like(per_sample_loss, 2.0 if padding else 1.0)
        finite = (inputs_finite.to(per_sample_loss.dtype) if inputs_finite is not None
                  else torch.ones_like(per_sample_loss))
        ids = sample_indices.to(device=per_sample_loss.device, dtype=per_sample_loss.dtype)
        self._rows.append(torch.stack([present, ids, per_sample_loss.detach().float(), finite], dim=1))

    def vector(self, window_loss_sum: torch.Tensor) -> torch.Tensor:
        """This process's vector (zeros in the other processes' slots), fp32 on the loss's device."""
        device = window_loss_sum.device
        block = torch.zeros(self.world_size, self.slots, SLOT_VALUES, dtype=torch.float32, device=device)
        if self._rows:
            rows = torch.cat(self._rows)
            block[self.rank, :rows.shape[0]] = rows
        return torch.cat([window_loss_sum.detach().reshape(1).float(), block.reshape(-1)])

    @staticmethod
    def outcomes(values: Sequence[float], image_of: Callable[[int], int]) -> tuple[SampleOutcome, ...]:
        """The samples in a summed vector read back as floats (the window loss sum first, skipped)."""
        samples = []
        for offset in range(1, len(values), SLOT_VALUES):
            present, sample_id, loss, finite = values[offset:offset + SLOT_VALUES]
            if present:
                sample_id = int(sample_id)
                samples.append(SampleOutcome(sample_id, image_of(sample_id), loss, finite == 1.0, present == 2.0))
        return tuple(samples)


def inputs_finite(*tensors: Any) -> torch.Tensor:
    """Per sample (dim 0) whether every element of every given tensor (or tuple of tensors) is finite."""
    flat = [tensor for item in tensors for tensor in (item if isinstance(item, (tuple, list)) else (item,))]
    checks = [torch.isfinite(tensor).flatten(1).all(dim=1) for tensor in flat]
    return torch.stack(checks).all(dim=0)


def scale_learning_rates(optimizer: torch.optim.Optimizer, scheduler: Any, factor: float) -> bool:
    """Multiply every group's learning rate and the schedule's base rates by ``factor``; False when the
    optimizer sets its own step size (Adafactor with relative_step: no ``lr`` to scale)."""
    if any(group.get("lr") is None for group in optimizer.param_groups):
        return False
    for group in optimizer.param_groups:
        group["lr"] *= factor
        if "initial_lr" in group:
            group["initial_lr"] *= factor
    for name in ("base_lrs", "_last_lr"):
        values = getattr(scheduler, name, None)
        if isinstance(values, list):
            setattr(scheduler, name, [value * factor for value in values])
    return True


def learning_rates(optimizer: torch.optim.Optimizer) -> list[Optional[float]]:
    return [group.get("lr") for group in optimizer.param_groups]


def describe_rates(rates: Iterable[Optional[float]]) -> str:
    distinct = list(dict.fromkeys(rates))
    return ", ".join("set by the optimizer" if rate is None else f"{rate:.4g}" for rate in distinct)
