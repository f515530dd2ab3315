"""One model's weights read one tensor at a time, by their diffusers names, from a single file or a
diffusers folder, without building the model (the offline tools that compare two models keep one
module's weights in memory, not a model).

A single file (``.safetensors``/``.ckpt``, original layout) is read through ``library.checkpoint_keys``'
key maps, built on the meta-device models of the architecture (``library.model_loading.build_empty_models``);
a diffusers folder through its components' weight files (``unet/``, ``text_encoder/``, ``text_encoder_2/``;
sharded or ``fp16`` variants too). Components are named as in ``checkpoint_keys.checkpoint_key_maps``.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Optional, Sequence

import torch

from library import checkpoint_keys as ck
from library.checkpoint_files import CheckpointReader
from library.checkpoint_keys import ModelKind, TensorRule
from library.errors import UserError, first_line
from library.model_loading import detect_checkpoint_kind

KIND_NAMES = {"sdxl": "SDXL", "sd2": "SD2.x", "sd1": "SD1.x"}
COMPONENTS = ("unet", "text_encoder", "text_encoder_2")
_TEXT_MODEL = "text_model."  # transformers 4 names CLIP weights text_model.*, transformers 5 does not


def model_kind_of(path: Path, flag: str) -> ModelKind:
    """SDXL/SD2/SD1 of a single file (from its keys) or a diffusers folder (from its JSON files).
    UserError naming ``flag`` for a missing path, a folder that is not a diffusers model, a file
    that is not a Stable Diffusion checkpoint."""
    if path.is_dir():
        index = _read_json(path, "model_index.json", flag, "is a folder but not a diffusers model (no model_index.json)")
        if "text_encoder_2" in index:
            return "sdxl"
        unet_config = _read_json(path, "unet/config.json", flag, "is not a diffusers model (no unet/config.json)")
        return "sd2" if unet_config.get("use_linear_projection") else "sd1"
    if not path.is_file():
        raise UserError(f"{flag} {path} does not exist; give a .safetensors/.ckpt file or a diffusers model folder")
    with CheckpointReader(path, flag) as reader:
        kind = detect_checkpoint_kind(reader.keys())
    if kind is None:
        raise UserError(f"{flag} {path}: not a Stable Diffusion checkpoint with text encoders "
                        f"(no SD1/SD2/SDXL text encoder keys)")
    return kind


def _read_json(folder: Path, name: str, flag: str, missing: str) -> dict:
    path = folder / name
    if not path.is_file():
        raise UserError(f"{flag} {folder} {missing}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise UserError(f"{flag}: cannot read {path}: {first_line(error)}") from error


class ModelWeights:
    """``get``/``shape`` of one model's tensors by (component, diffusers name); a context manager.

    ``models``: (unet, text encoders) on the meta device, the architecture a single file is read
    as (their state dict names are the names asked for). Tensors come back as stored (dtype),
    fresh (not shared with the next read).
    """

    def __init__(self, path: Path, flag: str, kind: ModelKind, models: tuple[torch.nn.Module, Sequence[torch.nn.Module]]):
        self.path, self.flag = path, flag
        self._stack = contextlib.ExitStack()
        self._rules: dict[str, dict[str, TensorRule]] = {}
        self._where: dict[str, dict[str, tuple[CheckpointReader, str]]] = {}
        self._last: tuple[Optional[TensorRule], list[torch.Tensor]] = (None, [])
        try:
            if path.is_dir():
                self._open_folder(kind)
            else:
                self._open_file(kind, models)
        except BaseException:
            self._stack.close()
            raise

    def _open_file(self, kind: ModelKind, models: tuple[torch.nn.Module, Sequence[torch.nn.Module]]) -> None:
        reader = self._stack.enter_context(CheckpointReader(self.path, self.flag))
        keys = set(reader.keys())
        unet, text_encoders = models
        try:
            maps = ck.checkpoint_key_maps(kind, unet, None, text_encoders)
        except KeyError as error:
            raise UserError(f"--model_config_dir: this architecture is not supported: {error}") from error
        for component, (_, key_map) in maps.items():
            self._rules[component] = dict(key_map.by_diffusers)
            self._where[component] = {rule.original: (reader, rule.original) for rule in key_map.rules
                                      if rule.original in keys}

    def _open_folder(self, kind: ModelKind) -> None:
        for component in COMPONENTS[:3 if kind == "sdxl" else 2]:
            folder = self.path / component
            files = []
            if folder.is_dir():
                files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
            plain = [file for file in files if ".fp16." not in file.name]  # a variant only when it is all there is
            if not files:
                raise UserError(f"{self.flag} {self.path} has no weights in {component}/ "
                                f"(.safetensors or .bin); give a diffusers model folder with weights")
            located: dict[str, tuple[CheckpointReader, str]] = {}
            for file in plain or files:
                reader = self._stack.enter_context(CheckpointReader(file, self.flag))
                located.update({key: (reader, key) for key in reader.keys()})
            self._where[component] = located

    def _locate(self, component: str, name: str) -> tuple[Optional[TensorRule], Optional[tuple[CheckpointReader, str]]]:
        where = self._where[component]
        if component in self._rules:
            rule = self._rules[component].get(name)
            return rule, where.get(rule.original) if rule is not None else None
        for candidate in (name, _TEXT_MODEL + name, name.removeprefix(_TEXT_MODEL)):
            if candidate in where:
                return None, where[candidate]
        return None, None

    def _missing(self, component: str, name: str) -> UserError:
        return UserError(f"{self.flag} {self.path} has no tensor for {component} {name}: the models have "
                         f"different architectures (or --model_config_dir does not describe this file)")

    def shape(self, component: str, name: str) -> tuple[int, ...]:
        """The shape ``name`` has in the model (from the file's header, no data read)."""
        rule, found = self._locate(component, name)
        if found is None:
            raise self._missing(component, name)
        reader, key = found
        stored = reader.shape(key)
        if rule is None:
            return stored
        try:
            parts = rule.to_diffusers(torch.empty(stored, device="meta"))
        except ValueError as error:
            raise UserError(f"{self.flag} {self.path}: {first_line(error)}") from error
        return tuple(parts[rule.diffusers.index(name)].shape)

    def get(self, component: str, name: str) -> torch.Tensor:
        """The tensor ``name`` as stored (its dtype), a fresh copy."""
        rule, found = self._locate(component, name)
        if found is None:
            raise self._missing(component, name)
        reader, key = found
        if rule is None:
            return reader.get(key)
        if self._last[0] is not rule:  # q, k and v come from one fused tensor: read it once
            self._last = (rule, [part.clone() for part in rule.to_diffusers(reader.get(key, transient=True))])
        return self._last[1][rule.diffusers.index(name)]

    def close(self) -> None:
        self._last = (None, [])
        self._stack.close()

    def __enter__(self) -> "ModelWeights":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
