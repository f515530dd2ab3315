"""Load SDXL / SD1.x / SD2.x from a diffusers folder or a single file, and write single files.

Everything is loaded in fp32 on the CPU; callers move and cast. A single file
(``.safetensors`` or ``.ckpt``) is read tensor by tensor into models built on
the meta device, so peak memory is one model plus one tensor, never a second
copy of the state dict. The architecture comes from ``--model_config_dir`` or
from the configs shipped in ``library/model_configs``; names are translated by
``library.checkpoint_keys``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from library import checkpoint_keys as ck
from library.checkpoint_keys import KeyMap, ModelKind, TensorRule
from library.errors import UserError

if TYPE_CHECKING:  # heavy imports stay lazy so `--help` is fast
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTokenizer

MODEL_CONFIGS_DIR = Path(__file__).resolve().parent / "model_configs"
SHIPPED_CONFIG_NAMES: dict[str, str] = {"sdxl": "sdxl_base", "sd1": "sd15", "sd2": "sd2_v"}

# Where kohya takes each tokenizer from: (hub repo, subfolder in the repo, pad token).
# With --tokenizer_cache_dir kohya keeps them in DIR/<repo with "/" -> "_">.
TOKENIZER_SOURCES: dict[str, list[tuple[str, str | None, str | None]]] = {
    "sd1": [("openai/clip-vit-large-patch14", None, None)],
    "sd2": [("stabilityai/stable-diffusion-2", "tokenizer", "!")],
    "sdxl": [("openai/clip-vit-large-patch14", None, None),
             ("laion/CLIP-ViT-bigG-14-laion2B-39B-b160k", None, "!")],
}
CLIP_MAX_LENGTH = 77
SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")
_VAE_TOP_LEVEL = ("encoder.", "decoder.", "quant_conv.", "post_quant_conv.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the model-loading options (kohya names)."""
    group = parser.add_argument_group("model")
    group.add_argument("--pretrained_model_name_or_path", type=str, default=None,
                       help="base model: a diffusers model folder or a single .safetensors/.ckpt file "
                            "(default: none, required)")
    group.add_argument("--v2", action="store_true",
                       help="the base model is Stable Diffusion 2.x (default: off, SD1.x)")
    group.add_argument("--vae", type=str, default=None,
                       help="replace the model's VAE: a diffusers VAE folder or a single-file VAE "
                            "(default: the model's own)")
    group.add_argument("--tokenizer_cache_dir", type=str, default=None,
                       help="folder of CLIP tokenizers in kohya's layout (openai_clip-vit-large-patch14, ...); "
                            "build one offline with tools/build_clip_tokenizers.py (default: none)")
    group.add_argument("--model_config_dir", type=str, default=None,
                       help="diffusers-format folder of configs (no weights) describing a single-file model's "
                            "architecture (default: the shipped config for SDXL, SD1.5 or SD2.x 768-v)")
    group.add_argument("--lowram", action="store_true",
                       help="kohya's low-RAM loading: put the weights on the training device (GPU) as they are "
                            "read instead of building the models in host RAM first, for machines with more VRAM "
                            "than RAM; single files then never hold a model in RAM. No effect on CPU "
                            "(default: off)")
    group.add_argument("--highvram", action="store_true",
                       help="kohya's high-VRAM mode: keep the CUDA allocator's cache after caching latents and "
                            "text encoder outputs instead of emptying it. No effect on CPU (default: off)")


def load_device(args: argparse.Namespace) -> torch.device:
    """Where ``load_models`` should put the weights: this process's training device with ``--lowram``, else CPU.

    Call after the ``Accelerator`` exists (its process state picks the device).
    """
    if not getattr(args, "lowram", False):
        return torch.device("cpu")
    from accelerate import PartialState

    return PartialState().device


@dataclass
class StableDiffusionModels:
    """One base model, fp32 on CPU. SDXL: two tokenizers and text encoders (CLIP-L, then bigG with projection)."""

    kind: ModelKind
    tokenizers: list[CLIPTokenizer]
    text_encoders: list[torch.nn.Module]
    vae: AutoencoderKL
    unet: UNet2DConditionModel
    scheduler_config: dict[str, Any]
    name: str

    @property
    def is_sdxl(self) -> bool:
        return self.kind == "sdxl"


