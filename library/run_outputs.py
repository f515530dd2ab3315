"""Where a run's step results go: the progress bar, the gradient log and its events file, the
trackers and ``--log_jsonl``; flushed at every state save, at the end, on errors and on signals.

Only the main process writes files; every process keeps the progress bar object (disabled off
the local main process) so the loop reads the same everywhere.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Optional

from tqdm import tqdm

from library import grad_guard, tracking
from library.grad_log import GradientLog, install_flush_handlers
from library.healing import SampleOutcome, Verdict
from library.interrupts import StopRequest


@dataclass
class StepResult:
    """One optimizer step as the loop saw it: the window ``loss`` (NaN when non-finite), the guard's
    ``measured`` norms and ``decision``, the healing ``verdict``, whether the optimizer ``stepped``
    (False: a skip of the guard, the scaler, or a non-finite loss), and kohya's max-norm scalars."""

    step: int
    epoch: int
    loss: float
    measured: grad_guard.GradientMeasurement
    decision: grad_guard.GuardDecision
    verdict: Verdict
    stepped: bool
    learning_rates: list[float]
    max_norm_logs: dict[str, float] = field(default_factory=dict)
    samples: tuple[SampleOutcome, ...] = ()


class RunOutputs:
    """The run's progress bar, gradient log (with events), trackers and JSON-lines file."""

    def __init__(self, args: argparse.Namespace, accelerator: Any, *, with_scaler: bool, total_steps: int,
                 initial_step: int, resume_step: Optional[int]) -> None:
        """``resume_step``: the resumed state's step (logs keep their rows up to it), None for a fresh run."""
        self.args = args
        self.accelerator = accelerator
        self.with_scaler = with_scaler
        main = accelerator.is_main_process
        self.grad_log = GradientLog.from_args(args, with_scale=with_scaler) if main else None
        self.log_cosine = self.grad_log is not None and self.grad_log.with_cosine
        if self.grad_log is not None:
            self.grad_log.start(resume_step=resume_step)
        tracking.init_trackers(accelerator, args)
        self.jsonl = tracking.JsonlLog(args.log_jsonl, resume_step) if args.log_jsonl and main else None
        self.progress = tqdm(total=total_steps, initial=initial_step, desc="steps",
                             disable=not accelerator.is_local_main_process)
        self._remove_exit_flush = install_flush_handlers(self.flush, signals=())
        self.stop = StopRequest(on_force=self.flush)
        self.event_scalars: dict[str, float] = {}  # self-healing counts, logged with every step once non-zero

    def flush(self) -> None:
        """Put the buffered gradient-log and event rows on disk."""
        if self.grad_log is not None:
            self.grad_log.flush()

    def __enter__(self) -> "RunOutputs":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.progress.close()
        self.flush()
        self._remove_exit_flush()
        self.stop.uninstall()
        if self.jsonl is not None:
            self.jsonl.close()
        self.accelerator.end_training()

    def record(self, result: StepResult, average_loss: float, *, skipped: int, non_finite_losses: int,
               overflows: Optional[int], extra: Optional[dict[str, float]] = None) -> dict[str, float]:
        """One optimizer step: a gradient-log row, the progress bar, tracker scalars and a JSON line.
        ``skipped``: the guard's skip count; ``overflows``: the scaler's (None without one);
        ``extra``: more scalars of the step (``--debiased_loss``'s, the effect check's)."""
        measured, decision = result.measured, result.decision
        if self.grad_log is not None:
            self.grad_log.append(
                epoch=result.epoch, step=result.step, norm=measured.norm, threshold=decision.threshold,
                loss=result.loss, thresh_off=decision.thresh_off,
                scale=measured.scale if self.with_scaler else None,
                cosine=measured.cosine if self.log_cosine else None,
            )
        postfix = {"avr_loss": f"{average_loss:.4f}"}
        extra = extra or {}
        if "loss/debiased_average" in extra:
            postfix["dbl_loss"] = f"{extra['loss/debiased_average']:.4f}"
        if result.max_norm_logs:  # kohya's progress bar names
            postfix["Keys Scaled"] = int(result.max_norm_logs["max_norm/keys_scaled"])
            postfix["Average key norm"] = f"{result.max_norm_logs['max_norm/average_key_norm']:.4f}"
        if self.args.skip_grad_norm:
            postfix["skipped"] = skipped
        if non_finite_losses:
            postfix["nonfinite"] = non_finite_losses
        if overflows is not None:
            postfix["overflows"] = overflows
        for name, value in self.event_scalars.items():
            postfix[name.rpartition("/")[2]] = int(value)
        self.progress.set_postfix(postfix, refresh=False)
        self.progress.update(1)
        logs = {
            "loss/current": result.loss,
            "loss/average": average_loss,
            "train/skipped_steps": skipped,
            "train/grad_norm": measured.norm,
            "train/grad_threshold": decision.threshold,
        }
        if self.with_scaler:
            logs["train/loss_scale"] = measured.scale
        if self.log_cosine:
            logs["train/grad_cosine"] = measured.cosine
        for index, lr in enumerate(result.learning_rates):
            logs[f"lr/group{index}"] = lr
        logs.update(result.max_norm_logs)
        logs.update(extra)
        logs.update(self.event_scalars)
        self.accelerator.log(logs, step=result.step)
        if self.jsonl is not None:
            self.jsonl.append(result.step, logs)
        return logs

    def event(self, step: int, kind: str, detail: str, line: Optional[str] = None,
              count: Optional[tuple[str, int]] = None, fields: Optional[dict[str, Any]] = None) -> None:
        """A self-healing event at ``step``: the console ``line`` (main process), a row of the events
        file, a JSON line ``{"step", "event": kind, ...fields}``, and the tracker scalar ``count``
        (name, running total), which every later step logs too."""
        if line is not None and self.accelerator.is_main_process:
            tqdm.write(line)
        if self.grad_log is not None:
            self.grad_log.events.append(step, kind, detail)
        if count is not None:
            self.event_scalars[count[0]] = float(count[1])
            self.accelerator.log({count[0]: float(count[1])}, step=step)
        if self.jsonl is not None and (line is not None or fields):
            self.jsonl.append(step, {"event": kind, "detail": detail, **(fields or {})})

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """Extra scalars of ``step`` (validation) to the trackers and the JSON lines."""
        self.accelerator.log(values, step=step)
        if self.jsonl is not None:
            self.jsonl.append(step, values)

