"""What the LoRA does to the model: the effect monitor and the "this LoRA does nothing" warning.

At every validation (docs/know_your_lora.md) the monitor logs

* ``effect/output_rel``: ``||UNet_lora(x) - UNet_base(x)|| / ||UNet_base(x)||`` over the validation
  pass (its fixed timesteps and noise). The base is the same UNet with the network's multiplier 0
  (the adapters then add exactly 0); its outputs and losses are computed once, in one extra
  validation pass at the first validation, and kept (on the CPU).
* ``effect/val_rel``: the validation loss relative to the base model's, and ``effect/val_rel_t<T>``
  at each fixed timestep T (below 1: the LoRA predicts the held-out images better than the base).
* ``effect/weight_rel_median`` / ``effect/weight_rel_max``: ``||delta W||_F / ||W||_F`` over the
  adapted modules. For a LoRA, ``||up @ down||_F`` comes from two rank x rank Gram matrices
  (``sqrt(sum((U^T U) * (D D^T)))``), without forming delta W; types with a ``delta_weight()``
  (LoHa, LoKr) use it; others (every LyCORIS algo included) the merged weight minus the base
  (``network.frozen_weight``), in float32 whatever the base weight's dtype. A module whose type
  cannot give it is left out with one line; the monitor never stops training.

Without a validation split the output and loss figures come from a fixed probe of training images
(:class:`TrainingProbe`: ``effect/probe_rel`` instead of ``effect/val_rel``) at the check steps.

The weight ratios need no forward pass, so they are also what the "does nothing" check reads, with
or without validation, at step ``min(50, ceil(max_train_steps / 4))`` and its multiples (logged
there, with the probe's figures), until it warned once: when the median ratio is below ``DOES_NOTHING_FLOOR`` (1e-6) the
warning names the likely cause from what the run knows: every step skipped by the gradient guard,
or by the loss scaler; weights that received no update at all though steps were taken (the LoRA is
not in the model's forward, or the trained part's gradient does not reach it); otherwise a
learning rate too low. A later check also warns when the guard skipped every step since the
previous one (the LoRA stopped learning), and the first check warns ahead when every gradient norm
so far is above ``--skip_grad_norm_max``, which the guard applies from its 200th norm on (then it
skips every step). Measured values: docs/know_your_lora.md.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
from tqdm import tqdm

from library import grad_guard, validation


DOES_NOTHING_FLOOR = 1e-6  # median ||delta W|| / ||W|| below this: the LoRA does nothing (docs/know_your_lora.md)
CHECK_STEP_CAP = 50  # the "does nothing" check happens by this step at the latest
PROBE_BATCHES = 1  # training batches of the probe without a validation split (its cost: docs/know_your_lora.md)


LATER_CHECK_EVERY = 100  # runs of 200+ steps: after the check at step 50, one every 100 steps (its cost: docs)


def check_step(max_train_steps: int) -> int:
    """The step of the "does nothing" check: a quarter of the run, at most step 50."""
    return max(1, min(CHECK_STEP_CAP, math.ceil(max_train_steps / 4)))


def is_check(step: int, first: int) -> bool:
    """Whether ``step`` is a check step, the first being ``first`` (``check_step``): its multiples, or, once
    ``first`` is the cap (runs of 200+ steps), every ``LATER_CHECK_EVERY`` steps after it: a check costs
    about 1.5 training steps without a validation split (the probe's 4 no-grad UNet forwards; its batch is
    encoded once); one per 50 steps is 3.1% of a step on the tiny SDXL (benchmarks/bench_know_your_lora.py,
    docs/know_your_lora.md), over the 3% target."""
    every = LATER_CHECK_EVERY if first == CHECK_STEP_CAP else first
    return step == first or step % every == 0


def module_delta_norm(network: Any, lora: torch.nn.Module) -> torch.Tensor:
    """``||delta W||_F`` of one adapter module at multiplier 1, float32, 0-dim, whatever the dtypes of the
    base weight (fp16, bf16, float8) and of the module: a LoRA's from its factors, a ``delta_weight()``
    (kohya's LoHa, LoKr), else the merged weight minus the base, both in ``merge_dtype`` (float32; its
    rounding, ~6e-8 of ||W||, is far below ``DOES_NOTHING_FLOOR``)."""
    factors = network.max_norm_weights(lora)
    if factors is not None and hasattr(lora, "alpha"):  # delta W = up @ down * alpha / rank
        up, down = factors
        rank = down.shape[0]
        up, down = up.reshape(-1, rank).float(), down.reshape(rank, -1).float()
        squared = ((up.mT @ up) * (down @ down.mT)).sum().clamp(min=0)
        return squared.sqrt() * (lora.alpha.float().abs() / rank)
    if hasattr(lora, "delta_weight"):
        return torch.linalg.vector_norm(lora.delta_weight().float())
    merged = network.merged_parameters(lora, 1.0)["weight"]
    return torch.linalg.vector_norm(merged.float() - network.frozen_weight(lora, merged.dtype).float())


class EffectMonitor:
    """The effect scalars of a run and its one "does nothing" check."""

    def __init__(self, args: argparse.Namespace, network: Any, is_main_process: bool) -> None:
        self.args = args
        self.network = network
        self.is_main_process = is_main_process
        self.check_at = check_step(args.max_train_steps)
        self.warning: Optional[str] = None
        self._last_check = (0, 0)  # (step, guard skips) at the previous check
        self._measured: Optional[list[torch.nn.Module]] = None  # the modules whose weight change is measured
        self._base_norms: Optional[torch.Tensor] = None  # their ||W||
        self.skipped_modules = 0  # modules left out (their type cannot give the weight change)
        self.probe: Optional[TrainingProbe] = None  # without a validation split: the fixed training probe
        self._base_outputs: Optional[list[torch.Tensor]] = None
        self._base_loss: Optional[tuple[float, dict[int, float]]] = None

    # -- weights ------------------------------------------------------------------------
    @torch.no_grad()
    def weight_ratios(self) -> torch.Tensor:
        """``||delta W|| / ||W||`` of every adapter module that can give it (float32, on the CPU). A module
        whose type cannot (an error computing it) is left out, with one line naming it and why, and the
        run goes on: the monitor never stops training."""
        if self._measured is None:  # the wrapped weights are frozen: their norms once
            self._measured, norms = [], []
            for lora in self.network.all_loras():
                norm = self._measure(lora, lambda: torch.linalg.vector_norm(
                    self.network.frozen_weight(lora, torch.float32)))
                if norm is not None:
                    self._measured.append(lora)
                    norms.append(norm.cpu())
            self._base_norms = torch.stack(norms) if norms else torch.zeros(0)
        keep, deltas = [], []
        for index, lora in enumerate(self._measured):
            delta = self._measure(lora, lambda: module_delta_norm(self.network, lora))
            if delta is not None:
                keep.append(index)
                deltas.append(delta.cpu())
        if len(keep) < len(self._measured):  # the skipped ones stay out from now on
            self._measured = [self._measured[index] for index in keep]
            self._base_norms = self._base_norms[keep]
        if not deltas:
            return torch.zeros(0)
        return torch.stack(deltas) / self._base_norms.clamp(min=torch.finfo(torch.float32).tiny)

    def _measure(self, lora: torch.nn.Module, compute: Callable[[], torch.Tensor]) -> Optional[torch.Tensor]:
        """``compute()`` as a float32 0-dim tensor, or None (with one line) when this module's type cannot."""
        try:
            return compute().float().reshape(())
        except (RuntimeError, AttributeError, TypeError, ValueError, NotImplementedError) as error:
            self.skipped_modules += 1
            if self.skipped_modules == 1 and self.is_main_process:
                tqdm.write(f"effect monitor: the weight change of {lora.lora_name} ({type(lora).__name__}) cannot be "
                           f"measured ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
                           f"such modules are left out of effect/weight_rel_*")
            return None

    def weight_scalars(self) -> dict[str, float]:
        ratios = self.weight_ratios()
        if not len(ratios):
            return {}
        return {"effect/weight_rel_median": ratios.median().item(), "effect/weight_rel_max": ratios.max().item()}

    # -- the "does nothing" check ------------------------------------------------------------
    def check(self, step: int, *, guard_skipped: int, scaler_skipped: int, learning_rates: list[float],
              guard_window: Sequence[float] = ()) -> dict[str, float]:
        """At the check step and its multiples: the weight scalars and, without a validation split, the
        training probe's (logged with the step's); until one warned, the warning line (printed once,
        kept in ``warning``) when the LoRA does nothing, or when the guard skipped every step since the
        previous check (the LoRA stopped learning), or when the guard will skip every step once its
        window is full (``guard_window``: its norms now). Every process calls it (the probe reduces)."""
        if not is_check(step, self.check_at):
            return {}
        scalars = self.probe_scalars() if self.probe is not None else {}
        ratios = self.weight_ratios()
        if not len(ratios):  # no module's weight change can be measured (a line said why): no check
            return scalars
        median = ratios.median().item()
        scalars.update({"effect/weight_rel_median": median, "effect/weight_rel_max": ratios.max().item()})
        if self.warning is not None:
            return scalars
        since_step, since_skipped = self._last_check
        self._last_check = (step, guard_skipped)
        if median < DOES_NOTHING_FLOOR:
            self.warning = (f"warning: this LoRA does nothing after {step} steps (median weight change "
                            f"||delta W||/||W|| {median:.3g}, below {DOES_NOTHING_FLOOR:g}): "
                            + self.likely_cause(step, ratios, guard_skipped, scaler_skipped, learning_rates))
        elif guard_skipped - since_skipped >= step - since_step:
            self.warning = (f"warning: this LoRA stopped learning: the gradient guard skipped every step from step "
                            f"{since_step + 1} to {step}" + self.guard_limit())
        else:
            self.warning = self.guard_forecast(step, guard_window)
        if self.warning is not None and self.is_main_process:
            tqdm.write(self.warning)
        return scalars

    def guard_forecast(self, step: int, window: Sequence[float]) -> Optional[str]:
        """The warning when the guard will skip every step from the step its window fills: every norm so
        far is above ``--skip_grad_norm_max``, which (kohya's fork's rule, docs/grad_guard_spec.md) acts
        only from then on; its threshold is then at most the cap, and the skipped steps change nothing,
        so the norms stay above it. None otherwise."""
        cap = getattr(self.args, "skip_grad_norm_max", None)
        if not getattr(self.args, "skip_grad_norm", False) or cap is None or not window \
                or len(window) >= grad_guard.WINDOW_SIZE or min(window) <= cap:
            return None
        return (f"warning: this LoRA will stop learning from about step {step + grad_guard.WINDOW_SIZE - len(window)}: "
                f"every gradient norm so far ({len(window)}, the smallest {min(window):.3g}) is above "
                f"--skip_grad_norm_max {cap:g}, which the gradient guard applies once its window holds "
                f"{grad_guard.WINDOW_SIZE} norms; it will then skip every step. Raise --skip_grad_norm_max above "
                f"the norms (see --grad_norm_log) or leave it out")

    def guard_limit(self) -> str:
        cap = getattr(self.args, "skip_grad_norm_max", None)
        return (f"; its limit --skip_grad_norm_max {cap:g} is below this run's gradient norms (see the gradient "
                f"log)" if cap is not None else "; see the gradient log for the norms")

    def likely_cause(self, step: int, ratios: torch.Tensor, guard_skipped: int, scaler_skipped: int,
                     learning_rates: list[float]) -> str:
        """The likeliest reason, from what the run knows (most specific first)."""
        if guard_skipped >= step:
            return f"the gradient guard skipped every step ({guard_skipped} of {step})" + self.guard_limit()
        if scaler_skipped >= step:
            return f"the fp16 loss scaler skipped every step ({scaler_skipped} of {step}): the gradients overflow"
        if ratios.max().item() == 0.0 and self.network_starts_at_zero():
            return ("no adapter weight changed although steps were taken: the LoRA gets no gradient (it is not "
                    "in the model's forward, e.g. a text encoder LoRA with cached text encoder outputs, or a part "
                    "trained at learning rate 0)")
        rates = ", ".join(f"{lr:.3g}" for lr in learning_rates)
        return (f"the learning rate is too low (now {rates}); raise --learning_rate/--unet_lr (--find_lr suggests "
                f"a range) or check the scheduler's warm-up")

    def network_starts_at_zero(self) -> bool:
        """Whether every adapter would start with delta W = 0 (a fresh LoRA; a loaded one did not)."""
        return not self.args.network_weights

    # -- at every validation -------------------------------------------------------------
    @contextlib.contextmanager
    def capturing(self, unet: torch.nn.Module, outputs: list[torch.Tensor]) -> Iterator[None]:
        """Collects the UNet's outputs (CPU float32) of the enclosed validation pass into ``outputs``."""
        def keep(_module, _inputs, output):
            sample = output.sample if hasattr(output, "sample") else output[0] if isinstance(output, tuple) else output
            outputs.append(sample.detach().float().cpu())

        handle = unet.register_forward_hook(keep)
        try:
            yield
        finally:
            handle.remove()

    def pass_scalars(self, kind: str, unet: torch.nn.Module, rerun: Callable[[], tuple[float, dict[int, float]]],
                     value: float, per_timestep: dict[int, float], outputs: list[torch.Tensor],
                     reduce: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """The effect scalars of a pass (``kind``: "val" for a validation pass, "probe" for the training
        probe's; ``value``, ``per_timestep``, the UNet ``outputs`` captured during it); ``rerun()`` repeats
        the pass (the base pass, at the first call); ``reduce`` sums a tensor over processes."""
        if self._base_outputs is None:
            multiplier = self.network.multiplier
            self._base_outputs = []
            self.network.set_multiplier(0.0)
            try:
                with self.capturing(unet, self._base_outputs):
                    self._base_loss = rerun()
            finally:
                self.network.set_multiplier(multiplier)
        base_value, base_per_timestep = self._base_loss
        difference = sum((float((lora - base).double().square().sum()) for lora, base in
                          zip(outputs, self._base_outputs)), 0.0)
        size = sum((float(base.double().square().sum()) for base in self._base_outputs), 0.0)
        difference, size = reduce(torch.tensor([difference, size], dtype=torch.float64)).tolist()
        scalars = {"effect/output_rel": math.sqrt(difference / size) if size else float("nan"),
                   f"effect/{kind}_rel": value / base_value if base_value else float("nan")}
        for timestep, loss in per_timestep.items():
            base = base_per_timestep.get(timestep)
            scalars[f"effect/{kind}_rel_t{timestep}"] = loss / base if base else float("nan")
        weights = self.weight_scalars()
        scalars.update(weights)
        if self.is_main_process:
            name = "validation loss" if kind == "val" else "loss on the training probe"
            tqdm.write(f"effect: output {scalars['effect/output_rel']:.4g} of the base's, {name} "
                       f"{scalars[f'effect/{kind}_rel']:.4f} x the base's"
                       + (f", weight change median {weights['effect/weight_rel_median']:.3g} max "
                          f"{weights['effect/weight_rel_max']:.3g}" if weights else ""))
        return scalars

    def probe_scalars(self) -> dict[str, float]:
        """The effect scalars on the training probe (``probe``, set when there is no validation split)."""
        probe = self.probe
        outputs: list[torch.Tensor] = []
        with self.capturing(probe.unet, outputs):
            value, per_timestep = probe.losses(self.network)
        return self.pass_scalars("probe", probe.unet, lambda: probe.losses(self.network), value, per_timestep,
                                 outputs, probe.reduce)

    def validation_pass(self, unet: torch.nn.Module, validator: Any, kind: str, run_pass: Callable[[], dict[str, float]],
                        batch_loss: Any, accelerator: Any) -> dict[str, float]:
        """``run_pass()`` (the validation's own pass and scalars) with the UNet outputs captured, and the
        effect scalars added (the base pass at the first call)."""
        outputs: list[torch.Tensor] = []
        with self.capturing(unet, outputs):
            scalars = run_pass()
        device = accelerator.device
        scalars.update(self.pass_scalars(
            "val", unet, lambda: validator.losses(self.network, batch_loss), scalars[f"loss/validation/{kind}_average"],
            validator.last_per_timestep, outputs, lambda tensor: accelerator.reduce(tensor.to(device), "sum").cpu()))
        return scalars


@dataclass
class TrainingProbe:
    """Without a validation split, what the monitor measures the effect on: the first ``PROBE_BATCHES``
    training batches of epoch 1 (the same on a resumed run), at kohya's fixed validation timesteps with
    validation's keyed noise (``library/validation.py``): like a validation pass, it moves only with the
    weights and draws from no training random stream. The batches are encoded once, at the first check
    (``library/fixed_batches.py``)."""

    batches: Iterable[dict[str, Any]]  # encoded once (library/fixed_batches.py)
    timesteps: list[int]
    seed: int
    unet: torch.nn.Module
    batch_loss: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    accelerator: Any

    def losses(self, network: torch.nn.Module) -> tuple[float, dict[int, float]]:
        return validation.pass_losses(self.batches, network, self.batch_loss, self.timesteps, self.seed,
                                      self.accelerator)

    def reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor.to(self.accelerator.device), "sum").cpu()