def model_kind(*, sdxl: bool, v2: bool) -> ModelKind:
    """The model kind selected by the entry script (``sdxl``) and ``--v2``."""
    if sdxl and v2:
        raise UserError("--v2: SDXL models take no --v2 (it selects Stable Diffusion 2.x)")
    return "sdxl" if sdxl else "sd2" if v2 else "sd1"


def shipped_config_dir(kind: ModelKind) -> Path:
    """The architecture config folder shipped for ``kind``."""
    return MODEL_CONFIGS_DIR / SHIPPED_CONFIG_NAMES[kind]


def load_models_from_args(args: argparse.Namespace, *, sdxl: bool) -> StableDiffusionModels:
    """``load_models`` driven by the options of ``add_arguments``."""
    if not args.pretrained_model_name_or_path:
        raise UserError("--pretrained_model_name_or_path is required: a diffusers model folder "
                        "or a .safetensors/.ckpt file")
    return load_models(args.pretrained_model_name_or_path, sdxl=sdxl, v2=args.v2,
                       model_config_dir=args.model_config_dir, tokenizer_cache_dir=args.tokenizer_cache_dir,
                       vae_path=args.vae, device=load_device(args))


def load_models(path: str | os.PathLike, *, sdxl: bool, v2: bool = False,
                model_config_dir: str | os.PathLike | None = None,
                tokenizer_cache_dir: str | os.PathLike | None = None,
                vae_path: str | os.PathLike | None = None,
                device: torch.device | str | None = None) -> StableDiffusionModels:
    """Load tokenizers, text encoders, VAE, UNet and scheduler config, fp32 on CPU, in eval mode.

    ``device`` (``--lowram``, see ``load_device``): put the weights there instead; a single
    file's tensors go there one at a time, a diffusers folder's components one at a time.

    ``path`` is a diffusers folder (components via ``from_pretrained``, offline;
    ``model_config_dir`` is not used) or a single file (architecture and
    tokenizers from ``model_config_dir``, else the shipped configs).
    ``vae_path`` replaces the VAE (see ``load_vae``); ``tokenizer_cache_dir``
    is kohya's tokenizer cache (see ``load_tokenizers``). Raises ``UserError``
    for a missing/corrupt path, a checkpoint of another kind, missing,
    unexpected or misshapen tensors, or unavailable tokenizers.
    """
    kind = model_kind(sdxl=sdxl, v2=v2)
    flag = "--pretrained_model_name_or_path"
    path = Path(path)
    if not path.exists():
        raise UserError(f"{flag}: {path} does not exist; give a diffusers model folder or a "
                        ".safetensors/.ckpt file (hub ids are not downloaded)")
    keep_vae = vae_path is None
    if path.is_dir():
        unet, vae, text_encoders, vae_config, scheduler_config = _load_diffusers_folder(path, kind, keep_vae, device)
        tokenizer_dir: Path | None = path
    else:
        if model_config_dir is not None:
            _check_config_dir(Path(model_config_dir), kind)
        config_dir = Path(model_config_dir) if model_config_dir is not None else shipped_config_dir(kind)
        unet, vae, text_encoders, vae_config = _load_single_file(path, kind, config_dir, keep_vae, device)
        scheduler_config = _read_json(config_dir / "scheduler" / "scheduler_config.json", "--model_config_dir")
        tokenizer_dir = Path(model_config_dir) if model_config_dir is not None else None
    if vae is None:
        vae = load_vae(vae_path, vae_config=vae_config)
        if device is not None:
            vae.to(device)
    tokenizers = load_tokenizers(kind, model_dir=tokenizer_dir, tokenizer_cache_dir=tokenizer_cache_dir)
    name = path.name if path.is_dir() else path.stem
    return StableDiffusionModels(kind, tokenizers, text_encoders, vae, unet, scheduler_config, name)


# ---------------------------------------------------------------------------
# Diffusers folders
# ---------------------------------------------------------------------------

