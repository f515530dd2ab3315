"""The training loop every trainer shares: ``Trainer`` = a model family + a trainable.

The story of a run: build it (``library.training.build``), then window by window
batch -> noise -> forward -> loss -> backward (``library.training.diffusion_loss``) -> guard ->
step -> log -> heal -> save points (sample, validate, files, states), then finish (the final file
and state, or the honest failure line). The guard, the loss scaler, healing, EMA, states and
outputs are wired here once; what differs between trainers is the model family
(``library.training.families``) and what trains (``library.trainables``).
"""
from __future__ import annotations

import argparse
import functools
import sys
from typing import Any, Callable, Iterable, Optional

import torch
from accelerate import Accelerator
from tqdm import tqdm

from library import best_checkpoint, fault_injection, healing, lora_files, losses, lr_finder, nan_report
from library import optimizers, sampling, train_state
from library.fixed_batches import FixedBatches
from library.model_loading import StableDiffusionModels
from library.run_data import Window
from library.run_outputs import StepResult
from library.trainables.base import Trainable
from library.training import build, diffusion_loss
from library.training.families import StableDiffusionFamily
from library.training.run import LossContext, Run


class Trainer:
    """Trains ``trainable`` on the models of ``family``. The model hooks (``load_models``,
    ``unet_module_names``, ``encode_prompts``, ``predict``) and the loss path are methods, so a
    subclass (kohya's users subclass ``NetworkTrainer``) can replace one and the loop uses it."""

    def __init__(self, family: StableDiffusionFamily, trainable: Trainable) -> None:
        self.family = family
        self.trainable = trainable

    @property
    def is_sdxl(self) -> bool:
        return self.family.is_sdxl

    def validate_arguments(self, args: argparse.Namespace) -> None:
        """Every option checked before anything is loaded (the trainable's check covers the run's)."""
        self.trainable.validate_arguments(args, self.family.is_sdxl)

    # -- model hooks (the family's) ---------------------------------------------------------------
    def load_models(self, args: argparse.Namespace) -> StableDiffusionModels:
        # a trainable that places whole models in a training dtype has them read in it (optional hook)
        return self.family.load_models(args, getattr(self.trainable, "load_dtypes", dict)())

    def unet_module_names(self, models: StableDiffusionModels) -> Optional[dict[str, str]]:
        return self.family.unet_module_names(models)

    def encode_prompts(self, args: argparse.Namespace, models: StableDiffusionModels, captions: list[str]) -> Any:
        return self.family.encode_prompts(args, models, captions)

    def sample_prompt_replacement(self) -> Optional[tuple[str, str]]:
        """(old, new): the text replaced in every sample prompt before it is encoded (None: none)."""
        return None

    def predict(
        self, models: StableDiffusionModels, noisy_latents: torch.Tensor, timesteps: torch.Tensor, conditioning: Any,
        batch: dict[str, Any],
    ) -> torch.Tensor:
        return self.family.predict(models, noisy_latents, timesteps, conditioning, batch)

    # -- the run -------------------------------------------------------------------------------
    def train(self, args: argparse.Namespace, explicit: set[str]) -> None:
        """Build the run, train it window by window, finish it (exit code 1 when it failed)."""
        run = self.build_run(args, explicit)
        if run is None:  # --debug_dataset printed the first epoch's batches
            return
        with run.outputs:
            if lr_finder.requested(args):  # everything it touches is put back
                lr_finder.find(self, run)
                if args.find_lr_only:
                    run.states.close()
                    return
            run.trainable.before_training(self, run)
            self.after_start(run)
            for window in run.data.windows(run.progress, run.config.max_train_steps,
                                           lambda: run.outputs.stop.requested or best_checkpoint.stopped(run.best),
                                           on_epoch_start=run.network.train):
                if window.trains:
                    result = self.train_step(run, window)
                    self.record(run, result)
                    self.heal(run, result, window)
                    if run.stopped:
                        break
                    self.after_step(run, result.step, window.epoch)
                if window.ends_epoch:
                    run.data.next_epoch(run.progress)
                    self.after_epoch(run, window.epoch)
        try:
            self.finish(run)
        finally:  # done, failed or interrupted: a healthy point on disk is no longer needed
            run.states.close()

    def build_run(self, args: argparse.Namespace, explicit: set[str]) -> Optional[Run]:
        return build.build_run(self, args, explicit)

    # -- one step ------------------------------------------------------------------------------
    def train_step(self, run: Run, window: Window) -> StepResult:
        """Forward and backward the window, measure, let the guard and the healing policy decide, step."""
        optimization, accelerator = run.optimization, run.accelerator
        step = run.progress.global_step + 1
        optimizers.enter_train_mode(optimization.optimizer)  # schedule-free: save points leave it at its average
        samples = healing.WindowSamples(accelerator.process_index, accelerator.num_processes,
                                        run.config.gradient_accumulation_steps, run.data.dataset.max_batch_size)
        gradient_step = optimization.gradient_step  # unfused, or the update applied during backward
        if optimization.gradients is not None:  # a whole model's gradients accumulate into the flat buffer
            optimization.gradients.attach()
        window_loss = self.backward_window(run.loss, window.batches, window.epoch, accelerator, optimization.scaler,
                                           samples, backward=gradient_step.backward)
        measured = gradient_step.measure(optimization, step, window_loss, samples.reduced)
        scaler = optimization.scaler
        decision = optimization.guard.decide(step, measured.norm, optimization.agree)
        outcome = healing.StepOutcome(
            step, healing.WindowSamples.outcomes(measured.riders, run.data.dataset.image_index_of), measured.loss,
            optimization.unscaled(measured), has_scaler=scaler is not None)
        verdict = optimization.healer.assess(outcome)
        if verdict.problem == "non-finite loss" and not verdict.rewind and not run.trainable.weights_finite():
            verdict = optimization.healer.weights_diverged(verdict)
        after_step_logs = {}
        if decision.skip or not verdict.train:
            gradient_step.discard(optimization)
        else:
            gradient_step.apply(self, run.config, optimization, measured.loss)
            after_step_logs = run.trainable.after_optimizer_step()
        stepped = not decision.skip and verdict.train and not (scaler is not None and scaler.last_step_skipped)
        if stepped and optimization.ema is not None:  # a skipped step leaves the average as it is
            optimization.ema.after_optimizer_step()
        verdict = optimization.healer.conclude(verdict, healing.step_kind(stepped, decision.skip, verdict))
        run.progress.global_step = step
        return StepResult(step, window.epoch, measured.loss, measured, decision, verdict, stepped,
                          optimization.lr_scheduler.get_last_lr(), after_step_logs, samples=outcome.samples)

    def optimizer_step(self, config, optimizer, lr_scheduler, scaler, trainable_params, loss: float) -> None:
        """Unscale, clip (``config.max_grad_norm``), step; the LR schedule advances only when the
        optimizer really stepped (the scaler's ``last_step_skipped`` tells the caller; the schedule
        sees the step's ``loss``: reduce_lr_on_plateau)."""
        if scaler is not None:
            scaler.unscale_(optimizer)
        if config.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(trainable_params, config.max_grad_norm)
        if scaler is not None:
            stepped = scaler.step(optimizer)  # False: an inf/NaN gradient (on any process), step skipped
            scaler.update()
        else:
            optimizer.step()
            stepped = True
        if stepped:
            optimizers.step_schedule(lr_scheduler, loss)
        optimizer.zero_grad(set_to_none=True)

    def record(self, run: Run, result: StepResult) -> None:
        """The step's counts and average loss, then its row, bar, scalars and JSON line."""
        optimization = run.optimization
        if result.stepped:
            run.writer.trained = True
        run.average_loss = run.progress.record_loss(result.loss, window=run.data.steps_per_epoch)
        scaler = optimization.scaler
        run.outputs.record(result, run.average_loss, skipped=optimization.guard.skipped_steps,
                           non_finite_losses=run.progress.non_finite_losses,
                           overflows=scaler.overflow_count if scaler else None,
                           extra={**debiased_scalars(run), **run.trainable.step_scalars(
                               result.step, guard_skipped=optimization.guard.skipped_steps,
                               guard_window=optimization.guard.window,
                               scaler_skipped=scaler.overflow_count if scaler else 0,
                               learning_rates=result.learning_rates)})

    # -- the loss path ---------------------------------------------------------------------------
    def backward_window(self, run: LossContext, window: list[dict[str, Any]], epoch: int, accelerator: Accelerator,
                        scaler, samples: Optional[healing.WindowSamples] = None,
                        backward: Optional[Callable[[torch.Tensor], None]] = None) -> torch.Tensor:
        return diffusion_loss.backward_window(self, run, window, epoch, accelerator, scaler, samples, backward)

    def plan_loss(self, run: LossContext, batch: dict[str, Any], epoch: int,
                  timesteps: Optional[torch.Tensor] = None) -> losses.BatchWeights:
        return diffusion_loss.plan_loss(run, batch, epoch, timesteps)

    def compute_loss(self, run: LossContext, batch: dict[str, Any], epoch: int, plan: losses.BatchWeights,
                     timesteps: Optional[torch.Tensor] = None, seed: Optional[int] = None) -> losses.WeightedLoss:
        own = self.trainable.compute_loss(self, run, batch, epoch, plan, timesteps, seed)  # e.g. LECO's target
        return own if own is not None else diffusion_loss.compute_loss(self, run, batch, epoch, plan, timesteps, seed)

    def validation_loss(self, run: LossContext, batch: dict[str, Any], timesteps: torch.Tensor, epoch: int,
                        seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return diffusion_loss.validation_loss(self, run, batch, timesteps, epoch, seed)

    def fixed_batches(self, run: LossContext, source: Iterable[dict[str, Any]]) -> FixedBatches:
        """``source``'s batches, scored again and again (validation, the effect monitor's probe, the finder),
        with what the frozen models make of them encoded once (library/fixed_batches.py)."""
        return FixedBatches(source, diffusion_loss.fixed_batch_encoder(self, run))

    # -- healing -------------------------------------------------------------------------------
    def heal(self, run: Run, result: StepResult, window: Window) -> None:
        """Act on the step's healing verdict: name quarantined images, write the NaN report, rewind to
        the healthy point or stop, or keep the state as the new healthy point (docs/healing.md)."""
        healer, outputs, verdict = run.optimization.healer, run.outputs, result.verdict
        for entry in verdict.quarantined:
            outputs.event(result.step, "quarantine", entry.file,
                          f"step {result.step}: quarantined {entry.file} (caption {entry.caption!r}): {entry.reason}; "
                          f"it is left out for the rest of the run",
                          count=("train/quarantined_samples", len(healer.quarantine)),
                          fields={"file": entry.file, "caption": entry.caption, "reason": entry.reason})
        if verdict.report and healer.config.nan_report:
            self.write_nan_report(run, result, window)
        if verdict.stop:
            run.stopped = f"step {result.step}: {verdict.stop_reason}"
        elif verdict.rewind:
            self.rewind(run, result.step, verdict.rewind)
        elif healer.snapshot_due(result.step, result.stepped):
            self.capture_healthy_point(run.states, healer, run.progress)
            outputs.event(result.step, "healthy", "")
        run.data.quarantined = healer.quarantined_images  # after a rewind, which lifts uncertain ones

    @staticmethod
    def capture_healthy_point(states: train_state.RunStates, healer: healing.HealingPolicy,
                              progress: train_state.Progress) -> None:
        states.capture(progress.global_step, position=(progress.epoch, progress.batches_done))
        healer.mark_healthy(progress.global_step)

    def rewind(self, run: Run, step: int, reason: str) -> None:
        """Back to the healthy point: its weights, optimizer, schedule, scaler, guard and RNG; a lower
        learning rate; the batches trained since then are not trained again (the data goes on)."""
        optimization, healer = run.optimization, run.optimization.healer
        batches_skipped = run.data.batches_since(run.states.healthy_point["position"], run.progress)
        event = healer.rewound(step, reason, batches_skipped)
        run.states.restore(run.device)
        abandoned = run.writer.mark_abandoned(event.to_step) if run.accelerator.is_main_process else []
        lowered = healing.scale_learning_rates(optimization.optimizer, optimization.lr_scheduler,
                                               healer.lr_multiplier)
        run.progress.loss_history = []  # the average restarts from the healthy point's weights
        rates = healing.describe_rates(healing.learning_rates(optimization.optimizer))
        run.outputs.event(
            step, "rewind", str(event.to_step),
            f"step {step}: {reason}: rewound to the healthy point of step {event.to_step}, learning rate now {rates}"
            + ("" if lowered else " (unchanged: the optimizer sets its own step size)")
            + f", {batches_skipped} batches of the diverged span skipped (rewind {len(healer.rewinds)} of "
              f"{healer.config.max_rewinds})"
            + (f"; the files of the diverged span are renamed: {', '.join(abandoned)}" if abandoned else ""),
            count=("train/rewinds", len(healer.rewinds)),
            fields={"to_step": event.to_step, "reason": reason,
                    "learning_rate": event.lr_scale * run.config.learning_rate,
                    "lr_scale": event.lr_scale, "batches_skipped": batches_skipped})

    def write_nan_report(self, run: Run, result: StepResult, window: Window) -> None:
        """The first non-finite loss (with a re-run of the forward under hooks) or gradient, explained
        in ``<output_name>-nan_report.txt`` (main process)."""
        if not run.accelerator.is_main_process:
            return
        kind, healer = result.verdict.report, run.optimization.healer
        dataset = run.data.dataset
        samples = [nan_report.SampleLine(dataset.image_of(sample.sample_id).path,
                                         dataset.image_of(sample.sample_id).caption, sample.loss,
                                         sample.image in healer.quarantined_images)
                   for sample in result.samples]
        probe = self.probe_forward(run, window) if kind == "loss" else None
        path = nan_report.report_path(run.config.output_dir, run.config.output_name)
        text = nan_report.format_report(
            kind, result.step, result.epoch, samples, probe,
            result.measured.scale if run.optimization.scaler else None, list(healer.recent_norms),
            healing.learning_rates(run.optimization.optimizer), healing.report_note(result.verdict,
                                                                                  run.optimization.scaler is not None))
        nan_report.write_report(path, text, start_new=len(healer.reported) == 1)
        tqdm.write(f"step {result.step}: first non-finite {kind}; what it was: {path}")

    def probe_forward(self, run: Run, window: Window) -> nan_report.ForwardProbe:
        """Re-run the window's forward (no gradient, the RNGs put back) with hooks on every module."""
        models = run.models
        named = [("unet", models.unet)] + ([(f"text_encoder{index + 1}", encoder)
                                            for index, encoder in enumerate(models.text_encoders)]
                                           if run.loss.train_text_encoder else [])
        devices = [run.device] if run.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad(), \
                nan_report.probe_forward(named, models.unet) as probe:
            for batch in window.batches:
                plan = self.plan_loss(run.loss, batch, window.epoch)
                with run.loss.autocast:
                    self.compute_loss(run.loss, batch, window.epoch, plan)
        return probe

    # -- events ------------------------------------------------------------------------------------
    def after_start(self, run: Run) -> None:
        with run.weights_for_use():  # samples, validation and files see the EMA / schedule-free's average
            sampling.sample_images(run.args, run.accelerator, run.models, run.network, run.device, when="first",
                                   step=run.progress.global_step, prompt_replacement=self.sample_prompt_replacement())

    def after_step(self, run: Run, step: int, epoch: int) -> None:
        """Validation, file, sample images and state of a step save point (every process calls it)."""
        saves, name = run.config.saves, run.config.output_name
        with run.weights_for_use():  # every step on every process, as kohya
            if run.validator is not None and run.validator.due_after_step(step):  # before this step's state
                self.validate(run, "step", f"after step {step}")
            if run.accelerator.is_main_process:
                run.writer.on_step(run.network, step, epoch)
                sampling.sample_images(run.args, run.accelerator, run.models, run.network, run.device, when="step",
                                       step=step, prompt_replacement=self.sample_prompt_replacement())
        if run.accelerator.is_main_process and saves.step_state_due(step):
            if run.save_state(train_state.step_state_name(name, step)):
                run.states.store.rotate("step", step, saves.every_n_steps, saves.keep_last_n_steps)

    def after_epoch(self, run: Run, epoch: int) -> None:
        """Validation, file, sample images and state of an epoch save point."""
        saves, name, step = run.config.saves, run.config.output_name, run.progress.global_step
        with run.weights_for_use():
            if run.validator is not None and run.validator.due_after_epoch(epoch):
                self.validate(run, "epoch", f"after epoch {epoch} (step {step})")
            if run.accelerator.is_main_process:
                run.writer.on_epoch_end(run.network, step, epoch, is_last_epoch=epoch == run.data.num_epochs)
                sampling.sample_images(run.args, run.accelerator, run.models, run.network, run.device, when="epoch",
                                       step=step, epoch=epoch, prompt_replacement=self.sample_prompt_replacement())
        if run.accelerator.is_main_process and saves.epoch_state_due(epoch, run.data.num_epochs):
            if run.save_state(train_state.epoch_state_name(name, epoch)):
                run.states.store.rotate("epoch", epoch, saves.every_n_epochs, saves.keep_last_n_epochs)

    def validate(self, run: Run, kind: str, where: str) -> None:
        """A validation pass on every process; its scalars are logged at the current step like the step's."""
        batch_loss = functools.partial(self.validation_loss, run.loss)
        scalars = run.trainable.validation_pass(
            run, kind, lambda: run.validator.run(kind, run.network, batch_loss, run.average_loss, where), batch_loss)
        scalars.update(best_checkpoint.observe(run.best, kind, run.progress.global_step, scalars, functools.partial(
            run.writer.write, run.network, best_checkpoint.best_file_name(run.config.output_name),
            run.progress.global_step, run.progress.epoch)))
        run.outputs.scalars(run.progress.global_step, scalars)

    # -- the end -----------------------------------------------------------------------------------
    def finish(self, run: Run) -> None:
        """Interrupted: state and exit code 128 + signal. Stopped by the healing, or failed at the end:
        the last healthy weights, one line, exit code 1. Otherwise the final file, state and summary."""
        config, accelerator, progress, stop = run.config, run.accelerator, run.progress, run.outputs.stop
        healer = run.optimization.healer
        if stop.requested:
            if config.saves.save_state and accelerator.is_main_process:
                saved = run.save_state(train_state.step_state_name(config.output_name, progress.global_step))
                print(f"interrupted at step {progress.global_step}; "
                      + ("state saved" if saved else "its state was refused (see above)")
                      + ". Resume with the same command plus --resume auto", flush=True)
            else:
                print(f"interrupted at step {progress.global_step}; no state saved (--save_state is off)",
                      flush=True)
            sys.exit(stop.exit_code)
        failure = run.stopped or healer.failure_at_end()
        if failure:
            self.finish_failed(run, failure)
        saved = None
        with run.weights_for_use():  # the file holds the EMA / schedule-free's average, the state the training weights
            if config.debug_report_weights:
                fault_injection.report_weights(accelerator.process_index, run.trainable.weights_for_report())
            if accelerator.is_main_process:
                epoch = progress.epoch - (1 if progress.batches_done == 0 else 0)
                saved = run.writer.write(run.network, lora_files.final_file_name(config.output_name),
                                         progress.global_step, epoch)
                if saved:  # the file re-read holds what trained (catches save bugs)
                    run.trainable.check_written(saved, run.writer.save_dtype)
                if saved and run.best is not None:
                    run.best.final_from_best(saved)
        if accelerator.is_main_process:
            if config.saves.save_state or config.saves.save_state_on_train_end:  # kohya: --save_state also saves the last state
                run.save_state(train_state.final_state_name(config.output_name))
            if saved is None:
                sys.exit(1)
        print("done: " + healer.summary(progress.global_step, run.average_loss, len(progress.loss_history),
                                        healing.learning_rates(run.optimization.optimizer)))

    def finish_failed(self, run: Run, failure: str) -> None:
        """Write the healthy point's weights as ``<output_name>-last_healthy.safetensors`` (none without a
        healthy point: rewinding off) and exit with code 1."""
        progress, healer = run.progress, run.optimization.healer
        summary = healer.summary(progress.global_step, run.average_loss, len(progress.loss_history),
                                 healing.learning_rates(run.optimization.optimizer))
        written = None
        if run.states.healthy_point is not None:
            weights_step = run.states.restore(run.device)
            with run.weights_for_use():
                if run.accelerator.is_main_process:
                    run.writer.metadata["ss_last_healthy_step"] = str(weights_step)
                    written = run.writer.write(run.network, lora_files.last_healthy_file_name(run.config.output_name),
                                               weights_step, progress.epoch)
        earlier = [path for _, path in run.writer.written if path != written]
        if written:
            outcome = f"the last healthy weights (step {weights_step}) are in {written}"
        elif run.states.healthy_point is None:
            outcome = "no last healthy weights written (no healthy point is kept without --rewind_on_divergence)"
        else:
            outcome = "no last healthy weights written (see above)"
        outcome += (f"; written before the failure: {', '.join(earlier)}" if earlier else
                    f"; this run wrote no other {run.trainable.kind} file" if run.accelerator.is_main_process else "")
        print(f"failed: {failure}; {outcome}; {summary}", flush=True)
        sys.exit(1)


def debiased_scalars(run: Run) -> dict[str, float]:
    """The step's ``--debiased_loss`` scalars ({} without the option)."""
    return run.loss.debiased.take(run.accelerator) if run.loss.debiased is not None else {}
