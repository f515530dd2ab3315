"""``--find_lr``: a deterministic learning-rate range test on a fixed probe (docs/know_your_lora.md).

Before training, the LoRA trains ``--find_lr_steps`` steps (default 40) on the first
``PROBE_BATCHES`` training batches (epoch 1's order) with a learning rate that grows exponentially
from ``--find_lr_min`` to ``--find_lr_max`` (each optimizer group keeps its ratio to the largest
rate: --unet_lr/--text_encoder_lr, LoRA+). After every step the *probe loss* is measured: the loss
on those batches at kohya's fixed validation timesteps with keyed noise (the same inputs every
time), so it moves only with the weights, not with the random timesteps that make the training
loss unreadable. The base model's probe loss is the multiplier-0 value. The batches are encoded once
(their VAE latents, and the text conditioning unless a text encoder LoRA is in it: ``library/fixed_batches.py``)
and trained on and measured as such, with the same bits as encoding them at every use.

It stops at a non-finite loss or when the probe loss is clearly worse than the base model's
(``UNSTABLE_RATIO``: 5% above). It reports a **window**: the lowest rate with a measurable effect
(the probe loss moved by more than ``EFFECT_FLOOR`` = 0.1% of the base's) and the rate where
training turns unstable (the stop; ``--find_lr_max`` when it never did). It suggests no single rate:
in benchmarks/bench_lr_finder.py the classic rule (a decade below the edge, not below the low edge)
missed the good band of a constant-rate grid (docs/know_your_lora.md); the unstable edge is an upper
bound only (a run that stays at one rate diverges well below it).

Everything it touched is put back bit-exactly afterwards (``RunStates.snapshot/restore``: network,
optimizer, schedule, scaler, guard, EMA and every RNG, kept where ``--healthy_point_location`` keeps
the healthy point; that point itself is untouched), so a run after ``--find_lr`` writes the same
bytes as the run without it.
Learning-rate-free optimizers (Prodigy, D-Adaptation) get one line saying that it does not apply.
Writes ``<output_name>-lr_find.csv`` (and ``-lr_find.png`` with matplotlib).
"""
from __future__ import annotations

import argparse
import functools
import math
import os
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

from library import atomic_files, noise, sharding, validation
from library.errors import UserError

PROBE_BATCHES = 4  # training batches the finder trains on and probes with
EFFECT_FLOOR = 1e-3  # |probe - base| / base above this: a measurable effect
UNSTABLE_RATIO = 1.05  # probe loss above base * this: clearly worse than the base model
FINDER_EPOCH = -100000  # keyed-draw epoch slot of the finder's training steps (no training or validation draw uses it)
LR_FREE_OPTIMIZERS = ("prodigy", "dadapt")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--find_lr", action="store_true",
                        help="before training, run a learning-rate range test on a fixed probe of training images; "
                             "prints a window (the lowest rate with an effect .. where training turns unstable), "
                             "writes <output_name>-lr_find.csv, then trains as "
                             "given (the run is the same as without it)")
    parser.add_argument("--find_lr_only", action="store_true", help="run the --find_lr test, print it and exit")
    parser.add_argument("--find_lr_steps", type=int, default=40, help="steps of the range test (default 40)")
    parser.add_argument("--find_lr_min", type=float, default=1e-7, help="first learning rate of the test (default 1e-7)")
    parser.add_argument("--find_lr_max", type=float, default=1.0, help="last learning rate of the test (default 1)")


def validate_arguments(args: argparse.Namespace) -> None:
    if args.find_lr_steps < 2:
        raise UserError(f"--find_lr_steps {args.find_lr_steps} must be at least 2")
    if not 0 < args.find_lr_min < args.find_lr_max or not math.isfinite(args.find_lr_max):
        raise UserError(f"--find_lr_min {args.find_lr_min} and --find_lr_max {args.find_lr_max}: need "
                        f"0 < min < max (finite)")


def requested(args: argparse.Namespace) -> bool:
    return bool(args.find_lr or args.find_lr_only)