def _load_diffusers_folder(folder: Path, kind: ModelKind, keep_vae: bool, device: torch.device | str | None = None):
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    flag = "--pretrained_model_name_or_path"
    index = _read_json(folder / "model_index.json", flag,
                       missing="is a folder but not a diffusers model (no model_index.json)")
    if kind == "sdxl" and "text_encoder_2" not in index:
        raise UserError(f"{flag}: {folder} is not an SDXL model (no text_encoder_2 in model_index.json); "
                        "use train_network.py for SD1.x/2.x")
    if kind != "sdxl" and "text_encoder_2" in index:
        raise UserError(f"{flag}: {folder} is an SDXL model; train it with sdxl_train_network.py")
    if kind != "sdxl":
        # SD2.x UNets project into attention with Linear layers, SD1.x with 1x1 convs.
        unet_config = _read_json(folder / "unet" / "config.json", flag)
        if bool(unet_config.get("use_linear_projection")) != (kind == "sd2"):
            hint = "drop --v2" if kind == "sd2" else "pass --v2"
            raise UserError(f"{flag}: {folder} is an SD{'1' if kind == 'sd2' else '2'}.x model; {hint}")

    def load(cls, subfolder: str, **kwargs):
        sub = folder / subfolder
        if not sub.is_dir():
            raise UserError(f"{flag}: {folder} has no {subfolder}/ folder")
        variant = "fp16" if _only_fp16_weights(sub) else None
        try:
            model = cls.from_pretrained(folder, subfolder=subfolder, local_files_only=True, variant=variant, **kwargs)
            return model.to(device) if device is not None else model
        except (OSError, ValueError, RuntimeError, SafetensorError) as error:
            raise UserError(f"{flag}: cannot load {sub}: {_first_line(error)}") from error

    unet = load(UNet2DConditionModel, "unet", torch_dtype=torch.float32).eval()
    vae = load(AutoencoderKL, "vae", torch_dtype=torch.float32).eval() if keep_vae else None
    vae_config = dict(vae.config) if vae is not None else _read_json(folder / "vae" / "config.json", flag)
    text_encoders = [load(CLIPTextModel, "text_encoder", dtype=torch.float32).eval()]
    if kind == "sdxl":
        text_encoders.append(load(CLIPTextModelWithProjection, "text_encoder_2", dtype=torch.float32).eval())
    scheduler_file = folder / "scheduler" / "scheduler_config.json"
    if not scheduler_file.is_file():
        scheduler_file = shipped_config_dir(kind) / "scheduler" / "scheduler_config.json"
    return unet, vae, text_encoders, vae_config, _read_json(scheduler_file, flag)


def _only_fp16_weights(folder: Path) -> bool:
    names = [p.name for p in folder.iterdir()]
    weights = [n for n in names if n.endswith((".safetensors", ".bin"))]
    return bool(weights) and all(".fp16." in n for n in weights)


# ---------------------------------------------------------------------------
# Single files
# ---------------------------------------------------------------------------

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
                self._state = _load_pickled_state_dict(path)
                self._keys = [k for k, v in self._state.items() if isinstance(v, torch.Tensor)]
        except (SafetensorError, OSError, RuntimeError, ValueError, EOFError) as error:
            self._stack.close()
            raise self._error(error) from error

    def _error(self, error: BaseException) -> UserError:
        return UserError(f"{self.flag}: {self.path} is not a readable checkpoint (corrupt or truncated?): "
                         f"{_first_line(error)}")

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


def _load_pickled_state_dict(path: Path) -> Mapping[str, torch.Tensor]:
    import pickle

    try:
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as error:
            if "mmap" not in str(error):  # legacy (non-zip) files cannot be memory-mapped
                raise
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        # weights_only refuses arbitrary pickled objects; we never unpickle code.
        raise OSError(f"it holds more than tensors and cannot be read safely; convert it to .safetensors "
                      f"({_first_line(error)})") from error
    if isinstance(checkpoint, dict) and isinstance(checkpoint.get("state_dict"), dict):
        checkpoint = checkpoint["state_dict"]
    if not isinstance(checkpoint, dict):
        raise OSError("it does not hold a state dict")
    return checkpoint


