"""Saving a trained full model as kohya's fine-tuning scripts do (``sdxl_train.py``, ``train_db.py``,
``fine_tune.py``): formats, dtypes, file names, metadata.

* ``--save_model_as ckpt|safetensors``: one original-layout file (``library.checkpoint_files.save_single_file``:
  kohya's key names; ``.ckpt`` = ``torch.save({"state_dict", "epoch", "global_step"})``; ``.safetensors``
  with the model spec metadata of a checkpoint, :func:`checkpoint_metadata`).
* ``--save_model_as diffusers|diffusers_safetensors``: a diffusers pipeline folder
  (:func:`save_diffusers_folder`; ``.bin`` weights, or ``.safetensors`` with ``diffusers_safetensors``
  or ``--use_safetensors``).
* Without ``--save_model_as``: the base model's own form (single file or folder), safetensors only
  with ``--use_safetensors`` (kohya's rule, :meth:`ModelFormat.resolve`).
* ``--save_precision float|fp16|bf16`` casts the saved floating tensors (default: as trained). kohya's
  SD 1.x diffusers saver ignores it; here it applies to every format.

Names (kohya's ``train_util``): ``<output_name or "epoch">-<epoch:06d>``, ``<output_name or "at">-step<step:08d>``,
``<output_name or "last">``, plus ``.safetensors`` / ``.ckpt`` (none for folders). Every file and folder is
written through ``library.atomic_files``: a save killed half-way leaves the previous one.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional

import torch
from safetensors.torch import save_file

from library import atomic_files
from library.checkpoint_files import SAVE_DTYPES, SourceCheckpoint, add_save_precision_argument, save_single_file
from library.errors import UserError
from library.lora_files import epoch_to_remove, step_to_remove
from library.lora_metadata import modelspec_metadata
from library.models import StableDiffusionModels

SAVE_MODEL_AS_CHOICES = ("ckpt", "safetensors", "diffusers", "diffusers_safetensors")
DEFAULT_EPOCH_NAME, DEFAULT_STEP_NAME, DEFAULT_LAST_NAME = "epoch", "at", "last"
"""kohya's names when ``--output_name`` is not given (``train_util.DEFAULT_*_NAME``)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The full-model saving options (kohya's ``add_sd_saving_arguments`` and ``--save_precision``)."""
    parser.add_argument("--save_model_as", type=str, default=None, choices=[None, *SAVE_MODEL_AS_CHOICES],
                        help="format of the saved model: ckpt or safetensors (one original-layout file, as "
                             "A1111/ComfyUI load), diffusers or diffusers_safetensors (a diffusers folder). "
                             "Default: the base model's form")
    parser.add_argument("--use_safetensors", action="store_true",
                        help="write safetensors when --save_model_as does not say (a single-file base: "
                             ".safetensors instead of .ckpt; a folder: .safetensors weights instead of .bin)")
    add_save_precision_argument(parser, "model")


@dataclass(frozen=True)
class ModelFormat:
    """How a full model is saved: one original-layout file or a diffusers folder, safetensors or not."""

    single_file: bool
    safetensors: bool

    @classmethod
    def resolve(cls, save_model_as: Optional[str], use_safetensors: bool, base_is_single_file: bool) -> "ModelFormat":
        """kohya's rule: ``--save_model_as`` decides; without it the base model's form, and safetensors
        only with ``--use_safetensors`` (which also turns ``diffusers`` into safetensors weights)."""
        if save_model_as is None:
            return cls(single_file=base_is_single_file, safetensors=use_safetensors)
        if save_model_as not in SAVE_MODEL_AS_CHOICES:
            raise UserError(f"--save_model_as {save_model_as}: choose one of {', '.join(SAVE_MODEL_AS_CHOICES)}")
        return cls(single_file=save_model_as in ("ckpt", "safetensors"),
                   safetensors=use_safetensors or "safetensors" in save_model_as)

    @property
    def extension(self) -> str:
        """The file extension (``""`` for a folder)."""
        if not self.single_file:
            return ""
        return ".safetensors" if self.safetensors else ".ckpt"


def epoch_model_name(output_name: Optional[str], epoch: int, model_format: ModelFormat) -> str:
    """kohya's name of the model saved after epoch ``epoch`` (1-based): ``name-000003.safetensors``."""
    return f"{output_name or DEFAULT_EPOCH_NAME}-{epoch:06d}{model_format.extension}"