def applies(optimizer_type: Optional[str]) -> bool:
    name = (optimizer_type or "").lower()
    return not any(free in name for free in LR_FREE_OPTIMIZERS)


def learning_rate_at(index: int, steps: int, low: float, high: float) -> float:
    """The exponential ramp: ``low`` at index 0, ``high`` at ``steps - 1``."""
    return low * (high / low) ** (index / (steps - 1))


@dataclass
class FinderRow:
    step: int
    learning_rate: float
    train_loss: float
    probe_loss: float


@dataclass
class Window:
    low: Optional[float]  # lowest rate with a measurable effect (None: none up to the top)
    unstable: float  # where training turned unstable (the top of the ramp when it never did)
    diverged: bool


def window(rows: list[FinderRow], base: float, top: float) -> Window:
    """The window of a finished ramp (see the module docstring)."""
    low = next((row.learning_rate for row in rows
                if math.isfinite(row.probe_loss) and abs(row.probe_loss - base) > EFFECT_FLOOR * base), None)
    unstable_row = next((row for row in rows if not math.isfinite(row.probe_loss) or not math.isfinite(row.train_loss)
                         or row.probe_loss > UNSTABLE_RATIO * base), None)
    unstable = unstable_row.learning_rate if unstable_row is not None else top
    return Window(low, unstable, unstable_row is not None)


def csv_text(rows: list[FinderRow], base: float) -> str:
    lines = ["step,learning_rate,train_loss,probe_loss,probe_rel"]
    lines += [f"{row.step},{row.learning_rate!r},{row.train_loss!r},{row.probe_loss!r},{row.probe_loss / base!r}"
              for row in rows]
    return "\n".join(lines) + "\n"