def detect_checkpoint_kind(keys: Sequence[str]) -> ModelKind | None:
    """Which kind of model a single file holds, from its key names; ``None`` if it has no SD UNet."""
    key_set = set(keys)
    if any(k.startswith(ck.SDXL_OPEN_CLIP_PREFIX) for k in keys) or f"{ck.UNET_PREFIX}label_emb.0.0.weight" in key_set:
        return "sdxl"
    if any(k.startswith(ck.SD2_OPEN_CLIP_PREFIX) for k in keys):
        return "sd2"
    if any(k.startswith(ck.SD1_CLIP_PREFIX) for k in keys):
        return "sd1"
    return None  # no text encoder: SD1 and SD2 UNets differ only in shapes, left to the shape check


def _check_checkpoint_kind(keys: Sequence[str], kind: ModelKind, path: Path, flag: str) -> None:
    if not any(k.startswith(ck.UNET_PREFIX) for k in keys):
        raise UserError(f"{flag}: {path} is not a Stable Diffusion checkpoint (no tensors under {ck.UNET_PREFIX})")
    found = detect_checkpoint_kind(keys)
    if found is None or found == kind:
        return
    if found == "sdxl":
        raise UserError(f"{flag}: {path} is an SDXL checkpoint; train it with sdxl_train_network.py")
    if kind == "sdxl":
        raise UserError(f"{flag}: {path} is an SD{'2' if found == 'sd2' else '1'}.x checkpoint, not SDXL; "
                        "use train_network.py" + (" with --v2" if found == "sd2" else ""))
    if found == "sd2":
        raise UserError(f"{flag}: {path} is an SD2.x checkpoint; pass --v2")
    raise UserError(f"{flag}: {path} is an SD1.x checkpoint; drop --v2")


def _check_config_dir(config_dir: Path, kind: ModelKind) -> None:
    needed = ["unet/config.json", "vae/config.json", "text_encoder/config.json", "scheduler/scheduler_config.json"]
    if kind == "sdxl":
        needed.append("text_encoder_2/config.json")
    if not config_dir.is_dir():
        raise UserError(f"--model_config_dir: {config_dir} is not a folder; give a diffusers-format config folder")
    for relative in needed:
        if not (config_dir / relative).is_file():
            raise UserError(f"--model_config_dir: {config_dir} has no {relative}; a {kind} config folder needs "
                            + ", ".join(needed))


def build_empty_models(kind: ModelKind, config_dir: Path, *, with_vae: bool = True
                       ) -> tuple[UNet2DConditionModel, AutoencoderKL | None, list[torch.nn.Module], dict[str, Any]]:
    """UNet, VAE (or ``None``), text encoders of ``kind`` from ``config_dir`` on the meta device, and the VAE config.

    Parameters are meta tensors (no memory); buffers are real.
    """
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    flag = "--model_config_dir"
    unet_config = _read_json(config_dir / "unet" / "config.json", flag)
    vae_config = _read_json(config_dir / "vae" / "config.json", flag)
    encoder_classes = [CLIPTextModel] + ([CLIPTextModelWithProjection] if kind == "sdxl" else [])
    encoder_configs = []
    for index in range(len(encoder_classes)):
        sub = "text_encoder" if index == 0 else f"text_encoder_{index + 1}"
        encoder_configs.append(CLIPTextConfig(**_read_json(config_dir / sub / "config.json", flag)))
    # Buffers stay real (include_buffers=False): CLIP's position_ids are not in any file.
    with init_empty_weights(include_buffers=False):
        unet = UNet2DConditionModel.from_config(unet_config)
        vae = AutoencoderKL.from_config(vae_config) if with_vae else None
        text_encoders = [cls(config) for cls, config in zip(encoder_classes, encoder_configs)]
    return unet, vae, text_encoders, vae_config


def _load_single_file(path: Path, kind: ModelKind, config_dir: Path, keep_vae: bool,
                      device: torch.device | str | None = None):
    flag = "--pretrained_model_name_or_path"
    if not path.is_file():
        raise UserError(f"{flag}: {path} is not a file or folder")
    with CheckpointReader(path, flag) as reader:
        _check_checkpoint_kind(reader.keys(), kind, path, flag)
        unet, vae, text_encoders, vae_config = build_empty_models(kind, config_dir, with_vae=keep_vae)
        try:
            maps = ck.checkpoint_key_maps(kind, unet, vae, text_encoders)
        except KeyError as error:
            raise UserError(f"--model_config_dir: the architecture in {config_dir} is not supported: "
                            f"{error}") from error
        _stream_into(reader, list(maps.values()), config_hint=f"configs in {config_dir}", device=device)
    return unet, vae, text_encoders, vae_config


