"""The full-model trainable: kohya's ``sdxl_train.py`` / ``train_db.py`` / ``fine_tune.py`` fine-tune the
UNet (and optionally the text encoders) themselves.

What trains and at which learning rates is ``library.full_training_params`` (kohya's rules per script:
``--learning_rate_te1/te2``, ``--learning_rate_te``, ``--block_lr``, ``--stop_text_encoder_training`` -1);
the dtypes are kohya's (``--full_fp16`` / ``--full_bf16``: the trained models in the mixed-precision
dtype, else float32); files are kohya's checkpoints (``library.full_model_files``: ``--save_model_as
ckpt|safetensors|diffusers|diffusers_safetensors``, original-layout single files, kohya's names).

A state holds the trained models' tensors (``FullModel.training_state_dict``: ``unet.<name>``,
``text_encoder.<name>``, ``text_encoder_2.<name>``) beside the optimizer, schedule, scaler, guard
and RNGs, written by the core's ``train_state.StateStore`` (atomic, ``--resume auto`` exact).

The healthy point (self-healing) is kept where it fits (``library.healthy_point``): a full model's weights
and optimizer state (AdamW: ~3x the trained weights in float32, 28.7 GiB for a full-size SDXL UNet) go to a
file on disk written at each healthy point when they do not fit in memory; see docs/full_fine_tuning.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch
from accelerate import Accelerator
from tqdm import tqdm

from library import checkpoint_files, compatibility, full_model_files, full_training_params, fused_backward, lora_files
from library import optimizers, train_state
from library.ema import LoraEma
from library.errors import UserError
from library.full_model_files import ModelFormat, ModelSaver
from library.full_training_params import Script, TrainedParts
from library.model_loading import StableDiffusionModels
from library.trainables.base import Trainable
from library.training import checks

LORA_ONLY_DEFAULTS = {
    "network_module": None, "network_dim": None, "network_alpha": None, "network_dropout": None,
    "network_args": None, "network_weights": None, "dim_from_weights": False, "base_weights": None,
    "base_weights_multiplier": None, "scale_weight_norms": None, "network_train_unet_only": False,
    "network_train_text_encoder_only": False, "unet_lr": None, "text_encoder_lr": None,
}
"""What the shared modules read of the LoRA's options (state protection, preflight, kohya states): a full
fine-tune has none of them. Set as parser defaults only (``set_defaults``), not as options."""


class FullModel(torch.nn.Module):
    """The models that train, under one module: ``training_state_dict`` is every trained tensor under a
    stable name (``<component>.<parameter>``), ``load_training_state_dict`` copies values back in place
    (the optimizer holds these very parameters)."""

    def __init__(self, components: Mapping[str, torch.nn.Module], trained: Mapping[str, torch.nn.Parameter]) -> None:
        super().__init__()
        self.components = torch.nn.ModuleDict(dict(components))
        self.trained = dict(trained)

    def training_state_dict(self) -> dict[str, torch.Tensor]:
        return {name: parameter.detach() for name, parameter in self.trained.items()}

    @torch.no_grad()
    def load_training_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        missing = set(self.trained) - set(state)
        if missing or len(state) != len(self.trained):
            raise ValueError(f"the state's model tensors do not match the trained ones ({len(missing)} missing)")
        for name, value in state.items():
            self.trained[name].copy_(value)


@dataclasses.dataclass(frozen=True)
class FullModelConfig:
    """The full-model trainable's options, resolved once."""

    parts: TrainedParts
    dtypes: full_training_params.ModelDtypes
    model_format: ModelFormat
    save_dtype: Optional[torch.dtype]
    stop_text_encoder_at: Optional[int] = None
    """``train_db``'s ``--stop_text_encoder_training N`` (N >= 0): the text encoder trains for the first N steps."""
    diffusers_xformers: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace, script: Script) -> "FullModelConfig":
        parts = TrainedParts.from_args(args, script)
        dtypes = full_training_params.model_dtypes(
            parts, mixed_precision=args.mixed_precision, full_fp16=args.full_fp16, full_bf16=args.full_bf16,
            no_half_vae=args.no_half_vae, cache_text_encoder_outputs=getattr(args, "cache_text_encoder_outputs", False))
        model_format = ModelFormat.resolve(args.save_model_as, args.use_safetensors,
                                           os.path.isfile(args.pretrained_model_name_or_path or ""))
        stop = getattr(args, "stop_text_encoder_training", None)
        return cls(parts, dtypes, model_format, full_model_files.save_dtype(args.save_precision),
                   stop_text_encoder_at=stop if stop is not None and stop >= 0 else None,
                   diffusers_xformers=getattr(args, "diffusers_xformers", False))