def write_plot(path: str, rows: list[FinderRow], base: float, found: Window) -> Optional[str]:
    """The probe loss (relative to the base) over the rate, log x, with the window; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.semilogx([row.learning_rate for row in rows], [row.probe_loss / base for row in rows], marker=".",
                  label="probe loss / base model's")
    axis.axhline(1.0, color="grey", linewidth=0.8)
    if found.low is not None:
        axis.axvspan(found.low, found.unstable, color="tab:green", alpha=0.15, label="window")
    if found.diverged:
        axis.axvline(found.unstable, color="tab:red", label=f"unstable from {found.unstable:.2g}")
    axis.set_xlabel("learning rate")
    axis.set_ylabel("probe loss / base")
    axis.legend()
    figure.tight_layout()
    import io

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, metadata={"Software": None})
    plt.close(figure)
    atomic_files.write_file(path, buffer.getvalue())
    return path


def find(trainer: Any, run: Any) -> Optional[Window]:
    """Run the range test on ``run`` (built, not yet trained) and put everything back; the window, or
    None when the optimizer sets its own rate."""
    args = run.args
    if not applies(args.optimizer_type):
        print(f"--find_lr: does not apply to --optimizer_type {args.optimizer_type}, which sets its own learning "
              f"rate")
        return None
    states, progress, optimization = run.states, run.progress, run.optimization
    place = states.place.beside("find_lr.pt", "the learning-rate finder's snapshot")
    snapshot = states.snapshot(progress.global_step, (progress.epoch, progress.batches_done), place)
    try:
        rows, base = ramp(trainer, run)
    finally:
        states.restore(run.device, snapshot)
        place.clear()
        optimization.optimizer.zero_grad(set_to_none=True)
        if run.loss.debiased is not None:  # --debiased_loss collected the finder's steps too
            run.loss.debiased.clear()
    found = window(rows, base, args.find_lr_max)
    report(args, rows, base, found, run.accelerator.is_main_process)
    return found


def probe_batches(run: Any, count: int = PROBE_BATCHES) -> list[dict[str, Any]]:
    """The first ``count`` training batches of epoch 1 (the dataset's own draws; the training loop sets
    the dataset's epoch again before it loads a batch)."""
    from accelerate.utils import send_to_device

    dataset = run.data.dataset
    dataset.set_epoch(1, 0)
    return [send_to_device(dataset[index], run.device) for index in range(min(count, len(dataset)))]


def probe_loss(trainer: Any, run: Any, batches: Iterable[dict[str, Any]], timesteps: list[int]) -> float:
    """Mean loss over the probe batches at the fixed timesteps (keyed noise), no gradient, adapters in eval."""
    return validation.pass_losses(batches, run.network, functools.partial(trainer.validation_loss, run.loss),
                                  timesteps, run.args.seed, run.accelerator)[0]


def train_step(trainer: Any, run: Any, batch: dict[str, Any], epoch: int) -> float:
    """One optimizer step on ``batch`` at the optimizer's rates (keyed draws in slot ``epoch``), outside the
    guard and the healing (clipping and the loss scaler as training); its loss. A non-finite loss: no step."""
    args, optimization = run.args, run.optimization
    optimizer, scaler = optimization.optimizer, optimization.scaler
    loss = trainer.backward_window(run.loss, [batch], epoch, run.accelerator, scaler)
    sharding.sum_gradients_across_processes(optimization.gradients)
    train_loss = float(loss)
    if math.isfinite(train_loss):
        if scaler is not None:
            scaler.unscale_(optimizer)
        if args.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(optimization.trainable_params, args.max_grad_norm)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return train_loss


def ramp(trainer: Any, run: Any) -> tuple[list[FinderRow], float]:
    """The ramp's rows and the base model's probe loss."""
    args, optimizer = run.args, run.optimization.optimizer
    batches = trainer.fixed_batches(run.loss, probe_batches(run))  # encoded once, trained on and probed as they are
    timesteps = validation.fixed_timesteps(args.min_timestep, args.max_timestep,
                                           run.loss.noise_scheduler.config.num_train_timesteps)
    multiplier = run.network.multiplier
    run.network.set_multiplier(0.0)
    try:
        base = probe_loss(trainer, run, batches, timesteps)
    finally:
        run.network.set_multiplier(multiplier)
    top = max(group["lr"] for group in optimizer.param_groups) or 1.0
    ratios = [group["lr"] / top for group in optimizer.param_groups]
    rows = []
    for index in range(args.find_lr_steps):
        rate = learning_rate_at(index, args.find_lr_steps, args.find_lr_min, args.find_lr_max)
        for group, ratio in zip(optimizer.param_groups, ratios):
            group["lr"] = rate * ratio
        train_loss = train_step(trainer, run, batches[index % len(batches)], FINDER_EPOCH - index)
        probe = probe_loss(trainer, run, batches, timesteps) if math.isfinite(train_loss) else math.nan
        rows.append(FinderRow(index + 1, rate, train_loss, probe))
        if not math.isfinite(probe) or probe > UNSTABLE_RATIO * base:
            break
    return rows, base


def report(args: argparse.Namespace, rows: list[FinderRow], base: float, found: Window, main: bool) -> None:
    if not main:
        return
    csv_path = os.path.join(args.output_dir, f"{args.output_name}-lr_find.csv")
    atomic_files.write_file(csv_path, csv_text(rows, base))
    plot = write_plot(os.path.join(args.output_dir, f"{args.output_name}-lr_find.png"), rows, base, found)
    edge = (f"unstable from {found.unstable:.3g} (probe loss {'non-finite' if not math.isfinite(rows[-1].probe_loss) else f'{rows[-1].probe_loss / base:.3f} x the base model'})"
            if found.diverged else f"stable up to --find_lr_max {found.unstable:.3g}")
    if found.low is None:
        print(f"--find_lr: no measurable effect up to {rows[-1].learning_rate:.3g}; {edge}; base probe loss "
              f"{base:.6f}. Wrote {csv_path}" + (f" and {plot}" if plot else ""))
        return
    print(f"--find_lr: window {found.low:.3g} .. {found.unstable:.3g} (lowest rate with a measurable effect .. "
          f"{edge}); {len(rows)} steps. No rate is suggested: a run that stays at one rate diverges well below the "
          f"unstable edge (docs/know_your_lora.md). Wrote {csv_path}" + (f" and {plot}" if plot else ""))
