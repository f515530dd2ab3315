"""Single checkpoint files: a streaming reader (``.safetensors`` / ``.ckpt``) and atomic writes.

``CheckpointReader`` reads one tensor at a time with plain file reads, so loading a
7 GB SDXL file never holds a second copy of it; ``save_single_file`` writes models in
the original (kohya/A1111) layout through ``library.checkpoint_keys``.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from library import atomic_files
from library import checkpoint_keys as ck
from library.errors import UserError, first_line

if TYPE_CHECKING:
    from library.models import StableDiffusionModels


# safetensors dtype names -> torch dtypes read with plain file reads (others go through safe_open).
_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointReader:
    """Key, shape and tensor access to one ``.safetensors`` (streamed) or ``.ckpt`` (memory-mapped) file.

    Every read error becomes a ``UserError`` naming ``flag`` and the file. A ``.safetensors``
    tensor is read with a plain file read into its own buffer, not through the memory map:
    pages of a map stay resident (``RssFile``) while the file is open, so reading a 7 GB
    SDXL file through it would add the whole file to the process's peak memory.
    """

    def __init__(self, path: Path, flag: str):
        self.path, self.flag = path, flag
        self._stack = contextlib.ExitStack()
        try:
            if path.suffix == ".safetensors":
                # safe_open validates the header and offsets; the data itself is read by _read_tensor.
                self._handle = self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
                self._state: Mapping[str, torch.Tensor] | None = None
                self._keys = list(self._handle.keys())
                self._file = self._stack.enter_context(open(path, "rb"))
                header_length = int.from_bytes(self._file.read(8), "little")
                self._header = json.loads(self._file.read(header_length))
                self._data_start = 8 + header_length
                self._scratch: torch.Tensor | None = None
            else:
                self._state = load_pickled_state_dict(path)
                self._keys = [k for k, v in self._state.items() if isinstance(v, torch.Tensor)]
        except (SafetensorError, OSError, RuntimeError, ValueError, EOFError) as error:
            self._stack.close()
            raise self._error(error) from error

    def _error(self, error: BaseException) -> UserError:
        return UserError(f"{self.flag}: {self.path} is not a readable checkpoint (corrupt or truncated?): "
                         f"{first_line(error)}")

    def keys(self) -> list[str]:
        return self._keys

    def shape(self, key: str) -> tuple[int, ...]:
        if self._state is not None:
            return tuple(self._state[key].shape)
        return tuple(self._handle.get_slice(key).get_shape())

    def get(self, key: str, transient: bool = False) -> torch.Tensor:
        """The tensor ``key`` as stored. ``transient``: it may share memory with the file or with a
        buffer reused by the next ``get`` (the caller copies it out), so reading allocates nothing."""
        try:
            if self._state is not None:
                # Clone so no parameter stays backed by the memory-mapped file.
                return self._state[key] if transient else self._state[key].clone()
            entry = self._header[key]
            if entry["dtype"] not in _SAFETENSORS_DTYPES:
                return self._handle.get_tensor(key)
            return self._read_tensor(entry, transient)
        except (SafetensorError, OSError, RuntimeError) as error:
            raise self._error(error) from error

    def _read_tensor(self, entry: Mapping[str, Any], transient: bool) -> torch.Tensor:
        begin, end = entry["data_offsets"]
        dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
        if transient:
            # One buffer of the largest tensor's size for the whole file: freed per-tensor
            # temporaries would leave holes in the heap that the fp32 weights cannot reuse.
            if self._scratch is None:
                largest = max(e["data_offsets"][1] - e["data_offsets"][0]
                              for k, e in self._header.items() if k != "__metadata__")
                self._scratch = torch.empty(largest, dtype=torch.uint8)
            tensor = self._scratch[:end - begin].view(dtype).view(entry["shape"])
        else:
            tensor = torch.empty(entry["shape"], dtype=dtype)
        if end == begin:
            return tensor
        buffer = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        self._file.seek(self._data_start + begin)
        if self._file.readinto(buffer) != end - begin:
            raise OSError(f"the file ends inside tensor data (offsets {begin}..{end})")
        return tensor

    def close(self) -> None:
        self._state = None
        self._scratch = None
        self._stack.close()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def is_safetensors(path: str | os.PathLike) -> bool:
    """Whether a file is named as safetensors (others: ``torch.save`` files such as ``.ckpt``/``.pt``)."""
    return Path(path).suffix.lower() == ".safetensors"


TORCH_SAVE_MAGIC = (b"PK\x03\x04", b"\x80")
"""How ``torch.save`` files start: a zip archive (since torch 1.6), or a pickle (protocol 2+) for legacy ones."""


def load_pickled_state_dict(path: Path) -> Mapping[str, torch.Tensor]:
    """The tensors of a ``torch.save`` file (``.ckpt``/``.pt``; a top-level ``state_dict`` entry is
    unwrapped), read with ``weights_only`` so that no code is unpickled. OSError when it holds other objects."""
    import pickle

    with open(path, "rb") as file:
        start = file.read(4)
    if not start.startswith(TORCH_SAVE_MAGIC):
        raise OSError(f"not a torch.save (.ckpt/.pt) file nor safetensors: it starts with the bytes {start!r}")
    try:
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as error:
            if "mmap" not in str(error):  # legacy (non-zip) files cannot be memory-mapped
                raise
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        # weights_only refuses arbitrary pickled objects; we never unpickle code.
        # torch's message advises weights_only=False, i.e. running the file's code: never pass that on.
        raise OSError("it holds more than tensors (pickled objects) and is not read, as loading those could run "
                      "code; convert it to .safetensors with a tool you trust") from error
    if isinstance(checkpoint, dict) and isinstance(checkpoint.get("state_dict"), dict):
        checkpoint = checkpoint["state_dict"]
    if not isinstance(checkpoint, dict):
        raise OSError("it does not hold a state dict")
    return checkpoint


SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt")
"""What :func:`save_single_file` writes (kohya's merge and fine-tuning scripts write both)."""

SAVE_DTYPES: dict[Optional[str], Optional[torch.dtype]] = {
    None: None, "float": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
"""``--save_precision`` -> the dtype floating tensors are saved in (None: as they are in memory)."""


def add_save_precision_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """kohya's ``--save_precision`` (one definition for the trainers; ``what``: what is saved)."""
    parser.add_argument("--save_precision", type=str, default=None, choices=[None, "float", "fp16", "bf16"],
                        help=f"dtype of the saved {what} (default: the training dtype: float32, or fp16/bf16 with "
                             f"--full_fp16/--full_bf16)")


@dataclass(frozen=True)
class SourceCheckpoint:
    """What kohya carries from the base model's single file into a checkpoint it writes.

    ``extra_tensors``: original-layout tensors the models have no place for (SD 1.x/2.x: all of
    them, e.g. EMA weights, noise-schedule buffers, SD2's unused last text layer; SDXL: only
    OpenCLIP's ``logit_scale``), written unchanged (not cast); ``epoch`` / ``global_step``: the
    counters of a ``.ckpt`` base, added to the run's in a ``.ckpt`` output.
    """

    extra_tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    epoch: int = 0
    global_step: int = 0


SDXL_CARRIED_KEYS = (ck.SDXL_OPEN_CLIP_PREFIX + "logit_scale",)
"""What kohya's SDXL saver keeps of the base file (sdxl_model_util: ``logit_scale`` only)."""


def read_source_checkpoint(path: str | os.PathLike, models: StableDiffusionModels,
                           flag: str = "--pretrained_model_name_or_path") -> SourceCheckpoint:
    """The :class:`SourceCheckpoint` of the base model ``path`` for ``models`` (loaded from it); an
    empty one for a diffusers folder (kohya then writes only the models' tensors)."""
    path = Path(path)
    if path.is_dir():
        return SourceCheckpoint()
    maps = ck.checkpoint_key_maps(models.kind, models.unet, models.vae, models.text_encoders)
    mapped = {rule.original for _, key_map in maps.values() for rule in key_map.rules}
    with CheckpointReader(path, flag) as reader:
        if models.kind == "sdxl":
            keys = [key for key in SDXL_CARRIED_KEYS if key in set(reader.keys())]
        else:
            keys = [key for key in reader.keys() if key not in mapped]
        extra = {key: reader.get(key) for key in keys}
    counters = _ckpt_counters(path) if not is_safetensors(path) else {}
    return SourceCheckpoint(extra, **counters)


def _ckpt_counters(path: Path) -> dict[str, int]:
    """``epoch`` / ``global_step`` of a ``torch.save`` checkpoint when they are integers (kohya: "sometimes not int")."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, OSError, EOFError, ValueError):
        return {}
    counters = {}
    if isinstance(checkpoint, dict):
        for name in ("epoch", "global_step"):
            value = checkpoint.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                counters[name] = value
    return counters


def original_layout_tensors(models: StableDiffusionModels, dtype: torch.dtype | None = None
                            ) -> dict[str, torch.Tensor]:
    """Every tensor of ``models`` under its original (single-file) name, floating ones cast to ``dtype``
    (default: as they are; uncast tensors are the models' own, not copies)."""
    tensors: dict[str, torch.Tensor] = {}
    maps = ck.checkpoint_key_maps(models.kind, models.unet, models.vae, models.text_encoders)
    for model, key_map in maps.values():
        state = model.state_dict()
        for rule in key_map.rules:
            tensor = rule.to_original([state[name].detach() for name in rule.diffusers])
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            tensors[rule.original] = tensor.contiguous()
    return tensors


def save_single_file(models: StableDiffusionModels, path: str | os.PathLike, dtype: torch.dtype | None = None,
                     metadata: Mapping[str, str] | None = None, *, epoch: int = 0, global_step: int = 0,
                     source: SourceCheckpoint | None = None) -> None:
    """Write ``models`` as one original-layout file, atomically, as kohya's savers do
    (``model_util`` / ``sdxl_model_util.save_stable_diffusion_checkpoint``).

    ``.safetensors``: the tensors and ``metadata``. ``.ckpt``: ``torch.save`` of ``{"state_dict": ...,
    "epoch": ..., "global_step": ...}`` (no metadata), the counters ``epoch`` / ``global_step`` plus the
    base file's (``source``). ``dtype`` casts the models' floating tensors (default: keep); the
    ``source``'s extra tensors are added unchanged. The file is written to a temporary name in the same
    folder and renamed over ``path`` (``library.atomic_files``), so readers never see a partial file.
    """
    path = Path(path)
    if path.suffix not in SINGLE_FILE_SUFFIXES:
        raise UserError(f"{path}: single files are written as {' or '.join(SINGLE_FILE_SUFFIXES)} only")
    source = source or SourceCheckpoint()
    tensors = dict(source.extra_tensors)
    tensors.update(original_layout_tensors(models, dtype))
    if path.suffix == ".ckpt":
        needed = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
        with atomic_files.writing_file(path, needed) as temporary:
            torch.save({"state_dict": tensors, "epoch": epoch + source.epoch,
                        "global_step": global_step + source.global_step}, temporary)
        return
    atomic_save_safetensors(tensors, path, metadata)


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a file, read in 1 MiB pieces (hashlib.file_digest needs Python 3.11)."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def atomic_save_safetensors(tensors: Mapping[str, torch.Tensor], path: Path,
                            metadata: Mapping[str, str] | None = None) -> None:
    """``safetensors.torch.save_file`` to a temporary beside ``path``, renamed over it
    (``library.atomic_files``; streamed to disk, never a second copy in memory), its header made
    canonical (:func:`sort_header_in_place`: equal contents give equal bytes)."""
    needed = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    with atomic_files.writing_file(path, needed) as temporary:
        save_file(dict(tensors), str(temporary), metadata=dict(metadata) if metadata else None)
        sort_header_in_place(temporary)


def sort_header_in_place(path: str | os.PathLike) -> None:
    """Rewrite a safetensors file's header JSON with sorted keys, in place. safetensors writes the
    metadata map in a per-process random order, and a resumed run must reproduce an uninterrupted
    run's checkpoint byte for byte (``networks.network_base.canonical_safetensors_bytes`` does the same
    for LoRA files in memory). The header is compact JSON either way, so its length is unchanged and the
    tensor data (offsets relative to the header's end) is not touched."""
    with open(path, "r+b") as file:
        length = int.from_bytes(file.read(8), "little")
        header = file.read(length)
        content = header.rstrip(b" ")
        canonical = json.dumps(json.loads(content), sort_keys=True, separators=(",", ":")).encode("utf-8")
        if len(canonical) != len(content):  # not safetensors' compact JSON: leave the file as written
            return
        file.seek(8)
        file.write(canonical)


def iter_model_tensors(models: StableDiffusionModels) -> Iterator[tuple[str, torch.Tensor]]:
    """(component.name, tensor) for every state-dict tensor of every component (tests, merge tools)."""
    components = {"unet": models.unet, "vae": models.vae}
    for index, encoder in enumerate(models.text_encoders):
        components["text_encoder" if index == 0 else f"text_encoder_{index + 1}"] = encoder
    for component, model in components.items():
        for name, tensor in model.state_dict().items():
            yield f"{component}.{name}", tensor