def validate_arguments(args: argparse.Namespace, script: Script, sdxl: bool) -> None:
    """The full fine-tune's checks, then the run's (``options.validate_run_arguments``); before any load."""
    for flag in ("max_train_steps", "max_train_epochs", "gradient_accumulation_steps", "train_batch_size"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise UserError(f"--{flag} {value} must be a positive integer")
    for flag in ("learning_rate", "learning_rate_te", "learning_rate_te1", "learning_rate_te2"):
        value = getattr(args, flag, None)
        if value is not None and not value >= 0:
            raise UserError(f"--{flag} {value} must be a number >= 0 (0: that part does not train)")
    full_training_params.check_full_precision(args.mixed_precision, args.full_fp16, args.full_bf16)
    fused_backward.FusedOptions.from_args(args, optimizers.effective_optimizer_type(args),
                                          announce=lambda line: None)  # the build says it once
    if args.debiased_loss:
        raise UserError("--debiased_loss compares with the base model's loss, which a full fine-tune changes; "
                        "it is for LoRA training only")
    parts = TrainedParts.from_args(args, script)  # --block_lr parsed: one line for a bad value
    if not parts.trains_unet and not any(lr is not None for lr in parts.text_encoder_lrs):
        raise UserError("--learning_rate 0 and no text encoder trains: nothing would train")
    if getattr(args, "cache_text_encoder_outputs", False) and any(lr is not None for lr in parts.text_encoder_lrs):
        raise UserError("--cache_text_encoder_outputs with --train_text_encoder: the outputs of a text encoder that "
                        "trains change every step; leave one of them out")
    checks.validate_run_arguments(args, sdxl)


class FullModelTrainable(Trainable):
    """The UNet (and text encoders) fine-tuned whole (see ``library.trainables.base.Trainable``)."""

    kind = "model"
    writes_models = True
    # the core's flat gradient buffer is the only copy of the gradients (flat_gradients.FlatGradients)
    accumulates_gradients_in_place = True

    def __init__(self, script: Script) -> None:
        self.script = script
        self.config: Optional[FullModelConfig] = None
        self.module: Optional[FullModel] = None
        self.models: Optional[StableDiffusionModels] = None  # every part, kept for saving (caching may drop some)
        self.base_path: Optional[str] = None
        self.output_dir: Optional[str] = None

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        full_training_params.add_arguments(parser, self.script)
        full_model_files.add_arguments(parser)
        compatibility.add_full_model_arguments(parser, diffusers_xformers=self.script in ("sdxl_train", "fine_tune"),
                                               no_token_padding=self.script == "train_db")
        parser.set_defaults(**LORA_ONLY_DEFAULTS)

    def validate_arguments(self, args: argparse.Namespace, sdxl: bool) -> None:
        validate_arguments(args, self.script, sdxl)

    def configure(self, args: argparse.Namespace) -> None:
        self.config = FullModelConfig.from_args(args, self.script)
        self.base_path = args.pretrained_model_name_or_path
        self.output_dir = args.output_dir

    def output_path(self, file_name: str) -> str:
        """Where the writer puts ``file_name`` (e.g. the ``-best`` file): its stem with the run's model format's
        extension (none for a diffusers folder), as :meth:`FullModelWriter.write` names it."""
        return os.path.join(self.output_dir, os.path.splitext(file_name)[0] + self.config.model_format.extension)

    def parts(self) -> tuple[bool, bool]:
        parts = self.config.parts
        return parts.trains_unet, any(lr is not None for lr in parts.text_encoder_lrs)

    def load_dtypes(self) -> dict[str, torch.dtype]:
        """The dtype each component is read into (``model_loading.stored_in_dtypes``): the one it trains
        or is kept in (``full_training_params.model_dtypes``), never wider than where it is placed, so
        the float32 copy of a full-size model never exists (kohya loads in the same dtypes)."""
        dtypes = self.config.dtypes
        names = ["text_encoder" if index == 0 else f"text_encoder_{index + 1}"
                 for index in range(len(dtypes.text_encoders))]
        return {"unet": dtypes.unet, "vae": dtypes.vae, **dict(zip(names, dtypes.text_encoders))}

    def trained_models(self) -> list[torch.nn.Module]:
        """The models this trainable places itself (the core leaves their dtype alone: a float32 master
        copy must not pass through the mixed-precision dtype)."""
        return list(self.module.components.values()) if self.module is not None else []

    # -- building ----------------------------------------------------------------------------
    def attach(self, models: StableDiffusionModels, unet_module_names: Optional[dict[str, str]]) -> None:
        parts = self.config.parts
        self.models = dataclasses.replace(models, text_encoders=list(models.text_encoders))
        groups = full_training_params.param_groups(models, parts)
        if not groups:
            raise UserError("--learning_rate/--block_lr: every part has learning rate 0, nothing would train")
        self._groups = groups
        components = {"unet": models.unet} if parts.trains_unet else {}
        for index, encoder in enumerate(models.text_encoders):
            if parts.trains_text_encoder(index):
                components["text_encoder" if index == 0 else f"text_encoder_{index + 1}"] = encoder
        self.module = FullModel(components, {name: p for group in groups for name, p in group.params.items()})

    def place(self, device: torch.device, autocast_dtype: torch.dtype) -> None:
        dtypes, models = self.config.dtypes, self.models
        if self.config.parts.trains_unet:
            models.unet.to(device, dtype=dtypes.unet)
        for index, encoder in enumerate(models.text_encoders):
            if self.config.parts.trains_text_encoder(index):
                encoder.to(device, dtype=dtypes.text_encoders[index])
        full_training_params.apply_requires_grad(models, self.config.parts)
        # kohya: sdxl_train.py sets diffusers' xformers in the VAE (its UNet is its own), fine_tune.py in the UNet
        compatibility.select_diffusers_xformers(self.config.diffusers_xformers,
                                                models.vae if self.script == "sdxl_train" else models.unet,
                                                device.type, announce=print)

    def records_text_encoder_gradients(self) -> bool:
        return self.parts()[1]

    def changes_text_conditioning(self) -> bool:
        # a text encoder among the trained models (its components)
        return any(encoder is component for encoder in self.models.text_encoders
                   for component in self.module.components.values())

    def param_groups(self) -> list[dict[str, Any]]:
        return [group.for_optimizer() for group in self._groups]

    def metadata(self, args: argparse.Namespace, accelerator: Accelerator, models: StableDiffusionModels,
                 data: Any, optimization: Any, progress: train_state.Progress) -> dict[str, str]:
        """kohya's checkpoint metadata: the model spec only (its date: the run's start, so a resumed run
        writes the same bytes)."""
        return full_model_files.checkpoint_metadata(args, models.kind, data.dataset.resolution_hw,
                                                    progress.training_started_at)

    def writer(self, args: argparse.Namespace, metadata: dict[str, str], ema_average: Optional[LoraEma],
               current_metadata: Any, resumed: bool) -> "FullModelWriter":
        source = checkpoint_files.read_source_checkpoint(self.base_path, self.models)
        saver = ModelSaver(Path(args.output_dir), args.output_name, self.config.model_format, self.config.save_dtype,
                           source=source, save_every_n_epochs=args.save_every_n_epochs,
                           save_every_n_steps=args.save_every_n_steps, save_last_n_epochs=args.save_last_n_epochs,
                           save_last_n_steps=args.save_last_n_steps)
        writer = FullModelWriter(saver, self.models, self.module, metadata, ema_average)
        writer.trained = resumed
        return writer

    # -- during the run ------------------------------------------------------------------------
    def weights_finite(self) -> bool:
        return bool(torch.stack([torch.isfinite(p).all() for p in self.module.trained.values()]).all())

    def before_training(self, trainer: Any, run: Any) -> None:
        if self.config.stop_text_encoder_at is not None:
            TextEncoderStop.install(self.module, self.config.stop_text_encoder_at, run.progress)

    def check_written(self, path: str, save_dtype: Optional[torch.dtype]) -> None:
        """A single ``.safetensors`` file re-read holds the trained UNet's tensors (catches save bugs)."""
        if not path.endswith(".safetensors"):
            return
        from safetensors import safe_open

        expected = checkpoint_files.original_layout_tensors(self.models)
        with safe_open(path, "pt") as file:
            for key, tensor in expected.items():
                stored = file.get_tensor(key)
                if not torch.equal(stored, tensor.cpu().to(save_dtype or tensor.dtype)):
                    print(f"warning: {path} does not hold the trained {key}", flush=True)
                    return

    def weights_for_report(self) -> dict[str, torch.Tensor]:
        return self.module.training_state_dict()


class TextEncoderStop:
    """``--stop_text_encoder_training N`` (kohya's ``train_db.py``): the text encoder trains during the first N
    optimizer steps, then is frozen. Decided from the run's step count at each forward of the text encoder, so a
    resumed run, or a rewind of the self-healing to a step before N, trains it again exactly when the
    uninterrupted run would. Frozen = its parameters stop requiring gradients: they get none, so the optimizer
    leaves them (and their moments) as they are, and the guard's norm is the UNet's, as in kohya."""

    def __init__(self, stop_at: int, parameters: Sequence[torch.nn.Parameter], progress: Any) -> None:
        self.stop_at = stop_at
        self.parameters = list(parameters)
        self.progress = progress
        self.training = True

    @classmethod
    def install(cls, module: FullModel, stop_at: int, progress: Any) -> Optional["TextEncoderStop"]:
        encoders = {name: model for name, model in module.components.items() if name.startswith("text_encoder")}
        parameters = [p for name, p in module.trained.items() if name.split(".", 1)[0] in encoders]
        if not parameters:
            return None
        stop = cls(stop_at, parameters, progress)
        for encoder in encoders.values():
            encoder.register_forward_pre_hook(stop.before_forward)
        return stop

    def before_forward(self, module: torch.nn.Module, inputs: Any) -> None:
        training = self.progress.global_step < self.stop_at  # steps done before the one this forward belongs to
        if training == self.training:
            return
        for parameter in self.parameters:
            parameter.requires_grad_(training)
        self.training = training
        tqdm.write(f"stop text encoder training at step {self.progress.global_step}" if not training
                   else f"text encoder training again from step {self.progress.global_step + 1} "
                        f"(--stop_text_encoder_training {self.stop_at})")


class FullModelWriter:
    """Writes the model at kohya's save points (``ModelSaver``: names, rotation), the core's named files
    (final, ``-last_healthy``, ``-best``) in the run's format, and never a model that is untrained or
    holds NaN/Inf (``trained``, ``written``, ``mark_abandoned`` as ``lora_files.LoraWriter``)."""

    def __init__(self, saver: ModelSaver, models: StableDiffusionModels, module: FullModel,
                 metadata: Mapping[str, str], ema: Optional[LoraEma]) -> None:
        self.saver = saver
        self.models = models
        self.module = module
        self.metadata = dict(metadata)
        self.save_dtype = saver.dtype
        self.ema = ema
        self.trained = True
        self.written: list[tuple[int, str]] = []
        saver.metadata = self.file_metadata

    def file_metadata(self) -> dict[str, str]:
        """kohya's checkpoints carry the model spec only."""
        return {key: value for key, value in self.metadata.items() if key.startswith("modelspec.")}

    def refusal(self) -> Optional[str]:
        if not self.trained:
            return "it would hold the initial, untrained model (no optimizer step of this run has trained it yet)"
        if self.ema is not None and self.ema.updates == 0:
            return "the EMA has not updated yet (--ema_update_every)"
        return lora_files.save_refusal(self.module.training_state_dict(), self.save_dtype)

    def _saving(self, label: str, save: Callable[[], Path], step: int) -> Optional[str]:
        refusal = self.refusal()
        if refusal is not None:
            print(f"\nnot saving the {label} model: {refusal}; no file written or removed", flush=True)
            return None
        path = str(save())
        self.written = [(s, p) for s, p in self.written if p != path and os.path.exists(p)] + [(step, path)]
        return path

    def write(self, module: FullModel, file_name: str, step: int, epoch: int,
              extra_metadata: Optional[Mapping[str, str]] = None) -> Optional[str]:
        """The model as ``file_name``'s stem plus the format's extension in the output folder."""
        name = os.path.splitext(file_name)[0] + self.saver.model_format.extension
        path = self.saver.output_dir / name

        def save() -> Path:
            full_model_files.save_model(self.models, path, self.saver.model_format, self.save_dtype,
                                        metadata=self.file_metadata(), epoch=epoch, global_step=step,
                                        source=self.saver.source)
            print(f"\nsaved {path}", flush=True)
            return path
        return self._saving(name, save, step)

    def on_step(self, module: FullModel, step: int, epoch: int) -> None:
        every = self.saver.save_every_n_steps
        if every and step % every == 0:
            self._saving(f"step {step}", lambda: self.saver.save_step(self.models, step, epoch - 1), step)

    def on_epoch_end(self, module: FullModel, step: int, epoch: int, is_last_epoch: bool) -> None:
        every = self.saver.save_every_n_epochs
        if every and epoch % every == 0 and not is_last_epoch:
            self._saving(f"epoch {epoch}", lambda: self.saver.save_epoch(self.models, epoch, step), step)

    def mark_abandoned(self, after_step: int) -> list[str]:
        """Rename what this run wrote after ``after_step`` (a rewind went back to it) with the
        ``-abandoned`` suffix; the new paths."""
        self.written, renamed = lora_files.rename_abandoned(self.written, after_step)
        return renamed