def _stream_into(reader: CheckpointReader, components: list[tuple[torch.nn.Module, KeyMap]],
                 config_hint: str, device: torch.device | str | None = None) -> None:
    """Fill every tensor of each (model, key map) from ``reader``, one tensor at a time, fp32 on ``device`` (CPU).

    All names and shapes are checked before any data is read, so a wrong file
    fails fast. Keys outside every component's prefix are skipped (EMA copies,
    noise-schedule buffers, other components).
    """
    flag, path = reader.flag, reader.path
    components = sorted(components, key=lambda item: len(item[1].prefix), reverse=True)
    plan: list[tuple[str, torch.nn.Module, TensorRule]] = []
    unexpected: list[str] = []
    present: set[str] = set()
    for key in reader.keys():
        for model, key_map in components:
            if key.startswith(key_map.prefix):
                rule = key_map.by_original.get(key)
                if rule is not None:
                    plan.append((key, model, rule))
                    present.add(key)
                elif not key_map.ignore(key):
                    unexpected.append(key)
                break
    missing = [rule.original for _, key_map in components for rule in key_map.rules if rule.original not in present]
    if missing:
        raise UserError(f"{flag}: {path} lacks {len(missing)} tensor(s) the model needs, first: {missing[0]} "
                        f"(architecture from {config_hint}; --model_config_dir sets it)")
    if unexpected:
        raise UserError(f"{flag}: {path} has {len(unexpected)} tensor(s) the architecture has no place for, "
                        f"first: {unexpected[0]} (architecture from {config_hint}; --model_config_dir sets it)")
    meta_states = {id(model): model.state_dict() for model, _ in components}
    for key, model, rule in plan:
        expected = tuple(rule.to_original([meta_states[id(model)][n] for n in rule.diffusers]).shape)
        found = reader.shape(key)
        if found != expected and not (rule.transform == "conv1x1" and found == expected[:2]):
            raise UserError(f"{flag}: {path}: {key} has shape {list(found)} but the architecture expects "
                            f"{list(expected)} (architecture from {config_hint}; --model_config_dir sets it)")
    del meta_states
    for key, model, rule in plan:
        for name, value in zip(rule.diffusers, rule.to_diffusers(reader.get(key, transient=True))):
            # A fresh fp32 tensor on the target device, copied (and cast) from the transient read.
            _assign(model, name, torch.empty(value.shape, dtype=torch.float32, device=device or "cpu").copy_(value))
    for model, _ in components:
        leftovers = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        if leftovers:  # a rule table gap, not a user mistake
            raise RuntimeError(f"{type(model).__name__}.{leftovers[0]} was not loaded from {path}")
        model.eval()