def step_model_name(output_name: Optional[str], step: int, model_format: ModelFormat) -> str:
    """kohya's name of the model saved at optimizer step ``step``: ``name-step00000500.safetensors``."""
    return f"{output_name or DEFAULT_STEP_NAME}-step{step:08d}{model_format.extension}"


def final_model_name(output_name: Optional[str], model_format: ModelFormat) -> str:
    """kohya's name of the model saved at the end: ``name.safetensors`` (``last`` without a name)."""
    return f"{output_name or DEFAULT_LAST_NAME}{model_format.extension}"


def checkpoint_metadata(args: argparse.Namespace, model_kind: str, resolution_hw: tuple[int, int],
                        timestamp: float) -> dict[str, str]:
    """The metadata kohya writes into a ``.safetensors`` checkpoint: the model spec keys only (no ``ss_*``),
    architecture without ``/lora``, title ``--metadata_title`` or ``--output_name``. ``args`` needs
    ``output_name``, ``v_parameterization`` and the ``--metadata_*`` options."""
    return modelspec_metadata(args, model_kind, resolution_hw, timestamp, adapter=None)


def save_dtype(save_precision: Optional[str]) -> Optional[torch.dtype]:
    """``--save_precision`` as a dtype (None: save as trained)."""
    return SAVE_DTYPES[save_precision]


def save_model(models: StableDiffusionModels, path: str | os.PathLike, model_format: ModelFormat,
               dtype: Optional[torch.dtype] = None, *, metadata: Optional[Mapping[str, str]] = None,
               epoch: int = 0, global_step: int = 0, source: Optional[SourceCheckpoint] = None) -> None:
    """Write ``models`` to ``path`` in ``model_format``, floating tensors cast to ``dtype`` (None: as they are).

    Single files: ``metadata`` (safetensors only), kohya's ``epoch`` / ``global_step`` counters (``.ckpt``
    only; kohya passes the 1-based epoch at an epoch end, the 0-based current epoch at a step save and at
    the end) and the base file's ``source`` tensors and counters. Folders: see :func:`save_diffusers_folder`.
    """
    if models.vae is None or len(models.text_encoders) != (2 if models.is_sdxl else 1):
        # a programming error: a full fine-tune keeps the VAE and text encoders (on the CPU) to save them, as kohya
        raise ValueError("a full model is saved with its VAE and text encoders; the trainer freed them")
    if model_format.single_file:
        save_single_file(models, path, dtype, metadata if model_format.safetensors else None, epoch=epoch,
                         global_step=global_step, source=source)
    else:
        save_diffusers_folder(models, path, dtype, safetensors=model_format.safetensors)


def remove_model(path: str | os.PathLike) -> bool:
    """Remove a saved model, file or folder (kohya's ``--save_last_n_*`` rotation); False when it is not there."""
    path = Path(path)
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    else:
        return False
    return True


@dataclass
class ModelSaver:
    """Where and how a run saves its full model, as kohya's ``save_sd_model_on_epoch_end_or_stepwise`` /
    ``save_sd_model_on_train_end``: names, ``.ckpt`` counters, metadata, and the ``--save_last_n_*`` rotation
    (kohya's formulas, ``lora_files.step_to_remove`` / ``epoch_to_remove``). Whether a save is due is the
    loop's decision. ``metadata`` is called at each save (kohya stamps each file with its own date)."""

    output_dir: Path
    output_name: Optional[str]
    model_format: ModelFormat
    dtype: Optional[torch.dtype] = None
    metadata: Optional[Callable[[], Mapping[str, str]]] = None
    source: SourceCheckpoint = field(default_factory=SourceCheckpoint)
    save_every_n_epochs: Optional[int] = None
    save_every_n_steps: Optional[int] = None
    save_last_n_epochs: Optional[int] = None
    save_last_n_steps: Optional[int] = None

    def save_epoch(self, models: StableDiffusionModels, epoch: int, global_step: int) -> Path:
        """The save after epoch ``epoch`` (1-based); removes the epoch save that falls out of ``--save_last_n_epochs``."""
        path = self._save(models, epoch_model_name(self.output_name, epoch, self.model_format), epoch, global_step)
        old = epoch_to_remove(epoch, self.save_every_n_epochs or 1, self.save_last_n_epochs)
        if old is not None:
            self._remove(epoch_model_name(self.output_name, old, self.model_format))
        return path

    def save_step(self, models: StableDiffusionModels, global_step: int, epoch: int) -> Path:
        """The save at optimizer step ``global_step`` during epoch ``epoch`` (0-based, kohya's counter for these);
        removes the step save that falls out of ``--save_last_n_steps``."""
        path = self._save(models, step_model_name(self.output_name, global_step, self.model_format), epoch,
                          global_step)
        old = step_to_remove(global_step, self.save_every_n_steps or 1, self.save_last_n_steps)
        if old is not None:
            self._remove(step_model_name(self.output_name, old, self.model_format))
        return path

    def save_final(self, models: StableDiffusionModels, epoch: int, global_step: int) -> Path:
        """The model at the end (``epoch``: kohya passes the last epoch's 0-based number)."""
        return self._save(models, final_model_name(self.output_name, self.model_format), epoch, global_step)

    def _save(self, models: StableDiffusionModels, name: str, epoch: int, global_step: int) -> Path:
        path = Path(self.output_dir) / name
        metadata = self.metadata() if self.metadata is not None else None
        save_model(models, path, self.model_format, self.dtype, metadata=metadata, epoch=epoch,
                   global_step=global_step, source=self.source)
        print(f"saved {path}", flush=True)
        return path

    def _remove(self, name: str) -> None:
        path = Path(self.output_dir) / name
        if remove_model(path):
            print(f"removed old model {path}", flush=True)