def training_probe(trainer: Any, run: Any) -> TrainingProbe:
    """The run's :class:`TrainingProbe` (taken before training: the dataset's epoch is set again by the
    training loop, and the random states are put back)."""
    from library import lr_finder, train_state

    saved = train_state.rng_state()
    try:
        batches = trainer.fixed_batches(run.loss, lr_finder.probe_batches(run, PROBE_BATCHES))
    finally:
        train_state.set_rng_state(saved)
    args = run.args
    timesteps = validation.fixed_timesteps(args.min_timestep, args.max_timestep,
                                           run.loss.noise_scheduler.config.num_train_timesteps)
    return TrainingProbe(batches, timesteps, args.seed, run.loss.models.unet,
                         functools.partial(trainer.validation_loss, run.loss), run.accelerator)


def check_written(network: Any, path: str, save_dtype: Optional[torch.dtype]) -> Optional[str]:
    """Re-read the LoRA file just written at ``path`` and compare it with the network it came from
    (cast as the writer casts): a warning line naming the first missing, extra or different tensor,
    or None when the file holds exactly the trained LoRA (so applying it has the trained effect)."""
    from library.lora_files import cast_for_saving
    from networks.network_base import read_lora_file

    written = read_lora_file(path)
    expected = cast_for_saving(network.lora_state_dict(), save_dtype)
    problem = next((f"{key} is missing" for key in expected if key not in written), None) \
        or next((f"{key} is not in the trained LoRA" for key in written if key not in expected), None) \
        or next((f"{key} differs" for key, value in expected.items()
                 if not torch.equal(written[key], value.detach().cpu())), None)
    if problem is None:
        return None
    line = f"warning: {path} does not hold the trained LoRA as it was saved: {problem} (a save bug; please report it)"
    print(line, flush=True)
    return line