def _assign(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace the (meta) parameter or buffer ``name`` of ``model`` by ``value``."""
    module_name, _, attribute = name.rpartition(".")
    module = model.get_submodule(module_name)
    if attribute in module._parameters:
        old = module._parameters[attribute]
        module._parameters[attribute] = torch.nn.Parameter(value, requires_grad=old.requires_grad)
    elif attribute in module._buffers:
        module._buffers[attribute] = value
    else:
        raise KeyError(name)


# ---------------------------------------------------------------------------
# VAE
# ---------------------------------------------------------------------------

def load_vae(path: str | os.PathLike, *, vae_config: Mapping[str, Any], flag: str = "--vae") -> AutoencoderKL:
    """An ``AutoencoderKL`` (fp32, CPU, eval) from a diffusers folder or a single file.

    Folder: a VAE folder (``config.json`` + weights) or a model folder with
    ``vae/``; its own config wins. Single file: a full checkpoint
    (``first_stage_model.*``), a VAE in original names (``encoder.down.0...``)
    or in diffusers names; the architecture is ``vae_config`` (the base model's
    VAE config, so the latent scaling factor matches the base model).
    """
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL

    path = Path(path)
    if not path.exists():
        raise UserError(f"{flag}: {path} does not exist; give a diffusers VAE folder or a .safetensors/.ckpt file")
    if path.is_dir():
        subfolder = "vae" if (path / "vae" / "config.json").is_file() else None
        if subfolder is None and not (path / "config.json").is_file():
            raise UserError(f"{flag}: {path} is a folder without config.json or vae/config.json")
        try:
            return AutoencoderKL.from_pretrained(path, subfolder=subfolder, local_files_only=True,
                                                 torch_dtype=torch.float32).eval()
        except (OSError, ValueError, RuntimeError, SafetensorError) as error:
            raise UserError(f"{flag}: cannot load a VAE from {path}: {_first_line(error)}") from error
    with CheckpointReader(path, flag) as reader:
        keys = reader.keys()
        with init_empty_weights(include_buffers=False):
            vae = AutoencoderKL.from_config(dict(vae_config))
        if any(k.startswith(ck.VAE_PREFIX) for k in keys):
            key_map = ck.vae_key_map(vae)
        elif any(k.startswith("encoder.down.") for k in keys):
            original = ck.vae_key_map(vae, prefix="")
            key_map = KeyMap("", original.rules, lambda key: not key.startswith(_VAE_TOP_LEVEL))
        elif any(k.startswith("encoder.down_blocks.") for k in keys):
            rules = tuple(TensorRule(name, (name,)) for name in vae.state_dict())
            key_map = KeyMap("", rules, lambda key: not key.startswith(_VAE_TOP_LEVEL))
        else:
            raise UserError(f"{flag}: {path} holds no VAE weights (no encoder/decoder tensors)")
        _stream_into(reader, [(vae, key_map)], config_hint="the base model's VAE config")
    return vae


# ---------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------

def _hub_offline() -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def load_tokenizers(kind: ModelKind, *, model_dir: str | os.PathLike | None = None,
                    tokenizer_cache_dir: str | os.PathLike | None = None) -> list[CLIPTokenizer]:
    """The CLIP tokenizer(s) of ``kind``, max length 77.

    Looked up in order: ``model_dir/tokenizer`` (``tokenizer_2``), then
    ``tokenizer_cache_dir/<kohya name>``, then the hub repo kohya uses (only
    when online; the result is then saved into ``tokenizer_cache_dir`` like
    kohya does). SDXL tokenizer 2 and SD2's tokenizer pad with ``"!"``.
    """
    from transformers import CLIPTokenizer

    tokenizers = []
    for index, (repo, hub_subfolder, pad_token) in enumerate(TOKENIZER_SOURCES[kind]):
        local_name = "tokenizer" if index == 0 else f"tokenizer_{index + 1}"
        cache_name = repo.replace("/", "_")
        candidates = []
        if model_dir is not None:
            candidates.append((Path(model_dir) / local_name, "--pretrained_model_name_or_path/--model_config_dir"))
        if tokenizer_cache_dir is not None:
            candidates.append((Path(tokenizer_cache_dir) / cache_name, "--tokenizer_cache_dir"))
        tokenizer = None
        for folder, flag in candidates:
            if folder.is_dir():
                try:
                    tokenizer = CLIPTokenizer.from_pretrained(folder, local_files_only=True)
                except (OSError, ValueError) as error:
                    raise UserError(f"{flag}: cannot load a CLIP tokenizer from {folder}: "
                                    f"{_first_line(error)}") from error
                break
        if tokenizer is None:
            tokenizer = _tokenizer_from_hub(repo, hub_subfolder, cache_name, tokenizer_cache_dir)
        if tokenizer.model_max_length > 1_000_000:  # a bare vocab.json/merges.txt folder has no limit set
            tokenizer.model_max_length = CLIP_MAX_LENGTH
        if pad_token is not None:
            tokenizer = set_pad_token(tokenizer, pad_token)
        tokenizers.append(tokenizer)
    return tokenizers


def set_pad_token(tokenizer: CLIPTokenizer, pad_token: str) -> CLIPTokenizer:
    """``tokenizer`` padding with ``pad_token`` while still tokenizing that character in prompts as text.

    open_clip pads SDXL's second prompt (and SD2's) with id 0, ``"!"``, yet reads
    ``"!!"`` in a prompt as ordinary BPE. transformers 5 registers a configured
    pad token as a special token and cuts it out of the text, so
    ``"masterpiece!!"`` would lose its tokens. A tokenizer in that state is
    rebuilt from its own vocab and merges; the pad token is then set through
    the attribute, which does not register it. Returns the (possibly new) tokenizer.
    """
    from transformers import CLIPTokenizer

    own_specials = {tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token}
    if pad_token in tokenizer.get_added_vocab() and pad_token not in own_specials:
        model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
        merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
        tokenizer = CLIPTokenizer(vocab=model["vocab"], merges=merges, model_max_length=tokenizer.model_max_length)
    tokenizer.pad_token = pad_token
    return tokenizer


def _tokenizer_from_hub(repo: str, subfolder: str | None, cache_name: str,
                        tokenizer_cache_dir: str | os.PathLike | None):
    from transformers import CLIPTokenizer

    build_hint = ("build the tokenizers offline with `python tools/build_clip_tokenizers.py --out DIR` "
                  "and pass --tokenizer_cache_dir DIR")
    if tokenizer_cache_dir is None:
        where = "no --tokenizer_cache_dir was given"
    else:
        where = f"--tokenizer_cache_dir {tokenizer_cache_dir} has no {cache_name}/ folder"
    if _hub_offline():
        raise UserError(f"--tokenizer_cache_dir: no tokenizer for {repo} ({where}, hub is offline); {build_hint}")
    try:
        tokenizer = CLIPTokenizer.from_pretrained(repo, subfolder=subfolder)
    except (OSError, ValueError) as error:
        raise UserError(f"--tokenizer_cache_dir: no tokenizer for {repo} ({where}) and the hub failed: "
                        f"{_first_line(error)}; {build_hint}") from error
    if tokenizer_cache_dir is not None:
        tokenizer.save_pretrained(Path(tokenizer_cache_dir) / cache_name)
    return tokenizer


# ---------------------------------------------------------------------------
# Writing single files
# ---------------------------------------------------------------------------

def save_single_file(models: StableDiffusionModels, path: str | os.PathLike, dtype: torch.dtype | None = None,
                     metadata: Mapping[str, str] | None = None) -> None:
    """Write ``models`` as one original-layout ``.safetensors`` file, atomically.

    ``dtype`` casts floating tensors (default: keep). The file is written to a
    temporary name in the same folder and renamed over ``path``, so readers
    never see a partial file.
    """
    path = Path(path)
    if path.suffix != ".safetensors":
        raise UserError(f"{path}: single files are written as .safetensors only")
    tensors: dict[str, torch.Tensor] = {}
    maps = ck.checkpoint_key_maps(models.kind, models.unet, models.vae, models.text_encoders)
    for model, key_map in maps.values():
        state = model.state_dict()
        for rule in key_map.rules:
            tensor = rule.to_original([state[name].detach() for name in rule.diffusers])
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            tensors[rule.original] = tensor.contiguous()
    atomic_save_safetensors(tensors, path, metadata)


def atomic_save_safetensors(tensors: Mapping[str, torch.Tensor], path: Path,
                            metadata: Mapping[str, str] | None = None) -> None:
    """``safetensors.torch.save_file`` to a temp file beside ``path``, then ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(dict(tensors), str(temporary), metadata=dict(metadata) if metadata else None)
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()


# ---------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------

def _read_json(path: Path, flag: str, missing: str | None = None) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except FileNotFoundError:
        if missing is not None:
            raise UserError(f"{flag}: {path.parent} {missing}") from None
        raise UserError(f"{flag}: {path} does not exist") from None
    except (OSError, ValueError) as error:
        raise UserError(f"{flag}: {path} is not readable JSON: {_first_line(error)}") from error


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def iter_model_tensors(models: StableDiffusionModels) -> Iterator[tuple[str, torch.Tensor]]:
    """(component.name, tensor) for every state-dict tensor of every component (tests, merge tools)."""
    components = {"unet": models.unet, "vae": models.vae}
    for index, encoder in enumerate(models.text_encoders):
        components["text_encoder" if index == 0 else f"text_encoder_{index + 1}"] = encoder
    for component, model in components.items():
        for name, tensor in model.state_dict().items():
            yield f"{component}.{name}", tensor