# A folder's weight files, by (library, safetensors): what diffusers' and transformers' from_pretrained look for.
_WEIGHT_FILES = {("diffusers", True): "diffusion_pytorch_model.safetensors",
                 ("diffusers", False): "diffusion_pytorch_model.bin",
                 ("transformers", True): "model.safetensors", ("transformers", False): "pytorch_model.bin"}


def save_diffusers_folder(models: StableDiffusionModels, path: str | os.PathLike, dtype: Optional[torch.dtype] = None,
                          *, safetensors: bool = True) -> None:
    """Write ``models`` as a diffusers pipeline folder (``StableDiffusionXLPipeline`` / ``StableDiffusionPipeline``,
    scheduler Euler for SDXL and DDIM for SD 1.x/2.x as kohya's savers), atomically (``atomic_files.writing_folder``).

    Each component's config and weights are written from its state dict, cast to ``dtype`` tensor by tensor, so
    the models in memory are neither cast nor copied whole (kohya's SDXL saver casts the pipeline in place).
    """
    from diffusers import DDIMScheduler, EulerDiscreteScheduler

    from library.sampling import build_pipeline

    scheduler_class = EulerDiscreteScheduler if models.is_sdxl else DDIMScheduler
    scheduler = scheduler_class.from_config(models.scheduler_config)
    pipeline = build_pipeline(models, scheduler)
    components: dict[str, torch.nn.Module] = {"unet": models.unet, "vae": models.vae}
    for index, encoder in enumerate(models.text_encoders):
        components["text_encoder" if index == 0 else f"text_encoder_{index + 1}"] = encoder
    needed = sum(tensor.numel() * (dtype.itemsize if dtype is not None and tensor.is_floating_point()
                                   else tensor.element_size())
                 for model in components.values() for tensor in model.state_dict().values())
    with atomic_files.writing_folder(path, needed) as temporary:
        pipeline.save_config(temporary)  # model_index.json: the pipeline class and its components
        scheduler.save_config(temporary / "scheduler")
        for index, tokenizer in enumerate(models.tokenizers):
            tokenizer.save_pretrained(temporary / ("tokenizer" if index == 0 else f"tokenizer_{index + 1}"))
        for name, model in components.items():
            _save_component(model, temporary / name, dtype, safetensors)


def _save_component(model: torch.nn.Module, folder: Path, dtype: Optional[torch.dtype], safetensors: bool) -> None:
    """One component's ``config.json`` and weights file, as its library's ``from_pretrained`` reads them."""
    folder.mkdir(parents=True)
    library = "transformers" if hasattr(model.config, "to_json_string") else "diffusers"
    state = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        state[name] = tensor.contiguous()
    if library == "transformers":
        config = json.loads(model.config.to_json_string())
        if dtype is not None or "dtype" in config:  # what transformers' "auto" dtype loads it as
            config["dtype"] = str(dtype or next(iter(state.values())).dtype).removeprefix("torch.")
        config.pop("_name_or_path", None)
        (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    else:
        model.save_config(folder)
    weights = folder / _WEIGHT_FILES[library, safetensors]
    if safetensors:
        save_file(state, str(weights), metadata={"format": "pt"})
    else:
        torch.save(state, weights)
